//! The supervisor as `hack/dev/lib.sh` runs it: a daemon that exits is restarted with back-off,
//! each exit a line of the log and counted; SIGTERM stops the daemon and the supervisor; the
//! daemon does not inherit the descriptors the supervisor's caller held.

use std::{
    path::Path,
    process::{Child, Command, Stdio},
    thread::sleep,
    time::{Duration, Instant},
};

const BIN: &str = env!("CARGO_BIN_EXE_capk-supervise");

fn start(run: &Path, name: &str, script: &str) -> Child {
    Command::new("sh")
        .arg("-c")
        // fd 7 stands for what a caller holds (a flock around `make dev-up`).
        .arg(format!(
            "exec 7>\"$CAPK_DEV_RUN/held\"; exec {BIN} {name} sh -c '{script}'"
        ))
        .env("CAPK_DEV_RUN", run)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap()
}

fn read(run: &Path, file: &str) -> String {
    std::fs::read_to_string(run.join(file)).unwrap_or_default()
}

fn until(what: &str, secs: u64, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(
            start.elapsed() < Duration::from_secs(secs),
            "timed out: {what}"
        );
        sleep(Duration::from_millis(50));
    }
}

fn alive(pid: &str) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .unwrap_or_default()
            .contains(") Z ")
}

#[test]
fn a_daemon_that_exits_is_restarted_with_back_off_and_each_exit_is_logged() {
    let run = tempfile::tempdir().unwrap();
    let sup = start(run.path(), "flaky", "exit 3");
    until("two restarts", 10, || {
        read(run.path(), "flaky.restarts") == "2"
    });
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(sup.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let out = sup.wait_with_output().unwrap();
    assert!(out.status.success(), "{:?}", out.status);
    let log = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = log.lines().collect();
    assert!(lines.len() >= 2, "{log}");
    assert!(
        lines[0].contains("supervise: flaky exited with status 3 after 0s; restart 1 in 1s"),
        "{log}"
    );
    assert!(lines[1].contains("restart 2 in 2s"), "{log}");
}

#[test]
fn sigterm_stops_the_daemon_and_then_the_supervisor() {
    let run = tempfile::tempdir().unwrap();
    let mut sup = start(
        run.path(),
        "steady",
        "ls /proc/$$/fd > \"$CAPK_DEV_RUN/fds\"; exec sleep 60",
    );
    until("the child's pid", 10, || {
        !read(run.path(), "steady.child").is_empty()
    });
    until("the child's descriptors", 10, || {
        !read(run.path(), "fds").is_empty()
    });
    let child = read(run.path(), "steady.child");
    assert!(alive(&child));
    // The daemon sees stdin, stdout, stderr and what it opened itself, not the caller's fd 7.
    let fds: Vec<String> = read(run.path(), "fds").lines().map(str::to_owned).collect();
    assert!(
        !fds.contains(&"7".to_owned()),
        "the daemon inherited fd 7: {fds:?}"
    );
    let started = Instant::now();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(sup.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let status = sup.wait().unwrap();
    assert!(status.success(), "{status:?}");
    assert!(started.elapsed() < Duration::from_secs(5));
    until("the daemon gone", 5, || !alive(&child));
    assert_eq!(read(run.path(), "steady.restarts"), "0");
}
