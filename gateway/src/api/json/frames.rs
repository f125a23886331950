//! Frame accounting: the totals since the gateway started, the counts over
//! a span by how frames ended, and the latency edges reported.

use serde::Serialize;
use utoipa::ToSchema;

/// Frame accounting since the gateway started: `admitted = ok + shed +
/// expired + failed + queued + dispatched`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, ToSchema)]
pub struct FrameTotals {
    /// Frames accepted into the scheduler.
    pub admitted: u64,
    /// Finished with inference results.
    pub ok: u64,
    /// Dropped before dispatch.
    pub shed: u64,
    /// Deadline passed while queued.
    pub expired: u64,
    /// Failed (worker error or worker lost).
    pub failed: u64,
    /// Waiting in a queue now.
    pub queued: u64,
    /// Dispatched to a worker and not yet finished.
    pub dispatched: u64,
    /// Times a lost worker's frame was queued again (not part of the
    /// identity: such a frame is still in flight, then ends once).
    pub requeued: u64,
    /// Times a frame a worker failed was queued again for another worker
    /// (at most once a frame; not part of the identity either).
    pub retried: u64,
    /// Frames no worker's estimate could finish in time, sent alone to an
    /// idle worker as a trial of its estimate (dispatched frames, so not
    /// part of the identity either).
    pub trials: u64,
}

impl From<crate::scheduler::Counters> for FrameTotals {
    fn from(c: crate::scheduler::Counters) -> Self {
        let crate::scheduler::Counters {
            admitted,
            ok,
            shed,
            expired,
            failed,
            queued,
            dispatched,
            requeued,
            retried,
            trials,
        } = c;
        FrameTotals {
            admitted,
            ok,
            shed,
            expired,
            failed,
            queued,
            dispatched,
            requeued,
            retried,
            trials,
        }
    }
}

/// Frames over a span of time, by how they ended.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, ToSchema)]
pub struct FrameCounts {
    /// Frames that arrived and were admitted.
    pub admitted: u64,
    /// Frames answered with results.
    pub ok: u64,
    /// Frames shed by the gateway (overload, would miss their deadline, no
    /// worker, superseded), not counting `edge_gone`.
    pub shed: u64,
    /// Frames whose deadline passed while queued.
    pub expired: u64,
    /// Frames a worker failed, or lost with its worker.
    pub failed: u64,
    /// Queued frames dropped because their edge disconnected.
    pub edge_gone: u64,
}

impl FrameCounts {
    /// Frames that ended (any status but `edge_gone`), as
    /// [`crate::timeline::FrameCounts::ended`] counts them.
    pub fn ended(&self) -> u64 {
        self.ok + self.shed + self.expired + self.failed
    }
}

impl From<crate::timeline::FrameCounts> for FrameCounts {
    fn from(c: crate::timeline::FrameCounts) -> Self {
        let crate::timeline::FrameCounts {
            admitted,
            ok,
            shed,
            expired,
            failed,
            edge_gone,
        } = c;
        FrameCounts {
            admitted,
            ok,
            shed,
            expired,
            failed,
            edge_gone,
        }
    }
}

/// End-to-end latency percentiles, as edges reported them.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, ToSchema)]
pub struct Percentiles {
    /// Samples they were taken from.
    pub samples: u64,
    /// Median (ms).
    pub p50_ms: f64,
    /// 95th percentile (ms).
    pub p95_ms: f64,
    /// 99th percentile (ms).
    pub p99_ms: f64,
    /// Largest (ms).
    pub max_ms: f64,
}

impl From<crate::timeline::Percentiles> for Percentiles {
    fn from(p: crate::timeline::Percentiles) -> Self {
        let crate::timeline::Percentiles {
            samples,
            p50_ms,
            p95_ms,
            p99_ms,
            max_ms,
        } = p;
        Percentiles {
            samples,
            p50_ms,
            p95_ms,
            p99_ms,
            max_ms,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_end_as_the_timeline_counts_them() {
        let t = crate::timeline::FrameCounts {
            admitted: 20,
            ok: 11,
            shed: 5,
            expired: 2,
            failed: 1,
            edge_gone: 1,
        };
        assert_eq!(FrameCounts::from(t).ended(), t.ended());
    }
}
