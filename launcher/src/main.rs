//! `capk-launcher`: PID 1 of a machine Pod; turns the Pod into a VM host.
#![forbid(unsafe_code)]

use std::process::ExitCode;
use std::time::Duration;

use capk_launcher::cli::{
    Cli, Command, FetchImageArgs, LogFormat, ProbeArgs, QmpCommandArg, RemoveEtcdDataArgs,
    SocketArgs,
};
use capk_launcher::control::{self, ProbeKind, Request};
use capk_launcher::{accel, run};
use clap::Parser;

fn init_tracing(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("CAPK_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colours only on a terminal: kubectl logs and test harnesses read plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// The error and its causes on one line.
fn one_line(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s.replace('\n', " ")
}

/// Prints the console copy (its rotated predecessor first), then (when `follow`) what is
/// written, across rotations, until interrupted.
fn follow_console(path: &std::path::Path, follow: bool) -> std::io::Result<()> {
    use capk_launcher::console::{self, ConsoleFollower};
    use std::io::{Read, Write};
    let mut out = std::io::stdout().lock();
    let mut buf = vec![0u8; 64 * 1024];
    let mut follower = ConsoleFollower::open(path)?;
    if let Ok(mut older) = console::open_for_reading(&console::rotated(path)) {
        loop {
            let n = older.read(&mut buf)?;
            if n == 0 {
                break;
            }
            out.write_all(&buf[..n])?;
        }
    }
    loop {
        let n = follower.read(&mut buf)?;
        if n > 0 {
            out.write_all(&buf[..n])?;
            continue;
        }
        if !follow {
            return Ok(());
        }
        out.flush()?;
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `fetch-image`: fills the cache and links the image, or writes `<Reason>: <message>` (one
/// line, for the controller) to the termination log and fails.
fn fetch_image(args: &FetchImageArgs) -> ExitCode {
    use capk_launcher::image_cache::{self, ImageCacheError};
    let result = fetch_image_config(args).and_then(|(source, config)| {
        let filled = image_cache::fill(&source, &config)?;
        tracing::info!(
            image = %source.describe(),
            path = %filled.path.display(),
            downloaded = filled.downloaded,
            evicted = ?filled.evicted,
            "node image ready"
        );
        if let Some(link) = &args.link {
            image_cache::link(&filled.path, link)?;
        }
        Ok::<_, ImageCacheError>(())
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let line = format!("{}: {}", e.reason(), one_line(&e));
            tell_the_controller(&args.termination_log, &line);
            ExitCode::FAILURE
        }
    }
}

/// `remove-etcd-data`: removes the directory when its marker names the owner given, and writes
/// one line for the controller to the termination log: what was done, or
/// `EtcdCleanupRefused: <why>` (exit code 3: nothing removed, for good), or the failure (exit
/// code 1: worth another try).
fn remove_etcd_data(args: &RemoveEtcdDataArgs) -> ExitCode {
    use capk_api::etcd_owner::{CLEANUP_REFUSED_EXIT_CODE, REASON_CLEANUP_REFUSED};
    use capk_launcher::etcd_dir::{self, Removal, RemoveError};
    let dir = args.dir.display();
    let (line, code) = match etcd_dir::remove(&args.dir, &args.owner) {
        Ok(Removal::Removed) => (
            format!("removed the etcd disk, its owner marker and {dir}"),
            ExitCode::SUCCESS,
        ),
        Ok(Removal::DiskRemoved { left }) => (
            format!(
                "removed the etcd disk; left {dir} and its owner marker: it also holds {}",
                left.join(", ")
            ),
            ExitCode::SUCCESS,
        ),
        Ok(Removal::NothingThere) => (format!("nothing to remove in {dir}"), ExitCode::SUCCESS),
        Err(RemoveError::Refused { refusal, .. }) => (
            format!("{REASON_CLEANUP_REFUSED}: {dir} left as it is: {refusal}"),
            ExitCode::from(CLEANUP_REFUSED_EXIT_CODE as u8),
        ),
        Err(e) => (one_line(&e), ExitCode::FAILURE),
    };
    tell_the_controller(&args.termination_log, &line);
    code
}

/// Prints `line` on stderr and writes it to the termination log: the kubelet shows it in the
/// container's terminated state, where the controller reads it. Outside a Pod there is no such
/// file, and stderr has said it.
fn tell_the_controller(termination_log: &std::path::Path, line: &str) {
    eprintln!("capk-launcher: {line}");
    let _ = std::fs::write(termination_log, format!("{line}\n"));
}

/// The source and cache settings `fetch-image` was given.
fn fetch_image_config(
    args: &FetchImageArgs,
) -> Result<
    (
        capk_launcher::image_cache::ImageSource,
        capk_launcher::image_cache::CacheConfig,
    ),
    capk_launcher::image_cache::ImageCacheError,
> {
    use capk_api::file_error::FileError;
    use capk_flatcar_image::fetch::Curl;
    use capk_flatcar_image::signature::SignatureVerifier;
    use capk_launcher::image_cache::{CacheConfig, ImageCacheError as E, ImageSource};
    let source = match (&args.url, &args.sha256, &args.flatcar_version) {
        (Some(url), Some(sha256), None) => ImageSource::url(url, sha256)?,
        (None, None, Some(version)) => {
            let channel = args
                .flatcar_channel
                .parse()
                .map_err(|e| E::Source(format!("{e}")))?;
            let version = version
                .parse()
                .map_err(|e| E::Source(format!("{e}; pin a release")))?;
            ImageSource::flatcar(channel, version, args.flatcar_base_url.as_deref())?
        }
        _ => {
            return Err(E::Source(
                "give --url with --sha256, or --flatcar-version".into(),
            ));
        }
    };
    let verifier = match &args.flatcar_key {
        None => SignatureVerifier::flatcar(),
        Some(path) => {
            let key = std::fs::read(path).map_err(FileError::at("read the Flatcar key", path))?;
            SignatureVerifier::from_key(&key, None).map_err(|e| E::Source(e.to_string()))?
        }
    }
    .with_gpgv(&args.gpgv);
    let curl = Curl::new(&args.curl)
        .allow_http()
        .resumable()
        .attempts(args.attempts)
        .timeouts(
            Duration::from_secs(args.connect_timeout_seconds),
            Duration::from_secs(args.stall_seconds),
        )
        .max_bytes(args.max_cache_size.0);
    let config = CacheConfig {
        dir: args.cache_dir.clone(),
        max_bytes: args.max_cache_size.0,
        grace: Duration::from_secs(args.keep_used_seconds),
        curl,
        verifier,
    };
    Ok((source, config))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("capk-launcher: start async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match cli.command {
        Command::Run(args) => {
            init_tracing(cli.log_format);
            match rt.block_on(run::run(*args)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => failed(&e),
            }
        }
        Command::Probe(p) => probe(&rt, &p),
        Command::Status(s) => status(&rt, &s),
        Command::Console { socket, no_follow } => console(&socket, !no_follow),
        Command::Qmp { command, socket } => qmp(&rt, &socket, command),
        Command::FetchImage(args) => {
            init_tracing(cli.log_format);
            fetch_image(&args)
        }
        Command::RemoveEtcdData(args) => remove_etcd_data(&args),
        Command::ProbeAccel { timeout_ms } => probe_accel(Duration::from_millis(timeout_ms)),
    }
}

/// Reports a failure on stderr, on one line.
fn failed(e: &dyn std::error::Error) -> ExitCode {
    eprintln!("capk-launcher: {}", one_line(e));
    ExitCode::FAILURE
}

/// `probe`: asks the running launcher for a probe's verdict and prints it on stdout (the
/// kubelet's exec probe shows it); fails when the probe does.
fn probe(rt: &tokio::runtime::Runtime, p: &ProbeArgs) -> ExitCode {
    let kind = ProbeKind::from(p.kind);
    let req = Request::Probe { kind };
    match rt.block_on(control::call(&p.socket.runtime_dir, &req)) {
        Ok(v) => {
            let ok = v["ok"].as_bool().unwrap_or(false);
            let reason = v["reason"].as_str().unwrap_or("no reason given");
            println!("{}: {reason}", kind.as_str());
            if ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            println!("capk-launcher: {}", one_line(&e));
            ExitCode::FAILURE
        }
    }
}

/// `status`: prints the running launcher's status report as JSON.
fn status(rt: &tokio::runtime::Runtime, socket: &SocketArgs) -> ExitCode {
    match rt.block_on(control::call(&socket.runtime_dir, &Request::Status)) {
        Ok(v) => {
            println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
            ExitCode::SUCCESS
        }
        Err(e) => failed(&e),
    }
}

/// `console`: prints the guest's console copy, following it unless told not to.
fn console(socket: &SocketArgs, follow: bool) -> ExitCode {
    match follow_console(&socket.runtime_dir.join(run::CONSOLE_LOG), follow) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!(
                "capk-launcher: console {}: {e}",
                socket.runtime_dir.display()
            );
            ExitCode::FAILURE
        }
    }
}

/// `qmp`: sends one operator command through the running launcher and prints QEMU's answer;
/// fails when QEMU answered with an error.
fn qmp(rt: &tokio::runtime::Runtime, socket: &SocketArgs, command: QmpCommandArg) -> ExitCode {
    let req = Request::Qmp {
        command: command.into(),
    };
    match rt.block_on(control::call(&socket.runtime_dir, &req)) {
        Ok(v) => {
            println!("{v}");
            if v.get("error").is_some() {
                ExitCode::FAILURE
            } else {
                ExitCode::SUCCESS
            }
        }
        Err(e) => failed(&e),
    }
}

/// `probe-accel`: prints the accelerator this host gives QEMU (`kvm`, or `tcg` and why).
fn probe_accel(timeout: Duration) -> ExitCode {
    match accel::probe_kvm(timeout) {
        Ok(()) => {
            println!("kvm");
            ExitCode::SUCCESS
        }
        Err(e) => {
            println!("tcg ({e})");
            ExitCode::FAILURE
        }
    }
}
