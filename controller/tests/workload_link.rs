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

#[tokio::test]
async fn readiness_gate_and_provider_id_follow_the_workload_node() -> Result<()> {
    let ns = "workload-link";
    let mc = TestEnv::shared().client().await?;
    create_namespace(&mc, ns).await?;
    let _stop = start_controller(mc.clone(), ns);

    // The workload cluster: a second etcd + kube-apiserver, gone when this test binary exits.
    let dir = tempfile::Builder::new()
        .prefix("capk-workload-")
        .tempdir()?
        .keep();
    let wc_env = TestEnv::start(EnvOptions {
        dir,
        stop_with_current_process: true,
    })
    .await?;
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
    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": "demo-kubeconfig", "labels": {"cluster.x-k8s.io/cluster-name": "demo"}},
        "type": "cluster.x-k8s.io/secret",
        "stringData": {"value": std::fs::read_to_string(wc_env.kubeconfig())?},
    }))?;
    Api::<Secret>::namespaced(mc.clone(), ns)
        .create(&PostParams::default(), &secret)
        .await?;
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
