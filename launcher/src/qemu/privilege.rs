//! QEMU runs unprivileged: KubeVirt's non-root QEMU is what contained its path bugs (CVE-2022-1798:
//! a path traversal read host files only as far as its uid 107 could). The launcher keeps root for setup (netlink, the tap, DHCP on the bridge, disks) and the
//! QEMU child, between fork and exec, gives up everything: supplementary groups set to the
//! `/dev/kvm` group only, gid and uid set to the QEMU user (KubeVirt's 107:107 by default), the
//! capability bounding set dropped, ambient and inheritable capabilities cleared (setuid from
//! root clears effective and permitted), and `no_new_privs` set so no exec regains any.
//!
//! What QEMU opens must be usable by that user: the launcher hands over the tap (and vhost-net)
//! as descriptors, and gives the user the files QEMU writes ([`hand_over`]) and a runtime
//! directory it may create its sockets in ([`share_runtime_dir`]).
#![allow(unsafe_code)]

use std::io;
use std::os::fd::RawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use capk_api::file_error::FileError;
use nix::libc;

/// KubeVirt's qemu user and group: the default for `--qemu-uid` / `--qemu-gid`.
pub const DEFAULT_QEMU_ID: u32 = 107;
/// The KVM device: its group becomes QEMU's supplementary group.
pub const KVM_DEVICE: &str = "/dev/kvm";

/// Who QEMU runs as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QemuUser {
    /// User id.
    pub uid: u32,
    /// Group id.
    pub gid: u32,
    /// Supplementary groups (the `/dev/kvm` group, when there is one).
    pub groups: Vec<u32>,
}

impl QemuUser {
    /// The user from the flags, with the group of the KVM device (`kvm_gid`, when it exists)
    /// as its only supplementary group. Group 0 is never added: root's group may read more
    /// than `/dev/kvm` (a `root:root 0666` device needs no group).
    pub fn plan(uid: u32, gid: u32, kvm_gid: Option<u32>) -> Self {
        QemuUser {
            uid,
            gid,
            groups: kvm_gid
                .filter(|g| *g != 0 && *g != gid)
                .into_iter()
                .collect(),
        }
    }
}

/// The group of `/dev/kvm`, when it exists.
pub fn kvm_device_group() -> Option<u32> {
    std::fs::metadata(KVM_DEVICE).ok().map(|m| m.gid())
}

/// `struct __user_cap_header_struct` of capset(2).
#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

/// `struct __user_cap_data_struct` of capset(2) (two of them for 64 capabilities).
#[repr(C)]
#[derive(Clone, Copy)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// `_LINUX_CAPABILITY_VERSION_3`: 64-bit capability sets in two `CapData`.
const CAP_VERSION_3: u32 = 0x2008_0522;
/// Capability numbers are below 64 (the sets are 64 bits); dropping past the kernel's last one
/// fails with EINVAL, which is ignored.
const CAP_COUNT: libc::c_ulong = 64;

/// Makes `cmd` start as `user` with no capabilities and `no_new_privs`, keeping `inherit` (the
/// tap and vhost-net descriptors) open across exec at the same numbers.
pub fn run_unprivileged(cmd: &mut Command, user: &QemuUser, inherit: &[RawFd]) {
    let (uid, gid) = (user.uid as libc::uid_t, user.gid as libc::gid_t);
    let groups: Vec<libc::gid_t> = user.groups.iter().map(|g| *g as libc::gid_t).collect();
    let inherit = inherit.to_vec();
    let check = |r: libc::c_int| {
        if r == -1 {
            Err(io::Error::last_os_error())
        } else {
            Ok(())
        }
    };
    // SAFETY: the closure runs in the forked child before exec, where only async-signal-safe
    // calls are allowed: it calls fcntl, setgroups, setresgid, prctl, setresuid and capset
    // directly (no allocation, no locks; `groups` and `inherit` were allocated before the fork
    // and are only read), and errors are `io::Error::last_os_error`, which does not allocate.
    unsafe {
        cmd.pre_exec(move || {
            for fd in &inherit {
                check(libc::fcntl(*fd, libc::F_SETFD, 0))?;
            }
            check(libc::setgroups(groups.len(), groups.as_ptr()))?;
            check(libc::setresgid(gid, gid, gid))?;
            // While still root (CAP_SETPCAP): nothing exec'd later can gain a capability back.
            for cap in 0..CAP_COUNT {
                if libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) == -1
                    && io::Error::last_os_error().raw_os_error() != Some(libc::EINVAL)
                {
                    return Err(io::Error::last_os_error());
                }
            }
            check(libc::prctl(
                libc::PR_CAP_AMBIENT,
                libc::PR_CAP_AMBIENT_CLEAR_ALL,
                0,
                0,
                0,
            ))?;
            // From root to another uid the kernel clears effective and permitted capabilities
            // (no SECBIT_KEEP_CAPS); inheritable ones stay, so capset clears them too.
            check(libc::setresuid(uid, uid, uid))?;
            let mut header = CapHeader {
                version: CAP_VERSION_3,
                pid: 0,
            };
            let data = [CapData {
                effective: 0,
                permitted: 0,
                inheritable: 0,
            }; 2];
            check(libc::syscall(libc::SYS_capset, &raw mut header, data.as_ptr()) as libc::c_int)?;
            check(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))?;
            Ok(())
        });
    }
}

/// Giving a file to QEMU's user failed.
#[derive(Debug, thiserror::Error)]
pub enum HandOverError {
    /// The file is not one the launcher may give away.
    #[error(
        "{path}: {why}; QEMU runs as {uid}:{gid} and the launcher gives it only regular files \
         owned by root or by that user: fix the file (chown {uid}:{gid}) or remove it"
    )]
    Refused {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        why: String,
        /// QEMU's uid.
        uid: u32,
        /// QEMU's gid.
        gid: u32,
    },
    /// A system call failed.
    #[error(transparent)]
    Io(#[from] FileError),
}

/// Gives QEMU's user the disk files it writes (the overlay, data disks, an etcd disk created by
/// an earlier launcher that ran QEMU as root) and the Ignition file it reads. Only a regular
/// file with one link, owned by root or already by the user, is changed; a symlink is never
/// followed and a hard-linked file never changed (it could be another file of the host: KubeVirt's
/// CVE-2025-64324 chowned existing host files to its QEMU user, GHSA-qw6q-3pgr-5cwq followed
/// symlinks out of a tenant's volume).
pub fn hand_over(path: &Path, user: &QemuUser) -> Result<(), HandOverError> {
    let io_err = |action| {
        let at = FileError::at(action, path);
        move |e| HandOverError::Io(at(e))
    };
    let refused = |why: String| HandOverError::Refused {
        path: path.to_path_buf(),
        why,
        uid: user.uid,
        gid: user.gid,
    };
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => refused("a symbolic link".into()),
            _ => io_err("open")(e),
        })?;
    let m = f.metadata().map_err(io_err("stat"))?;
    if !m.file_type().is_file() {
        return Err(refused("not a regular file".into()));
    }
    if m.nlink() != 1 {
        return Err(refused(format!("has {} hard links", m.nlink())));
    }
    if m.uid() != 0 && m.uid() != user.uid {
        return Err(refused(format!("owned by uid {}", m.uid())));
    }
    std::os::unix::fs::fchown(&f, Some(user.uid), Some(user.gid)).map_err(io_err("chown"))
}

/// Lets QEMU's user create its sockets in the runtime directory without touching the launcher's
/// own files there (the control socket, the console copy): group-owned by QEMU's group,
/// group-writable and sticky (only a file's owner may remove or rename it, so QEMU cannot replace
/// them). Leftovers of an earlier QEMU are removed.
pub fn share_runtime_dir(
    dir: &Path,
    user: &QemuUser,
    qemu_creates: &[&Path],
) -> Result<(), HandOverError> {
    let io_err = |action, path: &Path| {
        let at = FileError::at(action, path);
        move |e| HandOverError::Io(at(e))
    };
    std::os::unix::fs::chown(dir, Some(0), Some(user.gid)).map_err(io_err("chown", dir))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o1770))
        .map_err(io_err("chmod", dir))?;
    for p in qemu_creates {
        match std::fs::remove_file(p) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(io_err("remove", p)(e)),
            _ => {}
        }
    }
    Ok(())
}

/// Prepares the directory the merged Ignition config is written to: created if missing, owned by
/// root and QEMU's group, mode 0750, so QEMU's user may open the file it is given there (and
/// nothing else: it cannot create, rename or remove entries).
pub fn share_secret_dir(dir: &Path, user: &QemuUser) -> Result<(), HandOverError> {
    let io_err = |action| {
        let at = FileError::at(action, dir);
        move |e| HandOverError::Io(at(e))
    };
    std::fs::create_dir_all(dir).map_err(io_err("create"))?;
    std::os::unix::fs::chown(dir, Some(0), Some(user.gid)).map_err(io_err("chown"))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o750)).map_err(io_err("chmod"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The effective uid, from /proc (as the other tests here tell root).
    fn euid() -> u32 {
        std::fs::metadata("/proc/self")
            .map(|m| m.uid())
            .unwrap_or(u32::MAX)
    }

    #[test]
    fn the_kvm_group_is_the_only_supplementary_group_and_never_root() {
        assert_eq!(QemuUser::plan(107, 107, Some(993)).groups, [993]);
        assert!(QemuUser::plan(107, 107, Some(0)).groups.is_empty());
        assert!(QemuUser::plan(107, 107, Some(107)).groups.is_empty());
        assert!(QemuUser::plan(107, 107, None).groups.is_empty());
    }

    /// Real files: a root-owned regular file is handed over; a symlink, a hard-linked file and
    /// a file of another user are refused and left as they were.
    #[test]
    fn only_plain_files_of_root_or_the_user_are_handed_over() {
        if euid() != 0 {
            assert!(
                std::env::var_os("CI").is_none(),
                "this test needs root to chown (run the tests as root)"
            );
            eprintln!("skipping: needs root to chown");
            return;
        }
        let user = QemuUser::plan(107, 107, None);
        let d = tempfile::tempdir().unwrap();
        let file = d.path().join("etcd.img");
        std::fs::write(&file, b"x").unwrap();
        hand_over(&file, &user).unwrap();
        let m = std::fs::metadata(&file).unwrap();
        assert_eq!((m.uid(), m.gid()), (107, 107));

        let secret = d.path().join("secret");
        std::fs::write(&secret, b"x").unwrap();
        let link = d.path().join("link.img");
        std::os::unix::fs::symlink(&secret, &link).unwrap();
        let hard = d.path().join("hard.img");
        std::fs::hard_link(&secret, &hard).unwrap();
        let other = d.path().join("other.img");
        std::fs::write(&other, b"x").unwrap();
        std::os::unix::fs::chown(&other, Some(1000), Some(1000)).unwrap();
        for (path, why) in [
            (&link, "a symbolic link"),
            (&hard, "has 2 hard links"),
            (&other, "owned by uid 1000"),
        ] {
            let e = hand_over(path, &user).unwrap_err().to_string();
            assert!(e.contains(why), "{e}");
            assert!(e.contains("chown 107:107"), "{e}");
        }
        assert_eq!(std::fs::metadata(&secret).unwrap().uid(), 0);
        assert_eq!(std::fs::metadata(&other).unwrap().uid(), 1000);
    }
}
