//! The `capk-controller` binary as a user runs it: kubeconfig from $KUBECONFIG, health and metrics
//! endpoints, a clean exit on SIGTERM.

mod support;

use std::{
    io::{Read, Write},
    net::{TcpListener, TcpStream},
    process::{Command, Stdio},
    time::Duration,
};

use anyhow::{Context, Result};
use capk_api::v1alpha1::KVMCluster;
use capk_tests::env::TestEnv;
use kube::{Api, api::PostParams};
use serde_json::json;
use support::{create_namespace, eventually};

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A plain HTTP/1.0 GET; returns (status code, body).
fn get(port: u16, path: &str) -> Result<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n")?;
    let mut resp = String::new();
    s.read_to_string(&mut resp)?;
    let code = resp
        .split_whitespace()
        .nth(1)
        .context("status line")?
        .parse()?;
    let body = resp
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((code, body))
}

#[tokio::test]
async fn serves_health_and_metrics_and_stops_on_sigterm() -> Result<()> {
    let env = TestEnv::shared();
    let client = env.client().await?;
    let ns = "binary";
    create_namespace(&client, ns).await?;
    let (metrics_port, health_port) = (free_port(), free_port());
    let mut child = Command::new(env!("CARGO_BIN_EXE_capk-controller"))
        .args([
            &format!("--namespace={ns}"),
            &format!("--metrics-addr=127.0.0.1:{metrics_port}"),
            &format!("--health-addr=127.0.0.1:{health_port}"),
            "--log-format=json",
        ])
        .env("KUBECONFIG", env.kubeconfig())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;

    let result = async {
        eventually(30, "/readyz", || async {
            Ok(get(health_port, "/readyz").ok().filter(|r| r.0 == 200))
        })
        .await?;
        assert_eq!(get(health_port, "/healthz")?, (200, "ok".into()));
        assert_eq!(get(health_port, "/version")?.1, env!("CARGO_PKG_VERSION"));

        let kc: KVMCluster = serde_json::from_value(json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1", "kind": "KVMCluster",
            "metadata": {"name": "metrics"}, "spec": {},
        }))?;
        Api::<KVMCluster>::namespaced(client.clone(), ns)
            .create(&PostParams::default(), &kc)
            .await?;
        eventually(30, "a KVMCluster reconcile in /metrics", || async {
            let (code, body) = get(metrics_port, "/metrics")?;
            Ok((code == 200
                && body.contains("capk_reconciles_total{kind=\"KVMCluster\"}")
                && body.contains("capk_reconcile_duration_seconds_count{kind=\"KVMCluster\"}")
                && body.contains(
                    "capk_object_last_reconciled_timestamp_seconds{kind=\"KVMCluster\",namespace=\"binary\",name=\"metrics\"}",
                ))
            .then_some(()))
        })
        .await?;
        anyhow::Ok(())
    }
    .await;

    // SIGTERM (what the kubelet sends) ends it promptly and cleanly.
    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()?;
    let mut waited = 0;
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        if waited > 100 {
            child.kill()?;
            anyhow::bail!("capk-controller did not exit within 10 s of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(100));
        waited += 1;
    };
    result?;
    assert!(status.success(), "exit status after SIGTERM: {status}");
    Ok(())
}

/// Who holds the leader-election Lease in `ns`.
async fn lease_holder(client: &kube::Client, ns: &str) -> Result<Option<String>> {
    let lease = Api::<k8s_openapi::api::coordination::v1::Lease>::namespaced(client.clone(), ns)
        .get_opt(capk_controller::leader::LEASE_NAME)
        .await?;
    Ok(lease
        .and_then(|l| l.spec)
        .and_then(|s| s.holder_identity)
        .filter(|h| !h.is_empty()))
}

#[tokio::test]
async fn with_leader_election_one_replica_reconciles_and_the_other_takes_over() -> Result<()> {
    let env = TestEnv::shared();
    let client = env.client().await?;
    let ns = "leader-election";
    create_namespace(&client, ns).await?;
    let start = |identity: &str| -> Result<(std::process::Child, u16)> {
        let health = free_port();
        let child = Command::new(env!("CARGO_BIN_EXE_capk-controller"))
            .args([
                &format!("--namespace={ns}"),
                "--metrics-addr=127.0.0.1:0",
                &format!("--health-addr=127.0.0.1:{health}"),
                "--leader-elect",
                &format!("--leader-election-namespace={ns}"),
            ])
            .env("KUBECONFIG", env.kubeconfig())
            .env("POD_NAME", identity)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        Ok((child, health))
    };
    let (mut first, _) = start("capk-first")?;
    eventually(30, "capk-first holds the Lease", || async {
        Ok((lease_holder(&client, ns).await?.as_deref() == Some("capk-first")).then_some(()))
    })
    .await?;
    let (mut second, second_health) = start("capk-second")?;
    // The follower is up and ready (it waits its turn), but does not take the Lease.
    eventually(30, "the follower's /readyz", || async {
        Ok(get(second_health, "/readyz").ok().filter(|r| r.0 == 200))
    })
    .await?;

    let kcs: Api<KVMCluster> = Api::namespaced(client.clone(), ns);
    let provisioned = |name: &'static str| {
        let kcs = kcs.clone();
        async move {
            let kc: KVMCluster = serde_json::from_value(json!({
                "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1", "kind": "KVMCluster",
                "metadata": {"name": name}, "spec": {},
            }))?;
            kcs.create(&PostParams::default(), &kc).await?;
            eventually(30, &format!("KVMCluster {name} reconciled"), || async {
                let kc = kcs.get(name).await?;
                Ok(kc.status.and_then(|s| s.conditions).map(|_| ()))
            })
            .await
        }
    };
    provisioned("one").await?;
    assert_eq!(
        lease_holder(&client, ns).await?.as_deref(),
        Some("capk-first")
    );

    // The leader stops (a rollout, a node drain) and gives the Lease back; the follower takes
    // it (kube-lease-manager looks again when the 15 s lease would have expired) and reconciles.
    let stopped = std::time::Instant::now();
    Command::new("kill")
        .args(["-TERM", &first.id().to_string()])
        .status()?;
    let status = first.wait()?;
    assert!(
        status.success(),
        "the leader's exit after SIGTERM: {status}"
    );
    let result = async {
        eventually(45, "capk-second holds the Lease", || async {
            Ok((lease_holder(&client, ns).await?.as_deref() == Some("capk-second")).then_some(()))
        })
        .await?;
        let takeover = stopped.elapsed();
        provisioned("two").await?;
        anyhow::Ok(takeover)
    }
    .await;
    second.kill()?;
    let _ = second.wait();
    let takeover = result?;
    println!("leader takeover after SIGTERM: {takeover:?}");
    Ok(())
}
