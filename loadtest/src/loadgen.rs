//! Simulated cameras: each sends frames at a fixed rate over the real QUIC
//! uplink for a bounded time (and a bounded number of frames), and every
//! result's end-to-end latency is recorded on the edge clock.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use hdrhistogram::Histogram;
use tidegate_edge::clock;
use tidegate_edge::uplink::{Incoming, Lane, Uplink, UplinkError, UplinkOptions, WireFate};
use tidegate_kit::backoff::Backoff;
use tidegate_protocol::quic::Congestion;
use tidegate_protocol::{
    CameraAccepted, CameraOpen, DType, Encoding, Frame, GatewayAddr, Geometry, InputSpec, Layout,
    Status, Tensor, queue,
};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

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
pub enum LoadError {
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
    /// The frame could not be encoded as asked.
    #[error("encoding the frame as {encoding}: {source}")]
    Encode {
        /// The encoding asked for.
        encoding: Encoding,
        /// What the encoder said.
        source: image::ImageError,
    },
}

/// What to simulate.
#[derive(Debug, Clone)]
pub struct LoadOptions {
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
    /// How frames travel: raw, JPEG at a fixed quality, or PNG.
    pub encoding: Encoding,
    /// Congestion controller for the frames sent.
    pub congestion: Congestion,
    /// Copies of each frame sent side by side, and of each result asked
    /// back (1 to 3; the protocol's `CameraOpen.copies`).
    pub copies: u8,
    /// Every camera's frame due in the same instant, a burst a period (the
    /// worst case for an uplink, and how tests keep several workers busy
    /// at a light load). Otherwise camera i is due i/n of a period after
    /// the first, as real cameras' phases fall.
    pub in_step: bool,
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

/// Frames each camera is to send: `fps × duration`, rounded, at least one.
pub fn frames_per_camera(fps: f64, duration: Duration) -> u64 {
    (fps * duration.as_secs_f64()).round().max(1.0) as u64
}

/// One camera's open-loop schedule. Frame `seq` is due at `start + seq ×
/// period` and is stamped as captured then on the edge clock, whenever it
/// is actually sent: a generator that falls behind sends its late frames
/// as soon as it can (it never skips a tick), and the delay shows in their
/// end-to-end latency and eats their budget, as a camera's frames waiting
/// on a slow edge would. Frames not sent by `stop_at` are `unsent`, which
/// count as not ok in the SLO attainment; none is silently dropped.
///
/// The KServe load generator (`crate::kserve`) drives its HTTP requests
/// on the same schedules ([`camera_schedules`], [`Schedule::wait_for`]),
/// so that tidegate and the servers it is compared with see the same load.
#[derive(Debug, Clone, Copy)]
pub struct Schedule {
    /// When frame 0 is due (tokio's clock).
    start: tokio::time::Instant,
    /// The same moment on the edge clock (µs), where capture times and
    /// end-to-end latency are read.
    start_us: u64,
    /// Time between two frames.
    period: Duration,
    /// Frames to send.
    frames: u64,
    /// No frame is sent from this moment on: the last frame's due time plus
    /// at least one period of slack.
    stop_at: tokio::time::Instant,
}

impl Schedule {
    /// `frames_per_camera(fps, duration)` frames at `fps` from `start`
    /// (which is `start_us` on the edge clock), sending until `duration`
    /// plus one period.
    pub fn new(fps: f64, duration: Duration, start: tokio::time::Instant, start_us: u64) -> Self {
        let period = Duration::from_secs_f64(1.0 / fps);
        Schedule {
            start,
            start_us,
            period,
            frames: frames_per_camera(fps, duration),
            stop_at: start + duration + period,
        }
    }

    /// Frames the schedule calls for.
    pub fn frames(&self) -> u64 {
        self.frames
    }

    /// Time between two frames.
    pub fn period(&self) -> Duration {
        self.period
    }

    /// The moment from which no frame is sent (tokio's clock).
    pub fn stop_at(&self) -> tokio::time::Instant {
        self.stop_at
    }

    /// How long after `start` frame `seq` is due.
    fn offset(&self, seq: u64) -> Duration {
        let nanos = self.period.as_nanos().saturating_mul(u128::from(seq));
        u64::try_from(nanos / 1_000_000_000).map_or(Duration::MAX, |secs| {
            Duration::new(secs, (nanos % 1_000_000_000) as u32)
        })
    }

    /// When frame `seq` is due (tokio's clock); past the clock's range, at
    /// `stop_at` (never sent).
    pub fn due_at(&self, seq: u64) -> tokio::time::Instant {
        self.start
            .checked_add(self.offset(seq))
            .unwrap_or(self.stop_at)
    }

    /// Frame `seq`'s capture time on the edge clock (µs): when it was due,
    /// not when the generator got round to sending it.
    pub fn captured_at_us(&self, seq: u64) -> u64 {
        let offset_us = u64::try_from(self.offset(seq).as_micros()).unwrap_or(u64::MAX);
        self.start_us.saturating_add(offset_us)
    }

    /// Sleeps until frame `seq` is due and returns its due time, at once
    /// when it is overdue (whatever is outstanding: the schedule is open
    /// loop); `None` once the sending time is up (`stop_at`), when this
    /// frame and every later one is `unsent`. Bounded: it returns by
    /// `stop_at`.
    pub async fn wait_for(&self, seq: u64) -> Option<tokio::time::Instant> {
        let due = self.due_at(seq);
        tokio::time::sleep_until(due.min(self.stop_at)).await;
        (tokio::time::Instant::now() < self.stop_at).then_some(due)
    }
}

/// The schedules of `cameras` cameras sending at `fps` for `duration` from
/// `start` (`start_us` on the edge clock), by camera index. With `in_step`
/// every camera's frame is due in the same instant, a burst a period;
/// otherwise camera i starts i/n of a period after the first, as real
/// cameras' phases fall, so that n frames do not all go out at once.
pub fn camera_schedules(
    cameras: usize,
    fps: f64,
    duration: Duration,
    in_step: bool,
    start: tokio::time::Instant,
    start_us: u64,
) -> Vec<Schedule> {
    (0..cameras)
        .map(|i| {
            let phase = if in_step {
                Duration::ZERO
            } else {
                Duration::from_secs_f64(i as f64 / fps / cameras as f64)
            };
            Schedule::new(
                fps,
                duration,
                start + phase,
                start_us + phase.as_micros() as u64,
            )
        })
        .collect()
}

/// Sends one camera's frames on `schedule`: a copy of `template` for each
/// `seq`, stamped as captured when it was due, with the budget it has left
/// (of `budget_us`) when sent. With `caps` (the gateway's frame-rate hints,
/// per camera, `""` for all), frames closer than the hinted cap allows are
/// held back (`throttled`). Each frame is counted `pending` in `report` as
/// it is handed to `send` (on a task of the returned set), then `sent` or
/// `send_errors` as that resolves (`true`: QUIC took it), so at any moment
/// after this returns `sent + send_errors + throttled + unsent + pending`
/// is `schedule.frames` (summed over the cameras). The caller owns the
/// returned sends: dropping the set aborts those still blocked.
async fn send_camera<S, F>(
    schedule: Schedule,
    template: Frame,
    budget_us: u32,
    caps: Option<Arc<Mutex<HashMap<String, f32>>>>,
    report: Arc<Mutex<Report>>,
    send: S,
) -> JoinSet<()>
where
    S: Fn(Frame) -> F,
    F: Future<Output = bool> + Send + 'static,
{
    let mut sends = JoinSet::new();
    let mut last_due: Option<tokio::time::Instant> = None;
    for seq in 0..schedule.frames {
        let Some(due) = schedule.wait_for(seq).await else {
            report.lock().expect("report lock").unsent += schedule.frames - seq;
            break;
        };
        // Only the sends still in flight stay in the set.
        while sends.try_join_next().is_some() {}
        if let Some(caps) = &caps {
            let cap = {
                let caps = caps.lock().expect("caps lock");
                caps.get(&template.camera).or_else(|| caps.get("")).copied()
            };
            // Spacing by due time: a burst of late frames is not throttled
            // for being sent close together.
            if let (Some(cap), Some(last)) = (cap.filter(|c| *c > 0.0), last_due)
                && due.duration_since(last) < min_send_gap(cap, schedule.period)
            {
                report.lock().expect("report lock").throttled += 1;
                continue;
            }
            last_due = Some(due);
        }
        // The whole budget, counted from the due time: the gateway sees
        // how late the frame is from `captured_at_us` and this edge's
        // clock offset, as it does a real edge's.
        let frame = Frame {
            seq,
            captured_at_us: schedule.captured_at_us(seq),
            budget_us,
            ..template.clone()
        };
        report.lock().expect("report lock").pending += 1;
        let sending = send(frame);
        let report = report.clone();
        sends.spawn(async move {
            let ok = sending.await;
            let mut rep = report.lock().expect("report lock");
            rep.pending -= 1;
            if ok {
                rep.sent += 1;
            } else {
                rep.send_errors += 1;
            }
        });
    }
    sends
}

/// [`run`] on a runtime of its own (two threads), for callers outside
/// async code.
pub fn run_blocking(opts: &LoadOptions) -> Result<Report, LoadError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(LoadError::Runtime)?
        .block_on(run(opts))
}

/// How long after the last send (and the budget) the simulation waits for
/// results still outstanding before it counts them `missing`. It stops as
/// soon as every frame sent is settled: answered, reset by the sender, or
/// lost with its connection. On an overloaded machine (the overload tests
/// run a gateway, two workers and this on two cores, debug builds) results
/// can trail the last send by seconds.
pub const RESULT_GRACE: Duration = Duration::from_secs(30);

/// Frames in flight per camera before the oldest is reset to make room:
/// far more than a camera at 30 fps has within an 80 ms budget, so only a
/// link that holds frames for a second or more makes the lane supersede.
const LANE_IN_FLIGHT: usize = 32;

/// First and longest delay between two dials after the connection is lost
/// (jittered, doubling), as a real edge's; the delay starts again from the
/// first once a connection has stayed up for the longest. Each dial is
/// given [`DIAL_ATTEMPT`]: a dial made into a dead link backs its packets
/// off for seconds (QUIC resends a lost Initial after about 1, then 2, then
/// 4 s), so a fresh one is started rather than waited on; 1.5 s, as the
/// edge's, keeps the longest silence between two Initials to 1.5 s.
const REDIAL_BASE: Duration = Duration::from_millis(100);
const REDIAL_MAX: Duration = Duration::from_secs(1);
const DIAL_ATTEMPT: Duration = Duration::from_millis(1500);

/// How every frame the generator sent ended, frame by frame: its result,
/// or what its sender saw of it. A frame is first `sent` on connection
/// `conn`; a result may overtake that record (the gateway can answer
/// before the sending task writes it down), so either order makes one
/// entry.
#[derive(Debug, Default)]
struct Ledger {
    frames: HashMap<(String, u64), Entry>,
    /// Connections that have ended: their frames' results can no longer
    /// come.
    ended: HashSet<u64>,
}

#[derive(Debug, Default, Clone, Copy)]
struct Entry {
    conn: Option<u64>,
    fate: Option<WireFate>,
    answered: bool,
}

/// What a frame without a result comes to at the end of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unanswered {
    /// The sender reset it: superseded, or still unacknowledged at its
    /// deadline. Counted `reset`.
    Reset,
    /// The gateway stopped its stream with an error. Counted `refused`.
    Refused,
    /// Its connection died before its result came. Counted
    /// `lost_with_connection`.
    Lost,
    /// None of these: still awaited. Counted `missing`.
    Waiting,
}

impl Ledger {
    fn sent(&mut self, key: (String, u64), conn: u64) {
        self.frames.entry(key).or_default().conn = Some(conn);
    }

    fn fate(&mut self, key: (String, u64), fate: WireFate) {
        self.frames.entry(key).or_default().fate = Some(fate);
    }

    /// Records a result; false when the frame already had one.
    fn answered(&mut self, key: (String, u64)) -> bool {
        let e = self.frames.entry(key).or_default();
        !std::mem::replace(&mut e.answered, true)
    }

    fn why_unanswered(&self, e: &Entry) -> Unanswered {
        match e.fate {
            Some(WireFate::Superseded | WireFate::Expired) => Unanswered::Reset,
            Some(WireFate::Refused) => Unanswered::Refused,
            Some(WireFate::Lost) => Unanswered::Lost,
            Some(WireFate::Delivered) | None => {
                if e.conn.is_some_and(|c| self.ended.contains(&c)) {
                    Unanswered::Lost
                } else {
                    Unanswered::Waiting
                }
            }
        }
    }

    /// Frames sent still awaiting their result.
    fn waiting(&self) -> usize {
        self.frames
            .values()
            .filter(|e| e.conn.is_some() && !e.answered)
            .filter(|e| self.why_unanswered(e) == Unanswered::Waiting)
            .count()
    }

    /// Writes the end of every sent frame without a result into `report`
    /// (reset, refused or lost with its connection); returns how many are
    /// still awaited, which [`Report::finish`] counts `missing`.
    fn settle(&self, report: &mut Report) -> u64 {
        let (mut reset, mut refused, mut lost, mut waiting) = (0, 0, 0, 0);
        for e in self
            .frames
            .values()
            .filter(|e| e.conn.is_some() && !e.answered)
        {
            match self.why_unanswered(e) {
                Unanswered::Reset => reset += 1,
                Unanswered::Refused => refused += 1,
                Unanswered::Lost => lost += 1,
                Unanswered::Waiting => waiting += 1,
            }
        }
        report.reset = reset;
        report.refused = refused;
        report.lost_with_connection = lost;
        waiting
    }
}

/// One connection to the gateway with every camera open on it.
#[derive(Debug)]
struct Live {
    id: u64,
    uplink: Uplink,
    /// One lane per camera, by camera index.
    lanes: Vec<Lane>,
}

/// Encodes `pixels` (`w`×`h` RGB, the model's input) as `encoding`: the
/// frame every camera of the generator sends. The load generator encodes
/// with the `image` crate, once, at a fixed quality; a real edge encodes
/// every frame with GStreamer and adapts its quality to its link.
pub fn encode_frame(
    pixels: &[u8],
    w: u32,
    h: u32,
    encoding: Encoding,
) -> Result<Bytes, image::ImageError> {
    use image::ImageEncoder;
    let mut out = Vec::new();
    match encoding {
        Encoding::Raw => return Ok(Bytes::copy_from_slice(pixels)),
        Encoding::Jpeg { quality } => image::codecs::jpeg::JpegEncoder::new_with_quality(
            &mut out, quality,
        )
        .write_image(pixels, w, h, image::ExtendedColorType::Rgb8)?,
        Encoding::Png => image::codecs::png::PngEncoder::new(&mut out).write_image(
            pixels,
            w,
            h,
            image::ExtendedColorType::Rgb8,
        )?,
    }
    Ok(Bytes::from(out))
}

/// Dials the gateway and opens every camera of `opts` on the connection.
async fn open_connection(
    opts: &LoadOptions,
    client: &quinn::ClientConfig,
    id: u64,
) -> Result<(Live, queue::Receiver<Incoming>, Vec<CameraAccepted>), LoadError> {
    let (uplink, incoming) = Uplink::connect_client(
        &opts.gateway,
        &opts.server_name,
        client.clone(),
        &opts.edge,
        &opts.token,
        UplinkOptions::default(),
    )
    .await
    .map_err(|source| LoadError::Connect {
        gateway: opts.gateway.clone(),
        edge: opts.edge.clone(),
        source: Box::new(source),
    })?;
    let mut lanes = Vec::with_capacity(opts.cameras);
    let mut accepted = Vec::with_capacity(opts.cameras);
    for i in 0..opts.cameras {
        let camera = camera_name(i);
        let a = uplink
            .open_camera_with(CameraOpen {
                camera: camera.clone(),
                model: opts.model.clone(),
                budget_ms: opts.budget_ms,
                encoding: opts.encoding,
                copies: opts.copies,
            })
            .await
            .map_err(|source| LoadError::OpenCamera {
                camera: camera.clone(),
                model: opts.model.clone(),
                source,
            })?;
        lanes.push(
            uplink
                .lane(&camera, LANE_IN_FLIGHT, Arc::default())
                .with_copies(a.copies),
        );
        accepted.push(a);
    }
    Ok((Live { id, uplink, lanes }, incoming, accepted))
}

fn camera_name(i: usize) -> String {
    format!("sim-{i}")
}

/// What a connection's results and hints are counted into.
#[derive(Debug, Clone)]
struct Tally {
    report: Arc<Mutex<Report>>,
    ledger: Arc<Mutex<Ledger>>,
    hist: Arc<Mutex<Histogram<u64>>>,
    caps: Arc<Mutex<HashMap<String, f32>>>,
    budget_us: u64,
    /// When the run started: results are placed on the report's timeline
    /// from it.
    started: tokio::time::Instant,
}

impl Tally {
    /// Reads one connection's results and hints until it ends; then its
    /// frames still unanswered are lost with it.
    async fn collect(&self, uplink: Uplink, id: u64, mut incoming: queue::Receiver<Incoming>) {
        while let Some(msg) = incoming.recv().await {
            match msg {
                Incoming::Result(r) => {
                    let e2e = clock::now_us().saturating_sub(r.captured_at_us);
                    uplink.report_latency(&r.camera, r.seq, e2e);
                    let first = self
                        .ledger
                        .lock()
                        .expect("ledger lock")
                        .answered((r.camera.clone(), r.seq));
                    let mut rep = self.report.lock().expect("report lock");
                    if !first {
                        rep.duplicates += 1;
                        continue;
                    }
                    rep.count(&r.status);
                    if r.status == Status::Ok {
                        // Past the histogram's 60 s it counts as 60 s rather
                        // than not at all.
                        self.hist
                            .lock()
                            .expect("histogram lock")
                            .saturating_record(e2e.max(1));
                        if e2e <= self.budget_us {
                            rep.ok_within_budget += 1;
                            rep.mark_ok_at(self.started.elapsed());
                        }
                    }
                }
                Incoming::Hint(h) => {
                    self.report.lock().expect("report lock").hints += 1;
                    tracing::info!(camera = %h.camera, max_fps = h.max_fps, "control hint");
                    self.caps
                        .lock()
                        .expect("caps lock")
                        .insert(h.camera, h.max_fps);
                }
            }
        }
        // Every result the connection delivered is in: the rest never come.
        self.ledger.lock().expect("ledger lock").ended.insert(id);
    }
}

/// Keeps a connection up until `stop`: collects the live one's results,
/// and when it ends redials with backoff and opens the cameras again, as a
/// real edge does. Frames due meanwhile find no connection (`send_errors`).
async fn keep_connected(
    opts: LoadOptions,
    client: quinn::ClientConfig,
    first: (Live, queue::Receiver<Incoming>),
    live_tx: watch::Sender<Option<Arc<Live>>>,
    tally: Tally,
    stop: CancellationToken,
) {
    let mut backoff = Backoff::seeded(REDIAL_BASE, REDIAL_MAX, &opts.edge);
    let (live, mut incoming) = first;
    let mut live = Arc::new(live);
    loop {
        live_tx.send_replace(Some(live.clone()));
        let up_since = tokio::time::Instant::now();
        let collect = tally.collect(live.uplink.clone(), live.id, incoming);
        tokio::pin!(collect);
        tokio::select! {
            _ = stop.cancelled() => {
                // What the connection still delivers is counted; then it
                // ends, as the run does.
                live.uplink.close();
                collect.await;
                return;
            }
            () = &mut collect => {}
        }
        live_tx.send_replace(None);
        let why = live.uplink.closed().await;
        backoff.reset_if_stable(up_since.elapsed());
        tracing::warn!("connection to the gateway lost ({why}); redialling");
        let id = live.id + 1;
        (live, incoming) = loop {
            let delay = backoff.next_delay();
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(delay) => {}
            }
            let dial = tokio::time::timeout(DIAL_ATTEMPT, open_connection(&opts, &client, id));
            let opened = tokio::select! {
                _ = stop.cancelled() => return,
                r = dial => r,
            };
            match opened {
                Ok(Ok((l, incoming, _))) => {
                    tally.report.lock().expect("report lock").reconnects += 1;
                    break (Arc::new(l), incoming);
                }
                Ok(Err(e)) => tracing::warn!("redialling: {e}"),
                Err(_) => tracing::warn!("redialling: no connection within {DIAL_ATTEMPT:?}"),
            }
        };
    }
}

/// Runs the simulation and returns its report.
pub async fn run(opts: &LoadOptions) -> Result<Report, LoadError> {
    run_with_progress(opts, None).await
}

/// One line of progress: the time since the run began and what has
/// happened so far, with the p99 of the results in.
pub fn progress_line(elapsed: Duration, r: &Report, p99_ms: Option<f64>) -> String {
    let p99 = p99_ms.map_or_else(|| "-".to_string(), |p| format!("{p:.1} ms"));
    format!(
        "progress {:>5.1} s: sent {} ok {} ({} within budget) shed {} expired {} failed {} p99 {p99}",
        elapsed.as_secs_f64(),
        r.sent,
        r.ok,
        r.ok_within_budget,
        r.shed,
        r.expired,
        r.failed
    )
}

/// [`run`], printing a [`progress_line`] on stderr every `every` while it
/// runs.
pub async fn run_with_progress(
    opts: &LoadOptions,
    every: Option<Duration>,
) -> Result<Report, LoadError> {
    if !FPS_RANGE.contains(&opts.fps) {
        return Err(LoadError::Fps(opts.fps));
    }
    if opts.cameras == 0 {
        return Err(LoadError::NoCameras);
    }
    let client =
        tidegate_protocol::quic::client_config_with(&opts.ca, opts.congestion).map_err(|e| {
            LoadError::Connect {
                gateway: opts.gateway.clone(),
                edge: opts.edge.clone(),
                source: Box::new(UplinkError::Tls(e)),
            }
        })?;
    let (live, incoming, accepted) = open_connection(opts, &client, 0).await?;
    let input = accepted[0].input;
    if input.dtype != DType::U8 || input.layout != Layout::Nhwc {
        return Err(LoadError::UnsupportedInput {
            model: opts.model.clone(),
            dtype: input.dtype,
            layout: input.layout,
        });
    }
    let (pixels, geometry) = frame_pixels(&input, opts.image.as_deref())?;
    let data =
        encode_frame(&pixels, input.width, input.height, opts.encoding).map_err(|source| {
            LoadError::Encode {
                encoding: opts.encoding,
                source,
            }
        })?;

    let tally = Tally {
        report: Arc::new(Mutex::new(Report::new(opts))),
        ledger: Arc::default(),
        hist: Arc::new(Mutex::new(
            Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("valid histogram bounds"),
        )),
        // Frame-rate caps from the gateway's hints, per camera ("" = all).
        caps: Arc::default(),
        budget_us: opts.budget_ms as u64 * 1000,
        started: tokio::time::Instant::now(),
    };
    {
        let mut rep = tally.report.lock().expect("report lock");
        rep.bytes_per_frame = data.len() as u64;
        rep.encoding = opts.encoding.to_string();
        rep.congestion = opts.congestion.to_string();
        rep.copies = opts.copies;
    }
    let (live_tx, live_rx) = watch::channel(None);
    let stop = CancellationToken::new();
    let link = tokio::spawn(keep_connected(
        opts.clone(),
        client,
        (live, incoming),
        live_tx,
        tally.clone(),
        stop.clone(),
    ));

    let progress = every.map(|every| {
        let (report, hist, stop) = (tally.report.clone(), tally.hist.clone(), stop.clone());
        let began = tally.started;
        tokio::spawn(async move {
            let mut tick = tokio::time::interval_at(began + every, every);
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tick.tick() => {}
                }
                let r = report.lock().expect("report lock").clone();
                let p99 = {
                    let h = hist.lock().expect("histogram lock");
                    (!h.is_empty()).then(|| h.value_at_quantile(0.99) as f64 / 1000.0)
                };
                eprintln!("{}", progress_line(began.elapsed(), &r, p99));
            }
        })
    });
    // An open-loop schedule per camera: see [`Schedule`].
    let (start, start_us) = (tokio::time::Instant::now(), clock::now_us());
    let budget_us = frame_budget_us(opts.budget_ms);
    let mut tensor = Tensor::raw(DType::U8, Layout::Nhwc, input.frame_shape(), data);
    tensor.encoding = opts.encoding;
    let mut senders = Vec::new();
    let schedules = camera_schedules(
        opts.cameras,
        opts.fps,
        opts.duration,
        opts.in_step,
        start,
        start_us,
    );
    for (i, schedule) in schedules.into_iter().enumerate() {
        let template = Frame {
            camera: camera_name(i),
            seq: 0,
            captured_at_us: 0,
            budget_us: 0,
            model: opts.model.clone(),
            geometry,
            tensor: tensor.clone(),
        };
        let caps = opts.obey_hints.then(|| tally.caps.clone());
        let live_rx = live_rx.clone();
        let ledger = tally.ledger.clone();
        senders.push(tokio::spawn(send_camera(
            schedule,
            template,
            budget_us,
            caps,
            tally.report.clone(),
            move |frame| {
                let live = live_rx.borrow().clone();
                let ledger = ledger.clone();
                async move {
                    let Some(live) = live else { return false };
                    send_on(&live, i, frame, ledger).await
                }
            },
        )));
    }
    // The sends still in flight, owned here until the report is taken.
    let mut sends = Vec::with_capacity(senders.len());
    for s in senders {
        sends.push(s.await?);
    }
    // Wait until every frame sent is settled, or the budget plus
    // RESULT_GRACE has passed; a frame QUIC has not yet taken (no stream
    // credit) is `pending`.
    let until =
        tokio::time::Instant::now() + Duration::from_millis(opts.budget_ms as u64) + RESULT_GRACE;
    loop {
        let pending = tally.report.lock().expect("report lock").pending;
        let waiting = tally.ledger.lock().expect("ledger lock").waiting();
        if (pending == 0 && waiting == 0) || tokio::time::Instant::now() > until {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Taken before the connection closes, so a send still blocked counts
    // as `pending`, and a frame still awaited as `missing`, not as lost to
    // a close of our own making.
    let mut rep = tally.report.lock().expect("report lock").clone();
    let waiting = tally.ledger.lock().expect("ledger lock").settle(&mut rep);
    drop(sends);
    stop.cancel();
    if let Some(p) = progress {
        let _ = p.await;
    }
    let _ = tokio::time::timeout(Duration::from_secs(5), link).await;
    debug_assert_eq!(
        rep.sent + rep.send_errors + rep.throttled + rep.unsent + rep.pending,
        rep.planned,
        "every planned frame is counted once: {rep:?}"
    );
    rep.finish(&tally.hist.lock().expect("histogram lock"));
    debug_assert_eq!(rep.missing, waiting, "every sent frame ends once: {rep:?}");
    Ok(rep)
}

/// Sends `frame` on camera `i`'s lane of `live`, to be reset if it is still
/// unacknowledged at the end of its budget, as a real edge's lane does;
/// records it, and its fate on the wire once settled, in `ledger`. False
/// when the connection was gone before the stream opened.
async fn send_on(live: &Live, i: usize, frame: Frame, ledger: Arc<Mutex<Ledger>>) -> bool {
    let left_us =
        (u64::from(frame.budget_us) + frame.captured_at_us).saturating_sub(clock::now_us());
    let deadline = tokio::time::Instant::now() + Duration::from_micros(left_us);
    let key = (frame.camera.clone(), frame.seq);
    match live.lanes[i].send_watched(frame, deadline).await {
        Ok(fate) => {
            ledger
                .lock()
                .expect("ledger lock")
                .sent(key.clone(), live.id);
            tokio::spawn(async move {
                if let Ok(f) = fate.await {
                    ledger.lock().expect("ledger lock").fate(key, f);
                }
            });
            true
        }
        Err(_) => false,
    }
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

    #[test]
    fn a_frame_is_stamped_as_captured_when_it_was_due_not_when_it_was_sent() {
        let start = tokio::time::Instant::now();
        // 25 fps for 2 s: 50 frames 40 ms apart, sending until 2.04 s.
        let s = Schedule::new(25.0, Duration::from_secs(2), start, 1_000_000);
        assert_eq!((s.frames, s.period), (50, Duration::from_millis(40)));
        assert_eq!(s.stop_at, start + Duration::from_millis(2_040));
        assert_eq!(s.due_at(0), start);
        assert_eq!(s.due_at(49), start + Duration::from_millis(1_960));
        assert_eq!(s.captured_at_us(0), 1_000_000);
        assert_eq!(s.captured_at_us(3), 1_120_000);
        // Due times are computed, not accumulated tick by tick: after 10
        // minutes at 30 fps the last frame is within 10 µs of 17999 / 30 s.
        let s = Schedule::new(30.0, Duration::from_secs(600), start, 0);
        assert_eq!(s.frames, 18_000);
        assert!(s.captured_at_us(17_999).abs_diff(599_966_667) < 10);
        // Far-off frames saturate rather than overflow.
        assert_eq!(s.captured_at_us(u64::MAX), u64::MAX);
        assert_eq!(frames_per_camera(0.001, Duration::from_secs(1)), 1);
    }

    #[test]
    fn cameras_out_of_step_are_spread_over_one_period_and_in_step_share_it() {
        let start = tokio::time::Instant::now();
        // 4 cameras at 10 fps for 1 s: 100 ms periods, 25 ms apart.
        let spread = camera_schedules(4, 10.0, Duration::from_secs(1), false, start, 1_000);
        assert_eq!(spread.len(), 4);
        for (i, s) in spread.iter().enumerate() {
            let phase = Duration::from_millis(25 * i as u64);
            assert_eq!(s.frames(), 10, "camera {i}");
            assert_eq!(s.period(), Duration::from_millis(100));
            assert_eq!(s.due_at(0), start + phase, "camera {i}");
            assert_eq!(s.captured_at_us(0), 1_000 + 25_000 * i as u64);
            assert_eq!(s.stop_at(), start + phase + Duration::from_millis(1_100));
        }
        let in_step = camera_schedules(4, 10.0, Duration::from_secs(1), true, start, 0);
        assert!(
            in_step
                .iter()
                .all(|s| s.due_at(3) == start + Duration::from_millis(300))
        );
    }

    #[tokio::test]
    async fn a_schedule_whose_time_is_up_hands_out_no_more_frames() {
        let start = tokio::time::Instant::now() - Duration::from_secs(5);
        // Every frame of a 1 s schedule that started 5 s ago is past its
        // sending time; the first frame of a fresh one is due at once.
        let s = Schedule::new(10.0, Duration::from_secs(1), start, 0);
        assert_eq!(s.wait_for(0).await, None);
        let now = tokio::time::Instant::now();
        let fresh = Schedule::new(10.0, Duration::from_secs(1), now, 0);
        assert_eq!(fresh.wait_for(0).await, Some(now));
    }

    /// A frame of camera `cam-1` with no pixels to speak of.
    fn template() -> Frame {
        Frame {
            camera: "cam-1".into(),
            seq: 0,
            captured_at_us: 0,
            budget_us: 0,
            model: "m".into(),
            geometry: Geometry::stretch(1, 1, 1, 1),
            tensor: Tensor::raw(
                DType::U8,
                Layout::Nhwc,
                vec![1, 1, 1, 3],
                Bytes::from_static(&[0, 0, 0]),
            ),
        }
    }

    #[tokio::test]
    async fn a_generator_behind_its_schedule_sends_late_frames_stamped_when_due() {
        // A generator 1 s behind: all 5 frames of a 10 fps schedule are
        // overdue, by 1 s down to 0.6 s. They are all sent (a cap at the
        // send rate spaces frames by when they were due, so the burst is
        // not throttled), each stamped with its due time and its whole
        // 0.8 s budget, counted from then: the gateway sees the lateness.
        // Bounded: 5 frames, sent without waiting.
        let start = tokio::time::Instant::now() - Duration::from_secs(1);
        let schedule = Schedule {
            start,
            start_us: 5_000_000,
            period: Duration::from_millis(100),
            frames: 5,
            stop_at: start + Duration::from_secs(60),
        };
        let report = Arc::new(Mutex::new(Report::default()));
        let frames = Arc::new(Mutex::new(Vec::new()));
        let caps = Arc::new(Mutex::new(HashMap::from([(String::new(), 10.0)])));
        let mut sends = {
            let frames = frames.clone();
            send_camera(
                schedule,
                template(),
                800_000,
                Some(caps),
                report.clone(),
                move |f: Frame| {
                    frames
                        .lock()
                        .unwrap()
                        .push((f.seq, f.captured_at_us, f.budget_us));
                    async { true }
                },
            )
            .await
        };
        while let Some(done) = sends.join_next().await {
            done.unwrap();
        }
        let frames = frames.lock().unwrap().clone();
        assert_eq!(frames.len(), 5, "{frames:?}");
        for (seq, captured_at_us, budget_us) in frames {
            assert_eq!(captured_at_us, 5_000_000 + seq * 100_000, "frame {seq}");
            assert_eq!(budget_us, 800_000, "frame {seq}");
        }
        let r = report.lock().unwrap().clone();
        assert_eq!((r.sent, r.throttled, r.unsent, r.pending), (5, 0, 0, 0));
    }

    #[tokio::test]
    async fn every_frame_is_counted_sent_failed_pending_or_unsent() {
        // Three frames sent at once (due 1 ms apart, the end a minute
        // away): QUIC takes frame 0, refuses frame 2, and flow control
        // holds frame 1 for ever.
        let start = tokio::time::Instant::now();
        let schedule = Schedule {
            start,
            start_us: 0,
            period: Duration::from_millis(1),
            frames: 3,
            stop_at: start + Duration::from_secs(60),
        };
        let report = Arc::new(Mutex::new(Report {
            planned: 3,
            ..Report::default()
        }));
        let mut sends = send_camera(
            schedule,
            template(),
            80_000,
            None,
            report.clone(),
            |f: Frame| async move {
                if f.seq == 1 {
                    std::future::pending::<()>().await;
                }
                f.seq == 0
            },
        )
        .await;
        tokio::time::timeout(Duration::from_secs(30), async {
            while sends.len() > 1 {
                sends.join_next().await;
            }
        })
        .await
        .expect("the sends that can finish finish");
        let mut r = report.lock().unwrap().clone();
        drop(sends);
        assert_eq!((r.sent, r.send_errors, r.pending, r.unsent), (1, 1, 1, 0));
        r.count(&Status::Ok);
        r.ok_within_budget = 1;
        r.finish(&Histogram::new(3).unwrap());
        // Over sent + send errors alone this would be 1 / 2.
        assert!((r.slo_attainment - 1.0 / 3.0).abs() < 1e-9, "{r:?}");

        // A schedule whose end had passed before the generator got to it:
        // every frame is unsent, none vanishes.
        let report = Arc::new(Mutex::new(Report::default()));
        let sends = send_camera(
            Schedule {
                stop_at: start,
                ..schedule
            },
            template(),
            80_000,
            None,
            report.clone(),
            |_| async { true },
        )
        .await;
        assert!(sends.is_empty());
        let r = report.lock().unwrap().clone();
        assert_eq!((r.sent, r.pending, r.unsent), (0, 0, 3));
    }

    #[tokio::test]
    async fn a_rate_outside_the_range_is_refused_before_connecting() {
        let opts = LoadOptions {
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
            encoding: Encoding::Raw,
            congestion: Congestion::default(),
            copies: 1,
            in_step: false,
        };
        for fps in [1e-300, 0.0, -1.0, f64::NAN, 1001.0] {
            let err = run(&LoadOptions {
                fps,
                ..opts.clone()
            })
            .await
            .unwrap_err();
            assert!(matches!(err, LoadError::Fps(_)), "{fps}: {err}");
            assert!(err.to_string().contains("0.001"), "{err}");
        }
    }
}
