//! Jittered exponential backoff for reconnecting to the gateway and for
//! restarting a failed camera pipeline. Pure: the caller sleeps.

use std::time::Duration;

/// Delays that double from `base` up to `max`, each drawn uniformly from the
/// upper half of the current step ("equal jitter"), so many edges (or
/// cameras) that failed together do not retry in lockstep.
#[derive(Debug, Clone)]
pub struct Backoff {
    base: Duration,
    max: Duration,
    step: Duration,
    rng: u64,
}

impl Backoff {
    /// A backoff from `base` to `max`; `seed` feeds the jitter (any value,
    /// zero included).
    pub fn new(base: Duration, max: Duration, seed: u64) -> Self {
        let base = base.max(Duration::from_millis(1));
        Backoff {
            base,
            max: max.max(base),
            step: base,
            rng: seed ^ 0x9E37_79B9_7F4A_7C15,
        }
    }

    /// A backoff seeded from the clock and `salt` (a camera or edge name).
    pub fn seeded(base: Duration, max: Duration, salt: &str) -> Self {
        let mut seed = crate::clock::now_us();
        for b in salt.bytes() {
            seed = seed.rotate_left(5) ^ u64::from(b);
        }
        Backoff::new(base, max, seed)
    }

    /// The next delay: in [step/2, step], then the step doubles (up to max).
    pub fn next_delay(&mut self) -> Duration {
        let step = self.step;
        self.step = (self.step * 2).min(self.max);
        let half = step / 2;
        let span = (step - half).as_micros() as u64;
        let jitter = if span == 0 {
            0
        } else {
            self.next_random() % (span + 1)
        };
        half + Duration::from_micros(jitter)
    }

    /// Starts again from `base` (after a success).
    pub fn reset(&mut self) {
        self.step = self.base;
    }

    /// Starts again from `base` only if what it guards (a connection, a
    /// pipeline) has stayed up for `up_for`, at least `max` (the longest
    /// delay); returns whether it did. A peer that fails right after each
    /// success is thus retried ever more slowly, up to `max`, instead of
    /// at `base` for ever.
    pub fn reset_if_stable(&mut self, up_for: Duration) -> bool {
        let stable = up_for >= self.max;
        if stable {
            self.reset();
        }
        stable
    }

    /// How long something must stay up before [`Backoff::reset_if_stable`]
    /// starts again from `base`: the longest delay.
    pub fn stable_after(&self) -> Duration {
        self.max
    }

    /// xorshift64*: plenty for spreading retries.
    fn next_random(&mut self) -> u64 {
        let mut x = self.rng.max(1);
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn delays_double_within_their_jitter_band_up_to_the_max() {
        let mut b = Backoff::new(100 * MS, 1600 * MS, 7);
        let steps = [100, 200, 400, 800, 1600, 1600, 1600];
        for step in steps {
            let d = b.next_delay();
            let step = step * MS;
            assert!(
                d >= step / 2 && d <= step,
                "{d:?} outside [{:?}, {step:?}]",
                step / 2
            );
        }
    }

    #[test]
    fn reset_starts_again_from_base() {
        let mut b = Backoff::new(100 * MS, 10_000 * MS, 1);
        for _ in 0..10 {
            b.next_delay();
        }
        b.reset();
        assert!(b.next_delay() <= 100 * MS);
    }

    #[test]
    fn a_success_shorter_than_the_max_delay_keeps_the_delays_growing() {
        let mut b = Backoff::new(100 * MS, 1600 * MS, 3);
        let mut steps = Vec::new();
        for _ in 0..6 {
            // Each attempt "succeeds" for a moment, then fails again.
            assert!(!b.reset_if_stable(1599 * MS));
            steps.push(b.next_delay());
        }
        for (d, step) in steps.iter().zip([100, 200, 400, 800, 1600, 1600]) {
            let step = step * MS;
            assert!(*d >= step / 2 && *d <= step, "{steps:?}");
        }
        // Up for the longest delay: the next failure starts from base.
        assert!(b.reset_if_stable(1600 * MS));
        assert!(b.next_delay() <= 100 * MS);
        assert_eq!(b.stable_after(), 1600 * MS);
    }

    #[test]
    fn different_seeds_spread_the_retries() {
        let firsts: std::collections::HashSet<Duration> = (0..50)
            .map(|seed| Backoff::new(1000 * MS, 1000 * MS, seed).next_delay())
            .collect();
        assert!(firsts.len() > 40, "only {} distinct delays", firsts.len());
    }

    #[test]
    fn degenerate_bounds_are_clamped() {
        let mut b = Backoff::new(Duration::ZERO, Duration::ZERO, 0);
        let d = b.next_delay();
        assert!(d <= MS, "{d:?}");
    }
}
