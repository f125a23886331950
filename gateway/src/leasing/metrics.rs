//! What the workers did and what the leases cost, outward: frames and
//! usage served per lease into the ledger, profiles into measured
//! throughput (the autoscaler's [`ModelLoad`]), and the leasing metrics
//! (`tidegate_leases`, `tidegate_cost_total`, cost per 1k frames, GPU
//! utilisation) from the table and the ledger. It decides nothing.

use tidegate_lease::autoscale::{self, ModelLoad};
use tidegate_lease::{LeaseId, LeaseState, Millis};
use tracing::warn;

use super::shell::Shell;
use super::{DEFAULT_BUDGET_MS, LeaseSource, NETWORK_MS};
use crate::hub::LoadReport;

impl<P: LeaseSource> Shell<P> {
    /// Frames served per lease into the ledger; profiles into throughput.
    pub(super) fn record(&mut self, now: Millis, report: &LoadReport) {
        let mono = self.mono();
        if !report.workers.is_empty() && self.book.seen_due(mono) {
            let ids: Vec<LeaseId> = report.workers.iter().map(|w| w.lease).collect();
            match self.ledger.mark_seen(&ids, now) {
                Ok(()) => self.book.seen_written(mono),
                Err(e) => warn!("recording which workers are connected: {e}"),
            }
        }
        for (lease, s) in &report.served {
            self.busy_ms += s.busy_us as f64 / 1e3;
            self.metrics.leased_busy.inc_by(s.busy_us as f64 / 1e6);
            let frames = &self.metrics.lease_frames;
            frames
                .with_label_values(&["within_slo"])
                .inc_by(s.within_slo);
            frames.with_label_values(&["late"]).inc_by(s.late);
            if (s.within_slo > 0 || s.late > 0)
                && let Err(e) = self.ledger.record_frames(*lease, now, s.within_slo, s.late)
            {
                warn!(%lease, "recording frames: {e}");
            }
        }
        for u in &report.usage {
            if let Err(e) = self
                .ledger
                .record_usage(u.lease, now, &u.edge, &u.model, u.usage)
            {
                warn!(lease = %u.lease, edge = %u.edge, "recording usage: {e}");
            }
        }
        for w in &report.workers {
            let Some(entry) = self.table.get(w.lease) else {
                continue;
            };
            for m in &report.models {
                let points: Vec<(u16, u32)> = w
                    .profile
                    .iter()
                    .filter(|p| p.0 == m.model)
                    .map(|p| (p.1, p.2))
                    .collect();
                let budget = if m.budget_ms > 0.0 {
                    m.budget_ms
                } else {
                    DEFAULT_BUDGET_MS
                };
                let batch_budget_us = ((budget - NETWORK_MS).max(1.0) / 2.0 * 1e3) as u32;
                let fps = autoscale::throughput_from_profile(&points, batch_budget_us);
                if fps > 0.0 {
                    self.measured
                        .insert((m.model.clone(), entry.instance_type.clone()), fps);
                }
            }
        }
    }

    /// Each scaled model's load, and its throughput per instance type:
    /// measured from the workers' profiles, or its configured `worker_fps`.
    pub(super) fn observe(&self, report: &LoadReport) -> Vec<ModelLoad> {
        self.models
            .iter()
            .map(|m| {
                let load = report.models.iter().find(|l| l.model == m.name);
                let throughput_fps = m
                    .instance_types
                    .iter()
                    .map(|t| {
                        let measured = self.measured.get(&(m.name.clone(), t.clone()));
                        let fps = match measured {
                            Some(f) if m.measure => *f,
                            _ => m.worker_fps,
                        };
                        (t.clone(), fps)
                    })
                    .collect();
                ModelLoad {
                    model: m.name.clone(),
                    arrival_fps: load.map_or(0.0, |l| l.arrival_fps),
                    queue_depth: load.map_or(0, |l| l.queue_depth),
                    p95_ms: load.map_or(0.0, |l| l.p95_ms),
                    budget_ms: load
                        .map(|l| l.budget_ms)
                        .filter(|b| *b > 0.0)
                        .unwrap_or(DEFAULT_BUDGET_MS),
                    throughput_fps,
                }
            })
            .collect()
    }

    /// The `tidegate_leases` gauges (the table's, and the acquisitions
    /// not answered yet as `requested`), the cost counters by tier, cost
    /// per 1k frames within the SLO, and GPU utilisation.
    pub(super) fn update_metrics(&mut self, now: Millis) {
        let m = &self.metrics;
        m.leases.reset();
        let mut counts = self.table.counts();
        // asked of the provider, not answered yet
        for a in self.book.acquiring() {
            let label = LeaseState::Requested.label();
            *counts
                .entry((a.instance.name.clone(), a.tier, label))
                .or_insert(0) += 1;
        }
        for ((ty, tier, state), n) in counts {
            m.leases
                .with_label_values(&[ty.as_str(), tier.as_str(), state])
                .set(n as i64);
        }
        if let Ok(by_tier) = self.ledger.cost_total_by_tier() {
            for (tier, cost) in by_tier {
                let seen = self.cost_seen.entry(tier).or_insert(0.0);
                let add = cost.units() - *seen;
                if add > 0.0 {
                    m.cost_total
                        .with_label_values(&[tier.as_str(), self.catalog.currency.as_str()])
                        .inc_by(add);
                    *seen = cost.units();
                }
            }
        }
        if let Ok(r) = self.ledger.cost_totals(0, now + 1)
            && let Some(c) = r.cost_per_1k_within_slo
        {
            m.cost_per_1k_within_slo.set(c);
        }
        if let Some(u) = tidegate_lease::metrics::gpu_utilization(self.busy_ms, self.leased_ms) {
            m.gpu_utilization.set(u);
        }
    }
}
