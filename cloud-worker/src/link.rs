//! The worker's QUIC link to the gateway: dial in, authenticate, register
//! (models and measured latency profile), then serve dispatched batches
//! through the [`Executor`] and send heartbeats, until drained or cancelled.
//!
//! Batches arrive on unidirectional streams; each result goes back on a new
//! unidirectional stream. Inference runs on the executor's own thread, never
//! on tokio's.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tidegate_protocol::quic::{HandshakeError, handshake, read_message, write_message};
use tidegate_protocol::{
    BatchResult, Dispatch, Drain, ErrorCode, Heartbeat, Hello, ItemResult, Limits, Message,
    Register, Role, Status,
};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, debug, info, info_span, warn};

use crate::backend::{FrameInput, FrameOutcome};
use crate::executor::{Executor, Job, SubmitError};

/// Where and as whom to dial in.
#[derive(Clone)]
pub struct LinkConfig {
    /// Gateway QUIC address.
    pub gateway: SocketAddr,
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
        matches!(self, LinkError::Dial(_) | LinkError::Broken(_))
    }
}

/// Delay before redial `attempt` (0-based): 200 ms doubling to at most 5 s,
/// scaled by `jitter` in [0, 1) to between 50 % and 100 %, so workers that
/// lost the same gateway do not redial in step.
pub fn redial_delay(attempt: u32, jitter: f64) -> Duration {
    let base = Duration::from_millis(200).saturating_mul(1u32 << attempt.min(5));
    base.min(Duration::from_secs(5))
        .mul_f64(0.5 + 0.5 * jitter.clamp(0.0, 1.0))
}

/// How a link ended without error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkEnd {
    /// Drained on the gateway's request or on shutdown: every batch taken
    /// was answered.
    Drained,
    /// The gateway closed the connection.
    Closed,
}

/// Load figures shared between the batch tasks and the heartbeat.
#[derive(Debug, Default)]
struct Load {
    in_flight: AtomicU64,
    busy_us: AtomicU64,
    /// Batches accepted so far.
    taken: AtomicU64,
}

/// A drain ends once no batch has arrived for this long with none in flight.
/// Longer than the gaps between batches of a camera throttled to a few
/// frames a second, so that a pause in the load, not a gap in it, ends it.
const DRAIN_QUIET: Duration = Duration::from_millis(250);

/// A drain ends after this long even if the gateway keeps dispatching.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// Dials the gateway, registers, and serves until the gateway drains or
/// closes us, or `cancel` fires (then it drains: batches already taken are
/// finished and answered before returning).
pub async fn run(
    cfg: &LinkConfig,
    executor: Arc<Executor>,
    register: Register,
    cancel: CancellationToken,
) -> Result<LinkEnd, LinkError> {
    let client = tidegate_protocol::quic::client_config(&cfg.ca)?;
    let conn = tidegate_protocol::quic::dial(cfg.gateway, &cfg.server_name, client).await?;
    let broken = |e: &dyn std::fmt::Display| LinkError::Broken(e.to_string());
    let limits = Limits::default();
    let hello = Hello {
        role: Role::Worker,
        name: cfg.name.clone(),
        token: cfg.token.clone(),
    };
    let (mut ctl_send, mut ctl_recv, welcome) =
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
    info!(gateway = %cfg.gateway, "registered");

    let load = Arc::new(Load::default());
    let batches = TaskTracker::new();
    let drain = CancellationToken::new();
    let started = Instant::now();

    // Control stream: heartbeats out; Drain in; our own Drain out when
    // `cancel` fires (SIGTERM), so the gateway stops dispatching to us.
    let control = {
        let load = load.clone();
        let drain = drain.clone();
        let cancel = cancel.clone();
        async move {
            let mut tick = tokio::time::interval(Duration::from_millis(heartbeat_ms as u64));
            let mut last = (Instant::now(), 0u64);
            let mut told = false;
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
                        let busy = load.busy_us.load(Ordering::Relaxed);
                        let elapsed = last.0.elapsed().as_micros().max(1) as f64;
                        let utilization = ((busy - last.1) as f64 / elapsed).clamp(0.0, 1.0) as f32;
                        last = (Instant::now(), busy);
                        let hb = Message::Heartbeat(Heartbeat {
                            queue_depth: load.in_flight.load(Ordering::Relaxed) as u32,
                            utilization,
                        });
                        if write_message(&mut ctl_send, &hb).await.is_err() {
                            break;
                        }
                    }
                    msg = read_message(&mut ctl_recv, &limits) => match msg {
                        Ok(Some(Message::Drain(d))) => {
                            // Heartbeats go on while the batches taken finish.
                            info!(deadline_ms = d.deadline_ms, "drain requested by the gateway");
                            drain.cancel();
                        }
                        Ok(Some(other)) => warn!(kind = ?other.kind(), "unexpected control message"),
                        Ok(None) | Err(_) => break,
                    },
                }
            }
        }
    };

    // Dispatch streams: one batch each.
    let accept = {
        let conn = conn.clone();
        let batches = batches.clone();
        let executor = executor.clone();
        let load = load.clone();
        async move {
            while let Ok(mut recv) = conn.accept_uni().await {
                // Counted on arrival, so that a drain does not end while a
                // dispatch is still being read.
                load.taken.fetch_add(1, Ordering::Relaxed);
                let dispatch = match read_message(&mut recv, &limits).await {
                    Ok(Some(Message::Dispatch(d))) => d,
                    Ok(Some(other)) => {
                        warn!(kind = ?other.kind(), "dispatch stream carried a non-Dispatch message; stream closed");
                        let _ = recv.stop(ErrorCode::Malformed.quic_code().into());
                        continue;
                    }
                    Ok(None) => continue,
                    Err(e) => {
                        warn!("bad dispatch stream closed: {e}");
                        let _ = recv.stop(ErrorCode::Malformed.quic_code().into());
                        continue;
                    }
                };
                let span = info_span!("batch", batch = dispatch.batch, model = %dispatch.model,
                    frames = dispatch.items.len(),
                    first = %dispatch.items.first().map(|i| format!("{}#{}", i.camera, i.seq)).unwrap_or_default());
                let task = serve_batch(conn.clone(), executor.clone(), load.clone(), dispatch);
                batches.spawn(task.instrument(span));
            }
        }
    };

    tokio::pin!(control, accept);
    let end = tokio::select! {
        _ = cancel.cancelled() => LinkEnd::Drained,
        _ = drain.cancelled() => LinkEnd::Drained,
        _ = &mut control => LinkEnd::Closed,
        _ = &mut accept => LinkEnd::Closed,
    };
    batches.close();
    if end == LinkEnd::Drained {
        // The protocol has no "draining" message from worker to gateway, so
        // the gateway goes on dispatching to us until we close, and a batch
        // it sent just before the close would be lost on the way. So keep
        // serving (accepting, answering, heartbeating) until every batch
        // taken is answered and no new one has come for DRAIN_QUIET, or
        // DRAIN_TIMEOUT has passed. A closed tracker still takes new tasks.
        info!(
            in_flight = batches.len(),
            "draining: finishing the batches taken"
        );
        let deadline = tokio::time::Instant::now() + DRAIN_TIMEOUT;
        loop {
            let seen = load.taken.load(Ordering::Relaxed);
            let gone = tokio::select! {
                _ = batches.wait() => false,
                _ = &mut accept => true,
                _ = &mut control => true,
                _ = tokio::time::sleep_until(deadline) => true,
            };
            if gone {
                break;
            }
            let gone = tokio::select! {
                _ = tokio::time::sleep(DRAIN_QUIET) => false,
                _ = &mut accept => true,
                _ = &mut control => true,
            };
            if gone || (load.taken.load(Ordering::Relaxed) == seen && batches.is_empty()) {
                break;
            }
        }
        if tokio::time::Instant::now() >= deadline {
            warn!(
                timeout_s = DRAIN_TIMEOUT.as_secs(),
                "drain timed out while the gateway kept dispatching"
            );
        }
    }
    // Whatever is still running is answered before leaving.
    batches.wait().await;
    if end == LinkEnd::Drained {
        conn.close(0u32.into(), b"drained");
    }
    info!(uptime_s = started.elapsed().as_secs(), ?end, "link ended");
    Ok(end)
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
    let started = Instant::now();
    let outcomes = match executor.try_submit(job) {
        Ok(rx) => rx.await.ok(),
        Err(SubmitError::Overloaded { capacity, .. }) => {
            warn!(capacity, "executor queue full");
            None
        }
        Err(e) => {
            warn!("executor unavailable: {e}");
            None
        }
    };
    load.busy_us
        .fetch_add(started.elapsed().as_micros() as u64, Ordering::Relaxed);
    load.in_flight.fetch_sub(1, Ordering::Relaxed);
    let items = match outcomes {
        Some(outcomes) => item_results(&ids, outcomes, &Limits::default()),
        None => ids
            .iter()
            .map(|&id| ItemResult {
                id,
                status: Status::Failed(
                    "worker could not run the batch (executor overloaded or stopped)".into(),
                ),
                detections: Vec::new(),
                timings: Default::default(),
                outputs: Vec::new(),
            })
            .collect(),
    };
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

/// The batch's results for the gateway. Raw outputs of one frame are
/// bounded by the decoder; those of the whole batch must fit one message
/// (`max_tensor_bytes`), so a frame whose outputs would overflow it fails
/// with the reason instead of breaking the message.
fn item_results(ids: &[u64], outcomes: Vec<FrameOutcome>, limits: &Limits) -> Vec<ItemResult> {
    let mut total = 0usize;
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
            item
        })
        .collect()
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

    #[test]
    fn redial_backs_off_with_jitter_up_to_five_seconds() {
        assert_eq!(redial_delay(0, 1.0), Duration::from_millis(200));
        assert_eq!(redial_delay(0, 0.0), Duration::from_millis(100));
        assert_eq!(redial_delay(3, 1.0), Duration::from_millis(1600));
        assert_eq!(redial_delay(30, 1.0), Duration::from_secs(5));
        assert_eq!(redial_delay(30, 0.0), Duration::from_millis(2500));
        let refused = LinkError::Refused {
            code: ErrorCode::Unauthorized,
            message: "token was already used".into(),
        };
        assert!(!refused.is_retryable());
        assert!(LinkError::Broken("reset".into()).is_retryable());
    }
}
