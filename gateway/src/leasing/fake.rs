//! A scripted provider for the shell's tests: acquires at once, fails
//! its releases while told to, and adopts the ledger's live `fake`
//! leases.
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tidegate_lease::ledger::Ledger;
use tidegate_lease::provider::{
    Acquired, Adoption, EVENT_CHANNEL_CAPACITY, LeaseSpec, Provider, ProviderError, ProviderEvent,
};
use tidegate_lease::{LeaseId, LeaseToken, Millis};
use tokio::sync::mpsc;

use super::LeaseSource;

/// What the test controls and observes.
#[derive(Debug, Default)]
pub struct Script {
    /// Releases fail while set (the worker keeps running).
    pub fail_releases: AtomicBool,
    /// Every release asked for, in order.
    pub release_calls: Mutex<Vec<LeaseId>>,
    /// Leases whose release was begun (`begin_release`), in order.
    pub begun: Mutex<Vec<LeaseId>>,
    /// Releases asked for before the lease's release was begun.
    pub unbegun_releases: AtomicUsize,
    /// The token handed to each acquired lease's worker.
    pub tokens: Mutex<HashMap<LeaseId, LeaseToken>>,
    /// While true, releases wait (a Pod's grace period, a job's drain).
    pub hold_releases: tokio::sync::watch::Sender<bool>,
    /// While true, acquisitions wait (an API server slow to answer).
    pub hold_acquires: tokio::sync::watch::Sender<bool>,
    /// While true, acquisitions panic once the lease is held (a bug in
    /// a provider, after it started a worker).
    pub panic_acquires: AtomicBool,
    /// While true, adoption fails (a cluster that does not answer).
    pub fail_adopt: AtomicBool,
    /// The provider's event channel, for a test to report events.
    pub events: Mutex<Option<mpsc::Sender<ProviderEvent>>>,
}

impl Script {
    pub fn releases_of(&self, lease: LeaseId) -> usize {
        let calls = self.release_calls.lock().unwrap();
        calls.iter().filter(|l| **l == lease).count()
    }

    pub fn token(&self, lease: LeaseId) -> Option<String> {
        let tokens = self.tokens.lock().unwrap();
        tokens.get(&lease).map(|t| t.expose().to_string())
    }

    pub fn fail_releases(&self, fail: bool) {
        self.fail_releases.store(fail, Ordering::SeqCst);
    }

    pub fn hold_releases(&self, hold: bool) {
        self.hold_releases.send_replace(hold);
    }

    pub fn hold_acquires(&self, hold: bool) {
        self.hold_acquires.send_replace(hold);
    }

    /// Whether the shell has taken every event reported.
    pub fn events_taken(&self) -> bool {
        let tx = self.events.lock().unwrap();
        tx.as_ref()
            .is_some_and(|tx| tx.capacity() == tx.max_capacity())
    }

    /// Reports `ev` as the provider would.
    pub async fn report(&self, ev: ProviderEvent) {
        let tx = self.events.lock().unwrap().clone();
        tx.expect("a FakeProvider was made")
            .send(ev)
            .await
            .expect("the shell reads events");
    }
}

#[derive(Debug)]
pub struct FakeProvider {
    script: Arc<Script>,
    held: BTreeSet<LeaseId>,
    events: Option<mpsc::Receiver<ProviderEvent>>,
}

impl FakeProvider {
    pub fn new(script: Arc<Script>) -> FakeProvider {
        let (tx, rx) = mpsc::channel(EVENT_CHANNEL_CAPACITY);
        *script.events.lock().unwrap() = Some(tx);
        FakeProvider {
            script,
            held: BTreeSet::new(),
            events: Some(rx),
        }
    }
}

impl LeaseSource for FakeProvider {
    /// Nothing runs on its behalf.
    fn detach(self) -> impl Future<Output = ()> + Send {
        std::future::ready(())
    }
}

impl Provider for FakeProvider {
    fn name(&self) -> &'static str {
        "fake"
    }

    fn acquire(
        &mut self,
        spec: LeaseSpec,
    ) -> impl Future<Output = Result<Acquired, ProviderError>> + Send + 'static {
        self.held.insert(spec.lease);
        self.script
            .tokens
            .lock()
            .unwrap()
            .insert(spec.lease, spec.token.clone());
        let mut hold = self.script.hold_acquires.subscribe();
        let panics = self.script.panic_acquires.load(Ordering::SeqCst);
        async move {
            // held while the script says so
            let _ = hold.wait_for(|held| !held).await;
            assert!(!panics, "scripted panic in acquire");
            Ok(Acquired {
                lease: spec.lease,
                pid: None,
                provider_data: None,
                token: None,
            })
        }
    }

    fn release(
        &mut self,
        lease: LeaseId,
    ) -> impl Future<Output = Result<(), ProviderError>> + Send + 'static {
        self.script.release_calls.lock().unwrap().push(lease);
        if !self.script.begun.lock().unwrap().contains(&lease) {
            self.script.unbegun_releases.fetch_add(1, Ordering::SeqCst);
        }
        let result = if !self.held.contains(&lease) {
            Err(ProviderError::UnknownLease(lease))
        } else if self.script.fail_releases.load(Ordering::SeqCst) {
            Err(ProviderError::Slurm {
                lease: Some(lease),
                what: "scancel".into(),
                detail: "the controller does not answer (scripted)".into(),
            })
        } else {
            self.held.remove(&lease);
            Ok(())
        };
        let mut hold = self.script.hold_releases.subscribe();
        async move {
            let _ = hold.wait_for(|held| !held).await;
            result
        }
    }

    /// Every live `fake` lease's worker "still runs"; the shell ends the
    /// others.
    fn adopt(
        &mut self,
        ledger: &mut Ledger,
        _now: Millis,
    ) -> impl Future<Output = Result<Adoption, ProviderError>> + Send {
        if self.script.fail_adopt.load(Ordering::SeqCst) {
            return std::future::ready(Err(ProviderError::Slurm {
                lease: None,
                what: "squeue".into(),
                detail: "the controller does not answer (scripted)".into(),
            }));
        }
        let adopted = ledger.live_leases().map(|recs| {
            let ids: Vec<LeaseId> = recs
                .into_iter()
                .filter(|r| r.provider == "fake")
                .map(|r| r.id)
                .collect();
            self.held.extend(ids.iter().copied());
            Adoption {
                adopted: ids,
                ended: Vec::new(),
            }
        });
        std::future::ready(adopted.map_err(ProviderError::from))
    }

    /// Starts the drain of every lease in `leases` at once.
    fn begin_release(&mut self, leases: &[LeaseId]) -> impl Future<Output = ()> + Send {
        self.script.begun.lock().unwrap().extend(leases);
        std::future::ready(())
    }

    fn take_events(&mut self) -> Option<mpsc::Receiver<ProviderEvent>> {
        self.events.take()
    }
}
