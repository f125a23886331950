//! `deploy/prometheus/workers_edges.yml`, the alerts on the series that
//! workers and edges export, against Prometheus's own `promtool`: the rules
//! parse, their unit tests in `workers_edges_test.yml` pass (each alert
//! fires on series that should trip it and stays quiet on others), they use
//! only series a worker or an edge exports (as listed in
//! `deploy/grafana/series/`, which each crate holds equal to what it
//! exports), and every alert has a firing test case, a quiet one and a
//! runbook line in `docs/operations.md`. (`rules.yml`, on the gateway's
//! series, is `deploy/tests/deploy.rs`'s.) `promtool` is unpacked into
//! the cache by `scripts/setup.sh`.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use tidegate_testkit::promtool::{run_promtool, series_in};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

fn read(path: &str) -> String {
    let p = repo().join(path);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// The names after `key` on lines of `text` that start with it.
fn values_of<'a>(text: &'a str, key: &str) -> Vec<&'a str> {
    text.lines()
        .filter_map(|l| l.trim_start().strip_prefix(key))
        .map(str::trim)
        .collect()
}

#[test]
fn worker_and_edge_rules_pass_promtool_and_their_unit_tests() {
    let checked = run_promtool(
        &["check", "rules", "workers_edges.yml"],
        &repo().join("deploy/prometheus"),
    );
    assert!(checked.contains("SUCCESS"), "{checked}");
    let tested = run_promtool(
        &["test", "rules", "workers_edges_test.yml"],
        &repo().join("deploy/prometheus"),
    );
    assert!(tested.contains("SUCCESS"), "{tested}");
}

#[test]
fn worker_and_edge_rules_use_only_series_that_workers_and_edges_export() {
    let mut exported = BTreeSet::new();
    for who in ["worker", "edge"] {
        let list = read(&format!("deploy/grafana/series/{who}.txt"));
        exported.extend(list.lines().filter(|l| !l.is_empty()).map(String::from));
    }
    let used = series_in(&read("deploy/prometheus/workers_edges.yml"));
    let unknown: Vec<_> = used.difference(&exported).collect();
    assert!(
        unknown.is_empty(),
        "workers_edges.yml uses series no worker or edge exports: {unknown:?}"
    );
    for name in [
        "tidegate_worker_gpu_memory_used_bytes",
        "tidegate_worker_gpu_temperature_celsius",
        "tidegate_edge_uplink_lost_packets_total",
        "tidegate_edge_uplink_reconnects_total",
        "tidegate_edge_frames_dropped_total",
    ] {
        assert!(used.contains(name), "no rule on {name}");
    }
}

/// Each alert is tested firing (a case with expected alerts) and quiet
/// (`exp_alerts: []`), and named in the runbook.
#[test]
fn every_worker_and_edge_alert_is_tested_both_ways_and_has_a_runbook_line() {
    let rules = read("deploy/prometheus/workers_edges.yml");
    let tests = read("deploy/prometheus/workers_edges_test.yml");
    let docs = read("docs/operations.md");
    let alerts = values_of(&rules, "- alert:");
    assert!(alerts.len() >= 5, "{alerts:?}");
    let lines: Vec<&str> = tests.lines().map(str::trim).collect();
    for alert in alerts {
        let (mut fires, mut quiet) = (false, false);
        for (i, l) in lines.iter().enumerate() {
            if l.strip_prefix("alertname:").map(str::trim) != Some(alert) {
                continue;
            }
            match lines.get(i + 1) {
                Some(&"exp_alerts: []") => quiet = true,
                Some(&"exp_alerts:") => fires = true,
                other => panic!("{alert}: unexpected line after its alertname: {other:?}"),
            }
        }
        assert!(fires, "{alert}: no test case in which it fires");
        assert!(quiet, "{alert}: no test case in which it stays quiet");
        assert!(
            docs.contains(&format!("`{alert}`")),
            "{alert}: no runbook line in docs/operations.md"
        );
    }
}
