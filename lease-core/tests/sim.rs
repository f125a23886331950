//! Deterministic simulator runs checked against hand-computed figures, and
//! the day/night goal.

use tidegate_lease_core::autoscale::PolicyName;
use tidegate_lease_core::catalog::{Catalog, Money, Tier};
use tidegate_lease_core::cloud::{CloudConfig, CloudPreset};
use tidegate_lease_core::lifecycle::{EndReason, LeaseState};
use tidegate_lease_core::sim::{SimOptions, simulate};
use tidegate_lease_core::trace::Trace;

/// `minutes` rows of `fps` for model `m`, then the next segment.
fn trace(segments: &[(u64, f64)]) -> Trace {
    let mut csv = String::from("t_secs,model,fps\n");
    let mut minute = 0;
    for &(len, fps) in segments {
        for _ in 0..len {
            csv.push_str(&format!("{},m,{fps}\n", minute * 60));
            minute += 1;
        }
    }
    Trace::parse("hand", &csv).unwrap()
}

fn h100_only() -> SimOptions {
    SimOptions {
        instance_types: Some(vec!["h100".into()]),
        preemptions: false,
        spot_refusal_probability: 0.0,
        reserved_floor: Some(0),
        record_leases: true,
        warm_start: false,
        // hand computations need the constant 150 s start-up
        cloud: Some(CloudConfig::preset(CloudPreset::Ideal)),
        ..SimOptions::default()
    }
}

// Hand computation shared by the tests below (default workload, H100):
//   frame_ms = 280 GFLOP / (989.4 TFLOPS * 0.35) + 400 MB / 3350 GB/s
//            = 0.808578 + 0.119403 = 0.927981 ms
//   compute budget = (80 - 20) / 2 = 30 ms per batch; launch 2 ms
//   batch b = floor(28 / 0.927981) = 30;  L(30) = 2 + 27.8394 = 29.8394 ms
//   throughput at the SLO = 30 / 29.8394 ms = 1005.38 frames/s per H100
//   start-up (catalog) = 150 s

#[test]
fn static_peak_on_a_flat_trace_matches_the_hand_computation() {
    // 3 hours at 1500 fps.
    // static-peak sizes for 1500 * 1.03 = 1545 fps -> ceil(1545 / 1005.38)
    // = 2 on-demand H100 at t = 0, ready at 150 s, held to 3 h.
    // cost: 2 leases * 3 hour blocks * 42.58 = 255.48 CNY
    // frames: 1500 * 10 800 s = 16 200 000; the first 150 s (15 steps of
    // 15 000) arrive before any worker is ready and are shed: 225 000.
    // utilisation: each step a worker is busy 15 000 / (2 * 10 053.8) of
    // the step, for 1065 of 1080 steps: 0.745985 * 1065/1080 = 0.73562.
    let r = simulate(
        &trace(&[(180, 1500.0)]),
        PolicyName::StaticPeak,
        &Catalog::default_catalog(),
        &h100_only(),
    );
    assert_eq!(r.leases, 2);
    assert_eq!(r.cost_total, Money::from_units(255.48));
    assert_eq!(
        r.cost_by_tier.get(&Tier::OnDemand),
        Some(&Money::from_units(255.48))
    );
    assert_eq!(r.frames_total, 16_200_000);
    assert_eq!(r.frames_shed, 225_000);
    assert_eq!(r.frames_within_slo, 16_200_000 - 225_000);
    assert!((r.gpu_hours_leased - 6.0).abs() < 1e-9);
    assert!((r.gpu_hours_paid - 6.0).abs() < 1e-9);
    assert!((r.utilisation - 0.73562).abs() < 1e-4, "{}", r.utilisation);
    assert!(
        r.lease_log
            .iter()
            .all(|l| l.state == LeaseState::Ended(EndReason::Released))
    );
}

#[test]
fn paid_block_aware_releases_the_surplus_just_before_its_block_ends() {
    // 30 min at 1500 fps, then 150 min at 400 fps.
    // t = 0 (the trace starts warm at 1500 fps): 1545 wanted -> 2 spot H100
    // (14.90/h), billed from 0. The tick at T reports the minute before it,
    // and the down-target is the maximum over 10 minutes, so from 41 min
    // one lease is surplus (400 * 1.03 = 412 < 1005.38); but it is paid
    // until 60 min, so it is released at the first tick within 3 minutes of
    // that: 57 min. The other is held to the end of the trace (3 blocks).
    // cost: lease 1 one block (14.90) + lease 2 three blocks (44.70) = 59.60
    let r = simulate(
        &trace(&[(30, 1500.0), (150, 400.0)]),
        PolicyName::PaidBlockAware,
        &Catalog::default_catalog(),
        &h100_only(),
    );
    assert_eq!(r.leases, 2, "{:#?}", r.lease_log);
    let ended: Vec<u64> = r.lease_log.iter().map(|l| l.ended_at.unwrap()).collect();
    assert_eq!(ended, vec![57 * 60_000, 180 * 60_000]);
    assert_eq!(r.cost_total, Money::from_units(59.60));
    assert_eq!(
        r.cost_by_tier.get(&Tier::Spot),
        Some(&Money::from_units(59.60))
    );
    assert_eq!(r.frames_total, r.frames_within_slo + r.frames_shed);

    // tidal releases the same surplus mid-block once it has lasted 2
    // minutes (newest first, at 43 min): here it costs the same, because
    // the hour was paid anyway, and holds fewer GPU-hours
    let t = simulate(
        &trace(&[(30, 1500.0), (150, 400.0)]),
        PolicyName::Tidal,
        &Catalog::default_catalog(),
        &h100_only(),
    );
    let ended: Vec<u64> = t.lease_log.iter().map(|l| l.ended_at.unwrap()).collect();
    assert_eq!(ended, vec![180 * 60_000, 43 * 60_000]);
    assert_eq!(t.cost_total, Money::from_units(59.60));
}

#[test]
fn simulation_is_deterministic() {
    let tr = trace(&[(60, 900.0), (60, 3000.0), (60, 200.0)]);
    let c = Catalog::default_catalog();
    let o = SimOptions::default();
    for p in PolicyName::ALL {
        assert_eq!(simulate(&tr, p, &c, &o), simulate(&tr, p, &c, &o));
    }
}

#[test]
fn day_night_goal_paid_block_aware_vs_static_peak() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("traces/day-night.csv");
    let tr = Trace::load(&path).unwrap();
    let c = Catalog::default_catalog();
    // The goal as set and measured (issue 6) on the ideal cloud: constant
    // start-ups, independent refusals and interruptions. On the default
    // cloud paid-block-aware reaches 91.9% utilisation at 33.6% of the cost
    // (docs/leasing.md, "Simulator"); `make bench-leasing` checks both
    // clouds against their own goals.
    let o = SimOptions {
        cloud: Some(CloudConfig::preset(CloudPreset::Ideal)),
        ..SimOptions::default()
    };
    let stat = simulate(&tr, PolicyName::StaticPeak, &c, &o);
    let pba = simulate(&tr, PolicyName::PaidBlockAware, &c, &o);
    let ratio = pba.cost_total.units() / stat.cost_total.units();
    eprintln!(
        "paid-block-aware: util {:.3}, SLO {:.4}, cost {:.3} of static-peak",
        pba.utilisation, pba.slo_attainment, ratio
    );
    assert!(pba.utilisation >= 0.92, "utilisation {}", pba.utilisation);
    assert!(pba.slo_attainment >= 0.99, "SLO {}", pba.slo_attainment);
    assert!(ratio <= 0.40, "cost ratio {ratio}");
}

/// Options for the queueing checks: one H100 type, no cloud randomness.
fn queued_h100() -> SimOptions {
    SimOptions {
        record_ticks: true,
        ..h100_only()
    }
}

#[test]
fn every_frame_is_within_the_slo_late_or_shed_and_the_served_ones_have_latencies() {
    // 20 min at 1500 fps, a 20 min burst at 6000 (the leases needed take
    // 150 s to start, so frames are shed meanwhile), then 20 min at 800.
    let tr = trace(&[(20, 1500.0), (20, 6000.0), (20, 800.0)]);
    let r = simulate(
        &tr,
        PolicyName::PaidBlockAware,
        &Catalog::default_catalog(),
        &queued_h100(),
    );
    assert_eq!(r.frames_total, 1500 * 1200 + 6000 * 1200 + 800 * 1200);
    assert_eq!(
        r.frames_total,
        r.frames_within_slo + r.frames_late + r.frames_shed
    );
    // no batch runs longer than planned (no jitter): none is late, and every
    // latency is within the budget and above network + one batch (2.93 ms)
    assert_eq!(r.frames_late, 0);
    assert!(r.frames_shed > 0, "the burst outran the start-up");
    let served: u64 = r.lease_log.iter().map(|l| l.frames_served).sum();
    assert_eq!(served, r.frames_within_slo + r.frames_late);
    let (p50, p95, p99) = (
        r.latency_p50_ms.unwrap(),
        r.latency_p95_ms.unwrap(),
        r.latency_p99_ms.unwrap(),
    );
    assert!(20.0 + 2.928 <= p50 && p50 <= p95 && p95 <= p99 && p99 <= 80.0);
    assert!(r.worst_tick_p95_ms.unwrap() <= 80.0);
    assert!(r.gpu_hours_running > 0.0);
    assert!((r.slo_attainment - r.frames_within_slo as f64 / r.frames_total as f64).abs() < 1e-12);
}

#[test]
fn the_autoscaler_is_shown_the_queue_and_the_latency_of_each_tick() {
    let tr = trace(&[(20, 1500.0), (20, 6000.0), (20, 800.0)]);
    let r = simulate(
        &tr,
        PolicyName::PaidBlockAware,
        &Catalog::default_catalog(),
        &queued_h100(),
    );
    // one record per tick (60 s) and one for the end
    assert_eq!(r.ticks.len(), 61);
    let arrived: u64 = r.ticks.iter().map(|t| t.arrived).sum();
    let ended: u64 = r.ticks.iter().map(|t| t.within_slo + t.late + t.shed).sum();
    assert_eq!(arrived, r.frames_total);
    assert_eq!(ended, r.frames_total);
    // while the burst outruns the fleet the queue is non-empty at some tick
    // and p95 rises towards the budget; at 800 fps on a warm fleet it is
    // far below
    let burst = &r.ticks[21..24];
    assert!(burst.iter().any(|t| t.queue_depth > 0), "{burst:#?}");
    let worst = burst.iter().filter_map(|t| t.p95_ms).fold(0.0, f64::max);
    let calm = r.ticks[50].p95_ms.unwrap();
    assert!(worst > calm, "burst p95 {worst} vs calm {calm}");
    assert!(r.ticks.iter().filter_map(|t| t.p95_ms).all(|p| p <= 80.0));
}

#[test]
fn batches_that_run_long_make_frames_late_and_cost_slo_attainment() {
    let tr = trace(&[(30, 1800.0)]);
    let c = Catalog::default_catalog();
    let exact = simulate(&tr, PolicyName::StaticPeak, &c, &queued_h100());
    let jittery = simulate(
        &tr,
        PolicyName::StaticPeak,
        &c,
        &SimOptions {
            batch_jitter: 0.5,
            ..queued_h100()
        },
    );
    assert_eq!(exact.frames_late, 0);
    assert!(jittery.frames_late > 0);
    assert_eq!(
        jittery.frames_total,
        jittery.frames_within_slo + jittery.frames_late + jittery.frames_shed
    );
    assert!(jittery.slo_attainment < exact.slo_attainment);
}

#[test]
fn bad_queue_options_are_refused_with_the_reason() {
    let o = SimOptions {
        slot_us: 0,
        ..SimOptions::default()
    };
    let e = o.queue_config().unwrap_err().to_string();
    assert!(e.contains("slot 0"), "{e}");
    let o = SimOptions {
        network_ms: 90.0,
        ..SimOptions::default()
    };
    assert!(
        o.queue_config()
            .unwrap_err()
            .to_string()
            .contains("below the budget")
    );
}
