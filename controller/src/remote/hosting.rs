//! Hosting clusters: where a workload cluster's machine Pods, Ignition Secrets, etcd PVCs and
//! control-plane Service live when its KVMCluster names one (`spec.hostingCluster`), reached
//! through a kubeconfig Secret in the management cluster (which the reconcilers find, and label
//! for clusterctl move and the controller's watch, before they ask for a [`Target`]). Without
//! one they live in the management cluster, in the namespace the KVMCluster's status records
//! ([`machine_namespace`]): the operator's machine namespace, or the KVMCluster's own.
//!
//! One link ([`crate::remote`]) per hosting cluster and namespace, however many KVMClusters and
//! machines use it: one client and one watch per kind (machine Pods, our Secrets, PVCs and
//! Services, selected by label), whose caches the reconcilers read exactly as they read the
//! management cluster's. A link is started when a reconcile first needs it, rebuilt when the
//! Secret's kubeconfig changes and dropped when no KVMCluster names it. Its watch events wake
//! the KVMMachine or KVMCluster that the object's labels name ([`crate::k8s::ownership`]).
//!
//! Reachability: a failing watch makes the link unavailable at once; while it is, the link lists
//! each watched kind every [`PROBE_INTERVAL`] (the watches themselves resume silently), and the
//! first full success makes it available again. Each change wakes every KVMCluster and
//! KVMMachine of the link, which say so in their `HostingClusterAvailable` condition. Meanwhile
//! nothing is created, adopted or deleted there: the VMs keep running, untouched.
//!
//! The hosting cluster's server may be a tenant's: its client is held to the operator's
//! [`RemoteLimits`] (what it reads, requests in flight, their time, a back-off after failures).

use std::{
    collections::HashMap,
    fmt,
    sync::{Arc, Mutex},
    time::Duration,
};

use capk_api::{
    constants::{CONDITION_HOSTING_CLUSTER_AVAILABLE, HOSTING_KUBECONFIG_KEY},
    v1alpha1::KVMCluster,
};
use futures::{StreamExt, stream};
use k8s_openapi::{
    NamespaceResourceScope,
    api::core::v1::{PersistentVolumeClaim, Pod, Secret, Service},
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use kube::{
    Api, Client, Resource, ResourceExt,
    api::ListParams,
    core::PartialObjectMeta,
    runtime::{reflector::ObjectRef, watcher},
};
use tracing::{debug, info, warn};

pub use crate::remote::Unavailable;
use crate::{
    k8s::caches::{Changes, ObjectCaches, cached, owned, strip_object, strip_pod, strip_secret},
    k8s::conditions::DesiredCondition,
    k8s::ownership::Home,
    k8s::wake::Wake,
    remote::kubeconfig::KubeconfigError,
    remote::limits::{LimitError, RemoteLimits, describe},
    remote::{self, KubeconfigSecret, LinkState},
};

/// Reason: the objects live in the management cluster (no hosting cluster is named).
pub const REASON_MANAGEMENT_CLUSTER: &str = "ManagementCluster";
/// Reason: the hosting cluster answers and its watches are in sync.
pub const REASON_CONNECTED: &str = "HostingClusterConnected";
/// Reason: the kubeconfig Secret does not exist.
pub const REASON_KUBECONFIG_MISSING: &str = "HostingKubeconfigMissing";
/// Reason: the kubeconfig would run a command or read a file of the controller.
pub const REASON_KUBECONFIG_REFUSED: &str = "HostingKubeconfigRefused";
/// Reason: the kubeconfig cannot be read or used.
pub const REASON_KUBECONFIG_INVALID: &str = "HostingKubeconfigInvalid";
/// Reason: the first list of the hosting cluster's objects has not arrived yet.
pub const REASON_CONNECTING: &str = "WaitingForHostingCluster";
/// Reason: the hosting cluster does not answer.
pub const REASON_UNREACHABLE: &str = "HostingClusterUnreachable";
/// Reason: the hosting cluster answers, but refuses the credential (401) or what it may do (403).
pub const REASON_FORBIDDEN: &str = "HostingClusterForbidden";
/// Reason: the hosting cluster sent an answer over the controller's limits.
pub const REASON_ANSWER_TOO_LARGE: &str = "HostingClusterAnswerTooLarge";

/// Reason: the KVMCluster has not recorded yet which namespace of the management cluster its
/// machines live in (`status.machineNamespace`).
pub const REASON_MACHINE_NAMESPACE_PENDING: &str = "WaitingForMachineNamespace";

/// The namespace of the management cluster where `kc`'s objects live while it names no hosting
/// cluster, as its status records; `None` until its first reconcile has chosen.
pub fn machine_namespace(kc: &KVMCluster) -> Option<&str> {
    kc.status
        .as_ref()
        .and_then(|s| s.machine_namespace.as_deref())
        .filter(|ns| !ns.is_empty())
}

/// How often an unavailable hosting cluster is tried again.
pub const PROBE_INTERVAL: Duration = Duration::from_secs(2);
/// Time allowed for one probe.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// A hosting cluster and namespace, as a KVMCluster names them.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HostingKey {
    /// Namespace of the kubeconfig Secret in the management cluster (the KVMCluster's).
    pub secret_namespace: String,
    /// Name of the kubeconfig Secret.
    pub secret: String,
    /// The namespace in the hosting cluster.
    pub namespace: String,
}

impl HostingKey {
    /// The hosting cluster `kc` names; `None` for the management cluster.
    pub fn of(kc: &KVMCluster) -> Option<Self> {
        let hosting = kc.spec.hosting_cluster.as_ref()?;
        let ns = kc.namespace()?;
        Some(Self {
            namespace: hosting.namespace.clone().unwrap_or_else(|| ns.clone()),
            secret_namespace: ns,
            secret: hosting.kubeconfig_secret_ref.name.clone(),
        })
    }
}

impl fmt::Display for HostingKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "namespace {} of the hosting cluster of Secret {}",
            self.namespace, self.secret
        )
    }
}

/// The cluster and namespace where a reconcile's objects live, with the watch caches of it.
#[derive(Clone)]
pub struct Target {
    /// A client of that cluster.
    pub client: Client,
    /// The namespace, and whether it is the management cluster.
    pub home: Home,
    caches: ObjectCaches,
    key: Option<HostingKey>,
}

impl Target {
    /// The management cluster, namespace `ns`, through the controller's own caches, for owners
    /// in `owner_namespace`: next to them (owner references), or in a machine namespace of
    /// the operator's (labels only, names qualified, as in a hosting namespace).
    pub fn management(
        client: &Client,
        caches: ObjectCaches,
        owner_namespace: &str,
        ns: &str,
    ) -> Self {
        Self {
            client: client.clone(),
            home: Home {
                namespace: ns.to_owned(),
                management: ns == owner_namespace,
            },
            caches,
            key: None,
        }
    }

    /// An API of kind `K` in the target namespace.
    pub fn api<K>(&self) -> Api<K>
    where
        K: Resource<Scope = NamespaceResourceScope, DynamicType = ()>,
    {
        Api::namespaced(self.client.clone(), &self.home.namespace)
    }

    fn at<K: Resource<DynamicType = ()>>(&self, name: &str) -> ObjectRef<K> {
        ObjectRef::new(name).within(&self.home.namespace)
    }

    /// Machine Pod `name`, as cached.
    pub fn pod(&self, name: &str) -> Option<Arc<Pod>> {
        self.caches.pods.get(&self.at(name))
    }

    /// Every cached machine Pod of the target namespace.
    pub fn pods(&self) -> Vec<Arc<Pod>> {
        self.caches
            .pods
            .state()
            .into_iter()
            .filter(|p| p.namespace().as_deref() == Some(self.home.namespace.as_str()))
            .collect()
    }

    /// Secret `name`'s metadata, as cached.
    pub fn secret(&self, name: &str) -> Option<Arc<PartialObjectMeta<Secret>>> {
        self.caches.secrets.get(&self.at(name))
    }

    /// PVC `name`'s metadata, as cached.
    pub fn claim(&self, name: &str) -> Option<Arc<PartialObjectMeta<PersistentVolumeClaim>>> {
        self.caches.claims.get(&self.at(name))
    }

    /// Service `name`'s metadata, as cached.
    pub fn service(&self, name: &str) -> Option<Arc<PartialObjectMeta<Service>>> {
        self.caches.services.get(&self.at(name))
    }

    /// The hosting cluster, `None` for the management cluster.
    pub fn key(&self) -> Option<&HostingKey> {
        self.key.as_ref()
    }

    /// Where the objects are, in words: "namespace x of the management cluster".
    pub fn describe(&self) -> String {
        match &self.key {
            Some(key) => key.to_string(),
            None => format!(
                "namespace {} of the management cluster",
                self.home.namespace
            ),
        }
    }

    /// The `HostingClusterAvailable` condition of a target in use.
    pub fn condition(&self) -> DesiredCondition {
        let reason = if self.key.is_some() {
            REASON_CONNECTED
        } else {
            REASON_MANAGEMENT_CLUSTER
        };
        let moving = if self.key.is_some() {
            "clusterctl move leaves them running there"
        } else {
            "clusterctl move is blocked until spec.hostingCluster names where they run \
             (docs/hosting-and-move.md)"
        };
        DesiredCondition::truthy(
            CONDITION_HOSTING_CLUSTER_AVAILABLE,
            reason,
            format!(
                "machines and the control-plane Service live in {}; {moving}",
                self.describe()
            ),
        )
    }
}

/// Called on every change a link sees: an object's metadata (wake whoever its labels name), or
/// `None` when the link's availability changed (wake everyone on it).
pub type OnChange = Arc<dyn Fn(&HostingKey, Option<&ObjectMeta>) + Send + Sync>;

/// The [`OnChange`] of a kind's reconciles: an object wakes those `of_object` names, a change of
/// a link's availability those `of_hosting` names.
pub fn waking<K, Objects, Hosted>(
    wake: Wake<K>,
    of_object: impl Fn(&ObjectMeta) -> Objects + Send + Sync + 'static,
    of_hosting: impl Fn(&HostingKey) -> Hosted + Send + Sync + 'static,
) -> OnChange
where
    K: kube::Resource<DynamicType = ()> + 'static,
    Objects: IntoIterator<Item = ObjectRef<K>>,
    Hosted: IntoIterator<Item = ObjectRef<K>>,
{
    Arc::new(move |key, meta| match meta {
        Some(meta) => wake.all(of_object(meta)),
        None => wake.all(of_hosting(key)),
    })
}

/// The links to every hosting cluster in use.
pub struct Links {
    links: remote::Links<HostingKey, ObjectCaches>,
    /// Kubeconfig Secrets that cannot be used, by the resourceVersion found so: not read again
    /// until they change.
    refused: Mutex<HashMap<HostingKey, (String, Unavailable)>>,
    /// One connection at a time, so that two reconciles never start two links for one key.
    connecting: tokio::sync::Mutex<()>,
    on_change: OnChange,
    limits: RemoteLimits,
}

/// One hosting cluster and namespace: its client, the caches of the objects the controller
/// makes there, and their availability.
type Link = remote::Link<ObjectCaches>;

impl Links {
    /// No links yet; `on_change` hears of every change the links will see. Each hosting
    /// cluster's client is held to `limits`.
    pub fn new(on_change: OnChange, limits: &RemoteLimits) -> Self {
        Self {
            links: remote::Links::default(),
            refused: Mutex::default(),
            connecting: tokio::sync::Mutex::new(()),
            on_change,
            limits: limits.clone(),
        }
    }

    /// How many hosting clusters are linked.
    pub fn len(&self) -> usize {
        self.links.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops the links (and remembered refusals) of the keys `in_use` does not keep.
    pub fn retain(&self, in_use: impl Fn(&HostingKey) -> bool) {
        let dropped = self.links.retain(&in_use);
        self.refused
            .lock()
            .expect("refused lock")
            .retain(|k, _| in_use(k));
        for key in dropped {
            info!(hosting = %key, "stopped watching the hosting cluster: no KVMCluster names it");
        }
    }

    /// Where `kc`'s objects live: the management cluster (no `hostingCluster`; `mc` and its
    /// caches, in the namespace its status records, [`machine_namespace`]), or the hosting cluster it names once its watches are in sync; otherwise why not.
    /// `kubeconfig` is the resourceVersion of the hosting kubeconfig Secret, `None` when it
    /// does not exist.
    pub async fn target(
        &self,
        mc: &Client,
        caches: &ObjectCaches,
        kc: &KVMCluster,
        kubeconfig: Option<String>,
    ) -> Result<Target, Unavailable> {
        let Some(key) = HostingKey::of(kc) else {
            let owner_ns = kc.namespace().unwrap_or_default();
            let Some(ns) = machine_namespace(kc) else {
                return Err(Unavailable {
                    reason: REASON_MACHINE_NAMESPACE_PENDING,
                    message: "waiting for the KVMCluster to record its machine namespace"
                        .to_owned(),
                });
            };
            return Ok(Target::management(mc, caches.clone(), &owner_ns, ns));
        };
        let link = self.link(mc, kubeconfig, &key).await?;
        if let Some(failure) = link.state().failure() {
            return Err(failure);
        }
        if !link.state().synced() {
            return Err(Unavailable {
                reason: REASON_CONNECTING,
                message: format!("listing the machine Pods, Secrets, PVCs and Services in {key}"),
            });
        }
        Ok(Target {
            client: link.client().clone(),
            home: Home {
                namespace: key.namespace.clone(),
                management: false,
            },
            caches: link.caches().clone(),
            key: Some(key),
        })
    }

    /// The link of `key` as of the kubeconfig Secret's current version (`source`), built if
    /// needed.
    async fn link(
        &self,
        mc: &Client,
        source: Option<String>,
        key: &HostingKey,
    ) -> Result<Arc<Link>, Unavailable> {
        let missing = || Unavailable {
            reason: REASON_KUBECONFIG_MISSING,
            message: format!(
                "Secret {} does not exist in namespace {}; create it with the hosting cluster's kubeconfig in key `{HOSTING_KUBECONFIG_KEY}`",
                key.secret, key.secret_namespace
            ),
        };
        let Some(source) = source else {
            self.links.remove(key);
            return Err(missing());
        };
        if let Some(link) = self.links.current(key, &source) {
            return Ok(link);
        }
        let _one = self.connecting.lock().await;
        if let Some(link) = self.links.current(key, &source) {
            return Ok(link);
        }
        if let Some((_, u)) = self
            .refused
            .lock()
            .expect("refused lock")
            .get(key)
            .filter(|(s, _)| *s == source)
        {
            return Err(u.clone());
        }
        let secret = KubeconfigSecret::read(
            mc,
            &key.secret_namespace,
            &key.secret,
            HOSTING_KUBECONFIG_KEY,
        )
        .await
        .map_err(|e| Unavailable {
            reason: REASON_KUBECONFIG_INVALID,
            message: format!("read Secret {}: {e}", key.secret),
        })?
        .ok_or_else(missing)?;
        // The Secret changed, its kubeconfig did not (the controller's own move label, say):
        // the link stays.
        if let Some(link) = self.links.get(key).filter(|l| l.has_kubeconfig_of(&secret)) {
            link.renew(&secret.version);
            return Ok(link);
        }
        let client = match secret.client(&self.limits).await {
            Ok(c) => c,
            Err(e) => {
                let reason = match e {
                    KubeconfigError::Refused { .. } => REASON_KUBECONFIG_REFUSED,
                    _ => REASON_KUBECONFIG_INVALID,
                };
                let u = Unavailable {
                    reason,
                    message: format!("Secret {} {e}", key.secret),
                };
                warn!(hosting = %key, reason, "the hosting cluster's kubeconfig is not used");
                self.refused
                    .lock()
                    .expect("refused lock")
                    .insert(key.clone(), (secret.version, u.clone()));
                return Err(u);
            }
        };
        self.refused.lock().expect("refused lock").remove(key);
        let link = self.start(key, client, &secret);
        Ok(self.links.insert(key.clone(), link))
    }

    /// Starts the link to `key`: its watches, and the tasks that wake the objects' owners, mark
    /// it synced after the first lists, and probe it while it is unavailable.
    fn start(&self, key: &HostingKey, client: Client, secret: &KubeconfigSecret) -> Link {
        info!(hosting = %key, "watching the hosting cluster");
        let (caches, events) = watch_objects(&client, &key.namespace, &self.limits);
        let mut link = Link::new(
            secret.version.clone(),
            secret.digest,
            client.clone(),
            caches.clone(),
        );
        let state = link.state().clone();
        let on_change = &self.on_change;
        link.spawn(wake_owners(
            key.clone(),
            state.clone(),
            on_change.clone(),
            events,
        ));
        link.spawn(mark_synced(
            key.clone(),
            state.clone(),
            on_change.clone(),
            caches,
        ));
        link.spawn(probe_while_unavailable(
            key.clone(),
            state,
            on_change.clone(),
            client,
        ));
        link
    }
}

/// The watches of our objects in namespace `ns` of a hosting cluster: their caches, and all
/// their events (each object's metadata, or the watch's failure) in one stream.
fn watch_objects(
    client: &Client,
    ns: &str,
    limits: &RemoteLimits,
) -> (ObjectCaches, Changes<ObjectMeta>) {
    let config = owned()
        .timeout(crate::remote::kubeconfig::WATCH_TIMEOUT_SECONDS)
        .page_size(limits.list_page_size);
    let (pods, pod_events) = cached(
        Api::<Pod>::namespaced(client.clone(), ns),
        config.clone(),
        strip_pod,
    );
    let (secrets, secret_events) = cached(
        Api::<PartialObjectMeta<Secret>>::namespaced(client.clone(), ns),
        config.clone(),
        strip_secret,
    );
    let (claims, claim_events) = cached(
        Api::<PartialObjectMeta<PersistentVolumeClaim>>::namespaced(client.clone(), ns),
        config.clone(),
        strip_object,
    );
    let (services, service_events) = cached(
        Api::<PartialObjectMeta<Service>>::namespaced(client.clone(), ns),
        config,
        strip_object,
    );
    let caches = ObjectCaches {
        pods,
        secrets,
        claims,
        services,
    };
    let events = stream::select_all([
        pod_events.map(|r| r.map(|o| o.metadata)).boxed(),
        secret_events.map(|r| r.map(|o| o.metadata)).boxed(),
        claim_events.map(|r| r.map(|o| o.metadata)).boxed(),
        service_events.map(|r| r.map(|o| o.metadata)).boxed(),
    ]);
    (caches, events.boxed())
}

/// Every watch event: wakes the owner the object's labels name, or notes the failure (and wakes
/// every owner of the link when it makes the link unavailable, or changes why).
async fn wake_owners(
    key: HostingKey,
    state: Arc<LinkState>,
    on_change: OnChange,
    mut events: Changes<ObjectMeta>,
) {
    while let Some(event) = events.next().await {
        match event {
            Ok(meta) => on_change(&key, Some(&meta)),
            Err(e) => {
                let Some(u) = watch_failure(&e) else { continue };
                if fail(&state, u) {
                    warn!(hosting = %key, error = %e, "hosting cluster cannot be used");
                    on_change(&key, None);
                } else {
                    debug!(hosting = %key, error = %e, "hosting cluster watch failed");
                }
                state.notify_failed();
            }
        }
    }
}

/// After the first list of every watch (the caches mean something from then on): marks the link
/// synced and wakes every owner of the link.
async fn mark_synced(
    key: HostingKey,
    state: Arc<LinkState>,
    on_change: OnChange,
    caches: ObjectCaches,
) {
    let _ = caches.pods.wait_until_ready().await;
    let _ = caches.secrets.wait_until_ready().await;
    let _ = caches.claims.wait_until_ready().await;
    let _ = caches.services.wait_until_ready().await;
    state.set_synced();
    info!(hosting = %key, "hosting cluster in sync");
    on_change(&key, None);
}

/// While the link is unavailable: probes the hosting cluster every [`PROBE_INTERVAL`] until it
/// answers again, waking every owner of the link when it recovers or why it fails changes.
async fn probe_while_unavailable(
    key: HostingKey,
    state: Arc<LinkState>,
    on_change: OnChange,
    client: Client,
) {
    loop {
        if state.failure().is_none() {
            state.wait_failed().await;
            continue;
        }
        tokio::time::sleep(PROBE_INTERVAL).await;
        match probe(&client, &key.namespace).await {
            Ok(()) => {
                if state.recover() {
                    info!(hosting = %key, "hosting cluster reachable again");
                    on_change(&key, None);
                }
            }
            Err(u) => {
                if fail(&state, u) {
                    on_change(&key, None);
                }
            }
        }
    }
}

/// Records a failure of the link; true when its reason changed (a condition to rewrite).
fn fail(state: &LinkState, u: Unavailable) -> bool {
    let reason = u.reason;
    state.fail(u).is_none_or(|before| before.reason != reason)
}

/// Lists each watched kind (one item, metadata only): what the watches need to work.
async fn probe(client: &Client, ns: &str) -> Result<(), Unavailable> {
    let lp = ListParams::default().limit(1);
    let all = async {
        Api::<Pod>::namespaced(client.clone(), ns)
            .list_metadata(&lp)
            .await?;
        Api::<Secret>::namespaced(client.clone(), ns)
            .list_metadata(&lp)
            .await?;
        Api::<PersistentVolumeClaim>::namespaced(client.clone(), ns)
            .list_metadata(&lp)
            .await?;
        Api::<Service>::namespaced(client.clone(), ns)
            .list_metadata(&lp)
            .await?;
        Ok::<(), kube::Error>(())
    };
    match tokio::time::timeout(PROBE_TIMEOUT, all).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(request_failure(&e)),
        Err(_) => Err(Unavailable {
            reason: REASON_UNREACHABLE,
            message: format!(
                "the hosting cluster did not answer within {}s",
                PROBE_TIMEOUT.as_secs()
            ),
        }),
    }
}

/// A failed request to the hosting cluster, as a reason and a message.
fn request_failure(e: &kube::Error) -> Unavailable {
    match e {
        kube::Error::Api(s) if s.code == 401 || s.code == 403 => Unavailable {
            reason: REASON_FORBIDDEN,
            message: format!(
                "the hosting cluster refuses the credential of the kubeconfig Secret (HTTP {}): {}; grant it manifests/hosting (hosting-rbac.yaml) in the hosting namespace",
                s.code,
                crate::remote::redact::untrusted_message(&s.message)
            ),
        },
        other if LimitError::of(other).is_some_and(LimitError::is_too_large) => Unavailable {
            reason: REASON_ANSWER_TOO_LARGE,
            message: format!("the hosting cluster cannot be used: {}", describe(other)),
        },
        other => Unavailable {
            reason: REASON_UNREACHABLE,
            message: format!("the hosting cluster does not answer: {}", describe(other)),
        },
    }
}

/// A watch error that says the hosting cluster cannot be used; `None` for the routine ones (an
/// expired resourceVersion, after which the watch simply lists again).
fn watch_failure(e: &watcher::Error) -> Option<Unavailable> {
    match e {
        watcher::Error::InitialListFailed(e)
        | watcher::Error::WatchStartFailed(e)
        | watcher::Error::WatchFailed(e) => Some(request_failure(e)),
        watcher::Error::WatchError(s) if s.code == 410 => None,
        watcher::Error::WatchError(s) => Some(request_failure(&kube::Error::Api(s.clone()))),
        _ => None,
    }
}
