//! The gateway's own clock, as the store keeps times.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// This machine's clock in milliseconds since the epoch, as versions and lease times are kept.
pub(crate) fn now_ms() -> i64 {
    let since_epoch = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO);
    i64::try_from(since_epoch.as_millis()).unwrap_or(i64::MAX)
}
