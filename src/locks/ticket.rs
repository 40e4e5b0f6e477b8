//! Tickets: the authority's admission of writes that another gateway sends
//! to ClickHouse (a bulk import's entries, which may belong to several
//! authorities and go out in one INSERT). The sending gateway asks each
//! authority for a ticket before its INSERT; the authority admits the
//! entries by its own lock rule and registers them as sending, exactly as
//! its own writes are (`write`), so no lease on their ids is granted until
//! the ticket is settled: the sender reports the INSERT's outcome, or the
//! ticket's budget, and ClickHouse's `max_execution_time` after it, pass.
//! A sender that dies or hangs up holds the ids no longer than that.
//!
//! This file is the protocol and the sender's side; the authority's
//! registry of issued tickets is `issued`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{HeaderValue, Method, Request, StatusCode, header};
use http_body_util::BodyExt;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::error::LockError;
use super::forward::{PeerClient, Router};
use super::peer::Peer;
use crate::domain::{Lease, LeaseInfo, StateId};

/// Where a ticket is asked for, and settled (`/{ticket}`).
pub const TICKETS_PATH: &str = "/v1/internal/tickets";

/// How long asking for, or settling, a ticket may take: the authority
/// answers from memory.
const TICKET_DEADLINE: Duration = Duration::from_secs(5);

/// What a ticket is asked for: writes, each to a state_id with the lease it
/// carries, if any.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TicketRequest {
    pub writes: Vec<TicketWrite>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TicketWrite {
    pub state_id: String,
    pub lease_id: Option<Uuid>,
}

/// A ticket issued: its id, how long its writes may take from now, and
/// the lease each write was admitted under (for its history version).
#[derive(Serialize, Deserialize)]
pub struct TicketGrant {
    pub ticket: Uuid,
    pub budget_ms: u64,
    pub leases: Vec<Option<TicketLease>>,
}

#[derive(Serialize, Deserialize)]
pub struct TicketLease {
    pub owner: String,
    pub fencing_token: u64,
}

/// A ticket held by the gateway sending the writes. Dropped, it settles
/// itself in the background: known unless the send left the outcome
/// unknown.
pub struct RemoteTicket {
    peer: Peer,
    ticket: Uuid,
    /// The ticket's budget, counted from when it was asked for: never past
    /// the authority's, which counts from when it was issued.
    until: Instant,
    client: PeerClient,
    me: Uuid,
    authorization: Option<HeaderValue>,
    unknown: AtomicBool,
}

impl RemoteTicket {
    pub(super) fn until(&self) -> Instant {
        self.until
    }

    /// The write went out and its outcome is unknown (a timeout, a drop).
    pub(super) fn mark_unknown(&self) {
        self.unknown.store(true, Ordering::Relaxed);
    }
}

impl Drop for RemoteTicket {
    fn drop(&mut self) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let outcome = if self.unknown.load(Ordering::Relaxed) {
            "unknown"
        } else {
            "known"
        };
        let uri = format!("{TICKETS_PATH}/{}?outcome={outcome}", self.ticket);
        let mut request = Request::builder().method(Method::DELETE).uri(uri);
        if let Some(authorization) = &self.authorization {
            request = request.header(header::AUTHORIZATION, authorization);
        }
        let request = request.body(Body::empty()).expect("a valid request");
        let (client, me, peer) = (self.client.clone(), self.me, self.peer.clone());
        runtime.spawn(async move {
            match client.send(me, &peer, request, TICKET_DEADLINE).await {
                Ok(response) if response.status().is_success() => {}
                // The authority drops the ticket at the end of its budget.
                Ok(response) => {
                    tracing::warn!(gateway_id = %peer.gateway_id, status = %response.status(), "a ticket's settlement was refused");
                }
                Err(err) => tracing::warn!(error = %err, "could not settle a ticket"),
            }
        });
    }
}

/// Asks `peer`, the authority of the ids of `writes`, for a ticket.
/// Answers it with the lease each write was admitted under, or the index
/// of the first write refused.
pub(super) async fn request_ticket(
    router: &Router,
    peer: &Peer,
    writes: &[(&StateId, Option<Uuid>)],
    authorization: Option<&HeaderValue>,
) -> Result<(Arc<RemoteTicket>, Vec<Option<Lease>>), (usize, LockError)> {
    let moving = |index: usize| (index, LockError::Moving(writes[index].0.clone()));
    let body = TicketRequest {
        writes: writes
            .iter()
            .map(|(id, lease_id)| TicketWrite {
                state_id: id.as_str().to_owned(),
                lease_id: *lease_id,
            })
            .collect(),
    };
    let mut request = Request::builder()
        .method(Method::POST)
        .uri(TICKETS_PATH)
        .header(header::CONTENT_TYPE, "application/json");
    if let Some(authorization) = authorization {
        request = request.header(header::AUTHORIZATION, authorization);
    }
    let body = serde_json::to_vec(&body).expect("a ticket request serializes");
    let request = request.body(Body::from(body)).expect("a valid request");
    let asked = Instant::now();
    let response = router
        .forward(peer, request, TICKET_DEADLINE, TICKET_DEADLINE)
        .await
        .map_err(|err| {
            tracing::warn!(error = %err, "could not ask the authority for a ticket");
            moving(0)
        })?;
    let status = response.status();
    let bytes = response
        .into_body()
        .collect()
        .await
        .map_err(|_| moving(0))?
        .to_bytes();
    if status != StatusCode::CREATED {
        return Err(refusal(&bytes, writes));
    }
    let grant: TicketGrant = serde_json::from_slice(&bytes).map_err(|_| moving(0))?;
    let leases = writes
        .iter()
        .zip(&grant.leases)
        .map(|((id, lease_id), lease)| {
            Some(Lease {
                state_id: (*id).clone(),
                lease_id: (*lease_id)?,
                owner: lease.as_ref()?.owner.clone(),
                fencing_token: lease.as_ref()?.fencing_token,
                gateway_id: peer.gateway_id,
                acquired_ms: 0,
                expires_ms: 0,
                lock_delay: Duration::ZERO,
                info: LeaseInfo::default(),
                limit: 1,
                slots: 1,
            })
        })
        .collect();
    let (client, me) = router.client();
    let ticket = RemoteTicket {
        peer: peer.clone(),
        ticket: grant.ticket,
        until: asked + Duration::from_millis(grant.budget_ms),
        client,
        me,
        authorization: authorization.cloned(),
        unknown: AtomicBool::new(false),
    };
    Ok((Arc::new(ticket), leases))
}

/// The authority's refusal of a ticket as this gateway tells it: the entry
/// its problem names (`entry N (state_id ...)`), refused as not current
/// when it carried a lease, else as moving (retry).
fn refusal(problem: &[u8], writes: &[(&StateId, Option<Uuid>)]) -> (usize, LockError) {
    #[derive(Deserialize)]
    struct Problem {
        #[serde(rename = "type")]
        kind: String,
        detail: String,
    }
    let Ok(problem) = serde_json::from_slice::<Problem>(problem) else {
        return (0, LockError::Moving(writes[0].0.clone()));
    };
    let index = problem
        .detail
        .strip_prefix("entry ")
        .and_then(|rest| rest.split_once(' '))
        .and_then(|(n, _)| n.parse::<usize>().ok())
        .filter(|n| *n < writes.len())
        .unwrap_or(0);
    let (id, lease_id) = writes[index];
    let err = match lease_id {
        Some(lease_id) if problem.kind.ends_with(":lease-not-current") => {
            LockError::NotCurrent(lease_id)
        }
        _ if problem.kind.ends_with(":state-locked") => LockError::LockedElsewhere(id.clone()),
        _ => LockError::Moving(id.clone()),
    };
    (index, err)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(name: &str) -> StateId {
        StateId::parse(name.to_owned()).unwrap()
    }

    #[test]
    fn a_refusal_names_the_entry_the_authority_named() {
        let (a, b) = (id("a"), id("b"));
        let lease = Uuid::from_u128(7);
        let writes = [(&a, None), (&b, Some(lease))];
        let problem = serde_json::json!({
            "type": "urn:statehouse:problem:lease-not-current",
            "detail": "entry 1 (state_id \"b\"): lease ... is not the current lease",
        });
        let (index, err) = refusal(problem.to_string().as_bytes(), &writes);
        assert_eq!(index, 1);
        assert!(matches!(err, LockError::NotCurrent(l) if l == lease));
    }

    #[test]
    fn an_unleased_write_refused_for_a_lock_is_locked_anything_else_moving() {
        let a = id("a");
        let writes = [(&a, None)];
        let locked = serde_json::json!({
            "type": "urn:statehouse:problem:state-locked",
            "detail": "entry 0 (state_id \"a\"): a is locked",
        });
        let (_, err) = refusal(locked.to_string().as_bytes(), &writes);
        assert!(matches!(err, LockError::LockedElsewhere(_)));
        let (index, err) = refusal(b"not a problem", &writes);
        assert_eq!(index, 0);
        assert!(matches!(err, LockError::Moving(_)));
    }
}
