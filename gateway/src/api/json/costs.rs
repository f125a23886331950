//! What the leases cost in a range, and its split by tier, instance type,
//! edge and model (`GET /api/v1/costs`).

use serde::Serialize;
use utoipa::ToSchema;

use tidegate_lease::Money;
use tidegate_lease::ledger::CostReport;
use tidegate_lease::showback::Share;

use super::Timestamp;

/// Cost by tier.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct TierCost {
    /// `on_demand`, `spot` or `reserved`.
    pub tier: String,
    /// Charged in the range (currency units).
    pub cost: f64,
}

/// Cost by instance type.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct InstanceTypeCost {
    /// Instance type.
    pub instance_type: String,
    /// Charged in the range (currency units).
    pub cost: f64,
}

/// One edge's share of the range's cost.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct EdgeCost {
    /// The edge's configured name.
    pub edge: String,
    /// Its share of the leases' cost (currency units).
    pub cost: f64,
    /// Frames served within the SLO.
    pub frames_within_slo: u64,
    /// Frames served late or failed.
    pub frames_late: u64,
    /// Worker time its frames took (s).
    pub busy_s: f64,
    /// `cost` per 1000 frames within the SLO (`null` without such frames).
    pub cost_per_1k_within_slo: Option<f64>,
}

/// One model's share of the range's cost.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct ModelCost {
    /// The model.
    pub model: String,
    /// Its share of the leases' cost (currency units).
    pub cost: f64,
    /// Frames served within the SLO.
    pub frames_within_slo: u64,
    /// Frames served late or failed.
    pub frames_late: u64,
    /// Worker time its frames took (s).
    pub busy_s: f64,
    /// `cost` per 1000 frames within the SLO (`null` without such frames).
    pub cost_per_1k_within_slo: Option<f64>,
}

/// A share's fields: cost, frames within the SLO, frames late, busy
/// seconds, cost per 1000.
fn share(s: &Share) -> (f64, u64, u64, f64, Option<f64>) {
    let Share {
        cost,
        frames_within_slo,
        frames_late,
        busy_seconds,
        cost_per_1k_within_slo,
    } = s;
    (
        cost.units(),
        *frames_within_slo,
        *frames_late,
        *busy_seconds,
        *cost_per_1k_within_slo,
    )
}

/// What the leases cost in a range (`GET /api/v1/costs`).
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct Costs {
    /// Range start (inclusive).
    pub from_at: Timestamp,
    /// Range end (exclusive).
    pub to_at: Timestamp,
    /// Currency of every amount (`null` before any lease).
    pub currency: Option<String>,
    /// Total charged in the range (currency units).
    pub total: f64,
    /// By tier.
    pub by_tier: Vec<TierCost>,
    /// By instance type.
    pub by_instance_type: Vec<InstanceTypeCost>,
    /// Frames served within the SLO in hours starting in the range.
    pub frames_within_slo: u64,
    /// Frames served late in those hours.
    pub frames_late: u64,
    /// Cost per 1000 frames served within the SLO (`null` without frames).
    pub cost_per_1k_within_slo: Option<f64>,
    /// The cost split among the edges each lease served, by the worker
    /// time their frames took, by edge name.
    pub by_edge: Vec<EdgeCost>,
    /// The same split among models, by name.
    pub by_model: Vec<ModelCost>,
    /// Cost of leases that served no frame in the range (in neither split).
    pub idle: f64,
}

impl From<&CostReport> for Costs {
    fn from(r: &CostReport) -> Self {
        let CostReport {
            from,
            to,
            currency,
            total,
            by_tier,
            by_type,
            frames_within_slo,
            frames_late,
            cost_per_1k_within_slo,
            by_edge,
            by_model,
            idle,
        } = r;
        let units = |m: &Money| m.units();
        Costs {
            from_at: Timestamp(*from),
            to_at: Timestamp(*to),
            currency: currency.clone(),
            total: total.units(),
            by_tier: by_tier
                .iter()
                .map(|(tier, cost)| TierCost {
                    tier: tier.as_str().into(),
                    cost: units(cost),
                })
                .collect(),
            by_instance_type: by_type
                .iter()
                .map(|(instance_type, cost)| InstanceTypeCost {
                    instance_type: instance_type.clone(),
                    cost: units(cost),
                })
                .collect(),
            frames_within_slo: *frames_within_slo,
            frames_late: *frames_late,
            cost_per_1k_within_slo: *cost_per_1k_within_slo,
            by_edge: by_edge
                .iter()
                .map(|(edge, s)| {
                    let (cost, within, late, busy_s, per_1k) = share(s);
                    EdgeCost {
                        edge: edge.clone(),
                        cost,
                        frames_within_slo: within,
                        frames_late: late,
                        busy_s,
                        cost_per_1k_within_slo: per_1k,
                    }
                })
                .collect(),
            by_model: by_model
                .iter()
                .map(|(model, s)| {
                    let (cost, within, late, busy_s, per_1k) = share(s);
                    ModelCost {
                        model: model.clone(),
                        cost,
                        frames_within_slo: within,
                        frames_late: late,
                        busy_s,
                        cost_per_1k_within_slo: per_1k,
                    }
                })
                .collect(),
            idle: idle.units(),
        }
    }
}
