//! The process's own series, as Prometheus client libraries export them by default (Cluster
//! API's "Controller Runtime" dashboard charts `process_open_fds`): open and allowed file
//! descriptors, memory, CPU time and start time, read from `/proc/self` at each scrape.

use std::sync::atomic::AtomicU64;

use prometheus_client::{
    metrics::{counter::Counter, gauge::Gauge},
    registry::Registry,
};

use super::register;

/// Clock ticks per second of `/proc/<pid>/stat` times (Linux's `USER_HZ`, 100 on every
/// architecture it runs on).
const USER_HZ: f64 = 100.0;

/// The process gauges.
pub(super) struct Process {
    open_fds: Gauge,
    max_fds: Gauge,
    resident: Gauge,
    virtual_bytes: Gauge,
    cpu: Counter<f64, AtomicU64>,
    start: Gauge<f64, AtomicU64>,
}

impl Process {
    /// Registers the series in `registry`.
    pub(super) fn register(r: &mut Registry) -> Self {
        Self {
            open_fds: register(
                r,
                "process_open_fds",
                "Number of open file descriptors.",
                Gauge::default(),
            ),
            max_fds: register(
                r,
                "process_max_fds",
                "Maximum number of open file descriptors.",
                Gauge::default(),
            ),
            resident: register(
                r,
                "process_resident_memory_bytes",
                "Resident memory size in bytes.",
                Gauge::default(),
            ),
            virtual_bytes: register(
                r,
                "process_virtual_memory_bytes",
                "Virtual memory size in bytes.",
                Gauge::default(),
            ),
            cpu: register(
                r,
                "process_cpu_seconds",
                "Total user and system CPU time spent in seconds.",
                Counter::default(),
            ),
            start: register(
                r,
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds.",
                Gauge::default(),
            ),
        }
    }

    /// Reads `/proc/self` into the series; what cannot be read keeps its last value.
    pub(super) fn update(&self) {
        if let Ok(fds) = std::fs::read_dir("/proc/self/fd") {
            self.open_fds.set(fds.count() as i64);
        }
        if let Ok(limits) = std::fs::read_to_string("/proc/self/limits")
            && let Some(max) = max_open_files(&limits)
        {
            self.max_fds.set(max);
        }
        if let Ok(status) = std::fs::read_to_string("/proc/self/status")
            && let Some(kib) = status_kib(&status, "VmRSS:")
        {
            self.resident.set(kib * 1024);
        }
        let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
            return;
        };
        let Some(stat) = Stat::parse(&stat) else {
            return;
        };
        self.virtual_bytes.set(stat.vsize);
        let cpu = (stat.utime + stat.stime) as f64 / USER_HZ;
        let counted = self.cpu.get();
        if cpu > counted {
            self.cpu.inc_by(cpu - counted);
        }
        if self.start.get() == 0.0
            && let Ok(kernel) = std::fs::read_to_string("/proc/stat")
            && let Some(boot) = kernel
                .lines()
                .find_map(|l| l.strip_prefix("btime ")?.trim().parse::<f64>().ok())
        {
            self.start.set(boot + stat.starttime as f64 / USER_HZ);
        }
    }
}

/// The soft limit of open files in `/proc/<pid>/limits`.
fn max_open_files(limits: &str) -> Option<i64> {
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line.trim_start_matches("Max open files")
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// A `kB` value of `/proc/<pid>/status` (`VmRSS:   1234 kB`).
fn status_kib(status: &str, key: &str) -> Option<i64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// What the series need of `/proc/<pid>/stat`.
#[derive(Debug, PartialEq)]
struct Stat {
    utime: u64,
    stime: u64,
    starttime: u64,
    vsize: i64,
}

impl Stat {
    /// Fields counted from 1 as proc(5) numbers them; the command name (2) may hold spaces and
    /// parentheses, so counting starts after its last `)`.
    fn parse(stat: &str) -> Option<Self> {
        let after = &stat[stat.rfind(')')? + 1..];
        // `after` starts with field 3.
        let fields: Vec<&str> = after.split_whitespace().collect();
        let field = |n: usize| fields.get(n - 3).copied();
        Some(Self {
            utime: field(14)?.parse().ok()?,
            stime: field(15)?.parse().ok()?,
            starttime: field(22)?.parse().ok()?,
            vsize: field(23)?.parse().ok()?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_counted_after_the_command_name() {
        let stat = "4242 (capk (ctl) x) S 1 4242 4242 0 -1 4194560 1000 0 0 0 250 50 0 0 20 0 \
                    9 0 123456 104857600 3000 18446744073709551615";
        assert_eq!(
            Stat::parse(stat),
            Some(Stat {
                utime: 250,
                stime: 50,
                starttime: 123456,
                vsize: 104857600
            })
        );
    }

    #[test]
    fn limits_and_status_values_are_read() {
        let limits = "Limit                     Soft Limit           Hard Limit           Units\n\
                      Max open files            1048576              1048576              files\n";
        assert_eq!(max_open_files(limits), Some(1048576));
        assert_eq!(
            status_kib("Name:\tx\nVmRSS:\t   51200 kB\n", "VmRSS:"),
            Some(51200)
        );
    }

    #[test]
    fn this_process_has_open_files_and_memory() {
        let mut registry = Registry::default();
        let p = Process::register(&mut registry);
        p.update();
        assert!(p.open_fds.get() > 0);
        assert!(p.resident.get() > 0);
        assert!(p.start.get() > 1.6e9, "{}", p.start.get());
    }
}
