//! The withdraw-on-drop guard both claim protocols keep over a claim
//! attempt, so that an abandoned attempt leaves no claim behind.

use super::protocol::ClaimProtocol;
use crate::domain::StateId;
use crate::store::Candidate;

/// A claim on its way (a candidate row proposed, a key written), or won and
/// not yet handed to the caller. Dropped before it is settled (its future
/// abandoned, its request failed, or the renewal or read after a win
/// failed), the claim may be ours all the same: it is withdrawn in the
/// background, so that no claim is left that nobody renews or uses and
/// other gateways wait out its whole TTL.
pub(super) struct Withdrawing<'a> {
    /// The protocol the claim was made in, which withdraws it.
    pub protocol: &'a dyn ClaimProtocol,
    /// The id claimed.
    pub id: &'a StateId,
    /// The claim, as far as this gateway knows it.
    pub candidate: Candidate,
    /// Whether the attempt decided the claim's fate itself.
    settled: bool,
}

impl<'a> Withdrawing<'a> {
    /// Guards `candidate`, a claim on `id` about to be written.
    pub fn new(protocol: &'a dyn ClaimProtocol, id: &'a StateId, candidate: Candidate) -> Self {
        Self {
            protocol,
            id,
            candidate,
            settled: false,
        }
    }

    /// The claim is surely not ours (the attempt decided its fate itself),
    /// or it is handed to the caller, which holds it from now on.
    pub fn settle(&mut self) {
        self.settled = true;
    }
}

impl Drop for Withdrawing<'_> {
    fn drop(&mut self) {
        if !self.settled {
            self.protocol
                .withdraw_in_background(self.id.clone(), self.candidate.clone());
        }
    }
}
