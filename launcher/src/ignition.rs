//! Ignition handed to the guest: the machine's config (from the controller's Ignition Secret)
//! with this boot's facts merged in by capk-bootstrap's [`MachineOverlay`], the one place that
//! turns machine facts into Ignition (the controller uses the same code).
//!
//! Plan, then apply: [`overlay`] is pure (attached disks, host volumes and the DHCP naming in, a
//! [`MachineOverlay`] out) and [`prepare`] reads, merges and writes the file QEMU serves by fw_cfg
//! (under every name in [`argv::IGNITION_FW_CFG_NAMES`], so upstream's and Flatcar's Ignition both
//! find it).

use std::io::Write;
use std::net::IpAddr;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use capk_bootstrap::overlay::{DataDisk, Dns, EtcdDisk, FsFormat, Heartbeat, HostVolume};
use capk_bootstrap::{BootstrapFormat, MachineFacts, MachineOverlay, MergeReport};

use crate::disk;
use crate::qemu::argv::{self, DiskAttachment};

/// Seconds between two heartbeat lines from the guest (the readiness timeout is a flag, 90 s by
/// default, so a few lost lines do not flap readiness).
pub const HEARTBEAT_INTERVAL_SECONDS: u32 = 5;

/// Filesystem of the containerd, kubelet and etcd disks. ext4 rather than the legacy xfs:
/// mkfs.xfs refuses filesystems smaller than 300 MiB, and small disks are valid specs.
pub const DATA_DISK_FORMAT: FsFormat = FsFormat::Ext4;

/// What the launcher knows about this boot, as the overlay needs it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BootInputs {
    /// The node name.
    pub hostname: String,
    /// DNS servers the guest is given (also served by DHCP).
    pub dns_servers: Vec<IpAddr>,
    /// DNS search domains.
    pub dns_search: Vec<String>,
    /// NTP servers.
    pub ntp_servers: Vec<String>,
    /// iSCSI initiator name (stable per machine).
    pub iscsi_initiator_name: Option<String>,
    /// Disks attached to the VM.
    pub disks: Vec<DiskAttachment>,
    /// Host volumes shared over virtio-9p.
    pub host_volumes: Vec<argv::HostVolume>,
}

/// The per-boot facts as a capk-bootstrap overlay: hostname, DNS, NTP, iSCSI name, a
/// filesystem and mount unit per data disk (containerd, kubelet: scratch, formatted at first
/// boot; etcd at `/var/lib/etcd`: formatted only when blank), a 9p mount per host volume
/// (`/data/<tag>`), and the heartbeat unit on the launcher's virtio-serial port.
pub fn overlay(inputs: &BootInputs) -> MachineOverlay {
    let scratch = |serial: &str, mount_path: &str, label: &str| DataDisk {
        serial: serial.to_string(),
        format: DATA_DISK_FORMAT,
        mount_path: mount_path.to_string(),
        label: Some(label.to_string()),
        wipe: true,
    };
    let mut data_disks = Vec::new();
    let mut etcd_disk = None;
    for d in &inputs.disks {
        match d.serial.as_str() {
            disk::DOCKER_SERIAL => {
                data_disks.push(scratch(&d.serial, "/var/lib/containerd", "containerd"))
            }
            disk::KUBELET_SERIAL => {
                data_disks.push(scratch(&d.serial, "/var/lib/kubelet", "kubelet"))
            }
            disk::ETCD_SERIAL => {
                etcd_disk = Some(EtcdDisk {
                    serial: d.serial.clone(),
                    format: DATA_DISK_FORMAT,
                })
            }
            _ => {}
        }
    }
    let dns = (!inputs.dns_servers.is_empty() || !inputs.dns_search.is_empty()).then(|| Dns {
        servers: inputs.dns_servers.clone(),
        search: inputs.dns_search.clone(),
    });
    MachineOverlay {
        hostname: inputs.hostname.clone(),
        dns,
        ntp_servers: inputs.ntp_servers.clone(),
        iscsi_initiator_name: inputs.iscsi_initiator_name.clone(),
        data_disks,
        etcd_disk,
        host_volumes: inputs
            .host_volumes
            .iter()
            .map(|v| HostVolume {
                tag: v.tag.clone(),
                mount_path: None,
                read_only: v.read_only,
            })
            .collect(),
        heartbeat: Some(Heartbeat {
            port_name: argv::HEARTBEAT_PORT.to_string(),
            interval_seconds: HEARTBEAT_INTERVAL_SECONDS,
        }),
    }
}

/// Ignition preparation failures.
#[derive(Debug, thiserror::Error)]
pub enum IgnitionError {
    /// The file is missing or unreadable.
    #[error("read Ignition config {0}: {1}")]
    Read(PathBuf, String),
    /// Not an Ignition config capk-bootstrap reads (spec 2.3.0 or 3.0.0–3.5.0).
    #[error("{0} is not an Ignition config: {1}")]
    Invalid(PathBuf, String),
    /// Writing the result failed.
    #[error("write {0}: {1}")]
    Write(PathBuf, String),
}

/// Reads the machine's config, merges `overlay` into it, writes the result to `dest` (mode 0600:
/// it holds bootstrap secrets) and returns what the overlay replaced in the machine's config.
pub fn prepare(
    src: &Path,
    dest: &Path,
    overlay: &MachineOverlay,
) -> Result<MergeReport, IgnitionError> {
    let bytes = std::fs::read(src).map_err(|e| IgnitionError::Read(src.into(), e.to_string()))?;
    // The controller stores spec 3.4.0; 2.3.0 and other 3.x are read the same way as by the
    // controller. The facts only feed Jinja placeholders, which Ignition input never has.
    let rendered = capk_bootstrap::render_ignition(
        BootstrapFormat::Ignition,
        &bytes,
        &MachineFacts::new(overlay.hostname.clone()),
        Some(overlay),
    )
    .map_err(|e| IgnitionError::Invalid(src.into(), e.to_string()))?;
    let _ = std::fs::remove_file(dest);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(dest)
        .map_err(|e| IgnitionError::Write(dest.into(), e.to_string()))?;
    f.write_all(&rendered.json)
        .map_err(|e| IgnitionError::Write(dest.into(), e.to_string()))?;
    Ok(rendered.merge)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::qemu::argv::DiskFormat;

    fn inputs() -> BootInputs {
        let d = |serial: &str| DiskAttachment {
            serial: serial.into(),
            path: "/x".into(),
            format: DiskFormat::Raw,
            base: None,
        };
        BootInputs {
            hostname: "capk-md-0-abcde".into(),
            dns_servers: vec!["10.96.0.10".parse().unwrap()],
            dns_search: vec!["cluster.local".into()],
            ntp_servers: vec!["10.0.0.123".into()],
            iscsi_initiator_name: Some("iqn.2016-04.com.coreos.iscsi:capk-1".into()),
            disks: vec![d("rootfs"), d("dockerfs"), d("kubeletfs"), d("etcdfs")],
            host_volumes: vec![
                argv::HostVolume {
                    tag: "shared".into(),
                    path: "/srv".into(),
                    read_only: false,
                    fd: None,
                },
                argv::HostVolume {
                    tag: "config".into(),
                    path: "/srv/config".into(),
                    read_only: true,
                    fd: None,
                },
            ],
        }
    }

    #[test]
    fn boot_facts_become_the_machine_overlay() {
        let o = overlay(&inputs());
        assert_eq!(o.hostname, "capk-md-0-abcde");
        assert_eq!(
            o.data_disks
                .iter()
                .map(|d| (d.serial.as_str(), d.mount_path.as_str(), d.wipe))
                .collect::<Vec<_>>(),
            [
                ("dockerfs", "/var/lib/containerd", true),
                ("kubeletfs", "/var/lib/kubelet", true)
            ]
        );
        assert_eq!(
            o.etcd_disk,
            Some(EtcdDisk {
                serial: "etcdfs".into(),
                format: FsFormat::Ext4
            })
        );
        assert_eq!(o.host_volumes[0].tag, "shared");
        assert!(!o.host_volumes[0].read_only);
        // A read-only share is mounted read-only in the guest too (QEMU refuses writes anyway).
        assert!(o.host_volumes[1].read_only);
        assert_eq!(
            o.heartbeat.as_ref().map(|h| h.port_name.as_str()),
            Some(argv::HEARTBEAT_PORT)
        );
        // capk-bootstrap accepts the facts (it validates them when building the fragment).
        o.fragment().expect("valid overlay");
    }

    #[test]
    fn no_dns_facts_no_dns_dropin() {
        let o = overlay(&BootInputs {
            dns_servers: vec![],
            dns_search: vec![],
            ..inputs()
        });
        assert_eq!(o.dns, None);
    }

    #[test]
    fn merges_facts_and_writes_private_copy() {
        let dir = tempfile::tempdir().unwrap();
        let bad = dir.path().join("bad.json");
        std::fs::write(&bad, "#cloud-config\n").unwrap();
        let e = prepare(&bad, &dir.path().join("out"), &overlay(&inputs())).unwrap_err();
        assert!(
            e.to_string()
                .starts_with(&format!("{} is not an Ignition config", bad.display())),
            "{e}"
        );

        let good = dir.path().join("good.json");
        std::fs::write(
            &good,
            r#"{"ignition":{"version":"3.4.0"},"storage":{"files":[{"path":"/etc/hostname","contents":{"source":"data:,other"}},{"path":"/etc/capk-test","contents":{"source":"data:,hello"}}]}}"#,
        )
        .unwrap();
        let out = dir.path().join("out");
        let report = prepare(&good, &out, &overlay(&inputs())).unwrap();
        assert_eq!(report.replaced.len(), 1, "{report:?}");
        assert_eq!(report.replaced[0].name, "/etc/hostname");
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(&out).unwrap().permissions().mode() & 0o777,
            0o600
        );
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
        /// Every one of `wanted` is the `key` of an entry of the list `list`.
        fn assert_listed(list: &serde_json::Value, key: &str, wanted: &[&str]) {
            let entries = list.as_array().unwrap().iter();
            let found: Vec<&str> = entries.map(|e| e[key].as_str().unwrap()).collect();
            for w in wanted {
                assert!(found.contains(w), "{w} missing from {found:?}");
            }
        }
        assert_listed(
            &v["storage"]["files"],
            "path",
            &[
                "/etc/capk-test",
                "/etc/hostname",
                "/etc/iscsi/initiatorname.iscsi",
                "/etc/capk/heartbeat.sh",
            ],
        );
        assert_listed(
            &v["systemd"]["units"],
            "name",
            &[
                "var-lib-containerd.mount",
                "var-lib-etcd.mount",
                "data-shared.mount",
                "capk-heartbeat.service",
            ],
        );
        let etcd = v["storage"]["filesystems"]
            .as_array()
            .unwrap()
            .iter()
            .find(|f| f["device"] == "/dev/disk/by-id/virtio-etcdfs")
            .expect("etcd filesystem");
        assert_eq!(etcd["wipeFilesystem"], false);
    }
}
