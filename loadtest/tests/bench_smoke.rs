//! The benchmarks stay runnable: a few frames through each path. Nothing
//! here asserts on speed; the numbers live in docs/benchmarks.md.

use tidegate_loadtest::{relay, schedbench};

#[test]
fn relay_benchmark_completes_every_frame_on_both_paths() {
    let r = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(relay::run(20, 2))
        .expect("relay benchmark runs");
    assert_eq!(r.sizes.len(), 2);
    for s in &r.sizes {
        assert_eq!(s.relay.frames, 20);
        assert_eq!(s.raw.frames, 20);
        assert!(s.fps_ratio.is_finite() && s.fps_ratio > 0.0, "{s:?}");
    }
    assert_eq!(r.sizes[0].payload_bytes, 128 * 128 * 3);
    assert_eq!(r.sizes[1].payload_bytes, 224 * 224 * 3);
}

#[test]
fn scheduler_benchmark_holds_its_queue_lengths() {
    for queued in [1_000, 10_000] {
        let r = schedbench::run(queued, 8, 1, 200);
        assert_eq!(r.queued, queued);
        assert!(r.arrivals_per_s > 0.0 && r.completions_per_s > 0.0);
    }
}
