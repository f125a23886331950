//! `tidegate-gateway simulate` through the real binary.

use std::process::Command;

fn gateway() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tidegate-gateway"));
    // what an operator sees: no backtrace under the error line
    c.env("RUST_LIB_BACKTRACE", "0").env("RUST_BACKTRACE", "0");
    c
}

#[test]
fn simulate_prints_and_writes_the_json_report() {
    let dir = tempfile::tempdir().unwrap();
    let mut csv = String::from("# a test trace\nt_secs,model,fps\n");
    for m in 0..60 {
        // an hour: 500 frames/s, then 1500 from minute 30
        let fps = if m < 30 { 500 } else { 1500 };
        csv += &format!("{},det,{fps}\n", m * 60);
    }
    let trace = dir.path().join("step.csv");
    std::fs::write(&trace, csv).unwrap();
    let out = dir.path().join("r.json");
    let o = gateway()
        .args([
            "simulate",
            "--policy",
            "reactive-idle-timeout",
            "--seed",
            "3",
            "--trace",
        ])
        .arg(&trace)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let printed: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let written: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(printed, written);
    assert_eq!(printed["trace"], "step");
    assert_eq!(printed["policy"], "reactive-idle-timeout");
    assert_eq!(printed["frames_total"], 30 * 60 * 500 + 30 * 60 * 1500);
    assert!(
        printed["cost_by_tier"]["on_demand"].as_f64().unwrap() > 0.0,
        "{printed}"
    );
}

#[test]
fn simulate_refuses_a_bad_policy_and_a_missing_file_in_one_line() {
    let o = gateway()
        .args(["simulate", "--policy", "nope", "--trace", "x.csv"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("unknown policy \"nope\""), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");

    let o = gateway()
        .args([
            "simulate",
            "--policy",
            "tidal",
            "--trace",
            "/nonexistent/t.csv",
        ])
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("/nonexistent/t.csv"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}
