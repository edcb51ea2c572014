//! A host volume's directory, opened without following a symbolic link anywhere on its path.
//!
//! The machine Pod mounts the tenant's whole share (`<allowed dir>/<namespace>`, a directory the
//! operator made) and names the volume's directory inside that mount; the kubelet never sees the
//! sub-path. A link on the way (one made on the node, or a real symlink a guest made under an
//! older launcher's 9p `security_model=none`) could lead anywhere in the Pod's view: the
//! launcher refuses it, before QEMU starts, whether the link stays inside the share or not.
//!
//! The path is walked from `/` one element at a time (`openat` with `O_NOFOLLOW`, each element
//! checked to be a directory), so the walk never leaves what it has already opened; QEMU then
//! gets the opened directory as a descriptor (`/proc/self/fd/N`), never the path again: a
//! rename in the share between this check and QEMU's start cannot swap in another directory.
//! (`openat2` with `RESOLVE_NO_SYMLINKS` does the same in one call, but names no culprit; the
//! walk says which element is a link and where it points.)

use std::ffi::OsStr;
use std::os::fd::OwnedFd;
use std::path::{Component, Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, openat, readlinkat};
use nix::sys::stat::{Mode, SFlag, fstat, fstatat};

/// A host volume's directory could not be opened as one without links.
#[derive(Debug, thiserror::Error)]
pub enum HostVolumeError {
    /// An element of the path is a symbolic link.
    #[error(
        "host volume {tag}: {path} is a symbolic link (to {target:?}); host volumes never follow \
         links, which could lead out of the tenant's share: name the directory itself in \
         spec.hostVolumes[].hostPath, or remove the link"
    )]
    Link {
        /// The volume's mount tag.
        tag: String,
        /// The path up to and including the link.
        path: PathBuf,
        /// Where the link points.
        target: PathBuf,
    },
    /// An element of the path is `..`.
    #[error("host volume {tag}: {path} has a '..' element; name the directory without it")]
    DotDot {
        /// The volume's mount tag.
        tag: String,
        /// The whole path.
        path: PathBuf,
    },
    /// An element of the path is not a directory.
    #[error("host volume {tag}: {path} is not a directory")]
    NotDirectory {
        /// The volume's mount tag.
        tag: String,
        /// The path up to and including that element.
        path: PathBuf,
    },
    /// A read-write volume's filesystem keeps no user extended attributes.
    #[error(
        "host volume {tag}: the filesystem of {path} keeps no user extended attributes, where 9p \
         (security_model=mapped-xattr) stores the owners, modes and links of what the guest \
         makes; put read-write shares on ext4, xfs or btrfs, or share this one read-only"
    )]
    NoUserXattrs {
        /// The volume's mount tag.
        tag: String,
        /// The directory.
        path: PathBuf,
    },
    /// An element of the path could not be opened.
    #[error("host volume {tag}: open {path}")]
    Open {
        /// The volume's mount tag.
        tag: String,
        /// The path up to and including that element.
        path: PathBuf,
        /// Why.
        #[source]
        source: Errno,
    },
}

/// Whether the filesystem of the directory QEMU opens as `qemu_path` keeps user extended
/// attributes, where 9p `security_model=mapped-xattr` stores the owners, modes and kinds of what
/// the guest makes: without them every file a guest creates fails. Read-write volumes only.
pub fn check_user_xattrs(tag: &str, path: &Path, qemu_path: &Path) -> Result<(), HostVolumeError> {
    match rustix::fs::getxattr(qemu_path, "user.capk.probe", &mut [0u8; 0][..]) {
        Err(e) if e == rustix::io::Errno::NOTSUP => Err(HostVolumeError::NoUserXattrs {
            tag: tag.into(),
            path: path.into(),
        }),
        _ => Ok(()),
    }
}

/// `O_PATH`: the descriptor names the directory and reads nothing; QEMU's user opens it anew
/// through `/proc/self/fd`, with its own rights.
const WALK: OFlag = OFlag::O_PATH
    .union(OFlag::O_DIRECTORY)
    .union(OFlag::O_NOFOLLOW)
    .union(OFlag::O_CLOEXEC);

/// Opens the directory `path` (absolute) of host volume `tag` without following any symbolic
/// link: every element must be a directory itself.
pub fn open_dir(tag: &str, path: &Path) -> Result<OwnedFd, HostVolumeError> {
    let root = Path::new("/");
    let mut dir =
        nix::fcntl::open(root, WALK, Mode::empty()).map_err(|source| HostVolumeError::Open {
            tag: tag.into(),
            path: root.into(),
            source,
        })?;
    let mut walked = PathBuf::from("/");
    for element in path.components() {
        let name: &OsStr = match element {
            Component::Normal(name) => name,
            Component::RootDir | Component::CurDir => continue,
            Component::ParentDir | Component::Prefix(_) => {
                return Err(HostVolumeError::DotDot {
                    tag: tag.into(),
                    path: path.into(),
                });
            }
        };
        walked.push(name);
        // O_PATH with O_NOFOLLOW may open a link itself rather than fail: what was opened must
        // be a directory, whatever the kernel did.
        let opened = openat(&dir, name, WALK, Mode::empty())
            .and_then(|fd| Ok((fstat(&fd)?.st_mode & SFlag::S_IFMT.bits(), fd)));
        dir = match opened {
            Ok((kind, fd)) if kind == SFlag::S_IFDIR.bits() => fd,
            Ok(_) => return Err(refusal(&dir, name, tag, walked, Errno::ENOTDIR)),
            Err(e) => return Err(refusal(&dir, name, tag, walked, e)),
        };
    }
    Ok(dir)
}

/// Why `name` in `dir` (at `walked`) could not be walked into: a link, not a directory, or the
/// `error` of opening it.
fn refusal(
    dir: &OwnedFd,
    name: &OsStr,
    tag: &str,
    walked: PathBuf,
    error: Errno,
) -> HostVolumeError {
    let kind = fstatat(dir, name, AtFlags::AT_SYMLINK_NOFOLLOW)
        .map(|s| s.st_mode & SFlag::S_IFMT.bits())
        .ok();
    let tag = tag.to_owned();
    match kind {
        Some(k) if k == SFlag::S_IFLNK.bits() => HostVolumeError::Link {
            tag,
            path: walked,
            target: readlinkat(dir, name).map(PathBuf::from).unwrap_or_default(),
        },
        Some(k) if k != SFlag::S_IFDIR.bits() || error == Errno::ENOTDIR => {
            HostVolumeError::NotDirectory { tag, path: walked }
        }
        _ => HostVolumeError::Open {
            tag,
            path: walked,
            source: error,
        },
    }
}

/// What QEMU opens for a directory the launcher opened as `fd` (inherited across exec).
pub fn qemu_path(fd: i32) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{fd}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::symlink;

    /// A share with a directory, a link out of it (what a guest made with
    /// `security_model=none`), a link that stays inside, and a file.
    fn share() -> (tempfile::TempDir, PathBuf) {
        let d = tempfile::tempdir().unwrap();
        let share = d.path().join("share");
        std::fs::create_dir_all(share.join("data/sub")).unwrap();
        symlink("/", share.join("escape")).unwrap();
        symlink("data", share.join("inside")).unwrap();
        std::fs::write(share.join("file"), "x").unwrap();
        (d, share)
    }

    #[test]
    fn a_directory_opens_and_qemu_reopens_that_very_directory() {
        let (_d, share) = share();
        let fd = open_dir("data", &share.join("data/sub")).unwrap();
        let seen = std::fs::read_link(qemu_path(fd.as_raw_fd())).unwrap();
        assert_eq!(seen, share.join("data/sub").canonicalize().unwrap());
        // `.` and doubled slashes are nothing to refuse.
        let dotted = PathBuf::from(format!("{}/./data//sub/", share.display()));
        assert!(open_dir("data", &dotted).is_ok());
    }

    #[test]
    fn a_link_anywhere_on_the_path_is_refused_naming_it() {
        let (_d, share) = share();
        for (path, link, target) in [
            (share.join("escape"), share.join("escape"), "/"),
            (share.join("escape/etc"), share.join("escape"), "/"),
            (share.join("inside/sub"), share.join("inside"), "data"),
        ] {
            let err = open_dir("data", &path).unwrap_err();
            match &err {
                HostVolumeError::Link {
                    tag,
                    path,
                    target: t,
                } => {
                    assert_eq!(
                        (tag.as_str(), path, t),
                        ("data", &link, &PathBuf::from(target))
                    );
                }
                other => panic!("{other:?}"),
            }
            let msg = err.to_string();
            assert!(
                msg.starts_with(&format!(
                    "host volume data: {} is a symbolic link",
                    link.display()
                )) && msg.contains("never follow links"),
                "{msg}"
            );
        }
    }

    #[test]
    fn a_share_on_a_filesystem_without_user_xattrs_is_refused_for_writing() {
        let (_d, share) = share();
        let fd = open_dir("data", &share).unwrap();
        // The test's temporary directory is on a filesystem with user xattrs (ext4 here).
        assert!(check_user_xattrs("data", &share, &qemu_path(fd.as_raw_fd())).is_ok());
        // procfs keeps none.
        let proc = Path::new("/proc/sys");
        let fd = open_dir("data", proc).unwrap();
        let err = check_user_xattrs("data", proc, &qemu_path(fd.as_raw_fd())).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("host volume data: the filesystem of /proc/sys keeps no user"),
            "{err}"
        );
    }

    #[test]
    fn files_missing_paths_and_dot_dot_are_refused() {
        let (_d, share) = share();
        assert!(matches!(
            open_dir("data", &share.join("file")),
            Err(HostVolumeError::NotDirectory { path, .. }) if path == share.join("file")
        ));
        assert!(matches!(
            open_dir("data", &share.join("absent/sub")),
            Err(HostVolumeError::Open { path, source: Errno::ENOENT, .. })
                if path == share.join("absent")
        ));
        assert!(matches!(
            open_dir("data", &share.join("data/../escape")),
            Err(HostVolumeError::DotDot { .. })
        ));
    }
}
