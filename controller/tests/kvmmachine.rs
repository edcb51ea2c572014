//! The KVMMachine reconciler against a real kube-apiserver: Cluster API objects are created by
//! the test the way the CAPI controllers would; no kubelet runs here, so machine Pods stay
//! Pending (the VM itself is covered by the launcher and end-to-end tests).

mod support;

use anyhow::{Context, Result};
use capk_api::v1alpha1::KVMMachine;
use capk_tests::env::TestEnv;
use k8s_openapi::api::{
    core::v1::{PersistentVolumeClaim, Pod, Secret},
    events::v1::Event,
};
use kube::{
    Api, Client, ResourceExt,
    api::{DeleteParams, ListParams, Patch, PatchParams},
};
use serde_json::{Value, json};
use support::{control_plane_machine as world, create_namespace, eventually, start_controller};

async fn setup(ns: &str) -> Result<(Client, tokio::sync::oneshot::Sender<()>)> {
    let client = TestEnv::shared().client().await?;
    create_namespace(&client, ns).await?;
    let stop = start_controller(client.clone(), ns);
    Ok((client, stop))
}

fn ready(km: &KVMMachine) -> Option<(String, String, String)> {
    condition(km, "Ready")
}

/// Waits until KVMMachine `name`'s `Ready` condition has `reason`; returns (status, message).
async fn ready_with_reason(
    kms: &Api<KVMMachine>,
    name: &str,
    reason: &str,
) -> Result<(String, String)> {
    let (status, _, message) = eventually(30, reason, || async {
        let km = kms.get(name).await?;
        Ok(ready(&km).filter(|r| r.1 == reason))
    })
    .await?;
    Ok((status, message))
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
    let (_, message) = ready_with_reason(&kms, "demo-cp-1", "BootstrapDataInvalid").await?;
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

fn condition(km: &KVMMachine, type_: &str) -> Option<(String, String, String)> {
    let c = km
        .status
        .as_ref()?
        .contract
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == type_)?;
    Some((c.status.clone(), c.reason.clone(), c.message.clone()))
}

const CLOUD_CONFIG: &str = "#cloud-config\nruncmd:\n- kubeadm init\n";

#[tokio::test]
async fn a_missing_bootstrap_secret_is_waited_for_then_used() -> Result<()> {
    let ns = "kvmmachine-missing-secret";
    let (client, _stop) = setup(ns).await?;
    support::control_plane_machine_without_secret(&client, ns, "demo-cp-2").await?;
    let kms: Api<KVMMachine> = Api::namespaced(client.clone(), ns);
    let (status, message) = ready_with_reason(&kms, "demo-cp-2", "WaitingForBootstrapData").await?;
    assert_eq!(status, "False");
    assert!(message.contains("demo-cp-2-bootstrap"), "{message}");
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    assert!(pods.get_opt("demo-cp-2").await?.is_none());

    // The Secret appearing is an event the controller acts on: no restart, no polling.
    support::bootstrap_secret(&client, ns, "demo-cp-2", CLOUD_CONFIG).await?;
    eventually(30, "the machine Pod", || async {
        Ok(pods.get_opt("demo-cp-2").await?)
    })
    .await?;
    Ok(())
}

#[tokio::test]
async fn a_paused_cluster_leaves_its_machines_alone() -> Result<()> {
    let ns = "kvmmachine-paused";
    let client = TestEnv::shared().client().await?;
    create_namespace(&client, ns).await?;
    support::provisioned_cluster(&client, ns).await?;
    let clusters: Api<capk_api::capi::Cluster> = Api::namespaced(client.clone(), ns);
    let pause = |paused: bool| {
        let clusters = clusters.clone();
        async move {
            clusters
                .patch(
                    "demo",
                    &PatchParams::default(),
                    &Patch::Merge(&json!({"spec": {"paused": paused}})),
                )
                .await
        }
    };
    pause(true).await?;
    world(&client, ns, "demo-cp-3", CLOUD_CONFIG).await?;
    let _stop = start_controller(client.clone(), ns);
    let kms: Api<KVMMachine> = Api::namespaced(client.clone(), ns);
    eventually(30, "Paused=True", || async {
        let km = kms.get("demo-cp-3").await?;
        Ok(condition(&km, "Paused").filter(|c| c.0 == "True"))
    })
    .await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let secrets: Api<Secret> = Api::namespaced(client.clone(), ns);
    // Give a wrongly acting controller time to act before checking it did not.
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    assert!(
        pods.get_opt("demo-cp-3").await?.is_none(),
        "a Pod was made while paused"
    );
    assert!(secrets.get_opt("demo-cp-3-ignition").await?.is_none());
    assert!(kms.get("demo-cp-3").await?.finalizers().is_empty());

    pause(false).await?;
    eventually(30, "the machine Pod after unpausing", || async {
        Ok(pods.get_opt("demo-cp-3").await?)
    })
    .await?;
    // The status write follows the Pod, within the same reconcile.
    eventually(30, "Paused=False after unpausing", || async {
        let km = kms.get("demo-cp-3").await?;
        Ok(condition(&km, "Paused").filter(|c| c.0 == "False"))
    })
    .await?;
    Ok(())
}

/// `clusterctl move` pauses a KVMMachine, strips its finalizer and deletes it: no reconcile sees
/// its deletion finish. Its per-object series go with it all the same (else the source
/// management cluster's stuck-provisioning alert would fire for it for as long as the
/// controller runs), and so does its back-off record (the same path; unit-tested in `report`).
#[tokio::test]
async fn a_machine_moved_away_leaves_no_series_behind() -> Result<()> {
    let ns = "kvmmachine-moved-series";
    let client = TestEnv::shared().client().await?;
    create_namespace(&client, ns).await?;
    let metrics = std::sync::Arc::new(capk_controller::metrics::Metrics::new(16));
    let (_stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let settings = capk_controller::Settings {
        namespace: Some(ns.to_owned()),
        ..Default::default()
    };
    tokio::spawn(capk_controller::run_with_metrics(
        client.clone(),
        settings,
        metrics.clone(),
        async {
            let _ = stopped.await;
        },
    ));
    world(&client, ns, "demo-cp-0", CLOUD_CONFIG).await?;
    let series = format!(
        "capk_object_provisioned{{kind=\"KVMMachine\",namespace=\"{ns}\",name=\"demo-cp-0\"}}"
    );
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    eventually(30, "the machine Pod and the machine's series", || async {
        let pod = pods.get_opt("demo-cp-0").await?;
        Ok((pod.is_some() && metrics.render().contains(&series)).then_some(()))
    })
    .await?;

    // What clusterctl move does to the source's objects.
    let kms: Api<KVMMachine> = Api::namespaced(client.clone(), ns);
    let pause =
        json!({"metadata": {"annotations": {capk_api::constants::PAUSED_ANNOTATION: "true"}}});
    kms.patch("demo-cp-0", &PatchParams::default(), &Patch::Merge(&pause))
        .await?;
    eventually(30, "Paused=True", || async {
        let km = kms.get("demo-cp-0").await?;
        Ok(condition(&km, "Paused").filter(|c| c.0 == "True"))
    })
    .await?;
    let strip = json!({"metadata": {"finalizers": null}});
    kms.patch("demo-cp-0", &PatchParams::default(), &Patch::Merge(&strip))
        .await?;
    kms.delete("demo-cp-0", &DeleteParams::default()).await?;
    eventually(30, "the KVMMachine gone", || async {
        Ok(kms.get_opt("demo-cp-0").await?.is_none().then_some(()))
    })
    .await?;
    eventually(10, "the machine's series gone from /metrics", || async {
        let text = metrics.render();
        Ok((!text.contains("name=\"demo-cp-0\"")).then_some(()))
    })
    .await?;
    Ok(())
}

#[tokio::test]
async fn the_kvmmachine_follows_its_pod_from_pending_to_bootstrapped() -> Result<()> {
    let ns = "kvmmachine-pod-story";
    let (client, _stop) = setup(ns).await?;
    world(&client, ns, "demo-cp-4", CLOUD_CONFIG).await?;
    let kms: Api<KVMMachine> = Api::namespaced(client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    // No scheduler runs here: the Pod waits for one, and the conditions say so. clusterctl's
    // block-move annotation, set while the Pod was being created, stays: the Pod lives in the
    // management cluster, and a move would delete it with this KVMMachine.
    let km = eventually(30, "PodScheduled=False and block-move", || async {
        let km = kms.get("demo-cp-4").await?;
        let waiting = condition(&km, "PodScheduled").is_some_and(|c| c.1 == "WaitingForScheduler");
        let blocked = km
            .annotations()
            .contains_key("clusterctl.cluster.x-k8s.io/block-move");
        Ok((waiting && blocked).then_some(km))
    })
    .await?;
    assert_eq!(
        condition(&km, "VMRunning").map(|c| (c.0, c.1)),
        Some(("False".into(), "LauncherPending".into()))
    );

    // What the scheduler (a binding) and the kubelet would write: scheduled, running, ready.
    let binding = json!({"apiVersion": "v1", "kind": "Binding", "metadata": {"name": "demo-cp-4"},
        "target": {"apiVersion": "v1", "kind": "Node", "name": "mc-node-1"}});
    pods.create_subresource::<Value, Value>(
        "binding",
        "demo-cp-4",
        &kube::api::PostParams::default(),
        &binding,
    )
    .await?;
    let status = |ready: bool| {
        json!({"status": {"phase": "Running", "podIP": "10.244.1.7",
            "conditions": [{"type": "PodScheduled", "status": "True"}],
            "containerStatuses": [{"name": "launcher", "ready": ready, "restartCount": 0,
                "image": "localhost/capk/capk-launcher:dev", "imageID": "",
                "state": {"running": {"startedAt": "2026-11-22T07:00:00Z"}}}]}})
    };
    pods.patch_status(
        "demo-cp-4",
        &PatchParams::default(),
        &Patch::Merge(&status(false)),
    )
    .await?;
    let km = eventually(30, "VMRunning=True and provisioned", || async {
        let km = kms.get("demo-cp-4").await?;
        let provisioned = km
            .status
            .as_ref()
            .and_then(|s| s.contract.initialization.as_ref())
            .and_then(|i| i.provisioned)
            == Some(true);
        Ok(
            (provisioned && condition(&km, "VMRunning").is_some_and(|c| c.0 == "True"))
                .then_some(km),
        )
    })
    .await?;
    let addresses = serde_json::to_value(&km.status.as_ref().unwrap().addresses)?;
    assert!(addresses.to_string().contains("10.244.1.7"), "{addresses}");
    assert_eq!(
        condition(&km, "BootstrapCompleted").map(|c| c.1),
        Some("WaitingForBootstrap".into())
    );
    let (_, reason, message) = condition(&km, "PodScheduled").context("PodScheduled")?;
    assert_eq!(reason, "Scheduled");
    assert!(message.contains("mc-node-1"), "{message}");
    pods.patch_status(
        "demo-cp-4",
        &PatchParams::default(),
        &Patch::Merge(&status(true)),
    )
    .await?;
    eventually(30, "BootstrapCompleted=True", || async {
        let km = kms.get("demo-cp-4").await?;
        Ok(condition(&km, "BootstrapCompleted").filter(|c| c.0 == "True"))
    })
    .await?;
    Ok(())
}

#[tokio::test]
async fn a_restarted_controller_makes_no_duplicate_pods() -> Result<()> {
    let ns = "kvmmachine-restart";
    let client = TestEnv::shared().client().await?;
    create_namespace(&client, ns).await?;
    const N: usize = 6;
    for i in 0..N {
        world(&client, ns, &format!("demo-cp-r{i}"), CLOUD_CONFIG).await?;
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    // Stop the first controller as soon as it has made its first Pod: mid-flight.
    let stop = start_controller(client.clone(), ns);
    eventually(30, "a first Pod", || async {
        Ok((!pods.list(&ListParams::default()).await?.items.is_empty()).then_some(()))
    })
    .await?;
    drop(stop);
    let _stop = start_controller(client.clone(), ns);
    let kms: Api<KVMMachine> = Api::namespaced(client.clone(), ns);
    let converged = eventually(60, "every machine with its Pod", || async {
        let done = kms
            .list(&ListParams::default())
            .await?
            .items
            .iter()
            .filter(|k| {
                k.status
                    .as_ref()
                    .and_then(|s| s.pod_name.as_ref())
                    .is_some()
            })
            .count();
        Ok((done == N).then_some(()))
    })
    .await;
    if let Err(e) = converged {
        let states: Vec<_> = kms
            .list(&ListParams::default())
            .await?
            .items
            .iter()
            .map(|k| (k.name_any(), ready(k)))
            .collect();
        anyhow::bail!("{e:#}: {states:?}");
    }
    let list = pods.list(&ListParams::default()).await?.items;
    assert_eq!(
        list.len(),
        N,
        "Pods: {:?}",
        list.iter().map(|p| p.name_any()).collect::<Vec<_>>()
    );
    for p in &list {
        let owners: Vec<_> = p
            .owner_references()
            .iter()
            .map(|o| o.name.clone())
            .collect();
        assert_eq!(
            owners,
            vec![p.name_any()],
            "each Pod is owned by its own KVMMachine"
        );
    }
    Ok(())
}

/// Waits for the Warning Event `SpecInvalid` about KVMMachine `name` whose note has `field`.
async fn spec_invalid_event(client: &Client, ns: &str, name: &str, field: &str) -> Result<()> {
    warning_event(client, ns, name, "SpecInvalid", field).await
}

/// Waits for a Warning Event with `reason` about KVMMachine `name` whose note has `detail`.
async fn warning_event(
    client: &Client,
    ns: &str,
    name: &str,
    reason: &str,
    detail: &str,
) -> Result<()> {
    let events: Api<Event> = Api::namespaced(client.clone(), ns);
    eventually(30, &format!("a {reason} Warning Event"), || async {
        let list = events.list(&ListParams::default()).await?;
        Ok(list.items.into_iter().find(|e| {
            e.reason.as_deref() == Some(reason)
                && e.type_.as_deref() == Some("Warning")
                && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name)
                && e.note.as_deref().is_some_and(|n| n.contains(detail))
        }))
    })
    .await?;
    Ok(())
}

#[tokio::test]
async fn a_node_image_that_cannot_be_fetched_or_verified_is_the_ready_reason_and_an_event()
-> Result<()> {
    let ns = "kvmmachine-image-fetch";
    let (client, _stop) = setup(ns).await?;
    let sha = "ab".repeat(32);
    let spec = json!({
        "resources": {"cpu": 1, "memory": "1Gi", "disk": "20Gi"},
        "image": {"url": {"url": "https://images.example/node.qcow2?token=t0ken", "sha256": sha}},
    });
    support::bootstrap_secret(&client, ns, "demo-cp-9", CLOUD_CONFIG).await?;
    support::control_plane_machine_with_spec(&client, ns, "demo-cp-9", spec).await?;
    let kms: Api<KVMMachine> = Api::namespaced(client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);

    // The machine Pod fetches the image into the node's cache before the launcher boots it.
    let pod = eventually(30, "machine Pod", || async {
        Ok(pods.get_opt("demo-cp-9").await?)
    })
    .await?;
    let spec = pod.spec.context("Pod spec")?;
    let init = spec.init_containers.unwrap_or_default();
    let fetch = init
        .iter()
        .find(|c| c.name == "fetch-image")
        .context("the fetch-image init container")?;
    let args = fetch.args.clone().unwrap_or_default();
    assert!(
        args.contains(&format!("--sha256={sha}"))
            && args.contains(&"--link=/var/lib/capk/state/node-image".to_owned()),
        "{args:?}"
    );
    let launcher = &spec.containers[0];
    assert!(
        launcher
            .args
            .iter()
            .flatten()
            .any(|a| a == "--image=/var/lib/capk/state/node-image"),
        "{:?}",
        launcher.args
    );

    // What the kubelet writes when the init container fails and is backed off: its
    // termination message (the fetcher's one line) in lastState.
    let failed = |message: &str| {
        json!({"status": {"phase": "Pending",
            "initContainerStatuses": [{"name": "fetch-image", "ready": false, "restartCount": 1,
                "image": "localhost/capk/capk-launcher:dev", "imageID": "",
                "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                "lastState": {"terminated": {"exitCode": 1, "message": message}}}]}})
    };
    let download = "ImageDownloadFailed: cannot fetch node image https://images.example/node.qcow2: download https://images.example/node.qcow2: HTTP 404: The requested URL returned error: 404\n";
    pods.patch_status(
        "demo-cp-9",
        &PatchParams::default(),
        &Patch::Merge(&failed(download)),
    )
    .await?;
    let (status, message) = ready_with_reason(&kms, "demo-cp-9", "ImageDownloadFailed").await?;
    assert_eq!(status, "False");
    assert!(
        message.contains("HTTP 404") && message.contains("https://images.example/node.qcow2"),
        "{message}"
    );
    warning_event(&client, ns, "demo-cp-9", "ImageDownloadFailed", "HTTP 404").await?;

    let mismatch = format!(
        "ImageVerificationFailed: https://images.example/node.qcow2: sha256 is {}, expected {sha}; the download was deleted",
        "cd".repeat(32)
    );
    pods.patch_status(
        "demo-cp-9",
        &PatchParams::default(),
        &Patch::Merge(&failed(&mismatch)),
    )
    .await?;
    let (_, message) = ready_with_reason(&kms, "demo-cp-9", "ImageVerificationFailed").await?;
    assert!(
        message.contains(&sha) && message.contains(&"cd".repeat(32)),
        "both digests: {message}"
    );
    warning_event(
        &client,
        ns,
        "demo-cp-9",
        "ImageVerificationFailed",
        &"cd".repeat(32),
    )
    .await?;
    Ok(())
}

#[tokio::test]
async fn a_spec_that_cannot_run_is_reported_and_nothing_is_applied() -> Result<()> {
    let ns = "kvmmachine-bad-spec";
    let (client, _stop) = setup(ns).await?;
    support::bootstrap_secret(&client, ns, "demo-cp-5", CLOUD_CONFIG).await?;
    // 16Ei passes the CRD's rule (a quantity above 0) but is more bytes than 64 bits hold.
    let spec = json!({"resources": {"cpu": 1, "memory": "1Gi", "disk": "20Gi"},
                      "etcdStorage": {"type": "persistentVolume", "size": "16Ei"}});
    support::control_plane_machine_with_spec(&client, ns, "demo-cp-5", spec).await?;
    let kms: Api<KVMMachine> = Api::namespaced(client.clone(), ns);
    let (status, message) = ready_with_reason(&kms, "demo-cp-5", "SpecInvalid").await?;
    assert_eq!(status, "False");
    assert!(message.contains("spec.etcdStorage.size"), "{message}");
    spec_invalid_event(&client, ns, "demo-cp-5", "spec.etcdStorage.size").await?;
    // Validated before anything is applied: no Ignition Secret, no etcd PVC, no Pod.
    assert!(
        Api::<Pod>::namespaced(client.clone(), ns)
            .get_opt("demo-cp-5")
            .await?
            .is_none()
    );
    assert!(
        Api::<Secret>::namespaced(client.clone(), ns)
            .get_opt("demo-cp-5-ignition")
            .await?
            .is_none(),
        "the Ignition Secret was applied for a spec that cannot run"
    );
    assert!(
        Api::<PersistentVolumeClaim>::namespaced(client.clone(), ns)
            .get_opt("demo-cp-5-etcd")
            .await?
            .is_none(),
        "the etcd PVC was created for a spec that cannot run"
    );

    // Fixed, the machine goes on.
    kms.patch(
        "demo-cp-5",
        &PatchParams::default(),
        &Patch::Merge(&json!({"spec": {"etcdStorage": {"size": "8Gi"}}})),
    )
    .await?;
    eventually(30, "the machine Pod once the spec is fixed", || async {
        Ok(Api::<Pod>::namespaced(client.clone(), ns)
            .get_opt("demo-cp-5")
            .await?)
    })
    .await?;
    Ok(())
}

/// A tenant's KVMMachine reaching past its VM (the MC node's root shared into the guest, a
/// toleration of every taint, a system PriorityClass) is refused with the shipped operator
/// settings before anything is applied: each field named, with what the operator allows.
#[tokio::test]
async fn host_paths_and_placement_past_the_tenant_are_refused() -> Result<()> {
    let ns = "kvmmachine-tenant-reach";
    let (client, _stop) = setup(ns).await?;
    support::bootstrap_secret(&client, ns, "demo-cp-7", CLOUD_CONFIG).await?;
    let spec = json!({"resources": {"cpu": 1, "memory": "1Gi", "disk": "20Gi"},
                      "hostVolumes": [{"mountTag": "hostroot", "hostPath": "/"}],
                      "etcdStorage": {"type": "hostPath", "hostPath": "/var/lib/kubelet"},
                      "tolerations": [{"operator": "Exists"}],
                      "priorityClassName": "system-node-critical"});
    support::control_plane_machine_with_spec(&client, ns, "demo-cp-7", spec).await?;
    let message =
        refused_without_pod(&client, ns, "demo-cp-7", "spec.hostVolumes[0].hostPath").await?;
    for expected in [
        "spec.hostVolumes[0].hostPath: \"/\" is not in a directory the operator allows host volumes in (allowed: none)",
        "spec.etcdStorage.hostPath: \"/var/lib/kubelet\" is not in a directory the operator allows etcd data in (allowed: /var/lib/capk/etcd)",
        "spec.tolerations[0].operator",
        "spec.priorityClassName",
    ] {
        assert!(message.contains(expected), "{expected:?} not in {message}");
    }
    Ok(())
}

/// The attack on shares: with one directory of shares allowed, a tenant (another
/// namespace) names tenant A's share. It is refused before anything is applied, naming the
/// field, the tenant's own share and the provider variable; no Pod mounts A's data.
#[tokio::test]
async fn another_namespaces_host_volume_share_is_refused() -> Result<()> {
    let ns = "kvmmachine-share-b";
    let client = TestEnv::shared().client().await?;
    create_namespace(&client, ns).await?;
    let _stop = support::start_controller_with(
        client.clone(),
        capk_controller::Settings {
            namespace: Some(ns.to_owned()),
            tenant_policy: capk_controller::settings::TenantPolicy {
                host_volume_prefixes: vec!["/srv/capk-shares".into()],
                ..Default::default()
            },
            ..Default::default()
        },
    );
    support::bootstrap_secret(&client, ns, "demo-cp-8", CLOUD_CONFIG).await?;
    let spec = json!({"resources": {"cpu": 1, "memory": "1Gi", "disk": "20Gi"},
                      "hostVolumes": [{"mountTag": "stolen",
                                       "hostPath": "/srv/capk-shares/kvmmachine-share-a"}]});
    support::control_plane_machine_with_spec(&client, ns, "demo-cp-8", spec).await?;
    let message =
        refused_without_pod(&client, ns, "demo-cp-8", "spec.hostVolumes[0].hostPath").await?;
    let expected = "spec.hostVolumes[0].hostPath: \"/srv/capk-shares/kvmmachine-share-a\" is not \
                    in a directory the operator allows host volumes in (allowed: \
                    /srv/capk-shares/kvmmachine-share-b)";
    assert!(
        message.contains(expected) && message.contains("CAPK_ALLOWED_HOST_VOLUME_PATHS"),
        "{expected:?} not in {message}"
    );
    Ok(())
}

/// A tenant's machine Pod placed where the operator keeps other things: tolerating the
/// control-plane, cordon, pressure and not-ready taints (NoExecute without a time limit),
/// selecting control-plane nodes, an operator's own PriorityClass. Refused with the shipped
/// settings, each field named with the provider variable that would allow it; no Pod is made.
#[tokio::test]
async fn placement_on_the_operators_nodes_is_refused() -> Result<()> {
    let ns = "kvmmachine-tenant-placement";
    let (client, _stop) = setup(ns).await?;
    support::bootstrap_secret(&client, ns, "demo-cp-8", CLOUD_CONFIG).await?;
    let spec = json!({"resources": {"cpu": 1, "memory": "1Gi", "disk": "20Gi"},
                      "tolerations": [
                          {"key": "node-role.kubernetes.io/control-plane", "operator": "Exists", "effect": "NoSchedule"},
                          {"key": "node.kubernetes.io/unschedulable", "operator": "Exists", "effect": "NoSchedule"},
                          {"key": "node.kubernetes.io/memory-pressure", "operator": "Exists", "effect": "NoSchedule"},
                          {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute"}],
                      "nodeSelector": {"node-role.kubernetes.io/control-plane": ""},
                      "priorityClassName": "platform-critical"});
    support::control_plane_machine_with_spec(&client, ns, "demo-cp-8", spec).await?;
    let message = refused_without_pod(&client, ns, "demo-cp-8", "spec.tolerations[0].key").await?;
    for expected in [
        "spec.nodeSelector[\"node-role.kubernetes.io/control-plane\"]: ",
        "CAPK_ALLOWED_NODE_SELECTOR_KEYS",
        "spec.tolerations[0].key: \"node-role.kubernetes.io/control-plane\" is a taint the operator has not let machines tolerate (allowed: none)",
        "spec.tolerations[1].key: \"node.kubernetes.io/unschedulable\"",
        "spec.tolerations[2].key: \"node.kubernetes.io/memory-pressure\"",
        "spec.tolerations[3].key: \"node.kubernetes.io/not-ready\"",
        "CAPK_ALLOWED_TOLERATION_KEYS",
        "spec.priorityClassName: \"platform-critical\" is not a PriorityClass the operator lets machines use (allowed: none)",
        "CAPK_ALLOWED_PRIORITY_CLASSES",
    ] {
        assert!(message.contains(expected), "{expected:?} not in {message}");
    }
    Ok(())
}

/// Waits until KVMMachine `name` is refused (`Ready=False` reason `SpecInvalid`, a Warning Event
/// naming `field`) and checks that no machine Pod was made for it; returns the condition's
/// message.
async fn refused_without_pod(client: &Client, ns: &str, name: &str, field: &str) -> Result<String> {
    let kms: Api<KVMMachine> = Api::namespaced(client.clone(), ns);
    let (status, message) = ready_with_reason(&kms, name, "SpecInvalid").await?;
    assert_eq!(status, "False");
    spec_invalid_event(client, ns, name, field).await?;
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    assert!(
        Api::<Pod>::namespaced(client.clone(), ns)
            .get_opt(name)
            .await?
            .is_none(),
        "a machine Pod was made for {name}, whose spec is refused: {message}"
    );
    Ok(message)
}

#[tokio::test]
async fn a_machine_pod_refused_by_pod_security_says_why_and_starts_once_allowed() -> Result<()> {
    const ENFORCE: &str = "pod-security.kubernetes.io/enforce";
    let ns = "kvmm-pod-security";
    let (client, _stop) = setup(ns).await?;
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    let label = |level: &str| json!({"metadata": {"labels": {ENFORCE: level}}});
    namespaces
        .patch(
            ns,
            &PatchParams::default(),
            &Patch::Merge(label("baseline")),
        )
        .await?;
    world(&client, ns, "m-psa", "#cloud-config\n").await?;
    let kms: Api<KVMMachine> = Api::namespaced(client.clone(), ns);

    // The apiserver's words and what to do, on the machine and in a Warning Event.
    let (status, message) = ready_with_reason(&kms, "m-psa", "MachinePodRefused").await?;
    assert_eq!(status, "False");
    assert!(message.contains("violates PodSecurity"), "{message}");
    assert!(
        message.contains(&format!("{ENFORCE}=privileged")),
        "{message}"
    );
    warning_event(&client, ns, "m-psa", "MachinePodRefused", "PodSecurity").await?;

    // The operator allows privileged Pods there: the next try makes the Pod.
    namespaces
        .patch(
            ns,
            &PatchParams::default(),
            &Patch::Merge(label("privileged")),
        )
        .await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    eventually(90, "the machine Pod, after the retry", || async {
        let list = pods.list(&ListParams::default()).await?;
        Ok(list.items.into_iter().next())
    })
    .await?;
    Ok(())
}
