//! KVMMachine and KVMMachineTemplate: one workload-cluster node = one VM in one machine Pod.
// Several `printcolumn(type_ = "string", ...)` entries are not duplicates.
#![allow(clippy::duplicated_attributes)]

use std::collections::BTreeMap;

use k8s_openapi::{api::core::v1::Toleration, apimachinery::pkg::api::resource::Quantity};
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use super::shared::{ContractStatus, MachineAddress};
use crate::{
    limits::{self, CelRule},
    quantity::SizeQuantity,
};

/// A CRD rule from one of [`limits`]' rules.
fn cel(r: CelRule) -> kube::core::Rule {
    kube::core::Rule::new(r.rule).message(kube::core::Message::Message(r.message))
}

/// The CEL rule that keeps a KVMMachine's spec as it was when its machine Pod was built. The
/// controller sets `providerID` right before it creates the Pod (and the spec's own rule forbids
/// changing it after), so from then on an edit would be accepted and silently ignored: refused.
/// Before, an edit is what the Pod will be built from (a spec the controller refused can be
/// fixed). Cluster API writes nothing in an InfraMachine's spec (it updates labels and
/// annotations); the controller writes only `providerID`. The rule sits on the KVMMachine, not
/// on its spec type, which KVMMachineTemplate embeds: a template must still take the topology
/// controller's dry run (manifests/admission). An optional field is compared after `has()` on
/// both sides: the apiserver estimates `self.spec.?f == oldSelf.spec.?f` above its CEL cost
/// budget. A test keeps the fields here equal to the spec's.
pub const SPEC_IMMUTABLE_RULE: &str = concat!(
    "!has(oldSelf.spec.providerID)",
    " || (self.spec.resources == oldSelf.spec.resources",
    " && has(self.spec.image) == has(oldSelf.spec.image)",
    " && (!has(self.spec.image) || self.spec.image == oldSelf.spec.image)",
    " && has(self.spec.dns) == has(oldSelf.spec.dns)",
    " && (!has(self.spec.dns) || self.spec.dns == oldSelf.spec.dns)",
    " && has(self.spec.ntp) == has(oldSelf.spec.ntp)",
    " && (!has(self.spec.ntp) || self.spec.ntp == oldSelf.spec.ntp)",
    " && has(self.spec.etcdStorage) == has(oldSelf.spec.etcdStorage)",
    " && (!has(self.spec.etcdStorage) || self.spec.etcdStorage == oldSelf.spec.etcdStorage)",
    " && has(self.spec.hostVolumes) == has(oldSelf.spec.hostVolumes)",
    " && (!has(self.spec.hostVolumes) || self.spec.hostVolumes == oldSelf.spec.hostVolumes)",
    " && has(self.spec.accel) == has(oldSelf.spec.accel)",
    " && (!has(self.spec.accel) || self.spec.accel == oldSelf.spec.accel)",
    " && has(self.spec.nodeSelector) == has(oldSelf.spec.nodeSelector)",
    " && (!has(self.spec.nodeSelector) || self.spec.nodeSelector == oldSelf.spec.nodeSelector)",
    " && has(self.spec.tolerations) == has(oldSelf.spec.tolerations)",
    " && (!has(self.spec.tolerations) || self.spec.tolerations == oldSelf.spec.tolerations)",
    " && has(self.spec.priorityClassName) == has(oldSelf.spec.priorityClassName)",
    " && (!has(self.spec.priorityClassName) || self.spec.priorityClassName == oldSelf.spec.priorityClassName))",
);

/// What the apiserver answers to an edit of a KVMMachine's spec.
pub const SPEC_IMMUTABLE_MESSAGE: &str = "KVMMachine spec cannot be changed once its machine Pod is built (spec.providerID is set): to resize or reconfigure machines, point the MachineDeployment or control plane at a new KVMMachineTemplate and Cluster API replaces them";

/// A workload-cluster node: a QEMU/KVM virtual machine running in a machine Pod of the
/// management cluster. The VM takes the Pod's IP and boots Flatcar Linux with the node's Ignition.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[kube(
    group = "infrastructure.cluster.x-k8s.io",
    version = "v1alpha1",
    kind = "KVMMachine",
    doc = "KVMMachine is one workload-cluster node: a QEMU/KVM virtual machine in a machine Pod of the management cluster.",
    plural = "kvmmachines",
    singular = "kvmmachine",
    namespaced,
    status = "KVMMachineStatus",
    category = "cluster-api",
    shortname = "kvmm",
    label("cluster.x-k8s.io/v1beta2", "v1alpha1"),
    label("cluster.x-k8s.io/provider", "infrastructure-kvm"),
    validation = Rule::new(SPEC_IMMUTABLE_RULE).message(SPEC_IMMUTABLE_MESSAGE),
    printcolumn(
        name = "Cluster",
        type_ = "string",
        json_path = ".metadata.labels['cluster\\.x-k8s\\.io/cluster-name']",
        description = "Cluster to which this KVMMachine belongs"
    ),
    printcolumn(
        name = "Provisioned",
        type_ = "boolean",
        json_path = ".status.initialization.provisioned",
        description = "Whether the VM is provisioned"
    ),
    printcolumn(
        name = "ProviderID",
        type_ = "string",
        json_path = ".spec.providerID",
        description = "Provider ID the Node carries"
    ),
    printcolumn(
        name = "Pod Namespace",
        type_ = "string",
        json_path = ".status.podNamespace",
        description = "Namespace of the machine Pod",
        priority = 1
    ),
    printcolumn(
        name = "Pod",
        type_ = "string",
        json_path = ".status.podName",
        description = "Machine Pod running the VM"
    ),
    printcolumn(
        name = "IP",
        type_ = "string",
        json_path = ".status.addresses[?(@.type==\"InternalIP\")].address",
        description = "The VM's (Pod's) IP"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(oldSelf.providerID) || (has(self.providerID) && self.providerID == oldSelf.providerID)").message("providerID cannot be changed once set"))]
pub struct KVMMachineSpec {
    /// Set by the controller to `kvm://<namespace>/<kvmmachine>`; the Node carries the same.
    #[serde(
        rename = "providerID",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(length(max = 512))]
    pub provider_id: Option<String>,

    /// Size of the VM.
    pub resources: MachineResources,

    /// The node image the VM boots. Default: Flatcar from the `stable` channel at the version
    /// the controller is configured with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<NodeImage>,

    /// DNS for the guest. Default: the machine Pod's resolv.conf.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dns: Option<DnsConfig>,

    /// NTP for the guest. Default: none (the guest keeps its own defaults disabled).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ntp: Option<NtpConfig>,

    /// Where a control-plane machine keeps its etcd data; survives Pod restarts and
    /// replacements. Only used on control-plane machines.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etcd_storage: Option<EtcdStorage>,

    /// Host directories shared into worker VMs (virtio-9p), mounted at `/data/<mountTag>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["mountTag".into()]))]
    #[schemars(length(max = 16))]
    pub host_volumes: Option<Vec<HostVolume>>,

    /// Hardware acceleration: `auto` (default) uses KVM when a test guest instruction runs under
    /// it and falls back to software emulation (TCG) with a warning; `kvm` fails when KVM does
    /// not work; `tcg` always emulates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accel: Option<Accel>,

    /// Node selector for the machine Pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<BTreeMap<String, String>>,

    /// Tolerations for the machine Pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tolerations: Option<Vec<Toleration>>,

    /// PriorityClass of the machine Pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub priority_class_name: Option<String>,
}

/// VM size, in the RFC's field names.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct MachineResources {
    /// Number of vCPUs (1 to 255, what the launcher runs).
    #[x_kube(validation = cel(limits::cpu_min_rule()))]
    #[x_kube(validation = cel(limits::cpu_max_rule()))]
    pub cpu: i32,

    /// VM memory, at least 256Mi (e.g. `1Gi`).
    #[x_kube(validation = cel(limits::memory_rule()))]
    pub memory: SizeQuantity,

    /// Root disk size: the qcow2 overlay on the node image is grown to this (at least 1Gi).
    #[x_kube(validation = cel(limits::disk_rule()))]
    pub disk: SizeQuantity,

    /// Size of the container runtime's disk (`/var/lib/containerd`). The name is the RFC's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("isQuantity(string(self)) && quantity(string(self)).isGreaterThan(quantity('0'))").message("dockerVolumeSize must be a positive quantity, e.g. 5Gi"))]
    pub docker_volume_size: Option<SizeQuantity>,

    /// Size of the kubelet's disk (`/var/lib/kubelet`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("isQuantity(string(self)) && quantity(string(self)).isGreaterThan(quantity('0'))").message("kubeletVolumeSize must be a positive quantity, e.g. 5Gi"))]
    pub kubelet_volume_size: Option<SizeQuantity>,
}

/// The node image: exactly one source.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("[has(self.flatcar), has(self.containerImage), has(self.url)].exists_one(x, x)").message("image needs exactly one of flatcar, containerImage or url"))]
pub struct NodeImage {
    /// A Flatcar release (channel + version).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flatcar: Option<FlatcarImage>,
    /// A container image that holds the disk image file; copied once per MC node into a cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container_image: Option<ContainerDiskImage>,
    /// An http(s) URL of a qcow2 or raw disk image, checked against its sha256.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<UrlImage>,
}

/// A Flatcar Container Linux release.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct FlatcarImage {
    /// Release channel.
    pub channel: FlatcarChannel,
    /// Release version such as `4230.2.3`: a pinned release, so that machines made later boot
    /// what their peers boot (a moving name such as `current` is refused).
    #[schemars(length(max = 64))]
    #[x_kube(validation = Rule::new("self.matches('^[0-9]+\\\\.[0-9]+\\\\.[0-9]+$')").message("flatcar.version must be a pinned release such as 4230.2.3 ('current' would boot a different release in machines made later)"))]
    pub version: String,
}

/// Flatcar release channels.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum FlatcarChannel {
    /// Stable.
    Stable,
    /// Beta.
    Beta,
    /// Alpha.
    Alpha,
    /// Long-term support.
    Lts,
}

/// A disk image shipped inside a container image.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct ContainerDiskImage {
    /// The container image reference, with a concrete tag or digest.
    #[schemars(length(min = 1, max = 512))]
    pub image: String,
    /// Path of the disk file inside the image. Default: `/disk/image.qcow2`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 4096))]
    #[x_kube(validation = Rule::new("self.startsWith('/')").message("containerImage.path must be an absolute path"))]
    pub path: Option<String>,
}

/// A disk image fetched over http(s).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct UrlImage {
    /// http:// or https:// URL of the image.
    #[schemars(length(max = 2048))]
    #[x_kube(validation = Rule::new("self.startsWith('https://') || self.startsWith('http://')").message("url must start with http:// or https://"))]
    pub url: String,
    /// Expected sha256 of the file, 64 lowercase hex digits.
    #[schemars(length(max = 64))]
    #[x_kube(validation = Rule::new("self.matches('^[a-f0-9]{64}$')").message("sha256 must be 64 lowercase hex digits"))]
    pub sha256: String,
}

/// DNS settings for the guest.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct DnsConfig {
    /// Name server IPv4 addresses (at most 3, the resolver's limit; the guest gets them by
    /// DHCPv4, which carries IPv4 only).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 3))]
    #[x_kube(validation = Rule::new("self.all(s, isIP(s) && ip(s).family() == 4)").message("dns.servers must be IPv4 addresses (the guest gets its DNS servers by DHCPv4)"))]
    pub servers: Vec<BoundedString>,
    /// Search domains.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub searches: Vec<BoundedString>,
}

/// NTP settings for the guest.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct NtpConfig {
    /// NTP server names or addresses.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub servers: Vec<BoundedString>,
}

/// A DNS name or an address: a string of at most 253 characters.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Hash)]
#[serde(transparent)]
pub struct BoundedString(pub String);

impl From<&str> for BoundedString {
    fn from(s: &str) -> Self {
        Self(s.to_owned())
    }
}

impl schemars::JsonSchema for BoundedString {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "BoundedString".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({"type": "string", "maxLength": 253})
    }
}

/// Where etcd data lives.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.type != 'hostPath' || has(self.hostPath)").message("etcdStorage.hostPath is required when type is hostPath"))]
#[x_kube(validation = Rule::new("self.type != 'hostPath' || (!has(self.storageClassName) && !has(self.size))").message("etcdStorage.storageClassName and size apply only to type persistentVolume"))]
#[x_kube(validation = Rule::new("self.type != 'persistentVolume' || has(self.size)").message("etcdStorage.size is required when type is persistentVolume"))]
#[x_kube(validation = Rule::new("self.type != 'persistentVolume' || !has(self.hostPath)").message("etcdStorage.hostPath applies only to type hostPath"))]
pub struct EtcdStorage {
    /// `hostPath` (a directory on the MC node) or `persistentVolume` (a PVC per machine).
    #[serde(rename = "type")]
    pub type_: EtcdStorageType,
    /// Directory on the MC node holding the etcd disk file (type hostPath): one of the
    /// directories the operator allows etcd data under (the controller's
    /// `--allowed-etcd-host-paths`, default `/var/lib/capk/etcd`). Each machine gets
    /// `<hostPath>/<namespace>/<name>` below it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 4096))]
    #[x_kube(validation = Rule::new("self.startsWith('/')").message("etcdStorage.hostPath must be an absolute path"))]
    pub host_path: Option<String>,
    /// StorageClass of the PVC (type persistentVolume). Default: the cluster's default class.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub storage_class_name: Option<String>,
    /// Size of the PVC and of the etcd disk (type persistentVolume).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("isQuantity(string(self)) && quantity(string(self)).isGreaterThan(quantity('0'))").message("etcdStorage.size must be a positive quantity, e.g. 10Gi"))]
    pub size: Option<SizeQuantity>,
}

/// Kinds of etcd storage.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum EtcdStorageType {
    /// A directory on the management-cluster node.
    HostPath,
    /// A PersistentVolumeClaim created per machine.
    PersistentVolume,
}

/// A host directory shared into the VM.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct HostVolume {
    /// virtio-9p mount tag: 1-31 letters, digits, '_' or '-'; the guest mounts it at
    /// `/data/<mountTag>`.
    #[schemars(length(max = 64))]
    #[x_kube(validation = Rule::new(crate::mount_tag::CEL_RULE).message(crate::mount_tag::CEL_MESSAGE))]
    pub mount_tag: String,
    /// Absolute path of the directory on the MC node: in this namespace's share,
    /// `<dir>/<namespace>` for one of the directories the operator allows host volumes in (the
    /// controller's `--allowed-host-volume-paths`; none by default). No element below the
    /// share may be a symbolic link.
    #[schemars(length(max = 4096))]
    #[x_kube(validation = Rule::new("self.startsWith('/')").message("hostVolumes.hostPath must be an absolute path"))]
    pub host_path: String,
    /// Share the directory read-only: the machine Pod mounts it read-only and the VM gets a
    /// read-only 9p export.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_only: Option<bool>,
}

/// Hardware acceleration choice.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Accel {
    /// KVM when it really runs a guest, else TCG with a warning.
    #[default]
    Auto,
    /// KVM only; fail when it does not work.
    Kvm,
    /// Software emulation only.
    Tcg,
}

/// Observed state of a KVMMachine.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct KVMMachineStatus {
    /// The contract's fields: `initialization`, `ready`, `conditions`, `observedGeneration`.
    #[serde(flatten)]
    pub contract: ContractStatus,

    /// Addresses of the machine (InternalIP = the Pod's IP, Hostname = the node name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub addresses: Option<Vec<MachineAddress>>,

    /// The failure domain the machine Pod was placed in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_domain: Option<String>,

    /// Namespace of the machine Pod (in the hosting cluster when the KVMCluster names one):
    /// `kubectl -n <podNamespace> logs <podName>` shows the guest's console.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_namespace: Option<String>,

    /// Name of the machine Pod running the VM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_name: Option<String>,

    /// Where the machine Pod keeps its etcd disk on an MC node (`etcdStorage.type: hostPath`),
    /// recorded by the controller from the Pod: the only record the etcd cleanup trusts, since
    /// the spec's author cannot write status.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etcd_host_dir: Option<EtcdHostDirStatus>,
}

/// A directory on a management-cluster node.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct EtcdHostDirStatus {
    /// The node's name.
    #[schemars(length(max = 253))]
    pub node: String,
    /// The directory's absolute path on that node.
    #[schemars(length(max = 4096))]
    pub path: String,
    /// The KVMMachine UID the machine Pod marked the directory with (its `--etcd-owner`): this
    /// KVMMachine's, or, after `clusterctl move` made the KVMMachine again, the one its Pod was
    /// first made for. Pods made again and the cleanup name the same.
    #[serde(default, rename = "ownerUID", skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 128))]
    pub owner_uid: Option<String>,
}

/// A template for KVMMachines (used by KubeadmControlPlane and MachineDeployments). Immutable:
/// roll out a change by creating a new template and pointing the owner at it. The admission
/// policy in manifests/admission enforces it, not a CRD rule: only it can let Cluster API's
/// topology dry run through.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[kube(
    group = "infrastructure.cluster.x-k8s.io",
    version = "v1alpha1",
    kind = "KVMMachineTemplate",
    doc = "KVMMachineTemplate stamps out KVMMachines for control planes and MachineDeployments; it is immutable.",
    plural = "kvmmachinetemplates",
    singular = "kvmmachinetemplate",
    namespaced,
    status = "KVMMachineTemplateStatus",
    category = "cluster-api",
    shortname = "kvmmt",
    label("cluster.x-k8s.io/v1beta2", "v1alpha1"),
    label("cluster.x-k8s.io/provider", "infrastructure-kvm"),
    printcolumn(
        name = "CPU",
        type_ = "integer",
        json_path = ".spec.template.spec.resources.cpu",
        description = "vCPUs per machine"
    ),
    printcolumn(
        name = "Memory",
        type_ = "string",
        json_path = ".spec.template.spec.resources.memory",
        description = "Memory per machine"
    ),
    printcolumn(
        name = "Disk",
        type_ = "string",
        json_path = ".spec.template.spec.resources.disk",
        description = "Root disk per machine"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct KVMMachineTemplateSpec {
    /// The KVMMachine to stamp out.
    pub template: KVMMachineTemplateResource,
}

/// The object a KVMMachineTemplate produces.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct KVMMachineTemplateResource {
    /// Labels and annotations for the produced KVMMachine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<super::TemplateMetadata>,
    /// Spec of the produced KVMMachine.
    pub spec: KVMMachineSpec,
}

/// Observed state of a KVMMachineTemplate: what the autoscaler needs to scale from zero.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct KVMMachineTemplateStatus {
    /// Resources a node from this template has (`cpu`, `memory`, `ephemeral-storage`: the disk
    /// holding the kubelet's directory), written by the controller.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<BTreeMap<String, Quantity>>,
    /// Architecture and operating system of nodes from this template (`amd64`, `linux`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_info: Option<NodeInfo>,
}

/// Node facts for scale-from-zero.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeInfo {
    /// `amd64` or `arm64`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub architecture: Option<String>,
    /// `linux`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operating_system: Option<String>,
}

#[cfg(test)]
mod tests {
    use kube::CustomResourceExt;

    use super::*;

    /// The CEL rules (rule, message) on `spec.resources.<field>` of a KVMMachine.
    fn resource_rules(field: &str) -> Vec<CelRule> {
        let crd = serde_json::to_value(KVMMachine::crd()).unwrap();
        let f = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
            ["resources"]["properties"][field];
        f["x-kubernetes-validations"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| CelRule {
                rule: r["rule"].as_str().unwrap().to_owned(),
                message: r["message"].as_str().unwrap().to_owned(),
            })
            .collect()
    }

    /// Every field of a KVMMachine's spec but `providerID` is held by [`SPEC_IMMUTABLE_RULE`]:
    /// a field added later without it would be silently mutable again.
    #[test]
    fn the_immutability_rule_names_every_spec_field_but_provider_id() {
        let crd = serde_json::to_value(KVMMachine::crd()).unwrap();
        let spec = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"];
        let fields: Vec<&String> = spec["properties"]
            .as_object()
            .unwrap()
            .keys()
            .filter(|k| *k != "providerID")
            .collect();
        assert!(fields.len() >= 10, "{fields:?}");
        for f in fields {
            let held = SPEC_IMMUTABLE_RULE.contains(&format!("self.spec.{f} == oldSelf.spec.{f}"));
            assert!(held, "spec.{f} is missing from SPEC_IMMUTABLE_RULE");
        }
        // providerID itself is only the condition: set, the spec is frozen.
        assert!(SPEC_IMMUTABLE_RULE.starts_with("!has(oldSelf.spec.providerID) || ("));
        assert_eq!(SPEC_IMMUTABLE_RULE.matches("providerID").count(), 1);
        let root = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
        let rules: Vec<&str> = root["x-kubernetes-validations"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|r| r["rule"].as_str())
            .collect();
        assert!(rules.contains(&SPEC_IMMUTABLE_RULE), "{rules:?}");
    }

    /// The CRD bounds a machine's resources with the rules of [`limits`], which the controller
    /// and the launcher check too.
    #[test]
    fn the_crds_resource_bounds_are_the_shared_limits() {
        assert_eq!(
            resource_rules("cpu"),
            [limits::cpu_min_rule(), limits::cpu_max_rule()]
        );
        assert_eq!(resource_rules("memory"), [limits::memory_rule()]);
        assert_eq!(resource_rules("disk"), [limits::disk_rule()]);
    }
}
