//! A frame's deadline on the gateway's clock: pure, clock-injected.
//!
//! An edge stamps each frame with `captured_at_us` on its own clock and a
//! budget counted from then. Between capture and arrival the frame may have
//! waited in the edge's send path (a congested uplink can hold it for
//! seconds) and crossed the link. The gateway learns how long from the
//! edge's clock offset, which [`EdgeClock`] estimates NTP-style from
//! `ClockProbe` → `ClockEcho` exchanges on the control stream:
//!
//! - a probe sent at gateway time `t1` is stamped `e` by the edge and its
//!   echo read at `t4`: round trip `t4 − t1`, offset `e − (t1 + t4) / 2`,
//!   wrong by at most half the round trip (if all the delay was one way);
//! - of the last [`CLOCK_WINDOW`] samples the one with the shortest round
//!   trip is trusted (the least queueing, so the tightest bound), as NTP's
//!   clock filter does; a window, not all history, so that an edge whose
//!   clock is stepped is followed within a window.
//!
//! [`admit`] then turns a frame's capture time and budget into its local
//! deadline: the moment its result must leave the gateway to reach the edge
//! within budget. A frame whose deadline has passed on arrival is late: the
//! scheduler sheds it at once (`late_on_arrival`), never `ok`.

use std::collections::VecDeque;

use crate::scheduler::Micros;

/// Samples the offset is chosen from: at one probe every
/// [`PROBE_EVERY_US`] about 40 s of history.
pub const CLOCK_WINDOW: usize = 8;

/// How often the gateway probes an edge's clock once it has a first
/// estimate (µs). The first [`FIRST_PROBES`] go [`FIRST_PROBE_EVERY_US`]
/// apart, so a new connection has a good estimate within a few seconds.
pub const PROBE_EVERY_US: Micros = 5_000_000;
/// Probes sent at the quicker pace after a connection opens.
pub const FIRST_PROBES: u32 = 4;
/// The quicker pace (µs).
pub const FIRST_PROBE_EVERY_US: Micros = 500_000;

/// An echo whose round trip exceeds this is refused as a sample: it tells
/// the offset only to within ±5 s, which is no use against an 80 ms budget,
/// and is more likely a stale or forged echo than a measurement.
pub const MAX_SAMPLE_RTT_US: Micros = 10_000_000;

/// Why a `ClockEcho` was not taken as a sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EchoError {
    /// It echoes a probe time later than now: not one of ours.
    #[error(
        "clock echo of a probe sent at {sent_us} µs, after now ({now_us} µs): not a probe this gateway sent"
    )]
    FromTheFuture {
        /// The echoed probe time.
        sent_us: Micros,
        /// Now, on the gateway's clock.
        now_us: Micros,
    },
    /// Its round trip is too long to say anything useful.
    #[error("clock echo after {rtt_us} µs; echoes over {MAX_SAMPLE_RTT_US} µs are ignored")]
    TooSlow {
        /// The round trip.
        rtt_us: Micros,
    },
}

/// An estimate of an edge's clock against the gateway's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Offset {
    /// Edge clock − gateway clock (µs).
    pub offset_us: i64,
    /// The round trip of the sample it came from (µs): the estimate is
    /// wrong by at most half of it.
    pub rtt_us: Micros,
}

/// One edge connection's clock, from its probe echoes.
#[derive(Debug, Clone, Default)]
pub struct EdgeClock {
    samples: VecDeque<Offset>,
    probes_sent: u32,
    last_probe_us: Option<Micros>,
}

impl EdgeClock {
    /// A clock with no samples yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether a probe is due at `now_us`; if so, counts it as sent.
    pub fn probe_due(&mut self, now_us: Micros) -> bool {
        let every = if self.probes_sent < FIRST_PROBES {
            FIRST_PROBE_EVERY_US
        } else {
            PROBE_EVERY_US
        };
        let due = self
            .last_probe_us
            .is_none_or(|last| now_us.saturating_sub(last) >= every);
        if due {
            self.probes_sent = self.probes_sent.saturating_add(1);
            self.last_probe_us = Some(now_us);
        }
        due
    }

    /// When the next probe is due (µs), for the caller's timer.
    pub fn next_probe_us(&self) -> Micros {
        let every = if self.probes_sent < FIRST_PROBES {
            FIRST_PROBE_EVERY_US
        } else {
            PROBE_EVERY_US
        };
        self.last_probe_us
            .map_or(0, |last| last.saturating_add(every))
    }

    /// Takes an echo of the probe sent at `sent_us`, stamped `edge_us` by
    /// the edge, read at `now_us` (gateway clock).
    pub fn on_echo(
        &mut self,
        sent_us: Micros,
        edge_us: Micros,
        now_us: Micros,
    ) -> Result<Offset, EchoError> {
        if sent_us > now_us {
            return Err(EchoError::FromTheFuture { sent_us, now_us });
        }
        let rtt_us = now_us - sent_us;
        if rtt_us > MAX_SAMPLE_RTT_US {
            return Err(EchoError::TooSlow { rtt_us });
        }
        // The midpoint, without overflow: sent + rtt / 2.
        let mid = sent_us + rtt_us / 2;
        let offset_us = clamp_i64(i128::from(edge_us) - i128::from(mid));
        let sample = Offset { offset_us, rtt_us };
        if self.samples.len() == CLOCK_WINDOW {
            self.samples.pop_front();
        }
        self.samples.push_back(sample);
        Ok(sample)
    }

    /// The trusted estimate: the window's sample with the shortest round
    /// trip (the latest of equals); `None` before the first echo.
    pub fn offset(&self) -> Option<Offset> {
        self.samples.iter().rev().min_by_key(|s| s.rtt_us).copied()
    }
}

fn clamp_i64(v: i128) -> i64 {
    v.clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64
}

/// What a frame's capture time and budget mean on the gateway's clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admission {
    /// When a worker must have finished it (µs, gateway clock): what is
    /// left of its budget after the trip back and the margin.
    pub deadline_us: Micros,
    /// How old it was on arrival (µs): time on the edge's send path and on
    /// the link. Half the round trip while the edge's clock is unknown.
    pub age_us: Micros,
    /// Whether its age came from the edge's clock (or was assumed).
    pub clock_known: bool,
}

impl Admission {
    /// Whether nothing of the budget is left for the worker: the frame
    /// arrived too late to be served.
    pub fn is_late(&self, arrived_us: Micros) -> bool {
        self.deadline_us <= arrived_us
    }
}

/// `budget_us` held to the gateway's longest budget (`[scheduler]
/// max_budget_ms`): a frame that declares more is served as if it had
/// declared that, so that no edge can keep frames queued for longer (a
/// budget of `u32::MAX` µs is 71 minutes).
pub fn capped_budget_us(budget_us: u32, max_budget_ms: u32) -> u32 {
    budget_us.min(max_budget_ms.saturating_mul(1000))
}

/// The local deadline of a frame that arrived at `arrived_us`, captured at
/// `captured_at_us` on the edge's clock with `budget_us` counted from then:
///
/// `deadline = arrival − age + budget − rtt / 2 − margin`
///
/// where `age` is the time since capture on the gateway's clock (via the
/// edge's `offset`; never negative), `rtt / 2` the trip back of its result,
/// and `margin` the time the gateway needs to send it. Before the edge's
/// clock is known the frame is taken to have been sent as it was captured
/// (`age = rtt / 2`), as a gateway without clock estimates must.
pub fn admit(
    arrived_us: Micros,
    captured_at_us: u64,
    budget_us: u32,
    offset: Option<Offset>,
    rtt_us: Micros,
    margin_us: Micros,
) -> Admission {
    let one_way = rtt_us / 2;
    let (age_us, clock_known) = match offset {
        Some(o) => {
            let captured_here = i128::from(captured_at_us) - i128::from(o.offset_us);
            let age = (i128::from(arrived_us) - captured_here).max(0);
            (u64::try_from(age).unwrap_or(u64::MAX), true)
        }
        None => (one_way, false),
    };
    let deadline_us = arrived_us
        .saturating_add(u64::from(budget_us))
        .saturating_sub(age_us)
        .saturating_sub(one_way)
        .saturating_sub(margin_us);
    Admission {
        deadline_us,
        age_us,
        clock_known,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const EDGE_AHEAD: i64 = 3_600_000_000; // the edge's clock an hour ahead

    #[test]
    fn the_offset_is_read_from_the_midpoint_of_a_probe() {
        let mut c = EdgeClock::new();
        assert_eq!(c.offset(), None);
        // Sent at 1 s, echoed after 20 ms, stamped when the probe was half
        // way: an edge an hour ahead.
        let o = c
            .on_echo(1_000_000, (1_010_000 + EDGE_AHEAD) as u64, 1_020_000)
            .unwrap();
        assert_eq!(o.offset_us, EDGE_AHEAD);
        assert_eq!(o.rtt_us, 20_000);
        assert_eq!(c.offset(), Some(o));
    }

    #[test]
    fn the_sample_with_the_shortest_round_trip_is_trusted_within_the_window() {
        let mut c = EdgeClock::new();
        // A queued probe (200 ms, one-sided) then a clean one (20 ms).
        c.on_echo(0, (190_000 + EDGE_AHEAD) as u64, 200_000)
            .unwrap();
        c.on_echo(1_000_000, (1_010_000 + EDGE_AHEAD) as u64, 1_020_000)
            .unwrap();
        assert_eq!(c.offset().unwrap().offset_us, EDGE_AHEAD);
        // The clean sample leaves the window after CLOCK_WINDOW more: the
        // edge's clock was stepped back a second meanwhile.
        for i in 0..CLOCK_WINDOW as u64 {
            let t = 2_000_000 + i * 1_000_000;
            c.on_echo(
                t,
                (t as i64 + 25_000 + EDGE_AHEAD - 1_000_000) as u64,
                t + 50_000,
            )
            .unwrap();
        }
        assert_eq!(c.offset().unwrap().offset_us, EDGE_AHEAD - 1_000_000);
    }

    #[test]
    fn echoes_from_the_future_or_after_ten_seconds_are_refused() {
        let mut c = EdgeClock::new();
        assert!(matches!(
            c.on_echo(5, 0, 4),
            Err(EchoError::FromTheFuture { .. })
        ));
        assert!(matches!(
            c.on_echo(0, 0, MAX_SAMPLE_RTT_US + 1),
            Err(EchoError::TooSlow { .. })
        ));
        assert_eq!(c.offset(), None);
    }

    #[test]
    fn probes_go_quickly_at_first_then_every_five_seconds() {
        let mut c = EdgeClock::new();
        let mut sent = Vec::new();
        for t in (0..20_000_000).step_by(100_000) {
            if c.probe_due(t) {
                sent.push(t);
            }
        }
        assert_eq!(
            &sent[..5],
            &[0, 500_000, 1_000_000, 1_500_000, 6_500_000],
            "{sent:?}"
        );
        assert_eq!(c.next_probe_us(), sent.last().unwrap() + PROBE_EVERY_US);
    }

    #[test]
    fn a_frame_that_waited_on_the_edge_has_that_much_less_time() {
        // Edge clock an hour ahead; captured 31 s before it arrived (it sat
        // in the sender's queue): 80 ms of budget were gone long ago.
        let offset = Offset {
            offset_us: EDGE_AHEAD,
            rtt_us: 20_000,
        };
        let arrived = 100_000_000;
        let captured = (arrived as i64 - 31_000_000 + EDGE_AHEAD) as u64;
        let a = admit(arrived, captured, 80_000, Some(offset), 20_000, 2_000);
        assert_eq!(a.age_us, 31_000_000);
        assert!(a.is_late(arrived));
        assert!(a.clock_known);

        // Captured 15 ms before it arrived: 80 − 15 − 10 (back) − 2 left.
        let captured = (arrived as i64 - 15_000 + EDGE_AHEAD) as u64;
        let a = admit(arrived, captured, 80_000, Some(offset), 20_000, 2_000);
        assert_eq!(a.deadline_us, arrived + 53_000);
        assert!(!a.is_late(arrived));
    }

    #[test]
    fn a_budget_over_the_gateways_longest_is_cut_to_it() {
        assert_eq!(capped_budget_us(u32::MAX, 10_000), 10_000_000);
        assert_eq!(capped_budget_us(80_000, 10_000), 80_000);
        // A cap beyond what µs in a u32 can say leaves every budget alone.
        assert_eq!(capped_budget_us(u32::MAX, u32::MAX), u32::MAX);
    }

    #[test]
    fn a_link_slower_than_the_budget_leaves_nothing() {
        // 100 ms RTT against an 80 ms budget: 50 ms there, 50 back.
        let offset = Offset {
            offset_us: 0,
            rtt_us: 100_000,
        };
        let a = admit(1_000_000, 950_000, 80_000, Some(offset), 100_000, 2_000);
        assert_eq!(a.age_us, 50_000);
        assert!(a.is_late(1_000_000));
        // With 200 ms of budget there is time.
        let a = admit(1_000_000, 950_000, 200_000, Some(offset), 100_000, 2_000);
        assert_eq!(a.deadline_us, 1_000_000 + 200_000 - 50_000 - 50_000 - 2_000);
    }

    #[test]
    fn without_a_clock_estimate_the_frame_is_taken_as_sent_when_captured() {
        // The formula of a gateway that knows only the RTT.
        let a = admit(1_000_000, 12_345, 80_000, None, 20_000, 2_000);
        assert_eq!(a.age_us, 10_000);
        assert!(!a.clock_known);
        assert_eq!(a.deadline_us, 1_000_000 + 80_000 - 20_000 - 2_000);
    }

    proptest! {
        #[test]
        fn the_deadline_never_exceeds_capture_plus_budget(
            arrived in 0u64..1 << 50,
            age in 0u64..100_000_000,
            offset_us in -(1i64 << 50)..(1i64 << 50),
            budget in any::<u32>(),
            rtt in 0u64..MAX_SAMPLE_RTT_US,
            margin in 0u64..1_000_000,
        ) {
            let captured = i128::from(arrived) - i128::from(age) + i128::from(offset_us);
            prop_assume!((0..i128::from(u64::MAX)).contains(&captured));
            let offset = Offset { offset_us, rtt_us: rtt };
            let a = admit(arrived, captured as u64, budget, Some(offset), rtt, margin);
            prop_assert_eq!(a.age_us, age);
            // Never later than capture + budget, on the gateway's clock.
            prop_assert!(a.deadline_us <= (arrived + u64::from(budget)).saturating_sub(age));
            // A frame older than its budget is always late.
            if age >= u64::from(budget) {
                prop_assert!(a.is_late(arrived));
            }
        }

        #[test]
        fn the_estimate_is_within_half_the_round_trip_whatever_the_path(
            true_offset in -(1i64 << 40)..(1i64 << 40),
            probes in prop::collection::vec((0u64..1_000_000, 0u64..1_000_000), 1..20),
        ) {
            // Each probe: `out` µs to the edge, `back` µs back, asymmetric.
            let mut c = EdgeClock::new();
            let mut t = 1u64 << 41;
            for (out, back) in probes {
                let edge = (i128::from(t + out) + i128::from(true_offset)) as u64;
                let o = c.on_echo(t, edge, t + out + back).unwrap();
                let err = (i128::from(o.offset_us) - i128::from(true_offset)).abs();
                prop_assert!(err <= i128::from(o.rtt_us / 2 + 1), "err {} rtt {}", err, o.rtt_us);
                t += out + back + 1_000_000;
            }
            let best = c.offset().unwrap();
            let err = (i128::from(best.offset_us) - i128::from(true_offset)).abs();
            prop_assert!(err <= i128::from(best.rtt_us / 2 + 1));
        }
    }
}
