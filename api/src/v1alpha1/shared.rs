//! Types shared by the KVM kinds.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::KubeSchema;
use serde::{Deserialize, Serialize};

/// Where the workload cluster's API server is reached (`host:port`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.host) == has(self.port)").message("controlPlaneEndpoint needs both host and port"))]
pub struct ApiEndpoint {
    /// DNS name or IP address of the control-plane endpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self.size() > 0 && self.size() <= 253").message("host must be a non-empty DNS name or IP address of at most 253 characters"))]
    pub host: Option<String>,
    /// TCP port of the control-plane endpoint (1-65535).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 65535").message("port must be between 1 and 65535"))]
    pub port: Option<i32>,
}

impl ApiEndpoint {
    /// True when both host and port are set (CAPI's `IsValid`).
    pub fn is_set(&self) -> bool {
        self.host.as_deref().is_some_and(|h| !h.is_empty()) && self.port.is_some_and(|p| p > 0)
    }
}

/// `status.initialization` of the v1beta2 contract.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct Initialization {
    /// True once the infrastructure is provisioned; Cluster API then proceeds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provisioned: Option<bool>,
}

/// The status fields of Cluster API's v1beta2 infrastructure contract, the same in both kinds.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct ContractStatus {
    /// Contract field: provisioned once the infrastructure exists: a KVMCluster's control-plane
    /// endpoint, a KVMMachine's running VM with `providerID` set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initialization: Option<Initialization>,

    /// The same as `initialization.provisioned`, for Cluster API v1beta1 readers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready: Option<bool>,

    /// Conditions: `Ready`, `Paused`, and the kind's own: a KVMCluster's
    /// `ControlPlaneServiceReady`, a KVMMachine's `BootstrapCompleted`, `VMRunning`, ...
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["type".into()]))]
    pub conditions: Option<Vec<Condition>>,

    /// The generation the status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

impl ContractStatus {
    /// Whether `initialization.provisioned` is true (it never goes back to false).
    pub fn is_provisioned(&self) -> bool {
        self.initialization.as_ref().and_then(|i| i.provisioned) == Some(true)
    }

    /// Marks the infrastructure provisioned, in both contract versions' fields.
    pub fn set_provisioned(&mut self) {
        self.initialization = Some(Initialization {
            provisioned: Some(true),
        });
        self.ready = Some(true);
    }
}

/// A failure domain, in the v1beta2 list form.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct FailureDomain {
    /// Name of the failure domain (for example an MC node zone).
    #[x_kube(validation = Rule::new("self.size() > 0 && self.size() <= 256").message("failure domain name must be 1-256 characters"))]
    pub name: String,
    /// Whether control-plane machines may be placed in it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_plane: Option<bool>,
    /// Free-form attributes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attributes: Option<BTreeMap<String, String>>,
}

/// The type of a machine address (`Hostname|ExternalIP|InternalIP|ExternalDNS|InternalDNS`).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, schemars::JsonSchema)]
pub enum MachineAddressType {
    /// The node's hostname.
    Hostname,
    /// An externally routable IP.
    ExternalIP,
    /// The IP inside the management cluster's Pod network.
    InternalIP,
    /// An external DNS name.
    ExternalDNS,
    /// An internal DNS name.
    InternalDNS,
}

/// An address of a machine, as Cluster API expects it.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct MachineAddress {
    /// Kind of address.
    #[serde(rename = "type")]
    pub type_: MachineAddressType,
    /// The address.
    pub address: String,
}

/// Conditions as `metav1.Condition`, keyed by type.
pub type Conditions = Vec<Condition>;
