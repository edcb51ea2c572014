//! The launcher's unix control socket: exec probes and `status` talk to the running launcher
//! here (the launcher has no IP on the Pod network once the VM owns it).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{Mutex, Semaphore};

use crate::health::{self, ProbeResult, SharedState};
use crate::line::{Frame, LineReader};
use crate::qemu::qmp::{QapiQmp, Qmp, SimpleCommand};

/// The QMP client once connected.
pub type SharedQmp = Arc<Mutex<Option<QapiQmp>>>;

/// File name of the control socket inside the runtime directory.
pub const CONTROL_SOCKET: &str = "control.sock";

/// How long a probe waits for QMP.
const QMP_PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// Longest request line (a request is under 100 bytes).
pub const REQUEST_LINE_MAX: usize = 4096;
/// Longest answer `call` reads (a status report is a few KiB).
pub const ANSWER_LINE_MAX: usize = 1 << 20;
/// How long a client has to send its request line.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections served at once; more wait in the listen backlog.
pub const MAX_CONNECTIONS: usize = 16;

/// Kinds of exec probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProbeKind {
    /// QEMU alive, QMP answers, guest not shut down or panicked.
    Liveness,
    /// Guest heartbeat seen recently and bootstrap succeeded.
    Readiness,
}

impl ProbeKind {
    /// The name in probe output.
    pub fn as_str(self) -> &'static str {
        match self {
            ProbeKind::Liveness => "liveness",
            ProbeKind::Readiness => "readiness",
        }
    }
}

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
    /// The answer did not end or was too long.
    #[error("launcher sent no complete answer (at most {ANSWER_LINE_MAX} bytes)")]
    Truncated,
}

/// Why a request line is refused.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    /// Longer than [`REQUEST_LINE_MAX`].
    #[error("request longer than {REQUEST_LINE_MAX} bytes")]
    TooLong,
    /// Not a request.
    #[error("bad request: {0}")]
    Decode(#[from] serde_json::Error),
}

/// Parses one request line as the server reads it (pure; what the fuzz target drives).
pub fn parse_request(frame: &Frame) -> Result<Request, RequestError> {
    match frame {
        Frame::Line(bytes) => Ok(serde_json::from_slice(bytes)?),
        Frame::TooLong(_) => Err(RequestError::TooLong),
    }
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
    let capped = r.take(ANSWER_LINE_MAX as u64 + 1);
    match LineReader::new(BufReader::new(capped), ANSWER_LINE_MAX)
        .next_frame()
        .await?
    {
        Some(Frame::Line(answer)) => Ok(serde_json::from_slice(&answer)?),
        _ => Err(ControlError::Truncated),
    }
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

/// Serves requests until the task is dropped: one request line per connection, read with a
/// length cap and a deadline, at most [`MAX_CONNECTIONS`] at once, so a client that floods the
/// socket or never finishes its line costs a bounded amount of memory and time.
pub async fn serve(listener: UnixListener, state: SharedState, qmp: SharedQmp) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return;
        };
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let (state, qmp) = (state.clone(), qmp.clone());
        tokio::spawn(async move {
            let _permit = permit;
            let (r, mut w) = stream.into_split();
            // One line per connection: reading stops one byte past the cap.
            let capped = r.take(REQUEST_LINE_MAX as u64 + 1);
            let mut lines = LineReader::new(BufReader::new(capped), REQUEST_LINE_MAX);
            let reply = match tokio::time::timeout(REQUEST_TIMEOUT, lines.next_frame()).await {
                Ok(Ok(Some(frame))) => match parse_request(&frame) {
                    Ok(req) => answer(req, &state, &qmp).await,
                    Err(e) => refusal(e.to_string()),
                },
                Ok(Ok(None) | Err(_)) => return,
                Err(_) => refusal(format!(
                    "no request line within {}s",
                    REQUEST_TIMEOUT.as_secs()
                )),
            };
            let mut out = serde_json::to_vec(&reply).unwrap_or_default();
            out.push(b'\n');
            let _ = w.write_all(&out).await;
        });
    }
}

fn refusal(reason: String) -> serde_json::Value {
    json(&ProbeResult { ok: false, reason })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::health::{LauncherState, Phase};

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

        let readiness = || async {
            let probe = Request::Probe {
                kind: ProbeKind::Readiness,
            };
            call(dir.path(), &probe).await.unwrap()
        };
        let r = readiness().await;
        assert_eq!(r["ok"], false);
        assert_eq!(r["reason"], "guest has not reported bootstrap success");
        state.lock().await.bootstrap_succeeded = true;
        let r = readiness().await;
        assert_eq!(r["ok"], true);
        let s = call(dir.path(), &Request::Status).await.unwrap();
        assert_eq!(s["phase"], "running");
        assert_eq!(s["ip"], "10.244.1.5/32");
        assert_eq!(s["role"], "control-plane");
        server.abort();
    }

    /// A client that sends 8 MiB without a newline is refused after the cap (not read to its
    /// end), and the next client is served as usual.
    #[tokio::test]
    async fn an_endless_request_is_refused_and_the_next_one_served() {
        let dir = tempfile::tempdir().unwrap();
        let state: SharedState = Arc::new(Mutex::new(LauncherState::new(
            "worker",
            Duration::from_secs(90),
        )));
        let qmp: SharedQmp = Arc::new(Mutex::new(None));
        let server = tokio::spawn(serve(bind(dir.path()).unwrap(), state, qmp));

        let (mut r, mut w) = UnixStream::connect(dir.path().join(CONTROL_SOCKET))
            .await
            .unwrap()
            .into_split();
        let flood = tokio::spawn(async move {
            let junk = vec![b'{'; 64 * 1024];
            let mut sent = 0usize;
            // The server stops reading once the line is over the cap: writing then fails.
            while sent < 8 << 20 && w.write_all(&junk).await.is_ok() {
                sent += junk.len();
            }
            sent
        });
        let reply = LineReader::new(BufReader::new(&mut r), 1024)
            .next_frame()
            .await
            .unwrap();
        let Some(Frame::Line(reply)) = reply else {
            panic!("no answer: {reply:?}")
        };
        let reply: serde_json::Value = serde_json::from_slice(&reply).unwrap();
        assert_eq!(reply["ok"], false);
        assert_eq!(
            reply["reason"],
            format!("request longer than {REQUEST_LINE_MAX} bytes")
        );
        assert!(
            flood.await.unwrap() < 8 << 20,
            "the server read the whole flood"
        );

        let s = call(dir.path(), &Request::Status).await.unwrap();
        assert_eq!(s["role"], "worker");
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
