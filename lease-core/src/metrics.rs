//! The numbers behind the gateway's leasing metrics.
//!
//! The gateway owns the Prometheus registry; this module only computes the
//! values so that every exporter (the gateway, the simulator report, tests)
//! derives them the same way:
//!
//! | metric | source |
//! |---|---|
//! | `tidegate_leases{type,tier,state}` | [`crate::table::LeaseTable::counts`] |
//! | `tidegate_cost_total{tier}` | `Ledger::cost_total_by_tier` (in `tidegate-lease`) |
//! | `tidegate_cost_per_1k_frames_within_slo` | [`cost_per_1k`] |
//! | `tidegate_gpu_utilization_ratio` | [`gpu_utilization`] |

use crate::catalog::Money;

/// Metric names, in Prometheus form.
pub mod names {
    /// Gauge: leases by instance type, tier and lifecycle state.
    pub const LEASES: &str = "tidegate_leases";
    /// Counter: cost charged, by tier, in the catalog currency.
    pub const COST_TOTAL: &str = "tidegate_cost_total";
    /// Gauge: cost per 1000 frames served within the SLO.
    pub const COST_PER_1K_WITHIN_SLO: &str = "tidegate_cost_per_1k_frames_within_slo";
    /// Gauge: busy GPU time over leased GPU time.
    pub const GPU_UTILIZATION: &str = "tidegate_gpu_utilization_ratio";
}

/// Cost per 1000 frames served within the SLO; None when none were.
pub fn cost_per_1k(cost: Money, frames_within_slo: u64) -> Option<f64> {
    if frames_within_slo == 0 {
        None
    } else {
        Some(cost.units() * 1000.0 / frames_within_slo as f64)
    }
}

/// Busy time over leased time, in `[0, 1]`; None when nothing was leased.
pub fn gpu_utilization(busy_gpu_ms: f64, leased_gpu_ms: f64) -> Option<f64> {
    if leased_gpu_ms <= 0.0 {
        None
    } else {
        Some((busy_gpu_ms / leased_gpu_ms).clamp(0.0, 1.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratios_handle_zero_denominators() {
        assert_eq!(cost_per_1k(Money::from_units(5.0), 0), None);
        assert_eq!(cost_per_1k(Money::from_units(5.0), 2000), Some(2.5));
        assert_eq!(gpu_utilization(1.0, 0.0), None);
        assert_eq!(gpu_utilization(3.0, 4.0), Some(0.75));
    }
}
