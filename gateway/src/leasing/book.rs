//! The lease shell's bookkeeping, pure: which leases' workers are gone and
//! since when, their stalls, when the connected workers were last written
//! as seen, the acquisitions and provider releases under way, the leases
//! under a spot notice that serve on until their drain, and the ledger
//! writes waiting for a retry, in lifecycle order. Every
//! time-dependent call takes `now` on the shell's monotonic clock (ms
//! since it started). It reads no clock, touches no ledger, hub or
//! provider, and spawns nothing: the shell (`shell.rs`) asks it and
//! carries out what it says.
//!
//! The task key `K` is the shell's `tokio::task::Id`; the tests use
//! plain numbers.

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;

use tidegate_lease::autoscale::AcquireReason;
use tidegate_lease::catalog::InstanceType;
use tidegate_lease::provider::ProviderEvent;
use tidegate_lease::{EndReason, LeaseId, LeaseState, LeaseToken, Millis, Tier};

use super::{SEEN_EVERY, STALL_WINDOW};

/// An acquire under way: the lease is `requested` in the ledger, and not in
/// the table until the provider has answered.
#[derive(Debug)]
pub(super) struct Acquiring {
    pub(super) model: String,
    pub(super) instance: InstanceType,
    pub(super) tier: Tier,
    pub(super) reason: AcquireReason,
    pub(super) token: LeaseToken,
    /// Its place in a chain of refusals (`AcquireRefused`).
    pub(super) depth: u32,
    /// Its provider's events that came before the answer (its worker may
    /// end, or its spot node be reclaimed, that soon): handled after it.
    pub(super) early: Vec<ProviderEvent>,
    /// The autoscaler released it before the answer: released after it.
    pub(super) release_wanted: bool,
}

/// A ledger write of one lease's lifecycle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum LedgerWrite {
    /// `mark_starting`: the provider accepted; billing starts.
    Starting {
        at: Millis,
        pid: Option<u32>,
        data: Option<String>,
    },
    /// `mark_ready`: the worker registered.
    Ready { at: Millis },
    /// `mark_draining`: no new frames.
    Draining,
    /// `mark_ended`: charges the final blocks.
    Ended { at: Millis, reason: EndReason },
}

impl LedgerWrite {
    /// Lifecycle order: a later write waits for an earlier one.
    fn rank(&self) -> u8 {
        match self {
            LedgerWrite::Starting { .. } => 0,
            LedgerWrite::Ready { .. } => 1,
            LedgerWrite::Draining => 2,
            LedgerWrite::Ended { .. } => 3,
        }
    }

    pub(super) fn name(&self) -> &'static str {
        match self {
            LedgerWrite::Starting { .. } => "marking starting",
            LedgerWrite::Ready { .. } => "marking ready",
            LedgerWrite::Draining => "marking draining",
            LedgerWrite::Ended { .. } => "ending the lease",
        }
    }
}

/// The leases that serve nothing, by [`LeaseBook::unserving`].
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Unserving {
    /// Stalled, the first time within [`STALL_WINDOW`]: kept while the
    /// worker recovers.
    pub(super) first_stall: Vec<LeaseId>,
    /// Stalled again within [`STALL_WINDOW`]: to end `lost` and release.
    pub(super) stalled_again: Vec<LeaseId>,
    /// Gone for the rejoin timeout or longer, with for how long (ms): to
    /// end `lost` and release.
    pub(super) gone: Vec<(LeaseId, Millis)>,
}

/// The shell's bookkeeping (see the module doc).
#[derive(Debug)]
pub(super) struct LeaseBook<K> {
    /// Ready leases whose worker's connection is gone, with since when
    /// (adopted leases from the start, 0).
    absent: HashMap<LeaseId, Millis>,
    /// A ready lease whose worker has been gone this long is replaced.
    rejoin_timeout_ms: Millis,
    /// When each live lease's worker was last dropped as stalled.
    stalls: HashMap<LeaseId, Millis>,
    /// When the connected workers were last written to the ledger as seen.
    seen_written: Option<Millis>,
    /// Ledger writes that failed, per lease in lifecycle order.
    writes: BTreeMap<LeaseId, Vec<LedgerWrite>>,
    /// What each lease being acquired was asked for.
    acquiring: HashMap<LeaseId, Acquiring>,
    /// The lease of each acquire task.
    acquire_tasks: HashMap<K, LeaseId>,
    /// The lease of each provider release task.
    release_tasks: HashMap<K, LeaseId>,
    /// Leases under a spot notice that serve on, with when dispatch to
    /// each stops.
    drains: BTreeMap<LeaseId, Millis>,
}

impl<K: Eq + Hash> LeaseBook<K> {
    /// A book with nothing in it, replacing a ready lease whose worker has
    /// been gone `rejoin_timeout_ms`.
    pub(super) fn new(rejoin_timeout_ms: Millis) -> Self {
        LeaseBook {
            absent: HashMap::new(),
            rejoin_timeout_ms,
            stalls: HashMap::new(),
            seen_written: None,
            writes: BTreeMap::new(),
            acquiring: HashMap::new(),
            acquire_tasks: HashMap::new(),
            release_tasks: HashMap::new(),
            drains: BTreeMap::new(),
        }
    }

    // --- absence, rejoin and stalls ---

    /// The lease's worker went away at `now` while the lease was in
    /// `state`: a ready lease is absent from then (the first time counts)
    /// until its worker registers again; any other is not timed here.
    pub(super) fn worker_gone(&mut self, lease: LeaseId, state: Option<LeaseState>, now: Millis) {
        if state == Some(LeaseState::Ready) {
            self.absent.entry(lease).or_insert(now);
        }
    }

    /// The lease's worker registered: it is no longer absent.
    pub(super) fn worker_back(&mut self, lease: LeaseId) {
        self.absent.remove(&lease);
    }

    /// Whether the lease's worker is counted as gone.
    #[cfg(test)]
    pub(super) fn is_absent(&self, lease: LeaseId) -> bool {
        self.absent.contains_key(&lease)
    }

    /// The lease ended: its absence, stalls and drain are forgotten.
    pub(super) fn ended(&mut self, lease: LeaseId) {
        self.absent.remove(&lease);
        self.stalls.remove(&lease);
        self.drains.remove(&lease);
    }

    /// The leases to replace at `now`, of those `live` says still count
    /// as capacity (starting or ready, not being released): those the hub
    /// reported `stalled` (a batch far past due) a second time within
    /// [`STALL_WINDOW`], and those whose worker has been gone for the
    /// rejoin timeout. A first stall is recorded and the lease kept. A
    /// lease to replace is no longer absent; each is named once, in id
    /// order.
    pub(super) fn unserving(
        &mut self,
        now: Millis,
        stalled: &[LeaseId],
        live: impl Fn(LeaseId) -> bool,
    ) -> Unserving {
        let window = STALL_WINDOW.as_millis() as Millis;
        let mut verdict = Unserving::default();
        for &lease in stalled.iter().filter(|l| live(**l)) {
            match self.stalls.insert(lease, now) {
                Some(first) if now.saturating_sub(first) <= window => {
                    verdict.stalled_again.push(lease)
                }
                _ => verdict.first_stall.push(lease),
            }
        }
        verdict.stalled_again.sort_unstable();
        verdict.stalled_again.dedup();
        verdict.first_stall.sort_unstable();
        verdict.first_stall.dedup();
        verdict
            .first_stall
            .retain(|l| !verdict.stalled_again.contains(l));
        verdict.gone = self
            .absent
            .iter()
            .map(|(lease, since)| (*lease, now.saturating_sub(*since)))
            .filter(|(lease, gone)| *gone >= self.rejoin_timeout_ms && live(*lease))
            .filter(|(lease, _)| !verdict.stalled_again.contains(lease))
            .collect();
        verdict.gone.sort_unstable();
        for lease in verdict
            .stalled_again
            .iter()
            .chain(verdict.gone.iter().map(|(l, _)| l))
        {
            self.absent.remove(lease);
        }
        verdict
    }

    /// Whether the connected workers are due to be written as seen at
    /// `now` ([`SEEN_EVERY`]).
    pub(super) fn seen_due(&self, now: Millis) -> bool {
        let every = SEEN_EVERY.as_millis() as Millis;
        self.seen_written
            .is_none_or(|at| now.saturating_sub(at) >= every)
    }

    /// The connected workers were written as seen at `now`.
    pub(super) fn seen_written(&mut self, now: Millis) {
        self.seen_written = Some(now);
    }

    // --- ledger writes waiting for a retry ---

    /// Whether a write of the lease waits for a retry: a later one must
    /// queue behind it.
    pub(super) fn write_waits(&self, lease: LeaseId) -> bool {
        self.writes.contains_key(&lease)
    }

    /// Whether any write waits for a retry.
    pub(super) fn writes_wait(&self) -> bool {
        !self.writes.is_empty()
    }

    /// Queues `w` behind the lease's earlier pending writes. An end makes
    /// the pending `ready`/`draining` moot (a pending start stays: the
    /// billing start must be written before the end); a write of a stage
    /// the queue has already passed is moot.
    pub(super) fn queue_write(&mut self, lease: LeaseId, w: LedgerWrite) {
        let q = self.writes.entry(lease).or_default();
        if matches!(w, LedgerWrite::Ended { .. }) {
            q.retain(|p| matches!(p, LedgerWrite::Starting { .. }));
        }
        if !q.iter().any(|p| p.rank() >= w.rank()) {
            q.push(w);
        }
    }

    /// Every lease's pending writes, in lifecycle order, taken out to be
    /// retried; what fails again goes back by [`LeaseBook::requeue`].
    pub(super) fn take_writes(&mut self) -> BTreeMap<LeaseId, Vec<LedgerWrite>> {
        std::mem::take(&mut self.writes)
    }

    /// Puts back the writes of a lease that a retry left, in their order.
    pub(super) fn requeue(&mut self, lease: LeaseId, left: Vec<LedgerWrite>) {
        for w in left {
            self.queue_write(lease, w);
        }
    }

    /// The lease's pending writes, in the order they will be made.
    #[cfg(test)]
    pub(super) fn pending_writes(&self, lease: LeaseId) -> &[LedgerWrite] {
        self.writes.get(&lease).map_or(&[], Vec::as_slice)
    }

    /// The leases with a write still pending.
    pub(super) fn unwritten(&self) -> Vec<LeaseId> {
        self.writes.keys().copied().collect()
    }

    // --- acquisitions under way ---

    /// An acquire of `lease` runs as `task`. False, and nothing recorded,
    /// when the lease is already being acquired or the task already
    /// answers for another: a lease is never acquired twice at once.
    pub(super) fn acquire_started(&mut self, task: K, lease: LeaseId, a: Acquiring) -> bool {
        if self.acquiring.contains_key(&lease) || self.acquire_tasks.contains_key(&task) {
            return false;
        }
        self.acquire_tasks.insert(task, lease);
        self.acquiring.insert(lease, a);
        true
    }

    /// The acquire task `task` answered: its lease and what it was asked
    /// for, once (`None` for a task not recorded, or answered already).
    pub(super) fn acquire_answered(&mut self, task: &K) -> Option<(LeaseId, Acquiring)> {
        let lease = self.acquire_tasks.remove(task)?;
        self.acquiring.remove(&lease).map(|a| (lease, a))
    }

    /// Whether the lease's provider has yet to answer its acquire.
    pub(super) fn is_acquiring(&self, lease: LeaseId) -> bool {
        self.acquiring.contains_key(&lease)
    }

    /// The acquisitions under way.
    pub(super) fn acquiring(&self) -> impl Iterator<Item = &Acquiring> {
        self.acquiring.values()
    }

    /// A provider event for a lease still being acquired is held until its
    /// answer (`None`); any other is handed back to handle now.
    pub(super) fn hold_early(&mut self, ev: ProviderEvent) -> Option<ProviderEvent> {
        let lease = match &ev {
            ProviderEvent::Ready { lease }
            | ProviderEvent::PreemptionNotice { lease, .. }
            | ProviderEvent::Ended { lease, .. } => *lease,
        };
        match self.acquiring.get_mut(&lease) {
            Some(a) => {
                a.early.push(ev);
                None
            }
            None => Some(ev),
        }
    }

    /// A release of the lease is wanted: one still being acquired is
    /// marked to be released after its answer (true); false for any other.
    pub(super) fn release_after_answer(&mut self, lease: LeaseId) -> bool {
        match self.acquiring.get_mut(&lease) {
            Some(a) => {
                a.release_wanted = true;
                true
            }
            None => false,
        }
    }

    // --- spot notices: dispatch stopped before the deadline ---

    /// Dispatch to `lease` stops at `at` (the autoscaler's
    /// `StopDispatch`); a second time for the same lease keeps the earlier.
    pub(super) fn drain_at(&mut self, lease: LeaseId, at: Millis) {
        let due = self.drains.entry(lease).or_insert(at);
        *due = (*due).min(at);
    }

    /// When the next drain is due.
    pub(super) fn next_drain(&self) -> Option<Millis> {
        self.drains.values().min().copied()
    }

    /// The leases whose drain is due at `now`, in id order, each named once.
    pub(super) fn drains_due(&mut self, now: Millis) -> Vec<LeaseId> {
        let mut due = Vec::new();
        self.drains.retain(|lease, at| {
            let keep = *at > now;
            if !keep {
                due.push(*lease);
            }
            keep
        });
        due
    }

    // --- provider releases under way ---

    /// A provider release of `lease` runs as `task`. False, and nothing
    /// recorded, when a release of the lease is already under way or the
    /// task already answers for another: a lease is never released twice
    /// at once.
    pub(super) fn release_started(&mut self, task: K, lease: LeaseId) -> bool {
        if self.is_releasing(lease) || self.release_tasks.contains_key(&task) {
            return false;
        }
        self.release_tasks.insert(task, lease);
        true
    }

    /// The release task `task` answered: its lease, once.
    pub(super) fn release_answered(&mut self, task: &K) -> Option<LeaseId> {
        self.release_tasks.remove(task)
    }

    /// Whether a provider release of the lease is under way.
    pub(super) fn is_releasing(&self, lease: LeaseId) -> bool {
        self.release_tasks.values().any(|l| *l == lease)
    }
}

#[cfg(test)]
mod tests {
    use tidegate_lease::Catalog;

    use super::*;

    const REJOIN: Millis = 120_000;
    const WINDOW: Millis = STALL_WINDOW.as_millis() as Millis;

    fn book() -> LeaseBook<u32> {
        LeaseBook::new(REJOIN)
    }

    fn acquiring(model: &str) -> Acquiring {
        Acquiring {
            model: model.into(),
            instance: Catalog::default_catalog().get("cpu-32").cloned().unwrap(),
            tier: Tier::OnDemand,
            reason: AcquireReason::Demand,
            token: LeaseToken::generate().unwrap(),
            depth: 0,
            early: Vec::new(),
            release_wanted: false,
        }
    }

    fn all_live(_: LeaseId) -> bool {
        true
    }

    #[test]
    fn a_ready_lease_whose_worker_stays_gone_past_the_rejoin_timeout_is_replaced() {
        let mut b = book();
        let l = LeaseId(1);
        b.worker_gone(l, Some(LeaseState::Ready), 1_000);
        assert!(
            b.unserving(1_000 + REJOIN - 1, &[], all_live)
                .gone
                .is_empty()
        );
        let v = b.unserving(1_000 + REJOIN, &[], all_live);
        assert_eq!(v.gone, vec![(l, REJOIN)]);
        assert!(v.stalled_again.is_empty());
        // named once: it is no longer absent
        assert!(!b.is_absent(l));
        assert!(
            b.unserving(1_000 + 2 * REJOIN, &[], all_live)
                .gone
                .is_empty()
        );
    }

    #[test]
    fn a_drain_is_due_once_at_the_earliest_time_asked_and_forgotten_when_its_lease_ends() {
        let mut b = book();
        let (l1, l2, l3) = (LeaseId(1), LeaseId(2), LeaseId(3));
        assert_eq!(b.next_drain(), None);
        b.drain_at(l2, 50_000);
        b.drain_at(l1, 70_000);
        b.drain_at(l1, 60_000);
        b.drain_at(l1, 90_000);
        b.drain_at(l3, 40_000);
        b.ended(l3);
        assert_eq!(b.next_drain(), Some(50_000));
        assert!(b.drains_due(49_999).is_empty());
        assert_eq!(b.drains_due(60_000), vec![l1, l2]);
        assert!(b.drains_due(1_000_000).is_empty(), "each named once");
        assert_eq!(b.next_drain(), None);
    }

    #[test]
    fn a_worker_that_rejoins_in_time_keeps_its_lease() {
        let mut b = book();
        let l = LeaseId(1);
        b.worker_gone(l, Some(LeaseState::Ready), 0);
        b.worker_back(l);
        assert!(!b.is_absent(l));
        assert_eq!(
            b.unserving(10 * REJOIN, &[], all_live),
            Unserving::default()
        );
    }

    #[test]
    fn absence_counts_from_the_first_disconnection_and_only_for_ready_leases() {
        let mut b = book();
        b.worker_gone(LeaseId(1), Some(LeaseState::Ready), 0);
        // a second disconnection does not restart the clock
        b.worker_gone(LeaseId(1), Some(LeaseState::Ready), 50_000);
        b.worker_gone(LeaseId(2), Some(LeaseState::Starting), 0);
        b.worker_gone(LeaseId(3), None, 0);
        let v = b.unserving(REJOIN, &[], all_live);
        assert_eq!(v.gone, vec![(LeaseId(1), REJOIN)]);
        assert!(!b.is_absent(LeaseId(2)) && !b.is_absent(LeaseId(3)));
    }

    #[test]
    fn a_gone_lease_that_no_longer_counts_as_capacity_is_not_replaced_but_stays_timed() {
        let mut b = book();
        let l = LeaseId(1);
        b.worker_gone(l, Some(LeaseState::Ready), 0);
        // being released already: not named again
        assert!(b.unserving(REJOIN, &[], |_| false).gone.is_empty());
        assert!(b.is_absent(l));
        // its end forgets it
        b.ended(l);
        assert!(b.unserving(REJOIN, &[], all_live).gone.is_empty());
    }

    #[test]
    fn a_first_stall_is_kept_and_a_second_within_the_window_replaces_the_lease() {
        let mut b = book();
        let l = LeaseId(7);
        let v = b.unserving(1_000, &[l], all_live);
        assert_eq!(v.first_stall, vec![l]);
        assert!(v.stalled_again.is_empty() && v.gone.is_empty());
        let v = b.unserving(1_000 + WINDOW, &[l], all_live);
        assert_eq!(v.stalled_again, vec![l]);
        assert!(v.first_stall.is_empty());
    }

    #[test]
    fn a_stall_after_the_window_counts_as_a_first_one_again() {
        let mut b = book();
        let l = LeaseId(7);
        b.unserving(0, &[l], all_live);
        let v = b.unserving(WINDOW + 1, &[l], all_live);
        assert_eq!(v.first_stall, vec![l]);
        // that later stall is the one the window runs from
        let v = b.unserving(2 * WINDOW, &[l], all_live);
        assert_eq!(v.stalled_again, vec![l]);
    }

    #[test]
    fn stalls_are_cleared_when_the_lease_ends_and_not_counted_when_it_is_not_live() {
        let mut b = book();
        let l = LeaseId(7);
        b.unserving(0, &[l], all_live);
        b.ended(l);
        assert_eq!(b.unserving(1, &[l], all_live).first_stall, vec![l]);
        // a stall of a lease being released is not counted at all
        let other = LeaseId(8);
        assert_eq!(b.unserving(2, &[other], |_| false), Unserving::default());
        assert_eq!(b.unserving(3, &[other], all_live).first_stall, vec![other]);
    }

    #[test]
    fn a_lease_both_stalled_again_and_gone_is_named_once() {
        let mut b = book();
        let l = LeaseId(3);
        b.worker_gone(l, Some(LeaseState::Ready), 0);
        b.unserving(REJOIN - 10, &[l], all_live);
        let v = b.unserving(REJOIN, &[l, l], all_live);
        assert_eq!(v.stalled_again, vec![l]);
        assert!(v.gone.is_empty() && v.first_stall.is_empty());
        assert!(!b.is_absent(l));
    }

    #[test]
    fn the_connected_workers_are_written_as_seen_at_most_every_interval() {
        let mut b = book();
        let every = SEEN_EVERY.as_millis() as Millis;
        assert!(b.seen_due(0));
        b.seen_written(5);
        assert!(!b.seen_due(5 + every - 1));
        assert!(b.seen_due(5 + every));
        // a clock that seems to go back does not make it due
        assert!(!b.seen_due(0));
    }

    #[test]
    fn an_acquisition_in_flight_is_never_started_twice_and_answers_once() {
        let mut b = book();
        let l = LeaseId(1);
        assert!(b.acquire_started(10, l, acquiring("m")));
        // the same lease again, or the same task for another lease
        assert!(!b.acquire_started(11, l, acquiring("other")));
        assert!(!b.acquire_started(10, LeaseId(2), acquiring("other")));
        assert!(b.is_acquiring(l) && !b.is_acquiring(LeaseId(2)));
        assert_eq!(b.acquiring().count(), 1);
        let (lease, a) = b.acquire_answered(&10).expect("answered");
        assert_eq!((lease, a.model.as_str()), (l, "m"));
        assert!(b.acquire_answered(&10).is_none());
        assert!(b.acquire_answered(&11).is_none());
        assert!(!b.is_acquiring(l));
    }

    #[test]
    fn events_and_releases_of_a_lease_being_acquired_wait_for_its_answer() {
        let mut b = book();
        let l = LeaseId(1);
        b.acquire_started(1, l, acquiring("m"));
        let ready = ProviderEvent::Ready { lease: l };
        assert!(b.hold_early(ready.clone()).is_none());
        assert!(b.release_after_answer(l));
        let other = ProviderEvent::Ready { lease: LeaseId(2) };
        assert_eq!(b.hold_early(other.clone()), Some(other));
        assert!(!b.release_after_answer(LeaseId(2)));
        let (_, a) = b.acquire_answered(&1).unwrap();
        assert_eq!(a.early, vec![ready.clone()]);
        assert!(a.release_wanted);
        // answered: its events are handled at once
        assert_eq!(b.hold_early(ready.clone()), Some(ready));
    }

    #[test]
    fn a_release_in_flight_is_never_started_twice_and_answers_once() {
        let mut b = book();
        let l = LeaseId(4);
        assert!(b.release_started(1, l));
        assert!(!b.release_started(2, l), "a second release of the lease");
        assert!(
            !b.release_started(1, LeaseId(5)),
            "a task answering for two"
        );
        assert!(b.is_releasing(l) && !b.is_releasing(LeaseId(5)));
        assert_eq!(b.release_answered(&1), Some(l));
        assert_eq!(b.release_answered(&1), None);
        assert!(!b.is_releasing(l));
        // once answered, it may be tried again
        assert!(b.release_started(2, l));
    }

    fn starting(at: Millis) -> LedgerWrite {
        LedgerWrite::Starting {
            at,
            pid: None,
            data: None,
        }
    }

    fn ended(at: Millis) -> LedgerWrite {
        LedgerWrite::Ended {
            at,
            reason: EndReason::Released,
        }
    }

    #[test]
    fn pending_ledger_writes_keep_lifecycle_order_and_an_end_supersedes_the_rest() {
        let l = LeaseId(1);
        let mut b = book();
        b.queue_write(l, starting(5));
        b.queue_write(l, LedgerWrite::Ready { at: 6 });
        b.queue_write(l, LedgerWrite::Draining);
        // an earlier stage queued after a later one is moot
        b.queue_write(l, LedgerWrite::Ready { at: 7 });
        assert_eq!(b.pending_writes(l).len(), 3);
        b.queue_write(l, ended(8));
        // the billing start stays (it must be written before the end); the
        // ready and draining marks are moot
        assert_eq!(b.pending_writes(l), [starting(5), ended(8)]);
        // nothing after an end
        b.queue_write(l, LedgerWrite::Draining);
        assert_eq!(b.pending_writes(l).len(), 2);
        assert!(b.write_waits(l));
        assert!(!b.write_waits(LeaseId(2)));
    }

    #[test]
    fn writes_taken_for_a_retry_and_put_back_keep_their_order_behind_nothing_newer() {
        let mut b = book();
        let (l, m) = (LeaseId(1), LeaseId(2));
        b.queue_write(l, starting(1));
        b.queue_write(l, LedgerWrite::Ready { at: 2 });
        b.queue_write(m, ended(3));
        assert!(b.writes_wait());
        assert_eq!(b.unwritten(), vec![l, m]);
        let taken = b.take_writes();
        assert!(!b.writes_wait() && b.unwritten().is_empty());
        assert_eq!(taken[&l], vec![starting(1), LedgerWrite::Ready { at: 2 }]);
        // the start went through; the rest fails again
        let mut left = taken[&l].clone();
        left.remove(0);
        b.requeue(l, left);
        b.requeue(m, taken[&m].clone());
        assert_eq!(b.pending_writes(l), [LedgerWrite::Ready { at: 2 }]);
        assert_eq!(b.pending_writes(m), [ended(3)]);
        // nothing left to put back leaves nothing pending
        b.requeue(LeaseId(9), Vec::new());
        assert!(!b.write_waits(LeaseId(9)));
    }

    mod props {
        use std::collections::HashMap;

        use proptest::prelude::*;

        use super::*;

        #[derive(Debug, Clone)]
        enum Op {
            Gone(u64, bool),
            Back(u64),
            Stall(u64),
            End(u64),
            StartRelease(u32, u64),
            AnswerRelease(u32),
            Wait(Millis),
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                (0..4u64, any::<bool>()).prop_map(|(l, ready)| Op::Gone(l, ready)),
                (0..4u64).prop_map(Op::Back),
                (0..4u64).prop_map(Op::Stall),
                (0..4u64).prop_map(Op::End),
                (0..6u32, 0..4u64).prop_map(|(t, l)| Op::StartRelease(t, l)),
                (0..6u32).prop_map(Op::AnswerRelease),
                prop_oneof![
                    Just(1),
                    Just(REJOIN - 1),
                    Just(REJOIN),
                    0..2 * REJOIN,
                    Just(WINDOW),
                ]
                .prop_map(Op::Wait),
            ]
        }

        proptest! {
            /// Over any sequence of disconnections, registrations, stalls,
            /// ends and releases on a clock that only moves forward: a lease
            /// is named at most once per verdict, only once its worker has
            /// been gone the rejoin timeout since its first disconnection
            /// after its last registration, and none gone that long is left
            /// unnamed; a lease never has two releases in flight.
            #[test]
            fn the_book_names_each_unserving_lease_once_and_never_early(
                ops in proptest::collection::vec(op(), 1..80)
            ) {
                let mut b = book();
                let mut now: Millis = 0;
                // the first disconnection since the last registration or end
                let mut gone_since: HashMap<LeaseId, Millis> = HashMap::new();
                let mut in_flight: HashMap<u32, LeaseId> = HashMap::new();
                for op in ops {
                    let mut stalled = Vec::new();
                    match op {
                        Op::Gone(l, ready) => {
                            let (l, s) = (LeaseId(l), ready.then_some(LeaseState::Ready));
                            b.worker_gone(l, s, now);
                            if ready {
                                gone_since.entry(l).or_insert(now);
                            }
                        }
                        Op::Back(l) => {
                            b.worker_back(LeaseId(l));
                            gone_since.remove(&LeaseId(l));
                        }
                        Op::Stall(l) => stalled.push(LeaseId(l)),
                        Op::End(l) => {
                            b.ended(LeaseId(l));
                            gone_since.remove(&LeaseId(l));
                        }
                        Op::StartRelease(t, l) => {
                            let busy = in_flight.contains_key(&t)
                                || in_flight.values().any(|x| *x == LeaseId(l));
                            prop_assert_eq!(b.release_started(t, LeaseId(l)), !busy);
                            if !busy {
                                in_flight.insert(t, LeaseId(l));
                            }
                        }
                        Op::AnswerRelease(t) => {
                            prop_assert_eq!(b.release_answered(&t), in_flight.remove(&t));
                        }
                        Op::Wait(dt) => now += dt,
                    }
                    for l in 0..4 {
                        let l = LeaseId(l);
                        prop_assert_eq!(b.is_releasing(l), in_flight.values().any(|x| *x == l));
                    }
                    let v = b.unserving(now, &stalled, all_live);
                    let mut named: Vec<LeaseId> = v.first_stall.clone();
                    named.extend(&v.stalled_again);
                    named.extend(v.gone.iter().map(|(l, _)| *l));
                    let n = named.len();
                    named.sort_unstable();
                    named.dedup();
                    prop_assert_eq!(named.len(), n, "a lease named twice: {:?}", v);
                    for (l, gone) in &v.gone {
                        let since = gone_since.remove(l);
                        prop_assert_eq!(since.map(|s| now - s), Some(*gone));
                        prop_assert!(*gone >= REJOIN);
                    }
                    for l in &v.stalled_again {
                        gone_since.remove(l);
                    }
                    for (l, since) in &gone_since {
                        prop_assert!(now - since < REJOIN, "{:?} gone since {} left unnamed", l, since);
                    }
                }
            }
        }
    }
}
