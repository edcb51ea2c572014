//! The generated scripts, run by a real bash: CABPK's success-file semantics hold, argv entries
//! arrive intact, and the heartbeat writes lines the launcher's parser reads.

mod support;

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use capk_bootstrap::heartbeat::{BootstrapState, HeartbeatLine};
use capk_bootstrap::overlay::{HEARTBEAT_SCRIPT, Heartbeat};
use capk_bootstrap::{BootstrapFormat, MachineOverlay, SUCCESS_FILE, convert, to_json};
use support::{facts, readable};

fn tempdir() -> std::path::PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    // Plain characters only: the path is pasted into shell lines unquoted.
    let dir = std::env::temp_dir().join(format!(
        "capk-bootstrap-test-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::SeqCst)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn script(config_json: &[u8], path: &str) -> String {
    let v = readable(config_json);
    v["storage"]["files"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["path"] == path)
        .unwrap_or_else(|| panic!("no {path}"))["contents"]["source"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// Converts a CABPK-shaped runcmd and runs the resulting script; returns (exit ok, files).
fn run_runcmd(dir: &Path, pre: &str) -> (bool, bool, bool) {
    let success = dir.join("bootstrap-success.complete");
    let post = dir.join("post");
    let kubeadm = dir.join("kubeadm-ran");
    let cc = format!(
        "#cloud-config\nruncmd:\n  - \"{pre}\"\n  - 'touch {k} && echo success > {s}'\n  - [touch, {p}]\n",
        k = kubeadm.display(),
        s = success.display(),
        p = post.display(),
    );
    let cfg = convert(BootstrapFormat::CloudConfig, cc.as_bytes(), &facts()).unwrap();
    let text = script(&to_json(&cfg).unwrap(), "/etc/capk/bootstrap/runcmd.sh");
    let status = Command::new("bash").arg("-c").arg(&text).status().unwrap();
    (status.success(), success.exists(), post.exists())
}

#[test]
fn success_file_is_written_only_when_every_command_before_it_succeeds() {
    let dir = tempdir();
    let (ok, success, post) = run_runcmd(&dir, "true");
    assert!(
        ok && success && post,
        "all commands ran: {ok} {success} {post}"
    );

    let dir = tempdir();
    let (ok, success, post) = run_runcmd(&dir, "false");
    assert!(!ok, "a failing pre-kubeadm command fails the unit");
    assert!(
        !success,
        "no success file after a failed pre-kubeadm command"
    );
    assert!(!post, "set -e stops before the post-kubeadm commands");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn kubeadm_failure_leaves_no_success_file() {
    let dir = tempdir();
    let success = dir.join("ok");
    // CABPK's line: `kubeadm … && echo success > FILE`; here kubeadm is `false`.
    let cc = format!(
        "#cloud-config\nruncmd:\n  - 'false && echo success > {}'\n",
        success.display()
    );
    let cfg = convert(BootstrapFormat::CloudConfig, cc.as_bytes(), &facts()).unwrap();
    let text = script(&to_json(&cfg).unwrap(), "/etc/capk/bootstrap/runcmd.sh");
    let _ = Command::new("bash").arg("-c").arg(&text).status().unwrap();
    assert!(!success.exists());
    assert!(text.contains("set -e\n"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn heartbeat_script_writes_parseable_lines() {
    let dir = tempdir();
    let overlay = MachineOverlay {
        hostname: "n1".into(),
        heartbeat: Some(Heartbeat {
            port_name: "org.capk.heartbeat".into(),
            interval_seconds: 1,
        }),
        ..Default::default()
    };
    let json = to_json(&overlay.fragment().unwrap()).unwrap();
    let port = dir.join("port");
    let done = dir.join("success");
    let text = script(&json, HEARTBEAT_SCRIPT)
        .replace(
            "/dev/virtio-ports/org.capk.heartbeat",
            &port.display().to_string(),
        )
        .replace(SUCCESS_FILE, &done.display().to_string());
    std::fs::write(&port, b"").unwrap();

    let mut child = Command::new("bash")
        .arg("-c")
        .arg(&text)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let read_lines = |want: usize| -> Vec<HeartbeatLine> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let lines: Vec<HeartbeatLine> = std::fs::read_to_string(&port)
                .unwrap()
                .lines()
                .map(|l| l.parse().unwrap())
                .collect();
            if lines.len() >= want || Instant::now() > deadline {
                return lines;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    let first = read_lines(1);
    std::fs::write(&done, b"success\n").unwrap();
    let later = read_lines(first.len() + 2);
    child.kill().unwrap();
    child.wait().unwrap();

    assert_eq!(first[0].bootstrap, BootstrapState::Pending);
    assert!(first[0].uptime_seconds > 0.0);
    assert_eq!(later.last().unwrap().bootstrap, BootstrapState::Done);
    let _ = std::fs::remove_dir_all(&dir);
}
