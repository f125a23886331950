//! The edge node: one connection supervisor and one task per camera.
//!
//! ```text
//!   link task ── dial (jittered exponential backoff) ──► Uplink ──watch──► camera tasks
//!      │  each dial, connection and its end ─► UplinkStats (read by /metrics)
//!      │  results ─► SinkWriter thread ─► Sinks (stdout / file / webhook), latency report
//!      └─ hints ─► HintBoard ──watch──► camera tasks ─► FrameGate limits
//!
//!   camera task: CameraOpen on every new connection ─► SupervisedCapture
//!      (restarts itself) ─► Outbound (JPEG/PNG on the camera's encoder
//!      thread) ─► Lane (bounded in flight, reset when stale)
//!      once a second: Outbound fits quality, then rate, to the uplink
//!      (crate::adapt); the stricter of its cap and the gateway's wins
//!      no connection: frames are dropped and counted, never kept for later
//! ```
//!
//! A camera whose entry is wrong (no model, a bad URI, a missing file) logs
//! one clear error and stops; the others carry on.
//!
//! When every camera has stopped (a `file://` clip played to its end, or
//! `--max-frames` reached), the node waits for the results of the frames
//! still out, at most [`RESULT_DRAIN`], and returns. Frames are tracked by
//! camera and `seq` ([`Unanswered`]), so an extra result stands for no other
//! frame, and every frame handed to the uplink ends exactly once: as its
//! result, reset, refused or lost on the wire, or lost with its connection
//! (acknowledged, its result never came). The link tells the node that a
//! connection ended through the queue its results come by, after the last
//! of them, so a result on its way is never counted lost.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde::Serialize;
use tidegate_protocol::queue;
use tidegate_protocol::{
    ControlHint, DType, Frame, FrameResult, InputSpec, Layout, ShedReason, Status,
};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, debug, error, info, info_span, warn};

use crate::capture::{
    CameraStopped, CaptureCounters, CaptureOptions, CaptureSpec, SourceUri, SupervisedCapture,
    SupervisorOptions,
};
use crate::config::{CameraConfig, ConfigError, EdgeConfig};
use crate::gate::{Hint, Limits};
use crate::outbound::{Outbound, OutboundReport, ResultCounts};
use crate::sink::{FinishError, Sinks};
use crate::uplink::{
    FrameEnds, Incoming, Lane, LaneStats, Unanswered, Uplink, UplinkError, UplinkOptions,
};
use crate::uplink_stats::{DisconnectReason, UplinkStats};
use tidegate_kit::backoff::{Backoff, Loudness, Outage};

/// How long a finished camera waits for its frames in flight to settle.
const SETTLE: Duration = Duration::from_secs(5);
/// Results queued for the sink thread; when it is full the node waits, and
/// the wait reaches the gateway through the uplink's bounded queues.
const SINK_QUEUE: usize = 256;
/// Bytes of results (see [`FrameResult::held_bytes`]) queued for the sink
/// thread, whichever of this and [`SINK_QUEUE`] fills first.
const SINK_QUEUE_BYTES: usize = 64 * 1024 * 1024;
/// Results the link has taken from the uplink and the node has yet to hand
/// to the sinks, in count and in bytes.
const RESULTS_QUEUE: usize = 4096;
const RESULTS_QUEUE_BYTES: usize = 64 * 1024 * 1024;
/// How long shutdown waits for the sinks to write what is queued, and for
/// the webhook to post it.
const SINK_DRAIN: Duration = Duration::from_secs(5);
/// How long the node waits, once every camera has stopped, for the results
/// of the frames still out.
pub const RESULT_DRAIN: Duration = Duration::from_secs(10);
/// First delay before redialling the gateway; it doubles per failure up to
/// [`REDIAL_MAX`]. Each delay is drawn from the upper half of its step
/// ([`Backoff`]'s equal jitter): when a gateway restarts, its edges, cut
/// off in the same instant, do not all dial it again in the same instant.
pub const REDIAL_BASE: Duration = Duration::from_millis(200);
/// Longest delay before redialling the gateway (so 0.5-1 s once the delays
/// have grown). Short, because an edge should serve again within 2 s of
/// its link's return: with [`DIAL_ATTEMPT`], at most 1.5 s pass between
/// two Initial packets toward the gateway (an attempt's second one, 1 s in,
/// then at most 0.5 s of the attempt and 1 s of delay), and the dial that
/// follows the return needs a round trip or two. Long enough that 1000
/// edges redialling a restarted gateway spread their handshakes over a
/// second or more rather than a few milliseconds. The delay starts again
/// from [`REDIAL_BASE`] only after a connection has stayed up this long,
/// so a gateway that accepts and then drops the edge at once is redialled
/// once a second at most, not five times a second.
pub const REDIAL_MAX: Duration = Duration::from_secs(1);

/// While the gateway stays unreachable, a WARN line this often (with the
/// attempts and how long it has been); the redials between are DEBUG.
pub const OUTAGE_REMINDER: Duration = Duration::from_secs(30);
/// Longest one dial may take to get a QUIC connection up. A dial into a
/// dead link backs its Initial packets off (sent at 0, ~1 s, ~3 s, ~7 s at
/// QUIC's default initial RTT): past this one is abandoned and, after the
/// redial delay, a fresh one starts whose first Initial goes out at once.
/// 1.5 s lets an attempt send two Initials (one may be lost on a lossy
/// link) and ends it before the 2 s silence that would follow. A gateway
/// that is reachable but slow to answer `Hello` is not cut short by this:
/// the wait for `Welcome` has its own bound (`uplink::HANDSHAKE_TIMEOUT`).
pub const DIAL_ATTEMPT: Duration = Duration::from_millis(1500);

/// Options of [`run`] that come from flags rather than the config file.
#[derive(Debug, Clone, Default)]
pub struct NodeOptions {
    /// Stop each camera after handing this many frames to the uplink, wait
    /// for their results, and return.
    pub max_frames: Option<u64>,
    /// Print every camera's counters this often (`None`: only at the end).
    pub summary_every: Option<Duration>,
    /// Also publish every camera's counters here, each `summary_every` and
    /// at the end (for an embedding program, or a test).
    pub stats: Option<watch::Sender<Vec<CameraSummary>>>,
    /// Record each dial, connection and disconnect of the uplink here
    /// (what `/metrics` reads at each scrape); unset, the node keeps its
    /// own record, unread.
    pub uplink: Option<Arc<UplinkStats>>,
}

/// The gateway's hints in force: the latest for all cameras, and the latest
/// per camera. A hint replaces the one before it; one for all cameras
/// replaces every per-camera hint too. A new connection starts with none.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HintBoard {
    all: Option<Hint>,
    per_camera: HashMap<String, Hint>,
}

impl HintBoard {
    /// Applies a hint from the gateway.
    pub fn apply(&mut self, h: &ControlHint) {
        let hint = Hint {
            max_fps: h.max_fps as f64,
            motion_threshold: h.motion_threshold as f64,
        };
        if h.camera.is_empty() {
            self.per_camera.clear();
            self.all = Some(hint);
        } else {
            self.per_camera.insert(h.camera.clone(), hint);
        }
    }

    /// The hint that applies to `camera`.
    pub fn for_camera(&self, camera: &str) -> Option<Hint> {
        self.per_camera.get(camera).copied().or(self.all)
    }
}

/// One camera's counters, shared between its task and the summaries. How
/// its frames ended beyond the wire (results for frames reset, frames lost
/// with their connection) is counted by the node's [`Unanswered`], which
/// sees both a frame's result and its fate on the wire.
#[derive(Debug, Default)]
pub struct CameraStats {
    /// Frames handed to the uplink (a stream opened for each).
    pub handed: AtomicU64,
    /// Wire outcomes.
    pub lane: Arc<LaneStats>,
    /// Frames that passed the gate while no connection (or no open camera)
    /// could take them, including a frame whose stream could not be opened
    /// because the connection had just gone: dropped, never sent late. Such
    /// a frame is counted here only, not in the lane's `lost`.
    pub dropped_outage: AtomicU64,
    /// Results received.
    pub results: AtomicU64,
    /// Results with status ok.
    pub ok: AtomicU64,
    /// Results late: `ok` but over the budget, or shed by the gateway as
    /// late on arrival (the link ate the budget).
    pub late: AtomicU64,
    /// The camera's budget (µs), what `late` is measured against.
    budget_us: u64,
    snapshot: Mutex<CameraSnapshot>,
}

#[derive(Debug, Clone, Default)]
struct CameraSnapshot {
    state: &'static str,
    /// The model's class names, from `CameraAccepted`.
    labels: Arc<Vec<String>>,
    capture: crate::capture::CaptureCounters,
    limits: Option<Limits>,
    outbound: Option<OutboundReport>,
}

impl CameraStats {
    fn snapshot(&self) -> std::sync::MutexGuard<'_, CameraSnapshot> {
        self.snapshot.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn set_state(&self, state: &'static str) {
        self.snapshot().state = state;
    }

    /// Counts a result of this camera, of a frame captured at
    /// `captured_at_us`, that came back at `now_us`.
    fn on_result(&self, status: &Status, captured_at_us: u64, now_us: u64) {
        self.results.fetch_add(1, Ordering::Relaxed);
        let ok = *status == Status::Ok;
        if ok {
            self.ok.fetch_add(1, Ordering::Relaxed);
        }
        let e2e_us = now_us.saturating_sub(captured_at_us);
        if (ok && e2e_us > self.budget_us) || *status == Status::Shed(ShedReason::LateOnArrival) {
            self.late.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn result_counts(&self) -> ResultCounts {
        ResultCounts {
            results: self.results.load(Ordering::Relaxed),
            late: self.late.load(Ordering::Relaxed),
        }
    }
}

/// A camera's counters as printed in the summaries (`camera_stats {json}`).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct CameraSummary {
    /// Camera name.
    pub camera: String,
    /// `starting`, `running`, `waiting` (for the gateway or a worker),
    /// `stopped` or `failed`.
    pub state: &'static str,
    /// Frames the pipeline produced.
    pub seen: u64,
    /// Frames that passed the rate cap and motion gate.
    pub passed: u64,
    /// Frames over the rate cap.
    pub skipped_rate: u64,
    /// Frames the motion gate found static.
    pub skipped_static: u64,
    /// Frames evicted from the capture queue unread.
    pub dropped_queue: u64,
    /// Frames dropped while the gateway was unreachable (or no camera was
    /// open on the connection): never handed to the uplink.
    pub dropped_outage: u64,
    /// Frames handed to the uplink. Each ends once, as one of `results`,
    /// `reset_superseded`, `reset_expired`, `refused`, `lost`,
    /// `lost_connection` or `gave_up`, or is still `awaiting`.
    pub handed: u64,
    /// Frames acknowledged by the gateway.
    pub delivered: u64,
    /// Frames reset because a newer one superseded them, without a result
    /// (one the gateway had read and answered anyway counts as a result).
    pub reset_superseded: u64,
    /// Frames reset at their deadline, without a result.
    pub reset_expired: u64,
    /// Frames refused by the gateway, without a result.
    pub refused: u64,
    /// Frames whose stream was open when their connection was lost,
    /// without a result.
    pub lost: u64,
    /// Frames acknowledged by the gateway whose result had not come when
    /// their connection ended (lost, or closed by the edge as it stopped).
    pub lost_connection: u64,
    /// Frames acknowledged whose result was given up on while their
    /// connection lived (over 1024 newer frames of the camera came first):
    /// 0 unless the gateway loses results.
    pub gave_up: u64,
    /// Frames handed that have not ended yet: on the wire, or acknowledged
    /// and awaiting their result.
    pub awaiting: u64,
    /// Results received (a second result for a frame, or one for a frame
    /// this edge did not send, included).
    pub results: u64,
    /// Results with status ok.
    pub ok: u64,
    /// Pipeline restarts.
    pub restarts: u64,
    /// Frame-rate cap in force: the configured one, the gateway's hint and
    /// the adaptation's, whichever is strictest.
    pub max_fps: f64,
    /// Motion threshold in force.
    pub motion_threshold: f64,
    /// How frames travel: `raw`, `jpeg` or `png` (as the gateway accepted
    /// it, once it has).
    pub encoding: &'static str,
    /// JPEG quality in force (0 for other encodings).
    pub quality: u8,
    /// The adaptation's own frame-rate cap (the configured `max_fps` until
    /// the uplink makes it lower it).
    pub adapt_max_fps: f64,
    /// Mean bytes of a frame handed to QUIC, over the last 1 s window that
    /// sent any.
    pub bytes_per_frame: u64,
    /// Mean time to encode a frame (µs), over the last 1 s window that
    /// encoded any (0 for raw).
    pub encode_us: u64,
    /// Frames encoded.
    pub encoded: u64,
    /// Frames the encoder failed (each dropped alone).
    pub encode_failed: u64,
    /// Results late: ok but over the budget, or shed as late on arrival.
    pub late: u64,
    /// The uplink's smoothed round trip at the last window (ms; 0 without
    /// a connection).
    pub rtt_ms: f64,
}

impl CameraSummary {
    /// The counters of camera `name` now; `ends` from the node's
    /// [`Unanswered`].
    fn of(name: &str, s: &CameraStats, ends: FrameEnds) -> Self {
        let snap = s.snapshot().clone();
        let l = &s.lane;
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        // A frame the lane reset, or lost, that was answered all the same
        // ended as its result.
        let net = |c: &AtomicU64, answered: u64| load(c).saturating_sub(answered);
        CameraSummary {
            camera: name.to_string(),
            state: if snap.state.is_empty() {
                "starting"
            } else {
                snap.state
            },
            seen: snap.capture.seen,
            passed: snap.capture.passed,
            skipped_rate: snap.capture.skipped_rate,
            skipped_static: snap.capture.skipped_static,
            dropped_queue: snap.capture.dropped_queue,
            dropped_outage: load(&s.dropped_outage),
            handed: load(&s.handed),
            delivered: load(&l.delivered),
            reset_superseded: net(&l.superseded, ends.answered_superseded),
            reset_expired: net(&l.expired, ends.answered_expired),
            refused: net(&l.refused, ends.answered_refused),
            lost: net(&l.lost, ends.answered_lost),
            lost_connection: ends.lost_connection,
            gave_up: ends.gave_up,
            awaiting: ends.awaiting,
            results: load(&s.results),
            ok: load(&s.ok),
            restarts: snap.capture.restarts,
            max_fps: snap.limits.map_or(0.0, |l| l.max_fps),
            motion_threshold: snap.limits.map_or(0.0, |l| l.motion_threshold),
            encoding: snap.outbound.map_or("", |o| o.codec.name()),
            quality: snap.outbound.map_or(0, |o| o.quality),
            adapt_max_fps: snap.outbound.map_or(0.0, |o| o.adapt_max_fps),
            bytes_per_frame: snap.outbound.map_or(0, |o| o.bytes_per_frame),
            encode_us: snap.outbound.map_or(0, |o| o.encode_us),
            encoded: snap.outbound.map_or(0, |o| o.encoded),
            encode_failed: snap.outbound.map_or(0, |o| o.encode_failed),
            late: load(&s.late),
            rtt_ms: snap.outbound.map_or(0.0, |o| o.rtt.as_secs_f64() * 1e3),
        }
    }
}

/// What the link task hands the node, in the order it happened.
#[derive(Debug)]
enum FromLink {
    /// A frame's result.
    Result(FrameResult),
    /// Connection [`Uplink::id`] has ended, and every result it delivered
    /// came before this.
    Ended(u64),
}

impl FromLink {
    /// Roughly the memory it holds, in bytes.
    fn held_bytes(&self) -> usize {
        match self {
            FromLink::Result(r) => r.held_bytes(),
            FromLink::Ended(_) => std::mem::size_of::<FromLink>(),
        }
    }
}

/// Logs the frames [`Unanswered`] has just counted lost with a connection
/// (`lost_connection`): one line for the connection, naming the cameras
/// (each camera's count is in its `camera_stats`).
fn lost_with_connection(lost: std::collections::BTreeMap<String, u64>, why: &str) {
    if lost.is_empty() {
        return;
    }
    let frames: u64 = lost.values().sum();
    let cameras: Vec<&str> = lost.keys().map(String::as_str).collect();
    warn!(
        frames,
        cameras = cameras.len(),
        "frames acknowledged by the gateway lost with the connection ({why}): their results never came (cameras {})",
        cameras.join(", ")
    );
}

/// What [`run`] returns.
#[derive(Debug, Clone)]
pub struct Summary {
    /// Frames acknowledged by the gateway, all cameras.
    pub sent: u64,
    /// Results received.
    pub results: u64,
    /// Results with status ok.
    pub ok: u64,
    /// Per camera.
    pub cameras: Vec<CameraSummary>,
}

impl Summary {
    /// Prints the summary to stderr: one `summary:` line, then one
    /// `camera_stats {json}` line per camera.
    pub fn print(&self) {
        eprintln!(
            "summary: sent={} results={} ok={}",
            self.sent, self.results, self.ok
        );
        print_cameras(&self.cameras);
    }
}

fn print_cameras(cameras: &[CameraSummary]) {
    for c in cameras {
        if let Ok(json) = serde_json::to_string(c) {
            eprintln!("camera_stats {json}");
        }
    }
}

/// Why the node could not run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NodeError {
    /// The gateway refused us for good (bad token, unsupported version).
    #[error("the gateway refused this edge: {0}")]
    Refused(#[source] UplinkError),
    /// The uplink cannot be set up on this machine: the CA file
    /// (`gateway.ca`) cannot be loaded, or no UDP socket can be bound
    /// before the first connection. Not the gateway's doing.
    #[error("cannot set up the uplink on this machine (not the gateway's doing): {0}")]
    Local(#[source] UplinkError),
    /// Writing a result failed.
    #[error("writing a result: {0}")]
    Sink(#[source] std::io::Error),
    /// The thread that writes results could not be started.
    #[error("starting the result sink thread: {0}")]
    SinkThread(#[source] std::io::Error),
    /// The result sinks did not finish writing what was queued.
    #[error(transparent)]
    SinkFinish(#[from] FinishError),
}

impl NodeError {
    /// The node's error for a connection failure that ends it: a local
    /// problem, or the gateway's refusal.
    fn fatal(e: UplinkError) -> Self {
        if e.is_local() {
            NodeError::Local(e)
        } else {
            NodeError::Refused(e)
        }
    }
}

/// Runs the edge until `shutdown` resolves, or until every camera has
/// stopped (with `max_frames`, once each has sent that many frames; a
/// `file://` camera without `loop` at the end of its file; a bad entry at
/// once) and the results of the frames still out are in, waiting for them
/// at most [`RESULT_DRAIN`].
pub async fn run(
    cfg: EdgeConfig,
    sinks: Sinks,
    options: NodeOptions,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<Summary, NodeError> {
    let mut sinks = sinks
        .spawn(SINK_QUEUE, SINK_QUEUE_BYTES)
        .map_err(NodeError::SinkThread)?;
    let cancel = CancellationToken::new();
    let tracker = TaskTracker::new();
    let (link_tx, link_rx) = watch::channel::<Option<Uplink>>(None);
    let (hints_tx, hints_rx) = watch::channel(HintBoard::default());
    let (results_tx, mut results_rx) =
        queue::channel::<FromLink>(RESULTS_QUEUE, RESULTS_QUEUE_BYTES);
    let (fatal_tx, mut fatal_rx) = mpsc::channel::<UplinkError>(1);
    let unanswered = Arc::new(Unanswered::default());

    let shell = LinkShell {
        link_tx,
        hints_tx,
        results: results_tx,
        fatal: fatal_tx,
        stats: options.uplink.clone().unwrap_or_else(|| uplink_stats(&cfg)),
        cancel: cancel.clone(),
    };
    let link_task = tokio::spawn(
        link(cfg.clone(), shell)
            .instrument(info_span!("link", gateway = %cfg.gateway.addr, edge = %cfg.name)),
    );

    let mut stats: Vec<(String, Arc<CameraStats>)> = Vec::new();
    for cam in cfg.cameras.clone() {
        let s = Arc::new(CameraStats {
            budget_us: u64::from(cam.budget_ms) * 1000,
            ..CameraStats::default()
        });
        stats.push((cam.name.clone(), s.clone()));
        let span = info_span!("camera", camera = %cam.name, model = %cam.model);
        tracker.spawn(
            camera(
                cam,
                link_rx.clone(),
                hints_rx.clone(),
                s,
                unanswered.clone(),
                cancel.clone(),
                options.max_frames,
            )
            .instrument(span),
        );
    }
    tracker.close();
    let by_name: HashMap<String, Arc<CameraStats>> = stats.iter().cloned().collect();
    let summaries = || -> Vec<CameraSummary> {
        stats
            .iter()
            .map(|(n, s)| CameraSummary::of(n, s, unanswered.ends(n)))
            .collect()
    };
    let sent = || -> u64 {
        stats
            .iter()
            .map(|(_, s)| s.lane.delivered.load(Ordering::Relaxed))
            .sum()
    };

    tokio::pin!(shutdown);
    let mut results = 0u64;
    let mut ok = 0u64;
    let mut drain_deadline = None::<Instant>;
    let mut summary_tick = options.summary_every.map(|d| {
        let mut i = tokio::time::interval_at(Instant::now() + d, d);
        i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        i
    });
    let mut outcome = Ok(());
    loop {
        // Results still to come, or come and not yet handed to the sinks.
        let waiting = !unanswered.is_empty() || !results_rx.is_empty();
        if tracker.is_empty() && drain_deadline.is_none() {
            // Every camera stopped (bad entries, files that ended, or
            // `max_frames` reached): once the frames still out are
            // answered, the edge has nothing left to do.
            if !waiting {
                info!("every camera has stopped");
                break;
            }
            info!(
                frames = unanswered.len(),
                "every camera has stopped; waiting up to {RESULT_DRAIN:?} for the results of the frames still out"
            );
            drain_deadline = Some(Instant::now() + RESULT_DRAIN);
        }
        if drain_deadline.is_some() && !waiting {
            info!("every camera has stopped and every result is in");
            break;
        }
        let drain = async {
            match drain_deadline {
                Some(t) => tokio::time::sleep_until(t).await,
                None => std::future::pending().await,
            }
        };
        let tick = async {
            match &mut summary_tick {
                Some(t) => {
                    t.tick().await;
                }
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = &mut shutdown => { info!("shutting down"); break; }
            _ = drain => {
                warn!(
                    frames = unanswered.len(),
                    "gave up waiting for the last results after {RESULT_DRAIN:?}"
                );
                break;
            }
            _ = tracker.wait(), if drain_deadline.is_none() => {}
            // Frames abandoned (reset, or lost with the connection) while
            // draining: nothing more to wait for.
            _ = unanswered.emptied(), if drain_deadline.is_some() && !unanswered.is_empty() => {}
            _ = tick => {
                let now = summaries();
                print_cameras(&now);
                if let Some(tx) = &options.stats {
                    tx.send_replace(now);
                }
            }
            _ = sinks.stopped() => {
                // A write failed; `finish` below says which.
                break;
            }
            e = fatal_rx.recv() => {
                if let Some(e) = e {
                    outcome = Err(NodeError::fatal(e));
                }
                break;
            }
            msg = results_rx.recv() => match msg {
                Some(FromLink::Ended(conn)) => {
                    // Every result of the connection has been handled.
                    lost_with_connection(unanswered.connection_ended(conn), "it ended");
                }
                Some(FromLink::Result(r)) => {
                    let now = crate::clock::now_us();
                    let labels = by_name
                        .get(&r.camera)
                        .map(|s| s.snapshot().labels.clone())
                        .unwrap_or_default();
                    let (camera, seq) = (r.camera.clone(), r.seq);
                    let (status, captured_at_us) = (r.status.clone(), r.captured_at_us);
                    // Serialised and written on the sink thread, in order;
                    // waits while its queue is full.
                    tokio::select! {
                        queued = sinks.write(r, now, labels) => if queued.is_err() {
                            // The thread stopped on a failed write; `finish`
                            // below says which.
                            break;
                        },
                        _ = &mut shutdown => { info!("shutting down"); break; }
                    }
                    // Handed to the sinks: `finish` below writes it. Counted
                    // only now: a result cut off above is not written, and
                    // its frame is lost with the connection instead.
                    results += 1;
                    if status == Status::Ok {
                        ok += 1;
                    }
                    if let Some(s) = by_name.get(&camera) {
                        s.on_result(&status, captured_at_us, now);
                    }
                    unanswered.answered(&camera, seq);
                }
                None => break,
            },
        }
    }
    cancel.cancel();
    tracker.wait().await;
    let _ = link_task.await;
    // The connection is closed, and the results still queued are not
    // written: the frames awaiting them are lost with it.
    lost_with_connection(unanswered.clear(), "the edge stopped");
    // The loop may have ended on another branch (the results channel
    // closing with the link) while a refusal was waiting: it still decides
    // the exit.
    if outcome.is_ok()
        && let Ok(e) = fatal_rx.try_recv()
    {
        outcome = Err(NodeError::fatal(e));
    }
    // Everything queued for the sinks is written before the webhook closes.
    match sinks.finish(SINK_DRAIN).await {
        Ok(mut report) => {
            if let Some(e) = report.error.take() {
                error!(
                    written = report.written,
                    unwritten = report.unwritten,
                    "writing a result failed: {e}"
                );
                if outcome.is_ok() {
                    outcome = Err(NodeError::Sink(e));
                }
            }
            if let Some(m) = report.sinks.mqtt.take() {
                m.close(SINK_DRAIN).await;
            }
            if let Some(w) = report.sinks.webhook.take() {
                let stats = w.close(SINK_DRAIN).await;
                let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
                info!(
                    pushed = load(&stats.pushed),
                    posted = load(&stats.posted),
                    dropped_full = load(&stats.dropped_full),
                    dropped_failed = load(&stats.dropped_failed),
                    dropped_shutdown = load(&stats.dropped_shutdown),
                    retries = load(&stats.retries),
                    "webhook closed"
                );
            }
        }
        Err(e) => {
            error!("{e}");
            if outcome.is_ok() {
                outcome = Err(NodeError::SinkFinish(e));
            }
        }
    }
    let cameras = summaries();
    if let Some(tx) = &options.stats {
        tx.send_replace(cameras.clone());
    }
    outcome?;
    Ok(Summary {
        sent: sent(),
        results,
        ok,
        cameras,
    })
}

/// A record of the uplink to `cfg`'s gateway, labelled with its address
/// as configured, for [`NodeOptions::uplink`] and the metrics.
pub fn uplink_stats(cfg: &EdgeConfig) -> Arc<UplinkStats> {
    Arc::new(UplinkStats::new(
        &cfg.gateway.addr.to_string(),
        cfg.gateway.congestion,
    ))
}

/// What the link task hands on and listens to, beside its config.
struct LinkShell {
    /// The live uplink, for the cameras (`None` between connections).
    link_tx: watch::Sender<Option<Uplink>>,
    hints_tx: watch::Sender<HintBoard>,
    results: queue::Sender<FromLink>,
    /// A failure that ends the node (a refusal for good, a local fault).
    fatal: mpsc::Sender<UplinkError>,
    /// Each dial and each connection's end, for the metrics.
    stats: Arc<UplinkStats>,
    cancel: CancellationToken,
}

/// How [`LinkShell::serve`] ended.
#[derive(Debug, PartialEq, Eq)]
enum Served {
    /// The connection ended and the node has been told, after its results.
    Ended,
    /// The edge is stopping (or the node stopped reading): the link ends.
    Stopped,
}

/// Keeps a connection to the gateway: dials with jittered exponential
/// backoff (each dial bounded by [`DIAL_ATTEMPT`]), publishes the uplink,
/// forwards results, applies hints ([`LinkShell::serve`]), and starts over
/// when the connection is lost, telling the node after the connection's
/// last result. The CA is loaded once, here: a redial never reads it again.
/// The backoff starts again from [`REDIAL_BASE`] only after a connection
/// has stayed up [`REDIAL_MAX`]. Every dial and every connection's end is
/// recorded in the shell's [`UplinkStats`].
async fn link(cfg: EdgeConfig, shell: LinkShell) {
    let client = match tidegate_protocol::quic::client_config_with(
        &cfg.gateway.ca,
        cfg.gateway.congestion,
    ) {
        Ok(c) => c,
        Err(e) => {
            let e = UplinkError::Tls(e);
            error!("gateway.ca: {e}");
            let _ = shell.fatal.send(e).await;
            return;
        }
    };
    let mut backoff = Backoff::seeded(REDIAL_BASE, REDIAL_MAX, &cfg.name);
    // one WARN for an outage, then one every OUTAGE_REMINDER: not one per
    // redial
    let mut outage = Outage::new(OUTAGE_REMINDER);
    let mut connected_before = false;
    loop {
        // Resolved at every dial: a redial follows a gateway that moved.
        let dial = Uplink::connect_client(
            &cfg.gateway.addr,
            &cfg.gateway.server_name,
            client.clone(),
            &cfg.name,
            &cfg.token.0,
            UplinkOptions {
                dial_timeout: Some(DIAL_ATTEMPT),
                ..UplinkOptions::default()
            },
        );
        let connected = tokio::select! {
            _ = shell.cancel.cancelled() => return,
            r = dial => r,
        };
        let (uplink, incoming) = match connected {
            Ok(u) => u,
            Err(e) => {
                shell.stats.dial_failed(&e);
                // A local failure (no UDP socket) once the edge has worked
                // is passing: retried like the gateway's.
                if !(e.retryable() || (connected_before && e.is_local())) {
                    error!("{e}");
                    let _ = shell.fatal.send(e).await;
                    return;
                }
                let delay = backoff.next_delay();
                match outage.failed(std::time::Instant::now()) {
                    Loudness::Warn { attempts, down_for } => {
                        warn!(attempts, ?down_for, "{e}; retrying in {delay:?}");
                    }
                    Loudness::Debug => debug!("{e}; retrying in {delay:?}"),
                }
                tokio::select! {
                    _ = shell.cancel.cancelled() => return,
                    _ = tokio::time::sleep(delay) => continue,
                }
            }
        };
        connected_before = true;
        let up_since = Instant::now();
        match outage.recovered(std::time::Instant::now()) {
            Some((attempts, down_for)) => {
                info!(addr = %uplink.remote_address(), attempts, ?down_for, "connected again")
            }
            None => info!(addr = %uplink.remote_address(), "connected"),
        }
        shell
            .stats
            .dialled(std::time::Instant::now(), Arc::new(uplink.clone()));
        if shell.serve(&uplink, incoming).await == Served::Stopped {
            return;
        }
        let why = uplink.closed().await;
        shell.link_tx.send_replace(None);
        if let Some(e) = uplink.close_reason() {
            shell.stats.disconnected(DisconnectReason::of(&e));
        }
        let up_for = up_since.elapsed();
        if !backoff.reset_if_stable(up_for) {
            debug!(
                ?up_for,
                "the connection did not stay up; the redial delay keeps growing"
            );
        }
        let delay = backoff.next_delay();
        // the outage's one loud line; the redials that fail are quiet
        let _ = outage.failed(std::time::Instant::now());
        warn!(
            "connection to the gateway lost ({why}); frames are dropped until it is back; reconnecting in {delay:?}"
        );
        tokio::select! {
            _ = shell.cancel.cancelled() => return,
            _ = tokio::time::sleep(delay) => {}
        }
    }
}

impl LinkShell {
    /// Publishes `uplink` to the cameras, forwards its results to the node
    /// and applies its hints until the connection ends, then tells the node
    /// that it ended (after its last result).
    async fn serve(&self, uplink: &Uplink, mut incoming: queue::Receiver<Incoming>) -> Served {
        self.hints_tx.send_modify(|h| *h = HintBoard::default());
        self.link_tx.send_replace(Some(uplink.clone()));
        loop {
            tokio::select! {
                _ = self.cancel.cancelled() => return self.stop(uplink),
                msg = incoming.recv() => match msg {
                    Some(Incoming::Result(r)) => {
                        let e2e = crate::clock::now_us().saturating_sub(r.captured_at_us);
                        uplink.report_latency(&r.camera, r.seq, e2e);
                        let r = FromLink::Result(r);
                        let size = r.held_bytes();
                        // The node stops reading when it stops: so may we.
                        tokio::select! {
                            _ = self.cancel.cancelled() => return self.stop(uplink),
                            sent = self.results.send(r, size) => if sent.is_err() {
                                return Served::Stopped;
                            },
                        }
                    }
                    Some(Incoming::Hint(h)) => {
                        info!(camera = %h.camera, max_fps = h.max_fps, motion_threshold = h.motion_threshold, "control hint");
                        self.hints_tx.send_modify(|b| b.apply(&h));
                    }
                    None => break,
                },
            }
        }
        // Every result the connection delivered has been forwarded: the
        // frames still waiting for one will never get it. The node counts
        // them once it has handled those results.
        let ended = FromLink::Ended(uplink.id());
        let size = ended.held_bytes();
        tokio::select! {
            _ = self.cancel.cancelled() => Served::Stopped,
            sent = self.results.send(ended, size) => if sent.is_err() {
                Served::Stopped
            } else {
                Served::Ended
            },
        }
    }

    /// The edge is stopping: the cameras let go of `uplink`, which is
    /// closed.
    fn stop(&self, uplink: &Uplink) -> Served {
        self.link_tx.send_replace(None);
        uplink.close();
        self.stats.disconnected(DisconnectReason::ClosedByEdge);
        Served::Stopped
    }
}

/// The configured limits of a camera.
fn configured_limits(cam: &CameraConfig) -> Limits {
    Limits {
        max_fps: cam.max_fps,
        motion_threshold: cam.motion_threshold,
        keepalive_fps: cam.keepalive_fps,
    }
}

/// Why a camera entry cannot run, found before the gateway is reached.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PreflightError {
    /// The entry itself is wrong (no model, no uri, a value out of range).
    #[error(transparent)]
    Entry(#[from] ConfigError),
    /// The URI cannot be used (unknown scheme, no host, not an absolute
    /// path).
    #[error("camera '{camera}': cannot use source URI '{uri}': {source}")]
    Uri {
        /// The camera.
        camera: String,
        /// The URI as configured.
        uri: String,
        /// What is wrong with it.
        source: crate::capture::UriError,
    },
    /// The local file of a `file://` or `image://` URI is not a regular
    /// file.
    #[error("camera '{camera}': '{}' from URI '{uri}' is not a regular file", path.display())]
    NotAFile {
        /// The camera.
        camera: String,
        /// The URI as configured.
        uri: String,
        /// The path it names.
        path: std::path::PathBuf,
    },
    /// The local file of a `file://` or `image://` URI cannot be read.
    #[error(
        "camera '{camera}': cannot open '{}' from URI '{uri}': {source}; check that the file exists and is readable",
        path.display()
    )]
    Unreadable {
        /// The camera.
        camera: String,
        /// The URI as configured.
        uri: String,
        /// The path it names.
        path: std::path::PathBuf,
        /// Why it cannot be read.
        source: std::io::Error,
    },
}

/// Checks what can be checked of a camera entry before the gateway is
/// reached: the entry, the URI, and that a local file exists. `run` disables
/// a camera that fails it; `check-config` reports it.
pub fn preflight(cam: &CameraConfig) -> Result<(), PreflightError> {
    cam.validate()?;
    let source: SourceUri = cam.uri.parse().map_err(|source| PreflightError::Uri {
        camera: cam.name.clone(),
        uri: cam.uri.clone(),
        source,
    })?;
    match source {
        SourceUri::File { path, .. } | SourceUri::Image { path } => {
            match std::fs::metadata(&path) {
                Ok(m) if m.is_file() => Ok(()),
                Ok(_) => Err(PreflightError::NotAFile {
                    camera: cam.name.clone(),
                    uri: cam.uri.clone(),
                    path,
                }),
                Err(source) => Err(PreflightError::Unreadable {
                    camera: cam.name.clone(),
                    uri: cam.uri.clone(),
                    path,
                    source,
                }),
            }
        }
        _ => Ok(()),
    }
}

/// A camera's capture, and what the captures it replaced left behind. A
/// gateway that announces another input on a new connection gets a new
/// capture, which goes on from the old one: its `seq` continues, and the
/// camera's counters keep counting up.
#[derive(Debug, Default)]
struct CameraCapture {
    current: Option<SupervisedCapture>,
    /// Counters of the captures stopped so far, summed.
    stopped: CaptureCounters,
    /// The `seq` the next capture starts at.
    next_seq: u64,
}

impl CameraCapture {
    /// The camera's counters, over every capture it has had.
    fn counters(&self) -> CaptureCounters {
        let mut c = self.stopped;
        if let Some(current) = &self.current {
            c.accumulate(&current.counters());
        }
        c
    }

    /// Stops the current capture, if any, keeping its counters (frames it
    /// still queued count as `dropped_queue`) and where its `seq` got to.
    async fn stop(&mut self) {
        if let Some(old) = self.current.take() {
            let (counters, next_seq) = old.stop().await;
            self.stopped.accumulate(&counters);
            self.next_seq = next_seq;
        }
    }

    /// Replaces the capture with `start(first_seq)`.
    async fn replace<E>(
        &mut self,
        start: impl FnOnce(u64) -> Result<SupervisedCapture, E>,
    ) -> Result<(), E> {
        self.stop().await;
        self.current = Some(start(self.next_seq)?);
        Ok(())
    }

    fn set_limits(&mut self, limits: Limits) {
        if let Some(c) = &mut self.current {
            c.set_limits(limits);
        }
    }

    /// The next frame; pending for ever without a capture.
    async fn recv(&mut self) -> Result<crate::capture::CapturedFrame, CameraStopped> {
        match &mut self.current {
            Some(c) => c.recv().await,
            None => std::future::pending().await,
        }
    }
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

/// One camera, for the life of the edge. See the module docs.
async fn camera(
    cam: CameraConfig,
    mut link_rx: watch::Receiver<Option<Uplink>>,
    mut hints_rx: watch::Receiver<HintBoard>,
    stats: Arc<CameraStats>,
    unanswered: Arc<Unanswered>,
    cancel: CancellationToken,
    max_frames: Option<u64>,
) {
    if let Err(e) = preflight(&cam) {
        error!("{e}; this camera is disabled, the others run");
        stats.set_state("failed");
        return;
    }
    let configured = configured_limits(&cam);
    let mut outbound = Outbound::new(&cam);
    // The limits with the gateway's hint, then with the adaptation's cap.
    let mut hinted = configured.with_hint(hints_rx.borrow_and_update().for_camera(&cam.name));
    let mut limits = hinted.with_rate_cap(outbound.max_fps());
    {
        let mut snap = stats.snapshot();
        snap.limits = Some(limits);
        snap.outbound = Some(outbound.report());
    }
    stats.set_state("waiting");
    let mut capture = CameraCapture::default();
    let mut input: Option<InputSpec> = None;
    let mut lane: Option<Lane> = None;
    // The connection the camera should be opened on, and when to try again.
    let mut open_on: Option<Uplink> = link_rx.borrow_and_update().clone();
    let mut open_at: Option<Instant> = Some(Instant::now());
    let mut handed = 0u64;
    // Counters refreshed, and the camera fitted to its uplink, once a window.
    let mut refresh = tokio::time::interval(crate::outbound::WINDOW);
    refresh.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        if max_frames.is_some_and(|m| handed >= m) {
            break;
        }
        tokio::select! {
            biased;
            _ = cancel.cancelled() => break,
            changed = link_rx.changed() => {
                if changed.is_err() {
                    break;
                }
                lane = None;
                open_on = link_rx.borrow_and_update().clone();
                open_at = open_on.as_ref().map(|_| Instant::now());
                if open_on.is_none() {
                    stats.set_state("waiting");
                }
            }
            _ = hints_rx.changed() => {
                let hint = hints_rx.borrow_and_update().for_camera(&cam.name);
                hinted = configured.with_hint(hint);
                let now = hinted.with_rate_cap(outbound.max_fps());
                if now != limits {
                    info!(
                        max_fps = now.max_fps,
                        motion_threshold = now.motion_threshold,
                        was_max_fps = limits.max_fps,
                        was_motion_threshold = limits.motion_threshold,
                        "limits changed by the gateway's hint"
                    );
                    limits = now;
                    capture.set_limits(limits);
                    let mut snap = stats.snapshot();
                    // Counters as of the change, so that a reader sees the
                    // new limits with the counts they start from.
                    snap.capture = capture.counters();
                    snap.limits = Some(limits);
                }
            }
            _ = sleep_until_opt(open_at), if open_on.is_some() => {
                open_at = None;
                let Some(uplink) = open_on.clone() else { continue };
                let opened = tokio::select! {
                    _ = cancel.cancelled() => break,
                    r = uplink.open_camera_with(tidegate_protocol::CameraOpen {
                        camera: cam.name.clone(),
                        model: cam.model.clone(),
                        budget_ms: cam.budget_ms,
                        encoding: outbound.asked(),
                        copies: cam.copies,
                    }) => r,
                };
                match opened {
                    Ok(accepted) => {
                        let spec = accepted.input;
                        stats.snapshot().labels = Arc::new(accepted.labels);
                        if spec.dtype != DType::U8 || spec.layout != Layout::Nhwc || spec.channels != 3 {
                            error!(
                                "model '{}' wants {} {} with {} channels; this edge produces u8 nhwc RGB; this camera is disabled",
                                cam.model, spec.dtype, spec.layout, spec.channels
                            );
                            stats.set_state("failed");
                            break;
                        }
                        let same = input.as_ref().is_some_and(|i| {
                            (i.width, i.height, i.resize) == (spec.width, spec.height, spec.resize)
                        });
                        if !same {
                            // Frames go on from the old capture's `seq`;
                            // its counters stay in the camera's.
                            let started = capture
                                .replace(|first_seq| start_capture(&cam, &spec, limits, first_seq))
                                .await;
                            stats.snapshot().capture = capture.counters();
                            match started {
                                Ok(()) => {}
                                Err(e) => {
                                    error!("{e}; this camera is disabled, the others run");
                                    stats.set_state("failed");
                                    break;
                                }
                            }
                            input = Some(spec);
                        }
                        let (width, height) = (spec.width, spec.height);
                        if let Err(e) = outbound.open(&cam, accepted.encoding, width, height).await {
                            error!("{e}; this camera is disabled, the others run");
                            stats.set_state("failed");
                            break;
                        }
                        // The adaptation starts afresh on every connection
                        // (`Outbound::open`): its cap in force goes with it,
                        // or a cap learned in an outage would hold the
                        // camera down while the fresh policy, already at
                        // its top, has nothing to raise.
                        let now = hinted.with_rate_cap(outbound.max_fps());
                        if now != limits {
                            limits = now;
                            capture.set_limits(limits);
                            stats.snapshot().limits = Some(limits);
                        }
                        stats.snapshot().outbound = Some(outbound.report());
                        info!(width, height, encoding = %accepted.encoding, "camera open");
                        lane = Some(
                            uplink
                                .lane_with(
                                    &cam.name,
                                    cam.max_in_flight,
                                    stats.lane.clone(),
                                    Some(unanswered.clone()),
                                )
                                .with_copies(accepted.copies),
                        );
                        stats.set_state("running");
                    }
                    Err(e) if e.retryable() => {
                        if uplink.is_closed() {
                            // the link logs the connection's loss once
                            debug!("{e}; opening the camera again once the gateway is redialled");
                            open_on = None;
                            stats.set_state("waiting");
                        } else {
                            let first = match &e {
                                UplinkError::Refused { code, .. } => {
                                    uplink.first_refusal(*code, &cam.model)
                                }
                                _ => true,
                            };
                            if first {
                                warn!("{e}; retrying in 1 s (cameras of model {} refused alike on this connection retry quietly)", cam.model);
                            } else {
                                debug!("{e}; retrying in 1 s");
                            }
                            open_at = Some(Instant::now() + Duration::from_secs(1));
                        }
                    }
                    Err(e) => {
                        error!("cannot open camera: {e}; this camera is disabled, the others run");
                        stats.set_state("failed");
                        break;
                    }
                }
            }
            _ = refresh.tick() => {
                // The window counts whatever the connection; the policy
                // decides only while the camera is open on one.
                let open = lane.as_ref().and(open_on.as_ref());
                let decided = outbound.on_window(
                    crate::clock::now_us(),
                    &stats.lane,
                    stats.result_counts(),
                    open.map(Uplink::path_stats),
                );
                // One bottleneck: the other cameras on it back off too.
                if let (Some(queued), Some(uplink)) = (outbound.uplink_report(), open) {
                    uplink.report_pressed(queued);
                }
                let mut snap = stats.snapshot();
                if decided.is_some() {
                    let now = hinted.with_rate_cap(outbound.max_fps());
                    if now != limits {
                        limits = now;
                        capture.set_limits(limits);
                        snap.limits = Some(limits);
                    }
                }
                snap.capture = capture.counters();
                snap.outbound = Some(outbound.report());
            }
            frame = capture.recv() => match frame {
                Ok(frame) => {
                    {
                        let mut snap = stats.snapshot();
                        snap.capture = capture.counters();
                        snap.outbound = Some(outbound.report());
                    }
                    let Some(l) = &lane else {
                        stats.dropped_outage.fetch_add(1, Ordering::Relaxed);
                        continue;
                    };
                    let Some(spec) = &input else { continue };
                    // The whole budget travels, counted from capture: the
                    // gateway knows how long the frame waited on the way.
                    let budget_us = cam.budget_ms as u64 * 1000;
                    let left_us = budget_us
                        .saturating_sub(crate::clock::now_us().saturating_sub(frame.captured_at_us));
                    let deadline = Instant::now() + Duration::from_micros(left_us);
                    // Encoded as the gateway accepted; a frame the encoder
                    // fails is dropped alone (counted and logged there).
                    let Some(tensor) = outbound.tensor(frame.data, spec.frame_shape()).await else {
                        continue;
                    };
                    let bytes = tensor.data.len();
                    let msg = Frame {
                        camera: cam.name.clone(),
                        seq: frame.seq,
                        captured_at_us: frame.captured_at_us,
                        budget_us: budget_us.min(u32::MAX as u64) as u32,
                        model: cam.model.clone(),
                        geometry: frame.geometry,
                        tensor,
                    };
                    match l.send(msg, deadline).await {
                        Ok(()) => {
                            handed += 1;
                            stats.handed.fetch_add(1, Ordering::Relaxed);
                            outbound.handed(bytes);
                        }
                        Err(e) => {
                            if matches!(e, UplinkError::Lost(_)) {
                                // the link logs the connection's loss once
                                debug!("sending a frame: {e}; dropping frames until the camera is open again");
                            } else {
                                warn!("sending a frame: {e}; dropping frames until the camera is open again");
                            }
                            stats.dropped_outage.fetch_add(1, Ordering::Relaxed);
                            lane = None;
                        }
                    }
                }
                Err(e) => {
                    match &e {
                        CameraStopped::Ended(_) => {
                            info!("{e}");
                            stats.set_state("stopped");
                        }
                        _ => {
                            error!("{e}; this camera is disabled, the others run");
                            stats.set_state("failed");
                        }
                    }
                    capture.stop().await;
                    stats.snapshot().capture = capture.counters();
                    break;
                }
            },
        }
    }
    if let Some(l) = &lane {
        l.settle(SETTLE).await;
    }
    outbound.on_window(
        crate::clock::now_us(),
        &stats.lane,
        stats.result_counts(),
        None,
    );
    stats.snapshot().outbound = Some(outbound.report());
    stats.snapshot().capture = capture.counters();
    let mut snap = stats.snapshot();
    if matches!(snap.state, "running" | "waiting" | "") {
        snap.state = "stopped";
    }
    info!(handed, "camera stopped");
}

/// A capture of `cam` at the model's `input`, its first frame numbered
/// `first_seq`.
fn start_capture(
    cam: &CameraConfig,
    input: &InputSpec,
    limits: Limits,
    first_seq: u64,
) -> Result<SupervisedCapture, crate::capture::CaptureError> {
    let spec = CaptureSpec {
        camera: cam.name.clone(),
        uri: cam.uri.clone(),
        width: input.width,
        height: input.height,
        resize: input.resize,
        max_fps: cam.max_fps,
    };
    let options = SupervisorOptions {
        capture: CaptureOptions {
            rtsp_transport: cam.rtsp_transport,
            motion_threshold: cam.motion_threshold,
            keepalive_fps: cam.keepalive_fps,
            first_seq,
            ..CaptureOptions::default()
        },
        loop_file: cam.loop_file,
        ..SupervisorOptions::default()
    };
    let mut c = SupervisedCapture::new(spec, options)?;
    c.set_limits(limits);
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hint(camera: &str, max_fps: f32, motion_threshold: f32) -> ControlHint {
        ControlHint {
            camera: camera.into(),
            max_fps,
            motion_threshold,
        }
    }

    #[test]
    fn a_hint_replaces_the_previous_one_and_all_cameras_replaces_every_hint() {
        let mut b = HintBoard::default();
        assert_eq!(b.for_camera("door"), None);
        b.apply(&hint("door", 5.0, 0.0));
        assert_eq!(b.for_camera("door").unwrap().max_fps, 5.0);
        assert_eq!(b.for_camera("yard"), None);
        b.apply(&hint("door", 0.0, 0.1));
        let d = b.for_camera("door").unwrap();
        assert_eq!((d.max_fps, d.motion_threshold as f32), (0.0, 0.1));
        b.apply(&hint("", 2.0, 0.0));
        assert_eq!(b.for_camera("door").unwrap().max_fps, 2.0);
        assert_eq!(b.for_camera("yard").unwrap().max_fps, 2.0);
        b.apply(&hint("yard", 1.0, 0.0));
        assert_eq!(b.for_camera("yard").unwrap().max_fps, 1.0);
        assert_eq!(b.for_camera("door").unwrap().max_fps, 2.0);
    }

    #[test]
    fn effective_limits_follow_the_latest_hint_only() {
        let cam_limits = Limits {
            max_fps: 10.0,
            motion_threshold: 0.0,
            keepalive_fps: 0.5,
        };
        let mut b = HintBoard::default();
        b.apply(&hint("", 4.0, 0.05));
        let l = cam_limits.with_hint(b.for_camera("c"));
        assert_eq!(l.max_fps, 4.0);
        assert!((l.motion_threshold - 0.05).abs() < 1e-6);
        // The next hint lifts the cap again: it replaces, it does not stack.
        b.apply(&hint("", 0.0, 0.0));
        assert_eq!(cam_limits.with_hint(b.for_camera("c")), cam_limits);
    }

    fn cam(uri: &str, model: &str) -> CameraConfig {
        toml::from_str(&format!(
            "name = \"c\"\nuri = \"{uri}\"\nmodel = \"{model}\"\n"
        ))
        .unwrap()
    }

    fn square(side: u32) -> InputSpec {
        InputSpec {
            width: side,
            height: side,
            channels: 3,
            dtype: DType::U8,
            layout: Layout::Nhwc,
            color: tidegate_protocol::ColorOrder::Rgb,
            resize: tidegate_protocol::Resize::Stretch,
        }
    }

    /// A new input (the gateway announced another size on a reconnect)
    /// replaces the capture: the new one numbers its frames on from the old
    /// one, and the camera's counters keep the old one's, frames it still
    /// had queued counted as dropped.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_replaced_capture_goes_on_from_the_old_ones_seq_and_counters() {
        const WAIT: Duration = Duration::from_secs(20);
        let mut cam = cam("test://ball?width=320&height=240", "m");
        cam.max_fps = 20.0;
        let limits = configured_limits(&cam);
        let mut capture = CameraCapture::default();
        capture
            .replace(|first| start_capture(&cam, &square(64), limits, first))
            .await
            .unwrap();
        let mut received = 0u64;
        let mut last_seq = 0;
        while received < 5 {
            let f = tokio::time::timeout(WAIT, capture.recv())
                .await
                .expect("a frame from the first capture")
                .unwrap();
            assert_eq!(f.width, 64);
            last_seq = f.seq;
            received += 1;
        }
        // Leave frames unread in the queue (2 at most; older ones evicted).
        let deadline = Instant::now() + WAIT;
        while capture.counters().passed < received + 2 {
            assert!(Instant::now() < deadline, "{:?}", capture.counters());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let old = capture.counters();
        capture
            .replace(|first| start_capture(&cam, &square(32), limits, first))
            .await
            .unwrap();
        let carried = capture.counters();
        assert!(
            carried.seen >= old.seen && carried.passed >= old.passed,
            "{old:?} then {carried:?}"
        );
        // Every frame that passed the old gate was read here or dropped
        // (evicted, or still queued when the capture stopped).
        assert_eq!(
            carried.passed,
            received + carried.dropped_queue,
            "{carried:?}"
        );
        assert!(carried.dropped_queue >= 2, "{carried:?}");
        let f = tokio::time::timeout(WAIT, capture.recv())
            .await
            .expect("a frame from the new capture")
            .unwrap();
        assert_eq!(f.width, 32);
        // The old capture numbered its frames 0..passed.
        assert!(f.seq > last_seq, "seq {last_seq} then {}", f.seq);
        assert_eq!(f.seq, carried.passed, "{carried:?}");
        let now = capture.counters();
        assert!(now.passed > carried.passed, "{carried:?} then {now:?}");
    }

    #[test]
    fn preflight_names_the_camera_for_each_kind_of_bad_entry() {
        for (c, want) in [
            (cam("test://smpte", ""), "no model"),
            (cam("ftp://x/y", "m"), "ftp"),
            (cam("rtsp:///nohost", "m"), "names no host"),
            (
                cam("file:///nonexistent/tidegate.mp4", "m"),
                "/nonexistent/tidegate.mp4",
            ),
        ] {
            let err = preflight(&c).unwrap_err().to_string();
            assert!(err.contains("'c'") && err.contains(want), "{err}");
        }
        preflight(&cam("test://smpte", "m")).unwrap();
        preflight(&cam("rtsp://127.0.0.1:1/x", "m")).unwrap();
    }
}
