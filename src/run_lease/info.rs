//! What the runner tells the gateway of itself with its lease (`info`): the
//! host, its pid and the command it runs, plus any `--info KEY=VALUE`, so
//! that an operator looking at the lock sees what holds it.

use std::ffi::OsString;

use serde_json::{Map, Value};

/// The most of the command line `info` carries: enough to tell runs apart,
/// well within the gateway's 4 KiB for all of `info`.
pub const MAX_COMMAND_BYTES: usize = 256;

/// An `--info KEY=VALUE`: the key must not be empty; the value may be.
pub fn parse_pair(raw: &str) -> Result<(String, String), String> {
    match raw.split_once('=') {
        Some((key, value)) if !key.is_empty() => Ok((key.to_owned(), value.to_owned())),
        _ => Err("expected KEY=VALUE with a non-empty KEY".to_owned()),
    }
}

/// The lease's `info`: host, pid and command, then the `--info` pairs in
/// their order (a pair may replace one of the three).
pub fn lease_info(command: &[OsString], pairs: &[(String, String)]) -> Value {
    let mut info = Map::new();
    info.insert("host".into(), hostname().into());
    info.insert("pid".into(), std::process::id().into());
    info.insert("command".into(), command_line(command).into());
    for (key, value) in pairs {
        info.insert(key.clone(), value.clone().into());
    }
    Value::Object(info)
}

/// The command line joined with spaces, cut to [`MAX_COMMAND_BYTES`] at a
/// character boundary.
fn command_line(command: &[OsString]) -> String {
    let joined = command
        .iter()
        .map(|arg| arg.to_string_lossy())
        .collect::<Vec<_>>()
        .join(" ");
    let mut end = joined.len().min(MAX_COMMAND_BYTES);
    while !joined.is_char_boundary(end) {
        end -= 1;
    }
    joined[..end].to_owned()
}

/// This host's name, or `localhost` when it has none.
pub fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname(2) writes at most the length it is given.
    let ok = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } == 0;
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    if ok && end > 0 {
        String::from_utf8_lossy(&buf[..end]).into_owned()
    } else {
        "localhost".to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<OsString> {
        list.iter().map(OsString::from).collect()
    }

    #[test]
    fn info_names_the_host_the_pid_and_the_command() {
        let info = lease_info(&args(&["meltano", "run", "tap", "target"]), &[]);
        assert_eq!(info["host"], hostname());
        assert_eq!(info["pid"], std::process::id());
        assert_eq!(info["command"], "meltano run tap target");
        assert_eq!(info.as_object().unwrap().len(), 3);
    }

    #[test]
    fn pairs_are_added_in_order_and_may_replace_the_defaults() {
        let pairs = [
            ("dag".to_owned(), "nightly".to_owned()),
            ("host".to_owned(), "pod-7".to_owned()),
            ("empty".to_owned(), String::new()),
        ];
        let info = lease_info(&args(&["true"]), &pairs);
        assert_eq!(info["dag"], "nightly");
        assert_eq!(info["host"], "pod-7");
        assert_eq!(info["empty"], "");
    }

    #[test]
    fn the_command_is_cut_to_256_bytes_at_a_character_boundary() {
        let long = "é".repeat(200);
        let line = command_line(&args(&["echo", &long]));
        // "echo " is 5 bytes, then 2-byte characters: 255 fits, 256 would split one.
        assert_eq!(line.len(), 255);
        assert!(line.starts_with("echo éé"));
        assert_eq!(command_line(&args(&["a", "b"])), "a b");
    }

    #[test]
    fn a_pair_needs_a_key_and_an_equals_sign() {
        assert_eq!(parse_pair("k=v=w"), Ok(("k".into(), "v=w".into())));
        assert_eq!(parse_pair("k="), Ok(("k".into(), String::new())));
        assert!(parse_pair("=v").is_err());
        assert!(parse_pair("kv").is_err());
    }
}
