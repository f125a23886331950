//! Token checking, and the credentials in force. Tokens are stored as
//! SHA-256 hex digests, never in clear, and compared in constant time.
//!
//! [`Access`] holds the credentials (`[[edges]]`, `[[workers]]`, the admin
//! token) and the connections they let in. A reload swaps the credentials
//! whole ([`Access::replace`]) and revokes every connection whose name and
//! token are no longer listed.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Mutex;

use serde::Serialize;
use sha2::{Digest, Sha256};
use tidegate_protocol::Role;
use tokio_util::sync::CancellationToken;

use crate::config::{Config, Principal};

/// The SHA-256 hex digest of a token, as stored in the config.
pub fn hash_token(token: &str) -> String {
    let digest = Sha256::digest(token.as_bytes());
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether `token` hashes to `stored` (a hex digest), in constant time.
pub fn token_matches(token: &str, stored: &str) -> bool {
    let got = hash_token(token);
    let (a, b) = (
        got.as_bytes(),
        stored.trim().to_ascii_lowercase().into_bytes(),
    );
    a.len() == b.len() && a.iter().zip(&b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Who may connect and who may use the mutating API routes: the part of the
/// configuration a reload swaps while the gateway runs.
#[derive(Debug, Clone, Default)]
pub struct Credentials {
    /// `[[edges]]`.
    pub edges: Vec<Principal>,
    /// `[[workers]]` (workers that are not leased).
    pub workers: Vec<Principal>,
    /// `http.admin_token_sha256`.
    pub admin_token_sha256: Option<String>,
}

impl Credentials {
    /// The credentials of `config`.
    pub fn from_config(config: &Config) -> Self {
        Credentials {
            edges: config.edges.clone(),
            workers: config.workers.clone(),
            admin_token_sha256: config.http.admin_token_sha256.clone(),
        }
    }

    fn principals(&self, role: Role) -> &[Principal] {
        match role {
            Role::Edge => &self.edges,
            Role::Worker => &self.workers,
        }
    }

    /// The digest `token` matched for `name` in `role`, if any.
    fn authenticate(&self, role: Role, name: &str, token: &str) -> Option<String> {
        self.principals(role)
            .iter()
            .find(|p| p.name == name && token_matches(token, &p.token_sha256))
            .map(|p| normalise(&p.token_sha256))
    }

    /// Whether `name` with the token whose digest is `digest` is still listed.
    fn allows(&self, role: Role, name: &str, digest: &str) -> bool {
        self.principals(role)
            .iter()
            .any(|p| p.name == name && normalise(&p.token_sha256) == digest)
    }
}

fn normalise(digest: &str) -> String {
    digest.trim().to_ascii_lowercase()
}

/// How one list of principals changed, by name.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct PrincipalChanges {
    /// Names listed now and not before.
    pub added: Vec<String>,
    /// Names no longer listed.
    pub removed: Vec<String>,
    /// Names listed in both, with a different set of token digests.
    pub rotated: Vec<String>,
}

impl PrincipalChanges {
    /// Compares two lists (a name may be listed more than once, with
    /// different tokens).
    pub fn between(old: &[Principal], new: &[Principal]) -> Self {
        let digests = |ps: &[Principal]| {
            let mut m: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
            for p in ps {
                m.entry(p.name.clone())
                    .or_default()
                    .insert(normalise(&p.token_sha256));
            }
            m
        };
        let (old, new) = (digests(old), digests(new));
        let mut c = PrincipalChanges::default();
        for (name, d) in &new {
            match old.get(name) {
                None => c.added.push(name.clone()),
                Some(o) if o != d => c.rotated.push(name.clone()),
                Some(_) => {}
            }
        }
        c.removed = old
            .keys()
            .filter(|n| !new.contains_key(*n))
            .cloned()
            .collect();
        c
    }
}

/// A connection closed because a reload took its credentials away.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Revoked {
    /// `edge` or `worker`.
    pub role: Role,
    /// The name it connected as.
    pub name: String,
    /// Its connection's session number.
    pub session: u64,
}

/// What a change of credentials did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CredentialChanges {
    /// `[[edges]]` changes.
    pub edges: PrincipalChanges,
    /// `[[workers]]` changes.
    pub workers: PrincipalChanges,
    /// `unchanged`, `set`, `changed` or `removed`.
    pub admin_token: &'static str,
    /// Connections closed, sorted by session.
    pub revoked: Vec<Revoked>,
}

/// A connection authenticated from the credentials (not a leased worker).
#[derive(Debug)]
struct Live {
    role: Role,
    name: String,
    digest: String,
    revoke: CancellationToken,
}

#[derive(Debug)]
struct AccessState {
    credentials: Credentials,
    live: HashMap<u64, Live>,
}

/// The credentials in force and the connections they let in. Checking a
/// `Hello` and recording its connection happen under the same lock as a
/// reload's swap, so no connection slips in on credentials just removed.
#[derive(Debug)]
pub struct Access {
    state: Mutex<AccessState>,
}

/// A connection let in by [`Access::admit`]; dropping it forgets the
/// connection. `revoked` fires when a reload takes its credentials away.
#[derive(Debug)]
pub struct Admitted<'a> {
    access: &'a Access,
    session: u64,
    /// Cancelled when the connection's credentials are revoked.
    pub revoked: CancellationToken,
}

impl Drop for Admitted<'_> {
    fn drop(&mut self) {
        self.access.lock().live.remove(&self.session);
    }
}

impl Access {
    /// Access under `credentials`, with no connection yet.
    pub fn new(credentials: Credentials) -> Self {
        Access {
            state: Mutex::new(AccessState {
                credentials,
                live: HashMap::new(),
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, AccessState> {
        // The state stays consistent even if a holder panicked: every
        // change under the lock is a single insert, remove or swap.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Lets `name` in as `role` for connection `session` if `token` matches
    /// one of its listed digests.
    pub fn admit(&self, session: u64, role: Role, name: &str, token: &str) -> Option<Admitted<'_>> {
        let mut s = self.lock();
        let digest = s.credentials.authenticate(role, name, token)?;
        let revoke = CancellationToken::new();
        s.live.insert(
            session,
            Live {
                role,
                name: name.to_string(),
                digest,
                revoke: revoke.clone(),
            },
        );
        Some(Admitted {
            access: self,
            session,
            revoked: revoke,
        })
    }

    /// The weight of the edge `name` in force (1 when it is not listed).
    pub fn edge_weight(&self, name: &str) -> u32 {
        self.lock()
            .credentials
            .edges
            .iter()
            .find(|p| p.name == name)
            .map_or(1, Principal::weight)
    }

    /// The admin token's digest in force.
    pub fn admin_token_sha256(&self) -> Option<String> {
        self.lock().credentials.admin_token_sha256.clone()
    }

    /// Swaps in `new` and revokes every connection whose name and token it
    /// no longer lists.
    pub fn replace(&self, new: Credentials) -> CredentialChanges {
        let mut s = self.lock();
        let old = std::mem::replace(&mut s.credentials, new);
        let new = &s.credentials;
        let admin_token = match (&old.admin_token_sha256, &new.admin_token_sha256) {
            (None, None) => "unchanged",
            (None, Some(_)) => "set",
            (Some(_), None) => "removed",
            (Some(a), Some(b)) if normalise(a) == normalise(b) => "unchanged",
            (Some(_), Some(_)) => "changed",
        };
        let mut revoked: Vec<Revoked> = s
            .live
            .iter()
            .filter(|(_, l)| !l.revoke.is_cancelled() && !new.allows(l.role, &l.name, &l.digest))
            .map(|(session, l)| {
                l.revoke.cancel();
                Revoked {
                    role: l.role,
                    name: l.name.clone(),
                    session: *session,
                }
            })
            .collect();
        revoked.sort_by_key(|r| r.session);
        CredentialChanges {
            edges: PrincipalChanges::between(&old.edges, &new.edges),
            workers: PrincipalChanges::between(&old.workers, &new.workers),
            admin_token,
            revoked,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_matches_only_its_own_digest() {
        let stored = hash_token("s3cret");
        assert_eq!(stored.len(), 64);
        assert!(token_matches("s3cret", &stored));
        assert!(token_matches("s3cret", &stored.to_uppercase()));
        assert!(!token_matches("s3creT", &stored));
        assert!(!token_matches("", &stored));
    }

    fn principal(name: &str, token: &str) -> Principal {
        Principal {
            name: name.into(),
            token_sha256: hash_token(token),
            weight: None,
        }
    }

    fn creds(edges: &[(&str, &str)], workers: &[(&str, &str)], admin: Option<&str>) -> Credentials {
        Credentials {
            edges: edges.iter().map(|(n, t)| principal(n, t)).collect(),
            workers: workers.iter().map(|(n, t)| principal(n, t)).collect(),
            admin_token_sha256: admin.map(hash_token),
        }
    }

    #[test]
    fn admit_checks_role_name_and_token() {
        let access = Access::new(creds(&[("cam", "e")], &[("gpu", "w")], None));
        assert!(access.admit(1, Role::Edge, "cam", "e").is_some());
        assert!(access.admit(2, Role::Edge, "cam", "w").is_none());
        assert!(access.admit(3, Role::Worker, "cam", "e").is_none());
        assert!(access.admit(4, Role::Edge, "gpu", "w").is_none());
        assert!(access.admit(5, Role::Worker, "gpu", "w").is_some());
    }

    #[test]
    fn replace_revokes_removed_and_rotated_and_keeps_the_rest() {
        let access = Access::new(creds(
            &[("a", "ta"), ("b", "tb")],
            &[("w1", "t1"), ("w2", "t2")],
            Some("admin"),
        ));
        let a = access.admit(10, Role::Edge, "a", "ta").expect("a");
        let b = access.admit(11, Role::Edge, "b", "tb").expect("b");
        let w1 = access.admit(12, Role::Worker, "w1", "t1").expect("w1");
        let w2 = access.admit(13, Role::Worker, "w2", "t2").expect("w2");

        // a removed, c added, w2 rotated, admin token changed.
        let changes = access.replace(creds(
            &[("b", "tb"), ("c", "tc")],
            &[("w1", "t1"), ("w2", "new")],
            Some("admin2"),
        ));
        assert_eq!(changes.edges.added, ["c"]);
        assert_eq!(changes.edges.removed, ["a"]);
        assert!(changes.edges.rotated.is_empty());
        assert_eq!(changes.workers.rotated, ["w2"]);
        assert!(changes.workers.added.is_empty() && changes.workers.removed.is_empty());
        assert_eq!(changes.admin_token, "changed");
        let revoked: Vec<(Role, &str, u64)> = changes
            .revoked
            .iter()
            .map(|r| (r.role, r.name.as_str(), r.session))
            .collect();
        assert_eq!(revoked, [(Role::Edge, "a", 10), (Role::Worker, "w2", 13)]);
        assert!(a.revoked.is_cancelled() && w2.revoked.is_cancelled());
        assert!(!b.revoked.is_cancelled() && !w1.revoked.is_cancelled());

        // The old tokens no longer get in; the new ones do.
        assert!(access.admit(20, Role::Edge, "a", "ta").is_none());
        assert!(access.admit(21, Role::Worker, "w2", "t2").is_none());
        assert!(access.admit(22, Role::Worker, "w2", "new").is_some());
        assert!(access.admit(23, Role::Edge, "c", "tc").is_some());
        assert_eq!(access.admin_token_sha256(), Some(hash_token("admin2")));

        // A connection revoked once is not reported again, and a closed
        // connection is forgotten.
        drop(b);
        let again = access.replace(creds(&[("c", "tc")], &[], None));
        assert_eq!(again.edges.removed, ["b"]);
        assert_eq!(again.admin_token, "removed");
        let names: Vec<&str> = again.revoked.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["w1"], "a and w2 were revoked before, b has gone");
        drop((a, w1, w2));
    }

    #[test]
    fn a_name_listed_twice_keeps_the_connections_of_the_token_still_listed() {
        let access = Access::new(creds(&[("cam", "old"), ("cam", "new")], &[], None));
        let old = access
            .admit(1, Role::Edge, "cam", "old")
            .expect("old token");
        let new = access
            .admit(2, Role::Edge, "cam", "new")
            .expect("new token");
        let changes = access.replace(creds(&[("cam", "NEW-unused"), ("cam", "new")], &[], None));
        assert_eq!(changes.edges.rotated, ["cam"]);
        assert_eq!(changes.revoked.len(), 1);
        assert!(old.revoked.is_cancelled());
        assert!(!new.revoked.is_cancelled());
    }

    #[test]
    fn digests_compare_case_insensitively() {
        let mut upper = creds(&[("cam", "t")], &[], Some("x"));
        upper.edges[0].token_sha256 = upper.edges[0].token_sha256.to_uppercase();
        upper.admin_token_sha256 = upper.admin_token_sha256.map(|d| d.to_uppercase());
        let access = Access::new(creds(&[("cam", "t")], &[], Some("x")));
        let conn = access.admit(1, Role::Edge, "cam", "t").expect("admitted");
        let changes = access.replace(upper);
        assert_eq!(changes.edges, PrincipalChanges::default());
        assert_eq!(changes.admin_token, "unchanged");
        assert!(changes.revoked.is_empty());
        assert!(!conn.revoked.is_cancelled());
    }
}
