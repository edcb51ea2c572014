//! The alerts of the monitoring component (`manifests/components/monitoring`): the
//! PrometheusRule's rule file passes upstream `promtool check rules`, its unit tests
//! (`alerts.test.yaml`) pass `promtool test rules` with a test that fires and one that stays
//! silent for every alert, and every series an alert reads exists: the controller's own, as it
//! renders them, or kube-state-metrics' standard Pod series.

use std::{collections::BTreeSet, path::Path, process::Command, sync::Arc};

use anyhow::{Context, Result, bail};
use capk_controller::metrics::Metrics;
use serde_json::Value;

/// kube-state-metrics' standard Pod series the alerts may use (and Prometheus' own `up`).
const KUBE_STATE_METRICS: &[&str] = &[
    "kube_pod_owner",
    "kube_pod_status_ready",
    "kube_pod_container_status_restarts_total",
    "kube_pod_deletion_timestamp",
    "up",
];

fn component_dir() -> std::path::PathBuf {
    capk_tests::repo_root().join("manifests/components/monitoring")
}

/// The PrometheusRule of monitoring.yaml.
fn prometheus_rule() -> Result<Value> {
    let text = std::fs::read_to_string(component_dir().join("monitoring.yaml"))?;
    for doc in serde_yaml_ng::Deserializer::from_str(&text) {
        let v: Value = serde::Deserialize::deserialize(doc)?;
        if v["kind"] == "PrometheusRule" {
            return Ok(v);
        }
    }
    bail!("monitoring.yaml has no PrometheusRule")
}

fn rules(rule: &Value) -> Vec<&Value> {
    rule["spec"]["groups"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|g| g["rules"].as_array().into_iter().flatten())
        .collect()
}

/// Runs `promtool ARGS` in `dir`; fails with its output.
fn promtool(dir: &Path, args: &[&str]) -> Result<String> {
    let bin = capk_tests::component("promtool", "make test-deps")?;
    let out = Command::new(&bin)
        .args(args)
        .current_dir(dir)
        .output()
        .with_context(|| format!("run {}", bin.display()))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if !out.status.success() {
        bail!("promtool {} failed:\n{text}", args.join(" "));
    }
    Ok(text)
}

#[test]
fn the_alerts_pass_promtools_check_and_their_unit_tests() -> Result<()> {
    let rule = prometheus_rule()?;
    let dir = tempfile::tempdir()?;
    std::fs::write(
        dir.path().join("rules.yaml"),
        serde_yaml_ng::to_string(&rule["spec"])?,
    )?;
    std::fs::copy(
        component_dir().join("alerts.test.yaml"),
        dir.path().join("alerts.test.yaml"),
    )?;
    promtool(dir.path(), &["check", "rules", "rules.yaml"])?;
    promtool(dir.path(), &["test", "rules", "alerts.test.yaml"])?;
    Ok(())
}

#[test]
fn every_alert_has_a_test_where_it_fires_and_one_where_it_is_silent() -> Result<()> {
    let tests: Value = serde_yaml_ng::from_str(&std::fs::read_to_string(
        component_dir().join("alerts.test.yaml"),
    )?)?;
    let (mut fires, mut silent) = (BTreeSet::new(), BTreeSet::new());
    for case in tests["tests"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|t| t["alert_rule_test"].as_array().into_iter().flatten())
    {
        let name = case["alertname"].as_str().context("alertname")?.to_owned();
        match case["exp_alerts"].as_array() {
            Some(a) if !a.is_empty() => fires.insert(name),
            _ => silent.insert(name),
        };
    }
    let rule = prometheus_rule()?;
    for r in rules(&rule) {
        let alert = r["alert"].as_str().context("alert name")?;
        assert!(fires.contains(alert), "no test where {alert} fires");
        assert!(silent.contains(alert), "no test where {alert} stays silent");
        for key in ["summary", "description"] {
            assert!(
                r["annotations"][key].is_string(),
                "{alert} has no {key} annotation"
            );
        }
        assert!(
            r["labels"]["severity"].is_string(),
            "{alert} has no severity"
        );
    }
    Ok(())
}

/// The metric names a PromQL expression selects: identifiers followed by `{` (the rules write
/// every selector with braces, so this finds them all).
fn selected_metrics(expr: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let chars: Vec<char> = expr.chars().collect();
    let (mut i, mut in_string) = (0, false);
    while i < chars.len() {
        let c = chars[i];
        if c == '"' {
            in_string = !in_string;
            i += 1;
            continue;
        }
        if !in_string && (c.is_ascii_alphabetic() || c == '_') {
            let start = i;
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || "_:".contains(chars[i])) {
                i += 1;
            }
            if chars[i..].iter().find(|c| !c.is_whitespace()) == Some(&'{') {
                out.insert(chars[start..i].iter().collect());
            }
            continue;
        }
        i += 1;
    }
    out
}

#[test]
fn the_alerts_read_only_series_that_exist() -> Result<()> {
    // The controller's series, as it renders them after a reconcile of a machine being deleted.
    let metrics = Arc::new(Metrics::new(16));
    {
        let _run = metrics.start("KVMMachine");
        metrics.finished(
            "KVMMachine",
            &Ok(kube::runtime::controller::Action::await_change()),
        );
    }
    let meta = serde_json::from_value(serde_json::json!({
        "name": "m", "namespace": "ns",
        "creationTimestamp": "2026-11-25T10:00:00Z", "deletionTimestamp": "2026-11-25T11:00:00Z"}))?;
    metrics.object("KVMMachine", &meta, false, false);
    let rendered: BTreeSet<String> = metrics
        .render()
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_owned)
        .collect();

    let rule = prometheus_rule()?;
    let mut used = BTreeSet::new();
    for r in rules(&rule) {
        let expr = r["expr"].as_str().context("expr")?;
        let selected = selected_metrics(expr);
        assert!(!selected.is_empty(), "no series found in {expr}");
        used.extend(selected);
    }
    for name in &used {
        assert!(
            rendered.contains(name) || KUBE_STATE_METRICS.contains(&name.as_str()),
            "an alert reads {name}, which neither the controller ({rendered:?}) nor \
             kube-state-metrics' Pod series provide"
        );
    }
    Ok(())
}

#[test]
fn selected_metrics_are_the_names_before_braces() {
    assert_eq!(
        selected_metrics(
            r#"max by (pod) (kube_pod_status_ready{condition="true"}) unless on (pod) x_y{}"#
        ),
        BTreeSet::from(["kube_pod_status_ready".to_owned(), "x_y".to_owned()])
    );
    assert!(selected_metrics(r#"absent(up{job="a{b"} == 1)"#).contains("up"));
}
