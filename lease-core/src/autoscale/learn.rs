//! The learned tidal schedule: what each 5-minute slot of the day needed
//! before, as a minimum to pre-warm for. Pure: observations and `now` in,
//! a rate out.
//!
//! * Each slot keeps the lowest rate observed in it, per day, for today and
//!   the seven days before.
//! * The schedule at `t` is the same slot on the same weekday a week
//!   before, when that was seen (so Monday's morning ramp is learned from
//!   last Monday's, not from Sunday's quiet); else the most recent earlier
//!   day that saw the slot (yesterday, on a trace shorter than a week).
//! * A day that contradicts its schedule stops following it: once the
//!   observed rate has stayed under [`CONTRADICTED_BELOW`] of what the
//!   schedule said for now for [`CONTRADICTED_FOR_MS`], the schedule says
//!   nothing more until the day ends. The first Saturday after a working
//!   week, which copies Friday's ramp, holds Friday's fleet for one block
//!   instead of all day. The observed rate still scales the fleet as on any
//!   day; only the pre-warm goes.
//!
//! * Short of that, the schedule is scaled to the load the day shows: by
//!   the highest ratio of the observed rate to the schedule's over the last
//!   [`CALIBRATE_MS`], at most 1. A day at 80 % of yesterday throughout the
//!   last hour pre-warms for 80 % of yesterday's ramp ahead; one tick at or
//!   above the schedule in that hour restores all of it. A decaying burst,
//!   each day below the one before, no longer holds yesterday's fleet
//!   (`burst-72h-v100`, seed 42: 24,440 GPU-hours paid, 24,161 with it,
//!   idle-timeout-spot 24,367; no shipped trace paid more).
//!
//! It must not decide capacity: the autoscaler's targets take the maximum
//! of this, the observed rate and its trend.

use std::collections::{BTreeMap, VecDeque};

use super::DAY_MS;
use crate::billing::Millis;

/// A slot of the learned schedule.
pub(super) const SLOT_MS: Millis = 5 * 60_000;
/// Slots in a day.
pub(super) const SLOTS: usize = (DAY_MS / SLOT_MS) as usize;
/// Days of a week: how far back a slot is looked for.
const WEEK_DAYS: u64 = 7;
/// The observed rate contradicts the schedule under this fraction of it.
pub(super) const CONTRADICTED_BELOW: f64 = 0.7;
/// For this long without a break, the day stops following its schedule.
pub(super) const CONTRADICTED_FOR_MS: Millis = 15 * 60_000;
/// How far back the observed rate is compared with the schedule to scale it.
pub(super) const CALIBRATE_MS: Millis = 60 * 60_000;

/// One model's learned schedule.
#[derive(Debug, Clone, Default)]
pub(super) struct Learner {
    /// Per day (`t / DAY_MS`), each slot's lowest observed rate: today and
    /// up to [`WEEK_DAYS`] days before.
    days: BTreeMap<u64, Vec<Option<f64>>>,
    /// Since when the observed rate has been under [`CONTRADICTED_BELOW`]
    /// of the schedule's, without a break.
    below_since: Option<Millis>,
    /// A day whose load contradicted its schedule: the schedule says
    /// nothing more for it.
    contradicted_day: Option<u64>,
    /// Observed over scheduled, per tick with a schedule, over the last
    /// [`CALIBRATE_MS`].
    ratios: VecDeque<(Millis, f64)>,
    /// The schedule's scale: the highest of `ratios`, at most 1 (1 with
    /// none); kept up to date by `observe`, read for every slot ahead.
    scale: Option<f64>,
}

impl Learner {
    /// A learner that has seen nothing: its schedule is 0 everywhere.
    pub(super) fn new() -> Learner {
        Learner::default()
    }

    /// Records `fps` observed at `now` (ticks in time order).
    pub(super) fn observe(&mut self, now: Millis, fps: f64) {
        let day = now / DAY_MS;
        let expected = self.learned(now);
        if expected > 0.0 && fps < expected * CONTRADICTED_BELOW {
            let since = *self.below_since.get_or_insert(now);
            if now >= since + CONTRADICTED_FOR_MS {
                self.contradicted_day = Some(day);
            }
        } else {
            self.below_since = None;
        }
        if expected > 0.0 {
            self.ratios.push_back((now, fps / expected));
        }
        while self
            .ratios
            .front()
            .is_some_and(|(t, _)| *t + CALIBRATE_MS <= now)
        {
            self.ratios.pop_front();
        }
        self.scale = self
            .ratios
            .iter()
            .map(|(_, r)| *r)
            .reduce(f64::max)
            .map(|m| m.min(1.0));
        let slots = self.days.entry(day).or_insert_with(|| vec![None; SLOTS]);
        let slot = slot_of(now);
        slots[slot] = Some(slots[slot].map_or(fps, |m: f64| m.min(fps)));
        self.days.retain(|&d, _| d + WEEK_DAYS >= day);
    }

    /// The schedule's minimum rate at `t` (now, or ahead of it): 0 on a day
    /// that contradicted it.
    pub(super) fn min_at(&self, t: Millis) -> f64 {
        if self.contradicted_day == Some(t / DAY_MS) {
            return 0.0;
        }
        self.learned(t) * self.scale.unwrap_or(1.0)
    }

    /// What was learned for `t`'s slot: a week before, else the latest
    /// earlier day that saw it, else 0.
    fn learned(&self, t: Millis) -> f64 {
        let day = t / DAY_MS;
        let slot = slot_of(t);
        let seen = |d: u64| self.days.get(&d).and_then(|slots| slots[slot]);
        let week_ago = day.checked_sub(WEEK_DAYS).and_then(seen);
        week_ago
            .or_else(|| {
                (1..WEEK_DAYS)
                    .filter_map(|back| day.checked_sub(back))
                    .find_map(seen)
            })
            .unwrap_or(0.0)
    }
}

fn slot_of(t: Millis) -> usize {
    ((t % DAY_MS) / SLOT_MS) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOUR: Millis = 3_600_000;

    /// Observes one day, every 5 minutes, at `fps(minute of the day)`.
    fn day(l: &mut Learner, d: u64, fps: impl Fn(u64) -> f64) {
        for minute in (0..24 * 60).step_by(5) {
            l.observe(d * DAY_MS + minute * 60_000, fps(minute));
        }
    }

    fn office(weekday: u64) -> impl Fn(u64) -> f64 {
        move |minute| {
            if weekday < 5 && (8 * 60..18 * 60).contains(&minute) {
                200.0
            } else {
                20.0
            }
        }
    }

    #[test]
    fn nothing_seen_is_a_schedule_of_zero() {
        let l = Learner::new();
        assert_eq!(l.min_at(9 * HOUR), 0.0);
    }

    #[test]
    fn a_slot_keeps_the_lowest_rate_seen_in_it_and_tomorrow_follows_it() {
        let mut l = Learner::new();
        l.observe(9 * HOUR, 300.0);
        l.observe(9 * HOUR + 60_000, 250.0);
        l.observe(9 * HOUR + 2 * 60_000, 280.0);
        assert_eq!(l.min_at(DAY_MS + 9 * HOUR + 3 * 60_000), 250.0);
        // another slot, never seen
        assert_eq!(l.min_at(DAY_MS + 10 * HOUR), 0.0);
    }

    #[test]
    fn a_week_of_history_gives_each_weekday_its_own_schedule() {
        let mut l = Learner::new();
        // days 0..=6: Monday to Sunday
        for d in 0..7 {
            day(&mut l, d, office(d));
        }
        // day 7 is a Monday: its 09:00 is last Monday's, not Sunday's
        assert_eq!(l.min_at(7 * DAY_MS + 9 * HOUR), 200.0);
        day(&mut l, 7, office(0));
        // day 8, a Tuesday, then Saturday (day 12) from the Saturday before
        assert_eq!(l.min_at(8 * DAY_MS + 9 * HOUR), 200.0);
        for d in 8..12 {
            day(&mut l, d, office(d % 7));
        }
        assert_eq!(l.min_at(12 * DAY_MS + 9 * HOUR), 20.0);
    }

    #[test]
    fn without_a_week_of_history_a_day_follows_the_latest_day_before_it() {
        let mut l = Learner::new();
        for d in 0..5 {
            day(&mut l, d, office(d));
        }
        // Saturday (day 5) has only Friday to go by
        assert_eq!(l.min_at(5 * DAY_MS + 9 * HOUR), 200.0);
        // a slot Friday missed is taken from Thursday
        let mut gap = Learner::new();
        day(&mut gap, 0, |_| 100.0);
        gap.observe(DAY_MS, 150.0);
        assert_eq!(gap.min_at(2 * DAY_MS + 9 * HOUR), 100.0);
        assert_eq!(gap.min_at(2 * DAY_MS), 150.0);
    }

    #[test]
    fn a_day_that_stays_under_its_schedule_stops_following_it_until_the_day_ends() {
        let mut l = Learner::new();
        for d in 0..5 {
            day(&mut l, d, office(d));
        }
        // Saturday: quiet where Friday ramped at 08:00
        let sat = 5 * DAY_MS;
        let mut t = sat;
        while t < sat + 8 * HOUR + CONTRADICTED_FOR_MS - 60_000 {
            l.observe(t, 20.0);
            t += 60_000;
        }
        // under the schedule for less than the whole window: still followed
        assert_eq!(l.min_at(t), 200.0);
        l.observe(t, 20.0);
        t += 60_000;
        l.observe(t, 20.0);
        assert_eq!(l.min_at(t), 0.0, "contradicted for the window");
        assert_eq!(l.min_at(sat + 17 * HOUR), 0.0, "for the rest of the day");
        while t < sat + DAY_MS - 60_000 {
            t += 60_000;
            l.observe(t, 20.0);
        }
        // Sunday follows Saturday's own (quiet) day, not Friday's
        assert_eq!(l.min_at(6 * DAY_MS + 9 * HOUR), 20.0);
    }

    #[test]
    fn a_break_in_the_shortfall_restarts_the_window() {
        let mut l = Learner::new();
        day(&mut l, 0, |_| 100.0);
        let d1 = DAY_MS;
        let window = CONTRADICTED_FOR_MS / 60_000;
        for m in 0..window {
            l.observe(d1 + m * 60_000, 50.0);
        }
        // back at the schedule for one tick
        l.observe(d1 + window * 60_000, 100.0);
        for m in window + 1..2 * window {
            l.observe(d1 + m * 60_000, 50.0);
        }
        assert_eq!(l.min_at(d1 + 2 * window * 60_000), 100.0);
        // within the tolerance is no shortfall at all
        let mut near = Learner::new();
        day(&mut near, 0, |_| 100.0);
        for m in 0..3 * window {
            near.observe(d1 + m * 60_000, 100.0 * CONTRADICTED_BELOW + 1.0);
        }
        // (followed, scaled to the load it sees: below)
        assert_eq!(
            near.min_at(d1 + 3 * window * 60_000),
            100.0 * CONTRADICTED_BELOW + 1.0
        );
    }

    #[test]
    fn a_day_under_its_schedule_pre_warms_for_the_share_it_sees_and_never_more_than_learned() {
        let mut l = Learner::new();
        day(&mut l, 0, |_| 100.0);
        let d1 = DAY_MS;
        // an hour at 80 % of yesterday: 80 % of yesterday's schedule ahead
        let hour = CALIBRATE_MS / 60_000;
        for m in 0..hour {
            l.observe(d1 + m * 60_000, 80.0);
        }
        let now = d1 + (hour - 1) * 60_000;
        assert!((l.min_at(now + 30 * 60_000) - 80.0).abs() < 1e-9);
        // one tick at the schedule within the hour: all of it again
        l.observe(now + 60_000, 100.0);
        assert_eq!(l.min_at(now + 30 * 60_000), 100.0);
        // ticks above the schedule never raise it
        for m in 0..hour {
            l.observe(now + (2 + m) * 60_000, 300.0);
        }
        assert_eq!(l.min_at(now + (2 + hour) * 60_000), 100.0);
        // and a shortfall older than the hour is forgotten: 90 % for an
        // hour after 75 % for one
        let mut f = Learner::new();
        day(&mut f, 0, |_| 100.0);
        for m in 0..hour {
            f.observe(d1 + m * 60_000, 75.0);
        }
        for m in hour..2 * hour {
            f.observe(d1 + m * 60_000, 90.0);
        }
        assert!((f.min_at(d1 + 2 * hour * 60_000) - 90.0).abs() < 1e-9);
    }
}
