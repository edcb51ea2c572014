//! The link to a workload cluster: its API through the `<cluster>-kubeconfig` Secret that Cluster
//! API writes. The machine Pod's readiness gate follows the Node's `Ready` condition, and the
//! Node gets our providerID when it has none. An unreachable workload cluster is a reason on the
//! gate, never a crash.

use capk_api::constants::NODE_READY_GATE;
use k8s_openapi::{
    api::core::v1::{Node, Pod, Secret},
    jiff::Timestamp,
};
use kube::{
    Api, Client, Config, ResourceExt,
    api::{Patch, PatchParams},
    config::{KubeConfigOptions, Kubeconfig},
};
use serde_json::json;

use crate::context::FIELD_MANAGER;

/// What the readiness gate should say.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gate {
    /// Node is Ready.
    pub ready: bool,
    /// CamelCase reason.
    pub reason: &'static str,
    /// Human-readable message.
    pub message: String,
}

impl Gate {
    fn not_ready(reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            ready: false,
            reason,
            message: message.into(),
        }
    }
}

/// A client for the workload cluster of `cluster`, or why there is none.
pub async fn client(mc: &Client, ns: &str, cluster: &str) -> Result<Client, Gate> {
    let name = format!("{cluster}-kubeconfig");
    let secret = Api::<Secret>::namespaced(mc.clone(), ns)
        .get_opt(&name)
        .await
        .map_err(|e| Gate::not_ready("WorkloadClusterUnavailable", format!("read Secret {name}: {e}")))?
        .ok_or_else(|| {
            Gate::not_ready(
                "WaitingForWorkloadClusterKubeconfig",
                format!("Secret {name} does not exist yet (Cluster API writes it once the control plane is initialized)"),
            )
        })?;
    let value = secret
        .data
        .as_ref()
        .and_then(|d| d.get("value"))
        .map(|v| v.0.clone())
        .unwrap_or_default();
    let text = String::from_utf8(value).map_err(|_| {
        Gate::not_ready(
            "WorkloadClusterUnavailable",
            format!("Secret {name}: value is not UTF-8"),
        )
    })?;
    let kc = Kubeconfig::from_yaml(&text).map_err(|e| {
        Gate::not_ready("WorkloadClusterUnavailable", format!("Secret {name}: {e}"))
    })?;
    let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .map_err(|e| {
            Gate::not_ready("WorkloadClusterUnavailable", format!("Secret {name}: {e}"))
        })?;
    Client::try_from(config).map_err(|e| {
        Gate::not_ready(
            "WorkloadClusterUnavailable",
            format!("workload cluster client: {e}"),
        )
    })
}

/// Reads the Node, sets its providerID when empty, and says what the gate should be.
pub async fn sync_node(wc: &Client, node_name: &str, provider_id: &str) -> Gate {
    let nodes: Api<Node> = Api::all(wc.clone());
    let node = match nodes.get_opt(node_name).await {
        Ok(Some(n)) => n,
        Ok(None) => {
            return Gate::not_ready(
                "WaitingForNode",
                format!("node {node_name} has not joined the workload cluster yet"),
            );
        }
        Err(e) => {
            return Gate::not_ready(
                "WorkloadClusterUnreachable",
                format!("read node {node_name}: {e}"),
            );
        }
    };
    let has_id = node
        .spec
        .as_ref()
        .and_then(|s| s.provider_id.as_deref())
        .is_some_and(|p| !p.is_empty());
    if !has_id {
        let patch = json!({"spec": {"providerID": provider_id}});
        if let Err(e) = nodes
            .patch(
                &node.name_any(),
                &PatchParams {
                    field_manager: Some(FIELD_MANAGER.into()),
                    ..Default::default()
                },
                &Patch::Merge(&patch),
            )
            .await
        {
            return Gate::not_ready(
                "WorkloadClusterUnreachable",
                format!("set providerID on node {node_name}: {e}"),
            );
        }
    }
    let ready = node
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"));
    match ready {
        Some(c) if c.status == "True" => Gate {
            ready: true,
            reason: "NodeReady",
            message: format!("node {node_name} is Ready"),
        },
        Some(c) => Gate::not_ready(
            "NodeNotReady",
            format!(
                "node {node_name} is not Ready: {}",
                c.message.clone().unwrap_or_default()
            ),
        ),
        None => Gate::not_ready(
            "NodeNotReady",
            format!("node {node_name} reports no Ready condition"),
        ),
    }
}

/// Writes the gate condition on the machine Pod when it differs from what is there.
pub async fn set_gate(pods: &Api<Pod>, pod: &Pod, gate: &Gate) -> Result<(), kube::Error> {
    let status = if gate.ready { "True" } else { "False" };
    let current = pod
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == NODE_READY_GATE));
    if current.is_some_and(|c| {
        c.status == status
            && c.reason.as_deref() == Some(gate.reason)
            && c.message.as_deref() == Some(gate.message.as_str())
    }) {
        return Ok(());
    }
    let transition = match current {
        Some(c) if c.status == status => c.last_transition_time.clone(),
        _ => Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            Timestamp::now(),
        )),
    };
    let patch = json!({"status": {"conditions": [{
        "type": NODE_READY_GATE,
        "status": status,
        "reason": gate.reason,
        "message": gate.message,
        "lastTransitionTime": transition,
    }]}});
    pods.patch_status(
        &pod.name_any(),
        &PatchParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..Default::default()
        },
        &Patch::Strategic(&patch),
    )
    .await?;
    Ok(())
}
