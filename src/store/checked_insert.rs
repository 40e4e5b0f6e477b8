//! The INSERT of a batch of changes that checks, in the same statement, the
//! stored version each change was decided against: if any checked id's
//! state row is no longer the one read (another writer, such as the
//! ClickHouse plugin, wrote it meanwhile), ClickHouse refuses the whole
//! INSERT and nothing of it lands (`StoreError::Stale`). It costs no round
//! trip of its own: the check is a scalar subquery of the INSERT's SELECT.
//!
//! The rows are in the statement's text, each escaped by the clickhouse
//! crate's binding, since an `INSERT ... SELECT` cannot take them in a
//! data body as a plain INSERT does.

use std::fmt::Write;

use serde::Serialize;

use super::client::ClickHouse;
use super::error::StoreError;
use crate::domain::StateId;

/// What a change was decided against: `id`'s stored version (its
/// `updated_at` in milliseconds), or None when it had no row.
#[derive(Clone, Copy, Debug)]
pub struct Expected<'a> {
    pub id: &'a StateId,
    pub version_ms: Option<i64>,
}

/// The text of ClickHouse's refusal (`throwIf`, code 395) that tells a
/// stale check apart from every other failure.
const STALE: &str = "statehouse: a checked state changed since it was read";

/// An `INSERT INTO table (columns) SELECT select FROM values(structure, rows)`:
/// the rows as `structure` types them, `select` making the table's columns
/// of them.
pub(super) struct CheckedInsert<'a> {
    pub table: &'a str,
    pub columns: &'static str,
    pub structure: &'static str,
    pub select: &'static str,
    /// The state table whose rows are checked.
    pub state_table: &'a str,
}

impl CheckedInsert<'_> {
    /// Inserts `rows` (each a tuple in the order of `structure`) if every
    /// id of `expected` still has the version it names (or still has no
    /// row), in one statement timed as `operation`.
    pub async fn run<R: Serialize>(
        &self,
        ch: &ClickHouse,
        operation: &'static str,
        rows: &[R],
        expected: &[Expected<'_>],
    ) -> Result<(), StoreError> {
        let placeholders = vec!["?"; rows.len()].join(", ");
        // The newest version of each checked id: with FINAL's choice of row
        // (the highest `updated_at`) without FINAL's merge. Ids with no row
        // are absent, so a row written meanwhile shows as a difference. One
        // id (a lone writer's batch) is compared as a scalar, measured a
        // millisecond cheaper than the array.
        let changed = match expected {
            [
                Expected {
                    version_ms: Some(_),
                    ..
                },
            ] => format!(
                "(SELECT max(toUnixTimestamp64Milli(updated_at)) FROM {} WHERE state_id = ?) != ?",
                self.state_table
            ),
            [
                Expected {
                    version_ms: None, ..
                },
            ] => format!(
                "(SELECT count() FROM {} WHERE state_id = ?) != 0",
                self.state_table
            ),
            _ => format!(
                "(SELECT arraySort(groupArray((state_id, toUnixTimestamp64Milli(updated_at))))
                  FROM (SELECT state_id, max(updated_at) AS updated_at FROM {}
                        WHERE state_id IN ? GROUP BY state_id))
                 != arraySort(CAST(?, 'Array(Tuple(String, Int64))'))",
                self.state_table
            ),
        };
        let sql = format!(
            "INSERT INTO {table} ({columns}) SELECT {select}
             FROM values('{structure}', {placeholders})
             WHERE throwIf({changed}, '{STALE}') = 0",
            table = self.table,
            columns = self.columns,
            select = self.select,
            structure = self.structure,
        );
        let mut query = ch.latest_read(&sql);
        for row in rows {
            query = query.bind(row);
        }
        let query = match expected {
            [one] => {
                let query = query.bind(one.id.as_str());
                match one.version_ms {
                    Some(ms) => query.bind(ms),
                    None => query,
                }
            }
            _ => {
                let ids: Vec<&str> = expected.iter().map(|e| e.id.as_str()).collect();
                let stored: Vec<(&str, i64)> = expected
                    .iter()
                    .filter_map(|e| e.version_ms.map(|ms| (e.id.as_str(), ms)))
                    .collect();
                query.bind(ids).bind(stored)
            }
        };
        // The documents are in the text: ClickHouse must parse more than
        // its default 256 KiB (the body limit bounds them).
        let mut length = Length(0);
        write!(length, "{}", query.sql_display()).expect("counting never fails");
        let query = query.with_setting("max_query_size", (length.0 + 1024).to_string());
        match ch.timed(operation, query.execute()).await {
            Err(StoreError::ClickHouse(clickhouse::error::Error::BadResponse(text)))
                if is_stale(&text) =>
            {
                Err(StoreError::Stale)
            }
            other => other,
        }
    }
}

/// Whether ClickHouse's answer is the check's refusal (`throwIf` is code
/// 395, with the check's own message).
fn is_stale(text: &str) -> bool {
    text.contains("Code: 395.") && text.contains(STALE)
}

/// Counts the bytes written to it.
struct Length(usize);

impl Write for Length {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        self.0 += s.len();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_checks_own_refusal_is_stale() {
        let refused = format!(
            "Code: 395. DB::Exception: {STALE}: while executing 'FUNCTION throwIf(...)'. \
             (FUNCTION_THROW_IF_VALUE_IS_NON_ZERO)"
        );
        assert!(is_stale(&refused));
        assert!(!is_stale(
            "Code: 395. DB::Exception: Value passed to 'throwIf' function is non-zero"
        ));
        assert!(!is_stale(&format!(
            "Code: 62. DB::Exception: Syntax error near '{STALE}'"
        )));
    }
}
