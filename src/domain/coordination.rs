//! How gateways that share tables agree on who holds a state_id's claim.

/// The claim protocol, chosen with `--coordination`; every gateway on one
/// set of tables must use the same.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Coordination {
    /// Claim candidates in the lease table, the earliest after a settle wins:
    /// correct while every gateway reaches one ClickHouse node.
    Table,
    /// Claims in KeeperMap, linearizable on any topology; needs the server's
    /// Keeper and `keeper_map_path_prefix`.
    Keeper,
}

impl Coordination {
    /// The flag's value, as the gateways table records it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Table => "table",
            Self::Keeper => "keeper",
        }
    }

    pub fn parse(raw: &str) -> Option<Self> {
        match raw {
            "table" => Some(Self::Table),
            "keeper" => Some(Self::Keeper),
            _ => None,
        }
    }
}
