//! Property tests of the scheduler's fair shares over random event
//! sequences on the injected clock: configured edges (accounts of several
//! connections, with weights) share the queue and the workers by weight,
//! and a gone connection's frames are never dispatched.

use std::collections::{BTreeMap, HashMap, HashSet};

use proptest::prelude::*;
use tidegate_gateway::health::HealthPolicy;
use tidegate_gateway::scheduler::{
    Action, Arrival, BatchId, EdgeId, Event, FrameId, Micros, Scheduler, Settings, WorkerId,
    WorkerModel,
};
use tidegate_protocol::{ShedReason, Status};

/// Accounts in these tests; connection `k` of account `a` is edge id
/// `a * 10 + k`.
const ACCOUNTS: usize = 3;

fn worker_joined(id: u64, max_batch: u16, latency_us: u32) -> Event {
    Event::WorkerJoined {
        worker: WorkerId(id),
        models: vec![WorkerModel {
            model: "m".into(),
            max_batch,
            profile: vec![
                (1, latency_us),
                (
                    max_batch,
                    latency_us * u32::from(max_batch) / 2 + latency_us,
                ),
            ],
        }],
    }
}

#[derive(Debug, Clone)]
enum Share {
    Arrive {
        account: u8,
        conn: u8,
        camera: u8,
        budget_ms: u32,
    },
    Join {
        max_batch: u16,
        latency_us: u32,
    },
    Finish {
        pick: u8,
    },
    Advance {
        us: u32,
    },
}

fn share_step() -> impl Strategy<Value = Share> {
    prop_oneof![
        8 => (0..ACCOUNTS as u8, 0u8..3, 0u8..6, 10_000u32..60_000).prop_map(
            |(account, conn, camera, budget_ms)| Share::Arrive { account, conn, camera, budget_ms }
        ),
        1 => (1u16..6, 500u32..20_000)
            .prop_map(|(max_batch, latency_us)| Share::Join { max_batch, latency_us }),
        4 => any::<u8>().prop_map(|pick| Share::Finish { pick }),
        2 => (0u32..5_000).prop_map(|us| Share::Advance { us }),
    ]
}

/// What the test knows of the queue, to check the scheduler's choices.
struct Shares {
    now: Micros,
    limits: Settings,
    weights: Vec<u32>,
    account_of: HashMap<FrameId, usize>,
    queued: Vec<HashSet<FrameId>>,
    completed: HashSet<FrameId>,
    batches: Vec<(WorkerId, BatchId, Vec<FrameId>)>,
    /// For each pair of accounts queued since the window opened: the
    /// frames each was given since.
    windows: BTreeMap<(usize, usize), (u64, u64)>,
}

impl Shares {
    fn backlogged(&self, a: usize) -> bool {
        !self.queued[a].is_empty()
    }

    /// Total weight of the accounts with frames queued, and `also`.
    fn active_weight(&self, also: usize) -> u64 {
        (0..ACCOUNTS)
            .filter(|a| *a == also || self.backlogged(*a))
            .map(|a| u64::from(self.weights[a]))
            .sum()
    }

    fn total_queued(&self) -> usize {
        self.queued.iter().map(HashSet::len).sum()
    }

    /// Opens a window for each pair now both queued; closes those that
    /// are not.
    fn refresh_windows(&mut self) {
        for a in 0..ACCOUNTS {
            for b in a + 1..ACCOUNTS {
                if self.backlogged(a) && self.backlogged(b) {
                    self.windows.entry((a, b)).or_insert((0, 0));
                } else {
                    self.windows.remove(&(a, b));
                }
            }
        }
    }

    /// Applies `event`; `arriving` is the frame it brings, if any.
    fn apply(
        &mut self,
        s: &mut Scheduler,
        event: Event,
        arriving: Option<(FrameId, usize)>,
    ) -> Result<(), TestCaseError> {
        let mut settled = arriving.is_none();
        for action in s.on_event(self.now, event) {
            match action {
                Action::Complete { frame, status, .. } => {
                    prop_assert!(self.completed.insert(frame), "{:?} ended twice", frame);
                    if let Some((new, a)) = arriving
                        && new == frame
                    {
                        settled = true;
                        if status == Status::Shed(ShedReason::Overloaded) {
                            // Refused: its account was at its cap, or at
                            // its weighted share of a full queue.
                            let q = self.queued[a].len();
                            let share = self.limits.max_queued as u64 * u64::from(self.weights[a])
                                / self.active_weight(a);
                            prop_assert!(
                                q >= self.limits.max_queued_per_edge
                                    || (self.total_queued() >= self.limits.max_queued
                                        && q as u64 >= share),
                                "account {} refused with {} queued (share {}, total {})",
                                a,
                                q,
                                share,
                                self.total_queued()
                            );
                        }
                        continue;
                    }
                    let a = self.account_of[&frame];
                    if self.queued[a].contains(&frame)
                        && status == Status::Shed(ShedReason::Overloaded)
                    {
                        // Pushed out for the arriving frame: its account
                        // held more than its weighted share of the queue.
                        let (_, newcomer) = arriving.expect("pushed out only by an arrival");
                        let q = self.queued[a].len() as u64;
                        prop_assert!(
                            q * self.active_weight(newcomer)
                                > self.limits.max_queued as u64 * u64::from(self.weights[a]),
                            "account {} pushed out at {} queued",
                            a,
                            q
                        );
                    }
                    self.queued[a].remove(&frame);
                    self.batches
                        .iter_mut()
                        .for_each(|(_, _, f)| f.retain(|x| *x != frame));
                }
                Action::Dispatch {
                    worker,
                    batch,
                    frames,
                    ..
                } => {
                    if !settled {
                        let (new, a) = arriving.expect("unsettled only with an arrival");
                        self.queued[a].insert(new);
                        settled = true;
                        self.refresh_windows();
                    }
                    let mut given = [0u64; ACCOUNTS];
                    for f in &frames {
                        let a = self.account_of[f];
                        prop_assert!(self.queued[a].remove(f), "dispatched {:?} not queued", f);
                        given[a] += 1;
                    }
                    for (&(a, b), (sa, sb)) in &mut self.windows {
                        *sa += given[a];
                        *sb += given[b];
                        // Only while both stayed queued through the batch
                        // does the bound hold for all of its picks.
                        if self.queued[a].is_empty() || self.queued[b].is_empty() {
                            continue;
                        }
                        let (wa, wb) = (f64::from(self.weights[a]), f64::from(self.weights[b]));
                        let lag = (*sa as f64 / wa - *sb as f64 / wb).abs();
                        let bound = 2.0 * (1.0 / wa).max(1.0 / wb) + 1e-3;
                        prop_assert!(
                            lag <= bound,
                            "accounts {} (w {}) and {} (w {}) served {} and {} while both queued",
                            a,
                            wa,
                            b,
                            wb,
                            sa,
                            sb
                        );
                    }
                    self.batches.push((worker, batch, frames));
                }
                _ => {}
            }
            self.refresh_windows();
        }
        if !settled {
            let (new, a) = arriving.expect("unsettled only with an arrival");
            self.queued[a].insert(new);
        }
        self.refresh_windows();
        prop_assert!(s.counters().balanced());
        prop_assert_eq!(s.counters().queued, self.total_queued() as u64);
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// While two edges both have frames queued, each gets frames in
    /// proportion to its weight within two frames' worth, so neither is
    /// starved whatever the other sends; a frame is refused for a full
    /// queue only when its edge holds its weighted share, and a frame is
    /// pushed out only from an edge over its share.
    #[test]
    fn edges_share_the_queue_and_the_workers_by_weight(
        steps in prop::collection::vec(share_step(), 1..300),
        weights in prop::collection::vec(1u32..5, ACCOUNTS),
        max_queued in 4usize..32,
        max_queued_per_edge in 2usize..32,
        pipeline_depth in 1usize..3,
    ) {
        let limits = Settings {
            max_queued,
            max_queued_per_edge,
            default_latency_us: 10_000,
            pipeline_depth,
            stall_us: 600_000_000,
            health: HealthPolicy::default(),
        };
        let mut s = Scheduler::new(limits);
        let mut w = Shares {
            now: 0,
            limits,
            weights: weights.clone(),
            account_of: HashMap::new(),
            queued: vec![HashSet::new(); ACCOUNTS],
            completed: HashSet::new(),
            batches: Vec::new(),
            windows: BTreeMap::new(),
        };
        for (a, weight) in weights.iter().enumerate() {
            for k in 0..3 {
                w.apply(&mut s, Event::EdgeJoined {
                    edge: EdgeId((a * 10 + k) as u64),
                    name: format!("edge-{a}"),
                    weight: *weight,
                }, None)?;
            }
        }
        let mut next_frame = 0;
        let mut next_worker = 0;
        for st in steps {
            match st {
                Share::Arrive { account, conn, camera, budget_ms } => {
                    let id = FrameId(next_frame);
                    next_frame += 1;
                    let a = account as usize;
                    w.account_of.insert(id, a);
                    let arrival = Arrival {
                        id,
                        edge: EdgeId((a * 10 + conn as usize) as u64),
                        camera: format!("c{camera}"),
                        model: "m".into(),
                        deadline: w.now + u64::from(budget_ms) * 1000,
                        age: 0,
                    };
                    w.apply(&mut s, Event::FrameArrived(arrival), Some((id, a)))?;
                }
                Share::Join { max_batch, latency_us } => {
                    next_worker += 1;
                    w.apply(&mut s, worker_joined(next_worker, max_batch, latency_us), None)?;
                }
                Share::Finish { pick } => {
                    if w.batches.is_empty() {
                        continue;
                    }
                    let (worker, batch, frames) = w.batches.remove(pick as usize % w.batches.len());
                    let outcomes = frames.iter().map(|f| (*f, Status::Ok)).collect();
                    w.apply(&mut s, Event::BatchFinished { worker, batch, outcomes }, None)?;
                }
                Share::Advance { us } => {
                    w.now += u64::from(us);
                    w.apply(&mut s, Event::Tick, None)?;
                }
            }
        }
    }
}

#[derive(Debug, Clone)]
enum Churn {
    Arrive {
        slot: u8,
        camera: u8,
        budget_us: u32,
    },
    /// A frame of the slot's last gone connection, trailing its close.
    Trail {
        slot: u8,
    },
    /// The slot's connection closes and a new one joins under its name.
    Reconnect {
        slot: u8,
        weight: u32,
    },
    Join {
        max_batch: u16,
        latency_us: u32,
    },
    Lose {
        pick: u8,
    },
    Finish {
        pick: u8,
    },
    Advance {
        us: u32,
    },
}

fn churn_step() -> impl Strategy<Value = Churn> {
    prop_oneof![
        6 => (0u8..4, 0u8..4, prop_oneof![1_000u32..200_000, Just(u32::MAX)]).prop_map(
            |(slot, camera, budget_us)| Churn::Arrive { slot, camera, budget_us }
        ),
        1 => (0u8..4).prop_map(|slot| Churn::Trail { slot }),
        1 => (0u8..4, 1u32..4).prop_map(|(slot, weight)| Churn::Reconnect { slot, weight }),
        1 => (1u16..9, 500u32..40_000)
            .prop_map(|(max_batch, latency_us)| Churn::Join { max_batch, latency_us }),
        1 => any::<u8>().prop_map(|pick| Churn::Lose { pick }),
        4 => any::<u8>().prop_map(|pick| Churn::Finish { pick }),
        3 => (0u32..50_000).prop_map(|us| Churn::Advance { us }),
    ]
}

/// What the churn test remembers.
#[derive(Default)]
struct Churned {
    now: Micros,
    edge_of: HashMap<FrameId, EdgeId>,
    completed: HashSet<FrameId>,
    gone: HashSet<EdgeId>,
    batches: Vec<(WorkerId, BatchId, Vec<FrameId>)>,
}

impl Churned {
    fn apply(&mut self, s: &mut Scheduler, event: Event) -> Result<(), TestCaseError> {
        let closing = match &event {
            Event::EdgeGone { edge } => Some(*edge),
            _ => None,
        };
        let arriving_from = match &event {
            Event::FrameArrived(a) => Some((a.id, a.edge)),
            _ => None,
        };
        for action in s.on_event(self.now, event) {
            match action {
                Action::Dispatch {
                    worker,
                    batch,
                    frames,
                    ..
                } => {
                    for f in &frames {
                        prop_assert!(
                            !self.gone.contains(&self.edge_of[f]),
                            "dispatched {:?} of a gone connection",
                            f
                        );
                    }
                    self.batches.push((worker, batch, frames));
                }
                Action::Complete { frame, status, .. } => {
                    prop_assert!(self.completed.insert(frame), "{:?} ended twice", frame);
                    let edge = self.edge_of[&frame];
                    if status == Status::Shed(ShedReason::EdgeGone) {
                        prop_assert!(
                            closing == Some(edge) || self.gone.contains(&edge),
                            "{:?} dropped as edge_gone, its connection still open",
                            frame
                        );
                    }
                    if let Some((id, from)) = arriving_from
                        && id == frame
                        && self.gone.contains(&from)
                    {
                        prop_assert_eq!(status, Status::Shed(ShedReason::EdgeGone));
                    }
                }
                _ => {}
            }
        }
        if let Some(edge) = closing {
            self.gone.insert(edge);
        }
        prop_assert!(s.counters().balanced(), "{:?}", s.counters());
        prop_assert_eq!(
            s.counters().ok + s.counters().shed + s.counters().expired + s.counters().failed,
            self.completed.len() as u64
        );
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Connections come and go under shared edge names while workers join,
    /// fail and answer: every admitted frame ends exactly once, no frame of
    /// a gone connection is dispatched after it went (those queued, lost
    /// with a worker, or trailing it end `edge_gone`), and budgets up to
    /// `u32::MAX` change nothing of that.
    #[test]
    fn a_gone_connections_frames_are_never_dispatched_and_every_frame_ends_once(
        steps in prop::collection::vec(churn_step(), 1..250),
    ) {
        let mut s = Scheduler::new(Settings {
            max_queued: 24,
            max_queued_per_edge: 8,
            default_latency_us: 10_000,
            pipeline_depth: 2,
            stall_us: 1_000_000,
            health: HealthPolicy::default(),
        });
        let mut w = Churned::default();
        // Slots 0 and 1 are connections of edge "a", 2 and 3 of "b".
        let mut conn: Vec<EdgeId> = (0..4).map(EdgeId).collect();
        let mut last_gone: Vec<Option<EdgeId>> = vec![None; 4];
        let mut next_edge = 4;
        for (slot, edge) in conn.iter().enumerate() {
            let name = if slot < 2 { "a" } else { "b" };
            w.apply(&mut s, Event::EdgeJoined { edge: *edge, name: name.into(), weight: 1 })?;
        }
        let mut workers: Vec<WorkerId> = Vec::new();
        let mut next = 0u64;
        for st in steps {
            match st {
                Churn::Arrive { slot, camera, budget_us } => {
                    next += 1;
                    let edge = conn[slot as usize];
                    w.edge_of.insert(FrameId(next), edge);
                    w.apply(&mut s, Event::FrameArrived(Arrival {
                        id: FrameId(next),
                        edge,
                        camera: format!("c{camera}"),
                        model: "m".into(),
                        deadline: w.now.saturating_add(u64::from(budget_us)),
                        age: 0,
                    }))?;
                }
                Churn::Trail { slot } => {
                    let Some(edge) = last_gone[slot as usize] else {
                        continue;
                    };
                    next += 1;
                    w.edge_of.insert(FrameId(next), edge);
                    w.apply(&mut s, Event::FrameArrived(Arrival {
                        id: FrameId(next),
                        edge,
                        camera: "late".into(),
                        model: "m".into(),
                        deadline: w.now + 1_000_000,
                        age: 0,
                    }))?;
                }
                Churn::Reconnect { slot, weight } => {
                    let old = conn[slot as usize];
                    w.apply(&mut s, Event::EdgeGone { edge: old })?;
                    last_gone[slot as usize] = Some(old);
                    let edge = EdgeId(next_edge);
                    next_edge += 1;
                    conn[slot as usize] = edge;
                    let name = if slot < 2 { "a" } else { "b" };
                    w.apply(&mut s, Event::EdgeJoined { edge, name: name.into(), weight })?;
                }
                Churn::Join { max_batch, latency_us } => {
                    next += 1;
                    workers.push(WorkerId(next));
                    w.apply(&mut s, worker_joined(next, max_batch, latency_us))?;
                }
                Churn::Lose { pick } => {
                    if workers.is_empty() {
                        continue;
                    }
                    let id = workers.remove(pick as usize % workers.len());
                    w.batches.retain(|(wk, _, _)| *wk != id);
                    w.apply(&mut s, Event::WorkerLost { worker: id })?;
                }
                Churn::Finish { pick } => {
                    if w.batches.is_empty() {
                        continue;
                    }
                    let (worker, batch, frames) = w.batches.remove(pick as usize % w.batches.len());
                    let outcomes = frames.iter().map(|f| (*f, Status::Ok)).collect();
                    w.apply(&mut s, Event::BatchFinished { worker, batch, outcomes })?;
                }
                Churn::Advance { us } => {
                    w.now += u64::from(us);
                    w.apply(&mut s, Event::Tick)?;
                }
            }
        }
        // Every connection goes, every batch returns, every worker leaves.
        for edge in conn {
            w.apply(&mut s, Event::EdgeGone { edge })?;
        }
        prop_assert_eq!(s.counters().queued, 0, "queued frames outlived their edges");
        while let Some((worker, batch, frames)) = w.batches.pop() {
            let outcomes = frames.iter().map(|f| (*f, Status::Ok)).collect();
            w.apply(&mut s, Event::BatchFinished { worker, batch, outcomes })?;
        }
        for id in workers {
            w.apply(&mut s, Event::WorkerLost { worker: id })?;
        }
        prop_assert_eq!(s.counters().in_flight(), 0);
        prop_assert_eq!(w.completed.len(), w.edge_of.len(), "a frame was lost");
    }
}
