//! The ledger of frames sent: by camera and `seq`, how each frame ended
//! (its result, its fate on the wire, or its connection's end), so that
//! every frame is counted exactly once. Pure bookkeeping: no I/O, no clock.
//! A [`Lane`](super::Lane) records frames sent and their fates here; the
//! consumer of results records their answers.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Mutex, PoisonError};

use tracing::warn;

use super::WireFate;

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
///
/// [`Uplink::lane_with`]: super::Uplink::lane_with
/// [`LaneStats`]: super::LaneStats
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
///
/// [`LaneStats`]: super::LaneStats
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
    /// [`Uplink::id`](super::Uplink::id) of the connection it went out on.
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
    pub(super) fn sent(&self, camera: &str, seq: u64, conn: u64) {
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
    pub(super) fn unsent(&self, camera: &str, seq: u64) {
        let mut cameras = self.cameras();
        if let Some(c) = cameras.get_mut(camera) {
            c.update(seq, |_, _| false);
        }
        self.wake_if_emptied(&cameras);
    }

    /// The lane knows what became of frame `seq` of `camera` on the wire
    /// (after counting it in its [`LaneStats`]).
    pub(super) fn settled(&self, camera: &str, seq: u64, fate: WireFate) {
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
    ///
    /// [`Uplink::id`]: super::Uplink::id
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

#[cfg(test)]
mod tests {
    use super::*;
    use WireFate::{Delivered, Expired, Lost, Refused, Superseded};
    use std::sync::Arc;
    use std::time::Duration;

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
