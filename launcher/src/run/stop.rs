//! Supervising QEMU until it ends, and stopping the guest: SIGTERM or SIGINT press the ACPI
//! power button (again and again) and QEMU is killed after the grace period.

use std::time::Duration;

use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::Notify;

use crate::cli::RunArgs;
use crate::control::SharedQmp;
use crate::health::{Phase, SharedState};
use crate::qemu::qmp::Qmp;
use crate::supervise::{QemuExit, Reaper};

use super::RunError;

/// SIGTERM and SIGINT listeners, installed first thing so that a stop request during setup is
/// kept (PID 1 would otherwise ignore it) and acted on once QEMU runs.
pub(super) struct StopSignals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl StopSignals {
    pub(super) fn install() -> Result<Self, RunError> {
        let sig = |k| signal(k).map_err(|e| RunError::Runtime("install signal handler".into(), e));
        Ok(Self {
            term: sig(SignalKind::terminate())?,
            int: sig(SignalKind::interrupt())?,
        })
    }
}

/// How often the ACPI power button is pressed again while the guest has not powered off: a press
/// that comes while the guest boots (a stop requested before or just after QMP answered) is lost
/// when the guest's kernel or its button handler is not up yet, and a guest that already shuts
/// down ignores another.
const POWERDOWN_REPEAT: Duration = Duration::from_secs(5);

/// Supervises QEMU until it ends. A stop (SIGTERM, SIGINT) presses the ACPI power button over QMP
/// — at once, or as soon as QMP answers when it comes earlier (`qmp.1` is told then) — and again
/// every [`POWERDOWN_REPEAT`]; QEMU is killed `--grace-period-seconds` after the stop request.
pub(super) async fn supervise(
    signals: &mut StopSignals,
    a: &RunArgs,
    pid: u32,
    reaper: &mut Reaper,
    state: &SharedState,
    (qmp, qmp_ready): (&SharedQmp, &Notify),
) -> Result<(), RunError> {
    let StopSignals { term, int } = signals;
    let grace = Duration::from_secs(a.launch.grace_period_seconds);
    let mut deadline: Option<tokio::time::Instant> = None;
    // When to press the power button (again); None: no stop requested, or QMP not there yet.
    let mut next_press: Option<tokio::time::Instant> = None;
    let mut pressed = false;
    let mut killed = false;
    let exit = loop {
        let why = tokio::select! {
            exit = reaper.wait_for(pid) => break exit,
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
            () = qmp_ready.notified(), if deadline.is_some() && !pressed => "QMP answers",
            () = async { tokio::time::sleep_until(next_press.expect("guarded")).await }, if next_press.is_some() && !killed => "repeat",
            () = async { tokio::time::sleep_until(deadline.expect("guarded")).await }, if deadline.is_some() && !killed => {
                tracing::warn!(grace_seconds = grace.as_secs(), "guest did not power off in time, killing qemu");
                let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGKILL);
                killed = true;
                continue;
            }
        };
        if deadline.is_none() {
            request_stop(state, &mut deadline, grace, why).await;
        } else if why.starts_with("SIG") {
            continue;
        }
        if press_power_button(qmp, !pressed).await {
            pressed = true;
            next_press = Some(tokio::time::Instant::now() + POWERDOWN_REPEAT);
        } else if !pressed {
            tracing::info!("QMP does not answer yet: ACPI powerdown as soon as it does");
        }
    };
    let stop_requested = deadline.is_some();
    {
        let mut s = state.lock().await;
        s.phase = Phase::Stopped;
        s.qemu_pid = None;
        s.qemu_exit = Some(exit.to_string());
    }
    tracing::info!(qemu.exit = %exit, stop_requested, "qemu ended");
    match (stop_requested, exit) {
        (true, QemuExit::Exited(0)) => Ok(()),
        (true, e) => Err(RunError::ShutdownFailed(e)),
        (false, QemuExit::Exited(0)) => Err(RunError::GuestPoweredOff),
        (false, e) => Err(RunError::QemuEnded(e)),
    }
}

/// Records a stop request: the kill deadline runs from now, whenever QMP answers.
async fn request_stop(
    state: &SharedState,
    deadline: &mut Option<tokio::time::Instant>,
    grace: Duration,
    why: &str,
) {
    *deadline = Some(tokio::time::Instant::now() + grace);
    state.lock().await.phase = Phase::ShuttingDown;
    tracing::info!(
        signal = why,
        grace_seconds = grace.as_secs(),
        "stopping: ACPI powerdown"
    );
}

/// Presses the ACPI power button over QMP; false when QMP does not answer yet. The first press
/// is logged, repeats only at debug level.
async fn press_power_button(qmp: &SharedQmp, first: bool) -> bool {
    let slot = qmp.lock().await;
    let Some(q) = slot.as_ref() else {
        return false;
    };
    match q.system_powerdown().await {
        Ok(_) if first => tracing::info!(
            qmp.command = "system_powerdown",
            "ACPI power button pressed"
        ),
        Ok(_) => tracing::debug!(
            qmp.command = "system_powerdown",
            "ACPI power button pressed again"
        ),
        Err(e) => tracing::warn!(error = %e, "system_powerdown failed"),
    }
    true
}
