//! Hostile edges and lying workers beside a legitimate load
//! (`tidegate-bench hostile`, `make bench-hostile`; issue 21).
//!
//! Each case starts a fresh cluster (a gateway at its default `[limits]`
//! and one BlazeFace worker on this machine), runs the legitimate edge's
//! load alone for the baseline (4 cameras × 10 fps, raw frames, 80 ms
//! budget), then the same load again with the case's attack
//! ([`crate::attack`]) beside it, sampling the gateway's resident set every
//! 25 ms throughout; then it stops the attack and measures how long the
//! gateway takes to give its memory back. The goals, per case:
//!
//! - the gateway's peak RSS during the attack ≤ 256 MiB plus the memory
//!   budgets that apply ([`rss_bound`]), and within 2× its baseline again
//!   at most 60 s after the attack;
//! - the legitimate edge keeps ≥ 99 % of its frames due `ok`, with a p99
//!   within 1.5× its baseline's, and `missing` = 0 (every frame sent got
//!   exactly one result).
//!
//! [`judge`] decides them from the numbers alone; nothing else here is a
//! verdict.

mod attacks;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::attack::rss::{RssWatch, rss};
use crate::attack::worker::Lie;
use crate::attack::{AttackError, MIB};
use crate::cluster::{Cluster, ClusterError, ClusterOptions};
use crate::loadgen::{self, LoadError};
use crate::report::Report;

/// The legitimate edge's name.
pub const LEGIT: &str = "edge-1";
/// The name every hostile edge logs in with.
pub const HOSTILE: &str = "edge-hostile";
/// The legitimate load: cameras, frames/s each.
pub const LEGIT_LOAD: (usize, f64) = (4, 10.0);
/// What the gateway may hold besides the memory budgets.
pub const RSS_BASE: u64 = 256 * MIB;
/// The least share of its frames due the legitimate edge gets `ok`.
pub const MIN_OK_SHARE: f64 = 0.99;
/// The most its p99 may grow, as a multiple of its baseline's.
pub const MAX_P99_RATIO: f64 = 1.5;
/// The memory counts as given back at this multiple of the baseline RSS...
pub const GIVEN_BACK_FACTOR: u64 = 2;
/// ... reached within this long of the attack's end.
pub const GIVEN_BACK_WITHIN: Duration = Duration::from_secs(60);
/// How often the gateway's RSS is sampled.
const RSS_EVERY: Duration = Duration::from_millis(25);
/// The attack runs alone this long before the legitimate load starts.
const WARM_UP: Duration = Duration::from_secs(1);
/// An attack stops within this long of being told to.
const STOP_WITHIN: Duration = Duration::from_secs(30);

/// Why the benchmark could not run (not whether a goal was met).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HostileBenchError {
    /// The local cluster did not start.
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    /// The legitimate load could not run.
    #[error("case {case}: the legitimate load: {source}")]
    Sim {
        /// The case.
        case: String,
        /// Why (boxed: it is large).
        source: Box<LoadError>,
    },
    /// The attack could not be carried out.
    #[error("case {case}: the attack: {source}")]
    Attack {
        /// The case.
        case: String,
        /// Why.
        source: AttackError,
    },
    /// The attack did not stop when told to.
    #[error("case {case}: the attack was still running {STOP_WITHIN:?} after it was stopped")]
    Hung {
        /// The case.
        case: String,
    },
    /// No case matched the names asked for.
    #[error("no case is named {0:?}; the cases are: {1}")]
    NoCase(Vec<String>, String),
}

/// An attack class of issue 21.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Attack {
    /// Frames declared large and never finished.
    PartialFrames,
    /// Frame streams trickling a byte a second.
    Trickle,
    /// Connections that push before `Hello`, and never log in.
    BeforeHello,
    /// Many connections × cameras of one edge flooding frames whose budget
    /// is `u32::MAX` µs, then leaving.
    Starve,
    /// Refusals quoting the longest names.
    LongNames,
    /// `LatencyReport`s as fast as the connection takes them.
    ControlFlood,
    /// A worker that lies about its batches, beside a real one.
    Liar(Lie),
    /// Half-open connections on the HTTP API.
    Slowloris,
    /// More connections and cameras under one edge name than it may have.
    ManyConnections,
}

/// One case of the benchmark.
#[derive(Debug, Clone, Serialize)]
pub struct Case {
    /// Its name, as `--cases` takes it.
    pub name: &'static str,
    /// The attack.
    pub attack: Attack,
    /// What the attacker does, for the table.
    pub about: &'static str,
}

/// Every case, in the order of the list.
pub fn cases() -> Vec<Case> {
    let case = |name, attack, about| Case {
        name,
        attack,
        about,
    };
    vec![
        case(
            "partial-frames",
            Attack::PartialFrames,
            "32 × 40 MiB frames never finished, a new connection every 3 s",
        ),
        case(
            "trickle",
            Attack::Trickle,
            "16 frame streams at 1 byte/s, reopened when reset",
        ),
        case(
            "before-hello",
            Attack::BeforeHello,
            "waves of 32 connections pushing before Hello",
        ),
        case(
            "starve",
            Attack::Starve,
            "2 connections × 64 cameras × 4 fps, budget u32::MAX µs, then gone",
        ),
        case(
            "long-names",
            Attack::LongNames,
            "logins and camera opens with 1024-byte names, refused",
        ),
        case(
            "control-flood",
            Attack::ControlFlood,
            "LatencyReports as fast as possible, reconnecting when closed",
        ),
        case(
            "liar-half",
            Attack::Liar(Lie::HalfOfEachBatch),
            "a worker answering half of each batch",
        ),
        case(
            "liar-shed",
            Attack::Liar(Lie::ShedEverything),
            "a worker answering `shed` for every frame",
        ),
        case(
            "slowloris",
            Attack::Slowloris,
            "1,000 half-open HTTP connections, reopened when closed",
        ),
        case(
            "many-connections",
            Attack::ManyConnections,
            "12 connections × 160 cameras under one edge name",
        ),
    ]
}

/// The cases named in `names` (by prefix; all when empty), in order.
pub fn select(names: &[String]) -> Result<Vec<Case>, HostileBenchError> {
    let all = cases();
    if names.is_empty() {
        return Ok(all);
    }
    let picked: Vec<Case> = all
        .iter()
        .filter(|c| names.iter().any(|n| c.name.starts_with(n.as_str())))
        .cloned()
        .collect();
    if picked.is_empty() {
        let known: Vec<&str> = all.iter().map(|c| c.name).collect();
        return Err(HostileBenchError::NoCase(names.to_vec(), known.join(", ")));
    }
    Ok(picked)
}

/// The most RSS the gateway may reach under attack: [`RSS_BASE`] plus the
/// frame budgets of the two edges that send frames (the legitimate one
/// and the attacker), at most the gateway's total budget.
pub fn rss_bound(limits: &tidegate_gateway::config::LimitsConfig) -> u64 {
    RSS_BASE
        + limits
            .edge_inflight_bytes
            .saturating_mul(2)
            .min(limits.inflight_bytes_total)
}

/// The gateway's memory through a case (bytes).
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Memory {
    /// Peak RSS during the baseline run.
    pub baseline_rss: u64,
    /// Peak RSS from the attack's start to its end.
    pub peak_rss: u64,
    /// The bound on the peak ([`rss_bound`]).
    pub bound: u64,
    /// RSS when it was first seen within [`GIVEN_BACK_FACTOR`] × the
    /// baseline, or [`GIVEN_BACK_WITHIN`] after the attack if never.
    pub after_rss: u64,
    /// Seconds from the attack's end until then (`None`: not within
    /// [`GIVEN_BACK_WITHIN`]).
    pub given_back_after_s: Option<f64>,
}

/// Which goals a case met.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Goals {
    /// Peak RSS within the bound.
    pub memory_bounded: bool,
    /// RSS within twice the baseline again within 60 s.
    pub memory_given_back: bool,
    /// ≥ 99 % of the frames due `ok`.
    pub ok_share: bool,
    /// p99 within 1.5× the baseline's.
    pub p99: bool,
    /// `missing` = 0 and no duplicates.
    pub accounted: bool,
}

impl Goals {
    /// Whether every goal was met.
    pub fn all(&self) -> bool {
        self.memory_bounded && self.memory_given_back && self.ok_share && self.p99 && self.accounted
    }
}

/// `ok` over the frames due (sent, failed to send, never sent, pending):
/// a frame the legitimate edge could not even send counts as not ok.
pub fn ok_share(r: &Report) -> f64 {
    match r.due() {
        0 => 0.0,
        due => r.ok as f64 / due as f64,
    }
}

/// The goals met, and why each other was not (one reason a goal).
pub fn judge(baseline: &Report, attacked: &Report, m: &Memory) -> (Goals, Vec<String>) {
    let mut why = Vec::new();
    let mib = |b: u64| b as f64 / MIB as f64;
    let memory_bounded = m.peak_rss <= m.bound;
    if !memory_bounded {
        why.push(format!(
            "peak RSS {:.0} MiB > bound {:.0} MiB",
            mib(m.peak_rss),
            mib(m.bound)
        ));
    }
    let memory_given_back = m
        .given_back_after_s
        .is_some_and(|s| s <= GIVEN_BACK_WITHIN.as_secs_f64());
    if !memory_given_back {
        why.push(format!(
            "RSS {:.0} MiB {} s after the attack > {GIVEN_BACK_FACTOR} × baseline {:.0} MiB",
            mib(m.after_rss),
            GIVEN_BACK_WITHIN.as_secs(),
            mib(m.baseline_rss)
        ));
    }
    let share = ok_share(attacked);
    let ok_share_met = share >= MIN_OK_SHARE && attacked.due() > 0;
    if !ok_share_met {
        why.push(format!(
            "{:.1} % ok ({} of {} due) < {:.0} %",
            share * 100.0,
            attacked.ok,
            attacked.due(),
            MIN_OK_SHARE * 100.0
        ));
    }
    let ratio = p99_ratio(baseline, attacked);
    let p99 = ratio.is_some_and(|r| r <= MAX_P99_RATIO);
    if !p99 {
        why.push(format!(
            "p99 {:.1} ms vs baseline {:.1} ms ({}) > {MAX_P99_RATIO}×",
            attacked.e2e_ms.p99,
            baseline.e2e_ms.p99,
            ratio.map_or("no ratio".into(), |r| format!("{r:.2}×"))
        ));
    }
    let accounted = attacked.missing == 0 && attacked.duplicates == 0;
    if !accounted {
        why.push(format!(
            "{} frames missing, {} answered twice",
            attacked.missing, attacked.duplicates
        ));
    }
    let goals = Goals {
        memory_bounded,
        memory_given_back,
        ok_share: ok_share_met,
        p99,
        accounted,
    };
    (goals, why)
}

/// p99 under attack over the baseline's; `None` when either run had no
/// `ok` result.
pub fn p99_ratio(baseline: &Report, attacked: &Report) -> Option<f64> {
    (baseline.ok > 0 && attacked.ok > 0 && baseline.e2e_ms.p99 > 0.0)
        .then(|| attacked.e2e_ms.p99 / baseline.e2e_ms.p99)
}

/// What one case measured.
#[derive(Debug, Clone, Serialize)]
pub struct CaseResult {
    /// The case.
    pub case: Case,
    /// The legitimate load alone.
    pub baseline: Report,
    /// The same load beside the attack.
    pub attacked: Report,
    /// [`ok_share`] of `attacked`.
    pub ok_share: f64,
    /// [`p99_ratio`].
    pub p99_ratio: Option<f64>,
    /// Each run's [`p99_ratio`], in order, when the case was run more
    /// than once ([`combine`]); this one's alone otherwise.
    pub p99_ratios: Vec<Option<f64>>,
    /// The gateway's memory.
    pub memory: Memory,
    /// The attack's own tally.
    pub attack: serde_json::Value,
    /// The gateway's counters of refusals, drops and demotions after the
    /// attack ([`COUNTERS`]).
    pub gateway: BTreeMap<String, f64>,
    /// The goals met.
    pub goals: Goals,
    /// Why each goal not met was not.
    pub failures: Vec<String>,
}

impl CaseResult {
    /// One run's result from what it measured: its `ok` share, its p99
    /// ratio and its goals ([`judge`]) derived here.
    pub fn judged(
        case: Case,
        baseline: Report,
        attacked: Report,
        memory: Memory,
        attack: serde_json::Value,
        gateway: BTreeMap<String, f64>,
    ) -> CaseResult {
        let (goals, failures) = judge(&baseline, &attacked, &memory);
        let ratio = p99_ratio(&baseline, &attacked);
        CaseResult {
            case,
            ok_share: ok_share(&attacked),
            p99_ratio: ratio,
            p99_ratios: vec![ratio],
            baseline,
            attacked,
            memory,
            attack,
            gateway,
            goals,
            failures,
        }
    }
}

/// The gateway's counters a case reports (every label set of each).
pub const COUNTERS: [&str; 10] = [
    "tidegate_frames_total",
    "tidegate_frames_rejected_total",
    "tidegate_frames_dropped_total",
    "tidegate_quic_connections_refused_total",
    "tidegate_control_messages_dropped_total",
    "tidegate_http_connections_refused_total",
    "tidegate_worker_demotions_total",
    "tidegate_frames_retried_total",
    "tidegate_results_undeliverable_total",
    "tidegate_workers_demoted",
];

/// Runs `case`: a fresh cluster, the baseline, the attack beside the load,
/// then the memory's return. `seconds` is each run of the legitimate load.
pub fn run_case(case: &Case, seconds: f64) -> Result<CaseResult, HostileBenchError> {
    let sim_err = |source| HostileBenchError::Sim {
        case: case.name.into(),
        source: Box::new(source),
    };
    let mut workers = vec!["worker-1".to_string()];
    if matches!(case.attack, Attack::Liar(_)) {
        workers.push("liar".into());
    }
    let mut c = Cluster::start(&ClusterOptions {
        edges: vec![LEGIT.into(), HOSTILE.into()],
        workers,
        ..ClusterOptions::default()
    })?;
    c.spawn_worker("worker-1")?;
    c.wait_for_workers(1, Duration::from_secs(120))?;
    let pid = c.gateway_pid();
    let legit = c.load_options(LEGIT, LEGIT_LOAD.0, LEGIT_LOAD.1, seconds);

    let watch = RssWatch::watch(pid, RSS_EVERY);
    let baseline = loadgen::run_blocking(&legit).map_err(sim_err)?;
    let baseline_rss = watch.max();
    drop(watch);

    let watch = RssWatch::watch(pid, RSS_EVERY);
    let stop = CancellationToken::new();
    let max_time = WARM_UP + loadgen::RESULT_GRACE + Duration::from_secs_f64(seconds * 2.0);
    let attack_err = |source| HostileBenchError::Attack {
        case: case.name.into(),
        source,
    };
    let running = attacks::spawn(case.attack, &c, stop.clone(), max_time).map_err(attack_err)?;
    std::thread::sleep(WARM_UP);
    let attacked = loadgen::run_blocking(&legit);
    stop.cancel();
    let tally = join(running, case)?;
    let peak_rss = watch.max();
    drop(watch);
    let attacked = attacked.map_err(sim_err)?;
    let tally = tally.map_err(attack_err)?;

    let (after_rss, given_back_after_s) = given_back(pid, baseline_rss);
    let memory = Memory {
        baseline_rss,
        peak_rss,
        bound: rss_bound(&tidegate_gateway::config::LimitsConfig::default()),
        after_rss,
        given_back_after_s,
    };
    let gateway = counters(&c);
    Ok(CaseResult::judged(
        case.clone(),
        baseline,
        attacked,
        memory,
        tally,
        gateway,
    ))
}

/// Runs of one case (each on a fresh cluster, in order) as one result:
/// the run whose p99 ratio is the median (the higher of the two middle
/// ones for an even count; a run with no ratio counts highest) stands for
/// the case, with every run's ratio in `p99_ratios`. Its p99 goal is the
/// median run's; every other goal (memory, `ok`, accounting) must have
/// held in every run, and a run's failure of one is kept, marked with its
/// run. `None` for no runs.
pub fn combine(runs: Vec<CaseResult>) -> Option<CaseResult> {
    let ratios: Vec<Option<f64>> = runs.iter().map(|r| r.p99_ratio).collect();
    let mut order: Vec<usize> = (0..runs.len()).collect();
    order.sort_by(|&a, &b| {
        let key = |i: usize| ratios[i].unwrap_or(f64::INFINITY);
        key(a).total_cmp(&key(b))
    });
    let median = *order.get(runs.len() / 2)?;
    let mut goals = runs[median].goals;
    let mut failures: Vec<String> = runs[median]
        .failures
        .iter()
        .filter(|f| f.starts_with("p99 "))
        .cloned()
        .collect();
    for (i, r) in runs.iter().enumerate() {
        goals.memory_bounded &= r.goals.memory_bounded;
        goals.memory_given_back &= r.goals.memory_given_back;
        goals.ok_share &= r.goals.ok_share;
        goals.accounted &= r.goals.accounted;
        let others = r.failures.iter().filter(|f| !f.starts_with("p99 "));
        failures.extend(others.map(|f| format!("run {}: {f}", i + 1)));
    }
    let mut out = runs.into_iter().nth(median)?;
    out.goals = goals;
    out.failures = failures;
    out.p99_ratios = ratios;
    Some(out)
}

/// Waits (at most [`STOP_WITHIN`]) for a stopped attack's thread.
fn join(
    running: attacks::Running,
    case: &Case,
) -> Result<Result<serde_json::Value, AttackError>, HostileBenchError> {
    let until = Instant::now() + STOP_WITHIN;
    while !running.is_finished() {
        if Instant::now() > until {
            return Err(HostileBenchError::Hung {
                case: case.name.into(),
            });
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(running
        .join()
        .unwrap_or_else(|_| Err(AttackError::Task("the attack's thread panicked".into()))))
}

/// Polls the gateway's RSS every 250 ms until it is within
/// [`GIVEN_BACK_FACTOR`] × `baseline`, for at most [`GIVEN_BACK_WITHIN`]:
/// the RSS then, and the seconds it took (`None` if it never was).
fn given_back(pid: u32, baseline: u64) -> (u64, Option<f64>) {
    let start = Instant::now();
    loop {
        let now = rss(pid).unwrap_or(u64::MAX);
        if now <= GIVEN_BACK_FACTOR * baseline {
            return (now, Some(start.elapsed().as_secs_f64()));
        }
        if start.elapsed() >= GIVEN_BACK_WITHIN {
            return (now, None);
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// The [`COUNTERS`] series on the gateway's `/metrics` (empty if it does
/// not answer within 15 s).
fn counters(c: &Cluster) -> BTreeMap<String, f64> {
    let until = Instant::now() + Duration::from_secs(15);
    let text = loop {
        match c.get("/metrics") {
            Ok((200, body)) => break body,
            _ if Instant::now() > until => return BTreeMap::new(),
            _ => std::thread::sleep(Duration::from_millis(200)),
        }
    };
    series(&text, &COUNTERS)
}

/// The series of the metrics `names` in a Prometheus text exposition.
fn series(text: &str, names: &[&str]) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let name = series.split('{').next()?;
            if !names.contains(&name) {
                return None;
            }
            Some((series.to_string(), value.parse().ok()?))
        })
        .collect()
}

/// The results as one Markdown table.
pub fn markdown(results: &[CaseResult], seconds: f64) -> String {
    let mut out = format!(
        "| case ({seconds:.0} s each) | attack | baseline p99 (ms) | p99 under attack (ms) | ratio | ok | missing | peak RSS (MiB) | bound (MiB) | RSS after (MiB) | memory ≤ bound | given back | ok ≥ 99 % | p99 ≤ 1.5× | missing 0 |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    );
    let mib = |b: u64| b as f64 / MIB as f64;
    let pass = |ok: bool| if ok { "pass" } else { "**fail**" };
    for r in results {
        let m = &r.memory;
        let after = match m.given_back_after_s {
            Some(s) => format!("{:.0} (after {s:.1} s)", mib(m.after_rss)),
            None => format!(
                "{:.0} (at {} s)",
                mib(m.after_rss),
                GIVEN_BACK_WITHIN.as_secs()
            ),
        };
        let ratio = |x: Option<f64>| x.map_or("—".into(), |x| format!("{x:.2}×"));
        let mut ratios = ratio(r.p99_ratio);
        if r.p99_ratios.len() > 1 {
            let all: Vec<String> = r.p99_ratios.iter().map(|x| ratio(*x)).collect();
            ratios += &format!(" (runs: {})", all.join(", "));
        }
        out += &format!(
            "| {} | {} | {:.1} | {:.1} | {ratios} | {:.1} % | {} | {:.0} | {:.0} | {after} | {} | {} | {} | {} | {} |\n",
            r.case.name,
            r.case.about,
            r.baseline.e2e_ms.p99,
            r.attacked.e2e_ms.p99,
            r.ok_share * 100.0,
            r.attacked.missing,
            mib(m.peak_rss),
            mib(m.bound),
            pass(r.goals.memory_bounded),
            pass(r.goals.memory_given_back),
            pass(r.goals.ok_share),
            pass(r.goals.p99),
            pass(r.goals.accounted),
        );
    }
    out
}

#[cfg(test)]
mod tests;
