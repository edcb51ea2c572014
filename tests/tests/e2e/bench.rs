//! The machine benchmark (`make bench-e2e`): how long a machine takes to boot, and what its Pod
//! costs beyond the guest's RAM (QEMU and the launcher, from the Pod's cgroup).

use super::*;

/// Resident KiB of QEMU's guest-RAM mapping: the anonymous mapping whose size is the guest's
/// memory (`/proc/PID/smaps`).
pub(crate) fn guest_ram_rss_kib(pid: u32, guest_kib: u64) -> Result<u64> {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps"))?;
    let mut size_matches = false;
    for line in smaps.lines() {
        let mut f = line.split_whitespace();
        match (f.next(), f.next()) {
            (Some("Size:"), Some(kib)) => size_matches = kib.parse::<u64>().ok() == Some(guest_kib),
            (Some("Rss:"), Some(kib)) if size_matches => return Ok(kib.parse()?),
            _ => {}
        }
    }
    bail!("no {guest_kib} KiB mapping in /proc/{pid}/smaps")
}

/// A machine Pod's memory from its cgroup (v1, cgroupfs driver: kubepods/[<qos>/]pod<uid>):
/// working set (usage minus inactive file cache), and
/// the processes in it with their RSS.
pub(crate) struct PodMemory {
    pub(crate) working_set_kib: u64,
    pub(crate) qemu_rss_kib: u64,
    pub(crate) launcher_rss_kib: u64,
    pub(crate) guest_ram_rss_kib: u64,
}

/// The cgroup directory of KVMMachine `machine`'s Pod under a cgroup v1 `controller` (`memory`,
/// `cpuacct`; cgroupfs driver): kubepods/[<qos>/]pod<uid>.
pub(crate) fn pod_cgroup(e: &E2e, machine: &str, controller: &str) -> Result<PathBuf> {
    let p = machine_pod(e, machine)?;
    let uid = p["metadata"]["uid"].as_str().context("pod uid")?;
    // Guaranteed Pods sit directly under kubepods, the others under their QoS class.
    let qos = match p["status"]["qosClass"].as_str() {
        Some("Burstable") => "burstable/",
        Some("BestEffort") => "besteffort/",
        _ => "",
    };
    Ok(PathBuf::from(format!(
        "/sys/fs/cgroup/{controller}/kubepods/{qos}pod{uid}"
    )))
}

/// CPU time the processes of KVMMachine `machine`'s Pod (QEMU and the launcher) have used, from
/// its cgroup's `cpuacct.usage`.
pub(crate) fn pod_cpu_time(e: &E2e, machine: &str) -> Result<Duration> {
    let file = pod_cgroup(e, machine, "cpuacct")?.join("cpuacct.usage");
    let ns: u64 = std::fs::read_to_string(&file)
        .with_context(|| file.display().to_string())?
        .trim()
        .parse()
        .with_context(|| file.display().to_string())?;
    Ok(Duration::from_nanos(ns))
}

/// [`PodMemory`] of KVMMachine `machine`'s Pod.
pub(crate) fn pod_memory(e: &E2e, machine: &str, guest_kib: u64) -> Result<PodMemory> {
    let dir = pod_cgroup(e, machine, "memory")?;
    let read = |f: &str| {
        std::fs::read_to_string(dir.join(f)).with_context(|| format!("{}/{f}", dir.display()))
    };
    let usage: u64 = read("memory.usage_in_bytes")?.trim().parse()?;
    let inactive_file: u64 = read("memory.stat")?
        .lines()
        .find_map(|l| l.strip_prefix("total_inactive_file "))
        .context("total_inactive_file")?
        .trim()
        .parse()?;
    let mut m = PodMemory {
        working_set_kib: usage.saturating_sub(inactive_file) / 1024,
        qemu_rss_kib: 0,
        launcher_rss_kib: 0,
        guest_ram_rss_kib: 0,
    };
    for entry in std::fs::read_dir(&dir)? {
        let procs = entry?.path().join("cgroup.procs");
        let Ok(text) = std::fs::read_to_string(&procs) else {
            continue;
        };
        for pid in text.lines().filter_map(|l| l.trim().parse::<u32>().ok()) {
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
            let rss: u64 = status
                .lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
                .unwrap_or(0);
            match comm.trim() {
                c if c.starts_with("qemu-system") => {
                    m.qemu_rss_kib = rss;
                    m.guest_ram_rss_kib = guest_ram_rss_kib(pid, guest_kib)?;
                }
                "capk-launcher" => m.launcher_rss_kib = rss,
                _ => {}
            }
        }
    }
    if m.qemu_rss_kib == 0 {
        bail!("no QEMU process in {}", dir.display());
    }
    Ok(m)
}

pub(crate) fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// `make bench-e2e`: Machine created -> guest up for 10 workers, one at a time (each measured
/// alone: 2 cores under TCG), and each machine Pod's memory beyond the guest's RAM.
pub(crate) fn bench(e: &E2e) -> Result<()> {
    const MACHINES: usize = 10;
    const GUEST_KIB: u64 = 256 * 1024;
    create_cluster(e)?;
    prepare_workers(e)?;
    let mut seconds = Vec::new();
    let mut seen: Vec<String> = Vec::new();
    for n in 1..=MACHINES {
        let start = Instant::now();
        e.kubectl(&[
            "-n",
            ns(),
            "scale",
            "machinedeployment",
            "e2e-md-0",
            &format!("--replicas={n}"),
        ])?;
        // The new worker's KVMMachine reports BootstrapCompleted: the guest is up and its
        // bootstrap ran (what makes CAPI's Machine provisioned).
        let new = loop {
            if start.elapsed() > Duration::from_secs(300) {
                bail!("worker {n} not up after 300s");
            }
            let up: Vec<String> = e
                .items("kvmmachines", Some("!cluster.x-k8s.io/control-plane"))?
                .iter()
                .filter(|k| condition_true(k, "BootstrapCompleted"))
                .map(|k| name(k).to_owned())
                .filter(|k| !seen.contains(k))
                .collect();
            if let Some(k) = up.into_iter().next() {
                break k;
            }
            sleep(Duration::from_millis(200));
        };
        let s = start.elapsed().as_secs_f64();
        eprintln!("bench-e2e: worker {n}/{MACHINES} {new} up in {s:.1}s");
        seconds.push(s);
        seen.push(new);
    }
    let mut sorted = seconds.clone();
    sorted.sort_by(f64::total_cmp);
    let mut overhead = Vec::new();
    for k in &seen {
        let m = pod_memory(e, k, GUEST_KIB)?;
        let beyond = m.working_set_kib.saturating_sub(m.guest_ram_rss_kib) as f64 / 1024.0;
        eprintln!(
            "bench-e2e: {k}: pod working set {:.0} MiB, QEMU RSS {:.0} MiB (guest RAM resident {:.0} of {} MiB), launcher RSS {:.1} MiB, beyond guest RAM {beyond:.0} MiB",
            m.working_set_kib as f64 / 1024.0,
            m.qemu_rss_kib as f64 / 1024.0,
            m.guest_ram_rss_kib as f64 / 1024.0,
            GUEST_KIB / 1024,
            m.launcher_rss_kib as f64 / 1024.0,
        );
        overhead.push(beyond);
    }
    overhead.sort_by(f64::total_cmp);
    println!(
        "bench-e2e: machine created -> guest up over {MACHINES} workers (TCG, one at a time): P50 {:.1}s P95 {:.1}s (target P50 <= 10s)",
        percentile(&sorted, 0.5),
        percentile(&sorted, 0.95)
    );
    println!(
        "bench-e2e: machine Pod memory beyond the guest's RAM (QEMU + launcher, cgroup working set minus resident guest RAM, 1 vCPU / 256 MiB TCG guest): P50 {:.0} MiB max {:.0} MiB (target <= 100 MiB)",
        percentile(&overhead, 0.5),
        overhead.last().copied().unwrap_or_default()
    );
    e.kubectl(&["-n", ns(), "delete", "cluster", CLUSTER, "--timeout=300s"])?;
    e.kubectl(&["delete", "namespace", ns(), "--timeout=120s"])?;
    Ok(())
}
