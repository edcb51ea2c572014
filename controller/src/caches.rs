//! The watch caches the reconcilers read instead of asking an apiserver, and how they are made.
//! [`cached`] turns one watch into a cache and the stream of changed objects that triggers
//! reconciles; each cache keeps only what the reconcilers read of an object (`strip_*`), so
//! thousands of objects written by others are not the controller's memory. [`Caches`] are the
//! management cluster's; [`ObjectCaches`] those of the objects the controller makes in one
//! cluster (the management cluster or a hosting cluster).

use capk_api::{
    capi::{Cluster, Machine},
    constants::{ETCD_VOLUME, MANAGED_BY, MAX_LABEL_LEN, RENDERED_FROM_ANNOTATION, bounded_name},
    v1alpha1::{KVMCluster, KVMMachine},
};
use futures::{Stream, StreamExt, stream::BoxStream};
use k8s_openapi::{
    NamespaceResourceScope,
    api::core::v1::{Container, PersistentVolumeClaim, Pod, PodSpec, Secret, Service},
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

/// Every Secret's metadata is watched (bootstrap data, kubeconfigs, hosting kubeconfigs are
/// found by name), but of its annotations only the one the controller reads is kept: anyone
/// may annotate a Secret with up to 256 KiB, and thousands of them would otherwise be the
/// controller's memory.
pub fn strip_secret(s: &mut PartialObjectMeta<Secret>) {
    if let Some(annotations) = s.metadata.annotations.as_mut() {
        annotations.retain(|k, _| k == RENDERED_FROM_ANNOTATION);
    }
}

/// Of a machine Pod only its status, node, hostPath etcd volume (where its etcd data stays
/// behind) and whether its containers have a startup probe are read; the spec is most of its
/// size.
pub fn strip_pod(p: &mut Pod) {
    if let Some(spec) = p.spec.as_mut() {
        let etcd = std::mem::take(&mut spec.volumes)
            .into_iter()
            .flatten()
            .filter(|v| v.name == ETCD_VOLUME && v.host_path.is_some())
            .collect::<Vec<_>>();
        *spec = PodSpec {
            node_name: spec.node_name.take(),
            volumes: (!etcd.is_empty()).then_some(etcd),
            containers: std::mem::take(&mut spec.containers)
                .into_iter()
                .map(|c| Container {
                    name: c.name,
                    startup_probe: c.startup_probe,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        };
    }
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
/// the Pods). In the management cluster the Secrets are all of them (bootstrap data and
/// kubeconfigs too); in a hosting cluster only ours.
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
/// read when needed).
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
    /// Every Secret's metadata: our Ignition Secrets, bootstrap data, `<cluster>-kubeconfig`.
    pub secrets: Store<PartialObjectMeta<Secret>>,
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
    /// Secrets' metadata.
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
        let (kvm_clusters, kvm_cluster_events) =
            cached(api::<KVMCluster>(client, ns), Default::default(), |_| {});
        let (kvm_machines, kvm_machine_events) =
            cached(api::<KVMMachine>(client, ns), Default::default(), |_| {});
        let (machines, machine_events) =
            cached(api::<Machine>(client, ns), Default::default(), |_| {});
        let (clusters, cluster_events) =
            cached(api::<Cluster>(client, ns), Default::default(), |_| {});
        let (pods, pod_events) = cached(api::<Pod>(client, ns), owned(), strip_pod);
        // Secrets, PVCs and Services as metadata only: their data is read when needed.
        let (secrets, secret_events) = cached(
            api::<PartialObjectMeta<Secret>>(client, ns),
            // Pages of 25: each Secret may carry up to 256 KiB of annotations until stripped.
            watcher::Config::default().page_size(25),
            strip_secret,
        );
        let (claims, claim_events) = cached(
            api::<PartialObjectMeta<PersistentVolumeClaim>>(client, ns),
            owned(),
            |_| {},
        );
        let (services, service_events) = cached(
            api::<PartialObjectMeta<Service>>(client, ns),
            owned(),
            |_| {},
        );
        let (synced_tx, synced) = tokio::sync::watch::channel(false);
        let caches = Self {
            kvm_machines,
            kvm_clusters,
            machines,
            clusters,
            pods,
            secrets,
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
            secrets: secret_events.boxed(),
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

    /// The metadata of Secret `name` in `ns`, if it exists.
    pub fn secret(
        &self,
        ns: &str,
        name: &str,
    ) -> Option<std::sync::Arc<PartialObjectMeta<Secret>>> {
        self.secrets.get(&ObjectRef::new(name).within(ns))
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

    #[test]
    fn a_cached_secret_keeps_only_the_annotation_the_controller_reads() {
        let mut s: PartialObjectMeta<Secret> = serde_json::from_value(serde_json::json!({
            "apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
            "metadata": {"name": "m-ignition", "labels": {"a": "b"}, "annotations": {
                "example.com/blob": "x".repeat(64 << 10),
                RENDERED_FROM_ANNOTATION: "m-bootstrap@7"}},
        }))
        .unwrap();
        strip_secret(&mut s);
        let annotations = s.metadata.annotations.unwrap();
        assert_eq!(
            annotations.keys().collect::<Vec<_>>(),
            [RENDERED_FROM_ANNOTATION]
        );
        assert_eq!(s.metadata.labels.unwrap()["a"], "b");
    }

    #[test]
    fn a_cached_machine_pod_keeps_its_node_its_hostpath_etcd_volume_and_startup_probes() {
        let mut p: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "m"},
            "spec": {
                "nodeName": "n1",
                "volumes": [
                    {"name": ETCD_VOLUME, "hostPath": {"path": "/srv/etcd/team-a/m"}},
                    {"name": "state", "emptyDir": {}}],
                "containers": [{"name": "launcher", "image": "launcher:1",
                                "args": ["--x"], "startupProbe": {"exec": {"command": ["a"]}}}],
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
                    "containers": [{"name": "launcher", "startupProbe": {"exec": {"command": ["a"]}}}]},
                "status": {"phase": "Running"}})
        );
    }
}
