//! `capk-controller`: reconciles KVMCluster (control-plane Service, endpoint) and, later,
//! KVMMachine (machine Pods) for the Cluster API v1beta2 contract.
#![forbid(unsafe_code)]

pub mod conditions;
pub mod context;
pub mod error;
pub mod kvmcluster;
pub mod kvmmachine;

use std::sync::Arc;

use capk_api::{capi::Cluster, constants::MANAGED_BY, v1alpha1::KVMCluster};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Service;
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
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) {
    let ns = settings.namespace.clone();
    let ctx = Arc::new(Context::new(client.clone(), settings));
    let owned =
        watcher::Config::default().labels(&format!("app.kubernetes.io/managed-by={MANAGED_BY}"));

    Controller::new(
        api::<KVMCluster>(&client, ns.as_deref()),
        watcher::Config::default(),
    )
    .owns(api::<Service>(&client, ns.as_deref()), owned)
    .watches(
        api::<Cluster>(&client, ns.as_deref()),
        watcher::Config::default(),
        |cluster: Cluster| {
            let ns = cluster.namespace()?;
            let r = cluster.spec.infrastructure_ref.as_ref()?;
            (r.kind == "KVMCluster").then(|| ObjectRef::new(&r.name).within(&ns))
        },
    )
    .graceful_shutdown_on(shutdown)
    .run(kvmcluster::reconcile, kvmcluster::error_policy, ctx)
    .for_each(|res| async move {
        match res {
            Ok((obj, _)) => debug!(kvmcluster = %obj.name, "reconciled"),
            Err(e) => warn!(error = %e, "reconcile error"),
        }
    })
    .await;
}
