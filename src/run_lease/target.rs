//! What one lease of a run is on: the lock of a state_id, or slots of a
//! pool. Both take the same requests, at their own paths; a pool's acquire
//! also names its limit, which every run of the pool must agree on, the
//! slots the run takes, and its priority in the pool's line.

use std::fmt;

use crate::client::path_segment as segment;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// The lock of a state_id: one holder at a time.
    State(String),
    /// `slots` of a pool of `limit` slots, waiting at `priority`.
    Pool {
        name: String,
        limit: u16,
        slots: u16,
        priority: i16,
    },
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

    /// What an acquire of it says besides the lease: a pool's limit, slots
    /// and priority; nothing for a state_id.
    pub fn acquire_fields(&self) -> Option<serde_json::Value> {
        match self {
            Self::State(_) => None,
            Self::Pool {
                limit,
                slots,
                priority,
                ..
            } => Some(serde_json::json!({
                "limit": limit, "slots": slots, "priority": priority,
            })),
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
            slots: 1,
            priority: -3,
        };
        assert_eq!(pool.path(), "/v1/pools/source%20db");
        assert_eq!(pool.lease_path("l-2"), "/v1/pools/source%20db/l-2");
        assert_eq!(pool.to_string(), "pool source db");
        assert_eq!(state.acquire_fields(), None);
        assert_eq!(
            pool.acquire_fields(),
            Some(serde_json::json!({"limit": 2, "slots": 1, "priority": -3}))
        );
    }
}
