//! Pure: from a KVMCluster and its Cluster to the desired Service, endpoint and status (the
//! Service's endpoints are in [`super::endpoints`]).

use std::collections::BTreeMap;

use capk_api::{
    constants::{
        API_SERVER_PORT, CLUSTER_NAME_LABEL, CONDITION_PAUSED, CONDITION_READY, MANAGED_BY,
        MAX_LABEL_LEN,
    },
    v1alpha1::{ApiEndpoint, KVMCluster, KVMClusterStatus, ServiceType},
};
use k8s_openapi::{
    api::core::v1::{Service, ServicePort, ServiceSpec},
    apimachinery::pkg::{apis::meta::v1::ObjectMeta, util::intstr::IntOrString},
    jiff::Timestamp,
};
use kube::{Resource, ResourceExt};

use crate::{
    k8s::conditions::{self, DesiredCondition},
    k8s::ownership::{Home, Owner},
    settings::{KeyPatterns, TenantPolicy},
};

/// Labels on every object the controller creates for a cluster (to which each adds the labels
/// naming its owner, [`Owner::labels`]).
pub fn owned_labels(cluster: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (CLUSTER_NAME_LABEL.to_owned(), cluster.to_owned()),
        (
            "app.kubernetes.io/managed-by".to_owned(),
            MANAGED_BY.to_owned(),
        ),
    ])
}

/// The control-plane Service's name when made in `home` ([`Home::name_for`]):
/// `<cluster>-apiserver` in the KVMCluster's own namespace; in another (a hosting namespace
/// several management namespaces may share) `<cluster>-<hash of its namespace>-apiserver`, so
/// that same-named clusters of two namespaces never want one Service. A DNS-1035 label of at
/// most 63 characters, as a Service name must be.
pub fn service_name_in(kc: &KVMCluster, cluster: &str, home: &Home) -> String {
    let ns = kc.namespace().unwrap_or_default();
    home.name_for(&ns, cluster, "-apiserver", MAX_LABEL_LEN)
}

/// The control-plane Service: port 6443 of the cluster's control-plane machines.
///
/// No selector: its EndpointSlice is the controller's ([`super::endpoints`]), with a machine's
/// address ready while its apiserver answers `/readyz`. A selector would make Kubernetes decide
/// from the Pod's readiness, which comes long after the first control-plane VM needs its own
/// apiserver through this Service during `kubeadm init`; publishing not-ready addresses instead
/// would send traffic to dead control planes too. It is `name` ([`service_name_in`]) in `home`.
pub fn control_plane_service(kc: &KVMCluster, cluster: &str, name: &str, home: &Home) -> Service {
    let svc_spec = kc.spec.control_plane_service.clone().unwrap_or_default();
    let service_type = svc_spec.type_.unwrap_or_default();
    let type_ = match service_type {
        ServiceType::ClusterIP => "ClusterIP",
        ServiceType::NodePort => "NodePort",
        ServiceType::LoadBalancer => "LoadBalancer",
    };
    // 0 or absent: the apiserver allocates one (and keeps it on later applies without one).
    let node_port = svc_spec
        .node_port
        .filter(|p| *p != 0 && service_type == ServiceType::NodePort);
    let owner = Owner::cluster(kc);
    let mut labels = owned_labels(cluster);
    labels.extend(owner.labels());
    Service {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some(home.namespace.clone()),
            labels: Some(labels),
            annotations: svc_spec.annotations.filter(|a| !a.is_empty()),
            owner_references: owner.owner_references(home),
            ..Default::default()
        },
        spec: Some(ServiceSpec {
            type_: Some(type_.to_owned()),
            ports: Some(vec![ServicePort {
                name: Some("apiserver".to_owned()),
                port: API_SERVER_PORT,
                target_port: Some(IntOrString::Int(API_SERVER_PORT)),
                node_port,
                protocol: Some("TCP".to_owned()),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        status: None,
    }
}

/// The endpoint to record when the user left `spec.controlPlaneEndpoint` empty. Host: the
/// external host when configured, else the DNS name of Service `service` in `home` (which the VMs,
/// Pods there, resolve). Port: with type NodePort and an external host (which then reaches the
/// nodes), `node_port`, the node port of the applied Service; else the Service's port, 6443.
/// `None` keeps the user's value, or waits for a node port not known yet.
pub fn endpoint_to_set(
    kc: &KVMCluster,
    service: &str,
    cluster_domain: &str,
    home: &Home,
    node_port: Option<i32>,
) -> Option<ApiEndpoint> {
    if kc
        .spec
        .control_plane_endpoint
        .as_ref()
        .is_some_and(ApiEndpoint::is_set)
    {
        return None;
    }
    let svc = kc.spec.control_plane_service.clone().unwrap_or_default();
    let external = svc.external_host.filter(|h| !h.is_empty());
    let port = match (&external, svc.type_.unwrap_or_default()) {
        (Some(_), ServiceType::NodePort) => node_port.filter(|p| *p > 0)?,
        _ => API_SERVER_PORT,
    };
    let ns = &home.namespace;
    let host = external.unwrap_or_else(|| format!("{service}.{ns}.svc.{cluster_domain}"));
    Some(ApiEndpoint {
        host: Some(host),
        port: Some(port),
    })
}

/// Reason of `Ready` when the spec asks for what the operator does not allow.
pub const REASON_SPEC_INVALID: &str = "SpecInvalid";

/// The `Ready` condition refusing `kc` when its control-plane Service asks for what the
/// operator's policy does not allow: a type (`--allowed-control-plane-service-types`) or
/// annotations (`--allowed-control-plane-service-annotations`), each refusal naming the field
/// and the provider variable; `None` when everything is allowed.
pub fn refused_spec(kc: &KVMCluster, policy: &TenantPolicy) -> Option<DesiredCondition> {
    let service = kc.spec.control_plane_service.as_ref();
    let mut refusals = Vec::new();
    let t = service.and_then(|s| s.type_).unwrap_or_default();
    if !policy.allows_service_type(t) {
        let allowed: Vec<String> = std::iter::once(ServiceType::ClusterIP)
            .chain(policy.control_plane_service_types.iter().copied())
            .map(|t| format!("{t:?}"))
            .collect();
        refusals.push(format!(
            "spec.controlPlaneService.type {t:?} is not allowed on this management cluster (allowed: {}); its operator allows more with the controller flag --allowed-control-plane-service-types (CAPK_ALLOWED_CONTROL_PLANE_SERVICE_TYPES at clusterctl init)",
            allowed.join(", ")
        ));
    }
    for key in service
        .and_then(|s| s.annotations.as_ref())
        .into_iter()
        .flat_map(|a| a.keys())
        .filter(|k| !KeyPatterns::allows(&policy.service_annotation_keys, k))
    {
        refusals.push(format!(
            "spec.controlPlaneService.annotations[{key:?}] is not an annotation the operator lets control-plane Services carry (allowed: {}): add-ons of the management cluster act on Service annotations for whoever wrote them; its operator lists keys with the controller flag --allowed-control-plane-service-annotations (CAPK_ALLOWED_CONTROL_PLANE_SERVICE_ANNOTATIONS at clusterctl init)",
            TenantPolicy::describe(&policy.service_annotation_keys)
        ));
    }
    (!refusals.is_empty())
        .then(|| DesiredCondition::falsy(CONDITION_READY, REASON_SPEC_INVALID, refusals.join("; ")))
}

/// Why the cluster is not provisioned yet, or that it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClusterState {
    /// No Cluster owns the KVMCluster yet (CAPI sets the owner reference).
    WaitingForOwner,
    /// Reconciliation is paused.
    Paused,
    /// Service applied and endpoint recorded; `endpoints` says whether its apiservers answer.
    Provisioned {
        /// The `ControlPlaneEndpointsReady` condition ([`super::endpoints::endpoints_condition`]).
        endpoints: DesiredCondition,
        /// The `HostingClusterAvailable` condition: where the objects live.
        hosting: DesiredCondition,
    },
    /// The spec asks for what the operator does not allow (the `Ready` condition says what);
    /// nothing is applied.
    SpecInvalid(DesiredCondition),
    /// The cluster where the objects live cannot be used now (the `HostingClusterAvailable`
    /// condition says why). What was last seen stands: a provisioned cluster stays provisioned
    /// and Ready, the VMs run on untouched.
    HostingUnavailable(DesiredCondition),
}

/// The status the KVMCluster should have.
pub fn status(kc: &KVMCluster, state: &ClusterState, now: Timestamp) -> KVMClusterStatus {
    let current = kc.status.clone().unwrap_or_default();
    let generation = kc.meta().generation;
    let paused = match state {
        ClusterState::Paused => DesiredCondition::truthy(
            CONDITION_PAUSED,
            "Paused",
            "the Cluster or this object is paused; nothing is changed until it is unpaused",
        ),
        _ => DesiredCondition::falsy(CONDITION_PAUSED, "NotPaused", ""),
    };
    let mut desired = vec![paused];
    let mut out = current.clone();
    match state {
        ClusterState::WaitingForOwner => desired.push(DesiredCondition::falsy(
            CONDITION_READY,
            "WaitingForClusterOwner",
            "waiting for Cluster API to set a Cluster as owner of this KVMCluster",
        )),
        ClusterState::Paused => {}
        ClusterState::SpecInvalid(why) => desired.push(why.clone()),
        ClusterState::HostingUnavailable(hosting) => {
            desired.push(hosting.clone());
            if !current.contract.is_provisioned() {
                desired.push(DesiredCondition::falsy(
                    CONDITION_READY,
                    hosting.reason.clone(),
                    hosting.message.clone(),
                ));
            }
        }
        ClusterState::Provisioned { endpoints, hosting } => {
            // Not part of Ready (which CAPI mirrors to the Cluster): the cluster must keep
            // provisioning while its first control plane boots and nothing answers yet.
            desired.push(endpoints.clone());
            desired.push(hosting.clone());
            desired.push(DesiredCondition::truthy(
                CONDITION_READY,
                "Provisioned",
                "control-plane Service and endpoint are in place",
            ));
            out.contract.set_provisioned();
            out.failure_domains = kc.spec.failure_domains.clone().filter(|f| !f.is_empty());
            out.contract.observed_generation = generation;
        }
    }
    let merged = conditions::merge(
        current.contract.conditions.as_deref().unwrap_or_default(),
        &desired,
        generation,
        now,
    );
    out.contract.conditions = Some(merged);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use capk_api::v1alpha1::{ControlPlaneService, KVMClusterSpec};

    fn kvm_cluster(spec: KVMClusterSpec) -> KVMCluster {
        let mut kc = KVMCluster::new("demo", spec);
        kc.metadata.namespace = Some("team-a".into());
        kc.metadata.uid = Some("0000-1111".into());
        kc.metadata.generation = Some(3);
        kc
    }

    /// The Service as the controller provisions it while nothing answers yet.
    fn provisioned() -> ClusterState {
        ClusterState::Provisioned {
            endpoints: crate::kvmcluster::endpoints::endpoints_condition(&[]),
            hosting: DesiredCondition::truthy(
                "HostingClusterAvailable",
                "ManagementCluster",
                "machines and the control-plane Service live in namespace team-a of the management cluster",
            ),
        }
    }

    /// The management cluster, the KVMCluster's namespace.
    fn management() -> Home {
        Home {
            namespace: "team-a".into(),
            management: true,
        }
    }

    #[test]
    fn service_has_no_selector_and_publishes_no_unready_address() {
        let kc = kvm_cluster(KVMClusterSpec {
            control_plane_service: Some(ControlPlaneService {
                type_: Some(ServiceType::LoadBalancer),
                annotations: Some(BTreeMap::from([("lb.example/pool".into(), "a".into())])),
                external_host: Some("demo.k8s.example.com".into()),
                node_port: None,
            }),
            ..Default::default()
        });
        let svc = control_plane_service(&kc, "demo", "demo-apiserver", &management());
        let spec = svc.spec.as_ref().unwrap();
        assert_eq!(spec.selector, None);
        assert_eq!(spec.publish_not_ready_addresses, None);
        insta::assert_yaml_snapshot!(svc);
    }

    /// `spec.controlPlaneEndpoint` to set for Service `demo-apiserver` in the management
    /// cluster, given the node port the Service got.
    fn endpoint_in_management(kc: &KVMCluster, node_port: Option<i32>) -> Option<ApiEndpoint> {
        endpoint_to_set(
            kc,
            "demo-apiserver",
            "cluster.local",
            &management(),
            node_port,
        )
    }

    /// A KVMCluster whose control-plane Service names external host `host`.
    fn with_external_host(host: &str) -> KVMCluster {
        kvm_cluster(KVMClusterSpec {
            control_plane_service: Some(ControlPlaneService {
                external_host: Some(host.into()),
                ..Default::default()
            }),
            ..Default::default()
        })
    }

    #[test]
    fn endpoint_defaults_to_the_service_dns_name_and_keeps_a_user_value() {
        let kc = kvm_cluster(KVMClusterSpec::default());
        assert_eq!(
            endpoint_in_management(&kc, None),
            Some(ApiEndpoint {
                host: Some("demo-apiserver.team-a.svc.cluster.local".into()),
                port: Some(6443)
            })
        );
        let external = with_external_host("demo.k8s.example.com");
        assert_eq!(
            endpoint_in_management(&external, None)
                .and_then(|e| e.host)
                .as_deref(),
            Some("demo.k8s.example.com")
        );
        let user = kvm_cluster(KVMClusterSpec {
            control_plane_endpoint: Some(ApiEndpoint {
                host: Some("10.0.0.1".into()),
                port: Some(443),
            }),
            ..Default::default()
        });
        assert_eq!(endpoint_in_management(&user, Some(31000)), None);
    }

    /// NodePort: the Service asks for the requested node port (none: the apiserver allocates
    /// one), and the endpoint is the external host at the node port the Service got.
    #[test]
    fn a_node_port_service_makes_the_endpoint_the_external_host_and_node_port() {
        let node_port = |port: Option<i32>| {
            kvm_cluster(KVMClusterSpec {
                control_plane_service: Some(ControlPlaneService {
                    type_: Some(ServiceType::NodePort),
                    external_host: Some("nodes.example.com".into()),
                    node_port: port,
                    ..Default::default()
                }),
                ..Default::default()
            })
        };
        let requested = node_port(Some(31443));
        let svc = control_plane_service(&requested, "demo", "demo-apiserver", &management());
        let spec = svc.spec.unwrap();
        assert_eq!(spec.type_.as_deref(), Some("NodePort"));
        assert_eq!(spec.ports.unwrap()[0].node_port, Some(31443));
        assert_eq!(
            endpoint_in_management(&requested, Some(31443)),
            Some(ApiEndpoint {
                host: Some("nodes.example.com".into()),
                port: Some(31443)
            })
        );
        let allocated = node_port(Some(0));
        let svc = control_plane_service(&allocated, "demo", "demo-apiserver", &management());
        assert_eq!(svc.spec.unwrap().ports.unwrap()[0].node_port, None);
        assert_eq!(
            endpoint_in_management(&allocated, None),
            None,
            "no node port known yet: the endpoint waits for it"
        );
        assert_eq!(
            endpoint_in_management(&allocated, Some(30123)).and_then(|e| e.port),
            Some(30123)
        );
        // An empty external host (a flavor's default) is no external host.
        let cluster_ip = with_external_host("");
        assert_eq!(
            endpoint_in_management(&cluster_ip, None),
            Some(ApiEndpoint {
                host: Some("demo-apiserver.team-a.svc.cluster.local".into()),
                port: Some(6443)
            })
        );
    }

    /// ClusterIP always; NodePort and LoadBalancer only when the operator lists them, else a
    /// `Ready` reason that names what is allowed and the flag that allows more.
    #[test]
    fn service_types_beyond_cluster_ip_are_the_operators_decision() {
        let of = |t: ServiceType| {
            kvm_cluster(KVMClusterSpec {
                control_plane_service: Some(ControlPlaneService {
                    type_: Some(t),
                    external_host: Some("demo.example.com".into()),
                    ..Default::default()
                }),
                ..Default::default()
            })
        };
        let shipped = TenantPolicy::default();
        assert_eq!(
            refused_spec(&kvm_cluster(KVMClusterSpec::default()), &shipped),
            None
        );
        assert_eq!(refused_spec(&of(ServiceType::ClusterIP), &shipped), None);
        let refused = refused_spec(&of(ServiceType::NodePort), &shipped).unwrap();
        assert_eq!(refused.reason, "SpecInvalid");
        assert!(
            refused.message.contains("NodePort is not allowed")
                && refused.message.contains("allowed: ClusterIP)")
                && refused
                    .message
                    .contains("--allowed-control-plane-service-types"),
            "{}",
            refused.message
        );
        let node_port = TenantPolicy {
            control_plane_service_types: vec![ServiceType::NodePort],
            ..TenantPolicy::default()
        };
        assert_eq!(refused_spec(&of(ServiceType::NodePort), &node_port), None);
        assert!(
            refused_spec(&of(ServiceType::LoadBalancer), &node_port)
                .unwrap()
                .message
                .contains("allowed: ClusterIP, NodePort)")
        );
    }

    /// External DNS, tunnels, load-balancer pools: add-ons of the management cluster that act
    /// on a Service's annotations act for the tenant only with the operator's leave.
    #[test]
    fn control_plane_service_annotations_are_the_operators_decision() {
        let with = |keys: &[&str]| {
            kvm_cluster(KVMClusterSpec {
                control_plane_service: Some(ControlPlaneService {
                    annotations: Some(
                        keys.iter()
                            .map(|k| ((*k).to_owned(), "x".to_owned()))
                            .collect(),
                    ),
                    ..Default::default()
                }),
                ..Default::default()
            })
        };
        let attack = with(&[
            "external-dns.alpha.kubernetes.io/hostname",
            "tailscale.com/expose",
        ]);
        let refused = refused_spec(&attack, &TenantPolicy::default()).unwrap();
        assert_eq!(refused.reason, "SpecInvalid");
        assert_eq!(refused.message.matches("allowed: none").count(), 2);
        for field in [
            "spec.controlPlaneService.annotations[\"external-dns.alpha.kubernetes.io/hostname\"]",
            "spec.controlPlaneService.annotations[\"tailscale.com/expose\"]",
            "CAPK_ALLOWED_CONTROL_PLANE_SERVICE_ANNOTATIONS",
        ] {
            assert!(refused.message.contains(field), "{}", refused.message);
        }
        let operator = TenantPolicy {
            service_annotation_keys: vec!["metallb.universe.tf/*".into()],
            ..TenantPolicy::default()
        };
        assert_eq!(
            refused_spec(&with(&["metallb.universe.tf/address-pool"]), &operator),
            None
        );
        let refused = refused_spec(&attack, &operator).unwrap();
        assert!(
            refused.message.contains("allowed: metallb.universe.tf/*"),
            "{}",
            refused.message
        );
        // The shipped policy lets a Service without annotations through.
        assert_eq!(refused_spec(&with(&[]), &TenantPolicy::default()), None);
    }

    #[test]
    fn in_a_hosting_cluster_the_service_names_its_owner_by_labels_only() {
        let kc = kvm_cluster(KVMClusterSpec::default());
        let hosted = Home {
            namespace: "tenant-1".into(),
            management: false,
        };
        let name = service_name_in(&kc, "demo", &hosted);
        let svc = control_plane_service(&kc, "demo", &name, &hosted);
        assert_eq!(svc.metadata.namespace.as_deref(), Some("tenant-1"));
        assert_eq!(svc.metadata.owner_references, None);
        let labels = svc.metadata.labels.unwrap();
        assert_eq!(
            labels["infrastructure.cluster.x-k8s.io/owner-namespace"],
            "team-a"
        );
        assert_eq!(labels["infrastructure.cluster.x-k8s.io/kvmcluster"], "demo");
        assert_eq!(
            labels["infrastructure.cluster.x-k8s.io/owner-uid"],
            "0000-1111"
        );
        // The VMs resolve the Service where it is.
        assert_eq!(
            endpoint_to_set(&kc, &name, "cluster.local", &hosted, None).and_then(|e| e.host),
            Some(format!("{name}.tenant-1.svc.cluster.local"))
        );
    }

    fn is_dns_1035_label(s: &str) -> bool {
        (1..=63).contains(&s.len())
            && s.starts_with(|c: char| c.is_ascii_lowercase())
            && s.ends_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
            && s.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
    }

    #[test]
    fn in_a_namespace_of_another_name_the_service_is_named_after_its_owners_namespace_too() {
        let of = |ns: &str| {
            let mut kc = kvm_cluster(KVMClusterSpec::default());
            kc.metadata.namespace = Some(ns.into());
            kc
        };
        let shared = Home {
            namespace: "shared".into(),
            management: false,
        };
        let (a, b) = (of("team-a"), of("team-b"));
        let name_a = service_name_in(&a, "demo", &shared);
        let name_b = service_name_in(&b, "demo", &shared);
        assert_ne!(name_a, name_b, "same-named clusters of two namespaces");
        assert!(
            name_a.starts_with("demo-") && name_a.ends_with("-apiserver"),
            "{name_a}"
        );
        assert_eq!(name_a, service_name_in(&a, "demo", &shared), "stable");
        // Its own namespace, in the management cluster or a hosting cluster: as always.
        assert_eq!(service_name_in(&a, "demo", &management()), "demo-apiserver");
        let own = Home {
            namespace: "team-a".into(),
            management: false,
        };
        assert_eq!(service_name_in(&a, "demo", &own), "demo-apiserver");
        // The longest cluster names still give a Service name, distinct per namespace.
        let long = format!("c{}", "x".repeat(62));
        let (la, lb) = (
            service_name_in(&a, &long, &shared),
            service_name_in(&b, &long, &shared),
        );
        for n in [&name_a, &name_b, &la, &lb] {
            assert!(is_dns_1035_label(n), "{n}");
        }
        assert_ne!(la, lb);
        assert_ne!(la, service_name_in(&a, &format!("{long}y"), &shared));
    }

    #[test]
    fn an_unreachable_hosting_cluster_keeps_a_provisioned_cluster_ready() {
        let t0: Timestamp = "2026-01-01T00:00:00Z".parse().unwrap();
        let down = DesiredCondition::falsy(
            "HostingClusterAvailable",
            "HostingClusterUnreachable",
            "the hosting cluster does not answer",
        );
        let mut kc = kvm_cluster(KVMClusterSpec::default());
        let fresh = status(&kc, &ClusterState::HostingUnavailable(down.clone()), t0);
        let conds = fresh.contract.conditions.clone().unwrap();
        let ready = conditions::find(&conds, "Ready").unwrap();
        assert_eq!(
            (ready.status.as_str(), ready.reason.as_str()),
            ("False", "HostingClusterUnreachable"),
            "never provisioned: Ready says why"
        );
        kc.status = Some(status(&kc, &provisioned(), t0));
        let later = status(&kc, &ClusterState::HostingUnavailable(down), t0);
        let conds = later.contract.conditions.clone().unwrap();
        assert_eq!(conditions::find(&conds, "Ready").unwrap().status, "True");
        assert_eq!(
            conditions::find(&conds, "HostingClusterAvailable")
                .unwrap()
                .reason,
            "HostingClusterUnreachable"
        );
        assert_eq!(later.contract.ready, Some(true));
    }

    #[test]
    fn status_is_stable_when_nothing_changes() {
        let t0: Timestamp = "2026-01-01T00:00:00Z".parse().unwrap();
        let t1: Timestamp = "2026-01-01T01:00:00Z".parse().unwrap();
        let mut kc = kvm_cluster(KVMClusterSpec::default());
        let first = status(&kc, &provisioned(), t0);
        assert_eq!(
            first.contract.initialization.as_ref().unwrap().provisioned,
            Some(true)
        );
        assert_eq!(first.contract.ready, Some(true));
        kc.status = Some(first.clone());
        // Same world an hour later: identical status, so the controller writes nothing.
        assert_eq!(status(&kc, &provisioned(), t1), first);
    }

    #[test]
    fn no_apiserver_answering_does_not_make_the_cluster_unready() {
        let t0: Timestamp = "2026-01-01T00:00:00Z".parse().unwrap();
        let kc = kvm_cluster(KVMClusterSpec::default());
        let s = status(&kc, &provisioned(), t0);
        let conds = s.contract.conditions.clone().unwrap();
        let endpoints = conditions::find(&conds, "ControlPlaneEndpointsReady").unwrap();
        assert_eq!(
            (endpoints.status.as_str(), endpoints.reason.as_str()),
            ("False", "WaitingForControlPlaneMachines")
        );
        // CAPI mirrors Ready to the Cluster, which must keep provisioning its first machine.
        assert_eq!(conditions::find(&conds, "Ready").unwrap().status, "True");
        assert_eq!(s.contract.ready, Some(true));
    }

    #[test]
    fn paused_keeps_everything_but_the_paused_condition() {
        let t0: Timestamp = "2026-01-01T00:00:00Z".parse().unwrap();
        let mut kc = kvm_cluster(KVMClusterSpec::default());
        kc.status = Some(status(&kc, &provisioned(), t0));
        let paused = status(&kc, &ClusterState::Paused, t0);
        let conds = paused.contract.conditions.clone().unwrap();
        assert_eq!(conditions::find(&conds, "Paused").unwrap().status, "True");
        assert_eq!(conditions::find(&conds, "Ready").unwrap().status, "True");
        assert_eq!(paused.contract.ready, Some(true));
    }
}
