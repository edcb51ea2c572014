//! A deleted control-plane KVMMachine leaves none of its etcd data on the MC node: with
//! `etcdStorage.type: hostPath` a cleanup Pod removes the machine's directory on the node its
//! machine Pod ran on, and the finalizer waits for it. Against a real kube-apiserver; no
//! scheduler or kubelet runs here, so the test binds the machine Pod to a node and plays the
//! kubelet: it confirms the machine Pod's deletion and writes the cleanup Pod's phase.

mod support;

use anyhow::{Context, Result};
use capk_api::v1alpha1::KVMMachine;
use capk_tests::env::TestEnv;
use k8s_openapi::api::{
    core::v1::{Node, Pod},
    events::v1::Event,
};
use kube::{
    Api, Client, ResourceExt,
    api::{DeleteParams, ListParams, Patch, PatchParams, PostParams},
};
use serde_json::{Value, json};
use support::{
    control_plane_machine, control_plane_machine_with_spec, create_namespace,
    delete_without_finalizers, eventually, start_controller,
};

const CLOUD_CONFIG: &str = "#cloud-config\nruncmd:\n- kubeadm init\n";
/// The hostPath of `support::control_plane_machine`'s etcd storage.
const HOST_PATH: &str = "/var/lib/capk/etcd";

async fn setup(ns: &str) -> Result<(Client, tokio::sync::oneshot::Sender<()>)> {
    let client = TestEnv::shared().client().await?;
    create_namespace(&client, ns).await?;
    let stop = start_controller(client.clone(), ns);
    Ok((client, stop))
}

/// Creates Node `name` (idempotent): the MC node the machine Pod runs on.
async fn create_node(client: &Client, name: &str) -> Result<()> {
    let node: Node = serde_json::from_value(json!({"metadata": {"name": name}}))?;
    match Api::<Node>::all(client.clone())
        .create(&PostParams::default(), &node)
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Waits for machine Pod `name` and binds it to `node`, as the scheduler would.
async fn schedule(pods: &Api<Pod>, name: &str, node: &str) -> Result<()> {
    eventually(30, "the machine Pod", || async {
        Ok(pods.get_opt(name).await?)
    })
    .await?;
    let binding = json!({"apiVersion": "v1", "kind": "Binding", "metadata": {"name": name},
        "target": {"apiVersion": "v1", "kind": "Node", "name": node}});
    pods.create_subresource::<Value, Value>("binding", name, &PostParams::default(), &binding)
        .await?;
    Ok(())
}

/// Deletes the KVMMachine and, as the kubelet would once the VM stopped, confirms its machine
/// Pod's deletion.
async fn delete_machine(kms: &Api<KVMMachine>, pods: &Api<Pod>, name: &str) -> Result<()> {
    kms.delete(name, &DeleteParams::default()).await?;
    eventually(30, "the machine Pod being deleted", || async {
        let pod = pods.get_opt(name).await?;
        Ok(pod
            .is_none_or(|p| p.metadata.deletion_timestamp.is_some())
            .then_some(()))
    })
    .await?;
    let _ = pods
        .delete(
            name,
            &DeleteParams {
                grace_period_seconds: Some(0),
                ..Default::default()
            },
        )
        .await;
    Ok(())
}

/// What the kubelet writes when the cleanup Pod's container exited with `code`.
async fn finish(pods: &Api<Pod>, name: &str, code: i32) -> Result<()> {
    let phase = if code == 0 { "Succeeded" } else { "Failed" };
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let status = json!({"status": {"phase": phase,
        "containerStatuses": [{"name": "remove", "ready": false, "restartCount": 0,
            "image": "localhost/capk/capk-launcher:dev", "imageID": "",
            "state": {"terminated": {"exitCode": code, "finishedAt": now,
                "message": if code == 0 { "" } else { "rm: cannot remove 'x': Device or resource busy" }}}}]}});
    pods.patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await?;
    Ok(())
}

/// The Event of `reason` about KVMMachine `name`, once there is one.
async fn event(client: &Client, ns: &str, name: &str, reason: &str) -> Result<Event> {
    let events: Api<Event> = Api::namespaced(client.clone(), ns);
    eventually(30, &format!("a {reason} Event"), || async {
        let list = events.list(&ListParams::default()).await?;
        Ok(list.items.into_iter().find(|e| {
            e.reason.as_deref() == Some(reason)
                && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name)
        }))
    })
    .await
}

fn ready(km: &KVMMachine) -> Option<(String, String)> {
    let c = km
        .status
        .as_ref()?
        .contract
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "Ready")?;
    Some((c.reason.clone(), c.message.clone()))
}

#[tokio::test]
async fn the_kvmmachine_stays_until_its_cleanup_pod_removed_the_etcd_directory() -> Result<()> {
    let ns = "etcd-cleanup-ok";
    let (client, _stop) = setup(ns).await?;
    create_node(&client, "etcd-node-1").await?;
    control_plane_machine(&client, ns, "demo-cp-0", CLOUD_CONFIG).await?;
    let kms: Api<KVMMachine> = Api::namespaced(client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    schedule(&pods, "demo-cp-0", "etcd-node-1").await?;
    // Recorded on the KVMMachine once the Pod is on a node: it survives a restart, a move and
    // the Pod.
    let dir = format!("{HOST_PATH}/{ns}/demo-cp-0");
    eventually(30, "the etcd directory recorded", || async {
        let km = kms.get("demo-cp-0").await?;
        let recorded = km
            .annotations()
            .get("infrastructure.cluster.x-k8s.io/etcd-host-dir")
            .cloned();
        Ok(recorded.filter(|r| *r == format!("etcd-node-1:{dir}")))
    })
    .await?;
    // The record the cleanup trusts is in status, which the KVMMachine's author cannot write.
    let status = kms
        .get_status("demo-cp-0")
        .await?
        .status
        .unwrap_or_default();
    let record = status.etcd_host_dir.context("status.etcdHostDir")?;
    assert_eq!(
        (record.node.as_str(), record.path.as_str()),
        ("etcd-node-1", dir.as_str())
    );

    delete_machine(&kms, &pods, "demo-cp-0").await?;
    let cleanup = eventually(30, "the cleanup Pod", || async {
        Ok(pods.get_opt("demo-cp-0-etcd-cleanup").await?)
    })
    .await?;
    let spec = cleanup.spec.as_ref().context("spec")?;
    assert_eq!(spec.node_name.as_deref(), Some("etcd-node-1"));
    assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
    assert!(spec.active_deadline_seconds.is_some());
    let volumes = spec.volumes.as_ref().context("volumes")?;
    assert_eq!(volumes.len(), 1, "only the directory's parent is mounted");
    let host = volumes[0].host_path.as_ref().context("hostPath")?;
    assert_eq!(host.path, format!("{HOST_PATH}/{ns}"));
    let c = &spec.containers[0];
    let mount = &c.volume_mounts.as_ref().context("mounts")?[0];
    let km = kms.get("demo-cp-0").await?;
    assert_eq!(
        c.command.clone().unwrap_or_default(),
        [
            "capk-launcher".to_owned(),
            "remove-etcd-data".to_owned(),
            format!("--dir={}/demo-cp-0", mount.mount_path),
            format!("--owner={ns}/demo-cp-0/{}", km.uid().unwrap_or_default()),
        ]
    );
    assert_eq!(
        c.image.as_deref(),
        Some(
            capk_controller::settings::MachineDefaults::default()
                .launcher_image
                .as_str()
        )
    );
    let labels = cleanup.labels();
    assert_eq!(
        labels["infrastructure.cluster.x-k8s.io/kvmmachine"],
        "demo-cp-0"
    );
    assert_eq!(
        labels["infrastructure.cluster.x-k8s.io/owner-namespace"],
        ns
    );
    assert_eq!(labels["cluster.x-k8s.io/cluster-name"], "demo");
    assert!(
        !labels.contains_key("infrastructure.cluster.x-k8s.io/machine-role"),
        "a cleanup Pod is no control-plane endpoint"
    );

    // The finalizer waits for it, and says so.
    let (reason, message) = eventually(30, "Ready says the data is being removed", || async {
        Ok(kms.get_opt("demo-cp-0").await?.as_ref().and_then(ready))
            .map(|r| r.filter(|r| r.0 == "RemovingEtcdData"))
    })
    .await?;
    assert!(
        message.contains(&dir) && message.contains("etcd-node-1"),
        "{reason}: {message}"
    );
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    assert!(
        kms.get_opt("demo-cp-0").await?.is_some(),
        "the KVMMachine went before its etcd data"
    );

    finish(&pods, "demo-cp-0-etcd-cleanup", 0).await?;
    eventually(30, "KVMMachine and cleanup Pod gone", || async {
        let gone = kms.get_opt("demo-cp-0").await?.is_none()
            && pods.get_opt("demo-cp-0-etcd-cleanup").await?.is_none();
        Ok(gone.then_some(()))
    })
    .await?;
    let ev = event(&client, ns, "demo-cp-0", "EtcdDataRemoved").await?;
    assert!(ev.note.unwrap_or_default().contains(&dir));
    Ok(())
}

#[tokio::test]
async fn a_failed_cleanup_pod_is_reported_and_made_again() -> Result<()> {
    let ns = "etcd-cleanup-retry";
    let (client, _stop) = setup(ns).await?;
    create_node(&client, "etcd-node-2").await?;
    control_plane_machine(&client, ns, "demo-cp-1", CLOUD_CONFIG).await?;
    let kms: Api<KVMMachine> = Api::namespaced(client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    schedule(&pods, "demo-cp-1", "etcd-node-2").await?;
    delete_machine(&kms, &pods, "demo-cp-1").await?;
    let name = "demo-cp-1-etcd-cleanup";
    let first = eventually(30, "the cleanup Pod", || async {
        Ok(pods.get_opt(name).await?)
    })
    .await?;
    finish(&pods, name, 1).await?;

    let ev = event(&client, ns, "demo-cp-1", "EtcdCleanupFailed").await?;
    assert_eq!(ev.type_.as_deref(), Some("Warning"));
    let note = ev.note.unwrap_or_default();
    assert!(
        note.contains("attempt 1") && note.contains("Device or resource busy"),
        "{note}"
    );
    let (reason, _) = eventually(30, "Ready says the cleanup failed", || async {
        Ok(kms.get_opt("demo-cp-1").await?.as_ref().and_then(ready))
            .map(|r| r.filter(|r| r.0 == "EtcdCleanupFailed" || r.1.contains("attempt 2")))
    })
    .await?;
    assert!(kms.get_opt("demo-cp-1").await?.is_some(), "{reason}");

    // After the back-off, a new Pod: the second attempt, which succeeds.
    let second = eventually(30, "a second cleanup Pod", || async {
        Ok(pods.get_opt(name).await?.filter(|p| p.uid() != first.uid()))
    })
    .await?;
    assert_eq!(
        second.annotations()["infrastructure.cluster.x-k8s.io/etcd-cleanup-attempt"],
        "2"
    );
    // The status write follows the new Pod: wait for it rather than read it once.
    let (_, message) = eventually(30, "Ready says the etcd data is being removed", || async {
        Ok(kms.get_opt("demo-cp-1").await?.as_ref().and_then(ready))
            .map(|r| r.filter(|r| r.0 == "RemovingEtcdData"))
    })
    .await?;
    assert!(message.contains("attempt 1 to remove"), "{message}");
    finish(&pods, name, 0).await?;
    eventually(30, "KVMMachine and cleanup Pod gone", || async {
        let gone = kms.get_opt("demo-cp-1").await?.is_none() && pods.get_opt(name).await?.is_none();
        Ok(gone.then_some(()))
    })
    .await?;
    Ok(())
}

#[tokio::test]
async fn a_node_that_is_gone_does_not_hold_the_deletion() -> Result<()> {
    let ns = "etcd-cleanup-node-gone";
    let (client, _stop) = setup(ns).await?;
    // No Node object: deleted after the Pod was bound to it.
    control_plane_machine(&client, ns, "demo-cp-2", CLOUD_CONFIG).await?;
    let kms: Api<KVMMachine> = Api::namespaced(client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    schedule(&pods, "demo-cp-2", "etcd-node-gone").await?;
    delete_machine(&kms, &pods, "demo-cp-2").await?;
    eventually(30, "KVMMachine gone", || async {
        Ok(kms.get_opt("demo-cp-2").await?.is_none().then_some(()))
    })
    .await?;
    let ev = event(&client, ns, "demo-cp-2", "EtcdDataLeft").await?;
    assert_eq!(ev.type_.as_deref(), Some("Warning"));
    let note = ev.note.unwrap_or_default();
    assert!(
        note.contains("etcd-node-gone")
            && note.contains(&format!("{HOST_PATH}/{ns}/demo-cp-2"))
            && note.contains("no longer exists"),
        "{note}"
    );
    assert!(pods.get_opt("demo-cp-2-etcd-cleanup").await?.is_none());
    Ok(())
}

#[tokio::test]
async fn emptydir_etcd_storage_gets_no_cleanup_pod() -> Result<()> {
    let ns = "etcd-cleanup-emptydir";
    let (client, _stop) = setup(ns).await?;
    create_node(&client, "etcd-node-3").await?;
    support::bootstrap_secret(&client, ns, "demo-cp-3", CLOUD_CONFIG).await?;
    let spec = json!({"resources": {"cpu": 1, "memory": "1Gi", "disk": "20Gi"}});
    control_plane_machine_with_spec(&client, ns, "demo-cp-3", spec).await?;
    let kms: Api<KVMMachine> = Api::namespaced(client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    schedule(&pods, "demo-cp-3", "etcd-node-3").await?;
    eventually(30, "the Pod seen on its node", || async {
        let km = kms.get("demo-cp-3").await?;
        Ok(ready(&km)
            .is_some_and(|r| r.0 == "VMStarting")
            .then_some(km))
    })
    .await?;
    delete_machine(&kms, &pods, "demo-cp-3").await?;
    eventually(30, "KVMMachine gone", || async {
        Ok(kms.get_opt("demo-cp-3").await?.is_none().then_some(()))
    })
    .await?;
    let km_annotated = pods.get_opt("demo-cp-3-etcd-cleanup").await?;
    assert!(
        km_annotated.is_none(),
        "a cleanup Pod for emptyDir etcd data"
    );
    Ok(())
}

#[tokio::test]
async fn a_namespace_being_deleted_does_not_hold_the_deletion() -> Result<()> {
    let ns = "etcd-cleanup-ns-deleted";
    let (client, _stop) = setup(ns).await?;
    create_node(&client, "etcd-node-4").await?;
    control_plane_machine(&client, ns, "demo-cp-4", CLOUD_CONFIG).await?;
    let kms: Api<KVMMachine> = Api::namespaced(client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    schedule(&pods, "demo-cp-4", "etcd-node-4").await?;
    eventually(30, "the etcd directory recorded", || async {
        let km = kms.get("demo-cp-4").await?;
        Ok(km
            .annotations()
            .contains_key("infrastructure.cluster.x-k8s.io/etcd-host-dir")
            .then_some(()))
    })
    .await?;
    // No namespace controller runs here: the namespace stays Terminating, and the apiserver
    // refuses every new object in it, the cleanup Pod included.
    Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone())
        .delete(ns, &DeleteParams::default())
        .await?;
    delete_machine(&kms, &pods, "demo-cp-4").await?;
    eventually(30, "KVMMachine gone", || async {
        Ok(kms.get_opt("demo-cp-4").await?.is_none().then_some(()))
    })
    .await?;
    assert!(pods.get_opt("demo-cp-4-etcd-cleanup").await?.is_none());
    Ok(())
}

/// Waits until the controller recorded machine `name`'s etcd directory in its status.
async fn recorded(kms: &Api<KVMMachine>, name: &str) -> Result<()> {
    eventually(30, "the etcd directory recorded in status", || async {
        let km = kms.get_status(name).await?;
        Ok(km.status.and_then(|s| s.etcd_host_dir).map(|_| ()))
    })
    .await
}

/// A tenant who edits the annotation to point the privileged cleanup Pod elsewhere (another
/// node, another directory) gets a Warning, and nothing is removed anywhere.
#[tokio::test]
async fn an_edited_etcd_dir_annotation_is_refused_and_removes_nothing() -> Result<()> {
    let ns = "etcd-cleanup-edited";
    let (client, _stop) = setup(ns).await?;
    create_node(&client, "etcd-node-5").await?;
    create_node(&client, "etcd-node-5-other").await?;
    control_plane_machine(&client, ns, "demo-cp-5", CLOUD_CONFIG).await?;
    let kms: Api<KVMMachine> = Api::namespaced(client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    schedule(&pods, "demo-cp-5", "etcd-node-5").await?;
    recorded(&kms, "demo-cp-5").await?;
    // Edited while the machine is deleted (before, the controller sets its copy back).
    kms.delete("demo-cp-5", &DeleteParams::default()).await?;
    eventually(30, "the machine Pod being deleted", || async {
        let pod = pods.get_opt("demo-cp-5").await?;
        Ok(pod
            .is_some_and(|p| p.metadata.deletion_timestamp.is_some())
            .then_some(()))
    })
    .await?;
    let forged = format!("etcd-node-5-other:{HOST_PATH}/{ns}/demo-cp-5");
    let patch = json!({"metadata": {"annotations": {
        "infrastructure.cluster.x-k8s.io/etcd-host-dir": forged}}});
    kms.patch("demo-cp-5", &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    let force = DeleteParams {
        grace_period_seconds: Some(0),
        ..Default::default()
    };
    pods.delete("demo-cp-5", &force).await?;
    eventually(30, "KVMMachine gone", || async {
        Ok(kms.get_opt("demo-cp-5").await?.is_none().then_some(()))
    })
    .await?;
    let ev = event(&client, ns, "demo-cp-5", "EtcdDataLeft").await?;
    assert_eq!(ev.type_.as_deref(), Some("Warning"));
    let note = ev.note.unwrap_or_default();
    assert!(
        note.contains("was changed")
            && note.contains("nothing is removed")
            && note.contains(&format!("node etcd-node-5 in {HOST_PATH}/{ns}/demo-cp-5")),
        "{note}"
    );
    assert!(pods.get_opt("demo-cp-5-etcd-cleanup").await?.is_none());
    Ok(())
}

/// A directory named only by the annotation (written by the KVMMachine's author, never
/// recorded from a machine Pod) is never removed.
#[tokio::test]
async fn an_etcd_dir_only_annotated_removes_nothing() -> Result<()> {
    let ns = "etcd-cleanup-annotated-only";
    let (client, _stop) = setup(ns).await?;
    create_node(&client, "etcd-node-6").await?;
    control_plane_machine(&client, ns, "demo-cp-6", CLOUD_CONFIG).await?;
    let kms: Api<KVMMachine> = Api::namespaced(client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    // The machine Pod never reaches a node; the tenant names one, and a directory of its own
    // shape under the allowed prefix.
    eventually(30, "the machine Pod", || async {
        Ok(pods.get_opt("demo-cp-6").await?)
    })
    .await?;
    let forged = format!("etcd-node-6:{HOST_PATH}/{ns}/demo-cp-6");
    let patch = json!({"metadata": {"annotations": {
        "infrastructure.cluster.x-k8s.io/etcd-host-dir": forged}}});
    kms.patch("demo-cp-6", &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    delete_machine(&kms, &pods, "demo-cp-6").await?;
    eventually(30, "KVMMachine gone", || async {
        Ok(kms.get_opt("demo-cp-6").await?.is_none().then_some(()))
    })
    .await?;
    let ev = event(&client, ns, "demo-cp-6", "EtcdDataLeft").await?;
    let note = ev.note.unwrap_or_default();
    assert!(
        note.contains("only the annotation") && note.contains("nothing is removed"),
        "{note}"
    );
    assert!(pods.get_opt("demo-cp-6-etcd-cleanup").await?.is_none());
    Ok(())
}

/// Plays the kubelet for cleanup Pod `pod`: its hostPath volume is `host` (a directory of the
/// test's), and its command runs as the launcher would parse and run it. The container's exit
/// code.
fn run_cleanup(pod: &Pod, host: &std::path::Path) -> Result<i32> {
    use capk_launcher::cli::{Cli, Command};
    use clap::Parser;
    let spec = pod.spec.as_ref().context("spec")?;
    let c = &spec.containers[0];
    let mount = &c.volume_mounts.as_ref().context("mounts")?[0].mount_path;
    let argv: Vec<String> = c
        .command
        .clone()
        .unwrap_or_default()
        .into_iter()
        .map(|a| a.replace(mount.as_str(), &host.display().to_string()))
        .collect();
    let Command::RemoveEtcdData(args) = Cli::try_parse_from(&argv)?.command else {
        anyhow::bail!("the cleanup Pod runs {argv:?}, not capk-launcher remove-etcd-data");
    };
    Ok(
        match capk_launcher::etcd_dir::remove(&args.dir, &args.owner) {
            Ok(_) => 0,
            Err(capk_launcher::etcd_dir::RemoveError::Refused { .. }) => {
                capk_api::etcd_owner::CLEANUP_REFUSED_EXIT_CODE
            }
            Err(_) => 1,
        },
    )
}

/// Tenant B names its namespace like tenant A's control-plane
/// KVMMachine, and its own KVMMachine `etcd.img` with etcd under `<prefix>/<A's namespace>`:
/// its "directory" is A's etcd disk. The cleanup Pod refuses it (A's marker names A's UID),
/// A's etcd data stays, and B's deletion finishes with an EtcdCleanupRefused Warning.
#[tokio::test]
async fn a_cleanup_pointed_at_another_tenants_etcd_disk_removes_nothing() -> Result<()> {
    let victim_ns = "etcd-victim";
    let ns = "victim-cp-0";
    let (client, _stop) = setup(ns).await?;
    create_node(&client, "etcd-node-7").await?;
    support::bootstrap_secret(&client, ns, "etcd.img", CLOUD_CONFIG).await?;
    let spec = json!({"resources": {"cpu": 1, "memory": "1Gi", "disk": "20Gi"},
        "etcdStorage": {"type": "hostPath", "hostPath": format!("{HOST_PATH}/{victim_ns}")}});
    control_plane_machine_with_spec(&client, ns, "etcd.img", spec).await?;
    let kms: Api<KVMMachine> = Api::namespaced(client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    schedule(&pods, "etcd.img", "etcd-node-7").await?;
    recorded(&kms, "etcd.img").await?;

    // Tenant A's machine directory on the node, as its launcher left it.
    let node = tempfile::tempdir()?;
    let victim_dir = node.path().join("victim-cp-0");
    let a = capk_api::etcd_owner::EtcdOwner {
        namespace: victim_ns.into(),
        name: "victim-cp-0".into(),
        uid: "aaaaaaaa-0000-4000-8000-000000000001".into(),
    };
    capk_launcher::etcd_dir::write_marker(&victim_dir, &a)?;
    std::fs::write(victim_dir.join("etcd.img"), b"tenant A's etcd data")?;

    delete_machine(&kms, &pods, "etcd.img").await?;
    let name = "etcd.img-etcd-cleanup";
    let cleanup = eventually(30, "the cleanup Pod", || async {
        Ok(pods.get_opt(name).await?)
    })
    .await?;
    let host = cleanup
        .spec
        .as_ref()
        .context("spec")?
        .volumes
        .as_ref()
        .context("volumes")?[0]
        .host_path
        .clone()
        .context("hostPath")?;
    assert_eq!(host.path, format!("{HOST_PATH}/{victim_ns}/victim-cp-0"));
    let code = run_cleanup(&cleanup, &victim_dir)?;
    assert_eq!(
        std::fs::read(victim_dir.join("etcd.img"))?,
        b"tenant A's etcd data",
        "the cleanup removed another tenant's etcd disk"
    );
    assert_eq!(code, capk_api::etcd_owner::CLEANUP_REFUSED_EXIT_CODE);

    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let status = json!({"status": {"phase": "Failed",
        "containerStatuses": [{"name": "remove", "ready": false, "restartCount": 0,
            "image": "localhost/capk/capk-launcher:dev", "imageID": "",
            "state": {"terminated": {"exitCode": code, "finishedAt": now,
                "message": "EtcdCleanupRefused: /var/lib/capk/etcd-cleanup/etcd.img left as it is: it is not a directory\n"}}}]}});
    pods.patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await?;
    eventually(30, "KVMMachine and cleanup Pod gone", || async {
        let gone = kms.get_opt("etcd.img").await?.is_none() && pods.get_opt(name).await?.is_none();
        Ok(gone.then_some(()))
    })
    .await?;
    let ev = event(&client, ns, "etcd.img", "EtcdCleanupRefused").await?;
    assert_eq!(ev.type_.as_deref(), Some("Warning"));
    let note = ev.note.unwrap_or_default();
    assert!(
        note.contains("it is not a directory") && note.contains("nothing was removed"),
        "{note}"
    );
    Ok(())
}

/// `clusterctl move` makes the KVMMachine again (same namespace and name, a new UID, no status)
/// while its machine Pod, adopted, and its etcd data stay. The data is still that machine's:
/// the controller reads the UID the Pod marked it with back from the Pod, and the cleanup
/// removes the directory when the moved KVMMachine is deleted.
#[tokio::test]
async fn a_moved_machine_removes_the_etcd_data_its_pod_marked() -> Result<()> {
    use capk_api::capi::Machine;
    let ns = "etcd-cleanup-moved";
    let (client, stop) = setup(ns).await?;
    create_node(&client, "etcd-node-8").await?;
    control_plane_machine(&client, ns, "demo-cp-0", CLOUD_CONFIG).await?;
    let kms: Api<KVMMachine> = Api::namespaced(client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    schedule(&pods, "demo-cp-0", "etcd-node-8").await?;
    recorded(&kms, "demo-cp-0").await?;
    let old = kms.get("demo-cp-0").await?;
    let owner = format!("{ns}/demo-cp-0/{}", old.uid().context("uid")?);
    let pod = pods.get("demo-cp-0").await?;
    let args = pod.spec.as_ref().context("spec")?.containers[0]
        .args
        .clone()
        .unwrap_or_default();
    assert!(
        args.contains(&format!("--etcd-owner={owner}")),
        "the machine Pod's launcher is not told whose data it keeps: {args:?}"
    );
    // The directory as that launcher marked it.
    let node = tempfile::tempdir()?;
    let dir = node.path().join("demo-cp-0");
    capk_launcher::etcd_dir::write_marker(&dir, &owner.parse()?)?;
    std::fs::write(dir.join("etcd.img"), b"etcd data")?;

    // What the move leaves: the KVMMachine made again by another controller, the old one
    // deleted without its finalizer running.
    drop(stop);
    let machine = Api::<Machine>::namespaced(client.clone(), ns)
        .get("demo-cp-0")
        .await?;
    delete_without_finalizers(&kms, "demo-cp-0").await?;
    let km: KVMMachine = serde_json::from_value(json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1", "kind": "KVMMachine",
        "metadata": {"name": "demo-cp-0", "labels": {"cluster.x-k8s.io/cluster-name": "demo"},
            "ownerReferences": [{"apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine",
                "name": "demo-cp-0", "uid": machine.uid().context("uid")?, "controller": true}]},
        "spec": old.spec,
    }))?;
    let moved = kms.create(&PostParams::default(), &km).await?;
    assert_ne!(moved.uid(), old.uid());
    let _stop = start_controller(client.clone(), ns);
    eventually(60, "the owner read back from the adopted Pod", || async {
        let record = kms
            .get_status("demo-cp-0")
            .await?
            .status
            .and_then(|s| s.etcd_host_dir);
        Ok(record.filter(|r| r.owner_uid == old.uid()).map(|_| ()))
    })
    .await?;
    assert_eq!(
        pods.get("demo-cp-0").await?.uid(),
        pod.uid(),
        "the VM was not recreated"
    );

    delete_machine(&kms, &pods, "demo-cp-0").await?;
    let name = "demo-cp-0-etcd-cleanup";
    let cleanup = eventually(30, "the cleanup Pod", || async {
        Ok(pods.get_opt(name).await?)
    })
    .await?;
    let code = run_cleanup(&cleanup, node.path())?;
    assert_eq!(code, 0, "the cleanup refused the moved machine's own data");
    assert!(
        !dir.exists(),
        "the moved machine's etcd data is still there"
    );
    finish(&pods, name, 0).await?;
    eventually(30, "KVMMachine and cleanup Pod gone", || async {
        let gone = kms.get_opt("demo-cp-0").await?.is_none() && pods.get_opt(name).await?.is_none();
        Ok(gone.then_some(()))
    })
    .await?;
    Ok(())
}
