//! Every error path: the input that triggers it, the key or value its message must name, and
//! the full message (snapshotted, so a reworded message is a reviewed change).

use std::fmt::Write as _;

use capk_bootstrap::overlay::{DataDisk, Dns, FsFormat, Heartbeat, HostVolume};
use capk_bootstrap::{
    BootstrapFormat, ConvertError, MAX_INPUT_BYTES, MAX_OUTPUT_BYTES, MachineFacts, MachineOverlay,
    convert, render_ignition,
};

const CC: BootstrapFormat = BootstrapFormat::CloudConfig;
const IGN: BootstrapFormat = BootstrapFormat::Ignition;

fn facts() -> MachineFacts {
    MachineFacts {
        hostname: "node-1".into(),
        instance_id: "i-1".into(),
    }
}

fn cc(body: &str) -> Vec<u8> {
    format!("#cloud-config\n{body}").into_bytes()
}

fn ign23(body: &str) -> Vec<u8> {
    format!(r#"{{"ignition":{{"version":"2.3.0"}},{body}}}"#).into_bytes()
}

/// (case name, format, input, text the message must contain)
fn conversion_cases() -> Vec<(&'static str, BootstrapFormat, Vec<u8>, &'static str)> {
    vec![
        ("not utf-8", CC, b"#cloud-config\n\xff".to_vec(), "offset 14"),
        ("shell script user data", CC, b"#!/bin/bash\necho hi\n".to_vec(), "#cloud-config"),
        (
            "jinja header without cloud-config",
            CC,
            b"## template: jinja\n#!/bin/bash\n".to_vec(),
            "#cloud-config",
        ),
        (
            "unknown jinja variable",
            CC,
            b"## template: jinja\n#cloud-config\nruncmd:\n  - echo {{ ds.meta_data.region }}\n".to_vec(),
            "{{ ds.meta_data.region }}` on line 4",
        ),
        (
            "jinja statement",
            CC,
            b"## template: jinja\n#cloud-config\n{% set x = 1 %}\n".to_vec(),
            "{% set x = 1 %}",
        ),
        ("invalid yaml", CC, cc("write_files: [\n"), "cloud-config is not valid"),
        ("document not a mapping", CC, cc("- a\n- b\n"), "not a mapping"),
        ("unknown top-level key", CC, cc("foo: 1\n"), "`foo`"),
        ("packages", CC, cc("packages: [vim]\n"), "no package manager"),
        ("hostname key", CC, cc("hostname: x\n"), "comes from the Machine"),
        (
            "unknown write_files key",
            CC,
            cc("write_files:\n- path: /a\n  defer: true\n"),
            "`write_files[0].defer`",
        ),
        ("write_files not a list", CC, cc("write_files: 3\n"), "`write_files`"),
        (
            "write_files relative path",
            CC,
            cc("write_files:\n- path: etc/x\n"),
            "`write_files[0].path`",
        ),
        (
            "write_files to /proc",
            CC,
            cc("write_files:\n- path: /proc/sys/x\n"),
            "`write_files[0].path`",
        ),
        (
            "unknown encoding",
            CC,
            cc("write_files:\n- path: /a\n  encoding: zstd\n  content: x\n"),
            "`write_files[0].encoding`",
        ),
        (
            "bad base64",
            CC,
            cc("write_files:\n- path: /a\n  encoding: b64\n  content: '!!'\n"),
            "`write_files[0].content`: content is not valid base64",
        ),
        (
            "bad gzip",
            CC,
            cc("write_files:\n- path: /a\n  encoding: gzip+base64\n  content: aGVsbG8=\n"),
            "`write_files[0].content`: content is not a valid gzip stream",
        ),
        (
            "numeric permissions",
            CC,
            cc("write_files:\n- path: /a\n  permissions: 420\n"),
            "`write_files[0].permissions`",
        ),
        (
            "non-octal permissions",
            CC,
            cc("write_files:\n- path: /a\n  permissions: '0899'\n"),
            "`0899`",
        ),
        (
            "content of the wrong type",
            CC,
            cc("write_files:\n- path: /a\n  content: [1]\n"),
            "`write_files[0].content`",
        ),
        (
            "append of the wrong type",
            CC,
            cc("write_files:\n- path: /a\n  append: maybe\n"),
            "`write_files[0].append`",
        ),
        (
            "yaml binary tag",
            CC,
            cc("write_files:\n- path: /b\n  content: !!binary |\n    AAECAw==\n"),
            "`!!binary` on line 4",
        ),
        ("runcmd mapping entry", CC, cc("runcmd:\n- {a: b}\n"), "`runcmd[0]`"),
        ("runcmd empty argv", CC, cc("runcmd:\n- []\n"), "`runcmd[0]`"),
        ("runcmd argv with a list", CC, cc("runcmd:\n- [echo, [x]]\n"), "`runcmd[0][1]`"),
        ("bootcmd not a list", CC, cc("bootcmd: echo\n"), "`bootcmd`"),
        (
            "users inactive",
            CC,
            cc("users:\n- name: a\n  inactive: '5'\n"),
            "`users[0].inactive`",
        ),
        ("users without name", CC, cc("users:\n- {shell: /bin/sh}\n"), "`users[0]`: missing field `name`"),
        ("users empty name", CC, cc("users:\n- name: ''\n"), "`users[0].name`"),
        ("users twice", CC, cc("users:\n- name: a\n- name: a\n"), "`users[1].name`"),
        (
            "write_files on a generated path",
            CC,
            cc("write_files:\n- path: /etc/capk/bootstrap/runcmd.sh\nruncmd: [x]\n"),
            "`write_files[0].path`: `/etc/capk/bootstrap/runcmd.sh` is reserved",
        ),
        (
            "write_files on the generated sudoers file",
            CC,
            cc("write_files:\n- path: /etc/sudoers.d/90-cloud-init-users\nusers:\n- {name: a, sudo: ALL}\n"),
            "`/etc/sudoers.d/90-cloud-init-users` is also defined at `storage.files[0].path`",
        ),
        (
            "ignition 3 unit twice",
            IGN,
            br#"{"ignition":{"version":"3.4.0"},"systemd":{"units":[{"name":"a.service"},{"name":"a.service","mask":true}]}}"#.to_vec(),
            "`systemd.units[1].name`",
        ),
        (
            "ignition 2.3 file and directory at one path",
            IGN,
            ign23(
                r#""storage":{"files":[{"filesystem":"root","path":"/x"}],"directories":[{"filesystem":"root","path":"/x"}]}"#,
            ),
            "`storage.directories[0].path`",
        ),
        (
            "ignition 3 filesystem twice",
            IGN,
            br#"{"ignition":{"version":"3.0.0"},"storage":{"filesystems":[{"device":"/dev/vdb","format":"ext4"},{"device":"/dev/vdb","format":"xfs"}]}}"#.to_vec(),
            "`storage.filesystems[1].device`",
        ),
        ("users bad groups", CC, cc("users:\n- name: a\n  groups: 3\n"), "`users[0].groups`"),
        ("users bad sudo", CC, cc("users:\n- name: a\n  sudo: {x: y}\n"), "`users[0].sudo`"),
        ("ntp client", CC, cc("ntp:\n  ntp_client: chrony\n"), "`ntp.ntp_client`"),
        ("ntp bad server", CC, cc("ntp:\n  servers: ['a b']\n"), "`ntp.servers`"),
        (
            "disk_setup mbr",
            CC,
            cc("disk_setup:\n  /dev/vdb:\n    table_type: mbr\n    layout: true\n"),
            "`disk_setup./dev/vdb.table_type`",
        ),
        (
            "disk_setup alias",
            CC,
            cc("disk_setup:\n  ephemeral0:\n    layout: true\n"),
            "`disk_setup.ephemeral0`",
        ),
        (
            "disk_setup half disk",
            CC,
            cc("disk_setup:\n  /dev/vdb:\n    layout: [50]\n"),
            "`disk_setup./dev/vdb.layout`",
        ),
        (
            "disk_setup two partitions",
            CC,
            cc("disk_setup:\n  /dev/vdb:\n    layout: [50, 50]\n"),
            "`disk_setup./dev/vdb.layout`",
        ),
        (
            "disk_setup unknown type",
            CC,
            cc("disk_setup:\n  /dev/vdb:\n    layout: [[100, 99]]\n"),
            "`99`",
        ),
        (
            "disk_setup unknown key",
            CC,
            cc("disk_setup:\n  /dev/vdb:\n    layout: true\n    size: 3\n"),
            "`disk_setup./dev/vdb.size`",
        ),
        (
            "fs_setup ext3",
            CC,
            cc("fs_setup:\n- filesystem: ext3\n  device: /dev/vdb\n"),
            "`fs_setup[0].filesystem`",
        ),
        (
            "fs_setup without filesystem",
            CC,
            cc("fs_setup:\n- device: /dev/vdb\n"),
            "`fs_setup[0].filesystem`",
        ),
        (
            "fs_setup replace_fs",
            CC,
            cc("fs_setup:\n- filesystem: ext4\n  device: /dev/vdb\n  replace_fs: ntfs\n"),
            "`fs_setup[0].replace_fs`",
        ),
        (
            "fs_setup bad partition",
            CC,
            cc("fs_setup:\n- filesystem: ext4\n  device: /dev/vdb\n  partition: first\n"),
            "`fs_setup[0].partition`",
        ),
        (
            "fs_setup alias device",
            CC,
            cc("fs_setup:\n- filesystem: ext4\n  device: ephemeral0.1\n"),
            "`fs_setup[0].device`",
        ),
        ("mounts too short", CC, cc("mounts:\n- [/dev/vdb]\n"), "`mounts[0]`"),
        ("mounts swap", CC, cc("mounts:\n- [/dev/vdc, none, swap]\n"), "`mounts[0][1]`"),
        ("mounts relative", CC, cc("mounts:\n- [/dev/vdb, data]\n"), "`mounts[0][1]`"),
        ("mounts alias", CC, cc("mounts:\n- [ephemeral0, /mnt]\n"), "`mounts[0][0]`"),
        ("ignition not json", IGN, b"{".to_vec(), "Ignition config is not valid"),
        ("ignition without version", IGN, br#"{"ignition":{}}"#.to_vec(), "`ignition.version`"),
        (
            "ignition 2.2",
            IGN,
            br#"{"ignition":{"version":"2.2.0"}}"#.to_vec(),
            "`2.2.0`",
        ),
        (
            "ignition 3.6",
            IGN,
            br#"{"ignition":{"version":"3.6.0"}}"#.to_vec(),
            "`3.6.0`",
        ),
        (
            "ignition 2.3 unknown key",
            IGN,
            ign23(r#""storage":{"files":[{"filesystem":"root","path":"/a","foo":1}]}"#),
            "`storage.files[0].foo`",
        ),
        (
            "ignition 2.3 file on a filesystem Ignition mounts",
            IGN,
            ign23(
                r#""storage":{"filesystems":[{"name":"d","mount":{"device":"/dev/vdb","format":"ext4"}}],"files":[{"filesystem":"d","path":"/a"}]}"#,
            ),
            "`storage.files[0].filesystem`",
        ),
        (
            "ignition 2.3 undefined filesystem",
            IGN,
            ign23(r#""storage":{"files":[{"filesystem":"nope","path":"/a"}]}"#),
            "`storage.files[0].filesystem`",
        ),
        (
            "ignition 2.3 filesystem with neither mount nor path",
            IGN,
            ign23(r#""storage":{"filesystems":[{"name":"x"}]}"#),
            "`storage.filesystems[0]`",
        ),
        (
            "ignition 2.3 filesystem with both mount and path",
            IGN,
            ign23(
                r#""storage":{"filesystems":[{"name":"x","path":"/x","mount":{"device":"/dev/vdb","format":"ext4"}}]}"#,
            ),
            "`storage.filesystems[0]`",
        ),
        (
            "ignition 2.3 create with wipeFilesystem",
            IGN,
            ign23(
                r#""storage":{"filesystems":[{"name":"x","mount":{"device":"/dev/vdb","format":"ext4","wipeFilesystem":true,"create":{"force":true}}}]}"#,
            ),
            "`storage.filesystems[0].mount.create`",
        ),
        (
            "ignition 2.3 partition size not MiB",
            IGN,
            ign23(
                r#""storage":{"disks":[{"device":"/dev/vdb","partitions":[{"number":1,"size":1000}]}]}"#,
            ),
            "`storage.disks[0].partitions[0].size`",
        ),
        (
            "ignition 2.3 partition size twice",
            IGN,
            ign23(
                r#""storage":{"disks":[{"device":"/dev/vdb","partitions":[{"number":1,"start":2048,"startMiB":1}]}]}"#,
            ),
            "`storage.disks[0].partitions[0].start`",
        ),
        (
            "ignition 2.3 anonymous partition next to a numbered one",
            IGN,
            ign23(r#""storage":{"disks":[{"device":"/dev/vdb","partitions":[{"number":2},{}]}]}"#),
            "`storage.disks[0].partitions[1]`",
        ),
        (
            "ignition 2.3 append and overwrite",
            IGN,
            ign23(
                r#""storage":{"files":[{"filesystem":"root","path":"/a","append":true,"overwrite":true,"contents":{"source":"data:,x"}}]}"#,
            ),
            "`storage.files[0].overwrite`",
        ),
        (
            "ignition 2.3 networkd unit name",
            IGN,
            ign23(r#""networkd":{"units":[{"name":"../x.network","contents":"x"}]}"#),
            "`networkd.units[0].name`",
        ),
        (
            "ignition 2.3 networkd drop-in name",
            IGN,
            ign23(
                r#""networkd":{"units":[{"name":"a.network","dropins":[{"name":"","contents":"x"}]}]}"#,
            ),
            "`networkd.units[0].dropins[0].name`",
        ),
        (
            "ignition 3.5 key not in 3.4",
            IGN,
            br#"{"ignition":{"version":"3.5.0"},"storage":{"luks":[{"name":"x","cex":{"enabled":true}}]}}"#.to_vec(),
            "`storage.luks[0].cex`",
        ),
        (
            "ignition 3 wrong type",
            IGN,
            br#"{"ignition":{"version":"3.4.0"},"storage":{"files":"x"}}"#.to_vec(),
            "`storage.files`",
        ),
    ]
}

#[test]
fn every_conversion_error_names_its_key_and_is_stable() {
    let mut table = String::new();
    for (name, format, input, needle) in conversion_cases() {
        let err = match convert(format, &input, &facts()) {
            Ok(c) => panic!("{name}: converted instead of failing: {c:?}"),
            Err(e) => e.to_string(),
        };
        assert!(
            err.contains(needle),
            "{name}: message does not contain {needle:?}: {err}"
        );
        writeln!(table, "{name}:\n  {err}").unwrap();
    }
    insta::assert_snapshot!("conversion_error_messages", table);
}

#[test]
fn oversized_input_is_refused_before_parsing() {
    let mut data = cc("runcmd: []\n");
    data.resize(MAX_INPUT_BYTES + 1, b' ');
    let err = convert(CC, &data, &facts()).unwrap_err();
    assert!(matches!(err, ConvertError::InputTooLarge { .. }));
    assert_eq!(
        err.to_string(),
        format!(
            "bootstrap data is {} bytes, over the {MAX_INPUT_BYTES}-byte limit; move large files \
             out of the KubeadmConfig (for example into the node image)",
            MAX_INPUT_BYTES + 1
        )
    );
}

#[test]
fn output_over_the_limit_is_refused() {
    // 400 KiB of spaces percent-encode to 1.2 MB: under the input limit, over the output one.
    let body = format!(
        "write_files:\n- path: /a\n  content: \"{}\"\n",
        " ".repeat(400 * 1024)
    );
    let err = render_ignition(CC, &cc(&body), &facts(), None).unwrap_err();
    let ConvertError::OutputTooLarge { size, limit } = err else {
        panic!("unexpected error {err}");
    };
    assert_eq!(limit, MAX_OUTPUT_BYTES);
    assert!(size > MAX_OUTPUT_BYTES);
    assert!(err_text(size).contains("shrink the bootstrap files"));
}

fn err_text(size: usize) -> String {
    ConvertError::OutputTooLarge {
        size,
        limit: MAX_OUTPUT_BYTES,
    }
    .to_string()
}

#[test]
fn unknown_format_is_named() {
    let err = BootstrapFormat::from_secret(Some("mime-multipart")).unwrap_err();
    assert_eq!(
        err.to_string(),
        "unknown bootstrap data format `mime-multipart`; expected `cloud-config` or `ignition`"
    );
    assert_eq!(BootstrapFormat::from_secret(None).unwrap(), CC);
    assert_eq!(BootstrapFormat::from_secret(Some("ignition")).unwrap(), IGN);
}

#[test]
fn bad_machine_facts_are_refused() {
    let bad_host = MachineFacts {
        hostname: "Node_1".into(),
        instance_id: "i".into(),
    };
    assert_eq!(
        convert(CC, &cc(""), &bad_host).unwrap_err().to_string(),
        "invalid machine hostname `Node_1`: must be RFC 1123 labels of letters, digits and '-', \
         at most 64 bytes"
    );
    let bad_id = MachineFacts {
        hostname: "node".into(),
        instance_id: "a b".into(),
    };
    assert_eq!(
        convert(CC, &cc(""), &bad_id).unwrap_err().to_string(),
        "invalid machine instance id `a b`: must be 1 to 253 letters, digits, '-', '_', '.', ':' \
         or '/'"
    );
}

fn overlay() -> MachineOverlay {
    MachineOverlay {
        hostname: "node-1".into(),
        ..Default::default()
    }
}

#[test]
fn every_overlay_error_names_the_bad_value() {
    let disk = |serial: &str, path: &str, label: Option<&str>, format| DataDisk {
        serial: serial.into(),
        format,
        mount_path: path.into(),
        label: label.map(Into::into),
        wipe: true,
    };
    let cases: Vec<(&str, MachineOverlay, &str)> = vec![
        ("empty hostname", MachineOverlay::default(), "hostname ``"),
        (
            "long hostname",
            MachineOverlay {
                hostname: "a".repeat(65),
                ..overlay()
            },
            "at most 64 bytes",
        ),
        (
            "dns search with a space",
            MachineOverlay {
                dns: Some(Dns {
                    servers: vec![],
                    search: vec!["a b".into()],
                }),
                ..overlay()
            },
            "DNS search domain `a b`",
        ),
        (
            "ntp server with a space",
            MachineOverlay {
                ntp_servers: vec!["a b".into()],
                ..overlay()
            },
            "NTP server `a b`",
        ),
        (
            "iscsi name",
            MachineOverlay {
                iscsi_initiator_name: Some("capk-node".into()),
                ..overlay()
            },
            "iSCSI initiator name `capk-node`",
        ),
        (
            "disk serial too long",
            MachineOverlay {
                data_disks: vec![disk(
                    "a-very-long-serial-number",
                    "/x",
                    None,
                    FsFormat::Ext4,
                )],
                ..overlay()
            },
            "disk serial `a-very-long-serial-number`",
        ),
        (
            "disk on a relative path",
            MachineOverlay {
                data_disks: vec![disk("d", "var/x", None, FsFormat::Ext4)],
                ..overlay()
            },
            "disk mount path `var/x`",
        ),
        (
            "disk on /",
            MachineOverlay {
                data_disks: vec![disk("d", "/", None, FsFormat::Ext4)],
                ..overlay()
            },
            "disk mount path `/`",
        ),
        (
            "xfs label too long",
            MachineOverlay {
                data_disks: vec![disk("d", "/x", Some("containerd-xx"), FsFormat::Xfs)],
                ..overlay()
            },
            "filesystem label `containerd-xx`",
        ),
        (
            "9p tag",
            MachineOverlay {
                host_volumes: vec![HostVolume {
                    tag: "a/b".into(),
                    mount_path: None,
                    read_only: false,
                }],
                ..overlay()
            },
            "9p mount tag `a/b`",
        ),
        (
            "host volume path",
            MachineOverlay {
                host_volumes: vec![HostVolume {
                    tag: "t".into(),
                    mount_path: Some("/a/../b".into()),
                    read_only: false,
                }],
                ..overlay()
            },
            "host volume mount path `/a/../b`",
        ),
        (
            "heartbeat port",
            MachineOverlay {
                heartbeat: Some(Heartbeat {
                    port_name: "a b".into(),
                    interval_seconds: 5,
                }),
                ..overlay()
            },
            "heartbeat port name `a b`",
        ),
        (
            "heartbeat interval",
            MachineOverlay {
                heartbeat: Some(Heartbeat {
                    port_name: "hb".into(),
                    interval_seconds: 0,
                }),
                ..overlay()
            },
            "heartbeat interval `0`",
        ),
    ];
    let mut table = String::new();
    for (name, o, needle) in cases {
        let err = o.fragment().expect_err(name).to_string();
        assert!(err.contains(needle), "{name}: {err}");
        writeln!(table, "{name}:\n  {err}").unwrap();
    }
    insta::assert_snapshot!("overlay_error_messages", table);
}
