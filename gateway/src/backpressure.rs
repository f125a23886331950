//! Back-pressure to the cameras: a pure, clock-injected policy.
//!
//! Shedding protects the deadline of the frames the gateway keeps, but every
//! shed frame was still captured, encoded and sent for nothing. When a
//! camera's frames are being shed, it is cheaper for everyone if the camera
//! sends fewer. This policy watches, per camera, how many frames arrive and
//! how many end `ok` or lost to overload (`shed` for being superseded, for
//! a deadline no worker can make or for full queues, and `expired`) over
//! fixed windows, and answers with [`RateCap`]s that the hub sends to the edge
//! as `ControlHint` messages:
//!
//! - **decrease** (multiplicative): when more than `shed_ratio` of a
//!   window's frames were lost, cap the camera at a little under the rate
//!   the gateway actually served it (`decrease` × ok rate), never below
//!   `min_fps`, and never below `max_cut` × the rate it sent (or its cap):
//!   one bad window at most halves a camera's rate. A second of starved
//!   workers (sixteen camera pipelines starting at once beside them) once
//!   served a camera a tenth of its frames and capped it at 1.8 fps, and
//!   the stepwise relax took the next 30 s to bring it back; a lasting
//!   shortage still halves it window after window, down to what is served;
//! - **relax** (stepwise): after `relax_after` windows in a row with no
//!   loss, raise the cap by `increase`; once the cap is back above the rate
//!   the camera sent before it was first capped, lift it altogether
//!   (`max_fps = 0`).
//!
//! `no_worker` sheds do not count: lowering a camera's rate does not bring
//! a worker. Failed frames do not count either: they are not overload. Nor
//! do `late_on_arrival` sheds: their budget went on the edge's send path
//! and the link before they reached the gateway, so the workers are not
//! the cause, and capping the camera for worker capacity would starve a
//! camera whose link is slow. A slow link is the edge's to adapt to (it
//! sees those results and its own path statistics); the gateway counts
//! them apart (`tidegate_frames_total{status="shed"}` with
//! `tidegate_shed_total{reason="late_on_arrival"}`).

use std::collections::HashMap;

use tidegate_protocol::{ShedReason, Status};

use crate::scheduler::{EdgeId, Micros};

/// Tuning of the policy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BackpressureConfig {
    /// Length of a measurement window (µs).
    pub window_us: Micros,
    /// Fraction of a window's frames lost that triggers a decrease.
    pub shed_ratio: f64,
    /// Cap = this × the rate served ok (0..1).
    pub decrease: f64,
    /// ... but never below this × the rate sent, or the cap in force if
    /// lower (0..1): the most one window cuts.
    pub max_cut: f64,
    /// Clean windows in a row before the cap is raised.
    pub relax_after: u32,
    /// Cap × this on each relax step (> 1).
    pub increase: f64,
    /// Lowest cap ever asked for (frames per second).
    pub min_fps: f64,
    /// Fewest arrivals in a window for it to count (avoids judging on noise).
    pub min_frames: u32,
}

impl Default for BackpressureConfig {
    fn default() -> Self {
        BackpressureConfig {
            window_us: 1_000_000,
            shed_ratio: 0.1,
            decrease: 0.9,
            max_cut: 0.5,
            relax_after: 3,
            increase: 1.25,
            min_fps: 1.0,
            min_frames: 3,
        }
    }
}

/// A new cap on one camera of one edge (the policy's change; the hub
/// sends it as a `ControlHint`).
#[derive(Debug, Clone, PartialEq)]
pub struct RateCap {
    /// The edge.
    pub edge: EdgeId,
    /// The camera.
    pub camera: String,
    /// Highest rate to send; 0 lifts the cap.
    pub max_fps: f32,
}

/// What the policy knows about one camera, for the API.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct CameraLoad {
    /// Arrival rate over the last complete window (frames per second).
    pub arrival_fps: f64,
    /// Rate served ok over the last complete window.
    pub ok_fps: f64,
    /// Fraction of the last window's frames lost to overload.
    pub lost_ratio: f64,
    /// The cap in force; `None` when uncapped.
    pub cap_fps: Option<f64>,
    /// Hints sent to this camera so far.
    pub hints: u64,
}

#[derive(Debug, Default)]
struct Camera {
    window_start: Micros,
    arrivals: u32,
    ok: u32,
    lost: u32,
    /// Rate the camera sent at before it was first capped.
    uncapped_fps: f64,
    clean_windows: u32,
    load: CameraLoad,
}

/// The policy. Feed it arrivals and outcomes; call [`Backpressure::tick`]
/// regularly (at least once per window) and send what it returns.
#[derive(Debug)]
pub struct Backpressure {
    cfg: BackpressureConfig,
    cameras: HashMap<(EdgeId, String), Camera>,
}

impl Backpressure {
    /// A policy with `cfg`.
    pub fn new(cfg: BackpressureConfig) -> Self {
        Backpressure {
            cfg,
            cameras: HashMap::new(),
        }
    }

    fn camera(&mut self, now: Micros, edge: EdgeId, camera: &str) -> &mut Camera {
        self.cameras
            .entry((edge, camera.to_string()))
            .or_insert_with(|| Camera {
                window_start: now,
                ..Camera::default()
            })
    }

    /// A frame of `camera` arrived.
    pub fn on_arrival(&mut self, now: Micros, edge: EdgeId, camera: &str) {
        self.camera(now, edge, camera).arrivals += 1;
    }

    /// A frame of `camera` finished with `status`, lost to the workers'
    /// capacity when it was shed or expired for anything but `no_worker`,
    /// `late_on_arrival` or `edge_gone`. A camera never seen (or forgotten with its
    /// edge) is ignored: outcomes of an edge that has gone must not bring
    /// its cameras back.
    pub fn on_outcome(&mut self, edge: EdgeId, camera: &str, status: &Status) {
        let capacity = matches!(status, Status::Expired)
            || matches!(
                status,
                Status::Shed(s) if !matches!(
                    s,
                    ShedReason::NoWorker | ShedReason::LateOnArrival | ShedReason::EdgeGone
                )
            );
        self.on_outcome_as(edge, camera, status, capacity);
    }

    /// [`Backpressure::on_outcome`] with the scheduler's word on whether
    /// the frame was lost to capacity (`scheduler::Action::Complete`): a
    /// frame that could not have been served in time even alone is not.
    pub fn on_outcome_as(&mut self, edge: EdgeId, camera: &str, status: &Status, capacity: bool) {
        let Some(c) = self.cameras.get_mut(&(edge, camera.to_string())) else {
            return;
        };
        if *status == Status::Ok {
            c.ok += 1;
        } else if capacity {
            c.lost += 1;
        }
    }

    /// The edge disconnected: forget its cameras (a reconnect starts fresh,
    /// and the edge forgets its hints when it reconnects too).
    pub fn forget_edge(&mut self, edge: EdgeId) {
        self.cameras.retain(|(e, _), _| *e != edge);
    }

    /// Current view of a camera, if it has sent anything.
    pub fn load(&self, edge: EdgeId, camera: &str) -> Option<CameraLoad> {
        self.cameras
            .get(&(edge, camera.to_string()))
            .map(|c| c.load)
    }

    /// Closes every window that has ended by `now` and returns the hints to
    /// send.
    pub fn tick(&mut self, now: Micros) -> Vec<RateCap> {
        let cfg = self.cfg;
        let mut hints = Vec::new();
        for ((edge, camera), c) in &mut self.cameras {
            let elapsed = now.saturating_sub(c.window_start);
            if elapsed < cfg.window_us {
                continue;
            }
            let secs = elapsed as f64 / 1e6;
            let arrival_fps = c.arrivals as f64 / secs;
            let ok_fps = c.ok as f64 / secs;
            let judged = c.ok + c.lost;
            let lost_ratio = if judged == 0 {
                0.0
            } else {
                c.lost as f64 / judged as f64
            };
            c.load.arrival_fps = arrival_fps;
            c.load.ok_fps = ok_fps;
            c.load.lost_ratio = lost_ratio;
            let old = c.load.cap_fps;
            if c.arrivals >= cfg.min_frames && lost_ratio > cfg.shed_ratio {
                if old.is_none() {
                    c.uncapped_fps = arrival_fps;
                }
                let sent = arrival_fps.min(old.unwrap_or(f64::INFINITY));
                let served = ok_fps.min(sent);
                let cap = (served * cfg.decrease).max(sent * cfg.max_cut);
                c.load.cap_fps = Some(cap.max(cfg.min_fps));
                c.clean_windows = 0;
            } else if c.lost == 0 {
                if let Some(cap) = old {
                    c.clean_windows += 1;
                    if c.clean_windows >= cfg.relax_after {
                        c.clean_windows = 0;
                        let raised = cap * cfg.increase;
                        c.load.cap_fps = (raised < c.uncapped_fps).then_some(raised);
                    }
                }
            } else {
                c.clean_windows = 0;
            }
            if c.load.cap_fps != old {
                c.load.hints += 1;
                hints.push(RateCap {
                    edge: *edge,
                    camera: camera.clone(),
                    max_fps: c.load.cap_fps.unwrap_or(0.0) as f32,
                });
            }
            c.window_start = now;
            c.arrivals = 0;
            c.ok = 0;
            c.lost = 0;
        }
        hints.sort_by(|a, b| (a.edge, &a.camera).cmp(&(b.edge, &b.camera)));
        hints
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const E: EdgeId = EdgeId(1);

    /// One window of `arrivals` frames of which `ok` end ok and the rest are
    /// superseded; returns the hints at the window's end.
    fn window(p: &mut Backpressure, start: Micros, arrivals: u32, ok: u32) -> Vec<RateCap> {
        for i in 0..arrivals {
            let t = start + i as u64 * (1_000_000 / arrivals.max(1) as u64);
            p.on_arrival(t, E, "cam");
            let st = if i < ok {
                Status::Ok
            } else {
                Status::Shed(ShedReason::Superseded)
            };
            p.on_outcome(E, "cam", &st);
        }
        p.tick(start + 1_000_000)
    }

    #[test]
    fn shedding_camera_is_capped_near_what_it_is_served() {
        let mut p = Backpressure::new(BackpressureConfig::default());
        p.on_arrival(0, E, "cam");
        p.on_outcome(E, "cam", &Status::Ok);
        assert!(p.tick(0).is_empty());
        // 30 fps sent, 20 served: cap at 0.9 × 20 = 18 fps.
        let h = window(&mut p, 0, 29, 19);
        assert_eq!(h.len(), 1);
        assert!((h[0].max_fps - 18.0).abs() < 0.01, "{h:?}");
        assert_eq!(p.load(E, "cam").and_then(|l| l.cap_fps), Some(18.0));
    }

    #[test]
    fn cap_relaxes_stepwise_then_lifts() {
        let cfg = BackpressureConfig::default();
        let mut p = Backpressure::new(cfg);
        p.on_arrival(0, E, "cam");
        p.on_outcome(E, "cam", &Status::Ok);
        let h = window(&mut p, 0, 29, 19);
        let mut cap = h[0].max_fps as f64;
        let mut t = 1_000_000;
        let mut lifted = false;
        // Slack returns: every frame ok. Each `relax_after` clean windows the
        // cap rises by `increase`, until it passes the original 30 fps.
        for _ in 0..40 {
            let hints = window(&mut p, t, cap.ceil() as u32, cap.ceil() as u32);
            t += 1_000_000;
            if let Some(h) = hints.first() {
                if h.max_fps == 0.0 {
                    lifted = true;
                    break;
                }
                assert!((h.max_fps as f64 - cap * cfg.increase).abs() < 0.01);
                cap = h.max_fps as f64;
            }
        }
        assert!(lifted, "cap never lifted; stuck at {cap}");
        assert_eq!(p.load(E, "cam").and_then(|l| l.cap_fps), None);
    }

    #[test]
    fn no_worker_late_arrivals_and_failures_do_not_throttle() {
        let mut p = Backpressure::new(BackpressureConfig::default());
        for i in 0..30u64 {
            p.on_arrival(i * 50_000, E, "cam");
            let st = match i % 3 {
                0 => Status::Shed(ShedReason::NoWorker),
                1 => Status::Shed(ShedReason::LateOnArrival),
                _ => Status::Failed("boom".into()),
            };
            p.on_outcome(E, "cam", &st);
        }
        assert!(p.tick(1_000_000).is_empty());
    }

    /// One bad window at most halves the camera's rate; a shortage that
    /// lasts halves it again each window, down to what is served.
    #[test]
    fn a_window_at_most_halves_the_rate_and_a_lasting_shortage_goes_on() {
        let mut p = Backpressure::new(BackpressureConfig::default());
        p.on_arrival(0, E, "cam");
        // 30 fps sent (the first arrival above and 29), 3 served: 15, not
        // 2.7.
        let h = window(&mut p, 0, 29, 3);
        assert_eq!(h[0].max_fps, 15.0);
        // Still 3 served of the 15 it now sends: 7.5, then 3.75, then
        // 0.9 × 3 = 2.7 (within half of 3.75).
        let mut caps = vec![];
        for (i, sent) in [15u32, 8, 4].into_iter().enumerate() {
            let h = window(&mut p, (i as u64 + 1) * 1_000_000, sent, 3);
            caps.push(h[0].max_fps);
        }
        assert_eq!(caps, vec![7.5, 3.75, 2.7]);
    }

    #[test]
    fn never_below_the_floor_and_forgets_gone_edges() {
        let mut p = Backpressure::new(BackpressureConfig::default());
        p.on_arrival(0, E, "cam");
        // Everything lost, at 4 fps then at the 2 fps cap: the cap goes to
        // the floor, not to zero (which would mean "no cap").
        let h = window(&mut p, 0, 3, 0);
        assert_eq!(h[0].max_fps, 2.0);
        let h = window(&mut p, 1_000_000, 3, 0);
        assert_eq!(h[0].max_fps, 1.0);
        p.forget_edge(E);
        assert!(p.load(E, "cam").is_none());
        // Results of frames the gone edge sent still arrive; they must not
        // bring its camera back (nothing would ever forget it again).
        p.on_outcome(E, "cam", &Status::Ok);
        p.on_outcome(E, "other", &Status::Expired);
        assert!(p.load(E, "cam").is_none() && p.load(E, "other").is_none());
        assert!(p.tick(2_000_000).is_empty());
    }
}
