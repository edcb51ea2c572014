//! Ignition handed to the guest. Per-boot facts are merged by an overlay function; the seam
//! below is where capk-bootstrap's overlay plugs in (until then the config passes unchanged).

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::disk;
use crate::qemu::argv::{DiskAttachment, HostVolume};

/// Per-boot facts the overlay merges into the machine's Ignition.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct BootFacts {
    /// Hostname.
    pub hostname: String,
    /// Role.
    pub role: String,
    /// DNS servers.
    pub dns_servers: Vec<String>,
    /// DNS search domains.
    pub dns_search: Vec<String>,
    /// NTP servers.
    pub ntp_servers: Vec<String>,
    /// iSCSI initiator name.
    pub iscsi_initiator_name: Option<String>,
    /// Data disks as (virtio serial, mount point).
    pub mounts: Vec<(String, String)>,
    /// virtio-serial port name of the heartbeat.
    pub heartbeat_port: String,
}

/// Where the guest mounts each data disk (by virtio serial) and each host volume (9p tag,
/// written as `9p:<tag>`): the facts the overlay turns into filesystems and mount units.
pub fn boot_mounts(disks: &[DiskAttachment], host_volumes: &[HostVolume]) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = disks
        .iter()
        .filter_map(|d| {
            let at = match d.serial.as_str() {
                disk::DOCKER_SERIAL => "/var/lib/containerd",
                disk::KUBELET_SERIAL => "/var/lib/kubelet",
                disk::ETCD_SERIAL => "/var/lib/etcd",
                _ => return None,
            };
            Some((d.serial.clone(), at.to_string()))
        })
        .collect();
    out.extend(
        host_volumes
            .iter()
            .map(|v| (format!("9p:{}", v.tag), format!("/data/{}", v.tag))),
    );
    out
}

/// Ignition preparation failures.
#[derive(Debug, thiserror::Error)]
pub enum IgnitionError {
    /// The file is missing or unreadable.
    #[error("read Ignition config {0}: {1}")]
    Read(PathBuf, String),
    /// Not an Ignition config.
    #[error("{0} is not an Ignition config: {1}")]
    Invalid(PathBuf, String),
    /// The overlay failed.
    #[error("merge per-boot facts into Ignition: {0}")]
    Overlay(String),
    /// Writing the result failed.
    #[error("write {0}: {1}")]
    Write(PathBuf, String),
}

/// The overlay seam: machine Ignition + per-boot facts → Ignition QEMU hands to the guest.
pub type OverlayFn = fn(&[u8], &BootFacts) -> Result<Vec<u8>, String>;

/// Overlay used until the launcher is pointed at capk-bootstrap's: returns the config as is.
pub fn unchanged(config: &[u8], _facts: &BootFacts) -> Result<Vec<u8>, String> {
    Ok(config.to_vec())
}

/// Reads and checks the machine's config, applies `overlay`, writes the result to `dest`
/// (mode 0600: it holds bootstrap secrets) and returns `dest`.
pub fn prepare(
    src: &Path,
    dest: &Path,
    facts: &BootFacts,
    overlay: OverlayFn,
) -> Result<PathBuf, IgnitionError> {
    let bytes = std::fs::read(src).map_err(|e| IgnitionError::Read(src.into(), e.to_string()))?;
    let v: serde_json::Value = serde_json::from_slice(&bytes)
        .map_err(|e| IgnitionError::Invalid(src.into(), e.to_string()))?;
    if v["ignition"]["version"].as_str().is_none() {
        return Err(IgnitionError::Invalid(
            src.into(),
            "no ignition.version".into(),
        ));
    }
    let merged = overlay(&bytes, facts).map_err(IgnitionError::Overlay)?;
    let _ = std::fs::remove_file(dest);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(dest)
        .map_err(|e| IgnitionError::Write(dest.into(), e.to_string()))?;
    f.write_all(&merged)
        .map_err(|e| IgnitionError::Write(dest.into(), e.to_string()))?;
    Ok(dest.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::qemu::argv::DiskFormat;

    #[test]
    fn data_disks_and_host_volumes_get_their_mount_points() {
        let d = |serial: &str| DiskAttachment {
            serial: serial.into(),
            path: "/x".into(),
            format: DiskFormat::Raw,
        };
        let m = boot_mounts(
            &[d("rootfs"), d("dockerfs"), d("kubeletfs"), d("etcdfs")],
            &[HostVolume {
                tag: "shared".into(),
                path: "/srv".into(),
            }],
        );
        assert_eq!(
            m,
            [
                ("dockerfs", "/var/lib/containerd"),
                ("kubeletfs", "/var/lib/kubelet"),
                ("etcdfs", "/var/lib/etcd"),
                ("9p:shared", "/data/shared"),
            ]
            .map(|(a, b)| (a.to_string(), b.to_string()))
        );
    }

    #[test]
    fn rejects_non_ignition_and_writes_private_copy() {
        let dir = tempfile::tempdir().unwrap();
        let bad = dir.path().join("bad.json");
        std::fs::write(&bad, "#cloud-config\n").unwrap();
        let e = prepare(
            &bad,
            &dir.path().join("out"),
            &BootFacts::default(),
            unchanged,
        )
        .unwrap_err();
        assert!(
            e.to_string()
                .starts_with(&format!("{} is not an Ignition config", bad.display()))
        );

        let good = dir.path().join("good.json");
        std::fs::write(&good, r#"{"ignition":{"version":"3.4.0"}}"#).unwrap();
        let out = prepare(
            &good,
            &dir.path().join("out"),
            &BootFacts::default(),
            unchanged,
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(&out).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(std::fs::read(&out).unwrap(), std::fs::read(&good).unwrap());
    }
}
