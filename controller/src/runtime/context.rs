//! What every reconcile gets: the client, settings, the Event recorder, metrics, the watch
//! caches the reconcilers read instead of asking the apiserver ([`crate::k8s::caches`]) and the
//! links to other clusters.

use kube::{
    Client,
    runtime::events::{Recorder, Reporter},
};

pub use crate::{k8s::caches::Caches, settings::Settings};

/// Shared state of the reconcilers.
#[derive(Clone)]
pub struct Context {
    /// Apiserver client.
    pub client: Client,
    /// Settings.
    pub settings: Settings,
    /// Publishes Events on our objects.
    pub recorder: Recorder,
    /// Prometheus metrics.
    pub metrics: std::sync::Arc<crate::metrics::Metrics>,
    /// Watch caches.
    pub caches: Caches,
    /// Node watches in workload clusters.
    pub workloads: std::sync::Arc<crate::remote::workload::Links>,
    /// Clients and watches of hosting clusters.
    pub hosting: std::sync::Arc<crate::remote::hosting::Links>,
    /// What the health check knows of the control-plane apiservers, between reconciles.
    pub apiserver_health: std::sync::Arc<crate::remote::apiserver_health::HealthMonitor>,
    /// Consecutive failures of each object, for the wait before its next reconcile.
    pub backoff: std::sync::Arc<crate::runtime::backoff::ReconcileBackoff>,
}

impl Context {
    /// Builds the context; Events are reported as `capk-controller`.
    pub fn new(
        client: Client,
        settings: Settings,
        metrics: std::sync::Arc<crate::metrics::Metrics>,
        caches: Caches,
        workloads: std::sync::Arc<crate::remote::workload::Links>,
        hosting: std::sync::Arc<crate::remote::hosting::Links>,
    ) -> Self {
        let reporter = Reporter {
            controller: crate::k8s::objects::FIELD_MANAGER.into(),
            instance: std::env::var("POD_NAME").ok(),
        };
        Self {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            settings,
            metrics,
            caches,
            workloads,
            hosting,
            apiserver_health: Default::default(),
            backoff: Default::default(),
        }
    }
}
