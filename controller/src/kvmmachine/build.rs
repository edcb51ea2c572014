//! Pure: from a KVMMachine and its Machine to the desired machine Pod and Ignition Secret.
//!
//! The Pod runs `capk-launcher run` as PID 1 with the machine's settings as flags. The Ignition
//! (which carries bootstrap tokens) is only ever a file from a Secret volume, mode 0400: never
//! an argument or an environment variable.

use std::collections::BTreeMap;

use capk_api::{
    constants::{
        CLUSTER_NAME_LABEL, MACHINE_ROLE_LABEL, NODE_READY_GATE, ROLE_CONTROL_PLANE, ROLE_WORKER,
    },
    quantity::QuantityError,
    v1alpha1::{Accel, ContainerDiskImage, EtcdStorageType, FlatcarChannel, KVMMachine},
};
use k8s_openapi::{
    ByteString,
    api::core::v1::{
        Affinity, Container, EmptyDirVolumeSource, ExecAction, HostPathVolumeSource,
        ImageVolumeSource, NodeAffinity, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm,
        PersistentVolumeClaim, PersistentVolumeClaimSpec, PersistentVolumeClaimVolumeSource, Pod,
        PodAffinityTerm, PodAntiAffinity, PodReadinessGate, PodSpec, Probe, ResourceRequirements,
        Secret, SecretVolumeSource, SecurityContext, Volume, VolumeMount,
        VolumeResourceRequirements, WeightedPodAffinityTerm,
    },
    apimachinery::pkg::{
        api::resource::Quantity,
        apis::meta::v1::{LabelSelector, ObjectMeta},
    },
};
use kube::Resource;

use crate::kvmcluster::build::owned_labels;
pub use crate::settings::{MachineDefaults, NodeImageSource};

/// Label on machine Pods and Secrets naming their KVMMachine.
pub const KVMMACHINE_LABEL: &str = "infrastructure.cluster.x-k8s.io/kvmmachine";
/// Key of the Ignition config in the machine's Ignition Secret.
pub const IGNITION_KEY: &str = "config.ign";
/// Where the Ignition Secret is mounted in the machine Pod.
pub const IGNITION_DIR: &str = "/etc/capk/ignition";
/// Where the VM disks live in the Pod (an emptyDir: survives container restarts).
pub const STATE_DIR: &str = "/var/lib/capk/state";
/// Where the node image is mounted read-only.
pub const IMAGE_DIR: &str = "/var/lib/capk/image";
/// Where the etcd disk's directory is mounted (control plane).
pub const ETCD_DIR: &str = "/var/lib/capk/etcd";
/// Host directory where MC nodes keep node images (Flatcar releases and URL downloads).
pub const HOST_IMAGE_CACHE: &str = "/var/lib/capk/images";
/// Default path of the disk file inside a node-image container image.
pub const DEFAULT_CONTAINER_DISK_PATH: &str = "/disk/image.qcow2";
/// Where the machine Pod's init containers keep the launcher image's static busybox.
pub const TOOLS_DIR: &str = "/var/lib/capk/tools";
/// The node-image link the `node-image` init container leaves in the state directory (host
/// cache mode): it points at the cached copy in [`IMAGE_DIR`].
pub const NODE_IMAGE_LINK: &str = "/var/lib/capk/state/node-image";
/// What the `node-image` init container runs (host-cache mode), with the static busybox the
/// `tools` init container copied out of the launcher image, so node images need nothing but the
/// disk file. Arguments: busybox, disk file in the node image, cache directory, link to write.
///
/// The copy is named by the sha256 of the disk's content and written under a temporary name,
/// then renamed: a half-copied file is never used, whatever happens. A lock directory on the
/// cache (busybox has no `flock`; `mkdir` is atomic) makes machine Pods that start together on
/// one MC node copy once; a lock left by a Pod killed mid-copy is broken after 15 minutes.
pub const NODE_IMAGE_SCRIPT: &str = r#"set -eu
bb=$1 src=$2 cache=$3 link=$4
[ -f "$src" ] || { echo "node image: $src is not in the node image" >&2; exit 1; }
sum=$("$bb" sha256sum "$src" | "$bb" cut -d' ' -f1)
dst="$cache/sha256-$sum.img"
lock="$cache/.lock"
until "$bb" mkdir "$lock" 2>/dev/null; do
  if [ -n "$("$bb" find "$lock" -maxdepth 0 -mmin +15 2>/dev/null)" ]; then
    echo "node image: breaking a lock older than 15 minutes" >&2
    "$bb" rmdir "$lock" 2>/dev/null || true
  fi
  "$bb" sleep 1
done
trap '"$bb" rmdir "$lock" 2>/dev/null || true' EXIT
if [ -f "$dst" ]; then
  echo "node image: $src is cached as $dst"
else
  "$bb" cp "$src" "$dst.partial.$$"
  "$bb" mv "$dst.partial.$$" "$dst"
  echo "node image: copied $src to $dst"
fi
"$bb" ln -sfn "$dst" "$link"
"#;

/// Seconds the launcher gives the guest for an ACPI shutdown before killing QEMU.
pub const GUEST_SHUTDOWN_SECONDS: i64 = 300;

/// Pod resources beyond the VM's own: QEMU's device and code buffers, the launcher, and the
/// kernel's per-process overhead; requests = limits so machine Pods get Guaranteed QoS.
///
/// Measured (`make bench-launcher`, TCG, 1 vCPU, 256 MiB guest, test guest): QEMU RSS 391 MiB,
/// i.e. about 135 MiB beyond the guest's whole RAM; launcher RSS 8.4 MiB. The fixed 256 MiB
/// covers that with room for TCG's translation cache, which the launcher bounds at 128 MiB
/// (QEMU's default is 1 GiB). Under KVM there is no translation cache; a real Flatcar guest's
/// numbers come with the end-to-end benchmark.
pub mod overhead {
    /// Fixed memory overhead per machine Pod, MiB.
    pub const FIXED_MIB: u64 = 256;
    /// Memory overhead per vCPU, MiB.
    pub const PER_VCPU_MIB: u64 = 16;
    /// Memory overhead per GiB of VM memory (page tables, QEMU's RAM bookkeeping), MiB.
    pub const PER_GIB_MIB: u64 = 16;
    /// CPU overhead in millicores for the launcher, QEMU's I/O threads and the DHCP server.
    pub const CPU_MILLIS: u64 = 250;

    /// Memory overhead in bytes for a VM of `vcpus` vCPUs and `vm_bytes` of memory.
    pub fn memory_bytes(vcpus: u64, vm_bytes: u64) -> u64 {
        let mib = FIXED_MIB + PER_VCPU_MIB * vcpus + PER_GIB_MIB * vm_bytes.div_ceil(1 << 30);
        mib << 20
    }
}

/// What the Pod builder needs to know about the owning Machine.
#[derive(Clone, Debug)]
pub struct MachineFacts {
    /// The Cluster's name.
    pub cluster: String,
    /// Whether this is a control-plane machine.
    pub control_plane: bool,
    /// The Machine's failure domain.
    pub failure_domain: Option<String>,
}

/// Why a Pod cannot be built from the spec (shown in a condition and an Event).
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// A size in the spec cannot be turned into bytes.
    #[error("{field}: {source}")]
    Size {
        /// The field's path, e.g. `spec.etcdStorage.size`.
        field: &'static str,
        /// Cause.
        #[source]
        source: QuantityError,
    },
}

pub use super::names::{etcd_claim_name, hostname, ignition_secret_name, pod_name};

fn labels(km: &KVMMachine, facts: &MachineFacts) -> BTreeMap<String, String> {
    let mut labels = owned_labels(&facts.cluster);
    labels.insert(KVMMACHINE_LABEL.into(), super::names::label_value(km));
    labels.insert(
        MACHINE_ROLE_LABEL.into(),
        if facts.control_plane {
            ROLE_CONTROL_PLANE
        } else {
            ROLE_WORKER
        }
        .into(),
    );
    labels
}

/// What an Ignition Secret is rendered from: the bootstrap data Secret's name and
/// resourceVersion, and this controller's version (a new converter renders again).
pub fn rendered_from(bootstrap_secret: &str, resource_version: &str) -> String {
    format!(
        "{bootstrap_secret}@{resource_version}/capk-controller-{}",
        env!("CARGO_PKG_VERSION")
    )
}

/// The Secret holding the machine's Ignition config, annotated with what it was rendered from
/// ([`rendered_from`]).
pub fn ignition_secret(
    km: &KVMMachine,
    facts: &MachineFacts,
    ignition: Vec<u8>,
    rendered_from: &str,
) -> Secret {
    Secret {
        metadata: ObjectMeta {
            name: Some(ignition_secret_name(km)),
            namespace: km.meta().namespace.clone(),
            labels: Some(labels(km, facts)),
            annotations: Some(BTreeMap::from([(
                capk_api::constants::RENDERED_FROM_ANNOTATION.to_owned(),
                rendered_from.to_owned(),
            )])),
            owner_references: km.controller_owner_ref(&()).map(|o| vec![o]),
            ..Default::default()
        },
        type_: Some("infrastructure.cluster.x-k8s.io/ignition".into()),
        data: Some(BTreeMap::from([(
            IGNITION_KEY.to_owned(),
            ByteString(ignition),
        )])),
        ..Default::default()
    }
}

/// The machine's Ignition config (compact JSON) from its bootstrap data and the Secret's
/// `format`. The error is in words safe to show in a condition and an Event: the converter
/// quotes the values it rejects, and bootstrap data holds join tokens and keys, so quoted values
/// and token-shaped words are replaced and the message is bounded ([`crate::redact`]).
pub fn render_ignition(
    km: &KVMMachine,
    format: Option<&str>,
    data: &[u8],
) -> Result<Vec<u8>, String> {
    let facts = capk_bootstrap::MachineFacts {
        hostname: hostname(km),
        instance_id: capk_api::constants::provider_id(
            km.meta().namespace.as_deref().unwrap_or_default(),
            &pod_name(km),
        ),
    };
    capk_bootstrap::BootstrapFormat::from_secret(format)
        .and_then(|f| capk_bootstrap::render_ignition(f, data, &facts, None))
        .map(|r| r.json)
        .map_err(|e| crate::redact::untrusted_message(&e.to_string()))
}

fn bytes(
    q: Option<&capk_api::quantity::SizeQuantity>,
    field: &'static str,
    default: u64,
) -> Result<u64, BuildError> {
    match q {
        Some(q) => q
            .bytes()
            .map_err(|source| BuildError::Size { field, source }),
        None => Ok(default),
    }
}

/// The machine Pod.
pub fn machine_pod(
    km: &KVMMachine,
    facts: &MachineFacts,
    defaults: &MachineDefaults,
) -> Result<Pod, BuildError> {
    let spec = &km.spec;
    let vcpus = u64::try_from(spec.resources.cpu.max(1)).unwrap_or(1);
    let memory = spec
        .resources
        .memory
        .bytes()
        .map_err(|source| BuildError::Size {
            field: "spec.resources.memory",
            source,
        })?;
    let disk = spec
        .resources
        .disk
        .bytes()
        .map_err(|source| BuildError::Size {
            field: "spec.resources.disk",
            source,
        })?;
    let docker = bytes(
        spec.resources.docker_volume_size.as_ref(),
        "spec.resources.dockerVolumeSize",
        defaults.docker_volume_bytes,
    )?;
    let kubelet = bytes(
        spec.resources.kubelet_volume_size.as_ref(),
        "spec.resources.kubeletVolumeSize",
        defaults.kubelet_volume_bytes,
    )?;

    // No hostPath volumes for /dev/kvm and /dev/net/tun: a privileged container sees the node's
    // devices, and a node without /dev/kvm must still start the Pod (accel auto falls back to TCG).
    let mut volumes = vec![
        Volume {
            name: "ignition".into(),
            secret: Some(SecretVolumeSource {
                secret_name: Some(ignition_secret_name(km)),
                default_mode: Some(0o400),
                ..Default::default()
            }),
            ..Default::default()
        },
        Volume {
            name: "state".into(),
            empty_dir: Some(EmptyDirVolumeSource {
                // qcow2 overlays grow up to their virtual size; the data disks are sparse files.
                size_limit: Some(Quantity((disk + docker + kubelet).to_string())),
                ..Default::default()
            }),
            ..Default::default()
        },
    ];
    let mut mounts = vec![
        mount("ignition", IGNITION_DIR, true),
        mount("state", STATE_DIR, false),
        mount("image", IMAGE_DIR, true),
    ];

    let node_image = node_image(km, defaults);
    volumes.extend(node_image.volumes);

    let mut args = vec![
        "run".to_owned(),
        format!("--vcpus={vcpus}"),
        format!("--memory={memory}"),
        format!("--disk-size={disk}"),
        format!("--docker-disk-size={docker}"),
        format!("--kubelet-disk-size={kubelet}"),
        format!("--image={}", node_image.path),
        format!("--ignition={IGNITION_DIR}/{IGNITION_KEY}"),
        format!("--state-dir={STATE_DIR}"),
        format!("--hostname={}", hostname(km)),
        format!(
            "--role={}",
            if facts.control_plane {
                "control-plane"
            } else {
                "worker"
            }
        ),
        format!(
            "--accel={}",
            match spec.accel.unwrap_or_default() {
                Accel::Auto => "auto",
                Accel::Kvm => "kvm",
                Accel::Tcg => "tcg",
            }
        ),
        format!("--grace-period-seconds={GUEST_SHUTDOWN_SECONDS}"),
    ];
    if let Some(dns) = &spec.dns {
        for s in &dns.servers {
            args.push(format!("--dns={}", s.0));
        }
        for s in &dns.searches {
            args.push(format!("--dns-search={}", s.0));
        }
    }
    if let Some(ntp) = &spec.ntp {
        // The launcher hands NTP servers to the guest by DHCP, which carries addresses only.
        for s in ntp
            .servers
            .iter()
            .filter(|s| s.0.parse::<std::net::Ipv4Addr>().is_ok())
        {
            args.push(format!("--ntp={}", s.0));
        }
    }

    if facts.control_plane {
        let storage = spec.etcd_storage.as_ref();
        let etcd_bytes = storage
            .and_then(|s| s.size.as_ref())
            .map(|q| {
                q.bytes().map_err(|source| BuildError::Size {
                    field: "spec.etcdStorage.size",
                    source,
                })
            })
            .transpose()?
            .unwrap_or(defaults.etcd_volume_bytes);
        let volume = match storage {
            Some(s) if s.type_ == EtcdStorageType::PersistentVolume => Volume {
                name: "etcd".into(),
                persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                    claim_name: etcd_claim_name(km),
                    read_only: Some(false),
                }),
                ..Default::default()
            },
            Some(s) => {
                // One directory per machine under the user's path.
                let base = s.host_path.clone().unwrap_or_default();
                let dir = format!(
                    "{}/{}/{}",
                    base.trim_end_matches('/'),
                    km.meta().namespace.as_deref().unwrap_or("default"),
                    pod_name(km)
                );
                host_path("etcd", &dir, "DirectoryOrCreate")
            }
            // No storage configured: etcd lives next to the VM disks (lost with the Pod).
            None => Volume {
                name: "etcd".into(),
                empty_dir: Some(EmptyDirVolumeSource::default()),
                ..Default::default()
            },
        };
        volumes.push(volume);
        mounts.push(mount("etcd", ETCD_DIR, false));
        args.push(format!("--etcd-disk={ETCD_DIR}/etcd.img"));
        args.push(format!("--etcd-disk-size={etcd_bytes}"));
    } else {
        for hv in spec.host_volumes.iter().flatten() {
            let name = format!("hostvol-{}", sanitize(&hv.mount_tag));
            let path = format!("/var/lib/capk/host-volumes/{}", hv.mount_tag);
            volumes.push(host_path(&name, &hv.host_path, "Directory"));
            mounts.push(mount(&name, &path, false));
            args.push(format!("--host-volume={}={path}", hv.mount_tag));
        }
    }

    let overhead_bytes = overhead::memory_bytes(vcpus, memory);
    // One whole core per vCPU by default (Guaranteed QoS: requests = limits). With an allocation
    // ratio N > 1 the Pod requests 1/N of that (vCPUs and overhead alike: requests are then the
    // Pods' relative shares) and the CPU is not limited (Burstable): vCPUs share the node's
    // cores, as KubeVirt's cpuAllocationRatio does. Memory is never overcommitted.
    let ratio = defaults.cpu_allocation_ratio.max(1) as u64;
    let cpu_millis = (vcpus * 1000 + overhead::CPU_MILLIS).div_ceil(ratio);
    let memory_quantity = Quantity((memory + overhead_bytes).to_string());
    let requests = BTreeMap::from([
        ("cpu".to_owned(), Quantity(format!("{cpu_millis}m"))),
        ("memory".to_owned(), memory_quantity.clone()),
    ]);
    let limits = if ratio == 1 {
        requests.clone()
    } else {
        BTreeMap::from([("memory".to_owned(), memory_quantity)])
    };

    let probe = |kind: &str, initial: i32, period: i32, failures: i32| Probe {
        exec: Some(ExecAction {
            command: Some(vec!["capk-launcher".into(), "probe".into(), kind.into()]),
        }),
        initial_delay_seconds: Some(initial),
        period_seconds: Some(period),
        timeout_seconds: Some(5),
        failure_threshold: Some(failures),
        ..Default::default()
    };

    let container = Container {
        name: "launcher".into(),
        image: Some(defaults.launcher_image.clone()),
        image_pull_policy: Some("IfNotPresent".into()),
        command: Some(vec!["capk-launcher".into()]),
        args: Some(args),
        security_context: Some(SecurityContext {
            privileged: Some(true),
            ..Default::default()
        }),
        resources: Some(ResourceRequirements {
            requests: Some(requests),
            limits: Some(limits),
            ..Default::default()
        }),
        volume_mounts: Some(mounts),
        // Until the guest first reports bootstrap success, the readiness check every second, so
        // the Machine is provisioned within a second of its guest (not up to a probe period
        // later). An hour without it restarts the container (the etcd disk stays); liveness and
        // readiness start only after it, and QEMU dying meanwhile ends the launcher anyway.
        startup_probe: Some(probe("readiness", 1, 1, 3600)),
        // QEMU alive and answering QMP.
        liveness_probe: Some(probe("liveness", 0, 20, 6)),
        // Guest heartbeat (+ API server on control planes).
        readiness_probe: Some(probe("readiness", 0, 10, 3)),
        termination_message_policy: Some("FallbackToLogsOnError".into()),
        ..Default::default()
    };

    // Init containers get the launcher's resources: the Pod keeps Guaranteed QoS, and its
    // effective request (the larger of init and app containers) does not grow.
    let mut init_containers = node_image.init_containers;
    for c in &mut init_containers {
        c.resources = container.resources.clone();
    }

    Ok(Pod {
        metadata: ObjectMeta {
            name: Some(pod_name(km)),
            namespace: km.meta().namespace.clone(),
            labels: Some(labels(km, facts)),
            // `kubectl logs|exec POD` go to the launcher (the console, capk-launcher status)
            // without `-c launcher` and without naming the init containers.
            annotations: Some(BTreeMap::from([(
                "kubectl.kubernetes.io/default-container".to_owned(),
                "launcher".to_owned(),
            )])),
            owner_references: km.controller_owner_ref(&()).map(|o| vec![o]),
            ..Default::default()
        },
        spec: Some(PodSpec {
            hostname: Some(hostname(km)),
            init_containers: (!init_containers.is_empty()).then_some(init_containers),
            containers: vec![container],
            volumes: Some(volumes),
            restart_policy: Some("Always".into()),
            termination_grace_period_seconds: Some(GUEST_SHUTDOWN_SECONDS + 30),
            readiness_gates: Some(vec![PodReadinessGate {
                condition_type: NODE_READY_GATE.into(),
            }]),
            // The launcher needs no access to the management cluster's API.
            automount_service_account_token: Some(false),
            enable_service_links: Some(false),
            node_selector: spec.node_selector.clone().filter(|m| !m.is_empty()),
            tolerations: spec.tolerations.clone().filter(|t| !t.is_empty()),
            priority_class_name: spec.priority_class_name.clone(),
            affinity: affinity(facts, defaults),
            ..Default::default()
        }),
        status: None,
    })
}

/// How the node image reaches the launcher: volumes, init containers, and the `--image` path.
struct NodeImage {
    volumes: Vec<Volume>,
    init_containers: Vec<Container>,
    path: String,
}

/// The node image: a container image through an image volume or the host cache, or a Flatcar
/// release / URL download from the host cache.
fn node_image(km: &KVMMachine, defaults: &MachineDefaults) -> NodeImage {
    let image = km.spec.image.as_ref();
    let cache = host_path("image", HOST_IMAGE_CACHE, "DirectoryOrCreate");
    let default_image = match (image, &defaults.default_node_image) {
        (None, Some(i)) => Some(ContainerDiskImage {
            image: i.clone(),
            path: None,
        }),
        _ => None,
    };
    let container_image = image
        .and_then(|i| i.container_image.as_ref())
        .or(default_image.as_ref());
    if let Some(ci) = container_image {
        let disk = ci
            .path
            .clone()
            .unwrap_or_else(|| DEFAULT_CONTAINER_DISK_PATH.into());
        if defaults.node_image_source == NodeImageSource::ImageVolume {
            // The container runtime pulls and caches the image by digest; it is mounted
            // read-only and used as the qcow2 backing file, never copied.
            let volume = Volume {
                name: "image".into(),
                image: Some(ImageVolumeSource {
                    reference: Some(ci.image.clone()),
                    pull_policy: Some("IfNotPresent".into()),
                }),
                ..Default::default()
            };
            return NodeImage {
                volumes: vec![volume],
                init_containers: vec![],
                path: format!("{IMAGE_DIR}/{}", disk.trim_start_matches('/')),
            };
        }
        let tools = Volume {
            name: "tools".into(),
            empty_dir: Some(EmptyDirVolumeSource::default()),
            ..Default::default()
        };
        let busybox = format!("{TOOLS_DIR}/busybox");
        let init =
            |name: &str, image: &str, command: Vec<String>, mounts: Vec<VolumeMount>| Container {
                name: name.into(),
                image: Some(image.into()),
                image_pull_policy: Some("IfNotPresent".into()),
                command: Some(command),
                volume_mounts: Some(mounts),
                termination_message_policy: Some("FallbackToLogsOnError".into()),
                ..Default::default()
            };
        return NodeImage {
            volumes: vec![cache, tools],
            init_containers: vec![
                init(
                    "tools",
                    &defaults.launcher_image,
                    vec![
                        "/bin/busybox".into(),
                        "cp".into(),
                        "/bin/busybox".into(),
                        busybox.clone(),
                    ],
                    vec![mount("tools", TOOLS_DIR, false)],
                ),
                init(
                    "node-image",
                    &ci.image,
                    vec![
                        busybox.clone(),
                        "sh".into(),
                        "-c".into(),
                        NODE_IMAGE_SCRIPT.into(),
                        "node-image".into(),
                        busybox,
                        disk,
                        IMAGE_DIR.into(),
                        NODE_IMAGE_LINK.into(),
                    ],
                    vec![
                        mount("tools", TOOLS_DIR, true),
                        mount("image", IMAGE_DIR, false),
                        mount("state", STATE_DIR, false),
                    ],
                ),
            ],
            path: NODE_IMAGE_LINK.into(),
        };
    }
    let file = match image {
        Some(i) if i.url.is_some() => {
            format!(
                "sha256-{}.img",
                i.url
                    .as_ref()
                    .map(|u| u.sha256.as_str())
                    .unwrap_or_default()
            )
        }
        Some(i) if i.flatcar.is_some() => {
            let f = i.flatcar.as_ref().expect("checked");
            format!("flatcar-{}-{}.img", channel(f.channel), f.version)
        }
        _ => format!("flatcar-stable-{}.img", defaults.flatcar_version),
    };
    NodeImage {
        volumes: vec![cache],
        init_containers: vec![],
        path: format!("{IMAGE_DIR}/{file}"),
    }
}

fn channel(c: FlatcarChannel) -> &'static str {
    match c {
        FlatcarChannel::Stable => "stable",
        FlatcarChannel::Beta => "beta",
        FlatcarChannel::Alpha => "alpha",
        FlatcarChannel::Lts => "lts",
    }
}

fn affinity(facts: &MachineFacts, defaults: &MachineDefaults) -> Option<Affinity> {
    let mut affinity = Affinity::default();
    if facts.control_plane {
        let term = PodAffinityTerm {
            label_selector: Some(LabelSelector {
                match_labels: Some(BTreeMap::from([
                    (CLUSTER_NAME_LABEL.to_owned(), facts.cluster.clone()),
                    (MACHINE_ROLE_LABEL.to_owned(), ROLE_CONTROL_PLANE.to_owned()),
                ])),
                ..Default::default()
            }),
            topology_key: "kubernetes.io/hostname".into(),
            ..Default::default()
        };
        affinity.pod_anti_affinity = Some(if defaults.require_control_plane_anti_affinity {
            PodAntiAffinity {
                required_during_scheduling_ignored_during_execution: Some(vec![term]),
                ..Default::default()
            }
        } else {
            PodAntiAffinity {
                preferred_during_scheduling_ignored_during_execution: Some(vec![
                    WeightedPodAffinityTerm {
                        weight: 100,
                        pod_affinity_term: term,
                    },
                ]),
                ..Default::default()
            }
        });
    }
    if let Some(fd) = &facts.failure_domain {
        affinity.node_affinity = Some(NodeAffinity {
            required_during_scheduling_ignored_during_execution: Some(NodeSelector {
                node_selector_terms: vec![NodeSelectorTerm {
                    match_expressions: Some(vec![NodeSelectorRequirement {
                        key: "topology.kubernetes.io/zone".into(),
                        operator: "In".into(),
                        values: Some(vec![fd.clone()]),
                    }]),
                    ..Default::default()
                }],
            }),
            ..Default::default()
        });
    }
    (affinity != Affinity::default()).then_some(affinity)
}

fn host_path(name: &str, path: &str, type_: &str) -> Volume {
    Volume {
        name: name.into(),
        host_path: Some(HostPathVolumeSource {
            path: path.into(),
            type_: Some(type_.into()),
        }),
        ..Default::default()
    }
}

fn mount(name: &str, path: &str, read_only: bool) -> VolumeMount {
    VolumeMount {
        name: name.into(),
        mount_path: path.into(),
        read_only: read_only.then_some(true),
        ..Default::default()
    }
}

fn sanitize(tag: &str) -> String {
    tag.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect()
}

/// The etcd PVC of a control-plane machine with `etcdStorage.type: persistentVolume`.
pub fn etcd_claim(km: &KVMMachine, facts: &MachineFacts) -> Option<PersistentVolumeClaim> {
    let storage = km.spec.etcd_storage.as_ref()?;
    if !facts.control_plane || storage.type_ != EtcdStorageType::PersistentVolume {
        return None;
    }
    let size = storage.size.as_ref()?.0.clone();
    Some(PersistentVolumeClaim {
        metadata: ObjectMeta {
            name: Some(etcd_claim_name(km)),
            namespace: km.meta().namespace.clone(),
            labels: Some(labels(km, facts)),
            owner_references: km.controller_owner_ref(&()).map(|o| vec![o]),
            ..Default::default()
        },
        spec: Some(PersistentVolumeClaimSpec {
            access_modes: Some(vec!["ReadWriteOnce".into()]),
            storage_class_name: storage.storage_class_name.clone(),
            resources: Some(VolumeResourceRequirements {
                requests: Some(BTreeMap::from([("storage".to_owned(), Quantity(size))])),
                ..Default::default()
            }),
            ..Default::default()
        }),
        status: None,
    })
}

/// Condition and Event reason of a spec that cannot be run.
pub const REASON_SPEC_INVALID: &str = "SpecInvalid";

/// Where a KVMMachine is on its way to a running VM.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MachineState {
    /// No Machine owns the KVMMachine yet.
    WaitingForMachineOwner,
    /// Reconciliation is paused.
    Paused,
    /// The Cluster's infrastructure is not provisioned yet.
    WaitingForClusterInfrastructure,
    /// The Machine names no bootstrap data Secret yet.
    WaitingForBootstrapData,
    /// The Machine names a bootstrap data Secret that does not exist (yet).
    WaitingForBootstrapSecret(String),
    /// The bootstrap data cannot be turned into Ignition; the message says why.
    BootstrapDataInvalid(String),
    /// The KVMMachine's spec cannot be run (what the CRD's schema cannot check); the message
    /// names the field and says why.
    SpecInvalid(String),
    /// The Pod exists but the VM is not running yet.
    PodStarting {
        /// Pod name.
        pod: String,
        /// The Pod's phase and reason, for the message.
        detail: String,
    },
    /// The machine Pod runs the VM.
    Running {
        /// Pod name.
        pod: String,
        /// Pod (= VM) IP.
        ip: String,
    },
    /// The machine Pod disappeared (or failed) after the VM ran; the Machine must be replaced.
    PodMissing,
}

/// A Kubernetes reason as a condition reason (CamelCase, no spaces), or `fallback`.
fn reason_or(reason: Option<&str>, fallback: &'static str) -> std::borrow::Cow<'static, str> {
    match reason {
        Some(r)
            if r.starts_with(|c: char| c.is_ascii_alphabetic())
                && r.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') =>
        {
            r.to_owned().into()
        }
        _ => fallback.into(),
    }
}

/// The conditions that follow the machine Pod: `PodScheduled` (the management cluster found it
/// a node), `VMRunning` (the launcher container runs; it exits when QEMU dies) and
/// `BootstrapCompleted` (the launcher's readiness probe: the guest reported bootstrap success).
pub fn pod_conditions(pod: Option<&Pod>) -> Vec<crate::conditions::DesiredCondition> {
    use crate::conditions::DesiredCondition as C;
    use capk_api::constants::{
        CONDITION_BOOTSTRAP_COMPLETED, CONDITION_POD_SCHEDULED, CONDITION_VM_RUNNING,
    };
    let Some(pod) = pod else {
        return [
            CONDITION_POD_SCHEDULED,
            CONDITION_VM_RUNNING,
            CONDITION_BOOTSTRAP_COMPLETED,
        ]
        .into_iter()
        .map(|t| C::falsy(t, "NoMachinePod", "there is no machine Pod"))
        .collect();
    };
    let status = pod.status.clone().unwrap_or_default();
    let scheduled = status
        .conditions
        .as_deref()
        .unwrap_or_default()
        .iter()
        .find(|c| c.type_ == "PodScheduled");
    let node = pod.spec.as_ref().and_then(|s| s.node_name.clone());
    let scheduled = match (scheduled, node) {
        (Some(c), Some(node)) if c.status == "True" => C::truthy(
            CONDITION_POD_SCHEDULED,
            "Scheduled",
            format!("machine Pod is scheduled to node {node}"),
        ),
        (Some(c), _) if c.status != "True" => C::falsy(
            CONDITION_POD_SCHEDULED,
            reason_or(c.reason.as_deref(), "Unschedulable"),
            c.message.clone().unwrap_or_default(),
        ),
        _ => C::falsy(
            CONDITION_POD_SCHEDULED,
            "WaitingForScheduler",
            "the machine Pod waits for the scheduler",
        ),
    };
    let launcher = status
        .container_statuses
        .as_deref()
        .unwrap_or_default()
        .iter()
        .find(|c| c.name == "launcher");
    let state = launcher.and_then(|c| c.state.as_ref());
    let restarts = launcher.map(|c| c.restart_count).unwrap_or(0);
    let last_exit = launcher
        .and_then(|c| c.last_state.as_ref())
        .and_then(|s| s.terminated.as_ref())
        .map(|t| {
            format!(
                "; last exit: code {}{}",
                t.exit_code,
                t.message
                    .as_deref()
                    .map(|m| format!(", {}", m.trim()))
                    .unwrap_or_default()
            )
        })
        .unwrap_or_default();
    let running = match state {
        Some(s) if s.running.is_some() => C::truthy(
            CONDITION_VM_RUNNING,
            "LauncherRunning",
            format!("the launcher runs the VM (restarts: {restarts}{last_exit})"),
        ),
        Some(s) if s.waiting.is_some() => {
            let w = s.waiting.as_ref().expect("checked");
            C::falsy(
                CONDITION_VM_RUNNING,
                reason_or(w.reason.as_deref(), "LauncherWaiting"),
                format!(
                    "{} (restarts: {restarts}{last_exit})",
                    w.message
                        .as_deref()
                        .unwrap_or("the launcher container waits to start")
                ),
            )
        }
        Some(s) if s.terminated.is_some() => {
            let t = s.terminated.as_ref().expect("checked");
            C::falsy(
                CONDITION_VM_RUNNING,
                "LauncherExited",
                format!(
                    "the launcher exited with code {}: {}",
                    t.exit_code,
                    t.message.as_deref().unwrap_or("no message").trim()
                ),
            )
        }
        _ => C::falsy(
            CONDITION_VM_RUNNING,
            "LauncherPending",
            "the launcher container has not started",
        ),
    };
    // The startup probe runs the readiness check every second until it first passes, and the
    // kubelet marks the container `started` at once; `ready` follows only at the readiness
    // probe's next period (up to 10 s later). A Pod built without a startup probe (by an older
    // controller) is `started` as soon as it runs, so there only `ready` counts.
    let has_startup_probe = pod
        .spec
        .as_ref()
        .and_then(|s| s.containers.iter().find(|c| c.name == "launcher"))
        .is_some_and(|c| c.startup_probe.is_some());
    let started = has_startup_probe
        && state.is_some_and(|s| s.running.is_some())
        && launcher.is_some_and(|c| c.started == Some(true));
    let bootstrapped = if launcher.is_some_and(|c| c.ready) {
        C::truthy(
            CONDITION_BOOTSTRAP_COMPLETED,
            "BootstrapSucceeded",
            "the guest reported bootstrap success and sends heartbeats",
        )
    } else if started {
        C::truthy(
            CONDITION_BOOTSTRAP_COMPLETED,
            "BootstrapSucceeded",
            "the guest reported bootstrap success (capk-launcher's startup probe passed)",
        )
    } else {
        C::falsy(
            CONDITION_BOOTSTRAP_COMPLETED,
            "WaitingForBootstrap",
            "waiting for the guest to report bootstrap success (capk-launcher probe readiness)",
        )
    };
    vec![scheduled, running, bootstrapped]
}

/// The `NodeReady` condition: what the machine Pod's readiness gate says about the workload
/// cluster's Node, or that there is no machine Pod to gate.
pub fn node_condition(gate: Option<&crate::workload::Gate>) -> crate::conditions::DesiredCondition {
    use crate::conditions::DesiredCondition as C;
    use capk_api::constants::CONDITION_NODE_READY;
    match gate {
        Some(g) if g.ready => C::truthy(CONDITION_NODE_READY, g.reason, g.message.clone()),
        Some(g) => C::falsy(CONDITION_NODE_READY, g.reason, g.message.clone()),
        None => C::falsy(
            CONDITION_NODE_READY,
            "NoMachinePod",
            "there is no running machine Pod, so no Node",
        ),
    }
}

/// The status the KVMMachine should have.
pub fn status(
    km: &KVMMachine,
    state: &MachineState,
    pod: &[crate::conditions::DesiredCondition],
    failure_domain: Option<&str>,
    now: k8s_openapi::jiff::Timestamp,
) -> capk_api::v1alpha1::KVMMachineStatus {
    use crate::conditions::{self, DesiredCondition as C};
    use capk_api::constants::{CONDITION_PAUSED, CONDITION_READY};
    use capk_api::v1alpha1::{Initialization, MachineAddress, MachineAddressType};

    let current = km.status.clone().unwrap_or_default();
    let generation = km.meta().generation;
    let mut out = current.clone();
    let mut desired = vec![match state {
        MachineState::Paused => C::truthy(
            CONDITION_PAUSED,
            "Paused",
            "the Cluster or this object is paused; nothing is changed until it is unpaused",
        ),
        _ => C::falsy(CONDITION_PAUSED, "NotPaused", ""),
    }];
    let ready = match state {
        MachineState::Paused => None,
        MachineState::WaitingForMachineOwner => Some(C::falsy(
            CONDITION_READY,
            "WaitingForMachineOwner",
            "waiting for Cluster API to set a Machine as owner of this KVMMachine",
        )),
        MachineState::WaitingForClusterInfrastructure => Some(C::falsy(
            CONDITION_READY,
            "WaitingForClusterInfrastructure",
            "waiting for the Cluster's infrastructure (KVMCluster) to be provisioned",
        )),
        MachineState::WaitingForBootstrapData => Some(C::falsy(
            CONDITION_READY,
            "WaitingForBootstrapData",
            "waiting for the bootstrap provider to set the Machine's spec.bootstrap.dataSecretName",
        )),
        MachineState::WaitingForBootstrapSecret(name) => Some(C::falsy(
            CONDITION_READY,
            "WaitingForBootstrapData",
            format!("waiting for the Machine's bootstrap data Secret {name} to exist"),
        )),
        MachineState::BootstrapDataInvalid(msg) => Some(C::falsy(
            CONDITION_READY,
            "BootstrapDataInvalid",
            format!("cannot convert the bootstrap data to Ignition: {msg}"),
        )),
        MachineState::SpecInvalid(msg) => Some(C::falsy(
            CONDITION_READY,
            REASON_SPEC_INVALID,
            format!("the spec cannot be run: {msg}"),
        )),
        MachineState::PodStarting { pod, detail } => Some(C::falsy(
            CONDITION_READY,
            "VMStarting",
            format!("machine Pod {pod}: {detail}"),
        )),
        MachineState::Running { pod, .. } => Some(C::truthy(
            CONDITION_READY,
            "VMRunning",
            format!("the VM runs in machine Pod {pod}"),
        )),
        MachineState::PodMissing => Some(C::falsy(
            CONDITION_READY,
            "MachinePodMissing",
            "the machine Pod is gone or failed, and with it the VM and its disks; the Machine \
             needs replacing (a MachineHealthCheck does this)",
        )),
    };
    desired.extend(ready);
    if !matches!(state, MachineState::Paused) {
        desired.extend_from_slice(pod);
    }
    match state {
        MachineState::PodStarting { pod, .. } => {
            out.pod_name = Some(pod.clone());
        }
        MachineState::Running { pod, ip } => {
            out.pod_name = Some(pod.clone());
            out.addresses = Some(vec![
                MachineAddress {
                    type_: MachineAddressType::InternalIP,
                    address: ip.clone(),
                },
                MachineAddress {
                    type_: MachineAddressType::Hostname,
                    address: hostname(km),
                },
            ]);
            out.initialization = Some(Initialization {
                provisioned: Some(true),
            });
            out.ready = Some(true);
        }
        _ => {}
    }
    if !matches!(state, MachineState::Paused) {
        out.failure_domain = failure_domain.map(str::to_owned);
        out.observed_generation = generation;
    }
    out.conditions = Some(conditions::merge(
        current.conditions.as_deref().unwrap_or_default(),
        &desired,
        generation,
        now,
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn kvm_machine(name: &str, spec: serde_json::Value) -> KVMMachine {
        let mut km: KVMMachine = serde_json::from_value(json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1",
            "kind": "KVMMachine",
            "metadata": {"name": name, "namespace": "team-a", "uid": "uid-1"},
            "spec": spec,
        }))
        .unwrap();
        km.metadata.generation = Some(1);
        km
    }

    #[test]
    fn control_plane_pod() {
        let km = kvm_machine(
            "demo-cp-x7k2p",
            json!({
                "resources": {"cpu": 2, "memory": "4Gi", "disk": "20Gi", "dockerVolumeSize": "5Gi"},
                "etcdStorage": {"type": "hostPath", "hostPath": "/var/lib/capk-etcd"},
                "image": {"flatcar": {"channel": "stable", "version": "4230.2.3"}},
                "dns": {"servers": ["10.96.0.10"], "searches": ["team-a.svc.cluster.local"]},
            }),
        );
        let facts = MachineFacts {
            cluster: "demo".into(),
            control_plane: true,
            failure_domain: Some("zone-a".into()),
        };
        let pod = machine_pod(&km, &facts, &MachineDefaults::default()).unwrap();
        insta::assert_yaml_snapshot!(pod);
    }

    #[test]
    fn default_node_image_replaces_flatcar_only_when_the_machine_names_no_image() {
        let defaults = MachineDefaults {
            default_node_image: Some("localhost/capk/test-guest:dev".into()),
            ..MachineDefaults::default()
        };
        let init_images = |km: &KVMMachine| -> Vec<String> {
            let facts = MachineFacts {
                cluster: "demo".into(),
                control_plane: false,
                failure_domain: None,
            };
            machine_pod(km, &facts, &defaults)
                .unwrap()
                .spec
                .unwrap()
                .init_containers
                .unwrap_or_default()
                .into_iter()
                .filter_map(|c| c.image)
                .collect()
        };
        let resources = json!({"cpu": 1, "memory": "1Gi", "disk": "20Gi"});
        let plain = kvm_machine("plain", json!({"resources": resources}));
        assert_eq!(
            init_images(&plain),
            [
                "localhost/capk/capk-launcher:dev",
                "localhost/capk/test-guest:dev"
            ],
            "a machine without spec.image boots the default node image"
        );
        let flatcar = kvm_machine(
            "flatcar",
            json!({"resources": resources, "image": {"flatcar": {"channel": "beta", "version": "4230.1.0"}}}),
        );
        assert!(
            init_images(&flatcar).is_empty(),
            "a machine naming its image keeps it"
        );
    }

    #[test]
    fn worker_pod_with_host_volumes_and_a_container_disk_image() {
        let km = kvm_machine(
            "demo-md-0-abcde",
            json!({
                "resources": {"cpu": 1, "memory": "1Gi", "disk": "20Gi", "dockerVolumeSize": "5Gi"},
                "hostVolumes": [{"mountTag": "Data_1", "hostPath": "/srv/data"}],
                "image": {"containerImage": {"image": "capk-test-guest:v1"}},
                "nodeSelector": {"kvm": "true"},
                "priorityClassName": "workload-vms",
            }),
        );
        let facts = MachineFacts {
            cluster: "demo".into(),
            control_plane: false,
            failure_domain: None,
        };
        let pod = machine_pod(&km, &facts, &MachineDefaults::default()).unwrap();
        insta::assert_yaml_snapshot!(pod);

        // With image volumes the runtime mounts the image: no init containers, no copy.
        let defaults = MachineDefaults {
            node_image_source: NodeImageSource::ImageVolume,
            ..Default::default()
        };
        let spec = machine_pod(&km, &facts, &defaults).unwrap().spec.unwrap();
        assert!(spec.init_containers.is_none());
        let image = spec
            .volumes
            .as_ref()
            .unwrap()
            .iter()
            .find(|v| v.name == "image");
        assert_eq!(
            image
                .and_then(|v| v.image.as_ref())
                .and_then(|i| i.reference.as_deref()),
            Some("capk-test-guest:v1")
        );
        let args = spec.containers[0].args.clone().unwrap().join(" ");
        assert!(
            args.contains("--image=/var/lib/capk/image/disk/image.qcow2"),
            "{args}"
        );
    }

    #[test]
    fn pod_resources_are_the_vm_plus_the_overhead() {
        let km = kvm_machine(
            "m",
            json!({"resources": {"cpu": 4, "memory": "8Gi", "disk": "40Gi"}}),
        );
        let facts = MachineFacts {
            cluster: "c".into(),
            control_plane: false,
            failure_domain: None,
        };
        let pod = machine_pod(&km, &facts, &MachineDefaults::default()).unwrap();
        let c = &pod.spec.unwrap().containers[0];
        let r = c.resources.as_ref().unwrap();
        assert_eq!(r.requests, r.limits, "Guaranteed QoS");
        let mem: u64 = r.limits.as_ref().unwrap()["memory"].0.parse().unwrap();
        // 8 GiB + 256 MiB fixed + 4 x 16 MiB + 8 x 16 MiB
        assert_eq!(mem, (8 << 30) + ((256 + 64 + 128) << 20));
        assert_eq!(r.limits.as_ref().unwrap()["cpu"].0, "4250m");

        // Overcommitted: 4 vCPUs and the overhead at ratio 10 request a tenth of 4250m, no CPU
        // limit; memory is still requested and limited in full.
        let dense = MachineDefaults {
            cpu_allocation_ratio: 10,
            ..MachineDefaults::default()
        };
        let pod = machine_pod(&km, &facts, &dense).unwrap();
        let c = &pod.spec.unwrap().containers[0];
        let r = c.resources.as_ref().unwrap();
        let (requests, limits) = (r.requests.as_ref().unwrap(), r.limits.as_ref().unwrap());
        assert_eq!(requests["cpu"].0, "425m");
        assert!(!limits.contains_key("cpu"), "Burstable: no CPU limit");
        assert_eq!(requests["memory"], limits["memory"]);
    }

    #[test]
    fn ignition_never_travels_in_args_or_env() {
        let km = kvm_machine(
            "m",
            json!({"resources": {"cpu": 1, "memory": "1Gi", "disk": "2Gi"}}),
        );
        let facts = MachineFacts {
            cluster: "c".into(),
            control_plane: true,
            failure_domain: None,
        };
        let secret = ignition_secret(
            &km,
            &facts,
            b"{\"token\":\"abcdef.0123456789abcdef\"}".to_vec(),
            &rendered_from("m-bootstrap", "42"),
        );
        assert!(
            !serde_json::to_string(&secret.metadata)
                .unwrap()
                .contains("abcdef"),
            "bootstrap data leaked into the Secret's metadata"
        );
        let pod = machine_pod(&km, &facts, &MachineDefaults::default()).unwrap();
        let text = serde_json::to_string(&pod).unwrap();
        assert!(!text.contains("abcdef.0123456789abcdef"));
        let c = &pod.spec.as_ref().unwrap().containers[0];
        assert!(c.env.is_none());
        let vol = pod.spec.as_ref().unwrap().volumes.as_ref().unwrap();
        let ign = vol.iter().find(|v| v.name == "ignition").unwrap();
        assert_eq!(ign.secret.as_ref().unwrap().default_mode, Some(0o400));
        assert_eq!(
            ign.secret.as_ref().unwrap().secret_name.as_deref(),
            secret.metadata.name.as_deref()
        );
    }

    #[test]
    fn the_launcher_accepts_the_arguments_the_controller_builds() {
        use clap::Parser;
        for (control_plane, spec) in [
            (
                true,
                json!({"resources": {"cpu": 2, "memory": "4Gi", "disk": "20Gi"},
                       "etcdStorage": {"type": "persistentVolume", "size": "8Gi"},
                       "ntp": {"servers": ["10.0.0.1", "pool.ntp.example"]}}),
            ),
            (
                false,
                json!({"resources": {"cpu": 1, "memory": "1Gi", "disk": "20Gi", "kubeletVolumeSize": "3Gi"},
                       "hostVolumes": [{"mountTag": "data", "hostPath": "/srv"}],
                       "accel": "tcg"}),
            ),
        ] {
            let km = kvm_machine("m", spec);
            let facts = MachineFacts {
                cluster: "c".into(),
                control_plane,
                failure_domain: None,
            };
            let pod = machine_pod(&km, &facts, &MachineDefaults::default()).unwrap();
            let c = &pod.spec.unwrap().containers[0];
            let argv = c
                .command
                .clone()
                .unwrap()
                .into_iter()
                .chain(c.args.clone().unwrap());
            if let Err(e) = capk_launcher::cli::Cli::try_parse_from(argv) {
                panic!("capk-launcher rejects the Pod's arguments: {e}");
            }
        }
    }

    #[test]
    fn a_lost_pod_turns_ready_false_but_keeps_provisioned() {
        let t0: k8s_openapi::jiff::Timestamp = "2026-01-01T00:00:00Z".parse().unwrap();
        let mut km = kvm_machine(
            "m",
            json!({"resources": {"cpu": 1, "memory": "1Gi", "disk": "2Gi"}}),
        );
        let running = MachineState::Running {
            pod: "m".into(),
            ip: "10.0.0.5".into(),
        };
        km.status = Some(status(&km, &running, &[], Some("zone-a"), t0));
        let lost = status(
            &km,
            &MachineState::PodMissing,
            &pod_conditions(None),
            Some("zone-a"),
            t0,
        );
        let ready = lost
            .conditions
            .as_ref()
            .unwrap()
            .iter()
            .find(|c| c.type_ == "Ready")
            .unwrap();
        assert_eq!(
            (ready.status.as_str(), ready.reason.as_str()),
            ("False", "MachinePodMissing")
        );
        // The contract: provisioned never goes back to false.
        assert_eq!(lost.initialization.unwrap().provisioned, Some(true));
        assert_eq!(lost.failure_domain.as_deref(), Some("zone-a"));
    }

    fn pod(status: serde_json::Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "m"},
            "spec": {"nodeName": "mc-node-1", "containers": [{"name": "launcher"}]},
            "status": status,
        }))
        .unwrap()
    }

    fn summary(cs: &[crate::conditions::DesiredCondition]) -> Vec<(&str, bool, String)> {
        cs.iter()
            .map(|c| (c.type_, c.status, c.reason.to_string()))
            .collect()
    }

    #[test]
    fn pod_conditions_tell_the_story_of_the_machine_pod() {
        let none = pod_conditions(None);
        assert!(none.iter().all(|c| !c.status && c.reason == "NoMachinePod"));

        let unschedulable = pod(json!({"phase": "Pending", "conditions": [{
            "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
            "message": "0/3 nodes are available: 3 Insufficient memory."}]}));
        let cs = pod_conditions(Some(&unschedulable));
        assert_eq!(
            summary(&cs)[0],
            ("PodScheduled", false, "Unschedulable".into())
        );
        assert!(cs[0].message.contains("Insufficient memory"));

        let crashing = pod(json!({"phase": "Running",
            "conditions": [{"type": "PodScheduled", "status": "True"}],
            "containerStatuses": [{"name": "launcher", "ready": false, "restartCount": 3,
                "image": "i", "imageID": "", "state": {"waiting": {"reason": "CrashLoopBackOff",
                "message": "back-off 40s restarting failed container"}},
                "lastState": {"terminated": {"exitCode": 1,
                "message": "qemu exited: guest panicked"}}}]}));
        let cs = pod_conditions(Some(&crashing));
        assert_eq!(
            summary(&cs),
            vec![
                ("PodScheduled", true, "Scheduled".into()),
                ("VMRunning", false, "CrashLoopBackOff".into()),
                ("BootstrapCompleted", false, "WaitingForBootstrap".into()),
            ]
        );
        assert!(
            cs[1].message.contains("guest panicked"),
            "{}",
            cs[1].message
        );
        assert!(cs[1].message.contains("restarts: 3"), "{}", cs[1].message);

        let ready = pod(json!({"phase": "Running",
            "conditions": [{"type": "PodScheduled", "status": "True"}],
            "containerStatuses": [{"name": "launcher", "ready": true, "restartCount": 0,
                "image": "i", "imageID": "", "state": {"running": {}}}]}));
        assert_eq!(
            summary(&pod_conditions(Some(&ready))),
            vec![
                ("PodScheduled", true, "Scheduled".into()),
                ("VMRunning", true, "LauncherRunning".into()),
                ("BootstrapCompleted", true, "BootstrapSucceeded".into()),
            ]
        );

        // The startup probe passed (started) before the readiness probe's next period: the
        // bootstrap is complete. Without a startup probe (a Pod of an older controller),
        // `started` only means the container runs.
        let started = |probe: bool| {
            let mut p = pod(json!({"phase": "Running",
                "conditions": [{"type": "PodScheduled", "status": "True"}],
                "containerStatuses": [{"name": "launcher", "ready": false, "started": true,
                    "restartCount": 0, "image": "i", "imageID": "", "state": {"running": {}}}]}));
            if probe {
                p.spec.as_mut().unwrap().containers[0].startup_probe = Some(Default::default());
            }
            let c = &pod_conditions(Some(&p))[2];
            (c.type_, c.status, c.reason.to_string())
        };
        assert_eq!(
            started(true),
            ("BootstrapCompleted", true, "BootstrapSucceeded".into())
        );
        assert_eq!(
            started(false),
            ("BootstrapCompleted", false, "WaitingForBootstrap".into())
        );

        // A reason that is not a condition reason is replaced, not copied.
        let odd = pod(json!({"phase": "Pending", "conditions": [{
            "type": "PodScheduled", "status": "False", "reason": "no good"}]}));
        assert_eq!(pod_conditions(Some(&odd))[0].reason, "Unschedulable");
    }

    #[test]
    fn bootstrap_errors_never_quote_the_bootstrap_data() {
        let token = "abcdef.0123456789abcdef";
        let key = "c2VjcmV0LWtleS1tYXRlcmlhbC0xMjM0NTY3ODkw";
        let km = kvm_machine(
            "m",
            json!({"resources": {"cpu": 1, "memory": "1Gi", "disk": "2Gi"}}),
        );
        let cloud = |body: String| (None, format!("#cloud-config\n{body}"));
        let cases = [
            cloud(format!(
                "write_files:\n- path: /etc/x\n  content: a\n  encoding: {token}\n"
            )),
            cloud(format!(
                "write_files:\n- path: /etc/x\n  content: a\n  permissions: {token}\n"
            )),
            cloud(format!("{token}: 1\n")),
            cloud(format!(
                "write_files:\n- path: /etc/x\n  content: a\n  encoding: {key}\n"
            )),
            (
                None,
                format!("## template: jinja\n#cloud-config\nruncmd:\n- echo {{{{ {token} }}}}\n"),
            ),
            (
                Some("ignition"),
                format!(
                    r#"{{"ignition":{{"version":"2.3.0"}},"storage":{{"files":[{{"path":"/x","filesystem":"root","mode":"{token}"}}]}}}}"#
                ),
            ),
            (
                Some("ignition"),
                format!(r#"{{"ignition":{{"version":"{token}"}}}}"#),
            ),
            (Some(token), "#cloud-config\n".to_owned()),
            // Many bad entries: a long message, still bounded.
            cloud(format!("runcmd:\n{}", "- [a, {b: c}]\n".repeat(5000))),
        ];
        for (format, data) in cases {
            let msg = render_ignition(&km, format, data.as_bytes()).unwrap_err();
            assert!(!msg.contains(token) && !msg.contains(key), "{msg}");
            assert!(
                msg.len() <= crate::redact::MAX_MESSAGE_BYTES,
                "{}",
                msg.len()
            );
        }
        // What is wrong is still said: the key path of the bad value.
        let (_, data) = cloud(format!(
            "write_files:\n- path: /etc/x\n  content: a\n  encoding: {token}\n"
        ));
        let msg = render_ignition(&km, None, data.as_bytes()).unwrap_err();
        assert!(msg.contains("`write_files[0].encoding`"), "{msg}");
    }

    #[test]
    fn a_size_the_launcher_cannot_take_is_a_spec_error_naming_its_field() {
        // 16Ei is a quantity above 0 (the CRD's rule) and more bytes than 64 bits hold.
        let km = kvm_machine(
            "m",
            json!({"resources": {"cpu": 1, "memory": "1Gi", "disk": "20Gi"},
                   "etcdStorage": {"type": "persistentVolume", "size": "16Ei"}}),
        );
        let facts = MachineFacts {
            cluster: "c".into(),
            control_plane: true,
            failure_domain: None,
        };
        let err = machine_pod(&km, &facts, &MachineDefaults::default()).unwrap_err();
        let msg = err.to_string();
        assert!(msg.starts_with("spec.etcdStorage.size: "), "{msg}");
        let t0: k8s_openapi::jiff::Timestamp = "2026-01-01T00:00:00Z".parse().unwrap();
        let st = status(&km, &MachineState::SpecInvalid(msg), &[], None, t0);
        let ready = crate::conditions::find(st.conditions.as_deref().unwrap(), "Ready").unwrap();
        assert_eq!(ready.reason, "SpecInvalid");
        assert!(
            ready.message.contains("spec.etcdStorage.size"),
            "{}",
            ready.message
        );
    }

    #[test]
    fn hostname_is_a_dns_label() {
        let km = kvm_machine(
            &format!("{}.x", "a".repeat(70)),
            json!({"resources": {"cpu": 1, "memory": "1Gi", "disk": "2Gi"}}),
        );
        let h = hostname(&km);
        assert!(
            h.len() <= 63 && !h.contains('.') && !h.ends_with('-'),
            "{h}"
        );
    }
}
