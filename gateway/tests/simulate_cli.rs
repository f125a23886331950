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

#[test]
fn generate_trace_writes_a_seeded_trace_that_simulate_replays() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("flips.csv");
    let o = gateway()
        .args(["generate-trace", "--kind", "flip", "--seed", "3", "--out"])
        .arg(&file)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let written = std::fs::read_to_string(&file).unwrap();
    // 48 hours, one row a minute, after the comment and the header
    let rows: Vec<&str> = written
        .lines()
        .filter(|l| !l.starts_with('#') && *l != "t_secs,model,fps")
        .collect();
    assert_eq!(rows.len(), 48 * 60);
    assert!(written.contains("kind flip, seed 3"), "{written}");

    let printed = |seed: &str| {
        let o = gateway()
            .args(["generate-trace", "--kind", "flip", "--seed", seed])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8(o.stdout).unwrap()
    };
    // the same seed gives the same rows (the name comes from the file)
    let again = printed("3");
    let body = |s: &str| {
        s.lines()
            .filter(|l| !l.starts_with('#'))
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert_eq!(body(&again), body(&written));
    assert_ne!(body(&printed("4")), body(&written));

    // the whole file parses as a trace; its first three hours replay
    let t = tidegate_lease::trace::Trace::parse("flips", &written).unwrap();
    assert_eq!(t.rows.len(), 48 * 60);
    let head: Vec<&str> = rows[..180].to_vec();
    let short = dir.path().join("flips-3h.csv");
    std::fs::write(&short, format!("t_secs,model,fps\n{}\n", head.join("\n"))).unwrap();
    let o = gateway()
        .args(["simulate", "--policy", "idle-timeout-spot", "--trace"])
        .arg(&short)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(r["trace"], "flips-3h");
    assert_eq!(r["policy"], "idle-timeout-spot");
    let fps: f64 = head
        .iter()
        .map(|l| l.rsplit(',').next().unwrap().parse::<f64>().unwrap())
        .sum();
    let total = r["frames_total"].as_f64().unwrap();
    // every minute's frames arrive; fractions carry over, so at most one is lost
    assert!(
        (total - fps * 60.0).abs() <= 1.0,
        "{total} vs {}",
        fps * 60.0
    );
}

#[test]
fn generate_trace_refuses_an_unknown_kind_in_one_line() {
    let o = gateway()
        .args(["generate-trace", "--kind", "sawtooth"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("unknown trace kind \"sawtooth\"") && err.contains("weekly"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}

/// Two hours at a constant 2000 frames/s.
fn flat_trace(dir: &std::path::Path) -> std::path::PathBuf {
    let mut csv = String::from("t_secs,model,fps\n");
    for m in 0..120 {
        csv += &format!("{},det,2000\n", m * 60);
    }
    let p = dir.join("flat.csv");
    std::fs::write(&p, csv).unwrap();
    p
}

#[test]
fn own_vs_rent_prices_owning_static_peaks_fleet_next_to_every_policy() {
    let dir = tempfile::tempdir().unwrap();
    // 26,280 over 3 years = 1.00 an hour, ops 876 a year = 0.10 an hour,
    // 0.5 kW at 0.8 = 0.40 a busy hour
    let o = gateway()
        .args(["own-vs-rent", "--trace"])
        .arg(flat_trace(dir.path()))
        .args([
            "--purchase-per-gpu",
            "26280",
            "--years",
            "3",
            "--kw-per-gpu",
            "0.5",
            "--price-per-kwh",
            "0.8",
            "--ops-per-gpu-year",
            "876",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let f = |v: &serde_json::Value| v.as_f64().unwrap();
    let owned = &v["owned"];
    let (fleet, hours, busy) = (
        f(&owned["fleet_gpus"]),
        f(&owned["hours"]),
        f(&owned["busy_gpu_hours"]),
    );
    assert!(fleet >= 2.0 && (hours - 2.0).abs() < 1e-9, "{owned}");
    let close = |a: f64, b: f64| (a - b).abs() < 1e-6 * b.abs().max(1.0);
    assert!(
        close(f(&owned["depreciation"]), fleet * hours * 1.0),
        "{owned}"
    );
    assert!(close(f(&owned["ops"]), fleet * hours * 0.1), "{owned}");
    assert!(close(f(&owned["power"]), busy * 0.4), "{owned}");
    assert!(close(f(&owned["purchase"]), fleet * 26_280.0), "{owned}");
    let rentals = v["rentals"].as_array().unwrap();
    let labels: Vec<&str> = rentals
        .iter()
        .map(|r| r["label"].as_str().unwrap())
        .collect();
    assert_eq!(
        labels,
        [
            "static-peak",
            "reactive-idle-timeout",
            "idle-timeout-spot",
            "tidal",
            "paid-block-aware"
        ]
    );
    for r in rentals {
        let per_busy = f(&r["cost"]) / f(&r["busy_gpu_hours"]);
        assert!(close(f(&r["cost_per_busy_gpu_hour"]), per_busy), "{r}");
        assert!(
            close(f(&r["break_even_utilisation"]), 1.1 / (per_busy - 0.4)),
            "{r}"
        );
    }

    // a purchase is required
    let o = gateway()
        .args(["own-vs-rent", "--trace", "t.csv", "--kw-per-gpu", "0.5"])
        .args(["--price-per-kwh", "0.8"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("--purchase-per-gpu"), "{err}");
}
