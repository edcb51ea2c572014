//! What every reconcile gets: the client, settings and the Event recorder.

use kube::{
    Client,
    runtime::events::{Recorder, Reporter},
};

/// Field manager of every server-side apply this controller makes.
pub const FIELD_MANAGER: &str = "capk-controller";

/// Settings from the command line.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Watch one namespace only (clusterctl's `--namespace`), or all.
    pub namespace: Option<String>,
    /// DNS domain of the management cluster (`cluster.local`), for the endpoint's Service name.
    pub cluster_domain: String,
    /// Defaults for machine Pods (launcher image, volume sizes, ...).
    pub machine_defaults: crate::kvmmachine::build::MachineDefaults,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            namespace: None,
            cluster_domain: "cluster.local".into(),
            machine_defaults: Default::default(),
        }
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
}

impl Context {
    /// Builds the context; Events are reported as `capk-controller`.
    pub fn new(
        client: Client,
        settings: Settings,
        metrics: std::sync::Arc<crate::metrics::Metrics>,
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
        }
    }
}
