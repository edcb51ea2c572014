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
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use kube::{
    Api,
    api::{Patch, PatchParams, PostParams},
};
use serde_json::{Value, json};
use support::{
    create_namespace, eventually,
    scrape::{https_get, token_for},
};

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
            &format!("--diagnostics-address=127.0.0.1:{metrics_port}"),
            "--insecure-diagnostics",
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
        // Under controller-runtime's names, as Cluster API's dashboards query them, and the
        // client's requests as client-go counts them.
        eventually(30, "a KVMCluster reconcile in /metrics", || async {
            let (code, body) = get(metrics_port, "/metrics")?;
            let reconciles: f64 = body
                .lines()
                .filter(|l| {
                    l.starts_with("controller_runtime_reconcile_total{controller=\"kvmcluster\"")
                })
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum();
            Ok((code == 200
                && reconciles > 0.0
                && body.contains(
                    "controller_runtime_reconcile_time_seconds_count{controller=\"kvmcluster\"}",
                )
                && body.contains(
                    "controller_runtime_max_concurrent_reconciles{controller=\"kvmmachine\"} 16",
                )
                && body.contains("rest_client_requests_total{code=\"200\",method=\"GET\",host=\"127.0.0.1:")
                && body.contains(
                    "capk_object_last_reconciled_timestamp_seconds{kind=\"KVMCluster\",namespace=\"binary\",name=\"metrics\"}",
                ))
            .then_some(()))
        })
        .await?;
        // Metrics are not on the probes' port, nor health on the metrics port.
        assert_eq!(get(health_port, "/metrics")?.0, 404);
        assert_eq!(get(metrics_port, "/healthz")?.0, 404);
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

/// The metrics endpoint as the Deployment serves it: HTTPS (here with the certificate of
/// `--diagnostics-cert-dir`), answering only a token whose user may `get` /metrics.
#[tokio::test]
async fn metrics_need_a_token_allowed_to_read_them() -> Result<()> {
    let env = TestEnv::shared();
    let admin = env.client().await?;
    let ns = "metrics-auth";
    create_namespace(&admin, ns).await?;
    // The shipped reader role, bound to one ServiceAccount; another has no binding.
    let reader: Value = serde_yaml_ng::from_str(&std::fs::read_to_string(
        capk_tests::repo_root().join("manifests/rbac/metrics_reader_role.yaml"),
    )?)?;
    let pp = PatchParams::apply("metrics-auth-test").force();
    Api::<ClusterRole>::all(admin.clone())
        .patch("capkvm-metrics-reader", &pp, &Patch::Apply(&reader))
        .await?;
    let binding = json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": "metrics-auth-scraper"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": "capkvm-metrics-reader"},
        "subjects": [{"kind": "ServiceAccount", "name": "scraper", "namespace": ns}]});
    Api::<ClusterRoleBinding>::all(admin.clone())
        .patch("metrics-auth-scraper", &pp, &Patch::Apply(&binding))
        .await?;
    let scraper = token_for(&admin, ns, "scraper").await?;
    let stranger = token_for(&admin, ns, "stranger").await?;

    let certs = tempfile::tempdir()?;
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()])?;
    std::fs::write(certs.path().join("tls.crt"), cert.cert.pem())?;
    std::fs::write(
        certs.path().join("tls.key"),
        cert.signing_key.serialize_pem(),
    )?;
    let ca = cert.cert.der().clone();
    let (metrics_port, health_port) = (free_port(), free_port());
    let mut child = Command::new(env!("CARGO_BIN_EXE_capk-controller"))
        .args([
            &format!("--namespace={ns}"),
            &format!("--diagnostics-address=127.0.0.1:{metrics_port}"),
            &format!("--diagnostics-cert-dir={}", certs.path().display()),
            &format!("--health-addr=127.0.0.1:{health_port}"),
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
        assert!(
            get(metrics_port, "/metrics").is_err(),
            "plain HTTP got an HTTP answer"
        );
        let (code, _) = https_get(metrics_port, "/metrics", None, &ca).await?;
        assert_eq!(code, 401, "no token");
        let (code, _) = https_get(metrics_port, "/metrics", Some("not-a-token"), &ca).await?;
        assert_eq!(code, 401, "a token the apiserver does not know");
        let (code, body) = https_get(metrics_port, "/metrics", Some(&stranger), &ca).await?;
        assert_eq!(code, 403, "{body}");
        assert!(
            body.contains(&format!("system:serviceaccount:{ns}:stranger")),
            "{body}"
        );
        let (code, body) = https_get(metrics_port, "/metrics", Some(&scraper), &ca).await?;
        assert_eq!(code, 200, "{body}");
        assert!(
            body.contains(
                "controller_runtime_max_concurrent_reconciles{controller=\"kvmmachine\"}"
            ),
            "{body}"
        );
        anyhow::Ok(())
    }
    .await;
    child.kill()?;
    let _ = child.wait();
    result
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
                "--diagnostics-address=127.0.0.1:0",
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
                Ok(kc.status.and_then(|s| s.contract.conditions).map(|_| ()))
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

/// Watching one namespace, the controller keeps machines in it: another machine namespace,
/// whose objects it would never see, is refused before it starts, with what to set; a bad
/// name too. (The release's Deployments always pass `--machine-namespace`.)
#[test]
fn a_machine_namespace_it_cannot_watch_is_refused_at_start() -> Result<()> {
    let run = |args: &[&str]| -> Result<(bool, String)> {
        let out = Command::new(env!("CARGO_BIN_EXE_capk-controller"))
            .args(args)
            .env_remove("CAPK_MACHINE_NAMESPACE")
            .env("KUBECONFIG", "/nonexistent")
            .output()?;
        Ok((
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        ))
    };
    let (ok, err) = run(&["--namespace=team-a", "--machine-namespace=capk-machines"])?;
    assert!(!ok);
    assert!(
        err.contains("--namespace=team-a watches one namespace only")
            && err.contains("--machine-namespace="),
        "{err}"
    );
    let (ok, err) = run(&["--machine-namespace=Capk_Machines"])?;
    assert!(!ok);
    assert!(err.contains("not a namespace name"), "{err}");
    // Accepted (it stops later, at the missing kubeconfig): the watched namespace itself, an
    // empty value (the cluster's own namespace), or no value at all.
    for args in [
        &["--namespace=team-a", "--machine-namespace=team-a"][..],
        &["--namespace=team-a", "--machine-namespace="][..],
        &["--namespace=team-a"][..],
    ] {
        let (ok, err) = run(args)?;
        assert!(!ok, "no kubeconfig");
        assert!(
            !err.contains("watches one namespace only"),
            "{args:?}: {err}"
        );
    }
    Ok(())
}

/// The KVM policy and node label are checked at start, with what is expected.
#[test]
fn a_kvm_policy_or_node_label_it_cannot_use_is_refused_at_start() -> Result<()> {
    let run = |arg: &str| -> Result<String> {
        let out = Command::new(env!("CARGO_BIN_EXE_capk-controller"))
            .arg(arg)
            .env("KUBECONFIG", "/nonexistent")
            .output()?;
        assert!(!out.status.success(), "{arg}");
        Ok(String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let err = run("--kvm=maybe")?;
    assert!(
        err.contains("[possible values: allow, prefer, require]"),
        "{err}"
    );
    let err = run("--kvm-node-label=kvm")?;
    assert!(err.contains("KEY=VALUE"), "{err}");
    let err = run("--kvm-node-label=bad key=true")?;
    assert!(err.contains("is not a node label"), "{err}");
    // Accepted (it stops later, at the missing kubeconfig).
    for ok in [
        "--kvm=require",
        "--kvm-node-label=example.com/kvm=",
        "--kvm-node-label=kvm=yes",
    ] {
        let err = run(ok)?;
        assert!(!err.contains("--kvm"), "{ok}: {err}");
    }
    Ok(())
}
