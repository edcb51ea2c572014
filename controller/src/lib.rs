//! `capk-controller`: reconciles KVMCluster (control-plane Service, endpoint) and, later,
//! KVMMachine (machine Pods) for the Cluster API v1beta2 contract.
#![forbid(unsafe_code)]

pub mod apiserver_health;
pub mod backoff;
pub mod conditions;
pub mod context;
pub mod error;
pub mod hosting;
pub mod inline_kubeconfig;
pub mod kvmcluster;
pub mod kvmmachine;
pub mod kvmmachinetemplate;
pub mod leader;
pub mod metrics;
pub mod ownership;
pub mod redact;
pub mod report;
pub mod settings;
pub mod workload;

use std::sync::Arc;

use capk_api::{
    capi::{Cluster, Machine},
    constants::{
        CLUSTER_NAME_LABEL, GROUP, KVMCLUSTER_LABEL, KVMMACHINE_LABEL, MACHINE_ROLE_LABEL,
        MANAGED_BY, MAX_LABEL_LEN, OWNER_NAMESPACE_LABEL, ROLE_CONTROL_PLANE,
    },
    v1alpha1::{KVMCluster, KVMMachine, KVMMachineTemplate},
};
use futures::{Stream, StreamExt};
use hosting::HostingKey;
use k8s_openapi::{
    api::core::v1::{PersistentVolumeClaim, Pod, Secret, Service},
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use kube::{
    Api, Client, Resource, ResourceExt,
    core::PartialObjectMeta,
    runtime::{
        Controller, WatchStreamExt,
        controller::Config as ControllerConfig,
        reflector::{self, ObjectRef, Store},
        watcher,
    },
};
use serde::de::DeserializeOwned;
use tracing::{debug, warn};

pub use context::{Caches, Context, Settings};

fn api<K>(client: &Client, ns: Option<&str>) -> Api<K>
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>,
{
    match ns {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

/// One watch of `K` that fills a cache and yields the changed objects (to trigger reconciles).
pub(crate) fn cached<K>(
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
pub(crate) fn strip_secret(s: &mut PartialObjectMeta<Secret>) {
    if let Some(annotations) = s.metadata.annotations.as_mut() {
        annotations.retain(|k, _| k == capk_api::constants::RENDERED_FROM_ANNOTATION);
    }
}

/// Of a machine Pod only its status, node, hostPath etcd volume (where its etcd data stays
/// behind) and whether its containers have a startup probe are read; the spec is most of its
/// size.
pub(crate) fn strip_pod(p: &mut Pod) {
    if let Some(spec) = p.spec.as_mut() {
        let etcd = std::mem::take(&mut spec.volumes)
            .into_iter()
            .flatten()
            .filter(|v| v.name == kvmmachine::etcd_cleanup::ETCD_VOLUME && v.host_path.is_some())
            .collect::<Vec<_>>();
        *spec = k8s_openapi::api::core::v1::PodSpec {
            node_name: spec.node_name.take(),
            volumes: (!etcd.is_empty()).then_some(etcd),
            containers: std::mem::take(&mut spec.containers)
                .into_iter()
                .map(|c| k8s_openapi::api::core::v1::Container {
                    name: c.name,
                    startup_probe: c.startup_probe,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        };
    }
}

/// The KVMMachines that belong to Cluster `name` in `ns`.
fn machines_of(
    store: &Store<KVMMachine>,
    ns: Option<&str>,
    name: &str,
) -> Vec<ObjectRef<KVMMachine>> {
    store
        .state()
        .into_iter()
        .filter(|km| {
            km.namespace().as_deref() == ns
                && km.labels().get(CLUSTER_NAME_LABEL).map(String::as_str) == Some(name)
        })
        .map(|km| ObjectRef::from(&*km))
        .collect()
}

/// The Cluster a KVMCluster belongs to: its owner, else its cluster-name label.
fn cluster_of(kc: &KVMCluster) -> Option<String> {
    kvmcluster::owner_cluster_name(kc).or_else(|| kc.labels().get(CLUSTER_NAME_LABEL).cloned())
}

/// The object of `store` in `ns` whose name label (the name, cut and hashed when long) is
/// `label`.
fn named_by_label<K>(store: &Store<K>, ns: &str, label: &str) -> Option<ObjectRef<K>>
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
                && capk_api::constants::bounded_name(&o.name_any(), "", MAX_LABEL_LEN) == label
        })
        .map(|o| ObjectRef::from(&*o))
}

/// Runs the reconcilers until `shutdown` resolves.
pub async fn run(
    client: Client,
    settings: Settings,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) {
    run_with_metrics(client, settings, Default::default(), shutdown).await
}

/// [`run`], recording into `metrics` (served by [`metrics::serve`]).
pub async fn run_with_metrics(
    client: Client,
    settings: Settings,
    metrics: Arc<metrics::Metrics>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) {
    let ns = settings.namespace.clone();
    let ns = ns.as_deref();
    let owned =
        watcher::Config::default().labels(&format!("app.kubernetes.io/managed-by={MANAGED_BY}"));
    let controller_config = ControllerConfig::default().concurrency(settings.concurrency);

    // One shutdown signal, fanned out to both controllers.
    let (tx, rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        let _ = tx.send(true);
    });
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };

    // The watches, each feeding a cache the reconciles read. (The KVMCluster controller keeps a
    // watch of its own: a store awaited by two tasks at once wakes only one of them.)
    let (kvm_clusters, kvm_cluster_events) =
        cached(api::<KVMCluster>(&client, ns), Default::default(), |_| {});
    let (cluster_trigger, cluster_triggers) = futures::channel::mpsc::unbounded();
    let (kvm_machines, kvm_machine_events) =
        cached(api::<KVMMachine>(&client, ns), Default::default(), |_| {});
    // A KVMMachine being deleted concerns its KVMCluster: one with a hosting cluster waits for
    // its machines to be gone before it goes.
    let kvm_machine_events = {
        let (kvm_clusters, cluster_trigger) = (kvm_clusters.clone(), cluster_trigger.clone());
        kvm_machine_events.inspect(move |km: &Result<KVMMachine, watcher::Error>| {
            let Ok(km) = km else { return };
            if km.metadata.deletion_timestamp.is_none() {
                return;
            }
            let cluster = km.labels().get(CLUSTER_NAME_LABEL);
            for kc in kvm_clusters.state() {
                if kc.namespace() == km.namespace() && cluster_of(&kc).as_ref() == cluster {
                    let _ = cluster_trigger.unbounded_send(ObjectRef::from(&*kc));
                }
            }
        })
    };
    let machine_controller = Controller::for_stream(kvm_machine_events, kvm_machines.clone());
    let (machines, machine_events) =
        cached(api::<Machine>(&client, ns), Default::default(), |_| {});
    let (clusters, cluster_events) =
        cached(api::<Cluster>(&client, ns), Default::default(), |_| {});
    let (pods, pod_events) = cached(api::<Pod>(&client, ns), owned.clone(), strip_pod);
    // Secrets, PVCs and Services as metadata only: their data is read when needed.
    let (secrets, secret_events) = cached(
        api::<PartialObjectMeta<Secret>>(&client, ns),
        // Pages of 25: each Secret may carry up to 256 KiB of annotations until stripped.
        watcher::Config::default().page_size(25),
        strip_secret,
    );
    let (claims, claim_events) = cached(
        api::<PartialObjectMeta<PersistentVolumeClaim>>(&client, ns),
        owned.clone(),
        |_| {},
    );
    let (services, service_events) = cached(
        api::<PartialObjectMeta<Service>>(&client, ns),
        owned.clone(),
        |_| {},
    );
    let (synced_tx, synced) = tokio::sync::watch::channel(false);
    let caches = Caches {
        kvm_machines: kvm_machines.clone(),
        kvm_clusters: kvm_clusters.clone(),
        machines: machines.clone(),
        clusters,
        pods,
        secrets,
        claims,
        services,
        synced,
    };
    let (node_trigger, node_events) = futures::channel::mpsc::unbounded();
    let machines_of_node: workload::MachinesOfNode = {
        let kvm_machines = kvm_machines.clone();
        Arc::new(move |ns: &str, cluster: &str, node: Option<&str>| {
            kvm_machines
                .state()
                .into_iter()
                .filter(|km| {
                    km.namespace().as_deref() == Some(ns)
                        && km.labels().get(CLUSTER_NAME_LABEL).map(String::as_str) == Some(cluster)
                        && node.is_none_or(|n| kvmmachine::names::hostname(km) == n)
                })
                .map(|km| ObjectRef::from(&*km))
                .collect()
        })
    };
    let workloads = Arc::new(workload::Links::new(node_trigger, machines_of_node));

    // Hosting clusters: an object there wakes whoever its labels name; a change of the link's
    // availability wakes every KVMCluster naming it and their machines.
    let (hosted_machine_trigger, hosted_machine_events) = futures::channel::mpsc::unbounded();
    let hosting_changed: hosting::OnChange = {
        let (kvm_machines, kvm_clusters) = (kvm_machines.clone(), kvm_clusters.clone());
        let clusters = caches.clusters.clone();
        let (machine_trigger, cluster_trigger) =
            (hosted_machine_trigger.clone(), cluster_trigger.clone());
        Arc::new(
            move |key: &hosting::HostingKey, meta: Option<&ObjectMeta>| {
                let Some(meta) = meta else {
                    for kc in kvm_clusters.state() {
                        if hosting::HostingKey::of(&kc).as_ref() != Some(key) {
                            continue;
                        }
                        let _ = cluster_trigger.unbounded_send(ObjectRef::from(&*kc));
                        if let Some(cluster) = cluster_of(&kc) {
                            for km in
                                machines_of(&kvm_machines, kc.namespace().as_deref(), &cluster)
                            {
                                let _ = machine_trigger.unbounded_send(km);
                            }
                        }
                    }
                    return;
                };
                let labels = meta.labels.clone().unwrap_or_default();
                let Some(owner_ns) = labels.get(OWNER_NAMESPACE_LABEL) else {
                    return;
                };
                if let Some(km) = labels
                    .get(KVMMACHINE_LABEL)
                    .and_then(|l| named_by_label(&kvm_machines, owner_ns, l))
                {
                    let _ = machine_trigger.unbounded_send(km);
                }
                if let Some(kc) = labels
                    .get(KVMCLUSTER_LABEL)
                    .and_then(|l| named_by_label(&kvm_clusters, owner_ns, l))
                {
                    let _ = cluster_trigger.unbounded_send(kc);
                }
                // A control-plane machine Pod is an endpoint of its cluster's Service.
                if labels.get(MACHINE_ROLE_LABEL).map(String::as_str) == Some(ROLE_CONTROL_PLANE)
                    && let Some(cluster) = labels
                        .get(CLUSTER_NAME_LABEL)
                        .and_then(|c| clusters.get(&ObjectRef::new(c).within(owner_ns)))
                    && let Some(infra) = cluster.spec.infrastructure_ref.as_ref()
                    && infra.kind == "KVMCluster"
                {
                    let _ = cluster_trigger
                        .unbounded_send(ObjectRef::new(&infra.name).within(owner_ns));
                }
            },
        )
    };
    let hosting = Arc::new(hosting::Links::new(hosting_changed));
    let ctx = Arc::new(Context::new(
        client.clone(),
        settings,
        metrics.clone(),
        caches.clone(),
        workloads,
        hosting,
    ));
    tokio::spawn(kvmcluster::prune_hosting_links(
        ctx.clone(),
        stopped(rx.clone()),
    ));
    {
        let (caches, metrics) = (caches.clone(), metrics.clone());
        tokio::spawn(caches.clone().watch_readiness(synced_tx));
        tokio::spawn(async move {
            caches.ready().await;
            metrics.set_ready();
        });
    }

    // A control-plane machine Pod that changes (an IP, deletion) concerns its KVMCluster too:
    // it is an endpoint of the control-plane Service. The one Pod watch feeds both controllers.
    let pod_events = {
        let clusters = caches.clusters.clone();
        let cluster_trigger = cluster_trigger.clone();
        pod_events.inspect(move |pod| {
            if let Ok(pod) = pod
                && let Some(kc) = kvmcluster::kvmcluster_of_pod(pod, &clusters)
            {
                let _ = cluster_trigger.unbounded_send(kc);
            }
        })
    };
    // A hosting kubeconfig Secret that changes concerns the KVMClusters naming it (and their
    // machines, through the Secret mapping below).
    let secret_events = {
        let kvm_clusters = kvm_clusters.clone();
        let cluster_trigger = cluster_trigger.clone();
        secret_events.inspect(move |s| {
            if let Ok(s) = s {
                for kc in hosting_users(&kvm_clusters, s) {
                    let _ = cluster_trigger.unbounded_send(kc);
                }
            }
        })
    };
    let clusters = Controller::new(api::<KVMCluster>(&client, ns), watcher::Config::default())
        .with_config(controller_config.clone())
        .owns_stream(service_events)
        .watches(
            api::<Cluster>(&client, ns),
            watcher::Config::default(),
            |cluster: Cluster| {
                let ns = cluster.namespace()?;
                let r = cluster.spec.infrastructure_ref.as_ref()?;
                (r.kind == "KVMCluster").then(|| ObjectRef::new(&r.name).within(&ns))
            },
        )
        .reconcile_on(cluster_triggers)
        .graceful_shutdown_on(stopped(rx.clone()))
        .run(kvmcluster::reconcile, kvmcluster::error_policy, ctx.clone())
        .for_each(|res| async move {
            match res {
                Ok((obj, _)) => debug!(kvmcluster = %obj.name, "reconciled"),
                Err(e) => warn!(error = %e, "KVMCluster reconcile error"),
            }
        });

    // Templates: only their own spec matters (the autoscaler's capacity).
    let templates = Controller::new(
        api::<KVMMachineTemplate>(&client, ns),
        watcher::Config::default(),
    )
    .with_config(controller_config.clone())
    .graceful_shutdown_on(stopped(rx.clone()))
    .run(
        kvmmachinetemplate::reconcile,
        kvmmachinetemplate::error_policy,
        ctx.clone(),
    )
    .for_each(|res| async move {
        match res {
            Ok((obj, _)) => debug!(kvmmachinetemplate = %obj.name, "reconciled"),
            Err(e) => warn!(error = %e, "KVMMachineTemplate reconcile error"),
        }
    });

    let (by_cluster, by_secret, by_kvm_cluster) = (
        kvm_machines.clone(),
        kvm_machines.clone(),
        kvm_machines.clone(),
    );
    // The hosting cluster each KVMCluster named when last seen.
    let hosted_in = std::sync::Mutex::new(std::collections::HashMap::new());
    // A Pod concerns the KVMMachine that owns it (machine Pods), or that its labels name (etcd
    // cleanup Pods, which have no owner reference).
    let by_pod = kvm_machines.clone();
    let machines = machine_controller
        .with_config(controller_config)
        .watches_stream(pod_events, move |pod: Pod| {
            let owners: Vec<ObjectRef<KVMMachine>> = pod
                .owner_references()
                .iter()
                .filter(|o| o.kind == "KVMMachine" && o.api_version.starts_with(GROUP))
                .filter_map(|o| Some(ObjectRef::new(&o.name).within(&pod.namespace()?)))
                .collect();
            if !owners.is_empty() {
                return owners;
            }
            let labels = pod.labels();
            labels
                .get(OWNER_NAMESPACE_LABEL)
                .zip(labels.get(KVMMACHINE_LABEL))
                .and_then(|(ns, name)| named_by_label(&by_pod, ns, name))
                .into_iter()
                .collect()
        })
        .owns_stream(claim_events)
        .watches_stream(machine_events, |m: Machine| {
            let ns = m.namespace()?;
            let r = &m.spec.infrastructure_ref;
            (r.kind == "KVMMachine").then(|| ObjectRef::new(&r.name).within(&ns))
        })
        // A KVMCluster that names another hosting cluster (or none any more) concerns its
        // machines.
        .watches_stream(kvm_cluster_events, move |kc: KVMCluster| {
            let key = HostingKey::of(&kc);
            let uid = kc.uid().unwrap_or_default();
            let moved = hosted_in
                .lock()
                .expect("hosted_in lock")
                .insert(uid, key.clone())
                != Some(key);
            match cluster_of(&kc) {
                Some(cluster) if moved => {
                    machines_of(&by_kvm_cluster, kc.namespace().as_deref(), &cluster)
                }
                _ => Vec::new(),
            }
        })
        // A Cluster's infrastructure becoming provisioned (or pausing) concerns its machines.
        .watches_stream(cluster_events, move |c: Cluster| {
            machines_of(&by_cluster, c.namespace().as_deref(), &c.name_any())
        })
        // Secrets: our Ignition Secrets (owner), a Machine's bootstrap data (it may appear after
        // the Machine names it), `<cluster>-kubeconfig` (the workload cluster link) and a
        // hosting cluster's kubeconfig.
        .watches_stream(secret_events, move |s: PartialObjectMeta<Secret>| {
            let ns = s.namespace();
            let name = s.name_any();
            let mut refs: Vec<ObjectRef<KVMMachine>> = s
                .owner_references()
                .iter()
                .filter(|o| o.kind == "KVMMachine")
                .filter_map(|o| Some(ObjectRef::new(&o.name).within(ns.as_deref()?)))
                .collect();
            refs.extend(
                machines
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
                refs.extend(machines_of(&by_secret, ns.as_deref(), cluster));
            }
            for kc in hosting_users(&kvm_clusters, &s) {
                if let Some(kc) = kvm_clusters.get(&kc)
                    && let Some(cluster) = cluster_of(&kc)
                {
                    refs.extend(machines_of(&by_secret, ns.as_deref(), &cluster));
                }
            }
            refs
        })
        // Node changes in workload clusters; objects in hosting clusters.
        .reconcile_on(node_events)
        .reconcile_on(hosted_machine_events)
        .graceful_shutdown_on(stopped(rx))
        .run(kvmmachine::reconcile, kvmmachine::error_policy, ctx)
        .for_each(|res| async move {
            match res {
                Ok((obj, _)) => debug!(kvmmachine = %obj.name, "reconciled"),
                Err(e) => warn!(error = %e, "KVMMachine reconcile error"),
            }
        });
    futures::join!(clusters, machines, templates);
}

/// The KVMClusters whose hosting cluster's kubeconfig is Secret `s`.
fn hosting_users(
    kvm_clusters: &Store<KVMCluster>,
    s: &PartialObjectMeta<Secret>,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cached_secret_keeps_only_the_annotation_the_controller_reads() {
        let mut s: PartialObjectMeta<Secret> = serde_json::from_value(serde_json::json!({
            "apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
            "metadata": {"name": "m-ignition", "labels": {"a": "b"}, "annotations": {
                "example.com/blob": "x".repeat(64 << 10),
                capk_api::constants::RENDERED_FROM_ANNOTATION: "m-bootstrap@7"}},
        }))
        .unwrap();
        strip_secret(&mut s);
        let annotations = s.metadata.annotations.unwrap();
        assert_eq!(
            annotations.keys().collect::<Vec<_>>(),
            [capk_api::constants::RENDERED_FROM_ANNOTATION]
        );
        assert_eq!(s.metadata.labels.unwrap()["a"], "b");
    }
}
