//! The workload-cluster link, with a second real kube-apiserver standing in as the workload
//! cluster: the machine Pod's readiness gate follows the Node's Ready condition and the Node gets
//! the machine's providerID.

mod support;

use anyhow::{Context, Result};
use capk_tests::env::{EnvOptions, TestEnv};
use k8s_openapi::api::core::v1::{Node, Pod, Secret};
use kube::{
    Api,
    api::{Patch, PatchParams, PostParams},
};
use serde_json::json;
use support::{control_plane_machine, create_namespace, eventually, start_controller};

const GATE: &str = "infrastructure.cluster.x-k8s.io/node-ready";

fn gate(pod: &Pod) -> Option<(String, String)> {
    pod.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == GATE)
        .map(|c| (c.status.clone(), c.reason.clone().unwrap_or_default()))
}

async fn set_node_ready(nodes: &Api<Node>, name: &str, ready: bool) -> Result<()> {
    let status = json!({"status": {"conditions": [{
        "type": "Ready",
        "status": if ready { "True" } else { "False" },
        "reason": if ready { "KubeletReady" } else { "KubeletNotReady" },
        "message": if ready { "kubelet is posting ready status" } else { "container runtime network not ready" },
        "lastHeartbeatTime": "2026-01-01T00:00:00Z",
        "lastTransitionTime": "2026-01-01T00:00:00Z",
    }]}});
    nodes
        .patch_status(name, &PatchParams::default(), &Patch::Strategic(&status))
        .await?;
    Ok(())
}

/// The workload cluster: a second etcd + kube-apiserver, gone when this test binary exits.
async fn workload_env() -> Result<TestEnv> {
    let dir = tempfile::Builder::new()
        .prefix("capk-workload-")
        .tempdir()?
        .keep();
    TestEnv::start(EnvOptions {
        dir,
        stop_with_current_process: true,
    })
    .await
}

/// The Secret `demo-kubeconfig` that Cluster API writes once the control plane is up, for the
/// workload cluster `wc_env`.
async fn write_workload_kubeconfig(mc: &kube::Client, ns: &str, wc_env: &TestEnv) -> Result<()> {
    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": "demo-kubeconfig", "labels": {"cluster.x-k8s.io/cluster-name": "demo"}},
        "type": "cluster.x-k8s.io/secret",
        "stringData": {"value": std::fs::read_to_string(wc_env.kubeconfig())?},
    }))?;
    Api::<Secret>::namespaced(mc.clone(), ns)
        .create(&PostParams::default(), &secret)
        .await?;
    Ok(())
}

#[tokio::test]
async fn readiness_gate_and_provider_id_follow_the_workload_node() -> Result<()> {
    let ns = "workload-link";
    let mc = TestEnv::shared().client().await?;
    create_namespace(&mc, ns).await?;
    let _stop = start_controller(mc.clone(), ns);

    let wc_env = workload_env().await?;
    let wc = wc_env.client().await?;
    let nodes: Api<Node> = Api::all(wc.clone());
    let node: Node = serde_json::from_value(json!({"metadata": {"name": "demo-cp-0"}}))?;
    nodes.create(&PostParams::default(), &node).await?;
    set_node_ready(&nodes, "demo-cp-0", true).await?;

    control_plane_machine(&mc, ns, "demo-cp-0", "#cloud-config\nruncmd:\n- echo ok\n").await?;
    let pods: Api<Pod> = Api::namespaced(mc.clone(), ns);

    // No kubeconfig Secret yet: the gate says so.
    eventually(30, "gate waiting for the kubeconfig", || async {
        let pod = pods.get("demo-cp-0").await?;
        Ok(
            (gate(&pod) == Some(("False".into(), "WaitingForWorkloadClusterKubeconfig".into())))
                .then_some(()),
        )
    })
    .await?;

    // Cluster API writes <cluster>-kubeconfig once the control plane is up.
    write_workload_kubeconfig(&mc, ns, &wc_env).await?;
    eventually(30, "gate True from the Ready node", || async {
        let pod = pods.get("demo-cp-0").await?;
        Ok((gate(&pod) == Some(("True".into(), "NodeReady".into()))).then_some(()))
    })
    .await?;
    let node = nodes.get("demo-cp-0").await?;
    assert_eq!(
        node.spec.and_then(|s| s.provider_id).as_deref(),
        Some("kvm://workload-link/demo-cp-0"),
        "the Node carries the machine's providerID"
    );

    // The node goes NotReady: the gate follows.
    set_node_ready(&nodes, "demo-cp-0", false).await?;
    let pod = eventually(90, "gate False from the NotReady node", || async {
        let pod = pods.get("demo-cp-0").await?;
        Ok((gate(&pod).map(|g| g.0) == Some("False".into())).then_some(pod))
    })
    .await?;
    assert_eq!(gate(&pod).context("gate")?.1, "NodeNotReady");
    Ok(())
}

/// The workload Node gets the zone and region of the management-cluster node its machine Pod
/// runs on (the failure domains are those zones), once: a zone the Node already has is kept.
#[tokio::test]
async fn the_workload_node_gets_the_zone_of_the_machine_pods_node() -> Result<()> {
    let ns = "workload-zone";
    let mc = TestEnv::shared().client().await?;
    create_namespace(&mc, ns).await?;
    let _stop = start_controller(mc.clone(), ns);
    let mc_node: Node = serde_json::from_value(json!({"metadata": {
        "name": "mc-node-zone-b",
        "labels": {"topology.kubernetes.io/zone": "zone-b",
                   "topology.kubernetes.io/region": "region-1",
                   "kubernetes.io/hostname": "mc-node-zone-b"}}}))?;
    Api::<Node>::all(mc.clone())
        .create(&PostParams::default(), &mc_node)
        .await?;

    let wc_env = workload_env().await?;
    let wc = wc_env.client().await?;
    let nodes: Api<Node> = Api::all(wc.clone());
    for (name, labels) in [
        ("demo-cp-0", json!({})),
        (
            "demo-cp-1",
            json!({"topology.kubernetes.io/zone": "chosen-by-the-user"}),
        ),
    ] {
        let node: Node =
            serde_json::from_value(json!({"metadata": {"name": name, "labels": labels}}))?;
        nodes.create(&PostParams::default(), &node).await?;
        set_node_ready(&nodes, name, true).await?;
    }
    let pods: Api<Pod> = Api::namespaced(mc.clone(), ns);
    for name in ["demo-cp-0", "demo-cp-1"] {
        control_plane_machine(&mc, ns, name, "#cloud-config\nruncmd:\n- echo ok\n").await?;
        eventually(30, "the machine Pod", || async {
            Ok(pods.get_opt(name).await?)
        })
        .await?;
        // What the scheduler writes.
        let binding = json!({"apiVersion": "v1", "kind": "Binding", "metadata": {"name": name},
            "target": {"apiVersion": "v1", "kind": "Node", "name": "mc-node-zone-b"}});
        pods.create_subresource::<serde_json::Value, serde_json::Value>(
            "binding",
            name,
            &PostParams::default(),
            &binding,
        )
        .await?;
    }
    write_workload_kubeconfig(&mc, ns, &wc_env).await?;

    let labels = eventually(30, "the zone on the workload Node", || async {
        let node = nodes.get("demo-cp-0").await?;
        let labels = node.metadata.labels.unwrap_or_default();
        Ok(labels
            .contains_key("topology.kubernetes.io/zone")
            .then_some(labels))
    })
    .await?;
    assert_eq!(labels["topology.kubernetes.io/zone"], "zone-b");
    assert_eq!(labels["topology.kubernetes.io/region"], "region-1");
    assert!(
        !labels.contains_key("kubernetes.io/hostname"),
        "only the topology labels are copied: {labels:?}"
    );
    // The other machine's Node had a zone: once its providerID is set it was seen, and kept.
    let other = eventually(30, "the other Node's providerID", || async {
        let node = nodes.get("demo-cp-1").await?;
        Ok(node
            .spec
            .as_ref()
            .and_then(|s| s.provider_id.clone())
            .map(|_| node))
    })
    .await?;
    let other_labels = other.metadata.labels.unwrap_or_default();
    assert_eq!(
        other_labels["topology.kubernetes.io/zone"],
        "chosen-by-the-user"
    );
    assert!(!other_labels.contains_key("topology.kubernetes.io/region"));
    Ok(())
}

/// A workload apiserver that accepts connections and never answers (a tenant's, say): its
/// machine's gate says the cluster is unreachable once the client's read timeout passes, and a
/// machine of another cluster gets its Pod within seconds meanwhile.
#[tokio::test]
async fn a_silent_workload_apiserver_is_reported_and_holds_up_no_other_cluster() -> Result<()> {
    let ns = "workload-silent";
    let mc = TestEnv::shared().client().await?;
    create_namespace(&mc, ns).await?;
    let _stop = start_controller(mc.clone(), ns);

    // The silent server: every connection is accepted and held, nothing is ever written.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let held = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((conn, _)) = listener.accept().await {
            open.push(conn);
        }
    });

    control_plane_machine(&mc, ns, "demo-cp-0", "#cloud-config\nruncmd:\n- echo ok\n").await?;
    // A real CA and credentials (the test apiserver's), so that only the silence fails.
    let mut kubeconfig = kube::config::Kubeconfig::read_from(TestEnv::shared().kubeconfig())?;
    for c in &mut kubeconfig.clusters {
        if let Some(cluster) = c.cluster.as_mut() {
            cluster.server = Some(format!("https://{addr}"));
        }
    }
    let kubeconfig = serde_yaml_ng::to_string(&kubeconfig)?;
    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": "demo-kubeconfig", "labels": {"cluster.x-k8s.io/cluster-name": "demo"}},
        "type": "cluster.x-k8s.io/secret",
        "stringData": {"value": kubeconfig},
    }))?;
    Api::<Secret>::namespaced(mc.clone(), ns)
        .create(&PostParams::default(), &secret)
        .await?;
    let linked = std::time::Instant::now();
    let pods: Api<Pod> = Api::namespaced(mc.clone(), ns);
    eventually(
        30,
        "the gate connecting to the silent workload cluster",
        || async {
            let pod = pods.get("demo-cp-0").await?;
            Ok((gate(&pod).map(|g| g.1) == Some("WaitingForWorkloadCluster".into())).then_some(()))
        },
    )
    .await?;

    // Another cluster's machine, meanwhile: its Pod within seconds.
    let started = std::time::Instant::now();
    support::bootstrap_secret(&mc, ns, "other-cp-0", "#cloud-config\n").await?;
    let spec = json!({"resources": {"cpu": 1, "memory": "1Gi", "disk": "20Gi"}});
    support::control_plane_machine_of(&mc, ns, "other", "other-cp-0", spec).await?;
    eventually(10, "the other cluster's machine Pod", || async {
        Ok(pods.get_opt("other-cp-0").await?)
    })
    .await?;
    let took = started.elapsed();

    // The silent cluster is reported, bounded by the client's timeouts.
    eventually(
        90,
        "the gate saying the workload cluster is unreachable",
        || async {
            let pod = pods.get("demo-cp-0").await?;
            Ok(
                (gate(&pod).map(|g| g.1) == Some("WorkloadClusterUnreachable".into()))
                    .then_some(()),
            )
        },
    )
    .await?;
    let reported = linked.elapsed();
    held.abort();
    assert!(took < std::time::Duration::from_secs(10), "{took:?}");
    // The client's connect timeout (5 s, the TLS handshake included) and one reconcile: well
    // under kube-rs's default of 30 s.
    assert!(
        reported < std::time::Duration::from_secs(20),
        "unreachable reported {reported:?} after the kubeconfig"
    );
    Ok(())
}

/// After `clusterctl move` (the source's Machine and KVMMachine deleted without their
/// finalizers, no reconcile following) the source controller stops watching the workload
/// cluster's Nodes: no connection with the moved credential is left.
#[tokio::test]
async fn a_machine_moved_away_leaves_no_connection_to_its_workload_cluster() -> Result<()> {
    use capk_api::{capi::Machine, v1alpha1::KVMMachine};
    let ns = "workload-moved";
    let mc = TestEnv::shared().client().await?;
    create_namespace(&mc, ns).await?;
    let _stop = start_controller(mc.clone(), ns);
    let wc_env = workload_env().await?;
    // The workload apiserver behind a relay that counts the controller's connections.
    let mut kubeconfig = kube::config::Kubeconfig::read_from(wc_env.kubeconfig())?;
    let server = kubeconfig.clusters[0]
        .cluster
        .as_ref()
        .and_then(|c| c.server.clone())
        .context("server")?;
    let to: std::net::SocketAddr = server
        .trim_start_matches("https://")
        .parse()
        .context("server address")?;
    let relay = support::Relay::start(to).await?;
    for c in &mut kubeconfig.clusters {
        if let Some(cluster) = c.cluster.as_mut() {
            cluster.server = Some(format!("https://{}", relay.addr));
        }
    }
    control_plane_machine(&mc, ns, "demo-cp-0", "#cloud-config\nruncmd:\n- echo ok\n").await?;
    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": "demo-kubeconfig", "labels": {"cluster.x-k8s.io/cluster-name": "demo"}},
        "type": "cluster.x-k8s.io/secret",
        "stringData": {"value": serde_yaml_ng::to_string(&kubeconfig)?},
    }))?;
    Api::<Secret>::namespaced(mc.clone(), ns)
        .create(&PostParams::default(), &secret)
        .await?;
    let pods: Api<Pod> = Api::namespaced(mc.clone(), ns);
    eventually(30, "the gate waiting for the Node", || async {
        let pod = pods.get("demo-cp-0").await?;
        Ok((gate(&pod).map(|g| g.1) == Some("WaitingForNode".into())).then_some(()))
    })
    .await?;
    assert!(
        relay.connections() > 0,
        "the Node watch goes through the relay"
    );

    // What clusterctl move does to the source's objects.
    let strip = json!({"metadata": {"finalizers": null}});
    let kms: Api<KVMMachine> = Api::namespaced(mc.clone(), ns);
    let machines: Api<Machine> = Api::namespaced(mc.clone(), ns);
    kms.patch("demo-cp-0", &PatchParams::default(), &Patch::Merge(&strip))
        .await?;
    machines
        .patch("demo-cp-0", &PatchParams::default(), &Patch::Merge(&strip))
        .await?;
    kms.delete("demo-cp-0", &Default::default()).await?;
    machines.delete("demo-cp-0", &Default::default()).await?;
    Api::<Secret>::namespaced(mc.clone(), ns)
        .delete("demo-kubeconfig", &Default::default())
        .await?;
    eventually(60, "no connection left to the workload cluster", || async {
        Ok((relay.connections() == 0).then_some(()))
    })
    .await?;
    Ok(())
}
