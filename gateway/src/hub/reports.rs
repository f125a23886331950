//! What the hub reports: the load report the lease shell asks for each
//! tick, and the snapshot the HTTP API is built from.

use std::collections::HashMap;

use tidegate_lease::LeaseId;

use super::state::State;
use super::{
    CameraView, EdgeView, LeasedWorker, LoadReport, ModelLoadReport, ModelView, Served, Snapshot,
    UsageReport, WorkerView,
};

impl State {
    pub(super) fn load_report(&mut self, models: Vec<String>) -> LoadReport {
        let now = self.now();
        let models = models
            .into_iter()
            .map(|model| {
                let mut lat = self.latencies.remove(&model).unwrap_or_default();
                lat.sort_by(f64::total_cmp);
                let p95_ms = match lat.len() {
                    0 => 0.0,
                    n => lat[((n as f64 * 0.95).ceil() as usize).clamp(1, n) - 1],
                };
                ModelLoadReport {
                    arrival_fps: self.scheduler.arrival_rate(&model, now),
                    queue_depth: self.scheduler.queue_len(&model) as u64,
                    p95_ms,
                    budget_ms: self.budget_ms(&model),
                    model,
                }
            })
            .collect();
        self.latencies.clear();
        let mut workers: Vec<LeasedWorker> = self
            .workers
            .iter()
            .filter_map(|(id, w)| {
                Some(LeasedWorker {
                    lease: self.roster.lease(*id)?,
                    profile: w
                        .register
                        .profile
                        .iter()
                        .map(|p| (p.model.clone(), p.batch, p.latency_us))
                        .collect(),
                })
            })
            .collect();
        workers.sort_by_key(|w| w.lease);
        let mut served: Vec<(LeaseId, Served)> = self.served.drain().collect();
        served.sort_by_key(|(l, _)| *l);
        let mut usage: Vec<UsageReport> = self
            .usage
            .drain()
            .flat_map(|((lease, edge), models)| {
                models.into_iter().map(move |(model, usage)| UsageReport {
                    lease,
                    edge: edge.to_string(),
                    model,
                    usage,
                })
            })
            .collect();
        usage.sort_by(|a, b| (a.lease, &a.edge, &a.model).cmp(&(b.lease, &b.edge, &b.model)));
        LoadReport {
            models,
            workers,
            served,
            usage,
            stalled: std::mem::take(&mut self.stalled_leases)
                .into_iter()
                .collect(),
        }
    }

    pub(super) fn snapshot(&self) -> Snapshot {
        let now = self.now();
        let mut models: HashMap<&str, ModelView> = HashMap::new();
        for (id, w) in &self.workers {
            let serving = !self.roster.get(*id).is_some_and(|m| m.unbound());
            for m in &w.register.models {
                let v = models.entry(m.name.as_str()).or_insert_with(|| ModelView {
                    name: m.name.clone(),
                    version: m.version,
                    input: m.input,
                    max_batch: 0,
                    queued: self.scheduler.queue_len(&m.name),
                    workers: 0,
                    labels: m.labels.clone(),
                    budget_ms: self.budget_ms(&m.name),
                });
                v.max_batch = v.max_batch.max(m.max_batch);
                if serving {
                    v.workers += 1;
                }
            }
        }
        let mut snap = Snapshot {
            frames: self.scheduler.counters(),
            edges: self
                .edges
                .iter()
                .map(|(id, e)| EdgeView {
                    id: id.0,
                    name: e.name.to_string(),
                })
                .collect(),
            cameras: self
                .edges
                .iter()
                .flat_map(|(id, e)| {
                    e.cameras.iter().map(|(c, (m, _))| CameraView {
                        session: id.0,
                        edge: e.name.to_string(),
                        camera: c.clone(),
                        model: m.clone(),
                        load: self.backpressure.as_ref().and_then(|bp| bp.load(*id, c)),
                    })
                })
                .collect(),
            workers: self
                .workers
                .iter()
                .map(|(id, w)| {
                    let member = self.roster.get(*id);
                    WorkerView {
                        id: id.0,
                        name: w.register.worker.clone(),
                        device: w.register.device.clone(),
                        models: w.register.models.iter().map(|m| m.name.clone()).collect(),
                        profile: w.register.profile.clone(),
                        estimate: w
                            .register
                            .profile
                            .iter()
                            .map(|p| tidegate_protocol::ProfilePoint {
                                latency_us: self
                                    .scheduler
                                    .latency_estimate_us(now, *id, &p.model, p.batch)
                                    .map_or(p.latency_us, |us| {
                                        u32::try_from(us).unwrap_or(u32::MAX)
                                    }),
                                ..p.clone()
                            })
                            .collect(),
                        draining: member.is_some_and(|m| !m.state.takes_batches()),
                        demoted: self.scheduler.is_demoted(*id),
                        lease: member.and_then(|m| m.state.lease()).map(|l| l.0),
                        unbound: member.is_some_and(|m| m.unbound()),
                    }
                })
                .collect(),
            models: models.into_values().collect(),
            timeline: self.timeline.view(now),
        };
        snap.edges.sort_by_key(|e| e.id);
        snap.workers.sort_by_key(|w| w.id);
        snap.cameras
            .sort_by(|a, b| (&a.edge, a.session, &a.camera).cmp(&(&b.edge, b.session, &b.camera)));
        snap.models.sort_by(|a, b| a.name.cmp(&b.name));
        snap
    }
}
