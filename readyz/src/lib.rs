//! `capk-readyz`: the one client for a Kubernetes apiserver's `/readyz`, used by the controller
//! (whether a control-plane machine takes the control-plane Service's traffic,
//! `capk_controller::remote::apiserver_health`) and by the launcher (part of a control-plane machine's
//! readiness, `capk_launcher::apiserver`). Each says in its own words why a probe failed; this
//! crate says what happened ([`ReadyzError`]).
//!
//! Only liveness is judged: no credential is sent and the server certificate is not verified
//! (neither has the workload cluster's CA; nothing read is trusted beyond the status code), while
//! the handshake's signatures still are. `/readyz` is readable anonymously in a kubeadm cluster
//! (`system:public-info-viewer`). Each probe is a fresh TCP connection and TLS handshake (a pooled
//! connection would hide a VM that stopped accepting new ones) and one HTTP/1.1 GET (hyper) of
//! which only the answer's head is read, at most [`MAX_HEAD`] bytes of it.
#![forbid(unsafe_code)]

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use http_body_util::Empty;
use hyper::{Request, StatusCode, header};
use hyper_util::rt::TokioIo;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, verify_tls12_signature, verify_tls13_signature};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, SignatureScheme};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

/// The most of an answer buffered before its head is complete (hyper's read buffer): an answer
/// head is small; a peer sending more is not an apiserver.
pub const MAX_HEAD: usize = 16 * 1024;

/// Why a probe did not count as an answer.
#[derive(Debug, thiserror::Error)]
pub enum ReadyzError {
    /// The TLS client could not be built (the crypto provider has no safe protocol version).
    #[error("TLS setup: {0}")]
    Setup(String),
    /// No TCP connection (refused, unreachable, ...).
    #[error("connect: {0}")]
    Connect(io::Error),
    /// TCP connected, TLS did not (not a TLS server, or it broke off).
    #[error("TLS handshake: {0}")]
    Handshake(io::Error),
    /// TLS connected, no HTTP answer (closed early, not HTTP, head larger than [`MAX_HEAD`]).
    #[error("HTTP: {0}")]
    Http(hyper::Error),
    /// An answer, but not 200: the apiserver is not ready (or not an apiserver).
    #[error("/readyz answered HTTP {0}")]
    Status(u16),
    /// No answer within the probe's timeout; `connected` when the TCP connection was accepted
    /// (the guest runs, its apiserver is hung or slow) rather than not made at all (a frozen VM).
    #[error("no answer in time (TCP connected: {connected})")]
    Timeout { connected: bool },
}

/// A `/readyz` client: who it says it is and how long one probe may take.
#[derive(Clone, Copy, Debug)]
pub struct Readyz {
    user_agent: &'static str,
    timeout: Duration,
}

impl Readyz {
    /// A client sending `User-Agent: user_agent` whose probes end after `timeout` (connect, TLS
    /// handshake and the answer's head together).
    pub const fn new(user_agent: &'static str, timeout: Duration) -> Self {
        Self {
            user_agent,
            timeout,
        }
    }

    /// The time one probe may take.
    pub const fn timeout(&self) -> Duration {
        self.timeout
    }

    /// One `GET https://<addr>/readyz`: `Ok` when the apiserver answers 200 in time.
    pub async fn probe(&self, addr: SocketAddr) -> Result<(), ReadyzError> {
        let connected = AtomicBool::new(false);
        match tokio::time::timeout(self.timeout, self.get(addr, &connected)).await {
            Ok(result) => result,
            Err(_) => Err(ReadyzError::Timeout {
                connected: connected.load(Ordering::Relaxed),
            }),
        }
    }

    async fn get(&self, addr: SocketAddr, connected: &AtomicBool) -> Result<(), ReadyzError> {
        let tls = connector()
            .as_ref()
            .map_err(|e| ReadyzError::Setup(e.clone()))?;
        let tcp = TcpStream::connect(addr)
            .await
            .map_err(ReadyzError::Connect)?;
        connected.store(true, Ordering::Relaxed);
        let stream = tls
            .connect(ServerName::IpAddress(addr.ip().into()), tcp)
            .await
            .map_err(ReadyzError::Handshake)?;
        let (mut sender, conn) = hyper::client::conn::http1::Builder::new()
            .max_buf_size(MAX_HEAD)
            .handshake(TokioIo::new(stream))
            .await
            .map_err(ReadyzError::Http)?;
        let request = Request::get("/readyz")
            .header(header::HOST, addr.to_string())
            .header(header::USER_AGENT, self.user_agent)
            .header(header::ACCEPT, "*/*")
            .header(header::CONNECTION, "close")
            .body(Empty::<&'static [u8]>::new())
            .expect("a GET with fixed, valid headers");
        // The connection is driven only until the answer's head arrives; the body is not read.
        let mut conn = std::pin::pin!(conn);
        let mut send = std::pin::pin!(sender.send_request(request));
        let response = tokio::select! {
            biased;
            r = &mut send => r,
            // The server may answer and close at once: the answer is then with `send`.
            r = &mut conn => match r {
                Ok(()) => send.await,
                Err(e) => return Err(ReadyzError::Http(e)),
            },
        }
        .map_err(ReadyzError::Http)?;
        match response.status() {
            StatusCode::OK => Ok(()),
            other => Err(ReadyzError::Status(other.as_u16())),
        }
    }
}

/// The TLS client, built once: any server certificate (see the crate comment), handshake
/// signatures still checked.
fn connector() -> &'static Result<TlsConnector, String> {
    static CONNECTOR: OnceLock<Result<TlsConnector, String>> = OnceLock::new();
    CONNECTOR.get_or_init(|| {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AnyServerCert(provider)))
            .with_no_client_auth();
        Ok(TlsConnector::from(Arc::new(config)))
    })
}

/// Accepts any server certificate (no cluster CA to verify it against; only liveness is
/// judged), but checks the handshake's signatures with the provider's algorithms.
#[derive(Debug)]
struct AnyServerCert(Arc<CryptoProvider>);

impl ServerCertVerifier for AnyServerCert {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

#[cfg(any(test, feature = "testsupport"))]
pub mod testsupport;

#[cfg(test)]
mod tests {
    use super::*;

    use tokio::io::AsyncWriteExt;

    use crate::testsupport::{Answer, tls_server};

    const CLIENT: Readyz = Readyz::new("capk-readyz-test", Duration::from_secs(2));

    #[tokio::test]
    async fn a_self_signed_apiserver_answering_200_is_ready_and_sees_one_plain_get() {
        let (addr, mut requests) = tls_server(Answer::status(200)).await;
        CLIENT.probe(addr).await.unwrap();
        let request = requests.recv().await.unwrap();
        assert!(request.starts_with("GET /readyz HTTP/1.1\r\n"), "{request}");
        for header in [
            format!("host: {addr}\r\n"),
            "user-agent: capk-readyz-test\r\n".into(),
        ] {
            assert!(request.to_lowercase().contains(&header), "{request}");
        }
        assert!(
            !request.to_lowercase().contains("authorization"),
            "no credential is sent: {request}"
        );
    }

    #[tokio::test]
    async fn any_other_status_is_reported_as_it_is() {
        for code in [500, 401, 404] {
            let (addr, _) = tls_server(Answer::status(code)).await;
            let e = CLIENT.probe(addr).await.unwrap_err();
            assert!(matches!(e, ReadyzError::Status(c) if c == code), "{e}");
        }
    }

    #[tokio::test]
    async fn a_hung_apiserver_times_out_connected() {
        let (addr, _) = tls_server(Answer::Hang).await;
        let started = std::time::Instant::now();
        let e = CLIENT.probe(addr).await.unwrap_err();
        assert!(matches!(e, ReadyzError::Timeout { connected: true }), "{e}");
        let waited = started.elapsed();
        assert!(
            waited >= CLIENT.timeout() && waited < CLIENT.timeout() + Duration::from_secs(3),
            "{waited:?}"
        );
    }

    #[tokio::test]
    async fn a_closed_port_a_plain_http_server_and_a_garbage_answer_are_told_apart() {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = closed.local_addr().unwrap();
        drop(closed);
        let e = CLIENT.probe(addr).await.unwrap_err();
        assert!(
            matches!(&e, ReadyzError::Connect(err) if err.kind() == io::ErrorKind::ConnectionRefused),
            "{e}"
        );

        let plain = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = plain.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = plain.accept().await.unwrap();
            let _ = s.write_all(b"HTTP/1.1 200 OK\r\n\r\nok").await;
        });
        let e = CLIENT.probe(addr).await.unwrap_err();
        assert!(matches!(e, ReadyzError::Handshake(_)), "{e}");

        let (addr, _) = tls_server(Answer::Head("SSH-2.0-OpenSSH\r\n\r\n".into())).await;
        let e = CLIENT.probe(addr).await.unwrap_err();
        assert!(matches!(&e, ReadyzError::Http(h) if h.is_parse()), "{e}");

        let (addr, _) = tls_server(Answer::Head(String::new())).await;
        let e = CLIENT.probe(addr).await.unwrap_err();
        assert!(
            matches!(e, ReadyzError::Http(_)),
            "closed without an answer: {e}"
        );
    }

    #[tokio::test]
    async fn an_answer_head_larger_than_the_cap_is_refused() {
        let huge = format!(
            "HTTP/1.1 200 OK\r\nX-Filler: {}\r\n\r\n",
            "a".repeat(2 * MAX_HEAD)
        );
        let (addr, _) = tls_server(Answer::Head(huge)).await;
        let e = CLIENT.probe(addr).await.unwrap_err();
        assert!(
            matches!(&e, ReadyzError::Http(h) if h.is_parse() && h.to_string().contains("too large")),
            "{e}"
        );
    }
}
