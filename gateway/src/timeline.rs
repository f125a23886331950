//! The last 15 minutes of what the gateway did, interval by interval: frames
//! by how they ended, the end-to-end latency edges reported, and for the
//! last minute the same per camera and each worker's batches. It feeds the
//! status page's plots and its problems banner (`GET /api/v1/timeline`).
//!
//! Pure and clock-injected: the hub passes its own clock (µs since it
//! started) with every event, and [`Timeline::view`] reads the intervals
//! up to a given instant without changing anything, so a view taken after
//! a quiet spell shows the quiet intervals as zeros. Everything it holds is
//! bounded: [`KEPT_INTERVALS`] intervals, at most
//! [`LATENCY_SAMPLES_PER_INTERVAL`] latency samples each (a uniform
//! reservoir past that), and per-camera and per-worker detail for the last
//! [`RECENT_INTERVALS`] only, for at most [`MAX_KEYS`] cameras and workers
//! per interval (the rest are counted under `others`).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use serde::Serialize;
use tidegate_protocol::{ShedReason, Status};

use crate::scheduler::Micros;

/// Length of one interval (ms): short enough that a burst of shedding
/// shows within one page refresh or two, long enough that an interval
/// holds enough latency reports for a p99 at tens of frames per second.
pub const INTERVAL_MS: u64 = 5_000;

/// Intervals kept: 15 minutes of them.
pub const KEPT_INTERVALS: usize = 180;

/// Intervals that keep per-camera and per-worker detail: the last minute,
/// which is the window of the page's rates and of its banner.
pub const RECENT_INTERVALS: usize = 12;

/// Latency samples kept per interval; past that, a uniform reservoir (the
/// percentiles are then estimates from that many samples).
pub const LATENCY_SAMPLES_PER_INTERVAL: usize = 2048;

/// Batch run times kept per worker and model per interval, for its p95.
pub const BATCH_SAMPLES_PER_INTERVAL: usize = 128;

/// Cameras (and, separately, worker-model pairs) tracked per interval;
/// one past that is added to its interval's `others` count instead.
pub const MAX_KEYS: usize = 4096;

/// Workers dropped as stalled that are remembered (the newest).
pub const STALLS_KEPT: usize = 32;

/// Frames by how they ended (and arrivals), within one span of time.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct FrameCounts {
    /// Frames that arrived and were admitted.
    pub admitted: u64,
    /// Frames answered with results.
    pub ok: u64,
    /// Frames shed by the gateway (overload, would miss their deadline, no
    /// worker, superseded), not counting `edge_gone`.
    pub shed: u64,
    /// Frames whose deadline passed while queued.
    pub expired: u64,
    /// Frames a worker failed, or lost with its worker.
    pub failed: u64,
    /// Queued frames dropped because their edge disconnected (nobody was
    /// left to take the result; not a sign of overload).
    pub edge_gone: u64,
}

impl FrameCounts {
    /// Frames that ended (any status but `edge_gone`).
    pub fn ended(&self) -> u64 {
        self.ok + self.shed + self.expired + self.failed
    }

    /// Shed frames over frames that ended; `None` when none ended.
    pub fn shed_ratio(&self) -> Option<f64> {
        let ended = self.ended();
        (ended > 0).then(|| self.shed as f64 / ended as f64)
    }

    fn add(&mut self, o: &FrameCounts) {
        self.admitted += o.admitted;
        self.ok += o.ok;
        self.shed += o.shed;
        self.expired += o.expired;
        self.failed += o.failed;
        self.edge_gone += o.edge_gone;
    }

    fn count(&mut self, status: &Status) {
        match status {
            Status::Ok => self.ok += 1,
            Status::Shed(ShedReason::EdgeGone) => self.edge_gone += 1,
            Status::Shed(_) => self.shed += 1,
            Status::Expired => self.expired += 1,
            Status::Failed(_) => self.failed += 1,
        }
    }
}

/// Nearest-rank percentiles of a set of latencies (ms).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Percentiles {
    /// Samples they were taken from.
    pub samples: u64,
    /// Median.
    pub p50_ms: f64,
    /// 95th percentile.
    pub p95_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
    /// Largest.
    pub max_ms: f64,
}

impl Percentiles {
    /// Of `samples` (sorted here); `None` when there are none.
    pub fn of(samples: &mut [f64]) -> Option<Percentiles> {
        samples.sort_by(f64::total_cmp);
        let n = samples.len();
        if n == 0 {
            return None;
        }
        let rank = |p: f64| samples[((n as f64 * p).ceil() as usize).clamp(1, n) - 1];
        Some(Percentiles {
            samples: n as u64,
            p50_ms: rank(0.50),
            p95_ms: rank(0.95),
            p99_ms: rank(0.99),
            max_ms: samples[n - 1],
        })
    }
}

/// A bounded uniform sample of a stream (Algorithm R), with its own
/// deterministic generator so that the timeline stays pure.
#[derive(Debug, Clone, Default)]
struct Reservoir {
    kept: Vec<f64>,
    seen: u64,
}

impl Reservoir {
    fn push(&mut self, v: f64, cap: usize, rng: &mut u64) {
        self.seen += 1;
        if self.kept.len() < cap {
            self.kept.push(v);
            return;
        }
        // xorshift64: enough to pick places uniformly
        *rng ^= *rng << 13;
        *rng ^= *rng >> 7;
        *rng ^= *rng << 17;
        let j = *rng % self.seen;
        if (j as usize) < cap {
            self.kept[j as usize] = v;
        }
    }
}

/// One worker's batches of one model within an interval.
#[derive(Debug, Clone, Default)]
struct WorkerAcc {
    name: String,
    batches: u64,
    frames: u64,
    run_us: u64,
    own_us: u64,
    run_ms: Reservoir,
}

/// One worker's batches of one model summed over several intervals.
#[derive(Debug, Default)]
struct WorkerSum<'a> {
    name: &'a str,
    batches: u64,
    frames: u64,
    run_us: u64,
    own_us: u64,
    runs_ms: Vec<f64>,
}

/// One interval: [`INTERVAL_MS`] of events.
#[derive(Debug, Clone, Default)]
struct Interval {
    /// Its number since the timeline began.
    index: u64,
    frames: FrameCounts,
    latency: Reservoir,
    /// The latency's percentiles, set when the interval closes.
    latency_summary: Option<Percentiles>,
    /// Per edge name, then camera (dropped once past the recent ones).
    cameras: HashMap<Arc<str>, HashMap<String, FrameCounts>>,
    camera_keys: usize,
    /// Frames of cameras past [`MAX_KEYS`].
    other_cameras: FrameCounts,
    /// Per worker id, then model.
    workers: HashMap<u64, HashMap<String, WorkerAcc>>,
    worker_keys: usize,
}

impl Interval {
    fn new(index: u64) -> Interval {
        Interval {
            index,
            ..Interval::default()
        }
    }

    /// The counts of `edge`'s `camera`, or of the others when the interval
    /// tracks [`MAX_KEYS`] cameras already.
    fn camera(&mut self, edge: &Arc<str>, camera: &str) -> &mut FrameCounts {
        let known = self
            .cameras
            .get(&**edge)
            .is_some_and(|c| c.contains_key(camera));
        if !known {
            if self.camera_keys >= MAX_KEYS {
                return &mut self.other_cameras;
            }
            self.camera_keys += 1;
            self.cameras
                .entry(edge.clone())
                .or_default()
                .insert(camera.to_string(), FrameCounts::default());
        }
        self.cameras
            .get_mut(&**edge)
            .and_then(|c| c.get_mut(camera))
            .expect("inserted above")
    }

    /// Drops what only the recent intervals keep.
    fn forget_detail(&mut self) {
        self.cameras = HashMap::new();
        self.workers = HashMap::new();
        self.latency.kept = Vec::new();
    }

    /// The percentiles of its latency samples (computed now for the open
    /// interval).
    fn percentiles(&self) -> Option<Percentiles> {
        self.latency_summary
            .or_else(|| Percentiles::of(&mut self.latency.kept.clone()))
    }
}

/// A worker the hub dropped because a batch went unanswered past due.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Stall {
    /// When (ms since the Unix epoch).
    pub at_ms: u64,
    /// The worker's registered name.
    pub worker: String,
    /// Why, as the scheduler said it.
    pub reason: String,
}

/// The ring of intervals. See the module documentation.
#[derive(Debug, Clone)]
pub struct Timeline {
    /// Wall-clock time (ms since the Unix epoch) of the clock's zero.
    origin_wall_ms: u64,
    /// Closed intervals, oldest first, consecutive, at most
    /// [`KEPT_INTERVALS`].
    closed: VecDeque<Interval>,
    /// The interval being filled.
    open: Interval,
    stalls: VecDeque<Stall>,
    rng: u64,
}

/// One interval of a [`TimelineView`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Point {
    /// Its start (ms since the Unix epoch).
    pub start_ms: u64,
    /// Frames that arrived, and that ended, within it.
    pub frames: FrameCounts,
    /// Shed over ended; `None` when none ended.
    pub shed_ratio: Option<f64>,
    /// End-to-end latency edges reported within it.
    pub latency: Option<Percentiles>,
}

/// One camera over the recent window.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CameraWindow {
    /// Its edge's name.
    pub edge: String,
    /// Camera name.
    pub camera: String,
    /// Its frames.
    pub frames: FrameCounts,
}

/// One worker's batches of one model over the recent window.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WorkerWindow {
    /// Session id.
    pub id: u64,
    /// Registered name.
    pub name: String,
    /// Model.
    pub model: String,
    /// Batches it returned.
    pub batches: u64,
    /// Frames in them.
    pub frames: u64,
    /// Mean run time per batch (ms), as the gateway sees it: dispatch (or
    /// the batch before) to result, transfer included.
    pub mean_ms: f64,
    /// 95th percentile of the run times (ms).
    pub p95_ms: f64,
    /// Mean of the worker's own time per batch (ms): its frames' pre- and
    /// postprocessing and the inference run, as it reports them; what its
    /// profile times.
    pub own_ms: f64,
}

/// How long one batch took: as the gateway saw it, and the worker's own
/// part of that.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchTimes {
    /// Dispatch (or the batch before) to result, transfer included (µs).
    pub run_us: u32,
    /// The worker's pre- and postprocessing and inference (µs).
    pub own_us: u64,
}

/// The last [`RECENT_INTERVALS`] closed intervals, summed.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RecentWindow {
    /// Start (ms since the Unix epoch).
    pub start_ms: u64,
    /// End: the end of the last closed interval.
    pub end_ms: u64,
    /// Frames; `admitted` is the sum of the cameras' (and `others'`).
    pub frames: FrameCounts,
    /// Shed over ended; `None` when none ended.
    pub shed_ratio: Option<f64>,
    /// End-to-end latency over the window.
    pub latency: Option<Percentiles>,
    /// Per camera that had a frame, by edge and camera name.
    pub cameras: Vec<CameraWindow>,
    /// Frames of cameras past [`MAX_KEYS`] in some interval.
    pub other_cameras: FrameCounts,
    /// Per worker and model that returned a batch, by id and model.
    pub workers: Vec<WorkerWindow>,
}

/// What [`Timeline::view`] returns: served as `GET /api/v1/timeline`.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct TimelineView {
    /// The instant of the view (ms since the Unix epoch).
    pub now_ms: u64,
    /// Each interval's length (ms).
    pub interval_ms: u64,
    /// Closed intervals, oldest first, consecutive, ending where the
    /// interval holding `now_ms` starts (quiet ones as zeros); fewer than
    /// [`KEPT_INTERVALS`] only in the gateway's first 15 minutes.
    pub points: Vec<Point>,
    /// The last minute (the last [`RECENT_INTERVALS`] of `points`).
    pub recent: RecentWindow,
    /// Workers dropped as stalled, newest last (at most [`STALLS_KEPT`]).
    pub stalls: Vec<Stall>,
}

impl Timeline {
    /// An empty timeline whose clock's zero is `origin_wall_ms` (ms since
    /// the Unix epoch).
    pub fn new(origin_wall_ms: u64) -> Timeline {
        Timeline {
            origin_wall_ms,
            closed: VecDeque::with_capacity(KEPT_INTERVALS),
            open: Interval::new(0),
            stalls: VecDeque::new(),
            rng: 0x9E37_79B9_7F4A_7C15,
        }
    }

    fn index_of(now: Micros) -> u64 {
        now / (INTERVAL_MS * 1000)
    }

    fn wall_ms(&self, now: Micros) -> u64 {
        self.origin_wall_ms + now / 1000
    }

    fn start_ms(&self, index: u64) -> u64 {
        self.origin_wall_ms + index * INTERVAL_MS
    }

    /// Closes the open interval if `now` is past it, and the quiet ones
    /// between. A clock that went back records into the open interval.
    fn roll(&mut self, now: Micros) -> &mut Interval {
        let index = Self::index_of(now);
        if index > self.open.index {
            let first_quiet =
                (self.open.index + 1).max(index.saturating_sub(KEPT_INTERVALS as u64));
            let done = std::mem::replace(&mut self.open, Interval::new(index));
            self.close(done);
            for quiet in first_quiet..index {
                self.close(Interval::new(quiet));
            }
        }
        &mut self.open
    }

    fn close(&mut self, mut iv: Interval) {
        // Once, here, rather than at every view; the samples stay for the
        // recent window's percentiles.
        iv.latency_summary = Percentiles::of(&mut iv.latency.kept.clone());
        if self.closed.len() == KEPT_INTERVALS {
            self.closed.pop_front();
        }
        self.closed.push_back(iv);
        if self.closed.len() > RECENT_INTERVALS {
            let aged = self.closed.len() - RECENT_INTERVALS - 1;
            self.closed[aged].forget_detail();
        }
    }

    /// A frame of `edge`'s `camera` was admitted.
    pub fn arrival(&mut self, now: Micros, edge: &Arc<str>, camera: &str) {
        let iv = self.roll(now);
        iv.frames.admitted += 1;
        iv.camera(edge, camera).admitted += 1;
    }

    /// A frame of `edge`'s `camera` ended with `status`.
    pub fn outcome(&mut self, now: Micros, edge: &Arc<str>, camera: &str, status: &Status) {
        let iv = self.roll(now);
        iv.frames.count(status);
        iv.camera(edge, camera).count(status);
    }

    /// An edge reported a result's end-to-end latency (ms).
    pub fn latency(&mut self, now: Micros, ms: f64) {
        let mut rng = self.rng;
        self.roll(now)
            .latency
            .push(ms, LATENCY_SAMPLES_PER_INTERVAL, &mut rng);
        self.rng = rng;
    }

    /// Worker `id` (registered as `name`) returned a batch of `frames`
    /// frames of `model` that took `times`.
    pub fn batch(
        &mut self,
        now: Micros,
        id: u64,
        name: &str,
        model: &str,
        frames: usize,
        times: BatchTimes,
    ) {
        let BatchTimes { run_us, own_us } = times;
        let mut rng = self.rng;
        let iv = self.roll(now);
        let known = iv.workers.get(&id).is_some_and(|m| m.contains_key(model));
        if !known {
            if iv.worker_keys >= MAX_KEYS {
                return;
            }
            iv.worker_keys += 1;
        }
        let acc = iv
            .workers
            .entry(id)
            .or_default()
            .entry(model.to_string())
            .or_insert_with(|| WorkerAcc {
                name: name.to_string(),
                ..WorkerAcc::default()
            });
        acc.batches += 1;
        acc.frames += frames as u64;
        acc.run_us += u64::from(run_us);
        acc.own_us += own_us;
        acc.run_ms.push(
            f64::from(run_us) / 1e3,
            BATCH_SAMPLES_PER_INTERVAL,
            &mut rng,
        );
        self.rng = rng;
    }

    /// The hub dropped worker `name` as stalled.
    pub fn stalled(&mut self, now: Micros, name: &str, reason: &str) {
        if self.stalls.len() == STALLS_KEPT {
            self.stalls.pop_front();
        }
        self.stalls.push_back(Stall {
            at_ms: self.wall_ms(now),
            worker: name.to_string(),
            reason: reason.to_string(),
        });
    }

    /// The closed interval numbered `index` as of `now`: one the timeline
    /// holds, the open one if `now` is past it, or `None` for a quiet one
    /// (or one older than what is kept).
    fn interval(&self, index: u64, now_index: u64) -> Option<&Interval> {
        if index >= now_index {
            return None;
        }
        if index == self.open.index {
            return Some(&self.open);
        }
        let first = self.closed.front()?.index;
        let at = usize::try_from(index.checked_sub(first)?).ok()?;
        self.closed.get(at).filter(|iv| iv.index == index)
    }

    /// The timeline as of `now` (not before the last event recorded).
    pub fn view(&self, now: Micros) -> TimelineView {
        let now_index = Self::index_of(now).max(self.open.index);
        let first = now_index.saturating_sub(KEPT_INTERVALS as u64);
        let points = (first..now_index)
            .map(|index| {
                let iv = self.interval(index, now_index);
                let frames = iv.map(|iv| iv.frames).unwrap_or_default();
                Point {
                    start_ms: self.start_ms(index),
                    frames,
                    shed_ratio: frames.shed_ratio(),
                    latency: iv.and_then(Interval::percentiles),
                }
            })
            .collect();
        TimelineView {
            now_ms: self.wall_ms(now),
            interval_ms: INTERVAL_MS,
            points,
            recent: self.recent(now_index),
            stalls: self.stalls.iter().cloned().collect(),
        }
    }

    /// The last [`RECENT_INTERVALS`] before `now_index`, summed.
    fn recent(&self, now_index: u64) -> RecentWindow {
        let first = now_index.saturating_sub(RECENT_INTERVALS as u64);
        let intervals: Vec<&Interval> = (first..now_index)
            .filter_map(|i| self.interval(i, now_index))
            .collect();
        let mut out = RecentWindow {
            start_ms: self.start_ms(first),
            end_ms: self.start_ms(now_index),
            ..RecentWindow::default()
        };
        let mut latencies = Vec::new();
        let mut cameras: HashMap<(&str, &str), FrameCounts> = HashMap::new();
        let mut workers: HashMap<(u64, &str), WorkerSum<'_>> = HashMap::new();
        for iv in intervals {
            out.frames.add(&iv.frames);
            out.other_cameras.add(&iv.other_cameras);
            latencies.extend_from_slice(&iv.latency.kept);
            for (edge, cams) in &iv.cameras {
                for (camera, counts) in cams {
                    cameras
                        .entry((&**edge, camera.as_str()))
                        .or_default()
                        .add(counts);
                }
            }
            for (id, models) in &iv.workers {
                for (model, acc) in models {
                    let w = workers
                        .entry((*id, model.as_str()))
                        .or_insert_with(|| WorkerSum {
                            name: &acc.name,
                            ..WorkerSum::default()
                        });
                    w.batches += acc.batches;
                    w.frames += acc.frames;
                    w.run_us += acc.run_us;
                    w.own_us += acc.own_us;
                    w.runs_ms.extend_from_slice(&acc.run_ms.kept);
                }
            }
        }
        out.shed_ratio = out.frames.shed_ratio();
        out.latency = Percentiles::of(&mut latencies);
        out.cameras = cameras
            .into_iter()
            .map(|((edge, camera), frames)| CameraWindow {
                edge: edge.to_string(),
                camera: camera.to_string(),
                frames,
            })
            .collect();
        out.cameras
            .sort_by(|a, b| (&a.edge, &a.camera).cmp(&(&b.edge, &b.camera)));
        out.workers = workers
            .into_iter()
            .map(|((id, model), mut w)| WorkerWindow {
                id,
                name: w.name.to_string(),
                model: model.to_string(),
                batches: w.batches,
                frames: w.frames,
                mean_ms: w.run_us as f64 / 1e3 / w.batches.max(1) as f64,
                p95_ms: Percentiles::of(&mut w.runs_ms).map_or(0.0, |p| p.p95_ms),
                own_ms: w.own_us as f64 / 1e3 / w.batches.max(1) as f64,
            })
            .collect();
        out.workers
            .sort_by(|a, b| (a.id, &a.model).cmp(&(b.id, &b.model)));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Micros = 1_000_000;
    const ORIGIN: u64 = 1_764_694_800_000;

    fn edge(name: &str) -> Arc<str> {
        Arc::from(name)
    }

    #[test]
    fn percentiles_are_nearest_rank_on_known_samples() {
        let mut v: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        let p = Percentiles::of(&mut v).unwrap();
        assert_eq!(
            (p.samples, p.p50_ms, p.p95_ms, p.p99_ms, p.max_ms),
            (100, 50.0, 95.0, 99.0, 100.0)
        );
        let p = Percentiles::of(&mut [7.5]).unwrap();
        assert_eq!((p.p50_ms, p.p99_ms, p.max_ms), (7.5, 7.5, 7.5));
        let p = Percentiles::of(&mut [30.0, 10.0, 20.0]).unwrap();
        assert_eq!((p.p50_ms, p.p95_ms), (20.0, 30.0));
        assert_eq!(Percentiles::of(&mut []), None);
    }

    #[test]
    fn each_interval_counts_exactly_what_happened_in_it() {
        let mut t = Timeline::new(ORIGIN);
        let lobby = edge("lobby");
        // interval 0: 3 arrivals, 2 ok, 1 shed; interval 1: 1 expired,
        // 1 failed, 1 dropped with its edge; interval 2 quiet.
        for k in 0..3 {
            t.arrival(k * S, &lobby, "door");
        }
        t.outcome(S, &lobby, "door", &Status::Ok);
        t.outcome(2 * S, &lobby, "door", &Status::Ok);
        t.outcome(4 * S, &lobby, "door", &Status::Shed(ShedReason::Overloaded));
        t.outcome(5 * S, &lobby, "door", &Status::Expired);
        t.outcome(6 * S, &lobby, "door", &Status::Failed("worker lost".into()));
        t.outcome(9 * S, &lobby, "door", &Status::Shed(ShedReason::EdgeGone));
        let v = t.view(16 * S);
        assert_eq!(v.points.len(), 3, "three closed intervals at 16 s");
        assert_eq!(v.points[0].start_ms, ORIGIN);
        assert_eq!(v.points[2].start_ms, ORIGIN + 10_000);
        let c = |admitted, ok, shed, expired, failed, edge_gone| FrameCounts {
            admitted,
            ok,
            shed,
            expired,
            failed,
            edge_gone,
        };
        assert_eq!(v.points[0].frames, c(3, 2, 1, 0, 0, 0));
        assert_eq!(v.points[1].frames, c(0, 0, 0, 1, 1, 1));
        assert_eq!(v.points[2].frames, FrameCounts::default());
        assert_eq!(v.points[0].shed_ratio, Some(1.0 / 3.0));
        assert_eq!(
            v.points[1].shed_ratio,
            Some(0.0),
            "edge_gone is not shedding"
        );
        assert_eq!(v.points[2].shed_ratio, None);
        assert_eq!(v.recent.frames, c(3, 2, 1, 1, 1, 1));
        assert_eq!(v.recent.cameras.len(), 1);
        assert_eq!(v.recent.cameras[0].frames, v.recent.frames);
    }

    #[test]
    fn the_ring_keeps_fifteen_minutes_and_drops_detail_past_the_last_minute() {
        let mut t = Timeline::new(ORIGIN);
        let e = edge("e");
        // one frame and one latency report per second for an hour
        for s in 0..3600 {
            t.arrival(s * S, &e, &format!("cam-{s}"));
            t.latency(s * S, s as f64);
        }
        assert_eq!(t.closed.len(), KEPT_INTERVALS);
        let detailed = t.closed.iter().filter(|iv| !iv.cameras.is_empty()).count();
        assert_eq!(detailed, RECENT_INTERVALS);
        assert!(
            t.closed
                .iter()
                .rev()
                .skip(RECENT_INTERVALS)
                .all(|iv| iv.latency.kept.is_empty())
        );
        let v = t.view(3600 * S);
        assert_eq!(v.points.len(), KEPT_INTERVALS);
        assert!(
            v.points.iter().all(|p| p.frames.admitted == 5),
            "5 s of 1 fps each"
        );
        // the last minute: 60 cameras of one frame each, adding up
        assert_eq!(v.recent.frames.admitted, 60);
        assert_eq!(v.recent.cameras.len(), 60);
        let sum: u64 = v.recent.cameras.iter().map(|c| c.frames.admitted).sum();
        assert_eq!(sum, v.recent.frames.admitted);
        assert_eq!(v.recent.end_ms - v.recent.start_ms, 60_000);
        // latency of the last interval: 3595..3599 ms
        let last = v.points.last().unwrap().latency.unwrap();
        assert_eq!(
            (last.samples, last.p50_ms, last.max_ms),
            (5, 3597.0, 3599.0)
        );
    }

    #[test]
    fn a_quiet_spell_reads_as_zeros_and_a_long_one_empties_the_ring() {
        let mut t = Timeline::new(ORIGIN);
        let e = edge("e");
        t.arrival(0, &e, "c");
        // no event since: the view still closes what has passed
        let v = t.view(61 * S);
        assert_eq!(v.points.len(), 12);
        assert_eq!(v.points[0].frames.admitted, 1);
        assert!(
            v.points[1..]
                .iter()
                .all(|p| p.frames == FrameCounts::default())
        );
        assert_eq!(
            v.recent.frames.admitted, 1,
            "the window is the last 12 whole intervals: 0 s to 60 s"
        );
        let v = t.view(65 * S);
        assert_eq!(v.points.len(), 13);
        assert_eq!(v.recent.frames.admitted, 0, "5 s to 65 s");
        assert_eq!(v.recent.start_ms, ORIGIN + 5_000);
        // a day later: one event rolls at most the ring's length
        t.arrival(86_400 * S, &e, "c");
        assert_eq!(t.closed.len(), KEPT_INTERVALS);
        assert!(
            t.closed
                .iter()
                .all(|iv| iv.frames == FrameCounts::default())
        );
        let v = t.view(86_405 * S);
        assert_eq!(v.points.len(), KEPT_INTERVALS);
        assert_eq!(v.points.last().unwrap().frames.admitted, 1);
        let consecutive = v
            .points
            .windows(2)
            .all(|w| w[1].start_ms == w[0].start_ms + INTERVAL_MS);
        assert!(consecutive);
    }

    #[test]
    fn a_clock_that_goes_back_records_into_the_open_interval() {
        let mut t = Timeline::new(ORIGIN);
        let e = edge("e");
        t.arrival(12 * S, &e, "c");
        t.arrival(3 * S, &e, "c");
        let v = t.view(2 * S);
        assert!(v.points.len() == 2 && v.points.iter().all(|p| p.frames.admitted == 0));
        let v = t.view(15 * S);
        assert_eq!(v.points[2].frames.admitted, 2);
    }

    #[test]
    fn latency_samples_are_bounded_per_interval() {
        let mut t = Timeline::new(ORIGIN);
        for k in 0..10 * LATENCY_SAMPLES_PER_INTERVAL {
            t.latency(0, (k % 100 + 1) as f64);
        }
        assert_eq!(t.open.latency.kept.len(), LATENCY_SAMPLES_PER_INTERVAL);
        assert_eq!(
            t.open.latency.seen,
            10 * LATENCY_SAMPLES_PER_INTERVAL as u64
        );
        let p = t.view(5 * S).points[0].latency.unwrap();
        assert_eq!(p.samples, LATENCY_SAMPLES_PER_INTERVAL as u64);
        // a uniform sample of 1..=100: the median lands near 50
        assert!((40.0..=60.0).contains(&p.p50_ms), "{p:?}");
        assert!(p.max_ms <= 100.0 && p.p99_ms >= 90.0, "{p:?}");
    }

    #[test]
    fn cameras_past_the_cap_are_counted_as_others_and_still_add_up() {
        let mut t = Timeline::new(ORIGIN);
        let e = edge("e");
        for k in 0..MAX_KEYS + 10 {
            t.arrival(0, &e, &format!("c{k}"));
            t.outcome(0, &e, &format!("c{k}"), &Status::Ok);
        }
        let v = t.view(5 * S);
        assert_eq!(v.recent.cameras.len(), MAX_KEYS);
        assert_eq!(v.recent.other_cameras.admitted, 10);
        let sum: u64 = v.recent.cameras.iter().map(|c| c.frames.admitted).sum();
        assert_eq!(
            sum + v.recent.other_cameras.admitted,
            v.recent.frames.admitted
        );
        assert_eq!(v.recent.frames.ok, (MAX_KEYS + 10) as u64);
    }

    /// A batch that ran `run_us`, of which the worker's own time was half.
    fn times(run_us: u32) -> BatchTimes {
        BatchTimes {
            run_us,
            own_us: u64::from(run_us) / 2,
        }
    }

    #[test]
    fn worker_batches_sum_over_the_last_minute() {
        let mut t = Timeline::new(ORIGIN);
        // worker 7 runs 2-frame batches of 10 ms then 30 ms; worker 9 one
        // batch of 4 frames; a batch 2 minutes old does not count.
        t.batch(0, 7, "w7", "m", 2, times(99_000));
        for k in 0..10u64 {
            let run = if k < 5 { 10_000 } else { 30_000 };
            t.batch(120 * S + k * S, 7, "w7", "m", 2, times(run));
        }
        t.batch(125 * S, 9, "w9", "m", 4, times(8_000));
        let v = t.view(135 * S);
        assert_eq!(v.recent.workers.len(), 2);
        let w7 = &v.recent.workers[0];
        assert_eq!(
            (w7.id, w7.name.as_str(), w7.batches, w7.frames),
            (7, "w7", 10, 20)
        );
        assert!((w7.mean_ms - 20.0).abs() < 1e-9, "{w7:?}");
        assert!(
            (w7.own_ms - 10.0).abs() < 1e-9,
            "the worker's own half: {w7:?}"
        );
        assert_eq!(w7.p95_ms, 30.0);
        let w9 = &v.recent.workers[1];
        assert_eq!(
            (w9.batches, w9.frames, w9.mean_ms, w9.p95_ms),
            (1, 4, 8.0, 8.0)
        );
    }

    #[test]
    fn stalls_are_remembered_newest_last_and_bounded() {
        let mut t = Timeline::new(ORIGIN);
        for k in 0..(STALLS_KEPT as u64 + 3) {
            t.stalled(k * S, &format!("w{k}"), "batch 3 unanswered");
        }
        let v = t.view(100 * S);
        assert_eq!(v.stalls.len(), STALLS_KEPT);
        let last = v.stalls.last().unwrap();
        assert_eq!(last.worker, format!("w{}", STALLS_KEPT + 2));
        assert_eq!(last.at_ms, ORIGIN + (STALLS_KEPT as u64 + 2) * 1000);
    }
}
