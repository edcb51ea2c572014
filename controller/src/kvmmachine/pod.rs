//! Pure: the machine Pod. It runs `capk-launcher run` as PID 1 with the machine's launch contract
//! ([`capk_api::launch`]) as flags; the Ignition is a file from the Ignition Secret's volume (mode 0400), never an
//! argument or an environment variable.

use std::collections::BTreeMap;

use capk_api::{
    byte_size::ByteSize,
    constants::{
        CLUSTER_NAME_LABEL, ETCD_VOLUME, MACHINE_ROLE_LABEL, NODE_READY_GATE, ROLE_CONTROL_PLANE,
    },
    etcd_owner,
    launch::{self, Launch, Role, Share, TcgThreads},
    v1alpha1::{Accel, EtcdStorageType, KVMMachine},
};
use k8s_openapi::{
    api::core::v1::{
        Affinity, Container, EmptyDirVolumeSource, ExecAction, NodeAffinity, NodeSelector,
        NodeSelectorRequirement, NodeSelectorTerm, PersistentVolumeClaimVolumeSource, Pod,
        PodAffinityTerm, PodAntiAffinity, PodReadinessGate, PodSpec, PreferredSchedulingTerm,
        Probe, ResourceRequirements, SecretVolumeSource, SecurityContext, Volume, VolumeMount,
        WeightedPodAffinityTerm,
    },
    apimachinery::pkg::{
        api::resource::Quantity,
        apis::meta::v1::{LabelSelector, ObjectMeta},
    },
};
use kube::Resource;

use super::{
    ignition_secret::IGNITION_KEY,
    names::{self, MachineNames, hostname},
    node_image, overhead,
    placement::MachinePlacement,
    pod_layout::{
        ETCD_DIR, IGNITION_DIR, IMAGE_DIR, SECRET_DIR, SECRET_VOLUME_SIZE, STATE_DIR, host_path,
        mount,
    },
    validate::ValidSpec,
};
use crate::{
    k8s::ownership::{Home, Owner},
    settings::MachineDefaults,
};

/// Seconds the launcher gives the guest for an ACPI shutdown before killing QEMU.
pub const GUEST_SHUTDOWN_SECONDS: i64 = 300;

/// The machine Pod of a spec that passed [`validate`](super::validate::validate), made in
/// `home` under `names` (with the Ignition Secret and etcd PVC of those names): the launcher
/// container running the machine's [`Launch`] contract, the volumes that contract names, the
/// VM's resources plus the overhead, and the node-image init containers.
pub fn machine_pod(
    km: &KVMMachine,
    placement: &MachinePlacement,
    home: &Home,
    names: &MachineNames,
    valid: &ValidSpec,
    defaults: &MachineDefaults,
) -> Pod {
    let spec = &km.spec;
    let node_image = node_image::plan(km, defaults);
    let mut launch = launch_contract(km, placement, valid, defaults, node_image.path);
    let mut storage = base_storage(names, valid);
    storage.volumes.extend(node_image.volumes);
    if placement.control_plane {
        etcd_storage(km, names, valid, &mut storage, &mut launch);
    } else {
        host_volumes(valid, &mut storage, &mut launch);
    }
    let accel = defaults.accel(spec.accel);
    let tcg_cache_mib = overhead::tcg_cache_mib(accel, defaults.tcg_translation_cache_mib);
    let resources = resources(&launch, defaults, tcg_cache_mib, storage.empty_dir_bytes);
    let container = launcher_container(defaults, &launch, resources, storage.mounts);
    // Init containers get the launcher's resources: the Pod keeps Guaranteed QoS, and its
    // effective request (the larger of init and app containers) does not grow.
    let mut init_containers = node_image.init_containers;
    for c in &mut init_containers {
        c.resources = container.resources.clone();
    }

    Pod {
        metadata: ObjectMeta {
            name: Some(names.pod.clone()),
            namespace: Some(home.namespace.clone()),
            labels: Some(names::labels(km, placement)),
            // `kubectl logs|exec POD` go to the launcher (the console, capk-launcher status)
            // without `-c launcher` and without naming the init containers.
            annotations: Some(BTreeMap::from([(
                "kubectl.kubernetes.io/default-container".to_owned(),
                "launcher".to_owned(),
            )])),
            owner_references: Owner::machine(km).owner_references(home),
            ..Default::default()
        },
        spec: Some(PodSpec {
            hostname: Some(hostname(km)),
            init_containers: (!init_containers.is_empty()).then_some(init_containers),
            containers: vec![container],
            volumes: Some(storage.volumes),
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
            affinity: affinity(placement, defaults, accel),
            ..Default::default()
        }),
        status: None,
    }
}

/// What the launcher is asked to run (the volumes' parts come with the volumes).
fn launch_contract(
    km: &KVMMachine,
    placement: &MachinePlacement,
    valid: &ValidSpec,
    defaults: &MachineDefaults,
    image: String,
) -> Launch {
    let spec = &km.spec;
    let accel = defaults.accel(spec.accel);
    let tcg_cache_mib = overhead::tcg_cache_mib(accel, defaults.tcg_translation_cache_mib);
    let mut launch = Launch {
        vcpus: valid.vcpus,
        memory: ByteSize(valid.memory),
        image: image.into(),
        disk_size: ByteSize(valid.disk),
        docker_disk_size: ByteSize(valid.docker_disk),
        kubelet_disk_size: ByteSize(valid.kubelet_disk),
        etcd_disk: None,
        etcd_disk_size: ByteSize(valid.etcd_disk),
        etcd_owner: None,
        host_volumes: Vec::new(),
        host_volumes_readonly: Vec::new(),
        state_dir: STATE_DIR.into(),
        secret_dir: SECRET_DIR.into(),
        ignition: Some(format!("{IGNITION_DIR}/{IGNITION_KEY}").into()),
        accel: match accel {
            Accel::Auto => launch::Accel::Auto,
            Accel::Kvm => launch::Accel::Kvm,
            Accel::Tcg => launch::Accel::Tcg,
        },
        // Under KVM there is no translation cache; the launcher's default stands for none.
        tcg_translation_cache_mib: u32::try_from(tcg_cache_mib)
            .ok()
            .filter(|mib| *mib != 0)
            .unwrap_or(launch::DEFAULT_TCG_TRANSLATION_CACHE_MIB),
        tcg_threads: if defaults.tcg_single_thread && tcg_cache_mib != 0 {
            TcgThreads::Single
        } else {
            TcgThreads::Multi
        },
        dns_servers: Vec::new(),
        dns_search: Vec::new(),
        ntp_servers: Vec::new(),
        hostname: Some(hostname(km)),
        role: if placement.control_plane {
            Role::ControlPlane
        } else {
            Role::Worker
        },
        grace_period_seconds: GUEST_SHUTDOWN_SECONDS.unsigned_abs(),
    };
    if let Some(dns) = &spec.dns {
        // Validation admitted only IPv4 servers and DNS names.
        launch.dns_servers = dns
            .servers
            .iter()
            .filter_map(|s| s.0.parse().ok())
            .collect();
        launch.dns_search = dns.searches.iter().map(|s| s.0.clone()).collect();
    }
    if let Some(ntp) = &spec.ntp {
        // The launcher hands NTP servers to the guest by DHCP, which carries addresses only.
        launch.ntp_servers = ntp
            .servers
            .iter()
            .filter_map(|s| s.0.parse().ok())
            .collect();
    }
    launch
}

/// The Pod's volumes and the launcher's mounts, and the bytes of its disk-backed emptyDirs
/// (counted in the Pod's ephemeral storage).
struct Storage {
    volumes: Vec<Volume>,
    mounts: Vec<VolumeMount>,
    empty_dir_bytes: u64,
}

/// The volumes every machine has: its Ignition Secret, the memory volume the merged Ignition is
/// written to, the state volume of its disks and the node image.
fn base_storage(names: &MachineNames, valid: &ValidSpec) -> Storage {
    let (disk, docker, kubelet) = (valid.disk, valid.docker_disk, valid.kubelet_disk);
    // No hostPath volumes for /dev/kvm and /dev/net/tun: a privileged container sees the node's
    // devices, and a node without /dev/kvm must still start the Pod (accel auto falls back to TCG).
    let volumes = vec![
        Volume {
            name: "ignition".into(),
            secret: Some(SecretVolumeSource {
                secret_name: Some(names.ignition_secret.clone()),
                default_mode: Some(0o400),
                ..Default::default()
            }),
            ..Default::default()
        },
        // The merged Ignition (bootstrap secrets, CA keys on a first control plane) lives here
        // until QEMU has read it: memory, not the node's disk. Its at most 2 MiB are charged to
        // the Pod's memory, within the fixed overhead (see overhead.rs).
        Volume {
            name: "secret".into(),
            empty_dir: Some(EmptyDirVolumeSource {
                medium: Some("Memory".into()),
                size_limit: Some(Quantity(SECRET_VOLUME_SIZE.into())),
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
    let mounts = vec![
        mount("ignition", IGNITION_DIR, true),
        mount("secret", SECRET_DIR, false),
        mount("state", STATE_DIR, false),
        mount("image", IMAGE_DIR, true),
    ];
    Storage {
        volumes,
        mounts,
        empty_dir_bytes: disk + docker + kubelet,
    }
}

/// A control plane's etcd volume: its PVC, a directory per machine under the spec's hostPath,
/// or (no storage configured) an emptyDir next to the VM disks, lost with the Pod.
fn etcd_storage(
    km: &KVMMachine,
    names: &MachineNames,
    valid: &ValidSpec,
    storage: &mut Storage,
    launch: &mut Launch,
) {
    let spec = &km.spec;
    let configured = spec.etcd_storage.as_ref();
    let etcd_bytes = valid.etcd_disk;
    let volume = match configured {
        Some(s) if s.type_ == EtcdStorageType::PersistentVolume => Volume {
            name: ETCD_VOLUME.into(),
            persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                claim_name: names.etcd_claim.clone(),
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
                names::etcd_dir_name(km)
            );
            host_path(ETCD_VOLUME, &dir, "DirectoryOrCreate")
        }
        // No storage configured: etcd lives next to the VM disks (lost with the Pod).
        None => {
            storage.empty_dir_bytes += etcd_bytes;
            Volume {
                name: ETCD_VOLUME.into(),
                empty_dir: Some(EmptyDirVolumeSource::default()),
                ..Default::default()
            }
        }
    };
    storage.volumes.push(volume);
    storage.mounts.push(mount(ETCD_VOLUME, ETCD_DIR, false));
    launch.etcd_disk = Some(format!("{ETCD_DIR}/{}", etcd_owner::DISK_FILE).into());
    // The launcher marks the etcd directory as this KVMMachine's (by UID) and refuses one
    // marked for another; the cleanup removes only a directory so marked.
    launch.etcd_owner = Some(super::etcd_cleanup::owner_of(km));
}

/// A worker's host volumes: the tenant's whole share as a hostPath, the sub-path opened by the
/// launcher inside it.
fn host_volumes(valid: &ValidSpec, storage: &mut Storage, launch: &mut Launch) {
    for hv in &valid.host_volumes {
        let name = format!("hostvol-{}", sanitize(&hv.mount_tag));
        let mount_path = format!("/var/lib/capk/host-volumes/{}", hv.mount_tag);
        // The share itself is the hostPath: the kubelet follows links in a hostPath, and the
        // share's path is the operator's (a link a guest left in the share is a sub-path,
        // which the launcher refuses to follow).
        storage
            .volumes
            .push(host_path(&name, &hv.share, "Directory"));
        // Read-only twice: the Pod's mount (nothing in the Pod writes it) and the 9p export
        // (the guest cannot, even through a QEMU that could).
        storage.mounts.push(mount(&name, &mount_path, hv.read_only));
        let share = Share {
            tag: hv.mount_tag.clone(),
            path: if hv.sub_path.is_empty() {
                mount_path.into()
            } else {
                format!("{mount_path}/{}", hv.sub_path).into()
            },
        };
        if hv.read_only {
            launch.host_volumes_readonly.push(share);
        } else {
            launch.host_volumes.push(share);
        }
    }
}

/// The VM's vCPUs and memory plus the launcher's and QEMU's overhead, and the ephemeral storage
/// of its disks.
fn resources(
    launch: &Launch,
    defaults: &MachineDefaults,
    tcg_cache_mib: u64,
    empty_dir_bytes: u64,
) -> ResourceRequirements {
    let vcpus = u64::from(launch.vcpus);
    let memory = launch.memory.0;
    let overhead_bytes = overhead::memory_bytes(vcpus, memory, tcg_cache_mib);
    // One whole core per vCPU by default (Guaranteed QoS: requests = limits). With an allocation
    // ratio N > 1 the Pod requests 1/N of that (vCPUs and overhead alike: requests are then the
    // Pods' relative shares) and the CPU is not limited (Burstable): vCPUs share the node's
    // cores, as KubeVirt's cpuAllocationRatio does. Memory is never overcommitted.
    let ratio = defaults.cpu_allocation_ratio.max(1) as u64;
    let cpu_millis = (vcpus * 1000 + overhead::CPU_MILLIS).div_ceil(ratio);
    let memory_quantity = Quantity((memory + overhead_bytes).to_string());
    // Ephemeral storage: the limit covers the VM disks' volumes and what the container writes
    // besides (console copy, logs); the request only the latter, because the disks are sparse
    // files that grow as the guest writes, and requesting their full size (tens of GiB per
    // machine with the templates' defaults) would keep machines off nodes they fit on for long.
    // QoS is decided by CPU and memory only.
    let ephemeral = |bytes: u64| ("ephemeral-storage".to_owned(), Quantity(bytes.to_string()));
    let ephemeral_request = ephemeral(overhead::WRITABLE_MIB << 20);
    let ephemeral_limit = ephemeral(overhead::ephemeral_storage_limit_bytes(empty_dir_bytes));
    let requests = BTreeMap::from([
        ("cpu".to_owned(), Quantity(format!("{cpu_millis}m"))),
        ("memory".to_owned(), memory_quantity.clone()),
        ephemeral_request,
    ]);
    let mut limits = BTreeMap::from([("memory".to_owned(), memory_quantity), ephemeral_limit]);
    if ratio == 1 {
        limits.insert("cpu".to_owned(), requests["cpu"].clone());
    }
    ResourceRequirements {
        requests: Some(requests),
        limits: Some(limits),
        ..Default::default()
    }
}

/// The launcher container: PID 1 running `launch`, privileged, with exec probes.
fn launcher_container(
    defaults: &MachineDefaults,
    launch: &Launch,
    resources: ResourceRequirements,
    mounts: Vec<VolumeMount>,
) -> Container {
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

    Container {
        name: "launcher".into(),
        image: Some(defaults.launcher_image.clone()),
        image_pull_policy: Some("IfNotPresent".into()),
        command: Some(vec!["capk-launcher".into()]),
        args: Some(
            std::iter::once("run".to_owned())
                .chain(launch.to_args())
                .collect(),
        ),
        security_context: Some(SecurityContext {
            privileged: Some(true),
            ..Default::default()
        }),
        resources: Some(resources),
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
    }
}

/// Control-plane Pods of a cluster spread over MC nodes; the Pod in its failure domain's zone and,
/// by the operator's KVM policy, on (or preferably on) a node with the KVM label.
fn affinity(
    placement: &MachinePlacement,
    defaults: &MachineDefaults,
    accel: Accel,
) -> Option<Affinity> {
    let mut affinity = Affinity::default();
    if placement.control_plane {
        let term = PodAffinityTerm {
            label_selector: Some(LabelSelector {
                match_labels: Some(BTreeMap::from([
                    (CLUSTER_NAME_LABEL.to_owned(), placement.cluster.clone()),
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
    let requirement = |key: &str, value: &str| NodeSelectorRequirement {
        key: key.into(),
        operator: "In".into(),
        values: Some(vec![value.into()]),
    };
    let mut required = Vec::new();
    if let Some(fd) = &placement.failure_domain {
        required.push(requirement("topology.kubernetes.io/zone", fd));
    }
    let (label, value) = &defaults.kvm_node_label;
    let kvm_node = defaults.kvm_node(accel);
    if kvm_node == Some(true) {
        required.push(requirement(label, value));
    }
    let node_affinity = NodeAffinity {
        // One term: its requirements must all hold.
        required_during_scheduling_ignored_during_execution: (!required.is_empty()).then(|| {
            NodeSelector {
                node_selector_terms: vec![NodeSelectorTerm {
                    match_expressions: Some(required),
                    ..Default::default()
                }],
            }
        }),
        preferred_during_scheduling_ignored_during_execution: (kvm_node == Some(false)).then(
            || {
                vec![PreferredSchedulingTerm {
                    weight: 100,
                    preference: NodeSelectorTerm {
                        match_expressions: Some(vec![requirement(label, value)]),
                        ..Default::default()
                    },
                }]
            },
        ),
    };
    if node_affinity != NodeAffinity::default() {
        affinity.node_affinity = Some(node_affinity);
    }
    (affinity != Affinity::default()).then_some(affinity)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kvmmachine::{
        ignition_secret,
        testing::{kvm_machine, management},
    };
    use crate::settings::NodeImageSource;
    use serde_json::json;

    /// An operator who allows host volumes under /srv (namespace team-a's in /srv/team-a), the
    /// test's etcd directory and the PriorityClass `workload-vms`.
    fn lenient() -> crate::settings::TenantPolicy {
        crate::settings::TenantPolicy {
            host_volume_prefixes: vec!["/srv".into()],
            etcd_host_path_prefixes: vec!["/var/lib/capk-etcd".into()],
            priority_classes: vec!["workload-vms".into()],
            ..Default::default()
        }
    }

    /// A placement in cluster `c`, no failure domain.
    fn in_cluster_c(control_plane: bool) -> MachinePlacement {
        MachinePlacement {
            cluster: "c".into(),
            control_plane,
            failure_domain: None,
        }
    }

    /// The Pod of a spec that must pass validation.
    fn build(km: &KVMMachine, placement: &MachinePlacement, defaults: &MachineDefaults) -> Pod {
        let valid =
            crate::kvmmachine::validate::validate(km, placement, defaults, &lenient()).unwrap();
        let home = management();
        let names = MachineNames::in_home(km, &home);
        machine_pod(km, placement, &home, &names, &valid, defaults)
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
        let placement = MachinePlacement {
            cluster: "demo".into(),
            control_plane: true,
            failure_domain: Some("zone-a".into()),
        };
        let pod = build(&km, &placement, &MachineDefaults::default());
        insta::assert_yaml_snapshot!(pod);
    }

    #[test]
    fn worker_pod_with_host_volumes_and_a_container_disk_image() {
        let km = kvm_machine(
            "demo-md-0-abcde",
            json!({
                "resources": {"cpu": 1, "memory": "1Gi", "disk": "20Gi", "dockerVolumeSize": "5Gi"},
                "hostVolumes": [{"mountTag": "Data_1", "hostPath": "/srv/team-a"},
                                {"mountTag": "reference", "hostPath": "/srv/team-a/ref/v1", "readOnly": true}],
                "image": {"containerImage": {"image": "capk-test-guest:v1"}},
                "nodeSelector": {"kvm": "true"},
                "priorityClassName": "workload-vms",
            }),
        );
        let placement = MachinePlacement {
            cluster: "demo".into(),
            control_plane: false,
            failure_domain: None,
        };
        let pod = build(&km, &placement, &MachineDefaults::default());
        insta::assert_yaml_snapshot!(pod);

        // With image volumes the runtime mounts the image: no init containers, no copy.
        let defaults = MachineDefaults {
            node_image_source: NodeImageSource::ImageVolume,
            ..Default::default()
        };
        let spec = build(&km, &placement, &defaults).spec.unwrap();
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
        let placement = in_cluster_c(false);
        let pod = build(&km, &placement, &MachineDefaults::default());
        let c = &pod.spec.unwrap().containers[0];
        let r = c.resources.as_ref().unwrap();
        let (requests, limits) = (r.requests.as_ref().unwrap(), r.limits.as_ref().unwrap());
        for k in ["cpu", "memory"] {
            assert_eq!(requests[k], limits[k], "Guaranteed QoS: {k}");
        }
        let mem: u64 = r.limits.as_ref().unwrap()["memory"].0.parse().unwrap();
        // 8 GiB + 256 MiB fixed + 4 x 16 MiB + 8 x 16 MiB + the 128 MiB translation cache
        // (accel auto may emulate)
        assert_eq!(mem, (8 << 30) + ((256 + 64 + 128 + 128) << 20));
        assert_eq!(r.limits.as_ref().unwrap()["cpu"].0, "4250m");

        // Overcommitted: 4 vCPUs and the overhead at ratio 10 request a tenth of 4250m, no CPU
        // limit; memory is still requested and limited in full.
        let dense = MachineDefaults {
            cpu_allocation_ratio: 10,
            ..MachineDefaults::default()
        };
        let pod = build(&km, &placement, &dense);
        let c = &pod.spec.unwrap().containers[0];
        let r = c.resources.as_ref().unwrap();
        let (requests, limits) = (r.requests.as_ref().unwrap(), r.limits.as_ref().unwrap());
        assert_eq!(requests["cpu"].0, "425m");
        assert!(!limits.contains_key("cpu"), "Burstable: no CPU limit");
        assert_eq!(requests["memory"], limits["memory"]);
    }

    #[test]
    fn the_operators_kvm_policy_places_machine_pods_and_picks_the_accelerator() {
        use crate::settings::KvmPolicy;
        let label = "infrastructure.cluster.x-k8s.io/kvm";
        let in_zone = MachinePlacement {
            failure_domain: Some("zone-a".into()),
            ..in_cluster_c(false)
        };
        // (required node label expressions, preferred ones, --accel, memory limit) of a machine.
        let placed = |accel: &str, kvm: KvmPolicy, placement: &MachinePlacement| {
            let km = kvm_machine(
                "m",
                json!({"accel": accel, "resources": {"cpu": 1, "memory": "1Gi", "disk": "2Gi"}}),
            );
            let defaults = MachineDefaults {
                kvm,
                ..MachineDefaults::default()
            };
            let spec = build(&km, placement, &defaults).spec.unwrap();
            let node = spec
                .affinity
                .and_then(|a| a.node_affinity)
                .unwrap_or_default();
            let keys = |term: &NodeSelectorTerm| -> Vec<String> {
                let exprs = term.match_expressions.clone().unwrap_or_default();
                exprs
                    .iter()
                    .map(|e| format!("{}={}", e.key, e.values.clone().unwrap().join(",")))
                    .collect()
            };
            let required: Vec<String> = node
                .required_during_scheduling_ignored_during_execution
                .map(|r| r.node_selector_terms.iter().flat_map(keys).collect())
                .unwrap_or_default();
            let preferred: Vec<String> = node
                .preferred_during_scheduling_ignored_during_execution
                .unwrap_or_default()
                .iter()
                .flat_map(|p| keys(&p.preference))
                .collect();
            let c = &spec.containers[0];
            let args = c.args.clone().unwrap_or_default();
            let accel = args.iter().find(|a| a.starts_with("--accel=")).cloned();
            let memory = c.resources.as_ref().unwrap().limits.as_ref().unwrap()["memory"]
                .0
                .clone();
            (required, preferred, accel.unwrap(), memory)
        };
        let on_kvm = format!("{label}=true");
        let zone = "topology.kubernetes.io/zone=zone-a".to_owned();
        let plain = in_cluster_c(false);

        // allow (the default): anywhere, auto may fall back to TCG.
        let (required, preferred, accel, emulated_memory) =
            placed("auto", KvmPolicy::Allow, &plain);
        assert!(required.is_empty() && preferred.is_empty());
        assert_eq!(accel, "--accel=auto");
        assert!(
            placed("kvm", KvmPolicy::Allow, &plain).0.is_empty(),
            "as before: no label asked"
        );
        // prefer: auto would rather be on a KVM node; kvm must be.
        let (required, preferred, accel, _) = placed("auto", KvmPolicy::Prefer, &plain);
        assert_eq!((required, preferred), (vec![], vec![on_kvm.clone()]));
        assert_eq!(accel, "--accel=auto");
        assert_eq!(
            placed("kvm", KvmPolicy::Prefer, &plain).0,
            vec![on_kvm.clone()]
        );
        assert!(placed("tcg", KvmPolicy::Prefer, &plain).0.is_empty());
        // require: auto runs as kvm on a KVM node of its zone, and its Pod holds no TCG cache.
        let (required, preferred, accel, memory) = placed("auto", KvmPolicy::Require, &in_zone);
        assert_eq!(required, [zone, on_kvm]);
        assert!(preferred.is_empty());
        assert_eq!(accel, "--accel=kvm");
        let mib = |q: &str| q.parse::<u64>().unwrap() >> 20;
        assert_eq!(
            mib(&emulated_memory) - mib(&memory),
            128,
            "the TCG cache is not reserved"
        );
    }

    #[test]
    fn a_larger_tcg_translation_cache_reaches_qemu_and_the_pods_memory_unless_kvm_is_required() {
        let placement = in_cluster_c(false);
        let emulated = MachineDefaults {
            tcg_translation_cache_mib: 1024,
            ..MachineDefaults::default()
        };
        let memory_and_args = |accel: &str, defaults: &MachineDefaults| {
            let km = kvm_machine(
                "m",
                json!({"accel": accel, "resources": {"cpu": 1, "memory": "1Gi", "disk": "2Gi"}}),
            );
            let pod = build(&km, &placement, defaults);
            let c = pod.spec.unwrap().containers[0].clone();
            let mem: u64 = c.resources.unwrap().limits.unwrap()["memory"]
                .0
                .parse()
                .unwrap();
            (mem, c.args.unwrap_or_default())
        };
        let flag = "--tcg-translation-cache-mib=1024".to_owned();
        // accel kvm never emulates: no cache, no flag.
        let (base, args) = memory_and_args("kvm", &emulated);
        assert_eq!(base, (1 << 30) + ((256 + 16 + 16) << 20));
        assert!(!args.contains(&flag));
        // Default (128 MiB, the launcher's own default): the cache on top.
        let (mem, args) = memory_and_args("auto", &MachineDefaults::default());
        assert_eq!(mem, base + (128 << 20));
        assert!(args.contains(&"--tcg-translation-cache-mib=128".to_owned()));
        // 1 GiB: QEMU is told, and the Pod holds all of it.
        for accel in ["auto", "tcg"] {
            let (mem, args) = memory_and_args(accel, &emulated);
            assert_eq!(mem, base + (1024 << 20), "{accel}");
            assert!(args.contains(&flag), "{accel}: {args:?}");
        }
        // One thread for all vCPUs is the operator's choice for machines that may be emulated;
        // the launcher's default is a thread per vCPU, and KVM machines never get it.
        let single = "--tcg-threads=single".to_owned();
        assert!(!memory_and_args("auto", &emulated).1.contains(&single));
        let one_thread = MachineDefaults {
            tcg_single_thread: true,
            ..MachineDefaults::default()
        };
        for accel in ["auto", "tcg"] {
            assert!(
                memory_and_args(accel, &one_thread).1.contains(&single),
                "{accel}"
            );
        }
        assert!(!memory_and_args("kvm", &one_thread).1.contains(&single));
    }

    #[test]
    fn ignition_never_travels_in_args_or_env() {
        let km = kvm_machine(
            "m",
            json!({"resources": {"cpu": 1, "memory": "1Gi", "disk": "2Gi"}}),
        );
        let placement = in_cluster_c(true);
        let secret = ignition_secret::desired(
            &km,
            &placement,
            &management(),
            &MachineNames::in_home(&km, &management()),
            b"{\"token\":\"abcdef.0123456789abcdef\"}".to_vec(),
            &ignition_secret::rendered_from("m-bootstrap", "42"),
        );
        assert!(
            !serde_json::to_string(&secret.metadata)
                .unwrap()
                .contains("abcdef"),
            "bootstrap data leaked into the Secret's metadata"
        );
        let pod = build(&km, &placement, &MachineDefaults::default());
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

    /// The kubelet counts the disk-backed emptyDirs (VM disks; etcd's without storage of its
    /// own), the writable layer (the console copy) and the logs against the Pod's
    /// ephemeral-storage limit: the limit is the volumes' sizes plus 128 MiB, the request the
    /// 128 MiB the container writes besides its sparse disks.
    #[test]
    fn ephemeral_storage_covers_the_disks_and_the_writable_layer() {
        let storage = |km: &KVMMachine, control_plane| {
            let c = build(
                km,
                &in_cluster_c(control_plane),
                &MachineDefaults::default(),
            )
            .spec
            .unwrap()
            .containers
            .remove(0);
            let r = c.resources.unwrap();
            let get = |m: Option<BTreeMap<String, Quantity>>| -> u64 {
                m.unwrap()["ephemeral-storage"].0.parse().unwrap()
            };
            (get(r.requests), get(r.limits))
        };
        let worker = kvm_machine(
            "w",
            json!({"resources": {"cpu": 1, "memory": "1Gi", "disk": "20Gi",
                                 "dockerVolumeSize": "40Gi", "kubeletVolumeSize": "2Gi"}}),
        );
        assert_eq!(
            storage(&worker, false),
            (128 << 20, (62u64 << 30) + (128 << 20))
        );
        // etcd without storage of its own lives in an emptyDir beside the disks.
        let cp = kvm_machine(
            "cp",
            json!({"resources": {"cpu": 1, "memory": "1Gi", "disk": "20Gi",
                                 "dockerVolumeSize": "5Gi", "kubeletVolumeSize": "1Gi"}}),
        );
        let etcd = MachineDefaults::default().etcd_volume_bytes;
        assert_eq!(
            storage(&cp, true),
            (128 << 20, (26u64 << 30) + etcd + (128 << 20))
        );
    }

    /// The launcher writes the merged Ignition (CA keys on a first control plane) to
    /// `--secret-dir`: a memory emptyDir with a small size limit, never the node's disk.
    #[test]
    fn the_merged_ignition_goes_to_a_memory_volume() {
        let km = kvm_machine(
            "m",
            json!({"resources": {"cpu": 1, "memory": "1Gi", "disk": "2Gi"}}),
        );
        let spec = build(&km, &in_cluster_c(true), &MachineDefaults::default())
            .spec
            .unwrap();
        let c = &spec.containers[0];
        let args = c.args.as_ref().unwrap();
        let dir = args
            .iter()
            .find_map(|a| a.strip_prefix("--secret-dir="))
            .expect("--secret-dir");
        let mount = c
            .volume_mounts
            .iter()
            .flatten()
            .find(|m| m.mount_path == dir)
            .expect("a volume at --secret-dir");
        let volume = spec
            .volumes
            .iter()
            .flatten()
            .find(|v| v.name == mount.name)
            .unwrap();
        let empty_dir = volume.empty_dir.as_ref().expect("an emptyDir");
        assert_eq!(empty_dir.medium.as_deref(), Some("Memory"));
        assert_eq!(empty_dir.size_limit, Some(Quantity("2Mi".into())));
    }
}
