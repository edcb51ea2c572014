//! The guest apiserver's `/readyz` on the VM IP: part of a control-plane machine's readiness.
//!
//! The probe is capk-readyz's, the one `/readyz` client of the launcher and the controller: the
//! launcher has no cluster CA, so the server certificate is not verified; the answer only gates
//! readiness, no credential is sent and nothing read is trusted beyond the status code.
//! (`/readyz` is readable anonymously in a kubeadm cluster: `system:public-info-viewer`.) This
//! module says why a check failed, in the words of the readiness probe's output.

use std::net::SocketAddr;
use std::time::Duration;

use capk_readyz::{Readyz, ReadyzError};

use crate::health::SharedState;

/// Seconds between two checks.
pub const CHECK_INTERVAL: Duration = Duration::from_secs(5);
/// Time allowed for one check (connect, handshake, answer).
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(3);

/// The launcher's `/readyz` client.
const CLIENT: Readyz = Readyz::new("capk-launcher", CHECK_TIMEOUT);

/// Why a check failed, as the readiness probe reports it (`apiserver <url> not ready: <this>`).
fn reason(e: &ReadyzError) -> String {
    match e {
        ReadyzError::Setup(e) => format!("TLS setup: {e}"),
        ReadyzError::Connect(e) => format!("connect: {e}"),
        ReadyzError::Handshake(e) => format!("TLS handshake: {e}"),
        ReadyzError::Http(e) if e.is_parse() => format!("not an HTTP answer: {e}"),
        ReadyzError::Http(e) if e.is_incomplete_message() => {
            "connection closed before an answer".to_string()
        }
        ReadyzError::Http(e) => format!("HTTP: {e}"),
        ReadyzError::Status(code) => format!("answered HTTP {code}"),
        ReadyzError::Timeout { .. } => format!("no answer within {}s", CHECK_TIMEOUT.as_secs()),
    }
}

/// One `GET https://<addr>/readyz`: Ok when the apiserver answers 200.
pub async fn readyz(addr: SocketAddr) -> Result<(), String> {
    CLIENT.probe(addr).await.map_err(|e| reason(&e))
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
    use tokio::io::AsyncWriteExt;

    #[test]
    fn reasons_name_the_status_and_the_timeout() {
        assert_eq!(reason(&ReadyzError::Status(500)), "answered HTTP 500");
        assert_eq!(
            reason(&ReadyzError::Timeout { connected: true }),
            "no answer within 3s"
        );
        assert_eq!(
            reason(&ReadyzError::Timeout { connected: false }),
            "no answer within 3s"
        );
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
