//! Names shared by the controller, the launcher and the manifests: labels, annotations,
//! finalizers and condition types.

/// API group of the KVM kinds.
pub const GROUP: &str = "infrastructure.cluster.x-k8s.io";
/// API version of the KVM kinds.
pub const VERSION: &str = "v1alpha1";

/// CRD label naming the CAPI contract and the versions of ours that implement it.
pub const CAPI_CONTRACT_LABEL: &str = "cluster.x-k8s.io/v1beta2";
/// Our versions that implement the contract, joined by `_`.
pub const CONTRACT_VERSIONS: &str = "v1alpha1";
/// Label clusterctl uses to find a provider's objects.
pub const PROVIDER_LABEL: &str = "cluster.x-k8s.io/provider";
/// This provider's name in clusterctl.
pub const PROVIDER_NAME: &str = "infrastructure-kvm";

/// Label naming the Cluster an object belongs to (set by CAPI and by us on our objects).
pub const CLUSTER_NAME_LABEL: &str = "cluster.x-k8s.io/cluster-name";
/// Label present (empty value) on control-plane Machines.
pub const CONTROL_PLANE_LABEL: &str = "cluster.x-k8s.io/control-plane";
/// Annotation pausing reconciliation of one object.
pub const PAUSED_ANNOTATION: &str = "cluster.x-k8s.io/paused";

/// Finalizer on KVMClusters.
pub const KVMCLUSTER_FINALIZER: &str = "kvmcluster.infrastructure.cluster.x-k8s.io";
/// Annotation on a machine's Ignition Secret: the bootstrap data Secret and resourceVersion it
/// was rendered from, and the controller version that rendered it. While they match, the
/// bootstrap data is neither read nor converted again.
pub const RENDERED_FROM_ANNOTATION: &str = "infrastructure.cluster.x-k8s.io/rendered-from";
/// clusterctl's annotation that holds `clusterctl move` back while an object is mid-creation.
pub const BLOCK_MOVE_ANNOTATION: &str = "clusterctl.cluster.x-k8s.io/block-move";
/// Finalizer on KVMMachines.
pub const KVMMACHINE_FINALIZER: &str = "kvmmachine.infrastructure.cluster.x-k8s.io";
/// Annotation on a KVMMachine: where its machine Pod kept the etcd disk, `<node>:<directory>`.
pub const ETCD_HOST_DIR_ANNOTATION: &str = "infrastructure.cluster.x-k8s.io/etcd-host-dir";
/// Annotation on an etcd cleanup Pod: which attempt it is (1, 2, ...).
pub const ETCD_CLEANUP_ATTEMPT_ANNOTATION: &str =
    "infrastructure.cluster.x-k8s.io/etcd-cleanup-attempt";
/// Annotation on an etcd cleanup Pod: when the first attempt was made (RFC 3339).
pub const ETCD_CLEANUP_SINCE_ANNOTATION: &str =
    "infrastructure.cluster.x-k8s.io/etcd-cleanup-since";

/// Pod readiness gate the controller sets from the workload cluster Node's Ready condition.
pub const NODE_READY_GATE: &str = "infrastructure.cluster.x-k8s.io/node-ready";
/// The name of the machine Pod's etcd volume: the controller's Pod builder, its etcd data cleanup
/// and its cache of machine Pods (which keeps only that volume of a Pod's spec) agree on it.
pub const ETCD_VOLUME: &str = "etcd";

/// Condition: the object is fully reconciled and usable.
pub const CONDITION_READY: &str = "Ready";
/// Condition: reconciliation is paused.
pub const CONDITION_PAUSED: &str = "Paused";
/// Condition: the machine Pod is scheduled to a node of the management cluster.
pub const CONDITION_POD_SCHEDULED: &str = "PodScheduled";
/// Condition: the launcher runs the VM (the machine Pod's container is running).
pub const CONDITION_VM_RUNNING: &str = "VMRunning";
/// Condition: the guest wrote the bootstrap success file.
pub const CONDITION_BOOTSTRAP_COMPLETED: &str = "BootstrapCompleted";
/// Condition: the machine's Node in the workload cluster is Ready (what the machine Pod's
/// readiness gate says, with its reason: a refused workload kubeconfig shows here).
pub const CONDITION_NODE_READY: &str = "NodeReady";
/// Condition on a KVMCluster: some control-plane machine's apiserver answers `/readyz`, so the
/// control-plane Service has a ready endpoint (the message says how many of how many answer).
pub const CONDITION_CONTROL_PLANE_ENDPOINTS_READY: &str = "ControlPlaneEndpointsReady";
/// Condition on a KVMCluster and its KVMMachines: the cluster where their objects live (the
/// management cluster, or the hosting cluster named by `spec.hostingCluster`) can be reached.
pub const CONDITION_HOSTING_CLUSTER_AVAILABLE: &str = "HostingClusterAvailable";
/// `endpointslice.kubernetes.io/managed-by` of the control-plane Service's EndpointSlice: the
/// controller, not Kubernetes' EndpointSlice controller, decides its endpoints.
pub const ENDPOINT_SLICE_MANAGED_BY: &str = "capk-controller.infrastructure.cluster.x-k8s.io";

/// Scheme of provider IDs: `kvm://<namespace>/<kvmmachine>`.
pub const PROVIDER_ID_SCHEME: &str = "kvm://";

/// The provider ID of a KVMMachine.
pub fn provider_id(namespace: &str, kvm_machine: &str) -> String {
    format!("{PROVIDER_ID_SCHEME}{namespace}/{kvm_machine}")
}

/// Label on machine Pods: `control-plane` or `worker`. The Pods with `control-plane` are the
/// control-plane Service's endpoints.
pub const MACHINE_ROLE_LABEL: &str = "infrastructure.cluster.x-k8s.io/machine-role";
/// Value of [`MACHINE_ROLE_LABEL`] on control-plane machine Pods.
pub const ROLE_CONTROL_PLANE: &str = "control-plane";
/// Value of [`MACHINE_ROLE_LABEL`] on worker machine Pods.
pub const ROLE_WORKER: &str = "worker";
/// Label on every object the controller makes (machine Pods, Ignition Secrets, PVCs, the
/// control-plane Service and its EndpointSlice): the namespace, in the management cluster, of
/// the KVMMachine or KVMCluster it belongs to. With the kind's own label
/// ([`KVMMACHINE_LABEL`], [`KVMCLUSTER_LABEL`]) it names the owner: objects in a
/// hosting cluster cannot carry owner references to it, and are adopted by these labels.
pub const OWNER_NAMESPACE_LABEL: &str = "infrastructure.cluster.x-k8s.io/owner-namespace";
/// Label on a machine's objects (Pod, Ignition Secret, PVC) naming their KVMMachine (its name,
/// cut and hashed when longer than a label value may be).
pub const KVMMACHINE_LABEL: &str = "infrastructure.cluster.x-k8s.io/kvmmachine";
/// Label naming the UID of the KVMMachine or KVMCluster that made or last adopted the object
/// (a moved object has a new UID; adoption is by namespace and name, and updates this label).
pub const OWNER_UID_LABEL: &str = "infrastructure.cluster.x-k8s.io/owner-uid";
/// Label on the control-plane Service and its EndpointSlice naming their KVMCluster (its name,
/// cut and hashed when longer than a label value may be).
pub const KVMCLUSTER_LABEL: &str = "infrastructure.cluster.x-k8s.io/kvmcluster";
/// clusterctl's label for objects `clusterctl move` takes along although no owner reference
/// leads to them, such as a hosting cluster's kubeconfig Secret.
pub const MOVE_LABEL: &str = "clusterctl.cluster.x-k8s.io/move";
/// Key of the kubeconfig in a hosting cluster's kubeconfig Secret (Cluster API's convention).
pub const HOSTING_KUBECONFIG_KEY: &str = "value";
/// `app.kubernetes.io/managed-by` value on every object the controller creates.
pub const MANAGED_BY: &str = "capk-controller";

/// The namespace of the management cluster where clusters' machine Pods live unless the operator
/// says otherwise (the controller's `--machine-namespace`, `CAPK_MACHINE_NAMESPACE`).
pub const DEFAULT_MACHINE_NAMESPACE: &str = "capk-machines";
/// Port of the workload cluster's API server (on the VMs and on the control-plane Service).
pub const API_SERVER_PORT: i32 = 6443;

/// Longest label value, DNS label (a hostname, a Service name).
pub const MAX_LABEL_LEN: usize = 63;
/// Longest DNS subdomain (the name of a Pod, Secret or PVC).
pub const MAX_SUBDOMAIN_LEN: usize = 253;

/// Name of the control-plane Service of a cluster: `<cluster>-apiserver`, cut and hashed
/// ([`bounded_name`]) when that is longer than a Service name may be (a DNS label).
pub fn control_plane_service_name(cluster: &str) -> String {
    bounded_name(cluster, "-apiserver", MAX_LABEL_LEN)
}

/// A stable 10-hex-digit hash of `s`: FNV-1a (64 bit), the same in every release, which a
/// name derived from it must be.
pub fn name_hash(s: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in s.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{:010x}", h >> 24)
}

/// `<base><suffix>` when it fits in `max` bytes. Otherwise `base` is cut, and ended by `-` and
/// [`name_hash`] of `base`, so that `<cut>-<hash><suffix>` fits: stable, and two long bases
/// that share a prefix still give two names. The cut ends in a letter or digit, so the result is
/// a valid name or label value whenever `base` is one.
pub fn bounded_name(base: &str, suffix: &str, max: usize) -> String {
    if base.len() + suffix.len() <= max {
        return format!("{base}{suffix}");
    }
    let hash = name_hash(base);
    let keep = max.saturating_sub(suffix.len() + hash.len() + 1);
    let mut end = keep.min(base.len());
    while !base.is_char_boundary(end) {
        end -= 1;
    }
    let cut = base[..end].trim_end_matches(|c: char| !c.is_ascii_alphanumeric());
    if cut.is_empty() {
        format!("{hash}{suffix}")
    } else {
        format!("{cut}-{hash}{suffix}")
    }
}
