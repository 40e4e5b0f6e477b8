//! The shape of src/, checked so that later work keeps it (issue 28): no
//! import circle between files, and no file over 600 lines. Reads the
//! sources only; needs no ClickHouse.
//!
//! A path that starts with `crate::`, `super::` or `self::`, in a `use` or
//! inline in code, is an edge from its file to the file of the deepest module
//! it names (`crate::http::error::ApiError` → src/http/error.rs,
//! `crate::locks::LockManager` → src/locks/mod.rs). So is a path through a
//! module brought in by such a `use` (`use crate::store;` then
//! `store::ddl::X`), or through a child module by its bare name. A module
//! file's `pub use` of its own descendants only hands them on: not an edge.
//! A line scanner, not a parser: comments and literals are skipped, and
//! `#[path]` attributes are not followed (src/ has none).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const MAX_LINES: usize = 600;

#[test]
fn no_import_circle_between_files() {
    let graph = Graph::of(&sources());
    let circles = graph.circles();
    assert!(
        circles.is_empty(),
        "import circles between files in src/; break each by moving what both sides share to \
         the module it belongs to (a lower one), not by spelling paths differently:\n{}",
        circles.join("\n")
    );
}

#[test]
fn no_file_in_src_is_over_600_lines() {
    let long: Vec<String> = sources()
        .iter()
        .map(|(path, text)| (path, text.lines().count()))
        .filter(|(_, lines)| *lines > MAX_LINES)
        .map(|(path, lines)| format!("{} has {lines} lines", path.display()))
        .collect();
    assert!(
        long.is_empty(),
        "files in src/ over {MAX_LINES} lines; split each by job:\n{}",
        long.join("\n")
    );
}

/// The checker itself, on a crate small enough to read: if it stopped seeing
/// edges, the test above would pass on anything.
#[test]
fn the_checker_finds_a_circle_and_lets_a_parent_hand_on_its_children() {
    let files = |extra: &[(&str, &str)]| {
        let files: BTreeMap<&str, &str> = [
            ("src/lib.rs", "pub mod a;\npub mod b;\n"),
            ("src/a/mod.rs", "pub mod inner;\npub use inner::Thing;\n"),
            (
                "src/a/inner.rs",
                "// use crate::b::Other;\nconst S: &str = \"crate::b::Other\";\npub struct Thing;\n",
            ),
        ]
        .into_iter()
        .chain(extra.iter().copied())
        .collect();
        files
            .into_iter()
            .map(|(path, text)| (PathBuf::from(path), text.to_owned()))
            .collect::<Vec<_>>()
    };
    let clean = Graph::of(&files(&[("src/b.rs", "use crate::a::Thing;\n")]));
    assert_eq!(clean.circles(), Vec::<String>::new());
    let circle = Graph::of(&files(&[
        (
            "src/b.rs",
            "use crate::a::inner::Thing;\npub struct Other;\n",
        ),
        (
            "src/a/inner.rs",
            "pub struct Thing(super::super::b::Other);\n",
        ),
    ]));
    let found = circle.circles().join("\n");
    assert!(found.contains("src/a/inner.rs"), "{found}");
    assert!(found.contains("src/b.rs"), "{found}");
    let grouped = Graph::of(&files(&[(
        "src/b.rs",
        "use crate::{a::{self, Thing}};\nfn f() { inner(a::inner::Thing); }\n",
    )]));
    assert!(
        grouped.edges["src/b.rs"].contains_key("src/a/inner.rs"),
        "{:?}",
        grouped.edges
    );
}

/// Every .rs file under src/, with its text, by path from the crate's root.
fn sources() -> Vec<(PathBuf, String)> {
    fn walk(dir: &Path, root: &Path, out: &mut Vec<(PathBuf, String)>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, root, out);
            } else if path.extension().is_some_and(|ext| ext == "rs") {
                let text = std::fs::read_to_string(&path).unwrap();
                out.push((path.strip_prefix(root).unwrap().to_owned(), text));
            }
        }
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut out = Vec::new();
    walk(&root.join("src"), root, &mut out);
    out.sort();
    out
}

type Module = Vec<String>;

/// The names `use` brings modules in by, in one file.
type Aliases = BTreeMap<String, Module>;

struct Graph {
    /// file → file it names → the first path that named it, as `line: path`.
    edges: BTreeMap<String, BTreeMap<String, String>>,
}

impl Graph {
    fn of(files: &[(PathBuf, String)]) -> Self {
        let tokens: Vec<(String, Module, Vec<Token>)> = files
            .iter()
            .map(|(path, text)| {
                let name = path.to_string_lossy().replace('\\', "/");
                let module = module_of(&name);
                (name, module, tokenize(text))
            })
            .collect();
        // Every module, inline ones (`mod tests { … }`) included, and its file.
        let mut modules: BTreeMap<Module, String> = BTreeMap::new();
        for (name, module, tokens) in &tokens {
            modules.insert(module.clone(), name.clone());
            for (inline, _) in scopes(module, tokens) {
                modules.entry(inline).or_insert_with(|| name.clone());
            }
        }
        let mut edges = BTreeMap::new();
        for (name, module, tokens) in &tokens {
            let scan = Scan {
                file: module,
                modules: &modules,
                tokens,
            };
            // Twice: the first pass learns the modules that `use` brings in,
            // so that a path through one is seen wherever it comes.
            let aliases = scan.paths(&BTreeMap::new()).1;
            let mut out: BTreeMap<String, String> = BTreeMap::new();
            for (target, why) in scan.paths(&aliases).0 {
                let to = &modules[&target];
                if to != name {
                    out.entry(to.clone()).or_insert(why);
                }
            }
            edges.insert(name.clone(), out);
        }
        Self { edges }
    }

    /// Each strongly connected group of files, as one circle through it.
    fn circles(&self) -> Vec<String> {
        let mut seen = BTreeSet::new();
        let mut out = Vec::new();
        for start in self.edges.keys() {
            if seen.contains(start) {
                continue;
            }
            let group: BTreeSet<&String> = self
                .reachable(start)
                .into_iter()
                .filter(|file| self.reachable(file).contains(start))
                .collect();
            seen.extend(group.iter().map(|file| (*file).clone()));
            if let Some(circle) = self.circle_through(start) {
                let members: Vec<&str> = group.iter().map(|file| file.as_str()).collect();
                out.push(format!(
                    "{circle}\n    (all files in it: {})",
                    members.join(", ")
                ));
            }
        }
        out
    }

    fn reachable<'a>(&'a self, from: &'a String) -> BTreeSet<&'a String> {
        let mut found = BTreeSet::new();
        let mut todo = vec![from];
        while let Some(file) = todo.pop() {
            for next in self.edges.get(file).into_iter().flat_map(|e| e.keys()) {
                if found.insert(next) {
                    todo.push(next);
                }
            }
        }
        found
    }

    /// The shortest circle from `start` back to it, each step with its path.
    fn circle_through(&self, start: &String) -> Option<String> {
        let mut came_from: BTreeMap<&String, &String> = BTreeMap::new();
        let mut queue = std::collections::VecDeque::from([start]);
        while let Some(file) = queue.pop_front() {
            for next in self.edges.get(file).into_iter().flat_map(|e| e.keys()) {
                if next == start {
                    let mut steps = vec![file];
                    while let Some(prev) = came_from.get(steps.last().unwrap()) {
                        steps.push(prev);
                    }
                    steps.reverse();
                    steps.push(start);
                    let described: Vec<String> = steps
                        .windows(2)
                        .map(|w| format!("{} ({}) →", w[0], self.edges[w[0]][w[1]]))
                        .collect();
                    return Some(format!("  {} {start}", described.join(" ")));
                }
                if next != start && !came_from.contains_key(next) {
                    came_from.insert(next, file);
                    queue.push_back(next);
                }
            }
        }
        None
    }
}

/// src/lib.rs is the crate; src/a.rs and src/a/mod.rs are `a`; src/a/b.rs
/// is `a::b`. src/main.rs is a crate of its own, apart from the library.
fn module_of(file: &str) -> Module {
    let rel = file.strip_prefix("src/").unwrap_or(file);
    if rel == "main.rs" {
        return vec!["<main>".to_owned()];
    }
    let rel = rel.strip_suffix(".rs").unwrap();
    let mut parts: Vec<String> = rel.split('/').map(str::to_owned).collect();
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
        parts.pop();
    }
    parts
}

struct Token {
    text: String,
    line: usize,
}

/// Identifiers, `::` and single punctuation; comments, strings, chars and
/// numbers are dropped.
fn tokenize(text: &str) -> Vec<Token> {
    let chars: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let (mut i, mut line) = (0, 1);
    let at = |i: usize| chars.get(i).copied().unwrap_or('\0');
    while i < chars.len() {
        let c = chars[i];
        let start = i;
        if c == '/' && at(i + 1) == '/' {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && at(i + 1) == '*' {
            let mut depth = 0;
            loop {
                if at(i) == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if at(i) == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else if i >= chars.len() {
                    break;
                } else {
                    i += 1;
                }
            }
        } else if let Some(hashes) = raw_string_start(&chars, i) {
            // r"…", r#"…"#, br#"…"#: ends at a quote and as many hashes.
            i = hashes.1;
            let closing: String = std::iter::once('"')
                .chain(std::iter::repeat_n('#', hashes.0))
                .collect();
            while i < chars.len() && !chars[i..].starts_with(&closing.chars().collect::<Vec<_>>()) {
                i += 1;
            }
            i += closing.chars().count();
        } else if c == '"' || (c == 'b' && at(i + 1) == '"') {
            i += if c == 'b' { 2 } else { 1 };
            while i < chars.len() && chars[i] != '"' {
                i += if chars[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
        } else if c == '\'' && (at(i + 1) == '\\' || at(i + 2) == '\'') {
            // A char literal; a lifetime ('a) has no closing quote.
            i += 1;
            while i < chars.len() && chars[i] != '\'' {
                i += if chars[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
        } else if c.is_alphabetic() || c == '_' {
            // A raw identifier (r#type) is the identifier.
            if c == 'r' && at(i + 1) == '#' {
                i += 2;
            }
            let word_start = i;
            while at(i).is_alphanumeric() || at(i) == '_' {
                i += 1;
            }
            let text = chars[word_start..i].iter().collect();
            out.push(Token { text, line });
        } else if c.is_ascii_digit() {
            while at(i).is_alphanumeric() || at(i) == '_' || at(i) == '.' && at(i + 1) != '.' {
                i += 1;
            }
        } else if c == ':' && at(i + 1) == ':' {
            out.push(Token {
                text: "::".to_owned(),
                line,
            });
            i += 2;
        } else {
            if !c.is_whitespace() {
                out.push(Token {
                    text: c.to_string(),
                    line,
                });
            }
            i += 1;
        }
        line += chars[start..i.min(chars.len())]
            .iter()
            .filter(|c| **c == '\n')
            .count();
    }
    out
}

/// Where a raw string starts at `i`: its number of hashes and where its text begins.
fn raw_string_start(chars: &[char], i: usize) -> Option<(usize, usize)> {
    let mut j = i;
    if chars.get(j) == Some(&'b') {
        j += 1;
    }
    if chars.get(j) != Some(&'r') {
        return None;
    }
    j += 1;
    let hashes = chars[j..].iter().take_while(|c| **c == '#').count();
    (chars.get(j + hashes) == Some(&'"')).then_some((hashes, j + hashes + 1))
}

/// The module each token is in: the file's, or an inline `mod x { … }`'s.
fn scopes(file: &Module, tokens: &[Token]) -> Vec<(Module, usize)> {
    let mut stack: Vec<(Module, usize)> = vec![(file.clone(), 0)];
    let mut depth = 0;
    let mut out = Vec::with_capacity(tokens.len());
    for (i, token) in tokens.iter().enumerate() {
        match token.text.as_str() {
            "{" => {
                depth += 1;
                let opens_mod = i >= 2 && tokens[i - 2].text == "mod";
                if opens_mod {
                    let mut inner = stack.last().unwrap().0.clone();
                    inner.push(tokens[i - 1].text.clone());
                    stack.push((inner, depth));
                }
            }
            "}" => {
                if stack.len() > 1 && stack.last().unwrap().1 == depth {
                    stack.pop();
                }
                depth -= 1;
            }
            _ => {}
        }
        out.push(stack.last().unwrap().clone());
    }
    out
}

struct Scan<'a> {
    file: &'a Module,
    modules: &'a BTreeMap<Module, String>,
    tokens: &'a [Token],
}

impl Scan<'_> {
    /// Each module a path in the file names, with `line: path`; and the
    /// modules its `use`s bring in by name.
    fn paths(&self, aliases: &Aliases) -> (Vec<(Module, String)>, Aliases) {
        let scopes = scopes(self.file, self.tokens);
        let (mut named, mut brought) = (Vec::new(), BTreeMap::new());
        let (mut in_use, mut pub_use) = (false, false);
        let mut i = 0;
        while i < self.tokens.len() {
            let text = self.tokens[i].text.as_str();
            let scope = &scopes[i].0;
            match text {
                "use" => {
                    in_use = true;
                    pub_use = self.tokens[..i]
                        .iter()
                        .rev()
                        .take(5)
                        .any(|t| t.text == "pub")
                        && self.tokens[..i]
                            .last()
                            .is_some_and(|t| t.text == "pub" || t.text == ")");
                }
                ";" => (in_use, pub_use) = (false, false),
                _ => {}
            }
            let prev = i.checked_sub(1).map(|p| self.tokens[p].text.as_str());
            let starts_path = self.tokens.get(i + 1).is_some_and(|t| t.text == "::")
                && !matches!(prev, Some("::" | "." | "$" | "in"))
                && (matches!(text, "crate" | "super" | "self")
                    || aliases.contains_key(text)
                    || self.modules.contains_key(&child(scope, text)));
            if !starts_path {
                i += 1;
                continue;
            }
            let mut leaves = Vec::new();
            let end = use_tree(self.tokens, i, Vec::new(), &mut leaves);
            for (path, alias) in leaves {
                let (module, whole) = self.resolve(scope, &path, aliases);
                let handed_on =
                    pub_use && module.len() > self.file.len() && module.starts_with(self.file);
                if in_use && whole {
                    let name = alias.or_else(|| path.iter().rev().find(|s| *s != "self").cloned());
                    if let Some(name) = name {
                        brought.insert(name, module.clone());
                    }
                }
                if !handed_on {
                    let shown = path.strip_suffix(&["self".to_owned()]).unwrap_or(&path);
                    let why = format!("line {}: {}", self.tokens[i].line, shown.join("::"));
                    named.push((module, why));
                }
            }
            i = end;
        }
        (named, brought)
    }

    /// The deepest module `path` names from `scope`, and whether the whole
    /// path is modules (so that `use` brings in a module by that name).
    fn resolve(&self, scope: &Module, path: &[String], aliases: &Aliases) -> (Module, bool) {
        let mut rest = path.iter().peekable();
        let mut module = match rest.peek().map(|s| s.as_str()) {
            Some("crate") => {
                rest.next();
                self.file
                    .iter()
                    .take_while(|s| *s == "<main>")
                    .cloned()
                    .collect()
            }
            Some("self") => {
                rest.next();
                scope.clone()
            }
            Some("super") => scope.clone(),
            Some(name) if self.modules.contains_key(&child(scope, name)) => scope.clone(),
            Some(name) => {
                rest.next();
                aliases.get(name).unwrap_or(scope).clone()
            }
            None => scope.clone(),
        };
        let mut whole = true;
        for segment in rest {
            match segment.as_str() {
                "super" => {
                    module.pop();
                }
                "self" => {}
                name if self.modules.contains_key(&child(&module, name)) => {
                    module.push(name.to_owned());
                }
                _ => {
                    whole = false;
                    break;
                }
            }
        }
        (module, whole)
    }
}

fn child(module: &Module, name: &str) -> Module {
    let mut child = module.clone();
    child.push(name.to_owned());
    child
}

/// The paths of a use tree (or of one inline path) starting at `i`, each with
/// its `as` name; returns where the tree ends.
fn use_tree(
    tokens: &[Token],
    mut i: usize,
    mut prefix: Vec<String>,
    leaves: &mut Vec<(Vec<String>, Option<String>)>,
) -> usize {
    let text = |i: usize| tokens.get(i).map(|t| t.text.as_str()).unwrap_or("");
    let is_ident = |s: &str| s.starts_with(|c: char| c.is_alphabetic() || c == '_');
    while is_ident(text(i)) {
        prefix.push(text(i).to_owned());
        i += 1;
        if text(i) != "::" {
            break;
        }
        i += 1;
        match text(i) {
            "{" => {
                i += 1;
                while !matches!(text(i), "}" | "") {
                    i = use_tree(tokens, i, prefix.clone(), leaves);
                    if text(i) == "," {
                        i += 1;
                    }
                }
                return i + 1;
            }
            "*" => {
                // Kept in the path, so that a glob does not bring in a name.
                prefix.push("*".to_owned());
                leaves.push((prefix, None));
                return i + 1;
            }
            _ => {}
        }
    }
    let alias = (text(i) == "as").then(|| text(i + 1).to_owned());
    leaves.push((prefix, alias.clone()));
    if alias.is_some() { i + 2 } else { i }
}
