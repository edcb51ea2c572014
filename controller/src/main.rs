//! `capk-controller`: reconciles KVMCluster and KVMMachine objects into machine Pods.
#![forbid(unsafe_code)]

use clap::Parser;

/// Cluster API infrastructure provider for KVM.
#[derive(Parser, Debug)]
#[command(name = "capk-controller", version, about)]
struct Cli {}

fn main() -> anyhow::Result<()> {
    let _cli = Cli::parse();
    anyhow::bail!("capk-controller: the reconcilers are not implemented yet")
}
