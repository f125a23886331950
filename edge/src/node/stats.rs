//! What each camera counted: [`CameraStats`], shared by the camera's task
//! (which counts frames and keeps a snapshot of its capture, limits and
//! encoding) and the node's loop (which counts results), and
//! [`CameraSummary`], the line printed and published from them. Counting
//! only: no task, no I/O.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use serde::Serialize;
use tidegate_protocol::{ShedReason, Status};

use crate::gate::CameraLimits;
use crate::outbound::{OutboundReport, ResultCounts};
use crate::uplink::{FrameEnds, LaneStats};

/// One camera's counters, shared between its task and the summaries. How
/// its frames ended beyond the wire (results for frames reset, frames lost
/// with their connection) is counted by the node's [`Unanswered`], which
/// sees both a frame's result and its fate on the wire.
///
/// [`Unanswered`]: crate::uplink::Unanswered
#[derive(Debug, Default)]
pub struct CameraStats {
    /// Frames handed to the uplink (a stream opened for each).
    pub handed: AtomicU64,
    /// Wire outcomes.
    pub lane: Arc<LaneStats>,
    /// Frames that passed the gate while no connection (or no open camera)
    /// could take them, including a frame whose stream could not be opened
    /// because the connection had just gone: dropped, never sent late. Such
    /// a frame is counted here only, not in the lane's `lost`.
    pub dropped_outage: AtomicU64,
    /// Results received.
    pub results: AtomicU64,
    /// Results with status ok.
    pub ok: AtomicU64,
    /// Results late: `ok` but over the budget, or shed by the gateway as
    /// late on arrival (the link ate the budget).
    pub late: AtomicU64,
    /// Of `late`, the results whose time at the gateway and worker alone
    /// was over the budget (a GPU's first run of a shape, a trial of a
    /// worker too slow for the budget): no link could have saved them, so
    /// they do not press the camera's link fit.
    pub late_at_server: AtomicU64,
    /// The camera's budget (µs), what `late` is measured against.
    budget_us: u64,
    snapshot: Mutex<CameraSnapshot>,
}

/// What a camera's task last saw of its capture, limits and encoding
/// (read at each summary).
#[derive(Debug, Clone, Default)]
pub(super) struct CameraSnapshot {
    /// See [`CameraSummary::state`]; empty until the task starts.
    pub(super) state: &'static str,
    /// The model's class names, from `CameraAccepted`.
    pub(super) labels: Arc<Vec<String>>,
    pub(super) capture: crate::capture::CaptureCounters,
    pub(super) limits: Option<CameraLimits>,
    pub(super) outbound: Option<OutboundReport>,
}

impl CameraStats {
    /// Counters for a camera whose results are late past `budget_ms`.
    pub(super) fn with_budget(budget_ms: u32) -> Self {
        CameraStats {
            budget_us: u64::from(budget_ms) * 1000,
            ..CameraStats::default()
        }
    }

    pub(super) fn snapshot(&self) -> std::sync::MutexGuard<'_, CameraSnapshot> {
        self.snapshot.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn set_state(&self, state: &'static str) {
        self.snapshot().state = state;
    }

    /// Counts a result of this camera, of a frame captured at
    /// `captured_at_us`, that came back at `now_us` having spent
    /// `server_us` at the gateway and its worker.
    pub(super) fn on_result(
        &self,
        status: &Status,
        captured_at_us: u64,
        server_us: u64,
        now_us: u64,
    ) {
        self.results.fetch_add(1, Ordering::Relaxed);
        let ok = *status == Status::Ok;
        if ok {
            self.ok.fetch_add(1, Ordering::Relaxed);
        }
        let e2e_us = now_us.saturating_sub(captured_at_us);
        if (ok && e2e_us > self.budget_us) || *status == Status::Shed(ShedReason::LateOnArrival) {
            self.late.fetch_add(1, Ordering::Relaxed);
            if ok && server_us > self.budget_us {
                self.late_at_server.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// What the link fit reads: the results, and those late that a faster
    /// link could have saved.
    pub(super) fn result_counts(&self) -> ResultCounts {
        let late = self.late.load(Ordering::Relaxed);
        ResultCounts {
            results: self.results.load(Ordering::Relaxed),
            late: late.saturating_sub(self.late_at_server.load(Ordering::Relaxed)),
        }
    }
}

/// A camera's counters as printed in the summaries (`camera_stats {json}`).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct CameraSummary {
    /// Camera name.
    pub camera: String,
    /// `starting`, `running`, `waiting` (for the gateway or a worker),
    /// `stopped` or `failed`.
    pub state: &'static str,
    /// Frames the pipeline produced.
    pub seen: u64,
    /// Frames that passed the rate cap and motion gate.
    pub passed: u64,
    /// Frames over the rate cap.
    pub skipped_rate: u64,
    /// Frames the motion gate found static.
    pub skipped_static: u64,
    /// Frames evicted from the capture queue unread.
    pub dropped_queue: u64,
    /// Frames dropped while the gateway was unreachable (or no camera was
    /// open on the connection): never handed to the uplink.
    pub dropped_outage: u64,
    /// Frames handed to the uplink. Each ends once, as one of `results`,
    /// `reset_superseded`, `reset_expired`, `refused`, `lost`,
    /// `lost_connection` or `gave_up`, or is still `awaiting`.
    pub handed: u64,
    /// Frames acknowledged by the gateway.
    pub delivered: u64,
    /// Frames reset because a newer one superseded them, without a result
    /// (one the gateway had read and answered anyway counts as a result).
    pub reset_superseded: u64,
    /// Frames reset at their deadline, without a result.
    pub reset_expired: u64,
    /// Frames refused by the gateway, without a result.
    pub refused: u64,
    /// Frames whose stream was open when their connection was lost,
    /// without a result.
    pub lost: u64,
    /// Frames acknowledged by the gateway whose result had not come when
    /// their connection ended (lost, or closed by the edge as it stopped).
    pub lost_connection: u64,
    /// Frames acknowledged whose result was given up on while their
    /// connection lived (over 1024 newer frames of the camera came first):
    /// 0 unless the gateway loses results.
    pub gave_up: u64,
    /// Frames handed that have not ended yet: on the wire, or acknowledged
    /// and awaiting their result.
    pub awaiting: u64,
    /// Results received (a second result for a frame, or one for a frame
    /// this edge did not send, included).
    pub results: u64,
    /// Results with status ok.
    pub ok: u64,
    /// Pipeline restarts.
    pub restarts: u64,
    /// Frame-rate cap in force: the configured one, the gateway's hint and
    /// the adaptation's, whichever is strictest.
    pub max_fps: f64,
    /// Motion threshold in force.
    pub motion_threshold: f64,
    /// How frames travel: `raw`, `jpeg` or `png` (as the gateway accepted
    /// it, once it has).
    pub encoding: &'static str,
    /// JPEG quality in force (0 for other encodings).
    pub quality: u8,
    /// The adaptation's own frame-rate cap (the configured `max_fps` until
    /// the uplink makes it lower it).
    pub adapt_max_fps: f64,
    /// Mean bytes of a frame handed to QUIC, over the last 1 s window that
    /// sent any.
    pub bytes_per_frame: u64,
    /// Mean time to encode a frame (µs), over the last 1 s window that
    /// encoded any (0 for raw).
    pub encode_us: u64,
    /// Frames encoded.
    pub encoded: u64,
    /// Frames the encoder failed (each dropped alone).
    pub encode_failed: u64,
    /// Results late: ok but over the budget, or shed as late on arrival.
    pub late: u64,
    /// The uplink's smoothed round trip at the last window (ms; 0 without
    /// a connection).
    pub rtt_ms: f64,
    /// Copies of each frame sent now (`copies`: fixed, or as `auto`
    /// decides; 0 before the camera is open).
    pub copies: u8,
}

impl CameraSummary {
    /// The counters of camera `name` now; `ends` from the node's
    /// [`Unanswered`].
    pub(super) fn of(name: &str, s: &CameraStats, ends: FrameEnds) -> Self {
        let snap = s.snapshot().clone();
        let l = &s.lane;
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        // A frame the lane reset, or lost, that was answered all the same
        // ended as its result.
        let net = |c: &AtomicU64, answered: u64| load(c).saturating_sub(answered);
        CameraSummary {
            camera: name.to_string(),
            state: if snap.state.is_empty() {
                "starting"
            } else {
                snap.state
            },
            seen: snap.capture.seen,
            passed: snap.capture.passed,
            skipped_rate: snap.capture.skipped_rate,
            skipped_static: snap.capture.skipped_static,
            dropped_queue: snap.capture.dropped_queue,
            dropped_outage: load(&s.dropped_outage),
            handed: load(&s.handed),
            delivered: load(&l.delivered),
            reset_superseded: net(&l.superseded, ends.answered_superseded),
            reset_expired: net(&l.expired, ends.answered_expired),
            refused: net(&l.refused, ends.answered_refused),
            lost: net(&l.lost, ends.answered_lost),
            lost_connection: ends.lost_connection,
            gave_up: ends.gave_up,
            awaiting: ends.awaiting,
            results: load(&s.results),
            ok: load(&s.ok),
            restarts: snap.capture.restarts,
            max_fps: snap.limits.map_or(0.0, |l| l.max_fps),
            motion_threshold: snap.limits.map_or(0.0, |l| l.motion_threshold),
            encoding: snap.outbound.map_or("", |o| o.codec.name()),
            quality: snap.outbound.map_or(0, |o| o.quality),
            adapt_max_fps: snap.outbound.map_or(0.0, |o| o.adapt_max_fps),
            bytes_per_frame: snap.outbound.map_or(0, |o| o.bytes_per_frame),
            encode_us: snap.outbound.map_or(0, |o| o.encode_us),
            encoded: snap.outbound.map_or(0, |o| o.encoded),
            encode_failed: snap.outbound.map_or(0, |o| o.encode_failed),
            late: load(&s.late),
            rtt_ms: snap.outbound.map_or(0.0, |o| o.rtt.as_secs_f64() * 1e3),
            copies: snap.outbound.map_or(0, |o| o.copies),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_result_late_at_the_server_alone_is_late_but_does_not_press_the_link() {
        let s = CameraStats::with_budget(80);
        // On time; late by the link (5 ms at the servers, 90 ms in all);
        // late at the servers (120 ms there); shed late on arrival (the
        // link's, whatever the timings say); a frame shed for want of a
        // worker is no lateness at all.
        s.on_result(&Status::Ok, 1_000, 10_000, 40_000);
        s.on_result(&Status::Ok, 1_000, 5_000, 91_000);
        s.on_result(&Status::Ok, 1_000, 120_000, 130_000);
        s.on_result(&Status::Shed(ShedReason::LateOnArrival), 1_000, 0, 95_000);
        s.on_result(&Status::Shed(ShedReason::NoWorker), 1_000, 0, 2_000);
        assert_eq!(s.results.load(Ordering::Relaxed), 5);
        assert_eq!(s.ok.load(Ordering::Relaxed), 3);
        assert_eq!(s.late.load(Ordering::Relaxed), 3, "what the operator sees");
        assert_eq!(
            s.result_counts(),
            ResultCounts {
                results: 5,
                late: 2
            },
            "what the link fit reads"
        );
    }

    #[test]
    fn an_ok_result_over_the_budget_at_the_servers_but_on_time_is_not_late() {
        // The edge's clock is what counts: timings are the servers' own.
        let s = CameraStats::with_budget(80);
        s.on_result(&Status::Ok, 0, 200_000, 70_000);
        assert_eq!(s.late.load(Ordering::Relaxed), 0);
        assert_eq!(s.result_counts().late, 0);
    }
}
