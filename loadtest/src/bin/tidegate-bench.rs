//! `tidegate-bench`: benchmarks that compare two things in the same run and
//! report the ratio, as JSON.
//!
//! - `scheduler`: decisions per second of the pure scheduler with 1k and 10k
//!   frames queued (ratio 10k / 1k).
//! - `relay`: frames per second and latency through a real gateway (edge →
//!   gateway → no-op worker → gateway → edge) against raw quinn doing one
//!   hop with the same payloads (ratio relay / raw).
//! - `hints`: an overload against one local cluster (real gateway and
//!   BlazeFace workers), with cameras that obey the gateway's frame-rate
//!   hints and with cameras that ignore them, alternating in the same run
//!   (ratios obeyed / ignored).
//! - `startup`: a worker's time from process start to registered with a
//!   gateway, against its `check-config` (the same loading, warm-up and
//!   profiling, no network), alternating (ratio registered / check-config).
//! - `wan`: the load generator through the impairment relay, case by case
//!   (`tidegate_loadtest::wanbench`): RTT, loss, bursts, a bandwidth cap
//!   and blackouts, each congestion controller on the same links, raw
//!   against JPEG; a Markdown table with `--markdown`.
//! - `hostile`: each attack class of issue 21 (hostile edges, a lying
//!   worker, slowloris) beside a legitimate load, on a fresh cluster each
//!   (`tidegate_loadtest::hostilebench`): the legitimate edge's p99 and ok
//!   share against its baseline in the same run, the gateway's peak RSS
//!   against its bound and its return; a Markdown table with `--markdown`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Parser, Subcommand};
use serde_json::json;
use tidegate_loadtest::cluster::{Cluster, ClusterOptions, WorkerProvider, model_repository};
use tidegate_loadtest::report::{Report, write_atomically};
use tidegate_loadtest::{hostilebench, loadgen, relay, schedbench, startup, wanbench};

/// tidegate benchmarks (JSON on stdout, and in --report).
#[derive(Debug, Parser)]
#[command(name = "tidegate-bench", version, about)]
struct Cli {
    /// Write the JSON report here too.
    #[arg(long, global = true)]
    report: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Scheduler decisions per second at 1k and 10k queued frames.
    Scheduler {
        /// Samples per configuration (median reported).
        #[arg(long, default_value_t = 7)]
        samples: usize,
        /// Decisions per sample (bounded: samples × per-sample at most
        /// 10,000,000).
        #[arg(long, default_value_t = 20_000)]
        per_sample: usize,
    },
    /// Relay overhead: edge→gateway→no-op worker→edge against raw quinn.
    Relay {
        /// Frames per payload size and path (bounded: at most 100000).
        #[arg(long, default_value_t = 2_000)]
        frames: usize,
        /// Frames in flight at once.
        #[arg(long, default_value_t = 1)]
        concurrency: usize,
        /// Most seconds of sending per payload size and path (at most 600);
        /// a path cut short reports the frames it completed.
        #[arg(long, default_value_t = 120)]
        max_seconds: u64,
    },
    /// Overload with cameras obeying the gateway's frame-rate hints against
    /// cameras ignoring them, alternating on one local cluster.
    Hints {
        /// Local BlazeFace workers.
        #[arg(long, default_value_t = 1)]
        workers: usize,
        /// Simulated cameras.
        #[arg(long, default_value_t = 32)]
        cameras: usize,
        /// Frames per second per camera.
        #[arg(long, default_value_t = 30.0)]
        fps: f64,
        /// Seconds per run (at most 120).
        #[arg(long, default_value_t = 5.0)]
        seconds: f64,
        /// Rounds; each runs both, obeying first in odd rounds and ignoring
        /// first in even ones (at most 10).
        #[arg(long, default_value_t = 2)]
        rounds: usize,
    },
    /// The WAN matrix: the load generator through the impairment relay,
    /// case by case, on one local cluster (BlazeFace and CenterNet
    /// workers).
    Wan {
        /// Seconds of sending per case (1 to 120; the matrix: 30).
        #[arg(long, default_value_t = 30.0)]
        seconds: f64,
        /// Run only the cases whose names start with these (comma
        /// separated); all by default.
        #[arg(long, value_delimiter = ',')]
        cases: Vec<String>,
        /// Seed of the relays' random draws (loss, bursts, jitter).
        #[arg(long, default_value_t = 19)]
        seed: u64,
        /// Write the table as Markdown here too.
        #[arg(long)]
        markdown: Option<PathBuf>,
        /// What the workers run on: cpu (one intra-op thread each) or
        /// cuda (for a GPU machine: scripts/gpu-check.sh step 10).
        #[arg(long, value_enum, default_value_t = WorkerProvider::Cpu)]
        worker_provider: WorkerProvider,
        /// Model repository the workers serve; the cameras send its
        /// testdata/astronaut.png (default: this checkout's models/).
        #[arg(long)]
        models_dir: Option<PathBuf>,
    },
    /// Hostile edges, a lying worker and slowloris, each beside a
    /// legitimate load (4 cameras × 10 fps) on a fresh local cluster.
    Hostile {
        /// Seconds of the legitimate load alone, and again beside the
        /// attack (1 to 120).
        #[arg(long, default_value_t = 15.0)]
        seconds: f64,
        /// Run only the cases whose names start with these (comma
        /// separated); all by default.
        #[arg(long, value_delimiter = ',')]
        cases: Vec<String>,
        /// Write the table as Markdown here too.
        #[arg(long)]
        markdown: Option<PathBuf>,
        /// Runs of each case (1 to 5), each on a fresh cluster: the run
        /// with the median p99 ratio stands for the case, every run's
        /// ratio is listed, and every other goal must hold in every run.
        #[arg(long, default_value_t = 1)]
        repeat: usize,
    },
    /// A worker's time to ready (registered with a gateway) against its
    /// `check-config`, alternating.
    Startup {
        /// Runs of each (at most 20; medians reported).
        #[arg(long, default_value_t = 5)]
        runs: usize,
        /// The model the worker serves, from the repository's models/.
        #[arg(long, default_value = "blazeface")]
        model: String,
    },
}

/// Most scheduler decisions of each kind per configuration.
const MAX_DECISIONS: usize = 10_000_000;

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new("warn"))
        .with_writer(std::io::stderr)
        .init();
    let report = match cli.command {
        Command::Scheduler {
            samples,
            per_sample,
        } => {
            anyhow::ensure!(
                samples >= 1 && per_sample >= 1,
                "--samples and --per-sample must be at least 1"
            );
            anyhow::ensure!(
                samples
                    .checked_mul(per_sample)
                    .is_some_and(|n| n <= MAX_DECISIONS),
                "--samples {samples} × --per-sample {per_sample} is more than {MAX_DECISIONS} decisions; lower either"
            );
            let small = schedbench::run(1_000, 8, samples, per_sample);
            let large = schedbench::run(10_000, 8, samples, per_sample);
            json!({
                "bench": "scheduler",
                "results": [small, large],
                "ratio_arrivals_10k_over_1k": large.arrivals_per_s / small.arrivals_per_s,
                "ratio_completions_10k_over_1k": large.completions_per_s / small.completions_per_s,
            })
        }
        Command::Relay {
            frames,
            concurrency,
            max_seconds,
        } => {
            anyhow::ensure!(
                (1..=100_000).contains(&frames) && (1..=64).contains(&concurrency),
                "--frames must be in 1..=100000 and --concurrency in 1..=64"
            );
            anyhow::ensure!(
                (1..=600).contains(&max_seconds),
                "--max-seconds must be in 1..=600"
            );
            let r = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?
                .block_on(relay::run(
                    frames,
                    concurrency,
                    Duration::from_secs(max_seconds),
                ))?;
            serde_json::to_value(r)?
        }
        Command::Hints {
            workers,
            cameras,
            fps,
            seconds,
            rounds,
        } => hints(workers, cameras, fps, seconds, rounds)?,
        Command::Startup { runs, model } => serde_json::to_value(startup::run(runs, &model)?)?,
        Command::Wan {
            seconds,
            cases,
            seed,
            markdown,
            worker_provider,
            models_dir,
        } => wan(
            &cases,
            worker_provider,
            models_dir.as_deref(),
            seconds,
            seed,
            markdown.as_deref(),
        )?,
        Command::Hostile {
            seconds,
            cases,
            markdown,
            repeat,
        } => hostile(seconds, &cases, repeat, markdown.as_deref())?,
    };
    let text = serde_json::to_string_pretty(&report)?;
    println!("{text}");
    if let Some(p) = &cli.report {
        write_atomically(p, &text).with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(())
}

/// Runs the WAN matrix's `cases` (all when empty) for `seconds` each, the
/// workers on `provider`, serving from `models` (default: this checkout's).
fn wan(
    cases: &[String],
    provider: WorkerProvider,
    models: Option<&Path>,
    seconds: f64,
    seed: u64,
    markdown: Option<&Path>,
) -> anyhow::Result<serde_json::Value> {
    anyhow::ensure!(
        (1.0..=120.0).contains(&seconds),
        "--seconds must be in 1..=120"
    );
    let cases = wanbench::select(cases)?;
    let models = model_repository(models).with_context(|| format!("--models-dir {models:?}"))?;
    let run = wanbench::RunOptions {
        seconds,
        seed,
        image: models.join("testdata/astronaut.png"),
    };
    anyhow::ensure!(
        run.image.is_file(),
        "{} is missing: the cameras send it (make setup fetches it)",
        run.image.display()
    );
    let mut cluster = Cluster::start(&ClusterOptions {
        workers: vec!["worker-1".into(), "worker-centernet".into()],
        worker_runtime: provider.runtime().into(),
        ..ClusterOptions::default()
    })?;
    cluster.spawn_worker_serving("worker-1", &models, &["blazeface"])?;
    let centernet = cases.iter().any(|c| c.model == "centernet");
    if centernet {
        cluster.spawn_worker_serving("worker-centernet", &models, &["centernet"])?;
    }
    cluster.wait_for_workers(1 + usize::from(centernet), Duration::from_secs(120))?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let mut results = Vec::with_capacity(cases.len());
    for case in &cases {
        eprintln!("wan: {} ...", case.name);
        let r = rt.block_on(wanbench::run_case(&cluster, case, &run))?;
        eprintln!(
            "wan: {}: {:.1} % ok within budget, {} B/frame, missing {}: {}",
            case.name,
            r.report.slo_attainment * 100.0,
            r.report.bytes_per_frame,
            r.report.missing,
            r.verdict
        );
        results.push(r);
    }
    let table = wanbench::markdown(&results, seconds);
    eprintln!("{table}");
    if let Some(p) = markdown {
        write_atomically(p, &table).with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(json!({
        "bench": "wan",
        "seconds": seconds,
        "seed": seed,
        "cases": results,
    }))
}

/// Runs the hostile cases `cases` (all when empty) `repeat` times each,
/// the legitimate load `seconds` alone and `seconds` beside each attack.
fn hostile(
    seconds: f64,
    cases: &[String],
    repeat: usize,
    markdown: Option<&std::path::Path>,
) -> anyhow::Result<serde_json::Value> {
    anyhow::ensure!(
        (1.0..=120.0).contains(&seconds),
        "--seconds must be in 1..=120"
    );
    anyhow::ensure!((1..=5).contains(&repeat), "--repeat must be in 1..=5");
    let cases = hostilebench::select(cases)?;
    let mut results = Vec::with_capacity(cases.len());
    for case in &cases {
        let mut runs = Vec::with_capacity(repeat);
        for run in 1..=repeat {
            eprintln!(
                "hostile: {} ({}), run {run} of {repeat} ...",
                case.name, case.about
            );
            let r = hostilebench::run_case(case, seconds)?;
            eprintln!(
                "hostile: {} run {run}: p99 {:.1} → {:.1} ms",
                case.name, r.baseline.e2e_ms.p99, r.attacked.e2e_ms.p99
            );
            runs.push(r);
        }
        let r = hostilebench::combine(runs).context("no run")?;
        eprintln!(
            "hostile: {}: p99 {:.1} → {:.1} ms, {:.1} % ok, missing {}, peak RSS {} MiB (bound {} MiB): {}",
            case.name,
            r.baseline.e2e_ms.p99,
            r.attacked.e2e_ms.p99,
            r.ok_share * 100.0,
            r.attacked.missing,
            r.memory.peak_rss >> 20,
            r.memory.bound >> 20,
            if r.failures.is_empty() {
                "every goal met".to_string()
            } else {
                r.failures.join("; ")
            }
        );
        results.push(r);
    }
    let table = hostilebench::markdown(&results, seconds);
    eprintln!("{table}");
    if let Some(p) = markdown {
        write_atomically(p, &table).with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(json!({
        "bench": "hostile",
        "seconds": seconds,
        "repeat": repeat,
        "legitimate_load": {
            "cameras": hostilebench::LEGIT_LOAD.0,
            "fps": hostilebench::LEGIT_LOAD.1,
        },
        "goals": {
            "rss_base_bytes": hostilebench::RSS_BASE,
            "min_ok_share": hostilebench::MIN_OK_SHARE,
            "max_p99_ratio": hostilebench::MAX_P99_RATIO,
            "given_back_factor": hostilebench::GIVEN_BACK_FACTOR,
            "given_back_within_s": hostilebench::GIVEN_BACK_WITHIN.as_secs(),
        },
        "cases": results,
    }))
}

/// Totals of the runs of one kind (obeying or ignoring hints).
#[derive(Debug, Default, serde::Serialize)]
struct HintTotals {
    sent: u64,
    ok: u64,
    ok_within_budget: u64,
    shed: u64,
    expired: u64,
    failed: u64,
    missing: u64,
    throttled: u64,
    send_errors: u64,
    /// Frames never sent: the generator fell behind its schedule.
    unsent: u64,
    /// Frames QUIC had neither taken nor refused when a run ended.
    pending: u64,
    hints: u64,
    /// Frames the cameras captured: sent + held back by a hint + send
    /// errors + unsent + pending (every frame the schedules called for).
    captured: u64,
    /// ok within budget over the frames captured: what reached the user in
    /// time.
    served_share: f64,
    /// p95 of each run's end-to-end latency (ms), in run order.
    e2e_p95_ms: Vec<f64>,
}

impl HintTotals {
    fn add(&mut self, r: &Report) {
        self.sent += r.sent;
        self.ok += r.ok;
        self.ok_within_budget += r.ok_within_budget;
        self.shed += r.shed;
        self.expired += r.expired;
        self.failed += r.failed;
        self.missing += r.missing;
        self.throttled += r.throttled;
        self.send_errors += r.send_errors;
        self.unsent += r.unsent;
        self.pending += r.pending;
        self.hints += r.hints;
        self.e2e_p95_ms.push(r.e2e_ms.p95);
        self.captured = self.sent + self.throttled + self.send_errors + self.unsent + self.pending;
        self.served_share = if self.captured == 0 {
            0.0
        } else {
            self.ok_within_budget as f64 / self.captured as f64
        };
    }
}

fn hints(
    workers: usize,
    cameras: usize,
    fps: f64,
    seconds: f64,
    rounds: usize,
) -> anyhow::Result<serde_json::Value> {
    anyhow::ensure!(
        (1..=8).contains(&workers) && (1..=256).contains(&cameras),
        "--workers must be in 1..=8 and --cameras in 1..=256"
    );
    let min_fps = *loadgen::FPS_RANGE.start();
    anyhow::ensure!(
        (min_fps..=120.0).contains(&fps) && seconds > 0.0 && seconds <= 120.0,
        "--fps must be in [{min_fps}, 120] and --seconds in (0, 120]"
    );
    anyhow::ensure!((1..=10).contains(&rounds), "--rounds must be in 1..=10");
    let names: Vec<String> = (1..=workers).map(|i| format!("worker-{i}")).collect();
    let mut cluster = Cluster::start(&ClusterOptions {
        workers: names.clone(),
        ..ClusterOptions::default()
    })?;
    for n in &names {
        cluster.spawn_worker(n)?;
    }
    cluster.wait_for_workers(workers, Duration::from_secs(120))?;
    let (mut obeyed, mut ignored) = (HintTotals::default(), HintTotals::default());
    for round in 0..rounds {
        let order = if round % 2 == 0 {
            [true, false]
        } else {
            [false, true]
        };
        for obey in order {
            let mut opts = cluster.load_options("edge-1", cameras, fps, seconds);
            opts.obey_hints = obey;
            let report = loadgen::run_blocking(&opts)?;
            eprintln!(
                "round {} {}: sent {} ok {} (within budget {}) shed {} held back {} unsent {} pending {}",
                round + 1,
                if obey {
                    "obeying hints"
                } else {
                    "ignoring hints"
                },
                report.sent,
                report.ok,
                report.ok_within_budget,
                report.shed,
                report.throttled,
                report.unsent,
                report.pending
            );
            if obey { &mut obeyed } else { &mut ignored }.add(&report);
            settle(&cluster)?;
        }
    }
    let ratio = |a: f64, b: f64| if b == 0.0 { None } else { Some(a / b) };
    Ok(json!({
        "bench": "hints",
        "workers": workers,
        "cameras": cameras,
        "fps": fps,
        "seconds_per_run": seconds,
        "rounds": rounds,
        "obeyed": obeyed,
        "ignored": ignored,
        "ratio_shed_obeyed_over_ignored": ratio(obeyed.shed as f64, ignored.shed as f64),
        "ratio_sent_obeyed_over_ignored": ratio(obeyed.sent as f64, ignored.sent as f64),
        "ratio_served_share_obeyed_over_ignored": ratio(obeyed.served_share, ignored.served_share),
    }))
}

/// Waits (at most 30 s) until the gateway holds no frame, so the next run
/// starts on an idle cluster.
fn settle(cluster: &Cluster) -> anyhow::Result<()> {
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let (_, body) = cluster.get("/api/v1/frames")?;
        let v: serde_json::Value = serde_json::from_str(&body)?;
        if v["queued"] == 0 && v["dispatched"] == 0 {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < until,
            "frames still in flight 30 s after a run: {v}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn served_share_counts_frames_never_sent_or_still_sending_as_captured() {
        // Half the frames the schedule called for never left the stalled
        // generator, or were still held by flow control at the end.
        let mut t = HintTotals::default();
        t.add(&Report {
            sent: 4,
            throttled: 1,
            send_errors: 1,
            unsent: 3,
            pending: 1,
            ok_within_budget: 4,
            ..Report::default()
        });
        assert_eq!((t.unsent, t.pending, t.captured), (3, 1, 10));
        assert!((t.served_share - 0.4).abs() < 1e-9, "{}", t.served_share);
        t.add(&Report {
            sent: 10,
            ok_within_budget: 10,
            ..Report::default()
        });
        assert_eq!((t.unsent, t.pending, t.captured), (3, 1, 20));
        assert!((t.served_share - 0.7).abs() < 1e-9, "{}", t.served_share);
    }

    #[test]
    fn served_share_counts_send_errors_as_captured_frames() {
        let mut t = HintTotals::default();
        t.add(&Report {
            sent: 6,
            throttled: 2,
            send_errors: 2,
            ok_within_budget: 5,
            ..Report::default()
        });
        assert_eq!(t.send_errors, 2);
        assert!((t.served_share - 0.5).abs() < 1e-9, "{}", t.served_share);
        // Totals accumulate across runs.
        t.add(&Report {
            sent: 4,
            send_errors: 6,
            ok_within_budget: 5,
            ..Report::default()
        });
        assert_eq!(t.send_errors, 8);
        assert!((t.served_share - 0.5).abs() < 1e-9, "{}", t.served_share);
    }
}
