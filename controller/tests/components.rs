//! The provider's components as clusterctl takes them: infrastructure-components.yaml follows
//! the clusterctl contract, clusterctl processes it and generates every flavor from the
//! required variables only, knows the provider from the release repository, and the component
//! names coexist with cluster-api-provider-kubevirt's.

mod support;

use std::collections::BTreeMap;

use anyhow::{Context, Result, bail};
use capk_tests::env::TestEnv;
use serde_json::{Value, json};
use support::create_namespace;
use support::{node_boot::*, release::*, topology::class_objects};

#[tokio::test]
async fn infrastructure_components_follow_the_clusterctl_contract() -> Result<()> {
    let dir = release_dir()?;
    let text = std::fs::read_to_string(dir.join("infrastructure-components.yaml"))?;
    let objs = docs(&text)?;
    let namespaces = objs.iter().filter(|o| o["kind"] == "Namespace").count();
    assert_eq!(namespaces, 1, "clusterctl wants exactly one Namespace");
    for o in &objs {
        assert_eq!(
            o["metadata"]["labels"]["cluster.x-k8s.io/provider"], "infrastructure-kvm",
            "{} {} lacks the provider label",
            o["kind"], o["metadata"]["name"]
        );
    }
    let deploy = objs
        .iter()
        .find(|o| o["kind"] == "Deployment")
        .context("a Deployment")?;
    let containers = deploy["spec"]["template"]["spec"]["containers"]
        .as_array()
        .context("containers")?;
    let manager = containers
        .iter()
        .find(|c| c["name"] == "manager")
        .context("clusterctl wants a container named manager")?;
    let args = manager["args"].to_string();
    assert!(
        args.contains("--namespace="),
        "manager supports --namespace: {args}"
    );

    assert!(
        !objs.iter().any(|o| o["kind"] == "VerticalPodAutoscaler"),
        "the VPA must stay optional: installs on clusters without its CRDs would fail"
    );
    let vpa: Value = serde_yaml_ng::from_str(&std::fs::read_to_string(dir.join("vpa.yaml"))?)?;
    assert_eq!(vpa["spec"]["targetRef"]["name"], deploy["metadata"]["name"]);
    // It acts on the one replica, with a mode that is not deprecated.
    assert_eq!(vpa["spec"]["updatePolicy"]["minReplicas"], 1);
    assert_eq!(vpa["spec"]["updatePolicy"]["updateMode"], "Recreate");

    // Scraping: the ServiceMonitor finds the metrics Service and its HTTPS port, and Cluster
    // API's own Prometheus setup (Pods with the provider label, port named metrics) finds the
    // Pod.
    let monitoring = docs(&std::fs::read_to_string(dir.join("monitoring.yaml"))?)?;
    let monitor = monitoring
        .iter()
        .find(|o| o["kind"] == "ServiceMonitor")
        .context("a ServiceMonitor")?;
    let service = objs
        .iter()
        .find(|o| o["kind"] == "Service" && o["metadata"]["name"] == "capkvm-controller-metrics")
        .context("the metrics Service")?;
    for (k, v) in monitor["spec"]["selector"]["matchLabels"]
        .as_object()
        .context("matchLabels")?
    {
        assert_eq!(&service["metadata"]["labels"][k], v, "Service label {k}");
    }
    let endpoint = &monitor["spec"]["endpoints"][0];
    assert_eq!(endpoint["scheme"], "https");
    let port = &service["spec"]["ports"][0];
    assert_eq!(endpoint["port"], port["name"]);
    let pod = &deploy["spec"]["template"];
    assert_eq!(
        pod["metadata"]["labels"]["cluster.x-k8s.io/provider"],
        "infrastructure-kvm"
    );
    let metrics_port = manager["ports"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["name"] == "metrics")
        .context("the manager's port named metrics")?;
    assert_eq!(port["targetPort"], "metrics");
    assert!(
        args.contains(&format!(
            "--diagnostics-address=${{CAPK_DIAGNOSTICS_ADDRESS:=0.0.0.0:{}}}",
            metrics_port["containerPort"]
        )),
        "the metrics port is the one served: {args}"
    );
    // The optional files name no namespace: they go where the provider is (`kubectl apply -n`
    // or a kustomization's namespace), which clusterctl init's --target-namespace chooses.
    for o in monitoring.iter().chain([&vpa]) {
        assert!(
            o["metadata"]["namespace"].is_null(),
            "{} {} names a namespace",
            o["kind"],
            o["metadata"]["name"]
        );
    }
    assert_eq!(
        manager["readinessProbe"]["httpGet"]["path"], "/readyz",
        "the manager is probed on its health endpoint"
    );

    let meta: Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(dir.join("metadata.yaml"))?)?;
    assert_eq!(meta["releaseSeries"][0]["contract"], "v1beta2");

    // The whole file applies to a real apiserver (variables at their defaults).
    let client = TestEnv::shared().client().await?;
    let text = substitute(&text, &BTreeMap::new())?;
    for o in docs(&text)? {
        apply(&client, &o, false).await?;
    }
    Ok(())
}

/// `clusterctl init --infrastructure kvm` with no variables set: every variable of the
/// components has a default clusterctl accepts (it calls `${VAR:=}` unset), and the optional
/// settings come out empty, i.e. all namespaces and Flatcar.
#[test]
fn clusterctl_processes_the_components_with_no_variables_set() -> Result<()> {
    let objs = provider_components(&release_dir()?)?;
    let deploy = objs
        .iter()
        .find(|o| o["kind"] == "Deployment")
        .context("the manager Deployment")?;
    let manager = &deploy["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(manager["image"], "localhost/capk/capk-controller:dev");
    let env = |name: &str| {
        manager["env"]
            .as_array()
            .and_then(|e| e.iter().find(|v| v["name"] == name))
            .map(|v| v["value"].clone())
    };
    // clusterctl drops an empty value (Go's omitempty): the variable is set, to "".
    for name in [
        "CAPK_NAMESPACE",
        "CAPK_DEFAULT_NODE_IMAGE",
        "CAPK_ALLOWED_HOST_VOLUME_PATHS",
        "CAPK_ALLOWED_CONTROL_PLANE_SERVICE_TYPES",
        "CAPK_ALLOWED_TOLERATION_KEYS",
        "CAPK_ALLOWED_NODE_SELECTOR_KEYS",
        "CAPK_ALLOWED_PRIORITY_CLASSES",
        "CAPK_ALLOWED_CONTROL_PLANE_SERVICE_ANNOTATIONS",
    ] {
        let value = env(name).with_context(|| format!("env {name}"))?;
        assert!(value.is_null() || value == "", "{name}={value}");
    }
    // The operator security settings as shipped: no host volumes, toleration keys, reserved
    // node selector keys, PriorityClasses or Service annotations, no control-plane Service type
    // but ClusterIP (all above), etcd data under /var/lib/capk/etcd only, no key-less
    // tolerations.
    let args: Vec<String> = serde_json::from_value(manager["args"].clone())?;
    // Machine Pods in the operator's namespace; the value passed as an argument, so that an
    // empty one (the cluster's own namespace) is not taken for no value.
    assert_eq!(
        env("CAPK_MACHINE_NAMESPACE"),
        Some(json!(capk_api::constants::DEFAULT_MACHINE_NAMESPACE))
    );
    for shipped in [
        "--allowed-etcd-host-paths=/var/lib/capk/etcd",
        "--allow-tolerate-all-taints=false",
        "--machine-namespace=$(CAPK_MACHINE_NAMESPACE)",
    ] {
        assert!(
            args.iter().any(|a| a == shipped),
            "{shipped} not in {args:?}"
        );
    }
    // The binary takes the Deployment's arguments as they are (clap would exit 2 on one it does
    // not know); render-ignition runs without a cluster.
    let mut argv: Vec<&str> = args.iter().map(String::as_str).collect();
    argv.extend(["render-ignition", "--hostname", "m"]);
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_capk-controller"));
    run_with_input(bin, &argv, b"#cloud-config\n")
        .context("capk-controller refuses the Deployment's arguments")?;
    Ok(())
}

/// An object's place in a cluster: kind, namespace (`-`: cluster-scoped; `*`: a namespace the
/// user chooses) and name.
type ObjectKey = (String, String, String);

/// The objects cluster-api-provider-kubevirt puts in a cluster, pinned from upstream (see the
/// file's header).
fn kubevirt_provider_objects() -> Result<Vec<ObjectKey>> {
    let path =
        capk_tests::repo_root().join("controller/tests/fixtures/kubevirt-provider-objects.txt");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))?;
    let mut out = Vec::new();
    for line in text
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
    {
        match line.split_whitespace().collect::<Vec<_>>()[..] {
            [kind, ns, name] => out.push((kind.into(), ns.into(), name.into())),
            _ => bail!("{}: not `kind namespace name`: {line}", path.display()),
        }
    }
    Ok(out)
}

/// Where an object of ours goes: cluster-scoped kinds have no namespace (kustomize writes one on
/// ValidatingAdmissionPolicies too; the apiserver drops it), the others go to `namespace`.
fn object_key(o: &Value, namespace: &str) -> Result<ObjectKey> {
    const CLUSTER_SCOPED: &[&str] = &[
        "Namespace",
        "CustomResourceDefinition",
        "ClusterRole",
        "ClusterRoleBinding",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    ];
    const NAMESPACED: &[&str] = &[
        "ServiceAccount",
        "Secret",
        "Role",
        "RoleBinding",
        "Service",
        "Deployment",
        "VerticalPodAutoscaler",
        "ServiceMonitor",
        "PrometheusRule",
    ];
    let kind = o["kind"].as_str().context("kind")?;
    let name = o["metadata"]["name"].as_str().context("metadata.name")?;
    let ns = if CLUSTER_SCOPED.contains(&kind) {
        "-"
    } else if NAMESPACED.contains(&kind) {
        namespace
    } else {
        bail!("{kind} {name}: add the kind to CLUSTER_SCOPED or NAMESPACED in object_key")
    };
    Ok((kind.into(), ns.into(), name.into()))
}

/// cluster-api-provider-kubevirt, which upstream also abbreviates CAPK, installs into its own
/// namespace with `capk-` names. Installing both providers (the way off KubeVirt) must overwrite
/// none of its objects, and it none of ours: no object of our release (the components
/// `clusterctl init` applies, the Lease the controller takes, the optional VPA and monitoring
/// components in the provider's namespace, the hosting cluster's RBAC) has the kind, namespace
/// and name of one of its (controller/tests/fixtures/kubevirt-provider-objects.txt).
#[test]
fn components_share_no_name_with_cluster_api_provider_kubevirt() -> Result<()> {
    let theirs = kubevirt_provider_objects()?;
    let dir = release_dir()?;
    let components = provider_components(&dir)?;
    let namespace = components
        .iter()
        .find(|o| o["kind"] == "Namespace")
        .and_then(|o| o["metadata"]["name"].as_str())
        .context("the components' Namespace")?
        .to_owned();
    let mut ours = Vec::new();
    for o in &components {
        let ns = o["metadata"]["namespace"].as_str().unwrap_or(&namespace);
        ours.push(object_key(o, ns)?);
    }
    ours.push((
        "Lease".into(),
        namespace.clone(),
        capk_controller::leader::LEASE_NAME.into(),
    ));
    for file in ["vpa.yaml", "monitoring.yaml"] {
        for o in docs(&std::fs::read_to_string(dir.join(file))?)? {
            ours.push(object_key(&o, &namespace)?);
        }
    }
    // Applied in a hosting cluster, and in the namespace a namespaced controller watches:
    // namespaces the user chooses (the files say so). The namespaced components' other objects
    // are the ones above.
    for file in ["hosting-rbac.yaml", "watch-namespace-rbac.yaml"] {
        for o in docs(&std::fs::read_to_string(dir.join(file))?)? {
            ours.push(object_key(&o, "*")?);
        }
    }
    for kind in [
        "Namespace",
        "Deployment",
        "ClusterRole",
        "Service",
        "PrometheusRule",
    ] {
        assert!(ours.iter().any(|o| o.0 == kind), "no {kind} among {ours:?}");
    }

    let same = |a: &ObjectKey, b: &ObjectKey| {
        a.0 == b.0 && a.2 == b.2 && (a.1 == b.1 || a.1 == "*" || b.1 == "*")
    };
    let clashes: Vec<&ObjectKey> = ours
        .iter()
        .filter(|o| theirs.iter().any(|t| same(o, t)))
        .collect();
    assert!(
        clashes.is_empty(),
        "objects cluster-api-provider-kubevirt installs too (one provider would overwrite the \
         other's): {clashes:?}\nall of ours: {ours:?}"
    );
    Ok(())
}

/// The variables `clusterctl generate cluster --list-variables` calls required.
fn required_variables(listing: &str) -> Vec<String> {
    listing
        .lines()
        .skip_while(|l| !l.starts_with("Required Variables:"))
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .map(|l| l.trim().trim_start_matches("- ").to_owned())
        .collect()
}

fn kinds(objs: &[Value]) -> Vec<String> {
    let mut k: Vec<String> = objs
        .iter()
        .map(|o| o["kind"].as_str().unwrap_or_default().to_owned())
        .collect();
    k.sort();
    k
}

#[tokio::test]
async fn clusterctl_generates_every_flavor_from_the_required_variables_only() -> Result<()> {
    let dir = release_dir()?;
    let file = |name: &str| dir.join(name).to_string_lossy().into_owned();
    let ns = "cluster-template";
    let client = TestEnv::shared().client().await?;
    create_namespace(&client, ns).await?;

    // The ClusterClass of the topology flavor, applied for real into the namespace (a Cluster
    // refers to it), as `kubectl apply -n` does.
    let mut class = class_objects()?;
    for o in &mut class {
        o["metadata"]["namespace"] = json!(ns);
    }
    assert_eq!(
        kinds(&class),
        [
            "ClusterClass",
            "KVMClusterTemplate",
            "KVMMachineTemplate",
            "KVMMachineTemplate",
            "KubeadmConfigTemplate",
            "KubeadmControlPlaneTemplate"
        ]
    );
    for o in &class {
        apply(&client, o, false).await?;
    }

    const KUBEADM: &[&str] = &[
        "Cluster",
        "KVMCluster",
        "KVMMachineTemplate",
        "KVMMachineTemplate",
        "KubeadmConfigTemplate",
        "KubeadmControlPlane",
        "MachineDeployment",
        "MachineHealthCheck",
        "MachineHealthCheck",
    ];
    /// The node-image flavor also installs its CNI (flannel) by a ClusterResourceSet.
    const KUBEADM_WITH_CNI: &[&str] = &[
        "Cluster",
        "ClusterResourceSet",
        "ConfigMap",
        "KVMCluster",
        "KVMMachineTemplate",
        "KVMMachineTemplate",
        "KubeadmConfigTemplate",
        "KubeadmControlPlane",
        "MachineDeployment",
        "MachineHealthCheck",
        "MachineHealthCheck",
    ];
    /// A flavor, the variables it requires besides KUBERNETES_VERSION, the kinds it renders and
    /// the bootstrap format of its kubeadm configs (`None`: CABPK's default, cloud-config).
    struct Flavor {
        file: &'static str,
        required: &'static [&'static str],
        kinds: &'static [&'static str],
        format: Option<&'static str>,
    }
    let flavors = [
        Flavor {
            file: "cluster-template.yaml",
            required: &[],
            kinds: KUBEADM,
            format: Some("ignition"),
        },
        Flavor {
            file: "cluster-template-node-image.yaml",
            required: &["KVM_NODE_IMAGE"],
            kinds: KUBEADM_WITH_CNI,
            format: None,
        },
        Flavor {
            file: "cluster-template-ignition.yaml",
            required: &[],
            kinds: KUBEADM,
            format: Some("ignition"),
        },
        Flavor {
            file: "cluster-template-topology.yaml",
            required: &[],
            kinds: &["Cluster"],
            format: None,
        },
    ];
    for (i, f) in flavors.iter().enumerate() {
        let (flavor, format) = (&f.file, f.format);
        let name = format!("tmpl-{i}");
        let listing = clusterctl(
            &[
                "generate",
                "cluster",
                &name,
                "--from",
                &file(flavor),
                "--list-variables",
                "--target-namespace",
                ns,
            ],
            &[],
        )?;
        let mut want = vec!["KUBERNETES_VERSION"];
        want.extend(f.required.iter());
        want.sort();
        assert_eq!(required_variables(&listing), want, "{flavor}: {listing}");
        let objs = docs(&clusterctl(
            &[
                "generate",
                "cluster",
                &name,
                "--from",
                &file(flavor),
                "--kubernetes-version",
                "v1.35.4",
                "--target-namespace",
                ns,
                "--control-plane-machine-count",
                "3",
                "--worker-machine-count",
                "2",
            ],
            &[("KVM_NODE_IMAGE", NODE_IMAGE)],
        )?)?;
        assert_eq!(kinds(&objs), f.kinds, "{flavor}");
        for o in &objs {
            assert_eq!(o["metadata"]["namespace"], ns, "{flavor}: {o}");
            let spec_format = match o["kind"].as_str() {
                Some("KubeadmControlPlane") => Some(&o["spec"]["kubeadmConfigSpec"]["format"]),
                Some("KubeadmConfigTemplate") => Some(&o["spec"]["template"]["spec"]["format"]),
                _ => None,
            };
            if let Some(found) = spec_format {
                assert_eq!(found.as_str(), format, "{flavor}: {}", o["kind"]);
            }
            // Strict server-side dry-run against the real Cluster API CRDs: unknown fields and
            // schema violations fail.
            apply(&client, o, true)
                .await
                .with_context(|| flavor.to_string())?;
        }
    }
    Ok(())
}

/// The README's journey on a real management cluster: `make release-manifests` writes a
/// clusterctl local repository and the `providers:` entry naming it (`_output/release/clusterctl.yaml`),
/// the user puts that entry in `~/.config/cluster-api/clusterctl.yaml`, and from then on clusterctl
/// knows the provider `kvm`: `clusterctl init --infrastructure kvm` installs the newest version
/// and `clusterctl generate cluster --infrastructure kvm:<version> [--flavor F]` renders every
/// flavor from the repository (the topology flavor with its ClusterClass), as `--from` does.
#[test]
fn clusterctl_knows_the_provider_kvm_from_the_release_repository() -> Result<()> {
    let dir = release_dir()?;
    let version = dir
        .file_name()
        .and_then(|v| v.to_str())
        .context("version directory")?
        .to_owned();
    let entry = dir
        .parent()
        .and_then(|d| d.parent())
        .context("release directory")?
        .join("clusterctl.yaml");
    let home = tempfile::tempdir()?;
    let config_dir = home.path().join(".config/cluster-api");
    std::fs::create_dir_all(&config_dir)?;
    std::fs::copy(&entry, config_dir.join("clusterctl.yaml"))
        .with_context(|| format!("copy {}", entry.display()))?;
    let home_dir = home.path().to_string_lossy().into_owned();
    let env = [("HOME", home_dir.as_str()), ("KVM_NODE_IMAGE", NODE_IMAGE)];

    // What `clusterctl init --infrastructure kvm` installs: the components of the newest version.
    let components = docs(&clusterctl(
        &["generate", "provider", "--infrastructure", "kvm"],
        &env,
    )?)?;
    let shipped = docs(&std::fs::read_to_string(
        dir.join("infrastructure-components.yaml"),
    )?)?;
    assert_eq!(
        kinds(&components),
        kinds(&shipped),
        "clusterctl init --infrastructure kvm would not install the release's components"
    );

    let infrastructure = format!("kvm:{version}");
    let mut flavors = Vec::new();
    for f in std::fs::read_dir(&dir)? {
        let name = f?.file_name().to_string_lossy().into_owned();
        if let Some(rest) = name
            .strip_prefix("cluster-template")
            .and_then(|r| r.strip_suffix(".yaml"))
        {
            flavors.push((name.clone(), rest.trim_start_matches('-').to_owned()));
        }
    }
    flavors.sort();
    assert!(
        flavors.len() >= 4,
        "flavors in {}: {flavors:?}",
        dir.display()
    );
    for (file, flavor) in &flavors {
        let generate = |source: &[&str], extra: &[&str]| -> Result<String> {
            let mut args = vec![
                "generate",
                "cluster",
                CLUSTER,
                "--target-namespace",
                FLAVOR_NS,
            ];
            args.extend(source);
            args.extend(extra);
            clusterctl(&args, &env)
        };
        let path = dir.join(file).to_string_lossy().into_owned();
        let from: Vec<&str> = vec!["--from", &path];
        let mut repository = vec!["--infrastructure", &infrastructure];
        if !flavor.is_empty() {
            repository.extend(["--flavor", flavor.as_str()]);
        }
        let listing = generate(&repository, &["--list-variables"])?;
        assert!(
            required_variables(&listing).contains(&"KUBERNETES_VERSION".to_owned()),
            "{file}: {listing}"
        );
        assert_eq!(listing, generate(&from, &["--list-variables"])?, "{file}");

        let version_args = ["--kubernetes-version", "v1.35.4"];
        let rendered = docs(&generate(&repository, &version_args)?)?;
        let mut want = docs(&generate(&from, &version_args)?)?;
        // From the repository clusterctl adds the ClusterClass a topology Cluster names (it
        // cannot see the namespace holds one already: no management cluster here).
        if flavor == "topology" {
            let mut class = class_objects()?;
            for o in &mut class {
                o["metadata"]["namespace"] = json!(FLAVOR_NS);
            }
            class.extend(want);
            want = class;
        }
        assert_eq!(kinds(&rendered), kinds(&want), "{file}");
        assert_eq!(rendered, want, "{file}");
    }
    Ok(())
}
