//! Shared by the controller's integration tests: namespaces, the controller running in-process
//! against the test apiserver, polling, and the Cluster API objects the CAPI controllers would
//! create.
#![allow(dead_code)]

pub mod node_boot;
pub mod release;
pub mod scrape;
pub mod topology;

use std::time::Duration;

use anyhow::{Context, Result, bail};
use capk_api::{
    capi::{Cluster, Machine},
    v1alpha1::KVMMachine,
};
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::{
    Api, Client, ResourceExt,
    api::{DeleteParams, Patch, PatchParams, PostParams},
};
use serde_json::json;

/// Creates a namespace (idempotent).
pub async fn create_namespace(client: &Client, ns: &str) -> Result<()> {
    let nsobj: Namespace = serde_json::from_value(json!({"metadata": {"name": ns}}))?;
    match Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &nsobj)
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Runs the controller, watching `ns` only, until the returned sender is dropped.
pub fn start_controller(client: Client, ns: &str) -> tokio::sync::oneshot::Sender<()> {
    start_controller_with(
        client,
        capk_controller::Settings {
            namespace: Some(ns.to_owned()),
            ..Default::default()
        },
    )
}

/// [`start_controller`] with the operator's `settings` (which name the namespace to watch).
#[allow(dead_code)] // not every test binary changes the operator's settings
pub fn start_controller_with(
    client: Client,
    settings: capk_controller::Settings,
) -> tokio::sync::oneshot::Sender<()> {
    // `CAPK_TEST_LOG=capk_controller=debug cargo test ...` shows the controller's logs.
    if let Ok(filter) = std::env::var("CAPK_TEST_LOG") {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_test_writer()
            .try_init();
    }
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(capk_controller::run(client, settings, async {
        let _ = rx.await;
    }));
    tx
}

/// Another etcd + kube-apiserver beside the binary's shared one (a hosting cluster, a cluster
/// where other tests' roles must not show), stopped when the test binary ends. Panics (failing
/// the test) when it cannot start.
pub fn start_env(prefix: &str) -> capk_tests::env::TestEnv {
    let dir = tempfile::Builder::new()
        .prefix(prefix)
        .tempdir()
        .expect("a directory for the apiserver")
        .keep();
    std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("tokio runtime")
            .block_on(capk_tests::env::TestEnv::start(
                capk_tests::env::EnvOptions {
                    dir,
                    stop_with_current_process: true,
                },
            ))
    })
    .join()
    .expect("apiserver thread")
    .unwrap_or_else(|e| panic!("starting another etcd + kube-apiserver failed: {e:#}"))
}

/// Polls `probe` until it returns `Some`, or fails after `secs`.
pub async fn eventually<T, F, Fut>(secs: u64, what: &str, mut probe: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Option<T>>>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    let mut last_error = None;
    loop {
        match probe().await {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(e) => last_error = Some(e),
        }
        if tokio::time::Instant::now() >= deadline {
            match last_error {
                Some(e) => bail!("timed out after {secs}s waiting for {what}; last error: {e:#}"),
                None => bail!("timed out after {secs}s waiting for {what}"),
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A Cluster `demo` whose infrastructure is provisioned (as CAPI records it).
pub async fn provisioned_cluster(client: &Client, ns: &str) -> Result<()> {
    provisioned_cluster_named(client, ns, "demo").await
}

/// [`provisioned_cluster`] of another name.
pub async fn provisioned_cluster_named(client: &Client, ns: &str, cluster: &str) -> Result<()> {
    let clusters: Api<Cluster> = Api::namespaced(client.clone(), ns);
    if clusters.get_opt(cluster).await?.is_some() {
        return Ok(());
    }
    let c: Cluster = serde_json::from_value(json!({
        "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Cluster",
        "metadata": {"name": cluster},
        "spec": {"infrastructureRef": {"apiGroup": "infrastructure.cluster.x-k8s.io",
                                       "kind": "KVMCluster", "name": cluster}},
    }))?;
    clusters.create(&PostParams::default(), &c).await?;
    let status = json!({"status": {"initialization": {"infrastructureProvisioned": true}}});
    clusters
        .patch_status(cluster, &PatchParams::default(), &Patch::Merge(&status))
        .await?;
    Ok(())
}

/// Cluster `demo` (provisioned, as Cluster API records it) and its KVMCluster of `spec`.
pub async fn kvm_cluster(
    client: &Client,
    ns: &str,
    spec: serde_json::Value,
) -> Result<capk_api::v1alpha1::KVMCluster> {
    provisioned_cluster(client, ns).await?;
    let cluster = Api::<Cluster>::namespaced(client.clone(), ns)
        .get("demo")
        .await?;
    let kc: capk_api::v1alpha1::KVMCluster = serde_json::from_value(json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1", "kind": "KVMCluster",
        "metadata": {"name": "demo", "labels": {"cluster.x-k8s.io/cluster-name": "demo"},
            "ownerReferences": [{"apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Cluster",
                                 "name": "demo", "uid": cluster.uid().context("uid")?}]},
        "spec": spec,
    }))?;
    Ok(Api::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &kc)
        .await?)
}

/// A control-plane Machine `name` of cluster `demo` with its bootstrap Secret and KVMMachine.
pub async fn control_plane_machine(
    client: &Client,
    ns: &str,
    name: &str,
    bootstrap: &str,
) -> Result<()> {
    bootstrap_secret(client, ns, name, bootstrap).await?;
    control_plane_machine_without_secret(client, ns, name).await
}

/// The bootstrap data Secret `<name>-bootstrap` (cloud-config), as CABPK writes it.
pub async fn bootstrap_secret(
    client: &Client,
    ns: &str,
    name: &str,
    bootstrap: &str,
) -> Result<()> {
    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": format!("{name}-bootstrap"),
                     "labels": {"cluster.x-k8s.io/cluster-name": "demo"}},
        "type": "cluster.x-k8s.io/secret",
        "stringData": {"value": bootstrap, "format": "cloud-config"},
    }))?;
    Api::<Secret>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &secret)
        .await?;
    Ok(())
}

/// [`control_plane_machine`] whose Machine names a bootstrap Secret that does not exist yet.
pub async fn control_plane_machine_without_secret(
    client: &Client,
    ns: &str,
    name: &str,
) -> Result<()> {
    let spec = json!({
        "resources": {"cpu": 1, "memory": "1Gi", "disk": "20Gi", "dockerVolumeSize": "5Gi"},
        "etcdStorage": {"type": "hostPath", "hostPath": "/var/lib/capk/etcd"},
    });
    control_plane_machine_with_spec(client, ns, name, spec).await
}

/// A control-plane Machine `name` of cluster `demo` and its KVMMachine of `spec`; the Machine
/// names the bootstrap Secret `<name>-bootstrap`.
pub async fn control_plane_machine_with_spec(
    client: &Client,
    ns: &str,
    name: &str,
    spec: serde_json::Value,
) -> Result<()> {
    control_plane_machine_of(client, ns, "demo", name, spec).await
}

/// [`control_plane_machine_with_spec`] in (provisioned) cluster `cluster`.
pub async fn control_plane_machine_of(
    client: &Client,
    ns: &str,
    cluster: &str,
    name: &str,
    spec: serde_json::Value,
) -> Result<()> {
    provisioned_cluster_named(client, ns, cluster).await?;
    let machine: Machine = serde_json::from_value(json!({
        "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine",
        "metadata": {"name": name, "labels": {
            "cluster.x-k8s.io/cluster-name": cluster, "cluster.x-k8s.io/control-plane": ""}},
        "spec": {
            "clusterName": cluster,
            "bootstrap": {"dataSecretName": format!("{name}-bootstrap")},
            "infrastructureRef": {"apiGroup": "infrastructure.cluster.x-k8s.io",
                                  "kind": "KVMMachine", "name": name},
        },
    }))?;
    let machine = Api::<Machine>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &machine)
        .await?;
    let km: KVMMachine = serde_json::from_value(json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1", "kind": "KVMMachine",
        "metadata": {"name": name,
            "labels": {"cluster.x-k8s.io/cluster-name": cluster},
            "ownerReferences": [{"apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine",
                "name": name, "uid": machine.uid().context("uid")?, "controller": true}]},
        "spec": spec,
    }))?;
    Api::<KVMMachine>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &km)
        .await?;
    Ok(())
}

/// A TCP relay on loopback in front of `to` (an apiserver): a cluster whose network can be cut.
/// Closed, it resets every relayed connection and every new one at once, as a partition that
/// the client notices does.
pub struct Relay {
    /// Where clients connect.
    pub addr: std::net::SocketAddr,
    open: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
    /// Connections relayed now.
    connections: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Relay {
    /// Starts relaying to `to`, open.
    pub async fn start(to: std::net::SocketAddr) -> Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (open, rx) = tokio::sync::watch::channel(true);
        let connections = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = connections.clone();
        let task = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                if !*rx.borrow() {
                    continue;
                }
                let mut closed = rx.clone();
                let counted = counted.clone();
                tokio::spawn(async move {
                    let Ok(mut outbound) = tokio::net::TcpStream::connect(to).await else {
                        return;
                    };
                    counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                        _ = closed.wait_for(|o| !*o) => {}
                    }
                    counted.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                });
            }
        });
        Ok(Self {
            addr,
            open,
            task,
            connections,
        })
    }

    /// How many connections it relays now (a client that keeps none open has dropped its link).
    pub fn connections(&self) -> usize {
        self.connections.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Cuts (`false`) or restores (`true`) the connection.
    pub fn set_open(&self, open: bool) {
        let _ = self.open.send(open);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

// A network namespace of its own, for tests whose machine Pods have addresses the controller
// reaches (EndpointSlices refuse loopback addresses), and a stand-in apiserver at such an
// address.

/// Set in the re-run of a test inside its own network namespace.
pub const NETNS_ENV: &str = "CAPK_TEST_IN_NETNS";
/// Pod addresses (TEST-NET-2), on `lo` of the test's network namespace.
pub const POD_NET: &str = "198.51.100";

/// Runs the test `name` of this binary again in a network namespace of its own; `true` in that
/// re-run (go on with the test), `false` in the caller once the re-run passed.
pub fn in_own_netns(name: &str) -> Result<bool> {
    if std::env::var_os(NETNS_ENV).is_some() {
        for args in [
            vec!["link", "set", "lo", "up"],
            vec!["addr", "add", &format!("{POD_NET}.0/24"), "dev", "lo"],
        ] {
            let out = std::process::Command::new("ip").args(&args).output()?;
            anyhow::ensure!(
                out.status.success(),
                "ip {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        return Ok(true);
    }
    let root = std::os::unix::fs::MetadataExt::uid(&std::fs::metadata("/proc/self")?) == 0;
    let mut cmd = std::process::Command::new("unshare");
    if !root {
        cmd.args(["--user", "--map-root-user"]);
    }
    cmd.args(["--net", "--"])
        .arg(std::env::current_exe()?)
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(NETNS_ENV, "1");
    let out = cmd.output().context("run unshare")?;
    print!("{}", String::from_utf8_lossy(&out.stdout));
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    let stderr = String::from_utf8_lossy(&out.stderr);
    if stderr.starts_with("unshare:") {
        anyhow::bail!(
            "this test needs a network namespace of its own: run it as root, or allow \
             unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1); {stderr}"
        );
    }
    anyhow::ensure!(
        out.status.success(),
        "{name} failed in its network namespace ({})",
        out.status
    );
    Ok(false)
}

/// How a stand-in apiserver answers `/readyz`.
pub const READY: u8 = 0;
/// Accepts TCP and TLS, never answers: a hung apiserver, a frozen VM's last breath.
pub const HUNG: u8 = 1;
/// Answers `/readyz` with 500: alive, not ready (etcd slow or down).
pub const NOT_READY: u8 = 2;

/// A TLS server on `<addr>:6443` with a throwaway self-signed certificate, answering
/// `GET /readyz` with 200 `ok` while READY (kube-apiserver's answer when healthy).
pub struct StandInApiServer {
    mode: std::sync::Arc<std::sync::atomic::AtomicU8>,
    task: tokio::task::JoinHandle<()>,
}

impl StandInApiServer {
    pub async fn start(ip: &str) -> Result<Self> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let key = rcgen::generate_simple_self_signed(vec![ip.to_owned()])?;
        let config = rustls::ServerConfig::builder_with_provider(std::sync::Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(
            vec![key.cert.der().clone()],
            rustls::pki_types::PrivateKeyDer::Pkcs8(key.signing_key.serialize_der().into()),
        )?;
        let acceptor = tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config));
        let listener = tokio::net::TcpListener::bind((ip, 6443))
            .await
            .with_context(|| format!("listen on {ip}:6443"))?;
        let mode = std::sync::Arc::new(std::sync::atomic::AtomicU8::new(READY));
        let m = mode.clone();
        let task = tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let (acceptor, m) = (acceptor.clone(), m.clone());
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let mut buf = [0u8; 2048];
                    let Ok(n) = tls.read(&mut buf).await else {
                        return;
                    };
                    if m.load(std::sync::atomic::Ordering::SeqCst) == HUNG {
                        return std::future::pending().await;
                    }
                    let ok = buf[..n].starts_with(b"GET /readyz ");
                    let not_ready = m.load(std::sync::atomic::Ordering::SeqCst) == NOT_READY;
                    let answer: &[u8] = if ok && not_ready {
                        b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                    } else if ok {
                        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
                    } else {
                        b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                    };
                    let _ = tls.write_all(answer).await;
                    let _ = tls.shutdown().await;
                });
            }
        });
        Ok(Self { mode, task })
    }

    pub fn set(&self, mode: u8) {
        self.mode.store(mode, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for StandInApiServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Removes `name`'s finalizers and deletes it, as `clusterctl move` does to the source's copies.
pub async fn delete_without_finalizers<K>(api: &Api<K>, name: &str) -> Result<()>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let patch = json!({"metadata": {"finalizers": null}});
    api.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    api.delete(name, &DeleteParams::default()).await?;
    eventually(30, "object gone", || async {
        Ok(api.get_opt(name).await?.is_none().then_some(()))
    })
    .await
}
