//! No import circles: no module of `compiler/src` names a module that names it back,
//! directly or through a chain. (The runtime's run layer is held to the same rule by
//! `runtime/tests/layers.rs`, a folder's files counted as its module: there a folder's
//! `mod.rs` shares its items with its own files.) The checker reads the source files (no compiler involved) and builds the graph of
//! module -> the modules its code names.
//!
//! - **Nodes** are file modules: `a/b.rs` and `a/b/mod.rs` are module `a::b`, `lib.rs`
//!   (or the folder's `mod.rs`) is the folder's own module. A module written inline
//!   in a file (`mod imp { .. }`) is part of its file, except a `#[cfg(test)]` one: a
//!   unit test is code nothing names, so it cannot close a circle, and it may drive
//!   its module through the crate's front door (`crate::compile`); its contents are
//!   left out. `main.rs` and `bin/` are crate roots of their own (the binary names
//!   the library as `distc::`), so they are no node.
//! - **Edges** come from paths in code, comments and string literals aside: every
//!   leaf of a `use` tree and every `a::b` path in an expression or a type whose
//!   first segment is `crate` (or `$crate`), `super` (counted from the inline module
//!   it is written in: `super::x` in `mod imp { .. }` is the file itself), `self`, a
//!   child module of the file, or (outside `use`) a name the file's `use`s bound to
//!   one of those. A path names the longest module prefix it has; when the item
//!   after that prefix is one the module only imports (`pub use driver::Compiled` in
//!   `lib.rs`), the edge goes to the module the import resolves to, so
//!   `crate::Compiled` names the driver, not the crate root.
//! - **Parent and child** are modules like any other. A `mod child;` declaration is
//!   no edge (it names the file, not its items), but a parent naming its child's
//!   items is one, and so is a child naming its parent's (`super::helper`): a
//!   folder's `mod.rs` that holds what its children share must not also call into
//!   them. (Lifting children into their parent would hide a circle that runs through
//!   the parent's own code.)
//! - Only modules under the folder checked are nodes; a path leaving it (another
//!   crate, or `crate::core` from `runtime/src/run`) is no edge. `#[path]`
//!   attributes and macros that build paths are not understood.
//!
//! A circle is reported as the strongly connected group it belongs to, with the
//! shortest circle through each of its modules and, for each step, the file and line
//! that names the next module.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::Path;

/// A module's path from the crate root (empty: the root).
type Module = Vec<String>;

fn display(m: &[String]) -> String {
    if m.is_empty() {
        "crate".into()
    } else {
        m.join("::")
    }
}

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Ident(String),
    /// `::`
    Colons,
    Punct(char),
}

/// The tokens of `text` that matter for paths, each with its line; comments, string
/// and char literals, lifetimes and numbers are dropped.
fn lex(text: &str) -> Vec<(Tok, usize)> {
    let c: Vec<char> = text.chars().collect();
    let at = |j: usize| c.get(j).copied().unwrap_or('\0');
    let ident_char = |ch: char| ch.is_alphanumeric() || ch == '_';
    let (mut i, mut line, mut out) = (0, 1, Vec::new());
    // Skips to just past the `"` that closes a literal (after `hashes` `#`s for a raw
    // one), counting lines; `i` is just past the opening `"`.
    let close = |i: &mut usize, line: &mut usize, raw: bool, hashes: usize| {
        while *i < c.len() {
            let ch = c[*i];
            if ch == '\n' {
                *line += 1;
            }
            if !raw && ch == '\\' {
                *i += 1;
                if at(*i) == '\n' {
                    *line += 1;
                }
            } else if ch == '"' && (1..=hashes).all(|k| at(*i + k) == '#') {
                *i += 1 + hashes;
                return;
            }
            *i += 1;
        }
    };
    while i < c.len() {
        let ch = c[i];
        if ch == '\n' {
            line += 1;
            i += 1;
        } else if ch.is_whitespace() {
            i += 1;
        } else if ch == '/' && at(i + 1) == '/' {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && at(i + 1) == '*' {
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    if c[i] == '\n' {
                        line += 1;
                    }
                    i += 1;
                }
            }
        } else if ch == '"' {
            i += 1;
            close(&mut i, &mut line, false, 0);
        } else if ch == 'b' && at(i + 1) == '"' {
            i += 2;
            close(&mut i, &mut line, false, 0);
        } else if (ch == 'r' || (ch == 'b' && at(i + 1) == 'r'))
            && !ident_char(if i == 0 { ' ' } else { c[i - 1] })
            && {
                let start = i + if ch == 'r' { 1 } else { 2 };
                let hashes = (start..).take_while(|&j| at(j) == '#').count();
                at(start + hashes) == '"'
            }
        {
            let start = i + if ch == 'r' { 1 } else { 2 };
            let hashes = (start..).take_while(|&j| at(j) == '#').count();
            i = start + hashes + 1;
            close(&mut i, &mut line, true, hashes);
        } else if ch == '\'' || (ch == 'b' && at(i + 1) == '\'') {
            // A char literal ('x', '\n', '\u{..}', b'x') or a lifetime or label ('a).
            let q = if ch == 'b' { i + 1 } else { i };
            if at(q + 1) == '\\' {
                i = q + 3;
                while i < c.len() && c[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if at(q + 2) == '\'' {
                i = q + 3;
            } else {
                i = q + 1;
                while i < c.len() && ident_char(c[i]) {
                    i += 1;
                }
            }
        } else if ch.is_ascii_digit() {
            while i < c.len() && (ident_char(c[i]) || (c[i] == '.' && at(i + 1).is_ascii_digit())) {
                i += 1;
            }
        } else if ident_char(ch) {
            let start = i;
            while i < c.len() && ident_char(c[i]) {
                i += 1;
            }
            out.push((Tok::Ident(c[start..i].iter().collect()), line));
        } else if ch == ':' && at(i + 1) == ':' {
            out.push((Tok::Colons, line));
            i += 2;
        } else {
            out.push((Tok::Punct(ch), line));
            i += 1;
        }
    }
    out
}

/// A path written in a file, as its segments.
#[derive(Debug)]
struct Written {
    segments: Vec<String>,
    line: usize,
    /// Inline (non-test) modules it is written inside, for `super`.
    depth: usize,
    /// Part of a `use` tree: a `use` that starts at a name another `use` bound (legal
    /// since the 2018 edition, unused here) is not followed.
    in_use: bool,
}

/// One file's paths, and the names its top-level `use`s bind (to the path bound).
#[derive(Debug, Default)]
struct Parsed {
    paths: Vec<Written>,
    uses: BTreeMap<String, Vec<String>>,
}

fn ident(t: Option<&(Tok, usize)>) -> Option<&str> {
    match t {
        Some((Tok::Ident(s), _)) => Some(s),
        _ => None,
    }
}

fn is(t: Option<&(Tok, usize)>, p: char) -> bool {
    matches!(t, Some((Tok::Punct(q), _)) if *q == p)
}

/// The leaves of the `use` tree at `toks[*i]`, each with `prefix` before it and the
/// name it binds (none for a glob or `as _`).
fn use_tree(
    toks: &[(Tok, usize)],
    i: &mut usize,
    prefix: Vec<String>,
    leaves: &mut Vec<(Vec<String>, Option<String>, usize)>,
) {
    let mut path = prefix;
    if matches!(toks.get(*i), Some((Tok::Colons, _))) {
        // `use ::name`: another crate.
        path.push("::".into());
        *i += 1;
    }
    loop {
        if let Some(s) = ident(toks.get(*i)) {
            path.push(s.to_string());
            *i += 1;
            if matches!(toks.get(*i), Some((Tok::Colons, _))) {
                *i += 1;
                continue;
            }
            break;
        } else if is(toks.get(*i), '{') {
            *i += 1;
            while *i < toks.len() && !is(toks.get(*i), '}') {
                use_tree(toks, i, path.clone(), leaves);
                if is(toks.get(*i), ',') {
                    *i += 1;
                }
            }
            *i += 1;
            return;
        } else if is(toks.get(*i), '*') {
            leaves.push((path, None, toks[*i].1));
            *i += 1;
            return;
        } else {
            return;
        }
    }
    let line = toks[*i - 1].1;
    if path.last().is_some_and(|s| s == "self") {
        path.pop();
    }
    let mut bound = path.last().cloned();
    if ident(toks.get(*i)) == Some("as") {
        bound = ident(toks.get(*i + 1))
            .filter(|s| *s != "_")
            .map(str::to_string);
        *i += 2;
    }
    leaves.push((path, bound, line));
}

/// Whether the attribute tokens `toks[from..to]` hold a `cfg` naming `test`
/// (`#[cfg(test)]`, `#[cfg(all(test, ..))]`).
fn cfg_test(toks: &[(Tok, usize)], from: usize, to: usize) -> bool {
    ident(toks.get(from)) == Some("cfg")
        && toks[from..to]
            .iter()
            .any(|t| matches!(&t.0, Tok::Ident(s) if s == "test"))
        && !toks[from..to]
            .iter()
            .any(|t| matches!(&t.0, Tok::Ident(s) if s == "not"))
}

fn parse(text: &str) -> Parsed {
    let toks = lex(text);
    let mut parsed = Parsed::default();
    // Brace depth at which each open inline module started.
    let (mut braces, mut inline): (usize, Vec<usize>) = (0, Vec::new());
    let mut test_attr = false;
    let mut i = 0;
    while i < toks.len() {
        let (tok, line) = (&toks[i].0, toks[i].1);
        match tok {
            Tok::Punct('#') if is(toks.get(i + 1), '[') => {
                let mut j = i + 2;
                let mut depth = 1;
                while j < toks.len() && depth > 0 {
                    match toks[j].0 {
                        Tok::Punct('[') => depth += 1,
                        Tok::Punct(']') => depth -= 1,
                        _ => {}
                    }
                    j += 1;
                }
                test_attr |= cfg_test(&toks, i + 2, j);
                i = j;
                continue;
            }
            Tok::Punct('{') => {
                braces += 1;
                test_attr = false;
            }
            Tok::Punct('}') => {
                braces = braces.saturating_sub(1);
                inline.retain(|&d| d <= braces);
                test_attr = false;
            }
            Tok::Punct(';') => test_attr = false,
            Tok::Ident(s) if s == "mod" && is(toks.get(i + 2), '{') => {
                if test_attr {
                    // Skip the test module to its closing brace.
                    let mut j = i + 3;
                    let mut depth = 1;
                    while j < toks.len() && depth > 0 {
                        match toks[j].0 {
                            Tok::Punct('{') => depth += 1,
                            Tok::Punct('}') => depth -= 1,
                            _ => {}
                        }
                        j += 1;
                    }
                    i = j;
                    test_attr = false;
                    continue;
                }
                braces += 1;
                inline.push(braces);
                i += 3;
                continue;
            }
            Tok::Ident(s) if s == "use" => {
                let mut j = i + 1;
                let mut leaves = Vec::new();
                use_tree(&toks, &mut j, Vec::new(), &mut leaves);
                for (segments, bound, line) in leaves {
                    if let (Some(name), true) = (&bound, inline.is_empty()) {
                        parsed.uses.insert(name.clone(), segments.clone());
                    }
                    parsed.paths.push(Written {
                        segments,
                        line,
                        depth: inline.len(),
                        in_use: true,
                    });
                }
                i = j;
                continue;
            }
            Tok::Ident(first)
                if matches!(toks.get(i + 1), Some((Tok::Colons, _)))
                    && ident(toks.get(i + 2)).is_some()
                    && !matches!(i.checked_sub(1).map(|p| &toks[p].0), Some(Tok::Colons)) =>
            {
                let mut segments = vec![first.clone()];
                let mut j = i + 1;
                while matches!(toks.get(j), Some((Tok::Colons, _))) {
                    let Some(s) = ident(toks.get(j + 1)) else {
                        break;
                    };
                    segments.push(s.to_string());
                    j += 2;
                }
                parsed.paths.push(Written {
                    segments,
                    line,
                    depth: inline.len(),
                    in_use: false,
                });
                i = j;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    parsed
}

/// A source file as a module of the graph.
struct Source {
    file: String,
    parsed: Parsed,
}

/// The absolute path (from the crate root) `w`, written in `module`, stands for, if
/// it starts at a module (not at another crate or a local item).
fn absolute(
    w: &Written,
    module: &Module,
    uses: &BTreeMap<String, Vec<String>>,
    modules: &BTreeMap<Module, Source>,
) -> Option<Vec<String>> {
    let s = &w.segments;
    let joined = |base: &[String], rest: &[String]| -> Vec<String> {
        base.iter().chain(rest).cloned().collect()
    };
    match s[0].as_str() {
        "crate" => Some(s[1..].to_vec()),
        "self" => Some(joined(module, &s[1..])),
        "super" => {
            let ups = s.iter().take_while(|x| *x == "super").count();
            let above = ups.saturating_sub(w.depth);
            let base = module.len().checked_sub(above)?;
            Some(joined(&module[..base], &s[ups..]))
        }
        first if w.depth == 0 => {
            let child = joined(module, &s[..1]);
            if modules.contains_key(&child) {
                Some(joined(module, s))
            } else if w.in_use {
                None
            } else {
                let bound = uses.get(first)?;
                let w = Written {
                    segments: bound.clone(),
                    line: w.line,
                    depth: 0,
                    in_use: true,
                };
                absolute(&w, module, uses, modules).map(|b| joined(&b, &s[1..]))
            }
        }
        _ => None,
    }
}

/// The module an absolute path names: its longest module prefix, or, when the item
/// after that prefix is one the module imports, the module the import names.
fn target(path: &[String], modules: &BTreeMap<Module, Source>, hops: usize) -> Option<Module> {
    let k = (0..=path.len())
        .rev()
        .find(|&k| modules.contains_key(&path[..k]))?;
    let module = path[..k].to_vec();
    if let (Some(item), true) = (path.get(k), hops < 16) {
        let source = &modules[&module];
        if let Some(bound) = source.parsed.uses.get(item) {
            let w = Written {
                segments: bound.clone(),
                line: 0,
                depth: 0,
                in_use: true,
            };
            if let Some(mut through) = absolute(&w, &module, &source.parsed.uses, modules) {
                through.extend_from_slice(&path[k + 1..]);
                if through != path {
                    if let Some(t) = target(&through, modules, hops + 1) {
                        return Some(t);
                    }
                }
            }
        }
    }
    Some(module)
}

/// Module -> module it names -> where it first names it (`file:line: path`).
type Graph = BTreeMap<Module, BTreeMap<Module, String>>;

/// The import graph of `files` (path relative to the folder, text), the folder being
/// module `prefix` of its crate.
fn graph(files: &[(String, String)], prefix: &[&str]) -> Graph {
    let mut modules: BTreeMap<Module, Source> = BTreeMap::new();
    for (file, text) in files {
        let mut parts: Vec<String> = file
            .trim_end_matches(".rs")
            .split('/')
            .map(str::to_string)
            .collect();
        if parts.first().is_some_and(|p| p == "bin") || parts == ["main"] {
            continue;
        }
        if parts.last().is_some_and(|p| p == "mod") || parts == ["lib"] {
            parts.pop();
        }
        let module: Module = prefix.iter().map(|s| s.to_string()).chain(parts).collect();
        let parsed = parse(text);
        modules.insert(
            module,
            Source {
                file: file.clone(),
                parsed,
            },
        );
    }
    let mut g = Graph::new();
    for (module, source) in &modules {
        let edges = g.entry(module.clone()).or_default();
        for w in &source.parsed.paths {
            let Some(path) = absolute(w, module, &source.parsed.uses, &modules) else {
                continue;
            };
            let Some(to) = target(&path, &modules, 0) else {
                continue;
            };
            if to != *module {
                edges.entry(to).or_insert_with(|| {
                    format!("{}:{}: {}", source.file, w.line, w.segments.join("::"))
                });
            }
        }
    }
    g
}

/// The groups of modules that reach each other (Tarjan's algorithm), each sorted,
/// those of more than one module only.
fn circles(g: &Graph) -> Vec<Vec<Module>> {
    struct State<'a> {
        g: &'a Graph,
        index: BTreeMap<&'a Module, (usize, usize)>,
        stack: Vec<&'a Module>,
        on_stack: BTreeSet<&'a Module>,
        groups: Vec<Vec<Module>>,
    }
    fn visit<'a>(v: &'a Module, s: &mut State<'a>) {
        let n = s.index.len();
        s.index.insert(v, (n, n));
        s.stack.push(v);
        s.on_stack.insert(v);
        let g = s.g;
        for w in g[v].keys() {
            if !g.contains_key(w) {
                continue;
            }
            if !s.index.contains_key(w) {
                visit(w, s);
                let low = s.index[w].1.min(s.index[v].1);
                s.index.entry(v).or_default().1 = low;
            } else if s.on_stack.contains(w) {
                let low = s.index[w].0.min(s.index[v].1);
                s.index.entry(v).or_default().1 = low;
            }
        }
        if s.index[v].0 == s.index[v].1 {
            let mut group = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                group.push(w.clone());
                if w == v {
                    break;
                }
            }
            if group.len() > 1 {
                group.sort();
                s.groups.push(group);
            }
        }
    }
    let mut s = State {
        g,
        index: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        groups: Vec::new(),
    };
    for v in g.keys() {
        if !s.index.contains_key(v) {
            visit(v, &mut s);
        }
    }
    s.groups.sort();
    s.groups
}

/// The shortest circle from `start` back to it inside `group`.
fn shortest_circle(g: &Graph, group: &[Module], start: &Module) -> Vec<Module> {
    let mut came_from: BTreeMap<&Module, &Module> = BTreeMap::new();
    let mut queue = VecDeque::from([start]);
    while let Some(v) = queue.pop_front() {
        for w in g[v].keys().filter(|w| group.contains(w)) {
            if w == start {
                let mut path = vec![v.clone()];
                let mut at = v;
                while at != start {
                    at = came_from[at];
                    path.push(at.clone());
                }
                path.reverse();
                return path;
            }
            if !came_from.contains_key(w) {
                came_from.insert(w, v);
                queue.push_back(w);
            }
        }
    }
    vec![start.clone()]
}

/// Each group of modules in a circle, with the shortest circle through each module
/// and where each step is named; empty when the graph has no circle.
fn report(g: &Graph) -> Vec<String> {
    let mut out = Vec::new();
    for group in circles(g) {
        let names: Vec<String> = group.iter().map(|m| display(m)).collect();
        let mut text = format!("modules in a circle: {}", names.join(", "));
        let mut seen = BTreeSet::new();
        for start in &group {
            let circle = shortest_circle(g, &group, start);
            // The same circle from its smallest module, so each is listed once.
            let min = (0..circle.len())
                .min_by_key(|&k| &circle[k])
                .unwrap_or_default();
            let mut canonical = circle[min..].to_vec();
            canonical.extend_from_slice(&circle[..min]);
            if !seen.insert(canonical.clone()) {
                continue;
            }
            let mut steps: Vec<String> = canonical.iter().map(|m| display(m)).collect();
            steps.push(display(&canonical[0]));
            text += &format!("\n  {}", steps.join(" -> "));
            for (k, from) in canonical.iter().enumerate() {
                let to = &canonical[(k + 1) % canonical.len()];
                text += &format!("\n    {}", g[from][to]);
            }
        }
        out.push(text);
    }
    out
}

/// The `.rs` files under `dir`, by path relative to it (`/`-separated), sorted.
fn sources(dir: &Path) -> Vec<(String, String)> {
    fn walk(dir: &Path, root: &Path, out: &mut Vec<(String, String)>) {
        for entry in std::fs::read_dir(dir).expect("a readable source folder") {
            let path = entry.expect("a folder entry").path();
            if path.is_dir() {
                walk(&path, root, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let rel = path.strip_prefix(root).expect("under the folder");
                let rel: Vec<String> = rel
                    .components()
                    .map(|c| c.as_os_str().to_string_lossy().into_owned())
                    .collect();
                let text = std::fs::read_to_string(&path).expect("a readable source file");
                out.push((rel.join("/"), text));
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out.sort();
    out
}

fn manifest_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn compiler_src_has_no_import_circle() {
    let files = sources(&manifest_dir().join("src"));
    let g = graph(&files, &[]);
    assert!(g.len() > 20, "only {} modules in compiler/src", g.len());
    let found = report(&g);
    assert!(
        found.is_empty(),
        "compiler/src has import circles:\n{}",
        found.join("\n")
    );
}

fn files(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter()
        .map(|(f, t)| (f.to_string(), t.to_string()))
        .collect()
}

fn edges(g: &Graph, from: &str) -> Vec<String> {
    let m: Module = if from == "crate" {
        Vec::new()
    } else {
        from.split("::").map(str::to_string).collect()
    };
    g[&m].keys().map(|m| display(m)).collect()
}

#[test]
fn the_checker_follows_re_exports_super_and_use_trees_and_skips_comments_and_tests() {
    let g = graph(
        &files(&[
            (
                "lib.rs",
                "pub mod a; pub mod b; pub mod c;\npub use a::Thing;\n",
            ),
            (
                "a.rs",
                "//! Not [`crate::b`].\nconst S: &str = \"crate::c::X\";\nconst R: &str = \
                 r#\"crate::c\"#;\nfn f<'a>(x: &'a str) -> char { 'x' }\n\
                 #[cfg(test)]\nmod tests { use crate::c::Y; }\npub struct Thing;\n",
            ),
            ("b/mod.rs", "mod d;\npub fn g() { d::h() }\n"),
            (
                "b/d.rs",
                "use super::super::{Thing, c::{self as cc}};\npub fn h() { cc::z() }\n\
                 mod inner { fn k() { super::super::g() } }\n",
            ),
            ("c.rs", "pub fn z() { let _ = crate::Thing; }\n"),
        ]),
        &[],
    );
    assert_eq!(edges(&g, "crate"), ["a"]);
    assert!(edges(&g, "a").is_empty(), "{:?}", g);
    assert_eq!(edges(&g, "b"), ["b::d"]);
    // `crate::Thing` (through `lib.rs`'s `pub use`) is `a`'s; `super::super` in the
    // inline module `inner` is `b`.
    assert_eq!(edges(&g, "b::d"), ["a", "b", "c"]);
    assert_eq!(edges(&g, "c"), ["a"]);
    let found = report(&g);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(
        found[0].starts_with("modules in a circle: b, b::d\n  b -> b::d -> b"),
        "{}",
        found[0]
    );
    assert!(
        found[0].contains("b/d.rs:3: super::super::g"),
        "{}",
        found[0]
    );
}

#[test]
fn the_checker_finds_a_circle_through_a_chain() {
    let g = graph(
        &files(&[
            ("mod.rs", "pub mod x; pub mod y; pub mod z;"),
            ("x.rs", "use crate::run::y::Y;"),
            ("y.rs", "fn f() -> crate::run::z::Z { todo!() }"),
            ("z.rs", "use super::x;\nfn g() { x::go() }"),
        ]),
        &["run"],
    );
    let found = report(&g);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(
        found[0].contains("run::x -> run::y -> run::z -> run::x"),
        "{}",
        found[0]
    );
}
