//! The machine Pod's `node-image` init container (host-cache mode) runs
//! `NODE_IMAGE_SCRIPT` with the launcher image's static busybox. Here the same script runs with
//! the host's busybox against temporary directories standing in for the node image, the MC
//! node's cache and the Pod's state directory: machine Pods starting together on one node copy
//! a node image once, and every one of them gets a link to the same complete copy.

use std::{path::Path, process::Command};

use anyhow::{Context, Result, bail};
use capk_controller::kvmmachine::node_image::NODE_IMAGE_SCRIPT;

fn busybox() -> Result<&'static str> {
    const BUSYBOX: &str = "/bin/busybox";
    if Path::new(BUSYBOX).is_file() {
        return Ok(BUSYBOX);
    }
    bail!(
        "{BUSYBOX} is missing: install Debian's busybox-static (hack/debian-packages.txt; .ci/run installs it)"
    )
}

/// Runs the init container's script: (exit success, stdout + stderr).
fn run(bb: &str, src: &Path, cache: &Path, link: &Path) -> Result<std::process::Child> {
    Ok(Command::new(bb)
        .args(["sh", "-c", NODE_IMAGE_SCRIPT, "node-image", bb])
        .arg(src)
        .arg(cache)
        .arg(link)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?)
}

#[test]
fn concurrent_machine_pods_copy_a_node_image_once() -> Result<()> {
    let bb = busybox()?;
    let dir = tempfile::tempdir()?;
    let image = dir.path().join("disk/image.qcow2");
    std::fs::create_dir_all(image.parent().unwrap())?;
    // 32 MiB of varied bytes: big enough that unlocked concurrent copies would overlap.
    let content: Vec<u8> = (0..32u32 << 20)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    std::fs::write(&image, &content)?;
    let cache = dir.path().join("cache");
    std::fs::create_dir(&cache)?;

    let pods: Vec<_> = (0..6)
        .map(|i| {
            let state = dir.path().join(format!("pod-{i}"));
            std::fs::create_dir(&state)?;
            let link = state.join("node-image");
            Ok((run(bb, &image, &cache, &link)?, link))
        })
        .collect::<Result<_>>()?;
    let mut copied = 0;
    let mut targets = Vec::new();
    for (child, link) in pods {
        let out = child.wait_with_output()?;
        let log = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "node-image failed: {log}");
        copied += log.matches("copied").count();
        targets.push(std::fs::read_link(&link).context("the Pod's node-image link")?);
    }
    assert_eq!(copied, 1, "the image was copied {copied} times");
    let target = &targets[0];
    assert!(targets.iter().all(|t| t == target), "{targets:?}");
    let digest = {
        let out = Command::new(bb).arg("sha256sum").arg(&image).output()?;
        String::from_utf8(out.stdout)?[..64].to_owned()
    };
    assert_eq!(
        target,
        &cache.join(format!("sha256-{digest}.img")),
        "the cache is keyed by the disk's sha256"
    );
    assert!(std::fs::read(target)? == content, "the cached copy differs");
    let leftovers: Vec<_> = std::fs::read_dir(&cache)?
        .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect::<Result<_, _>>()?;
    assert!(
        leftovers.iter().all(|n| !n.contains("partial")),
        "a partial copy was left behind: {leftovers:?}"
    );

    // A restarted Pod on the same node finds the copy; a new image version gets its own.
    let state = dir.path().join("pod-again");
    std::fs::create_dir(&state)?;
    let out = run(bb, &image, &cache, &state.join("node-image"))?.wait_with_output()?;
    assert!(String::from_utf8_lossy(&out.stdout).contains("is cached as"));
    std::fs::write(&image, b"another version")?;
    let out = run(bb, &image, &cache, &state.join("node-image"))?.wait_with_output()?;
    assert!(out.status.success());
    assert_ne!(&std::fs::read_link(state.join("node-image"))?, target);
    Ok(())
}

#[test]
fn a_node_image_without_the_disk_fails_with_its_path() -> Result<()> {
    let bb = busybox()?;
    let dir = tempfile::tempdir()?;
    let out = run(
        bb,
        &dir.path().join("disk/image.qcow2"),
        dir.path(),
        &dir.path().join("link"),
    )?
    .wait_with_output()?;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("disk/image.qcow2 is not in the node image"),
        "{err}"
    );
    Ok(())
}

#[test]
fn a_lock_left_by_a_killed_pod_is_broken() -> Result<()> {
    let bb = busybox()?;
    let dir = tempfile::tempdir()?;
    let image = dir.path().join("image.qcow2");
    std::fs::write(&image, b"disk")?;
    // A Pod killed mid-copy 20 minutes ago left its lock (and a partial file) behind.
    let lock = dir.path().join(".lock");
    std::fs::create_dir(&lock)?;
    let status = Command::new("touch")
        .args(["-d", "20 minutes ago"])
        .arg(&lock)
        .status()?;
    assert!(status.success());
    let out = run(bb, &image, dir.path(), &dir.path().join("link"))?.wait_with_output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("breaking a lock"), "{err}");
    assert_eq!(std::fs::read(dir.path().join("link"))?, b"disk");
    assert!(!lock.exists(), "the lock is released after the copy");
    Ok(())
}
