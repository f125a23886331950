//! The verdicts, the case list and the table, from numbers alone.

use super::*;

fn report(ok: u64, sent: u64, p99: f64) -> Report {
    let mut r = Report {
        sent,
        ok,
        ..Report::default()
    };
    r.e2e_ms.p99 = p99;
    r
}

fn memory(peak: u64, back: Option<f64>) -> Memory {
    Memory {
        baseline_rss: 40 * MIB,
        peak_rss: peak,
        bound: 384 * MIB,
        after_rss: 60 * MIB,
        given_back_after_s: back,
    }
}

#[test]
fn a_case_within_every_bound_meets_every_goal() {
    let (goals, why) = judge(
        &report(400, 400, 10.0),
        &report(397, 400, 14.9),
        &memory(384 * MIB, Some(0.0)),
    );
    assert!(goals.all(), "{why:?}");
    assert!(why.is_empty(), "{why:?}");
}

#[test]
fn each_goal_fails_alone_and_says_why() {
    let base = report(400, 400, 10.0);
    let (g, why) = judge(&base, &base, &memory(384 * MIB + 1, Some(1.0)));
    assert!(!g.memory_bounded && g.memory_given_back && g.ok_share && g.p99 && g.accounted);
    assert!(why.len() == 1 && why[0].contains("peak RSS"), "{why:?}");

    let (g, why) = judge(&base, &base, &memory(MIB, None));
    assert!(!g.memory_given_back && g.memory_bounded, "{why:?}");
    assert!(why[0].contains("after the attack"), "{why:?}");

    // 395 of 400 is 98.75 %.
    let (g, why) = judge(&base, &report(395, 400, 10.0), &memory(MIB, Some(0.0)));
    assert!(!g.ok_share && g.p99, "{why:?}");
    assert!(why[0].contains("98.8 % ok"), "{why:?}");

    let (g, why) = judge(&base, &report(400, 400, 15.1), &memory(MIB, Some(0.0)));
    assert!(!g.p99 && g.ok_share, "{why:?}");
    assert!(why[0].contains("1.51×"), "{why:?}");

    let mut lost = report(400, 401, 10.0);
    lost.missing = 1;
    let (g, why) = judge(&base, &lost, &memory(MIB, Some(0.0)));
    assert!(!g.accounted && !g.all(), "{why:?}");
}

#[test]
fn frames_never_sent_count_against_the_ok_share_and_no_result_fails_the_p99() {
    let mut r = report(99, 99, 10.0);
    r.unsent = 1;
    assert!((ok_share(&r) - 0.99).abs() < 1e-9);
    let none = report(0, 10, 0.0);
    assert_eq!(p99_ratio(&report(10, 10, 5.0), &none), None);
    assert_eq!(ok_share(&Report::default()), 0.0);
    let (g, _) = judge(&report(10, 10, 5.0), &none, &memory(MIB, Some(0.0)));
    assert!(!g.p99 && !g.ok_share);
}

#[test]
fn the_bound_is_the_base_plus_two_edges_budgets_at_most_the_total() {
    let mut limits = tidegate_gateway::config::LimitsConfig::default();
    assert_eq!(
        rss_bound(&limits),
        RSS_BASE + 2 * limits.edge_inflight_bytes
    );
    limits.inflight_bytes_total = limits.edge_inflight_bytes;
    assert_eq!(rss_bound(&limits), RSS_BASE + limits.edge_inflight_bytes);
}

#[test]
fn every_attack_class_is_a_case_picked_by_prefix_and_an_unknown_name_is_refused() {
    let all = cases();
    let mut names: Vec<&str> = all.iter().map(|c| c.name).collect();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), all.len(), "unique names");
    assert_eq!(all.len(), 10, "9 classes, the liar in two kinds");
    let liars = select(&["liar".into()]).unwrap();
    assert_eq!(liars.len(), 2);
    let e = select(&["nope".into()]).unwrap_err().to_string();
    assert!(e.contains("nope") && e.contains("slowloris"), "{e}");
}

#[test]
fn counters_are_read_by_name_with_every_label_set() {
    let text = "# HELP x\ntidegate_frames_rejected_total{reason=\"memory_budget\"} 31\n\
                tidegate_frames_rejected_total{reason=\"read_timeout\"} 1\n\
                tidegate_frames_rejected_total_other 5\nprocess_resident_memory_bytes 7\n";
    let got = series(text, &COUNTERS);
    assert_eq!(got.len(), 2, "{got:?}");
    assert_eq!(
        got["tidegate_frames_rejected_total{reason=\"memory_budget\"}"],
        31.0
    );
}

#[test]
fn the_table_has_a_row_a_case_and_marks_failures() {
    let base = report(400, 400, 10.0);
    let r = CaseResult::judged(
        cases()[0].clone(),
        base.clone(),
        base,
        memory(MIB, None),
        serde_json::Value::Null,
        BTreeMap::new(),
    );
    assert_eq!((r.ok_share, r.p99_ratio), (1.0, Some(1.0)));
    let t = markdown(&[r.clone(), r], 10.0);
    assert_eq!(t.lines().count(), 4, "{t}");
    assert!(
        t.contains("partial-frames") && t.contains("**fail**"),
        "{t}"
    );
    assert!(t.contains("60 (at 60 s)"), "{t}");
}

/// A case's result with the given attacked p99 (baseline 10 ms), peak RSS
/// and accounting.
fn result(p99: f64, peak: u64, missing: u64) -> CaseResult {
    let mut attacked = report(400, 400 + missing, p99);
    attacked.missing = missing;
    CaseResult::judged(
        cases()[0].clone(),
        report(400, 400, 10.0),
        attacked,
        memory(peak, Some(0.0)),
        serde_json::Value::Null,
        BTreeMap::new(),
    )
}

#[test]
fn repeated_runs_take_the_median_ratio_and_every_runs_other_goals() {
    // the median of 1.1, 1.7 and 1.3 is the run of 1.3: the p99 goal holds
    let r = combine(vec![
        result(11.0, MIB, 0),
        result(17.0, MIB, 0),
        result(13.0, MIB, 0),
    ])
    .unwrap();
    assert!((r.p99_ratio.unwrap() - 1.3).abs() < 1e-9);
    assert_eq!(r.p99_ratios.len(), 3);
    assert!(r.goals.all() && r.failures.is_empty(), "{:?}", r.failures);
    let table = markdown(std::slice::from_ref(&r), 15.0);
    assert!(
        table.contains("1.30× (runs: 1.10×, 1.70×, 1.30×)"),
        "{table}"
    );

    // of two, the higher; a memory or accounting failure in any run fails
    // the case, and says which run
    let r = combine(vec![result(11.0, 400 * MIB, 0), result(16.0, MIB, 1)]).unwrap();
    assert!((r.p99_ratio.unwrap() - 1.6).abs() < 1e-9);
    assert!(!r.goals.p99 && !r.goals.memory_bounded && !r.goals.accounted);
    assert!(
        r.failures.iter().any(|f| f.starts_with("p99 ")),
        "{:?}",
        r.failures
    );
    assert!(
        r.failures
            .iter()
            .any(|f| f.starts_with("run 1: ") && f.contains("peak RSS")),
        "{:?}",
        r.failures
    );
    assert!(combine(Vec::new()).is_none());
}
