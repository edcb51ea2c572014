//! The shipped RBAC: the controller works, and its metrics are served, with nothing but the
//! ClusterRoles and Roles the release ships (cluster-wide and namespaced).

mod support;

use std::collections::BTreeMap;

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
use support::release::*;
use support::{control_plane_machine, create_namespace, eventually};

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
            Ok((kc.status.and_then(|s| s.contract.ready) == Some(true)).then_some(()))
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
