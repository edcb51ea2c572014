//! How individual cloud-config keys map, case by case (the fixtures cover them together).

mod support;

use capk_bootstrap::{BootstrapFormat, MachineFacts, convert, to_json};
use serde_json::{Value, json};
use support::{ignition_validate, readable, validate};

fn conv(body: &str) -> Value {
    let data = format!("#cloud-config\n{body}");
    let facts = MachineFacts {
        hostname: "node-1".into(),
        instance_id: "i-1".into(),
    };
    let cfg = convert(BootstrapFormat::CloudConfig, data.as_bytes(), &facts)
        .unwrap_or_else(|e| panic!("{e}\n{data}"));
    let bytes = to_json(&cfg).unwrap();
    if let Some(bin) = ignition_validate() {
        validate(&bin, body, &bytes, false);
    }
    readable(&bytes)
}

fn file<'a>(v: &'a Value, path: &str) -> &'a Value {
    v["storage"]["files"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["path"] == path)
        .unwrap_or_else(|| panic!("no file {path} in {v:#}"))
}

fn unit<'a>(v: &'a Value, name: &str) -> &'a Value {
    v["systemd"]["units"]
        .as_array()
        .unwrap()
        .iter()
        .find(|u| u["name"] == name)
        .unwrap_or_else(|| panic!("no unit {name} in {v:#}"))
}

#[test]
fn passwords_are_locked_unless_lock_passwd_is_false() {
    let v = conv(
        "users:\n- default\n- {name: a, passwd: '$6$x'}\n- {name: b, passwd: '$6$y', lock_passwd: false}\n- c\n",
    );
    let users = v["passwd"]["users"].as_array().unwrap();
    assert_eq!(users.len(), 3, "`default` adds no user: {users:?}");
    assert_eq!(users[0]["passwordHash"], "!$6$x");
    assert_eq!(users[1]["passwordHash"], "$6$y");
    assert_eq!(users[2], json!({"name": "c"}));
}

#[test]
fn groups_and_sudo_accept_lists() {
    let v = conv(
        "users:\n- name: a\n  groups: [wheel, docker]\n  sudo: ['ALL=(ALL) ALL', 'ALL=(root) NOPASSWD: /bin/ls']\n- name: b\n  sudo: false\n",
    );
    assert_eq!(
        v["passwd"]["users"][0]["groups"],
        json!(["wheel", "docker"])
    );
    let sudoers = file(&v, "/etc/sudoers.d/90-cloud-init-users");
    assert_eq!(sudoers["mode"], 0o440);
    assert!(
        sudoers["contents"]["source"]
            .as_str()
            .unwrap()
            .ends_with("a ALL=(ALL) ALL\na ALL=(root) NOPASSWD: /bin/ls\n")
    );
}

#[test]
fn ntp_disabled_configures_nothing_and_pools_count_as_servers() {
    let v = conv("ntp:\n  enabled: false\n  servers: [a]\n");
    assert!(
        v.get("storage").is_none() && v.get("systemd").is_none(),
        "{v:#}"
    );
    let v = conv("ntp:\n  servers: [a.example]\n  pools: [pool.example]\n");
    let dropin = file(&v, "/etc/systemd/timesyncd.conf.d/50-cloud-config-ntp.conf");
    assert!(
        dropin["contents"]["source"]
            .as_str()
            .unwrap()
            .contains("NTP=a.example pool.example\n")
    );
    assert_eq!(unit(&v, "systemd-timesyncd.service")["enabled"], true);
}

#[test]
fn partition_types_and_partition_device_names() {
    let v = conv(
        "disk_setup:\n  /dev/nvme1n1: {layout: [[100, 82]], overwrite: true}\n  /dev/disk/by-id/virtio-data: {layout: true}\n\
         fs_setup:\n- {filesystem: swap, device: /dev/nvme1n1, partition: 1}\n\
         - {label: data, filesystem: xfs, device: /dev/disk/by-id/virtio-data, partition: any}\n\
         - {filesystem: ext4, device: /dev/vdc, partition: auto}\n\
         - {filesystem: btrfs, device: /dev/vdd, partition: '2', extra_opts: '-f -L x'}\n",
    );
    let disks = &v["storage"]["disks"];
    let nvme = disks
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["device"] == "/dev/nvme1n1")
        .unwrap();
    assert_eq!(
        nvme["partitions"],
        json!([{"number": 1, "typeGuid": "0657FD6D-A4AB-43C4-84E5-0933C84B4F4F"}])
    );
    assert_eq!(nvme["wipeTable"], true);
    let devices: Vec<&str> = v["storage"]["filesystems"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["device"].as_str().unwrap())
        .collect();
    assert_eq!(
        devices,
        [
            "/dev/nvme1n1p1",
            "/dev/disk/by-id/virtio-data-part1",
            "/dev/vdc",
            "/dev/vdd2"
        ]
    );
    assert_eq!(
        v["storage"]["filesystems"][3]["options"],
        json!(["-f", "-L", "x"])
    );
}

#[test]
fn mount_sources_resolve_like_cloud_init_and_cabpk() {
    let v = conv(
        "fs_setup:\n- {label: etcd_disk, filesystem: ext4, device: /dev/vdb}\n\
         mounts:\n- [etcd_disk, /var/lib/etcddisk]\n- [vdc, /mnt/c, xfs, 'defaults,noatime']\n\
         - ['UUID=1234', /mnt/u]\n- [/dev/vde, /mnt/n, nfs, '_netdev,ro', '0', '0']\n",
    );
    let what = |name: &str| unit(&v, name)["contents"].as_str().unwrap().to_owned();
    assert!(what("var-lib-etcddisk.mount").contains("What=/dev/vdb\n"));
    let c = what("mnt-c.mount");
    assert!(
        c.contains("What=/dev/vdc\n")
            && c.contains("Type=xfs\n")
            && c.contains("Options=defaults,noatime\n"),
        "{c}"
    );
    assert!(what("mnt-u.mount").contains("What=/dev/disk/by-uuid/1234\n"));
    assert!(what("mnt-u.mount").contains("Options=defaults,nofail\n"));
    assert!(what("mnt-n.mount").contains("WantedBy=remote-fs.target\n"));
}

#[test]
fn append_without_an_earlier_entry_appends_to_the_image_file() {
    let v = conv("write_files:\n- {path: /etc/motd, append: true, content: hi}\n");
    let f = file(&v, "/etc/motd");
    assert_eq!(f["append"], json!([{"source": "hi"}]));
    assert!(
        f.get("contents").is_none() && f.get("overwrite").is_none(),
        "{f}"
    );
}

#[test]
fn later_entries_replace_earlier_ones_for_the_same_path() {
    let v = conv(
        "write_files:\n- {path: /a, content: one, permissions: '0600'}\n- {path: /a, content: two, owner: 'core:core'}\n",
    );
    let files = v["storage"]["files"].as_array().unwrap();
    assert_eq!(files.len(), 1);
    assert_eq!(files[0]["contents"]["source"], "two");
    assert_eq!(files[0]["mode"], 0o644);
    assert_eq!(files[0]["user"]["name"], "core");
}

#[test]
fn without_the_jinja_header_placeholders_stay_literal() {
    let v = conv("write_files:\n- {path: /a, content: '{{ v1.local_hostname }}'}\n");
    assert_eq!(
        file(&v, "/a")["contents"]["source"],
        "{{ v1.local_hostname }}"
    );
}

#[test]
fn bootcmd_runs_every_boot_with_the_instance_id() {
    let v = conv("bootcmd:\n- [echo, 'a b']\n- echo $INSTANCE_ID\n");
    let script = file(&v, "/etc/capk/bootstrap/bootcmd.sh")["contents"]["source"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        script.ends_with("set -e\necho 'a b'\necho $INSTANCE_ID\n"),
        "{script}"
    );
    let u = unit(&v, "capk-bootcmd.service")["contents"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(u.contains("Environment=INSTANCE_ID=i-1\n"));
    assert!(
        !u.contains("ConditionPathExists"),
        "bootcmd is not once-only"
    );
}

#[test]
fn files_under_run_and_tmp_are_staged_and_copied_with_their_owner_and_mode() {
    let v = conv(
        "write_files:\n- {path: /run/kubeadm/kubeadm.yaml, content: x, permissions: '0640', owner: 'root:core'}\n- {path: /tmp/t, content: y}\n",
    );
    assert!(file(&v, "/var/lib/capk/run-staging/run/kubeadm/kubeadm.yaml")["mode"] == 0o640);
    let script = file(&v, "/etc/capk/bootstrap/run-files.sh")["contents"]["source"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(script.contains("install -D -m 0640 -o root -g core /var/lib/capk/run-staging/run/kubeadm/kubeadm.yaml /run/kubeadm/kubeadm.yaml\n"), "{script}");
    assert!(
        script.contains(
            "install -D -m 0644 -o root -g root /var/lib/capk/run-staging/tmp/t /tmp/t\n"
        ),
        "{script}"
    );
    assert_eq!(
        v["storage"]["directories"],
        json!([{"mode": 0o700, "path": "/var/lib/capk/run-staging"}])
    );
}
