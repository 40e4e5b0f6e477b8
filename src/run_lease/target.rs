//! What one lease of a run is on: the lock of a state_id, or a slot of a
//! pool. Both take the same requests, at their own paths; a pool's acquire
//! also names its limit, which every run of the pool must agree on.

use std::fmt;

use crate::client::path_segment as segment;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// The lock of a state_id: one holder at a time.
    State(String),
    /// A pool: up to `limit` holders at a time.
    Pool { name: String, limit: u16 },
}

impl Target {
    /// The path of its lease collection: `/v1/locks/{id}` or `/v1/pools/{name}`.
    pub fn path(&self) -> String {
        match self {
            Self::State(id) => format!("/v1/locks/{}", segment(id)),
            Self::Pool { name, .. } => format!("/v1/pools/{}", segment(name)),
        }
    }

    /// The path of one of its leases, for renewals and releases.
    pub fn lease_path(&self, lease_id: &str) -> String {
        format!("{}/{}", self.path(), segment(lease_id))
    }

    /// The pool's limit; a state_id has none.
    pub fn limit(&self) -> Option<u16> {
        match self {
            Self::State(_) => None,
            Self::Pool { limit, .. } => Some(*limit),
        }
    }
}

/// As the runner's messages name it: a state_id as it is (as they always
/// have), a pool as `pool NAME`.
impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::State(id) => f.write_str(id),
            Self::Pool { name, .. } => write!(f, "pool {name}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_ids_and_pool_names_are_one_path_segment() {
        assert_eq!(
            segment("dev:tap-x-to-target_y.v2~"),
            "dev%3Atap-x-to-target_y.v2~"
        );
        assert_eq!(segment("a/b c?d%"), "a%2Fb%20c%3Fd%25");
        assert_eq!(segment("é"), "%C3%A9");
        let state = Target::State("dev:a/b".into());
        assert_eq!(state.path(), "/v1/locks/dev%3Aa%2Fb");
        assert_eq!(state.lease_path("l-1"), "/v1/locks/dev%3Aa%2Fb/l-1");
        assert_eq!(state.to_string(), "dev:a/b");
        let pool = Target::Pool {
            name: "source db".into(),
            limit: 2,
        };
        assert_eq!(pool.path(), "/v1/pools/source%20db");
        assert_eq!(pool.lease_path("l-2"), "/v1/pools/source%20db/l-2");
        assert_eq!(pool.to_string(), "pool source db");
        assert_eq!((state.limit(), pool.limit()), (None, Some(2)));
    }
}
