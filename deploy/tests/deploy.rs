//! deploy/ against the gateway that it watches: the Prometheus rules pass
//! Prometheus's own `promtool` (syntax and the unit tests in
//! `rules_test.yml`), every PromQL query of the Grafana dashboard parses,
//! and both use only series the gateway exports (the dashboard also those
//! that workers and edges export on their own `/metrics`, listed in
//! `deploy/grafana/series/`), while the dashboard shows every one of the
//! gateway's. `promtool` is unpacked into the cache by `scripts/setup.sh`.

use std::collections::BTreeSet;

use serde_json::Value;
use tidegate_deploy::workspace_root;
use tidegate_gateway::metrics::Metrics;
use tidegate_testkit::promtool::{run_promtool, series_in};

fn dashboard() -> Value {
    let path = workspace_root().join("deploy/grafana/tidegate.json");
    let text = std::fs::read_to_string(&path).expect("dashboard file");
    serde_json::from_str(&text).expect("the dashboard is JSON")
}

/// Every panel's queries, with Grafana's variables replaced by what
/// Prometheus would receive.
fn dashboard_queries(d: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for p in d["panels"].as_array().expect("panels") {
        for t in p["targets"].as_array().into_iter().flatten() {
            let expr = t["expr"].as_str().expect("every target has an expr");
            let expr = expr
                .replace("$__rate_interval", "5m")
                .replace("$__range", "6h")
                .replace("$model", ".*");
            out.push((p["title"].as_str().unwrap_or("?").to_string(), expr));
        }
    }
    out
}

#[test]
fn alert_rules_pass_promtool_and_their_unit_tests() {
    let dir = workspace_root().join("deploy/prometheus");
    let checked = run_promtool(&["check", "rules", "rules.yml"], &dir);
    assert!(checked.contains("SUCCESS"), "{checked}");
    let tested = run_promtool(&["test", "rules", "rules_test.yml"], &dir);
    assert!(tested.contains("SUCCESS"), "{tested}");
}

#[test]
fn every_dashboard_query_is_valid_promql() {
    // promtool parses PromQL when it checks rules: each query becomes one
    // recording rule of a scratch file
    let queries = dashboard_queries(&dashboard());
    assert!(queries.len() >= 15, "{queries:?}");
    let mut yaml = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, (_, q)) in queries.iter().enumerate() {
        yaml.push_str(&format!(
            "      - record: dashboard:query{i}\n        expr: {}\n",
            serde_json::to_string(q).expect("a JSON string is a YAML string")
        ));
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("queries.yml"), yaml).unwrap();
    let out = run_promtool(&["check", "rules", "queries.yml"], dir.path());
    assert!(
        out.contains(&format!("SUCCESS: {} rules found", queries.len())),
        "{out}"
    );
}

#[test]
fn the_dashboard_is_a_grafana_model_with_no_overlapping_panels() {
    let d = dashboard();
    assert_eq!(d["uid"], "tidegate-overview");
    assert!(d["schemaVersion"].as_u64().unwrap() >= 36);
    let vars: Vec<&str> = d["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v["name"].as_str())
        .collect();
    assert_eq!(vars, ["datasource", "model"]);
    let mut ids = BTreeSet::new();
    let mut cells = BTreeSet::new();
    for p in d["panels"].as_array().unwrap() {
        let title = p["title"].as_str().expect("every panel has a title");
        assert!(ids.insert(p["id"].as_u64().unwrap()), "{title}: id reused");
        let g = &p["gridPos"];
        let n = |k: &str| {
            g[k].as_u64()
                .unwrap_or_else(|| panic!("{title}: gridPos.{k}"))
        };
        assert!(n("x") + n("w") <= 24, "{title} is wider than the grid");
        for x in n("x")..n("x") + n("w") {
            for y in n("y")..n("y") + n("h") {
                assert!(
                    cells.insert((x, y)),
                    "{title} overlaps another panel at ({x},{y})"
                );
            }
        }
        if p["type"] != "row" {
            assert_eq!(p["datasource"]["uid"], "${datasource}", "{title}");
            let targets = p["targets"].as_array().expect("targets");
            assert!(!targets.is_empty(), "{title} has no query");
            assert!(
                p["description"].as_str().is_some_and(|s| !s.is_empty()),
                "{title} says nothing about what it shows"
            );
        }
    }
}

/// The series a worker and an edge export on their own `/metrics`, as
/// listed in `deploy/grafana/series/{worker,edge}.txt`. These tests do not
/// build the worker and edge crates; each of those holds its list
/// equal to what it exports (`the_series_file_lists_exactly_what_a_worker_exports`,
/// `..._an_edge_exports`).
fn worker_and_edge_series() -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for who in ["worker", "edge"] {
        let path = workspace_root().join(format!("deploy/grafana/series/{who}.txt"));
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let names: Vec<&str> = text.lines().filter(|l| !l.is_empty()).collect();
        assert!(
            names
                .iter()
                .any(|n| n.starts_with(&format!("tidegate_{who}_"))),
            "{} lists no tidegate_{who}_ series",
            path.display()
        );
        out.extend(names.into_iter().map(String::from));
    }
    out
}

#[test]
fn rules_and_dashboard_use_only_exported_series_and_show_them_all() {
    let gateway: BTreeSet<String> = Metrics::new().series_names().into_iter().collect();
    let others = worker_and_edge_series();
    let rules =
        std::fs::read_to_string(workspace_root().join("deploy/prometheus/rules.yml")).unwrap();
    let in_rules = series_in(&rules);
    let unknown: Vec<_> = in_rules.difference(&gateway).collect();
    assert!(
        unknown.is_empty(),
        "rules.yml uses series the gateway does not export: {unknown:?}"
    );
    assert!(in_rules.contains("tidegate_frames_total"), "{in_rules:?}");

    let queries: String = dashboard_queries(&dashboard())
        .into_iter()
        .map(|(_, q)| q + "\n")
        .collect();
    let in_dashboard = series_in(&queries);
    let everyone: BTreeSet<String> = gateway.union(&others).cloned().collect();
    let unknown: Vec<_> = in_dashboard.difference(&everyone).collect();
    assert!(
        unknown.is_empty(),
        "the dashboard uses series that neither the gateway, a worker nor an edge exports: {unknown:?}"
    );
    // The "Workers and edges" row: GPU utilisation, memory and power, the
    // worker's batch time, edge camera rates and drops, uplink RTT and loss.
    for name in [
        "tidegate_worker_gpu_utilization_ratio",
        "tidegate_worker_gpu_memory_used_bytes",
        "tidegate_worker_gpu_power_watts",
        "tidegate_worker_gpu_info",
        "tidegate_worker_batch_run_seconds_bucket",
        "tidegate_edge_frames_seen_total",
        "tidegate_edge_frames_dropped_total",
        "tidegate_edge_uplink_rtt_seconds",
        "tidegate_edge_frames_unanswered",
    ] {
        assert!(
            in_dashboard.contains(name),
            "{name} is not on the dashboard"
        );
    }
    assert!(
        queries.contains("process_cpu_seconds_total")
            && queries.contains("process_resident_memory_bytes"),
        "the gateway's CPU and memory are on the dashboard"
    );
    // every metric is on the dashboard (a histogram by any of its series)
    let shown = |name: &str| {
        let base = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .unwrap_or(name);
        in_dashboard
            .iter()
            .any(|n| n == name || n.starts_with(base))
    };
    // The standard process_* metrics are the process's, not tidegate's:
    // the dashboard shows CPU and memory of them, not all seven.
    let missing: Vec<_> = gateway
        .iter()
        .filter(|n| !n.starts_with("process_") && !shown(n))
        .collect();
    assert!(missing.is_empty(), "not on the dashboard: {missing:?}");
}

#[test]
fn series_names_are_found_whole() {
    let found = series_in(
        "rate(tidegate_frames_total{a=\"b\"}[5m]) / tidegate:x:y + xtidegate_no + tidegate_e2e_latency_seconds_bucket",
    );
    assert_eq!(
        found.into_iter().collect::<Vec<_>>(),
        [
            "tidegate_e2e_latency_seconds_bucket",
            "tidegate_frames_total"
        ]
    );
}
