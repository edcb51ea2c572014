//! QMP behind a small trait (the `qapi` crate today; a fallback client stays possible).

use std::future::Future;
use std::path::Path;
use std::time::{Duration, Instant};

use qapi::futures::{QapiService, QmpStreamTokio};
use serde::Serialize;
use tokio::io::WriteHalf;
use tokio::net::UnixStream;

/// QEMU's run state as QMP reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VmStatus {
    /// Whether vCPUs run.
    pub running: bool,
    /// QEMU's RunState name (`running`, `shutdown`, `guest-panicked`, …).
    pub status: String,
}

impl VmStatus {
    /// States from which the guest does not come back by itself.
    pub fn is_dead(&self) -> bool {
        matches!(
            self.status.as_str(),
            "shutdown" | "guest-panicked" | "internal-error" | "io-error"
        )
    }
}

/// QMP failures.
#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    /// The socket did not accept a QMP session in time.
    #[error("connect to QMP at {path} within {timeout:?}: {last}")]
    Connect {
        /// Socket path.
        path: String,
        /// How long we tried.
        timeout: Duration,
        /// Last error seen.
        last: String,
    },
    /// A command failed.
    #[error("QMP {command}: {message}")]
    Command {
        /// Command name.
        command: &'static str,
        /// Error text.
        message: String,
    },
}

/// QMP commands `capk-launcher qmp` may send (no arguments, nothing that reads guest memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum SimpleCommand {
    /// `query-status`.
    QueryStatus,
    /// `system_powerdown` (ACPI power button).
    SystemPowerdown,
    /// `system_reset` (hard reset).
    SystemReset,
    /// `stop` (pause vCPUs).
    Stop,
    /// `cont` (resume vCPUs).
    Cont,
}

/// The QMP commands the launcher uses.
pub trait Qmp: Send {
    /// `query-status`.
    fn query_status(&self) -> impl Future<Output = Result<VmStatus, QmpError>> + Send;
    /// `system_powerdown`: ACPI power button.
    fn system_powerdown(&self) -> impl Future<Output = Result<(), QmpError>> + Send;
    /// `quit`: stop QEMU now.
    fn quit(&self) -> impl Future<Output = Result<(), QmpError>> + Send;
    /// One of the operator commands; the answer as JSON.
    fn simple(
        &self,
        cmd: SimpleCommand,
    ) -> impl Future<Output = Result<serde_json::Value, QmpError>> + Send;
}

type Writer = QmpStreamTokio<WriteHalf<UnixStream>>;

/// QMP over QEMU's unix socket with the `qapi` crate.
pub struct QapiQmp {
    service: QapiService<Writer>,
    _events: tokio::task::JoinHandle<()>,
}

impl QapiQmp {
    /// Connects and negotiates capabilities, retrying while QEMU creates the socket.
    pub async fn connect(path: &Path, timeout: Duration) -> Result<Self, QmpError> {
        let start = Instant::now();
        loop {
            let last = match QmpStreamTokio::open_uds(path).await {
                Ok(neg) => match neg.negotiate().await {
                    Ok(stream) => {
                        let (service, events) = stream.spawn_tokio();
                        return Ok(Self {
                            service,
                            _events: events,
                        });
                    }
                    Err(e) => e.to_string(),
                },
                Err(e) => e.to_string(),
            };
            if start.elapsed() >= timeout {
                return Err(QmpError::Connect {
                    path: path.display().to_string(),
                    timeout,
                    last,
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

fn done<T>(_: T) -> serde_json::Value {
    serde_json::json!({})
}

impl QapiQmp {
    /// Runs `command`; a failure is a [`QmpError::Command`] named after it.
    async fn execute<C: qapi::Command>(&self, command: C) -> Result<C::Ok, QmpError>
    where
        Writer: futures::Sink<qapi::Execute<C, u32>, Error = std::io::Error> + Unpin,
    {
        self.service
            .execute(command)
            .await
            .map_err(|e| QmpError::Command {
                command: C::NAME,
                message: e.to_string(),
            })
    }
}

impl Qmp for QapiQmp {
    async fn query_status(&self) -> Result<VmStatus, QmpError> {
        let s = self.execute(qapi::qmp::query_status {}).await?;
        let status = serde_json::to_value(s.status)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_else(|| format!("{:?}", s.status));
        Ok(VmStatus {
            running: s.running,
            status,
        })
    }

    async fn system_powerdown(&self) -> Result<(), QmpError> {
        self.execute(qapi::qmp::system_powerdown {})
            .await
            .map(|_| ())
    }

    async fn simple(&self, cmd: SimpleCommand) -> Result<serde_json::Value, QmpError> {
        match cmd {
            SimpleCommand::QueryStatus => {
                Ok(serde_json::to_value(self.query_status().await?).unwrap_or_default())
            }
            SimpleCommand::SystemPowerdown => self.system_powerdown().await.map(done),
            SimpleCommand::SystemReset => self.execute(qapi::qmp::system_reset {}).await.map(done),
            SimpleCommand::Stop => self.execute(qapi::qmp::stop {}).await.map(done),
            SimpleCommand::Cont => self.execute(qapi::qmp::cont {}).await.map(done),
        }
    }

    async fn quit(&self) -> Result<(), QmpError> {
        self.execute(qapi::qmp::quit {}).await.map(|_| ())
    }
}
