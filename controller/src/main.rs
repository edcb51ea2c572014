//! `capk-controller`: the Cluster API infrastructure provider for KVM.

use std::io::{Read, Write};

use anyhow::Context;
use capk_bootstrap::{BootstrapFormat, MachineFacts};
use clap::{Parser, Subcommand, ValueEnum};
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
    /// Container image of capk-launcher used for machine Pods (a concrete tag).
    #[arg(long, env = "CAPK_LAUNCHER_IMAGE", default_value = "capk-launcher:dev")]
    launcher_image: String,
    /// Flatcar version for KVMMachines that name no image.
    #[arg(long, default_value = "current")]
    default_flatcar_version: String,
    /// Address of the Prometheus metrics endpoint (`/metrics`).
    #[arg(long, default_value = "0.0.0.0:8080")]
    metrics_addr: std::net::SocketAddr,
    /// Address of the health endpoints (`/healthz`, `/readyz`, `/version`).
    #[arg(long, default_value = "0.0.0.0:8081")]
    health_addr: std::net::SocketAddr,
    /// Require control-plane machine Pods of one cluster on different MC nodes (default: prefer).
    #[arg(long)]
    require_control_plane_anti_affinity: bool,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the reconcilers (the default).
    Run,
    /// Read CAPI bootstrap data on stdin and print the Ignition v3 config the controller would
    /// store for it (before the launcher's per-boot additions). For debugging bootstrap data.
    RenderIgnition {
        /// The Secret's `format`: cloud-config or ignition.
        #[arg(long, default_value = "cloud-config")]
        format: String,
        /// The machine's hostname (node name), substituted for cloud-init placeholders.
        #[arg(long)]
        hostname: String,
        /// Instance id substituted for `{{ v1.instance_id }}` (default: the hostname).
        #[arg(long)]
        instance_id: Option<String>,
    },
}

fn render_ignition(
    format: &str,
    hostname: String,
    instance_id: Option<String>,
) -> anyhow::Result<()> {
    let format: BootstrapFormat = format.parse()?;
    let mut data = Vec::new();
    std::io::stdin()
        .read_to_end(&mut data)
        .context("read bootstrap data from stdin")?;
    let mut facts = MachineFacts::new(hostname);
    if let Some(id) = instance_id {
        facts.instance_id = id;
    }
    let config = capk_bootstrap::convert(format, &data, &facts)?;
    let json = capk_bootstrap::to_json_pretty(&config)?;
    writeln!(std::io::stdout(), "{json}")?;
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if let Some(Command::RenderIgnition {
        format,
        hostname,
        instance_id,
    }) = cli.command
    {
        // One line on error, the way a CLI user expects (no backtrace).
        if let Err(e) = render_ignition(&format, hostname, instance_id) {
            eprintln!("capk-controller render-ignition: {e:#}");
            std::process::exit(1);
        }
        return Ok(());
    }
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
        // `--namespace=` (clusterctl with an empty variable) means all namespaces.
        namespace: cli.namespace.filter(|n| !n.is_empty()),
        cluster_domain: cli.cluster_domain,
        machine_defaults: capk_controller::kvmmachine::build::MachineDefaults {
            launcher_image: cli.launcher_image,
            flatcar_version: cli.default_flatcar_version,
            require_control_plane_anti_affinity: cli.require_control_plane_anti_affinity,
            ..Default::default()
        },
    };
    // Kubernetes stops Pods with SIGTERM; a terminal sends SIGINT.
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let shutdown = async move {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = sigterm.recv() => {}
        }
    };
    let metrics = std::sync::Arc::new(capk_controller::metrics::Metrics::default());
    for addr in [cli.metrics_addr, cli.health_addr] {
        let m = metrics.clone();
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("listen on {addr}"))?;
        tokio::spawn(async move {
            let _ = axum::serve(listener, capk_controller::metrics::router(m)).await;
        });
    }
    capk_controller::run_with_metrics(client, settings, metrics, shutdown).await;
    Ok(())
}
