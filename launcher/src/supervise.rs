//! PID 1 duties: one reaper for every child (QEMU and orphans re-parented to us), and turning
//! QEMU's end into the launcher's exit reason.

use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;
use tokio::signal::unix::{Signal, SignalKind, signal};

/// How QEMU ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QemuExit {
    /// Exit status.
    Exited(i32),
    /// Killed by a signal.
    Signaled(i32),
}

impl std::fmt::Display for QemuExit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            QemuExit::Exited(c) => write!(f, "exit status {c}"),
            QemuExit::Signaled(s) => write!(f, "killed by signal {s}"),
        }
    }
}

/// Reaps children; the only caller of `waitpid` once QEMU runs (so nothing else may spawn and
/// wait on processes after [`Reaper::new`]).
pub struct Reaper {
    sigchld: Signal,
}

impl Reaper {
    /// Registers for SIGCHLD. Call before spawning QEMU so no exit is missed.
    pub fn new() -> std::io::Result<Self> {
        Ok(Self {
            sigchld: signal(SignalKind::child())?,
        })
    }

    /// Waits until `pid` ends, reaping every other child that ends meanwhile.
    pub async fn wait_for(&mut self, pid: u32) -> QemuExit {
        let target = Pid::from_raw(pid as i32);
        loop {
            loop {
                match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
                    Ok(WaitStatus::Exited(p, code)) if p == target => {
                        return QemuExit::Exited(code);
                    }
                    Ok(WaitStatus::Signaled(p, sig, _)) if p == target => {
                        return QemuExit::Signaled(sig as i32);
                    }
                    Ok(WaitStatus::StillAlive) | Err(_) => break,
                    Ok(other) => tracing::debug!(status = ?other, "reaped child"),
                }
            }
            self.sigchld.recv().await;
        }
    }
}
