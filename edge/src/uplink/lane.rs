//! One camera's frames on one connection: [`Lane`] opens a stream per
//! frame (per copy), at the connection's [`SendOrder`] priority, and resets
//! it when it is superseded or still unacknowledged at its deadline. Each
//! frame's fate on the wire is counted in [`LaneStats`], then told to the
//! [`Unanswered`] ledger if the lane has one. It never queues a frame for
//! later, and it reads nothing from the gateway but acknowledgements; the
//! frame's result comes back through `results`.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tidegate_protocol::quic::write_message;
use tidegate_protocol::{Frame, Message};
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug};

use super::{Unanswered, Uplink, UplinkError};

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

impl Uplink {
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
                max_copies: 1,
                copies: AtomicU8::new(1),
                in_flight: Mutex::new(VecDeque::new()),
                stats,
                unanswered,
            }),
            tasks: tokio_util::task::TaskTracker::new(),
        }
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
    /// The most copies of a frame: those the camera was opened with.
    max_copies: u8,
    /// Copies of each frame sent now, each on a stream of its own (1 to
    /// `max_copies`).
    copies: AtomicU8,
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
    /// camera opened with as many copies ([`Uplink::open_camera_with`]);
    /// [`Lane::set_copies`] may then send fewer. Call before the first
    /// send.
    pub fn with_copies(mut self, copies: u8) -> Self {
        if let Some(state) = Arc::get_mut(&mut self.state) {
            state.max_copies = copies.clamp(1, tidegate_protocol::MAX_COPIES);
            state.copies = AtomicU8::new(state.max_copies);
        }
        self
    }

    /// Sends each frame from now on `copies` times, at least once and at
    /// most as many times as the lane was made with ([`Lane::with_copies`]):
    /// the gateway admits one copy of a frame however many come.
    pub fn set_copies(&self, copies: u8) {
        let n = copies.clamp(1, self.state.max_copies);
        self.state.copies.store(n, Ordering::Relaxed);
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
        for _ in 1..self.state.copies.load(Ordering::Relaxed) {
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
    // Late and superseded: expired, whichever woke first (a timer whose
    // deadline had passed before it was first polled may not be ready
    // before a supersession that came meanwhile).
    let reason = match reason {
        WireFate::Superseded if tokio::time::Instant::now() >= deadline => WireFate::Expired,
        r => r,
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
