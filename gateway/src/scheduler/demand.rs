//! How busy a model is: its arrival rate, measured as it comes (so that a
//! burst is seen at its rate from its first frames), the cameras sending
//! it and its frames running now. The batch size worth waiting for
//! (`dispatch.rs`) is chosen from it.

use std::collections::HashMap;

use super::{EdgeId, Micros};

/// Time constant of the arrival-rate estimate (µs).
const RATE_TAU_US: f64 = 500_000.0;
/// Shortest span over which a rate is believed: a first frame alone is not
/// a burst (µs).
const RATE_MIN_SPAN_US: Micros = 100_000;
/// A camera counts as sending if it sent a frame within this window (µs).
const ACTIVE_WINDOW_US: Micros = 2_000_000;

/// Demand on one model: an exponentially decaying arrival count (its rate)
/// and the cameras that sent recently.
#[derive(Debug, Default)]
pub(super) struct Demand {
    /// Decayed arrival count; in steady state `count = rate × RATE_TAU_US`.
    count: f64,
    /// First and last arrival.
    first: Option<Micros>,
    last: Micros,
    /// Last arrival per camera.
    pub(super) cameras: HashMap<(EdgeId, String), Micros>,
    /// When `cameras` was last pruned.
    pruned: Micros,
    /// Frames of this model running on workers now.
    pub(super) in_flight: usize,
}

impl Demand {
    pub(super) fn arrive(&mut self, now: Micros, edge: EdgeId, camera: &str) {
        self.count = self.decayed(now) + 1.0;
        self.first.get_or_insert(now);
        self.last = self.last.max(now);
        match self.cameras.get_mut(&(edge, camera.to_string())) {
            Some(t) => *t = now,
            None => {
                self.cameras.insert((edge, camera.to_string()), now);
            }
        }
        if now.saturating_sub(self.pruned) >= ACTIVE_WINDOW_US {
            self.cameras
                .retain(|_, t| now.saturating_sub(*t) < ACTIVE_WINDOW_US);
            self.pruned = now;
        }
    }

    fn decayed(&self, now: Micros) -> f64 {
        let dt = now.saturating_sub(self.last) as f64;
        self.count * (-dt / RATE_TAU_US).exp()
    }

    /// Arrivals per µs. Early on the decayed count has not filled up yet;
    /// dividing by the weight the observed span can hold corrects that bias,
    /// so a burst is seen at its true rate from its first frames.
    pub(super) fn rate(&self, now: Micros) -> f64 {
        let Some(first) = self.first else {
            return 0.0;
        };
        let span = now.saturating_sub(first).max(RATE_MIN_SPAN_US) as f64;
        let weight = RATE_TAU_US * (1.0 - (-span / RATE_TAU_US).exp());
        self.decayed(now) / weight.max(1.0)
    }
}
