//! The live lease table and one-time lease tokens.
//!
//! Each lease is issued a random token that its worker presents once when
//! it registers with the gateway. Only the SHA-256 digest is kept (in memory
//! and in the ledger), and [`LeaseTable::claim`] compares digests in
//! constant time, so a worker cannot register for a lease that is not its
//! own, cannot register twice, and the token cannot be recovered from the
//! ledger file.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::io::Read;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::catalog::Tier;
use crate::lifecycle::{LeaseState, TransitionError};

/// A lease's id (the ledger's row id).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct LeaseId(pub u64);

impl fmt::Display for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "lease-{}", self.0)
    }
}

/// A one-time lease token as handed to a worker. Redacted in `Debug`.
#[derive(Clone, PartialEq, Eq)]
pub struct LeaseToken(String);

impl LeaseToken {
    /// 32 random bytes from the OS, hex-encoded.
    pub fn generate() -> Result<LeaseToken, std::io::Error> {
        let mut buf = [0u8; 32];
        std::fs::File::open("/dev/urandom")?.read_exact(&mut buf)?;
        Ok(LeaseToken(buf.iter().map(|b| format!("{b:02x}")).collect()))
    }

    /// Wraps a token received from a worker.
    pub fn from_secret(s: impl Into<String>) -> LeaseToken {
        LeaseToken(s.into())
    }

    /// The secret, to pass to the worker (env var `TIDEGATE_LEASE_TOKEN`).
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Its SHA-256 digest, the only form that is stored.
    pub fn digest(&self) -> TokenDigest {
        TokenDigest(Sha256::digest(self.0.as_bytes()).into())
    }
}

impl fmt::Debug for LeaseToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("LeaseToken(<redacted>)")
    }
}

/// SHA-256 of a lease token.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct TokenDigest(pub [u8; 32]);

impl TokenDigest {
    /// Constant-time equality: every byte is compared whatever the first
    /// difference, so timing does not reveal a matching prefix.
    pub fn ct_eq(&self, other: &TokenDigest) -> bool {
        let mut acc = 0u8;
        for (a, b) in self.0.iter().zip(other.0.iter()) {
            acc |= std::hint::black_box(a ^ b);
        }
        acc == 0
    }
}

impl fmt::Debug for TokenDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TokenDigest({:02x}{:02x}..)", self.0[0], self.0[1])
    }
}

/// Why a worker's registration was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ClaimError {
    /// No such lease, or it already ended.
    #[error("{0} is not a live lease; the worker should exit")]
    UnknownLease(LeaseId),
    /// The token is not this lease's.
    #[error("token does not match {0}; a worker may only register for its own lease")]
    WrongToken(LeaseId),
    /// The token was already used.
    #[error("{0}'s token was already used; tokens are one-time")]
    AlreadyClaimed(LeaseId),
}

/// Why a table operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TableError {
    /// No such lease.
    #[error("{0} is not in the lease table")]
    Unknown(LeaseId),
    /// The lifecycle forbids it.
    #[error("{id}: {source}")]
    Transition {
        /// The lease.
        id: LeaseId,
        /// The refused transition.
        source: TransitionError,
    },
    /// An id used twice.
    #[error("{0} is already in the lease table")]
    Duplicate(LeaseId),
    /// The lease has ended: its token stays spent.
    #[error("{0} has ended; its token cannot be re-armed")]
    Ended(LeaseId),
}

/// One lease as the gateway sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseEntry {
    /// Its id.
    pub id: LeaseId,
    /// Catalog instance type.
    pub instance_type: String,
    /// Tier.
    pub tier: Tier,
    /// Lifecycle state.
    pub state: LeaseState,
    /// Digest of its one-time token.
    pub token: TokenDigest,
    /// Whether the token was used.
    pub claimed: bool,
}

/// The gateway's in-memory table of leases.
#[derive(Debug, Default)]
pub struct LeaseTable {
    leases: HashMap<LeaseId, LeaseEntry>,
}

impl LeaseTable {
    /// An empty table.
    pub fn new() -> LeaseTable {
        LeaseTable::default()
    }

    /// Adds a lease (from a fresh acquire or restored from the ledger).
    pub fn insert(&mut self, entry: LeaseEntry) -> Result<(), TableError> {
        if self.leases.contains_key(&entry.id) {
            return Err(TableError::Duplicate(entry.id));
        }
        self.leases.insert(entry.id, entry);
        Ok(())
    }

    /// The lease `id`.
    pub fn get(&self, id: LeaseId) -> Option<&LeaseEntry> {
        self.leases.get(&id)
    }

    /// All leases, in id order.
    pub fn entries(&self) -> Vec<&LeaseEntry> {
        let mut v: Vec<&LeaseEntry> = self.leases.values().collect();
        v.sort_by_key(|e| e.id);
        v
    }

    /// Moves a lease through its lifecycle.
    pub fn transition(&mut self, id: LeaseId, to: LeaseState) -> Result<LeaseState, TableError> {
        let e = self.leases.get_mut(&id).ok_or(TableError::Unknown(id))?;
        e.state = e
            .state
            .transition(to)
            .map_err(|source| TableError::Transition { id, source })?;
        Ok(e.state)
    }

    /// Verifies a registering worker's token for `id`, once.
    ///
    /// Succeeds only for a live lease whose stored digest equals the
    /// token's digest (constant-time) and whose token is unused.
    pub fn claim(&mut self, id: LeaseId, token: &LeaseToken) -> Result<(), ClaimError> {
        let e = match self.leases.get_mut(&id) {
            Some(e) if !e.state.is_ended() => e,
            _ => return Err(ClaimError::UnknownLease(id)),
        };
        if !e.token.ct_eq(&token.digest()) {
            return Err(ClaimError::WrongToken(id));
        }
        if e.claimed {
            return Err(ClaimError::AlreadyClaimed(id));
        }
        e.claimed = true;
        Ok(())
    }

    /// Re-arms the claim of a live lease whose worker has no connection:
    /// adopted after a gateway restart, or its link dropped. Its worker
    /// (and only a holder of this lease's token) may register again, once;
    /// a second connection is still refused while the first holds the
    /// claim. Only call it for a lease whose worker the provider verified
    /// alive, or whose connection is gone. An ended lease is refused.
    pub fn rearm_claim(&mut self, id: LeaseId) -> Result<(), TableError> {
        let e = self.leases.get_mut(&id).ok_or(TableError::Unknown(id))?;
        if e.state.is_ended() {
            return Err(TableError::Ended(id));
        }
        e.claimed = false;
        Ok(())
    }

    /// Counts by (instance type, tier, state label): the
    /// `tidegate_leases{type,tier,state}` gauge.
    pub fn counts(&self) -> BTreeMap<(String, Tier, &'static str), u64> {
        let mut m = BTreeMap::new();
        for e in self.leases.values() {
            *m.entry((e.instance_type.clone(), e.tier, e.state.label()))
                .or_insert(0) += 1;
        }
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lifecycle::EndReason;

    fn table_with(id: u64) -> (LeaseTable, LeaseToken) {
        let token = LeaseToken::generate().unwrap();
        let mut t = LeaseTable::new();
        t.insert(LeaseEntry {
            id: LeaseId(id),
            instance_type: "a100".into(),
            tier: Tier::Spot,
            state: LeaseState::Starting,
            token: token.digest(),
            claimed: false,
        })
        .unwrap();
        (t, token)
    }

    #[test]
    fn token_claims_its_own_lease_once() {
        let (mut t, token) = table_with(1);
        assert_eq!(t.claim(LeaseId(1), &token), Ok(()));
        assert_eq!(
            t.claim(LeaseId(1), &token),
            Err(ClaimError::AlreadyClaimed(LeaseId(1)))
        );
    }

    #[test]
    fn worker_cannot_claim_another_lease() {
        let (mut t, token1) = table_with(1);
        let token2 = LeaseToken::generate().unwrap();
        t.insert(LeaseEntry {
            id: LeaseId(2),
            instance_type: "a100".into(),
            tier: Tier::Spot,
            state: LeaseState::Starting,
            token: token2.digest(),
            claimed: false,
        })
        .unwrap();
        assert_eq!(
            t.claim(LeaseId(2), &token1),
            Err(ClaimError::WrongToken(LeaseId(2)))
        );
        assert_eq!(
            t.claim(LeaseId(3), &token1),
            Err(ClaimError::UnknownLease(LeaseId(3)))
        );
        // the failed attempt did not consume lease 2's claim
        assert_eq!(t.claim(LeaseId(2), &token2), Ok(()));
    }

    #[test]
    fn a_rearmed_claim_admits_the_same_token_once_more_and_never_another() {
        let (mut t, token) = table_with(1);
        t.claim(LeaseId(1), &token).unwrap();
        // the worker's link dropped: the gateway re-arms its claim
        t.rearm_claim(LeaseId(1)).unwrap();
        let stranger = LeaseToken::generate().unwrap();
        assert_eq!(
            t.claim(LeaseId(1), &stranger),
            Err(ClaimError::WrongToken(LeaseId(1)))
        );
        assert_eq!(t.claim(LeaseId(1), &token), Ok(()));
        assert_eq!(
            t.claim(LeaseId(1), &token),
            Err(ClaimError::AlreadyClaimed(LeaseId(1))),
            "one connection at a time"
        );
        t.transition(LeaseId(1), LeaseState::Ended(EndReason::Released))
            .unwrap();
        assert_eq!(
            t.rearm_claim(LeaseId(1)),
            Err(TableError::Ended(LeaseId(1)))
        );
        assert_eq!(
            t.rearm_claim(LeaseId(9)),
            Err(TableError::Unknown(LeaseId(9)))
        );
    }

    #[test]
    fn ended_lease_cannot_be_claimed() {
        let (mut t, token) = table_with(1);
        t.transition(LeaseId(1), LeaseState::Ended(EndReason::Lost))
            .unwrap();
        assert_eq!(
            t.claim(LeaseId(1), &token),
            Err(ClaimError::UnknownLease(LeaseId(1)))
        );
    }

    #[test]
    fn tokens_are_random_and_redacted() {
        let a = LeaseToken::generate().unwrap();
        let b = LeaseToken::generate().unwrap();
        assert_ne!(a, b);
        assert_eq!(a.expose().len(), 64);
        assert!(!format!("{a:?}").contains(a.expose()));
        assert!(a.digest().ct_eq(&a.digest()));
        assert!(!a.digest().ct_eq(&b.digest()));
    }

    #[test]
    fn table_refuses_illegal_transition() {
        let (mut t, _) = table_with(1);
        t.transition(LeaseId(1), LeaseState::Ready).unwrap();
        let e = t.transition(LeaseId(1), LeaseState::Starting).unwrap_err();
        assert!(matches!(e, TableError::Transition { .. }));
        assert_eq!(
            t.counts().get(&("a100".to_string(), Tier::Spot, "ready")),
            Some(&1)
        );
    }
}
