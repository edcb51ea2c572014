//! `capk-launcher run`: validate and preflight ([`check`]) → disks planned → accel → network →
//! disks, Ignition, QEMU ([`start`]) → supervise until it ends ([`stop`]) → teardown, in one
//! place ([`Teardown`]).

mod check;
mod start;
mod stop;

use check::preflight;
pub use check::{Validated, guest_naming, validate};
use start::start_vm;
use stop::{StopSignals, supervise};

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{Mutex, Notify};

use capk_api::launch::Role;

use crate::accel::{self, KvmUnusable};
use crate::apiserver;
use crate::cli::RunArgs;
use crate::console;
use crate::control::{self, SharedQmp};
use crate::disk::{self, DiskError, DiskRequest, EtcdDiskRequest};
use crate::health::{self, LauncherState, Phase, SharedState};
use crate::host_volume::HostVolumeError;
use crate::ignition::IgnitionError;
use crate::net::netns::NetnsUnknown;
use crate::net::observe::NetlinkError;
use crate::net::plan::PlanError;
use crate::net::{MacAddr, apply, dhcp, observe, plan, tap};
use crate::qemu::argv;
use crate::qemu::privilege::HandOverError;
use crate::qemu::qmp::{QapiQmp, Qmp};
use crate::supervise::QemuExit;

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
    let disk_plan = plan_disks(&a, &v)?;
    let hostname = guest_hostname(&a);
    let accel = choose_accel(&a, t0)?;

    std::fs::create_dir_all(&a.socket.runtime_dir)
        .map_err(|e| RunError::Runtime(format!("create {}", a.socket.runtime_dir.display()), e))?;
    let state: SharedState = Arc::new(Mutex::new(LauncherState::new(
        a.launch.role.as_str(),
        Duration::from_secs(a.heartbeat_timeout_seconds),
    )));
    state.lock().await.accel = Some(accel);
    let qmp_slot: SharedQmp = Arc::new(Mutex::new(None));
    let listener = control::bind(&a.socket.runtime_dir)?;
    let control_task = tokio::spawn(control::serve(listener, state.clone(), qmp_slot.clone()));

    let (net_plan, teardown) = bind_network(&a, &hostname, &state).await?;
    let started = start_vm(
        &a, &v, volumes, disk_plan, &net_plan, accel, &hostname, &state,
    )
    .await;
    let (pid, dhcp_task, mut reaper, qemu_stdout) = match started {
        Ok(x) => x,
        Err(e) => {
            teardown.undo().await;
            return Err(e);
        }
    };
    tracing::info!(
        qemu.pid = pid,
        startup_ms = t0.elapsed().as_millis() as u64,
        "qemu started"
    );

    let qmp_ready = Arc::new(Notify::new());
    let followers = follow_guest(&a, &net_plan, &state, &qmp_slot, &qmp_ready, &teardown).await;
    let console_ended = copy_console(&a.socket.runtime_dir, qemu_stdout, state.clone())?;
    let qmp = (&qmp_slot, &*qmp_ready);
    let result = supervise(&mut signals, &a, pid, &mut reaper, &state, qmp).await;
    // The console's last lines (the guest powering off) reach stdout before the launcher exits.
    let _ = tokio::time::timeout(Duration::from_secs(5), console_ended).await;
    for t in [dhcp_task, control_task].into_iter().chain(followers) {
        t.abort();
    }
    teardown.undo().await;
    result
}

/// The disks, planned before anything changes: a node image that names other files (qcow2
/// backing or data file) is refused here, before qemu-img or QEMU opens it.
fn plan_disks(a: &RunArgs, v: &Validated) -> Result<disk::DiskPlan, RunError> {
    let l = &a.launch;
    let disk_req = DiskRequest {
        state_dir: l.state_dir.clone(),
        image: l.image.clone(),
        image_format: v.image_format,
        root_size: l.disk_size,
        docker_size: l.docker_disk_size,
        kubelet_size: l.kubelet_disk_size,
        etcd: l
            .etcd_disk
            .clone()
            .zip(l.etcd_owner.clone())
            .map(|(path, owner)| EtcdDiskRequest {
                path,
                size: l.etcd_disk_size,
                owner,
            }),
    };
    Ok(disk::plan(&disk_req, &disk::observe(&disk_req)?)?)
}

/// The guest's hostname: the contract's, else this Pod's.
fn guest_hostname(a: &RunArgs) -> String {
    match &a.launch.hostname {
        Some(h) => h.clone(),
        None => nix::unistd::gethostname()
            .map(|h| h.to_string_lossy().into_owned())
            .unwrap_or_else(|_| "capk-machine".into()),
    }
}

/// KVM when asked for and usable (a probe vCPU really runs), else TCG.
fn choose_accel(a: &RunArgs, t0: Instant) -> Result<argv::Accel, RunError> {
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
    Ok(decision.accel)
}

/// What the launcher changed on the way up and undoes on the way out, whether QEMU never
/// started or ended: the Pod interface's binding (and its saved copy) and the merged Ignition.
struct Teardown {
    nl: rtnetlink::Handle,
    applied: apply::AppliedNetwork,
    binding_file: PathBuf,
    merged_ignition: Option<PathBuf>,
}

impl Teardown {
    async fn undo(mut self) {
        remove_merged_ignition(self.merged_ignition.as_deref());
        self.applied.undo(&self.nl).await;
        let _ = std::fs::remove_file(&self.binding_file);
    }
}

/// The network: observe the Pod's interface (restoring one a previous run left bound) → plan
/// → apply (which undoes itself on failure), the binding saved for the next run.
async fn bind_network(
    a: &RunArgs,
    hostname: &str,
    state: &SharedState,
) -> Result<(plan::NetworkPlan, Teardown), RunError> {
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
    let naming = guest_naming(a, &resolv_text, hostname.to_owned());
    let net_plan = plan::plan(&pod, naming, MacAddr::random())?;
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
    let teardown = Teardown {
        nl,
        applied,
        binding_file,
        merged_ignition,
    };
    Ok((net_plan, teardown))
}

/// The tasks that follow the running guest: its heartbeat, QMP (the merged Ignition removed
/// once it answers; `qmp_ready` told), and on a control plane the apiserver's `/readyz`.
async fn follow_guest(
    a: &RunArgs,
    net_plan: &plan::NetworkPlan,
    state: &SharedState,
    qmp_slot: &SharedQmp,
    qmp_ready: &Arc<Notify>,
    teardown: &Teardown,
) -> Vec<tokio::task::JoinHandle<()>> {
    let mut tasks = Vec::new();
    if a.launch.role == Role::ControlPlane && a.apiserver_readyz_port != 0 {
        let addr = SocketAddr::new(
            IpAddr::V4(net_plan.lease.address.addr()),
            a.apiserver_readyz_port,
        );
        tracing::info!(apiserver = %addr, "control plane: readiness also requires the apiserver's /readyz");
        state.lock().await.apiserver = Some(health::ApiserverReadyz {
            url: format!("https://{addr}/readyz"),
            last: None,
        });
        tasks.push(tokio::spawn(apiserver::follow_readyz(addr, state.clone())));
    }
    tasks.push(tokio::spawn(health::follow_heartbeat(
        a.socket.runtime_dir.join("heartbeat.sock"),
        state.clone(),
    )));
    let qmp_path = a.socket.runtime_dir.join("qmp.sock");
    let (slot, state, ready) = (qmp_slot.clone(), state.clone(), qmp_ready.clone());
    let merged_ignition = teardown.merged_ignition.clone();
    tasks.push(tokio::spawn(async move {
        let connected = QapiQmp::connect(&qmp_path, Duration::from_secs(30)).await;
        // QMP runs commands only once QEMU's start-up, which reads every `-fw_cfg file=` into
        // memory, is over: the merged config is no longer needed on any filesystem.
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
    }));
    tasks
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
