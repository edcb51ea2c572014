//! The watch caches the reconcilers read instead of asking an apiserver, and how they are made.
//! [`cached`] turns one watch into a cache and the stream of changed objects that triggers
//! reconciles. What a cache holds is bounded by what the controller reads, never by what others
//! write: each watch selects by label the objects the controller may read (Secrets too: see
//! [`Caches`]), and each object is stripped (`strip_*`) to the labels, annotations, owner
//! references and fields the reconcilers read; an annotation value is kept up to
//! [`MAX_KEPT_ANNOTATION_BYTES`], owner references up to [`MAX_KEPT_OWNERS`]. [`Caches`] are
//! the management cluster's; [`ObjectCaches`] those of the objects the controller makes in one
//! cluster (the management cluster or a hosting cluster).

use capk_api::{
    capi::{Cluster, ClusterStatus, Machine},
    constants::{
        BLOCK_MOVE_ANNOTATION, CLUSTER_NAME_LABEL, CONTROL_PLANE_LABEL,
        ETCD_CLEANUP_ATTEMPT_ANNOTATION, ETCD_CLEANUP_SINCE_ANNOTATION, ETCD_HOST_DIR_ANNOTATION,
        ETCD_VOLUME, KVMCLUSTER_LABEL, KVMMACHINE_LABEL, MACHINE_ROLE_LABEL, MANAGED_BY,
        MAX_LABEL_LEN, MOVE_LABEL, OWNER_NAMESPACE_LABEL, OWNER_UID_LABEL, PAUSED_ANNOTATION,
        RENDERED_FROM_ANNOTATION, bounded_name,
    },
    v1alpha1::{KVMCluster, KVMMachine, KVMMachineTemplate},
};
use futures::{Stream, StreamExt, stream::BoxStream};
use k8s_openapi::{
    NamespaceResourceScope,
    api::core::v1::{Container, PersistentVolumeClaim, Pod, PodSpec, Secret, Service},
    apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference},
};
use kube::{
    Api, Client, Resource, ResourceExt,
    core::PartialObjectMeta,
    runtime::{
        WatchStreamExt,
        reflector::{self, ObjectRef, Store},
        watcher,
    },
};
use serde::de::DeserializeOwned;

use crate::k8s::ownership::{is_capi, is_ours};

/// The changed objects of one watch, as they come: each wakes the reconciles it concerns.
pub type Changes<K> = BoxStream<'static, Result<K, watcher::Error>>;

/// An API of kind `K` in namespace `ns`, or in all namespaces.
pub fn api<K>(client: &Client, ns: Option<&str>) -> Api<K>
where
    K: Resource<Scope = NamespaceResourceScope, DynamicType = ()>,
{
    match ns {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

/// A watch of the objects the controller made (by their managed-by label).
pub fn owned() -> watcher::Config {
    watcher::Config::default().labels(&format!("app.kubernetes.io/managed-by={MANAGED_BY}"))
}

/// A watch of the Secrets of Cluster API clusters (by the cluster-name label, which Cluster
/// API's contracts require on bootstrap data and `<cluster>-kubeconfig` Secrets, and which
/// the controller's Ignition Secrets carry).
pub fn cluster_secrets() -> watcher::Config {
    watcher::Config::default().labels(CLUSTER_NAME_LABEL)
}

/// A watch of hosting kubeconfig Secrets (by clusterctl's move label, which the controller
/// puts on every one a KVMCluster names: see `objects::labelled_secret`).
pub fn hosting_kubeconfigs() -> watcher::Config {
    watcher::Config::default().labels(MOVE_LABEL)
}

/// One watch of `K` that fills a cache and yields the changed objects (to trigger reconciles).
/// Managed fields are dropped from every object, and whatever `strip` removes.
pub fn cached<K>(
    api: Api<K>,
    config: watcher::Config,
    strip: fn(&mut K),
) -> (
    Store<K>,
    impl Stream<Item = Result<K, watcher::Error>> + Send + 'static,
)
where
    K: Resource<DynamicType = ()>
        + Clone
        + DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    let (store, writer) = reflector::store();
    // Small pages (100, or fewer when the caller asks): the first list of thousands of objects
    // is not held in memory at once.
    let page = config.page_size.unwrap_or(100).min(100);
    let stream = reflector::reflector(
        writer,
        watcher(api, config.page_size(page)).modify(move |o: &mut K| {
            o.managed_fields_mut().clear();
            strip(o);
        }),
    )
    .default_backoff()
    .touched_objects();
    (store, stream)
}

/// The longest annotation value a cache keeps. Longer than any value the controller writes or
/// compares (a Secret's name and resourceVersion, a node and a directory); a longer one is cut
/// and ends in `…`, so it still differs from every one of them.
pub const MAX_KEPT_ANNOTATION_BYTES: usize = 1024;

/// The most owner references (of the kinds the controller reads) a cache keeps of one object:
/// the controller's objects have one, and a list it rewrites is read from the apiserver first
/// (`objects::adopt`).
pub const MAX_KEPT_OWNERS: usize = 4;

/// What a cache keeps of one kind's metadata, besides its name, namespace, UID, versions and
/// timestamps.
struct Kept {
    /// Labels, by key.
    labels: &'static [&'static str],
    /// Annotations, by key (values cut at [`MAX_KEPT_ANNOTATION_BYTES`]).
    annotations: &'static [&'static str],
    /// Owner references of the kinds read (up to [`MAX_KEPT_OWNERS`]).
    owners: fn(&OwnerReference) -> bool,
    /// The finalizers: a reconciler's finalizer patch tests the whole list.
    finalizers: bool,
}

/// The labels the controller reads on the objects it makes and the Secrets it reads: cluster,
/// role, owner (namespace, name, UID) and clusterctl's move label.
const OBJECT_LABELS: &[&str] = &[
    CLUSTER_NAME_LABEL,
    MACHINE_ROLE_LABEL,
    OWNER_NAMESPACE_LABEL,
    KVMMACHINE_LABEL,
    KVMCLUSTER_LABEL,
    OWNER_UID_LABEL,
    MOVE_LABEL,
];

fn none(_: &OwnerReference) -> bool {
    false
}

/// Secrets: ours, bootstrap data, kubeconfigs (workload and hosting clusters).
const SECRET: Kept = Kept {
    labels: OBJECT_LABELS,
    annotations: &[RENDERED_FROM_ANNOTATION],
    owners: is_ours,
    finalizers: false,
};
/// Machine Pods and etcd cleanup Pods.
const POD: Kept = Kept {
    labels: OBJECT_LABELS,
    annotations: &[
        ETCD_CLEANUP_ATTEMPT_ANNOTATION,
        ETCD_CLEANUP_SINCE_ANNOTATION,
    ],
    owners: is_ours,
    finalizers: false,
};
/// PVCs and Services the controller makes.
const OBJECT: Kept = Kept {
    labels: OBJECT_LABELS,
    annotations: &[],
    owners: is_ours,
    finalizers: false,
};
const KVM_MACHINE: Kept = Kept {
    labels: &[CLUSTER_NAME_LABEL],
    annotations: &[
        PAUSED_ANNOTATION,
        BLOCK_MOVE_ANNOTATION,
        ETCD_HOST_DIR_ANNOTATION,
    ],
    owners: is_capi,
    finalizers: true,
};
const KVM_CLUSTER: Kept = Kept {
    labels: &[CLUSTER_NAME_LABEL],
    annotations: &[PAUSED_ANNOTATION, BLOCK_MOVE_ANNOTATION],
    owners: is_capi,
    finalizers: true,
};
const KVM_MACHINE_TEMPLATE: Kept = Kept {
    labels: &[],
    annotations: &[PAUSED_ANNOTATION],
    owners: none,
    finalizers: false,
};
const MACHINE: Kept = Kept {
    labels: &[CONTROL_PLANE_LABEL],
    annotations: &[],
    owners: none,
    finalizers: false,
};
const CLUSTER: Kept = Kept {
    labels: &[],
    annotations: &[],
    owners: none,
    finalizers: false,
};

/// Strips `meta` to what `kept` keeps.
fn keep(meta: &mut ObjectMeta, kept: &Kept) {
    meta.managed_fields = None;
    meta.labels = meta
        .labels
        .take()
        .map(|mut l| {
            l.retain(|k, _| kept.labels.contains(&k.as_str()));
            l
        })
        .filter(|l| !l.is_empty());
    meta.annotations = meta
        .annotations
        .take()
        .map(|mut a| {
            a.retain(|k, _| kept.annotations.contains(&k.as_str()));
            a.values_mut().for_each(cut);
            a
        })
        .filter(|a| !a.is_empty());
    meta.owner_references = meta
        .owner_references
        .take()
        .map(|refs| {
            refs.into_iter()
                .filter(|r| (kept.owners)(r))
                .take(MAX_KEPT_OWNERS)
                .collect::<Vec<_>>()
        })
        .filter(|r| !r.is_empty());
    if !kept.finalizers {
        meta.finalizers = None;
    }
}

/// Cuts `value` to at most [`MAX_KEPT_ANNOTATION_BYTES`], ending in `…` when cut.
fn cut(value: &mut String) {
    if value.len() <= MAX_KEPT_ANNOTATION_BYTES {
        return;
    }
    let mut end = MAX_KEPT_ANNOTATION_BYTES - '…'.len_utf8();
    while !value.is_char_boundary(end) {
        end -= 1;
    }
    value.truncate(end);
    value.push('…');
}

/// Of a Secret only its metadata is watched (data is read when needed), and of that only what
/// the controller reads: the owner labels, the cluster's and the move label, the rendered-from
/// annotation and owner references to our kinds. Anyone who may write a Secret may give it
/// hundreds of KiB of labels and annotations.
pub fn strip_secret(s: &mut PartialObjectMeta<Secret>) {
    keep(&mut s.metadata, &SECRET);
}

/// Of a PVC or Service the controller makes only its owner labels and owner references.
pub fn strip_object<K: Resource>(o: &mut K) {
    keep(o.meta_mut(), &OBJECT);
}

/// Of a machine Pod only its owner labels and references, its status, node, hostPath etcd
/// volume (where its etcd data stays behind) and the `--etcd-owner` argument that marked it
/// are read, and of an etcd cleanup Pod its
/// attempt annotations; the spec is most of its size.
pub fn strip_pod(p: &mut Pod) {
    keep(&mut p.metadata, &POD);
    if let Some(spec) = p.spec.as_mut() {
        let etcd = std::mem::take(&mut spec.volumes)
            .into_iter()
            .flatten()
            .filter(|v| v.name == ETCD_VOLUME && v.host_path.is_some())
            .collect::<Vec<_>>();
        let host_etcd = !etcd.is_empty();
        *spec = PodSpec {
            node_name: spec.node_name.take(),
            volumes: (!etcd.is_empty()).then_some(etcd),
            containers: std::mem::take(&mut spec.containers)
                .into_iter()
                .map(|c| {
                    let owner: Vec<String> = host_etcd
                        .then(|| c.args.into_iter().flatten())
                        .into_iter()
                        .flatten()
                        .filter(|a| a.starts_with("--etcd-owner="))
                        .collect();
                    Container {
                        name: c.name,
                        args: (!owner.is_empty()).then_some(owner),
                        ..Default::default()
                    }
                })
                .collect(),
            ..Default::default()
        };
    }
}

/// Of a KVMMachine its spec and status, finalizers, its Machine's owner reference, its
/// cluster's label, and the annotations the controller reads (paused, clusterctl's block-move,
/// the etcd directory).
pub fn strip_kvm_machine(km: &mut KVMMachine) {
    keep(&mut km.metadata, &KVM_MACHINE);
}

/// Of a KVMCluster its spec and status, finalizers, its Cluster's owner reference, its
/// cluster's label and the annotations the controller reads (paused, clusterctl's block-move).
pub fn strip_kvm_cluster(kc: &mut KVMCluster) {
    keep(&mut kc.metadata, &KVM_CLUSTER);
}

/// Of a KVMMachineTemplate its spec, status and the paused annotation.
pub fn strip_kvm_machine_template(t: &mut KVMMachineTemplate) {
    keep(&mut t.metadata, &KVM_MACHINE_TEMPLATE);
}

/// Of a Cluster API Machine (the controller watches every provider's) its spec (the few fields
/// [`capk_api::capi::Machine`] has) and the control-plane label; no status.
pub fn strip_machine(m: &mut Machine) {
    keep(&mut m.metadata, &MACHINE);
    m.status = None;
}

/// Of a Cluster API Cluster its spec (the few fields [`capk_api::capi::Cluster`] has) and
/// whether its infrastructure is provisioned.
pub fn strip_cluster(c: &mut Cluster) {
    keep(&mut c.metadata, &CLUSTER);
    c.status = c.status.take().map(|s| ClusterStatus {
        initialization: s.initialization,
        ..Default::default()
    });
}

/// The object of `store` in `ns` whose name label (the name, cut and hashed when long, as
/// the ownership labels have it) is `label`.
pub fn named_by_label<K>(store: &Store<K>, ns: &str, label: &str) -> Option<ObjectRef<K>>
where
    K: Resource<DynamicType = ()> + Clone + 'static,
{
    let direct = ObjectRef::new(label).within(ns);
    if store.get(&direct).is_some() {
        return Some(direct);
    }
    store
        .state()
        .into_iter()
        .find(|o| {
            o.namespace().as_deref() == Some(ns)
                && bounded_name(&o.name_any(), "", MAX_LABEL_LEN) == label
        })
        .map(|o| ObjectRef::from(&*o))
}

/// The watch caches of the objects the controller makes in one cluster (metadata only but for
/// the Pods). In the management cluster the Secrets are those of Cluster API clusters (ours,
/// bootstrap data and kubeconfigs: [`cluster_secrets`]); in a hosting cluster only ours.
#[derive(Clone)]
pub struct ObjectCaches {
    /// Machine Pods (ours, by label).
    pub pods: Store<Pod>,
    /// Secrets.
    pub secrets: Store<PartialObjectMeta<Secret>>,
    /// etcd PVCs (ours, by label).
    pub claims: Store<PartialObjectMeta<PersistentVolumeClaim>>,
    /// Control-plane Services (ours, by label).
    pub services: Store<PartialObjectMeta<Service>>,
}

/// Read-only views of the management cluster's watches that also trigger reconciles. Each is
/// filled by exactly one watch; Secrets, PVCs and Services are watched as metadata only (data is
/// read when needed). No cache holds a Secret the controller does not read: Secrets are
/// selected by label ([`cluster_secrets`], [`hosting_kubeconfigs`]); one the controller finds
/// by name without the label gets it (`objects::labelled_secret`).
#[derive(Clone)]
pub struct Caches {
    /// KVMMachines (the KVMMachine controller's own store).
    pub kvm_machines: Store<KVMMachine>,
    /// KVMClusters (a watch apart from the KVMCluster controller's).
    pub kvm_clusters: Store<KVMCluster>,
    /// Cluster API Machines.
    pub machines: Store<Machine>,
    /// Cluster API Clusters.
    pub clusters: Store<Cluster>,
    /// Machine Pods (ours only, by label), without managed fields.
    pub pods: Store<Pod>,
    /// The metadata of Cluster API clusters' Secrets: our Ignition Secrets, bootstrap data,
    /// `<cluster>-kubeconfig` ([`cluster_secrets`]).
    pub secrets: Store<PartialObjectMeta<Secret>>,
    /// The metadata of hosting kubeconfig Secrets ([`hosting_kubeconfigs`]).
    pub hosting_kubeconfigs: Store<PartialObjectMeta<Secret>>,
    /// Our etcd PVCs' metadata.
    pub claims: Store<PartialObjectMeta<PersistentVolumeClaim>>,
    /// Our control-plane Services' metadata.
    pub services: Store<PartialObjectMeta<Service>>,
    /// Turns true once every store above has listed (see [`Caches::watch_readiness`]).
    pub synced: tokio::sync::watch::Receiver<bool>,
}

/// The changes of the management cluster's watches behind [`Caches`] that trigger KVMMachine
/// reconciles, one stream each (the KVMCluster controller looks at some on the way: each
/// reconciler's `watches` module says which).
pub struct Events {
    /// KVMClusters.
    pub kvm_clusters: Changes<KVMCluster>,
    /// KVMMachines.
    pub kvm_machines: Changes<KVMMachine>,
    /// Cluster API Machines.
    pub machines: Changes<Machine>,
    /// Cluster API Clusters.
    pub clusters: Changes<Cluster>,
    /// Machine Pods (and etcd cleanup Pods).
    pub pods: Changes<Pod>,
    /// Secrets' metadata: those of Cluster API clusters and hosting kubeconfigs.
    pub secrets: Changes<PartialObjectMeta<Secret>>,
    /// Our PVCs' metadata.
    pub claims: Changes<PartialObjectMeta<PersistentVolumeClaim>>,
}

impl Caches {
    /// Starts the management cluster's watches (of namespace `ns`, or all): their caches, and
    /// their changes for the controllers to consume (our Services' for the KVMCluster
    /// controller, the rest in [`Events`]). A task sets `synced` once every cache has listed.
    pub fn watch(
        client: &Client,
        ns: Option<&str>,
    ) -> (Self, Events, Changes<PartialObjectMeta<Service>>) {
        let (kvm_clusters, kvm_cluster_events) = cached(
            api::<KVMCluster>(client, ns),
            Default::default(),
            strip_kvm_cluster,
        );
        let (kvm_machines, kvm_machine_events) = cached(
            api::<KVMMachine>(client, ns),
            Default::default(),
            strip_kvm_machine,
        );
        let (machines, machine_events) = cached(
            api::<Machine>(client, ns),
            Default::default(),
            strip_machine,
        );
        let (clusters, cluster_events) = cached(
            api::<Cluster>(client, ns),
            Default::default(),
            strip_cluster,
        );
        let (pods, pod_events) = cached(api::<Pod>(client, ns), owned(), strip_pod);
        // Secrets, PVCs and Services as metadata only: their data is read when needed. Pages of
        // 2 Secrets: each may carry up to 1.5 MiB of labels and annotations until stripped, and
        // a page is held about five times over while it is read (body, text, objects).
        let (secrets, secret_events) = cached(
            api::<PartialObjectMeta<Secret>>(client, ns),
            cluster_secrets().page_size(2),
            strip_secret,
        );
        let (hosting_kubeconfigs, hosting_kubeconfig_events) = cached(
            api::<PartialObjectMeta<Secret>>(client, ns),
            hosting_kubeconfigs().page_size(2),
            strip_secret,
        );
        let (claims, claim_events) = cached(
            api::<PartialObjectMeta<PersistentVolumeClaim>>(client, ns),
            owned(),
            strip_object,
        );
        let (services, service_events) = cached(
            api::<PartialObjectMeta<Service>>(client, ns),
            owned(),
            strip_object,
        );
        let (synced_tx, synced) = tokio::sync::watch::channel(false);
        let caches = Self {
            kvm_machines,
            kvm_clusters,
            machines,
            clusters,
            pods,
            secrets,
            hosting_kubeconfigs,
            claims,
            services,
            synced,
        };
        tokio::spawn(caches.clone().watch_readiness(synced_tx));
        let events = Events {
            kvm_clusters: kvm_cluster_events.boxed(),
            kvm_machines: kvm_machine_events.boxed(),
            machines: machine_events.boxed(),
            clusters: cluster_events.boxed(),
            pods: pod_events.boxed(),
            secrets: futures::stream::select(secret_events, hosting_kubeconfig_events).boxed(),
            claims: claim_events.boxed(),
        };
        (caches, events, service_events.boxed())
    }

    /// Waits until every watch has listed once, so that "not in the cache" means "does not
    /// exist" (up to watch lag, which the reconcilers tolerate).
    pub async fn ready(&self) {
        let _ = self.synced.clone().wait_for(|s| *s).await;
    }

    /// Sets `synced` once every store has listed. Each store is awaited by this one task only:
    /// `Store::wait_until_ready` wakes only the last of several concurrent waiters (kube-runtime
    /// 5.0 keeps one waker), which left all but one of the first reconciles waiting forever.
    /// The KVMMachine store is the Controller's own, which it awaits before any reconcile.
    pub async fn watch_readiness(self, synced: tokio::sync::watch::Sender<bool>) {
        let _ = self.kvm_clusters.wait_until_ready().await;
        let _ = self.machines.wait_until_ready().await;
        let _ = self.clusters.wait_until_ready().await;
        let _ = self.pods.wait_until_ready().await;
        let _ = self.secrets.wait_until_ready().await;
        let _ = self.hosting_kubeconfigs.wait_until_ready().await;
        let _ = self.claims.wait_until_ready().await;
        let _ = self.services.wait_until_ready().await;
        let _ = synced.send(true);
    }

    /// The management cluster's caches of the objects the controller makes.
    pub fn objects(&self) -> ObjectCaches {
        ObjectCaches {
            pods: self.pods.clone(),
            secrets: self.secrets.clone(),
            claims: self.claims.clone(),
            services: self.services.clone(),
        }
    }
}

#[cfg(test)]
pub(crate) mod testing {
    use super::*;

    /// A cache holding `objects`, as its watch would have filled it.
    pub fn store<K>(objects: Vec<K>) -> Store<K>
    where
        K: Resource<DynamicType = ()> + Clone + 'static,
    {
        let (store, mut writer) = reflector::store();
        for o in objects {
            writer.apply_watcher_event(&watcher::Event::Apply(o));
        }
        store
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use serde_json::{Value, json};

    /// Metadata as anyone who may write the object can make it: hundreds of labels and
    /// annotations, owner references and finalizers of others, beside `ours`.
    fn crowded(ours: Value) -> Value {
        let mut meta = json!({
            "name": "m", "namespace": "team-a", "uid": "u", "resourceVersion": "7",
            "labels": {}, "annotations": {"example.com/blob": "x".repeat(200 << 10)},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "r",
                                 "uid": "r"}],
            "finalizers": ["example.com/keep"],
            "managedFields": [{"manager": "kubectl", "operation": "Update"}],
        });
        for i in 0..300 {
            meta["labels"][format!("example.com/l{i}")] = json!("v".repeat(63));
        }
        for (k, v) in ours.as_object().unwrap() {
            let section = meta[k].as_object_mut().map(|m| m.len());
            match (v, section) {
                (Value::Object(o), Some(_)) => {
                    meta[k].as_object_mut().unwrap().extend(o.clone());
                }
                (Value::Array(a), _) => meta[k].as_array_mut().unwrap().extend(a.clone()),
                _ => meta[k] = v.clone(),
            }
        }
        meta
    }

    fn reference(api_version: &str, kind: &str) -> Value {
        json!({"apiVersion": api_version, "kind": kind, "name": "m", "uid": kind})
    }

    #[test]
    fn a_cached_secret_keeps_only_the_labels_annotation_and_owners_the_controller_reads() {
        let mut s: PartialObjectMeta<Secret> = serde_json::from_value(json!({
            "apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
            "metadata": crowded(json!({
                "labels": {CLUSTER_NAME_LABEL: "demo", OWNER_NAMESPACE_LABEL: "team-a",
                           KVMMACHINE_LABEL: "m", MOVE_LABEL: ""},
                "annotations": {RENDERED_FROM_ANNOTATION: "m-bootstrap@7"},
                "ownerReferences": [reference("infrastructure.cluster.x-k8s.io/v1alpha1",
                                              "KVMMachine")],
            })),
        }))
        .unwrap();
        strip_secret(&mut s);
        assert_eq!(
            serde_json::to_value(&s.metadata).unwrap(),
            json!({"name": "m", "namespace": "team-a", "uid": "u", "resourceVersion": "7",
                "labels": {CLUSTER_NAME_LABEL: "demo", OWNER_NAMESPACE_LABEL: "team-a",
                           KVMMACHINE_LABEL: "m", MOVE_LABEL: ""},
                "annotations": {RENDERED_FROM_ANNOTATION: "m-bootstrap@7"},
                "ownerReferences": [reference("infrastructure.cluster.x-k8s.io/v1alpha1",
                                              "KVMMachine")]})
        );
    }

    #[test]
    fn a_long_annotation_value_is_cut_and_differs_from_every_shorter_one() {
        let kept = format!(
            "{}{}",
            "n:/srv/etcd/",
            "d".repeat(MAX_KEPT_ANNOTATION_BYTES)
        );
        // A multi-byte character across the cut: the cut stays on a character boundary.
        let mut value = format!(
            "{}é{}",
            "a".repeat(MAX_KEPT_ANNOTATION_BYTES - 4),
            "b".repeat(9)
        );
        cut(&mut value);
        assert!(value.len() <= MAX_KEPT_ANNOTATION_BYTES);
        assert!(value.ends_with('…'));
        let mut value = kept.clone();
        cut(&mut value);
        assert!(value.len() <= MAX_KEPT_ANNOTATION_BYTES && value.ends_with('…'));
        assert!(kept.starts_with(value.trim_end_matches('…')));
        let mut short = "m-bootstrap@7".to_owned();
        cut(&mut short);
        assert_eq!(short, "m-bootstrap@7");
    }

    #[test]
    fn a_cached_kvmmachine_keeps_its_finalizers_machine_and_the_annotations_read() {
        let mut km: KVMMachine = serde_json::from_value(json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1", "kind": "KVMMachine",
            "metadata": crowded(json!({
                "labels": {CLUSTER_NAME_LABEL: "demo"},
                "annotations": {PAUSED_ANNOTATION: "", BLOCK_MOVE_ANNOTATION: "true",
                                ETCD_HOST_DIR_ANNOTATION: "n1:/srv/etcd/team-a/m",
                                "kubectl.kubernetes.io/last-applied-configuration": "{}"},
                "ownerReferences": [reference("cluster.x-k8s.io/v1beta2", "Machine")],
                "finalizers": ["kvmmachine.infrastructure.cluster.x-k8s.io"],
            })),
            "spec": {"resources": {"cpu": 1, "memory": "1Gi", "disk": "2Gi"}},
        }))
        .unwrap();
        let spec = km.spec.clone();
        strip_kvm_machine(&mut km);
        assert_eq!(
            serde_json::to_value(&km.metadata).unwrap(),
            json!({"name": "m", "namespace": "team-a", "uid": "u", "resourceVersion": "7",
                "labels": {CLUSTER_NAME_LABEL: "demo"},
                "annotations": {PAUSED_ANNOTATION: "", BLOCK_MOVE_ANNOTATION: "true",
                                ETCD_HOST_DIR_ANNOTATION: "n1:/srv/etcd/team-a/m"},
                "ownerReferences": [reference("cluster.x-k8s.io/v1beta2", "Machine")],
                "finalizers": ["example.com/keep", "kvmmachine.infrastructure.cluster.x-k8s.io"]})
        );
        assert_eq!(km.spec, spec);
    }

    #[test]
    fn a_cached_kvmcluster_keeps_its_finalizers_cluster_label_and_paused() {
        let mut kc: KVMCluster = serde_json::from_value(json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1", "kind": "KVMCluster",
            "metadata": crowded(json!({
                "labels": {CLUSTER_NAME_LABEL: "demo"},
                "annotations": {PAUSED_ANNOTATION: ""},
                "ownerReferences": [reference("cluster.x-k8s.io/v1beta2", "Cluster")],
            })),
            "spec": {},
        }))
        .unwrap();
        strip_kvm_cluster(&mut kc);
        let meta = serde_json::to_value(&kc.metadata).unwrap();
        assert_eq!(meta["labels"], json!({CLUSTER_NAME_LABEL: "demo"}));
        assert_eq!(meta["annotations"], json!({PAUSED_ANNOTATION: ""}));
        assert_eq!(
            meta["ownerReferences"],
            json!([reference("cluster.x-k8s.io/v1beta2", "Cluster")])
        );
        assert_eq!(meta["finalizers"], json!(["example.com/keep"]));
        assert!(meta.get("managedFields").is_none());
    }

    #[test]
    fn a_cached_machine_and_cluster_keep_their_spec_the_control_plane_label_and_provisioned() {
        let mut m: Machine = serde_json::from_value(json!({
            "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine",
            "metadata": crowded(json!({"labels": {CONTROL_PLANE_LABEL: ""}})),
            "spec": {"clusterName": "demo", "bootstrap": {"dataSecretName": "m-bootstrap"},
                     "infrastructureRef": {"apiGroup": "infrastructure.cluster.x-k8s.io",
                                           "kind": "KVMMachine", "name": "m"}},
            "status": {"phase": "Running", "conditions": []},
        }))
        .unwrap();
        let spec = m.spec.clone();
        strip_machine(&mut m);
        assert!(m.is_control_plane());
        assert_eq!(m.spec, spec);
        assert_eq!(
            serde_json::to_value(&m.metadata).unwrap(),
            json!({"name": "m", "namespace": "team-a", "uid": "u", "resourceVersion": "7",
                   "labels": {CONTROL_PLANE_LABEL: ""}})
        );
        assert_eq!(m.status, None);

        let mut c: Cluster = serde_json::from_value(json!({
            "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Cluster",
            "metadata": crowded(json!({})),
            "spec": {"paused": true},
            "status": {"initialization": {"infrastructureProvisioned": true}, "phase": "x",
                       "conditions": []},
        }))
        .unwrap();
        strip_cluster(&mut c);
        assert!(c.is_paused() && c.infrastructure_provisioned());
        assert_eq!(
            serde_json::to_value(&c).unwrap()["status"],
            json!({"initialization": {"infrastructureProvisioned": true}})
        );
        assert_eq!(c.metadata.labels, None);
        assert_eq!(c.metadata.annotations, None);
    }

    #[test]
    fn a_cached_cleanup_pod_keeps_its_attempt_and_our_owner_references_only() {
        let mut p: Pod = serde_json::from_value(json!({
            "metadata": crowded(json!({
                "labels": {OWNER_NAMESPACE_LABEL: "team-a", KVMMACHINE_LABEL: "m",
                           MACHINE_ROLE_LABEL: "control-plane"},
                "annotations": {ETCD_CLEANUP_ATTEMPT_ANNOTATION: "2",
                                ETCD_CLEANUP_SINCE_ANNOTATION: "2026-01-01T00:00:00Z"},
                "ownerReferences": (0..10).map(|_| reference(
                    "infrastructure.cluster.x-k8s.io/v1alpha1", "KVMMachine"))
                    .collect::<Vec<_>>(),
            })),
        }))
        .unwrap();
        strip_pod(&mut p);
        let meta = serde_json::to_value(&p.metadata).unwrap();
        assert_eq!(
            meta["labels"],
            json!({OWNER_NAMESPACE_LABEL: "team-a", KVMMACHINE_LABEL: "m",
                   MACHINE_ROLE_LABEL: "control-plane"})
        );
        assert_eq!(
            meta["annotations"],
            json!({ETCD_CLEANUP_ATTEMPT_ANNOTATION: "2",
                   ETCD_CLEANUP_SINCE_ANNOTATION: "2026-01-01T00:00:00Z"})
        );
        assert_eq!(
            meta["ownerReferences"].as_array().unwrap().len(),
            MAX_KEPT_OWNERS
        );
        assert!(meta.get("finalizers").is_none());
    }

    #[test]
    fn a_cached_pvc_or_service_keeps_only_its_owner_labels_and_references() {
        let mut s: PartialObjectMeta<Service> = serde_json::from_value(json!({
            "apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
            "metadata": crowded(json!({
                "labels": {OWNER_NAMESPACE_LABEL: "team-a", KVMCLUSTER_LABEL: "demo",
                           OWNER_UID_LABEL: "u"},
                "ownerReferences": [reference("infrastructure.cluster.x-k8s.io/v1alpha1",
                                              "KVMCluster")],
            })),
        }))
        .unwrap();
        strip_object(&mut s);
        assert_eq!(
            serde_json::to_value(&s.metadata).unwrap(),
            json!({"name": "m", "namespace": "team-a", "uid": "u", "resourceVersion": "7",
                "labels": {OWNER_NAMESPACE_LABEL: "team-a", KVMCLUSTER_LABEL: "demo",
                           OWNER_UID_LABEL: "u"},
                "ownerReferences": [reference("infrastructure.cluster.x-k8s.io/v1alpha1",
                                              "KVMCluster")]})
        );
    }

    #[test]
    fn a_cached_machine_pod_keeps_its_node_its_hostpath_etcd_volume_and_owner_argument() {
        let mut p: Pod = serde_json::from_value(json!({
            "metadata": {"name": "m"},
            "spec": {
                "nodeName": "n1",
                "volumes": [
                    {"name": ETCD_VOLUME, "hostPath": {"path": "/srv/etcd/team-a/m"}},
                    {"name": "state", "emptyDir": {}}],
                "containers": [{"name": "launcher", "image": "launcher:1",
                                "args": ["--x", "--etcd-owner=team-a/m/1111"],
                                "startupProbe": {"exec": {"command": ["a"]}}}],
            },
            "status": {"phase": "Running"},
        }))
        .unwrap();
        strip_pod(&mut p);
        assert_eq!(
            serde_json::to_value(&p).unwrap(),
            serde_json::json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "m"},
                "spec": {"nodeName": "n1",
                    "volumes": [{"name": ETCD_VOLUME, "hostPath": {"path": "/srv/etcd/team-a/m"}}],
                    "containers": [{"name": "launcher", "args": ["--etcd-owner=team-a/m/1111"]}]},
                "status": {"phase": "Running"}})
        );
    }
}
