//! Which captured frames are worth sending: a frame-rate cap, a motion gate
//! with a keep-alive rate, and the policy that folds the gateway's
//! [`ControlHint`](tidegate_protocol::ControlHint) into the camera's
//! configured limits.
//!
//! Everything here is pure and takes `now` from the caller (µs on any
//! monotonic clock), so it is tested without sleeping. The capture pipeline
//! runs [`FrameGate::decide`] in its appsink callback, before the frame is
//! copied: a skipped frame costs one small greyscale thumbnail at most.

/// Side of the square greyscale thumbnail the motion gate compares.
pub const THUMB_SIDE: usize = 32;
/// Thumbnail cells (`THUMB_SIDE²`).
pub const THUMB_CELLS: usize = THUMB_SIDE * THUMB_SIDE;
/// A thumbnail cell counts as changed when its mean grey level moved by more
/// than this (0–255). Above sensor noise after block averaging, below any
/// real object moving through the cell.
pub const PIXEL_DELTA: u8 = 12;

/// A frame-rate cap as a generic cell rate algorithm (GCRA): a frame
/// conforms when it arrives no earlier than half an interval before its
/// theoretical time. A source running exactly at the cap passes every frame
/// despite jitter; a faster one is thinned to the cap over any window, with at
/// most one extra frame of burst.
#[derive(Debug, Clone, PartialEq)]
pub struct RateLimiter {
    interval_us: u64,
    /// Theoretical arrival time of the next conforming frame.
    tat_us: Option<u64>,
}

impl RateLimiter {
    /// A limiter for `max_fps` frames per second. A non-positive or
    /// non-finite rate, or one below one frame an hour, allows one frame an
    /// hour ([`SLOWEST_INTERVAL_US`]).
    pub fn new(max_fps: f64) -> Self {
        RateLimiter {
            interval_us: interval_us(max_fps),
            tat_us: None,
        }
    }

    /// Changes the cap, keeping the schedule of the last frame sent: the
    /// next frame is due one new interval after it. Raised from a frame
    /// every two seconds (a camera's adaptation during an outage) to ten a
    /// second, the camera sends again within a tenth of a second, not when
    /// the slow schedule's next frame would have been due.
    pub fn set_max_fps(&mut self, max_fps: f64) {
        let interval = interval_us(max_fps);
        if let Some(tat) = self.tat_us.as_mut() {
            *tat = tat
                .saturating_sub(self.interval_us)
                .saturating_add(interval);
        }
        self.interval_us = interval;
    }

    /// Whether a frame at `now_us` would conform. Does not consume anything.
    pub fn allows(&self, now_us: u64) -> bool {
        match self.tat_us {
            None => true,
            Some(tat) => now_us.saturating_add(self.interval_us / 2) >= tat,
        }
    }

    /// Records that a frame was sent at `now_us`.
    pub fn commit(&mut self, now_us: u64) {
        let tat = self.tat_us.unwrap_or(now_us).max(now_us);
        self.tat_us = Some(tat.saturating_add(self.interval_us));
    }
}

/// The longest interval a rate means: one frame an hour (µs). Slower rates,
/// and rates that are not positive numbers, are clamped to it.
pub const SLOWEST_INTERVAL_US: u64 = 3_600_000_000;

fn interval_us(max_fps: f64) -> u64 {
    if max_fps.is_finite() && max_fps > 0.0 {
        // A tiny rate (a hint of 1e-20 fps) would be an interval of
        // centuries, or saturate to u64::MAX: clamp it to the floor.
        (1e6 / max_fps)
            .round()
            .clamp(1.0, SLOWEST_INTERVAL_US as f64) as u64
    } else {
        SLOWEST_INTERVAL_US
    }
}

/// A greyscale thumbnail of a frame: `THUMB_SIDE`×`THUMB_SIDE` cell means.
pub type Thumb = [u8; THUMB_CELLS];

/// Builds the thumbnail of a packed or padded RGB image by averaging each
/// cell on a sparse grid (at most 4×4 samples a cell), so its cost does not
/// grow with the frame size.
pub fn thumbnail(plane: &[u8], stride: usize, width: usize, height: usize) -> Option<Thumb> {
    if width == 0
        || height == 0
        || stride < width * 3
        || plane.len() < (height - 1) * stride + width * 3
    {
        return None;
    }
    let mut out = [0u8; THUMB_CELLS];
    for cy in 0..THUMB_SIDE {
        let y0 = cy * height / THUMB_SIDE;
        let y1 = ((cy + 1) * height / THUMB_SIDE).max(y0 + 1).min(height);
        let ystep = ((y1 - y0) / 4).max(1);
        for cx in 0..THUMB_SIDE {
            let x0 = cx * width / THUMB_SIDE;
            let x1 = ((cx + 1) * width / THUMB_SIDE).max(x0 + 1).min(width);
            let xstep = ((x1 - x0) / 4).max(1);
            let (mut sum, mut n) = (0u32, 0u32);
            for y in (y0..y1).step_by(ystep) {
                let row = &plane[y * stride..];
                for x in (x0..x1).step_by(xstep) {
                    let p = &row[x * 3..x * 3 + 3];
                    // BT.601 luma in fixed point.
                    sum += (77 * p[0] as u32 + 150 * p[1] as u32 + 29 * p[2] as u32) >> 8;
                    n += 1;
                }
            }
            out[cy * THUMB_SIDE + cx] = (sum / n.max(1)) as u8;
        }
    }
    Some(out)
}

/// Fraction (0–1) of thumbnail cells whose grey level moved by more than
/// [`PIXEL_DELTA`].
pub fn changed_fraction(a: &Thumb, b: &Thumb) -> f64 {
    let changed = a
        .iter()
        .zip(b.iter())
        .filter(|(x, y)| x.abs_diff(**y) > PIXEL_DELTA)
        .count();
    changed as f64 / THUMB_CELLS as f64
}

/// A camera's own limits, from its configuration.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CameraLimits {
    /// Frame-rate cap.
    pub max_fps: f64,
    /// Motion threshold: the fraction of changed thumbnail cells that makes a
    /// frame worth sending; 0 turns the gate off.
    pub motion_threshold: f64,
    /// Least frames per second sent from a static scene (keep-alive); 0
    /// sends nothing while the scene stays still.
    pub keepalive_fps: f64,
}

/// The gateway's limits for a camera: its latest `ControlHint` for it,
/// without the name.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct GatewayLimits {
    /// Cap from the gateway; 0 = no cap of its own.
    pub max_fps: f64,
    /// Threshold from the gateway; 0 = none of its own.
    pub motion_threshold: f64,
}

impl CameraLimits {
    /// The limits in force under `hint` (the latest one replaces any
    /// earlier): the lower cap and the higher threshold, each only where the
    /// hint sets a positive value.
    pub fn under_gateway(self, hint: Option<GatewayLimits>) -> CameraLimits {
        let Some(h) = hint else { return self };
        let pos = |v: f64| v.is_finite() && v > 0.0;
        CameraLimits {
            max_fps: if pos(h.max_fps) {
                self.max_fps.min(h.max_fps)
            } else {
                self.max_fps
            },
            motion_threshold: if pos(h.motion_threshold) {
                self.motion_threshold.max(h.motion_threshold.min(1.0))
            } else {
                self.motion_threshold
            },
            keepalive_fps: self.keepalive_fps,
        }
    }
}

impl CameraLimits {
    /// These limits under a further rate cap (the edge's own adaptation to
    /// its uplink): the stricter cap wins. A cap that is not a positive
    /// number changes nothing.
    pub fn with_rate_cap(self, max_fps: f64) -> CameraLimits {
        if max_fps.is_finite() && max_fps > 0.0 {
            CameraLimits {
                max_fps: self.max_fps.min(max_fps),
                ..self
            }
        } else {
            self
        }
    }
}

/// What the gate did with one frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Send it.
    Send,
    /// Over the frame-rate cap.
    SkipRate,
    /// The scene did not change enough, and the keep-alive is not due.
    SkipStatic,
}

/// Counts of [`Decision`]s.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GateCounts {
    /// Frames sent.
    pub sent: u64,
    /// Frames skipped by the rate cap.
    pub skipped_rate: u64,
    /// Frames skipped by the motion gate.
    pub skipped_static: u64,
}

/// Rate cap, motion gate and keep-alive for one camera.
#[derive(Debug, Clone)]
pub struct FrameGate {
    limits: CameraLimits,
    rate: RateLimiter,
    /// Thumbnail of the last frame sent: motion is measured against it, so a
    /// slow drift adds up until it is worth a frame.
    reference: Option<Box<Thumb>>,
    last_sent_us: Option<u64>,
    /// Time of the last frame decided on: a clock that goes back (a
    /// restarted or looped stream) starts the rate and keep-alive anew.
    last_seen_us: Option<u64>,
    counts: GateCounts,
}

impl FrameGate {
    /// A gate enforcing `limits`.
    pub fn new(limits: CameraLimits) -> Self {
        FrameGate {
            limits,
            rate: RateLimiter::new(limits.max_fps),
            reference: None,
            last_sent_us: None,
            last_seen_us: None,
            counts: GateCounts::default(),
        }
    }

    /// The limits in force.
    pub fn limits(&self) -> CameraLimits {
        self.limits
    }

    /// Replaces the limits from the next frame on.
    pub fn set_limits(&mut self, limits: CameraLimits) {
        self.limits = limits;
        self.rate.set_max_fps(limits.max_fps);
    }

    /// Whether the motion gate is on (and so needs a thumbnail).
    pub fn wants_thumbnail(&self) -> bool {
        self.limits.motion_threshold > 0.0
    }

    /// Whether the rate cap lets a frame through at `now_us`; callers skip
    /// building the thumbnail when it does not.
    pub fn rate_allows(&self, now_us: u64) -> bool {
        self.went_back(now_us) || self.rate.allows(now_us)
    }

    fn went_back(&self, now_us: u64) -> bool {
        self.last_seen_us.is_some_and(|t| now_us < t)
    }

    /// Decides about the frame that arrived at `now_us`. `thumb` is needed
    /// only when [`FrameGate::wants_thumbnail`]; without one the motion gate
    /// lets the frame through.
    pub fn decide(&mut self, now_us: u64, thumb: Option<&Thumb>) -> Decision {
        if self.went_back(now_us) {
            self.rate = RateLimiter::new(self.limits.max_fps);
            self.last_sent_us = None;
        }
        self.last_seen_us = Some(now_us);
        if !self.rate.allows(now_us) {
            self.counts.skipped_rate += 1;
            return Decision::SkipRate;
        }
        let threshold = self.limits.motion_threshold;
        if threshold > 0.0
            && let (Some(thumb), Some(reference)) = (thumb, self.reference.as_deref())
        {
            let keepalive_due = self.limits.keepalive_fps > 0.0
                && self.last_sent_us.is_none_or(|t| {
                    now_us.saturating_sub(t) >= interval_us(self.limits.keepalive_fps)
                });
            if changed_fraction(reference, thumb) < threshold && !keepalive_due {
                self.counts.skipped_static += 1;
                return Decision::SkipStatic;
            }
        }
        self.rate.commit(now_us);
        self.last_sent_us = Some(now_us);
        if let Some(thumb) = thumb {
            self.reference = Some(Box::new(*thumb));
        }
        self.counts.sent += 1;
        Decision::Send
    }

    /// Decisions so far.
    pub fn counts(&self) -> GateCounts {
        self.counts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1000;

    fn limits(max_fps: f64, motion_threshold: f64, keepalive_fps: f64) -> CameraLimits {
        CameraLimits {
            max_fps,
            motion_threshold,
            keepalive_fps,
        }
    }

    /// Runs a source at `source_fps` for `secs` through the limiter, with up
    /// to `jitter_us` of deterministic jitter; returns (passed, produced).
    fn run_source(max_fps: f64, source_fps: f64, secs: u64, jitter_us: u64) -> (u64, u64) {
        let mut r = RateLimiter::new(max_fps);
        let period = (1e6 / source_fps) as u64;
        let mut n = 0;
        let mut t = 1_000_000u64;
        let end = t + secs * 1_000_000;
        let mut i = 0u64;
        while t < end {
            let jitter = (i * 7919) % (jitter_us + 1);
            let now = t + jitter;
            if r.allows(now) {
                r.commit(now);
                n += 1;
            }
            t += period;
            i += 1;
        }
        (n, i)
    }

    fn passed(max_fps: f64, source_fps: f64, secs: u64, jitter_us: u64) -> u64 {
        run_source(max_fps, source_fps, secs, jitter_us).0
    }

    #[test]
    fn source_at_the_cap_passes_every_frame_despite_jitter() {
        for (fps, jitter) in [(10.0, 30 * MS), (15.0, 20 * MS), (30.0, 10 * MS)] {
            let (passed, produced) = run_source(fps, fps, 10, jitter);
            assert_eq!(passed, produced, "{fps} fps");
            assert!(produced >= (fps * 10.0) as u64);
        }
    }

    #[test]
    fn faster_source_is_thinned_to_the_cap() {
        let n = passed(5.0, 30.0, 10, 5 * MS);
        assert!((50..=52).contains(&n), "{n} frames in 10 s at a 5 fps cap");
        let n = passed(1.0, 25.0, 20, 0);
        assert!((20..=21).contains(&n), "{n}");
    }

    #[test]
    fn rate_never_exceeds_the_cap_over_any_window() {
        // Property over many source rates and caps: in every 1 s window the
        // count is at most cap + 1 (the GCRA burst).
        for cap in [1.0, 2.5, 7.0, 10.0, 30.0] {
            for source in [3.0, 10.0, 29.97, 60.0, 120.0] {
                let mut r = RateLimiter::new(cap);
                let period = (1e6_f64 / source) as u64;
                let mut sent = Vec::new();
                for i in 0..(source as u64 * 5) {
                    let now = i * period;
                    if r.allows(now) {
                        r.commit(now);
                        sent.push(now);
                    }
                }
                for (i, &t) in sent.iter().enumerate() {
                    let in_window = sent[i..].iter().take_while(|&&u| u < t + 1_000_000).count();
                    assert!(
                        in_window as f64 <= cap.ceil() + 1.0,
                        "cap {cap}, source {source}: {in_window} frames in 1 s"
                    );
                }
            }
        }
    }

    #[test]
    fn a_tiny_rate_is_clamped_to_one_frame_an_hour_without_overflow() {
        let hour = SLOWEST_INTERVAL_US;
        for tiny in [1e-20, f64::from(f32::MIN_POSITIVE), 1e-300, 1.0 / 7200.0] {
            assert_eq!(interval_us(tiny), hour, "{tiny}");
            let mut r = RateLimiter::new(tiny);
            assert!(r.allows(0));
            r.commit(0);
            assert!(!r.allows(hour / 2 - 1), "{tiny}");
            assert!(r.allows(hour / 2), "{tiny}");
            // Near the end of the clock nothing overflows: the schedule
            // saturates instead.
            r.commit(u64::MAX - 10);
            assert!(r.allows(u64::MAX));
            r.commit(u64::MAX);
            assert!(!r.allows(u64::MAX - hour));
        }
        // A gate under such a hint (as the gateway's f32 sends it) sends the
        // first frame, then one an hour, on the stream clock.
        let mut g = FrameGate::new(limits(30.0, 0.0, 0.0));
        g.set_limits(limits(10.0, 0.0, 0.0).under_gateway(Some(GatewayLimits {
            max_fps: f64::from(f32::MIN_POSITIVE),
            motion_threshold: 0.0,
        })));
        assert_eq!(g.decide(0, None), Decision::Send);
        assert_eq!(g.decide(1_000_000, None), Decision::SkipRate);
        assert_eq!(g.decide(hour, None), Decision::Send);
        assert_eq!(g.counts().sent, 2);
        // Rates at or above the floor keep their own interval.
        assert_eq!(interval_us(1.0 / 3600.0), hour);
        assert_eq!(interval_us(1.0 / 1800.0), hour / 2);
        assert_eq!(interval_us(1e9), 1);
    }

    #[test]
    fn lowering_the_cap_applies_to_the_next_frame() {
        let mut r = RateLimiter::new(10.0);
        r.commit(0);
        assert!(r.allows(100 * MS));
        r.set_max_fps(2.0);
        // The next frame is due 500 ms after the last one; with half an
        // interval (250 ms) of tolerance it may come at 250 ms, not before.
        assert!(!r.allows(100 * MS));
        assert!(!r.allows(240 * MS));
        assert!(r.allows(250 * MS));
        // Sent early, within the tolerance: the schedule stays, the next is
        // due at 1 s (750 ms with the tolerance).
        r.commit(250 * MS);
        assert!(!r.allows(740 * MS));
        assert!(r.allows(750 * MS));
    }

    #[test]
    fn raising_the_cap_applies_to_the_next_frame() {
        let mut r = RateLimiter::new(0.5);
        r.commit(0);
        // At a frame every two seconds the next is due at 2 s (1 s with the
        // tolerance).
        assert!(!r.allows(200 * MS));
        r.set_max_fps(10.0);
        // At ten a second it is due at 100 ms.
        assert!(!r.allows(40 * MS));
        assert!(r.allows(50 * MS));
        r.commit(100 * MS);
        assert!(!r.allows(140 * MS));
        assert!(r.allows(150 * MS));
    }

    #[test]
    fn hint_lowers_the_cap_and_raises_the_threshold_but_never_the_reverse() {
        let cfg = limits(10.0, 0.02, 0.5);
        let h = |max_fps, motion_threshold| {
            Some(GatewayLimits {
                max_fps,
                motion_threshold,
            })
        };
        assert_eq!(cfg.under_gateway(None), cfg);
        assert_eq!(cfg.under_gateway(h(4.0, 0.0)), limits(4.0, 0.02, 0.5));
        assert_eq!(
            cfg.under_gateway(h(25.0, 0.0)),
            cfg,
            "a hint cannot raise the cap"
        );
        assert_eq!(cfg.under_gateway(h(0.0, 0.1)), limits(10.0, 0.1, 0.5));
        assert_eq!(
            cfg.under_gateway(h(0.0, 0.01)),
            cfg,
            "a hint cannot lower the threshold"
        );
        assert_eq!(cfg.under_gateway(h(0.0, 0.0)), cfg, "zeros mean no hint");
        assert_eq!(cfg.under_gateway(h(f64::NAN, -1.0)), cfg);
        assert_eq!(cfg.under_gateway(h(2.0, 7.0)), limits(2.0, 1.0, 0.5));
    }

    fn flat(v: u8) -> Thumb {
        [v; THUMB_CELLS]
    }

    fn with_block(v: u8, cells: usize) -> Thumb {
        let mut t = flat(0);
        t[..cells].fill(v);
        t
    }

    #[test]
    fn static_scene_sends_only_the_first_frame_and_keepalives() {
        let mut g = FrameGate::new(limits(10.0, 0.01, 0.5));
        let still = flat(80);
        let mut sent = Vec::new();
        for i in 0..100u64 {
            let now = i * 100 * MS; // 10 s at 10 fps
            if g.decide(now, Some(&still)) == Decision::Send {
                sent.push(now);
            }
        }
        // First frame, then one every 2 s.
        assert_eq!(sent, vec![0, 2_000_000, 4_000_000, 6_000_000, 8_000_000]);
        assert_eq!(g.counts().skipped_static, 95);
        assert_eq!(g.counts().skipped_rate, 0);
    }

    #[test]
    fn moving_scene_sends_at_the_cap() {
        let mut g = FrameGate::new(limits(5.0, 0.01, 0.5));
        let mut sent = 0;
        for i in 0..300u64 {
            // 30 fps source; a 20-cell block (2 %) moves every frame.
            let mut thumb = flat(0);
            let at = (i as usize * 20) % (THUMB_CELLS - 20);
            thumb[at..at + 20].fill(200);
            if g.decide(i * 33_333, Some(&thumb)) == Decision::Send {
                sent += 1;
            }
        }
        assert!((50..=51).contains(&sent), "{sent} frames in 10 s at 5 fps");
        assert_eq!(g.counts().skipped_static, 0);
    }

    #[test]
    fn slow_drift_adds_up_against_the_last_frame_sent() {
        let mut g = FrameGate::new(limits(100.0, 0.5, 0.0));
        let mut sends = 0;
        // Each step moves every cell by 5 grey levels: under PIXEL_DELTA from
        // one frame to the next, over it after three steps.
        for i in 0..13u64 {
            if g.decide(i * 100 * MS, Some(&flat((i * 5) as u8))) == Decision::Send {
                sends += 1;
            }
        }
        assert_eq!(sends, 1 + 4, "first frame, then every third step");
    }

    #[test]
    fn zero_threshold_turns_the_gate_off_and_keepalive_zero_means_silence() {
        let mut g = FrameGate::new(limits(10.0, 0.0, 0.0));
        assert!(!g.wants_thumbnail());
        assert_eq!(g.decide(0, None), Decision::Send);
        let mut g = FrameGate::new(limits(10.0, 0.1, 0.0));
        let still = flat(1);
        assert_eq!(g.decide(0, Some(&still)), Decision::Send);
        for i in 1..600u64 {
            assert_eq!(g.decide(i * 100 * MS, Some(&still)), Decision::SkipStatic);
        }
    }

    #[test]
    fn raising_the_threshold_live_silences_a_small_motion() {
        let mut g = FrameGate::new(limits(10.0, 0.01, 0.0));
        assert_eq!(g.decide(0, Some(&with_block(0, 30))), Decision::Send);
        assert_eq!(
            g.decide(100 * MS, Some(&with_block(200, 30))),
            Decision::Send
        );
        g.set_limits(limits(10.0, 0.05, 0.0));
        assert_eq!(
            g.decide(200 * MS, Some(&with_block(0, 30))),
            Decision::SkipStatic,
            "30 of 1024 cells is under 5 %"
        );
    }

    #[test]
    fn thumbnail_averages_cells_and_ignores_row_padding() {
        // 64×64 RGB, stride padded to 200 bytes; left half white, right black;
        // padding bytes are 0xFF and must not leak in.
        let (w, h, stride) = (64usize, 64usize, 200usize);
        let mut plane = vec![0xFFu8; stride * h];
        for y in 0..h {
            for x in 0..w {
                let v = if x < w / 2 { 255 } else { 0 };
                plane[y * stride + x * 3..y * stride + x * 3 + 3].fill(v);
            }
        }
        let t = thumbnail(&plane, stride, w, h).unwrap();
        for cy in 0..THUMB_SIDE {
            for cx in 0..THUMB_SIDE {
                let want = if cx < THUMB_SIDE / 2 { 255 } else { 0 };
                assert!(
                    t[cy * THUMB_SIDE + cx].abs_diff(want) <= 1,
                    "cell {cx},{cy}"
                );
            }
        }
        assert!(thumbnail(&plane[..100], stride, w, h).is_none());
        assert!(thumbnail(&plane, 10, w, h).is_none());
        assert_eq!(changed_fraction(&t, &t), 0.0);
        assert_eq!(changed_fraction(&flat(0), &flat(255)), 1.0);
    }

    #[test]
    fn thumbnail_of_a_frame_smaller_than_the_grid_still_covers_it() {
        let plane = vec![100u8; 5 * 3 * 7];
        let t = thumbnail(&plane, 15, 5, 7).unwrap();
        assert!(t.iter().all(|&v| v.abs_diff(100) <= 1));
    }

    #[test]
    fn a_clock_that_goes_back_starts_the_cap_anew() {
        let mut g = FrameGate::new(limits(10.0, 0.0, 0.0));
        assert_eq!(g.decide(5_000 * MS, None), Decision::Send);
        assert_eq!(g.decide(5_010 * MS, None), Decision::SkipRate);
        // the stream restarted: its clock is back at zero
        assert!(g.rate_allows(0));
        assert_eq!(g.decide(0, None), Decision::Send);
        assert_eq!(g.decide(10 * MS, None), Decision::SkipRate);
        assert_eq!(g.decide(100 * MS, None), Decision::Send);
        assert_eq!(g.counts().sent, 3);
    }
}
