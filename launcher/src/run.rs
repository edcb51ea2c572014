//! `capk-launcher run`: validate → accel → network → disks → Ignition → QEMU → supervise.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::Mutex;

use crate::accel::{self, KvmUnusable};
use crate::apiserver;
use crate::cli::{Role, RunArgs};
use crate::control::{self, SharedQmp, SharedState};
use crate::disk::{self, DiskError, DiskRequest};
use crate::health::{self, LauncherState, Phase};
use crate::ignition::{self, IgnitionError};
use crate::net::observe::NetlinkError;
use crate::net::plan::{GuestNaming, PlanError};
use crate::net::{MacAddr, apply, dhcp, observe, plan, resolv, tap};
use crate::qemu::argv::{self, DirectKernel, DiskFormat, HostVolume, VmSpec};
use crate::qemu::qmp::{QapiQmp, Qmp};
use crate::supervise::{QemuExit, Reaper};

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
    if a.vcpus == 0 || a.vcpus > 255 {
        return Err(invalid("vcpus", "must be between 1 and 255"));
    }
    let memory_mib = a.memory.as_mib_ceil();
    if memory_mib < 128 {
        return Err(invalid("memory", "must be at least 128Mi"));
    }
    let image_format = match a.image_format.as_str() {
        "qcow2" => DiskFormat::Qcow2,
        "raw" => DiskFormat::Raw,
        _ => return Err(invalid("image-format", "must be qcow2 or raw")),
    };
    if a.disk_size.0 == 0 {
        return Err(invalid("disk-size", "must be larger than 0"));
    }
    if a.etcd_disk.is_some() && a.etcd_disk_size.0 == 0 {
        return Err(invalid("etcd-disk-size", "must be larger than 0"));
    }
    if let Some(h) = &a.hostname
        && !valid_hostname(h)
    {
        return Err(invalid(
            "hostname",
            "must be a DNS name of labels [a-z0-9-], at most 253 characters",
        ));
    }
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
    let mut host_volumes = Vec::new();
    for v in &a.host_volumes {
        let Some((tag, path)) = v.split_once('=') else {
            return Err(invalid("host-volume", &format!("{v:?} is not TAG=PATH")));
        };
        if tag.is_empty()
            || tag.len() > 31
            || !tag
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            return Err(invalid(
                "host-volume",
                &format!("tag {tag:?} must be 1-31 characters of [A-Za-z0-9_-]"),
            ));
        }
        if !path.starts_with('/') {
            return Err(invalid(
                "host-volume",
                &format!("path {path:?} must be absolute"),
            ));
        }
        host_volumes.push(HostVolume {
            tag: tag.into(),
            path: path.into(),
        });
    }
    Ok(Validated {
        image_format,
        host_volumes,
        memory_mib,
    })
}

fn valid_hostname(h: &str) -> bool {
    !h.is_empty()
        && h.len() <= 253
        && h.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && l.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        })
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

/// Checks files and devices before anything is changed.
fn preflight(a: &RunArgs) -> Result<(), RunError> {
    require_file("node image", &a.image)?;
    if let Some(i) = &a.ignition {
        require_file("Ignition config", i)?;
    }
    if let Some(k) = &a.kernel {
        require_file("kernel", k)?;
    }
    if let Some(i) = &a.initrd {
        require_file("initrd", i)?;
    }
    for v in &a.host_volumes {
        if let Some((_, p)) = v.split_once('=')
            && !Path::new(p).is_dir()
        {
            return Err(RunError::MissingFile {
                what: "host volume",
                path: p.into(),
                reason: "not a directory".into(),
            });
        }
    }
    if !tap::tun_available() {
        return Err(RunError::NoTun);
    }
    Ok(())
}

/// Naming facts for DHCP: flags win over the Pod's resolv.conf.
pub fn guest_naming(a: &RunArgs, resolv_text: &str, hostname: String) -> GuestNaming {
    let r = resolv::parse(resolv_text);
    GuestNaming {
        hostname,
        dns_servers: if a.dns_servers.is_empty() {
            r.nameservers
        } else {
            a.dns_servers.clone()
        },
        dns_search: if a.dns_search.is_empty() {
            r.search
        } else {
            a.dns_search.clone()
        },
        ntp_servers: a.ntp_servers.clone(),
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
    preflight(&a)?;
    let hostname = match &a.hostname {
        Some(h) => h.clone(),
        None => nix::unistd::gethostname()
            .map(|h| h.to_string_lossy().into_owned())
            .unwrap_or_else(|_| "capk-machine".into()),
    };

    let decision = accel::decide(a.accel, || {
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
        a.role.as_str(),
        Duration::from_secs(a.heartbeat_timeout_seconds),
    )));
    state.lock().await.accel = Some(decision.accel);
    let qmp_slot: SharedQmp = Arc::new(Mutex::new(None));
    let listener = control::bind(&a.socket.runtime_dir)?;
    let control_task = tokio::spawn(control::serve(listener, state.clone(), qmp_slot.clone()));

    // Network: observe → plan → apply (apply undoes itself on failure).
    let nl = observe::connect()?;
    let mut pod = observe::observe(&nl, &a.interface).await?;
    let binding_file = a.state_dir.join(apply::SavedBinding::FILE);
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
    if let Err(e) =
        std::fs::create_dir_all(&a.state_dir).and_then(|()| std::fs::write(&binding_file, saved))
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

    let started = start_vm(&a, &v, &net_plan, decision.accel, &hostname, &state).await;
    let (pid, dhcp_task, mut reaper) = match started {
        Ok(x) => x,
        Err(e) => {
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

    let readyz_task = if a.role == Role::ControlPlane && a.apiserver_readyz_port != 0 {
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
    let hb_task = tokio::spawn(health::follow_heartbeat(
        a.socket.runtime_dir.join("heartbeat.sock"),
        state.clone(),
    ));
    let qmp_path = a.socket.runtime_dir.join("qmp.sock");
    let qmp_task = {
        let (slot, state) = (qmp_slot.clone(), state.clone());
        tokio::spawn(async move {
            match QapiQmp::connect(&qmp_path, Duration::from_secs(30)).await {
                Ok(q) => {
                    if let Ok(s) = q.query_status().await {
                        tracing::info!(qmp.status = %s.status, "QMP connected");
                    }
                    *slot.lock().await = Some(q);
                    let mut st = state.lock().await;
                    if st.phase == Phase::Starting {
                        st.phase = Phase::Running;
                    }
                }
                Err(e) => tracing::warn!(error = %e, "QMP unavailable"),
            }
        })
    };

    let result = supervise(&mut signals, &a, pid, &mut reaper, &state, &qmp_slot).await;
    for t in [dhcp_task, hb_task, qmp_task, control_task]
        .into_iter()
        .chain(readyz_task)
    {
        t.abort();
    }
    applied.undo(&nl).await;
    let _ = std::fs::remove_file(&binding_file);
    result
}

type Started = (u32, tokio::task::JoinHandle<()>, Reaper);

async fn start_vm(
    a: &RunArgs,
    v: &Validated,
    net_plan: &plan::NetworkPlan,
    accel: argv::Accel,
    hostname: &str,
    state: &SharedState,
) -> Result<Started, RunError> {
    let req = DiskRequest {
        state_dir: a.state_dir.clone(),
        image: a.image.clone(),
        image_format: v.image_format,
        root_size: a.disk_size,
        docker_size: a.docker_disk_size,
        kubelet_size: a.kubelet_disk_size,
        etcd: a.etcd_disk.clone().map(|p| (p, a.etcd_disk_size)),
    };
    let disk_plan = disk::plan(&req, &disk::observe(&req)?)?;
    disk::apply(&disk_plan, &a.qemu_img)?;
    state.lock().await.disks = disk_plan.attachments.clone();

    let ignition = match &a.ignition {
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
            let dest = a.socket.runtime_dir.join("ignition.json");
            let report = ignition::prepare(src, &dest, &ignition::overlay(&inputs))?;
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

    let spec = VmSpec {
        name: hostname.into(),
        accel,
        vcpus: a.vcpus,
        memory_mib: v.memory_mib,
        tap: net_plan.tap.clone(),
        mac: net_plan.vm_mac,
        mtu: net_plan.mtu,
        disks: disk_plan.attachments,
        ignition,
        qmp_socket: a.socket.runtime_dir.join("qmp.sock"),
        heartbeat_socket: a.socket.runtime_dir.join("heartbeat.sock"),
        console_log: a.socket.runtime_dir.join(CONSOLE_LOG),
        host_volumes: v.host_volumes.clone(),
        direct_kernel: a.kernel.clone().map(|kernel| DirectKernel {
            kernel,
            initrd: a.initrd.clone(),
            cmdline: a.kernel_cmdline.clone(),
        }),
    };
    let args = argv::qemu_args(&spec);
    tracing::debug!(qemu.argv = ?args.0, "qemu command line");
    let reaper = Reaper::new().map_err(|e| RunError::Runtime("watch SIGCHLD".into(), e))?;
    let child = Command::new(&a.qemu)
        .args(&args.0)
        .stdin(Stdio::null())
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| {
            dhcp_task.abort();
            RunError::SpawnQemu(a.qemu.clone(), e)
        })?;
    let pid = child.id();
    // The reaper owns waiting from here on; dropping Child neither waits nor kills.
    drop(child);
    {
        let mut s = state.lock().await;
        s.qemu_pid = Some(pid);
        s.phase = Phase::Starting;
    }
    Ok((pid, dhcp_task, reaper))
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

async fn supervise(
    signals: &mut StopSignals,
    a: &RunArgs,
    pid: u32,
    reaper: &mut Reaper,
    state: &SharedState,
    qmp: &SharedQmp,
) -> Result<(), RunError> {
    let StopSignals { term, int } = signals;
    let grace = Duration::from_secs(a.grace_period_seconds);
    let mut deadline: Option<tokio::time::Instant> = None;
    let mut killed = false;
    let exit = loop {
        tokio::select! {
            exit = reaper.wait_for(pid) => break exit,
            _ = term.recv() => request_stop(state, qmp, &mut deadline, grace, "SIGTERM").await,
            _ = int.recv() => request_stop(state, qmp, &mut deadline, grace, "SIGINT").await,
            _ = async { tokio::time::sleep_until(deadline.expect("guarded")).await }, if deadline.is_some() && !killed => {
                tracing::warn!(grace_seconds = grace.as_secs(), "guest did not power off in time, killing qemu");
                let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGKILL);
                killed = true;
            }
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

async fn request_stop(
    state: &SharedState,
    qmp: &SharedQmp,
    deadline: &mut Option<tokio::time::Instant>,
    grace: Duration,
    why: &str,
) {
    if deadline.is_some() {
        return;
    }
    *deadline = Some(tokio::time::Instant::now() + grace);
    state.lock().await.phase = Phase::ShuttingDown;
    tracing::info!(
        signal = why,
        grace_seconds = grace.as_secs(),
        "stopping: ACPI powerdown"
    );
    if let Some(q) = qmp.lock().await.as_ref()
        && let Err(e) = q.system_powerdown().await
    {
        tracing::warn!(error = %e, "system_powerdown failed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Cli, Command};
    use clap::Parser;

    fn args(extra: &[&str]) -> RunArgs {
        let mut v = vec!["capk-launcher", "run", "--image", "/img.qcow2"];
        v.extend_from_slice(extra);
        match Cli::try_parse_from(v).unwrap().command {
            Command::Run(r) => *r,
            _ => unreachable!(),
        }
    }

    #[test]
    fn bad_flags_get_one_line_causes() {
        let cases: &[(&[&str], &str)] = &[
            (
                &["--vcpus", "0"],
                "invalid --vcpus: must be between 1 and 255",
            ),
            (
                &["--memory", "64Mi"],
                "invalid --memory: must be at least 128Mi",
            ),
            (
                &["--image-format", "vmdk"],
                "invalid --image-format: must be qcow2 or raw",
            ),
            (
                &["--host-volume", "data"],
                "invalid --host-volume: \"data\" is not TAG=PATH",
            ),
            (
                &["--host-volume", "d=rel/path"],
                "invalid --host-volume: path \"rel/path\" must be absolute",
            ),
            (
                &["--iscsi-initiator-name", "node 1"],
                "invalid --iscsi-initiator-name: must be an iqn. or eui. name without spaces, at most 223 bytes",
            ),
            (
                &["--hostname", "Bad_Name"],
                "invalid --hostname: must be a DNS name of labels [a-z0-9-], at most 253 characters",
            ),
        ];
        for (flags, msg) in cases {
            assert_eq!(validate(&args(flags)).unwrap_err().to_string(), *msg);
        }
        assert!(
            validate(&args(&[
                "--host-volume",
                "data=/srv/data",
                "--memory",
                "8Gi"
            ]))
            .is_ok()
        );
    }

    #[test]
    fn sizes_that_do_not_parse_are_refused_by_the_cli() {
        let e = Cli::try_parse_from(["capk-launcher", "run", "--image", "/i", "--memory", "lots"])
            .unwrap_err();
        assert!(e.to_string().contains("invalid size \"lots\""), "{e}");
    }

    #[test]
    fn dns_flags_override_resolv_conf() {
        let resolv = "search ns.svc.cluster.local\nnameserver 10.96.0.10\n";
        let n = guest_naming(&args(&[]), resolv, "m1".into());
        assert_eq!(n.dns_servers, vec![Ipv4Addr::new(10, 96, 0, 10)]);
        assert_eq!(n.dns_search, ["ns.svc.cluster.local"]);
        let n = guest_naming(
            &args(&[
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
