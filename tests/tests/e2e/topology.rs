//! The ClusterClass journey (`make e2e-topology`, part of `make e2e-stub`
//! and `make e2e`): a Cluster of the ClusterClass `kvm` under Cluster API's real topology
//! controller, its control plane reachable from outside the management cluster through a
//! NodePort, and a changed class variable that rotates a KVMMachineTemplate and rolls a Machine.
//!
//! The machines boot the test guest, as in the stub journey ([`super`]): the local MC's default
//! node image (`CAPK_DEFAULT_NODE_IMAGE`), which the class uses when the Cluster sets no
//! `nodeImage`. What that means here, said plainly:
//! - `kubernetesSysext` is false: the guest runs upstream Ignition, which would download the
//!   Kubernetes sysext from the internet, and nothing leaves this machine.
//! - CABPK writes a worker's join data only after a real control plane initialised, which the
//!   guest's stand-in apiserver never is. The test stands in for it: each new worker Machine gets
//!   the workers' bootstrap Secret as `spec.bootstrap.dataSecretName`, which CABPK then takes as
//!   its KubeadmConfig's data (its path for Machines restored from a backup).
//! - The MachineDeployment topology skips the MachineSet preflight checks and rolls with
//!   `maxUnavailable: 1`, no surge: no Node registers, so a new Machine never becomes Available.
//! - KubeadmControlPlane rolls only a control plane whose workload cluster it reaches, so its
//!   template rotation is asserted and its machine stays.
//!
//! 0. The controller allows NodePort control-plane Services (the local MC's `clusterctl init`
//!    does, hack/dev/capi.sh) and the MC node's address is known; a fresh namespace.
//! 1. `clusterctl generate cluster --flavor topology` (clusterctl adds the ClusterClass and its
//!    templates) with `CONTROL_PLANE_SERVICE_TYPE=NodePort`, `CONTROL_PLANE_ENDPOINT_HOST` = the
//!    MC node's address and an allocated node port; one control plane, one worker, both up; the
//!    class's two MachineHealthChecks exist.
//! 2. The Service is a NodePort, the endpoint is `<node address>:<node port>`, `clusterctl get
//!    kubeconfig` names it as the server, and `/readyz` at that server, requested from the host
//!    (the node's address, not the MC's Service network), is answered by the guest's apiserver.
//! 3. `workerResources.memory` changed in `spec.topology.variables`: the MachineDeployment points
//!    at a new KVMMachineTemplate (the admission policy let the topology controller's dry run
//!    through) whose spec differs only in the memory, the old template is unchanged, and the
//!    worker is replaced by one with the new memory; nothing is left of the old one.
//! 4. `controlPlaneResources.memory` changed: the KubeadmControlPlane points at a new template,
//!    the old one is deleted by the topology controller, the control-plane machine is untouched.
//! 5. A direct edit of a KVMMachineTemplate's spec is refused with the admission policy's
//!    message, an edit of a running KVMMachine's spec with the CRD rule's.
//! 6. The Cluster is deleted; nothing the provider made is left.

use capk_api::v1alpha1::SPEC_IMMUTABLE_MESSAGE;

use super::{workload::map_yaml_docs, *};

/// The MachineDeployment topology of the topology flavor
/// (manifests/templates/cluster-template-topology.yaml).
const MD_TOPOLOGY: &str = "md-0";
/// What the admission policy answers to an edit of a KVMMachineTemplate's spec
/// (manifests/admission/immutable-templates.yaml).
const TEMPLATE_IMMUTABLE: &str = "KVMMachineTemplate spec is immutable";
/// Every machine's memory at first, and after its class variable changed.
const MEMORY: &str = "256Mi";
const NEW_MEMORY: &str = "320Mi";

pub(super) fn topology_journey(e: &E2e) -> Result<()> {
    // --- 0. NodePorts allowed, a fresh namespace -----------------------------------------------------
    let node_ip = node_port_host(e)?;
    fresh_namespace(e)?;

    // --- 1. a Cluster of the class -------------------------------------------------------------------
    let (cp, worker) = create_topology_cluster(e, &node_ip)?;

    // --- 2. reachable from the host through the NodePort ---------------------------------------------
    reachable_through_node_port(e, &node_ip, &cp)?;

    // --- 3. a worker variable changed: template rotated, worker rolled -------------------------------
    let worker = rotate_workers(e, &cp, &worker)?;

    // --- 4. a control-plane variable changed: template rotated ---------------------------------------
    rotate_control_plane_template(e, &cp)?;

    // --- 5. direct edits refused ---------------------------------------------------------------------
    let template = machine_deployment_template(e)?;
    let template_spec = kvm_machine_template_spec(e, &template)?;
    refused(
        e,
        "kvmmachinetemplate",
        &template,
        &json!({"spec": {"template": {"spec": {"resources": {"memory": "512Mi"}}}}}),
        TEMPLATE_IMMUTABLE,
    );
    assert_eq!(kvm_machine_template_spec(e, &template)?, template_spec);
    refused(
        e,
        "kvmmachine",
        &worker,
        &json!({"spec": {"resources": {"memory": "512Mi"}}}),
        SPEC_IMMUTABLE_MESSAGE,
    );
    let km = e.json(&["-n", ns(), "get", "kvmmachine", &worker])?;
    assert_eq!(km["spec"]["resources"]["memory"], NEW_MEMORY);
    eprintln!(
        "e2e: topology 5. edits of KVMMachineTemplate {template} and KVMMachine {worker} refused"
    );

    // --- 6. delete -----------------------------------------------------------------------------------
    delete_cluster_and_namespace(e)?;
    eprintln!("e2e: topology 6. cluster deleted, nothing left");
    Ok(())
}

/// The local MC node's address, where its kube-proxy opens node ports (hack/dev-up.sh: the
/// kubelet's `--node-ip` and kube-proxy's `nodePortAddresses`, the bridge address 10.240.0.1,
/// which the host reaches directly). Fails, naming what fixes it, unless the controller allows
/// NodePort control-plane Services.
fn node_port_host(e: &E2e) -> Result<String> {
    let deploy = e.json(&["-n", CAPK_NS, "get", "deployment", CAPK_DEPLOYMENT])?;
    let allowed = deploy["spec"]["template"]["spec"]["containers"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|c| c["env"].as_array().cloned().unwrap_or_default())
        .find(|v| v["name"] == "CAPK_ALLOWED_CONTROL_PLANE_SERVICE_TYPES")
        .and_then(|v| v["value"].as_str().map(str::to_owned))
        .unwrap_or_default();
    if !allowed.split(',').any(|t| t.trim() == "NodePort") {
        bail!(
            "the controller does not allow NodePort control-plane Services \
             (CAPK_ALLOWED_CONTROL_PLANE_SERVICE_TYPES={allowed:?}); run `make dev-up`, whose \
             clusterctl init allows them on the local management cluster (hack/dev/capi.sh)"
        );
    }
    let nodes = e.json(&["get", "nodes"])?;
    nodes["items"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|n| {
            n["status"]["addresses"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .find(|a| a["type"] == "InternalIP")
        .and_then(|a| a["address"].as_str().map(str::to_owned))
        .context("no node of the local management cluster has an InternalIP")
}

/// Step 1: the Cluster from `clusterctl generate cluster --flavor topology`, one control plane
/// and one worker, both up. Returns their KVMMachines.
fn create_topology_cluster(e: &E2e, node_ip: &str) -> Result<(String, String)> {
    let manifest = e.generate_cluster(
        "topology",
        1,
        1,
        &[
            ("CONTROL_PLANE_MACHINE_CPUS", "1"),
            ("CONTROL_PLANE_MACHINE_MEMORY", MEMORY),
            ("WORKER_MACHINE_CPUS", "1"),
            ("WORKER_MACHINE_MEMORY", MEMORY),
            ("CONTROL_PLANE_VOLUME_SIZE_GB", "1"),
            ("CONTROL_PLANE_DOCKER_VOLUME_SIZE_GB", "1"),
            ("VOLUME_SIZE_GB", "1"),
            ("DOCKER_VOLUME_SIZE_GB", "1"),
            ("CONTROL_PLANE_SERVICE_TYPE", "NodePort"),
            ("CONTROL_PLANE_ENDPOINT_HOST", node_ip),
            // 0: the management cluster allocates the port.
            ("CONTROL_PLANE_NODE_PORT", "0"),
        ],
    )?;
    let mut has_class = false;
    let manifest = map_yaml_docs(&manifest, |doc| {
        if doc["kind"] == "ClusterClass" && doc["metadata"]["name"] == "kvm" {
            has_class = true;
        }
        if doc["kind"] != "Cluster" {
            return Ok(Some(doc));
        }
        let mut cluster: Value = serde_yaml_ng::from_value(doc)?;
        for_the_test_guest(&mut cluster)?;
        Ok(Some(serde_yaml_ng::to_value(cluster)?))
    })?;
    assert!(
        has_class,
        "clusterctl added no ClusterClass kvm to a namespace without one:\n{manifest}"
    );
    std::fs::create_dir_all(&e.out)?;
    std::fs::write(e.out.join("cluster.yaml"), &manifest)?;
    apply_worker_bootstrap_secret(e)?;
    e.kubectl_in(&["apply", "-f", "-"], &manifest)?;

    wait("KVMCluster provisioned", Duration::from_secs(120), || {
        let kc = e.json(&["-n", ns(), "get", "kvmcluster", &kvm_cluster_name(e)?])?;
        if kc["status"]["initialization"]["provisioned"] == true {
            return Ok(Some(()));
        }
        Err(anyhow!(
            "not provisioned; Ready: {}",
            condition(&kc, "Ready").map_or_else(|| "not reported".to_owned(), |c| c.to_string())
        ))
    })?;
    // The worker boots beside the control plane: its Machine gets bootstrap data on every look.
    let cp = wait(
        "control-plane machine up",
        emulated(Duration::from_secs(420)),
        || {
            give_workers_bootstrap_data(e)?;
            let machines = e.items(
                "machines",
                Some("cluster.x-k8s.io/cluster-name=e2e,cluster.x-k8s.io/control-plane"),
            )?;
            match machines.as_slice() {
                [m] => machine_up(e, m),
                _ => Ok(None),
            }
        },
    )?;
    let worker = wait(
        "worker machine up",
        emulated(Duration::from_secs(420)),
        || workers_with_bootstrap_data_up(e, 1),
    )?
    .remove(0);
    let checks = wait(
        "the class's MachineHealthChecks",
        Duration::from_secs(60),
        || {
            let mut names: Vec<String> = e
                .items("machinehealthchecks", None)?
                .iter()
                .filter(|m| m["spec"]["clusterName"] == CLUSTER)
                .map(|m| name(m).to_owned())
                .collect();
            names.sort();
            Ok((names.len() == 2).then_some(names))
        },
    )?;
    eprintln!(
        "e2e: topology 1. a Cluster of the class kvm: control plane {cp}, worker {worker}, health checks {checks:?}"
    );
    Ok((cp, worker))
}

/// What a Cluster of the topology flavor needs on the test guest (the module's header says why):
/// no Kubernetes sysext, and a MachineDeployment topology without preflight checks that rolls
/// one Machine down before it makes the next.
fn for_the_test_guest(cluster: &mut Value) -> Result<()> {
    let topology = &mut cluster["spec"]["topology"];
    let variables = topology["variables"]
        .as_array_mut()
        .context("the Cluster has no spec.topology.variables")?;
    variables.retain(|v| v["name"] != "kubernetesSysext");
    variables.push(json!({"name": "kubernetesSysext", "value": false}));
    let md = topology["workers"]["machineDeployments"]
        .as_array_mut()
        .into_iter()
        .flatten()
        .find(|md| md["name"] == MD_TOPOLOGY)
        .with_context(|| format!("the Cluster has no MachineDeployment topology {MD_TOPOLOGY}"))?;
    // Cluster API puts the topology's annotations on the MachineDeployment, whose MachineSets
    // take them.
    md["metadata"]["annotations"]["machineset.cluster.x-k8s.io/skip-preflight-checks"] =
        json!("All");
    md["rollout"] = json!({"strategy": {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
    }});
    Ok(())
}

/// Stands in for CABPK's join data (the module's header says why): every worker Machine without
/// bootstrap data, and not being deleted, gets the workers' bootstrap Secret.
fn give_workers_bootstrap_data(e: &E2e) -> Result<()> {
    let patch = json!({"spec": {"bootstrap": {"dataSecretName": WORKER_BOOTSTRAP}}}).to_string();
    for m in worker_machines(e)? {
        if m["spec"]["bootstrap"]["dataSecretName"].is_string()
            || m["metadata"]["deletionTimestamp"].is_string()
        {
            continue;
        }
        e.kubectl(&[
            "-n",
            ns(),
            "patch",
            "machine",
            name(&m),
            "--type",
            "merge",
            "-p",
            &patch,
        ])?;
    }
    Ok(())
}

/// [`workers_up_in`] with the test standing in for CABPK first.
fn workers_with_bootstrap_data_up(e: &E2e, n: usize) -> Result<Option<Vec<String>>> {
    give_workers_bootstrap_data(e)?;
    workers_up_in(e, e, n)
}

/// Step 2: the NodePort Service, the endpoint and the kubeconfig's server, and the guest's
/// apiserver answering there from the host.
fn reachable_through_node_port(e: &E2e, node_ip: &str, cp: &str) -> Result<()> {
    let svc = control_plane_service(e)?;
    assert_eq!(svc["spec"]["type"], "NodePort", "{}", svc["spec"]);
    let node_port = svc["spec"]["ports"][0]["nodePort"]
        .as_u64()
        .with_context(|| format!("no nodePort on the control-plane Service: {}", svc["spec"]))?;
    assert!(
        (30000..=32767).contains(&node_port),
        "node port {node_port} outside the node-port range"
    );
    let endpoint = json!({"host": node_ip, "port": node_port});
    let kc = e.json(&["-n", ns(), "get", "kvmcluster", &kvm_cluster_name(e)?])?;
    assert_eq!(kc["spec"]["controlPlaneEndpoint"], endpoint);
    let cluster = e.json(&["-n", ns(), "get", "cluster", CLUSTER])?;
    assert_eq!(cluster["spec"]["controlPlaneEndpoint"], endpoint);

    // The kubeconfig as a user gets it (docs/control-plane-endpoint.md).
    let kubeconfig = e.clusterctl(&["get", "kubeconfig", CLUSTER, "--namespace", ns()], &[])?;
    let kubeconfig: Value =
        serde_yaml_ng::from_str(&kubeconfig).context("clusterctl get kubeconfig: not YAML")?;
    let servers: Vec<&str> = kubeconfig["clusters"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["cluster"]["server"].as_str())
        .collect();
    let server = format!("https://{node_ip}:{node_port}");
    assert_eq!(
        servers,
        [server.as_str()],
        "the workload kubeconfig's servers"
    );

    // Behind the node port: the control-plane VM only, ready (its apiserver answers).
    let cp_ip = machine_pod(e, cp)?["status"]["podIP"]
        .as_str()
        .context("control-plane Pod IP")?
        .to_owned();
    wait(
        "control-plane endpoint set and ready",
        Duration::from_secs(60),
        || Ok((control_plane_endpoints(e)? == [(cp_ip.clone(), true)]).then_some(())),
    )?;
    let answer = wait(
        "the guest apiserver answers /readyz at the kubeconfig's server, from the host",
        Duration::from_secs(60),
        || Ok(curl_readyz_at(e, &server).ok()),
    )?;
    assert_eq!(answer.trim(), "ok", "/readyz at {server}");
    eprintln!("e2e: topology 2. kubeconfig server {server} (NodePort), /readyz from the host: ok");
    Ok(())
}

/// Step 3: `workerResources.memory` changed; `old_worker` is replaced. Returns the new worker's
/// KVMMachine.
fn rotate_workers(e: &E2e, cp: &str, old_worker: &str) -> Result<String> {
    let old_template = machine_deployment_template(e)?;
    let old_spec = kvm_machine_template_spec(e, &old_template)?;
    assert_eq!(
        old_spec["template"]["spec"]["resources"]["memory"], MEMORY,
        "{old_template}: {old_spec}"
    );
    let km = e.json(&["-n", ns(), "get", "kvmmachine", old_worker])?;
    assert_eq!(
        km["metadata"]["annotations"]["cluster.x-k8s.io/cloned-from-name"],
        old_template.as_str()
    );
    let cp_pod = pod_uid(e, cp)?;

    let new_template = rotate_template(
        e,
        "workerResources",
        "the MachineDeployment",
        machine_deployment_template,
        &old_template,
        &old_spec,
    )?;

    let new_worker = wait(
        "the worker rolled to the new template",
        emulated(Duration::from_secs(420)),
        || {
            let Some(up) = workers_with_bootstrap_data_up(e, 1)? else {
                return Ok(None);
            };
            let km = e.json(&["-n", ns(), "get", "kvmmachine", &up[0]])?;
            let from = km["metadata"]["annotations"]["cluster.x-k8s.io/cloned-from-name"].as_str();
            let mut workers: Vec<String> = e
                .items("kvmmachines", Some("!cluster.x-k8s.io/control-plane"))?
                .iter()
                .map(|k| name(k).to_owned())
                .collect();
            workers.sort();
            Ok((from == Some(new_template.as_str())
                && km["spec"]["resources"]["memory"] == NEW_MEMORY
                && workers == up)
                .then(|| up[0].clone()))
        },
    )?;
    assert_ne!(new_worker, old_worker);
    assert_nothing_left_for(e, &[old_worker.to_owned()])?;
    // The old MachineSet keeps its template until the rollout completes (never, here: no Node).
    assert_eq!(
        kvm_machine_template_spec(e, &old_template)?,
        old_spec,
        "{old_template} was changed"
    );
    assert_eq!(
        pod_uid(e, cp)?,
        cp_pod,
        "the control plane's Pod was replaced"
    );
    eprintln!(
        "e2e: topology 3. workerResources.memory {MEMORY} -> {NEW_MEMORY}: template {old_template} -> {new_template}, worker {old_worker} -> {new_worker}"
    );
    Ok(new_worker)
}

/// Step 4: `controlPlaneResources.memory` changed: a new control-plane template, the old one
/// deleted (the topology controller does that at once for a control plane), the machine kept.
fn rotate_control_plane_template(e: &E2e, cp: &str) -> Result<()> {
    let old_template = control_plane_template(e)?;
    let old_spec = kvm_machine_template_spec(e, &old_template)?;
    assert_eq!(
        old_spec["template"]["spec"]["resources"]["memory"], MEMORY,
        "{old_template}: {old_spec}"
    );
    let cp_pod = pod_uid(e, cp)?;

    let new_template = rotate_template(
        e,
        "controlPlaneResources",
        "the KubeadmControlPlane",
        control_plane_template,
        &old_template,
        &old_spec,
    )?;
    wait(
        "the old control-plane template deleted",
        Duration::from_secs(60),
        || {
            let names: Vec<String> = e
                .items("kvmmachinetemplates", None)?
                .iter()
                .map(|t| name(t).to_owned())
                .collect();
            Ok((!names.contains(&old_template)).then_some(()))
        },
    )?;
    let km = e.json(&["-n", ns(), "get", "kvmmachine", cp])?;
    assert_eq!(km["spec"]["resources"]["memory"], MEMORY);
    assert_eq!(
        pod_uid(e, cp)?,
        cp_pod,
        "the control plane's Pod was replaced"
    );
    eprintln!(
        "e2e: topology 4. controlPlaneResources.memory {MEMORY} -> {NEW_MEMORY}: template {old_template} -> {new_template}; control plane {cp} kept"
    );
    Ok(())
}

/// Sets `memory` in the Cluster's class variable `variable`, as `kubectl edit cluster` would:
/// one JSON patch that first tests the variable's name at that index.
fn set_variable_memory(e: &E2e, variable: &str, memory: &str) -> Result<()> {
    let cluster = e.json(&["-n", ns(), "get", "cluster", CLUSTER])?;
    let i = cluster["spec"]["topology"]["variables"]
        .as_array()
        .and_then(|vs| vs.iter().position(|v| v["name"] == variable))
        .with_context(|| format!("no variable {variable} in the Cluster's topology"))?;
    let patch = json!([
        {"op": "test", "path": format!("/spec/topology/variables/{i}/name"), "value": variable},
        {"op": "replace", "path": format!("/spec/topology/variables/{i}/value/memory"), "value": memory},
    ]);
    e.kubectl(&[
        "-n",
        ns(),
        "patch",
        "cluster",
        CLUSTER,
        "--type",
        "json",
        "-p",
        &patch.to_string(),
    ])?;
    Ok(())
}

/// Asserts that a merge `patch` of `kind/object`'s spec is refused with `message`.
fn refused(e: &E2e, kind: &str, object: &str, patch: &Value, message: &str) {
    let result = e.kubectl(&[
        "-n",
        ns(),
        "patch",
        kind,
        object,
        "--type",
        "merge",
        "-p",
        &patch.to_string(),
    ]);
    match result {
        Ok(out) => panic!("the edit of {kind}/{object} was accepted: {out}"),
        Err(err) => {
            let err = format!("{err:#}");
            assert!(
                err.contains(message),
                "the edit of {kind}/{object} was refused without {message:?}: {err}"
            );
        }
    }
}

/// The KVMCluster the topology controller made for the Cluster.
fn kvm_cluster_name(e: &E2e) -> Result<String> {
    let cluster = e.json(&["-n", ns(), "get", "cluster", CLUSTER])?;
    cluster["spec"]["infrastructureRef"]["name"]
        .as_str()
        .map(str::to_owned)
        .context("the Cluster has no infrastructureRef yet")
}

/// The KVMMachineTemplate the topology's MachineDeployment points at.
fn machine_deployment_template(e: &E2e) -> Result<String> {
    let mds = e.items(
        "machinedeployments",
        Some(&format!(
            "cluster.x-k8s.io/cluster-name={CLUSTER},topology.cluster.x-k8s.io/deployment-name={MD_TOPOLOGY}"
        )),
    )?;
    let [md] = mds.as_slice() else {
        bail!("{} MachineDeployments of topology {MD_TOPOLOGY}", mds.len());
    };
    md["spec"]["template"]["spec"]["infrastructureRef"]["name"]
        .as_str()
        .map(str::to_owned)
        .context("the MachineDeployment has no infrastructureRef")
}

/// The KVMMachineTemplate the Cluster's KubeadmControlPlane points at.
fn control_plane_template(e: &E2e) -> Result<String> {
    let cluster = e.json(&["-n", ns(), "get", "cluster", CLUSTER])?;
    let kcp = cluster["spec"]["controlPlaneRef"]["name"]
        .as_str()
        .context("the Cluster has no controlPlaneRef")?;
    let kcp = e.json(&["-n", ns(), "get", "kubeadmcontrolplane", kcp])?;
    kcp["spec"]["machineTemplate"]["spec"]["infrastructureRef"]["name"]
        .as_str()
        .map(str::to_owned)
        .context("the KubeadmControlPlane has no infrastructureRef")
}

fn kvm_machine_template_spec(e: &E2e, template: &str) -> Result<Value> {
    Ok(e.json(&["-n", ns(), "get", "kvmmachinetemplate", template])?["spec"].clone())
}

/// The UID of KVMMachine `machine`'s Pod.
fn pod_uid(e: &E2e, machine: &str) -> Result<String> {
    machine_pod(e, machine)?["metadata"]["uid"]
        .as_str()
        .map(str::to_owned)
        .with_context(|| format!("no uid on the Pod of {machine}"))
}

/// The Cluster's `TopologyReconciled` condition, for a wait's last error.
fn topology_reconciled(e: &E2e) -> Result<String> {
    let cluster = e.json(&["-n", ns(), "get", "cluster", CLUSTER])?;
    Ok(condition(&cluster, "TopologyReconciled")
        .map(|c| format!("{} {}: {}", c["status"], c["reason"], c["message"]))
        .unwrap_or_else(|| "not reported".to_owned()))
}

/// Sets the class variable `variable`'s memory to [`NEW_MEMORY`] and waits until `user` (read by
/// `current`) points at a new KVMMachineTemplate, whose spec must be `old_spec` with only the
/// memory changed. Returns the new template's name.
fn rotate_template(
    e: &E2e,
    variable: &str,
    user: &str,
    current: fn(&E2e) -> Result<String>,
    old_template: &str,
    old_spec: &Value,
) -> Result<String> {
    set_variable_memory(e, variable, NEW_MEMORY)?;
    let new_template = wait(
        &format!("{user} points at a new KVMMachineTemplate"),
        Duration::from_secs(120),
        || {
            let now = current(e)?;
            if now != old_template {
                return Ok(Some(now));
            }
            Err(anyhow!(
                "still {old_template}; the Cluster's TopologyReconciled: {}",
                topology_reconciled(e)?
            ))
        },
    )?;
    let mut expected = old_spec.clone();
    expected["template"]["spec"]["resources"]["memory"] = json!(NEW_MEMORY);
    assert_eq!(
        kvm_machine_template_spec(e, &new_template)?,
        expected,
        "{new_template}: the old template's spec with the new memory"
    );
    Ok(new_template)
}
