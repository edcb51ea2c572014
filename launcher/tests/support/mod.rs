//! Shared by the launcher's integration tests that boot a guest (`vm_netns.rs`, `node_image.rs`):
//! the repository, the prerequisites check, shell steps, network namespaces built like a CNI's
//! Pod network, and a running `capk-launcher run` with its console.
#![allow(dead_code)] // each test binary uses its part

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::time::{Duration, Instant};

/// QEMU's user (the launcher's default, KubeVirt's qemu user).
pub const QEMU_ID: u32 = 107;

/// The repository's root (the launcher crate's parent).
pub fn repo_root() -> PathBuf {
    package_dir().parent().unwrap().to_path_buf()
}

/// Whether the test runs as root (network namespaces, taps, QEMU's user).
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .map(|s| {
            s.lines()
                .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false)
}

/// True when root, `ip`, QEMU and each of `files` (a path and how to get it) are there. Otherwise
/// the test (`what`) fails under `CI` with what is missing and how to get it, or is skipped with
/// that reason.
pub fn prerequisites(what: &str, files: &[(PathBuf, &str)]) -> bool {
    let mut missing = Vec::new();
    if !is_root() {
        missing.push("root (run the tests as root)".to_string());
    }
    for (tool, how) in [
        ("ip", "apt-get install iproute2"),
        ("qemu-system-x86_64", "apt-get install qemu-system-x86"),
        ("qemu-img", "apt-get install qemu-utils"),
    ] {
        let found = Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .output()
            .is_ok_and(|o| o.status.success());
        if !found {
            missing.push(format!("{tool} ({how})"));
        }
    }
    for (file, how) in files {
        if !file.exists() {
            missing.push(format!("{} ({how})", file.display()));
        }
    }
    if missing.is_empty() {
        return true;
    }
    let msg = format!("{what} needs: {}", missing.join(", "));
    if std::env::var_os("CI").is_some() {
        panic!("{msg}");
    }
    eprintln!("skipping: {msg}");
    false
}

/// Runs `cmd` with `sh -c`; fails the test with its output when it fails.
pub fn sh(cmd: &str) {
    let out = Command::new("sh")
        .args(["-c", cmd])
        .output()
        .expect("run sh");
    assert!(
        out.status.success(),
        "{cmd} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The trimmed stdout of `sh -c cmd`, whatever its exit status.
pub fn sh_out(cmd: &str) -> String {
    let out = Command::new("sh")
        .args(["-c", cmd])
        .output()
        .expect("run sh");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// sha256 of `bytes` as hex, by sha256sum (the guests report file digests the same way).
pub fn sha256_hex(bytes: &[u8]) -> String {
    let mut c = Command::new("sha256sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("run sha256sum");
    c.stdin.take().unwrap().write_all(bytes).unwrap();
    let out = c.wait_with_output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string()
}

/// Pids whose parent is `ppid` (QEMU under the launcher).
pub fn children_of(ppid: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| s.rsplit_once(") ").map(|(_, rest)| rest.to_string()))
                .and_then(|rest| {
                    rest.split_whitespace()
                        .nth(1)
                        .and_then(|p| p.parse::<u32>().ok())
                })
                == Some(ppid)
        })
        .collect()
}

/// Network namespaces of one test, made with loopback up; deleted on drop, also when the test
/// fails.
pub struct Namespaces(Vec<String>);

impl Namespaces {
    pub fn create(names: &[impl AsRef<str>]) -> Namespaces {
        let mut made = Namespaces(Vec::new());
        for ns in names.iter().map(AsRef::as_ref) {
            sh(&format!("ip netns add {ns} && ip -n {ns} link set lo up"));
            made.0.push(ns.to_string());
        }
        made
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        for ns in self.0.iter().rev() {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

/// Calico's node side in `node`: forwarding on, and 169.254.1.1 routed out of a veth, because
/// proxy ARP answers only for addresses routed out of another interface (a veth pair: this
/// machine's kernel has no dummy driver).
pub fn calico_node(node: &str) {
    let n = node;
    sh(&format!(
        "ip netns exec {n} sysctl -qw net.ipv4.ip_forward=1"
    ));
    sh(&format!(
        "ip -n {n} link add gw0 type veth peer name gw0p && ip -n {n} link set gw0p up && \
         ip -n {n} link set gw0 up && ip -n {n} route add 169.254.1.1/32 dev gw0"
    ));
}

/// A Calico Pod `pod` on `node` (see [`calico_node`]): eth0 holds `ip`/32 with the default route
/// via 169.254.1.1 on-link; the node's veth `cali` answers ARP for it by proxy and routes `ip`/32
/// to it. Both ends have MTU `mtu`.
pub fn calico_pod(node: &str, pod: &str, cali: &str, ip: &str, mtu: u32) {
    let (n, ns) = (node, pod);
    sh(&format!(
        "ip -n {n} link add {cali} mtu {mtu} type veth peer name eth0 mtu {mtu} netns {ns}"
    ));
    sh(&format!(
        "ip netns exec {n} sysctl -qw net.ipv4.conf.{cali}.proxy_arp=1 net.ipv4.neigh.{cali}.proxy_delay=0"
    ));
    sh(&format!(
        "ip -n {n} link set {cali} up && ip -n {n} route add {ip}/32 dev {cali}"
    ));
    sh(&format!(
        "ip -n {ns} addr add {ip}/32 dev eth0 && ip -n {ns} link set eth0 up"
    ));
    sh(&format!(
        "ip -n {ns} route add 169.254.1.1 dev eth0 scope link && ip -n {ns} route add default via 169.254.1.1 dev eth0 onlink"
    ));
}

/// A running `capk-launcher run`: its console (stdout) and its log (stderr, each line prefixed
/// `LAUNCHER `), echoed to the test's output and kept in the order they came. On drop the
/// launcher and its children (QEMU) are killed if still running: a failed assertion leaves
/// nothing behind.
pub struct Launcher {
    pub child: Child,
    lines: Receiver<(String, Instant)>,
    /// Every line read so far, and when it was read (benchmarks time the console).
    pub seen: Vec<String>,
    pub seen_at: Vec<Instant>,
    /// The launcher's `--runtime-dir` (its control socket).
    pub runtime_dir: PathBuf,
    pub started: Instant,
    /// How many of the last lines a failed wait shows.
    pub diagnostic_lines: usize,
}

impl Launcher {
    /// Spawns `command` (`ip netns exec … capk-launcher run …`) with its output piped; `console`
    /// turns each console line into the one kept (e.g. without terminal escapes).
    pub fn spawn(mut command: Command, runtime_dir: PathBuf, console: fn(&str) -> String) -> Self {
        let started = Instant::now();
        let mut child = command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start capk-launcher");
        let (tx, rx) = channel();
        let out = child.stdout.take().unwrap();
        let err = child.stderr.take().unwrap();
        let tx2 = tx.clone();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                let at = Instant::now();
                println!("console| {l}");
                let _ = tx.send((console(&l), at));
            }
        });
        std::thread::spawn(move || {
            for l in BufReader::new(err).lines().map_while(Result::ok) {
                let at = Instant::now();
                println!("launcher| {l}");
                let _ = tx2.send((format!("LAUNCHER {l}"), at));
            }
        });
        Launcher {
            child,
            lines: rx,
            seen: Vec::new(),
            seen_at: Vec::new(),
            runtime_dir,
            started,
            diagnostic_lines: usize::MAX,
        }
    }

    /// Waits for a line containing `needle`; returns it.
    pub fn wait_for(&mut self, needle: &str, timeout: Duration) -> String {
        self.wait_for_at(needle, timeout).0
    }

    /// Waits for a line containing `needle`; returns it and the seconds from the launcher's
    /// start to when the line was read.
    pub fn wait_for_at(&mut self, needle: &str, timeout: Duration) -> (String, f64) {
        let started = self.started;
        let since = |at: Instant| at.duration_since(started).as_secs_f64();
        if let Some(i) = self.seen.iter().position(|l| l.contains(needle)) {
            return (self.seen[i].clone(), since(self.seen_at[i]));
        }
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok((l, at)) => {
                    self.seen.push(l.clone());
                    self.seen_at.push(at);
                    if l.contains(needle) {
                        return (l, since(at));
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    panic!("no {needle:?} within {timeout:?}; saw:\n{}", self.tail())
                }
                Err(RecvTimeoutError::Disconnected) => {
                    panic!("launcher ended before {needle:?}; saw:\n{}", self.tail())
                }
            }
        }
    }

    /// The last [`diagnostic_lines`](Self::diagnostic_lines) lines seen.
    pub fn tail(&self) -> String {
        let from = self.seen.len().saturating_sub(self.diagnostic_lines);
        self.seen[from..].join("\n")
    }

    /// `capk-launcher ARGS --runtime-dir …` against this launcher (`probe readiness`, …): whether
    /// it succeeded and its trimmed stdout.
    pub fn cli(&self, args: &[&str]) -> (bool, String) {
        let out = Command::new(env!("CARGO_BIN_EXE_capk-launcher"))
            .args(args)
            .args(["--runtime-dir", &self.runtime_dir.display().to_string()])
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).trim().to_string(),
        )
    }

    /// Polls probe `kind` until it passes (`want`) or fails (`!want`); returns its output.
    pub fn wait_probe(&self, kind: &str, want: bool, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let (ok, out) = self.cli(&["probe", kind]);
            if ok == want || Instant::now() > deadline {
                assert_eq!(ok, want, "probe {kind}: {out}");
                return out;
            }
            std::thread::sleep(Duration::from_millis(300));
        }
    }

    /// Waits until probe `kind` fails with a reason containing `needle`; returns the reason.
    pub fn wait_probe_reason(&self, kind: &str, needle: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let (ok, out) = self.cli(&["probe", kind]);
            assert!(!ok, "probe {kind} passed, expected {needle:?}: {out}");
            if out.contains(needle) {
                return out;
            }
            assert!(
                Instant::now() < deadline,
                "probe {kind} never said {needle:?}; last: {out}"
            );
            std::thread::sleep(Duration::from_millis(300));
        }
    }

    /// Waits for the launcher to exit; keeps what it printed last.
    pub fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                // Drain what is left for diagnostics.
                while let Ok((l, at)) = self.lines.recv_timeout(Duration::from_millis(200)) {
                    self.seen.push(l);
                    self.seen_at.push(at);
                }
                return s;
            }
            assert!(
                Instant::now() < deadline,
                "launcher did not exit within {timeout:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The launcher's last one-line error (`capk-launcher: <what>: <why>`), empty if none.
    pub fn exit_cause(&self) -> String {
        self.seen
            .iter()
            .rev()
            .find(|x| x.contains("capk-launcher: "))
            .cloned()
            .unwrap_or_default()
    }
}

impl Drop for Launcher {
    fn drop(&mut self) {
        // A failed assertion must not leave QEMU running: kill the launcher's children first.
        if self.child.try_wait().ok().flatten().is_none() {
            for pid in children_of(self.child.id()) {
                let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            }
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// This package's directory: Cargo's `CARGO_MANIFEST_DIR` of this test run, falling back to the
/// one it was compiled with. Checkouts share Cargo's build cache (`$CAPK_CACHE/target`), so a
/// binary Cargo finds fresh may have been compiled in another checkout.
fn package_dir() -> std::path::PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| env!("CARGO_MANIFEST_DIR").into(), Into::into)
}
