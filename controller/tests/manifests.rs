//! The shipped manifests against a real kube-apiserver: the clusterctl contract of
//! infrastructure-components.yaml, the cluster template with real Cluster API CRDs, and the
//! controller working with nothing but the shipped RBAC.

mod support;

use std::{collections::BTreeMap, process::Command};

use anyhow::{Context, Result, anyhow, bail};
use capk_api::v1alpha1::{KVMCluster, KVMMachine};
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

/// `clusterctl init --infrastructure kvm` with no variables set: every variable of the
/// components has a default clusterctl accepts (it calls `${VAR:=}` unset), and the optional
/// settings come out empty, i.e. all namespaces and Flatcar.
#[test]
fn clusterctl_processes_the_components_with_no_variables_set() -> Result<()> {
    let dir = release_dir()?;
    let file = dir.join("infrastructure-components.yaml");
    // What `clusterctl init` runs before applying: variables and image references (which must
    // be canonical, e.g. localhost/capk/...:dev, not capk-controller:dev).
    let config = tempfile::Builder::new().suffix(".yaml").tempfile()?;
    std::fs::write(
        config.path(),
        format!(
            "providers:\n  - name: kvm\n    type: InfrastructureProvider\n    url: file://{}\n",
            file.display()
        ),
    )?;
    let objs = docs(&clusterctl(
        &[
            "generate",
            "provider",
            "--infrastructure",
            "kvm",
            "--config",
            &config.path().to_string_lossy(),
        ],
        &[],
    )?)?;
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
    for name in ["CAPK_NAMESPACE", "CAPK_DEFAULT_NODE_IMAGE"] {
        let value = env(name).with_context(|| format!("env {name}"))?;
        assert!(value.is_null() || value == "", "{name}={value}");
    }
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

    // The ClusterClass of the topology flavor, applied for real (a Cluster refers to it).
    let class = docs(&clusterctl(
        &["generate", "yaml", "--from", &file("clusterclass-kvm.yaml")],
        &[("NAMESPACE", ns)],
    )?)?;
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
    ];
    let flavors: [(&str, &[&str]); 3] = [
        ("cluster-template.yaml", KUBEADM),
        ("cluster-template-ignition.yaml", KUBEADM),
        ("cluster-template-topology.yaml", &["Cluster"]),
    ];
    for (i, (flavor, expected)) in flavors.iter().enumerate() {
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
        assert_eq!(
            required_variables(&listing),
            ["KUBERNETES_VERSION"],
            "{flavor}: {listing}"
        );
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
            &[],
        )?)?;
        assert_eq!(kinds(&objs), *expected, "{flavor}");
        for o in &objs {
            assert_eq!(o["metadata"]["namespace"], ns, "{flavor}: {o}");
            if *flavor == "cluster-template-ignition.yaml" {
                match o["kind"].as_str() {
                    Some("KubeadmControlPlane") => assert_eq!(
                        o["spec"]["kubeadmConfigSpec"]["format"], "ignition",
                        "{flavor}"
                    ),
                    Some("KubeadmConfigTemplate") => assert_eq!(
                        o["spec"]["template"]["spec"]["format"], "ignition",
                        "{flavor}"
                    ),
                    _ => {}
                }
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

/// A client that authenticates as the controller's ServiceAccount.
async fn service_account_client(admin: &Client) -> Result<Client> {
    let sa: Api<k8s_openapi::api::core::v1::ServiceAccount> =
        Api::namespaced(admin.clone(), "capk-system");
    let req = json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                     "spec": {"expirationSeconds": 3600}});
    let resp: Value = sa
        .create_subresource(
            "token",
            "capk-controller-manager",
            &PostParams::default(),
            &req,
        )
        .await?;
    let token = resp["status"]["token"].as_str().context("token")?;
    let kc_path = TestEnv::shared().kubeconfig();
    let mut kc: Value = serde_yaml_ng::from_str(&std::fs::read_to_string(kc_path)?)?;
    kc["users"][0]["user"] = json!({"token": token});
    let kc = Kubeconfig::from_yaml(&serde_yaml_ng::to_string(&kc)?)?;
    let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?;
    Ok(Client::try_from(config)?)
}

#[tokio::test]
async fn the_controller_works_with_only_the_shipped_rbac() -> Result<()> {
    // The controller's warnings (a 403 names the missing rule) show in the test's output.
    let _ = tracing_subscriber::fmt()
        .with_env_filter("capk_controller=warn,kube_runtime=warn,kube_client=warn")
        .with_test_writer()
        .try_init();
    let admin = TestEnv::shared().client().await?;
    // ServiceAccount, ClusterRole and binding exactly as shipped.
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
            apply(&admin, &o, false).await?;
        }
    }
    let restricted = service_account_client(&admin).await?;

    // Leader election (--leader-elect, as the Deployment runs it): take the Lease in
    // capk-system, renew it, give it back.
    let lease =
        capk_controller::leader::lease_manager(restricted.clone(), "capk-system", "rbac-check")
            .await
            .context("Lease under the shipped RBAC")?;
    let held = tokio::time::timeout(std::time::Duration::from_secs(20), lease.changed())
        .await
        .context("taking the Lease timed out")??;
    assert!(held, "the Lease was not taken");
    lease.release().await.context("release the Lease")?;

    let ns = "rbac-check";
    create_namespace(&admin, ns).await?;
    let _stop = support::start_controller(restricted, ns);

    // KVMCluster: Service, endpoint, status.
    support::provisioned_cluster(&admin, ns).await?;
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

    // KVMMachine: Ignition Secret, Pod, providerID, status, Events.
    control_plane_machine(
        &admin,
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

    // Deletion: the Pod, the Ignition Secret and the Service go, then the finalizers.
    kms.delete("demo-cp-0", &Default::default()).await?;
    kcs.delete("demo", &Default::default()).await?;
    let secrets: Api<k8s_openapi::api::core::v1::Secret> = Api::namespaced(admin.clone(), ns);
    let services: Api<k8s_openapi::api::core::v1::Service> = Api::namespaced(admin.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(admin.clone(), ns);
    eventually(60, "deletion under the shipped RBAC", || async {
        let gone = kms.get_opt("demo-cp-0").await?.is_none()
            && kcs.get_opt("demo").await?.is_none()
            && pods.get_opt("demo-cp-0").await?.is_none()
            && secrets.get_opt("demo-cp-0-ignition").await?.is_none()
            && services.get_opt("demo-apiserver").await?.is_none();
        Ok(gone.then_some(()))
    })
    .await?;
    Ok(())
}
