//! The longest names Cluster API makes, and longer hand-made ones, against a real apiserver:
//! a 63-character Cluster gets its control-plane Service, and every machine its Ignition Secret
//! and Pod, with a hostname (= Node name) that is a DNS label of its own.
//!
//! Cluster API v1.14 names (`internal/topology/names`): a KubeadmControlPlane's Machines are
//! `{{ .kubeadmControlPlane.name }}-{{ .random }}`, a MachineSet is `<machinedeployment>-<random>`
//! and its Machines `{{ .machineSet.name }}-{{ .random }}`; a name longer than 63 is cut to 58
//! and given 5 random characters. The KVMMachine is named like its Machine.

mod support;

use std::collections::{BTreeMap, BTreeSet};

use anyhow::{Context, Result, ensure};
use capk_api::{
    capi::{Cluster, Machine},
    v1alpha1::{KVMCluster, KVMMachine},
};
use capk_tests::env::TestEnv;
use k8s_openapi::api::core::v1::{Pod, Secret, Service};
use kube::{
    Api, Client, ResourceExt,
    api::{ListParams, Patch, PatchParams, PostParams},
};
use serde_json::json;
use support::{create_namespace, eventually, start_controller};

/// What Cluster API's name generators make of `base` when it is too long: cut to 58, 5 random.
fn capi_name(base: &str, random: &str) -> String {
    let name = format!("{base}-{random}");
    if name.len() > 63 {
        format!("{}{random}", &name[..58])
    } else {
        name
    }
}

async fn machine(
    client: &Client,
    ns: &str,
    cluster: &str,
    name: &str,
    control_plane: bool,
) -> Result<()> {
    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": format!("{name}-bootstrap"),
                     "labels": {"cluster.x-k8s.io/cluster-name": cluster}},
        "type": "cluster.x-k8s.io/secret",
        "stringData": {"value": "## template: jinja\n#cloud-config\nwrite_files:\n- path: /etc/node\n  content: \"{{ ds.meta_data.hostname }}\"\n", "format": "cloud-config"},
    }))?;
    Api::<Secret>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &secret)
        .await?;
    let mut labels = BTreeMap::from([("cluster.x-k8s.io/cluster-name", cluster)]);
    if control_plane {
        labels.insert("cluster.x-k8s.io/control-plane", "");
    }
    let m: Machine = serde_json::from_value(json!({
        "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "clusterName": cluster,
            "bootstrap": {"dataSecretName": format!("{name}-bootstrap")},
            "infrastructureRef": {"apiGroup": "infrastructure.cluster.x-k8s.io",
                                  "kind": "KVMMachine", "name": name},
        },
    }))?;
    let m = Api::<Machine>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &m)
        .await?;
    let mut spec = json!({"resources": {"cpu": 1, "memory": "1Gi", "disk": "20Gi"}});
    if control_plane {
        spec["etcdStorage"] = json!({"type": "persistentVolume", "size": "1Gi"});
    }
    let km: KVMMachine = serde_json::from_value(json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1", "kind": "KVMMachine",
        "metadata": {"name": name,
            "labels": {"cluster.x-k8s.io/cluster-name": cluster},
            "ownerReferences": [{"apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine",
                "name": name, "uid": m.uid().context("uid")?, "controller": true}]},
        "spec": spec,
    }))?;
    Api::<KVMMachine>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &km)
        .await?;
    Ok(())
}

fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

#[tokio::test]
async fn the_longest_names_still_make_a_service_secrets_and_pods() -> Result<()> {
    let ns = "long-names";
    let client = TestEnv::shared().client().await?;
    create_namespace(&client, ns).await?;
    let _stop = start_controller(client.clone(), ns);

    // A Cluster name of the longest kind (a DNS label: 63 characters).
    let mut cluster = "payments-platform-eu-west-1-production-workload-".to_owned();
    while cluster.len() < 63 {
        cluster.push('x');
    }
    let clusters: Api<Cluster> = Api::namespaced(client.clone(), ns);
    let c: Cluster = serde_json::from_value(json!({
        "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Cluster",
        "metadata": {"name": cluster},
        "spec": {"infrastructureRef": {"apiGroup": "infrastructure.cluster.x-k8s.io",
                                       "kind": "KVMCluster", "name": cluster}},
    }))?;
    let c = clusters.create(&PostParams::default(), &c).await?;
    let status = json!({"status": {"initialization": {"infrastructureProvisioned": true}}});
    clusters
        .patch_status(&cluster, &PatchParams::default(), &Patch::Merge(&status))
        .await?;
    let kc: KVMCluster = serde_json::from_value(json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1", "kind": "KVMCluster",
        "metadata": {"name": cluster, "ownerReferences": [{
            "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Cluster",
            "name": cluster, "uid": c.uid().context("uid")?}]},
        "spec": {},
    }))?;
    let kcs: Api<KVMCluster> = Api::namespaced(client.clone(), ns);
    kcs.create(&PostParams::default(), &kc).await?;

    // KubeadmControlPlane `<cluster>-control-plane` and MachineDeployment `<cluster>-md-0`, as
    // Cluster API names their Machines; and two hand-made names past 63 characters that share
    // their first 100.
    let cp = capi_name(&format!("{cluster}-control-plane"), "x7k2p");
    let machine_set = capi_name(&format!("{cluster}-md-0"), "bq9ts");
    let worker = capi_name(&machine_set, "4vz8n");
    let long = format!("{cluster}.workers.{}", "pool".repeat(10));
    let (long_a, long_b) = (format!("{long}-a"), format!("{long}-b"));
    assert_eq!((cp.len(), worker.len()), (63, 63));
    machine(&client, ns, &cluster, &cp, true).await?;
    for name in [&worker, &long_a, &long_b] {
        machine(&client, ns, &cluster, name, false).await?;
    }

    // The control-plane Service applies: the KVMCluster is provisioned, its endpoint names it.
    let kc = eventually(30, "KVMCluster provisioned", || async {
        let kc = kcs.get(&cluster).await?;
        let ready = kc
            .status
            .as_ref()
            .and_then(|s| s.contract.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
        Ok(ready.then_some(kc))
    })
    .await?;
    let services = Api::<Service>::namespaced(client.clone(), ns)
        .list(&ListParams::default())
        .await?
        .items;
    ensure!(services.len() == 1, "one control-plane Service");
    let svc = &services[0];
    assert!(is_dns_label(&svc.name_any()), "{}", svc.name_any());
    let host = kc
        .spec
        .control_plane_endpoint
        .as_ref()
        .and_then(|e| e.host.clone())
        .context("endpoint")?;
    assert!(
        host.starts_with(&format!("{}.{ns}.svc.", svc.name_any())),
        "{host}"
    );

    // Every machine gets its Pod and Ignition Secret, under a hostname of its own.
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let secrets: Api<Secret> = Api::namespaced(client.clone(), ns);
    let mut hostnames = BTreeSet::new();
    for name in [&cp, &worker, &long_a, &long_b] {
        let pod = eventually(30, &format!("machine Pod {name}"), || async {
            Ok(pods.get_opt(name).await?)
        })
        .await?;
        let spec = pod.spec.as_ref().context("spec")?;
        let hostname = spec.hostname.clone().context("hostname")?;
        assert!(is_dns_label(&hostname), "{hostname}");
        if name.len() <= 63 {
            assert_eq!(
                &hostname, name,
                "a name that is a DNS label is the hostname"
            );
        }
        assert!(
            hostnames.insert(hostname.clone()),
            "{hostname} is used twice"
        );
        let ignition = spec
            .volumes
            .iter()
            .flatten()
            .find_map(|v| v.secret.as_ref()?.secret_name.clone())
            .context("Ignition volume")?;
        let secret = secrets.get(&ignition).await?;
        let config = String::from_utf8(secret.data.context("data")?["config.ign"].0.clone())?;
        assert!(
            config.contains(&hostname),
            "the guest's node name is the Pod's hostname"
        );
        // The control-plane Service's endpoints are the cluster's Pods labelled control-plane.
        let labels = pod.labels();
        assert_eq!(labels.get("cluster.x-k8s.io/cluster-name"), Some(&cluster));
        let role = labels.get("infrastructure.cluster.x-k8s.io/machine-role");
        let want = if *name == cp {
            "control-plane"
        } else {
            "worker"
        };
        assert_eq!(role.map(String::as_str), Some(want), "{name}");
    }
    Ok(())
}
