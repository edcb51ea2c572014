//! Pure: the names a KVMMachine's objects get, each valid where it is used. A KVMMachine's name
//! is a DNS subdomain of up to 253 characters, but a label value and a hostname are at most 63:
//! a longer name is cut and ends in a hash of the whole name ([`bounded_name`]), so the
//! objects still apply and two machines never share a Node name. In a hosting namespace other
//! than the machine's own, names are qualified by its namespace ([`MachineNames`]).

use std::collections::BTreeMap;

use capk_api::constants::{
    MACHINE_ROLE_LABEL, MAX_LABEL_LEN, MAX_SUBDOMAIN_LEN, ROLE_CONTROL_PLANE, ROLE_WORKER,
    bounded_name,
};
use capk_api::v1alpha1::KVMMachine;
use kube::ResourceExt;

use super::placement::MachinePlacement;
use crate::{
    k8s::ownership::{Home, Owner},
    kvmcluster::build::owned_labels,
};

/// Label on machine Pods and Secrets naming their KVMMachine ([`label_value`]).
pub use capk_api::constants::KVMMACHINE_LABEL;

/// The names of a machine's objects where they are made: the machine Pod, its Ignition Secret,
/// its etcd PVC and the etcd cleanup Pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MachineNames {
    /// The machine Pod.
    pub pod: String,
    /// The Ignition Secret: `<pod>-ignition`.
    pub ignition_secret: String,
    /// The etcd PVC of a control-plane machine: `<pod>-etcd`.
    pub etcd_claim: String,
    /// The Pod removing the machine's etcd data from its node: `<pod>-etcd-cleanup`.
    pub etcd_cleanup_pod: String,
}

impl MachineNames {
    /// The names a machine's objects get in `home` ([`Home::name_for`]): the KVMMachine's
    /// name in its own namespace; in another (a hosting namespace several management namespaces
    /// may share) `<kvmmachine>-<hash of its namespace>`, so that same-named machines of two
    /// namespaces never want one name.
    pub fn in_home(km: &KVMMachine, home: &Home) -> Self {
        let ns = km.namespace().unwrap_or_default();
        let name = |suffix: &str| home.name_for(&ns, &km.name_any(), suffix, MAX_SUBDOMAIN_LEN);
        Self {
            pod: name(""),
            ignition_secret: name("-ignition"),
            etcd_claim: name("-etcd"),
            etcd_cleanup_pod: name("-etcd-cleanup"),
        }
    }
}

/// The machine's own etcd directory in its namespace's under `etcdStorage.hostPath`
/// (`<hostPath>/<namespace>/<this>`): the KVMMachine's name, wherever its Pod lives and whatever
/// that Pod is called (the namespace's directory already tells same-named machines apart).
pub fn etcd_dir_name(km: &KVMMachine) -> String {
    km.name_any()
}

/// Value of the label naming the KVMMachine on its objects: the name, or when longer than a
/// label value may be, its cut-and-hashed form.
pub fn label_value(km: &KVMMachine) -> String {
    bounded_name(&km.name_any(), "", MAX_LABEL_LEN)
}

/// The labels of every object made for a machine: the cluster's ([`owned_labels`]), the
/// KVMMachine's ([`Owner::labels`]: namespace, name, UID) and the role's (the control-plane
/// Service's endpoints are the `control-plane` Pods).
pub fn labels(km: &KVMMachine, placement: &MachinePlacement) -> BTreeMap<String, String> {
    let mut labels = owned_labels(&placement.cluster);
    labels.extend(Owner::machine(km).labels());
    debug_assert_eq!(labels.get(KVMMACHINE_LABEL), Some(&label_value(km)));
    let role = if placement.control_plane {
        ROLE_CONTROL_PLANE
    } else {
        ROLE_WORKER
    };
    labels.insert(MACHINE_ROLE_LABEL.into(), role.into());
    labels
}

/// The node's hostname, which is its Node's name in the workload cluster: a DNS label. The
/// KVMMachine's name when it is one. Otherwise (a dot, which a hostname label cannot hold, or more
/// than 63 characters) dots become dashes, the result is cut to fit, and it ends in a hash of the
/// real name: `a.b` and `a-b`, or two long names with a common prefix, stay two hostnames, so two
/// machines never share a Node.
pub fn hostname(km: &KVMMachine) -> String {
    let name = km.name_any();
    let dashed: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    let is_label = dashed == name
        && name.len() <= MAX_LABEL_LEN
        && !name.is_empty()
        && !name.starts_with('-')
        && !name.ends_with('-');
    if is_label {
        return name;
    }
    // The hash is of the real name, so names that differ only where the mapping changed them
    // stay apart. All ASCII: any cut is on a character boundary.
    let hash = capk_api::constants::name_hash(&name);
    let keep = dashed.len().min(MAX_LABEL_LEN - hash.len() - 1);
    let cut = dashed[..keep].trim_matches('-');
    if cut.is_empty() {
        format!("m-{hash}")
    } else {
        format!("{cut}-{hash}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn km(name: &str) -> KVMMachine {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1",
            "kind": "KVMMachine",
            "metadata": {"name": name, "namespace": "team-a"},
            "spec": {"resources": {"cpu": 1, "memory": "1Gi", "disk": "2Gi"}},
        }))
        .unwrap()
    }

    fn is_dns_label(s: &str) -> bool {
        !s.is_empty()
            && s.len() <= 63
            && s.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            && !s.starts_with('-')
            && !s.ends_with('-')
    }

    fn is_label_value(s: &str) -> bool {
        s.len() <= 63
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
            && s.starts_with(|c: char| c.is_ascii_alphanumeric())
            && s.ends_with(|c: char| c.is_ascii_alphanumeric())
    }

    fn home(ns: &str) -> Home {
        Home {
            namespace: ns.into(),
            management: false,
        }
    }

    fn in_ns(name: &str, ns: &str) -> KVMMachine {
        let mut m = km(name);
        m.metadata.namespace = Some(ns.into());
        m
    }

    #[test]
    fn in_a_namespace_of_another_name_the_names_say_whose_they_are() {
        let (a, b) = (in_ns("demo-cp-0", "team-a"), in_ns("demo-cp-0", "team-b"));
        // Its own namespace (the management cluster's, or a hosting namespace of that name):
        // the names machines always had.
        assert_eq!(MachineNames::in_home(&a, &home("team-a")).pod, "demo-cp-0");
        // A shared one: same-named machines of two namespaces want different names.
        let (na, nb) = (
            MachineNames::in_home(&a, &home("shared")),
            MachineNames::in_home(&b, &home("shared")),
        );
        assert_ne!(na.pod, nb.pod);
        assert_ne!(na.ignition_secret, nb.ignition_secret);
        assert_ne!(na.etcd_claim, nb.etcd_claim);
        assert_ne!(na.etcd_cleanup_pod, nb.etcd_cleanup_pod);
        assert!(na.pod.starts_with("demo-cp-0-"), "{}", na.pod);
        assert_eq!(na.ignition_secret, format!("{}-ignition", na.pod));
        assert_eq!(na.etcd_claim, format!("{}-etcd", na.pod));
        assert_eq!(na.etcd_cleanup_pod, format!("{}-etcd-cleanup", na.pod));
        assert_eq!(na, MachineNames::in_home(&a, &home("shared")), "stable");
        assert!(is_dns_label(&na.pod), "{}", na.pod);
        // The longest names still fit a Pod's and a Secret's name, and stay apart.
        let long = |ns: &str| in_ns(&"y".repeat(253), ns);
        let (la, lb) = (
            MachineNames::in_home(&long("team-a"), &home("shared")),
            MachineNames::in_home(&long("team-b"), &home("shared")),
        );
        for n in [&la, &lb] {
            for name in [
                &n.pod,
                &n.ignition_secret,
                &n.etcd_claim,
                &n.etcd_cleanup_pod,
            ] {
                assert!(name.len() <= 253, "{name}");
            }
        }
        assert_ne!(la.pod, lb.pod);
        // The etcd directory is the machine's own, under its namespace's, wherever it lives.
        assert_eq!(etcd_dir_name(&a), "demo-cp-0");
    }

    #[test]
    fn short_names_are_used_as_they_are() {
        let m = km("demo-md-0-x7k2p-abcde");
        assert_eq!(hostname(&m), "demo-md-0-x7k2p-abcde");
        assert_eq!(label_value(&m), "demo-md-0-x7k2p-abcde");
        let names = MachineNames::in_home(&m, &home("team-a"));
        assert_eq!(names.pod, "demo-md-0-x7k2p-abcde");
        assert_eq!(names.ignition_secret, "demo-md-0-x7k2p-abcde-ignition");
        assert_eq!(names.etcd_claim, "demo-md-0-x7k2p-abcde-etcd");
        assert_eq!(names.etcd_cleanup_pod, "demo-md-0-x7k2p-abcde-etcd-cleanup");
    }

    #[test]
    fn dotted_names_get_a_hash_so_they_never_share_a_node_with_the_dashed_name() {
        let dotted = hostname(&km("a.b"));
        let dashed = hostname(&km("a-b"));
        assert_eq!(dashed, "a-b", "already a DNS label: unchanged");
        assert_ne!(dotted, dashed);
        assert!(dotted.starts_with("a-b-"), "{dotted}");
        for h in [&dotted, &dashed, &hostname(&km("demo.cp.0"))] {
            assert!(is_dns_label(h), "{h}");
        }
        assert_eq!(dotted, hostname(&km("a.b")), "stable");
        // Two dots where the other has a dot and a dash.
        assert_ne!(hostname(&km("x.y.z")), hostname(&km("x.y-z")));
        // A 63-character dotted name still fits once its hash is added.
        let long = format!("{}.{}", "p".repeat(31), "q".repeat(31));
        assert!(
            is_dns_label(&hostname(&km(&long))),
            "{}",
            hostname(&km(&long))
        );
        assert_ne!(hostname(&km(&long)), hostname(&km(&long.replace('.', "-"))));
    }

    #[test]
    fn long_names_are_cut_with_a_hash_and_stay_distinct() {
        let a = km(&format!("{}-a", "x".repeat(120)));
        let b = km(&format!("{}-b", "x".repeat(120)));
        let dotted = km(&format!(
            "{}.workers.{}",
            "team".repeat(20),
            "z".repeat(150)
        ));
        for m in [&a, &b, &dotted] {
            let h = hostname(m);
            assert!(is_dns_label(&h), "{h}");
            let l = label_value(m);
            assert!(is_label_value(&l), "{l}");
            assert_eq!(h, hostname(m), "stable");
        }
        assert_ne!(hostname(&a), hostname(&b));
        assert_ne!(label_value(&a), label_value(&b));
        let longest = MachineNames::in_home(&km(&"y".repeat(253)), &home("team-a"));
        assert!(longest.ignition_secret.len() <= 253);
        assert!(longest.etcd_claim.ends_with("-etcd"));
        assert_ne!(
            longest.ignition_secret,
            MachineNames::in_home(&km(&format!("{}z", "y".repeat(252))), &home("team-a"))
                .ignition_secret
        );
    }
}
