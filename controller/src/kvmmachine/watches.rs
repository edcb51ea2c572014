//! What wakes a KVMMachine reconcile, and the controller that runs it ([`run`]): its own
//! changes, and each object it reads or makes, mapped to the KVMMachines it concerns by a named
//! function: machine and etcd cleanup Pods ([`kvmmachines_of_object`]), its PVCs, its Machine
//! ([`kvmmachine_of_machine`]), its KVMCluster naming another hosting cluster
//! ([`HostingMoves`]), its Cluster ([`kvmmachines_of_cluster`]), Secrets
//! ([`kvmmachines_of_secret`]); and through a [`Wake`], the Nodes of its workload cluster
//! ([`kvmmachines_of_node`]) and what its hosting cluster reports
//! ([`kvmmachines_of_hosted_object`], [`kvmmachines_of_hosting`]).

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use capk_api::{
    capi::{Cluster, Machine},
    constants::{GROUP, KVMMACHINE_LABEL, OWNER_NAMESPACE_LABEL},
    v1alpha1::{KVMCluster, KVMMachine},
};
use futures::channel::mpsc::UnboundedReceiver;
use k8s_openapi::{
    api::core::v1::{Pod, Secret},
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use kube::{
    ResourceExt,
    core::PartialObjectMeta,
    runtime::{
        Controller,
        controller::Config,
        reflector::{ObjectRef, Store},
    },
};

use crate::k8s::ownership::cluster_of;
use crate::{
    k8s::caches::{Caches, Events, named_by_label},
    remote::hosting::{self, HostingKey, OnChange},
    remote::workload::OnNodeChange,
    runtime::context::Context,
    runtime::outcome,
};

/// The KVMMachines that belong to Cluster `cluster` in `ns` (by their cluster-name label).
pub fn kvmmachines_of_cluster_named(
    kvm_machines: &Store<KVMMachine>,
    ns: Option<&str>,
    cluster: &str,
) -> Vec<ObjectRef<KVMMachine>> {
    kvm_machines
        .state()
        .into_iter()
        .filter(|km| {
            km.namespace().as_deref() == ns && cluster_of(&**km).as_deref() == Some(cluster)
        })
        .map(|km| ObjectRef::from(&*km))
        .collect()
}

/// The KVMMachine that owns a machine Pod or etcd PVC beside it, or that the labels of one in a
/// machine namespace, or of an etcd cleanup Pod, name (those have no owner reference).
pub fn kvmmachines_of_object<K: ResourceExt>(
    obj: &K,
    kvm_machines: &Store<KVMMachine>,
) -> Vec<ObjectRef<KVMMachine>> {
    let owners: Vec<ObjectRef<KVMMachine>> = obj
        .owner_references()
        .iter()
        .filter(|o| o.kind == "KVMMachine" && o.api_version.starts_with(GROUP))
        .filter_map(|o| Some(ObjectRef::new(&o.name).within(&obj.namespace()?)))
        .collect();
    if !owners.is_empty() {
        return owners;
    }
    let labels = obj.labels();
    labels
        .get(OWNER_NAMESPACE_LABEL)
        .zip(labels.get(KVMMACHINE_LABEL))
        .and_then(|(ns, name)| named_by_label(kvm_machines, ns, name))
        .into_iter()
        .collect()
}

/// The KVMMachine a Machine's infrastructureRef names.
pub fn kvmmachine_of_machine(m: &Machine) -> Option<ObjectRef<KVMMachine>> {
    let ns = m.namespace()?;
    let r = &m.spec.infrastructure_ref;
    (r.kind == "KVMMachine").then(|| ObjectRef::new(&r.name).within(&ns))
}

/// The KVMMachines of a Cluster: its infrastructure becoming provisioned (or its pausing)
/// concerns them.
pub fn kvmmachines_of_cluster(
    c: &Cluster,
    kvm_machines: &Store<KVMMachine>,
) -> Vec<ObjectRef<KVMMachine>> {
    kvmmachines_of_cluster_named(kvm_machines, c.namespace().as_deref(), &c.name_any())
}

/// The KVMMachines a Secret concerns: the owner of an Ignition Secret, the machine whose
/// Machine names it as bootstrap data (it may appear after the Machine names it), every machine
/// of the cluster of a `<cluster>-kubeconfig` (the workload cluster link) and every machine of
/// the KVMClusters whose hosting cluster's kubeconfig it is.
pub fn kvmmachines_of_secret(
    s: &PartialObjectMeta<Secret>,
    caches: &Caches,
) -> Vec<ObjectRef<KVMMachine>> {
    let ns = s.namespace();
    let name = s.name_any();
    let mut refs: Vec<ObjectRef<KVMMachine>> = s
        .owner_references()
        .iter()
        .filter(|o| o.kind == "KVMMachine")
        .filter_map(|o| Some(ObjectRef::new(&o.name).within(ns.as_deref()?)))
        .collect();
    refs.extend(
        caches
            .machines
            .state()
            .into_iter()
            .filter(|m| {
                m.namespace() == ns
                    && m.spec.bootstrap.data_secret_name.as_deref() == Some(name.as_str())
                    && m.spec.infrastructure_ref.kind == "KVMMachine"
            })
            .filter_map(|m| {
                Some(ObjectRef::new(&m.spec.infrastructure_ref.name).within(ns.as_deref()?))
            }),
    );
    if let Some(cluster) = name.strip_suffix("-kubeconfig") {
        refs.extend(kvmmachines_of_cluster_named(
            &caches.kvm_machines,
            ns.as_deref(),
            cluster,
        ));
    }
    let kvm_clusters = &caches.kvm_clusters;
    for kc in crate::kvmcluster::watches::kvmclusters_of_hosting_secret(s, kvm_clusters) {
        if let Some(kc) = kvm_clusters.get(&kc)
            && let Some(cluster) = cluster_of(&*kc)
        {
            refs.extend(kvmmachines_of_cluster_named(
                &caches.kvm_machines,
                ns.as_deref(),
                &cluster,
            ));
        }
    }
    refs
}

/// The KVMMachines of workload cluster `cluster` in namespace `ns` whose Node is `node`, or all
/// of them (`None`: the link to the workload cluster changed).
pub fn kvmmachines_of_node(
    kvm_machines: &Store<KVMMachine>,
    ns: &str,
    cluster: &str,
    node: Option<&str>,
) -> Vec<ObjectRef<KVMMachine>> {
    kvm_machines
        .state()
        .into_iter()
        .filter(|km| {
            km.namespace().as_deref() == Some(ns)
                && cluster_of(&**km).as_deref() == Some(cluster)
                && node.is_none_or(|n| super::names::hostname(km) == n)
        })
        .map(|km| ObjectRef::from(&*km))
        .collect()
}

/// The KVMMachine the labels of an object in a hosting cluster name.
pub fn kvmmachines_of_hosted_object(
    meta: &ObjectMeta,
    kvm_machines: &Store<KVMMachine>,
) -> Option<ObjectRef<KVMMachine>> {
    let labels = meta.labels.as_ref()?;
    let owner_ns = labels.get(OWNER_NAMESPACE_LABEL)?;
    named_by_label(kvm_machines, owner_ns, labels.get(KVMMACHINE_LABEL)?)
}

/// The KVMMachines of every KVMCluster naming hosting cluster `key`: each says in a condition
/// whether it can be used.
pub fn kvmmachines_of_hosting(
    key: &HostingKey,
    kvm_clusters: &Store<KVMCluster>,
    kvm_machines: &Store<KVMMachine>,
) -> Vec<ObjectRef<KVMMachine>> {
    crate::kvmcluster::watches::kvmclusters_of_hosting(key, kvm_clusters)
        .into_iter()
        .filter_map(|kc| kvm_clusters.get(&kc))
        .filter_map(|kc| {
            let cluster = cluster_of(&*kc)?;
            Some(kvmmachines_of_cluster_named(
                kvm_machines,
                kc.namespace().as_deref(),
                &cluster,
            ))
        })
        .flatten()
        .collect()
}

/// Where each KVMCluster said its machines live when last seen (the hosting cluster it names,
/// its recorded machine namespace): a change concerns its machines, whose objects are then
/// elsewhere (or, first recorded, may now be made).
#[derive(Default)]
pub struct HostingMoves {
    hosted_in: Mutex<HashMap<String, MachinesAt>>,
}

/// Where a KVMCluster says its machines live: the hosting cluster it names, its recorded
/// machine namespace.
type MachinesAt = (Option<HostingKey>, Option<String>);

impl HostingMoves {
    /// The KVMMachines of `kc` when it is new to this watch or says its machines live
    /// elsewhere than when last seen.
    pub fn kvmmachines_of_kvm_cluster(
        &self,
        kc: &KVMCluster,
        kvm_machines: &Store<KVMMachine>,
    ) -> Vec<ObjectRef<KVMMachine>> {
        let key = (
            HostingKey::of(kc),
            crate::remote::hosting::machine_namespace(kc).map(str::to_owned),
        );
        let uid = kc.uid().unwrap_or_default();
        let moved = self
            .hosted_in
            .lock()
            .expect("hosted_in lock")
            .insert(uid, key.clone())
            != Some(key);
        match cluster_of(kc) {
            Some(cluster) if moved => {
                kvmmachines_of_cluster_named(kvm_machines, kc.namespace().as_deref(), &cluster)
            }
            _ => Vec::new(),
        }
    }
}

pub use crate::k8s::wake::Wake;

impl Wake<KVMMachine> {
    /// What a workload cluster's Node watch reports: a Node changed ([`kvmmachines_of_node`]).
    pub fn on_nodes(&self, caches: &Caches) -> OnNodeChange {
        let (wake, kvm_machines) = (self.clone(), caches.kvm_machines.clone());
        Arc::new(move |ns: &str, cluster: &str, node: Option<&str>| {
            wake.all(kvmmachines_of_node(&kvm_machines, ns, cluster, node))
        })
    }

    /// What a hosting cluster's link reports: an object there wakes the KVMMachine its labels
    /// name, a change of the link's availability the machines of every KVMCluster naming it.
    pub fn on_hosting(&self, caches: &Caches) -> OnChange {
        let kvm_machines = caches.kvm_machines.clone();
        let (kvm_clusters, of_key) = (caches.kvm_clusters.clone(), caches.kvm_machines.clone());
        hosting::waking(
            self.clone(),
            move |meta| kvmmachines_of_hosted_object(meta, &kvm_machines),
            move |key| kvmmachines_of_hosting(key, &kvm_clusters, &of_key),
        )
    }
}

/// Runs the KVMMachine controller until `stopped`: triggered by the management cluster's
/// `events` (the KVMMachine store is its own, [`Caches::kvm_machines`]) and the reconciles a
/// [`Wake`] asks for (`wakes`).
pub async fn run(
    ctx: Arc<Context>,
    config: Config,
    events: Events,
    wakes: UnboundedReceiver<ObjectRef<KVMMachine>>,
    stopped: impl Future<Output = ()> + Send + Sync + 'static,
) {
    let Events {
        kvm_clusters,
        kvm_machines,
        machines,
        clusters,
        pods,
        secrets,
        claims,
    } = events;
    let caches = ctx.caches.clone();
    let (by_pod, by_claim, by_cluster, by_kvm_cluster) = (
        caches.kvm_machines.clone(),
        caches.kvm_machines.clone(),
        caches.kvm_machines.clone(),
        caches.kvm_machines.clone(),
    );
    let moves = HostingMoves::default();
    let results = Controller::for_stream(kvm_machines, caches.kvm_machines.clone())
        .with_config(config)
        .watches_stream(pods, move |pod: Pod| kvmmachines_of_object(&pod, &by_pod))
        .watches_stream(claims, move |claim| {
            kvmmachines_of_object(&claim, &by_claim)
        })
        .watches_stream(machines, |m: Machine| kvmmachine_of_machine(&m))
        .watches_stream(kvm_clusters, move |kc: KVMCluster| {
            moves.kvmmachines_of_kvm_cluster(&kc, &by_kvm_cluster)
        })
        .watches_stream(clusters, move |c: Cluster| {
            kvmmachines_of_cluster(&c, &by_cluster)
        })
        .watches_stream(secrets, move |s: PartialObjectMeta<Secret>| {
            kvmmachines_of_secret(&s, &caches)
        })
        .reconcile_on(wakes)
        .graceful_shutdown_on(stopped)
        .run(super::reconcile, super::error_policy, ctx.clone());
    outcome::finish_each(results, &ctx, "KVMMachine").await
}

#[cfg(test)]
mod tests {
    use capk_api::constants::{CLUSTER_NAME_LABEL, MAX_LABEL_LEN, bounded_name};
    use serde_json::{Value, json};

    use super::*;
    use crate::{k8s::caches::testing::store, kvmmachine::testing::kvm_machine};

    fn km(name: &str, cluster: &str) -> KVMMachine {
        let mut km = kvm_machine(
            name,
            json!({"resources": {"cpu": 1, "memory": "1Gi", "disk": "2Gi"}}),
        );
        km.metadata.uid = Some(format!("uid-{name}"));
        km.metadata.labels = Some([(CLUSTER_NAME_LABEL.to_owned(), cluster.to_owned())].into());
        km
    }

    fn at(name: &str) -> ObjectRef<KVMMachine> {
        ObjectRef::new(name).within("team-a")
    }

    fn names(mut refs: Vec<ObjectRef<KVMMachine>>) -> Vec<String> {
        refs.sort_by(|a, b| a.name.cmp(&b.name));
        refs.into_iter().map(|r| r.name).collect()
    }

    fn kvm_cluster(name: &str, hosting_secret: Option<&str>) -> KVMCluster {
        let spec = match hosting_secret {
            Some(s) => json!({"hostingCluster": {"kubeconfigSecretRef": {"name": s}}}),
            None => json!({}),
        };
        serde_json::from_value(json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1", "kind": "KVMCluster",
            "metadata": {"name": format!("{name}-kvm"), "namespace": "team-a",
                         "uid": format!("uid-{name}"), "labels": {CLUSTER_NAME_LABEL: name}},
            "spec": spec,
        }))
        .unwrap()
    }

    fn secret(name: &str, owners: Value) -> PartialObjectMeta<Secret> {
        serde_json::from_value(json!({"apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": name, "namespace": "team-a", "ownerReferences": owners}}))
        .unwrap()
    }

    fn caches(
        kvm_machines: Vec<KVMMachine>,
        kvm_clusters: Vec<KVMCluster>,
        machines: Vec<Machine>,
    ) -> Caches {
        Caches {
            kvm_machines: store(kvm_machines),
            kvm_clusters: store(kvm_clusters),
            machines: store(machines),
            clusters: store(vec![]),
            pods: store(vec![]),
            secrets: store(vec![]),
            hosting_kubeconfigs: store(vec![]),
            claims: store(vec![]),
            services: store(vec![]),
            synced: tokio::sync::watch::channel(true).1,
        }
    }

    #[test]
    fn a_machine_pod_wakes_its_owner_and_a_cleanup_pod_the_machine_its_labels_name() {
        let long = "m".repeat(80);
        let kvm_machines = store(vec![km("demo-cp-0", "demo"), km(&long, "demo")]);
        let owned: Pod = serde_json::from_value(json!({"metadata": {
            "name": "demo-cp-0", "namespace": "team-a", "ownerReferences": [{
                "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1", "kind": "KVMMachine",
                "name": "demo-cp-0", "uid": "uid-demo-cp-0"}]}}))
        .unwrap();
        assert_eq!(
            kvmmachines_of_object(&owned, &kvm_machines),
            [at("demo-cp-0")]
        );
        // A cleanup Pod in a hosting cluster: the labels name the machine, cut and hashed.
        let cleanup: Pod = serde_json::from_value(json!({"metadata": {
            "name": "x-etcd-cleanup", "namespace": "hosted", "labels": {
                OWNER_NAMESPACE_LABEL: "team-a",
                KVMMACHINE_LABEL: bounded_name(&long, "", MAX_LABEL_LEN)}}}))
        .unwrap();
        assert_eq!(kvmmachines_of_object(&cleanup, &kvm_machines), [at(&long)]);
        let foreign: Pod =
            serde_json::from_value(json!({"metadata": {"name": "x", "namespace": "team-a"}}))
                .unwrap();
        assert!(kvmmachines_of_object(&foreign, &kvm_machines).is_empty());
    }

    #[test]
    fn a_machine_wakes_the_kvmmachine_its_infrastructure_ref_names() {
        let machine = |kind: &str| -> Machine {
            serde_json::from_value(json!({
                "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine",
                "metadata": {"name": "demo-cp-abc", "namespace": "team-a"},
                "spec": {"clusterName": "demo", "bootstrap": {"dataSecretName": "demo-cp-abc"},
                         "infrastructureRef": {"apiGroup": "infrastructure.cluster.x-k8s.io",
                                               "kind": kind, "name": "demo-cp-0"}},
            }))
            .unwrap()
        };
        assert_eq!(
            kvmmachine_of_machine(&machine("KVMMachine")),
            Some(at("demo-cp-0"))
        );
        assert_eq!(kvmmachine_of_machine(&machine("DockerMachine")), None);
    }

    #[test]
    fn secrets_wake_their_owner_the_machine_bootstrapped_from_them_and_their_clusters_machines() {
        let machine: Machine = serde_json::from_value(json!({
            "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine",
            "metadata": {"name": "demo-md-abc", "namespace": "team-a"},
            "spec": {"clusterName": "demo", "bootstrap": {"dataSecretName": "demo-md-abc-bootstrap"},
                     "infrastructureRef": {"apiGroup": "infrastructure.cluster.x-k8s.io",
                                           "kind": "KVMMachine", "name": "demo-md-0"}},
        }))
        .unwrap();
        let caches = caches(
            vec![
                km("demo-cp-0", "demo"),
                km("demo-md-0", "demo"),
                km("hosted-cp-0", "hosted"),
            ],
            vec![kvm_cluster("hosted", Some("hosting-kubeconfig"))],
            vec![machine],
        );
        let owner = json!([{"apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1",
            "kind": "KVMMachine", "name": "demo-cp-0", "uid": "uid-demo-cp-0"}]);
        assert_eq!(
            names(kvmmachines_of_secret(
                &secret("demo-cp-0-ignition", owner),
                &caches
            )),
            ["demo-cp-0"]
        );
        assert_eq!(
            names(kvmmachines_of_secret(
                &secret("demo-md-abc-bootstrap", json!([])),
                &caches
            )),
            ["demo-md-0"]
        );
        assert_eq!(
            names(kvmmachines_of_secret(
                &secret("demo-kubeconfig", json!([])),
                &caches
            )),
            ["demo-cp-0", "demo-md-0"]
        );
        assert_eq!(
            names(kvmmachines_of_secret(
                &secret("hosting-kubeconfig", json!([])),
                &caches
            )),
            ["hosted-cp-0"]
        );
        assert!(kvmmachines_of_secret(&secret("unrelated", json!([])), &caches).is_empty());
    }

    #[test]
    fn a_node_wakes_the_machine_of_its_hostname_and_a_link_change_every_machine_of_the_cluster() {
        let kvm_machines = store(vec![
            km("demo-cp-0", "demo"),
            km("demo-md-0", "demo"),
            km("other-cp-0", "other"),
        ]);
        assert_eq!(
            kvmmachines_of_node(&kvm_machines, "team-a", "demo", Some("demo-md-0")),
            [at("demo-md-0")]
        );
        assert_eq!(
            names(kvmmachines_of_node(&kvm_machines, "team-a", "demo", None)),
            ["demo-cp-0", "demo-md-0"]
        );
        assert!(kvmmachines_of_node(&kvm_machines, "team-b", "demo", None).is_empty());
    }

    #[test]
    fn a_kvmcluster_wakes_its_machines_when_first_seen_and_when_it_says_they_live_elsewhere() {
        let kvm_machines = store(vec![km("demo-cp-0", "demo")]);
        let moves = HostingMoves::default();
        let local = kvm_cluster("demo", None);
        let hosted = kvm_cluster("demo", Some("hosting-kubeconfig"));
        let woken = |kc: &KVMCluster| moves.kvmmachines_of_kvm_cluster(kc, &kvm_machines);
        // What the KVMCluster says the first time, then the same again: its machines wake once.
        let woken_then_again = |kc: &KVMCluster| (woken(kc), woken(kc));
        let once = (vec![at("demo-cp-0")], vec![]);
        assert_eq!(woken_then_again(&local), once);
        assert_eq!(woken_then_again(&hosted), once);
        assert_eq!(woken(&local), [at("demo-cp-0")]);
        // Its machine namespace recorded: the machines, which waited for it, may now be made.
        let mut recorded = local.clone();
        recorded.status = Some(capk_api::v1alpha1::KVMClusterStatus {
            machine_namespace: Some("capk-machines".into()),
            ..Default::default()
        });
        assert_eq!(woken_then_again(&recorded), once);
    }

    #[test]
    fn a_hosting_cluster_wakes_the_machine_its_objects_name_and_on_a_change_all_of_its_machines() {
        let kvm_machines = store(vec![km("hosted-cp-0", "hosted"), km("demo-cp-0", "demo")]);
        let kvm_clusters = store(vec![
            kvm_cluster("hosted", Some("hosting-kubeconfig")),
            kvm_cluster("demo", None),
        ]);
        let meta: ObjectMeta = serde_json::from_value(json!({"name": "hosted-cp-0",
            "namespace": "hosting-ns", "labels": {OWNER_NAMESPACE_LABEL: "team-a",
            KVMMACHINE_LABEL: "hosted-cp-0"}}))
        .unwrap();
        assert_eq!(
            kvmmachines_of_hosted_object(&meta, &kvm_machines),
            Some(at("hosted-cp-0"))
        );
        let key = HostingKey::of(&kvm_cluster("hosted", Some("hosting-kubeconfig"))).unwrap();
        assert_eq!(
            kvmmachines_of_hosting(&key, &kvm_clusters, &kvm_machines),
            [at("hosted-cp-0")]
        );
    }
}
