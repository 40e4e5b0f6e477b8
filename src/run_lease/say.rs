//! The runner's one voice: each thing it has to tell is one line on stderr,
//! named as its own, so that it stands apart from the command's output.

pub fn say(line: std::fmt::Arguments<'_>) {
    eprintln!("statehouse lock: {line}");
}
