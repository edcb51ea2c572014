//! The ClusterClass and its topology, rendered as Cluster API's topology controller would: its
//! clusterctl contract, variables reaching the machine templates, the sysext of the cluster's
//! version, and the MachineHealthChecks of every flavor.

mod support;

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use capk_bootstrap::BootstrapFormat;
use capk_tests::env::TestEnv;
use serde_json::{Value, json};
use support::create_namespace;
use support::{node_boot::*, release::*, topology::*};

/// Every non-topology flavor ships a MachineHealthCheck for the control plane and one for the
/// workers, each selecting exactly the Machines it is for, with the timeouts of its variables;
/// MACHINE_HEALTH_CHECK_ENABLED=false leaves them selecting no Machine at all.
#[test]
fn machine_health_checks_cover_the_flavors_machines_unless_turned_off() -> Result<()> {
    for flavor in [
        "cluster-template.yaml",
        "cluster-template-node-image.yaml",
        "cluster-template-ignition.yaml",
    ] {
        for enabled in [None, Some("false")] {
            let mut env = vec![
                ("KVM_NODE_IMAGE", NODE_IMAGE),
                ("MACHINE_HEALTH_CHECK_UNHEALTHY_SECONDS", "120"),
            ];
            env.extend(enabled.map(|e| ("MACHINE_HEALTH_CHECK_ENABLED", e)));
            let objs = docs(&generate_flavor(flavor, &env)?)?;
            let of_kind = |kind: &'static str| objs.iter().filter(move |o| o["kind"] == kind);
            let owners: Vec<(&Value, BTreeMap<String, String>)> = of_kind("KubeadmControlPlane")
                .chain(of_kind("MachineDeployment"))
                .map(|o| (o, machine_labels(o)))
                .collect();
            let checks: Vec<&Value> = of_kind("MachineHealthCheck").collect();
            assert_eq!(checks.len(), 2, "{flavor}");
            for mhc in checks {
                let what = format!("{flavor} {enabled:?} {}", mhc["metadata"]["name"]);
                assert_eq!(mhc["spec"]["clusterName"], CLUSTER, "{what}");
                let selector = mhc["spec"]["selector"]["matchLabels"]
                    .as_object()
                    .context("matchLabels")?;
                let selected: Vec<&str> = owners
                    .iter()
                    .filter(|(_, labels)| {
                        selector
                            .iter()
                            .all(|(k, v)| labels.get(k).map(String::as_str) == v.as_str())
                    })
                    .map(|(o, _)| o["kind"].as_str().unwrap_or_default())
                    .collect();
                let for_control_plane = mhc["metadata"]["name"]
                    .as_str()
                    .is_some_and(|n| n.ends_with("-control-plane"));
                let want: &[&str] = match (enabled, for_control_plane) {
                    (Some(_), _) => &[],
                    (None, true) => &["KubeadmControlPlane"],
                    (None, false) => &["MachineDeployment"],
                };
                assert_eq!(selected, want, "{what}");
                let checks = &mhc["spec"]["checks"];
                assert_eq!(checks["nodeStartupTimeoutSeconds"], 1800, "{what}");
                for c in checks["unhealthyNodeConditions"]
                    .as_array()
                    .context("conditions")?
                {
                    assert_eq!(c["type"], "Ready", "{what}");
                    assert_eq!(c["timeoutSeconds"], 120, "{what}");
                }
                // A second control-plane replacement at once would risk etcd's quorum.
                if for_control_plane {
                    assert_eq!(
                        mhc["spec"]["remediation"]["triggerIf"]["unhealthyLessThanOrEqualTo"], 1,
                        "{what}"
                    );
                }
            }
        }
    }
    Ok(())
}

/// The topology flavor: the ClusterClass's patch brings the sysext of the Cluster's version
/// (and the mirror the Cluster names in its variables) to every machine.
#[test]
fn topology_class_brings_the_sysext_of_the_cluster_version() -> Result<()> {
    let version = kubernetes_version();
    let class = class_objects()?;
    for (base, env) in [
        (UPSTREAM_SYSEXT, vec![]),
        (
            MIRROR_SYSEXT,
            vec![("FLATCAR_SYSEXT_BASE_URL", MIRROR_SYSEXT)],
        ),
    ] {
        let cluster = docs(&generate_flavor("cluster-template-topology.yaml", &env)?)?
            .into_iter()
            .next()
            .context("the Cluster")?;
        let objects = topology_objects(&class, &cluster, &version)?;
        for role in ROLES {
            let what = format!("{base} {role:?}");
            let (format, data) = cabpk_bootstrap(&objects, role).context(what.clone())?;
            assert_eq!(format, BootstrapFormat::Ignition, "{what}");
            let config = boot_ignition(format, &data, role).context(what.clone())?;
            assert_kubernetes_sysext(&config, base, &version, &what);
            assert_timeouts(&kubeadm_documents(&config)?, role, &default_timeouts(role));
        }
    }
    Ok(())
}

/// The ClusterClass definition as the clusterctl contract asks: no clusterctl variables, no
/// namespace anywhere (`kubectl apply -n` and `clusterctl generate cluster` place it), every
/// template it names in the file, every variable a patch reads declared with a default or
/// optional, and a MachineHealthCheck for the control plane and the workers.
#[test]
fn clusterclass_follows_the_clusterctl_contract() -> Result<()> {
    let file = release_dir()?.join("clusterclass-kvm.yaml");
    let listing = clusterctl(
        &[
            "generate",
            "yaml",
            "--from",
            &file.to_string_lossy(),
            "--list-variables",
        ],
        &[],
    )?;
    assert!(
        !listing.contains("- "),
        "the ClusterClass definition uses clusterctl variables: {listing}"
    );
    let class = class_objects()?;
    for o in &class {
        assert!(
            o["metadata"]["namespace"].is_null(),
            "{} {} names a namespace",
            o["kind"],
            o["metadata"]["name"]
        );
    }
    let cc = class
        .iter()
        .find(|o| o["kind"] == "ClusterClass")
        .context("no ClusterClass")?;
    let text = serde_json::to_string(cc)?;
    for r in text.split("\"templateRef\":").skip(1) {
        let r: Value = serde_json::Deserializer::from_str(r)
            .into_iter()
            .next()
            .context("templateRef")??;
        assert!(r["namespace"].is_null(), "{r}");
        assert!(
            class
                .iter()
                .any(|o| o["kind"] == r["kind"] && o["metadata"]["name"] == r["name"]),
            "the class refers to {r}, which the file lacks"
        );
    }
    let declared: Vec<&str> = cc["spec"]["variables"]
        .as_array()
        .context("variables")?
        .iter()
        .filter_map(|v| v["name"].as_str())
        .collect();
    for want in [
        "controlPlaneResources",
        "workerResources",
        "nodeImage",
        "etcdStorage",
    ] {
        assert!(declared.contains(&want), "no variable {want}: {declared:?}");
    }
    for p in cc["spec"]["patches"].as_array().context("patches")? {
        let p = serde_json::to_string(p)?;
        let mut vars: Vec<&str> = p
            .split("\"variable\":\"")
            .skip(1)
            .filter_map(|r| r.split(['"', '.']).next())
            .collect();
        // Go template actions: each `.name` they read.
        for action in p.split("{{").skip(1).filter_map(|a| a.split("}}").next()) {
            vars.extend(
                action
                    .split_whitespace()
                    .filter_map(|w| w.strip_prefix('.'))
                    .filter_map(|w| w.split('.').next()),
            );
        }
        for name in vars {
            assert!(
                name == "builtin" || declared.contains(&name),
                "a patch reads {name}, which the class does not declare"
            );
        }
    }
    for (what, hc) in [
        ("control plane", &cc["spec"]["controlPlane"]["healthCheck"]),
        (
            "workers",
            &cc["spec"]["workers"]["machineDeployments"][0]["healthCheck"],
        ),
    ] {
        let checks = &hc["checks"];
        assert!(
            checks["nodeStartupTimeoutSeconds"]
                .as_i64()
                .is_some_and(|s| s > 600),
            "{what}: an emulated node may need longer than kubeadm's own 10 minutes: {hc}"
        );
        assert!(
            checks["unhealthyNodeConditions"]
                .as_array()
                .is_some_and(|c| c.len() >= 2),
            "{what}: {hc}"
        );
    }
    Ok(())
}

/// The class's variables reach the KVMMachineTemplates it stamps out (sizes, node image, etcd
/// storage), a MachineDeployment's override in place of the Cluster's value, and the patched
/// templates are valid KVM objects for the real apiserver; a Cluster that sets nothing gets the
/// documented defaults.
#[tokio::test]
async fn topology_variables_reach_the_machine_templates() -> Result<()> {
    let version = kubernetes_version();
    let class = class_objects()?;
    let client = TestEnv::shared().client().await?;
    let ns = "topology-variables";
    create_namespace(&client, ns).await?;

    let defaults = topology(&class, &json!({"spec": {"topology": {}}}), &version)?;
    let spec = |t: &Value| t["spec"]["template"]["spec"].clone();
    let default_resources =
        json!({"cpu": 4, "memory": "8Gi", "disk": "40Gi", "dockerVolumeSize": "40Gi"});
    assert_eq!(
        spec(&defaults.control_plane_machine)["resources"],
        default_resources
    );
    assert_eq!(
        spec(&defaults.control_plane_machine)["etcdStorage"],
        json!({"type": "hostPath", "hostPath": "/var/lib/capk/etcd"})
    );
    assert_eq!(
        spec(&defaults.worker_machine)["resources"],
        default_resources
    );
    assert!(spec(&defaults.worker_machine)["image"].is_null());

    let image = json!({"containerImage": {"image": NODE_IMAGE}});
    let cluster = json!({"spec": {"topology": {
      "workers": {"machineDeployments": [{"class": "default-worker", "name": "md-0",
        "variables": {"overrides": [
          {"name": "workerResources", "value": {"cpu": 1, "memory": "2Gi", "disk": "20Gi",
            "kubeletVolumeSize": "5Gi"}},
        ]}}]},
      "variables": [
        {"name": "controlPlaneResources", "value": {"cpu": 2, "memory": "3Gi"}},
        {"name": "workerResources", "value": {"cpu": 8}},
        {"name": "nodeImage", "value": image},
        {"name": "etcdStorage", "value": {"type": "persistentVolume", "size": "10Gi",
            "storageClassName": "fast"}},
        {"name": "kubernetesSysext", "value": false},
    ]}}});
    let t = topology(&class, &cluster, &version)?;
    let cp = spec(&t.control_plane_machine);
    let worker = spec(&t.worker_machine);
    assert_eq!(
        cp["resources"],
        json!({"cpu": 2, "memory": "3Gi", "disk": "40Gi", "dockerVolumeSize": "40Gi"}),
        "unset sizes keep their defaults"
    );
    assert_eq!(
        worker["resources"],
        json!({"cpu": 1, "memory": "2Gi", "disk": "20Gi", "dockerVolumeSize": "40Gi",
               "kubeletVolumeSize": "5Gi"})
    );
    assert_eq!(cp["image"], image);
    assert_eq!(worker["image"], image);
    assert_eq!(cp["etcdStorage"]["type"], "persistentVolume");
    assert!(worker["etcdStorage"].is_null(), "{worker}");
    // A node image that holds Kubernetes: no sysext download.
    let ignition = serde_json::to_string(&t.kcp_template)?;
    assert!(!ignition.contains("kubernetes.raw"), "{ignition}");

    // The patched templates as the topology controller creates them: valid for the real CRDs.
    for (i, mut o) in [
        t.control_plane_machine,
        t.worker_machine,
        t.kcp_template,
        t.kct,
    ]
    .into_iter()
    .enumerate()
    {
        o["metadata"]["namespace"] = json!(ns);
        o["metadata"]["name"] = json!(format!("patched-{i}"));
        apply(&client, &o, false)
            .await
            .with_context(|| format!("{o}"))?;
    }
    Ok(())
}
