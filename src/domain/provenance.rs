/// Where a change came from, as history records it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Provenance {
    /// The token's name (see `auth::Actor`).
    pub actor: String,
    /// The request's `x-request-id`.
    pub request_id: String,
    /// The client's `User-Agent`, empty when it sent none.
    pub user_agent: String,
    /// Why, when the request said (a restore's `reason`); empty otherwise.
    pub reason: String,
}
