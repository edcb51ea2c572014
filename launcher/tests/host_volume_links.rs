//! A host volume that reaches out of its share through a link is refused by `capk-launcher run`
//! before QEMU starts: the attack of a guest that made `escape -> /` in its share (a real host
//! symlink under 9p `security_model=none`) and a second machine that names `<share>/escape`.
//! The refusal comes in the launcher's preflight, before the network, the disks or QEMU are
//! touched, so this needs neither root nor QEMU: the QEMU named here does not exist.

use std::os::unix::fs::symlink;
use std::path::Path;
use std::process::Command;

/// Runs `capk-launcher run` with one host volume `flag=data=<path>` and a node image that is
/// an empty file; returns (success, stderr).
fn launcher_with_volume(work: &Path, flag: &str, path: &Path) -> (bool, String) {
    let image = work.join("image.qcow2");
    std::fs::write(&image, b"").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_capk-launcher"))
        .arg("run")
        .args(["--image", &image.display().to_string()])
        .arg(format!("--{flag}=data={}", path.display()))
        .args(["--qemu", "/nonexistent/qemu-system-x86_64"])
        .args(["--state-dir", &work.join("state").display().to_string()])
        .args(["--runtime-dir", &work.join("run").display().to_string()])
        .args(["--secret-dir", &work.join("secret").display().to_string()])
        .env("CAPK_LOG", "info")
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_link_out_of_the_share_is_refused_before_qemu_starts() {
    let work = tempfile::tempdir().unwrap();
    let share = work.path().join("capk-shares/team-a");
    std::fs::create_dir_all(share.join("data")).unwrap();
    // What the guest made over 9p with security_model=none, and a link inside the share.
    symlink("/", share.join("escape")).unwrap();
    symlink("data", share.join("alias")).unwrap();
    for flag in ["host-volume", "host-volume-readonly"] {
        for (path, link, target) in [
            (share.join("escape"), share.join("escape"), "/"),
            (share.join("escape/etc"), share.join("escape"), "/"),
            (share.join("alias"), share.join("alias"), "data"),
        ] {
            let (ok, stderr) = launcher_with_volume(work.path(), flag, &path);
            assert!(
                !ok,
                "--{flag} {}: the launcher went on:\n{stderr}",
                path.display()
            );
            let want = format!(
                "host volume data: {} is a symbolic link (to \"{target}\")",
                link.display()
            );
            assert!(
                stderr.contains(&want) && stderr.contains("never follow links"),
                "--{flag} {}: want {want:?} in:\n{stderr}",
                path.display()
            );
            // Refused in the preflight: no accelerator probed, no network, no disks, no QEMU.
            for later in ["accelerator chosen", "network planned", "starting qemu"] {
                assert!(
                    !stderr.contains(later),
                    "{later:?} after the refusal:\n{stderr}"
                );
            }
            assert!(
                !work.path().join("state").exists(),
                "the disks were made:\n{stderr}"
            );
        }
    }
    // The share's own directory passes the host volume check; the launcher stops later, at the
    // tun device, the host's network namespace or, at the latest, the empty node image, before
    // the network is touched.
    let (ok, stderr) = launcher_with_volume(work.path(), "host-volume", &share.join("data"));
    assert!(!ok);
    assert!(!stderr.contains("host volume"), "{stderr}");
}
