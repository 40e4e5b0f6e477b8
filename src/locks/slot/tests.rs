//! The slot's transitions, pure state in and a decision out, no I/O: the
//! line, grants, hand-overs, lapses and writes that may still land.

use super::fixtures::{GATEWAY, claim, line, rules, state_id, waiter};
use super::*;

fn id() -> StateId {
    state_id("dev:tap-to-target")
}

/// A slot holding a fresh claim with tokens to grant, and these waiters in line.
fn claimed(now: Instant, tickets: &[u64]) -> SlotState {
    SlotState {
        claim: Some(claim(Uuid::from_u128(1), now + Duration::from_secs(9))),
        tokens: TokenBlock { next: 5, last: 9 },
        queue: line(tickets),
        next_ticket: tickets.len() as u64,
        ..SlotState::default()
    }
}

fn decide(st: &mut SlotState, waiter: &Waiter<'_>, now: Instant) -> Decision {
    st.expire(&id(), now, &Metrics::default());
    st.next_step(&id(), waiter, &rules(), now, 1_000).out
}

#[test]
fn the_first_in_line_is_granted_the_next_token() {
    let now = Instant::now();
    let mut st = claimed(now, &[0, 1]);
    let decision = decide(&mut st, &waiter(0, now), now);
    let Step::Granted(lease, _) = decision.step else {
        panic!("not granted: {:?}", decision.step)
    };
    assert_eq!(lease.fencing_token, 5);
    assert_eq!(lease.expires_ms, 31_000);
    assert_eq!(st.tokens.next, 6);
    // The second waits for the lease to end, or for its own deadline.
    let later = now + Duration::from_secs(60);
    assert_eq!(
        decide(&mut st, &waiter(1, later), now).step,
        Step::Wait(now + Duration::from_secs(30))
    );
}

#[test]
fn a_lease_ends_for_the_next_grant_only_once_its_writes_have_landed() {
    let now = Instant::now();
    let mut st = claimed(now, &[1]);
    // The lease ended (released); a write sent under it may land for 3 s.
    st.sending.insert(0, now + Duration::from_secs(3));
    let deadline = now + Duration::from_secs(60);
    assert_eq!(
        decide(&mut st, &waiter(1, deadline), now).step,
        Step::Wait(now + Duration::from_secs(3)),
        "no grant while the write may land"
    );
    // The write answered: its entry goes, and the waiter is granted.
    st.sending.remove(&0);
    assert!(matches!(
        decide(&mut st, &waiter(1, deadline), now).step,
        Step::Granted(..)
    ));
}

#[test]
fn a_write_abandoned_in_flight_holds_the_id_until_its_budget_is_spent() {
    let now = Instant::now();
    let mut st = claimed(now, &[1]);
    st.sending.insert(0, now + Duration::from_secs(3));
    let deadline = now + Duration::from_secs(60);
    let later = now + Duration::from_secs(3);
    assert!(matches!(
        decide(&mut st, &waiter(1, deadline), later).step,
        Step::Granted(..)
    ));
    assert!(st.sending.is_empty());
}

#[test]
fn no_hand_over_while_a_write_may_land() {
    let now = Instant::now();
    let mut st = claimed(now, &[]);
    st.sending.insert(0, now + Duration::from_secs(1));
    assert!(!st.claim_can_go());
    assert!(!st.is_idle());
    st.sending.clear();
    assert!(st.claim_can_go());
}

#[test]
fn a_waiter_out_of_time_behind_a_claim_attempt_waits_to_name_the_holder() {
    let now = Instant::now();
    let mut st = SlotState {
        claiming: true,
        queue: line(&[0, 1]),
        ..SlotState::default()
    };
    // Wait 0: its deadline is now, but the lease is about to exist.
    let late = waiter(1, now);
    assert_eq!(
        decide(&mut st, &late, now).step,
        Step::Wait(now + Duration::from_secs(2))
    );
    // The attempt won and granted: the 409 names the holder.
    let mut st = claimed(now, &[0, 1]);
    let Step::Granted(lease, _) = decide(&mut st, &waiter(0, now), now).step else {
        panic!("the first is granted")
    };
    assert_eq!(decide(&mut st, &late, now).step, Step::GiveUp(Some(lease)));
}

#[test]
fn past_the_grace_a_waiter_gives_up_without_a_holder_it_does_not_know() {
    let now = Instant::now();
    let mut st = SlotState {
        claiming: true,
        queue: line(&[0, 1]),
        ..SlotState::default()
    };
    let after_grace = now + Duration::from_secs(2);
    assert_eq!(
        decide(&mut st, &waiter(1, now), after_grace).step,
        Step::GiveUp(None)
    );
}

#[test]
fn a_contested_claim_is_handed_over_before_the_next_claim_attempt() {
    let now = Instant::now();
    let mut st = claimed(now, &[0]);
    st.claim.as_mut().unwrap().handover = true;
    let decision = decide(&mut st, &waiter(0, now + Duration::from_secs(5)), now);
    assert_eq!(decision.step, Step::Claim(None));
    assert_eq!(
        decision.withdraw.map(|c| c.claim_id),
        Some(Uuid::from_u128(1))
    );
    assert!(st.claim.is_none());
}

#[test]
fn a_claim_short_of_validity_is_renewed_and_a_spent_block_refilled_first() {
    let now = Instant::now();
    let mut st = claimed(now, &[0]);
    st.claim.as_mut().unwrap().valid_until = now + Duration::from_secs(4);
    let deadline = now + Duration::from_secs(5);
    assert_eq!(
        decide(&mut st, &waiter(0, deadline), now).step,
        Step::RenewClaim(Uuid::from_u128(1))
    );
    let mut st = claimed(now, &[0]);
    st.tokens = TokenBlock { next: 10, last: 9 };
    assert_eq!(
        decide(&mut st, &waiter(0, deadline), now).step,
        Step::ReserveTokens {
            claim_id: Uuid::from_u128(1),
            first: 10
        }
    );
}

#[test]
fn a_claim_that_lapses_keeps_its_lease_and_the_next_waiter_claims_once_it_ends() {
    let now = Instant::now();
    let mut st = claimed(now, &[0, 1]);
    assert!(matches!(
        decide(&mut st, &waiter(0, now), now).step,
        Step::Granted(..)
    ));
    let lapsed = now + Duration::from_secs(9);
    let deadline = lapsed + Duration::from_secs(60);
    st.queue.pop_front();
    assert_eq!(
        decide(&mut st, &waiter(1, deadline), lapsed).step,
        Step::Wait(now + Duration::from_secs(30)),
        "the kept lease holds its place until its deadline"
    );
    let ended = now + Duration::from_secs(30);
    assert_eq!(
        decide(&mut st, &waiter(1, deadline), ended).step,
        Step::Claim(None),
        "with the lease gone nothing is kept: a fresh claim"
    );
}

/// A lease granted in `st` to the first waiter, for 30 s from `now`.
fn granted(st: &mut SlotState, now: Instant) -> Lease {
    let Step::Granted(lease, _) = decide(st, &waiter(st.queue[0].ticket, now), now).step else {
        panic!("the first in line is granted")
    };
    lease
}

#[test]
fn a_claim_past_its_validity_keeps_its_lease_under_the_lapse() {
    let now = Instant::now();
    let mut st = claimed(now, &[0]);
    let lease = granted(&mut st, now);
    st.expire(&id(), now + Duration::from_secs(8), &Metrics::default());
    assert!(st.claim.is_some() && st.lapsed.is_none());
    st.expire(&id(), now + Duration::from_secs(9), &Metrics::default());
    assert!(
        st.claim.is_none(),
        "past valid_until the claim may have lapsed"
    );
    let lapsed = st
        .lapsed_claim()
        .expect("the lease is kept under the lapse");
    assert_eq!(lapsed.claim.claim_id, Uuid::from_u128(1));
    assert_eq!(lapsed.leases, [lease.lease_id]);
    assert!(st.answers_for() && !st.is_idle());
}

#[test]
fn a_claim_that_lapses_with_no_lease_is_simply_gone() {
    let now = Instant::now();
    let mut st = claimed(now, &[]);
    st.expire(&id(), now + Duration::from_secs(9), &Metrics::default());
    assert!(st.claim.is_none() && st.lapsed.is_none() && st.is_idle());
}

#[test]
fn a_lease_past_its_deadline_ends_and_the_claim_stays() {
    let now = Instant::now();
    let mut st = claimed(now, &[0]);
    let lease = granted(&mut st, now);
    assert_eq!(lease.expires_ms, 31_000);
    st.claim.as_mut().unwrap().valid_until = now + Duration::from_secs(60);
    st.expire(&id(), now + Duration::from_secs(30), &Metrics::default());
    assert!(st.leases.is_empty());
    assert!(st.claim.is_some());
    assert!(
        st.claim_can_go(),
        "an idle claim may go once its lease ended"
    );
}

#[test]
fn a_lapsed_claim_keeps_its_lease_and_lapsing_none_changes_nothing() {
    let now = Instant::now();
    let mut st = claimed(now, &[0]);
    granted(&mut st, now);
    st.lapse_claim(&id(), &Metrics::default());
    assert!(st.claim.is_none() && st.leases.len() == 1 && st.lapsed.is_some());
    let mut st = claimed(now, &[0]);
    st.lapse_claim(&id(), &Metrics::default());
    assert!(
        st.claim.is_none() && st.lapsed.is_none(),
        "with no lease, nothing is kept"
    );
    let mut st = SlotState {
        queue: line(&[3]),
        ..SlotState::default()
    };
    st.lapse_claim(&id(), &Metrics::default());
    assert_eq!(st.queue, line(&[3]));
}

#[test]
fn a_claim_with_a_running_lease_cannot_go() {
    let now = Instant::now();
    let mut st = claimed(now, &[0]);
    assert!(st.claim_can_go());
    granted(&mut st, now);
    assert!(!st.claim_can_go());
    assert!(!st.is_idle());
}

#[test]
fn a_contested_claim_is_not_handed_over_while_its_lease_runs() {
    let now = Instant::now();
    let mut st = claimed(now, &[0, 1]);
    let lease = granted(&mut st, now);
    st.claim.as_mut().unwrap().handover = true;
    st.queue.pop_front();
    let deadline = now + Duration::from_secs(60);
    let decision = decide(&mut st, &waiter(1, deadline), now);
    assert_eq!(decision.step, Step::Wait(now + Duration::from_secs(30)));
    assert!(decision.withdraw.is_none(), "the holder keeps its lease");
    assert_eq!(st.lease().map(|l| l.lease_id), Some(lease.lease_id));
}

#[test]
fn nothing_is_granted_from_a_spent_or_missing_token_block() {
    let now = Instant::now();
    let mut st = claimed(now, &[0]);
    st.tokens = TokenBlock { next: 0, last: 0 };
    assert!(
        st.grant(&id(), &waiter(0, now), GATEWAY, 1_000, now)
            .is_none()
    );
    st.tokens = TokenBlock { next: 10, last: 9 };
    assert!(
        st.grant(&id(), &waiter(0, now), GATEWAY, 1_000, now)
            .is_none()
    );
    assert!(st.leases.is_empty());
    st.tokens = TokenBlock { next: 9, last: 9 };
    let (lease, version) = st
        .grant(&id(), &waiter(0, now), GATEWAY, 1_000, now)
        .unwrap();
    assert_eq!(lease.fencing_token, 9);
    assert_eq!(version, LeaseVersion::granted(9));
    assert_eq!(st.last_used, Some(now));
}

#[test]
fn a_token_block_is_taken_only_under_the_claim_it_was_reserved_for_and_above_the_last() {
    let now = Instant::now();
    let mut st = claimed(now, &[]);
    assert!(
        !st.add_tokens(Uuid::from_u128(2), TokenBlock { next: 20, last: 29 })
            .wake
    );
    assert_eq!(
        st.tokens,
        TokenBlock { next: 5, last: 9 },
        "another claim's"
    );
    let _ = st.add_tokens(Uuid::from_u128(1), TokenBlock { next: 8, last: 17 });
    assert_eq!(st.tokens, TokenBlock { next: 5, last: 9 }, "overlaps");
    let _ = st.add_tokens(Uuid::from_u128(1), TokenBlock { next: 10, last: 19 });
    assert_eq!(st.tokens, TokenBlock { next: 10, last: 19 });
}

#[test]
fn only_the_first_in_line_claims_and_a_second_attempt_past_the_deadline_gives_up() {
    let now = Instant::now();
    let mut st = SlotState {
        queue: line(&[0, 1]),
        ..SlotState::default()
    };
    let deadline = now + Duration::from_secs(5);
    assert_eq!(
        decide(&mut st, &waiter(1, deadline), now).step,
        Step::Wait(deadline)
    );
    assert_eq!(
        decide(&mut st, &waiter(0, deadline), now).step,
        Step::Claim(None)
    );
    let mut tried = waiter(0, deadline);
    tried.attempted_claim = true;
    assert_eq!(decide(&mut st, &tried, deadline).step, Step::GiveUp(None));
}

#[test]
fn a_slot_is_idle_only_with_nothing_held_claimed_queued_or_landing() {
    let now = Instant::now();
    assert!(SlotState::default().is_idle());
    for st in [
        claimed(now, &[]),
        SlotState {
            claiming: true,
            ..SlotState::default()
        },
        SlotState {
            queue: line(&[0]),
            ..SlotState::default()
        },
        SlotState {
            sending: [(0, now)].into(),
            ..SlotState::default()
        },
    ] {
        assert!(!st.is_idle());
    }
}

/// A lease with a 4 s lock-delay granted to the first waiter, for 30 s.
fn granted_with_delay(st: &mut SlotState, now: Instant) -> Lease {
    let delayed = Waiter {
        lock_delay: Duration::from_secs(4),
        ..waiter(st.queue[0].ticket, now)
    };
    let Step::Granted(lease, _) = decide(st, &delayed, now).step else {
        panic!("the first in line is granted")
    };
    lease
}

#[test]
fn after_an_expiry_with_a_lock_delay_nothing_is_granted_until_it_ends() {
    let now = Instant::now();
    let mut st = claimed(now, &[0, 1]);
    let lease = granted_with_delay(&mut st, now);
    assert_eq!(lease.lock_delay, Duration::from_secs(4));
    st.queue.pop_front();
    // Renewed in the background meanwhile.
    st.claim.as_mut().unwrap().valid_until = now + Duration::from_secs(60);
    let expired = now + Duration::from_secs(30);
    // A waiter that cannot wait past the delay is told when it ends.
    let short = decide(
        &mut st,
        &waiter(1, expired + Duration::from_secs(1)),
        expired,
    );
    assert_eq!(short.step, Step::Delayed(31_000 + 4_000));
    assert!(st.leases.is_empty(), "no lease exists during the delay");
    assert!(!st.claim_can_go(), "the claim is held through the delay");
    // One that can wait sleeps until it ends, and is granted then.
    let long = waiter(1, expired + Duration::from_secs(10));
    assert_eq!(
        decide(&mut st, &long, expired).step,
        Step::Wait(expired + Duration::from_secs(4))
    );
    let over = expired + Duration::from_secs(4);
    assert!(matches!(
        decide(&mut st, &long, over).step,
        Step::Granted(..)
    ));
}

#[test]
fn a_force_unlock_starts_the_delay_and_a_release_does_not() {
    let now = Instant::now();
    let mut st = claimed(now, &[0, 1]);
    granted_with_delay(&mut st, now);
    st.queue.pop_front();
    let forced = now + Duration::from_secs(1);
    assert_eq!(st.end_all_by_force(forced, 2_000).len(), 1);
    assert_eq!(
        decide(&mut st, &waiter(1, forced), forced).step,
        Step::Delayed(6_000)
    );

    let mut st = claimed(now, &[0, 1]);
    granted_with_delay(&mut st, now);
    st.queue.pop_front();
    // A release takes the lease: its holder is done, so no delay.
    st.leases.clear();
    assert!(matches!(
        decide(&mut st, &waiter(1, now), now).step,
        Step::Granted(..)
    ));
}

#[test]
fn an_inherited_delay_holds_the_first_grant_and_the_later_of_two_ends_wins() {
    let now = Instant::now();
    let mut st = claimed(now, &[0]);
    let end = |secs| Delay {
        until: now + Duration::from_secs(secs),
        free_at_ms: 1_000 + 1_000 * i64::try_from(secs).unwrap(),
        slots: 1,
    };
    st.delayed = vec![end(3), end(2)];
    assert_eq!(
        decide(&mut st, &waiter(0, now), now).step,
        Step::Delayed(4_000)
    );
    st.delayed.push(end(5));
    assert_eq!(
        decide(&mut st, &waiter(0, now), now).step,
        Step::Delayed(6_000)
    );
    // Renewed in the background meanwhile.
    st.claim.as_mut().unwrap().valid_until = now + Duration::from_secs(60);
    assert!(matches!(
        decide(
            &mut st,
            &waiter(0, now + Duration::from_secs(6)),
            now + Duration::from_secs(5)
        )
        .step,
        Step::Granted(..)
    ));
}

/// A release's row is queued before a waiter wakes: a woken waiter may hand
/// the claim over, and the hand-over writes only the rows queued by then.
#[test]
fn what_a_transition_records_is_done_before_any_waiter_wakes() {
    use futures_util::FutureExt;

    let slot = Slot::default();
    let woken = slot.changed();
    tokio::pin!(woken);
    woken.as_mut().enable();
    let mut recorded = false;
    slot.apply_recording(
        |_, _| Effects::waking(()),
        |()| {
            assert!(woken.as_mut().now_or_never().is_none(), "woken first");
            recorded = true;
        },
    );
    assert!(recorded);
    assert!(woken.now_or_never().is_some(), "the waiter is woken after");
}
