//! The README and `docs/` stay true to the repository, for all later work
//! too: the README is a short front door that starts with the two commands,
//! the rest lives in at least three pages under `docs/`, every `src/` path
//! they name exists, the code map in `docs/development.md` names every module
//! file, every relative link leads to a file (and heading) that exists, and
//! every flag and `STATEHOUSE_*` variable the operators' pages name is one
//! something reads. Only files are read: no gateway, no ClickHouse.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
const README_MAX_LINES: usize = 250;
const CODE_MAP: &str = "## Code map";
/// The pages operators copy settings from.
const SETTING_PAGES: [&str; 3] = ["README.md", "docs/configuration.md", "docs/operations.md"];
const VARIABLE_PREFIX: &str = "STATEHOUSE_";
/// Programs whose flags the pages show beside statehouse's: a command that
/// starts with one of these is theirs, and its flags are not checked.
const OTHER_PROGRAMS: [&str; 12] = [
    "cargo",
    "curl",
    "docker",
    "docker-compose",
    "jq",
    "kubectl",
    "kustomize",
    "meltano",
    "openssl",
    "pip",
    "pipx",
    "uv",
];

/// A page of the docs: its path from the repository root, and its text.
struct Page {
    path: String,
    text: String,
}

impl Page {
    fn read(path: &str) -> Page {
        let text = std::fs::read_to_string(Path::new(ROOT).join(path))
            .unwrap_or_else(|e| panic!("{path} is readable: {e}"));
        Page {
            path: path.to_owned(),
            text,
        }
    }

    /// Numbered lines (from 1) outside fenced code blocks, with whether each
    /// is inside one: links and headings only count outside them.
    fn lines(&self) -> impl Iterator<Item = (usize, &str, bool)> {
        let mut fenced = false;
        self.text.lines().enumerate().map(move |(i, line)| {
            let fence = line.trim_start().starts_with("```");
            if fence {
                fenced = !fenced;
            }
            (i + 1, line, fenced || fence)
        })
    }

    /// The anchors GitHub gives this page's headings.
    fn anchors(&self) -> BTreeSet<String> {
        let mut seen: HashMap<String, usize> = HashMap::new();
        self.lines()
            .filter(|(_, _, fenced)| !fenced)
            .filter_map(|(_, line, _)| heading(line))
            .map(|title| {
                let base = slug(title);
                let count = seen.entry(base.clone()).or_default();
                let anchor = match *count {
                    0 => base,
                    n => format!("{base}-{n}"),
                };
                *count += 1;
                anchor
            })
            .collect()
    }
}

/// README.md, then every page under docs/ in name order.
fn pages() -> Vec<Page> {
    let mut pages = vec![Page::read("README.md")];
    pages.extend(docs_pages().iter().map(|path| Page::read(path)));
    pages
}

fn docs_pages() -> Vec<String> {
    let dir = Path::new(ROOT).join("docs");
    let mut pages: Vec<String> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{} is readable: {e}", dir.display()))
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".md"))
        .map(|name| format!("docs/{name}"))
        .collect();
    pages.sort();
    pages
}

/// A markdown heading's title (`## Locks` → `Locks`).
fn heading(line: &str) -> Option<&str> {
    let hashes = line.len() - line.trim_start_matches('#').len();
    let title = line[hashes..].strip_prefix(' ')?;
    (1..=6).contains(&hashes).then_some(title)
}

/// GitHub's anchor for a heading: lower case, punctuation dropped (`-` and
/// `_` kept), spaces as hyphens.
fn slug(title: &str) -> String {
    title
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | ' '))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

fn path_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '/' | '-')
}

/// Every `src/...` path a line names: `src/` where no path starts before it
/// (so not `shim/src/`), up to the first character no path here has, less a
/// sentence's closing dot.
fn src_paths(line: &str) -> Vec<&str> {
    line.match_indices("src/")
        .filter(|(at, _)| !line[..*at].chars().next_back().is_some_and(path_char))
        .map(|(at, _)| {
            let rest = &line[at..];
            let end = rest.find(|c| !path_char(c)).unwrap_or(rest.len());
            rest[..end].trim_end_matches('.')
        })
        .collect()
}

/// Every link target on a line, `[text](target)`; the text may have begun
/// on an earlier line.
fn link_targets(line: &str) -> Vec<&str> {
    line.match_indices("](")
        .filter_map(|(at, _)| {
            let rest = &line[at + 2..];
            rest.find(')').map(|end| &rest[..end])
        })
        .collect()
}

/// Every `.rs` file under src/, as `src/...`.
fn module_files(dir: &Path, found: &mut Vec<String>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            module_files(&path, found);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            let relative = path.strip_prefix(ROOT).unwrap();
            found.push(relative.to_string_lossy().into_owned());
        }
    }
}

/// Every file under `dir` whose name ends with `suffix`, recursively.
fn files_ending(dir: &Path, suffix: &str, found: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files_ending(&path, suffix, found);
        } else if path.to_string_lossy().ends_with(suffix) {
            found.push(path);
        }
    }
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{} is readable: {e}", path.display()))
}

/// Every `STATEHOUSE_*` name in `text` that no longer name runs into (not the
/// tail of `MELTANO_STATE_BACKEND_STATEHOUSE_TOKEN`), with the character
/// before it.
fn variables(text: &str) -> Vec<(Option<char>, &str)> {
    text.match_indices(VARIABLE_PREFIX)
        .filter_map(|(at, _)| {
            let before = text[..at].chars().next_back();
            if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
                return None;
            }
            let rest = &text[at..];
            let end = rest
                .find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
                .unwrap_or(rest.len());
            Some((before, &rest[..end]))
        })
        .collect()
}

/// The long flags `#[arg(...)]` attributes in `source` declare: `long` on a
/// field is `--field-name`, `long = "name"` is `--name`.
fn long_flags(source: &str) -> Vec<String> {
    let mut flags = Vec::new();
    for (at, _) in source.match_indices("#[arg(") {
        let rest = &source[at..];
        let end = rest.find(")]").expect("an #[arg(...)] attribute ends");
        let body = &rest["#[arg(".len()..end];
        let items: Vec<&str> = body.split(',').map(str::trim).collect();
        if let Some(name) = items.iter().find_map(|item| {
            item.strip_prefix("long")
                .and_then(|v| v.trim_start().strip_prefix('='))
                .map(|v| v.trim().trim_matches('"'))
        }) {
            flags.push(name.to_owned());
        } else if items.contains(&"long") {
            let field = rest[end..]
                .lines()
                .skip(1)
                .map(str::trim)
                .find(|line| !(line.is_empty() || line.starts_with("#[") || line.starts_with("//")))
                .expect("an #[arg] attribute is on a field");
            let field = field
                .trim_start_matches("pub(crate) ")
                .trim_start_matches("pub(super) ")
                .trim_start_matches("pub ");
            let name = &field[..field.find(':').expect("a field has a type")];
            flags.push(name.trim().replace('_', "-"));
        }
    }
    flags
}

/// What the pages may name: the binary's long flags (and clap's own); the
/// variables the binary and the shim read (string literals in `src/` and
/// `shim/src/`) and the compose files' own (`${STATEHOUSE_PORT:-8080}`).
fn known_settings() -> (BTreeSet<String>, BTreeSet<String>) {
    let mut flags: BTreeSet<String> = ["help", "version"].map(String::from).into();
    let mut names = BTreeSet::new();
    let mut sources = Vec::new();
    files_ending(&Path::new(ROOT).join("src"), ".rs", &mut sources);
    for path in &sources {
        let text = read(path);
        flags.extend(long_flags(&text));
        names.extend(
            variables(&text)
                .into_iter()
                .filter(|(before, _)| *before == Some('"'))
                .map(|(_, name)| name.to_owned()),
        );
    }
    let mut shim = Vec::new();
    files_ending(&Path::new(ROOT).join("shim/src"), ".py", &mut shim);
    for path in &shim {
        names.extend(
            variables(&read(path))
                .into_iter()
                .filter(|(before, _)| matches!(before, Some('"' | '\'')))
                .map(|(_, name)| name.to_owned()),
        );
    }
    // The root's compose files and deploy/'s, not the whole tree: target/
    // and the venvs hold files of their own.
    let mut compose: Vec<PathBuf> = std::fs::read_dir(ROOT)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .collect();
    files_ending(&Path::new(ROOT).join("deploy"), ".yml", &mut compose);
    for path in compose.iter().filter(|path| {
        let name = path.file_name().unwrap().to_string_lossy();
        name.ends_with(".yml")
            && (name.starts_with("docker-compose") || name.starts_with("compose"))
    }) {
        names.extend(
            variables(&read(path))
                .into_iter()
                .filter(|(before, _)| *before == Some('{'))
                .map(|(_, name)| name.to_owned()),
        );
    }
    (flags, names)
}

/// A paragraph's code spans and the prose between them, each a piece.
fn flush(paragraph: &mut Option<(usize, String)>, pieces: &mut Vec<(usize, String)>) {
    if let Some((number, text)) = paragraph.take() {
        pieces.extend(text.split('`').map(|piece| (number, piece.to_owned())));
    }
}

/// The pieces of a page to look for flags in, with the line each starts on:
/// each line of a code block (a line ending in `\` continued by the next),
/// and, outside them, each paragraph's code spans and the prose between
/// them, so a span that breaks across lines is one piece.
fn pieces(page: &Page) -> Vec<(usize, String)> {
    let mut pieces = Vec::new();
    let mut paragraph: Option<(usize, String)> = None;
    let mut continued: Option<(usize, String)> = None;
    for (number, line, fenced) in page.lines() {
        if fenced {
            flush(&mut paragraph, &mut pieces);
            let (start, mut text) = continued.take().unwrap_or((number, String::new()));
            match line.strip_suffix('\\') {
                Some(head) => {
                    text.push_str(head);
                    continued = Some((start, text));
                }
                None => {
                    text.push_str(line);
                    pieces.push((start, text));
                }
            }
        } else if line.trim().is_empty() {
            flush(&mut paragraph, &mut pieces);
        } else {
            let (_, text) = paragraph.get_or_insert_with(|| (number, String::new()));
            text.push(' ');
            text.push_str(line);
        }
    }
    flush(&mut paragraph, &mut pieces);
    pieces
}

/// The long flags in `piece` that are statehouse's to answer for: all but
/// those of a command that starts with another program, such as the child
/// after `statehouse lock ... --`.
fn statehouse_flags(piece: &str) -> Vec<&str> {
    let mut flags = Vec::new();
    let mut at_start = true;
    let mut theirs = false;
    for word in piece.split(|c: char| c.is_whitespace() || c == '(') {
        if word.is_empty() {
            continue;
        }
        if matches!(word, "|" | "||" | "&&" | ";" | "--" | "$") || word.ends_with(";") {
            at_start = true;
            theirs = false;
            continue;
        }
        let assignment = word.split_once('=').is_some_and(|(name, _)| {
            !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        });
        if at_start {
            if assignment || matches!(word, "sudo" | "nohup" | "exec" | "env") {
                continue;
            }
            at_start = false;
            let program = word.rsplit('/').next().unwrap_or(word);
            theirs = OTHER_PROGRAMS.contains(&program);
        }
        if let Some(flag) = word.strip_prefix("--") {
            let end = flag
                .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'))
                .unwrap_or(flag.len());
            if !theirs && flag.starts_with(|c: char| c.is_ascii_lowercase()) {
                flags.push(&flag[..end]);
            }
        }
    }
    flags
}

fn fail_with(problems: &[String], what: &str) {
    assert!(problems.is_empty(), "{what}:\n  {}", problems.join("\n  "));
}

#[test]
fn the_readme_is_a_short_front_door_that_starts_with_the_two_commands() {
    let readme = Page::read("README.md");
    let count = readme.text.lines().count();
    assert!(
        count <= README_MAX_LINES,
        "README.md has {count} lines, more than {README_MAX_LINES}: it is the front door \
         (the two commands, what statehouse is, a short tour, a map of the docs); \
         move the details to a page under docs/"
    );
    let mut lines = readme.text.lines().enumerate();
    let before: Vec<(usize, &str)> = lines
        .by_ref()
        .take_while(|(_, line)| !line.starts_with("```"))
        .collect();
    for (i, line) in &before {
        assert!(
            line.trim().is_empty() || heading(line).is_some(),
            "README.md:{}: {line:?} comes before the two commands; only the title may",
            i + 1
        );
    }
    let block: Vec<&str> = lines
        .take_while(|(_, line)| !line.starts_with("```"))
        .map(|(_, line)| line.trim())
        .collect();
    for command in ["scripts/dev", "scripts/test"] {
        assert!(
            block
                .iter()
                .any(|line| line.split_whitespace().next() == Some(command)),
            "README.md's first code block must run `{command}`; it holds: {block:?}"
        );
    }
}

#[test]
fn docs_has_at_least_three_pages() {
    let pages = docs_pages();
    assert!(
        pages.len() >= 3,
        "docs/ holds {} .md pages ({pages:?}); the README's details need at least three",
        pages.len()
    );
}

#[test]
fn every_src_path_named_in_the_docs_exists() {
    let mut problems = Vec::new();
    for page in pages() {
        for (number, line, _) in page.lines() {
            for path in src_paths(line) {
                if !Path::new(ROOT).join(path).exists() {
                    problems.push(format!(
                        "{}:{number}: names {path}, which does not exist",
                        page.path
                    ));
                }
            }
        }
    }
    fail_with(
        &problems,
        "the README and docs/ name src/ paths that are not in the repository \
         (fix the path, or drop the mention)",
    );
}

#[test]
fn the_code_map_names_every_module_file() {
    let development = Page::read("docs/development.md");
    let start = development
        .text
        .lines()
        .position(|line| line == CODE_MAP)
        .unwrap_or_else(|| panic!("docs/development.md has no `{CODE_MAP}` section"));
    let mapped: BTreeSet<&str> = development
        .text
        .lines()
        .skip(start + 1)
        .take_while(|line| !line.starts_with("## "))
        .flat_map(src_paths)
        .collect();
    let mut files = Vec::new();
    module_files(&Path::new(ROOT).join("src"), &mut files);
    files.sort();
    let missing: Vec<String> = files
        .into_iter()
        .filter(|file| !mapped.contains(file.as_str()))
        .map(|file| {
            format!(
                "{file}: add it to the code map in docs/development.md, one line saying its job"
            )
        })
        .collect();
    fail_with(
        &missing,
        "module files missing from the code map (docs/development.md, `## Code map`)",
    );
}

#[test]
fn relative_links_between_the_pages_resolve() {
    let pages = pages();
    let anchors: HashMap<PathBuf, BTreeSet<String>> = pages
        .iter()
        .map(|page| {
            let path = Path::new(ROOT).join(&page.path).canonicalize().unwrap();
            (path, page.anchors())
        })
        .collect();
    let mut problems = Vec::new();
    for page in &pages {
        let here = Path::new(ROOT).join(&page.path);
        let dir = here.parent().unwrap();
        for (number, line, fenced) in page.lines() {
            if fenced {
                continue;
            }
            for target in link_targets(line) {
                if target.contains("://") || target.starts_with("mailto:") {
                    continue;
                }
                let (file, anchor) = target.split_once('#').unwrap_or((target, ""));
                let file = if file.is_empty() {
                    here.clone()
                } else {
                    dir.join(file)
                };
                let at = format!("{}:{number}: [..]({target})", page.path);
                if !file.exists() {
                    problems.push(format!("{at}: no file {}", file.display()));
                    continue;
                }
                if anchor.is_empty() {
                    continue;
                }
                let file = file.canonicalize().unwrap();
                match anchors.get(&file) {
                    Some(headings) if headings.contains(anchor) => {}
                    Some(_) => problems.push(format!("{at}: no heading with anchor #{anchor}")),
                    None => problems.push(format!(
                        "{at}: an anchor into a file that is not README.md or docs/*.md"
                    )),
                }
            }
        }
    }
    fail_with(&problems, "broken relative links in the README and docs/");
}

#[test]
fn every_flag_and_variable_the_operators_pages_name_exists() {
    let (flags, names) = known_settings();
    let mut problems = Vec::new();
    for path in SETTING_PAGES {
        let page = Page::read(path);
        for (number, line, _) in page.lines() {
            for (_, name) in variables(line) {
                // `STATEHOUSE_*` and the like name a family, not one variable.
                let known = if name.ends_with('_') {
                    names.iter().any(|known| known.starts_with(name))
                } else {
                    names.contains(name)
                };
                if !known {
                    problems.push(format!("{path}:{number}: {name} is read by nothing"));
                }
            }
        }
        for (number, piece) in pieces(&page) {
            for flag in statehouse_flags(&piece) {
                if !flags.contains(flag) {
                    problems.push(format!(
                        "{path}:{number}: --{flag} is no flag of statehouse (another program's? \
                         add it to OTHER_PROGRAMS)"
                    ));
                }
            }
        }
    }
    fail_with(
        &problems,
        "the operators' pages name settings that do not exist (fix the name, or drop it)",
    );
}

#[test]
fn src_paths_and_links_are_found_where_they_are() {
    assert_eq!(
        src_paths("`src/locks/mod.rs`, src/http/ and src/lib.rs. Not shim/src/x.rs"),
        ["src/locks/mod.rs", "src/http/", "src/lib.rs"]
    );
    assert_eq!(
        link_targets("see [Locks](locks.md#locks) and [TLS](#tls)"),
        ["locks.md#locks", "#tls"]
    );
    assert_eq!(
        slug("Limits: overload, slow clients, memory"),
        "limits-overload-slow-clients-memory"
    );
    assert_eq!(slug("`statehouse lock`"), "statehouse-lock");
}

#[test]
fn flags_and_variables_are_found_where_they_are() {
    assert_eq!(
        statehouse_flags("STATEHOUSE_URL=x statehouse lock --owner me id -- meltano run --force"),
        ["owner"]
    );
    assert_eq!(
        statehouse_flags("kubectl create secret generic statehouse --from-file=tokens=./tokens"),
        Vec::<&str>::new()
    );
    assert_eq!(
        statehouse_flags("lease=$(curl -s -X POST x) ; statehouse serve --listen=0.0.0.0:8080"),
        ["listen"]
    );
    assert_eq!(
        statehouse_flags(" with --tls-cert-file (and --tls-key-file)"),
        ["tls-cert-file", "tls-key-file"]
    );
    let names: Vec<&str> =
        variables("MELTANO_STATE_BACKEND_STATEHOUSE_TOKEN, $STATEHOUSE_TOKEN and `STATEHOUSE_*`")
            .into_iter()
            .map(|(_, name)| name)
            .collect();
    assert_eq!(names, ["STATEHOUSE_TOKEN", "STATEHOUSE_"]);
    assert_eq!(
        long_flags(
            "#[arg(long, env = \"X\")]\n    /// why\n    pub max_lock_delay: u32,\n#[arg(long = \"ttl\")]\n    pub t: u32,"
        ),
        ["max-lock-delay", "ttl"]
    );
}
