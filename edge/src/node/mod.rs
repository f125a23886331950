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
//! still out, at most [`RESULT_DRAIN`], and returns. A shutdown (SIGTERM,
//! SIGINT) stops the cameras the same way, and waits for those results at
//! most the longest camera budget plus [`SHUTDOWN_GRACE`]: a rolling
//! restart loses no answer the gateway was about to give. Frames are tracked by
//! camera and `seq` ([`Unanswered`]), so an extra result stands for no other
//! frame, and every frame handed to the uplink ends exactly once: as its
//! result, reset, refused or lost on the wire, or lost with its connection
//! (acknowledged, its result never came). The link tells the node that a
//! connection ended through the queue its results come by, after the last
//! of them, so a result on its way is never counted lost.
//!
//! Rooms:
//! - this module: [`run`], the node's loop. It starts the link and the
//!   cameras, hands each result the link forwards to the sink thread
//!   (counting it for its camera and in [`Unanswered`]), prints the
//!   summaries, and stops everything in order. It sends no frame and dials
//!   nothing.
//! - `link`: the connection supervisor. It dials and redials, publishes the
//!   live uplink and the gateway's hints ([`HintBoard`]) to the cameras, and
//!   forwards each result, then the connection's end, to this module's loop.
//! - `camera`: one camera's task, from its capture to its lane. A frame
//!   goes from it to [`crate::uplink::Lane`], and on to the gateway.
//! - `stats`: what each camera counted ([`CameraStats`]) and how it is
//!   printed ([`CameraSummary`]).

mod camera;
mod link;
mod stats;

pub use camera::{PreflightError, preflight};
pub use link::{DIAL_ATTEMPT, HintBoard, OUTAGE_REMINDER, REDIAL_BASE, REDIAL_MAX, uplink_stats};
pub use stats::{CameraStats, CameraSummary};

use std::collections::HashMap;
use std::ops::ControlFlow;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tidegate_protocol::queue;
use tidegate_protocol::{FrameResult, Status};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, error, info, info_span, warn};

use crate::config::EdgeConfig;
use crate::sink::{FinishError, SinkWriter, Sinks};
use crate::uplink::{Unanswered, Uplink, UplinkError};
use crate::uplink_stats::UplinkStats;
use camera::camera;
use link::{FromLink, LinkShell, link};

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
/// What a shutdown waits for the results of the frames still out beyond
/// the longest budget of any camera: the gateway answers every frame by
/// its deadline, and the answer still has the way back to make. Never more
/// than [`RESULT_DRAIN`] in all.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(1);

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
    let sinks = sinks
        .spawn(SINK_QUEUE, SINK_QUEUE_BYTES)
        .map_err(NodeError::SinkThread)?;
    let mut node = Node::start(&cfg, sinks, options);
    tokio::pin!(shutdown);
    let outcome = node.serve(shutdown).await;
    node.stop(outcome).await
}

/// The node while it runs: the tasks it started, the queue their results
/// come by, and what it has handed to the sinks.
struct Node {
    /// The sink thread's queue.
    sinks: SinkWriter,
    /// Stops the link and the cameras.
    cancel: CancellationToken,
    /// The camera tasks.
    cameras_running: TaskTracker,
    link_task: tokio::task::JoinHandle<()>,
    /// Results and connection ends, from the link.
    from_link: queue::Receiver<FromLink>,
    /// A failure of the link that ends the node.
    fatal: mpsc::Receiver<UplinkError>,
    unanswered: Arc<Unanswered>,
    /// Every camera's counters, in the configured order.
    cameras: Vec<(String, Arc<CameraStats>)>,
    by_name: HashMap<String, Arc<CameraStats>>,
    /// Results handed to the sinks, and of them, `ok`.
    results: u64,
    ok: u64,
    /// Once every camera has stopped: until when the node waits for the
    /// results of the frames still out.
    drain_deadline: Option<Instant>,
    /// Stops the cameras alone, on a shutdown (a child of `cancel`).
    cameras_cancel: CancellationToken,
    /// Once shutdown has come: when the node stops, results in or not.
    stop_by: Option<Instant>,
    /// How long a shutdown waits for the results of the frames still out.
    shutdown_drain: Duration,
    /// When to print (and publish) the summaries, if at all.
    summary_tick: Option<tokio::time::Interval>,
    /// Where the summaries are published ([`NodeOptions::stats`]).
    published: Option<watch::Sender<Vec<CameraSummary>>>,
}

impl Node {
    /// Starts the link task and one task per camera.
    fn start(cfg: &EdgeConfig, sinks: SinkWriter, options: NodeOptions) -> Node {
        let cancel = CancellationToken::new();
        let cameras_cancel = cancel.child_token();
        let (link_tx, link_rx) = watch::channel::<Option<Uplink>>(None);
        let (hints_tx, hints_rx) = watch::channel(HintBoard::default());
        let (results_tx, from_link) =
            queue::channel::<FromLink>(RESULTS_QUEUE, RESULTS_QUEUE_BYTES);
        let (fatal_tx, fatal) = mpsc::channel::<UplinkError>(1);
        let unanswered = Arc::new(Unanswered::default());

        let shell = LinkShell {
            link_tx,
            hints_tx,
            results: results_tx,
            fatal: fatal_tx,
            stats: options.uplink.clone().unwrap_or_else(|| uplink_stats(cfg)),
            cancel: cancel.clone(),
        };
        let link_task = tokio::spawn(
            link(cfg.clone(), shell)
                .instrument(info_span!("link", gateway = %cfg.gateway.addr, edge = %cfg.name)),
        );

        let cameras_running = TaskTracker::new();
        let mut cameras: Vec<(String, Arc<CameraStats>)> = Vec::new();
        for cam in cfg.cameras.clone() {
            let s = Arc::new(CameraStats::with_budget(cam.budget_ms));
            cameras.push((cam.name.clone(), s.clone()));
            let span = info_span!("camera", camera = %cam.name, model = %cam.model);
            cameras_running.spawn(
                camera(
                    cam,
                    link_rx.clone(),
                    hints_rx.clone(),
                    s,
                    unanswered.clone(),
                    cameras_cancel.clone(),
                    options.max_frames,
                )
                .instrument(span),
            );
        }
        cameras_running.close();
        let by_name = cameras.iter().cloned().collect();
        let summary_tick = options.summary_every.map(|d| {
            let mut i = tokio::time::interval_at(Instant::now() + d, d);
            i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            i
        });
        Node {
            sinks,
            cancel,
            cameras_running,
            link_task,
            from_link,
            fatal,
            unanswered,
            cameras,
            by_name,
            results: 0,
            ok: 0,
            drain_deadline: None,
            cameras_cancel,
            stop_by: None,
            shutdown_drain: shutdown_drain(cfg),
            summary_tick,
            published: options.stats,
        }
    }

    /// Hands results to the sinks until `shutdown`, a failure, or the end
    /// of the work; returns the failure that ends the node, if one did.
    async fn serve<F: std::future::Future<Output = ()>>(
        &mut self,
        mut shutdown: Pin<&mut F>,
    ) -> Result<(), NodeError> {
        loop {
            if self.nothing_left() {
                return Ok(());
            }
            if let ControlFlow::Break(outcome) = self.turn(shutdown.as_mut()).await {
                return outcome;
            }
        }
    }

    /// Whether the node has nothing left to do: every camera has stopped
    /// and every result is in. Starts the wait for the last results
    /// ([`RESULT_DRAIN`]) when every camera has stopped with some still out.
    fn nothing_left(&mut self) -> bool {
        // Results still to come, or come and not yet handed to the sinks.
        let waiting = !self.unanswered.is_empty() || !self.from_link.is_empty();
        if self.cameras_running.is_empty() && self.drain_deadline.is_none() {
            // Every camera stopped (bad entries, files that ended, or
            // `max_frames` reached): once the frames still out are
            // answered, the edge has nothing left to do.
            if !waiting {
                info!("every camera has stopped");
                return true;
            }
            info!(
                frames = self.unanswered.len(),
                "every camera has stopped; waiting up to {RESULT_DRAIN:?} for the results of the frames still out"
            );
            self.drain_deadline = Some(self.stop_by.unwrap_or(Instant::now() + RESULT_DRAIN));
        }
        if self.drain_deadline.is_some() && !waiting {
            info!("every camera has stopped and every result is in");
            return true;
        }
        false
    }

    /// Waits for the next thing to do and does it; `Break` ends the node,
    /// with the failure that ends it, if any.
    async fn turn<F: std::future::Future<Output = ()>>(
        &mut self,
        mut shutdown: Pin<&mut F>,
    ) -> ControlFlow<Result<(), NodeError>> {
        let drain = sleep_until_opt(self.drain_deadline.or(self.stop_by));
        let tick = tick_opt(&mut self.summary_tick);
        let draining = self.drain_deadline.is_some();
        let stopping = self.stop_by.is_some();
        tokio::select! {
            _ = &mut shutdown, if !stopping => {
                self.stop_by = Some(begin_shutdown(&self.cameras_cancel, self.shutdown_drain, &self.unanswered));
                ControlFlow::Continue(())
            }
            _ = drain => {
                warn!(
                    frames = self.unanswered.len(),
                    "gave up waiting for the last results of the frames still out"
                );
                ControlFlow::Break(Ok(()))
            }
            _ = self.cameras_running.wait(), if !draining => ControlFlow::Continue(()),
            // Frames abandoned (reset, or lost with the connection) while
            // draining: nothing more to wait for.
            _ = self.unanswered.emptied(), if draining && !self.unanswered.is_empty() => {
                ControlFlow::Continue(())
            }
            _ = tick => {
                self.publish_summaries();
                ControlFlow::Continue(())
            }
            // A write failed; `finish_sinks` says which.
            _ = self.sinks.stopped() => ControlFlow::Break(Ok(())),
            e = self.fatal.recv() => ControlFlow::Break(e.map_or(Ok(()), |e| Err(NodeError::fatal(e)))),
            msg = self.from_link.recv() => match msg {
                Some(FromLink::Ended(conn)) => {
                    // Every result of the connection has been handled.
                    lost_with_connection(self.unanswered.connection_ended(conn), "it ended");
                    ControlFlow::Continue(())
                }
                Some(FromLink::Result(r)) => self.hand_to_sinks(r, shutdown).await,
                None => ControlFlow::Break(Ok(())),
            },
        }
    }

    /// Hands result `r` to the sink thread, which serialises and writes it
    /// in order; waits while its queue is full, until the shutdown's drain
    /// is over (a shutdown arriving meanwhile starts it). Then counts it,
    /// for its camera and against [`Unanswered`].
    async fn hand_to_sinks<F: std::future::Future<Output = ()>>(
        &mut self,
        r: FrameResult,
        mut shutdown: Pin<&mut F>,
    ) -> ControlFlow<Result<(), NodeError>> {
        let now = crate::clock::now_us();
        let labels = self
            .by_name
            .get(&r.camera)
            .map(|s| s.snapshot().labels.clone())
            .unwrap_or_default();
        let (camera, seq) = (r.camera.clone(), r.seq);
        let (status, captured_at_us, server_us) =
            (r.status.clone(), r.captured_at_us, r.timings.total_us());
        let write = self.sinks.write(r, now, labels);
        tokio::pin!(write);
        loop {
            let stopping = self.stop_by.is_some();
            tokio::select! {
                queued = &mut write => if queued.is_err() {
                    // The thread stopped on a failed write; `finish_sinks`
                    // says which.
                    return ControlFlow::Break(Ok(()));
                } else {
                    break;
                },
                _ = &mut shutdown, if !stopping => {
                    self.stop_by = Some(begin_shutdown(&self.cameras_cancel, self.shutdown_drain, &self.unanswered));
                }
                _ = sleep_until_opt(self.stop_by) => {
                    warn!("gave up waiting for the result sinks to take a result");
                    return ControlFlow::Break(Ok(()));
                }
            }
        }
        // Handed to the sinks: `finish_sinks` writes it. Counted only now:
        // a result cut off above is not written, and its frame is lost
        // with the connection instead.
        self.results += 1;
        if status == Status::Ok {
            self.ok += 1;
        }
        if let Some(s) = self.by_name.get(&camera) {
            s.on_result(&status, captured_at_us, server_us, now);
        }
        self.unanswered.answered(&camera, seq);
        ControlFlow::Continue(())
    }

    /// Prints every camera's counters, and publishes them if asked to.
    fn publish_summaries(&self) {
        let now = camera_summaries(&self.cameras, &self.unanswered);
        print_cameras(&now);
        if let Some(tx) = &self.published {
            tx.send_replace(now);
        }
    }

    /// Stops the link and the cameras, counts the frames still awaiting a
    /// result as lost with the connection, lets the sinks write what is
    /// queued, and sums up. `outcome` is what ended the loop; the first
    /// failure decides the result.
    async fn stop(mut self, mut outcome: Result<(), NodeError>) -> Result<Summary, NodeError> {
        self.cancel.cancel();
        self.cameras_running.wait().await;
        let _ = (&mut self.link_task).await;
        // The connection is closed, and the results still queued are not
        // written: the frames awaiting them are lost with it.
        lost_with_connection(self.unanswered.clear(), "the edge stopped");
        // The loop may have ended on another branch (the results channel
        // closing with the link) while a refusal was waiting: it still
        // decides the exit.
        if outcome.is_ok()
            && let Ok(e) = self.fatal.try_recv()
        {
            outcome = Err(NodeError::fatal(e));
        }
        let Node {
            sinks,
            cameras,
            unanswered,
            results,
            ok,
            published,
            ..
        } = self;
        // Everything queued for the sinks is written before the webhook
        // closes.
        let outcome = outcome.and(finish_sinks(sinks).await);
        let summaries = camera_summaries(&cameras, &unanswered);
        if let Some(tx) = &published {
            tx.send_replace(summaries.clone());
        }
        outcome?;
        Ok(Summary {
            sent: cameras
                .iter()
                .map(|(_, s)| s.lane.delivered.load(Ordering::Relaxed))
                .sum(),
            results,
            ok,
            cameras: summaries,
        })
    }
}

/// How long a shutdown of an edge configured as `cfg` waits for the results
/// of the frames still out: its longest camera budget plus
/// [`SHUTDOWN_GRACE`], never more than [`RESULT_DRAIN`].
pub fn shutdown_drain(cfg: &EdgeConfig) -> Duration {
    let budget = cfg.cameras.iter().map(|c| c.budget_ms).max().unwrap_or(0);
    (Duration::from_millis(u64::from(budget)) + SHUTDOWN_GRACE).min(RESULT_DRAIN)
}

/// Starts a shutdown: stops the cameras (each settles what it has on the
/// wire), and returns when the node stops waiting for the results of the
/// frames still out: `drain` from now.
fn begin_shutdown(
    cameras: &CancellationToken,
    drain: Duration,
    unanswered: &Unanswered,
) -> Instant {
    info!(
        frames = unanswered.len(),
        "shutting down: the cameras stop; waiting up to {drain:?} for the results of the frames still out"
    );
    cameras.cancel();
    Instant::now() + drain
}

/// Every camera's counters now, in the configured order.
fn camera_summaries(
    cameras: &[(String, Arc<CameraStats>)],
    unanswered: &Unanswered,
) -> Vec<CameraSummary> {
    cameras
        .iter()
        .map(|(n, s)| CameraSummary::of(n, s, unanswered.ends(n)))
        .collect()
}

/// Ends the sink thread's queue and waits, at most [`SINK_DRAIN`], for it
/// to write what is queued; then closes the MQTT and webhook clients.
/// Returns the failure, if a write failed or the thread did not finish.
async fn finish_sinks(sinks: SinkWriter) -> Result<(), NodeError> {
    let mut report = match sinks.finish(SINK_DRAIN).await {
        Ok(report) => report,
        Err(e) => {
            error!("{e}");
            return Err(NodeError::SinkFinish(e));
        }
    };
    let failed = report.error.take().map(|e| {
        error!(
            written = report.written,
            unwritten = report.unwritten,
            "writing a result failed: {e}"
        );
        NodeError::Sink(e)
    });
    close_clients(report.sinks).await;
    failed.map_or(Ok(()), Err)
}

/// Closes the sinks that talk to a server (MQTT, webhook), each given
/// [`SINK_DRAIN`] to deliver what it holds; logs what the webhook did.
async fn close_clients(mut sinks: Sinks) {
    if let Some(m) = sinks.mqtt.take() {
        m.close(SINK_DRAIN).await;
    }
    if let Some(w) = sinks.webhook.take() {
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

/// Sleeps until `at`; pending for ever without it.
async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

/// The next tick of `interval`; pending for ever without one.
async fn tick_opt(interval: &mut Option<tokio::time::Interval>) {
    match interval {
        Some(t) => {
            t.tick().await;
        }
        None => std::future::pending().await,
    }
}
