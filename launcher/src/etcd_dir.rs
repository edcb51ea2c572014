//! The etcd directory on persistent storage: whose it is, and removing it once its KVMMachine
//! is gone (`capk-launcher remove-etcd-data`, the controller's etcd cleanup Pod).
//!
//! `run` writes an owner marker ([`MARKER_FILE`], naming the KVMMachine by namespace, name and
//! UID) before it creates the etcd disk, and refuses a directory whose marker names another
//! KVMMachine, or that holds an etcd disk without a marker (the disk plan decides, from
//! [`read_marker`]). [`remove`] removes the disk, the
//! marker and the directory only when the marker names the KVMMachine it was given; anything
//! else is refused, with nothing removed. A path is never trusted: tenants choose the names it
//! is made of.

use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use capk_api::file_error::FileError;

pub use capk_api::etcd_owner::{DISK_FILE, EtcdOwner, MARKER_FILE, MAX_MARKER_BYTES};

/// What an etcd directory's marker says.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Marker {
    /// No marker (or no directory).
    #[default]
    Absent,
    /// A marker naming this KVMMachine.
    Owner(EtcdOwner),
    /// Something there that is not a marker a launcher wrote; why.
    Unreadable(String),
}

/// Reads the marker of directory `dir`: a plain file (never followed through a link), at most
/// [`MAX_MARKER_BYTES`].
pub fn read_marker(dir: &Path) -> Marker {
    let path = dir.join(MARKER_FILE);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
        .open(&path);
    let file = match file {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Marker::Absent,
        Err(e) if e.raw_os_error() == Some(nix::libc::ELOOP) => {
            return Marker::Unreadable(format!("{MARKER_FILE} is a symbolic link"));
        }
        Err(e) => return Marker::Unreadable(format!("open {MARKER_FILE}: {e}")),
    };
    match file.metadata() {
        Ok(m) if m.is_file() => {}
        _ => return Marker::Unreadable(format!("{MARKER_FILE} is not a plain file")),
    }
    let mut bytes = Vec::new();
    if let Err(e) = file
        .take(MAX_MARKER_BYTES as u64 + 1)
        .read_to_end(&mut bytes)
    {
        return Marker::Unreadable(format!("read {MARKER_FILE}: {e}"));
    }
    match EtcdOwner::from_marker(&bytes) {
        Ok(o) => Marker::Owner(o),
        Err(e) => Marker::Unreadable(format!("{MARKER_FILE}: {e}")),
    }
}

/// Writes `owner`'s marker into `dir` (made when missing): a new file only, so a marker that
/// appeared meanwhile is never overwritten; on disk before the etcd disk is created.
pub fn write_marker(dir: &Path, owner: &EtcdOwner) -> std::io::Result<()> {
    use std::io::Write;
    std::fs::create_dir_all(dir)?;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .open(dir.join(MARKER_FILE))?;
    f.write_all(owner.marker().as_bytes())?;
    f.sync_all()
}

/// What [`remove`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Removal {
    /// The etcd disk, the marker and the directory are gone.
    Removed,
    /// The etcd disk is gone; the directory holds other entries (none of them the launcher's),
    /// so it and its marker stay: these.
    DiskRemoved {
        /// The other entries' names (at most 10).
        left: Vec<String>,
    },
    /// There was nothing: no directory, or an empty one without a marker (a removal that
    /// stopped just before removing the directory itself).
    NothingThere,
}

/// Why [`remove`] removed nothing: the directory is not the given KVMMachine's. Trying again
/// would not change that.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// A file (a symbolic link, a device, ...) where a directory should be.
    #[error("it is not a directory")]
    NotADirectory,
    /// Something in the directory, but no marker: not made by a launcher for any KVMMachine.
    #[error("it has no owner marker {MARKER_FILE}, so it was not made for this KVMMachine")]
    Unmarked,
    /// A marker a launcher did not write.
    #[error("its owner marker cannot be read: {0}")]
    UnreadableMarker(String),
    /// Another KVMMachine's.
    #[error(
        "its owner marker names KVMMachine {}/{} (uid {}), not {}/{} (uid {})",
        marker.namespace, marker.name, marker.uid, given.namespace, given.name, given.uid
    )]
    OtherOwner {
        /// Whom the marker names.
        marker: Box<EtcdOwner>,
        /// Whom the cleanup was given.
        given: Box<EtcdOwner>,
    },
}

/// Failures of [`remove`].
#[derive(Debug, thiserror::Error)]
pub enum RemoveError {
    /// Not the given KVMMachine's: nothing removed.
    #[error("{} left as it is: {refusal}", dir.display())]
    Refused {
        /// The directory.
        dir: PathBuf,
        /// Why.
        refusal: Refusal,
    },
    /// A file system operation failed (worth another try).
    #[error(transparent)]
    Io(#[from] FileError),
}

/// Removes etcd directory `dir` when its marker names `owner` (namespace, name, UID): the etcd disk, the
/// marker and the directory, and nothing else: other entries (which no launcher made) keep the
/// directory and its marker. Anything not marked for `owner` is refused, with nothing removed.
pub fn remove(dir: &Path, owner: &EtcdOwner) -> Result<Removal, RemoveError> {
    let refused = |refusal| RemoveError::Refused {
        dir: dir.to_path_buf(),
        refusal,
    };
    let io = |action, path: &Path| {
        let at = FileError::at(action, path);
        move |e| RemoveError::Io(at(e))
    };
    // The directory itself, never through a link.
    match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_DIRECTORY | nix::libc::O_NOFOLLOW)
        .open(dir)
    {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Removal::NothingThere),
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(nix::libc::ENOTDIR | nix::libc::ELOOP)
            ) =>
        {
            return Err(refused(Refusal::NotADirectory));
        }
        Err(e) => return Err(io("open", dir)(e)),
    }
    let others = |skip: &[&str]| -> Result<Vec<String>, RemoveError> {
        let mut names = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(io("list", dir))? {
            let name = entry.map_err(io("list", dir))?.file_name();
            let name = name.to_string_lossy().into_owned();
            if !skip.contains(&name.as_str()) {
                names.push(name);
            }
        }
        names.sort();
        Ok(names)
    };
    match read_marker(dir) {
        Marker::Owner(m) if owner.owns(&m) => {}
        Marker::Owner(m) => {
            return Err(refused(Refusal::OtherOwner {
                marker: Box::new(m),
                given: Box::new(owner.clone()),
            }));
        }
        Marker::Unreadable(why) => return Err(refused(Refusal::UnreadableMarker(why))),
        Marker::Absent if others(&[])?.is_empty() => return Ok(Removal::NothingThere),
        Marker::Absent => return Err(refused(Refusal::Unmarked)),
    }
    let disk = dir.join(DISK_FILE);
    match std::fs::remove_file(&disk) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io("remove", &disk)(e)),
    }
    let mut left = others(&[MARKER_FILE])?;
    if !left.is_empty() {
        left.truncate(10);
        return Ok(Removal::DiskRemoved { left });
    }
    let marker = dir.join(MARKER_FILE);
    std::fs::remove_file(&marker).map_err(io("remove", &marker))?;
    std::fs::remove_dir(dir).map_err(io("remove", dir))?;
    Ok(Removal::Removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owner(namespace: &str, name: &str, uid: &str) -> EtcdOwner {
        EtcdOwner {
            namespace: namespace.into(),
            name: name.into(),
            uid: uid.into(),
        }
    }

    /// A launcher's etcd directory: marker and disk.
    fn machine_dir(dir: &Path, o: &EtcdOwner) {
        write_marker(dir, o).unwrap();
        std::fs::write(dir.join(DISK_FILE), b"the cluster's etcd data").unwrap();
    }

    fn victim() -> EtcdOwner {
        owner(
            "team-a",
            "demo-cp-x7k2p",
            "aaaaaaaa-0000-4000-8000-000000000001",
        )
    }

    /// Tenant B's namespace is named like tenant A's control-plane
    /// KVMMachine and its KVMMachine `etcd.img` keeps etcd under `<prefix>/team-a`, so B's
    /// "directory" is A's etcd disk. B's cleanup removes nothing of A's, whatever it points at.
    #[test]
    fn a_cleanup_for_another_machine_removes_nothing() {
        let root = tempfile::tempdir().unwrap();
        let a_dir = root.path().join("team-a/demo-cp-x7k2p");
        machine_dir(&a_dir, &victim());
        let b = owner(
            "demo-cp-x7k2p",
            "etcd.img",
            "bbbbbbbb-0000-4000-8000-000000000002",
        );
        // B's directory as the path says: A's disk.
        let e = remove(&a_dir.join(DISK_FILE), &b).unwrap_err();
        assert!(
            matches!(
                &e,
                RemoveError::Refused {
                    refusal: Refusal::NotADirectory,
                    ..
                }
            ),
            "{e}"
        );
        // A's directory itself, given to B.
        let e = remove(&a_dir, &b).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "{} left as it is: its owner marker names KVMMachine \
                 team-a/demo-cp-x7k2p (uid aaaaaaaa-0000-4000-8000-000000000001), not \
                 demo-cp-x7k2p/etcd.img (uid bbbbbbbb-0000-4000-8000-000000000002)",
                a_dir.display()
            )
        );
        // Same namespace and name, another UID: a machine made again is another machine.
        let again = owner(
            "team-a",
            "demo-cp-x7k2p",
            "cccccccc-0000-4000-8000-000000000003",
        );
        assert!(matches!(
            remove(&a_dir, &again),
            Err(RemoveError::Refused {
                refusal: Refusal::OtherOwner { .. },
                ..
            })
        ));
        // A's namespace directory (no marker): refused too.
        assert!(matches!(
            remove(&root.path().join("team-a"), &b),
            Err(RemoveError::Refused {
                refusal: Refusal::Unmarked,
                ..
            })
        ));
        assert_eq!(
            std::fs::read(a_dir.join(DISK_FILE)).unwrap(),
            b"the cluster's etcd data"
        );
        assert_eq!(read_marker(&a_dir), Marker::Owner(victim()));
    }

    #[test]
    fn an_unmarked_directory_is_not_ours() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("team-a/demo-cp-x7k2p");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join(DISK_FILE),
            b"made before markers, or by someone else",
        )
        .unwrap();
        let e = remove(&dir, &victim()).unwrap_err();
        assert!(
            e.to_string().contains("has no owner marker .capk-owner"),
            "{e}"
        );
        assert!(dir.join(DISK_FILE).exists());
        // A marker that is a link (to a marker that would match) is no marker.
        let elsewhere = root.path().join("elsewhere");
        write_marker(&elsewhere, &victim()).unwrap();
        std::os::unix::fs::symlink(elsewhere.join(MARKER_FILE), dir.join(MARKER_FILE)).unwrap();
        assert!(matches!(
            remove(&dir, &victim()),
            Err(RemoveError::Refused {
                refusal: Refusal::UnreadableMarker(_),
                ..
            })
        ));
        // So is a directory reached through a link.
        let link = root.path().join("team-a/link");
        std::os::unix::fs::symlink(&elsewhere, &link).unwrap();
        assert!(matches!(
            remove(&link, &victim()),
            Err(RemoveError::Refused {
                refusal: Refusal::NotADirectory,
                ..
            })
        ));
        assert!(dir.join(DISK_FILE).exists() && elsewhere.join(MARKER_FILE).exists());
    }

    #[test]
    fn the_machines_own_directory_is_removed_and_only_what_the_launcher_made() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("team-a/demo-cp-x7k2p");
        machine_dir(&dir, &victim());
        assert_eq!(remove(&dir, &victim()).unwrap(), Removal::Removed);
        assert!(!dir.exists());
        assert!(root.path().join("team-a").is_dir(), "the parent stays");
        // Gone already (a retry): nothing to do.
        assert_eq!(remove(&dir, &victim()).unwrap(), Removal::NothingThere);
        // Someone else's files in it stay, and so do the directory and its marker.
        machine_dir(&dir, &victim());
        std::fs::create_dir(dir.join("team-b")).unwrap();
        std::fs::write(dir.join("team-b/etcd.img"), b"another's").unwrap();
        assert_eq!(
            remove(&dir, &victim()).unwrap(),
            Removal::DiskRemoved {
                left: vec!["team-b".into()]
            }
        );
        assert!(!dir.join(DISK_FILE).exists());
        assert_eq!(
            std::fs::read(dir.join("team-b/etcd.img")).unwrap(),
            b"another's"
        );
        assert_eq!(read_marker(&dir), Marker::Owner(victim()));
        // An empty directory without a marker (a removal stopped before rmdir): nothing there.
        let empty = root.path().join("team-a/empty");
        std::fs::create_dir(&empty).unwrap();
        assert_eq!(remove(&empty, &victim()).unwrap(), Removal::NothingThere);
        assert!(empty.is_dir());
    }

    #[test]
    fn a_marker_is_written_once() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("etcd");
        write_marker(&dir, &victim()).unwrap();
        let other = owner("team-b", "m", "dddddddd-0000-4000-8000-000000000004");
        assert!(write_marker(&dir, &other).is_err());
        assert_eq!(read_marker(&dir), Marker::Owner(victim()));
        std::fs::write(dir.join(MARKER_FILE), "x".repeat(MAX_MARKER_BYTES * 4)).unwrap();
        assert!(matches!(read_marker(&dir), Marker::Unreadable(_)));
    }
}
