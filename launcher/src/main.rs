//! `capk-launcher`: PID 1 of a machine Pod; turns the Pod into a VM host.

use clap::Parser;

/// Boots the machine's VM inside its Pod.
#[derive(Parser, Debug)]
#[command(name = "capk-launcher", version, about)]
struct Cli {}

fn main() -> anyhow::Result<()> {
    let _cli = Cli::parse();
    anyhow::bail!("capk-launcher: not implemented yet")
}
