//! Command line of `capk-launcher`. Everything the controller decides arrives as flags or env
//! (never secrets: the Ignition config is a file path, its content is never an argument).

use std::net::Ipv4Addr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::size::ByteSize;

/// PID 1 of a machine Pod: turns the Pod into a VM host that owns the Pod's IP and MAC.
#[derive(Parser, Debug)]
#[command(name = "capk-launcher", version, about, propagate_version = true)]
pub struct Cli {
    /// Log format on stderr.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, env = "CAPK_LOG_FORMAT")]
    pub log_format: LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

/// Log output format.
#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// What to do.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Set up network and disks, boot the VM and supervise it until it stops.
    Run(Box<RunArgs>),
    /// Exec probe for the kubelet: exit 0 when healthy, 1 with a one-line reason otherwise.
    Probe(ProbeArgs),
    /// Print the running launcher's state as JSON.
    Status(SocketArgs),
    /// Print the VM's serial console (kept in the runtime directory) and follow it.
    Console {
        #[command(flatten)]
        socket: SocketArgs,
        /// Print what is there and exit instead of following.
        #[arg(long)]
        no_follow: bool,
    },
    /// Send a QMP command to the running VM through the launcher and print QEMU's answer.
    Qmp {
        /// The command.
        #[arg(value_enum)]
        command: crate::qemu::qmp::SimpleCommand,
        #[command(flatten)]
        socket: SocketArgs,
    },
    /// Check whether KVM can run a guest instruction here and print the accelerator `auto` picks.
    ProbeAccel {
        /// How long the probe vCPU may take for its loop (real KVM needs about 1 ms).
        #[arg(long, default_value_t = 1000)]
        timeout_ms: u64,
    },
}

/// Where the running launcher listens.
#[derive(Args, Debug, Clone)]
pub struct SocketArgs {
    /// Directory holding the launcher's sockets (control, QMP, heartbeat).
    #[arg(long, env = "CAPK_RUNTIME_DIR", default_value = "/run/capk")]
    pub runtime_dir: PathBuf,
}

/// `probe` arguments.
#[derive(Args, Debug)]
pub struct ProbeArgs {
    /// Which probe.
    #[arg(value_enum)]
    pub kind: ProbeKind,
    #[command(flatten)]
    pub socket: SocketArgs,
}

/// Kinds of exec probe.
#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProbeKind {
    /// QEMU alive, QMP answers, guest not shut down or panicked.
    Liveness,
    /// Guest heartbeat seen recently and bootstrap succeeded.
    Readiness,
}

/// Hardware accelerator choice.
#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum AccelChoice {
    /// KVM when a probe vCPU really runs, else TCG with a warning.
    Auto,
    /// KVM or fail.
    Kvm,
    /// Software emulation.
    Tcg,
}

/// Role of the machine in its cluster.
#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Role {
    /// Runs etcd and the apiserver.
    ControlPlane,
    /// Runs workloads.
    Worker,
}

impl Role {
    /// The name used in flags, logs and status.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::ControlPlane => "control-plane",
            Role::Worker => "worker",
        }
    }
}

/// `run` arguments.
#[derive(Args, Debug, Clone)]
pub struct RunArgs {
    /// Number of vCPUs.
    #[arg(long, env = "CAPK_VCPUS", default_value_t = 2)]
    pub vcpus: u32,
    /// Guest memory (Kubernetes quantity, e.g. 8Gi).
    #[arg(long, env = "CAPK_MEMORY", default_value = "2Gi")]
    pub memory: ByteSize,
    /// Node image (read-only base of the root disk's qcow2 overlay).
    #[arg(long, env = "CAPK_IMAGE")]
    pub image: PathBuf,
    /// Format of the node image.
    #[arg(long, env = "CAPK_IMAGE_FORMAT", default_value = "qcow2")]
    pub image_format: String,
    /// Size the root disk is grown to (never shrunk below the image's size).
    #[arg(long, env = "CAPK_DISK_SIZE", default_value = "20Gi")]
    pub disk_size: ByteSize,
    /// containerd ("docker") disk size; 0 leaves it out.
    #[arg(long, env = "CAPK_DOCKER_DISK_SIZE", default_value = "0")]
    pub docker_disk_size: ByteSize,
    /// kubelet disk size; 0 leaves it out.
    #[arg(long, env = "CAPK_KUBELET_DISK_SIZE", default_value = "0")]
    pub kubelet_disk_size: ByteSize,
    /// etcd disk file on persistent storage: created once, never recreated or re-formatted.
    #[arg(long, env = "CAPK_ETCD_DISK")]
    pub etcd_disk: Option<PathBuf>,
    /// Size of the etcd disk when it is created.
    #[arg(long, env = "CAPK_ETCD_DISK_SIZE", default_value = "10Gi")]
    pub etcd_disk_size: ByteSize,
    /// Host directory shared into the guest over virtio-9p, as TAG=PATH (repeatable).
    #[arg(long = "host-volume", env = "CAPK_HOST_VOLUMES", value_delimiter = ',')]
    pub host_volumes: Vec<String>,
    /// Directory for the root overlay and the data disks (a Pod volume, so they survive restarts).
    #[arg(long, env = "CAPK_STATE_DIR", default_value = "/var/lib/capk")]
    pub state_dir: PathBuf,
    #[command(flatten)]
    pub socket: SocketArgs,
    /// Ignition config file (mounted from the machine's Secret).
    #[arg(long, env = "CAPK_IGNITION_FILE")]
    pub ignition: Option<PathBuf>,
    /// Accelerator.
    #[arg(long, env = "CAPK_ACCEL", value_enum, default_value_t = AccelChoice::Auto)]
    pub accel: AccelChoice,
    /// DNS servers for the guest (default: the Pod's resolv.conf).
    #[arg(long = "dns", env = "CAPK_DNS_SERVERS", value_delimiter = ',')]
    pub dns_servers: Vec<Ipv4Addr>,
    /// DNS search domains for the guest (default: the Pod's resolv.conf).
    #[arg(long = "dns-search", env = "CAPK_DNS_SEARCH", value_delimiter = ',')]
    pub dns_search: Vec<String>,
    /// NTP servers for the guest.
    #[arg(long = "ntp", env = "CAPK_NTP_SERVERS", value_delimiter = ',')]
    pub ntp_servers: Vec<Ipv4Addr>,
    /// Guest hostname (default: this Pod's hostname).
    #[arg(long, env = "CAPK_HOSTNAME")]
    pub hostname: Option<String>,
    /// iSCSI initiator name written into the guest (stable per machine; chosen by the controller).
    #[arg(long, env = "CAPK_ISCSI_INITIATOR_NAME")]
    pub iscsi_initiator_name: Option<String>,
    /// Machine role.
    #[arg(long, env = "CAPK_ROLE", value_enum, default_value_t = Role::Worker)]
    pub role: Role,
    /// The Pod's interface whose identity the VM takes.
    #[arg(long, env = "CAPK_POD_INTERFACE", default_value = "eth0")]
    pub interface: String,
    /// resolv.conf to read DNS servers and search domains from.
    #[arg(long, default_value = "/etc/resolv.conf")]
    pub resolv_conf: PathBuf,
    /// Seconds between ACPI powerdown and killing QEMU on SIGTERM.
    #[arg(long, env = "CAPK_SHUTDOWN_GRACE_SECONDS", default_value_t = 300)]
    pub grace_period_seconds: u64,
    /// Port of the guest apiserver: with `--role control-plane`, readiness also requires
    /// `https://<VM IP>:<port>/readyz` to answer 200 (certificate not verified). 0 turns the
    /// check off.
    #[arg(long, env = "CAPK_APISERVER_READYZ_PORT", default_value_t = 6443)]
    pub apiserver_readyz_port: u16,
    /// Seconds without a guest heartbeat before readiness fails.
    #[arg(long, env = "CAPK_HEARTBEAT_TIMEOUT_SECONDS", default_value_t = 90)]
    pub heartbeat_timeout_seconds: u64,
    /// QEMU system emulator.
    #[arg(long, env = "CAPK_QEMU", default_value = "qemu-system-x86_64")]
    pub qemu: PathBuf,
    /// qemu-img.
    #[arg(long, env = "CAPK_QEMU_IMG", default_value = "qemu-img")]
    pub qemu_img: PathBuf,
    /// Boot this kernel directly instead of the disk's bootloader (debugging, test guests).
    #[arg(long, env = "CAPK_KERNEL")]
    pub kernel: Option<PathBuf>,
    /// Initramfs for --kernel.
    #[arg(long, env = "CAPK_INITRD", requires = "kernel")]
    pub initrd: Option<PathBuf>,
    /// Kernel command line for --kernel.
    #[arg(long = "append", env = "CAPK_KERNEL_CMDLINE", requires = "kernel")]
    pub kernel_cmdline: Option<String>,
    /// How long the KVM probe vCPU may take for its loop (real KVM needs about 1 ms).
    #[arg(long, env = "CAPK_KVM_PROBE_TIMEOUT_MS", default_value_t = 1000)]
    pub kvm_probe_timeout_ms: u64,
}
