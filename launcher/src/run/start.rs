//! Starting the VM: the disks made and handed to QEMU's user, the merged Ignition, the DHCP
//! server, the descriptors QEMU inherits, and QEMU itself, unprivileged.

use std::net::{IpAddr, Ipv4Addr};
use std::process::{Command, Stdio};

use crate::cli::RunArgs;
use crate::disk;
use crate::health::{Phase, SharedState};
use crate::ignition;
use crate::net::{dhcp, plan, tap};
use crate::qemu::argv::{self, DirectKernel, HostVolume, VmSpec};
use crate::qemu::privilege::{self, QemuUser};
use crate::supervise::Reaper;

use super::check::{OpenedVolumes, Validated, memory_backed};
use super::{IGNITION_FILE, RunError, VHOST_NET};

pub(super) type Started = (
    u32,
    tokio::task::JoinHandle<()>,
    Reaper,
    std::process::ChildStdout,
);

#[allow(clippy::too_many_arguments)]
pub(super) async fn start_vm(
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
    hand_over_disks(&disk_plan, &user, state).await?;
    let ignition = merge_ignition(a, v, &disk_plan, net_plan, hostname, &user)?;

    let (qmp_socket, heartbeat_socket) = share_sockets(a, &user)?;
    let devices = open_devices(a, net_plan, accel, &disk_plan)?;
    let fds = devices.fds();
    let host_volumes = inherited_host_volumes(v, &volumes);
    let inherited: Vec<i32> = fds
        .all()
        .chain(host_volumes.iter().filter_map(|h| h.fd))
        .collect();
    let spec = VmSpec {
        name: hostname.into(),
        accel,
        tcg_tb_size_mib: a.launch.tcg_translation_cache_mib,
        tcg_threads: a.launch.tcg_threads,
        vcpus: a.launch.vcpus,
        memory_mib: v.memory_mib,
        tap_fd: fds.tap,
        vhost_fd: fds.vhost,
        image_fd: fds.image,
        mac: net_plan.vm_mac,
        mtu: net_plan.mtu,
        disks: disk_plan.attachments,
        ignition,
        qmp_socket,
        heartbeat_socket,
        host_volumes,
        // QEMU reads them through the descriptors the launcher opened: its user needs no way
        // to the files (a kernel under root's home, mode 0700, boots too).
        direct_kernel: fds.kernel.map(|kernel| DirectKernel {
            kernel: inherited_path(kernel),
            initrd: fds.initrd.map(inherited_path),
            cmdline: a.kernel_cmdline.clone(),
        }),
    };
    // Bound last before QEMU starts, so that the guest's first DISCOVER finds it and no step
    // that fails before QEMU leaves it serving.
    let server = dhcp::DhcpServer::bind(&net_plan.bridge, net_plan.lease.clone())?;
    let dhcp_task = tokio::spawn(server.serve());
    let spawned = spawn_qemu(a, &spec, &user, &inherited);
    drop((devices, volumes));
    let (pid, reaper, stdout) = match spawned {
        Ok(x) => x,
        Err(e) => {
            dhcp_task.abort();
            return Err(e);
        }
    };
    {
        let mut s = state.lock().await;
        s.qemu_pid = Some(pid);
        s.phase = Phase::Starting;
    }
    Ok((pid, dhcp_task, reaper, stdout))
}

/// Gives QEMU's user the disk files and records them as the VM's disks.
async fn hand_over_disks(
    disk_plan: &disk::DiskPlan,
    user: &QemuUser,
    state: &SharedState,
) -> Result<(), RunError> {
    for d in &disk_plan.attachments {
        privilege::hand_over(&d.path, user)?;
    }
    state.lock().await.disks = disk_plan.attachments.clone();
    Ok(())
}

/// The QMP and heartbeat sockets QEMU creates in the runtime directory, which is made
/// writable for QEMU's user.
fn share_sockets(
    a: &RunArgs,
    user: &QemuUser,
) -> Result<(std::path::PathBuf, std::path::PathBuf), RunError> {
    let (qmp_socket, heartbeat_socket) = (
        a.socket.runtime_dir.join("qmp.sock"),
        a.socket.runtime_dir.join("heartbeat.sock"),
    );
    privilege::share_runtime_dir(
        &a.socket.runtime_dir,
        user,
        &[&qmp_socket, &heartbeat_socket],
    )?;
    Ok((qmp_socket, heartbeat_socket))
}

/// The validated host volumes, each with the descriptor of its opened directory.
fn inherited_host_volumes(v: &Validated, volumes: &OpenedVolumes) -> Vec<HostVolume> {
    v.host_volumes
        .iter()
        .zip(volumes)
        .map(|(h, fd)| HostVolume {
            fd: Some(std::os::fd::AsRawFd::as_raw_fd(fd)),
            ..h.clone()
        })
        .collect()
}

/// The node's Ignition merged with this machine's facts (hostname, DNS, NTP, disks, host
/// volumes), written to the memory-backed secret directory for QEMU's user; none without an
/// Ignition config.
fn merge_ignition(
    a: &RunArgs,
    v: &Validated,
    disk_plan: &disk::DiskPlan,
    net_plan: &plan::NetworkPlan,
    hostname: &str,
    user: &QemuUser,
) -> Result<Option<std::path::PathBuf>, RunError> {
    let Some(src) = &a.launch.ignition else {
        return Ok(None);
    };
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
    privilege::share_secret_dir(&a.launch.secret_dir, user)?;
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
    privilege::hand_over(&dest, user)?;
    for r in &report.replaced {
        tracing::info!(
            ignition.kind = r.kind,
            ignition.name = %r.name,
            "machine fact replaces the bootstrap config's entry"
        );
    }
    Ok(Some(dest))
}

/// Starts QEMU on `spec`'s command line as `user`, with the `inherited` descriptors; its stdout
/// (the serial console) piped. The reaper owns waiting for it from here on.
fn spawn_qemu(
    a: &RunArgs,
    spec: &VmSpec,
    user: &QemuUser,
    inherited: &[i32],
) -> Result<(u32, Reaper, std::process::ChildStdout), RunError> {
    let args = argv::qemu_args(spec);
    tracing::debug!(qemu.argv = ?args.0, "qemu command line");
    let reaper = Reaper::new().map_err(|e| RunError::Runtime("watch SIGCHLD".into(), e))?;
    let mut cmd = Command::new(&a.qemu);
    cmd.args(&args.0)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    privilege::run_unprivileged(&mut cmd, user, inherited);
    tracing::info!(
        qemu.uid = user.uid,
        qemu.gid = user.gid,
        qemu.groups = ?user.groups,
        "starting qemu unprivileged"
    );
    let mut child = cmd
        .spawn()
        .map_err(|e| RunError::SpawnQemu(a.qemu.clone(), e))?;
    let pid = child.id();
    let Some(stdout) = child.stdout.take() else {
        let e = std::io::Error::other("qemu's stdout is not piped");
        return Err(RunError::Runtime("read the console".into(), e));
    };
    // Dropping Child neither waits nor kills.
    drop(child);
    Ok((pid, reaper, stdout))
}

/// What QEMU gets as open descriptors instead of paths it could not (or should not) open.
struct Devices {
    tap: std::fs::File,
    vhost: Option<std::fs::File>,
    image: Option<std::fs::File>,
    kernel: Option<std::fs::File>,
    initrd: Option<std::fs::File>,
}

/// The numbers of the [`Devices`]' descriptors, as QEMU inherits them.
struct DeviceFds {
    tap: i32,
    vhost: Option<i32>,
    image: Option<i32>,
    kernel: Option<i32>,
    initrd: Option<i32>,
}

impl Devices {
    fn fds(&self) -> DeviceFds {
        let fd = |f: Option<&std::fs::File>| f.map(std::os::fd::AsRawFd::as_raw_fd);
        DeviceFds {
            tap: std::os::fd::AsRawFd::as_raw_fd(&self.tap),
            vhost: fd(self.vhost.as_ref()),
            image: fd(self.image.as_ref()),
            kernel: fd(self.kernel.as_ref()),
            initrd: fd(self.initrd.as_ref()),
        }
    }
}

impl DeviceFds {
    /// Every descriptor, tap first.
    fn all(&self) -> impl Iterator<Item = i32> {
        [
            Some(self.tap),
            self.vhost,
            self.image,
            self.kernel,
            self.initrd,
        ]
        .into_iter()
        .flatten()
    }
}

/// The path through which a process opens the descriptor `fd` it inherited.
fn inherited_path(fd: i32) -> std::path::PathBuf {
    format!("/proc/self/fd/{fd}").into()
}

/// Opens the VM's tap, vhost-net (KVM only), node image and directly booted kernel and initrd
/// for QEMU to inherit.
fn open_devices(
    a: &RunArgs,
    net_plan: &plan::NetworkPlan,
    accel: argv::Accel,
    disk_plan: &disk::DiskPlan,
) -> Result<Devices, RunError> {
    // QEMU cannot open /dev/net/tun or /dev/vhost-net: the launcher opens them and QEMU
    // inherits the descriptors (closed here once QEMU runs). Without vhost-net the NIC still
    // works, in QEMU's own thread.
    let tap = tap::open_tap(&net_plan.tap).map_err(RunError::OpenTap)?;
    let vhost = (accel == argv::Accel::Kvm)
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
    let image = disk_plan
        .attachments
        .iter()
        .find_map(|d| d.base.as_ref())
        .map(disk::open_base)
        .transpose()?;
    let open = |what: &'static str, path: &std::path::PathBuf| {
        std::fs::File::open(path).map_err(|e| RunError::MissingFile {
            what,
            path: path.clone(),
            reason: e.to_string(),
        })
    };
    let kernel = a.kernel.as_ref().map(|k| open("kernel", k)).transpose()?;
    let initrd = a.initrd.as_ref().map(|i| open("initrd", i)).transpose()?;
    Ok(Devices {
        tap,
        vhost,
        image,
        kernel,
        initrd,
    })
}
