//! The KVM API against a real kube-apiserver: the RFC example is accepted next to real Cluster
//! API v1beta2 objects, and every kind of bad input is rejected with a readable message.

use anyhow::{Context, Result, anyhow};
use capk_api::v1alpha1::{KVMMachine, KVMMachineTemplate};
use capk_tests::env::TestEnv;
use k8s_openapi::api::core::v1::Namespace;
use kube::{
    Api, Client, ResourceExt,
    api::{DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams},
    discovery,
};
use serde_json::{Value, json};

const MANAGER: &str = "capk-api-test";

async fn client_with_namespace(ns: &str) -> Result<Client> {
    let client = TestEnv::shared().client().await?;
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let nsobj: Namespace = serde_json::from_value(json!({"metadata": {"name": ns}}))?;
    match namespaces.create(&PostParams::default(), &nsobj).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(e) => return Err(e.into()),
    }
    Ok(client)
}

/// Server-side applies one object with strict field validation (like
/// `kubectl apply --validate=strict`), returning the apiserver's error text on rejection.
async fn apply(client: &Client, ns: &str, obj: &Value) -> Result<DynamicObject, String> {
    apply_with(
        client,
        ns,
        obj,
        &PatchParams::apply(MANAGER).force().validation_strict(),
    )
    .await
}

/// Server-side applies one object with `params`.
async fn apply_with(
    client: &Client,
    ns: &str,
    obj: &Value,
    params: &PatchParams,
) -> Result<DynamicObject, String> {
    let mut obj: DynamicObject = serde_json::from_value(obj.clone()).map_err(|e| e.to_string())?;
    obj.metadata.namespace = Some(ns.to_owned());
    let types = obj.types.clone().ok_or("object without apiVersion/kind")?;
    let gvk = GroupVersionKind::try_from(&types).map_err(|e| e.to_string())?;
    let (ar, _) = discovery::pinned_kind(client, &gvk)
        .await
        .map_err(|e| format!("discover {gvk:?}: {e}"))?;
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &ar);
    api.patch(&obj.name_any(), params, &Patch::Apply(&obj))
        .await
        .map_err(|e| match e {
            kube::Error::Api(status) => status.message,
            other => other.to_string(),
        })
}

async fn expect_rejected(client: &Client, ns: &str, obj: Value, wanted: &[&str]) {
    let name = obj["metadata"]["name"].as_str().unwrap_or("?").to_owned();
    match apply(client, ns, &obj).await {
        Ok(_) => panic!("{name}: the apiserver accepted an invalid object:\n{obj:#}"),
        Err(message) => {
            // Case-insensitive: create says "Duplicate value", server-side apply "duplicate entries".
            for w in wanted {
                assert!(
                    message.to_lowercase().contains(&w.to_lowercase()),
                    "{name}: rejection message lacks {w:?}:\n{message}"
                );
            }
        }
    }
}

fn machine(name: &str, spec: Value) -> Value {
    json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1",
        "kind": "KVMMachine",
        "metadata": {"name": name},
        "spec": spec,
    })
}

fn resources() -> Value {
    json!({"cpu": 1, "memory": "1Gi", "disk": "20Gi", "dockerVolumeSize": "5Gi"})
}

fn machine_with(name: &str, patch: Value) -> Value {
    let mut spec = json!({"resources": resources()});
    merge(&mut spec, patch);
    machine(name, spec)
}

fn merge(base: &mut Value, patch: Value) {
    match (base, patch) {
        (Value::Object(b), Value::Object(p)) => {
            for (k, v) in p {
                merge(b.entry(k).or_insert(Value::Null), v);
            }
        }
        (b, p) => *b = p,
    }
}

fn rfc_example() -> Result<Vec<Value>> {
    let path = capk_tests::repo_root().join("tests/fixtures/rfc-example.yaml");
    let text = std::fs::read_to_string(&path)?;
    let mut docs = Vec::new();
    for doc in serde_yaml_ng::Deserializer::from_str(&text) {
        let v: Value = serde::Deserialize::deserialize(doc).context("parse the RFC example")?;
        if !v.is_null() {
            docs.push(v);
        }
    }
    Ok(docs)
}

#[tokio::test]
async fn rfc_example_is_accepted_with_cluster_api_objects() -> Result<()> {
    let ns = "rfc-example";
    let client = client_with_namespace(ns).await?;
    let docs = rfc_example()?;
    let kinds: Vec<&str> = docs.iter().filter_map(|d| d["kind"].as_str()).collect();
    for kind in [
        "Cluster",
        "KVMCluster",
        "KubeadmControlPlane",
        "MachineDeployment",
        "KubeadmConfigTemplate",
        "KVMMachineTemplate",
    ] {
        assert!(kinds.contains(&kind), "the RFC example lacks a {kind}");
    }
    for doc in &docs {
        apply(&client, ns, doc)
            .await
            .map_err(|e| anyhow!("{} {}: {e}", doc["kind"], doc["metadata"]["name"]))?;
    }

    // Stored as written, and readable through the typed API the controller uses.
    let templates: Api<KVMMachineTemplate> = Api::namespaced(client.clone(), ns);
    let t = templates.get("demo-md-0").await?;
    let r = &t.spec.template.spec.resources;
    assert_eq!(r.cpu, 1);
    assert_eq!(r.memory.bytes()?, 1 << 30);
    assert_eq!(r.disk.bytes()?, 20 << 30);
    assert_eq!(
        r.docker_volume_size.as_ref().map(|q| q.0.as_str()),
        Some("5Gi")
    );
    Ok(())
}

#[tokio::test]
async fn invalid_machines_are_rejected_with_readable_messages() -> Result<()> {
    let ns = "invalid-machines";
    let client = client_with_namespace(ns).await?;
    let cases: Vec<(Value, Vec<&str>)> = vec![
        (
            machine_with("cpu-zero", json!({"resources": {"cpu": 0}})),
            vec!["spec.resources.cpu", "must be at least 1"],
        ),
        (
            // The launcher runs at most 255 vCPUs.
            machine_with("cpu-256", json!({"resources": {"cpu": 256}})),
            vec!["spec.resources.cpu", "must be at most 255"],
        ),
        (
            machine_with("tiny-memory", json!({"resources": {"memory": "128Mi"}})),
            vec!["spec.resources.memory", "at least 256Mi"],
        ),
        (
            machine_with("word-disk", json!({"resources": {"disk": "big"}})),
            vec!["spec.resources.disk", "quantity of at least 1Gi"],
        ),
        (
            machine_with("negative-disk", json!({"resources": {"disk": "-20Gi"}})),
            vec!["spec.resources.disk"],
        ),
        (
            machine_with("zero-docker", json!({"resources": {"dockerVolumeSize": 0}})),
            vec!["dockerVolumeSize must be a positive quantity"],
        ),
        (
            machine_with(
                "bad-kubelet",
                json!({"resources": {"kubeletVolumeSize": "5 GB"}}),
            ),
            vec!["kubeletVolumeSize must be a positive quantity"],
        ),
        (
            machine_with(
                "long-tag",
                json!({"hostVolumes": [{"mountTag": "a-mount-tag-longer-than-31-characters", "hostPath": "/srv"}]}),
            ),
            vec!["spec.hostVolumes[0].mountTag", "1-31 characters"],
        ),
        (
            machine_with(
                "dup-tag",
                json!({"hostVolumes": [
                    {"mountTag": "data", "hostPath": "/srv/a"},
                    {"mountTag": "data", "hostPath": "/srv/b"},
                ]}),
            ),
            vec!["duplicate", "mountTag", "data"],
        ),
        (
            machine_with(
                "relative-volume",
                json!({"hostVolumes": [{"mountTag": "data", "hostPath": "srv"}]}),
            ),
            vec!["hostPath must be an absolute path"],
        ),
        (
            machine_with("etcd-no-path", json!({"etcdStorage": {"type": "hostPath"}})),
            vec!["etcdStorage.hostPath is required when type is hostPath"],
        ),
        (
            machine_with(
                "etcd-mixed",
                json!({"etcdStorage": {"type": "hostPath", "hostPath": "/var/lib/capk", "size": "10Gi"}}),
            ),
            vec!["storageClassName and size apply only to type persistentVolume"],
        ),
        (
            machine_with(
                "etcd-pv-no-size",
                json!({"etcdStorage": {"type": "persistentVolume"}}),
            ),
            vec!["etcdStorage.size is required when type is persistentVolume"],
        ),
        (
            machine_with(
                "etcd-pv-path",
                json!({"etcdStorage": {"type": "persistentVolume", "size": "10Gi", "hostPath": "/x"}}),
            ),
            vec!["hostPath applies only to type hostPath"],
        ),
        (
            machine_with("etcd-bad-type", json!({"etcdStorage": {"type": "nfs"}})),
            vec![
                "spec.etcdStorage.type",
                "Unsupported value",
                "hostPath",
                "persistentVolume",
            ],
        ),
        (
            machine_with(
                "two-images",
                json!({"image": {
                    "flatcar": {"channel": "stable", "version": "4230.2.3"},
                    "url": {"url": "https://images.example/flatcar.img", "sha256": "0".repeat(64)},
                }}),
            ),
            vec!["image needs exactly one of flatcar, containerImage or url"],
        ),
        (
            machine_with(
                "flatcar-current",
                json!({"image": {"flatcar": {"channel": "stable", "version": "current"}}}),
            ),
            vec!["flatcar.version must be a pinned release such as 4230.2.3"],
        ),
        (
            machine_with(
                "bad-sha",
                json!({"image": {"url": {"url": "https://images.example/f.img", "sha256": "xyz"}}}),
            ),
            vec!["sha256 must be 64 lowercase hex digits"],
        ),
        (
            machine_with("bad-dns", json!({"dns": {"servers": ["dns.example"]}})),
            vec!["dns.servers must be IPv4 addresses"],
        ),
        (
            // The guest gets its DNS servers by DHCPv4.
            machine_with(
                "ipv6-dns",
                json!({"dns": {"servers": ["10.96.0.10", "fd00::10"]}}),
            ),
            vec!["spec.dns.servers", "dns.servers must be IPv4 addresses"],
        ),
        (
            machine_with("bad-accel", json!({"accel": "hvf"})),
            vec!["spec.accel", "Unsupported value"],
        ),
        (
            machine_with("unknown-field", json!({"cores": 4})),
            // SSA says "field not declared in schema", create says "unknown field".
            vec!["spec.cores", "field"],
        ),
        (
            machine("no-resources", json!({})),
            vec!["spec.resources", "Required value"],
        ),
    ];
    for (obj, wanted) in cases {
        expect_rejected(&client, ns, obj, &wanted).await;
    }
    Ok(())
}

#[tokio::test]
async fn invalid_clusters_are_rejected_with_readable_messages() -> Result<()> {
    let ns = "invalid-clusters";
    let client = client_with_namespace(ns).await?;
    let cluster = |name: &str, spec: Value| {
        json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1",
            "kind": "KVMCluster",
            "metadata": {"name": name},
            "spec": spec,
        })
    };
    let cases = vec![
        (
            cluster(
                "port-high",
                json!({"controlPlaneEndpoint": {"host": "a.example", "port": 70000}}),
            ),
            vec!["spec.controlPlaneEndpoint.port", "between 1 and 65535"],
        ),
        (
            cluster(
                "port-zero",
                json!({"controlPlaneEndpoint": {"host": "a.example", "port": 0}}),
            ),
            vec!["between 1 and 65535"],
        ),
        (
            cluster(
                "host-only",
                json!({"controlPlaneEndpoint": {"host": "a.example"}}),
            ),
            vec!["controlPlaneEndpoint needs both host and port"],
        ),
        (
            cluster(
                "bad-service",
                json!({"controlPlaneService": {"type": "ExternalName"}}),
            ),
            vec!["spec.controlPlaneService.type", "Unsupported value"],
        ),
        (
            cluster(
                "bad-host",
                json!({"controlPlaneService": {"externalHost": "Not A Host"}}),
            ),
            vec!["externalHost must be a lowercase DNS name"],
        ),
        (
            cluster(
                "port-without-node-port",
                json!({"controlPlaneService": {"type": "LoadBalancer", "nodePort": 31000,
                    "externalHost": "lb.example.com"}}),
            ),
            vec!["nodePort is only for type NodePort"],
        ),
        (
            cluster(
                "node-port-range",
                json!({"controlPlaneService": {"type": "NodePort", "nodePort": 6443,
                    "externalHost": "nodes.example.com"}}),
            ),
            vec!["nodePort must be in Kubernetes' node port range 30000-32767"],
        ),
        (
            cluster(
                "node-port-no-host",
                json!({"controlPlaneService": {"type": "NodePort"}}),
            ),
            vec!["NodePort or LoadBalancer needs spec.controlPlaneService.externalHost"],
        ),
        (
            cluster(
                "lb-no-host",
                json!({"controlPlaneService": {"type": "LoadBalancer", "externalHost": ""}}),
            ),
            vec!["NodePort or LoadBalancer needs spec.controlPlaneService.externalHost"],
        ),
        (
            cluster(
                "dup-fd",
                json!({"failureDomains": [{"name": "zone-a"}, {"name": "zone-a"}]}),
            ),
            vec!["duplicate", "failureDomains", "zone-a"],
        ),
    ];
    for (obj, wanted) in cases {
        expect_rejected(&client, ns, obj, &wanted).await;
    }
    Ok(())
}

#[tokio::test]
async fn provider_id_cannot_change_once_set() -> Result<()> {
    let ns = "provider-id";
    let client = client_with_namespace(ns).await?;
    apply(&client, ns, &machine_with("m", json!({})))
        .await
        .map_err(|e| anyhow!(e))?;
    // Setting it the first time is what the controller does.
    apply(
        &client,
        ns,
        &machine_with("m", json!({"providerID": "kvm://provider-id/m"})),
    )
    .await
    .map_err(|e| anyhow!(e))?;
    expect_rejected(
        &client,
        ns,
        machine_with("m", json!({"providerID": "kvm://provider-id/other"})),
        &["providerID cannot be changed once set"],
    )
    .await;
    // Dropping it is a change too.
    expect_rejected(
        &client,
        ns,
        machine_with("m", json!({})),
        &["providerID cannot be changed once set"],
    )
    .await;
    let machines: Api<KVMMachine> = Api::namespaced(client, ns);
    assert_eq!(
        machines.get("m").await?.spec.provider_id.as_deref(),
        Some("kvm://provider-id/m")
    );
    Ok(())
}

/// The request Cluster API's topology controller makes to see whether a ClusterClass change
/// alters a template (CAPI v1.14 `structuredmerge/dryrun.go`): a forced server-side apply as
/// `capi-topology` with `dryRun=All`, the object carrying the annotation
/// `topology.cluster.x-k8s.io/dry-run: ""`.
async fn topology_dry_run(client: &Client, ns: &str, obj: &Value) -> Result<DynamicObject, String> {
    let mut obj = obj.clone();
    obj["metadata"]["annotations"]["topology.cluster.x-k8s.io/dry-run"] = json!("");
    apply_with(
        client,
        ns,
        &obj,
        &PatchParams::apply("capi-topology").force().dry_run(),
    )
    .await
}

#[tokio::test]
async fn templates_are_immutable_but_take_the_topology_dry_run() -> Result<()> {
    let ns = "immutable-templates";
    let client = client_with_namespace(ns).await?;
    let template = |memory: &str| {
        json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1",
            "kind": "KVMMachineTemplate",
            "metadata": {"name": "workers"},
            "spec": {"template": {"spec": {"resources":
                {"cpu": 2, "memory": memory, "disk": "20Gi"}}}},
        })
    };
    apply(&client, ns, &template("2Gi"))
        .await
        .map_err(|e| anyhow!(e))?;
    // Re-applying the same spec is fine (GitOps tools do it all the time).
    apply(&client, ns, &template("2Gi"))
        .await
        .map_err(|e| anyhow!(e))?;
    expect_rejected(
        &client,
        ns,
        template("4Gi"),
        &[
            "KVMMachineTemplate spec is immutable",
            "create a new template",
        ],
    )
    .await;
    // The topology controller's dry run of a changed spec is answered, with the changed spec,
    // and changes nothing.
    let answer = topology_dry_run(&client, ns, &template("4Gi"))
        .await
        .map_err(|e| anyhow!("the topology controller's dry run was refused: {e}"))?;
    assert_eq!(
        answer.data["spec"]["template"]["spec"]["resources"]["memory"],
        "4Gi"
    );
    let templates: Api<KVMMachineTemplate> = Api::namespaced(client.clone(), ns);
    let stored = templates.get("workers").await?;
    assert_eq!(stored.spec.template.spec.resources.memory.0, "2Gi");
    assert!(
        !stored
            .annotations()
            .contains_key("topology.cluster.x-k8s.io/dry-run")
    );
    // Only both together pass: a real update with the annotation, and a dry run without it
    // (`kubectl apply --dry-run=server` should tell the truth), are refused.
    let mut annotated = template("4Gi");
    annotated["metadata"]["annotations"] = json!({"topology.cluster.x-k8s.io/dry-run": ""});
    expect_rejected(
        &client,
        ns,
        annotated,
        &["KVMMachineTemplate spec is immutable"],
    )
    .await;
    let plain_dry_run = apply_with(
        &client,
        ns,
        &template("4Gi"),
        &PatchParams::apply(MANAGER).force().dry_run(),
    )
    .await;
    assert!(
        plain_dry_run
            .as_ref()
            .is_err_and(|e| e.contains("KVMMachineTemplate spec is immutable")),
        "a dry run without the topology annotation: {plain_dry_run:?}"
    );
    // Labels, annotations and status stay writable (clusterctl move, the template reconciler).
    templates
        .patch(
            "workers",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {
                "labels": {"team": "a"}, "annotations": {"note": "x"}}})),
        )
        .await?;
    templates
        .patch_status(
            "workers",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"capacity": {"cpu": "2"}}})),
        )
        .await?;

    let cluster_template = |t: &str| {
        json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1",
            "kind": "KVMClusterTemplate",
            "metadata": {"name": "default"},
            "spec": {"template": {"spec": {"controlPlaneService": {"type": t}}}},
        })
    };
    apply(&client, ns, &cluster_template("ClusterIP"))
        .await
        .map_err(|e| anyhow!(e))?;
    expect_rejected(
        &client,
        ns,
        cluster_template("NodePort"),
        &["KVMClusterTemplate spec is immutable"],
    )
    .await;
    topology_dry_run(&client, ns, &cluster_template("NodePort"))
        .await
        .map_err(|e| anyhow!("the topology controller's dry run was refused: {e}"))?;
    Ok(())
}

/// A KVMMachine's spec is what its Pod was built from: once the controller has set providerID
/// (right before it creates the Pod) an edit is refused, not silently ignored. Before, an edit
/// is what the Pod will be built from. The controller's one write (providerID) and metadata and
/// status writes pass.
#[tokio::test]
async fn machine_spec_is_immutable_once_its_pod_is_built() -> Result<()> {
    let ns = "immutable-machines";
    let client = client_with_namespace(ns).await?;
    apply(&client, ns, &machine_with("m", json!({"accel": "kvm"})))
        .await
        .map_err(|e| anyhow!(e))?;
    // No Pod yet (no providerID): a spec the controller refused can still be fixed.
    apply(&client, ns, &machine_with("m", json!({})))
        .await
        .map_err(|e| anyhow!("an edit before the Pod exists was refused: {e}"))?;
    let machines: Api<KVMMachine> = Api::namespaced(client.clone(), ns);
    // What the controller sends (controller/src/kvmmachine/mod.rs `patch_machine`): a merge
    // patch with providerID, and its annotations.
    machines
        .patch(
            "m",
            &PatchParams::default(),
            &Patch::Merge(json!({
                "metadata": {"annotations": {"clusterctl.cluster.x-k8s.io/block-move": "true"}},
                "spec": {"providerID": "kvm://immutable-machines/m"},
            })),
        )
        .await
        .context("the controller sets providerID")?;
    let message = "KVMMachine spec cannot be changed once its machine Pod is built";
    for (what, change) in [
        ("resources", json!({"resources": {"cpu": 2}})),
        (
            "an added image",
            json!({"image": {"flatcar": {"channel": "stable", "version": "4230.2.3"}}}),
        ),
        (
            "an added node selector",
            json!({"nodeSelector": {"zone": "a"}}),
        ),
        ("accel", json!({"accel": "tcg"})),
    ] {
        let mut obj = machine_with("m", change);
        obj["spec"]["providerID"] = json!("kvm://immutable-machines/m");
        match apply(&client, ns, &obj).await {
            Ok(_) => panic!("an edit of {what} was accepted"),
            Err(e) => assert!(
                e.contains(message) && e.contains("KVMMachineTemplate"),
                "{what}: {e}"
            ),
        }
    }
    // Removing a field is a change too.
    let provider_id = json!({"providerID": "kvm://immutable-machines/n"});
    let mut with_accel = machine_with("n", provider_id.clone());
    with_accel["spec"]["accel"] = json!("tcg");
    apply(&client, ns, &with_accel)
        .await
        .map_err(|e| anyhow!(e))?;
    expect_rejected(&client, ns, machine_with("n", provider_id), &[message]).await;

    // Metadata (Cluster API's labels and annotations, finalizers) and status stay writable.
    machines
        .patch(
            "m",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {
                "labels": {"cluster.x-k8s.io/cluster-name": "c"},
                "annotations": {"clusterctl.cluster.x-k8s.io/block-move": null},
                "finalizers": ["kvmmachine.infrastructure.cluster.x-k8s.io"],
            }})),
        )
        .await
        .context("metadata update")?;
    machines
        .patch_status(
            "m",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"ready": true, "podName": "m"}})),
        )
        .await
        .context("status update")?;
    machines
        .patch(
            "m",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": null}})),
        )
        .await?;
    let m = machines.get("m").await?;
    assert_eq!(m.spec.resources.cpu, 1);
    assert_eq!(
        m.spec.provider_id.as_deref(),
        Some("kvm://immutable-machines/m")
    );
    Ok(())
}

#[tokio::test]
async fn control_plane_endpoint_cannot_change_once_set() -> Result<()> {
    let ns = "endpoint";
    let client = client_with_namespace(ns).await?;
    let cluster = |spec: Value| {
        json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1",
            "kind": "KVMCluster",
            "metadata": {"name": "c"},
            "spec": spec,
        })
    };
    // Empty at first; the controller (or the user) fills it in once.
    apply(&client, ns, &cluster(json!({})))
        .await
        .map_err(|e| anyhow!(e))?;
    apply(
        &client,
        ns,
        &cluster(
            json!({"controlPlaneEndpoint": {"host": "c-apiserver.endpoint.svc", "port": 6443}}),
        ),
    )
    .await
    .map_err(|e| anyhow!(e))?;
    expect_rejected(
        &client,
        ns,
        cluster(json!({"controlPlaneEndpoint": {"host": "elsewhere.example", "port": 6443}})),
        &["controlPlaneEndpoint cannot be changed once set"],
    )
    .await;
    Ok(())
}

#[tokio::test]
async fn kubectl_get_kvmmachines_shows_the_story() -> Result<()> {
    let ns = "columns";
    let client = client_with_namespace(ns).await?;
    let mut obj = machine_with("cp-0", json!({"providerID": "kvm://columns/cp-0"}));
    obj["metadata"]["labels"] = json!({"cluster.x-k8s.io/cluster-name": "demo"});
    apply(&client, ns, &obj).await.map_err(|e| anyhow!(e))?;
    let machines: Api<KVMMachine> = Api::namespaced(client.clone(), ns);
    let status = json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1",
        "kind": "KVMMachine",
        "status": {
            "initialization": {"provisioned": true},
            "ready": true,
            "podNamespace": "capk-machines",
            "podName": "demo-cp-0",
            "addresses": [
                {"type": "Hostname", "address": "demo-cp-0"},
                {"type": "InternalIP", "address": "10.244.0.7"},
            ],
        }
    });
    machines
        .patch_status(
            "cp-0",
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(&status),
        )
        .await?;

    // What `kubectl get kvmmachines` prints: the server-side Table.
    let req = http::Request::get(format!(
        "/apis/infrastructure.cluster.x-k8s.io/v1alpha1/namespaces/{ns}/kvmmachines"
    ))
    .header("Accept", "application/json;as=Table;v=v1;g=meta.k8s.io")
    .body(Vec::new())?;
    let table: Value = serde_json::from_str(&client.request_text(req).await?)?;
    let columns: Vec<&str> = table["columnDefinitions"]
        .as_array()
        .context("columnDefinitions")?
        .iter()
        .filter_map(|c| c["name"].as_str())
        .collect();
    assert_eq!(
        columns,
        [
            "Name",
            "Cluster",
            "Provisioned",
            "ProviderID",
            "Pod Namespace",
            "Pod",
            "IP",
            "Age"
        ]
    );
    // The Pod's namespace only with `-o wide` (priority 1): every machine shares it by default.
    let wide: Vec<bool> = table["columnDefinitions"]
        .as_array()
        .context("columnDefinitions")?
        .iter()
        .map(|c| c["priority"].as_i64().unwrap_or(0) > 0)
        .collect();
    assert_eq!(
        wide,
        [false, false, false, false, true, false, false, false]
    );
    let cells = &table["rows"][0]["cells"];
    assert_eq!(cells[0], "cp-0");
    assert_eq!(cells[1], "demo");
    assert_eq!(cells[2], true);
    assert_eq!(cells[3], "kvm://columns/cp-0");
    assert_eq!(cells[4], "capk-machines");
    assert_eq!(cells[5], "demo-cp-0");
    assert_eq!(cells[6], "10.244.0.7");
    Ok(())
}

/// The CRD admits exactly the mount tags the bootstrap overlay and the launcher admit (capk-api's
/// `mount_tag` rule): before, `a.b` passed here and crash-looped the machine Pod.
#[tokio::test]
async fn mount_tags_follow_the_launchers_rule() -> Result<()> {
    let ns = "mount-tags";
    let client = client_with_namespace(ns).await?;
    for (i, tag) in capk_api::mount_tag::EXAMPLES.iter().enumerate() {
        let obj = machine_with(
            &format!("tag-{i}"),
            json!({"hostVolumes": [{"mountTag": tag, "hostPath": "/srv"}]}),
        );
        match (
            capk_api::mount_tag::check(tag),
            apply(&client, ns, &obj).await,
        ) {
            (Ok(()), Ok(_)) => {}
            (Ok(()), Err(e)) => panic!("{tag:?}: the launcher takes it, the CRD refused: {e}"),
            (Err(_), Ok(_)) => panic!("{tag:?}: the launcher refuses it, the CRD accepted it"),
            (Err(_), Err(e)) => assert!(
                e.contains("spec.hostVolumes[0].mountTag")
                    && e.contains(capk_api::mount_tag::CEL_MESSAGE),
                "{tag:?}: {e}"
            ),
        }
    }
    Ok(())
}
