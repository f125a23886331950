//! Exponential backoff with optional jitter, for every client that tries
//! again: the edge redialling the gateway and restarting a camera
//! pipeline, the worker redialling the gateway, the edge's webhook retries,
//! the lease shell's pauses and release retries, the load generator.
//!
//! Pure: nothing here reads a clock or sleeps (only [`Backoff::seeded`]
//! reads the clock, for a seed). The caller sleeps for the delay it is
//! given, and says how long what the backoff guards stayed up.

use std::time::Duration;

/// How much of each step is random, in thousandths of the step: a delay
/// is drawn uniformly from `[step − step × fraction, step]`.
///
/// [`Jitter::EQUAL`] ("equal jitter", the upper half of the step) keeps
/// many clients that failed together from retrying in lockstep while
/// still waiting at least half the step; [`Jitter::NONE`] gives the step
/// itself, for deterministic pauses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Jitter(u16);

impl Jitter {
    /// No jitter: every delay is the step.
    pub const NONE: Jitter = Jitter(0);
    /// Delays drawn from the upper half of the step.
    pub const EQUAL: Jitter = Jitter(500);
    /// Delays drawn from the whole step, zero included.
    pub const FULL: Jitter = Jitter(1000);

    /// `per_mille` thousandths of the step are random (at most 1000).
    pub fn per_mille(per_mille: u16) -> Jitter {
        Jitter(per_mille.min(1000))
    }

    /// The random share of the step, in thousandths.
    pub fn as_per_mille(self) -> u16 {
        self.0
    }

    /// The band a delay for `step` is drawn from, `(shortest, longest)`;
    /// the longest is `step` itself.
    pub fn band(self, step: Duration) -> (Duration, Duration) {
        let fixed = step.as_nanos() * u128::from(1000 - self.0) / 1000;
        (from_nanos(fixed), step)
    }
}

/// The step before retry `attempt` (0 = the first): `base` doubled
/// `attempt` times, never above `max` (and never overflowing). Pure
/// arithmetic, for callers that count their attempts themselves.
pub fn step(base: Duration, max: Duration, attempt: u32) -> Duration {
    let mut step = base;
    // Once at `max` (or saturated) doubling changes nothing: at most ~100
    // turns even from 1 ns.
    for _ in 0..attempt {
        if step >= max {
            break;
        }
        step = step.saturating_mul(2);
    }
    step.min(max)
}

/// Delays that double from `base` up to `max`, each drawn within its
/// step's [`Jitter`] band (equal jitter unless told otherwise), so many
/// clients that failed together do not retry in lockstep.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backoff {
    base: Duration,
    max: Duration,
    jitter: Jitter,
    step: Duration,
    rng: u64,
}

impl Backoff {
    /// A backoff from `base` to `max` with equal jitter; `seed` feeds the
    /// jitter (any value, zero included). A `base` under 1 ms is raised to
    /// 1 ms (a zero base would retry in a busy loop), and `max` to `base`.
    pub fn new(base: Duration, max: Duration, seed: u64) -> Self {
        let base = base.max(Duration::from_millis(1));
        Backoff {
            base,
            max: max.max(base),
            jitter: Jitter::EQUAL,
            step: base,
            rng: seed ^ 0x9E37_79B9_7F4A_7C15,
        }
    }

    /// A backoff seeded from the clock, this process's id and `salt` (a
    /// camera, edge or worker name), so that processes and cameras that
    /// start together still draw different delays.
    pub fn seeded(base: Duration, max: Duration, salt: &str) -> Self {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let mut seed = u64::try_from(now.as_micros()).unwrap_or(u64::MAX)
            ^ (u64::from(std::process::id()) << 40);
        for b in salt.bytes() {
            seed = seed.rotate_left(5) ^ u64::from(b);
        }
        Backoff::new(base, max, seed)
    }

    /// The same backoff with `jitter` instead of equal jitter.
    pub fn with_jitter(mut self, jitter: Jitter) -> Self {
        self.jitter = jitter;
        self
    }

    /// The first step (after the 1 ms floor).
    pub fn base(&self) -> Duration {
        self.base
    }

    /// The longest step.
    pub fn max(&self) -> Duration {
        self.max
    }

    /// The jitter delays are drawn with.
    pub fn jitter(&self) -> Jitter {
        self.jitter
    }

    /// The step the next delay is drawn from: the longest it can be.
    pub fn next_step(&self) -> Duration {
        self.step
    }

    /// The next delay, within the current step's [`Jitter::band`]; then
    /// the step doubles (up to `max`).
    pub fn next_delay(&mut self) -> Duration {
        let step = self.step;
        self.step = step.saturating_mul(2).min(self.max);
        let (shortest, _) = self.jitter.band(step);
        let span = u64::try_from((step - shortest).as_micros()).unwrap_or(u64::MAX);
        let jitter = if span == 0 {
            0
        } else {
            self.next_random() % span.saturating_add(1)
        };
        shortest + Duration::from_micros(jitter)
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
        self.reset_if_up_for(up_for, self.max)
    }

    /// Starts again from `base` only if what it guards stayed up for
    /// `up_for`, at least `stable`; returns whether it did. As
    /// [`Backoff::reset_if_stable`], with a threshold of the caller's.
    pub fn reset_if_up_for(&mut self, up_for: Duration, stable: Duration) -> bool {
        let stable = up_for >= stable;
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

/// `nanos` as a duration, saturating at [`Duration::MAX`].
fn from_nanos(nanos: u128) -> Duration {
    const PER_SEC: u128 = 1_000_000_000;
    match u64::try_from(nanos / PER_SEC) {
        // below PER_SEC: fits a u32
        Ok(secs) => Duration::new(secs, (nanos % PER_SEC) as u32),
        Err(_) => Duration::MAX,
    }
}

/// How loudly to log one failed attempt of a retry loop ([`Outage`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Loudness {
    /// A WARN line: the first failure of an outage, or the outage has gone
    /// on for another [`Outage`] period. `attempts` failed so far, over
    /// `down_for`.
    Warn {
        /// Failed attempts in this outage, this one included.
        attempts: u32,
        /// Since the first failure of this outage.
        down_for: Duration,
    },
    /// A DEBUG line: one more failure of an outage already reported.
    Debug,
}

/// One outage of a retry loop, so that an ordinary disconnect is one log
/// line, not one per attempt: the first failure is loud, then one failure
/// every `every` while it lasts, and [`Outage::recovered`] says how long it
/// was. Pure: the caller passes the time.
#[derive(Debug, Clone)]
pub struct Outage {
    every: Duration,
    /// First failure of the outage going on, and the last loud one.
    since: Option<(std::time::Instant, std::time::Instant)>,
    attempts: u32,
}

impl Outage {
    /// No outage yet; a reminder every `every` while one lasts.
    pub fn new(every: Duration) -> Outage {
        Outage {
            every,
            since: None,
            attempts: 0,
        }
    }

    /// An attempt failed at `now`: how loudly to say so.
    pub fn failed(&mut self, now: std::time::Instant) -> Loudness {
        self.attempts = self.attempts.saturating_add(1);
        match &mut self.since {
            None => {
                self.since = Some((now, now));
                Loudness::Warn {
                    attempts: 1,
                    down_for: Duration::ZERO,
                }
            }
            Some((first, loud)) if now.saturating_duration_since(*loud) >= self.every => {
                *loud = now;
                Loudness::Warn {
                    attempts: self.attempts,
                    down_for: now.saturating_duration_since(*first),
                }
            }
            Some(_) => Loudness::Debug,
        }
    }

    /// An attempt succeeded at `now`: the outage it ends, as (failed
    /// attempts, time since its first failure), if there was one.
    pub fn recovered(&mut self, now: std::time::Instant) -> Option<(u32, Duration)> {
        let (first, _) = self.since.take()?;
        let attempts = std::mem::take(&mut self.attempts);
        Some((attempts, now.saturating_duration_since(first)))
    }

    /// Whether an outage is going on.
    pub fn is_down(&self) -> bool {
        self.since.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

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
    fn a_threshold_of_the_callers_decides_when_an_uptime_resets() {
        let mut b = Backoff::new(200 * MS, 5000 * MS, 9);
        for _ in 0..4 {
            b.next_delay();
        }
        assert_eq!(b.next_step(), 3200 * MS);
        // Up longer than the longest delay, shorter than the caller's 10 s.
        assert!(!b.reset_if_up_for(9999 * MS, 10_000 * MS));
        assert_eq!(b.next_step(), 3200 * MS);
        assert!(b.reset_if_up_for(10_000 * MS, 10_000 * MS));
        assert_eq!(b.next_step(), 200 * MS);
    }

    #[test]
    fn different_seeds_spread_the_retries() {
        let firsts: std::collections::HashSet<Duration> = (0..50)
            .map(|seed| Backoff::new(1000 * MS, 1000 * MS, seed).next_delay())
            .collect();
        assert!(firsts.len() > 40, "only {} distinct delays", firsts.len());
    }

    #[test]
    fn seeded_backoffs_of_different_names_spread_the_retries() {
        let firsts: std::collections::HashSet<Duration> = (0..50)
            .map(|i| Backoff::seeded(1000 * MS, 1000 * MS, &format!("cam-{i}")).next_delay())
            .collect();
        assert!(firsts.len() > 40, "only {} distinct delays", firsts.len());
    }

    #[test]
    fn degenerate_bounds_are_clamped() {
        let mut b = Backoff::new(Duration::ZERO, Duration::ZERO, 0);
        let d = b.next_delay();
        assert!(d <= MS, "{d:?}");
        assert_eq!((b.base(), b.max()), (MS, MS));
    }

    #[test]
    fn without_jitter_the_delays_are_the_steps_themselves() {
        let mut b = Backoff::new(1000 * MS, 60_000 * MS, 5).with_jitter(Jitter::NONE);
        let delays: Vec<u128> = (0..9).map(|_| b.next_delay().as_millis()).collect();
        assert_eq!(
            delays,
            [
                1000, 2000, 4000, 8000, 16_000, 32_000, 60_000, 60_000, 60_000
            ]
        );
        assert_eq!(b.jitter(), Jitter::NONE);
    }

    #[test]
    fn the_bands_of_each_jitter_end_at_the_step() {
        let s = 200 * MS;
        assert_eq!(Jitter::NONE.band(s), (s, s));
        assert_eq!(Jitter::EQUAL.band(s), (100 * MS, s));
        assert_eq!(Jitter::FULL.band(s), (Duration::ZERO, s));
        assert_eq!(Jitter::per_mille(250).band(s), (150 * MS, s));
        assert_eq!(Jitter::per_mille(5000), Jitter::FULL, "clamped");
        assert_eq!(Jitter::EQUAL.as_per_mille(), 500);
        assert_eq!(
            Jitter::EQUAL.band(Duration::MAX).1,
            Duration::MAX,
            "no overflow"
        );
    }

    #[test]
    fn steps_double_per_attempt_up_to_the_max_and_never_overflow() {
        let (base, max) = (200 * MS, 5000 * MS);
        assert_eq!(step(base, max, 0), 200 * MS);
        assert_eq!(step(base, max, 3), 1600 * MS);
        assert_eq!(step(base, max, 4), 3200 * MS);
        assert_eq!(step(base, max, 5), 5000 * MS);
        assert_eq!(step(base, max, u32::MAX), 5000 * MS);
        assert_eq!(
            step(Duration::from_nanos(1), Duration::MAX, u32::MAX),
            Duration::MAX
        );
        assert_eq!(step(Duration::ZERO, max, 40), Duration::ZERO);
    }

    proptest! {
        /// Over any sequence of failures, resets and uptimes, with any
        /// bounds, jitter and seed: every delay lies within its step's
        /// band, the step follows base·2ⁿ capped at max (as [`step`] says),
        /// and no delay exceeds max.
        #[test]
        fn every_delay_stays_within_its_steps_band_and_under_the_max(
            base_us in 0u64..5_000_000,
            max_us in 0u64..120_000_000,
            per_mille in 0u16..1200,
            seed in any::<u64>(),
            ops in prop::collection::vec((0u8..4, 0u64..200_000_000), 1..200),
        ) {
            let jitter = Jitter::per_mille(per_mille);
            let mut b = Backoff::new(
                Duration::from_micros(base_us),
                Duration::from_micros(max_us),
                seed,
            )
            .with_jitter(jitter);
            let (base, max) = (b.base(), b.max());
            prop_assert!(base >= MS && max >= base);
            let mut failures = 0u32;
            for (op, up_us) in ops {
                let up_for = Duration::from_micros(up_us);
                match op {
                    0 => {
                        b.reset();
                        failures = 0;
                    }
                    1 => {
                        let reset = b.reset_if_stable(up_for);
                        prop_assert_eq!(reset, up_for >= max);
                        if reset {
                            failures = 0;
                        }
                    }
                    _ => {
                        let want = step(base, max, failures);
                        prop_assert_eq!(b.next_step(), want);
                        let d = b.next_delay();
                        let (shortest, longest) = jitter.band(want);
                        // whole microseconds of jitter: never past the step
                        prop_assert!(d >= shortest && d <= longest, "{:?} outside {:?}..={:?}", d, shortest, longest);
                        prop_assert!(d <= max);
                        failures += 1;
                    }
                }
            }
        }

        /// [`step`] never falls as attempts grow, never passes `max`, and
        /// below `max` is exactly base·2ⁿ.
        #[test]
        fn steps_grow_monotonically_to_the_max(
            base_ms in 0u64..10_000,
            max_ms in 0u64..1_000_000,
            attempt in 0u32..80,
        ) {
            let (base, max) = (Duration::from_millis(base_ms), Duration::from_millis(max_ms));
            let s = step(base, max, attempt);
            prop_assert!(s <= max);
            prop_assert!(step(base, max, attempt + 1) >= s);
            if attempt < 40 {
                let exact = base_ms.checked_mul(1u64 << attempt).map(Duration::from_millis);
                prop_assert_eq!(s, exact.map_or(max, |e| e.min(max)));
            }
        }
    }

    /// The first failure is loud, the next ones quiet until the period has
    /// passed, then one loud reminder counting them all; recovery reports
    /// the outage once and starts afresh.
    #[test]
    fn an_outage_is_loud_once_then_once_a_period_and_recovery_reports_it() {
        let t0 = std::time::Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut o = Outage::new(Duration::from_secs(30));
        assert!(!o.is_down());
        assert_eq!(o.recovered(at(0)), None, "nothing to recover from");
        assert_eq!(
            o.failed(at(0)),
            Loudness::Warn {
                attempts: 1,
                down_for: Duration::ZERO
            }
        );
        for ms in (1..30).map(|s| s * 1000) {
            assert_eq!(o.failed(at(ms)), Loudness::Debug, "at {ms} ms");
        }
        assert_eq!(
            o.failed(at(30_000)),
            Loudness::Warn {
                attempts: 31,
                down_for: Duration::from_secs(30)
            }
        );
        assert_eq!(o.failed(at(31_000)), Loudness::Debug);
        assert!(o.is_down());
        assert_eq!(o.recovered(at(40_000)), Some((32, Duration::from_secs(40))));
        assert!(!o.is_down());
        assert_eq!(
            o.failed(at(50_000)),
            Loudness::Warn {
                attempts: 1,
                down_for: Duration::ZERO
            },
            "a new outage is loud again"
        );
    }

    /// Over any run of failures, loud lines are at most one per period
    /// plus the first: what an outage adds to the log is bounded by its
    /// length, not by its attempts.
    #[test]
    fn loud_lines_are_bounded_by_the_outages_length_not_its_attempts() {
        let t0 = std::time::Instant::now();
        let mut o = Outage::new(Duration::from_secs(10));
        let mut loud = 0;
        // 600 s of attempts every 100 ms
        for i in 0..6000u64 {
            if matches!(
                o.failed(t0 + Duration::from_millis(i * 100)),
                Loudness::Warn { .. }
            ) {
                loud += 1;
            }
        }
        assert!((60..=61).contains(&loud), "{loud}");
    }
}
