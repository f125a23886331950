//! `tidegate-edge`: captures cameras with GStreamer, sends frames over QUIC
//! to a tidegate gateway, and prints each result as a JSON line with its
//! end-to-end latency measured on this machine's clock.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use tidegate_edge::config::{EdgeConfig, Secret};
use tidegate_edge::metrics::EdgeMetrics;
use tidegate_edge::node::{CameraSummary, NodeOptions, preflight};
use tidegate_edge::sink::webhook::{Client, Endpoint, QueueLimits, RetryPolicy, Webhook};
use tidegate_edge::sink::{Sinks, open_results_file};
use tokio_util::sync::CancellationToken;

/// The bearer token sent to the webhook, when set.
const WEBHOOK_TOKEN_ENV: &str = "TIDEGATE_WEBHOOK_TOKEN";
use tidegate_protocol::GatewayAddr;

/// tidegate edge node.
///
/// Runs one GStreamer pipeline per camera in the config (rtsp://, v4l2://,
/// file://, image://, test://), scales frames to the model input the gateway
/// announces, skips frames over the rate cap or without motion, and streams
/// the rest over QUIC. Each result is printed as one JSON line (stdout,
/// --results FILE, or the sinks in the config). A camera that fails restarts
/// by itself; a lost gateway is redialled with backoff.
///
/// Example: tidegate-edge --config edge.toml
#[derive(Debug, Parser)]
#[command(version, about, long_about)]
struct Cli {
    /// Config file (TOML): name, [gateway], [[cameras]], [sinks], [metrics].
    #[arg(long, short, env = "TIDEGATE_EDGE_CONFIG")]
    config: PathBuf,
    /// Gateway address, host:port (overrides `gateway.addr`): an IP address
    /// or a host name, resolved at every dial, e.g. gw.example.com:4433 or
    /// 10.0.0.5:4433.
    #[arg(long, env = "TIDEGATE_GATEWAY_ADDR", global = true)]
    gateway: Option<GatewayAddr>,
    /// CA certificate to trust (overrides `gateway.ca`).
    #[arg(long, env = "TIDEGATE_CA", global = true)]
    ca: Option<PathBuf>,
    /// The edge's token (overrides `token`; prefer the environment variable).
    #[arg(
        long,
        env = "TIDEGATE_EDGE_TOKEN",
        hide_env_values = true,
        global = true
    )]
    token: Option<String>,
    /// Stop each camera after this many frames, wait for their results, exit.
    #[arg(long, global = true)]
    max_frames: Option<u64>,
    /// Append results to this file instead of printing them.
    #[arg(long, global = true)]
    results: Option<PathBuf>,
    /// Print every camera's counters (`camera_stats {json}` on stderr) every
    /// this many seconds; 0 = only at exit.
    #[arg(
        long,
        env = "TIDEGATE_SUMMARY_EVERY",
        default_value_t = 10,
        global = true
    )]
    summary_every: u64,
    /// Serve Prometheus metrics at http://ADDR/metrics (overrides
    /// `metrics.listen`), e.g. 127.0.0.1:9102; port 0 takes a free one,
    /// printed on stderr as `metrics listening on ADDR`. Off when unset. The
    /// cameras' figures are those of the last `camera_stats` (every
    /// --summary-every seconds); the QUIC uplink's are read at the scrape.
    #[arg(long, env = "TIDEGATE_METRICS_LISTEN", global = true)]
    metrics_listen: Option<std::net::SocketAddr>,
    /// Log filter.
    #[arg(long, env = "TIDEGATE_LOG", default_value = "info", global = true)]
    log: String,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the edge (the default).
    Run,
    /// Load and validate the config, read the CA files it names, print a
    /// short summary (no secrets), and check every camera as `run` would
    /// before reaching the gateway (its entry, its URI, that a local file
    /// exists); exit non-zero naming each camera that would be disabled.
    CheckConfig,
}

fn load_config(cli: &Cli) -> anyhow::Result<EdgeConfig> {
    let mut cfg = EdgeConfig::load(&cli.config)?;
    if let Some(a) = &cli.gateway {
        cfg.gateway.addr = a.clone();
    }
    if let Some(ca) = &cli.ca {
        cfg.gateway.ca = ca.clone();
    }
    if let Some(t) = &cli.token {
        cfg.token = Secret(t.clone());
    }
    if let Some(a) = cli.metrics_listen {
        cfg.metrics.listen = Some(a);
    }
    cfg.validate()?;
    Ok(cfg)
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(&cli.log))
        .with_writer(std::io::stderr)
        .init();
    let cfg = load_config(&cli)?;
    match cli.command {
        Some(Command::CheckConfig) => {
            // the CA the uplink will trust, read as the uplink reads it
            tidegate_protocol::quic::client_config(&cfg.gateway.ca).with_context(|| {
                format!(
                    "the CA certificate {} (gateway.ca, --ca or TIDEGATE_CA)",
                    cfg.gateway.ca.display()
                )
            })?;
            let webhook = webhook_client(&cfg)?;
            println!("{}", summary(&cfg, webhook.as_ref()));
            // The checks `run` makes before it reaches the gateway: the
            // entry, the URI, and that a local file exists.
            let bad: Vec<String> = cfg
                .cameras
                .iter()
                .filter_map(|c| preflight(c).err().map(|e| e.to_string()))
                .collect();
            if bad.is_empty() {
                println!("config ok");
                Ok(())
            } else {
                anyhow::bail!(
                    "{} camera(s) would be disabled:\n  {}",
                    bad.len(),
                    bad.join("\n  ")
                )
            }
        }
        Some(Command::Run) | None => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .context("starting the tokio runtime")?
            .block_on(run(
                cfg,
                cli.max_frames,
                cli.results,
                Some(cli.summary_every),
            )),
    }
}

/// Most cameras `check-config` lists one by one.
const CAMERAS_LISTED: usize = 8;

/// What `check-config` prints of a good config: a few lines, no secrets.
fn summary(cfg: &EdgeConfig, webhook: Option<&Client>) -> String {
    let g = &cfg.gateway;
    let mut lines = vec![
        format!("edge     {} ({} camera(s))", cfg.name, cfg.cameras.len()),
        format!(
            "gateway  {} (server name {}, CA {}, congestion {})",
            g.addr,
            g.server_name,
            g.ca.display(),
            g.congestion
        ),
    ];
    for c in cfg.cameras.iter().take(CAMERAS_LISTED) {
        lines.push(format!(
            "camera   {}: {} -> {}, {} ms budget",
            c.name, c.uri, c.model, c.budget_ms
        ));
    }
    if cfg.cameras.len() > CAMERAS_LISTED {
        lines.push(format!(
            "camera   … {} more",
            cfg.cameras.len() - CAMERAS_LISTED
        ));
    }
    let mut sinks = Vec::new();
    if cfg.sinks.stdout {
        sinks.push("stdout".to_string());
    }
    if let Some(f) = &cfg.sinks.file {
        sinks.push(format!("file {}", f.display()));
    }
    if let (Some(url), Some(c)) = (&cfg.sinks.webhook, webhook) {
        sinks.push(format!("webhook {url} ({})", c.describe()));
    }
    if let Some(m) = &cfg.sinks.mqtt {
        sinks.push(format!("mqtt {} topic {}", m.url, m.topic));
    }
    if sinks.is_empty() {
        sinks.push("none".into());
    }
    lines.push(format!("sinks    {}", sinks.join(", ")));
    lines.join("\n")
}

/// With `[metrics] listen`: serves `/metrics` there, says where on stderr
/// (`metrics listening on ADDR`; stdout carries results), and returns where
/// the node publishes the counters the metrics read (and reads `uplink`,
/// the record the node's link keeps, at each scrape). They are published
/// with each summary, so `summarising` (a non-zero `--summary-every`) is
/// required.
async fn serve_metrics(
    cfg: &EdgeConfig,
    summarising: bool,
    uplink: std::sync::Arc<tidegate_edge::uplink_stats::UplinkStats>,
) -> anyhow::Result<Option<tokio::sync::watch::Sender<Vec<CameraSummary>>>> {
    let Some(addr) = cfg.metrics.listen else {
        return Ok(None);
    };
    if !summarising {
        anyhow::bail!(
            "metrics.listen (or --metrics-listen) needs --summary-every above 0: the metrics are the counters of each summary; give e.g. --summary-every 10"
        );
    }
    let (tx, rx) = tokio::sync::watch::channel(Vec::new());
    let cameras: Vec<String> = cfg.cameras.iter().map(|c| c.name.clone()).collect();
    let metrics = EdgeMetrics::new(&cameras, rx, uplink);
    // Ends with the process: the node's run is the whole of its life.
    let bound = tidegate_edge::metrics::serve(addr, metrics, CancellationToken::new()).await?;
    eprintln!("metrics listening on {bound}");
    Ok(Some(tx))
}

/// The webhook's client (its TLS set up, the CA file read), when the config
/// has a webhook.
fn webhook_client(cfg: &EdgeConfig) -> anyhow::Result<Option<Client>> {
    let Some(url) = &cfg.sinks.webhook else {
        return Ok(None);
    };
    let endpoint = Endpoint::parse(url).context("sinks.webhook")?;
    let token = std::env::var(WEBHOOK_TOKEN_ENV)
        .ok()
        .filter(|t| !t.is_empty());
    if token.is_some() && !endpoint.tls {
        tracing::warn!(
            "{WEBHOOK_TOKEN_ENV} is sent to a plain http:// webhook, readable on the network; use https://"
        );
    }
    let client =
        Client::new(endpoint, cfg.sinks.webhook_ca.as_deref(), token).context("sinks.webhook")?;
    Ok(Some(client))
}

async fn run(
    cfg: EdgeConfig,
    max_frames: Option<u64>,
    results: Option<PathBuf>,
    summary_every: Option<u64>,
) -> anyhow::Result<()> {
    let mut sinks = Sinks {
        stdout: cfg.sinks.stdout,
        ..Sinks::default()
    };
    // --results FILE replaces stdout and the configured file.
    let file = match &results {
        Some(p) => {
            sinks.stdout = false;
            Some(p.clone())
        }
        None => cfg.sinks.file.clone(),
    };
    if let Some(p) = &file {
        sinks.file = Some(
            open_results_file(p)
                .with_context(|| format!("opening results file {}", p.display()))?,
        );
    }
    if let Some(client) = webhook_client(&cfg)? {
        let limits = QueueLimits {
            results: cfg.sinks.webhook_queue,
            bytes: cfg.sinks.webhook_queue_bytes,
        };
        sinks.webhook = Some(Webhook::spawn_with(client, limits, RetryPolicy::default()));
    }
    if let Some(m) = &cfg.sinks.mqtt {
        let password = std::env::var(tidegate_edge::sink::mqtt::PASSWORD_ENV).ok();
        let settings = tidegate_edge::sink::mqtt::MqttSettings::new(m, &cfg.name, password)
            .context("sinks.mqtt")?;
        sinks.mqtt = Some(tidegate_edge::sink::mqtt::Mqtt::spawn(settings));
    }
    let summary_every = summary_every.filter(|&s| s > 0).map(Duration::from_secs);
    let uplink = tidegate_edge::node::uplink_stats(&cfg);
    let stats = serve_metrics(&cfg, summary_every.is_some(), uplink.clone()).await?;
    let options = NodeOptions {
        max_frames,
        summary_every,
        stats,
        uplink: Some(uplink),
    };
    let summary = tidegate_edge::node::run(cfg, sinks, options, tidegate_kit::signal::shutdown())
        .await
        .context("running the edge")?;
    summary.print();
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn cli_definition_is_consistent() {
        use clap::CommandFactory;
        super::Cli::command().debug_assert();
    }

    #[test]
    fn metrics_listen_flag_overrides_the_file_and_left_unset_keeps_it() {
        use clap::Parser;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("e.toml");
        std::fs::write(
            &p,
            "name = \"e\"\ntoken = \"t\"\n[gateway]\naddr = \"127.0.0.1:1\"\nca = \"ca.pem\"\n[metrics]\nlisten = \"127.0.0.1:9102\"\n",
        )
        .unwrap();
        let path = p.to_str().unwrap();
        let listen = |extra: &[&str]| {
            let args = [&["tidegate-edge", "--config", path], extra].concat();
            let cli = super::Cli::try_parse_from(args).unwrap();
            super::load_config(&cli).unwrap().metrics.listen
        };
        assert_eq!(listen(&[]), Some("127.0.0.1:9102".parse().unwrap()));
        let flag = listen(&["--metrics-listen", "127.0.0.1:0"]);
        assert_eq!(flag, Some("127.0.0.1:0".parse().unwrap()));
    }
}
