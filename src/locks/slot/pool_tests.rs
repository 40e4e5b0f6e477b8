//! A slot of several places (a pool's), pure state in and a decision out,
//! no I/O: the limit, FIFO order, fencing tokens in grant order, expiry and
//! lock-delay with several holders, a force-unlock of them all, and the
//! places an earlier authority's leases keep.

use super::*;

use super::fixtures::{GATEWAY, claim, one_of, orphan, rules, waiter};

const CLAIM: Uuid = Uuid::from_u128(1);

fn pool() -> StateId {
    StateId::parse("replica-1".to_owned()).unwrap()
}

/// A slot of `limit` places under a fresh claim, with `waiters` in line.
fn pool_of(limit: usize, waiters: usize, now: Instant) -> SlotState {
    let mut st = SlotState {
        claim: Some(claim(CLAIM, now + Duration::from_secs(600))),
        tokens: TokenBlock { next: 5, last: 99 },
        ..SlotState::default()
    };
    for _ in 0..waiters {
        st.join(one_of(limit)).out.expect("the limit is the pool's");
    }
    st
}

fn decide(st: &mut SlotState, waiter: &Waiter<'_>, now: Instant) -> Step {
    st.expire(&pool(), now, &Metrics::default());
    st.next_step(&pool(), waiter, &rules(), now, 1_000).out.step
}

/// Grants the first in line and lets it leave the line, as an acquire does.
fn grant_first(st: &mut SlotState, now: Instant, lock_delay: Duration) -> Lease {
    let ticket = st.queue[0].ticket;
    let first = Waiter {
        lock_delay,
        ..waiter(ticket, now + Duration::from_secs(60))
    };
    let Step::Granted(lease, _) = decide(st, &first, now) else {
        panic!("the first in line is granted while a place is free")
    };
    assert!(st.leave(ticket).wake);
    lease
}

#[test]
fn a_pool_takes_the_first_limit_and_refuses_another_while_in_use() {
    let now = Instant::now();
    let mut st = pool_of(3, 1, now);
    assert_eq!(st.join(one_of(2)).out, Err(3), "a waiter is in line");
    let lease = grant_first(&mut st, now, Duration::ZERO);
    assert_eq!(lease.limit, 3);
    assert_eq!(st.join(one_of(1)).out, Err(3), "a lease runs");
    let _ = st.release(lease.lease_id, now);
    assert!(
        st.join(one_of(2)).out.is_ok(),
        "empty: the new limit is taken"
    );
    assert_eq!(st.limit(), 2);
}

#[test]
fn up_to_the_limit_are_granted_in_line_order_with_rising_tokens() {
    let now = Instant::now();
    let mut st = pool_of(2, 4, now);
    let deadline = now + Duration::from_secs(60);
    // Only the first in line goes, even with a place free behind it.
    assert_eq!(
        decide(&mut st, &waiter(1, deadline), now),
        Step::Wait(deadline)
    );
    let first = grant_first(&mut st, now, Duration::ZERO);
    let later = now + Duration::from_secs(1);
    let second = grant_first(&mut st, later, Duration::ZERO);
    assert_eq!((first.fencing_token, second.fencing_token), (5, 6));
    assert_eq!(st.holders().len(), 2);
    assert_eq!(st.waiters().len(), 2);
    // Full: the next sleeps until the first lease ends, then takes its place.
    assert_eq!(
        decide(&mut st, &waiter(2, deadline), later),
        Step::Wait(now + Duration::from_secs(30))
    );
    let _ = st.release(first.lease_id, later);
    let third = grant_first(&mut st, later, Duration::ZERO);
    assert_eq!(third.fencing_token, 7);
    // The fourth is still behind the line's head.
    assert!(matches!(
        decide(&mut st, &waiter(3, later), later),
        Step::GiveUp(Some(_))
    ));
}

#[test]
fn a_full_pool_names_a_holder_to_a_waiter_out_of_time() {
    let now = Instant::now();
    let mut st = pool_of(1, 2, now);
    let holder = grant_first(&mut st, now, Duration::ZERO);
    assert_eq!(
        decide(&mut st, &waiter(1, now), now),
        Step::GiveUp(Some(holder))
    );
}

#[test]
fn an_expired_holder_with_a_lock_delay_keeps_its_place_until_the_delay_ends() {
    let now = Instant::now();
    let mut st = pool_of(2, 3, now);
    let delayed = grant_first(&mut st, now, Duration::from_secs(4));
    let later = now + Duration::from_secs(10);
    let plain = grant_first(&mut st, later, Duration::ZERO);
    let expired = now + Duration::from_secs(30);
    // The first expired: one lease runs and a delay keeps the other place.
    let step = decide(&mut st, &waiter(2, expired), expired);
    assert_eq!(step, Step::GiveUp(Some(plain.clone())));
    assert_eq!(st.holders(), [plain]);
    assert_eq!(st.delayed.len(), 1);
    assert_ne!(delayed.lease_id, st.holders()[0].lease_id);
    // It waits for the delay to end, the first place to come free.
    let patient = waiter(2, expired + Duration::from_secs(60));
    assert_eq!(
        decide(&mut st, &patient, expired),
        Step::Wait(expired + Duration::from_secs(4))
    );
    let over = expired + Duration::from_secs(4);
    assert!(matches!(decide(&mut st, &patient, over), Step::Granted(..)));
}

#[test]
fn a_force_unlock_ends_every_holder_and_each_delay_keeps_a_place() {
    let now = Instant::now();
    let mut st = pool_of(2, 3, now);
    grant_first(&mut st, now, Duration::from_secs(4));
    grant_first(&mut st, now, Duration::from_secs(6));
    let forced = st.force_unlock(now, 2_000);
    assert!(forced.wake);
    assert_eq!(forced.out.map(|ended| ended.len()), Some(2));
    assert!(st.holders().is_empty());
    // No lease exists; the first place frees when the shorter delay ends.
    assert_eq!(decide(&mut st, &waiter(2, now), now), Step::Delayed(6_000));
    let patient = waiter(2, now + Duration::from_secs(60));
    assert_eq!(
        decide(&mut st, &patient, now),
        Step::Wait(now + Duration::from_secs(4))
    );
    let four = now + Duration::from_secs(4);
    assert!(matches!(decide(&mut st, &patient, four), Step::Granted(..)));
}

#[test]
fn a_release_frees_one_place_and_the_claim_goes_only_once_all_are_free() {
    let now = Instant::now();
    let mut st = pool_of(2, 2, now);
    let first = grant_first(&mut st, now, Duration::ZERO);
    let second = grant_first(&mut st, now, Duration::ZERO);
    st.claim.as_mut().unwrap().handover = true;
    let released = st.release(first.lease_id, now);
    assert!(released.wake, "a place came free");
    assert!(released.out.unwrap().withdraw.is_none(), "one still holds");
    assert_eq!(st.holders(), std::slice::from_ref(&second));
    let last = st.release(second.lease_id, now).out.unwrap();
    assert_eq!(last.withdraw.map(|c| c.claim_id), Some(CLAIM));
}

#[test]
fn a_claim_won_keeps_the_places_of_a_dead_authoritys_leases() {
    let now = Instant::now();
    let mut st = SlotState::default();
    let ticket = st.join(one_of(2)).out.unwrap();
    let ends = |secs: u64| orphan(&pool(), 7, 1, secs, now, 1_000);
    let won = WonClaim {
        claim: claim(CLAIM, now + Duration::from_secs(600)),
        tokens: TokenBlock { next: 40, last: 99 },
        inherited: Inherited {
            leases: Vec::new(),
            orphaned: vec![ends(3), ends(5)],
            delays: Vec::new(),
        },
        readopted: false,
    };
    let me = waiter(ticket, now + Duration::from_secs(60));
    let grant = Grant {
        id: &pool(),
        waiter: &me,
        gateway_id: GATEWAY,
        now,
        now_ms: 1_000,
    };
    let adopted = st.claim_won(won, grant, Duration::from_secs(1));
    assert!(adopted.out.granted.is_none(), "both places are kept");
    assert_eq!(
        decide(&mut st, &me, now),
        Step::Wait(now + Duration::from_secs(3))
    );
    let Step::Granted(lease, _) = decide(&mut st, &me, now + Duration::from_secs(3)) else {
        panic!("granted once the first kept place ends")
    };
    assert_eq!(lease.fencing_token, 40);
}

#[test]
fn a_renewal_or_a_force_elsewhere_touches_only_its_own_lease() {
    let now = Instant::now();
    let mut st = pool_of(2, 2, now);
    let first = grant_first(&mut st, now, Duration::ZERO);
    let second = grant_first(&mut st, now, Duration::from_secs(4));
    let later = now + Duration::from_secs(10);
    let renewed = st.renew(second.lease_id, Duration::from_secs(30), later, 11_000);
    let LeaseAct::Done((row, _)) = renewed.out else {
        panic!("a current lease renews")
    };
    assert_eq!(row.lease_id, second.lease_id);
    assert_eq!(st.leases[0].deadline, now + Duration::from_secs(30));
    assert_eq!(st.leases[1].deadline, later + Duration::from_secs(30));
    assert!(st.forced_elsewhere(second.lease_id, later, 11_000).wake);
    assert_eq!(st.holders(), std::slice::from_ref(&first));
    assert_eq!(st.delayed.len(), 1, "its lock-delay keeps its place");
}

#[test]
fn a_tick_and_a_hand_back_carry_every_holder() {
    let now = Instant::now();
    let mut st = pool_of(3, 2, now);
    let leases = [
        grant_first(&mut st, now, Duration::ZERO),
        grant_first(&mut st, now, Duration::ZERO),
    ];
    assert_eq!(
        st.tick(now, Duration::from_secs(60)).out,
        Tick::Held(CLAIM, leases.to_vec())
    );
    let (claim_id, handed) = st.hand_back().out.expect("a claim to hand back");
    assert_eq!(claim_id, CLAIM);
    let handed: Vec<Uuid> = handed.iter().map(|l| l.lease.lease_id).collect();
    assert_eq!(handed, leases.map(|l| l.lease_id));
    assert!(st.holders().is_empty());
}

#[test]
fn a_claim_won_adopts_every_lease_handed_on_and_grants_a_free_place() {
    let now = Instant::now();
    let mut before = pool_of(3, 2, now);
    grant_first(&mut before, now, Duration::ZERO);
    grant_first(&mut before, now, Duration::ZERO);
    let (_, handed) = before.hand_back().out.unwrap();
    let mut st = SlotState::default();
    let ticket = st.join(one_of(3)).out.unwrap();
    let won = WonClaim {
        claim: claim(CLAIM, now + Duration::from_secs(600)),
        tokens: TokenBlock { next: 40, last: 99 },
        inherited: Inherited {
            leases: handed,
            orphaned: Vec::new(),
            delays: Vec::new(),
        },
        readopted: false,
    };
    let me = waiter(ticket, now + Duration::from_secs(60));
    let grant = Grant {
        id: &pool(),
        waiter: &me,
        gateway_id: GATEWAY,
        now,
        now_ms: 1_000,
    };
    let adopted = st.claim_won(won, grant, Duration::from_secs(1)).out;
    assert_eq!(adopted.adopted.len(), 2);
    let (granted, _) = adopted.granted.expect("the third place is free");
    assert_eq!(granted.fencing_token, 40);
    assert_eq!(st.holders().len(), 3);
}
