//! Connected edges (`GET /api/v1/edges`).

use serde::Serialize;
use utoipa::ToSchema;

use crate::hub::{EdgeView, Snapshot};

/// A connected edge (one entry per connection).
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct Edge {
    /// Its configured name, as it authenticated.
    pub edge: String,
    /// Its connection's number (the same edge may hold several).
    pub session: u64,
}

impl From<&EdgeView> for Edge {
    fn from(e: &EdgeView) -> Self {
        let EdgeView { id, name } = e;
        Edge {
            edge: name.clone(),
            session: *id,
        }
    }
}

/// Connected edges, one entry per connection.
pub fn edges(s: &Snapshot) -> Vec<Edge> {
    s.edges.iter().map(Edge::from).collect()
}
