//! Disks: a qcow2 overlay on the read-only node image (never a copy), raw data disks of the
//! configured sizes, and the etcd disk on persistent storage that is created once and never
//! recreated, shrunk or formatted by the launcher. Its directory is marked as the KVMMachine's
//! before the disk is made, and a directory marked for another, or a disk without a marker, is
//! refused ([`crate::etcd_dir`]).

use std::path::{Path, PathBuf};
use std::process::Command;

use serde::Serialize;

use crate::etcd_dir::{self, EtcdOwner, Marker};
use crate::qcow2::{self, NotSelfContained};
use crate::qemu::argv::{BaseImage, DiskAttachment, DiskFormat};
use capk_api::byte_size::ByteSize;
use capk_api::file_error::FileError;

/// What the controller asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskRequest {
    /// Directory for the overlay and the data disks.
    pub state_dir: PathBuf,
    /// Node image.
    pub image: PathBuf,
    /// Its format.
    pub image_format: DiskFormat,
    /// Root disk size.
    pub root_size: ByteSize,
    /// containerd disk size (0 = none).
    pub docker_size: ByteSize,
    /// kubelet disk size (0 = none).
    pub kubelet_size: ByteSize,
    /// The etcd disk, on persistent storage.
    pub etcd: Option<EtcdDiskRequest>,
}

/// The etcd disk the controller asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdDiskRequest {
    /// The disk file (in its own directory, which the marker is written to).
    pub path: PathBuf,
    /// Its size at creation.
    pub size: ByteSize,
    /// The KVMMachine it belongs to.
    pub owner: EtcdOwner,
}

impl EtcdDiskRequest {
    /// The directory the disk and its marker are in.
    pub fn dir(&self) -> PathBuf {
        self.path
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from("/"))
    }
}

/// What exists on disk now (filled by [`observe`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DiskState {
    /// Virtual size of the node image.
    pub image_size: Option<ByteSize>,
    /// The backing file a qcow2 node image's header names.
    pub image_backing_file: Option<String>,
    /// The external data file a qcow2 node image's header names (empty: the feature bit alone).
    pub image_data_file: Option<String>,
    /// Virtual size of the root overlay, when it exists.
    pub overlay_size: Option<ByteSize>,
    /// Size of the containerd disk, when it exists.
    pub docker_size: Option<ByteSize>,
    /// Size of the kubelet disk, when it exists.
    pub kubelet_size: Option<ByteSize>,
    /// Size of the etcd disk, when it exists.
    pub etcd_size: Option<ByteSize>,
    /// What the etcd directory's owner marker says.
    pub etcd_marker: Marker,
}

/// One thing to do to one disk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "action", rename_all = "kebab-case")]
pub enum DiskAction {
    /// `qemu-img create -f qcow2 -b <image>`.
    CreateOverlay {
        /// Overlay path.
        path: PathBuf,
        /// Read-only base.
        backing: PathBuf,
        /// Base format.
        backing_format: DiskFormat,
        /// Virtual size.
        size: ByteSize,
    },
    /// `qemu-img resize` an existing overlay up.
    GrowOverlay {
        /// Overlay path.
        path: PathBuf,
        /// New virtual size.
        size: ByteSize,
    },
    /// Create a sparse raw file.
    CreateRaw {
        /// File.
        path: PathBuf,
        /// Size.
        size: ByteSize,
    },
    /// Extend a raw file (never shrink: data may be there).
    GrowRaw {
        /// File.
        path: PathBuf,
        /// New size.
        size: ByteSize,
    },
    /// Use as it is.
    Keep {
        /// File.
        path: PathBuf,
    },
    /// Write the owner marker into the etcd disk's directory (before the disk is created).
    MarkEtcdOwner {
        /// The directory.
        dir: PathBuf,
        /// The KVMMachine.
        owner: EtcdOwner,
    },
}

/// The disk plan: actions and the resulting attachments, root first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DiskPlan {
    /// Actions in order.
    pub actions: Vec<DiskAction>,
    /// virtio-blk disks for QEMU.
    pub attachments: Vec<DiskAttachment>,
}

/// Disk failures.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    /// The node image is missing or unreadable.
    #[error("node image {0}: {1}")]
    Image(PathBuf, String),
    /// The root disk cannot be smaller than the image.
    #[error("disk size {requested} is smaller than the node image's {image}; raise --disk-size")]
    RootTooSmall {
        /// Requested.
        requested: ByteSize,
        /// Image virtual size.
        image: ByteSize,
    },
    /// The node image names another file to open.
    #[error(transparent)]
    NotSelfContained(#[from] NotSelfContained),
    /// qemu-img failed.
    #[error("{command}: {stderr}")]
    QemuImg {
        /// Command line.
        command: String,
        /// Its stderr.
        stderr: String,
    },
    /// Running qemu-img failed.
    #[error("run {0} (install qemu-utils)")]
    RunQemuImg(PathBuf, #[source] std::io::Error),
    /// The etcd directory is marked for another KVMMachine.
    #[error(
        "etcd directory {}: its owner marker names KVMMachine {}/{} (uid {}), not this machine \
         {}/{} (uid {}); its data is left alone: give this machine another etcdStorage, or \
         remove that directory on the node if its machine is gone",
        dir.display(), marker.namespace, marker.name, marker.uid, owner.namespace, owner.name,
        owner.uid
    )]
    EtcdDirForeign {
        /// The directory.
        dir: PathBuf,
        /// Whom its marker names.
        marker: Box<EtcdOwner>,
        /// This machine.
        owner: Box<EtcdOwner>,
    },
    /// The etcd disk exists but its directory has no owner marker, or one no launcher wrote.
    #[error(
        "etcd directory {}: {why}, so the etcd disk in it was not made for this machine and is \
         left alone: give this machine another etcdStorage, or remove that directory on the node",
        dir.display()
    )]
    EtcdDirUnmarked {
        /// The directory.
        dir: PathBuf,
        /// What is wrong with the marker.
        why: String,
    },
    /// File I/O on a disk file failed.
    #[error(transparent)]
    Io(#[from] FileError),
}

/// Serial the guest sees the root disk as.
pub const ROOT_SERIAL: &str = "rootfs";
/// containerd disk serial.
pub const DOCKER_SERIAL: &str = "dockerfs";
/// kubelet disk serial.
pub const KUBELET_SERIAL: &str = "kubeletfs";
/// etcd disk serial.
pub const ETCD_SERIAL: &str = "etcdfs";

fn overlay_path(r: &DiskRequest) -> PathBuf {
    r.state_dir.join("root.qcow2")
}

/// Plans the disks from the request and what exists.
pub fn plan(r: &DiskRequest, s: &DiskState) -> Result<DiskPlan, DiskError> {
    let mut actions = Vec::new();
    let mut attachments = Vec::new();
    let image_size = s
        .image_size
        .ok_or_else(|| DiskError::Image(r.image.clone(), "not found".into()))?;
    // What a tenant's image names is never opened: QEMU would serve it to the guest.
    qcow2::self_contained(
        &r.image,
        s.image_backing_file.as_deref(),
        s.image_data_file.as_deref(),
    )?;
    if r.root_size < image_size {
        return Err(DiskError::RootTooSmall {
            requested: r.root_size,
            image: image_size,
        });
    }
    let root_size = ByteSize(r.root_size.aligned_kib());
    let overlay = overlay_path(r);
    actions.push(match s.overlay_size {
        None => DiskAction::CreateOverlay {
            path: overlay.clone(),
            backing: r.image.clone(),
            backing_format: r.image_format,
            size: root_size,
        },
        Some(cur) if cur < root_size => DiskAction::GrowOverlay {
            path: overlay.clone(),
            size: root_size,
        },
        Some(_) => DiskAction::Keep {
            path: overlay.clone(),
        },
    });
    attachments.push(DiskAttachment {
        serial: ROOT_SERIAL.into(),
        path: overlay,
        format: DiskFormat::Qcow2,
        base: Some(BaseImage {
            path: r.image.clone(),
            format: r.image_format,
        }),
    });

    for (serial, file, want, have) in [
        (DOCKER_SERIAL, "docker.img", r.docker_size, s.docker_size),
        (
            KUBELET_SERIAL,
            "kubelet.img",
            r.kubelet_size,
            s.kubelet_size,
        ),
    ] {
        if want.0 == 0 {
            continue;
        }
        let path = r.state_dir.join(file);
        let want = ByteSize(want.aligned_kib());
        actions.push(match have {
            None => DiskAction::CreateRaw {
                path: path.clone(),
                size: want,
            },
            Some(cur) if cur < want => DiskAction::GrowRaw {
                path: path.clone(),
                size: want,
            },
            Some(_) => DiskAction::Keep { path: path.clone() },
        });
        attachments.push(DiskAttachment {
            serial: serial.into(),
            path,
            format: DiskFormat::Raw,
            base: None,
        });
    }

    if let Some(etcd) = &r.etcd {
        etcd_actions(etcd, s, &mut actions)?;
        attachments.push(DiskAttachment {
            serial: ETCD_SERIAL.into(),
            path: etcd.path.clone(),
            format: DiskFormat::Raw,
            base: None,
        });
    }
    Ok(DiskPlan {
        actions,
        attachments,
    })
}

/// The etcd disk's actions: an existing disk is never touched (it holds the cluster's state)
/// and is used only when its directory's marker names this KVMMachine; a new one is made after
/// the marker is written.
fn etcd_actions(
    etcd: &EtcdDiskRequest,
    s: &DiskState,
    actions: &mut Vec<DiskAction>,
) -> Result<(), DiskError> {
    let dir = etcd.dir();
    match (&s.etcd_marker, s.etcd_size) {
        (Marker::Owner(m), _) if !etcd.owner.owns(m) => {
            return Err(DiskError::EtcdDirForeign {
                dir,
                marker: Box::new(m.clone()),
                owner: Box::new(etcd.owner.clone()),
            });
        }
        (Marker::Unreadable(why), _) => {
            return Err(DiskError::EtcdDirUnmarked {
                dir,
                why: why.clone(),
            });
        }
        (Marker::Absent, Some(_)) => {
            return Err(DiskError::EtcdDirUnmarked {
                dir,
                why: format!("it has no owner marker {}", etcd_dir::MARKER_FILE),
            });
        }
        (Marker::Absent, None) => actions.push(DiskAction::MarkEtcdOwner {
            dir,
            owner: etcd.owner.clone(),
        }),
        (Marker::Owner(_), _) => {}
    }
    actions.push(match s.etcd_size {
        None => DiskAction::CreateRaw {
            path: etcd.path.clone(),
            size: ByteSize(etcd.size.aligned_kib()),
        },
        Some(_) => DiskAction::Keep {
            path: etcd.path.clone(),
        },
    });
    Ok(())
}

fn qemu_img(qemu_img: &Path, args: &[&str]) -> Result<String, DiskError> {
    let out = Command::new(qemu_img)
        .args(args)
        .output()
        .map_err(|e| DiskError::RunQemuImg(qemu_img.to_path_buf(), e))?;
    if !out.status.success() {
        return Err(DiskError::QemuImg {
            command: format!("{} {}", qemu_img.display(), args.join(" ")),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// An image's virtual size and, for qcow2, what its header names, read from the file itself:
/// a qcow2 header (`qcow2::read`), a raw file's (or block device's) length in 512-byte sectors.
/// What `qemu-img info` reports, without a process: a restart spawns nothing before QEMU (the
/// two `qemu-img info` runs were most of the 15-60 ms from launcher start to QEMU exec), and
/// nothing the header names is opened.
fn read_image(
    path: &Path,
    format: DiskFormat,
) -> Result<(ByteSize, Option<qcow2::Header>), DiskError> {
    use std::io::{Seek, SeekFrom};
    let bad = |why: String| DiskError::Image(path.to_path_buf(), why);
    match format {
        // QEMU sees a raw file in whole 512-byte sectors, the last one zero-padded. Its bytes
        // are the guest's: never looked at as a header (QEMU is always told `raw`).
        DiskFormat::Raw => std::fs::File::open(path)
            .and_then(|mut f| f.seek(SeekFrom::End(0)))
            .map(|len| (ByteSize(len.div_ceil(512) * 512), None))
            .map_err(|e| bad(e.to_string())),
        DiskFormat::Qcow2 => {
            let h = qcow2::read(path).map_err(|e| bad(e.to_string()))?;
            Ok((ByteSize(h.size), Some(h)))
        }
    }
}

fn file_size(path: &Path) -> Option<ByteSize> {
    std::fs::metadata(path).ok().map(|m| ByteSize(m.len()))
}

/// Reads what exists (virtual sizes of the image and the overlay from their headers, raw files
/// by their length).
pub fn observe(r: &DiskRequest) -> Result<DiskState, DiskError> {
    let overlay = overlay_path(r);
    let (image_size, header) = read_image(&r.image, r.image_format)?;
    let header = header.unwrap_or_default();
    Ok(DiskState {
        image_size: Some(image_size),
        image_backing_file: header.backing_file,
        image_data_file: header.data_file,
        overlay_size: if overlay.exists() {
            Some(read_image(&overlay, DiskFormat::Qcow2)?.0)
        } else {
            None
        },
        docker_size: file_size(&r.state_dir.join("docker.img")),
        kubelet_size: file_size(&r.state_dir.join("kubelet.img")),
        etcd_size: r.etcd.as_ref().and_then(|e| file_size(&e.path)),
        etcd_marker: r
            .etcd
            .as_ref()
            .map(|e| etcd_dir::read_marker(&e.dir()))
            .unwrap_or_default(),
    })
}

/// Opens a base image read-only for QEMU (which gets the descriptor) and checks again, on the
/// open file, that a qcow2 names no other file: what QEMU reads is what was checked, even if the
/// path was replaced after planning. The open file holds a shared `flock` for as long as the VM
/// runs: the node-image cache never evicts an image so held (`image_cache`). Every start also
/// marks the image used (its modification time, as the `fetch-image` init container does): a
/// crash-looping launcher holds no lock between its restarts, and the init container does not
/// run again for them, so without the mark its image would look idle once the kubelet's back-off
/// (at most 5 minutes) outlasted the cache's grace period since the Pod started, be evicted,
/// and the Pod's next start would find nothing.
pub fn open_base(b: &BaseImage) -> Result<std::fs::File, DiskError> {
    let f = std::fs::File::open(&b.path).map_err(FileError::at("open", &b.path))?;
    f.lock_shared().map_err(FileError::at(
        "lock (shared: in use) the node image",
        &b.path,
    ))?;
    // Best effort: an image on a read-only medium is in no cache.
    if let Err(e) = f.set_modified(std::time::SystemTime::now()) {
        tracing::debug!(error = %e, image = %b.path.display(), "the node image's use is not marked");
    }
    if b.format == DiskFormat::Qcow2 {
        let h =
            qcow2::read_from(&f).map_err(|e| DiskError::Image(b.path.clone(), e.to_string()))?;
        qcow2::self_contained(&b.path, h.backing_file.as_deref(), h.data_file.as_deref())?;
    }
    Ok(f)
}

/// Carries out the plan's actions.
pub fn apply(plan: &DiskPlan, qemu_img_bin: &Path) -> Result<(), DiskError> {
    for a in &plan.actions {
        match a {
            DiskAction::CreateOverlay {
                path,
                backing,
                backing_format,
                size,
            } => create_overlay(qemu_img_bin, path, backing, *backing_format, *size)?,
            DiskAction::GrowOverlay { path, size } => grow_overlay(qemu_img_bin, path, *size)?,
            DiskAction::CreateRaw { path, size } => create_raw(path, *size)?,
            DiskAction::GrowRaw { path, size } => grow_raw(path, *size)?,
            DiskAction::MarkEtcdOwner { dir, owner } => etcd_dir::write_marker(dir, owner)
                .map_err(FileError::at("write the owner marker into", dir))?,
            DiskAction::Keep { .. } => {}
        }
    }
    Ok(())
}

/// Creates the directory `path` is to be made in.
fn create_parent_dir(path: &Path) -> Result<(), DiskError> {
    match path.parent() {
        Some(dir) => {
            Ok(std::fs::create_dir_all(dir).map_err(FileError::at("create directory", dir))?)
        }
        None => Ok(()),
    }
}

/// `qemu-img create` of a qcow2 overlay on `backing`.
fn create_overlay(
    qemu_img_bin: &Path,
    path: &Path,
    backing: &Path,
    backing_format: DiskFormat,
    size: ByteSize,
) -> Result<(), DiskError> {
    create_parent_dir(path)?;
    let backing = std::fs::canonicalize(backing).map_err(FileError::at("resolve", backing))?;
    // -u: qemu-img does not open the base (its header was checked by the planner);
    // the size is given, so it need not. QEMU opens the base itself, read-only and
    // with no backing of its own (`qemu::argv`).
    qemu_img(
        qemu_img_bin,
        &[
            "create",
            "-q",
            "-u",
            "-f",
            "qcow2",
            "-F",
            backing_format.as_str(),
            "-b",
            &backing.display().to_string(),
            &path.display().to_string(),
            &size.0.to_string(),
        ],
    )?;
    Ok(())
}

/// `qemu-img resize` of an overlay up to `size`.
fn grow_overlay(qemu_img_bin: &Path, path: &Path, size: ByteSize) -> Result<(), DiskError> {
    // `backing: null`: growing the overlay opens neither the base nor what it names.
    let opts = serde_json::json!({
        "driver": "qcow2",
        "file": { "driver": "file", "filename": path },
        "backing": null,
    });
    qemu_img(
        qemu_img_bin,
        &["resize", "-q", &format!("json:{opts}"), &size.0.to_string()],
    )?;
    Ok(())
}

/// A new sparse raw file of `size`.
fn create_raw(path: &Path, size: ByteSize) -> Result<(), DiskError> {
    create_parent_dir(path)?;
    // create_new: never clobber a disk that appeared since observation.
    let f = std::fs::File::create_new(path).map_err(FileError::at("create", path))?;
    Ok(f.set_len(size.0).map_err(FileError::at("size", path))?)
}

/// Extends a raw file to `size`; never shrinks it.
fn grow_raw(path: &Path, size: ByteSize) -> Result<(), DiskError> {
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(FileError::at("open", path))?;
    if f.metadata().map(|m| m.len() < size.0).unwrap_or(false) {
        f.set_len(size.0).map_err(FileError::at("grow", path))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request() -> DiskRequest {
        DiskRequest {
            state_dir: "/var/lib/capk".into(),
            image: "/images/flatcar.qcow2".into(),
            image_format: DiskFormat::Qcow2,
            root_size: ByteSize::gib(40),
            docker_size: ByteSize::gib(40),
            kubelet_size: ByteSize::gib(20),
            etcd: Some(EtcdDiskRequest {
                path: "/var/lib/etcd-disk/etcd.img".into(),
                size: ByteSize::gib(10),
                owner: owner("uid-1"),
            }),
        }
    }

    fn owner(uid: &str) -> EtcdOwner {
        EtcdOwner {
            namespace: "team-a".into(),
            name: "demo-cp-0".into(),
            uid: uid.into(),
        }
    }

    #[test]
    fn first_boot_creates_everything() {
        let s = DiskState {
            image_size: Some(ByteSize::gib(8)),
            ..Default::default()
        };
        insta::assert_yaml_snapshot!(plan(&request(), &s).unwrap());
    }

    #[test]
    fn restart_keeps_etcd_even_when_sizes_changed_and_grows_data_disks() {
        let s = DiskState {
            image_size: Some(ByteSize::gib(8)),
            overlay_size: Some(ByteSize::gib(40)),
            docker_size: Some(ByteSize::gib(30)),
            kubelet_size: Some(ByteSize::gib(20)),
            etcd_size: Some(ByteSize::gib(5)),
            etcd_marker: Marker::Owner(owner("uid-1")),
            ..Default::default()
        };
        let p = plan(&request(), &s).unwrap();
        assert_eq!(
            p.actions,
            vec![
                DiskAction::Keep {
                    path: "/var/lib/capk/root.qcow2".into()
                },
                DiskAction::GrowRaw {
                    path: "/var/lib/capk/docker.img".into(),
                    size: ByteSize::gib(40)
                },
                DiskAction::Keep {
                    path: "/var/lib/capk/kubelet.img".into()
                },
                DiskAction::Keep {
                    path: "/var/lib/etcd-disk/etcd.img".into()
                },
            ]
        );
    }

    #[test]
    fn root_smaller_than_image_is_refused() {
        let mut r = request();
        r.root_size = ByteSize::gib(4);
        let s = DiskState {
            image_size: Some(ByteSize::gib(8)),
            ..Default::default()
        };
        assert_eq!(
            plan(&r, &s).unwrap_err().to_string(),
            "disk size 4Gi is smaller than the node image's 8Gi; raise --disk-size"
        );
    }

    /// The etcd directory is marked as the machine's before its disk is made; a restart uses
    /// it; a machine of another UID (a tenant whose path names this directory, or a machine made
    /// again under the same name) is refused before anything changes, and so is a disk without
    /// a marker.
    #[test]
    fn the_etcd_directory_is_marked_at_creation_and_refused_to_another_machine() {
        let dir = tempfile::tempdir().unwrap();
        let image = dir.path().join("node.raw");
        std::fs::File::create(&image)
            .unwrap()
            .set_len(1 << 20)
            .unwrap();
        let etcd_dir = dir.path().join("etcd/team-a/demo-cp-0");
        let request = |uid: &str| DiskRequest {
            etcd: Some(EtcdDiskRequest {
                path: etcd_dir.join("etcd.img"),
                size: ByteSize::mib(16),
                owner: owner(uid),
            }),
            ..root_only(dir.path(), &image, DiskFormat::Raw)
        };
        // Only the etcd actions: the overlay would need qemu-img.
        let apply_etcd = |p: &DiskPlan| {
            let etcd = DiskPlan {
                actions: p.actions[1..].to_vec(),
                attachments: vec![],
            };
            apply(&etcd, Path::new("/nonexistent/qemu-img")).unwrap();
        };
        let r = request("uid-1");
        let p = plan(&r, &observe(&r).unwrap()).unwrap();
        assert_eq!(
            p.actions[1..],
            [
                DiskAction::MarkEtcdOwner {
                    dir: etcd_dir.clone(),
                    owner: owner("uid-1")
                },
                DiskAction::CreateRaw {
                    path: etcd_dir.join("etcd.img"),
                    size: ByteSize::mib(16)
                },
            ]
        );
        apply_etcd(&p);
        assert_eq!(
            etcd_dir::read_marker(&etcd_dir),
            Marker::Owner(owner("uid-1"))
        );
        // A restart: the disk is used as it is.
        let p = plan(&r, &observe(&r).unwrap()).unwrap();
        assert_eq!(
            p.actions[1..],
            [DiskAction::Keep {
                path: etcd_dir.join("etcd.img")
            }]
        );
        // Another machine whose directory is this one.
        let other = request("uid-2");
        let e = plan(&other, &observe(&other).unwrap()).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "etcd directory {}: its owner marker names KVMMachine team-a/demo-cp-0 (uid \
                 uid-1), not this machine team-a/demo-cp-0 (uid uid-2); its data is left alone: \
                 give this machine another etcdStorage, or remove that directory on the node if \
                 its machine is gone",
                etcd_dir.display()
            )
        );
        // An etcd disk nobody marked.
        std::fs::remove_file(etcd_dir.join(etcd_dir::MARKER_FILE)).unwrap();
        let e = plan(&r, &observe(&r).unwrap()).unwrap_err().to_string();
        assert!(e.contains("it has no owner marker .capk-owner"), "{e}");
    }

    /// Real qemu-img: the overlay is backed by the image (no copy) and a second apply keeps
    /// the etcd disk's bytes.
    #[test]
    fn apply_creates_overlay_and_keeps_etcd_bytes() {
        let Some(qemu_img_bin) =
            crate::testsupport::require_tool("qemu-img", "apt-get install qemu-utils")
        else {
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let image = dir.path().join("base.qcow2");
        qemu_img(
            &qemu_img_bin,
            &[
                "create",
                "-q",
                "-f",
                "qcow2",
                &image.display().to_string(),
                "64M",
            ],
        )
        .unwrap();
        let r = DiskRequest {
            state_dir: dir.path().join("state"),
            image: image.clone(),
            image_format: DiskFormat::Qcow2,
            root_size: ByteSize::mib(128),
            docker_size: ByteSize::mib(32),
            kubelet_size: ByteSize(0),
            etcd: Some(EtcdDiskRequest {
                path: dir.path().join("etcd/etcd.img"),
                size: ByteSize::mib(16),
                owner: owner("uid-1"),
            }),
        };
        let p = plan(&r, &observe(&r).unwrap()).unwrap();
        apply(&p, &qemu_img_bin).unwrap();
        let info = qemu_img(
            &qemu_img_bin,
            &[
                "info",
                "--output=json",
                &dir.path().join("state/root.qcow2").display().to_string(),
            ],
        )
        .unwrap();
        let v: serde_json::Value = serde_json::from_str(&info).unwrap();
        assert_eq!(v["virtual-size"], 128 << 20);
        assert_eq!(v["backing-filename"], image.display().to_string());
        assert_eq!(
            std::fs::metadata(dir.path().join("state/docker.img"))
                .unwrap()
                .len(),
            32 << 20
        );

        let etcd = dir.path().join("etcd/etcd.img");
        std::fs::write(&etcd, b"etcd data from the first boot").unwrap();
        let s = observe(&r).unwrap();
        let p = plan(&r, &s).unwrap();
        apply(&p, &qemu_img_bin).unwrap();
        assert_eq!(
            std::fs::read(&etcd).unwrap(),
            b"etcd data from the first boot"
        );
    }

    /// The sizes read from the files are what `qemu-img info` says, for qcow2 (an odd size, an
    /// overlay with a backing file) and raw; a file that is not qcow2 is refused with the cause.
    #[test]
    fn virtual_sizes_match_qemu_img_info() {
        let Some(qemu_img_bin) =
            crate::testsupport::require_tool("qemu-img", "apt-get install qemu-utils")
        else {
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("base.qcow2");
        let overlay = dir.path().join("overlay.qcow2");
        let raw = dir.path().join("disk.raw");
        let b = base.display().to_string();
        qemu_img(
            &qemu_img_bin,
            &["create", "-q", "-f", "qcow2", &b, "100000000"],
        )
        .unwrap();
        let o = overlay.display().to_string();
        let args = [
            "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", &b, &o, "3G",
        ];
        qemu_img(&qemu_img_bin, &args).unwrap();
        std::fs::File::create(&raw)
            .unwrap()
            .set_len(12_345_678)
            .unwrap();
        for (path, format) in [
            (&base, DiskFormat::Qcow2),
            (&overlay, DiskFormat::Qcow2),
            (&raw, DiskFormat::Raw),
        ] {
            let p = path.display().to_string();
            let info = qemu_img(
                &qemu_img_bin,
                &["info", "--output=json", "-f", format.as_str(), &p],
            )
            .unwrap();
            let v: serde_json::Value = serde_json::from_str(&info).unwrap();
            assert_eq!(
                Some(read_image(path, format).unwrap().0.0),
                v["virtual-size"].as_u64(),
                "{p}"
            );
        }
        assert_eq!(
            read_image(&raw, DiskFormat::Qcow2).unwrap_err().to_string(),
            format!(
                "node image {}: not a qcow2 image (no qcow2 magic); is --image-format right?",
                raw.display()
            )
        );
        let missing = dir.path().join("missing.qcow2");
        assert!(
            read_image(&missing, DiskFormat::Qcow2)
                .unwrap_err()
                .to_string()
                .contains("No such file or directory")
        );
    }

    /// A 128 MiB root disk on `image`, state under `dir`, no data disks.
    fn root_only(dir: &Path, image: &Path, image_format: DiskFormat) -> DiskRequest {
        DiskRequest {
            state_dir: dir.join("state"),
            image: image.to_path_buf(),
            image_format,
            root_size: ByteSize::mib(128),
            docker_size: ByteSize(0),
            kubelet_size: ByteSize(0),
            etcd: None,
        }
    }

    /// A scratch directory and the real qemu-img, to make crafted node images in; `None` (the
    /// test skips, or fails under CI) without qemu-img.
    struct ImageBench {
        qemu_img: PathBuf,
        dir: tempfile::TempDir,
    }

    impl ImageBench {
        fn new() -> Option<Self> {
            let qemu_img =
                crate::testsupport::require_tool("qemu-img", "apt-get install qemu-utils")?;
            let dir = tempfile::tempdir().unwrap();
            Some(Self { qemu_img, dir })
        }

        /// The path of `name` in the directory, as text.
        fn path(&self, name: &str) -> String {
            self.dir.path().join(name).display().to_string()
        }

        /// `qemu-img create -q -f qcow2 <extra> <name> 64M`.
        fn create_qcow2(&self, name: &str, extra: &[&str]) {
            let image = self.path(name);
            let mut args = vec!["create", "-q", "-f", "qcow2"];
            args.extend_from_slice(extra);
            args.extend_from_slice(&[&image, "64M"]);
            qemu_img(&self.qemu_img, &args).unwrap();
        }
    }

    /// Crafted node images made by the real qemu-img whose headers name something outside the
    /// image: a host file, a raw block device, an nbd export through a `json:` name, an external
    /// data file. Each is refused by observe → plan (before qemu-img or QEMU opens it), with a
    /// message naming what the header names; the self-contained image of the same size passes.
    #[test]
    fn images_that_name_other_files_are_refused() {
        let Some(bench) = ImageBench::new() else {
            return;
        };
        let dir = &bench.dir;
        let d = |name: &str| bench.path(name);
        // Stands in for a copy of /etc/shadow: a host file a tenant must never read.
        std::fs::write(d("shadow"), "root:$y$j9T$secret:19000:0:99999:7:::\n").unwrap();
        let nbd = r#"json:{"file":{"driver":"nbd","server":{"type":"inet","host":"127.0.0.1","port":"10809"},"export":"root"}}"#;
        let create = |image: &str, extra: &[&str]| bench.create_qcow2(image, extra);
        let shadow = d("shadow");
        let data = d("data.raw");
        let data_file = format!("data_file={data},data_file_raw=on");
        create("host-file.qcow2", &["-F", "raw", "-b", &shadow]);
        // -u: the device need not exist here to be named.
        create("device.qcow2", &["-u", "-F", "raw", "-b", "/dev/vda"]);
        create("nbd.qcow2", &["-u", "-F", "raw", "-b", nbd]);
        create("data-file.qcow2", &["-o", &data_file]);
        create("clean.qcow2", &[]);
        let cases = [
            ("host-file.qcow2", format!("a backing file ({shadow})")),
            ("device.qcow2", "a backing file (/dev/vda)".to_string()),
            ("nbd.qcow2", format!("a backing file ({nbd})")),
            ("data-file.qcow2", format!("an external data file ({data})")),
        ];
        for (image, names) in cases {
            let r = root_only(dir.path(), &dir.path().join(image), DiskFormat::Qcow2);
            let err = plan(&r, &observe(&r).unwrap()).unwrap_err();
            assert_eq!(
                err.to_string(),
                format!(
                    "node image {}: the qcow2 header names {names}; a node image must be \
                     self-contained: flatten it with `qemu-img convert -O qcow2 <image> <new image>`",
                    d(image)
                )
            );
        }
        let r = root_only(
            dir.path(),
            &dir.path().join("clean.qcow2"),
            DiskFormat::Qcow2,
        );
        assert!(plan(&r, &observe(&r).unwrap()).is_ok());
        assert!(!dir.path().join("state").exists(), "nothing was created");
    }

    /// The image QEMU gets is checked again on the descriptor it gets: a clean image replaced
    /// after planning by one naming a host file is refused when opened for QEMU.
    #[test]
    fn an_image_replaced_after_planning_is_refused_when_opened_for_qemu() {
        let Some(bench) = ImageBench::new() else {
            return;
        };
        let dir = &bench.dir;
        let d = |name: &str| bench.path(name);
        std::fs::write(d("shadow"), "secret\n").unwrap();
        bench.create_qcow2("node.qcow2", &[]);
        let r = root_only(
            dir.path(),
            &dir.path().join("node.qcow2"),
            DiskFormat::Qcow2,
        );
        let p = plan(&r, &observe(&r).unwrap()).unwrap();
        let base = p.attachments[0].base.clone().unwrap();
        assert!(open_base(&base).is_ok());
        bench.create_qcow2("evil.qcow2", &["-F", "raw", "-b", &d("shadow")]);
        std::fs::rename(d("evil.qcow2"), d("node.qcow2")).unwrap();
        let e = open_base(&base).unwrap_err().to_string();
        assert!(
            e.contains(&format!("names a backing file ({})", d("shadow"))),
            "{e}"
        );
    }

    /// A raw image's bytes are the guest's, never a header: a "raw" file that holds a qcow2
    /// header naming a backing file is planned as raw, and QEMU is told `raw` for the base.
    #[test]
    fn raw_images_are_never_read_as_qcow2() {
        let Some(bench) = ImageBench::new() else {
            return;
        };
        let dir = &bench.dir;
        let image = dir.path().join("looks-like-qcow2.raw");
        let header = ["-u", "-F", "raw", "-b", "/dev/vda"];
        bench.create_qcow2("looks-like-qcow2.raw", &header);
        let r = root_only(dir.path(), &image, DiskFormat::Raw);
        let s = observe(&r).unwrap();
        assert_eq!((s.image_backing_file, s.image_data_file), (None, None));
        let p = plan(&r, &observe(&r).unwrap()).unwrap();
        assert_eq!(
            p.attachments[0].base,
            Some(BaseImage {
                path: image,
                format: DiskFormat::Raw
            })
        );
    }
}
