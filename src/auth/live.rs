//! The tokens in use: read by every request, replaced whole by a reload, so
//! a request sees either the old set or the new one and never half of each.

use std::sync::{Arc, PoisonError, RwLock};

use super::Tokens;
use super::jwt::JwtAuth;

pub struct LiveTokens {
    current: RwLock<Arc<Tokens>>,
    /// The JWT issuers, which reload themselves (see `jwt`).
    jwt: Option<Arc<JwtAuth>>,
}

impl LiveTokens {
    pub fn new(tokens: Tokens, jwt: Option<Arc<JwtAuth>>) -> Self {
        Self {
            current: RwLock::new(Arc::new(tokens)),
            jwt,
        }
    }

    /// Whether requests must present a credential: the gateway has tokens
    /// or JWT issuers.
    pub fn required(&self) -> bool {
        self.jwt.is_some() || !self.current().is_empty()
    }

    pub fn jwt(&self) -> Option<&Arc<JwtAuth>> {
        self.jwt.as_ref()
    }

    /// The set to check a request against; a reload meanwhile does not change it.
    pub fn current(&self) -> Arc<Tokens> {
        // The lock guards a pointer swap, which cannot panic half-way.
        self.current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    pub fn replace(&self, tokens: Tokens) {
        *self.current.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(tokens);
    }
}
