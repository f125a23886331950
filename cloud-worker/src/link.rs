//! The worker's QUIC link to the gateway: dial in, authenticate, register
//! (models and measured latency profile), then serve dispatched batches
//! through the [`Executor`] and send heartbeats, until drained or cancelled.
//!
//! Batches arrive on unidirectional streams; each stream is read and served
//! by its own tracked task, and each result goes back on a new
//! unidirectional stream. Inference runs on the executor's own thread, never
//! on tokio's. A batch the executor has no room for is answered
//! `Shed(Overloaded)`.

use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use tidegate_kit::backoff::Backoff;
use tidegate_protocol::quic::{HandshakeError, ReadError, handshake, read_message, write_message};
use tidegate_protocol::{
    BatchResult, Dispatch, Drain, ErrorCode, GatewayAddr, Heartbeat, Hello, ItemResult, Limits,
    Message, Register, Role, ShedReason, Status,
};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, debug, info, info_span, warn};

use crate::backend::{FrameInput, FrameOutcome};
use crate::executor::{Executor, Job, SubmitError};
use crate::metrics::WorkerMetrics;

/// Where and as whom to dial in.
#[derive(Clone)]
pub struct LinkConfig {
    /// Gateway QUIC address; a host name is resolved at every dial.
    pub gateway: GatewayAddr,
    /// Name in the gateway's certificate.
    pub server_name: String,
    /// CA certificate to trust.
    pub ca: PathBuf,
    /// This worker's name.
    pub name: String,
    /// Its token.
    pub token: String,
}

impl std::fmt::Debug for LinkConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinkConfig")
            .field("gateway", &self.gateway)
            .field("server_name", &self.server_name)
            .field("ca", &self.ca)
            .field("name", &self.name)
            .field("token", &"<redacted>")
            .finish()
    }
}

/// Why the link ended with an error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LinkError {
    /// TLS material could not be loaded.
    #[error(transparent)]
    Tls(#[from] tidegate_protocol::quic::TlsError),
    /// The gateway could not be reached.
    #[error(transparent)]
    Dial(#[from] tidegate_protocol::quic::DialError),
    /// The gateway refused the worker.
    #[error("gateway refused worker: {message} ({code:?})")]
    Refused {
        /// Its code.
        code: ErrorCode,
        /// Its explanation.
        message: String,
    },
    /// The gateway broke the protocol or the connection failed.
    #[error("link to the gateway failed: {0}")]
    Broken(String),
}

impl LinkError {
    /// Whether dialling again can help: a refusal (bad token, a lease token
    /// already used) or unreadable TLS material will not change by itself.
    pub fn is_retryable(&self) -> bool {
        match self {
            LinkError::Dial(_) | LinkError::Broken(_) => true,
            // the protocol's classification: `unavailable` (try again
            // later) is retryable, `unauthorized` is not
            LinkError::Refused { code, .. } => code.class().1,
            _ => false,
        }
    }
}

/// The first redial's step; it doubles per redial, up to [`REDIAL_MAX`].
pub const REDIAL_BASE: Duration = Duration::from_millis(200);
/// The longest redial step.
pub const REDIAL_MAX: Duration = Duration::from_secs(5);

/// The delays between redials: 200 ms doubling to at most 5 s, each drawn
/// between 50 % and 100 % of its step (the kit's equal jitter), seeded by
/// the clock, the process and the worker's `name`, so that workers that lost
/// the same gateway do not redial in step.
pub fn redial_backoff(name: &str) -> Backoff {
    Backoff::seeded(REDIAL_BASE, REDIAL_MAX, name)
}

/// How [`settle`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settled {
    /// The executor is idle: register again.
    Idle,
    /// `cancel` fired first.
    Cancelled,
}

/// Before dialling again after the link was lost: waits until the executor
/// has finished the batches taken on the old connection (their answers go
/// nowhere), so that a new registration's batches do not queue behind them,
/// or until `cancel` fires. Says in the log why it waits. A wedged job never
/// finishes; the [`watchdog`](crate::watchdog) ends the process then.
pub async fn settle(executor: &Executor, cancel: &CancellationToken) -> Settled {
    if executor.is_idle() {
        return Settled::Idle;
    }
    let pending = executor.activity().pending();
    match executor.running() {
        Some(job) => warn!(
            pending,
            model = %job.model,
            frames = job.frames,
            running_ms = job.running_for.as_millis() as u64,
            "the backend is still running batches of the lost link; waiting for them to finish before registering again"
        ),
        None => warn!(
            pending,
            "the backend still has batches of the lost link queued; waiting for them to finish before registering again"
        ),
    }
    tokio::select! {
        _ = executor.idle() => {
            info!("the backend has finished the lost link's batches");
            Settled::Idle
        }
        _ = cancel.cancelled() => Settled::Cancelled,
    }
}

/// How a link ended without error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkEnd {
    /// Drained on the gateway's request or on shutdown: every batch taken
    /// was answered, or, at the drain's deadline, handed back (a dispatch
    /// stream still being read stopped, a batch still running left
    /// unanswered when the connection closed; the gateway re-homes both).
    Drained,
    /// The gateway closed the connection.
    Closed,
}

/// Load figures shared between the batch tasks and the heartbeat.
#[derive(Debug, Default)]
struct Load {
    /// Batches submitted to the executor and not yet answered.
    in_flight: AtomicU64,
    /// Dispatch streams accepted so far.
    taken: AtomicU64,
    /// Where each answered batch is counted, when metrics are on.
    metrics: Option<WorkerMetrics>,
}

/// A drain ends once no batch has arrived for this long with none in flight.
/// Longer than the gaps between batches of a camera throttled to a few
/// frames a second, so that a pause in the load, not a gap in it, ends it.
const DRAIN_QUIET: Duration = Duration::from_millis(250);

/// A drain ends after this long even if the gateway keeps dispatching, or
/// sooner when the gateway's `Drain.deadline_ms` says so.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// Dials the gateway (resolving its name now, see
/// [`tidegate_protocol::quic::dial_addr`]), registers, and serves until the
/// gateway drains or closes us, or `cancel` fires (then it drains: batches
/// already taken are finished and answered before returning).
pub async fn run(
    cfg: &LinkConfig,
    executor: Arc<Executor>,
    register: Register,
    cancel: CancellationToken,
) -> Result<LinkEnd, LinkError> {
    run_observed(cfg, executor, register, cancel, None).await
}

/// [`run`], counting each batch answered in `metrics` (batches, frames by
/// status, the backend's run time) as its result is sent.
pub async fn run_observed(
    cfg: &LinkConfig,
    executor: Arc<Executor>,
    register: Register,
    cancel: CancellationToken,
    metrics: Option<WorkerMetrics>,
) -> Result<LinkEnd, LinkError> {
    let client = tidegate_protocol::quic::client_config(&cfg.ca)?;
    // Resolved now, not once at start: a redial follows a gateway that moved.
    let conn = tidegate_protocol::quic::dial_addr(&cfg.gateway, &cfg.server_name, client).await?;
    let broken = |e: &dyn std::fmt::Display| LinkError::Broken(e.to_string());
    let limits = Limits::default();
    let hello = Hello {
        role: Role::Worker,
        name: cfg.name.clone(),
        token: cfg.token.clone(),
    };
    let (mut ctl_send, ctl_recv, welcome) =
        handshake(&conn, hello, &limits)
            .await
            .map_err(|e| match e {
                HandshakeError::Refused { code, message } => LinkError::Refused { code, message },
                other => broken(&other),
            })?;
    let heartbeat_ms = welcome.heartbeat_ms.max(100);
    write_message(&mut ctl_send, &Message::Register(register))
        .await
        .map_err(|e| broken(&e))?;
    info!(gateway = %cfg.gateway, addr = %conn.remote_address(), "registered");

    let load = Arc::new(Load {
        metrics,
        ..Load::default()
    });
    // One task per dispatch stream, from its first byte to its answer, so
    // that a batch still being read counts as in flight.
    let batches = TaskTracker::new();
    // Stops the reads still waiting for their bytes when a drain gives up.
    let stop_reading = CancellationToken::new();
    let drain = CancellationToken::new();
    // When the gateway's Drain says we must be done by.
    let asked = Arc::new(OnceLock::new());
    let started = Instant::now();

    // Control stream: heartbeats out; Drain in; our own Drain out when
    // `cancel` fires (SIGTERM), so the gateway stops dispatching to us.
    let control = {
        let load = load.clone();
        let executor = executor.clone();
        let drain = drain.clone();
        let asked = asked.clone();
        let cancel = cancel.clone();
        async move {
            let mut tick = tokio::time::interval(Duration::from_millis(heartbeat_ms as u64));
            let mut last = (Instant::now(), executor.busy_us());
            let mut told = false;
            // One read stays in progress across the turns of the loop:
            // `read_message` is not cancel-safe, and a read dropped when a
            // tick wins half way through a message would desynchronise the
            // stream (a Drain split across packets would be lost).
            let mut read = Box::pin(read_control(ctl_recv));
            loop {
                tokio::select! {
                    _ = cancel.cancelled(), if !told => {
                        told = true;
                        let d = Message::Drain(Drain { deadline_ms: DRAIN_TIMEOUT.as_millis() as u32 });
                        if write_message(&mut ctl_send, &d).await.is_err() {
                            break;
                        }
                        info!("told the gateway we are draining");
                    }
                    _ = tick.tick() => {
                        // The backend's own run time (measured on its
                        // thread), not the wall time of the batches in
                        // flight, which overlap while they queue.
                        let busy = executor.busy_us();
                        let elapsed = last.0.elapsed().as_micros().max(1) as f64;
                        let utilization =
                            (busy.saturating_sub(last.1) as f64 / elapsed).clamp(0.0, 1.0) as f32;
                        last = (Instant::now(), busy);
                        let hb = Message::Heartbeat(Heartbeat {
                            queue_depth: load.in_flight.load(Ordering::Relaxed) as u32,
                            utilization,
                        });
                        if write_message(&mut ctl_send, &hb).await.is_err() {
                            break;
                        }
                    }
                    (recv, msg) = &mut read => {
                        match msg {
                            Ok(Some(Message::Drain(d))) => {
                                // Heartbeats go on while the batches taken finish.
                                info!(deadline_ms = d.deadline_ms, "drain requested by the gateway");
                                let by = tokio::time::Instant::now()
                                    + Duration::from_millis(d.deadline_ms.into());
                                // The first deadline stands; a later one may not extend it.
                                let _ = asked.set(by);
                                drain.cancel();
                            }
                            Ok(Some(other)) => warn!(kind = ?other.kind(), "unexpected control message"),
                            Ok(None) | Err(_) => break,
                        }
                        read.set(read_control(recv));
                    }
                }
            }
        }
    };

    // Dispatch streams: one batch each, read and served by a tracked task.
    let accept = {
        let conn = conn.clone();
        let batches = batches.clone();
        let executor = executor.clone();
        let load = load.clone();
        let stop_reading = stop_reading.clone();
        async move {
            while let Ok(recv) = conn.accept_uni().await {
                load.taken.fetch_add(1, Ordering::Relaxed);
                batches.spawn(read_and_serve(
                    conn.clone(),
                    recv,
                    executor.clone(),
                    load.clone(),
                    stop_reading.clone(),
                ));
            }
        }
    };

    // Ends when the control stream or the connection does; polling it
    // heartbeats and accepts dispatch streams.
    let link = async {
        tokio::select! {
            _ = control => {},
            _ = accept => {},
        }
    };
    tokio::pin!(link);
    let end = tokio::select! {
        _ = cancel.cancelled() => LinkEnd::Drained,
        _ = drain.cancelled() => LinkEnd::Drained,
        _ = &mut link => LinkEnd::Closed,
    };
    batches.close();
    let mut link = (end == LinkEnd::Drained).then_some(link);
    let deadline = drain_deadline(tokio::time::Instant::now(), asked.get().copied());
    if end == LinkEnd::Drained {
        // The gateway stops dispatching once it has our Drain (or sent its
        // own), but batches it dispatched before that may still be on the
        // way, and one lost to an early close would never be answered. So
        // keep serving (accepting, reading, answering, heartbeating) until
        // every stream taken is read and answered and no new one has come
        // for DRAIN_QUIET, or the deadline has passed.
        info!(
            in_flight = batches.len(),
            budget_ms = deadline
                .saturating_duration_since(tokio::time::Instant::now())
                .as_millis() as u64,
            "draining: finishing the batches taken"
        );
        if serve_drain(&batches, &load.taken, deadline, &mut link).await == DrainEnd::Deadline {
            warn!(
                in_flight = batches.len(),
                "drain deadline reached while the gateway kept dispatching or a dispatch stream stalled"
            );
        }
    }
    // Reads still waiting for bytes are abandoned (their streams stopped):
    // the gateway re-homes those batches. Batches read are answered, by the
    // drain's deadline when draining.
    stop_reading.cancel();
    let by = (end == LinkEnd::Drained).then_some(deadline);
    if finish_batches(&batches, by, &mut link).await == Finish::HandedBack {
        warn!(
            in_flight = batches.len(),
            "drain deadline reached with batches unanswered; closing the link hands them back to the gateway"
        );
    }
    if end == LinkEnd::Drained {
        conn.close(0u32.into(), b"drained");
    }
    info!(uptime_s = started.elapsed().as_secs(), ?end, "link ended");
    Ok(end)
}

/// Reads the next control message. It owns the stream while it reads and
/// hands it back, so that one read can stay in progress across the turns of
/// the control loop (as the edge's uplink does).
async fn read_control(
    mut recv: quinn::RecvStream,
) -> (quinn::RecvStream, Result<Option<Message>, ReadError>) {
    let msg = read_message(&mut recv, &Limits::default()).await;
    (recv, msg)
}

/// When a drain that begins at `now` must be over: by the gateway's
/// `Drain.deadline_ms` when it sent one (`asked`), and never later than
/// [`DRAIN_TIMEOUT`] (what our own Drain announces).
fn drain_deadline(
    now: tokio::time::Instant,
    asked: Option<tokio::time::Instant>,
) -> tokio::time::Instant {
    let ours = now + DRAIN_TIMEOUT;
    asked.map_or(ours, |by| by.min(ours))
}

/// How [`serve_drain`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DrainEnd {
    /// Every stream taken was answered and none came for [`DRAIN_QUIET`].
    Quiet,
    /// The deadline passed first.
    Deadline,
    /// The link (control stream or connection) ended first.
    LinkGone,
}

/// Keeps serving while draining: `link` is polled throughout (heartbeats,
/// new dispatch streams), until the batches in `batches` are done and no
/// new stream has been `taken` for [`DRAIN_QUIET`], or `deadline`. A stream
/// still being read is a task in `batches`, so it holds the drain open. A
/// closed tracker still takes new tasks. `link` is set to `None` once it has
/// ended.
async fn serve_drain<L: Future<Output = ()> + Unpin>(
    batches: &TaskTracker,
    taken: &AtomicU64,
    deadline: tokio::time::Instant,
    link: &mut Option<L>,
) -> DrainEnd {
    loop {
        let Some(live) = link.as_mut() else {
            return DrainEnd::LinkGone;
        };
        let seen = taken.load(Ordering::Relaxed);
        tokio::select! {
            _ = batches.wait() => {}
            _ = &mut *live => {
                *link = None;
                return DrainEnd::LinkGone;
            }
            _ = tokio::time::sleep_until(deadline) => return DrainEnd::Deadline,
        }
        tokio::select! {
            _ = tokio::time::sleep(DRAIN_QUIET) => {}
            _ = &mut *live => {
                *link = None;
                return DrainEnd::LinkGone;
            }
            _ = tokio::time::sleep_until(deadline) => return DrainEnd::Deadline,
        }
        if taken.load(Ordering::Relaxed) == seen && batches.is_empty() {
            return DrainEnd::Quiet;
        }
    }
}

/// How [`finish_batches`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Finish {
    /// Every batch read was answered.
    Answered,
    /// The deadline passed first; the rest are left to the gateway.
    HandedBack,
}

/// Waits for the batches already read to be answered, by `deadline` if
/// there is one, while `link` is still polled: heartbeats go on, so that
/// the gateway does not take a worker finishing its last batches for a
/// lost one (it does after three missed heartbeats).
async fn finish_batches<L: Future<Output = ()> + Unpin>(
    batches: &TaskTracker,
    deadline: Option<tokio::time::Instant>,
    link: &mut Option<L>,
) -> Finish {
    let answered = async {
        if let Some(live) = link.as_mut() {
            tokio::select! {
                _ = batches.wait() => return,
                _ = live => *link = None,
            }
        }
        batches.wait().await
    };
    match deadline {
        Some(by) => match tokio::time::timeout_at(by, answered).await {
            Ok(()) => Finish::Answered,
            Err(_) => Finish::HandedBack,
        },
        None => {
            answered.await;
            Finish::Answered
        }
    }
}

/// Reads one dispatch stream and serves its batch, unless `stop_reading`
/// fires before the whole message has arrived.
async fn read_and_serve(
    conn: quinn::Connection,
    mut recv: quinn::RecvStream,
    executor: Arc<Executor>,
    load: Arc<Load>,
    stop_reading: CancellationToken,
) {
    let limits = Limits::default();
    let read = tokio::select! {
        r = read_message(&mut recv, &limits) => r,
        _ = stop_reading.cancelled() => {
            warn!("dispatch stream still incomplete when the link ended; stream stopped");
            let _ = recv.stop(ErrorCode::Unavailable.quic_code().into());
            return;
        }
    };
    let dispatch = match read {
        Ok(Some(Message::Dispatch(d))) => d,
        Ok(Some(other)) => {
            warn!(kind = ?other.kind(), "dispatch stream carried a non-Dispatch message; stream closed");
            let _ = recv.stop(ErrorCode::Malformed.quic_code().into());
            return;
        }
        Ok(None) => return,
        Err(e) => {
            warn!("bad dispatch stream closed: {e}");
            let _ = recv.stop(ErrorCode::Malformed.quic_code().into());
            return;
        }
    };
    let span = info_span!("batch", batch = dispatch.batch, model = %dispatch.model,
        frames = dispatch.items.len(),
        first = %dispatch.items.first().map(|i| format!("{}#{}", i.camera, i.seq)).unwrap_or_default());
    serve_batch(conn, executor, load, dispatch)
        .instrument(span)
        .await;
}

/// Runs one batch on the executor and sends its result back.
async fn serve_batch(
    conn: quinn::Connection,
    executor: Arc<Executor>,
    load: Arc<Load>,
    dispatch: Dispatch,
) {
    let Dispatch {
        batch,
        model,
        items,
    } = dispatch;
    let ids: Vec<u64> = items.iter().map(|i| i.id).collect();
    let model_name = load.metrics.as_ref().map(|_| model.clone());
    let job = Job {
        model,
        frames: items
            .into_iter()
            .map(|i| FrameInput {
                tensor: i.tensor,
                geometry: i.geometry,
            })
            .collect(),
        span: tracing::Span::current(),
    };
    load.in_flight.fetch_add(1, Ordering::Relaxed);
    let answered = match executor.try_submit(job) {
        Ok(rx) => rx.await.map_err(|_| {
            warn!("the backend thread dropped the batch");
            unrun_status(None)
        }),
        Err(e) => {
            warn!("{e}");
            Err(unrun_status(Some(&e)))
        }
    };
    load.in_flight.fetch_sub(1, Ordering::Relaxed);
    let ran = answered.is_ok();
    let outcomes = answered.unwrap_or_else(|status| {
        let unrun = FrameOutcome {
            status,
            detections: Vec::new(),
            timings: Default::default(),
            outputs: Vec::new(),
        };
        vec![unrun; ids.len()]
    });
    let items = item_results(&ids, outcomes, &Limits::default());
    // counted as answered, with the statuses sent
    if let (Some(m), Some(model)) = (&load.metrics, &model_name) {
        m.on_batch(model, &items, ran);
    }
    let result = Message::BatchResult(BatchResult { batch, items });
    match conn.open_uni().await {
        Ok(mut s) => {
            if let Err(e) = write_message(&mut s, &result).await {
                warn!("sending batch result: {e}");
            } else {
                let _ = s.finish();
                // Wait until the gateway has the bytes, so a drain that
                // closes the connection right after loses nothing.
                let _ = s.stopped().await;
            }
        }
        Err(e) => debug!("cannot return batch result: {e}"),
    }
}

/// The status of every frame of a batch the executor did not run: shed as
/// overloaded when its queue was full (the gateway may send it elsewhere or
/// later), failed when the backend thread is gone (`submit` is `None` when
/// the backend dropped the batch after taking it).
fn unrun_status(submit: Option<&SubmitError>) -> Status {
    match submit {
        Some(SubmitError::Overloaded { .. }) => Status::Shed(ShedReason::Overloaded),
        _ => Status::Failed(
            "the worker's backend thread has stopped; the worker must be restarted".into(),
        ),
    }
}

/// The batch's results for the gateway; every outcome sent goes through
/// here. Raw outputs of one frame are bounded by the decoder; those of the
/// whole batch must fit one message (`max_tensor_bytes`), so a frame whose
/// outputs would overflow it fails with the reason instead of breaking the
/// message. A failure's reason (ONNX Runtime's or CUDA's text, a caught
/// panic) is cut to `max_string_bytes`: the gateway refuses a longer string,
/// and with it the whole result.
fn item_results(ids: &[u64], outcomes: Vec<FrameOutcome>, limits: &Limits) -> Vec<ItemResult> {
    let mut total = 0usize;
    let mut logged = false;
    ids.iter()
        .zip(outcomes)
        .map(|(&id, o)| {
            let bytes: usize = o.outputs.iter().map(|t| t.data.len()).sum();
            let mut item = ItemResult {
                id,
                status: o.status,
                detections: o.detections,
                timings: o.timings,
                outputs: o.outputs,
            };
            if item.detections.iter().any(|d| !is_finite(d)) {
                // the protocol carries finite numbers only: one such
                // detection would make the whole batch's message unreadable
                item.status = Status::Failed(
                    "the decoder produced a detection with a non-finite number; \
                     is the model's output overflowing?"
                        .into(),
                );
                item.detections.clear();
                item.outputs.clear();
            }
            if bytes > 0 && total + bytes > limits.max_tensor_bytes {
                item.status = Status::Failed(format!(
                    "raw outputs of this batch exceed {} bytes, the most one result message \
                     carries; lower the model's max_batch",
                    limits.max_tensor_bytes
                ));
                item.outputs.clear();
            } else {
                total += bytes;
            }
            if let Status::Failed(reason) = &mut item.status
                && reason.len() > limits.max_string_bytes
            {
                // Once a batch: its frames often fail for the same reason.
                if !logged {
                    warn!(id, %reason, "failure reason cut to the protocol's string limit for the gateway");
                    logged = true;
                }
                cap_reason(reason, limits.max_string_bytes);
            }
            item
        })
        .collect()
}

/// Whether every number of `d` is finite, as the protocol requires.
fn is_finite(d: &tidegate_protocol::Detection) -> bool {
    [d.x1, d.y1, d.x2, d.y2, d.score]
        .iter()
        .chain(d.keypoints.iter().flatten())
        .all(|v| v.is_finite())
}

/// Cuts `reason` to at most `max` bytes on a char boundary, ending it with
/// "…" to show that text is missing.
fn cap_reason(reason: &mut String, max: usize) {
    const MORE: &str = "…";
    if reason.len() <= max {
        return;
    }
    let (room, more) = match max.checked_sub(MORE.len()) {
        Some(room) => (room, MORE),
        None => (max, ""),
    };
    let mut end = room;
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    reason.truncate(end);
    reason.push_str(more);
}

#[cfg(test)]
mod tests {
    use super::*;
    use tidegate_protocol::OutputTensor;

    #[test]
    fn raw_outputs_that_overflow_one_batch_message_fail_their_frame_only() {
        let limits = Limits {
            max_tensor_bytes: 40,
            ..Limits::default()
        };
        // Three frames of 16 bytes each: the third would make 48 > 40.
        let outcome = |v: f32| FrameOutcome {
            status: Status::Ok,
            detections: Vec::new(),
            timings: Default::default(),
            outputs: vec![OutputTensor::from_f32("e", vec![1, 4], &[v; 4]).unwrap()],
        };
        let items = item_results(
            &[7, 8, 9],
            vec![outcome(1.0), outcome(2.0), outcome(3.0)],
            &limits,
        );
        assert_eq!(items.iter().map(|i| i.id).collect::<Vec<_>>(), [7, 8, 9]);
        assert_eq!(items[0].status, Status::Ok);
        assert_eq!(items[1].outputs[0].values(), vec![2.0; 4]);
        assert!(
            matches!(&items[2].status, Status::Failed(r) if r.contains("exceed 40 bytes")),
            "{:?}",
            items[2].status
        );
        assert!(items[2].outputs.is_empty());
        // What is sent decodes under those limits.
        let msg = Message::BatchResult(BatchResult { batch: 1, items });
        let mut buf = Vec::new();
        msg.encode(&mut buf);
        let back = Message::decode(&mut buf.as_slice(), &limits).unwrap();
        assert_eq!(back, msg);
    }

    /// A detection with a non-finite number (a decoder's bug, a model's
    /// overflow) fails its own frame only: the batch's message stays one
    /// the gateway reads.
    #[test]
    fn a_non_finite_detection_fails_its_frame_and_the_batch_stays_readable() {
        let limits = Limits::default();
        let det = |score: f32, kp: f32| tidegate_protocol::Detection {
            x1: 1.0,
            y1: 2.0,
            x2: 3.0,
            y2: 4.0,
            score,
            class: 0,
            keypoints: vec![[kp, 1.0]],
        };
        let outcome = |d| FrameOutcome {
            status: Status::Ok,
            detections: vec![d],
            timings: Default::default(),
            outputs: Vec::new(),
        };
        let items = item_results(
            &[1, 2, 3],
            vec![
                outcome(det(0.9, 5.0)),
                outcome(det(f32::INFINITY, 5.0)),
                outcome(det(0.9, f32::NAN)),
            ],
            &limits,
        );
        assert_eq!(items[0].status, Status::Ok);
        for item in &items[1..] {
            assert!(
                matches!(&item.status, Status::Failed(r) if r.contains("non-finite")),
                "{:?}",
                item.status
            );
            assert!(item.detections.is_empty());
        }
        let msg = Message::BatchResult(BatchResult { batch: 5, items });
        let mut buf = Vec::new();
        msg.encode(&mut buf);
        let back = Message::decode(&mut buf.as_slice(), &limits).unwrap();
        assert_eq!(back, msg);
    }

    #[test]
    fn long_multibyte_failure_reason_is_cut_so_the_gateway_reads_the_result() {
        let limits = Limits::default();
        // 5000 bytes of 2- and 3-byte characters, as ONNX Runtime's or
        // CUDA's error text or a caught panic may run to.
        let reason = "é€x".repeat(834)[..5000].to_string();
        assert_eq!(reason.len(), 5000);
        let ok = FrameOutcome {
            status: Status::Ok,
            detections: Vec::new(),
            timings: Default::default(),
            outputs: Vec::new(),
        };
        let items = item_results(
            &[1, 2],
            vec![FrameOutcome::failed(reason.clone()), ok],
            &limits,
        );
        let msg = Message::BatchResult(BatchResult { batch: 3, items });
        let mut buf = Vec::new();
        msg.encode(&mut buf);
        // What the gateway reads with.
        let back = Message::decode(&mut buf.as_slice(), &Limits::default()).unwrap();
        let Message::BatchResult(back) = back else {
            panic!("{back:?}");
        };
        let Status::Failed(cut) = &back.items[0].status else {
            panic!("{:?}", back.items[0].status);
        };
        assert!(cut.len() <= limits.max_string_bytes, "{} bytes", cut.len());
        let kept = cut.strip_suffix('…').expect("a cut reason ends with …");
        assert!(reason.starts_with(kept), "{kept}");
        // At most one character (3 bytes) short of the room left by "…".
        assert!(
            kept.len() > limits.max_string_bytes - 3 - 3,
            "{}",
            kept.len()
        );
        assert_eq!(back.items[1].status, Status::Ok);
    }

    #[test]
    fn reason_within_the_limit_is_kept_and_a_cut_one_stays_on_a_char_boundary() {
        let mut short = "model 'm': fine".to_string();
        cap_reason(&mut short, 15);
        assert_eq!(short, "model 'm': fine");
        // Cutting "€€€€" (12 bytes) to 8: two euros (6) and "…" (3) is 9,
        // too many, so one euro and the ellipsis.
        let mut euros = "€€€€".to_string();
        cap_reason(&mut euros, 8);
        assert_eq!(euros, "€…");
        // No room for the ellipsis: just the cut.
        let mut tiny = "abcdef".to_string();
        cap_reason(&mut tiny, 2);
        assert_eq!(tiny, "ab");
    }

    #[test]
    fn drain_ends_by_the_gateways_deadline_and_never_after_the_workers_own() {
        let now = tokio::time::Instant::now();
        let soon = now + Duration::from_millis(300);
        assert_eq!(drain_deadline(now, Some(soon)), soon);
        let late = now + Duration::from_secs(60);
        assert_eq!(drain_deadline(now, Some(late)), now + DRAIN_TIMEOUT);
        assert_eq!(drain_deadline(now, None), now + DRAIN_TIMEOUT);
        // A deadline already past (deadline_ms = 0, or read long ago).
        assert_eq!(drain_deadline(now, Some(now)), now);
    }

    /// A batch that can only finish if the link is polled (as a batch
    /// waiting on the gateway's acknowledgment can only finish while the
    /// connection is kept alive by heartbeats): the final wait polls the
    /// link, and a batch that does not finish by the deadline is handed back.
    #[tokio::test]
    async fn final_wait_keeps_polling_the_link_and_hands_back_at_the_deadline() {
        let batches = TaskTracker::new();
        let (polled, heard) = tokio::sync::oneshot::channel::<()>();
        batches.spawn(async move {
            let _ = heard.await;
        });
        batches.close();
        let mut polled = Some(polled);
        let link = std::future::poll_fn(move |_| {
            if let Some(tx) = polled.take() {
                let _ = tx.send(());
            }
            std::task::Poll::<()>::Pending
        });
        let mut link = Some(Box::pin(link));
        let far = tokio::time::Instant::now() + Duration::from_secs(3600);
        // Bounds a wait that never polls the link; no assertion depends on
        // how fast anything runs.
        let finished = tokio::time::timeout(
            Duration::from_secs(30),
            finish_batches(&batches, Some(far), &mut link),
        )
        .await
        .expect("the batch never finished: the final wait did not poll the link");
        assert_eq!(finished, Finish::Answered);
        assert!(link.is_some(), "the link is still up");

        let stuck = TaskTracker::new();
        stuck.spawn(std::future::pending::<()>());
        stuck.close();
        let now = tokio::time::Instant::now();
        assert_eq!(
            finish_batches(&stuck, Some(now), &mut link).await,
            Finish::HandedBack
        );
        let (taken, mut gone) = (
            AtomicU64::new(0),
            None::<std::pin::Pin<Box<std::future::Pending<()>>>>,
        );
        assert_eq!(
            serve_drain(&stuck, &taken, now, &mut gone).await,
            DrainEnd::LinkGone
        );
        assert_eq!(
            serve_drain(&stuck, &taken, now, &mut link).await,
            DrainEnd::Deadline
        );
    }

    #[test]
    fn full_executor_queue_sheds_as_overloaded_and_a_stopped_backend_fails() {
        let job = || crate::executor::Job {
            model: "m".into(),
            frames: Vec::new(),
            span: tracing::Span::none(),
        };
        let full = SubmitError::Overloaded {
            job: job(),
            capacity: 4,
        };
        assert_eq!(
            unrun_status(Some(&full)),
            Status::Shed(ShedReason::Overloaded)
        );
        let stopped = SubmitError::Stopped { job: job() };
        for status in [unrun_status(Some(&stopped)), unrun_status(None)] {
            assert!(
                matches!(&status, Status::Failed(r) if r.contains("backend thread has stopped")),
                "{status:?}"
            );
        }
    }

    /// An executor whose first job is running and held until the returned
    /// sender releases it.
    fn executor_with_a_held_batch() -> (
        Executor,
        tokio::sync::oneshot::Receiver<Vec<FrameOutcome>>,
        std::sync::mpsc::Sender<()>,
    ) {
        crate::executor::test_support::executor_with_a_held_job("m", Vec::new(), 4)
    }

    /// Bounds a wait that would hang if the behaviour under test were
    /// broken; no assertion depends on how fast anything runs.
    const BOUND: Duration = Duration::from_secs(10);

    /// Polls `fut` once: its output if it is ready now.
    async fn now<T>(fut: impl Future<Output = T>) -> Option<T> {
        tokio::select! {
            biased;
            out = fut => Some(out),
            _ = std::future::ready(()) => None,
        }
    }

    #[tokio::test]
    async fn registering_again_waits_until_the_old_links_batches_are_done() {
        let idle = crate::executor::test_support::idle_executor(4);
        let cancel = CancellationToken::new();
        assert_eq!(now(settle(&idle, &cancel)).await, Some(Settled::Idle));

        let (executor, answer, release) = executor_with_a_held_batch();
        let settled = settle(&executor, &cancel);
        tokio::pin!(settled);
        assert_eq!(
            now(&mut settled).await,
            None,
            "a batch of the old link runs"
        );
        release.send(()).unwrap();
        // Its answer goes nowhere: the link that wanted it is gone.
        drop(answer);
        let settled = tokio::time::timeout(BOUND, settled)
            .await
            .expect("settle never saw the executor idle");
        assert_eq!(settled, Settled::Idle);
        assert!(executor.is_idle());
    }

    #[tokio::test]
    async fn waiting_on_a_wedged_batch_ends_on_cancel() {
        let (executor, _answer, release) = executor_with_a_held_batch();
        let cancel = CancellationToken::new();
        let settled = settle(&executor, &cancel);
        tokio::pin!(settled);
        assert_eq!(now(&mut settled).await, None);
        cancel.cancel();
        let settled = tokio::time::timeout(BOUND, settled)
            .await
            .expect("cancel did not end the wait");
        assert_eq!(settled, Settled::Cancelled);
        assert!(!executor.is_idle(), "the batch still runs");
        // Unwedge it, so that the executor joins its thread when dropped.
        release.send(()).unwrap();
    }

    #[test]
    fn redial_backs_off_with_jitter_up_to_five_seconds() {
        use tidegate_kit::backoff::{Jitter, step};
        let ms = Duration::from_millis;
        // (redial, shortest delay, longest delay)
        let bands = [(0, 100, 200), (3, 800, 1600), (30, 2500, 5000)];
        for (redial, shortest, longest) in bands {
            let step = step(REDIAL_BASE, REDIAL_MAX, redial);
            assert_eq!(Jitter::EQUAL.band(step), (ms(shortest), ms(longest)));
        }
        let mut backoff = redial_backoff("w");
        assert_eq!(backoff.jitter(), Jitter::EQUAL);
        for redial in 0..40 {
            let (shortest, longest) = Jitter::EQUAL.band(step(REDIAL_BASE, REDIAL_MAX, redial));
            let d = backoff.next_delay();
            assert!(d >= shortest && d <= longest, "redial {redial}: {d:?}");
        }
        assert_eq!(backoff.next_step(), Duration::from_secs(5));
        let refused = LinkError::Refused {
            code: ErrorCode::Unauthorized,
            message: "token was already used".into(),
        };
        assert!(!refused.is_retryable());
        let busy = LinkError::Refused {
            code: ErrorCode::Unavailable,
            message: "already connected; retry once the old connection has ended".into(),
        };
        assert!(busy.is_retryable(), "unavailable means try again later");
        assert!(LinkError::Broken("reset".into()).is_retryable());
    }

    /// A link that stays up for the whole test.
    fn live_link() -> Option<std::pin::Pin<Box<std::future::Pending<()>>>> {
        Some(Box::pin(std::future::pending()))
    }

    /// Takes a dispatch stream at `at` (from now) whose batch runs for
    /// `runs`, as the link task does: counted in `taken`, run in `batches`.
    fn batch_at(
        batches: &TaskTracker,
        taken: &Arc<AtomicU64>,
        at: Duration,
        runs: Duration,
    ) -> tokio::task::JoinHandle<()> {
        let (batches, taken) = (batches.clone(), taken.clone());
        tokio::spawn(async move {
            tokio::time::sleep(at).await;
            taken.fetch_add(1, Ordering::Relaxed);
            batches.spawn(tokio::time::sleep(runs));
        })
    }

    /// The last batch ends at 100 ms; one more arrives at 200 ms, inside
    /// the quiet period, and runs to 250 ms: the quiet period that began at
    /// 100 ms does not end the drain, and the drain ends one full
    /// [`DRAIN_QUIET`] after the next began, at 600 ms, not before.
    #[tokio::test(start_paused = true)]
    async fn a_drain_ends_one_quiet_period_after_its_last_batch_and_a_new_batch_restarts_it() {
        let ms = Duration::from_millis;
        let start = tokio::time::Instant::now();
        let (batches, taken) = (TaskTracker::new(), Arc::new(AtomicU64::new(1)));
        batches.spawn(tokio::time::sleep(ms(100)));
        batches.close();
        let late = batch_at(&batches, &taken, ms(200), ms(50));
        let mut link = live_link();
        let end = serve_drain(&batches, &taken, start + DRAIN_TIMEOUT, &mut link).await;
        assert_eq!(end, DrainEnd::Quiet);
        assert_eq!(start.elapsed(), ms(100) + DRAIN_QUIET + DRAIN_QUIET);
        assert_eq!(ms(100) + DRAIN_QUIET, ms(350), "the late batch fell inside");
        assert_eq!(taken.load(Ordering::Relaxed), 2);
        assert!(link.is_some(), "the link stays up");
        late.await.unwrap();
    }

    /// A gateway that keeps dispatching a batch every 100 ms never leaves a
    /// quiet period: the drain ends at its deadline, to the millisecond,
    /// neither before nor after.
    #[tokio::test(start_paused = true)]
    async fn a_drain_under_steady_load_ends_exactly_at_its_deadline() {
        let ms = Duration::from_millis;
        let start = tokio::time::Instant::now();
        let (batches, taken) = (TaskTracker::new(), Arc::new(AtomicU64::new(0)));
        batches.close();
        let feeders: Vec<_> = (1..=40)
            .map(|i| batch_at(&batches, &taken, ms(100) * i + ms(30), ms(50)))
            .collect();
        let deadline = start + ms(1000);
        let end = serve_drain(&batches, &taken, deadline, &mut live_link()).await;
        assert_eq!(end, DrainEnd::Deadline);
        assert_eq!(tokio::time::Instant::now(), deadline);
        assert_eq!(taken.load(Ordering::Relaxed), 9, "batches at 130..=930 ms");
        for f in feeders {
            f.abort();
        }
    }

    /// The link ends 150 ms into a drain, in its quiet period: the drain
    /// ends then, says so, and drops the link.
    #[tokio::test(start_paused = true)]
    async fn a_drain_ends_when_the_link_goes_even_in_its_quiet_period() {
        let ms = Duration::from_millis;
        let start = tokio::time::Instant::now();
        let (batches, taken) = (TaskTracker::new(), AtomicU64::new(0));
        batches.close();
        let mut link = Some(Box::pin(tokio::time::sleep(ms(150))));
        let end = serve_drain(&batches, &taken, start + DRAIN_TIMEOUT, &mut link).await;
        assert_eq!(end, DrainEnd::LinkGone);
        assert_eq!(start.elapsed(), ms(150));
        assert!(link.is_none());
    }
}
