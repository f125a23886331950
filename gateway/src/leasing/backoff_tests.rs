//! The process provider's start failures: a worker that never registers
//! is ended and stopped, and a command that cannot start is retried with
//! backoff.

use std::collections::BTreeSet;

use tidegate_lease::{EndReason, LeaseState};

use super::*;

#[tokio::test]
async fn a_worker_that_never_registers_is_ended_and_its_process_stopped() {
    let dir = tempfile::tempdir().unwrap();
    // `sleep` starts fine but never dials the gateway.
    let text = format!(
        r#"
[leasing]
provider = "process"
ledger = "{}"
tick_ms = 100
start_timeout_secs = 1
[leasing.process]
command = "sleep"
args = ["30"]
[[leasing.models]]
name = "m"
instance_types = ["cpu-32"]
worker_fps = 20
min_fps = 10
"#,
        dir.path().join("l.db").display()
    );
    let cfg: crate::config::Config = toml::from_str(&text).unwrap();
    let (l, cancel, tracker) = super::tests::start(&cfg.leasing.unwrap()).await;
    let until = tokio::time::Instant::now() + Duration::from_secs(10);
    let first = loop {
        let all = l.leases(false, 100).await.unwrap();
        if let Some(r) = all.iter().find(|r| r.state.is_ended()) {
            break r.clone();
        }
        assert!(
            tokio::time::Instant::now() < until,
            "no lease timed out: {all:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        first.state,
        LeaseState::Ended(EndReason::Failed),
        "{first:?}"
    );
    assert!(first.ready_at.is_none());
    let waited = first.ended_at.unwrap() - first.requested_at;
    assert!(
        waited >= 1_000,
        "ended after {waited} ms, before the timeout"
    );
    // Its process is gone (reaped, not a zombie).
    let pid = first.pid.expect("a process lease has a pid");
    let gone = !std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|st| {
        st.rsplit_once(')')
            .is_some_and(|(_, r)| !r.trim_start().starts_with('Z'))
    });
    assert!(gone, "worker {pid} still runs");
    cancel.cancel();
    tracker.close();
    tracker.wait().await;
}

#[tokio::test]
async fn a_worker_command_that_cannot_start_is_retried_with_backoff() {
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        r#"
[leasing]
provider = "process"
ledger = "{}"
tick_ms = 100
[leasing.process]
command = "/nonexistent/tidegate-worker"
[[leasing.models]]
name = "m"
instance_types = ["cpu-32"]
worker_fps = 20
min_fps = 10
"#,
        dir.path().join("l.db").display()
    );
    let cfg: crate::config::Config = toml::from_str(&text).unwrap();
    let cfg = cfg.leasing.unwrap();
    let cancel = CancellationToken::new();
    let tracker = TaskTracker::new();
    let metrics = Metrics::new();
    let hub = crate::hub::spawn(
        crate::scheduler::Settings::default(),
        None,
        metrics.clone(),
        cancel.clone(),
        &tracker,
    );
    let l = spawn(
        &cfg,
        "127.0.0.1:4433".parse().unwrap(),
        hub,
        metrics.clone(),
        cancel.clone(),
        &tracker,
    )
    .unwrap();
    // 15 ticks: without the pause, 15 spawn attempts; with it, the
    // first, one after 1 s, none before 3 s.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // (the last try's answer may still be on its way)
    let until = tokio::time::Instant::now() + Duration::from_secs(20);
    while (l.leases(false, 100).await.unwrap().iter()).any(|r| r.state == LeaseState::Requested) {
        assert!(tokio::time::Instant::now() < until, "a try never answered");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let all = l.leases(false, 100).await.unwrap();
    assert!((1..=2).contains(&all.len()), "{all:?}");
    assert!(
        all.iter()
            .all(|r| r.state == LeaseState::Ended(EndReason::Failed)),
        "{all:?}"
    );
    // each try is an acquire error and a failed end, by its tier
    let tiers: BTreeSet<&str> = all.iter().map(|r| r.tier.as_str()).collect();
    let count = |c: &prometheus::IntCounterVec, result: &str| -> u64 {
        tiers
            .iter()
            .map(|t| c.with_label_values(&[*t, result]).get())
            .sum()
    };
    assert_eq!(count(&metrics.lease_acquires, "error"), all.len() as u64);
    assert_eq!(count(&metrics.lease_acquires, "ok"), 0);
    assert_eq!(count(&metrics.lease_ends, "failed"), all.len() as u64);
    let text = metrics.render();
    assert!(
        text.contains("tidegate_lease_acquires_total{result=\"error\""),
        "{text}"
    );
    cancel.cancel();
    tracker.close();
    tracker.wait().await;
}
