//! Test helpers: a missing component fails under CI and skips with a reason elsewhere.

use std::path::PathBuf;

/// Finds `tool` on PATH. Under `CI` a missing tool panics with `how` (the command providing
/// it); elsewhere the test prints why it skips and gets `None`.
pub fn require_tool(tool: &str, how: &str) -> Option<PathBuf> {
    let found = std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|d| d.join(tool))
        .find(|p| p.is_file());
    if found.is_none() {
        if std::env::var_os("CI").is_some() {
            panic!("{tool} is required for this test: {how}");
        }
        eprintln!("skipping: {tool} not found ({how})");
    }
    found
}
