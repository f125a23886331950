//! The benchmarks stay runnable: a few frames through each path. Nothing
//! here asserts on speed; the numbers live in docs/benchmarks.md.

use std::time::Duration;

use tidegate_loadtest::{relay, schedbench};

#[test]
fn relay_benchmark_completes_every_frame_on_both_paths() {
    let r = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(relay::run(20, 2, Duration::from_secs(60)))
        .expect("relay benchmark runs");
    assert_eq!(r.sizes.len(), 2);
    for s in &r.sizes {
        assert_eq!(s.relay.frames, 20, "{s:?}");
        assert_eq!(s.raw.frames, 20, "{s:?}");
        assert!(!s.relay.stopped_by_time_limit && !s.raw.stopped_by_time_limit);
        assert!(s.fps_ratio.is_finite() && s.fps_ratio > 0.0, "{s:?}");
    }
    assert_eq!(r.sizes[0].payload_bytes, 128 * 128 * 3);
    assert_eq!(r.sizes[1].payload_bytes, 224 * 224 * 3);
}

#[test]
fn relay_benchmark_sends_nothing_after_its_time_limit() {
    let r = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(relay::run(20, 2, Duration::ZERO))
        .expect("relay benchmark runs");
    for s in &r.sizes {
        for path in [&s.relay, &s.raw] {
            assert_eq!(path.frames, 0, "{s:?}");
            assert!(path.stopped_by_time_limit, "{s:?}");
        }
    }
}

#[test]
fn scheduler_benchmark_holds_its_queue_lengths() {
    for queued in [1_000, 10_000] {
        let r = schedbench::run(queued, 8, 1, 200);
        assert_eq!(r.queued, queued);
        assert!(r.arrivals_per_s > 0.0 && r.completions_per_s > 0.0);
    }
}

#[test]
fn hints_benchmark_runs_both_kinds_and_loses_nothing() {
    let out = std::process::Command::new(
        tidegate_loadtest::cluster::bin("tidegate-bench").expect("tidegate-bench built"),
    )
    .args(["hints", "--cameras", "2", "--fps", "5", "--seconds", "1"])
    .args(["--rounds", "1"])
    .output()
    .expect("tidegate-bench runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON report");
    assert_eq!(v["bench"], "hints");
    for kind in ["obeyed", "ignored"] {
        let k = &v[kind];
        assert!(k["sent"].as_u64().unwrap() > 0, "{v}");
        assert_eq!(k["missing"], 0, "every frame sent got a result: {v}");
        let ended = ["ok", "shed", "expired", "failed"]
            .iter()
            .map(|s| k[s].as_u64().unwrap())
            .sum::<u64>();
        assert_eq!(ended, k["sent"].as_u64().unwrap(), "{v}");
    }
    assert!(stderr.contains("obeying hints") && stderr.contains("ignoring hints"));
}

#[test]
fn startup_benchmark_times_both_kinds_of_start() {
    let r = tidegate_loadtest::startup::run(1, "blazeface").expect("startup benchmark runs");
    assert_eq!((r.registered_ms.len(), r.check_config_ms.len()), (1, 1));
    for ms in [r.registered_median_ms, r.check_config_median_ms] {
        assert!(ms.is_finite() && ms > 0.0, "{r:?}");
    }
    assert!(r.ratio_registered_over_check_config > 0.0, "{r:?}");
    let e = tidegate_loadtest::startup::run(0, "blazeface").unwrap_err();
    assert!(e.to_string().contains("runs must be in 1..=20"), "{e}");
}
