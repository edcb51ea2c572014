//! Where the owning Machine puts a machine: what the builders need to know about the Machine.

use capk_api::capi::Machine;

/// The machine's cluster, its role and its failure domain, from its owner Machine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MachinePlacement {
    /// The Cluster's name.
    pub cluster: String,
    /// Whether this is a control-plane machine.
    pub control_plane: bool,
    /// The Machine's failure domain.
    pub failure_domain: Option<String>,
}

impl MachinePlacement {
    /// The placement `machine` gives.
    pub fn of(machine: &Machine) -> Self {
        Self {
            cluster: machine.spec.cluster_name.clone(),
            control_plane: machine.is_control_plane(),
            failure_domain: machine.spec.failure_domain.clone(),
        }
    }
}
