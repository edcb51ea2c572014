//! The controller's module graph, read from its sources (test modules excluded), so a new cycle
//! or a clap type in a domain module fails here, not in review: no cycles between the top-level
//! modules and the modules of the groups of shared machinery (`runtime`, `k8s`, `remote`), no module using an item of `lib.rs` (which only declares the modules and starts the
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

/// Every path that starts with `prefix`, its use-trees expanded (`prefix{a::{b, c}, d}` gives
/// `a::b`, `a::c` and `d`), as its segments.
fn paths_after(code: &str, prefix: &str) -> Vec<Vec<String>> {
    fn tree(s: &[char], i: &mut usize) -> Vec<Vec<String>> {
        let skip = |i: &mut usize| {
            while *i < s.len() && s[*i].is_whitespace() {
                *i += 1;
            }
        };
        skip(i);
        if *i < s.len() && s[*i] == '{' {
            *i += 1;
            let mut out = Vec::new();
            loop {
                skip(i);
                match s.get(*i) {
                    None => return out,
                    Some('}') => {
                        *i += 1;
                        return out;
                    }
                    Some(',') => *i += 1,
                    Some(_) => {
                        let before = *i;
                        out.extend(tree(s, i));
                        // Skip what a path does not describe (`as x`) up to its separator.
                        while *i < s.len() && !matches!(s[*i], ',' | '}') {
                            *i += 1;
                        }
                        if *i == before {
                            *i += 1;
                        }
                    }
                }
            }
        }
        let start = *i;
        while *i < s.len() && (s[*i].is_alphanumeric() || s[*i] == '_') {
            *i += 1;
        }
        let ident: String = s[start..*i].iter().collect();
        if ident.is_empty() {
            return Vec::new();
        }
        if s.get(*i) == Some(&':') && s.get(*i + 1) == Some(&':') {
            *i += 2;
            let subs = tree(s, i);
            if subs.is_empty() {
                return vec![vec![ident]];
            }
            return subs
                .into_iter()
                .map(|mut p| {
                    p.insert(0, ident.clone());
                    p
                })
                .collect();
        }
        vec![vec![ident]]
    }
    let chars: Vec<char> = code.chars().collect();
    let prefix: Vec<char> = prefix.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i + prefix.len() <= chars.len() {
        if chars[i..i + prefix.len()] == prefix[..] {
            let mut j = i + prefix.len();
            out.extend(tree(&chars, &mut j));
            i = j.max(i + 1);
        } else {
            i += 1;
        }
    }
    out
}

/// The folders that group shared machinery (`runtime`, `k8s`, `remote`): each of their modules
/// is a node of the graph of its own (`k8s::caches`), so that the groups may use each other
/// while their modules do not go round in circles.
const GROUPS: [&str; 3] = ["runtime", "k8s", "remote"];

/// The graph's node for a path below `crate::`: `group::module` for a module of a group, else
/// the top-level module (the group itself for an item of its `mod.rs`).
fn node_of(path: &[String]) -> Option<String> {
    let top = path.first()?.clone();
    if GROUPS.contains(&top.as_str())
        && let Some(sub) = path.get(1)
        && src().join(&top).join(format!("{sub}.rs")).exists()
    {
        return Some(format!("{top}::{sub}"));
    }
    (top != "self").then_some(top)
}

/// Module → the modules its non-test code names (`crate::<module>`, and `super::<module>` inside
/// a group): top-level modules, and each module of a group on its own (see [`GROUPS`]).
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
        let parts: Vec<String> = rel
            .components()
            .map(|c| {
                c.as_os_str()
                    .to_string_lossy()
                    .trim_end_matches(".rs")
                    .to_owned()
            })
            .collect();
        let top = parts[0].clone();
        if top == "lib" || top == "main" {
            continue;
        }
        let group = GROUPS.contains(&top.as_str()).then(|| top.clone());
        let name = match (&group, parts.get(1)) {
            (Some(g), Some(m)) if m != "mod" => format!("{g}::{m}"),
            _ => top.clone(),
        };
        let code = code(&path);
        let mut paths = paths_after(&code, "crate::");
        if let Some(g) = &group {
            let inner = if name == *g { "self::" } else { "super::" };
            paths.extend(paths_after(&code, inner).into_iter().map(|mut p| {
                p.insert(0, g.clone());
                p
            }));
        }
        let deps = graph.entry(name.clone()).or_default();
        for d in paths.iter().filter_map(|p| node_of(p)) {
            if d != name {
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
        g.contains_key("remote::workload") && g.contains_key("runtime::context"),
        "{g:?}"
    );
    for (a, b) in [
        ("runtime::context", "remote::workload"),
        ("remote::workload", "kvmmachine"),
        ("runtime::context", "kvmmachine"),
        ("runtime::context", "kvmcluster"),
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
    // another is named by that module's path (`crate::k8s::caches::cached`, not `crate::cached`).
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
