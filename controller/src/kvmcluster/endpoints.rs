//! Pure: from the cluster's control-plane machine Pods and their apiservers' health to the
//! control-plane Service's EndpointSlice and the `ControlPlaneEndpointsReady` condition, and
//! from the slices that are there to whether to write it and say so in an Event
//! ([`decide_endpoints`]; the reconciler's `sync_endpoints` probes, reads and writes).
//!
//! The Service has no selector: Kubernetes' EndpointSlice controller would mark an endpoint
//! ready from the Pod's readiness, which for a control-plane machine comes only after its
//! workload Node is Ready, long after `kubeadm init` needs its own apiserver through the Service.
//! Instead an endpoint is ready while its apiserver answers `/readyz` ([`crate::remote::apiserver_health`]).

use std::{net::Ipv4Addr, time::Duration};

use capk_api::{
    constants::{
        API_SERVER_PORT, CLUSTER_NAME_LABEL, CONDITION_CONTROL_PLANE_ENDPOINTS_READY,
        ENDPOINT_SLICE_MANAGED_BY, MACHINE_ROLE_LABEL, ROLE_CONTROL_PLANE,
    },
    v1alpha1::KVMCluster,
};
use k8s_openapi::{
    api::{
        core::v1::{ObjectReference, Pod},
        discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice},
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use kube::{Resource, ResourceExt, runtime::events::EventType};

use super::build::owned_labels;
use crate::{
    k8s::conditions::DesiredCondition,
    k8s::ownership::{Home, Owner},
    remote::apiserver_health::{EndpointHealth, ProbeError, recheck_after},
};

/// `kubernetes.io/service-name`: which Service an EndpointSlice belongs to.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// `endpointslice.kubernetes.io/managed-by`: who writes an EndpointSlice.
pub const MANAGED_BY_LABEL: &str = "endpointslice.kubernetes.io/managed-by";

/// A control-plane machine Pod with an address: one endpoint of the Service.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ControlPlaneMember {
    /// Pod name.
    pub pod: String,
    /// Pod UID (the health is tracked per Pod, not per address).
    pub uid: String,
    /// The Pod's IPv4 address, which the VM holds.
    pub ip: Ipv4Addr,
    /// The management cluster node it runs on.
    pub node: Option<String>,
    /// The Pod is being deleted.
    pub terminating: bool,
}

/// The control-plane machine Pods of Cluster `cluster` in `ns` that have an IPv4 address and
/// have not ended, by name.
pub fn control_plane_members<'a>(
    pods: impl IntoIterator<Item = &'a Pod>,
    ns: &str,
    cluster: &str,
) -> Vec<ControlPlaneMember> {
    let mut members: Vec<ControlPlaneMember> = pods
        .into_iter()
        .filter(|p| p.namespace().as_deref() == Some(ns))
        .filter(|p| {
            let labels = p.labels();
            labels.get(CLUSTER_NAME_LABEL).map(String::as_str) == Some(cluster)
                && labels.get(MACHINE_ROLE_LABEL).map(String::as_str) == Some(ROLE_CONTROL_PLANE)
        })
        .filter_map(|p| {
            let status = p.status.as_ref()?;
            if matches!(status.phase.as_deref(), Some("Succeeded" | "Failed")) {
                return None;
            }
            let ip = status
                .pod_ips
                .iter()
                .flatten()
                .map(|i| i.ip.as_str())
                .chain(status.pod_ip.as_deref())
                .find_map(|ip| ip.parse::<Ipv4Addr>().ok())?;
            Some(ControlPlaneMember {
                pod: p.name_any(),
                uid: p.uid()?,
                ip,
                node: p.spec.as_ref().and_then(|s| s.node_name.clone()),
                terminating: p.meta().deletion_timestamp.is_some(),
            })
        })
        .collect();
    members.sort_by(|a, b| a.pod.cmp(&b.pod));
    members
}

/// The control-plane Service's EndpointSlice: one endpoint per member, ready while its apiserver
/// answers and its Pod is not being deleted. `serving` ignores deletion, so that kube-proxy
/// still reaches a terminating control plane when it is the last one answering. It lives next
/// to Service `service` in `home`, and has its name.
pub fn endpoint_slice(
    kc: &KVMCluster,
    cluster: &str,
    service: &str,
    members: &[(ControlPlaneMember, EndpointHealth)],
    home: &Home,
) -> EndpointSlice {
    let svc = service.to_owned();
    let owner = Owner::cluster(kc);
    let mut labels = owned_labels(cluster);
    labels.extend(owner.labels());
    labels.insert(SERVICE_NAME_LABEL.to_owned(), svc.clone());
    labels.insert(
        MANAGED_BY_LABEL.to_owned(),
        ENDPOINT_SLICE_MANAGED_BY.to_owned(),
    );
    let ns = Some(home.namespace.clone());
    EndpointSlice {
        metadata: ObjectMeta {
            name: Some(svc),
            namespace: ns.clone(),
            labels: Some(labels),
            owner_references: owner.owner_references(home),
            ..Default::default()
        },
        address_type: "IPv4".to_owned(),
        endpoints: members
            .iter()
            .map(|(m, health)| Endpoint {
                addresses: vec![m.ip.to_string()],
                conditions: Some(EndpointConditions {
                    ready: Some(takes_traffic(members, m, health) && !m.terminating),
                    serving: Some(takes_traffic(members, m, health)),
                    terminating: Some(m.terminating),
                }),
                node_name: m.node.clone(),
                target_ref: Some(ObjectReference {
                    kind: Some("Pod".to_owned()),
                    namespace: ns.clone(),
                    name: Some(m.pod.clone()),
                    uid: Some(m.uid.clone()),
                    ..Default::default()
                }),
                ..Default::default()
            })
            .collect(),
        ports: Some(vec![EndpointPort {
            name: Some("apiserver".to_owned()),
            port: Some(API_SERVER_PORT),
            protocol: Some("TCP".to_owned()),
            app_protocol: None,
        }]),
    }
}

/// No apiserver of the cluster is ready (none answers `/readyz` with 200, or only terminating
/// ones do).
fn none_ready(members: &[(ControlPlaneMember, EndpointHealth)]) -> bool {
    !members.iter().any(|(m, h)| h.answering && !m.terminating)
}

/// Whether traffic goes to this apiserver: it answers `/readyz`, or, when none of the cluster's
/// does, it is still alive (answers "not ready", or accepts connections but is slow), as a cloud
/// load balancer fails open when every target is unhealthy. A single control plane whose etcd is
/// slow (an emulated guest under load) would otherwise turn a slow cluster into one that refuses
/// every connection, the workers' `kubeadm join` included. A dead VM (nothing accepts the
/// connection) still leaves.
fn takes_traffic(
    members: &[(ControlPlaneMember, EndpointHealth)],
    m: &ControlPlaneMember,
    h: &EndpointHealth,
) -> bool {
    h.answering
        || (!m.terminating
            && none_ready(members)
            && h.last_error.as_ref().is_some_and(ProbeError::alive))
}

/// What to do about the control-plane Service's endpoints, decided without I/O from its members'
/// apiserver health and the EndpointSlices that are there ([`decide_endpoints`]).
#[derive(Clone, Debug, PartialEq)]
pub struct EndpointsDecision {
    /// `ControlPlaneEndpointsReady`.
    pub condition: DesiredCondition,
    /// When to probe the apiservers again.
    pub recheck: Duration,
    /// The EndpointSlice to apply; `None` when the one there already is it.
    pub write: Option<EndpointSlice>,
    /// The Event that says who left or came back, with the condition's message: Normal when
    /// every apiserver answers, else Warning. Only when a slice that was there is rewritten (not
    /// on the first write).
    pub event: Option<(EventType, String)>,
}

/// Decides the control-plane Service's endpoints: the EndpointSlice `service` with `observed`'s
/// members (ready while their apiserver answers, see [`endpoint_slice`]), written only when the
/// one among `current` (the slices labelled for the Service) differs; the condition; and when
/// to probe again (soon while some probe fails).
pub fn decide_endpoints(
    kc: &KVMCluster,
    cluster: &str,
    service: &str,
    observed: &[(ControlPlaneMember, EndpointHealth)],
    current: &[EndpointSlice],
    home: &Home,
) -> EndpointsDecision {
    let condition = endpoints_condition(observed);
    let recheck = recheck_after(observed.iter().map(|(_, h)| h));
    let desired = endpoint_slice(kc, cluster, service, observed, home);
    let ours = current.iter().find(|s| s.name_any() == desired.name_any());
    if ours.is_some_and(|s| slice_is_current(s, &desired)) {
        return EndpointsDecision {
            condition,
            recheck,
            write: None,
            event: None,
        };
    }
    let event = ours.map(|_| {
        let type_ = if condition.reason == "APIServersAnswering" {
            EventType::Normal
        } else {
            EventType::Warning
        };
        (type_, condition.message.clone())
    });
    EndpointsDecision {
        condition,
        recheck,
        write: Some(desired),
        event,
    }
}

/// The addresses `slice` publishes as ready.
pub fn ready_addresses(slice: &EndpointSlice) -> Vec<String> {
    slice
        .endpoints
        .iter()
        .filter(|e| e.conditions.as_ref().and_then(|c| c.ready) == Some(true))
        .flat_map(|e| e.addresses.clone())
        .collect()
}

/// Whether `current` already is `desired` (so nothing needs writing): same endpoints and ports,
/// our labels in place, and owner references to a KVMCluster exactly the desired ones (none in
/// a hosting cluster).
pub fn slice_is_current(current: &EndpointSlice, desired: &EndpointSlice) -> bool {
    let labels_in_place = desired
        .labels()
        .iter()
        .all(|(k, v)| current.labels().get(k) == Some(v));
    let kvm_owners = |s: &EndpointSlice| -> Vec<String> {
        let mut uids: Vec<String> = s
            .owner_references()
            .iter()
            .filter(|o| o.kind == "KVMCluster")
            .map(|o| o.uid.clone())
            .collect();
        uids.sort();
        uids
    };
    let owners_in_place = kvm_owners(current) == kvm_owners(desired);
    current.address_type == desired.address_type
        && current.endpoints == desired.endpoints
        && current.ports == desired.ports
        && labels_in_place
        && owners_in_place
}

/// `ControlPlaneEndpointsReady`: True while some control-plane apiserver answers (the Service
/// takes traffic); the message says how many of how many, and why the others do not.
pub fn endpoints_condition(members: &[(ControlPlaneMember, EndpointHealth)]) -> DesiredCondition {
    let t = CONDITION_CONTROL_PLANE_ENDPOINTS_READY;
    if members.is_empty() {
        return DesiredCondition::falsy(
            t,
            "WaitingForControlPlaneMachines",
            "no control-plane machine Pod has an IP address yet",
        );
    }
    let answering = members.iter().filter(|(_, h)| h.answering).count();
    let why = |h: &EndpointHealth| {
        h.last_error
            .as_ref()
            .map_or("not probed yet".to_owned(), ToString::to_string)
    };
    // Not answering, split into those that take traffic anyway (none is ready) and the others.
    let (mut alive, mut silent) = (Vec::new(), Vec::new());
    for (m, h) in members.iter().filter(|(_, h)| !h.answering) {
        let entry = format!("{} ({})", m.pod, why(h));
        if takes_traffic(members, m, h) {
            alive.push(entry);
        } else {
            silent.push(entry);
        }
    }
    let mut message = format!(
        "{answering} of {} control-plane apiservers answer /readyz",
        members.len()
    );
    if !alive.is_empty() {
        message.push_str(&format!(
            "; none is ready, so the Service sends traffic to those still alive: {}",
            alive.join(", ")
        ));
    }
    if !silent.is_empty() {
        message.push_str(&format!("; taking no traffic: {}", silent.join(", ")));
    }
    match answering {
        0 if !alive.is_empty() => DesiredCondition::falsy(t, "APIServersNotReady", message),
        0 => DesiredCondition::falsy(t, "NoAPIServerAnswering", message),
        n if n == members.len() => DesiredCondition::truthy(t, "APIServersAnswering", message),
        _ => DesiredCondition::truthy(t, "SomeAPIServersNotAnswering", message),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use capk_api::v1alpha1::KVMClusterSpec;
    use serde_json::json;

    fn kvm_cluster() -> KVMCluster {
        let mut kc = KVMCluster::new("demo", KVMClusterSpec::default());
        kc.metadata.namespace = Some("team-a".into());
        kc.metadata.uid = Some("0000-1111".into());
        kc
    }

    fn management() -> Home {
        Home {
            namespace: "team-a".into(),
            management: true,
        }
    }

    fn pod(name: &str, cluster: &str, role: &str, status: serde_json::Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "team-a", "uid": format!("uid-{name}"),
                "labels": {"cluster.x-k8s.io/cluster-name": cluster,
                           "infrastructure.cluster.x-k8s.io/machine-role": role}},
            "spec": {"nodeName": "mc-node-1", "containers": []},
            "status": status,
        }))
        .unwrap()
    }

    fn running(ip: &str) -> serde_json::Value {
        json!({"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]})
    }

    #[test]
    fn members_are_the_clusters_control_plane_pods_with_an_ipv4_address() {
        let mut deleting = pod("demo-cp-c", "demo", "control-plane", running("10.0.0.3"));
        deleting.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                "2026-01-01T00:00:00Z".parse().unwrap(),
            ));
        let pods = [
            pod("demo-cp-b", "demo", "control-plane", running("10.0.0.2")),
            pod("demo-cp-a", "demo", "control-plane", running("10.0.0.1")),
            deleting,
            // No address yet (scheduled, the CNI has not run).
            pod(
                "demo-cp-d",
                "demo",
                "control-plane",
                json!({"phase": "Pending"}),
            ),
            // Dual stack: the IPv4 address, whichever comes first.
            pod(
                "demo-cp-e",
                "demo",
                "control-plane",
                json!({"phase": "Running", "podIP": "fd00::5", "podIPs": [{"ip": "fd00::5"}, {"ip": "10.0.0.5"}]}),
            ),
            pod(
                "demo-cp-f",
                "demo",
                "control-plane",
                json!({"phase": "Failed", "podIP": "10.0.0.6"}),
            ),
            pod("demo-md-0", "demo", "worker", running("10.0.0.7")),
            pod("other-cp-0", "other", "control-plane", running("10.0.0.8")),
        ];
        let members = control_plane_members(&pods, "team-a", "demo");
        let summary: Vec<(&str, String, bool)> = members
            .iter()
            .map(|m| (m.pod.as_str(), m.ip.to_string(), m.terminating))
            .collect();
        assert_eq!(
            summary,
            [
                ("demo-cp-a", "10.0.0.1".to_owned(), false),
                ("demo-cp-b", "10.0.0.2".to_owned(), false),
                ("demo-cp-c", "10.0.0.3".to_owned(), true),
                ("demo-cp-e", "10.0.0.5".to_owned(), false),
            ]
        );
        assert_eq!(members[0].node.as_deref(), Some("mc-node-1"));
        assert_eq!(members[0].uid, "uid-demo-cp-a");
        assert!(control_plane_members(&pods, "team-b", "demo").is_empty());
    }

    fn member(pod: &str, ip: [u8; 4], terminating: bool) -> ControlPlaneMember {
        ControlPlaneMember {
            pod: pod.into(),
            uid: format!("uid-{pod}"),
            ip: ip.into(),
            node: Some("mc-node-1".into()),
            terminating,
        }
    }

    fn health(answering: bool, last_error: Option<ProbeError>) -> EndpointHealth {
        EndpointHealth {
            answering,
            failures: u32::from(last_error.is_some()),
            last_error,
        }
    }

    #[test]
    fn slice_marks_ready_only_the_apiservers_that_answer() {
        let members = [
            (
                member("demo-cp-a", [10, 0, 0, 1], false),
                health(true, None),
            ),
            // First failed probe: still in.
            (
                member("demo-cp-b", [10, 0, 0, 2], false),
                health(true, Some(ProbeError::Timeout)),
            ),
            // Not answering: out.
            (
                member("demo-cp-c", [10, 0, 0, 3], false),
                health(
                    false,
                    Some(ProbeError::Connect("connection refused".into())),
                ),
            ),
            // Being deleted but still answering: serving, not ready.
            (member("demo-cp-d", [10, 0, 0, 4], true), health(true, None)),
        ];
        insta::assert_yaml_snapshot!(endpoint_slice(
            &kvm_cluster(),
            "demo",
            "demo-apiserver",
            &members,
            &management()
        ));
    }

    #[test]
    fn no_members_make_an_empty_slice() {
        let slice = endpoint_slice(&kvm_cluster(), "demo", "demo-apiserver", &[], &management());
        assert!(slice.endpoints.is_empty());
        assert_eq!(slice.labels()[SERVICE_NAME_LABEL], "demo-apiserver");
    }

    #[test]
    fn an_unchanged_slice_needs_no_write() {
        let members = [(
            member("demo-cp-a", [10, 0, 0, 1], false),
            health(true, None),
        )];
        let desired = endpoint_slice(
            &kvm_cluster(),
            "demo",
            "demo-apiserver",
            &members,
            &management(),
        );
        // As read back: the apiserver added metadata of its own.
        let mut current = desired.clone();
        current.metadata.resource_version = Some("42".into());
        current
            .metadata
            .labels
            .as_mut()
            .unwrap()
            .insert("extra".into(), "x".into());
        assert!(slice_is_current(&current, &desired));
        let flipped = [(
            member("demo-cp-a", [10, 0, 0, 1], false),
            health(false, Some(ProbeError::Timeout)),
        )];
        assert!(!slice_is_current(
            &current,
            &endpoint_slice(
                &kvm_cluster(),
                "demo",
                "demo-apiserver",
                &flipped,
                &management()
            )
        ));
        current.metadata.owner_references = None;
        assert!(!slice_is_current(&current, &desired), "owner missing");
        // Switched to a hosting cluster: the KVMCluster's owner reference must go.
        let hosted = Home {
            namespace: "team-a".into(),
            management: false,
        };
        let desired_hosted =
            endpoint_slice(&kvm_cluster(), "demo", "demo-apiserver", &members, &hosted);
        assert!(!slice_is_current(&desired, &desired_hosted), "stale owner");
        assert!(slice_is_current(&desired_hosted, &desired_hosted));
    }

    #[test]
    fn the_condition_counts_the_apiservers_that_answer() {
        let summary = |c: DesiredCondition| (c.status, c.reason.to_string(), c.message);
        assert_eq!(
            summary(endpoints_condition(&[])),
            (
                false,
                "WaitingForControlPlaneMachines".into(),
                "no control-plane machine Pod has an IP address yet".into()
            )
        );
        let a = member("demo-cp-a", [10, 0, 0, 1], false);
        let b = member("demo-cp-b", [10, 0, 0, 2], false);
        let up = health(true, None);
        let dead = health(false, Some(ProbeError::Timeout));
        let new = EndpointHealth::default();
        assert_eq!(
            summary(endpoints_condition(&[
                (a.clone(), up.clone()),
                (b.clone(), up.clone())
            ])),
            (
                true,
                "APIServersAnswering".into(),
                "2 of 2 control-plane apiservers answer /readyz".into()
            )
        );
        assert_eq!(
            summary(endpoints_condition(&[(a.clone(), up), (b.clone(), dead.clone())])),
            (
                true,
                "SomeAPIServersNotAnswering".into(),
                "1 of 2 control-plane apiservers answer /readyz; taking no traffic: demo-cp-b (no answer within 2s)".into()
            )
        );
        assert_eq!(
            summary(endpoints_condition(&[(a, new), (b, dead)])),
            (
                false,
                "NoAPIServerAnswering".into(),
                "0 of 2 control-plane apiservers answer /readyz; taking no traffic: demo-cp-a (not probed yet), demo-cp-b (no answer within 2s)".into()
            )
        );
    }

    /// When no apiserver is ready, those still alive (an answer other than 200, or a connection
    /// accepted but no answer in time) take the traffic; a dead one (nothing accepts the
    /// connection, or refused) and a terminating one do not. As soon as one is ready again, only
    /// the ready ones do.
    #[test]
    fn with_none_ready_the_service_fails_open_to_the_apiservers_still_alive() {
        let slow = member("demo-cp-a", [10, 0, 0, 1], false);
        let unready = member("demo-cp-b", [10, 0, 0, 2], false);
        let frozen = member("demo-cp-c", [10, 0, 0, 3], false);
        let leaving = member("demo-cp-d", [10, 0, 0, 4], true);
        let gone = |e: ProbeError| EndpointHealth {
            answering: false,
            failures: 2,
            last_error: Some(e),
        };
        let members = [
            (slow.clone(), gone(ProbeError::NoAnswer)),
            (unready.clone(), gone(ProbeError::Status(500))),
            (frozen.clone(), gone(ProbeError::Timeout)),
            (leaving.clone(), gone(ProbeError::Status(500))),
        ];
        let ready = |members: &[(ControlPlaneMember, EndpointHealth)]| -> Vec<String> {
            ready_addresses(&endpoint_slice(
                &kvm_cluster(),
                "demo",
                "demo-apiserver",
                members,
                &management(),
            ))
        };
        assert_eq!(ready(&members), ["10.0.0.1", "10.0.0.2"]);
        let c = endpoints_condition(&members);
        assert!(!c.status);
        assert_eq!(c.reason.to_string(), "APIServersNotReady");
        assert_eq!(
            c.message,
            "0 of 4 control-plane apiservers answer /readyz; none is ready, so the Service sends \
             traffic to those still alive: demo-cp-a (connected, no answer within 2s), demo-cp-b \
             (/readyz answered HTTP 500); taking no traffic: demo-cp-c (no answer within 2s), \
             demo-cp-d (/readyz answered HTTP 500)"
        );

        // One ready again: only it.
        let mut recovered = members.clone();
        recovered[2].1 = health(true, None);
        assert_eq!(ready(&recovered), ["10.0.0.3"]);
        assert_eq!(
            endpoints_condition(&recovered).reason.to_string(),
            "SomeAPIServersNotAnswering"
        );

        // Only dead ones: nothing takes traffic (kube-proxy refuses at once).
        let dead = [
            (frozen, gone(ProbeError::Timeout)),
            (leaving, health(true, None)),
        ];
        assert_eq!(ready(&dead), Vec::<String>::new());
        assert_eq!(
            endpoints_condition(&dead).reason.to_string(),
            "SomeAPIServersNotAnswering"
        );
    }

    /// The decision about `observed`, given the slices `current` there are.
    fn decide(
        observed: &[(ControlPlaneMember, EndpointHealth)],
        current: &[EndpointSlice],
    ) -> EndpointsDecision {
        decide_endpoints(
            &kvm_cluster(),
            "demo",
            "demo-apiserver",
            observed,
            current,
            &management(),
        )
    }

    /// `slice` as the apiserver returns it after a write: with metadata of its own.
    fn as_read_back(slice: &EndpointSlice) -> EndpointSlice {
        let mut read = slice.clone();
        read.metadata.resource_version = Some("7".into());
        read.metadata.uid = Some("slice-uid".into());
        read
    }

    #[test]
    fn the_first_slice_publishes_the_answering_apiservers_without_an_event() {
        let observed = [
            (
                member("demo-cp-a", [10, 0, 0, 1], false),
                health(true, None),
            ),
            (
                member("demo-cp-b", [10, 0, 0, 2], false),
                health(false, Some(ProbeError::Timeout)),
            ),
        ];
        let decision = decide(&observed, &[]);
        let written = decision.write.expect("no slice yet: one is written");
        assert_eq!(written.name_any(), "demo-apiserver");
        assert_eq!(ready_addresses(&written), ["10.0.0.1"]);
        assert_eq!(decision.event, None, "nobody left or came back yet");
        assert_eq!(decision.condition.reason, "SomeAPIServersNotAnswering");
        assert_eq!(
            decision.recheck,
            crate::remote::apiserver_health::RECHECK_FAILING
        );
    }

    #[test]
    fn an_unchanged_world_writes_nothing_and_says_nothing() {
        let observed = [
            (
                member("demo-cp-a", [10, 0, 0, 1], false),
                health(true, None),
            ),
            (
                member("demo-cp-b", [10, 0, 0, 2], false),
                health(true, None),
            ),
        ];
        let written = decide(&observed, &[]).write.unwrap();
        let again = decide(&observed, &[as_read_back(&written)]);
        assert_eq!(again.write, None);
        assert_eq!(again.event, None);
        assert!(again.condition.status);
        assert_eq!(
            again.recheck,
            crate::remote::apiserver_health::RECHECK_HEALTHY
        );
    }

    #[test]
    fn an_apiserver_that_stops_answering_leaves_the_slice_with_a_warning() {
        let a = member("demo-cp-a", [10, 0, 0, 1], false);
        let b = member("demo-cp-b", [10, 0, 0, 2], false);
        let both = [
            (a.clone(), health(true, None)),
            (b.clone(), health(true, None)),
        ];
        let before = as_read_back(&decide(&both, &[]).write.unwrap());
        let dead = EndpointHealth {
            answering: false,
            failures: 2,
            last_error: Some(ProbeError::Timeout),
        };
        let one_left = [(a.clone(), health(true, None)), (b.clone(), dead)];
        let decision = decide(&one_left, std::slice::from_ref(&before));
        assert_eq!(
            ready_addresses(decision.write.as_ref().unwrap()),
            ["10.0.0.1"]
        );
        assert_eq!(
            decision.event,
            Some((
                EventType::Warning,
                "1 of 2 control-plane apiservers answer /readyz; taking no traffic: demo-cp-b \
                 (no answer within 2s)"
                    .to_owned()
            ))
        );
        // It comes back: published ready again, and a Normal Event says all answer.
        let after = as_read_back(decision.write.as_ref().unwrap());
        let back = decide(&both, &[after]);
        assert_eq!(
            ready_addresses(back.write.as_ref().unwrap()),
            ["10.0.0.1", "10.0.0.2"]
        );
        assert_eq!(back.event.map(|(t, _)| t), Some(EventType::Normal));
    }

    #[test]
    fn a_slice_of_another_name_for_the_service_is_not_ours_to_compare() {
        let observed = [(
            member("demo-cp-a", [10, 0, 0, 1], false),
            health(true, None),
        )];
        let mut other = as_read_back(&decide(&observed, &[]).write.unwrap());
        other.metadata.name = Some("demo-apiserver-abcde".into());
        let decision = decide(&observed, &[other]);
        assert!(decision.write.is_some(), "ours does not exist yet");
        assert_eq!(decision.event, None, "a first write says nothing");
    }
}
