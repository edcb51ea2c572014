//! The guest apiserver's `/readyz` on the VM IP: part of a control-plane machine's readiness.
//!
//! The launcher has no cluster CA, so the server certificate is not verified: the answer only
//! gates readiness, no credential is sent and nothing read is trusted beyond the status code.
//! (`/readyz` is readable anonymously in a kubeadm cluster: `system:public-info-viewer`.)

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, verify_tls12_signature, verify_tls13_signature};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, SignatureScheme};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

use crate::health::SharedState;

/// Seconds between two checks.
pub const CHECK_INTERVAL: Duration = Duration::from_secs(5);
/// Time allowed for one check (connect, handshake, answer).
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(3);

/// Accepts any server certificate but still checks the handshake signatures.
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

fn connector() -> Result<TlsConnector, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS setup: {e}"))?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyServerCert(provider)))
        .with_no_client_auth();
    Ok(TlsConnector::from(Arc::new(config)))
}

/// The HTTP status of an answer head, once the head is complete.
fn status_of(head: &[u8]) -> Result<Option<u16>, String> {
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut resp = httparse::Response::new(&mut headers);
    match resp.parse(head) {
        Ok(httparse::Status::Complete(_)) => Ok(resp.code),
        Ok(httparse::Status::Partial) => Ok(None),
        Err(e) => Err(format!("not an HTTP answer: {e}")),
    }
}

/// One `GET https://<addr>/readyz`: Ok when the apiserver answers 200.
pub async fn readyz(addr: SocketAddr) -> Result<(), String> {
    let work = async {
        let tcp = TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let name = ServerName::IpAddress(addr.ip().into());
        let mut tls = connector()?
            .connect(name, tcp)
            .await
            .map_err(|e| format!("TLS handshake: {e}"))?;
        let request = format!(
            "GET /readyz HTTP/1.1\r\nHost: {addr}\r\nUser-Agent: capk-launcher\r\nAccept: */*\r\nConnection: close\r\n\r\n"
        );
        tls.write_all(request.as_bytes())
            .await
            .map_err(|e| format!("send: {e}"))?;
        let mut head = Vec::new();
        let mut buf = [0u8; 1024];
        loop {
            let n = tls.read(&mut buf).await.map_err(|e| format!("read: {e}"))?;
            if n == 0 {
                return Err("connection closed before an answer".to_string());
            }
            head.extend_from_slice(&buf[..n]);
            if let Some(code) = status_of(&head)? {
                return if code == 200 {
                    Ok(())
                } else {
                    Err(format!("answered HTTP {code}"))
                };
            }
            if head.len() > 16 * 1024 {
                return Err("answer head too large".to_string());
            }
        }
    };
    tokio::time::timeout(CHECK_TIMEOUT, work)
        .await
        .map_err(|_| format!("no answer within {}s", CHECK_TIMEOUT.as_secs()))?
}

/// Checks `/readyz` every [`CHECK_INTERVAL`] and records the result in the launcher state.
pub async fn follow_readyz(addr: SocketAddr, state: SharedState) {
    loop {
        let result = readyz(addr).await;
        if let Some(r) = state.lock().await.apiserver.as_mut() {
            r.last = Some(result);
        }
        tokio::time::sleep(CHECK_INTERVAL).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_status_of_complete_heads_only() {
        assert_eq!(status_of(b"HTTP/1.1 200 OK\r\n"), Ok(None));
        assert_eq!(
            status_of(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"),
            Ok(Some(200))
        );
        assert_eq!(
            status_of(b"HTTP/1.0 500 Internal Server Error\r\n\r\n"),
            Ok(Some(500))
        );
        assert!(status_of(b"\x16\x03\x01garbage\r\n\r\n").is_err());
    }

    #[tokio::test]
    async fn a_closed_port_is_not_ready() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        drop(l);
        let e = readyz(addr).await.unwrap_err();
        assert!(e.starts_with("connect: "), "{e}");
    }

    #[tokio::test]
    async fn a_plain_http_server_fails_the_handshake() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let _ = s.write_all(b"HTTP/1.1 200 OK\r\n\r\n").await;
        });
        let e = readyz(addr).await.unwrap_err();
        assert!(e.starts_with("TLS handshake: "), "{e}");
    }
}
