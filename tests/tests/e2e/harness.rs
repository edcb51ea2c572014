//! The harness of the end-to-end scenarios: the local management cluster as [`E2e`] (kubectl,
//! clusterctl, diagnostics), one scenario at a time in its namespace ([`run_scenario`]), waits
//! scaled to this machine's emulation, and what every scenario reads of machines, their Pods
//! and the objects the controller made.

use super::*;

thread_local! {
    /// The namespace of the running scenario (the journey's or the benchmark's).
    static NS: std::cell::Cell<&'static str> = const { std::cell::Cell::new("capk-e2e") };
}

pub(crate) fn ns() -> &'static str {
    NS.with(|n| n.get())
}

/// One scenario at a time: they share the local management cluster.
pub(crate) static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
pub(crate) const CLUSTER: &str = "e2e";
/// The workers' bootstrap Secret ([`apply_worker_bootstrap_secret`]).
pub(crate) const WORKER_BOOTSTRAP: &str = "e2e-worker-bootstrap";
pub(crate) const OWNED: &str =
    "cluster.x-k8s.io/cluster-name=e2e,app.kubernetes.io/managed-by=capk-controller";
pub(crate) const CAPK_NS: &str = "capkvm-system";
pub(crate) const CAPK_DEPLOYMENT: &str = "capkvm-controller-manager";
/// Where the management cluster keeps the machines of clusters that name no hosting cluster
/// (machine Pods, Ignition Secrets, etcd PVCs, the control-plane Service): the controller's
/// `--machine-namespace` (`CAPK_MACHINE_NAMESPACE`) as shipped, which the local MC's `clusterctl
/// init` keeps. Owners of every namespace share it: their objects are found by their
/// owner-namespace label ([`E2e::machine_items`]), a machine's Pod by its KVMMachine's status
/// ([`MachinePod`]).
pub(crate) const MACHINE_NS: &str = capk_api::constants::DEFAULT_MACHINE_NAMESPACE;
/// What the controller makes where the machines live.
pub(crate) const HOSTED_KINDS: [&str; 5] = [
    "pods",
    "secrets",
    "services",
    "endpointslices",
    "persistentvolumeclaims",
];

pub(crate) struct E2e {
    pub(crate) root: PathBuf,
    pub(crate) kubeconfig: PathBuf,
    pub(crate) clusterctl_config: PathBuf,
    pub(crate) out: PathBuf,
}

impl E2e {
    /// The local management cluster of `make dev-up`.
    pub(crate) fn new() -> Result<Self> {
        Self::for_dev_dir("dev", "make dev-up")
    }

    /// A local management cluster whose files hack/dev-up.sh wrote to `_output/<dir>/`;
    /// `bring_up` is the command that does so, named when they are missing.
    pub(crate) fn for_dev_dir(dir: &str, bring_up: &str) -> Result<Self> {
        let root = capk_tests::repo_root();
        let out = capk_tests::output_dir();
        let kubeconfig = out.join(dir).join("admin.kubeconfig");
        let clusterctl_config = out.join(dir).join("clusterctl/clusterctl.yaml");
        for (f, what) in [
            (&kubeconfig, "the local management cluster"),
            (
                &clusterctl_config,
                "Cluster API and CAPK installed by clusterctl",
            ),
        ] {
            if !f.exists() {
                bail!(
                    "{} missing: {what} is not up; run `{bring_up}`",
                    f.display()
                );
            }
        }
        let stamp = chrono_stamp();
        let out = out.join("e2e").join(stamp);
        Ok(Self {
            root,
            kubeconfig,
            clusterctl_config,
            out,
        })
    }

    pub(crate) fn bin(&self, name: &str) -> PathBuf {
        capk_tests::output_dir().join("bin").join(name)
    }

    /// Runs a command; its stdout, or an error with its stderr.
    pub(crate) fn run(&self, mut cmd: Command, input: Option<&str>) -> Result<String> {
        let shown = format!("{cmd:?}");
        cmd.stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        let mut child = cmd.spawn().with_context(|| format!("spawn {shown}"))?;
        if let Some(input) = input {
            use std::io::Write;
            child
                .stdin
                .take()
                .expect("piped")
                .write_all(input.as_bytes())?;
        }
        let out = child.wait_with_output()?;
        if !out.status.success() {
            bail!(
                "{shown} failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    pub(crate) fn kubectl_cmd(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(self.bin("kubectl"));
        cmd.arg("--kubeconfig").arg(&self.kubeconfig).args(args);
        cmd
    }

    pub(crate) fn kubectl(&self, args: &[&str]) -> Result<String> {
        self.run(self.kubectl_cmd(args), None)
    }

    pub(crate) fn kubectl_in(&self, args: &[&str], input: &str) -> Result<String> {
        self.run(self.kubectl_cmd(args), Some(input))
    }

    pub(crate) fn json(&self, args: &[&str]) -> Result<Value> {
        let mut all = args.to_vec();
        all.extend(["-o", "json"]);
        let text = self.kubectl(&all)?;
        serde_json::from_str(&text).context("kubectl -o json")
    }

    /// `kubectl get` of a list in the test namespace.
    pub(crate) fn items(&self, kind: &str, selector: Option<&str>) -> Result<Vec<Value>> {
        self.items_in(ns(), kind, selector)
    }

    /// `kubectl get` of a list in the machine namespace ([`MACHINE_NS`]): what the controller
    /// made there for owners in the test namespace (its owner-namespace label), also matching
    /// `selector` when given.
    pub(crate) fn machine_items(&self, kind: &str, selector: Option<&str>) -> Result<Vec<Value>> {
        let mut owned = format!("{OWNER_NAMESPACE_LABEL}={}", ns());
        if let Some(s) = selector {
            owned = format!("{owned},{s}");
        }
        self.items_in(MACHINE_NS, kind, Some(&owned))
    }

    pub(crate) fn items_in(
        &self,
        namespace: &str,
        kind: &str,
        selector: Option<&str>,
    ) -> Result<Vec<Value>> {
        let mut args = vec!["-n", namespace, "get", kind];
        if let Some(s) = selector {
            args.extend(["-l", s]);
        }
        Ok(self.json(&args)?["items"]
            .as_array()
            .cloned()
            .unwrap_or_default())
    }

    pub(crate) fn clusterctl(&self, args: &[&str], env: &[(&str, &str)]) -> Result<String> {
        let mut cmd = Command::new(self.bin("clusterctl"));
        cmd.args(args)
            .arg("--config")
            .arg(&self.clusterctl_config)
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .env("CLUSTERCTL_DISABLE_VERSIONCHECK", "true")
            .envs(env.iter().copied());
        self.run(cmd, None)
    }

    /// `clusterctl generate cluster` of the cluster [`CLUSTER`] from the provider's `flavor`, in
    /// the scenario's namespace, at the pinned Kubernetes version, with `control_planes` and
    /// `workers` machines and the flavor's variables `vars`: the manifest a user would apply.
    pub(crate) fn generate_cluster(
        &self,
        flavor: &str,
        control_planes: u32,
        workers: u32,
        vars: &[(&str, &str)],
    ) -> Result<String> {
        let version = capk_tests::pinned_version("KUBERNETES_VERSION");
        let (control_planes, workers) = (control_planes.to_string(), workers.to_string());
        self.clusterctl(
            &[
                "generate",
                "cluster",
                CLUSTER,
                "--infrastructure",
                "kvm",
                "--flavor",
                flavor,
                "--target-namespace",
                ns(),
                "--kubernetes-version",
                &version,
                "--control-plane-machine-count",
                &control_planes,
                "--worker-machine-count",
                &workers,
            ],
            vars,
        )
    }

    /// Everything useful for a failure, under `_output/e2e/<stamp>/`.
    pub(crate) fn collect(&self) {
        let _ = std::fs::create_dir_all(&self.out);
        let dump = |file: &str, args: &[&str]| {
            let text = match self.kubectl(args) {
                Ok(t) => t,
                Err(e) => format!("{e:#}"),
            };
            let _ = std::fs::write(self.out.join(file), text);
        };
        dump(
            "objects.yaml",
            &[
                "get",
                "-A",
                "-o",
                "yaml",
                "clusters,clusterclasses,machines,machinesets,machinedeployments,machinehealthchecks,kubeadmcontrolplanes,kubeadmconfigs,kvmclusters,kvmmachines,kvmmachinetemplates,pods,services,endpointslices,persistentvolumeclaims",
            ],
        );
        dump(
            "events.txt",
            &["get", "events", "-A", "--sort-by=.lastTimestamp"],
        );
        dump(
            "verticalpodautoscalers.yaml",
            &["get", "-A", "-o", "yaml", "verticalpodautoscalers"],
        );
        for (ns, deploy) in [
            (CAPK_NS, CAPK_DEPLOYMENT),
            ("capi-system", "capi-controller-manager"),
            (
                "capi-kubeadm-bootstrap-system",
                "capi-kubeadm-bootstrap-controller-manager",
            ),
            (
                "capi-kubeadm-control-plane-system",
                "capi-kubeadm-control-plane-controller-manager",
            ),
            // CAPK_DEV_VPA=1 and CAPK_DEV_MONITORING=1 ([`operating`]).
            ("kube-system", "metrics-server"),
            ("kube-system", "vpa-recommender"),
            ("kube-system", "vpa-updater"),
            ("kube-system", "vpa-admission-controller"),
            ("monitoring", "prometheus"),
        ] {
            dump(
                &format!("{deploy}.log"),
                &[
                    "-n",
                    ns,
                    "logs",
                    &format!("deployment/{deploy}"),
                    "--tail=2000",
                ],
            );
        }
        // The test namespace's Pods, and the machine Pods of its owners.
        let pods = [
            (ns(), self.items("pods", None)),
            (MACHINE_NS, self.machine_items("pods", None)),
        ];
        for (namespace, pods) in pods {
            for p in pods.into_iter().flatten() {
                let name = name(&p);
                dump(
                    &format!("pod-{namespace}-{name}.log"),
                    &["-n", namespace, "logs", name, "--all-containers"],
                );
                dump(
                    &format!("pod-{namespace}-{name}.previous.log"),
                    &["-n", namespace, "logs", name, "--previous"],
                );
            }
        }
        // The workload cluster, when the journey got as far as its kubeconfig.
        let workload = self.out.join("workload.kubeconfig");
        if workload.exists() {
            let wdump = |file: &str, args: &[&str]| {
                let mut cmd = Command::new(self.bin("kubectl"));
                cmd.arg("--kubeconfig")
                    .arg(&workload)
                    .arg("--request-timeout=30s")
                    .args(args);
                let text = match self.run(cmd, None) {
                    Ok(t) => t,
                    Err(e) => format!("{e:#}"),
                };
                let _ = std::fs::write(self.out.join(file), text);
            };
            wdump("workload-nodes.yaml", &["get", "nodes", "-o", "yaml"]);
            wdump("workload-pods.txt", &["get", "pods", "-A", "-o", "wide"]);
            wdump(
                "workload-events.txt",
                &["get", "events", "-A", "--sort-by=.lastTimestamp"],
            );
        }
        eprintln!("e2e: diagnostics in {}", self.out.display());
    }
}

/// Runs a scenario in its namespace, one at a time; on an error or a failed assertion,
/// diagnostics go to `_output/e2e/` first.
pub(crate) fn run_scenario(namespace: &'static str, scenario: fn(&E2e) -> Result<()>) {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    NS.with(|n| n.set(namespace));
    let e = &E2e::new().unwrap_or_else(|err| panic!("{err:#}"));
    if let Err(err) = collect_on_failure(e, || scenario(e)) {
        panic!("{err:#}");
    }
}

/// Runs `f`; when it fails (an error, or a failed assertion's panic), `e`'s diagnostics are
/// collected before the failure goes on.
pub(crate) fn collect_on_failure<T>(e: &E2e, f: impl FnOnce() -> Result<T>) -> Result<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(err)) => {
            e.collect();
            Err(err)
        }
        Err(panic) => {
            e.collect();
            std::panic::resume_unwind(panic);
        }
    }
}

/// UTC timestamp for the diagnostics directory, without a date crate.
pub(crate) fn chrono_stamp() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default();
    format!("run-{secs}")
}

/// How much slower this host emulates than the reference machine of hack/calibrate-host.sh (its
/// `CAPK_TCG_CALIBRATION_RATIO` in `_output/calibration.env`, which every make target of an
/// emulated journey writes first), never below 1. Without that file the waits are the reference
/// machine's, and the first wait says so.
pub(crate) fn tcg_ratio() -> f64 {
    static RATIO: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *RATIO.get_or_init(|| {
        let file = capk_tests::output_dir().join("calibration.env");
        let ratio = std::fs::read_to_string(&file).ok().and_then(|env| {
            env.lines()
                .find_map(|l| l.strip_prefix("CAPK_TCG_CALIBRATION_RATIO="))
                .and_then(|v| v.trim().parse::<f64>().ok())
        });
        match ratio {
            Some(r) => {
                let r = r.max(1.0);
                eprintln!("e2e: waits for emulated guests scaled by {r:.2} ({})", file.display());
                r
            }
            None => {
                eprintln!(
                    "e2e: no host calibration in {} (make calibrate): waits for emulated guests are the reference machine's",
                    file.display()
                );
                1.0
            }
        }
    })
}

/// A wait for emulated guests: `reference` is what it may take on the reference machine (docs/
/// benchmarks.md, "Host calibration"), scaled by this host's [`tcg_ratio`].
pub(crate) fn emulated(reference: Duration) -> Duration {
    reference.mul_f64(tcg_ratio())
}

/// Polls `f` until it returns `Some`, or fails with the description and the last error.
pub(crate) fn wait<T>(
    what: &str,
    timeout: Duration,
    mut f: impl FnMut() -> Result<Option<T>>,
) -> Result<T> {
    let start = Instant::now();
    let mut last = String::from("not yet");
    loop {
        match f() {
            Ok(Some(v)) => {
                eprintln!("e2e: {what}: after {:.1}s", start.elapsed().as_secs_f64());
                return Ok(v);
            }
            Ok(None) => {}
            Err(e) => last = format!("{e:#}"),
        }
        if start.elapsed() > timeout {
            bail!("timed out after {timeout:?} waiting for {what} (last: {last})");
        }
        sleep(Duration::from_secs(1));
    }
}

pub(crate) fn name(o: &Value) -> &str {
    o["metadata"]["name"].as_str().unwrap_or_default()
}

pub(crate) fn uid(o: &Value) -> &str {
    o["metadata"]["uid"].as_str().unwrap_or_default()
}

pub(crate) fn condition<'a>(o: &'a Value, t: &str) -> Option<&'a Value> {
    o["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == t)
}

pub(crate) fn condition_true(o: &Value, t: &str) -> bool {
    condition(o, t).is_some_and(|c| c["status"] == "True")
}

/// A KVMMachine's machine Pod, where the KVMMachine's status says it is (`status.podNamespace`,
/// `status.podName`), as a user finds a machine's console.
pub(crate) struct MachinePod {
    pub(crate) namespace: String,
    pub(crate) name: String,
}

impl MachinePod {
    /// The machine Pod of KVMMachine `kvmmachine` of the test namespace of `e`.
    pub(crate) fn of(e: &E2e, kvmmachine: &str) -> Result<Self> {
        Self::in_status(&e.json(&["-n", ns(), "get", "kvmmachine", kvmmachine])?)
    }

    /// The machine Pod the KVMMachine `km` names.
    pub(crate) fn in_status(km: &Value) -> Result<Self> {
        let status = &km["status"];
        let field = |f: &str| {
            status[f]
                .as_str()
                .filter(|v| !v.is_empty())
                .map(str::to_owned)
        };
        match (field("podNamespace"), field("podName")) {
            (Some(namespace), Some(name)) => Ok(Self { namespace, name }),
            _ => bail!(
                "KVMMachine {} names no machine Pod (status.podNamespace {}, status.podName {})",
                name(km),
                status["podNamespace"],
                status["podName"]
            ),
        }
    }

    /// The Pod, from the cluster it runs in.
    pub(crate) fn get(&self, hosting: &E2e) -> Result<Value> {
        hosting.json(&["-n", &self.namespace, "get", "pod", &self.name])
    }
}

/// The machine Pod of KVMMachine `kvmmachine` of the test namespace.
pub(crate) fn machine_pod(e: &E2e, kvmmachine: &str) -> Result<Value> {
    MachinePod::of(e, kvmmachine)?.get(e)
}

/// The KVMMachines of the cluster's Pods in the machine namespace of `hosting` (each Pod's
/// KVMMachine label), one per Pod, sorted: a machine with two Pods is there twice.
pub(crate) fn machine_pod_owners(hosting: &E2e) -> Result<Vec<String>> {
    let mut owners: Vec<String> = hosting
        .machine_items("pods", Some(OWNED))?
        .iter()
        .map(|p| {
            p["metadata"]["labels"][KVMMACHINE_LABEL]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        })
        .collect();
    owners.sort();
    Ok(owners)
}

/// Everything the controller made in the machine namespace of `e` for owners of the test
/// namespace: `kind/name` -> UID.
pub(crate) fn hosted_objects(e: &E2e) -> Result<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    for kind in HOSTED_KINDS {
        for o in e.machine_items(kind, None)? {
            out.insert(format!("{kind}/{}", name(&o)), uid(&o).to_owned());
        }
    }
    Ok(out)
}

/// Tenant containment, as a user sees it: no Pod in the cluster's namespace, and every
/// KVMMachine's Pod in the machine namespace.
pub(crate) fn assert_machines_outside_the_tenant_namespace(e: &E2e) -> Result<()> {
    let pods: Vec<String> = e
        .items("pods", None)?
        .iter()
        .map(|p| name(p).to_owned())
        .collect();
    assert!(
        pods.is_empty(),
        "Pods in the cluster's namespace {}: {pods:?}",
        ns()
    );
    for km in e.items("kvmmachines", None)? {
        assert_eq!(
            km["status"]["podNamespace"],
            MACHINE_NS,
            "KVMMachine {}'s machine Pod is not in the machine namespace: status {}",
            name(&km),
            km["status"]
        );
    }
    Ok(())
}

/// The cluster's control-plane Service, in the machine namespace (the one labelled with the
/// Cluster's name for owners of the test namespace).
pub(crate) fn control_plane_service(e: &E2e) -> Result<Value> {
    let mut services =
        e.machine_items("services", Some(&format!("{CLUSTER_NAME_LABEL}={CLUSTER}")))?;
    match services.len() {
        1 => Ok(services.remove(0)),
        n => bail!(
            "{n} control-plane Services of cluster {}/{CLUSTER} in {MACHINE_NS}",
            ns()
        ),
    }
}

pub(crate) fn worker_machines(e: &E2e) -> Result<Vec<Value>> {
    e.items(
        "machines",
        Some("cluster.x-k8s.io/cluster-name=e2e,!cluster.x-k8s.io/control-plane"),
    )
}

/// A machine is up when its KVMMachine says BootstrapCompleted, its Pod runs, and the Machine
/// has the provider ID and infrastructure provisioned.
pub(crate) fn machine_up(e: &E2e, machine: &Value) -> Result<Option<String>> {
    machine_up_in(e, e, machine)
}

/// [`machine_up`] for a Machine of `e` whose Pod runs in `hosting` (where its KVMMachine's
/// status says).
pub(crate) fn machine_up_in(e: &E2e, hosting: &E2e, machine: &Value) -> Result<Option<String>> {
    let Some(km_name) = machine["spec"]["infrastructureRef"]["name"].as_str() else {
        return Ok(None);
    };
    let km = e.json(&["-n", ns(), "get", "kvmmachine", km_name])?;
    if !condition_true(&km, "BootstrapCompleted") {
        return Ok(None);
    }
    let provisioned = machine["status"]["initialization"]["infrastructureProvisioned"] == true;
    let provider_id = machine["spec"]["providerID"].as_str().unwrap_or_default();
    if !provisioned || provider_id != format!("kvm://{}/{km_name}", ns()) {
        return Ok(None);
    }
    let pod = MachinePod::in_status(&km)?.get(hosting)?;
    if pod["status"]["phase"] != "Running" {
        return Ok(None);
    }
    Ok(Some(km_name.to_owned()))
}

/// `kubectl scale machinedeployment <cluster>-md-0`, as a user does.
pub(crate) fn scale_machine_deployment(e: &E2e, replicas: usize) -> Result<String> {
    e.kubectl(&[
        "-n",
        ns(),
        "scale",
        "machinedeployment",
        &format!("{CLUSTER}-md-0"),
        &format!("--replicas={replicas}"),
    ])
}

pub(crate) fn scale_workers(e: &E2e, replicas: usize) -> Result<Vec<String>> {
    scale_machine_deployment(e, replicas)?;
    wait_workers(e, replicas)
}

/// Waits until exactly `n` worker machines are up and only their Pods (plus the control plane's)
/// exist; returns the worker KVMMachine names.
pub(crate) fn wait_workers(e: &E2e, n: usize) -> Result<Vec<String>> {
    wait_workers_in(e, e, n)
}

/// [`wait_workers`] for the machines of `e` whose Pods run in `hosting`.
pub(crate) fn wait_workers_in(e: &E2e, hosting: &E2e, n: usize) -> Result<Vec<String>> {
    wait(
        &format!("{n} worker machines up, no other machine Pods"),
        emulated(Duration::from_secs(420)),
        || workers_up_in(e, hosting, n),
    )
}

/// One look for [`wait_workers_in`]: the worker KVMMachine names once exactly `n` worker machines
/// are up and only their Pods (plus the control plane's) exist in `hosting`.
pub(crate) fn workers_up_in(e: &E2e, hosting: &E2e, n: usize) -> Result<Option<Vec<String>>> {
    let machines = worker_machines(e)?;
    if machines.len() != n
        || machines
            .iter()
            .any(|m| m["metadata"]["deletionTimestamp"].is_string())
    {
        return Ok(None);
    }
    let mut up = Vec::new();
    for m in &machines {
        match machine_up_in(e, hosting, m)? {
            Some(km) => up.push(km),
            None => return Ok(None),
        }
    }
    let cp = control_plane_kvmmachines(e)?;
    let mut expected: Vec<String> = up.iter().cloned().chain(cp).collect();
    expected.sort();
    if machine_pod_owners(hosting)? != expected {
        return Ok(None);
    }
    up.sort();
    Ok(Some(up))
}

pub(crate) fn control_plane_kvmmachines(e: &E2e) -> Result<Vec<String>> {
    Ok(e.items(
        "machines",
        Some("cluster.x-k8s.io/cluster-name=e2e,cluster.x-k8s.io/control-plane"),
    )?
    .iter()
    .filter_map(|m| {
        m["spec"]["infrastructureRef"]["name"]
            .as_str()
            .map(str::to_owned)
    })
    .collect())
}

/// Nothing the provider created for machines that are gone: Pods, Ignition Secrets, PVCs, in
/// the test namespace or the machine namespace.
pub(crate) fn assert_nothing_left_for(e: &E2e, gone: &[String]) -> Result<()> {
    wait(
        "deleted machines' Pods, Secrets and PVCs gone",
        Duration::from_secs(120),
        || {
            let mut left = Vec::new();
            for kind in ["pods", "secrets", "persistentvolumeclaims"] {
                let here = e.items(kind, Some(OWNED))?;
                let there = e.machine_items(kind, Some(OWNED))?;
                for (namespace, o) in
                    (here.iter().map(|o| (ns(), o))).chain(there.iter().map(|o| (MACHINE_NS, o)))
                {
                    let n = name(o);
                    let owner = o["metadata"]["labels"][KVMMACHINE_LABEL].as_str();
                    if gone.iter().any(|g| {
                        owner == Some(g.as_str()) || n == g || n.starts_with(&format!("{g}-"))
                    }) {
                        left.push(format!("{namespace}/{kind}/{n}"));
                    }
                }
            }
            if left.is_empty() {
                Ok(Some(()))
            } else {
                Err(anyhow!("still there: {left:?}"))
            }
        },
    )
}

/// `kubectl logs` of the launcher of KVMMachine `machine`'s Pod: the guest's console.
pub(crate) fn logs(e: &E2e, machine: &str, previous: bool) -> Result<String> {
    let pod = MachinePod::of(e, machine)?;
    let mut args = vec!["-n", &pod.namespace, "logs", &pod.name, "-c", "launcher"];
    if previous {
        args.push("--previous");
    }
    e.kubectl(&args)
}

/// `kubectl exec POD -c launcher -- ARGS...` in KVMMachine `machine`'s Pod: its stdout.
pub(crate) fn exec_launcher(e: &E2e, machine: &str, command: &[&str]) -> Result<String> {
    let pod = MachinePod::of(e, machine)?;
    let mut args = vec![
        "-n",
        &pod.namespace,
        "exec",
        &pod.name,
        "-c",
        "launcher",
        "--",
    ];
    args.extend_from_slice(command);
    e.kubectl(&args)
}

pub(crate) fn launcher_status(e: &E2e, machine: &str) -> Result<Value> {
    let text = exec_launcher(e, machine, &["capk-launcher", "status"])?;
    serde_json::from_str(&text).with_context(|| format!("capk-launcher status: {text}"))
}

/// QEMU's uid and gid in a machine Pod: the launcher's `--qemu-uid`/`--qemu-gid` default, which
/// the controller does not change.
pub(crate) const QEMU_ID: &str = "107";

/// What the launcher promises of QEMU in a real machine Pod, read from QEMU's
/// `/proc/<pid>/status` through `kubectl exec` (`status`: the launcher's, naming QEMU's pid): it
/// runs as the unprivileged user with no root group, no capability in any set, `no_new_privs`
/// and its `-sandbox` seccomp filter, so a guest that escapes into QEMU holds none of the
/// privileged Pod's powers.
pub(crate) fn qemu_runs_unprivileged(e: &E2e, machine: &str, status: &Value) -> Result<()> {
    let qemu = status["qemu_pid"]
        .as_u64()
        .with_context(|| format!("qemu_pid in capk-launcher status: {status}"))?;
    let proc_status = exec_launcher(e, machine, &["cat", &format!("/proc/{qemu}/status")])?;
    let field = |name: &str| -> Result<String> {
        proc_status
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name}:")))
            .map(|v| v.split_whitespace().collect::<Vec<_>>().join(" "))
            .with_context(|| {
                format!("no {name} in /proc/{qemu}/status in the Pod of {machine}:\n{proc_status}")
            })
    };
    let what = format!("QEMU (pid {qemu}) in the Pod of {machine}:\n{proc_status}");
    assert!(field("Name")?.starts_with("qemu-system"), "{what}");
    let id = [QEMU_ID; 4].join(" ");
    assert_eq!(field("Uid")?, id, "{what}");
    assert_eq!(field("Gid")?, id, "{what}");
    assert!(
        !field("Groups")?.split(' ').any(|g| g == "0"),
        "QEMU keeps root's group: {what}"
    );
    for caps in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        assert_eq!(field(caps)?, "0000000000000000", "{caps}: {what}");
    }
    assert_eq!(field("NoNewPrivs")?, "1", "{what}");
    assert_eq!(field("Seccomp")?, "2", "QEMU's -sandbox filter: {what}");
    Ok(())
}

/// Pauses or unpauses the Cluster (`spec.paused`), as a user does.
pub(crate) fn set_paused(e: &E2e, paused: bool) -> Result<()> {
    let patch = json!({"spec": {"paused": paused}}).to_string();
    e.kubectl(&[
        "-n",
        ns(),
        "patch",
        "cluster",
        CLUSTER,
        "--type",
        "merge",
        "-p",
        &patch,
    ])?;
    Ok(())
}

pub(crate) fn restart_count(e: &E2e, machine: &str) -> Result<i64> {
    Ok(launcher_restarts(&machine_pod(e, machine)?))
}

/// How often a machine Pod's launcher container restarted (its VM with it).
pub(crate) fn launcher_restarts(pod: &Value) -> i64 {
    pod["status"]["containerStatuses"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["name"] == "launcher"))
        .and_then(|c| c["restartCount"].as_i64())
        .unwrap_or(0)
}

/// `kill -9` of the QEMU in KVMMachine `machine`'s Pod, from inside the Pod, as a user with
/// `kubectl exec` would; returns once the launcher container has restarted.
pub(crate) fn kill_qemu(e: &E2e, machine: &str, timeout: Duration) -> Result<()> {
    let restarts = restart_count(e, machine)?;
    let qemu = launcher_status(e, machine)?["qemu_pid"]
        .as_u64()
        .context("qemu_pid in capk-launcher status")?;
    exec_launcher(e, machine, &["sh", "-c", &format!("kill -9 {qemu}")])?;
    wait(
        &format!("{machine}: launcher container restarted after kill -9 of QEMU"),
        timeout,
        || Ok((restart_count(e, machine)? > restarts).then_some(())),
    )
}

pub(crate) fn set_controller_replicas(e: &E2e, n: u32) -> Result<()> {
    e.kubectl(&[
        "-n",
        CAPK_NS,
        "scale",
        "deployment",
        CAPK_DEPLOYMENT,
        &format!("--replicas={n}"),
    ])?;
    wait(
        &format!("capk-controller at {n} replicas"),
        Duration::from_secs(120),
        || {
            let pods = e.json(&[
                "-n",
                CAPK_NS,
                "get",
                "pods",
                "-l",
                "app.kubernetes.io/name=capk-controller",
            ])?;
            let items = pods["items"].as_array().cloned().unwrap_or_default();
            let ready = items
                .iter()
                .filter(|p| {
                    condition_true(p, "Ready") && p["metadata"]["deletionTimestamp"].is_null()
                })
                .count();
            Ok((items.len() == n as usize && ready == n as usize).then_some(()))
        },
    )
}
