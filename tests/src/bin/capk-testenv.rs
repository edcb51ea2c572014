//! `capk-testenv up|down`: the integration tests' etcd + kube-apiserver (with our CRDs and the
//! Cluster API CRDs) for manual use. `up` prints the kubeconfig path as its last line.

use std::{fs, path::PathBuf};

use anyhow::{Context, Result, bail};
use capk_tests::env::{EnvOptions, TestEnv, pid_alive as alive, read_pids, stop_pids as stop};

fn state_dir() -> PathBuf {
    capk_tests::output_dir().join("testenv")
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<()> {
    let dir = state_dir();
    match std::env::args().nth(1).as_deref() {
        Some("up") => {
            if let Ok(pids) = read_pids(&dir)
                && !pids.is_empty()
                && pids.iter().all(|p| alive(*p))
            {
                eprintln!("testenv: already running (pids {pids:?}); `make testenv-down` stops it");
            } else {
                if let Ok(pids) = read_pids(&dir) {
                    stop(&pids);
                }
                let _ = fs::remove_dir_all(&dir);
                let env = TestEnv::start(EnvOptions {
                    dir: dir.clone(),
                    stop_with_current_process: false,
                })
                .await
                .context("start the test environment")?;
                eprintln!(
                    "testenv: kube-apiserver at {} (pids {:?}); logs in {}",
                    env.server(),
                    env.pids(),
                    env.dir().display()
                );
                eprintln!("testenv: stop it with `make testenv-down`");
            }
            println!("{}", dir.join("kubeconfig").display());
            Ok(())
        }
        Some("down") => {
            match read_pids(&dir) {
                Ok(pids) => {
                    stop(&pids);
                    eprintln!("testenv: stopped pids {pids:?}");
                }
                Err(_) => eprintln!("testenv: not running"),
            }
            let _ = fs::remove_dir_all(&dir);
            Ok(())
        }
        _ => bail!("usage: capk-testenv up|down"),
    }
}
