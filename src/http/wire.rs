//! What every route writes the same way: the request id's header and the
//! API's one time format.

use axum::http::HeaderName;

pub const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// RFC 3339 UTC with milliseconds, the API's one time format.
pub fn rfc3339_millis(ms: i64) -> String {
    crate::domain::Version::from_millis(ms).to_rfc3339()
}
