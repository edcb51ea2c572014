//! Pure: the rules of a KVMMachine's spec that its CRD schema cannot express, and everything
//! `capk-launcher run` (or the apiserver, for the machine Pod) would refuse. It runs before
//! anything is applied: a spec that breaks a rule is a `SpecInvalid` condition naming each
//! field, never a half-built machine or a crash-looping Pod.

use std::net::Ipv4Addr;

use capk_api::{
    quantity::SizeQuantity,
    v1alpha1::{Accel, KVMMachine, KVMMachineSpec},
};
use kube::ResourceExt;

use super::{node_image::HOST_IMAGE_CACHE, overhead, placement::MachinePlacement};
use crate::settings::{
    KeyPatterns, KvmPolicy, MachineDefaults, TenantPolicy, is_reserved_label_key,
};

use capk_api::limits::{MAX_VCPUS, MIN_DISK, MIN_MEMORY, MIN_VCPUS, SizeBound};

/// The data disks (containerd, kubelet, etcd) need only be there; the CRD asks them positive.
const ONE_BYTE: SizeBound = SizeBound {
    quantity: "1",
    bytes: 1,
};

/// A spec that passed [`validate`], with its sizes in bytes (defaults filled in): what the
/// builders use, so they cannot fail.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ValidSpec {
    /// vCPUs.
    pub vcpus: u32,
    /// Guest memory.
    pub memory: u64,
    /// Root disk.
    pub disk: u64,
    /// containerd disk.
    pub docker_disk: u64,
    /// kubelet disk.
    pub kubelet_disk: u64,
    /// etcd disk (control-plane machines).
    pub etcd_disk: u64,
    /// Host volumes, each in its namespace's share.
    pub host_volumes: Vec<ValidHostVolume>,
}

/// A host volume that passed [`validate`]: the machine Pod mounts the tenant's whole share (a
/// directory the operator made, whose path has no part the tenant chose but the namespace), and
/// the launcher opens the sub-path inside it without following links. The kubelet, which follows
/// links in a hostPath, never sees a path a guest could have put a link into.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ValidHostVolume {
    /// The 9p mount tag.
    pub mount_tag: String,
    /// `<allowed directory>/<namespace>`: the hostPath volume.
    pub share: String,
    /// The directory inside `share` (`a/b`; empty for the share itself): no empty, `.` or `..`
    /// element.
    pub sub_path: String,
    /// Exported read-only.
    pub read_only: bool,
}

/// One rule a field breaks.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct FieldError {
    /// The field's path, e.g. `spec.dns.servers[1]`.
    pub field: String,
    /// What is wrong and what to write instead.
    pub reason: String,
}

/// Every rule the spec breaks, in field order.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
pub struct SpecErrors(pub Vec<FieldError>);

/// Checks `km`'s spec for a machine placed as `placement`, with `defaults` for what it leaves
/// out and `policy` for what it may reach past its VM (host paths, placement).
pub fn validate(
    km: &KVMMachine,
    placement: &MachinePlacement,
    defaults: &MachineDefaults,
    policy: &TenantPolicy,
) -> Result<ValidSpec, SpecErrors> {
    let spec = &km.spec;
    let mut errors = Vec::new();
    let mut valid = resources(spec, placement, defaults, &mut errors);
    sums_fit(spec, defaults, &valid, &mut errors);
    dns(spec, &mut errors);
    accel(spec, defaults, &mut errors);
    valid.host_volumes = host_volumes(km, policy, &mut errors);
    etcd_host_path(spec, placement, policy, &mut errors);
    node_image(spec, &mut errors);
    node_selector(spec, policy, &mut errors);
    tolerations(spec, policy, &mut errors);
    priority_class(spec, policy, &mut errors);
    if !errors.is_empty() {
        return Err(SpecErrors(errors));
    }
    Ok(valid)
}

/// The sizes (defaults filled in, each at least its bound) and the vCPUs.
fn resources(
    spec: &KVMMachineSpec,
    placement: &MachinePlacement,
    defaults: &MachineDefaults,
    errors: &mut Vec<FieldError>,
) -> ValidSpec {
    let mut fail = |field: String, reason: String| errors.push(FieldError { field, reason });
    let vcpus = match u32::try_from(spec.resources.cpu) {
        Ok(n @ MIN_VCPUS..=MAX_VCPUS) => n,
        _ => {
            fail(
                "spec.resources.cpu".into(),
                format!("must be {MIN_VCPUS} to {MAX_VCPUS} vCPUs"),
            );
            MIN_VCPUS
        }
    };
    let mut size = |q: Option<&SizeQuantity>, field: &str, default: u64, min: SizeBound| match q {
        None => default,
        Some(q) => match q.bytes() {
            Ok(b) if b >= min.bytes => b,
            Ok(_) => {
                fail(
                    field.into(),
                    format!("{q} is below the minimum of {}", min.quantity),
                );
                default
            }
            Err(e) => {
                fail(field.into(), e.to_string());
                default
            }
        },
    };
    let memory = size(
        Some(&spec.resources.memory),
        "spec.resources.memory",
        MIN_MEMORY.bytes,
        MIN_MEMORY,
    );
    let disk = size(
        Some(&spec.resources.disk),
        "spec.resources.disk",
        MIN_DISK.bytes,
        MIN_DISK,
    );
    let docker_disk = size(
        spec.resources.docker_volume_size.as_ref(),
        "spec.resources.dockerVolumeSize",
        defaults.docker_volume_bytes,
        ONE_BYTE,
    );
    let kubelet_disk = size(
        spec.resources.kubelet_volume_size.as_ref(),
        "spec.resources.kubeletVolumeSize",
        defaults.kubelet_volume_bytes,
        ONE_BYTE,
    );
    // The etcd disk is only made for a control plane: a worker's etcdStorage is not used.
    let etcd_disk = match &spec.etcd_storage {
        Some(s) if placement.control_plane => size(
            s.size.as_ref(),
            "spec.etcdStorage.size",
            defaults.etcd_volume_bytes,
            ONE_BYTE,
        ),
        _ => defaults.etcd_volume_bytes,
    };
    ValidSpec {
        vcpus,
        memory,
        disk,
        docker_disk,
        kubelet_disk,
        etcd_disk,
        host_volumes: Vec::new(),
    }
}

/// The disks share the Pod's state volume, and the Pod's memory is the guest's and the
/// overhead: each sum must fit in 64 bits.
fn sums_fit(
    spec: &KVMMachineSpec,
    defaults: &MachineDefaults,
    valid: &ValidSpec,
    errors: &mut Vec<FieldError>,
) {
    let mut fail = |field: String, reason: String| errors.push(FieldError { field, reason });
    let ValidSpec {
        vcpus,
        memory,
        disk,
        docker_disk,
        kubelet_disk,
        ..
    } = *valid;
    if disk
        .checked_add(docker_disk)
        .and_then(|s| s.checked_add(kubelet_disk))
        .is_none()
    {
        fail(
            "spec.resources".into(),
            "disk, dockerVolumeSize and kubeletVolumeSize add up to more bytes than 64 bits hold"
                .into(),
        );
    }
    if memory
        .checked_add(overhead::memory_bytes(
            u64::from(vcpus),
            memory,
            overhead::tcg_cache_mib(
                defaults.accel(spec.accel),
                defaults.tcg_translation_cache_mib,
            ),
        ))
        .is_none()
    {
        fail(
            "spec.resources.memory".into(),
            "with the machine Pod's overhead it is more bytes than 64 bits hold".into(),
        );
    }
}

/// DNS servers the guest can be given by DHCPv4, search domains that are DNS names.
fn dns(spec: &KVMMachineSpec, errors: &mut Vec<FieldError>) {
    let mut fail = |field: String, reason: String| errors.push(FieldError { field, reason });
    if let Some(dns) = &spec.dns {
        for (i, s) in dns.servers.iter().enumerate() {
            if s.0.parse::<Ipv4Addr>().is_err() {
                fail(
                    format!("spec.dns.servers[{i}]"),
                    format!(
                        "{:?} is not an IPv4 address (the guest gets its DNS servers by DHCPv4)",
                        s.0
                    ),
                );
            }
        }
        for (i, s) in dns.searches.iter().enumerate() {
            if !capk_api::dns::is_name(s.0.trim_end_matches('.')) {
                fail(
                    format!("spec.dns.searches[{i}]"),
                    format!("{:?} is not a DNS domain name", s.0),
                );
            }
        }
    }
}

/// Each host volume inside its namespace's share of a directory the operator allows.
fn host_volumes(
    km: &KVMMachine,
    policy: &TenantPolicy,
    errors: &mut Vec<FieldError>,
) -> Vec<ValidHostVolume> {
    let mut fail = |field: String, reason: String| errors.push(FieldError { field, reason });
    let spec = &km.spec;
    let namespace = km.namespace().unwrap_or_else(|| "default".into());
    let mut host_volumes = Vec::new();
    for (i, v) in spec.host_volumes.iter().flatten().enumerate() {
        if let Err(e) = capk_api::mount_tag::check(&v.mount_tag) {
            fail(format!("spec.hostVolumes[{i}].mountTag"), e.to_string());
        }
        let field = format!("spec.hostVolumes[{i}].hostPath");
        if has_dot_dot(&v.host_path) {
            fail(
                field,
                "must not contain a '..' element (Kubernetes refuses such hostPath volumes)".into(),
            );
            continue;
        }
        match host_volume_share(policy, &namespace, &v.host_path) {
            Ok((share, sub_path)) => host_volumes.push(ValidHostVolume {
                mount_tag: v.mount_tag.clone(),
                share,
                sub_path,
                read_only: v.read_only == Some(true),
            }),
            Err(reason) => fail(field, format!("{:?} {reason}", v.host_path)),
        }
    }
    host_volumes
}

/// A control plane's etcd hostPath in a directory the operator allows etcd data in.
fn etcd_host_path(
    spec: &KVMMachineSpec,
    placement: &MachinePlacement,
    policy: &TenantPolicy,
    errors: &mut Vec<FieldError>,
) {
    let mut fail = |field: String, reason: String| errors.push(FieldError { field, reason });
    if let Some(path) = spec
        .etcd_storage
        .as_ref()
        .and_then(|s| s.host_path.as_ref())
        && has_dot_dot(path)
    {
        fail(
            "spec.etcdStorage.hostPath".into(),
            "must not contain a '..' element (Kubernetes refuses such hostPath volumes)".into(),
        );
    } else if let Some(path) = spec
        .etcd_storage
        .as_ref()
        .and_then(|s| s.host_path.as_ref())
        .filter(|_| placement.control_plane)
        && !TenantPolicy::allows(&policy.etcd_host_path_prefixes, path)
    {
        fail(
            "spec.etcdStorage.hostPath".into(),
            format!(
                "{path:?} is not in a directory the operator allows etcd data in (allowed: {}); \
                 use one of those, or etcdStorage.type persistentVolume",
                TenantPolicy::describe(&policy.etcd_host_path_prefixes)
            ),
        );
    }
}

/// What the machine Pod's fetch-image init container is given: a pinned release, a URL it can
/// hand to curl. (The CRD refuses `current` too; objects admitted under an older CRD may still
/// name it.)
fn node_image(spec: &KVMMachineSpec, errors: &mut Vec<FieldError>) {
    let mut fail = |field: String, reason: String| errors.push(FieldError { field, reason });
    if let Some(f) = spec.image.as_ref().and_then(|i| i.flatcar.as_ref())
        && !crate::settings::is_flatcar_release(&f.version)
    {
        fail(
            "spec.image.flatcar.version".into(),
            format!(
                "{:?} is not a concrete release: pin one such as 4230.2.3, so that machines made \
                 later boot what their peers boot",
                f.version
            ),
        );
    }
    if let Some(u) = spec.image.as_ref().and_then(|i| i.url.as_ref())
        && u.url
            .chars()
            .any(|c| c.is_whitespace() || c.is_control() || c == '"' || c == '\\')
    {
        fail(
            "spec.image.url.url".into(),
            "must not contain spaces, quotes, backslashes or control characters (percent-encode them)"
                .into(),
        );
    }
    if let Some(ci) = spec.image.as_ref().and_then(|i| i.container_image.as_ref()) {
        if ci.image.is_empty() || ci.image.chars().any(char::is_whitespace) {
            fail(
                "spec.image.containerImage.image".into(),
                "must be an image reference without spaces".into(),
            );
        }
        if ci.path.as_deref().is_some_and(has_dot_dot) {
            fail(
                "spec.image.containerImage.path".into(),
                "must not contain a '..' element: it is a path inside the image".into(),
            );
        }
    }
}

/// Label selectors Kubernetes takes, on keys the operator leaves to tenants.
fn node_selector(spec: &KVMMachineSpec, policy: &TenantPolicy, errors: &mut Vec<FieldError>) {
    let mut fail = |field: String, reason: String| errors.push(FieldError { field, reason });
    for (k, v) in spec.node_selector.iter().flatten() {
        if !is_qualified_name(k) {
            fail(
                format!("spec.nodeSelector[{k:?}]"),
                "the key must be a label key ([prefix/]name)".into(),
            );
        }
        if !is_label_value(v) {
            fail(
                format!("spec.nodeSelector[{k:?}]"),
                format!("{v:?} is not a label value (at most 63 of A-Z a-z 0-9 - _ .)"),
            );
        }
        if is_reserved_label_key(k) && !KeyPatterns::allows(&policy.node_selector_keys, k) {
            fail(
                format!("spec.nodeSelector[{k:?}]"),
                format!(
                    "{k:?} is a label Kubernetes or the operator sets to say what a node is for \
                     (roles, host names, zones); selecting on it is the operator's placement \
                     (allowed: {}); the operator lists such keys with the provider variable \
                     CAPK_ALLOWED_NODE_SELECTOR_KEYS",
                    TenantPolicy::describe(&policy.node_selector_keys)
                ),
            );
        }
    }
}

/// Tolerations Kubernetes takes, of taints the operator lets machines tolerate.
fn tolerations(spec: &KVMMachineSpec, policy: &TenantPolicy, errors: &mut Vec<FieldError>) {
    let mut fail = |field: String, reason: String| errors.push(FieldError { field, reason });
    for (i, t) in spec.tolerations.iter().flatten().enumerate() {
        let at = |f: &str| format!("spec.tolerations[{i}].{f}");
        let key = t.key.as_deref().unwrap_or_default();
        let operator = t.operator.as_deref().unwrap_or("Equal");
        if !key.is_empty() && !is_qualified_name(key) {
            fail(at("key"), "must be a label key ([prefix/]name)".into());
        }
        match operator {
            "Equal" if key.is_empty() => fail(
                at("operator"),
                "must be Exists when the key is empty".into(),
            ),
            "Equal" if !is_label_value(t.value.as_deref().unwrap_or_default()) => fail(
                at("value"),
                "must be a label value (at most 63 of A-Z a-z 0-9 - _ .)".into(),
            ),
            "Exists" if t.value.as_deref().is_some_and(|v| !v.is_empty()) => fail(
                at("value"),
                "must be empty when the operator is Exists".into(),
            ),
            "Equal" | "Exists" => {}
            _ => fail(at("operator"), "must be Equal or Exists".into()),
        }
        let effect = t.effect.as_deref().unwrap_or_default();
        if !["", "NoSchedule", "PreferNoSchedule", "NoExecute"].contains(&effect) {
            fail(
                at("effect"),
                "must be NoSchedule, PreferNoSchedule or NoExecute (or empty)".into(),
            );
        }
        if t.toleration_seconds.is_some() && effect != "NoExecute" {
            fail(
                at("tolerationSeconds"),
                "applies only to the effect NoExecute".into(),
            );
        }
        if !key.is_empty() && !KeyPatterns::allows(&policy.toleration_keys, key) {
            fail(
                at("key"),
                format!(
                    "{key:?} is a taint the operator has not let machines tolerate (allowed: {}); \
                     tolerating it would place the machine Pod on nodes kept for other uses \
                     (control planes, dedicated, cordoned or failing nodes); the operator lists \
                     taint keys with the provider variable CAPK_ALLOWED_TOLERATION_KEYS",
                    TenantPolicy::describe(&policy.toleration_keys)
                ),
            );
        }
        if key.is_empty() && operator == "Exists" && !policy.allow_tolerate_all_taints {
            fail(
                at("operator"),
                "a toleration with no key tolerates every taint and would place the machine \
                 Pod on any node, control-plane and dedicated nodes included; name the taint's \
                 key (the operator allows key-less tolerations with the provider variable \
                 CAPK_ALLOW_TOLERATE_ALL_TAINTS=true)"
                    .into(),
            );
        }
    }
}

/// No emulation where the operator requires KVM.
fn accel(spec: &KVMMachineSpec, defaults: &MachineDefaults, errors: &mut Vec<FieldError>) {
    if defaults.kvm == KvmPolicy::Require && spec.accel == Some(Accel::Tcg) {
        errors.push(FieldError {
            field: "spec.accel".into(),
            reason: "tcg (emulation) is not allowed: the operator requires KVM for every machine \
                     (provider variable CAPK_KVM=require); leave accel out or set auto or kvm"
                .into(),
        });
    }
}

/// A PriorityClass the operator lets machines use.
fn priority_class(spec: &KVMMachineSpec, policy: &TenantPolicy, errors: &mut Vec<FieldError>) {
    let mut fail = |field: String, reason: String| errors.push(FieldError { field, reason });
    if let Some(p) = &spec.priority_class_name {
        if !capk_api::dns::is_subdomain(p) {
            fail(
                "spec.priorityClassName".into(),
                format!("{p:?} is not a PriorityClass name (a DNS subdomain)"),
            );
        } else if !policy.priority_classes.contains(p) {
            fail(
                "spec.priorityClassName".into(),
                format!(
                    "{p:?} is not a PriorityClass the operator lets machines use (allowed: {}); a \
                     priority above others lets the machine Pod preempt other tenants' machines \
                     and the cluster's own Pods; leave it out, or ask the operator to list it \
                     with the provider variable CAPK_ALLOWED_PRIORITY_CLASSES",
                    TenantPolicy::describe(&policy.priority_classes)
                ),
            );
        }
    }
}

/// The share of `namespace` that holds `path` (`<allowed directory>/<namespace>`, the longest
/// when allowed directories nest) and `path` inside it; or why there is none. A share that
/// holds or lies in a directory the provider keeps other data in (etcd disks, node images,
/// another allowed directory) is refused: a namespace named like that directory would reach it.
fn host_volume_share(
    policy: &TenantPolicy,
    namespace: &str,
    path: &str,
) -> Result<(String, String), String> {
    let shares: Vec<String> = policy
        .host_volume_prefixes
        .iter()
        .filter(|p| p.starts_with('/'))
        .map(|p| format!("{}/{namespace}", p.trim_end_matches('/')))
        .collect();
    let Some(share) = shares
        .iter()
        .filter(|s| TenantPolicy::allows(std::slice::from_ref(s), path))
        .max_by_key(|s| elements(s).len())
    else {
        return Err(format!(
            "is not in a directory the operator allows host volumes in (allowed: {}): a \
             KVMMachine shares only its own namespace's directory, <dir>/{namespace}, of each \
             directory the operator lists with the provider variable \
             CAPK_ALLOWED_HOST_VOLUME_PATHS ({})",
            TenantPolicy::describe(&shares),
            TenantPolicy::describe(&policy.host_volume_prefixes),
        ));
    };
    let within_share = |d: &str| TenantPolicy::allows(std::slice::from_ref(share), d);
    let overlap = policy
        .etcd_host_path_prefixes
        .iter()
        .map(String::as_str)
        .chain([HOST_IMAGE_CACHE])
        .find(|d| within_share(d) || TenantPolicy::allows(&[d.to_string()], share))
        .or_else(|| {
            policy
                .host_volume_prefixes
                .iter()
                .map(String::as_str)
                .find(|d| within_share(d))
        });
    if let Some(dir) = overlap {
        return Err(format!(
            "is in {share}, namespace {namespace}'s share, which overlaps {dir} (etcd data, node \
             images or another allowed directory): the operator must keep the directories of \
             the provider variable CAPK_ALLOWED_HOST_VOLUME_PATHS apart from those"
        ));
    }
    let sub_path = elements(path)[elements(share).len()..].join("/");
    Ok((share.clone(), sub_path))
}

/// A path's elements, without empty and `.` ones.
fn elements(path: &str) -> Vec<&str> {
    path.split('/')
        .filter(|e| !e.is_empty() && *e != ".")
        .collect()
}

fn has_dot_dot(path: &str) -> bool {
    path.split('/').any(|e| e == "..")
}

/// A label value: empty, or 1-63 of `[A-Za-z0-9-_.]` starting and ending with a letter or
/// digit.
fn is_label_value(s: &str) -> bool {
    s.is_empty()
        || (s.len() <= 63
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
            && s.starts_with(|c: char| c.is_ascii_alphanumeric())
            && s.ends_with(|c: char| c.is_ascii_alphanumeric()))
}

/// A label key: an optional DNS-subdomain prefix and `/`, then a non-empty label value.
fn is_qualified_name(s: &str) -> bool {
    let (prefix, name) = match s.split_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, s),
    };
    prefix.is_none_or(capk_api::dns::is_subdomain) && !name.is_empty() && is_label_value(name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kvmmachine::{pod, testing::kvm_machine};
    use serde_json::{Value, json};

    fn placement(control_plane: bool) -> MachinePlacement {
        MachinePlacement {
            cluster: "demo".into(),
            control_plane,
            failure_domain: None,
        }
    }

    fn spec(extra: Value) -> Value {
        let mut spec = json!({"resources": {"cpu": 2, "memory": "2Gi", "disk": "20Gi"}});
        for (k, v) in extra.as_object().unwrap() {
            if k == "resources" {
                for (rk, rv) in v.as_object().unwrap() {
                    spec["resources"][rk] = rv.clone();
                }
            } else {
                spec[k] = v.clone();
            }
        }
        spec
    }

    /// An operator who allows host volumes under /srv (each namespace's in /srv/<namespace>) and
    /// tolerations of the taint `k`.
    fn policy() -> TenantPolicy {
        TenantPolicy {
            host_volume_prefixes: vec!["/srv".into()],
            toleration_keys: vec!["k".into()],
            ..TenantPolicy::default()
        }
    }

    /// The message `validate` refuses a worker with `extra` in its spec with.
    fn refusal(extra: Value) -> String {
        let km = kvm_machine("m", spec(extra));
        validate(
            &km,
            &placement(false),
            &MachineDefaults::default(),
            &policy(),
        )
        .unwrap_err()
        .to_string()
    }

    fn errors(extra: Value, control_plane: bool) -> Vec<String> {
        let km = kvm_machine("m", spec(extra));
        match validate(
            &km,
            &placement(control_plane),
            &MachineDefaults::default(),
            &policy(),
        ) {
            Ok(_) => vec![],
            Err(e) => e.0.into_iter().map(|e| e.field).collect(),
        }
    }

    /// The controller takes a machine's resources up to the shared limits, which the CRD and the
    /// launcher hold too (their own tests), and refuses one past each, naming the field.
    #[test]
    fn the_resource_edges_are_the_shared_limits() {
        let at = |cpu: u32, memory: u64, disk: u64| {
            errors(
                json!({"resources": {"cpu": cpu, "memory": memory.to_string(),
                                     "disk": disk.to_string()}}),
                false,
            )
        };
        let (mem, disk) = (MIN_MEMORY.bytes, MIN_DISK.bytes);
        assert!(at(MIN_VCPUS, mem, disk).is_empty());
        assert!(at(MAX_VCPUS, mem, disk).is_empty());
        assert_eq!(at(MIN_VCPUS - 1, mem, disk), ["spec.resources.cpu"]);
        assert_eq!(at(MAX_VCPUS + 1, mem, disk), ["spec.resources.cpu"]);
        assert_eq!(at(1, mem - 1, disk), ["spec.resources.memory"]);
        assert_eq!(at(1, mem, disk - 1), ["spec.resources.disk"]);
    }

    #[test]
    fn each_broken_rule_names_its_field() {
        let cases = [
            (json!({"resources": {"cpu": 256}}), "spec.resources.cpu"),
            (
                json!({"resources": {"memory": "100Mi"}}),
                "spec.resources.memory",
            ),
            (
                json!({"resources": {"memory": "1.5.5Gi"}}),
                "spec.resources.memory",
            ),
            (
                json!({"resources": {"disk": "15Ei", "dockerVolumeSize": "15Ei"}}),
                "spec.resources",
            ),
            (
                json!({"resources": {"kubeletVolumeSize": "1Gb"}}),
                "spec.resources.kubeletVolumeSize",
            ),
            (
                json!({"etcdStorage": {"type": "persistentVolume", "size": "16Ei"}}),
                "spec.etcdStorage.size",
            ),
            (
                json!({"dns": {"servers": ["10.0.0.10", "fd00::10"]}}),
                "spec.dns.servers[1]",
            ),
            (
                json!({"dns": {"searches": ["svc.cluster.local", "a,b"]}}),
                "spec.dns.searches[1]",
            ),
            (
                json!({"hostVolumes": [{"mountTag": "data.1", "hostPath": "/srv/team-a"}]}),
                "spec.hostVolumes[0].mountTag",
            ),
            (
                json!({"hostVolumes": [{"mountTag": "data", "hostPath": "/srv/../etc"}]}),
                "spec.hostVolumes[0].hostPath",
            ),
            (
                json!({"etcdStorage": {"type": "hostPath", "hostPath": "/var/lib/capk/etcd/../../../etc"}}),
                "spec.etcdStorage.hostPath",
            ),
            (
                json!({"image": {"containerImage": {"image": "a b"}}}),
                "spec.image.containerImage.image",
            ),
            (
                json!({"image": {"containerImage": {"image": "i:1", "path": "/../../x"}}}),
                "spec.image.containerImage.path",
            ),
            (
                json!({"nodeSelector": {"kvm": "yes please"}}),
                "spec.nodeSelector[\"kvm\"]",
            ),
            (
                json!({"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]}),
                "spec.tolerations[0].value",
            ),
            (
                json!({"tolerations": [{"key": "k", "effect": "NoSchedul"}]}),
                "spec.tolerations[0].effect",
            ),
            (
                json!({"priorityClassName": "Workload VMs"}),
                "spec.priorityClassName",
            ),
        ];
        for (extra, field) in cases {
            let found = errors(extra.clone(), true);
            assert_eq!(found, [field], "{extra}");
        }
        // Everything wrong at once: every field is named, in one message.
        let msg = refusal(json!({"resources": {"cpu": 0}, "dns": {"servers": ["::1"]}}));
        assert!(
            msg.contains("spec.resources.cpu: must be 1 to 255 vCPUs")
                && msg.contains("spec.dns.servers[0]"),
            "{msg}"
        );
    }

    #[test]
    fn emulation_is_refused_where_the_operator_requires_kvm() {
        let check = |accel: &str, kvm: KvmPolicy| {
            let km = kvm_machine("m", spec(json!({"accel": accel})));
            let defaults = MachineDefaults {
                kvm,
                ..MachineDefaults::default()
            };
            validate(&km, &placement(false), &defaults, &policy()).map_err(|e| e.to_string())
        };
        let refused = check("tcg", KvmPolicy::Require).unwrap_err();
        assert!(
            refused.contains("spec.accel") && refused.contains("CAPK_KVM=require"),
            "{refused}"
        );
        for (accel, kvm) in [("auto", KvmPolicy::Require), ("kvm", KvmPolicy::Require)]
            .into_iter()
            .chain([("tcg", KvmPolicy::Prefer), ("tcg", KvmPolicy::Allow)])
        {
            assert!(check(accel, kvm).is_ok(), "{accel} under {kvm:?}");
        }
    }

    /// What reaches past the tenant's VM is refused unless the operator allows it, naming the
    /// field and what is allowed.
    #[test]
    fn host_paths_and_placement_past_the_tenant_need_the_operators_leave() {
        let refused = |extra: Value, control_plane: bool, policy: &TenantPolicy| {
            let km = kvm_machine("m", spec(extra.clone()));
            validate(
                &km,
                &placement(control_plane),
                &MachineDefaults::default(),
                policy,
            )
            .err()
            .map(|e| e.to_string())
        };
        let shipped = TenantPolicy::default();
        // The tenant's attack: the MC node's root shared into the VM.
        let root = json!({"hostVolumes": [{"mountTag": "hostroot", "hostPath": "/"}]});
        let msg = refused(root.clone(), false, &shipped).expect("refused");
        assert!(
            msg.contains("spec.hostVolumes[0].hostPath")
                && msg.contains("allowed: none")
                && msg.contains("CAPK_ALLOWED_HOST_VOLUME_PATHS"),
            "{msg}"
        );
        let msg = refused(root, false, &policy()).expect("refused");
        assert!(msg.contains("allowed: /srv/team-a"), "{msg}");
        let data = json!({"hostVolumes": [{"mountTag": "data", "hostPath": "/srv/team-a/data", "readOnly": true}]});
        assert_eq!(refused(data, false, &policy()), None);
        let sibling = json!({"hostVolumes": [{"mountTag": "data", "hostPath": "/srvx/team-a"}]});
        assert!(refused(sibling, false, &policy()).is_some());

        // etcd data only under the allowed directories (shipped: /var/lib/capk/etcd).
        let etcd = |p: &str| json!({"etcdStorage": {"type": "hostPath", "hostPath": p}});
        assert_eq!(refused(etcd("/var/lib/capk/etcd"), true, &shipped), None);
        let msg = refused(etcd("/var/lib/kubelet"), true, &shipped).expect("refused");
        assert!(
            msg.contains("spec.etcdStorage.hostPath")
                && msg.contains("allowed: /var/lib/capk/etcd"),
            "{msg}"
        );

        // Every taint tolerated, a system PriorityClass: refused unless allowed.
        let everywhere = json!({"tolerations": [{"operator": "Exists"}]});
        let msg = refused(everywhere.clone(), false, &shipped).expect("refused");
        assert!(
            msg.contains("spec.tolerations[0].operator") && msg.contains("every taint"),
            "{msg}"
        );
        let one_effect = json!({"tolerations": [{"operator": "Exists", "effect": "NoSchedule"}]});
        assert!(refused(one_effect, false, &shipped).is_some());
        let critical = json!({"priorityClassName": "system-node-critical"});
        let msg = refused(critical.clone(), false, &shipped).expect("refused");
        assert!(
            msg.contains("spec.priorityClassName")
                && msg.contains("allowed: none")
                && msg.contains("CAPK_ALLOWED_PRIORITY_CLASSES"),
            "{msg}"
        );
        let lenient = TenantPolicy {
            allow_tolerate_all_taints: true,
            priority_classes: vec!["system-node-critical".into()],
            ..TenantPolicy::default()
        };
        assert_eq!(refused(everywhere, false, &lenient), None);
        assert_eq!(refused(critical, false, &lenient), None);
    }

    /// A tenant's machine Pod goes where the operator's placement lets it: onto control-plane,
    /// cordoned or failing nodes, or above the operator's own Pods, only with the operator's
    /// leave; each refusal names the field and the provider variable.
    #[test]
    fn placement_on_the_operators_nodes_and_priorities_needs_the_operators_leave() {
        let refusals = |extra: Value, policy: &TenantPolicy| -> Vec<String> {
            let km = kvm_machine("m", spec(extra));
            match validate(&km, &placement(false), &MachineDefaults::default(), policy) {
                Ok(_) => Vec::new(),
                Err(SpecErrors(e)) => e.iter().map(ToString::to_string).collect(),
            }
        };
        let shipped = TenantPolicy::default();
        let attack = json!({
            "tolerations": [
                {"key": "node-role.kubernetes.io/control-plane", "operator": "Exists", "effect": "NoSchedule"},
                {"key": "node.kubernetes.io/unschedulable", "operator": "Exists"},
                {"key": "node.kubernetes.io/memory-pressure", "operator": "Exists"},
                {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute"},
            ],
            "nodeSelector": {"node-role.kubernetes.io/control-plane": ""},
            "priorityClassName": "platform-critical",
        });
        let refused = refusals(attack.clone(), &shipped);
        let fields: Vec<&str> = refused
            .iter()
            .map(|m| m.split_once(": ").unwrap().0)
            .collect();
        assert_eq!(
            fields,
            [
                "spec.nodeSelector[\"node-role.kubernetes.io/control-plane\"]",
                "spec.tolerations[0].key",
                "spec.tolerations[1].key",
                "spec.tolerations[2].key",
                "spec.tolerations[3].key",
                "spec.priorityClassName",
            ]
        );
        for (m, variable) in refused.iter().zip([
            "CAPK_ALLOWED_NODE_SELECTOR_KEYS",
            "CAPK_ALLOWED_TOLERATION_KEYS",
            "CAPK_ALLOWED_TOLERATION_KEYS",
            "CAPK_ALLOWED_TOLERATION_KEYS",
            "CAPK_ALLOWED_TOLERATION_KEYS",
            "CAPK_ALLOWED_PRIORITY_CLASSES",
        ]) {
            assert!(m.contains(variable) && m.contains("allowed: none"), "{m}");
        }

        // What the operator lists passes; the rest is still refused.
        let operator = TenantPolicy {
            toleration_keys: vec!["node-role.kubernetes.io/*".into()],
            node_selector_keys: vec!["node-role.kubernetes.io/control-plane".into()],
            priority_classes: vec!["platform-critical".into()],
            ..TenantPolicy::default()
        };
        let refused = refusals(attack, &operator);
        assert_eq!(refused.len(), 3, "{refused:?}");
        assert!(
            refused.iter().all(|m| m.contains("node.kubernetes.io/")
                && m.contains("allowed: node-role.kubernetes.io/*")),
            "{refused:?}"
        );

        // A tenant's own labels stay the tenant's: no leave needed.
        let own = json!({"nodeSelector": {"example.com/vm-host": "true", "kvm": "yes"}});
        assert!(refusals(own, &shipped).is_empty());
        let zone = json!({"nodeSelector": {"topology.kubernetes.io/zone": "a"}});
        assert_eq!(refusals(zone, &shipped).len(), 1);
    }

    /// The attack on shares: with `/srv/capk-shares` allowed, tenant B (namespace team-b) names
    /// tenant A's share, or the directory above every share; both are refused naming the field,
    /// the namespace's own share and the provider variable. A tenant's own share and what is
    /// below it pass, split into the share (the Pod's hostPath) and the sub-path.
    #[test]
    fn each_namespace_shares_only_its_own_directory() {
        let policy = TenantPolicy {
            host_volume_prefixes: vec!["/srv/capk-shares/".into()],
            ..TenantPolicy::default()
        };
        let machine = |namespace: &str, path: &str| {
            let mut km = kvm_machine(
                "m",
                spec(json!({"hostVolumes": [{"mountTag": "data", "hostPath": path}]})),
            );
            km.metadata.namespace = Some(namespace.into());
            validate(&km, &placement(false), &MachineDefaults::default(), &policy)
        };
        for path in [
            "/srv/capk-shares/team-a",
            "/srv/capk-shares/team-a/escape",
            "/srv/capk-shares",
            "/srv/capk-shares/team-b-x",
        ] {
            let msg = machine("team-b", path).unwrap_err().to_string();
            assert!(
                msg.starts_with(&format!("spec.hostVolumes[0].hostPath: {path:?} is not in")),
                "{msg}"
            );
            assert_eq!(
                msg,
                format!(
                    "spec.hostVolumes[0].hostPath: {path:?} is not in a directory the operator \
                     allows host volumes in (allowed: /srv/capk-shares/team-b): a KVMMachine \
                     shares only its own namespace's directory, <dir>/team-b, of each directory \
                     the operator lists with the provider variable CAPK_ALLOWED_HOST_VOLUME_PATHS \
                     (/srv/capk-shares/)"
                )
            );
        }
        let own = |path: &str| {
            machine("team-a", path)
                .unwrap_or_else(|e| panic!("{path}: {e}"))
                .host_volumes
        };
        assert_eq!(
            own("/srv/capk-shares/team-a"),
            [ValidHostVolume {
                mount_tag: "data".into(),
                share: "/srv/capk-shares/team-a".into(),
                sub_path: "".into(),
                read_only: false,
            }]
        );
        let nested = own("/srv/capk-shares//team-a/./cache/x/");
        assert_eq!(
            (nested[0].share.as_str(), nested[0].sub_path.as_str()),
            ("/srv/capk-shares/team-a", "cache/x")
        );
    }

    /// A namespace named like a directory the provider keeps data in (or an allowed directory
    /// placed in, or around, one of those) does not make that directory a share.
    #[test]
    fn a_share_never_overlaps_the_providers_own_directories() {
        let machine = |namespace: &str, prefixes: &[&str], path: &str| {
            let mut km = kvm_machine(
                "m",
                spec(json!({"hostVolumes": [{"mountTag": "data", "hostPath": path}]})),
            );
            km.metadata.namespace = Some(namespace.into());
            let policy = TenantPolicy {
                host_volume_prefixes: prefixes.iter().map(|p| p.to_string()).collect(),
                ..TenantPolicy::default()
            };
            validate(&km, &placement(false), &MachineDefaults::default(), &policy)
                .err()
                .map(|e| e.to_string())
        };
        for (namespace, prefixes, path, overlapped) in [
            (
                "etcd",
                &["/var/lib/capk"][..],
                "/var/lib/capk/etcd",
                "/var/lib/capk/etcd",
            ),
            (
                "images",
                &["/var/lib/capk"],
                "/var/lib/capk/images/x",
                "/var/lib/capk/images",
            ),
            (
                "a",
                &["/var/lib/capk/etcd/shares"],
                "/var/lib/capk/etcd/shares/a",
                "/var/lib/capk/etcd",
            ),
            ("a", &["/srv", "/srv/a/more"], "/srv/a", "/srv/a/more"),
        ] {
            let msg = machine(namespace, prefixes, path).expect("refused");
            assert!(
                msg.contains("spec.hostVolumes[0].hostPath")
                    && msg.contains(&format!("overlaps {overlapped} "))
                    && msg.contains("CAPK_ALLOWED_HOST_VOLUME_PATHS"),
                "{namespace} {path}: {msg}"
            );
        }
        assert_eq!(
            machine("team-a", &["/var/lib/capk"], "/var/lib/capk/team-a"),
            None
        );
        assert_eq!(
            machine("b", &["/srv", "/srv/a/more"], "/srv/a/more/b"),
            None
        );
    }

    #[test]
    fn node_images_to_fetch_are_pinned_releases_and_urls_curl_can_take() {
        let current = json!({"image": {"flatcar": {"channel": "stable", "version": "current"}}});
        assert_eq!(
            errors(current.clone(), false),
            ["spec.image.flatcar.version"]
        );
        let msg = refusal(current);
        assert!(msg.contains("pin one such as 4230.2.3"), "{msg}");
        let pinned = json!({"image": {"flatcar": {"channel": "lts", "version": "4081.3.6"}}});
        assert!(errors(pinned, false).is_empty());
        let sha = "ab".repeat(32);
        let spaced = json!({"image": {"url": {"url": "https://x/a b.img", "sha256": sha}}});
        assert_eq!(errors(spaced, false), ["spec.image.url.url"]);
        let fine = json!({"image": {"url": {"url": "https://x/a%20b.img?sig=1", "sha256": sha}}});
        assert!(errors(fine, false).is_empty());
    }

    #[test]
    fn a_workers_unused_etcd_storage_is_not_checked() {
        let extra = json!({"etcdStorage": {"type": "persistentVolume", "size": "16Ei"}});
        assert!(errors(extra, false).is_empty());
    }

    #[test]
    fn sizes_come_out_in_bytes_with_the_defaults_filled_in() {
        let km = kvm_machine(
            "m",
            spec(
                json!({"resources": {"cpu": 4, "memory": "8Gi", "dockerVolumeSize": "5Gi"},
                        "etcdStorage": {"type": "persistentVolume", "size": "8Gi"}}),
            ),
        );
        let defaults = MachineDefaults::default();
        let v = validate(&km, &placement(true), &defaults, &policy()).unwrap();
        assert_eq!(
            v,
            ValidSpec {
                vcpus: 4,
                memory: 8 << 30,
                disk: 20 << 30,
                docker_disk: 5 << 30,
                kubelet_disk: defaults.kubelet_volume_bytes,
                etcd_disk: 8 << 30,
                host_volumes: vec![],
            }
        );
    }

    /// What `validate` lets through, the launcher runs: the Pod's arguments parse and pass the
    /// launcher's own validation, at the edges of every rule.
    #[test]
    fn what_passes_validation_the_launcher_accepts() {
        use clap::Parser;
        let edges = [
            (
                true,
                json!({"resources": {"cpu": MAX_VCPUS, "memory": MIN_MEMORY.quantity,
                                     "disk": MIN_DISK.quantity}}),
            ),
            (
                true,
                json!({"etcdStorage": {"type": "persistentVolume", "size": "1"},
                       "dns": {"servers": ["10.96.0.10", "10.96.0.11", "10.96.0.12"],
                               "searches": ["Team-A.svc.cluster.local.", "cluster.local"]},
                       "ntp": {"servers": ["10.0.0.1", "pool.ntp.example"]}}),
            ),
            (
                false,
                json!({"resources": {"dockerVolumeSize": "1", "kubeletVolumeSize": "1"},
                       "hostVolumes": [{"mountTag": "a", "hostPath": "/team-a"},
                                       {"mountTag": "ro", "hostPath": "/team-a/ro", "readOnly": true},
                                       {"mountTag": "A_b-012345678901234567890123456", "hostPath": "/team-a/x..y/z"}],
                       "accel": "kvm",
                       "nodeSelector": {"example.com/kvm": "", "kvm": "true"},
                       "tolerations": [{"operator": "Exists"},
                                       {"key": "k", "value": "v", "effect": "NoExecute",
                                        "tolerationSeconds": 30}],
                       "priorityClassName": "workload-vms"}),
            ),
        ];
        for (control_plane, extra) in edges {
            let km = kvm_machine("m", spec(extra.clone()));
            let placement = placement(control_plane);
            let defaults = MachineDefaults::default();
            // An operator who allows everything (etcd data apart from host volumes): the
            // launcher must take it all.
            let policy = TenantPolicy {
                host_volume_prefixes: vec!["/".into()],
                etcd_host_path_prefixes: vec!["/var/lib/capk/etcd".into()],
                allow_tolerate_all_taints: true,
                toleration_keys: vec!["k".into()],
                priority_classes: vec!["workload-vms".into()],
                ..TenantPolicy::default()
            };
            let valid = validate(&km, &placement, &defaults, &policy)
                .unwrap_or_else(|e| panic!("{extra}: {e}"));
            let home = crate::kvmmachine::testing::management();
            let names = crate::kvmmachine::names::MachineNames::in_home(&km, &home);
            let pod = pod::machine_pod(&km, &placement, &home, &names, &valid, &defaults);
            let c = &pod.spec.unwrap().containers[0];
            let argv = c
                .command
                .clone()
                .unwrap()
                .into_iter()
                .chain(c.args.clone().unwrap());
            let cli = capk_launcher::cli::Cli::try_parse_from(argv)
                .unwrap_or_else(|e| panic!("the launcher refuses {extra}: {e}"));
            let capk_launcher::cli::Command::Run(args) = cli.command else {
                panic!("not run")
            };
            if let Err(e) = capk_launcher::run::validate(&args) {
                panic!("the launcher refuses {extra}: {e}");
            }
        }
    }
}
