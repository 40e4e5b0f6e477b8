//! `statehouse restore`'s lines: one per change (its action, id, versions
//! and each stream's bookmark from and to), then a summary.

use std::fmt::Write;

use serde_json::Value;

/// The lines of a restore's answer.
pub fn lines(answer: &Value) -> String {
    let mut out = String::new();
    let changes = answer["changes"].as_array().map_or(&[][..], Vec::as_slice);
    for change in changes {
        let action = text(&change["action"]);
        if action == "unchanged" {
            continue;
        }
        let _ = write!(
            out,
            "{action:<15}{}  {} -> {}",
            text(&change["state_id"]),
            version(&change["from_version"]),
            version(&change["to_version"]),
        );
        for stream in change["streams"].as_array().map_or(&[][..], Vec::as_slice) {
            let _ = write!(
                out,
                "  {}: {} -> {}",
                text(&stream["stream"]),
                bookmark(&stream["from"]),
                bookmark(&stream["to"]),
            );
        }
        out.push('\n');
    }
    let count = |name: &str| answer[name].as_u64().unwrap_or(0);
    let _ = writeln!(
        out,
        "{} {}: {} restored, {} deleted, {} unchanged, {} skipped-locked{}",
        if answer["dry_run"] == Value::Bool(true) {
            "dry run to"
        } else {
            "restored to"
        },
        text(&answer["at"]),
        count("restored"),
        count("deleted"),
        count("unchanged"),
        count("skipped_locked"),
        if answer["truncated"] == Value::Bool(true) {
            " (only the first 1000 changes listed; --json for the answer)"
        } else {
            ""
        },
    );
    out
}

fn text(value: &Value) -> &str {
    value.as_str().unwrap_or("")
}

fn version(value: &Value) -> &str {
    value.as_str().unwrap_or("none")
}

/// A bookmark as its `replication_key_value` when it has one, else as JSON.
fn bookmark(value: &Value) -> String {
    match value {
        Value::Null => "none".into(),
        other => match other.get("replication_key_value") {
            Some(Value::String(text)) => text.clone(),
            Some(key_value) => key_value.to_string(),
            None => other.to_string(),
        },
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_line_per_change_and_a_summary() {
        let answer = json!({"at": "2026-12-01T13:59:00.000Z", "dry_run": true,
        "restored": 1, "deleted": 1, "unchanged": 1, "skipped_locked": 0, "truncated": false,
        "changes": [
            {"state_id": "a", "action": "restore", "from_version": "2026-12-01T14:00:00.000Z",
             "to_version": "2026-12-01T13:00:00.000Z",
             "streams": [{"stream": "orders", "from": {"replication_key_value": 3},
                          "to": {"replication_key_value": 2}}]},
            {"state_id": "b", "action": "delete", "from_version": "2026-12-01T14:00:00.000Z",
             "to_version": null, "streams": []},
            {"state_id": "c", "action": "unchanged", "from_version": "2026-12-01T12:00:00.000Z",
             "to_version": "2026-12-01T12:00:00.000Z", "streams": []}
        ]});
        assert_eq!(
            lines(&answer),
            "restore        a  2026-12-01T14:00:00.000Z -> 2026-12-01T13:00:00.000Z  orders: 3 -> 2\n\
             delete         b  2026-12-01T14:00:00.000Z -> none\n\
             dry run to 2026-12-01T13:59:00.000Z: 1 restored, 1 deleted, 1 unchanged, 0 skipped-locked\n"
        );
    }
}
