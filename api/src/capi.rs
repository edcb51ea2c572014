//! The Cluster API (v1beta2) objects this provider reads: Cluster and Machine.
//!
//! Hand-written and minimal on purpose: only the fields the controller uses. Unknown fields are
//! ignored when reading; the controller never writes these objects whole.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use serde::{Deserialize, Serialize};

/// A reference to an object by API group, kind and name (`ContractVersionedObjectReference`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ContractVersionedObjectReference {
    /// API group of the referenced object.
    #[serde(default)]
    pub api_group: String,
    /// Kind of the referenced object.
    #[serde(default)]
    pub kind: String,
    /// Name of the referenced object (same namespace).
    #[serde(default)]
    pub name: String,
}

/// `host:port` of an API server.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ApiEndpoint {
    /// Host.
    #[serde(default)]
    pub host: String,
    /// Port.
    #[serde(default)]
    pub port: i32,
}

/// CIDR blocks of a network.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct NetworkRanges {
    /// CIDR blocks.
    #[serde(default)]
    pub cidr_blocks: Vec<String>,
}

/// Network settings of a workload cluster.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ClusterNetwork {
    /// Port the API server listens on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_server_port: Option<i32>,
    /// Service CIDRs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub services: Option<NetworkRanges>,
    /// Pod CIDRs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods: Option<NetworkRanges>,
    /// Service DNS domain.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_domain: Option<String>,
}

/// The fields of `cluster.x-k8s.io/v1beta2` Cluster that the provider reads.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[kube(
    group = "cluster.x-k8s.io",
    version = "v1beta2",
    kind = "Cluster",
    plural = "clusters",
    namespaced,
    status = "ClusterStatus",
    schema = "disabled"
)]
#[serde(rename_all = "camelCase")]
pub struct ClusterSpec {
    /// Pauses reconciliation of the whole cluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused: Option<bool>,
    /// Network settings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_network: Option<ClusterNetwork>,
    /// Where the API server is reached.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_plane_endpoint: Option<ApiEndpoint>,
    /// The control plane object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_plane_ref: Option<ContractVersionedObjectReference>,
    /// The infrastructure cluster object (our KVMCluster).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub infrastructure_ref: Option<ContractVersionedObjectReference>,
}

/// `status.initialization` of a Cluster.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ClusterInitialization {
    /// The infrastructure cluster reported provisioned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub infrastructure_provisioned: Option<bool>,
    /// The control plane is initialized (the first API server answers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_plane_initialized: Option<bool>,
}

/// The fields of a Cluster's status that the provider reads.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ClusterStatus {
    /// Initialization progress.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initialization: Option<ClusterInitialization>,
    /// Conditions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conditions: Option<Vec<Condition>>,
    /// Phase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
}

impl Cluster {
    /// True when `spec.paused` is set.
    pub fn is_paused(&self) -> bool {
        self.spec.paused.unwrap_or(false)
    }

    /// True once CAPI recorded the infrastructure as provisioned.
    pub fn infrastructure_provisioned(&self) -> bool {
        self.status
            .as_ref()
            .and_then(|s| s.initialization.as_ref())
            .and_then(|i| i.infrastructure_provisioned)
            .unwrap_or(false)
    }
}

/// Bootstrap settings of a Machine.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Bootstrap {
    /// The bootstrap config object (e.g. a KubeadmConfig).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_ref: Option<ContractVersionedObjectReference>,
    /// Name of the Secret holding the bootstrap data (keys `value` and `format`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_secret_name: Option<String>,
}

/// The fields of `cluster.x-k8s.io/v1beta2` Machine that the provider reads.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[kube(
    group = "cluster.x-k8s.io",
    version = "v1beta2",
    kind = "Machine",
    plural = "machines",
    namespaced,
    status = "MachineStatus",
    schema = "disabled"
)]
#[serde(rename_all = "camelCase")]
pub struct MachineSpec {
    /// The Cluster this Machine belongs to.
    #[serde(default)]
    pub cluster_name: String,
    /// Bootstrap config and data.
    #[serde(default)]
    pub bootstrap: Bootstrap,
    /// The infrastructure machine object (our KVMMachine).
    #[serde(default)]
    pub infrastructure_ref: ContractVersionedObjectReference,
    /// Kubernetes version of the node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// Provider ID copied from the infrastructure machine.
    #[serde(
        rename = "providerID",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub provider_id: Option<String>,
    /// Failure domain the Machine must be placed in (authoritative).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_domain: Option<String>,
}

/// Reference to the workload-cluster Node of a Machine.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct MachineNodeReference {
    /// Node name.
    #[serde(default)]
    pub name: String,
}

/// The fields of a Machine's status that the provider reads.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct MachineStatus {
    /// The workload-cluster Node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_ref: Option<MachineNodeReference>,
    /// Phase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    /// Conditions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conditions: Option<Vec<Condition>>,
}

impl Machine {
    /// True for control-plane Machines (label `cluster.x-k8s.io/control-plane`).
    pub fn is_control_plane(&self) -> bool {
        self.metadata
            .labels
            .as_ref()
            .is_some_and(|l| l.contains_key(crate::constants::CONTROL_PLANE_LABEL))
    }
}
