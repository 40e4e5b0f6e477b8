//! Replacing the tokens while serving: on SIGHUP, and when the tokens file
//! changes. A file that does not give a usable set (unreadable, not
//! parsing, or with no token at all, as an empty or half-written one) keeps
//! the tokens in use, so a reload never switches authentication off.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::broadcast::{self, error::RecvError};

use super::TokenSources;
use super::live::LiveTokens;

/// How often the file is looked at. A change is taken once two looks in a
/// row see the same content: an editor or `cp` midway is not reloaded.
const POLL: Duration = Duration::from_secs(1);

/// Keeps `live` in step with `sources` for as long as it runs.
pub async fn keep_current(
    live: Arc<LiveTokens>,
    sources: TokenSources,
    path: PathBuf,
    mut hangups: broadcast::Receiver<()>,
) {
    let mut seen = contents(&path).await;
    let mut pending: Option<Option<Vec<u8>>> = None;
    let mut polls = tokio::time::interval(POLL);
    polls.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut hangups_open = true;
    loop {
        tokio::select! {
            _ = polls.tick() => {
                let now = contents(&path).await;
                if now == seen {
                    pending = None;
                } else if pending.as_ref() == Some(&now) {
                    seen = now;
                    pending = None;
                    reload(&live, &sources, "the tokens file changed");
                } else {
                    pending = Some(now);
                }
            }
            hangup = hangups.recv(), if hangups_open => match hangup {
                Ok(()) | Err(RecvError::Lagged(_)) => {
                    seen = contents(&path).await;
                    pending = None;
                    reload(&live, &sources, "SIGHUP");
                }
                Err(RecvError::Closed) => hangups_open = false,
            },
        }
    }
}

/// The file's bytes, None when it cannot be read (gone for a moment, say).
async fn contents(path: &std::path::Path) -> Option<Vec<u8>> {
    let path = path.to_owned();
    tokio::task::spawn_blocking(move || std::fs::read(path).ok())
        .await
        .ok()
        .flatten()
}

fn reload(live: &LiveTokens, sources: &TokenSources, why: &str) {
    let in_use = live.current().len();
    match sources.load() {
        Ok(tokens) if tokens.is_empty() => tracing::warn!(
            why,
            in_use,
            "tokens not reloaded: the tokens file has no token (empty, or caught half-written?); keeping the ones in use, since a reload never switches authentication off"
        ),
        Ok(tokens) => {
            tracing::info!(why, tokens = tokens.len(), "tokens reloaded");
            live.replace(tokens);
        }
        // The error names the line and what is wrong with it, never a token.
        Err(error) => {
            tracing::warn!(why, in_use, %error, "tokens not reloaded: keeping the ones in use");
        }
    }
}
