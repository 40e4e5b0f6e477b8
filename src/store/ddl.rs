//! Where the gateway's tables are created, and so which DDL they take: on one
//! node, plain engines; with `--cluster`, `ON CLUSTER` and the Replicated form
//! of each MergeTree engine; in a database whose engine is `Replicated` (as on
//! ClickHouse Cloud), Replicated engines without `ON CLUSTER`, which such a
//! database refuses because it replicates its DDL itself.

/// A `--cluster` name: spliced into DDL as a quoted literal, so it may hold
/// what cluster names and macros do (`prod-1`, `{cluster}`) and nothing else.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterName(String);

/// A name that cannot be a cluster's.
#[derive(Debug, thiserror::Error)]
#[error("{0:?} is not a cluster name")]
pub struct InvalidClusterName(pub String);

impl ClusterName {
    pub fn parse(raw: &str) -> Result<Self, InvalidClusterName> {
        let valid = !raw.is_empty()
            && raw.len() <= 128
            && raw
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "_-.{}".contains(c));
        if valid {
            Ok(Self(raw.to_owned()))
        } else {
            Err(InvalidClusterName(raw.to_owned()))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// How the tables of one database are placed: the cluster option and the
/// database's engine (`system.databases.engine`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    cluster: Option<ClusterName>,
    replicated_database: bool,
}

impl Placement {
    pub fn new(cluster: Option<ClusterName>, database_engine: &str) -> Self {
        Self {
            cluster,
            replicated_database: database_engine == "Replicated",
        }
    }

    /// ` ON CLUSTER 'name'` to follow a table's name in CREATE and ALTER, or nothing.
    pub fn on_cluster(&self) -> String {
        match &self.cluster {
            Some(cluster) if !self.replicated_database => {
                format!(" ON CLUSTER '{}'", cluster.as_str())
            }
            _ => String::new(),
        }
    }

    /// `family(args)` as the engine to create: `ReplicatedReplacingMergeTree(version)`
    /// when the tables are replicated. The Replicated form takes no path and
    /// replica: the server's `default_replica_path` and `default_replica_name`
    /// (`/clickhouse/tables/{uuid}/{shard}`, `{replica}`) apply, as ClickHouse
    /// Cloud and Replicated databases require.
    pub fn merge_tree(&self, family: &str, args: &str) -> String {
        let prefix = if self.replicated() { "Replicated" } else { "" };
        format!("{prefix}{family}({args})")
    }

    /// Whether MergeTree tables have replicas, whose reads can lag writes.
    pub fn replicated(&self) -> bool {
        self.cluster.is_some() || self.replicated_database
    }
}

/// `CREATE DATABASE` with a `?` for the name, placed as the server's
/// databases are (see `Store::ensure_schema`).
/// A TTL that keeps a row for `retention` after `expr` (None: forever), in
/// whole seconds and at least one: a TTL of 0 would drop every row.
pub(super) fn retention_ttl(expr: &str, retention: Option<std::time::Duration>) -> Option<String> {
    retention.map(|r| format!("TTL {expr} + toIntervalSecond({})", r.as_secs().max(1)))
}

/// The ALTER that brings `table`, whose engine is `engine_full`, to `ttl`
/// (see [`retention_ttl`]), if it needs one.
pub(super) fn retention_alter(
    table: &str,
    ttl: Option<String>,
    engine_full: &str,
    placement: &Placement,
) -> Option<String> {
    let alter = match ttl {
        Some(ttl) if !engine_full.contains(ttl.as_str()) => format!("MODIFY {ttl}"),
        None if engine_full.contains(" TTL ") => "REMOVE TTL".to_owned(),
        _ => return None,
    };
    Some(format!(
        "ALTER TABLE {table}{} {alter}",
        placement.on_cluster()
    ))
}

pub(super) fn create_database_sql(placement: &Placement) -> String {
    format!("CREATE DATABASE IF NOT EXISTS ?{}", placement.on_cluster())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one_node() -> Placement {
        Placement::new(None, "Atomic")
    }

    fn cluster() -> Placement {
        Placement::new(Some(ClusterName::parse("prod-1").unwrap()), "Atomic")
    }

    fn replicated_database() -> Placement {
        Placement::new(Some(ClusterName::parse("default").unwrap()), "Replicated")
    }

    #[test]
    fn a_replicated_database_takes_replicated_engines_without_on_cluster() {
        assert_eq!(replicated_database().on_cluster(), "");
        assert_eq!(
            replicated_database().merge_tree("MergeTree", ""),
            "ReplicatedMergeTree()"
        );
        assert_eq!(
            Placement::new(None, "Replicated").merge_tree("ReplacingMergeTree", "v"),
            "ReplicatedReplacingMergeTree(v)"
        );
    }

    #[test]
    fn a_cluster_takes_on_cluster_and_replicated_engines() {
        assert_eq!(cluster().on_cluster(), " ON CLUSTER 'prod-1'");
        assert_eq!(
            cluster().merge_tree("ReplacingMergeTree", "version"),
            "ReplicatedReplacingMergeTree(version)"
        );
        assert_eq!(one_node().on_cluster(), "");
        assert_eq!(one_node().merge_tree("MergeTree", ""), "MergeTree()");
        assert!(!one_node().replicated());
    }

    #[test]
    fn a_database_is_created_on_the_cluster_unless_databases_replicate_themselves() {
        assert_eq!(
            create_database_sql(&one_node()),
            "CREATE DATABASE IF NOT EXISTS ?"
        );
        assert_eq!(
            create_database_sql(&cluster()),
            "CREATE DATABASE IF NOT EXISTS ? ON CLUSTER 'prod-1'"
        );
        assert_eq!(
            create_database_sql(&replicated_database()),
            "CREATE DATABASE IF NOT EXISTS ?"
        );
    }

    #[test]
    fn cluster_names_are_names_or_macros_only() {
        for good in ["default", "prod-1", "{cluster}", "a.b_c"] {
            assert!(ClusterName::parse(good).is_ok(), "{good}");
        }
        for bad in ["", "a'b", "a b", "x;DROP", "`x`"] {
            assert!(ClusterName::parse(bad).is_err(), "{bad}");
        }
    }
}
