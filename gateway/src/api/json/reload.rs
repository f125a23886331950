//! What `POST /api/v1/reload` changed: the principal lists, the admin
//! token, the connections it closed, TLS, and what waits for a restart.

use serde::Serialize;
use utoipa::ToSchema;

/// A principal list's changes at a reload.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct PrincipalChanges {
    /// Names listed now and not before.
    pub added: Vec<String>,
    /// Names no longer listed.
    pub removed: Vec<String>,
    /// Names listed in both, with a different set of token digests.
    pub rotated: Vec<String>,
}

impl From<&crate::auth::PrincipalChanges> for PrincipalChanges {
    fn from(p: &crate::auth::PrincipalChanges) -> Self {
        let crate::auth::PrincipalChanges {
            added,
            removed,
            rotated,
        } = p;
        PrincipalChanges {
            added: added.clone(),
            removed: removed.clone(),
            rotated: rotated.clone(),
        }
    }
}

/// A connection a reload closed, because its credential was removed or
/// rotated.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct Revoked {
    /// `edge` or `worker`.
    pub role: String,
    /// The name it connected as (an edge's configured name, or a
    /// worker's).
    pub name: String,
    /// Its connection's number.
    pub session: u64,
}

/// What `POST /api/v1/reload` did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct Reloaded {
    /// `[[edges]]` changes.
    pub edges: PrincipalChanges,
    /// `[[workers]]` changes.
    pub workers: PrincipalChanges,
    /// `unchanged`, `set`, `changed` or `removed`.
    pub admin_token: String,
    /// Connections closed, by session.
    pub revoked: Vec<Revoked>,
    /// `reloaded` when the QUIC certificate or key changed and now serves
    /// new handshakes, else `unchanged`.
    pub tls: String,
    /// Sections that differ from the running configuration and were not
    /// applied: they take effect at the next restart.
    pub needs_restart: Vec<String>,
}

impl From<&crate::reload::ReloadReport> for Reloaded {
    fn from(r: &crate::reload::ReloadReport) -> Self {
        let crate::reload::ReloadReport {
            credentials,
            tls,
            needs_restart,
        } = r;
        let crate::auth::CredentialChanges {
            edges,
            workers,
            admin_token,
            revoked,
        } = credentials;
        Reloaded {
            edges: edges.into(),
            workers: workers.into(),
            admin_token: (*admin_token).into(),
            revoked: revoked
                .iter()
                .map(|r| {
                    let crate::auth::Revoked {
                        role,
                        name,
                        session,
                    } = r;
                    Revoked {
                        role: match role {
                            tidegate_protocol::Role::Edge => "edge",
                            tidegate_protocol::Role::Worker => "worker",
                        }
                        .into(),
                        name: name.clone(),
                        session: *session,
                    }
                })
                .collect(),
            tls: (*tls).into(),
            needs_restart: needs_restart.iter().map(|s| (*s).into()).collect(),
        }
    }
}
