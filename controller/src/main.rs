//! `capk-controller`: the Cluster API infrastructure provider for KVM.

use clap::{Parser, ValueEnum};
use kube::Client;
use tracing_subscriber::EnvFilter;

#[derive(Clone, Copy, Debug, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

/// Cluster API infrastructure provider for KVM: turns KVMClusters into control-plane Services
/// and KVMMachines into machine Pods. Uses the standard kubeconfig resolution (in-cluster, or
/// $KUBECONFIG).
#[derive(Parser, Debug)]
#[command(name = "capk-controller", version, about)]
struct Cli {
    /// Watch only this namespace (default: all namespaces).
    #[arg(long, env = "CAPK_NAMESPACE")]
    namespace: Option<String>,
    /// DNS domain of the management cluster, used in the default control-plane endpoint.
    #[arg(long, default_value = "cluster.local")]
    cluster_domain: String,
    /// Log format.
    #[arg(long, value_enum, default_value = "text")]
    log_format: LogFormat,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    match cli.log_format {
        LogFormat::Text => tracing_subscriber::fmt().with_env_filter(filter).init(),
        LogFormat::Json => tracing_subscriber::fmt()
            .json()
            .with_env_filter(filter)
            .init(),
    }
    let client = Client::try_default().await?;
    let settings = capk_controller::Settings {
        namespace: cli.namespace,
        cluster_domain: cli.cluster_domain,
    };
    // Kubernetes stops Pods with SIGTERM; a terminal sends SIGINT.
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let shutdown = async move {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = sigterm.recv() => {}
        }
    };
    capk_controller::run(client, settings, shutdown).await;
    Ok(())
}
