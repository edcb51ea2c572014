//! The launch contract: what the controller decides for one machine's VM (resources, disks,
//! shares, the guest's network settings, where the Pod's volumes are), as types with their bounds.
//! The controller fills a [`Launch`] and renders it with [`Launch::to_args`] into the machine
//! Pod's `capk-launcher run` arguments; the launcher's command line parses those arguments straight
//! back into a [`Launch`] (feature `cli`) and checks it with [`Launch::check`], which the
//! controller's tests hold every Pod it builds to. A field added here is a flag on both sides:
//! the launcher's test that a rendered contract parses back to itself fails when one side lacks
//! it. What only the launcher's host decides (QEMU's binary and user, the runtime directory, a
//! kernel to boot directly) is not part of it.

use std::fmt;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::str::FromStr;

use crate::byte_size::ByteSize;
use crate::etcd_owner::{DISK_FILE, EtcdOwner};
use crate::limits::{MAX_VCPUS, MIN_DISK, MIN_MEMORY, MIN_VCPUS};

/// The TCG translation cache QEMU gets when nothing else is asked, MiB (QEMU's memory beyond the
/// guest's when the guest is emulated).
pub const DEFAULT_TCG_TRANSLATION_CACHE_MIB: u32 = 128;
/// The largest TCG translation cache a machine may ask for, MiB.
pub const MAX_TCG_TRANSLATION_CACHE_MIB: u32 = 4096;
/// The smallest TCG translation cache a machine may ask for, MiB.
pub const MIN_TCG_TRANSLATION_CACHE_MIB: u32 = 32;
/// Seconds between the ACPI power button and killing QEMU when nothing else is asked.
pub const DEFAULT_GRACE_PERIOD_SECONDS: u64 = 300;

/// Role of the machine in its cluster.
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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

/// Hardware accelerator choice.
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accel {
    /// KVM when a probe vCPU really runs, else TCG with a warning.
    Auto,
    /// KVM or fail.
    Kvm,
    /// Software emulation.
    Tcg,
}

impl Accel {
    /// The flag's value.
    pub fn as_str(self) -> &'static str {
        match self {
            Accel::Auto => "auto",
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }
}

/// How TCG runs an emulated guest's vCPUs.
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum TcgThreads {
    /// One host thread takes turns running every vCPU: a VM never uses more than one host core,
    /// and no vCPU waits on a lock another vCPU's preempted thread holds (docs/benchmarks.md,
    /// "Levers tried on an idle emulated control plane"); a 2-vCPU control plane then boots too
    /// slowly for kubeadm.
    Single,
    /// One host thread per vCPU (QEMU's default on x86, and the launcher's).
    Multi,
}

impl TcgThreads {
    /// The flag's value, also QEMU's `-accel tcg,thread=` value.
    pub fn as_str(self) -> &'static str {
        match self {
            TcgThreads::Single => "single",
            TcgThreads::Multi => "multi",
        }
    }
}

/// A host directory shared into the guest over virtio-9p: `TAG=PATH` on the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Share {
    /// The 9p mount tag the guest mounts it by.
    pub tag: String,
    /// The directory, as the launcher's container sees it.
    pub path: PathBuf,
}

/// A command-line share that is not `TAG=PATH`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not TAG=PATH")]
pub struct NotTagPath(pub String);

impl FromStr for Share {
    type Err = NotTagPath;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (tag, path) = s.split_once('=').ok_or_else(|| NotTagPath(s.to_owned()))?;
        Ok(Share {
            tag: tag.to_owned(),
            path: path.into(),
        })
    }
}

impl fmt::Display for Share {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}={}", self.tag, self.path.display())
    }
}

/// A value of the contract the launcher must not run: the flag and why, one line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid --{flag}: {reason}")]
pub struct Invalid {
    /// The flag, without its dashes.
    pub flag: &'static str,
    /// Why.
    pub reason: String,
}

/// What the controller decides for one machine's VM: the `capk-launcher run` flags it renders.
/// The defaults are the launcher's when run by hand (tests, debugging); the controller renders
/// every field it sets.
#[cfg_attr(feature = "cli", derive(clap::Args))]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    /// Number of vCPUs.
    #[cfg_attr(feature = "cli", arg(long, env = "CAPK_VCPUS", default_value_t = 2))]
    pub vcpus: u32,
    /// Guest memory (Kubernetes quantity, e.g. 8Gi).
    #[cfg_attr(feature = "cli", arg(long, env = "CAPK_MEMORY", default_value = "2Gi"))]
    pub memory: ByteSize,
    /// Node image (read-only base of the root disk's qcow2 overlay).
    #[cfg_attr(feature = "cli", arg(long, env = "CAPK_IMAGE"))]
    pub image: PathBuf,
    /// Size the root disk is grown to (never shrunk below the image's size).
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "CAPK_DISK_SIZE", default_value = "20Gi")
    )]
    pub disk_size: ByteSize,
    /// containerd ("docker") disk size; 0 leaves it out.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "CAPK_DOCKER_DISK_SIZE", default_value = "0")
    )]
    pub docker_disk_size: ByteSize,
    /// kubelet disk size; 0 leaves it out.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "CAPK_KUBELET_DISK_SIZE", default_value = "0")
    )]
    pub kubelet_disk_size: ByteSize,
    /// etcd disk file on persistent storage: created once, never recreated or re-formatted.
    #[cfg_attr(feature = "cli", arg(long, env = "CAPK_ETCD_DISK"))]
    pub etcd_disk: Option<PathBuf>,
    /// Size of the etcd disk when it is created.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "CAPK_ETCD_DISK_SIZE", default_value = "10Gi")
    )]
    pub etcd_disk_size: ByteSize,
    /// The KVMMachine the etcd disk belongs to, `<namespace>/<name>/<uid>` (required with
    /// --etcd-disk): its directory is marked for it when the disk is created, and a directory
    /// marked for another KVMMachine, or a disk without a marker, is refused.
    #[cfg_attr(feature = "cli", arg(long, env = "CAPK_ETCD_OWNER"))]
    pub etcd_owner: Option<EtcdOwner>,
    /// Host directory shared into the guest over virtio-9p, as TAG=PATH (repeatable). No
    /// element of PATH may be a symbolic link (refused before QEMU starts). QEMU reads and
    /// writes it as its own user, and keeps what the guest makes as its own files of mode
    /// 0600/0700 with the guest's owners, modes and links in `user.virtfs.*` extended
    /// attributes (9p security_model=mapped-xattr): the directory must be readable by
    /// --qemu-uid/--qemu-gid, writable by them for the guest to write (e.g. owned by 107:107),
    /// and on a filesystem with user extended attributes (ext4, xfs, btrfs; refused otherwise).
    #[cfg_attr(
        feature = "cli",
        arg(long = "host-volume", env = "CAPK_HOST_VOLUMES", value_delimiter = ',')
    )]
    pub host_volumes: Vec<Share>,
    /// Host directory shared into the guest read-only, as TAG=PATH (repeatable): 9p
    /// readonly=on and a read-only mount in the guest. No element of PATH may be a symbolic
    /// link; the directory must be readable by --qemu-uid/--qemu-gid.
    #[cfg_attr(
        feature = "cli",
        arg(
            long = "host-volume-readonly",
            env = "CAPK_HOST_VOLUMES_READONLY",
            value_delimiter = ','
        )
    )]
    pub host_volumes_readonly: Vec<Share>,
    /// Directory for the root overlay and the data disks (a Pod volume, so they survive restarts).
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "CAPK_STATE_DIR", default_value = "/var/lib/capk")
    )]
    pub state_dir: PathBuf,
    /// Directory on a memory-backed volume (the machine Pod's `medium: Memory` emptyDir) the
    /// merged Ignition config is written to for QEMU. It holds bootstrap secrets (a first control
    /// plane's CA keys), so it must not be on the node's disk; the file is removed once QMP
    /// answers (QEMU has read it by then).
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "CAPK_SECRET_DIR", default_value = "/run/capk-secret")
    )]
    pub secret_dir: PathBuf,
    /// Ignition config file (mounted from the machine's Secret).
    #[cfg_attr(feature = "cli", arg(long, env = "CAPK_IGNITION_FILE"))]
    pub ignition: Option<PathBuf>,
    /// Accelerator.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "CAPK_ACCEL", value_enum, default_value_t = Accel::Auto)
    )]
    pub accel: Accel,
    /// TCG translation cache, MiB, when the guest is emulated: QEMU's memory beyond the guest's.
    /// A Kubernetes node needs about 1024; small guests run in the default.
    #[cfg_attr(
        feature = "cli",
        arg(
            long,
            env = "CAPK_TCG_TRANSLATION_CACHE_MIB",
            default_value_t = DEFAULT_TCG_TRANSLATION_CACHE_MIB,
            value_parser = clap::value_parser!(u32)
                .range(i64::from(MIN_TCG_TRANSLATION_CACHE_MIB)..=i64::from(MAX_TCG_TRANSLATION_CACHE_MIB))
        )
    )]
    pub tcg_translation_cache_mib: u32,
    /// How an emulated guest's vCPUs run: `multi` (a thread per vCPU, QEMU's default) or
    /// `single` (one host thread for all of them, so a VM uses at most one host core).
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "CAPK_TCG_THREADS", value_enum, default_value_t = TcgThreads::Multi)
    )]
    pub tcg_threads: TcgThreads,
    /// DNS servers for the guest (default: the Pod's resolv.conf).
    #[cfg_attr(
        feature = "cli",
        arg(long = "dns", env = "CAPK_DNS_SERVERS", value_delimiter = ',')
    )]
    pub dns_servers: Vec<Ipv4Addr>,
    /// DNS search domains for the guest (default: the Pod's resolv.conf).
    #[cfg_attr(
        feature = "cli",
        arg(long = "dns-search", env = "CAPK_DNS_SEARCH", value_delimiter = ',')
    )]
    pub dns_search: Vec<String>,
    /// NTP servers for the guest.
    #[cfg_attr(
        feature = "cli",
        arg(long = "ntp", env = "CAPK_NTP_SERVERS", value_delimiter = ',')
    )]
    pub ntp_servers: Vec<Ipv4Addr>,
    /// Guest hostname (default: this Pod's hostname).
    #[cfg_attr(feature = "cli", arg(long, env = "CAPK_HOSTNAME"))]
    pub hostname: Option<String>,
    /// Machine role.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "CAPK_ROLE", value_enum, default_value_t = Role::Worker)
    )]
    pub role: Role,
    /// Seconds between ACPI powerdown and killing QEMU on SIGTERM.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "CAPK_SHUTDOWN_GRACE_SECONDS", default_value_t = DEFAULT_GRACE_PERIOD_SECONDS)
    )]
    pub grace_period_seconds: u64,
}

impl Launch {
    /// The `capk-launcher run` arguments (after `run`) that parse back into this contract: every
    /// value, except an absent option, an empty list, and the etcd disk's size without the disk.
    pub fn to_args(&self) -> Vec<String> {
        let mut args = vec![
            format!("--vcpus={}", self.vcpus),
            format!("--memory={}", self.memory),
            format!("--image={}", self.image.display()),
            format!("--disk-size={}", self.disk_size),
            format!("--docker-disk-size={}", self.docker_disk_size),
            format!("--kubelet-disk-size={}", self.kubelet_disk_size),
        ];
        if let Some(disk) = &self.etcd_disk {
            args.push(format!("--etcd-disk={}", disk.display()));
            args.push(format!("--etcd-disk-size={}", self.etcd_disk_size));
        }
        if let Some(owner) = &self.etcd_owner {
            args.push(format!("--etcd-owner={owner}"));
        }
        args.extend(
            self.host_volumes
                .iter()
                .map(|s| format!("--host-volume={s}")),
        );
        args.extend(
            self.host_volumes_readonly
                .iter()
                .map(|s| format!("--host-volume-readonly={s}")),
        );
        args.push(format!("--state-dir={}", self.state_dir.display()));
        args.push(format!("--secret-dir={}", self.secret_dir.display()));
        if let Some(ignition) = &self.ignition {
            args.push(format!("--ignition={}", ignition.display()));
        }
        args.push(format!("--accel={}", self.accel.as_str()));
        args.push(format!(
            "--tcg-translation-cache-mib={}",
            self.tcg_translation_cache_mib
        ));
        args.push(format!("--tcg-threads={}", self.tcg_threads.as_str()));
        args.extend(self.dns_servers.iter().map(|s| format!("--dns={s}")));
        args.extend(self.dns_search.iter().map(|s| format!("--dns-search={s}")));
        args.extend(self.ntp_servers.iter().map(|s| format!("--ntp={s}")));
        if let Some(hostname) = &self.hostname {
            args.push(format!("--hostname={hostname}"));
        }
        args.push(format!("--role={}", self.role.as_str()));
        args.push(format!(
            "--grace-period-seconds={}",
            self.grace_period_seconds
        ));
        args
    }

    /// Checks what needs no I/O: the machine limits, the etcd disk's name and owner, the
    /// hostname, the shares' tags and paths. The launcher refuses a contract that fails it; the
    /// controller never renders one.
    pub fn check(&self) -> Result<(), Invalid> {
        let invalid = |flag, reason: String| Invalid { flag, reason };
        if !(MIN_VCPUS..=MAX_VCPUS).contains(&self.vcpus) {
            return Err(invalid(
                "vcpus",
                format!("must be between {MIN_VCPUS} and {MAX_VCPUS}"),
            ));
        }
        if self.memory.0 < MIN_MEMORY.bytes {
            return Err(invalid(
                "memory",
                format!("must be at least {}", MIN_MEMORY.quantity),
            ));
        }
        if self.disk_size.0 < MIN_DISK.bytes {
            return Err(invalid(
                "disk-size",
                format!("must be at least {}", MIN_DISK.quantity),
            ));
        }
        if !(MIN_TCG_TRANSLATION_CACHE_MIB..=MAX_TCG_TRANSLATION_CACHE_MIB)
            .contains(&self.tcg_translation_cache_mib)
        {
            return Err(invalid(
                "tcg-translation-cache-mib",
                format!(
                    "must be between {MIN_TCG_TRANSLATION_CACHE_MIB} and \
                     {MAX_TCG_TRANSLATION_CACHE_MIB}"
                ),
            ));
        }
        if let Some(disk) = &self.etcd_disk {
            if self.etcd_disk_size.0 == 0 {
                return Err(invalid("etcd-disk-size", "must be larger than 0".into()));
            }
            // The cleanup removes exactly the disk it knows by name, and only where the marker is.
            if disk.file_name().and_then(|n| n.to_str()) != Some(DISK_FILE) {
                return Err(invalid(
                    "etcd-disk",
                    format!("must be a file named {DISK_FILE} in a directory of its own"),
                ));
            }
            if self.etcd_owner.is_none() {
                return Err(invalid(
                    "etcd-owner",
                    "is required with --etcd-disk: the KVMMachine \
                     (<namespace>/<name>/<uid>) whose directory it is"
                        .into(),
                ));
            }
        }
        if let Some(h) = &self.hostname
            && !crate::dns::is_subdomain(h)
        {
            return Err(invalid(
                "hostname",
                "must be a DNS name of labels [a-z0-9-], at most 253 characters".into(),
            ));
        }
        let mut tags: Vec<&str> = Vec::new();
        for (flag, shares) in [
            ("host-volume", &self.host_volumes),
            ("host-volume-readonly", &self.host_volumes_readonly),
        ] {
            for s in shares {
                if let Err(e) = crate::mount_tag::check(&s.tag) {
                    return Err(invalid(flag, e.to_string()));
                }
                if !s.path.is_absolute() {
                    return Err(invalid(
                        flag,
                        format!("path {:?} must be absolute", s.path.display().to_string()),
                    ));
                }
                if tags.contains(&s.tag.as_str()) {
                    return Err(invalid(
                        flag,
                        format!("mount tag {:?} is used twice", s.tag),
                    ));
                }
                tags.push(&s.tag);
            }
        }
        Ok(())
    }

    /// The shares with whether each is read-only, read-write ones first.
    pub fn shares(&self) -> impl Iterator<Item = (&Share, bool)> {
        let rw = self.host_volumes.iter().map(|s| (s, false));
        rw.chain(self.host_volumes_readonly.iter().map(|s| (s, true)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn launch() -> Launch {
        Launch {
            vcpus: 2,
            memory: ByteSize::gib(2),
            image: "/var/lib/capk/image/disk/image.qcow2".into(),
            disk_size: ByteSize::gib(20),
            docker_disk_size: ByteSize(0),
            kubelet_disk_size: ByteSize(0),
            etcd_disk: None,
            etcd_disk_size: ByteSize::gib(10),
            etcd_owner: None,
            host_volumes: vec![],
            host_volumes_readonly: vec![],
            state_dir: "/var/lib/capk".into(),
            secret_dir: "/run/capk-secret".into(),
            ignition: None,
            accel: Accel::Auto,
            tcg_translation_cache_mib: DEFAULT_TCG_TRANSLATION_CACHE_MIB,
            tcg_threads: TcgThreads::Multi,
            dns_servers: vec![],
            dns_search: vec![],
            ntp_servers: vec![],
            hostname: None,
            role: Role::Worker,
            grace_period_seconds: DEFAULT_GRACE_PERIOD_SECONDS,
        }
    }

    #[test]
    fn the_limits_are_the_shared_ones() {
        let with = |f: fn(&mut Launch)| {
            let mut l = launch();
            f(&mut l);
            l.check().map_err(|e| e.to_string())
        };
        assert_eq!(with(|l| l.vcpus = MIN_VCPUS), Ok(()));
        assert_eq!(with(|l| l.vcpus = MAX_VCPUS), Ok(()));
        assert_eq!(with(|l| l.memory = ByteSize(MIN_MEMORY.bytes)), Ok(()));
        assert_eq!(with(|l| l.disk_size = ByteSize(MIN_DISK.bytes)), Ok(()));
        assert_eq!(
            with(|l| l.vcpus = MAX_VCPUS + 1),
            Err("invalid --vcpus: must be between 1 and 255".into())
        );
        assert_eq!(
            with(|l| l.memory = ByteSize(MIN_MEMORY.bytes - 1)),
            Err("invalid --memory: must be at least 256Mi".into())
        );
        assert_eq!(
            with(|l| l.disk_size = ByteSize(MIN_DISK.bytes - 1)),
            Err("invalid --disk-size: must be at least 1Gi".into())
        );
    }

    #[test]
    fn shares_are_tag_and_absolute_path_once_each() {
        let share = |s: &str| s.parse::<Share>().unwrap();
        assert_eq!(
            "data".parse::<Share>().unwrap_err().to_string(),
            "\"data\" is not TAG=PATH"
        );
        assert_eq!(share("d=/srv/a=b").path, PathBuf::from("/srv/a=b"));
        let mut l = launch();
        l.host_volumes = vec![share("d=rel")];
        assert_eq!(
            l.check().unwrap_err().to_string(),
            "invalid --host-volume: path \"rel\" must be absolute"
        );
        l.host_volumes = vec![share("d=/a")];
        l.host_volumes_readonly = vec![share("d=/b")];
        assert_eq!(
            l.check().unwrap_err().to_string(),
            "invalid --host-volume-readonly: mount tag \"d\" is used twice"
        );
        l.host_volumes_readonly = vec![share("cfg=/etc/cfg")];
        assert!(l.check().is_ok());
        assert_eq!(
            l.shares()
                .map(|(s, ro)| (s.tag.as_str(), ro))
                .collect::<Vec<_>>(),
            [("d", false), ("cfg", true)]
        );
    }

    #[test]
    fn absent_options_and_empty_lists_are_left_out_of_the_arguments() {
        let args = launch().to_args();
        for flag in [
            "--etcd-disk=",
            "--etcd-owner",
            "--host-volume",
            "--ignition",
            "--dns",
            "--ntp",
            "--hostname",
        ] {
            assert!(
                !args.iter().any(|a| a.starts_with(flag)),
                "{flag} in {args:?}"
            );
        }
        assert!(args.contains(&"--memory=2Gi".to_owned()), "{args:?}");
        assert!(args.contains(&"--role=worker".to_owned()), "{args:?}");
    }
}
