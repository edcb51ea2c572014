//! The ClusterClass `kvm` as Cluster API's topology controller makes it for one Cluster: its
//! variables with their defaults, its inline patches (Go templates rendered by Cluster API's own
//! code through `cabpk-render`) and the objects CABPK bootstraps nodes from.

use std::collections::BTreeMap;

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use super::{node_boot::*, release::*};

/// RFC 6902 `add` of an object member, as the topology controller applies a ClusterClass's
/// inline patch: the parent must exist.
pub fn json_patch_add(target: &mut Value, path: &str, value: Value) -> Result<()> {
    let (parent_path, key) = path.rsplit_once('/').context("JSON pointer")?;
    let key = key.replace("~1", "/").replace("~0", "~");
    target
        .pointer_mut(parent_path)
        .and_then(Value::as_object_mut)
        .with_context(|| format!("{parent_path} is not an existing object"))?
        .insert(key, value);
    Ok(())
}

/// The ClusterClass file as `clusterctl generate yaml --from` renders it (with no variables: the
/// contract wants none in a ClusterClass definition).
pub fn class_objects() -> Result<Vec<Value>> {
    let file = release_dir()?.join("clusterclass-kvm.yaml");
    docs(&clusterctl(
        &["generate", "yaml", "--from", &file.to_string_lossy()],
        &[],
    )?)
}

/// `value` with the defaults of `schema` filled in where absent, as the apiserver's structural
/// defaulting (which Cluster API runs on a Cluster's variables) does: a parent's default first,
/// then its properties'.
pub fn with_defaults(schema: &Value, value: Option<&Value>) -> Option<Value> {
    let mut value = value.cloned().or_else(|| schema.get("default").cloned())?;
    if let (Some(obj), Some(props)) = (value.as_object_mut(), schema["properties"].as_object()) {
        for (name, prop) in props {
            if let Some(v) = with_defaults(prop, obj.get(name)) {
                obj.insert(name.clone(), v);
            }
        }
    }
    Some(value)
}

/// The values of the class's variables for `cluster`: its `spec.topology.variables`, else the
/// class's defaults, with the builtin variables the patches use.
pub fn topology_variables(cc: &Value, cluster: &Value, version: &str) -> Value {
    let set: BTreeMap<&str, &Value> = cluster["spec"]["topology"]["variables"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| Some((v["name"].as_str()?, &v["value"])))
        .collect();
    let mut vars = json!({"builtin": {
        "cluster": {"name": CLUSTER, "namespace": FLAVOR_NS},
        "controlPlane": {"version": version, "replicas": 1},
        "machineDeployment": {"version": version, "class": "default-worker", "replicas": 1},
    }});
    for v in cc["spec"]["variables"].as_array().into_iter().flatten() {
        let name = v["name"].as_str().unwrap_or_default();
        let schema = &v["schema"]["openAPIV3Schema"];
        if let Some(value) = with_defaults(schema, set.get(name).copied()) {
            vars[name] = value;
        }
    }
    vars
}

/// A ClusterClass patch's Go template (`valueFrom.template`, `enabledIf`) rendered by
/// `cabpk-render patch-template`: Cluster API's own template code.
pub fn render_patch_template(template: &str, variables: &Value) -> Result<Value> {
    let bin = capk_tests::component("cabpk-render", "make test-deps")?;
    let input = json!({"template": template, "variables": variables});
    let out = run_with_input(&bin, &["patch-template"], input.to_string().as_bytes())?;
    if out.trim_ascii().is_empty() {
        // An empty rendering (an `enabledIf` whose condition is false) is no value.
        return Ok(Value::Null);
    }
    Ok(serde_json::from_slice(&out)?)
}

/// The class's templates after its inline patches, as the topology controller makes them for
/// one Cluster.
pub struct Topology {
    pub kvm_cluster_template: Value,
    pub kcp_template: Value,
    pub kct: Value,
    pub control_plane_machine: Value,
    pub worker_machine: Value,
}

/// What the topology controller makes of the ClusterClass `kvm` for `cluster`: the class's
/// templates with each enabled patch applied where its selector points, each value taken from
/// `value`, a variable (`valueFrom.variable`, dotted) or a Go template (`valueFrom.template`).
pub fn topology(class: &[Value], cluster: &Value, version: &str) -> Result<Topology> {
    let by_kind_name = |kind: &str, name: &str| {
        class
            .iter()
            .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
            .cloned()
            .with_context(|| format!("no {kind} {name} in the class"))
    };
    let cc = class
        .iter()
        .find(|o| o["kind"] == "ClusterClass")
        .context("no ClusterClass")?;
    let cp = &cc["spec"]["controlPlane"];
    let md = &cc["spec"]["workers"]["machineDeployments"][0];
    let name = |r: &Value| {
        r["templateRef"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    };
    let mut t = Topology {
        kvm_cluster_template: by_kind_name(
            "KVMClusterTemplate",
            &name(&cc["spec"]["infrastructure"]),
        )?,
        kcp_template: by_kind_name("KubeadmControlPlaneTemplate", &name(cp))?,
        kct: by_kind_name("KubeadmConfigTemplate", &name(&md["bootstrap"]))?,
        control_plane_machine: by_kind_name(
            "KVMMachineTemplate",
            &name(&cp["machineInfrastructure"]),
        )?,
        worker_machine: by_kind_name("KVMMachineTemplate", &name(&md["infrastructure"]))?,
    };
    let md_class = md["class"].as_str().context("class")?;
    // A MachineDeployment's templates see its variable overrides in place of the Cluster's.
    let mut md_cluster = cluster.clone();
    let overrides =
        &cluster["spec"]["topology"]["workers"]["machineDeployments"][0]["variables"]["overrides"];
    if let Some(overrides) = overrides.as_array() {
        let mut merged: Vec<Value> = cluster["spec"]["topology"]["variables"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        merged.retain(|v| !overrides.iter().any(|o| o["name"] == v["name"]));
        merged.extend(overrides.iter().cloned());
        md_cluster["spec"]["topology"]["variables"] = json!(merged);
    }
    for (variables, control_plane_side) in [
        (topology_variables(cc, cluster, version), true),
        (topology_variables(cc, &md_cluster, version), false),
    ] {
        for patch in cc["spec"]["patches"].as_array().into_iter().flatten() {
            if let Some(cond) = patch["enabledIf"].as_str() {
                let enabled = render_patch_template(cond, &variables)?;
                // As Cluster API: enabled when the rendering is exactly `true`.
                if enabled != json!(true) {
                    continue;
                }
            }
            for def in patch["definitions"].as_array().into_iter().flatten() {
                let selector = &def["selector"];
                let control_plane =
                    control_plane_side && selector["matchResources"]["controlPlane"] == json!(true);
                let worker = !control_plane_side
                    && selector["matchResources"]["machineDeploymentClass"]["names"]
                        .as_array()
                        .is_some_and(|n| n.contains(&json!(md_class)));
                let mut targets: Vec<&mut Value> = Vec::new();
                match selector["kind"].as_str() {
                    Some("KVMClusterTemplate") => {
                        if control_plane_side
                            && selector["matchResources"]["infrastructureCluster"] == json!(true)
                        {
                            targets.push(&mut t.kvm_cluster_template);
                        }
                    }
                    Some("KubeadmControlPlaneTemplate") => {
                        if control_plane {
                            targets.push(&mut t.kcp_template);
                        }
                    }
                    Some("KubeadmConfigTemplate") => {
                        if worker {
                            targets.push(&mut t.kct);
                        }
                    }
                    Some("KVMMachineTemplate") => {
                        if control_plane {
                            targets.push(&mut t.control_plane_machine);
                        }
                        if worker {
                            targets.push(&mut t.worker_machine);
                        }
                    }
                    other => bail!("patch {} selects {other:?}", patch["name"]),
                }
                if targets.is_empty() {
                    continue;
                }
                for p in def["jsonPatches"].as_array().into_iter().flatten() {
                    assert_eq!(p["op"], "add", "{p}");
                    let value = if let Some(v) = p.get("value") {
                        v.clone()
                    } else if let Some(var) = p["valueFrom"]["variable"].as_str() {
                        let pointer = format!("/{}", var.replace('.', "/"));
                        variables
                            .pointer(&pointer)
                            .cloned()
                            .with_context(|| format!("variable {var} has no value"))?
                    } else {
                        let template = p["valueFrom"]["template"].as_str().context("template")?;
                        render_patch_template(template, &variables)?
                    };
                    for target in targets.iter_mut() {
                        json_patch_add(target, p["path"].as_str().context("path")?, value.clone())?;
                    }
                }
            }
        }
    }
    Ok(t)
}

/// The topology as the KubeadmControlPlane, KubeadmConfigTemplate and MachineDeployment the
/// topology controller creates, for CABPK's bootstrap code.
pub fn topology_objects(class: &[Value], cluster: &Value, version: &str) -> Result<String> {
    let t = topology(class, cluster, version)?;
    let kcp = json!({
        "apiVersion": "controlplane.cluster.x-k8s.io/v1beta2", "kind": "KubeadmControlPlane",
        "metadata": {"name": format!("{CLUSTER}-x2k9d"), "namespace": FLAVOR_NS},
        "spec": {
            "replicas": 1, "version": version,
            "machineTemplate": {"spec": {"infrastructureRef": {
                "apiGroup": "infrastructure.cluster.x-k8s.io", "kind": "KVMMachineTemplate",
                "name": format!("{CLUSTER}-control-plane-f7h2k")}}},
            "kubeadmConfigSpec": t.kcp_template["spec"]["template"]["spec"]["kubeadmConfigSpec"],
        },
    });
    let md = json!({
        "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "MachineDeployment",
        "metadata": {"name": format!("{CLUSTER}-md-0-p4x7z"), "namespace": FLAVOR_NS},
        "spec": {"clusterName": CLUSTER, "template": {"spec": {
            "clusterName": CLUSTER, "version": version,
            "bootstrap": {"configRef": {"apiGroup": "bootstrap.cluster.x-k8s.io",
                "kind": "KubeadmConfigTemplate", "name": t.kct["metadata"]["name"]}},
            "infrastructureRef": {"apiGroup": "infrastructure.cluster.x-k8s.io",
                "kind": "KVMMachineTemplate", "name": "kvm-default-worker"}}}},
    });
    let mut kct = t.kct;
    kct["metadata"]["namespace"] = json!(FLAVOR_NS);
    let mut out = String::new();
    for o in [cluster, &kcp, &kct, &md] {
        out.push_str("---\n");
        out.push_str(&serde_yaml_ng::to_string(o)?);
    }
    Ok(out)
}

/// The labels Cluster API gives the Machines of a flavor's KubeadmControlPlane or
/// MachineDeployment `o` (its own, and its machine template's).
pub fn machine_labels(o: &Value) -> BTreeMap<String, String> {
    let name = o["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let (own, template) = match o["kind"].as_str() {
        Some("KubeadmControlPlane") => (
            [
                ("cluster.x-k8s.io/control-plane", String::new()),
                ("cluster.x-k8s.io/control-plane-name", name),
            ],
            &o["spec"]["machineTemplate"]["metadata"]["labels"],
        ),
        _ => (
            [
                ("cluster.x-k8s.io/deployment-name", name),
                ("cluster.x-k8s.io/cluster-name", CLUSTER.to_owned()),
            ],
            &o["spec"]["template"]["metadata"]["labels"],
        ),
    };
    let mut labels: BTreeMap<String, String> =
        own.into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
    for (k, v) in template.as_object().into_iter().flatten() {
        labels.insert(k.clone(), v.as_str().unwrap_or_default().to_owned());
    }
    labels
}
