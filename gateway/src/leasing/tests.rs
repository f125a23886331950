//! The lease shell end to end with the static provider: leasing,
//! authenticating and binding a listed worker, refused acquisitions, and
//! a restart that ends the leases it cannot adopt.

use tidegate_lease::ledger::NewLease;
use tidegate_lease::provider::wall_clock_ms;
use tidegate_lease::{Catalog, EndReason, LeaseState, LeaseToken, Money, Tier};

use super::*;
use crate::auth::hash_token;
use crate::hub::HubMsg;

fn static_config(dir: &std::path::Path) -> LeasingConfig {
    let text = format!(
        r#"
[leasing]
provider = "static"
ledger = "{}"
policy = "tidal"
tick_ms = 100
[[leasing.static_workers]]
name = "gpu-a"
instance_type = "cpu-32"
tier = "reserved"
token_sha256 = "{}"
[[leasing.models]]
name = "m"
instance_types = ["cpu-32"]
worker_fps = 20
min_fps = 10
reserved = 1
"#,
        dir.join("l.db").display(),
        hash_token("gpu-a-secret")
    );
    let cfg: crate::config::Config = toml::from_str(&text).unwrap();
    cfg.validate().unwrap();
    assert!(
        !format!("{cfg:?}").contains(&hash_token("gpu-a-secret")),
        "token digests stay out of Debug"
    );
    cfg.leasing.unwrap()
}

pub(super) async fn start(cfg: &LeasingConfig) -> (Leasing, CancellationToken, TaskTracker) {
    let (l, _hub, cancel, tracker) = start_with_hub(cfg).await;
    (l, cancel, tracker)
}

/// [`start`], with the hub the shell drives.
async fn start_with_hub(cfg: &LeasingConfig) -> (Leasing, Hub, CancellationToken, TaskTracker) {
    let cancel = CancellationToken::new();
    let tracker = TaskTracker::new();
    let metrics = Metrics::new();
    let hub = crate::hub::spawn(
        crate::scheduler::Settings::default(),
        None,
        metrics.clone(),
        cancel.clone(),
        &tracker,
    );
    let quic = "127.0.0.1:4433".parse().unwrap();
    let l = spawn(cfg, quic, hub.clone(), metrics, cancel.clone(), &tracker).unwrap();
    (l, hub, cancel, tracker)
}

async fn live(l: &Leasing) -> Vec<LeaseRecord> {
    l.leases(true, 100).await.unwrap()
}

#[tokio::test]
async fn static_worker_is_leased_authenticated_once_and_made_ready() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = static_config(dir.path());
    let (l, cancel, tracker) = start(&cfg).await;
    // the reserved floor binds gpu-a at the first tick
    let until = tokio::time::Instant::now() + Duration::from_secs(5);
    while live(&l)
        .await
        .iter()
        .all(|r| r.state == LeaseState::Requested)
    {
        assert!(tokio::time::Instant::now() < until, "no lease acquired");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let leases = live(&l).await;
    assert_eq!(leases.len(), 1, "{leases:?}");
    let id = leases[0].id;
    assert_eq!(leases[0].tier, Tier::Reserved);
    assert_eq!(leases[0].state, LeaseState::Starting);

    // not a leased worker: the [[workers]] list decides
    assert_eq!(l.authenticate("gpu-b", "x").await, None);
    let wrong = l.authenticate("gpu-a", "guess").await.unwrap().unwrap_err();
    assert!(wrong.message.contains("does not match"), "{wrong}");
    assert_eq!(
        l.authenticate("gpu-a", "gpu-a-secret").await,
        Some(Ok(WorkerPass::Static("gpu-a".into())))
    );
    let again = l
        .authenticate("gpu-a", "gpu-a-secret")
        .await
        .unwrap()
        .unwrap_err();
    assert!(again.message.contains("already connected"), "{again}");
    let bad = l.authenticate("lease-x", "t").await.unwrap().unwrap_err();
    assert!(bad.message.contains("lease-<id>"), "{bad}");

    l.static_registered("gpu-a").await;
    let until = tokio::time::Instant::now() + Duration::from_secs(5);
    while live(&l).await[0].state != LeaseState::Ready {
        assert!(tokio::time::Instant::now() < until, "lease never ready");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(live(&l).await[0].id, id, "the bound lease is ready");
    let costs = l.costs(0, wall_clock_ms() + 1).await.unwrap();
    assert!(costs.total > Money::ZERO, "{costs:?}");

    // a clean stop ends every lease as released
    cancel.cancel();
    tracker.close();
    tracker.wait().await;
    let ledger = Ledger::open(&cfg.ledger).unwrap();
    let all = ledger.leases(false, 100).unwrap();
    assert!(ledger.live_leases().unwrap().is_empty(), "{all:?}");
    assert!(
        all.iter()
            .all(|r| r.state == LeaseState::Ended(EndReason::Released)),
        "{all:?}"
    );
}

/// Polls `done` every 25 ms until it holds; fails after 10 s.
async fn until<F, Fut>(what: &str, mut done: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let until = tokio::time::Instant::now() + Duration::from_secs(10);
    while !done().await {
        assert!(tokio::time::Instant::now() < until, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Connects and registers the static worker `gpu-a` as worker `id`:
/// the batches the hub sends it.
async fn connect_static(
    l: &Leasing,
    hub: &Hub,
    id: u64,
) -> mpsc::Receiver<tidegate_protocol::Dispatch> {
    assert_eq!(
        l.authenticate("gpu-a", "gpu-a-secret").await,
        Some(Ok(WorkerPass::Static("gpu-a".into())))
    );
    let (dispatch, batches) = mpsc::channel(8);
    hub.send(HubMsg::WorkerConnected {
        worker: crate::scheduler::WorkerId(id),
        register: tidegate_protocol::Register {
            worker: "gpu-a".into(),
            device: "cpu".into(),
            models: Vec::new(),
            profile: Vec::new(),
            codecs: Vec::new(),
        },
        dispatch,
        lease: None,
        static_worker: Some("gpu-a".into()),
        drain: CancellationToken::new(),
    })
    .await;
    l.static_registered("gpu-a").await;
    batches
}

/// The hub's view of worker `id`: its lease and whether it is unbound.
async fn worker_view(hub: &Hub, id: u64) -> Option<(Option<u64>, bool)> {
    let snap = hub.snapshot().await?;
    snap.workers
        .iter()
        .find(|w| w.id == id)
        .map(|w| (w.lease, w.unbound))
}

#[tokio::test]
async fn a_released_static_lease_unbinds_its_worker_which_stays_connected_and_is_bound_again() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = static_config(dir.path());
    let (l, hub, cancel, tracker) = start_with_hub(&cfg).await;
    // the worker connects whether or not the reserved floor has bound
    // it yet; either way its lease becomes ready and the hub serves it
    let mut batches = connect_static(&l, &hub, 1).await;
    let again = l
        .authenticate("gpu-a", "gpu-a-secret")
        .await
        .unwrap()
        .unwrap_err();
    assert!(again.message.contains("already connected"), "{again}");
    until("the first lease ready", || async {
        live(&l)
            .await
            .first()
            .is_some_and(|r| r.state == LeaseState::Ready)
    })
    .await;
    let first = live(&l).await[0].id;
    until("the hub serves the first lease", || async {
        worker_view(&hub, 1).await == Some((Some(first.0), false))
    })
    .await;

    // an operator releases it: the lease ends released, the worker
    // stays (its dispatch channel open) and the floor binds it again
    // under a new lease, ready at once since it is registered
    l.release(first).await.unwrap();
    until("the first lease released", || async {
        let all = l.leases(false, 100).await.unwrap();
        all.iter()
            .any(|r| r.id == first && r.state == LeaseState::Ended(EndReason::Released))
    })
    .await;
    until("a second lease ready on the same worker", || async {
        live(&l)
            .await
            .iter()
            .any(|r| r.id != first && r.state == LeaseState::Ready)
    })
    .await;
    let second = live(&l)
        .await
        .iter()
        .find(|r| r.id != first && r.state == LeaseState::Ready)
        .expect("the second lease")
        .id;
    until("the hub serves the second lease", || async {
        worker_view(&hub, 1).await == Some((Some(second.0), false))
    })
    .await;
    assert!(
        matches!(batches.try_recv(), Err(mpsc::error::TryRecvError::Empty)),
        "the worker's link was kept"
    );
    let all = l.leases(false, 100).await.unwrap();
    for id in [first, second] {
        let r = all.iter().find(|r| r.id == id).unwrap();
        assert!(
            r.provider_data
                .as_deref()
                .is_some_and(|d| d.contains("gpu-a")),
            "both leases bound gpu-a: {r:?}"
        );
    }

    // its disconnection ends the lease as lost; it may connect again,
    // and the floor binds it once more
    hub.send(HubMsg::WorkerGone {
        worker: crate::scheduler::WorkerId(1),
    })
    .await;
    l.static_disconnected("gpu-a").await;
    until("the second lease lost", || async {
        let all = l.leases(false, 100).await.unwrap();
        all.iter()
            .any(|r| r.id == second && r.state == LeaseState::Ended(EndReason::Lost))
    })
    .await;
    let _batches = connect_static(&l, &hub, 2).await;
    until("a third lease ready", || async {
        live(&l)
            .await
            .iter()
            .any(|r| r.id != second && r.id != first && r.state == LeaseState::Ready)
    })
    .await;
    cancel.cancel();
    tracker.close();
    tracker.wait().await;
}

/// Every lease, live or ended, after `wait` more ticks; then a clean stop.
async fn every_lease_after(
    wait: Duration,
    l: &Leasing,
    cancel: CancellationToken,
    tracker: TaskTracker,
) -> Vec<LeaseRecord> {
    tokio::time::sleep(wait).await;
    let all = l.leases(false, 1000).await.unwrap();
    cancel.cancel();
    tracker.close();
    tracker.wait().await;
    all
}

#[tokio::test]
async fn acquires_the_provider_refuses_are_not_asked_again_at_every_tick() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = static_config(dir.path());
    // 100 fps (+3%) takes six 20-fps workers; one is listed, reserved:
    // five spot acquires are refused, then their on-demand fallbacks
    cfg.models[0].min_fps = 100.0;
    let (l, cancel, tracker) = start(&cfg).await;
    // Refusals end as `no_capacity`, not `failed`.
    let failed = |all: &[LeaseRecord], tier: Tier| {
        all.iter()
            .filter(|r| r.tier == tier && r.state == LeaseState::Ended(EndReason::NoCapacity))
            .count()
    };
    until("an on-demand fallback refused", || async {
        failed(&l.leases(false, 1000).await.unwrap(), Tier::OnDemand) > 0
    })
    .await;
    // 20 ticks of 100 ms within the cool-offs (a minute each, spot and
    // on-demand): nothing more is asked
    let all = every_lease_after(Duration::from_secs(2), &l, cancel, tracker).await;
    assert_eq!(failed(&all, Tier::Spot), 5, "{all:?}");
    assert!(
        (1..=5).contains(&failed(&all, Tier::OnDemand)),
        "one round of on-demand refusals at most: {all:?}"
    );
    assert_eq!(failed(&all, Tier::Reserved), 0, "{all:?}");
}

#[tokio::test]
async fn a_refused_spot_type_falls_back_to_the_next_types_spot_before_on_demand() {
    let dir = tempfile::tempdir().unwrap();
    // H100 is the cheaper per frame at the same throughput, but the only
    // spot worker listed is an H200
    let text = format!(
        r#"
[leasing]
provider = "static"
ledger = "{}"
policy = "paid-block-aware"
tick_ms = 100
[[leasing.static_workers]]
name = "gpu-b"
instance_type = "h200"
tier = "spot"
token_sha256 = "{}"
[[leasing.models]]
name = "m"
instance_types = ["h100", "h200"]
worker_fps = 20
min_fps = 10
"#,
        dir.path().join("l.db").display(),
        hash_token("gpu-b-secret")
    );
    let cfg: crate::config::Config = toml::from_str(&text).unwrap();
    cfg.validate().unwrap();
    let (l, cancel, tracker) = start(cfg.leasing.as_ref().unwrap()).await;
    until("the H200 spot worker leased", || async {
        live(&l)
            .await
            .iter()
            .any(|r| r.instance_type == "h200" && r.state == LeaseState::Starting)
    })
    .await;
    // ticks within H100 spot's cool-off ask nothing more
    let all = every_lease_after(Duration::from_secs(1), &l, cancel, tracker).await;
    let ended = |ty: &str, tier: Tier| {
        all.iter()
            .filter(|r| r.instance_type == ty && r.tier == tier)
            .filter(|r| r.state == LeaseState::Ended(EndReason::NoCapacity))
            .count()
    };
    assert_eq!(ended("h100", Tier::Spot), 1, "{all:?}");
    assert_eq!(
        all.iter().filter(|r| r.tier == Tier::OnDemand).count(),
        0,
        "no on-demand while another type's spot is there: {all:?}"
    );
    let h200: Vec<_> = all
        .iter()
        .filter(|r| r.instance_type == "h200" && r.tier == Tier::Spot)
        .collect();
    assert_eq!(h200.len(), 1, "{all:?}");
}

#[tokio::test]
async fn restart_ends_leases_it_cannot_adopt() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = static_config(dir.path());
    // a live lease left by a previous gateway
    let catalog = Catalog::default_catalog();
    let mut ledger = Ledger::open(&cfg.ledger).unwrap();
    let token = LeaseToken::generate().unwrap();
    let old = ledger
        .insert_requested(&NewLease {
            provider: "static",
            model: Some("m"),
            instance: catalog.get("cpu-32").unwrap(),
            tier: Tier::Reserved,
            currency: &catalog.currency,
            requested_at: wall_clock_ms() - 10_000,
            token: Some(token.digest()),
        })
        .unwrap();
    ledger
        .mark_starting(old, wall_clock_ms() - 9_000, None, None)
        .unwrap();
    drop(ledger);
    let (l, cancel, tracker) = start(&cfg).await;
    let all = l.leases(false, 100).await.unwrap();
    let rec = all.iter().find(|r| r.id == old).unwrap();
    assert_eq!(rec.state, LeaseState::Ended(EndReason::Lost), "{rec:?}");
    assert!(rec.cost > Money::ZERO, "the minimum was charged: {rec:?}");
    cancel.cancel();
    tracker.close();
    tracker.wait().await;
}
