//! The leases of an earlier authority that lost its claim while they ran
//! (it was killed or frozen), pure state in and a decision out, no I/O:
//! each keeps its place until it would have expired, and an acquire refused
//! meanwhile is told of it as the holder, not of a lock-delay, and `GET`
//! views show it as one; its own lock-delay, if it asked for one, follows
//! its expiry.

use super::fixtures::{DEAD, GATEWAY, claim, one_of, orphan, rules, state_id, waiter};
use super::*;
use crate::locks::occupancy::Occupancy;

const CLAIM: Uuid = Uuid::from_u128(1);
/// The wall clock when the claim is won, in ms since the epoch.
const WON_MS: i64 = 1_000;

fn id() -> StateId {
    state_id("dev:tap-to-target")
}

/// A claim won with `orphaned` inherited, by a waiter that joined a slot of
/// `limit` first and ran the claim attempt itself: answers its ticket, and
/// whether it was granted at once.
fn won_with(
    st: &mut SlotState,
    limit: usize,
    orphaned: Vec<LocalLease>,
    now: Instant,
) -> (u64, bool) {
    let ticket = st.join(one_of(limit)).out.unwrap();
    let won = WonClaim {
        claim: claim(CLAIM, now + Duration::from_secs(600)),
        tokens: TokenBlock { next: 40, last: 99 },
        inherited: Inherited {
            orphaned,
            ..Inherited::default()
        },
        readopted: false,
    };
    let me = waiter(ticket, now);
    let grant = Grant {
        id: &id(),
        waiter: &me,
        gateway_id: GATEWAY,
        now,
        now_ms: WON_MS,
    };
    let adopted = st.claim_won(won, grant, Duration::ZERO).out;
    assert!(
        adopted.adopted.is_empty(),
        "it is no lease of this gateway's"
    );
    (ticket, adopted.granted.is_some())
}

/// [`won_with`] a slot whose places the orphans all keep.
fn kept_out(st: &mut SlotState, limit: usize, orphaned: Vec<LocalLease>, now: Instant) -> u64 {
    let (ticket, granted) = won_with(st, limit, orphaned, now);
    assert!(!granted, "the places are kept");
    ticket
}

/// `ticket`'s next step at `now` (the wall clock as far past [`WON_MS`]),
/// having run its claim attempt and waiting until `deadline`.
fn decide(
    st: &mut SlotState,
    ticket: u64,
    deadline: Instant,
    now: Instant,
    start: Instant,
) -> Step {
    let me = Waiter {
        attempted_claim: true,
        ..waiter(ticket, deadline)
    };
    let now_ms = WON_MS + i64::try_from(now.duration_since(start).as_millis()).unwrap();
    st.expire(&id(), now, &Metrics::default());
    st.next_step(&id(), &me, &rules(), now, now_ms).out.step
}

/// The earlier authority's lease on the id: token 7, expiring 10 s after
/// the claim is won, with a 5 s lock-delay.
fn delayed_orphan(now: Instant) -> LocalLease {
    let mut lease = orphan(&id(), 7, 1, 10, now, WON_MS);
    lease.lease.lock_delay = Duration::from_secs(5);
    lease
}

#[test]
fn an_acquire_refused_before_the_orphan_would_have_expired_names_it_as_the_holder() {
    let now = Instant::now();
    let mut st = SlotState::default();
    let orphan = delayed_orphan(now);
    let holder = orphan.lease.clone();
    let ticket = kept_out(&mut st, 1, vec![orphan], now);
    assert_eq!(
        decide(&mut st, ticket, now, now, now),
        Step::GiveUp(Some(holder.clone())),
        "held, not in a lock-delay"
    );
    assert_eq!(holder.gateway_id, DEAD);
    assert!(st.lease().is_none(), "it is no current lease here");
    assert!(!st.claim_can_go() && !st.is_idle(), "the claim keeps it");
    // A waiter that can wait past its expiry, but not its lock-delay, sleeps
    // until the expiry and is then told when the lock-delay ends.
    let expiry = now + Duration::from_secs(10);
    let deadline = expiry + Duration::from_secs(1);
    assert_eq!(
        decide(&mut st, ticket, deadline, now, now),
        Step::Wait(expiry)
    );
    assert_eq!(
        decide(&mut st, ticket, deadline, expiry, now),
        Step::Delayed(WON_MS + 15_000)
    );
    assert!(st.orphaned().is_empty(), "it expired");
    // One that can wait it out is granted when the lock-delay ends.
    let free = expiry + Duration::from_secs(5);
    let Step::Granted(lease, _) = decide(&mut st, ticket, free, free, now) else {
        panic!("granted once the lock-delay ends")
    };
    assert_eq!(lease.fencing_token, 40);
}

#[test]
fn an_orphan_without_a_lock_delay_frees_its_place_at_its_expiry() {
    let now = Instant::now();
    let mut st = SlotState::default();
    let ticket = kept_out(&mut st, 1, vec![orphan(&id(), 7, 1, 10, now, WON_MS)], now);
    let expiry = now + Duration::from_secs(10);
    let deadline = now + Duration::from_secs(60);
    assert_eq!(
        decide(&mut st, ticket, deadline, now, now),
        Step::Wait(expiry),
        "asleep until it would have expired"
    );
    assert!(matches!(
        decide(&mut st, ticket, deadline, expiry, now),
        Step::Granted(..)
    ));
}

#[test]
fn a_full_pool_counts_and_names_an_earlier_authoritys_leases_as_get_shows_them() {
    let now = Instant::now();
    let mut st = SlotState::default();
    let kept = vec![
        orphan(&id(), 7, 2, 10, now, WON_MS),
        orphan(&id(), 8, 1, 4, now, WON_MS),
    ];
    let tokens: Vec<u64> = kept.iter().map(|l| l.lease.fencing_token).collect();
    let ticket = kept_out(&mut st, 3, kept, now);
    let Step::GiveUp(Some(holder)) = decide(&mut st, ticket, now, now, now) else {
        panic!("a held pool names a holder")
    };
    assert_eq!(holder.fencing_token, 8, "the first to free its place");
    let view = Occupancy::of(&id(), &st).expect("held and waited on");
    assert_eq!((view.used, view.limit, view.waiting), (3, 3, 1));
    let named: Vec<u64> = view.holders.iter().map(|l| l.fencing_token).collect();
    assert_eq!(named, tokens);
    assert!(view.holders.iter().all(|l| l.gateway_id == DEAD));
}

#[test]
fn get_shows_an_orphan_as_the_holder_until_it_would_have_expired() {
    let now = Instant::now();
    let mut st = SlotState::default();
    let orphan = delayed_orphan(now);
    let held = orphan.lease.clone();
    let ticket = kept_out(&mut st, 1, vec![orphan], now);
    assert_eq!(
        decide(&mut st, ticket, now, now, now),
        Step::GiveUp(Some(held.clone()))
    );
    let _ = st.leave(ticket);
    assert_eq!(st.holder(), Some(&held), "as the 409 named it");
    let view = Occupancy::of(&id(), &st).expect("held, nobody waiting");
    assert_eq!((view.holders, view.used, view.waiting), (vec![held], 1, 0));
    // Expired: only its lock-delay keeps the place, and no lease holds it.
    let expiry = now + Duration::from_secs(10);
    st.expire(&id(), expiry, &Metrics::default());
    assert_eq!(st.holder(), None);
    assert!(Occupancy::of(&id(), &st).is_none(), "none holds or waits");
}

#[test]
fn beside_an_orphan_a_lease_granted_here_is_named_first_and_listed_after_it() {
    let now = Instant::now();
    let mut st = SlotState::default();
    let orphan = orphan(&id(), 7, 1, 10, now, WON_MS);
    let (_, granted) = won_with(&mut st, 2, vec![orphan], now);
    assert!(granted, "one of two places is free");
    let mine = st.lease().cloned().expect("granted here");
    assert_eq!(st.holder(), Some(&mine), "the current lease");
    let view = Occupancy::of(&id(), &st).expect("held");
    let tokens: Vec<u64> = view.holders.iter().map(|l| l.fencing_token).collect();
    assert_eq!(tokens, [7, mine.fencing_token], "oldest first");
    assert_eq!(view.used, 2);
}

#[test]
fn a_force_unlock_ends_an_orphan_and_starts_its_lock_delay() {
    let now = Instant::now();
    let mut st = SlotState::default();
    let orphan = delayed_orphan(now);
    let lease_id = orphan.lease.lease_id;
    let ticket = kept_out(&mut st, 1, vec![orphan], now);
    let forced = now + Duration::from_secs(1);
    let ended = st.force_unlock(forced, WON_MS + 1_000);
    assert!(ended.wake);
    let ended: Vec<Uuid> = ended
        .out
        .unwrap()
        .iter()
        .map(|l| l.lease.lease_id)
        .collect();
    assert_eq!(ended, [lease_id], "its row is recorded as forced");
    assert_eq!(
        decide(&mut st, ticket, forced, forced, now),
        Step::Delayed(WON_MS + 6_000)
    );
}

#[test]
fn a_claim_won_again_keeps_each_orphan_once() {
    let now = Instant::now();
    let mut st = SlotState::default();
    let first = orphan(&id(), 7, 1, 10, now, WON_MS);
    let again = LocalLease {
        lease: first.lease.clone(),
        version: first.version,
        deadline: first.deadline,
    };
    let (_, granted) = won_with(&mut st, 2, vec![first], now);
    assert!(granted, "one of two places is free");
    let won = WonClaim {
        claim: claim(CLAIM, now + Duration::from_secs(600)),
        tokens: TokenBlock { next: 40, last: 99 },
        inherited: Inherited {
            orphaned: vec![again],
            ..Inherited::default()
        },
        readopted: false,
    };
    let _ = st.claim_rewon(won, now, Duration::ZERO);
    assert_eq!(st.orphaned().len(), 1);
    let view = Occupancy::of(&id(), &st).expect("held");
    assert_eq!(view.used, 2, "the grant and the orphan, once");
}
