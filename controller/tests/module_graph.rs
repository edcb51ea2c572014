//! The controller's module graph, read from its sources (test modules excluded), so a new cycle
//! or a clap type in a domain module fails here, not in review: no cycles between the top-level
//! modules, no module using an item of `lib.rs` (which only declares the modules and starts the
//! controllers), none between the KVMMachine pipeline's steps (`kvmmachine/*.rs`), and the
//! command line (clap) only in `main.rs`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

type Graph = BTreeMap<String, BTreeSet<String>>;

fn src() -> PathBuf {
    package_dir().join("src")
}

/// The code of `path` without its test module.
fn code(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap();
    match text.find("#[cfg(test)]\nmod tests") {
        Some(i) => text[..i].to_owned(),
        None => text,
    }
}

/// The first path segment of every path that starts with `prefix` (`prefix{a, b::c}` counts
/// `a` and `b`).
fn segments_after(code: &str, prefix: &str) -> BTreeSet<String> {
    let ident = |s: &str| -> String {
        s.trim_start()
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
    };
    let mut out = BTreeSet::new();
    for (i, _) in code.match_indices(prefix) {
        let rest = &code[i + prefix.len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let (mut depth, mut item) = (0, String::new());
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        out.insert(ident(&item));
                        item.clear();
                        continue;
                    }
                    _ => {}
                }
                item.push(c);
            }
            out.insert(ident(&item));
        } else {
            out.insert(ident(rest));
        }
    }
    out.retain(|s| !s.is_empty() && s != "self");
    out
}

/// Top-level module → the top-level modules its non-test code names (`crate::<module>`).
fn top_level() -> Graph {
    let mut graph = Graph::new();
    let mut files = Vec::new();
    for entry in std::fs::read_dir(src()).unwrap() {
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
        let rel = path.strip_prefix(src()).unwrap();
        let top = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy();
        let top = top.trim_end_matches(".rs").to_owned();
        if top == "lib" || top == "main" {
            continue;
        }
        let deps = graph.entry(top.clone()).or_default();
        for d in segments_after(&code(&path), "crate::") {
            if d != top {
                deps.insert(d);
            }
        }
    }
    graph
}

/// `kvmmachine`'s modules → the sibling modules they name (`super::x`, `crate::kvmmachine::x`);
/// `kvmmachine` is `mod.rs`, and a child naming `super::Type` depends on it.
fn pipeline() -> Graph {
    let dir = src().join("kvmmachine");
    let mut graph = Graph::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let name = path.file_stem().unwrap().to_string_lossy().into_owned();
        let code = code(&path);
        let mut deps = segments_after(&code, "crate::kvmmachine::");
        if name == "mod" {
            deps.extend(segments_after(&code, "self::"));
        } else {
            deps.extend(segments_after(&code, "super::"));
        }
        let deps = deps
            .into_iter()
            .map(|d| {
                if d.starts_with(|c: char| c.is_uppercase()) {
                    "mod".to_owned()
                } else {
                    d
                }
            })
            .filter(|d| *d != name && dir.join(format!("{d}.rs")).exists())
            .collect();
        graph.insert(name, deps);
    }
    graph
}

fn reaches(graph: &Graph, from: &str, to: &str) -> bool {
    let mut seen = BTreeSet::new();
    let mut todo = vec![from.to_owned()];
    while let Some(m) = todo.pop() {
        for d in graph.get(&m).into_iter().flatten() {
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

/// The sets of modules that depend on each other (strongly connected, more than one module).
fn cycles(graph: &Graph) -> BTreeSet<BTreeSet<String>> {
    graph
        .keys()
        .filter(|m| reaches(graph, m, m))
        .map(|m| {
            graph
                .keys()
                .filter(|o| *o == m || (reaches(graph, m, o) && reaches(graph, o, m)))
                .cloned()
                .collect()
        })
        .collect()
}

#[test]
fn top_level_modules_have_no_cycles() {
    let g = top_level();
    assert!(
        g.contains_key("workload") && g.contains_key("context"),
        "{g:?}"
    );
    for (a, b) in [
        ("context", "workload"),
        ("workload", "kvmmachine"),
        ("context", "kvmmachine"),
        ("context", "kvmcluster"),
    ] {
        assert!(
            !(reaches(&g, a, b) && reaches(&g, b, a)),
            "{a} and {b} depend on each other: {g:?}"
        );
    }
    let found = cycles(&g);
    assert!(
        found.is_empty(),
        "modules on a dependency cycle: {found:?} ({g:?})"
    );
}

#[test]
fn no_module_reaches_back_into_lib_rs() {
    // lib.rs declares the modules and starts the controllers; everything a module uses of
    // another is named by that module's path (`crate::caches::cached`, not `crate::cached`).
    let modules: BTreeSet<String> = std::fs::read_dir(src())
        .unwrap()
        .map(|e| e.unwrap().path())
        .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
        .filter(|m| m != "lib" && m != "main")
        .collect();
    let mut offenders = Vec::new();
    let mut todo = vec![src()];
    while let Some(dir) = todo.pop() {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let file = path.file_name().unwrap().to_string_lossy().into_owned();
            let edge = path.parent() == Some(src().as_path())
                && ["lib.rs", "main.rs"].contains(&file.as_str());
            if path.is_dir() {
                todo.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") && !edge {
                for name in segments_after(&code(&path), "crate::") {
                    if !modules.contains(&name) {
                        offenders.push(format!("{}: crate::{name}", path.display()));
                    }
                }
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "items of lib.rs used by modules: {offenders:?}"
    );
}

#[test]
fn the_kvmmachine_pipeline_steps_have_no_cycles() {
    let g = pipeline();
    assert!(
        g.contains_key("validate") && g.contains_key("pod") && g.contains_key("status"),
        "{g:?}"
    );
    let found = cycles(&g);
    assert!(
        found.is_empty(),
        "pipeline modules on a cycle: {found:?} ({g:?})"
    );
    // Pure steps: none of them reaches back to the reconciler.
    for (m, deps) in &g {
        assert!(
            m == "mod" || !deps.contains("mod"),
            "{m} depends on the reconciler (mod.rs): {deps:?}"
        );
    }
}

#[test]
fn clap_stays_at_the_binarys_edge() {
    let mut offenders = Vec::new();
    let mut todo = vec![src()];
    while let Some(dir) = todo.pop() {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                todo.push(path);
            } else if path.extension().is_some_and(|e| e == "rs")
                && path.file_name().is_some_and(|n| n != "main.rs")
                && code(&path).contains("clap::")
            {
                offenders.push(path);
            }
        }
    }
    assert!(offenders.is_empty(), "clap outside main.rs: {offenders:?}");
}

/// This package's directory: Cargo's `CARGO_MANIFEST_DIR` of this test run, falling back to the
/// one it was compiled with. Checkouts share Cargo's build cache (`$CAPK_CACHE/target`), so a
/// binary Cargo finds fresh may have been compiled in another checkout.
fn package_dir() -> std::path::PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| env!("CARGO_MANIFEST_DIR").into(), Into::into)
}
