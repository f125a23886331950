//! Whose fault a missed deadline is: the link's or the workers'.
//!
//! A frame's budget is spent in two places before a worker runs it: on the
//! edge's send path and the link (its age on arrival, [`Arrival::age`]),
//! and in the gateway's queue. When a frame cannot make its deadline, the
//! scheduler asks whether it would have made it had it arrived as young as
//! its camera's frames usually do: the least age of the camera's frames
//! over the last [`FLOOR_WINDOW`] (a windowed minimum, as a congestion
//! controller keeps the least round trip: the link's floor, without the
//! queues that build on it).
//!
//! - **yes**: the link is to blame. The frame is shed `late_on_arrival`,
//!   which the edge's uplink fit reads as a late result (lower the quality,
//!   then the rate), and it is not lost to capacity, so the gateway's
//!   back-pressure does not cap the camera for the workers' sake. A link
//!   that fills up must not throttle cameras for worker capacity.
//! - **no**: the queue ahead, or the workers' speed, is to blame even for a
//!   frame that came at the link's usual pace. It is shed
//!   `would_miss_deadline` and lost to capacity: the back-pressure caps the
//!   camera. Busy workers must not pass as a slow link.
//!
//! [`Arrival::age`]: super::Arrival::age

use super::Micros;

/// How far back a camera's least age on arrival reaches: frames that
/// arrived within this window, and no older ones, set its floor. Long
/// enough to span a congestion controller's drain of its queue (BBR probes
/// its least round trip every 10 s), short enough that a link that got
/// slower for good (a new route) is taken as it is within it.
pub const FLOOR_WINDOW: Micros = 10_000_000;

/// A camera's least age on arrival over the last [`FLOOR_WINDOW`]: two
/// buckets of half the window each, the current one and the one before.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct AgeFloor {
    /// When the current bucket began.
    start: Micros,
    /// Least age in the current bucket.
    current: Micros,
    /// Least age in the bucket before it, if it directly precedes it.
    previous: Option<Micros>,
}

impl AgeFloor {
    /// A floor from its first frame, `age` old on arrival at `now`.
    pub(super) fn new(now: Micros, age: Micros) -> Self {
        AgeFloor {
            start: now,
            current: age,
            previous: None,
        }
    }

    /// A frame arrived at `now`, `age` old.
    pub(super) fn observe(&mut self, now: Micros, age: Micros) {
        let half = FLOOR_WINDOW / 2;
        let elapsed = now.saturating_sub(self.start);
        if elapsed >= 2 * half {
            // Nothing arrived for a whole window: start again.
            *self = AgeFloor::new(now, age);
        } else if elapsed >= half {
            self.previous = Some(self.current);
            self.start = now;
            self.current = age;
        } else {
            self.current = self.current.min(age);
        }
    }

    /// The floor: the least age of the frames seen within the last
    /// [`FLOOR_WINDOW`] or so (up to a bucket more).
    pub(super) fn floor(&self) -> Micros {
        self.previous.map_or(self.current, |p| p.min(self.current))
    }

    /// How much older than the floor a frame `age` old arrived: the part
    /// of its age the link's queues (or the edge's send path) added.
    pub(super) fn excess(&self, age: Micros) -> Micros {
        age.saturating_sub(self.floor())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MS: Micros = 1_000;

    #[test]
    fn the_floor_is_the_least_age_and_an_older_frame_is_in_excess_of_it() {
        let mut f = AgeFloor::new(0, 30 * MS);
        f.observe(100 * MS, 12 * MS);
        f.observe(200 * MS, 55 * MS);
        assert_eq!(f.floor(), 12 * MS);
        assert_eq!(f.excess(55 * MS), 43 * MS);
        assert_eq!(f.excess(5 * MS), 0, "younger than the floor: no excess");
    }

    #[test]
    fn a_floor_older_than_the_window_is_forgotten() {
        let mut f = AgeFloor::new(0, 10 * MS);
        // Every frame since is 50 ms old: the link got slower for good.
        let mut t = 0;
        while t < FLOOR_WINDOW + FLOOR_WINDOW / 2 {
            t += 100 * MS;
            f.observe(t, 50 * MS);
        }
        assert_eq!(f.floor(), 50 * MS);
    }

    #[test]
    fn a_floor_within_the_window_is_kept_across_the_bucket_turn() {
        let mut f = AgeFloor::new(0, 10 * MS);
        f.observe(FLOOR_WINDOW / 2 + 1, 50 * MS);
        assert_eq!(f.floor(), 10 * MS, "seen half a window ago");
        f.observe(FLOOR_WINDOW / 2 + 2, 40 * MS);
        assert_eq!(f.floor(), 10 * MS);
    }

    #[test]
    fn a_camera_silent_for_a_window_starts_afresh() {
        let mut f = AgeFloor::new(0, 10 * MS);
        f.observe(FLOOR_WINDOW, 70 * MS);
        assert_eq!(f.floor(), 70 * MS);
    }

    proptest! {
        /// The floor is always the age of a frame seen within the last
        /// window and a half, and no frame seen within the last half
        /// window is younger than it.
        #[test]
        fn the_floor_is_a_recent_age_and_none_recent_is_below_it(
            steps in proptest::collection::vec((0u64..3_000_000, 0u64..200_000), 1..200),
        ) {
            let (mut t, first) = (0u64, steps[0].1);
            let mut f = AgeFloor::new(0, first);
            let mut seen = vec![(0u64, first)];
            for (dt, age) in steps.into_iter().skip(1) {
                t += dt;
                f.observe(t, age);
                seen.push((t, age));
            }
            let floor = f.floor();
            let horizon = t.saturating_sub(FLOOR_WINDOW + FLOOR_WINDOW / 2);
            prop_assert!(seen.iter().any(|&(at, a)| at >= horizon && a == floor));
            let recent = t.saturating_sub(FLOOR_WINDOW / 2);
            prop_assert!(seen.iter().filter(|&&(at, _)| at > recent).all(|&(_, a)| a >= floor));
        }
    }
}
