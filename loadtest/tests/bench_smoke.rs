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

/// Runs `tidegate-bench` with `args`, killed if it runs past `limit`:
/// its exit status, stdout and stderr.
fn bench(args: &[&str], limit: Duration) -> (std::process::ExitStatus, Vec<u8>, String) {
    use std::io::Read;
    let mut child = std::process::Command::new(
        tidegate_loadtest::cluster::bin("tidegate-bench").expect("tidegate-bench built"),
    )
    .args(args)
    .stdout(std::process::Stdio::piped())
    .stderr(std::process::Stdio::piped())
    .spawn()
    .expect("tidegate-bench runs");
    // Drained on threads, so that a full pipe cannot stall the child.
    let mut stdout = child.stdout.take().expect("stdout");
    let mut stderr = child.stderr.take().expect("stderr");
    let out = std::thread::spawn(move || {
        let mut b = Vec::new();
        let _ = stdout.read_to_end(&mut b);
        b
    });
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let until = std::time::Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if std::time::Instant::now() > until {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "tidegate-bench {args:?} ran past {limit:?}\n{}",
                err.join().unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    (status, out.join().unwrap(), err.join().unwrap())
}

/// Every frame a report says was sent ended once: a result, a reset by
/// its own lane, a refusal, or lost with its connection; none missing.
fn assert_accounted(r: &serde_json::Value) {
    let n = |k: &str| {
        r[k].as_u64()
            .unwrap_or_else(|| panic!("no count {k} in {r}"))
    };
    assert!(n("sent") > 0, "{r}");
    assert_eq!(n("missing"), 0, "every frame sent got a result: {r}");
    assert_eq!(n("duplicates"), 0, "{r}");
    let ended: u64 = [
        "ok",
        "shed",
        "expired",
        "failed",
        "reset",
        "refused",
        "lost_with_connection",
    ]
    .iter()
    .map(|k| n(k))
    .sum();
    assert_eq!(ended, n("sent"), "{r}");
}

#[test]
fn hostile_benchmark_runs_a_case_beside_its_baseline_and_accounts_for_every_frame() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let (json, md) = (dir.path().join("h.json"), dir.path().join("h.md"));
    let (status, stdout, stderr) = bench(
        &[
            "--report",
            json.to_str().unwrap(),
            "hostile",
            "--cases",
            "trickle",
            "--seconds",
            "2",
            "--markdown",
            md.to_str().unwrap(),
        ],
        Duration::from_secs(300),
    );
    assert!(status.success(), "{stderr}");
    let v: serde_json::Value = serde_json::from_slice(&stdout).expect("JSON on stdout");
    let file: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("--report written"))
            .expect("JSON in --report");
    assert_eq!(v, file, "the report file holds what stdout printed");
    assert_eq!(v["bench"], "hostile");
    let cases = v["cases"].as_array().expect("cases");
    assert_eq!(cases.len(), 1, "{v}");
    let c = &cases[0];
    assert_eq!(c["case"]["name"], "trickle");
    assert_accounted(&c["baseline"]);
    assert_accounted(&c["attacked"]);
    let share = c["ok_share"].as_f64().expect("ok_share");
    assert!((0.0..=1.0).contains(&share), "{c}");
    // The memory: sampled in both runs, the bound the default budgets'.
    let m = &c["memory"];
    let bytes = |k: &str| m[k].as_u64().unwrap_or_else(|| panic!("no {k} in {m}"));
    assert!(bytes("baseline_rss") > 0 && bytes("peak_rss") > 0, "{m}");
    assert_eq!(bytes("bound"), (256 + 2 * 64) << 20, "{m}");
    // The goals are the numbers' verdicts: a reason for each one failed.
    let goals = c["goals"].as_object().expect("goals");
    assert_eq!(goals.len(), 5, "{c}");
    let failed = goals
        .values()
        .filter(|g| g.as_bool() == Some(false))
        .count();
    assert_eq!(failed, c["failures"].as_array().expect("failures").len());
    // The attack ran: its streams were opened (16 at once).
    assert!(c["attack"]["streams"].as_u64().unwrap_or(0) >= 16, "{c}");
    let table = std::fs::read_to_string(&md).expect("--markdown written");
    assert_eq!(table.lines().count(), 3, "{table}");
    assert!(
        table.lines().nth(2).unwrap().starts_with("| trickle |"),
        "{table}"
    );
}

#[test]
fn hostile_benchmark_refuses_an_unknown_case_naming_the_known_ones() {
    let (status, _, stderr) = bench(
        &["hostile", "--cases", "nope", "--seconds", "2"],
        Duration::from_secs(60),
    );
    assert!(!status.success());
    assert!(
        stderr.contains("nope") && stderr.contains("partial-frames"),
        "{stderr}"
    );
    let (status, _, stderr) = bench(&["hostile", "--seconds", "0"], Duration::from_secs(60));
    assert!(!status.success());
    assert!(stderr.contains("--seconds must be in 1..=120"), "{stderr}");
}

#[test]
fn wan_benchmark_runs_a_case_through_its_relay_and_accounts_for_every_frame() {
    // One short case of the matrix (the load generator through the relay
    // at 20 ms RTT and 1 % loss), from a model repository given by path,
    // as scripts/gpu-check.sh gives its kit's.
    let models = tidegate_loadtest::cluster::workspace_root().join("models");
    let (status, stdout, stderr) = bench(
        &[
            "wan",
            "--cases",
            "20ms-1pct-light-bbr",
            "--seconds",
            "3",
            "--worker-provider",
            "cpu",
            "--models-dir",
            models.to_str().unwrap(),
        ],
        Duration::from_secs(180),
    );
    assert!(status.success(), "{stderr}");
    let v: serde_json::Value = serde_json::from_slice(&stdout).expect("JSON report");
    assert_eq!(v["bench"], "wan");
    let cases = v["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 1, "{v}");
    assert_eq!(cases[0]["case"]["name"], "20ms-1pct-light-bbr");
    assert_eq!(cases[0]["accounted"], true, "{v}");
    assert_accounted(&cases[0]["report"]);
    // every frame answered ok crossed the relay whole
    let ok = cases[0]["report"]["ok"].as_u64().unwrap();
    let per_frame = cases[0]["report"]["bytes_per_frame"].as_u64().unwrap();
    let delivered = cases[0]["relay"]["uplink"]["delivered"]["bytes"]
        .as_u64()
        .unwrap_or_else(|| panic!("the relay's uplink bytes in {v}"));
    assert!(ok > 0 && per_frame > 0, "{v}");
    assert!(
        delivered >= ok * per_frame,
        "{delivered} B delivered < {ok} ok × {per_frame} B"
    );
}

#[test]
fn wan_benchmark_refuses_a_model_repository_without_its_test_image() {
    let dir = tempfile::tempdir().unwrap();
    let (status, _, stderr) = bench(
        &[
            "wan",
            "--seconds",
            "3",
            "--models-dir",
            dir.path().to_str().unwrap(),
        ],
        Duration::from_secs(30),
    );
    assert!(!status.success());
    assert!(
        stderr.contains("testdata/astronaut.png is missing"),
        "{stderr}"
    );
    let (status, _, stderr) = bench(
        &["wan", "--worker-provider", "tpu"],
        Duration::from_secs(30),
    );
    assert!(!status.success());
    assert!(stderr.contains("tpu"), "{stderr}");
}
