//! The crate's import structure, read from `src/` with plain Rust: no import circle among its
//! files, and imports that run down the floors of [`FLOORS`] (docs/contributing.md).
//!
//! An import is any path in the code, a `use` or a path in an expression, that starts with
//! `crate::` (or a macro's `$crate::`), `super::`, `self::` or a child module of the file;
//! comments and string literals do not count. A path counts as an import of the longest module
//! it names: a name that a parent `mod.rs` re-exports is an import of that `mod.rs`, and
//! `crate::name!` of an exported macro one of the file that defines the macro.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::Path;

/// Each module's floor, by the longest prefix that names it (`exchange` covers
/// `exchange::ring`, `data::command` has its own). A module imports its own floor and the
/// floors below; an import of a higher floor runs back up.
const FLOORS: &[(&str, u32)] = &[
    // The crate root: parses the command line, initialises MPI once, dispatches.
    ("main", 7),
    // Argument parsing only: composes the commands' options.
    ("cli", 6),
    ("config", 5),
    // The commands.
    ("study", 5),
    ("conform", 5),
    ("bench", 5),
    ("report", 5),
    ("project", 5),
    ("data::command", 5),
    ("data::bench", 5),
    ("checkpoint::command", 5),
    // The training run and what it is made of.
    ("train", 4),
    ("overlap", 4),
    ("checkpoint", 4),
    ("model", 4),
    ("data", 4),
    ("faults", 4),
    ("results", 4),
    // The exchange strategies and the optimizer they step.
    ("exchange", 3),
    ("optim", 3),
    // Planning, without MPI: schedules, shard arithmetic, bucket plans, the cost model.
    ("plan", 2),
    ("cost", 2),
    ("layouts", 2),
    // MPI, tensor memory and what everything shares. `raw` covers every file of src/raw/.
    ("raw", 1),
    ("mpi_library", 1),
    ("watchdog", 1),
    ("progress", 1),
    ("topology", 1),
    ("error", 1),
    ("element", 1),
];

/// Imports that may run back up, at most (issue 33).
const UPWARD_BUDGET: usize = 4;

/// Imports left out of the circle check, each with the reason. Every one must still be in the
/// code (the test fails on one that is gone, so that the list stays minimal).
const EXCEPTIONS: &[(&str, &str, &str)] = &[];

type Graph = BTreeMap<String, BTreeSet<String>>;

/// The crate's modules (one per file) and the imports between them.
struct Imports {
    modules: BTreeSet<String>,
    edges: Graph,
}

/// The module a file under `src/` is: `main` for the crate root, `a::b` for `a/b.rs` and
/// `a/b/mod.rs`.
fn module_of(relative: &str) -> String {
    let mut parts: Vec<&str> = relative.trim_end_matches(".rs").split('/').collect();
    if matches!(parts.last(), Some(&"mod") | Some(&"main") | Some(&"lib")) {
        parts.pop();
    }
    if parts.is_empty() { "main".to_string() } else { parts.join("::") }
}

fn join(segments: &[String]) -> String {
    if segments.is_empty() { "main".to_string() } else { segments.join("::") }
}

#[derive(Clone, Debug, PartialEq)]
enum Token {
    Ident(String),
    PathSep,
    Punct(char),
}

/// The tokens that paths are made of; comments, string, char and number literals and
/// lifetimes are dropped.
fn tokens(source: &str) -> Vec<Token> {
    let c: Vec<char> = source.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    let at = |k: usize| c.get(k).copied().unwrap_or('\0');
    while i < c.len() {
        let ch = c[i];
        if ch == '/' && at(i + 1) == '/' {
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
                    i += 1;
                }
            }
        } else if ch == '"' {
            i = skip_string(&c, i);
        } else if ch == '\'' {
            if at(i + 1) == '\\' {
                i += 3; // the quote, the backslash and the escaped character
                while i < c.len() && c[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if at(i + 2) == '\'' {
                i += 3;
            } else {
                i += 1; // a lifetime or a label: its name follows as an identifier
            }
        } else if ch.is_ascii_digit() {
            while i < c.len() && (c[i].is_ascii_alphanumeric() || c[i] == '_' || (c[i] == '.' && at(i + 1).is_ascii_digit())) {
                i += 1;
            }
        } else if ch.is_alphabetic() || ch == '_' {
            let start = i;
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
            let word: String = c[start..i].iter().collect();
            let raw_string = matches!(word.as_str(), "r" | "br" | "cr") && (at(i) == '"' || (at(i) == '#' && (at(i + 1) == '"' || at(i + 1) == '#')));
            if raw_string {
                let hashes = (i..).take_while(|&k| at(k) == '#').count();
                i += hashes + 1;
                loop {
                    if i >= c.len() {
                        break;
                    }
                    if c[i] == '"' && (1..=hashes).all(|h| at(i + h) == '#') {
                        i += hashes + 1;
                        break;
                    }
                    i += 1;
                }
            } else if matches!(word.as_str(), "b" | "c") && at(i) == '"' {
                i = skip_string(&c, i);
            } else if word == "b" && at(i) == '\'' {
                i += 1;
                while i < c.len() && c[i] != '\'' {
                    i += if c[i] == '\\' { 2 } else { 1 };
                }
                i += 1;
            } else if word == "r" && at(i) == '#' {
                i += 1; // a raw identifier: r#name
            } else {
                out.push(Token::Ident(word));
            }
        } else if ch == ':' && at(i + 1) == ':' {
            out.push(Token::PathSep);
            i += 2;
        } else if ch == '$' && at(i + 1) == 'c' {
            i += 1; // `$crate` reads as `crate`
        } else {
            if !ch.is_whitespace() {
                out.push(Token::Punct(ch));
            }
            i += 1;
        }
    }
    out
}

/// The index after the string literal that starts at `start` (its opening quote).
fn skip_string(c: &[char], start: usize) -> usize {
    let mut i = start + 1;
    while i < c.len() && c[i] != '"' {
        i += if c[i] == '\\' { 2 } else { 1 };
    }
    i + 1
}

/// A path read from the code: its segments from the crate root, whether it names a macro
/// (`path!`), and the name it is brought in as (`use a::b` brings `b`; `use a::b as c`, `c`).
struct FoundPath {
    segments: Vec<String>,
    is_macro: bool,
    name: Option<String>,
}

/// Reads a path or a use tree from `t[*i]` on, below `prefix`; each full path goes to `out`.
fn use_tree(t: &[Token], i: &mut usize, mut prefix: Vec<String>, out: &mut Vec<FoundPath>) {
    loop {
        match t.get(*i) {
            Some(Token::Ident(word)) => {
                match word.as_str() {
                    "super" => {
                        prefix.pop();
                    }
                    "self" => {}
                    _ => prefix.push(word.clone()),
                }
                *i += 1;
                if t.get(*i) == Some(&Token::PathSep) {
                    *i += 1;
                    continue;
                }
                let is_macro = t.get(*i) == Some(&Token::Punct('!'));
                let name = match (t.get(*i), t.get(*i + 1)) {
                    (Some(Token::Ident(as_)), Some(Token::Ident(alias))) if as_ == "as" => Some(alias.clone()),
                    _ => prefix.last().cloned(),
                };
                out.push(FoundPath { segments: prefix, is_macro, name });
                return;
            }
            Some(Token::Punct('{')) => {
                *i += 1;
                loop {
                    match t.get(*i) {
                        None => return,
                        Some(Token::Punct('}')) => {
                            *i += 1;
                            return;
                        }
                        Some(Token::Punct(',')) => *i += 1,
                        Some(Token::Ident(_)) | Some(Token::Punct('{')) | Some(Token::Punct('*')) => {
                            use_tree(t, i, prefix.clone(), out);
                            // `as name` after an item.
                            while matches!(t.get(*i), Some(Token::Ident(_))) {
                                *i += 1;
                            }
                        }
                        Some(_) => *i += 1,
                    }
                }
            }
            _ => {
                // `*`, or a path that ends in `::<T>` or the like: the prefix is what it names.
                out.push(FoundPath { segments: prefix, is_macro: false, name: None });
                return;
            }
        }
    }
}

/// The imports of the crate made of `files` (path under `src/`, source).
fn read(files: &[(String, String)]) -> Imports {
    let modules: BTreeSet<String> = files.iter().map(|(path, _)| module_of(path)).collect();
    let segments = |m: &str| -> Vec<String> { if m == "main" { Vec::new() } else { m.split("::").map(String::from).collect() } };
    let mut macros: BTreeMap<String, String> = BTreeMap::new();
    let mut token_lists = Vec::new();
    for (path, source) in files {
        let t = tokens(source);
        let exported = source.contains("macro_export");
        for w in t.windows(3) {
            if let [Token::Ident(m), Token::Punct('!'), Token::Ident(name)] = w {
                if m == "macro_rules" && exported {
                    macros.insert(name.clone(), module_of(path));
                }
            }
        }
        token_lists.push((module_of(path), t));
    }
    let resolve = |path: &[String], is_macro: bool| -> String {
        if is_macro && path.len() == 1 {
            if let Some(m) = macros.get(&path[0]) {
                return m.clone();
            }
        }
        (0..=path.len()).rev().map(|k| join(&path[..k])).find(|m| modules.contains(m)).unwrap_or_else(|| "main".into())
    };
    let mut edges: Graph = modules.iter().map(|m| (m.clone(), BTreeSet::new())).collect();
    for (module, t) in &token_lists {
        let own = segments(module);
        let children: BTreeSet<String> =
            modules.iter().filter_map(|m| segments(m).split_last().filter(|(_, parent)| *parent == own.as_slice()).map(|(last, _)| last.clone())).collect();
        // Inline modules (`mod tests { .. }`): their names and the brace depth they close at.
        let mut inline: Vec<(String, usize)> = Vec::new();
        // Modules brought in by name (`use crate::data::{self, loader}`): paths through them.
        let mut aliases: BTreeMap<String, Vec<String>> = BTreeMap::new();
        let mut depth = 0usize;
        let mut i = 0;
        while i < t.len() {
            match &t[i] {
                Token::Punct('{') => {
                    depth += 1;
                    i += 1;
                    continue;
                }
                Token::Punct('}') => {
                    depth = depth.saturating_sub(1);
                    while inline.last().is_some_and(|(_, d)| *d > depth) {
                        inline.pop();
                    }
                    i += 1;
                    continue;
                }
                Token::Ident(word) if word == "mod" => {
                    if let (Some(Token::Ident(name)), Some(Token::Punct('{'))) = (t.get(i + 1), t.get(i + 2)) {
                        inline.push((name.clone(), depth + 1));
                    }
                    i += 1;
                    continue;
                }
                _ => {}
            }
            let starts_path = matches!(&t[i], Token::Ident(_)) && t.get(i + 1) == Some(&Token::PathSep) && (i == 0 || t[i - 1] != Token::PathSep);
            let Token::Ident(first) = &t[i] else {
                i += 1;
                continue;
            };
            if !starts_path {
                i += 1;
                continue;
            }
            let here: Vec<String> = own.iter().cloned().chain(inline.iter().map(|(n, _)| n.clone())).collect();
            let base = match first.as_str() {
                "crate" => Some((Vec::new(), i + 2)),
                "super" | "self" => Some((here, i)),
                name if aliases.contains_key(name) => Some((aliases[name].clone(), i + 2)),
                name if children.contains(name) => Some((own.clone(), i)),
                _ => None,
            };
            let in_use = i > 0 && t[i - 1] == Token::Ident("use".into());
            let Some((base, mut next)) = base else {
                i += 1;
                continue;
            };
            let mut found = Vec::new();
            use_tree(t, &mut next, base, &mut found);
            for path in found {
                let target = resolve(&path.segments, path.is_macro);
                if in_use && target == join(&path.segments) {
                    if let Some(name) = path.name {
                        aliases.insert(name, path.segments.clone());
                    }
                }
                if &target != module {
                    edges.get_mut(module).expect("every module has an entry").insert(target);
                }
            }
            i = next.max(i + 1);
        }
    }
    Imports { modules, edges }
}

/// The files under `src/`, as (path relative to `src/`, source).
fn source_files() -> Vec<(String, String)> {
    fn walk(dir: &Path, root: &Path, out: &mut Vec<(String, String)>) {
        let mut entries: Vec<_> = std::fs::read_dir(dir).expect("src/ is readable").map(|e| e.expect("a directory entry").path()).collect();
        entries.sort();
        for path in entries {
            if path.is_dir() {
                walk(&path, root, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let relative = path.strip_prefix(root).expect("under src/").to_string_lossy().into_owned();
                out.push((relative, std::fs::read_to_string(&path).expect("a readable source file")));
            }
        }
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut out = Vec::new();
    walk(&root, &root, &mut out);
    out
}

/// The module circles of `edges`: every strongly connected set of more than one module, each
/// shown as one circle through its first module (`a -> b -> a`).
fn circles(edges: &Graph) -> Vec<String> {
    // Tarjan's strongly connected components, iteratively.
    let nodes: Vec<&String> = edges.keys().collect();
    let index_of: BTreeMap<&String, usize> = nodes.iter().enumerate().map(|(k, n)| (*n, k)).collect();
    let succ: Vec<Vec<usize>> = nodes.iter().map(|n| edges[*n].iter().filter_map(|m| index_of.get(m).copied()).collect()).collect();
    let n = nodes.len();
    let (mut index, mut low, mut on_stack) = (vec![usize::MAX; n], vec![0; n], vec![false; n]);
    let (mut stack, mut components, mut counter) = (Vec::new(), Vec::new(), 0);
    for root in 0..n {
        if index[root] != usize::MAX {
            continue;
        }
        let mut work = vec![(root, 0usize)];
        while let Some(&(v, next)) = work.last() {
            if next == 0 && index[v] == usize::MAX {
                index[v] = counter;
                low[v] = counter;
                counter += 1;
                stack.push(v);
                on_stack[v] = true;
            }
            if let Some(&w) = succ[v].get(next) {
                work.last_mut().expect("v is on top").1 += 1;
                if index[w] == usize::MAX {
                    work.push((w, 0));
                } else if on_stack[w] {
                    low[v] = low[v].min(index[w]);
                }
                continue;
            }
            work.pop();
            if let Some(&(parent, _)) = work.last() {
                low[parent] = low[parent].min(low[v]);
            }
            if low[v] == index[v] {
                let mut component = Vec::new();
                while let Some(w) = stack.pop() {
                    on_stack[w] = false;
                    component.push(w);
                    if w == v {
                        break;
                    }
                }
                if component.len() > 1 {
                    components.push(component);
                }
            }
        }
    }
    components
        .into_iter()
        .map(|component| {
            let members: BTreeSet<usize> = component.iter().copied().collect();
            let start = *members.first().expect("not empty");
            // The shortest way from `start` back to it, inside the component.
            let mut came_from: BTreeMap<usize, usize> = BTreeMap::new();
            let mut queue = VecDeque::from([start]);
            'search: while let Some(v) = queue.pop_front() {
                for &w in &succ[v] {
                    if !members.contains(&w) || came_from.contains_key(&w) {
                        continue;
                    }
                    came_from.insert(w, v);
                    if w == start {
                        break 'search;
                    }
                    queue.push_back(w);
                }
            }
            let mut path = vec![start];
            let mut at = came_from[&start];
            while at != start {
                path.push(at);
                at = came_from[&at];
            }
            path.push(start);
            path.reverse();
            let shown: Vec<&str> = path.iter().map(|&k| nodes[k].as_str()).collect();
            let all: Vec<&str> = members.iter().map(|&k| nodes[k].as_str()).collect();
            format!("{} (modules in the circle: {})", shown.join(" -> "), all.join(", "))
        })
        .collect()
}

/// The floor of `module`, by the longest prefix of [`FLOORS`] that names it.
fn floor(module: &str) -> Option<u32> {
    FLOORS
        .iter()
        .filter(|(prefix, _)| module == *prefix || module.starts_with(&format!("{prefix}::")))
        .max_by_key(|(prefix, _)| prefix.len())
        .map(|&(_, f)| f)
}

/// Every import of a higher floor than the importer's, as `from (floor) -> to (floor)`.
fn upward(imports: &Imports) -> Vec<String> {
    let mut out = Vec::new();
    for (from, targets) in &imports.edges {
        for to in targets {
            if let (Some(a), Some(b)) = (floor(from), floor(to)) {
                if b > a {
                    out.push(format!("{from} ({a}) -> {to} ({b})"));
                }
            }
        }
    }
    out
}

#[test]
fn no_import_circle() {
    let mut imports = read(&source_files());
    let mut stale = Vec::new();
    for &(from, to, why) in EXCEPTIONS {
        if !imports.edges.get_mut(from).is_some_and(|targets| targets.remove(to)) {
            stale.push(format!("{from} -> {to} ({why})"));
        }
    }
    assert!(stale.is_empty(), "EXCEPTIONS lists imports that are no longer in the code; remove them:\n  {}", stale.join("\n  "));
    let found = circles(&imports.edges);
    assert!(found.is_empty(), "import circle(s) among the crate's files:\n  {}", found.join("\n  "));
}

#[test]
fn imports_run_down_the_floors() {
    let imports = read(&source_files());
    let unplaced: Vec<&String> = imports.modules.iter().filter(|m| floor(m).is_none()).collect();
    assert!(unplaced.is_empty(), "modules without a floor: {unplaced:?}; add them to FLOORS in tests/architecture.rs (and docs/contributing.md's layer map)");
    let up = upward(&imports);
    println!("{} module(s), {} import(s) between them; running back up:\n  {}", imports.modules.len(), imports.edges.values().map(BTreeSet::len).sum::<usize>(), up.join("\n  "));
    assert!(up.len() <= UPWARD_BUDGET, "{} imports run back up, more than {UPWARD_BUDGET}:\n  {}", up.len(), up.join("\n  "));
}

/// The reader itself, on a made-up crate: every form of import, and nothing else.
#[test]
fn the_reader_sees_every_form_of_import_and_nothing_else() {
    let file = |path: &str, source: &str| (path.to_string(), source.to_string());
    let crate_files = [
        file("main.rs", "mod a; mod b; mod c; use a::Thing; fn main() { c::go(); } pub fn helper() {}"),
        file("a/mod.rs", "pub mod x; pub mod y; pub use x::Thing;"),
        file("a/x.rs", "use super::y::{self, Other as O};\n// use crate::b::Commented;\nconst S: &str = \"crate::c::InAString\";\nconst R: &str = r#\"crate::c::Raw\"#;\nfn f<'a>(c: &'a char) -> char { 'x' }"),
        file("a/y.rs", "use crate::{b::{deep::Item, Other}, helper}; #[cfg(test)] mod tests { use super::*; use super::super::x::Thing; }"),
        file("b/mod.rs", "pub mod deep; fn f() { crate::with_it!(); }"),
        file("b/deep.rs", ""),
        file("c.rs", "#[macro_export] macro_rules! with_it { () => { $crate::b::deep::f() } }"),
        file("d.rs", "use crate::b as bee;\nuse crate::a::{self};\nfn f() { bee::deep::g(); a::x::h(); }"),
    ];
    let imports = read(&crate_files);
    let of = |m: &str| imports.edges[m].iter().map(String::as_str).collect::<Vec<_>>();
    assert_eq!(of("main"), vec!["a", "c"], "child modules through relative paths");
    assert_eq!(of("a"), vec!["a::x"]);
    assert_eq!(of("a::x"), vec!["a::y"], "comments and strings are not imports");
    assert_eq!(of("a::y"), vec!["a::x", "b", "b::deep", "main"], "nested groups, items of the root, super in an inline module");
    assert_eq!(of("b"), vec!["c"], "an exported macro is an import of its file");
    assert_eq!(of("c"), vec!["b::deep"], "$crate in a macro");
    assert_eq!(of("d"), vec!["a", "a::x", "b", "b::deep"], "paths through a module brought in by `use`");
}

#[test]
fn a_circle_is_found_and_shown() {
    let graph: Graph = [("a", vec!["b"]), ("b", vec!["c"]), ("c", vec!["a", "d"]), ("d", vec![]), ("e", vec!["d"])]
        .into_iter()
        .map(|(m, to)| (m.to_string(), to.into_iter().map(String::from).collect()))
        .collect();
    assert_eq!(circles(&graph), vec!["a -> b -> c -> a (modules in the circle: a, b, c)".to_string()]);
    let mut cut = graph.clone();
    cut.get_mut("c").unwrap().remove("a");
    assert!(circles(&cut).is_empty());
}
