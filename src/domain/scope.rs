use super::{StateId, StatePattern};

/// The state_ids a token may name: every one, or those some glob of a list
/// matches. A listing shows the ids its pattern and the scope both match.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Scope(Option<Vec<StatePattern>>);

impl Scope {
    /// Every state_id: a token without `scope=`.
    pub fn everything() -> Self {
        Self(None)
    }

    /// The ids one of `globs` matches; a glob of stars only makes it every id.
    pub fn of(globs: Vec<StatePattern>) -> Self {
        if globs.iter().any(StatePattern::matches_everything) {
            return Self::everything();
        }
        Self(Some(globs))
    }

    /// The globs the scope is made of; None for every id.
    pub fn globs(&self) -> Option<Vec<String>> {
        let globs = self.0.as_ref()?;
        Some(globs.iter().map(ToString::to_string).collect())
    }

    pub fn is_everything(&self) -> bool {
        self.0.is_none()
    }

    pub fn allows(&self, id: &StateId) -> bool {
        self.0
            .as_ref()
            .is_none_or(|globs| globs.iter().any(|glob| glob.matches(id)))
    }

    /// The same language as one RE2 expression for ClickHouse, None for
    /// every id (no condition at all).
    pub fn to_regex(&self) -> Option<String> {
        let globs = self.0.as_ref()?;
        let alternatives: Vec<String> = globs
            .iter()
            .map(|glob| {
                let anchored = glob.to_regex();
                // `(?s)^…$` around each: the alternation gets one of its own.
                anchored["(?s)^".len()..anchored.len() - 1].to_owned()
            })
            .collect();
        Some(format!("(?s)^(?:{})$", alternatives.join("|")))
    }
}

/// The log form: the globs, comma-separated, or `*`.
impl std::fmt::Display for Scope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            None => f.write_str("*"),
            Some(globs) => {
                for (i, glob) in globs.iter().enumerate() {
                    if i > 0 {
                        f.write_str(",")?;
                    }
                    glob.fmt(f)?;
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scope(globs: &[&str]) -> Scope {
        Scope::of(
            globs
                .iter()
                .map(|g| StatePattern::parse(*g).unwrap())
                .collect(),
        )
    }

    fn id(raw: &str) -> StateId {
        StateId::parse(raw.to_owned()).unwrap()
    }

    #[test]
    fn any_glob_admits_an_id() {
        let teams = scope(&["team-a:*", "shared:?"]);
        assert!(teams.allows(&id("team-a:tap-to-target")));
        assert!(teams.allows(&id("shared:1")));
        assert!(!teams.allows(&id("shared:12")));
        assert!(!teams.allows(&id("team-b:tap")));
        assert!(Scope::everything().allows(&id("anything")));
    }

    #[test]
    fn a_star_makes_it_everything() {
        assert!(scope(&["team-a:*", "*"]).is_everything());
        assert_eq!(scope(&["**"]).to_regex(), None);
    }

    #[test]
    fn the_regex_is_one_alternation_anchored_once() {
        assert_eq!(
            scope(&["team-a:*", "x.y?"]).to_regex().as_deref(),
            Some("(?s)^(?:team-a:.*|x\\.y.)$")
        );
    }
}
