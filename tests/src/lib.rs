//! Test support for cluster-api-provider-kvm: locating the pinned upstream binaries that
//! `make test-deps` builds, and [`env::TestEnv`], a real etcd + kube-apiserver per test binary.
#![forbid(unsafe_code)]

pub mod env;

use std::path::PathBuf;

use anyhow::{Result, bail};

/// The repository root: the parent of the running test's package directory, which Cargo gives
/// every test it runs (`CARGO_MANIFEST_DIR`; every package is one level below the root). The
/// directory the binary was compiled in is only the fallback: Cargo's build cache is shared
/// between checkouts (`.ci/run`'s clone and a developer's tree use `$CAPK_CACHE/target`), and a
/// test binary Cargo finds fresh may have been compiled in the other checkout.
pub fn repo_root() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
        .parent()
        .expect("a package directory has a parent")
        .to_path_buf()
}

/// Build output of the scripts in `hack/` (`$CAPK_OUTPUT`, default `<repo>/_output`).
pub fn output_dir() -> PathBuf {
    std::env::var_os("CAPK_OUTPUT")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("_output"))
}

/// A value pinned in `hack/versions.env` (e.g. `KUBERNETES_VERSION`).
pub fn pinned_version(key: &str) -> String {
    let path = repo_root().join("hack/versions.env");
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    text.lines()
        .filter_map(|l| l.split_once('='))
        .find(|(k, _)| k.trim() == key)
        .map(|(_, v)| v.trim().to_owned())
        .unwrap_or_else(|| panic!("{key} is not pinned in {}", path.display()))
}

/// Path of an upstream binary in `_output/bin`. A missing binary is an error (never a skip),
/// naming the command that builds it.
pub fn component(name: &str, provided_by: &str) -> Result<PathBuf> {
    let path = output_dir().join("bin").join(name);
    if path.is_file() {
        return Ok(path);
    }
    bail!(
        "{name} is missing at {}; run `{provided_by}` to build it from the Go module proxy",
        path.display()
    )
}
