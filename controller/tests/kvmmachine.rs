//! The KVMMachine reconciler against a real kube-apiserver: Cluster API objects are created by
//! the test the way the CAPI controllers would; no kubelet runs here, so machine Pods stay
//! Pending (the VM itself is covered by the launcher and end-to-end tests).

mod support;

use anyhow::{Context, Result};
use capk_api::v1alpha1::KVMMachine;
use capk_tests::env::TestEnv;
use k8s_openapi::api::{
    core::v1::{Pod, Secret},
    events::v1::Event,
};
use kube::{
    Api, Client, ResourceExt,
    api::{DeleteParams, ListParams},
};
use serde_json::Value;
use support::{control_plane_machine as world, create_namespace, eventually, start_controller};

async fn setup(ns: &str) -> Result<(Client, tokio::sync::oneshot::Sender<()>)> {
    let client = TestEnv::shared().client().await?;
    create_namespace(&client, ns).await?;
    let stop = start_controller(client.clone(), ns);
    Ok((client, stop))
}

fn ready(km: &KVMMachine) -> Option<(String, String, String)> {
    let c = km
        .status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "Ready")?;
    Some((c.status.clone(), c.reason.clone(), c.message.clone()))
}

#[tokio::test]
async fn kvmmachine_gets_its_ignition_secret_a_machine_pod_and_a_provider_id() -> Result<()> {
    let ns = "kvmmachine-lifecycle";
    let (client, _stop) = setup(ns).await?;
    let bootstrap = "## template: jinja\n#cloud-config\nwrite_files:\n- path: /etc/kubeadm-node\n  content: \"{{ ds.meta_data.hostname }}\"\nruncmd:\n- kubeadm init --config /etc/kubeadm.yml\n";
    world(&client, ns, "demo-cp-0", bootstrap).await?;
    let kms: Api<KVMMachine> = Api::namespaced(client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let secrets: Api<Secret> = Api::namespaced(client.clone(), ns);

    let pod = eventually(30, "machine Pod", || async {
        Ok(pods.get_opt("demo-cp-0").await?)
    })
    .await?;
    let labels = pod.labels();
    assert_eq!(labels["cluster.x-k8s.io/cluster-name"], "demo");
    assert_eq!(
        labels["infrastructure.cluster.x-k8s.io/machine-role"],
        "control-plane"
    );
    let spec = pod.spec.as_ref().unwrap();
    assert_eq!(spec.hostname.as_deref(), Some("demo-cp-0"));
    assert_eq!(
        spec.readiness_gates.as_ref().unwrap()[0].condition_type,
        "infrastructure.cluster.x-k8s.io/node-ready"
    );
    let args = spec.containers[0].args.clone().unwrap().join(" ");
    assert!(args.contains("--role=control-plane"), "{args}");
    assert!(
        args.contains("--etcd-disk=/var/lib/capk/etcd/etcd.img"),
        "{args}"
    );
    assert!(
        !args.contains("kubeadm"),
        "bootstrap data leaked into the Pod's arguments: {args}"
    );

    let secret = secrets.get("demo-cp-0-ignition").await?;
    let ign: Value = serde_json::from_slice(&secret.data.as_ref().unwrap()["config.ign"].0)?;
    assert_eq!(ign["ignition"]["version"], "3.4.0");
    assert!(
        ign.to_string().contains("demo-cp-0"),
        "hostname substituted into the Ignition"
    );
    assert_eq!(secret.owner_references()[0].kind, "KVMMachine");

    let km = eventually(30, "providerID and status", || async {
        let km = kms.get("demo-cp-0").await?;
        let ok = km.spec.provider_id.is_some()
            && km
                .status
                .as_ref()
                .and_then(|s| s.pod_name.clone())
                .is_some();
        Ok(ok.then_some(km))
    })
    .await?;
    assert_eq!(
        km.spec.provider_id.as_deref(),
        Some("kvm://kvmmachine-lifecycle/demo-cp-0")
    );
    let (status, reason, message) = ready(&km).context("Ready condition")?;
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "VMStarting"),
        "{message}"
    );

    // Deleting the KVMMachine removes the Pod and the Ignition Secret, then the finalizer.
    kms.delete("demo-cp-0", &DeleteParams::default()).await?;
    eventually(30, "KVMMachine, Pod and Secret gone", || async {
        let gone = kms.get_opt("demo-cp-0").await?.is_none()
            && pods.get_opt("demo-cp-0").await?.is_none()
            && secrets.get_opt("demo-cp-0-ignition").await?.is_none();
        Ok(gone.then_some(()))
    })
    .await?;
    Ok(())
}

#[tokio::test]
async fn bad_bootstrap_data_is_reported_and_no_pod_is_made() -> Result<()> {
    let ns = "kvmmachine-bad-bootstrap";
    let (client, _stop) = setup(ns).await?;
    world(
        &client,
        ns,
        "demo-cp-1",
        "#cloud-config\nfrobnicate: true\n",
    )
    .await?;
    let kms: Api<KVMMachine> = Api::namespaced(client.clone(), ns);
    let (_, reason, message) = eventually(30, "BootstrapDataInvalid", || async {
        let km = kms.get("demo-cp-1").await?;
        Ok(ready(&km).filter(|r| r.1 == "BootstrapDataInvalid"))
    })
    .await?;
    assert_eq!(reason, "BootstrapDataInvalid");
    assert!(message.contains("frobnicate"), "{message}");
    let events: Api<Event> = Api::namespaced(client.clone(), ns);
    let ev = eventually(30, "a Warning Event", || async {
        let list = events.list(&ListParams::default()).await?;
        Ok(list.items.into_iter().find(|e| {
            e.reason.as_deref() == Some("BootstrapDataInvalid")
                && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("demo-cp-1")
        }))
    })
    .await?;
    assert_eq!(ev.type_.as_deref(), Some("Warning"));
    assert!(ev.note.unwrap_or_default().contains("frobnicate"));
    assert!(
        Api::<Pod>::namespaced(client.clone(), ns)
            .get_opt("demo-cp-1")
            .await?
            .is_none()
    );
    Ok(())
}
