//! A camera's frames on their way out: encoded after the capture pipeline
//! (JPEG at the quality adaptation chose, or PNG; raw passes through), and
//! the camera fitted to its uplink once a [`WINDOW`] by the pure
//! [`LinkFit`] (quality and rate) and, for `copies = "auto"`, the pure
//! [`Redundancy`] (copies of each frame). The camera task in
//! `node/camera.rs` only moves frames and windows in and decisions out.

use std::time::Duration;

use tidegate_protocol::{Codec, DType, Encoding, Layout, Tensor};
use tokio::time::Instant;
use tracing::{info, warn};

use crate::adapt::{
    Decision, FitConfig, LinkFit, QualityRange, Step, Totals, WindowMeter, WindowStats, phase_of,
};
use crate::capture::{EncodeError, FrameEncoder};
use crate::config::{CameraConfig, Copies};
use crate::redundancy::Redundancy;
use crate::uplink::{LaneStats, PathStats};

pub use crate::adapt::WINDOW;

/// The least time between two warnings about frames the encoder failed
/// (each is counted).
const FAILURE_LOG_EVERY: Duration = Duration::from_secs(1);

/// What the camera's summaries show of its way out.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OutboundReport {
    /// Codec the frames travel in.
    pub codec: Codec,
    /// JPEG quality in force (0 for other codecs).
    pub quality: u8,
    /// The adaptation's own frame-rate cap (the configured rate when it has
    /// not lowered it).
    pub adapt_max_fps: f64,
    /// Mean bytes of a frame handed to QUIC, over the last window that sent
    /// any.
    pub bytes_per_frame: u64,
    /// Mean encoding time of a frame (µs), over the last window that encoded
    /// any.
    pub encode_us: u64,
    /// Frames encoded.
    pub encoded: u64,
    /// Frames the encoder failed (each dropped alone).
    pub encode_failed: u64,
    /// The connection's smoothed round trip at the last window (0 without
    /// one).
    pub rtt: Duration,
    /// Copies of each frame sent now (0 before the camera is open).
    pub copies: u8,
}

/// The counters of the camera's results, kept by the node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ResultCounts {
    /// Results received.
    pub results: u64,
    /// Results late (over the budget, or shed as late on arrival), less
    /// those whose time at the gateway and worker alone was over the
    /// budget: the link fit reacts only to lateness a link could cause.
    pub late: u64,
}

/// One camera's encoder and adaptation. See the module docs.
#[derive(Debug)]
pub struct Outbound {
    camera: String,
    /// What the camera's configuration asks for.
    asked: Encoding,
    /// What the gateway accepted (the asked one until it answers).
    codec: Codec,
    adapt: bool,
    fit: LinkFit,
    fit_config: FitConfig,
    /// What the configuration asks for.
    copies_asked: Copies,
    /// Copies of each frame when they are fixed: those accepted.
    copies: u8,
    /// For `copies = "auto"`, once the camera is open: the policy.
    redundancy: Option<Redundancy>,
    /// Started at `open` for a codec other than raw; `None` then means it
    /// stopped, and it is started again for the next frame.
    encoder: Option<FrameEncoder>,
    /// The frame size accepted.
    size: (u32, u32),
    meter: WindowMeter,
    handed: u64,
    bytes: u64,
    encoded: u64,
    encode_us: u64,
    encode_failed: u64,
    report: OutboundReport,
    /// What the last window tells the connection's other cameras
    /// ([`Decision::report`]).
    uplink_report: Option<bool>,
    /// Whether the last window was pressed, for any reason
    /// ([`Decision::pressed`]).
    pressed: bool,
    last_failure_log: Option<Instant>,
}

impl Outbound {
    /// The way out of camera `cam`, before the gateway has answered.
    pub fn new(cam: &CameraConfig) -> Self {
        let asked = cam.wire_encoding();
        let fit_config = fit_config(cam, asked);
        let fit = LinkFit::new(fit_config);
        Outbound {
            camera: cam.name.clone(),
            asked,
            codec: asked.codec(),
            adapt: cam.adapt,
            report: OutboundReport {
                codec: asked.codec(),
                quality: fit.quality().unwrap_or(0),
                adapt_max_fps: fit.max_fps(),
                bytes_per_frame: 0,
                encode_us: 0,
                encoded: 0,
                encode_failed: 0,
                rtt: Duration::ZERO,
                copies: 0,
            },
            fit,
            fit_config,
            copies_asked: cam.copies,
            copies: 1,
            redundancy: None,
            encoder: None,
            size: (0, 0),
            meter: WindowMeter::default(),
            handed: 0,
            bytes: 0,
            encoded: 0,
            encode_us: 0,
            encode_failed: 0,
            uplink_report: None,
            pressed: false,
            last_failure_log: None,
        }
    }

    /// The encoding to ask for at `CameraOpen`.
    pub fn asked(&self) -> Encoding {
        self.asked
    }

    /// What the last window found that the connection's other cameras
    /// should hear of: `Some(queued)` when the camera's own frames found the
    /// uplink pressed on the wire ([`crate::uplink::Uplink::report_pressed`]).
    pub fn uplink_report(&self) -> Option<bool> {
        self.uplink_report
    }

    /// Whether the last window was pressed, for any reason: slow start is
    /// then over for the connection's other cameras too
    /// ([`crate::uplink::Uplink::report_slow_start_over`]).
    pub fn pressed(&self) -> bool {
        self.pressed
    }

    /// The adaptation's rate cap in force.
    pub fn max_fps(&self) -> f64 {
        self.fit.max_fps()
    }

    /// Copies of each frame to send now: the policy's for `auto`, else
    /// those accepted.
    pub fn copies(&self) -> u8 {
        self.redundancy
            .as_ref()
            .map_or(self.copies, Redundancy::copies)
    }

    /// What the summaries show: the counts as of now, the means as of the
    /// last window.
    pub fn report(&self) -> OutboundReport {
        OutboundReport {
            encoded: self.encoded,
            encode_failed: self.encode_failed,
            ..self.report
        }
    }

    /// The gateway accepted the camera with `accepted` and `copies`, for
    /// frames of `width`×`height`: (re)starts the encoder where the codec
    /// or the size changed. The adaptation starts again from the configured quality and
    /// rate on every connection: what it learned before says little about
    /// the path now, and a link that went dark until the connection died
    /// looked, window after window, like a full one (frames reset, none
    /// acknowledged), which had taken the camera to its floor and slowed
    /// its first frames after the reconnection by up to two seconds. A
    /// link that is really thin is learned again within a few windows.
    pub async fn open(
        &mut self,
        cam: &CameraConfig,
        accepted: Encoding,
        copies: u8,
        width: u32,
        height: u32,
    ) -> Result<(), EncodeError> {
        if accepted != self.asked {
            warn!(
                asked = %self.asked,
                %accepted,
                "the gateway accepted the camera with another encoding than asked; using the gateway's"
            );
        }
        let config = fit_config(cam, accepted);
        self.fit_config = config;
        self.fit = LinkFit::new(config);
        // Like the fit, the copies start afresh on every connection: at one.
        self.copies = copies.max(1);
        self.redundancy =
            (self.copies_asked == Copies::Auto).then(|| Redundancy::new(copies, config.budget));
        self.codec = accepted.codec();
        self.size = (width, height);
        let same = self
            .encoder
            .as_ref()
            .is_some_and(|e| e.codec() == self.codec && e.size() == (width, height));
        if self.codec == Codec::Raw {
            self.encoder = None;
        } else if !same {
            self.encoder = None;
            self.encoder =
                Some(FrameEncoder::start(&self.camera, self.codec, width, height).await?);
        }
        self.report.codec = self.codec;
        self.report.quality = self.fit.quality().unwrap_or(0);
        self.report.adapt_max_fps = self.fit.max_fps();
        self.report.copies = self.copies();
        Ok(())
    }

    /// The tensor of a packed RGB frame of `shape` (`[1,H,W,3]`), encoded
    /// as accepted. A frame the encoder fails is counted, the reason
    /// logged (at most once a second), and `None` returned: the frame is
    /// dropped alone.
    pub async fn tensor(&mut self, pixels: bytes::Bytes, shape: Vec<u32>) -> Option<Tensor> {
        if self.codec == Codec::Raw {
            return Some(Tensor::raw(DType::U8, Layout::Nhwc, shape, pixels));
        }
        if self.encoder.is_none() {
            // Its thread stopped: a new one for this frame.
            let (width, height) = self.size;
            match FrameEncoder::start(&self.camera, self.codec, width, height).await {
                Ok(e) => self.encoder = Some(e),
                Err(e) => {
                    self.failed(&e);
                    return None;
                }
            }
        }
        let encoder = self.encoder.as_ref()?;
        let quality = self.fit.quality().unwrap_or(self.asked.quality().max(1));
        match encoder.encode(pixels, quality).await {
            Ok(e) => {
                self.encoded += 1;
                self.encode_us += u64::try_from(e.took.as_micros()).unwrap_or(u64::MAX);
                Some(Tensor {
                    dtype: DType::U8,
                    layout: Layout::Nhwc,
                    shape,
                    encoding: e.encoding,
                    data: e.data,
                })
            }
            Err(e) => {
                if !e.frame_only() {
                    self.encoder = None;
                }
                self.failed(&e);
                None
            }
        }
    }

    /// Counts a frame the encoder failed, and says why at most once a
    /// second.
    fn failed(&mut self, e: &EncodeError) {
        self.encode_failed += 1;
        let now = Instant::now();
        if self
            .last_failure_log
            .is_none_or(|t| now.duration_since(t) >= FAILURE_LOG_EVERY)
        {
            self.last_failure_log = Some(now);
            warn!(failed = self.encode_failed, "{e}");
        }
    }

    /// A frame of `bytes` was handed to QUIC.
    pub fn handed(&mut self, bytes: usize) {
        self.handed += 1;
        self.bytes += bytes as u64;
    }

    /// Closes the window that ends at `now_us`: counts it and, when the
    /// camera is open on a connection (`path` is its statistics) and adapts,
    /// asks the policy. Returns the decision when it changed something.
    pub fn on_window(
        &mut self,
        now_us: u64,
        lane: &LaneStats,
        results: ResultCounts,
        path: Option<PathStats>,
    ) -> Option<Decision> {
        use std::sync::atomic::Ordering::Relaxed;
        let totals = Totals {
            handed: self.handed,
            delivered: lane.delivered.load(Relaxed),
            expired: lane.expired.load(Relaxed),
            superseded: lane.superseded.load(Relaxed),
            bytes: self.bytes,
            ack_us: lane.ack_us.load(Relaxed),
            results: results.results,
            late: results.late,
            encoded: self.encoded,
            encode_us: self.encode_us,
        };
        let w = self.meter.window(totals, path);
        let r = &mut self.report;
        r.rtt = path.map_or(Duration::ZERO, |p| p.rtt);
        if let Some(b) = w.bytes_per_frame() {
            r.bytes_per_frame = b;
        }
        if let Some(us) = w.encode_us_per_frame() {
            r.encode_us = us;
        }
        self.uplink_report = None;
        self.pressed = false;
        // Without a connection there is nothing to fit.
        path?;
        self.fit_copies(&w);
        if !self.adapt {
            return None;
        }
        let d = self.fit.on_window(now_us, &w);
        self.uplink_report = d.report;
        self.pressed = d.pressed();
        self.report.quality = d.quality.unwrap_or(0);
        self.report.adapt_max_fps = d.max_fps;
        if d.step == Step::Hold {
            return None;
        }
        info!(
            step = ?d.step,
            verdict = ?d.verdict,
            quality = d.quality.unwrap_or(0),
            max_fps = d.max_fps,
            handed = w.handed,
            expired = w.expired,
            late = w.late,
            bytes_per_frame = w.bytes_per_frame().unwrap_or(0),
            ack_excess_us = w.ack_excess_us().unwrap_or(0),
            rtt_ms = w.path.map_or(0.0, |p| p.rtt.as_secs_f64() * 1e3),
            loss = w.path.map_or(0.0, |p| p.loss()),
            "fitting the camera to its uplink"
        );
        Some(d)
    }

    /// For `copies = "auto"`: the copies of each frame for the next window,
    /// from window `w` (on a connection) and how the fit judged it.
    fn fit_copies(&mut self, w: &WindowStats) {
        let Some(r) = &mut self.redundancy else {
            return;
        };
        let before = r.copies();
        let d = r.on_window(w, self.fit.verdict(w));
        self.report.copies = d.copies;
        if d.copies != before {
            info!(
                copies = d.copies,
                was = before,
                loss = d.loss.unwrap_or(0.0),
                min_rtt_ms = w.path.map_or(0.0, |p| p.min_rtt.as_secs_f64() * 1e3),
                bytes_per_frame = w.bytes_per_frame().unwrap_or(0),
                "copies of each frame changed with the path's random loss and round trip"
            );
        }
    }
}

/// What the policy adapts for a camera whose frames travel as `encoding`.
fn fit_config(cam: &CameraConfig, encoding: Encoding) -> FitConfig {
    FitConfig {
        quality: match encoding {
            Encoding::Jpeg { quality } => Some(QualityRange::new(quality, cam.min_jpeg_quality)),
            _ => None,
        },
        max_fps: cam.max_fps,
        budget: Duration::from_millis(u64::from(cam.budget_ms)),
        // A camera that does not adapt stays at its configured quality.
        slow_start: cam.adapt,
        phase: phase_of(&cam.name),
    }
}
