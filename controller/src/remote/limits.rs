//! What one remote cluster may cost the controller. A workload or hosting cluster is reached
//! through a kubeconfig Secret whose author may be a tenant, so its server may be theirs: every
//! client built from such a Secret goes through a [`LimitsLayer`] holding it to the operator's
//! [`RemoteLimits`]:
//!
//! - an answer is read up to [`RemoteLimits::max_response_bytes`], one watch event up to
//!   [`RemoteLimits::max_event_bytes`]; past that the request fails ([`LimitError::TooLarge`])
//!   and what was read is dropped, so no answer becomes memory beyond the cap;
//! - a request, its answer read to the end, takes at most [`RemoteLimits::request_timeout`]; a
//!   watch the `timeoutSeconds` it asked for plus that ([`LimitError::Timeout`]), so a server
//!   that trickles bytes holds nothing longer than a silent one;
//! - at most [`RemoteLimits::max_in_flight`] requests are in flight at once (watches aside: a
//!   link runs a fixed few); one more fails at once ([`LimitError::Busy`]) instead of queueing,
//!   so a cluster that holds its requests holds no more of the controller's reconciles than
//!   that;
//! - after a failure (no answer, a 5xx or 429, an answer over a cap) the cluster is not asked
//!   again for a while, doubling per failure in a row up to [`BACKOFF_MAX`]
//!   ([`LimitError::BackingOff`]); an answer read to its end resets it. Watches keep their own
//!   back-off (kube-runtime's) and neither wait for this one nor count in it.
//!
//! One layer, and so one in-flight count and one back-off, per client: per remote cluster link.

use std::{
    pin::Pin,
    sync::{Arc, Mutex},
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use futures::{FutureExt, future::BoxFuture};
use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use tokio::{
    sync::{OwnedSemaphorePermit, Semaphore},
    time::{Instant, Sleep},
};
use tower::{BoxError, Layer, Service};

/// Default of [`RemoteLimits::max_response_bytes`]: a page of [`DEFAULT_LIST_PAGE_SIZE`] Nodes
/// or Pods is well under 1 MiB, and no single object is larger than etcd's 1.5 MiB request
/// limit.
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 4 << 20;
/// Default of [`RemoteLimits::max_event_bytes`]: one object, as etcd stores at most.
pub const DEFAULT_MAX_EVENT_BYTES: usize = 2 << 20;
/// Default of [`RemoteLimits::list_page_size`].
pub const DEFAULT_LIST_PAGE_SIZE: u32 = 100;
/// Default of [`RemoteLimits::max_in_flight`].
pub const DEFAULT_MAX_IN_FLIGHT: usize = 4;
/// Default of [`RemoteLimits::request_timeout`].
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// The wait after a remote cluster's first failure.
pub const BACKOFF_FIRST: Duration = Duration::from_secs(1);
/// The longest wait after a remote cluster's failures.
pub const BACKOFF_MAX: Duration = Duration::from_secs(120);
/// How long a watch asks the server to keep it open when the request does not say (the
/// controller's own watches always say: their `timeoutSeconds` is 25).
const DEFAULT_WATCH_SECONDS: u64 = 300;

/// The operator's limits on what one remote cluster's client reads and how long it waits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteLimits {
    /// The most bytes read of one answer (a list page, an object).
    pub max_response_bytes: usize,
    /// The most bytes read of one watch event (one line of a watch stream).
    pub max_event_bytes: usize,
    /// Objects asked for per list page (`limit`; the rest follows by `continue`).
    pub list_page_size: u32,
    /// Requests in flight at once, watches aside.
    pub max_in_flight: usize,
    /// The longest a request may take, its answer read to the end.
    pub request_timeout: Duration,
}

impl Default for RemoteLimits {
    fn default() -> Self {
        Self {
            max_response_bytes: DEFAULT_MAX_RESPONSE_BYTES,
            max_event_bytes: DEFAULT_MAX_EVENT_BYTES,
            list_page_size: DEFAULT_LIST_PAGE_SIZE,
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
        }
    }
}

/// Why a request to a remote cluster failed at the controller's limits. Its message never
/// quotes what the server sent.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LimitError {
    /// An answer longer than a cap; what was read is dropped.
    #[error(
        "the cluster sent more than {limit} bytes in {what}, over the controller's limit \
         for a remote cluster; the answer is not used"
    )]
    TooLarge {
        /// `one answer` or `one watch event`.
        what: &'static str,
        /// The cap, in bytes.
        limit: usize,
    },
    /// No answer, or not all of it, within the request's time.
    #[error("the cluster did not answer within {0:?}")]
    Timeout(Duration),
    /// The cluster has as many requests in flight as allowed; this one was not sent.
    #[error("the cluster already has {0} requests in flight; this one was not sent")]
    Busy(usize),
    /// The cluster answered with a server error.
    #[error("the cluster answered HTTP {0}")]
    ServerError(u16),
    /// The request failed on the way (connection refused, reset, TLS).
    #[error("{0}")]
    Transport(String),
    /// The cluster failed recently and is not asked again yet.
    #[error(
        "not asked again for {}s after {failures} failures in a row; the last: {last}",
        .wait.as_secs().max(1)
    )]
    BackingOff {
        /// Consecutive failures.
        failures: u32,
        /// Until the next attempt.
        wait: Duration,
        /// The last failure.
        last: Box<LimitError>,
    },
}

impl LimitError {
    /// The failure behind a back-off, or this one.
    pub fn cause(&self) -> &LimitError {
        match self {
            Self::BackingOff { last, .. } => last.cause(),
            other => other,
        }
    }

    /// Whether an answer was over a cap (the cluster's server misbehaves, rather than being
    /// slow or away).
    pub fn is_too_large(&self) -> bool {
        matches!(self.cause(), Self::TooLarge { .. })
    }

    /// The limit error in `e`, if it failed at one: through kube's wrappings of a failed
    /// request, a failed body and a failed watch stream.
    pub fn of(e: &kube::Error) -> Option<&LimitError> {
        match e {
            kube::Error::Service(inner) => Self::in_boxed(inner.as_ref()),
            kube::Error::ReadEvents(io) => io.get_ref().and_then(|i| Self::in_boxed(i)),
            _ => None,
        }
    }

    fn in_boxed<'a>(
        e: &'a (dyn std::error::Error + Send + Sync + 'static),
    ) -> Option<&'a LimitError> {
        if let Some(l) = e.downcast_ref::<LimitError>() {
            return Some(l);
        }
        e.downcast_ref::<kube::Error>().and_then(Self::of)
    }
}

/// What a failed request to a remote cluster says in a condition: the limit it failed at, in
/// the controller's words, else kube's error, cut and redacted like other text a server sent.
pub fn describe(e: &kube::Error) -> String {
    match LimitError::of(e) {
        Some(l) => l.to_string(),
        None => crate::remote::redact::untrusted_message(&e.to_string()),
    }
}

/// The requests in flight to one cluster and its recent failures, shared by every clone of its
/// client.
struct Shared {
    limits: RemoteLimits,
    in_flight: Arc<Semaphore>,
    health: Mutex<Health>,
}

/// A cluster's failures in a row, and until when it is not asked.
#[derive(Default)]
struct Health {
    failures: u32,
    until: Option<Instant>,
    last: Option<LimitError>,
}

impl Shared {
    /// The back-off in force, if any.
    fn backing_off(&self) -> Option<LimitError> {
        let health = self.health.lock().expect("health lock");
        let now = Instant::now();
        match (health.until, &health.last) {
            (Some(until), Some(last)) if until > now => Some(LimitError::BackingOff {
                failures: health.failures,
                wait: until - now,
                last: Box::new(last.clone()),
            }),
            _ => None,
        }
    }

    /// Records a failure. Failures of requests that were in flight together count once: the
    /// wait doubles per attempt after a wait, not per request that shared one.
    fn failed(&self, e: &LimitError) {
        let mut health = self.health.lock().expect("health lock");
        let now = Instant::now();
        if health.until.is_none_or(|u| u <= now) {
            health.failures = health.failures.saturating_add(1);
            let wait =
                crate::runtime::backoff::doubling(BACKOFF_FIRST, BACKOFF_MAX, health.failures);
            health.until = Some(now + wait);
        }
        health.last = Some(e.clone());
    }

    /// Records an answer read to its end.
    fn succeeded(&self) {
        let mut health = self.health.lock().expect("health lock");
        *health = Health::default();
    }
}

/// Holds one client to [`RemoteLimits`] (see the module's contract).
#[derive(Clone)]
pub struct LimitsLayer {
    shared: Arc<Shared>,
}

impl LimitsLayer {
    /// A layer for one remote cluster's client.
    pub fn new(limits: &RemoteLimits) -> Self {
        Self {
            shared: Arc::new(Shared {
                in_flight: Arc::new(Semaphore::new(limits.max_in_flight.max(1))),
                limits: limits.clone(),
                health: Mutex::default(),
            }),
        }
    }
}

impl<S> Layer<S> for LimitsLayer {
    type Service = Limited<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Limited {
            inner,
            shared: self.shared.clone(),
        }
    }
}

/// The service of [`LimitsLayer`].
#[derive(Clone)]
pub struct Limited<S> {
    inner: S,
    shared: Arc<Shared>,
}

/// A watch request: how long it asked the server to keep it open.
fn watch_seconds(uri: &http::Uri) -> Option<u64> {
    let query = uri.query()?;
    let pairs = || query.split('&').filter_map(|kv| kv.split_once('='));
    pairs()
        .any(|(k, v)| k == "watch" && (v == "true" || v == "1"))
        .then(|| {
            pairs()
                .find(|(k, _)| *k == "timeoutSeconds")
                .and_then(|(_, v)| v.parse::<u64>().ok())
                .unwrap_or(DEFAULT_WATCH_SECONDS)
                .min(DEFAULT_WATCH_SECONDS)
        })
}

impl<S, B, R> Service<Request<B>> for Limited<S>
where
    S: Service<Request<B>, Response = Response<R>>,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    R: Body<Data = Bytes> + Send + 'static,
    R::Error: Into<BoxError>,
{
    type Response = Response<LimitedBody<R>>;
    type Error = BoxError;
    type Future = BoxFuture<'static, Result<Self::Response, BoxError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let shared = self.shared.clone();
        let limits = &shared.limits;
        let watch = watch_seconds(req.uri());
        let (permit, timeout, cap) = match watch {
            Some(secs) => (
                None,
                Duration::from_secs(secs) + limits.request_timeout,
                Cap::Events(limits.max_event_bytes),
            ),
            None => {
                if let Some(e) = shared.backing_off() {
                    return futures::future::ready(Err(e.into())).boxed();
                }
                let Ok(permit) = shared.in_flight.clone().try_acquire_owned() else {
                    let busy = LimitError::Busy(limits.max_in_flight);
                    return futures::future::ready(Err(busy.into())).boxed();
                };
                (
                    Some(permit),
                    limits.request_timeout,
                    Cap::Answer(limits.max_response_bytes),
                )
            }
        };
        let deadline = Instant::now() + timeout;
        let sent = self.inner.call(req);
        async move {
            let counts = watch.is_none();
            let fail = |e: LimitError| {
                if counts {
                    shared.failed(&e);
                }
                e
            };
            let res = match tokio::time::timeout_at(deadline, sent).await {
                Err(_) => return Err(fail(LimitError::Timeout(timeout)).into()),
                Ok(Err(e)) => {
                    let e: BoxError = e.into();
                    fail(LimitError::Transport(e.to_string()));
                    return Err(e);
                }
                Ok(Ok(res)) => res,
            };
            let status = res.status();
            let healthy =
                !(status.is_server_error() || status == http::StatusCode::TOO_MANY_REQUESTS);
            if !healthy {
                fail(LimitError::ServerError(status.as_u16()));
            }
            let guard = Guard {
                shared: counts.then_some(shared.clone()),
                healthy,
                _permit: permit,
            };
            Ok(res.map(|body| LimitedBody {
                inner: Box::pin(body),
                deadline: Box::pin(tokio::time::sleep_until(deadline)),
                timeout,
                cap,
                read: 0,
                guard: Some(guard),
            }))
        }
        .boxed()
    }
}

/// What an answer's body may hold.
#[derive(Clone, Copy)]
enum Cap {
    /// This many bytes in all.
    Answer(usize),
    /// This many bytes per line (a watch event).
    Events(usize),
}

/// A request's hold on its cluster until its answer is read: the in-flight permit, and where
/// the outcome is recorded.
struct Guard {
    /// `None` for a watch: its outcome is not counted.
    shared: Option<Arc<Shared>>,
    /// The status line was not a failure: reading the body to its end is a success.
    healthy: bool,
    _permit: Option<OwnedSemaphorePermit>,
}

/// An answer's body, read within the request's deadline and its [`Cap`].
pub struct LimitedBody<B> {
    inner: Pin<Box<B>>,
    deadline: Pin<Box<Sleep>>,
    timeout: Duration,
    cap: Cap,
    /// Bytes read: in all, or since the last newline.
    read: usize,
    /// Released at the end of the body, or when it fails.
    guard: Option<Guard>,
}

impl<B> LimitedBody<B> {
    /// Ends the body with `e`, recording the failure.
    fn fail(&mut self, e: LimitError) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Some(Guard {
            shared: Some(shared),
            ..
        }) = self.guard.take()
        {
            shared.failed(&e);
        }
        Poll::Ready(Some(Err(e.into())))
    }

    /// Counts `data` against the cap; the error when it goes over.
    fn count(&mut self, data: &[u8]) -> Option<LimitError> {
        match self.cap {
            Cap::Answer(limit) => {
                self.read = self.read.saturating_add(data.len());
                (self.read > limit).then_some(LimitError::TooLarge {
                    what: "one answer",
                    limit,
                })
            }
            Cap::Events(limit) => {
                // Every line this chunk ends or continues, the one before it included.
                let mut over = false;
                for (i, line) in data.split(|b| *b == b'\n').enumerate() {
                    self.read = if i == 0 {
                        self.read.saturating_add(line.len())
                    } else {
                        line.len()
                    };
                    over |= self.read > limit;
                }
                over.then_some(LimitError::TooLarge {
                    what: "one watch event",
                    limit,
                })
            }
        }
    }
}

impl<B> Body for LimitedBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.guard.is_none() {
            // Ended, or failed.
            return Poll::Ready(None);
        }
        if self.deadline.as_mut().poll(cx).is_ready() {
            let timeout = self.timeout;
            return self.fail(LimitError::Timeout(timeout));
        }
        match self.inner.as_mut().poll_frame(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref()
                    && let Some(e) = self.count(data)
                {
                    return self.fail(e);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                let e: BoxError = e.into();
                if let Some(Guard {
                    shared: Some(shared),
                    ..
                }) = self.guard.take()
                {
                    shared.failed(&LimitError::Transport(e.to_string()));
                }
                Poll::Ready(Some(Err(e)))
            }
            Poll::Ready(None) => {
                if let Some(Guard {
                    shared: Some(shared),
                    healthy: true,
                    ..
                }) = self.guard.take()
                {
                    shared.succeeded();
                }
                self.guard = None;
                Poll::Ready(None)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.guard.is_none() || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::{BodyExt, StreamBody};

    use super::*;

    type TestBody = http_body_util::combinators::BoxBody<Bytes, BoxError>;

    fn body_of(chunks: Vec<&'static [u8]>) -> TestBody {
        let frames = chunks
            .into_iter()
            .map(|c| Ok::<_, BoxError>(Frame::data(Bytes::from_static(c))));
        StreamBody::new(futures::stream::iter(frames)).boxed()
    }

    fn limits() -> RemoteLimits {
        RemoteLimits {
            max_response_bytes: 10,
            max_event_bytes: 4,
            max_in_flight: 1,
            request_timeout: Duration::from_millis(300),
            ..Default::default()
        }
    }

    /// A client of a server that answers every request with `chunks`, but `/small` with its
    /// first two.
    fn answering(
        chunks: Vec<&'static [u8]>,
    ) -> impl Service<Request<()>, Response = Response<LimitedBody<TestBody>>, Error = BoxError>
    {
        LimitsLayer::new(&limits()).layer(tower::service_fn(move |req: Request<()>| {
            let mut chunks = chunks.clone();
            if req.uri().path() == "/small" {
                chunks.truncate(2);
            }
            async move { Ok::<_, BoxError>(Response::new(body_of(chunks))) }
        }))
    }

    async fn read(
        svc: &mut impl Service<
            Request<()>,
            Response = Response<LimitedBody<TestBody>>,
            Error = BoxError,
        >,
        uri: &str,
    ) -> Result<Bytes, LimitError> {
        let res = svc
            .call(Request::get(uri).body(()).unwrap())
            .await
            .map_err(|e| e.downcast_ref::<LimitError>().unwrap().clone())?;
        res.into_body()
            .collect()
            .await
            .map(|c| c.to_bytes())
            .map_err(|e| e.downcast_ref::<LimitError>().unwrap().clone())
    }

    #[tokio::test]
    async fn an_answer_over_the_cap_fails_and_the_cluster_is_left_alone_for_a_while() {
        let mut svc = answering(vec![b"0123456", b"789", b"abc"]);
        let err = read(&mut svc, "/api/v1/nodes").await.unwrap_err();
        assert_eq!(
            err,
            LimitError::TooLarge {
                what: "one answer",
                limit: 10
            }
        );
        // The next request is not sent: the cluster backs off, and says why.
        let err = read(&mut svc, "/small").await.unwrap_err();
        assert!(
            matches!(&err, LimitError::BackingOff { failures: 1, .. }) && err.is_too_large(),
            "{err:?}"
        );
        tokio::time::sleep(BACKOFF_FIRST).await;
        assert!(
            read(&mut svc, "/api/v1/nodes")
                .await
                .unwrap_err()
                .is_too_large()
        );
        // The second failure in a row doubles the wait.
        tokio::time::sleep(BACKOFF_FIRST).await;
        assert!(matches!(
            read(&mut svc, "/small").await.unwrap_err(),
            LimitError::BackingOff { failures: 2, .. }
        ));
        tokio::time::sleep(BACKOFF_FIRST).await;
        assert_eq!(read(&mut svc, "/small").await.unwrap(), "0123456789");
        // An answer read to its end: the next failure waits the first wait again.
        assert!(read(&mut svc, "/api/v1/nodes").await.is_err());
        tokio::time::sleep(BACKOFF_FIRST).await;
        assert_eq!(read(&mut svc, "/small").await.unwrap(), "0123456789");
    }

    #[tokio::test]
    async fn a_watch_is_capped_per_event_and_not_in_total() {
        let mut svc = answering(vec![b"abc\nab", b"cd\n", b"abc\n", b"abc\n"]);
        let uri = "/api/v1/nodes?watch=true&timeoutSeconds=25";
        assert_eq!(read(&mut svc, uri).await.unwrap(), "abc\nabcd\nabc\nabc\n");
        let mut long = answering(vec![b"ab\nabc", b"de\n"]);
        assert_eq!(
            read(&mut long, uri).await.unwrap_err(),
            LimitError::TooLarge {
                what: "one watch event",
                limit: 4
            }
        );
        // A watch's failure is kube-runtime's to back off: the next request goes out.
        assert!(read(&mut long, "/small").await.is_ok());
    }

    #[tokio::test]
    async fn a_cluster_that_holds_its_requests_holds_one_and_times_out() {
        let layer = LimitsLayer::new(&limits());
        let mut svc = layer.layer(tower::service_fn(|_req: Request<()>| async {
            std::future::pending::<Result<Response<TestBody>, BoxError>>().await
        }));
        let started = Instant::now();
        let held = svc.call(Request::patch("/api/v1/nodes/n").body(()).unwrap());
        let busy = svc
            .call(Request::patch("/api/v1/nodes/m").body(()).unwrap())
            .await
            .err()
            .unwrap();
        assert_eq!(
            busy.downcast_ref::<LimitError>(),
            Some(&LimitError::Busy(1))
        );
        assert!(started.elapsed() < Duration::from_millis(100));
        let err = held.await.err().unwrap();
        assert_eq!(
            err.downcast_ref::<LimitError>(),
            Some(&LimitError::Timeout(Duration::from_millis(300)))
        );
        assert!(started.elapsed() >= Duration::from_millis(300));
    }

    #[tokio::test]
    async fn a_trickling_answer_ends_at_the_deadline() {
        let layer = LimitsLayer::new(&limits());
        let mut svc = layer.layer(tower::service_fn(|_req: Request<()>| async {
            let trickle = futures::stream::unfold((), |()| async {
                tokio::time::sleep(Duration::from_millis(50)).await;
                Some((
                    Ok::<_, BoxError>(Frame::data(Bytes::from_static(b"\n"))),
                    (),
                ))
            });
            Ok::<_, BoxError>(Response::new(StreamBody::new(trickle).boxed()))
        }));
        let started = Instant::now();
        let res = svc
            .call(
                Request::get("/api/v1/nodes?watch=1&timeoutSeconds=1")
                    .body(())
                    .unwrap(),
            )
            .await
            .unwrap();
        let err = res.into_body().collect().await.err().unwrap();
        assert_eq!(
            err.downcast_ref::<LimitError>(),
            Some(&LimitError::Timeout(Duration::from_millis(1300)))
        );
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(1300) && took < Duration::from_secs(3),
            "{took:?}"
        );
    }

    #[test]
    fn watches_are_told_from_other_requests() {
        let w = |u: &str| watch_seconds(&u.parse().unwrap());
        assert_eq!(w("/api/v1/nodes?watch=true&timeoutSeconds=25"), Some(25));
        assert_eq!(w("/api/v1/nodes?timeoutSeconds=9999&watch=1"), Some(300));
        assert_eq!(w("/api/v1/nodes?watch=true"), Some(300));
        assert_eq!(w("/api/v1/nodes?limit=100"), None);
        assert_eq!(w("/api/v1/nodes/n"), None);
    }

    #[test]
    fn a_limit_error_is_found_through_kubes_wrappings() {
        let e = LimitError::TooLarge {
            what: "one answer",
            limit: 1,
        };
        let service = kube::Error::Service(Box::new(e.clone()));
        assert_eq!(LimitError::of(&service), Some(&e));
        let events = kube::Error::ReadEvents(std::io::Error::other(kube::Error::Service(
            Box::new(e.clone()),
        )));
        assert_eq!(LimitError::of(&events), Some(&e));
        assert!(describe(&events).starts_with("the cluster sent more than 1 bytes"));
    }
}
