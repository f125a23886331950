//! `tidegate-loadtest --local` end to end: it starts its own cluster (a
//! gateway and a BlazeFace worker on 127.0.0.1), runs 2 s of one camera,
//! and writes the JSON report and its SVG picture. Bounded in frames and
//! time; nothing asserts on speed.

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
