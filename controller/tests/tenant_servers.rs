//! A tenant's `<cluster>-kubeconfig` may point at a server of the tenant's own. Here that server
//! runs on loopback (HTTPS, with a CA the kubeconfig carries, as Cluster API writes one) and
//! misbehaves as a tenant's could: it answers the Node list with a NodeList that never ends, or
//! it answers list and watch and then holds every PATCH of a Node. The controller stays within
//! its memory, says what is wrong on the tenant's own machine, and another tenant's machine gets
//! its Pod within seconds meanwhile.
//!
//! Each test runs its own etcd + kube-apiserver and a controller watching every namespace, as
//! one shipped to a management cluster does.

mod support;

use std::{
    convert::Infallible,
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use base64::Engine;

use capk_api::v1alpha1::KVMMachine;
use futures::StreamExt;
use http_body_util::{BodyExt, StreamBody, combinators::BoxBody};
use hyper::{
    Request, Response,
    body::{Bytes, Frame},
};
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::{Api, Client, api::PostParams};
use serde_json::json;
use support::{create_namespace, eventually, start_controller_with, start_env};

const GATE: &str = "infrastructure.cluster.x-k8s.io/node-ready";

/// How the tenant's server answers.
#[derive(Clone, Copy)]
enum Behaviour {
    /// `GET /api/v1/nodes` (a list) is a NodeList whose items never end, sent as fast as the
    /// client reads.
    EndlessNodeList,
    /// `GET /api/v1/nodes` (a list) is a page of 100 new Nodes with 20 KiB names and a
    /// `continue` to the next page, without end.
    EndlessPages,
    /// Lists the Nodes named, each Ready and without a providerID (so the controller sets it);
    /// a watch stays open, quiet; every PATCH is held, never answered.
    HoldPatches(&'static [&'static str]),
}

/// What the tenant's server saw.
#[derive(Default)]
struct Seen {
    /// Bytes of NodeList sent.
    sent: AtomicU64,
    /// List pages sent.
    pages: AtomicUsize,
    /// PATCHes received.
    patches: AtomicUsize,
    /// PATCHes held now (their connection still open).
    held: AtomicUsize,
    /// The most PATCHes held at once.
    most_held: AtomicUsize,
}

/// A PATCH held; counted as held until the client gives up on it.
struct Held(Arc<Seen>);

impl Held {
    fn new(seen: &Arc<Seen>) -> Self {
        seen.patches.fetch_add(1, Ordering::SeqCst);
        let now = seen.held.fetch_add(1, Ordering::SeqCst) + 1;
        seen.most_held.fetch_max(now, Ordering::SeqCst);
        Self(seen.clone())
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.0.held.fetch_sub(1, Ordering::SeqCst);
    }
}

type Body = BoxBody<Bytes, Infallible>;

fn full(status: u16, body: serde_json::Value) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(
            http_body_util::Full::new(Bytes::from(body.to_string()))
                .map_err(|e| match e {})
                .boxed(),
        )
        .expect("response")
}

fn is_watch(req: &Request<hyper::body::Incoming>) -> bool {
    req.uri()
        .query()
        .is_some_and(|q| q.split('&').any(|kv| kv == "watch=true" || kv == "watch=1"))
}

async fn answer(
    behaviour: Behaviour,
    seen: Arc<Seen>,
    req: Request<hyper::body::Incoming>,
) -> Result<Response<Body>, Infallible> {
    let nodes = req.uri().path() == "/api/v1/nodes";
    let response = match behaviour {
        Behaviour::EndlessNodeList if nodes && !is_watch(&req) => {
            let head = Bytes::from_static(
                br#"{"kind":"NodeList","apiVersion":"v1","metadata":{"resourceVersion":"1"},"items":["#,
            );
            let item = r#"{"metadata":{"name":"endless"},"status":{}},"#;
            let chunk = Bytes::from(item.repeat((64 << 10) / item.len()));
            let frames = futures::stream::once(async move { head })
                .chain(futures::stream::repeat_with(move || chunk.clone()))
                .map(move |b| {
                    seen.sent.fetch_add(b.len() as u64, Ordering::Relaxed);
                    Ok::<_, Infallible>(Frame::data(b))
                });
            Response::builder()
                .header("content-type", "application/json")
                .body(BodyExt::boxed(StreamBody::new(frames)))
                .expect("response")
        }
        Behaviour::EndlessPages if nodes && !is_watch(&req) => {
            let page: usize = req
                .uri()
                .query()
                .and_then(|q| q.split('&').find_map(|kv| kv.strip_prefix("continue=")))
                .and_then(|p| p.parse().ok())
                .unwrap_or(0);
            seen.pages.fetch_add(1, Ordering::SeqCst);
            let items: Vec<_> = (0..100)
                .map(|i| {
                    let name = format!("p{page}-n{i}-{}", "x".repeat(20 << 10));
                    json!({"metadata": {"name": name, "resourceVersion": "1"}})
                })
                .collect();
            let list = json!({"kind": "NodeList", "apiVersion": "v1",
                "metadata": {"resourceVersion": "1", "continue": (page + 1).to_string()},
                "items": items});
            let body = list.to_string();
            seen.sent.fetch_add(body.len() as u64, Ordering::Relaxed);
            full(200, list)
        }
        Behaviour::HoldPatches(names) if req.method() == hyper::Method::PATCH => {
            let _held = Held::new(&seen);
            std::future::pending::<()>().await;
            unreachable!("a held PATCH is never answered: {names:?}")
        }
        Behaviour::HoldPatches(_) if nodes && is_watch(&req) => {
            // Open and quiet until the watch's own timeout.
            let quiet = futures::stream::once(async {
                tokio::time::sleep(Duration::from_secs(20)).await;
                Ok::<_, Infallible>(Frame::data(Bytes::new()))
            });
            Response::builder()
                .header("content-type", "application/json")
                .body(BodyExt::boxed(StreamBody::new(quiet)))
                .expect("response")
        }
        Behaviour::HoldPatches(names) if nodes => {
            let ready = json!([{"type": "Ready", "status": "True", "reason": "KubeletReady",
                "message": "kubelet is posting ready status",
                "lastHeartbeatTime": "2026-01-01T00:00:00Z",
                "lastTransitionTime": "2026-01-01T00:00:00Z"}]);
            let items: Vec<_> = names
                .iter()
                .map(|n| {
                    json!({"metadata": {"name": n, "uid": format!("uid-{n}"),
                    "resourceVersion": "1"}, "status": {"conditions": ready}})
                })
                .collect();
            full(
                200,
                json!({"kind": "NodeList", "apiVersion": "v1",
                    "metadata": {"resourceVersion": "1"}, "items": items}),
            )
        }
        _ => full(
            404,
            json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                "reason": "NotFound", "code": 404, "message": "not here"}),
        ),
    };
    Ok(response)
}

/// The tenant's server: HTTPS on loopback with a certificate of its own CA.
struct TenantServer {
    addr: SocketAddr,
    ca_pem: String,
    seen: Arc<Seen>,
    task: tokio::task::JoinHandle<()>,
}

impl TenantServer {
    async fn start(behaviour: Behaviour) -> Result<Self> {
        let ca_key = rcgen::KeyPair::generate()?;
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new())?;
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca = ca_params.self_signed(&ca_key)?;
        let issuer = rcgen::Issuer::new(ca_params, ca_key);
        let key = rcgen::KeyPair::generate()?;
        let cert = rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned()])?
            .signed_by(&key, &issuer)?;
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(
            vec![cert.der().clone()],
            rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
        )?;
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let seen = Arc::new(Seen::default());
        let counted = seen.clone();
        let task = tokio::spawn(async move {
            // Dropped with the server: every connection ends with it.
            let mut connections = tokio::task::JoinSet::new();
            while let Ok((tcp, _)) = listener.accept().await {
                let (acceptor, seen) = (acceptor.clone(), counted.clone());
                connections.spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let service =
                        hyper::service::service_fn(move |req| answer(behaviour, seen.clone(), req));
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(tls), service)
                        .await;
                });
            }
        });
        Ok(Self {
            addr,
            ca_pem: ca.pem(),
            seen,
            task,
        })
    }

    /// The Secret `<cluster>-kubeconfig` as Cluster API writes it, naming this server.
    fn kubeconfig_secret(&self, cluster: &str) -> Result<Secret> {
        let ca = base64::engine::general_purpose::STANDARD.encode(&self.ca_pem);
        let kubeconfig = format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: admin@{cluster}\n\
             clusters:\n- name: {cluster}\n  cluster:\n    server: https://{}\n    \
             certificate-authority-data: {ca}\n\
             contexts:\n- name: admin@{cluster}\n  context: {{cluster: {cluster}, user: admin}}\n\
             users:\n- name: admin\n  user:\n    token: tenant-token\n",
            self.addr
        );
        Ok(serde_json::from_value(json!({
            "metadata": {"name": format!("{cluster}-kubeconfig"),
                         "labels": {"cluster.x-k8s.io/cluster-name": cluster}},
            "type": "cluster.x-k8s.io/secret",
            "stringData": {"value": kubeconfig},
        }))?)
    }
}

impl Drop for TenantServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A management cluster of the test's own, and the controller as shipped: every namespace.
async fn management_cluster(prefix: &str) -> Result<(Client, tokio::sync::oneshot::Sender<()>)> {
    let env = Box::leak(Box::new(start_env(prefix)));
    let mc = env.client().await?;
    let stop = start_controller_with(mc.clone(), capk_controller::Settings::default());
    Ok((mc, stop))
}

/// A control-plane machine `name` of `cluster` in `ns`, with its bootstrap data.
async fn machine(mc: &Client, ns: &str, cluster: &str, name: &str) -> Result<()> {
    support::bootstrap_secret(mc, ns, name, "#cloud-config\nruncmd:\n- echo ok\n").await?;
    let spec = json!({"resources": {"cpu": 1, "memory": "1Gi", "disk": "20Gi"}});
    support::control_plane_machine_of(mc, ns, cluster, name, spec).await
}

fn gate_reason(pod: &Pod) -> Option<String> {
    pod.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == GATE)
        .and_then(|c| c.reason.clone())
}

fn node_ready(km: &KVMMachine) -> Option<(String, String)> {
    km.status
        .as_ref()?
        .contract
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "NodeReady")
        .map(|c| (c.reason.clone(), c.message.clone()))
}

/// This process's resident memory, bytes.
fn rss() -> Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .context("VmRSS in /proc/self/status")?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()?;
    Ok(kib << 10)
}

/// More memory than the controller may take for one tenant: the default cap on one answer
/// (4 MiB) held as bytes, as text and as objects, and the cap on one cluster's cached Nodes
/// (16 MiB), with room for the allocator.
const MEMORY_FOR_ONE_TENANT: u64 = 64 << 20;

/// The tests that measure this process's memory run one at a time.
static MEASURING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// This process's memory since a start, checked on every step of a test: the test ends at once
/// when it grew too much (a server would send gigabytes to a controller that buffers them).
struct Memory<'a> {
    before: u64,
    peak: u64,
    server: &'a TenantServer,
}

impl<'a> Memory<'a> {
    fn from_now(server: &'a TenantServer) -> Result<Self> {
        let before = rss()?;
        Ok(Self {
            before,
            peak: before,
            server,
        })
    }

    fn check(&mut self) -> Result<()> {
        self.peak = self.peak.max(rss()?);
        let grown = self.grown();
        if grown > MEMORY_FOR_ONE_TENANT {
            bail!(
                "the controller's process grew by {} MiB while the tenant's server sent {} MiB",
                grown >> 20,
                self.server.seen.sent.load(Ordering::Relaxed) >> 20
            );
        }
        Ok(())
    }

    fn grown(&self) -> u64 {
        self.peak.saturating_sub(self.before)
    }

    /// The message of machine `name`'s NodeReady condition once its reason is `reason`, within
    /// `secs`.
    async fn until_node_ready(
        &mut self,
        kms: &Api<KVMMachine>,
        name: &str,
        reason: &str,
        secs: u64,
    ) -> Result<String> {
        let started = Instant::now();
        loop {
            self.check()?;
            let km = kms.get(name).await?;
            if let Some((_, message)) = node_ready(&km).filter(|(r, _)| r == reason) {
                return Ok(message);
            }
            if started.elapsed() > Duration::from_secs(secs) {
                bail!(
                    "NodeReady of {name} is not {reason} after {secs}s: {:?}",
                    node_ready(&km)
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Keeps checking for `secs`.
    async fn hold_for(&mut self, secs: u64) -> Result<()> {
        let until = Instant::now() + Duration::from_secs(secs);
        while Instant::now() < until {
            self.check()?;
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Ok(())
    }
}

/// A tenant's cluster `cluster` in namespace `ns` with one machine `<cluster>-cp-0`, whose Pod
/// exists: what it needs before its kubeconfig Secret is written.
async fn tenant(mc: &Client, ns: &str, cluster: &str) -> Result<String> {
    create_namespace(mc, ns).await?;
    let name = format!("{cluster}-cp-0");
    machine(mc, ns, cluster, &name).await?;
    let pods: Api<Pod> = Api::namespaced(mc.clone(), ns);
    eventually(30, "the tenant's machine Pod", || async {
        Ok(pods.get_opt(&name).await?)
    })
    .await?;
    Ok(name)
}

/// A tenant's server answers the Node list with a NodeList that never ends: the controller reads
/// up to its cap, drops it, and the tenant's machine says why within seconds; its memory grows
/// by a few MiB, not by what the server sends (on the controller as first shipped: 475 MiB
/// buffered, RSS 988 MiB, then OOM-killed in a real management cluster).
#[tokio::test]
async fn an_endless_node_list_is_cut_at_the_cap_and_said_on_the_machine() -> Result<()> {
    let (mc, _stop) = management_cluster("capk-endless-").await?;
    let ns = "tenant-endless";
    let name = tenant(&mc, ns, "big").await?;
    let server = TenantServer::start(Behaviour::EndlessNodeList).await?;
    let _one = MEASURING.lock().await;
    let mut memory = Memory::from_now(&server)?;
    Api::<Secret>::namespaced(mc.clone(), ns)
        .create(&PostParams::default(), &server.kubeconfig_secret("big")?)
        .await?;
    let linked = Instant::now();
    let kms: Api<KVMMachine> = Api::namespaced(mc.clone(), ns);
    let message = memory
        .until_node_ready(&kms, &name, "WorkloadClusterAnswerTooLarge", 30)
        .await?;
    let reported = linked.elapsed();
    assert!(
        message.contains("more than 4194304 bytes in one answer"),
        "{message}"
    );
    assert!(
        reported < Duration::from_secs(15),
        "reported after {reported:?}"
    );
    let pod = Api::<Pod>::namespaced(mc.clone(), ns).get(&name).await?;
    assert_eq!(
        gate_reason(&pod).as_deref(),
        Some("WorkloadClusterAnswerTooLarge")
    );

    // The controller keeps asking, with back-off, and keeps cutting the answer at the cap.
    memory.hold_for(10).await?;
    println!(
        "endless list: the server sent {} MiB; the controller's process grew by {} MiB at most",
        server.seen.sent.load(Ordering::Relaxed) >> 20,
        memory.grown() >> 20
    );
    Ok(())
}

/// A tenant's server answers the Node list page by page, each page under the cap, with a
/// `continue` to another page without end (Nodes with 20 KiB names): the controller keeps at
/// most 16 MiB of one cluster's Nodes, then stops watching it and the machine says why.
#[tokio::test]
async fn endless_list_pages_fill_no_more_than_the_node_cache_allows() -> Result<()> {
    let (mc, _stop) = management_cluster("capk-pages-").await?;
    let ns = "tenant-pages";
    let name = tenant(&mc, ns, "paged").await?;
    let server = TenantServer::start(Behaviour::EndlessPages).await?;
    let _one = MEASURING.lock().await;
    let mut memory = Memory::from_now(&server)?;
    Api::<Secret>::namespaced(mc.clone(), ns)
        .create(&PostParams::default(), &server.kubeconfig_secret("paged")?)
        .await?;
    let kms: Api<KVMMachine> = Api::namespaced(mc.clone(), ns);
    let message = memory
        .until_node_ready(&kms, &name, "WorkloadClusterTooManyNodes", 30)
        .await?;
    assert!(
        message.contains("Secret paged-kubeconfig changes"),
        "{message}"
    );
    // It is not asked for more pages.
    let pages = server.seen.pages.load(Ordering::SeqCst);
    memory.hold_for(5).await?;
    assert_eq!(server.seen.pages.load(Ordering::SeqCst), pages);
    println!(
        "endless pages: {pages} pages ({} MiB) sent; the controller's process grew by {} MiB at most",
        server.seen.sent.load(Ordering::Relaxed) >> 20,
        memory.grown() >> 20
    );
    Ok(())
}

/// Node names of the tenant whose server holds every PATCH: more machines than the controller
/// runs reconciles at once (16).
const HELD_NODES: &[&str] = &[
    "slow-cp-0",
    "slow-cp-1",
    "slow-cp-2",
    "slow-cp-3",
    "slow-cp-4",
    "slow-cp-5",
    "slow-cp-6",
    "slow-cp-7",
    "slow-cp-8",
    "slow-cp-9",
    "slow-cp-10",
    "slow-cp-11",
    "slow-cp-12",
    "slow-cp-13",
    "slow-cp-14",
    "slow-cp-15",
    "slow-cp-16",
    "slow-cp-17",
    "slow-cp-18",
    "slow-cp-19",
];

/// A tenant's server answers list and watch, then holds every PATCH of a Node (the controller
/// sets each Node's providerID): at most a few requests are held for that cluster at once, its
/// machines say it does not answer, and another tenant's new machine in another namespace gets
/// its Pod within seconds (on the controller as first shipped: after 54.5 s, every reconcile
/// held by the hanging requests).
#[tokio::test]
async fn a_server_that_holds_every_patch_holds_up_no_other_tenant() -> Result<()> {
    let (mc, _stop) = management_cluster("capk-held-").await?;
    let (slow, other) = ("tenant-slow", "tenant-other");
    create_namespace(&mc, slow).await?;
    create_namespace(&mc, other).await?;
    let server = TenantServer::start(Behaviour::HoldPatches(HELD_NODES)).await?;
    Api::<Secret>::namespaced(mc.clone(), slow)
        .create(&PostParams::default(), &server.kubeconfig_secret("slow")?)
        .await?;
    for name in HELD_NODES {
        machine(&mc, slow, "slow", name).await?;
    }
    // The tenant's machines reach their Nodes, and the PATCHes hang.
    eventually(60, "PATCHes held by the tenant's server", || async {
        Ok((server.seen.held.load(Ordering::SeqCst) > 0).then_some(()))
    })
    .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;

    let started = Instant::now();
    machine(&mc, other, "other", "other-cp-0").await?;
    let pods: Api<Pod> = Api::namespaced(mc.clone(), other);
    eventually(60, "the other tenant's machine Pod", || async {
        Ok(pods.get_opt("other-cp-0").await?)
    })
    .await?;
    let took = started.elapsed();

    // The tenant's own machines say their cluster does not answer.
    let kms: Api<KVMMachine> = Api::namespaced(mc.clone(), slow);
    let (reason, message) = eventually(60, "NodeReady saying the PATCH failed", || async {
        let km = kms.get("slow-cp-0").await?;
        Ok(node_ready(&km)
            .filter(|(r, _)| r == "WorkloadClusterUnreachable" || r == "WorkloadClusterBusy"))
    })
    .await?;
    assert!(message.contains("node slow-cp-0"), "{reason}: {message}");
    let most = server.seen.most_held.load(Ordering::SeqCst);
    println!(
        "the other tenant's Pod after {took:?}; {} PATCHes received, at most {most} held at once",
        server.seen.patches.load(Ordering::SeqCst)
    );
    assert!(
        took < Duration::from_secs(10),
        "the other tenant's machine Pod took {took:?}"
    );
    assert!(
        most <= capk_controller::remote::limits::DEFAULT_MAX_IN_FLIGHT,
        "{most} PATCHes were held at once"
    );
    Ok(())
}
