//! End to end on the local management cluster (`make e2e`).
//!
//! The user's journey with real components: Cluster API's core, kubeadm bootstrap and control-plane
//! controllers and this provider, installed by the real `clusterctl init` (`make dev-up`), a real
//! kubelet and containerd running the machine Pods, and in each Pod capk-launcher booting the test
//! guest's bootable disk under QEMU (TCG) from the node image container. What is not real, said
//! plainly: the guest's `kubeadm` only records its arguments and its "apiserver" answers `/readyz`
//! only (images/test-guest/README.md), so no workload Node ever registers. Hence the workers get a
//! bootstrap data Secret of their own (CABPK writes join data only after a real control plane
//! initialised), and their MachineDeployment skips the MachineSet preflight checks (which wait for
//! a stable control plane) and rolls with maxUnavailable 1 (a new Machine never becomes Available).
//!
//! The machines live where the shipped controller puts them, in the management cluster's machine
//! namespace ([`MACHINE_NS`]), not in the cluster's namespace: that one is created as a tenant's,
//! Pod Security `baseline` enforced, and holds no Pod.
//!
//! Every step asserts with a timeout; on failure everything useful goes to `_output/e2e/`.
//!
//! [`operating`]: the controller's metrics as a real Prometheus scrapes them, and the shipped
//! VerticalPodAutoscaler object under the real VPA.
//!
//! [`topology`]: a Cluster of the ClusterClass `kvm` with a NodePort control-plane Service: its
//! kubeconfig works from the host, and a changed variable rotates a template and rolls the
//! Machines.
//!
//! `make e2e-move` adds a second local management cluster and moves a cluster to it with the
//! real `clusterctl move` ([`pivot`]).

use std::{
    collections::BTreeMap,
    path::PathBuf,
    process::{Command, Stdio},
    thread::sleep,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, anyhow, bail};
use capk_api::constants::{
    CLUSTER_NAME_LABEL, KVMCLUSTER_LABEL, KVMMACHINE_LABEL, OWNER_NAMESPACE_LABEL,
};
use serde_json::{Value, json};

#[path = "e2e/operating.rs"]
mod operating;
#[path = "e2e/pivot.rs"]
mod pivot;
#[path = "e2e/topology.rs"]
mod topology;
#[path = "e2e/workload.rs"]
mod workload;

thread_local! {
    /// The namespace of the running scenario (the journey's or the benchmark's).
    static NS: std::cell::Cell<&'static str> = const { std::cell::Cell::new("capk-e2e") };
}

fn ns() -> &'static str {
    NS.with(|n| n.get())
}

/// One scenario at a time: they share the local management cluster.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
const CLUSTER: &str = "e2e";
/// The workers' bootstrap Secret ([`apply_worker_bootstrap_secret`]).
const WORKER_BOOTSTRAP: &str = "e2e-worker-bootstrap";
const OWNED: &str =
    "cluster.x-k8s.io/cluster-name=e2e,app.kubernetes.io/managed-by=capk-controller";
const CAPK_NS: &str = "capkvm-system";
const CAPK_DEPLOYMENT: &str = "capkvm-controller-manager";
/// Where the management cluster keeps the machines of clusters that name no hosting cluster
/// (machine Pods, Ignition Secrets, etcd PVCs, the control-plane Service): the controller's
/// `--machine-namespace` (`CAPK_MACHINE_NAMESPACE`) as shipped, which the local MC's `clusterctl
/// init` keeps. Owners of every namespace share it: their objects are found by their
/// owner-namespace label ([`E2e::machine_items`]), a machine's Pod by its KVMMachine's status
/// ([`MachinePod`]).
const MACHINE_NS: &str = capk_api::constants::DEFAULT_MACHINE_NAMESPACE;
/// What the controller makes where the machines live.
const HOSTED_KINDS: [&str; 5] = [
    "pods",
    "secrets",
    "services",
    "endpointslices",
    "persistentvolumeclaims",
];

struct E2e {
    root: PathBuf,
    kubeconfig: PathBuf,
    clusterctl_config: PathBuf,
    out: PathBuf,
}

impl E2e {
    /// The local management cluster of `make dev-up`.
    fn new() -> Result<Self> {
        Self::for_dev_dir("dev", "make dev-up")
    }

    /// A local management cluster whose files hack/dev-up.sh wrote to `_output/<dir>/`;
    /// `bring_up` is the command that does so, named when they are missing.
    fn for_dev_dir(dir: &str, bring_up: &str) -> Result<Self> {
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

    fn bin(&self, name: &str) -> PathBuf {
        capk_tests::output_dir().join("bin").join(name)
    }

    /// Runs a command; its stdout, or an error with its stderr.
    fn run(&self, mut cmd: Command, input: Option<&str>) -> Result<String> {
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

    fn kubectl_cmd(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(self.bin("kubectl"));
        cmd.arg("--kubeconfig").arg(&self.kubeconfig).args(args);
        cmd
    }

    fn kubectl(&self, args: &[&str]) -> Result<String> {
        self.run(self.kubectl_cmd(args), None)
    }

    fn kubectl_in(&self, args: &[&str], input: &str) -> Result<String> {
        self.run(self.kubectl_cmd(args), Some(input))
    }

    fn json(&self, args: &[&str]) -> Result<Value> {
        let mut all = args.to_vec();
        all.extend(["-o", "json"]);
        let text = self.kubectl(&all)?;
        serde_json::from_str(&text).context("kubectl -o json")
    }

    /// `kubectl get` of a list in the test namespace.
    fn items(&self, kind: &str, selector: Option<&str>) -> Result<Vec<Value>> {
        self.items_in(ns(), kind, selector)
    }

    /// `kubectl get` of a list in the machine namespace ([`MACHINE_NS`]): what the controller
    /// made there for owners in the test namespace (its owner-namespace label), also matching
    /// `selector` when given.
    fn machine_items(&self, kind: &str, selector: Option<&str>) -> Result<Vec<Value>> {
        let mut owned = format!("{OWNER_NAMESPACE_LABEL}={}", ns());
        if let Some(s) = selector {
            owned = format!("{owned},{s}");
        }
        self.items_in(MACHINE_NS, kind, Some(&owned))
    }

    fn items_in(&self, namespace: &str, kind: &str, selector: Option<&str>) -> Result<Vec<Value>> {
        let mut args = vec!["-n", namespace, "get", kind];
        if let Some(s) = selector {
            args.extend(["-l", s]);
        }
        Ok(self.json(&args)?["items"]
            .as_array()
            .cloned()
            .unwrap_or_default())
    }

    fn clusterctl(&self, args: &[&str], env: &[(&str, &str)]) -> Result<String> {
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

    /// Everything useful for a failure, under `_output/e2e/<stamp>/`.
    fn collect(&self) {
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
fn run_scenario(namespace: &'static str, scenario: fn(&E2e) -> Result<()>) {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    NS.with(|n| n.set(namespace));
    let e = &E2e::new().unwrap_or_else(|err| panic!("{err:#}"));
    if let Err(err) = collect_on_failure(e, || scenario(e)) {
        panic!("{err:#}");
    }
}

/// Runs `f`; when it fails (an error, or a failed assertion's panic), `e`'s diagnostics are
/// collected before the failure goes on.
fn collect_on_failure<T>(e: &E2e, f: impl FnOnce() -> Result<T>) -> Result<T> {
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
fn chrono_stamp() -> String {
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
fn tcg_ratio() -> f64 {
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
fn emulated(reference: Duration) -> Duration {
    reference.mul_f64(tcg_ratio())
}

/// Polls `f` until it returns `Some`, or fails with the description and the last error.
fn wait<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Result<Option<T>>) -> Result<T> {
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

fn name(o: &Value) -> &str {
    o["metadata"]["name"].as_str().unwrap_or_default()
}

fn uid(o: &Value) -> &str {
    o["metadata"]["uid"].as_str().unwrap_or_default()
}

fn condition<'a>(o: &'a Value, t: &str) -> Option<&'a Value> {
    o["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == t)
}

fn condition_true(o: &Value, t: &str) -> bool {
    condition(o, t).is_some_and(|c| c["status"] == "True")
}

/// A KVMMachine's machine Pod, where the KVMMachine's status says it is (`status.podNamespace`,
/// `status.podName`), as a user finds a machine's console.
struct MachinePod {
    namespace: String,
    name: String,
}

impl MachinePod {
    /// The machine Pod of KVMMachine `kvmmachine` of the test namespace of `e`.
    fn of(e: &E2e, kvmmachine: &str) -> Result<Self> {
        Self::in_status(&e.json(&["-n", ns(), "get", "kvmmachine", kvmmachine])?)
    }

    /// The machine Pod the KVMMachine `km` names.
    fn in_status(km: &Value) -> Result<Self> {
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
    fn get(&self, hosting: &E2e) -> Result<Value> {
        hosting.json(&["-n", &self.namespace, "get", "pod", &self.name])
    }
}

/// The machine Pod of KVMMachine `kvmmachine` of the test namespace.
fn machine_pod(e: &E2e, kvmmachine: &str) -> Result<Value> {
    MachinePod::of(e, kvmmachine)?.get(e)
}

/// The KVMMachines of the cluster's Pods in the machine namespace of `hosting` (each Pod's
/// KVMMachine label), one per Pod, sorted: a machine with two Pods is there twice.
fn machine_pod_owners(hosting: &E2e) -> Result<Vec<String>> {
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
fn hosted_objects(e: &E2e) -> Result<BTreeMap<String, String>> {
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
fn assert_machines_outside_the_tenant_namespace(e: &E2e) -> Result<()> {
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
fn control_plane_service(e: &E2e) -> Result<Value> {
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

fn worker_machines(e: &E2e) -> Result<Vec<Value>> {
    e.items(
        "machines",
        Some("cluster.x-k8s.io/cluster-name=e2e,!cluster.x-k8s.io/control-plane"),
    )
}

/// A machine is up when its KVMMachine says BootstrapCompleted, its Pod runs, and the Machine
/// has the provider ID and infrastructure provisioned.
fn machine_up(e: &E2e, machine: &Value) -> Result<Option<String>> {
    machine_up_in(e, e, machine)
}

/// [`machine_up`] for a Machine of `e` whose Pod runs in `hosting` (where its KVMMachine's
/// status says).
fn machine_up_in(e: &E2e, hosting: &E2e, machine: &Value) -> Result<Option<String>> {
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
fn scale_machine_deployment(e: &E2e, replicas: usize) -> Result<String> {
    e.kubectl(&[
        "-n",
        ns(),
        "scale",
        "machinedeployment",
        &format!("{CLUSTER}-md-0"),
        &format!("--replicas={replicas}"),
    ])
}

fn scale_workers(e: &E2e, replicas: usize) -> Result<Vec<String>> {
    scale_machine_deployment(e, replicas)?;
    wait_workers(e, replicas)
}

/// Waits until exactly `n` worker machines are up and only their Pods (plus the control plane's)
/// exist; returns the worker KVMMachine names.
fn wait_workers(e: &E2e, n: usize) -> Result<Vec<String>> {
    wait_workers_in(e, e, n)
}

/// [`wait_workers`] for the machines of `e` whose Pods run in `hosting`.
fn wait_workers_in(e: &E2e, hosting: &E2e, n: usize) -> Result<Vec<String>> {
    wait(
        &format!("{n} worker machines up, no other machine Pods"),
        emulated(Duration::from_secs(420)),
        || workers_up_in(e, hosting, n),
    )
}

/// One look for [`wait_workers_in`]: the worker KVMMachine names once exactly `n` worker machines
/// are up and only their Pods (plus the control plane's) exist in `hosting`.
fn workers_up_in(e: &E2e, hosting: &E2e, n: usize) -> Result<Option<Vec<String>>> {
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

fn control_plane_kvmmachines(e: &E2e) -> Result<Vec<String>> {
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
fn assert_nothing_left_for(e: &E2e, gone: &[String]) -> Result<()> {
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
fn logs(e: &E2e, machine: &str, previous: bool) -> Result<String> {
    let pod = MachinePod::of(e, machine)?;
    let mut args = vec!["-n", &pod.namespace, "logs", &pod.name, "-c", "launcher"];
    if previous {
        args.push("--previous");
    }
    e.kubectl(&args)
}

/// `kubectl exec POD -c launcher -- ARGS...` in KVMMachine `machine`'s Pod: its stdout.
fn exec_launcher(e: &E2e, machine: &str, command: &[&str]) -> Result<String> {
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

fn launcher_status(e: &E2e, machine: &str) -> Result<Value> {
    let text = exec_launcher(e, machine, &["capk-launcher", "status"])?;
    serde_json::from_str(&text).with_context(|| format!("capk-launcher status: {text}"))
}

/// QEMU's uid and gid in a machine Pod: the launcher's `--qemu-uid`/`--qemu-gid` default, which
/// the controller does not change.
const QEMU_ID: &str = "107";

/// What the launcher promises of QEMU in a real machine Pod, read from QEMU's
/// `/proc/<pid>/status` through `kubectl exec` (`status`: the launcher's, naming QEMU's pid): it
/// runs as the unprivileged user with no root group, no capability in any set, `no_new_privs`
/// and its `-sandbox` seccomp filter, so a guest that escapes into QEMU holds none of the
/// privileged Pod's powers.
fn qemu_runs_unprivileged(e: &E2e, machine: &str, status: &Value) -> Result<()> {
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
fn set_paused(e: &E2e, paused: bool) -> Result<()> {
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

fn restart_count(e: &E2e, machine: &str) -> Result<i64> {
    Ok(launcher_restarts(&machine_pod(e, machine)?))
}

/// How often a machine Pod's launcher container restarted (its VM with it).
fn launcher_restarts(pod: &Value) -> i64 {
    pod["status"]["containerStatuses"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["name"] == "launcher"))
        .and_then(|c| c["restartCount"].as_i64())
        .unwrap_or(0)
}

/// `kill -9` of the QEMU in KVMMachine `machine`'s Pod, from inside the Pod, as a user with
/// `kubectl exec` would; returns once the launcher container has restarted.
fn kill_qemu(e: &E2e, machine: &str, timeout: Duration) -> Result<()> {
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

fn set_controller_replicas(e: &E2e, n: u32) -> Result<()> {
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

/// What step 1 leaves for the others.
struct ControlPlane {
    kvmmachine: String,
    first_marker: String,
}

fn the_journey(e: &E2e) -> Result<()> {
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
fn create_cluster(e: &E2e) -> Result<ControlPlane> {
    // --- 0. a clean namespace -----------------------------------------------------------------------
    fresh_namespace(e)?;

    // --- 1. create ------------------------------------------------------------------------------------
    let version = capk_tests::pinned_version("KUBERNETES_VERSION");
    let manifest = e.clusterctl(
        &[
            "generate",
            "cluster",
            CLUSTER,
            "--infrastructure",
            "kvm",
            "--flavor",
            "ignition",
            "--target-namespace",
            ns(),
            "--kubernetes-version",
            &version,
            "--control-plane-machine-count",
            "1",
            "--worker-machine-count",
            "0",
        ],
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
fn fresh_namespace(e: &E2e) -> Result<()> {
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
fn create_tenant_namespace(e: &E2e) -> Result<()> {
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
fn control_plane_endpoints(e: &E2e) -> Result<Vec<(String, bool)>> {
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
fn curl_readyz(e: &E2e, cluster_ip: &str) -> Result<String> {
    curl_readyz_at(e, &format!("https://{cluster_ip}:6443"))
}

/// `curl -k <server>/readyz` from the host; `server` is `https://<host>:<port>`, as a kubeconfig
/// names it. `-k`: the test guest's stand-in apiserver has a self-signed certificate.
fn curl_readyz_at(e: &E2e, server: &str) -> Result<String> {
    let mut curl = Command::new("curl");
    curl.args(["-ksS", "--max-time", "5", &format!("{server}/readyz")]);
    e.run(curl, None)
}

/// Step 1b: the control-plane Service sends traffic to the control plane only while its
/// apiserver answers: frozen (QMP `stop`), the VM leaves the Service's ready endpoints; resumed,
/// it is back. The stand-in apiserver of the test guest answers `/readyz` since its `kubeadm
/// init`.
fn control_plane_endpoint_follows_its_apiserver(e: &E2e, cp: &str) -> Result<()> {
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
fn prepare_workers(e: &E2e) -> Result<()> {
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
fn apply_worker_bootstrap_secret(e: &E2e) -> Result<()> {
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

fn scale_upgrade_faults_pause_delete(e: &E2e, cp: &str, first_marker: &str) -> Result<()> {
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
fn delete_cluster_and_namespace(e: &E2e) -> Result<()> {
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

#[test]
#[ignore = "end to end on the local management cluster: `make e2e`"]
fn cluster_journey_on_the_local_management_cluster() {
    run_scenario("capk-e2e", the_journey);
}

#[test]
#[ignore = "a real workload cluster on the local management cluster, minutes under TCG: `make e2e`"]
fn workload_cluster_journey_on_the_local_management_cluster() {
    run_scenario("capk-e2e-workload", workload::workload_journey);
}

#[test]
#[ignore = "metrics scraped by Prometheus and the controller under the VPA, on the local management cluster: `make e2e`"]
fn operating_the_controller_on_the_local_management_cluster() {
    run_scenario("capk-e2e-operating", operating::operating_journey);
}

#[test]
#[ignore = "a ClusterClass cluster reached through a NodePort, a variable changed, on the local management cluster: `make e2e`"]
fn cluster_class_journey_on_the_local_management_cluster() {
    run_scenario("capk-e2e-topology", topology::topology_journey);
}

#[test]
#[ignore = "clusterctl move between two local management clusters: `make e2e-move`"]
fn cluster_move_between_management_clusters() {
    run_scenario("capk-e2e-move", pivot::move_journey);
}

/// Resident KiB of QEMU's guest-RAM mapping: the anonymous mapping whose size is the guest's
/// memory (`/proc/PID/smaps`).
fn guest_ram_rss_kib(pid: u32, guest_kib: u64) -> Result<u64> {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps"))?;
    let mut size_matches = false;
    for line in smaps.lines() {
        let mut f = line.split_whitespace();
        match (f.next(), f.next()) {
            (Some("Size:"), Some(kib)) => size_matches = kib.parse::<u64>().ok() == Some(guest_kib),
            (Some("Rss:"), Some(kib)) if size_matches => return Ok(kib.parse()?),
            _ => {}
        }
    }
    bail!("no {guest_kib} KiB mapping in /proc/{pid}/smaps")
}

/// A machine Pod's memory from its cgroup (v1, cgroupfs driver: kubepods/[<qos>/]pod<uid>):
/// working set (usage minus inactive file cache), and
/// the processes in it with their RSS.
struct PodMemory {
    working_set_kib: u64,
    qemu_rss_kib: u64,
    launcher_rss_kib: u64,
    guest_ram_rss_kib: u64,
}

/// The cgroup directory of KVMMachine `machine`'s Pod under a cgroup v1 `controller` (`memory`,
/// `cpuacct`; cgroupfs driver): kubepods/[<qos>/]pod<uid>.
fn pod_cgroup(e: &E2e, machine: &str, controller: &str) -> Result<PathBuf> {
    let p = machine_pod(e, machine)?;
    let uid = p["metadata"]["uid"].as_str().context("pod uid")?;
    // Guaranteed Pods sit directly under kubepods, the others under their QoS class.
    let qos = match p["status"]["qosClass"].as_str() {
        Some("Burstable") => "burstable/",
        Some("BestEffort") => "besteffort/",
        _ => "",
    };
    Ok(PathBuf::from(format!(
        "/sys/fs/cgroup/{controller}/kubepods/{qos}pod{uid}"
    )))
}

/// CPU time the processes of KVMMachine `machine`'s Pod (QEMU and the launcher) have used, from
/// its cgroup's `cpuacct.usage`.
fn pod_cpu_time(e: &E2e, machine: &str) -> Result<Duration> {
    let file = pod_cgroup(e, machine, "cpuacct")?.join("cpuacct.usage");
    let ns: u64 = std::fs::read_to_string(&file)
        .with_context(|| file.display().to_string())?
        .trim()
        .parse()
        .with_context(|| file.display().to_string())?;
    Ok(Duration::from_nanos(ns))
}

/// [`PodMemory`] of KVMMachine `machine`'s Pod.
fn pod_memory(e: &E2e, machine: &str, guest_kib: u64) -> Result<PodMemory> {
    let dir = pod_cgroup(e, machine, "memory")?;
    let read = |f: &str| {
        std::fs::read_to_string(dir.join(f)).with_context(|| format!("{}/{f}", dir.display()))
    };
    let usage: u64 = read("memory.usage_in_bytes")?.trim().parse()?;
    let inactive_file: u64 = read("memory.stat")?
        .lines()
        .find_map(|l| l.strip_prefix("total_inactive_file "))
        .context("total_inactive_file")?
        .trim()
        .parse()?;
    let mut m = PodMemory {
        working_set_kib: usage.saturating_sub(inactive_file) / 1024,
        qemu_rss_kib: 0,
        launcher_rss_kib: 0,
        guest_ram_rss_kib: 0,
    };
    for entry in std::fs::read_dir(&dir)? {
        let procs = entry?.path().join("cgroup.procs");
        let Ok(text) = std::fs::read_to_string(&procs) else {
            continue;
        };
        for pid in text.lines().filter_map(|l| l.trim().parse::<u32>().ok()) {
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
            let rss: u64 = status
                .lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
                .unwrap_or(0);
            match comm.trim() {
                c if c.starts_with("qemu-system") => {
                    m.qemu_rss_kib = rss;
                    m.guest_ram_rss_kib = guest_ram_rss_kib(pid, guest_kib)?;
                }
                "capk-launcher" => m.launcher_rss_kib = rss,
                _ => {}
            }
        }
    }
    if m.qemu_rss_kib == 0 {
        bail!("no QEMU process in {}", dir.display());
    }
    Ok(m)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// `make bench-e2e`: Machine created -> guest up for 10 workers, one at a time (each measured
/// alone: 2 cores under TCG), and each machine Pod's memory beyond the guest's RAM.
fn bench(e: &E2e) -> Result<()> {
    const MACHINES: usize = 10;
    const GUEST_KIB: u64 = 256 * 1024;
    create_cluster(e)?;
    prepare_workers(e)?;
    let mut seconds = Vec::new();
    let mut seen: Vec<String> = Vec::new();
    for n in 1..=MACHINES {
        let start = Instant::now();
        e.kubectl(&[
            "-n",
            ns(),
            "scale",
            "machinedeployment",
            "e2e-md-0",
            &format!("--replicas={n}"),
        ])?;
        // The new worker's KVMMachine reports BootstrapCompleted: the guest is up and its
        // bootstrap ran (what makes CAPI's Machine provisioned).
        let new = loop {
            if start.elapsed() > Duration::from_secs(300) {
                bail!("worker {n} not up after 300s");
            }
            let up: Vec<String> = e
                .items("kvmmachines", Some("!cluster.x-k8s.io/control-plane"))?
                .iter()
                .filter(|k| condition_true(k, "BootstrapCompleted"))
                .map(|k| name(k).to_owned())
                .filter(|k| !seen.contains(k))
                .collect();
            if let Some(k) = up.into_iter().next() {
                break k;
            }
            sleep(Duration::from_millis(200));
        };
        let s = start.elapsed().as_secs_f64();
        eprintln!("bench-e2e: worker {n}/{MACHINES} {new} up in {s:.1}s");
        seconds.push(s);
        seen.push(new);
    }
    let mut sorted = seconds.clone();
    sorted.sort_by(f64::total_cmp);
    let mut overhead = Vec::new();
    for k in &seen {
        let m = pod_memory(e, k, GUEST_KIB)?;
        let beyond = m.working_set_kib.saturating_sub(m.guest_ram_rss_kib) as f64 / 1024.0;
        eprintln!(
            "bench-e2e: {k}: pod working set {:.0} MiB, QEMU RSS {:.0} MiB (guest RAM resident {:.0} of {} MiB), launcher RSS {:.1} MiB, beyond guest RAM {beyond:.0} MiB",
            m.working_set_kib as f64 / 1024.0,
            m.qemu_rss_kib as f64 / 1024.0,
            m.guest_ram_rss_kib as f64 / 1024.0,
            GUEST_KIB / 1024,
            m.launcher_rss_kib as f64 / 1024.0,
        );
        overhead.push(beyond);
    }
    overhead.sort_by(f64::total_cmp);
    println!(
        "bench-e2e: machine created -> guest up over {MACHINES} workers (TCG, one at a time): P50 {:.1}s P95 {:.1}s (target P50 <= 10s)",
        percentile(&sorted, 0.5),
        percentile(&sorted, 0.95)
    );
    println!(
        "bench-e2e: machine Pod memory beyond the guest's RAM (QEMU + launcher, cgroup working set minus resident guest RAM, 1 vCPU / 256 MiB TCG guest): P50 {:.0} MiB max {:.0} MiB (target <= 100 MiB)",
        percentile(&overhead, 0.5),
        overhead.last().copied().unwrap_or_default()
    );
    e.kubectl(&["-n", ns(), "delete", "cluster", CLUSTER, "--timeout=300s"])?;
    e.kubectl(&["delete", "namespace", ns(), "--timeout=120s"])?;
    Ok(())
}

#[test]
#[ignore = "benchmark on the local management cluster: `make bench-e2e`"]
fn bench_e2e_machine_boot_and_pod_overhead() {
    run_scenario("capk-bench", bench);
}

#[test]
#[ignore = "benchmark of real nodes on the local management cluster: `make bench-e2e-workload`"]
fn bench_e2e_workload_nodes() {
    run_scenario("capk-bench-workload", workload::workload_bench);
}

#[test]
#[ignore = "benchmark of an idle real cluster on the local management cluster: `make bench-idle-nodes`"]
fn bench_idle_nodes() {
    run_scenario("capk-bench-idle", workload::idle_nodes_bench);
}
