//! `capk-controller`: the Cluster API infrastructure provider for KVM.

use std::{
    io::{Read, Write},
    time::Duration,
};

use anyhow::Context;
use capk_api::{launch, v1alpha1::ServiceType};
use capk_bootstrap::{BootstrapFormat, MachineFacts};
use capk_controller::metrics::{
    rest_client::RequestsLayer,
    serve::{self, Serving},
};
use capk_controller::{
    remote::limits::RemoteLimits,
    settings::{KvmPolicy, MachineDefaults, MachineNamespace, NodeImageSource, TenantPolicy},
};
use clap::{
    Parser, Subcommand, ValueEnum,
    builder::{PossibleValuesParser, TypedValueParser},
};
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
    /// Where new clusters' machine Pods, Ignition Secrets, etcd PVCs and control-plane Service
    /// live in the management cluster: a namespace of the operator's for all tenants
    /// (default), one per tenant namespace (a name with `{namespace}` in it, which the
    /// operator makes), or empty for the KVMCluster's own namespace (whose users may then exec
    /// into the privileged machine Pods). Chosen once per cluster: a change applies to clusters
    /// made after it. Default: `capk-machines`; with `--namespace`, that namespace.
    #[arg(long, env = "CAPK_MACHINE_NAMESPACE")]
    machine_namespace: Option<String>,
    /// DNS domain of the management cluster, used in the default control-plane endpoint.
    #[arg(long, default_value = "cluster.local")]
    cluster_domain: String,
    /// Log format.
    #[arg(long, value_enum, default_value = "text")]
    log_format: LogFormat,
    /// Container image of capk-launcher used for machine Pods (a concrete tag).
    #[arg(
        long,
        env = "CAPK_LAUNCHER_IMAGE",
        default_value = "localhost/capk/capk-launcher:dev"
    )]
    launcher_image: String,
    /// Flatcar release (stable channel) for KVMMachines that name no image: a concrete
    /// version, so machines made later boot what their peers boot.
    #[arg(
        long,
        env = "CAPK_DEFAULT_FLATCAR_VERSION",
        default_value = capk_controller::settings::DEFAULT_FLATCAR_VERSION,
        value_parser = pinned_flatcar_version
    )]
    default_flatcar_version: String,
    /// A mirror of Flatcar's release server for one channel (`<base>/amd64-usr/<version>/…`, as
    /// `capk-flatcar-image fetch --base-url` reads it), http or https: the machine Pods fetch
    /// Flatcar images there instead of from flatcar-linux.net (air-gapped management
    /// clusters). Signatures are checked either way. Empty: Flatcar's servers.
    #[arg(long, env = "CAPK_FLATCAR_BASE_URL", default_value = "")]
    flatcar_base_url: String,
    /// Most an MC node's node-image cache (/var/lib/capk/images) may hold, e.g. 50Gi; least
    /// recently used images no machine uses are evicted beyond it. Also the most one
    /// `spec.image.url` download may hold.
    #[arg(long, env = "CAPK_IMAGE_CACHE_SIZE", default_value = "50Gi", value_parser = quantity_bytes)]
    image_cache_size: u64,
    /// Container image holding a node disk (at `/disk/image.qcow2`) for KVMMachines that name no
    /// image; overrides the Flatcar default. Empty: Flatcar.
    #[arg(long, env = "CAPK_DEFAULT_NODE_IMAGE", default_value = "")]
    default_node_image: String,
    /// Address of the Prometheus metrics endpoint (`/metrics`, as Cluster API's managers'
    /// `--diagnostics-address`): HTTPS, for callers whose token may `get` the non-resource URL
    /// `/metrics` (ClusterRole capkvm-metrics-reader), unless --insecure-diagnostics.
    #[arg(long, alias = "metrics-addr", default_value = "0.0.0.0:8443")]
    diagnostics_address: std::net::SocketAddr,
    /// Serve `/metrics` as plain HTTP, without authentication or authorization.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    insecure_diagnostics: bool,
    /// Directory holding the metrics endpoint's serving certificate, `tls.crt` and `tls.key`
    /// (e.g. a mounted cert-manager Secret; reread when it changes). Unset: a self-signed one
    /// made at start.
    #[arg(long)]
    diagnostics_cert_dir: Option<std::path::PathBuf>,
    /// Address of the health endpoints (`/healthz`, `/readyz`, `/version`).
    #[arg(long, default_value = "0.0.0.0:8081")]
    health_addr: std::net::SocketAddr,
    /// Require control-plane machine Pods of one cluster on different MC nodes (default: prefer).
    #[arg(long)]
    require_control_plane_anti_affinity: bool,
    /// vCPUs per requested core of a machine Pod. 1 (default): a dedicated core per vCPU,
    /// Guaranteed QoS. N > 1: the Pod requests 1/N of that and the CPU is not limited
    /// (overcommit, like KubeVirt's cpuAllocationRatio), for dense test and development clusters.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=100))]
    cpu_allocation_ratio: u32,
    /// TCG translation cache, MiB, of machines that may run emulated (`accel` auto or tcg): QEMU
    /// memory counted in the machine Pod's requests and limits. The default suits small guests;
    /// Kubernetes nodes under TCG need about 1024 (management clusters without KVM).
    #[arg(
        long,
        default_value_t = launch::DEFAULT_TCG_TRANSLATION_CACHE_MIB,
        value_parser = clap::value_parser!(u32).range(
            i64::from(launch::MIN_TCG_TRANSLATION_CACHE_MIB)..=i64::from(launch::MAX_TCG_TRANSLATION_CACHE_MIB)
        )
    )]
    tcg_translation_cache_mib: u32,
    /// How emulated machines run their vCPUs: `multi`, a thread per vCPU (QEMU's default; a
    /// 2-vCPU control plane needs both cores to finish `kubeadm init` in time); `single`, one host
    /// thread takes turns with all of them (a VM uses at most one core and waits on no lock held
    /// by a preempted vCPU thread).
    #[arg(
        long = "tcg-threads",
        default_value = "multi",
        action = clap::ArgAction::Set,
        value_parser = PossibleValuesParser::new(["single", "multi"]).map(|s| s == "single"),
    )]
    tcg_single_thread: bool,
    /// Whether machines may run emulated: `allow` (default), `accel: auto` falls back to TCG on
    /// a node without KVM; `prefer`, as allow but their Pods prefer nodes with the KVM label
    /// (and `accel: kvm` ones require it); `require`, nothing emulated: `auto` runs as `kvm`,
    /// every machine Pod requires a node with the label, `accel: tcg` is refused.
    #[arg(
        long,
        default_value = "allow",
        value_parser = PossibleValuesParser::new(KvmPolicy::NAMES).try_map(|s| s.parse::<KvmPolicy>()),
    )]
    kvm: KvmPolicy,
    /// The label, `KEY=VALUE`, the operator gives MC nodes whose KVM works (`--kvm` prefer or
    /// require).
    #[arg(long, default_value = "infrastructure.cluster.x-k8s.io/kvm=true", value_parser = node_label)]
    kvm_node_label: (String, String),
    /// How KVMMachines with `spec.image.containerImage` get their disk: `host-cache`, an init
    /// container copies it once per MC node into /var/lib/capk/images (any container runtime);
    /// `image-volume`, a Kubernetes image volume, no copy (ImageVolume: Kubernetes 1.33+,
    /// containerd 2.1+ or CRI-O 1.31+).
    #[arg(
        long,
        default_value = "host-cache",
        value_parser = PossibleValuesParser::new(NodeImageSource::NAMES)
            .try_map(|s| s.parse::<NodeImageSource>()),
    )]
    node_image_source: NodeImageSource,
    /// Directories of host volume shares, comma-separated: a KVMMachine in namespace NS may
    /// share `<dir>/NS` or a directory below it into its VMs (`spec.hostVolumes[].hostPath`),
    /// never another namespace's. The operator makes `<dir>/NS` on the nodes for each
    /// namespace it grants a share (owned by QEMU's user, 107:107, for read-write volumes).
    /// Empty (default): no host volumes.
    #[arg(
        long,
        env = "CAPK_ALLOWED_HOST_VOLUME_PATHS",
        value_delimiter = ',',
        value_parser = absolute_dir
    )]
    allowed_host_volume_paths: Vec<String>,
    /// Host directories KVMMachines may keep etcd data in (`spec.etcdStorage.hostPath`),
    /// comma-separated; etcd cleanup Pods remove data only there.
    #[arg(
        long,
        default_value = capk_controller::settings::DEFAULT_ETCD_HOST_PATH_PREFIX,
        value_delimiter = ',',
        value_parser = absolute_dir
    )]
    allowed_etcd_host_paths: Vec<String>,
    /// Allow tolerations with no key (`operator: Exists`), which place a machine Pod on any node.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    allow_tolerate_all_taints: bool,
    /// Taint keys KVMMachines may tolerate (`spec.tolerations[].key`), comma-separated; a key
    /// ending in `/*` covers every key with that prefix. Empty (default): none.
    #[arg(long, env = "CAPK_ALLOWED_TOLERATION_KEYS", value_delimiter = ',')]
    allowed_toleration_keys: Vec<String>,
    /// Node label keys of Kubernetes' reserved namespaces (`*kubernetes.io/`, `*k8s.io/`: roles,
    /// host names, zones) KVMMachines may select nodes by, comma-separated; `/*` as for
    /// tolerations. Other keys are always allowed. Empty (default): none.
    #[arg(long, env = "CAPK_ALLOWED_NODE_SELECTOR_KEYS", value_delimiter = ',')]
    allowed_node_selector_keys: Vec<String>,
    /// PriorityClasses KVMMachines may name (`spec.priorityClassName`), comma-separated. Empty
    /// (default): none.
    #[arg(long, env = "CAPK_ALLOWED_PRIORITY_CLASSES", value_delimiter = ',')]
    allowed_priority_classes: Vec<String>,
    /// Annotation keys a KVMCluster's control-plane Service may carry
    /// (`spec.controlPlaneService.annotations`), comma-separated; `/*` as for tolerations.
    /// Empty (default): none.
    #[arg(
        long,
        env = "CAPK_ALLOWED_CONTROL_PLANE_SERVICE_ANNOTATIONS",
        value_delimiter = ','
    )]
    allowed_control_plane_service_annotations: Vec<String>,
    /// Control-plane Service types KVMClusters may ask for besides ClusterIP, comma-separated:
    /// NodePort, LoadBalancer. Empty (default): ClusterIP only.
    #[arg(
        long,
        env = "CAPK_ALLOWED_CONTROL_PLANE_SERVICE_TYPES",
        value_delimiter = ',',
        value_parser = service_type
    )]
    allowed_control_plane_service_types: Vec<Option<ServiceType>>,
    /// Reconciles that run at once, per kind.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u16).range(1..))]
    concurrency: u16,
    /// The most the controller reads of one answer of a workload or hosting cluster (their
    /// servers may be a tenant's): a larger one fails, as the cluster's condition says.
    #[arg(
        long,
        env = "CAPK_REMOTE_MAX_RESPONSE_SIZE",
        default_value = "4Mi",
        value_parser = quantity_bytes
    )]
    remote_max_response_size: u64,
    /// The most the controller reads of one watch event of a workload or hosting cluster.
    #[arg(
        long,
        env = "CAPK_REMOTE_MAX_WATCH_EVENT_SIZE",
        default_value = "2Mi",
        value_parser = quantity_bytes
    )]
    remote_max_watch_event_size: u64,
    /// Objects per list page asked of a workload or hosting cluster (the rest follows by
    /// `continue`).
    #[arg(
        long,
        env = "CAPK_REMOTE_LIST_PAGE_SIZE",
        default_value_t = capk_controller::remote::limits::DEFAULT_LIST_PAGE_SIZE,
        value_parser = clap::value_parser!(u32).range(1..=500)
    )]
    remote_list_page_size: u32,
    /// Requests in flight at once to one workload or hosting cluster (watches aside); more fail
    /// at once and are retried with back-off, so one cluster holds at most this many reconciles.
    #[arg(
        long,
        env = "CAPK_REMOTE_MAX_IN_FLIGHT",
        default_value_t = capk_controller::remote::limits::DEFAULT_MAX_IN_FLIGHT as u16,
        value_parser = clap::value_parser!(u16).range(1..=64)
    )]
    remote_max_in_flight: u16,
    /// The longest one request to a workload or hosting cluster may take, its answer read to the
    /// end, in seconds.
    #[arg(
        long,
        env = "CAPK_REMOTE_REQUEST_TIMEOUT_SECONDS",
        default_value_t = capk_controller::remote::limits::DEFAULT_REQUEST_TIMEOUT.as_secs() as u16,
        value_parser = clap::value_parser!(u16).range(1..=50)
    )]
    remote_request_timeout_seconds: u16,
    /// Run only while holding the Lease `capkvm-controller-leader` (for more than one replica).
    #[arg(long)]
    leader_elect: bool,
    /// Namespace of the leader-election Lease (default: $POD_NAMESPACE, else the kubeconfig's).
    #[arg(long, env = "POD_NAMESPACE")]
    leader_election_namespace: Option<String>,
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

/// A Kubernetes quantity of bytes (`50Gi`), positive.
fn quantity_bytes(s: &str) -> Result<u64, String> {
    match capk_api::quantity::parse_bytes(s.trim()) {
        Ok(0) => Err("must be more than 0".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// A concrete Flatcar release (`4230.2.3`).
fn pinned_flatcar_version(s: &str) -> Result<String, String> {
    let s = s.trim();
    if capk_controller::settings::is_flatcar_release(s) {
        Ok(s.to_owned())
    } else {
        Err(format!(
            "{s:?} is not a Flatcar release such as 4230.2.3 (pin one: machines made later \
             boot what their peers boot; 'current' is not accepted)"
        ))
    }
}

/// A Service type of `--allowed-control-plane-service-types`; `None` for an empty element.
fn service_type(s: &str) -> Result<Option<ServiceType>, String> {
    match s.trim() {
        "" => Ok(None),
        "ClusterIP" => Ok(Some(ServiceType::ClusterIP)),
        "NodePort" => Ok(Some(ServiceType::NodePort)),
        "LoadBalancer" => Ok(Some(ServiceType::LoadBalancer)),
        other => Err(format!(
            "{other:?} is not a Service type: NodePort or LoadBalancer (ClusterIP is always allowed)"
        )),
    }
}

/// A node label `KEY=VALUE` (the key with an optional `prefix/`, as `kubectl label` takes it).
fn node_label(s: &str) -> Result<(String, String), String> {
    let (key, value) = s.split_once('=').ok_or_else(|| {
        format!("{s:?}: KEY=VALUE, e.g. infrastructure.cluster.x-k8s.io/kvm=true")
    })?;
    let name = key.rsplit('/').next().unwrap_or_default();
    let fits = |part: &str, max: usize| {
        part.len() <= max
            && part
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
            && part.starts_with(|c: char| c.is_ascii_alphanumeric())
            && part.ends_with(|c: char| c.is_ascii_alphanumeric())
    };
    if !fits(name, 63) || key.len() > 253 + 1 + 63 || !(value.is_empty() || fits(value, 63)) {
        return Err(format!("{s:?} is not a node label KEY=VALUE"));
    }
    Ok((key.to_owned(), value.to_owned()))
}

/// The non-empty entries of a comma-separated list, trimmed (an empty variable lists nothing).
fn listed(entries: Vec<String>) -> Vec<String> {
    entries
        .into_iter()
        .map(|e| e.trim().to_owned())
        .filter(|e| !e.is_empty())
        .collect()
}

/// An allowed host directory: absolute, no `..` element (or empty: none).
fn absolute_dir(s: &str) -> Result<String, String> {
    let s = s.trim();
    if s.is_empty() {
        return Ok(String::new());
    }
    if !s.starts_with('/') || s.split('/').any(|e| e == "..") {
        return Err(format!(
            "{s:?} must be an absolute directory without '..' elements"
        ));
    }
    Ok(s.to_owned())
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

/// The reconcilers' settings from the command line; refuses combinations that cannot work.
fn settings(cli: &Cli) -> anyhow::Result<capk_controller::Settings> {
    // `--namespace=` (clusterctl with an empty variable) means all namespaces.
    let namespace = cli.namespace.clone().filter(|n| !n.is_empty());
    let machine_namespace = match (&cli.machine_namespace, &namespace) {
        (Some(m), _) => m.parse::<MachineNamespace>()?,
        (None, Some(_)) => MachineNamespace::Tenant,
        (None, None) => MachineNamespace::Shared(
            capk_controller::settings::DEFAULT_MACHINE_NAMESPACE.to_owned(),
        ),
    };
    if let Some(watched) = &namespace
        && machine_namespace.of(watched) != *watched
    {
        anyhow::bail!(
            "--namespace={watched} watches one namespace only, so machines must live there too: set --machine-namespace= (CAPK_MACHINE_NAMESPACE) empty or to {watched}"
        );
    }
    let non_empty = |v: &[String]| v.iter().filter(|p| !p.is_empty()).cloned().collect();
    Ok(capk_controller::Settings {
        namespace,
        machine_namespace,
        cluster_domain: cli.cluster_domain.clone(),
        machine_defaults: MachineDefaults {
            launcher_image: cli.launcher_image.clone(),
            flatcar_version: cli.default_flatcar_version.clone(),
            flatcar_base_url: Some(cli.flatcar_base_url.trim().to_owned())
                .filter(|u| !u.is_empty()),
            image_cache_bytes: cli.image_cache_size,
            default_node_image: Some(cli.default_node_image.trim().to_owned())
                .filter(|i| !i.is_empty()),
            require_control_plane_anti_affinity: cli.require_control_plane_anti_affinity,
            cpu_allocation_ratio: cli.cpu_allocation_ratio,
            tcg_translation_cache_mib: cli.tcg_translation_cache_mib,
            tcg_single_thread: cli.tcg_single_thread,
            node_image_source: cli.node_image_source,
            kvm: cli.kvm,
            kvm_node_label: cli.kvm_node_label.clone(),
            ..Default::default()
        },
        concurrency: cli.concurrency,
        tenant_policy: TenantPolicy {
            host_volume_prefixes: non_empty(&cli.allowed_host_volume_paths),
            etcd_host_path_prefixes: non_empty(&cli.allowed_etcd_host_paths),
            allow_tolerate_all_taints: cli.allow_tolerate_all_taints,
            toleration_keys: listed(cli.allowed_toleration_keys.clone()),
            node_selector_keys: listed(cli.allowed_node_selector_keys.clone()),
            priority_classes: listed(cli.allowed_priority_classes.clone()),
            service_annotation_keys: listed(cli.allowed_control_plane_service_annotations.clone()),
            control_plane_service_types: cli
                .allowed_control_plane_service_types
                .iter()
                .flatten()
                .cloned()
                .collect(),
        },
        remote_limits: RemoteLimits {
            max_response_bytes: usize::try_from(cli.remote_max_response_size)?,
            max_event_bytes: usize::try_from(cli.remote_max_watch_event_size)?,
            list_page_size: cli.remote_list_page_size,
            max_in_flight: cli.remote_max_in_flight.into(),
            request_timeout: Duration::from_secs(cli.remote_request_timeout_seconds.into()),
        },
    })
}

/// Serves the metrics (authorized, or plain with `--insecure-diagnostics`) and the health
/// endpoints in the background.
async fn serve_diagnostics(
    cli: &Cli,
    client: &kube::Client,
    metrics: &std::sync::Arc<capk_controller::metrics::Metrics>,
) -> anyhow::Result<()> {
    let serving = if cli.insecure_diagnostics {
        Serving::Insecure
    } else {
        let tls = match cli
            .diagnostics_cert_dir
            .as_ref()
            .filter(|d| !d.as_os_str().is_empty())
        {
            Some(dir) => serve::tls_from_dir(dir)?,
            None => serve::tls_self_signed(serve::self_signed_names())?.0,
        };
        Serving::Secure {
            tls,
            client: client.clone(),
        }
    };
    let listen = |addr| async move {
        tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("listen on {addr}"))
    };
    let (diagnostics, health) = (
        listen(cli.diagnostics_address).await?,
        listen(cli.health_addr).await?,
    );
    tokio::spawn(serve::serve_metrics(diagnostics, metrics.clone(), serving));
    tokio::spawn(serve::serve_health(health, metrics.clone()));
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if let Some(Command::RenderIgnition {
        format,
        hostname,
        instance_id,
    }) = &cli.command
    {
        // One line on error, the way a CLI user expects (no backtrace).
        if let Err(e) = render_ignition(format, hostname.clone(), instance_id.clone()) {
            eprintln!("capk-controller render-ignition: {e:#}");
            std::process::exit(1);
        }
        return Ok(());
    }
    let settings = settings(&cli)?;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    match cli.log_format {
        LogFormat::Text => tracing_subscriber::fmt().with_env_filter(filter).init(),
        LogFormat::Json => tracing_subscriber::fmt()
            .json()
            .with_env_filter(filter)
            .init(),
    }
    let metrics = std::sync::Arc::new(capk_controller::metrics::Metrics::new(cli.concurrency));
    // The client counts its requests (rest_client_requests_total).
    let config = kube::Config::infer().await?;
    let requests = RequestsLayer::new(metrics.clone(), &config.cluster_url);
    let client = kube::client::ClientBuilder::try_from(config)?
        .with_layer(&requests)
        .build();
    // Kubernetes stops Pods with SIGTERM; a terminal sends SIGINT.
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = sigterm.recv() => {}
        }
        let _ = stop_tx.send(true);
    });
    serve_diagnostics(&cli, &client, &metrics).await?;
    if !cli.leader_elect {
        let mut stop = stop_rx;
        let stopped = async move {
            let _ = stop.wait_for(|s| *s).await;
        };
        capk_controller::run_with_metrics(client, settings, metrics, stopped).await;
        return Ok(());
    }
    let namespace = cli
        .leader_election_namespace
        .clone()
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| client.default_namespace().to_owned());
    let run = |shutdown| {
        capk_controller::run_with_metrics(client.clone(), settings, metrics.clone(), shutdown)
    };
    capk_controller::leader::run_as_leader(client.clone(), &namespace, &metrics, stop_rx, run).await
}
