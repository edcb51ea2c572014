//! Launcher state, guest heartbeat and the pure probe verdicts.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use capk_bootstrap::heartbeat::{BootstrapState, HeartbeatLine};
use serde::{Deserialize, Serialize};
use tokio::io::BufReader;
use tokio::sync::Mutex;

use crate::line::{Frame, LineReader};
use crate::qemu::argv::{Accel, DiskAttachment};
use crate::qemu::qmp::VmStatus;

/// State shared by the tasks of a running launcher.
pub type SharedState = Arc<Mutex<LauncherState>>;

/// Longest line read from the guest's heartbeat port (a heartbeat is about 50 bytes); longer
/// lines are dropped and counted, so a guest flooding the port cannot grow the launcher.
pub const HEARTBEAT_LINE_MAX: usize = 4096;

/// Lifecycle phase of the machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Phase {
    /// Setting up network and disks.
    Preparing,
    /// QEMU started, QMP not yet answering.
    Starting,
    /// QEMU runs the guest.
    Running,
    /// SIGTERM received, ACPI powerdown sent.
    ShuttingDown,
    /// QEMU exited.
    Stopped,
}

/// Everything `status` reports and the probes judge.
#[derive(Debug, Clone)]
pub struct LauncherState {
    /// Phase.
    pub phase: Phase,
    /// Accelerator in use.
    pub accel: Option<Accel>,
    /// Pod IP handed to the VM.
    pub ip: Option<String>,
    /// VM MAC.
    pub mac: Option<String>,
    /// Machine role.
    pub role: String,
    /// Launcher start.
    pub started: Instant,
    /// Wall clock of the launcher start.
    pub started_wall: SystemTime,
    /// QEMU pid while it runs.
    pub qemu_pid: Option<u32>,
    /// Why QEMU is gone, once it is.
    pub qemu_exit: Option<String>,
    /// Last heartbeat line from the guest.
    pub last_heartbeat: Option<Instant>,
    /// The guest reported bootstrap success.
    pub bootstrap_succeeded: bool,
    /// Readiness fails when the last heartbeat is older than this.
    pub heartbeat_timeout: Duration,
    /// Disks attached.
    pub disks: Vec<DiskAttachment>,
    /// The guest apiserver's `/readyz`, when readiness requires it (control-plane machines).
    pub apiserver: Option<ApiserverReadyz>,
    /// Heartbeat-port lines longer than [`HEARTBEAT_LINE_MAX`], dropped.
    pub heartbeat_lines_too_long: u64,
    /// The guest's boot stopped in a shell (emergency or rescue mode), as its console said:
    /// [`console_boot_failure`] and the line. Cleared by the next heartbeat (the boot went on).
    pub guest_boot_failure: Option<String>,
}

/// The apiserver check of a control-plane machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiserverReadyz {
    /// Where it is checked (`https://<VM IP>:<port>/readyz`).
    pub url: String,
    /// The last answer: Ok, or why not.
    pub last: Option<Result<(), String>>,
}

impl LauncherState {
    /// Fresh state at launcher start.
    pub fn new(role: &str, heartbeat_timeout: Duration) -> Self {
        Self {
            phase: Phase::Preparing,
            accel: None,
            ip: None,
            mac: None,
            role: role.into(),
            started: Instant::now(),
            started_wall: SystemTime::now(),
            qemu_pid: None,
            qemu_exit: None,
            last_heartbeat: None,
            bootstrap_succeeded: false,
            heartbeat_timeout,
            disks: Vec::new(),
            apiserver: None,
            heartbeat_lines_too_long: 0,
            guest_boot_failure: None,
        }
    }
}

/// A probe's verdict: exit 0 or 1 with a one-line reason.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProbeResult {
    /// Healthy.
    pub ok: bool,
    /// One line for the kubelet's event.
    pub reason: String,
}

impl ProbeResult {
    fn ok(reason: impl Into<String>) -> Self {
        Self {
            ok: true,
            reason: reason.into(),
        }
    }
    fn fail(reason: impl Into<String>) -> Self {
        Self {
            ok: false,
            reason: reason.into(),
        }
    }
}

/// Liveness: QEMU alive, QMP answers, guest neither shut down nor panicked.
pub fn liveness(state: &LauncherState, qmp: Option<Result<VmStatus, String>>) -> ProbeResult {
    if let Some(exit) = &state.qemu_exit {
        return ProbeResult::fail(format!("qemu exited: {exit}"));
    }
    if state.phase == Phase::Preparing {
        return ProbeResult::ok("preparing network and disks");
    }
    match qmp {
        None => ProbeResult::ok("qemu starting, QMP not connected yet"),
        Some(Err(e)) => ProbeResult::fail(format!("QMP does not answer: {e}")),
        Some(Ok(s)) if s.is_dead() => ProbeResult::fail(format!("guest is {}", s.status)),
        Some(Ok(s)) => ProbeResult::ok(format!("qemu {}", s.status)),
    }
}

/// Readiness: a recent heartbeat and bootstrap success.
pub fn readiness(state: &LauncherState, now: Instant) -> ProbeResult {
    if let Some(exit) = &state.qemu_exit {
        return ProbeResult::fail(format!("qemu exited: {exit}"));
    }
    if let Some(failure) = &state.guest_boot_failure {
        return ProbeResult::fail(format!(
            "guest boot stopped in {failure}; the console (kubectl logs) says why"
        ));
    }
    let Some(beat) = state.last_heartbeat else {
        return ProbeResult::fail("no guest heartbeat yet");
    };
    let age = now.saturating_duration_since(beat);
    if age > state.heartbeat_timeout {
        return ProbeResult::fail(format!("last guest heartbeat {}s ago", age.as_secs()));
    }
    if !state.bootstrap_succeeded {
        return ProbeResult::fail("guest has not reported bootstrap success");
    }
    let apiserver = match &state.apiserver {
        None => "",
        Some(ApiserverReadyz { url, last: None }) => {
            return ProbeResult::fail(format!("apiserver {url} not checked yet"));
        }
        Some(ApiserverReadyz {
            url,
            last: Some(Err(e)),
        }) => return ProbeResult::fail(format!("apiserver {url} not ready: {e}")),
        Some(ApiserverReadyz {
            last: Some(Ok(())), ..
        }) => ", apiserver ready",
    };
    ProbeResult::ok(format!(
        "heartbeat {}s ago, bootstrap succeeded{apiserver}",
        age.as_secs()
    ))
}

/// `capk-launcher status` output.
#[derive(Debug, Clone, Serialize)]
pub struct StatusReport {
    /// Phase.
    pub phase: Phase,
    /// Accelerator.
    pub accel: Option<Accel>,
    /// VM IP.
    pub ip: Option<String>,
    /// VM MAC.
    pub mac: Option<String>,
    /// Role.
    pub role: String,
    /// Seconds since the launcher started.
    pub uptime_seconds: u64,
    /// QEMU pid.
    pub qemu_pid: Option<u32>,
    /// QEMU's run state.
    pub vm_status: Option<String>,
    /// Seconds since the last heartbeat.
    pub last_heartbeat_seconds_ago: Option<u64>,
    /// Bootstrap success seen.
    pub bootstrap_succeeded: bool,
    /// Disks.
    pub disks: Vec<DiskAttachment>,
    /// Heartbeat-port lines dropped for being too long (a misbehaving guest).
    pub heartbeat_lines_too_long: u64,
    /// The guest's boot stopped in emergency or rescue mode (what its console said), if it did.
    pub guest_boot_failure: Option<String>,
}

/// Builds the status report.
pub fn status_report(state: &LauncherState, vm: Option<&VmStatus>, now: Instant) -> StatusReport {
    StatusReport {
        phase: state.phase,
        accel: state.accel,
        ip: state.ip.clone(),
        mac: state.mac.clone(),
        role: state.role.clone(),
        uptime_seconds: now.saturating_duration_since(state.started).as_secs(),
        qemu_pid: state.qemu_pid,
        vm_status: vm.map(|v| v.status.clone()),
        last_heartbeat_seconds_ago: state
            .last_heartbeat
            .map(|b| now.saturating_duration_since(b).as_secs()),
        bootstrap_succeeded: state.bootstrap_succeeded,
        disks: state.disks.clone(),
        heartbeat_lines_too_long: state.heartbeat_lines_too_long,
        guest_boot_failure: state.guest_boot_failure.clone(),
    }
}

/// Applies one line from the heartbeat port (format owned by capk-bootstrap, which writes the
/// guest side). Returns false for a line that is not a heartbeat.
pub fn record_heartbeat(state: &mut LauncherState, line: &str, now: Instant) -> bool {
    let Ok(beat) = line.parse::<HeartbeatLine>() else {
        return false;
    };
    let done = beat.bootstrap == BootstrapState::Done;
    if done && !state.bootstrap_succeeded {
        tracing::info!(
            guest.uptime_seconds = beat.uptime_seconds,
            "guest reported bootstrap success"
        );
    }
    state.bootstrap_succeeded = done;
    state.last_heartbeat = Some(now);
    if let Some(failure) = state.guest_boot_failure.take() {
        tracing::info!(was = %failure, "guest heartbeat again: its boot went on");
    }
    true
}

/// Applies one frame read from the heartbeat port: a line as [`record_heartbeat`] does, an
/// over-long one is counted (and logged at 1, 2, 4, 8, ... so a flood does not flood the log).
pub fn record_frame(state: &mut LauncherState, frame: &Frame, now: Instant) {
    match frame {
        Frame::Line(bytes) => {
            let line = String::from_utf8_lossy(bytes);
            if !record_heartbeat(state, &line, now) {
                tracing::debug!(line = %line.chars().take(120).collect::<String>(), "ignored heartbeat port line");
            }
        }
        Frame::TooLong(bytes) => {
            state.heartbeat_lines_too_long += 1;
            let n = state.heartbeat_lines_too_long;
            if n.is_power_of_two() {
                tracing::warn!(
                    line.bytes = bytes,
                    lines_dropped = n,
                    max = HEARTBEAT_LINE_MAX,
                    "dropped an over-long line from the guest's heartbeat port"
                );
            }
        }
    }
}

/// Reads the heartbeat socket QEMU serves, reconnecting, and records what the guest says.
pub async fn follow_heartbeat(path: std::path::PathBuf, state: SharedState) {
    loop {
        if let Ok(stream) = tokio::net::UnixStream::connect(&path).await {
            let mut lines = LineReader::new(BufReader::new(stream), HEARTBEAT_LINE_MAX);
            while let Ok(Some(frame)) = lines.next_frame().await {
                record_frame(&mut *state.lock().await, &frame, Instant::now());
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// What a console line says about a boot that stopped in a shell instead of reaching its units:
/// systemd's emergency or rescue mode (its sulogin shell prints "You are in emergency mode"), or
/// dracut's emergency shell in the initramfs (Ignition failing there: "Entering emergency
/// mode"). `None` for every other line.
pub fn console_boot_failure(line: &str) -> Option<&'static str> {
    const MARKERS: [(&str, &str); 3] = [
        ("You are in emergency mode", "emergency mode"),
        ("Entering emergency mode", "emergency mode"),
        ("You are in rescue mode", "rescue mode"),
    ];
    MARKERS
        .iter()
        .find(|(marker, _)| line.contains(marker))
        .map(|(_, what)| *what)
}

/// Applies one console line: a boot failure is recorded (and logged once).
pub fn record_console_line(state: &mut LauncherState, line: &[u8]) {
    let text = String::from_utf8_lossy(line);
    let Some(what) = console_boot_failure(&text) else {
        return;
    };
    let said: String = text
        .chars()
        .filter(|c| !c.is_control())
        .take(200)
        .collect::<String>()
        .trim()
        .to_owned();
    let failure = format!("{what} (console: {said:?})");
    if state.guest_boot_failure.as_ref() != Some(&failure) {
        tracing::warn!(failure = %failure, "the guest's boot stopped in a shell: its units will not run");
        state.guest_boot_failure = Some(failure);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn running() -> LauncherState {
        let mut s = LauncherState::new("worker", Duration::from_secs(90));
        s.phase = Phase::Running;
        s
    }

    fn vm(status: &str) -> Option<Result<VmStatus, String>> {
        Some(Ok(VmStatus {
            running: status == "running",
            status: status.into(),
        }))
    }

    #[test]
    fn liveness_fails_when_qemu_died_qmp_is_silent_or_guest_panicked() {
        assert!(liveness(&running(), vm("running")).ok);
        assert_eq!(
            liveness(&running(), vm("guest-panicked")),
            ProbeResult::fail("guest is guest-panicked")
        );
        assert!(!liveness(&running(), Some(Err("connection reset".into()))).ok);
        let mut dead = running();
        dead.qemu_exit = Some("killed by signal 9".into());
        assert_eq!(
            liveness(&dead, None).reason,
            "qemu exited: killed by signal 9"
        );
    }

    #[test]
    fn readiness_needs_fresh_heartbeat_and_bootstrap_success() {
        let now = Instant::now();
        let mut s = running();
        assert_eq!(readiness(&s, now).reason, "no guest heartbeat yet");
        s.last_heartbeat = Some(now);
        assert_eq!(
            readiness(&s, now).reason,
            "guest has not reported bootstrap success"
        );
        s.bootstrap_succeeded = true;
        assert!(readiness(&s, now).ok);
        let later = now + Duration::from_secs(120);
        assert_eq!(
            readiness(&s, later),
            ProbeResult::fail("last guest heartbeat 120s ago")
        );
    }

    #[test]
    fn control_plane_readiness_also_needs_apiserver_readyz() {
        let now = Instant::now();
        let mut s = running();
        s.last_heartbeat = Some(now);
        s.bootstrap_succeeded = true;
        let url = "https://10.244.1.5:6443/readyz".to_string();
        s.apiserver = Some(ApiserverReadyz {
            url: url.clone(),
            last: None,
        });
        assert_eq!(
            readiness(&s, now),
            ProbeResult::fail(format!("apiserver {url} not checked yet"))
        );
        s.apiserver.as_mut().unwrap().last = Some(Err("connect: refused".into()));
        assert_eq!(
            readiness(&s, now),
            ProbeResult::fail(format!("apiserver {url} not ready: connect: refused"))
        );
        s.apiserver.as_mut().unwrap().last = Some(Ok(()));
        assert_eq!(
            readiness(&s, now),
            ProbeResult::ok("heartbeat 0s ago, bootstrap succeeded, apiserver ready")
        );
        // Bootstrap comes first: no apiserver before kubeadm ran.
        s.bootstrap_succeeded = false;
        assert_eq!(
            readiness(&s, now).reason,
            "guest has not reported bootstrap success"
        );
    }

    #[test]
    fn heartbeat_lines_set_liveness_and_bootstrap_state() {
        let mut s = running();
        let now = Instant::now();
        assert!(!record_heartbeat(&mut s, "hello", now));
        assert_eq!(s.last_heartbeat, None);
        assert!(record_heartbeat(
            &mut s,
            "capk-heartbeat/1 bootstrap=pending uptime=3.2",
            now
        ));
        assert!(!s.bootstrap_succeeded);
        assert_eq!(s.last_heartbeat, Some(now));
        assert!(record_heartbeat(
            &mut s,
            "capk-heartbeat/1 bootstrap=done uptime=9.0\n",
            now
        ));
        assert!(s.bootstrap_succeeded);
    }

    #[test]
    fn a_boot_stopped_in_a_shell_fails_readiness_until_the_guest_beats_again() {
        let now = Instant::now();
        let mut s = running();
        s.last_heartbeat = Some(now);
        s.bootstrap_succeeded = true;
        for line in [
            "[  OK  ] Started \u{1b}[0;1;39mcontainerd.service\u{1b}[0m - containerd container runtime.",
            "kubelet: emergency-mode is not a word here",
        ] {
            record_console_line(&mut s, line.as_bytes());
        }
        assert_eq!(s.guest_boot_failure, None);
        assert!(readiness(&s, now).ok);
        record_console_line(
            &mut s,
            b"\rYou are in emergency mode. After logging in, type \"journalctl -xb\" to view\r",
        );
        let r = readiness(&s, now);
        assert!(!r.ok);
        assert!(
            r.reason.starts_with(
                "guest boot stopped in emergency mode (console: \"You are in emergency mode."
            ) && r.reason.ends_with("; the console (kubectl logs) says why"),
            "{}",
            r.reason
        );
        assert_eq!(
            status_report(&s, None, now).guest_boot_failure,
            s.guest_boot_failure
        );
        assert_eq!(
            console_boot_failure(
                "[  181.2] dracut: Entering emergency mode. Exit the shell to continue."
            ),
            Some("emergency mode")
        );
        assert_eq!(
            console_boot_failure("You are in rescue mode. After logging in, type ..."),
            Some("rescue mode")
        );
        // Somebody continued the boot: the heartbeat unit runs again.
        assert!(record_heartbeat(
            &mut s,
            "capk-heartbeat/1 bootstrap=done uptime=300.0",
            now
        ));
        assert_eq!(s.guest_boot_failure, None);
        assert!(readiness(&s, now).ok);
    }

    /// A guest that floods the heartbeat port with a 16 MiB line: the launcher reads through it
    /// with a bounded buffer, counts it, and still takes the heartbeat on the next line.
    #[tokio::test]
    async fn an_endless_line_on_the_heartbeat_port_is_dropped_and_the_next_beat_counts() {
        use tokio::io::AsyncWriteExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("heartbeat.sock");
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        let state: SharedState = Arc::new(Mutex::new(running()));
        let follower = tokio::spawn(follow_heartbeat(path, state.clone()));
        let (mut guest, _) = listener.accept().await.unwrap();
        let junk = vec![b'#'; 64 * 1024];
        for _ in 0..256 {
            guest.write_all(&junk).await.unwrap();
        }
        guest
            .write_all(b"\ncapk-heartbeat/1 bootstrap=done uptime=7.0\n")
            .await
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !state.lock().await.bootstrap_succeeded {
            assert!(
                Instant::now() < deadline,
                "the heartbeat after the flood was lost"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let report = status_report(&*state.lock().await, None, Instant::now());
        assert_eq!(report.heartbeat_lines_too_long, 1);
        assert!(report.last_heartbeat_seconds_ago.is_some());
        follower.abort();
    }
}
