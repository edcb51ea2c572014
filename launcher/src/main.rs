//! `capk-launcher`: PID 1 of a machine Pod; turns the Pod into a VM host.
#![forbid(unsafe_code)]

use std::process::ExitCode;
use std::time::Duration;

use capk_launcher::cli::{Cli, Command, LogFormat};
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
            match rt.block_on(run::run((*args).into())) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("capk-launcher: {}", one_line(&e));
                    ExitCode::FAILURE
                }
            }
        }
        Command::Probe(p) => {
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
        Command::Status(s) => match rt.block_on(control::call(&s.runtime_dir, &Request::Status)) {
            Ok(v) => {
                println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("capk-launcher: {}", one_line(&e));
                ExitCode::FAILURE
            }
        },
        Command::Console { socket, no_follow } => {
            match follow_console(&socket.runtime_dir.join(run::CONSOLE_LOG), !no_follow) {
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
        Command::Qmp { command, socket } => {
            match rt.block_on(control::call(
                &socket.runtime_dir,
                &Request::Qmp {
                    command: command.into(),
                },
            )) {
                Ok(v) => {
                    println!("{v}");
                    if v.get("error").is_some() {
                        ExitCode::FAILURE
                    } else {
                        ExitCode::SUCCESS
                    }
                }
                Err(e) => {
                    eprintln!("capk-launcher: {}", one_line(&e));
                    ExitCode::FAILURE
                }
            }
        }
        Command::ProbeAccel { timeout_ms } => {
            match accel::probe_kvm(Duration::from_millis(timeout_ms)) {
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
    }
}
