//! The link to a workload cluster ([`crate::remote`]): its API through the `<cluster>-kubeconfig`
//! Secret that Cluster API writes. One Node watch per workload cluster (started when a machine of
//! that cluster first needs it, restarted when the kubeconfig Secret changes) feeds a cache and
//! wakes the machines whose Node changed; nothing polls. The machine Pod's readiness gate follows the Node's `Ready`
//! condition, and the Node gets our providerID when it has none, and the zone and region labels of
//! the management-cluster node its machine Pod runs on when it has neither (failure domains are
//! those zones). An unreachable workload cluster is a reason on the gate, never a crash; its
//! client is held to the operator's [`RemoteLimits`] (what it reads, requests in flight, their
//! time, a back-off after failures), and a gate that could not be read or a Node that could not
//! be synced is a failure of the reconcile ([`Gate::failed`]), retried with back-off.

use std::{
    collections::{BTreeMap, HashMap},
    sync::Arc,
};

use capk_api::constants::NODE_READY_GATE;
use futures::StreamExt;
use k8s_openapi::{
    api::core::v1::{Node, Pod},
    jiff::Timestamp,
};
use kube::{
    Api, Client, ResourceExt,
    api::Patch,
    runtime::{
        WatchStreamExt,
        reflector::{self, ObjectRef, Store},
        watcher,
    },
};
use serde_json::json;
use tracing::{debug, info};

use crate::{
    k8s::objects,
    remote::kubeconfig::KubeconfigError,
    remote::limits::{LimitError, RemoteLimits, describe},
    remote::{self, KubeconfigSecret, Unavailable},
};

/// The well-known labels that say where a Node is, copied from the management-cluster node a
/// machine Pod runs on to the workload Node (the scheduler's topology spreading, zone-aware
/// volumes and the workload's own tools read them).
pub const TOPOLOGY_LABELS: [&str; 2] = [
    "topology.kubernetes.io/zone",
    "topology.kubernetes.io/region",
];

/// The management-cluster node a machine Pod runs on, and a client of the cluster it is in (the
/// management cluster or a hosting cluster).
#[derive(Clone, Copy)]
pub struct PodNode<'a> {
    /// A client of the cluster the Pod runs in.
    pub client: &'a Client,
    /// The node's name (`spec.nodeName` of the Pod).
    pub name: &'a str,
}

/// What a machine's workload Node is to carry: the machine's providerID and the topology labels
/// of the node its machine Pod runs on (once scheduled).
#[derive(Clone, Copy)]
pub struct NodeFacts<'a> {
    /// `kvm://<namespace>/<kvmmachine>`.
    pub provider_id: &'a str,
    /// Where the machine Pod runs.
    pub pod_node: Option<PodNode<'a>>,
}

/// The [`TOPOLOGY_LABELS`] among `labels`.
pub fn topology_labels(labels: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    labels
        .iter()
        .filter(|(k, _)| TOPOLOGY_LABELS.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// The Secret Cluster API writes with the workload cluster's kubeconfig.
pub fn kubeconfig_secret_name(cluster: &str) -> String {
    format!("{cluster}-kubeconfig")
}

/// Called on every change a Node watch sees that the machines of workload cluster `cluster` in
/// namespace `ns` care about: of Node `node` (its Ready condition or providerID), or of the link
/// itself (`None`: in sync, failing, recovered).
pub type OnNodeChange = Arc<dyn Fn(&str, &str, Option<&str>) + Send + Sync>;

/// Gate reason: the workload kubeconfig Secret does not exist (yet).
pub const REASON_KUBECONFIG_MISSING: &str = "WaitingForWorkloadClusterKubeconfig";
/// Gate reason: the workload kubeconfig would run a command or read a file, and is not used.
pub const REASON_KUBECONFIG_REFUSED: &str = "WorkloadKubeconfigRefused";
/// Gate reason: the workload kubeconfig cannot be read or used.
pub const REASON_KUBECONFIG_INVALID: &str = "WorkloadKubeconfigInvalid";

/// What the readiness gate should say.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gate {
    /// Node is Ready.
    pub ready: bool,
    /// CamelCase reason.
    pub reason: &'static str,
    /// Human-readable message.
    pub message: String,
    /// The gate could not be read or the Node not synced (the workload cluster fails, or the
    /// management cluster did not give its kubeconfig): the reconcile that asked fails after
    /// writing it, and is retried with back-off rather than at the next change.
    pub failed: bool,
}

impl Gate {
    fn not_ready(reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            ready: false,
            reason,
            message: message.into(),
            failed: false,
        }
    }

    fn failure(reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            failed: true,
            ..Self::not_ready(reason, message)
        }
    }
}

/// The Node watches of all workload clusters this controller links to.
pub struct Links {
    /// By namespace and cluster name.
    links: remote::Links<(String, String), Store<Node>>,
    on_change: OnNodeChange,
    limits: RemoteLimits,
}

/// Gate reason: the workload cluster does not answer, or not in time.
pub const REASON_UNREACHABLE: &str = "WorkloadClusterUnreachable";
/// Gate reason: the workload cluster sent an answer over the controller's limits.
pub const REASON_ANSWER_TOO_LARGE: &str = "WorkloadClusterAnswerTooLarge";
/// Gate reason: the workload cluster has as many requests in flight as the controller allows.
pub const REASON_BUSY: &str = "WorkloadClusterBusy";
/// Gate reason: the workload cluster lists more Nodes than the controller keeps.
pub const REASON_TOO_MANY_NODES: &str = "WorkloadClusterTooManyNodes";

/// What one workload cluster's Nodes may take in the controller's cache, as cached
/// ([`strip_node`]: a few hundred bytes a Node, so tens of thousands of Nodes, more than a
/// Kubernetes cluster has). Each answer is capped ([`RemoteLimits`]), but a server may send
/// pages (`continue`) or new Nodes without end: a cluster that lists more than this is no
/// longer watched, and says so, until its kubeconfig Secret changes.
pub const MAX_NODE_CACHE_BYTES: usize = 16 << 20;
/// The longest Ready condition message or reason kept of a Node.
const MAX_NODE_MESSAGE_BYTES: usize = 1024;

/// The gate reason for a failed request to the workload cluster.
fn failure_reason(e: &kube::Error) -> &'static str {
    match LimitError::of(e) {
        Some(l) if l.is_too_large() => REASON_ANSWER_TOO_LARGE,
        Some(LimitError::Busy(_)) => REASON_BUSY,
        _ => REASON_UNREACHABLE,
    }
}

/// The request a Node watch failed at, if it failed at one.
fn watch_request_error(e: &watcher::Error) -> Option<&kube::Error> {
    match e {
        watcher::Error::InitialListFailed(e)
        | watcher::Error::WatchStartFailed(e)
        | watcher::Error::WatchFailed(e) => Some(e),
        _ => None,
    }
}

impl Links {
    /// No links yet; `on_change` hears of every change the Node watches will see. Each
    /// workload cluster's client is held to `limits`.
    pub fn new(on_change: OnNodeChange, limits: &RemoteLimits) -> Self {
        Self {
            links: remote::Links::default(),
            on_change,
            limits: limits.clone(),
        }
    }

    /// Stops the Node watch of `cluster` (its kubeconfig is gone, or the cluster is deleted).
    pub fn forget(&self, ns: &str, cluster: &str) {
        let key = (ns.to_owned(), cluster.to_owned());
        if self.links.remove(&key) {
            info!(
                namespace = ns,
                cluster, "stopped watching the workload cluster's Nodes"
            );
        }
    }

    /// Drops the links (client and Node watch) of the workload clusters `in_use(namespace,
    /// cluster)` says no machine needs any more.
    pub fn retain(&self, in_use: impl Fn(&str, &str) -> bool) {
        for (ns, cluster) in self.links.retain(|(ns, cluster)| in_use(ns, cluster)) {
            info!(
                namespace = %ns,
                cluster = %cluster,
                "stopped watching the Nodes of a workload cluster no machine here needs"
            );
        }
    }

    /// How many workload clusters are linked (for tests and metrics).
    pub fn len(&self) -> usize {
        self.links.len()
    }

    /// Whether no workload cluster is linked.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// What the readiness gate of machine `km` (Node `node_name`) in `cluster` should say; sets
    /// the Node's providerID when it has none, and the topology labels of the Pod's node when it
    /// has none of them ([`NodeFacts`]). `kubeconfig` is the resourceVersion of the
    /// kubeconfig Secret ([`kubeconfig_secret_name`]) when it exists: the Secret is read only
    /// when it is new or changed.
    pub async fn node_gate(
        &self,
        mc: &Client,
        kubeconfig: Option<&str>,
        ns: &str,
        cluster: &str,
        node_name: &str,
        facts: NodeFacts<'_>,
    ) -> Gate {
        let secret_name = kubeconfig_secret_name(cluster);
        let Some(source) = kubeconfig else {
            self.forget(ns, cluster);
            return Gate::not_ready(
                REASON_KUBECONFIG_MISSING,
                format!(
                    "Secret {secret_name} does not exist yet (Cluster API writes it once the control plane is initialized)"
                ),
            );
        };
        let key = (ns.to_owned(), cluster.to_owned());
        // The link is as current as the cache's view of the Secret: it is restarted when that
        // changes.
        let link = match self.links.current(&key, source) {
            Some(link) => link,
            None => {
                let (secret, wc) = match connect(mc, ns, cluster, &self.limits).await {
                    Ok(connected) => connected,
                    Err(gate) => return gate,
                };
                let link = self.start(wc, ns, cluster, source.to_owned(), &secret);
                self.links.insert(key, link)
            }
        };
        if let Some(u) = link.state().failure() {
            return Gate::failure(u.reason, u.message);
        }
        if !link.state().synced() {
            return Gate::not_ready(
                "WaitingForWorkloadCluster",
                format!("connecting to workload cluster {cluster}"),
            );
        }
        match link.caches().get(&ObjectRef::new(node_name)) {
            Some(node) => sync_node(link.client(), &node, facts).await,
            None => Gate::not_ready(
                "WaitingForNode",
                format!("node {node_name} has not joined the workload cluster yet"),
            ),
        }
    }

    fn start(
        &self,
        wc: Client,
        ns: &str,
        cluster: &str,
        version: String,
        secret: &KubeconfigSecret,
    ) -> remote::Link<Store<Node>> {
        info!(
            namespace = ns,
            cluster, "watching the workload cluster's Nodes"
        );
        let (nodes, writer) = reflector::store::<Node>();
        let mut link = remote::Link::new(version, secret.digest, wc.clone(), nodes);
        let stream = reflector::reflector(
            writer,
            watcher(
                Api::<Node>::all(wc),
                watcher::Config::default()
                    .timeout(crate::remote::kubeconfig::WATCH_TIMEOUT_SECONDS)
                    .page_size(self.limits.list_page_size),
            )
            .modify(strip_node),
        )
        .default_backoff();
        let on_change = self.on_change.clone();
        let (ns, cluster, st) = (ns.to_owned(), cluster.to_owned(), link.state().clone());
        link.spawn(async move {
            // What each Node last looked like to us, (Ready, has providerID), and its size in
            // the cache; the sum of those sizes.
            let mut seen: HashMap<String, ((bool, bool), usize)> = HashMap::new();
            let mut cached = 0usize;
            let wake = |node: Option<&str>| on_change(&ns, &cluster, node);
            futures::pin_mut!(stream);
            while let Some(event) = stream.next().await {
                match event {
                    Err(e) => {
                        debug!(error = %e, cluster = %cluster, "workload cluster Node watch failed");
                        let (reason, what) = match watch_request_error(&e) {
                            Some(e) => (failure_reason(e), describe(e)),
                            None => (REASON_UNREACHABLE, e.to_string()),
                        };
                        let u = Unavailable {
                            reason,
                            message: format!("watch nodes of workload cluster {cluster}: {what}"),
                        };
                        if st.fail(u.clone()).as_ref() != Some(&u) {
                            wake(None);
                        }
                    }
                    Ok(ev) => {
                        let recovered = st.recover();
                        match ev {
                            watcher::Event::InitDone => {
                                st.set_synced();
                                wake(None)
                            }
                            watcher::Event::Apply(n) | watcher::Event::InitApply(n) => {
                                let facts = (node_ready(&n), has_provider_id(&n));
                                let size = cached_size(&n);
                                let before = seen.insert(n.name_any(), (facts, size));
                                cached = cached + size - before.map_or(0, |(_, s)| s);
                                if cached > MAX_NODE_CACHE_BYTES {
                                    st.fail(too_many_nodes(&cluster));
                                    wake(None);
                                    // The watch ends: what was cached stays, nothing more is.
                                    break;
                                }
                                if before.map(|(f, _)| f) != Some(facts) || recovered {
                                    wake(Some(&n.name_any()));
                                }
                            }
                            watcher::Event::Delete(n) => {
                                if let Some((_, size)) = seen.remove(&n.name_any()) {
                                    cached -= size;
                                }
                                wake(Some(&n.name_any()));
                            }
                            watcher::Event::Init => {}
                        }
                        if recovered {
                            wake(None);
                        }
                    }
                }
            }
        });
        link
    }
}

/// Why a workload cluster whose Nodes outgrew [`MAX_NODE_CACHE_BYTES`] is not watched.
fn too_many_nodes(cluster: &str) -> Unavailable {
    Unavailable {
        reason: REASON_TOO_MANY_NODES,
        message: format!(
            "workload cluster {cluster} lists more Nodes than the controller keeps ({} MiB of \
             them as cached); its Nodes are not watched until Secret {} changes",
            MAX_NODE_CACHE_BYTES >> 20,
            kubeconfig_secret_name(cluster)
        ),
    }
}

/// What a Node, as cached, takes in the cache (about: its size as JSON, its name twice).
fn cached_size(n: &Node) -> usize {
    serde_json::to_vec(n).map_or(0, |v| v.len()) + n.metadata.name.as_ref().map_or(0, String::len)
}

/// Of a workload Node only what the gate reads is kept: its identity, providerID, topology
/// labels and `Ready` condition (its message and reason cut to [`MAX_NODE_MESSAGE_BYTES`]).
/// Images, labels, annotations and managed fields are most of a Node's size, and the workload
/// cluster's users write them.
fn strip_node(n: &mut Node) {
    use k8s_openapi::api::core::v1::{NodeSpec, NodeStatus};
    let meta = &mut n.metadata;
    meta.managed_fields = None;
    meta.labels = meta
        .labels
        .take()
        .map(|l| topology_labels(&l))
        .filter(|l| !l.is_empty());
    meta.annotations = None;
    meta.owner_references = None;
    meta.finalizers = None;
    n.spec = Some(NodeSpec {
        provider_id: n.spec.take().and_then(|s| s.provider_id),
        ..Default::default()
    });
    let ready = n
        .status
        .take()
        .and_then(|s| s.conditions)
        .into_iter()
        .flatten()
        .filter(|c| c.type_ == "Ready")
        .map(|mut c| {
            for text in [c.message.as_mut(), c.reason.as_mut()]
                .into_iter()
                .flatten()
            {
                *text = crate::remote::redact::cap(text, MAX_NODE_MESSAGE_BYTES);
            }
            c
        })
        .collect::<Vec<_>>();
    n.status = Some(NodeStatus {
        conditions: (!ready.is_empty()).then_some(ready),
        ..Default::default()
    });
}

fn node_ready(n: &Node) -> bool {
    n.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"))
        .is_some_and(|c| c.status == "True")
}

fn has_provider_id(n: &Node) -> bool {
    n.spec
        .as_ref()
        .and_then(|s| s.provider_id.as_deref())
        .is_some_and(|p| !p.is_empty())
}

/// The kubeconfig Secret of workload cluster `cluster` and a client of that cluster, or why
/// there is none. The kubeconfig is checked as data first ([`KubeconfigSecret::client`]): one
/// that would run a command or read a file of the controller is refused before any client
/// exists.
async fn connect(
    mc: &Client,
    ns: &str,
    cluster: &str,
    limits: &RemoteLimits,
) -> Result<(KubeconfigSecret, Client), Gate> {
    let name = kubeconfig_secret_name(cluster);
    let secret = KubeconfigSecret::read(mc, ns, &name, "value")
        .await
        .map_err(|e| Gate::failure("WorkloadClusterUnavailable", format!("read Secret {name}: {e}")))?
        .ok_or_else(|| {
            Gate::not_ready(
                "WaitingForWorkloadClusterKubeconfig",
                format!("Secret {name} does not exist yet (Cluster API writes it once the control plane is initialized)"),
            )
        })?;
    match secret.client(limits).await {
        Ok(client) => Ok((secret, client)),
        Err(e) => {
            let reason = match e {
                KubeconfigError::Refused { .. } => REASON_KUBECONFIG_REFUSED,
                _ => REASON_KUBECONFIG_INVALID,
            };
            Err(Gate::not_ready(reason, format!("Secret {name} {e}")))
        }
    }
}

/// The topology labels of the management-cluster node `pod_node`; none when it cannot be read
/// (a hosting cluster's credential may not read Nodes).
async fn pod_node_topology(pod_node: PodNode<'_>) -> BTreeMap<String, String> {
    match Api::<Node>::all(pod_node.client.clone())
        .get_metadata_opt(pod_node.name)
        .await
    {
        Ok(Some(n)) => topology_labels(n.labels()),
        Ok(None) => BTreeMap::new(),
        Err(e) => {
            debug!(node = pod_node.name, error = %e, "cannot read the machine Pod's node");
            BTreeMap::new()
        }
    }
}

/// Sets the Node's providerID when it has none and, when it has no topology label, those of the
/// management-cluster node its machine Pod runs on (read only then); says what the gate should
/// be.
pub async fn sync_node(wc: &Client, node: &Node, facts: NodeFacts<'_>) -> Gate {
    let node_name = node.name_any();
    let mut patch = json!({});
    if !has_provider_id(node) {
        patch["spec"] = json!({"providerID": facts.provider_id});
    }
    if let Some(pod_node) = facts.pod_node
        && topology_labels(node.labels()).is_empty()
    {
        let labels = pod_node_topology(pod_node).await;
        if !labels.is_empty() {
            patch["metadata"] = json!({ "labels": labels });
        }
    }
    let merge = Patch::Merge(&patch);
    if patch != json!({})
        && let Err(e) = Api::<Node>::all(wc.clone())
            .patch(&node_name, &objects::params(&merge), &merge)
            .await
    {
        return Gate::failure(
            failure_reason(&e),
            format!(
                "set providerID or topology labels on node {node_name}: {}",
                describe(&e)
            ),
        );
    }
    let ready = node
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"));
    match ready {
        Some(c) if c.status == "True" => Gate {
            ready: true,
            reason: "NodeReady",
            message: format!("node {node_name} is Ready"),
            failed: false,
        },
        Some(c) => Gate::not_ready(
            "NodeNotReady",
            format!(
                "node {node_name} is not Ready: {}",
                c.message.clone().unwrap_or_default()
            ),
        ),
        None => Gate::not_ready(
            "NodeNotReady",
            format!("node {node_name} reports no Ready condition"),
        ),
    }
}

/// Writes the gate condition on the machine Pod when it differs from what is there.
pub async fn set_gate(pods: &Api<Pod>, pod: &Pod, gate: &Gate) -> Result<(), kube::Error> {
    let status = if gate.ready { "True" } else { "False" };
    let current = pod
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == NODE_READY_GATE));
    if current.is_some_and(|c| {
        c.status == status
            && c.reason.as_deref() == Some(gate.reason)
            && c.message.as_deref() == Some(gate.message.as_str())
    }) {
        return Ok(());
    }
    let transition = match current {
        Some(c) if c.status == status => c.last_transition_time.clone(),
        _ => Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            Timestamp::now(),
        )),
    };
    let patch = json!({"status": {"conditions": [{
        "type": NODE_READY_GATE,
        "status": status,
        "reason": gate.reason,
        "message": gate.message,
        "lastTransitionTime": transition,
    }]}});
    let patch = Patch::Strategic(&patch);
    pods.patch_status(&pod.name_any(), &objects::params(&patch), &patch)
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cached_node_keeps_only_what_the_gate_reads() {
        let mut n: Node = serde_json::from_value(json!({
            "metadata": {"name": "n1", "uid": "u", "resourceVersion": "7",
                         "labels": {"a": "b", "topology.kubernetes.io/zone": "z1"},
                         "annotations": {"big": "x".repeat(4096)}},
            "spec": {"providerID": "kvm://ns/n1", "podCIDR": "10.0.0.0/24"},
            "status": {"conditions": [
                {"type": "MemoryPressure", "status": "False"},
                {"type": "Ready", "status": "True", "message": "kubelet is posting ready status"}],
                "images": [{"names": ["x"], "sizeBytes": 1}]},
        }))
        .unwrap();
        strip_node(&mut n);
        assert_eq!(
            serde_json::to_value(&n).unwrap(),
            json!({"apiVersion": "v1", "kind": "Node",
                   "metadata": {"name": "n1", "uid": "u", "resourceVersion": "7",
                                "labels": {"topology.kubernetes.io/zone": "z1"}},
                   "spec": {"providerID": "kvm://ns/n1"},
                   "status": {"conditions": [{"type": "Ready", "status": "True",
                       "message": "kubelet is posting ready status"}]}})
        );
        assert!(node_ready(&n) && has_provider_id(&n));
    }

    #[test]
    fn a_cached_nodes_ready_message_and_reason_are_cut() {
        let mut n: Node = serde_json::from_value(json!({
            "metadata": {"name": "n1"},
            "status": {"conditions": [{"type": "Ready", "status": "False",
                "reason": "r".repeat(4096), "message": "m".repeat(1 << 20)}]},
        }))
        .unwrap();
        strip_node(&mut n);
        let ready = &n.status.as_ref().unwrap().conditions.as_ref().unwrap()[0];
        assert!(ready.message.as_ref().unwrap().len() <= MAX_NODE_MESSAGE_BYTES);
        assert!(ready.reason.as_ref().unwrap().len() <= MAX_NODE_MESSAGE_BYTES);
        assert!(cached_size(&n) < 4 * MAX_NODE_MESSAGE_BYTES);
    }
}
