//! `run`'s checks before anything changes: the flags ([`validate`], pure) and the files,
//! devices and network namespace ([`preflight`]).

use std::path::Path;

use crate::cli::RunArgs;
use crate::host_volume::{self, HostVolumeError};
use crate::net::netns::{self, NetnsKind};
use crate::net::plan::GuestNaming;
use crate::net::{resolv, tap};
use crate::qemu::argv::{DiskFormat, HostVolume};

use super::RunError;

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
pub(super) fn memory_backed(dir: &Path) -> bool {
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
pub(super) type OpenedVolumes = Vec<std::os::fd::OwnedFd>;

/// Checks files and devices before anything is changed; opens the host volumes' directories.
pub(super) fn preflight(a: &RunArgs, v: &Validated) -> Result<OpenedVolumes, RunError> {
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
