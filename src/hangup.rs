//! SIGHUP, taken over for as long as the gateway serves, so that it never
//! ends the process (its default), and told to everything that reloads on
//! it: the TLS certificate and the tokens.

use tokio::sync::broadcast;
use tokio::task::JoinHandle;

pub struct Hangups {
    sender: broadcast::Sender<()>,
    listening: JoinHandle<()>,
}

impl Hangups {
    /// Takes the signal over at once, not when a task first runs: from the
    /// return on, a SIGHUP no longer ends the process.
    #[cfg(unix)]
    pub fn listen() -> Self {
        use tokio::signal::unix::{SignalKind, signal};
        let (sender, _) = broadcast::channel(4);
        let hangups = signal(SignalKind::hangup());
        let tell = sender.clone();
        let listening = tokio::spawn(async move {
            let mut hangups = match hangups {
                Ok(hangups) => hangups,
                Err(err) => {
                    tracing::error!(error = %err, "cannot watch for SIGHUP: nothing reloads on it (the tokens file is still watched)");
                    return;
                }
            };
            while hangups.recv().await.is_some() {
                tracing::info!("SIGHUP: reloading");
                // Nobody listening (no TLS, no tokens file) is fine.
                let _ = tell.send(());
            }
        });
        Self { sender, listening }
    }

    /// No SIGHUP here: nothing is told.
    #[cfg(not(unix))]
    pub fn listen() -> Self {
        let (sender, _) = broadcast::channel(4);
        Self {
            sender,
            listening: tokio::spawn(async {}),
        }
    }

    pub fn subscribe(&self) -> broadcast::Receiver<()> {
        self.sender.subscribe()
    }
}

impl Drop for Hangups {
    fn drop(&mut self) {
        self.listening.abort();
    }
}
