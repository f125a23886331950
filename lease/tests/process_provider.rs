//! The process provider with real child processes (`sleep 30` stands in for
//! `tidegate-worker`). Waits are bounded by timeouts that only guard against
//! a hang; no test asserts how fast anything happens.

use std::path::Path;
use std::time::Duration;

use tidegate_lease::catalog::{Catalog, Tier};
use tidegate_lease::ledger::{Ledger, NewLease};
use tidegate_lease::lifecycle::{EndReason, LeaseState};
use tidegate_lease::provider::process::{ProcessConfig, ProcessProvider, pid_alive};
use tidegate_lease::provider::{LeaseSpec, Provider, ProviderError, ProviderEvent, wall_clock_ms};
use tidegate_lease::table::{LeaseId, LeaseToken};

const GUARD: Duration = Duration::from_secs(20);

fn spec(id: u64, tier: Tier, preempt_after: Option<Duration>) -> LeaseSpec {
    LeaseSpec {
        lease: LeaseId(id),
        token: LeaseToken::generate().unwrap(),
        instance: Catalog::default_catalog().get("h100").unwrap().clone(),
        tier,
        preempt_after,
    }
}

fn sleeper() -> ProcessConfig {
    ProcessConfig::new("sleep", &["30"])
}

/// Polls (bounded) until `/proc/<pid>` is gone or a zombie.
async fn wait_dead(pid: u32) -> bool {
    for _ in 0..500 {
        if !pid_alive(pid) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

/// The worker's environment. Right after spawn the kernel may still be
/// finishing `execve` (the new environment is not yet published and reads
/// as empty), so this polls, bounded.
async fn environ(pid: u32) -> Vec<String> {
    let mut env = Vec::new();
    for _ in 0..200 {
        env = std::fs::read(format!("/proc/{pid}/environ"))
            .unwrap()
            .split(|b| *b == 0)
            .filter(|s| !s.is_empty())
            .map(|s| String::from_utf8_lossy(s).into_owned())
            .collect();
        if !env.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    env
}

#[tokio::test]
async fn acquire_runs_a_worker_bound_to_its_lease_and_release_reaps_it() {
    let mut p = ProcessProvider::new(sleeper());
    let s = spec(7, Tier::OnDemand, None);
    let token = s.token.clone();
    let a = p.acquire(s).await.unwrap();
    let pid = a.pid.unwrap();
    assert!(pid_alive(pid), "worker should be running");
    let env = environ(pid).await;
    assert!(env.contains(&"TIDEGATE_LEASE_ID=7".to_string()), "{env:?}");
    assert!(env.contains(&format!("TIDEGATE_LEASE_TOKEN={}", token.expose())));
    assert!(env.contains(&"TIDEGATE_INSTANCE_TYPE=h100".to_string()));
    assert!(env.contains(&"TIDEGATE_LEASE_TIER=on_demand".to_string()));
    assert_eq!(
        a.provider_data.as_deref(),
        Some(r#"{"cmdline":["sleep","30"]}"#)
    );
    assert!(matches!(
        p.acquire(spec(7, Tier::OnDemand, None)).await,
        Err(ProviderError::Duplicate(LeaseId(7)))
    ));

    p.release(LeaseId(7)).await.unwrap();
    // killed AND reaped: no /proc entry at all, not even a zombie
    assert!(
        !Path::new(&format!("/proc/{pid}")).exists(),
        "worker not reaped"
    );
    assert!(matches!(
        p.release(LeaseId(7)).await,
        Err(ProviderError::UnknownLease(_))
    ));
}

#[tokio::test]
async fn simulated_spot_preemption_sends_a_notice_then_kills_after_the_period() {
    let mut cfg = sleeper();
    cfg.notice_period_secs = 2.0;
    let mut p = ProcessProvider::new(cfg);
    let mut events = p.take_events().unwrap();
    let before = wall_clock_ms();
    let a = p
        .acquire(spec(1, Tier::Spot, Some(Duration::from_millis(100))))
        .await
        .unwrap();
    let pid = a.pid.unwrap();
    let ev = tokio::time::timeout(GUARD, events.recv())
        .await
        .unwrap()
        .unwrap();
    let ProviderEvent::PreemptionNotice { lease, deadline } = ev else {
        panic!("expected a notice first, got {ev:?}");
    };
    assert_eq!(lease, LeaseId(1));
    assert!(
        deadline >= before + 2000,
        "deadline must be a notice period away"
    );
    // during the notice the worker still runs
    assert!(pid_alive(pid));
    let ev = tokio::time::timeout(GUARD, events.recv())
        .await
        .unwrap()
        .unwrap();
    assert!(
        matches!(
            ev,
            ProviderEvent::Ended {
                lease: LeaseId(1),
                reason: EndReason::Preempted,
                ..
            }
        ),
        "{ev:?}"
    );
    assert!(
        wall_clock_ms() >= deadline - 50,
        "killed before the deadline"
    );
    assert!(
        !Path::new(&format!("/proc/{pid}")).exists(),
        "preempted worker not reaped"
    );
}

#[tokio::test]
async fn on_demand_lease_is_never_preempted_by_the_simulation() {
    let mut cfg = sleeper();
    cfg.notice_period_secs = 0.1;
    let mut p = ProcessProvider::new(cfg);
    let mut events = p.take_events().unwrap();
    let a = p
        .acquire(spec(1, Tier::OnDemand, Some(Duration::from_millis(10))))
        .await
        .unwrap();
    let r = tokio::time::timeout(Duration::from_millis(500), events.recv()).await;
    assert!(r.is_err(), "no event expected, got {r:?}");
    assert!(pid_alive(a.pid.unwrap()));
    p.shutdown().await;
    assert!(!Path::new(&format!("/proc/{}", a.pid.unwrap())).exists());
}

#[tokio::test]
async fn worker_that_dies_is_reported_lost() {
    let mut p = ProcessProvider::new(ProcessConfig::new("sh", &["-c", "exit 3"]));
    let mut events = p.take_events().unwrap();
    p.acquire(spec(3, Tier::Spot, None)).await.unwrap();
    let ev = tokio::time::timeout(GUARD, events.recv())
        .await
        .unwrap()
        .unwrap();
    match ev {
        ProviderEvent::Ended {
            lease: LeaseId(3),
            reason: EndReason::Lost,
            detail,
        } => assert!(detail.contains('3'), "{detail}"),
        other => panic!("{other:?}"),
    }
    // an ended lease is no longer held (its supervisor returns right after
    // reporting it): a shutdown has nothing to release, and the provider's
    // map does not grow with ended leases
    let until = tokio::time::Instant::now() + GUARD;
    while !p.held().is_empty() {
        assert!(tokio::time::Instant::now() < until, "{:?}", p.held());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(p.pid(LeaseId(3)), None);
}

/// `preempt_spot_after_secs` preempts every spot lease whose spec names
/// no delay of its own, and no lease of another tier.
#[tokio::test]
async fn the_configured_preemption_delay_applies_to_spot_leases_only() {
    let mut cfg = sleeper();
    cfg.notice_period_secs = 0.5;
    cfg.preempt_spot_after_secs = Some(0.1);
    let mut p = ProcessProvider::new(cfg);
    let mut events = p.take_events().unwrap();
    p.acquire(spec(1, Tier::OnDemand, None)).await.unwrap();
    p.acquire(spec(2, Tier::Spot, None)).await.unwrap();
    let ev = tokio::time::timeout(GUARD, events.recv())
        .await
        .unwrap()
        .unwrap();
    assert!(
        matches!(
            ev,
            ProviderEvent::PreemptionNotice {
                lease: LeaseId(2),
                ..
            }
        ),
        "{ev:?}"
    );
    let ev = tokio::time::timeout(GUARD, events.recv())
        .await
        .unwrap()
        .unwrap();
    assert!(
        matches!(
            ev,
            ProviderEvent::Ended {
                lease: LeaseId(2),
                reason: EndReason::Preempted,
                ..
            }
        ),
        "{ev:?}"
    );
    // the on-demand lease was never preempted: still held, no event
    assert_eq!(p.held(), vec![LeaseId(1)]);
    assert!(events.try_recv().is_err());
    p.shutdown().await;
}

#[test]
fn preemption_delays_that_would_panic_a_duration_are_refused() {
    let mut cfg = sleeper();
    cfg.preempt_spot_after_secs = Some(6.0);
    assert!(cfg.validate().is_ok());
    for bad in [1e20, -1.0, f64::NAN, f64::INFINITY] {
        cfg.preempt_spot_after_secs = Some(bad);
        let e = cfg.validate().unwrap_err();
        assert!(e.contains("preempt_spot_after_secs"), "{e}");
    }
}

#[test]
fn notice_periods_that_would_panic_a_duration_are_refused() {
    let mut cfg = sleeper();
    assert!(cfg.validate().is_ok());
    for bad in [1e20, -1.0, f64::NAN, f64::INFINITY] {
        cfg.notice_period_secs = bad;
        let e = cfg.validate().unwrap_err();
        assert!(e.contains("notice_period_secs"), "{e}");
    }
    cfg.notice_period_secs = 1.0;
    cfg.command = " ".into();
    assert!(cfg.validate().unwrap_err().contains("command"));
}

#[tokio::test]
async fn an_unvalidated_huge_notice_period_does_not_panic_the_provider() {
    // the provider clamps what validate() would refuse instead of
    // panicking in Duration::from_secs_f64 at the first spot acquire
    let mut cfg = sleeper();
    cfg.notice_period_secs = 1e20;
    let mut p = ProcessProvider::new(cfg);
    let a = p
        .acquire(spec(1, Tier::Spot, Some(Duration::from_secs(3600))))
        .await
        .unwrap();
    assert_eq!(p.held(), vec![LeaseId(1)]);
    p.release(a.lease).await.unwrap();
}

#[tokio::test]
async fn dropping_the_provider_kills_its_workers() {
    let mut p = ProcessProvider::new(sleeper());
    let pid = p
        .acquire(spec(1, Tier::Reserved, None))
        .await
        .unwrap()
        .pid
        .unwrap();
    drop(p);
    assert!(wait_dead(pid).await, "worker {pid} outlived its provider");
}

#[tokio::test]
async fn spawn_failure_is_a_clear_error() {
    let mut p = ProcessProvider::new(ProcessConfig::new("/nonexistent/tidegate-worker", &[]));
    let e = p.acquire(spec(1, Tier::Spot, None)).await.unwrap_err();
    assert!(matches!(e, ProviderError::Spawn { .. }));
    assert!(
        e.to_string().contains("/nonexistent/tidegate-worker"),
        "{e}"
    );
}

fn record(ledger: &mut Ledger, catalog: &Catalog, token: &LeaseToken) -> LeaseId {
    ledger
        .insert_requested(&NewLease {
            provider: "process",
            model: Some("detector"),
            instance: catalog.get("h100").unwrap(),
            tier: Tier::OnDemand,
            currency: &catalog.currency,
            requested_at: wall_clock_ms(),
            token: Some(token.digest()),
        })
        .unwrap()
}

#[tokio::test]
async fn restart_adopts_live_workers_and_ends_dead_ones_in_the_ledger() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger.sqlite");
    let catalog = Catalog::default_catalog();
    let (alive_id, dead_id, never_id, alive_pid, dead_pid, seen_at);
    {
        // gateway #1: two workers, and a lease that never got started
        let mut ledger = Ledger::open(&path).unwrap();
        let mut p = ProcessProvider::new(sleeper());
        let mut ids = Vec::new();
        let mut pids = Vec::new();
        for _ in 0..2 {
            let token = LeaseToken::generate().unwrap();
            let id = record(&mut ledger, &catalog, &token);
            let a = p
                .acquire(LeaseSpec {
                    lease: id,
                    token,
                    instance: catalog.get("h100").unwrap().clone(),
                    tier: Tier::OnDemand,
                    preempt_after: None,
                })
                .await
                .unwrap();
            ledger
                .mark_starting(id, wall_clock_ms(), a.pid, a.provider_data.as_deref())
                .unwrap();
            ids.push(id);
            pids.push(a.pid.unwrap());
        }
        never_id = record(&mut ledger, &catalog, &LeaseToken::generate().unwrap());
        // the gateway last heard from both workers at `seen_at`
        seen_at = wall_clock_ms();
        ledger.mark_seen(&ids, seen_at).unwrap();
        (alive_id, dead_id) = (ids[0], ids[1]);
        (alive_pid, dead_pid) = (pids[0], pids[1]);
        // the gateway "crashes": workers keep running
        p.detach_all().await;
    }
    assert!(pid_alive(alive_pid) && pid_alive(dead_pid));
    // one worker dies while the gateway is down
    tidegate_kit::signal::send(dead_pid, tidegate_kit::signal::Signal::Kill).expect("SIGKILL");
    assert!(wait_dead(dead_pid).await);

    // gateway #2 over the same ledger file
    let mut ledger = Ledger::open(&path).unwrap();
    let mut p = ProcessProvider::new(sleeper());
    let adoption = p.adopt(&mut ledger, wall_clock_ms()).await.unwrap();
    assert_eq!(adoption.adopted, vec![alive_id]);
    let mut ended = adoption.ended.clone();
    ended.sort_by_key(|(id, _)| *id);
    assert_eq!(
        ended,
        vec![(dead_id, EndReason::Lost), (never_id, EndReason::Failed)]
    );
    let dead = ledger.lease(dead_id).unwrap().unwrap();
    assert_eq!(dead.state, LeaseState::Ended(EndReason::Lost));
    // billed to when it was last heard from, not to this restart
    assert_eq!(dead.ended_at, Some(seen_at));
    assert_eq!(dead.last_seen_at, Some(seen_at));
    assert_eq!(p.pid(alive_id), Some(alive_pid));
    let live: Vec<LeaseId> = ledger.live_leases().unwrap().iter().map(|r| r.id).collect();
    assert_eq!(live, vec![alive_id]);

    // the adopted worker is really ours: releasing it kills it
    p.release(alive_id).await.unwrap();
    assert!(wait_dead(alive_pid).await);
    ledger
        .mark_ended(alive_id, wall_clock_ms(), EndReason::Released)
        .unwrap();
    assert!(ledger.live_leases().unwrap().is_empty(), "a lease leaked");
}

#[tokio::test]
async fn a_reused_pid_running_something_else_is_not_adopted() {
    let dir = tempfile::tempdir().unwrap();
    let mut ledger = Ledger::open(&dir.path().join("l.sqlite")).unwrap();
    let catalog = Catalog::default_catalog();
    let id = record(&mut ledger, &catalog, &LeaseToken::generate().unwrap());
    // record our own pid (alive, but running the test binary) as the worker
    ledger
        .mark_starting(
            id,
            wall_clock_ms(),
            Some(std::process::id()),
            Some(r#"{"cmdline":["sleep","30"]}"#),
        )
        .unwrap();
    let mut p = ProcessProvider::new(sleeper());
    let adoption = p.adopt(&mut ledger, wall_clock_ms()).await.unwrap();
    assert!(adoption.adopted.is_empty());
    assert_eq!(adoption.ended, vec![(id, EndReason::Lost)]);
}
