//! The tokens in use: read by every request, replaced whole by a reload, so
//! a request sees either the old set or the new one and never half of each.

use std::sync::{Arc, PoisonError, RwLock};

use super::Tokens;

pub struct LiveTokens {
    current: RwLock<Arc<Tokens>>,
}

impl LiveTokens {
    pub fn new(tokens: Tokens) -> Self {
        Self {
            current: RwLock::new(Arc::new(tokens)),
        }
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
