//! `capk-supervise NAME COMMAND [ARGS...]`: keeps one daemon of the local management cluster
//! running (`hack/dev/lib.sh`'s `start_daemon`), as systemd's `Restart=always` would where no
//! systemd runs.
//!
//! It runs COMMAND; whenever that exits, for any reason, it starts it again after a back-off:
//! 1 s, doubled up to 30 s, back to 1 s once a run lasted a minute. Every exit and restart is a
//! line of the daemon's log (this process's stdout and stderr, which the daemon shares), and is
//! counted in `$CAPK_DEV_RUN/NAME.restarts`; `$CAPK_DEV_RUN/NAME.child` holds the pid of the
//! current run. SIGTERM or SIGINT stops the current run (SIGTERM, then waiting for it) and then
//! the supervisor, which exits 0. Descriptors above 2 that its caller left open are closed first:
//! they are not the daemon's (a `flock` held around `make dev-up` would stay held, a pipe to
//! `tee` would never end).
#![forbid(unsafe_code)]

use std::{
    path::{Path, PathBuf},
    process::{ExitCode, ExitStatus, Stdio},
    time::{Duration, Instant},
};

use nix::{sys::signal, unistd::Pid};
use tokio::{
    process::{Child, Command},
    signal::unix::{SignalKind, signal as unix_signal},
};

/// The first wait before a restart.
const FIRST_DELAY: Duration = Duration::from_secs(1);
/// The longest wait before a restart.
const MAX_DELAY: Duration = Duration::from_secs(30);
/// A run that lasted this long resets the back-off.
const STEADY: Duration = Duration::from_secs(60);

/// The wait before the next restart, after a run that lasted `up` and a previous wait `delay`;
/// and the wait after that.
fn back_off(delay: Duration, up: Duration) -> (Duration, Duration) {
    let now = if up >= STEADY { FIRST_DELAY } else { delay };
    (now, (now * 2).min(MAX_DELAY))
}

/// Closes every descriptor above stderr (best effort: the one that listed them is gone by then).
fn close_inherited_descriptors() {
    let fds: Vec<i32> = std::fs::read_dir("/proc/self/fd")
        .map(|dir| {
            dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .filter(|fd| *fd > 2)
                .collect()
        })
        .unwrap_or_default();
    for fd in fds {
        let _ = nix::unistd::close(fd);
    }
}

fn stamp() -> String {
    jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

/// What ended a run, as a log line says it.
fn ended(status: std::io::Result<ExitStatus>) -> String {
    use std::os::unix::process::ExitStatusExt;
    match status {
        Ok(s) => match (s.code(), s.signal()) {
            (Some(code), _) => format!("exited with status {code}"),
            (None, Some(sig)) => format!("was killed by signal {sig}"),
            _ => format!("ended ({s})"),
        },
        Err(e) => format!("could not be waited for ({e})"),
    }
}

struct Supervisor {
    name: String,
    run: PathBuf,
}

impl Supervisor {
    fn record(&self, what: &str, value: impl ToString) {
        let path = self.run.join(format!("{}.{what}", self.name));
        if let Err(e) = std::fs::write(&path, value.to_string()) {
            eprintln!("{} supervise: {}: {e}", stamp(), path.display());
        }
    }

    fn spawn(&self, command: &[String]) -> std::io::Result<Child> {
        let child = Command::new(&command[0])
            .args(&command[1..])
            .stdin(Stdio::inherit())
            .spawn()?;
        if let Some(pid) = child.id() {
            self.record("child", pid);
        }
        Ok(child)
    }
}

/// Stops `child`: SIGTERM, then waits for it to be gone.
async fn stop(child: &mut Child) {
    if let Some(pid) = child.id() {
        let _ = signal::kill(Pid::from_raw(pid as i32), signal::Signal::SIGTERM);
    }
    let _ = child.wait().await;
}

async fn supervise(sup: Supervisor, command: Vec<String>) -> std::io::Result<()> {
    let mut term = unix_signal(SignalKind::terminate())?;
    let mut int = unix_signal(SignalKind::interrupt())?;
    let mut delay = FIRST_DELAY;
    let mut restarts: u64 = 0;
    sup.record("restarts", restarts);
    loop {
        let started = Instant::now();
        let status = match sup.spawn(&command) {
            Ok(mut child) => tokio::select! {
                status = child.wait() => status,
                _ = term.recv() => {
                    stop(&mut child).await;
                    return Ok(());
                }
                _ = int.recv() => {
                    stop(&mut child).await;
                    return Ok(());
                }
            },
            Err(e) => Err(e),
        };
        let up = started.elapsed();
        let (wait, next) = back_off(delay, up);
        restarts += 1;
        sup.record("restarts", restarts);
        println!(
            "{} supervise: {} {} after {}s; restart {restarts} in {}s",
            stamp(),
            sup.name,
            ended(status),
            up.as_secs(),
            wait.as_secs()
        );
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = term.recv() => return Ok(()),
            _ = int.recv() => return Ok(()),
        }
        delay = next;
    }
}

fn main() -> ExitCode {
    close_inherited_descriptors();
    let mut args = std::env::args().skip(1);
    let (Some(name), command) = (args.next(), args.collect::<Vec<_>>()) else {
        eprintln!("usage: capk-supervise NAME COMMAND [ARGS...] (with CAPK_DEV_RUN set)");
        return ExitCode::from(2);
    };
    let Some(run) = std::env::var_os("CAPK_DEV_RUN").map(PathBuf::from) else {
        eprintln!("capk-supervise: CAPK_DEV_RUN must name the run directory");
        return ExitCode::from(2);
    };
    if command.is_empty() || !Path::new(&run).is_dir() {
        eprintln!(
            "capk-supervise: needs a COMMAND and CAPK_DEV_RUN={} to be a directory",
            run.display()
        );
        return ExitCode::from(2);
    }
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("capk-supervise: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(supervise(Supervisor { name, run }, command)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("capk-supervise: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_back_off_doubles_up_to_thirty_seconds_and_resets_after_a_steady_minute() {
        let s = Duration::from_secs;
        let mut delay = FIRST_DELAY;
        let mut waits = Vec::new();
        for _ in 0..7 {
            let (wait, next) = back_off(delay, s(2));
            waits.push(wait.as_secs());
            delay = next;
        }
        assert_eq!(waits, [1, 2, 4, 8, 16, 30, 30]);
        assert_eq!(back_off(delay, s(61)), (s(1), s(2)));
    }
}
