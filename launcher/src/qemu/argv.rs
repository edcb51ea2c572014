//! Pure QEMU command line planner.

use std::path::PathBuf;

use serde::Serialize;

use crate::net::MacAddr;

/// fw_cfg names the Ignition config is served under (the same file under each), so that every
/// guest finds it without the user choosing a name: upstream Ignition's `qemu` platform reads
/// `opt/com.coreos/config` (Fedora CoreOS, the node image of `images/node`, the test guest);
/// Flatcar's Ignition reads `opt/org.flatcar-linux/config` (its current source falls back to
/// upstream's name, but not every release need have had the fallback). QEMU reads each
/// `file=` entry into its own buffer: the second name costs one more copy of the config (at most
/// `capk_bootstrap::MAX_OUTPUT_BYTES`, 960 KiB) of QEMU's anonymous memory.
pub const IGNITION_FW_CFG_NAMES: [&str; 2] =
    ["opt/com.coreos/config", "opt/org.flatcar-linux/config"];
/// virtio-serial port name the guest's heartbeat unit writes to.
pub const HEARTBEAT_PORT: &str = "org.capk.heartbeat.0";
/// Default TCG translation cache size, MiB (QEMU's own default is 1 GiB; see `machine`): the
/// launch contract's. Enough for small guests; a Kubernetes node's programs need about 1 GiB, or
/// QEMU keeps flushing and re-translating them (`kubeadm init` then does not finish in 10 minutes).
pub const TCG_TB_SIZE_MIB: u32 = capk_api::launch::DEFAULT_TCG_TRANSLATION_CACHE_MIB;

/// The accelerator actually used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Accel {
    /// Hardware virtualisation.
    Kvm,
    /// Software emulation.
    Tcg,
}

impl Accel {
    /// QEMU's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }
}

/// Disk image formats QEMU opens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DiskFormat {
    /// qcow2.
    Qcow2,
    /// Raw.
    Raw,
}

impl DiskFormat {
    /// QEMU's name.
    pub fn as_str(self) -> &'static str {
        match self {
            DiskFormat::Qcow2 => "qcow2",
            DiskFormat::Raw => "raw",
        }
    }
}

/// One virtio-blk disk; the guest finds it as `/dev/disk/by-id/virtio-<serial>`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DiskAttachment {
    /// Serial (`rootfs`, `dockerfs`, `kubeletfs`, `etcdfs`).
    pub serial: String,
    /// Image file.
    pub path: PathBuf,
    /// Its format.
    pub format: DiskFormat,
    /// The read-only image under a qcow2 overlay (the root disk's node image).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub base: Option<BaseImage>,
}

/// The read-only base of an overlay: opened by QEMU as its own node, never through the names in
/// the overlay's or its own header.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BaseImage {
    /// Image file.
    pub path: PathBuf,
    /// Its format (always explicit: a raw image is never probed).
    pub format: DiskFormat,
}

/// The `-blockdev` of an overlay's base, in QEMU's JSON syntax: the dotted syntax cannot say
/// `backing: null` (it reads `null` as a node name). Read-only, and a qcow2 base gets no backing
/// of its own whatever its header says (the planner refuses such images before; this holds even
/// if the file changes after the check).
/// With `fd`, QEMU opens the descriptor the launcher opened (`/dev/fdset/<fd>`, added with
/// `-add-fd`): the file whose header the launcher checked, which QEMU's user need not be able to
/// open.
fn base_blockdev(node: &str, b: &BaseImage, fd: Option<i32>) -> String {
    let filename = match fd {
        Some(fd) => PathBuf::from(format!("/dev/fdset/{fd}")),
        None => b.path.clone(),
    };
    let mut v = serde_json::json!({
        "driver": b.format.as_str(),
        "node-name": node,
        "read-only": true,
        "file": { "driver": "file", "filename": filename },
    });
    if b.format == DiskFormat::Qcow2 {
        v["backing"] = serde_json::Value::Null;
    }
    v.to_string()
}

/// A host directory shared over virtio-9p.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HostVolume {
    /// 9p mount tag.
    pub tag: String,
    /// Host path.
    pub path: PathBuf,
    /// Exported read-only (9p `readonly=on`): the guest cannot change the host's files.
    pub read_only: bool,
    /// Descriptor of the directory, opened by the launcher without following links
    /// ([`crate::host_volume::open_dir`]) and inherited by QEMU, which opens it through
    /// `/proc/self/fd` instead of `path`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fd: Option<i32>,
}

/// Direct kernel boot (debugging and test guests).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DirectKernel {
    /// Kernel image.
    pub kernel: PathBuf,
    /// Initramfs.
    pub initrd: Option<PathBuf>,
    /// Command line.
    pub cmdline: Option<String>,
}

/// How TCG runs an emulated guest's vCPUs (the launch contract's `--tcg-threads`).
pub use capk_api::launch::TcgThreads;

/// Everything the VM is made of.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VmSpec {
    /// Guest name (the hostname).
    pub name: String,
    /// Accelerator.
    pub accel: Accel,
    /// TCG translation cache, MiB (used only when `accel` is TCG).
    pub tcg_tb_size_mib: u32,
    /// How TCG runs the vCPUs (used only when `accel` is TCG).
    pub tcg_threads: TcgThreads,
    /// vCPUs.
    pub vcpus: u32,
    /// Memory in MiB.
    pub memory_mib: u64,
    /// Descriptor of the tap the NIC is attached to, opened by the launcher and inherited by
    /// QEMU (which runs without the rights to open it).
    pub tap_fd: i32,
    /// Descriptor of `/dev/vhost-net`, opened by the launcher, for vhost under KVM.
    pub vhost_fd: Option<i32>,
    /// Descriptor of the node image (the root disk's base), opened read-only by the launcher.
    pub image_fd: Option<i32>,
    /// NIC MAC: the Pod's original MAC.
    pub mac: MacAddr,
    /// MTU announced to virtio-net.
    pub mtu: u32,
    /// Disks in boot order (root first).
    pub disks: Vec<DiskAttachment>,
    /// Ignition config handed over fw_cfg (under each of [`IGNITION_FW_CFG_NAMES`]).
    pub ignition: Option<PathBuf>,
    /// QMP socket (QEMU listens).
    pub qmp_socket: PathBuf,
    /// Heartbeat socket (QEMU listens, the launcher connects).
    pub heartbeat_socket: PathBuf,
    /// 9p shares.
    pub host_volumes: Vec<HostVolume>,
    /// Direct kernel boot instead of the disk's bootloader.
    pub direct_kernel: Option<DirectKernel>,
}

/// The argument vector, without the program name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct QemuArgs(pub Vec<String>);

fn p(path: &std::path::Path) -> String {
    // QEMU's option parser splits on commas; a doubled comma is a literal one.
    path.display().to_string().replace(',', ",,")
}

/// Plans QEMU's argv for `spec`.
pub fn qemu_args(spec: &VmSpec) -> QemuArgs {
    let mut a = Argv::default();
    machine(&mut a, spec);
    process_behaviour(&mut a);
    console_and_qmp(&mut a, spec);
    sandbox(&mut a);
    nic(&mut a, spec);
    for (i, d) in spec.disks.iter().enumerate() {
        disk(&mut a, spec, i, d);
    }
    entropy_and_panic_devices(&mut a);
    heartbeat_port(&mut a, spec);
    for v in &spec.host_volumes {
        host_volume(&mut a, v);
    }
    ignition(&mut a, spec);
    direct_kernel(&mut a, spec);
    QemuArgs(a.0)
}

/// QEMU's argv as it is built: options in the order they are added.
#[derive(Default)]
struct Argv(Vec<String>);

impl Argv {
    /// An option and its value.
    fn opt(&mut self, option: &str, value: impl Into<String>) {
        self.0.push(option.to_owned());
        self.0.push(value.into());
    }

    /// An option without a value.
    fn flag(&mut self, option: &str) {
        self.0.push(option.to_owned());
    }
}

/// Name, machine type, accelerator, CPU model, vCPUs and memory.
fn machine(a: &mut Argv, spec: &VmSpec) {
    a.opt(
        "-name",
        format!("guest={},debug-threads=on", spec.name.replace(',', ",,")),
    );
    a.opt("-machine", "q35");
    // TCG's translation cache defaults to 1 GiB and grows into the Pod's memory as the guest
    // runs new code; the bound (the controller's `--tcg-translation-cache-mib`, counted in the
    // Pod's memory overhead) keeps QEMU inside the machine Pod's allowance.
    a.opt(
        "-accel",
        match spec.accel {
            Accel::Tcg => format!(
                "tcg,tb-size={},thread={}",
                spec.tcg_tb_size_mib,
                spec.tcg_threads.as_str()
            ),
            _ => spec.accel.as_str().to_owned(),
        },
    );
    if spec.accel == Accel::Kvm {
        a.opt("-cpu", "host,pmu=off");
    } else {
        a.opt("-cpu", "max");
    }
    a.opt("-smp", spec.vcpus.to_string());
    a.opt("-m", format!("{}M", spec.memory_mib));
}

/// How QEMU behaves as a process: exit status, no default devices or user config, no display.
fn process_behaviour(a: &mut Argv) {
    // A guest panic or QEMU-level failure ends the process with a failure status.
    a.opt("-action", "panic=exit-failure");
    a.flag("-nodefaults");
    a.flag("-no-user-config");
    a.opt("-display", "none");
    a.opt("-msg", "timestamp=on");
}

/// The serial console on stdout and the QMP monitor socket.
fn console_and_qmp(a: &mut Argv, spec: &VmSpec) {
    // Serial console on QEMU's stdout, a pipe to the launcher: it copies it to its own stdout
    // (kubectl logs) and to a size-capped file (`console`). QEMU's `logfile=` would only append.
    a.opt("-chardev", "stdio,id=console,signal=off");
    a.opt("-serial", "chardev:console");
    a.opt(
        "-chardev",
        format!(
            "socket,id=qmp,path={},server=on,wait=off",
            p(&spec.qmp_socket)
        ),
    );
    a.opt("-mon", "chardev=qmp,mode=control");
}

/// QEMU's seccomp filter: no exec or fork, no set*id or capability changes, no obsolete
/// system calls, no scheduler/affinity changes. QEMU starts without privileges (see
/// `qemu::privilege`); this keeps a compromised QEMU from doing more with the rest.
fn sandbox(a: &mut Argv) {
    a.opt(
        "-sandbox",
        "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
    );
}

/// The virtio NIC on the tap (and vhost-net), both as descriptors: QEMU cannot open
/// /dev/net/tun itself.
fn nic(a: &mut Argv, spec: &VmSpec) {
    let vhost = match (spec.accel, spec.vhost_fd) {
        (Accel::Kvm, Some(fd)) => format!(",vhost=on,vhostfd={fd}"),
        _ => String::new(),
    };
    a.opt("-netdev", format!("tap,id=net0,fd={}{vhost}", spec.tap_fd));
    a.opt(
        "-device",
        format!(
            "virtio-net-pci,netdev=net0,mac={},host_mtu={}",
            spec.mac, spec.mtu
        ),
    );
}

/// The `index`th disk: its base (if any), its own node, and its virtio-blk device; the first
/// disk boots unless a kernel is booted directly.
fn disk(a: &mut Argv, spec: &VmSpec, index: usize, d: &DiskAttachment) {
    let id = format!("disk-{}", d.serial);
    let backing = match &d.base {
        Some(b) => {
            let base = format!("base-{}", d.serial);
            if let Some(fd) = spec.image_fd {
                a.opt("-add-fd", format!("fd={fd},set={fd}"));
            }
            a.opt("-blockdev", base_blockdev(&base, b, spec.image_fd));
            format!(",backing={base}")
        }
        None => String::new(),
    };
    a.opt(
        "-blockdev",
        format!(
            "driver={},node-name={id},discard=unmap,file.driver=file,file.filename={}{backing}",
            d.format.as_str(),
            p(&d.path)
        ),
    );
    let boot = if index == 0 && spec.direct_kernel.is_none() {
        ",bootindex=0"
    } else {
        ""
    };
    a.opt(
        "-device",
        format!(
            "virtio-blk-pci,drive={id},num-queues=1,serial={}{boot}",
            d.serial
        ),
    );
}

/// The guest's entropy source and the pvpanic device.
fn entropy_and_panic_devices(a: &mut Argv) {
    a.opt("-object", "rng-random,id=rng0,filename=/dev/urandom");
    a.opt("-device", "virtio-rng-pci,rng=rng0");
    a.opt("-device", "pvpanic-pci");
}

/// The virtio-serial port the guest's heartbeat unit writes to, on a socket QEMU listens on.
fn heartbeat_port(a: &mut Argv, spec: &VmSpec) {
    // QEMU's main loop polls the notifier of every virtqueue each time it wakes (and under TCG
    // every guest timer interrupt wakes it: thousands of times a second on a busy node), so the
    // devices get only the queues they use: one per disk (no iothreads here, so more queues are
    // processed by the same thread anyway), and a virtio-serial bus with room for the heartbeat
    // port only (port 0 is reserved for a console; QEMU's default of 31 ports is 64 queues, two
    // thirds of all the notifiers a node had).
    a.opt("-device", "virtio-serial-pci,id=vser0,max_ports=2");
    a.opt(
        "-chardev",
        format!(
            "socket,id=heartbeat,path={},server=on,wait=off",
            p(&spec.heartbeat_socket)
        ),
    );
    a.opt(
        "-device",
        format!("virtserialport,bus=vser0.0,chardev=heartbeat,name={HEARTBEAT_PORT}"),
    );
}

/// One 9p share.
///
/// security_model=mapped-xattr: whatever the guest makes is a plain file or directory of
/// QEMU's (unprivileged) user on the host, mode 0600 or 0700; the owners, modes and kinds
/// the guest asked for live in `user.virtfs.*` extended attributes, which the guest can
/// neither read nor set. So a guest's symlink is a file holding the target's name, not a
/// link the kubelet, the launcher or anything else on the node could follow, and a guest
/// makes no device nodes, FIFOs or set-id files there. Files made on the host keep their
/// owners and modes; the guest sees those, and QEMU's user is what the host enforces.
fn host_volume(a: &mut Argv, v: &HostVolume) {
    let ro = if v.read_only { ",readonly=on" } else { "" };
    let path =
        v.fd.map(crate::host_volume::qemu_path)
            .unwrap_or_else(|| v.path.clone());
    a.opt(
        "-fsdev",
        format!(
            "local,id=fs-{0},path={1},security_model=mapped-xattr{ro}",
            v.tag,
            p(&path)
        ),
    );
    a.opt(
        "-device",
        format!("virtio-9p-pci,fsdev=fs-{0},mount_tag={0}", v.tag),
    );
}

/// The Ignition config over fw_cfg, under each of [`IGNITION_FW_CFG_NAMES`].
fn ignition(a: &mut Argv, spec: &VmSpec) {
    if let Some(ign) = &spec.ignition {
        for name in IGNITION_FW_CFG_NAMES {
            a.opt("-fw_cfg", format!("name={name},file={}", p(ign)));
        }
    }
}

/// Kernel, initramfs and command line of a direct kernel boot.
fn direct_kernel(a: &mut Argv, spec: &VmSpec) {
    if let Some(k) = &spec.direct_kernel {
        a.opt("-kernel", k.kernel.display().to_string());
        if let Some(i) = &k.initrd {
            a.opt("-initrd", i.display().to_string());
        }
        if let Some(c) = &k.cmdline {
            a.opt("-append", c.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(accel: Accel) -> VmSpec {
        VmSpec {
            name: "wc1-cp-x7k2p".into(),
            accel,
            tcg_tb_size_mib: TCG_TB_SIZE_MIB,
            tcg_threads: TcgThreads::Single,
            vcpus: 4,
            memory_mib: 8192,
            tap_fd: 3,
            vhost_fd: Some(4),
            image_fd: Some(5),
            mac: "9a:1c:3e:aa:bb:cc".parse().unwrap(),
            mtu: 1440,
            disks: vec![
                DiskAttachment {
                    serial: "rootfs".into(),
                    path: "/var/lib/capk/root.qcow2".into(),
                    format: DiskFormat::Qcow2,
                    base: Some(BaseImage {
                        path: "/images/flatcar.qcow2".into(),
                        format: DiskFormat::Qcow2,
                    }),
                },
                DiskAttachment {
                    serial: "dockerfs".into(),
                    path: "/var/lib/capk/docker.img".into(),
                    format: DiskFormat::Raw,
                    base: None,
                },
                DiskAttachment {
                    serial: "etcdfs".into(),
                    path: "/var/lib/etcd-disk/etcd.img".into(),
                    format: DiskFormat::Raw,
                    base: None,
                },
            ],
            ignition: Some("/run/capk-secret/ignition.json".into()),
            qmp_socket: "/run/capk/qmp.sock".into(),
            heartbeat_socket: "/run/capk/heartbeat.sock".into(),
            host_volumes: vec![
                HostVolume {
                    tag: "data".into(),
                    path: "/var/lib/capk/host-volumes/data".into(),
                    read_only: false,
                    fd: Some(6),
                },
                HostVolume {
                    tag: "config".into(),
                    path: "/srv/config".into(),
                    read_only: true,
                    fd: None,
                },
            ],
            direct_kernel: None,
        }
    }

    #[test]
    fn kvm_control_plane_with_ignition_and_data_disks() {
        insta::assert_yaml_snapshot!(qemu_args(&spec(Accel::Kvm)).0);
    }

    /// QEMU gets the tap as a descriptor (never by name: it could not open it), runs under its
    /// seccomp sandbox, gets a host volume the launcher opened as a descriptor too, keeps what
    /// guests make in a share as data (`mapped-xattr`: a guest's symlink is no link on the
    /// host) and exports a read-only host volume read-only.
    #[test]
    fn qemu_gets_descriptors_a_sandbox_and_read_only_shares() {
        let a = qemu_args(&spec(Accel::Kvm)).0;
        let after = |flag: &str| -> Vec<&str> {
            a.windows(2)
                .filter(|w| w[0] == flag)
                .map(|w| w[1].as_str())
                .collect()
        };
        assert_eq!(after("-netdev"), ["tap,id=net0,fd=3,vhost=on,vhostfd=4"]);
        assert_eq!(
            after("-sandbox"),
            ["on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"]
        );
        assert_eq!(
            after("-fsdev"),
            [
                "local,id=fs-data,path=/proc/self/fd/6,security_model=mapped-xattr",
                "local,id=fs-config,path=/srv/config,security_model=mapped-xattr,readonly=on",
            ]
        );
        let mut s = spec(Accel::Tcg);
        s.vhost_fd = None;
        assert!(qemu_args(&s).0.contains(&"tap,id=net0,fd=3".to_owned()));
    }

    #[test]
    fn tcg_never_asks_for_host_cpu_or_vhost() {
        let a = qemu_args(&spec(Accel::Tcg)).0;
        assert!(a.contains(&format!("tcg,tb-size={TCG_TB_SIZE_MIB},thread=single")));
        assert!(
            !a.iter()
                .any(|x| x.contains("host,pmu") || x.contains("vhost"))
        );
    }

    #[test]
    fn the_translation_cache_size_is_the_specs() {
        let mut s = spec(Accel::Tcg);
        s.tcg_tb_size_mib = 1024;
        assert!(
            qemu_args(&s)
                .0
                .contains(&"tcg,tb-size=1024,thread=single".to_owned())
        );
        s.tcg_threads = TcgThreads::Multi;
        assert!(
            qemu_args(&s)
                .0
                .contains(&"tcg,tb-size=1024,thread=multi".to_owned())
        );
        s.accel = Accel::Kvm;
        assert!(!qemu_args(&s).0.iter().any(|x| x.contains("tb-size")));
    }

    /// One config, served under upstream Ignition's and Flatcar's fw_cfg names: a guest of
    /// either kind finds it, and nobody has to choose the name.
    #[test]
    fn ignition_is_served_under_upstream_and_flatcar_names() {
        let a = qemu_args(&spec(Accel::Kvm)).0;
        let fw_cfg: Vec<&str> = a
            .windows(2)
            .filter(|w| w[0] == "-fw_cfg")
            .map(|w| w[1].as_str())
            .collect();
        assert_eq!(
            fw_cfg,
            [
                "name=opt/com.coreos/config,file=/run/capk-secret/ignition.json",
                "name=opt/org.flatcar-linux/config,file=/run/capk-secret/ignition.json",
            ]
        );
    }

    #[test]
    fn direct_kernel_boot_and_commas_in_paths() {
        let mut s = spec(Accel::Tcg);
        s.disks.truncate(1);
        s.disks[0].path = "/tmp/a,b/root.qcow2".into();
        s.ignition = None;
        s.host_volumes.clear();
        s.direct_kernel = Some(DirectKernel {
            kernel: "/guest/vmlinuz".into(),
            initrd: Some("/guest/initrd.img".into()),
            cmdline: Some("console=ttyS0 quiet".into()),
        });
        insta::assert_yaml_snapshot!(qemu_args(&s).0);
    }
}
