//! The pivot journey (`make e2e-move`): a workload cluster is made on the local
//! management cluster (MC1), its machines in MC1's machine namespace ([`MACHINE_NS`]), then
//! switched to an explicit hosting cluster that is MC1 itself, in that same namespace (its objects
//! kept, not made again), then moved by the real `clusterctl move` to a second management cluster
//! (MC2) that reaches MC1 through the hosting kubeconfig Secret. The VMs stay in MC1 all along and
//! must see nothing: the same Pods (UIDs), no launcher restart, the same guest boot id. Then MC2
//! rebuilds every status from the world, scales the workers and deletes the cluster, and MC1's
//! controller has touched nothing.
//!
//! The control plane is a real node (the node-image flavor, as in the workload journey):
//! `clusterctl move` refuses a cluster whose control plane is not initialized or whose Machines
//! have no Node, which the stub guest never gives. The worker added after the move is the stub
//! guest (its own bootstrap Secret, [`prepare_workers`]): a real one would add nothing here but
//! a quarter of an hour.

use std::collections::BTreeMap;

use capk_api::constants::{
    CONDITION_HOSTING_CLUSTER_AVAILABLE, HOSTING_KUBECONFIG_KEY, MANAGED_BY, MOVE_LABEL,
    NODE_READY_GATE, OWNER_UID_LABEL, provider_id,
};
use k8s_openapi::jiff::Timestamp;

use super::{
    workload::{
        Workload, apply_workload_cluster, assert_no_etcd_data_left, dev_node_image, dev_setting,
        map_yaml_docs, node_ready_timeout, ready_nodes,
    },
    *,
};

/// The hosting kubeconfig Secret, beside the KVMCluster (in MC1, then moved to MC2).
const HOSTING_SECRET: &str = "e2e-hosting";
/// MC1's apiserver as every Pod of both clusters reaches it (its serving certificate names it).
const MC1_APISERVER: &str = "https://10.240.0.1:6443";
/// `HostingClusterAvailable`'s reason for a hosting cluster in use (controller/src/remote/hosting.rs,
/// `REASON_CONNECTED`).
const CONNECTED: &str = "HostingClusterConnected";
/// The Normal Events the controller publishes on a KVMMachine when it takes over an existing
/// machine Pod, or makes one (controller/src/kvmmachine/mod.rs).
const POD_ADOPTED: &str = "MachinePodAdopted";
const POD_CREATED: &str = "MachinePodCreated";
/// What `clusterctl move` takes from the source: none of it may stay.
const MOVED_KINDS: [&str; 9] = [
    "clusters",
    "machines",
    "machinesets",
    "machinedeployments",
    "kubeadmcontrolplanes",
    "kubeadmconfigs",
    "kvmclusters",
    "kvmmachines",
    "kvmmachinetemplates",
];

/// What the VMs are, as MC1 and the workload cluster show them. Nothing that happens to the
/// Cluster API objects may change it.
#[derive(Debug)]
struct Vms {
    /// Machine Pod name -> (UID, launcher restarts).
    pods: BTreeMap<String, (String, i64)>,
    /// Node name -> boot id (the guest's).
    boot_ids: BTreeMap<String, String>,
}

impl Vms {
    fn read(mc1: &E2e, w: &Workload) -> Result<Self> {
        Ok(Self {
            pods: machine_pods(mc1)?,
            boot_ids: boot_ids(w, mc1)?,
        })
    }
}

pub(super) fn move_journey(mc1: &E2e) -> Result<()> {
    let mut mc2 = E2e::for_dev_dir("dev-mc2", "make e2e-move")?;
    // MC2's diagnostics go beside MC1's.
    mc2.out = mc1.out.join("mc2");
    collect_on_failure(&mc2, || journey(mc1, &mc2))
}

fn journey(mc1: &E2e, mc2: &E2e) -> Result<()> {
    let started = Instant::now();
    fresh_namespaces(mc1, mc2)?;
    let (cp, w) = create_movable_cluster(mc1)?;
    let hosting_ns = switch_to_explicit_hosting(mc1, &w, &cp)?;

    // --- 3. what the VMs are before the move ----------------------------------------------------
    let vms = wait(
        "machine Pods and Node boot ids",
        Duration::from_secs(120),
        || Vms::read(mc1, &w).map(Some),
    )?;
    let hosted = hosted_objects(mc1)?;
    let endpoint =
        mc1.json(&["-n", ns(), "get", "kvmcluster", CLUSTER])?["spec"]["controlPlaneEndpoint"]
            .clone();
    eprintln!(
        "e2e: move: 3. before the move: Pods {:?}, boot ids {:?}, {} objects of the controller in MC1",
        vms.pods,
        vms.boot_ids,
        hosted.len()
    );

    let from = clusterctl_move(mc1, mc2)?;
    source_left_alone(mc1, &vms, &hosted, from)?;
    target_rebuilt(mc1, mc2, &cp, &endpoint, from)?;
    vms_unchanged_for(mc1, &w, &vms, Duration::from_secs(60))?;
    scale_from_target(mc1, mc2, &vms)?;
    delete_from_target(mc1, mc2, &hosting_ns)?;
    eprintln!(
        "e2e: move: journey done in {:.0}s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Step 0: nothing of an earlier run on either cluster. Clusters first, MC2's before MC1's: the
/// machines of one on MC2 are in MC1, reached with the credential of the hosting ServiceAccount
/// in MC1's machine namespace ([`hosting_rbac`]), which must outlive it.
fn fresh_namespaces(mc1: &E2e, mc2: &E2e) -> Result<()> {
    let both = [("MC2", mc2), ("MC1", mc1)];
    for (which, mc) in both {
        if mc.kubectl(&["-n", ns(), "get", "cluster", CLUSTER]).is_ok() {
            eprintln!("e2e: move: 0. deleting Cluster {CLUSTER} left in {which} by an earlier run");
            // A move that stopped half-way leaves it paused, and a paused Cluster's machines
            // are never deleted.
            set_paused(mc, false)?;
            mc.kubectl(&["-n", ns(), "delete", "cluster", CLUSTER, "--timeout=600s"])
                .with_context(|| {
                    format!("deleting the Cluster left in {which} (machines in MC1's namespace)")
                })?;
        }
    }
    for (which, mc) in both {
        if mc.kubectl(&["get", "namespace", ns()]).is_ok() {
            eprintln!("e2e: move: 0. deleting {} left in {which}", ns());
            mc.kubectl(&["delete", "namespace", ns(), "--timeout=300s"])?;
        }
        create_tenant_namespace(mc)?;
    }
    Ok(())
}

/// Step 1: on MC1, a cluster `clusterctl move` accepts: a real control plane (its Node Ready, so
/// its machine Pod's readiness gate is True), no workers yet; the workers' template is the stub
/// guest, as small as a machine may be, with its own bootstrap Secret labelled for the move.
fn create_movable_cluster(mc1: &E2e) -> Result<(String, Workload)> {
    let node_image = dev_node_image()?;
    let guest = dev_setting(
        "images.env",
        "CAPK_TEST_GUEST_IMAGE",
        "the local MC's images are not built; run `make dev-up`",
    )?;
    let (cp, created) = apply_workload_cluster(mc1, &node_image, |worker| {
        worker["resources"] = serde_yaml_ng::to_value(
            json!({"cpu": 1, "memory": "256Mi", "disk": "1Gi", "dockerVolumeSize": "1Gi"}),
        )?;
        worker["image"] = serde_yaml_ng::to_value(json!({"containerImage": {"image": guest}}))?;
        Ok(())
    })?;
    prepare_workers(mc1)?;
    let w = Workload::fetch(mc1)?;
    wait("control-plane Node Ready", node_ready_timeout(), || {
        Ok(ready_nodes(&w, mc1)?.contains(&cp).then_some(()))
    })?;
    // What clusterctl move checks before it moves anything (mover.go, checkProvisioningCompleted).
    wait(
        "Cluster's control plane initialized and the control plane's Machine with its nodeRef",
        Duration::from_secs(600),
        || {
            let c = mc1.json(&["-n", ns(), "get", "cluster", CLUSTER])?;
            let init = &c["status"]["initialization"];
            if !(condition_true(&c, "ControlPlaneInitialized")
                && init["controlPlaneInitialized"] == true
                && init["infrastructureProvisioned"] == true)
            {
                return Err(anyhow!(
                    "Cluster initialization {init}, conditions {}",
                    c["status"]["conditions"]
                ));
            }
            let m = control_plane_machine(mc1)?;
            Ok((m["status"]["nodeRef"]["name"] == cp.as_str()).then_some(()))
        },
    )?;
    wait(
        "the control plane's readiness gate True",
        Duration::from_secs(120),
        || {
            let p = machine_pod(mc1, &cp)?;
            Ok(condition_true(&p, NODE_READY_GATE).then_some(()))
        },
    )?;
    eprintln!(
        "e2e: move: 1. control plane {cp} ready to move (Node Ready, nodeRef) {:.0}s after apply",
        created.elapsed().as_secs_f64()
    );
    Ok((cp, w))
}

/// The control plane's Machine (one).
fn control_plane_machine(e: &E2e) -> Result<Value> {
    let mut ms = e.items(
        "machines",
        Some("cluster.x-k8s.io/cluster-name=e2e,cluster.x-k8s.io/control-plane"),
    )?;
    match ms.len() {
        1 => Ok(ms.remove(0)),
        n => bail!("{n} control-plane Machines"),
    }
}

/// Step 2: the KVMCluster names MC1 itself as its hosting cluster, in the namespace its machines
/// already live in (its `status.machineNamespace`), through a kubeconfig for the released hosting
/// RBAC there: the controller keeps what it made (labels naming its owner, no owner references),
/// makes nothing again, and the VM runs on. Returns the hosting namespace.
fn switch_to_explicit_hosting(mc1: &E2e, w: &Workload, cp: &str) -> Result<String> {
    let started = Instant::now();
    let kc = mc1.json(&["-n", ns(), "get", "kvmcluster", CLUSTER])?;
    let hosting_ns = kc["status"]["machineNamespace"]
        .as_str()
        .filter(|n| !n.is_empty())
        .with_context(|| {
            format!(
                "the KVMCluster records no machine namespace: status {}",
                kc["status"]
            )
        })?
        .to_owned();
    assert_eq!(
        hosting_ns, MACHINE_NS,
        "the KVMCluster's machine namespace is not the local MC's"
    );
    let pods_before = machine_pods(mc1)?;
    let pod_before = machine_pod(mc1, cp)?;
    let boot_before = wait(
        "the control plane's boot id",
        Duration::from_secs(120),
        || boot_ids(w, mc1).map(Some),
    )?;

    mc1.kubectl_in(&["apply", "-f", "-"], &hosting_rbac(mc1, &hosting_ns)?)?;
    let token_secret = format!("{hosting_ns}-token");
    let (token, ca) = wait(
        "the hosting ServiceAccount's token",
        Duration::from_secs(120),
        || {
            let s = mc1.json(&["-n", &hosting_ns, "get", "secret", &token_secret])?;
            let data = &s["data"];
            Ok(data["token"]
                .as_str()
                .zip(data["ca.crt"].as_str())
                .map(|(t, c)| (t.to_owned(), c.to_owned())))
        },
    )?;
    let token = String::from_utf8(base64::Engine::decode(
        &base64::engine::general_purpose::STANDARD,
        token,
    )?)?;
    // Inline credentials only: the controller refuses files and exec.
    let kubeconfig = json!({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "mc1", "cluster": {"server": MC1_APISERVER, "certificate-authority-data": ca}}],
        "users": [{"name": "capk-hosting", "user": {"token": token}}],
        "contexts": [{"name": "mc1", "context": {"cluster": "mc1", "user": "capk-hosting", "namespace": hosting_ns}}],
        "current-context": "mc1",
    });
    let secret = json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": HOSTING_SECRET, "namespace": ns(), "labels": {MOVE_LABEL: ""}},
        "stringData": {HOSTING_KUBECONFIG_KEY: serde_yaml_ng::to_string(&kubeconfig)?},
    });
    // create, not apply: apply would keep the token in its last-applied annotation.
    mc1.kubectl_in(&["create", "-f", "-"], &secret.to_string())?;
    let switched = Timestamp::now();
    let patch = json!({"spec": {"hostingCluster": {
        "kubeconfigSecretRef": {"name": HOSTING_SECRET}, "namespace": hosting_ns}}});
    mc1.kubectl(&[
        "-n",
        ns(),
        "patch",
        "kvmcluster",
        CLUSTER,
        "--type",
        "merge",
        "-p",
        &patch.to_string(),
    ])?;

    wait(
        "KVMCluster and KVMMachine: HostingClusterAvailable True, HostingClusterConnected",
        Duration::from_secs(120),
        || {
            let kc = mc1.json(&["-n", ns(), "get", "kvmcluster", CLUSTER])?;
            let km = mc1.json(&["-n", ns(), "get", "kvmmachine", cp])?;
            Ok((hosting_connected(&kc) && hosting_connected(&km)).then_some(()))
        },
    )?;
    // Owner references would let the garbage collector delete them with the source's copies at
    // the move, and would make clusterctl move take the Ignition Secret along.
    wait(
        "everything the controller made in MC1 adopted: labels naming its owner, no owner references to it",
        Duration::from_secs(120),
        || nothing_left(not_adopted(mc1)?),
    )?;
    // The machines were in the hosting namespace already: nothing is made again there.
    assert!(
        !has_event(mc1, POD_CREATED, cp, switched)?,
        "the controller created a machine Pod for {cp} when the cluster named its hosting cluster"
    );
    let at = MachinePod::of(mc1, cp)?;
    assert_eq!(
        at.namespace, hosting_ns,
        "KVMMachine {cp}'s status.podNamespace"
    );
    let pod = at.get(mc1)?;
    assert_eq!(
        uid(&pod),
        uid(&pod_before),
        "the control plane's machine Pod was replaced, not kept"
    );
    assert!(
        pod["metadata"]["ownerReferences"]
            .as_array()
            .is_none_or(Vec::is_empty),
        "the hosted Pod has owner references: {}",
        pod["metadata"]["ownerReferences"]
    );
    assert_eq!(
        launcher_restarts(&pod),
        launcher_restarts(&pod_before),
        "the launcher restarted when the cluster named its hosting cluster"
    );
    assert_eq!(
        machine_pods(mc1)?,
        pods_before,
        "machine Pods in {hosting_ns} (UID, launcher restarts) changed when the cluster named its hosting cluster"
    );
    assert_eq!(
        boot_ids(w, mc1)?,
        boot_before,
        "the guest rebooted when the cluster named its hosting cluster"
    );
    eprintln!(
        "e2e: move: 2. switched to MC1 as an explicit hosting cluster, namespace {hosting_ns}: {cp} kept, VM untouched ({:.0}s)",
        started.elapsed().as_secs_f64()
    );
    Ok(hosting_ns)
}

/// The released hosting RBAC (manifests/hosting/hosting-rbac.yaml) for `namespace` of MC1
/// ("replace capk-hosting throughout", says the file), without its Namespace: MC1's machine
/// namespace exists.
fn hosting_rbac(mc1: &E2e, namespace: &str) -> Result<String> {
    let rbac = std::fs::read_to_string(mc1.root.join("manifests/hosting/hosting-rbac.yaml"))?
        .replace("capk-hosting", namespace);
    map_yaml_docs(&rbac, |d| {
        Ok((!d.is_null() && d["kind"] != "Namespace").then_some(d))
    })
}

fn hosting_connected(o: &Value) -> bool {
    condition(o, CONDITION_HOSTING_CLUSTER_AVAILABLE)
        .is_some_and(|c| c["status"] == "True" && c["reason"] == CONNECTED)
}

/// The machine Pods in MC1's machine namespace: name -> (UID, launcher restarts).
fn machine_pods(mc1: &E2e) -> Result<BTreeMap<String, (String, i64)>> {
    Ok(mc1
        .machine_items("pods", Some(OWNED))?
        .iter()
        .map(|p| {
            (
                name(p).to_owned(),
                (uid(p).to_owned(), launcher_restarts(p)),
            )
        })
        .collect())
}

/// Every workload Node's boot id (`status.nodeInfo.bootID`: the guest's).
fn boot_ids(w: &Workload, mc1: &E2e) -> Result<BTreeMap<String, String>> {
    w.items(mc1, &["get", "nodes"])?
        .iter()
        .map(|n| {
            let id = n["status"]["nodeInfo"]["bootID"]
                .as_str()
                .filter(|b| !b.is_empty())
                .with_context(|| format!("Node {} reports no bootID", name(n)))?;
            Ok((name(n).to_owned(), id.to_owned()))
        })
        .collect()
}

/// The controller's objects in MC1 that an owner reference still ties to a KVMMachine or
/// KVMCluster, or whose labels do not name their owner (the namespace, by which they are found,
/// and the KVMMachine's or KVMCluster's name); and any left in the test namespace.
fn not_adopted(mc1: &E2e) -> Result<Vec<String>> {
    let mut out = Vec::new();
    for kind in HOSTED_KINDS {
        for o in mc1.machine_items(kind, Some(OWNED))? {
            let referenced = o["metadata"]["ownerReferences"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|r| r["kind"] == "KVMMachine" || r["kind"] == "KVMCluster");
            let labels = &o["metadata"]["labels"];
            let named =
                labels[KVMMACHINE_LABEL].is_string() || labels[KVMCLUSTER_LABEL].is_string();
            if referenced || !named {
                out.push(format!("{MACHINE_NS}/{kind}/{}", name(&o)));
            }
        }
        for o in mc1.items(kind, Some(OWNED))? {
            out.push(format!("{}/{kind}/{}", ns(), name(&o)));
        }
    }
    Ok(out)
}

/// The Events capk-controller published in the namespace (kube-rs' Recorder writes
/// events.k8s.io Events, `reportingComponent` in their core/v1 form).
fn controller_events(e: &E2e) -> Result<Vec<Value>> {
    Ok(e.items("events", None)?
        .into_iter()
        .filter(|ev| {
            ev["reportingComponent"] == MANAGED_BY
                || ev["reportingController"] == MANAGED_BY
                || ev["source"]["component"] == MANAGED_BY
        })
        .collect())
}

/// What an Event is about (`involvedObject` in core/v1, `regarding` in events.k8s.io).
fn event_object(ev: &Value) -> &str {
    ev["involvedObject"]["name"]
        .as_str()
        .or(ev["regarding"]["name"].as_str())
        .unwrap_or_default()
}

/// When an Event was last stamped: a series' last observation, else its own time.
fn event_time(ev: &Value) -> Option<Timestamp> {
    [
        &ev["series"]["lastObservedTime"],
        &ev["eventTime"],
        &ev["lastTimestamp"],
        &ev["firstTimestamp"],
    ]
    .into_iter()
    .filter_map(|t| t.as_str()?.parse::<Timestamp>().ok())
    .max()
}

/// Whether capk-controller published an Event `reason` about `object` in the namespace, last at
/// or after `since`.
fn has_event(e: &E2e, reason: &str, object: &str, since: Timestamp) -> Result<bool> {
    Ok(controller_events(e)?.iter().any(|ev| {
        ev["reason"] == reason
            && event_object(ev) == object
            && event_time(ev).is_some_and(|t| t >= since)
    }))
}

/// For [`wait`]: done when nothing is `left`, else an error that names it.
fn nothing_left(left: Vec<String>) -> Result<Option<()>> {
    if left.is_empty() {
        Ok(Some(()))
    } else {
        Err(anyhow!("left: {left:?}"))
    }
}

/// What `clusterctl move -v 1` says right before it sets `spec.paused` on the source's Cluster
/// (cmd/clusterctl/client/cluster/mover.go); from then on the source's controller must act no
/// more.
const PAUSING: &str = "Pausing the source cluster";

/// Step 4: the real `clusterctl move`, as a user runs it (with `-v 1`); returns when it paused
/// the source's Cluster, as its output said it would while it ran. That is the start of "MC1's
/// controller published nothing": before it, during clusterctl's discovery, the emulated control
/// plane's health may still change and be reported, as it should.
fn clusterctl_move(mc1: &E2e, mc2: &E2e) -> Result<Timestamp> {
    use std::io::{BufRead, BufReader, Read};
    let mut cmd = Command::new(mc1.bin("clusterctl"));
    cmd.args(["move", "-v", "1", "--namespace", ns(), "--to-kubeconfig"])
        .arg(&mc2.kubeconfig)
        .arg("--config")
        .arg(&mc1.clusterctl_config)
        .arg("--kubeconfig")
        .arg(&mc1.kubeconfig)
        .env("CLUSTERCTL_DISABLE_VERSIONCHECK", "true")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let started = Instant::now();
    let mut child = cmd.spawn().context("spawn clusterctl move")?;
    let paused_at = std::sync::Arc::new(std::sync::Mutex::new(None::<Timestamp>));
    let streams: Vec<Box<dyn Read + Send>> = vec![
        Box::new(child.stdout.take().context("stdout")?),
        Box::new(child.stderr.take().context("stderr")?),
    ];
    let readers: Vec<_> = streams
        .into_iter()
        .map(|stream| {
            let paused_at = paused_at.clone();
            std::thread::spawn(move || {
                let mut said = String::new();
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    if line.contains(PAUSING) {
                        let mut at = paused_at.lock().unwrap_or_else(|p| p.into_inner());
                        at.get_or_insert_with(Timestamp::now);
                    }
                    said.push_str(&line);
                    said.push('\n');
                }
                said
            })
        })
        .collect();
    let status = child.wait().context("wait for clusterctl move")?;
    let said: String = readers
        .into_iter()
        .map(|r| r.join().unwrap_or_default())
        .collect();
    std::fs::create_dir_all(&mc1.out)?;
    std::fs::write(mc1.out.join("clusterctl-move.log"), &said)?;
    if !status.success() {
        bail!("clusterctl move failed ({status}):\n{said}");
    }
    let paused = paused_at
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .with_context(|| format!("clusterctl move never said {PAUSING:?}:\n{said}"))?;
    eprintln!(
        "e2e: move: 4. clusterctl move MC1 -> MC2 took {:.1}s",
        started.elapsed().as_secs_f64()
    );
    Ok(paused)
}

/// Step 5: MC1 keeps none of the Cluster API objects, but every VM and everything the controller
/// made for them, untouched; its controller published nothing since the Cluster was paused for
/// the move (clusterctl deletes the source's objects only after pausing them, and a paused
/// cluster is left alone, also when its objects vanish under a reconcile).
fn source_left_alone(
    mc1: &E2e,
    vms: &Vms,
    hosted: &BTreeMap<String, String>,
    from: Timestamp,
) -> Result<()> {
    wait(
        "MC1 holds no Cluster API object of the cluster",
        Duration::from_secs(60),
        || {
            let mut left = Vec::new();
            for kind in MOVED_KINDS {
                for o in mc1.items(kind, None)? {
                    left.push(format!("{kind}/{}", name(&o)));
                }
            }
            for secret in [
                HOSTING_SECRET,
                WORKER_BOOTSTRAP,
                &format!("{CLUSTER}-kubeconfig"),
            ] {
                if mc1.kubectl(&["-n", ns(), "get", "secret", secret]).is_ok() {
                    left.push(format!("secrets/{secret}"));
                }
            }
            nothing_left(left)
        },
    )?;
    assert_eq!(
        machine_pods(mc1)?,
        vms.pods,
        "machine Pods in MC1 (UID, launcher restarts) changed across the move"
    );
    assert_eq!(
        &hosted_objects(mc1)?,
        hosted,
        "the controller's objects in MC1 (kind/name -> UID) changed across the move"
    );
    let acted: Vec<String> = controller_events(mc1)?
        .iter()
        .filter_map(|ev| {
            let t = event_time(ev)?;
            (t >= from).then(|| {
                format!(
                    "{t} {} {}: {}",
                    ev["reason"],
                    event_object(ev),
                    ev["message"]
                )
            })
        })
        .collect();
    assert!(
        acted.is_empty(),
        "MC1's controller published Events after clusterctl paused the cluster ({from}): {acted:#?}"
    );
    eprintln!(
        "e2e: move: 5. MC1: no Cluster API object left, {} machine Pods and {} objects of the controller untouched, no Event of its controller since clusterctl paused the cluster",
        vms.pods.len(),
        hosted.len()
    );
    Ok(())
}

/// Step 6: MC2's controller finds the world as it is (`clusterctl move` copies no status): the
/// KVMCluster provisioned and connected to MC1, the control plane's apiserver answering, the
/// KVMMachine Ready with the conditions of a running machine, its Pod adopted (not made again)
/// and its readiness gate True; Cluster API gives the Machine its nodeRef again.
fn target_rebuilt(
    mc1: &E2e,
    mc2: &E2e,
    cp: &str,
    endpoint: &Value,
    moved: Timestamp,
) -> Result<()> {
    let started = Instant::now();
    let kc = wait(
        "MC2's KVMCluster provisioned, connected to MC1, its control plane answering",
        Duration::from_secs(300),
        || {
            let kc = mc2.json(&["-n", ns(), "get", "kvmcluster", CLUSTER])?;
            let rebuilt = kc["status"]["initialization"]["provisioned"] == true
                && condition_true(&kc, "Ready")
                && hosting_connected(&kc)
                && condition_true(&kc, "ControlPlaneEndpointsReady")
                && !condition_true(&kc, "Paused");
            if rebuilt {
                Ok(Some(kc))
            } else {
                Err(anyhow!("KVMCluster status {}", kc["status"]))
            }
        },
    )?;
    assert_eq!(
        kc["spec"]["controlPlaneEndpoint"], *endpoint,
        "the control-plane endpoint changed"
    );
    let km = wait(
        "MC2's KVMMachine Ready with the conditions of a running machine",
        Duration::from_secs(300),
        || {
            let km = mc2.json(&["-n", ns(), "get", "kvmmachine", cp])?;
            let not_true: Vec<&str> = [
                "Ready",
                "PodScheduled",
                "VMRunning",
                "BootstrapCompleted",
                "NodeReady",
            ]
            .into_iter()
            .filter(|t| !condition_true(&km, t))
            .collect();
            if not_true.is_empty()
                && hosting_connected(&km)
                && km["status"]["initialization"]["provisioned"] == true
            {
                Ok(Some(km))
            } else {
                Err(anyhow!(
                    "not True: {not_true:?}; provisioned {}; conditions {}",
                    km["status"]["initialization"]["provisioned"],
                    km["status"]["conditions"]
                ))
            }
        },
    )?;
    let ready = condition(&km, "Ready").context("Ready")?;
    assert_eq!(
        ready["reason"], "VMRunning",
        "KVMMachine {cp} Ready: {ready}"
    );
    assert_eq!(
        km["spec"]["providerID"],
        provider_id(ns(), cp).as_str(),
        "KVMMachine {cp} providerID"
    );
    // Where MC2's KVMMachine says its Pod is: MC1's hosting namespace.
    let pod = MachinePod::of(mc2, cp)?.get(mc1)?;
    let internal_ip = km["status"]["addresses"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|a| a["type"] == "InternalIP")
        .map(|a| a["address"].clone());
    assert_eq!(
        internal_ip.as_ref(),
        Some(&pod["status"]["podIP"]),
        "KVMMachine {cp}'s InternalIP is not its Pod's (the VM's) IP"
    );
    // The Pod is MC2's KVMMachine's now (its UID in the labels), adopted rather than made.
    assert_eq!(
        pod["metadata"]["labels"][OWNER_UID_LABEL],
        uid(&km),
        "the machine Pod's labels do not name MC2's KVMMachine"
    );
    assert!(
        has_event(mc2, POD_ADOPTED, cp, moved)?,
        "no {POD_ADOPTED} Event on MC2's KVMMachine {cp}"
    );
    assert!(
        !has_event(mc2, POD_CREATED, cp, moved)?,
        "MC2's controller created a machine Pod for {cp}"
    );
    let gate = wait(
        "the control plane's readiness gate still True",
        Duration::from_secs(120),
        || {
            let p = MachinePod::of(mc2, cp)?.get(mc1)?;
            Ok(condition(&p, NODE_READY_GATE)
                .filter(|c| c["status"] == "True")
                .cloned())
        },
    )?;
    let machine = wait(
        "MC2's control-plane Machine has its nodeRef again",
        Duration::from_secs(600),
        || {
            let m = control_plane_machine(mc2)?;
            Ok((m["status"]["nodeRef"]["name"] == cp).then_some(m))
        },
    )?;
    assert_eq!(
        machine["spec"]["providerID"], km["spec"]["providerID"],
        "the Machine and the KVMMachine disagree on the provider ID"
    );
    wait(
        "MC2's Cluster: infrastructure provisioned, control plane initialized",
        Duration::from_secs(600),
        || {
            let c = mc2.json(&["-n", ns(), "get", "cluster", CLUSTER])?;
            let init = &c["status"]["initialization"];
            Ok((init["infrastructureProvisioned"] == true
                && init["controlPlaneInitialized"] == true)
                .then_some(()))
        },
    )?;
    eprintln!(
        "e2e: move: 6. MC2 rebuilt every status from the world in {:.0}s (Pod adopted, readiness gate: {})",
        started.elapsed().as_secs_f64(),
        gate["message"]
    );
    Ok(())
}

/// Step 6, continued: for `how_long`, the VMs are what they were before the move. A boot id that
/// cannot be read now and then (the emulated apiserver is slow) is read again; one that differs
/// fails at once.
fn vms_unchanged_for(mc1: &E2e, w: &Workload, before: &Vms, how_long: Duration) -> Result<()> {
    let start = Instant::now();
    let (mut reads, mut last_error) = (0, None);
    while start.elapsed() < how_long {
        assert_eq!(
            machine_pods(mc1)?,
            before.pods,
            "machine Pods (UID, launcher restarts) changed after the move"
        );
        match boot_ids(w, mc1) {
            Ok(ids) => {
                assert_eq!(ids, before.boot_ids, "a guest rebooted after the move");
                reads += 1;
            }
            Err(e) => last_error = Some(e),
        }
        sleep(Duration::from_secs(5));
    }
    if reads == 0 {
        bail!("no boot id read in {how_long:?}; last error: {last_error:?}");
    }
    eprintln!(
        "e2e: move: 6. {how_long:?} after: the same Pods, no launcher restart, the same boot ids ({reads} reads)"
    );
    Ok(())
}

/// Step 7: the workers from MC2: the bootstrap Secret came with the move (its label), a new
/// worker's Pod runs in MC1 with no owner reference, and scaling back removes it, its Ignition
/// Secret and PVCs from MC1. The control plane's Pod is left as it was.
fn scale_from_target(mc1: &E2e, mc2: &E2e, vms: &Vms) -> Result<()> {
    let started = Instant::now();
    mc2.kubectl(&["-n", ns(), "get", "secret", WORKER_BOOTSTRAP])
        .context("the workers' bootstrap Secret did not come with the move (its clusterctl.cluster.x-k8s.io/move label)")?;
    scale_machine_deployment(mc2, 1)?;
    let workers = wait_workers_in(mc2, mc1, 1)?;
    let pod = MachinePod::of(mc2, &workers[0])?.get(mc1)?;
    assert!(
        pod["metadata"]["ownerReferences"]
            .as_array()
            .is_none_or(Vec::is_empty),
        "a machine Pod in the hosting cluster has owner references: {}",
        pod["metadata"]["ownerReferences"]
    );
    assert_eq!(
        pod["metadata"]["labels"][OWNER_NAMESPACE_LABEL],
        ns(),
        "the worker's Pod does not name its KVMMachine's namespace"
    );
    eprintln!(
        "e2e: move: 7. scaled 0 -> 1 from MC2: {} runs in MC1 ({:.0}s)",
        workers[0],
        started.elapsed().as_secs_f64()
    );
    let started = Instant::now();
    scale_machine_deployment(mc2, 0)?;
    wait_workers_in(mc2, mc1, 0)?;
    assert_nothing_left_for(mc1, &workers)?;
    assert_eq!(
        machine_pods(mc1)?,
        vms.pods,
        "the control plane's machine Pod changed while the workers scaled"
    );
    eprintln!(
        "e2e: move: 7. scaled 1 -> 0 from MC2: {} gone from MC1 ({:.0}s)",
        workers[0],
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Step 8: deleting the Cluster on MC2 removes everything the controller made in MC1 (the etcd
/// data on the node included) and every KVM object in MC2. Then the hosting RBAC goes from MC1's
/// `hosting_ns`, which other clusters' machines share.
fn delete_from_target(mc1: &E2e, mc2: &E2e, hosting_ns: &str) -> Result<()> {
    let started = Instant::now();
    mc2.kubectl(&["-n", ns(), "delete", "cluster", CLUSTER, "--timeout=600s"])?;
    wait(
        "nothing of the controller's left in MC1, no KVM object in MC2",
        Duration::from_secs(120),
        || {
            let mut left: Vec<String> = hosted_objects(mc1)?
                .into_keys()
                .map(|k| format!("MC1 {MACHINE_NS}/{k}"))
                .collect();
            for kind in ["kvmclusters", "kvmmachines", "kvmmachinetemplates"] {
                for o in mc2.items(kind, None)? {
                    left.push(format!("MC2 {kind}/{}", name(&o)));
                }
            }
            nothing_left(left)
        },
    )?;
    assert_no_etcd_data_left();
    mc1.kubectl_in(
        &["delete", "--ignore-not-found", "-f", "-"],
        &hosting_rbac(mc1, hosting_ns)?,
    )?;
    for mc in [mc2, mc1] {
        mc.kubectl(&["delete", "namespace", ns(), "--timeout=300s"])?;
    }
    eprintln!(
        "e2e: move: 8. Cluster deleted from MC2 in {:.0}s: nothing left in MC1 or MC2",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
