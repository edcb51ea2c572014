//! KVMMachineTemplate against a real kube-apiserver: the controller fills `status.capacity` and
//! `status.nodeInfo` from the spec, as Cluster API's autoscaler contract reads them to scale a
//! MachineDeployment up from zero.

mod support;

use anyhow::Result;
use capk_api::v1alpha1::KVMMachineTemplate;
use capk_tests::env::TestEnv;
use kube::{
    Api,
    api::{Patch, PatchParams, PostParams},
};
use serde_json::json;
use support::{create_namespace, eventually, start_controller};

#[tokio::test]
async fn templates_tell_the_autoscaler_what_a_node_will_have() -> Result<()> {
    let ns = "template-capacity";
    let client = TestEnv::shared().client().await?;
    create_namespace(&client, ns).await?;
    let _stop = start_controller(client.clone(), ns);
    let templates: Api<KVMMachineTemplate> = Api::namespaced(client.clone(), ns);
    let template = |name: &str, resources: serde_json::Value| -> Result<KVMMachineTemplate> {
        Ok(serde_json::from_value(json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1",
            "kind": "KVMMachineTemplate",
            "metadata": {"name": name},
            "spec": {"template": {"spec": {"resources": resources}}},
        }))?)
    };
    templates
        .create(
            &PostParams::default(),
            &template(
                "workers",
                json!({"cpu": 4, "memory": "8Gi", "disk": "40Gi", "dockerVolumeSize": "40Gi"}),
            )?,
        )
        .await?;
    templates
        .create(
            &PostParams::default(),
            &template(
                "workers-kubelet-disk",
                json!({"cpu": 2, "memory": "3Gi", "disk": "20Gi", "kubeletVolumeSize": "50Gi"}),
            )?,
        )
        .await?;

    for (name, cpu, memory, storage) in [
        ("workers", "4", "8Gi", "40Gi"),
        ("workers-kubelet-disk", "2", "3Gi", "50Gi"),
    ] {
        let status = eventually(30, "the template's status", || async {
            Ok(templates
                .get(name)
                .await?
                .status
                .filter(|s| s.capacity.is_some()))
        })
        .await?;
        let capacity = status.capacity.unwrap_or_default();
        let value = |k: &str| capacity.get(k).map(|q| q.0.clone());
        assert_eq!(value("cpu").as_deref(), Some(cpu), "{name}: {capacity:?}");
        assert_eq!(value("memory").as_deref(), Some(memory), "{name}");
        assert_eq!(
            value("ephemeral-storage").as_deref(),
            Some(storage),
            "{name}"
        );
        let info = status.node_info.unwrap_or_default();
        assert_eq!(info.architecture.as_deref(), Some("amd64"), "{name}");
        assert_eq!(info.operating_system.as_deref(), Some("linux"), "{name}");
    }

    // Status is rebuilt from the spec (clusterctl move does not copy it): a status someone
    // clears comes back.
    templates
        .patch_status(
            "workers",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"capacity": null, "nodeInfo": null}})),
        )
        .await?;
    // The cleared status is seen by the watch, and the controller writes it again.
    eventually(30, "the status written again", || async {
        Ok(templates
            .get("workers")
            .await?
            .status
            .and_then(|s| s.capacity)
            .filter(|c| c.get("cpu").is_some_and(|q| q.0 == "4")))
    })
    .await?;
    Ok(())
}
