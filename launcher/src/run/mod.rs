//! `capk-launcher run`: validate → accel → network → disks → Ignition → QEMU → supervise.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::{Mutex, Notify};

use capk_api::launch::Role;

use crate::accel::{self, KvmUnusable};
use crate::apiserver;
use crate::cli::RunArgs;
use crate::console;
use crate::control::{self, SharedQmp};
use crate::disk::{self, DiskError, DiskRequest, EtcdDiskRequest};
use crate::health::{self, LauncherState, Phase, SharedState};
use crate::host_volume::{self, HostVolumeError};
use crate::ignition::{self, IgnitionError};
use crate::net::netns::{self, NetnsKind, NetnsUnknown};
use crate::net::observe::NetlinkError;
use crate::net::plan::{GuestNaming, PlanError};
use crate::net::{MacAddr, apply, dhcp, observe, plan, resolv, tap};
use crate::qemu::argv::{self, DirectKernel, DiskFormat, HostVolume, VmSpec};
use crate::qemu::privilege::{self, HandOverError, QemuUser};
use crate::qemu::qmp::{QapiQmp, Qmp};
use crate::supervise::{QemuExit, Reaper};

/// The vhost-net device (KVM only), opened for QEMU.
const VHOST_NET: &str = "/dev/vhost-net";

/// File name of the merged Ignition config in the secret directory.
pub const IGNITION_FILE: &str = "ignition.json";

/// File name of the console copy in the runtime directory.
pub const CONSOLE_LOG: &str = "console.log";

/// Why `run` stopped or could not start. Each message is one line and says what to do.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// A flag value is impossible.
    #[error("invalid --{flag}: {reason}")]
    Invalid {
        /// Flag name.
        flag: &'static str,
        /// Why.
        reason: String,
    },
    /// A host volume's directory is not one QEMU may be given.
    #[error(transparent)]
    HostVolume(#[from] HostVolumeError),
    /// A file the run needs is missing.
    #[error("{what} {path}: {reason}")]
    MissingFile {
        /// Which file.
        what: &'static str,
        /// Path.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// No tun device.
    #[error(
        "{} not found: the Pod needs the tun device (privileged, or a device plugin providing it)",
        tap::TUN_DEVICE
    )]
    NoTun,
    /// Run in the host's network namespace.
    #[error(
        "this is the host's network namespace (hostNetwork, or run by hand on a node): the VM \
         would take the node's own address and MAC; run capk-launcher as PID 1 of a machine Pod \
         in the Pod's own network namespace (hostNetwork: false)"
    )]
    HostNetwork,
    /// The network namespace could not be told.
    #[error(transparent)]
    NetnsUnknown(#[from] NetnsUnknown),
    /// Opening the tap for QEMU failed.
    #[error("open the tap for QEMU")]
    OpenTap(#[source] tap::TapError),
    /// Handing QEMU's files to its user failed.
    #[error("give QEMU's user its files")]
    HandOver(#[from] HandOverError),
    /// KVM required but unusable.
    #[error("--accel kvm: {0}")]
    Kvm(#[from] KvmUnusable),
    /// Netlink.
    #[error("network setup")]
    Network(#[from] NetlinkError),
    /// Network plan.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// DHCP server.
    #[error(transparent)]
    Dhcp(#[from] dhcp::DhcpError),
    /// Disks.
    #[error("disk setup")]
    Disk(#[from] DiskError),
    /// Ignition.
    #[error(transparent)]
    Ignition(#[from] IgnitionError),
    /// Runtime directory, sockets, signals.
    #[error("{0}")]
    Runtime(String, #[source] std::io::Error),
    /// Control socket.
    #[error(transparent)]
    Control(#[from] control::ControlError),
    /// QEMU could not be started.
    #[error("start {0} (install qemu-system-x86)")]
    SpawnQemu(PathBuf, #[source] std::io::Error),
    /// The guest powered itself off without a stop request.
    #[error("guest powered off without a stop request; the container restarts to boot it again")]
    GuestPoweredOff,
    /// QEMU or the guest ended without a stop request.
    #[error("qemu ended without a stop request ({0}): guest panicked or qemu died")]
    QemuEnded(QemuExit),
    /// QEMU ended badly during a requested stop.
    #[error("qemu ended with {0} during shutdown")]
    ShutdownFailed(QemuExit),
}

/// Validated values of `run` that need no I/O to check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Validated {
    /// Image format.
    pub image_format: DiskFormat,
    /// Host volumes.
    pub host_volumes: Vec<HostVolume>,
    /// Memory in MiB.
    pub memory_mib: u64,
}

/// Pure validation of the flags.
pub fn validate(a: &RunArgs) -> Result<Validated, RunError> {
    let invalid = |flag, reason: &str| RunError::Invalid {
        flag,
        reason: reason.to_string(),
    };
    a.launch.check().map_err(|e| RunError::Invalid {
        flag: e.flag,
        reason: e.reason,
    })?;
    let memory_mib = a.launch.memory.as_mib_ceil();
    let image_format = match a.image_format.as_str() {
        "qcow2" => DiskFormat::Qcow2,
        "raw" => DiskFormat::Raw,
        _ => return Err(invalid("image-format", "must be qcow2 or raw")),
    };
    if let Some(n) = &a.iscsi_initiator_name
        && (!(n.starts_with("iqn.") || n.starts_with("eui."))
            || n.len() > 223
            || n.chars().any(char::is_whitespace))
    {
        return Err(invalid(
            "iscsi-initiator-name",
            "must be an iqn. or eui. name without spaces, at most 223 bytes",
        ));
    }
    let host_volumes = a
        .launch
        .shares()
        .map(|(share, read_only)| HostVolume {
            tag: share.tag.clone(),
            path: share.path.clone(),
            read_only,
            fd: None,
        })
        .collect();
    for (flag, id) in [("qemu-uid", a.qemu_uid), ("qemu-gid", a.qemu_gid)] {
        if id == 0 {
            return Err(invalid(
                flag,
                "must not be 0: QEMU runs as an unprivileged user (default 107)",
            ));
        }
    }
    Ok(Validated {
        image_format,
        host_volumes,
        memory_mib,
    })
}

/// Whether `dir` is on tmpfs: what an emptyDir with
/// `medium: Memory` is.
fn memory_backed(dir: &Path) -> bool {
    use nix::sys::statfs::{TMPFS_MAGIC, statfs};
    statfs(dir)
        .map(|s| s.filesystem_type() == TMPFS_MAGIC)
        .unwrap_or(false)
}

fn require_file(what: &'static str, path: &Path) -> Result<(), RunError> {
    std::fs::File::open(path)
        .map(|_| ())
        .map_err(|e| RunError::MissingFile {
            what,
            path: path.to_path_buf(),
            reason: e.to_string(),
        })
}

/// The host volumes' directories, opened without following links, in the order of
/// [`Validated::host_volumes`]: QEMU inherits these, so what was checked is what it exports.
type OpenedVolumes = Vec<std::os::fd::OwnedFd>;

/// Checks files and devices before anything is changed; opens the host volumes' directories.
fn preflight(a: &RunArgs, v: &Validated) -> Result<OpenedVolumes, RunError> {
    require_file("node image", &a.launch.image)?;
    if let Some(i) = &a.launch.ignition {
        require_file("Ignition config", i)?;
    }
    if let Some(k) = &a.kernel {
        require_file("kernel", k)?;
    }
    if let Some(i) = &a.initrd {
        require_file("initrd", i)?;
    }
    let volumes = v
        .host_volumes
        .iter()
        .map(|h| {
            let fd = host_volume::open_dir(&h.tag, &h.path)?;
            if !h.read_only {
                let opened = host_volume::qemu_path(std::os::fd::AsRawFd::as_raw_fd(&fd));
                host_volume::check_user_xattrs(&h.tag, &h.path, &opened)?;
            }
            Ok(fd)
        })
        .collect::<Result<OpenedVolumes, HostVolumeError>>()?;
    if !tap::tun_available() {
        return Err(RunError::NoTun);
    }
    // Before anything touches a link: in the host's namespace "the Pod's interface" is the node's.
    if netns::classify(Path::new(netns::CORE_SYSCTLS))? == NetnsKind::Initial {
        return Err(RunError::HostNetwork);
    }
    Ok(volumes)
}

/// Naming facts for DHCP: flags win over the Pod's resolv.conf.
pub fn guest_naming(a: &RunArgs, resolv_text: &str, hostname: String) -> GuestNaming {
    let r = resolv::parse(resolv_text);
    GuestNaming {
        hostname,
        dns_servers: if a.launch.dns_servers.is_empty() {
            r.nameservers
        } else {
            a.launch.dns_servers.clone()
        },
        dns_search: if a.launch.dns_search.is_empty() {
            r.search
        } else {
            a.launch.dns_search.clone()
        },
        ntp_servers: a.launch.ntp_servers.clone(),
    }
}

/// Runs the machine until QEMU ends. Ok means a requested, clean stop.
pub async fn run(a: RunArgs) -> Result<(), RunError> {
    let t0 = Instant::now();
    let mut signals = StopSignals::install()?;
    tracing::info!(
        pid = std::process::id(),
        version = env!("CARGO_PKG_VERSION"),
        "capk-launcher starting"
    );
    let v = validate(&a)?;
    let volumes = preflight(&a, &v)?;
    // Disks are planned before anything changes: a node image that names other files (qcow2
    // backing or data file) is refused here, before qemu-img or QEMU opens it.
    let disk_req = DiskRequest {
        state_dir: a.launch.state_dir.clone(),
        image: a.launch.image.clone(),
        image_format: v.image_format,
        root_size: a.launch.disk_size,
        docker_size: a.launch.docker_disk_size,
        kubelet_size: a.launch.kubelet_disk_size,
        etcd: a
            .launch
            .etcd_disk
            .clone()
            .zip(a.launch.etcd_owner.clone())
            .map(|(path, owner)| EtcdDiskRequest {
                path,
                size: a.launch.etcd_disk_size,
                owner,
            }),
    };
    let disk_plan = disk::plan(&disk_req, &disk::observe(&disk_req)?)?;
    let hostname = match &a.launch.hostname {
        Some(h) => h.clone(),
        None => nix::unistd::gethostname()
            .map(|h| h.to_string_lossy().into_owned())
            .unwrap_or_else(|_| "capk-machine".into()),
    };

    let decision = accel::decide(a.launch.accel, || {
        accel::probe_kvm(Duration::from_millis(a.kvm_probe_timeout_ms))
    })?;
    if let Some(reason) = &decision.fallback_reason {
        tracing::warn!(reason = %reason, "KVM unusable, falling back to TCG (slow)");
    }
    tracing::info!(
        accel = decision.accel.as_str(),
        elapsed_ms = t0.elapsed().as_millis() as u64,
        "accelerator chosen"
    );

    std::fs::create_dir_all(&a.socket.runtime_dir)
        .map_err(|e| RunError::Runtime(format!("create {}", a.socket.runtime_dir.display()), e))?;
    let state: SharedState = Arc::new(Mutex::new(LauncherState::new(
        a.launch.role.as_str(),
        Duration::from_secs(a.heartbeat_timeout_seconds),
    )));
    state.lock().await.accel = Some(decision.accel);
    let qmp_slot: SharedQmp = Arc::new(Mutex::new(None));
    let listener = control::bind(&a.socket.runtime_dir)?;
    let control_task = tokio::spawn(control::serve(listener, state.clone(), qmp_slot.clone()));

    // Network: observe → plan → apply (apply undoes itself on failure).
    let nl = observe::connect()?;
    let mut pod = observe::observe(&nl, &a.interface).await?;
    let binding_file = a.launch.state_dir.join(apply::SavedBinding::FILE);
    if pod.addresses.is_empty()
        && let Some(saved) = std::fs::read(&binding_file)
            .ok()
            .and_then(|b| serde_json::from_slice::<apply::SavedBinding>(&b).ok())
            .filter(|s| s.original.name == a.interface)
    {
        tracing::warn!(interface = %a.interface, "previous run left the Pod interface bound; restoring it first");
        apply::recover(&nl, &saved).await?;
        pod = observe::observe(&nl, &a.interface).await?;
    }
    let resolv_text = std::fs::read_to_string(&a.resolv_conf).unwrap_or_default();
    let net_plan = plan::plan(
        &pod,
        guest_naming(&a, &resolv_text, hostname.clone()),
        MacAddr::random(),
    )?;
    tracing::info!(
        vm.ip = %net_plan.lease.address,
        vm.mac = %net_plan.vm_mac,
        vm.tap = %net_plan.tap,
        mtu = net_plan.mtu,
        "network planned"
    );
    let mut applied = apply::apply(&nl, &net_plan, &pod).await?;
    let saved = serde_json::to_vec(&apply::SavedBinding::new(&net_plan, &pod)).unwrap_or_default();
    if let Err(e) = std::fs::create_dir_all(&a.launch.state_dir)
        .and_then(|()| std::fs::write(&binding_file, saved))
    {
        applied.undo(&nl).await;
        return Err(RunError::Runtime(
            format!("write {}", binding_file.display()),
            e,
        ));
    }
    {
        let mut s = state.lock().await;
        s.ip = Some(net_plan.lease.address.to_string());
        s.mac = Some(net_plan.vm_mac.to_string());
    }

    let merged_ignition = a
        .launch
        .ignition
        .as_ref()
        .map(|_| a.launch.secret_dir.join(IGNITION_FILE));
    let started = start_vm(
        &a,
        &v,
        volumes,
        disk_plan,
        &net_plan,
        decision.accel,
        &hostname,
        &state,
    )
    .await;
    let (pid, dhcp_task, mut reaper, qemu_stdout) = match started {
        Ok(x) => x,
        Err(e) => {
            remove_merged_ignition(merged_ignition.as_deref());
            applied.undo(&nl).await;
            let _ = std::fs::remove_file(&binding_file);
            return Err(e);
        }
    };
    tracing::info!(
        qemu.pid = pid,
        startup_ms = t0.elapsed().as_millis() as u64,
        "qemu started"
    );

    let readyz_task = if a.launch.role == Role::ControlPlane && a.apiserver_readyz_port != 0 {
        let addr = SocketAddr::new(
            IpAddr::V4(net_plan.lease.address.addr()),
            a.apiserver_readyz_port,
        );
        tracing::info!(apiserver = %addr, "control plane: readiness also requires the apiserver's /readyz");
        state.lock().await.apiserver = Some(health::ApiserverReadyz {
            url: format!("https://{addr}/readyz"),
            last: None,
        });
        Some(tokio::spawn(apiserver::follow_readyz(addr, state.clone())))
    } else {
        None
    };
    let console_ended = copy_console(&a.socket.runtime_dir, qemu_stdout, state.clone())?;
    let hb_task = tokio::spawn(health::follow_heartbeat(
        a.socket.runtime_dir.join("heartbeat.sock"),
        state.clone(),
    ));
    let qmp_path = a.socket.runtime_dir.join("qmp.sock");
    // Told when QMP answers: a stop requested before then powers the guest down at that moment.
    let qmp_ready = Arc::new(Notify::new());
    let qmp_task = {
        let (slot, state, ready) = (qmp_slot.clone(), state.clone(), qmp_ready.clone());
        let merged_ignition = merged_ignition.clone();
        tokio::spawn(async move {
            let connected = QapiQmp::connect(&qmp_path, Duration::from_secs(30)).await;
            // QMP runs commands only once QEMU's start-up, which reads every `-fw_cfg file=`
            // into memory, is over: the merged config is no longer needed on any filesystem.
            remove_merged_ignition(merged_ignition.as_deref());
            match connected {
                Ok(q) => {
                    if let Ok(s) = q.query_status().await {
                        tracing::info!(qmp.status = %s.status, "QMP connected");
                    }
                    *slot.lock().await = Some(q);
                    ready.notify_one();
                    let mut st = state.lock().await;
                    if st.phase == Phase::Starting {
                        st.phase = Phase::Running;
                    }
                }
                Err(e) => tracing::warn!(error = %e, "QMP unavailable"),
            }
        })
    };

    let result = supervise(
        &mut signals,
        &a,
        pid,
        &mut reaper,
        &state,
        (&qmp_slot, &qmp_ready),
    )
    .await;
    // The console's last lines (the guest powering off) reach stdout before the launcher exits.
    let _ = tokio::time::timeout(Duration::from_secs(5), console_ended).await;
    for t in [dhcp_task, hb_task, qmp_task, control_task]
        .into_iter()
        .chain(readyz_task)
    {
        t.abort();
    }
    remove_merged_ignition(merged_ignition.as_deref());
    applied.undo(&nl).await;
    let _ = std::fs::remove_file(&binding_file);
    result
}

/// Removes the merged Ignition config (bootstrap secrets) once QEMU holds it in memory; a
/// restarted launcher merges it again from the mounted Secret.
fn remove_merged_ignition(path: Option<&Path>) {
    let Some(path) = path else { return };
    match std::fs::remove_file(path) {
        Ok(()) => tracing::info!(
            path = %path.display(),
            "merged Ignition config removed: QEMU has read it"
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "remove the merged Ignition config")
        }
    }
}

/// Copies QEMU's serial output (the read end of its stdout) to stdout, the capped console copy
/// and the boot-failure detector, on a thread of its own (blocking reads of a pipe); the receiver
/// is told when QEMU's output has ended and all of it has been copied.
fn copy_console(
    runtime_dir: &Path,
    qemu_stdout: std::process::ChildStdout,
    state: SharedState,
) -> Result<tokio::sync::oneshot::Receiver<()>, RunError> {
    let path = runtime_dir.join(CONSOLE_LOG);
    let copy = console::ConsoleLog::open(&path, console::CONSOLE_LOG_MAX_BYTES)
        .inspect_err(|e| {
            tracing::warn!(
                path = %path.display(),
                error = %e,
                "no console copy for capk-launcher console (kubectl logs still has the console)"
            )
        })
        .ok();
    let (done, ended) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("console".into())
        .spawn(move || {
            console::tee(qemu_stdout, std::io::stdout(), copy, |line| {
                health::record_console_line(&mut state.blocking_lock(), line)
            });
            let _ = done.send(());
        })
        .map_err(|e| RunError::Runtime("start the console thread".into(), e))?;
    Ok(ended)
}

type Started = (
    u32,
    tokio::task::JoinHandle<()>,
    Reaper,
    std::process::ChildStdout,
);

#[allow(clippy::too_many_arguments)]
async fn start_vm(
    a: &RunArgs,
    v: &Validated,
    volumes: OpenedVolumes,
    disk_plan: disk::DiskPlan,
    net_plan: &plan::NetworkPlan,
    accel: argv::Accel,
    hostname: &str,
    state: &SharedState,
) -> Result<Started, RunError> {
    disk::apply(&disk_plan, &a.qemu_img)?;
    let user = QemuUser::plan(a.qemu_uid, a.qemu_gid, privilege::kvm_device_group());
    for d in &disk_plan.attachments {
        privilege::hand_over(&d.path, &user)?;
    }
    state.lock().await.disks = disk_plan.attachments.clone();

    let ignition = match &a.launch.ignition {
        Some(src) => {
            let inputs = ignition::BootInputs {
                hostname: hostname.into(),
                dns_servers: net_plan
                    .lease
                    .naming
                    .dns_servers
                    .iter()
                    .map(|ip| IpAddr::V4(*ip))
                    .collect(),
                dns_search: net_plan.lease.naming.dns_search.clone(),
                ntp_servers: net_plan
                    .lease
                    .naming
                    .ntp_servers
                    .iter()
                    .map(Ipv4Addr::to_string)
                    .collect(),
                iscsi_initiator_name: a.iscsi_initiator_name.clone(),
                disks: disk_plan.attachments.clone(),
                host_volumes: v.host_volumes.clone(),
            };
            privilege::share_secret_dir(&a.launch.secret_dir, &user)?;
            if !memory_backed(&a.launch.secret_dir) {
                tracing::warn!(
                    secret_dir = %a.launch.secret_dir.display(),
                    "--secret-dir is not a memory filesystem (tmpfs): the merged Ignition config, \
                     with its bootstrap secrets, is on disk until QEMU has read it; mount an \
                     emptyDir with medium: Memory there"
                );
            }
            let dest = a.launch.secret_dir.join(IGNITION_FILE);
            let report = ignition::prepare(src, &dest, &ignition::overlay(&inputs))?;
            privilege::hand_over(&dest, &user)?;
            for r in &report.replaced {
                tracing::info!(
                    ignition.kind = r.kind,
                    ignition.name = %r.name,
                    "machine fact replaces the bootstrap config's entry"
                );
            }
            Some(dest)
        }
        None => None,
    };

    // Bound before QEMU starts so the guest's first DISCOVER finds it.
    let server = dhcp::DhcpServer::bind(&net_plan.bridge, net_plan.lease.clone())?;
    let dhcp_task = tokio::spawn(server.serve());

    let (qmp_socket, heartbeat_socket) = (
        a.socket.runtime_dir.join("qmp.sock"),
        a.socket.runtime_dir.join("heartbeat.sock"),
    );
    privilege::share_runtime_dir(
        &a.socket.runtime_dir,
        &user,
        &[&qmp_socket, &heartbeat_socket],
    )?;
    // QEMU cannot open /dev/net/tun or /dev/vhost-net: the launcher opens them and QEMU
    // inherits the descriptors (closed here once QEMU runs). Without vhost-net the NIC still
    // works, in QEMU's own thread.
    let tap_file = tap::open_tap(&net_plan.tap).map_err(RunError::OpenTap)?;
    let vhost_file = (accel == argv::Accel::Kvm)
        .then(|| {
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(VHOST_NET)
                .inspect_err(|e| tracing::warn!(error = %e, "{VHOST_NET} unavailable: no vhost"))
                .ok()
        })
        .flatten();
    // The node image too: QEMU's user need not be able to open it, and QEMU reads the very
    // file whose header was checked (again, on the open file).
    let image_file = disk_plan
        .attachments
        .iter()
        .find_map(|d| d.base.as_ref())
        .map(disk::open_base)
        .transpose()?;
    let fd = |f: Option<&std::fs::File>| f.map(std::os::fd::AsRawFd::as_raw_fd);
    let (tap_fd, vhost_fd, image_fd) = (
        std::os::fd::AsRawFd::as_raw_fd(&tap_file),
        fd(vhost_file.as_ref()),
        fd(image_file.as_ref()),
    );
    let host_volumes: Vec<HostVolume> = v
        .host_volumes
        .iter()
        .zip(&volumes)
        .map(|(h, fd)| HostVolume {
            fd: Some(std::os::fd::AsRawFd::as_raw_fd(fd)),
            ..h.clone()
        })
        .collect();
    let inherited: Vec<i32> = [Some(tap_fd), vhost_fd, image_fd]
        .into_iter()
        .flatten()
        .chain(host_volumes.iter().filter_map(|h| h.fd))
        .collect();
    let spec = VmSpec {
        name: hostname.into(),
        accel,
        tcg_tb_size_mib: a.launch.tcg_translation_cache_mib,
        tcg_threads: a.launch.tcg_threads,
        vcpus: a.launch.vcpus,
        memory_mib: v.memory_mib,
        tap_fd,
        vhost_fd,
        image_fd,
        mac: net_plan.vm_mac,
        mtu: net_plan.mtu,
        disks: disk_plan.attachments,
        ignition,
        qmp_socket,
        heartbeat_socket,
        host_volumes,
        direct_kernel: a.kernel.clone().map(|kernel| DirectKernel {
            kernel,
            initrd: a.initrd.clone(),
            cmdline: a.kernel_cmdline.clone(),
        }),
    };
    let args = argv::qemu_args(&spec);
    tracing::debug!(qemu.argv = ?args.0, "qemu command line");
    let reaper = Reaper::new().map_err(|e| RunError::Runtime("watch SIGCHLD".into(), e))?;
    let mut cmd = Command::new(&a.qemu);
    cmd.args(&args.0)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    privilege::run_unprivileged(&mut cmd, &user, &inherited);
    tracing::info!(
        qemu.uid = user.uid,
        qemu.gid = user.gid,
        qemu.groups = ?user.groups,
        "starting qemu unprivileged"
    );
    let mut child = cmd.spawn().map_err(|e| {
        dhcp_task.abort();
        RunError::SpawnQemu(a.qemu.clone(), e)
    })?;
    drop((tap_file, vhost_file, image_file, volumes));
    let pid = child.id();
    let stdout = child.stdout.take().expect("piped");
    // The reaper owns waiting from here on; dropping Child neither waits nor kills.
    drop(child);
    {
        let mut s = state.lock().await;
        s.qemu_pid = Some(pid);
        s.phase = Phase::Starting;
    }
    Ok((pid, dhcp_task, reaper, stdout))
}

/// SIGTERM and SIGINT listeners, installed first thing so that a stop request during setup is
/// kept (PID 1 would otherwise ignore it) and acted on once QEMU runs.
struct StopSignals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl StopSignals {
    fn install() -> Result<Self, RunError> {
        let sig = |k| signal(k).map_err(|e| RunError::Runtime("install signal handler".into(), e));
        Ok(Self {
            term: sig(SignalKind::terminate())?,
            int: sig(SignalKind::interrupt())?,
        })
    }
}

/// How often the ACPI power button is pressed again while the guest has not powered off: a press
/// that comes while the guest boots (a stop requested before or just after QMP answered) is lost
/// when the guest's kernel or its button handler is not up yet, and a guest that already shuts
/// down ignores another.
const POWERDOWN_REPEAT: Duration = Duration::from_secs(5);

/// Supervises QEMU until it ends. A stop (SIGTERM, SIGINT) presses the ACPI power button over QMP
/// — at once, or as soon as QMP answers when it comes earlier (`qmp.1` is told then) — and again
/// every [`POWERDOWN_REPEAT`]; QEMU is killed `--grace-period-seconds` after the stop request.
async fn supervise(
    signals: &mut StopSignals,
    a: &RunArgs,
    pid: u32,
    reaper: &mut Reaper,
    state: &SharedState,
    (qmp, qmp_ready): (&SharedQmp, &Notify),
) -> Result<(), RunError> {
    let StopSignals { term, int } = signals;
    let grace = Duration::from_secs(a.launch.grace_period_seconds);
    let mut deadline: Option<tokio::time::Instant> = None;
    // When to press the power button (again); None: no stop requested, or QMP not there yet.
    let mut next_press: Option<tokio::time::Instant> = None;
    let mut pressed = false;
    let mut killed = false;
    let exit = loop {
        let why = tokio::select! {
            exit = reaper.wait_for(pid) => break exit,
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
            () = qmp_ready.notified(), if deadline.is_some() && !pressed => "QMP answers",
            () = async { tokio::time::sleep_until(next_press.expect("guarded")).await }, if next_press.is_some() && !killed => "repeat",
            () = async { tokio::time::sleep_until(deadline.expect("guarded")).await }, if deadline.is_some() && !killed => {
                tracing::warn!(grace_seconds = grace.as_secs(), "guest did not power off in time, killing qemu");
                let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGKILL);
                killed = true;
                continue;
            }
        };
        if deadline.is_none() {
            request_stop(state, &mut deadline, grace, why).await;
        } else if why.starts_with("SIG") {
            continue;
        }
        if press_power_button(qmp, !pressed).await {
            pressed = true;
            next_press = Some(tokio::time::Instant::now() + POWERDOWN_REPEAT);
        } else if !pressed {
            tracing::info!("QMP does not answer yet: ACPI powerdown as soon as it does");
        }
    };
    let stop_requested = deadline.is_some();
    {
        let mut s = state.lock().await;
        s.phase = Phase::Stopped;
        s.qemu_pid = None;
        s.qemu_exit = Some(exit.to_string());
    }
    tracing::info!(qemu.exit = %exit, stop_requested, "qemu ended");
    match (stop_requested, exit) {
        (true, QemuExit::Exited(0)) => Ok(()),
        (true, e) => Err(RunError::ShutdownFailed(e)),
        (false, QemuExit::Exited(0)) => Err(RunError::GuestPoweredOff),
        (false, e) => Err(RunError::QemuEnded(e)),
    }
}

/// Records a stop request: the kill deadline runs from now, whenever QMP answers.
async fn request_stop(
    state: &SharedState,
    deadline: &mut Option<tokio::time::Instant>,
    grace: Duration,
    why: &str,
) {
    *deadline = Some(tokio::time::Instant::now() + grace);
    state.lock().await.phase = Phase::ShuttingDown;
    tracing::info!(
        signal = why,
        grace_seconds = grace.as_secs(),
        "stopping: ACPI powerdown"
    );
}

/// Presses the ACPI power button over QMP; false when QMP does not answer yet. The first press
/// is logged, repeats only at debug level.
async fn press_power_button(qmp: &SharedQmp, first: bool) -> bool {
    let slot = qmp.lock().await;
    let Some(q) = slot.as_ref() else {
        return false;
    };
    match q.system_powerdown().await {
        Ok(_) if first => tracing::info!(
            qmp.command = "system_powerdown",
            "ACPI power button pressed"
        ),
        Ok(_) => tracing::debug!(
            qmp.command = "system_powerdown",
            "ACPI power button pressed again"
        ),
        Err(e) => tracing::warn!(error = %e, "system_powerdown failed"),
    }
    true
}
