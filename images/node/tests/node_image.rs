//! The Kubernetes node image (`images/node`, `make node-image`) booted by the real launcher under
//! QEMU (TCG) in a network namespace with no route out of this machine, with the bootstrap data
//! the real CABPK wrote for a first control-plane machine in Ignition format
//! (`bootstrap/tests/fixtures/cabpk/ignition-control-plane-init.secret.json`: `kubeadm init` of
//! Kubernetes v1.35.4, control-plane endpoint 10.0.0.10:6443, which is the Pod IP here).
//!
//! What a user of the image notices, each asserted: firmware → SYSLINUX → kernel → Ignition
//! in the initramfs (the files and the hostname are there), the units Ignition enabled run in
//! that same first boot (CABPK's `kubeadm.service`, the launcher's heartbeat), containerd on the
//! launcher's containerd disk holds exactly the images `kubeadm config images list` names and
//! nothing was pulled, `kubeadm init` succeeds and the launcher's readiness (the apiserver's
//! `/readyz` through the Pod IP) passes, the etcd disk is mounted at /var/lib/etcd and a host
//! volume at /data/<tag> over virtio-9p.
//!
//! Minutes under TCG, so ignored by default: `make test-node-image`. Needs root, `ip`,
//! `qemu-system-x86_64`, `qemu-img`, `_output/node-image/node.qcow2` and `_output/bin/kubeadm`
//! (`make node-image`); under `CI` a missing piece fails the test.

// Built and run as a test of the launcher package (it boots the real `capk-launcher`), which
// lends its test support.
#[path = "../../../launcher/tests/support/mod.rs"]
mod support;

use std::ops::{Deref, DerefMut};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use capk_bootstrap::{BootstrapFormat, MachineFacts};
use support::{Namespaces, QEMU_ID, calico_node, calico_pod, repo_root, sha256_hex};

/// The node name the launcher gives the VM (`--hostname`).
const HOSTNAME: &str = "capk-node-test";
/// The fixture's `controlPlaneEndpoint` host: the Pod IP, so the endpoint is the VM itself.
const POD_IP: &str = "10.0.0.10";
const FIXTURE: &str = "ignition-control-plane-init.secret.json";
/// Where the test adds kubeadm's timeouts in the fixture's `/etc/kubeadm.yml`.
const INIT_KIND: &str = "kind: InitConfiguration\n";
/// The flavors' defaults (`KUBEADM_*_SECONDS` in manifests/templates) as kubeadm v1beta4 writes them.
const TCG_TIMEOUTS: &str = "timeouts:\n  controlPlaneComponentHealthCheck: 10m0s\n  \
    kubeletHealthCheck: 10m0s\n  kubernetesAPICall: 3m0s\n  etcdAPICall: 6m0s\n  \
    tlsBootstrap: 10m0s\n  discovery: 10m0s\n";
/// What the guest's report unit writes into the host volume's file and reads back.
const HOST_VOLUME_TEXT: &str = "written on the host for the guest";

fn node_image() -> PathBuf {
    repo_root().join("_output/node-image/node.qcow2")
}

fn kubeadm() -> PathBuf {
    repo_root().join("_output/bin/kubeadm")
}

/// True when everything is present; otherwise fails under CI or skips with the reason.
fn prerequisites() -> bool {
    support::prerequisites(
        "node image test",
        &[
            (node_image(), "make node-image"),
            (kubeadm(), "make node-image"),
        ],
    )
}

/// A Calico-style Pod network in namespaces of this test: eth0 holds a /32 with a default route
/// via 169.254.1.1 on-link, answered by proxy ARP on the node side. The node namespace has no
/// other interface: nothing the guest sends can leave this machine.
struct Topology {
    pod: String,
    _namespaces: Namespaces,
}

impl Topology {
    fn new() -> Topology {
        let id = std::process::id();
        let (node, pod) = (format!("capk-ni-node-{id}"), format!("capk-ni-pod-{id}"));
        let namespaces = Namespaces::create(&[&node, &pod]);
        calico_node(&node);
        calico_pod(&node, &pod, "cali0", POD_IP, 1440);
        Topology {
            pod,
            _namespaces: namespaces,
        }
    }
}

/// Shell lines for a failed `kubeadm init`: the static Pods' log files (the node image has no
/// crictl) and the etcd and apiserver logs' tails, each line after `prefix` on the console.
fn static_pod_logs(prefix: &str) -> String {
    format!(
        r#"ls /var/log/pods/*/* 2>&1 | sed 's/^/{prefix}logs /'
  for c in etcd kube-apiserver; do
    for f in /var/log/pods/kube-system_$c-*/$c/*.log; do
      tail -n 25 "$f" 2>&1 | grep -vi token | cut -c1-300 | sed "s/^/{prefix}$c /"
    done
  done"#
    )
}

/// The guest's report: after `kubeadm.service` it prints what the test checks to the console, one
/// fact per `CAPK-NODE` line. It never prints kubeadm's output unfiltered (kubeadm init prints a
/// join token).
const REPORT_SCRIPT: &str = r#"#!/bin/bash
exec >/dev/console 2>&1
r() { echo "CAPK-NODE $*"; }
r "uptime $(cut -d' ' -f1 /proc/uptime)"
r "hostname=$(hostname)"
r "ignition-file=$(sha256sum </etc/capk/plain.txt | cut -d' ' -f1)"
r "kubeadm result=$(systemctl show -p Result --value kubeadm.service) status=$(systemctl show -p ExecMainStatus --value kubeadm.service)"
r "bootstrap-success=$(test -e /run/cluster-api/bootstrap-success.complete && echo yes || echo no)"
r "seed $(journalctl -b -u capk-seed-containerd.service -o cat | grep capk-seed-containerd: | tail -1)"
r "preload $(journalctl -b -u capk-preload-images.service -o cat | grep capk-preload-images: | tail -1)"
disk() { lsblk -dno SERIAL,FSTYPE "$(findmnt -no SOURCE "$1")" | tr -s ' ' ,; }
r "containerd-disk=$(disk /var/lib/containerd)"
r "etcd-disk=$(disk /var/lib/etcd)"
r "host-volume=$(findmnt -no FSTYPE /data/shared),$(cat /data/shared/hello 2>&1)"
echo "$HOSTNAME" >/data/shared/from-guest
# What a guest did to reach the node's root through the next machine's hostPath.
ln -s / /data/shared/escape
# The read-only share: mounted ro, readable; remounted rw it is still refused by QEMU (9p
# readonly=on), not only by the guest's mount.
r "host-volume-ro=$(findmnt -no FSTYPE /data/ro),$(findmnt -no OPTIONS /data/ro | tr , '\n' | grep -cx ro),$(cat /data/ro/hello 2>&1)"
mount -o remount,rw /data/ro 2>/dev/null
r "host-volume-ro-write=$( (echo x >/data/ro/from-guest) 2>/dev/null && echo written || echo refused)"
# networkd configures the launcher's NIC and leaves a CNI's links alone: it took the host side
# of Pods' veth pairs out of the CNI's bridge and ran DHCP on them (the node could not reach its
# Pods). SETUP of a fresh veth and of eth0.
ip link add capk-veth0 type veth peer name capk-veth1 && ip link set capk-veth0 up && ip link set capk-veth1 up
sleep 5
r "networkd-setup=$(networkctl list --no-legend capk-veth0 | awk '{print $5}'),$(networkctl list --no-legend eth0 | awk '{print $5}')"
ip link del capk-veth0
# The node's own name resolves from /etc/hosts (capk-etc-hosts.service), without DNS: the kubelet
# looks it up for every node status.
r "hosts-entry=$(getent -s files hosts "$(hostname)" | tr -s ' \t' ,)"
# Timer slack set for PID 1 (system.conf.d) and inherited by the kubelet and, through containerd
# and its shims, by the static Pods' processes.
r "timer-slack=$(cat /proc/1/timerslack_ns),$(cat /proc/$(pgrep -xo kubelet)/timerslack_ns),$(cat /proc/$(pgrep -xo kube-apiserver)/timerslack_ns)"
# Units (a container's cri-containerd scope among them) get 20 s to stop before SIGKILL.
r "stop-timeout=$(systemctl show -P DefaultTimeoutStopUSec)"
for i in $(ctr -n k8s.io images ls -q | grep -v '^sha256:' | sort); do r "image $i"; done
r "pulls=$(journalctl -b -u containerd.service -o cat | grep -c 'PullImage')"
kc() { kubectl --kubeconfig /etc/kubernetes/admin.conf --request-timeout 60s "$@"; }
r "node $(kc get nodes --no-headers -o custom-columns=N:.metadata.name,V:.status.nodeInfo.kubeletVersion 2>&1 | tr -s ' ' ,)"
# kube-proxy's DaemonSet Pod comes once the controller-manager has caught up (minutes under TCG).
for _ in $(seq 60); do kc -n kube-system get pods -l k8s-app=kube-proxy --no-headers 2>/dev/null | grep -q . && break; sleep 5; done
for p in $(kc -n kube-system get pods --no-headers -o custom-columns=N:.metadata.name,P:.status.phase 2>&1 | tr -s ' ' =); do r "pod $p"; done
if [ "$(systemctl show -p Result --value kubeadm.service)" != success ]; then
  journalctl -b -u kubeadm.service -o cat | grep -vi token | tail -40 | sed 's/^/CAPK-NODE kubeadm| /'
  # What the control plane's containers did (their logs hold no bootstrap token), and the load.
  @STATIC_POD_LOGS@
  top -b -n 1 | head -20 | sed 's/^/CAPK-NODE top| /'
  journalctl -b -u kubelet.service -o cat | grep -vi token | tail -15 | sed 's/^/CAPK-NODE kubelet| /'
fi
# The seed's layers are symlinks into the root (capk-seed-containerd), all of them; removing an
# image with every name of it, as the kubelet's image garbage collection does, removes its layer's
# link and never the seed's files (the toolbox: no Pod of this node uses it).
seed_snaps=/usr/share/capk/containerd-seed/io.containerd.snapshotter.v1.overlayfs/snapshots
snaps=/var/lib/containerd/io.containerd.snapshotter.v1.overlayfs/snapshots
links() { find "$snaps" -mindepth 1 -maxdepth 1 -type l | wc -l; }
seed_layers() { find "$seed_snaps" -mindepth 1 -maxdepth 1 -type d | wc -l; }
seeded_layers=$(seed_layers)
seeded_links=$(links)
toolbox=$(ctr -n k8s.io images ls | awk '$1 ~ /^localhost\/capk\/toolbox:/ {print $3}')
ctr -n k8s.io images rm --sync $(ctr -n k8s.io images ls | awk -v d="$toolbox" '$3 == d {print $1}') >/dev/null
r "seed-links=$seeded_layers,$seeded_links,$(links),$(seed_layers),$(find "$snaps" -mindepth 1 -maxdepth 1 ! -type l | wc -l)"
r "report-done"
# Boot-to-multi-user once the boot transaction (which waits for this unit) is over.
systemd-run --no-block --on-active=1 /bin/bash -c 'systemctl is-system-running --wait >/dev/null; echo "CAPK-NODE $(systemd-analyze time | head -1)" >/dev/console'
"#;

/// The machine's Ignition as the controller stores it (capk-bootstrap's conversion of the real
/// CABPK Secret for this node name) plus the test's report unit.
fn machine_ignition() -> Vec<u8> {
    let path = repo_root()
        .join("bootstrap/tests/fixtures/cabpk")
        .join(FIXTURE);
    let secret: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let value = secret["value"].as_str().expect("value").as_bytes();
    let json = capk_bootstrap::render_ignition(
        BootstrapFormat::Ignition,
        value,
        &MachineFacts::new(HOSTNAME),
        None,
    )
    .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    .json;
    let mut config: serde_json::Value = serde_json::from_slice(&json).unwrap();
    // The fixture's KubeadmConfig partitions, formats and mounts /dev/vdb (CABPK's diskSetup). On a
    // CAPK machine /dev/vdb is the launcher's containerd disk, which the machine overlay formats
    // as a whole: Ignition's disks stage would partition and format one device twice, the
    // filesystems concurrently. CAPK machines get their etcd disk from the launcher instead, so
    // the test drops the example.
    for kind in ["disks", "filesystems"] {
        if let Some(entries) = config["storage"][kind].as_array_mut() {
            entries.retain(|e| e["device"] != "/dev/vdb");
        }
    }
    // The fixture was rendered with kubeadm's default timeouts (4 minutes for the control-plane
    // components); the shipped flavors raise them for emulated nodes (KUBEADM_*_SECONDS, see
    // manifests/templates), and so does the test, the same way CABPK writes them.
    for f in config["storage"]["files"].as_array_mut().expect("files") {
        if f["path"] == "/etc/kubeadm.yml" {
            let source = f["contents"]["source"]
                .as_str()
                .expect("kubeadm.yml source");
            let yaml = data_url::DataUrl::process(source)
                .unwrap()
                .decode_to_vec()
                .unwrap()
                .0;
            let yaml = String::from_utf8(yaml).unwrap();
            assert!(
                yaml.contains(INIT_KIND),
                "kubeadm.yml has no InitConfiguration"
            );
            let raised = yaml.replace(INIT_KIND, &format!("{INIT_KIND}{TCG_TIMEOUTS}"));
            f["contents"]["source"] = capk_bootstrap::content::data_url(raised.as_bytes()).into();
        }
    }
    let units = config["systemd"]["units"].as_array_mut().expect("units");
    units.retain(|u| u["name"] != "var-lib-etcddisk.mount");
    // Its Flatcar drop-in makes kubeadm.service require containerd.service, and its pre-kubeadm
    // commands `systemctl restart containerd`: the restart propagates through Requires= and
    // kills kubeadm.service in the middle (systemd does that on Flatcar too). Keep the ordering.
    for u in units.iter_mut() {
        for d in u["dropins"].as_array_mut().into_iter().flatten() {
            if let Some(c) = d["contents"].as_str() {
                d["contents"] = c.replace("Requires=containerd.service\n", "").into();
            }
        }
    }
    config["storage"]["files"]
        .as_array_mut()
        .expect("files")
        .push(serde_json::json!({
            "path": "/etc/capk-test/report.sh",
            "mode": 0o755,
            "contents": {"source": capk_bootstrap::content::data_url(
                REPORT_SCRIPT
                    .replace("@STATIC_POD_LOGS@", &static_pod_logs("CAPK-NODE kubeadm| "))
                    .as_bytes()
            )},
        }));
    config["systemd"]["units"]
        .as_array_mut()
        .expect("units")
        .push(serde_json::json!({
            "name": "capk-node-report.service",
            "enabled": true,
            "contents": "[Unit]\nDescription=CAPK node image test report\n\
                After=kubeadm.service capk-preload-images.service\n\n\
                [Service]\nType=oneshot\nExecStart=/bin/bash /etc/capk-test/report.sh\n\n\
                [Install]\nWantedBy=multi-user.target\n",
        }));
    serde_json::to_vec(&config).unwrap()
}

/// A running `capk-launcher run` on the node image (see [`support::Launcher`]); stopped with
/// SIGTERM on drop, as the kubelet stops a machine Pod.
struct Launcher(support::Launcher);

impl Deref for Launcher {
    type Target = support::Launcher;
    fn deref(&self) -> &support::Launcher {
        &self.0
    }
}

impl DerefMut for Launcher {
    fn deref_mut(&mut self) -> &mut support::Launcher {
        &mut self.0
    }
}

impl Launcher {
    /// Starts the launcher on the node image with `ignition`, `vcpus` and `memory` (a quantity).
    fn start(t: &Topology, work: &Path, ignition: &[u8], vcpus: &str, memory: &str) -> Launcher {
        let resolv = work.join("resolv.conf");
        std::fs::write(
            &resolv,
            "search default.svc.cluster.local svc.cluster.local cluster.local\nnameserver 10.96.0.10\n",
        )
        .unwrap();
        let shared = work.join("shared");
        std::fs::create_dir_all(&shared).unwrap();
        std::fs::write(shared.join("hello"), HOST_VOLUME_TEXT).unwrap();
        // QEMU runs as 107:107 and 9p uses its rights: the read-write share is its own, the
        // read-only one only readable.
        std::os::unix::fs::chown(&shared, Some(QEMU_ID), Some(QEMU_ID)).unwrap();
        let ro = work.join("ro");
        std::fs::create_dir_all(&ro).unwrap();
        std::fs::write(ro.join("hello"), HOST_VOLUME_TEXT).unwrap();
        let ignition_json = ignition;
        let ignition = work.join("ignition.json");
        std::fs::write(&ignition, ignition_json).unwrap();
        let runtime_dir = work.join("run");
        let mut command = Command::new("ip");
        command
            .args(["netns", "exec", &t.pod])
            .args([env!("CARGO_BIN_EXE_capk-launcher"), "run"])
            .args(["--image", &node_image().display().to_string()])
            .args(["--accel", "tcg", "--vcpus", vcpus, "--memory", memory])
            // A Kubernetes node's programs overflow the default 128 MiB translation cache: QEMU
            // then keeps re-translating, and `kubeadm init` did not finish in 10 minutes.
            .args(["--tcg-translation-cache-mib", "1024"])
            .args(["--role", "control-plane"])
            .args(["--disk-size", "8Gi", "--docker-disk-size", "4Gi"])
            .args(["--kubelet-disk-size", "1Gi"])
            .args([
                "--etcd-disk",
                &work.join("etcd/etcd.img").display().to_string(),
                "--etcd-disk-size",
                "1Gi",
                "--etcd-owner",
                "capk-test/vm-test/00000000-0000-4000-8000-000000000001",
            ])
            .args(["--state-dir", &work.join("state").display().to_string()])
            .args(["--runtime-dir", &runtime_dir.display().to_string()])
            // Each run's own, like the machine Pod's memory volume (not the host's /run).
            .args(["--secret-dir", &work.join("secret").display().to_string()])
            .args(["--resolv-conf", &resolv.display().to_string()])
            .args(["--ignition", &ignition.display().to_string()])
            .args(["--host-volume", &format!("shared={}", shared.display())])
            .args(["--host-volume-readonly", &format!("ro={}", ro.display())])
            .args(["--hostname", HOSTNAME, "--grace-period-seconds", "60"]);
        let mut inner = support::Launcher::spawn(command, runtime_dir, strip_ansi);
        inner.diagnostic_lines = 80;
        Launcher(inner)
    }

    /// Waits for a console line containing `needle`; returns it and prints when it came.
    fn wait_for(&mut self, needle: &str, timeout: Duration) -> String {
        let before = self.seen.len();
        let (line, secs) = self.0.wait_for_at(needle, timeout);
        if self.seen.len() > before {
            println!("MEASURE {secs:>7.1} s after launcher start: {needle}");
        }
        line
    }

    /// Every `CAPK-NODE <prefix>` line seen so far, without the prefix.
    fn facts(&self, prefix: &str) -> Vec<String> {
        let p = format!("CAPK-NODE {prefix}");
        self.seen
            .iter()
            .filter_map(|l| l.find(&p).map(|i| l[i + p.len()..].trim().to_string()))
            .collect()
    }

    fn fact(&self, prefix: &str) -> String {
        self.facts(prefix)
            .pop()
            .unwrap_or_else(|| panic!("no CAPK-NODE {prefix} line; last lines:\n{}", self.tail()))
    }
}

impl Drop for Launcher {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        // support::Launcher's drop kills what is still running.
    }
}

/// The line without terminal escape sequences (systemd colours its status lines).
fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // CSI: ESC [ parameters final-byte (a letter).
            if chars.next() == Some('[') {
                for c in chars.by_ref() {
                    if c.is_ascii_alphabetic() {
                        break;
                    }
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The content CABPK gave /etc/capk/plain.txt in the fixture (the guest reports its digest).
fn fixture_file(path: &str) -> Vec<u8> {
    let json = machine_ignition();
    let config: serde_json::Value = serde_json::from_slice(&json).unwrap();
    let f = config["storage"]["files"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["path"] == path)
        .unwrap_or_else(|| panic!("{path} not in the fixture"));
    let source = f["contents"]["source"].as_str().unwrap();
    let bytes = data_url::DataUrl::process(source)
        .unwrap()
        .decode_to_vec()
        .unwrap()
        .0;
    match f["contents"]["compression"].as_str() {
        Some("gzip") => capk_bootstrap::content::gunzip(&bytes).unwrap(),
        _ => bytes,
    }
}

#[test]
#[ignore = "boots the Kubernetes node image under TCG and runs kubeadm init (minutes): make test-node-image"]
fn node_image_runs_ignition_and_kubeadm_init_with_preloaded_images_and_no_route_out() {
    if !prerequisites() {
        return;
    }
    let listed = Command::new(kubeadm())
        .args([
            "config",
            "images",
            "list",
            "--kubernetes-version",
            "v1.35.4",
        ])
        .output()
        .expect("run kubeadm config images list");
    assert!(listed.status.success(), "{listed:?}");
    let mut want: Vec<String> = String::from_utf8_lossy(&listed.stdout)
        .lines()
        .map(str::to_string)
        .collect();
    want.sort();
    assert_eq!(want.len(), 7, "{want:?}");

    let t = Topology::new();
    let work = tempfile::Builder::new()
        .prefix("capk-ni")
        .tempdir_in("/tmp")
        .unwrap();
    // Like a Pod's volumes, reachable by QEMU's unprivileged user (tempdirs are 0700).
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(work.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    // kubeadm's preflight wants 2 CPUs and 1700 MB on a control-plane node.
    let mut l = Launcher::start(&t, work.path(), &machine_ignition(), "2", "2560Mi");

    // Firmware → SYSLINUX → kernel → Ignition in the initramfs → the real root's systemd.
    l.wait_for("SYSLINUX", Duration::from_secs(60));
    l.wait_for("Ignition (files)", Duration::from_secs(300));
    // The real root's systemd (the initramfs says "(bookworm) dracut-… (Initramfs)!").
    l.wait_for("Debian GNU/Linux 12 (bookworm)!", Duration::from_secs(600));
    l.wait_for("Started containerd", Duration::from_secs(600));
    // kubeadm.service is enabled by Ignition's preset, in this same first boot.
    l.wait_for("CAPK-NODE report-done", Duration::from_secs(1800));
    let boot = l.wait_for("CAPK-NODE Startup finished", Duration::from_secs(120));
    println!("MEASURE {boot}");
    println!("MEASURE {}", l.fact("seed "));
    println!("MEASURE {}", l.fact("preload "));

    assert_eq!(l.fact("hostname="), HOSTNAME);
    assert_eq!(
        l.fact("ignition-file="),
        sha256_hex(&fixture_file("/etc/capk/plain.txt"))
    );
    // The launcher's containerd disk is mounted over /var/lib/containerd: the images came from
    // the image's unpacked seed, copied before containerd started (no import needed), and they
    // are exactly kubeadm's (plus the CNI's and the toolbox), nothing pulled.
    assert_eq!(l.fact("containerd-disk="), "dockerfs,ext4");
    assert!(
        l.fact("seed ").starts_with("capk-seed-containerd: linked"),
        "containerd's disk was not seeded: {}",
        l.fact("seed ")
    );
    // Every layer of the seed was a link (kubeadm init then ran its Pods from them); the removed
    // toolbox image took its link with it, the seed kept every layer, and the containers' own
    // snapshots are directories on the containerd disk.
    let links: Vec<usize> = l
        .fact("seed-links=")
        .split(',')
        .map(|n| n.parse().expect("seed-links counts"))
        .collect();
    let [seed_layers, seeded, after_removal, seed_after, own] = links[..] else {
        panic!("seed-links: {links:?}");
    };
    assert!(seed_layers > 0, "an empty seed");
    assert_eq!(seeded, seed_layers, "not every seed layer linked");
    assert!(
        after_removal < seeded,
        "removing the toolbox image removed no link ({seeded} -> {after_removal})"
    );
    assert_eq!(
        seed_after, seed_layers,
        "removing an image removed seed layers"
    );
    assert!(own > 0, "no container snapshot of containerd's own");
    assert!(
        l.fact("preload ")
            .starts_with("capk-preload-images: containerd has all"),
        "the seeded containerd lacked images: {}",
        l.fact("preload ")
    );
    let images = l.facts("image ");
    for w in &want {
        assert!(images.contains(w), "{w} not in containerd: {images:?}");
    }
    let extra: Vec<&String> = images
        .iter()
        .filter(|i| {
            !want.contains(i)
                && !i.starts_with("localhost/capk/flannel")
                && !i.starts_with("localhost/capk/toolbox:")
        })
        .collect();
    assert!(extra.is_empty(), "unexpected images: {extra:?}");
    assert_eq!(l.fact("pulls="), "0", "containerd pulled an image");

    assert_eq!(
        l.fact("kubeadm result="),
        "success status=0",
        "kubeadm init failed: {:?}",
        l.facts("kubeadm| ")
    );
    assert_eq!(l.fact("bootstrap-success="), "yes");
    assert_eq!(l.fact("node "), format!("{HOSTNAME},v1.35.4"));
    let pods = l.facts("pod ");
    for c in [
        "etcd",
        "kube-apiserver",
        "kube-controller-manager",
        "kube-scheduler",
    ] {
        let p = format!("{c}-{HOSTNAME}=Running");
        assert!(pods.contains(&p), "{p} not in {pods:?}");
    }
    assert!(
        pods.iter().any(|p| p.starts_with("kube-proxy-")),
        "no kube-proxy Pod: {pods:?}"
    );
    assert_eq!(l.fact("etcd-disk="), "etcdfs,ext4");
    // A veth (as a CNI makes for each Pod) is not networkd's; the launcher's NIC is.
    assert_eq!(l.fact("networkd-setup="), "unmanaged,configured");
    assert_eq!(l.fact("hosts-entry="), format!("{POD_IP},{HOSTNAME}"));
    // 10 ms (the image's TimerSlackNSec) for PID 1, the kubelet and the apiserver's container.
    assert_eq!(l.fact("timer-slack="), "10000000,10000000,10000000");
    // The image's DefaultTimeoutStopSec: a shutdown does not wait systemd's 90 s for each
    // container that ignores SIGTERM.
    assert_eq!(l.fact("stop-timeout="), "20s");
    assert_eq!(l.fact("host-volume="), format!("9p,{HOST_VOLUME_TEXT}"));
    // The guest wrote to the read-write share as QEMU's user; the read-only one was read and
    // mounted read-only, and a write was refused even after a read-write remount.
    let written = std::fs::metadata(work.path().join("shared/from-guest")).unwrap();
    use std::os::unix::fs::MetadataExt;
    assert_eq!((written.uid(), written.gid()), (QEMU_ID, QEMU_ID));
    // The guest's symlink is, on the host, a file of QEMU's user holding the target's name (9p
    // security_model=mapped-xattr): nothing on the node follows it.
    let escape = work.path().join("shared/escape");
    let link = std::fs::symlink_metadata(&escape).unwrap();
    assert!(link.file_type().is_file(), "{link:?}");
    assert_eq!((link.uid(), link.mode() & 0o7777), (QEMU_ID, 0o600));
    assert_eq!(std::fs::read_to_string(&escape).unwrap(), "/");
    assert_eq!(
        l.fact("host-volume-ro="),
        format!("9p,1,{HOST_VOLUME_TEXT}")
    );
    assert_eq!(l.fact("host-volume-ro-write="), "refused");
    assert!(!work.path().join("ro/from-guest").exists());

    // The launcher sees the bootstrap through the heartbeat and the apiserver through the Pod IP.
    let deadline = Instant::now() + Duration::from_secs(120);
    let ready = loop {
        let (ok, out) = l.cli(&["probe", "readiness"]);
        if ok || Instant::now() > deadline {
            break (ok, out);
        }
        std::thread::sleep(Duration::from_secs(1));
    };
    assert!(ready.0, "readiness: {}", ready.1);
    println!(
        "MEASURE ready {:.0} s after launcher start: {}",
        l.started.elapsed().as_secs_f64(),
        ready.1
    );
}

// ---------------------------------------------------------------------------------------------
// What an idle emulated control plane costs (`make bench-idle-node`): the node-image flavor (or
// the flavor file CAPK_BENCH_FLAVOR names) as `clusterctl generate cluster` renders it, with
// flavor variables from the environment as clusterctl takes them; its first control plane's
// bootstrap data made by CABPK's own code (`cabpk-render`) and converted like the controller
// does; booted by the launcher on the node image. Once kubeadm init is done, the flavor's CNI
// applied and every kube-system Pod ready, the guest waits CAPK_BENCH_SETTLE_SECONDS (30) and
// then measures CAPK_BENCH_IDLE_SECONDS (60) while the test reads QEMU's host CPU over the same
// window. The guest prints its own split: CPU by process name, user/system/irq time, interrupts
// and context switches per second. With CAPK_BENCH_PERF=1 the test also samples QEMU with
// `perf` during the window. With CAPK_BENCH_HOLD=1 the guest keeps running after the numbers
// (the test prints how to reach it with kubectl and how to end it), to compare levers on one node.

/// The guest's side of the idle benchmark (`CAPK-NODE idle-…` console lines). `@SETTLE@` and
/// `@WINDOW@` are replaced by seconds. Short-lived processes (exec'd by probes, say) are not in the
/// per-process table; `unaccounted` is the busy time the table misses.
const IDLE_SCRIPT: &str = r#"#!/bin/bash
exec >/dev/console 2>&1
r() { echo "CAPK-NODE idle-$*"; }
kc() { kubectl --kubeconfig /etc/kubernetes/admin.conf --request-timeout 60s "$@"; }
up() { cut -d' ' -f1 /proc/uptime; }
# The flavor's bootstrap is cloud-config: kubeadm runs in the converted runcmd unit.
if [ ! -e /run/cluster-api/bootstrap-success.complete ]; then
  journalctl -b -u capk-runcmd.service -o cat | grep -vi token | tail -30 | sed 's/^/CAPK-NODE idle-kubeadm| /'
  @STATIC_POD_LOGS@
  r "failed kubeadm init: $(systemctl show -p Result --value capk-runcmd.service)"
  exit 0
fi
r "kubeadm-done uptime=$(up)"
# Where the boot went, in seconds of uptime: the units before kubeadm, kubeadm's phases and its
# health checks, and how often each static Pod's container was started (its log files).
journalctl -b -o short-monotonic -u capk-seed-containerd.service -u containerd.service \
  -u capk-preload-images.service -u capk-runcmd.service |
  grep -E 'Start|Finish|\[(kubelet-start|wait-control-plane|control-plane-check|kubelet-check|apiclient|upload-config|mark-control-plane|addons)\]' |
  grep -vi token | cut -c1-200 | sed 's/^/CAPK-NODE idle-timeline /'
for d in /var/log/pods/kube-system_*/*/; do r "timeline starts $(basename "$d")=$(ls "$d" | wc -l)"; done
r "timeline-end"
# Without validation: kubectl would download the OpenAPI document first (seconds under TCG).
until kc apply --validate=false -f /etc/capk-bench/cni.yaml >/dev/null; do sleep 10; done
# From here on the host watches the cluster through its apiserver, as a management cluster
# would: nothing in the guest polls (a kubectl costs a second or two of a vCPU under TCG, and
# the progress report's `top` as much).
systemctl stop capk-bench-progress.service
r "cni-applied uptime=$(up)"
# The host starts the window by writing this file into the read-write host volume.
until [ -e /data/shared/capk-window ]; do sleep 1; done
# pid, name, utime+stime in ticks of every process.
procs() {
  for d in /proc/[0-9]*; do
    s=$(cat "$d/stat" 2>/dev/null) || continue
    n=${s#*(}; n=${n%)*}; set -- ${s##*) }
    echo "${d#/proc/} ${n// /_} $((${12} + ${13}))"
  done
}
cpu() { awk '/^cpu /{print $2 + $3, $4, $7 + $8, $5 + $6}' /proc/stat; }
counters() { awk '/^intr /{i=$2} /^ctxt /{c=$2} END {print i, c}' /proc/stat; }
procs >/run/capk-idle.0; c0=$(cpu); k0=$(counters); cp /proc/interrupts /run/capk-idle.irq0
r "window-start uptime=$(up)"
sleep @WINDOW@
r "window-end uptime=$(up)"
procs >/run/capk-idle.1; c1=$(cpu); k1=$(counters); cp /proc/interrupts /run/capk-idle.irq1
tck=$(getconf CLK_TCK)
# Per process name: % of one vCPU over the window.
awk -v w=@WINDOW@ -v t="$tck" 'NR == FNR {a[$1] = $3; next} {d = $3 - ($1 in a ? a[$1] : 0); s[$2] += d}
  END {for (n in s) if (s[n] > 0) printf "%.1f %s\n", 100 * s[n] / t / w, n}' \
  /run/capk-idle.0 /run/capk-idle.1 | sort -rn | awk '{print "CAPK-NODE idle-proc " $2 " " $1 "%"}'
set -- $c0 $c1
r "$(awk -v w=@WINDOW@ -v t="$tck" -v u=$(($5 - $1)) -v s=$(($6 - $2)) -v i=$(($7 - $3)) -v id=$(($8 - $4)) \
  'BEGIN {printf "cpu user=%.1f%% system=%.1f%% irq=%.1f%% idle=%.1f%% (of one vCPU)", 100*u/t/w, 100*s/t/w, 100*i/t/w, 100*id/t/w}')"
accounted=$(awk 'NR == FNR {a[$1] = $3; next} {d = $3 - ($1 in a ? a[$1] : 0); if (d > 0) s += d} END {print s + 0}' /run/capk-idle.0 /run/capk-idle.1)
r "unaccounted $(awk -v w=@WINDOW@ -v t="$tck" -v b=$(( ($5 - $1) + ($6 - $2) )) -v a="$accounted" 'BEGIN {printf "%.1f%%", 100 * (b - a) / t / w}')"
set -- $k0 $k1
r "rates interrupts/s=$(( ($3 - $1) / @WINDOW@ )) context-switches/s=$(( ($4 - $2) / @WINDOW@ ))"
awk 'NR == FNR {for (i = 2; i <= NF && $i ~ /^[0-9]+$/; i++) a[$1] += $i; next}
  {s = 0; for (i = 2; i <= NF && $i ~ /^[0-9]+$/; i++) s += $i; if (s - a[$1] > 0) printf "%d %s %s\n", (s - a[$1]) / @WINDOW@, $1, $NF}' \
  /run/capk-idle.irq0 /run/capk-idle.irq1 | sort -rn | head -6 | awk '{print "CAPK-NODE idle-irq " $2 $3 " " $1 "/s"}'
r "loadavg $(cut -d' ' -f1-3 /proc/loadavg)"
r "done"
"#;

/// Once a minute while the benchmark's guest runs: its load and busiest processes.
const PROGRESS_SCRIPT: &str = r#"#!/bin/bash
while sleep 60; do
  top=$(top -b -n 1 -w 200 | sed -n 8,11p | awk '{printf "%s:%s%% ", $12, $9}')
  echo "CAPK-NODE progress uptime=$(cut -d' ' -f1 /proc/uptime) load=$(cut -d' ' -f1-3 /proc/loadavg) $top" >/dev/console
done
"#;

/// `name` from the environment, else `default` (the flavor variables the benchmark sets unless
/// the caller did).
fn var_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_string())
}

/// The node-image flavor's first control plane as the benchmark boots it: its Ignition (CABPK's
/// bootstrap data converted like the controller does, plus the idle report and the CNI manifest),
/// vCPUs and memory.
fn flavor_control_plane(window: u64) -> (Vec<u8>, String, String) {
    let home = tempfile::tempdir().unwrap();
    // Sizes of the workload journey's control plane (tests/tests/e2e/workload.rs), leader
    // election, the liveness threshold and etcd's CPU request as it raises them for TCG; each
    // overridable from the environment. With CONTROL_PLANE_MACHINE_CPUS=2 etcd gets 1 CPU (its
    // weight against the kubelet's with two vCPUs); with one, the static Pods, CoreDNS and flannel
    // must fit in the vCPU's 1,000m, or kubeadm init never finishes.
    let one_vcpu = var_or("CONTROL_PLANE_MACHINE_CPUS", "1") == "1";
    let defaults = [
        ("CONTROL_PLANE_MACHINE_CPUS", "1"),
        ("CONTROL_PLANE_MACHINE_MEMORY", "2560Mi"),
        ("CONTROL_PLANE_VOLUME_SIZE_GB", "8"),
        ("CONTROL_PLANE_DOCKER_VOLUME_SIZE_GB", "4"),
        ("KUBE_LEADER_ELECT_LEASE_DURATION", "120s"),
        ("KUBE_LEADER_ELECT_RENEW_DEADLINE", "90s"),
        ("KUBE_LEADER_ELECT_RETRY_PERIOD", "10s"),
        ("KUBE_LIVENESS_FAILURE_THRESHOLD", "30"),
        ("KUBE_ETCD_CPU_REQUEST", if one_vcpu { "250m" } else { "1" }),
    ];
    let mut clusterctl = Command::new(repo_root().join("_output/bin/clusterctl"));
    clusterctl
        .args(["generate", "cluster", "idle", "--from"])
        .arg(std::env::var_os("CAPK_BENCH_FLAVOR").map_or_else(
            || repo_root().join("manifests/templates/cluster-template-node-image.yaml"),
            PathBuf::from,
        ))
        .args([
            "--kubernetes-version",
            "v1.35.4",
            "--target-namespace",
            "default",
        ])
        .args([
            "--control-plane-machine-count",
            "1",
            "--worker-machine-count",
            "0",
        ])
        .env("HOME", home.path())
        .env("CLUSTERCTL_DISABLE_VERSIONCHECK", "true")
        .env("KVM_NODE_IMAGE", "localhost/capk/node:bench");
    for (k, v) in defaults {
        clusterctl.env(k, var_or(k, v));
    }
    let out = clusterctl.output().expect("run clusterctl");
    assert!(
        out.status.success(),
        "clusterctl generate cluster: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    use serde::Deserialize;
    let mut cni = None;
    for d in serde_yaml_ng::Deserializer::from_slice(&out.stdout) {
        let v = serde_yaml_ng::Value::deserialize(d).unwrap();
        if v["kind"] == "ConfigMap" {
            cni = v["data"]["flannel.yaml"].as_str().map(str::to_string);
        }
    }
    let objects = out.stdout;
    let cni = cni.expect("the flavor's CNI ConfigMap");

    use std::io::Write;
    let mut render = Command::new(repo_root().join("_output/bin/cabpk-render"))
        .args(["bootstrap", "--role", "init", "--endpoint"])
        .arg(format!("{POD_IP}:6443"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run cabpk-render");
    render.stdin.take().unwrap().write_all(&objects).unwrap();
    let out = render.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "cabpk-render: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let secret: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let format = BootstrapFormat::from_secret(secret["format"].as_str()).unwrap();
    let value = secret["value"].as_str().expect("value").as_bytes();
    let json = capk_bootstrap::render_ignition(format, value, &MachineFacts::new(HOSTNAME), None)
        .unwrap()
        .json;
    let mut config: serde_json::Value = serde_json::from_slice(&json).unwrap();
    let script = IDLE_SCRIPT
        .replace(
            "@STATIC_POD_LOGS@",
            &static_pod_logs("CAPK-NODE idle-kubeadm| "),
        )
        .replace("@WINDOW@", &window.to_string());
    let files = config["storage"]["files"].as_array_mut().expect("files");
    for (path, mode, body) in [
        ("/etc/capk-bench/idle.sh", 0o755, script.as_bytes()),
        ("/etc/capk-bench/cni.yaml", 0o644, cni.as_bytes()),
        (
            "/etc/capk-bench/progress.sh",
            0o755,
            PROGRESS_SCRIPT.as_bytes(),
        ),
    ] {
        files.push(serde_json::json!({
            "path": path,
            "mode": mode,
            "contents": {"source": capk_bootstrap::content::data_url(body)},
        }));
    }
    let units = config["systemd"]["units"].as_array_mut().expect("units");
    // Where a slow boot spends its time: once a minute, the load and the busiest processes.
    units.push(serde_json::json!({
        "name": "capk-bench-progress.service",
        "enabled": true,
        "contents": "[Unit]\nDescription=CAPK idle benchmark progress\n\n\
            [Service]\nExecStart=/bin/bash /etc/capk-bench/progress.sh\n\n\
            [Install]\nWantedBy=multi-user.target\n",
    }));
    units.push(serde_json::json!({
        "name": "capk-bench-idle.service",
        "enabled": true,
        "contents": "[Unit]\nDescription=CAPK idle benchmark\nAfter=capk-runcmd.service\n\n\
            [Service]\nType=oneshot\nExecStart=/bin/bash /etc/capk-bench/idle.sh\n\n\
            [Install]\nWantedBy=multi-user.target\n",
    }));
    (
        serde_json::to_vec(&config).unwrap(),
        var_or("CONTROL_PLANE_MACHINE_CPUS", "1"),
        var_or("CONTROL_PLANE_MACHINE_MEMORY", "2560Mi"),
    )
}

/// User + system CPU ticks of a process (all its threads).
fn cpu_ticks(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("QEMU's /proc stat");
    let rest: Vec<&str> = s[s.rfind(')').unwrap() + 2..].split(' ').collect();
    rest[11].parse::<u64>().unwrap() + rest[12].parse::<u64>().unwrap()
}

/// The launcher's QEMU.
fn qemu_pid(launcher: u32) -> u32 {
    let out = Command::new("pgrep")
        .args(["-P", &launcher.to_string(), "qemu-system"])
        .output()
        .expect("run pgrep");
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("no QEMU child of the launcher {launcher}"))
}

/// The cluster's admin, from the host: a client certificate signed with the cluster CA that the
/// bootstrap data carries, used with kubectl from the machine's network namespace. The benchmark
/// watches the cluster from outside, as a management cluster does, so that its polling costs the
/// guest only the requests it serves.
struct Admin {
    netns: String,
    kubeconfig: PathBuf,
}

impl Admin {
    fn new(t: &Topology, work: &Path, ignition: &[u8]) -> Admin {
        let config: serde_json::Value = serde_json::from_slice(ignition).unwrap();
        let dir = work.join("admin");
        std::fs::create_dir_all(&dir).unwrap();
        for name in ["ca.crt", "ca.key"] {
            let path = format!("/etc/kubernetes/pki/{name}");
            let file = config["storage"]["files"]
                .as_array()
                .unwrap()
                .iter()
                .find(|f| f["path"] == path.as_str())
                .unwrap_or_else(|| panic!("{path} in the bootstrap data"));
            let url = file["contents"]["source"].as_str().unwrap();
            let (bytes, _) = data_url::DataUrl::process(url)
                .unwrap()
                .decode_to_vec()
                .unwrap();
            std::fs::write(dir.join(name), bytes).unwrap();
        }
        let d = dir.display();
        support::sh(&format!(
            "cd {d} && openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
             -keyout admin.key -subj /O=system:masters/CN=capk-bench -out admin.csr 2>/dev/null && \
             openssl x509 -req -in admin.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 1 \
             -out admin.crt 2>/dev/null"
        ));
        let kubeconfig = dir.join("kubeconfig");
        std::fs::write(
            &kubeconfig,
            format!(
                "apiVersion: v1\nkind: Config\n\
                 clusters: [{{name: c, cluster: {{server: \"https://{POD_IP}:6443\", certificate-authority: {d}/ca.crt}}}}]\n\
                 users: [{{name: u, user: {{client-certificate: {d}/admin.crt, client-key: {d}/admin.key}}}}]\n\
                 contexts: [{{name: c, context: {{cluster: c, user: u}}}}]\ncurrent-context: c\n"
            ),
        )
        .unwrap();
        Admin {
            netns: t.pod.clone(),
            kubeconfig,
        }
    }

    fn kubectl(&self) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.netns])
            .arg(repo_root().join("_output/bin/kubectl"))
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .args(["--request-timeout", "30s"]);
        c
    }

    fn get(&self, args: &[&str]) -> Option<String> {
        let out = self
            .kubectl()
            .args(args)
            .stderr(Stdio::null())
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Waits until the Node is Ready and every Pod runs with all its containers ready; prints
    /// once a minute QEMU's host CPU and what is not ready yet.
    fn wait_ready(&self, l: &mut Launcher, qemu: u32, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        let (mut t0, mut q0) = (Instant::now(), cpu_ticks(qemu));
        let mut last = String::from("no answer from the apiserver");
        loop {
            let node = self.get(&[
                "get",
                "node",
                HOSTNAME,
                "-o",
                "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}",
            ]);
            let pods = self.get(&["get", "pods", "-A", "--no-headers"]);
            if let (Some(node), Some(pods)) = (node, pods) {
                let lines: Vec<&str> = pods.lines().filter(|l| !l.trim().is_empty()).collect();
                let waiting: Vec<String> = lines
                    .iter()
                    .filter(|l| {
                        let f: Vec<&str> = l.split_whitespace().collect();
                        let ready = f.get(2).and_then(|r| r.split_once('/'));
                        f.get(3) != Some(&"Running") || ready.is_none_or(|(a, b)| a != b)
                    })
                    .map(|l| l.split_whitespace().take(5).collect::<Vec<_>>().join(" "))
                    .collect();
                last = format!(
                    "node Ready={node}, {} Pods, not ready: [{}]",
                    lines.len(),
                    waiting.join("; ")
                );
                if node == "True" && !lines.is_empty() && waiting.is_empty() {
                    return format!("{} Pods", lines.len());
                }
            }
            if t0.elapsed() >= Duration::from_secs(60) {
                let q1 = cpu_ticks(qemu);
                println!(
                    "PROGRESS {:>7.1} s: QEMU {:.0} % of a host core over the last minute; {last}",
                    l.started.elapsed().as_secs_f64(),
                    100.0 * (q1 - q0) as f64 / clock_ticks() / t0.elapsed().as_secs_f64()
                );
                (t0, q0) = (Instant::now(), q1);
            }
            assert!(
                Instant::now() < deadline,
                "the control plane did not get ready within {timeout:?}: {last}\n{}",
                self.get(&["get", "events", "-A", "--sort-by=.lastTimestamp"])
                    .unwrap_or_default()
            );
            std::thread::sleep(Duration::from_secs(10));
        }
    }

    /// `apiserver_request_total` summed by verb and resource.
    fn request_counts(&self) -> std::collections::HashMap<String, f64> {
        let text = self.get(&["get", "--raw", "/metrics"]).unwrap_or_default();
        let mut counts = std::collections::HashMap::new();
        for line in text
            .lines()
            .filter(|l| l.starts_with("apiserver_request_total{"))
        {
            let Some((labels, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let label = |k: &str| {
                labels
                    .split(&format!("{k}=\""))
                    .nth(1)
                    .and_then(|r| r.split('"').next())
                    .unwrap_or("")
                    .to_string()
            };
            let key = format!("{} {}{}", label("verb"), label("resource"), {
                let sub = label("subresource");
                if sub.is_empty() {
                    sub
                } else {
                    format!("/{sub}")
                }
            });
            *counts.entry(key).or_insert(0.0) += value.parse::<f64>().unwrap_or(0.0);
        }
        counts
    }
}

/// Clock ticks per second of /proc's CPU times.
fn clock_ticks() -> f64 {
    String::from_utf8(
        Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap()
    .trim()
    .parse()
    .unwrap()
}

#[test]
#[ignore = "boots the node-image flavor's control plane under TCG and measures it idle (minutes): make bench-idle-node"]
fn bench_idle_control_plane() {
    if !prerequisites() {
        return;
    }
    for f in ["clusterctl", "cabpk-render"] {
        let p = repo_root().join("_output/bin").join(f);
        assert!(p.exists(), "{} missing: make test-deps", p.display());
    }
    let settle: u64 = var_or("CAPK_BENCH_SETTLE_SECONDS", "30").parse().unwrap();
    let window: u64 = var_or("CAPK_BENCH_IDLE_SECONDS", "60").parse().unwrap();
    let (ignition, vcpus, memory) = flavor_control_plane(window);
    let t = Topology::new();
    let work = tempfile::Builder::new()
        .prefix("capk-idle")
        .tempdir_in("/tmp")
        .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(work.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut l = Launcher::start(&t, work.path(), &ignition, &vcpus, &memory);
    // "idle-kubeadm-done", or kubeadm's journal ("idle-kubeadm| ") before "idle-failed".
    let kubeadm = l.wait_for("CAPK-NODE idle-kubeadm", Duration::from_secs(1800));
    if !kubeadm.contains("idle-kubeadm-done") {
        let failed = l.wait_for("CAPK-NODE idle-failed", Duration::from_secs(60));
        panic!("{failed}:\n{}", l.facts("idle-kubeadm| ").join("\n"));
    }
    l.wait_for("CAPK-NODE idle-timeline-end", Duration::from_secs(300));
    for line in l.facts("idle-timeline ") {
        println!("TIMELINE {line}");
    }
    let qemu = qemu_pid(l.child.id());
    let admin = Admin::new(&t, work.path(), &ignition);
    let ready = admin.wait_ready(&mut l, qemu, Duration::from_secs(1800));
    println!(
        "MEASURE {:>7.1} s after launcher start: node Ready and every Pod ready ({ready})",
        l.started.elapsed().as_secs_f64()
    );
    std::thread::sleep(Duration::from_secs(settle));
    let requests0 = admin.request_counts();
    let out = repo_root().join("_output/bench").join(format!(
        "idle-{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs()
    ));
    std::fs::create_dir_all(&out).unwrap();
    // The guest starts its window when this file appears in its read-write host volume.
    std::fs::write(work.path().join("shared/capk-window"), "").unwrap();
    l.wait_for("CAPK-NODE idle-window-start", Duration::from_secs(120));
    let (t0, q0) = (Instant::now(), cpu_ticks(qemu));
    // CPU profiles of the apiserver and the kubelet over the window (their pprof handlers,
    // on by default), read with `go tool pprof`.
    let pprof = (std::env::var("CAPK_BENCH_PPROF").as_deref() == Ok("1")).then(|| {
        let secs = window.saturating_sub(10).max(10);
        [
            ("kube-apiserver", "/debug/pprof/profile".to_string()),
            (
                "kubelet",
                format!("/api/v1/nodes/{HOSTNAME}/proxy/debug/pprof/profile"),
            ),
        ]
        .map(|(name, path)| {
            let file = out.join(format!("{name}.pprof"));
            // kubectl's request timeout (30 s) is shorter than the profile.
            let child = admin
                .kubectl()
                .args(["--request-timeout", &format!("{}s", secs + 60)])
                .args(["get", "--raw", &format!("{path}?seconds={secs}")])
                .stdout(std::fs::File::create(&file).unwrap())
                .spawn()
                .expect("run kubectl");
            (child, file)
        })
    });
    let perf = (std::env::var("CAPK_BENCH_PERF").as_deref() == Ok("1")).then(|| {
        let data = work.path().join("perf.data");
        let child = Command::new("perf")
            .args([
                "record",
                "-q",
                "-F",
                "499",
                "-g",
                "-p",
                &qemu.to_string(),
                "-o",
            ])
            .arg(&data)
            .args(["--", "sleep", &(window - 5).to_string()])
            .stdout(Stdio::null())
            .spawn()
            .expect("run perf (apt-get install linux-perf)");
        (child, data)
    });
    l.wait_for(
        "CAPK-NODE idle-window-end",
        Duration::from_secs(window + 60),
    );
    let (secs, q1) = (t0.elapsed().as_secs_f64(), cpu_ticks(qemu));
    l.wait_for("CAPK-NODE idle-done", Duration::from_secs(120));
    let requests1 = admin.request_counts();
    let tck = clock_ticks();
    println!("MEASURE idle control plane ({vcpus} vCPUs, {memory}):");
    println!(
        "MEASURE   QEMU host CPU over {secs:.0} s: {:.0} % of one host core",
        100.0 * (q1 - q0) as f64 / tck / secs
    );
    for prefix in ["cpu ", "unaccounted", "rates ", "loadavg "] {
        println!(
            "MEASURE   guest {prefix}{}",
            l.fact(&format!("idle-{prefix}"))
        );
    }
    for p in l.facts("idle-proc ").iter().take(15) {
        println!("MEASURE   guest proc {p}");
    }
    for i in l.facts("idle-irq ") {
        println!("MEASURE   guest irq {i}");
    }
    // What the apiserver served over the window (the two /metrics reads included), by verb
    // and resource: each request is a TLS record, an authorization and an etcd round trip.
    let mut rates: Vec<(f64, String)> = requests1
        .iter()
        .map(|(k, n)| (n - requests0.get(k).copied().unwrap_or(0.0), k.clone()))
        .filter(|(d, _)| *d > 0.0)
        .map(|(d, k)| (d / secs, k))
        .collect();
    rates.sort_by(|a, b| b.0.total_cmp(&a.0));
    println!(
        "MEASURE   apiserver requests/s {:.2} in all",
        rates.iter().map(|r| r.0).sum::<f64>()
    );
    for (r, k) in rates.iter().take(12) {
        println!("MEASURE   apiserver requests/s {r:.2} {k}");
    }
    if let Some(children) = pprof {
        for (mut child, file) in children {
            let ok = child.wait().unwrap().success();
            println!(
                "MEASURE   pprof {} ({}): go tool pprof -top {}",
                file.display(),
                if ok { "written" } else { "FAILED" },
                file.display()
            );
        }
    }
    if let Some((mut child, data)) = perf {
        child.wait().unwrap();
        let report = Command::new("perf")
            .args([
                "report",
                "--stdio",
                "--no-children",
                "--sort",
                "dso,sym",
                "-g",
                "none",
                "-i",
            ])
            .arg(&data)
            .output()
            .unwrap();
        for line in String::from_utf8_lossy(&report.stdout)
            .lines()
            .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
            .take(40)
        {
            println!("MEASURE   perf {line}");
        }
    }
    // A developer comparing levers on the running node (edit a static Pod, restart the kubelet,
    // measure QEMU again) keeps it: the guest runs until the file is removed.
    if std::env::var("CAPK_BENCH_HOLD").as_deref() == Ok("1") {
        let hold = work.path().join("hold");
        std::fs::write(&hold, "").unwrap();
        println!(
            "HOLD QEMU pid {qemu}; kubectl: ip netns exec {} {} --kubeconfig {}; rm {} to end",
            admin.netns,
            repo_root().join("_output/bin/kubectl").display(),
            admin.kubeconfig.display(),
            hold.display()
        );
        while hold.exists() {
            std::thread::sleep(Duration::from_secs(5));
        }
    }
}
