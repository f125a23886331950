//! The edge side of the hub: edges leaving, frames arriving, latency
//! reports, frame-rate hints, thumbnails, and the budget a model's
//! frames are held to.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tidegate_protocol::{ControlHint, Frame};

use super::state::{EdgeEntry, GONE_EDGES_KEPT, LATENCY_SAMPLES, Pending, State};
use crate::scheduler::{Arrival, EdgeId, Event, FrameId};

impl State {
    pub(super) fn send_hints(&mut self) {
        let now = self.now();
        let Some(bp) = self.backpressure.as_mut() else {
            return;
        };
        for h in bp.tick(now) {
            let direction = if h.max_fps == 0.0 { "lift" } else { "set" };
            let Some(edge) = self.edges.get(&h.edge) else {
                continue;
            };
            // Back-pressure counts only frames lost to the workers'
            // capacity: never those whose link ate their time.
            tracing::info!(
                edge = %edge.name,
                camera = %h.camera,
                max_fps = h.max_fps,
                "frame-rate hint: frames lost to the workers' capacity"
            );
            let hint = ControlHint {
                camera: h.camera,
                max_fps: h.max_fps,
                motion_threshold: 0.0,
            };
            edge.hints.post(hint);
            self.metrics.hints.with_label_values(&[direction]).inc();
        }
    }

    /// An edge's connection closed: its queued frames are dropped and it is forgotten.
    pub(super) fn edge_gone(&mut self, edge: EdgeId) {
        // Its queued frames are dropped (`edge_gone`, counted), and
        // so are its frames that trail this message; those on a
        // worker still finish, and their results are counted
        // undeliverable when they complete.
        let before = self.scheduler.counters().shed;
        self.step(Event::EdgeGone { edge });
        let c = self.scheduler.counters();
        // What was on the workers, and what had ended, as it went:
        // no more than the first of its frames can end after.
        tracing::info!(
            edge = edge.0,
            dropped = c.shed - before,
            on_workers = c.dispatched,
            ended = c.ok + c.failed + c.expired,
            "edge connection gone; its queued frames dropped"
        );
        if let Some(gone) = self.edges.remove(&edge) {
            self.forget_thumbnails(&gone);
            if self.gone_edges.len() >= GONE_EDGES_KEPT {
                self.gone_edges.pop_front();
            }
            self.gone_edges.push_back((edge, gone.name));
        }
        if let Some(bp) = self.backpressure.as_mut() {
            bp.forget_edge(edge);
        }
        self.metrics.edges_connected.set(self.edges.len() as i64);
    }

    /// A frame read from an edge: admitted, tracked until it completes, and handed to the scheduler.
    pub(super) fn frame_arrived(
        &mut self,
        edge: EdgeId,
        frame: Frame,
        deadline: Instant,
        age: Duration,
    ) {
        let id = FrameId(self.next_frame);
        self.next_frame += 1;
        let deadline = self.at(deadline);
        let arrival = Arrival {
            id,
            edge,
            camera: frame.camera.clone(),
            model: frame.model.clone(),
            deadline,
            age: u64::try_from(age.as_micros()).unwrap_or(u64::MAX),
        };
        let now = self.now();
        // A frame can trail its edge's EdgeGone (separate tasks):
        // it is still admitted and accounted, but tracking its
        // camera for hints would outlive the edge.
        if let Some(bp) = self.backpressure.as_mut()
            && self.edges.contains_key(&edge)
        {
            bp.on_arrival(now, edge, &frame.camera);
        }
        if self.budgets.get(&frame.model) != Some(&frame.budget_us) {
            self.budgets.insert(frame.model.clone(), frame.budget_us);
        }
        let edge_name = match self.edges.get(&edge) {
            Some(e) => e.name.clone(),
            // it trails its edge's EdgeGone
            None => self
                .gone_edges
                .iter()
                .rev()
                .find(|(id, _)| *id == edge)
                .map_or_else(|| Arc::from(""), |(_, name)| name.clone()),
        };
        self.timeline.arrival(now, &edge_name, &frame.camera);
        self.pending.insert(
            id,
            Pending {
                edge,
                edge_name,
                frame,
                deadline,
                served_by: None,
                busy_us: 0,
            },
        );
        self.step(Event::FrameArrived(arrival));
    }

    /// An edge reported a frame's capture-to-result latency.
    pub(super) fn latency_reported(&mut self, model: String, e2e: Duration) {
        let now = self.now();
        self.timeline.latency(now, e2e.as_secs_f64() * 1e3);
        let samples = self.latencies.entry(model.clone()).or_default();
        if samples.len() < LATENCY_SAMPLES {
            samples.push(e2e.as_secs_f64() * 1e3);
        }
        self.metrics
            .e2e_latency
            .with_label_values(&[model.as_str()])
            .observe(e2e.as_secs_f64());
    }

    /// Starts a thumbnail of a frame served `ok`, on a blocking task, if
    /// its camera is open and due for one (at most one per interval, and
    /// one under way) and thumbnails are on.
    pub(super) fn thumbnail(&self, p: &Pending, detections: &[tidegate_protocol::Detection]) {
        // A frame trailing its edge's EdgeGone would make a thumbnail
        // nobody forgets.
        let open = self
            .edges
            .get(&p.edge)
            .is_some_and(|e| e.cameras.contains_key(&p.frame.camera));
        if !open {
            return;
        }
        let Some(ticket) = self
            .thumbnails
            .begin(&p.edge_name, &p.frame.camera, Instant::now())
        else {
            return;
        };
        let store = self.thumbnails.clone();
        let (tensor, geometry) = (p.frame.tensor.clone(), p.frame.geometry);
        let detections = detections.to_vec();
        let (edge, camera) = (p.edge_name.clone(), p.frame.camera.clone());
        let counted = self.metrics.thumbnails.clone();
        self.tracker.spawn_blocking(move || {
            let jpeg = crate::thumbnail::render(&tensor, &geometry, &detections, ticket.max_px);
            let result = if jpeg.is_ok() { "rendered" } else { "refused" };
            counted.with_label_values(&[result]).inc();
            if let Some(e) = store.finish(ticket, jpeg) {
                tracing::warn!(edge = %edge, camera = %camera, "no thumbnail: {e}");
            }
        });
    }

    /// Drops the thumbnails of a gone connection's cameras, except those
    /// that another connection of its edge still has open.
    fn forget_thumbnails(&self, gone: &EdgeEntry) {
        for camera in gone.cameras.keys() {
            let still_open = self
                .edges
                .values()
                .any(|e| e.name == gone.name && e.cameras.contains_key(camera));
            if !still_open {
                self.thumbnails.forget(&gone.name, camera);
            }
        }
    }

    /// The budget `model`'s frames are held to (ms): the strictest its open
    /// cameras declared; else the latest frame's (its whole budget, counted
    /// from capture since protocol version 3); 0 when neither is known.
    pub(super) fn budget_ms(&self, model: &str) -> f64 {
        let declared = self
            .edges
            .values()
            .flat_map(|e| e.cameras.values())
            .filter(|(m, b)| m == model && *b > 0)
            .map(|(_, b)| *b)
            .min();
        match declared {
            Some(ms) => f64::from(ms),
            None => self.budgets.get(model).map_or(0.0, |b| *b as f64 / 1e3),
        }
    }
}
