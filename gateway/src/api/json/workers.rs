//! Registered workers and their latency profiles (`GET /api/v1/workers`),
//! and what draining one answers.

use serde::Serialize;
use utoipa::ToSchema;

use crate::hub::{Snapshot, WorkerView};

/// One point of a worker's measured latency profile.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct ProfilePoint {
    /// Model.
    pub model: String,
    /// Batch size.
    pub batch: u16,
    /// Latency of one run of that batch (µs).
    pub latency_us: u32,
}

impl From<&tidegate_protocol::ProfilePoint> for ProfilePoint {
    fn from(p: &tidegate_protocol::ProfilePoint) -> Self {
        ProfilePoint {
            model: p.model.clone(),
            batch: p.batch,
            latency_us: p.latency_us,
        }
    }
}

/// A registered worker.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct Worker {
    /// Its connection's number.
    pub session: u64,
    /// Its registered name (a leased worker's is `lease-<id>`).
    pub name: String,
    /// Its device (`cpu`, `cuda:0`, …).
    pub device: String,
    /// Models it serves.
    pub models: Vec<String>,
    /// Measured latency per model and batch size, as the worker registered
    /// it.
    pub profile: Vec<ProfilePoint>,
    /// What the scheduler expects each of `profile`'s batches to take now:
    /// refined by the batches the worker returned (one slow batch counts
    /// at most 3 times the estimate) and relaxed back towards `profile`
    /// while it runs nothing.
    pub estimate: Vec<ProfilePoint>,
    /// Takes no new batch (it is draining, or an unbound static worker).
    pub draining: bool,
    /// Demoted for failing its frames: it gets only probe batches until
    /// one succeeds.
    pub demoted: bool,
    /// The lease it serves (its id), if any.
    pub lease: Option<u64>,
    /// A static worker bound to no lease: connected and registered, it
    /// waits (no batch) until the autoscaler binds it.
    pub unbound: bool,
}

impl From<&WorkerView> for Worker {
    fn from(w: &WorkerView) -> Self {
        let WorkerView {
            id,
            name,
            device,
            models,
            profile,
            estimate,
            draining,
            demoted,
            lease,
            unbound,
        } = w;
        Worker {
            session: *id,
            name: name.clone(),
            device: device.clone(),
            models: models.clone(),
            profile: profile.iter().map(ProfilePoint::from).collect(),
            estimate: estimate.iter().map(ProfilePoint::from).collect(),
            draining: *draining,
            demoted: *demoted,
            lease: *lease,
            unbound: *unbound,
        }
    }
}

/// Registered workers, by session.
pub fn workers(s: &Snapshot) -> Vec<Worker> {
    s.workers.iter().map(Worker::from).collect()
}

/// `POST /api/v1/workers/{name}/drain` accepted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct Draining {
    /// The worker's registered name.
    pub worker: String,
    /// Its connections told to drain.
    pub draining: usize,
}
