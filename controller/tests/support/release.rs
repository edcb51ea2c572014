//! The provider's clusterctl repository as `hack/release-manifests.sh` writes it, and the real
//! clusterctl run on it: what the manifests' tests (components, RBAC, flavors, ClusterClass)
//! read.

use std::{collections::BTreeMap, process::Command};

use anyhow::{Context, Result, anyhow, bail};
use kube::{
    Api, Client, ResourceExt,
    api::{DynamicObject, GroupVersionKind, Patch, PatchParams},
    discovery,
};
use serde_json::Value;

/// The clusterctl repository from `hack/release-manifests.sh`, written once per test binary:
/// the tests run in parallel and must not read files another test is rewriting.
pub fn release_dir() -> Result<std::path::PathBuf> {
    static DIR: std::sync::Mutex<Option<std::path::PathBuf>> = std::sync::Mutex::new(None);
    let mut dir = DIR.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(d) = dir.as_ref() {
        return Ok(d.clone());
    }
    let out = Command::new("bash")
        .arg(capk_tests::repo_root().join("hack/release-manifests.sh"))
        .output()
        .context("run hack/release-manifests.sh")?;
    if !out.status.success() {
        bail!(
            "hack/release-manifests.sh failed (run `make test-deps` first): {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let last = String::from_utf8(out.stdout)?
        .lines()
        .last()
        .context("release dir")?
        .to_owned();
    *dir = Some(last.clone().into());
    Ok(last.into())
}

pub fn docs(text: &str) -> Result<Vec<Value>> {
    let mut out = Vec::new();
    for doc in serde_yaml_ng::Deserializer::from_str(text) {
        let v: Value = serde::Deserialize::deserialize(doc)?;
        if !v.is_null() {
            out.push(v);
        }
    }
    Ok(out)
}

/// clusterctl's variable syntax: `${VAR}` and `${VAR:=default}`.
pub fn substitute(text: &str, vars: &BTreeMap<&str, &str>) -> Result<String> {
    let mut out = String::new();
    let mut rest = text;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let end = rest[start..].find('}').context("unclosed ${")? + start;
        let expr = &rest[start + 2..end];
        let (name, default) = match expr.split_once(":=") {
            Some((n, d)) => (n, Some(d)),
            None => (expr, None),
        };
        match (vars.get(name), default) {
            (Some(v), _) => out.push_str(v),
            (None, Some(d)) => out.push_str(d),
            (None, None) => bail!("template variable {name} has no value and no default"),
        }
        rest = &rest[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

pub async fn apply(client: &Client, obj: &Value, dry_run: bool) -> Result<()> {
    let obj: DynamicObject = serde_json::from_value(obj.clone())?;
    let types = obj.types.clone().context("apiVersion/kind")?;
    let gvk = GroupVersionKind::try_from(&types)?;
    let (ar, caps) = discovery::pinned_kind(client, &gvk).await?;
    let api: Api<DynamicObject> = match (&obj.metadata.namespace, caps.scope) {
        (Some(ns), discovery::Scope::Namespaced) => Api::namespaced_with(client.clone(), ns, &ar),
        _ => Api::all_with(client.clone(), &ar),
    };
    let mut pp = PatchParams::apply("capk-manifest-test")
        .force()
        .validation_strict();
    if dry_run {
        pp = pp.dry_run();
    }
    api.patch(&obj.name_any(), &pp, &Patch::Apply(&obj))
        .await
        .map_err(|e| anyhow!("{} {}: {e}", gvk.kind, obj.name_any()))?;
    Ok(())
}

/// Runs the real clusterctl (built from the Go module proxy) with no user configuration and
/// no version check; fails with its stderr.
pub fn clusterctl(args: &[&str], env: &[(&str, &str)]) -> Result<String> {
    let bin = capk_tests::component("clusterctl", "make test-deps")?;
    let home = tempfile::tempdir()?;
    let out = Command::new(bin)
        .args(args)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("HOME", home.path())
        .env("CLUSTERCTL_DISABLE_VERSIONCHECK", "true")
        .envs(env.iter().copied())
        .output()
        .context("run clusterctl")?;
    if !out.status.success() {
        bail!(
            "clusterctl {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8(out.stdout)?)
}

/// The components as `clusterctl init --infrastructure kvm` applies them, with no variables set:
/// what it runs before applying (variables and image references, which must be canonical, e.g.
/// localhost/capk/...:dev, not capk-controller:dev) on the release's infrastructure-components.yaml.
pub fn provider_components(release: &std::path::Path) -> Result<Vec<Value>> {
    let config = tempfile::Builder::new().suffix(".yaml").tempfile()?;
    std::fs::write(
        config.path(),
        format!(
            "providers:\n  - name: kvm\n    type: InfrastructureProvider\n    url: file://{}\n",
            release.join("infrastructure-components.yaml").display()
        ),
    )?;
    docs(&clusterctl(
        &[
            "generate",
            "provider",
            "--infrastructure",
            "kvm",
            "--config",
            &config.path().to_string_lossy(),
        ],
        &[],
    )?)
}
