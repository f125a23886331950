//! The uplink adaptation policy over random sequences of windows, with a
//! clock that jumps: the quality stays within [floor, highest], the rate cap
//! within (0, configured], one knob moves at a time, the rate moves down
//! only at the quality floor and the quality up only at the full rate,
//! pressure never raises and a clean window never lowers, a raise comes
//! only after enough clean windows in a row, and clean windows always bring
//! the camera back to its highest quality at its configured rate.

use std::time::Duration;

use proptest::prelude::*;
use tidegate_edge::adapt::{
    CLEAN_TO_RAISE, Decision, FitConfig, LinkFit, PathWindow, QualityRange, Step, Verdict,
    WindowStats,
};

fn config() -> impl Strategy<Value = FitConfig> {
    (
        prop::option::of((1u8..=100, 1u8..=100)),
        prop_oneof![Just(10.0), Just(0.2), 0.1f64..60.0],
        10u64..2000,
        any::<bool>(),
        0u32..10,
    )
        .prop_map(|(q, max_fps, budget_ms, slow_start, phase)| FitConfig {
            quality: q.map(|(a, b)| QualityRange::new(a.max(b), a.min(b))),
            max_fps,
            budget: Duration::from_millis(budget_ms),
            slow_start,
            phase,
        })
}

fn window() -> impl Strategy<Value = WindowStats> {
    let counts = (0u64..30, 0u64..30, 0u64..5, 0u64..5, 0u64..20, 0u64..5);
    let path = prop::option::of((0u64..200, 0u64..100, 0u64..1000, 0u64..50, 0u64..3, 0u64..3));
    prop_oneof![
        // Idle.
        Just(WindowStats::default()),
        // Clean: everything across promptly.
        (1u64..30, 0u64..20).prop_map(|(n, rtt_ms)| WindowStats {
            handed: n,
            delivered: n,
            bytes: n * 5000,
            ack_us: n * rtt_ms * 1000,
            path: Some(PathWindow {
                rtt: Duration::from_millis(rtt_ms),
                min_rtt: Duration::from_millis(rtt_ms),
                ..PathWindow::default()
            }),
            ..WindowStats::default()
        }),
        // Anything.
        (counts, path, 0u64..2_000_000).prop_map(
            |((handed, delivered, expired, superseded, results, late), path, ack)| WindowStats {
                handed,
                delivered,
                expired,
                superseded,
                bytes: handed * 4000,
                ack_us: delivered * ack,
                results,
                late: late.min(results),
                path: path.map(|(rtt, min, sent, lost, pressed, queued)| PathWindow {
                    rtt: Duration::from_millis(rtt),
                    min_rtt: Duration::from_millis(min.min(rtt)),
                    cwnd: 14_720,
                    sent_packets: sent,
                    lost_packets: lost.min(sent),
                    pressed_windows: pressed.max(queued),
                    queued_windows: queued,
                    slow_start_over: pressed > 0,
                }),
                ..WindowStats::default()
            }
        ),
    ]
}

/// Clock steps (µs): mostly a window, sometimes a jump either way.
fn clock_step() -> impl Strategy<Value = i64> {
    prop_oneof![
        8 => Just(1_000_000i64),
        1 => -5_000_000i64..5_000_000,
        1 => 0i64..600_000_000,
    ]
}

/// Checks one decision against the state before it.
fn check(
    cfg: &FitConfig,
    fit: &LinkFit,
    before: (Option<u8>, f64),
    d: &Decision,
    clean_run: u32,
    slow_start: bool,
) -> Result<(), TestCaseError> {
    let (q0, f0) = before;
    let (q1, f1) = (d.quality, d.max_fps);
    prop_assert_eq!(q1, fit.quality());
    prop_assert_eq!(f1, fit.max_fps());
    match (cfg.quality, q1) {
        (Some(r), Some(q)) => prop_assert!(q >= r.min && q <= r.max, "{q} outside {r:?}"),
        (None, None) => {}
        (c, q) => prop_assert!(false, "quality {q:?} for {c:?}"),
    }
    prop_assert!(f1.is_finite() && f1 > 0.0 && f1 <= cfg.max_fps, "rate {f1}");
    prop_assert!(f1 >= fit.min_fps());
    let floor = cfg.quality.map(|r| r.min);
    match d.step {
        Step::Hold => prop_assert!(q1 == q0 && f1 == f0),
        Step::QualityDown => prop_assert!(q1 < q0 && f1 == f0),
        Step::RateDown => {
            prop_assert!(f1 < f0 && q1 == q0);
            prop_assert_eq!(q0, floor, "the rate went down above the quality floor");
        }
        Step::RateUp => prop_assert!(f1 > f0 && q1 == q0),
        Step::QualityUp => {
            prop_assert!(q1 > q0 && f1 == f0);
            prop_assert_eq!(f0, cfg.max_fps, "the quality went up below the full rate");
        }
    }
    match d.verdict {
        Verdict::Pressed(_) => prop_assert!(matches!(
            d.step,
            Step::Hold | Step::QualityDown | Step::RateDown
        )),
        Verdict::Clean => {
            prop_assert!(matches!(
                d.step,
                Step::Hold | Step::RateUp | Step::QualityUp
            ))
        }
        Verdict::Idle | Verdict::Fair => prop_assert_eq!(d.step, Step::Hold),
    }
    if matches!(d.step, Step::RateUp | Step::QualityUp) {
        // Slow start raises after one clean window, and only the quality
        // (the rate starts at the configured one and only a pressed
        // window, which ends slow start, lowers it).
        let needed = if slow_start { 1 } else { CLEAN_TO_RAISE };
        prop_assert!(
            clean_run >= needed,
            "a raise after {clean_run} clean windows (slow start: {slow_start})"
        );
    }
    if matches!(d.verdict, Verdict::Pressed(_)) {
        prop_assert!(!fit.in_slow_start(), "a pressed window ends slow start");
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn over_random_windows_the_policy_keeps_its_bounds_and_its_order(
        cfg in config(),
        steps in prop::collection::vec((window(), clock_step()), 1..120),
    ) {
        let mut fit = LinkFit::new(cfg);
        // Slow start begins at the floor, otherwise at the top.
        let start = cfg.quality.map(|r| if cfg.slow_start { r.min } else { r.max });
        prop_assert_eq!(fit.quality(), start);
        prop_assert_eq!(fit.max_fps(), cfg.max_fps);
        let mut now: u64 = 10_000_000_000;
        // Clean windows since the last pressed or fair window or raise,
        // idle ones not counted.
        let mut clean_run = 0u32;
        for (w, dt) in &steps {
            now = now.saturating_add_signed(*dt);
            let before = (fit.quality(), fit.max_fps());
            let slow_start = fit.in_slow_start();
            let verdict = fit.verdict(w);
            if verdict == Verdict::Clean {
                clean_run += 1;
            } else if verdict != Verdict::Idle {
                clean_run = 0;
            }
            let d = fit.on_window(now, w);
            prop_assert_eq!(d.verdict, verdict);
            check(&cfg, &fit, before, &d, clean_run, slow_start)?;
            if d.step != Step::Hold {
                clean_run = 0;
            }
        }
        // However it got here, a clean link brings it all the way back.
        let clean = WindowStats {
            handed: 5,
            delivered: 5,
            bytes: 20_000,
            ack_us: 5_000,
            ..WindowStats::default()
        };
        for _ in 0..2000 {
            now += 1_000_000;
            fit.on_window(now, &clean);
        }
        prop_assert_eq!(fit.quality(), cfg.quality.map(|r| r.max));
        prop_assert_eq!(fit.max_fps(), cfg.max_fps);
    }
}
