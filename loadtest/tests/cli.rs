//! `tidegate-loadtest --local` end to end: it starts its own cluster (a
//! gateway and a worker on 127.0.0.1), runs 2 s of one camera, and writes
//! the JSON report and its SVG picture; its SLO gate fails a run that
//! cannot meet it; and flags it cannot honour are refused before anything
//! starts (for `tidegate-bench` too). Bounded in frames and time; nothing
//! asserts on speed.

use std::process::Command;

use serde_json::Value;

#[test]
fn a_local_run_writes_the_json_report_and_its_svg() {
    let dir = tempfile::tempdir().unwrap();
    let (json, svg) = (dir.path().join("r.json"), dir.path().join("r.svg"));
    let out = Command::new(env!("CARGO_BIN_EXE_tidegate-loadtest"))
        .args([
            "--local",
            "--workers",
            "1",
            "--cameras",
            "1",
            "--fps",
            "5",
            "--seconds",
            "2",
            "--min-slo-attainment",
            "0.5",
        ])
        .arg("--report")
        .arg(&json)
        .arg("--svg")
        .arg(&svg)
        // A shell set up for a remote gateway: --local ignores it, and so
        // do the gateway, worker and edge it starts.
        .env("TIDEGATE_GATEWAY_ADDR", "127.0.0.1:9")
        .env("TIDEGATE_CA", "/nonexistent/ca.pem")
        .env("TIDEGATE_EDGE_TOKEN", "not-the-token")
        .output()
        .expect("tidegate-loadtest runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}\n{stderr}", out.status);
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).expect("JSON report");
    let sent = report["sent"].as_u64().unwrap();
    assert!(sent > 0, "{report}");
    assert_eq!(report["missing"], 0, "{report}");
    let cdf = report["e2e_cdf_ms"].as_array().expect("the latency CDF");
    assert_eq!(cdf.len(), 102, "{report}");
    assert_eq!(cdf.last().unwrap()[1], 1.0);
    let picture = std::fs::read_to_string(&svg).unwrap();
    assert!(picture.starts_with("<svg "), "{picture}");
    assert!(picture.contains("id=\"cdf\""), "{picture}");
    assert!(
        picture.contains(&format!("{sent} frames sent")),
        "{picture}"
    );
}

#[test]
fn a_local_run_of_another_edge_and_model_that_misses_its_slo_exits_non_zero() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("r.json");
    // A 1 ms budget cannot be met at any speed: the gateway keeps a 2 ms
    // return margin, so every frame's deadline has passed on arrival and
    // none is dispatched; no frame is ok within budget.
    let out = Command::new(env!("CARGO_BIN_EXE_tidegate-loadtest"))
        .args([
            "--local",
            "--edge",
            "lab-edge",
            "--model",
            "emotion",
            "--cameras",
            "1",
            "--fps",
            "5",
            "--seconds",
            "1",
            "--budget-ms",
            "1",
            "--min-slo-attainment",
            "0.5",
        ])
        .arg("--report")
        .arg(&json)
        .output()
        .expect("tidegate-loadtest runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the gate passed: {stderr}");
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("SLO gate failed: attainment 0.0000 < 0.5"),
        "{stderr}"
    );
    // The run itself worked: edge lab-edge was accepted and the workers
    // served the emotion model's input (the camera opened and frames went).
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).expect("JSON report");
    assert!(report["sent"].as_u64().unwrap() > 0, "{report}");
    assert_eq!(report["ok_within_budget"], 0, "{report}");
    assert_eq!(report["slo_attainment"], 0.0, "{report}");
}

#[test]
fn flags_it_cannot_honour_are_refused_before_anything_starts() {
    let loadtest = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_tidegate-loadtest"))
            .args(args)
            .env_remove("TIDEGATE_GATEWAY_ADDR")
            .env_remove("TIDEGATE_CA")
            .env_remove("TIDEGATE_EDGE_TOKEN")
            .output()
            .expect("tidegate-loadtest runs")
    };
    for bad in ["1.5", "-0.1", "NaN", "most"] {
        let out = loadtest(&["--local", &format!("--min-slo-attainment={bad}")]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad}: {stderr}");
        assert!(
            stderr.contains("--min-slo-attainment") && stderr.contains(bad),
            "{bad}: {stderr}"
        );
    }
    let out = loadtest(&["--local", "--min-slo-attainment=1.5"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("not a fraction in [0, 1]"), "{stderr}");

    // --local makes its own gateway: an address, CA or token flag is
    // refused, not silently ignored.
    for flag in [
        ["--gateway", "127.0.0.1:4433"],
        ["--ca", "ca.pem"],
        ["--token", "t"],
    ] {
        let out = loadtest(&["--local", flag[0], flag[1]]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flag:?}: {stderr}");
        assert!(
            stderr.contains("cannot be used with") && stderr.contains(flag[0]),
            "{flag:?}: {stderr}"
        );
    }

    // The scheduler benchmark's work is bounded too.
    let out = Command::new(env!("CARGO_BIN_EXE_tidegate-bench"))
        .args(["scheduler", "--samples", "1000", "--per-sample", "1000000"])
        .output()
        .expect("tidegate-bench runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("more than 10000000 decisions"), "{stderr}");
}
