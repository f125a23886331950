//! Fits a camera to what its uplink delivers in time: JPEG quality first,
//! then frame rate.
//!
//! A pure, clock-injected policy. Once a [`WINDOW`] the camera task feeds
//! [`LinkFit::on_window`] what happened to the camera's frames in it
//! ([`WindowStats`]: frames handed to QUIC, acknowledged, reset at their
//! deadline or superseded, how long the acknowledged ones took, the bytes
//! they weighed,
//! the results that came back too late, and the connection's path
//! statistics) and gets a [`Decision`]: the JPEG quality and the frame-rate
//! cap to use until the next window. [`WindowMeter`] turns the camera's
//! running totals into windows.
//!
//! The rules, in order:
//!
//! 1. A window is **pressed** when more than [`MISS_PRESSED`] of its frames
//!    were reset on the wire (at their deadline, or superseded: a newer
//!    frame got through first, or the lane's `max_in_flight` was full), or
//!    more than
//!    [`LATE_PRESSED`] of its results came back over the budget (or were
//!    shed by the gateway as late on arrival; a result whose time at the
//!    gateway and worker alone was over the budget, as a GPU's first run
//!    of a shape or a trial of a worker too slow for it can be, is not
//!    counted: no link could have saved it), or the link is **queued**:
//!    the frames acknowledged took, on average, more than
//!    [`ACK_DELAY_ALLOWANCE`] + [`QUEUE_PRESSED`] × budget beyond the path's
//!    least round trip (so the bytes ahead of them were more than the link
//!    delivers within that share of the budget), or frames were reset and
//!    none got through at all, or the round trip is **swelling**: the
//!    connection's smoothed round trip rose by more than [`RTT_RISE`] ×
//!    budget since the camera's last window and stands more than
//!    [`QUEUE_PRESSED`] × budget above its least one (a queue filling at
//!    the bottleneck, a window before the frames go late; a round trip that
//!    is merely high, or jittery, does not rise window after window). It is
//!    pressed too when **another camera on
//!    the same connection** found it pressed on the wire since this
//!    camera's last window ([`PathWindow::pressed_windows`]): one
//!    bottleneck, one signal, so every camera backs off together — except
//!    in the window right after this camera stepped down, when those
//!    reports are of the queue its step has not yet drained.
//! 2. Pressed: lower the quality by [`QUALITY_DOWN`], never below the
//!    floor. Only at the floor (or for a codec without a quality: raw, PNG)
//!    lower the rate cap, to [`RATE_DOWN`] × the rate actually sent, never
//!    below [`RATE_FLOOR_FPS`], and only when the link is queued or results
//!    are late: resets alone, with the frames that arrive arriving
//!    promptly, are random loss on a long round trip, which fewer frames do
//!    not cure (smaller ones do: fewer packets each to lose).
//! 3. A window is **clean** when frames went or arrived, none was reset,
//!    no result was late, the acknowledged ones waited less
//!    than [`ACK_DELAY_ALLOWANCE`] + [`QUEUE_CLEAN`] × budget beyond the
//!    least round trip, and the smoothed round trip is within
//!    [`RTT_CLEAN`] × budget of the least one. After [`CLEAN_TO_RAISE`]
//!    clean windows in a row, in the camera's next raise slot (one window
//!    in [`STAGGER`], so that the cameras of an uplink take turns probing
//!    it): raise the rate cap by [`RATE_UP`] (up to the configured rate);
//!    once it is back, raise the quality by [`QUALITY_UP`] (up to the
//!    highest). One knob moves per window, and a raise starts the count
//!    again.
//! 4. Hysteresis: down is fast (one pressed window, big steps), up is slow
//!    (three clean windows, small steps); and a raise followed by pressure
//!    within [`PROBATION`] windows doubles the clean windows the next raise
//!    needs (up to [`MAX_CLEAN_TO_RAISE`]), so a camera at the edge of its
//!    link does not probe it every few seconds. A raise that survives its
//!    probation halves them again (down to [`CLEAN_TO_RAISE`]).
//! 5. A window in which nothing went, arrived, was reset or came back (a
//!    static scene behind the motion gate) is **idle**: it changes nothing,
//!    not even the count of clean windows.
//! 6. **Slow start**: an adapting camera starts at its quality floor and
//!    the configured rate, and climbs by [`SLOW_START_UP`] in each raise
//!    slot after a clean window, until its first pressed window, or the
//!    first pressed window (for any reason, late results too) of any camera
//!    on its connection ([`PathWindow::slow_start_over`]): one link, one
//!    capacity. Starting at the top made the first windows on a thin uplink
//!    late while the quality came down; and sixteen cameras that each went
//!    on climbing in big steps until their own window was pressed took a
//!    10 Mbit/s link past its limit together, a second after two of them
//!    had found it.
//!
//! The gateway's `ControlHint` rate caps are applied on top by the caller:
//! the stricter cap wins. A frame still on the wire at its deadline is
//! reset by the lane whatever this policy decides; this policy keeps that
//! from being the common case.

use std::time::Duration;

use crate::uplink::PathStats;

/// How often the policy decides. The gateway's back-pressure works on 1 s
/// windows too; at 10 fps a window holds 10 frames, enough to tell one
/// miss in ten from none.
pub const WINDOW: Duration = Duration::from_secs(1);
/// Fraction of a window's frames reset (at their deadline, or superseded)
/// above which it is pressed. Under 1–2 % random loss a frame of a few
/// packets loses one now and then, and on a long round trip the
/// retransmission costs it its deadline: that alone must not drive the
/// quality to the floor.
pub const MISS_PRESSED: f64 = 0.10;
/// Fraction of a window's results late (over the budget, or shed as late
/// on arrival) above which it is pressed.
pub const LATE_PRESSED: f64 = 0.10;
/// Part of an acknowledgement's lateness that is not queueing: QUIC's
/// default `max_ack_delay`, the longest a receiver may hold the ACK of a
/// frame's last packet.
pub const ACK_DELAY_ALLOWANCE: Duration = Duration::from_millis(25);
/// Share of the budget that waiting behind other bytes (beyond the path's
/// round trip and [`ACK_DELAY_ALLOWANCE`]) may take before the link counts
/// as queued: the rest of the budget is the worker's and the result's way
/// back.
pub const QUEUE_PRESSED: f64 = 0.25;
/// Share of the budget that waiting may take in a clean window; between
/// this and [`QUEUE_PRESSED`] a window is neither (no change).
pub const QUEUE_CLEAN: f64 = 0.10;
/// Share of the budget by which the connection's smoothed round trip may
/// exceed its least one in a clean window. A link filling up shows here
/// first: on a 10 Mbit/s uplink the round trip grew from 20 to 41 ms while
/// every frame still arrived in time, a window before the frames went
/// late; a raise then was the one that overshot. It only holds raises back,
/// never presses: jitter inflates it too.
pub const RTT_CLEAN: f64 = 0.15;
/// Share of the budget by which the smoothed round trip must rise within a
/// window, to more than [`QUEUE_PRESSED`] × budget above its least one,
/// for the link to count as filling up. On a 10 Mbit/s uplink the round
/// trip went from 32 to 53 ms in the window before sixteen cameras' frames
/// all went late; QUIC's smoothed round trip moves an eighth of the way to
/// each sample, so jitter alone does not lift it this much in a second.
pub const RTT_RISE: f64 = 0.15;
/// Acknowledged frames a window needs before their mean wait counts: one
/// retransmitted frame is not a queue.
pub const QUEUE_MIN_FRAMES: u64 = 2;
/// JPEG quality step down. Ten points of quality save 10–30 % of a frame's
/// bytes in the 50–90 range (a detailed 128×128 frame: 8.8 KB at 90, 6.4
/// at 80, 5.3 at 70, 4.6 at 60, 4.1 at 50): four steps from the default 90
/// reach the default floor 50.
pub const QUALITY_DOWN: u8 = 10;
/// JPEG quality step up: half the step down, so that the quality climbs
/// back more slowly than it fell.
pub const QUALITY_UP: u8 = 5;
/// Rate cap after a pressed window at the floor, as a share of the rate
/// sent in it (multiplicative decrease, as a congestion controller backs
/// off).
pub const RATE_DOWN: f64 = 0.7;
/// Rate cap raise per step (as the gateway's back-pressure raises its cap).
pub const RATE_UP: f64 = 1.25;
/// Lowest rate cap: a frame every two seconds keeps the camera seen and the
/// link probed (the default keep-alive rate too).
pub const RATE_FLOOR_FPS: f64 = 0.5;
/// Clean windows in a row before a raise (as the gateway's back-pressure).
pub const CLEAN_TO_RAISE: u32 = 3;
/// The most clean windows a raise may come to need.
pub const MAX_CLEAN_TO_RAISE: u32 = 24;
/// Windows after a raise within which pressure blames the raise.
pub const PROBATION: u32 = 3;
/// Raise slots: a camera raises only in every `STAGGER`th window, at the
/// offset its [`FitConfig::phase`] gives, so that the cameras of one
/// uplink take turns probing it. Sixteen cameras that all raised together
/// added, in one window, sixteen times the bytes one probe needs: a failed
/// probe then made most of that window's frames late.
pub const STAGGER: u32 = 3;
/// JPEG quality step up during slow start: as big as the step down.
pub const SLOW_START_UP: u8 = QUALITY_DOWN;

/// What the policy fits, from the camera's configuration.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FitConfig {
    /// JPEG: the highest quality and the floor (1 ≤ floor ≤ highest).
    /// `None` for a codec without a quality knob (raw, PNG): the rate is
    /// the only one.
    pub quality: Option<QualityRange>,
    /// The configured frame-rate cap: adaptation never goes above it.
    pub max_fps: f64,
    /// The camera's end-to-end budget.
    pub budget: Duration,
    /// Start at the quality floor and climb in slow start (see
    /// [`LinkFit::new`]); `false`: start at the highest quality.
    pub slow_start: bool,
    /// Which of the [`STAGGER`] raise slots is the camera's (taken modulo
    /// [`STAGGER`]); [`phase_of`] spreads cameras over them by name.
    pub phase: u32,
}

/// A camera's raise slot ([`FitConfig::phase`]): from its name (FNV-1a),
/// so that the cameras of an edge spread over the [`STAGGER`] slots and a
/// camera keeps its slot across restarts.
pub fn phase_of(camera: &str) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in camera.bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h % STAGGER
}

/// JPEG qualities adaptation moves between.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QualityRange {
    /// Where the camera starts, and the most it goes back up to.
    pub max: u8,
    /// The floor: below it, the rate goes down instead.
    pub min: u8,
}

impl QualityRange {
    /// A range from `min` to `max`, put in order and kept within 1..=100.
    pub fn new(max: u8, min: u8) -> Self {
        let max = max.clamp(1, 100);
        QualityRange {
            max,
            min: min.clamp(1, max),
        }
    }
}

/// A window of the camera's path statistics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PathWindow {
    /// Smoothed round trip at the end of the window.
    pub rtt: Duration,
    /// Least round trip seen on the connection.
    pub min_rtt: Duration,
    /// Congestion window at the end of the window (bytes).
    pub cwnd: u64,
    /// Packets sent in the window (all cameras of the connection).
    pub sent_packets: u64,
    /// Packets declared lost in the window.
    pub lost_packets: u64,
    /// Windows in which a camera of the connection (this one included)
    /// found it pressed on the wire, since this camera's last window.
    pub pressed_windows: u64,
    /// Of them, windows whose frames waited in a queue.
    pub queued_windows: u64,
    /// A camera of the connection has had a pressed window since it was
    /// set up, for any reason: the link's capacity has been found, and
    /// slow start is over for every camera on it.
    pub slow_start_over: bool,
}

impl PathWindow {
    /// Fraction of the window's packets lost.
    pub fn loss(&self) -> f64 {
        if self.sent_packets == 0 {
            0.0
        } else {
            self.lost_packets as f64 / self.sent_packets as f64
        }
    }
}

/// What happened to one camera's frames in one window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WindowStats {
    /// Frames handed to QUIC.
    pub handed: u64,
    /// Frames acknowledged.
    pub delivered: u64,
    /// Frames reset at their deadline (they may have been handed in the
    /// window before).
    pub expired: u64,
    /// Frames reset because a newer frame superseded them.
    pub superseded: u64,
    /// Bytes of the frames handed (their encoded tensors).
    pub bytes: u64,
    /// Send-to-acknowledgement time of the frames `delivered`, summed (µs).
    pub ack_us: u64,
    /// Results received.
    pub results: u64,
    /// Results over the budget, or shed by the gateway as late on arrival.
    pub late: u64,
    /// Frames encoded (JPEG, PNG).
    pub encoded: u64,
    /// Encoding time of the frames `encoded`, summed (µs).
    pub encode_us: u64,
    /// The connection's path in the window; `None` without a connection.
    pub path: Option<PathWindow>,
}

impl WindowStats {
    /// Frames reset on the wire: at their deadline, or superseded.
    pub fn missed(&self) -> u64 {
        self.expired.saturating_add(self.superseded)
    }

    /// Mean bytes of a frame handed.
    pub fn bytes_per_frame(&self) -> Option<u64> {
        (self.handed > 0).then(|| self.bytes / self.handed)
    }

    /// Mean encoding time of a frame (µs).
    pub fn encode_us_per_frame(&self) -> Option<u64> {
        (self.encoded > 0).then(|| self.encode_us / self.encoded)
    }

    /// Mean time an acknowledged frame took beyond the path's least round
    /// trip (µs): its transfer and its wait behind other bytes, plus the
    /// peer's ACK delay. Without path statistics, the whole mean.
    pub fn ack_excess_us(&self) -> Option<u64> {
        if self.delivered == 0 {
            return None;
        }
        let mean = self.ack_us / self.delivered;
        let floor = self.path.map_or(0, |p| {
            u64::try_from(p.min_rtt.as_micros()).unwrap_or(u64::MAX)
        });
        Some(mean.saturating_sub(floor))
    }
}

/// Why a window was pressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Pressure {
    /// More than [`MISS_PRESSED`] of the frames were reset on the wire.
    pub missed: bool,
    /// More than [`LATE_PRESSED`] of the results were late.
    pub late: bool,
    /// The frames that got through waited behind other bytes, or none got
    /// through.
    pub queued: bool,
    /// Another camera on the same connection found it pressed on the wire
    /// (its frames reset or queued) since this camera's last window.
    pub uplink: bool,
    /// ... and its frames waited in a queue.
    pub uplink_queued: bool,
    /// The round trip rose within the window to well above its least one:
    /// a queue is filling at the bottleneck.
    pub swelling: bool,
}

impl Pressure {
    /// This camera's own frames were reset or queued on the wire: what it
    /// tells the other cameras of its connection.
    pub fn on_the_wire(&self) -> bool {
        self.missed || self.queued || self.swelling
    }

    /// Frames waited, or are about to wait, in a queue on the link: what
    /// lowers the rate once the quality is at its floor.
    pub fn queueing(&self) -> bool {
        self.queued || self.uplink_queued || self.swelling
    }
}

/// How a window went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Nothing sent, arrived, reset or back: no evidence either way.
    Idle,
    /// The link did not deliver in time.
    Pressed(Pressure),
    /// Neither pressed nor clean.
    Fair,
    /// The link delivered everything in time, with room.
    Clean,
}

/// What a decision changed (at most one knob).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Nothing.
    Hold,
    /// The JPEG quality went down.
    QualityDown,
    /// The rate cap went down (the quality is at its floor).
    RateDown,
    /// The rate cap went up.
    RateUp,
    /// The JPEG quality went up (the rate cap is back at the configured
    /// rate).
    QualityUp,
}

/// The policy's answer to a window.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Decision {
    /// How the window went.
    pub verdict: Verdict,
    /// What changed.
    pub step: Step,
    /// JPEG quality from now on (`None` for codecs without one).
    pub quality: Option<u8>,
    /// Frame-rate cap from now on (before the gateway's hints).
    pub max_fps: f64,
    /// What to tell the other cameras of the connection
    /// ([`crate::uplink::Uplink::report_pressed`]): `Some(queued)` when
    /// this camera's own frames found it pressed on the wire.
    pub report: Option<bool>,
}

impl Decision {
    /// Whether the window was pressed, for any reason: what ends slow start
    /// for the connection's other cameras
    /// ([`crate::uplink::Uplink::report_slow_start_over`]).
    pub fn pressed(&self) -> bool {
        matches!(self.verdict, Verdict::Pressed(_))
    }
}

/// The policy of one camera. See the module docs.
#[derive(Debug, Clone)]
pub struct LinkFit {
    config: FitConfig,
    quality: Option<u8>,
    max_fps: f64,
    clean_streak: u32,
    clean_needed: u32,
    /// Climbing from the floor, until the first pressed window.
    slow_start: bool,
    /// What the last window reported to the connection's other cameras
    /// (and so counted in the next window's path counters).
    reported: Option<bool>,
    /// The last window stepped down: the other cameras' reports in the
    /// next one are of the same pressure (a queue takes a window to
    /// drain), and are not answered twice.
    stepped_down: bool,

    /// Non-idle windows since the last raise, while it is on probation.
    since_raise: Option<u32>,
    last_now_us: Option<u64>,
    /// The connection's smoothed round trip at the end of the last window
    /// that had one.
    last_rtt: Option<Duration>,
}

impl LinkFit {
    /// A policy at the configured rate and, with
    /// [`FitConfig::slow_start`], at the quality floor: the link is
    /// unknown, and a floor that any link meant for the camera carries
    /// keeps its first frames in time, where starting at the top on a thin
    /// uplink made the first two or three windows' frames late while the
    /// quality came down. From there the quality climbs by
    /// [`SLOW_START_UP`] in each of the camera's raise slots that follows a
    /// clean window, until the first pressed window ends the slow start.
    /// Without slow start it starts at the highest quality.
    pub fn new(config: FitConfig) -> Self {
        let max_fps = if config.max_fps.is_finite() && config.max_fps > 0.0 {
            config.max_fps
        } else {
            RATE_FLOOR_FPS
        };
        let config = FitConfig { max_fps, ..config };
        let slow_start = config.slow_start && config.quality.is_some_and(|q| q.min < q.max);
        LinkFit {
            config,
            quality: config
                .quality
                .map(|q| if slow_start { q.min } else { q.max }),
            max_fps,
            clean_streak: 0,
            clean_needed: CLEAN_TO_RAISE,
            slow_start,
            reported: None,
            stepped_down: false,
            since_raise: None,
            last_now_us: None,
            last_rtt: None,
        }
    }

    /// JPEG quality in force (`None` for codecs without one).
    pub fn quality(&self) -> Option<u8> {
        self.quality
    }

    /// Rate cap in force (before the gateway's hints).
    pub fn max_fps(&self) -> f64 {
        self.max_fps
    }

    /// The lowest rate cap.
    pub fn min_fps(&self) -> f64 {
        RATE_FLOOR_FPS.min(self.config.max_fps)
    }

    /// Clean windows in a row the next raise needs.
    pub fn clean_needed(&self) -> u32 {
        self.clean_needed
    }

    /// Whether the quality is still climbing in slow start (no window has
    /// been pressed yet).
    pub fn in_slow_start(&self) -> bool {
        self.slow_start
    }

    /// How the window went, without deciding anything.
    pub fn verdict(&self, w: &WindowStats) -> Verdict {
        let missed = w.missed();
        if w.handed == 0 && w.delivered == 0 && missed == 0 && w.results == 0 {
            return Verdict::Idle;
        }
        let budget_us = self.config.budget.as_micros() as f64;
        let allowance_us = ACK_DELAY_ALLOWANCE.as_micros() as f64;
        let frames = w.handed.max(missed).max(1) as f64;
        let excess = w.ack_excess_us().map(|e| e as f64);
        // The other cameras' reports: the path counters include this
        // camera's own report of its last window.
        let own = |queued_too: bool| u64::from(self.reported.is_some_and(|q| q || !queued_too));
        let (others, others_queued) = w.path.map_or((0, 0), |p| {
            (
                p.pressed_windows.saturating_sub(own(false)),
                p.queued_windows.saturating_sub(own(true)),
            )
        });
        // A queue swells the smoothed round trip; a retransmission (random
        // loss on a long round trip) delays the acknowledgement of its
        // frame but leaves the round trip alone, since QUIC takes no
        // sample from a retransmitted packet.
        let rtt_swollen = w.path.is_some_and(|p| {
            p.rtt.saturating_sub(p.min_rtt).as_micros() as f64 > RTT_CLEAN * budget_us
        });
        let swelling = w.path.is_some_and(|p| {
            let rose = self.last_rtt.is_some_and(|last| {
                p.rtt.saturating_sub(last).as_micros() as f64 > RTT_RISE * budget_us
            });
            rose && p.rtt.saturating_sub(p.min_rtt).as_micros() as f64 > QUEUE_PRESSED * budget_us
        });
        let pressure = Pressure {
            missed: missed > 0 && missed as f64 > MISS_PRESSED * frames,
            late: w.late > 0 && w.late as f64 > LATE_PRESSED * w.results.max(1) as f64,
            queued: (w.delivered >= QUEUE_MIN_FRAMES
                && excess.is_some_and(|e| e > allowance_us + QUEUE_PRESSED * budget_us)
                && (w.path.is_none() || rtt_swollen))
                || (missed > 0 && w.delivered == 0),
            uplink: others > 0 && !self.stepped_down,
            uplink_queued: others_queued > 0 && !self.stepped_down,
            swelling,
        };
        if pressure.missed
            || pressure.late
            || pressure.queued
            || pressure.uplink
            || pressure.swelling
        {
            return Verdict::Pressed(pressure);
        }
        let roomy =
            excess.is_none_or(|e| e <= allowance_us + QUEUE_CLEAN * budget_us) && !rtt_swollen;
        let went = w.handed > 0 || w.delivered > 0;
        if went && missed == 0 && w.late == 0 && roomy {
            Verdict::Clean
        } else {
            Verdict::Fair
        }
    }

    /// Decides from the window that ended at `now_us` (µs on any monotonic
    /// clock; a clock that goes back is survived).
    pub fn on_window(&mut self, now_us: u64, w: &WindowStats) -> Decision {
        let elapsed_us = match self.last_now_us {
            Some(last) if now_us > last => now_us - last,
            _ => WINDOW.as_micros() as u64,
        };
        self.last_now_us = Some(now_us);
        if w.path.is_some_and(|p| p.slow_start_over) {
            // Another camera found the link's limit: climbing in big steps
            // now would take it past it together.
            self.slow_start = false;
        }
        let verdict = self.verdict(w);
        self.last_rtt = w.path.map(|p| p.rtt);
        let step = match verdict {
            Verdict::Idle => Step::Hold,
            Verdict::Pressed(why) => self.on_pressed(why, w, elapsed_us),
            Verdict::Fair => {
                self.clean_streak = 0;
                self.tick_probation();
                Step::Hold
            }
            Verdict::Clean => {
                self.tick_probation();
                self.on_clean(now_us)
            }
        };
        self.stepped_down = matches!(step, Step::QualityDown | Step::RateDown);
        self.reported = match verdict {
            Verdict::Pressed(why) if why.on_the_wire() => Some(why.queued || why.swelling),
            _ => None,
        };
        Decision {
            verdict,
            step,
            quality: self.quality,
            max_fps: self.max_fps,
            report: self.reported,
        }
    }

    fn on_pressed(&mut self, why: Pressure, w: &WindowStats, elapsed_us: u64) -> Step {
        self.clean_streak = 0;
        self.slow_start = false;
        if self.since_raise.take().is_some() {
            // The last raise was too much: the next one waits longer.
            self.clean_needed = (self.clean_needed * 2).min(MAX_CLEAN_TO_RAISE);
        }
        if let (Some(q), Some(range)) = (self.quality, self.config.quality)
            && q > range.min
        {
            self.quality = Some(q.saturating_sub(QUALITY_DOWN).max(range.min));
            return Step::QualityDown;
        }
        if !why.queueing() {
            return Step::Hold;
        }
        // From what was actually sent: under a lower hint or a motion gate
        // the cap itself may be far above it.
        let sent_fps = if w.handed > 0 && elapsed_us >= WINDOW.as_micros() as u64 / 2 {
            w.handed as f64 * 1e6 / elapsed_us as f64
        } else {
            self.max_fps
        };
        let lowered = (self.max_fps.min(sent_fps) * RATE_DOWN).max(self.min_fps());
        if lowered < self.max_fps {
            self.max_fps = lowered;
            Step::RateDown
        } else {
            Step::Hold
        }
    }

    /// Whether the window that ended at `now_us` is one of the camera's
    /// raise slots. Slots are counted on the clock, not in windows, so that
    /// the cameras of one process keep to their turns whenever each
    /// started, and whatever windows each spent idle.
    pub fn in_slot(&self, now_us: u64) -> bool {
        let window = now_us / WINDOW.as_micros() as u64;
        (window + u64::from(self.config.phase)).is_multiple_of(u64::from(STAGGER))
    }

    fn on_clean(&mut self, now_us: u64) -> Step {
        self.clean_streak += 1;
        let needed = if self.slow_start {
            1
        } else {
            self.clean_needed
        };
        if self.clean_streak < needed || !self.in_slot(now_us) {
            return Step::Hold;
        }
        let up = if self.slow_start {
            SLOW_START_UP
        } else {
            QUALITY_UP
        };
        let step = if self.max_fps < self.config.max_fps {
            self.max_fps = (self.max_fps * RATE_UP).min(self.config.max_fps);
            Step::RateUp
        } else {
            match (self.quality, self.config.quality) {
                (Some(q), Some(range)) if q < range.max => {
                    self.quality = Some(q.saturating_add(up).min(range.max));
                    Step::QualityUp
                }
                _ => Step::Hold,
            }
        };
        if step != Step::Hold {
            self.clean_streak = 0;
            self.since_raise = Some(0);
        }
        step
    }

    /// Counts a window without pressure against the last raise's
    /// probation; one that survives it earns back quicker raises.
    fn tick_probation(&mut self) {
        if let Some(n) = self.since_raise.as_mut() {
            *n += 1;
            if *n >= PROBATION {
                self.since_raise = None;
                self.clean_needed = (self.clean_needed / 2).max(CLEAN_TO_RAISE);
            }
        }
    }
}

/// A camera's running totals, as its counters hold them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Totals {
    /// Frames handed to QUIC.
    pub handed: u64,
    /// Frames acknowledged.
    pub delivered: u64,
    /// Frames reset at their deadline.
    pub expired: u64,
    /// Frames reset as superseded.
    pub superseded: u64,
    /// Bytes handed.
    pub bytes: u64,
    /// Send-to-acknowledgement time of the frames delivered (µs).
    pub ack_us: u64,
    /// Results received.
    pub results: u64,
    /// Results late.
    pub late: u64,
    /// Frames encoded.
    pub encoded: u64,
    /// Encoding time (µs).
    pub encode_us: u64,
}

/// Turns running totals into windows. Totals only grow; path counters
/// start again with each connection, which [`WindowMeter::window`] notices.
#[derive(Debug, Clone, Default)]
pub struct WindowMeter {
    last: Totals,
    last_path: Option<PathStats>,
}

impl WindowMeter {
    /// A meter whose first window counts from `totals`.
    pub fn starting_at(totals: Totals) -> Self {
        WindowMeter {
            last: totals,
            last_path: None,
        }
    }

    /// The window since the last call: the growth of `totals`, and of the
    /// connection's `path` counters (from zero on a new connection, whose
    /// counters are below the last ones seen).
    pub fn window(&mut self, totals: Totals, path: Option<PathStats>) -> WindowStats {
        let l = self.last;
        let d = |now: u64, before: u64| now.saturating_sub(before);
        let path_window = path.map(|p| {
            let counters = |p: &PathStats| {
                [
                    p.sent_packets,
                    p.lost_packets,
                    p.pressed_windows,
                    p.queued_windows,
                ]
            };
            let now = counters(&p);
            // Counters below the last ones seen: a new connection, counted
            // from zero.
            let [sent, lost, pressed, queued] = match self.last_path.as_ref().map(counters) {
                Some(before) if now.iter().zip(&before).all(|(n, b)| n >= b) => {
                    std::array::from_fn(|i| now[i] - before[i])
                }
                _ => now,
            };
            PathWindow {
                rtt: p.rtt,
                min_rtt: p.min_rtt,
                cwnd: p.cwnd,
                sent_packets: sent,
                lost_packets: lost,
                pressed_windows: pressed,
                queued_windows: queued,
                slow_start_over: p.slow_start_over,
            }
        });
        let w = WindowStats {
            handed: d(totals.handed, l.handed),
            delivered: d(totals.delivered, l.delivered),
            expired: d(totals.expired, l.expired),
            superseded: d(totals.superseded, l.superseded),
            bytes: d(totals.bytes, l.bytes),
            ack_us: d(totals.ack_us, l.ack_us),
            results: d(totals.results, l.results),
            late: d(totals.late, l.late),
            encoded: d(totals.encoded, l.encoded),
            encode_us: d(totals.encode_us, l.encode_us),
            path: path_window,
        };
        self.last = totals;
        self.last_path = path;
        w
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn jpeg(max: u8, min: u8) -> FitConfig {
        FitConfig {
            quality: Some(QualityRange::new(max, min)),
            max_fps: 10.0,
            budget: Duration::from_millis(80),
            slow_start: false,
            phase: 0,
        }
    }

    fn path(min_rtt_ms: u64) -> Option<PathWindow> {
        Some(PathWindow {
            rtt: Duration::from_millis(min_rtt_ms),
            min_rtt: Duration::from_millis(min_rtt_ms),
            cwnd: 14_720,
            sent_packets: 100,
            lost_packets: 0,
            ..PathWindow::default()
        })
    }

    /// Ten frames, all acknowledged `ack_ms` after they were handed, on a
    /// 20 ms path.
    fn window(ack_ms: u64) -> WindowStats {
        WindowStats {
            handed: 10,
            delivered: 10,
            bytes: 60_000,
            ack_us: 10 * ack_ms * 1000,
            path: path(20),
            ..WindowStats::default()
        }
    }

    #[test]
    fn ack_wait_beyond_the_allowance_and_a_quarter_of_the_budget_is_queueing() {
        let fit = LinkFit::new(jpeg(90, 50));
        // The round trip swollen by a queue (20 ms beyond its least one).
        let queue = |ack_ms| {
            let mut w = window(ack_ms);
            if let Some(p) = w.path.as_mut() {
                p.rtt = p.min_rtt + Duration::from_millis(20);
            }
            w
        };
        // 20 ms path + 25 ms ACK delay + 20 ms (a quarter of 80) = 65 ms.
        assert_eq!(fit.verdict(&queue(64)), Verdict::Fair);
        assert_eq!(
            fit.verdict(&queue(66)),
            Verdict::Pressed(Pressure {
                queued: true,
                ..Pressure::default()
            })
        );
        // Acknowledgements as late with the round trip at its least: the
        // frames waited for retransmissions, not behind other bytes.
        assert_eq!(fit.verdict(&window(66)), Verdict::Fair);
        assert_eq!(fit.verdict(&window(500)), Verdict::Fair);
        // Clean up to 20 + 25 + 8 ms.
        assert_eq!(fit.verdict(&window(53)), Verdict::Clean);
        assert_eq!(fit.verdict(&window(54)), Verdict::Fair);
    }

    #[test]
    fn one_miss_in_ten_is_tolerated_two_are_not() {
        let fit = LinkFit::new(jpeg(90, 50));
        let mut w = window(30);
        w.expired = 1;
        w.delivered = 9;
        assert_eq!(fit.verdict(&w), Verdict::Fair);
        w.expired = 2;
        w.delivered = 8;
        assert!(matches!(
            fit.verdict(&w),
            Verdict::Pressed(Pressure { missed: true, .. })
        ));
    }

    #[test]
    fn superseded_frames_are_misses_and_none_delivered_is_a_queue() {
        let fit = LinkFit::new(jpeg(90, 50));
        // A full lane evicts every frame before it gets across.
        let w = WindowStats {
            handed: 10,
            superseded: 9,
            bytes: 88_000,
            path: path(10),
            ..WindowStats::default()
        };
        assert_eq!(
            fit.verdict(&w),
            Verdict::Pressed(Pressure {
                missed: true,
                queued: true,
                ..Pressure::default()
            })
        );
    }

    /// A clean window on a path where `pressed` windows (`queued` of them
    /// queued) were reported by the connection's cameras.
    fn reported(pressed: u64, queued: u64) -> WindowStats {
        let mut w = window(21);
        if let Some(p) = w.path.as_mut() {
            p.pressed_windows = pressed;
            p.queued_windows = queued;
        }
        w
    }

    #[test]
    fn another_cameras_report_presses_this_one_and_its_own_does_not() {
        let mut fit = LinkFit::new(jpeg(90, 50));
        let mut t = 0;
        // Its own frames were reset and queued: it steps down and tells the
        // others.
        t += 1_000_000;
        let d = fit.on_window(t, &jammed());
        assert_eq!((d.step, d.report), (Step::QualityDown, Some(true)));
        // Its own report, alone, comes back in the next window's counters:
        // clean.
        t += 1_000_000;
        let d = fit.on_window(t, &reported(1, 1));
        assert_eq!((d.verdict, d.report), (Verdict::Clean, None));
        // Another camera's: pressed, though its own frames went through.
        t += 1_000_000;
        let d = fit.on_window(t, &reported(1, 0));
        assert_eq!(
            d.verdict,
            Verdict::Pressed(Pressure {
                uplink: true,
                ..Pressure::default()
            })
        );
        assert_eq!((d.step, d.report), (Step::QualityDown, None));
        assert_eq!(fit.quality(), Some(70));
    }

    #[test]
    fn after_a_step_down_the_others_reports_of_the_same_queue_are_not_answered_twice() {
        let mut fit = LinkFit::new(jpeg(90, 50));
        let mut t = 0;
        assert_eq!(feed(&mut fit, &mut t, &reported(3, 3)), Step::QualityDown);
        // The queue is still draining: the others report it once more.
        assert_eq!(feed(&mut fit, &mut t, &reported(2, 2)), Step::Hold);
        // A window later it counts again.
        assert_eq!(feed(&mut fit, &mut t, &reported(1, 1)), Step::QualityDown);
        assert_eq!(fit.quality(), Some(70));
        // Its own frames reset and queued count whatever came before.
        assert_eq!(feed(&mut fit, &mut t, &jammed()), Step::QualityDown);
    }

    #[test]
    fn a_swollen_round_trip_holds_raises_back_without_pressing() {
        let fit = LinkFit::new(jpeg(90, 50));
        let swollen = |extra_ms: u64| {
            let mut w = window(21);
            if let Some(p) = w.path.as_mut() {
                p.rtt = p.min_rtt + Duration::from_millis(extra_ms);
            }
            w
        };
        // 15 % of 80 ms.
        assert_eq!(fit.verdict(&swollen(12)), Verdict::Clean);
        assert_eq!(fit.verdict(&swollen(13)), Verdict::Fair);
        assert_eq!(fit.verdict(&swollen(200)), Verdict::Fair);
    }

    /// A round trip that rises by more than 15 % of the budget in a window,
    /// to more than a quarter of it above its least, is a queue filling:
    /// pressed (the quality down, and it tells the connection's other
    /// cameras), before the frames go late. One that stays high, however
    /// high, is not.
    #[test]
    fn a_round_trip_rising_into_a_queue_presses_one_that_stays_high_does_not() {
        let mut fit = LinkFit::new(jpeg(90, 50));
        let at = |extra_ms: u64| {
            let mut w = window(21);
            if let Some(p) = w.path.as_mut() {
                p.rtt = p.min_rtt + Duration::from_millis(extra_ms);
            }
            w
        };
        let mut t = 0;
        assert_eq!(feed(&mut fit, &mut t, &at(10)), Step::Hold);
        // Up 12 ms (not more than 15 % of 80) to 22 ms above the least.
        assert_eq!(feed(&mut fit, &mut t, &at(22)), Step::Hold);
        // Up 13 ms, but to 35 ms: pressed.
        let d = {
            t += WINDOW.as_micros() as u64;
            fit.on_window(t, &at(35))
        };
        assert_eq!(
            d.verdict,
            Verdict::Pressed(Pressure {
                swelling: true,
                ..Pressure::default()
            })
        );
        assert_eq!((d.step, d.report), (Step::QualityDown, Some(true)));
        // It stays at 35 ms, then jitters within it: no pressure.
        for extra in [35, 30, 36, 33] {
            t += WINDOW.as_micros() as u64;
            let v = fit.on_window(t, &at(extra)).verdict;
            assert!(!matches!(v, Verdict::Pressed(_)), "{extra}: {v:?}");
        }
        // Up 13 ms, but only to 20 ms above the least: not yet a queue.
        let mut fit = LinkFit::new(jpeg(90, 50));
        feed(&mut fit, &mut t, &at(7));
        assert_eq!(feed(&mut fit, &mut t, &at(20)), Step::Hold);
    }

    #[test]
    fn at_the_floor_only_a_queue_elsewhere_lowers_the_rate() {
        let mut fit = LinkFit::new(jpeg(50, 50));
        let mut t = 0;
        // Resets elsewhere (random loss): fewer frames would not help.
        assert_eq!(feed(&mut fit, &mut t, &reported(2, 0)), Step::Hold);
        assert_eq!(fit.max_fps(), 10.0);
        // A queue elsewhere: the link is full, every camera sends less.
        assert_eq!(feed(&mut fit, &mut t, &reported(2, 1)), Step::RateDown);
        assert!(fit.max_fps() < 10.0);
    }

    #[test]
    fn a_window_with_nothing_sent_or_received_is_idle() {
        let fit = LinkFit::new(jpeg(90, 50));
        assert_eq!(fit.verdict(&WindowStats::default()), Verdict::Idle);
    }

    #[test]
    fn late_results_press_even_when_the_wire_looks_fine() {
        let fit = LinkFit::new(jpeg(90, 50));
        let mut w = window(30);
        w.results = 10;
        w.late = 2;
        assert!(matches!(
            fit.verdict(&w),
            Verdict::Pressed(Pressure { late: true, .. })
        ));
    }

    /// Ten frames handed in a second, every one evicted by newer frames
    /// before it got across.
    fn jammed() -> WindowStats {
        WindowStats {
            handed: 10,
            superseded: 10,
            bytes: 88_000,
            path: path(20),
            ..WindowStats::default()
        }
    }

    /// Feeds `w` once a second from `*t`; returns the step taken.
    fn feed(fit: &mut LinkFit, t: &mut u64, w: &WindowStats) -> Step {
        *t += 1_000_000;
        fit.on_window(*t, w).step
    }

    #[test]
    fn resets_lower_the_quality_to_its_floor_before_the_rate() {
        let mut fit = LinkFit::new(jpeg(90, 50));
        let mut t = 0;
        let mut qualities = Vec::new();
        for _ in 0..4 {
            assert_eq!(feed(&mut fit, &mut t, &jammed()), Step::QualityDown);
            assert_eq!(fit.max_fps(), 10.0, "the rate waits for the floor");
            qualities.push(fit.quality().unwrap());
        }
        assert_eq!(qualities, [80, 70, 60, 50]);
        assert_eq!(feed(&mut fit, &mut t, &jammed()), Step::RateDown);
        assert_eq!(fit.quality(), Some(50));
        // 70 % of the 10 fps sent.
        assert!((fit.max_fps() - 7.0).abs() < 1e-9, "{}", fit.max_fps());
        for _ in 0..50 {
            feed(&mut fit, &mut t, &jammed());
        }
        assert_eq!(fit.max_fps(), RATE_FLOOR_FPS, "never below the floor");
        assert_eq!(feed(&mut fit, &mut t, &jammed()), Step::Hold);
    }

    #[test]
    fn resets_alone_at_the_floor_hold_the_rate() {
        let mut fit = LinkFit::new(jpeg(60, 50));
        let mut t = 0;
        // Two frames in ten lost to random loss; the rest arrive promptly.
        let lossy = WindowStats {
            expired: 2,
            delivered: 8,
            ack_us: 8 * 25_000,
            ..window(25)
        };
        assert_eq!(feed(&mut fit, &mut t, &lossy), Step::QualityDown);
        assert_eq!(fit.quality(), Some(50));
        for _ in 0..5 {
            assert_eq!(feed(&mut fit, &mut t, &lossy), Step::Hold);
        }
        assert_eq!(fit.max_fps(), 10.0);
    }

    #[test]
    fn clean_windows_bring_the_rate_back_before_the_quality_three_windows_a_step() {
        let mut fit = LinkFit::new(jpeg(90, 50));
        let mut t = 0;
        for _ in 0..6 {
            feed(&mut fit, &mut t, &jammed());
        }
        assert_eq!((fit.quality(), fit.max_fps() < 10.0), (Some(50), true));
        let mut steps = Vec::new();
        for _ in 0..60 {
            steps.push(feed(&mut fit, &mut t, &window(21)));
        }
        let raises: Vec<(usize, Step)> = steps
            .iter()
            .copied()
            .enumerate()
            .filter(|(_, s)| *s != Step::Hold)
            .collect();
        // Every third clean window raises one knob: the rate until it is
        // back, then the quality, 5 points at a time.
        for (n, (i, _)) in raises.iter().enumerate() {
            assert_eq!(*i, 3 * n + 2, "{raises:?}");
        }
        let first_quality = raises
            .iter()
            .position(|(_, s)| *s == Step::QualityUp)
            .unwrap();
        assert!(first_quality > 0);
        assert!(
            raises[..first_quality]
                .iter()
                .all(|(_, s)| *s == Step::RateUp)
        );
        assert!(
            raises[first_quality..]
                .iter()
                .all(|(_, s)| *s == Step::QualityUp)
        );
        assert_eq!(raises.len() - first_quality, 8, "50 to 90 by 5");
        assert_eq!((fit.quality(), fit.max_fps()), (Some(90), 10.0));
    }

    /// Feeds clean windows until one raises; returns how many it took.
    fn clean_until_raise(fit: &mut LinkFit, t: &mut u64) -> u32 {
        for n in 1..=100 {
            if feed(fit, t, &window(21)) != Step::Hold {
                return n;
            }
        }
        panic!("no raise in 100 clean windows");
    }

    #[test]
    fn a_raise_followed_by_pressure_doubles_the_clean_windows_the_next_needs() {
        let mut fit = LinkFit::new(jpeg(90, 50));
        let mut t = 0;
        feed(&mut fit, &mut t, &jammed());
        assert_eq!(fit.quality(), Some(80));
        // The clean windows a raise needs, then the wait for the camera's
        // slot.
        let took = clean_until_raise(&mut fit, &mut t);
        assert!((CLEAN_TO_RAISE..CLEAN_TO_RAISE + STAGGER).contains(&took));
        assert_eq!(fit.quality(), Some(85));
        // The link could not take it.
        assert_eq!(feed(&mut fit, &mut t, &jammed()), Step::QualityDown);
        assert_eq!(fit.clean_needed(), 2 * CLEAN_TO_RAISE);
        let took = clean_until_raise(&mut fit, &mut t);
        assert!((2 * CLEAN_TO_RAISE..2 * CLEAN_TO_RAISE + STAGGER).contains(&took));
        // This one holds through its probation: raises get quicker again.
        for _ in 0..PROBATION {
            feed(&mut fit, &mut t, &window(21));
        }
        assert_eq!(fit.clean_needed(), CLEAN_TO_RAISE);
    }

    #[test]
    fn idle_windows_change_nothing_and_keep_the_clean_count() {
        let mut fit = LinkFit::new(jpeg(90, 50));
        let mut t = 0;
        feed(&mut fit, &mut t, &jammed());
        feed(&mut fit, &mut t, &window(21));
        feed(&mut fit, &mut t, &window(21));
        for _ in 0..10 {
            assert_eq!(feed(&mut fit, &mut t, &WindowStats::default()), Step::Hold);
        }
        // The third clean window: the raise waits only for the camera's
        // slot.
        let took = clean_until_raise(&mut fit, &mut t);
        assert!(took <= STAGGER, "{took}");
    }

    #[test]
    fn cameras_in_different_slots_never_raise_in_the_same_window() {
        let mut fits: Vec<LinkFit> = (0..STAGGER)
            .map(|phase| {
                LinkFit::new(FitConfig {
                    phase,
                    ..jpeg(90, 50)
                })
            })
            .collect();
        let mut t = 0;
        for fit in &mut fits {
            let mut t0 = t;
            feed(fit, &mut t0, &jammed());
        }
        t += 1_000_000;
        for _ in 0..40 {
            t += 1_000_000;
            let raised = fits
                .iter_mut()
                .map(|f| f.on_window(t, &window(21)).step)
                .filter(|s| *s != Step::Hold)
                .count();
            assert!(raised <= 1, "{raised} cameras raised together");
        }
        // And each got back to the top.
        assert!(fits.iter().all(|f| f.quality() == Some(90)));
    }

    #[test]
    fn slow_start_climbs_from_the_floor_a_big_step_a_slot_until_pressed() {
        let mut fit = LinkFit::new(FitConfig {
            slow_start: true,
            ..jpeg(90, 50)
        });
        assert_eq!(fit.quality(), Some(50));
        assert!(fit.in_slow_start());
        let mut t = 0;
        let took = clean_until_raise(&mut fit, &mut t);
        assert!(took <= STAGGER);
        assert_eq!(fit.quality(), Some(50 + SLOW_START_UP));
        let took = clean_until_raise(&mut fit, &mut t);
        assert_eq!(took, STAGGER, "one raise a slot");
        assert_eq!(fit.quality(), Some(50 + 2 * SLOW_START_UP));
        // The first pressed window ends it: from now on raises are small
        // and need three clean windows.
        assert_eq!(feed(&mut fit, &mut t, &jammed()), Step::QualityDown);
        assert!(!fit.in_slow_start());
        assert_eq!(fit.quality(), Some(60));
        let took = clean_until_raise(&mut fit, &mut t);
        assert!(took >= 2 * CLEAN_TO_RAISE, "{took}: on probation");
        assert_eq!(fit.quality(), Some(60 + QUALITY_UP));
    }

    /// Another camera's pressed window (its results late) ends this one's
    /// slow start without lowering its quality: it goes on climbing, in
    /// small steps after three clean windows.
    #[test]
    fn another_cameras_pressed_window_ends_slow_start_for_the_whole_link() {
        let mut fit = LinkFit::new(FitConfig {
            slow_start: true,
            ..jpeg(90, 50)
        });
        let mut t = 0;
        clean_until_raise(&mut fit, &mut t);
        assert_eq!(fit.quality(), Some(50 + SLOW_START_UP));
        let mut w = window(21);
        if let Some(p) = w.path.as_mut() {
            p.slow_start_over = true;
        }
        t += WINDOW.as_micros() as u64;
        assert_eq!(fit.on_window(t, &w).step, Step::Hold, "clean, not pressed");
        assert!(!fit.in_slow_start());
        assert_eq!(fit.quality(), Some(60));
        let mut raised = None;
        for _ in 0..4 * STAGGER {
            t += WINDOW.as_micros() as u64;
            if fit.on_window(t, &w).step != Step::Hold {
                raised = fit.quality();
                break;
            }
        }
        assert_eq!(raised, Some(60 + QUALITY_UP), "a small step");
    }

    #[test]
    fn a_camera_that_does_not_adapt_or_has_no_range_starts_at_the_top() {
        let fit = LinkFit::new(FitConfig {
            slow_start: true,
            ..jpeg(75, 75)
        });
        assert_eq!(fit.quality(), Some(75));
        assert!(!fit.in_slow_start());
    }

    #[test]
    fn slots_spread_camera_names() {
        let mut seen = [0u32; STAGGER as usize];
        for i in 0..48 {
            seen[phase_of(&format!("cam-{i}")) as usize] += 1;
        }
        assert!(seen.iter().all(|&n| n >= 8), "{seen:?}");
        assert_eq!(phase_of("cam-1"), phase_of("cam-1"));
    }

    #[test]
    fn without_a_quality_knob_pressure_goes_straight_to_the_rate() {
        let mut fit = LinkFit::new(FitConfig {
            quality: None,
            ..jpeg(90, 50)
        });
        let mut t = 0;
        assert_eq!(feed(&mut fit, &mut t, &jammed()), Step::RateDown);
        assert_eq!(fit.quality(), None);
    }

    #[test]
    fn the_rate_comes_down_from_what_was_sent_not_from_the_cap() {
        let mut fit = LinkFit::new(jpeg(50, 50));
        let mut t = 0;
        // A hint of 3 fps: the cap of 10 is far above what goes.
        let w = WindowStats {
            handed: 3,
            superseded: 3,
            ..jammed()
        };
        assert_eq!(feed(&mut fit, &mut t, &w), Step::RateDown);
        assert!((fit.max_fps() - 2.1).abs() < 1e-9, "{}", fit.max_fps());
    }

    #[test]
    fn the_meter_restarts_path_counters_on_a_new_connection() {
        let mut m = WindowMeter::default();
        let p = |sent, lost| PathStats {
            sent_packets: sent,
            lost_packets: lost,
            ..PathStats::default()
        };
        let t = Totals {
            handed: 5,
            ..Totals::default()
        };
        let w = m.window(t, Some(p(100, 2)));
        assert_eq!(w.handed, 5);
        assert_eq!(w.path.unwrap().sent_packets, 100);
        let w = m.window(
            Totals {
                handed: 12,
                ..Totals::default()
            },
            Some(p(150, 3)),
        );
        assert_eq!((w.handed, w.path.unwrap().sent_packets), (7, 50));
        assert_eq!(w.path.unwrap().lost_packets, 1);
        // A new connection: its counters start from zero.
        let w = m.window(
            Totals {
                handed: 12,
                ..Totals::default()
            },
            Some(p(20, 0)),
        );
        assert_eq!((w.handed, w.path.unwrap().sent_packets), (0, 20));
        assert!(m.window(t, None).path.is_none());
    }
}
