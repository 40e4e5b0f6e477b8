//! Each transition alone, for one lease per slot, with no I/O: what it
//! changes, what it answers, and whether it wakes the waiters. A pool's
//! slot of several leases is in `slot::pool_tests`.

use super::super::fixtures::{GATEWAY, claim, line, one_of, state_id, waiter};
use super::*;

const CLAIM: Uuid = Uuid::from_u128(1);

fn id() -> StateId {
    state_id("dev:tap-to-target")
}

/// A waiter giving up a minute from now.
fn waiting(ticket: u64) -> Waiter<'static> {
    waiter(ticket, Instant::now() + Duration::from_secs(60))
}

/// A slot whose claim holds a lease granted at `now` (1 000 ms), with
/// `lock_delay`; answers the lease.
fn holding(now: Instant, lock_delay: Duration) -> (SlotState, Lease) {
    let mut st = SlotState {
        claim: Some(claim(CLAIM, now + Duration::from_secs(9))),
        tokens: TokenBlock { next: 5, last: 9 },
        ..SlotState::default()
    };
    let waiter = Waiter {
        lock_delay,
        ..waiting(0)
    };
    let (lease, _) = st.grant(&id(), &waiter, GATEWAY, 1_000, now).unwrap();
    (st, lease)
}

#[test]
fn tickets_are_handed_out_in_order_and_leaving_the_line_wakes_the_rest() {
    let mut st = SlotState::default();
    let first = st.join(one_of(1));
    let second = st.join(one_of(1));
    assert_eq!((first.out, first.wake), (Ok(0), false));
    assert_eq!(second.out, Ok(1));
    assert!(st.leave(0).wake);
    assert_eq!(st.queue, line(&[1]));
}

#[test]
fn the_end_of_a_claim_attempt_clears_the_mark_and_wakes() {
    let mut st = SlotState {
        claiming: true,
        ..SlotState::default()
    };
    assert!(st.end_claim_attempt().wake);
    assert!(!st.claiming);
}

#[test]
fn a_renewal_extends_the_current_lease_only_and_wakes_no_one() {
    let now = Instant::now();
    let (mut st, lease) = holding(now, Duration::ZERO);
    let later = now + Duration::from_secs(10);
    let renewed = st.renew(lease.lease_id, Duration::from_secs(30), later, 11_000);
    assert!(!renewed.wake);
    let LeaseAct::Done((row, version)) = renewed.out else {
        panic!("renewed")
    };
    assert_eq!(row.expires_ms, 41_000);
    assert_eq!(version, LeaseVersion::granted(5).renewed());
    assert_eq!(st.leases[0].deadline, later + Duration::from_secs(30));
    assert_eq!(st.last_used, Some(later));
    assert_eq!(
        st.renew(Uuid::nil(), Duration::from_secs(30), later, 11_000)
            .out,
        LeaseAct::Unknown
    );
    st.claim = None;
    assert_eq!(
        st.renew(lease.lease_id, Duration::from_secs(30), later, 11_000)
            .out,
        LeaseAct::Unknown
    );
}

#[test]
fn a_release_ends_the_lease_wakes_and_keeps_an_uncontested_claim() {
    let now = Instant::now();
    let (mut st, lease) = holding(now, Duration::from_secs(5));
    let other = st.release(Uuid::nil(), now);
    assert!(other.out.is_none() && !other.wake);
    let released = st.release(lease.lease_id, now);
    assert!(released.wake);
    let released = released.out.expect("released");
    assert_eq!(released.lease.lease.lease_id, lease.lease_id);
    assert!(released.withdraw.is_none());
    assert!(st.leases.is_empty() && st.claim.is_some());
    assert!(st.delayed.is_empty(), "a release starts no lock-delay");
}

#[test]
fn a_release_hands_a_contested_claim_over_only_when_nothing_needs_it() {
    let now = Instant::now();
    let (mut st, lease) = holding(now, Duration::ZERO);
    st.claim.as_mut().unwrap().handover = true;
    let released = st.release(lease.lease_id, now).out.unwrap();
    assert_eq!(released.withdraw.map(|c| c.claim_id), Some(CLAIM));
    assert!(st.claim.is_none());

    let (mut st, lease) = holding(now, Duration::ZERO);
    st.claim.as_mut().unwrap().handover = true;
    st.start_send(now + Duration::from_secs(1));
    assert!(
        st.release(lease.lease_id, now)
            .out
            .unwrap()
            .withdraw
            .is_none()
    );
    assert!(st.claim.is_some(), "a write may still land under it");

    let (mut st, lease) = holding(now, Duration::ZERO);
    st.claim.as_mut().unwrap().handover = true;
    let _ = st.join(one_of(1));
    assert!(
        st.release(lease.lease_id, now)
            .out
            .unwrap()
            .withdraw
            .is_none()
    );
}

#[test]
fn a_force_unlock_needs_the_claim_and_wakes_only_when_a_lease_ended() {
    let now = Instant::now();
    let (mut st, lease) = holding(now, Duration::from_secs(5));
    let forced = st.force_unlock(now, 2_000);
    assert!(forced.wake);
    assert_eq!(forced.out.unwrap()[0].lease.lease_id, lease.lease_id);
    assert_eq!(st.delayed[0].free_at_ms, 7_000);
    let again = st.force_unlock(now, 2_000);
    assert!(again.out.is_some_and(|ended| ended.is_empty()) && !again.wake);
    st.claim = None;
    assert!(st.force_unlock(now, 2_000).out.is_none());
}

#[test]
fn a_lease_forced_elsewhere_ends_here_only_if_still_current() {
    let now = Instant::now();
    let (mut st, lease) = holding(now, Duration::ZERO);
    assert!(!st.forced_elsewhere(Uuid::nil(), now, 2_000).wake);
    assert!(!st.leases.is_empty());
    assert!(st.forced_elsewhere(lease.lease_id, now, 2_000).wake);
    assert!(st.leases.is_empty());
}

fn won(now: Instant, inherited: Inherited) -> WonClaim {
    WonClaim {
        claim: claim(CLAIM, now + Duration::from_secs(9)),
        tokens: TokenBlock { next: 11, last: 20 },
        inherited,
        readopted: false,
    }
}

/// `won` taken on for the waiter of ticket 0, first in line.
fn claim_won(st: &mut SlotState, won: WonClaim, now: Instant) -> Effects<Adopted> {
    st.queue = line(&[0]);
    let waiter = waiting(0);
    let grant = Grant {
        id: &id(),
        waiter: &waiter,
        gateway_id: GATEWAY,
        now,
        now_ms: 1_000,
    };
    st.claim_won(won, grant, Duration::from_secs(3))
}

#[test]
fn a_won_claim_grants_its_winner_at_once_and_wakes() {
    let now = Instant::now();
    let mut st = SlotState::default();
    let adopted = claim_won(&mut st, won(now, Inherited::default()), now);
    assert!(adopted.wake);
    assert!(adopted.out.adopted.is_empty());
    let (lease, _) = adopted.out.granted.expect("granted");
    assert_eq!(lease.fencing_token, 11);
    assert_eq!(st.claim_id(), Some(CLAIM));
    assert_eq!(st.lease(), Some(&lease));
}

#[test]
fn a_won_claim_adopts_a_running_lease_and_waits_out_its_writes() {
    let now = Instant::now();
    let (mut before, lease) = holding(now, Duration::ZERO);
    let inherited = Inherited {
        leases: std::mem::take(&mut before.leases),
        orphaned: Vec::new(),
        delays: Vec::new(),
    };
    let mut st = SlotState::default();
    let adopted = claim_won(&mut st, won(now, inherited), now).out;
    let adopted_ids: Vec<Uuid> = adopted.adopted.iter().map(|(l, _)| l.lease_id).collect();
    assert_eq!(adopted_ids, [lease.lease_id]);
    assert!(adopted.granted.is_none());
    assert_eq!(st.landing_until(), Some(now + Duration::from_secs(3)));
}

#[test]
fn a_won_claim_grants_nothing_during_an_inherited_delay() {
    let now = Instant::now();
    let delay = Delay::ending(6_000, 1, now, 1_000);
    let inherited = Inherited {
        leases: Vec::new(),
        orphaned: Vec::new(),
        delays: vec![delay],
    };
    let mut st = SlotState::default();
    assert!(
        claim_won(&mut st, won(now, inherited), now)
            .out
            .granted
            .is_none()
    );
    assert_eq!(st.delayed, [delay]);
}

#[test]
fn a_refused_claim_lapses_keeping_its_lease_only_if_it_is_still_the_one_here() {
    let now = Instant::now();
    let metrics = Metrics::default();
    let (mut st, _) = holding(now, Duration::ZERO);
    assert!(!st.claim_refused(&id(), Uuid::nil(), &metrics).wake);
    assert!(st.claim.is_some() && !st.leases.is_empty());
    assert!(st.claim_refused(&id(), CLAIM, &metrics).wake);
    assert!(st.claim.is_none() && !st.leases.is_empty());
    assert_eq!(st.lapsed.as_ref().map(|c| c.claim_id), Some(CLAIM));
}

#[test]
fn a_renewal_or_a_contest_changes_only_the_claim_it_was_for() {
    let now = Instant::now();
    let (mut st, _) = holding(now, Duration::ZERO);
    let until = st.claim.as_ref().unwrap().valid_until;
    assert!(
        !st.claim_renewed(CLAIM, until - Duration::from_secs(1), now)
            .wake
    );
    assert_eq!(
        st.claim.as_ref().unwrap().valid_until,
        until,
        "never shortened"
    );
    let _ = st.claim_renewed(Uuid::nil(), until + Duration::from_secs(5), now);
    assert_eq!(st.claim.as_ref().unwrap().valid_until, until);
    let _ = st.claim_renewed(CLAIM, until + Duration::from_secs(5), now);
    assert_eq!(
        st.claim.as_ref().unwrap().valid_until,
        until + Duration::from_secs(5)
    );
    let _ = st.contested(Uuid::nil(), true);
    assert!(!st.claim.as_ref().unwrap().handover);
    assert!(!st.contested(CLAIM, true).wake);
    assert!(st.claim.as_ref().unwrap().handover);
}

#[test]
fn a_claim_goes_when_contested_or_idle_and_never_under_a_lease() {
    let now = Instant::now();
    let idle = Duration::from_secs(60);
    let (mut st, lease) = holding(now, Duration::ZERO);
    st.claim.as_mut().unwrap().handover = true;
    assert_eq!(
        st.tick(now, idle).out,
        Tick::Held(CLAIM, vec![lease.clone()]),
        "its lease runs"
    );
    // Someone waits here, so the release keeps the claim.
    let _ = st.join(one_of(1));
    assert!(
        st.release(lease.lease_id, now)
            .out
            .unwrap()
            .withdraw
            .is_none()
    );
    let gone = st.tick(now, idle);
    assert!(gone.wake);
    assert_eq!(
        gone.out,
        Tick::Gone(CLAIM),
        "handed over even with a waiter here"
    );

    let (mut st, lease) = holding(now, Duration::ZERO);
    let _ = st.release(lease.lease_id, now);
    let not_yet = st.tick(now + idle / 2, idle);
    assert_eq!(
        not_yet.out,
        Tick::Held(CLAIM, Vec::new()),
        "not idle long enough"
    );
    assert!(!not_yet.wake);
    let ticket = st.join(one_of(1)).out.unwrap();
    let waits = st.tick(now + idle, idle).out;
    assert_eq!(waits, Tick::Held(CLAIM, Vec::new()), "someone waits");
    let _ = st.leave(ticket);
    assert_eq!(st.tick(now + idle, idle).out, Tick::Gone(CLAIM));
    assert_eq!(st.tick(now + idle, idle).out, Tick::Unclaimed);
}

#[test]
fn handing_back_takes_the_claim_and_its_lease_and_wakes_no_one() {
    let now = Instant::now();
    let (mut st, lease) = holding(now, Duration::ZERO);
    let back = st.hand_back();
    assert!(!back.wake);
    let (claim_id, handed) = back.out.expect("a claim to hand back");
    assert_eq!(claim_id, CLAIM);
    let handed: Vec<Uuid> = handed.iter().map(|l| l.lease.lease_id).collect();
    assert_eq!(handed, [lease.lease_id]);
    assert!(st.claim.is_none() && st.leases.is_empty());
    assert!(st.hand_back().out.is_none());
}

#[test]
fn a_write_holds_the_id_until_done_or_until_its_unknown_end() {
    let now = Instant::now();
    let mut st = SlotState::default();
    let first = st.start_send(now + Duration::from_secs(1));
    let second = st.start_send(now + Duration::from_secs(2));
    assert_ne!(first, second);
    assert!(st.send_done(first).wake);
    assert!(!st.send_unknown(second, now + Duration::from_secs(7)).wake);
    assert_eq!(st.landing_until(), Some(now + Duration::from_secs(7)));
    assert!(!st.nothing_landing());
    let _ = st.send_done(second);
    assert!(st.nothing_landing());
}

#[test]
fn a_write_stands_by_its_lease_the_claim_and_the_time() {
    let now = Instant::now();
    let (mut st, lease) = holding(now, Duration::ZERO);
    let valid = now + Duration::from_secs(9);
    let mine = Some(lease.lease_id);
    assert_eq!(st.standing(CLAIM, mine, now), Standing::Until(valid));
    assert_eq!(
        st.standing(CLAIM, None, now),
        Standing::Locked(lease.clone())
    );
    assert_eq!(st.standing(CLAIM, Some(Uuid::nil()), now), Standing::Gone);
    assert_eq!(st.standing(Uuid::nil(), mine, now), Standing::Gone);
    assert_eq!(
        st.standing(CLAIM, mine, valid),
        Standing::Gone,
        "the claim may have lapsed"
    );
    // Past its deadline the lease has ended, looked at or not.
    let after = now + Duration::from_secs(30);
    st.claim.as_mut().unwrap().valid_until = after + Duration::from_secs(1);
    assert_eq!(st.standing(CLAIM, mine, after), Standing::Gone);
    assert_eq!(
        st.standing(CLAIM, None, after),
        Standing::Until(after + Duration::from_secs(1))
    );
}

#[tokio::test]
async fn apply_wakes_the_waiters_only_when_the_transition_asks() {
    let slot = Slot::default();
    let quiet = slot.changed();
    tokio::pin!(quiet);
    quiet.as_mut().enable();
    let _ = slot.apply(|st, _| st.join(one_of(1)));
    let woken = tokio::time::timeout(Duration::from_millis(20), quiet.as_mut()).await;
    assert!(woken.is_err(), "joining the line wakes no one");
    slot.apply(|st, _| st.leave(0));
    tokio::time::timeout(Duration::from_secs(1), quiet)
        .await
        .expect("leaving the line wakes the waiters");
}

#[test]
fn a_claim_for_writes_starts_only_on_a_free_slot_and_waiters_wait_for_it() {
    let mut st = SlotState::default();
    let started = st.start_claim_for_writes();
    assert!(started.out && !started.wake);
    assert!(
        !st.start_claim_for_writes().out,
        "one attempt at a time: the second write finds it under way"
    );
    assert!(!st.is_idle(), "a slot with an attempt under way is kept");
    let _ = st.end_claim_attempt();
    let ticket = st.join(one_of(1)).out.unwrap();
    assert!(
        !st.start_claim_for_writes().out,
        "an acquire in line runs the attempt, for its own grant"
    );
    let _ = st.leave(ticket);
    st.claim = Some(claim(CLAIM, Instant::now() + Duration::from_secs(9)));
    assert!(!st.start_claim_for_writes().out, "already the authority");
}

#[test]
fn a_claim_won_for_writes_grants_nothing_and_stays_while_writes_go_out() {
    let now = Instant::now();
    let idle = Duration::from_secs(10);
    let mut st = SlotState::default();
    assert!(st.start_claim_for_writes().out);
    let _ = st.end_claim_attempt();
    let won = st.claim_won_for_writes(won(now, Inherited::default()), now, Duration::from_secs(3));
    assert!(won.out.is_empty() && won.wake, "waiters look again");
    assert!(st.leases.is_empty(), "no lease is granted");
    assert_eq!(
        st.standing(CLAIM, None, now),
        Standing::Until(now + Duration::from_secs(9)),
        "an unlocked write is admitted under it"
    );
    assert_eq!(
        st.tick(now + idle / 2, idle).out,
        Tick::Held(CLAIM, Vec::new())
    );
    // A write at 8 s keeps it past the idle time counted from the win.
    let number = st
        .send(now + Duration::from_secs(8), now + Duration::from_secs(9))
        .out;
    let _ = st.send_done(number);
    assert_eq!(
        st.tick(now + idle + Duration::from_secs(1), idle).out,
        Tick::Held(CLAIM, Vec::new()),
        "written 3 s ago"
    );
    assert_eq!(
        st.tick(now + Duration::from_secs(8) + idle, idle).out,
        Tick::Gone(CLAIM),
        "idle for --claim-idle since its last write"
    );
}

#[test]
fn a_claim_won_for_writes_adopts_the_leases_handed_on_to_it() {
    let now = Instant::now();
    let (mut previous, lease) = holding(now, Duration::ZERO);
    let handed = previous.leases.drain(..).collect();
    let mut st = SlotState::default();
    let inherited = Inherited {
        leases: handed,
        orphaned: Vec::new(),
        delays: Vec::new(),
    };
    let adopted = st.claim_won_for_writes(won(now, inherited), now, Duration::from_secs(3));
    assert_eq!(adopted.out.len(), 1);
    assert_eq!(
        st.standing(CLAIM, None, now),
        Standing::Locked(lease),
        "an unlocked write is refused while the adopted lease runs"
    );
}
