//! Start-up: builds the autoscaler's policy from the config, then, on the
//! shell's own thread and runtime, connects the provider, adopts the
//! ledger's live leases whose worker still runs (their tokens re-armed),
//! ends the rest, and runs the shell. The caller waits until the shell
//! serves, or for the reason it cannot.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::time::Duration;

use tidegate_lease::autoscale::{self, Autoscaler, PolicyConfig, ReservedFloor, ScheduleEntry};
use tidegate_lease::ledger::Ledger;
use tidegate_lease::pacing::{AcquireBackoff, ReleaseQueue};
use tidegate_lease::provider::{ProviderError, ProviderEvent};
use tidegate_lease::{Catalog, EndReason, LeaseId, LeaseState, LeaseTable, Millis, Money, Tier};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, info, info_span, warn};

use super::book::LeaseBook;
use super::shell::{Shell, WallClock};
use super::{INBOX, LeaseSource, Leasing, LeasingError, LeasingMsg, RELEASE_LEAD};
use crate::config::LeasingConfig;
use crate::hub::Hub;
use crate::metrics::Metrics;

/// Starts the shell over the provider that `connect` makes: on the
/// shell's thread, the provider connects and adopts, then the shell runs.
/// Returns once it serves, or with why it could not start.
pub(super) fn start<P, C>(
    cfg: &LeasingConfig,
    ledger: Ledger,
    connect: C,
    hub: Hub,
    metrics: Metrics,
    cancel: CancellationToken,
    tracker: &TaskTracker,
) -> Result<Leasing, LeasingError>
where
    P: LeaseSource,
    C: Future<Output = Result<P, ProviderError>> + Send + 'static,
{
    let (open, rx, tx) = prepare(cfg, ledger, connect, hub, metrics, WallClock::System)?;
    let tick = Duration::from_millis(cfg.tick_ms);
    spawn_shell(open, rx, tick, cancel, tracker)?;
    Ok(Leasing { tx })
}

/// [`start`] on the caller's runtime instead of a thread of its own, with
/// a wall clock that follows Tokio's ([`WallClock::follows_tokio`]): for
/// tests on paused time, where the shell, the hub, the provider and the
/// test must share one clock. The shell is a task of `tracker`.
#[cfg(test)]
pub(super) async fn start_here<P, C>(
    cfg: &LeasingConfig,
    ledger: Ledger,
    connect: C,
    hub: Hub,
    metrics: Metrics,
    cancel: CancellationToken,
    tracker: &TaskTracker,
) -> Result<Leasing, LeasingError>
where
    P: LeaseSource,
    C: Future<Output = Result<P, ProviderError>> + Send + 'static,
{
    let clock = WallClock::follows_tokio();
    let (open, rx, tx) = prepare(cfg, ledger, connect, hub, metrics, clock)?;
    let tick = Duration::from_millis(cfg.tick_ms);
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    tracker.spawn(
        async move {
            match open().await {
                Ok((shell, events)) => {
                    let _ = started_tx.send(Ok(()));
                    shell.run(rx, events, tick, cancel).await;
                }
                Err(e) => {
                    let _ = started_tx.send(Err(e));
                }
            }
        }
        .instrument(info_span!("leasing")),
    );
    started_rx
        .await
        .map_err(|_| LeasingError::Thread(std::io::Error::other("the shell's task panicked")))??;
    Ok(Leasing { tx })
}

/// What [`start`] and [`start_here`] share: the autoscaler from the
/// config, the shell's inbox, and how to open the shell (connect, adopt).
#[allow(clippy::type_complexity)]
fn prepare<P, C>(
    cfg: &LeasingConfig,
    ledger: Ledger,
    connect: C,
    hub: Hub,
    metrics: Metrics,
    clock: WallClock,
) -> Result<
    (
        impl FnOnce() -> ShellOpening<P> + Send + 'static,
        mpsc::Receiver<LeasingMsg>,
        mpsc::Sender<LeasingMsg>,
    ),
    LeasingError,
>
where
    P: LeaseSource,
    C: Future<Output = Result<P, ProviderError>> + Send + 'static,
{
    let catalog = cfg.load_catalog()?;
    let policy = cfg.policy_name()?;
    let pc = policy_config(cfg, policy, &metrics, &catalog.currency);
    let autoscaler = Autoscaler::new(pc, catalog.clone());
    let (tx, rx) = mpsc::channel(INBOX);
    let cfg = cfg.clone();
    let open = move || -> ShellOpening<P> {
        Box::pin(async move {
            let provider = connect
                .await
                .map_err(|e| LeasingError::Provider(e.to_string()))?;
            open_shell(
                &cfg, ledger, provider, autoscaler, catalog, hub, metrics, clock,
            )
            .await
        })
    };
    Ok((open, rx, tx))
}

/// Opening the shell: the provider connected and the ledger's leases
/// adopted, or why not.
type ShellOpening<P> = std::pin::Pin<
    Box<
        dyn Future<Output = Result<(Shell<P>, mpsc::Receiver<ProviderEvent>), LeasingError>> + Send,
    >,
>;

/// Adopts with `provider` the ledger's live leases whose worker still runs,
/// ends the rest, and makes the shell, with its provider's events.
#[allow(clippy::too_many_arguments)]
async fn open_shell<P: LeaseSource>(
    cfg: &LeasingConfig,
    mut ledger: Ledger,
    mut provider: P,
    autoscaler: Autoscaler,
    catalog: Catalog,
    hub: Hub,
    metrics: Metrics,
    clock: WallClock,
) -> Result<(Shell<P>, mpsc::Receiver<ProviderEvent>), LeasingError> {
    let ledger_err = |source| LeasingError::Ledger {
        path: cfg.ledger.clone(),
        source,
    };
    let now = clock.now_ms();
    // Adopt what still runs, end the rest: no lease outlives its worker.
    let adopted = adopt_live(cfg, &mut ledger, &mut provider, now).await?;
    let mut table = ledger.load_table().map_err(ledger_err)?;
    let epoch = tokio::time::Instant::now();
    let mut book = LeaseBook::new(cfg.rejoin_timeout_secs.saturating_mul(1000));
    let releases = rearm_adopted(cfg, &mut ledger, &mut table, &adopted, &mut book)?;
    let events = provider
        .take_events()
        .ok_or_else(|| LeasingError::Provider("provider events already taken".into()))?;

    let mut shell = Shell {
        autoscaler,
        catalog,
        models: cfg.models.clone(),
        ledger,
        table,
        provider,
        hub,
        metrics,
        measured: HashMap::new(),
        static_names: HashMap::new(),
        static_links: HashMap::new(),
        epoch,
        clock,
        releases,
        backoff: AcquireBackoff::new(),
        last_tick: None,
        busy_ms: 0.0,
        leased_ms: 0.0,
        cost_seen: BTreeMap::new(),
        start_timeout_ms: cfg.start_timeout_secs.saturating_mul(1000),
        in_flight: tokio::task::JoinSet::new(),
        acquiring: tokio::task::JoinSet::new(),
        book,
        stopping: false,
        on_stop: cfg.on_stop,
    };
    shell.update_metrics(now);
    Ok((shell, events))
}

/// Adopts with `provider` the ledger's live leases whose worker still
/// runs, and ends the rest (`failed` if never started, else `lost`): no
/// lease outlives its worker. The adopted leases.
async fn adopt_live<P: LeaseSource>(
    cfg: &LeasingConfig,
    ledger: &mut Ledger,
    provider: &mut P,
    now: Millis,
) -> Result<Vec<LeaseId>, LeasingError> {
    let ledger_err = |source| LeasingError::Ledger {
        path: cfg.ledger.clone(),
        source,
    };
    let adopted = provider
        .adopt(ledger, now)
        .await
        .map_err(|e| LeasingError::Provider(e.to_string()))?
        .adopted;
    for rec in ledger.live_leases().map_err(ledger_err)? {
        if !adopted.contains(&rec.id) {
            let reason = if rec.state == LeaseState::Requested {
                EndReason::Failed
            } else {
                EndReason::Lost
            };
            warn!(lease = %rec.id, provider = %rec.provider, "live lease not adopted after restart; ended");
            ledger.mark_ended(rec.id, now, reason).map_err(ledger_err)?;
        }
    }
    Ok(adopted)
}

/// After adoption: each adopted lease's token is armed again (its worker
/// registers again with it), a lease adopted `ready` is absent in `book`
/// from the start until its worker does, and one adopted `draining` is
/// released at once. The releases so scheduled.
fn rearm_adopted(
    cfg: &LeasingConfig,
    ledger: &mut Ledger,
    table: &mut LeaseTable,
    adopted: &[LeaseId],
    book: &mut LeaseBook<tokio::task::Id>,
) -> Result<ReleaseQueue, LeasingError> {
    let ledger_err = |source| LeasingError::Ledger {
        path: cfg.ledger.clone(),
        source,
    };
    let mut releases = ReleaseQueue::new();
    // An adopted lease's worker must redial this gateway: until it
    // registers, it is absent.
    for id in adopted {
        book.worker_gone(*id, table.get(*id).map(|e| e.state), 0);
    }
    for id in adopted {
        // the adopted worker registers again with the token it was given
        table.rearm_claim(*id)?;
        ledger.set_token_claimed(*id, false).map_err(ledger_err)?;
        // A lease that was draining (being released, or under a spot
        // notice) when the gateway went down: no policy would ever release
        // it (it serves nothing), so release it now; the hub drains its
        // worker if it registers again meanwhile.
        if table.get(*id).map(|e| e.state) == Some(LeaseState::Draining) {
            info!(lease = %id, "adopted lease was draining; releasing it");
            releases.schedule(*id, 0, EndReason::Released);
        }
    }
    if !adopted.is_empty() {
        info!(adopted = ?adopted, "adopted live leases");
    }
    Ok(releases)
}

/// The autoscaler's configuration from `[leasing]`; exports the spend cap
/// and every tier's cost counter at 0 in `currency`.
fn policy_config(
    cfg: &LeasingConfig,
    policy: autoscale::PolicyName,
    metrics: &Metrics,
    currency: &str,
) -> PolicyConfig {
    let mut pc = PolicyConfig::new(policy);
    if let Some(h) = cfg.headroom {
        pc.headroom = h;
    }
    pc.spend_cap_per_hour = cfg.spend_cap_per_hour.map(Money::from_units);
    if let Some(cap) = cfg.spend_cap_per_hour {
        metrics.spend_cap.with_label_values::<&str>(&[]).set(cap);
    }
    // Exported at 0 from the start, in the catalog's currency.
    for tier in Tier::ALL {
        metrics
            .cost_total
            .with_label_values(&[tier.as_str(), currency]);
    }
    // the windows are bounded by validate(); saturating all the same
    if let Some(s) = cfg.down_window_secs {
        pc.down_window_ms = s.saturating_mul(1000);
    }
    if let Some(s) = cfg.release_window_secs {
        pc.release_window_ms = s.saturating_mul(1000);
    }
    if let Some(s) = cfg.idle_timeout_secs {
        pc.idle_timeout_ms = s.saturating_mul(1000);
    }
    if let Some(s) = cfg.renew_horizon_secs {
        pc.renew_horizon_ms = s.saturating_mul(1000);
    }
    if let Some(m) = cfg.hedge_margin {
        pc.hedge_margin = m;
    }
    if let Some(m) = cfg.spot_fallback_min_share {
        pc.spot_fallback_min_share = m;
    }
    if let Some(s) = cfg.spot_refused_cooloff_secs {
        pc.spot_refused_cooloff_ms = s.saturating_mul(1000);
    }
    pc.release_lead_ms = RELEASE_LEAD.as_millis() as Millis;
    for m in &cfg.models {
        if m.min_fps > 0.0 {
            pc.schedule.push(ScheduleEntry {
                model: m.name.clone(),
                from_minute: 0,
                to_minute: 24 * 60,
                min_fps: m.min_fps,
            });
            pc.static_peak_fps.insert(m.name.clone(), m.min_fps);
        }
        if m.reserved > 0 {
            pc.reserved.push(ReservedFloor {
                model: m.name.clone(),
                instance_type: m.instance_types[0].clone(),
                count: m.reserved,
            });
        }
    }

    pc
}

/// Runs the shell that `open` makes on a thread and runtime of its own
/// until `cancel`, once `open` has succeeded; waits until it has, and
/// returns its error otherwise. The tracker waits for the thread at
/// shutdown.
fn spawn_shell<P, O, F>(
    open: O,
    rx: mpsc::Receiver<LeasingMsg>,
    tick: Duration,
    cancel: CancellationToken,
    tracker: &TaskTracker,
) -> Result<(), LeasingError>
where
    P: LeaseSource,
    O: FnOnce() -> F + Send + 'static,
    F: Future<Output = Result<(Shell<P>, mpsc::Receiver<ProviderEvent>), LeasingError>>,
{
    // The shell blocks: SQLite writes (up to the ledger's busy timeout).
    // It runs on its own thread and runtime, with its provider's calls and
    // tasks, so the gateway's workers (QUIC, the hub, the API) never wait
    // on it; the tracker waits for it at shutdown.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(LeasingError::Thread)?;
    let (started_tx, started_rx) = std::sync::mpsc::sync_channel(1);
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
    let span = info_span!("leasing");
    std::thread::Builder::new()
        .name("tidegate-leasing".into())
        .spawn(move || {
            let serve = async move {
                match open().await {
                    Ok((shell, events)) => {
                        let _ = started_tx.send(Ok(()));
                        shell.run(rx, events, tick, cancel).await;
                    }
                    Err(e) => {
                        let _ = started_tx.send(Err(e));
                    }
                }
            };
            runtime.block_on(serve.instrument(span));
            // Tasks the provider left (watchers of ended leases) end with
            // the runtime.
            drop(runtime);
            let _ = done_tx.send(());
        })
        .map_err(LeasingError::Thread)?;
    // Start-up (the provider's checks and adoption) is bounded by the
    // provider's own deadlines; the thread answers once, or ends.
    match started_rx.recv() {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(e),
        Err(_) => {
            return Err(LeasingError::Thread(std::io::Error::other(
                "its thread stopped while the provider connected and adopted; see the log",
            )));
        }
    }
    tracker.spawn(async move {
        let _ = done_rx.await;
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leasing(extra: &str) -> LeasingConfig {
        let text = format!(
            "provider = \"process\"\nledger = \"l.db\"\n{extra}\n[process]\ncommand = \"tidegate-worker\"\n"
        );
        toml::from_str(&text).expect("a [leasing] section")
    }

    #[test]
    fn the_policy_takes_each_knob_set_in_leasing_and_its_own_default_for_the_rest() {
        let policy = autoscale::PolicyName::PaidBlockAware;
        let metrics = Metrics::new();
        let set = policy_config(
            &leasing(
                "headroom = 0.1\nrenew_horizon_secs = 300\nhedge_margin = 2.0\nspot_fallback_min_share = 0.25\nspot_refused_cooloff_secs = 900",
            ),
            policy,
            &metrics,
            "CNY",
        );
        assert_eq!(set.headroom, 0.1);
        assert_eq!(set.renew_horizon_ms, 300_000);
        assert_eq!(set.hedge_margin, 2.0);
        assert_eq!(set.spot_fallback_min_share, 0.25);
        assert_eq!(set.spot_refused_cooloff_ms, 900_000);
        let unset = policy_config(&leasing(""), policy, &metrics, "CNY");
        let defaults = PolicyConfig::new(policy);
        assert_eq!(unset.headroom, defaults.headroom);
        assert_eq!(unset.hedge_margin, defaults.hedge_margin);
        assert_eq!(unset.spot_fallback_min_share, 0.5);
        assert_eq!(unset.spot_refused_cooloff_ms, 60_000);
        assert_eq!(
            unset.spot_refused_cooloff_ms,
            defaults.spot_refused_cooloff_ms
        );
        assert_eq!(
            unset.spot_fallback_min_share,
            defaults.spot_fallback_min_share
        );
    }
}
