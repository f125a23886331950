//! The gateway the status tests look at: two minutes up, two edges, three
//! cameras with frames in the last minute (one closed since), a worker
//! with ten batches, and leases as the ledger records them.

use tidegate_lease::billing::Granularity;
use tidegate_lease::ledger::LeaseRecord;
use tidegate_lease::{LeaseId, Money};

use crate::hub::{CameraView, EdgeView, ModelView, Snapshot, WorkerView};
use crate::timeline::{
    CameraWindow, FrameCounts, Percentiles, RecentWindow, TimelineView, WorkerWindow,
};

pub(super) const NOW: u64 = 1_764_694_800_000;

pub(super) fn counts(admitted: u64, ok: u64, shed: u64) -> FrameCounts {
    FrameCounts {
        admitted,
        ok,
        shed,
        ..FrameCounts::default()
    }
}

pub(super) fn camera(session: u64, edge: &str, name: &str, model: &str) -> CameraView {
    CameraView {
        session,
        edge: edge.into(),
        camera: name.into(),
        model: model.into(),
        load: None,
    }
}

pub(super) fn worker(id: u64, name: &str, demoted: bool) -> WorkerView {
    let profile = [(1, 4_000), (4, 10_000)]
        .map(|(batch, latency_us)| tidegate_protocol::ProfilePoint {
            model: "blazeface".into(),
            batch,
            latency_us,
        })
        .to_vec();
    WorkerView {
        id,
        name: name.into(),
        device: "cpu".into(),
        models: vec!["blazeface".into()],
        estimate: profile.clone(),
        profile,
        draining: false,
        demoted,
        lease: None,
        unbound: false,
    }
}

pub(super) fn blazeface(workers: usize) -> ModelView {
    ModelView {
        name: "blazeface".into(),
        version: 1,
        input: tidegate_protocol::InputSpec {
            width: 128,
            height: 128,
            channels: 3,
            dtype: tidegate_protocol::DType::U8,
            layout: tidegate_protocol::Layout::Nhwc,
            color: tidegate_protocol::ColorOrder::Rgb,
            resize: tidegate_protocol::Resize::Stretch,
        },
        max_batch: 8,
        queued: 0,
        workers,
        labels: Vec::new(),
        budget_ms: 80.0,
    }
}

/// A gateway 2 minutes up: two edges, three cameras with frames in the
/// last minute (one closed since), a worker with 10 batches.
pub(super) fn snapshot(lobby_shed: u64) -> Snapshot {
    let recent = RecentWindow {
        start_ms: NOW - 65_000,
        end_ms: NOW - 5_000,
        frames: counts(600 + 120 + 60, 600 - lobby_shed + 120 + 60, lobby_shed),
        shed_ratio: None,
        latency: Percentiles::of(&mut [10.0, 20.0, 30.0]),
        cameras: vec![
            CameraWindow {
                edge: "dock".into(),
                camera: "gone".into(),
                frames: counts(60, 60, 0),
            },
            CameraWindow {
                edge: "lobby".into(),
                camera: "door".into(),
                frames: counts(600, 600 - lobby_shed, lobby_shed),
            },
            CameraWindow {
                edge: "yard".into(),
                camera: "gate".into(),
                frames: counts(120, 120, 0),
            },
        ],
        other_cameras: FrameCounts::default(),
        workers: vec![WorkerWindow {
            id: 3,
            name: "w-1".into(),
            model: "blazeface".into(),
            batches: 10,
            frames: 40,
            mean_ms: 12.0,
            p95_ms: 15.0,
            own_ms: 9.0,
        }],
    };
    let mut recent = recent;
    recent.shed_ratio = recent.frames.shed_ratio();
    Snapshot {
        edges: vec![
            EdgeView {
                id: 1,
                name: "lobby".into(),
            },
            EdgeView {
                id: 2,
                name: "yard".into(),
            },
        ],
        cameras: vec![
            camera(2, "yard", "gate", "blazeface"),
            camera(1, "lobby", "door", "blazeface"),
        ],
        workers: vec![worker(3, "w-1", false)],
        models: vec![blazeface(1)],
        timeline: TimelineView {
            now_ms: NOW,
            interval_ms: crate::timeline::INTERVAL_MS,
            recent,
            ..TimelineView::default()
        },
        ..Snapshot::default()
    }
}

pub(super) fn lease(
    id: u64,
    price: f64,
    start: Option<u64>,
    granularity: Granularity,
) -> LeaseRecord {
    LeaseRecord {
        id: LeaseId(id),
        provider: "process".into(),
        model: Some("blazeface".into()),
        instance_type: "a100".into(),
        tier: tidegate_lease::catalog::Tier::Spot,
        price_per_hour: Money::from_units(price),
        currency: "EUR".into(),
        granularity,
        state: tidegate_lease::lifecycle::LeaseState::Ready,
        requested_at: 0,
        billing_start: start,
        ready_at: start,
        ended_at: None,
        last_seen_at: None,
        pid: None,
        provider_data: None,
        cost: Money::ZERO,
        frames_within_slo: 0,
        frames_late: 0,
        token_claimed: false,
        token: None,
    }
}
