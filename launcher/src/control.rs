//! The launcher's unix control socket: exec probes and `status` talk to the running launcher
//! here (the launcher has no IP on the Pod network once the VM owns it).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::Mutex;

use crate::cli::ProbeKind;
use crate::health::{self, LauncherState, ProbeResult};
use crate::qemu::qmp::{QapiQmp, Qmp, SimpleCommand};

/// State shared by the tasks of a running launcher.
pub type SharedState = Arc<Mutex<LauncherState>>;
/// The QMP client once connected.
pub type SharedQmp = Arc<Mutex<Option<QapiQmp>>>;

/// File name of the control socket inside the runtime directory.
pub const CONTROL_SOCKET: &str = "control.sock";

/// How long a probe waits for QMP.
const QMP_PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// A request on the control socket (one JSON line).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "op", rename_all = "lowercase")]
pub enum Request {
    /// Run a probe.
    Probe {
        /// Which.
        kind: ProbeKind,
    },
    /// Report status.
    Status,
    /// Send a QMP command.
    Qmp {
        /// Which.
        command: SimpleCommand,
    },
}

/// Control socket client failures.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// Nobody listens.
    #[error(
        "connect to the launcher at {0}: {1} (is `capk-launcher run` running with the same --runtime-dir?)"
    )]
    Connect(PathBuf, #[source] std::io::Error),
    /// I/O on the socket.
    #[error("talk to the launcher: {0}")]
    Io(#[from] std::io::Error),
    /// Bad answer.
    #[error("launcher sent an unreadable answer: {0}")]
    Decode(#[from] serde_json::Error),
    /// Binding the socket.
    #[error("listen on {0}")]
    Bind(PathBuf, #[source] std::io::Error),
}

/// Sends one request and returns the raw JSON answer.
pub async fn call(runtime_dir: &Path, req: &Request) -> Result<serde_json::Value, ControlError> {
    let path = runtime_dir.join(CONTROL_SOCKET);
    let stream = UnixStream::connect(&path)
        .await
        .map_err(|e| ControlError::Connect(path.clone(), e))?;
    let (r, mut w) = stream.into_split();
    let mut line = serde_json::to_vec(req)?;
    line.push(b'\n');
    w.write_all(&line).await?;
    let mut answer = String::new();
    BufReader::new(r).read_line(&mut answer).await?;
    Ok(serde_json::from_str(&answer)?)
}

async fn answer(req: Request, state: &SharedState, qmp: &SharedQmp) -> serde_json::Value {
    if let Request::Qmp { command } = req {
        let guard = qmp.lock().await;
        let Some(q) = guard.as_ref() else {
            return serde_json::json!({"error": "QMP is not connected yet"});
        };
        return match tokio::time::timeout(QMP_PROBE_TIMEOUT, q.simple(command)).await {
            Ok(Ok(v)) => serde_json::json!({ "return": v }),
            Ok(Err(e)) => serde_json::json!({ "error": e.to_string() }),
            Err(_) => {
                serde_json::json!({ "error": format!("no answer within {QMP_PROBE_TIMEOUT:?}") })
            }
        };
    }
    let vm = match req {
        Request::Probe {
            kind: ProbeKind::Readiness,
        } => None,
        _ => {
            let guard = qmp.lock().await;
            match guard.as_ref() {
                None => None,
                Some(q) => Some(
                    match tokio::time::timeout(QMP_PROBE_TIMEOUT, q.query_status()).await {
                        Ok(Ok(s)) => Ok(s),
                        Ok(Err(e)) => Err(e.to_string()),
                        Err(_) => Err(format!("no answer within {QMP_PROBE_TIMEOUT:?}")),
                    },
                ),
            }
        }
    };
    let s = state.lock().await;
    match req {
        Request::Probe {
            kind: ProbeKind::Liveness,
        } => json(&health::liveness(&s, vm)),
        Request::Probe {
            kind: ProbeKind::Readiness,
        } => json(&health::readiness(&s, Instant::now())),
        Request::Status => {
            let vm = vm.and_then(Result::ok);
            json(&health::status_report(&s, vm.as_ref(), Instant::now()))
        }
        Request::Qmp { .. } => unreachable!("answered above"),
    }
}

fn json<T: Serialize>(v: &T) -> serde_json::Value {
    serde_json::to_value(v).unwrap_or_default()
}

/// Binds the control socket (replacing a stale one from a previous container run).
pub fn bind(runtime_dir: &Path) -> Result<UnixListener, ControlError> {
    let path = runtime_dir.join(CONTROL_SOCKET);
    let _ = std::fs::remove_file(&path);
    UnixListener::bind(&path).map_err(|e| ControlError::Bind(path, e))
}

/// Serves requests until the task is dropped.
pub async fn serve(listener: UnixListener, state: SharedState, qmp: SharedQmp) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let (state, qmp) = (state.clone(), qmp.clone());
        tokio::spawn(async move {
            let (r, mut w) = stream.into_split();
            let mut line = String::new();
            if BufReader::new(r).read_line(&mut line).await.is_err() {
                return;
            }
            let reply = match serde_json::from_str::<Request>(&line) {
                Ok(req) => answer(req, &state, &qmp).await,
                Err(e) => json(&ProbeResult {
                    ok: false,
                    reason: format!("bad request: {e}"),
                }),
            };
            let mut out = serde_json::to_vec(&reply).unwrap_or_default();
            out.push(b'\n');
            let _ = w.write_all(&out).await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::health::Phase;

    #[tokio::test]
    async fn probe_and_status_over_the_socket() {
        let dir = tempfile::tempdir().unwrap();
        let mut st = LauncherState::new("control-plane", Duration::from_secs(90));
        st.phase = Phase::Running;
        st.ip = Some("10.244.1.5/32".into());
        st.last_heartbeat = Some(Instant::now());
        let state: SharedState = Arc::new(Mutex::new(st));
        let qmp: SharedQmp = Arc::new(Mutex::new(None));
        let server = tokio::spawn(serve(bind(dir.path()).unwrap(), state.clone(), qmp));

        let r = call(
            dir.path(),
            &Request::Probe {
                kind: ProbeKind::Readiness,
            },
        )
        .await
        .unwrap();
        assert_eq!(r["ok"], false);
        assert_eq!(r["reason"], "guest has not reported bootstrap success");
        state.lock().await.bootstrap_succeeded = true;
        let r = call(
            dir.path(),
            &Request::Probe {
                kind: ProbeKind::Readiness,
            },
        )
        .await
        .unwrap();
        assert_eq!(r["ok"], true);
        let s = call(dir.path(), &Request::Status).await.unwrap();
        assert_eq!(s["phase"], "running");
        assert_eq!(s["ip"], "10.244.1.5/32");
        assert_eq!(s["role"], "control-plane");
        server.abort();
    }

    #[tokio::test]
    async fn no_launcher_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let e = call(dir.path(), &Request::Status).await.unwrap_err();
        assert!(
            e.to_string().contains("is `capk-launcher run` running"),
            "{e}"
        );
    }
}
