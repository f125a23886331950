//! Worker membership: which registered workers take batches, and for which
//! lease. Pure: the hub feeds it registrations, departures and the lease
//! shell's messages, and it answers what the scheduler must be told of each
//! worker whose membership changed ([`Change`]).
//!
//! A worker is in one of four states ([`Membership`]):
//! - **serving**: it takes batches, for its lease if it has one;
//! - **draining**: its lease is being released (or got a spot notice): no
//!   new batch, the ones it holds finish; bound again to a live lease (a
//!   static worker), it serves again;
//! - **retiring**: it said `Drain`, or an operator drained it: no batch ever
//!   again, whatever lease message comes; it exits, and its lease ends when
//!   it goes;
//! - **unbound**: a static worker bound to no lease: connected, registered,
//!   no batch until a lease binds it.
//!
//! The lease-level state lives here too: the leases told to drain and the
//! lease bound to each static worker's name, both applied to a worker that
//! registers after the message came.

use std::collections::{HashMap, HashSet};

use tidegate_lease::LeaseId;

use crate::scheduler::WorkerId;

/// Whether a worker takes batches, and the lease it serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Membership {
    /// Takes batches; `None` for a worker that came with no lease pass.
    Serving { lease: Option<LeaseId> },
    /// Its lease drains: no new batch.
    Draining { lease: LeaseId },
    /// It said `Drain` or an operator drained it: never serves again.
    Retiring { lease: Option<LeaseId> },
    /// A static worker bound to no lease.
    Unbound,
}

impl Membership {
    /// The lease it serves, if any.
    pub(super) fn lease(self) -> Option<LeaseId> {
        match self {
            Membership::Serving { lease } | Membership::Retiring { lease } => lease,
            Membership::Draining { lease } => Some(lease),
            Membership::Unbound => None,
        }
    }

    /// Whether the scheduler may send it batches.
    pub(super) fn takes_batches(self) -> bool {
        matches!(self, Membership::Serving { .. })
    }
}

/// What the scheduler must be told of a worker whose membership changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Change {
    /// Its lease or state changed, but it takes batches as before, or
    /// takes none as before.
    Quiet,
    /// It takes no new batch (`Event::WorkerDraining`).
    Drain,
    /// It takes batches again, keeping what it holds
    /// (`Event::WorkerResumed`).
    Resume,
    /// It is gone with its lease (`Event::WorkerLost`).
    Lose,
}

/// One registered worker's membership.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Member {
    /// A static worker's name: it serves whichever lease is bound to it,
    /// and only it outlives a lease.
    pub(super) static_name: Option<String>,
    pub(super) state: Membership,
}

impl Member {
    /// A static worker with no lease bound to its name (it shows
    /// `unbound`, retiring or not).
    pub(super) fn unbound(&self) -> bool {
        self.static_name.is_some() && self.state.lease().is_none()
    }

    /// It said `Drain`, or an operator drained it.
    fn retire(&mut self) -> Change {
        let was = self.state;
        self.state = Membership::Retiring { lease: was.lease() };
        if was.takes_batches() {
            Change::Drain
        } else {
            Change::Quiet
        }
    }

    /// Its lease `lease` is being released. Only a serving worker of that
    /// lease changes.
    fn drain_lease(&mut self, lease: LeaseId) -> Option<Change> {
        match self.state {
            Membership::Serving { lease: Some(l) } if l == lease => {
                self.state = Membership::Draining { lease };
                Some(Change::Drain)
            }
            _ => None,
        }
    }

    /// `lease` was bound to this worker's static name (`draining`: the
    /// lease is already told to drain). A leased worker's lease is fixed,
    /// so it ignores this, as does a static worker already bound to
    /// `lease`; a retiring worker takes the lease (it ends when the worker
    /// goes) but never serves again.
    fn bind(&mut self, lease: LeaseId, draining: bool) -> Option<Change> {
        if self.static_name.is_none() || self.state.lease() == Some(lease) {
            return None;
        }
        let was = self.state;
        if let Membership::Retiring { .. } = was {
            self.state = Membership::Retiring { lease: Some(lease) };
            return Some(Change::Quiet);
        }
        self.state = if draining {
            Membership::Draining { lease }
        } else {
            Membership::Serving { lease: Some(lease) }
        };
        Some(match (was.takes_batches(), self.state.takes_batches()) {
            (false, true) => Change::Resume,
            (true, false) => Change::Drain,
            _ => Change::Quiet,
        })
    }

    /// Its lease ended other than by its loss: a static worker stays
    /// connected, unbound (retiring if it was); any other goes with it.
    fn unbind(&mut self) -> Change {
        if self.static_name.is_none() {
            return Change::Lose;
        }
        let was = self.state;
        self.state = match was {
            Membership::Retiring { .. } => Membership::Retiring { lease: None },
            _ => Membership::Unbound,
        };
        if was.takes_batches() {
            Change::Drain
        } else {
            Change::Quiet
        }
    }
}

/// The registered workers' memberships and the lease messages that apply
/// to workers yet to register.
#[derive(Debug, Default)]
pub(super) struct Roster {
    members: HashMap<WorkerId, Member>,
    /// Leases told to drain (applied to their worker when it registers).
    draining_leases: HashSet<LeaseId>,
    /// The lease each static worker's name is bound to (applied to its
    /// worker when it registers).
    static_bindings: HashMap<String, LeaseId>,
}

impl Roster {
    /// A worker registered with `lease` from its pass, or as the static
    /// worker `static_name` (which serves the lease bound to its name):
    /// its membership, which says whether it takes batches.
    pub(super) fn join(
        &mut self,
        worker: WorkerId,
        lease: Option<LeaseId>,
        static_name: Option<String>,
    ) -> Membership {
        let lease = match &static_name {
            Some(name) => self.static_bindings.get(name).copied(),
            None => lease,
        };
        let state = match lease {
            None if static_name.is_some() => Membership::Unbound,
            Some(l) if self.draining_leases.contains(&l) => Membership::Draining { lease: l },
            lease => Membership::Serving { lease },
        };
        self.members.insert(worker, Member { static_name, state });
        state
    }

    /// A worker went (disconnected, dropped, or lost with its lease): its
    /// membership, if it had one.
    pub(super) fn leave(&mut self, worker: WorkerId) -> Option<Member> {
        self.members.remove(&worker)
    }

    pub(super) fn get(&self, worker: WorkerId) -> Option<&Member> {
        self.members.get(&worker)
    }

    /// The lease `worker` serves, if any.
    pub(super) fn lease(&self, worker: WorkerId) -> Option<LeaseId> {
        self.get(worker).and_then(|m| m.state.lease())
    }

    /// The worker said `Drain`, or an operator drained it: `None` if it is
    /// not registered.
    pub(super) fn retire(&mut self, worker: WorkerId) -> Option<Change> {
        self.members.get_mut(&worker).map(Member::retire)
    }

    /// The lease shell stops dispatch to `lease`'s worker; one that
    /// registers later starts draining.
    pub(super) fn lease_draining(&mut self, lease: LeaseId) -> Vec<(WorkerId, Change)> {
        self.draining_leases.insert(lease);
        self.each(|m| m.drain_lease(lease))
    }

    /// `lease` ended with its worker (released, preempted, lost): its
    /// workers are lost, and its drain and binding forgotten.
    pub(super) fn lease_ended(&mut self, lease: LeaseId) -> Vec<(WorkerId, Change)> {
        self.forget(lease);
        self.each(|m| (m.state.lease() == Some(lease)).then_some(Change::Lose))
    }

    /// `lease` was bound to the static worker `name`, now or when it
    /// registers.
    pub(super) fn lease_bound(&mut self, lease: LeaseId, name: &str) -> Vec<(WorkerId, Change)> {
        self.static_bindings.insert(name.to_string(), lease);
        let draining = self.draining_leases.contains(&lease);
        self.each(|m| {
            if m.static_name.as_deref() == Some(name) {
                m.bind(lease, draining)
            } else {
                None
            }
        })
    }

    /// `lease` ended other than by its worker's loss: a static worker
    /// stays, unbound; any other is lost.
    pub(super) fn lease_unbound(&mut self, lease: LeaseId) -> Vec<(WorkerId, Change)> {
        self.forget(lease);
        self.each(|m| (m.state.lease() == Some(lease)).then(|| m.unbind()))
    }

    fn forget(&mut self, lease: LeaseId) {
        self.draining_leases.remove(&lease);
        self.static_bindings.retain(|_, l| *l != lease);
    }

    /// Applies `f` to every member; those it changed, in worker order.
    fn each(
        &mut self,
        mut f: impl FnMut(&mut Member) -> Option<Change>,
    ) -> Vec<(WorkerId, Change)> {
        let mut changed: Vec<(WorkerId, Change)> = self
            .members
            .iter_mut()
            .filter_map(|(id, m)| Some((*id, f(m)?)))
            .collect();
        changed.sort_unstable_by_key(|(id, _)| *id);
        changed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const L5: LeaseId = LeaseId(5);
    const L6: LeaseId = LeaseId(6);
    const W1: WorkerId = WorkerId(1);

    fn state(r: &Roster, w: WorkerId) -> Membership {
        r.get(w).expect("registered").state
    }

    /// A roster with worker 1 registered as the static worker `gpu-a`.
    fn with_static() -> Roster {
        let mut r = Roster::default();
        r.join(W1, None, Some("gpu-a".into()));
        r
    }

    #[test]
    fn a_worker_joins_serving_its_pass_lease_or_draining_if_the_lease_drains_first() {
        let mut r = Roster::default();
        assert_eq!(
            r.join(W1, Some(L5), None),
            Membership::Serving { lease: Some(L5) }
        );
        assert_eq!(
            r.join(WorkerId(2), None, None),
            Membership::Serving { lease: None }
        );
        assert_eq!(r.lease_draining(L6), vec![]);
        assert_eq!(
            r.join(WorkerId(3), Some(L6), None),
            Membership::Draining { lease: L6 }
        );
        assert!(!state(&r, WorkerId(3)).takes_batches());
        assert_eq!(r.lease(WorkerId(3)), Some(L6));
    }

    #[test]
    fn a_static_worker_joins_unbound_or_serving_the_lease_bound_to_its_name() {
        let mut r = with_static();
        assert_eq!(state(&r, W1), Membership::Unbound);
        assert!(r.get(W1).unwrap().unbound());
        r.leave(W1);
        assert_eq!(r.lease_bound(L5, "gpu-a"), vec![], "no worker yet");
        // the pass's lease is not a static worker's: its name's binding is
        assert_eq!(
            r.join(W1, Some(L6), Some("gpu-a".into())),
            Membership::Serving { lease: Some(L5) }
        );
        r.leave(W1);
        r.lease_draining(L5);
        assert_eq!(
            r.join(W1, None, Some("gpu-a".into())),
            Membership::Draining { lease: L5 }
        );
    }

    #[test]
    fn binding_an_unbound_static_worker_resumes_it_and_unbinding_drains_it() {
        let mut r = with_static();
        assert_eq!(r.lease_bound(L5, "gpu-a"), vec![(W1, Change::Resume)]);
        assert_eq!(state(&r, W1), Membership::Serving { lease: Some(L5) });
        assert_eq!(r.lease_bound(L5, "gpu-a"), vec![], "already bound");
        assert_eq!(r.lease_bound(L6, "gpu-b"), vec![], "another name");
        assert_eq!(r.lease_unbound(L5), vec![(W1, Change::Drain)]);
        assert_eq!(state(&r, W1), Membership::Unbound);
        assert_eq!(r.lease_unbound(L5), vec![], "no longer its lease");
    }

    #[test]
    fn a_lease_drains_its_serving_worker_once_and_a_live_lease_bound_resumes_it() {
        let mut r = with_static();
        r.lease_bound(L5, "gpu-a");
        assert_eq!(r.lease_draining(L6), vec![], "not its lease");
        assert_eq!(r.lease_draining(L5), vec![(W1, Change::Drain)]);
        assert_eq!(state(&r, W1), Membership::Draining { lease: L5 });
        assert_eq!(r.lease_draining(L5), vec![], "already draining");
        // rebound to a lease that also drains: it stays out
        r.lease_draining(L6);
        assert_eq!(r.lease_bound(L6, "gpu-a"), vec![(W1, Change::Quiet)]);
        assert_eq!(state(&r, W1), Membership::Draining { lease: L6 });
        // to a live one: it serves again
        assert_eq!(
            r.lease_bound(LeaseId(7), "gpu-a"),
            vec![(W1, Change::Resume)]
        );
        assert_eq!(
            state(&r, W1),
            Membership::Serving {
                lease: Some(LeaseId(7))
            }
        );
        // a draining lease's drain is forgotten once it is unbound
        assert_eq!(r.lease_unbound(L6), vec![]);
        assert_eq!(r.lease_bound(L6, "gpu-a"), vec![(W1, Change::Quiet)]);
        assert_eq!(state(&r, W1), Membership::Serving { lease: Some(L6) });
    }

    #[test]
    fn a_serving_static_worker_rebound_to_a_draining_lease_drains() {
        let mut r = with_static();
        r.lease_bound(L5, "gpu-a");
        r.lease_draining(L6);
        assert_eq!(r.lease_bound(L6, "gpu-a"), vec![(W1, Change::Drain)]);
        assert_eq!(state(&r, W1), Membership::Draining { lease: L6 });
        // unbound while draining: nothing more for the scheduler
        assert_eq!(r.lease_unbound(L6), vec![(W1, Change::Quiet)]);
        assert_eq!(state(&r, W1), Membership::Unbound);
    }

    #[test]
    fn a_retiring_worker_never_serves_again_whatever_lease_message_comes() {
        for start in ["unbound", "serving", "draining"] {
            let mut r = with_static();
            match start {
                "serving" => {
                    r.lease_bound(L5, "gpu-a");
                }
                "draining" => {
                    r.lease_bound(L5, "gpu-a");
                    r.lease_draining(L5);
                }
                _ => {}
            }
            let change = r.retire(W1);
            let expect = if start == "serving" {
                Change::Drain
            } else {
                Change::Quiet
            };
            assert_eq!(change, Some(expect), "{start}");
            assert!(matches!(state(&r, W1), Membership::Retiring { .. }));
            // said again: no change for the scheduler
            assert_eq!(r.retire(W1), Some(Change::Quiet), "{start}");
            // bound to a live lease: it takes the lease, never a batch
            assert_eq!(r.lease_bound(L6, "gpu-a"), vec![(W1, Change::Quiet)]);
            assert_eq!(state(&r, W1), Membership::Retiring { lease: Some(L6) });
            assert_eq!(r.lease_draining(L6), vec![], "{start}");
            assert_eq!(r.lease_unbound(L6), vec![(W1, Change::Quiet)]);
            assert_eq!(state(&r, W1), Membership::Retiring { lease: None });
            assert!(r.get(W1).unwrap().unbound(), "shown unbound: {start}");
            assert_eq!(
                r.lease_bound(LeaseId(7), "gpu-a"),
                vec![(W1, Change::Quiet)]
            );
            assert!(!state(&r, W1).takes_batches(), "{start}");
            // its lease still ends with it
            assert_eq!(r.lease_ended(LeaseId(7)), vec![(W1, Change::Lose)]);
        }
        assert_eq!(Roster::default().retire(W1), None, "not registered");
    }

    #[test]
    fn a_leased_workers_lease_is_fixed_bindings_pass_it_by_and_its_unbinding_loses_it() {
        let mut r = Roster::default();
        r.join(W1, Some(L5), None);
        assert_eq!(r.lease_bound(L6, "lease-5"), vec![]);
        assert_eq!(state(&r, W1), Membership::Serving { lease: Some(L5) });
        assert_eq!(r.lease_unbound(L5), vec![(W1, Change::Lose)]);
        // and a worker with no lease is touched by no lease message
        let mut r = Roster::default();
        r.join(W1, None, None);
        for changes in [
            r.lease_draining(L5),
            r.lease_bound(L5, "gpu-a"),
            r.lease_unbound(L5),
            r.lease_ended(L5),
        ] {
            assert_eq!(changes, vec![]);
        }
        assert_eq!(state(&r, W1), Membership::Serving { lease: None });
    }

    #[test]
    fn an_ended_lease_loses_its_workers_and_forgets_its_drain_and_binding() {
        let mut r = with_static();
        r.join(WorkerId(2), Some(L5), None);
        r.lease_bound(L5, "gpu-a");
        r.lease_draining(L5);
        assert_eq!(
            r.lease_ended(L5),
            vec![(W1, Change::Lose), (WorkerId(2), Change::Lose)]
        );
        r.leave(W1);
        r.leave(WorkerId(2));
        // a later registration finds neither the binding nor the drain
        assert_eq!(r.join(W1, None, Some("gpu-a".into())), Membership::Unbound);
        assert_eq!(
            r.join(WorkerId(2), Some(L5), None),
            Membership::Serving { lease: Some(L5) }
        );
        assert!(r.leave(WorkerId(3)).is_none());
    }
}
