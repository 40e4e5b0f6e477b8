//! Logging: human-readable text by default, one JSON object per line on request.

use tracing_subscriber::EnvFilter;

use crate::config::LogFormat;

/// `RUST_LOG` refines the level (default `info`).
pub fn init(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let result = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .try_init(),
    };
    // Already initialized (tests build several apps in one process): keep the first.
    drop(result);
}
