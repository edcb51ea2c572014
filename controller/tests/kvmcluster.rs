//! The KVMCluster reconciler against a real kube-apiserver (Cluster API objects created by the
//! test, as the CAPI controllers would).

mod support;

use std::time::Duration;

use anyhow::{Context, Result};
use capk_api::{capi::Cluster, v1alpha1::KVMCluster};
use capk_tests::env::TestEnv;
use k8s_openapi::api::core::v1::Service;
use kube::{
    Api, Client, ResourceExt,
    api::{DeleteParams, Patch, PatchParams, PostParams},
};
use serde_json::json;
use support::{create_namespace, eventually, start_controller};

async fn setup(ns: &str) -> Result<(Client, tokio::sync::oneshot::Sender<()>)> {
    let client = TestEnv::shared().client().await?;
    create_namespace(&client, ns).await?;
    let stop = start_controller(client.clone(), ns);
    Ok((client, stop))
}

fn condition(kc: &KVMCluster, type_: &str) -> Option<(String, String)> {
    kc.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| (c.status.clone(), c.reason.clone()))
}

#[tokio::test]
async fn kvmcluster_gets_a_service_an_endpoint_and_a_provisioned_status() -> Result<()> {
    let ns = "kvmcluster-lifecycle";
    let (client, _stop) = setup(ns).await?;
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
            .and_then(|s| s.initialization.as_ref())
            .and_then(|i| i.provisioned)
            == Some(true);
        Ok(provisioned.then_some(kc))
    })
    .await?;
    let status = kc.status.as_ref().unwrap();
    assert_eq!(status.ready, Some(true), "v1beta1 readers see ready");
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
    assert_eq!(spec.publish_not_ready_addresses, Some(true));
    let selector = spec.selector.clone().unwrap();
    assert_eq!(selector["cluster.x-k8s.io/cluster-name"], "demo");
    assert_eq!(
        selector["infrastructure.cluster.x-k8s.io/machine-role"],
        "control-plane"
    );
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
    let to_nodeport = json!({"spec": {"controlPlaneService": {"type": "NodePort"}}});
    kvmclusters
        .patch("demo", &PatchParams::default(), &Patch::Merge(&to_nodeport))
        .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let svc = services.get("demo-apiserver").await?;
    assert_eq!(
        svc.spec.unwrap().type_.as_deref(),
        Some("ClusterIP"),
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
    eventually(30, "Service becomes NodePort", || async {
        let svc = services.get("demo-apiserver").await?;
        Ok((svc.spec.and_then(|s| s.type_).as_deref() == Some("NodePort")).then_some(()))
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
    let clusters: Api<Cluster> = Api::namespaced(client.clone(), ns);
    let kvmclusters: Api<KVMCluster> = Api::namespaced(client.clone(), ns);
    let cluster: Cluster = serde_json::from_value(json!({
        "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Cluster",
        "metadata": {"name": "mine"},
        "spec": {"infrastructureRef": {
            "apiGroup": "infrastructure.cluster.x-k8s.io", "kind": "KVMCluster", "name": "mine"}},
    }))?;
    let cluster = clusters.create(&PostParams::default(), &cluster).await?;
    let kc: KVMCluster = serde_json::from_value(json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1",
        "kind": "KVMCluster",
        "metadata": {"name": "mine", "ownerReferences": [{
            "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Cluster",
            "name": "mine", "uid": cluster.uid().context("uid")?}]},
        "spec": {"controlPlaneEndpoint": {"host": "mine.k8s.example.com", "port": 443}},
    }))?;
    kvmclusters.create(&PostParams::default(), &kc).await?;
    let kc = eventually(30, "provisioned", || async {
        let kc = kvmclusters.get("mine").await?;
        Ok((kc.status.as_ref().and_then(|s| s.ready) == Some(true)).then_some(kc))
    })
    .await?;
    let ep = kc.spec.control_plane_endpoint.unwrap();
    assert_eq!(ep.host.as_deref(), Some("mine.k8s.example.com"));
    assert_eq!(ep.port, Some(443));
    Ok(())
}
