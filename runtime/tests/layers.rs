//! The runtime's layers depend one way (see the crate doc): every source file's code
//! (comments aside) names only `crate::` paths of its own layer or of layers below it.
//! The table here is the crate doc's; the arrows form no cycle, so neither can the
//! imports. Inside the run layer, its sub-layers (the `run` module's doc) are held to
//! the same rule.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Each layer and the layers it may name.
const ALLOWED: &[(&str, &[&str])] = &[
    ("core", &["core"]),
    ("cpu", &["core", "cpu"]),
    ("comm", &["core", "comm"]),
    ("cuda", &["core", "comm", "cuda"]),
    ("ps", &["core", "cpu", "ps"]),
    ("run", &["core", "cpu", "comm", "cuda", "ps", "run"]),
];

/// The run layer's sub-layers, bottom first, and the modules of each.
const RUN_LAYERS: &[(&str, &[&str])] = &[
    (
        "base",
        &[
            "mesh", "programs", "options", "hook", "state", "snapshot", "data", "eval", "memory",
            "metrics", "trace", "steps",
        ],
    ),
    ("roles", &["trainer", "checkpoint", "worker", "pipeline"]),
    ("coordinator", &["coordinator"]),
    ("launcher", &["launcher"]),
    ("transport", &["threads", "mpi"]),
    ("launch", &["launch", "train"]),
];

/// The sub-layer of a run module, as its index in [`RUN_LAYERS`].
fn run_layer(module: &str) -> Option<usize> {
    RUN_LAYERS
        .iter()
        .position(|(_, modules)| modules.contains(&module))
}

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("readable source folder") {
        let path = entry.expect("an entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The layers a file's code names, with the first line naming each.
fn named_layers(text: &str) -> BTreeMap<String, (usize, String)> {
    named_after(text, "crate::")
}

/// The names that follow `prefix` in a file's code (comments aside), with the first
/// line naming each.
fn named_after(text: &str, prefix: &str) -> BTreeMap<String, (usize, String)> {
    let mut named = BTreeMap::new();
    for (i, line) in text.lines().enumerate() {
        let code = line.trim_start();
        if code.starts_with("//") {
            continue;
        }
        let mut rest = code;
        while let Some(at) = rest.find(prefix) {
            let after = &rest[at + prefix.len()..];
            let name: String = after
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            // `distc_runtime::crate::` cannot occur; a path like `$crate::` is a macro's.
            let preceded_by_dollar = rest[..at].ends_with('$');
            if !name.is_empty() && !preceded_by_dollar {
                named
                    .entry(name)
                    .or_insert_with(|| (i + 1, line.trim().to_string()));
            }
            rest = after;
        }
    }
    named
}

#[test]
fn every_file_names_only_its_own_layer_or_layers_below() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    files.sort();
    let layers: Vec<&str> = ALLOWED.iter().map(|(l, _)| *l).collect();
    let mut wrong = Vec::new();
    let mut checked = 0;
    for file in &files {
        let rel = file.strip_prefix(&src).expect("under src");
        let Some(layer) = rel.components().next().and_then(|c| c.as_os_str().to_str()) else {
            continue;
        };
        if layer == "lib.rs" {
            continue;
        }
        let allowed = ALLOWED
            .iter()
            .find(|(l, _)| *l == layer)
            .map(|(_, a)| *a)
            .unwrap_or_else(|| {
                panic!(
                    "{}: a folder that is no layer: add it to the table",
                    rel.display()
                )
            });
        let text = std::fs::read_to_string(file).expect("readable source");
        checked += 1;
        for (named, (line, code)) in named_layers(&text) {
            if layers.contains(&named.as_str()) && !allowed.contains(&named.as_str()) {
                wrong.push(format!(
                    "{}:{line}: layer `{layer}` names `crate::{named}`: {code}",
                    rel.display()
                ));
            }
        }
    }
    assert!(
        checked > 30,
        "only {checked} files found under {}",
        src.display()
    );
    assert!(
        wrong.is_empty(),
        "imports against the layers:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn the_checker_sees_an_upward_import() {
    let named = named_layers(
        "use crate::core::value::Tensor;\n// crate::run in a comment\nfn f() { crate::run::x() }\n",
    );
    assert_eq!(named.keys().collect::<Vec<_>>(), ["core", "run"]);
    assert_eq!(named["run"].0, 3);
}

#[test]
fn every_run_module_names_only_its_own_sub_layer_or_those_below() {
    let run = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/run");
    let mut files = Vec::new();
    sources(&run, &mut files);
    files.sort();
    let mut wrong = Vec::new();
    let mut checked = 0;
    for file in &files {
        let rel = file.strip_prefix(&run).expect("under src/run");
        let Some(first) = rel.components().next().and_then(|c| c.as_os_str().to_str()) else {
            continue;
        };
        let module = first.trim_end_matches(".rs");
        if module == "mod" {
            continue;
        }
        let Some(mine) = run_layer(module) else {
            panic!(
                "run/{}: a module in no sub-layer: add it to RUN_LAYERS",
                rel.display()
            );
        };
        let text = std::fs::read_to_string(file).expect("readable source");
        checked += 1;
        for (named, (line, code)) in named_after(&text, "crate::run::") {
            match run_layer(&named) {
                Some(theirs) if theirs > mine => wrong.push(format!(
                    "run/{}:{line}: `{module}` ({}) names `crate::run::{named}` ({}): {code}",
                    rel.display(),
                    RUN_LAYERS[mine].0,
                    RUN_LAYERS[theirs].0
                )),
                Some(_) => {}
                None => wrong.push(format!(
                    "run/{}:{line}: names `crate::run::{named}`, in no sub-layer: {code}",
                    rel.display()
                )),
            }
        }
    }
    assert!(
        checked > 10,
        "only {checked} files found under {}",
        run.display()
    );
    assert!(
        wrong.is_empty(),
        "imports against the run layer's sub-layers:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn the_run_checker_sees_a_role_naming_its_launcher() {
    let named = named_after(
        "use crate::run::mesh::Mesh;\nfn f() { crate::run::launch::x() }\n",
        "crate::run::",
    );
    assert_eq!(named.keys().collect::<Vec<_>>(), ["launch", "mesh"]);
    assert!(run_layer("launch") > run_layer("worker"));
}

/// The run modules each run module names (`crate::run::x`), a folder's files as its
/// module's.
fn run_imports() -> BTreeMap<String, BTreeMap<String, String>> {
    let run = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/run");
    let mut files = Vec::new();
    sources(&run, &mut files);
    let mut out: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    for file in &files {
        let rel = file.strip_prefix(&run).expect("under src/run");
        let Some(first) = rel.components().next().and_then(|c| c.as_os_str().to_str()) else {
            continue;
        };
        let module = first.trim_end_matches(".rs").to_string();
        if module == "mod" {
            continue;
        }
        let text = std::fs::read_to_string(file).expect("readable source");
        let names = out.entry(module.clone()).or_default();
        for (named, (line, code)) in named_after(&text, "crate::run::") {
            if named != module {
                names
                    .entry(named)
                    .or_insert_with(|| format!("run/{}:{line}: {code}", rel.display()));
            }
        }
    }
    out
}

/// A cycle of `graph`, as the modules on it and the line that names each next one.
fn a_cycle(graph: &BTreeMap<String, BTreeMap<String, String>>) -> Option<Vec<String>> {
    fn visit(
        m: &str,
        graph: &BTreeMap<String, BTreeMap<String, String>>,
        done: &mut std::collections::BTreeSet<String>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|p| p == m) {
            let ring = &path[at..];
            return Some(
                ring.iter()
                    .zip(ring.iter().cycle().skip(1))
                    .map(|(a, b)| format!("{a} -> {b} ({})", graph[a][b]))
                    .collect(),
            );
        }
        if !done.insert(m.to_string()) {
            return None;
        }
        path.push(m.to_string());
        for next in graph.get(m).into_iter().flat_map(|n| n.keys()) {
            if let Some(c) = visit(next, graph, done, path) {
                return Some(c);
            }
        }
        path.pop();
        None
    }
    let mut done = std::collections::BTreeSet::new();
    graph
        .keys()
        .find_map(|m| visit(m, graph, &mut done, &mut Vec::new()))
}

/// Issue 59: no run module names one that names it back, directly or through others
/// (the plan's programs were a hub that data, memory and the mesh named back).
#[test]
fn no_run_module_names_one_that_names_it_back() {
    let graph = run_imports();
    assert!(graph.len() > 10, "only {} run modules found", graph.len());
    if let Some(cycle) = a_cycle(&graph) {
        panic!(
            "a circle of imports in the run layer:\n{}",
            cycle.join("\n")
        );
    }
}

#[test]
fn the_circle_checker_sees_a_circle_through_three_modules() {
    let edge = |a: &str, b: &str| (a.to_string(), [(b.to_string(), format!("{a}.rs"))].into());
    let graph: BTreeMap<String, BTreeMap<String, String>> = [
        edge("a", "b"),
        edge("b", "c"),
        edge("c", "a"),
        edge("d", "a"),
    ]
    .into();
    let cycle = a_cycle(&graph).expect("a cycle");
    assert_eq!(cycle.len(), 3, "{cycle:?}");
    assert!(cycle[0].starts_with("a -> b"), "{cycle:?}");
    let open: BTreeMap<String, BTreeMap<String, String>> = [edge("a", "b"), edge("b", "c")].into();
    assert!(a_cycle(&open).is_none());
}
