//! The `static` provider: workers that already exist, listed in config,
//! which dial in to the gateway by themselves.
//!
//! Acquiring binds a free listed worker of the requested type to a lease;
//! releasing unbinds it (the machine keeps running; it is simply no longer
//! ours to dispatch to, and it may be bound again by a later acquire). A
//! static worker cannot be handed a fresh token at acquire time, so each
//! listed worker carries the SHA-256 digest of its own provisioned token,
//! which [`Acquired::token`] returns for the lease table and
//! [`StaticProvider::token_matches`] checks whether it is bound or not: a
//! listed worker may stay connected to the gateway while unbound, waiting to
//! be bound. Readiness and loss are reported by the gateway, which sees the
//! worker dial in and disconnect ([`StaticProvider::worker_registered`],
//! [`StaticProvider::worker_disconnected`]).

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use super::{
    Acquired, Adoption, EVENT_CHANNEL_CAPACITY, LeaseSpec, Provider, ProviderError, ProviderEvent,
};
use crate::billing::Millis;
use crate::catalog::Tier;
use crate::ledger::Ledger;
use crate::lifecycle::EndReason;
use crate::table::{LeaseId, LeaseToken, TokenDigest};

/// Provider name in the ledger.
pub const PROVIDER_NAME: &str = "static";

/// One configured worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StaticWorker {
    /// Its name (as it introduces itself when dialling in).
    pub name: String,
    /// Catalog instance type it is.
    pub instance_type: String,
    /// Tier it is paid at (usually reserved).
    pub tier: Tier,
    /// Hex SHA-256 of the token provisioned on the worker.
    pub token_sha256: String,
}

/// Configuration: the list of workers.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StaticConfig {
    /// The workers.
    pub workers: Vec<StaticWorker>,
}

/// Why a static config is invalid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StaticConfigError {
    /// A digest that is not 64 hex characters.
    #[error("static worker {0:?}: token_sha256 must be 64 hex characters")]
    BadDigest(String),
    /// Two workers with one name.
    #[error("static worker {0:?} is listed twice")]
    Duplicate(String),
}

#[derive(Debug)]
struct Slot {
    worker: StaticWorker,
    digest: TokenDigest,
    bound: Option<LeaseId>,
}

/// The static provider.
#[derive(Debug)]
pub struct StaticProvider {
    slots: Vec<Slot>,
    by_lease: HashMap<LeaseId, usize>,
    events_tx: mpsc::Sender<ProviderEvent>,
    events_rx: Option<mpsc::Receiver<ProviderEvent>>,
}

fn parse_digest(hex: &str) -> Option<TokenDigest> {
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(TokenDigest(out))
}

impl StaticProvider {
    /// Validates the config and builds the provider.
    pub fn new(cfg: StaticConfig) -> Result<StaticProvider, StaticConfigError> {
        let mut slots: Vec<Slot> = Vec::new();
        for w in cfg.workers {
            if slots.iter().any(|s| s.worker.name == w.name) {
                return Err(StaticConfigError::Duplicate(w.name));
            }
            let digest = parse_digest(&w.token_sha256)
                .ok_or_else(|| StaticConfigError::BadDigest(w.name.clone()))?;
            slots.push(Slot {
                worker: w,
                digest,
                bound: None,
            });
        }
        let (events_tx, events_rx) = mpsc::channel(EVENT_CHANNEL_CAPACITY);
        Ok(StaticProvider {
            slots,
            by_lease: HashMap::new(),
            events_tx,
            events_rx: Some(events_rx),
        })
    }

    /// The worker bound to `lease`.
    pub fn worker_of(&self, lease: LeaseId) -> Option<&StaticWorker> {
        self.by_lease.get(&lease).map(|&i| &self.slots[i].worker)
    }

    /// Whether `name` is a listed worker.
    pub fn is_listed(&self, name: &str) -> bool {
        self.slots.iter().any(|s| s.worker.name == name)
    }

    /// Whether `token` is the provisioned token of the listed worker
    /// `name` (digests compared in constant time), bound or not; false for
    /// a name that is not listed.
    pub fn token_matches(&self, name: &str, token: &LeaseToken) -> bool {
        self.slots
            .iter()
            .find(|s| s.worker.name == name)
            .is_some_and(|s| s.digest.ct_eq(&token.digest()))
    }

    /// The lease the listed worker `name` is bound to now, if any.
    pub fn bound_lease(&self, name: &str) -> Option<LeaseId> {
        self.slots
            .iter()
            .find(|s| s.worker.name == name)
            .and_then(|s| s.bound)
    }

    /// The gateway saw the lease's worker register and warm up.
    pub fn worker_registered(&self, lease: LeaseId) -> Result<(), ProviderError> {
        if !self.by_lease.contains_key(&lease) {
            return Err(ProviderError::UnknownLease(lease));
        }
        self.events_tx
            .try_send(ProviderEvent::Ready { lease })
            .map_err(|_| ProviderError::Process {
                lease,
                what: "report ready",
                source: std::io::Error::other("event channel full or closed"),
            })
    }

    /// The gateway lost the lease's worker: the lease ends as lost and the
    /// worker is free to be bound again when it returns.
    pub fn worker_disconnected(&mut self, lease: LeaseId) -> Result<(), ProviderError> {
        let i = self
            .by_lease
            .remove(&lease)
            .ok_or(ProviderError::UnknownLease(lease))?;
        self.slots[i].bound = None;
        self.events_tx
            .try_send(ProviderEvent::Ended {
                lease,
                reason: EndReason::Lost,
                detail: format!("static worker {} disconnected", self.slots[i].worker.name),
            })
            .map_err(|_| ProviderError::Process {
                lease,
                what: "report lost",
                source: std::io::Error::other("event channel full or closed"),
            })
    }
}

impl StaticProvider {
    /// Binds a free configured worker of the spec's type and tier.
    fn bind(&mut self, spec: LeaseSpec) -> Result<Acquired, ProviderError> {
        if self.by_lease.contains_key(&spec.lease) {
            return Err(ProviderError::Duplicate(spec.lease));
        }
        let i = self
            .slots
            .iter()
            .position(|s| {
                s.bound.is_none()
                    && s.worker.instance_type == spec.instance.name
                    && s.worker.tier == spec.tier
            })
            .ok_or_else(|| ProviderError::NoCapacity {
                instance_type: spec.instance.name.clone(),
                tier: spec.tier,
                detail: "every configured static worker of this type and tier is bound".into(),
            })?;
        self.slots[i].bound = Some(spec.lease);
        self.by_lease.insert(spec.lease, i);
        Ok(Acquired {
            lease: spec.lease,
            pid: None,
            provider_data: Some(
                serde_json::json!({ "worker": self.slots[i].worker.name }).to_string(),
            ),
            token: Some(self.slots[i].digest),
        })
    }
}

impl Provider for StaticProvider {
    fn name(&self) -> &'static str {
        PROVIDER_NAME
    }

    /// Binds a free worker in the call.
    fn acquire(
        &mut self,
        spec: LeaseSpec,
    ) -> impl Future<Output = Result<Acquired, ProviderError>> + Send + 'static {
        std::future::ready(self.bind(spec))
    }

    fn release(
        &mut self,
        lease: LeaseId,
    ) -> impl Future<Output = Result<(), ProviderError>> + Send + 'static {
        let unbound = match self.by_lease.remove(&lease) {
            Some(i) => {
                self.slots[i].bound = None;
                Ok(())
            }
            None => Err(ProviderError::UnknownLease(lease)),
        };
        std::future::ready(unbound)
    }

    /// Adopts nothing: a static worker's link is all the gateway knows of
    /// it, and a restart lost it, so its lease is ended by the caller (as
    /// `lost`); the worker, which dials in again by itself, is free to be
    /// bound to a new lease.
    fn adopt(
        &mut self,
        _ledger: &mut Ledger,
        _now: Millis,
    ) -> impl Future<Output = Result<Adoption, ProviderError>> + Send {
        std::future::ready(Ok(Adoption::default()))
    }

    fn take_events(&mut self) -> Option<mpsc::Receiver<ProviderEvent>> {
        self.events_rx.take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::Catalog;
    use crate::table::LeaseToken;

    fn cfg() -> StaticConfig {
        let t = LeaseToken::from_secret("worker-a-secret");
        let hex: String = t.digest().0.iter().map(|b| format!("{b:02x}")).collect();
        StaticConfig {
            workers: vec![StaticWorker {
                name: "gpu-a".into(),
                instance_type: "a100".into(),
                tier: Tier::Reserved,
                token_sha256: hex,
            }],
        }
    }

    fn spec(id: u64) -> LeaseSpec {
        LeaseSpec {
            lease: LeaseId(id),
            token: LeaseToken::from_secret("unused"),
            instance: Catalog::default_catalog().get("a100").unwrap().clone(),
            tier: Tier::Reserved,
            preempt_after: None,
        }
    }

    #[tokio::test]
    async fn static_worker_is_bound_once_and_freed_on_release() {
        let mut p = StaticProvider::new(cfg()).unwrap();
        let mut ev = p.take_events().unwrap();
        let a = p.acquire(spec(1)).await.unwrap();
        assert_eq!(
            a.token,
            Some(LeaseToken::from_secret("worker-a-secret").digest())
        );
        assert!(matches!(
            p.acquire(spec(2)).await,
            Err(ProviderError::NoCapacity { .. })
        ));
        p.worker_registered(LeaseId(1)).unwrap();
        assert_eq!(
            ev.recv().await,
            Some(ProviderEvent::Ready { lease: LeaseId(1) })
        );
        p.release(LeaseId(1)).await.unwrap();
        p.acquire(spec(2)).await.unwrap();
        p.worker_disconnected(LeaseId(2)).unwrap();
        assert!(matches!(
            ev.recv().await,
            Some(ProviderEvent::Ended {
                reason: EndReason::Lost,
                ..
            })
        ));
    }

    #[tokio::test]
    async fn a_listed_worker_is_known_by_its_token_bound_or_not() {
        let mut p = StaticProvider::new(cfg()).unwrap();
        let mine = LeaseToken::from_secret("worker-a-secret");
        assert!(p.is_listed("gpu-a") && !p.is_listed("gpu-b"));
        assert!(p.token_matches("gpu-a", &mine), "unbound, its own token");
        assert!(!p.token_matches("gpu-a", &LeaseToken::from_secret("guess")));
        assert!(!p.token_matches("gpu-b", &mine), "not listed");
        assert_eq!(p.bound_lease("gpu-a"), None);
        p.acquire(spec(1)).await.unwrap();
        assert_eq!(p.bound_lease("gpu-a"), Some(LeaseId(1)));
        assert!(p.token_matches("gpu-a", &mine), "bound, the same token");
        p.release(LeaseId(1)).await.unwrap();
        assert_eq!(p.bound_lease("gpu-a"), None);
        // bound again by a later acquire
        p.acquire(spec(2)).await.unwrap();
        assert_eq!(p.bound_lease("gpu-a"), Some(LeaseId(2)));
    }

    #[test]
    fn bad_digest_is_rejected() {
        let mut c = cfg();
        c.workers[0].token_sha256 = "abc".into();
        assert_eq!(
            StaticProvider::new(c).unwrap_err(),
            StaticConfigError::BadDigest("gpu-a".into())
        );
    }
}
