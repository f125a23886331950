//! The ledger on a real SQLite file in a temporary directory.

use tidegate_lease::billing::HOUR_MS;
use tidegate_lease::catalog::{Catalog, Money, Tier};
use tidegate_lease::ledger::{Ledger, LedgerError, NewLease};
use tidegate_lease::lifecycle::{EndReason, LeaseState};
use tidegate_lease::showback::Usage;
use tidegate_lease::table::{ClaimError, LeaseId, LeaseToken};

const T0: u64 = 1_800_000_000_000; // some instant in 2027

fn new_lease<'a>(
    catalog: &'a Catalog,
    ty: &str,
    tier: Tier,
    at: u64,
    token: &LeaseToken,
) -> NewLease<'a> {
    NewLease {
        provider: "process",
        model: Some("detector"),
        instance: catalog.get(ty).unwrap(),
        tier,
        currency: &catalog.currency,
        requested_at: at,
        token: Some(token.digest()),
    }
}

#[test]
fn file_ledger_is_wal_and_reopen_keeps_data_and_schema() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger.sqlite");
    let catalog = Catalog::default_catalog();
    let token = LeaseToken::generate().unwrap();
    let id;
    {
        let mut l = Ledger::open(&path).unwrap();
        assert_eq!(l.journal_mode().unwrap(), "wal");
        assert_eq!(l.schema_version().unwrap(), 5);
        id = l
            .insert_requested(&new_lease(&catalog, "a100", Tier::Spot, T0, &token))
            .unwrap();
        l.mark_starting(id, T0 + 1000, Some(4242), Some("{\"cmdline\":[\"w\"]}"))
            .unwrap();
        l.mark_ready(id, T0 + 60_000).unwrap();
        l.record_frames(id, T0 + 120_000, 900, 12).unwrap();
        l.accrue(T0 + 2 * HOUR_MS).unwrap();
    }
    // reopen twice: migrations are idempotent and the data is intact
    for _ in 0..2 {
        let l = Ledger::open(&path).unwrap();
        assert_eq!(l.schema_version().unwrap(), 5);
        let r = l.lease(id).unwrap().unwrap();
        assert_eq!(r.state, LeaseState::Ready);
        assert_eq!(r.pid, Some(4242));
        assert_eq!(r.instance_type, "a100");
        assert_eq!(r.tier, Tier::Spot);
        assert_eq!(r.frames_within_slo, 900);
        assert_eq!(r.frames_late, 12);
        // started T0+1s, accrued to T0+2h: blocks at +1s, +1h+1s, not +2h+1s
        assert_eq!(r.cost, Money::from_units(7.70 * 2.0));
        let mut table = l.load_table().unwrap();
        assert_eq!(table.claim(id, &token), Ok(()));
        assert_eq!(
            table.claim(id, &LeaseToken::generate().unwrap()),
            Err(ClaimError::WrongToken(id))
        );
    }
}

#[test]
fn last_seen_only_moves_forward_and_stops_at_the_end() {
    let catalog = Catalog::default_catalog();
    let mut l = Ledger::open_in_memory().unwrap();
    let token = LeaseToken::generate().unwrap();
    let a = l
        .insert_requested(&new_lease(&catalog, "h100", Tier::OnDemand, T0, &token))
        .unwrap();
    let b = l
        .insert_requested(&new_lease(&catalog, "h100", Tier::OnDemand, T0, &token))
        .unwrap();
    assert_eq!(l.lease(a).unwrap().unwrap().last_seen_at, None);
    l.mark_starting(a, T0 + 1_000, None, None).unwrap();
    l.mark_starting(b, T0 + 1_000, None, None).unwrap();
    l.mark_seen(&[a, b], T0 + 60_000).unwrap();
    // a late write of an older sighting does not take it back
    l.mark_seen(&[a], T0 + 30_000).unwrap();
    let seen = |l: &Ledger, id| l.lease(id).unwrap().unwrap().last_seen_at;
    assert_eq!(seen(&l, a), Some(T0 + 60_000));
    l.mark_ended(b, T0 + 70_000, EndReason::Released).unwrap();
    l.mark_seen(&[a, b, LeaseId(999)], T0 + 90_000).unwrap();
    assert_eq!(seen(&l, a), Some(T0 + 90_000));
    assert_eq!(
        seen(&l, b),
        Some(T0 + 60_000),
        "an ended lease is not seen again"
    );
}

#[test]
fn newer_schema_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger.sqlite");
    drop(Ledger::open(&path).unwrap());
    {
        let c = rusqlite::Connection::open(&path).unwrap();
        c.execute_batch("PRAGMA user_version = 99").unwrap();
    }
    match Ledger::open(&path) {
        Err(LedgerError::NewerSchema {
            found: 99,
            known: 5,
        }) => {}
        other => panic!("expected NewerSchema, got {other:?}"),
    }
}

#[test]
fn accrued_cost_equals_recomputed_cost_and_never_decreases() {
    let dir = tempfile::tempdir().unwrap();
    let mut l = Ledger::open(&dir.path().join("l.sqlite")).unwrap();
    let c = Catalog::default_catalog();
    let tok = LeaseToken::generate().unwrap();
    // an hourly H100 on-demand lease, a per-second CPU spot lease that is
    // released, and a reserved A100 that ends lost
    let a = l
        .insert_requested(&new_lease(&c, "h100", Tier::OnDemand, T0, &tok))
        .unwrap();
    let b = l
        .insert_requested(&new_lease(&c, "cpu-32", Tier::Spot, T0, &tok))
        .unwrap();
    let d = l
        .insert_requested(&new_lease(&c, "a100", Tier::Reserved, T0, &tok))
        .unwrap();
    l.mark_starting(a, T0, None, None).unwrap();
    l.mark_starting(b, T0 + 5_000, None, None).unwrap();
    l.mark_starting(d, T0 + 7_000, None, None).unwrap();
    let mut last = Money::ZERO;
    let mut now = T0;
    for step in 0..40u64 {
        now = T0 + step * 7 * 60_000 + 333;
        if step == 10 {
            l.mark_ended(b, now, EndReason::Released).unwrap();
        }
        if step == 25 {
            l.mark_ended(d, now, EndReason::Lost).unwrap();
        }
        l.accrue(now).unwrap();
        let total = l.accrued_cost(0, u64::MAX / 2).unwrap();
        assert!(total >= last, "cost decreased at step {step}");
        last = total;
        assert_eq!(total, l.recompute_cost(0, u64::MAX / 2, now).unwrap());
        // and over a sub-range
        let (f, t) = (T0 + HOUR_MS, T0 + 3 * HOUR_MS);
        assert_eq!(
            l.accrued_cost(f, t).unwrap(),
            l.recompute_cost(f, t, now).unwrap()
        );
    }
    // accruing again at the same instant charges nothing
    assert_eq!(l.accrue(now).unwrap(), Money::ZERO);
    // Hand check of the CPU spot lease (1.40 CNY/h = 1_400_000 micro/h):
    // it lived from T0+5 s to T0 + 10*7 min + 333 ms, i.e. 4195.333 s.
    // Block 0 is the 60 s minimum: 1.4e6 * 60/3600 = 23_333.3 -> 23_333.
    // Then (4195.333 - 60) s = 68 full minutes (68 * 23_333) and a final
    // 55.333 s rounded up to 56 s: 1.4e6 * 56/3600 = 21_777.8 -> 21_778.
    let cpu = l.lease(b).unwrap().unwrap();
    assert_eq!(cpu.cost, Money(23_333 * 69 + 21_778));
    let by_tier = l.costs(0, u64::MAX / 2).unwrap().by_tier;
    assert_eq!(by_tier.values().copied().sum::<Money>(), last);
}

#[test]
fn lifecycle_is_enforced_by_the_ledger() {
    let mut l = Ledger::open_in_memory().unwrap();
    let c = Catalog::default_catalog();
    let tok = LeaseToken::generate().unwrap();
    let id = l
        .insert_requested(&new_lease(&c, "a100", Tier::Spot, T0, &tok))
        .unwrap();
    assert!(matches!(
        l.mark_ready(id, T0),
        Err(LedgerError::Transition { .. })
    ));
    l.mark_starting(id, T0, None, None).unwrap();
    l.mark_ended(id, T0 + 10, EndReason::Preempted).unwrap();
    assert!(matches!(
        l.mark_ended(id, T0 + 20, EndReason::Released),
        Err(LedgerError::Transition { .. })
    ));
    assert!(matches!(
        l.mark_ready(LeaseId(999), T0),
        Err(LedgerError::UnknownLease(LeaseId(999)))
    ));
    assert!(matches!(
        l.record_frames(LeaseId(999), T0, 1, 0),
        Err(LedgerError::UnknownLease(LeaseId(999)))
    ));
    assert!(matches!(
        l.record_usage(LeaseId(999), T0, "edge-1", "m", Usage::default()),
        Err(LedgerError::UnknownLease(LeaseId(999)))
    ));
}

#[test]
fn costs_are_split_among_the_edges_and_models_each_lease_served() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger.sqlite");
    let c = Catalog::default_catalog();
    let tok = LeaseToken::generate().unwrap();
    let u = |busy_us, within_slo, late| Usage {
        within_slo,
        late,
        busy_us,
    };
    let (a, b, idle) = {
        let mut l = Ledger::open(&path).unwrap();
        let mut lease = |ty| {
            let id = l
                .insert_requested(&new_lease(&c, ty, Tier::OnDemand, T0, &tok))
                .unwrap();
            l.mark_starting(id, T0, Some(7), None).unwrap();
            l.mark_ready(id, T0 + 60_000).unwrap();
            id
        };
        let (a, b, idle) = (lease("a100"), lease("h100"), lease("v100"));
        // Lease a: the lobby edge took three times the worker time of the
        // dock edge, over two hours and two models.
        l.record_usage(a, T0 + 1_000, "lobby", "blazeface", u(200_000, 90, 1))
            .unwrap();
        l.record_usage(a, T0 + HOUR_MS + 5, "lobby", "centernet", u(100_000, 10, 0))
            .unwrap();
        l.record_usage(a, T0 + 2_000, "dock", "blazeface", u(100_000, 40, 0))
            .unwrap();
        // The same hour, edge and model again: added up.
        l.record_usage(b, T0 + 3_000, "dock", "centernet", u(50_000, 5, 0))
            .unwrap();
        l.record_usage(b, T0 + 4_000, "dock", "centernet", u(50_000, 5, 2))
            .unwrap();
        l.accrue(T0 + HOUR_MS + 30_000).unwrap();
        (a, b, idle)
    };
    let l = Ledger::open(&path).unwrap();
    let r = l.costs(T0, T0 + 2 * HOUR_MS).unwrap();
    let cost = |id| l.lease(id).unwrap().unwrap().cost;
    let (cost_a, cost_b, cost_idle) = (cost(a), cost(b), cost(idle));
    assert!(cost_a.0 > 0 && cost_b.0 > 0 && cost_idle.0 > 0);
    assert_eq!(r.total, cost_a + cost_b + cost_idle);
    assert_eq!(r.idle, cost_idle, "the v100 lease served no frame");
    // Whole micro-units: a share is its exact value rounded either way.
    let near = |got: Money, exact: f64| (got.0 as f64 - exact).abs() < 1.0;
    let lobby = r.by_edge["lobby"];
    let dock = r.by_edge["dock"];
    assert!(near(lobby.cost, cost_a.0 as f64 * 0.75), "{lobby:?}");
    assert!(
        near(dock.cost, cost_a.0 as f64 * 0.25 + cost_b.0 as f64),
        "{dock:?}"
    );
    assert_eq!((lobby.frames_within_slo, lobby.frames_late), (100, 1));
    assert_eq!((dock.frames_within_slo, dock.frames_late), (50, 2));
    assert!((lobby.busy_seconds - 0.3).abs() < 1e-9);
    let (blaze, center) = (r.by_model["blazeface"], r.by_model["centernet"]);
    assert!(near(blaze.cost, cost_a.0 as f64 * 0.75), "{blaze:?}");
    assert!(
        near(center.cost, cost_a.0 as f64 * 0.25 + cost_b.0 as f64),
        "{center:?}"
    );
    for split in [&r.by_edge, &r.by_model] {
        let shared: Money = split.values().map(|s| s.cost).sum();
        assert_eq!(shared + r.idle, r.total);
    }
    // Only the first hour: its usage and the blocks charged in it.
    let first = l.costs(T0, T0 + HOUR_MS).unwrap();
    assert_eq!(first.by_edge["lobby"].frames_within_slo, 90);
    // Lease b's two centernet rows; lease a's is in the second hour.
    assert_eq!(first.by_model["centernet"].frames_within_slo, 10);
    let shared: Money = first.by_edge.values().map(|s| s.cost).sum();
    assert_eq!(shared + first.idle, first.total);
    let json = serde_json::to_value(&r).unwrap();
    assert_eq!(json["by_edge"]["lobby"]["frames_within_slo"], 100);
    assert!(json["by_model"]["centernet"]["cost"].is_number());
    assert!(json["idle"].is_number());
}

#[test]
fn cost_report_and_lease_listing_serialise_for_the_api() {
    let mut l = Ledger::open_in_memory().unwrap();
    let c = Catalog::default_catalog();
    let tok = LeaseToken::generate().unwrap();
    let id = l
        .insert_requested(&new_lease(&c, "h100", Tier::Spot, T0, &tok))
        .unwrap();
    l.mark_starting(id, T0, Some(7), None).unwrap();
    l.mark_ready(id, T0 + 150_000).unwrap();
    l.record_frames(id, T0 + 200_000, 29_800, 200).unwrap();
    l.accrue(T0 + 30 * 60_000).unwrap();
    let report = l.costs(T0, T0 + HOUR_MS).unwrap();
    assert_eq!(report.total, Money::from_units(14.90));
    assert_eq!(
        report.by_tier.get(&Tier::Spot),
        Some(&Money::from_units(14.90))
    );
    assert_eq!(report.frames_within_slo, 29_800);
    let per_1k = report.cost_per_1k_within_slo.unwrap();
    assert!((per_1k - 14.90 / 29.8).abs() < 1e-9, "{per_1k}");
    let json = serde_json::to_value(&report).unwrap();
    assert_eq!(json["total"], serde_json::json!(14.9));
    assert_eq!(json["by_tier"]["spot"], serde_json::json!(14.9));
    let leases = l.leases(true, 100).unwrap();
    assert_eq!(leases.len(), 1);
    let json = serde_json::to_value(&leases).unwrap();
    assert_eq!(json[0]["state"]["state"], "ready");
    assert_eq!(json[0]["tier"], "spot");
    assert!(
        json[0].get("token").is_none(),
        "token digest must not be served"
    );
    let gauge = l.load_table().unwrap().counts();
    assert_eq!(
        gauge.get(&("h100".to_string(), Tier::Spot, "ready")),
        Some(&1)
    );
}
