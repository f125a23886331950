//! The QUIC uplink to the gateway: authenticates, opens cameras, sends each
//! frame on its own unidirectional stream (newer frames at higher priority),
//! and delivers results and control hints.
//!
//! A camera sends through its [`Lane`], which keeps at most a few frames
//! unacknowledged and resets (`RESET_STREAM`, code 0) a frame that is
//! superseded — a newer frame of the camera was acknowledged first, or the
//! lane is full — or still unacknowledged at its deadline. Nothing is queued
//! for later: a stale frame is abandoned, never sent late.
//!
//! Results and hints reach the consumer through one bounded channel and are
//! never dropped: when the consumer falls behind, result streams wait to be
//! read and QUIC flow control holds the gateway back. A control stream that
//! fails (malformed bytes, a reset) closes the connection with its error
//! code (protocol §7.3), so the caller sees the loss and redials.
//!
//! The gateway has [`HANDSHAKE_TIMEOUT`] to answer `Hello` and
//! [`OPEN_TIMEOUT`] to answer each `CameraOpen`. The client's keep-alives
//! keep a connection alive for as long as the gateway's QUIC stack answers
//! them, even when the gateway itself is wedged; these deadlines are what
//! make the edge give up on such a gateway, close the connection and redial.
//!
//! This module has no GStreamer dependency, so `tidegate-loadtest`'s
//! simulated cameras use it too.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tidegate_protocol::queue;
use tidegate_protocol::quic::{HandshakeError, ReadError, handshake, read_message, write_message};
use tidegate_protocol::{
    CameraAccepted, CameraOpen, ControlHint, ErrorCode, ErrorMsg, Frame, FrameResult, GatewayAddr,
    Hello, LatencyReport, Limits, Message, Role,
};
use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info_span, warn};

/// Results and hints buffered for the consumer. When it is full nothing is
/// dropped: result streams wait to be read, and the gateway is held back by
/// QUIC flow control.
const INCOMING_QUEUE: usize = 4096;
/// Bytes of results and hints (see [`Incoming::held_bytes`]) buffered for
/// the consumer, whichever of this and [`INCOMING_QUEUE`] fills first:
/// 4096 results of `raw` outputs could otherwise take gigabytes.
const INCOMING_BYTES: usize = 64 * 1024 * 1024;
/// Result streams read at once. Further streams wait unaccepted, within the
/// connection's stream and flow-control limits, while the readers wait for
/// room in the consumer's queue.
const RESULT_READERS: usize = 64;
/// How long a failing control stream waits for its `Error` to be
/// acknowledged before the connection is closed anyway.
const ERROR_LINGER: Duration = Duration::from_secs(1);
/// How long [`Uplink::connect`] waits for the gateway's `Welcome` (or
/// `Error`) once the QUIC connection is up. Past it the connection is
/// closed and the connect fails with [`UplinkError::Unresponsive`].
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long [`Uplink::open_camera`] waits for the gateway's answer. Answers
/// come in order, so a missing one holds back every later one: past it the
/// connection is closed and the open fails with
/// [`UplinkError::Unresponsive`].
pub const OPEN_TIMEOUT: Duration = Duration::from_secs(10);

/// Why the uplink failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum UplinkError {
    /// TLS material could not be loaded.
    #[error(transparent)]
    Tls(#[from] tidegate_protocol::quic::TlsError),
    /// The local UDP socket could not be bound.
    #[error("binding a UDP socket: {0}")]
    Bind(std::io::Error),
    /// The gateway's name did not resolve, or the QUIC connection could not
    /// be set up.
    #[error("connecting to gateway {addr}: {reason}")]
    Connect {
        /// Gateway address.
        addr: GatewayAddr,
        /// What failed.
        reason: String,
    },
    /// The gateway refused us (bad token, unknown model...).
    #[error("gateway refused: {message} ({code:?})")]
    Refused {
        /// Its code.
        code: ErrorCode,
        /// Its explanation.
        message: String,
    },
    /// The gateway broke the protocol.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The connection is gone.
    #[error("connection to the gateway lost: {0}")]
    Lost(String),
    /// The gateway's QUIC stack is alive but the gateway did not answer in
    /// time; the connection has been closed so that the caller redials.
    #[error(
        "the gateway at {remote} did not answer {waiting_for} within {after:?} although \
         its QUIC stack is up; the connection was closed so that a redial starts afresh \
         (if this repeats, the gateway is stuck: check its logs)"
    )]
    Unresponsive {
        /// What the edge was waiting for, e.g. "Hello with Welcome".
        waiting_for: String,
        /// How long it waited.
        after: Duration,
        /// The gateway's address.
        remote: SocketAddr,
    },
}

impl UplinkError {
    /// Whether trying again later may succeed.
    pub fn retryable(&self) -> bool {
        match self {
            UplinkError::Refused { code, .. } => code.retryable(),
            UplinkError::Connect { .. }
            | UplinkError::Lost(_)
            | UplinkError::Unresponsive { .. } => true,
            _ => false,
        }
    }

    /// Whether the fault is on this machine (TLS material that cannot be
    /// loaded, a UDP socket that cannot be bound), not the gateway's.
    pub fn is_local(&self) -> bool {
        matches!(self, UplinkError::Tls(_) | UplinkError::Bind(_))
    }
}

/// What the uplink delivers to the edge.
#[derive(Debug)]
pub enum Incoming {
    /// A frame's result.
    Result(FrameResult),
    /// A control hint from the gateway.
    Hint(ControlHint),
}

impl Incoming {
    /// Roughly the memory it holds, in bytes (what the uplink's queue of
    /// them is bounded by).
    pub fn held_bytes(&self) -> usize {
        match self {
            Incoming::Result(r) => r.held_bytes(),
            Incoming::Hint(h) => std::mem::size_of::<ControlHint>() + h.camera.len(),
        }
    }
}

enum Command {
    Open(
        CameraOpen,
        oneshot::Sender<Result<CameraAccepted, UplinkError>>,
    ),
    Latency(LatencyReport),
}

/// A connected, authenticated uplink.
#[derive(Debug, Clone)]
pub struct Uplink {
    conn: quinn::Connection,
    commands: mpsc::Sender<Command>,
    open_timeout: Duration,
}

/// Deadlines of an [`Uplink`]. [`Default`] is what the edge uses:
/// [`HANDSHAKE_TIMEOUT`] and [`OPEN_TIMEOUT`]; tests shorten them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UplinkOptions {
    /// Longest wait for `Welcome` once the QUIC connection is up.
    pub handshake_timeout: Duration,
    /// Longest wait for the answer to a `CameraOpen`.
    pub open_timeout: Duration,
}

impl Default for UplinkOptions {
    fn default() -> Self {
        UplinkOptions {
            handshake_timeout: HANDSHAKE_TIMEOUT,
            open_timeout: OPEN_TIMEOUT,
        }
    }
}

/// Closes `conn` because the gateway did not answer in time, and says so.
fn unresponsive(conn: &quinn::Connection, waiting_for: &str, after: Duration) -> UplinkError {
    let err = UplinkError::Unresponsive {
        waiting_for: waiting_for.to_string(),
        after,
        remote: conn.remote_address(),
    };
    // Code 0: not an error in anything the gateway sent (protocol §7.1).
    let reason = format!("no answer to {waiting_for} within {after:?}");
    conn.close(0u32.into(), reason.as_bytes());
    err
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Command::Open(o, _) => write!(f, "Open({})", o.camera),
            Command::Latency(r) => write!(f, "Latency({}#{})", r.camera, r.seq),
        }
    }
}

impl Uplink {
    /// Connects to the gateway at `addr` (resolving a host name now, see
    /// [`tidegate_protocol::quic::dial_addr`]), trusting `ca`, and
    /// authenticates as `name`. Returns the uplink and the stream of results
    /// and hints. Uses [`UplinkOptions::default`].
    pub async fn connect(
        addr: &GatewayAddr,
        server_name: &str,
        ca: &Path,
        name: &str,
        token: &str,
    ) -> Result<(Uplink, queue::Receiver<Incoming>), UplinkError> {
        Self::connect_with(addr, server_name, ca, name, token, UplinkOptions::default()).await
    }

    /// [`Uplink::connect`] with explicit deadlines. A gateway that does not
    /// answer `Hello` within `options.handshake_timeout` fails the connect
    /// with [`UplinkError::Unresponsive`] (retryable), its connection closed.
    pub async fn connect_with(
        addr: &GatewayAddr,
        server_name: &str,
        ca: &Path,
        name: &str,
        token: &str,
        options: UplinkOptions,
    ) -> Result<(Uplink, queue::Receiver<Incoming>), UplinkError> {
        let client = tidegate_protocol::quic::client_config(ca)?;
        Self::connect_client(addr, server_name, client, name, token, options).await
    }

    /// [`Uplink::connect_with`] with the QUIC client configuration (the CA
    /// to trust) already loaded, by
    /// [`tidegate_protocol::quic::client_config`]: a caller that redials
    /// loads it once, so a CA file rewritten meanwhile cannot fail a redial.
    pub async fn connect_client(
        addr: &GatewayAddr,
        server_name: &str,
        client: quinn::ClientConfig,
        name: &str,
        token: &str,
        options: UplinkOptions,
    ) -> Result<(Uplink, queue::Receiver<Incoming>), UplinkError> {
        let connect_err = |reason: String| UplinkError::Connect {
            addr: addr.clone(),
            reason,
        };
        let conn = tidegate_protocol::quic::dial_addr(addr, server_name, client)
            .await
            .map_err(|e| match e {
                tidegate_protocol::quic::DialError::Bind(e) => UplinkError::Bind(e),
                other => connect_err(other.to_string()),
            })?;
        let hello = Hello {
            role: Role::Edge,
            name: name.to_string(),
            token: token.to_string(),
        };
        // The keep-alives hold the connection open while the gateway's QUIC
        // stack answers, however long the gateway itself takes: bound it.
        let answered = tokio::time::timeout(
            options.handshake_timeout,
            handshake(&conn, hello, &Limits::default()),
        )
        .await
        .map_err(|_| unresponsive(&conn, "Hello with Welcome", options.handshake_timeout))?;
        let (send, recv, _welcome) = answered.map_err(|e| match e {
            HandshakeError::Refused { code, message } => UplinkError::Refused { code, message },
            HandshakeError::Protocol(m) => UplinkError::Protocol(m),
            other => UplinkError::Lost(other.to_string()),
        })?;

        let (in_tx, in_rx) = queue::channel(INCOMING_QUEUE, INCOMING_BYTES);
        let (cmd_tx, cmd_rx) = mpsc::channel(256);
        let span =
            info_span!("uplink", gateway = %addr, addr = %conn.remote_address(), edge = name);
        tokio::spawn(
            control(conn.clone(), send, recv, cmd_rx, in_tx.clone()).instrument(span.clone()),
        );
        tokio::spawn(results(conn.clone(), in_tx).instrument(span));
        Ok((
            Uplink {
                conn,
                commands: cmd_tx,
                open_timeout: options.open_timeout,
            },
            in_rx,
        ))
    }

    /// Opens a camera and returns the gateway's answer: the input the model
    /// expects and its class names. Without an answer within the open
    /// timeout ([`OPEN_TIMEOUT`] by default) the connection is closed and
    /// the open fails with [`UplinkError::Unresponsive`]: the answers that
    /// should follow would wait behind the missing one.
    pub async fn open_camera(
        &self,
        camera: &str,
        model: &str,
        budget_ms: u32,
    ) -> Result<CameraAccepted, UplinkError> {
        let (tx, rx) = oneshot::channel();
        let open = CameraOpen {
            camera: camera.to_string(),
            model: model.to_string(),
            budget_ms,
        };
        let opened = async {
            self.commands
                .send(Command::Open(open, tx))
                .await
                .map_err(|_| UplinkError::Lost("control stream closed".into()))?;
            rx.await
                .map_err(|_| UplinkError::Lost("control stream closed".into()))?
        };
        // A late answer, if one ever comes, goes to the dropped reply: the
        // control task keeps answers matched to opens in order.
        tokio::time::timeout(self.open_timeout, opened)
            .await
            .unwrap_or_else(|_| {
                let what = format!("CameraOpen for camera '{camera}'");
                Err(unresponsive(&self.conn, &what, self.open_timeout))
            })
    }

    /// Sends a frame on its own stream. Newer frames (higher `seq`) get a
    /// higher stream priority. Returns once the frame is handed to QUIC.
    pub async fn send_frame(&self, frame: Frame) -> Result<(), UplinkError> {
        let mut s = self
            .conn
            .open_uni()
            .await
            .map_err(|e| UplinkError::Lost(e.to_string()))?;
        let _ = s.set_priority((frame.seq % i32::MAX as u64) as i32);
        write_message(&mut s, &Message::Frame(frame))
            .await
            .map_err(|e| UplinkError::Lost(e.to_string()))?;
        let _ = s.finish();
        Ok(())
    }

    /// Sends raw bytes on a new unidirectional stream (for tests of the
    /// gateway's handling of malformed input).
    pub async fn send_raw(&self, bytes: &[u8]) -> Result<(), UplinkError> {
        let mut s = self
            .conn
            .open_uni()
            .await
            .map_err(|e| UplinkError::Lost(e.to_string()))?;
        s.write_all(bytes)
            .await
            .map_err(|e| UplinkError::Lost(e.to_string()))?;
        let _ = s.finish();
        Ok(())
    }

    /// Reports the end-to-end latency of a result to the gateway.
    pub fn report_latency(&self, camera: &str, seq: u64, e2e_us: u64) {
        let _ = self.commands.try_send(Command::Latency(LatencyReport {
            camera: camera.to_string(),
            seq,
            e2e_us: e2e_us.min(u32::MAX as u64) as u32,
        }));
    }

    /// The gateway's address this connection reached (its name resolved).
    pub fn remote_address(&self) -> SocketAddr {
        self.conn.remote_address()
    }

    /// The connection's current round-trip estimate.
    pub fn rtt(&self) -> std::time::Duration {
        self.conn.rtt()
    }

    /// Closes the connection.
    pub fn close(&self) {
        self.conn.close(0u32.into(), b"edge closing");
    }

    /// Waits until the connection is gone and says why.
    pub async fn closed(&self) -> String {
        self.conn.closed().await.to_string()
    }

    /// Whether the connection is gone.
    pub fn is_closed(&self) -> bool {
        self.conn.close_reason().is_some()
    }

    /// A lane for `camera` on this connection, keeping at most
    /// `max_in_flight` frames unacknowledged and counting into `stats`
    /// (which may outlive the connection).
    pub fn lane(&self, camera: &str, max_in_flight: usize, stats: Arc<LaneStats>) -> Lane {
        self.lane_with(camera, max_in_flight, stats, None)
    }

    /// [`Uplink::lane`] that also records, in `unanswered`, each frame it
    /// sends until the frame is abandoned (reset, refused, lost) or
    /// [`Unanswered::answered`] is called for its result.
    pub fn lane_with(
        &self,
        camera: &str,
        max_in_flight: usize,
        stats: Arc<LaneStats>,
        unanswered: Option<Arc<Unanswered>>,
    ) -> Lane {
        Lane {
            conn: self.conn.clone(),
            state: Arc::new(LaneState {
                camera: camera.to_string(),
                max_in_flight: max_in_flight.max(1),
                in_flight: Mutex::new(VecDeque::new()),
                stats,
                unanswered,
            }),
            tasks: tokio_util::task::TaskTracker::new(),
        }
    }
}

/// Frames sent whose result has not come yet, by camera and `seq`: what an
/// edge that is stopping still waits for. A lane made with
/// [`Uplink::lane_with`] adds each frame as it sends it and removes it when
/// the frame is abandoned; the consumer of results removes it with
/// [`Unanswered::answered`]. Either may happen first: a result can overtake
/// the acknowledgement of its frame. Keyed by frame, not counted, so an
/// extra result (for a frame the edge reset but the gateway had read)
/// stands for no other frame.
///
/// Bounded: at most [`Unanswered::PER_CAMERA`] frames per camera; beyond
/// that the oldest is forgotten (its result is long overdue).
#[derive(Debug, Default)]
pub struct Unanswered {
    frames: Mutex<HashMap<String, BTreeSet<u64>>>,
    /// Woken when the last frame is forgotten.
    emptied: tokio::sync::Notify,
}

impl Unanswered {
    /// Frames of one camera remembered at most.
    pub const PER_CAMERA: usize = 1024;

    fn frames(&self) -> std::sync::MutexGuard<'_, HashMap<String, BTreeSet<u64>>> {
        // Each update is one insert or remove: usable after a panic.
        self.frames.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A frame of `camera` goes out.
    fn sent(&self, camera: &str, seq: u64) {
        let mut frames = self.frames();
        let seqs = frames.entry(camera.to_string()).or_default();
        seqs.insert(seq);
        while seqs.len() > Self::PER_CAMERA {
            if let Some(oldest) = seqs.pop_first() {
                debug!(
                    camera,
                    oldest, "no result for this frame yet; no longer waiting for it"
                );
            }
        }
    }

    /// The frame will not be answered (reset, refused, or lost with its
    /// connection) or has been: stop waiting for it.
    fn forget(&self, camera: &str, seq: u64) {
        let mut frames = self.frames();
        if let Some(seqs) = frames.get_mut(camera) {
            seqs.remove(&seq);
            if seqs.is_empty() {
                frames.remove(camera);
                if frames.is_empty() {
                    self.emptied.notify_waiters();
                }
            }
        }
    }

    /// The result of frame `seq` of `camera` has come (and been handled).
    /// A result for a frame not waited for changes nothing.
    pub fn answered(&self, camera: &str, seq: u64) {
        self.forget(camera, seq);
    }

    /// The connection the frames went out on is gone: none of them will be
    /// answered.
    pub fn clear(&self) {
        self.frames().clear();
        self.emptied.notify_waiters();
    }

    /// Resolves once no frame is waited for (at once if none is).
    pub async fn emptied(&self) {
        let notified = self.emptied.notified();
        tokio::pin!(notified);
        // Registered before the check, so that a frame forgotten in between
        // is not missed.
        notified.as_mut().enable();
        if self.is_empty() {
            return;
        }
        notified.await;
    }

    /// Frames waited for, all cameras.
    pub fn len(&self) -> usize {
        self.frames().values().map(BTreeSet::len).sum()
    }

    /// Whether no frame is waited for.
    pub fn is_empty(&self) -> bool {
        self.frames().is_empty()
    }
}

/// What became of a camera's frames on the wire.
#[derive(Debug, Default)]
pub struct LaneStats {
    /// Frames acknowledged by the gateway's QUIC stack.
    pub delivered: AtomicU64,
    /// Frames reset because a newer frame of the camera got there first, or
    /// the lane was full.
    pub superseded: AtomicU64,
    /// Frames reset because they were still unacknowledged at their deadline.
    pub expired: AtomicU64,
    /// Frames refused by the gateway (`STOP_SENDING` with an error code).
    pub refused: AtomicU64,
    /// Frames whose stream was open when the connection was lost. A frame
    /// whose stream could not even be opened is not counted here:
    /// [`Lane::send`] returns an error for it and the caller counts it.
    pub lost: AtomicU64,
}

impl LaneStats {
    fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Frames reset (superseded or expired).
    pub fn reset(&self) -> u64 {
        self.superseded.load(Ordering::Relaxed) + self.expired.load(Ordering::Relaxed)
    }
}

#[derive(Debug)]
struct LaneState {
    camera: String,
    max_in_flight: usize,
    /// Unacknowledged frames, oldest first: (seq, abandon signal).
    in_flight: Mutex<VecDeque<(u64, CancellationToken)>>,
    stats: Arc<LaneStats>,
    /// Where frames sent are recorded until answered, if anywhere.
    unanswered: Option<Arc<Unanswered>>,
}

impl LaneState {
    /// The frame will get no result: stop waiting for one.
    fn abandoned(&self, seq: u64) {
        if let Some(u) = &self.unanswered {
            u.forget(&self.camera, seq);
        }
    }
}

impl LaneState {
    fn in_flight(&self) -> std::sync::MutexGuard<'_, VecDeque<(u64, CancellationToken)>> {
        // Each update is one VecDeque call or a scan: usable after a panic.
        self.in_flight
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// How a frame stream ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Delivered,
    Superseded,
    Expired,
    Refused,
    Lost,
}

/// One camera's sender on one connection. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Lane {
    conn: quinn::Connection,
    state: Arc<LaneState>,
    tasks: tokio_util::task::TaskTracker,
}

impl Lane {
    /// Sends `frame` on its own stream, abandoning it (reset) if it is still
    /// unacknowledged at `deadline` or superseded first. When the lane is
    /// full the oldest frame in flight is abandoned to make room. Returns
    /// once the stream is open; the rest happens in a task of its own, and
    /// the frame's fate is counted in the lane's [`LaneStats`].
    ///
    /// A frame whose stream cannot be opened because the connection is gone
    /// is returned as [`UplinkError::Lost`] and not counted by the lane: the
    /// caller counts it (the edge node as `dropped_outage`).
    pub async fn send(
        &self,
        frame: Frame,
        deadline: tokio::time::Instant,
    ) -> Result<(), UplinkError> {
        let seq = frame.seq;
        let abandon = CancellationToken::new();
        // Recorded before the frame can go out: its result may come back
        // before the lane sees the acknowledgement.
        if let Some(u) = &self.state.unanswered {
            u.sent(&self.state.camera, seq);
        }
        {
            let mut q = self.state.in_flight();
            while q.len() >= self.state.max_in_flight {
                if let Some((_, oldest)) = q.pop_front() {
                    oldest.cancel();
                }
            }
            q.push_back((seq, abandon.clone()));
        }
        // Opening waits for stream credit from the gateway; a frame that
        // cannot even start before its deadline is dropped as expired.
        let stream = match tokio::time::timeout_at(deadline, self.conn.open_uni()).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                self.forget(seq);
                self.state.abandoned(seq);
                return Err(UplinkError::Lost(e.to_string()));
            }
            Err(_) => {
                self.forget(seq);
                self.state.abandoned(seq);
                LaneStats::bump(&self.state.stats.expired);
                return Ok(());
            }
        };
        let _ = stream.set_priority((seq % i32::MAX as u64) as i32);
        let state = self.state.clone();
        let span = tracing::debug_span!("frame", camera = %state.camera, seq);
        self.tasks.spawn(
            async move {
                let outcome = drive(stream, frame, deadline, abandon).await;
                let lane = Lane::forget_in(&state, seq);
                let stats = &state.stats;
                if outcome != Outcome::Delivered {
                    state.abandoned(seq);
                }
                match outcome {
                    Outcome::Delivered => {
                        LaneStats::bump(&stats.delivered);
                        // Older frames still on the way are now useless.
                        for (older, token) in lane.iter().filter(|(s, _)| *s < seq) {
                            debug!(older, "superseded by {seq}");
                            token.cancel();
                        }
                    }
                    Outcome::Superseded => LaneStats::bump(&stats.superseded),
                    Outcome::Expired => LaneStats::bump(&stats.expired),
                    Outcome::Refused => LaneStats::bump(&stats.refused),
                    Outcome::Lost => LaneStats::bump(&stats.lost),
                }
                debug!(?outcome, "frame stream done");
            }
            .instrument(span),
        );
        Ok(())
    }

    /// Frames of this lane not yet acknowledged, reset or lost.
    pub fn in_flight(&self) -> usize {
        self.state.in_flight().len()
    }

    /// Waits (at most `timeout`) until every frame sent so far is settled.
    pub async fn settle(&self, timeout: std::time::Duration) {
        self.tasks.close();
        let _ = tokio::time::timeout(timeout, self.tasks.wait()).await;
        self.tasks.reopen();
    }

    fn forget(&self, seq: u64) {
        Lane::forget_in(&self.state, seq);
    }

    /// Removes `seq` from the lane; returns the tokens of the frames left.
    fn forget_in(state: &LaneState, seq: u64) -> Vec<(u64, CancellationToken)> {
        let mut q = state.in_flight();
        q.retain(|(s, _)| *s != seq);
        q.iter().cloned().collect()
    }
}

/// Writes one frame, finishes the stream and waits for the acknowledgement,
/// unless it is abandoned or its deadline passes first; then it is reset.
async fn drive(
    mut stream: quinn::SendStream,
    frame: Frame,
    deadline: tokio::time::Instant,
    abandon: CancellationToken,
) -> Outcome {
    let message = Message::Frame(frame);
    // A frame both late and superseded counts as expired.
    let reason = tokio::select! {
        biased;
        _ = tokio::time::sleep_until(deadline) => Outcome::Expired,
        _ = abandon.cancelled() => Outcome::Superseded,
        r = async {
            write_message(&mut stream, &message).await.map_err(|_| ())?;
            stream.finish().map_err(|_| ())?;
            stream.stopped().await.map_err(|_| ())
        } => {
            return match r {
                Ok(None) => Outcome::Delivered,
                Ok(Some(code)) if code.into_inner() == 0 => Outcome::Delivered,
                Ok(Some(_)) => Outcome::Refused,
                Err(()) => Outcome::Lost,
            };
        }
    };
    // Code 0: a deliberate abandonment (protocol §7.3).
    let _ = stream.reset(0u32.into());
    reason
}

/// Why the control conversation ended.
enum ControlEnd {
    /// Every [`Uplink`] is gone: nobody can send a command any more.
    Dropped,
    /// The gateway finished the control stream.
    Finished,
    /// The control stream failed; the connection is closed with this code.
    Failed(ErrorCode, String),
}

/// Reads the next control message. It owns the stream while it reads and
/// hands it back, so that one read can stay in progress across the turns of
/// [`control`]'s loop: `read_message` is not cancel-safe, and a read dropped
/// half way through a message would desynchronise the stream.
async fn read_control(
    mut recv: quinn::RecvStream,
) -> (quinn::RecvStream, Result<Option<Message>, ReadError>) {
    let msg = read_message(&mut recv, &Limits::default()).await;
    (recv, msg)
}

/// Owns the control stream: writes commands, reads replies and hints. When
/// the stream fails it says why (`Error`, if it still can) and closes the
/// connection with the error's code (protocol §7.3), so that the uplink's
/// owner sees the connection end and redials.
async fn control(
    conn: quinn::Connection,
    mut send: quinn::SendStream,
    recv: quinn::RecvStream,
    mut commands: mpsc::Receiver<Command>,
    incoming: queue::Sender<Incoming>,
) {
    // Camera opens are answered in order on this stream.
    let mut pending: VecDeque<oneshot::Sender<Result<CameraAccepted, UplinkError>>> =
        VecDeque::new();
    let mut read = Box::pin(read_control(recv));
    let end = loop {
        tokio::select! {
            cmd = commands.recv() => {
                let Some(cmd) = cmd else { break ControlEnd::Dropped };
                let msg = match cmd {
                    Command::Open(open, reply) => {
                        pending.push_back(reply);
                        Message::CameraOpen(open)
                    }
                    Command::Latency(r) => Message::LatencyReport(r),
                };
                if let Err(e) = write_message(&mut send, &msg).await {
                    break ControlEnd::Failed(
                        ErrorCode::Internal,
                        format!("writing the control stream: {e}"),
                    );
                }
            }
            (recv, msg) = &mut read => match msg {
                Ok(Some(msg)) => {
                    read.set(read_control(recv));
                    on_control_message(msg, &mut pending, &incoming).await;
                }
                Ok(None) => break ControlEnd::Finished,
                Err(e) => break ControlEnd::Failed(e.code(), format!("reading the control stream: {e}")),
            },
        }
    };
    let why = match end {
        ControlEnd::Dropped => "the uplink was dropped".to_string(),
        ControlEnd::Finished => {
            warn!("the gateway ended the control stream; closing the connection");
            conn.close(0u32.into(), b"the gateway ended the control stream");
            "the gateway ended it".to_string()
        }
        ControlEnd::Failed(code, message) => {
            if conn.close_reason().is_none() {
                warn!(?code, "{message}; closing the connection");
                // Say what was wrong if we still can, and give it a moment
                // to be acknowledged before the close discards it.
                let error = Message::Error(ErrorMsg {
                    code,
                    message: message.clone(),
                });
                let _ = tokio::time::timeout(ERROR_LINGER, async {
                    if write_message(&mut send, &error).await.is_ok() && send.finish().is_ok() {
                        let _ = send.stopped().await;
                    }
                })
                .await;
                conn.close(code.quic_code().into(), message.as_bytes());
            } else {
                debug!("control stream ended with the connection: {message}");
            }
            message
        }
    };
    for reply in pending {
        let _ = reply.send(Err(UplinkError::Lost(format!(
            "control stream closed: {why}"
        ))));
    }
}

/// Handles one message from the gateway's side of the control stream.
async fn on_control_message(
    msg: Message,
    pending: &mut VecDeque<oneshot::Sender<Result<CameraAccepted, UplinkError>>>,
    incoming: &queue::Sender<Incoming>,
) {
    match msg {
        Message::CameraAccepted(a) => match pending.pop_front() {
            Some(reply) => {
                let _ = reply.send(Ok(a));
            }
            None => warn!(camera = %a.camera, "CameraAccepted that answers no CameraOpen"),
        },
        Message::Error(e) => match pending.pop_front() {
            Some(reply) => {
                let _ = reply.send(Err(UplinkError::Refused {
                    code: e.code,
                    message: e.message,
                }));
            }
            None => warn!(code = ?e.code, "gateway error: {}", e.message),
        },
        // Waits for room rather than dropping the hint: a hint is rare and
        // the latest one is the one in force.
        Message::ControlHint(h) => {
            let hint = Incoming::Hint(h);
            let size = hint.held_bytes();
            if incoming.send(hint, size).await.is_err() {
                debug!("hint consumer gone");
            }
        }
        other => warn!(kind = ?other.kind(), "unexpected message on the control stream"),
    }
}

/// Accepts result streams and forwards their results, reading at most
/// [`RESULT_READERS`] streams at once. A reader waits for room in the
/// consumer's queue (a slot, and the result's bytes), so a slow consumer
/// slows the gateway down instead of losing results; what the edge holds
/// is bounded by that queue and the results its readers hold. A stream that does not carry one well-formed `Result` is
/// stopped with its error code (protocol §7.3).
async fn results(conn: quinn::Connection, incoming: queue::Sender<Incoming>) {
    let readers = Arc::new(Semaphore::new(RESULT_READERS));
    loop {
        let permit = tokio::select! {
            p = readers.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break,
            },
            _ = conn.closed() => break,
        };
        let Ok(mut recv) = conn.accept_uni().await else {
            break;
        };
        let incoming = incoming.clone();
        tokio::spawn(
            async move {
                let _permit = permit;
                match read_message(&mut recv, &Limits::default()).await {
                    Ok(Some(Message::Result(r))) => {
                        let size = r.held_bytes();
                        if incoming.send(Incoming::Result(r), size).await.is_err() {
                            debug!("result consumer gone");
                        }
                    }
                    Ok(Some(other)) => {
                        warn!(kind = ?other.kind(), "unexpected message on a result stream");
                        let _ = recv.stop(ErrorCode::Malformed.quic_code().into());
                    }
                    Ok(None) => {}
                    Err(ReadError::Stream(e)) => debug!("result stream failed: {e}"),
                    Err(e) => {
                        warn!("bad result stream: {e}");
                        let _ = recv.stop(e.code().quic_code().into());
                    }
                }
            }
            .in_current_span(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unanswered_frames_are_tracked_by_camera_and_seq_not_counted() {
        let u = Unanswered::default();
        u.sent("door", 1);
        u.sent("door", 2);
        u.sent("yard", 1);
        assert_eq!(u.len(), 3);
        // A second result for frame 1, or one for a frame never waited for,
        // stands for no other frame.
        u.answered("door", 1);
        u.answered("door", 1);
        u.answered("door", 7);
        u.answered("hall", 2);
        assert_eq!(u.len(), 2);
        u.forget("door", 2);
        u.answered("yard", 1);
        assert!(u.is_empty());
        u.sent("door", 3);
        u.clear();
        assert!(u.is_empty());
    }

    #[test]
    fn unanswered_forgets_the_oldest_frames_beyond_its_bound() {
        let u = Unanswered::default();
        let n = Unanswered::PER_CAMERA as u64;
        for seq in 0..n + 10 {
            u.sent("door", seq);
        }
        assert_eq!(u.len(), Unanswered::PER_CAMERA);
        u.answered("door", 5);
        assert_eq!(
            u.len(),
            Unanswered::PER_CAMERA,
            "frame 5 was already forgotten"
        );
        u.answered("door", n + 9);
        assert_eq!(u.len(), Unanswered::PER_CAMERA - 1);
    }

    #[tokio::test]
    async fn emptied_resolves_when_the_last_frame_is_answered() {
        let u = Arc::new(Unanswered::default());
        tokio::time::timeout(Duration::from_secs(5), u.emptied())
            .await
            .expect("nothing waited for: at once");
        u.sent("door", 1);
        u.sent("door", 2);
        let waiter = tokio::spawn({
            let u = u.clone();
            async move { u.emptied().await }
        });
        u.answered("door", 1);
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        u.answered("door", 2);
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("woken by the last answer")
            .unwrap();
    }
}
