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
    BatchResult, Dispatch, ErrorCode, Heartbeat, Hello, ItemResult, Limits, Message, Register, Role,
};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, debug, info, info_span, warn};

use crate::backend::FrameInput;
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
}

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

    // Control stream: heartbeats out; Drain in.
    let control = {
        let load = load.clone();
        let drain = drain.clone();
        async move {
            let mut tick = tokio::time::interval(Duration::from_millis(heartbeat_ms as u64));
            let mut last = (Instant::now(), 0u64);
            loop {
                tokio::select! {
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
                            info!(deadline_ms = d.deadline_ms, "drain requested by the gateway");
                            drain.cancel();
                            break;
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

    let end = tokio::select! {
        _ = cancel.cancelled() => LinkEnd::Drained,
        _ = drain.cancelled() => LinkEnd::Drained,
        _ = control => LinkEnd::Closed,
        _ = accept => LinkEnd::Closed,
    };
    // Finish and answer every batch already taken before leaving.
    batches.close();
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
        Some(outcomes) => ids
            .iter()
            .zip(outcomes)
            .map(|(&id, o)| ItemResult {
                id,
                status: o.status,
                detections: o.detections,
                timings: o.timings,
            })
            .collect(),
        None => ids
            .iter()
            .map(|&id| ItemResult {
                id,
                status: tidegate_protocol::Status::Failed(
                    "worker could not run the batch (executor overloaded or stopped)".into(),
                ),
                detections: Vec::new(),
                timings: Default::default(),
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
