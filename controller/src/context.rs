//! What every reconcile gets: the client, settings, the Event recorder, metrics, and the
//! watch caches the reconcilers read instead of asking the apiserver.

use capk_api::{
    capi::{Cluster, Machine},
    v1alpha1::{KVMCluster, KVMMachine},
};
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod, Secret, Service};
use kube::{
    Client,
    core::PartialObjectMeta,
    runtime::{
        events::{Recorder, Reporter},
        reflector::{ObjectRef, Store},
    },
};

/// Field manager of every server-side apply this controller makes: its name.
pub const FIELD_MANAGER: &str = capk_api::constants::MANAGED_BY;

pub use crate::settings::Settings;

/// Read-only views of the watches that also trigger reconciles. Each is filled by exactly one
/// watch; Secrets, PVCs and Services are watched as metadata only (data is read when needed).
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

impl Caches {
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
    pub fn objects(&self) -> crate::hosting::ObjectCaches {
        crate::hosting::ObjectCaches {
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
    pub workloads: std::sync::Arc<crate::workload::Links>,
    /// Clients and watches of hosting clusters.
    pub hosting: std::sync::Arc<crate::hosting::Links>,
    /// What the health check knows of the control-plane apiservers, between reconciles.
    pub apiserver_health: std::sync::Arc<crate::apiserver_health::HealthMonitor>,
    /// Consecutive failures of each object, for the wait before its next reconcile.
    pub backoff: std::sync::Arc<crate::backoff::ReconcileBackoff>,
}

impl Context {
    /// Builds the context; Events are reported as `capk-controller`.
    pub fn new(
        client: Client,
        settings: Settings,
        metrics: std::sync::Arc<crate::metrics::Metrics>,
        caches: Caches,
        workloads: std::sync::Arc<crate::workload::Links>,
        hosting: std::sync::Arc<crate::hosting::Links>,
    ) -> Self {
        let reporter = Reporter {
            controller: FIELD_MANAGER.into(),
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
