//! The QUIC uplink to the gateway: authenticates, opens cameras, sends each
//! frame on its own unidirectional stream (frames handed later at higher
//! priority, across all the connection's cameras: see [`SendOrder`]), and
//! delivers results and control hints.
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

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tidegate_protocol::queue;
use tidegate_protocol::quic::{HandshakeError, ReadError, handshake, read_message, write_message};
use tidegate_protocol::{
    CameraAccepted, CameraOpen, ClockEcho, ControlHint, Encoding, ErrorCode, ErrorMsg, Frame,
    FrameResult, GatewayAddr, Hello, LatencyReport, Limits, Message, Role,
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
    /// No QUIC connection came up within the dial's bound
    /// ([`UplinkOptions::dial_timeout`]): the dial was abandoned.
    #[error(
        "connecting to gateway {addr}: no QUIC connection within {after:?} (is the link down?); \
         this dial is abandoned, the next starts afresh"
    )]
    DialTimeout {
        /// Gateway address.
        addr: GatewayAddr,
        /// The bound it waited.
        after: Duration,
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
            | UplinkError::DialTimeout { .. }
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
    /// This process's number for the connection ([`Uplink::id`]).
    id: u64,
    commands: mpsc::Sender<Command>,
    open_timeout: Duration,
    /// Cameras opened with more than one copy, and the results already
    /// taken of each: the gateway sends such a camera each result
    /// `copies` times, and the later copies are dropped here.
    copies: Arc<ResultCopies>,
    /// Stream priorities of the frames sent on the connection.
    order: Arc<SendOrder>,
    /// Windows in which a camera found the connection pressed.
    pressure: Arc<UplinkPressure>,
    /// The kinds of camera refusal already logged on this connection
    /// ([`Uplink::first_refusal`]).
    refusals: Arc<Mutex<HashSet<(ErrorCode, String)>>>,
}

/// The windows in which one of a connection's cameras found its uplink
/// pressed, so that every camera on it backs off together (one bottleneck,
/// one signal): frames handed later go first ([`SendOrder`]), so when the
/// link is full it is the cameras whose frames happened to be handed
/// first that miss, and alone they would step down while the others kept
/// climbing into the room they left.
#[derive(Debug, Default)]
struct UplinkPressure {
    /// Windows with frames reset on the wire, or waiting in a queue.
    pressed: AtomicU64,
    /// Of them, windows whose frames waited in a queue.
    queued: AtomicU64,
}

/// The stream priority of each frame sent on one connection: the order in
/// which frames were handed to QUIC, newest highest, whichever camera they
/// come from.
///
/// QUIC interleaves streams of equal priority. Cameras in step (sixteen
/// started together at 15 fps) hand their frames at the same instant, and
/// interleaved, every frame of such a burst finishes only when the whole
/// burst does: on a 10 Mbit/s uplink, sixteen 5 KB frames all take 64 ms.
/// One after another, the first takes 4 ms and the last still 64. Newest
/// first also keeps the rule the priorities had when they were each
/// camera's `seq`: a frame handed after another goes ahead of it, so under
/// overload the old frames wait (and are reset at their deadline) rather
/// than the fresh ones; and no camera goes ahead of the others because its
/// `seq` happens to be higher.
///
/// Priorities wrap after `i32::MAX` frames (about 100 days at 240 frames a
/// second on one connection); the frames handed just after a wrap go behind
/// those just before it for as long as both are in flight, a few
/// milliseconds.
#[derive(Debug, Default)]
pub struct SendOrder(AtomicU64);

impl SendOrder {
    /// The priority of the next frame handed to QUIC.
    pub fn next(&self) -> i32 {
        let n = self.0.fetch_add(1, Ordering::Relaxed);
        // Lossless: the remainder is below i32::MAX.
        (n % i32::MAX as u64) as i32
    }
}

/// The number of the next connection [`Uplink::connect_client`] sets up.
static NEXT_CONNECTION: AtomicU64 = AtomicU64::new(1);

/// Deadlines of an [`Uplink`]. [`Default`] has [`HANDSHAKE_TIMEOUT`] and
/// [`OPEN_TIMEOUT`], and no bound on the dial; the edge node bounds the
/// dial (`node::DIAL_ATTEMPT`), tests shorten the rest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UplinkOptions {
    /// Longest wait for the QUIC connection (the gateway's name resolved,
    /// the QUIC handshake done); `None`: as long as QUIC tries (its idle
    /// timeout). Past it the dial is abandoned and the connect fails with
    /// [`UplinkError::DialTimeout`] (retryable): a dial into a dead link backs
    /// its Initial packets off (1 s, 2 s, 4 s...), so a fresh dial once
    /// the link is back connects sooner than the old one's next Initial.
    pub dial_timeout: Option<Duration>,
    /// Longest wait for `Welcome` once the QUIC connection is up.
    pub handshake_timeout: Duration,
    /// Longest wait for the answer to a `CameraOpen`.
    pub open_timeout: Duration,
}

impl Default for UplinkOptions {
    fn default() -> Self {
        UplinkOptions {
            dial_timeout: None,
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
        let dial = tidegate_protocol::quic::dial_addr(addr, server_name, client);
        let dialled =
            match options.dial_timeout {
                // Dropping the dial abandons it: its endpoint and socket go.
                Some(limit) => tokio::time::timeout(limit, dial).await.map_err(|_| {
                    UplinkError::DialTimeout {
                        addr: addr.clone(),
                        after: limit,
                    }
                })?,
                None => dial.await,
            };
        let conn = dialled.map_err(|e| match e {
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
        let copies = Arc::new(ResultCopies::default());
        tokio::spawn(results(conn.clone(), in_tx, copies.clone()).instrument(span));
        Ok((
            Uplink {
                conn,
                id: NEXT_CONNECTION.fetch_add(1, Ordering::Relaxed),
                commands: cmd_tx,
                open_timeout: options.open_timeout,
                copies,
                order: Arc::default(),
                pressure: Arc::default(),
                refusals: Arc::default(),
            },
            in_rx,
        ))
    }

    /// Later copies of results dropped so far on this connection (cameras
    /// opened with copies; see [`Uplink::open_camera_with`]).
    pub fn result_copies_dropped(&self) -> u64 {
        self.copies.dropped.load(Ordering::Relaxed)
    }

    /// Opens a camera whose frames travel as `encoding` and returns the
    /// gateway's answer: the input the model expects, its class names and
    /// the encoding accepted. Without an answer within the open timeout
    /// ([`OPEN_TIMEOUT`] by default) the connection is closed and the open
    /// fails with [`UplinkError::Unresponsive`]: the answers that should
    /// follow would wait behind the missing one.
    pub async fn open_camera(
        &self,
        camera: &str,
        model: &str,
        budget_ms: u32,
        encoding: Encoding,
    ) -> Result<CameraAccepted, UplinkError> {
        self.open_camera_with(CameraOpen {
            camera: camera.to_string(),
            model: model.to_string(),
            budget_ms,
            encoding,
            copies: 1,
        })
        .await
    }

    /// [`Uplink::open_camera`] with every field of the `CameraOpen`: a
    /// camera opened with `copies` above 1 sends each frame that many times
    /// (its lane, [`Lane::with_copies`]) and gets each result that many
    /// times, of which the uplink passes on the first.
    pub async fn open_camera_with(&self, open: CameraOpen) -> Result<CameraAccepted, UplinkError> {
        let camera = open.camera.clone();
        let (tx, rx) = oneshot::channel();
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
        let accepted = tokio::time::timeout(self.open_timeout, opened)
            .await
            .unwrap_or_else(|_| {
                let what = format!("CameraOpen for camera '{camera}'");
                Err(unresponsive(&self.conn, &what, self.open_timeout))
            })?;
        self.copies.opened(&camera, accepted.copies);
        Ok(accepted)
    }

    /// Sends a frame on its own stream, ahead of the frames handed before it
    /// ([`SendOrder`]). Returns once the frame is handed to QUIC.
    pub async fn send_frame(&self, frame: Frame) -> Result<(), UplinkError> {
        let mut s = self
            .conn
            .open_uni()
            .await
            .map_err(|e| UplinkError::Lost(e.to_string()))?;
        let _ = s.set_priority(self.order.next());
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

    /// This process's number for the connection: each connection set up
    /// gets the next, so frames can be told apart by the connection they
    /// went out on ([`Unanswered::connection_ended`]).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The gateway's address this connection reached (its name resolved).
    pub fn remote_address(&self) -> SocketAddr {
        self.conn.remote_address()
    }

    /// The connection's current round-trip estimate.
    pub fn rtt(&self) -> std::time::Duration {
        self.conn.rtt()
    }

    /// Records that a camera's window found the connection pressed on the
    /// wire (`queued`: its frames waited behind other bytes; otherwise they
    /// were reset). The other cameras see it in [`PathStats`].
    pub fn report_pressed(&self, queued: bool) {
        self.pressure.pressed.fetch_add(1, Ordering::Relaxed);
        if queued {
            self.pressure.queued.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The connection's path statistics now: round trips, congestion
    /// window, packets sent and lost since it was set up, and the windows
    /// its cameras found it pressed in. The counters start from zero on
    /// every connection.
    pub fn path_stats(&self) -> PathStats {
        let stats = self.conn.stats();
        let p = stats.path;
        PathStats {
            pressed_windows: self.pressure.pressed.load(Ordering::Relaxed),
            queued_windows: self.pressure.queued.load(Ordering::Relaxed),
            rtt: p.rtt,
            min_rtt: p.min_rtt,
            cwnd: p.cwnd,
            sent_packets: p.sent_packets,
            lost_packets: p.lost_packets,
            lost_bytes: p.lost_bytes,
            congestion_events: p.congestion_events,
            sent_bytes: stats.udp_tx.bytes,
        }
    }

    /// The connection's counters since it was set up, and its path now
    /// (what [`crate::uplink_stats::UplinkStats`] carries across
    /// connections). Still readable once the connection has ended.
    pub fn quic_reading(&self) -> crate::uplink_stats::QuicReading {
        let s = self.conn.stats();
        crate::uplink_stats::QuicReading {
            totals: crate::uplink_stats::QuicTotals {
                sent_bytes: s.udp_tx.bytes,
                received_bytes: s.udp_rx.bytes,
                sent_datagrams: s.udp_tx.datagrams,
                sent_packets: s.path.sent_packets,
                lost_packets: s.path.lost_packets,
                congestion_events: s.path.congestion_events,
            },
            cwnd: s.path.cwnd,
            rtt: s.path.rtt,
        }
    }

    /// Why the connection ended; `None` while it lives.
    pub fn close_reason(&self) -> Option<quinn::ConnectionError> {
        self.conn.close_reason()
    }

    /// Closes the connection.
    pub fn close(&self) {
        self.conn.close(0u32.into(), b"edge closing");
    }

    /// Waits until the connection is gone and says why.
    pub async fn closed(&self) -> String {
        self.conn.closed().await.to_string()
    }

    /// Whether this is the first refusal with `code` for a camera of
    /// `model` on this connection: cameras refused alike (no worker for
    /// their model yet, while a gateway restarts) are logged once per
    /// connection, not once per camera and retry.
    pub fn first_refusal(&self, code: ErrorCode, model: &str) -> bool {
        self.refusals
            .lock()
            .expect("refusals lock")
            .insert((code, model.to_string()))
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
    /// sends and what became of it on the wire, so that `unanswered` can
    /// tell how each frame ended (see [`Unanswered`]).
    pub fn lane_with(
        &self,
        camera: &str,
        max_in_flight: usize,
        stats: Arc<LaneStats>,
        unanswered: Option<Arc<Unanswered>>,
    ) -> Lane {
        Lane {
            conn: self.conn.clone(),
            order: self.order.clone(),
            state: Arc::new(LaneState {
                camera: camera.to_string(),
                conn: self.id,
                max_in_flight: max_in_flight.max(1),
                copies: 1,
                in_flight: Mutex::new(VecDeque::new()),
                stats,
                unanswered,
            }),
            tasks: tokio_util::task::TaskTracker::new(),
        }
    }
}

/// Every frame a lane made with [`Uplink::lane_with`] sent, by camera and
/// `seq`, until it has ended, and how the frames of each camera ended
/// beyond what the lane's [`LaneStats`] count ([`FrameEnds`]).
///
/// A frame ends once, as one of: its result (the consumer calls
/// [`Unanswered::answered`]); reset, refused or lost on the wire (the lane
/// counts these) with no result after all; or acknowledged, with no result
/// when its connection ended ([`Unanswered::connection_ended`]:
/// `lost_connection`). Result and wire outcome may come in either order: a
/// result can overtake the acknowledgement of its frame, and the gateway
/// may have read and answered a frame that the lane then reset. Such a
/// frame ends as its result, and is counted in [`FrameEnds`] so that it is
/// not also a reset. Keyed by frame, not counted, so an extra result (a
/// second one, or one for a frame never sent) stands for no other frame.
///
/// Bounded: at most [`Unanswered::PER_CAMERA`] frames per camera; beyond
/// that the oldest is forgotten. A frame reset long ago is already
/// counted; one acknowledged and still waiting for its result is counted
/// `gave_up`.
#[derive(Debug, Default)]
pub struct Unanswered {
    cameras: Mutex<HashMap<String, CameraFrames>>,
    /// Woken when the last frame awaited ends.
    emptied: tokio::sync::Notify,
}

/// How a camera's frames ended beyond what its [`LaneStats`] count. With
/// them, every frame the lane sent is counted exactly once:
///
/// ```text
/// sent = results of these frames
///      + (superseded - answered_superseded) + (expired - answered_expired)
///      + (refused - answered_refused) + (lost - answered_lost)
///      + lost_connection + gave_up + awaiting
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FrameEnds {
    /// Frames reset as superseded whose result came all the same (the
    /// gateway had read them): they end as results.
    pub answered_superseded: u64,
    /// Frames reset at their deadline whose result came all the same.
    pub answered_expired: u64,
    /// Frames refused whose result came all the same.
    pub answered_refused: u64,
    /// Frames whose stream was cut by the connection's end, but whose
    /// result came before it.
    pub answered_lost: u64,
    /// Frames the gateway acknowledged whose result had not come when
    /// their connection ended.
    pub lost_connection: u64,
    /// Frames the gateway acknowledged whose result was given up on while
    /// their connection lived: [`Unanswered::PER_CAMERA`] newer frames of
    /// the camera were tracked meanwhile.
    pub gave_up: u64,
    /// Frames sent that have not ended yet (on the wire, or acknowledged
    /// and awaiting their result): a count now, not a running total.
    pub awaiting: u64,
}

impl FrameEnds {
    /// A result came for a frame that ended on the wire as `fate`.
    fn answered_after(&mut self, fate: WireFate) {
        match fate {
            WireFate::Delivered => {}
            WireFate::Superseded => self.answered_superseded += 1,
            WireFate::Expired => self.answered_expired += 1,
            WireFate::Refused => self.answered_refused += 1,
            WireFate::Lost => self.answered_lost += 1,
        }
    }
}

/// One camera's frames in an [`Unanswered`].
#[derive(Debug, Default)]
struct CameraFrames {
    frames: BTreeMap<u64, Tracked>,
    /// How many of `frames` are awaited ([`Tracked::awaited`]).
    awaited: usize,
    ends: FrameEnds,
}

/// What is known of one frame that has not ended, or that ended on the
/// wire while a result could still come.
#[derive(Debug, Clone, Copy)]
struct Tracked {
    /// [`Uplink::id`] of the connection it went out on.
    conn: u64,
    /// What became of it on the wire, once the lane knows.
    fate: Option<WireFate>,
    /// Its result has come (its fate on the wire has not).
    answered: bool,
    /// Its connection has ended: no result can come any more.
    conn_ended: bool,
}

impl Tracked {
    /// Whether the frame has not ended: no result, and neither reset,
    /// refused nor lost on the wire.
    fn awaited(&self) -> bool {
        !self.answered && matches!(self.fate, None | Some(WireFate::Delivered))
    }
}

impl CameraFrames {
    /// Applies `f` to frame `seq` if it is tracked; `f` returns whether to
    /// keep tracking it. Returns whether the frame was tracked.
    fn update(&mut self, seq: u64, f: impl FnOnce(&mut Tracked, &mut FrameEnds) -> bool) -> bool {
        let Some(t) = self.frames.get_mut(&seq) else {
            return false;
        };
        let was = t.awaited();
        let keep = f(t, &mut self.ends);
        let is = keep && t.awaited();
        if !keep {
            self.frames.remove(&seq);
        }
        match (was, is) {
            (true, false) => self.awaited -= 1,
            (false, true) => self.awaited += 1,
            _ => {}
        }
        true
    }

    /// Forgets the oldest frame (beyond the bound).
    fn forget_oldest(&mut self, camera: &str) {
        let Some((seq, t)) = self.frames.pop_first() else {
            return;
        };
        if t.awaited() {
            self.awaited -= 1;
            // A frame on the wire is never this old: a lane holds at most
            // `max_in_flight` (64 at most) of them.
            self.ends.gave_up += 1;
            warn!(
                camera,
                seq,
                "no result for this frame after {} newer ones; no longer waiting for it",
                Unanswered::PER_CAMERA
            );
        }
    }
}

impl Unanswered {
    /// Frames of one camera remembered at most.
    pub const PER_CAMERA: usize = 1024;

    fn cameras(&self) -> std::sync::MutexGuard<'_, HashMap<String, CameraFrames>> {
        // Each update leaves the map consistent: usable after a panic.
        self.cameras.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Wakes [`Unanswered::emptied`] if no frame is awaited any more.
    fn wake_if_emptied(&self, cameras: &HashMap<String, CameraFrames>) {
        if cameras.values().all(|c| c.awaited == 0) {
            self.emptied.notify_waiters();
        }
    }

    /// Frame `seq` of `camera` goes out on connection `conn`.
    fn sent(&self, camera: &str, seq: u64, conn: u64) {
        let mut cameras = self.cameras();
        let c = cameras.entry(camera.to_string()).or_default();
        let tracked = Tracked {
            conn,
            fate: None,
            answered: false,
            conn_ended: false,
        };
        if c.frames
            .insert(seq, tracked)
            .is_some_and(|old| old.awaited())
        {
            c.awaited -= 1;
        }
        c.awaited += 1;
        while c.frames.len() > Self::PER_CAMERA {
            c.forget_oldest(camera);
        }
    }

    /// Frame `seq` of `camera` did not go out after all (its stream could
    /// not be opened): the caller counts it as not sent.
    fn unsent(&self, camera: &str, seq: u64) {
        let mut cameras = self.cameras();
        if let Some(c) = cameras.get_mut(camera) {
            c.update(seq, |_, _| false);
        }
        self.wake_if_emptied(&cameras);
    }

    /// The lane knows what became of frame `seq` of `camera` on the wire
    /// (after counting it in its [`LaneStats`]).
    fn settled(&self, camera: &str, seq: u64, fate: WireFate) {
        let mut cameras = self.cameras();
        if let Some(c) = cameras.get_mut(camera) {
            c.update(seq, |t, ends| {
                if t.answered {
                    // Its result came first: the frame ended as a result.
                    ends.answered_after(fate);
                    return false;
                }
                match fate {
                    WireFate::Delivered if t.conn_ended => {
                        ends.lost_connection += 1;
                        false
                    }
                    // Awaiting its result; or ended on the wire, unless
                    // its result comes after all.
                    _ if !t.conn_ended => {
                        t.fate = Some(fate);
                        true
                    }
                    _ => false,
                }
            });
        }
        self.wake_if_emptied(&cameras);
    }

    /// The result of frame `seq` of `camera` has come (and been handled).
    /// Returns whether it is the first result of a frame tracked here; a
    /// second result, or one for a frame not tracked, changes nothing.
    pub fn answered(&self, camera: &str, seq: u64) -> bool {
        let mut cameras = self.cameras();
        let Some(c) = cameras.get_mut(camera) else {
            return false;
        };
        let mut first = false;
        c.update(seq, |t, ends| {
            if t.answered {
                return true;
            }
            first = true;
            match t.fate {
                // Its fate on the wire is still to come.
                None => {
                    t.answered = true;
                    true
                }
                Some(fate) => {
                    ends.answered_after(fate);
                    false
                }
            }
        });
        self.wake_if_emptied(&cameras);
        first
    }

    /// Connection `conn` ([`Uplink::id`]) has ended and every result it
    /// delivered has been handled ([`Unanswered::answered`]): its frames
    /// acknowledged and unanswered are lost with it. Returns how many, by
    /// camera (those still on the wire are counted when the lane settles
    /// them: `lost_connection` if acknowledged after all, the lane's own
    /// counters otherwise).
    pub fn connection_ended(&self, conn: u64) -> BTreeMap<String, u64> {
        self.end(Some(conn))
    }

    /// Every connection has ended (the edge is stopping):
    /// [`Unanswered::connection_ended`] for all of them.
    pub fn clear(&self) -> BTreeMap<String, u64> {
        self.end(None)
    }

    fn end(&self, conn: Option<u64>) -> BTreeMap<String, u64> {
        let mut lost = BTreeMap::new();
        let mut cameras = self.cameras();
        for (camera, c) in cameras.iter_mut() {
            let before = c.ends.lost_connection;
            let ends = &mut c.ends;
            c.frames.retain(|_, t| {
                if conn.is_some_and(|id| t.conn != id) {
                    return true;
                }
                t.conn_ended = true;
                match t.fate {
                    // On the wire: the lane settles it.
                    None => true,
                    Some(WireFate::Delivered) => {
                        ends.lost_connection += 1;
                        false
                    }
                    // Ended on the wire; no result can come now.
                    Some(_) => false,
                }
            });
            c.awaited = c.frames.values().filter(|t| t.awaited()).count();
            let n = c.ends.lost_connection - before;
            if n > 0 {
                lost.insert(camera.clone(), n);
            }
        }
        self.wake_if_emptied(&cameras);
        lost
    }

    /// How the frames of `camera` have ended so far.
    pub fn ends(&self, camera: &str) -> FrameEnds {
        self.cameras()
            .get(camera)
            .map_or_else(FrameEnds::default, |c| FrameEnds {
                awaiting: c.awaited as u64,
                ..c.ends
            })
    }

    /// Resolves once no frame is awaited (at once if none is).
    pub async fn emptied(&self) {
        let notified = self.emptied.notified();
        tokio::pin!(notified);
        // Registered before the check, so that a frame ending in between
        // is not missed.
        notified.as_mut().enable();
        if self.is_empty() {
            return;
        }
        notified.await;
    }

    /// Frames awaited (sent and not ended), all cameras.
    pub fn len(&self) -> usize {
        self.cameras().values().map(|c| c.awaited).sum()
    }

    /// Whether no frame is awaited.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A connection's path statistics ([`Uplink::path_stats`]), from QUIC's
/// own: what the edge's adaptation reads to tell a full link from a long
/// or lossy one. Counters are since the connection was set up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PathStats {
    /// Smoothed round-trip time.
    pub rtt: Duration,
    /// Least round-trip time seen: the path's delay without queues.
    pub min_rtt: Duration,
    /// Congestion window (bytes in flight allowed).
    pub cwnd: u64,
    /// Packets sent.
    pub sent_packets: u64,
    /// Packets declared lost.
    pub lost_packets: u64,
    /// Bytes declared lost.
    pub lost_bytes: u64,
    /// Times the congestion controller backed off.
    pub congestion_events: u64,
    /// UDP payload bytes sent.
    pub sent_bytes: u64,
    /// Windows in which one of the connection's cameras found it pressed
    /// ([`Uplink::report_pressed`]).
    pub pressed_windows: u64,
    /// Of them, windows whose frames waited in a queue.
    pub queued_windows: u64,
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
    /// Microseconds from [`Lane::send`] to the acknowledgement, summed over
    /// the frames `delivered`: divided by them, how long a frame took to
    /// get across (a round trip, its transfer, and any wait behind other
    /// bytes, including the peer's ACK delay).
    pub ack_us: AtomicU64,
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
    /// [`Uplink::id`] of the lane's connection.
    conn: u64,
    max_in_flight: usize,
    /// Copies of each frame sent, each on a stream of its own.
    copies: u8,
    /// Unacknowledged frames, oldest first: (seq, abandon signal).
    in_flight: Mutex<VecDeque<(u64, CancellationToken)>>,
    stats: Arc<LaneStats>,
    /// Where frames sent and their fates are recorded, if anywhere.
    unanswered: Option<Arc<Unanswered>>,
}

impl LaneState {
    /// Frame `seq` goes out.
    fn sent(&self, seq: u64) {
        if let Some(u) = &self.unanswered {
            u.sent(&self.camera, seq, self.conn);
        }
    }

    /// Frame `seq` did not go out: its stream could not be opened.
    fn unsent(&self, seq: u64) {
        if let Some(u) = &self.unanswered {
            u.unsent(&self.camera, seq);
        }
    }

    /// Frame `seq` ended on the wire as `fate` (already counted in the
    /// lane's stats).
    fn settled(&self, seq: u64, fate: WireFate) {
        if let Some(u) = &self.unanswered {
            u.settled(&self.camera, seq, fate);
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

/// What became of one frame on the wire ([`Lane::send_watched`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WireFate {
    /// The gateway acknowledged every byte (or stopped the stream with code
    /// 0, having read what it needed).
    Delivered,
    /// Reset: a newer frame of the camera was acknowledged first, or the
    /// lane was full.
    Superseded,
    /// Reset: still unacknowledged at its deadline (or its stream could
    /// not even open before it).
    Expired,
    /// The gateway stopped the stream with an error code.
    Refused,
    /// The connection died under it.
    Lost,
}

/// One camera's sender on one connection. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Lane {
    conn: quinn::Connection,
    /// The connection's [`SendOrder`], shared by all its lanes.
    order: Arc<SendOrder>,
    state: Arc<LaneState>,
    tasks: tokio_util::task::TaskTracker,
}

impl Lane {
    /// The lane, sending each frame `copies` times (1 to
    /// [`tidegate_protocol::MAX_COPIES`]), each copy on a stream of its
    /// own, side by side: on a link that loses packets at random a frame
    /// is lost only when every copy loses one, without waiting a round
    /// trip for a retransmission. The first copy acknowledged delivers the
    /// frame and the others are reset; the gateway admits one. For a
    /// camera opened with as many copies ([`Uplink::open_camera_with`]).
    /// Call before the first send.
    pub fn with_copies(mut self, copies: u8) -> Self {
        if let Some(state) = Arc::get_mut(&mut self.state) {
            state.copies = copies.clamp(1, tidegate_protocol::MAX_COPIES);
        }
        self
    }

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
        self.send_with(frame, deadline, None).await
    }

    /// [`Lane::send`], and the frame's fate on the wire once it is settled
    /// (for a load generator that accounts for every frame it sent). The
    /// receiver errs only if the lane's task was dropped with its runtime.
    pub async fn send_watched(
        &self,
        frame: Frame,
        deadline: tokio::time::Instant,
    ) -> Result<oneshot::Receiver<WireFate>, UplinkError> {
        let (tx, rx) = oneshot::channel();
        self.send_with(frame, deadline, Some(tx)).await?;
        Ok(rx)
    }

    async fn send_with(
        &self,
        frame: Frame,
        deadline: tokio::time::Instant,
        fate: Option<oneshot::Sender<WireFate>>,
    ) -> Result<(), UplinkError> {
        let seq = frame.seq;
        let handed_at = tokio::time::Instant::now();
        let abandon = CancellationToken::new();
        // Recorded before the frame can go out: its result may come back
        // before the lane sees the acknowledgement.
        self.state.sent(seq);
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
                self.state.unsent(seq);
                return Err(UplinkError::Lost(e.to_string()));
            }
            Err(_) => {
                self.forget(seq);
                LaneStats::bump(&self.state.stats.expired);
                self.state.settled(seq, WireFate::Expired);
                if let Some(fate) = fate {
                    let _ = fate.send(WireFate::Expired);
                }
                return Ok(());
            }
        };
        // Copies share their frame's priority: QUIC sends them side by side.
        let priority = self.order.next();
        let _ = stream.set_priority(priority);
        // The other copies, if the lane sends any: each that opens before
        // the deadline goes.
        let mut copies = Vec::new();
        for _ in 1..self.state.copies {
            match tokio::time::timeout_at(deadline, self.conn.open_uni()).await {
                Ok(Ok(s)) => {
                    let _ = s.set_priority(priority);
                    copies.push(s);
                }
                _ => break,
            }
        }
        let state = self.state.clone();
        let span = tracing::debug_span!("frame", camera = %state.camera, seq);
        self.tasks.spawn(
            async move {
                let outcome = drive_copies(stream, copies, frame, deadline, abandon).await;
                let lane = Lane::forget_in(&state, seq);
                let stats = &state.stats;
                match outcome {
                    WireFate::Delivered => {
                        let took = handed_at.elapsed().as_micros();
                        stats
                            .ack_us
                            .fetch_add(u64::try_from(took).unwrap_or(u64::MAX), Ordering::Relaxed);
                        LaneStats::bump(&stats.delivered);
                        // Older frames still on the way are now useless.
                        for (older, token) in lane.iter().filter(|(s, _)| *s < seq) {
                            debug!(older, "superseded by {seq}");
                            token.cancel();
                        }
                    }
                    WireFate::Superseded => LaneStats::bump(&stats.superseded),
                    WireFate::Expired => LaneStats::bump(&stats.expired),
                    WireFate::Refused => LaneStats::bump(&stats.refused),
                    WireFate::Lost => LaneStats::bump(&stats.lost),
                }
                // Counted first, so that a frame's correction in
                // `Unanswered` never runs ahead of the count it corrects.
                state.settled(seq, outcome);
                debug!(?outcome, "frame stream done");
                if let Some(fate) = fate {
                    let _ = fate.send(outcome);
                }
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
) -> WireFate {
    let message = Message::Frame(frame);
    // A frame both late and superseded counts as expired.
    let reason = tokio::select! {
        biased;
        _ = tokio::time::sleep_until(deadline) => WireFate::Expired,
        _ = abandon.cancelled() => WireFate::Superseded,
        r = async {
            write_message(&mut stream, &message).await.map_err(|_| ())?;
            stream.finish().map_err(|_| ())?;
            stream.stopped().await.map_err(|_| ())
        } => {
            return match r {
                Ok(None) => WireFate::Delivered,
                Ok(Some(code)) if code.into_inner() == 0 => WireFate::Delivered,
                Ok(Some(_)) => WireFate::Refused,
                Err(()) => WireFate::Lost,
            };
        }
    };
    // Acknowledged in the same instant (one ACK that covers this frame and
    // the newer one that superseded it, or that lands at the deadline):
    // delivered, not abandoned.
    let acked = {
        let mut stopped = std::pin::pin!(stream.stopped());
        std::future::poll_fn(|cx| std::task::Poll::Ready(stopped.as_mut().poll(cx))).await
    };
    if matches!(acked, std::task::Poll::Ready(Ok(None))) {
        return WireFate::Delivered;
    }
    // Code 0: a deliberate abandonment (protocol §7.3).
    let _ = stream.reset(0u32.into());
    reason
}

/// [`drive`] for a frame sent as `first` and `copies`: delivered as soon as
/// one copy is acknowledged (the others are then reset); otherwise `Lost`
/// if the connection died under any copy, else the first copy's fate.
async fn drive_copies(
    first: quinn::SendStream,
    copies: Vec<quinn::SendStream>,
    frame: Frame,
    deadline: tokio::time::Instant,
    abandon: CancellationToken,
) -> WireFate {
    if copies.is_empty() {
        return drive(first, frame, deadline, abandon).await;
    }
    let mut tokens = Vec::with_capacity(1 + copies.len());
    let mut set = tokio::task::JoinSet::new();
    for (i, stream) in std::iter::once(first).chain(copies).enumerate() {
        // Each copy is abandoned with the frame, or alone once another
        // copy has delivered it.
        let token = abandon.child_token();
        tokens.push(token.clone());
        let frame = frame.clone();
        set.spawn(async move { (i, drive(stream, frame, deadline, token).await) });
    }
    let mut fates = Vec::new();
    while let Some(done) = set.join_next().await {
        let (i, fate) = done.unwrap_or((usize::MAX, WireFate::Lost));
        if fate == WireFate::Delivered {
            for t in &tokens {
                t.cancel();
            }
            while set.join_next().await.is_some() {}
            return WireFate::Delivered;
        }
        fates.push((i, fate));
    }
    fates.sort_by_key(|(i, _)| *i);
    if fates.iter().any(|(_, f)| *f == WireFate::Lost) {
        return WireFate::Lost;
    }
    fates.first().map_or(WireFate::Lost, |(_, f)| *f)
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
                    let Some(reply) = on_control_message(msg, &mut pending, &incoming).await else {
                        continue;
                    };
                    if let Err(e) = write_message(&mut send, &reply).await {
                        break ControlEnd::Failed(
                            ErrorCode::Internal,
                            format!("writing the control stream: {e}"),
                        );
                    }
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

/// Handles one message from the gateway's side of the control stream;
/// returns the answer to write back, if it needs one.
async fn on_control_message(
    msg: Message,
    pending: &mut VecDeque<oneshot::Sender<Result<CameraAccepted, UplinkError>>>,
    incoming: &queue::Sender<Incoming>,
) -> Option<Message> {
    match msg {
        // Answered at once, stamped on the clock `captured_at_us` uses: the
        // gateway estimates this edge's clock offset from it.
        Message::ClockProbe(p) => {
            return Some(Message::ClockEcho(ClockEcho {
                gateway_us: p.gateway_us,
                edge_us: crate::clock::now_us(),
            }));
        }
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
    None
}

/// Accepts result streams and forwards their results, reading at most
/// [`RESULT_READERS`] streams at once. A reader waits for room in the
/// consumer's queue (a slot, and the result's bytes), so a slow consumer
/// slows the gateway down instead of losing results; what the edge holds
/// is bounded by that queue and the results its readers hold. A stream that does not carry one well-formed `Result` is
/// stopped with its error code (protocol §7.3).
/// The results taken of each camera opened with copies, by `seq` and
/// status: a later result of the same frame with the same status is a copy
/// and is dropped; one with another status is passed on, for the consumer
/// to see that a frame got two different results.
#[derive(Debug, Default)]
struct ResultCopies {
    cameras: Mutex<HashMap<String, VecDeque<(u64, tidegate_protocol::Status)>>>,
    dropped: AtomicU64,
}

impl ResultCopies {
    /// Results remembered per camera.
    const PER_CAMERA: usize = 256;

    fn opened(&self, camera: &str, copies: u8) {
        let mut cams = self.cameras.lock().unwrap_or_else(PoisonError::into_inner);
        if copies > 1 {
            cams.entry(camera.to_string()).or_default();
        } else {
            cams.remove(camera);
        }
    }

    /// Whether `r` is to be passed on: not a copy of a result taken.
    fn take(&self, r: &FrameResult) -> bool {
        let mut cams = self.cameras.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(seen) = cams.get_mut(&r.camera) else {
            return true;
        };
        if seen
            .iter()
            .any(|(seq, status)| *seq == r.seq && *status == r.status)
        {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        if seen.len() == Self::PER_CAMERA {
            seen.pop_front();
        }
        seen.push_back((r.seq, r.status.clone()));
        true
    }
}

async fn results(
    conn: quinn::Connection,
    incoming: queue::Sender<Incoming>,
    copies: Arc<ResultCopies>,
) {
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
        let copies = copies.clone();
        tokio::spawn(
            async move {
                let _permit = permit;
                match read_message(&mut recv, &Limits::default()).await {
                    Ok(Some(Message::Result(r))) if !copies.take(&r) => {
                        debug!(camera = %r.camera, seq = r.seq, "a copy of a result taken; dropped");
                    }
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
    use WireFate::{Delivered, Expired, Lost, Refused, Superseded};

    #[test]
    fn unanswered_frames_are_tracked_by_camera_and_seq_not_counted() {
        let u = Unanswered::default();
        u.sent("door", 1, 1);
        u.sent("door", 2, 1);
        u.sent("yard", 1, 1);
        assert_eq!(u.len(), 3);
        // A second result for frame 1, or one for a frame never waited for,
        // stands for no other frame.
        assert!(u.answered("door", 1));
        assert!(!u.answered("door", 1));
        assert!(!u.answered("door", 7));
        assert!(!u.answered("hall", 2));
        assert_eq!(u.len(), 2);
        u.unsent("door", 2);
        u.settled("yard", 1, Delivered);
        assert_eq!(u.len(), 1, "acknowledged, still awaiting its result");
        assert!(u.answered("yard", 1));
        assert!(u.is_empty());
        assert_eq!(u.ends("door"), FrameEnds::default());
        assert_eq!(u.ends("yard"), FrameEnds::default());
    }

    /// The gateway read a frame the lane then reset (or answered it before
    /// the acknowledgement came): whichever comes first, the frame ends as
    /// its result, counted so that it is not also a reset.
    #[test]
    fn a_result_for_a_frame_the_lane_reset_ends_it_as_a_result_in_either_order() {
        let u = Unanswered::default();
        for seq in 1..=4 {
            u.sent("door", seq, 1);
        }
        // Reset first, result after.
        u.settled("door", 1, Superseded);
        u.settled("door", 2, Expired);
        assert_eq!(u.len(), 2, "a reset frame is no longer awaited");
        assert!(u.answered("door", 1));
        assert!(u.answered("door", 2));
        // Result first, reset after.
        assert!(u.answered("door", 3));
        u.settled("door", 3, Superseded);
        // Result first, acknowledgement after: nothing to correct.
        assert!(u.answered("door", 4));
        u.settled("door", 4, Delivered);
        assert!(u.is_empty());
        assert_eq!(
            u.ends("door"),
            FrameEnds {
                answered_superseded: 2,
                answered_expired: 1,
                ..FrameEnds::default()
            }
        );
        // A reset frame whose result never comes stays a reset: its
        // connection's end counts nothing for it.
        u.sent("door", 5, 1);
        u.settled("door", 5, Expired);
        assert!(u.connection_ended(1).is_empty());
        assert_eq!(u.ends("door").answered_expired, 1);
        assert!(!u.answered("door", 5), "its connection has ended");
    }

    #[test]
    fn frames_acknowledged_and_unanswered_are_lost_with_their_own_connection() {
        let u = Unanswered::default();
        // Connection 1: frame 1 acknowledged, 2 still on the wire, 3 reset.
        u.sent("door", 1, 1);
        u.settled("door", 1, Delivered);
        u.sent("door", 2, 1);
        u.sent("door", 3, 1);
        u.settled("door", 3, Superseded);
        u.sent("yard", 1, 1);
        u.settled("yard", 1, Delivered);
        // Connection 2 is up before the end of 1 is handled.
        u.sent("door", 4, 2);
        u.settled("door", 4, Delivered);
        let lost = u.connection_ended(1);
        assert_eq!(
            lost,
            BTreeMap::from([("door".to_string(), 1), ("yard".to_string(), 1)])
        );
        assert_eq!(u.len(), 2, "frame 2 on the wire, frame 4 of connection 2");
        // Frame 2 was acknowledged just before the end: lost with it too.
        u.settled("door", 2, Delivered);
        assert_eq!(u.ends("door").lost_connection, 2);
        assert_eq!(u.ends("yard").lost_connection, 1);
        assert!(
            u.answered("door", 4),
            "connection 2's frame is still awaited"
        );
        assert!(u.is_empty());
        // A frame cut on the wire by the end is the lane's `lost`, not this.
        u.sent("door", 5, 2);
        assert!(u.connection_ended(2).is_empty());
        u.settled("door", 5, Lost);
        assert_eq!(u.ends("door").lost_connection, 2);
        assert!(u.is_empty());
        // The edge stops: every connection ends.
        u.sent("door", 6, 3);
        u.settled("door", 6, Delivered);
        assert_eq!(u.clear(), BTreeMap::from([("door".to_string(), 1)]));
        assert_eq!(u.ends("door").lost_connection, 3);
    }

    #[test]
    fn unanswered_gives_up_on_the_oldest_frames_beyond_its_bound() {
        let u = Unanswered::default();
        let n = Unanswered::PER_CAMERA as u64;
        // Frame 0 acknowledged, then many more reset on the wire.
        u.sent("door", 0, 1);
        u.settled("door", 0, Delivered);
        for seq in 1..n + 10 {
            u.sent("door", seq, 1);
            u.settled("door", seq, Superseded);
        }
        assert_eq!(u.len(), 0);
        assert_eq!(u.ends("door").gave_up, 1);
        assert!(!u.answered("door", 0), "frame 0 was given up on");
        assert!(!u.answered("door", 5), "frame 5's record was forgotten");
        assert!(u.answered("door", n + 9));
        assert_eq!(u.ends("door").answered_superseded, 1);
    }

    #[tokio::test]
    async fn emptied_resolves_when_the_last_frame_ends() {
        let u = Arc::new(Unanswered::default());
        tokio::time::timeout(Duration::from_secs(5), u.emptied())
            .await
            .expect("nothing waited for: at once");
        u.sent("door", 1, 1);
        u.sent("door", 2, 1);
        u.sent("door", 3, 1);
        let waiter = tokio::spawn({
            let u = u.clone();
            async move { u.emptied().await }
        });
        u.answered("door", 1);
        u.settled("door", 2, Superseded);
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        u.settled("door", 3, Delivered);
        u.connection_ended(1);
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("woken by the last frame's end")
            .unwrap();
    }

    /// What happens to the frames of one camera, in any order reality
    /// allows: frames go out on the live connection; each gets one fate
    /// on the wire (or does not go out at all) at any time after; results
    /// come only while the frame's connection lives, sometimes two, and
    /// sometimes for frames never sent; connections end.
    #[derive(Debug, Clone)]
    enum Event {
        Send,
        Fate(usize, u8),
        Unsent(usize),
        Result(usize),
        Stray(u64),
        EndConnection,
    }

    fn event() -> impl proptest::strategy::Strategy<Value = Event> {
        use proptest::prelude::*;
        prop_oneof![
            4 => Just(Event::Send),
            4 => (any::<usize>(), 0u8..5).prop_map(|(i, f)| Event::Fate(i, f)),
            1 => any::<usize>().prop_map(Event::Unsent),
            4 => any::<usize>().prop_map(Event::Result),
            1 => (1_000_000u64..1_000_010).prop_map(Event::Stray),
            1 => Just(Event::EndConnection),
        ]
    }

    fn fate(f: u8) -> WireFate {
        [Delivered, Superseded, Expired, Refused, Lost][f as usize % 5]
    }

    #[derive(Debug, Default)]
    struct Frame {
        conn: u64,
        settled: bool,
        unsent: bool,
        answered: bool,
    }

    /// The lane's counters by fate, and the sum the ledger promises.
    #[derive(Debug, Default)]
    struct Counts {
        sent: u64,
        fates: [u64; 5],
        results: u64,
    }

    fn assert_accounted(u: &Unanswered, c: &Counts) {
        let e = u.ends("cam");
        let [_, superseded, expired, refused, lost] = c.fates;
        assert!(e.answered_superseded <= superseded && e.answered_expired <= expired);
        assert!(e.answered_refused <= refused && e.answered_lost <= lost);
        let ended = c.results
            + (superseded - e.answered_superseded)
            + (expired - e.answered_expired)
            + (refused - e.answered_refused)
            + (lost - e.answered_lost)
            + e.lost_connection
            + e.gave_up
            + e.awaiting;
        assert_eq!(ended, c.sent, "{e:?} {c:?}");
    }

    proptest::proptest! {
        #[test]
        fn every_frame_sent_ends_once_whatever_the_order_of_events(
            events in proptest::collection::vec(event(), 1..200),
        ) {
            let u = Unanswered::default();
            let mut frames: Vec<Frame> = Vec::new();
            let mut conn = 1u64;
            let mut c = Counts::default();
            let pick = |frames: &[Frame], i: usize| (!frames.is_empty()).then(|| i % frames.len());
            for ev in events {
                match ev {
                    Event::Send => {
                        u.sent("cam", frames.len() as u64, conn);
                        frames.push(Frame { conn, ..Frame::default() });
                        c.sent += 1;
                    }
                    Event::Fate(i, f) => {
                        if let Some(i) = pick(&frames, i)
                            && !frames[i].settled
                            && !frames[i].unsent
                        {
                            frames[i].settled = true;
                            c.fates[f as usize % 5] += 1;
                            u.settled("cam", i as u64, fate(f));
                        }
                    }
                    Event::Unsent(i) => {
                        if let Some(i) = pick(&frames, i) {
                            let f = &mut frames[i];
                            if !f.settled && !f.unsent && !f.answered {
                                f.unsent = true;
                                c.sent -= 1;
                                u.unsent("cam", i as u64);
                            }
                        }
                    }
                    Event::Result(i) => {
                        if let Some(i) = pick(&frames, i)
                            && frames[i].conn == conn
                            && !frames[i].unsent
                        {
                            let first = u.answered("cam", i as u64);
                            if first {
                                c.results += 1;
                            }
                            // Only a frame's first result is a first, and
                            // a frame reset long ago may have been dropped.
                            proptest::prop_assert!(!first || !frames[i].answered);
                            frames[i].answered = true;
                        }
                    }
                    Event::Stray(seq) => {
                        proptest::prop_assert!(!u.answered("cam", seq));
                    }
                    Event::EndConnection => {
                        u.connection_ended(conn);
                        conn += 1;
                    }
                }
                assert_accounted(&u, &c);
            }
            // The lanes settle what is left, and the edge stops.
            for (i, f) in frames.iter_mut().enumerate() {
                if !f.settled && !f.unsent {
                    f.settled = true;
                    c.fates[i % 5] += 1;
                    u.settled("cam", i as u64, fate(i as u8));
                }
            }
            u.clear();
            assert_accounted(&u, &c);
            proptest::prop_assert_eq!(u.ends("cam").awaiting, 0);
            proptest::prop_assert!(u.is_empty());
        }
    }
}
