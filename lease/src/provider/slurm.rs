//! The `slurm` provider: each lease is a Slurm batch job that runs one
//! `tidegate-worker` on a GPU node.
//!
//! Slurm is the engine many GPU clouds hand their users, and it runs on a
//! single machine for tests (see `lease/tests/slurm_provider.rs`). The
//! provider talks to it through its own command-line tools (`sbatch`,
//! `squeue`, `scancel`, `scontrol`), so it needs no library of Slurm's and
//! works against any version whose output it parses (22.05 and later):
//!
//! * **acquire** submits a job with `sbatch --parsable` into the tier's
//!   partition (on-demand, spot or reserved) with `--gres` from the
//!   instance type (`gpu:<gpus>` unless configured). The job script `exec`s
//!   `srun <command> <args>`: running the worker as a job *step* is what
//!   makes Slurm deliver the preemption SIGTERM to it at the start of the
//!   partition's `GraceTime`. The lease's identity and one-time token go
//!   in the environment of `sbatch` (exported to the job), never on a
//!   command line.
//! * **watching**: one task polls `squeue` for every held job each
//!   `poll_interval_ms`. A job Slurm has chosen to preempt shows a
//!   `PreemptTime`; that is the spot notice, with the deadline
//!   `PreemptTime + GraceTime` of the partition. The worker, signalled at
//!   the same moment, drains by itself. When the job ends, the lease ends:
//!   `preempted` if it was preempted, `failed` if it never ran, `lost`
//!   otherwise. A preempted job that Slurm requeued (`PreemptMode=REQUEUE`)
//!   is cancelled: a lease is one run of a worker.
//! * **release** cancels the job (`scancel`: SIGTERM to the worker, then
//!   SIGKILL after Slurm's `KillWait`) and waits until Slurm reports it
//!   ended; only then is the job forgotten. If `scancel` fails, or the job
//!   (or a tool that does not answer) outlives `release_timeout_secs`, the
//!   release fails and the job stays held and watched (it may still bill):
//!   the caller retries, and if it ends meanwhile the poller reports it
//!   like any end.
//! * **deadlines**: every run of a tool is bounded by
//!   `tool_timeout_secs`; past it the tool is killed (and reaped) and the
//!   call fails, saying which command did not answer within how long, so a
//!   hung slurmctld cannot stall the gateway. An `sbatch` that timed out
//!   may have queued its job all the same (the controller got it, the
//!   answer was lost), so any job of the lease's name (`<job_name>-<lease>`)
//!   is then cancelled, best effort, before the acquire fails; and since
//!   a busy controller may queue it later still, the poller looks for a
//!   job of that name for 15 minutes and cancels it when it appears. A release
//!   takes at most `release_timeout_secs` in all: each tool it runs gets the
//!   smaller of `tool_timeout_secs` and the time the release has left.
//! * a job that ended is no longer held: [`SlurmProvider::held`] lists live
//!   jobs only, and a shutdown cancels nothing that has already ended.
//! * **adoption**: the ledger keeps each lease's job id. After a gateway
//!   restart a lease whose job still runs (or is still pending) is watched
//!   again; any other is ended, so none leaks.
//!
//! Readiness comes from the worker's registration, as with the process
//! provider. A job that stays pending (no free GPU) is ended by the
//! gateway's `start_timeout_secs`, which releases it.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use super::{
    Acquired, Adoption, EVENT_CHANNEL_CAPACITY, LeaseSpec, MAX_NOTICE_PERIOD_SECS, Provider,
    ProviderError, ProviderEvent, checked_secs, wall_clock_ms,
};
use crate::billing::{Millis, days_from_civil};
use crate::catalog::{InstanceType, Tier};
use crate::ledger::Ledger;
use crate::lifecycle::{EndReason, LeaseState};
use crate::table::LeaseId;

/// Provider name in the ledger.
pub const PROVIDER_NAME: &str = "slurm";

/// A job missing from `squeue` this many polls in a row has ended (one
/// miss may be a job that is between states on a busy controller).
const MISSES_TO_END: u32 = 2;
/// How often `release` checks whether the cancelled job has ended.
const RELEASE_POLL: Duration = Duration::from_millis(200);
/// Most characters of a failing command's stderr kept in an error.
const STDERR_KEPT: usize = 400;
/// Longest `release_timeout_secs` accepted: an hour.
pub const MAX_RELEASE_TIMEOUT_SECS: f64 = 3600.0;
/// Longest `tool_timeout_secs` accepted: ten minutes.
pub const MAX_TOOL_TIMEOUT_SECS: f64 = 600.0;
/// How often a blocking tool run checks whether its tool has exited.
const BLOCKING_POLL: Duration = Duration::from_millis(10);
/// What bounds a tool run, for its timeout error.
const TOOL_TIMEOUT: &str = "tool_timeout_secs";
/// How long the poller looks for a job that an `sbatch` which did not
/// answer may queue yet (its request waiting in a busy controller's
/// queue), and cancels it.
const ABANDONED_WATCH: Duration = Duration::from_secs(900);
/// Most such job names the poller looks for at once (the oldest go first).
const ABANDONED_KEPT: usize = 256;

/// Configuration of the Slurm provider (`[leasing.slurm]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlurmConfig {
    /// Worker command, as the compute nodes see it (`tidegate-worker`).
    pub command: String,
    /// Its arguments.
    #[serde(default)]
    pub args: Vec<String>,
    /// Extra environment for every worker, e.g. `TIDEGATE_GATEWAY_ADDR`:
    /// the address at which the compute nodes reach this gateway.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// The partition of each tier.
    pub partitions: SlurmPartitions,
    /// Reserved leases run in this reservation (`--reservation`).
    #[serde(default)]
    pub reservation: Option<String>,
    /// `--gres` per catalog instance type; a type not listed gets
    /// `gpu:<its gpus>` (and no `--gres` when it has none).
    #[serde(default)]
    pub gres: BTreeMap<String, String>,
    /// Further `sbatch` options for every job (`--cpus-per-task=8`,
    /// `--mem=32G`, `--time=…`).
    #[serde(default)]
    pub sbatch_args: Vec<String>,
    /// `SLURM_CONF` for the Slurm tools; unset: theirs.
    #[serde(default)]
    pub slurm_conf: Option<PathBuf>,
    /// Folder holding `sbatch`, `squeue`, `scancel`, `scontrol`; unset:
    /// `PATH`.
    #[serde(default)]
    pub bin_dir: Option<PathBuf>,
    /// Where each job writes its output (`--output`, `%j` is the job id);
    /// unset: Slurm's default, `slurm-%j.out` in the gateway's folder.
    #[serde(default)]
    pub output: Option<String>,
    /// Job name prefix; the job of lease 12 is `<job_name>-12`.
    #[serde(default = "default_job_name")]
    pub job_name: String,
    /// How often the jobs are polled (ms).
    #[serde(default = "default_poll_ms")]
    pub poll_interval_ms: u64,
    /// Notice period of a preempted spot job (s); unset: the spot
    /// partition's `GraceTime`.
    #[serde(default)]
    pub notice_period_secs: Option<f64>,
    /// Longest `release` waits for a cancelled job to end (s).
    #[serde(default = "default_release_timeout_secs")]
    pub release_timeout_secs: f64,
    /// Longest one run of a Slurm tool (`sbatch`, `squeue`, `scancel`,
    /// `scontrol`) may take (s); past it the tool is killed and the call
    /// fails, so a hung slurmctld cannot stall the gateway.
    #[serde(default = "default_tool_timeout_secs")]
    pub tool_timeout_secs: f64,
}

/// `[leasing.slurm.partitions]`: where each tier's jobs go.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlurmPartitions {
    /// On-demand leases (a partition nothing preempts).
    pub on_demand: String,
    /// Spot leases: a partition that higher-priority partitions preempt
    /// (`PreemptMode=CANCEL` or `REQUEUE`, with a `GraceTime`); unset: no
    /// spot leases.
    #[serde(default)]
    pub spot: Option<String>,
    /// Reserved leases; unset: the on-demand partition.
    #[serde(default)]
    pub reserved: Option<String>,
}

fn default_job_name() -> String {
    "tidegate".into()
}
fn default_poll_ms() -> u64 {
    1000
}
fn default_release_timeout_secs() -> f64 {
    60.0
}
fn default_tool_timeout_secs() -> f64 {
    30.0
}

impl SlurmConfig {
    /// A config running `command args…` with on-demand jobs in `on_demand`.
    pub fn new(command: impl Into<String>, args: &[&str], on_demand: &str) -> SlurmConfig {
        SlurmConfig {
            command: command.into(),
            args: args.iter().map(|s| s.to_string()).collect(),
            env: BTreeMap::new(),
            partitions: SlurmPartitions {
                on_demand: on_demand.into(),
                spot: None,
                reserved: None,
            },
            reservation: None,
            gres: BTreeMap::new(),
            sbatch_args: Vec::new(),
            slurm_conf: None,
            bin_dir: None,
            output: None,
            job_name: default_job_name(),
            poll_interval_ms: default_poll_ms(),
            notice_period_secs: None,
            release_timeout_secs: default_release_timeout_secs(),
            tool_timeout_secs: default_tool_timeout_secs(),
        }
    }

    /// Checks what serde cannot; the message names the field.
    pub fn validate(&self) -> Result<(), String> {
        if self.command.trim().is_empty() {
            return Err("command is empty; name the tidegate-worker binary".into());
        }
        if !(50..=600_000).contains(&self.poll_interval_ms) {
            return Err(format!(
                "poll_interval_ms = {} must be between 50 and 600000",
                self.poll_interval_ms
            ));
        }
        if let Some(n) = self.notice_period_secs {
            checked_secs("notice_period_secs", n, MAX_NOTICE_PERIOD_SECS)?;
        }
        let t = self.release_timeout_secs;
        checked_secs("release_timeout_secs", t, MAX_RELEASE_TIMEOUT_SECS)?;
        if t <= 0.0 {
            return Err(format!("release_timeout_secs = {t} must be > 0"));
        }
        let t = self.tool_timeout_secs;
        checked_secs("tool_timeout_secs", t, MAX_TOOL_TIMEOUT_SECS)?;
        if t <= 0.0 {
            return Err(format!("tool_timeout_secs = {t} must be > 0"));
        }
        let name_ok = |s: &str| {
            !s.is_empty()
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        };
        if !name_ok(&self.job_name) {
            return Err(format!(
                "job_name = {:?} must be letters, digits, '-', '_' or '.'",
                self.job_name
            ));
        }
        let parts = &self.partitions;
        for (field, p) in [
            ("partitions.on_demand", Some(&parts.on_demand)),
            ("partitions.spot", parts.spot.as_ref()),
            ("partitions.reserved", parts.reserved.as_ref()),
        ] {
            if let Some(p) = p
                && !name_ok(p)
            {
                return Err(format!("{field} = {p:?} is not a partition name"));
            }
        }
        Ok(())
    }

    /// The partition for `tier`, or why there is none.
    pub fn partition(&self, tier: Tier) -> Option<&str> {
        match tier {
            Tier::OnDemand => Some(&self.partitions.on_demand),
            Tier::Spot => self.partitions.spot.as_deref(),
            Tier::Reserved => Some(
                self.partitions
                    .reserved
                    .as_deref()
                    .unwrap_or(&self.partitions.on_demand),
            ),
        }
    }

    /// `--gres` for an instance type; `None` for a CPU type.
    pub fn gres_for(&self, instance: &InstanceType) -> Option<String> {
        match self.gres.get(&instance.name) {
            Some(g) => Some(g.clone()),
            None if instance.gpus > 0 => Some(format!("gpu:{}", instance.gpus)),
            None => None,
        }
    }

    /// The `sbatch` arguments for a lease (the script comes on stdin).
    pub fn sbatch_args(&self, spec: &LeaseSpec) -> Result<Vec<String>, ProviderError> {
        let partition = self
            .partition(spec.tier)
            .ok_or_else(|| ProviderError::NoCapacity {
                instance_type: spec.instance.name.clone(),
                tier: spec.tier,
                detail: "no Slurm partition is configured for spot leases \
                         (leasing.slurm.partitions.spot)"
                    .into(),
            })?;
        let mut args = vec![
            "--parsable".to_string(),
            format!("--job-name={}-{}", self.job_name, spec.lease.0),
            format!("--partition={partition}"),
            "--ntasks=1".into(),
            "--export=ALL".into(),
        ];
        if let Some(g) = self.gres_for(&spec.instance) {
            args.push(format!("--gres={g}"));
        }
        if spec.tier == Tier::Reserved
            && let Some(r) = &self.reservation
        {
            args.push(format!("--reservation={r}"));
        }
        if let Some(o) = &self.output {
            args.push(format!("--output={o}"));
        }
        args.extend(self.sbatch_args.iter().cloned());
        Ok(args)
    }

    /// The batch script: the worker as one job step, so that Slurm's
    /// preemption signal reaches it.
    pub fn script(&self) -> String {
        let argv: Vec<String> = std::iter::once(&self.command)
            .chain(&self.args)
            .map(|a| shell_quote(a))
            .collect();
        format!(
            "#!/bin/sh\n# tidegate lease: one worker as one job step\nexec srun --ntasks=1 --kill-on-bad-exit=1 -- {}\n",
            argv.join(" ")
        )
    }
}

/// `s` as one POSIX shell word.
pub fn shell_quote(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:,@%+".contains(c))
    {
        return s.to_string();
    }
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// A Slurm job id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct JobId(pub u64);

impl std::fmt::Display for JobId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// What the ledger keeps about a Slurm lease, to adopt it later.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlurmData {
    /// The job.
    pub job_id: JobId,
    /// The partition it was submitted to.
    pub partition: String,
}

/// Parses `sbatch --parsable` output: `<id>` or `<id>;<cluster>`.
pub fn parse_job_id(stdout: &str) -> Option<JobId> {
    let line = stdout.lines().map(str::trim).find(|l| !l.is_empty())?;
    let id = line.split(';').next()?.trim();
    id.parse().ok().filter(|n| *n > 0).map(JobId)
}

/// A job's state, as `squeue` names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobState {
    /// Waiting for resources (or requeued).
    Pending,
    /// Nodes are booting for it.
    Configuring,
    /// Running.
    Running,
    /// Stopped and held.
    Suspended,
    /// Ending: its processes are being cleaned up.
    Completing,
    /// Ended; the state name (`COMPLETED`, `CANCELLED`, `PREEMPTED`,
    /// `FAILED`, `NODE_FAIL`, `TIMEOUT`, …).
    Ended(String),
}

impl JobState {
    /// Parses an `squeue` `State`: every state not known to be live is an
    /// end, so a Slurm with new end states cannot keep a lease alive.
    pub fn parse(s: &str) -> JobState {
        match s.trim() {
            "PENDING" | "REQUEUED" | "REQUEUE_HOLD" | "REQUEUE_FED" | "RESV_DEL_HOLD" => {
                JobState::Pending
            }
            "CONFIGURING" | "POWER_UP_NODE" | "RESIZING" => JobState::Configuring,
            "RUNNING" | "SIGNALING" | "STAGE_OUT" => JobState::Running,
            "SUSPENDED" | "STOPPED" => JobState::Suspended,
            "COMPLETING" => JobState::Completing,
            other => JobState::Ended(other.to_string()),
        }
    }
}

/// One `squeue` row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobInfo {
    /// The job.
    pub id: JobId,
    /// Its state.
    pub state: JobState,
    /// When Slurm chose to preempt it (ms since epoch).
    pub preempt_time: Option<Millis>,
    /// When it ended, for an ended job (ms since epoch); for a live one
    /// Slurm prints when its time limit runs out, which is not read.
    pub end_time: Option<Millis>,
    /// Slurm's reason (why pending, why it failed).
    pub reason: String,
}

/// The `squeue -O` format [`parse_squeue`] reads, times in UTC.
pub const SQUEUE_FORMAT: &str = "JobID:|,State:|,PreemptTime:|,EndTime:|,Reason:|";

/// Parses `squeue --noheader -O` [`SQUEUE_FORMAT`] output. Lines that do
/// not parse are skipped (and counted in the second value).
pub fn parse_squeue(stdout: &str) -> (Vec<JobInfo>, usize) {
    let mut jobs = Vec::new();
    let mut bad = 0;
    for line in stdout.lines().filter(|l| !l.trim().is_empty()) {
        let mut f = line.split('|');
        let (Some(id), Some(state), Some(preempt), Some(end)) =
            (f.next(), f.next(), f.next(), f.next())
        else {
            bad += 1;
            continue;
        };
        let reason = f.next().unwrap_or("").trim().to_string();
        // array and het jobs print `12_3` / `12+1`; ours are plain
        let Ok(id) = id.trim().parse::<u64>() else {
            bad += 1;
            continue;
        };
        let state = JobState::parse(state);
        let end_time = match state {
            JobState::Ended(_) => parse_utc(end.trim()),
            _ => None,
        };
        jobs.push(JobInfo {
            id: JobId(id),
            state,
            preempt_time: parse_utc(preempt.trim()),
            end_time,
            reason,
        });
    }
    (jobs, bad)
}

/// Parses Slurm's `YYYY-MM-DDTHH:MM:SS` (printed in UTC: the tools run
/// with `TZ=UTC`) to ms since the epoch; `N/A`, `None`, `Unknown` → `None`.
pub fn parse_utc(s: &str) -> Option<Millis> {
    let (date, time) = s.split_once('T')?;
    let mut d = date.split('-').map(|p| p.parse::<i64>());
    let (y, mo, da) = (d.next()?.ok()?, d.next()?.ok()?, d.next()?.ok()?);
    let mut t = time.split(':').map(|p| p.parse::<i64>());
    let (h, mi, se) = (t.next()?.ok()?, t.next()?.ok()?, t.next()?.ok()?);
    if d.next().is_some()
        || t.next().is_some()
        || !(1..=12).contains(&mo)
        || !(1..=31).contains(&da)
        || !(0..24).contains(&h)
        || !(0..60).contains(&mi)
        || !(0..=60).contains(&se)
    {
        return None;
    }
    let days = days_from_civil(y, mo, da);
    let secs = days * 86_400 + h * 3600 + mi * 60 + se;
    u64::try_from(secs).ok().map(|s| s * 1000)
}

/// Parses `GraceTime=<secs>` from `scontrol show partition -o` output.
pub fn parse_grace_secs(stdout: &str) -> Option<u64> {
    stdout
        .split_whitespace()
        .find_map(|kv| kv.strip_prefix("GraceTime="))
        .and_then(|v| v.parse().ok())
}

/// What the provider knows of one held job between polls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobWatch {
    /// The lease.
    pub lease: LeaseId,
    /// Its job.
    pub job: JobId,
    /// It was seen running (so an end is a loss, not a failed start).
    pub ran: bool,
    /// Its preemption notice was sent.
    pub noticed: bool,
    /// Polls in a row it was missing from `squeue`.
    pub misses: u32,
    /// It was requeued and is being cancelled: every poll that still
    /// shows it live cancels it again, until Slurm reports it ended.
    pub cancelling: bool,
}

/// What one poll means for a job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Nothing new.
    Nothing,
    /// Send the spot notice.
    Notice {
        /// When Slurm kills it (ms since epoch).
        deadline: Millis,
    },
    /// Preempted and requeued: cancel it; once `scancel` succeeds it
    /// ended as preempted. If `scancel` fails the watch stays, and the next
    /// poll that shows the job live says `CancelRequeued` again.
    CancelRequeued {
        /// The notice to send first, if no poll saw the preemption coming.
        late_notice: Option<Millis>,
    },
    /// The job ended.
    Ended {
        /// Why, for the ledger.
        reason: EndReason,
        /// For logs.
        detail: String,
        /// The notice to send first: a preempted job whose worker drained
        /// and exited between two polls still gets its notice (so the
        /// autoscaler replaces it as a preemption).
        late_notice: Option<Millis>,
    },
}

impl JobWatch {
    /// A job just submitted (or adopted: `ran` if it was running).
    pub fn new(lease: LeaseId, job: JobId, ran: bool) -> JobWatch {
        JobWatch {
            lease,
            job,
            ran,
            noticed: false,
            misses: 0,
            cancelling: false,
        }
    }

    /// Folds one `squeue` observation (`None`: the job is not listed) into
    /// the watch. Pure: `now` and the notice period are given.
    pub fn observe(&mut self, info: Option<&JobInfo>, now: Millis, notice: Duration) -> Step {
        let Some(info) = info else {
            self.misses += 1;
            if self.misses < MISSES_TO_END {
                return Step::Nothing;
            }
            return Step::Ended {
                reason: self.end_reason(false),
                detail: format!("Slurm job {} is no longer known to Slurm", self.job),
                late_notice: None,
            };
        };
        self.misses = 0;
        let preempted = info.preempt_time.is_some()
            || matches!(&info.state, JobState::Ended(s) if s == "PREEMPTED");
        let notice_ms = Millis::try_from(notice.as_millis()).unwrap_or(Millis::MAX);
        let deadline = info.preempt_time.unwrap_or(now).saturating_add(notice_ms);
        let late_notice = (preempted && !self.noticed).then_some(deadline);
        if self.cancelling && !matches!(info.state, JobState::Ended(_)) {
            // a cancel that failed: try again, even if Slurm started it
            // once more meanwhile; its notice was sent the first time
            return Step::CancelRequeued { late_notice: None };
        }
        match &info.state {
            JobState::Ended(state) => Step::Ended {
                reason: self.end_reason(preempted),
                detail: format!(
                    "Slurm job {} ended {state} (reason {})",
                    self.job, info.reason
                ),
                late_notice,
            },
            JobState::Pending if self.ran || self.noticed || preempted => {
                // requeued after preemption (or after a node failure): a
                // lease is one run, and its worker is gone
                self.cancelling = true;
                self.noticed |= late_notice.is_some();
                Step::CancelRequeued { late_notice }
            }
            JobState::Pending | JobState::Configuring => Step::Nothing,
            JobState::Running | JobState::Suspended | JobState::Completing => {
                if matches!(info.state, JobState::Running) {
                    self.ran = true;
                }
                if preempted && !self.noticed {
                    self.noticed = true;
                    Step::Notice { deadline }
                } else {
                    Step::Nothing
                }
            }
        }
    }

    fn end_reason(&self, preempted: bool) -> EndReason {
        if preempted || self.noticed || self.cancelling {
            EndReason::Preempted
        } else if self.ran {
            EndReason::Lost
        } else {
            EndReason::Failed
        }
    }
}

/// The Slurm tools, with this provider's `SLURM_CONF` and `TZ=UTC`, each
/// run bounded by `tool_timeout_secs`.
#[derive(Debug, Clone)]
struct Tools {
    bin_dir: Option<PathBuf>,
    slurm_conf: Option<PathBuf>,
    /// Longest one run of a tool may take.
    timeout: Duration,
}

/// A Slurm tool that failed.
fn tool_error(lease: Option<LeaseId>, what: String, detail: String) -> ProviderError {
    ProviderError::Slurm {
        lease,
        what,
        detail,
    }
}

/// `d` in seconds, to the millisecond: `30`, `1.5`.
fn secs(d: Duration) -> String {
    format!("{}", (d.as_secs_f64() * 1000.0).round() / 1000.0)
}

/// A tool that did not answer within `limit` (set by `bound`, the
/// setting named in the error) and was killed.
fn timeout_error(
    lease: Option<LeaseId>,
    what: String,
    limit: Duration,
    bound: &str,
) -> ProviderError {
    tool_error(
        lease,
        what,
        format!(
            "did not answer within {} s ({bound}) and was killed; is slurmctld up and answering?",
            secs(limit)
        ),
    )
}

/// Why a tool run failed.
#[derive(Debug)]
struct ToolFailure {
    /// The error to return.
    error: ProviderError,
    /// The tool did not answer in time and was killed: what it was asked
    /// may have been done all the same.
    timed_out: bool,
}

impl From<ProviderError> for ToolFailure {
    fn from(error: ProviderError) -> ToolFailure {
        ToolFailure {
            error,
            timed_out: false,
        }
    }
}

/// All of `pipe`, read on the current task.
async fn read_all(pipe: Option<impl tokio::io::AsyncRead + Unpin>) -> std::io::Result<Vec<u8>> {
    use tokio::io::AsyncReadExt;
    let mut buf = Vec::new();
    if let Some(mut p) = pipe {
        p.read_to_end(&mut buf).await?;
    }
    Ok(buf)
}

/// All of `pipe`, read on a thread of its own (so that a tool printing
/// much never blocks on a full pipe); the answer comes on the receiver.
fn read_all_blocking(
    pipe: Option<impl std::io::Read + Send + 'static>,
) -> std::io::Result<std::sync::mpsc::Receiver<std::io::Result<Vec<u8>>>> {
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    match pipe {
        Some(mut p) => {
            std::thread::Builder::new()
                .name("slurm-tool-pipe".into())
                .spawn(move || {
                    let mut buf = Vec::new();
                    let _ = tx.send(p.read_to_end(&mut buf).map(|_| buf));
                })?;
        }
        None => {
            let _ = tx.send(Ok(Vec::new()));
        }
    }
    Ok(rx)
}

impl Tools {
    fn new(cfg: &SlurmConfig) -> Result<Tools, ProviderError> {
        let timeout = checked_secs(
            "tool_timeout_secs",
            cfg.tool_timeout_secs,
            MAX_TOOL_TIMEOUT_SECS,
        )
        .map_err(|e| tool_error(None, "leasing.slurm".into(), e))?;
        Ok(Tools {
            bin_dir: cfg.bin_dir.clone(),
            slurm_conf: cfg.slurm_conf.clone(),
            timeout,
        })
    }

    fn program(&self, tool: &str) -> PathBuf {
        match &self.bin_dir {
            Some(d) => d.join(tool),
            None => PathBuf::from(tool),
        }
    }

    fn env(&self) -> Vec<(OsString, OsString)> {
        let mut env = vec![(OsString::from("TZ"), OsString::from("UTC"))];
        if let Some(c) = &self.slurm_conf {
            env.push(("SLURM_CONF".into(), c.clone().into_os_string()));
        }
        env
    }

    /// The stdout of a tool that succeeded, else the error.
    fn check(
        lease: Option<LeaseId>,
        what: String,
        out: std::io::Result<std::process::Output>,
    ) -> Result<String, ProviderError> {
        let out = out.map_err(|e| tool_error(lease, what.clone(), e.to_string()))?;
        if out.status.success() {
            return Ok(String::from_utf8_lossy(&out.stdout).into_owned());
        }
        // some tools (scontrol) say what went wrong on stdout
        let stderr = String::from_utf8_lossy(&out.stderr);
        let stdout = String::from_utf8_lossy(&out.stdout);
        let mut detail = match stderr.trim() {
            "" => stdout.trim().to_string(),
            s => s.to_string(),
        };
        if detail.len() > STDERR_KEPT {
            let cut = (0..=STDERR_KEPT)
                .rev()
                .find(|i| detail.is_char_boundary(*i))
                .unwrap_or(0);
            detail.truncate(cut);
        }
        Err(tool_error(lease, what, format!("{}: {detail}", out.status)))
    }

    /// Runs a tool, blocking (start-up checks and adoption only), for at
    /// most `tool_timeout_secs`: past it the tool is killed and reaped.
    fn run_blocking(&self, tool: &str, args: &[String]) -> Result<String, ProviderError> {
        self.run_blocking_timed(tool, args).map_err(|f| f.error)
    }

    /// [`Tools::run_blocking`], saying whether a failure timed out.
    fn run_blocking_timed(&self, tool: &str, args: &[String]) -> Result<String, ToolFailure> {
        use std::process::Stdio;
        let what = format!("{tool} {}", args.join(" "));
        let give_up = Instant::now() + self.timeout;
        let mut child = std::process::Command::new(self.program(tool))
            .args(args)
            .envs(self.env())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| tool_error(None, what.clone(), e.to_string()))?;
        let kill = |child: &mut std::process::Child| {
            // an error here is a child that has exited: wait reaps it
            let _ = child.kill();
            let _ = child.wait();
        };
        let pipes = read_all_blocking(child.stdout.take())
            .and_then(|out| Ok((out, read_all_blocking(child.stderr.take())?)));
        let (out, err) = match pipes {
            Ok(p) => p,
            Err(e) => {
                kill(&mut child);
                return Err(tool_error(None, what, format!("reading its output: {e}")).into());
            }
        };
        let status = loop {
            match child.try_wait() {
                Ok(Some(status)) => break status,
                Ok(None) => {
                    let now = Instant::now();
                    if now >= give_up {
                        kill(&mut child);
                        return Err(ToolFailure {
                            error: timeout_error(None, what, self.timeout, TOOL_TIMEOUT),
                            timed_out: true,
                        });
                    }
                    std::thread::sleep(BLOCKING_POLL.min(give_up - now));
                }
                Err(e) => {
                    kill(&mut child);
                    return Err(tool_error(None, what, e.to_string()).into());
                }
            }
        };
        // it exited; its output ends unless something it started holds it
        let read = |rx: std::sync::mpsc::Receiver<std::io::Result<Vec<u8>>>| {
            rx.recv_timeout(give_up.saturating_duration_since(Instant::now()))
                .map_err(|_| ToolFailure {
                    error: timeout_error(None, what.clone(), self.timeout, TOOL_TIMEOUT),
                    timed_out: true,
                })
        };
        let (stdout, stderr) = (read(out)?, read(err)?);
        let output = stdout.and_then(|stdout| {
            Ok(std::process::Output {
                status,
                stdout,
                stderr: stderr?,
            })
        });
        Ok(Tools::check(None, what, output)?)
    }

    /// Runs a tool for at most `tool_timeout_secs`; `stdin` is written to
    /// it; `env` is added.
    async fn run(
        &self,
        lease: Option<LeaseId>,
        tool: &str,
        args: &[String],
        stdin: Option<&str>,
        env: &[(String, String)],
    ) -> Result<String, ProviderError> {
        self.run_within(lease, tool, args, stdin, env, self.timeout, TOOL_TIMEOUT)
            .await
            .map_err(|f| f.error)
    }

    /// Runs a tool for at most `limit` (set by `bound`, named in the
    /// error): past it the tool is killed and reaped, and the failure says
    /// it timed out.
    #[allow(clippy::too_many_arguments)]
    async fn run_within(
        &self,
        lease: Option<LeaseId>,
        tool: &str,
        args: &[String],
        stdin: Option<&str>,
        env: &[(String, String)],
        limit: Duration,
        bound: &str,
    ) -> Result<String, ToolFailure> {
        use tokio::io::AsyncWriteExt;
        let what = format!("{tool} {}", args.join(" "));
        let mut cmd = tokio::process::Command::new(self.program(tool));
        cmd.args(args)
            .envs(self.env())
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(if stdin.is_some() {
                std::process::Stdio::piped()
            } else {
                std::process::Stdio::null()
            })
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            // a run dropped half way (its caller gave up) kills the tool
            .kill_on_drop(true);
        let mut child = cmd
            .spawn()
            .map_err(|e| tool_error(lease, what.clone(), e.to_string()))?;
        let (pipe_in, pipe_out, pipe_err) =
            (child.stdin.take(), child.stdout.take(), child.stderr.take());
        let feed = async move {
            match (stdin, pipe_in) {
                // dropping the pipe after it closes the tool's stdin
                (Some(text), Some(mut pipe)) => pipe.write_all(text.as_bytes()).await,
                _ => Ok(()),
            }
        };
        let talk =
            async { tokio::join!(feed, read_all(pipe_out), read_all(pipe_err), child.wait()) };
        let talked = tokio::time::timeout(limit, talk).await;
        let Ok((fed, stdout, stderr, status)) = talked else {
            // kill it and reap it: no tool left talking to slurmctld, and
            // no zombie (an error is a tool that has exited meanwhile)
            let _ = child.kill().await;
            return Err(ToolFailure {
                error: timeout_error(lease, what, limit, bound),
                timed_out: true,
            });
        };
        let output = status.and_then(|status| {
            Ok(std::process::Output {
                status,
                stdout: stdout?,
                stderr: stderr?,
            })
        });
        let out = Tools::check(lease, what.clone(), output)?;
        // a tool that succeeded without reading all its input did not
        // get what it was asked
        fed.map_err(|e| tool_error(lease, what, format!("writing stdin: {e}")))?;
        Ok(out)
    }

    fn squeue_args(jobs: &[JobId]) -> Vec<String> {
        let ids: Vec<String> = jobs.iter().map(|j| j.to_string()).collect();
        vec![
            "--noheader".into(),
            "--states=all".into(),
            format!("--jobs={}", ids.join(",")),
            format!("--Format={SQUEUE_FORMAT}"),
        ]
    }

    /// `squeue` of `jobs`: the listed ones. Slurm fails the whole call
    /// when none of the ids is known; that is an empty list.
    fn squeue_result(out: Result<String, ProviderError>) -> Result<Vec<JobInfo>, ProviderError> {
        match out {
            Ok(text) => {
                let (jobs, bad) = parse_squeue(&text);
                if bad > 0 {
                    tracing::warn!(bad, "squeue printed lines that do not parse");
                }
                Ok(jobs)
            }
            Err(ProviderError::Slurm { ref detail, .. })
                if detail.contains("Invalid job id specified") =>
            {
                Ok(Vec::new())
            }
            Err(e) => Err(e),
        }
    }

    async fn squeue(&self, jobs: &[JobId]) -> Result<Vec<JobInfo>, ProviderError> {
        self.squeue_within(None, jobs, self.timeout, TOOL_TIMEOUT)
            .await
    }

    /// [`Tools::squeue`] for `lease` (when it asks for one lease's job),
    /// for at most `limit` (see [`Tools::run_within`]).
    async fn squeue_within(
        &self,
        lease: Option<LeaseId>,
        jobs: &[JobId],
        limit: Duration,
        bound: &str,
    ) -> Result<Vec<JobInfo>, ProviderError> {
        if jobs.is_empty() {
            return Ok(Vec::new());
        }
        let args = Tools::squeue_args(jobs);
        let out = self
            .run_within(lease, "squeue", &args, None, &[], limit, bound)
            .await
            .map_err(|f| f.error);
        Tools::squeue_result(out)
    }

    fn squeue_blocking(&self, jobs: &[JobId]) -> Result<Vec<JobInfo>, ProviderError> {
        if jobs.is_empty() {
            return Ok(Vec::new());
        }
        Tools::squeue_result(self.run_blocking("squeue", &Tools::squeue_args(jobs)))
    }
}

#[derive(Debug)]
enum Cmd {
    Watch(JobWatch),
    /// Stop watching (release, detach); the reply comes once no event for
    /// it can follow.
    Forget(LeaseId, oneshot::Sender<()>),
    /// We are cancelling it (`true`): its end is ours, not news (`release`
    /// waits for it and forgets it); or the release failed (`false`): the
    /// job may run on, and its end is news again.
    Releasing(LeaseId, bool),
    /// An `sbatch` for the job of this name did not answer: a job of the
    /// name that appears within [`ABANDONED_WATCH`] is no lease's, and is
    /// cancelled.
    Abandoned(String),
}

/// The jobs held, shared with the poller, which drops a job once Slurm
/// reports it ended (before it sends the end), so the map holds live jobs
/// only. Never locked across an `.await`.
type HeldJobs = Arc<Mutex<HashMap<LeaseId, JobId>>>;

fn lock(jobs: &HeldJobs) -> MutexGuard<'_, HashMap<LeaseId, JobId>> {
    // a panic while holding it cannot leave the map half-updated
    jobs.lock().unwrap_or_else(|e| e.into_inner())
}

/// The Slurm provider.
#[derive(Debug)]
pub struct SlurmProvider {
    cfg: SlurmConfig,
    tools: Tools,
    notice: Duration,
    jobs: HeldJobs,
    cmds: mpsc::UnboundedSender<Cmd>,
    poller: JoinHandle<()>,
    events_rx: Option<mpsc::Receiver<ProviderEvent>>,
}

impl SlurmProvider {
    /// Checks the configuration against the cluster (every partition
    /// exists; the spot partition's `GraceTime` is the notice period unless
    /// configured) and starts the poller. Blocks on `scontrol`; must be
    /// called inside a tokio runtime.
    pub fn connect(cfg: SlurmConfig) -> Result<SlurmProvider, ProviderError> {
        cfg.validate()
            .map_err(|e| tool_error(None, "leasing.slurm".into(), e))?;
        let tools = Tools::new(&cfg)?;
        let mut grace = None;
        let parts = &cfg.partitions;
        for (tier, p) in [
            (Tier::OnDemand, Some(&parts.on_demand)),
            (Tier::Spot, parts.spot.as_ref()),
            (Tier::Reserved, parts.reserved.as_ref()),
        ] {
            let Some(p) = p else { continue };
            let out = tools
                .run_blocking_timed(
                    "scontrol",
                    &[
                        "show".into(),
                        "partition".into(),
                        "--oneliner".into(),
                        p.clone(),
                    ],
                )
                .map_err(|f| match f.error {
                    // a controller that does not answer: no hint about
                    // the partition would help
                    e if f.timed_out => e,
                    ProviderError::Slurm { detail, .. } => tool_error(
                        None,
                        format!("checking the {tier} partition {p:?}"),
                        format!(
                            "{detail}; is it in slurm.conf, and is SLURM_CONF ({}) right?",
                            cfg.slurm_conf
                                .as_ref()
                                .map_or("default".into(), |c| c.display().to_string())
                        ),
                    ),
                    other => other,
                })?;
            if tier == Tier::Spot {
                grace = parse_grace_secs(&out);
            }
        }
        let notice = match (cfg.notice_period_secs, grace) {
            (Some(s), _) => checked_secs("notice_period_secs", s, MAX_NOTICE_PERIOD_SECS)
                .map_err(|e| tool_error(None, "leasing.slurm".into(), e))?,
            (None, Some(g)) => Duration::from_secs(g),
            (None, None) => Duration::ZERO,
        };
        let (events_tx, events_rx) = mpsc::channel(EVENT_CHANNEL_CAPACITY);
        let (cmds, rx) = mpsc::unbounded_channel();
        let jobs = HeldJobs::default();
        let poller = tokio::spawn(poll(
            tools.clone(),
            Duration::from_millis(cfg.poll_interval_ms),
            notice,
            rx,
            events_tx,
            jobs.clone(),
        ));
        Ok(SlurmProvider {
            cfg,
            tools,
            notice,
            jobs,
            cmds,
            poller,
            events_rx: Some(events_rx),
        })
    }

    /// The notice period a preempted spot lease gets.
    pub fn notice_period(&self) -> Duration {
        self.notice
    }

    /// The job of a held lease.
    pub fn job(&self, lease: LeaseId) -> Option<JobId> {
        lock(&self.jobs).get(&lease).copied()
    }

    /// Leases held: those whose job Slurm has not reported ended.
    pub fn held(&self) -> Vec<LeaseId> {
        let mut v: Vec<LeaseId> = lock(&self.jobs).keys().copied().collect();
        v.sort();
        v
    }

    /// Re-adopts the live `slurm` leases recorded in `ledger`, ending the
    /// ones whose job is gone: at the job's end when `squeue` still shows
    /// it, otherwise at `now`. Blocks on `squeue` (it runs once, at start);
    /// a controller that cannot answer fails it, since ending leases whose
    /// jobs may well run would leak them.
    pub fn adopt(&mut self, ledger: &mut Ledger, now: Millis) -> Result<Adoption, ProviderError> {
        let recs = ledger.live_leases()?;
        let ids: Vec<JobId> = recs
            .iter()
            .filter(|r| r.provider == PROVIDER_NAME)
            .filter_map(|r| r.provider_data.as_deref())
            .filter_map(|d| serde_json::from_str::<SlurmData>(d).ok())
            .map(|d| d.job_id)
            .collect();
        let infos = self.tools.squeue_blocking(&ids)?;
        let mut out = Adoption::default();
        for r in recs.into_iter().filter(|r| r.provider == PROVIDER_NAME) {
            let job = r
                .provider_data
                .as_deref()
                .and_then(|d| serde_json::from_str::<SlurmData>(d).ok())
                .map(|d| d.job_id);
            let info = job.and_then(|j| infos.iter().find(|i| i.id == j));
            let live = info.filter(|i| !matches!(i.state, JobState::Ended(_)));
            if let (Some(job), Some(info)) = (job, live) {
                let ran = !matches!(info.state, JobState::Pending | JobState::Configuring);
                self.watch(JobWatch::new(r.id, job, ran))?;
                tracing::info!(lease = %r.id, %job, "adopted Slurm job after restart");
                out.adopted.push(r.id);
            } else {
                let reason = if r.state == LeaseState::Requested {
                    EndReason::Failed
                } else {
                    EndReason::Lost
                };
                if job.is_none() {
                    // The gateway stopped between sbatch and recording the
                    // job id: a job may be queued under the lease's name,
                    // to hold GPUs and start a worker for an ended lease.
                    let name = format!("--name={}-{}", self.cfg.job_name, r.id.0);
                    match self.tools.run_blocking("scancel", &[name]) {
                        Ok(_) => {
                            tracing::info!(lease = %r.id, "cancelled any job submitted for it before the restart")
                        }
                        Err(e) => {
                            tracing::warn!(lease = %r.id, "cancelling a job it may have been given: {e}")
                        }
                    }
                }
                // billed to when the job ended, where Slurm still says
                // (`MinJobAge`, 300 s by default); otherwise to now
                let at = info.and_then(|i| i.end_time).map_or(now, |t| t.min(now));
                ledger.mark_ended(r.id, at, reason)?;
                tracing::warn!(lease = %r.id, job = ?job, ended_at = at, "Slurm job gone after restart; lease ended");
                out.ended.push((r.id, reason));
            }
        }
        Ok(out)
    }

    fn watch(&mut self, w: JobWatch) -> Result<(), ProviderError> {
        watch(&self.cmds, &self.jobs, w)
    }

    /// Stops watching every job WITHOUT cancelling it, as a crash of the
    /// gateway would. The next provider over the same ledger adopts them.
    pub async fn detach_all(self) {
        for lease in self.held() {
            forget(&self.cmds, lease).await;
        }
        lock(&self.jobs).clear();
        self.poller.abort();
    }

    /// Starts releasing `leases` all at once: one `scancel` of their jobs
    /// (each worker gets SIGTERM and drains) without waiting for them to
    /// end. [`Provider::release`] then cancels again (harmless) and waits,
    /// so a gateway stopping with many leases waits about one drain, not
    /// one per lease. A failed `scancel` is logged; `release` retries.
    pub async fn begin_release(&mut self, leases: &[LeaseId]) {
        let mut jobs = Vec::new();
        for lease in leases {
            if let Some(job) = self.job(*lease) {
                let _ = self.cmds.send(Cmd::Releasing(*lease, true));
                jobs.push(job.to_string());
            }
        }
        if jobs.is_empty() {
            return;
        }
        if let Err(e) = self.tools.run(None, "scancel", &jobs, None, &[]).await {
            tracing::warn!(?jobs, error = %e, "cancelling jobs; each release tries again");
        }
    }

    /// Releases every lease (cancels its job and waits for its end). A job
    /// that cannot be cancelled is logged with its id: it outlives the
    /// provider, and the next one over the same ledger adopts it.
    pub async fn shutdown(mut self) {
        let held = self.held();
        self.begin_release(&held).await;
        for lease in held {
            if let Err(e) = self.release(lease).await {
                let job = self.job(lease);
                tracing::warn!(%lease, ?job, error = %e, "release at shutdown failed; the job may still run and bill");
            }
        }
        self.poller.abort();
    }
}

impl Drop for SlurmProvider {
    fn drop(&mut self) {
        // Jobs are not ours to kill on drop: they outlive the gateway
        // like a cloud instance would, and the ledger adopts them.
        self.poller.abort();
    }
}

impl Provider for SlurmProvider {
    fn name(&self) -> &'static str {
        PROVIDER_NAME
    }

    /// Builds the job in the call; the future submits it (within
    /// `tool_timeout_secs`) and watches it.
    fn acquire(
        &mut self,
        spec: LeaseSpec,
    ) -> impl Future<Output = Result<Acquired, ProviderError>> + Send + 'static {
        let lease = spec.lease;
        let args = if self.job(lease).is_some() {
            Err(ProviderError::Duplicate(lease))
        } else {
            self.cfg.sbatch_args(&spec)
        };
        let mut env: Vec<(String, String)> = self
            .cfg
            .env
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        env.extend([
            ("TIDEGATE_LEASE_ID".to_string(), lease.0.to_string()),
            (
                "TIDEGATE_LEASE_TOKEN".into(),
                spec.token.expose().to_string(),
            ),
            ("TIDEGATE_INSTANCE_TYPE".into(), spec.instance.name.clone()),
            ("TIDEGATE_GPU_MODEL".into(), spec.instance.gpu_model.clone()),
            ("TIDEGATE_LEASE_TIER".into(), spec.tier.as_str().to_string()),
        ]);
        let script = self.cfg.script();
        let partition = self
            .cfg
            .partition(spec.tier)
            .unwrap_or_default()
            .to_string();
        let (tools, job_name) = (self.tools.clone(), self.cfg.job_name.clone());
        let (cmds, jobs) = (self.cmds.clone(), self.jobs.clone());
        async move {
            let args = args?;
            let sbatch = tools
                .run_within(
                    Some(lease),
                    "sbatch",
                    &args,
                    Some(&script),
                    &env,
                    tools.timeout,
                    TOOL_TIMEOUT,
                )
                .await;
            let out = match sbatch {
                Ok(out) => out,
                Err(f) => {
                    if f.timed_out {
                        cancel_unanswered(&tools, &job_name, lease).await;
                        // the controller may queue it later still
                        let _ = cmds.send(Cmd::Abandoned(format!("{job_name}-{}", lease.0)));
                    }
                    return Err(f.error);
                }
            };
            let job = parse_job_id(&out).ok_or_else(|| {
                tool_error(
                    Some(lease),
                    "sbatch".into(),
                    format!("no job id in its output {:?}", out.trim()),
                )
            })?;
            watch(&cmds, &jobs, JobWatch::new(lease, job, false))?;
            tracing::info!(%lease, %job, %partition, instance = %spec.instance.name, tier = %spec.tier, "Slurm job submitted");
            let data = SlurmData {
                job_id: job,
                partition,
            };
            Ok(Acquired {
                lease,
                pid: None,
                provider_data: Some(serde_json::to_string(&data).unwrap_or_default()),
                token: None,
            })
        }
    }

    /// Cancels the lease's job and waits until Slurm reports it ended;
    /// only then is it forgotten. On an error the job is still held and
    /// watched: it may still run (and bill), so the caller must retry.
    fn release(
        &mut self,
        lease: LeaseId,
    ) -> impl Future<Output = Result<(), ProviderError>> + Send + 'static {
        let _ = self.cmds.send(Cmd::Releasing(lease, true));
        let release = JobRelease {
            lease,
            job: self.job(lease),
            tools: self.tools.clone(),
            cmds: self.cmds.clone(),
            jobs: self.jobs.clone(),
            timeout_secs: self.cfg.release_timeout_secs,
        };
        async move {
            let cmds = release.cmds.clone();
            let r = release.cancel_and_wait().await;
            if r.is_err() {
                let _ = cmds.send(Cmd::Releasing(lease, false));
            }
            r
        }
    }

    fn take_events(&mut self) -> Option<mpsc::Receiver<ProviderEvent>> {
        self.events_rx.take()
    }
}

/// One release's work, owning what it needs so that the shell can wait
/// for it while it goes on with other work.
struct JobRelease {
    lease: LeaseId,
    job: Option<JobId>,
    tools: Tools,
    cmds: mpsc::UnboundedSender<Cmd>,
    jobs: HeldJobs,
    timeout_secs: f64,
}

impl JobRelease {
    /// Cancel, wait for the end, forget; all within `release_timeout_secs`.
    async fn cancel_and_wait(self) -> Result<(), ProviderError> {
        let lease = self.lease;
        let job = self.job.ok_or(ProviderError::UnknownLease(lease))?;
        let timeout = checked_secs(
            "release_timeout_secs",
            self.timeout_secs,
            MAX_RELEASE_TIMEOUT_SECS,
        )
        .unwrap_or(Duration::from_secs_f64(default_release_timeout_secs()));
        let give_up = tokio::time::Instant::now() + timeout;
        let cancel = [job.to_string()];
        if let Err(e) = self.tool("scancel", &cancel, give_up).await {
            // a job that has ended cannot be cancelled, and need not be
            if !matches!(self.live_state(job, give_up).await, Ok(None)) {
                return Err(e);
            }
        }
        loop {
            let state = match self.live_state(job, give_up).await? {
                None => break,
                Some(state) => state,
            };
            let left = give_up.saturating_duration_since(tokio::time::Instant::now());
            if left < RELEASE_POLL {
                // no time for another look
                return Err(tool_error(
                    Some(lease),
                    format!("waiting for cancelled job {job} to end"),
                    format!(
                        "still {state:?} after {} s; it is still held and watched, and its release will be retried",
                        self.timeout_secs
                    ),
                ));
            }
            tokio::time::sleep(RELEASE_POLL).await;
        }
        forget(&self.cmds, lease).await;
        lock(&self.jobs).remove(&lease);
        tracing::info!(%lease, %job, "Slurm job cancelled");
        Ok(())
    }

    /// How long a tool may run, given the release ends at `give_up`: the
    /// smaller of the tool's own deadline and the time left; and which
    /// setting that is. `None` when no time is left.
    fn limit(&self, give_up: tokio::time::Instant) -> Option<(Duration, &'static str)> {
        let left = give_up.saturating_duration_since(tokio::time::Instant::now());
        if left.is_zero() {
            None
        } else if left < self.tools.timeout {
            Some((left, "what was left of release_timeout_secs"))
        } else {
            Some((self.tools.timeout, TOOL_TIMEOUT))
        }
    }

    /// The error of a release out of time before it could run `what`.
    fn out_of_time(&self, what: String) -> ProviderError {
        tool_error(
            Some(self.lease),
            what,
            format!(
                "not run: release_timeout_secs ({} s) ran out; the job is still held and watched, and its release will be retried",
                self.timeout_secs
            ),
        )
    }

    /// Runs `tool` for this release, within its deadline.
    async fn tool(
        &self,
        tool: &str,
        args: &[String],
        give_up: tokio::time::Instant,
    ) -> Result<String, ProviderError> {
        let Some((limit, bound)) = self.limit(give_up) else {
            return Err(self.out_of_time(format!("{tool} {}", args.join(" "))));
        };
        self.tools
            .run_within(Some(self.lease), tool, args, None, &[], limit, bound)
            .await
            .map_err(|f| f.error)
    }

    /// [`live_state`], within the release's deadline.
    async fn live_state(
        &self,
        job: JobId,
        give_up: tokio::time::Instant,
    ) -> Result<Option<JobState>, ProviderError> {
        let Some((limit, bound)) = self.limit(give_up) else {
            return Err(self.out_of_time(format!("squeue --jobs={job}")));
        };
        live_state(&self.tools, self.lease, job, limit, bound).await
    }
}

/// Has the poller watch `w`'s job, and holds it.
fn watch(
    cmds: &mpsc::UnboundedSender<Cmd>,
    jobs: &HeldJobs,
    w: JobWatch,
) -> Result<(), ProviderError> {
    let (lease, job) = (w.lease, w.job);
    cmds.send(Cmd::Watch(w)).map_err(|_| {
        tool_error(
            Some(lease),
            "watching its job".into(),
            "the poller has stopped".into(),
        )
    })?;
    lock(jobs).insert(lease, job);
    Ok(())
}

/// After an `sbatch` for `lease` that did not answer in time: the
/// controller may have queued the job all the same (the answer was lost),
/// and nobody knows its id, so any job of the lease's name is cancelled,
/// as adoption does for a lease whose job id was never recorded. Best
/// effort: a failure is logged.
async fn cancel_unanswered(tools: &Tools, job_name: &str, lease: LeaseId) {
    let name = format!("{job_name}-{}", lease.0);
    let args = [format!("--name={name}")];
    match tools.run(Some(lease), "scancel", &args, None, &[]).await {
        Ok(_) => {
            tracing::info!(%lease, job_name = %name, "sbatch did not answer; cancelled any job it may have queued")
        }
        Err(e) => {
            tracing::warn!(%lease, job_name = %name, error = %e, "sbatch did not answer, and cancelling any job it may have queued failed; such a job runs unwatched: cancel it with `scancel --name={name}`")
        }
    }
}

/// Cancels the live jobs named in `abandoned`: queued by an `sbatch` that
/// did not answer, after its acquire gave up, they belong to no lease. A
/// name whose job is cancelled is looked for no more (one `sbatch` queues
/// one job). Failures are logged; the next poll tries again.
async fn cancel_strays(tools: &Tools, abandoned: &mut Vec<(String, Instant)>) {
    let names: Vec<&str> = abandoned.iter().map(|(n, _)| n.as_str()).collect();
    let args = [
        "--noheader".to_string(),
        format!("--name={}", names.join(",")),
        "--format=%i|%j|%T".to_string(),
    ];
    let out = match tools.run(None, "squeue", &args, None, &[]).await {
        Ok(out) => out,
        Err(e) => {
            tracing::debug!(error = %e, "looking for jobs queued by unanswered sbatches");
            return;
        }
    };
    for (job, name) in parse_stray_jobs(&out) {
        match tools
            .run(None, "scancel", &[job.to_string()], None, &[])
            .await
        {
            Ok(_) => {
                tracing::warn!(%job, job_name = %name, "Slurm queued a job after its sbatch had stopped waiting for the answer; no lease holds it, cancelled so it does not bill");
                abandoned.retain(|(n, _)| *n != name);
            }
            Err(e) => {
                tracing::warn!(%job, job_name = %name, error = %e, "cancelling a job no lease holds failed; trying again at the next poll");
            }
        }
    }
}

/// The live jobs in `squeue --format=%i|%j|%T` output: id and name. Jobs
/// already on their way out (`COMPLETING`, or ended) and lines that do not
/// parse are left out.
pub fn parse_stray_jobs(stdout: &str) -> Vec<(JobId, String)> {
    stdout
        .lines()
        .filter_map(|line| {
            let mut f = line.trim().splitn(3, '|');
            let (id, name, state) = (f.next()?, f.next()?, f.next()?);
            let id = id.trim().parse::<u64>().ok()?;
            match JobState::parse(state) {
                JobState::Completing | JobState::Ended(_) => None,
                _ => Some((JobId(id), name.trim().to_string())),
            }
        })
        .collect()
}

/// Has the poller stop watching `lease`; returns once it has.
async fn forget(cmds: &mpsc::UnboundedSender<Cmd>, lease: LeaseId) {
    let (tx, rx) = oneshot::channel();
    if cmds.send(Cmd::Forget(lease, tx)).is_ok() {
        let _ = rx.await;
    }
}

/// The state of `lease`'s `job` while Slurm reports it live; `None` once
/// it has ended (or Slurm no longer knows it); `Err` when `squeue` cannot
/// answer within `limit` (set by `bound`).
async fn live_state(
    tools: &Tools,
    lease: LeaseId,
    job: JobId,
    limit: Duration,
    bound: &str,
) -> Result<Option<JobState>, ProviderError> {
    let infos = tools
        .squeue_within(Some(lease), &[job], limit, bound)
        .await?;
    Ok(match infos.into_iter().find(|i| i.id == job) {
        None => None,
        Some(i) if matches!(i.state, JobState::Ended(_)) => None,
        Some(i) => Some(i.state),
    })
}

/// The poller: owns the watches, polls `squeue`, sends events.
async fn poll(
    tools: Tools,
    every: Duration,
    notice: Duration,
    mut cmds: mpsc::UnboundedReceiver<Cmd>,
    events: mpsc::Sender<ProviderEvent>,
    held: HeldJobs,
) {
    let mut watches: HashMap<LeaseId, JobWatch> = HashMap::new();
    let mut releasing: HashSet<LeaseId> = HashSet::new();
    // job names of unanswered sbatches, and until when to look for them
    let mut abandoned: Vec<(String, Instant)> = Vec::new();
    // the first poll one interval after start, not at once: a lease
    // watched in the meantime is looked at on the same schedule as later
    // ones (and a test that swaps a tool after its acquire never races an
    // immediate poll)
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failures = 0u32;
    loop {
        tokio::select! {
            cmd = cmds.recv() => match cmd {
                Some(Cmd::Watch(w)) => {
                    watches.insert(w.lease, w);
                }
                Some(Cmd::Releasing(lease, true)) => {
                    releasing.insert(lease);
                }
                Some(Cmd::Releasing(lease, false)) => {
                    releasing.remove(&lease);
                }
                Some(Cmd::Forget(lease, done)) => {
                    watches.remove(&lease);
                    releasing.remove(&lease);
                    let _ = done.send(());
                }
                Some(Cmd::Abandoned(name)) => {
                    if abandoned.len() >= ABANDONED_KEPT {
                        abandoned.remove(0);
                    }
                    abandoned.push((name, Instant::now() + ABANDONED_WATCH));
                }
                None => return,
            },
            _ = tick.tick() => {
                let now = Instant::now();
                abandoned.retain(|(_, until)| *until > now);
                if !abandoned.is_empty() {
                    cancel_strays(&tools, &mut abandoned).await;
                }
                if watches.is_empty() {
                    continue;
                }
                let jobs: Vec<JobId> = watches.values().map(|w| w.job).collect();
                match tools.squeue(&jobs).await {
                    Ok(infos) => {
                        failures = 0;
                        if !poll_once(&tools, &mut watches, &releasing, &infos, notice, &events, &held).await {
                            return;
                        }
                    }
                    Err(e) => {
                        // the controller may be restarting; the jobs run on
                        failures += 1;
                        if failures == 1 || failures.is_multiple_of(30) {
                            tracing::warn!(error = %e, failures, "squeue failed; leases kept as they were");
                        }
                    }
                }
            }
        }
    }
}

/// Folds one `squeue` answer into the watches and sends what it means;
/// `false` once nobody listens to the events. A job that ended is dropped
/// from the watches and from the held jobs before its end is sent.
async fn poll_once(
    tools: &Tools,
    watches: &mut HashMap<LeaseId, JobWatch>,
    releasing: &HashSet<LeaseId>,
    infos: &[JobInfo],
    notice: Duration,
    events: &mpsc::Sender<ProviderEvent>,
    held: &HeldJobs,
) -> bool {
    let now = wall_clock_ms();
    let mut ended = Vec::new();
    let mut out = Vec::new();
    for w in watches.values_mut() {
        let (lease, job) = (w.lease, w.job);
        if releasing.contains(&lease) {
            // release() waits for its end and forgets it
            continue;
        }
        let info = infos.iter().find(|i| i.id == job);
        let notice_first = |deadline: Option<Millis>, out: &mut Vec<ProviderEvent>| {
            if let Some(deadline) = deadline {
                out.push(ProviderEvent::PreemptionNotice { lease, deadline });
            }
        };
        match w.observe(info, now, notice) {
            Step::Nothing => {}
            Step::Notice { deadline } => {
                tracing::info!(%lease, %job, deadline, "Slurm preempts the job: spot notice");
                notice_first(Some(deadline), &mut out);
            }
            Step::CancelRequeued { late_notice } => {
                // the notice first: the worker is gone either way
                notice_first(late_notice, &mut out);
                let r = tools
                    .run(Some(lease), "scancel", &[job.to_string()], None, &[])
                    .await;
                if let Err(e) = r {
                    // Slurm may start it again: keep it held and watched,
                    // and cancel again at the next poll (or see it end)
                    tracing::warn!(%lease, %job, error = %e, "cancelling a requeued job failed; retrying at the next poll");
                    continue;
                }
                ended.push(lease);
                out.push(ProviderEvent::Ended {
                    lease,
                    reason: EndReason::Preempted,
                    detail: format!("Slurm job {job} was preempted and requeued; cancelled"),
                });
            }
            Step::Ended {
                reason,
                detail,
                late_notice,
            } => {
                notice_first(late_notice, &mut out);
                ended.push(lease);
                out.push(ProviderEvent::Ended {
                    lease,
                    reason,
                    detail,
                });
            }
        }
    }
    if !ended.is_empty() {
        let mut held = lock(held);
        for lease in ended {
            watches.remove(&lease);
            held.remove(&lease);
        }
    }
    for ev in out {
        if events.send(ev).await.is_err() {
            return false;
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::Catalog;
    use crate::table::LeaseToken;

    fn spec(tier: Tier, instance: &str) -> LeaseSpec {
        LeaseSpec {
            lease: LeaseId(12),
            token: LeaseToken::generate().unwrap(),
            instance: Catalog::default_catalog().get(instance).unwrap().clone(),
            tier,
            preempt_after: None,
        }
    }

    fn info(state: &str, preempt: Option<Millis>) -> JobInfo {
        JobInfo {
            id: JobId(7),
            state: JobState::parse(state),
            preempt_time: preempt,
            end_time: None,
            reason: "None".into(),
        }
    }

    const NOTICE: Duration = Duration::from_secs(30);

    #[test]
    fn job_ids_parse_with_and_without_a_cluster() {
        assert_eq!(parse_job_id("123\n"), Some(JobId(123)));
        assert_eq!(parse_job_id("\n45;gpu-cluster\n"), Some(JobId(45)));
        assert_eq!(parse_job_id(""), None);
        assert_eq!(parse_job_id("Submitted batch job 9"), None);
        assert_eq!(parse_job_id("0"), None);
    }

    #[test]
    fn squeue_rows_parse_and_bad_rows_are_counted() {
        let text = "3|COMPLETED|2026-12-03T03:38:56|2026-12-03T03:39:01|None|\n\
                    4|PENDING|N/A|2026-12-04T03:39:01|Resources|\n\
                    12_3|RUNNING|N/A|N/A|None|\n\
                    5|RUNNING|N/A|\n\
                    garbage\n\n";
        let (jobs, bad) = parse_squeue(text);
        assert_eq!(bad, 2);
        assert_eq!(jobs.len(), 3);
        assert_eq!(jobs[0].id, JobId(3));
        assert_eq!(jobs[0].state, JobState::Ended("COMPLETED".into()));
        assert_eq!(jobs[0].preempt_time, Some(1_796_269_136_000));
        assert_eq!(
            jobs[0].end_time,
            Some(1_796_269_141_000),
            "an ended job's end"
        );
        assert_eq!(jobs[1].state, JobState::Pending);
        assert_eq!(jobs[1].preempt_time, None);
        assert_eq!(jobs[1].end_time, None, "a live job's time limit is no end");
        assert_eq!(jobs[1].reason, "Resources");
        assert_eq!((jobs[2].id, jobs[2].reason.as_str()), (JobId(5), ""));
    }

    #[test]
    fn stray_jobs_are_the_live_rows_of_squeue() {
        let out = "17|tg-3|PENDING\n18|tg-4|RUNNING\n19|tg-5|COMPLETING\n20|tg-6|CANCELLED\nnot a row\n21_2|tg-7|RUNNING\n";
        assert_eq!(
            parse_stray_jobs(out),
            vec![
                (JobId(17), "tg-3".to_string()),
                (JobId(18), "tg-4".to_string())
            ]
        );
        assert!(parse_stray_jobs("").is_empty());
    }

    #[test]
    fn utc_times_parse_like_the_calendar() {
        assert_eq!(parse_utc("1970-01-01T00:00:00"), Some(0));
        assert_eq!(parse_utc("2000-03-01T00:00:00"), Some(951_868_800_000));
        assert_eq!(parse_utc("2024-02-29T23:59:59"), Some(1_709_251_199_000));
        for bad in [
            "N/A",
            "None",
            "Unknown",
            "2024-13-01T00:00:00",
            "2024-01-01T24:00:00",
            "2024-01-01",
            "1969-12-31T23:59:59",
        ] {
            assert_eq!(parse_utc(bad), None, "{bad}");
        }
    }

    #[test]
    fn unknown_states_end_the_lease() {
        assert_eq!(JobState::parse("RUNNING"), JobState::Running);
        assert_eq!(JobState::parse("REQUEUED"), JobState::Pending);
        assert_eq!(
            JobState::parse("NODE_FAIL"),
            JobState::Ended("NODE_FAIL".into())
        );
        assert_eq!(
            JobState::parse("SOMETHING_NEW"),
            JobState::Ended("SOMETHING_NEW".into())
        );
    }

    #[test]
    fn grace_time_is_read_from_scontrol() {
        let out = "PartitionName=spot AllowGroups=ALL GraceTime=120 Hidden=NO PreemptMode=CANCEL";
        assert_eq!(parse_grace_secs(out), Some(120));
        assert_eq!(parse_grace_secs("PartitionName=x"), None);
    }

    #[test]
    fn a_preempted_job_gets_one_notice_then_ends_preempted() {
        let mut w = JobWatch::new(LeaseId(1), JobId(7), false);
        assert_eq!(
            w.observe(Some(&info("PENDING", None)), 1000, NOTICE),
            Step::Nothing
        );
        assert_eq!(
            w.observe(Some(&info("RUNNING", None)), 2000, NOTICE),
            Step::Nothing
        );
        assert!(w.ran);
        assert_eq!(
            w.observe(Some(&info("RUNNING", Some(5000))), 6000, NOTICE),
            Step::Notice { deadline: 35_000 }
        );
        assert_eq!(
            w.observe(Some(&info("COMPLETING", Some(5000))), 7000, NOTICE),
            Step::Nothing
        );
        // the worker drained and exited 0 within the grace time
        match w.observe(Some(&info("COMPLETED", Some(5000))), 8000, NOTICE) {
            Step::Ended {
                reason,
                detail,
                late_notice,
            } => {
                assert_eq!(reason, EndReason::Preempted);
                assert!(detail.contains("COMPLETED"), "{detail}");
                assert_eq!(late_notice, None, "the notice went out already");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn ends_are_lost_failed_or_preempted() {
        let end =
            |w: &mut JobWatch, state: &str| match w.observe(Some(&info(state, None)), 0, NOTICE) {
                Step::Ended { reason, .. } => reason,
                other => panic!("{other:?}"),
            };
        let mut never_ran = JobWatch::new(LeaseId(1), JobId(7), false);
        assert_eq!(end(&mut never_ran, "CANCELLED"), EndReason::Failed);
        let mut ran = JobWatch::new(LeaseId(1), JobId(7), true);
        assert_eq!(end(&mut ran, "NODE_FAIL"), EndReason::Lost);
        let mut killed = JobWatch::new(LeaseId(1), JobId(7), true);
        assert_eq!(end(&mut killed, "PREEMPTED"), EndReason::Preempted);
        // preempted, drained and gone between two polls: notice, then end
        let mut quick = JobWatch::new(LeaseId(1), JobId(7), true);
        match quick.observe(Some(&info("COMPLETED", Some(4000))), 9000, NOTICE) {
            Step::Ended {
                reason,
                late_notice,
                ..
            } => {
                assert_eq!(reason, EndReason::Preempted);
                assert_eq!(late_notice, Some(34_000));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_missing_job_ends_only_after_two_polls() {
        let mut w = JobWatch::new(LeaseId(1), JobId(7), true);
        assert_eq!(w.observe(None, 0, NOTICE), Step::Nothing);
        assert_eq!(
            w.observe(Some(&info("RUNNING", None)), 0, NOTICE),
            Step::Nothing
        );
        assert_eq!(w.observe(None, 0, NOTICE), Step::Nothing);
        match w.observe(None, 0, NOTICE) {
            Step::Ended { reason, detail, .. } => {
                assert_eq!(reason, EndReason::Lost);
                assert!(detail.contains("no longer known"), "{detail}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_requeued_job_is_cancelled() {
        let mut w = JobWatch::new(LeaseId(1), JobId(7), false);
        assert_eq!(
            w.observe(Some(&info("RUNNING", None)), 0, NOTICE),
            Step::Nothing
        );
        assert_eq!(
            w.observe(Some(&info("PENDING", None)), 0, NOTICE),
            Step::CancelRequeued { late_notice: None }
        );
        // preempted and requeued between two polls: the notice comes late
        let mut w = JobWatch::new(LeaseId(1), JobId(7), true);
        assert_eq!(
            w.observe(Some(&info("PENDING", Some(4000))), 9000, NOTICE),
            Step::CancelRequeued {
                late_notice: Some(34_000)
            }
        );
    }

    #[test]
    fn a_requeued_job_is_cancelled_again_until_slurm_reports_it_ended() {
        let mut w = JobWatch::new(LeaseId(1), JobId(7), true);
        let late = Step::CancelRequeued {
            late_notice: Some(34_000),
        };
        let again = Step::CancelRequeued { late_notice: None };
        assert_eq!(
            w.observe(Some(&info("PENDING", Some(4000))), 9000, NOTICE),
            late
        );
        // the scancel failed: the next polls cancel again, the notice once
        assert_eq!(
            w.observe(Some(&info("PENDING", Some(4000))), 10_000, NOTICE),
            again
        );
        // Slurm started the requeued job meanwhile: still cancelled
        assert_eq!(
            w.observe(Some(&info("RUNNING", None)), 11_000, NOTICE),
            again
        );
        match w.observe(Some(&info("CANCELLED", None)), 12_000, NOTICE) {
            Step::Ended {
                reason,
                late_notice,
                ..
            } => {
                assert_eq!(reason, EndReason::Preempted);
                assert_eq!(late_notice, None);
            }
            other => panic!("{other:?}"),
        }
        // requeued after a node failure (no preemption), gone from squeue
        let mut w = JobWatch::new(LeaseId(1), JobId(7), true);
        assert_eq!(w.observe(Some(&info("PENDING", None)), 0, NOTICE), again);
        assert_eq!(w.observe(None, 0, NOTICE), Step::Nothing);
        match w.observe(None, 0, NOTICE) {
            Step::Ended { reason, .. } => assert_eq!(reason, EndReason::Preempted),
            other => panic!("{other:?}"),
        }
    }

    /// Points the provider's `scancel` at `true` or `false` (a symlink:
    /// nothing is written that a forked child could hold open).
    fn fake_scancel(dir: &std::path::Path, works: bool) {
        let target = ["/bin", "/usr/bin"]
            .iter()
            .map(|d| std::path::Path::new(d).join(if works { "true" } else { "false" }))
            .find(|p| p.exists())
            .expect("true and false are installed");
        let link = dir.join("scancel");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(target, link).unwrap();
    }

    #[tokio::test]
    async fn a_requeued_job_whose_scancel_fails_stays_held_and_watched() {
        let dir = tempfile::tempdir().unwrap();
        let tools = Tools {
            bin_dir: Some(dir.path().to_path_buf()),
            slurm_conf: None,
            timeout: Duration::from_secs(30),
        };
        let lease = LeaseId(1);
        let mut watches = HashMap::from([(lease, JobWatch::new(lease, JobId(7), true))]);
        let held = HeldJobs::default();
        lock(&held).insert(lease, JobId(7));
        let (tx, mut rx) = mpsc::channel(16);
        let requeued = [info("PENDING", Some(4000))];
        let releasing = HashSet::new();

        fake_scancel(dir.path(), false);
        assert!(
            poll_once(
                &tools,
                &mut watches,
                &releasing,
                &requeued,
                NOTICE,
                &tx,
                &held
            )
            .await
        );
        // the notice goes out (its worker is gone), but the lease does not end
        assert!(matches!(
            rx.try_recv(),
            Ok(ProviderEvent::PreemptionNotice { lease: l, deadline: 34_000 }) if l == lease
        ));
        assert!(rx.try_recv().is_err());
        assert!(watches.contains_key(&lease));
        assert_eq!(lock(&held).get(&lease), Some(&JobId(7)));

        // the next poll cancels again; this time it works, and it ends
        fake_scancel(dir.path(), true);
        assert!(
            poll_once(
                &tools,
                &mut watches,
                &releasing,
                &requeued,
                NOTICE,
                &tx,
                &held
            )
            .await
        );
        match rx.try_recv() {
            Ok(ProviderEvent::Ended {
                lease: l, reason, ..
            }) => {
                assert_eq!(l, lease);
                assert_eq!(reason, EndReason::Preempted);
            }
            other => panic!("{other:?}"),
        }
        assert!(rx.try_recv().is_err());
        assert!(watches.is_empty());
        assert!(lock(&held).is_empty());
    }

    #[test]
    fn sbatch_arguments_follow_the_tier_and_the_instance() {
        let mut cfg = SlurmConfig::new("tidegate-worker", &["--config", "w.toml", "run"], "gpu");
        cfg.partitions.spot = Some("spot".into());
        cfg.reservation = Some("tidegate-rsv".into());
        cfg.output = Some("/var/log/tidegate/%j.out".into());
        cfg.sbatch_args = vec!["--cpus-per-task=8".into()];
        cfg.gres.insert("a100".into(), "gpu:a100:1".into());
        let a = cfg.sbatch_args(&spec(Tier::Spot, "h100")).unwrap();
        assert_eq!(
            a,
            [
                "--parsable",
                "--job-name=tidegate-12",
                "--partition=spot",
                "--ntasks=1",
                "--export=ALL",
                "--gres=gpu:1",
                "--output=/var/log/tidegate/%j.out",
                "--cpus-per-task=8"
            ]
        );
        let r = cfg.sbatch_args(&spec(Tier::Reserved, "a100")).unwrap();
        assert!(r.contains(&"--partition=gpu".to_string()), "{r:?}");
        assert!(r.contains(&"--gres=gpu:a100:1".to_string()), "{r:?}");
        assert!(
            r.contains(&"--reservation=tidegate-rsv".to_string()),
            "{r:?}"
        );
        let cpu = cfg.sbatch_args(&spec(Tier::OnDemand, "cpu-32")).unwrap();
        assert!(!cpu.iter().any(|a| a.starts_with("--gres")), "{cpu:?}");
        cfg.partitions.spot = None;
        match cfg.sbatch_args(&spec(Tier::Spot, "h100")) {
            Err(ProviderError::NoCapacity { detail, .. }) => {
                assert!(detail.contains("partitions.spot"), "{detail}")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_script_runs_the_worker_as_a_quoted_job_step() {
        let cfg = SlurmConfig::new(
            "/opt/tidegate/bin/tidegate-worker",
            &["--config", "it's here.toml"],
            "gpu",
        );
        let s = cfg.script();
        assert!(s.starts_with("#!/bin/sh\n"), "{s}");
        assert!(
            s.contains("exec srun --ntasks=1 --kill-on-bad-exit=1 -- /opt/tidegate/bin/tidegate-worker --config 'it'\\''s here.toml'\n"),
            "{s}"
        );
        assert_eq!(shell_quote(""), "''");
        assert_eq!(shell_quote("$(rm -rf /)"), "'$(rm -rf /)'");
    }

    #[test]
    fn config_errors_name_the_field() {
        let mut cfg = SlurmConfig::new("w", &[], "gpu");
        assert!(cfg.validate().is_ok());
        cfg.partitions.spot = Some("spot partition".into());
        assert!(cfg.validate().unwrap_err().contains("partitions.spot"));
        let mut cfg = SlurmConfig::new("w", &[], "gpu");
        cfg.poll_interval_ms = 10;
        assert!(cfg.validate().unwrap_err().contains("poll_interval_ms"));
        let mut cfg = SlurmConfig::new(" ", &[], "gpu");
        assert!(cfg.validate().unwrap_err().contains("command"));
        // values that would panic a Duration, or wait for ever
        let mut big = SlurmConfig::new("w", &[], "gpu");
        big.notice_period_secs = Some(1e20);
        assert!(big.validate().unwrap_err().contains("notice_period_secs"));
        big.notice_period_secs = Some(30.0);
        for t in [1e20, 0.0, f64::NAN] {
            big.release_timeout_secs = t;
            assert!(
                big.validate().unwrap_err().contains("release_timeout_secs"),
                "{t}"
            );
        }
        cfg.command = "w".into();
        cfg.job_name = "a b".into();
        assert!(cfg.validate().unwrap_err().contains("job_name"));
    }

    #[test]
    fn a_tool_timeout_must_be_positive_finite_and_at_most_ten_minutes() {
        let mut cfg = SlurmConfig::new("w", &[], "gpu");
        assert_eq!(cfg.tool_timeout_secs, 30.0);
        for ok in [0.5, 30.0, MAX_TOOL_TIMEOUT_SECS] {
            cfg.tool_timeout_secs = ok;
            assert_eq!(cfg.validate(), Ok(()), "{ok}");
            assert!(Tools::new(&cfg).is_ok(), "{ok}");
        }
        for bad in [
            0.0,
            -1.0,
            f64::NAN,
            f64::INFINITY,
            MAX_TOOL_TIMEOUT_SECS + 1.0,
            1e20,
        ] {
            cfg.tool_timeout_secs = bad;
            let e = cfg.validate().unwrap_err();
            assert!(e.contains("tool_timeout_secs"), "{bad}: {e}");
            // the provider refuses it too, before it runs any tool
            let e = SlurmProvider::connect(cfg.clone()).unwrap_err().to_string();
            assert!(e.contains("tool_timeout_secs"), "{bad}: {e}");
        }
    }

    #[test]
    fn a_tool_timeout_is_read_from_the_config_file_and_defaults_to_30_s() {
        let file = "command = \"w\"\npartitions = { on_demand = \"gpu\" }\n";
        let cfg: SlurmConfig = toml::from_str(file).unwrap();
        assert_eq!(cfg.tool_timeout_secs, 30.0);
        let cfg: SlurmConfig = toml::from_str(&format!("{file}tool_timeout_secs = 5\n")).unwrap();
        assert_eq!(cfg.tool_timeout_secs, 5.0);
    }

    fn leap(y: i64) -> bool {
        (y % 4 == 0 && y % 100 != 0) || y % 400 == 0
    }

    fn days_in(y: i64, m: i64) -> i64 {
        match m {
            2 if leap(y) => 29,
            2 => 28,
            4 | 6 | 9 | 11 => 30,
            _ => 31,
        }
    }

    proptest::proptest! {
        #[test]
        fn squeue_parsing_never_panics(text in "\\PC{0,300}") {
            let (jobs, bad) = parse_squeue(&text);
            proptest::prop_assert!(jobs.len() + bad <= text.lines().count());
        }

        /// One second later is 1000 ms later, across every day, month and
        /// year boundary (checked against a plain calendar walk).
        #[test]
        fn the_last_second_of_a_day_is_one_second_before_the_next(
            y in 1970i64..2400, m in 1i64..=12, d_frac in 0.0f64..1.0
        ) {
            let d = 1 + ((days_in(y, m) as f64 * d_frac) as i64).min(days_in(y, m) - 1);
            let last = parse_utc(&format!("{y:04}-{m:02}-{d:02}T23:59:59")).unwrap();
            let (ny, nm, nd) = if d < days_in(y, m) {
                (y, m, d + 1)
            } else if m < 12 {
                (y, m + 1, 1)
            } else {
                (y + 1, 1, 1)
            };
            let next = parse_utc(&format!("{ny:04}-{nm:02}-{nd:02}T00:00:00")).unwrap();
            proptest::prop_assert_eq!(next, last + 1000);
            let midnight = parse_utc(&format!("{y:04}-{m:02}-{d:02}T00:00:00")).unwrap();
            proptest::prop_assert_eq!(midnight % 86_400_000, 0);
        }
    }
}
