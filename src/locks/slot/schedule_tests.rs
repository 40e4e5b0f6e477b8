//! A pool's scheduling, pure state in and a decision out, no I/O: leases of
//! several slots, waiters' priorities, the strict line (nobody passes the
//! first waiter, even a later one that would fit), a waiter that leaves it,
//! and the slots a dead authority's leases keep.

use super::*;

use super::fixtures::{GATEWAY, claim, orphan, rules, waiter};

const CLAIM: Uuid = Uuid::from_u128(1);

fn pool() -> StateId {
    StateId::parse("source-db".to_owned()).unwrap()
}

/// A pool under a fresh claim, nobody in line.
fn claimed(now: Instant) -> SlotState {
    SlotState {
        claim: Some(claim(CLAIM, now + Duration::from_secs(600))),
        tokens: TokenBlock { next: 5, last: 99 },
        ..SlotState::default()
    }
}

/// Joins the line of a pool of `limit` for `slots` at `priority`.
fn join(st: &mut SlotState, limit: usize, slots: usize, priority: i32) -> u64 {
    let asking = Asking {
        limit,
        slots,
        priority,
    };
    st.join(asking).out.expect("the limit is the pool's")
}

/// The waiter holding `ticket`, asking for its slots in line.
fn waiter_of(st: &SlotState, ticket: u64, now: Instant) -> Waiter<'static> {
    let slots = st
        .queue
        .iter()
        .find(|q| q.ticket == ticket)
        .expect("in line")
        .slots;
    Waiter {
        slots,
        ..waiter(ticket, now + Duration::from_secs(60))
    }
}

fn decide(st: &mut SlotState, ticket: u64, now: Instant) -> Step {
    let waiter = waiter_of(st, ticket, now);
    st.expire(&pool(), now, &Metrics::default());
    st.next_step(&pool(), &waiter, &rules(), now, 1_000)
        .out
        .step
}

/// Grants `ticket` and lets it leave the line, as an acquire does; None
/// when it is not granted now.
fn try_grant(st: &mut SlotState, ticket: u64, now: Instant) -> Option<Lease> {
    let Step::Granted(lease, _) = decide(st, ticket, now) else {
        return None;
    };
    assert!(st.leave(ticket).wake);
    assert!(st.used() <= st.limit(), "never more slots than the limit");
    Some(lease)
}

/// The tickets in line, in the order they are granted.
fn order(st: &SlotState) -> Vec<u64> {
    st.waiters().iter().map(|q| q.ticket).collect()
}

#[test]
fn leases_of_mixed_widths_fill_the_limit_and_a_wide_waiter_waits_for_room() {
    let now = Instant::now();
    let mut st = claimed(now);
    let three = join(&mut st, 4, 3, 0);
    let one = join(&mut st, 4, 1, 0);
    let two = join(&mut st, 4, 2, 0);
    let wide = try_grant(&mut st, three, now).expect("3 of 4 fit");
    let narrow = try_grant(&mut st, one, now).expect("1 more fits");
    assert_eq!((wide.slots, narrow.slots), (3, 1));
    assert_eq!(st.used(), 4);
    assert_eq!(
        (wide.fencing_token, narrow.fencing_token),
        (5, 6),
        "tokens rise in grant order"
    );
    assert!(try_grant(&mut st, two, now).is_none(), "4 of 4 held");
    let _ = st.release(narrow.lease_id, now);
    assert!(try_grant(&mut st, two, now).is_none(), "3 + 2 is over 4");
    let _ = st.release(wide.lease_id, now);
    let granted = try_grant(&mut st, two, now).expect("room once the 3 go");
    assert_eq!((granted.slots, granted.fencing_token), (2, 7));
    assert_eq!(st.used(), 2);
    assert_eq!(st.holders()[0].limit, 4);
}

#[test]
fn higher_priorities_go_first_and_one_priority_in_arrival_order() {
    let now = Instant::now();
    let mut st = claimed(now);
    let holder = join(&mut st, 1, 1, 0);
    let held = try_grant(&mut st, holder, now).unwrap();
    let tickets = [0, 10, 5, 10].map(|priority| join(&mut st, 1, 1, priority));
    let [zero, ten, five, later_ten] = tickets;
    assert_eq!(order(&st), [ten, later_ten, five, zero]);
    let priorities: Vec<i32> = st.waiters().iter().map(|q| q.priority).collect();
    assert_eq!(priorities, [10, 10, 5, 0]);
    let mut last = held;
    let mut granted = Vec::new();
    while let Some(first) = st.queue.front().map(|q| q.ticket) {
        let _ = st.release(last.lease_id, now);
        // The one place is free: every waiter but the first is refused it.
        for behind in order(&st).into_iter().skip(1) {
            assert!(
                try_grant(&mut st, behind, now).is_none(),
                "{behind} passed {first}"
            );
        }
        last = try_grant(&mut st, first, now).expect("the first in line");
        granted.push(first);
    }
    assert_eq!(granted, [ten, later_ten, five, zero]);
}

#[test]
fn no_later_waiter_of_the_same_or_a_lower_priority_passes_a_wide_first() {
    let now = Instant::now();
    let mut st = claimed(now);
    let holder = join(&mut st, 2, 1, 0);
    let held = try_grant(&mut st, holder, now).unwrap();
    let wide = join(&mut st, 2, 2, 5);
    let same = join(&mut st, 2, 1, 5);
    let lower = join(&mut st, 2, 1, -3);
    // One place is free and the narrow ones would fit: they wait all the same.
    assert!(try_grant(&mut st, wide, now).is_none());
    for narrow in [same, lower] {
        assert_eq!(
            decide(&mut st, narrow, now),
            Step::Wait(now + Duration::from_secs(30)),
            "asleep until the holder's lease ends"
        );
    }
    assert_eq!(st.used(), 1);
    let _ = st.release(held.lease_id, now);
    let first = try_grant(&mut st, wide, now).expect("the wide one first");
    assert_eq!(first.slots, 2);
    assert!(try_grant(&mut st, same, now).is_none(), "2 of 2 held");
    let _ = st.release(first.lease_id, now);
    assert!(try_grant(&mut st, lower, now).is_none(), "the same first");
    assert!(try_grant(&mut st, same, now).is_some());
    assert!(try_grant(&mut st, lower, now).is_some());
}

#[test]
fn a_later_waiter_of_a_higher_priority_goes_ahead_of_a_wide_first() {
    let now = Instant::now();
    let mut st = claimed(now);
    let holder = join(&mut st, 2, 1, 0);
    try_grant(&mut st, holder, now).unwrap();
    let wide = join(&mut st, 2, 2, 0);
    let urgent = join(&mut st, 2, 1, 1);
    assert_eq!(order(&st), [urgent, wide]);
    assert!(try_grant(&mut st, wide, now).is_none());
    assert!(
        try_grant(&mut st, urgent, now).is_some(),
        "it fits, and is first"
    );
}

#[test]
fn the_first_waiter_leaving_lets_the_next_ones_be_granted() {
    let now = Instant::now();
    let mut st = claimed(now);
    let holder = join(&mut st, 3, 1, 0);
    try_grant(&mut st, holder, now).unwrap();
    let wide = join(&mut st, 3, 3, 0);
    let one = join(&mut st, 3, 1, 0);
    let two = join(&mut st, 3, 1, 0);
    assert!(
        try_grant(&mut st, one, now).is_none(),
        "behind the wide one"
    );
    // The wide one gives up (its wait ran out, or its client hung up).
    assert!(st.leave(wide).wake, "those behind it are woken");
    assert_eq!(order(&st), [one, two]);
    assert!(try_grant(&mut st, one, now).is_some());
    assert!(try_grant(&mut st, two, now).is_some());
    assert_eq!(st.used(), 3);
}

#[test]
fn a_waiter_leaving_from_the_middle_keeps_the_order_of_the_rest() {
    let now = Instant::now();
    let mut st = claimed(now);
    let tickets = [3, 2, 1].map(|priority| join(&mut st, 1, 1, priority));
    let _ = st.leave(tickets[1]);
    assert_eq!(order(&st), [tickets[0], tickets[2]]);
    assert!(try_grant(&mut st, tickets[2], now).is_none());
    assert!(try_grant(&mut st, tickets[0], now).is_some());
}

#[test]
fn a_claim_won_grants_its_winner_only_while_it_is_first_and_fits() {
    let now = Instant::now();
    let mut st = SlotState::default();
    let winner = join(&mut st, 2, 1, 0);
    assert_eq!(decide(&mut st, winner, now), Step::Claim(None));
    // A higher priority joins while the winner's claim attempt runs, and
    // waits for it rather than starting one of its own.
    let urgent = join(&mut st, 2, 2, 9);
    assert!(matches!(decide(&mut st, urgent, now), Step::Wait(_)));
    let me = waiter_of(&st, winner, now);
    let won = WonClaim {
        claim: claim(CLAIM, now + Duration::from_secs(600)),
        tokens: TokenBlock { next: 40, last: 99 },
        inherited: Inherited::default(),
        readopted: false,
    };
    let grant = Grant {
        id: &pool(),
        waiter: &me,
        gateway_id: GATEWAY,
        now,
        now_ms: 1_000,
    };
    let adopted = st.claim_won(won, grant, Duration::ZERO);
    assert!(adopted.wake, "the first in line hears of the claim");
    assert!(adopted.out.granted.is_none(), "the winner is not first");
    assert!(!st.claiming, "the attempt ended with the claim taken on");
    let first = try_grant(&mut st, urgent, now).expect("the first in line");
    assert_eq!((first.slots, first.fencing_token), (2, 40));
    assert!(try_grant(&mut st, winner, now).is_none(), "2 of 2 held");
}

#[test]
fn a_dead_authoritys_leases_keep_their_slots_until_they_would_have_expired() {
    let now = Instant::now();
    let mut st = SlotState::default();
    let two = join(&mut st, 4, 2, 0);
    let one = join(&mut st, 4, 1, 0);
    // Its leases of 3 slots and 1 slot would expire in 5 s and 8 s.
    let kept = |slots: usize, secs: u64| orphan(&pool(), 7, slots, secs, now, 1_000);
    let won = WonClaim {
        claim: claim(CLAIM, now + Duration::from_secs(600)),
        tokens: TokenBlock { next: 40, last: 99 },
        inherited: Inherited {
            leases: Vec::new(),
            orphaned: vec![kept(3, 5), kept(1, 8)],
            delays: Vec::new(),
        },
        readopted: false,
    };
    let me = waiter_of(&st, two, now);
    let grant = Grant {
        id: &pool(),
        waiter: &me,
        gateway_id: GATEWAY,
        now,
        now_ms: 1_000,
    };
    assert!(
        st.claim_won(won, grant, Duration::ZERO)
            .out
            .granted
            .is_none()
    );
    // The first waiter sleeps until enough slots come free.
    assert_eq!(
        decide(&mut st, two, now),
        Step::Wait(now + Duration::from_secs(5))
    );
    let five = now + Duration::from_secs(5);
    let granted = try_grant(&mut st, two, five).expect("3 of 4 free at 5 s");
    assert_eq!(granted.fencing_token, 40);
    let last = try_grant(&mut st, one, five).expect("1 + 2 + 1 fit");
    assert_eq!(last.fencing_token, 41);
    assert_eq!(st.used(), 3, "the kept slot is no lease of this gateway's");
}

#[test]
fn a_waiter_out_of_time_behind_kept_slots_is_told_when_they_free() {
    let now = Instant::now();
    let mut st = claimed(now);
    let wide = join(&mut st, 4, 4, 0);
    st.delayed = vec![
        Delay::ending(3_000, 1, now, 1_000),
        Delay::ending(6_000, 2, now, 1_000),
    ];
    let out_of_time = Waiter {
        slots: 4,
        ..waiter(wide, now)
    };
    st.expire(&pool(), now, &Metrics::default());
    let step = st
        .next_step(&pool(), &out_of_time, &rules(), now, 1_000)
        .out
        .step;
    assert_eq!(
        step,
        Step::Delayed(6_000),
        "all 4 are free only at the later end"
    );
}
