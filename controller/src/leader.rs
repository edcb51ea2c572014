//! Leader election on a Lease, so that several replicas can run and one reconciles.

use std::{future::Future, pin::Pin, sync::Arc};

use anyhow::Context;
use kube::Client;
use kube_lease_manager::{LeaseManager, LeaseManagerBuilder};
use tokio::sync::watch;

use crate::metrics::Metrics;

/// Resolves when the controllers are to stop.
pub type Shutdown = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Name of the leader-election Lease.
pub const LEASE_NAME: &str = "capkvm-controller-leader";

/// The Lease manager for `identity` in `namespace`: a 15 s lease renewed 5 s before it ends.
/// Needs get, create and patch on `coordination.k8s.io` leases there.
pub async fn lease_manager(
    client: Client,
    namespace: &str,
    identity: &str,
) -> Result<LeaseManager, kube_lease_manager::LeaseManagerError> {
    LeaseManagerBuilder::new(client, LEASE_NAME)
        .with_namespace(namespace)
        .with_identity(identity)
        .with_duration(15)
        .with_grace(5)
        .with_field_manager(crate::k8s::objects::FIELD_MANAGER)
        .build()
        .await
}

/// This replica's name in the Lease: its Pod's (`POD_NAME`), else `<hostname>-<pid>`.
pub fn identity() -> String {
    std::env::var("POD_NAME").unwrap_or_else(|_| {
        format!(
            "{}-{}",
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .unwrap_or_default()
                .trim(),
            std::process::id()
        )
    })
}

/// Resolves once `stop` is true.
async fn stopped(mut stop: watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// Runs `run` (the controllers, until the [`Shutdown`] it gets resolves) while this replica holds
/// the Lease in `namespace`, until `stop` turns true. A follower is healthy and ready (it serves
/// its endpoints) while it waits its turn. On the way out the Lease is released at once, so the
/// next replica takes over without waiting for it to expire. Losing it mid-run is an error that
/// ends the process (as controller-runtime does): the kubelet restarts it as a follower.
pub async fn run_as_leader<Run>(
    client: Client,
    namespace: &str,
    metrics: &Metrics,
    stop: watch::Receiver<bool>,
    run: impl FnOnce(Shutdown) -> Run,
) -> anyhow::Result<()>
where
    Run: Future<Output = ()>,
{
    let identity = identity();
    let manager = lease_manager(client, namespace, &identity)
        .await
        .with_context(|| format!("leader election Lease {namespace}/{LEASE_NAME}"))?;
    metrics.set_ready();
    // The Lease is driven by hand (not `watch()`), so that on the way out it is released at
    // once rather than after the manager's next renewal.
    let manager = Arc::new(manager);
    tracing::info!(lease = %format!("{namespace}/{LEASE_NAME}"), %identity, "waiting for leadership");
    loop {
        tokio::select! {
            held = manager.changed() => {
                if held.context("leader election")? {
                    break;
                }
            }
            () = stopped(stop.clone()) => return Ok(()),
        }
    }
    tracing::info!(%identity, "became the leader");
    // Renew in the background; `changed()` returns only when the state changes: lost.
    let renew = {
        let manager = manager.clone();
        tokio::spawn(async move {
            loop {
                match manager.changed().await {
                    Ok(true) => continue,
                    Ok(false) => break,
                    Err(e) => {
                        tracing::warn!(error = %e, "renewing the Lease failed");
                        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                    }
                }
            }
        })
    };
    let (end_tx, end_rx) = watch::channel(false);
    let run = run(Box::pin(stopped(end_rx)));
    tokio::pin!(run);
    tokio::pin!(renew);
    let lost = tokio::select! {
        () = &mut run => false,
        () = stopped(stop.clone()) => {
            let _ = end_tx.send(true);
            run.await;
            false
        }
        _ = &mut renew => {
            let _ = end_tx.send(true);
            run.await;
            true
        }
    };
    renew.abort();
    if lost {
        anyhow::bail!("lost the leader election Lease {namespace}/{LEASE_NAME}");
    }
    if let Err(e) = manager.release().await {
        tracing::warn!(error = %e, "releasing the Lease failed; the next leader waits for it to expire");
    }
    Ok(())
}
