//! `make bench-controller`: N KVMMachines (with Machines and bootstrap Secrets) against a real
//! kube-apiserver, no kubelet (Pods stay Pending), beside Secrets that are none of the
//! controller's business, each carrying what any tenant may write on one: labels up to
//! [`LABEL_BYTES`] and an annotation of [`ANNOTATION_BYTES`]. Most are unrelated (M of them);
//! some carry the cluster's label as Cluster API's own Secrets do (L of them), so the
//! controller's watch selects them and its cache must strip them. Prints: time until every Pod
//! and status exists, the controller's peak RSS against its budget, API requests per machine,
//! and object changes at rest.
//!
//!   CAPK_BENCH_MACHINES=1000 CAPK_BENCH_UNRELATED_SECRETS=10000 CAPK_BENCH_LABELLED_SECRETS=1000 \
//!     cargo bench -p capk-controller --bench controller

use std::{
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use capk_api::v1alpha1::KVMMachine;
use capk_tests::env::{EnvOptions, TestEnv};
use futures::{StreamExt, TryStreamExt, stream};
use k8s_openapi::api::core::v1::{Namespace, Pod, Secret};
use kube::{
    Api, Client, ResourceExt,
    api::{Patch, PatchParams, PostParams},
    core::PartialObjectMeta,
    runtime::{WatchStreamExt, reflector, watcher},
};
use serde_json::{Value, json};

const NS: &str = "bench";
/// The controller's peak RSS budget, MiB: the Deployment's VPA starts from its requests, and
/// one tenant's objects must not grow it.
const RSS_BUDGET_MIB: f64 = 64.0;
/// Labels on each foreign Secret, about this many bytes in all: 48 labels with the longest key
/// (a 253-byte prefix and a 63-byte name) and value (63 bytes) the apiserver accepts.
const LABEL_BYTES: usize = 48 * (253 + 1 + 63 + 63);
/// One annotation on each foreign Secret (the apiserver allows 256 KiB of annotations).
const ANNOTATION_BYTES: usize = 32 << 10;

fn rss_peak_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// Total requests the apiserver served (from its own /metrics), retried while it is busy.
async fn apiserver_requests(client: &Client) -> Result<f64> {
    let mut attempt = 0;
    let text = loop {
        let req = http::Request::get("/metrics").body(Vec::new())?;
        match client.request_text(req).await {
            Ok(t) => break t,
            Err(e) if attempt >= 5 => return Err(e.into()),
            Err(_) => {
                attempt += 1;
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    };
    Ok(text
        .lines()
        .filter(|l| l.starts_with("apiserver_request_total{"))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum())
}

/// The labels (about [`LABEL_BYTES`]) and annotations ([`ANNOTATION_BYTES`]) of a foreign
/// Secret, plus `extra` labels.
fn large_metadata(extra: Value) -> Value {
    let mut labels = serde_json::Map::new();
    for j in 0..LABEL_BYTES / (253 + 1 + 63 + 63) {
        // A DNS subdomain of 253 bytes: four labels of up to 63 bytes and the counter.
        let prefix = format!(
            "{}.{}.{}.{}.l{j:03}",
            "a".repeat(63),
            "b".repeat(63),
            "c".repeat(63),
            "d".repeat(56)
        );
        labels.insert(
            format!("{prefix}/{}", "n".repeat(63)),
            json!("v".repeat(63)),
        );
    }
    if let Value::Object(extra) = extra {
        labels.extend(extra);
    }
    json!({"labels": labels,
           "annotations": {"example.com/blob": "x".repeat(ANNOTATION_BYTES)}})
}

/// Secret `name`, none of the controller's business, with large labels and annotations (and
/// `extra` labels).
async fn create_foreign_secret(client: &Client, name: String, extra: Value) -> Result<()> {
    let mut metadata = large_metadata(extra);
    metadata["name"] = json!(name);
    let secret: Secret = serde_json::from_value(json!({
        "metadata": metadata,
        "stringData": {"value": "not the controller's"},
    }))?;
    Api::<Secret>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &secret)
        .await?;
    Ok(())
}

async fn create_machine(client: &Client, i: usize) -> Result<()> {
    let name = format!("m-{i:05}");
    let secret: Secret = serde_json::from_value(json!({
        // As CABPK writes it: labelled with its cluster (the Cluster API bootstrap contract).
        "metadata": {"name": format!("{name}-bootstrap"),
                     "labels": {"cluster.x-k8s.io/cluster-name": "demo"}},
        "stringData": {"value": "#cloud-config\nruncmd:\n- kubeadm join --config /run/kubeadm/kubeadm-join-config.yaml\n", "format": "cloud-config"},
    }))?;
    Api::<Secret>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &secret)
        .await?;
    let machine: Value = json!({
        "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine",
        "metadata": {"name": name, "labels": {"cluster.x-k8s.io/cluster-name": "demo"}},
        "spec": {"clusterName": "demo",
                 "bootstrap": {"dataSecretName": format!("{name}-bootstrap")},
                 "infrastructureRef": {"apiGroup": "infrastructure.cluster.x-k8s.io", "kind": "KVMMachine", "name": name}},
    });
    let machine: capk_api::capi::Machine = serde_json::from_value(machine)?;
    let machine = Api::<capk_api::capi::Machine>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &machine)
        .await?;
    let km: KVMMachine = serde_json::from_value(json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1", "kind": "KVMMachine",
        "metadata": {"name": name, "labels": {"cluster.x-k8s.io/cluster-name": "demo"},
            "ownerReferences": [{"apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine",
                "name": name, "uid": machine.uid().context("uid")?, "controller": true}]},
        "spec": {"resources": {"cpu": 1, "memory": "1Gi", "disk": "10Gi"}},
    }))?;
    Api::<KVMMachine>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &km)
        .await?;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<()> {
    let n: usize = std::env::var("CAPK_BENCH_MACHINES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let dir = tempfile::Builder::new()
        .prefix("capk-bench-")
        .tempdir()?
        .keep();
    let env = TestEnv::start(EnvOptions {
        dir,
        stop_with_current_process: true,
    })
    .await?;
    let client = env.client().await?;
    let nsobj: Namespace = serde_json::from_value(json!({"metadata": {"name": NS}}))?;
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &nsobj)
        .await?;
    let cluster: capk_api::capi::Cluster = serde_json::from_value(json!({
        "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Cluster", "metadata": {"name": "demo"},
        "spec": {"infrastructureRef": {"apiGroup": "infrastructure.cluster.x-k8s.io", "kind": "KVMCluster", "name": "demo"}},
    }))?;
    let clusters = Api::<capk_api::capi::Cluster>::namespaced(client.clone(), NS);
    let cluster = clusters.create(&PostParams::default(), &cluster).await?;
    // Its KVMCluster, as Cluster API owns it: the machines read where they live from it.
    let kc: capk_api::v1alpha1::KVMCluster = serde_json::from_value(json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1", "kind": "KVMCluster",
        "metadata": {"name": "demo", "labels": {"cluster.x-k8s.io/cluster-name": "demo"},
            "ownerReferences": [{"apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Cluster",
                "name": "demo", "uid": cluster.metadata.uid.clone().unwrap_or_default()}]},
        "spec": {},
    }))?;
    Api::<capk_api::v1alpha1::KVMCluster>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &kc)
        .await?;
    clusters
        .patch_status(
            "demo",
            &PatchParams::default(),
            &Patch::Merge(
                &json!({"status": {"initialization": {"infrastructureProvisioned": true}}}),
            ),
        )
        .await?;

    let count = |var: &str, default: usize| -> usize {
        std::env::var(var)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let unrelated = count("CAPK_BENCH_UNRELATED_SECRETS", 10_000);
    let labelled = count("CAPK_BENCH_LABELLED_SECRETS", 1_000);
    stream::iter(0..unrelated)
        .map(|i| create_foreign_secret(&client, format!("unrelated-{i:05}"), json!({})))
        .chain(stream::iter(0..labelled).map(|i| {
            create_foreign_secret(
                &client,
                format!("labelled-{i:05}"),
                json!({"cluster.x-k8s.io/cluster-name": "demo"}),
            )
        }))
        .buffer_unordered(16)
        .try_collect::<Vec<_>>()
        .await?;
    let foreign_kib = (LABEL_BYTES + ANNOTATION_BYTES) as f64 / 1024.0;
    let foreign_mib = (unrelated + labelled) as f64 * foreign_kib / 1024.0;
    println!(
        "bench-controller: {unrelated} unrelated + {labelled} labelled foreign Secrets created ({foreign_mib:.0} MiB of labels and annotations)"
    );

    // The objects exist first (as after a `clusterctl move` or a controller restart), then the
    // controller starts: this measures how fast it converges on N machines.
    stream::iter(0..n)
        .map(|i| create_machine(&client, i))
        .buffer_unordered(16)
        .try_collect::<Vec<_>>()
        .await?;
    println!("bench-controller: {n} machines created");

    let before = apiserver_requests(&client).await?;
    let start = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_capk-controller"))
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
        .spawn()?;
    let pid = child.id();

    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let kms: Api<KVMMachine> = Api::namespaced(client.clone(), NS);
    // Convergence is watched, not polled with lists (1000-object lists twice a second would
    // load the apiserver the controller is measured against).
    let (km_store, km_writer) = reflector::store();
    let (pod_store, pod_writer) = reflector::store();
    let km_watch = reflector::reflector(km_writer, watcher(kms.clone(), Default::default()))
        .default_backoff()
        .for_each(|_| async {});
    let pod_watch = reflector::reflector(
        pod_writer,
        watcher(
            Api::<PartialObjectMeta<Pod>>::namespaced(client.clone(), NS),
            Default::default(),
        ),
    )
    .default_backoff()
    .for_each(|_| async {});
    let watches = tokio::spawn(async move {
        futures::join!(km_watch, pod_watch);
    });
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let np = pod_store.state().len();
        let done = km_store
            .state()
            .iter()
            .filter(|k| {
                k.spec.provider_id.is_some()
                    && k.status
                        .as_ref()
                        .and_then(|s| s.pod_name.as_ref())
                        .is_some()
            })
            .count();
        if np == n && done == n {
            break;
        }
        if Instant::now() > deadline {
            child.kill()?;
            bail!("not converged after 600 s: {np} Pods, {done} statuses of {n}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    watches.abort();
    let converge = start.elapsed();
    let after = apiserver_requests(&client).await?;

    // At rest: count changes to our kinds and their children for a while.
    let rest = Duration::from_secs(
        std::env::var("CAPK_BENCH_REST_SECONDS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(60),
    );
    let rest_before = apiserver_requests(&client).await?;
    let changes = {
        let kms_changes = watcher(kms.clone(), watcher::Config::default().any_semantic())
            .applied_objects()
            .take_until(tokio::time::sleep(rest))
            .count();
        let pod_changes = watcher(pods.clone(), watcher::Config::default().any_semantic())
            .applied_objects()
            .take_until(tokio::time::sleep(rest))
            .count();
        let (a, b) = futures::join!(kms_changes, pod_changes);
        // Each watch first replays the n existing objects.
        (a + b).saturating_sub(2 * n)
    };
    // The bench's own watches and /metrics reads are 2 watches + 2 GETs; the rest is the
    // controller's.
    let rest_requests = apiserver_requests(&client).await? - rest_before - 4.0;
    let rss = rss_peak_kib(pid);
    Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()?;
    let _ = child.wait();

    println!("bench-controller: machines                    {n}");
    println!(
        "bench-controller: time to all Pods + statuses {:.1} s",
        converge.as_secs_f64()
    );
    println!(
        "bench-controller: foreign Secrets             {unrelated} unrelated + {labelled} with the cluster's label ({:.0} KiB of labels + {:.0} KiB annotation each, {foreign_mib:.0} MiB in all)",
        LABEL_BYTES as f64 / 1024.0,
        ANNOTATION_BYTES as f64 / 1024.0
    );
    let rss_mib = rss as f64 / 1024.0;
    println!(
        "bench-controller: controller peak RSS         {rss_mib:.1} MiB (budget {RSS_BUDGET_MIB} MiB: {})",
        if rss_mib <= RSS_BUDGET_MIB {
            "within"
        } else {
            "OVER"
        }
    );
    println!(
        "bench-controller: apiserver requests/machine  {:.1} (all clients during convergence)",
        (after - before) / n as f64
    );
    println!(
        "bench-controller: object changes at rest      {changes} in {} s (KVMMachines + Pods)",
        rest.as_secs()
    );
    println!(
        "bench-controller: apiserver requests at rest  {:.0} in {} s (controller, incl. watch renewals)",
        rest_requests.max(0.0),
        rest.as_secs()
    );
    Ok(())
}
