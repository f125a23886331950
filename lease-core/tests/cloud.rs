//! The simulator on the cloud model (`lease-core/src/cloud.rs`): refusals by
//! cause, capacity limits, reclaim waves, start-up draws, reserved
//! commitments billed whatever is used, and a reserved floor chosen from
//! history only.

use tidegate_lease_core::autoscale::{PolicyConfig, PolicyName};
use tidegate_lease_core::catalog::{Capacity, Catalog, CatalogError, Money, Tier};
use tidegate_lease_core::cloud::{CloudConfig, CloudPreset, InterruptionCause};
use tidegate_lease_core::lifecycle::{EndReason, LeaseState};
use tidegate_lease_core::sim::{
    SimOptions, SimReport, policy_config, simulate, simulate_with, split_history,
};
use tidegate_lease_core::trace::{Trace, history_days_for};

/// Rows of `(minutes, fps)` for model `m`.
fn trace(segments: &[(u64, f64)]) -> Trace {
    let mut csv = String::from("t_secs,model,fps\n");
    let mut minute = 0u64;
    for &(len, fps) in segments {
        for _ in 0..len {
            csv.push_str(&format!("{},m,{fps}\n", minute * 60));
            minute += 1;
        }
    }
    Trace::parse("cloudy", &csv).unwrap()
}

/// Options whose serving model is coarse (20 ms slots): these tests are
/// about the cloud, and a fine queueing model would only make them slow.
fn coarse() -> SimOptions {
    SimOptions {
        slot_us: 20_000,
        record_leases: true,
        ..SimOptions::default()
    }
}

fn h100(cloud: CloudPreset) -> SimOptions {
    SimOptions {
        instance_types: Some(vec!["h100".into()]),
        cloud: Some(CloudConfig::preset(cloud)),
        ..coarse()
    }
}

/// Load that swings between 1 and 9 H100s every 40 minutes for `hours`.
fn swinging(hours: u64) -> Trace {
    let segs: Vec<(u64, f64)> = (0..hours * 60 / 40)
        .map(|k| (40, if k % 2 == 0 { 1000.0 } else { 9000.0 }))
        .collect();
    trace(&segs)
}

fn check_refusals_add_up(r: &SimReport) {
    let spot_capacity = r.refusals.capacity.get(&Tier::Spot).copied().unwrap_or(0);
    assert_eq!(
        r.spot_refusals,
        r.refusals.spot_pool + r.refusals.spot_pool_dry + spot_capacity
    );
    let refused = r
        .lease_log
        .iter()
        .filter(|l| l.state == LeaseState::Ended(EndReason::NoCapacity))
        .count() as u64;
    let all: u64 =
        r.refusals.spot_pool + r.refusals.spot_pool_dry + r.refusals.capacity.values().sum::<u64>();
    assert_eq!(refused, all);
}

#[test]
fn a_commitment_is_billed_for_the_whole_window_whatever_is_used() {
    // 2 reserved H100 committed over 6 hours: 2 × 27.68 × 6 = 332.16 CNY,
    // whether the load needs them or not
    for load in [0.0, 1500.0, 6000.0] {
        let opts = SimOptions {
            reserved_floor: Some(2),
            ..h100(CloudPreset::Default)
        };
        let r = simulate(
            &trace(&[(360, load)]),
            PolicyName::PaidBlockAware,
            &Catalog::default_catalog(),
            &opts,
        );
        let expected = Money::from_units(332.16);
        assert_eq!(r.reserved.commitment_cost, expected, "load {load}");
        assert_eq!(r.cost_by_tier.get(&Tier::Reserved), Some(&expected));
        assert!((r.reserved.committed_gpu_hours - 12.0).abs() < 1e-9);
        assert_eq!(r.reserved.commitments.len(), 1);
        assert_eq!(r.reserved.commitments[0].count, 2);
        // reserved leases cost nothing beyond it, and there are at most 2
        let reserved: Vec<_> = r
            .lease_log
            .iter()
            .filter(|l| l.tier == Tier::Reserved && l.billing_start.is_some())
            .collect();
        assert!(reserved.len() <= 2, "{reserved:?}");
        let by_tier: Money = r.cost_by_tier.values().copied().sum();
        assert_eq!(by_tier, r.cost_total);
    }
}

#[test]
fn the_reserved_floor_comes_from_history_and_history_is_not_scored() {
    // day 1 (history) never below 3000 fps: floor(3000 / 1005.38) = 2 H100s;
    // the 2 hours after it (scored) are whatever they are: the floor must
    // not change with them
    let run = |later: f64| {
        let t = trace(&[(1440, 3000.0), (120, later)]);
        simulate(
            &t,
            PolicyName::PaidBlockAware,
            &Catalog::default_catalog(),
            &coarse(),
        )
    };
    for later in [200.0, 3000.0, 9000.0] {
        let r = run(later);
        assert_eq!(r.history_hours, 24.0);
        assert!((r.hours - 2.0).abs() < 1e-9, "{}", r.hours);
        assert_eq!(
            r.frames_total,
            (later * 7200.0) as u64,
            "only the window is scored"
        );
        assert_eq!(r.reserved.commitments.len(), 1, "window at {later}");
        assert_eq!(r.reserved.commitments[0].count, 2, "window at {later}");
    }
    // a trace no longer than the history has none: no floor
    let short = simulate(
        &trace(&[(120, 3000.0)]),
        PolicyName::PaidBlockAware,
        &Catalog::default_catalog(),
        &coarse(),
    );
    assert_eq!(short.history_hours, 0.0);
    assert!(short.reserved.commitments.is_empty());
    assert_eq!(short.reserved.commitment_cost, Money::ZERO);
}

#[test]
fn the_office_weeks_floor_is_sized_from_a_week_of_history_weekday_nights_included() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("traces");
    let t = Trace::load(&dir.join("office-week.csv")).unwrap();
    assert_eq!(history_days_for("office-week"), 7);
    assert_eq!(history_days_for("day-night"), 1);
    assert_eq!(history_days_for("no-such-trace"), 1);
    let opts = SimOptions {
        history_days: history_days_for("office-week"),
        ..SimOptions::default()
    };
    let split = split_history(&t, &opts);
    let history = split.history.expect("a week of history");
    assert_eq!(history.end_ms(), 7 * 86_400_000);
    let catalog = Catalog::default_catalog();
    let cfg = policy_config(&t, PolicyName::PaidBlockAware, &catalog, &opts);
    let floor = cfg.reserved.iter().map(|f| f.count).sum::<u32>();
    // the scored week's lowest load (a weekday night, about 15 GPUs of
    // 1000 fps) keeps every committed H100 (1005 fps) busy; a Sunday alone
    // (25 GPUs) would commit more
    let lowest = split.scored.min_fps_until(split.scored.end_ms())["detector"];
    assert!(floor > 0, "{cfg:?}");
    assert!(
        f64::from(floor) * 1000.0 <= lowest,
        "floor {floor} against {lowest} fps"
    );
    let sunday = trace(&[(1440, 25_000.0), (120, 25_000.0)]);
    let one_day = policy_config(
        &sunday,
        PolicyName::PaidBlockAware,
        &catalog,
        &SimOptions::default(),
    );
    assert!(one_day.reserved[0].count > floor, "{one_day:?}");
}

#[test]
fn waves_reclaim_only_spot_leases_and_every_preemption_is_counted_once() {
    let r = simulate(
        &swinging(24),
        PolicyName::PaidBlockAware,
        &Catalog::default_catalog(),
        &h100(CloudPreset::Harsh),
    );
    assert!(r.wave_preemptions > 0, "no wave struck a lease: {r:#?}");
    assert!(
        r.wave_preemptions < r.preemptions,
        "no background preemption"
    );
    let preempted: Vec<_> = r
        .lease_log
        .iter()
        .filter(|l| l.state == LeaseState::Ended(EndReason::Preempted))
        .collect();
    assert_eq!(preempted.len() as u64, r.preemptions);
    let by_wave = preempted
        .iter()
        .filter(|l| l.interruption == Some(InterruptionCause::Wave))
        .count() as u64;
    assert_eq!(by_wave, r.wave_preemptions);
    for l in &r.lease_log {
        if l.interruption.is_some() {
            assert_eq!(l.tier, Tier::Spot, "{l:?}");
            let notice = l.notice_at.unwrap();
            assert!(l.billing_start.unwrap() <= notice, "{l:?}");
            // killed after the notice period, unless released before
            if l.state == LeaseState::Ended(EndReason::Preempted) {
                assert_eq!(l.ended_at, Some(notice + 120_000), "{l:?}");
            }
        }
    }
    // a wave reclaims several leases at the same moment
    let mut wave_times: Vec<u64> = r
        .lease_log
        .iter()
        .filter(|l| l.interruption == Some(InterruptionCause::Wave))
        .filter_map(|l| l.notice_at)
        .collect();
    wave_times.sort_unstable();
    let together = wave_times.windows(2).filter(|w| w[0] == w[1]).count();
    assert!(
        together > 0,
        "no wave took two leases at once: {wave_times:?}"
    );
    check_refusals_add_up(&r);
}

/// A lease under a preemption notice serves on until `notice_drain_ms`
/// before its kill, while its replacement starts; stopping it at the notice
/// instead (a drain as long as the notice) leaves the fleet short for the
/// whole start-up, and sheds more.
#[test]
fn a_lease_under_notice_serves_until_its_drain_and_the_fleet_sheds_less_for_it() {
    let t = swinging(12);
    let catalog = Catalog::default_catalog();
    let opts = h100(CloudPreset::Harsh);
    let cfg = policy_config(&t, PolicyName::IdleTimeoutSpot, &catalog, &opts);
    assert_eq!(cfg.notice_drain_ms, 10_000);
    let serve_on = simulate_with(&t, cfg.clone(), &catalog, &opts);
    let at_once = simulate_with(
        &t,
        PolicyConfig {
            notice_drain_ms: 120_000,
            ..cfg
        },
        &catalog,
        &opts,
    );
    for (r, drain) in [(&serve_on, 10_000), (&at_once, 120_000)] {
        assert!(r.preemptions > 5, "{}", r.preemptions);
        for l in &r.lease_log {
            if l.state != LeaseState::Ended(EndReason::Preempted) || l.ready_at.is_none() {
                continue;
            }
            let notice = l.notice_at.unwrap();
            // served until the drain (to the simulator's 10 s step), then
            // stopped, and killed at the end of the 120 s notice
            let stopped = l.stopped_at.unwrap_or_else(|| panic!("{l:?}"));
            let due = notice + 120_000 - drain;
            assert!(stopped >= due && stopped < due + 10_000, "{l:?}");
            assert_eq!(l.ended_at, Some(notice + 120_000), "{l:?}");
        }
    }
    assert!(
        serve_on.frames_shed < at_once.frames_shed,
        "serving through the notice shed {} frames, stopping at once {}",
        serve_on.frames_shed,
        at_once.frames_shed
    );
}

#[test]
fn never_more_leases_held_than_the_capacity() {
    let mut catalog = Catalog::default_catalog();
    for it in &mut catalog.instances {
        it.capacity = Capacity {
            on_demand: Some(3),
            spot: Some(2),
        };
    }
    for p in [PolicyName::StaticPeak, PolicyName::PaidBlockAware] {
        let r = simulate(&swinging(6), p, &catalog, &h100(CloudPreset::Default));
        let limits = [(Tier::OnDemand, 3), (Tier::Spot, 2)];
        for (tier, limit) in limits {
            // at every billing start, count what that tier holds
            let held = |at: u64| {
                r.lease_log
                    .iter()
                    .filter(|l| l.tier == tier)
                    .filter(|l| l.billing_start.is_some_and(|s| s <= at))
                    .filter(|l| l.ended_at.is_none_or(|e| e > at))
                    .count()
            };
            for l in r.lease_log.iter().filter(|l| l.tier == tier) {
                if let Some(s) = l.billing_start {
                    assert!(held(s) <= limit, "{p}: {tier} over {limit} at {s}");
                }
            }
        }
        assert!(
            r.refusals.capacity.values().sum::<u64>() > 0,
            "{p}: the limit never bound"
        );
        assert!(r.frames_shed > 0, "{p}: 9 H100s of load on 5 should shed");
        check_refusals_add_up(&r);
    }
}

#[test]
fn harsh_start_ups_are_2_8_times_the_default_ones() {
    let t = swinging(12);
    let catalog = Catalog::default_catalog();
    let d = simulate(&t, PolicyName::Tidal, &catalog, &h100(CloudPreset::Default));
    let h = simulate(&t, PolicyName::Tidal, &catalog, &h100(CloudPreset::Harsh));
    let i = simulate(&t, PolicyName::Tidal, &catalog, &h100(CloudPreset::Ideal));
    // catalog H100: median 150 s, p95 300 s; tens of draws: loose bounds
    assert!((120.0..=180.0).contains(&d.startup_median_secs), "{d:#?}");
    assert!(
        (220.0..=400.0).contains(&d.startup_p95_secs),
        "{}",
        d.startup_p95_secs
    );
    assert!(
        (336.0..=504.0).contains(&h.startup_median_secs),
        "{}",
        h.startup_median_secs
    );
    assert_eq!((i.startup_median_secs, i.startup_p95_secs), (150.0, 150.0));
    assert_eq!(i.wave_preemptions, 0, "the ideal cloud has no waves");
    assert_eq!(
        i.refusals.spot_pool_dry, 0,
        "the ideal cloud has no dry pools"
    );
}

#[test]
fn the_catalog_cloud_section_selects_the_preset_and_options_override_it() {
    let text = tidegate_lease_core::catalog::DEFAULT_CATALOG_TOML
        .replace("preset = \"default\"", "preset = \"harsh\"");
    let harsh = Catalog::from_toml(&text).unwrap();
    assert_eq!(harsh.cloud, CloudConfig::preset(CloudPreset::Harsh));
    let t = trace(&[(120, 2000.0)]);
    let opts = coarse();
    let r = simulate(&t, PolicyName::Tidal, &harsh, &opts);
    assert_eq!(r.cloud.params().preset, CloudPreset::Harsh);
    let opts = SimOptions {
        cloud: Some(CloudConfig::preset(CloudPreset::Ideal)),
        ..opts
    };
    let r = simulate(&t, PolicyName::Tidal, &harsh, &opts);
    assert_eq!(r.cloud.params().preset, CloudPreset::Ideal);
}

#[test]
fn bad_cloud_and_start_up_fields_are_refused_naming_them() {
    let base = tidegate_lease_core::catalog::DEFAULT_CATALOG_TOML;
    let e = Catalog::from_toml(&base.replace("preset = \"default\"", "wave_fraction = 0.0"))
        .unwrap_err();
    assert!(matches!(e, CatalogError::Cloud(_)), "{e}");
    assert!(e.to_string().contains("wave_fraction"), "{e}");
    let e =
        Catalog::from_toml(&base.replacen("startup_p95_secs = 300", "startup_p95_secs = 100", 1))
            .unwrap_err();
    assert!(e.to_string().contains("startup_p95_secs"), "{e}");
    assert!(e.to_string().contains("\"v100\""), "{e}");
    let e = Catalog::from_toml(&base.replacen("spot = 100 }", "spot = 100, reserved = 3 }", 1))
        .unwrap_err();
    assert!(matches!(e, CatalogError::Parse(_)), "{e}");
}

#[test]
fn a_catalog_without_the_new_fields_keeps_a_constant_start_up_and_no_limits() {
    let mut text = String::new();
    for line in tidegate_lease_core::catalog::DEFAULT_CATALOG_TOML.lines() {
        let new = ["startup_p95_secs", "capacity", "[cloud]", "preset"];
        if !new.iter().any(|k| line.starts_with(k)) {
            text.push_str(line);
            text.push('\n');
        }
    }
    let c = Catalog::from_toml(&text).unwrap();
    let h = c.get("h100").unwrap();
    assert_eq!(h.startup_p95_secs, h.startup_secs);
    assert_eq!(h.capacity, Capacity::default());
    assert_eq!(c.cloud, CloudConfig::default());
}

#[test]
fn runs_on_every_preset_are_deterministic() {
    let t = swinging(2);
    let c = Catalog::default_catalog();
    for preset in CloudPreset::ALL {
        let o = h100(preset);
        for p in [PolicyName::StaticPeak, PolicyName::PaidBlockAware] {
            assert_eq!(
                simulate(&t, p, &c, &o),
                simulate(&t, p, &c, &o),
                "{preset} {p}"
            );
        }
    }
}
