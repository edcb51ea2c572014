//! Hosting clusters against two real kube-apiservers: the management cluster (this test binary's
//! shared one) and a hosting cluster (a second etcd + kube-apiserver) that the controller reaches
//! through a kubeconfig Secret, behind a TCP relay the test can cut. The controller runs with
//! the released hosting RBAC (`hosting-rbac.yaml`) and nothing more in the hosting cluster.

mod support;

use std::{collections::BTreeMap, sync::OnceLock, time::Duration};

use anyhow::{Context, Result, anyhow};
use capk_api::{
    capi::{Cluster, Machine},
    v1alpha1::{KVMCluster, KVMMachine},
};
use capk_tests::env::TestEnv;
use k8s_openapi::api::{
    core::v1::{Pod, Secret, Service},
    discovery::v1::EndpointSlice,
};
use kube::{
    Api, Client, ResourceExt,
    api::{
        DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams, PostParams,
    },
    discovery,
};
use serde_json::{Value, json};
use support::release::{docs, release_dir};
use support::{
    POD_NET, Relay, StandInApiServer, control_plane_machine, create_namespace,
    delete_without_finalizers, eventually, in_own_netns, kvm_cluster, start_controller,
};

const OWNER_NS_LABEL: &str = "infrastructure.cluster.x-k8s.io/owner-namespace";
const KVMMACHINE_LABEL: &str = "infrastructure.cluster.x-k8s.io/kvmmachine";

/// The namespace `hosting-rbac.yaml` grants.
const HOSTING_NS: &str = "capk-hosting";
const BOOTSTRAP: &str = "#cloud-config\nruncmd:\n- echo ok\n";

/// The hosting cluster's apiserver, one per test binary (each test relays to it on its own).
fn hosting_env() -> &'static TestEnv {
    static ENV: OnceLock<TestEnv> = OnceLock::new();
    ENV.get_or_init(|| support::start_env("capk-hosting-"))
}

async fn apply(client: &Client, obj: &Value) -> Result<()> {
    let obj: DynamicObject = serde_json::from_value(obj.clone())?;
    let types = obj.types.clone().context("apiVersion/kind")?;
    let gvk = GroupVersionKind::try_from(&types)?;
    let (ar, caps) = discovery::pinned_kind(client, &gvk).await?;
    let api: Api<DynamicObject> = match (&obj.metadata.namespace, caps.scope) {
        (Some(ns), discovery::Scope::Namespaced) => Api::namespaced_with(client.clone(), ns, &ar),
        _ => Api::all_with(client.clone(), &ar),
    };
    api.patch(
        &obj.name_any(),
        &PatchParams::apply("capk-hosting-test").force(),
        &Patch::Apply(&obj),
    )
    .await
    .map_err(|e| anyhow!("{} {}: {e}", gvk.kind, obj.name_any()))?;
    Ok(())
}

/// The hosting cluster as a test sees it: an admin client (for the test's own checks, never
/// through the relay), the relay the controller goes through, and the controller's kubeconfig.
struct Hosting {
    admin: Client,
    relay: Relay,
    kubeconfig: String,
}

/// The hosting cluster's kubeconfig through `relay`, authenticating with `user`.
fn kubeconfig_through(env: &TestEnv, relay: &Relay, user: Value) -> Result<String> {
    let mut kc: Value = serde_yaml_ng::from_str(&std::fs::read_to_string(env.kubeconfig())?)?;
    kc["clusters"][0]["cluster"]["server"] = json!(format!("https://{}", relay.addr));
    kc["users"][0]["user"] = user;
    Ok(serde_yaml_ng::to_string(&kc)?)
}

/// The hosting cluster with the released `hosting-rbac.yaml` applied, and a kubeconfig for its
/// ServiceAccount: a token bound to that role only.
async fn hosting_with_released_rbac() -> Result<Hosting> {
    let env = hosting_env();
    let admin = env.client().await?;
    let released = release_dir()?.join("hosting-rbac.yaml");
    let text = std::fs::read_to_string(&released)
        .with_context(|| format!("{} is not in the release", released.display()))?;
    assert_eq!(
        text,
        std::fs::read_to_string(
            capk_tests::repo_root().join("manifests/hosting/hosting-rbac.yaml")
        )?,
        "the release carries manifests/hosting/hosting-rbac.yaml as it is"
    );
    for o in docs(&text)? {
        apply(&admin, &o).await?;
    }
    let sa: Api<k8s_openapi::api::core::v1::ServiceAccount> =
        Api::namespaced(admin.clone(), HOSTING_NS);
    let req = json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                     "spec": {"expirationSeconds": 3600}});
    let resp: Value = sa
        .create_subresource("token", "capk-hosting", &PostParams::default(), &req)
        .await?;
    let token = resp["status"]["token"].as_str().context("token")?;
    let relay = Relay::start(apiserver_addr(env)?).await?;
    let kubeconfig = kubeconfig_through(env, &relay, json!({"token": token}))?;
    Ok(Hosting {
        admin,
        relay,
        kubeconfig,
    })
}

/// The hosting cluster with the admin's own credential, and namespace `ns` in it.
async fn hosting_as_admin(ns: &str) -> Result<Hosting> {
    let env = hosting_env();
    let admin = env.client().await?;
    create_namespace(&admin, ns).await?;
    let relay = Relay::start(apiserver_addr(env)?).await?;
    let mut kc: Value = serde_yaml_ng::from_str(&std::fs::read_to_string(env.kubeconfig())?)?;
    let user = kc["users"][0]["user"].take();
    let kubeconfig = kubeconfig_through(env, &relay, user)?;
    Ok(Hosting {
        admin,
        relay,
        kubeconfig,
    })
}

fn apiserver_addr(env: &TestEnv) -> Result<std::net::SocketAddr> {
    Ok(env
        .server()
        .strip_prefix("https://")
        .context("https server")?
        .parse()?)
}

/// In `ns` of the management cluster: the kubeconfig Secret `secret` and cluster `demo` whose
/// KVMCluster names it (and `hosting_ns`, when given) as its hosting cluster.
async fn hosted_cluster(
    mc: &Client,
    ns: &str,
    secret: &str,
    kubeconfig: &str,
    hosting_ns: Option<&str>,
) -> Result<KVMCluster> {
    let s: Secret = serde_json::from_value(json!({
        "metadata": {"name": secret},
        "stringData": {"value": kubeconfig},
    }))?;
    Api::<Secret>::namespaced(mc.clone(), ns)
        .create(&PostParams::default(), &s)
        .await?;
    let mut hosting = json!({"kubeconfigSecretRef": {"name": secret}});
    if let Some(h) = hosting_ns {
        hosting["namespace"] = json!(h);
    }
    kvm_cluster(mc, ns, json!({"hostingCluster": hosting})).await
}

/// Namespace `ns` of the management cluster with the controller running in it, and cluster
/// `demo` there whose machines live in `hosted_ns` of `hosting` (kubeconfig Secret
/// `demo-hosting`). The controller stops when the returned sender is dropped.
async fn controller_and_hosted_cluster(
    ns: &str,
    hosting: &Hosting,
    hosted_ns: &str,
) -> Result<(Client, tokio::sync::oneshot::Sender<()>, KVMCluster)> {
    let mc = TestEnv::shared().client().await?;
    create_namespace(&mc, ns).await?;
    let stop = start_controller(mc.clone(), ns);
    let kc = hosted_cluster(
        &mc,
        ns,
        "demo-hosting",
        &hosting.kubeconfig,
        Some(hosted_ns),
    )
    .await?;
    Ok((mc, stop, kc))
}

fn conditions_of(
    status: Option<&Vec<k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition>>,
    type_: &str,
) -> Option<(String, String, String)> {
    status?
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
}

fn cluster_condition(kc: &KVMCluster, type_: &str) -> Option<(String, String, String)> {
    conditions_of(kc.status.as_ref()?.contract.conditions.as_ref(), type_)
}

fn machine_condition(km: &KVMMachine, type_: &str) -> Option<(String, String, String)> {
    conditions_of(km.status.as_ref()?.contract.conditions.as_ref(), type_)
}

/// Waits until the KVMCluster's and the KVMMachine's `HostingClusterAvailable` say `status` with
/// `reason`.
async fn both_say(
    kcs: &Api<KVMCluster>,
    kms: &Api<KVMMachine>,
    machine: &str,
    status: &str,
    reason: &str,
) -> Result<()> {
    eventually(
        60,
        &format!("HostingClusterAvailable {status} {reason}"),
        || async {
            let kc = kcs.get("demo").await?;
            let km = kms.get(machine).await?;
            let want = |c: Option<(String, String, String)>| {
                c.is_some_and(|(s, r, _)| s == status && r == reason)
            };
            Ok((want(cluster_condition(&kc, "HostingClusterAvailable"))
                && want(machine_condition(&km, "HostingClusterAvailable")))
            .then_some(()))
        },
    )
    .await
}

/// Marks machine Pod `name` running at `ip`, as a kubelet would report it.
async fn run_pod(pods: &Api<Pod>, name: &str, ip: &str) -> Result<()> {
    let status = json!({"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
        "containerStatuses": [{"name": "launcher", "image": "capk-launcher", "imageID": "",
            "ready": false, "restartCount": 0, "started": false,
            "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}}]}});
    pods.patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await?;
    Ok(())
}

/// The name the controller gives an object of an owner in management namespace `owner_ns`
/// in a hosting namespace of another name: `<base>-<hash of owner_ns><suffix>`
/// (controller/src/k8s/ownership.rs, `Home::name_for`; short names are not cut).
fn qualified(base: &str, owner_ns: &str, suffix: &str) -> String {
    format!(
        "{base}-{}{suffix}",
        capk_api::constants::name_hash(owner_ns)
    )
}

fn labels_of(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
) -> BTreeMap<String, String> {
    meta.labels.clone().unwrap_or_default()
}

#[tokio::test]
async fn machines_live_in_the_hosting_cluster_under_the_hosting_role_only() -> Result<()> {
    let ns = "hosted";
    let hosting = hosting_with_released_rbac().await?;
    let (mc, _stop, _) = controller_and_hosted_cluster(ns, &hosting, HOSTING_NS).await?;
    let kcs: Api<KVMCluster> = Api::namespaced(mc.clone(), ns);
    let kms: Api<KVMMachine> = Api::namespaced(mc.clone(), ns);
    let hosted_services: Api<Service> = Api::namespaced(hosting.admin.clone(), HOSTING_NS);
    let hosted_slices: Api<EndpointSlice> = Api::namespaced(hosting.admin.clone(), HOSTING_NS);
    let hosted_pods: Api<Pod> = Api::namespaced(hosting.admin.clone(), HOSTING_NS);
    let hosted_secrets: Api<Secret> = Api::namespaced(hosting.admin.clone(), HOSTING_NS);
    // A namespace other than the management namespace's: the names say whose they are.
    let svc_name = qualified("demo", ns, "-apiserver");
    let pod_name = qualified("demo-cp-0", ns, "");
    let cleanup_name = format!("{pod_name}-etcd-cleanup");

    // The KVMCluster: its Service and EndpointSlice in the hosting cluster, named by labels; the
    // endpoint is where the VMs (Pods there) resolve it.
    let kc = eventually(
        60,
        "KVMCluster provisioned in the hosting cluster",
        || async {
            let kc = kcs.get("demo").await?;
            Ok((kc.status.as_ref().and_then(|s| s.contract.ready) == Some(true)).then_some(kc))
        },
    )
    .await?;
    let (status, reason, message) =
        cluster_condition(&kc, "HostingClusterAvailable").context("condition")?;
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("True", "HostingClusterConnected")
    );
    assert!(message.contains("namespace capk-hosting"), "{message}");
    assert_eq!(
        kc.spec
            .control_plane_endpoint
            .as_ref()
            .and_then(|e| e.host.as_deref()),
        Some(format!("{svc_name}.capk-hosting.svc.cluster.local").as_str())
    );
    let svc = hosted_services.get(&svc_name).await?;
    assert_eq!(svc.metadata.owner_references, None);
    let labels = labels_of(&svc.metadata);
    assert_eq!(
        labels["infrastructure.cluster.x-k8s.io/owner-namespace"],
        ns
    );
    assert_eq!(labels["infrastructure.cluster.x-k8s.io/kvmcluster"], "demo");
    assert_eq!(
        labels["infrastructure.cluster.x-k8s.io/owner-uid"],
        kc.uid().context("uid")?
    );
    eventually(30, "the EndpointSlice in the hosting cluster", || async {
        Ok(hosted_slices.get_opt(&svc_name).await?)
    })
    .await?;
    assert!(
        Api::<Service>::namespaced(mc.clone(), ns)
            .get_opt("demo-apiserver")
            .await?
            .is_none(),
        "nothing of it in the management cluster"
    );
    let secret = Api::<Secret>::namespaced(mc.clone(), ns)
        .get("demo-hosting")
        .await?;
    assert_eq!(
        labels_of(&secret.metadata)
            .get("clusterctl.cluster.x-k8s.io/move")
            .map(String::as_str),
        Some(""),
        "the kubeconfig Secret travels with clusterctl move"
    );

    // A machine: its Ignition Secret and Pod in the hosting cluster, nothing in the management
    // cluster; the Pod's status (seen through the hosting watch) makes it provisioned.
    control_plane_machine(&mc, ns, "demo-cp-0", BOOTSTRAP).await?;
    let pod = eventually(60, "the machine Pod in the hosting cluster", || async {
        Ok(hosted_pods.get_opt(&pod_name).await?)
    })
    .await?;
    assert_eq!(pod.metadata.owner_references, None);
    let km = kms.get("demo-cp-0").await?;
    let labels = labels_of(&pod.metadata);
    assert_eq!(
        labels["infrastructure.cluster.x-k8s.io/owner-namespace"],
        ns
    );
    assert_eq!(
        labels["infrastructure.cluster.x-k8s.io/kvmmachine"],
        "demo-cp-0"
    );
    assert_eq!(
        labels["infrastructure.cluster.x-k8s.io/owner-uid"],
        km.uid().context("uid")?
    );
    let ignition = hosted_secrets.get(&format!("{pod_name}-ignition")).await?;
    assert_eq!(ignition.metadata.owner_references, None);
    assert!(
        Api::<Pod>::namespaced(mc.clone(), ns)
            .get_opt("demo-cp-0")
            .await?
            .is_none()
            && Api::<Secret>::namespaced(mc.clone(), ns)
                .get_opt("demo-cp-0-ignition")
                .await?
                .is_none(),
        "nothing of the machine in the management cluster"
    );
    // On a node of the hosting cluster (as its scheduler binds it): the machine's hostPath etcd
    // data is there, and is removed from there when the machine goes.
    let node: k8s_openapi::api::core::v1::Node =
        serde_json::from_value(json!({"metadata": {"name": "hosting-node-1"}}))?;
    Api::<k8s_openapi::api::core::v1::Node>::all(hosting.admin.clone())
        .create(&PostParams::default(), &node)
        .await?;
    let binding = json!({"apiVersion": "v1", "kind": "Binding", "metadata": {"name": pod_name},
        "target": {"apiVersion": "v1", "kind": "Node", "name": "hosting-node-1"}});
    hosted_pods
        .create_subresource::<Value, Value>("binding", &pod_name, &PostParams::default(), &binding)
        .await?;
    run_pod(&hosted_pods, &pod_name, "10.240.0.7").await?;
    eventually(60, "KVMMachine Ready from the hosted Pod", || async {
        let km = kms.get("demo-cp-0").await?;
        let ready = machine_condition(&km, "Ready")
            .is_some_and(|(s, r, _)| s == "True" && r == "VMRunning");
        Ok(ready.then_some(()))
    })
    .await?;
    both_say(&kcs, &kms, "demo-cp-0", "True", "HostingClusterConnected").await?;
    // The readiness gate is written in the hosting cluster (pods/status).
    eventually(30, "the readiness gate on the hosted Pod", || async {
        let pod = hosted_pods.get(&pod_name).await?;
        let gate = pod
            .status
            .and_then(|s| s.conditions)
            .unwrap_or_default()
            .into_iter()
            .find(|c| c.type_ == "infrastructure.cluster.x-k8s.io/node-ready");
        Ok(gate.map(|g| g.reason))
    })
    .await?;

    // The hosting cluster becomes unreachable: a condition on both, the VM untouched, Ready
    // (what was last seen) kept.
    hosting.relay.set_open(false);
    both_say(
        &kcs,
        &kms,
        "demo-cp-0",
        "False",
        "HostingClusterUnreachable",
    )
    .await?;
    let km = kms.get("demo-cp-0").await?;
    assert_eq!(
        machine_condition(&km, "Ready").map(|c| c.0).as_deref(),
        Some("True")
    );
    let kc = kcs.get("demo").await?;
    assert_eq!(
        cluster_condition(&kc, "Ready").map(|c| c.0).as_deref(),
        Some("True")
    );
    let (_, _, message) = cluster_condition(&kc, "HostingClusterAvailable").context("condition")?;
    assert!(message.contains("does not answer"), "{message}");
    assert_eq!(
        hosted_pods.get(&pod_name).await?.uid(),
        pod.uid(),
        "the VM runs on"
    );

    // It answers again: recovery without anyone's help, still the same Pod.
    hosting.relay.set_open(true);
    both_say(&kcs, &kms, "demo-cp-0", "True", "HostingClusterConnected").await?;
    let pods = hosted_pods.list(&ListParams::default()).await?.items;
    assert_eq!(pods.len(), 1, "nothing made twice");
    assert_eq!(pods[0].uid(), pod.uid());

    // Deletion: the KVMCluster waits for its machines (each needs it to find its Pod); the
    // KVMMachine's deletion removes its objects in the hosting cluster, then the KVMCluster's.
    kcs.delete("demo", &DeleteParams::default()).await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        kcs.get_opt("demo").await?.is_some(),
        "waits for its machines"
    );
    assert!(hosted_services.get_opt(&svc_name).await?.is_some());
    kms.delete("demo-cp-0", &DeleteParams::default()).await?;
    // The test is the hosting cluster's kubelet: it confirms the machine Pod's deletion, then
    // runs the etcd cleanup Pod, which is made there, on the machine's node, owned by labels.
    eventually(30, "the hosted machine Pod being deleted", || async {
        let pod = hosted_pods.get_opt(&pod_name).await?;
        Ok(pod
            .is_none_or(|p| p.metadata.deletion_timestamp.is_some())
            .then_some(()))
    })
    .await?;
    let _ = hosted_pods
        .delete(
            &pod_name,
            &DeleteParams {
                grace_period_seconds: Some(0),
                ..Default::default()
            },
        )
        .await;
    let cleanup = eventually(
        30,
        "the etcd cleanup Pod in the hosting cluster",
        || async { Ok(hosted_pods.get_opt(&cleanup_name).await?) },
    )
    .await?;
    assert_eq!(cleanup.metadata.owner_references, None);
    let labels = labels_of(&cleanup.metadata);
    assert_eq!(
        labels["infrastructure.cluster.x-k8s.io/owner-namespace"],
        ns
    );
    assert_eq!(
        labels["infrastructure.cluster.x-k8s.io/kvmmachine"],
        "demo-cp-0"
    );
    let spec = cleanup.spec.clone().unwrap_or_default();
    assert_eq!(spec.node_name.as_deref(), Some("hosting-node-1"));
    assert_eq!(
        spec.volumes.unwrap_or_default()[0]
            .host_path
            .as_ref()
            .map(|h| h.path.as_str()),
        Some("/var/lib/capk/etcd/hosted"),
        "the parent of the machine Pod's own directory"
    );
    assert!(
        Api::<Pod>::namespaced(mc.clone(), ns)
            .get_opt("demo-cp-0-etcd-cleanup")
            .await?
            .is_none(),
        "no cleanup Pod in the management cluster"
    );
    hosted_pods
        .patch_status(
            &cleanup_name,
            &PatchParams::default(),
            &Patch::Merge(&json!({"status": {"phase": "Succeeded"}})),
        )
        .await?;
    eventually(60, "everything gone from the hosting cluster", || async {
        let gone = kms.get_opt("demo-cp-0").await?.is_none()
            && hosted_pods.get_opt(&cleanup_name).await?.is_none()
            && kcs.get_opt("demo").await?.is_none()
            && hosted_pods.get_opt(&pod_name).await?.is_none()
            && hosted_secrets
                .get_opt(&format!("{pod_name}-ignition"))
                .await?
                .is_none()
            && hosted_services.get_opt(&svc_name).await?.is_none()
            && hosted_slices.get_opt(&svc_name).await?.is_none();
        Ok(gone.then_some(()))
    })
    .await?;
    Ok(())
}

#[tokio::test]
async fn a_recreated_kvmmachine_adopts_its_labelled_objects() -> Result<()> {
    let (ns, hosted_ns) = ("hosting-adopt", "adopt");
    let hosting = hosting_as_admin(hosted_ns).await?;
    let (mc, stop, kc) = controller_and_hosted_cluster(ns, &hosting, hosted_ns).await?;
    control_plane_machine(&mc, ns, "demo-cp-0", BOOTSTRAP).await?;
    let kcs: Api<KVMCluster> = Api::namespaced(mc.clone(), ns);
    let kms: Api<KVMMachine> = Api::namespaced(mc.clone(), ns);
    let hosted_pods: Api<Pod> = Api::namespaced(hosting.admin.clone(), hosted_ns);
    let hosted_services: Api<Service> = Api::namespaced(hosting.admin.clone(), hosted_ns);
    let (pod_name, svc_name) = (
        qualified("demo-cp-0", ns, ""),
        qualified("demo", ns, "-apiserver"),
    );
    let pod = eventually(60, "the machine Pod in the hosting cluster", || async {
        Ok(hosted_pods.get_opt(&pod_name).await?)
    })
    .await?;
    run_pod(&hosted_pods, &pod_name, "10.240.0.9").await?;
    let svc = eventually(60, "the Service in the hosting cluster", || async {
        Ok(hosted_services.get_opt(&svc_name).await?)
    })
    .await?;
    let old_km = kms.get("demo-cp-0").await?;
    eventually(60, "provisioned", || async {
        let km = kms.get("demo-cp-0").await?;
        Ok(km
            .status
            .and_then(|s| s.contract.ready)
            .filter(|r| *r)
            .map(|_| ()))
    })
    .await?;

    // What `clusterctl move` leaves behind: the KVM objects made again (new UIDs, no status)
    // by another controller, the old ones deleted without their finalizers running.
    drop(stop);
    let km_spec = old_km.spec.clone();
    let machine = Api::<Machine>::namespaced(mc.clone(), ns)
        .get("demo-cp-0")
        .await?;
    delete_without_finalizers(&kms, "demo-cp-0").await?;
    delete_without_finalizers(&kcs, "demo").await?;
    let new_kc = kvm_cluster(&mc, ns, json!({"hostingCluster": kc.spec.hosting_cluster})).await?;
    let km: KVMMachine = serde_json::from_value(json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1", "kind": "KVMMachine",
        "metadata": {"name": "demo-cp-0", "labels": {"cluster.x-k8s.io/cluster-name": "demo"},
            "ownerReferences": [{"apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine",
                "name": "demo-cp-0", "uid": machine.uid().context("uid")?, "controller": true}]},
        "spec": km_spec,
    }))?;
    let new_km = kms.create(&PostParams::default(), &km).await?;
    assert_ne!(new_km.uid(), old_km.uid());
    let _stop = start_controller(mc.clone(), ns);

    // The new objects find theirs by the labels: same Pod, same Service, the UID label updated.
    let pod_now = eventually(60, "the Pod adopted by the new KVMMachine", || async {
        let p = hosted_pods.get(&pod_name).await?;
        Ok(
            (labels_of(&p.metadata).get("infrastructure.cluster.x-k8s.io/owner-uid")
                == new_km.uid().as_ref())
            .then_some(p),
        )
    })
    .await?;
    assert_eq!(pod_now.uid(), pod.uid(), "the VM was not recreated");
    eventually(
        60,
        "the new KVMMachine provisioned from the world",
        || async {
            let km = kms.get("demo-cp-0").await?;
            let ready = machine_condition(&km, "Ready")
                .is_some_and(|(s, r, _)| s == "True" && r == "VMRunning");
            Ok(ready.then_some(()))
        },
    )
    .await?;
    let svc_now = eventually(60, "the Service adopted by the new KVMCluster", || async {
        let s = hosted_services.get(&svc_name).await?;
        Ok(
            (labels_of(&s.metadata).get("infrastructure.cluster.x-k8s.io/owner-uid")
                == new_kc.uid().as_ref())
            .then_some(s),
        )
    })
    .await?;
    assert_eq!(svc_now.uid(), svc.uid());
    assert_eq!(
        hosted_pods.list(&ListParams::default()).await?.items.len(),
        1
    );
    Ok(())
}

#[tokio::test]
async fn a_cluster_moved_away_leaves_no_connection_to_its_hosting_cluster() -> Result<()> {
    let (ns, hosted_ns) = ("hosting-moved-away", "moved-away");
    let hosting = hosting_as_admin(hosted_ns).await?;
    let (mc, _stop, _) = controller_and_hosted_cluster(ns, &hosting, hosted_ns).await?;
    let kcs: Api<KVMCluster> = Api::namespaced(mc.clone(), ns);
    eventually(60, "the hosting cluster connected", || async {
        let kc = kcs.get("demo").await?;
        let connected = cluster_condition(&kc, "HostingClusterAvailable")
            .is_some_and(|(s, r, _)| s == "True" && r == "HostingClusterConnected");
        Ok(connected.then_some(()))
    })
    .await?;
    assert!(
        hosting.relay.connections() > 0,
        "the controller watches the hosting cluster through the relay"
    );

    // What `clusterctl move` does to the source's copy: pause, remove the finalizer, delete.
    // No reconcile of that KVMCluster follows; its link must go all the same.
    let clusters: Api<Cluster> = Api::namespaced(mc.clone(), ns);
    let pause = json!({"spec": {"paused": true}});
    clusters
        .patch("demo", &PatchParams::default(), &Patch::Merge(&pause))
        .await?;
    delete_without_finalizers(&kcs, "demo").await?;
    eventually(60, "no connection left to the hosting cluster", || async {
        Ok((hosting.relay.connections() == 0).then_some(()))
    })
    .await?;
    Ok(())
}

#[tokio::test]
async fn an_explicit_reference_to_the_same_cluster_keeps_the_running_pods() -> Result<()> {
    let ns = "hosting-switch";
    let mc = TestEnv::shared().client().await?;
    create_namespace(&mc, ns).await?;
    let _stop = start_controller(mc.clone(), ns);
    kvm_cluster(&mc, ns, json!({})).await?;
    control_plane_machine(&mc, ns, "demo-cp-0", BOOTSTRAP).await?;
    let kcs: Api<KVMCluster> = Api::namespaced(mc.clone(), ns);
    let kms: Api<KVMMachine> = Api::namespaced(mc.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(mc.clone(), ns);
    let secrets: Api<Secret> = Api::namespaced(mc.clone(), ns);
    let services: Api<Service> = Api::namespaced(mc.clone(), ns);
    // In the management cluster: owner references as always, and the owner labels.
    let pod = eventually(60, "the machine Pod in the management cluster", || async {
        Ok(pods.get_opt("demo-cp-0").await?)
    })
    .await?;
    assert_eq!(pod.owner_references()[0].kind, "KVMMachine");
    assert_eq!(
        labels_of(&pod.metadata)["infrastructure.cluster.x-k8s.io/owner-namespace"],
        ns
    );
    run_pod(&pods, "demo-cp-0", "10.240.0.11").await?;
    both_say(&kcs, &kms, "demo-cp-0", "True", "ManagementCluster").await?;
    // clusterctl move would delete that Pod with its KVMMachine: both block it.
    const BLOCK_MOVE: &str = "clusterctl.cluster.x-k8s.io/block-move";
    let blocks = || async {
        let kc = kcs.get("demo").await?;
        let km = kms.get("demo-cp-0").await?;
        anyhow::Ok((
            kc.annotations().contains_key(BLOCK_MOVE),
            km.annotations().contains_key(BLOCK_MOVE),
        ))
    };
    eventually(30, "block-move on both", || async {
        Ok((blocks().await? == (true, true)).then_some(()))
    })
    .await?;

    // The same cluster, now named by a kubeconfig Secret (the namespace defaults to the
    // KVMCluster's).
    let s: Secret = serde_json::from_value(json!({
        "metadata": {"name": "self"},
        "stringData": {"value": std::fs::read_to_string(TestEnv::shared().kubeconfig())?},
    }))?;
    secrets.create(&PostParams::default(), &s).await?;
    let patch = json!({"spec": {"hostingCluster": {"kubeconfigSecretRef": {"name": "self"}}}});
    kcs.patch("demo", &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    both_say(&kcs, &kms, "demo-cp-0", "True", "HostingClusterConnected").await?;
    let adopted = eventually(60, "the Pod adopted without owner references", || async {
        let p = pods.get("demo-cp-0").await?;
        Ok(p.metadata.owner_references.is_none().then_some(p))
    })
    .await?;
    assert_eq!(adopted.uid(), pod.uid(), "same Pod: the VM did not restart");
    eventually(
        60,
        "the Ignition Secret and the Service without owner references",
        || async {
            let ignition = secrets.get("demo-cp-0-ignition").await?;
            let svc = services.get("demo-apiserver").await?;
            Ok((ignition.metadata.owner_references.is_none()
                && svc.metadata.owner_references.is_none())
            .then_some(()))
        },
    )
    .await?;
    assert_eq!(pods.list(&ListParams::default()).await?.items.len(), 1);
    let km = kms.get("demo-cp-0").await?;
    assert_eq!(
        machine_condition(&km, "Ready").map(|c| c.1).as_deref(),
        Some("VMRunning")
    );
    // Adopted by labels, the VMs outlive a move: nothing blocks it any more.
    eventually(30, "no block-move", || async {
        Ok((blocks().await? == (false, false)).then_some(()))
    })
    .await?;
    Ok(())
}

#[tokio::test]
async fn hosting_references_are_checked_and_unusable_kubeconfigs_reported() -> Result<()> {
    let ns = "hosting-refused";
    let mc = TestEnv::shared().client().await?;
    create_namespace(&mc, ns).await?;
    let _stop = start_controller(mc.clone(), ns);
    let kcs: Api<KVMCluster> = Api::namespaced(mc.clone(), ns);

    // The apiserver refuses what cannot name a Secret or a namespace.
    let bad: KVMCluster = serde_json::from_value(json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1", "kind": "KVMCluster",
        "metadata": {"name": "bad"},
        "spec": {"hostingCluster": {"kubeconfigSecretRef": {"name": "Not_A_Name"}, "namespace": "-x"}},
    }))?;
    let err = kcs
        .create(&PostParams::default(), &bad)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("kubeconfigSecretRef.name must be the name of a Secret"),
        "{err}"
    );
    assert!(
        err.contains("hostingCluster.namespace must be a namespace name"),
        "{err}"
    );

    // No Secret yet: the condition names it.
    let spec = json!({"hostingCluster": {"kubeconfigSecretRef": {"name": "elsewhere"},
                                         "namespace": "there"}});
    kvm_cluster(&mc, ns, spec).await?;
    let said = |reason: &'static str| {
        let kcs = kcs.clone();
        async move {
            eventually(60, reason, || async {
                let kc = kcs.get("demo").await?;
                Ok(cluster_condition(&kc, "HostingClusterAvailable")
                    .filter(|(s, r, _)| s == "False" && r == reason)
                    .map(|c| c.2))
            })
            .await
        }
    };
    let message = said("HostingKubeconfigMissing").await?;
    assert!(
        message.contains("Secret elsewhere does not exist"),
        "{message}"
    );
    // A kubeconfig that would run a command: refused, never used.
    let exec = "apiVersion: v1\nkind: Config\ncurrent-context: c\nclusters:\n- name: c\n  cluster: {server: 'https://127.0.0.1:1'}\ncontexts:\n- name: c\n  context: {cluster: c, user: u}\nusers:\n- name: u\n  user:\n    exec: {apiVersion: client.authentication.k8s.io/v1, command: /bin/sh, args: [-c, 'touch /tmp/capk-pwned']}\n";
    let s: Secret = serde_json::from_value(json!({
        "metadata": {"name": "elsewhere"}, "stringData": {"value": exec},
    }))?;
    Api::<Secret>::namespaced(mc.clone(), ns)
        .create(&PostParams::default(), &s)
        .await?;
    let message = said("HostingKubeconfigRefused").await?;
    assert!(message.contains("`users[0].user.exec`"), "{message}");
    assert!(!std::path::Path::new("/tmp/capk-pwned").exists());
    // The namespace in the hosting cluster cannot change under running machines.
    let patch = json!({"spec": {"hostingCluster": {"namespace": "other"}}});
    let err = kcs
        .patch("demo", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("hostingCluster.namespace cannot be changed once set"),
        "{err}"
    );
    // Nothing was made anywhere meanwhile.
    assert!(
        Api::<Service>::namespaced(mc.clone(), ns)
            .get_opt("demo-apiserver")
            .await?
            .is_none()
    );
    Ok(())
}

/// A Secret in the hosting namespace that happens to have the Ignition Secret's name but is not
/// this machine's (another tenant's, anyone's) is never overwritten, nor deleted with the
/// machine: the machine reports it and waits.
#[tokio::test]
async fn an_unrelated_secret_with_the_ignition_secrets_name_is_left_alone() -> Result<()> {
    let (ns, hosted_ns) = ("hosting-foreign-secret", "foreign-secret");
    let hosting = hosting_as_admin(hosted_ns).await?;
    let hosted_secrets: Api<Secret> = Api::namespaced(hosting.admin.clone(), hosted_ns);
    let (pod_name, ignition_name) = (
        qualified("demo-cp-0", ns, ""),
        qualified("demo-cp-0", ns, "-ignition"),
    );
    let unrelated: Secret = serde_json::from_value(json!({
        "metadata": {"name": ignition_name},
        "stringData": {"value": "someone else's"},
    }))?;
    hosted_secrets
        .create(&PostParams::default(), &unrelated)
        .await?;
    let (mc, _stop, _kc) = controller_and_hosted_cluster(ns, &hosting, hosted_ns).await?;
    control_plane_machine(&mc, ns, "demo-cp-0", BOOTSTRAP).await?;
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(mc.clone(), ns);
    let ev = eventually(60, "a ForeignObject Warning", || async {
        let list = events.list(&ListParams::default()).await?;
        Ok(list.items.into_iter().find(|e| {
            e.reason.as_deref() == Some("ForeignObject")
                && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("demo-cp-0")
        }))
    })
    .await?;
    assert!(
        ev.note.unwrap_or_default().contains(&ignition_name),
        "the Event names the Secret"
    );
    let value = |s: &Secret| {
        s.data
            .as_ref()
            .and_then(|d| d.get("value"))
            .map(|v| v.0.clone())
    };
    let kept = hosted_secrets.get(&ignition_name).await?;
    assert_eq!(value(&kept), Some(b"someone else's".to_vec()));
    assert!(
        Api::<Pod>::namespaced(hosting.admin.clone(), hosted_ns)
            .get_opt(&pod_name)
            .await?
            .is_none(),
        "a machine Pod started on someone else's Secret"
    );

    // Deleting the machine leaves it too.
    let kms: Api<KVMMachine> = Api::namespaced(mc.clone(), ns);
    kms.delete("demo-cp-0", &DeleteParams::default()).await?;
    eventually(60, "the KVMMachine gone", || async {
        Ok(kms.get_opt("demo-cp-0").await?.is_none().then_some(()))
    })
    .await?;
    let kept = hosted_secrets.get(&ignition_name).await?;
    assert_eq!(value(&kept), Some(b"someone else's".to_vec()));
    Ok(())
}

fn secret_value(s: &Secret) -> Option<Vec<u8>> {
    s.data
        .as_ref()
        .and_then(|d| d.get("value"))
        .map(|v| v.0.clone())
}

/// Two management namespaces, each with a cluster `demo` and a machine `demo-cp-0`, host them in
/// one namespace of the hosting cluster: each gets its own machine Pod, Ignition Secret,
/// Service and EndpointSlice there, and both become Ready with their own apiserver (and only
/// it) behind their own Service. Someone's Secret of the name both Ignition Secrets would once
/// have had is never touched. One machine's deletion leaves the other's running.
#[tokio::test]
async fn same_named_clusters_of_two_namespaces_share_one_hosting_namespace() -> Result<()> {
    if !in_own_netns("same_named_clusters_of_two_namespaces_share_one_hosting_namespace")? {
        return Ok(());
    }
    let shared = "shared-tenants";
    let hosting = hosting_as_admin(shared).await?;
    let hosted_pods: Api<Pod> = Api::namespaced(hosting.admin.clone(), shared);
    let hosted_secrets: Api<Secret> = Api::namespaced(hosting.admin.clone(), shared);
    let hosted_services: Api<Service> = Api::namespaced(hosting.admin.clone(), shared);
    let hosted_slices: Api<EndpointSlice> = Api::namespaced(hosting.admin.clone(), shared);
    let unrelated: Secret = serde_json::from_value(json!({
        "metadata": {"name": "demo-cp-0-ignition"},
        "stringData": {"value": "someone else's"},
    }))?;
    hosted_secrets
        .create(&PostParams::default(), &unrelated)
        .await?;

    let mc = TestEnv::shared().client().await?;
    let tenants = [
        ("tenant-a", format!("{POD_NET}.31")),
        ("tenant-b", format!("{POD_NET}.32")),
    ];
    let mut running = Vec::new();
    for (ns, ip) in &tenants {
        create_namespace(&mc, ns).await?;
        let stop = start_controller(mc.clone(), ns);
        hosted_cluster(&mc, ns, "demo-hosting", &hosting.kubeconfig, Some(shared)).await?;
        control_plane_machine(&mc, ns, "demo-cp-0", BOOTSTRAP).await?;
        running.push((stop, StandInApiServer::start(ip).await?));
    }

    // Each its own Pod (found by its labels), mounting its own Ignition Secret.
    let mut pod_names = Vec::new();
    for (ns, ip) in &tenants {
        let selector = format!("{OWNER_NS_LABEL}={ns},{KVMMACHINE_LABEL}=demo-cp-0");
        let lp = ListParams::default().labels(&selector);
        let pod = eventually(60, &format!("{ns}'s machine Pod"), || async {
            Ok(hosted_pods.list(&lp).await?.items.pop())
        })
        .await?;
        let mounted = pod
            .spec
            .as_ref()
            .and_then(|s| s.volumes.as_ref())
            .and_then(|v| {
                v.iter()
                    .find_map(|v| v.secret.as_ref()?.secret_name.clone())
            })
            .context("the Ignition Secret volume")?;
        let secret = eventually(60, &format!("{ns}'s Ignition Secret"), || async {
            Ok(hosted_secrets.get_opt(&mounted).await?)
        })
        .await?;
        assert_eq!(
            labels_of(&secret.metadata).get(OWNER_NS_LABEL),
            Some(&ns.to_string()),
            "{ns}'s Pod mounts its own Secret"
        );
        run_pod(&hosted_pods, &pod.name_any(), ip).await?;
        pod_names.push(pod.name_any());
    }
    assert_ne!(pod_names[0], pod_names[1]);
    // Both Ready; each Service has its own apiserver as its only endpoint.
    let mut service_names = Vec::new();
    for (ns, ip) in &tenants {
        let kms: Api<KVMMachine> = Api::namespaced(mc.clone(), ns);
        eventually(60, &format!("{ns}'s KVMMachine Ready"), || async {
            let km = kms.get("demo-cp-0").await?;
            let ready = machine_condition(&km, "Ready")
                .is_some_and(|(s, r, _)| s == "True" && r == "VMRunning");
            Ok(ready.then_some(()))
        })
        .await?;
        let kcs: Api<KVMCluster> = Api::namespaced(mc.clone(), ns);
        let kc = eventually(
            60,
            &format!("{ns}'s apiserver behind its Service"),
            || async {
                let kc = kcs.get("demo").await?;
                let answering = cluster_condition(&kc, "ControlPlaneEndpointsReady")
                    .is_some_and(|(s, r, _)| s == "True" && r == "APIServersAnswering");
                Ok(answering.then_some(kc))
            },
        )
        .await?;
        assert_eq!(
            kc.status.as_ref().and_then(|s| s.contract.ready),
            Some(true)
        );
        // The endpoint the workload cluster is made with: its Service there.
        let host = kc
            .spec
            .control_plane_endpoint
            .as_ref()
            .and_then(|e| e.host.clone())
            .context("controlPlaneEndpoint")?;
        let svc_name = host
            .strip_suffix(&format!(".{shared}.svc.cluster.local"))
            .with_context(|| format!("{host} is not a Service in {shared}"))?
            .to_owned();
        let svc = hosted_services.get(&svc_name).await?;
        assert_eq!(labels_of(&svc.metadata)[OWNER_NS_LABEL], *ns);
        let slice = hosted_slices.get(&svc_name).await?;
        let addresses: Vec<String> = slice
            .endpoints
            .iter()
            .flat_map(|e| e.addresses.clone())
            .collect();
        assert_eq!(addresses, vec![ip.clone()], "{ns}'s apiserver only");
        service_names.push(svc_name);
    }
    assert_ne!(service_names[0], service_names[1]);
    // As named: `<name>-<hash of the namespace>`.
    for (i, (ns, _)) in tenants.iter().enumerate() {
        assert_eq!(pod_names[i], qualified("demo-cp-0", ns, ""));
        assert_eq!(service_names[i], qualified("demo", ns, "-apiserver"));
    }
    // Nothing under the bare names.
    assert!(hosted_pods.get_opt("demo-cp-0").await?.is_none());
    assert!(hosted_services.get_opt("demo-apiserver").await?.is_none());
    let kept = hosted_secrets.get("demo-cp-0-ignition").await?;
    assert_eq!(secret_value(&kept), Some(b"someone else's".to_vec()));
    assert_eq!(kept.metadata.labels, None, "not adopted either");

    // Tenant A's machine goes (the test confirms its Pod's deletion, as a kubelet would): its
    // objects go, tenant B's and the unrelated Secret stay.
    let a = tenants[0].0;
    let (a_pod, b_pod) = (&pod_names[0], &pod_names[1]);
    let b_uid = hosted_pods.get(b_pod).await?.uid();
    let a_kms: Api<KVMMachine> = Api::namespaced(mc.clone(), a);
    a_kms.delete("demo-cp-0", &DeleteParams::default()).await?;
    eventually(30, "tenant A's machine Pod being deleted", || async {
        let pod = hosted_pods.get_opt(a_pod).await?;
        Ok(pod
            .is_none_or(|p| p.metadata.deletion_timestamp.is_some())
            .then_some(()))
    })
    .await?;
    let now = DeleteParams {
        grace_period_seconds: Some(0),
        ..Default::default()
    };
    let _ = hosted_pods.delete(a_pod, &now).await;
    eventually(60, "tenant A's machine gone", || async {
        let gone = a_kms.get_opt("demo-cp-0").await?.is_none()
            && hosted_secrets
                .get_opt(&format!("{a_pod}-ignition"))
                .await?
                .is_none();
        Ok(gone.then_some(()))
    })
    .await?;
    let b_now = hosted_pods.get(b_pod).await?;
    assert_eq!(b_now.uid(), b_uid, "tenant B's VM runs on");
    assert!(b_now.metadata.deletion_timestamp.is_none());
    assert!(
        hosted_secrets
            .get_opt(&format!("{b_pod}-ignition"))
            .await?
            .is_some()
    );
    let kept = hosted_secrets.get("demo-cp-0-ignition").await?;
    assert_eq!(secret_value(&kept), Some(b"someone else's".to_vec()));
    Ok(())
}
