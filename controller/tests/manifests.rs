//! The shipped manifests: the clusterctl contract of infrastructure-components.yaml, every
//! flavor rendered by the real clusterctl and checked against the real Cluster API CRDs and, as
//! the nodes boot it, through CABPK's own bootstrap code, our Ignition conversion and upstream
//! `ignition-validate`; the controller working with nothing but the shipped RBAC; and component
//! names that coexist with cluster-api-provider-kubevirt's.

mod support;

use std::{collections::BTreeMap, process::Command};

use anyhow::{Context, Result, anyhow, bail};
use capk_api::v1alpha1::{KVMCluster, KVMMachine};
use capk_bootstrap::BootstrapFormat;
use capk_tests::env::TestEnv;
use k8s_openapi::api::core::v1::Pod;
use kube::{
    Api, Client, Config, ResourceExt,
    api::{DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams},
    config::{KubeConfigOptions, Kubeconfig},
    discovery,
};
use serde_json::{Value, json};
use support::{control_plane_machine, create_namespace, eventually};

/// The clusterctl repository from `hack/release-manifests.sh`, written once per test binary:
/// the tests run in parallel and must not read files another test is rewriting.
fn release_dir() -> Result<std::path::PathBuf> {
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

fn docs(text: &str) -> Result<Vec<Value>> {
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
fn substitute(text: &str, vars: &BTreeMap<&str, &str>) -> Result<String> {
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

async fn apply(client: &Client, obj: &Value, dry_run: bool) -> Result<()> {
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

/// Runs the real clusterctl (built from the Go module proxy) with no user configuration and
/// no version check; fails with its stderr.
fn clusterctl(args: &[&str], env: &[(&str, &str)]) -> Result<String> {
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
fn provider_components(release: &std::path::Path) -> Result<Vec<Value>> {
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

/// A client of `env` that authenticates as the controller's ServiceAccount.
async fn service_account_client(env: &TestEnv, admin: &Client) -> Result<Client> {
    let sa: Api<k8s_openapi::api::core::v1::ServiceAccount> =
        Api::namespaced(admin.clone(), "capkvm-system");
    let req = json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                     "spec": {"expirationSeconds": 3600}});
    let resp: Value = sa
        .create_subresource(
            "token",
            "capkvm-controller-manager",
            &PostParams::default(),
            &req,
        )
        .await?;
    let token = resp["status"]["token"].as_str().context("token")?;
    let kc_path = env.kubeconfig();
    let mut kc: Value = serde_yaml_ng::from_str(&std::fs::read_to_string(kc_path)?)?;
    kc["users"][0]["user"] = json!({"token": token});
    let kc = Kubeconfig::from_yaml(&serde_yaml_ng::to_string(&kc)?)?;
    let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?;
    Ok(Client::try_from(config)?)
}

/// Applies the ServiceAccount, ClusterRoles and bindings exactly as shipped; returns a client
/// of the controller's ServiceAccount.
async fn shipped_rbac_client(admin: &Client) -> Result<Client> {
    let dir = release_dir()?;
    let text = substitute(
        &std::fs::read_to_string(dir.join("infrastructure-components.yaml"))?,
        &BTreeMap::new(),
    )?;
    for o in docs(&text)? {
        if [
            "Namespace",
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "Role",
            "RoleBinding",
        ]
        .contains(&o["kind"].as_str().unwrap_or_default())
        {
            apply(admin, &o, false).await?;
        }
    }
    service_account_client(TestEnv::shared(), admin).await
}

/// The metrics endpoint's TokenReviews and SubjectAccessReviews work with the shipped role, and
/// the shipped capkvm-metrics-reader ClusterRole is what a scraper needs.
#[tokio::test]
async fn metrics_are_served_with_only_the_shipped_rbac() -> Result<()> {
    use capk_controller::metrics::{
        Metrics,
        serve::{Serving, serve_metrics, tls_self_signed},
    };
    let admin = TestEnv::shared().client().await?;
    let restricted = shipped_rbac_client(&admin).await?;
    let ns = "metrics-rbac";
    create_namespace(&admin, ns).await?;
    let binding = json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": "metrics-rbac-scraper"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": "capkvm-metrics-reader"},
        "subjects": [{"kind": "ServiceAccount", "name": "scraper", "namespace": ns}]});
    apply(&admin, &binding, false).await?;
    let scraper = support::scrape::token_for(&admin, ns, "scraper").await?;
    let stranger = support::scrape::token_for(&admin, ns, "stranger").await?;

    // As the controller serves it without a mounted certificate: self-signed.
    let (tls, ca) = tls_self_signed(vec!["localhost".to_owned()])?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    let server = tokio::spawn(serve_metrics(
        listener,
        std::sync::Arc::new(Metrics::new(16)),
        Serving::Secure {
            tls,
            client: restricted,
        },
    ));
    let get = |token| support::scrape::https_get(port, "/metrics", token, &ca);
    let result = async {
        let (code, body) = get(Some(scraper.as_str())).await?;
        assert_eq!(
            code, 200,
            "the scraper bound to capkvm-metrics-reader: {body}"
        );
        assert!(
            body.contains("controller_runtime_reconcile_total"),
            "{body}"
        );
        let (code, body) = get(Some(stranger.as_str())).await?;
        assert_eq!(code, 403, "a ServiceAccount without the role: {body}");
        anyhow::Ok(())
    }
    .await;
    server.abort();
    result
}

#[tokio::test]
async fn the_controller_works_with_only_the_shipped_rbac() -> Result<()> {
    show_controller_warnings();
    let admin = TestEnv::shared().client().await?;
    let restricted = shipped_rbac_client(&admin).await?;
    the_controller_works_as(&admin, restricted, "rbac-check").await
}

/// As shipped, the controller may make a machine namespace and nothing more of namespaces, and
/// `capkvm-machine-console` lets whoever it is bound to read machine Pods' consoles there, but
/// not exec into them, make Pods or read Secrets.
#[tokio::test]
async fn the_machine_namespace_rules_are_as_shipped() -> Result<()> {
    let admin = TestEnv::shared().client().await?;
    let restricted = shipped_rbac_client(&admin).await?;
    let namespaces = Api::<k8s_openapi::api::core::v1::Namespace>::all(restricted);
    let ns: k8s_openapi::api::core::v1::Namespace =
        serde_json::from_value(json!({"metadata": {"name": "rbac-machines"}}))?;
    match namespaces.create(&PostParams::default(), &ns).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(e) => {
            return Err(anyhow!(
                "the controller cannot make a machine namespace: {e}"
            ));
        }
    }
    let refused = namespaces
        .delete("rbac-machines", &Default::default())
        .await;
    assert!(
        matches!(refused, Err(kube::Error::Api(s)) if s.code == 403),
        "the controller may not delete namespaces"
    );

    let binding = json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": {"name": "team-a-consoles", "namespace": "rbac-machines"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": "capkvm-machine-console"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "team-a"}]});
    apply(&admin, &binding, false).await?;
    let may = |verb: &str, resource: &str, subresource: &str| {
        let admin = admin.clone();
        let review = json!({"apiVersion": "authorization.k8s.io/v1",
            "kind": "SubjectAccessReview",
            "spec": {"user": "alice", "groups": ["team-a"],
                     "resourceAttributes": {"namespace": "rbac-machines", "verb": verb,
                        "resource": resource, "subresource": subresource}}});
        async move {
            let gvk = GroupVersionKind::gvk("authorization.k8s.io", "v1", "SubjectAccessReview");
            let (ar, _) = discovery::pinned_kind(&admin, &gvk).await?;
            let obj: DynamicObject = serde_json::from_value(review)?;
            let answer = Api::<DynamicObject>::all_with(admin, &ar)
                .create(&PostParams::default(), &obj)
                .await?;
            anyhow::Ok(answer.data["status"]["allowed"] == json!(true))
        }
    };
    // The authorizer sees a new binding a moment later.
    eventually(20, "the console role bound", || async {
        Ok(may("get", "pods", "log").await?.then_some(()))
    })
    .await?;
    assert!(may("list", "pods", "").await?, "which Pods");
    assert!(!may("create", "pods", "exec").await?, "no exec");
    assert!(!may("create", "pods", "").await?, "no Pods of its own");
    assert!(!may("get", "secrets", "").await?, "no Secrets");
    Ok(())
}

/// The controller's warnings (a 403 names the missing rule) show in the test's output.
fn show_controller_warnings() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter("capk_controller=warn,kube_runtime=warn,kube_client=warn")
        .with_test_writer()
        .try_init();
}

/// The namespaced components (`--namespace` set): `infrastructure-components-namespaced.yaml`
/// as `clusterctl init` processes it with CAPK_WATCH_NAMESPACE, and `watch-namespace-rbac.yaml`
/// as `clusterctl generate yaml` renders it. The controller's ServiceAccount may do nothing
/// with tenants' kinds outside the watched namespace, and the controller does all it does
/// there. In an apiserver of its own: the cluster-wide binding other tests apply here would
/// hide a missing rule.
#[tokio::test]
async fn the_controller_works_with_only_the_namespaced_rbac() -> Result<()> {
    show_controller_warnings();
    static ENV: std::sync::OnceLock<TestEnv> = std::sync::OnceLock::new();
    let env = ENV.get_or_init(|| support::start_env("capk-namespaced-rbac-"));
    let admin = env.client().await?;
    let ns = "watched";
    let dir = release_dir()?;
    let config = tempfile::Builder::new().suffix(".yaml").tempfile()?;
    std::fs::copy(dir.join("../../clusterctl-namespaced.yaml"), config.path())?;
    let config = config.path().to_string_lossy().into_owned();
    let vars = [("CAPK_WATCH_NAMESPACE", ns)];
    let args = [
        "generate",
        "provider",
        "--infrastructure",
        "kvm",
        "--config",
    ];
    let components = docs(&clusterctl(
        &[&args[..], &[config.as_str()]].concat(),
        &vars,
    )?)?;
    let deploy = components
        .iter()
        .find(|o| o["kind"] == "Deployment")
        .context("the manager Deployment")?;
    let watched = deploy["spec"]["template"]["spec"]["containers"][0]["env"]
        .as_array()
        .and_then(|e| e.iter().find(|v| v["name"] == "CAPK_NAMESPACE"))
        .map(|v| v["value"].clone());
    assert_eq!(watched, Some(json!(ns)), "it watches that namespace only");
    let machines = deploy["spec"]["template"]["spec"]["containers"][0]["env"]
        .as_array()
        .and_then(|e| e.iter().find(|v| v["name"] == "CAPK_MACHINE_NAMESPACE"))
        .map(|v| v["value"].clone());
    assert_eq!(machines, Some(json!(ns)), "its machines live there too");
    let cluster_wide: Vec<&Value> = components
        .iter()
        .filter(|o| o["kind"] == "ClusterRoleBinding")
        .map(|o| &o["roleRef"]["name"])
        .collect();
    assert_eq!(cluster_wide, [&json!("capkvm-manager-cluster-role")]);
    let without = clusterctl(&[&args[..], &[config.as_str()]].concat(), &[]);
    assert!(
        without.is_err_and(|e| e.to_string().contains("CAPK_WATCH_NAMESPACE")),
        "the namespaced components need the namespace"
    );

    create_namespace(&admin, ns).await?;
    let rbac = [
        "Namespace",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
    ];
    for o in &components {
        if rbac.contains(&o["kind"].as_str().unwrap_or_default()) {
            apply(&admin, o, false).await?;
        }
    }
    let from = dir.join("watch-namespace-rbac.yaml");
    let binding = docs(&clusterctl(
        &[
            "generate",
            "yaml",
            "--from",
            &from.to_string_lossy(),
            "--config",
            &config,
        ],
        &vars,
    )?)?;
    assert_eq!(binding.len(), 1);
    assert_eq!(binding[0]["metadata"]["namespace"], ns);
    apply(&admin, &binding[0], false).await?;
    let restricted = service_account_client(env, &admin).await?;

    // Nothing of a tenant's outside the watched namespace.
    let elsewhere = "not-watched";
    create_namespace(&admin, elsewhere).await?;
    let forbidden = |r: kube::Result<_>| matches!(r, Err(kube::Error::Api(s)) if s.code == 403);
    let lp = kube::api::ListParams::default();
    assert!(forbidden(
        Api::<Pod>::namespaced(restricted.clone(), elsewhere)
            .list_metadata(&lp)
            .await
            .map(|_| ())
    ));
    assert!(forbidden(
        Api::<k8s_openapi::api::core::v1::Secret>::all(restricted.clone())
            .list_metadata(&lp)
            .await
            .map(|_| ())
    ));
    assert!(forbidden(
        Api::<KVMMachine>::namespaced(restricted.clone(), elsewhere)
            .list_metadata(&lp)
            .await
            .map(|_| ())
    ));
    the_controller_works_as(&admin, restricted, ns).await
}

/// The controller at work as `restricted` (its ServiceAccount under the roles a test applied),
/// watching `ns`: leader election, a KVMCluster and a KVMMachine from creation to deletion, a
/// KVMMachineTemplate's status, and what it reads outside any namespace. Any rule missing fails.
async fn the_controller_works_as(admin: &Client, restricted: Client, ns: &str) -> Result<()> {
    // Outside any namespace: the MC node of a machine Pod (its topology labels; whether it is
    // gone when etcd data is to be removed from it), and the metrics endpoint's reviews. The
    // controller goes on without them (unknown), so they are asked here.
    let node: k8s_openapi::api::core::v1::Node =
        serde_json::from_value(json!({"metadata": {"name": "rbac-check-node"}}))?;
    match Api::<k8s_openapi::api::core::v1::Node>::all(admin.clone())
        .create(&PostParams::default(), &node)
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(e) => return Err(e.into()),
    }
    Api::<k8s_openapi::api::core::v1::Node>::all(restricted.clone())
        .get_metadata("rbac-check-node")
        .await
        .context("get a Node")?;
    let review: Value = json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
        "spec": {"token": "not-a-token"}});
    let access: Value = json!({"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
        "spec": {"user": "scraper", "nonResourceAttributes": {"path": "/metrics", "verb": "get"}}});
    for (gvk, body) in [
        (
            GroupVersionKind::gvk("authentication.k8s.io", "v1", "TokenReview"),
            review,
        ),
        (
            GroupVersionKind::gvk("authorization.k8s.io", "v1", "SubjectAccessReview"),
            access,
        ),
    ] {
        let (ar, _) = discovery::pinned_kind(&restricted, &gvk).await?;
        let obj: DynamicObject = serde_json::from_value(body)?;
        Api::<DynamicObject>::all_with(restricted.clone(), &ar)
            .create(&PostParams::default(), &obj)
            .await
            .with_context(|| format!("create a {}", gvk.kind))?;
    }

    // Leader election (--leader-elect, as the Deployment runs it): take the Lease in
    // capkvm-system, renew it, give it back.
    let lease =
        capk_controller::leader::lease_manager(restricted.clone(), "capkvm-system", "rbac-check")
            .await
            .context("Lease under the shipped RBAC")?;
    let held = tokio::time::timeout(std::time::Duration::from_secs(20), lease.changed())
        .await
        .context("taking the Lease timed out")??;
    assert!(held, "the Lease was not taken");
    lease.release().await.context("release the Lease")?;

    create_namespace(admin, ns).await?;
    let _stop = support::start_controller(restricted, ns);

    // KVMCluster: Service, its EndpointSlice, endpoint, status.
    support::provisioned_cluster(admin, ns).await?;
    let cluster = Api::<capk_api::capi::Cluster>::namespaced(admin.clone(), ns)
        .get("demo")
        .await?;
    let kc: KVMCluster = serde_json::from_value(json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1", "kind": "KVMCluster",
        "metadata": {"name": "demo", "ownerReferences": [{
            "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Cluster",
            "name": "demo", "uid": cluster.uid().context("uid")?}]},
        "spec": {},
    }))?;
    let kcs: Api<KVMCluster> = Api::namespaced(admin.clone(), ns);
    kcs.create(&PostParams::default(), &kc).await?;
    eventually(
        30,
        "KVMCluster provisioned under the shipped RBAC",
        || async {
            let kc = kcs.get("demo").await?;
            Ok((kc.status.and_then(|s| s.ready) == Some(true)).then_some(()))
        },
    )
    .await?;
    let slices: Api<k8s_openapi::api::discovery::v1::EndpointSlice> =
        Api::namespaced(admin.clone(), ns);
    eventually(
        30,
        "the controller's EndpointSlice, under the shipped RBAC",
        || async { Ok(slices.get_opt("demo-apiserver").await?.map(|_| ())) },
    )
    .await?;

    // KVMMachine: Ignition Secret, Pod, providerID, status, Events.
    control_plane_machine(
        admin,
        ns,
        "demo-cp-0",
        "#cloud-config\nruncmd:\n- echo ok\n",
    )
    .await?;
    let kms: Api<KVMMachine> = Api::namespaced(admin.clone(), ns);
    let outcome = eventually(
        30,
        "KVMMachine with providerID and Pod under the shipped RBAC",
        || async {
            let km = kms.get("demo-cp-0").await?;
            let pod = Api::<Pod>::namespaced(admin.clone(), ns)
                .get_opt("demo-cp-0")
                .await?;
            Ok((km.spec.provider_id.is_some()
                && km.status.and_then(|s| s.pod_name).is_some()
                && pod.is_some())
            .then_some(()))
        },
    )
    .await;
    if let Err(e) = outcome {
        let km = kms.get("demo-cp-0").await?;
        bail!(
            "{e:#}; the KVMMachine is {:?} {:?}",
            km.spec.provider_id,
            km.status
        );
    }
    // The machine Pod's readiness gate (pods/status), which follows the workload Node: not
    // Ready, the workload cluster has no kubeconfig yet.
    eventually(30, "the readiness gate under the shipped RBAC", || async {
        let pod = Api::<Pod>::namespaced(admin.clone(), ns)
            .get("demo-cp-0")
            .await?;
        let gate = pod
            .status
            .and_then(|s| s.conditions)
            .unwrap_or_default()
            .into_iter()
            .find(|c| c.type_ == capk_api::constants::NODE_READY_GATE);
        Ok(gate.map(|_| ()))
    })
    .await?;

    // KVMMachineTemplate: the autoscaler's capacity in its status.
    let templates: Api<capk_api::v1alpha1::KVMMachineTemplate> = Api::namespaced(admin.clone(), ns);
    let template = serde_json::from_value(json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1", "kind": "KVMMachineTemplate",
        "metadata": {"name": "demo-md-0"},
        "spec": {"template": {"spec": {"resources": {"cpu": 2, "memory": "2Gi", "disk": "20Gi"}}}},
    }))?;
    templates.create(&PostParams::default(), &template).await?;
    eventually(
        30,
        "KVMMachineTemplate status.capacity under the shipped RBAC",
        || async {
            let t = templates.get("demo-md-0").await?;
            Ok(t.status.and_then(|s| s.capacity))
        },
    )
    .await?;

    // The machine Pod on a node (as the scheduler binds it): its hostPath etcd data is removed
    // from there when the machine goes.
    let pods: Api<Pod> = Api::namespaced(admin.clone(), ns);
    let binding = json!({"apiVersion": "v1", "kind": "Binding", "metadata": {"name": "demo-cp-0"},
        "target": {"apiVersion": "v1", "kind": "Node", "name": "rbac-check-node"}});
    pods.create_subresource::<Value, Value>(
        "binding",
        "demo-cp-0",
        &PostParams::default(),
        &binding,
    )
    .await?;

    // Deletion: the Pod, the Ignition Secret and the Service go, the etcd data is removed, then
    // the finalizers. The test is the kubelet: it confirms the machine Pod's deletion and
    // reports the cleanup Pod's success.
    kms.delete("demo-cp-0", &Default::default()).await?;
    kcs.delete("demo", &Default::default()).await?;
    eventually(30, "the machine Pod being deleted", || async {
        let pod = pods.get_opt("demo-cp-0").await?;
        Ok(pod
            .is_none_or(|p| p.metadata.deletion_timestamp.is_some())
            .then_some(()))
    })
    .await?;
    let _ = pods
        .delete(
            "demo-cp-0",
            &kube::api::DeleteParams {
                grace_period_seconds: Some(0),
                ..Default::default()
            },
        )
        .await;
    eventually(
        30,
        "the etcd cleanup Pod under the shipped RBAC",
        || async { Ok(pods.get_opt("demo-cp-0-etcd-cleanup").await?) },
    )
    .await?;
    pods.patch_status(
        "demo-cp-0-etcd-cleanup",
        &PatchParams::default(),
        &Patch::Merge(&json!({"status": {"phase": "Succeeded"}})),
    )
    .await?;
    let secrets: Api<k8s_openapi::api::core::v1::Secret> = Api::namespaced(admin.clone(), ns);
    let services: Api<k8s_openapi::api::core::v1::Service> = Api::namespaced(admin.clone(), ns);
    eventually(60, "deletion under the shipped RBAC", || async {
        let gone = kms.get_opt("demo-cp-0").await?.is_none()
            && pods.get_opt("demo-cp-0-etcd-cleanup").await?.is_none()
            && kcs.get_opt("demo").await?.is_none()
            && pods.get_opt("demo-cp-0").await?.is_none()
            && secrets.get_opt("demo-cp-0-ignition").await?.is_none()
            && services.get_opt("demo-apiserver").await?.is_none()
            && slices.get_opt("demo-apiserver").await?.is_none();
        Ok(gone.then_some(()))
    })
    .await?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The flavors as a node boots them: the objects clusterctl renders, the bootstrap data CABPK
// makes from them (`cabpk-render`: CABPK's own code, see hack/cabpk-render/main.go), the
// controller's conversion to Ignition v3 and the launcher's per-boot overlay, checked by
// upstream `ignition-validate`.

const CLUSTER: &str = "demo";
const FLAVOR_NS: &str = "flavors";
/// A node image reference for the node-image flavor (any concrete tag will do: nothing pulls it).
const NODE_IMAGE: &str = "localhost/capk/node:v1.35.4";
/// Where the upstream Flatcar CAPI templates download the Kubernetes sysext from.
const UPSTREAM_SYSEXT: &str = "https://extensions.flatcar.org/extensions";
/// An air-gapped mirror of it.
const MIRROR_SYSEXT: &str = "https://sysext-mirror.example.internal/flatcar";

fn kubernetes_version() -> String {
    capk_tests::pinned_version("KUBERNETES_VERSION")
}

/// `clusterctl generate cluster demo --from <flavor>` with the pinned Kubernetes version, one
/// control-plane machine and one worker.
fn generate_flavor(flavor: &str, env: &[(&str, &str)]) -> Result<String> {
    let path = release_dir()?.join(flavor);
    clusterctl(
        &[
            "generate",
            "cluster",
            CLUSTER,
            "--from",
            &path.to_string_lossy(),
            "--kubernetes-version",
            &kubernetes_version(),
            "--target-namespace",
            FLAVOR_NS,
            "--control-plane-machine-count",
            "1",
            "--worker-machine-count",
            "1",
        ],
        env,
    )
}

/// The machine a bootstrap Secret is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    /// The first control-plane machine (`kubeadm init`).
    Init,
    /// Another control-plane machine (`kubeadm join --control-plane`).
    Join,
    /// A MachineDeployment's machine (`kubeadm join`).
    Worker,
}

const ROLES: [Role; 3] = [Role::Init, Role::Join, Role::Worker];

impl Role {
    fn arg(self) -> &'static str {
        match self {
            Role::Init => "init",
            Role::Join => "join",
            Role::Worker => "worker",
        }
    }

    /// The KVMMachine's name, which the launcher gives the VM as its hostname.
    fn hostname(self) -> &'static str {
        match self {
            Role::Init => "demo-control-plane-x7k2p",
            Role::Join => "demo-control-plane-q9w4m",
            Role::Worker => "demo-md-0-zt5vb-r8d2c",
        }
    }
}

/// Runs `bin args` with `input` on stdin; fails with its stderr.
fn run_with_input(bin: &std::path::Path, args: &[&str], input: &[u8]) -> Result<Vec<u8>> {
    use std::io::Write;
    let mut child = Command::new(bin)
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .with_context(|| format!("run {}", bin.display()))?;
    child.stdin.take().context("stdin")?.write_all(input)?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!(
            "{} {}: {}{}",
            bin.display(),
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(out.stdout)
}

/// The bootstrap Secret (`format`, `value`) CABPK would write for `role` from the rendered
/// objects, made by CABPK's own code (`cabpk-render`; the KVMCluster's endpoint is the
/// control-plane Service's name).
fn cabpk_bootstrap(objects: &str, role: Role) -> Result<(BootstrapFormat, String)> {
    cabpk_bootstrap_at(
        objects,
        role,
        &format!("{CLUSTER}-apiserver.{FLAVOR_NS}.svc:6443"),
    )
}

/// [`cabpk_bootstrap`] with the Cluster's control-plane endpoint `endpoint` (HOST:PORT).
fn cabpk_bootstrap_at(
    objects: &str,
    role: Role,
    endpoint: &str,
) -> Result<(BootstrapFormat, String)> {
    let bin = capk_tests::component("cabpk-render", "make test-deps")?;
    let out = run_with_input(
        &bin,
        &["bootstrap", "--role", role.arg(), "--endpoint", endpoint],
        objects.as_bytes(),
    )?;
    let secret: Value = serde_json::from_slice(&out)?;
    let format = BootstrapFormat::from_secret(secret["format"].as_str())?;
    Ok((
        format,
        secret["value"].as_str().context("value")?.to_owned(),
    ))
}

/// Upstream `ignition-validate` on `json`: errors and warnings both fail.
fn ignition_validate(json: &[u8]) -> Result<()> {
    let bin = capk_tests::component("ignition-validate", "make test-deps")?;
    let out = Command::new(&bin)
        .arg("-")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            use std::io::Write;
            child.stdin.take().expect("stdin").write_all(json)?;
            child.wait_with_output()
        })
        .context("run ignition-validate")?;
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if !out.status.success() || !report.trim().is_empty() {
        bail!("ignition-validate: {report}");
    }
    Ok(())
}

/// The Ignition the guest boots: the controller's conversion of the bootstrap data (the
/// KVMMachine's Ignition Secret), then the launcher's per-boot overlay (hostname, data disks,
/// heartbeat), validated by upstream `ignition-validate`.
fn boot_ignition(format: BootstrapFormat, data: &str, role: Role) -> Result<Value> {
    use capk_launcher::{
        disk,
        ignition::{BootInputs, overlay, prepare},
        qemu::argv::{DiskAttachment, DiskFormat},
    };
    let hostname = role.hostname();
    let facts = capk_bootstrap::MachineFacts {
        hostname: hostname.into(),
        instance_id: format!("kvm://{FLAVOR_NS}/{hostname}"),
    };
    let stored = capk_bootstrap::render_ignition(format, data.as_bytes(), &facts, None)
        .context("the controller's conversion")?;
    let dir = tempfile::tempdir()?;
    let src = dir.path().join("ignition-secret.json");
    std::fs::write(&src, &stored.json)?;
    let attach = |serial: &str| DiskAttachment {
        serial: serial.into(),
        path: "/dev/null".into(),
        format: DiskFormat::Raw,
        base: None,
    };
    let mut disks = vec![
        attach(disk::ROOT_SERIAL),
        attach(disk::DOCKER_SERIAL),
        attach(disk::KUBELET_SERIAL),
    ];
    if role != Role::Worker {
        disks.push(attach(disk::ETCD_SERIAL));
    }
    let boot = overlay(&BootInputs {
        hostname: hostname.into(),
        disks,
        ..Default::default()
    });
    let dest = dir.path().join("fw_cfg.json");
    prepare(&src, &dest, &boot).context("the launcher's overlay")?;
    let json = std::fs::read(&dest)?;
    ignition_validate(&json)?;
    Ok(serde_json::from_slice(&json)?)
}

fn entry<'a>(config: &'a Value, list: &str, key: &str, name: &str) -> Option<&'a Value> {
    let (section, field) = list.split_once('.').expect("section.field");
    config[section][field]
        .as_array()?
        .iter()
        .find(|e| e[key] == name)
}

fn file<'a>(config: &'a Value, path: &str) -> Option<&'a Value> {
    entry(config, "storage.files", "path", path)
}

fn unit<'a>(config: &'a Value, name: &str) -> Option<&'a Value> {
    entry(config, "systemd.units", "name", name)
}

/// The text of an inline (`data:` URL) file.
fn inline_text(file: &Value) -> Result<String> {
    let source = file["contents"]["source"].as_str().context("no source")?;
    if !file["contents"]["compression"].is_null() {
        bail!("{} is compressed", file["path"]);
    }
    let url = data_url::DataUrl::process(source).map_err(|e| anyhow!("{source}: {e:?}"))?;
    let (bytes, _) = url
        .decode_to_vec()
        .map_err(|e| anyhow!("{source}: {e:?}"))?;
    Ok(String::from_utf8(bytes)?)
}

/// The values of `key=` in a unit and its drop-ins, each space-separated word once.
fn unit_values(unit: &Value, key: &str) -> Vec<String> {
    let mut texts = vec![unit["contents"].as_str().unwrap_or_default().to_owned()];
    for d in unit["dropins"].as_array().into_iter().flatten() {
        texts.push(d["contents"].as_str().unwrap_or_default().to_owned());
    }
    let prefix = format!("{key}=");
    texts
        .iter()
        .flat_map(|t| t.lines())
        .filter_map(|l| l.trim().strip_prefix(&prefix))
        .flat_map(|v| v.split_whitespace().map(str::to_owned))
        .collect()
}

/// Every file's remote (http, https) source.
fn remote_sources(config: &Value) -> Vec<String> {
    config["storage"]["files"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|f| f["contents"]["source"].as_str())
        .filter(|s| s.starts_with("http://") || s.starts_with("https://"))
        .map(str::to_owned)
        .collect()
}

/// What a stock Flatcar node needs to run kubeadm: the Kubernetes sysext of `version`
/// downloaded from `base` by Ignition, linked into /etc/extensions (merged by
/// systemd-sysext.service at boot), and kubeadm.service ordered after the merge, Flatcar's
/// unit reload and containerd. Nothing else is downloaded; Flatcar's own updates stay off.
fn assert_kubernetes_sysext(config: &Value, base: &str, version: &str, what: &str) {
    let raw = format!("/opt/extensions/kubernetes/kubernetes-{version}-x86-64.raw");
    let sysext = file(config, &raw).unwrap_or_else(|| panic!("{what}: Ignition writes no {raw}"));
    let url = format!("{base}/kubernetes-{version}-x86-64.raw");
    assert_eq!(sysext["contents"]["source"], url, "{what}: {sysext}");
    assert_eq!(remote_sources(config), [url], "{what}: other downloads");
    let link = entry(
        config,
        "storage.links",
        "path",
        "/etc/extensions/kubernetes.raw",
    )
    .unwrap_or_else(|| panic!("{what}: no /etc/extensions/kubernetes.raw"));
    assert_eq!(link["target"], raw, "{what}: {link}");
    assert_ne!(link["hard"], true, "{what}: {link}");

    let kubeadm =
        unit(config, "kubeadm.service").unwrap_or_else(|| panic!("{what}: no kubeadm.service"));
    assert_eq!(kubeadm["enabled"], true, "{what}: {kubeadm}");
    let after = unit_values(kubeadm, "After");
    for dep in [
        "systemd-sysext.service",
        "ensure-sysext.service",
        "containerd.service",
    ] {
        assert!(
            after.iter().any(|a| a == dep),
            "{what}: kubeadm.service is not After={dep}: {after:?}"
        );
    }
    let requires = unit_values(kubeadm, "Requires");
    assert!(
        requires.iter().any(|r| r == "systemd-sysext.service"),
        "{what}: kubeadm.service does not require the sysext merge: {requires:?}"
    );
    for masked in ["update-engine.service", "locksmithd.service"] {
        let u = unit(config, masked).unwrap_or_else(|| panic!("{what}: no {masked}"));
        assert_eq!(u["mask"], true, "{what}: {u}");
    }
}

/// The kubeadm configuration documents CABPK's Ignition writes (`/etc/kubeadm.yml`), by kind.
fn kubeadm_documents(config: &Value) -> Result<BTreeMap<String, Value>> {
    let text = inline_text(file(config, "/etc/kubeadm.yml").context("no /etc/kubeadm.yml")?)?;
    Ok(docs(&text)?
        .into_iter()
        .map(|d| (d["kind"].as_str().unwrap_or_default().to_owned(), d))
        .collect())
}

/// The kubeadm configuration documents of a cloud-config node as capk-bootstrap converts them:
/// CABPK's `/run/kubeadm/kubeadm.yaml` (init) or `kubeadm-join-config.yaml` (join), by kind.
fn cloud_config_kubeadm_documents(config: &Value) -> Result<BTreeMap<String, Value>> {
    let kubeadm_yaml = config["storage"]["files"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|f| {
            f["path"]
                .as_str()
                .is_some_and(|p| p.contains("/run/kubeadm/kubeadm"))
        })
        .context("no /run/kubeadm/kubeadm*.yaml")?;
    Ok(docs(&inline_text(kubeadm_yaml)?)?
        .into_iter()
        .map(|d| (d["kind"].as_str().unwrap_or_default().to_owned(), d))
        .collect())
}

/// The kubeadm documents the node of `role` gets from `objects`, whichever format CABPK wrote.
fn node_kubeadm_documents(objects: &str, role: Role) -> Result<BTreeMap<String, Value>> {
    let (format, data) = cabpk_bootstrap(objects, role)?;
    let config = boot_ignition(format, &data, role)?;
    match format {
        BootstrapFormat::CloudConfig => cloud_config_kubeadm_documents(&config),
        BootstrapFormat::Ignition => kubeadm_documents(&config),
    }
}

/// The leader-election flags kubeadm gives the controller-manager and the scheduler, in order
/// (lease duration, renew deadline, retry period).
fn assert_leader_election(kubeadm: &BTreeMap<String, Value>, want: [&str; 3], what: &str) {
    let cluster = &kubeadm["ClusterConfiguration"];
    for component in ["controllerManager", "scheduler"] {
        let args = &cluster[component]["extraArgs"];
        let got: BTreeMap<&str, &str> = args
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|a| Some((a["name"].as_str()?, a["value"].as_str()?)))
            .collect();
        for (flag, value) in [
            "leader-elect-lease-duration",
            "leader-elect-renew-deadline",
            "leader-elect-retry-period",
        ]
        .into_iter()
        .zip(want)
        {
            assert_eq!(
                got.get(flag).copied(),
                Some(value),
                "{what}: {component} --{flag}: {args}"
            );
        }
    }
}

/// kubeadm's timeouts as the flavors set them, in kubeadm's own notation.
fn assert_timeouts(kubeadm: &BTreeMap<String, Value>, role: Role, want: &[(&str, &str)]) {
    let kind = match role {
        Role::Init => "InitConfiguration",
        Role::Join | Role::Worker => "JoinConfiguration",
    };
    let timeouts = &kubeadm[kind]["timeouts"];
    for (field, value) in want {
        assert_eq!(
            timeouts[field], *value,
            "{role:?}: {kind}.timeouts.{field}: {timeouts}"
        );
    }
}

/// The timeouts a joining worker uses (the control-plane ones do not apply to it).
const WORKER_TIMEOUTS: [&str; 4] = [
    "kubeletHealthCheck",
    "kubernetesAPICall",
    "tlsBootstrap",
    "discovery",
];

fn default_timeouts(role: Role) -> Vec<(&'static str, &'static str)> {
    let all = [
        ("controlPlaneComponentHealthCheck", "10m0s"),
        ("kubeletHealthCheck", "10m0s"),
        ("kubernetesAPICall", "3m0s"),
        ("etcdAPICall", "6m0s"),
        ("tlsBootstrap", "10m0s"),
        ("discovery", "10m0s"),
    ];
    all.into_iter()
        .filter(|(f, _)| role != Role::Worker || WORKER_TIMEOUTS.contains(f))
        .collect()
}

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

/// RFC 6902 `add` of an object member, as the topology controller applies a ClusterClass's
/// inline patch: the parent must exist.
fn json_patch_add(target: &mut Value, path: &str, value: Value) -> Result<()> {
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
fn class_objects() -> Result<Vec<Value>> {
    let file = release_dir()?.join("clusterclass-kvm.yaml");
    docs(&clusterctl(
        &["generate", "yaml", "--from", &file.to_string_lossy()],
        &[],
    )?)
}

/// `value` with the defaults of `schema` filled in where absent, as the apiserver's structural
/// defaulting (which Cluster API runs on a Cluster's variables) does: a parent's default first,
/// then its properties'.
fn with_defaults(schema: &Value, value: Option<&Value>) -> Option<Value> {
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
fn topology_variables(cc: &Value, cluster: &Value, version: &str) -> Value {
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
fn render_patch_template(template: &str, variables: &Value) -> Result<Value> {
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
struct Topology {
    kvm_cluster_template: Value,
    kcp_template: Value,
    kct: Value,
    control_plane_machine: Value,
    worker_machine: Value,
}

/// What the topology controller makes of the ClusterClass `kvm` for `cluster`: the class's
/// templates with each enabled patch applied where its selector points, each value taken from
/// `value`, a variable (`valueFrom.variable`, dotted) or a Go template (`valueFrom.template`).
fn topology(class: &[Value], cluster: &Value, version: &str) -> Result<Topology> {
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
fn topology_objects(class: &[Value], cluster: &Value, version: &str) -> Result<String> {
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
fn machine_labels(o: &Value) -> BTreeMap<String, String> {
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
