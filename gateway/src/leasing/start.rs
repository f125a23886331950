//! Start-up: adopts the ledger's live leases whose worker still runs (their
//! tokens re-armed) and ends the rest, builds the autoscaler's policy from
//! the config, and starts the shell on a thread of its own.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use tidegate_lease::autoscale::{self, Autoscaler, PolicyConfig, ReservedFloor, ScheduleEntry};
use tidegate_lease::ledger::Ledger;
use tidegate_lease::pacing::{AcquireBackoff, ReleaseQueue};
use tidegate_lease::provider::{ProviderError, ProviderEvent, wall_clock_ms};
use tidegate_lease::{EndReason, LeaseId, LeaseState, LeaseTable, Millis, Money, Tier};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, info, info_span, warn};

use super::shell::Shell;
use super::writes::PendingWrites;
use super::{INBOX, Leasing, LeasingError, LeasingMsg, RELEASE_LEAD, Source};
use crate::config::LeasingConfig;
use crate::hub::Hub;
use crate::metrics::Metrics;

/// Adopts with `source` the ledger's live leases whose worker still runs,
/// ends the rest, and starts the shell.
pub(super) fn start(
    cfg: &LeasingConfig,
    mut ledger: Ledger,
    mut source: Source,
    hub: Hub,
    metrics: Metrics,
    cancel: CancellationToken,
    tracker: &TaskTracker,
) -> Result<Leasing, LeasingError> {
    let catalog = cfg.load_catalog()?;
    let policy = cfg.policy_name()?;
    let ledger_err = |source| LeasingError::Ledger {
        path: cfg.ledger.clone(),
        source,
    };
    let now = wall_clock_ms();
    // Adopt what still runs, end the rest: no lease outlives its worker.
    let adopted = adopt_live(cfg, &mut ledger, &mut source, now)?;
    let mut table = ledger.load_table().map_err(ledger_err)?;
    let epoch = tokio::time::Instant::now();
    let (releases, absent) = rearm_adopted(cfg, &mut ledger, &mut table, &adopted)?;
    let events = source
        .take_events()
        .ok_or_else(|| LeasingError::Provider("provider events already taken".into()))?;

    let pc = policy_config(cfg, policy, &metrics, &catalog.currency);

    let (tx, rx) = mpsc::channel(INBOX);
    let mut shell = Shell {
        autoscaler: Autoscaler::new(pc, catalog.clone()),
        catalog,
        models: cfg.models.clone(),
        ledger,
        table,
        source,
        hub,
        metrics,
        measured: HashMap::new(),
        static_names: HashMap::new(),
        static_links: HashMap::new(),
        epoch,
        releases,
        backoff: AcquireBackoff::new(),
        writes: PendingWrites::default(),
        last_tick: None,
        seen_written: None,
        busy_ms: 0.0,
        leased_ms: 0.0,
        cost_seen: BTreeMap::new(),
        start_timeout_ms: cfg.start_timeout_secs.saturating_mul(1000),
        absent,
        rejoin_timeout_ms: cfg.rejoin_timeout_secs.saturating_mul(1000),
        stalls: HashMap::new(),
        in_flight: tokio::task::JoinSet::new(),
        in_flight_leases: HashMap::new(),
        acquiring: tokio::task::JoinSet::new(),
        acquiring_tasks: HashMap::new(),
        acquiring_leases: HashMap::new(),
        stopping: false,
        on_stop: cfg.on_stop,
    };
    shell.update_metrics(now);
    spawn_shell(
        shell,
        (rx, events),
        Duration::from_millis(cfg.tick_ms),
        cancel,
        tracker,
    )?;
    Ok(Leasing { tx })
}

/// Adopts with `source` the ledger's live leases whose worker still runs,
/// and ends the rest (`failed` if never started, else `lost`): no lease
/// outlives its worker. The adopted leases.
fn adopt_live(
    cfg: &LeasingConfig,
    ledger: &mut Ledger,
    source: &mut Source,
    now: Millis,
) -> Result<Vec<LeaseId>, LeasingError> {
    let ledger_err = |source| LeasingError::Ledger {
        path: cfg.ledger.clone(),
        source,
    };
    let provider_err = |e: ProviderError| LeasingError::Provider(e.to_string());
    let adopted = match source {
        Source::Process { provider, .. } => {
            provider.adopt(ledger, now).map_err(provider_err)?.adopted
        }
        Source::Slurm(provider) => provider.adopt(ledger, now).map_err(provider_err)?.adopted,
        Source::Kubernetes(provider) => provider.adopt(ledger, now).map_err(provider_err)?.adopted,
        Source::Static(_) => Vec::new(),
        #[cfg(test)]
        Source::Fake(provider) => provider.adopt(ledger).map_err(provider_err)?,
    };
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
/// registers again with it), a lease adopted `ready` is absent until its
/// worker does, and one adopted `draining` is released at once. The
/// releases so scheduled, and the absent leases.
fn rearm_adopted(
    cfg: &LeasingConfig,
    ledger: &mut Ledger,
    table: &mut LeaseTable,
    adopted: &[LeaseId],
) -> Result<(ReleaseQueue, HashMap<LeaseId, Millis>), LeasingError> {
    let ledger_err = |source| LeasingError::Ledger {
        path: cfg.ledger.clone(),
        source,
    };
    let mut releases = ReleaseQueue::new();
    // An adopted lease's worker must redial this gateway: until it
    // registers, it is absent.
    let absent: HashMap<LeaseId, Millis> = adopted
        .iter()
        .filter(|id| table.get(**id).map(|e| e.state) == Some(LeaseState::Ready))
        .map(|id| (*id, 0))
        .collect();
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
    Ok((releases, absent))
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

/// Runs `shell` on a thread and runtime of its own until `cancel`; the
/// tracker waits for it at shutdown.
fn spawn_shell(
    shell: Shell,
    (rx, events): (mpsc::Receiver<LeasingMsg>, mpsc::Receiver<ProviderEvent>),
    tick: Duration,
    cancel: CancellationToken,
    tracker: &TaskTracker,
) -> Result<(), LeasingError> {
    // The shell blocks: SQLite writes (up to the ledger's busy timeout)
    // and the provider's tools. It runs on its own thread and runtime, so
    // the gateway's workers (QUIC, the hub, the API) never wait on it; the
    // tracker waits for it at shutdown.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(LeasingError::Thread)?;
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
    let span = info_span!("leasing");
    std::thread::Builder::new()
        .name("tidegate-leasing".into())
        .spawn(move || {
            runtime.block_on(shell.run(rx, events, tick, cancel).instrument(span));
            // Tasks the provider left (watchers of ended leases) end with
            // the runtime.
            drop(runtime);
            let _ = done_tx.send(());
        })
        .map_err(LeasingError::Thread)?;
    tracker.spawn(async move {
        let _ = done_rx.await;
    });
    Ok(())
}
