use uuid::Uuid;

use super::StateId;

/// A granted lease: who may write a state_id, until when, under which fencing token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    pub state_id: StateId,
    pub lease_id: Uuid,
    pub owner: String,
    /// Strictly increases per state_id across gateways and restarts.
    pub fencing_token: u64,
    /// The gateway that granted it, and the only one that renews or releases it.
    pub gateway_id: Uuid,
    pub acquired_ms: i64,
    pub expires_ms: i64,
}
