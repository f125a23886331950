//! `tidegate-bench`: benchmarks that compare two things in the same run and
//! report the ratio, as JSON.
//!
//! - `scheduler`: decisions per second of the pure scheduler with 1k and 10k
//!   frames queued (ratio 10k / 1k).
//! - `relay`: frames per second and latency through a real gateway (edge →
//!   gateway → no-op worker → gateway → edge) against raw quinn doing one
//!   hop with the same payloads (ratio relay / raw).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use serde_json::json;
use tidegate_loadtest::{relay, schedbench};

/// tidegate benchmarks (JSON on stdout, and in --report).
#[derive(Debug, Parser)]
#[command(version, about)]
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
    };
    let text = serde_json::to_string_pretty(&report)?;
    println!("{text}");
    if let Some(p) = &cli.report {
        std::fs::write(p, &text).with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(())
}
