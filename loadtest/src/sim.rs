//! Simulated cameras: each sends frames at a fixed rate over the real QUIC
//! uplink for a bounded time (and a bounded number of frames), and every
//! result's end-to-end latency is recorded on the edge clock.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use hdrhistogram::Histogram;
use tidegate_edge::clock;
use tidegate_edge::uplink::{Incoming, Uplink, UplinkError};
use tidegate_protocol::{DType, Frame, GatewayAddr, Geometry, InputSpec, Layout, Status, Tensor};

use crate::report::Report;

/// Why [`frame_pixels`] could not make the frame: the image would not open.
#[derive(Debug, thiserror::Error)]
#[error("opening the image {path}: {source}; give a PNG file")]
#[non_exhaustive]
pub struct FrameImageError {
    /// The image.
    pub path: PathBuf,
    /// What the decoder said.
    pub source: image::ImageError,
}

/// Why a simulation ([`run`], [`run_blocking`]) could not run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SimError {
    /// The runtime of [`run_blocking`] could not be built.
    #[error("building the simulation's runtime: {0}")]
    Runtime(#[source] std::io::Error),
    /// The gateway could not be reached, or refused the edge.
    #[error("connecting to the gateway at {gateway} as edge {edge}: {source}")]
    Connect {
        /// Gateway address.
        gateway: GatewayAddr,
        /// Edge name.
        edge: String,
        /// Why (boxed: it holds the gateway's address too).
        source: Box<UplinkError>,
    },
    /// The gateway did not accept a camera (unknown model, say).
    #[error("opening camera {camera} for model '{model}': {source}")]
    OpenCamera {
        /// The camera.
        camera: String,
        /// Its model.
        model: String,
        /// Why.
        source: UplinkError,
    },
    /// The options ask for no camera.
    #[error("at least one camera is needed; set cameras to 1 or more")]
    NoCameras,
    /// The options ask for a frame rate outside [`FPS_RANGE`].
    #[error("fps = {0} is not in [{min}, {max}]; give a rate in that range", min = FPS_RANGE.start(), max = FPS_RANGE.end())]
    Fps(f64),
    /// The model takes frames the simulator cannot make.
    #[error(
        "model '{model}' does not take u8 NHWC frames (it takes {dtype:?} {layout:?}); simulate a model with u8 NHWC input"
    )]
    UnsupportedInput {
        /// The model.
        model: String,
        /// Its input's element type.
        dtype: DType,
        /// Its input's layout.
        layout: Layout,
    },
    /// The image to send would not open.
    #[error(transparent)]
    Image(#[from] FrameImageError),
    /// A camera's sending task panicked or was cancelled.
    #[error("camera task: {0}")]
    CameraTask(#[from] tokio::task::JoinError),
}

/// What to simulate.
#[derive(Debug, Clone)]
pub struct SimOptions {
    /// Gateway QUIC address (an IP address or a host name, resolved when
    /// the simulation connects).
    pub gateway: GatewayAddr,
    /// Name in the gateway's certificate.
    pub server_name: String,
    /// CA certificate.
    pub ca: PathBuf,
    /// Edge name.
    pub edge: String,
    /// Edge token.
    pub token: String,
    /// Number of cameras.
    pub cameras: usize,
    /// Frames per second per camera.
    pub fps: f64,
    /// How long to send.
    pub duration: Duration,
    /// Model name.
    pub model: String,
    /// Budget per frame (ms).
    pub budget_ms: u32,
    /// Image to send (resized to the model input); grey frames if absent.
    pub image: Option<PathBuf>,
    /// Obey the gateway's frame-rate hints, as a real edge does.
    pub obey_hints: bool,
}

/// The frame every camera sends: the image resized to the model's input.
pub fn frame_pixels(
    input: &InputSpec,
    image: Option<&std::path::Path>,
) -> Result<(Bytes, Geometry), FrameImageError> {
    let (w, h) = (input.width, input.height);
    match image {
        Some(path) => {
            let img = image::open(path)
                .map_err(|source| FrameImageError {
                    path: path.to_path_buf(),
                    source,
                })?
                .to_rgb8();
            let (sw, sh) = img.dimensions();
            let g = match input.resize {
                tidegate_protocol::Resize::Stretch => Geometry::stretch(sw, sh, w, h),
                tidegate_protocol::Resize::Letterbox => Geometry::letterbox(sw, sh, w, h),
            };
            let scaled = image::imageops::resize(
                &img,
                g.content_width,
                g.content_height,
                image::imageops::FilterType::Triangle,
            );
            let mut canvas = image::RgbImage::new(w, h);
            image::imageops::replace(&mut canvas, &scaled, g.content_x as i64, g.content_y as i64);
            Ok((Bytes::from(canvas.into_raw()), g))
        }
        None => Ok((
            Bytes::from(vec![128u8; (w * h * 3) as usize]),
            Geometry::stretch(w, h, w, h),
        )),
    }
}

/// The frame rates a simulated camera can send at (frames per second): at
/// least one frame in 1000 s, at most one a millisecond.
pub const FPS_RANGE: std::ops::RangeInclusive<f64> = 0.001..=1000.0;

/// A frame's budget in µs for a budget of `budget_ms`, saturating at what
/// the frame header holds (`u32::MAX` µs, about 71 minutes).
fn frame_budget_us(budget_ms: u32) -> u32 {
    (u64::from(budget_ms) * 1000).min(u64::from(u32::MAX)) as u32
}

/// The least time between two frames a camera sending every `period` may
/// leave under a hinted cap of `cap` fps: one frame per `1 / cap`, less half
/// a period of slack so a cap equal to the send rate does not drop every
/// other frame. Zero (no throttling) when the cap is above twice the rate;
/// `cap` must be positive.
fn min_send_gap(cap: f32, period: Duration) -> Duration {
    Duration::try_from_secs_f64(1.0 / f64::from(cap))
        .unwrap_or(Duration::MAX)
        .saturating_sub(period / 2)
}

/// [`run`] on a runtime of its own (two threads), for callers outside
/// async code.
pub fn run_blocking(opts: &SimOptions) -> Result<Report, SimError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(SimError::Runtime)?
        .block_on(run(opts))
}

/// How long after the last send (and the budget) the simulation waits for
/// results still outstanding before it counts them `missing`. It stops as
/// soon as every result is in. A frame counts as sent once QUIC has taken
/// it, and the connection's 64 MiB send window holds 1365 frames of
/// 128×128×3: when the cameras outrun what reaches the gateway (the
/// overload tests, debug builds on two cores), those frames arrive, and
/// are answered, seconds after the last send. Twice, with a 10 s grace,
/// 1366 and 1372 frames were counted missing: about one full window.
pub const RESULT_GRACE: Duration = Duration::from_secs(30);

/// Runs the simulation and returns its report.
pub async fn run(opts: &SimOptions) -> Result<Report, SimError> {
    if !FPS_RANGE.contains(&opts.fps) {
        return Err(SimError::Fps(opts.fps));
    }
    let (uplink, mut incoming) = Uplink::connect(
        &opts.gateway,
        &opts.server_name,
        &opts.ca,
        &opts.edge,
        &opts.token,
    )
    .await
    .map_err(|source| SimError::Connect {
        gateway: opts.gateway.clone(),
        edge: opts.edge.clone(),
        source: Box::new(source),
    })?;
    let mut input = None;
    for i in 0..opts.cameras {
        let camera = format!("sim-{i}");
        let spec = uplink
            .open_camera(&camera, &opts.model, opts.budget_ms)
            .await
            .map_err(|source| SimError::OpenCamera {
                camera,
                model: opts.model.clone(),
                source,
            })?
            .input;
        input = Some(spec);
    }
    let input = input.ok_or(SimError::NoCameras)?;
    if input.dtype != DType::U8 || input.layout != Layout::Nhwc {
        return Err(SimError::UnsupportedInput {
            model: opts.model.clone(),
            dtype: input.dtype,
            layout: input.layout,
        });
    }
    let (pixels, geometry) = frame_pixels(&input, opts.image.as_deref())?;
    let per_camera = (opts.fps * opts.duration.as_secs_f64()).round().max(1.0) as u64;

    let hist = Arc::new(Mutex::new(
        Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("valid histogram bounds"),
    ));
    let report = Arc::new(Mutex::new(Report::new(opts)));
    // Frame-rate caps from the gateway's hints, per camera ("" = all).
    let caps: Arc<Mutex<HashMap<String, f32>>> = Arc::default();
    let collector = {
        let hist = hist.clone();
        let report = report.clone();
        let uplink = uplink.clone();
        let caps = caps.clone();
        let budget_us = opts.budget_ms as u64 * 1000;
        tokio::spawn(async move {
            let mut seen = HashSet::new();
            while let Some(msg) = incoming.recv().await {
                match msg {
                    Incoming::Result(r) => {
                        let e2e = clock::now_us().saturating_sub(r.captured_at_us);
                        uplink.report_latency(&r.camera, r.seq, e2e);
                        let mut rep = report.lock().expect("report lock");
                        if !seen.insert((r.camera.clone(), r.seq)) {
                            rep.duplicates += 1;
                            continue;
                        }
                        rep.count(&r.status);
                        if r.status == Status::Ok {
                            let _ = hist.lock().expect("histogram lock").record(e2e.max(1));
                            if e2e <= budget_us {
                                rep.ok_within_budget += 1;
                            }
                        }
                    }
                    Incoming::Hint(h) => {
                        report.lock().expect("report lock").hints += 1;
                        tracing::info!(camera = %h.camera, max_fps = h.max_fps, "control hint");
                        caps.lock().expect("caps lock").insert(h.camera, h.max_fps);
                    }
                }
            }
        })
    };

    let period = Duration::from_secs_f64(1.0 / opts.fps);
    // Sending stops at the planned time plus one period of slack even when
    // the senders fell behind their rate (missed ticks are skipped, not
    // caught up); frames never sent are counted as `unsent`.
    let stop_at = tokio::time::Instant::now() + opts.duration + period;
    let mut senders = Vec::new();
    for i in 0..opts.cameras {
        let uplink = uplink.clone();
        let pixels = pixels.clone();
        let model = opts.model.clone();
        let shape = input.frame_shape();
        let budget_us = frame_budget_us(opts.budget_ms);
        let report = report.clone();
        let caps = caps.clone();
        let obey = opts.obey_hints;
        senders.push(tokio::spawn(async move {
            let camera = format!("sim-{i}");
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            let mut last_sent: Option<tokio::time::Instant> = None;
            for seq in 0..per_camera {
                let ticked = tokio::time::timeout_at(stop_at, tick.tick()).await.is_ok();
                if !ticked || tokio::time::Instant::now() >= stop_at {
                    report.lock().expect("report lock").unsent += per_camera - seq;
                    break;
                }
                if obey {
                    let cap = {
                        let caps = caps.lock().expect("caps lock");
                        caps.get(&camera).or_else(|| caps.get("")).copied()
                    };
                    let now = tokio::time::Instant::now();
                    if let (Some(cap), Some(last)) = (cap.filter(|c| *c > 0.0), last_sent)
                        && now.duration_since(last) < min_send_gap(cap, period)
                    {
                        report.lock().expect("report lock").throttled += 1;
                        continue;
                    }
                    last_sent = Some(now);
                }
                let frame = Frame {
                    camera: camera.clone(),
                    seq,
                    captured_at_us: clock::now_us(),
                    budget_us,
                    model: model.clone(),
                    geometry,
                    tensor: Tensor {
                        dtype: DType::U8,
                        layout: Layout::Nhwc,
                        shape: shape.clone(),
                        data: pixels.clone(),
                    },
                };
                let uplink = uplink.clone();
                let report = report.clone();
                tokio::spawn(async move {
                    let ok = uplink.send_frame(frame).await.is_ok();
                    let mut rep = report.lock().expect("report lock");
                    if ok {
                        rep.sent += 1;
                    } else {
                        rep.send_errors += 1;
                    }
                });
            }
        }));
    }
    for s in senders {
        s.await?;
    }
    // Wait for outstanding results, until all are in or the budget plus
    // RESULT_GRACE has passed. On an overloaded machine (the overload
    // tests run a gateway, two workers and this on two cores, debug
    // builds) results can trail the last send by seconds; a frame still
    // without a result after that is `missing`.
    let until =
        tokio::time::Instant::now() + Duration::from_millis(opts.budget_ms as u64) + RESULT_GRACE;
    loop {
        let done = {
            let r = report.lock().expect("report lock");
            r.sent + r.send_errors + r.throttled + r.unsent >= per_camera * opts.cameras as u64
                && r.results() >= r.sent
        };
        if done || tokio::time::Instant::now() > until {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    uplink.close();
    collector.abort();
    let mut rep = report.lock().expect("report lock").clone();
    rep.finish(&hist.lock().expect("histogram lock"));
    Ok(rep)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cap_above_twice_the_send_rate_does_not_throttle() {
        // A camera at 0.25 fps hinted down to the gateway's floor of 1 fps:
        // 1 s - 2 s would underflow.
        let period = Duration::from_secs(4);
        assert_eq!(min_send_gap(1.0, period), Duration::ZERO);
        // A cap equal to the rate keeps half a period of slack; a lower cap
        // spaces frames by its own period less that slack.
        assert_eq!(min_send_gap(0.25, period), Duration::from_secs(2));
        assert_eq!(
            min_send_gap(0.125, period),
            Duration::from_secs(6),
            "8 s per frame less 2 s"
        );
        // A vanishing cap throttles everything rather than panicking.
        assert_eq!(
            min_send_gap(f32::MIN_POSITIVE, period),
            Duration::MAX - period / 2
        );
    }

    #[test]
    fn a_budget_too_long_for_the_frame_header_saturates() {
        assert_eq!(frame_budget_us(80), 80_000);
        assert_eq!(frame_budget_us(4_294_967), 4_294_967_000);
        assert_eq!(frame_budget_us(4_294_968), u32::MAX);
        assert_eq!(frame_budget_us(u32::MAX), u32::MAX);
    }

    #[tokio::test]
    async fn a_rate_outside_the_range_is_refused_before_connecting() {
        let opts = SimOptions {
            // Nothing listens here: a connection attempt would fail otherwise.
            gateway: GatewayAddr::from(std::net::SocketAddr::from(([127, 0, 0, 1], 9))),
            server_name: "localhost".into(),
            ca: PathBuf::from("/nonexistent/ca.pem"),
            edge: "edge-1".into(),
            token: "t".into(),
            cameras: 1,
            fps: 1e-300,
            duration: Duration::from_secs(1),
            model: "blazeface".into(),
            budget_ms: 80,
            image: None,
            obey_hints: true,
        };
        for fps in [1e-300, 0.0, -1.0, f64::NAN, 1001.0] {
            let err = run(&SimOptions {
                fps,
                ..opts.clone()
            })
            .await
            .unwrap_err();
            assert!(matches!(err, SimError::Fps(_)), "{fps}: {err}");
            assert!(err.to_string().contains("0.001"), "{err}");
        }
    }
}
