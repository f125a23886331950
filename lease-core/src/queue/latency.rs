//! Latencies of served frames, counted in fixed buckets: quantiles within
//! a bucket's width, merged across ticks and models in constant memory. It
//! only counts; which frames are within the SLO is the queue's to say.

/// Latencies of served frames, in buckets of [`LatencyHistogram::BUCKET_US`].
#[derive(Debug, Clone, PartialEq)]
pub struct LatencyHistogram {
    counts: Vec<u64>,
    total: u64,
    min_us: f64,
    max_us: f64,
}

impl LatencyHistogram {
    /// Bucket width, µs.
    pub const BUCKET_US: f64 = 50.0;
    /// Buckets: latencies up to 400 ms are resolved, longer ones count in
    /// the last.
    const BUCKETS: usize = 8_000;

    /// Empty.
    pub fn new() -> LatencyHistogram {
        LatencyHistogram {
            counts: vec![0; Self::BUCKETS],
            total: 0,
            min_us: f64::INFINITY,
            max_us: 0.0,
        }
    }

    /// Adds `count` frames of latency `us`.
    pub fn add(&mut self, us: f64, count: u64) {
        if count == 0 {
            return;
        }
        let i = ((us.max(0.0) * (1.0 / Self::BUCKET_US)) as usize).min(Self::BUCKETS - 1);
        self.counts[i] += count;
        self.total += count;
        self.min_us = self.min_us.min(us);
        self.max_us = self.max_us.max(us);
    }

    /// Adds another histogram's frames.
    pub fn merge(&mut self, other: &LatencyHistogram) {
        if other.total == 0 {
            return;
        }
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.total += other.total;
        self.min_us = self.min_us.min(other.min_us);
        self.max_us = self.max_us.max(other.max_us);
    }

    /// Frames counted.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// The `q` quantile (nearest rank, as the gateway's load report), ms:
    /// the upper edge of its bucket, within the observed range. None when
    /// empty.
    pub fn quantile_ms(&self, q: f64) -> Option<f64> {
        if self.total == 0 {
            return None;
        }
        let rank = ((self.total as f64 * q.clamp(0.0, 1.0)).ceil() as u64).clamp(1, self.total);
        let mut seen = 0;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                let edge = (i + 1) as f64 * Self::BUCKET_US;
                return Some(edge.clamp(self.min_us, self.max_us) / 1000.0);
            }
        }
        Some(self.max_us / 1000.0)
    }

    /// Smallest latency counted, ms.
    pub fn min_ms(&self) -> Option<f64> {
        (self.total > 0).then(|| self.min_us / 1000.0)
    }

    /// Largest latency counted, ms.
    pub fn max_ms(&self) -> Option<f64> {
        (self.total > 0).then(|| self.max_us / 1000.0)
    }

    /// Empties it.
    pub(super) fn clear(&mut self) {
        if self.total > 0 {
            self.counts.iter_mut().for_each(|c| *c = 0);
        }
        self.total = 0;
        self.min_us = f64::INFINITY;
        self.max_us = 0.0;
    }
}

impl Default for LatencyHistogram {
    fn default() -> Self {
        LatencyHistogram::new()
    }
}
