//! A KVMCluster or KVMMachine whose Cluster is gone (deleted without its dependents, as when a
//! `clusterctl move` or a user strips finalizers) can still be deleted: the controller does not
//! need the Cluster to let go of its finalizer.

mod support;

use anyhow::{Context, Result};
use capk_api::{
    capi::Cluster,
    v1alpha1::{KVMCluster, KVMMachine},
};
use capk_tests::env::TestEnv;
use k8s_openapi::api::core::v1::{Pod, Service};
use kube::{
    Api, ResourceExt,
    api::{DeleteParams, PostParams},
};
use serde_json::json;
use support::{control_plane_machine, create_namespace, eventually, start_controller};

/// No garbage collector runs against the test apiserver: deleting the Cluster leaves its
/// dependents with an owner reference to nothing, as an orphaning delete would.
async fn delete_cluster(clusters: &Api<Cluster>, name: &str) -> Result<()> {
    clusters.delete(name, &DeleteParams::default()).await?;
    eventually(30, "the Cluster gone", || async {
        Ok(clusters.get_opt(name).await?.is_none().then_some(()))
    })
    .await
}

#[tokio::test]
async fn a_kvmcluster_whose_cluster_is_gone_can_be_deleted() -> Result<()> {
    let ns = "owner-gone-kvmcluster";
    let client = TestEnv::shared().client().await?;
    create_namespace(&client, ns).await?;
    let _stop = start_controller(client.clone(), ns);
    let clusters: Api<Cluster> = Api::namespaced(client.clone(), ns);
    let kcs: Api<KVMCluster> = Api::namespaced(client.clone(), ns);
    let cluster: Cluster = serde_json::from_value(json!({
        "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Cluster",
        "metadata": {"name": "gone"},
        "spec": {"infrastructureRef": {"apiGroup": "infrastructure.cluster.x-k8s.io",
                                       "kind": "KVMCluster", "name": "gone"}},
    }))?;
    let cluster = clusters.create(&PostParams::default(), &cluster).await?;
    let kc: KVMCluster = serde_json::from_value(json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1", "kind": "KVMCluster",
        "metadata": {"name": "gone", "ownerReferences": [{
            "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Cluster",
            "name": "gone", "uid": cluster.uid().context("uid")?}]},
        "spec": {},
    }))?;
    kcs.create(&PostParams::default(), &kc).await?;
    eventually(
        30,
        "the control-plane Service and the finalizer",
        || async {
            let svc = Api::<Service>::namespaced(client.clone(), ns)
                .get_opt("gone-apiserver")
                .await?;
            let kc = kcs.get("gone").await?;
            Ok((svc.is_some() && !kc.finalizers().is_empty()).then_some(()))
        },
    )
    .await?;

    delete_cluster(&clusters, "gone").await?;
    kcs.delete("gone", &DeleteParams::default()).await?;
    eventually(30, "the KVMCluster gone", || async {
        Ok(kcs.get_opt("gone").await?.is_none().then_some(()))
    })
    .await?;
    Ok(())
}

#[tokio::test]
async fn a_kvmmachine_whose_cluster_is_gone_can_be_deleted() -> Result<()> {
    let ns = "owner-gone-kvmmachine";
    let client = TestEnv::shared().client().await?;
    create_namespace(&client, ns).await?;
    let _stop = start_controller(client.clone(), ns);
    control_plane_machine(
        &client,
        ns,
        "demo-cp-0",
        "#cloud-config\nruncmd:\n- echo ok\n",
    )
    .await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    eventually(30, "machine Pod", || async {
        Ok(pods.get_opt("demo-cp-0").await?)
    })
    .await?;

    delete_cluster(&Api::namespaced(client.clone(), ns), "demo").await?;
    let kms: Api<KVMMachine> = Api::namespaced(client.clone(), ns);
    kms.delete("demo-cp-0", &DeleteParams::default()).await?;
    eventually(30, "the KVMMachine and its Pod gone", || async {
        let gone =
            kms.get_opt("demo-cp-0").await?.is_none() && pods.get_opt("demo-cp-0").await?.is_none();
        Ok(gone.then_some(()))
    })
    .await?;
    Ok(())
}
