//! What a batch costs on a worker: per model, the expected run time of each
//! batch size, from the profile the worker registered and refined by every
//! batch it returns.
//!
//! Each finished batch refines its worker's profile, but one slow batch
//! counts at most [`OBSERVE_CAP`] times the estimate (a GPU's first run of
//! a new input shape can take a thousand times the usual), and while a
//! worker runs nothing its estimate relaxes back towards the profile it
//! registered (half the excess every [`RELAX_HALF_LIFE_US`]): an estimate
//! that outgrew every deadline would otherwise shed the model's frames for
//! ever, since only a dispatched batch can correct it.

use super::{Micros, WorkerModel};

/// Throughput headroom the target batch must give over the arrival rate.
const BATCH_HEADROOM: f64 = 1.2;

/// An observed batch time counts at most this many times the current
/// estimate, so that one outlier (a GPU's first run of an input shape:
/// cuDNN's algorithm search, allocations) cannot make every batch size look
/// hopeless at once; a worker that really slowed down is learned within a
/// few batches.
const OBSERVE_CAP: f64 = 3.0;

/// While a worker runs nothing, the excess of its estimate over the
/// profile it registered halves every this many µs. A model whose frames
/// all looked too slow to dispatch gets a batch again once the estimate has
/// relaxed enough, and that batch's time corrects the estimate.
const RELAX_HALF_LIFE_US: f64 = 2_000_000.0;

#[derive(Debug, Clone)]
pub(super) struct ModelProfile {
    max_batch: u16,
    /// Latency (µs) per batch size 1..=max_batch, smoothed by EWMA.
    latency: Vec<f64>,
    /// `latency` as registered, before any observation.
    registered: Vec<f64>,
    /// When the estimate was last put to the test: the worker registered,
    /// returned a batch of this model, or was sent a trial (`trial.rs`).
    pub(super) tested_at: Micros,
}

impl ModelProfile {
    /// The profile `m` registered at `now`.
    pub(super) fn new(m: &WorkerModel, default_latency_us: u32, now: Micros) -> Self {
        let max_batch = m.max_batch.max(1);
        let mut points: Vec<(u16, u32)> = m.profile.clone();
        points.sort_unstable();
        let latency: Vec<f64> = (1..=max_batch)
            .map(|b| interpolate(&points, b, default_latency_us))
            .collect();
        ModelProfile {
            max_batch,
            registered: latency.clone(),
            latency,
            tested_at: now,
        }
    }

    /// Expected run time of a batch. A larger batch never runs faster than
    /// a smaller one: observations only refine the sizes actually run, so
    /// the estimate is the largest over sizes up to `batch`.
    pub(super) fn latency(&self, batch: usize) -> u64 {
        let i = batch.clamp(1, self.latency.len());
        self.latency[..i]
            .iter()
            .fold(0.0f64, |m, l| m.max(*l))
            .ceil() as u64
    }

    /// Best throughput over batch sizes, in frames per µs.
    pub(super) fn peak_throughput(&self) -> f64 {
        self.throughput(self.best_batch())
    }

    /// Throughput of a batch of `b`, frames per µs.
    fn throughput(&self, b: usize) -> f64 {
        b as f64 / self.latency(b).max(1) as f64
    }

    /// The batch with the highest throughput (the smallest of equals). On a
    /// GPU that is usually the largest; on a CPU, where a batch costs about
    /// as much per frame as single runs or more, it can be 1.
    pub(super) fn best_batch(&self) -> usize {
        let mut best = 1;
        for b in 2..=self.max_batch as usize {
            if self.throughput(b) > self.throughput(best) * 1.02 {
                best = b;
            }
        }
        best
    }

    /// The smallest batch whose throughput covers `demand` frames per µs
    /// with headroom; the best-throughput batch when none does.
    pub(super) fn batch_for(&self, demand: f64) -> usize {
        let best = self.best_batch();
        (1..=best)
            .find(|&b| self.throughput(b) >= demand * BATCH_HEADROOM)
            .unwrap_or(best)
    }

    /// Refines the profile with one measured run. The whole curve moves by
    /// the same factor: a worker that slows down (a shared or throttled
    /// device) slows down at every batch size, and a size that is rarely run
    /// must not keep its warm-up value while the others drift, or the
    /// batcher would believe the unobserved sizes are cheap.
    pub(super) fn observe(&mut self, batch: usize, latency_us: u32) {
        const ALPHA: f64 = 0.2;
        let i = batch.clamp(1, self.latency.len()) - 1;
        let old = self.latency[i].max(1.0);
        let sample = (latency_us.max(1) as f64).min(old * OBSERVE_CAP);
        let new = (1.0 - ALPHA) * old + ALPHA * sample;
        let factor = new / old;
        for l in &mut self.latency {
            *l = (*l * factor).max(1.0);
        }
    }
}

impl ModelProfile {
    /// Moves each batch size's estimate back towards its registered value
    /// after `idle_us` with nothing running: the excess halves every
    /// [`RELAX_HALF_LIFE_US`]. An estimate below the registered one (a
    /// worker faster than it said) stays.
    pub(super) fn relax(&mut self, idle_us: Micros) {
        // Observations scale the whole curve alike, so the first size tells
        // whether any is above its registered value.
        if self.latency[0] <= self.registered[0] {
            return;
        }
        let keep = 0.5f64.powf(idle_us as f64 / RELAX_HALF_LIFE_US);
        // Within a microsecond of it, the whole curve is back (all at once,
        // or the check above would stop the larger sizes short of it).
        if (self.latency[0] - self.registered[0]) * keep < 1.0 {
            self.latency.clone_from(&self.registered);
            return;
        }
        for (l, r) in self.latency.iter_mut().zip(&self.registered) {
            if *l > *r {
                *l = r + (*l - r) * keep;
            }
        }
    }
}

/// What a worker's profile `points` (batch size, µs; sorted by batch size)
/// say a batch of `batch` frames takes, in µs: piecewise linear, and
/// linear per frame beyond the last point. `points` must not be empty.
pub fn profile_latency_us(points: &[(u16, u32)], batch: u16) -> f64 {
    interpolate(points, batch, 0)
}

/// Piecewise-linear latency at `batch` from sorted profile points; beyond the
/// last point it grows linearly per frame; with no points, the default.
fn interpolate(points: &[(u16, u32)], batch: u16, default_latency_us: u32) -> f64 {
    match points {
        [] => default_latency_us as f64 * batch as f64,
        [(b, l)] => *l as f64 * (batch as f64 / (*b).max(1) as f64).max(1.0),
        _ => {
            if let Some(&(_, l)) = points.iter().find(|(b, _)| *b == batch) {
                return l as f64;
            }
            let (lo, hi) = match points.iter().position(|(b, _)| *b > batch) {
                Some(0) => (points[0], points[1]),
                Some(i) => (points[i - 1], points[i]),
                None => (points[points.len() - 2], points[points.len() - 1]),
            };
            let slope = (hi.1 as f64 - lo.1 as f64) / (hi.0 as f64 - lo.0 as f64).max(1.0);
            (lo.1 as f64 + slope * (batch as f64 - lo.0 as f64)).max(1.0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_observation_moves_the_estimate_a_bounded_step() {
        let mut p = ModelProfile::new(
            &WorkerModel {
                model: "m".into(),
                max_batch: 4,
                profile: vec![(1, 1_000), (4, 2_000)],
            },
            1_000,
            0,
        );
        p.observe(4, u32::MAX);
        // 0.8 × 2 ms + 0.2 × 3 × 2 ms: the curve grows by 1.4 at most.
        assert_eq!(p.latency(4), 2_800);
        assert_eq!(p.latency(1), 1_400);
        // Relaxing never goes below what was registered, and a worker
        // faster than registered keeps its estimate.
        p.relax(u64::MAX);
        assert_eq!((p.latency(1), p.latency(4)), (1_000, 2_000));
        for _ in 0..20 {
            p.observe(4, 1_000);
        }
        let fast = p.latency(4);
        assert!(fast < 2_000);
        p.relax(10_000_000);
        assert_eq!(p.latency(4), fast);
    }

    #[test]
    fn a_profile_measured_faster_at_a_larger_batch_relaxes_to_its_envelope() {
        // Measured on a busy host: batch 2 took longer than batch 4.
        let mut p = ModelProfile::new(
            &WorkerModel {
                model: "m".into(),
                max_batch: 4,
                profile: vec![(1, 5_000), (2, 13_000), (3, 11_000), (4, 11_000)],
            },
            1_000,
            0,
        );
        let envelope = [5_000, 13_000, 13_000, 13_000];
        let read = |p: &ModelProfile| [1, 2, 3, 4].map(|b| p.latency(b));
        assert_eq!(read(&p), envelope);
        p.observe(4, u32::MAX);
        assert!(read(&p).iter().zip(envelope).all(|(e, r)| *e > r));
        p.relax(u64::MAX);
        assert_eq!(read(&p), envelope);
    }

    #[test]
    fn observed_latency_never_makes_a_bigger_batch_look_faster() {
        let mut p = ModelProfile::new(
            &WorkerModel {
                model: "m".into(),
                max_batch: 8,
                profile: vec![(1, 50), (8, 100)],
            },
            1_000,
            0,
        );
        // Only single frames ever run, and they take 500 µs on the wire.
        for _ in 0..30 {
            p.observe(1, 500);
        }
        assert!(p.latency(1) > 400);
        // A batch of 8 was never observed; it cannot be assumed faster than
        // one frame, or frames held for it would miss their deadline.
        assert!(p.latency(8) >= p.latency(1));
        assert!((1..8).all(|b| p.latency(b) <= p.latency(b + 1)));
    }

    #[test]
    fn interpolation_extends_profile_linearly() {
        let pts = [(1, 1_000), (4, 2_500)];
        assert_eq!(interpolate(&pts, 1, 0), 1_000.0);
        assert_eq!(interpolate(&pts, 2, 0), 1_500.0);
        assert_eq!(interpolate(&pts, 8, 0), 4_500.0);
        assert_eq!(interpolate(&[], 3, 100), 300.0);
    }
}
