//! The `process` provider: each lease is a `tidegate-worker` process on this
//! host.
//!
//! It is the embedded default, so a single machine can run the whole lease
//! lifecycle, billing and preemption handling without a cloud. Each worker
//! gets its lease through the environment (`TIDEGATE_LEASE_ID`,
//! `TIDEGATE_LEASE_TOKEN`, `TIDEGATE_INSTANCE_TYPE`, `TIDEGATE_GPU_MODEL`,
//! `TIDEGATE_LEASE_TIER`), so it can pretend to be the catalog type it was
//! leased as.
//!
//! One supervisor task owns each child: it reaps the child when it exits by
//! itself (reporting the lease lost), kills and reaps it on release, and
//! runs the simulated spot preemption (a notice, then a kill after
//! `notice_period`). Children are spawned with `kill_on_drop`, and dropping
//! the provider closes every supervisor's command channel, which kills and
//! reaps its child, so no process outlives the provider unless it was
//! deliberately detached (see [`ProcessProvider::detach_all`]).
//!
//! After a gateway restart, its [`Provider::adopt`] walks the ledger's
//! live `process` leases: a worker whose pid is alive and whose command line
//! (and, where readable, `TIDEGATE_LEASE_ID`) matches is adopted and watched
//! again; any other lease is ended as `lost` in the ledger, so none leaks.

use std::collections::HashMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tidegate_kit::signal::{Signal, SignalError};
use tokio::process::{Child, Command};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use super::{
    Acquired, Adoption, EVENT_CHANNEL_CAPACITY, LeaseSpec, MAX_NOTICE_PERIOD_SECS, Provider,
    ProviderError, ProviderEvent, checked_secs, wall_clock_ms,
};
use crate::billing::Millis;
use crate::catalog::Tier;
use crate::ledger::Ledger;
use crate::lifecycle::{EndReason, LeaseState};
use crate::table::LeaseId;

/// Provider name in the ledger.
pub const PROVIDER_NAME: &str = "process";

/// How often an adopted (not our child) worker is checked for liveness.
const ADOPTED_POLL: Duration = Duration::from_millis(200);
/// How long a killed adopted worker may take to disappear.
const ADOPTED_KILL_POLLS: u32 = 50;
/// Longest simulated preemption delay accepted (s): a year, past any drill.
const MAX_PREEMPT_AFTER_SECS: f64 = 365.0 * 86_400.0;

/// Configuration of the process provider.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProcessConfig {
    /// Worker command (`tidegate-worker`).
    pub command: String,
    /// Its arguments.
    #[serde(default)]
    pub args: Vec<String>,
    /// Extra environment for every worker (e.g. the gateway address).
    #[serde(default)]
    pub env: Vec<(String, String)>,
    /// Spot preemption notice period, in seconds (cloud default: 120).
    #[serde(default = "default_notice_secs")]
    pub notice_period_secs: f64,
    /// Simulated spot preemption: every spot lease gets its notice this
    /// long after it starts (s), unless its [`LeaseSpec::preempt_after`]
    /// says otherwise; unset: never (drills and tests only).
    #[serde(default)]
    pub preempt_spot_after_secs: Option<f64>,
}

fn default_notice_secs() -> f64 {
    120.0
}

impl ProcessConfig {
    /// A config running `command args…` with the default notice period.
    pub fn new(command: impl Into<String>, args: &[&str]) -> ProcessConfig {
        ProcessConfig {
            command: command.into(),
            args: args.iter().map(|s| s.to_string()).collect(),
            env: Vec::new(),
            notice_period_secs: default_notice_secs(),
            preempt_spot_after_secs: None,
        }
    }

    /// Checks what serde cannot; the message names the field.
    pub fn validate(&self) -> Result<(), String> {
        if self.command.trim().is_empty() {
            return Err("command is empty; name the tidegate-worker binary".into());
        }
        checked_secs(
            "notice_period_secs",
            self.notice_period_secs,
            MAX_NOTICE_PERIOD_SECS,
        )?;
        if let Some(s) = self.preempt_spot_after_secs {
            checked_secs("preempt_spot_after_secs", s, MAX_PREEMPT_AFTER_SECS)?;
        }
        Ok(())
    }

    /// When a spot lease is preempted, unless its spec says; a value
    /// [`ProcessConfig::validate`] refuses means never.
    fn preempt_spot_after(&self) -> Option<Duration> {
        self.preempt_spot_after_secs
            .and_then(|s| checked_secs("preempt_spot_after_secs", s, MAX_PREEMPT_AFTER_SECS).ok())
    }

    /// The notice period; a value [`ProcessConfig::validate`] refuses is
    /// clamped into range rather than panicking here.
    fn notice_period(&self) -> Duration {
        let s = self.notice_period_secs;
        let s = if s.is_nan() {
            0.0
        } else {
            s.clamp(0.0, MAX_NOTICE_PERIOD_SECS)
        };
        Duration::try_from_secs_f64(s).unwrap_or(Duration::ZERO)
    }

    fn cmdline(&self) -> Vec<String> {
        std::iter::once(self.command.clone())
            .chain(self.args.iter().cloned())
            .collect()
    }
}

/// What the ledger keeps about a process lease, to adopt it later.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessData {
    /// The argv it was started with.
    pub cmdline: Vec<String>,
}

#[derive(Debug)]
enum Cmd {
    Release(oneshot::Sender<()>),
    Preempt,
    Detach,
}

#[derive(Debug)]
struct Handle {
    pid: u32,
    cmds: mpsc::Sender<Cmd>,
    task: JoinHandle<()>,
}

/// The process provider.
#[derive(Debug)]
pub struct ProcessProvider {
    cfg: ProcessConfig,
    leases: HashMap<LeaseId, Handle>,
    events_tx: mpsc::Sender<ProviderEvent>,
    events_rx: Option<mpsc::Receiver<ProviderEvent>>,
}

impl ProcessProvider {
    /// A provider with no leases.
    pub fn new(cfg: ProcessConfig) -> ProcessProvider {
        let (events_tx, events_rx) = mpsc::channel(EVENT_CHANNEL_CAPACITY);
        ProcessProvider {
            cfg,
            leases: HashMap::new(),
            events_tx,
            events_rx: Some(events_rx),
        }
    }

    /// The pid of a held lease's worker.
    pub fn pid(&self, lease: LeaseId) -> Option<u32> {
        self.leases
            .get(&lease)
            .filter(|h| !h.task.is_finished())
            .map(|h| h.pid)
    }

    /// Leases held: those whose worker has not ended (an ended lease's
    /// supervisor has reported it and returned).
    pub fn held(&self) -> Vec<LeaseId> {
        let mut v: Vec<LeaseId> = self
            .leases
            .iter()
            .filter(|(_, h)| !h.task.is_finished())
            .map(|(l, _)| *l)
            .collect();
        v.sort();
        v
    }

    /// Forgets the leases whose worker has ended, so that the map holds
    /// only live ones however many leases come and go.
    fn prune(&mut self) {
        self.leases.retain(|_, h| !h.task.is_finished());
    }

    /// Starts a simulated spot preemption of `lease` now: a notice, then a
    /// kill after the notice period.
    pub async fn preempt(&mut self, lease: LeaseId) -> Result<(), ProviderError> {
        let h = self
            .leases
            .get(&lease)
            .ok_or(ProviderError::UnknownLease(lease))?;
        h.cmds
            .send(Cmd::Preempt)
            .await
            .map_err(|_| ProviderError::UnknownLease(lease))
    }

    /// Releases every lease and waits until every worker is reaped.
    pub async fn shutdown(mut self) {
        let ids = self.held();
        for id in ids {
            if let Err(e) = self.release(id).await {
                tracing::warn!(lease = %id, error = %e, "release at shutdown");
            }
        }
    }

    /// Stops supervising every worker WITHOUT killing it, as a crash of the
    /// gateway would. The next provider over the same ledger adopts them.
    /// Used to test adoption; a clean shutdown uses
    /// [`ProcessProvider::shutdown`].
    pub async fn detach_all(mut self) {
        for (_, h) in self.leases.drain() {
            if h.cmds.send(Cmd::Detach).await.is_ok() {
                let _ = h.task.await;
            }
        }
    }
}

impl ProcessProvider {
    /// Spawns the lease's worker and supervises it.
    fn spawn(&mut self, spec: LeaseSpec) -> Result<Acquired, ProviderError> {
        self.prune();
        if self.leases.contains_key(&spec.lease) {
            return Err(ProviderError::Duplicate(spec.lease));
        }
        let mut cmd = Command::new(&self.cfg.command);
        cmd.args(&self.cfg.args)
            .envs(self.cfg.env.iter().map(|(k, v)| (k, v)))
            .env("TIDEGATE_LEASE_ID", spec.lease.0.to_string())
            .env("TIDEGATE_LEASE_TOKEN", spec.token.expose())
            .env("TIDEGATE_INSTANCE_TYPE", &spec.instance.name)
            .env("TIDEGATE_GPU_MODEL", &spec.instance.gpu_model)
            .env("TIDEGATE_LEASE_TIER", spec.tier.as_str())
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true);
        let child = cmd.spawn().map_err(|source| ProviderError::Spawn {
            lease: spec.lease,
            command: self.cfg.command.clone(),
            source,
        })?;
        let pid = child.id().ok_or_else(|| ProviderError::Process {
            lease: spec.lease,
            what: "read pid of new worker",
            source: std::io::Error::other("child exited before its pid was read"),
        })?;
        let preempt_after = match spec.tier {
            Tier::Spot => spec.preempt_after.or_else(|| self.cfg.preempt_spot_after()),
            _ => None,
        };
        let (cmds, rx) = mpsc::channel(4);
        let task = tokio::spawn(supervise(
            spec.lease,
            child,
            rx,
            self.events_tx.clone(),
            preempt_after,
            self.cfg.notice_period(),
        ));
        self.leases.insert(spec.lease, Handle { pid, cmds, task });
        tracing::info!(lease = %spec.lease, pid, instance = %spec.instance.name, tier = %spec.tier, "worker spawned");
        let data = ProcessData {
            cmdline: self.cfg.cmdline(),
        };
        Ok(Acquired {
            lease: spec.lease,
            pid: Some(pid),
            provider_data: Some(serde_json::to_string(&data).unwrap_or_default()),
            token: None,
        })
    }
}

impl Provider for ProcessProvider {
    fn name(&self) -> &'static str {
        PROVIDER_NAME
    }

    /// Spawns the worker in the call.
    fn acquire(
        &mut self,
        spec: LeaseSpec,
    ) -> impl Future<Output = Result<Acquired, ProviderError>> + Send + 'static {
        std::future::ready(self.spawn(spec))
    }

    fn release(
        &mut self,
        lease: LeaseId,
    ) -> impl Future<Output = Result<(), ProviderError>> + Send + 'static {
        // a lease whose worker already ended (not yet pruned) releases at
        // once: its supervisor has returned
        let held = self.leases.remove(&lease);
        async move {
            let h = held.ok_or(ProviderError::UnknownLease(lease))?;
            let (tx, rx) = oneshot::channel();
            if h.cmds.send(Cmd::Release(tx)).await.is_ok() {
                let _ = rx.await;
            }
            // the supervisor returns only after the child is reaped
            let _ = h.task.await;
            tracing::info!(%lease, pid = h.pid, "worker released");
            Ok(())
        }
    }

    /// Re-adopts the live `process` leases recorded in `ledger`: a worker
    /// whose pid is alive and whose command line matches is supervised
    /// again; the others are ended, billed to when they were last heard
    /// from. Reads `/proc` only: nothing here waits.
    async fn adopt(&mut self, ledger: &mut Ledger, now: Millis) -> Result<Adoption, ProviderError> {
        let mut out = Adoption::default();
        for rec in ledger.live_leases()? {
            if rec.provider != PROVIDER_NAME {
                continue;
            }
            let expected = rec
                .provider_data
                .as_deref()
                .and_then(|d| serde_json::from_str::<ProcessData>(d).ok());
            let alive = match (rec.pid, &expected) {
                (Some(pid), Some(data)) => process_matches(pid, &data.cmdline, rec.id),
                _ => false,
            };
            if alive && let Some(pid) = rec.pid {
                let (cmds, rx) = mpsc::channel(4);
                let task = tokio::spawn(watch_adopted(rec.id, pid, rx, self.events_tx.clone()));
                self.leases.insert(rec.id, Handle { pid, cmds, task });
                tracing::info!(lease = %rec.id, pid, "adopted worker after restart");
                out.adopted.push(rec.id);
            } else {
                // never started → failed; started but gone → lost
                let reason = if rec.state == LeaseState::Requested {
                    EndReason::Failed
                } else {
                    EndReason::Lost
                };
                // it stopped after the gateway last heard from it and
                // before now; most often with the gateway (a host that
                // went down), so it is billed to then, not to this restart
                let at = rec.last_seen_at.map_or(now, |seen| seen.min(now));
                ledger.mark_ended(rec.id, at, reason)?;
                tracing::warn!(lease = %rec.id, pid = ?rec.pid, ended_at = at, "worker gone after restart; lease ended, billed to when it was last heard from");
                out.ended.push((rec.id, reason));
            }
        }
        Ok(out)
    }

    fn take_events(&mut self) -> Option<mpsc::Receiver<ProviderEvent>> {
        self.events_rx.take()
    }
}

/// Kills and reaps our own child.
async fn kill_and_reap(lease: LeaseId, child: &mut Child) -> String {
    if let Err(e) = child.start_kill() {
        tracing::debug!(%lease, error = %e, "kill (already exited?)");
    }
    match child.wait().await {
        Ok(s) => s.to_string(),
        Err(e) => format!("wait failed: {e}"),
    }
}

async fn supervise(
    lease: LeaseId,
    mut child: Child,
    mut cmds: mpsc::Receiver<Cmd>,
    events: mpsc::Sender<ProviderEvent>,
    preempt_after: Option<Duration>,
    notice: Duration,
) {
    let far = tokio::time::Instant::now() + Duration::from_secs(100 * 365 * 86_400);
    let mut notice_at = preempt_after.map(|d| tokio::time::Instant::now() + d);
    let mut kill_at: Option<tokio::time::Instant> = None;
    loop {
        tokio::select! {
            status = child.wait() => {
                let detail = match status {
                    Ok(s) => format!("worker exited: {s}"),
                    Err(e) => format!("wait failed: {e}"),
                };
                let reason = if kill_at.is_some() { EndReason::Preempted } else { EndReason::Lost };
                let _ = events.send(ProviderEvent::Ended { lease, reason, detail }).await;
                return;
            }
            cmd = cmds.recv() => match cmd {
                Some(Cmd::Release(reply)) => {
                    let status = kill_and_reap(lease, &mut child).await;
                    tracing::debug!(%lease, %status, "released worker reaped");
                    let _ = reply.send(());
                    return;
                }
                // the provider was dropped: never leak the child
                None => {
                    kill_and_reap(lease, &mut child).await;
                    return;
                }
                Some(Cmd::Detach) => {
                    // Simulates a gateway crash: the OS process must outlive
                    // this supervisor, so its handle (which would kill it on
                    // drop) is deliberately forgotten.
                    std::mem::forget(child);
                    return;
                }
                Some(Cmd::Preempt) => {
                    if kill_at.is_none() {
                        notice_at = Some(tokio::time::Instant::now());
                    }
                }
            },
            _ = tokio::time::sleep_until(notice_at.unwrap_or(far)), if notice_at.is_some() => {
                notice_at = None;
                // the wall clock first: the kill then never precedes the
                // deadline we announce
                let deadline = wall_clock_ms() + notice.as_millis() as Millis;
                kill_at = Some(tokio::time::Instant::now() + notice);
                tracing::info!(%lease, deadline, "spot preemption notice");
                let _ = events.send(ProviderEvent::PreemptionNotice { lease, deadline }).await;
            }
            _ = tokio::time::sleep_until(kill_at.unwrap_or(far)), if kill_at.is_some() => {
                let status = kill_and_reap(lease, &mut child).await;
                let _ = events.send(ProviderEvent::Ended {
                    lease,
                    reason: EndReason::Preempted,
                    detail: format!("spot preemption: {status}"),
                }).await;
                return;
            }
        }
    }
}

/// Whether `pid` is alive (not a zombie) and runs `cmdline` for `lease`.
pub fn process_matches(pid: u32, cmdline: &[String], lease: LeaseId) -> bool {
    if !pid_alive(pid) {
        return false;
    }
    let Ok(raw) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let argv: Vec<String> = raw
        .split(|b| *b == 0)
        .filter(|s| !s.is_empty())
        .map(|s| String::from_utf8_lossy(s).into_owned())
        .collect();
    if argv != cmdline {
        return false;
    }
    // where the environment is readable, it must name this lease (guards
    // against a reused pid running the same command)
    match std::fs::read(format!("/proc/{pid}/environ")) {
        Ok(env) => {
            let want = format!("TIDEGATE_LEASE_ID={}", lease.0);
            env.split(|b| *b == 0).any(|kv| kv == want.as_bytes())
        }
        Err(_) => true,
    }
}

/// Whether `/proc/<pid>` exists and is not a zombie.
pub fn pid_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // state is the field after the parenthesised command name
        Ok(stat) => match stat.rsplit_once(')') {
            Some((_, rest)) => !matches!(rest.trim_start().chars().next(), Some('Z' | 'X')),
            None => false,
        },
        Err(_) => false,
    }
}

/// Sends `signal` to `pid`; a process already gone (or a zombie) is not
/// an error.
fn send_signal(pid: u32, signal: Signal) -> Result<(), SignalError> {
    match tidegate_kit::signal::send(pid, signal) {
        Err(e) if pid_alive(pid) => Err(e),
        _ => Ok(()),
    }
}

/// Supervises a worker that is not our child (adopted after a restart):
/// liveness by polling `/proc`, release by signals.
async fn watch_adopted(
    lease: LeaseId,
    pid: u32,
    mut cmds: mpsc::Receiver<Cmd>,
    events: mpsc::Sender<ProviderEvent>,
) {
    let mut tick = tokio::time::interval(ADOPTED_POLL);
    loop {
        tokio::select! {
            _ = tick.tick() => {
                if !pid_alive(pid) {
                    let _ = events.send(ProviderEvent::Ended {
                        lease,
                        reason: EndReason::Lost,
                        detail: format!("adopted worker pid {pid} exited"),
                    }).await;
                    return;
                }
            }
            cmd = cmds.recv() => match cmd {
                Some(Cmd::Release(reply)) => {
                    kill_adopted(lease, pid).await;
                    let _ = reply.send(());
                    return;
                }
                None => {
                    kill_adopted(lease, pid).await;
                    return;
                }
                Some(Cmd::Detach) => return,
                Some(Cmd::Preempt) => {
                    // an adopted worker has no preemption timer; end it as
                    // preempted at once
                    kill_adopted(lease, pid).await;
                    let _ = events.send(ProviderEvent::Ended {
                        lease,
                        reason: EndReason::Preempted,
                        detail: "adopted worker preempted".into(),
                    }).await;
                    return;
                }
            },
        }
    }
}

async fn kill_adopted(lease: LeaseId, pid: u32) {
    if let Err(e) = send_signal(pid, Signal::Term) {
        tracing::warn!(%lease, pid, error = %e, "SIGTERM to adopted worker");
    }
    for _ in 0..ADOPTED_KILL_POLLS {
        if !pid_alive(pid) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if let Err(e) = send_signal(pid, Signal::Kill) {
        tracing::warn!(%lease, pid, error = %e, "SIGKILL to adopted worker");
    }
}
