//! `tidegate-loadtest`: simulated cameras against a tidegate gateway, with a
//! JSON report and an SLO gate.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use tidegate_loadtest::cluster::{Cluster, ClusterOptions, workspace_root};
use tidegate_loadtest::sim::{self, SimOptions};

/// tidegate load generator.
///
/// Simulates N cameras sending frames at a fixed rate for a bounded time,
/// records every result's end-to-end latency, prints a JSON report, and
/// exits non-zero when the SLO gate fails.
///
/// Against a local cluster it starts itself (gateway + workers on
/// 127.0.0.1, BlazeFace, astronaut.png):
///   tidegate-loadtest --local --workers 1 --cameras 4 --fps 10 --seconds 10
#[derive(Debug, Parser)]
#[command(version, about, long_about)]
struct Cli {
    /// Start a local gateway and workers instead of using --gateway.
    #[arg(long)]
    local: bool,
    /// Workers for --local.
    #[arg(long, default_value_t = 1)]
    workers: usize,
    /// Gateway QUIC address.
    #[arg(long, env = "TIDEGATE_GATEWAY_ADDR", required_unless_present = "local")]
    gateway: Option<SocketAddr>,
    /// CA certificate to trust.
    #[arg(long, env = "TIDEGATE_CA", required_unless_present = "local")]
    ca: Option<PathBuf>,
    /// Edge name.
    #[arg(long, default_value = "edge-1")]
    edge: String,
    /// Edge token.
    #[arg(
        long,
        env = "TIDEGATE_EDGE_TOKEN",
        hide_env_values = true,
        required_unless_present = "local"
    )]
    token: Option<String>,
    /// Simulated cameras.
    #[arg(long, default_value_t = 4)]
    cameras: usize,
    /// Frames per second per camera.
    #[arg(long, default_value_t = 10.0)]
    fps: f64,
    /// Seconds of sending (bounded: at most 600).
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// Model.
    #[arg(long, default_value = "blazeface")]
    model: String,
    /// Budget per frame (ms).
    #[arg(long, default_value_t = 80)]
    budget_ms: u32,
    /// Image to send (default: models/testdata/astronaut.png).
    #[arg(long)]
    image: Option<PathBuf>,
    /// Write the JSON report here too.
    #[arg(long)]
    report: Option<PathBuf>,
    /// Draw the report (latency CDF against the budget, outcomes) as SVG here.
    #[arg(long)]
    svg: Option<PathBuf>,
    /// SLO gate: fail unless at least this fraction of frames is ok within budget.
    #[arg(long)]
    min_slo_attainment: Option<f64>,
    /// Keep sending at --fps even when the gateway hints a lower rate.
    #[arg(long)]
    ignore_hints: bool,
    /// Log filter.
    #[arg(long, env = "TIDEGATE_LOG", default_value = "warn")]
    log: String,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(&cli.log))
        .with_writer(std::io::stderr)
        .init();
    anyhow::ensure!(
        cli.seconds > 0.0 && cli.seconds <= 600.0,
        "--seconds must be in (0, 600]"
    );
    anyhow::ensure!(
        cli.fps > 0.0 && cli.fps <= 1000.0,
        "--fps must be in (0, 1000]"
    );
    let mut cluster = None;
    let (gateway, ca, token) = if cli.local {
        let mut c = Cluster::start(&ClusterOptions {
            workers: (1..=cli.workers).map(|i| format!("worker-{i}")).collect(),
            ..ClusterOptions::default()
        })?;
        for i in 1..=cli.workers {
            c.spawn_worker(&format!("worker-{i}"))?;
        }
        c.wait_for_workers(cli.workers, Duration::from_secs(60))?;
        let out = (c.quic, c.ca(), c.edge_token.clone());
        cluster = Some(c);
        out
    } else {
        (
            cli.gateway.context("--gateway is required")?,
            cli.ca.clone().context("--ca is required")?,
            cli.token.clone().context("--token is required")?,
        )
    };
    let opts = SimOptions {
        gateway,
        server_name: "localhost".into(),
        ca,
        edge: cli.edge.clone(),
        token,
        cameras: cli.cameras,
        fps: cli.fps,
        duration: Duration::from_secs_f64(cli.seconds),
        model: cli.model.clone(),
        budget_ms: cli.budget_ms,
        image: Some(
            cli.image
                .clone()
                .unwrap_or_else(|| workspace_root().join("models/testdata/astronaut.png")),
        ),
        obey_hints: !cli.ignore_hints,
    };
    let report = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(sim::run(&opts))?;
    let json = serde_json::to_string_pretty(&report)?;
    println!("{json}");
    if let Some(p) = &cli.report {
        std::fs::write(p, &json).with_context(|| format!("writing {}", p.display()))?;
    }
    if let Some(p) = &cli.svg {
        std::fs::write(p, tidegate_loadtest::svg::render(&report))
            .with_context(|| format!("writing {}", p.display()))?;
    }
    drop(cluster);
    if let Some(min) = cli.min_slo_attainment {
        anyhow::ensure!(
            report.slo_attainment >= min,
            "SLO gate failed: attainment {:.4} < {min}",
            report.slo_attainment
        );
    }
    Ok(())
}
