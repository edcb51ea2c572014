//! Reading the controller's `/metrics` as a scraper does: HTTPS with a ServiceAccount token.

use std::sync::Arc;

use anyhow::{Context, Result};
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use k8s_openapi::api::core::v1::ServiceAccount;
use kube::{Api, Client, api::PostParams};
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::{Value, json};

/// A token of ServiceAccount `ns/name` (made if missing), as `kubectl create token` gives one.
pub async fn token_for(admin: &Client, ns: &str, name: &str) -> Result<String> {
    let sas: Api<ServiceAccount> = Api::namespaced(admin.clone(), ns);
    let sa = serde_json::from_value(json!({"metadata": {"name": name}}))?;
    match sas.create(&PostParams::default(), &sa).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(e) => return Err(e.into()),
    }
    let req = json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                     "spec": {"expirationSeconds": 3600}});
    let resp: Value = sas
        .create_subresource("token", name, &PostParams::default(), &req)
        .await?;
    Ok(resp["status"]["token"]
        .as_str()
        .context("TokenRequest without a token")?
        .to_owned())
}

/// `GET https://localhost:<port><path>`, trusting only `ca`, with `token` as the bearer token;
/// returns the status code and the body.
pub async fn https_get(
    port: u16,
    path: &str,
    token: Option<&str>,
    ca: &CertificateDer<'static>,
) -> Result<(u16, String)> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.clone())?;
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from("localhost")?, tcp)
        .await
        .context("TLS handshake with the metrics endpoint")?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await?;
    tokio::spawn(conn);
    let mut req = hyper::Request::get(path).header("host", "localhost");
    if let Some(t) = token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    let resp = sender
        .send_request(req.body(Empty::<Bytes>::new())?)
        .await?;
    let code = resp.status().as_u16();
    let body = resp.into_body().collect().await?.to_bytes();
    Ok((code, String::from_utf8_lossy(&body).into_owned()))
}
