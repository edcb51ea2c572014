//! `capk-controller`: reconciles KVMCluster (control-plane Service, endpoint) and, later,
//! KVMMachine (machine Pods) for the Cluster API v1beta2 contract.
#![forbid(unsafe_code)]

pub mod conditions;
pub mod context;
pub mod error;
pub mod kvmcluster;
pub mod kvmmachine;
pub mod metrics;
pub mod report;
pub mod workload;

use std::sync::Arc;

use capk_api::{
    capi::{Cluster, Machine},
    constants::{CLUSTER_NAME_LABEL, MANAGED_BY},
    v1alpha1::{KVMCluster, KVMMachine},
};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod, Secret, Service};
use kube::{
    Api, Client, ResourceExt,
    runtime::{Controller, reflector::ObjectRef, watcher},
};
use tracing::{debug, warn};

pub use context::{Context, Settings};

fn api<K>(client: &Client, ns: Option<&str>) -> Api<K>
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>,
{
    match ns {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
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
    metrics.set_ready();
    let ctx = Arc::new(Context::new(client.clone(), settings, metrics));
    let owned =
        watcher::Config::default().labels(&format!("app.kubernetes.io/managed-by={MANAGED_BY}"));

    // One shutdown signal, fanned out to both controllers.
    let (tx, rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        let _ = tx.send(true);
    });
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };

    let clusters = Controller::new(
        api::<KVMCluster>(&client, ns.as_deref()),
        watcher::Config::default(),
    )
    .owns(api::<Service>(&client, ns.as_deref()), owned.clone())
    .watches(
        api::<Cluster>(&client, ns.as_deref()),
        watcher::Config::default(),
        |cluster: Cluster| {
            let ns = cluster.namespace()?;
            let r = cluster.spec.infrastructure_ref.as_ref()?;
            (r.kind == "KVMCluster").then(|| ObjectRef::new(&r.name).within(&ns))
        },
    )
    .graceful_shutdown_on(stopped(rx.clone()))
    .run(kvmcluster::reconcile, kvmcluster::error_policy, ctx.clone())
    .for_each(|res| async move {
        match res {
            Ok((obj, _)) => debug!(kvmcluster = %obj.name, "reconciled"),
            Err(e) => warn!(error = %e, "KVMCluster reconcile error"),
        }
    });

    let machines = Controller::new(
        api::<KVMMachine>(&client, ns.as_deref()),
        watcher::Config::default(),
    );
    let store = machines.store();
    let machines = machines
        .owns(api::<Pod>(&client, ns.as_deref()), owned.clone())
        .owns(api::<Secret>(&client, ns.as_deref()), owned.clone())
        .owns(api::<PersistentVolumeClaim>(&client, ns.as_deref()), owned)
        .watches(
            api::<Machine>(&client, ns.as_deref()),
            watcher::Config::default(),
            |m: Machine| {
                let ns = m.namespace()?;
                let r = &m.spec.infrastructure_ref;
                (r.kind == "KVMMachine").then(|| ObjectRef::new(&r.name).within(&ns))
            },
        )
        // A Cluster's infrastructure becoming provisioned (or pausing) concerns its machines.
        .watches(
            api::<Cluster>(&client, ns.as_deref()),
            watcher::Config::default(),
            move |c: Cluster| {
                let (name, ns) = (c.name_any(), c.namespace());
                store
                    .state()
                    .into_iter()
                    .filter(|km| {
                        km.namespace() == ns && km.labels().get(CLUSTER_NAME_LABEL) == Some(&name)
                    })
                    .map(|km| ObjectRef::from(&*km))
                    .collect::<Vec<_>>()
            },
        )
        .graceful_shutdown_on(stopped(rx))
        .run(kvmmachine::reconcile, kvmmachine::error_policy, ctx)
        .for_each(|res| async move {
            match res {
                Ok((obj, _)) => debug!(kvmmachine = %obj.name, "reconciled"),
                Err(e) => warn!(error = %e, "KVMMachine reconcile error"),
            }
        });
    futures::join!(clusters, machines);
}
