//! The Python examples in the README and `docs/` (the Dagster and Airflow
//! sensors of docs/watching.md among them) are Python that compiles: a reader
//! who copies one gets no syntax error. Only files and `python3` are used;
//! the libraries the examples import need not be installed.

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
const FENCE: &str = "```python";

/// The ```python blocks of `text`, each with the line it starts on.
fn python_blocks(text: &str) -> Vec<(usize, String)> {
    let mut blocks = Vec::new();
    let mut open: Option<(usize, String)> = None;
    for (index, line) in text.lines().enumerate() {
        match open.take() {
            None if line.trim() == FENCE => open = Some((index + 1, String::new())),
            None => {}
            Some(block) if line.trim_start().starts_with("```") => blocks.push(block),
            Some((start, mut code)) => {
                code.push_str(line);
                code.push('\n');
                open = Some((start, code));
            }
        }
    }
    assert!(open.is_none(), "a ```python block is left open");
    blocks
}

/// Python's own verdict on `code`: None when it compiles, else its error.
fn compile_error(code: &str, name: &str) -> Option<String> {
    let mut python = Command::new("python3")
        .args([
            "-c",
            "import sys; compile(sys.stdin.read(), sys.argv[1], 'exec')",
            name,
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 runs");
    python
        .stdin
        .take()
        .unwrap()
        .write_all(code.as_bytes())
        .unwrap();
    let done = python.wait_with_output().unwrap();
    (!done.status.success()).then(|| String::from_utf8_lossy(&done.stderr).into_owned())
}

#[test]
fn the_python_examples_compile() {
    let mut pages = vec![Path::new(ROOT).join("README.md")];
    for entry in std::fs::read_dir(Path::new(ROOT).join("docs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|ext| ext == "md") {
            pages.push(path);
        }
    }
    let mut checked = 0;
    let mut failures = Vec::new();
    for page in &pages {
        let text = std::fs::read_to_string(page).unwrap();
        for (line, code) in python_blocks(&text) {
            let name = format!("{}:{line}", page.display());
            checked += 1;
            if let Some(error) = compile_error(&code, &name) {
                failures.push(format!("{name}: {error}"));
            }
        }
    }
    assert!(checked >= 3, "the sensors of docs/watching.md are checked");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn blocks_are_found_and_a_syntax_error_is_one() {
    let text = "x\n```python\nimport os\n```\n```sh\nls\n```\n```python\ndef f(:\n```\n";
    let blocks = python_blocks(text);
    assert_eq!(
        blocks,
        [(2, "import os\n".to_owned()), (8, "def f(:\n".to_owned())]
    );
    assert_eq!(compile_error(&blocks[0].1, "ok"), None);
    assert!(compile_error(&blocks[1].1, "bad").is_some_and(|e| e.contains("SyntaxError")));
}
