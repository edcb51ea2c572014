//! The per-machine overlay: what it adds, and the conflict rule when bootstrap data collides.

mod support;

use capk_bootstrap::ignition_v3::Config;
use capk_bootstrap::overlay::{ETCD_MOUNT_PATH, EtcdDisk, FsFormat, Replaced};
use capk_bootstrap::{BootstrapFormat, MachineOverlay, convert, to_json};
use support::{facts, full_overlay, ignition_validate, readable, validate};

fn file_text(config: &Config, path: &str) -> Option<String> {
    let json = to_json(config).unwrap();
    let v = readable(&json);
    v["storage"]["files"]
        .as_array()?
        .iter()
        .find(|f| f["path"] == path)
        .map(|f| f["contents"]["source"].as_str().unwrap().to_owned())
}

#[test]
fn machine_facts_win_conflicts_and_are_reported() {
    let bootstrap = b"#cloud-config
write_files:
- path: /etc/hostname
  content: from-bootstrap
- path: /etc/iscsi/initiatorname.iscsi
  content: InitiatorName=iqn.2000-01.example:bootstrap
- path: /etc/capk/untouched
  content: kept
mounts:
- [/dev/vdz, /var/lib/etcd, ext4]
";
    let mut config = convert(BootstrapFormat::CloudConfig, bootstrap, &facts()).unwrap();
    let report = full_overlay().apply(&mut config).unwrap();
    assert_eq!(
        report.replaced,
        vec![
            Replaced {
                kind: "file",
                name: "/etc/hostname".into()
            },
            Replaced {
                kind: "file",
                name: "/etc/iscsi/initiatorname.iscsi".into()
            },
            Replaced {
                kind: "unit",
                name: "var-lib-etcd.mount".into()
            },
        ]
    );
    assert_eq!(
        file_text(&config, "/etc/hostname").unwrap(),
        "capk-md-0-abcde\n"
    );
    assert_eq!(
        file_text(&config, "/etc/iscsi/initiatorname.iscsi").unwrap(),
        "InitiatorName=iqn.2016-04.com.coreos.iscsi:capk-abcde-worker-0\n"
    );
    assert_eq!(file_text(&config, "/etc/capk/untouched").unwrap(), "kept");
    let units = config.systemd.as_ref().unwrap().units.as_ref().unwrap();
    let etcd: Vec<_> = units
        .iter()
        .filter(|u| u.name == "var-lib-etcd.mount")
        .collect();
    assert_eq!(etcd.len(), 1, "exactly one mount unit for /var/lib/etcd");
    assert!(
        etcd[0]
            .contents
            .as_ref()
            .unwrap()
            .contains("What=/dev/disk/by-id/virtio-etcd")
    );
    if let Some(bin) = ignition_validate() {
        validate(&bin, "merged config", &to_json(&config).unwrap(), false);
    }
}

#[test]
fn a_directory_at_an_overlay_file_path_is_replaced() {
    let bootstrap =
        br#"{"ignition":{"version":"3.4.0"},"storage":{"directories":[{"path":"/etc/hostname"}]}}"#;
    let mut config = convert(BootstrapFormat::Ignition, bootstrap, &facts()).unwrap();
    let overlay = MachineOverlay {
        hostname: "n1".into(),
        ..Default::default()
    };
    let report = overlay.apply(&mut config).unwrap();
    assert_eq!(
        report.replaced,
        vec![Replaced {
            kind: "directory",
            name: "/etc/hostname".into()
        }]
    );
    assert!(config.storage.as_ref().unwrap().directories.is_none());
}

#[test]
fn etcd_disk_is_formatted_only_when_blank() {
    let overlay = MachineOverlay {
        hostname: "cp-0".into(),
        etcd_disk: Some(EtcdDisk {
            serial: "etcd".into(),
            format: FsFormat::Xfs,
        }),
        ..Default::default()
    };
    let fragment = overlay.fragment().unwrap();
    let fs = &fragment
        .storage
        .as_ref()
        .unwrap()
        .filesystems
        .as_ref()
        .unwrap()[0];
    assert_eq!(fs.device, "/dev/disk/by-id/virtio-etcd");
    assert_eq!(fs.format.as_deref(), Some("xfs"));
    // Ignition reuses a matching filesystem and creates one only on a blank disk.
    assert_eq!(fs.wipe_filesystem, Some(false));
    let unit = &fragment.systemd.as_ref().unwrap().units.as_ref().unwrap()[0];
    assert_eq!(unit.name, "var-lib-etcd.mount");
    assert!(
        unit.contents
            .as_ref()
            .unwrap()
            .contains(&format!("Where={ETCD_MOUNT_PATH}\n"))
    );
}

#[test]
fn overlay_ntp_resets_the_bootstrap_servers() {
    let bootstrap = b"#cloud-config\nntp:\n  enabled: true\n  servers: [pool.example]\n";
    let mut config = convert(BootstrapFormat::CloudConfig, bootstrap, &facts()).unwrap();
    full_overlay().apply(&mut config).unwrap();
    let bootstrap_dropin = file_text(
        &config,
        "/etc/systemd/timesyncd.conf.d/50-cloud-config-ntp.conf",
    )
    .unwrap();
    let machine_dropin = file_text(
        &config,
        "/etc/systemd/timesyncd.conf.d/60-capk-machine.conf",
    )
    .unwrap();
    assert!(bootstrap_dropin.contains("NTP=pool.example"));
    // timesyncd reads drop-ins in name order; the empty assignment clears the earlier list.
    assert!(
        machine_dropin.contains("NTP=\nNTP=169.254.169.123\n"),
        "{machine_dropin}"
    );
}

#[test]
fn ignition_templates_can_read_the_hostname_from_an_environment_file() {
    let fragment = MachineOverlay {
        hostname: "md-0-abc".into(),
        ..Default::default()
    }
    .fragment()
    .unwrap();
    assert_eq!(
        file_text(&fragment, capk_bootstrap::overlay::METADATA_ENV_FILE).unwrap(),
        "CAPK_HOSTNAME=md-0-abc\n"
    );
}
