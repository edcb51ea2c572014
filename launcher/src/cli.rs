//! Command line of `capk-launcher`. What the controller decides for a machine arrives as the
//! launch contract's flags ([`capk_api::launch`]), never secrets: the Ignition config is a file
//! path, its content is never an argument.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::control::ProbeKind;
use crate::etcd_dir::EtcdOwner;
use crate::qemu::qmp::SimpleCommand;
use capk_api::byte_size::ByteSize;
use capk_api::launch::Launch;

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
        command: QmpCommandArg,
        #[command(flatten)]
        socket: SocketArgs,
    },
    /// Put a node image into the MC node's cache (the machine Pod's `fetch-image` init
    /// container): download once per node, verify, evict least recently used images over the
    /// limit, link it for `run --image`. On failure, one line for the KVMMachine's `Ready`
    /// condition goes to --termination-log.
    FetchImage(Box<FetchImageArgs>),
    /// Remove a deleted KVMMachine's etcd directory (the controller's etcd cleanup Pod): its
    /// etcd disk, owner marker and the directory, only when the marker names --owner. Anything
    /// else is left as it is, with exit code 3 and `EtcdCleanupRefused: <why>` on
    /// --termination-log.
    RemoveEtcdData(RemoveEtcdDataArgs),
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
    pub kind: ProbeKindArg,
    #[command(flatten)]
    pub socket: SocketArgs,
}

/// Kinds of exec probe.
#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum ProbeKindArg {
    /// QEMU alive, QMP answers, guest not shut down or panicked.
    Liveness,
    /// Guest heartbeat seen recently and bootstrap succeeded.
    Readiness,
}

impl From<ProbeKindArg> for ProbeKind {
    fn from(k: ProbeKindArg) -> Self {
        match k {
            ProbeKindArg::Liveness => ProbeKind::Liveness,
            ProbeKindArg::Readiness => ProbeKind::Readiness,
        }
    }
}

/// QMP commands `capk-launcher qmp` may send (no arguments, nothing that reads guest memory).
#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum QmpCommandArg {
    /// `query-status`.
    QueryStatus,
    /// `system_powerdown` (ACPI power button).
    SystemPowerdown,
    /// `system_reset` (hard reset).
    SystemReset,
    /// `stop` (pause vCPUs).
    Stop,
    /// `cont` (resume vCPUs).
    Cont,
}

impl From<QmpCommandArg> for SimpleCommand {
    fn from(c: QmpCommandArg) -> Self {
        match c {
            QmpCommandArg::QueryStatus => SimpleCommand::QueryStatus,
            QmpCommandArg::SystemPowerdown => SimpleCommand::SystemPowerdown,
            QmpCommandArg::SystemReset => SimpleCommand::SystemReset,
            QmpCommandArg::Stop => SimpleCommand::Stop,
            QmpCommandArg::Cont => SimpleCommand::Cont,
        }
    }
}

/// `fetch-image` arguments: a URL with its sha256, or a Flatcar release.
#[derive(Args, Debug, Clone)]
#[command(group(clap::ArgGroup::new("source").required(true).args(["url", "flatcar_version"])))]
pub struct FetchImageArgs {
    /// http(s) URL of a qcow2 or raw disk image (`spec.image.url`); messages show it without
    /// userinfo, query and fragment.
    #[arg(long, requires = "sha256")]
    pub url: Option<String>,
    /// Expected sha256 of the --url file, 64 lower-case hex digits.
    #[arg(long, requires = "url")]
    pub sha256: Option<String>,
    /// Flatcar release channel.
    #[arg(long, default_value = "stable", requires = "flatcar_version")]
    pub flatcar_channel: String,
    /// Flatcar release, pinned (e.g. 4230.2.3).
    #[arg(long)]
    pub flatcar_version: Option<String>,
    /// A mirror of the channel's `<arch>/<version>/<file>` tree (http or https: the release's
    /// signature is checked either way). Default: Flatcar's release server of the channel.
    #[arg(long)]
    pub flatcar_base_url: Option<String>,
    /// OpenPGP key Flatcar releases must be signed with (a mirror's own signed tree). Default:
    /// the Flatcar image signing key shipped in this program.
    #[arg(long)]
    pub flatcar_key: Option<PathBuf>,
    /// The node-image cache directory (the MC node's /var/lib/capk/images).
    #[arg(long, default_value = "/var/lib/capk/image")]
    pub cache_dir: PathBuf,
    /// Symbolic link to the cached image written for `run --image`.
    #[arg(long)]
    pub link: Option<PathBuf>,
    /// Most bytes the cache's images may take (also the most one download may hold); least
    /// recently used images no machine uses are evicted beyond it.
    #[arg(long, default_value = "50Gi")]
    pub max_cache_size: ByteSize,
    /// Seconds an image stays after its last use before it may be evicted (a Pod between this
    /// init container and its launcher does not hold its image yet, nor does a launcher waiting
    /// out the kubelet's restart back-off, at most 300 s: keep this longer).
    #[arg(long, default_value_t = 600)]
    pub keep_used_seconds: u64,
    /// Seconds a connection may take.
    #[arg(long, default_value_t = 30)]
    pub connect_timeout_seconds: u64,
    /// Seconds a transfer may make (almost) no progress (under 1 KiB/s) before the attempt fails.
    #[arg(long, default_value_t = 60)]
    pub stall_seconds: u64,
    /// Attempts per file (back-off 1, 2, 4, ... s); then the container fails and the kubelet
    /// restarts it with its own back-off, continuing the download.
    #[arg(long, default_value_t = 4)]
    pub attempts: u32,
    /// Where the one-line failure message for the controller goes (the container's
    /// terminationMessagePath).
    #[arg(long, default_value = "/dev/termination-log")]
    pub termination_log: PathBuf,
    /// curl.
    #[arg(long, default_value = "curl")]
    pub curl: PathBuf,
    /// gpgv (Flatcar signatures).
    #[arg(long, default_value = "gpgv")]
    pub gpgv: PathBuf,
}

/// `remove-etcd-data` arguments.
#[derive(Args, Debug, Clone)]
pub struct RemoveEtcdDataArgs {
    /// The etcd directory.
    #[arg(long)]
    pub dir: PathBuf,
    /// The deleted KVMMachine, `<namespace>/<name>/<uid>`: the directory's marker must name
    /// its UID.
    #[arg(long)]
    pub owner: EtcdOwner,
    /// Where the one-line outcome for the controller goes (the container's
    /// terminationMessagePath).
    #[arg(long, default_value = "/dev/termination-log")]
    pub termination_log: PathBuf,
}

/// `run` arguments: the launch contract the controller rendered, and what this host decides.
#[derive(Args, Debug, Clone)]
pub struct RunArgs {
    #[command(flatten)]
    pub launch: Launch,
    /// Format of the node image.
    #[arg(long, env = "CAPK_IMAGE_FORMAT", default_value = "qcow2")]
    pub image_format: String,
    /// User QEMU runs as (never root; KubeVirt's qemu user by default). QEMU gets no
    /// capabilities and no_new_privs; the launcher gives it its disks, Ignition file and a
    /// runtime directory, and the tap, the node image, --kernel and --initrd as descriptors.
    #[arg(long, env = "CAPK_QEMU_UID", default_value_t = crate::qemu::privilege::DEFAULT_QEMU_ID)]
    pub qemu_uid: u32,
    /// Group QEMU runs as (never root). The group of /dev/kvm, when it exists, is added.
    #[arg(long, env = "CAPK_QEMU_GID", default_value_t = crate::qemu::privilege::DEFAULT_QEMU_ID)]
    pub qemu_gid: u32,
    #[command(flatten)]
    pub socket: SocketArgs,
    /// iSCSI initiator name written into the guest (stable per machine; chosen by the controller).
    #[arg(long, env = "CAPK_ISCSI_INITIATOR_NAME")]
    pub iscsi_initiator_name: Option<String>,
    /// The Pod's interface whose identity the VM takes.
    #[arg(long, env = "CAPK_POD_INTERFACE", default_value = "eth0")]
    pub interface: String,
    /// resolv.conf to read DNS servers and search domains from.
    #[arg(long, default_value = "/etc/resolv.conf")]
    pub resolv_conf: PathBuf,
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

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::run::{guest_naming, validate};

    fn config(extra: &[&str]) -> RunArgs {
        let mut v = vec!["capk-launcher", "run", "--image", "/img.qcow2"];
        v.extend_from_slice(extra);
        match Cli::try_parse_from(v).unwrap().command {
            Command::Run(r) => *r,
            _ => unreachable!(),
        }
    }

    fn parse_launch(args: Vec<String>) -> Launch {
        let argv = ["capk-launcher".to_owned(), "run".to_owned()]
            .into_iter()
            .chain(args);
        match Cli::try_parse_from(argv).unwrap().command {
            Command::Run(r) => r.launch,
            _ => unreachable!(),
        }
    }

    /// What the controller renders is what the launcher reads: every field of the contract, set
    /// away from its default, parses back to the same value (a field rendered by one side only,
    /// or under another flag, fails here).
    #[test]
    fn a_rendered_launch_contract_parses_back_to_itself() {
        use capk_api::launch::{Accel, Role, Share, TcgThreads};
        let launch = Launch {
            vcpus: 3,
            memory: ByteSize::mib(1536),
            image: "/var/lib/capk/image/disk/image.qcow2".into(),
            disk_size: ByteSize::gib(40),
            docker_disk_size: ByteSize::gib(30),
            kubelet_disk_size: ByteSize(5_000_000_000),
            etcd_disk: Some("/var/lib/capk/etcd/etcd.img".into()),
            etcd_disk_size: ByteSize::gib(12),
            etcd_owner: Some(
                "team-a/demo-cp-0/6f1c2a8e-0b7d-4c1e-9a53-2f0e8d7c6b5a"
                    .parse()
                    .unwrap(),
            ),
            host_volumes: vec![
                "data=/var/lib/capk/host-volumes/data"
                    .parse::<Share>()
                    .unwrap(),
            ],
            host_volumes_readonly: vec![
                "cfg=/var/lib/capk/host-volumes/cfg/sub"
                    .parse::<Share>()
                    .unwrap(),
                "certs=/var/lib/capk/host-volumes/certs"
                    .parse::<Share>()
                    .unwrap(),
            ],
            state_dir: "/var/lib/capk-state".into(),
            secret_dir: "/run/capk-secret-x".into(),
            ignition: Some("/etc/capk/ignition/config.ign".into()),
            accel: Accel::Tcg,
            tcg_translation_cache_mib: 1024,
            tcg_threads: TcgThreads::Single,
            dns_servers: vec![Ipv4Addr::new(10, 96, 0, 10), Ipv4Addr::new(10, 96, 0, 11)],
            dns_search: vec!["team-a.svc.cluster.local".into(), "cluster.local".into()],
            ntp_servers: vec![Ipv4Addr::new(10, 0, 0, 1)],
            hostname: Some("demo-cp-0".into()),
            role: Role::ControlPlane,
            grace_period_seconds: 120,
        };
        assert!(launch.check().is_ok());
        let defaults = parse_launch(vec!["--image=/i".into()]);
        assert_eq!(parse_launch(launch.to_args()), launch);
        // Every field differs from the launcher's default, so none passes by defaulting.
        let differing = |a: &Launch, b: &Launch| {
            [
                a.vcpus != b.vcpus,
                a.memory != b.memory,
                a.image != b.image,
                a.disk_size != b.disk_size,
                a.docker_disk_size != b.docker_disk_size,
                a.kubelet_disk_size != b.kubelet_disk_size,
                a.etcd_disk != b.etcd_disk,
                a.etcd_disk_size != b.etcd_disk_size,
                a.etcd_owner != b.etcd_owner,
                a.host_volumes != b.host_volumes,
                a.host_volumes_readonly != b.host_volumes_readonly,
                a.state_dir != b.state_dir,
                a.secret_dir != b.secret_dir,
                a.ignition != b.ignition,
                a.accel != b.accel,
                a.tcg_translation_cache_mib != b.tcg_translation_cache_mib,
                a.tcg_threads != b.tcg_threads,
                a.dns_servers != b.dns_servers,
                a.dns_search != b.dns_search,
                a.ntp_servers != b.ntp_servers,
                a.hostname != b.hostname,
                a.role != b.role,
                a.grace_period_seconds != b.grace_period_seconds,
            ]
        };
        assert!(differing(&launch, &defaults).iter().all(|d| *d));
        // And the launcher's defaults render to themselves as well.
        assert_eq!(parse_launch(defaults.to_args()), defaults);
    }

    #[test]
    fn a_share_that_is_not_tag_and_path_is_refused_by_the_cli() {
        let e = Cli::try_parse_from([
            "capk-launcher",
            "run",
            "--image",
            "/i",
            "--host-volume",
            "data",
        ])
        .unwrap_err();
        assert!(e.to_string().contains("\"data\" is not TAG=PATH"), "{e}");
    }

    #[test]
    fn bad_flags_get_one_line_causes() {
        let cases: &[(&[&str], &str)] = &[
            (
                &["--vcpus", "0"],
                "invalid --vcpus: must be between 1 and 255",
            ),
            (
                &["--memory", "255Mi"],
                "invalid --memory: must be at least 256Mi",
            ),
            (
                &["--disk-size", "1023Mi"],
                "invalid --disk-size: must be at least 1Gi",
            ),
            (
                &["--image-format", "vmdk"],
                "invalid --image-format: must be qcow2 or raw",
            ),
            (
                &["--host-volume", "d=rel/path"],
                "invalid --host-volume: path \"rel/path\" must be absolute",
            ),
            (
                &["--host-volume", "a.b=/srv"],
                "invalid --host-volume: mount tag \"a.b\" must be 1-31 characters long (the virtio-9p tag limit), of letters, digits, '_' and '-' only",
            ),
            (
                &["--host-volume-readonly", "cfg=etc"],
                "invalid --host-volume-readonly: path \"etc\" must be absolute",
            ),
            (
                &["--host-volume", "d=/a", "--host-volume-readonly", "d=/b"],
                "invalid --host-volume-readonly: mount tag \"d\" is used twice",
            ),
            (
                &["--qemu-uid", "0"],
                "invalid --qemu-uid: must not be 0: QEMU runs as an unprivileged user (default 107)",
            ),
            (
                &["--iscsi-initiator-name", "node 1"],
                "invalid --iscsi-initiator-name: must be an iqn. or eui. name without spaces, at most 223 bytes",
            ),
            (
                &["--etcd-disk", "/var/lib/capk/etcd/etcd.img"],
                "invalid --etcd-owner: is required with --etcd-disk: the KVMMachine \
                 (<namespace>/<name>/<uid>) whose directory it is",
            ),
            (
                &["--etcd-disk", "/var/lib/capk/etcd", "--etcd-owner", "a/b/c"],
                "invalid --etcd-disk: must be a file named etcd.img in a directory of its own",
            ),
            (
                &["--hostname", "Bad_Name"],
                "invalid --hostname: must be a DNS name of labels [a-z0-9-], at most 253 characters",
            ),
        ];
        for (flags, msg) in cases {
            assert_eq!(validate(&config(flags)).unwrap_err().to_string(), *msg);
        }
        assert!(
            validate(&config(&[
                "--host-volume",
                "data=/srv/data",
                "--memory",
                "8Gi"
            ]))
            .is_ok()
        );
    }

    /// The launcher runs a machine up to the shared limits the CRD and the controller's validation
    /// hold too (their own tests), and refuses one past each.
    #[test]
    fn the_resource_edges_are_the_shared_limits() {
        use capk_api::limits::{MAX_VCPUS, MIN_DISK, MIN_MEMORY, MIN_VCPUS};
        let at = |vcpus: u32, memory: u64, disk: u64| {
            let (vcpus, memory, disk) = (vcpus.to_string(), memory.to_string(), disk.to_string());
            validate(&config(&[
                "--vcpus",
                &vcpus,
                "--memory",
                &memory,
                "--disk-size",
                &disk,
            ]))
            .map(|_| ())
            .map_err(|e| e.to_string())
        };
        let (mem, disk) = (MIN_MEMORY.bytes, MIN_DISK.bytes);
        assert_eq!(at(MIN_VCPUS, mem, disk), Ok(()));
        assert_eq!(at(MAX_VCPUS, mem, disk), Ok(()));
        for (vcpus, memory, disk, flag) in [
            (MIN_VCPUS - 1, mem, disk, "--vcpus"),
            (MAX_VCPUS + 1, mem, disk, "--vcpus"),
            (1, mem - 1, disk, "--memory"),
            (1, mem, disk - 1, "--disk-size"),
        ] {
            let e = at(vcpus, memory, disk).unwrap_err();
            assert!(e.starts_with(&format!("invalid {flag}: ")), "{e}");
        }
    }

    /// The launcher takes exactly the mount tags the CRD and the bootstrap overlay take.
    #[test]
    fn host_volume_tags_follow_the_shared_rule() {
        for tag in capk_api::mount_tag::EXAMPLES {
            let flag = format!("{tag}=/srv");
            let argv = [
                "capk-launcher",
                "run",
                "--image",
                "/i",
                "--host-volume",
                &flag,
            ];
            // A tag the command line cannot even split into TAG=PATH is refused there.
            let got = Cli::try_parse_from(argv)
                .map_err(|e| e.to_string())
                .and_then(|cli| match cli.command {
                    Command::Run(r) => validate(&r).map_err(|e| e.to_string()),
                    _ => unreachable!(),
                });
            assert_eq!(
                got.is_ok(),
                capk_api::mount_tag::check(tag).is_ok(),
                "{tag:?}: {got:?}"
            );
        }
    }

    #[test]
    fn etcd_owners_are_parsed_once_at_the_edge() {
        let r = config(&[
            "--etcd-disk",
            "/var/lib/capk/etcd/etcd.img",
            "--etcd-owner",
            "team-a/demo-cp-0/6f1c2a8e-0b7d-4c1e-9a53-2f0e8d7c6b5a",
        ]);
        assert!(validate(&r).is_ok());
        assert_eq!(
            r.launch.etcd_owner.unwrap().uid,
            "6f1c2a8e-0b7d-4c1e-9a53-2f0e8d7c6b5a"
        );
        let e = Cli::try_parse_from([
            "capk-launcher",
            "remove-etcd-data",
            "--dir",
            "/var/lib/capk/etcd-cleanup/demo-cp-0",
            "--owner",
            "team-a/../uid",
        ])
        .unwrap_err();
        assert!(
            e.to_string()
                .contains("\"team-a/../uid\" is not <namespace>/<name>/<uid> of a KVMMachine"),
            "{e}"
        );
    }

    #[test]
    fn sizes_that_do_not_parse_are_refused_by_the_cli() {
        let e = Cli::try_parse_from(["capk-launcher", "run", "--image", "/i", "--memory", "lots"])
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("invalid size: \"lots\" is not a Kubernetes quantity"),
            "{e}"
        );
    }

    #[test]
    fn dns_flags_override_resolv_conf() {
        let resolv = "search ns.svc.cluster.local\nnameserver 10.96.0.10\n";
        let n = guest_naming(&config(&[]), resolv, "m1".into());
        assert_eq!(n.dns_servers, vec![Ipv4Addr::new(10, 96, 0, 10)]);
        assert_eq!(n.dns_search, ["ns.svc.cluster.local"]);
        let n = guest_naming(
            &config(&[
                "--dns",
                "1.1.1.1",
                "--dns-search",
                "example.org",
                "--ntp",
                "10.0.0.1",
            ]),
            resolv,
            "m1".into(),
        );
        assert_eq!(n.dns_servers, vec![Ipv4Addr::new(1, 1, 1, 1)]);
        assert_eq!(n.dns_search, ["example.org"]);
        assert_eq!(n.ntp_servers, vec![Ipv4Addr::new(10, 0, 0, 1)]);
    }
}
