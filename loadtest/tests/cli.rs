//! `tidegate-loadtest --local` end to end: it starts its own cluster (a
//! gateway and a worker on 127.0.0.1), runs 2 s of one camera, and writes
//! the JSON report and its SVG picture; its SLO gate fails a run that
//! cannot meet it; a scenario runs its phases in order, each with its
//! report, picture and gate; and flags or scenarios it cannot honour are
//! refused before anything starts (for `tidegate-bench` too). Bounded in frames and time; nothing
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
            "--progress",
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
    // its gateway's URLs, and progress while it ran
    assert!(
        stderr.contains("gateway: quic 127.0.0.1:")
            && stderr.contains("status page http://127.0.0.1:"),
        "{stderr}"
    );
    let progress: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("progress "))
        .collect();
    assert!(!progress.is_empty(), "no progress line: {stderr}");
    assert!(
        progress.iter().all(|l| l.contains(" sent ")
            && l.contains(" ok ")
            && l.contains(" shed ")
            && l.contains(" p99 ")),
        "{progress:?}"
    );
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
    for bad in [["--keep-up", "--seconds=1"], ["--local", "--progress=0.01"]] {
        let out = loadtest(&bad);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad:?}: {stderr}");
        let flag = if bad[0] == "--keep-up" {
            "--local"
        } else {
            "--progress"
        };
        assert!(stderr.contains(flag), "{bad:?}: {stderr}");
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

#[test]
fn a_scenario_runs_its_phases_in_order_and_gates_each() {
    let dir = tempfile::tempdir().unwrap();
    let scenario = dir.path().join("two-phases.toml");
    // The second phase's 1 ms budget cannot be met (see above): its gate
    // fails, the first's passes.
    std::fs::write(
        &scenario,
        "min_slo_attainment = 0.5\n\
         [[phases]]\nname = \"quiet\"\nseconds = 1.5\ncameras = 1\nfps = 5\n\
         [[phases]]\nname = \"too tight\"\nseconds = 1\ncameras = 2\nfps = 5\nbudget_ms = 1\n",
    )
    .unwrap();
    let (json, svg) = (dir.path().join("r.json"), dir.path().join("s.svg"));
    let out = Command::new(env!("CARGO_BIN_EXE_tidegate-loadtest"))
        .args(["--local", "--scenario"])
        .arg(&scenario)
        .arg("--report")
        .arg(&json)
        .arg("--svg")
        .arg(&svg)
        .output()
        .expect("tidegate-loadtest runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("SLO gate failed: phase \"too tight\": attainment 0.0000 < 0.5"),
        "{stderr}"
    );
    assert!(!stderr.contains("phase \"quiet\":"), "{stderr}");
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).expect("JSON report");
    assert_eq!(report["scenario"], "two-phases");
    assert_eq!(report["passed"], false);
    let phases = report["phases"].as_array().unwrap();
    assert_eq!(phases.len(), 2);
    let (quiet, tight) = (&phases[0], &phases[1]);
    assert_eq!(quiet["name"], "quiet");
    assert_eq!(
        quiet["slo_failures"].as_array().unwrap().len(),
        0,
        "{quiet}"
    );
    assert_eq!(quiet["report"]["cameras"], 1);
    assert!(
        quiet["report"]["ok_within_budget"].as_u64().unwrap() > 0,
        "{quiet}"
    );
    assert_eq!(tight["report"]["budget_ms"], 1);
    assert_eq!(tight["report"]["cameras"], 2);
    assert_eq!(tight["min_slo_attainment"], 0.5);
    for (p, r) in [("quiet", quiet), ("too_tight", tight)] {
        // Every frame sent got exactly one result.
        assert_eq!(r["report"]["missing"], 0, "{r}");
        assert_eq!(r["report"]["duplicates"], 0, "{r}");
        let picture = std::fs::read_to_string(dir.path().join(format!("s-{p}.svg"))).unwrap();
        assert!(picture.starts_with("<svg"), "{p}");
    }
}

#[test]
fn a_bad_scenario_is_refused_before_anything_starts() {
    let dir = tempfile::tempdir().unwrap();
    let scenario = dir.path().join("bad.toml");
    std::fs::write(
        &scenario,
        "[[phases]]\nname = \"flood\"\nseconds = 1\ncameras = 5000\nfps = 5\n",
    )
    .unwrap();
    let run = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_tidegate-loadtest"))
            .args(["--local", "--scenario"])
            .arg(&scenario)
            .args(extra)
            .output()
            .expect("tidegate-loadtest runs")
    };
    let out = run(&[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("bad.toml") && stderr.contains("phase \"flood\": cameras = 5000"),
        "{stderr}"
    );
    // A scenario sets its own cameras, rates and durations.
    let out = run(&["--cameras", "3"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--cameras") && stderr.contains("--scenario"),
        "{stderr}"
    );
}

#[test]
fn the_shipped_scenarios_are_valid() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let s =
            tidegate_loadtest::scenario::Scenario::load(&path).unwrap_or_else(|e| panic!("{e}"));
        assert!(!s.phases.is_empty());
        n += 1;
    }
    assert!(n >= 1, "no scenario in {}", dir.display());
}

/// `--keep-up` keeps the local cluster up after the run, its status page
/// answering, until SIGTERM, on which it exits 0 and takes the cluster
/// down.
#[test]
fn keep_up_keeps_the_local_cluster_up_until_sigterm() {
    use std::io::{BufRead, BufReader, Read, Write};
    let mut child = Command::new(env!("CARGO_BIN_EXE_tidegate-loadtest"))
        .args(["--local", "--cameras", "1", "--fps", "5", "--seconds", "1"])
        .args(["--progress", "0", "--keep-up"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("tidegate-loadtest runs");
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let until = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let mut seen = Vec::new();
    let http = loop {
        let left = until.saturating_duration_since(std::time::Instant::now());
        let Ok(line) = rx.recv_timeout(left) else {
            let _ = child.kill();
            panic!("no keep-up line within the guard: {seen:?}");
        };
        if let Some(rest) = line.strip_prefix("keeping the cluster up: status page http://") {
            break rest.split('/').next().unwrap().to_string();
        }
        seen.push(line);
    };
    let mut conn = std::net::TcpStream::connect(&http).expect("the gateway still listens");
    conn.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    write!(
        conn,
        "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut answer = String::new();
    conn.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    tidegate_kit::signal::terminate(pid).expect("SIGTERM sent");
    let until = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if std::time::Instant::now() > until {
            let _ = child.kill();
            panic!("still up 30 s after SIGTERM");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert!(status.success(), "{status}");
    assert!(
        std::net::TcpStream::connect(&http).is_err(),
        "the gateway outlived the load generator"
    );
}

/// Each binary of the package names itself, with the workspace's version.
#[test]
fn every_binary_prints_its_own_name_and_version() {
    for (name, exe) in [
        ("tidegate-loadtest", env!("CARGO_BIN_EXE_tidegate-loadtest")),
        ("tidegate-bench", env!("CARGO_BIN_EXE_tidegate-bench")),
        ("tidegate-baseline", env!("CARGO_BIN_EXE_tidegate-baseline")),
    ] {
        let out = Command::new(exe).arg("--version").output().unwrap();
        assert!(out.status.success(), "{name}");
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            format!("{name} {}", env!("CARGO_PKG_VERSION"))
        );
    }
}
