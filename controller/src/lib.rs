//! `capk-controller`: reconciles KVMCluster (control-plane Service, endpoint), KVMMachine
//! (machine Pods) and KVMMachineTemplate (capacity) for the Cluster API v1beta2 contract.
//!
//! [`run_with_metrics`] starts the management cluster's watches ([`k8s::caches`]), the links to
//! workload and hosting clusters ([`remote::workload`], [`remote::hosting`]) and one controller per kind; each
//! reconciler's folder says what wakes it (`kvmmachine/watches.rs`, `kvmcluster/watches.rs`).
#![forbid(unsafe_code)]

pub mod k8s;
pub mod kvmcluster;
pub mod kvmmachine;
pub mod kvmmachinetemplate;
pub mod leader;
pub mod metrics;
pub mod remote;
pub mod runtime;
pub mod settings;

use std::sync::Arc;

use capk_api::v1alpha1::{KVMCluster, KVMMachine};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::{Client, runtime::controller::Config as ControllerConfig};

pub use k8s::caches::Caches;
pub use runtime::context::{Context, Settings};

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
    let config = ControllerConfig::default().concurrency(settings.concurrency);

    // One shutdown signal, fanned out to every controller.
    let (tx, rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        let _ = tx.send(true);
    });
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };

    // The management cluster's watches, each feeding a cache the reconciles read; what other
    // clusters report wakes the reconciles it concerns.
    let (caches, events, services) = Caches::watch(&client, settings.namespace.as_deref());
    let (cluster_wake, cluster_wakes) = kvmcluster::watches::Wake::<KVMCluster>::new();
    let (machine_wake, machine_wakes) = kvmmachine::watches::Wake::<KVMMachine>::new();
    let events = cluster_wake.on(events, &caches);
    let limits = &settings.remote_limits;
    let workloads = remote::workload::Links::new(machine_wake.on_nodes(&caches), limits);
    let hosting = {
        let (machines, clusters) = (
            machine_wake.on_hosting(&caches),
            cluster_wake.on_hosting(&caches),
        );
        remote::hosting::Links::new(
            Arc::new(
                move |key: &remote::hosting::HostingKey, meta: Option<&ObjectMeta>| {
                    machines(key, meta);
                    clusters(key, meta);
                },
            ),
            limits,
        )
    };
    let ctx = Arc::new(Context::new(
        client,
        settings,
        metrics.clone(),
        caches.clone(),
        Arc::new(workloads),
        Arc::new(hosting),
    ));
    tokio::spawn(kvmcluster::prune_hosting_links(
        ctx.clone(),
        stopped(rx.clone()),
    ));
    tokio::spawn(async move {
        caches.ready().await;
        metrics.set_ready();
    });

    futures::join!(
        kvmcluster::watches::run(
            ctx.clone(),
            config.clone(),
            services,
            cluster_wakes,
            stopped(rx.clone()),
        ),
        kvmmachine::watches::run(
            ctx.clone(),
            config.clone(),
            events,
            machine_wakes,
            stopped(rx.clone()),
        ),
        kvmmachinetemplate::run(ctx, config, stopped(rx)),
    );
}
