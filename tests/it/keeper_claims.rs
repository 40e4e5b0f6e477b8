//! The KeeperMap claims table on two ClickHouse nodes (two chDB processes on
//! one ZooKeeper, whose MergeTree tables never meet): what the keeper
//! coordination builds on.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use statehouse::config::parse_clickhouse_url;
use statehouse::domain::{Coordination, StateId};
use statehouse::metrics::Metrics;
use statehouse::store::{
    ClaimRead, ClickHouse, History, Identifier, KeeperClaimStore, Layout, NewClaim, Outcome, Store,
};
use uuid::Uuid;

use crate::helpers::{clickhouse_url, node_b_url, unique_schema};

/// The claims of `schema` through the ClickHouse at `url`, tables made,
/// every query bounded by `timeout`.
pub async fn claims_at(url: &str, schema: &str, timeout: Duration) -> KeeperClaimStore {
    let target = parse_clickhouse_url(url).expect("a valid ClickHouse URI");
    let ch = ClickHouse::new(&target, timeout, Arc::new(Metrics::default()));
    let store = Store::with_layout(
        ch,
        Identifier::parse(schema).unwrap(),
        &Identifier::parse("state").unwrap(),
        History::Off,
        Layout {
            coordination: Coordination::Keeper,
            cluster: None,
            ..Layout::default()
        },
    );
    store.ensure_schema().await.expect("tables made");
    store.ensure_claims().await.expect("claims table made");
    store.claims
}

/// Runs every future at once, each on its own task; their outputs in order.
async fn all<T: Send + 'static>(
    futures: impl IntoIterator<Item = impl Future<Output = T> + Send + 'static>,
) -> Vec<T> {
    let tasks: Vec<_> = futures.into_iter().map(tokio::spawn).collect();
    let mut outputs = Vec::with_capacity(tasks.len());
    for task in tasks {
        outputs.push(task.await.expect("the task finishes"));
    }
    outputs
}

/// The same schema's claims through both nodes.
async fn two_nodes() -> (KeeperClaimStore, KeeperClaimStore) {
    let schema = unique_schema();
    let a = claims_at(&clickhouse_url(), &schema, Duration::from_secs(10)).await;
    let b = claims_at(&node_b_url(), &schema, Duration::from_secs(10)).await;
    (a, b)
}

fn claim(ttl: Duration, tokens: u64) -> NewClaim<'static> {
    NewClaim {
        claim_id: Uuid::new_v4(),
        gateway_id: Uuid::new_v4(),
        advertise_url: "http://127.0.0.1:1",
        ttl,
        tokens,
    }
}

fn id(raw: &str) -> StateId {
    StateId::parse(raw.to_owned()).unwrap()
}

/// Reads `id`'s key. ZooKeeper starved of CPU (SCRIPTS_TEST_STRESS) loses
/// a connection now and then: a read that fails is asked again for up to
/// 120 s, as the gateway asks again after a 503.
async fn read_key(claims: &KeeperClaimStore, id: &StateId) -> ClaimRead {
    let give_up = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        match claims.read(id).await {
            Ok(read) => return read,
            Err(err) if tokio::time::Instant::now() < give_up => {
                eprintln!("claim read failed, asked again: {err}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(err) => panic!("the claim could not be read for 120 s: {err}"),
        }
    }
}

/// Reads until the server's clock says the claim has lapsed.
async fn until_lapsed(claims: &KeeperClaimStore, id: &StateId) -> ClaimRead {
    loop {
        let read = read_key(claims, id).await;
        let claim = read.claim.as_ref().expect("the key exists");
        if claim.takeable(read.now_ms) {
            return read;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn exactly_one_of_concurrent_creates_on_two_nodes_wins_and_both_see_it() {
    let (a, b) = two_nodes().await;
    let target = id("dev:contested");
    let contenders: Vec<_> = (0..8).map(|_| claim(Duration::from_secs(30), 1)).collect();
    let attempts = contenders.iter().enumerate().map(|(i, c)| {
        let node = if i % 2 == 0 { a.clone() } else { b.clone() };
        let target = target.clone();
        let c = c.clone();
        async move { node.create(&target, &c).await.unwrap() }
    });
    let outcomes = all(attempts).await;
    let winners: Vec<_> = outcomes
        .iter()
        .zip(&contenders)
        .filter(|(outcome, _)| **outcome == Outcome::Done)
        .map(|(_, c)| c.claim_id)
        .collect();
    assert_eq!(winners.len(), 1, "{outcomes:?}");
    assert_eq!(
        outcomes.iter().filter(|o| **o == Outcome::Refused).count(),
        7,
        "{outcomes:?}"
    );
    for node in [&a, &b] {
        let read = read_key(node, &target).await;
        let claim = read.claim.unwrap();
        assert_eq!(claim.holder_claim_id(), winners[0]);
        assert_eq!(claim.last_token, 1);
        assert!(!claim.takeable(read.now_ms));
    }
}

#[tokio::test]
async fn a_missing_key_reads_as_none_with_the_server_clock() {
    let (a, _) = two_nodes().await;
    let read = read_key(&a, &id("never-claimed")).await;
    assert_eq!(read.claim, None);
    assert!(read.now_ms > 1_700_000_000_000, "{}", read.now_ms);
}

#[tokio::test]
async fn only_the_holder_renews_and_a_renewal_extends_the_expiry() {
    let (a, b) = two_nodes().await;
    let target = id("dev:renewed");
    let mine = claim(Duration::from_secs(5), 1);
    assert_eq!(a.create(&target, &mine).await.unwrap(), Outcome::Done);
    let before = read_key(&b, &target).await.claim.unwrap();

    let stranger = Uuid::new_v4();
    assert_eq!(
        b.renew(&target, stranger, Duration::from_secs(60))
            .await
            .unwrap(),
        Outcome::Refused
    );
    assert_eq!(
        read_key(&b, &target).await.claim.unwrap(),
        before,
        "a refused renewal changes nothing"
    );

    assert_eq!(
        a.renew(&target, mine.claim_id, Duration::from_secs(60))
            .await
            .unwrap(),
        Outcome::Done
    );
    let after = read_key(&b, &target).await.claim.unwrap();
    let (old, new) = (before.holder.unwrap(), after.holder.unwrap());
    assert_eq!(new.claim_id, mine.claim_id);
    assert!(new.expires_ms > old.expires_ms, "{old:?} -> {new:?}");
}

#[tokio::test]
async fn only_a_lapsed_claim_is_taken_over_and_then_its_old_holder_has_lost_it() {
    let (a, b) = two_nodes().await;
    let target = id("dev:lapsing");
    // Live for the next statement on however loaded a machine (under
    // SCRIPTS_TEST_STRESS a 400 ms claim, then a 10 s one, had lapsed before
    // the take-over landed); it is made to lapse below, by a renewal.
    let first = claim(Duration::from_secs(600), 5);
    assert_eq!(a.create(&target, &first).await.unwrap(), Outcome::Done);

    let second = claim(Duration::from_secs(30), 5);
    assert_eq!(
        b.take_over(&target, first.claim_id, 5, &second)
            .await
            .unwrap(),
        Outcome::Refused,
        "a live claim is not taken"
    );

    // A renewal for no time at all: the claim lapses at once.
    assert_eq!(
        a.renew(&target, first.claim_id, Duration::ZERO)
            .await
            .unwrap(),
        Outcome::Done
    );
    let lapsed = until_lapsed(&b, &target).await;
    let seen = lapsed.claim.unwrap();
    // A stale view (wrong holder, wrong token mark) takes nothing either.
    assert_eq!(
        b.take_over(&target, Uuid::new_v4(), seen.last_token, &second)
            .await
            .unwrap(),
        Outcome::Refused
    );
    assert_eq!(
        b.take_over(
            &target,
            seen.holder_claim_id(),
            seen.last_token + 1,
            &second
        )
        .await
        .unwrap(),
        Outcome::Refused
    );
    assert_eq!(
        b.take_over(&target, seen.holder_claim_id(), seen.last_token, &second)
            .await
            .unwrap(),
        Outcome::Done
    );

    let now = read_key(&a, &target).await.claim.unwrap();
    assert_eq!(now.holder_claim_id(), second.claim_id);
    assert_eq!(now.last_token, 10, "the takeover reserved tokens 6..=10");
    for outcome in [
        a.renew(&target, first.claim_id, Duration::from_secs(30))
            .await
            .unwrap(),
        a.release(&target, first.claim_id).await.unwrap(),
        a.reserve_tokens(&target, first.claim_id, 10, 20)
            .await
            .unwrap(),
    ] {
        assert_eq!(outcome, Outcome::Refused);
    }
    assert_eq!(
        read_key(&a, &target).await.claim.unwrap(),
        now,
        "the old holder changed nothing"
    );
}

#[tokio::test]
async fn of_concurrent_takeovers_of_a_lapsed_claim_exactly_one_wins() {
    let (a, b) = two_nodes().await;
    let target = id("dev:race");
    let first = claim(Duration::from_millis(300), 1);
    assert_eq!(a.create(&target, &first).await.unwrap(), Outcome::Done);
    let seen = until_lapsed(&a, &target).await.claim.unwrap();

    let contenders: Vec<_> = (0..6).map(|_| claim(Duration::from_secs(30), 1)).collect();
    let attempts = contenders.iter().enumerate().map(|(i, c)| {
        let node = if i % 2 == 0 { a.clone() } else { b.clone() };
        let (target, c, seen) = (target.clone(), c.clone(), seen.clone());
        async move {
            node.take_over(&target, seen.holder_claim_id(), seen.last_token, &c)
                .await
                .unwrap()
        }
    });
    let outcomes = all(attempts).await;
    assert_eq!(
        outcomes.iter().filter(|o| **o == Outcome::Done).count(),
        1,
        "{outcomes:?}"
    );
    assert!(
        outcomes
            .iter()
            .all(|o| matches!(o, Outcome::Done | Outcome::Refused | Outcome::Raced)),
        "{outcomes:?}"
    );
    let winner = contenders
        .iter()
        .zip(&outcomes)
        .find(|(_, o)| **o == Outcome::Done)
        .unwrap()
        .0;
    let now = read_key(&b, &target).await.claim.unwrap();
    assert_eq!(now.holder_claim_id(), winner.claim_id);
    assert_eq!(now.last_token, 2);
}

#[tokio::test]
async fn tokens_never_go_backwards_across_release_and_a_new_holder() {
    let (a, b) = two_nodes().await;
    let target = id("dev:tokens");
    let first = claim(Duration::from_secs(30), 10);
    assert_eq!(a.create(&target, &first).await.unwrap(), Outcome::Done);
    assert_eq!(
        a.reserve_tokens(&target, first.claim_id, 10, 25)
            .await
            .unwrap(),
        Outcome::Done
    );
    // Reservations only go up, and only from the mark the holder read.
    assert_eq!(
        a.reserve_tokens(&target, first.claim_id, 25, 20)
            .await
            .unwrap(),
        Outcome::Refused
    );
    assert_eq!(
        a.reserve_tokens(&target, first.claim_id, 10, 30)
            .await
            .unwrap(),
        Outcome::Refused
    );
    assert_eq!(
        a.release(&target, first.claim_id).await.unwrap(),
        Outcome::Done
    );

    let released = read_key(&b, &target).await;
    let key = released.claim.unwrap();
    assert_eq!(key.holder, None);
    assert_eq!(key.last_token, 25, "the mark outlives the claim");
    assert!(key.takeable(released.now_ms));

    let second = claim(Duration::from_secs(30), 10);
    assert_eq!(
        b.create(&target, &second).await.unwrap(),
        Outcome::Refused,
        "a released key is taken over, not made again"
    );
    assert_eq!(
        b.take_over(&target, Uuid::nil(), 25, &second)
            .await
            .unwrap(),
        Outcome::Done
    );
    let now = read_key(&a, &target).await.claim.unwrap();
    assert_eq!(now.holder_claim_id(), second.claim_id);
    assert_eq!(now.last_token, 35, "the new holder's tokens start at 26");
}

#[tokio::test]
async fn a_waiter_marks_the_claim_and_the_holder_sees_it_until_it_lets_go() {
    let (a, b) = two_nodes().await;
    let target = id("dev:waited");
    let other = id("dev:unwaited");
    let holder = claim(Duration::from_secs(30), 1);
    assert_eq!(a.create(&target, &holder).await.unwrap(), Outcome::Done);
    assert_eq!(a.create(&other, &holder).await.unwrap(), Outcome::Done);

    let waiter = Uuid::new_v4();
    assert_eq!(
        b.mark_waiting(&target, Uuid::new_v4(), waiter)
            .await
            .unwrap(),
        Outcome::Refused,
        "a mark for a claim that is not there is refused"
    );
    assert_eq!(
        b.mark_waiting(&target, holder.claim_id, waiter)
            .await
            .unwrap(),
        Outcome::Done
    );
    assert_eq!(
        b.mark_waiting(&target, holder.claim_id, Uuid::new_v4())
            .await
            .unwrap(),
        Outcome::Done
    );

    let seen = a.read_many(&[target.clone(), other.clone()]).await.unwrap();
    let waiting: Vec<_> = seen
        .iter()
        .map(|(id, read)| {
            (
                id.as_str().to_owned(),
                read.claim.as_ref().unwrap().waiting_gateway,
            )
        })
        .collect();
    assert_eq!(waiting.len(), 2);
    assert!(
        waiting.contains(&("dev:waited".to_owned(), Some(waiter))),
        "the first waiter's mark stays: {waiting:?}"
    );
    assert!(waiting.contains(&("dev:unwaited".to_owned(), None)));

    assert_eq!(
        a.renew(&target, holder.claim_id, Duration::from_secs(30))
            .await
            .unwrap(),
        Outcome::Done
    );
    assert_eq!(
        a.release(&target, holder.claim_id).await.unwrap(),
        Outcome::Done
    );
    let after = read_key(&b, &target).await.claim.unwrap();
    assert_eq!((after.holder, after.waiting_gateway), (None, None));
}
