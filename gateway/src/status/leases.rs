//! The leasing panels: live leases with the time left in the block each
//! has paid for, what all leases cost, and the last day's cost by edge.

use serde::Serialize;
use utoipa::ToSchema;

use tidegate_lease::billing::{Granularity, paid_until};
use tidegate_lease::ledger::{CostReport, LeaseRecord};

use crate::api::json::Timestamp;

use super::format::{num, span, when};
use super::table::{Cell, table_html};

/// How far back the status page's cost by edge reaches: a day (the split
/// reads every usage row of the range).
pub const RECENT_MS: u64 = 24 * 3600 * 1000;

/// Leasing, when configured: the live leases, what all leases cost, and
/// the cap on what live leases may cost per hour.
#[derive(Debug, Clone, Copy)]
pub struct LeasingView<'a> {
    /// Leases not ended.
    pub live: &'a [LeaseRecord],
    /// Cost of every lease so far.
    pub costs: &'a CostReport,
    /// The last [`RECENT_MS`], split by edge.
    pub recent: &'a CostReport,
    /// `leasing.spend_cap_per_hour`, when set.
    pub spend_cap_per_hour: Option<f64>,
}

/// A live lease.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct LeaseRow {
    /// Its id (the number `POST /api/v1/leases/{id}/release` takes).
    pub id: u64,
    /// Provider.
    pub provider: String,
    /// Instance type.
    pub instance_type: String,
    /// `on_demand`, `spot` or `reserved`.
    #[schema(value_type = String)]
    pub tier: &'static str,
    /// Lifecycle state.
    #[schema(value_type = String)]
    pub state: &'static str,
    /// Price per hour (currency units).
    pub price_per_hour: f64,
    /// Currency.
    pub currency: String,
    /// `hour` or `second`.
    #[schema(value_type = String)]
    pub billing: &'static str,
    /// Billing start, once the provider accepted.
    pub billing_started_at: Option<Timestamp>,
    /// End of what is already paid for: releasing earlier saves nothing.
    pub paid_until_at: Option<Timestamp>,
    /// Time left in that block (ms); 0 once per-second billing is past its
    /// minimum.
    pub block_left_ms: Option<u64>,
    /// Cost so far (currency units).
    pub cost: f64,
}

/// One edge's share of the last day's cost.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct EdgeCostRow {
    /// The edge's configured name (`null`: leases that served nothing).
    pub edge: Option<String>,
    /// Cost (currency units).
    pub cost: f64,
    /// Frames answered `ok` within their deadline.
    pub frames_within_slo: u64,
    /// Frames answered otherwise.
    pub frames_late: u64,
    /// Worker time (s).
    pub busy_s: f64,
    /// Cost per 1000 frames within the SLO.
    pub cost_per_1k_within_slo: Option<f64>,
}

/// Leasing on the page.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct LeasingModel {
    /// Live leases, newest first.
    pub leases: Vec<LeaseRow>,
    /// Their summed hourly price: what the spend cap holds.
    pub spend_per_hour: f64,
    /// `leasing.spend_cap_per_hour`.
    pub spend_cap_per_hour: Option<f64>,
    /// Currency of the ledger.
    pub currency: String,
    /// Cost of every lease so far.
    pub total_cost: f64,
    /// Frames leased workers answered within the SLO, so far.
    pub frames_within_slo: u64,
    /// And otherwise.
    pub frames_late: u64,
    /// Cost per 1000 frames within the SLO, so far.
    pub cost_per_1k_within_slo: Option<f64>,
    /// The last day's cost by edge, and idle leases last.
    pub last_day_by_edge: Vec<EdgeCostRow>,
}

fn lease_row(r: &LeaseRecord, now_ms: u64) -> LeaseRow {
    let paid = r
        .billing_start
        .map(|s| paid_until(s, now_ms, r.granularity));
    LeaseRow {
        id: r.id.0,
        provider: r.provider.clone(),
        instance_type: r.instance_type.clone(),
        tier: r.tier.as_str(),
        state: r.state.label(),
        price_per_hour: r.price_per_hour.units(),
        currency: r.currency.clone(),
        billing: match r.granularity {
            Granularity::Hour => "hour",
            Granularity::Second { .. } => "second",
        },
        billing_started_at: r.billing_start.map(Timestamp),
        paid_until_at: paid.map(Timestamp),
        block_left_ms: paid.map(|p| p.saturating_sub(now_ms)),
        cost: r.cost.units(),
    }
}

pub(super) fn leasing_model(l: LeasingView<'_>, now_ms: u64) -> LeasingModel {
    let c = l.costs;
    let mut by_edge: Vec<EdgeCostRow> = l
        .recent
        .by_edge
        .iter()
        .map(|(edge, s)| EdgeCostRow {
            edge: Some(edge.clone()),
            cost: s.cost.units(),
            frames_within_slo: s.frames_within_slo,
            frames_late: s.frames_late,
            busy_s: s.busy_seconds,
            cost_per_1k_within_slo: s.cost_per_1k_within_slo,
        })
        .collect();
    if l.recent.idle.0 > 0 {
        by_edge.push(EdgeCostRow {
            edge: None,
            cost: l.recent.idle.units(),
            frames_within_slo: 0,
            frames_late: 0,
            busy_s: 0.0,
            cost_per_1k_within_slo: None,
        });
    }
    let currency = c
        .currency
        .clone()
        .or_else(|| l.live.first().map(|r| r.currency.clone()))
        .unwrap_or_default();
    LeasingModel {
        leases: l.live.iter().map(|r| lease_row(r, now_ms)).collect(),
        spend_per_hour: l.live.iter().map(|r| r.price_per_hour.units()).sum(),
        spend_cap_per_hour: l.spend_cap_per_hour,
        currency,
        total_cost: c.total.units(),
        frames_within_slo: c.frames_within_slo,
        frames_late: c.frames_late,
        cost_per_1k_within_slo: c.cost_per_1k_within_slo,
        last_day_by_edge: by_edge,
    }
}

pub(super) fn leases_html(l: &LeasingModel, now_ms: u64) -> String {
    let rows = l
        .leases
        .iter()
        .map(|r| {
            let since = r.billing_started_at.map_or_else(
                || Cell::from("not yet"),
                |t| Cell::Markup(when(t.0, now_ms)),
            );
            let left = match (r.paid_until_at, r.block_left_ms) {
                (Some(until), Some(left)) if left > 0 => {
                    Cell::Markup(format!("{} ({} left)", when(until.0, now_ms), span(left)))
                }
                (Some(_), _) => "per second now".into(),
                _ => "—".into(),
            };
            vec![
                format!("lease-{}", r.id).into(),
                r.provider.as_str().into(),
                r.instance_type.as_str().into(),
                r.tier.into(),
                r.state.into(),
                format!("{:.2} {}/h", r.price_per_hour, r.currency).into(),
                since,
                left,
                format!("{:.2} {}", r.cost, r.currency).into(),
            ]
        })
        .collect();
    table_html(
        &[
            "lease",
            "provider",
            "type",
            "tier",
            "state",
            "price",
            "billing since",
            "paid block ends",
            "cost so far",
        ],
        rows,
        "No lease is live.",
        &[5, 8],
        None,
    )
}

pub(super) fn costs_html(l: &LeasingModel) -> String {
    let rows = l
        .last_day_by_edge
        .iter()
        .map(|e| {
            vec![
                e.edge.as_deref().unwrap_or("(idle leases)").into(),
                format!("{:.2} {}", e.cost, l.currency).into(),
                e.frames_within_slo.to_string().into(),
                e.frames_late.to_string().into(),
                format!("{:.1}", e.busy_s).into(),
                num(e.cost_per_1k_within_slo, 4).into(),
            ]
        })
        .collect();
    table_html(
        &[
            "edge",
            "cost",
            "within SLO",
            "late",
            "worker s",
            "per 1000 within SLO",
        ],
        rows,
        "No lease has served a frame yet.",
        &[1, 2, 3, 4, 5],
        None,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::build;
    use crate::status::fixtures::{NOW, lease, snapshot};

    #[test]
    fn leases_show_the_time_left_in_their_paid_block_and_spend_near_the_cap_is_flagged() {
        let live = [
            // 100 min into hourly billing: 20 min left in the second hour
            lease(1, 5.0, Some(NOW - 100 * 60_000), Granularity::Hour),
            // per-second billing past its 60 s minimum: nothing prepaid
            lease(
                2,
                4.0,
                Some(NOW - 120_000),
                Granularity::Second { minimum_secs: 60 },
            ),
            lease(3, 0.5, None, Granularity::Hour),
        ];
        let costs = CostReport::default();
        let view = |cap| LeasingView {
            live: &live,
            costs: &costs,
            recent: &costs,
            spend_cap_per_hour: cap,
        };
        let m = build(&snapshot(0), Some(view(Some(10.5))), NOW);
        let l = m.leasing.as_ref().unwrap();
        assert_eq!(l.spend_per_hour, 9.5);
        assert_eq!(l.leases[0].block_left_ms, Some(20 * 60_000));
        assert_eq!(
            l.leases[0].paid_until_at,
            Some(Timestamp(NOW + 20 * 60_000))
        );
        assert_eq!(l.leases[1].block_left_ms, Some(0));
        assert_eq!(
            (l.leases[2].paid_until_at, l.leases[2].block_left_ms),
            (None, None)
        );
        assert_eq!(
            m.problems.len(),
            1,
            "9.5 is 90.5 % of 10.5: {:?}",
            m.problems
        );
        assert_eq!(m.problems[0].kind, "spend_near_cap");
        assert!(
            build(&snapshot(0), Some(view(Some(10.6))), NOW)
                .problems
                .is_empty(),
            "89.6 %"
        );
        assert!(
            build(&snapshot(0), Some(view(None)), NOW)
                .problems
                .is_empty(),
            "no cap"
        );
    }
}
