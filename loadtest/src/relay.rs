//! Relay overhead: what the gateway adds on top of the network.
//!
//! In one run, for each payload size (49,152 B = 128×128×3 and
//! 150,528 B = 224×224×3):
//! - **relay**: a real `tidegate-gateway` process on 127.0.0.1 with a no-op
//!   worker (it speaks the worker protocol and answers every item `ok` at
//!   once) and an edge client that sends `Frame`s on their own streams and
//!   waits for each `Result`: edge → gateway → worker → gateway → edge;
//! - **raw**: quinn alone, same TLS and transport settings, one hop: the
//!   client sends an 8-byte id and the payload on a unidirectional stream
//!   and the server answers on another with a 64-byte reply that starts
//!   with the same id, so each reply is matched to its own request.
//!
//! Both run closed-loop with the same number of frames in flight and report
//! frames per second and round-trip latency; the ratios relay / raw are the
//! gateway's overhead (two extra hops, a scheduler decision, and the
//! encoding of every message). Each path is bounded in frames and in time:
//! no frame is sent after the time limit, and a frame waits at most
//! [`REPLY_TIMEOUT`] for its reply.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use hdrhistogram::Histogram;
use serde::Serialize;
use tidegate_protocol::quic::{
    DialError, HandshakeError, ReadError, TlsError, client_config, dial, handshake, read_answer,
    read_message, server_config,
};
use tidegate_protocol::{
    BatchResult, CameraOpen, Codec, ColorOrder, DType, Encoding, Frame, Geometry, Heartbeat, Hello,
    InputSpec, ItemResult, Layout, Limits, Message, ModelInfo, ProfilePoint, Register, Resize,
    Role, Status, Tensor, Timings, quic::write_message,
};

use crate::cluster::{Cluster, ClusterError, ClusterOptions};

/// The relay path's frame budget: the gateway's longest (`[scheduler]
/// max_budget_ms`). The benchmark measures what the gateway adds to a
/// round trip, not deadlines: with the 80 ms of a camera, a frame that a
/// busy machine held up on its way in was shed `late_on_arrival` and the
/// run failed, a speed claim where only overhead is measured.
const RELAY_BUDGET_MS: u32 = 10_000;

/// How long a frame may wait for its reply before the path fails.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(10);

/// How long the no-op worker may take to register.
const REGISTER_TIMEOUT: Duration = Duration::from_secs(10);

/// Why the relay benchmark ([`run`]) failed. An error about the relay path
/// or the no-op worker carries the end of the gateway's log.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum RelayError {
    /// The local gateway did not start.
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    /// The no-op worker did not register with the gateway.
    #[error(
        "the no-op worker did not register: {reason}; gateway log (last lines, newest first):\n{gateway_log}"
    )]
    NoopWorker {
        /// Why: its error, or the time it was given.
        reason: String,
        /// The end of the gateway's log.
        gateway_log: String,
    },
    /// The raw-quinn server could not load the cluster's certificate.
    #[error("starting the raw quinn server: {0}")]
    RawServerTls(#[source] TlsError),
    /// The raw-quinn server could not bind its UDP socket.
    #[error("starting the raw quinn server: binding 127.0.0.1:0: {0}")]
    RawServerBind(#[source] std::io::Error),
    /// The path through the gateway failed.
    #[error(
        "relay path ({payload_bytes} B payloads) failed: {source}; gateway log (last lines, newest first):\n{gateway_log}"
    )]
    RelayPath {
        /// Payload size.
        payload_bytes: usize,
        /// What failed.
        source: PathError,
        /// The end of the gateway's log.
        gateway_log: String,
    },
    /// The raw-quinn path failed.
    #[error("raw quinn path ({payload_bytes} B payloads) failed: {source}")]
    RawPath {
        /// Payload size.
        payload_bytes: usize,
        /// What failed.
        source: PathError,
    },
}

debug_as_display!(RelayError);

/// Why one path (relay or raw) of the benchmark failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PathError {
    /// The client's TLS configuration could not be built from the CA.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// The server could not be dialled.
    #[error(transparent)]
    Dial(#[from] DialError),
    /// The gateway refused the edge or broke the handshake.
    #[error("edge handshake: {0}")]
    Handshake(#[from] HandshakeError),
    /// The gateway did not accept a camera.
    #[error("camera {camera} not accepted: {answer}")]
    CameraNotAccepted {
        /// The camera.
        camera: String,
        /// What the gateway answered instead, as debug text (`None`: it
        /// closed the stream).
        answer: String,
    },
    /// A stream could not be opened (the connection is gone).
    #[error("opening a stream: {0}")]
    Open(#[from] quinn::ConnectionError),
    /// Writing a message or payload failed.
    #[error("sending: {0}")]
    Write(#[from] quinn::WriteError),
    /// A stream was finished after it closed.
    #[error("finishing a stream: {0}")]
    Finish(#[from] quinn::ClosedStream),
    /// Reading the gateway's answer failed.
    #[error("reading the gateway's answer: {0}")]
    Read(#[from] ReadError),
    /// The raw server's address could not be read.
    #[error("the raw server's local address: {0}")]
    LocalAddr(#[source] std::io::Error),
    /// A frame's reply did not come in time.
    #[error("no reply to frame {seq} within {timeout:?}")]
    NoReply {
        /// The frame.
        seq: u64,
        /// How long it waited.
        timeout: Duration,
    },
    /// The task routing replies stopped (the connection closed) before a
    /// frame's reply came.
    #[error("the reply reader stopped before frame {seq}'s reply came; the connection closed")]
    ReaderStopped {
        /// The frame.
        seq: u64,
    },
    /// A frame was answered with something other than ok.
    #[error("frame {seq} ended {status:?}")]
    NotOk {
        /// The frame.
        seq: u64,
        /// How it ended.
        status: Status,
    },
    /// A round trip could not be recorded.
    #[error("recording a round trip: {0}")]
    Record(#[from] hdrhistogram::RecordError),
    /// The senders' histograms could not be merged.
    #[error("merging the senders' histograms: {0}")]
    Merge(#[from] hdrhistogram::AdditionError),
    /// A sender task panicked or was cancelled.
    #[error("sender task: {0}")]
    Task(#[from] tokio::task::JoinError),
}

/// Why the no-op worker stopped.
#[derive(Debug, thiserror::Error)]
enum NoopWorkerError {
    /// Its TLS configuration could not be built from the CA.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// The gateway could not be dialled.
    #[error(transparent)]
    Dial(#[from] DialError),
    /// The gateway refused the worker or broke the handshake.
    #[error("worker handshake: {0}")]
    Handshake(#[from] HandshakeError),
    /// Its registration could not be sent.
    #[error("sending its registration: {0}")]
    Register(#[from] quinn::WriteError),
    /// The connection to the gateway ended.
    #[error("connection to the gateway: {0}")]
    Connection(#[from] quinn::ConnectionError),
}

/// The last lines of the gateway's log, newest first.
fn log_tail(cluster: &Cluster) -> String {
    let log = cluster.gateway_log();
    let tail: Vec<&str> = log.lines().rev().take(20).collect();
    tail.join("\n")
}

/// Frames per second and latency of one path at one payload size.
#[derive(Debug, Clone, Serialize)]
pub struct PathResult {
    /// Frames completed.
    pub frames: usize,
    /// The time limit stopped the path before all its frames were sent.
    pub stopped_by_time_limit: bool,
    /// Frames per second.
    pub fps: f64,
    /// Median round trip (ms).
    pub p50_ms: f64,
    /// 99th percentile round trip (ms).
    pub p99_ms: f64,
}

/// One payload size: both paths and their ratios.
#[derive(Debug, Clone, Serialize)]
pub struct SizeResult {
    /// Payload bytes (the tensor).
    pub payload_bytes: usize,
    /// Through the gateway and a no-op worker.
    pub relay: PathResult,
    /// Raw quinn, one hop.
    pub raw: PathResult,
    /// relay fps / raw fps.
    pub fps_ratio: f64,
    /// relay p50 / raw p50.
    pub p50_ratio: f64,
}

/// The whole benchmark.
#[derive(Debug, Clone, Serialize)]
pub struct RelayReport {
    /// Which benchmark.
    pub bench: &'static str,
    /// Frames in flight at once.
    pub concurrency: usize,
    /// Per payload size.
    pub sizes: Vec<SizeResult>,
}

const SIZES: [(u32, u32); 2] = [(128, 128), (224, 224)];

/// Bytes of the request id that starts every raw request and its reply.
const RAW_ID_BYTES: usize = 8;

fn model_name(w: u32) -> String {
    format!("noop{w}")
}

fn input(w: u32, h: u32) -> InputSpec {
    InputSpec {
        width: w,
        height: h,
        channels: 3,
        dtype: DType::U8,
        layout: Layout::Nhwc,
        color: ColorOrder::Rgb,
        resize: Resize::Stretch,
    }
}

/// Runs both paths for both sizes with `frames` frames each, sending on
/// each path for at most `time_limit`.
pub async fn run(
    frames: usize,
    concurrency: usize,
    time_limit: Duration,
) -> Result<RelayReport, RelayError> {
    let cluster = Cluster::start(&ClusterOptions {
        edges: vec!["bench-edge".into()],
        workers: vec!["noop-worker".into()],
        ..ClusterOptions::default()
    })?;
    let worker = tokio::spawn(noop_worker(
        cluster.quic,
        cluster.ca(),
        cluster.worker_token().to_string(),
    ));
    // Wait for the registration to show up.
    let until = Instant::now() + REGISTER_TIMEOUT;
    loop {
        if let Ok((200, body)) = cluster.get("/api/v1/workers")
            && body.contains("noop-worker")
        {
            break;
        }
        if worker.is_finished() {
            let reason = match worker.await {
                Ok(Ok(())) => "it stopped".to_string(),
                Ok(Err(e)) => format!("it stopped: {e}"),
                Err(e) => format!("its task ended: {e}"),
            };
            return Err(RelayError::NoopWorker {
                reason,
                gateway_log: log_tail(&cluster),
            });
        }
        if Instant::now() > until {
            worker.abort();
            return Err(RelayError::NoopWorker {
                reason: format!("not within {REGISTER_TIMEOUT:?}"),
                gateway_log: log_tail(&cluster),
            });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let raw_server = RawServer::start(&cluster)?;
    let mut sizes = Vec::new();
    for (w, h) in SIZES {
        let payload = Bytes::from(vec![7u8; (w * h * 3) as usize]);
        let relay = relay_path(
            &cluster,
            w,
            h,
            payload.clone(),
            frames,
            concurrency,
            time_limit,
        )
        .await
        .map_err(|source| RelayError::RelayPath {
            payload_bytes: payload.len(),
            source,
            gateway_log: log_tail(&cluster),
        })?;
        let raw = raw_server
            .run(payload.clone(), frames, concurrency, time_limit)
            .await
            .map_err(|source| RelayError::RawPath {
                payload_bytes: payload.len(),
                source,
            })?;
        sizes.push(SizeResult {
            payload_bytes: payload.len(),
            fps_ratio: relay.fps / raw.fps,
            p50_ratio: relay.p50_ms / raw.p50_ms,
            relay,
            raw,
        });
    }
    worker.abort();
    Ok(RelayReport {
        bench: "relay",
        concurrency,
        sizes,
    })
}

/// A worker that answers every item `ok` at once.
async fn noop_worker(
    gateway: std::net::SocketAddr,
    ca: std::path::PathBuf,
    token: String,
) -> Result<(), NoopWorkerError> {
    let conn = dial(gateway, "localhost", client_config(&ca)?).await?;
    let hello = Hello {
        role: Role::Worker,
        name: "noop-worker".into(),
        token,
    };
    let limits = Limits::default();
    let (mut send, _recv, welcome) = handshake(&conn, hello, &limits).await?;
    let models = SIZES
        .iter()
        .map(|(w, h)| ModelInfo {
            name: model_name(*w),
            version: 1,
            input: input(*w, *h),
            max_batch: 8,
            labels: Vec::new(),
        })
        .collect();
    let profile = SIZES
        .iter()
        .flat_map(|(w, _)| {
            [(1, 50), (8, 100)].map(|(batch, latency_us)| ProfilePoint {
                model: model_name(*w),
                batch,
                latency_us,
            })
        })
        .collect();
    let register = Register {
        worker: "noop-worker".into(),
        device: "none (no-op)".into(),
        models,
        profile,
        // It answers without reading the tensors: raw is all it claims.
        codecs: vec![Codec::Raw],
    };
    write_message(&mut send, &Message::Register(register)).await?;
    let beat = Duration::from_millis(welcome.heartbeat_ms.max(100) as u64);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(beat);
        loop {
            tick.tick().await;
            let hb = Message::Heartbeat(Heartbeat {
                queue_depth: 0,
                utilization: 0.0,
            });
            if write_message(&mut send, &hb).await.is_err() {
                break;
            }
        }
    });
    loop {
        let mut recv = conn.accept_uni().await?;
        let conn = conn.clone();
        tokio::spawn(async move {
            let Ok(Some(Message::Dispatch(d))) = read_message(&mut recv, &limits).await else {
                return;
            };
            let result = BatchResult {
                batch: d.batch,
                items: d
                    .items
                    .iter()
                    .map(|i| ItemResult {
                        id: i.id,
                        status: Status::Ok,
                        detections: Vec::new(),
                        timings: Timings::default(),
                        outputs: Vec::new(),
                    })
                    .collect(),
            };
            if let Ok(mut s) = conn.open_uni().await
                && write_message(&mut s, &Message::BatchResult(result))
                    .await
                    .is_ok()
            {
                let _ = s.finish();
            }
        });
    }
}

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000, 3).expect("valid histogram bounds")
}

/// Drives a closed loop: `concurrency` senders, each doing up to
/// `per_sender` round trips one after another (`round_trip(sender, seq)`
/// sends one frame and waits for its reply), none begun after
/// `time_limit`. Each round trip is timed on its own.
async fn closed_loop<F, Fut>(
    concurrency: usize,
    per_sender: usize,
    time_limit: Duration,
    round_trip: F,
) -> Result<PathResult, PathError>
where
    F: Fn(usize, u64) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = Result<(), PathError>> + Send,
{
    let start = Instant::now();
    let stop_at = start + time_limit;
    let mut tasks = Vec::new();
    for sender in 0..concurrency {
        let round_trip = round_trip.clone();
        tasks.push(tokio::spawn(async move {
            let mut hist = histogram();
            let mut stopped = false;
            for seq in 0..per_sender as u64 {
                if Instant::now() >= stop_at {
                    stopped = true;
                    break;
                }
                let t = Instant::now();
                round_trip(sender, seq).await?;
                hist.record(t.elapsed().as_micros().max(1) as u64)?;
            }
            Ok::<_, PathError>((hist, stopped))
        }));
    }
    let mut hist = histogram();
    let mut stopped_by_time_limit = false;
    for t in tasks {
        let (h, stopped) = t.await??;
        hist.add(h)?;
        stopped_by_time_limit |= stopped;
    }
    let elapsed = start.elapsed();
    let frames = hist.len() as usize;
    Ok(PathResult {
        frames,
        stopped_by_time_limit,
        fps: frames as f64 / elapsed.as_secs_f64(),
        p50_ms: hist.value_at_quantile(0.5) as f64 / 1000.0,
        p99_ms: hist.value_at_quantile(0.99) as f64 / 1000.0,
    })
}

/// Waits up to [`REPLY_TIMEOUT`] for the reply to frame `seq`.
async fn reply<T>(rx: tokio::sync::oneshot::Receiver<T>, seq: u64) -> Result<T, PathError> {
    match tokio::time::timeout(REPLY_TIMEOUT, rx).await {
        Ok(Ok(reply)) => Ok(reply),
        Ok(Err(_)) => Err(PathError::ReaderStopped { seq }),
        Err(_) => Err(PathError::NoReply {
            seq,
            timeout: REPLY_TIMEOUT,
        }),
    }
}

/// Closed loop through the gateway: `concurrency` cameras, each with one
/// frame in flight.
async fn relay_path(
    cluster: &Cluster,
    w: u32,
    h: u32,
    payload: Bytes,
    frames: usize,
    concurrency: usize,
    time_limit: Duration,
) -> Result<PathResult, PathError> {
    let conn = dial(cluster.quic, "localhost", client_config(&cluster.ca())?).await?;
    let hello = Hello {
        role: Role::Edge,
        name: "bench-edge".into(),
        token: cluster.edge_token.clone(),
    };
    let limits = Limits::default();
    let (mut send, mut recv, _) = handshake(&conn, hello, &limits).await?;
    for cam in 0..concurrency {
        let camera = format!("cam{cam}");
        let open = CameraOpen {
            camera: camera.clone(),
            model: model_name(w),
            budget_ms: RELAY_BUDGET_MS,
            encoding: Encoding::Raw,
            copies: 1,
        };
        write_message(&mut send, &Message::CameraOpen(open)).await?;
        match read_answer(&mut recv, &limits).await? {
            Some(Message::CameraAccepted(_)) => {}
            other => {
                return Err(PathError::CameraNotAccepted {
                    camera,
                    answer: format!("{other:?}"),
                });
            }
        }
    }
    // Results arrive on their own streams; route them to the camera's task.
    let waiters: Arc<Vec<tokio::sync::Mutex<Option<tokio::sync::oneshot::Sender<Status>>>>> =
        Arc::new((0..concurrency).map(|_| Default::default()).collect());
    let reader = {
        let conn = conn.clone();
        let waiters = waiters.clone();
        tokio::spawn(async move {
            while let Ok(mut s) = conn.accept_uni().await {
                let waiters = waiters.clone();
                tokio::spawn(async move {
                    if let Ok(Some(Message::Result(r))) = read_message(&mut s, &limits).await {
                        let cam: usize = r.camera.trim_start_matches("cam").parse().unwrap_or(0);
                        if let Some(tx) = waiters[cam].lock().await.take() {
                            let _ = tx.send(r.status);
                        }
                    }
                });
            }
        })
    };
    let round_trip = {
        let conn = conn.clone();
        move |cam: usize, seq: u64| {
            let conn = conn.clone();
            let payload = payload.clone();
            let waiters = waiters.clone();
            async move {
                let (tx, rx) = tokio::sync::oneshot::channel();
                *waiters[cam].lock().await = Some(tx);
                let frame = Frame {
                    camera: format!("cam{cam}"),
                    seq,
                    captured_at_us: 0,
                    budget_us: RELAY_BUDGET_MS * 1000,
                    model: model_name(w),
                    geometry: Geometry::stretch(w, h, w, h),
                    tensor: Tensor::raw(DType::U8, Layout::Nhwc, vec![1, h, w, 3], payload),
                };
                let mut s = conn.open_uni().await?;
                write_message(&mut s, &Message::Frame(frame)).await?;
                s.finish()?;
                let status = reply(rx, seq).await?;
                if status != Status::Ok {
                    return Err(PathError::NotOk { seq, status });
                }
                Ok(())
            }
        }
    };
    let result = closed_loop(
        concurrency,
        frames.div_ceil(concurrency),
        time_limit,
        round_trip,
    )
    .await;
    reader.abort();
    conn.close(0u32.into(), b"done");
    result
}

/// The raw-quinn baseline server: reads a whole stream (an 8-byte id, then
/// the payload) and answers on a stream of its own with 64 bytes that
/// start with the id.
struct RawServer {
    endpoint: quinn::Endpoint,
    ca: std::path::PathBuf,
}

impl RawServer {
    fn start(cluster: &Cluster) -> Result<RawServer, RelayError> {
        let certs = cluster.dir().join("certs");
        let cfg = server_config(&certs.join("gateway.pem"), &certs.join("gateway.key"))
            .map_err(RelayError::RawServerTls)?;
        // the gateway's socket buffers, so that only the relay differs
        let (endpoint, _) = tidegate_protocol::quic::server_endpoint(
            cfg,
            (std::net::Ipv4Addr::LOCALHOST, 0).into(),
        )
        .map_err(RelayError::RawServerBind)?;
        let ep = endpoint.clone();
        tokio::spawn(async move {
            while let Some(incoming) = ep.accept().await {
                tokio::spawn(async move {
                    let Ok(conn) = incoming.await else { return };
                    while let Ok(mut s) = conn.accept_uni().await {
                        let conn = conn.clone();
                        tokio::spawn(async move {
                            if let Ok(data) = s.read_to_end(RAW_ID_BYTES + (1 << 20)).await
                                && data.len() >= RAW_ID_BYTES
                                && let Ok(mut out) = conn.open_uni().await
                            {
                                let mut reply = [0u8; 64];
                                reply[..RAW_ID_BYTES].copy_from_slice(&data[..RAW_ID_BYTES]);
                                let _ = out.write_all(&reply).await;
                                let _ = out.finish();
                            }
                        });
                    }
                });
            }
        });
        Ok(RawServer {
            endpoint,
            ca: cluster.ca(),
        })
    }

    async fn run(
        &self,
        payload: Bytes,
        frames: usize,
        concurrency: usize,
        time_limit: Duration,
    ) -> Result<PathResult, PathError> {
        let addr = self.endpoint.local_addr().map_err(PathError::LocalAddr)?;
        let conn = dial(addr, "localhost", client_config(&self.ca)?).await?;
        // Each request carries an id that its reply echoes; the reply goes
        // to the sender waiting for that id.
        type Waiting = Mutex<HashMap<u64, tokio::sync::oneshot::Sender<()>>>;
        let waiting: Arc<Waiting> = Arc::default();
        let reader = {
            let conn = conn.clone();
            let waiting = waiting.clone();
            tokio::spawn(async move {
                while let Ok(mut s) = conn.accept_uni().await {
                    let waiting = waiting.clone();
                    tokio::spawn(async move {
                        let Ok(data) = s.read_to_end(1024).await else {
                            return;
                        };
                        let Some(id) = data.first_chunk::<RAW_ID_BYTES>() else {
                            return;
                        };
                        let id = u64::from_be_bytes(*id);
                        if let Some(tx) = waiting.lock().expect("waiting lock").remove(&id) {
                            let _ = tx.send(());
                        }
                    });
                }
            })
        };
        let round_trip = {
            let conn = conn.clone();
            let waiting = waiting.clone();
            move |sender: usize, seq: u64| {
                let conn = conn.clone();
                let payload = payload.clone();
                let waiting = waiting.clone();
                async move {
                    let id = ((sender as u64) << 32) | seq;
                    let (tx, rx) = tokio::sync::oneshot::channel();
                    waiting.lock().expect("waiting lock").insert(id, tx);
                    let mut s = conn.open_uni().await?;
                    s.write_all(&id.to_be_bytes()).await?;
                    s.write_all(&payload).await?;
                    s.finish()?;
                    let answered = reply(rx, seq).await;
                    waiting.lock().expect("waiting lock").remove(&id);
                    answered
                }
            }
        };
        let result = closed_loop(
            concurrency,
            frames.div_ceil(concurrency),
            time_limit,
            round_trip,
        )
        .await;
        reader.abort();
        conn.close(0u32.into(), b"done");
        result
    }
}
