//! What the operator decides for every reconcile (command-line flags, read once): the namespace
//! to watch, the cluster domain, and the defaults of machine Pods. Plain values: the binary's
//! edge (clap) fills them, the reconcilers read them.

use capk_api::v1alpha1::{Accel, ServiceType};

/// Settings from the command line.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Watch one namespace only (clusterctl's `--namespace`), or all.
    pub namespace: Option<String>,
    /// DNS domain of the management cluster (`cluster.local`), for the endpoint's Service name.
    pub cluster_domain: String,
    /// Defaults for machine Pods (launcher image, volume sizes, ...).
    pub machine_defaults: MachineDefaults,
    /// Reconciles that run at once per kind.
    pub concurrency: u16,
    /// What a KVMMachine's author may reach past their namespace.
    pub tenant_policy: TenantPolicy,
    /// What one workload or hosting cluster may cost the controller.
    pub remote_limits: crate::remote::limits::RemoteLimits,
    /// Where new clusters' machine Pods live in the management cluster.
    pub machine_namespace: MachineNamespace,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            namespace: None,
            cluster_domain: "cluster.local".into(),
            machine_defaults: Default::default(),
            concurrency: 16,
            tenant_policy: TenantPolicy::default(),
            remote_limits: Default::default(),
            machine_namespace: MachineNamespace::Tenant,
        }
    }
}

pub use capk_api::constants::DEFAULT_MACHINE_NAMESPACE;

/// The placeholder of a per-tenant machine namespace: the KVMCluster's namespace.
pub const TENANT_PLACEHOLDER: &str = "{namespace}";

/// Where a KVMCluster without a hosting cluster gets its machine Pods, Ignition Secrets, etcd
/// PVCs and control-plane Service in the management cluster: the operator's choice, made for
/// a cluster once (`status.machineNamespace`), so that changing it never moves running VMs.
/// Outside the tenant's namespace, whoever may exec into or create Pods there gains nothing
/// on the node. [`Settings::default`] keeps the tenant's namespace (what embedding tests
/// expect); the binary's default is [`DEFAULT_MACHINE_NAMESPACE`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MachineNamespace {
    /// In the KVMCluster's own namespace (`--machine-namespace=`): its users may exec into the
    /// privileged machine Pods. An operator's opt-in.
    Tenant,
    /// One namespace for every tenant (`capk-machines`).
    Shared(String),
    /// One per tenant namespace: the template with [`TENANT_PLACEHOLDER`] replaced (cut and
    /// hashed to a DNS label when long). The operator makes each namespace and grants its
    /// tenant the console there.
    PerTenant(String),
}

/// A `--machine-namespace` that cannot name a namespace.
#[derive(Debug, thiserror::Error)]
#[error(
    "machine namespace {0:?} is not a namespace name (a DNS label: lowercase letters, digits, '-'), nor such a name with {TENANT_PLACEHOLDER} in it, nor empty"
)]
pub struct InvalidMachineNamespace(String);

impl std::str::FromStr for MachineNamespace {
    type Err = InvalidMachineNamespace;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        if s.is_empty() {
            return Ok(Self::Tenant);
        }
        let per_tenant = s.contains(TENANT_PLACEHOLDER);
        let sample = s.replace(TENANT_PLACEHOLDER, "a");
        let label =
            sample.len() <= 63 || per_tenant && sample.len() <= 63 + 63 + TENANT_PLACEHOLDER.len();
        let valid = label
            && sample
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !sample.starts_with('-')
            && !sample.ends_with('-');
        match (valid, per_tenant) {
            (false, _) => Err(InvalidMachineNamespace(s.to_owned())),
            (true, true) => Ok(Self::PerTenant(s.to_owned())),
            (true, false) => Ok(Self::Shared(s.to_owned())),
        }
    }
}

impl MachineNamespace {
    /// The machine namespace of a new cluster in `tenant`.
    pub fn of(&self, tenant: &str) -> String {
        match self {
            Self::Tenant => tenant.to_owned(),
            Self::Shared(ns) => ns.clone(),
            Self::PerTenant(template) => {
                let named = template.replace(TENANT_PLACEHOLDER, tenant);
                if named.len() <= 63 {
                    named
                } else {
                    capk_api::constants::bounded_name(&named, "", 63)
                }
            }
        }
    }
}

/// Where the etcd disks of `etcdStorage.type: hostPath` may live unless the operator says
/// otherwise: one directory the provider owns.
pub const DEFAULT_ETCD_HOST_PATH_PREFIX: &str = "/var/lib/capk/etcd";

/// What a KVMMachine's author (a tenant, who may create Cluster API objects in a namespace but
/// not privileged Pods) may reach on the management cluster's nodes through the machine Pod.
/// The operator's decision: everything past the tenant's VM is off unless listed here.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TenantPolicy {
    /// Directories of host volume shares, one subdirectory per namespace: a KVMMachine's
    /// `spec.hostVolumes[].hostPath` must be `<one of these>/<its namespace>` or below it.
    /// Empty (the default): no host volumes.
    pub host_volume_prefixes: Vec<String>,
    /// Host directories `spec.etcdStorage.hostPath` may name, and the only places an etcd
    /// cleanup Pod removes data from.
    pub etcd_host_path_prefixes: Vec<String>,
    /// Whether a toleration with no key (`operator: Exists`: every taint) is allowed: it puts a
    /// machine Pod on any node, control-plane and dedicated nodes included.
    pub allow_tolerate_all_taints: bool,
    /// Taint keys a machine Pod's tolerations may name ([`KeyPatterns`]): a toleration lets it
    /// onto nodes the operator keeps for other uses (control planes, dedicated, cordoned or
    /// failing nodes). Empty (the default): no keyed tolerations.
    pub toleration_keys: Vec<String>,
    /// Node label keys in the reserved namespaces (`kubernetes.io`, `k8s.io` and their
    /// subdomains: node roles, host names, zones, `node-restriction.kubernetes.io/`) that a
    /// machine's nodeSelector may name ([`KeyPatterns`]); other keys are always allowed. Empty
    /// (the default): none.
    pub node_selector_keys: Vec<String>,
    /// PriorityClasses a machine Pod may name: a high one preempts other tenants' machines and
    /// the cluster's own Pods. Empty (the default): none (the cluster's default priority).
    pub priority_classes: Vec<String>,
    /// Annotation keys a KVMCluster's control-plane Service may carry ([`KeyPatterns`]): add-ons
    /// of the management cluster (DNS, load balancers, tunnels) act on them for whoever wrote
    /// them. Empty (the default): none.
    pub service_annotation_keys: Vec<String>,
    /// Control-plane Service types a KVMCluster may ask for besides ClusterIP (always allowed):
    /// NodePort opens a port of the shared node-port range on every management-cluster node,
    /// LoadBalancer takes an address (perhaps a paid, public one) from the load-balancer
    /// implementation. Empty (the default): ClusterIP only.
    pub control_plane_service_types: Vec<ServiceType>,
}

impl Default for TenantPolicy {
    fn default() -> Self {
        Self {
            host_volume_prefixes: Vec::new(),
            etcd_host_path_prefixes: vec![DEFAULT_ETCD_HOST_PATH_PREFIX.into()],
            allow_tolerate_all_taints: false,
            toleration_keys: Vec::new(),
            node_selector_keys: Vec::new(),
            priority_classes: Vec::new(),
            service_annotation_keys: Vec::new(),
            control_plane_service_types: Vec::new(),
        }
    }
}

impl TenantPolicy {
    /// Whether a KVMCluster's control-plane Service may be of type `t`.
    pub fn allows_service_type(&self, t: ServiceType) -> bool {
        t == ServiceType::ClusterIP || self.control_plane_service_types.contains(&t)
    }

    /// Whether `path` is one of `prefixes` or below one, element by element (`/srv/data` does
    /// not cover `/srv/database`). `path` must already be absolute without `..` elements.
    pub fn allows(prefixes: &[String], path: &str) -> bool {
        let elements = |p: &str| -> Vec<String> {
            p.split('/')
                .filter(|e| !e.is_empty() && *e != ".")
                .map(str::to_owned)
                .collect()
        };
        if !path.starts_with('/') {
            return false;
        }
        let path = elements(path);
        prefixes
            .iter()
            .filter(|p| p.starts_with('/'))
            .any(|p| path.starts_with(&elements(p)))
    }

    /// The prefixes as a message lists them: `none` when empty.
    pub fn describe(prefixes: &[String]) -> String {
        if prefixes.is_empty() {
            "none".into()
        } else {
            prefixes.join(", ")
        }
    }
}

/// Keys an operator lists: a key as it is (`example.com/dedicated`), or a prefix ending in `/*`
/// that covers every key with that prefix (`metallb.universe.tf/*`).
pub struct KeyPatterns;

impl KeyPatterns {
    /// Whether `key` is one of `patterns` or covered by one.
    pub fn allows(patterns: &[String], key: &str) -> bool {
        patterns.iter().any(|p| match p.strip_suffix('*') {
            Some(prefix) if prefix.ends_with('/') => key.starts_with(prefix),
            _ => p == key,
        })
    }
}

/// Whether label key `key` is in a namespace Kubernetes reserves for its own components
/// (`kubernetes.io/`, `k8s.io/` and their subdomains): the labels the kubelet, the node
/// lifecycle and the operator's own tools set to say what a node is for.
pub fn is_reserved_label_key(key: &str) -> bool {
    key.split_once('/').is_some_and(|(prefix, _)| {
        ["kubernetes.io", "k8s.io"]
            .iter()
            .any(|d| prefix == *d || prefix.ends_with(&format!(".{d}")))
    })
}

/// The Flatcar release (stable channel) a KVMMachine without `spec.image` boots, unless the
/// operator pins another (`--default-flatcar-version`); the flavors' `FLATCAR_VERSION` default
/// is the same (a test holds them together).
pub const DEFAULT_FLATCAR_VERSION: &str = "4230.2.3";

/// Whether `version` is a concrete Flatcar release (`4230.2.3`: three numbers, no leading
/// zeros), not `current`, which would let machines made later boot another OS than their peers.
pub fn is_flatcar_release(version: &str) -> bool {
    let parts: Vec<&str> = version.split('.').collect();
    parts.len() == 3
        && parts.iter().all(|p| {
            !p.is_empty()
                && p.len() <= 9
                && p.bytes().all(|b| b.is_ascii_digit())
                && (*p == "0" || !p.starts_with('0'))
        })
}

/// Defaults for what a KVMMachine leaves out.
#[derive(Clone, Debug)]
pub struct MachineDefaults {
    /// The launcher container image (concrete tag).
    pub launcher_image: String,
    /// Flatcar release (stable channel) used when `spec.image` is absent: pinned, so a machine
    /// made months later boots what its peers boot.
    pub flatcar_version: String,
    /// A mirror of Flatcar's release servers (`<base>/<arch>/<version>/<file>`, one channel),
    /// for air-gapped management clusters; `None`: Flatcar's own servers.
    pub flatcar_base_url: Option<String>,
    /// Most bytes the node-image cache of an MC node may hold (also the most one download may
    /// hold); beyond it, least recently used images no machine uses are evicted.
    pub image_cache_bytes: u64,
    /// A container disk image used instead of Flatcar when `spec.image` is absent.
    pub default_node_image: Option<String>,
    /// containerd disk size when `dockerVolumeSize` is absent.
    pub docker_volume_bytes: u64,
    /// kubelet disk size when `kubeletVolumeSize` is absent.
    pub kubelet_volume_bytes: u64,
    /// etcd disk size for hostPath etcd storage.
    pub etcd_volume_bytes: u64,
    /// Require (not just prefer) control-plane Pods of a cluster on different MC nodes.
    pub require_control_plane_anti_affinity: bool,
    /// How container-image node images reach the Pod.
    pub node_image_source: NodeImageSource,
    /// vCPUs per requested core: 1 dedicates a core to each vCPU (Guaranteed QoS); N > 1
    /// requests 1/N core per vCPU and sets no CPU limit.
    pub cpu_allocation_ratio: u32,
    /// TCG translation cache of machines that may be emulated (`accel` auto or tcg), MiB,
    /// counted in their Pods' memory.
    pub tcg_translation_cache_mib: u32,
    /// Emulated machines run one host thread for all their vCPUs (`--tcg-threads=single`)
    /// instead of a thread per vCPU (the launcher's default).
    pub tcg_single_thread: bool,
    /// Whether machines may run emulated, and where KVM is looked for (`--kvm`).
    pub kvm: KvmPolicy,
    /// The node label (key, value) of MC nodes whose KVM works (`--kvm-node-label`): required
    /// or preferred by machine Pods that run (or would rather run) under KVM.
    pub kvm_node_label: (String, String),
}

impl MachineDefaults {
    /// The accelerator a machine whose spec says `accel` runs under, by the operator's
    /// [`KvmPolicy`]: under `require`, `auto` becomes `kvm` (the launcher fails rather than
    /// emulate). The KVMMachine validation refuses `tcg` there.
    pub fn accel(&self, accel: Option<Accel>) -> Accel {
        match (accel.unwrap_or_default(), self.kvm) {
            (Accel::Auto, KvmPolicy::Require) => Accel::Kvm,
            (accel, _) => accel,
        }
    }

    /// What the machine Pod of a machine running under `accel` asks of its node's label: that
    /// it has it (true) or would rather (false), or nothing.
    pub fn kvm_node(&self, accel: Accel) -> Option<bool> {
        match (self.kvm, accel) {
            (KvmPolicy::Allow, _) | (_, Accel::Tcg) => None,
            (_, Accel::Kvm) => Some(true),
            (KvmPolicy::Prefer, Accel::Auto) => Some(false),
            (KvmPolicy::Require, Accel::Auto) => Some(true),
        }
    }
}

/// Whether machines may run emulated (TCG), the operator's choice (`--kvm`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvmPolicy {
    /// Machine Pods run on any node; `accel: auto` falls back to TCG where KVM does not work
    /// (management clusters without KVM, nested or emulated ones). The default.
    #[default]
    Allow,
    /// As `allow`, but `accel: auto` machine Pods prefer nodes with the KVM label and
    /// `accel: kvm` ones require it.
    Prefer,
    /// Nothing runs emulated: `accel: auto` runs as `kvm`, every machine Pod requires a node
    /// with the KVM label (one without stays Pending, the scheduler's message in the
    /// KVMMachine's `PodScheduled` condition), `accel: tcg` is refused.
    Require,
}

impl KvmPolicy {
    /// Every policy's name, as `--kvm` takes it.
    pub const NAMES: [&'static str; 3] = ["allow", "prefer", "require"];
}

impl std::str::FromStr for KvmPolicy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "allow" => Ok(Self::Allow),
            "prefer" => Ok(Self::Prefer),
            "require" => Ok(Self::Require),
            other => Err(format!(
                "unknown KVM policy {other:?}; expected allow, prefer or require"
            )),
        }
    }
}

/// The default of `--kvm-node-label`.
pub const DEFAULT_KVM_NODE_LABEL: (&str, &str) = ("infrastructure.cluster.x-k8s.io/kvm", "true");

impl Default for MachineDefaults {
    fn default() -> Self {
        Self {
            launcher_image: "localhost/capk/capk-launcher:dev".into(),
            flatcar_version: DEFAULT_FLATCAR_VERSION.into(),
            flatcar_base_url: None,
            image_cache_bytes: 50 << 30,
            default_node_image: None,
            docker_volume_bytes: 10 << 30,
            kubelet_volume_bytes: 5 << 30,
            etcd_volume_bytes: 10 << 30,
            require_control_plane_anti_affinity: false,
            node_image_source: NodeImageSource::default(),
            cpu_allocation_ratio: 1,
            tcg_translation_cache_mib: 128,
            tcg_single_thread: false,
            kvm: KvmPolicy::default(),
            kvm_node_label: (
                DEFAULT_KVM_NODE_LABEL.0.into(),
                DEFAULT_KVM_NODE_LABEL.1.into(),
            ),
        }
    }
}

/// How machine Pods get a node image that is a container image (`spec.image.containerImage`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum NodeImageSource {
    /// An init container copies the disk once per MC node into the host cache
    /// (`/var/lib/capk/images`); works with every container runtime.
    #[default]
    HostCache,
    /// A Kubernetes image volume mounts the image read-only, no copy (needs the ImageVolume
    /// feature: Kubernetes 1.33+ and containerd 2.1+ or CRI-O 1.31+).
    ImageVolume,
}

impl NodeImageSource {
    /// Every source's name, as `--node-image-source` takes it.
    pub const NAMES: [&'static str; 2] = ["host-cache", "image-volume"];

    /// The source's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::HostCache => "host-cache",
            Self::ImageVolume => "image-volume",
        }
    }
}

/// A name that is not one of [`NodeImageSource::NAMES`].
#[derive(Debug, thiserror::Error)]
#[error("unknown node image source {0:?}; expected host-cache or image-volume")]
pub struct UnknownNodeImageSource(String);

impl std::str::FromStr for NodeImageSource {
    type Err = UnknownNodeImageSource;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "host-cache" => Ok(Self::HostCache),
            "image-volume" => Ok(Self::ImageVolume),
            other => Err(UnknownNodeImageSource(other.to_owned())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_machine_namespace_is_the_tenants_one_for_all_or_one_per_tenant() {
        let parse = |s: &str| s.parse::<MachineNamespace>();
        assert_eq!(parse("").unwrap().of("team-a"), "team-a");
        assert_eq!(
            parse("capk-machines").unwrap().of("team-a"),
            "capk-machines"
        );
        let per_tenant = parse("capk-{namespace}").unwrap();
        assert_eq!(per_tenant.of("team-a"), "capk-team-a");
        let long = per_tenant.of(&"t".repeat(63));
        assert!(long.len() <= 63 && long.starts_with("capk-ttt"), "{long}");
        assert_ne!(long, per_tenant.of(&format!("{}u", "t".repeat(62))));
        for bad in [
            "Capk",
            "capk_machines",
            "-capk",
            "capk/x",
            "{namespace}-",
            &"a".repeat(64),
        ] {
            let err = parse(bad).unwrap_err().to_string();
            assert!(err.contains("not a namespace name"), "{bad}: {err}");
        }
    }

    #[test]
    fn a_prefix_covers_itself_and_what_is_below_it_element_by_element() {
        let prefixes = vec!["/srv/data/".to_owned(), "/var/lib/capk/etcd".to_owned()];
        for ok in [
            "/srv/data",
            "/srv/data/",
            "/srv/data/a/b",
            "/var/lib/capk/etcd/team-a",
        ] {
            assert!(TenantPolicy::allows(&prefixes, ok), "{ok}");
        }
        for refused in [
            "/srv/database",
            "/srv",
            "/",
            "/var/lib/capk",
            "/etc",
            "srv/data",
        ] {
            assert!(!TenantPolicy::allows(&prefixes, refused), "{refused}");
        }
        assert!(!TenantPolicy::allows(&[], "/srv/data"));
        // `/` as a prefix is the operator's explicit choice: everything.
        assert!(TenantPolicy::allows(&["/".to_owned()], "/etc"));
        // A relative prefix covers nothing.
        assert!(!TenantPolicy::allows(&["srv".to_owned()], "/srv"));
    }

    #[test]
    fn a_key_pattern_covers_its_key_or_its_prefix() {
        let patterns = vec![
            "example.com/dedicated".to_owned(),
            "metallb.universe.tf/*".to_owned(),
        ];
        assert!(KeyPatterns::allows(&patterns, "example.com/dedicated"));
        assert!(KeyPatterns::allows(
            &patterns,
            "metallb.universe.tf/address-pool"
        ));
        assert!(!KeyPatterns::allows(&patterns, "example.com/dedicated-2"));
        assert!(!KeyPatterns::allows(&patterns, "metallb.universe.tfx/a"));
        assert!(!KeyPatterns::allows(&[], "example.com/dedicated"));
        // `*` alone is no prefix: it covers only a key named `*`, never every key.
        assert!(!KeyPatterns::allows(&["*".to_owned()], "a"));
    }

    #[test]
    fn reserved_label_keys_are_kubernetes_own() {
        for reserved in [
            "node-role.kubernetes.io/control-plane",
            "kubernetes.io/hostname",
            "topology.kubernetes.io/zone",
            "node-restriction.kubernetes.io/vm-host",
            "k8s.io/a",
        ] {
            assert!(is_reserved_label_key(reserved), "{reserved}");
        }
        for free in [
            "zone",
            "example.com/vm-host",
            "kubernetes.iox/a",
            "notk8s.io/a",
        ] {
            assert!(!is_reserved_label_key(free), "{free}");
        }
    }

    #[test]
    fn the_shipped_flatcar_defaults_are_the_pinned_release() {
        let flavor = include_str!("../../manifests/templates/cluster-template.yaml");
        let manager = include_str!("../../manifests/manager/manager.yaml");
        let version = format!("${{FLATCAR_VERSION:={DEFAULT_FLATCAR_VERSION}}}");
        assert_eq!(
            flavor.matches(&version).count(),
            2,
            "both machine templates"
        );
        let flag = format!(
            "--default-flatcar-version=${{CAPK_DEFAULT_FLATCAR_VERSION:={DEFAULT_FLATCAR_VERSION}}}"
        );
        assert!(manager.contains(&flag), "{flag}");
        assert_eq!(
            MachineDefaults::default().flatcar_version,
            DEFAULT_FLATCAR_VERSION
        );
    }

    #[test]
    fn every_node_image_source_name_parses_to_itself() {
        for name in NodeImageSource::NAMES {
            let source: NodeImageSource = name.parse().unwrap();
            assert_eq!(source.as_str(), name);
        }
        let err = "image-volumes".parse::<NodeImageSource>().unwrap_err();
        assert!(
            err.to_string().contains("host-cache or image-volume"),
            "{err}"
        );
    }
}
