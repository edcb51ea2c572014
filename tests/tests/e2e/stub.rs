//! The user's journey on the stub guest (`make e2e`'s first scenario): create a cluster, its
//! control-plane endpoint following its apiserver, workers, scale, upgrade, faults, pause and
//! delete, each asserted as a user sees it.

use super::*;

/// What step 1 leaves for the others.
pub(crate) struct ControlPlane {
    pub(crate) kvmmachine: String,
    pub(crate) first_marker: String,
}

pub(crate) fn the_journey(e: &E2e) -> Result<()> {
    let ControlPlane {
        kvmmachine: cp,
        first_marker,
    } = create_cluster(e)?;
    control_plane_endpoint_follows_its_apiserver(e, &cp)?;
    prepare_workers(e)?;
    scale_upgrade_faults_pause_delete(e, &cp, &first_marker)
}

/// Step 1: a fresh namespace, a clusterctl-generated cluster with one control-plane machine and
/// no workers, asserted as a user sees it.
pub(crate) fn create_cluster(e: &E2e) -> Result<ControlPlane> {
    // --- 0. a clean namespace -----------------------------------------------------------------------
    fresh_namespace(e)?;

    // --- 1. create ------------------------------------------------------------------------------------
    let manifest = e.generate_cluster(
        "ignition",
        1,
        0,
        &[
            ("CONTROL_PLANE_MACHINE_CPUS", "1"),
            ("CONTROL_PLANE_MACHINE_MEMORY", "256Mi"),
            ("WORKER_MACHINE_CPUS", "1"),
            ("WORKER_MACHINE_MEMORY", "256Mi"),
            ("CONTROL_PLANE_VOLUME_SIZE_GB", "1"),
            ("CONTROL_PLANE_DOCKER_VOLUME_SIZE_GB", "1"),
            ("VOLUME_SIZE_GB", "1"),
            ("DOCKER_VOLUME_SIZE_GB", "1"),
        ],
    )?;
    std::fs::create_dir_all(&e.out)?;
    std::fs::write(e.out.join("cluster.yaml"), &manifest)?;
    e.kubectl_in(&["apply", "-f", "-"], &manifest)?;

    let kc = wait("KVMCluster provisioned", Duration::from_secs(120), || {
        let kc = e.json(&["-n", ns(), "get", "kvmcluster", CLUSTER])?;
        Ok((kc["status"]["initialization"]["provisioned"] == true).then_some(kc))
    })?;
    assert_eq!(
        kc["status"]["machineNamespace"], MACHINE_NS,
        "the KVMCluster's machine namespace: status {}",
        kc["status"]
    );
    // The endpoint is the control-plane Service's DNS name, in the machine namespace.
    let endpoint = kc["spec"]["controlPlaneEndpoint"].clone();
    assert_eq!(endpoint["port"], 6443, "control-plane endpoint: {endpoint}");
    let svc = control_plane_service(e).context("the control-plane Service")?;
    let svc_dns = format!("{}.{MACHINE_NS}.svc.", name(&svc));
    assert!(
        endpoint["host"]
            .as_str()
            .is_some_and(|h| h.starts_with(&svc_dns)),
        "control-plane endpoint {endpoint}: not the DNS name of Service {MACHINE_NS}/{}",
        name(&svc)
    );

    let cp = wait(
        "control-plane machine up",
        emulated(Duration::from_secs(420)),
        || {
            let cps = control_plane_kvmmachines(e)?;
            let Some(km) = cps.first() else {
                return Ok(None);
            };
            let machines = e.items(
                "machines",
                Some("cluster.x-k8s.io/cluster-name=e2e,cluster.x-k8s.io/control-plane"),
            )?;
            machine_up(e, &machines[0]).map(|up| up.filter(|k| k == km))
        },
    )?;
    // The tenant's namespace holds no Pod of the machine (it is baseline, [`fresh_namespace`]).
    assert_machines_outside_the_tenant_namespace(e)?;
    let cp_pod = machine_pod(e, &cp)?;
    let cp_ip = cp_pod["status"]["podIP"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    // The Service's endpoint is the control-plane VM (the Pod's IP is the VM's), ready: the
    // controller's health check found the guest's (stand-in) apiserver answering /readyz.
    wait(
        "control-plane endpoint set and ready",
        Duration::from_secs(60),
        || Ok((control_plane_endpoints(e)? == [(cp_ip.clone(), true)]).then_some(())),
    )?;
    // kubectl logs: the guest's console, from the bootloader to the bootstrap.
    let console = logs(e, &cp, false)?;
    for marker in [
        "SYSLINUX",
        "CAPK-TESTGUEST kubeadm args=init",
        "CAPK-TESTGUEST bootstrap-success",
        "CAPK-TESTGUEST marker-written",
    ] {
        assert!(
            console.contains(marker),
            "console of {cp} lacks {marker:?}:\n{console}"
        );
    }
    let first_marker = console
        .lines()
        .find_map(|l| l.split("CAPK-TESTGUEST marker-written ").nth(1))
        .map(|s| s.trim().to_owned())
        .context("marker id")?;
    assert!(
        console.contains(&format!("ip={cp_ip}")) || console.contains(&cp_ip),
        "the VM holds the Pod IP {cp_ip}:\n{console}"
    );
    let status = launcher_status(e, &cp)?;
    assert_eq!(status["phase"], "running", "capk-launcher status: {status}");
    assert_eq!(
        status["ip"].as_str().and_then(|ip| ip.split('/').next()),
        Some(cp_ip.as_str()),
        "capk-launcher status: {status}"
    );
    assert_eq!(
        status["bootstrap_succeeded"], true,
        "capk-launcher status: {status}"
    );
    qemu_runs_unprivileged(e, &cp, &status)?;
    eprintln!("e2e: 1. create: control plane {cp} up at {cp_ip}, QEMU unprivileged");
    Ok(ControlPlane {
        kvmmachine: cp,
        first_marker,
    })
}

/// The scenario's namespace, created anew ([`create_tenant_namespace`]): whatever an earlier
/// run left there (its cluster first) is deleted.
pub(crate) fn fresh_namespace(e: &E2e) -> Result<()> {
    if e.kubectl(&["get", "namespace", ns()]).is_ok() {
        eprintln!("e2e: deleting {} left by an earlier run", ns());
        let _ = e.kubectl(&["-n", ns(), "delete", "cluster", CLUSTER, "--timeout=300s"]);
        e.kubectl(&["delete", "namespace", ns(), "--timeout=300s"])?;
    }
    create_tenant_namespace(e)
}

/// Creates the scenario's namespace as a tenant's: Pod Security `baseline` enforced, so that no
/// privileged Pod can run there. The machines still come up: their privileged Pods live in the
/// machine namespace.
pub(crate) fn create_tenant_namespace(e: &E2e) -> Result<()> {
    e.kubectl(&["create", "namespace", ns()])?;
    e.kubectl(&[
        "label",
        "namespace",
        ns(),
        "pod-security.kubernetes.io/enforce=baseline",
    ])?;
    Ok(())
}

/// The addresses of the control-plane Service's EndpointSlices, each with whether it is ready.
pub(crate) fn control_plane_endpoints(e: &E2e) -> Result<Vec<(String, bool)>> {
    let svc = control_plane_service(e)?;
    let slices = e.json(&[
        "-n",
        MACHINE_NS,
        "get",
        "endpointslices",
        "-l",
        &format!("kubernetes.io/service-name={}", name(&svc)),
    ])?;
    Ok(slices["items"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|s| s["endpoints"].as_array().cloned().unwrap_or_default())
        .flat_map(|ep| {
            let ready = ep["conditions"]["ready"] == true;
            ep["addresses"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .into_iter()
                .filter_map(move |a| a.as_str().map(|a| (a.to_owned(), ready)))
        })
        .collect())
}

/// `curl -k https://<ClusterIP>:6443/readyz` from the host, through kube-proxy.
pub(crate) fn curl_readyz(e: &E2e, cluster_ip: &str) -> Result<String> {
    curl_readyz_at(e, &format!("https://{cluster_ip}:6443"))
}

/// `curl -k <server>/readyz` from the host; `server` is `https://<host>:<port>`, as a kubeconfig
/// names it. `-k`: the test guest's stand-in apiserver has a self-signed certificate.
pub(crate) fn curl_readyz_at(e: &E2e, server: &str) -> Result<String> {
    let mut curl = Command::new("curl");
    curl.args(["-ksS", "--max-time", "5", &format!("{server}/readyz")]);
    e.run(curl, None)
}

/// Step 1b: the control-plane Service sends traffic to the control plane only while its
/// apiserver answers: frozen (QMP `stop`), the VM leaves the Service's ready endpoints; resumed,
/// it is back. The stand-in apiserver of the test guest answers `/readyz` since its `kubeadm
/// init`.
pub(crate) fn control_plane_endpoint_follows_its_apiserver(e: &E2e, cp: &str) -> Result<()> {
    let cp_ip = machine_pod(e, cp)?["status"]["podIP"]
        .as_str()
        .context("control-plane Pod IP")?
        .to_owned();
    let svc = control_plane_service(e)?;
    assert!(
        svc["spec"]["selector"].is_null(),
        "the Service has no selector: {}",
        svc["spec"]
    );
    let cluster_ip = svc["spec"]["clusterIP"]
        .as_str()
        .context("the Service's ClusterIP")?
        .to_owned();
    let answer = wait(
        "the guest apiserver answers through the Service's ClusterIP",
        Duration::from_secs(60),
        || Ok(curl_readyz(e, &cluster_ip).ok()),
    )?;
    assert_eq!(answer.trim(), "ok", "/readyz through {cluster_ip}");

    let qmp = |cmd: &str| exec_launcher(e, cp, &["capk-launcher", "qmp", cmd]);
    qmp("stop")?;
    let frozen = Instant::now();
    let left = wait(
        "the frozen VM's endpoint not ready",
        Duration::from_secs(60),
        || Ok((control_plane_endpoints(e)? == [(cp_ip.clone(), false)]).then_some(())),
    );
    let left_after = frozen.elapsed();
    // No endpoint: kube-proxy refuses at once, where the frozen VM would let a client hang.
    let refused = left.and_then(|()| {
        wait(
            "the ClusterIP refuses at once while the VM is frozen",
            Duration::from_secs(30),
            || {
                let start = Instant::now();
                let failed_fast = curl_readyz(e, &cluster_ip).is_err()
                    && start.elapsed() < Duration::from_secs(2);
                Ok(failed_fast.then_some(()))
            },
        )
    });
    // Resume whatever happened: the rest of the journey needs the VM.
    let resumed = qmp("cont");
    refused?;
    resumed?;
    let cont = Instant::now();
    wait(
        "the resumed VM's endpoint ready again",
        Duration::from_secs(60),
        || Ok((control_plane_endpoints(e)? == [(cp_ip.clone(), true)]).then_some(())),
    )?;
    let back_after = cont.elapsed();
    wait(
        "the apiserver answers through the ClusterIP again",
        Duration::from_secs(60),
        || {
            Ok(curl_readyz(e, &cluster_ip)
                .ok()
                .filter(|a| a.trim() == "ok"))
        },
    )?;
    let kc = e.json(&["-n", ns(), "get", "kvmcluster", CLUSTER])?;
    assert!(
        condition_true(&kc, "ControlPlaneEndpointsReady"),
        "{}",
        kc["status"]["conditions"]
    );
    eprintln!(
        "e2e: 1b. control-plane endpoint: frozen VM not ready after {:.1}s, ready {:.1}s after resume",
        left_after.as_secs_f64(),
        back_after.as_secs_f64()
    );
    Ok(())
}

/// The workers' own bootstrap Secret and the MachineDeployment settings a cluster without a real
/// workload control plane needs ([`apply_worker_bootstrap_secret`]).
pub(crate) fn prepare_workers(e: &E2e) -> Result<()> {
    apply_worker_bootstrap_secret(e)?;
    e.kubectl_in(
        &["-n", ns(), "patch", "machinedeployment", "e2e-md-0", "--type", "merge", "--patch-file", "/dev/stdin"],
        &json!({
            "metadata": {"annotations": {"machineset.cluster.x-k8s.io/skip-preflight-checks": "All"}},
            "spec": {
                "rollout": {"strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}},
                "template": {"spec": {"bootstrap": {"configRef": null, "dataSecretName": WORKER_BOOTSTRAP}}},
            },
        })
        .to_string(),
    )?;
    Ok(())
}

/// The workers' own bootstrap Secret, [`WORKER_BOOTSTRAP`]: a real CABPK worker join (Ignition),
/// which CABPK writes only after a real control plane initialised. Labelled for `clusterctl
/// move`, which takes it along with the cluster (nothing else links it to the Cluster).
pub(crate) fn apply_worker_bootstrap_secret(e: &E2e) -> Result<()> {
    let fixture = std::fs::read_to_string(
        e.root
            .join("bootstrap/tests/fixtures/cabpk/ignition-worker-join.secret.json"),
    )?;
    let fixture: Value = serde_json::from_str(&fixture)?;
    let secret = json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": WORKER_BOOTSTRAP, "namespace": ns(),
                     "labels": {"cluster.x-k8s.io/cluster-name": CLUSTER,
                                capk_api::constants::MOVE_LABEL: ""}},
        "type": "cluster.x-k8s.io/secret",
        "stringData": {"format": fixture["format"], "value": fixture["value"]},
    });
    e.kubectl_in(&["apply", "-f", "-"], &secret.to_string())?;
    Ok(())
}

pub(crate) fn scale_upgrade_faults_pause_delete(
    e: &E2e,
    cp: &str,
    first_marker: &str,
) -> Result<()> {
    // --- 2. workers and scale -------------------------------------------------------------------------
    let one = scale_workers(e, 1)?;
    let three = scale_workers(e, 3)?;
    assert!(three.contains(&one[0]), "scaling up keeps the first worker");
    let kept = scale_workers(e, 1)?;
    let gone: Vec<String> = three
        .iter()
        .filter(|k| !kept.contains(k))
        .cloned()
        .collect();
    assert_eq!(gone.len(), 2);
    assert_nothing_left_for(e, &gone)?;
    eprintln!("e2e: 2. workers scaled 1 -> 3 -> 1");

    // --- 3. upgrade: a new KVMMachineTemplate rolls the MachineDeployment ------------------------------
    let mut tmpl = e.json(&["-n", ns(), "get", "kvmmachinetemplate", "e2e-md-0"])?;
    tmpl["metadata"] = json!({"name": "e2e-md-0-v2", "namespace": ns()});
    tmpl["spec"]["template"]["spec"]["resources"]["memory"] = json!("320Mi");
    tmpl.as_object_mut().expect("object").remove("status");
    e.kubectl_in(&["apply", "-f", "-"], &tmpl.to_string())?;
    e.kubectl_in(
        &[
            "-n",
            ns(),
            "patch",
            "machinedeployment",
            "e2e-md-0",
            "--type",
            "merge",
            "--patch-file",
            "/dev/stdin",
        ],
        &json!({"spec": {"template": {"spec": {"infrastructureRef": {"name": "e2e-md-0-v2"}}}}})
            .to_string(),
    )?;
    let upgraded = wait(
        "worker rolled to the new template",
        emulated(Duration::from_secs(420)),
        || {
            let ms = worker_machines(e)?;
            if ms.len() != 1 || ms[0]["metadata"]["deletionTimestamp"].is_string() {
                return Ok(None);
            }
            let Some(km) = machine_up(e, &ms[0])? else {
                return Ok(None);
            };
            let kvm = e.json(&["-n", ns(), "get", "kvmmachine", &km])?;
            let from = kvm["metadata"]["annotations"]["cluster.x-k8s.io/cloned-from-name"].clone();
            Ok(
                (from == "e2e-md-0-v2" && kvm["spec"]["resources"]["memory"] == "320Mi")
                    .then_some(km),
            )
        },
    )?;
    assert!(!kept.contains(&upgraded));
    assert_nothing_left_for(e, &kept)?;
    eprintln!("e2e: 3. upgrade: {kept:?} replaced by {upgraded}");

    // --- 4. faults ------------------------------------------------------------------------------------
    // kill -9 of QEMU: the container restarts, the VM boots again, the etcd disk kept its marker.
    kill_qemu(e, cp, Duration::from_secs(180))?;
    let previous = logs(e, cp, true)?;
    assert!(
        previous.contains("qemu") || previous.contains("QEMU"),
        "the launcher said why it exited:\n{}",
        previous
            .lines()
            .rev()
            .take(20)
            .collect::<Vec<_>>()
            .join("\n")
    );
    wait(
        "control-plane VM booted again with its etcd disk",
        Duration::from_secs(300),
        || {
            let console = logs(e, cp, false)?;
            if !console.contains("CAPK-TESTGUEST bootstrap-success") {
                return Ok(None);
            }
            if !console.contains(&format!("marker-found {first_marker}")) {
                bail!("the etcd disk lost its marker {first_marker}");
            }
            Ok(Some(()))
        },
    )?;
    eprintln!(
        "e2e: 4a. kill -9 of QEMU: container restarted, etcd disk kept marker {first_marker}"
    );

    // Deleting a machine Pod: the KVMMachine reports it (a MachineHealthCheck would replace it).
    let pod = MachinePod::of(e, &upgraded)?;
    e.kubectl(&[
        "-n",
        &pod.namespace,
        "delete",
        "pod",
        &pod.name,
        "--wait=false",
    ])?;
    wait(
        "KVMMachine reports its Pod missing",
        Duration::from_secs(120),
        || {
            let km = e.json(&["-n", ns(), "get", "kvmmachine", &upgraded])?;
            Ok(km["status"]["conditions"]
                .as_array()
                .is_some_and(|cs| cs.iter().any(|c| c["reason"] == "MachinePodMissing"))
                .then_some(()))
        },
    )?;
    let lost_machine = worker_machines(e)?
        .iter()
        .find(|m| m["spec"]["infrastructureRef"]["name"] == upgraded.as_str())
        .map(|m| name(m).to_owned())
        .context("the lost worker's Machine")?;
    e.kubectl(&[
        "-n",
        ns(),
        "delete",
        "machine",
        &lost_machine,
        "--wait=false",
    ])?;
    let replaced = wait_workers(e, 1)?;
    assert_ne!(replaced[0], upgraded);
    eprintln!(
        "e2e: 4b. deleted Pod reported; its Machine replaced by {}",
        replaced[0]
    );

    // The controller stopped during a scale-up, then started: no duplicate Pods.
    set_controller_replicas(e, 0)?;
    e.kubectl(&[
        "-n",
        ns(),
        "scale",
        "machinedeployment",
        "e2e-md-0",
        "--replicas=3",
    ])?;
    wait(
        "3 worker KVMMachines while the controller is down",
        Duration::from_secs(120),
        || Ok((e.items("kvmmachines", None)?.len() == 4).then_some(())),
    )?;
    assert_eq!(
        machine_pod_owners(e)?.len(),
        2,
        "no Pods while the controller is down"
    );
    set_controller_replicas(e, 1)?;
    let three = wait_workers(e, 3)?;
    assert_eq!(machine_pod_owners(e)?.len(), 4, "one Pod per machine");
    assert_machines_outside_the_tenant_namespace(e)?;
    eprintln!("e2e: 4c. controller stopped during scale-up: {three:?}, one Pod each");

    // kube-apiserver restarted: the controller recovers on its own (its watches resume).
    // dev-down's own stop (SIGTERM, then SIGKILL after 20 s), then dev-up starts it again.
    e.run(
        {
            let mut c = Command::new("bash");
            c.arg("-c")
                .arg("source hack/dev/lib.sh && stop_daemon kube-apiserver")
                .current_dir(&e.root);
            c
        },
        None,
    )
    .context("stop kube-apiserver")?;
    assert!(
        e.kubectl(&["get", "--raw", "/readyz"]).is_err(),
        "kube-apiserver is down"
    );
    e.run(
        {
            let mut c = Command::new("bash");
            // Only the apiserver is restarted: what containerd already holds stays, and a
            // local MC brought up without the node image (make e2e-stub) does not import it now.
            c.arg(e.root.join("hack/dev-up.sh"))
                .env("CAPK_DEV_SAMPLE", "0")
                .env("CAPK_DEV_NODE_IMAGE", "0");
            c
        },
        None,
    )
    .context("make dev-up restarts kube-apiserver")?;
    let kept = scale_workers(e, 1)?;
    let gone: Vec<String> = three
        .iter()
        .filter(|k| !kept.contains(k))
        .cloned()
        .collect();
    assert_nothing_left_for(e, &gone)?;
    eprintln!("e2e: 4d. kube-apiserver restarted; the controller scaled down afterwards");

    // --- 5. pause -------------------------------------------------------------------------------------
    // The machine's Secrets in the machine namespace: its Ignition Secret.
    let ignition = || -> Result<Vec<String>> {
        let selector = format!("{KVMMACHINE_LABEL}={}", kept[0]);
        Ok(e.machine_items("secrets", Some(&selector))?
            .iter()
            .map(|s| name(s).to_owned())
            .collect())
    };
    let [secret] = ignition()?.try_into().map_err(|s: Vec<String>| {
        anyhow!(
            "{}: not one Ignition Secret in {MACHINE_NS}: {s:?}",
            kept[0]
        )
    })?;
    set_paused(e, true)?;
    wait("KVMMachine reports Paused", Duration::from_secs(60), || {
        let km = e.json(&["-n", ns(), "get", "kvmmachine", &kept[0]])?;
        Ok(condition_true(&km, "Paused").then_some(()))
    })?;
    e.kubectl(&["-n", MACHINE_NS, "delete", "secret", &secret])?;
    sleep(Duration::from_secs(15));
    let while_paused = ignition()?;
    assert!(
        while_paused.is_empty(),
        "a paused cluster's machines are left alone: the Ignition Secret was recreated: {while_paused:?}"
    );
    set_paused(e, false)?;
    wait(
        "Ignition Secret rendered again after unpause",
        Duration::from_secs(60),
        || Ok((ignition()? == [secret.clone()]).then_some(())),
    )?;
    eprintln!("e2e: 5. paused: nothing touched; unpaused: reconciled");

    // --- 6. delete ------------------------------------------------------------------------------------
    delete_cluster_and_namespace(e)?;
    eprintln!("e2e: 6. cluster deleted, nothing left");
    Ok(())
}

/// Deletes the Cluster as a user does, asserts that nothing the provider created in the namespace
/// or for it in the machine namespace is left, then deletes the namespace.
pub(crate) fn delete_cluster_and_namespace(e: &E2e) -> Result<()> {
    e.kubectl(&["-n", ns(), "delete", "cluster", CLUSTER, "--timeout=300s"])?;
    wait(
        "everything the provider created is gone",
        Duration::from_secs(120),
        || {
            let mut left = Vec::new();
            for kind in [
                "pods",
                "services",
                "secrets",
                "persistentvolumeclaims",
                "kvmmachines",
                "kvmclusters",
            ] {
                for o in e.items(kind, None)? {
                    let n = name(&o).to_owned();
                    if kind == "secrets" && n == WORKER_BOOTSTRAP {
                        continue; // ours
                    }
                    left.push(format!("{kind}/{n}"));
                }
            }
            left.extend(
                hosted_objects(e)?
                    .into_keys()
                    .map(|k| format!("{MACHINE_NS}/{k}")),
            );
            if left.is_empty() {
                Ok(Some(()))
            } else {
                Err(anyhow!("left: {left:?}"))
            }
        },
    )?;
    e.kubectl(&["delete", "namespace", ns(), "--timeout=120s"])?;
    Ok(())
}
