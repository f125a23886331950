//! When the lease shell may act again: the pause on acquisitions after
//! leases failed to start, the start timeout, and when each provider
//! release is due (and retried after a failed one).
//!
//! Pure and clock-injected like [`crate::autoscale`]: every method takes
//! `now` ([`Millis`] on whatever clock the caller keeps; the gateway's shell
//! uses a monotonic one for the pauses and release times), so the shell only
//! reads its clock and sleeps until [`ReleaseQueue::next_due`].
//!
//! A release that fails is never forgotten: the lease may still be billing,
//! so it stays in the queue (and draining) and is retried, backing off from
//! [`RELEASE_RETRY_MS`] to [`RELEASE_RETRY_MAX_MS`], until the provider
//! reports it gone.

use std::collections::BTreeMap;
use std::time::Duration;

use tidegate_kit::backoff::{self, Backoff, Jitter};

use crate::billing::Millis;
use crate::lifecycle::{EndReason, LeaseState};
use crate::table::LeaseId;

/// First pause on acquisitions after a lease failed to start (ms).
pub const ACQUIRE_BACKOFF_MS: Millis = 1000;
/// Longest pause on acquisitions after repeated start failures (ms).
pub const ACQUIRE_BACKOFF_MAX_MS: Millis = 60_000;
/// First wait before a failed provider release is tried again (ms).
pub const RELEASE_RETRY_MS: Millis = 1000;
/// Longest wait between tries of a release that keeps failing (ms).
pub const RELEASE_RETRY_MAX_MS: Millis = 60_000;

/// After a lease fails to start (spawn error, or its worker ended before it
/// registered), acquisitions pause, doubling per failure up to
/// [`ACQUIRE_BACKOFF_MAX_MS`], so a broken worker command cannot spawn a
/// process (and write a ledger row) every tick. A lease becoming ready
/// resets it.
///
/// The pauses are the client kit's [`Backoff`] without jitter (one gateway,
/// nobody to keep out of step); the policy here is what the kit does not
/// know: a failure while paused does not count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AcquireBackoff {
    /// Paused until.
    paused_until: Option<Millis>,
    /// The pause after the next failure, and after it.
    pauses: Backoff,
}

impl Default for AcquireBackoff {
    fn default() -> Self {
        AcquireBackoff {
            paused_until: None,
            pauses: Backoff::new(
                Duration::from_millis(ACQUIRE_BACKOFF_MS),
                Duration::from_millis(ACQUIRE_BACKOFF_MAX_MS),
                0,
            )
            .with_jitter(Jitter::NONE),
        }
    }
}

impl AcquireBackoff {
    /// Not paused.
    pub fn new() -> AcquireBackoff {
        AcquireBackoff::default()
    }

    /// A lease failed to start at `now`: pause; returns the pause (ms).
    /// A failure while already paused came from an acquisition made
    /// before the pause (several are made and answered together): it
    /// tells nothing new, and the pause stays as it is.
    pub fn start_failed(&mut self, now: Millis) -> Millis {
        if let Some(until) = self.paused_until
            && now < until
        {
            return until - now;
        }
        let pause = millis(self.pauses.next_delay());
        self.paused_until = Some(now.saturating_add(pause));
        pause
    }

    /// Whether an acquisition may be made at `now`.
    pub fn allows(&self, now: Millis) -> bool {
        self.paused_until.is_none_or(|until| now >= until)
    }

    /// A lease became ready: starts work again, the next failure pauses
    /// for [`ACQUIRE_BACKOFF_MS`].
    pub fn reset(&mut self) {
        self.paused_until = None;
        self.pauses.reset();
    }
}

/// `d` in whole milliseconds, saturating.
fn millis(d: Duration) -> Millis {
    Millis::try_from(d.as_millis()).unwrap_or(Millis::MAX)
}

/// Whether a lease that is `state` and was requested at `requested_at` has
/// waited longer than `timeout_ms` for its worker to register (it is then
/// ended as `failed` and released). Only leases not yet ready time out.
pub fn start_timed_out(
    state: LeaseState,
    requested_at: Millis,
    now: Millis,
    timeout_ms: Millis,
) -> bool {
    matches!(state, LeaseState::Requested | LeaseState::Starting)
        && now.saturating_sub(requested_at) > timeout_ms
}

/// One lease waiting for its provider release.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PendingRelease {
    /// When the release is (next) due.
    pub due: Millis,
    /// How the lease ends once released.
    pub reason: EndReason,
    /// Tries that failed so far.
    pub failures: u32,
    /// A try is under way ([`ReleaseQueue::start`]): not due again until
    /// it has ended, by [`ReleaseQueue::done`] or [`ReleaseQueue::failed`].
    pub running: bool,
}

/// The leases whose dispatch has stopped and whose provider release is due
/// (after the grace for their batches in flight) or is being retried.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReleaseQueue {
    pending: BTreeMap<LeaseId, PendingRelease>,
}

impl ReleaseQueue {
    /// An empty queue.
    pub fn new() -> ReleaseQueue {
        ReleaseQueue::default()
    }

    /// Releases `lease` at `due`, to end it as `reason`. When it is
    /// already queued this returns `false`: the first reason stands, and
    /// the release only moves earlier (an operator's release of a lease
    /// under a spot notice, or of one whose retry waits); a try under way
    /// goes on.
    pub fn schedule(&mut self, lease: LeaseId, due: Millis, reason: EndReason) -> bool {
        if let Some(p) = self.pending.get_mut(&lease) {
            p.due = p.due.min(due);
            return false;
        }
        self.pending.insert(
            lease,
            PendingRelease {
                due,
                reason,
                failures: 0,
                running: false,
            },
        );
        true
    }

    /// A try at releasing `lease` starts: it is not due again until the
    /// try ends ([`ReleaseQueue::done`] or [`ReleaseQueue::failed`]).
    /// False when it is not queued, or a try is already under way.
    pub fn start(&mut self, lease: LeaseId) -> bool {
        match self.pending.get_mut(&lease) {
            Some(p) if !p.running => {
                p.running = true;
                true
            }
            _ => false,
        }
    }

    /// Whether a try at releasing `lease` is under way.
    pub fn is_running(&self, lease: LeaseId) -> bool {
        self.pending.get(&lease).is_some_and(|p| p.running)
    }

    /// Whether `lease` is queued.
    pub fn contains(&self, lease: LeaseId) -> bool {
        self.pending.contains_key(&lease)
    }

    /// The queued release of `lease`.
    pub fn get(&self, lease: LeaseId) -> Option<PendingRelease> {
        self.pending.get(&lease).copied()
    }

    /// Every queued lease, in id order.
    pub fn leases(&self) -> Vec<LeaseId> {
        self.pending.keys().copied().collect()
    }

    /// Number of queued leases.
    pub fn len(&self) -> usize {
        self.pending.len()
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// The leases due by `now`, soonest first; none whose try is under
    /// way.
    pub fn due(&self, now: Millis) -> Vec<LeaseId> {
        let mut due: Vec<(Millis, LeaseId)> = self
            .pending
            .iter()
            .filter(|(_, p)| p.due <= now && !p.running)
            .map(|(l, p)| (p.due, *l))
            .collect();
        due.sort_unstable();
        due.into_iter().map(|(_, l)| l).collect()
    }

    /// When the soonest release not under way is due.
    pub fn next_due(&self) -> Option<Millis> {
        self.pending
            .values()
            .filter(|p| !p.running)
            .map(|p| p.due)
            .min()
    }

    /// The lease is gone (released, or ended by its provider): it leaves
    /// the queue; the reason it was to end with.
    pub fn done(&mut self, lease: LeaseId) -> Option<EndReason> {
        self.pending.remove(&lease).map(|p| p.reason)
    }

    /// The provider release failed at `now`: the lease stays queued and is
    /// tried again later, backing off. Returns when (`None` if it was not
    /// queued).
    pub fn failed(&mut self, lease: LeaseId, now: Millis) -> Option<Millis> {
        let p = self.pending.get_mut(&lease)?;
        p.running = false;
        p.failures = p.failures.saturating_add(1);
        let wait = millis(backoff::step(
            Duration::from_millis(RELEASE_RETRY_MS),
            Duration::from_millis(RELEASE_RETRY_MAX_MS),
            p.failures - 1,
        ));
        p.due = now.saturating_add(wait);
        Some(p.due)
    }
}

/// The reason a lease that was being released ends with, when its provider
/// reports it ended first: as intended (`released`, or `failed` for a start
/// timeout), unless the provider preempted it.
pub fn end_reason_while_releasing(intended: EndReason, reported: EndReason) -> EndReason {
    if reported == EndReason::Preempted {
        reported
    } else {
        intended
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn acquisitions_pause_longer_after_each_failed_start_and_resume_when_one_is_ready() {
        let mut b = AcquireBackoff::new();
        assert!(b.allows(0));
        assert_eq!(b.start_failed(10_000), 1000);
        assert!(!b.allows(10_999));
        assert!(b.allows(11_000));
        assert_eq!(b.start_failed(11_000), 2000);
        assert!(!b.allows(12_999));
        // the failures of acquisitions made together: one pause
        assert_eq!(b.start_failed(11_500), 1500);
        assert!(!b.allows(12_999));
        assert!(b.allows(13_000));
        let (mut now, mut pauses) = (13_000, Vec::new());
        for _ in 0..7 {
            let pause = b.start_failed(now);
            pauses.push(pause);
            now += pause;
        }
        assert_eq!(pauses, [4000, 8000, 16_000, 32_000, 60_000, 60_000, 60_000]);
        b.reset();
        assert!(b.allows(20_000));
        assert_eq!(b.start_failed(20_000), 1000);
    }

    #[test]
    fn only_leases_not_yet_ready_time_out_and_only_after_the_timeout() {
        use LeaseState::*;
        assert!(!start_timed_out(Starting, 1000, 61_000, 60_000));
        assert!(start_timed_out(Starting, 1000, 61_001, 60_000));
        assert!(start_timed_out(Requested, 1000, 61_001, 60_000));
        for s in [Ready, Draining, Ended(EndReason::Lost)] {
            assert!(!start_timed_out(s, 0, u64::MAX, 60_000), "{s}");
        }
        // a clock that went backwards is not a timeout
        assert!(!start_timed_out(Starting, 5000, 1000, 0));
    }

    #[test]
    fn a_release_is_due_after_its_grace_and_a_failed_one_is_retried_not_forgotten() {
        let mut q = ReleaseQueue::new();
        assert!(q.schedule(LeaseId(1), 2000, EndReason::Released));
        assert!(
            !q.schedule(LeaseId(1), 9000, EndReason::Failed),
            "queued once; the first reason stands"
        );
        assert_eq!(q.get(LeaseId(1)).unwrap().due, 2000, "never later");
        assert!(!q.schedule(LeaseId(1), 1800, EndReason::Failed));
        assert_eq!(
            q.get(LeaseId(1)).unwrap(),
            PendingRelease {
                due: 1800,
                reason: EndReason::Released,
                failures: 0,
                running: false,
            },
            "sooner"
        );
        assert!(!q.schedule(LeaseId(1), 2000, EndReason::Released));
        assert!(q.schedule(LeaseId(2), 1500, EndReason::Failed));
        assert_eq!(q.next_due(), Some(1500));
        assert!(q.due(1499).is_empty());
        assert_eq!(q.due(2000), vec![LeaseId(2), LeaseId(1)]);
        assert_eq!(q.due(1600), vec![LeaseId(2)]);
        // a try under way is not due again, and a schedule leaves it be
        assert!(q.start(LeaseId(2)));
        assert!(!q.start(LeaseId(2)), "one try at a time");
        assert!(q.is_running(LeaseId(2)));
        assert_eq!(q.due(2000), vec![LeaseId(1)]);
        assert_eq!(q.next_due(), Some(1800));
        assert!(!q.schedule(LeaseId(2), 0, EndReason::Released));
        assert!(q.is_running(LeaseId(2)));
        assert_eq!(q.due(2000), vec![LeaseId(1)]);
        assert_eq!(q.done(LeaseId(2)), Some(EndReason::Failed));
        assert!(!q.start(LeaseId(2)), "not queued");
        // lease 1's provider cannot release it: it stays, retried later
        assert!(q.start(LeaseId(1)));
        assert_eq!(q.failed(LeaseId(1), 2000), Some(3000));
        assert!(q.contains(LeaseId(1)));
        assert!(!q.is_running(LeaseId(1)), "a failed try has ended");
        assert!(q.due(2999).is_empty());
        assert_eq!(q.due(3000), vec![LeaseId(1)]);
        assert_eq!(q.failed(LeaseId(1), 3000), Some(5000));
        assert_eq!(q.failed(LeaseId(1), 5000), Some(9000));
        for _ in 0..40 {
            q.failed(LeaseId(1), 10_000);
        }
        assert_eq!(
            q.get(LeaseId(1)).unwrap().due,
            10_000 + RELEASE_RETRY_MAX_MS
        );
        assert_eq!(q.done(LeaseId(1)), Some(EndReason::Released));
        assert!(q.is_empty());
        assert_eq!(q.next_due(), None);
        assert_eq!(q.failed(LeaseId(1), 0), None);
    }

    #[test]
    fn a_provider_end_during_a_release_keeps_the_intended_reason_unless_preempted() {
        use EndReason::*;
        assert_eq!(end_reason_while_releasing(Released, Lost), Released);
        assert_eq!(end_reason_while_releasing(Failed, Lost), Failed);
        assert_eq!(end_reason_while_releasing(Released, Preempted), Preempted);
    }

    proptest! {
        /// Over any sequence of schedules, failures and completions: a
        /// lease leaves the queue only by `done`, every queued lease is due
        /// within the longest retry wait, and `due` never returns a lease
        /// whose time has not come, nor one whose try is under way.
        #[test]
        fn no_queued_release_is_lost_or_left_without_a_due_time(
            ops in prop::collection::vec((0u8..4, 0u64..6, 0u64..5_000), 1..200)
        ) {
            let mut q = ReleaseQueue::new();
            let mut expected = std::collections::BTreeSet::new();
            let mut now: Millis = 0;
            for (op, id, dt) in ops {
                now += dt;
                let lease = LeaseId(id);
                match op {
                    0 => {
                        q.schedule(lease, now + 1000, EndReason::Released);
                        expected.insert(lease);
                    }
                    1 => {
                        let r = q.failed(lease, now);
                        prop_assert_eq!(r.is_some(), expected.contains(&lease));
                        prop_assert!(!q.is_running(lease));
                    }
                    3 => {
                        let was = q.is_running(lease);
                        let started = q.start(lease);
                        prop_assert_eq!(started, expected.contains(&lease) && !was);
                        prop_assert_eq!(q.is_running(lease), expected.contains(&lease));
                    }
                    _ => {
                        let r = q.done(lease);
                        prop_assert_eq!(r.is_some(), expected.remove(&lease));
                    }
                }
                prop_assert_eq!(q.leases(), expected.iter().copied().collect::<Vec<_>>());
                for l in q.leases() {
                    let p = q.get(l).unwrap();
                    prop_assert!(p.due <= now + RELEASE_RETRY_MAX_MS.max(1000));
                }
                for l in q.due(now) {
                    prop_assert!(q.get(l).unwrap().due <= now);
                    prop_assert!(!q.is_running(l));
                }
                if let Some(next) = q.next_due() {
                    let soonest = q.leases().iter().any(|l| {
                        let p = q.get(*l).unwrap();
                        p.due == next && !p.running
                    });
                    prop_assert!(soonest);
                }
            }
        }
    }
}
