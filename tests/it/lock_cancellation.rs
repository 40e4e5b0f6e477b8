//! An acquire abandoned at any await point (the client hung up, so the server
//! dropped its future) never leaves a state_id unlockable, and a lease won
//! late under a slow ClickHouse still lives its TTL, also when its claim's
//! renewal or re-claim runs past the claim TTL.
//!
//! The slot's state sits behind a std mutex that no await point holds, so
//! "waiting to re-lock the slot" is not an await point any more; the points
//! left are the claim attempt (proposal, settle, reads, win), the grant's
//! recording and the wait in line.

use std::sync::Arc;
use std::time::Duration;

use reqwest::StatusCode;
use statehouse::domain::{Coordination, LeaseInfo, StateId};
use statehouse::locks::{Ask, LockManager};
use statehouse::metrics::Metrics;
use statehouse::store::{ClickHouse, Layout, Store};
use tokio::io::AsyncWriteExt;

use crate::api::Reply;
use crate::api::retried_for;
use crate::helpers::{TestApp, metric, spawn_app_with, test_config, unique_schema};
use crate::proxy::{Proxy, spawn_app_behind_proxy};

/// A lock manager of its own on a fresh database, reaching ClickHouse through
/// a proxy the test can slow down, with its maintenance running.
async fn manager(proxy: &Proxy, settle: Duration) -> Arc<LockManager> {
    lock_core(proxy, settle, Kind::Locks).await
}

/// Which lock core: the state_ids' or the pools'.
enum Kind {
    Locks,
    Pools,
}

async fn lock_core(proxy: &Proxy, settle: Duration, kind: Kind) -> Arc<LockManager> {
    let mut config = test_config(&unique_schema());
    proxy.route(&mut config);
    config.locks.settle = settle;
    let metrics = Arc::new(Metrics::default());
    let ch = ClickHouse::new(&config.clickhouse, Duration::from_secs(10), metrics.clone());
    // In the coordination mode of the run (STATEHOUSE_COORDINATION), with
    // its claims table.
    let layout = Layout {
        coordination: config.locks.coordination,
        cluster: None,
        ..Layout::default()
    };
    let store = Store::with_layout(
        ch,
        config.schema.clone(),
        &config.table,
        config.history,
        layout,
    );
    store.ensure_schema().await.expect("tables");
    store.ensure_claims().await.expect("claims table");
    let (leases, claims) = match kind {
        Kind::Locks => (store.leases, store.claims),
        Kind::Pools => (store.pool_leases, store.pool_claims),
    };
    let locks = Arc::new(LockManager::new(
        config.locks.clone(),
        config.query_timeout,
        leases,
        claims,
        metrics,
    ));
    tokio::spawn(locks.clone().maintain());
    locks
}

fn id(text: &str) -> StateId {
    StateId::parse(text.to_owned()).unwrap()
}

/// Polls `acquire` for `after`, then drops it wherever it is.
async fn abandon(locks: &LockManager, state_id: &StateId, wait: Duration, after: Duration) {
    let acquire = locks.acquire(state_id, ask("abandoned", wait));
    if let Ok(result) = tokio::time::timeout(after, acquire).await {
        // Finished before the drop: let it go the ordinary way.
        let lease = result.expect("acquire");
        locks.release(state_id, lease.lease_id).await.unwrap();
    }
}

/// A fresh acquire gets the lease within a wait far shorter than a claim's
/// TTL (10 s): nothing abandoned is left in its way.
async fn fresh_acquire_succeeds(locks: &LockManager, state_id: &StateId) {
    let lease = locks
        .acquire(state_id, ask("fresh", Duration::from_secs(5)))
        .await
        .expect("a fresh acquire after an abandoned one");
    locks.release(state_id, lease.lease_id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_dropped_in_the_settle_leaves_no_candidate_in_the_way() {
    let proxy = Proxy::to_clickhouse().await;
    let locks = manager(&proxy, Duration::from_secs(1)).await;
    let state_id = id("dropped-in-settle");
    abandon(
        &locks,
        &state_id,
        Duration::ZERO,
        Duration::from_millis(400),
    )
    .await;
    fresh_acquire_succeeds(&locks, &state_id).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_dropped_in_line_gives_up_its_place_to_those_behind() {
    let proxy = Proxy::to_clickhouse().await;
    let locks = manager(&proxy, Duration::from_millis(200)).await;
    let state_id = id("dropped-in-line");
    let held = locks
        .acquire(&state_id, ask("holder", Duration::ZERO))
        .await
        .unwrap();
    // One waiter is dropped in line while another waits behind it.
    let behind = {
        let locks = locks.clone();
        let state_id = state_id.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            locks
                .acquire(&state_id, ask("behind", Duration::from_secs(30)))
                .await
        })
    };
    abandon(
        &locks,
        &state_id,
        Duration::from_secs(30),
        Duration::from_millis(300),
    )
    .await;
    locks.release(&state_id, held.lease_id).await.unwrap();
    let next = tokio::time::timeout(Duration::from_secs(20), behind)
        .await
        .expect("the waiter behind is served")
        .unwrap()
        .expect("lease");
    assert_eq!(next.owner, "behind");
    assert!(next.fencing_token > held.fencing_token);
    locks.release(&state_id, next.lease_id).await.unwrap();
    fresh_acquire_succeeds(&locks, &state_id).await;
}

/// Every ClickHouse round trip takes at least 300 ms here, so an acquire
/// passes through its proposal, settle, candidate read, win and grant record
/// over about two seconds; it is dropped at steps across that span while
/// other acquires wait on the same id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquires_dropped_anywhere_in_a_claim_attempt_leave_the_id_lockable() {
    let proxy = Proxy::to_clickhouse().await;
    let locks = manager(&proxy, Duration::from_millis(200)).await;
    for (round, after_ms) in [50u64, 250, 450, 700, 950, 1250, 1550, 1900]
        .into_iter()
        .enumerate()
    {
        let state_id = id(&format!("dropped-at-{round}"));
        proxy.set_delay(Duration::from_millis(300));
        let waiter = {
            let locks = locks.clone();
            let state_id = state_id.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(20)).await;
                locks
                    .acquire(&state_id, ask("waiter", Duration::from_secs(60)))
                    .await
            })
        };
        abandon(
            &locks,
            &state_id,
            Duration::from_secs(60),
            Duration::from_millis(after_ms),
        )
        .await;
        proxy.set_delay(Duration::ZERO);
        let lease = tokio::time::timeout(Duration::from_secs(30), waiter)
            .await
            .unwrap_or_else(|_| panic!("round {round}: the waiter is served"))
            .unwrap()
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
        locks.release(&state_id, lease.lease_id).await.unwrap();
        fresh_acquire_succeeds(&locks, &state_id).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_while_waiting_gives_up_its_place() {
    let app = spawn_app_with(|_| {}).await;
    let (held, _) = app.lease("hung-up", "holder", 60, 0.0).await;

    let addr = app.base.trim_start_matches("http://").to_owned();
    let mut socket = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let body = r#"{"owner": "gone", "ttl_seconds": 60, "wait_seconds": 120}"#;
    let request = format!(
        "POST /v1/locks/hung-up HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    socket.write_all(request.as_bytes()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    drop(socket);

    let next = {
        let api = app.api.clone();
        tokio::spawn(async move { api.lease("hung-up", "next", 60, 60.0).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    app.release("hung-up", &held)
        .await
        .expect(StatusCode::NO_CONTENT);
    let (lease, _) = tokio::time::timeout(Duration::from_secs(30), next)
        .await
        .expect("the next waiter gets the lease once the holder releases")
        .unwrap();
    let shown = app.get("/v1/locks/hung-up").await;
    assert_eq!(shown.json()["owner"], "next");
    app.release("hung-up", &lease)
        .await
        .expect(StatusCode::NO_CONTENT);
}

/// The TTL of the leases won late, and how long their renewal and release
/// are asked again while they answer 503 (a claim being re-won).
const LATE_TTL: u64 = 600;
const LAPSED_WAIT: Duration = Duration::from_secs(300);

/// 100 first acquires at once, each on its own id, through a ClickHouse that
/// takes 100 ms and more per round trip (the local one also queues them):
/// claims are won seconds after their candidates were written, a good part of
/// the claim TTL, and the renewals of 100 claims at once may land late
/// enough that a claim lapses. Every lease must still live its TTL: renewed
/// after 2 s and released, both accepted, at once or after a 503 while a
/// lapsed claim is re-won (which clients retry, as `Retry-After` asks; a
/// 409 would mean the lease was lost).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn leases_won_late_under_a_slow_clickhouse_live_their_ttl() {
    let proxy = Proxy::to_clickhouse().await;
    let app = spawn_app_with(|config| {
        proxy.route(config);
        // Slow is the point here, not unavailable: the local ClickHouse runs
        // two queries at a time for every test at once, so under this load one
        // query can queue for longer than 30 s on the 2-core CI machine.
        config.query_timeout = Duration::from_secs(120);
    })
    .await;
    proxy.set_delay(Duration::from_millis(100));
    let workers: Vec<_> = (0..100)
        .map(|n| {
            let api = app.api.clone();
            tokio::spawn(async move {
                let id = format!("late-{n}");
                // A TTL that outlives the lapses a loaded machine brings.
                let (lease, _) = api.lease(&id, "worker", LATE_TTL, 120.0).await;
                tokio::time::sleep(Duration::from_secs(2)).await;
                // A hundred claims re-won one by one through the slow proxy
                // on a loaded machine take minutes, not the 20 s of `retried`.
                let renewed = retried_for(LAPSED_WAIT, || api.renew(&id, &lease, LATE_TTL)).await;
                renewed.expect_because(StatusCode::OK, format!("{id} renew"));
                let released = retried_for(LAPSED_WAIT, || api.release(&id, &lease)).await;
                released.expect_because(StatusCode::NO_CONTENT, format!("{id} release"));
            })
        })
        .collect();
    for worker in workers {
        worker.await.unwrap();
    }
}

/// What the above meets one claim at a time, made certain: a claim renewal
/// that reaches ClickHouse (or Keeper) only after the claim ran out there,
/// held past the claim TTL here as the load queued it there. No other
/// gateway exists: the claim lapsed and nothing else happened, so its lease
/// is kept (503 meanwhile), the claim is re-won and the lease renews. A 409
/// would mean the refused renewal was taken for another gateway's claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_renewal_that_lands_after_the_claim_ran_out_keeps_its_lease() {
    let mut coordination = Coordination::Table;
    let mut claim_ttl = Duration::ZERO;
    let (app, proxy) = spawn_app_behind_proxy(|config| {
        coordination = config.locks.coordination;
        claim_ttl = config.locks.claim_ttl;
        config.query_timeout = HELD_QUERY_TIMEOUT;
    })
    .await;
    let (lease, _) = app.lease("renewed-late", "worker", KEPT_TTL, 60.0).await;
    // Only the renewal statement of each mode: it keeps a claim that is
    // still live, and refuses one that ran out.
    let renewal: &[&str] = match coordination {
        Coordination::Table => &["INSERT", "toIntervalMillisecond", "FINAL"],
        Coordination::Keeper => &[
            "UPDATE",
            "expires_ms = toUnixTimestamp64Milli",
            "throwIf(claim_id !=",
        ],
    };
    proxy.hold_one_request_containing(renewal, claim_ttl + Duration::from_secs(1));
    let lapsed = async {
        held_once(&proxy).await;
        // The refusal is taken in once counted; nothing touched the lease's
        // slot before (the metrics page reads only pools).
        claim_lapsed(&app).await;
    };
    tokio::time::timeout(Duration::from_secs(60), lapsed)
        .await
        .expect("a renewal was held, and refused");
    kept_through_lapses(&app, "renewed-late", &lease).await;
}

/// A claim lapsed (ClickHouse out of reach), then a re-claim too slow to
/// win: its decision read held past the claim TTL, so its own candidate ran
/// out before it was read. It saw no other gateway's claim, so the lease stays
/// kept, and a later attempt re-wins it. (Keeper mode has no such read
/// between its write and its win: there the attempt simply wins.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_re_claim_too_slow_to_win_keeps_the_lapsed_lease() {
    let (mut claim_ttl, mut coordination) = (Duration::ZERO, Coordination::Table);
    let (app, proxy) = spawn_app_behind_proxy(|config| {
        claim_ttl = config.locks.claim_ttl;
        coordination = config.locks.coordination;
        config.query_timeout = HELD_QUERY_TIMEOUT;
    })
    .await;
    let (lease, _) = app.lease("re-claimed-late", "worker", KEPT_TTL, 60.0).await;
    proxy.set_down(true);
    tokio::time::timeout(Duration::from_secs(60), claim_lapsed(&app))
        .await
        .expect("the claim lapsed with ClickHouse away");
    // An attempt's read of the id's lock rows, not a routing read's. In
    // table mode that is the decision read (its candidate among them), which
    // every attempt sends after its candidate: the settled read that may
    // follow is sent only when other gateways are seen or the decision read
    // came back late, so holding that one held nothing on a quiet lone
    // gateway. In keeper mode, the lease rows read again after the key.
    let read: &[&str] = match coordination {
        Coordination::Table => &["kind_code", "state_id = {id:String}"],
        Coordination::Keeper => &["kind_code", "ORDER BY state_id, created_at"],
    };
    proxy.hold_one_request_containing(read, claim_ttl + Duration::from_secs(1));
    proxy.set_down(false);
    tokio::time::timeout(Duration::from_secs(60), held_once(&proxy))
        .await
        .expect("a re-claim's read was held");
    kept_through_lapses(&app, "re-claimed-late", &lease).await;
}

/// The query timeout of the lapse tests: past the claim TTL and the second
/// more a statement is held, so that the held one is answered, not given up.
const HELD_QUERY_TIMEOUT: Duration = Duration::from_secs(30);

/// The lease TTL of the lapse tests: far longer than the load may keep a
/// claim from being re-won, so that only the gateway can end the lease.
const KEPT_TTL: u64 = 900;

/// The claim lapsed with `lease` kept: it renews and releases, each asked
/// again after every re-win while it is answered 503. The claim TTL is the
/// production one (10 s): a re-claim is a dozen round trips through the
/// local ClickHouse, which the other tests load for seconds at a time, and
/// one that does not fit in the TTL is refused, correctly, and tried again.
/// A re-won claim may lapse again under that load: the 503 then waits for
/// the next re-win, an event, not a time. A 409 would mean the lease was lost.
async fn kept_through_lapses(app: &TestApp, id: &str, lease: &str) {
    let kept = async {
        let renewed = once_re_won(app, || app.renew(id, lease, KEPT_TTL)).await;
        renewed.expect_because(StatusCode::OK, "the lease outlives its lapsed claim");
        let released = once_re_won(app, || app.release(id, lease)).await;
        released.expect_because(StatusCode::NO_CONTENT, "the kept lease releases");
    };
    // Only a guard against a hang: the lease lives far longer.
    tokio::time::timeout(Duration::from_secs(600), kept)
        .await
        .expect("the lapsed claim was re-won");
}

/// `request`'s first answer that is not 503: after each 503 (the claim
/// lapsed, its lease kept), asked again once the gateway has re-won a
/// claim since the request was sent.
async fn once_re_won<F: Future<Output = Reply>>(app: &TestApp, request: impl Fn() -> F) -> Reply {
    loop {
        let before = lock_events(app, CLAIM_READOPTED).await;
        let reply = request().await;
        if reply.status != StatusCode::SERVICE_UNAVAILABLE {
            return reply;
        }
        while lock_events(app, CLAIM_READOPTED).await <= before {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Waits until the proxy has held a request and ClickHouse answered it.
async fn held_once(proxy: &Proxy) {
    while proxy.held_answers().is_empty() {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// How many of `sample`'s lock events the gateway has counted.
async fn lock_events(app: &TestApp, sample: &str) -> f64 {
    let text = app.get("/metrics").await.text;
    metric(&text, sample).unwrap_or(0.0)
}

/// Waits until the gateway has counted a claim lapsed (or lost).
async fn claim_lapsed(app: &TestApp) {
    while lock_events(app, CLAIM_LAPSED).await < 1.0 {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The metrics sample of claims lapsed or lost here.
const CLAIM_LAPSED: &str = r#"statehouse_lock_events_total{event="claim_lapsed"}"#;

/// The metrics sample of lapsed claims re-won with their leases kept.
const CLAIM_READOPTED: &str = r#"statehouse_lock_events_total{event="claim_readopted"}"#;

/// A lease of 30 s for `owner`, waiting up to `wait`.
fn ask(owner: &str, wait: Duration) -> Ask {
    Ask {
        owner: owner.to_owned(),
        limit: 1,
        slots: 1,
        priority: 0,
        ttl: Duration::from_secs(30),
        wait,
        lock_delay: Duration::ZERO,
        info: LeaseInfo::default(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_grant_dropped_while_its_row_is_written_gives_its_place_back() {
    let proxy = Proxy::to_clickhouse().await;
    let pools = lock_core(&proxy, Duration::from_millis(200), Kind::Pools).await;
    let pool = id("dropped-while-recorded");
    // A pool's grant is answered once its row has landed; the row's INSERT
    // is held far past the moment the acquire is dropped.
    proxy.hold_requests_containing(Some((
        &["INSERT", "pool_lease", "RowBinary"],
        Duration::from_secs(3),
    )));
    let acquire = pools.acquire(
        &pool,
        Ask {
            limit: 1,
            ..ask("abandoned", Duration::ZERO)
        },
    );
    let dropped = tokio::time::timeout(Duration::from_millis(1500), acquire).await;
    assert!(
        dropped.is_err(),
        "answered before its row landed: {dropped:?}"
    );
    proxy.hold_requests_containing(None);
    // The place is free again at once, not after the lease's 30 s.
    let next = pools
        .acquire(
            &pool,
            Ask {
                limit: 1,
                ..ask("next", Duration::from_secs(5))
            },
        )
        .await
        .expect("the dropped grant's place is free");
    assert_eq!(next.owner, "next");
    pools.release(&pool, next.lease_id).await.unwrap();
}
