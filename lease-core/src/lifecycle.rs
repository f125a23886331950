//! The lease lifecycle as a pure state machine with checked transitions.
//!
//! ```text
//! requested ──► starting ──► ready ──► draining ──► ended(reason)
//!     │             │          │                        ▲
//!     └─────────────┴──────────┴────────────────────────┘
//! ```
//!
//! `ready` means the worker registered with its one-time token and warmed
//! its models. `draining` means no new frames are dispatched to it (released
//! by the autoscaler, or a spot preemption notice arrived). Every path ends
//! in `ended` with exactly one [`EndReason`]; nothing leaves `ended`. The
//! ledger and the in-memory [`crate::table::LeaseTable`] both go through
//! [`LeaseState::transition`], so an impossible transition (ready after
//! ended, say) is an error instead of a silently wrong record.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Why a lease ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EndReason {
    /// We released it.
    Released,
    /// The provider reclaimed it (spot).
    Preempted,
    /// It never became ready (spawn failed, worker crashed while starting).
    Failed,
    /// It disappeared: the process died unexpectedly, or it could not be
    /// re-adopted after a gateway restart.
    Lost,
    /// The provider refused it for capacity or quota (no spot to be had, a
    /// full partition): it never started and never billed. Not a failure
    /// of the worker: alerts tell the two apart.
    NoCapacity,
}

impl EndReason {
    /// Every reason.
    pub const ALL: [EndReason; 5] = [
        EndReason::Released,
        EndReason::Preempted,
        EndReason::Failed,
        EndReason::Lost,
        EndReason::NoCapacity,
    ];

    /// Name used in SQL and JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            EndReason::Released => "released",
            EndReason::Preempted => "preempted",
            EndReason::Failed => "failed",
            EndReason::Lost => "lost",
            EndReason::NoCapacity => "no_capacity",
        }
    }

    /// Parses [`EndReason::as_str`]'s output.
    pub fn parse(s: &str) -> Option<EndReason> {
        EndReason::ALL.into_iter().find(|r| r.as_str() == s)
    }
}

/// Where a lease is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "state", content = "reason")]
pub enum LeaseState {
    /// Asked of the provider, not yet accepted.
    Requested,
    /// The provider accepted; the worker is booting (billing has started).
    Starting,
    /// The worker registered and warmed; frames may be dispatched.
    Ready,
    /// No new frames; waiting for in-flight work or the provider's kill.
    Draining,
    /// Over.
    Ended(EndReason),
}

/// A transition the lifecycle does not allow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("lease cannot go from {from} to {to}")]
pub struct TransitionError {
    /// The state it was in.
    pub from: LeaseState,
    /// The state asked for.
    pub to: LeaseState,
}

impl LeaseState {
    /// Label for metrics and SQL: `requested`, `starting`, `ready`,
    /// `draining` or `ended`.
    pub fn label(self) -> &'static str {
        match self {
            LeaseState::Requested => "requested",
            LeaseState::Starting => "starting",
            LeaseState::Ready => "ready",
            LeaseState::Draining => "draining",
            LeaseState::Ended(_) => "ended",
        }
    }

    /// Rebuilds a state from [`LeaseState::label`] and an optional reason.
    pub fn from_parts(label: &str, reason: Option<&str>) -> Option<LeaseState> {
        Some(match label {
            "requested" => LeaseState::Requested,
            "starting" => LeaseState::Starting,
            "ready" => LeaseState::Ready,
            "draining" => LeaseState::Draining,
            "ended" => LeaseState::Ended(EndReason::parse(reason?)?),
            _ => return None,
        })
    }

    /// Whether the lease is over.
    pub fn is_ended(self) -> bool {
        matches!(self, LeaseState::Ended(_))
    }

    /// Whether `self → to` is allowed.
    pub fn can_go_to(self, to: LeaseState) -> bool {
        use LeaseState::*;
        match (self, to) {
            (Ended(_), _) => false,
            (_, Ended(_)) => true,
            (Requested, Starting) => true,
            (Starting, Ready) | (Starting, Draining) => true,
            (Ready, Draining) => true,
            _ => false,
        }
    }

    /// The checked transition.
    pub fn transition(self, to: LeaseState) -> Result<LeaseState, TransitionError> {
        if self.can_go_to(to) {
            Ok(to)
        } else {
            Err(TransitionError { from: self, to })
        }
    }
}

impl fmt::Display for LeaseState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LeaseState::Ended(r) => write!(f, "ended({})", r.as_str()),
            s => f.write_str(s.label()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use LeaseState::*;

    #[test]
    fn happy_path_is_allowed() {
        let s = Requested
            .transition(Starting)
            .and_then(|s| s.transition(Ready))
            .and_then(|s| s.transition(Draining))
            .and_then(|s| s.transition(Ended(EndReason::Released)))
            .unwrap();
        assert_eq!(s, Ended(EndReason::Released));
    }

    #[test]
    fn nothing_leaves_ended_and_nothing_goes_backwards() {
        let ended = Ended(EndReason::Lost);
        for to in [
            Requested,
            Starting,
            Ready,
            Draining,
            Ended(EndReason::Released),
        ] {
            assert!(ended.transition(to).is_err(), "ended -> {to}");
        }
        assert!(Ready.transition(Starting).is_err());
        assert!(Draining.transition(Ready).is_err());
        assert!(Requested.transition(Ready).is_err());
        let e = Draining.transition(Ready).unwrap_err();
        assert_eq!(e.to_string(), "lease cannot go from draining to ready");
    }

    #[test]
    fn labels_round_trip() {
        for s in [
            Requested,
            Starting,
            Ready,
            Draining,
            Ended(EndReason::Preempted),
        ] {
            let reason = match s {
                Ended(r) => Some(r.as_str()),
                _ => None,
            };
            assert_eq!(LeaseState::from_parts(s.label(), reason), Some(s));
        }
    }
}
