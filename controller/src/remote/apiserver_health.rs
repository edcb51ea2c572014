//! The control-plane Service's health check, as a cloud load balancer does it: the controller
//! probes `https://<Pod IP>:6443/readyz` of every control-plane machine Pod and keeps, per Pod,
//! whether its apiserver answers. The KVMCluster reconciler (its `endpoints` step) turns that into
//! the Service's EndpointSlice. A module of its own, not the reconciler's: the monitor lives in
//! the shared context between reconciles.
//!
//! The probe itself is capk-readyz's, the one `/readyz` client of the controller and the launcher
//! (self-signed certificates accepted, no credential sent, only the status code read); this
//! module keeps what the controller makes of it: stable reasons, and per Pod whether it answers.

use std::{
    collections::{BTreeMap, HashMap},
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use capk_readyz::{Readyz, ReadyzError};
use futures::future::BoxFuture;

/// Time allowed for one probe: connect, TLS handshake and the answer's status line.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// Next check while some apiserver's last probe failed: a dead one leaves quickly, a recovered
/// one comes back quickly.
pub const RECHECK_FAILING: Duration = Duration::from_secs(2);
/// Next check while every apiserver answered its last probe.
pub const RECHECK_HEALTHY: Duration = Duration::from_secs(10);
/// Failed probes in a row after which an answering apiserver leaves the endpoints. One slow
/// answer (a busy apiserver, a guest under emulation) does not take it out; two do.
pub const FAILURES_TO_LEAVE: u32 = 2;

/// Why a probe did not count as an answer. The messages are stable (no addresses, no timings
/// that vary), so a condition built from them does not change on every probe.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProbeError {
    /// No TCP connection (refused, unreachable, ...).
    #[error("connect: {0}")]
    Connect(String),
    /// TCP connected, TLS did not.
    #[error("TLS handshake: {0}")]
    Handshake(String),
    /// TLS connected, no HTTP answer.
    #[error("HTTP: {0}")]
    Http(String),
    /// An answer, but not 200: the apiserver is not ready (or not an apiserver).
    #[error("/readyz answered HTTP {0}")]
    Status(u16),
    /// No connection within [`PROBE_TIMEOUT`]: a frozen VM, a guest that does not answer at all.
    #[error("no answer within {}s", PROBE_TIMEOUT.as_secs())]
    Timeout,
    /// The connection was accepted, but no answer came within [`PROBE_TIMEOUT`]: the guest runs,
    /// its apiserver is hung or too slow (an emulated guest under load).
    #[error("connected, no answer within {}s", PROBE_TIMEOUT.as_secs())]
    NoAnswer,
}

impl ProbeError {
    /// Whether the apiserver showed it is alive although it failed the probe: it answered with
    /// another status than 200 (not ready: etcd slow or down) or accepted the connection and did
    /// not answer in time. A refused or unanswered connection, or no TLS, is not.
    pub fn alive(&self) -> bool {
        matches!(self, Self::Status(_) | Self::NoAnswer)
    }
}

/// One `/readyz` probe. A trait so that tests can stand in for the network.
pub trait ReadyzProbe: Send + Sync {
    /// `Ok` when `https://<addr>/readyz` answers 200 within [`PROBE_TIMEOUT`].
    fn readyz(&self, addr: SocketAddr) -> BoxFuture<'_, Result<(), ProbeError>>;
}

/// The real probe: capk-readyz with [`PROBE_TIMEOUT`] (a fresh TCP connection and TLS handshake
/// each time, one HTTP/1.1 GET, the status code).
#[derive(Debug, Default)]
pub struct HttpsReadyz;

/// The controller's `/readyz` client.
const CLIENT: Readyz = Readyz::new("capk-controller", PROBE_TIMEOUT);

impl ReadyzProbe for HttpsReadyz {
    fn readyz(&self, addr: SocketAddr) -> BoxFuture<'_, Result<(), ProbeError>> {
        Box::pin(async move { CLIENT.probe(addr).await.map_err(ProbeError::from) })
    }
}

impl From<ReadyzError> for ProbeError {
    /// The stable reason: a connect error by its kind only, no timing.
    fn from(e: ReadyzError) -> Self {
        match e {
            ReadyzError::Setup(e) => Self::Handshake(format!("TLS setup: {e}")),
            ReadyzError::Connect(e) => Self::Connect(e.kind().to_string()),
            ReadyzError::Handshake(e) => Self::Handshake(e.to_string()),
            ReadyzError::Http(e) => Self::Http(e.to_string()),
            ReadyzError::Status(code) => Self::Status(code),
            ReadyzError::Timeout { connected: true } => Self::NoAnswer,
            ReadyzError::Timeout { connected: false } => Self::Timeout,
        }
    }
}

/// What the controller knows of one control-plane machine's apiserver.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EndpointHealth {
    /// It takes traffic: it answered, and has not failed [`FAILURES_TO_LEAVE`] probes in a row
    /// since. A machine never probed (or never answering) does not.
    pub answering: bool,
    /// Failed probes in a row.
    pub failures: u32,
    /// Why the last probe failed; `None` when it answered.
    pub last_error: Option<ProbeError>,
}

impl EndpointHealth {
    /// The state after one more probe.
    pub fn after(&self, probe: Result<(), ProbeError>) -> Self {
        match probe {
            Ok(()) => Self {
                answering: true,
                failures: 0,
                last_error: None,
            },
            Err(e) => {
                let failures = self.failures.saturating_add(1);
                Self {
                    answering: self.answering && failures < FAILURES_TO_LEAVE,
                    failures,
                    last_error: Some(e),
                }
            }
        }
    }
}

/// When to look again: soon while some apiserver's last probe failed, else at the regular pace.
pub fn recheck_after<'a>(health: impl IntoIterator<Item = &'a EndpointHealth>) -> Duration {
    if health.into_iter().any(|h| h.last_error.is_some()) {
        RECHECK_FAILING
    } else {
        RECHECK_HEALTHY
    }
}

/// The apiserver health of every cluster's control-plane machines, kept between reconciles.
pub struct HealthMonitor {
    probe: Arc<dyn ReadyzProbe>,
    /// Per KVMCluster (`namespace/name`), per machine Pod UID.
    seen: Mutex<HashMap<String, BTreeMap<String, EndpointHealth>>>,
}

impl Default for HealthMonitor {
    fn default() -> Self {
        Self::new(Arc::new(HttpsReadyz))
    }
}

impl HealthMonitor {
    /// A monitor probing with `probe`.
    pub fn new(probe: Arc<dyn ReadyzProbe>) -> Self {
        Self {
            probe,
            seen: Default::default(),
        }
    }

    /// Probes every target (Pod UID, apiserver address) of `cluster` at once, and returns each
    /// one's health after it. Pods no longer among the targets are forgotten.
    pub async fn check(
        &self,
        cluster: &str,
        targets: &[(String, SocketAddr)],
    ) -> BTreeMap<String, EndpointHealth> {
        let before = self
            .seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(cluster)
            .cloned()
            .unwrap_or_default();
        let probes = targets.iter().map(|(uid, addr)| {
            let previous = before.get(uid).cloned().unwrap_or_default();
            async move {
                let result = self.probe.readyz(*addr).await;
                (uid.clone(), previous.after(result))
            }
        });
        let now: BTreeMap<String, EndpointHealth> = futures::future::join_all(probes)
            .await
            .into_iter()
            .collect();
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        seen.insert(cluster.to_owned(), now.clone());
        now
    }

    /// Drops what is known of `cluster` (it was deleted).
    pub fn forget(&self, cluster: &str) {
        self.seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(cluster);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    use capk_readyz::testsupport::{Answer, tls_server};
    use tokio::io::AsyncWriteExt;

    #[test]
    fn an_apiserver_leaves_after_two_failed_probes_and_returns_on_one_answer() {
        let new = EndpointHealth::default();
        assert!(!new.answering, "never probed: no traffic");
        let failed = new.after(Err(ProbeError::Timeout));
        assert!(!failed.answering, "never answered: still no traffic");
        let up = failed.after(Ok(()));
        assert_eq!(
            up,
            EndpointHealth {
                answering: true,
                failures: 0,
                last_error: None
            }
        );
        let once = up.after(Err(ProbeError::Status(500)));
        assert!(once.answering, "one slow or failed answer keeps it");
        assert_eq!(once.last_error, Some(ProbeError::Status(500)));
        let twice = once.after(Err(ProbeError::Timeout));
        assert!(!twice.answering, "two in a row take it out");
        assert_eq!(twice.failures, 2);
        assert!(twice.after(Ok(())).answering, "one answer brings it back");
    }

    #[test]
    fn recheck_soon_while_any_last_probe_failed() {
        let up = EndpointHealth::default().after(Ok(()));
        let failing = up.after(Err(ProbeError::Timeout));
        let dead = failing.after(Err(ProbeError::Timeout));
        assert_eq!(recheck_after([]), RECHECK_HEALTHY);
        assert_eq!(recheck_after([&up, &up]), RECHECK_HEALTHY);
        assert_eq!(recheck_after([&up, &failing]), RECHECK_FAILING);
        assert_eq!(recheck_after([&dead]), RECHECK_FAILING);
    }

    /// Answers from a table instead of the network.
    struct Scripted(Mutex<HashMap<SocketAddr, Result<(), ProbeError>>>);

    impl ReadyzProbe for Scripted {
        fn readyz(&self, addr: SocketAddr) -> BoxFuture<'_, Result<(), ProbeError>> {
            let r = self.0.lock().unwrap().get(&addr).cloned();
            Box::pin(async move { r.unwrap_or(Err(ProbeError::Connect("refused".into()))) })
        }
    }

    #[tokio::test]
    async fn the_monitor_remembers_each_pod_per_cluster_and_forgets_gone_pods() {
        let a: SocketAddr = "10.0.0.1:6443".parse().unwrap();
        let b: SocketAddr = "10.0.0.2:6443".parse().unwrap();
        let script = Arc::new(Scripted(Mutex::new(HashMap::from([
            (a, Ok(())),
            (b, Ok(())),
        ]))));
        let monitor = HealthMonitor::new(script.clone());
        let targets = vec![("uid-a".to_owned(), a), ("uid-b".to_owned(), b)];
        let first = monitor.check("ns/demo", &targets).await;
        assert!(first.values().all(|h| h.answering));

        script.0.lock().unwrap().insert(b, Err(ProbeError::Timeout));
        let second = monitor.check("ns/demo", &targets).await;
        assert!(second["uid-b"].answering, "first failure");
        let third = monitor.check("ns/demo", &targets).await;
        assert!(third["uid-a"].answering);
        assert!(!third["uid-b"].answering, "second failure in a row");

        // Another cluster's Pods are tracked apart.
        let other = monitor.check("ns/other", &[("uid-b".to_owned(), a)]).await;
        assert!(other["uid-b"].answering);

        // b's Pod is gone: a new Pod with b's address starts from scratch.
        let only_a = monitor.check("ns/demo", &targets[..1]).await;
        assert_eq!(only_a.keys().collect::<Vec<_>>(), ["uid-a"]);
        monitor.forget("ns/demo");
        script.0.lock().unwrap().insert(a, Err(ProbeError::Timeout));
        let fresh = monitor.check("ns/demo", &targets[..1]).await;
        assert!(!fresh["uid-a"].answering, "forgotten: never answered");
    }

    #[tokio::test]
    async fn the_real_probe_accepts_200_only() {
        let probe = HttpsReadyz;
        assert_eq!(
            probe.readyz(tls_server(Answer::status(200)).await.0).await,
            Ok(())
        );
        assert_eq!(
            probe.readyz(tls_server(Answer::status(500)).await.0).await,
            Err(ProbeError::Status(500)),
            "etcd down: the apiserver answers but is not ready"
        );
        assert_eq!(
            probe.readyz(tls_server(Answer::status(401)).await.0).await,
            Err(ProbeError::Status(401))
        );
        let started = std::time::Instant::now();
        assert_eq!(
            probe.readyz(tls_server(Answer::Hang).await.0).await,
            Err(ProbeError::NoAnswer),
            "a hung apiserver: connected, no answer"
        );
        let waited = started.elapsed();
        assert!(
            waited >= PROBE_TIMEOUT && waited < PROBE_TIMEOUT + Duration::from_secs(3),
            "{waited:?}"
        );
    }

    #[tokio::test]
    async fn the_real_probe_says_why_nothing_answered() {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = closed.local_addr().unwrap();
        drop(closed);
        assert_eq!(
            HttpsReadyz.readyz(addr).await,
            Err(ProbeError::Connect("connection refused".into()))
        );
        // Plain HTTP on the port: no TLS, not an apiserver.
        let plain = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = plain.local_addr().unwrap();
        let served = Arc::new(AtomicBool::new(false));
        let flag = served.clone();
        tokio::spawn(async move {
            let (mut s, _) = plain.accept().await.unwrap();
            flag.store(true, Ordering::SeqCst);
            let _ = s.write_all(b"HTTP/1.1 200 OK\r\n\r\nok").await;
        });
        let e = HttpsReadyz.readyz(addr).await.unwrap_err();
        assert!(matches!(e, ProbeError::Handshake(_)), "{e}");
        assert!(served.load(Ordering::SeqCst));
    }
}
