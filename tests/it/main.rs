//! Integration tests, one binary: a real gateway on a real ClickHouse engine
//! (the project's local ClickHouse, see localch/), over HTTP.

mod auth;
mod bad_input;
mod balancer;
mod bookmark_regressions;
mod bookmarks;
mod bulk;
mod cli;
mod clickhouse_faults;
mod contract;
mod coordination_start;
mod dashboards;
mod first_start;
mod gateways;
mod group_commit;
mod helpers;
mod history;
mod https;
mod keeper_claims;
mod keeper_locks;
mod keeper_loss;
mod lock_cancellation;
mod lock_concurrency;
mod lock_faults;
mod locks_api;
mod logs;
mod overload;
mod packaging;
mod proxy;
mod run_lease;
mod run_lease_tls;
mod run_lease_tree;
mod seed_compat;
mod slow_clients;
mod states_api;
mod tls;
