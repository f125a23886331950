//! The shell against a scripted provider ([`super::fake`]), on paused
//! time but for one test (see [`start_fake`]): slow or
//! panicking acquisitions and releases, failing ledger writes, adoption at
//! start, workers that never redial or stall, and the ledger's view of it.

use std::sync::Arc;

use tidegate_lease::ledger::NewLease;
use tidegate_lease::provider::{ProviderEvent, wall_clock_ms};
use tidegate_lease::{Catalog, EndReason, LeaseState, LeaseToken, Tier};

use super::fake::{FakeProvider, Script};
use super::startup::{start, start_here};
use super::*;
use crate::hub::HubMsg;

/// Bounded wait: polls `done` until it holds, failing after `guard`.
async fn eventually<F, Fut>(guard: Duration, what: &str, mut done: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let until = tokio::time::Instant::now() + guard;
    while !done().await {
        assert!(tokio::time::Instant::now() < until, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

const GUARD: Duration = Duration::from_secs(20);

fn config(dir: &std::path::Path, policy: &str, min_fps: u32) -> LeasingConfig {
    let text = format!(
        r#"
[leasing]
provider = "process"
ledger = "{}"
policy = "{policy}"
tick_ms = 100
[leasing.process]
command = "unused-by-the-fake-provider"
[[leasing.models]]
name = "m"
instance_types = ["cpu-32"]
worker_fps = 20
min_fps = {min_fps}
"#,
        dir.join("l.db").display()
    );
    let cfg: crate::config::Config = toml::from_str(&text).unwrap();
    cfg.validate().unwrap();
    cfg.leasing.unwrap()
}

/// The shell over the scripted provider, on the test's runtime and clock
/// ([`start_here`]): the tests below run on paused time, where every
/// timer of the shell, the hub and the provider fires as soon as nothing
/// else can happen first.
async fn start_fake(
    cfg: &LeasingConfig,
    script: &Arc<Script>,
) -> (Leasing, CancellationToken, TaskTracker) {
    let (l, cancel, tracker, _) = start_fake_metered(cfg, script).await;
    (l, cancel, tracker)
}

async fn start_fake_metered(
    cfg: &LeasingConfig,
    script: &Arc<Script>,
) -> (Leasing, CancellationToken, TaskTracker, Metrics) {
    let (l, _, cancel, tracker, metrics) =
        start_fake_with_hub(cfg, script, crate::scheduler::Settings::default()).await;
    (l, cancel, tracker, metrics)
}

/// [`start_fake_metered`] with the hub's scheduler `limits`, and the
/// hub.
async fn start_fake_with_hub(
    cfg: &LeasingConfig,
    script: &Arc<Script>,
    limits: crate::scheduler::Settings,
) -> (Leasing, Hub, CancellationToken, TaskTracker, Metrics) {
    let (cancel, tracker, metrics, hub, ledger, provider) = parts(cfg, script, limits);
    let l = start_here(
        cfg,
        ledger,
        std::future::ready(Ok(provider)),
        hub.clone(),
        metrics.clone(),
        cancel.clone(),
        &tracker,
    )
    .await
    .unwrap();
    (l, hub, cancel, tracker, metrics)
}

/// What a shell over the scripted provider is started with: a hub with
/// the scheduler's `limits` on the current runtime, the ledger, the
/// provider.
fn parts(
    cfg: &LeasingConfig,
    script: &Arc<Script>,
    limits: crate::scheduler::Settings,
) -> (
    CancellationToken,
    TaskTracker,
    Metrics,
    Hub,
    Ledger,
    FakeProvider,
) {
    let cancel = CancellationToken::new();
    let tracker = TaskTracker::new();
    let metrics = Metrics::new();
    let hub = crate::hub::spawn(limits, None, metrics.clone(), cancel.clone(), &tracker);
    let ledger = Ledger::open(&cfg.ledger).unwrap();
    let provider = FakeProvider::new(script.clone());
    (cancel, tracker, metrics, hub, ledger, provider)
}

/// [`start_fake`] on the shell's own thread, runtime and the system's
/// clock, as the gateway runs it: for a test whose ledger waits out
/// SQLite's busy timeout, which is real time.
fn start_fake_on_its_thread(
    cfg: &LeasingConfig,
    script: &Arc<Script>,
) -> (Leasing, CancellationToken, TaskTracker) {
    let (cancel, tracker, metrics, hub, ledger, provider) =
        parts(cfg, script, crate::scheduler::Settings::default());
    let l = start(
        cfg,
        ledger,
        std::future::ready(Ok(provider)),
        hub,
        metrics,
        cancel.clone(),
        &tracker,
    )
    .unwrap();
    (l, cancel, tracker)
}

async fn stop(cancel: CancellationToken, tracker: TaskTracker) {
    cancel.cancel();
    tracker.close();
    tracker.wait().await;
}

async fn lease(l: &Leasing, id: LeaseId) -> LeaseRecord {
    let all = l.leases(false, 100).await.unwrap();
    all.into_iter().find(|r| r.id == id).expect("in the ledger")
}

/// The first lease, once its provider has answered.
async fn first_lease(l: &Leasing) -> LeaseId {
    eventually(GUARD, "a lease acquired", || async {
        let leases = l.leases(true, 100).await.unwrap();
        leases
            .last()
            .is_some_and(|r| r.state != LeaseState::Requested)
    })
    .await;
    l.leases(true, 100).await.unwrap().last().unwrap().id
}

/// A lease whose worker registered while the ledger could not be
/// written (another writer holds its lock; a full disk does the same)
/// is ready in the table while the ledger still says starting: the
/// start timeout goes by the table and does not end it as stuck.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ready_lease_whose_ledger_write_waits_is_not_ended_by_the_start_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path(), "static-peak", 10);
    cfg.start_timeout_secs = 1;
    let script = Arc::new(Script::default());
    let (l, cancel, tracker) = start_fake_on_its_thread(&cfg, &script);
    let id = first_lease(&l).await;
    // Another writer holds the lock: the shell's writes wait out the
    // busy timeout (5 s) and fail, to be retried.
    let blocker = rusqlite::Connection::open(&cfg.ledger).unwrap();
    blocker.execute_batch("BEGIN IMMEDIATE").unwrap();
    l.registered(id).await;
    // The registration's write waits 5 s and fails; the next tick's
    // retry does the same, then that tick checks the start timeout
    // (1 s, long past) with the ledger still saying `starting`.
    tokio::time::sleep(Duration::from_secs(12)).await;
    blocker.execute_batch("ROLLBACK").unwrap();
    eventually(Duration::from_secs(30), "ready in the ledger", || async {
        lease(&l, id).await.state == LeaseState::Ready
    })
    .await;
    // Longer than a release's lead: nothing was scheduled.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(script.releases_of(id), 0);
    assert_eq!(lease(&l, id).await.state, LeaseState::Ready);
    stop(cancel, tracker).await;
}

/// A release that takes long (a Pod's grace period, a job's drain)
/// holds up nothing else: while it waits, the shell answers, and the
/// replacement the floor needs is leased and its worker logs in. The
/// lease ends only once its worker is gone.
#[tokio::test(start_paused = true)]
async fn a_long_release_holds_up_neither_the_shell_nor_the_replacement() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "static-peak", 10);
    let script = Arc::new(Script::default());
    let (l, cancel, tracker) = start_fake(&cfg, &script).await;
    let id = a_release_held_under_way(&l, &script).await;
    replaced(&l, id).await;
    let next = l.leases(true, 100).await.unwrap();
    let next = next.iter().find(|r| r.id != id).unwrap().id;
    let token = script.token(next).unwrap();
    let name = next.to_string();
    let login = tokio::time::timeout(GUARD, l.authenticate(&name, &token)).await;
    assert_eq!(login.unwrap(), Some(Ok(WorkerPass::Lease(next))));
    let rec = lease(&l, id).await;
    assert_eq!(
        rec.state,
        LeaseState::Draining,
        "not ended before its worker is gone"
    );
    assert_eq!(script.releases_of(id), 1, "one try at a time");

    script.hold_releases(false);
    eventually(GUARD, "the lease released", || async {
        lease(&l, id).await.state.is_ended()
    })
    .await;
    assert_eq!(
        lease(&l, id).await.state,
        LeaseState::Ended(EndReason::Released)
    );
    assert_eq!(script.releases_of(id), 1);
    stop(cancel, tracker).await;
}

/// An acquire the provider takes long to answer (an API server that
/// does not answer, an `sbatch` waiting on its controller) holds up
/// nothing else: the shell answers, the lease is `requested` (counted,
/// so the autoscaler asks for no other), its worker's login is put off
/// until the answer, and an operator cannot release it yet; a provider
/// event for it that comes before the answer is handled after it (a spot
/// notice: replaced at once, drained before the deadline).
#[tokio::test(start_paused = true)]
async fn a_slow_acquire_holds_up_nothing_and_its_early_events_wait_for_it() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "static-peak", 10);
    let script = Arc::new(Script::default());
    script.hold_acquires(true);
    let (l, cancel, tracker) = start_fake(&cfg, &script).await;
    eventually(GUARD, "a lease requested", || async {
        !l.leases(true, 100).await.unwrap().is_empty()
    })
    .await;
    let id = l.leases(true, 100).await.unwrap()[0].id;
    // a few ticks: still one lease asked for, and the shell answers
    tokio::time::sleep(Duration::from_millis(300)).await;
    let live = tokio::time::timeout(GUARD, l.leases(true, 100))
        .await
        .expect("the shell answers while the provider does not")
        .unwrap();
    assert_eq!(live.len(), 1, "{live:#?}");
    assert_eq!(live[0].state, LeaseState::Requested);
    let token = script.token(id).unwrap();
    let login = l.authenticate(&id.to_string(), &token).await;
    assert!(
        matches!(&login, Some(Err(r)) if r.to_string().contains("still being acquired")),
        "{login:?}"
    );
    assert_eq!(l.release(id).await, Err(ReleaseRefused::NotYetStarted(id)));
    // its spot node is reclaimed before the answer comes
    script
        .report(ProviderEvent::PreemptionNotice {
            lease: id,
            deadline: wall_clock_ms() + 60_000,
        })
        .await;
    eventually(GUARD, "the notice taken before the answer", || async {
        script.events_taken()
    })
    .await;
    assert_eq!(
        lease(&l, id).await.state,
        LeaseState::Requested,
        "kept for after the answer"
    );
    script.hold_acquires(false);
    // once acquired, the notice replaces it at once, and it serves on
    // through the notice until a drain 10 s before the deadline
    replaced(&l, id).await;
    assert_eq!(
        lease(&l, id).await.state,
        LeaseState::Starting,
        "serving on through its notice"
    );
    eventually(
        Duration::from_secs(90),
        "the notice drains it before its deadline",
        || async { lease(&l, id).await.state == LeaseState::Draining },
    )
    .await;
    stop(cancel, tracker).await;
}

/// A lease under a spot notice serves on until its drain; released by an
/// operator before then, it is drained at once and released within the
/// grace (ended `preempted`: the notice's reason stands), not left serving
/// until its worker is stopped under it.
#[tokio::test(start_paused = true)]
async fn a_lease_under_notice_released_before_its_drain_is_drained_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "static-peak", 10);
    let script = Arc::new(Script::default());
    let (l, cancel, tracker) = start_fake(&cfg, &script).await;
    let id = first_lease(&l).await;
    l.registered(id).await;
    script
        .report(ProviderEvent::PreemptionNotice {
            lease: id,
            deadline: wall_clock_ms() + 120_000,
        })
        .await;
    replaced(&l, id).await;
    assert_eq!(lease(&l, id).await.state, LeaseState::Ready, "serving on");
    l.release(id).await.unwrap();
    assert_eq!(lease(&l, id).await.state, LeaseState::Draining);
    eventually(GUARD, "released well before its deadline", || async {
        lease(&l, id).await.state.is_ended()
    })
    .await;
    assert_eq!(
        lease(&l, id).await.state,
        LeaseState::Ended(EndReason::Preempted),
        "the notice's reason stands"
    );
    assert_eq!(script.releases_of(id), 1);
    stop(cancel, tracker).await;
}

/// An acquire whose task panics (a provider's bug) may have left a
/// worker running: the provider is asked to release the lease, which
/// then ends failed, neither `requested` for ever nor billing unseen;
/// a release that fails is retried. Acquisitions go on afterwards.
#[tokio::test(start_paused = true)]
async fn a_panicking_acquire_is_released_at_its_provider_and_ends_failed() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "static-peak", 10);
    let script = Arc::new(Script::default());
    script
        .panic_acquires
        .store(true, std::sync::atomic::Ordering::SeqCst);
    script.fail_releases(true);
    let (l, cancel, tracker) = start_fake(&cfg, &script).await;
    eventually(GUARD, "a release of the panicked acquire tried", || async {
        script.release_calls.lock().unwrap().len() >= 2
    })
    .await;
    script
        .panic_acquires
        .store(false, std::sync::atomic::Ordering::SeqCst);
    let id = script.release_calls.lock().unwrap()[0];
    // its release failed: the worker may run, the lease is not over
    assert_eq!(lease(&l, id).await.state, LeaseState::Requested);
    script.fail_releases(false);
    eventually(GUARD, "the panicked lease released and ended", || async {
        lease(&l, id).await.state == LeaseState::Ended(EndReason::Failed)
    })
    .await;
    let rec = lease(&l, id).await;
    assert_eq!(rec.billing_start, None, "it never started");
    assert!(rec.ended_at.is_some());
    // the provider no longer holds it, and acquisitions go on
    let next = first_lease(&l).await;
    assert_ne!(next, id);
    stop(cancel, tracker).await;
}

/// The first lease, ready, whose release an operator asked for and
/// the provider holds under way (`Script::hold_releases`).
async fn a_release_held_under_way(l: &Leasing, script: &Script) -> LeaseId {
    let id = first_lease(l).await;
    l.registered(id).await;
    script.hold_releases(true);
    l.release(id).await.unwrap();
    eventually(GUARD, "the release under way", || async {
        script.releases_of(id) == 1
    })
    .await;
    id
}

/// The provider reports the end of a lease whose release is under way
/// (its worker exited first): the lease ends once, as released, and
/// the release's own result, coming later, changes nothing; a spot
/// notice arriving for it after its end neither drains nor replaces
/// anything.
#[tokio::test(start_paused = true)]
async fn an_end_reported_during_a_release_ends_the_lease_once() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "static-peak", 10);
    let script = Arc::new(Script::default());
    let (l, cancel, tracker, metrics) = start_fake_metered(&cfg, &script).await;
    let id = a_release_held_under_way(&l, &script).await;
    script
        .report(ProviderEvent::Ended {
            lease: id,
            reason: EndReason::Lost,
            detail: "worker exited: exit status: 0".into(),
        })
        .await;
    eventually(GUARD, "the lease ended", || async {
        lease(&l, id).await.state.is_ended()
    })
    .await;
    let rec = lease(&l, id).await;
    assert_eq!(
        rec.state,
        LeaseState::Ended(EndReason::Released),
        "as meant"
    );
    script
        .report(ProviderEvent::PreemptionNotice {
            lease: id,
            deadline: wall_clock_ms(),
        })
        .await;
    script.hold_releases(false);
    replaced(&l, id).await;
    // a few ticks for anything left to happen
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(lease(&l, id).await, rec, "ended once");
    assert_eq!(script.releases_of(id), 1);
    let tier = rec.tier.as_str();
    let ends = |reason: &str| metrics.lease_ends.with_label_values(&[tier, reason]).get();
    assert_eq!(
        (ends("released"), ends("lost"), ends("preempted")),
        (1, 0, 0)
    );
    let live = l.leases(true, 100).await.unwrap();
    assert_eq!(
        live.len(),
        1,
        "one replacement, none for the late notice: {live:?}"
    );
    stop(cancel, tracker).await;
}

#[tokio::test(start_paused = true)]
async fn a_release_the_provider_fails_keeps_the_lease_draining_and_is_retried() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "tidal", 10);
    let script = Arc::new(Script::default());
    let (l, cancel, tracker, metrics) = start_fake_metered(&cfg, &script).await;
    let id = first_lease(&l).await;

    script.fail_releases(true);
    l.release(id).await.unwrap();
    eventually(GUARD, "the release tried twice", || async {
        script.releases_of(id) >= 2
    })
    .await;
    // the worker may still run and bill: the lease is not ended
    let rec = lease(&l, id).await;
    assert_eq!(rec.state, LeaseState::Draining, "{rec:?}");
    assert!(rec.ended_at.is_none(), "{rec:?}");

    script.fail_releases(false);
    eventually(GUARD, "the lease released", || async {
        lease(&l, id).await.state.is_ended()
    })
    .await;
    let rec = lease(&l, id).await;
    assert_eq!(rec.state, LeaseState::Ended(EndReason::Released), "{rec:?}");
    // counted: its acquisition, every failed release, its end
    let tier = rec.tier.as_str();
    assert!(
        metrics
            .lease_acquires
            .with_label_values(&[tier, "ok"])
            .get()
            >= 1
    );
    assert!(metrics.lease_release_failures.get() >= 2);
    assert_eq!(
        metrics
            .lease_ends
            .with_label_values(&[tier, "released"])
            .get(),
        1
    );
    let tries = script.releases_of(id);
    assert!(tries >= 3, "released on a retry: {tries} tries");
    // each release waited only after every due lease began to drain
    assert_eq!(
        script
            .unbegun_releases
            .load(std::sync::atomic::Ordering::SeqCst),
        0
    );
    stop(cancel, tracker).await;
    // the replacement the floor needed was released at shutdown; the
    // first lease was not released again
    assert_eq!(script.releases_of(id), tries);
    let ledger = Ledger::open(&cfg.ledger).unwrap();
    assert!(ledger.live_leases().unwrap().is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_lease_whose_release_keeps_failing_is_left_live_at_shutdown_for_the_next_start() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "static-peak", 10);
    let script = Arc::new(Script::default());
    let (l, cancel, tracker) = start_fake(&cfg, &script).await;
    let id = first_lease(&l).await;
    script.fail_releases(true);
    stop(cancel, tracker).await;
    assert!(script.releases_of(id) >= 1);
    // not forgotten: still live, so the next start adopts (or ends) it
    let ledger = Ledger::open(&cfg.ledger).unwrap();
    let live: Vec<LeaseId> = ledger.live_leases().unwrap().iter().map(|r| r.id).collect();
    assert_eq!(live, vec![id]);
}

/// Starts the shell over the provider `connect` makes, on a fresh hub;
/// what `start` answers, with the tracker that waits for the shell.
fn start_connecting<C>(
    cfg: &LeasingConfig,
    connect: C,
) -> (Result<Leasing, LeasingError>, TaskTracker)
where
    C: std::future::Future<Output = Result<FakeProvider, ProviderError>> + Send + 'static,
{
    let cancel = CancellationToken::new();
    let tracker = TaskTracker::new();
    let metrics = Metrics::new();
    let limits = crate::scheduler::Settings::default();
    let hub = crate::hub::spawn(limits, None, metrics.clone(), cancel.clone(), &tracker);
    let ledger = Ledger::open(&cfg.ledger).unwrap();
    let started = start(cfg, ledger, connect, hub, metrics, cancel.clone(), &tracker);
    cancel.cancel();
    (started, tracker)
}

/// The live leases of the ledger.
fn live_in_ledger(cfg: &LeasingConfig) -> Vec<LeaseId> {
    let ledger = Ledger::open(&cfg.ledger).unwrap();
    ledger.live_leases().unwrap().iter().map(|r| r.id).collect()
}

/// Adoption runs on the shell's runtime before it serves: when the
/// provider cannot adopt (its cluster does not answer), the start fails
/// with the provider's error, and no lease is ended, since its worker may
/// well run.
#[tokio::test]
async fn a_provider_that_cannot_adopt_fails_the_start_and_ends_no_lease() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "static-peak", 0);
    let id = recorded(&cfg, false);
    let script = Arc::new(Script::default());
    script
        .fail_adopt
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let provider = FakeProvider::new(script.clone());
    let (started, tracker) = start_connecting(&cfg, std::future::ready(Ok(provider)));
    match started {
        Err(LeasingError::Provider(m)) => {
            assert!(m.contains("squeue") && m.contains("does not answer"), "{m}")
        }
        other => panic!("expected the provider's error, got {:?}", other.map(|_| ())),
    }
    assert_eq!(live_in_ledger(&cfg), vec![id], "no lease ended");
    assert!(script.release_calls.lock().unwrap().is_empty());
    tracker.close();
    tokio::time::timeout(GUARD, tracker.wait()).await.unwrap();
}

/// A provider that cannot connect (a start-up check failed) fails the
/// start with its error, before anything reads the ledger's leases.
#[tokio::test]
async fn a_provider_that_cannot_connect_fails_the_start_with_its_error() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "static-peak", 0);
    let id = recorded(&cfg, false);
    let refused = std::future::ready(Err(ProviderError::Kubernetes {
        lease: None,
        what: "listing pods in namespace \"tidegate\"".into(),
        detail: "403 Forbidden: scripted".into(),
    }));
    let (started, tracker) = start_connecting(&cfg, refused);
    match started {
        Err(LeasingError::Provider(m)) => {
            assert!(
                m.contains("listing pods") && m.contains("403 Forbidden"),
                "{m}"
            )
        }
        other => panic!("expected the provider's error, got {:?}", other.map(|_| ())),
    }
    assert_eq!(live_in_ledger(&cfg), vec![id], "no lease ended");
    tracker.close();
    tokio::time::timeout(GUARD, tracker.wait()).await.unwrap();
}

/// A provider that panics while it connects stops the shell's thread:
/// the start says so instead of waiting for an answer that never comes.
#[tokio::test]
async fn a_panic_while_connecting_fails_the_start_instead_of_hanging() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "static-peak", 0);
    let script = Arc::new(Script::default());
    let panics = true;
    let connect = async move {
        assert!(!panics, "scripted panic while connecting");
        Ok(FakeProvider::new(script))
    };
    let (started, _tracker) = start_connecting(&cfg, connect);
    match started {
        Err(e @ LeasingError::Thread(_)) => {
            assert!(
                e.to_string()
                    .contains("stopped while the provider connected"),
                "{e}"
            )
        }
        other => panic!("expected a thread error, got {:?}", other.map(|_| ())),
    }
}

/// A lease left in the ledger by a previous gateway, of the fake
/// provider, in `state` (draining: being released or under a notice).
fn recorded(cfg: &LeasingConfig, draining: bool) -> LeaseId {
    let catalog = Catalog::default_catalog();
    let mut ledger = Ledger::open(&cfg.ledger).unwrap();
    let token = LeaseToken::generate().unwrap();
    let t0 = wall_clock_ms() - 60_000;
    let id = ledger
        .insert_requested(&NewLease {
            provider: "fake",
            model: Some("m"),
            instance: catalog.get("cpu-32").unwrap(),
            tier: Tier::Spot,
            currency: &catalog.currency,
            requested_at: t0,
            token: Some(token.digest()),
        })
        .unwrap();
    ledger.mark_starting(id, t0, None, None).unwrap();
    ledger.mark_ready(id, t0 + 1000).unwrap();
    ledger.set_token_claimed(id, true).unwrap();
    if draining {
        ledger.mark_draining(id).unwrap();
    }
    id
}

#[tokio::test(start_paused = true)]
async fn an_adopted_draining_lease_is_released_at_start_and_a_ready_one_kept() {
    let dir = tempfile::tempdir().unwrap();
    // static-peak with no load neither acquires nor releases: what
    // happens is the restart's doing
    let cfg = config(dir.path(), "static-peak", 0);
    let draining = recorded(&cfg, true);
    let ready = recorded(&cfg, false);
    let script = Arc::new(Script::default());
    let (l, cancel, tracker) = start_fake(&cfg, &script).await;
    eventually(GUARD, "the draining lease released", || async {
        lease(&l, draining).await.state.is_ended()
    })
    .await;
    assert_eq!(
        lease(&l, draining).await.state,
        LeaseState::Ended(EndReason::Released)
    );
    assert_eq!(script.releases_of(draining), 1);
    // the ready one was adopted, its token re-armed, and kept
    let rec = lease(&l, ready).await;
    assert_eq!(rec.state, LeaseState::Ready, "{rec:?}");
    assert!(!rec.token_claimed, "{rec:?}");
    assert_eq!(script.releases_of(ready), 0);
    stop(cancel, tracker).await;
}

/// After a restart, an adopted ready lease whose worker never redials
/// this gateway is ended `lost` after the rejoin timeout and released;
/// one whose worker registers again is kept.
#[tokio::test(start_paused = true)]
async fn an_adopted_lease_whose_worker_never_redials_is_ended_lost() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path(), "static-peak", 0);
    cfg.rejoin_timeout_secs = 1;
    let back = recorded(&cfg, false);
    let gone = recorded(&cfg, false);
    let script = Arc::new(Script::default());
    let (l, cancel, tracker) = start_fake(&cfg, &script).await;
    l.registered(back).await;
    ended_lost_and_released(&l, &script, gone).await;
    assert_eq!(lease(&l, back).await.state, LeaseState::Ready);
    assert_eq!(script.releases_of(back), 0);
    stop(cancel, tracker).await;
}

/// A ready lease whose worker's link dropped and never came back (a
/// hung process, a lost network: its provider reports nothing) is
/// ended `lost` after the rejoin timeout, released at the provider,
/// and replaced; one whose worker redials in time is kept.
#[tokio::test(start_paused = true)]
async fn a_lease_whose_worker_never_redials_is_ended_lost_released_and_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path(), "static-peak", 10);
    cfg.rejoin_timeout_secs = 1;
    let script = Arc::new(Script::default());
    let (l, cancel, tracker) = start_fake(&cfg, &script).await;
    let id = first_lease(&l).await;
    l.registered(id).await;
    // back in time: kept
    l.disconnected(id).await;
    l.registered(id).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(lease(&l, id).await.state, LeaseState::Ready);
    assert_eq!(script.releases_of(id), 0);

    // gone for good
    l.disconnected(id).await;
    ended_lost_released_and_replaced(&l, &script, id).await;
    stop(cancel, tracker).await;
}

/// Waits for `id` to end, checks that it ended `lost` and was
/// released at the provider once, and waits for a new lease.
async fn ended_lost_released_and_replaced(l: &Leasing, script: &Script, id: LeaseId) {
    ended_lost_and_released(l, script, id).await;
    replaced(l, id).await;
}

/// Waits for `id` to end, and checks that it ended `lost` and was
/// released at the provider once.
async fn ended_lost_and_released(l: &Leasing, script: &Script, id: LeaseId) {
    eventually(GUARD, "the lease ended", || async {
        lease(l, id).await.state.is_ended()
    })
    .await;
    assert_eq!(lease(l, id).await.state, LeaseState::Ended(EndReason::Lost));
    assert_eq!(script.releases_of(id), 1, "stopped at the provider");
}

/// Waits for a live lease other than `id`.
/// Waits for a lease other than `id`, acquired.
async fn replaced(l: &Leasing, id: LeaseId) {
    eventually(GUARD, "a new lease replaces it", || async {
        l.leases(true, 100)
            .await
            .unwrap()
            .iter()
            .any(|r| r.id != id && r.state != LeaseState::Requested)
    })
    .await;
}

/// The hub drops a worker whose batch is far past due while its link
/// lives. Once, the lease is kept (a slow first batch of a new size);
/// when the worker, registered again, stalls a second time (a wedged
/// GPU), its lease is ended `lost`, released at the provider (which
/// stops the process) and replaced.
#[tokio::test(start_paused = true)]
async fn a_lease_whose_worker_stalls_twice_is_ended_lost_released_and_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "static-peak", 10);
    let script = Arc::new(Script::default());
    let limits = crate::scheduler::Settings {
        stall_us: 200_000,
        ..Default::default()
    };
    let (l, hub, cancel, tracker, metrics) = start_fake_with_hub(&cfg, &script, limits).await;
    let id = first_lease(&l).await;
    l.registered(id).await;
    let (results, _answers) = tidegate_protocol::queue::channel(8, 1 << 20);
    hub.send(HubMsg::EdgeConnected {
        edge: crate::scheduler::EdgeId(1),
        name: "e".into(),
        weight: 1,
        results,
        hints: crate::hub::HintBox::new(),
    })
    .await;
    stall_once(&hub, id, 1).await;
    eventually(GUARD, "the first stall counted", || async {
        metrics.workers_stalled.get() == 1
    })
    .await;
    // ten ticks later: kept
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(lease(&l, id).await.state, LeaseState::Ready);
    assert_eq!(script.releases_of(id), 0);

    stall_once(&hub, id, 2).await;
    ended_lost_released_and_replaced(&l, &script, id).await;
    assert_eq!(metrics.workers_stalled.get(), 2);
    stop(cancel, tracker).await;
}

/// The ledger learns when each lease's worker was last connected (at
/// most every `SEEN_EVERY`), which bills a worker found gone after a
/// restart; a lease with no worker connected is not seen.
#[tokio::test(start_paused = true)]
async fn connected_workers_are_recorded_as_seen_in_the_ledger() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "static-peak", 10);
    let script = Arc::new(Script::default());
    let (l, hub, cancel, tracker, _) =
        start_fake_with_hub(&cfg, &script, crate::scheduler::Settings::default()).await;
    let id = first_lease(&l).await;
    // a few ticks without its worker
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(lease(&l, id).await.last_seen_at, None);
    let before = wall_clock_ms();
    let _batches = leased_worker(&hub, id, 1).await;
    eventually(GUARD, "its worker recorded as seen", || async {
        lease(&l, id)
            .await
            .last_seen_at
            .is_some_and(|t| t >= before)
    })
    .await;
    stop(cancel, tracker).await;
}

#[tokio::test(start_paused = true)]
async fn frames_served_since_the_last_tick_reach_the_ledger_on_a_clean_stop() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path(), "static-peak", 10);
    // one tick, the first: everything after it is reported at the stop
    cfg.tick_ms = 3_600_000;
    let script = Arc::new(Script::default());
    let (l, hub, cancel, tracker, _) =
        start_fake_with_hub(&cfg, &script, crate::scheduler::Settings::default()).await;
    let id = first_lease(&l).await;
    let mut batches = leased_worker(&hub, id, 1).await;
    let (results, mut answers) = tidegate_protocol::queue::channel(8, 1 << 20);
    hub.send(HubMsg::EdgeConnected {
        edge: crate::scheduler::EdgeId(1),
        name: "e".into(),
        weight: 1,
        results,
        hints: crate::hub::HintBox::new(),
    })
    .await;
    for seq in 1..=3 {
        hub.send(HubMsg::Frame {
            edge: crate::scheduler::EdgeId(1),
            frame: crate::hub::tests::frame(seq),
            deadline: std::time::Instant::now() + Duration::from_secs(5),
            age: Duration::ZERO,
        })
        .await;
        let d = tokio::time::timeout(GUARD, batches.recv())
            .await
            .unwrap()
            .expect("a batch");
        let items = d
            .items
            .iter()
            .map(|i| tidegate_protocol::ItemResult {
                id: i.id,
                status: tidegate_protocol::Status::Ok,
                detections: Vec::new(),
                timings: Default::default(),
                outputs: Vec::new(),
            })
            .collect();
        hub.send(HubMsg::BatchDone {
            worker: crate::scheduler::WorkerId(1),
            result: tidegate_protocol::BatchResult {
                batch: d.batch,
                items,
            },
        })
        .await;
        let r = tokio::time::timeout(GUARD, answers.recv())
            .await
            .unwrap()
            .expect("a result");
        assert_eq!(r.status, tidegate_protocol::Status::Ok);
    }
    stop(cancel, tracker).await;
    let ledger = Ledger::open(&cfg.ledger).unwrap();
    let r = ledger.lease(id).unwrap().expect("in the ledger");
    assert_eq!(r.frames_within_slo + r.frames_late, 3, "{r:?}");
    // and the worker time each edge took, for the cost split
    let costs = ledger.costs(0, wall_clock_ms() + 1).unwrap();
    assert_eq!(costs.by_edge.keys().collect::<Vec<_>>(), ["e"], "{costs:?}");
}

/// Worker `n` registers with the hub for `lease`; its batches.
async fn leased_worker(
    hub: &Hub,
    lease: LeaseId,
    n: u64,
) -> mpsc::Receiver<tidegate_protocol::Dispatch> {
    let (dispatch, batches) = mpsc::channel(8);
    hub.send(HubMsg::WorkerConnected {
        worker: crate::scheduler::WorkerId(n),
        register: crate::hub::tests::register(),
        dispatch,
        lease: Some(lease),
        static_worker: None,
        drain: CancellationToken::new(),
    })
    .await;
    batches
}

/// Worker `n` registers for `lease` with the hub and takes frame `n`
/// of edge 1, which it never answers.
async fn stall_once(hub: &Hub, lease: LeaseId, n: u64) {
    let mut batches = leased_worker(hub, lease, n).await;
    hub.send(HubMsg::Frame {
        edge: crate::scheduler::EdgeId(1),
        frame: crate::hub::tests::frame(n),
        deadline: std::time::Instant::now() + Duration::from_secs(5),
        age: Duration::ZERO,
    })
    .await;
    let taken = tokio::time::timeout(GUARD, batches.recv()).await.unwrap();
    assert!(taken.is_some(), "worker {n} took the frame");
}

#[tokio::test(start_paused = true)]
async fn a_worker_whose_link_dropped_may_register_again_with_its_own_token_once() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "static-peak", 10);
    let script = Arc::new(Script::default());
    let (l, cancel, tracker) = start_fake(&cfg, &script).await;
    let id = first_lease(&l).await;
    let name = id.to_string();
    let token = script.token(id).unwrap();
    assert_eq!(
        l.authenticate(&name, &token).await,
        Some(Ok(WorkerPass::Lease(id)))
    );
    let again = l.authenticate(&name, &token).await.unwrap().unwrap_err();
    assert!(again.message.contains("already used"), "{again}");
    assert!(again.retry_later, "the first link may be dead unnoticed");
    l.registered(id).await;

    // its link drops: the same worker redials with the same token
    l.disconnected(id).await;
    let wrong = l.authenticate(&name, "guess").await.unwrap().unwrap_err();
    assert!(wrong.message.contains("does not match"), "{wrong}");
    assert!(!wrong.retry_later, "a wrong token is final");
    assert_eq!(
        l.authenticate(&name, &token).await,
        Some(Ok(WorkerPass::Lease(id)))
    );
    // still one connection at a time
    let again = l.authenticate(&name, &token).await.unwrap().unwrap_err();
    assert!(again.message.contains("already used"), "{again}");

    // once the lease has ended, a disconnect re-arms nothing
    l.release(id).await.unwrap();
    eventually(GUARD, "the lease released", || async {
        lease(&l, id).await.state.is_ended()
    })
    .await;
    l.disconnected(id).await;
    let gone = l.authenticate(&name, &token).await.unwrap().unwrap_err();
    assert!(gone.message.contains("not a live lease"), "{gone}");
    assert!(!gone.retry_later, "an ended lease is final");
    stop(cancel, tracker).await;
}
