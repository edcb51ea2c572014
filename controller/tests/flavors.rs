//! Every flavor as clusterctl renders it and as its nodes boot it (through CABPK's own bootstrap
//! code, our Ignition conversion and upstream `ignition-validate`): Kubernetes through the
//! sysext or the node image, the variables that reach kubeadm and the control-plane Service.

mod support;

use anyhow::{Context, Result};
use capk_api::v1alpha1::KVMCluster;
use capk_bootstrap::BootstrapFormat;
use capk_tests::env::TestEnv;
use serde_json::{Value, json};
use support::create_namespace;
use support::{node_boot::*, release::*, topology::*};

/// The default flavor on stock Flatcar: every machine names the pinned release
/// (`FLATCAR_VERSION`), its Ignition brings Kubernetes through the sysext of the cluster's
/// version, and kubeadm gets the timeouts and the cluster's ranges.
#[test]
fn default_flavor_brings_kubernetes_to_flatcar_through_the_sysext() -> Result<()> {
    let version = kubernetes_version();
    let rendered = generate_flavor("cluster-template.yaml", &[])?;
    let pinned = generate_flavor("cluster-template.yaml", &[("FLATCAR_VERSION", "4459.2.1")])?;
    for (rendered, release) in [(&rendered, "4230.2.3"), (&pinned, "4459.2.1")] {
        for o in docs(rendered)? {
            if o["kind"] == "KVMMachineTemplate" {
                assert_eq!(
                    o["spec"]["template"]["spec"]["image"],
                    json!({"flatcar": {"channel": "stable", "version": release}}),
                    "machines made later boot what their peers boot: {o}"
                );
            }
        }
    }
    for role in ROLES {
        let (format, data) = cabpk_bootstrap(&rendered, role)?;
        assert_eq!(format, BootstrapFormat::Ignition, "{role:?}");
        let config = boot_ignition(format, &data, role).with_context(|| format!("{role:?}"))?;
        assert_kubernetes_sysext(&config, UPSTREAM_SYSEXT, &version, &format!("{role:?}"));
        let kubeadm = kubeadm_documents(&config)?;
        assert_timeouts(&kubeadm, role, &default_timeouts(role));
        if role == Role::Init {
            let networking = &kubeadm["ClusterConfiguration"]["networking"];
            assert_eq!(networking["podSubnet"], "172.24.0.0/16", "{networking}");
            assert_eq!(networking["serviceSubnet"], "172.31.0.0/16", "{networking}");
        }
    }
    Ok(())
}

/// An air-gapped installation: FLATCAR_SYSEXT_BASE_URL moves the only download to the mirror,
/// and the kubeadm timeout variables reach kubeadm.
#[test]
fn sysext_mirror_and_timeout_variables_reach_the_node() -> Result<()> {
    let version = kubernetes_version();
    let rendered = generate_flavor(
        "cluster-template.yaml",
        &[
            ("FLATCAR_SYSEXT_BASE_URL", MIRROR_SYSEXT),
            (
                "KUBEADM_CONTROL_PLANE_COMPONENT_HEALTH_CHECK_SECONDS",
                "900",
            ),
            ("KUBEADM_DISCOVERY_SECONDS", "1200"),
        ],
    )?;
    for role in ROLES {
        let (format, data) = cabpk_bootstrap(&rendered, role)?;
        let config = boot_ignition(format, &data, role)?;
        assert_kubernetes_sysext(&config, MIRROR_SYSEXT, &version, &format!("{role:?}"));
        let all = config.to_string();
        assert!(
            !all.contains("flatcar.org"),
            "{role:?}: the upstream location is still named: {all}"
        );
        let kubeadm = kubeadm_documents(&config)?;
        let mut want = vec![("discovery", "20m0s")];
        if role != Role::Worker {
            want.push(("controlPlaneComponentHealthCheck", "15m0s"));
        }
        assert_timeouts(&kubeadm, role, &want);
    }
    Ok(())
}

/// A cluster reachable from outside: the flavors' control-plane Service variables make a
/// KVMCluster the real CRD accepts, whose endpoint (as the controller sets it) is the external
/// host at the node port; CABPK gives kubeadm that endpoint, which kubeadm puts in the
/// apiserver certificate's SANs and Cluster API into the workload kubeconfig.
#[tokio::test]
async fn control_plane_service_variables_make_an_endpoint_outside_the_management_cluster()
-> Result<()> {
    let client = TestEnv::shared().client().await?;
    create_namespace(&client, FLAVOR_NS).await?;
    for flavor in [
        "cluster-template.yaml",
        "cluster-template-node-image.yaml",
        "cluster-template-ignition.yaml",
    ] {
        let rendered = generate_flavor(
            flavor,
            &[
                ("KVM_NODE_IMAGE", NODE_IMAGE),
                ("CONTROL_PLANE_SERVICE_TYPE", "NodePort"),
                ("CONTROL_PLANE_ENDPOINT_HOST", "nodes.example.com"),
                ("CONTROL_PLANE_NODE_PORT", "31443"),
            ],
        )?;
        let objs = docs(&rendered)?;
        let kc = objs
            .iter()
            .find(|o| o["kind"] == "KVMCluster")
            .context("KVMCluster")?;
        apply(&client, kc, true)
            .await
            .with_context(|| flavor.to_owned())?;
        let kc: KVMCluster = serde_json::from_value(kc.clone())?;
        let home = capk_controller::k8s::ownership::Home {
            namespace: FLAVOR_NS.to_owned(),
            management: true,
        };
        let endpoint = capk_controller::kvmcluster::build::endpoint_to_set(
            &kc,
            &capk_controller::kvmcluster::build::service_name_in(&kc, CLUSTER, &home),
            "cluster.local",
            &home,
            Some(31443),
        )
        .context("the controller sets the endpoint")?;
        assert_eq!(
            (endpoint.host.as_deref(), endpoint.port),
            (Some("nodes.example.com"), Some(31443)),
            "{flavor}"
        );
        let (format, data) = cabpk_bootstrap_at(&rendered, Role::Init, "nodes.example.com:31443")?;
        let config = boot_ignition(format, &data, Role::Init)?;
        let kubeadm = match format {
            BootstrapFormat::CloudConfig => cloud_config_kubeadm_documents(&config)?,
            BootstrapFormat::Ignition => kubeadm_documents(&config)?,
        };
        assert_eq!(
            kubeadm["ClusterConfiguration"]["controlPlaneEndpoint"], "nodes.example.com:31443",
            "{flavor}"
        );
    }
    // The default: ClusterIP, and the endpoint the Service's name inside the management cluster.
    let rendered = generate_flavor("cluster-template.yaml", &[])?;
    let objs = docs(&rendered)?;
    let kc = objs
        .iter()
        .find(|o| o["kind"] == "KVMCluster")
        .context("KVMCluster")?;
    assert_eq!(kc["spec"]["controlPlaneService"]["type"], "ClusterIP");
    let kc: KVMCluster = serde_json::from_value(kc.clone())?;
    let home = capk_controller::k8s::ownership::Home {
        namespace: FLAVOR_NS.to_owned(),
        management: true,
    };
    assert_eq!(
        capk_controller::kvmcluster::build::endpoint_to_set(
            &kc,
            &capk_controller::kvmcluster::build::service_name_in(&kc, CLUSTER, &home),
            "cluster.local",
            &home,
            None
        )
        .and_then(|e| e.host)
        .as_deref(),
        Some("demo-apiserver.flavors.svc.cluster.local")
    );

    // The topology flavor: the same variables set the ClusterClass's controlPlaneService, whose
    // patch writes them into the KVMCluster the topology controller makes from the class.
    let class = class_objects()?;
    let version = kubernetes_version();
    for (env, want) in [
        (
            vec![
                ("CONTROL_PLANE_SERVICE_TYPE", "NodePort"),
                ("CONTROL_PLANE_ENDPOINT_HOST", "nodes.example.com"),
                ("CONTROL_PLANE_NODE_PORT", "31443"),
            ],
            ("nodes.example.com", Some(31443)),
        ),
        (vec![], ("demo-apiserver.flavors.svc.cluster.local", None)),
    ] {
        let cluster = docs(&generate_flavor("cluster-template-topology.yaml", &env)?)?
            .into_iter()
            .next()
            .context("the Cluster")?;
        let t = topology(&class, &cluster, &version)?;
        let kc = json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1", "kind": "KVMCluster",
            "metadata": {"name": CLUSTER, "namespace": FLAVOR_NS},
            "spec": t.kvm_cluster_template["spec"]["template"]["spec"],
        });
        apply(&client, &kc, true)
            .await
            .with_context(|| format!("the topology's KVMCluster for {env:?}"))?;
        let kc: KVMCluster = serde_json::from_value(kc)?;
        let endpoint = capk_controller::kvmcluster::build::endpoint_to_set(
            &kc,
            &capk_controller::kvmcluster::build::service_name_in(&kc, CLUSTER, &home),
            "cluster.local",
            &home,
            want.1,
        )
        .context("the controller sets the endpoint")?;
        assert_eq!(
            (endpoint.host.as_deref(), endpoint.port),
            (Some(want.0), Some(want.1.unwrap_or(6443))),
            "topology flavor with {env:?}"
        );
    }
    Ok(())
}

/// The flavors for a node image that already holds Kubernetes download nothing: the node-image
/// flavor (cloud-config, the image named per cluster by KVM_NODE_IMAGE) and the ignition flavor
/// (the management cluster's default node image).
#[test]
fn node_image_flavors_boot_the_image_and_download_nothing() -> Result<()> {
    // node-image: the image on both KVMMachineTemplates, cloud-config with the node's name and
    // providerID filled in by the controller.
    let rendered = generate_flavor(
        "cluster-template-node-image.yaml",
        &[("KVM_NODE_IMAGE", NODE_IMAGE)],
    )?;
    let templates: Vec<Value> = docs(&rendered)?
        .into_iter()
        .filter(|o| o["kind"] == "KVMMachineTemplate")
        .collect();
    assert_eq!(templates.len(), 2);
    for t in &templates {
        assert_eq!(
            t["spec"]["template"]["spec"]["image"],
            json!({"containerImage": {"image": NODE_IMAGE}}),
            "{t}"
        );
    }
    for role in ROLES {
        let (format, data) = cabpk_bootstrap(&rendered, role)?;
        assert_eq!(format, BootstrapFormat::CloudConfig, "{role:?}");
        let config = boot_ignition(format, &data, role).with_context(|| format!("{role:?}"))?;
        assert_eq!(remote_sources(&config), Vec::<String>::new(), "{role:?}");
        assert!(
            config["storage"]["links"].is_null(),
            "{role:?}: {}",
            config["storage"]["links"]
        );
        let kubeadm = cloud_config_kubeadm_documents(&config)?;
        assert_timeouts(&kubeadm, role, &default_timeouts(role));
        let kind = if role == Role::Init {
            "InitConfiguration"
        } else {
            "JoinConfiguration"
        };
        let registration = &kubeadm[kind]["nodeRegistration"];
        assert_eq!(registration["name"], role.hostname(), "{registration}");
        assert_eq!(
            registration["kubeletExtraArgs"],
            json!([{"name": "provider-id", "value": format!("kvm://{FLAVOR_NS}/{}", role.hostname())}]),
            "{registration}"
        );
    }

    // Its ClusterResourceSet gives the cluster flannel: the images the node image preloads
    // (hack/versions.env), the Cluster's Pod range as flannel's network.
    let objects = docs(&rendered)?;
    let cluster = objects
        .iter()
        .find(|o| o["kind"] == "Cluster")
        .context("Cluster")?;
    let crs = objects
        .iter()
        .find(|o| o["kind"] == "ClusterResourceSet")
        .context("ClusterResourceSet")?;
    for (label, value) in crs["spec"]["clusterSelector"]["matchLabels"]
        .as_object()
        .context("clusterSelector")?
    {
        assert_eq!(
            &cluster["metadata"]["labels"][label], value,
            "the CRS selects the Cluster"
        );
    }
    let cm_name = crs["spec"]["resources"][0]["name"]
        .as_str()
        .context("CRS resource")?;
    let cm = objects
        .iter()
        .find(|o| o["kind"] == "ConfigMap" && o["metadata"]["name"] == cm_name)
        .context("the CRS's ConfigMap")?;
    let addon = docs(
        cm["data"]["flannel.yaml"]
            .as_str()
            .context("flannel.yaml")?,
    )?;
    let ds = addon
        .iter()
        .find(|o| o["kind"] == "DaemonSet")
        .context("flannel DaemonSet")?;
    let mut images: Vec<&str> = Vec::new();
    let containers: Vec<Value> = ["initContainers", "containers"]
        .iter()
        .flat_map(|k| {
            ds["spec"]["template"]["spec"][k]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .collect();
    for c in &containers {
        images.push(c["image"].as_str().context("container image")?);
    }
    let flannel = format!(
        "localhost/capk/flannel:{}",
        capk_tests::pinned_version("FLANNEL_VERSION")
    );
    let plugin = format!(
        "localhost/capk/flannel-cni-plugin:{}",
        capk_tests::pinned_version("FLANNEL_CNI_PLUGIN_VERSION")
    );
    images.sort();
    images.dedup();
    assert_eq!(
        images,
        [plugin.as_str(), flannel.as_str()],
        "flannel images = the preloaded ones"
    );
    let net_conf = addon
        .iter()
        .find(|o| o["kind"] == "ConfigMap")
        .and_then(|c| c["data"]["net-conf.json"].as_str())
        .context("net-conf.json")?;
    let net_conf: Value = serde_json::from_str(net_conf)?;
    assert_eq!(
        net_conf["Network"], cluster["spec"]["clusterNetwork"]["pods"]["cidrBlocks"][0],
        "flannel's network is the Cluster's Pod range"
    );
    assert_eq!(net_conf["Backend"]["Type"], "vxlan");

    // ignition: CABPK's Ignition as it is, on the default node image.
    let rendered = generate_flavor("cluster-template-ignition.yaml", &[])?;
    for role in ROLES {
        let (format, data) = cabpk_bootstrap(&rendered, role)?;
        assert_eq!(format, BootstrapFormat::Ignition, "{role:?}");
        let config = boot_ignition(format, &data, role)?;
        assert_eq!(remote_sources(&config), Vec::<String>::new(), "{role:?}");
        assert_timeouts(&kubeadm_documents(&config)?, role, &default_timeouts(role));
    }
    Ok(())
}

/// KUBE_LEADER_ELECT_* reach the controller-manager's and scheduler's flags on the first control
/// plane in every flavor and in the ClusterClass, with Kubernetes' own values as defaults.
#[test]
fn leader_election_variables_reach_the_control_plane_in_every_flavor() -> Result<()> {
    const TCG: [(&str, &str); 3] = [
        ("KUBE_LEADER_ELECT_LEASE_DURATION", "60s"),
        ("KUBE_LEADER_ELECT_RENEW_DEADLINE", "40s"),
        ("KUBE_LEADER_ELECT_RETRY_PERIOD", "5s"),
    ];
    for flavor in [
        "cluster-template.yaml",
        "cluster-template-ignition.yaml",
        "cluster-template-node-image.yaml",
    ] {
        for (vars, want) in [
            (&[][..], ["15s", "10s", "2s"]),
            (&TCG[..], ["60s", "40s", "5s"]),
        ] {
            let mut env = vec![("KVM_NODE_IMAGE", NODE_IMAGE)];
            env.extend_from_slice(vars);
            let rendered = generate_flavor(flavor, &env)?;
            let what = format!("{flavor} {vars:?}");
            assert_leader_election(
                &node_kubeadm_documents(&rendered, Role::Init).context(what.clone())?,
                want,
                &what,
            );
        }
    }
    let version = kubernetes_version();
    let cluster = docs(&generate_flavor("cluster-template-topology.yaml", &TCG)?)?
        .into_iter()
        .next()
        .context("the Cluster")?;
    let objects = topology_objects(&class_objects()?, &cluster, &version)?;
    assert_leader_election(
        &node_kubeadm_documents(&objects, Role::Init)?,
        ["60s", "40s", "5s"],
        "clusterclass-kvm.yaml",
    );
    Ok(())
}

/// What the node-image flavor does for emulated control planes reaches kubeadm on the node:
/// readiness probes of the static Pods every `KUBE_READINESS_PROBE_PERIOD_SECONDS` (10; kubeadm
/// patches in init and control-plane join), their liveness failure threshold
/// (`KUBE_LIVENESS_FAILURE_THRESHOLD`, kubeadm's 8), etcd's CPU request (`KUBE_ETCD_CPU_REQUEST`,
/// kubeadm's 100m), one CoreDNS replica (`COREDNS_REPLICAS`, kubeadm's `corednsdeployment` patch),
/// ECDSA keys (`KUBE_ENCRYPTION_ALGORITHM`) and etcd's watch progress notifications every 60 s
/// (`ETCD_WATCH_PROGRESS_NOTIFY_INTERVAL`, kubeadm's 5s), each back to kubeadm's behaviour when a
/// user sets kubeadm's values; and how long Cluster API retries deleting a removed machine's Node
/// (`NODE_DELETION_TIMEOUT_SECONDS`: 300 s, or Cluster API's own 10 s when a user sets 10).
#[test]
fn emulation_levers_of_the_node_image_flavor_reach_kubeadm() -> Result<()> {
    const PATCHES: &str = "/etc/kubernetes/patches";
    for (vars, period, liveness, etcd_cpu, algorithm, resync, coredns, node_deletion, progress) in [
        (&[][..], 10, 8, "100m", "ECDSA-P256", "60", 1, 300, "60s"),
        (
            &[
                ("KUBE_READINESS_PROBE_PERIOD_SECONDS", "1"),
                ("KUBE_LIVENESS_FAILURE_THRESHOLD", "30"),
                ("KUBE_ETCD_CPU_REQUEST", "1"),
                ("KUBE_ENCRYPTION_ALGORITHM", "RSA-2048"),
                ("FLANNEL_IPTABLES_RESYNC_SECONDS", "5"),
                ("COREDNS_REPLICAS", "2"),
                ("NODE_DELETION_TIMEOUT_SECONDS", "10"),
                ("ETCD_WATCH_PROGRESS_NOTIFY_INTERVAL", "5s"),
            ][..],
            1,
            30,
            "1",
            "RSA-2048",
            "5",
            2,
            10,
            "5s",
        ),
    ] {
        let mut env = vec![("KVM_NODE_IMAGE", NODE_IMAGE)];
        env.extend_from_slice(vars);
        let rendered = generate_flavor("cluster-template-node-image.yaml", &env)?;
        // flanneld's container in the CNI the ClusterResourceSet installs.
        let objects = docs(&rendered)?;
        let cni = objects
            .iter()
            .find(|o| o["kind"] == "ConfigMap")
            .and_then(|o| o["data"]["flannel.yaml"].as_str())
            .context("the flavor's flannel ConfigMap")?;
        let flanneld = docs(cni)?
            .into_iter()
            .find(|o| o["kind"] == "DaemonSet")
            .context("flannel's DaemonSet")?;
        // How long Cluster API retries deleting a removed machine's Node, control planes and
        // workers alike.
        for (kind, spec) in [
            ("KubeadmControlPlane", "/spec/machineTemplate/spec"),
            ("MachineDeployment", "/spec/template/spec"),
        ] {
            let object = objects
                .iter()
                .find(|o| o["kind"] == kind)
                .with_context(|| format!("the flavor's {kind}"))?;
            assert_eq!(
                object.pointer(&format!("{spec}/deletion/nodeDeletionTimeoutSeconds")),
                Some(&json!(node_deletion)),
                "{kind} {vars:?}"
            );
        }
        assert_eq!(
            flanneld["spec"]["template"]["spec"]["containers"][0]["command"],
            json!([
                "/opt/bin/flanneld",
                "--ip-masq",
                "--kube-subnet-mgr",
                format!("--iptables-resync={resync}")
            ]),
            "{vars:?}"
        );
        for role in [Role::Init, Role::Join] {
            let what = format!("{role:?} {vars:?}");
            let (format, data) = cabpk_bootstrap(&rendered, role)?;
            let config = boot_ignition(format, &data, role)?;
            let kubeadm = cloud_config_kubeadm_documents(&config)?;
            let (kind, cluster) = match role {
                Role::Init => ("InitConfiguration", Some(&kubeadm["ClusterConfiguration"])),
                _ => ("JoinConfiguration", None),
            };
            assert_eq!(
                kubeadm[kind]["patches"]["directory"], PATCHES,
                "{what}: {kind}"
            );
            // A control plane of CONTROL_PLANE_MACHINE_CPUS=1 (the cheaper one under emulation)
            // passes kubeadm's preflight, which otherwise refuses fewer than 2 CPUs.
            assert_eq!(
                kubeadm[kind]["nodeRegistration"]["ignorePreflightErrors"],
                json!(["NumCPU"]),
                "{what}: {kind}"
            );
            if let Some(cluster) = cluster {
                assert_eq!(cluster["encryptionAlgorithm"], algorithm, "{what}");
                assert_eq!(
                    cluster["etcd"]["local"]["extraArgs"],
                    json!([{"name": "watch-progress-notify-interval", "value": progress}]),
                    "{what}: etcd's extraArgs"
                );
            }
            let path = format!("{PATCHES}/corednsdeployment0+strategic.yaml");
            let patch: Value = serde_yaml_ng::from_str(&inline_text(
                file(&config, &path).with_context(|| format!("{what}: no {path}"))?,
            )?)?;
            assert_eq!(
                patch,
                json!({"spec": {"replicas": coredns}}),
                "{what}: {path}"
            );
            for component in [
                "etcd",
                "kube-apiserver",
                "kube-controller-manager",
                "kube-scheduler",
            ] {
                let path = format!("{PATCHES}/{component}0+strategic.yaml");
                let patch: Value = serde_yaml_ng::from_str(&inline_text(
                    file(&config, &path).with_context(|| format!("{what}: no {path}"))?,
                )?)?;
                // kubeadm gives the controller-manager no readiness probe.
                let mut container = json!({
                    "name": component,
                    "livenessProbe": {"failureThreshold": liveness},
                });
                if component != "kube-controller-manager" {
                    container["readinessProbe"] = json!({"periodSeconds": period});
                }
                if component == "etcd" {
                    container["resources"] = json!({"requests": {"cpu": etcd_cpu}});
                }
                assert_eq!(
                    patch,
                    json!({"spec": {"containers": [container]}}),
                    "{what}: {path}"
                );
            }
        }
    }
    Ok(())
}

/// Every flavor as clusterctl renders it for fixed inputs (and the ClusterClass as `clusterctl
/// generate yaml` does): a change to a template shows up here for review.
#[test]
fn rendered_flavors() -> Result<()> {
    let dir = release_dir()?;
    for (name, flavor) in [
        ("default", "cluster-template.yaml"),
        ("node-image", "cluster-template-node-image.yaml"),
        ("ignition", "cluster-template-ignition.yaml"),
        ("topology", "cluster-template-topology.yaml"),
    ] {
        let rendered = clusterctl(
            &[
                "generate",
                "cluster",
                CLUSTER,
                "--from",
                &dir.join(flavor).to_string_lossy(),
                "--kubernetes-version",
                "v1.35.4",
                "--target-namespace",
                FLAVOR_NS,
                "--control-plane-machine-count",
                "3",
                "--worker-machine-count",
                "2",
            ],
            &[("KVM_NODE_IMAGE", NODE_IMAGE)],
        )?;
        insta::assert_snapshot!(format!("flavor-{name}"), rendered);
    }
    let class = clusterctl(
        &[
            "generate",
            "yaml",
            "--from",
            &dir.join("clusterclass-kvm.yaml").to_string_lossy(),
        ],
        &[],
    )?;
    insta::assert_snapshot!("clusterclass-kvm", class);
    Ok(())
}
