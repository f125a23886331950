//! Leases as the ledger records them (`GET /api/v1/leases`), and what
//! releasing one answers.

use serde::Serialize;
use utoipa::ToSchema;

use tidegate_lease::ledger::LeaseRecord;

use super::Timestamp;

/// A lease, as the ledger records it (`GET /api/v1/leases`).
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct Lease {
    /// Its id: the number `POST /api/v1/leases/{id}/release` takes (logs
    /// and a leased worker's name write it `lease-<id>`).
    pub id: u64,
    /// Provider name.
    pub provider: String,
    /// The model it serves.
    pub model: Option<String>,
    /// Instance type.
    pub instance_type: String,
    /// `on_demand`, `spot` or `reserved`.
    pub tier: String,
    /// Price per hour (currency units).
    pub price_per_hour: f64,
    /// Currency.
    pub currency: String,
    /// `hour` (whole hours, paid at the start of each) or `second`.
    pub billing: String,
    /// The least time billed (s): 3600 for hourly billing.
    pub billing_minimum_s: u32,
    /// `requested`, `starting`, `ready`, `draining` or `ended`.
    pub state: String,
    /// Why it ended (`released`, `preempted`, `failed`, `lost`,
    /// `no_capacity`); `null` until it has.
    pub end_reason: Option<String>,
    /// Asked of the provider.
    pub requested_at: Timestamp,
    /// The provider accepted it, and billing started.
    pub billing_started_at: Option<Timestamp>,
    /// Its worker registered and warmed its models.
    pub ready_at: Option<Timestamp>,
    /// It ended.
    pub ended_at: Option<Timestamp>,
    /// The gateway last heard from its worker (written at most every few
    /// seconds).
    pub last_seen_at: Option<Timestamp>,
    /// Worker process id (process provider), for adoption.
    pub pid: Option<u32>,
    /// Provider-specific data (JSON text), for adoption.
    pub provider_data: Option<String>,
    /// Cost charged so far (currency units).
    pub cost: f64,
    /// Frames served within the SLO.
    pub frames_within_slo: u64,
    /// Frames served late.
    pub frames_late: u64,
}

impl From<&LeaseRecord> for Lease {
    fn from(r: &LeaseRecord) -> Self {
        let LeaseRecord {
            id,
            provider,
            model,
            instance_type,
            tier,
            price_per_hour,
            currency,
            granularity,
            state,
            requested_at,
            billing_start,
            ready_at,
            ended_at,
            last_seen_at,
            pid,
            provider_data,
            cost,
            frames_within_slo,
            frames_late,
            token_claimed: _,
            token: _,
        } = r;
        Lease {
            id: id.0,
            provider: provider.clone(),
            model: model.clone(),
            instance_type: instance_type.clone(),
            tier: tier.as_str().into(),
            price_per_hour: price_per_hour.units(),
            currency: currency.clone(),
            billing: granularity.unit().into(),
            billing_minimum_s: granularity.minimum_secs(),
            state: state.label().into(),
            end_reason: match state {
                tidegate_lease::LeaseState::Ended(why) => Some(why.as_str().into()),
                _ => None,
            },
            requested_at: Timestamp(*requested_at),
            billing_started_at: billing_start.map(Timestamp),
            ready_at: ready_at.map(Timestamp),
            ended_at: ended_at.map(Timestamp),
            last_seen_at: last_seen_at.map(Timestamp),
            pid: *pid,
            provider_data: provider_data.clone(),
            cost: cost.units(),
            frames_within_slo: *frames_within_slo,
            frames_late: *frames_late,
        }
    }
}

/// `POST /api/v1/leases/{id}/release` accepted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct Releasing {
    /// The lease's id.
    pub lease: u64,
    /// `draining`: its worker finishes its batches, then the provider
    /// releases it.
    pub state: String,
}
