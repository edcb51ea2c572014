//! The launcher's module graph: no cycles between its top-level modules, and the command line
//! (clap, `cli.rs`) stays at the binary's edge: no domain module names `crate::cli` or `clap`.
//! Read from the sources (test modules excluded), so a new cycle fails here, not in review.

use std::collections::{BTreeMap, BTreeSet};

/// Top-level module → the top-level modules its non-test code names (`crate::<module>`).
fn graph() -> BTreeMap<String, (BTreeSet<String>, String)> {
    let src = package_dir().join("src");
    let mut graph: BTreeMap<String, (BTreeSet<String>, String)> = BTreeMap::new();
    let mut files = Vec::new();
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            for sub in std::fs::read_dir(&path).unwrap() {
                files.push(sub.unwrap().path());
            }
        } else {
            files.push(path);
        }
    }
    for path in files {
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let rel = path.strip_prefix(&src).unwrap();
        let top = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy()
            .trim_end_matches(".rs")
            .to_string();
        if top == "lib" || top == "main" {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let code = match text.find("#[cfg(test)]\nmod tests") {
            Some(i) => &text[..i],
            None => &text,
        };
        let (deps, all_code) = graph.entry(top.clone()).or_default();
        for (i, _) in code.match_indices("crate::") {
            let name: String = code[i + 7..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() && name != top {
                deps.insert(name);
            }
        }
        all_code.push_str(code);
    }
    graph
}

fn reaches(graph: &BTreeMap<String, (BTreeSet<String>, String)>, from: &str, to: &str) -> bool {
    let mut seen = BTreeSet::new();
    let mut todo = vec![from.to_string()];
    while let Some(m) = todo.pop() {
        for d in graph.get(&m).map(|(d, _)| d.iter()).into_iter().flatten() {
            if d == to {
                return true;
            }
            if seen.insert(d.clone()) {
                todo.push(d.clone());
            }
        }
    }
    false
}

#[test]
fn top_level_modules_have_no_cycles() {
    let g = graph();
    assert!(
        g.contains_key("control") && g.contains_key("health"),
        "{g:?}"
    );
    let cycles: Vec<&String> = g.keys().filter(|m| reaches(&g, m, m)).collect();
    assert!(
        cycles.is_empty(),
        "modules on a dependency cycle: {cycles:?} ({:?})",
        g.iter().map(|(m, (d, _))| (m, d)).collect::<Vec<_>>()
    );
}

/// Only `cli` knows clap. `run`, the body of `capk-launcher run`, takes that command's parsed
/// arguments (the launch contract and this host's settings) and hands the domain modules their
/// own types; no other module sees the command line.
#[test]
fn clap_stays_at_the_binarys_edge() {
    let g = graph();
    let offenders: Vec<&String> = g
        .iter()
        .filter(|(m, _)| *m != "cli")
        .filter(|(m, (deps, code))| {
            (deps.contains("cli") && *m != "run") || code.contains("clap::")
        })
        .map(|(m, _)| m)
        .collect();
    assert!(
        offenders.is_empty(),
        "domain modules using the command line's types or clap: {offenders:?}"
    );
}

/// This package's directory: Cargo's `CARGO_MANIFEST_DIR` of this test run, falling back to the
/// one it was compiled with. Checkouts share Cargo's build cache (`$CAPK_CACHE/target`), so a
/// binary Cargo finds fresh may have been compiled in another checkout.
fn package_dir() -> std::path::PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| env!("CARGO_MANIFEST_DIR").into(), Into::into)
}
