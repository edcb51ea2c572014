//! What wakes a KVMCluster reconcile, and the controller that runs it ([`run`]): its own changes,
//! its Cluster ([`kvmcluster_of_cluster`]), its control-plane Service
//! ([`kvmcluster_of_service`]), and what other watches
//! see that concerns it, through a [`Wake`]: a control-plane machine Pod that changes (an
//! endpoint of the Service, [`kvmcluster_of_pod`]), a KVMMachine being deleted
//! ([`kvmclusters_of_deleted_machine`]), a hosting kubeconfig Secret that changes
//! ([`kvmclusters_of_hosting_secret`]) and a hosting cluster's objects and availability
//! ([`kvmclusters_of_hosted_object`], [`kvmclusters_of_hosting`]).

use std::sync::Arc;

use capk_api::{
    capi::Cluster,
    constants::{
        CLUSTER_NAME_LABEL, KVMCLUSTER_LABEL, MACHINE_ROLE_LABEL, OWNER_NAMESPACE_LABEL,
        ROLE_CONTROL_PLANE,
    },
    v1alpha1::{KVMCluster, KVMMachine},
};
use futures::{StreamExt, channel::mpsc::UnboundedReceiver};
use k8s_openapi::{
    api::core::v1::{Pod, Secret, Service},
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use kube::{
    ResourceExt,
    core::PartialObjectMeta,
    runtime::{
        Controller,
        controller::Config,
        reflector::{ObjectRef, Store},
        watcher,
    },
};

use crate::k8s::ownership::cluster_of;
use crate::{
    k8s::caches::{Caches, Changes, Events, api, cached, named_by_label, strip_kvm_cluster},
    remote::hosting::{self, HostingKey, OnChange},
    runtime::context::Context,
    runtime::outcome,
};

/// The KVMCluster a Cluster's infrastructureRef names.
pub fn kvmcluster_of_cluster(cluster: Cluster) -> Option<ObjectRef<KVMCluster>> {
    let ns = cluster.namespace()?;
    let r = cluster.spec.infrastructure_ref.as_ref()?;
    (r.kind == "KVMCluster").then(|| ObjectRef::new(&r.name).within(&ns))
}

/// The KVMCluster whose control-plane Service a control-plane machine Pod is an endpoint of
/// (found through its Cluster, by the Pod's cluster-name and owner-namespace labels: the Pod
/// may be in a machine namespace); `None` for other Pods.
pub fn kvmcluster_of_pod(pod: &Pod, clusters: &Store<Cluster>) -> Option<ObjectRef<KVMCluster>> {
    let labels = pod.labels();
    if labels.get(MACHINE_ROLE_LABEL).map(String::as_str) != Some(ROLE_CONTROL_PLANE) {
        return None;
    }
    let ns = labels
        .get(OWNER_NAMESPACE_LABEL)
        .cloned()
        .or_else(|| pod.namespace())?;
    let cluster = clusters.get(&ObjectRef::new(labels.get(CLUSTER_NAME_LABEL)?).within(&ns))?;
    let infra = cluster.spec.infrastructure_ref.as_ref()?;
    (infra.kind == "KVMCluster").then(|| ObjectRef::new(&infra.name).within(&ns))
}

/// The KVMClusters of a KVMMachine being deleted: one with a hosting cluster waits for its
/// machines to be gone before it goes. None for a KVMMachine not being deleted.
pub fn kvmclusters_of_deleted_machine(
    km: &KVMMachine,
    kvm_clusters: &Store<KVMCluster>,
) -> Vec<ObjectRef<KVMCluster>> {
    if km.metadata.deletion_timestamp.is_none() {
        return Vec::new();
    }
    let cluster = cluster_of(km);
    kvm_clusters
        .state()
        .into_iter()
        .filter(|kc| kc.namespace() == km.namespace() && cluster_of(&**kc) == cluster)
        .map(|kc| ObjectRef::from(&*kc))
        .collect()
}

/// The KVMCluster of a control-plane Service of the management cluster: the one its owner
/// reference names beside it, or its labels name from a machine namespace.
pub fn kvmcluster_of_service(
    meta: &ObjectMeta,
    kvm_clusters: &Store<KVMCluster>,
) -> Option<ObjectRef<KVMCluster>> {
    let owned = meta
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.kind == "KVMCluster");
    if let (Some(owner), Some(ns)) = (owned, &meta.namespace) {
        return Some(ObjectRef::new(&owner.name).within(ns));
    }
    let labels = meta.labels.as_ref()?;
    named_by_label(
        kvm_clusters,
        labels.get(OWNER_NAMESPACE_LABEL)?,
        labels.get(KVMCLUSTER_LABEL)?,
    )
}

/// The KVMClusters whose hosting cluster's kubeconfig is Secret `s`.
pub fn kvmclusters_of_hosting_secret(
    s: &PartialObjectMeta<Secret>,
    kvm_clusters: &Store<KVMCluster>,
) -> Vec<ObjectRef<KVMCluster>> {
    let (ns, name) = (s.namespace(), s.name_any());
    kvm_clusters
        .state()
        .into_iter()
        .filter(|kc| {
            HostingKey::of(kc)
                .is_some_and(|k| Some(&k.secret_namespace) == ns.as_ref() && k.secret == name)
        })
        .map(|kc| ObjectRef::from(&*kc))
        .collect()
}

/// The KVMClusters an object in a hosting cluster concerns: the one its labels name (a
/// control-plane Service), and for a control-plane machine Pod the one of its Cluster (the Pod
/// is an endpoint of the Service).
pub fn kvmclusters_of_hosted_object(
    meta: &ObjectMeta,
    kvm_clusters: &Store<KVMCluster>,
    clusters: &Store<Cluster>,
) -> Vec<ObjectRef<KVMCluster>> {
    let labels = meta.labels.clone().unwrap_or_default();
    let Some(owner_ns) = labels.get(OWNER_NAMESPACE_LABEL) else {
        return Vec::new();
    };
    let mut refs: Vec<ObjectRef<KVMCluster>> = labels
        .get(KVMCLUSTER_LABEL)
        .and_then(|l| named_by_label(kvm_clusters, owner_ns, l))
        .into_iter()
        .collect();
    if labels.get(MACHINE_ROLE_LABEL).map(String::as_str) == Some(ROLE_CONTROL_PLANE)
        && let Some(cluster) = labels
            .get(CLUSTER_NAME_LABEL)
            .and_then(|c| clusters.get(&ObjectRef::new(c).within(owner_ns)))
        && let Some(infra) = cluster.spec.infrastructure_ref.as_ref()
        && infra.kind == "KVMCluster"
    {
        refs.push(ObjectRef::new(&infra.name).within(owner_ns));
    }
    refs
}

/// The KVMClusters that name hosting cluster `key`: each says in a condition whether it can be
/// used, so a change of that concerns them all.
pub fn kvmclusters_of_hosting(
    key: &HostingKey,
    kvm_clusters: &Store<KVMCluster>,
) -> Vec<ObjectRef<KVMCluster>> {
    kvm_clusters
        .state()
        .into_iter()
        .filter(|kc| HostingKey::of(kc).as_ref() == Some(key))
        .map(|kc| ObjectRef::from(&*kc))
        .collect()
}

pub use crate::k8s::wake::Wake;

impl Wake<KVMCluster> {
    /// The management cluster's changes, passed on unchanged, waking the KVMClusters that
    /// machine Pods, KVMMachines being deleted and hosting kubeconfig Secrets concern on the way.
    /// (The KVMCluster controller keeps a watch of its own: a store awaited by two tasks at once
    /// wakes only one of them.)
    pub fn on(&self, events: Events, caches: &Caches) -> Events {
        let (wake, clusters) = (self.clone(), caches.clusters.clone());
        let pods = events.pods.inspect(move |pod| {
            if let Ok(pod) = pod {
                wake.all(kvmcluster_of_pod(pod, &clusters));
            }
        });
        let (wake, kvm_clusters) = (self.clone(), caches.kvm_clusters.clone());
        let kvm_machines = events.kvm_machines.inspect(move |km| {
            if let Ok(km) = km {
                wake.all(kvmclusters_of_deleted_machine(km, &kvm_clusters));
            }
        });
        let (wake, kvm_clusters) = (self.clone(), caches.kvm_clusters.clone());
        let secrets = events.secrets.inspect(move |s| {
            if let Ok(s) = s {
                wake.all(kvmclusters_of_hosting_secret(s, &kvm_clusters));
            }
        });
        Events {
            pods: pods.boxed(),
            kvm_machines: kvm_machines.boxed(),
            secrets: secrets.boxed(),
            ..events
        }
    }

    /// What a hosting cluster's link reports: an object there wakes the KVMCluster it concerns,
    /// a change of the link's availability every KVMCluster naming it.
    pub fn on_hosting(&self, caches: &Caches) -> OnChange {
        let (kvm_clusters, clusters) = (caches.kvm_clusters.clone(), caches.clusters.clone());
        let of_key = caches.kvm_clusters.clone();
        hosting::waking(
            self.clone(),
            move |meta| kvmclusters_of_hosted_object(meta, &kvm_clusters, &clusters),
            move |key| kvmclusters_of_hosting(key, &of_key),
        )
    }
}

/// Runs the KVMCluster controller until `stopped`: its own watch of KVMClusters and of Clusters,
/// its control-plane Services (`services`) and the reconciles a [`Wake`] asks for (`wakes`).
pub async fn run(
    ctx: Arc<Context>,
    config: Config,
    services: Changes<PartialObjectMeta<Service>>,
    wakes: UnboundedReceiver<ObjectRef<KVMCluster>>,
    stopped: impl Future<Output = ()> + Send + Sync + 'static,
) {
    let ns = ctx.settings.namespace.clone();
    let client = ctx.client.clone();
    let (kvm_clusters, changes) = cached(
        api::<KVMCluster>(&client, ns.as_deref()),
        watcher::Config::default(),
        strip_kvm_cluster,
    );
    let store = kvm_clusters.clone();
    let results = Controller::for_stream(changes, kvm_clusters)
        .with_config(config)
        .watches_stream(services, move |s| {
            kvmcluster_of_service(&s.metadata, &store)
        })
        .watches(
            api::<Cluster>(&client, ns.as_deref()),
            watcher::Config::default(),
            kvmcluster_of_cluster,
        )
        .reconcile_on(wakes)
        .graceful_shutdown_on(stopped)
        .run(super::reconcile, super::error_policy, ctx.clone());
    outcome::finish_each(results, &ctx, "KVMCluster").await
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::k8s::caches::testing::store;

    fn kvm_cluster(name: &str, labels: serde_json::Value, spec: serde_json::Value) -> KVMCluster {
        serde_json::from_value(json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1", "kind": "KVMCluster",
            "metadata": {"name": name, "namespace": "team-a", "uid": format!("uid-{name}"),
                         "labels": labels},
            "spec": spec,
        }))
        .unwrap()
    }

    fn cluster(name: &str, infra_kind: &str, infra: &str) -> Cluster {
        serde_json::from_value(json!({
            "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Cluster",
            "metadata": {"name": name, "namespace": "team-a"},
            "spec": {"infrastructureRef": {"apiGroup": "infrastructure.cluster.x-k8s.io",
                                           "kind": infra_kind, "name": infra}},
        }))
        .unwrap()
    }

    fn hosted(name: &str, secret: &str) -> KVMCluster {
        kvm_cluster(
            name,
            json!({CLUSTER_NAME_LABEL: name}),
            json!({"hostingCluster": {"kubeconfigSecretRef": {"name": secret}}}),
        )
    }

    fn at(name: &str) -> ObjectRef<KVMCluster> {
        ObjectRef::new(name).within("team-a")
    }

    #[test]
    fn a_cluster_wakes_the_kvmcluster_its_infrastructure_ref_names() {
        assert_eq!(
            kvmcluster_of_cluster(cluster("demo", "KVMCluster", "demo-kvm")),
            Some(at("demo-kvm"))
        );
        assert_eq!(
            kvmcluster_of_cluster(cluster("demo", "DockerCluster", "demo")),
            None
        );
    }

    #[test]
    fn a_control_plane_pod_wakes_the_kvmcluster_of_its_cluster_and_a_worker_none() {
        let clusters = store(vec![cluster("demo", "KVMCluster", "demo-kvm")]);
        let pod = |role: &str| -> Pod {
            serde_json::from_value(
                json!({"metadata": {"name": "demo-cp-0", "namespace": "team-a",
                "labels": {MACHINE_ROLE_LABEL: role, CLUSTER_NAME_LABEL: "demo"}}}),
            )
            .unwrap()
        };
        assert_eq!(
            kvmcluster_of_pod(&pod(ROLE_CONTROL_PLANE), &clusters),
            Some(at("demo-kvm"))
        );
        assert_eq!(kvmcluster_of_pod(&pod("worker"), &clusters), None);
    }

    #[test]
    fn only_a_kvmmachine_being_deleted_wakes_its_kvmcluster() {
        let kvm_clusters = store(vec![
            hosted("demo", "hosting-kubeconfig"),
            hosted("other", "hosting-kubeconfig"),
        ]);
        let mut km: KVMMachine = serde_json::from_value(json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1", "kind": "KVMMachine",
            "metadata": {"name": "demo-cp-0", "namespace": "team-a",
                         "labels": {CLUSTER_NAME_LABEL: "demo"}},
            "spec": {"resources": {"cpu": 1, "memory": "1Gi", "disk": "2Gi"}},
        }))
        .unwrap();
        assert!(kvmclusters_of_deleted_machine(&km, &kvm_clusters).is_empty());
        km.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::now(),
            ));
        assert_eq!(
            kvmclusters_of_deleted_machine(&km, &kvm_clusters),
            [at("demo")]
        );
    }

    #[test]
    fn a_hosting_kubeconfig_secret_wakes_the_kvmclusters_naming_it() {
        let kvm_clusters = store(vec![
            hosted("a", "hosting-kubeconfig"),
            hosted("b", "other-kubeconfig"),
            kvm_cluster("c", json!({}), json!({})),
        ]);
        let secret: PartialObjectMeta<Secret> = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": "hosting-kubeconfig", "namespace": "team-a"}}))
        .unwrap();
        assert_eq!(
            kvmclusters_of_hosting_secret(&secret, &kvm_clusters),
            [at("a")]
        );
        let key = HostingKey::of(&hosted("b", "other-kubeconfig")).unwrap();
        assert_eq!(kvmclusters_of_hosting(&key, &kvm_clusters), [at("b")]);
    }

    #[test]
    fn a_hosted_object_wakes_the_kvmcluster_its_labels_name_and_a_control_plane_pod_its_clusters() {
        let kvm_clusters = store(vec![hosted("demo-kvm", "k")]);
        let clusters = store(vec![cluster("demo", "KVMCluster", "demo-kvm")]);
        let meta = |labels: serde_json::Value| -> ObjectMeta {
            serde_json::from_value(json!({"name": "x", "namespace": "hosted", "labels": labels}))
                .unwrap()
        };
        let service = meta(json!({OWNER_NAMESPACE_LABEL: "team-a", KVMCLUSTER_LABEL: "demo-kvm"}));
        assert_eq!(
            kvmclusters_of_hosted_object(&service, &kvm_clusters, &clusters),
            [at("demo-kvm")]
        );
        let pod = meta(json!({OWNER_NAMESPACE_LABEL: "team-a",
            MACHINE_ROLE_LABEL: ROLE_CONTROL_PLANE, CLUSTER_NAME_LABEL: "demo"}));
        assert_eq!(
            kvmclusters_of_hosted_object(&pod, &kvm_clusters, &clusters),
            [at("demo-kvm")]
        );
        // Without the owner's namespace, nothing here is ours.
        let unowned = meta(json!({KVMCLUSTER_LABEL: "demo-kvm"}));
        assert!(kvmclusters_of_hosted_object(&unowned, &kvm_clusters, &clusters).is_empty());
    }
}
