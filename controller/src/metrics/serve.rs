//! The controller's HTTP endpoints. Health (`/healthz`, `/readyz`, `/version`) is plain HTTP on
//! its own port, for the kubelet's probes. `/metrics` is served the way Cluster API's managers
//! serve theirs (controller-runtime's `WithAuthenticationAndAuthorization`): HTTPS, and only to a
//! caller whose bearer token the apiserver accepts (TokenReview) and who may `get` the
//! non-resource URL `/metrics` (SubjectAccessReview; the `capkvm-metrics-reader` ClusterRole
//! grants it). Plain HTTP without either is the operator's explicit choice
//! (`--insecure-diagnostics`).
//!
//! The serving certificate is `tls.crt`/`tls.key` of a directory (a mounted Secret, reread when
//! it changes) or, without one, a self-signed certificate made at start, as controller-runtime
//! does; scrapers skip verification of that one (Cluster API's documented Prometheus setup).

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::{Arc, Mutex, RwLock},
    time::{Duration, Instant, SystemTime},
};

use axum::{
    Router,
    extract::{Request, State},
    http::{StatusCode, header},
    middleware::{self, Next},
    response::{IntoResponse, Response},
    routing::get,
};
use hyper_util::rt::{TokioIo, TokioTimer};
use k8s_openapi::api::{
    authentication::v1::{TokenReview, TokenReviewSpec},
    authorization::v1::{NonResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec},
};
use kube::{Api, Client, api::PostParams};
use rustls::{
    ServerConfig,
    pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, pem::PemObject},
    server::{ClientHello, ResolvesServerCert},
    sign::CertifiedKey,
};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tracing::{debug, info, warn};

use super::Metrics;

/// How long a caller's accepted token and allowed request are remembered
/// (controller-runtime: one minute for tokens, five for allowed requests).
pub const ALLOW_TTL: Duration = Duration::from_secs(60);
/// How long a denied request is remembered (controller-runtime's 30 s).
pub const DENY_TTL: Duration = Duration::from_secs(30);
/// How long a rejected token is remembered.
pub const UNAUTHENTICATED_TTL: Duration = Duration::from_secs(10);
/// Decisions remembered at most; beyond it the oldest go first.
const CACHE_ENTRIES: usize = 1024;
/// The longest bearer token looked at (Kubernetes' tokens are about 1 KiB).
const MAX_TOKEN_BYTES: usize = 16 << 10;
/// Time a client has for its TLS handshake and its request headers.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(10);
/// How often a certificate directory is looked at for a renewed certificate.
const CERT_RECHECK: Duration = Duration::from_secs(10);

/// What failed while setting up the metrics endpoint.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// A certificate or key file could not be read or parsed.
    #[error("read {}: {source}", .path.display())]
    ReadCertificate {
        /// The file.
        path: PathBuf,
        /// Cause.
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    /// The key is of a kind rustls cannot sign with.
    #[error("the key in {} cannot sign TLS handshakes: {source}", .path.display())]
    UnsupportedKey {
        /// The file.
        path: PathBuf,
        /// Cause.
        #[source]
        source: rustls::Error,
    },
    /// Generating the self-signed certificate failed.
    #[error("generate a self-signed serving certificate: {0}")]
    GenerateCertificate(#[source] rcgen::Error),
    /// The TLS configuration was refused.
    #[error("TLS configuration: {0}")]
    Tls(#[source] rustls::Error),
}

/// How `/metrics` is served.
pub enum Serving {
    /// Plain HTTP, no authentication or authorization (`--insecure-diagnostics`).
    Insecure,
    /// HTTPS; callers authenticated and authorized through the apiserver `client` talks to.
    Secure {
        /// The serving certificate.
        tls: Arc<ServerConfig>,
        /// The controller's client (creates TokenReviews and SubjectAccessReviews).
        client: Client,
    },
}

/// The health routes: `/healthz`, `/readyz`, `/version`.
pub fn health_router(m: Arc<Metrics>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/version", get(|| async { env!("CARGO_PKG_VERSION") }))
        .with_state(m)
}

/// The metrics route, `/metrics`, unprotected (see [`serve_metrics`]).
pub fn metrics_router(m: Arc<Metrics>) -> Router {
    Router::new().route("/metrics", get(metrics)).with_state(m)
}

async fn metrics(State(m): State<Arc<Metrics>>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        m.render(),
    )
}

async fn readyz(State(m): State<Arc<Metrics>>) -> impl IntoResponse {
    if m.is_ready() {
        (StatusCode::OK, "ok")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "starting")
    }
}

/// Serves the health routes on `listener` (plain HTTP) until the process ends.
pub async fn serve_health(listener: TcpListener, m: Arc<Metrics>) -> std::io::Result<()> {
    axum::serve(listener, health_router(m)).await
}

/// Serves `/metrics` on `listener` as `serving` says, until the process ends.
pub async fn serve_metrics(listener: TcpListener, m: Arc<Metrics>, serving: Serving) {
    match serving {
        Serving::Insecure => {
            if let Err(e) = axum::serve(listener, metrics_router(m)).await {
                warn!(error = %e, "metrics endpoint stopped");
            }
        }
        Serving::Secure { tls, client } => {
            let authorizer = Arc::new(Authorizer::new(client));
            let app = metrics_router(m).layer(middleware::from_fn_with_state(
                authorizer,
                authenticate_and_authorize,
            ));
            serve_tls(listener, tls, app).await
        }
    }
}

/// Accepts TLS connections on `listener` and serves `app` on each (HTTP/1.1).
async fn serve_tls(listener: TcpListener, tls: Arc<ServerConfig>, app: Router) {
    let acceptor = TlsAcceptor::from(tls);
    loop {
        let tcp = match listener.accept().await {
            Ok((tcp, _)) => tcp,
            Err(e) => {
                // Out of file descriptors and the like: wait rather than spin.
                warn!(error = %e, "accepting a metrics connection failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let (acceptor, app) = (acceptor.clone(), app.clone());
        tokio::spawn(async move {
            let stream = match tokio::time::timeout(CLIENT_TIMEOUT, acceptor.accept(tcp)).await {
                Ok(Ok(stream)) => stream,
                Ok(Err(e)) => {
                    debug!(error = %e, "metrics TLS handshake failed");
                    return;
                }
                Err(_) => {
                    debug!("metrics TLS handshake timed out");
                    return;
                }
            };
            let service = hyper_util::service::TowerToHyperService::new(app);
            let _ = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(CLIENT_TIMEOUT)
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

/// What the apiserver said about a caller's token and request.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Decision {
    Allowed,
    /// The token was not accepted.
    Unauthenticated,
    /// The token's user may not make this request.
    Denied {
        user: String,
    },
}

/// A request as the cache knows it: the caller's token, the verb and the path.
type RequestKey = (String, String, String);

/// Asks the apiserver who a token is (TokenReview) and whether that user may make a request
/// (SubjectAccessReview), remembering the answers for a while.
pub struct Authorizer {
    client: Client,
    cache: Mutex<HashMap<RequestKey, (Instant, Decision)>>,
}

impl Authorizer {
    /// An authorizer asking the apiserver `client` talks to.
    pub fn new(client: Client) -> Self {
        Self {
            client,
            cache: Mutex::default(),
        }
    }

    async fn decide(&self, token: &str, verb: &str, path: &str) -> Result<Decision, kube::Error> {
        let key = (token.to_owned(), verb.to_owned(), path.to_owned());
        if let Some((until, decision)) = self.cache.lock().expect("cache lock").get(&key)
            && *until > Instant::now()
        {
            return Ok(decision.clone());
        }
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: Some(token.to_owned()),
                ..Default::default()
            },
            ..Default::default()
        };
        let review = Api::<TokenReview>::all(self.client.clone())
            .create(&PostParams::default(), &review)
            .await?;
        let status = review.status.unwrap_or_default();
        let decision = match status.user.filter(|_| status.authenticated == Some(true)) {
            None => Decision::Unauthenticated,
            Some(user) => {
                let name = user.username.clone().unwrap_or_default();
                let access = SubjectAccessReview {
                    spec: SubjectAccessReviewSpec {
                        user: user.username,
                        uid: user.uid,
                        groups: user.groups,
                        extra: user.extra,
                        non_resource_attributes: Some(NonResourceAttributes {
                            path: Some(path.to_owned()),
                            verb: Some(verb.to_owned()),
                        }),
                        ..Default::default()
                    },
                    ..Default::default()
                };
                let access = Api::<SubjectAccessReview>::all(self.client.clone())
                    .create(&PostParams::default(), &access)
                    .await?;
                if access.status.is_some_and(|s| s.allowed) {
                    Decision::Allowed
                } else {
                    Decision::Denied { user: name }
                }
            }
        };
        let ttl = match decision {
            Decision::Allowed => ALLOW_TTL,
            Decision::Denied { .. } => DENY_TTL,
            Decision::Unauthenticated => UNAUTHENTICATED_TTL,
        };
        let now = Instant::now();
        let mut cache = self.cache.lock().expect("cache lock");
        if cache.len() >= CACHE_ENTRIES {
            cache.retain(|_, (until, _)| *until > now);
        }
        if cache.len() >= CACHE_ENTRIES
            && let Some(oldest) = cache
                .iter()
                .min_by_key(|(_, (until, _))| *until)
                .map(|(k, _)| k.clone())
        {
            cache.remove(&oldest);
        }
        cache.insert(key, (now + ttl, decision.clone()));
        Ok(decision)
    }
}

/// The bearer token of `req`, if it carries one of bounded length.
fn bearer_token(req: &Request) -> Option<&str> {
    let value = req.headers().get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty() && token.len() <= MAX_TOKEN_BYTES)
        .then_some(token)
}

async fn authenticate_and_authorize(
    State(authorizer): State<Arc<Authorizer>>,
    req: Request,
    next: Next,
) -> Response {
    let Some(token) = bearer_token(&req) else {
        return (StatusCode::UNAUTHORIZED, "Unauthorized").into_response();
    };
    let verb = req.method().as_str().to_ascii_lowercase();
    let path = req.uri().path().to_owned();
    match authorizer.decide(token, &verb, &path).await {
        Ok(Decision::Allowed) => next.run(req).await,
        Ok(Decision::Unauthenticated) => {
            debug!("metrics request with a token the apiserver does not accept");
            (StatusCode::UNAUTHORIZED, "Unauthorized").into_response()
        }
        Ok(Decision::Denied { user }) => {
            debug!(%user, %verb, %path, "metrics request denied");
            (
                StatusCode::FORBIDDEN,
                format!("Authorization denied for user {user}"),
            )
                .into_response()
        }
        Err(e) => {
            warn!(error = %e, "authenticating a metrics request failed");
            (StatusCode::INTERNAL_SERVER_ERROR, "Authentication failed").into_response()
        }
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn server_config(resolver: Arc<dyn ResolvesServerCert>) -> Result<ServerConfig, ServeError> {
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(ServeError::Tls)?
        .with_no_client_auth()
        .with_cert_resolver(resolver);
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}

/// TLS for `/metrics` with `tls.crt` and `tls.key` of `dir`, reread when they change.
pub fn tls_from_dir(dir: &Path) -> Result<Arc<ServerConfig>, ServeError> {
    let resolver = CertDir::load(dir)?;
    Ok(Arc::new(server_config(Arc::new(resolver))?))
}

/// TLS for `/metrics` with a certificate made now, self-signed, for `names` (DNS names or IP
/// addresses); also returns that certificate, for a client that wants to trust it.
pub fn tls_self_signed(
    names: Vec<String>,
) -> Result<(Arc<ServerConfig>, CertificateDer<'static>), ServeError> {
    let generated =
        rcgen::generate_simple_self_signed(names).map_err(ServeError::GenerateCertificate)?;
    let cert = generated.cert.der().clone();
    // rcgen's keys are PKCS#8.
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(
        generated.signing_key.serialize_der(),
    ));
    let key = provider()
        .key_provider
        .load_private_key(key)
        .map_err(ServeError::Tls)?;
    let certified = Arc::new(CertifiedKey::new(vec![cert.clone()], key));
    let resolver = Arc::new(Fixed(certified));
    Ok((Arc::new(server_config(resolver)?), cert))
}

/// The names a self-signed certificate is made for: localhost, the Pod's hostname and the
/// metrics Service in the Pod's namespace (`POD_NAMESPACE`).
pub fn self_signed_names() -> Vec<String> {
    let mut names = vec!["localhost".to_owned(), "127.0.0.1".to_owned()];
    if let Ok(host) = std::fs::read_to_string("/proc/sys/kernel/hostname") {
        let host = host.trim();
        if !host.is_empty() && host != "localhost" {
            names.push(host.to_owned());
        }
    }
    if let Ok(ns) = std::env::var("POD_NAMESPACE")
        && !ns.is_empty()
    {
        names.push(format!("capkvm-controller-metrics.{ns}.svc"));
    }
    names
}

#[derive(Debug)]
struct Fixed(Arc<CertifiedKey>);

impl ResolvesServerCert for Fixed {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.clone())
    }
}

/// A certificate from `tls.crt`/`tls.key` of a directory (a mounted Secret), reread when their
/// modification times change, so that a renewed certificate is served without a restart.
#[derive(Debug)]
struct CertDir {
    dir: PathBuf,
    state: RwLock<CertState>,
}

#[derive(Debug)]
struct CertState {
    checked: Instant,
    modified: Option<(SystemTime, SystemTime)>,
    key: Arc<CertifiedKey>,
}

impl CertDir {
    fn paths(dir: &Path) -> (PathBuf, PathBuf) {
        (dir.join("tls.crt"), dir.join("tls.key"))
    }

    fn modified(dir: &Path) -> Option<(SystemTime, SystemTime)> {
        let (crt, key) = Self::paths(dir);
        let time = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
        Some((time(&crt)?, time(&key)?))
    }

    fn read(dir: &Path) -> Result<Arc<CertifiedKey>, ServeError> {
        let (crt, key) = Self::paths(dir);
        let read_err = |path: &Path| {
            let path = path.to_owned();
            move |source| ServeError::ReadCertificate { path, source }
        };
        let certs = CertificateDer::pem_file_iter(&crt)
            .map_err(read_err(&crt))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(read_err(&crt))?;
        let der = PrivateKeyDer::from_pem_file(&key).map_err(read_err(&key))?;
        let signing = provider()
            .key_provider
            .load_private_key(der)
            .map_err(|source| ServeError::UnsupportedKey {
                path: key.clone(),
                source,
            })?;
        Ok(Arc::new(CertifiedKey::new(certs, signing)))
    }

    fn load(dir: &Path) -> Result<Self, ServeError> {
        let key = Self::read(dir)?;
        info!(dir = %dir.display(), "serving metrics with the certificate of a directory");
        Ok(Self {
            dir: dir.to_owned(),
            state: RwLock::new(CertState {
                checked: Instant::now(),
                modified: Self::modified(dir),
                key,
            }),
        })
    }

    fn current(&self) -> Arc<CertifiedKey> {
        {
            let state = self.state.read().expect("certificate lock");
            if state.checked.elapsed() < CERT_RECHECK {
                return state.key.clone();
            }
        }
        let mut state = self.state.write().expect("certificate lock");
        state.checked = Instant::now();
        let modified = Self::modified(&self.dir);
        if modified.is_some() && modified != state.modified {
            match Self::read(&self.dir) {
                Ok(key) => {
                    info!(dir = %self.dir.display(), "serving the renewed metrics certificate");
                    state.key = key;
                    state.modified = modified;
                }
                // Half-written during an update: the old one serves until the next look.
                Err(e) => warn!(error = %e, "keeping the previous metrics certificate"),
            }
        }
        state.key.clone()
    }
}

impl ResolvesServerCert for CertDir {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(auth: Option<&str>) -> Request {
        let mut b = axum::http::Request::get("/metrics");
        if let Some(a) = auth {
            b = b.header(header::AUTHORIZATION, a);
        }
        b.body(axum::body::Body::empty()).unwrap()
    }

    #[test]
    fn only_a_bounded_bearer_token_is_taken() {
        assert_eq!(bearer_token(&request(Some("Bearer abc"))), Some("abc"));
        assert_eq!(bearer_token(&request(Some("bearer abc"))), Some("abc"));
        assert_eq!(bearer_token(&request(Some("Basic abc"))), None);
        assert_eq!(bearer_token(&request(Some("Bearer "))), None);
        assert_eq!(bearer_token(&request(None)), None);
        let long = format!("Bearer {}", "x".repeat(MAX_TOKEN_BYTES + 1));
        assert_eq!(bearer_token(&request(Some(&long))), None);
    }

    #[test]
    fn a_renewed_certificate_in_the_directory_is_served() {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str| {
            let c = rcgen::generate_simple_self_signed(vec![name.to_owned()]).unwrap();
            std::fs::write(dir.path().join("tls.crt"), c.cert.pem()).unwrap();
            std::fs::write(dir.path().join("tls.key"), c.signing_key.serialize_pem()).unwrap();
            c.cert.der().clone()
        };
        let first = write("first.example");
        let certs = CertDir::load(dir.path()).unwrap();
        assert_eq!(certs.current().cert[0], first);
        std::thread::sleep(Duration::from_millis(20));
        let second = write("second.example");
        // Looked at again only after CERT_RECHECK.
        assert_eq!(certs.current().cert[0], first);
        certs.state.write().unwrap().checked -= CERT_RECHECK;
        assert_eq!(certs.current().cert[0], second);
    }

    #[test]
    fn a_directory_without_a_key_is_an_error_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let c = rcgen::generate_simple_self_signed(vec!["x".to_owned()]).unwrap();
        std::fs::write(dir.path().join("tls.crt"), c.cert.pem()).unwrap();
        let e = CertDir::load(dir.path()).unwrap_err().to_string();
        assert!(e.contains("tls.key"), "{e}");
    }
}
