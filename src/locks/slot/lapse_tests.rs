//! A claim that lapses while its leases run (Keeper or ClickHouse out of
//! reach past the claim TTL), each transition alone with no I/O: the leases
//! are kept and act on nothing until a claim attempt re-wins the claim with
//! nothing in between (they run on) or finds another gateway's (they end).
//! Which attempt counts as "nothing in between" is each protocol's to say
//! (`locks::claim`); here both answers are taken.

use super::fixtures::{GATEWAY, claim, line, rules, state_id, waiter};
use super::*;

const LAPSED: Uuid = Uuid::from_u128(1);
const REWON: Uuid = Uuid::from_u128(2);

fn id() -> StateId {
    state_id("dev:lapsing")
}

/// A slot of `limit` places whose claim (valid 9 s from `now`) granted one
/// lease of 30 s with a 5 s lock-delay at `now`, and then lapsed at 9 s:
/// answers the state at the lapse, the lease and the lapse's instant.
fn lapsed(now: Instant, limit: usize) -> (SlotState, Lease, Instant) {
    let mut st = SlotState {
        claim: Some(claim(LAPSED, now + Duration::from_secs(9))),
        tokens: TokenBlock { next: 5, last: 9 },
        limit,
        ..SlotState::default()
    };
    let holder = Waiter {
        lock_delay: Duration::from_secs(5),
        ..waiter(0, now)
    };
    let (lease, _) = st.grant(&id(), &holder, GATEWAY, 1_000, now).unwrap();
    let at = now + Duration::from_secs(9);
    st.expire(&id(), at, &Metrics::default());
    (st, lease, at)
}

fn rewon(readopted: bool, now: Instant) -> WonClaim {
    WonClaim {
        claim: claim(REWON, now + Duration::from_secs(9)),
        tokens: TokenBlock {
            next: 1_025,
            last: 2_048,
        },
        inherited: Inherited::default(),
        readopted,
    }
}

#[test]
fn a_kept_lease_is_neither_renewed_nor_written_under_a_lapsed_claim() {
    let now = Instant::now();
    let (mut st, lease, at) = lapsed(now, 1);
    let renewal = st.renew(lease.lease_id, Duration::from_secs(30), at, 10_000);
    assert_eq!(renewal.out, LeaseAct::Lapsed, "503, not 409");
    assert!(!renewal.wake);
    assert_eq!(st.leases[0].deadline, now + Duration::from_secs(30));
    assert_eq!(
        st.renew(Uuid::nil(), Duration::from_secs(30), at, 10_000)
            .out,
        LeaseAct::Unknown,
        "a lease never granted here is still unknown"
    );
    assert_eq!(
        st.standing(LAPSED, Some(lease.lease_id), at),
        Standing::Lapsed,
        "a write admitted under the lapsed claim is not sent"
    );
    assert_eq!(st.standing(LAPSED, None, at), Standing::Lapsed);
    assert_eq!(
        st.standing(REWON, Some(lease.lease_id), at),
        Standing::Gone,
        "another claim's write is simply gone"
    );
}

#[test]
fn no_waiter_is_granted_while_a_kept_lease_holds_the_place() {
    let now = Instant::now();
    let (mut st, lease, at) = lapsed(now, 1);
    st.queue = line(&[1]);
    let competitor = waiter(1, at + Duration::from_secs(1));
    let step = st
        .next_step(&id(), &competitor, &rules(), at, 10_000)
        .out
        .step;
    assert_eq!(step, Step::Wait(at + Duration::from_secs(1)));
    let out_of_time = at + Duration::from_secs(1);
    let step = st
        .next_step(&id(), &competitor, &rules(), out_of_time, 11_000)
        .out
        .step;
    assert_eq!(step, Step::GiveUp(Some(lease)), "409 names the kept lease");
}

#[test]
fn a_pool_with_room_claims_again_with_the_lapsed_claim_to_re_win() {
    let now = Instant::now();
    let (mut st, lease, at) = lapsed(now, 2);
    st.queue = line(&[1]);
    let step = st
        .next_step(
            &id(),
            &waiter(1, at + Duration::from_secs(5)),
            &rules(),
            at,
            10_000,
        )
        .out
        .step;
    let Step::Claim(Some(lapsed)) = step else {
        panic!("the attempt carries the lapsed claim: {step:?}")
    };
    assert_eq!(lapsed.claim.claim_id, LAPSED);
    assert_eq!(lapsed.leases, [lease.lease_id]);
    assert!(st.claiming);
}

#[test]
fn a_tick_tries_the_lapsed_claim_once_at_a_time() {
    let now = Instant::now();
    let (mut st, lease, at) = lapsed(now, 1);
    let Tick::Lapsed(lapsed) = st.tick(at, Duration::from_secs(60)).out else {
        panic!("the tick re-claims")
    };
    assert_eq!(lapsed.leases, [lease.lease_id]);
    assert!(st.claiming, "marked under way");
    assert_eq!(
        st.tick(at, Duration::from_secs(60)).out,
        Tick::Unclaimed,
        "no second attempt meanwhile"
    );
    assert!(st.end_claim_attempt().wake);
    assert!(matches!(
        st.tick(at, Duration::from_secs(60)).out,
        Tick::Lapsed(_)
    ));
}

#[test]
fn re_won_with_nothing_in_between_the_kept_lease_runs_on_with_its_token() {
    let now = Instant::now();
    let (mut st, lease, at) = lapsed(now, 1);
    let adopted = st.claim_rewon(rewon(true, at), at, Duration::from_secs(1));
    assert!(adopted.wake);
    assert!(
        adopted.out.is_empty(),
        "nothing inherited: the lease is ours"
    );
    assert_eq!(st.claim_id(), Some(REWON));
    assert!(st.lapsed.is_none());
    assert_eq!(
        st.lease().map(|l| l.fencing_token),
        Some(lease.fencing_token)
    );
    assert_eq!(
        st.lease().map(|l| l.lock_delay),
        Some(Duration::from_secs(5))
    );
    let renewed = st.renew(lease.lease_id, Duration::from_secs(30), at, 10_000);
    assert!(matches!(renewed.out, LeaseAct::Done(_)));
    assert_eq!(
        st.standing(REWON, Some(lease.lease_id), at),
        Standing::Until(at + Duration::from_secs(9))
    );
    assert_eq!(
        st.tokens.next, 1_025,
        "new grants go on above the new block"
    );
}

#[test]
fn won_with_another_claim_in_between_the_kept_lease_ends() {
    let now = Instant::now();
    let (mut st, lease, at) = lapsed(now, 1);
    assert!(
        st.claim_rewon(rewon(false, at), at, Duration::from_secs(1))
            .wake
    );
    assert_eq!(st.claim_id(), Some(REWON));
    assert!(st.leases.is_empty() && st.lapsed.is_none());
    assert_eq!(
        st.renew(lease.lease_id, Duration::from_secs(30), at, 10_000)
            .out,
        LeaseAct::Unknown,
        "409 from now on"
    );
}

#[test]
fn a_waiters_attempt_that_re_wins_grants_beside_the_kept_lease() {
    let now = Instant::now();
    let (mut st, lease, at) = lapsed(now, 2);
    st.queue = line(&[1]);
    let me = waiter(1, at + Duration::from_secs(5));
    let grant = Grant {
        id: &id(),
        waiter: &me,
        gateway_id: GATEWAY,
        now: at,
        now_ms: 10_000,
    };
    let Adopted { granted, .. } = st.claim_won(rewon(true, at), grant, Duration::ZERO).out;
    let (granted, _) = granted.expect("the free place is granted");
    assert!(granted.fencing_token > lease.fencing_token);
    assert_eq!(st.holders().len(), 2);
}

#[test]
fn the_claim_found_elsewhere_ends_the_kept_leases_and_wakes() {
    let now = Instant::now();
    let (mut st, lease, _) = lapsed(now, 1);
    assert!(
        !st.lapse_refused(REWON).wake,
        "not this lapse: nothing ends"
    );
    assert_eq!(st.leases.len(), 1);
    assert!(st.lapse_refused(LAPSED).wake);
    assert!(st.leases.is_empty() && st.lapsed.is_none() && st.is_idle());
    assert!(st.release(lease.lease_id, now).out.is_none());
}

#[test]
fn a_kept_lease_may_be_released_and_the_lapse_goes_with_the_last() {
    let now = Instant::now();
    let (mut st, lease, at) = lapsed(now, 1);
    let released = st.release(lease.lease_id, at);
    assert!(released.wake);
    let released = released.out.expect("ending a lease early is always safe");
    assert_eq!(released.lease.lease.lease_id, lease.lease_id);
    assert!(released.withdraw.is_none());
    assert!(st.lapsed.is_none() && st.is_idle());
}

#[test]
fn a_kept_lease_past_its_deadline_expires_and_the_lapse_with_it() {
    let now = Instant::now();
    let (mut st, _, _) = lapsed(now, 1);
    st.expire(&id(), now + Duration::from_secs(30), &Metrics::default());
    assert!(st.leases.is_empty() && st.lapsed.is_none());
    assert_eq!(st.delayed.len(), 1, "its lock-delay runs from its expiry");
}

#[test]
fn a_force_unlock_ends_kept_leases_and_the_lapse() {
    let now = Instant::now();
    let (mut st, lease, at) = lapsed(now, 1);
    let ended = st.force_unlock(at, 10_000).out.expect("answered here");
    assert_eq!(ended[0].lease.lease_id, lease.lease_id);
    assert!(st.lapsed.is_none() && st.leases.is_empty());
    assert_eq!(st.delayed.len(), 1, "its lock-delay starts now");
}

#[test]
fn kept_leases_are_not_handed_on_at_shutdown() {
    let now = Instant::now();
    let (mut st, _, _) = lapsed(now, 1);
    assert!(st.hand_back().out.is_none(), "no claim, no hand-over rows");
    assert!(st.leases.is_empty() && st.lapsed.is_none());
}

/// A slot holding claim `LAPSED` (valid 9 s from `now`) with one lease of
/// 30 s granted at `now`, its claim not yet looked at past its validity.
fn holding(now: Instant) -> (SlotState, Lease) {
    let mut st = SlotState {
        claim: Some(claim(LAPSED, now + Duration::from_secs(9))),
        tokens: TokenBlock { next: 5, last: 9 },
        ..SlotState::default()
    };
    let (lease, _) = st
        .grant(&id(), &waiter(0, now), GATEWAY, 1_000, now)
        .unwrap();
    (st, lease)
}

#[test]
fn a_renewal_refused_as_the_claim_ran_out_is_a_lapse_and_keeps_the_lease() {
    let now = Instant::now();
    let (mut st, lease) = holding(now);
    let metrics = Metrics::default();
    assert!(
        !st.claim_refused(&id(), REWON, &metrics).wake,
        "not the claim here: nothing changes"
    );
    assert_eq!(st.claim_id(), Some(LAPSED));
    // The renewal ran after the claim's expiry in ClickHouse: nobody else
    // is known to have claimed the id, so its lease is kept, not ended.
    let at = now + Duration::from_secs(10);
    assert!(st.claim_refused(&id(), LAPSED, &metrics).wake);
    assert_eq!(
        st.claim_id(),
        None,
        "nothing is granted or renewed under it"
    );
    assert_eq!(
        st.renew(lease.lease_id, Duration::from_secs(30), at, 11_000)
            .out,
        LeaseAct::Lapsed,
        "503, not 409"
    );
    let Tick::Lapsed(lapsed) = st.tick(at, Duration::from_secs(60)).out else {
        panic!("the tick re-claims")
    };
    assert_eq!(lapsed.claim.claim_id, LAPSED);
    assert_eq!(lapsed.leases, [lease.lease_id]);
}

#[test]
fn a_renewal_that_lands_after_the_claim_lapsed_here_brings_it_back() {
    let now = Instant::now();
    let (mut st, lease, at) = lapsed(now, 1);
    assert!(
        !st.claim_renewed(REWON, at + Duration::from_secs(9), at)
            .wake,
        "another claim's renewal changes nothing"
    );
    assert!(st.claim.is_none());
    assert!(
        !st.claim_renewed(LAPSED, at, at).wake,
        "a renewal valid no longer leaves the claim lapsed"
    );
    assert!(st.claim.is_none());
    // The renewal ran while the claim was live in ClickHouse: it never
    // lapsed there, so nobody else can have claimed the id meanwhile.
    let until = at + Duration::from_secs(5);
    assert!(st.claim_renewed(LAPSED, until, at).wake);
    assert_eq!(st.claim_id(), Some(LAPSED));
    assert!(st.lapsed.is_none());
    assert!(matches!(
        st.renew(lease.lease_id, Duration::from_secs(30), at, 10_000)
            .out,
        LeaseAct::Done(_)
    ));
    assert_eq!(
        st.standing(LAPSED, Some(lease.lease_id), at),
        Standing::Until(until)
    );
}
