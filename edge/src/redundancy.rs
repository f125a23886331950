//! How many copies of each frame a camera sends when its `copies` is
//! `auto`: one while a lost packet can still be resent within the budget,
//! more when the path loses packets at random and its round trip leaves no
//! time for a retransmission.
//!
//! A pure policy. Once a [`WINDOW`](crate::adapt::WINDOW) the camera's
//! [`Outbound`](crate::outbound::Outbound) feeds [`Redundancy::on_window`]
//! the same [`WindowStats`] as [`LinkFit`](crate::adapt::LinkFit), with the
//! verdict it gave, and gets the copies to send each frame with until the
//! next window (1 up to the copies the camera was opened with; the gateway
//! admits one copy of a frame and sends each result back as many times as
//! the camera was opened with).
//!
//! The rules:
//!
//! 1. **Loss is random loss.** The path's packet loss is estimated over
//!    decaying sums ([`DECAY`] a window) of packets sent and lost, from
//!    windows whose path showed no queue only: a window whose frames
//!    waited behind other bytes (its verdict `queued`, or another camera's
//!    report of a queue) or whose smoothed round trip had swollen more than
//!    [`RTT_CLEAN`] × budget above the least one is a full link, whose
//!    losses copies would make worse.
//! 2. **A retransmission that fits needs no copy.** When twice the path's
//!    least round trip plus [`RECOVERY_SLACK`] fits in the budget, a lost
//!    packet is detected and resent in time: one copy.
//! 3. **Otherwise, as few copies as reach the target.** A frame of `n`
//!    packets (its bytes over [`PACKET_PAYLOAD`], rounded up) sent as `k`
//!    copies misses when every copy loses a packet: `(1 − (1 − p)^n)^k`.
//!    The policy wants the fewest copies for which that is at most
//!    [`TARGET_MISS`], or all it may send. It decides only on
//!    [`MIN_PACKETS`] packets of evidence.
//! 4. **Up at once, down slowly.** More copies are taken in the window that
//!    wants them; fewer only after [`DOWN_WINDOWS`] windows in a row in
//!    which one copy less would miss at most half the target.
//! 5. **A full link sheds copies.** [`QUEUED_TO_DROP`] queued windows in a
//!    row take one copy off: the link is short of bytes, and each copy
//!    adds a frame's worth. [`LinkFit`](crate::adapt::LinkFit) lowers the
//!    quality and the rate for the same windows.

use std::time::Duration;

use crate::adapt::{RTT_CLEAN, Verdict, WindowStats};

/// What a window's sums keep of the last: a loss seen 5 windows ago
/// weighs a third of one seen now.
pub const DECAY: f64 = 0.8;
/// Packets of evidence (decayed) the estimate needs before the policy
/// acts on it: at 2 % loss, 400 packets put the estimate within ±0.7 %.
pub const MIN_PACKETS: f64 = 400.0;
/// Time besides two round trips that a frame with one lost packet needs
/// within its budget: the loss's detection past the round trip (QUIC waits
/// 9/8 of it, or three later packets), the worker's run and the result's
/// way back.
pub const RECOVERY_SLACK: Duration = Duration::from_millis(15);
/// QUIC payload of a frame stream's packet on a path with the smallest
/// MTU QUIC allows (1,200 bytes, less headers); larger paths only make the
/// estimate cautious.
pub const PACKET_PAYLOAD: u64 = 1_150;
/// Share of the frames the policy accepts to lose to random loss.
pub const TARGET_MISS: f64 = 0.01;
/// Windows in a row that must find one copy fewer enough before a copy
/// is taken off.
pub const DOWN_WINDOWS: u32 = 5;
/// Queued windows in a row that take a copy off.
pub const QUEUED_TO_DROP: u32 = 2;

/// The policy of one camera. See the module docs.
#[derive(Debug, Clone)]
pub struct Redundancy {
    /// The most copies: those the camera was opened with.
    max: u8,
    copies: u8,
    budget: Duration,
    /// Decayed packets sent and lost, in windows without a queue.
    sent: f64,
    lost: f64,
    fewer_streak: u32,
    queued_streak: u32,
}

/// What one window told the policy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CopiesDecision {
    /// Copies of each frame from now on.
    pub copies: u8,
    /// The copies rule 3 wants (before the slow way down); `None` without
    /// enough evidence, a connection, or in a queued window.
    pub wanted: Option<u8>,
    /// The estimated random loss, once there is enough evidence.
    pub loss: Option<f64>,
}

impl Redundancy {
    /// A camera opened with `max` copies (1 to the protocol's
    /// `MAX_COPIES`) and a budget of `budget`; it starts at one copy.
    pub fn new(max: u8, budget: Duration) -> Self {
        Redundancy {
            max: max.max(1),
            copies: 1,
            budget,
            sent: 0.0,
            lost: 0.0,
            fewer_streak: 0,
            queued_streak: 0,
        }
    }

    /// Copies of each frame in force.
    pub fn copies(&self) -> u8 {
        self.copies
    }

    /// The estimated random loss, once [`MIN_PACKETS`] packets were seen.
    pub fn loss(&self) -> Option<f64> {
        (self.sent >= MIN_PACKETS).then(|| self.lost / self.sent)
    }

    /// Copies a frame of `packets` packets needs on a path that loses `p`
    /// of them at random, to miss at most [`TARGET_MISS`]; at most `max`.
    pub fn needed(p: f64, packets: u64, max: u8) -> u8 {
        let one = one_copy_miss(p, packets);
        (1..=max)
            .find(|&k| one.powi(i32::from(k)) <= TARGET_MISS)
            .unwrap_or(max)
    }

    /// The window `w`, whose verdict (by [`LinkFit::verdict`]) was
    /// `verdict`, has closed: the copies for the next.
    ///
    /// [`LinkFit::verdict`]: crate::adapt::LinkFit::verdict
    pub fn on_window(&mut self, w: &WindowStats, verdict: Verdict) -> CopiesDecision {
        let Some(path) = w.path else {
            return self.decision(None);
        };
        if self.full(w, verdict) {
            self.queued_streak += 1;
            self.fewer_streak = 0;
            if self.queued_streak >= QUEUED_TO_DROP && self.copies > 1 {
                self.copies -= 1;
                self.queued_streak = 0;
            }
            return self.decision(None);
        }
        self.queued_streak = 0;
        self.sent = self.sent * DECAY + path.sent_packets as f64;
        self.lost = self.lost * DECAY + path.lost_packets as f64;
        let Some(p) = self.loss() else {
            return self.decision(None);
        };
        let fits = 2 * path.min_rtt + RECOVERY_SLACK <= self.budget;
        let wanted = match packets(w) {
            _ if fits => 1,
            Some(n) => Self::needed(p, n, self.max),
            // Nothing handed in the window: no frame size to judge by.
            None => self.copies,
        };
        if wanted > self.copies {
            self.copies = wanted;
            self.fewer_streak = 0;
        } else if wanted < self.copies && self.fewer_would_do(p, w, fits) {
            self.fewer_streak += 1;
            if self.fewer_streak >= DOWN_WINDOWS {
                self.copies -= 1;
                self.fewer_streak = 0;
            }
        } else {
            self.fewer_streak = 0;
        }
        self.decision(Some(wanted))
    }

    /// The window's path was full: its frames queued, another camera's
    /// did, or the round trip had swollen.
    fn full(&self, w: &WindowStats, verdict: Verdict) -> bool {
        let queued = matches!(verdict, Verdict::Pressed(p) if p.queueing());
        let swollen = w
            .path
            .is_some_and(|p| p.rtt > p.min_rtt + self.budget.mul_f64(RTT_CLEAN));
        queued || swollen
    }

    /// One copy fewer than now would miss at most half the target.
    fn fewer_would_do(&self, p: f64, w: &WindowStats, fits: bool) -> bool {
        if fits {
            return true;
        }
        let Some(n) = packets(w) else {
            return false;
        };
        let one = one_copy_miss(p, n);
        one.powi(i32::from(self.copies - 1)) <= TARGET_MISS / 2.0
    }

    fn decision(&self, wanted: Option<u8>) -> CopiesDecision {
        CopiesDecision {
            copies: self.copies,
            wanted,
            loss: self.loss(),
        }
    }
}

/// Packets of the window's mean frame; `None` when none was handed.
fn packets(w: &WindowStats) -> Option<u64> {
    w.bytes_per_frame()
        .map(|bytes| bytes.div_ceil(PACKET_PAYLOAD).max(1))
}

/// The chance that one copy of a frame of `packets` packets loses one of
/// them, on a path that loses `p` of its packets at random.
fn one_copy_miss(p: f64, packets: u64) -> f64 {
    let kept = (1.0 - p.clamp(0.0, 1.0)).powi(i32::try_from(packets).unwrap_or(i32::MAX));
    1.0 - kept
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adapt::{PathWindow, Pressure};
    use proptest::prelude::*;

    const BUDGET: Duration = Duration::from_millis(80);

    /// A window of a light load (4 cameras × 10 fps of 9.3 KB frames, 8
    /// packets each, and their acknowledgements) on a path of `rtt_ms`
    /// losing `lost` of every 1,000 packets.
    fn window(rtt_ms: u64, lost_per_mille: u64) -> WindowStats {
        WindowStats {
            handed: 10,
            delivered: 10,
            bytes: 93_470,
            results: 10,
            path: Some(PathWindow {
                rtt: Duration::from_millis(rtt_ms),
                min_rtt: Duration::from_millis(rtt_ms),
                sent_packets: 1_000,
                lost_packets: lost_per_mille,
                ..PathWindow::default()
            }),
            ..WindowStats::default()
        }
    }

    fn feed(r: &mut Redundancy, w: &WindowStats, times: usize) -> u8 {
        for _ in 0..times {
            r.on_window(w, Verdict::Fair);
        }
        r.copies()
    }

    #[test]
    fn a_lossy_round_trip_too_long_to_resend_in_takes_a_second_copy() {
        let mut r = Redundancy::new(2, BUDGET);
        // 50 ms RTT: two round trips alone are 100 ms of an 80 ms budget.
        let d = r.on_window(&window(50, 20), Verdict::Fair);
        assert_eq!(d.copies, 2);
        assert_eq!(d.wanted, Some(2));
        assert!((d.loss.unwrap() - 0.02).abs() < 1e-9);
    }

    #[test]
    fn a_round_trip_that_leaves_time_to_resend_keeps_one_copy_whatever_the_loss() {
        let mut r = Redundancy::new(3, BUDGET);
        assert_eq!(feed(&mut r, &window(20, 50), 10), 1);
    }

    #[test]
    fn a_clean_long_path_keeps_one_copy() {
        let mut r = Redundancy::new(2, BUDGET);
        // 0.1 % loss: 8 packets miss 0.8 % of frames, within the target.
        assert_eq!(feed(&mut r, &window(50, 1), 10), 1);
    }

    #[test]
    fn the_fewest_copies_that_reach_the_target_are_taken() {
        // 8 packets at 2 %: one copy misses 14.9 %, two 2.2 %, three 0.33 %.
        assert_eq!(Redundancy::needed(0.02, 8, 3), 3);
        assert_eq!(Redundancy::needed(0.02, 8, 2), 2);
        // 5 packets (quality 75): two copies miss 0.92 %.
        assert_eq!(Redundancy::needed(0.02, 5, 3), 2);
        assert_eq!(Redundancy::needed(0.0, 40, 3), 1);
        assert_eq!(Redundancy::needed(1.0, 1, 3), 3);
    }

    #[test]
    fn too_little_evidence_changes_nothing() {
        let mut r = Redundancy::new(2, BUDGET);
        let mut w = window(50, 0);
        let path = w.path.as_mut().unwrap();
        path.sent_packets = 100;
        path.lost_packets = 10;
        let d = r.on_window(&w, Verdict::Fair);
        assert_eq!((d.copies, d.wanted, d.loss), (1, None, None));
        // The decayed sums reach the evidence needed in the eighth window:
        // 100 × (1 + 0.8 + … + 0.8⁶) = 395 < 400, then 416.
        assert_eq!(feed(&mut r, &w, 6), 1);
        assert_eq!(feed(&mut r, &w, 1), 2);
    }

    #[test]
    fn copies_come_off_only_after_enough_windows_that_need_fewer() {
        let mut r = Redundancy::new(2, BUDGET);
        assert_eq!(feed(&mut r, &window(50, 20), 1), 2);
        // The loss stops: the decayed estimate falls over a few windows,
        // then DOWN_WINDOWS windows in a row must agree.
        let mut windows = 0;
        while r.copies() == 2 {
            r.on_window(&window(50, 0), Verdict::Fair);
            windows += 1;
            assert!(windows < 50, "never came down");
        }
        assert!(
            windows >= DOWN_WINDOWS as usize,
            "came down after {windows}"
        );
    }

    #[test]
    fn a_window_that_needs_the_copies_starts_the_way_down_again() {
        let mut r = Redundancy::new(2, BUDGET);
        feed(&mut r, &window(50, 20), 1);
        // At 20 ms a retransmission fits: one copy would do, but only
        // DOWN_WINDOWS windows in a row take the copy off.
        let short = window(20, 20);
        assert_eq!(feed(&mut r, &short, DOWN_WINDOWS as usize - 1), 2);
        assert_eq!(feed(&mut r, &window(50, 20), 1), 2);
        assert_eq!(feed(&mut r, &short, DOWN_WINDOWS as usize - 1), 2);
        assert_eq!(feed(&mut r, &short, 1), 1);
    }

    #[test]
    fn a_queued_link_adds_no_copy_and_sheds_one() {
        let mut r = Redundancy::new(2, BUDGET);
        let queued = Verdict::Pressed(Pressure {
            queued: true,
            ..Pressure::default()
        });
        // Losses from a full queue are not counted.
        let d = r.on_window(&window(50, 50), queued);
        assert_eq!((d.copies, d.wanted), (1, None));
        assert_eq!(r.loss(), None);
        feed(&mut r, &window(50, 20), 1);
        assert_eq!(r.copies(), 2);
        r.on_window(&window(50, 20), queued);
        assert_eq!(r.copies(), 2, "one queued window is not a full link");
        r.on_window(&window(50, 20), queued);
        assert_eq!(r.copies(), 1);
    }

    #[test]
    fn a_swollen_round_trip_is_a_full_link() {
        let mut r = Redundancy::new(2, BUDGET);
        let mut w = window(50, 50);
        // 15 % of 80 ms is 12 ms: 63 ms over a least 50 is swollen.
        w.path.as_mut().unwrap().rtt = Duration::from_millis(63);
        assert_eq!(r.on_window(&w, Verdict::Fair).wanted, None);
        assert_eq!(r.loss(), None);
    }

    #[test]
    fn without_a_connection_or_frames_the_copies_hold() {
        let mut r = Redundancy::new(2, BUDGET);
        feed(&mut r, &window(50, 20), 1);
        let d = r.on_window(&WindowStats::default(), Verdict::Idle);
        assert_eq!(d.copies, 2);
        let mut idle = window(50, 0);
        idle.handed = 0;
        idle.bytes = 0;
        for _ in 0..20 {
            r.on_window(&idle, Verdict::Idle);
        }
        assert_eq!(r.copies(), 2, "no frame size, no judgement");
    }

    #[test]
    fn a_camera_opened_with_one_copy_never_sends_more() {
        let mut r = Redundancy::new(1, BUDGET);
        assert_eq!(feed(&mut r, &window(50, 200), 10), 1);
    }

    proptest! {
        /// Whatever the windows, the copies stay within 1 and the most the
        /// camera was opened with, and a queued window never adds one.
        #[test]
        fn copies_stay_in_bounds_and_a_queue_never_adds_one(
            max in 1u8..=3,
            windows in proptest::collection::vec(
                (0u64..120, 0u64..2_000, 0u64..300, 0u64..60_000, any::<bool>(), 0u64..40),
                1..60,
            ),
        ) {
            let mut r = Redundancy::new(max, BUDGET);
            for (rtt, sent, lost, bytes, queued, swell) in windows {
                let w = WindowStats {
                    handed: u64::from(bytes > 0),
                    bytes,
                    path: Some(PathWindow {
                        rtt: Duration::from_millis(rtt + swell),
                        min_rtt: Duration::from_millis(rtt),
                        sent_packets: sent,
                        lost_packets: lost.min(sent),
                        ..PathWindow::default()
                    }),
                    ..WindowStats::default()
                };
                let verdict = if queued {
                    Verdict::Pressed(Pressure { queued: true, ..Pressure::default() })
                } else {
                    Verdict::Fair
                };
                let before = r.copies();
                let d = r.on_window(&w, verdict);
                prop_assert!((1..=max).contains(&d.copies));
                if queued || swell > 12 {
                    prop_assert!(d.copies <= before);
                }
            }
        }
    }
}
