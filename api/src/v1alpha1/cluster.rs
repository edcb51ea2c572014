//! KVMCluster and KVMClusterTemplate: the infrastructure of one workload cluster.
// Several `printcolumn(type_ = "string", ...)` entries are not duplicates.
#![allow(clippy::duplicated_attributes)]

use std::collections::BTreeMap;

use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use super::shared::{ApiEndpoint, ContractStatus, FailureDomain};

/// The infrastructure of a workload cluster: its control-plane endpoint (a Service in the
/// hosting cluster whose endpoints are the control-plane machine Pods), its failure domains and
/// where its machines run (the management cluster, or a hosting cluster).
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, KubeSchema)]
#[kube(
    group = "infrastructure.cluster.x-k8s.io",
    version = "v1alpha1",
    kind = "KVMCluster",
    doc = "KVMCluster is the infrastructure of a Cluster API workload cluster on KVM: its control-plane endpoint and failure domains.",
    plural = "kvmclusters",
    singular = "kvmcluster",
    namespaced,
    status = "KVMClusterStatus",
    category = "cluster-api",
    shortname = "kvmc",
    label("cluster.x-k8s.io/v1beta2", "v1alpha1"),
    label("cluster.x-k8s.io/provider", "infrastructure-kvm"),
    printcolumn(
        name = "Cluster",
        type_ = "string",
        json_path = ".metadata.labels['cluster\\.x-k8s\\.io/cluster-name']",
        description = "Cluster to which this KVMCluster belongs"
    ),
    printcolumn(
        name = "Provisioned",
        type_ = "boolean",
        json_path = ".status.initialization.provisioned",
        description = "Whether the infrastructure is ready"
    ),
    printcolumn(
        name = "Endpoint",
        type_ = "string",
        json_path = ".spec.controlPlaneEndpoint.host",
        description = "Control-plane endpoint host"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    ),
    // On KVMCluster only, not its template's copy of the spec: a ClusterClass may change a
    // template (the topology controller's dry run must pass); the cluster it made refuses.
    validation = Rule::new("self.spec.?controlPlaneService.?type.orValue('ClusterIP') == 'ClusterIP' || self.spec.?controlPlaneService.?externalHost.orValue('') != '' || self.spec.?controlPlaneEndpoint.?host.orValue('') != ''").message("spec.controlPlaneService.type NodePort or LoadBalancer needs spec.controlPlaneService.externalHost: the DNS name or address through which clients outside the management cluster (and the machines) reach the Service; it becomes the control-plane endpoint's host and is in the apiserver's certificate"),
    validation = Rule::new("(self.spec.?controlPlaneService.?type.orValue('ClusterIP') == 'NodePort') == (oldSelf.spec.?controlPlaneService.?type.orValue('ClusterIP') == 'NodePort')").message("spec.controlPlaneService.type cannot change to or from NodePort: the control-plane endpoint's port (the node port, else 6443) is fixed when the cluster is created; ClusterIP and LoadBalancer may be swapped"),
    // has() rather than optionals: the cost estimate of an optional's value forgets maxLength.
    validation = Rule::new("(has(self.spec.controlPlaneService) && has(self.spec.controlPlaneService.externalHost) ? self.spec.controlPlaneService.externalHost : '') == (has(oldSelf.spec.controlPlaneService) && has(oldSelf.spec.controlPlaneService.externalHost) ? oldSelf.spec.controlPlaneService.externalHost : '')").message("spec.controlPlaneService.externalHost cannot be changed: it is the control-plane endpoint's host, named by the workload kubeconfig and the apiserver's certificate"),
    validation = Rule::new("self.spec.?controlPlaneService.?nodePort.orValue(0) == oldSelf.spec.?controlPlaneService.?nodePort.orValue(0)").message("spec.controlPlaneService.nodePort cannot be changed: it is the control-plane endpoint's port, named by the workload kubeconfig")
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(oldSelf.controlPlaneEndpoint) || !has(oldSelf.controlPlaneEndpoint.host) || (has(self.controlPlaneEndpoint) && self.controlPlaneEndpoint == oldSelf.controlPlaneEndpoint)").message("controlPlaneEndpoint cannot be changed once set"))]
pub struct KVMClusterSpec {
    /// Where the workload cluster's API server is reached. Leave empty and the controller sets it
    /// from the control-plane Service: host `controlPlaneService.externalHost`, else the Service's
    /// DNS name; port the Service's node port with type NodePort, else 6443.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_plane_endpoint: Option<ApiEndpoint>,

    /// The Service in the management cluster that fronts the control-plane machines.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_plane_service: Option<ControlPlaneService>,

    /// Failure domains machines may be spread over. When empty, the controller may derive them
    /// from the management cluster nodes' zone labels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["name".into()]))]
    #[schemars(length(max = 64))]
    pub failure_domains: Option<Vec<FailureDomain>>,

    /// Where the machine Pods, their Ignition Secrets and PVCs and the control-plane Service
    /// live. Absent: the management cluster itself, in the KVMCluster's namespace. Set: the
    /// cluster a kubeconfig Secret reaches, so that `clusterctl move` of the Cluster API objects
    /// leaves every VM running.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hosting_cluster: Option<HostingCluster>,
}

/// A hosting cluster: where a workload cluster's machine Pods run, reached through a kubeconfig.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.namespace) == has(oldSelf.namespace)").message("hostingCluster.namespace cannot be added or removed while hostingCluster is set: the machines and the control-plane Service are where it says, and changing it would not move them"))]
pub struct HostingCluster {
    /// The Secret, in the KVMCluster's namespace, whose key `value` holds the hosting cluster's
    /// kubeconfig (the Cluster API convention). Inline credentials only (`*-data`, `token`):
    /// a kubeconfig that runs a command or names a file is refused. Label the Secret
    /// `clusterctl.cluster.x-k8s.io/move: ""` so that `clusterctl move` takes it along (the
    /// controller adds the label too).
    pub kubeconfig_secret_ref: SecretReference,

    /// The namespace in the hosting cluster for this cluster's objects (it must exist; the
    /// controller does not create it). Defaults to the KVMCluster's namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 63))]
    #[x_kube(validation = Rule::new("self.size() <= 63 && self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$')").message("hostingCluster.namespace must be a namespace name: at most 63 lowercase letters, digits or '-', starting and ending with a letter or digit"))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("hostingCluster.namespace cannot be changed once set: the machines and the control-plane Service are where it says, and changing it would not move them"))]
    pub namespace: Option<String>,
}

/// A Secret in the referring object's namespace.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct SecretReference {
    /// The Secret's name.
    #[schemars(length(max = 253))]
    #[x_kube(validation = Rule::new("self.size() <= 253 && self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$')").message("kubeconfigSecretRef.name must be the name of a Secret in the KVMCluster's namespace (a lowercase DNS subdomain such as demo-hosting-kubeconfig)"))]
    pub name: String,
}

/// How the control-plane Service is exposed. On a KVMCluster, type, externalHost and nodePort
/// are fixed at creation (they make the control-plane endpoint), except that ClusterIP and
/// LoadBalancer may be swapped.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.?nodePort.orValue(0) == 0 || self.?type.orValue('ClusterIP') == 'NodePort'").message("nodePort is only for type NodePort"))]
pub struct ControlPlaneService {
    /// Service type: ClusterIP (default: reachable inside the management cluster), NodePort or
    /// LoadBalancer (both need `externalHost`).
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub type_: Option<ServiceType>,

    /// With type NodePort: the port on every management-cluster node, 30000-32767. 0 or absent:
    /// the management cluster allocates one. The control-plane endpoint's port is this node
    /// port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self == 0 || (self >= 30000 && self <= 32767)").message("nodePort must be in Kubernetes' node port range 30000-32767, or 0 for one the management cluster allocates"))]
    pub node_port: Option<i32>,

    /// Annotations put on the Service (for example for a load-balancer implementation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub annotations: Option<BTreeMap<String, String>>,

    /// A DNS name or IPv4 address that reaches the Service from outside the management cluster
    /// (and from the machines: they join through it), e.g. `mycluster.k8s.example.com`, a load
    /// balancer's address, or with type NodePort a name of the management cluster's nodes. The
    /// control-plane endpoint's host when the endpoint is empty, so the workload kubeconfig names
    /// it and kubeadm puts it in the apiserver certificate's SANs. Empty: unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    #[x_kube(validation = Rule::new("self == '' || self.size() <= 253 && self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$')").message("externalHost must be a lowercase DNS name such as mycluster.k8s.example.com, or an IPv4 address"))]
    pub external_host: Option<String>,
}

/// Kubernetes Service types the control-plane Service may use.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, schemars::JsonSchema,
)]
pub enum ServiceType {
    /// Reachable inside the management cluster only.
    #[default]
    ClusterIP,
    /// Also reachable on every management-cluster node's port.
    NodePort,
    /// Exposed through the management cluster's load-balancer implementation.
    LoadBalancer,
}

/// Observed state of a KVMCluster.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct KVMClusterStatus {
    /// The contract's fields: `initialization`, `ready`, `conditions`, `observedGeneration`.
    #[serde(flatten)]
    pub contract: ContractStatus,

    /// Failure domains available to machines (v1beta2 list form).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["name".into()]))]
    pub failure_domains: Option<Vec<FailureDomain>>,

    /// The management cluster's namespace of this cluster's machine Pods, Ignition Secrets,
    /// etcd PVCs and control-plane Service while it names no hosting cluster: the operator's
    /// machine namespace when the controller first saw the cluster, or this namespace for a
    /// cluster whose machines were already here. Kept for the cluster's life, so that changing
    /// the operator's setting never moves running VMs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub machine_namespace: Option<String>,
}

/// A template for KVMClusters, used by ClusterClass. Immutable, by the admission policy in
/// manifests/admission.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, KubeSchema)]
#[kube(
    group = "infrastructure.cluster.x-k8s.io",
    version = "v1alpha1",
    kind = "KVMClusterTemplate",
    doc = "KVMClusterTemplate stamps out KVMClusters for ClusterClass.",
    plural = "kvmclustertemplates",
    singular = "kvmclustertemplate",
    namespaced,
    category = "cluster-api",
    label("cluster.x-k8s.io/v1beta2", "v1alpha1"),
    label("cluster.x-k8s.io/provider", "infrastructure-kvm"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct KVMClusterTemplateSpec {
    /// The KVMCluster to stamp out.
    pub template: KVMClusterTemplateResource,
}

/// The object a KVMClusterTemplate produces.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct KVMClusterTemplateResource {
    /// Labels and annotations for the produced KVMCluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<super::TemplateMetadata>,
    /// Spec of the produced KVMCluster.
    pub spec: KVMClusterSpec,
}
