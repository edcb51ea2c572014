//! The KVMMachine reconciler against a real kube-apiserver: Cluster API objects are created by
//! the test the way the CAPI controllers would; no kubelet runs here, so machine Pods stay
//! Pending (the VM itself is covered by the launcher and end-to-end tests).

use std::time::Duration;

use anyhow::{Context, Result, bail};
use capk_api::{
    capi::{Cluster, Machine},
    v1alpha1::KVMMachine,
};
use capk_tests::env::TestEnv;
use k8s_openapi::api::{
    core::v1::{Namespace, Pod, Secret},
    events::v1::Event,
};
use kube::{
    Api, Client, ResourceExt,
    api::{DeleteParams, ListParams, Patch, PatchParams, PostParams},
};
use serde_json::{Value, json};

async fn setup(ns: &str) -> Result<(Client, tokio::sync::oneshot::Sender<()>)> {
    let client = TestEnv::shared().client().await?;
    let nsobj: Namespace = serde_json::from_value(json!({"metadata": {"name": ns}}))?;
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &nsobj)
        .await?;
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let settings = capk_controller::Settings {
        namespace: Some(ns.to_owned()),
        ..Default::default()
    };
    tokio::spawn(capk_controller::run(client.clone(), settings, async {
        let _ = rx.await;
    }));
    Ok((client, tx))
}

async fn eventually<T, F, Fut>(secs: u64, what: &str, mut probe: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Option<T>>>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    loop {
        if let Ok(Some(v)) = probe().await {
            return Ok(v);
        }
        if tokio::time::Instant::now() >= deadline {
            bail!("timed out after {secs}s waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
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

/// A provisioned Cluster, a bootstrap Secret, a Machine and its KVMMachine.
async fn world(client: &Client, ns: &str, name: &str, bootstrap: &str) -> Result<()> {
    let clusters: Api<Cluster> = Api::namespaced(client.clone(), ns);
    if clusters.get_opt("demo").await?.is_none() {
        let c: Cluster = serde_json::from_value(json!({
            "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Cluster",
            "metadata": {"name": "demo"},
            "spec": {"infrastructureRef": {"apiGroup": "infrastructure.cluster.x-k8s.io",
                                           "kind": "KVMCluster", "name": "demo"}},
        }))?;
        clusters.create(&PostParams::default(), &c).await?;
        let status = json!({"status": {"initialization": {"infrastructureProvisioned": true}}});
        clusters
            .patch_status("demo", &PatchParams::default(), &Patch::Merge(&status))
            .await?;
    }
    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": format!("{name}-bootstrap")},
        "type": "cluster.x-k8s.io/secret",
        "stringData": {"value": bootstrap, "format": "cloud-config"},
    }))?;
    Api::<Secret>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &secret)
        .await?;
    let machine: Machine = serde_json::from_value(json!({
        "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine",
        "metadata": {"name": name, "labels": {
            "cluster.x-k8s.io/cluster-name": "demo", "cluster.x-k8s.io/control-plane": ""}},
        "spec": {
            "clusterName": "demo",
            "bootstrap": {"dataSecretName": format!("{name}-bootstrap")},
            "infrastructureRef": {"apiGroup": "infrastructure.cluster.x-k8s.io",
                                  "kind": "KVMMachine", "name": name},
        },
    }))?;
    let machine = Api::<Machine>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &machine)
        .await?;
    let km: KVMMachine = serde_json::from_value(json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1", "kind": "KVMMachine",
        "metadata": {"name": name,
            "labels": {"cluster.x-k8s.io/cluster-name": "demo"},
            "ownerReferences": [{"apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine",
                "name": name, "uid": machine.uid().context("uid")?, "controller": true}]},
        "spec": {"resources": {"cpu": 1, "memory": "1Gi", "disk": "20Gi", "dockerVolumeSize": "5Gi"},
                 "etcdStorage": {"type": "hostPath", "hostPath": "/var/lib/capk-etcd"}},
    }))?;
    Api::<KVMMachine>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &km)
        .await?;
    Ok(())
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
