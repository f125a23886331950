//! The WAN matrix (`tidegate-bench wan`, `make bench-wan`): the load
//! generator against a local cluster through the impairment relay
//! ([`crate::impair`]), one case after another in one run, on one machine.
//!
//! Each case is a load (cameras × fps of a model, an encoding), a link
//! (RTT, loss, bursts, a bandwidth cap, a blackout), a budget and a
//! congestion controller, with the goal the issue set for it. Every case
//! reports the load generator's exact accounting (`missing` must be 0 and
//! no frame answered twice), the share of frames due that were ok within
//! budget, why the others were not, bytes per frame and the uplink's
//! Mbit/s, and, for a blackout, how long after the link's return results
//! came back. The congestion controllers are compared on the same links in
//! the same run.
//!
//! A case names its client: the load generator ([`crate::loadgen`]), or a real
//! `tidegate-edge` (`wanbench/edge.rs`), whose GStreamer cameras encode
//! their frames and fit them to the link as they would in the field.

mod edge;

pub use edge::Settled;

use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;
use tidegate_edge::config::Copies;
use tidegate_protocol::Encoding;
use tidegate_protocol::quic::Congestion;

use crate::cluster::{Cluster, ClusterError};
use crate::impair::{GilbertElliott, ImpairConfig, LinkConfig, Relay, RelayOptions, RelayStats};
use crate::loadgen::{self, LoadError};
use crate::report::Report;

/// Why the WAN matrix could not run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WanBenchError {
    /// The local cluster did not start.
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    /// The relay of a case did not start.
    #[error("case {case}: starting the relay: {source}")]
    Relay {
        /// The case.
        case: String,
        /// Why.
        source: crate::impair::ImpairError,
    },
    /// A case's load generator failed.
    #[error("case {case}: {source}")]
    Sim {
        /// The case.
        case: String,
        /// Why (boxed: it is large).
        source: Box<LoadError>,
    },
    /// A case's edge failed to start, serve or stop.
    #[error("case {case}: the edge: {why}")]
    Edge {
        /// The case.
        case: String,
        /// Why, with the edge's log where it has one.
        why: String,
    },
    /// No case matched the names asked for.
    #[error("no case is named {0:?}; the cases are: {1}")]
    NoCase(Vec<String>, String),
}

/// What a case must reach.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind", content = "value")]
pub enum Goal {
    /// At least this share of the frames due ok within budget.
    Attainment(f64),
    /// Every frame shed at once as `late_on_arrival`.
    AllLate,
    /// Results ok within budget again within this long of the link's
    /// return (s).
    RecoveredWithin(f64),
    /// Nothing beyond the accounting (a baseline or a comparison).
    Measure,
}

/// What sends a case's frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Client {
    /// The load generator: synthetic cameras at a fixed rate and quality,
    /// the same encoded frame each time.
    Sim,
    /// A real `tidegate-edge`: GStreamer cameras that encode each frame and
    /// adapt quality, then frame rate, to the link.
    Edge,
}

/// One case of the matrix.
#[derive(Debug, Clone, Serialize)]
pub struct Case {
    /// Its name, as `--cases` takes it.
    pub name: String,
    /// What sends the frames.
    pub client: Client,
    /// Cameras.
    pub cameras: usize,
    /// Frames per second per camera.
    pub fps: f64,
    /// Model.
    pub model: String,
    /// How frames travel.
    pub encoding: Encoding,
    /// Budget per frame (ms).
    pub budget_ms: u32,
    /// Congestion controller of the generator (and of the gateway, which
    /// this cluster starts with its default).
    pub congestion: Congestion,
    /// Copies of each frame and result: fixed (the load generator's only
    /// kind), or the edge's `auto`.
    pub copies: Copies,
    /// The link, each way.
    pub link: LinkConfig,
    /// A blackout: (start, duration) after the case starts sending.
    pub blackout: Option<(Duration, Duration)>,
    /// What it must reach.
    pub goal: Goal,
}

/// The link of the matrix's cases: `rtt_ms` split evenly each way, random
/// `loss` each way.
pub fn link(rtt_ms: f64, loss: f64) -> LinkConfig {
    LinkConfig {
        delay_ms: rtt_ms / 2.0,
        loss,
        ..LinkConfig::default()
    }
}

/// A load: cameras, frames per second each, model.
type Load = (usize, f64, &'static str);
/// 4 cameras × 10 fps of BlazeFace.
const LIGHT: Load = (4, 10.0, "blazeface");
/// 16 cameras × 15 fps of BlazeFace.
const MEDIUM: Load = (16, 15.0, "blazeface");
/// 4 cameras × 5 fps of CenterNet.
const CENTERNET: Load = (4, 5.0, "centernet");

/// A load-generator case of `load` on `link`: JPEG at quality 90, an 80 ms
/// budget, the default controller, one copy, nothing but the accounting to
/// reach.
fn case(name: &str, (cameras, fps, model): Load, link: LinkConfig) -> Case {
    Case {
        name: name.into(),
        client: Client::Sim,
        cameras,
        fps,
        model: model.into(),
        encoding: Encoding::Jpeg { quality: 90 },
        budget_ms: 80,
        congestion: Congestion::default(),
        copies: Copies::Fixed(1),
        link,
        blackout: None,
        goal: Goal::Measure,
    }
}

/// The 10 Mbit/s link with a 50 ms queue, 20 ms RTT, 16 × 15 fps.
fn capped() -> Case {
    case(
        "10mbit-50ms-queue-medium",
        MEDIUM,
        LinkConfig {
            rate_bps: Some(10_000_000),
            queue_ms: 50,
            ..link(20.0, 0.0)
        },
    )
}

/// Every case, at `seconds` each (the matrix: 30 s): the load
/// generator's, then the real edge's.
pub fn matrix() -> Vec<Case> {
    let mut cases = controllers();
    cases.extend(copies_and_links());
    cases.extend(edge_cases());
    cases
}

/// Loopback baselines, and the three controllers on the same lossy links.
fn controllers() -> Vec<Case> {
    let mut cases = vec![
        case("loopback-light", LIGHT, link(0.0, 0.0)),
        case("loopback-light-raw", LIGHT, link(0.0, 0.0)),
    ];
    cases[1].encoding = Encoding::Raw;
    // The three controllers on the same lossy links.
    for cc in Congestion::ALL {
        for (name, load, rtt, loss, goal) in [
            ("20ms-1pct-light", LIGHT, 20.0, 0.01, 0.99),
            ("20ms-1pct-medium", MEDIUM, 20.0, 0.01, 0.99),
            ("50ms-2pct-light", LIGHT, 50.0, 0.02, 0.97),
        ] {
            let mut c = case(&format!("{name}-{cc}"), load, link(rtt, loss));
            c.congestion = cc;
            c.goal = Goal::Attainment(goal);
            cases.push(c);
        }
        // Raw frames on the lossy uplink: what compression saves.
        let mut c = case(
            &format!("50ms-2pct-light-raw-{cc}"),
            LIGHT,
            link(50.0, 0.02),
        );
        c.congestion = cc;
        c.encoding = Encoding::Raw;
        cases.push(c);
    }
    cases
}

/// Copies, bursty loss, long round trips, blackouts and the capped link.
fn copies_and_links() -> Vec<Case> {
    let mut cases = Vec::new();
    // Two copies of each frame and result, where one copy's losses cannot
    // be retransmitted within the budget.
    for (name, load, rtt, loss, copies, quality, goal) in [
        ("50ms-2pct-light-copies2", LIGHT, 50.0, 0.02, 2, 90, 0.97),
        (
            "50ms-2pct-light-copies2-q75",
            LIGHT,
            50.0,
            0.02,
            2,
            75,
            0.97,
        ),
        ("50ms-2pct-light-copies3", LIGHT, 50.0, 0.02, 3, 90, 0.97),
        ("20ms-1pct-medium-copies2", MEDIUM, 20.0, 0.01, 2, 90, 0.99),
    ] {
        let mut c = case(name, load, link(rtt, loss));
        c.copies = Copies::Fixed(copies);
        c.encoding = Encoding::Jpeg { quality };
        c.goal = Goal::Attainment(goal);
        cases.push(c);
    }
    let mut bursty = case(
        "20ms-2pct-bursty-centernet",
        CENTERNET,
        LinkConfig {
            burst: Some(GilbertElliott {
                // Bursts of 4 packets on average, 2 % of packets lost in
                // the long run: p / (p + r) = 0.02 with r = 0.25.
                p_good_to_bad: 0.25 * 0.02 / 0.98,
                p_bad_to_good: 0.25,
                loss_good: 0.0,
                loss_bad: 1.0,
            }),
            ..link(20.0, 0.0)
        },
    );
    bursty.goal = Goal::Attainment(0.95);
    cases.push(bursty);
    let mut slow = case("100ms-budget-80", LIGHT, link(100.0, 0.0));
    slow.goal = Goal::AllLate;
    cases.push(slow);
    let mut slow = case("100ms-budget-200", LIGHT, link(100.0, 0.0));
    slow.budget_ms = 200;
    slow.goal = Goal::Attainment(0.95);
    cases.push(slow);
    for (name, secs, within) in [("blackout-2s", 2, 1.0), ("blackout-15s", 15, 2.0)] {
        let mut c = case(name, LIGHT, link(20.0, 0.0));
        c.blackout = Some((Duration::from_secs(5), Duration::from_secs(secs)));
        c.goal = Goal::RecoveredWithin(within);
        cases.push(c);
    }
    let mut capped = capped();
    // The load generator cannot fit its link: it sends every frame at its
    // one quality, whatever the link carries.
    capped.goal = Goal::Measure;
    cases.push(capped);
    cases
}

/// The real edge on the load generator's links: the accounting goal holds
/// for both clients, and only an edge fits a capped link.
fn edge_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    // The edge's defaults: copies `auto`, quality adapting from 90 down.
    let edge = |mut c: Case| {
        c.name = format!("edge-{}", c.name);
        c.client = Client::Edge;
        c.copies = Copies::Auto;
        c
    };
    let mut c = edge(case("20ms-1pct-light", LIGHT, link(20.0, 0.01)));
    c.goal = Goal::Attainment(0.99);
    cases.push(c);
    // A lossy long link with nothing configured for it: `auto` copies.
    let mut c = edge(case("50ms-2pct-light", LIGHT, link(50.0, 0.02)));
    c.goal = Goal::Attainment(0.97);
    cases.push(c);
    let mut c = edge(case("50ms-2pct-light-copies2-q75", LIGHT, link(50.0, 0.02)));
    c.copies = Copies::Fixed(2);
    c.encoding = Encoding::Jpeg { quality: 75 };
    c.goal = Goal::Attainment(0.97);
    cases.push(c);
    let mut c = edge(case("blackout-15s", LIGHT, link(20.0, 0.0)));
    c.blackout = Some((Duration::from_secs(5), Duration::from_secs(15)));
    c.goal = Goal::RecoveredWithin(2.0);
    cases.push(c);
    let mut c = edge(capped());
    // Of the frames the cameras send, once they fit the link.
    c.goal = Goal::Attainment(0.99);
    cases.push(c.clone());
    // The same with one fixed copy, against `auto`'s.
    let mut one = c.clone();
    one.name += "-copies1";
    one.copies = Copies::Fixed(1);
    cases.push(one);
    // The capped link loses packets only when its queue overflows, which
    // a loss-based controller reads right.
    c.name += "-cubic";
    c.congestion = Congestion::Cubic;
    cases.push(c);
    cases
}

/// What one case measured.
#[derive(Debug, Clone, Serialize)]
pub struct CaseResult {
    /// The case.
    pub case: Case,
    /// The load generator's report.
    pub report: Report,
    /// The relay's counters.
    pub relay: RelayStats,
    /// Uplink Mbit/s per camera: the relay's uplink bytes offered over the
    /// sending time, per camera (QUIC headers and retransmissions in).
    pub uplink_mbit_per_camera: f64,
    /// For a blackout: seconds from the link's return to the first result
    /// ok within budget (to the report timeline's 0.1 s).
    pub recovered_after_s: Option<f64>,
    /// Whether it reached its goal, and if not, why.
    pub verdict: String,
    /// Whether every frame was accounted for once (`missing` 0, no
    /// duplicates).
    pub accounted: bool,
    /// A real edge's cameras: where their quality and frame rate settled.
    pub settled: Option<Settled>,
}

/// How every case of a run is run.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Seconds of sending per case.
    pub seconds: f64,
    /// Seed of the relays' random draws (loss, bursts, jitter).
    pub seed: u64,
    /// The still every camera sends (the load generator's frames, the
    /// edge's `image://` source): `testdata/astronaut.png` of the model
    /// repository the workers serve.
    pub image: PathBuf,
}

/// Runs `case` against `cluster` through a relay of its own.
pub async fn run_case(
    cluster: &Cluster,
    case: &Case,
    run: &RunOptions,
) -> Result<CaseResult, WanBenchError> {
    let seconds = run.seconds;
    let relay = Relay::start(RelayOptions::new(
        cluster.quic,
        ImpairConfig {
            seed: run.seed,
            ..ImpairConfig::symmetric(case.link.clone())
        },
    ))
    .await
    .map_err(|source| WanBenchError::Relay {
        case: case.name.clone(),
        source,
    })?;
    let (report, settled) = match case.client {
        Client::Sim => (run_loadgen(cluster, case, &relay, run).await?, None),
        Client::Edge => {
            let run = edge::run(cluster, case, &relay, run).await?;
            (run.report, Some(run.settled))
        }
    };
    let stats = relay.stop().await;
    let recovered_after_s = case.blackout.map(|(at, lasting)| {
        let back = at + lasting;
        report
            .first_ok_from(back)
            .map_or(f64::INFINITY, |t| t.saturating_sub(back).as_secs_f64())
    });
    let uplink_mbit_per_camera =
        stats.uplink.link.offered.bytes as f64 * 8.0 / 1e6 / seconds / case.cameras as f64;
    let accounted = report.missing == 0 && report.duplicates == 0;
    let verdict = verdict(case, &report, recovered_after_s);
    Ok(CaseResult {
        case: case.clone(),
        report,
        relay: stats,
        uplink_mbit_per_camera,
        recovered_after_s,
        verdict,
        accounted,
        settled,
    })
}

/// Runs `case` with the load generator through `relay`.
async fn run_loadgen(
    cluster: &Cluster,
    case: &Case,
    relay: &Relay,
    run: &RunOptions,
) -> Result<Report, WanBenchError> {
    let mut opts = cluster.load_options("edge-1", case.cameras, case.fps, run.seconds);
    opts.gateway = relay.local_addr().into();
    opts.image = Some(run.image.clone());
    opts.model = case.model.clone();
    opts.budget_ms = case.budget_ms;
    opts.encoding = case.encoding;
    opts.congestion = case.congestion;
    opts.copies = match case.copies {
        Copies::Fixed(n) => n,
        Copies::Auto => {
            return Err(WanBenchError::Edge {
                case: case.name.clone(),
                why: "the load generator sends a fixed number of copies, not `auto`".into(),
            });
        }
    };
    // Cameras out of phase, as real ones are: in step, their frames leave
    // in one burst a period and queue behind each other on the uplink.
    opts.in_step = false;
    let sim = tokio::spawn(async move { loadgen::run(&opts).await });
    if let Some((at, lasting)) = case.blackout {
        tokio::time::sleep(at).await;
        relay.blackout(lasting);
    }
    sim.await
        .map_err(|e| WanBenchError::Sim {
            case: case.name.clone(),
            source: Box::new(LoadError::CameraTask(e)),
        })?
        .map_err(|source| WanBenchError::Sim {
            case: case.name.clone(),
            source: Box::new(source),
        })
}

/// `met`, or why not.
fn verdict(case: &Case, r: &Report, recovered_after_s: Option<f64>) -> String {
    let mut why = Vec::new();
    if r.missing > 0 {
        why.push(format!("{} frames missing", r.missing));
    }
    if r.duplicates > 0 {
        why.push(format!("{} duplicates", r.duplicates));
    }
    match case.goal {
        Goal::Attainment(min) if r.slo_attainment < min => why.push(format!(
            "{:.1} % ok within budget < {:.0} %",
            r.slo_attainment * 100.0,
            min * 100.0
        )),
        Goal::AllLate => {
            let late = r.outcomes.get("shed:late_on_arrival").copied().unwrap_or(0);
            if late < r.results() || r.results() == 0 {
                why.push(format!(
                    "{late} of {} results shed late_on_arrival",
                    r.results()
                ));
            }
        }
        Goal::RecoveredWithin(s) => match recovered_after_s {
            Some(t) if t <= s => {}
            Some(t) => why.push(format!(
                "served again {t:.1} s after the link's return > {s} s"
            )),
            None => why.push("no blackout".into()),
        },
        _ => {}
    }
    if why.is_empty() {
        "met".into()
    } else {
        why.join("; ")
    }
}

/// The cases named in `names` (all when empty), in matrix order.
pub fn select(names: &[String]) -> Result<Vec<Case>, WanBenchError> {
    let all = matrix();
    if names.is_empty() {
        return Ok(all);
    }
    let picked: Vec<Case> = all
        .iter()
        .filter(|c| names.iter().any(|n| c.name.starts_with(n.as_str())))
        .cloned()
        .collect();
    if picked.is_empty() {
        let known: Vec<&str> = all.iter().map(|c| c.name.as_str()).collect();
        return Err(WanBenchError::NoCase(names.to_vec(), known.join(", ")));
    }
    Ok(picked)
}

/// The matrix as a Markdown table, one row a case.
pub fn markdown(results: &[CaseResult], seconds: f64) -> String {
    let mut out = format!(
        "| case ({seconds:.0} s each) | load | link | cc | bytes/frame | uplink Mbit/s/camera | ok within budget | sent / due | reset | lost with conn. | not sent | missing | dup | recovery | goal |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    );
    for r in results {
        let c = &r.case;
        let l = &c.link;
        let mut link = format!("{:.0} ms RTT", l.delay_ms * 2.0);
        if l.loss > 0.0 {
            link += &format!(", {:.0} % loss", l.loss * 100.0);
        }
        if let Some(b) = &l.burst {
            link += &format!(", {:.0} % bursty loss", b.stationary_loss() * 100.0);
        }
        if let Some(rate) = l.rate_bps {
            link += &format!(", {} Mbit/s cap, {} ms queue", rate / 1_000_000, l.queue_ms);
        }
        if let Some((_, d)) = c.blackout {
            link += &format!(", {} s blackout", d.as_secs());
        }
        let rep = &r.report;
        let client = match (&r.settled, c.client) {
            (Some(s), _) if s.quality_max > 0 => format!(
                "edge, settled at quality {}–{}, {:.1}–{:.1} fps, {}–{} copies: ",
                s.quality_min, s.quality_max, s.fps_min, s.fps_max, s.copies_min, s.copies_max
            ),
            (Some(s), _) => format!(
                "edge, settled at {:.1}–{:.1} fps, {}–{} copies: ",
                s.fps_min, s.fps_max, s.copies_min, s.copies_max
            ),
            (None, Client::Edge) => "edge: ".into(),
            (None, Client::Sim) => String::new(),
        };
        out += &format!(
            "| {} | {client}{}×{} {} {}{}, {} ms | {} | {} | {} | {:.2} | {:.1} % | {} / {} | {} | {} | {} | {} | {} | {} | {} |\n",
            c.name,
            c.cameras,
            c.fps,
            c.model,
            c.encoding,
            match c.copies {
                Copies::Fixed(1) => String::new(),
                Copies::Fixed(n) => format!(" ×{n} copies"),
                Copies::Auto => " copies auto".into(),
            },
            c.budget_ms,
            link,
            c.congestion,
            rep.bytes_per_frame,
            r.uplink_mbit_per_camera,
            rep.slo_attainment * 100.0,
            rep.sent,
            rep.due(),
            rep.reset,
            rep.lost_with_connection,
            rep.send_errors + rep.unsent + rep.pending,
            rep.missing,
            rep.duplicates,
            r.recovered_after_s
                .map_or("—".into(), |t| format!("{t:.1} s")),
            r.verdict,
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_matrix_holds_every_case_of_the_goal_once() {
        let m = matrix();
        let mut names: Vec<&str> = m.iter().map(|c| c.name.as_str()).collect();
        names.sort();
        let n = names.len();
        names.dedup();
        assert_eq!(names.len(), n, "case names are unique");
        for want in [
            "20ms-1pct-light-bbr",
            "20ms-1pct-medium-cubic",
            "50ms-2pct-light-newreno",
            "20ms-2pct-bursty-centernet",
            "100ms-budget-80",
            "100ms-budget-200",
            "blackout-2s",
            "blackout-15s",
            "10mbit-50ms-queue-medium",
            "edge-20ms-1pct-light",
            "edge-50ms-2pct-light",
            "edge-50ms-2pct-light-copies2-q75",
            "edge-blackout-15s",
            "edge-10mbit-50ms-queue-medium",
        ] {
            assert!(names.contains(&want), "{want} in {names:?}");
        }
        // Every link of the matrix is one the relay accepts.
        for c in &m {
            ImpairConfig::symmetric(c.link.clone())
                .validate()
                .unwrap_or_else(|e| panic!("{}: {e}", c.name));
        }
        let bursty = m.iter().find(|c| c.name.contains("bursty")).unwrap();
        let loss = bursty.link.burst.as_ref().unwrap().stationary_loss();
        assert!((loss - 0.02).abs() < 1e-9, "{loss}");
    }

    #[test]
    fn cases_are_picked_by_name_prefix_and_an_unknown_name_is_refused() {
        let picked = select(&["blackout".into()]).unwrap();
        assert_eq!(picked.len(), 2);
        let err = select(&["nope".into()]).unwrap_err().to_string();
        assert!(err.contains("nope") && err.contains("blackout-2s"), "{err}");
    }

    #[test]
    fn a_case_whose_frames_all_arrive_late_meets_only_when_every_result_says_so() {
        let case = matrix()
            .into_iter()
            .find(|c| c.goal == Goal::AllLate)
            .unwrap();
        let mut r = Report {
            sent: 3,
            ..Report::default()
        };
        for _ in 0..3 {
            r.count(&tidegate_protocol::Status::Shed(
                tidegate_protocol::ShedReason::LateOnArrival,
            ));
        }
        assert_eq!(verdict(&case, &r, None), "met");
        r.count(&tidegate_protocol::Status::Ok);
        assert!(verdict(&case, &r, None).contains("3 of 4"));
    }
}
