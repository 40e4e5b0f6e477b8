use super::StateId;

pub const DEFAULT_PAGE_LIMIT: u32 = 100;
pub const MAX_PAGE_LIMIT: u32 = 1000;

/// Where a listing resumes: after this id, in byte order. On the wire it is
/// opaque (hex of the id), so clients cannot come to depend on its content.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PageCursor(StateId);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cursor is not one this service handed out")]
pub struct InvalidCursor;

impl PageCursor {
    pub fn after(id: StateId) -> Self {
        Self(id)
    }

    pub fn last_seen(&self) -> &StateId {
        &self.0
    }

    pub fn encode(&self) -> String {
        self.0
            .as_str()
            .bytes()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    pub fn decode(raw: &str) -> Result<Self, InvalidCursor> {
        if !raw.len().is_multiple_of(2) {
            return Err(InvalidCursor);
        }
        let bytes = (0..raw.len())
            .step_by(2)
            .map(|i| {
                raw.get(i..i + 2)
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
            })
            .collect::<Option<Vec<u8>>>()
            .ok_or(InvalidCursor)?;
        let text = String::from_utf8(bytes).map_err(|_| InvalidCursor)?;
        StateId::parse(text).map(Self).map_err(|_| InvalidCursor)
    }
}

/// How many ids one page holds: 1 to 1000.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageLimit(u32);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("limit must be between 1 and {MAX_PAGE_LIMIT}")]
pub struct InvalidLimit;

impl PageLimit {
    pub fn parse(raw: Option<u32>) -> Result<Self, InvalidLimit> {
        match raw.unwrap_or(DEFAULT_PAGE_LIMIT) {
            n @ 1..=MAX_PAGE_LIMIT => Ok(Self(n)),
            _ => Err(InvalidLimit),
        }
    }

    pub fn get(self) -> u32 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursor_round_trips_any_id() {
        for id in ["a", "dev:tap/x y", "ünï 🚀", "\"'\\"] {
            let cursor = PageCursor::after(StateId::parse(id).unwrap());
            assert_eq!(PageCursor::decode(&cursor.encode()).unwrap(), cursor);
        }
    }

    #[test]
    fn cursor_rejects_garbage() {
        for raw in ["", "a", "zz", "ff", "é1"] {
            assert_eq!(PageCursor::decode(raw), Err(InvalidCursor), "{raw}");
        }
    }

    #[test]
    fn limit_defaults_and_bounds() {
        assert_eq!(PageLimit::parse(None).unwrap().get(), 100);
        assert_eq!(PageLimit::parse(Some(1000)).unwrap().get(), 1000);
        assert_eq!(PageLimit::parse(Some(0)), Err(InvalidLimit));
        assert_eq!(PageLimit::parse(Some(1001)), Err(InvalidLimit));
    }
}
