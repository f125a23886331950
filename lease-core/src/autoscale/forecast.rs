//! The renewal forecast (`paid-block-aware`): at a paid block's end, the
//! demand that the block a renewal would buy has to serve. Pure: the rate
//! history, the tidal schedule and `now` in, a rate out.
//!
//! Over `[now, now + horizon]`, sampled per schedule slot, the forecast is
//! the larger of two estimates:
//! * the recent trend: the highest rate over the last `lookback` (a tick's
//!   dip is not read as the load leaving), or the rate now plus the fitted
//!   rising trend (at most [`MAX_TREND_GROWTH`] of it, as the up-target
//!   extrapolates), whichever is higher;
//! * the tidal schedule (configured and learned) at each point, scaled by
//!   how today compares with it now: a day running at 60 % of its schedule
//!   is forecast at 60 % of the schedule ahead (never above the schedule
//!   itself, which is already a minimum).
//!
//! It must not pick leases or add headroom: the scale-down
//! (`scale.rs`, `release_at_block_ends`) releases the leases that the
//! forecast, with headroom, does not need.

use std::collections::VecDeque;

use super::learn::SLOT_MS;
use super::scale::{MAX_TREND_GROWTH, trend};
use crate::billing::Millis;

/// What the renewal forecast looks at.
#[derive(Debug, Clone, Copy)]
pub(super) struct Horizon {
    /// How far back the recent level is the highest rate.
    pub(super) lookback_ms: Millis,
    /// How far ahead the forecast looks: the block a renewal buys, and at
    /// least a start-up (a lease needed sooner than a replacement could
    /// start is not worth releasing).
    pub(super) ahead_ms: Millis,
}

/// The rate (frames/s, before headroom) that a block bought at `now` has
/// to serve: the highest forecast over the horizon. `rate` is the rate
/// observed now; `history` the recent (time, rate) points, in time order;
/// `schedule(t)` the tidal minimum at `t`.
pub(super) fn renewal_demand(
    history: &VecDeque<(Millis, f64)>,
    now: Millis,
    rate: f64,
    horizon: Horizon,
    schedule: impl Fn(Millis) -> f64,
) -> f64 {
    let level = history
        .iter()
        .filter(|(t, _)| *t <= now && *t + horizon.lookback_ms >= now)
        .map(|(_, r)| *r)
        .fold(rate.max(0.0), f64::max);
    let rising = trend(history, now).max(0.0);
    let sched_now = schedule(now);
    // today against its schedule, never above it
    let ratio = if sched_now > 0.0 {
        (level / sched_now).clamp(0.0, 1.0)
    } else {
        1.0
    };
    let at = |ahead: Millis| {
        let rate = rate.max(0.0);
        let trended = level.max(rate + (rising * ahead as f64).min(rate * MAX_TREND_GROWTH));
        trended.max(schedule(now + ahead) * ratio)
    };
    let mut demand = at(0);
    let mut ahead = SLOT_MS;
    while ahead < horizon.ahead_ms {
        demand = demand.max(at(ahead));
        ahead += SLOT_MS;
    }
    demand.max(at(horizon.ahead_ms))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: Millis = 60_000;
    const HOUR: Millis = 60 * MIN;

    fn flat(from: Millis, to: Millis, fps: f64) -> VecDeque<(Millis, f64)> {
        (from / MIN..=to / MIN).map(|m| (m * MIN, fps)).collect()
    }

    fn block(lookback_ms: Millis) -> Horizon {
        Horizon {
            lookback_ms,
            ahead_ms: HOUR,
        }
    }

    #[test]
    fn a_level_load_with_no_schedule_is_forecast_at_its_level() {
        let h = flat(0, 30 * MIN, 100.0);
        let d = renewal_demand(&h, 30 * MIN, 100.0, block(3 * MIN), |_| 0.0);
        assert!((d - 100.0).abs() < 1e-9, "{d}");
    }

    #[test]
    fn a_block_ending_as_the_flip_turns_low_is_forecast_at_the_low_level() {
        // high for 20 minutes, low for the last 5
        let mut h = flat(0, 20 * MIN, 220.0);
        h.extend(flat(21 * MIN, 25 * MIN, 70.0));
        let d = renewal_demand(&h, 25 * MIN, 70.0, block(3 * MIN), |_| 0.0);
        assert!((d - 70.0).abs() < 1e-9, "{d}");
        // the ten-minute look-back it replaces would still see the high
        let ten = renewal_demand(&h, 25 * MIN, 70.0, block(10 * MIN), |_| 0.0);
        assert!((ten - 220.0).abs() < 1e-9, "{ten}");
    }

    #[test]
    fn a_block_ending_before_the_learned_morning_rise_is_forecast_at_the_rise() {
        let h = flat(7 * HOUR, 7 * HOUR + 30 * MIN, 20.0);
        let sched = |t: Millis| if t >= 8 * HOUR { 200.0 } else { 20.0 };
        let now = 7 * HOUR + 30 * MIN;
        let d = renewal_demand(&h, now, 20.0, block(3 * MIN), sched);
        assert!((d - 200.0).abs() < 1e-9, "{d}");
        // a rise beyond the horizon is not this block's business
        let short = Horizon {
            lookback_ms: 3 * MIN,
            ahead_ms: 20 * MIN,
        };
        let d = renewal_demand(&h, now, 20.0, short, sched);
        assert!((d - 20.0).abs() < 1e-9, "{d}");
    }

    #[test]
    fn a_day_running_under_its_schedule_scales_the_schedule_ahead_down() {
        // the schedule says 100 now and 200 in half an hour; today is at 60
        let h = flat(0, 30 * MIN, 60.0);
        let sched = |t: Millis| if t >= HOUR { 200.0 } else { 100.0 };
        let d = renewal_demand(&h, 30 * MIN, 60.0, block(3 * MIN), sched);
        assert!((d - 120.0).abs() < 1e-9, "{d}");
        // a day above its schedule is not scaled above it
        let h = flat(0, 30 * MIN, 150.0);
        let d = renewal_demand(&h, 30 * MIN, 150.0, block(3 * MIN), sched);
        assert!((d - 200.0).abs() < 1e-9, "{d}");
    }

    #[test]
    fn a_rising_trend_adds_at_most_its_cap_over_the_block() {
        let h: VecDeque<(Millis, f64)> = (0..=10).map(|m| (m * MIN, 100.0 + m as f64)).collect();
        let d = renewal_demand(&h, 10 * MIN, 110.0, block(3 * MIN), |_| 0.0);
        assert!((d - 110.0 * (1.0 + MAX_TREND_GROWTH)).abs() < 1e-6, "{d}");
        // a falling trend never forecasts under the recent level
        let h: VecDeque<(Millis, f64)> = (0..=10).map(|m| (m * MIN, 200.0 - m as f64)).collect();
        let d = renewal_demand(&h, 10 * MIN, 190.0, block(3 * MIN), |_| 0.0);
        assert!((d - 193.0).abs() < 1e-9, "{d}");
    }

    #[test]
    fn a_point_later_than_now_is_not_part_of_the_level() {
        // the wall clock stepped back: a point from "the future" is ignored
        let mut h = flat(0, 10 * MIN, 50.0);
        h.push_back((20 * MIN, 500.0));
        let d = renewal_demand(&h, 10 * MIN, 50.0, block(3 * MIN), |_| 0.0);
        assert!((d - 50.0).abs() < 1e-9, "{d}");
    }
}
