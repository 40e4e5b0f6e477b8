//! The README and `docs/` stay true to the repository, for all later work
//! too: the README is a short front door that starts with the two commands,
//! the rest lives in at least three pages under `docs/`, every `src/` path
//! they name exists, the code map in `docs/development.md` names every module
//! file, and every relative link leads to a file (and heading) that exists.
//! Only files are read: no gateway, no ClickHouse.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
const README_MAX_LINES: usize = 250;
const CODE_MAP: &str = "## Code map";

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
