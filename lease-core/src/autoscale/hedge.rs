//! The spot hedge (`paid-block-aware`): an on-demand reserve sized to the
//! spot interruption rate the autoscaler has measured. Pure: preemption
//! notices and per-tick spot exposure in, a count of workers out.
//!
//! * The measured rate is the notices over the spot lease-hours served in
//!   the last `window`, with the catalog's rate as a prior worth
//!   [`PRIOR_LEASE_HOURS`] (a fleet that has seen nothing yet is not taken
//!   to be safe, and one notice in the first minutes is not a storm).
//! * The reserve is the workers that rate is expected to take out of the
//!   spot fleet over one start-up (the time a replacement needs to serve),
//!   times `margin`, rounded to the nearest worker:
//!   `round(rate × spot × start-up × margin)`. A calm pool, expected to
//!   lose under half a worker over a start-up, holds none (a whole
//!   on-demand worker for a fraction of one lost is a poor trade; the
//!   preemption replacement covers it).
//!
//! It must not acquire or pick a tier: the scaling (`scale.rs`) keeps that
//! many workers of on-demand capacity above the target.
//!
//! The same measured rate decides whether an on-demand lease is handed
//! back to spot at its block end ([`spot_overhead`]): each interruption
//! costs GPU-hours that serve nothing (the rest of the reclaimed lease's
//! block, the on-demand replacement's start-up, and the start-up of the
//! spot lease that later takes over from it), and on a pool reclaimed
//! often enough those outweigh what the hand-over is for.

use std::collections::VecDeque;

use crate::billing::{Granularity, Millis};

/// The weight of the catalog's interruption rate, in spot lease-hours.
pub(super) const PRIOR_LEASE_HOURS: f64 = 20.0;

const HOUR_MS: f64 = 3_600_000.0;

/// One model's spot exposure and preemption notices over the window.
#[derive(Debug, Clone, Default)]
pub(super) struct SpotExposure {
    /// When each notice came.
    notices: VecDeque<Millis>,
    /// Per tick: (its time, spot lease-ms served since the tick before).
    served: VecDeque<(Millis, f64)>,
    /// The tick before, with the spot leases serving then.
    last: Option<(Millis, u32)>,
}

impl SpotExposure {
    /// Records a tick at `now` with `spot` spot leases serving, and forgets
    /// what is older than `window_ms`.
    pub(super) fn tick(&mut self, now: Millis, spot: u32, window_ms: Millis) {
        if let Some((t, n)) = self.last
            && now > t
        {
            self.served
                .push_back((now, f64::from(n) * (now - t) as f64));
        }
        self.last = Some((now, spot));
        // the window is (now - window, now]
        let Some(from) = now.checked_sub(window_ms) else {
            return;
        };
        while self.served.front().is_some_and(|(t, _)| *t <= from) {
            self.served.pop_front();
        }
        while self.notices.front().is_some_and(|t| *t <= from) {
            self.notices.pop_front();
        }
    }

    /// Records a preemption notice at `now`.
    pub(super) fn notice(&mut self, now: Millis) {
        self.notices.push_back(now);
    }

    /// Interruptions per spot lease-hour: the measured rate, with
    /// `prior_per_hour` (the catalog's) worth [`PRIOR_LEASE_HOURS`].
    pub(super) fn rate_per_hour(&self, prior_per_hour: f64) -> f64 {
        let hours = self.served.iter().map(|(_, ms)| ms).sum::<f64>() / HOUR_MS;
        (self.notices.len() as f64 + prior_per_hour.max(0.0) * PRIOR_LEASE_HOURS)
            / (hours + PRIOR_LEASE_HOURS)
    }
}

/// The on-demand workers to hold above the target: the spot workers the
/// measured `rate_per_hour` takes out over `startup_ms`, times `margin`,
/// rounded to the nearest (none with no spot or a margin of 0).
pub(super) fn reserve_workers(
    rate_per_hour: f64,
    spot_workers: u32,
    startup_ms: Millis,
    margin: f64,
) -> u32 {
    let lost = rate_per_hour.max(0.0) * f64::from(spot_workers) * startup_ms as f64 / HOUR_MS;
    let reserve = (lost * margin.max(0.0)).round();
    if reserve.is_finite() && reserve > 0.0 {
        reserve.min(f64::from(spot_workers)) as u32
    } else {
        0
    }
}

/// The GPU-hours a spot lease is expected to pay without serving, per
/// hour it serves, at `rate_per_hour` interruptions: each interruption
/// pays the rest of the reclaimed lease's billing block (half of it on
/// average; nothing more than its minimum with per-second billing), the start-up of its
/// on-demand replacement, and the start-up of the spot lease that takes
/// over from that replacement at its block end (`startup_ms` each).
pub(super) fn spot_overhead(
    rate_per_hour: f64,
    startup_ms: Millis,
    granularity: Granularity,
) -> f64 {
    let block_left = match granularity {
        Granularity::Hour => 0.5,
        Granularity::Second { .. } => 0.0,
    };
    rate_per_hour.max(0.0) * (block_left + 2.0 * startup_ms as f64 / HOUR_MS)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: Millis = 60_000;
    const HOUR: Millis = 60 * MIN;

    /// `spot` leases served every minute for `hours`, from `from`.
    fn serve(e: &mut SpotExposure, from: Millis, hours: u64, spot: u32, window: Millis) {
        for m in 0..=hours * 60 {
            e.tick(from + m * MIN, spot, window);
        }
    }

    #[test]
    fn with_nothing_measured_the_rate_is_the_catalogs() {
        let e = SpotExposure::default();
        assert!((e.rate_per_hour(0.04) - 0.04).abs() < 1e-12);
    }

    #[test]
    fn the_measured_rate_outweighs_the_prior_as_exposure_grows() {
        let mut e = SpotExposure::default();
        // 100 spot leases for 10 hours: 1,000 lease-hours, 400 notices
        for k in 0..400 {
            e.notice(k * 90_000);
        }
        serve(&mut e, 0, 10, 100, 24 * HOUR);
        let r = e.rate_per_hour(0.04);
        let expected = (400.0 + 0.04 * PRIOR_LEASE_HOURS) / (1000.0 + PRIOR_LEASE_HOURS);
        assert!((r - expected).abs() < 1e-9, "{r}");
        assert!(r > 0.35, "close to the measured 0.4: {r}");
    }

    #[test]
    fn notices_and_exposure_older_than_the_window_are_forgotten() {
        let mut e = SpotExposure::default();
        for k in 0..50 {
            e.notice(k * MIN);
        }
        serve(&mut e, 0, 3, 10, HOUR);
        // two quiet hours later, the storm of the first hour is gone
        let r = e.rate_per_hour(0.04);
        let hours = 10.0;
        assert!(
            (r - 0.04 * PRIOR_LEASE_HOURS / (hours + PRIOR_LEASE_HOURS)).abs() < 1e-9,
            "{r}"
        );
    }

    #[test]
    fn the_reserve_is_the_workers_the_rate_takes_out_over_a_start_up_times_the_margin() {
        // calm: 0.04 per hour, 100 spot workers, 150 s start-ups, margin 2:
        // a third of a worker expected, so none held
        assert_eq!(reserve_workers(0.04, 100, 150_000, 2.0), 0);
        // ten times the rate, 420 s start-ups: 0.4 × 200 × 420/3600 × 2 = 18.7
        assert_eq!(reserve_workers(0.4, 200, 420_000, 2.0), 19);
        // exact products stay themselves
        assert_eq!(reserve_workers(1.0, 10, HOUR, 1.0), 10);
    }

    #[test]
    fn no_spot_or_no_margin_needs_no_reserve_and_it_never_exceeds_the_spot_fleet() {
        assert_eq!(reserve_workers(0.4, 0, 420_000, 2.0), 0);
        assert_eq!(reserve_workers(0.4, 200, 420_000, 0.0), 0);
        assert_eq!(reserve_workers(f64::NAN, 200, 420_000, 2.0), 0);
        assert_eq!(reserve_workers(10.0, 5, HOUR, 3.0), 5);
    }

    #[test]
    fn spot_overhead_is_the_block_left_and_two_start_ups_per_interruption() {
        // 0.4 an hour, hourly blocks, 420 s start-ups: 0.4 × (0.5 + 2 × 420 / 3600)
        let hourly = spot_overhead(0.4, 420_000, Granularity::Hour);
        assert!(
            (hourly - 0.4 * (0.5 + 840.0 / 3600.0)).abs() < 1e-12,
            "{hourly}"
        );
        // per-second billing loses no rest of a block
        let per_second = spot_overhead(0.4, 420_000, Granularity::Second { minimum_secs: 60 });
        assert!(
            (per_second - 0.4 * 840.0 / 3600.0).abs() < 1e-12,
            "{per_second}"
        );
        assert_eq!(spot_overhead(0.0, 420_000, Granularity::Hour), 0.0);
        assert_eq!(
            spot_overhead(-1.0, 420_000, Granularity::Hour),
            0.0,
            "no negative rate"
        );
    }
}
