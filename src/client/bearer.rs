//! The bearer token a client presents: one given outright, or the content of
//! `--token-file`, read again for every request so that a token the platform
//! rotates in place (a Kubernetes projected service account token, a CI job's
//! ID token) keeps a long run going. A read that fails or finds the file
//! empty (caught mid-replacement) presents the last token read.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

#[derive(Clone, Debug, Default)]
pub struct Bearer {
    fixed: Option<String>,
    file: Option<Arc<TokenFile>>,
}

#[derive(Debug)]
struct TokenFile {
    path: PathBuf,
    last: Mutex<String>,
}

impl Bearer {
    /// A token that never changes; None or empty is no token.
    pub fn fixed(token: Option<String>) -> Self {
        Self {
            fixed: token.filter(|t| !t.is_empty()),
            file: None,
        }
    }

    /// The token in `path`, which must be readable now.
    pub fn file(path: &Path) -> Result<Self, String> {
        let token = read(path)?;
        Ok(Self {
            fixed: None,
            file: Some(Arc::new(TokenFile {
                path: path.to_owned(),
                last: Mutex::new(token),
            })),
        })
    }

    /// The token to present now, if any.
    pub fn current(&self) -> Option<String> {
        let Some(file) = &self.file else {
            return self.fixed.clone();
        };
        // The lock guards an assignment, which cannot panic half-way.
        let mut last = file.last.lock().unwrap_or_else(PoisonError::into_inner);
        if let Ok(token) = read(&file.path).map_err(|why| {
            tracing::debug!(%why, "token file not read again; presenting the last token read");
        }) && !token.is_empty()
        {
            *last = token;
        }
        Some(last.clone()).filter(|t| !t.is_empty())
    }

    /// `request` with the token, when there is one.
    pub fn authorize(&self, request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match self.current() {
            Some(token) => request.bearer_auth(token),
            None => request,
        }
    }
}

/// The file's token: its text without surrounding whitespace.
fn read(path: &Path) -> Result<String, String> {
    std::fs::read_to_string(path)
        .map(|text| text.trim().to_owned())
        .map_err(|e| format!("cannot read the token file {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_file_is_read_again_and_its_last_token_kept() {
        let dir = std::env::temp_dir().join(format!("statehouse-bearer-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("token");
        std::fs::write(&path, "first\n").unwrap();
        let bearer = Bearer::file(&path).unwrap();
        assert_eq!(bearer.current().as_deref(), Some("first"));
        std::fs::write(&path, "  second ").unwrap();
        assert_eq!(bearer.current().as_deref(), Some("second"));
        std::fs::write(&path, "").unwrap();
        assert_eq!(
            bearer.current().as_deref(),
            Some("second"),
            "caught mid-write"
        );
        std::fs::remove_file(&path).unwrap();
        assert_eq!(bearer.current().as_deref(), Some("second"), "gone a moment");
        assert!(Bearer::file(&path).is_err(), "unreadable at the start");
        assert_eq!(Bearer::fixed(Some(String::new())).current(), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
