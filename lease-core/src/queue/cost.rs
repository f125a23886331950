//! How long a batch takes on one worker type, and what follows from it:
//! the largest batch that runs in a time, the throughput at a batch size,
//! and the cost fitted to a measured latency profile. Pure arithmetic; it
//! knows nothing of queues or deadlines.

use serde::Serialize;

use super::QueueError;

/// How long a batch takes on one worker type: `launch + b × frame`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct BatchCost {
    /// Fixed time per batch, µs.
    pub launch_us: f64,
    /// Time per frame, µs.
    pub frame_us: f64,
    /// Largest batch the worker runs.
    pub max_batch: u32,
}

impl BatchCost {
    /// A checked cost.
    pub fn new(launch_us: f64, frame_us: f64, max_batch: u32) -> Result<BatchCost, QueueError> {
        let ok = launch_us.is_finite()
            && launch_us >= 0.0
            && frame_us.is_finite()
            && frame_us > 0.0
            && max_batch >= 1;
        if !ok {
            return Err(QueueError::BadCost {
                launch_us,
                frame_us,
                max_batch,
            });
        }
        Ok(BatchCost {
            launch_us,
            frame_us,
            max_batch,
        })
    }

    /// Least-squares fit of `launch + b × frame` to measured `(batch,
    /// latency µs)` points (a worker's registered profile) up to its
    /// best-throughput batch, which is `max_batch`: the gateway's scheduler
    /// never sends a larger one. The launch is clamped at 0; a profile whose
    /// best batch is 1 gives single frames at the batch-of-one latency.
    pub fn fit_profile(points: &[(u32, f64)]) -> Result<BatchCost, QueueError> {
        if points
            .iter()
            .any(|(b, l)| *b == 0 || !(l.is_finite() && *l > 0.0))
        {
            return Err(QueueError::BadProfile(
                "has a batch of 0 or a latency that is not a positive number".into(),
            ));
        }
        let best = points
            .iter()
            .max_by(|a, b| {
                (f64::from(a.0) / a.1)
                    .total_cmp(&(f64::from(b.0) / b.1))
                    .then(b.0.cmp(&a.0))
            })
            .copied();
        // Only batches up to the best one are ever run: fit those. A worker
        // whose best batch is 1 (a CPU) runs frames one by one.
        if let (Some((1, l1)), true) = (best, points.len() >= 2) {
            return BatchCost::new(0.0, l1, 1);
        }
        let best_batch = best.map_or(1, |p| p.0);
        let pts: Vec<(f64, f64)> = points
            .iter()
            .filter(|(b, _)| *b <= best_batch)
            .map(|&(b, l)| (f64::from(b), l))
            .collect();
        let n = pts.len() as f64;
        let mx = pts.iter().map(|p| p.0).sum::<f64>() / n;
        let my = pts.iter().map(|p| p.1).sum::<f64>() / n;
        let sxx: f64 = pts.iter().map(|p| (p.0 - mx).powi(2)).sum();
        if pts.len() < 2 || sxx <= 0.0 {
            return Err(QueueError::BadProfile(format!(
                "has {} point(s) at {} batch size(s)",
                pts.len(),
                if sxx > 0.0 { "several" } else { "one" }
            )));
        }
        let sxy: f64 = pts.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
        let frame = sxy / sxx;
        if frame <= 0.0 {
            return Err(QueueError::BadProfile(
                "does not grow with the batch size".into(),
            ));
        }
        let launch = (my - frame * mx).max(0.0);
        BatchCost::new(launch, frame, best_batch)
    }

    /// Run time of a batch of `b`, µs.
    pub fn latency_us(&self, b: u64) -> f64 {
        self.launch_us + b as f64 * self.frame_us
    }

    /// Frames/s of back-to-back batches of `b`.
    pub fn throughput_fps(&self, b: u64) -> f64 {
        b as f64 * 1e6 / self.latency_us(b)
    }

    /// The largest batch (at most `max_batch`) that runs within `us`; 0 if
    /// not even one frame does.
    pub fn fit(&self, us: f64) -> u64 {
        if us < self.latency_us(1) {
            return 0;
        }
        // positive here, so the cast floors
        (((us - self.launch_us) / self.frame_us) as u64).clamp(1, u64::from(self.max_batch))
    }
}
