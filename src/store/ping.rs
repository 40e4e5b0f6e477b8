//! The ping, sent beside the clickhouse crate rather than through it: the
//! crate keeps only the body of a failed answer, and the status is what
//! tells a proxy's passing 502 from a web server that is not ClickHouse.

use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper::{Request, StatusCode};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;

use super::error::{StoreError, one_line};
use super::http_client;
use super::target::ClickHouseTarget;
use crate::traces;

/// Enough of an answer to recognize it; a stranger's page can be large.
const ANSWER_LIMIT: usize = 64 * 1024;
/// How much of an unrecognized answer an error message quotes.
const EXCERPT_CHARS: usize = 160;

pub struct Pinger {
    client: Client<HttpsConnector<HttpConnector>, Empty<Bytes>>,
    url: String,
    user: String,
    password: String,
}

impl Pinger {
    pub fn new(target: &ClickHouseTarget) -> Self {
        Self {
            client: http_client::builder().build(http_client::connector(target)),
            // The format is explicit: a user's profile may set another default.
            url: format!("{}/?query=SELECT%201%20FORMAT%20TSV", target.endpoint()),
            user: target.user.clone(),
            password: target.password.clone(),
        }
    }

    /// Ok when ClickHouse answers `1`. A ClickHouse exception comes back as
    /// the crate reports it (`BadResponse("Code: N. ...")`), so one
    /// classification serves both; anything else is `Unrecognized`.
    pub async fn ping(&self) -> Result<(), StoreError> {
        use clickhouse::error::Error;

        let mut request = Request::get(self.url.as_str())
            .header("X-ClickHouse-User", self.user.as_str())
            .header("X-ClickHouse-Key", self.password.as_str());
        // A readiness check's ping is in its request's trace too.
        if let Some(traceparent) = traces::traceparent() {
            request = request.header(traces::TRACEPARENT, traceparent);
        }
        let request = request
            .body(Empty::new())
            .map_err(|err| Error::InvalidParams(Box::new(err)))?;
        let response = self.client.request(request).await.map_err(Error::from)?;
        let status = response.status();
        let header_code = response
            .headers()
            .get("X-ClickHouse-Exception-Code")
            .and_then(|value| value.to_str().ok())
            .map(str::to_owned);
        let mut body = response.into_body();
        let mut bytes = Vec::new();
        while bytes.len() < ANSWER_LIMIT {
            let Some(frame) = body.frame().await else {
                break;
            };
            if let Ok(data) = frame.map_err(Error::from)?.into_data() {
                bytes.extend_from_slice(&data);
            }
        }
        let text = String::from_utf8_lossy(&bytes);
        let text = text.trim();
        if status == StatusCode::OK && header_code.is_none() && text == "1" {
            return Ok(());
        }
        if text.starts_with("Code:") {
            return Err(Error::BadResponse(one_line(text)).into());
        }
        if let Some(code) = header_code {
            return Err(Error::BadResponse(format!("Code: {code}")).into());
        }
        Err(StoreError::Unrecognized {
            status: status.as_u16(),
            excerpt: excerpt(text),
        })
    }
}

fn excerpt(text: &str) -> String {
    let text = one_line(text);
    if text.is_empty() {
        return "(no body)".to_owned();
    }
    match text.char_indices().nth(EXCERPT_CHARS) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text,
    }
}
