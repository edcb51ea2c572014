//! Operating the provider (`make e2e` and `make e2e-operating`): the controller's metrics as
//! a real Prometheus scrapes them, and the shipped VerticalPodAutoscaler object under the real
//! VPA. `CAPK_DEV_VPA=1 CAPK_DEV_MONITORING=1 make dev-up` installs them (hack/dev/vpa.sh:
//! metrics-server, the VPA's recommender, updater and admission controller; hack/dev/monitoring.sh:
//! Prometheus scraping the controller's HTTPS /metrics with a ServiceAccount token bound to
//! `capkvm-metrics-reader`, and evaluating the shipped alert rules).
//!
//! 0. The components run, else the test fails naming the command that installs them; a
//!    controller Pod changed by an earlier run is replaced by a pristine one.
//! 1. `vpa.yaml` of the release is applied where the provider runs, as docs/operating.md says.
//! 2. A cluster as the stub journey makes it (one control-plane machine, test guest): its machine
//!    Pod is created while the VPA's admission controller is called for every Pod.
//! 3. One PromQL query per metric family returns the controller's series, through the Service's
//!    scrape; the shipped alert rules load and evaluate, and `CAPKControllerDown` is silent.
//! 4. The VPA publishes a recommendation for the container `manager`.
//! 5. The updater replaces the controller Pod (the Deployment's requests, 10m and 32 MiB, lie below
//!    the recommendation's lower bound: upstream's recommender never recommends less than 25m and
//!    250 MiB per Pod), and the new Pod gets the recommended requests from the admission
//!    controller, under the Deployment's memory limit (`controlledValues: RequestsOnly`).
//! 6. The machine Pod was not touched: the same Pod (no eviction, no restart) and no VPA
//!    annotation.
//! 7. The VPA and the cluster are deleted.

use super::*;

/// Where the dev MC's components come from, named when they are missing.
const INSTALLED_BY: &str =
    "CAPK_DEV_VPA=1 CAPK_DEV_MONITORING=1 make dev-up (make e2e and make e2e-operating do it)";
/// The shipped VPA object's name (manifests/components/vpa/vpa.yaml).
const VPA: &str = "capkvm-controller-manager";
/// The controller Pods' label.
const CONTROLLER_PODS: &str = "app.kubernetes.io/name=capk-controller";
/// Prometheus' HTTP API through the apiserver's service proxy (hack/dev/monitoring.sh).
const PROMETHEUS_API: &str =
    "/api/v1/namespaces/monitoring/services/http:prometheus:web/proxy/api/v1";
/// The scrape job: the metrics Service's name, as the ServiceMonitor gives it.
const JOB: &str = r#"job="capkvm-controller-metrics""#;

pub(crate) fn operating_journey(e: &E2e) -> Result<()> {
    require_components(e)?;
    let template = controller_template_resources(e)?;
    pristine_controller(e)?;
    let before = controller_pod(e)?;

    // --- 1. the shipped VPA object, where the provider runs ------------------------------------------
    let vpa_file = e.root.join("manifests/components/vpa/vpa.yaml");
    e.kubectl(&["apply", "-n", CAPK_NS, "-f", &vpa_file.to_string_lossy()])?;
    eprintln!("e2e: operating 1. vpa.yaml applied in {CAPK_NS}");

    // --- 2. a cluster, its machine Pod made while the admission controller is called --------------------
    let ControlPlane { kvmmachine: cp, .. } = create_cluster(e)?;
    let cp_pod = machine_pod(e, &cp)?;
    let machine_uid = cp_pod["metadata"]["uid"].clone();
    let machine_restarts = restart_count(e, &cp)?;

    // --- 3. metrics, scraped by Prometheus -------------------------------------------------------------
    metric_families_have_data(e)?;
    alert_rules_evaluate(e)?;

    // --- 4. a recommendation -----------------------------------------------------------------------------
    let recommendation = wait(
        "the VPA's recommendation for the controller",
        Duration::from_secs(300),
        || vpa_recommendation(e),
    )?;
    eprintln!("e2e: operating 4. recommendation for manager: {recommendation}");

    // --- 5. the updater replaces the controller Pod; the admission controller sets its requests -----------
    let before_uid = before["metadata"]["uid"].clone();
    let after = wait(
        "the controller Pod replaced by the VPA's updater",
        Duration::from_secs(300),
        || {
            let pod = controller_pod(e)?;
            Ok(
                (pod["metadata"]["uid"] != before_uid && condition_true(&pod, "Ready"))
                    .then_some(pod),
            )
        },
    )?;
    let evicted = e.json(&[
        "-n",
        CAPK_NS,
        "get",
        "events",
        "--field-selector",
        &format!("involvedObject.name={},reason=EvictedByVPA", name(&before)),
    ])?;
    assert!(
        !evicted["items"].as_array().is_none_or(Vec::is_empty),
        "no EvictedByVPA event for the old controller Pod {}: something else replaced it",
        name(&before)
    );
    let annotations = &after["metadata"]["annotations"];
    let updates = annotations["vpaUpdates"].as_str().unwrap_or_default();
    assert!(
        updates.contains("cpu request") && updates.contains("memory request"),
        "the new controller Pod {} lacks the admission controller's vpaUpdates annotation: {annotations}",
        name(&after)
    );
    let manager = manager_container(&after)?;
    // The recommendation may move between the admission and this read: bounds, not the target.
    let recommendation = vpa_recommendation(e)?.context("the recommendation went away")?;
    for resource in ["cpu", "memory"] {
        let got = quantity(&manager["resources"]["requests"][resource])?;
        let lower = quantity(&recommendation["lowerBound"][resource])?;
        let upper = quantity(&recommendation["upperBound"][resource])?;
        assert!(
            lower <= got && got <= upper,
            "{resource} request {got} of {} is outside the recommendation [{lower}, {upper}]: {recommendation}",
            name(&after)
        );
        assert_ne!(
            got,
            quantity(&template["requests"][resource])?,
            "{resource} request of {} is still the Deployment's",
            name(&after)
        );
    }
    assert_eq!(
        quantity(&manager["resources"]["limits"]["memory"])?,
        quantity(&template["limits"]["memory"])?,
        "RequestsOnly: the memory limit stays the Deployment's"
    );
    eprintln!(
        "e2e: operating 5. {} evicted by the VPA; {} admitted with requests {}",
        name(&before),
        name(&after),
        manager["resources"]["requests"]
    );

    // --- 6. the machine Pod was left alone ---------------------------------------------------------------
    let cp_pod = machine_pod(e, &cp)?;
    assert_eq!(
        cp_pod["metadata"]["uid"], machine_uid,
        "machine Pod {cp} was replaced"
    );
    assert_eq!(
        restart_count(e, &cp)?,
        machine_restarts,
        "machine Pod {cp} restarted"
    );
    let vpa_keys: Vec<&String> = cp_pod["metadata"]["annotations"]
        .as_object()
        .map(|a| a.keys().filter(|k| k.starts_with("vpa")).collect())
        .unwrap_or_default();
    assert!(
        vpa_keys.is_empty(),
        "the VPA's admission controller changed machine Pod {cp}: {vpa_keys:?}"
    );
    eprintln!("e2e: operating 6. machine Pod {cp} untouched by the VPA");

    // --- 7. cleanup --------------------------------------------------------------------------------------
    e.kubectl(&["-n", CAPK_NS, "delete", "vpa", VPA, "--ignore-not-found"])?;
    e.kubectl(&["-n", ns(), "delete", "cluster", CLUSTER, "--timeout=300s"])?;
    e.kubectl(&["delete", "namespace", ns(), "--timeout=120s"])?;
    eprintln!("e2e: operating 7. VPA and cluster deleted");
    Ok(())
}

/// Fails, naming the command that installs them, unless metrics-server, the VPA's three
/// components and Prometheus are available.
fn require_components(e: &E2e) -> Result<()> {
    for (namespace, deployment) in [
        ("kube-system", "metrics-server"),
        ("kube-system", "vpa-recommender"),
        ("kube-system", "vpa-updater"),
        ("kube-system", "vpa-admission-controller"),
        ("monitoring", "prometheus"),
    ] {
        let d = e
            .json(&["-n", namespace, "get", "deployment", deployment])
            .with_context(|| {
                format!("{namespace}/{deployment} is not installed: run `{INSTALLED_BY}`")
            })?;
        if d["status"]["availableReplicas"].as_i64().unwrap_or(0) < 1 {
            bail!(
                "{namespace}/{deployment} is not available (kubectl -n {namespace} describe deployment {deployment}); `{INSTALLED_BY}` installs it"
            );
        }
    }
    Ok(())
}

/// The `manager` container's resources in the controller Deployment's Pod template.
fn controller_template_resources(e: &E2e) -> Result<Value> {
    let d = e.json(&["-n", CAPK_NS, "get", "deployment", CAPK_DEPLOYMENT])?;
    let containers = d["spec"]["template"]["spec"]["containers"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    containers
        .into_iter()
        .find(|c| c["name"] == "manager")
        .map(|c| c["resources"].clone())
        .context("no manager container in the controller Deployment")
}

/// No VPA left by an earlier run, and a controller Pod with the Deployment's own requests.
fn pristine_controller(e: &E2e) -> Result<()> {
    e.kubectl(&["-n", CAPK_NS, "delete", "vpa", VPA, "--ignore-not-found"])?;
    let pod = controller_pod(e)?;
    if pod["metadata"]["annotations"]["vpaUpdates"].is_null() {
        return Ok(());
    }
    eprintln!(
        "e2e: {} has requests from an earlier VPA: restarting the controller",
        name(&pod)
    );
    let old = pod["metadata"]["uid"].clone();
    e.kubectl(&[
        "-n",
        CAPK_NS,
        "rollout",
        "restart",
        "deployment",
        CAPK_DEPLOYMENT,
    ])?;
    e.kubectl(&[
        "-n",
        CAPK_NS,
        "rollout",
        "status",
        "deployment",
        CAPK_DEPLOYMENT,
        "--timeout=180s",
    ])?;
    wait("a fresh controller Pod", Duration::from_secs(120), || {
        let pod = controller_pod(e)?;
        Ok((pod["metadata"]["uid"] != old
            && condition_true(&pod, "Ready")
            && pod["metadata"]["annotations"]["vpaUpdates"].is_null())
        .then_some(()))
    })
}

/// The one controller Pod that is not being deleted.
fn controller_pod(e: &E2e) -> Result<Value> {
    let pods = e.json(&["-n", CAPK_NS, "get", "pods", "-l", CONTROLLER_PODS])?;
    let live: Vec<Value> = pods["items"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .filter(|p| p["metadata"]["deletionTimestamp"].is_null())
        .collect();
    match live.as_slice() {
        [pod] => Ok(pod.clone()),
        _ => bail!(
            "{} controller Pods (not deleting), not 1: {:?}",
            live.len(),
            live.iter().map(name).collect::<Vec<_>>()
        ),
    }
}

fn manager_container(pod: &Value) -> Result<Value> {
    pod["spec"]["containers"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["name"] == "manager"))
        .cloned()
        .with_context(|| format!("no manager container in {}", name(pod)))
}

/// The VPA's recommendation for `manager`, once it has one.
fn vpa_recommendation(e: &E2e) -> Result<Option<Value>> {
    let vpa = e.json(&["-n", CAPK_NS, "get", "vpa", VPA])?;
    Ok(vpa["status"]["recommendation"]["containerRecommendations"]
        .as_array()
        .and_then(|rs| rs.iter().find(|r| r["containerName"] == "manager"))
        .filter(|r| !r["target"]["memory"].is_null() && !r["target"]["cpu"].is_null())
        .cloned())
}

/// A Kubernetes quantity (`25m`, `262144k`, `250Mi`, `1`) as a number of base units.
fn quantity(v: &Value) -> Result<f64> {
    let s = v.as_str().with_context(|| format!("not a quantity: {v}"))?;
    let split = s.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(s.len());
    let (number, suffix) = s.split_at(split);
    let factor = match suffix {
        "" => 1.0,
        "m" => 1e-3,
        "k" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "Ki" => 1024.0,
        "Mi" => 1024.0 * 1024.0,
        "Gi" => 1024.0 * 1024.0 * 1024.0,
        "Ti" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        _ => bail!("quantity {s:?}: unknown suffix {suffix:?}"),
    };
    let n: f64 = number
        .parse()
        .with_context(|| format!("quantity {s:?}: {number:?} is not a number"))?;
    Ok(n * factor)
}

/// An instant PromQL query through the apiserver's service proxy; the result's series.
fn promql(e: &E2e, query: &str) -> Result<Vec<Value>> {
    let encoded: String = query
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect();
    let answer: Value = serde_json::from_str(&e.kubectl(&[
        "get",
        "--raw",
        &format!("{PROMETHEUS_API}/query?query={encoded}"),
    ])?)
    .context("Prometheus' answer")?;
    if answer["status"] != "success" {
        bail!("query {query}: {answer}");
    }
    Ok(answer["data"]["result"]
        .as_array()
        .cloned()
        .unwrap_or_default())
}

/// One query per metric family docs/operating.md lists returns the controller's series (what a
/// dashboard panel or an alert would show), each within a bounded wait.
fn metric_families_have_data(e: &E2e) -> Result<()> {
    let ns = ns();
    let queries: Vec<(&str, String, usize)> = vec![
        ("the scrape target is up", format!("up{{{JOB}}} == 1"), 1),
        (
            "reconciles per controller",
            format!(
                r#"sum by (controller) (controller_runtime_reconcile_total{{{JOB},controller=~"kvmcluster|kvmmachine"}}) > 0"#
            ),
            2,
        ),
        (
            "reconcile errors",
            format!(
                r#"controller_runtime_reconcile_errors_total{{{JOB},controller="kvmmachine"}}"#
            ),
            1,
        ),
        (
            "reconcile time, p99 as the dashboard shows it",
            format!(
                r#"histogram_quantile(0.99, sum by (le) (controller_runtime_reconcile_time_seconds_bucket{{{JOB},controller="kvmmachine"}})) >= 0"#
            ),
            1,
        ),
        (
            "max concurrent reconciles",
            format!("controller_runtime_max_concurrent_reconciles{{{JOB}}} > 0"),
            2,
        ),
        (
            "active workers",
            format!("controller_runtime_active_workers{{{JOB}}}"),
            2,
        ),
        (
            "work-queue work duration",
            format!(r#"workqueue_work_duration_seconds_count{{{JOB},name="kvmmachine"}} > 0"#),
            1,
        ),
        (
            "work-queue unfinished work",
            format!(r#"workqueue_unfinished_work_seconds{{{JOB},name="kvmmachine"}}"#),
            1,
        ),
        (
            "work-queue longest running reconcile",
            format!(r#"workqueue_longest_running_processor_seconds{{{JOB},name="kvmmachine"}}"#),
            1,
        ),
        (
            "requests to the apiserver",
            format!(r#"sum(rest_client_requests_total{{{JOB},code=~"2.."}}) > 0"#),
            1,
        ),
        (
            "process memory",
            format!("process_resident_memory_bytes{{{JOB}}} > 0"),
            1,
        ),
        (
            "the KVMCluster provisioned",
            format!(r#"capk_object_provisioned{{{JOB},kind="KVMCluster",namespace="{ns}"}} == 1"#),
            1,
        ),
        (
            "the KVMMachine provisioned",
            format!(r#"capk_object_provisioned{{{JOB},kind="KVMMachine",namespace="{ns}"}} == 1"#),
            1,
        ),
        (
            "the KVMMachine's creation time",
            format!(
                r#"capk_object_creation_timestamp_seconds{{{JOB},kind="KVMMachine",namespace="{ns}"}} > 0"#
            ),
            1,
        ),
        (
            "the KVMMachine's last reconcile",
            format!(
                r#"capk_object_last_reconciled_timestamp_seconds{{{JOB},kind="KVMMachine",namespace="{ns}"}} > 0"#
            ),
            1,
        ),
    ];
    for (what, query, series) in &queries {
        let result = wait(
            &format!("Prometheus: {what} ({query})"),
            Duration::from_secs(120),
            || {
                let result = promql(e, query)?;
                Ok((result.len() >= *series).then_some(result))
            },
        )?;
        let values: Vec<String> = result
            .iter()
            .map(|s| format!("{} = {}", s["metric"], s["value"][1]))
            .collect();
        eprintln!("e2e: operating 3. {what}: {}", values.join("; "));
    }
    Ok(())
}

/// The shipped alert rules are loaded and evaluate without error against the real series, and
/// the controller-down alert is silent while the controller is scraped.
fn alert_rules_evaluate(e: &E2e) -> Result<()> {
    let rules = wait(
        "Prometheus evaluated the shipped alert rules",
        Duration::from_secs(60),
        || {
            let answer: Value = serde_json::from_str(&e.kubectl(&[
                "get",
                "--raw",
                &format!("{PROMETHEUS_API}/rules"),
            ])?)?;
            let group = answer["data"]["groups"]
                .as_array()
                .and_then(|gs| gs.iter().find(|g| g["name"] == "capk"))
                .cloned();
            Ok(group.filter(|g| {
                g["rules"].as_array().is_some_and(|rs| {
                    rs.iter().all(|r| {
                        r["lastEvaluation"]
                            .as_str()
                            .is_some_and(|t| !t.starts_with("0001"))
                    })
                })
            }))
        },
    )?;
    let rules = rules["rules"].as_array().cloned().unwrap_or_default();
    let names: Vec<&str> = rules.iter().filter_map(|r| r["name"].as_str()).collect();
    let shipped_file = e
        .root
        .join("manifests/components/monitoring/monitoring.yaml");
    let shipped = std::fs::read_to_string(&shipped_file)?
        .lines()
        .filter(|l| l.trim_start().starts_with("- alert:"))
        .count();
    assert_eq!(
        names.len(),
        shipped,
        "the capk rule group in Prometheus against the {shipped} alerts of {}: {names:?}",
        shipped_file.display()
    );
    for r in &rules {
        assert_eq!(
            r["health"], "ok",
            "alert {} does not evaluate: {}",
            r["name"], r["lastError"]
        );
    }
    let down = promql(e, r#"ALERTS{alertname="CAPKControllerDown"}"#)?;
    assert!(
        down.is_empty(),
        "CAPKControllerDown while the controller is scraped: {down:?}"
    );
    eprintln!(
        "e2e: operating 3. alert rules loaded and healthy: {names:?}; CAPKControllerDown silent"
    );
    Ok(())
}
