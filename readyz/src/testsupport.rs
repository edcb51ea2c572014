//! A test apiserver for the tests of `/readyz` clients (this crate's, the controller's): TLS on
//! loopback with a self-signed certificate, as kubeadm's apiserver looks to a client without the
//! cluster CA, answering every request as told. Feature `testsupport`, for dev-dependencies only.

use std::net::SocketAddr;
use std::sync::Arc;

use rustls::ServerConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;

/// How the test apiserver answers every request.
#[derive(Clone, Debug)]
pub enum Answer {
    /// These bytes (an answer head, maybe a body, or anything else), then close.
    Head(String),
    /// Accepts TCP and TLS, reads the request, never answers.
    Hang,
}

impl Answer {
    /// A complete answer with this status code and a short body.
    pub fn status(code: u16) -> Self {
        Self::Head(format!(
            "HTTP/1.1 {code} X\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
        ))
    }
}

/// Starts a test apiserver on a free port of 127.0.0.1, in the running tokio runtime, for as long
/// as the runtime runs. Returns its address and the first requests it read (their first KiB; the
/// first 8 are kept).
pub async fn tls_server(answer: Answer) -> (SocketAddr, mpsc::Receiver<String>) {
    let key = rcgen::generate_simple_self_signed(vec!["apiserver".into()]).unwrap();
    let config =
        ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(
                vec![key.cert.der().clone()],
                rustls::pki_types::PrivateKeyDer::Pkcs8(key.signing_key.serialize_der().into()),
            )
            .unwrap();
    let acceptor = TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (requests, received) = mpsc::channel(8);
    tokio::spawn(async move {
        loop {
            let (tcp, _) = listener.accept().await.unwrap();
            let (acceptor, answer, requests) = (acceptor.clone(), answer.clone(), requests.clone());
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let mut buf = [0u8; 1024];
                let n = tls.read(&mut buf).await.unwrap_or(0);
                // Never waits for the test to read: a full queue drops the request.
                let _ = requests.try_send(String::from_utf8_lossy(&buf[..n]).into_owned());
                match answer {
                    Answer::Head(head) => {
                        let _ = tls.write_all(head.as_bytes()).await;
                        let _ = tls.shutdown().await;
                    }
                    Answer::Hang => std::future::pending::<()>().await,
                }
            });
        }
    });
    (addr, received)
}
