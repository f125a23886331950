//! The queueing model of each model of the trace ([`crate::queue`]), step
//! by step, and what it measured per tick and over the run. It serves the
//! fleet it is given; which leases serve is the run's to decide.

use std::collections::BTreeMap;

use super::TickServing;
use crate::billing::Millis;
use crate::queue::{BatchCost, LatencyHistogram, ModelQueue, QueueConfig, QueueError, StepOutcome};

/// The queueing model of each model of the trace, and what it measured.
#[derive(Debug)]
pub(super) struct Serving {
    queues: BTreeMap<String, ModelQueue>,
    /// Frames per model since the last tick.
    tick: BTreeMap<String, TickCounts>,
    /// Latency of every frame served, all models.
    pub(super) run: LatencyHistogram,
    pub(super) worst_tick_p95_ms: Option<f64>,
    /// GPU-ms spent running batches.
    pub(super) running_ms: f64,
    pub(super) ticks: Vec<TickServing>,
}

#[derive(Debug, Clone, Copy, Default)]
struct TickCounts {
    arrived: u64,
    within_slo: u64,
    late: u64,
    shed: u64,
}

/// What one model's tick showed the autoscaler.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct TickSeen {
    pub(super) arrived: u64,
    pub(super) queue_depth: u64,
    pub(super) p95_ms: Option<f64>,
}

impl Serving {
    /// One queue per model, each seeded from `seed` and its place.
    pub(super) fn new(
        cfg: &QueueConfig,
        models: &[String],
        seed: u64,
    ) -> Result<Serving, QueueError> {
        let mut queues = BTreeMap::new();
        for (k, m) in models.iter().enumerate() {
            let seed = seed ^ 0x51AB_0000_0000_0001u64.wrapping_mul(k as u64 + 1);
            queues.insert(m.clone(), ModelQueue::new(cfg.clone(), 0, seed)?);
        }
        Ok(Serving {
            queues,
            tick: BTreeMap::new(),
            run: LatencyHistogram::new(),
            worst_tick_p95_ms: None,
            running_ms: 0.0,
            ticks: Vec::new(),
        })
    }

    /// One step of `model` on `fleet` (see `Run::serve`).
    pub(super) fn step(
        &mut self,
        model: &str,
        fleet: &[(&str, BatchCost, u64)],
        step: Option<(Millis, u64)>,
    ) -> Option<StepOutcome> {
        let q = self.queues.get_mut(model)?;
        q.set_fleet(fleet);
        let out = match step {
            Some((until, arrivals)) => q.advance(until * 1000, arrivals),
            None => q.drain(),
        };
        if !self.tick.contains_key(model) {
            self.tick.insert(model.to_string(), TickCounts::default());
        }
        if let Some(t) = self.tick.get_mut(model) {
            t.arrived += out.arrived;
            t.within_slo += out.within_slo;
            t.late += out.late;
            t.shed += out.shed;
        }
        Some(out)
    }

    /// Ends `model`'s tick at `now`: its counts, queue and latencies.
    pub(super) fn close_tick(&mut self, now: Millis, model: &str, record: bool) -> TickSeen {
        let counts = self.tick.remove(model).unwrap_or_default();
        let Some(q) = self.queues.get_mut(model) else {
            return TickSeen::default();
        };
        let h = q.take_tick_latency();
        self.run.merge(&h);
        let p95_ms = h.quantile_ms(0.95);
        if let Some(p) = p95_ms {
            self.worst_tick_p95_ms = Some(self.worst_tick_p95_ms.map_or(p, |w| w.max(p)));
        }
        let queue_depth = q.queued();
        if record {
            self.ticks.push(TickServing {
                at: now,
                model: model.to_string(),
                arrived: counts.arrived,
                within_slo: counts.within_slo,
                late: counts.late,
                shed: counts.shed,
                queue_depth,
                p95_ms,
                p99_ms: h.quantile_ms(0.99),
            });
        }
        TickSeen {
            arrived: counts.arrived,
            queue_depth,
            p95_ms,
        }
    }
}
