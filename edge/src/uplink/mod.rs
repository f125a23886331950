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
//!
//! Rooms:
//! - this module: the [`Uplink`] handle (open a camera, report latency,
//!   path statistics) and the errors; it spawns nothing itself;
//! - `dial`: TLS and QUIC dial, the `Hello` handshake, and the spawning of
//!   a connection's control and result tasks;
//! - `lane`: one camera's frames on the wire ([`Lane`]): a stream per
//!   frame, newest first ([`SendOrder`]), reset when stale; a frame's fate
//!   goes to [`LaneStats`] and, if asked, to [`Unanswered`];
//! - `unanswered`: the ledger of frames sent and how each ended
//!   ([`Unanswered`], [`FrameEnds`]); pure, no I/O;
//! - `control`: the control stream's task (opens, latency reports, clock
//!   probes, hints);
//! - `results`: the task that reads result streams into the consumer's
//!   queue ([`Incoming`]).
//!
//! None of them decides what a camera sends, or when: that is the caller's
//! (the edge's `node`, or a load generator).

mod control;
mod dial;
mod lane;
mod results;
mod unanswered;

pub use lane::{Lane, LaneStats, SendOrder, WireFate};
pub use unanswered::{FrameEnds, Unanswered};

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tidegate_protocol::quic::write_message;
use tidegate_protocol::{
    CameraAccepted, CameraOpen, ControlHint, Encoding, ErrorCode, Frame, FrameResult, GatewayAddr,
    LatencyReport, Message,
};
use tokio::sync::{mpsc, oneshot};

use control::Command;
use results::ResultCopies;

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
    /// A camera has had a pressed window, for any reason (late results
    /// too): the climb from the quality floor is over for all of them.
    climbed: AtomicBool,
}

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

impl Uplink {
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

    /// Records that a camera's window was pressed, for any reason: the
    /// link has been found, and no camera on it climbs in slow start any
    /// more ([`PathStats::slow_start_over`]).
    pub fn report_slow_start_over(&self) {
        self.pressure.climbed.store(true, Ordering::Relaxed);
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
            slow_start_over: self.pressure.climbed.load(Ordering::Relaxed),
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
    /// A camera of the connection has had a pressed window, for any
    /// reason ([`Uplink::report_slow_start_over`]).
    pub slow_start_over: bool,
}
