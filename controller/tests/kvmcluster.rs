//! The KVMCluster reconciler against a real kube-apiserver (Cluster API objects created by the
//! test, as the CAPI controllers would).

mod support;

use std::{collections::BTreeMap, time::Duration};

use anyhow::{Context, Result};
use capk_api::{capi::Cluster, v1alpha1::KVMCluster};
use capk_tests::env::TestEnv;
use k8s_openapi::api::{
    core::v1::{Pod, Service},
    discovery::v1::EndpointSlice,
};
use kube::{
    Api, Client, ResourceExt,
    api::{DeleteParams, ListParams, Patch, PatchParams, PostParams},
};
use serde_json::json;
use support::{
    HUNG, NOT_READY, POD_NET, READY, StandInApiServer, create_namespace, eventually, in_own_netns,
    start_controller, start_controller_with,
};

async fn setup(ns: &str) -> Result<(Client, tokio::sync::oneshot::Sender<()>)> {
    let client = TestEnv::shared().client().await?;
    create_namespace(&client, ns).await?;
    let stop = start_controller(client.clone(), ns);
    Ok((client, stop))
}

fn condition(kc: &KVMCluster, type_: &str) -> Option<(String, String)> {
    kc.status
        .as_ref()?
        .contract
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| (c.status.clone(), c.reason.clone()))
}

#[tokio::test]
async fn kvmcluster_gets_a_service_an_endpoint_and_a_provisioned_status() -> Result<()> {
    let ns = "kvmcluster-lifecycle";
    let client = TestEnv::shared().client().await?;
    create_namespace(&client, ns).await?;
    // An operator who lets control-plane Services carry a load balancer's annotations
    // (`--allowed-control-plane-service-annotations=lb.example/*`).
    let mut settings = capk_controller::Settings {
        namespace: Some(ns.to_owned()),
        ..Default::default()
    };
    settings.tenant_policy.service_annotation_keys = vec!["lb.example/*".into()];
    let _stop = start_controller_with(client.clone(), settings);
    let clusters: Api<Cluster> = Api::namespaced(client.clone(), ns);
    let kvmclusters: Api<KVMCluster> = Api::namespaced(client.clone(), ns);
    let services: Api<Service> = Api::namespaced(client.clone(), ns);

    let kc: KVMCluster = serde_json::from_value(json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1",
        "kind": "KVMCluster",
        "metadata": {"name": "demo"},
        "spec": {},
    }))?;
    kvmclusters.create(&PostParams::default(), &kc).await?;

    // No owner yet: the condition says what it waits for, nothing is created.
    eventually(30, "Ready=False WaitingForClusterOwner", || async {
        let kc = kvmclusters.get("demo").await?;
        Ok(
            (condition(&kc, "Ready") == Some(("False".into(), "WaitingForClusterOwner".into())))
                .then_some(()),
        )
    })
    .await?;
    assert!(services.get_opt("demo-apiserver").await?.is_none());

    // Cluster API creates the Cluster and sets itself as owner.
    let cluster: Cluster = serde_json::from_value(json!({
        "apiVersion": "cluster.x-k8s.io/v1beta2",
        "kind": "Cluster",
        "metadata": {"name": "demo"},
        "spec": {"infrastructureRef": {
            "apiGroup": "infrastructure.cluster.x-k8s.io", "kind": "KVMCluster", "name": "demo"}},
    }))?;
    let cluster = clusters.create(&PostParams::default(), &cluster).await?;
    let owner = json!({"metadata": {"ownerReferences": [{
        "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Cluster",
        "name": "demo", "uid": cluster.uid().context("uid")?,
    }]}});
    kvmclusters
        .patch("demo", &PatchParams::default(), &Patch::Merge(&owner))
        .await?;

    let kc = eventually(30, "KVMCluster provisioned", || async {
        let kc = kvmclusters.get("demo").await?;
        let provisioned = kc
            .status
            .as_ref()
            .and_then(|s| s.contract.initialization.as_ref())
            .and_then(|i| i.provisioned)
            == Some(true);
        Ok(provisioned.then_some(kc))
    })
    .await?;
    let status = kc.status.as_ref().unwrap();
    assert_eq!(
        status.contract.ready,
        Some(true),
        "v1beta1 readers see ready"
    );
    assert_eq!(
        condition(&kc, "Ready"),
        Some(("True".into(), "Provisioned".into()))
    );
    assert_eq!(condition(&kc, "Paused").map(|c| c.0), Some("False".into()));
    let endpoint = kc
        .spec
        .control_plane_endpoint
        .clone()
        .context("endpoint set")?;
    assert_eq!(
        endpoint.host.as_deref(),
        Some("demo-apiserver.kvmcluster-lifecycle.svc.cluster.local")
    );
    assert_eq!(endpoint.port, Some(6443));
    assert!(kc.finalizers().iter().any(|f| f.starts_with("kvmcluster.")));

    let svc = services.get("demo-apiserver").await?;
    let spec = svc.spec.as_ref().unwrap();
    assert_eq!(spec.type_.as_deref(), Some("ClusterIP"));
    assert_eq!(spec.ports.as_ref().unwrap()[0].port, 6443);
    // Its endpoints are the controller's EndpointSlice (see the tests below), not a selector's.
    assert_eq!(spec.selector, None);
    assert_eq!(spec.publish_not_ready_addresses, None);
    assert_eq!(svc.owner_references()[0].kind, "KVMCluster");
    assert_eq!(svc.labels()["cluster.x-k8s.io/cluster-name"], "demo");

    // Steady state: no further writes.
    let rv = kvmclusters.get("demo").await?.resource_version();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(kvmclusters.get("demo").await?.resource_version(), rv);

    // Paused: the Paused condition is set and spec changes are not acted on.
    clusters
        .patch(
            "demo",
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"paused": true}})),
        )
        .await?;
    eventually(30, "Paused=True", || async {
        let kc = kvmclusters.get("demo").await?;
        Ok((condition(&kc, "Paused").map(|c| c.0) == Some("True".into())).then_some(()))
    })
    .await?;
    let annotated = json!({"spec": {"controlPlaneService": {
        "annotations": {"lb.example/pool": "b"}}}});
    kvmclusters
        .patch("demo", &PatchParams::default(), &Patch::Merge(&annotated))
        .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let svc = services.get("demo-apiserver").await?;
    assert!(
        !svc.annotations().contains_key("lb.example/pool"),
        "paused cluster changed"
    );

    // Unpaused: the change lands.
    clusters
        .patch(
            "demo",
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"paused": false}})),
        )
        .await?;
    eventually(30, "Service gets the annotation", || async {
        let svc = services.get("demo-apiserver").await?;
        Ok(svc
            .annotations()
            .contains_key("lb.example/pool")
            .then_some(()))
    })
    .await?;

    // Deletion removes the Service, then the finalizer.
    kvmclusters.delete("demo", &DeleteParams::default()).await?;
    eventually(30, "KVMCluster and Service gone", || async {
        let gone = kvmclusters.get_opt("demo").await?.is_none()
            && services.get_opt("demo-apiserver").await?.is_none();
        Ok(gone.then_some(()))
    })
    .await?;
    Ok(())
}

#[tokio::test]
async fn a_user_set_endpoint_is_kept() -> Result<()> {
    let ns = "kvmcluster-user-endpoint";
    let (client, _stop) = setup(ns).await?;
    let kvmclusters: Api<KVMCluster> = Api::namespaced(client.clone(), ns);
    owned_kvmcluster_with(
        &client,
        ns,
        "mine",
        json!({"controlPlaneEndpoint": {"host": "mine.k8s.example.com", "port": 443}}),
    )
    .await?;
    let kc = eventually(30, "provisioned", || async {
        let kc = kvmclusters.get("mine").await?;
        Ok((kc.status.as_ref().and_then(|s| s.contract.ready) == Some(true)).then_some(kc))
    })
    .await?;
    let ep = kc.spec.control_plane_endpoint.unwrap();
    assert_eq!(ep.host.as_deref(), Some("mine.k8s.example.com"));
    assert_eq!(ep.port, Some(443));
    Ok(())
}

/// A cluster whose machines live in the management cluster blocks `clusterctl move` (which
/// would delete their Pods with the KVMMachines): the block-move annotation, the reason in
/// `HostingClusterAvailable`, and when the Cluster is paused, as a move pauses it first, a
/// Warning Event that says how to pivot and how to resume the Cluster.
#[tokio::test]
async fn a_cluster_whose_vms_run_in_the_management_cluster_blocks_clusterctl_move() -> Result<()> {
    const BLOCK_MOVE: &str = "clusterctl.cluster.x-k8s.io/block-move";
    let ns = "kvmcluster-move-blocked";
    let (client, _stop) = setup(ns).await?;
    let kvmclusters: Api<KVMCluster> = Api::namespaced(client.clone(), ns);
    owned_kvmcluster(&client, ns, "stay").await?;
    let kc = eventually(30, "provisioned and blocked", || async {
        let kc = kvmclusters.get("stay").await?;
        let ready = kc.status.as_ref().and_then(|s| s.contract.ready) == Some(true);
        Ok((ready && kc.annotations().contains_key(BLOCK_MOVE)).then_some(kc))
    })
    .await?;
    let hosting = kc
        .status
        .as_ref()
        .and_then(|s| s.contract.conditions.as_ref());
    let hosting = hosting
        .and_then(|cs| cs.iter().find(|c| c.type_ == "HostingClusterAvailable"))
        .context("HostingClusterAvailable")?;
    assert!(
        hosting
            .message
            .contains("clusterctl move is blocked until spec.hostingCluster"),
        "{}",
        hosting.message
    );

    // What clusterctl move does first: pause the Cluster.
    Api::<Cluster>::namespaced(client.clone(), ns)
        .patch(
            "stay",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"paused": true}})),
        )
        .await?;
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client.clone(), ns);
    let note = eventually(30, "a MoveBlocked Event", || async {
        let list = events.list(&ListParams::default()).await?;
        Ok(list
            .items
            .into_iter()
            .find(|e| {
                e.reason.as_deref() == Some("MoveBlocked")
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("stay")
            })
            .and_then(|e| e.note))
    })
    .await?;
    assert!(note.contains("spec.hostingCluster"), "{note}");
    assert!(
        note.contains(&format!("kubectl -n {ns} patch cluster stay")),
        "{note}"
    );
    // Paused, it changes nothing: the block stays for the move to meet.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        kvmclusters
            .get("stay")
            .await?
            .annotations()
            .contains_key(BLOCK_MOVE)
    );
    Ok(())
}

/// A cluster reachable from outside the management cluster through a node port: its Service is
/// a NodePort Service with the requested node port (or one the apiserver allocated), and its
/// control-plane endpoint, from which Cluster API writes the workload kubeconfig's server and
/// kubeadm the apiserver certificate's SANs, is the external host at that node port. What makes
/// the endpoint is fixed once the cluster exists.
#[tokio::test]
async fn a_node_port_cluster_is_reached_at_its_external_host_and_node_port() -> Result<()> {
    let ns = "kvmcluster-node-port";
    let client = TestEnv::shared().client().await?;
    create_namespace(&client, ns).await?;
    // An operator who allows NodePort (`--allowed-control-plane-service-types=NodePort`).
    let mut settings = capk_controller::Settings {
        namespace: Some(ns.to_owned()),
        ..Default::default()
    };
    settings.tenant_policy.control_plane_service_types =
        vec![capk_api::v1alpha1::ServiceType::NodePort];
    settings.tenant_policy.service_annotation_keys = vec!["lb.example/pool".into()];
    let _stop = start_controller_with(client.clone(), settings);
    let kvmclusters: Api<KVMCluster> = Api::namespaced(client.clone(), ns);
    let services: Api<Service> = Api::namespaced(client.clone(), ns);
    for (name, node_port) in [("fixed", 31443), ("allocated", 0)] {
        let spec = json!({"controlPlaneService": {
            "type": "NodePort", "nodePort": node_port, "externalHost": "nodes.example.com"}});
        owned_kvmcluster_with(&client, ns, name, spec).await?;
    }
    for name in ["fixed", "allocated"] {
        let kc = eventually(30, "provisioned", || async {
            let kc = kvmclusters.get(name).await?;
            Ok((kc.status.as_ref().and_then(|s| s.contract.ready) == Some(true)).then_some(kc))
        })
        .await?;
        let svc = services.get(&format!("{name}-apiserver")).await?;
        let spec = svc.spec.context("Service spec")?;
        assert_eq!(spec.type_.as_deref(), Some("NodePort"), "{name}");
        let port = &spec.ports.context("ports")?[0];
        assert_eq!(port.port, 6443, "{name}");
        let node_port = port.node_port.context("node port")?;
        if name == "fixed" {
            assert_eq!(node_port, 31443);
        }
        let ep = kc.spec.control_plane_endpoint.context("endpoint")?;
        assert_eq!(
            (ep.host.as_deref(), ep.port),
            (Some("nodes.example.com"), Some(node_port)),
            "{name}: the endpoint is the external host at the node port"
        );
    }

    // The endpoint is fixed, and so is what made it: refused with a message that says why.
    for (patch, wanted) in [
        (
            json!({"spec": {"controlPlaneService": {"type": "ClusterIP", "nodePort": null}}}),
            "spec.controlPlaneService.type cannot change to or from NodePort",
        ),
        (
            json!({"spec": {"controlPlaneService": {"type": "LoadBalancer", "nodePort": null}}}),
            "spec.controlPlaneService.type cannot change to or from NodePort",
        ),
        (
            json!({"spec": {"controlPlaneService": {"externalHost": "other.example.com"}}}),
            "spec.controlPlaneService.externalHost cannot be changed",
        ),
        (
            json!({"spec": {"controlPlaneService": {"nodePort": 31444}}}),
            "spec.controlPlaneService.nodePort cannot be changed",
        ),
    ] {
        let refused = kvmclusters
            .patch("fixed", &PatchParams::default(), &Patch::Merge(&patch))
            .await;
        match refused {
            Err(kube::Error::Api(s)) => assert!(s.message.contains(wanted), "{}", s.message),
            other => panic!("{patch} was not refused: {other:?}"),
        }
    }
    // Annotations may change (a load balancer's settings).
    kvmclusters
        .patch(
            "fixed",
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"controlPlaneService": {
                "annotations": {"lb.example/pool": "a"}}}})),
        )
        .await?;
    Ok(())
}

/// As shipped, the operator allows ClusterIP only: a NodePort KVMCluster gets no Service and no
/// endpoint, and its `Ready` condition and a Warning Event say what is allowed and which flag
/// allows more.
#[tokio::test]
async fn a_service_type_the_operator_does_not_allow_is_refused() -> Result<()> {
    let ns = "kvmcluster-refused-type";
    let (client, _stop) = setup(ns).await?;
    let kvmclusters: Api<KVMCluster> = Api::namespaced(client.clone(), ns);
    let services: Api<Service> = Api::namespaced(client.clone(), ns);
    let spec = json!({"controlPlaneService": {
        "type": "NodePort", "externalHost": "nodes.example.com"}});
    owned_kvmcluster_with(&client, ns, "open", spec).await?;
    let message = spec_invalid_message(&kvmclusters, "open").await?;
    assert!(
        message.contains("NodePort is not allowed")
            && message.contains("--allowed-control-plane-service-types"),
        "{message}"
    );
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client.clone(), ns);
    eventually(30, "Warning Event SpecInvalid", || async {
        let found = events
            .list(&ListParams::default())
            .await?
            .items
            .into_iter()
            .any(|e| {
                e.reason.as_deref() == Some("SpecInvalid")
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("open")
            });
        Ok(found.then_some(()))
    })
    .await?;
    assert!(services.get_opt("open-apiserver").await?.is_none());
    let kc = kvmclusters.get("open").await?;
    assert_eq!(kc.spec.control_plane_endpoint, None);
    Ok(())
}

/// A tenant's control-plane Service annotations (external DNS, a tailnet) would make add-ons of
/// the management cluster act for the tenant: refused with the shipped settings, naming each key
/// and the provider variable, and no Service is made.
#[tokio::test]
async fn service_annotations_the_operator_does_not_allow_are_refused() -> Result<()> {
    let ns = "kvmcluster-refused-annotations";
    let (client, _stop) = setup(ns).await?;
    let kvmclusters: Api<KVMCluster> = Api::namespaced(client.clone(), ns);
    let services: Api<Service> = Api::namespaced(client.clone(), ns);
    let spec = json!({"controlPlaneService": {"annotations": {
        "external-dns.alpha.kubernetes.io/hostname": "api.victim.example.com",
        "tailscale.com/expose": "true"}}});
    owned_kvmcluster_with(&client, ns, "announced", spec).await?;
    let message = spec_invalid_message(&kvmclusters, "announced").await?;
    for expected in [
        "spec.controlPlaneService.annotations[\"external-dns.alpha.kubernetes.io/hostname\"]",
        "spec.controlPlaneService.annotations[\"tailscale.com/expose\"]",
        "CAPK_ALLOWED_CONTROL_PLANE_SERVICE_ANNOTATIONS",
    ] {
        assert!(message.contains(expected), "{expected} not in {message}");
    }
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    assert!(services.get_opt("announced-apiserver").await?.is_none());
    Ok(())
}

/// The message of KVMCluster `name`'s `Ready` condition once it is False with reason
/// `SpecInvalid`.
async fn spec_invalid_message(kvmclusters: &Api<KVMCluster>, name: &str) -> Result<String> {
    eventually(30, "Ready=False SpecInvalid", || async {
        let kc = kvmclusters.get(name).await?;
        let ready = kc
            .status
            .and_then(|s| s.contract.conditions)
            .and_then(|cs| cs.into_iter().find(|c| c.type_ == "Ready"));
        Ok(ready
            .filter(|c| c.status == "False" && c.reason == "SpecInvalid")
            .map(|c| c.message))
    })
    .await
}

// ---------------------------------------------------------------------------------------------
// The control-plane Service's endpoints: the controller probes each control-plane machine's
// apiserver at `https://<Pod IP>:6443/readyz` and writes the Service's EndpointSlice from what
// answers. The machine Pods here are made by the test (no kubelet runs): their status says
// Running with an address, and the "VM" at that address is a TLS server the test runs.
// EndpointSlices refuse loopback addresses, so these tests run again in a network namespace of
// their own, where the Pod addresses live on its `lo` and nothing routes anywhere else.
// The harness (a network namespace of its own, stand-in apiservers) is in `support`.

/// A Cluster `name` and its KVMCluster, owned as Cluster API sets it.
async fn owned_kvmcluster(client: &Client, ns: &str, name: &str) -> Result<KVMCluster> {
    owned_kvmcluster_with(client, ns, name, json!({})).await
}

/// [`owned_kvmcluster`] with the KVMCluster's `spec`.
async fn owned_kvmcluster_with(
    client: &Client,
    ns: &str,
    name: &str,
    spec: serde_json::Value,
) -> Result<KVMCluster> {
    let cluster: Cluster = serde_json::from_value(json!({
        "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Cluster",
        "metadata": {"name": name},
        "spec": {"infrastructureRef": {
            "apiGroup": "infrastructure.cluster.x-k8s.io", "kind": "KVMCluster", "name": name}},
    }))?;
    let cluster = Api::<Cluster>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &cluster)
        .await?;
    let kc: KVMCluster = serde_json::from_value(json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1", "kind": "KVMCluster",
        "metadata": {"name": name, "ownerReferences": [{
            "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Cluster",
            "name": name, "uid": cluster.uid().context("uid")?}]},
        "spec": spec,
    }))?;
    Ok(Api::<KVMCluster>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &kc)
        .await?)
}

/// A machine Pod of cluster `demo` as the KVMMachine controller labels it, Running at `ip` but
/// not Ready (as a control plane is during `kubeadm init`: its readiness gate waits for a Node).
async fn machine_pod(client: &Client, ns: &str, name: &str, role: &str, ip: &str) -> Result<Pod> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {
            "cluster.x-k8s.io/cluster-name": "demo",
            "infrastructure.cluster.x-k8s.io/machine-role": role,
            "infrastructure.cluster.x-k8s.io/owner-namespace": ns,
            "app.kubernetes.io/managed-by": "capk-controller"}},
        "spec": {"nodeName": "mc-node-1",
                 "containers": [{"name": "launcher", "image": "capk-launcher:test"}]},
    }))?;
    pods.create(&PostParams::default(), &pod).await?;
    let status = json!({"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
        "conditions": [{"type": "Ready", "status": "False", "reason": "ReadinessGatesNotReady"}]}});
    Ok(pods
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await?)
}

/// Each address of the slice and its (ready, serving, terminating) conditions.
fn endpoint_states(slice: &EndpointSlice) -> BTreeMap<String, (bool, bool, bool)> {
    slice
        .endpoints
        .iter()
        .flat_map(|e| {
            let c = e.conditions.clone().unwrap_or_default();
            let state = (
                c.ready == Some(true),
                c.serving == Some(true),
                c.terminating == Some(true),
            );
            e.addresses.iter().map(move |a| (a.clone(), state))
        })
        .collect()
}

fn ready_addresses(slice: &EndpointSlice) -> Vec<String> {
    endpoint_states(slice)
        .into_iter()
        .filter(|(_, (ready, _, _))| *ready)
        .map(|(a, _)| a)
        .collect()
}

/// The EndpointSlices of Service `svc`.
async fn slices_of(client: &Client, ns: &str, svc: &str) -> Result<Vec<EndpointSlice>> {
    Ok(Api::<EndpointSlice>::namespaced(client.clone(), ns)
        .list(&ListParams::default().labels(&format!("kubernetes.io/service-name={svc}")))
        .await?
        .items)
}

/// Waits until `f` holds of the controller's slice of `demo-apiserver`; returns how long it took.
async fn slice_until(
    client: &Client,
    ns: &str,
    secs: u64,
    what: &str,
    f: impl Fn(&EndpointSlice) -> bool,
) -> Result<Duration> {
    let start = std::time::Instant::now();
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), ns);
    let f = &f;
    let slices = &slices;
    eventually(secs, what, || async move {
        Ok(slices
            .get_opt("demo-apiserver")
            .await?
            .filter(|s| f(s))
            .map(|_| ()))
    })
    .await?;
    Ok(start.elapsed())
}

#[tokio::test]
async fn control_plane_endpoints_follow_the_apiservers_that_answer() -> Result<()> {
    if !in_own_netns("control_plane_endpoints_follow_the_apiservers_that_answer")? {
        return Ok(());
    }
    let ns = "kvmcluster-endpoints";
    let (client, _stop) = setup(ns).await?;
    let kvmclusters: Api<KVMCluster> = Api::namespaced(client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let kc = owned_kvmcluster(&client, ns, "demo").await?;
    let (a, b, c, w) = (
        format!("{POD_NET}.2"),
        format!("{POD_NET}.3"),
        format!("{POD_NET}.4"),
        format!("{POD_NET}.5"),
    );
    // Two control planes whose apiservers answer, a third whose VM is still booting (nothing
    // listens yet), and a worker whose address answers too but is no control plane.
    let a_server = StandInApiServer::start(&a).await?;
    let b_server = StandInApiServer::start(&b).await?;
    let _w = StandInApiServer::start(&w).await?;
    machine_pod(&client, ns, "demo-cp-a", "control-plane", &a).await?;
    machine_pod(&client, ns, "demo-cp-b", "control-plane", &b).await?;
    let cp_c = machine_pod(&client, ns, "demo-cp-c", "control-plane", &c).await?;
    machine_pod(&client, ns, "demo-md-0", "worker", &w).await?;

    slice_until(&client, ns, 30, "a and b ready, c not", |s| {
        endpoint_states(s)
            == BTreeMap::from([
                (a.clone(), (true, true, false)),
                (b.clone(), (true, true, false)),
                (c.clone(), (false, false, false)),
            ])
    })
    .await?;
    let svc = Api::<Service>::namespaced(client.clone(), ns)
        .get("demo-apiserver")
        .await?;
    let spec = svc.spec.context("spec")?;
    assert_eq!(spec.selector, None, "no selector: the controller's slice");
    assert_eq!(spec.publish_not_ready_addresses, None);
    let slice = Api::<EndpointSlice>::namespaced(client.clone(), ns)
        .get("demo-apiserver")
        .await?;
    assert_eq!(slice.address_type, "IPv4");
    assert_eq!(
        slice.labels()["endpointslice.kubernetes.io/managed-by"],
        "capk-controller.infrastructure.cluster.x-k8s.io"
    );
    assert_eq!(slice.labels()["cluster.x-k8s.io/cluster-name"], "demo");
    assert_eq!(slice.owner_references()[0].uid, kc.uid().context("uid")?);
    let port = &slice.ports.clone().context("ports")?[0];
    assert_eq!(
        (port.name.as_deref(), port.port, port.protocol.as_deref()),
        (Some("apiserver"), Some(6443), Some("TCP"))
    );
    let ep_c = slice
        .endpoints
        .iter()
        .find(|e| e.addresses == [c.clone()])
        .context("c's endpoint")?;
    let target = ep_c.target_ref.clone().context("targetRef")?;
    assert_eq!(
        (target.kind.as_deref(), target.name.as_deref(), target.uid),
        (Some("Pod"), Some("demo-cp-c"), cp_c.uid())
    );
    assert_eq!(ep_c.node_name.as_deref(), Some("mc-node-1"));
    // The KVMCluster's status is written after its EndpointSlice.
    let kc_now = eventually(
        30,
        "ControlPlaneEndpointsReady=True SomeAPIServersNotAnswering",
        || async {
            let kc = kvmclusters.get("demo").await?;
            Ok((condition(&kc, "ControlPlaneEndpointsReady")
                == Some(("True".into(), "SomeAPIServersNotAnswering".into())))
            .then_some(kc))
        },
    )
    .await?;
    assert_eq!(
        condition(&kc_now, "Ready"),
        Some(("True".into(), "Provisioned".into()))
    );

    // c's apiserver comes up (the first `kubeadm init` of a cluster is this moment): its
    // address is ready within a probe period.
    let c_server = StandInApiServer::start(&c).await?;
    let joined = slice_until(&client, ns, 30, "c ready once it answers", |s| {
        ready_addresses(s) == [a.clone(), b.clone(), c.clone()]
    })
    .await?;
    println!("control-plane endpoints: a new apiserver answering -> ready in {joined:?}");
    assert!(joined < Duration::from_secs(8), "{joined:?}");
    let kc_now = eventually(30, "3 of 3 answer", || async {
        let kc = kvmclusters.get("demo").await?;
        Ok((condition(&kc, "ControlPlaneEndpointsReady")
            == Some(("True".into(), "APIServersAnswering".into())))
        .then_some(kc))
    })
    .await?;
    assert_eq!(
        kc_now
            .status
            .as_ref()
            .and_then(|s| s.contract.conditions.as_ref())
            .and_then(|cs| cs.iter().find(|c| c.type_ == "ControlPlaneEndpointsReady"))
            .map(|c| c.message.as_str()),
        Some("3 of 3 control-plane apiservers answer /readyz")
    );

    // Steady state: probing every 10 s writes nothing.
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), ns);
    let slice_rv = slices.get("demo-apiserver").await?.resource_version();
    let kc_rv = kvmclusters.get("demo").await?.resource_version();
    tokio::time::sleep(Duration::from_secs(12)).await;
    assert_eq!(
        slices.get("demo-apiserver").await?.resource_version(),
        slice_rv
    );
    assert_eq!(kvmclusters.get("demo").await?.resource_version(), kc_rv);

    // c's apiserver hangs: its endpoint leaves, the others stay.
    c_server.set(HUNG);
    let left = slice_until(&client, ns, 40, "c not ready while it hangs", |s| {
        endpoint_states(s).get(&c) == Some(&(false, false, false))
    })
    .await?;
    println!("control-plane endpoints: a hung apiserver -> not ready in {left:?}");
    assert!(left < Duration::from_secs(25), "{left:?}");
    assert_eq!(
        ready_addresses(&slices.get("demo-apiserver").await?),
        [a.clone(), b.clone()]
    );
    eventually(30, "the condition names c", || async {
        let cond = endpoints_ready_condition(&kvmclusters).await?;
        Ok(cond
            .filter(|c| {
                c.reason == "SomeAPIServersNotAnswering"
                    && c.message
                        == "2 of 3 control-plane apiservers answer /readyz; taking no traffic: \
                            demo-cp-c (connected, no answer within 2s)"
            })
            .map(|_| ()))
    })
    .await?;

    // It answers again: back in.
    c_server.set(READY);
    let back = slice_until(&client, ns, 30, "c ready again", |s| {
        endpoint_states(s).get(&c) == Some(&(true, true, false))
    })
    .await?;
    println!("control-plane endpoints: the apiserver answering again -> ready in {back:?}");

    // Every apiserver alive but not ready (/readyz 500: etcd slow everywhere, as in an emulated
    // single control plane under load): rather than refuse every connection, the Service keeps
    // sending traffic to them, and the condition says so. Ready again: as before.
    for server in [&a_server, &b_server, &c_server] {
        server.set(NOT_READY);
    }
    eventually(40, "none ready: the Service fails open", || async {
        let cond = endpoints_ready_condition(&kvmclusters).await?;
        let all_ready = ready_addresses(&slices.get("demo-apiserver").await?)
            == [a.clone(), b.clone(), c.clone()];
        Ok(cond
            .filter(|c| c.status == "False" && c.reason == "APIServersNotReady" && all_ready)
            .map(|_| ()))
    })
    .await?;
    for server in [&a_server, &b_server, &c_server] {
        server.set(READY);
    }
    eventually(40, "all answer again", || async {
        let cond = endpoints_ready_condition(&kvmclusters).await?;
        Ok(cond
            .filter(|c| c.reason == "APIServersAnswering")
            .map(|_| ()))
    })
    .await?;

    // c's Pod is being deleted (its node's kubelet stops the VM within the grace period): still
    // serving, no longer ready; gone with the Pod.
    pods.delete("demo-cp-c", &DeleteParams::default()).await?;
    slice_until(&client, ns, 30, "c terminating", |s| {
        endpoint_states(s).get(&c) == Some(&(false, true, true))
    })
    .await?;
    // The kubelet confirms the deletion.
    pods.delete("demo-cp-c", &DeleteParams::default().grace_period(0))
        .await?;
    slice_until(&client, ns, 30, "c's endpoint gone with its Pod", |s| {
        endpoint_states(s).keys().cloned().collect::<Vec<_>>() == [a.clone(), b.clone()]
    })
    .await?;

    // Deleting the cluster takes the slice with the Service.
    kvmclusters.delete("demo", &DeleteParams::default()).await?;
    eventually(30, "Service and EndpointSlice gone", || async {
        let gone = Api::<Service>::namespaced(client.clone(), ns)
            .get_opt("demo-apiserver")
            .await?
            .is_none()
            && slices_of(&client, ns, "demo-apiserver").await?.is_empty();
        Ok(gone.then_some(()))
    })
    .await?;
    Ok(())
}

/// The `ControlPlaneEndpointsReady` condition of KVMCluster `demo`, if set.
async fn endpoints_ready_condition(
    kvmclusters: &Api<KVMCluster>,
) -> Result<Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition>> {
    let kc = kvmclusters.get("demo").await?;
    Ok(kc
        .status
        .and_then(|s| s.contract.conditions)
        .and_then(|cs| {
            cs.into_iter()
                .find(|c| c.type_ == "ControlPlaneEndpointsReady")
        }))
}
