//! One edge connection, once it has logged in: an [`EdgeSession`] runs four
//! loops side by side until the connection ends, each a named function:
//!
//! - [`EdgeSession::read_frames`]: one task per frame stream (read within
//!   the limits, checked against the cameras opened, given its deadline by
//!   [`crate::deadline::admit`], handed to the hub);
//! - [`EdgeSession::write_results`]: one result stream per result the hub
//!   routes here;
//! - [`EdgeSession::read_control`]: camera opens, latency reports and clock
//!   echoes;
//! - [`EdgeSession::write_control`]: rate hints from the hub and clock
//!   probes, sharing the control stream with the replies.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tidegate_protocol::queue;
use tidegate_protocol::quic::{self, read_message_of, write_message};
use tidegate_protocol::{
    CameraAccepted, CameraOpen, ClockProbe, ErrorCode, Frame, FrameResult, Kind, Limits, Message,
};
use tracing::{debug, info, warn};

use super::edge_quota::EdgeSlot;
use super::error_reply::ErrorReply;
use super::inflight::{FrameReadError, InflightBudget, read_frame};
use super::{RESULT_QUEUE, RESULT_QUEUE_BYTES, Server, refuse};
use crate::deadline::{self, EdgeClock};
use crate::hub::{HintBox, Hub, HubMsg};
use crate::metrics::Metrics;
use crate::ratelimit::{ControlGate, ControlVerdict};
use crate::scheduler::{EdgeId, Micros};

/// Time between the copies of one result (for a camera that asked for
/// copies): QUIC packs stream data written together into one packet, and
/// one lost packet would then take every copy. A couple of milliseconds
/// puts each in a packet of its own; a copy is only ever needed when the
/// first was lost, and then the wait is this, not a retransmission's RTT.
const RESULT_COPY_SPACING: Duration = Duration::from_millis(2);

/// How long after the last later copy of one of a camera's frames its
/// results still go back as many times as it asked: a camera that sends
/// its frames once (the edge's `copies = "auto"` on a path that needs no
/// copy) gets each result once, and no second result stream per frame
/// crowds its link; one whose copies arrive gets them all.
const RESULT_COPIES_AFTER_A_COPY: Duration = Duration::from_secs(5);

/// Cameras opened on one connection, by name.
type Cameras = Arc<Mutex<HashMap<String, OpenCamera>>>;

/// A camera opened on a connection.
#[derive(Debug, Clone)]
pub(crate) struct OpenCamera {
    model: String,
    /// Copies of each frame it sends at most, and of each result it gets
    /// while its copies arrive.
    copies: u8,
    seen: SeqWindow,
    /// When a later copy of one of its frames last arrived.
    copy_at: Option<Instant>,
}

impl OpenCamera {
    fn new(model: String, copies: u8) -> Self {
        OpenCamera {
            model,
            copies,
            seen: SeqWindow::default(),
            copy_at: None,
        }
    }

    /// Frame `seq` arrived whole at `now`: whether it is the first of its
    /// copies (to be served). A later copy is remembered as one.
    fn admit(&mut self, seq: u64, now: Instant) -> bool {
        let first = self.seen.admit(seq);
        if !first && self.seen.holds(seq) {
            self.copy_at = Some(now);
        }
        first
    }

    /// Copies of a result to send at `now`: as many as the camera asked for
    /// while its frames' later copies arrive (one within
    /// [`RESULT_COPIES_AFTER_A_COPY`]), else one.
    fn result_copies(&self, now: Instant) -> u8 {
        match self.copy_at {
            Some(at) if now.saturating_duration_since(at) < RESULT_COPIES_AFTER_A_COPY => {
                self.copies.max(1)
            }
            _ => 1,
        }
    }
}

/// The frames of one camera already admitted, by `seq`: a second copy of
/// a frame (a camera sending copies on a lossy link, or an edge resending)
/// is dropped, never served twice. Remembers the latest [`SeqWindow::LEN`]
/// seqs; one older than all of them is refused too (it is stale anyway:
/// its camera has sent that many newer frames since).
#[derive(Debug, Clone, Default)]
pub(crate) struct SeqWindow {
    seqs: std::collections::BTreeSet<u64>,
}

impl SeqWindow {
    /// Seqs remembered per camera.
    pub(crate) const LEN: usize = 256;

    /// Admits `seq` if it is new: true the first time, false for a copy or
    /// a seq older than the window.
    pub(crate) fn admit(&mut self, seq: u64) -> bool {
        if self.seqs.len() >= Self::LEN && self.seqs.first().is_some_and(|&min| seq < min) {
            return false;
        }
        if !self.seqs.insert(seq) {
            return false;
        }
        while self.seqs.len() > Self::LEN {
            self.seqs.pop_first();
        }
        true
    }

    /// Whether `seq` is among the seqs remembered.
    fn holds(&self, seq: u64) -> bool {
        self.seqs.contains(&seq)
    }
}

/// The gateway's clock for deadlines and clock probes: µs since `epoch`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GatewayClock {
    epoch: Instant,
}

impl GatewayClock {
    pub(crate) fn new(epoch: Instant) -> Self {
        GatewayClock { epoch }
    }

    /// `at` on this clock (µs).
    pub(crate) fn us(&self, at: Instant) -> Micros {
        u64::try_from(at.saturating_duration_since(self.epoch).as_micros()).unwrap_or(u64::MAX)
    }

    /// The instant `us` names.
    pub(crate) fn instant(&self, us: Micros) -> Instant {
        self.epoch + Duration::from_micros(us)
    }
}

/// An authenticated edge connection.
pub(super) struct EdgeSession<'s> {
    pub(super) server: &'s Server,
    pub(super) id: EdgeId,
    pub(super) conn: quinn::Connection,
    /// Replies, hints and probes share the control stream.
    pub(super) ctl_send: tokio::sync::Mutex<quinn::SendStream>,
    pub(super) cameras: Cameras,
    /// The longest frame body any camera open on this connection can send
    /// (0 before one is): a frame declaring more is refused from its
    /// header. It only grows: a camera opened again on a smaller model
    /// keeps what it had.
    pub(super) max_frame_body: Arc<AtomicUsize>,
    pub(super) clock: Arc<Mutex<EdgeClock>>,
    /// The edge name's share of connections, cameras and partly received
    /// frames; dropped with the session.
    pub(super) quota: EdgeSlot,
    /// Models whose cameras were refused for want of a worker since one of
    /// them was last accepted: the wait is logged once per model, not once
    /// per camera and retry.
    pub(super) waiting_for_worker: Mutex<std::collections::HashSet<String>>,
}

impl EdgeSession<'_> {
    /// Reads frame streams until the connection ends; each is read on a
    /// task of its own (tracked, so shutdown drains it), within the edge's
    /// and the gateway's budgets for partly received frames and by
    /// `limits.frame_read_timeout_ms` from when it is accepted.
    pub(super) async fn read_frames(&self) {
        let margin = Duration::from_millis(self.server.config.scheduler.return_margin_ms as u64);
        let read_timeout =
            Duration::from_millis(self.server.config.limits.frame_read_timeout_ms.into());
        let budget = InflightBudget {
            edge: self.quota.inflight().clone(),
            total: self.server.inflight_total.clone(),
        };
        while let Ok(recv) = self.conn.accept_uni().await {
            let stream = FrameStream {
                budget: budget.clone(),
                read_timeout,
                edge: self.id,
                arrived: Instant::now(),
                rtt: self.conn.rtt(),
                margin,
                max_budget_ms: self.server.config.scheduler.max_budget_ms,
                clock: self.server.clock,
                edge_clock: self.clock.lock().expect("edge clock lock").offset(),
                cameras: self.cameras.clone(),
                max_body: self.max_frame_body.clone(),
                hub: self.server.hub.clone(),
                limits: self.server.limits,
                metrics: self.server.metrics.clone(),
            };
            self.server.tracker.spawn(stream.read(recv));
        }
    }

    /// Writes each result the hub routes to this edge on a stream of its
    /// own, at most [`RESULT_QUEUE`] at once. An edge that stops taking its
    /// streams fills the queue, and the hub drops and counts what follows
    /// instead of the gateway holding every result in a task. A result
    /// being written keeps its bytes counted in the queue's budget; one
    /// whose connection fails under it is counted undeliverable. A camera
    /// that asked for copies, and whose later copies arrive, gets each
    /// result that many times ([`OpenCamera::result_copies`]), each on a
    /// stream of its own; it counts undeliverable when none got through.
    pub(super) async fn write_results(&self, mut results: queue::Receiver<FrameResult>) {
        let writing = Arc::new(tokio::sync::Semaphore::new(RESULT_QUEUE));
        // The permit first: a result waiting for one stays in the queue,
        // where it counts.
        while let Ok(permit) = writing.clone().acquire_owned().await {
            let Some(r) = results.recv_held().await else {
                break;
            };
            let (r, bytes) = r.into_parts();
            let now = Instant::now();
            let copies = self
                .cameras
                .lock()
                .expect("camera map lock")
                .get(&r.camera)
                .map_or(1, |c| c.result_copies(now));
            let conn = self.conn.clone();
            let metrics = self.server.metrics.clone();
            self.server.tracker.spawn(async move {
                let _permits = (permit, bytes);
                let (camera, seq) = (r.camera.clone(), r.seq);
                let msg = Message::Result(r);
                // Each copy is handed to QUIC [`RESULT_COPY_SPACING`] after
                // the one before (not once it is acknowledged): far enough
                // apart to leave in packets of their own, so one lost
                // packet cannot take them all.
                let mut failed = None;
                let mut any_sent = false;
                for copy in 0..copies {
                    if copy > 0 {
                        tokio::time::sleep(RESULT_COPY_SPACING).await;
                    }
                    let sent = async {
                        let mut s = conn.open_uni().await.map_err(|e| e.to_string())?;
                        write_message(&mut s, &msg)
                            .await
                            .map_err(|e| e.to_string())?;
                        s.finish().map_err(|e| e.to_string())
                    };
                    match sent.await {
                        Ok(()) => any_sent = true,
                        Err(e) => failed = Some(e),
                    }
                }
                if let (false, Some(e)) = (any_sent, failed) {
                    debug!(%camera, seq, "result undeliverable: {e}");
                    metrics.undeliverable.inc();
                }
            });
        }
    }

    /// Reads the edge's control messages until the stream ends or fails.
    /// Messages over the connection's
    /// [`ControlRate`](crate::ratelimit::ControlRate) are dropped before
    /// they reach the hub and counted by kind (a `CameraOpen` is refused,
    /// not dropped); a connection that keeps flooding is closed.
    pub(super) async fn read_control(&self, mut ctl_recv: quinn::RecvStream) {
        let limits = &self.server.limits;
        let mut gate = ControlGate::new(self.server.control_rate());
        loop {
            let msg = match read_message_of(&mut ctl_recv, limits, EDGE_CONTROL).await {
                Ok(Some(m)) => m,
                Ok(None) => break,
                Err(e) if e.is_connection_lost() => break,
                Err(e) => {
                    warn!("malformed control stream: {e}; closing the connection");
                    let reply = ErrorReply::Unreadable {
                        code: e.code(),
                        error: format!("malformed control stream: {e}"),
                    };
                    refuse(&self.conn, &mut *self.ctl_send.lock().await, &reply).await;
                    break;
                }
            };
            let verdict = gate.on_message(Instant::now());
            if verdict != ControlVerdict::Pass {
                if !self.over_rate(msg, verdict, &gate).await {
                    break;
                }
                continue;
            }
            match msg {
                Message::CameraOpen(open) => {
                    let reply = self.open_camera(open).await;
                    if write_message(&mut *self.ctl_send.lock().await, &reply)
                        .await
                        .is_err()
                    {
                        break;
                    }
                }
                Message::LatencyReport(r) => {
                    let model = self.model_of(&r.camera).unwrap_or_default();
                    let e2e = Duration::from_micros(r.e2e_us as u64);
                    self.server.hub.send(HubMsg::Latency { model, e2e }).await;
                }
                Message::ClockEcho(echo) => {
                    let now = self.server.clock.us(Instant::now());
                    let taken = self.clock.lock().expect("edge clock lock").on_echo(
                        echo.gateway_us,
                        echo.edge_us,
                        now,
                    );
                    match taken {
                        Ok(o) => debug!(offset_us = o.offset_us, rtt_us = o.rtt_us, "edge clock"),
                        Err(e) => debug!("clock echo ignored: {e}"),
                    }
                }
                other => {
                    warn!(kind = ?other.kind(), "unexpected message on an edge control stream");
                }
            }
        }
    }

    /// Drops `msg`, which came over the connection's control rate, and
    /// counts it; a `CameraOpen` is answered with a refusal to send again.
    /// On [`ControlVerdict::Close`] the connection is closed with the
    /// reason. False when the control stream is done.
    async fn over_rate(&self, msg: Message, verdict: ControlVerdict, gate: &ControlGate) -> bool {
        let kind = control_kind_label(msg.kind());
        self.server
            .metrics
            .control_dropped
            .with_label_values(&[kind])
            .inc();
        if verdict == ControlVerdict::Close {
            let reply = ErrorReply::ControlFlood {
                rate: gate.rate(),
                dropped: gate.dropped(),
            };
            let cooldown = self.quota.flooded(Instant::now());
            warn!(
                dropped = gate.dropped(),
                cooldown_ms = cooldown.as_millis() as u64,
                "{reply}"
            );
            refuse(&self.conn, &mut *self.ctl_send.lock().await, &reply).await;
            return false;
        }
        if let Message::CameraOpen(open) = msg {
            let reply = ErrorReply::CameraOpenThrottled {
                camera: open.camera,
                rate: gate.rate(),
            };
            debug!("{reply}");
            return write_message(&mut *self.ctl_send.lock().await, &reply.to_message())
                .await
                .is_ok();
        }
        true
    }

    /// Logs a camera's refusal. Waiting for a worker is ordinary (the
    /// gateway or its workers are starting) and the edge retries each
    /// camera every second: one INFO line per model until a camera of it is
    /// accepted, the rest at DEBUG. Other refusals are the edge's to fix
    /// and each is a WARN.
    fn log_refusal(&self, open: &CameraOpen, reply: &ErrorReply) {
        if !matches!(reply, ErrorReply::NoWorker { .. }) {
            warn!(camera = %open.camera, message = %reply, "camera refused");
            return;
        }
        let first = self
            .waiting_for_worker
            .lock()
            .expect("waiting models lock")
            .insert(open.model.clone());
        if first {
            info!(model = %open.model, "no worker serves the model yet: its cameras are told to retry later until one registers");
        } else {
            debug!(camera = %open.camera, message = %reply, "camera refused");
        }
    }

    /// The answer to a `CameraOpen`: `CameraAccepted`, or an `Error` that
    /// refuses this camera only.
    async fn open_camera(&self, open: CameraOpen) -> Message {
        // Counted over all the edge's connections as it is checked, so two
        // connections opening at once cannot both pass; taken back below
        // if the camera is refused for another reason.
        let mut counted = false;
        let refusal = if open.camera.is_empty() {
            // an empty camera in a hint means every camera of the edge: one
            // cannot be named so
            Some(ErrorReply::EmptyCamera)
        } else {
            match self.quota.open_camera(&open.camera) {
                Ok(new) => {
                    counted = new;
                    None
                }
                Err(_) => Some(ErrorReply::TooManyCameras {
                    camera: open.camera.clone(),
                    max: self.server.config.limits.max_cameras_per_edge,
                }),
            }
        };
        let served = match refusal {
            Some(_) => None,
            None => self.server.hub.model_info(&open.model),
        };
        let refusal = match (refusal, &served) {
            (None, Some(served)) => served
                .accepts(open.encoding)
                .err()
                .map(|(code, reason)| ErrorReply::ModelRefused { code, reason }),
            (None, None) => Some(ErrorReply::NoWorker {
                camera: open.camera.clone(),
                model: open.model.clone(),
            }),
            (refusal, _) => refusal,
        };
        if let Some(reply) = refusal {
            if counted {
                self.quota.close_camera(&open.camera);
            }
            self.log_refusal(&open, &reply);
            return reply.to_message();
        }
        self.waiting_for_worker
            .lock()
            .expect("waiting models lock")
            .remove(&open.model);
        let served = served.expect("a model is served when nothing refused the camera");
        {
            // Opened again on this connection: the seqs it admitted stay
            // admitted.
            let mut cams = self.cameras.lock().expect("camera map lock");
            let cam = cams
                .entry(open.camera.clone())
                .or_insert_with(|| OpenCamera::new(open.model.clone(), open.copies));
            cam.model = open.model.clone();
            cam.copies = open.copies;
            // Raised before the camera is accepted: its first frame finds
            // it.
            let max =
                Frame::max_body_len(served.info.input.max_frame_payload(), &self.server.limits);
            let before = self.max_frame_body.fetch_max(max, Ordering::AcqRel);
            if max > before {
                self.conn
                    .set_receive_window(quic::edge_receive_window(max).into());
            }
        }
        self.server
            .hub
            .send(HubMsg::CameraOpened {
                edge: self.id,
                camera: open.camera.clone(),
                model: open.model.clone(),
                // Its frames are held to the gateway's longest budget.
                budget_ms: open
                    .budget_ms
                    .min(self.server.config.scheduler.max_budget_ms),
            })
            .await;
        info!(camera = %open.camera, model = %open.model, encoding = %open.encoding, "camera opened");
        Message::CameraAccepted(CameraAccepted {
            camera: open.camera,
            model: open.model,
            input: served.info.input,
            labels: served.info.labels,
            encoding: open.encoding,
            copies: open.copies,
        })
    }

    fn model_of(&self, camera: &str) -> Option<String> {
        self.cameras
            .lock()
            .expect("camera map lock")
            .get(camera)
            .map(|c| c.model.clone())
    }

    /// Writes the hub's rate hints as they come, and a clock probe whenever
    /// the edge's clock is due one, until the control stream fails.
    pub(super) async fn write_control(&self, hints: HintBox) {
        loop {
            let next_probe = self
                .server
                .clock
                .instant(self.clock.lock().expect("edge clock lock").next_probe_us());
            let waiting = tokio::select! {
                h = hints.take() => h,
                _ = tokio::time::sleep_until(next_probe.into()) => Vec::new(),
            };
            let mut s = self.ctl_send.lock().await;
            for h in waiting {
                if let Err(e) = write_message(&mut s, &Message::ControlHint(h)).await {
                    debug!("control stream closed while sending a hint: {e}");
                    return;
                }
            }
            let now = self.server.clock.us(Instant::now());
            if self.clock.lock().expect("edge clock lock").probe_due(now) {
                let probe = Message::ClockProbe(ClockProbe { gateway_us: now });
                if let Err(e) = write_message(&mut s, &probe).await {
                    debug!("control stream closed while sending a clock probe: {e}");
                    return;
                }
            }
        }
    }
}

/// What an edge may send on its control stream once logged in; any other
/// kind is refused from its header, before its body is read.
const EDGE_CONTROL: &[Kind] = &[Kind::CameraOpen, Kind::LatencyReport, Kind::ClockEcho];

/// The `kind` label of `tidegate_control_messages_dropped_total`.
fn control_kind_label(kind: Kind) -> &'static str {
    match kind {
        Kind::CameraOpen => "camera_open",
        Kind::LatencyReport => "latency_report",
        Kind::ClockEcho => "clock_echo",
        _ => "other",
    }
}

/// One frame stream and what its frame is admitted with: taken when the
/// stream was accepted, so its arrival time is when its first bytes came.
struct FrameStream {
    edge: EdgeId,
    arrived: Instant,
    /// Where the frame's body takes its room before it is read.
    budget: InflightBudget,
    /// The whole frame is in by `arrived` plus this, or the stream is
    /// reset: a frame that slow is past its budget anyway.
    read_timeout: Duration,
    rtt: Duration,
    margin: Duration,
    /// `[scheduler] max_budget_ms`: the longest budget a frame is held to.
    max_budget_ms: u32,
    clock: GatewayClock,
    edge_clock: Option<deadline::Offset>,
    cameras: Cameras,
    /// [`EdgeSession::max_frame_body`].
    max_body: Arc<AtomicUsize>,
    hub: Hub,
    limits: Limits,
    metrics: Metrics,
}

impl FrameStream {
    /// Reads the stream's one frame and hands it to the hub with its
    /// deadline. A stream that is not one well-formed frame of an open
    /// camera is stopped and counted by reason, as is one whose frame finds
    /// no room in the budgets (`memory_budget`) or is not in by the read
    /// timeout (`read_timeout`); one reset by the edge (a frame it
    /// withdrew) or cut by its connection's end was never admitted and is
    /// counted as such, not as malformed. The frame's room is held until
    /// the hub has it.
    async fn read(self, mut recv: quinn::RecvStream) {
        let read = tokio::time::timeout_at(
            (self.arrived + self.read_timeout).into(),
            read_frame(&mut recv, &self.limits, &self.max_body, &self.budget),
        )
        .await;
        let Ok(read) = read else {
            debug!(timeout = ?self.read_timeout, "frame stream not read in time; stream reset");
            self.reject(&mut recv, "read_timeout", ErrorCode::Overloaded);
            return;
        };
        let (mut frame, _room): (Frame, _) = match read {
            Ok(Some(read)) => read,
            Ok(None) => return,
            Err(FrameReadError::Budget(e)) => {
                debug!("frame refused: {e}");
                self.reject(&mut recv, "memory_budget", e.code());
                return;
            }
            Err(e @ FrameReadError::LargerThanItsCameras { .. }) => {
                debug!("frame refused: {e}");
                self.reject(&mut recv, "too_large", ErrorCode::TooLarge);
                return;
            }
            Err(FrameReadError::Read(e)) if e.is_reset() => {
                debug!("frame stream reset by the edge: {e}");
                self.metrics.rejected.with_label_values(&["reset"]).inc();
                return;
            }
            Err(FrameReadError::Read(e)) if e.is_connection_lost() => {
                debug!("frame stream cut by the connection's end: {e}");
                self.metrics
                    .rejected
                    .with_label_values(&["connection_lost"])
                    .inc();
                return;
            }
            Err(FrameReadError::Read(e)) => {
                warn!("bad frame stream closed: {e}");
                self.reject(&mut recv, "malformed", e.code());
                return;
            }
        };
        // Checked and recorded at once: two copies read side by side
        // cannot both pass.
        let admitted = match self
            .cameras
            .lock()
            .expect("camera map lock")
            .get_mut(&frame.camera)
        {
            Some(c) if c.model == frame.model => Some(c.admit(frame.seq, Instant::now())),
            _ => None,
        };
        match admitted {
            None => {
                warn!(camera = %frame.camera, model = %frame.model, "frame for a camera not opened with that model; dropped");
                self.reject(&mut recv, "camera_not_open", ErrorCode::Malformed);
                return;
            }
            Some(false) => {
                // Another copy was admitted first (or the frame is older
                // than any remembered): not an error, nothing to answer.
                debug!(camera = %frame.camera, seq = frame.seq, "copy of a frame already admitted; dropped");
                self.metrics
                    .rejected
                    .with_label_values(&["duplicate"])
                    .inc();
                return;
            }
            Some(true) => {}
        }
        let arrived_us = self.clock.us(self.arrived);
        // Served with the gateway's longest budget at most; the hub and
        // its load reports see the budget it is held to.
        frame.budget_us = deadline::capped_budget_us(frame.budget_us, self.max_budget_ms);
        let admission = deadline::admit(
            arrived_us,
            frame.captured_at_us,
            frame.budget_us,
            self.edge_clock,
            u64::try_from(self.rtt.as_micros()).unwrap_or(u64::MAX),
            u64::try_from(self.margin.as_micros()).unwrap_or(u64::MAX),
        );
        self.metrics
            .arrival_age
            .with_label_values(&[&frame.model])
            .observe(admission.age_us as f64 / 1e6);
        self.hub
            .send(HubMsg::Frame {
                edge: self.edge,
                frame,
                deadline: self.clock.instant(admission.deadline_us),
                age: Duration::from_micros(admission.age_us),
            })
            .await;
    }

    fn reject(&self, recv: &mut quinn::RecvStream, reason: &str, code: ErrorCode) {
        self.metrics.rejected.with_label_values(&[reason]).inc();
        let _ = recv.stop(code.quic_code().into());
    }
}

/// Starts an edge's session: registers it with the hub and runs its loops
/// until the connection ends, is revoked or the gateway stops.
pub(super) async fn run(server: &Server, id: EdgeId, link: super::Link, quota: EdgeSlot) {
    let super::Link {
        name,
        conn,
        ctl_send,
        ctl_recv,
        cancel,
        revoked,
    } = link;
    let (results_tx, results_rx) = queue::channel::<FrameResult>(RESULT_QUEUE, RESULT_QUEUE_BYTES);
    let hints = HintBox::new();
    let connected = server
        .hub
        .send(HubMsg::EdgeConnected {
            edge: id,
            name: name.clone(),
            weight: server.access.edge_weight(&name),
            results: results_tx,
            hints: hints.clone(),
        })
        .await;
    if !connected {
        return;
    }
    let mut session = EdgeSession {
        server,
        id,
        conn: conn.clone(),
        ctl_send: tokio::sync::Mutex::new(ctl_send),
        cameras: Cameras::default(),
        max_frame_body: Arc::default(),
        clock: Arc::new(Mutex::new(EdgeClock::new())),
        quota,
        waiting_for_worker: Mutex::default(),
    };
    let mut was_revoked = false;
    tokio::select! {
        _ = cancel.cancelled() => conn.close(0u32.into(), b"gateway shutting down"),
        _ = revoked.cancelled() => was_revoked = true,
        _ = session.read_control(ctl_recv) => {},
        _ = session.read_frames() => {},
        _ = session.write_results(results_rx) => {},
        _ = session.write_control(hints) => {},
        _ = conn.closed() => {},
    }
    // (After the select, so no loop still holds the control stream.)
    if was_revoked {
        let reply = ErrorReply::Revoked {
            role: tidegate_protocol::Role::Edge,
            name,
        };
        warn!("{reply}; closing the connection");
        refuse(&conn, session.ctl_send.get_mut(), &reply).await;
    }
    info!("edge disconnected");
    server.hub.send(HubMsg::EdgeGone { edge: id }).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gateway_clock_maps_instants_to_microseconds_and_back() {
        let epoch = Instant::now();
        let c = GatewayClock::new(epoch);
        assert_eq!(c.us(epoch), 0);
        assert_eq!(c.us(epoch + Duration::from_millis(1500)), 1_500_000);
        // Before the epoch saturates at 0 instead of wrapping.
        assert_eq!(
            c.us(epoch.checked_sub(Duration::from_secs(1)).unwrap_or(epoch)),
            0
        );
        assert_eq!(c.instant(2_000), epoch + Duration::from_micros(2_000));
    }

    #[test]
    fn a_frame_is_admitted_once_whatever_the_copies_and_their_order() {
        let mut w = SeqWindow::default();
        assert!(w.admit(5));
        assert!(!w.admit(5), "the second copy");
        assert!(w.admit(3), "an earlier frame arriving late is new");
        assert!(!w.admit(3));
        assert!(w.admit(u64::MAX));
    }

    #[test]
    fn results_go_back_as_many_times_as_asked_only_while_the_frames_copies_arrive() {
        let t0 = Instant::now();
        let mut cam = OpenCamera::new("m".into(), 2);
        assert!(cam.admit(1, t0));
        assert_eq!(cam.result_copies(t0), 1, "no copy yet");
        assert!(!cam.admit(1, t0 + Duration::from_millis(3)));
        let copied = t0 + Duration::from_millis(3);
        assert_eq!(cam.result_copies(copied), 2);
        assert_eq!(
            cam.result_copies(copied + RESULT_COPIES_AFTER_A_COPY - Duration::from_millis(1)),
            2
        );
        assert_eq!(cam.result_copies(copied + RESULT_COPIES_AFTER_A_COPY), 1);
        // A stale frame (older than every seq remembered) is no copy.
        let mut cam = OpenCamera::new("m".into(), 3);
        for seq in 1000..1000 + SeqWindow::LEN as u64 {
            assert!(cam.admit(seq, t0));
        }
        assert!(!cam.admit(3, t0));
        assert_eq!(cam.result_copies(t0), 1);
        // A camera that asked for one copy gets one, whatever arrives.
        let mut one = OpenCamera::new("m".into(), 1);
        assert!(one.admit(7, t0));
        assert!(!one.admit(7, t0));
        assert_eq!(one.result_copies(t0), 1);
    }

    #[test]
    fn the_window_remembers_its_latest_seqs_and_refuses_older_ones() {
        let mut w = SeqWindow::default();
        for seq in 1000..1000 + SeqWindow::LEN as u64 + 10 {
            assert!(w.admit(seq));
        }
        assert_eq!(w.seqs.len(), SeqWindow::LEN);
        // Older than any remembered: refused, though never seen.
        assert!(!w.admit(1005));
        assert!(!w.admit(0));
        // Within the window and new: admitted, the oldest forgotten.
        let newest = 1000 + SeqWindow::LEN as u64 + 10;
        assert!(w.admit(newest + 1));
        assert_eq!(w.seqs.len(), SeqWindow::LEN);
    }

    #[test]
    fn an_edge_sends_only_its_own_control_messages() {
        assert!(EDGE_CONTROL.contains(&Kind::ClockEcho));
        for k in [Kind::Frame, Kind::Dispatch, Kind::Register, Kind::Result] {
            assert!(!EDGE_CONTROL.contains(&k), "{k:?}");
        }
    }
}
