//! Secrets that are none of the controller's business are not its memory: anyone who may write
//! a Secret in a namespace may give it hundreds of KiB of labels and annotations, and the
//! `capk-controller` binary (as a user runs it) stays within its memory budget beside many of
//! them, with or without the cluster's label, while it still sees every Secret it does read:
//! a bootstrap data Secret that appears, one made by hand without the label Cluster API's
//! contract asks for, a `<cluster>-kubeconfig` that changes, and a hosting kubeconfig without
//! clusterctl's move label.

mod support;

use std::process::{Command, Stdio};

use anyhow::{Context, Result};
use capk_api::{
    capi::Cluster,
    v1alpha1::{KVMCluster, KVMMachine},
};
use capk_tests::env::TestEnv;
use futures::{StreamExt, TryStreamExt, stream};
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::{
    Api, Client, ResourceExt,
    api::{Patch, PatchParams, PostParams},
};
use serde_json::{Value, json};
use support::{
    control_plane_machine_without_secret, create_namespace, eventually, provisioned_cluster_named,
};

const NS: &str = "foreign-secrets";
const HOSTING_NS: &str = "foreign-secrets-hosted";
/// The controller's peak RSS budget, MiB (as `make bench-controller` holds it to).
const RSS_BUDGET_MIB: u64 = 64;
const CLUSTER_NAME_LABEL: &str = "cluster.x-k8s.io/cluster-name";
const MOVE_LABEL: &str = "clusterctl.cluster.x-k8s.io/move";
const BOOTSTRAP: &str = "#cloud-config\nruncmd:\n- echo ok\n";

/// The attack: Secrets with ~0.55 MiB of labels each (150 took the controller to
/// 219 MiB).
const UNRELATED: usize = 150;
/// Secrets with the cluster's label (the controller's watch selects them) and as much
/// metadata: the cache must strip them.
const LABELLED: usize = 50;
/// Labels of the longest key (253-byte prefix, 63-byte name) and value (63 bytes).
const LABELS: usize = 1500;
/// One annotation of 200 KiB (the apiserver allows 256 KiB of annotations).
const ANNOTATION_BYTES: usize = 200 << 10;

/// The labels of a foreign Secret: [`LABELS`] of ~380 bytes each (~0.55 MiB), and `extra`.
fn large_labels(extra: &[(&str, &str)]) -> serde_json::Map<String, Value> {
    let mut labels = serde_json::Map::new();
    for j in 0..LABELS {
        let prefix = format!(
            "{}.{}.{}.{}.l{j:04}",
            "a".repeat(63),
            "b".repeat(63),
            "c".repeat(63),
            "d".repeat(55)
        );
        labels.insert(
            format!("{prefix}/{}", "n".repeat(63)),
            json!("v".repeat(63)),
        );
    }
    for (k, v) in extra {
        labels.insert((*k).to_owned(), json!(v));
    }
    labels
}

async fn create_secret(client: &Client, secret: Value) -> Result<()> {
    let secret: Secret = serde_json::from_value(secret)?;
    Api::<Secret>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &secret)
        .await?;
    Ok(())
}

async fn create_foreign_secrets(client: &Client) -> Result<()> {
    let unrelated = (0..UNRELATED).map(|i| {
        json!({"metadata": {"name": format!("unrelated-{i:03}"), "labels": large_labels(&[])},
               "stringData": {"value": "not the controller's"}})
    });
    let labelled = (0..LABELLED).map(|i| {
        json!({"metadata": {"name": format!("labelled-{i:03}"),
                            "labels": large_labels(&[(CLUSTER_NAME_LABEL, "demo")]),
                            "annotations": {"example.com/blob": "x".repeat(ANNOTATION_BYTES)}},
               "stringData": {"value": "not the controller's either"}})
    });
    stream::iter(unrelated.chain(labelled))
        .map(|s| create_secret(client, s))
        .buffer_unordered(8)
        .try_collect::<Vec<_>>()
        .await?;
    Ok(())
}

fn bootstrap_secret(name: &str, labels: Value) -> Value {
    json!({"metadata": {"name": format!("{name}-bootstrap"), "labels": labels},
           "type": "cluster.x-k8s.io/secret",
           "stringData": {"value": BOOTSTRAP, "format": "cloud-config"}})
}

/// A kubeconfig of cluster `demo` whose user is `user` (refused forms: the condition names
/// the field).
fn kubeconfig(user: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\ncurrent-context: admin@demo\n\
         clusters:\n- name: demo\n  cluster:\n    server: https://127.0.0.1:1\n    \
         certificate-authority-data: Y2E=\n\
         contexts:\n- name: admin@demo\n  context: {{cluster: demo, user: admin}}\n\
         users:\n- name: admin\n  user:\n{user}"
    )
}

fn condition<'a>(
    conditions: Option<&'a Vec<k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition>>,
    type_: &str,
) -> Option<&'a k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition> {
    conditions?.iter().find(|c| c.type_ == type_)
}

/// Waits until KVMMachine `name`'s condition `type_` has `reason` and a message containing
/// `text`.
async fn machine_says(
    kms: &Api<KVMMachine>,
    name: &str,
    type_: &str,
    reason: &str,
    text: &str,
) -> Result<()> {
    eventually(
        60,
        &format!("{name}: {type_} {reason} ({text})"),
        || async {
            let km = kms.get(name).await?;
            Ok(condition(
                km.status
                    .as_ref()
                    .and_then(|s| s.contract.conditions.as_ref()),
                type_,
            )
            .filter(|c| c.reason == reason && c.message.contains(text))
            .map(|_| ()))
        },
    )
    .await
}

/// Cluster `hosted` and its KVMCluster, whose machines and Service live in [`HOSTING_NS`] of
/// the cluster that kubeconfig Secret `secret` names.
async fn hosted_cluster(client: &Client, secret: &str) -> Result<()> {
    provisioned_cluster_named(client, NS, "hosted").await?;
    let cluster = Api::<Cluster>::namespaced(client.clone(), NS)
        .get("hosted")
        .await?;
    let kc: KVMCluster = serde_json::from_value(json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1", "kind": "KVMCluster",
        "metadata": {"name": "hosted", "labels": {CLUSTER_NAME_LABEL: "hosted"},
            "ownerReferences": [{"apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Cluster",
                                 "name": "hosted", "uid": cluster.uid().context("uid")?}]},
        "spec": {"hostingCluster": {"kubeconfigSecretRef": {"name": secret},
                                    "namespace": HOSTING_NS}},
    }))?;
    Api::<KVMCluster>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &kc)
        .await?;
    Ok(())
}

/// The controller's process, stopped when the test ends, a failed assertion too.
struct Controller(std::process::Child);

impl Drop for Controller {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn rss_peak_mib(pid: u32) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .context("VmHWM in /proc/<pid>/status")?;
    Ok(kib / 1024)
}

#[tokio::test]
async fn large_foreign_secrets_stay_out_of_memory_and_the_secrets_read_are_still_seen() -> Result<()>
{
    let env = TestEnv::shared();
    let client = env.client().await?;
    create_namespace(&client, NS).await?;
    create_namespace(&client, HOSTING_NS).await?;
    create_foreign_secrets(&client).await?;

    let controller = Controller(
        Command::new(env!("CARGO_BIN_EXE_capk-controller"))
            .args([
                &format!("--namespace={NS}"),
                "--metrics-addr=127.0.0.1:0",
                "--health-addr=127.0.0.1:0",
            ])
            .env("KUBECONFIG", env.kubeconfig())
            .env("RUST_LOG", "warn")
            // As the Deployment (manifests/manager/manager.yaml) and the image run it.
            .env("MALLOC_ARENA_MAX", "2")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?,
    );
    let pid = controller.0.id();
    {
        let kms: Api<KVMMachine> = Api::namespaced(client.clone(), NS);
        let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
        let secrets: Api<Secret> = Api::namespaced(client.clone(), NS);

        // A Machine names its bootstrap data before the Secret exists; CABPK then writes it,
        // labelled with the cluster: the machine Pod follows.
        control_plane_machine_without_secret(&client, NS, "demo-cp-0").await?;
        machine_says(
            &kms,
            "demo-cp-0",
            "Ready",
            "WaitingForBootstrapData",
            "demo-cp-0",
        )
        .await?;
        create_secret(
            &client,
            bootstrap_secret("demo-cp-0", json!({CLUSTER_NAME_LABEL: "demo"})),
        )
        .await?;
        eventually(60, "the machine Pod after its bootstrap data", || async {
            Ok(pods.get_opt("demo-cp-0").await?)
        })
        .await?;

        // Bootstrap data made by hand, without the cluster's label: still read.
        create_secret(&client, bootstrap_secret("demo-cp-1", json!({}))).await?;
        control_plane_machine_without_secret(&client, NS, "demo-cp-1").await?;
        eventually(
            60,
            "the machine Pod of hand-made bootstrap data",
            || async { Ok(pods.get_opt("demo-cp-1").await?) },
        )
        .await?;

        // The workload kubeconfig appears, then changes: each version is seen (both refused,
        // and the condition names the field of each).
        create_secret(
            &client,
            json!({"metadata": {"name": "demo-kubeconfig",
                                "labels": {CLUSTER_NAME_LABEL: "demo"}},
                   "type": "cluster.x-k8s.io/secret",
                   "stringData": {"value": kubeconfig(
                       "    exec:\n      apiVersion: client.authentication.k8s.io/v1\n      \
                        command: /bin/false\n      interactiveMode: Never\n")}}),
        )
        .await?;
        machine_says(
            &kms,
            "demo-cp-0",
            "NodeReady",
            "WorkloadKubeconfigRefused",
            "`users[0].user.exec`",
        )
        .await?;
        let patch = json!({"stringData": {"value": kubeconfig(
            "    tokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token\n")}});
        secrets
            .patch(
                "demo-kubeconfig",
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await?;
        machine_says(
            &kms,
            "demo-cp-0",
            "NodeReady",
            "WorkloadKubeconfigRefused",
            "`users[0].user.tokenFile`",
        )
        .await?;

        // A hosting kubeconfig made without clusterctl's move label (this very cluster): the
        // controller labels it and uses it.
        create_secret(
            &client,
            json!({"metadata": {"name": "self"},
                   "stringData": {"value": std::fs::read_to_string(env.kubeconfig())?}}),
        )
        .await?;
        hosted_cluster(&client, "self").await?;
        let kcs: Api<KVMCluster> = Api::namespaced(client.clone(), NS);
        eventually(60, "the hosted KVMCluster connected", || async {
            let kc = kcs.get("hosted").await?;
            Ok(condition(
                kc.status
                    .as_ref()
                    .and_then(|s| s.contract.conditions.as_ref()),
                "HostingClusterAvailable",
            )
            .filter(|c| c.status == "True" && c.reason == "HostingClusterConnected")
            .map(|_| ()))
        })
        .await?;
        let hosting = secrets.get("self").await?;
        assert_eq!(
            hosting.labels().get(MOVE_LABEL).map(String::as_str),
            Some(""),
            "the hosting kubeconfig is labelled for clusterctl move"
        );

        let rss = rss_peak_mib(pid)?;
        eprintln!("controller peak RSS: {rss} MiB");
        assert!(
            rss <= RSS_BUDGET_MIB,
            "the controller's peak RSS is {rss} MiB beside {UNRELATED} unrelated and {LABELLED} \
             labelled Secrets with ~0.55 MiB of labels each (budget {RSS_BUDGET_MIB} MiB)"
        );
    }
    Ok(())
}
