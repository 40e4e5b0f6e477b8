//! Mode agreement: gateways that share tables must coordinate the same way,
//! since a table-mode claim and a keeper-mode claim on one state_id do not
//! see each other. Each gateway records itself and its mode in
//! `<table>_gateways` and keeps the record alive with a heartbeat; a gateway
//! does not start while one of the other mode is alive there.

use std::time::Duration;

use uuid::Uuid;

use crate::domain::Coordination;
use crate::store::{Blocker, GatewayStore, StoreError};

/// How long a record outlives its gateway's last heartbeat: after a crash,
/// the mode may change this long after the last gateway of the old one died.
pub const RECORD_TTL: Duration = Duration::from_secs(15);
const HEARTBEAT_EVERY: Duration = Duration::from_secs(5);

/// Why this gateway may not serve these tables.
#[derive(Debug, thiserror::Error)]
pub enum Disagreement {
    #[error(
        "{count} gateway(s) with --coordination {theirs} serve them now, and gateways on one set of tables must all use one --coordination (STATEHOUSE_COORDINATION): start this one with --coordination {theirs}, or stop those first (a stopped gateway's record clears at once, a crashed one's {ttl}s after it died) and then start every gateway with --coordination {mine}",
        ttl = RECORD_TTL.as_secs()
    )]
    OtherMode {
        count: usize,
        theirs: &'static str,
        mine: &'static str,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// This gateway's record in the gateways table.
#[derive(Clone)]
pub struct Registration {
    gateways: GatewayStore,
    gateway_id: Uuid,
    mode: Coordination,
}

impl Registration {
    /// Records this gateway, then looks for live gateways of the other mode:
    /// two gateways of different modes starting at once both see the other
    /// and both refuse, rather than both starting. None for a user that may
    /// not write: it cannot take locks either, so it has no mode to agree on.
    pub async fn join(
        gateways: GatewayStore,
        gateway_id: Uuid,
        mode: Coordination,
    ) -> Result<Option<Self>, Disagreement> {
        match gateways.heartbeat(gateway_id, mode, RECORD_TTL).await {
            Ok(()) => {}
            Err(error) if error.blocker() == Some(Blocker::Permission) => {
                tracing::warn!(%error, "this ClickHouse user may not write: the gateway serves reads only and takes part in no lock");
                return Ok(None);
            }
            Err(error) => return Err(error.into()),
        }
        let other = match mode {
            Coordination::Table => Coordination::Keeper,
            Coordination::Keeper => Coordination::Table,
        };
        let theirs = gateways.live_in(other, gateway_id).await?;
        let registration = Self {
            gateways,
            gateway_id,
            mode,
        };
        if theirs.is_empty() {
            return Ok(Some(registration));
        }
        registration.leave().await;
        Err(Disagreement::OtherMode {
            count: theirs.len(),
            theirs: other.as_str(),
            mine: mode.as_str(),
        })
    }

    /// Keeps the record alive until aborted; a failed beat is retried at the
    /// next (the record outlives two missed beats).
    pub async fn heartbeat(self) {
        loop {
            tokio::time::sleep(HEARTBEAT_EVERY).await;
            if let Err(error) = self
                .gateways
                .heartbeat(self.gateway_id, self.mode, RECORD_TTL)
                .await
            {
                tracing::warn!(%error, "gateway record not renewed; retrying");
            }
        }
    }

    /// Clears the record, so that the mode may change once every gateway has stopped.
    pub async fn leave(&self) {
        if let Err(error) = self.gateways.withdraw(self.gateway_id, self.mode).await {
            tracing::warn!(%error, "gateway record not cleared; it lapses by itself");
        }
    }
}
