//! `tidegate-gateway`: the QUIC gateway between edges and GPU workers.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use tidegate_gateway::config::{Config, ConfigError};
use tidegate_gateway::{
    api, auth, certs, http_listener, hub, leasing, metrics, reload, scheduler, server, simulate,
};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// tidegate gateway: admits frames from edges over QUIC, schedules each
/// against its deadline on registered workers, and routes results back.
///
/// Quick start:
///   tidegate-gateway dev-certs --out certs
///   tidegate-gateway hash-token my-edge-secret      # put the digest in the config
///   tidegate-gateway --config gateway.toml run
#[derive(Debug, Parser)]
#[command(version, about, long_about)]
struct Cli {
    /// Config file (TOML). Without it, defaults apply and nobody may connect.
    #[arg(long, short, env = "TIDEGATE_GATEWAY_CONFIG", global = true)]
    config: Option<PathBuf>,
    /// QUIC listen address (overrides `quic.listen`).
    #[arg(long, env = "TIDEGATE_QUIC_LISTEN", global = true)]
    quic_listen: Option<SocketAddr>,
    /// HTTP listen address for /metrics and the API (overrides `http.listen`).
    #[arg(long, env = "TIDEGATE_HTTP_LISTEN", global = true)]
    http_listen: Option<SocketAddr>,
    /// Log filter, e.g. `info` or `tidegate_gateway=debug`.
    #[arg(long, env = "TIDEGATE_LOG", default_value = "info", global = true)]
    log: String,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the gateway (the default).
    Run,
    /// Check what `run` needs without running: the config, every file it
    /// names (TLS certificate and key, catalog, ledger, the provider's
    /// tools) and the listen ports; print a short summary, exit 1 on a
    /// failed check.
    CheckConfig,
    /// Generate a development CA and gateway certificate (never commit them).
    DevCerts {
        /// Output directory.
        #[arg(long, default_value = "certs")]
        out: PathBuf,
        /// DNS names / IP addresses the certificate is valid for.
        #[arg(long, default_values_t = ["localhost".to_string(), "127.0.0.1".to_string()])]
        name: Vec<String>,
    },
    /// Print the SHA-256 digest of a token, for the config's `token_sha256`.
    HashToken {
        /// The token.
        token: String,
    },
    /// Replay an arrival trace through the autoscaler and print the cost,
    /// GPU-hours, utilisation and SLO attainment as JSON.
    ///
    /// Example:
    ///   tidegate-gateway simulate --trace lease-core/traces/day-night.csv --policy paid-block-aware
    Simulate {
        /// Trace file (CSV: `t_secs,model,fps`, one row per minute).
        #[arg(long)]
        trace: PathBuf,
        /// Policy: static-peak, reactive-idle-timeout, idle-timeout-spot, tidal
        /// or paid-block-aware.
        #[arg(long)]
        policy: String,
        /// Pricing catalog (TOML); default: the built-in catalog.
        #[arg(long)]
        catalog: Option<PathBuf>,
        /// Also write the JSON report to this file.
        #[arg(long)]
        out: Option<PathBuf>,
        /// Seed of the random draws (spot refusals, preemptions); default 42.
        #[arg(long)]
        seed: Option<u64>,
    },
    /// Write a synthetic arrival trace (CSV, as `simulate --trace` reads
    /// it) of a kind with its documented default parameters
    /// (lease-core/src/tracegen.rs, docs/leasing.md "Traces"): diurnal, weekly
    /// (an office week), burst (72 h, mean 320 and peak 487 GPUs), growth
    /// (a week), flip (high and low every 50-70 minutes) or noise (random
    /// spikes). The same kind and seed always give the same trace.
    ///
    /// Example:
    ///   tidegate-gateway generate-trace --kind weekly --seed 7 --out week.csv
    GenerateTrace {
        /// diurnal, weekly, burst, growth, flip or noise.
        #[arg(long)]
        kind: String,
        /// Seed of the random draws.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Write the CSV to this file instead of printing it.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Put renting (the simulator's cost under each policy) next to owning
    /// the fleet that static-peak rents for the same trace: the period's
    /// share of depreciation and operations plus power for the busy hours,
    /// and the utilisation over the fleet's life above which owning is
    /// cheaper (docs/leasing.md, "Renting against owning"). JSON, or a
    /// Markdown table with --markdown.
    ///
    /// Example:
    ///   tidegate-gateway own-vs-rent --trace lease-core/traces/burst-72h-v100.csv --catalog lease-core/catalog/v100.toml --purchase-per-gpu 7803 --kw-per-gpu 0.45 --price-per-kwh 0.8 --ops-per-gpu-year 1500
    OwnVsRent(OwnVsRentCmd),
}

/// The flags of `own-vs-rent`. Amounts are in the catalog's currency.
#[derive(Debug, clap::Args)]
struct OwnVsRentCmd {
    /// Trace file (CSV: `t_secs,model,fps`, one row per minute).
    #[arg(long)]
    trace: PathBuf,
    /// Pricing catalog (TOML); default: the built-in catalog.
    #[arg(long)]
    catalog: Option<PathBuf>,
    /// Rent under this policy only; default: every policy.
    #[arg(long)]
    policy: Option<String>,
    /// Seed of the simulator's random draws; default 42.
    #[arg(long)]
    seed: Option<u64>,
    /// Purchase price of one GPU with its share of the server.
    #[arg(
        long,
        required_unless_present = "purchase_per_server",
        conflicts_with = "purchase_per_server"
    )]
    purchase_per_gpu: Option<f64>,
    /// Purchase price of one server (with --gpus-per-server).
    #[arg(long, requires = "gpus_per_server")]
    purchase_per_server: Option<f64>,
    /// GPUs in one server.
    #[arg(long)]
    gpus_per_server: Option<u32>,
    /// Years over which the purchase is written off.
    #[arg(long, default_value_t = 3.0)]
    years: f64,
    /// kW drawn by one busy GPU with its share of the server and cooling.
    #[arg(long)]
    kw_per_gpu: f64,
    /// Price of a kWh.
    #[arg(long)]
    price_per_kwh: f64,
    /// Hosting and operations per GPU per year.
    #[arg(long, default_value_t = 0.0)]
    ops_per_gpu_year: f64,
    /// GPUs owned; default: static-peak's fleet for the trace.
    #[arg(long)]
    fleet_gpus: Option<u32>,
    /// Print a Markdown table instead of JSON.
    #[arg(long)]
    markdown: bool,
}

/// Runs `own-vs-rent` and prints its result.
fn own_vs_rent(cmd: &OwnVsRentCmd) -> anyhow::Result<()> {
    use tidegate_lease::own::Ownership;
    let one_line = |e: simulate::SimulateError| anyhow::anyhow!("{e}");
    let ownership = match (
        cmd.purchase_per_gpu,
        cmd.purchase_per_server,
        cmd.gpus_per_server,
    ) {
        (Some(per_gpu), _, _) => Ownership {
            purchase_per_gpu: per_gpu,
            depreciation_years: cmd.years,
            kw_per_gpu: cmd.kw_per_gpu,
            price_per_kwh: cmd.price_per_kwh,
            ops_per_gpu_year: cmd.ops_per_gpu_year,
        },
        (None, Some(server), Some(gpus)) => Ownership::per_server(
            server,
            gpus,
            cmd.years,
            cmd.kw_per_gpu,
            cmd.price_per_kwh,
            cmd.ops_per_gpu_year,
        )
        .map_err(|e| one_line(e.into()))?,
        _ => anyhow::bail!(
            "give --purchase-per-gpu, or --purchase-per-server with --gpus-per-server"
        ),
    };
    let args = simulate::OwnArgs {
        trace: cmd.trace.clone(),
        catalog: cmd.catalog.clone(),
        policy: cmd.policy.clone(),
        seed: cmd.seed,
        ownership,
        fleet_gpus: cmd.fleet_gpus,
    };
    let r = simulate::own_vs_rent(&args).map_err(one_line)?;
    if cmd.markdown {
        print!("{}", r.to_markdown());
    } else {
        println!(
            "{}",
            serde_json::to_string_pretty(&r).expect("the comparison serialises")
        );
    }
    Ok(())
}

fn load_config(cli: &Cli) -> anyhow::Result<Config> {
    Ok(reader(cli)()?)
}

/// Reads the configuration as the command line says: the file (or the
/// defaults), then the flags, validated. A reload calls it again.
fn reader(cli: &Cli) -> impl Fn() -> Result<Config, ConfigError> + Send + Sync + 'static {
    let (path, quic_listen, http_listen) = (cli.config.clone(), cli.quic_listen, cli.http_listen);
    move || {
        let mut cfg = match &path {
            Some(p) => Config::load(p)?,
            None => Config::default_config(),
        };
        if let Some(a) = quic_listen {
            cfg.quic.listen = a;
        }
        if let Some(a) = http_listen {
            cfg.http.listen = a;
        }
        cfg.validate()?;
        Ok(cfg)
    }
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(&cli.log))
        .with_writer(std::io::stderr)
        .init();
    match &cli.command {
        Some(Command::DevCerts { out, name }) => {
            let c = certs::generate(out, name).context("generating dev certificates")?;
            println!(
                "wrote {}, {}, {}",
                c.ca_cert.display(),
                c.server_cert.display(),
                c.server_key.display()
            );
            Ok(())
        }
        Some(Command::HashToken { token }) => {
            println!("{}", auth::hash_token(token));
            Ok(())
        }
        Some(Command::Simulate {
            trace,
            policy,
            catalog,
            out,
            seed,
        }) => {
            let args = simulate::SimulateArgs {
                trace: trace.clone(),
                policy: policy.clone(),
                catalog: catalog.clone(),
                seed: *seed,
            };
            // Each error already names the file and the cause: one line,
            // without anyhow's "Caused by" repeat.
            let one_line = |e: simulate::SimulateError| anyhow::anyhow!("{e}");
            let report = simulate::simulate(&args).map_err(one_line)?;
            println!(
                "{}",
                simulate::render(&report, out.as_deref()).map_err(one_line)?
            );
            Ok(())
        }
        Some(Command::GenerateTrace { kind, seed, out }) => {
            let csv = simulate::generate_trace(kind, *seed, out.as_deref())
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            if out.is_none() {
                print!("{csv}");
            }
            Ok(())
        }
        Some(Command::OwnVsRent(cmd)) => own_vs_rent(cmd),
        Some(Command::CheckConfig) => {
            let cfg = load_config(&cli)?;
            let text =
                tidegate_gateway::preflight::report(&cfg).map_err(|t| anyhow::anyhow!("{t}"))?;
            println!("{text}");
            Ok(())
        }
        Some(Command::Run) | None => {
            let cfg = load_config(&cli)?;
            let reload: Option<reload::LoadConfig> = cli
                .config
                .is_some()
                .then(|| Box::new(reader(&cli)) as reload::LoadConfig);
            tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
                .context("starting the tokio runtime")?
                .block_on(run(cfg, reload))
        }
    }
}

/// How long shutdown waits for HTTP requests under way (and connections
/// that have not finished sending one) before it closes them: a
/// graceful shutdown alone waits for a request's handler to finish, and a
/// client that sent half a request waits out its header-read timeout.
const HTTP_GRACE: Duration = Duration::from_secs(5);

async fn run(cfg: Config, reload: Option<reload::LoadConfig>) -> anyhow::Result<()> {
    // Before anything can announce the gateway: a SIGHUP or SIGTERM sent
    // as soon as it is listening must reload or stop it, not kill it by
    // the signal's default action.
    let signals = Signals::install()?;
    let server_config = tidegate_protocol::quic::login_gated_server_config(
        &cfg.quic.cert,
        &cfg.quic.key,
        cfg.quic.congestion,
    )
    .context("loading the gateway's TLS certificate")?;
    use tidegate_gateway::preflight::{Listener, bind_error};
    let (endpoint, buffers) =
        tidegate_protocol::quic::server_endpoint(server_config, cfg.quic.listen)
            .map_err(|e| anyhow::anyhow!("{}", bind_error(Listener::Quic, cfg.quic.listen, &e)))?;
    tracing::info!(
        recv = buffers.recv,
        send = buffers.send,
        "QUIC socket buffers (bytes)"
    );
    let http = tokio::net::TcpListener::bind(cfg.http.listen)
        .await
        .map_err(|e| anyhow::anyhow!("{}", bind_error(Listener::Http, cfg.http.listen, &e)))?;
    // Printed for scripts and tests that bind port 0.
    println!(
        "listening quic={} http={}",
        endpoint.local_addr()?,
        http.local_addr()?
    );

    let cancel = CancellationToken::new();
    let tracker = TaskTracker::new();
    let metrics = metrics::Metrics::new();
    let limits = scheduler::Settings {
        max_queued: cfg.scheduler.max_queued,
        max_queued_per_edge: cfg.scheduler.max_queued_per_edge,
        pipeline_depth: cfg.scheduler.pipeline_depth,
        stall_us: u64::from(cfg.scheduler.stall_timeout_ms) * 1000,
        health: cfg.scheduler.health.policy(),
        ..scheduler::Settings::default()
    };
    let hints = cfg
        .scheduler
        .hints
        .then(|| tidegate_gateway::backpressure::BackpressureConfig {
            window_us: cfg.scheduler.hint_window_ms as u64 * 1000,
            shed_ratio: cfg.scheduler.hint_shed_ratio,
            ..Default::default()
        });
    let hub = hub::spawn(limits, hints, metrics.clone(), cancel.clone(), &tracker);
    hub.thumbnails().configure(cfg.status.thumbnails());
    let leasing = match &cfg.leasing {
        Some(l) => Some(
            leasing::spawn(
                l,
                endpoint.local_addr()?,
                hub.clone(),
                metrics.clone(),
                cancel.clone(),
                &tracker,
            )
            .context("starting the lease manager")?,
        ),
        None => None,
    };
    let access = Arc::new(auth::Access::new(auth::Credentials::from_config(&cfg)));
    let reloader = Arc::new(reload::Reloader::new(
        reload,
        cfg.clone(),
        access.clone(),
        Some(reload::TlsReload::new(
            endpoint.clone(),
            &cfg.quic.cert,
            &cfg.quic.key,
            cfg.quic.congestion,
        )),
        metrics.clone(),
    ));
    let api = api::router(api::ApiState {
        hub: hub.clone(),
        metrics: metrics.clone(),
        leasing: leasing.clone(),
        access: access.clone(),
        reloader: reloader.clone(),
    });
    let Signals { hangup, mut stop } = signals;
    #[cfg(unix)]
    tracker.spawn(reload_on_sighup(reloader, hangup, cancel.clone()));
    #[cfg(not(unix))]
    let _ = (reloader, hangup);
    {
        let cancel = cancel.clone();
        let http_limits = cfg.http.limits();
        let http_metrics = metrics.clone();
        tracker.spawn(async move {
            let shutdown = cancel.clone();
            let serve = http_listener::serve(http, api, http_limits, http_metrics, shutdown);
            let grace_over = async {
                cancel.cancelled().await;
                tokio::time::sleep(HTTP_GRACE).await;
            };
            tokio::select! {
                _ = serve => {},
                _ = grace_over => tracing::warn!(
                    "HTTP connections still open {HTTP_GRACE:?} after shutdown began are closed"
                ),
            }
        });
    }
    let srv = server::Server::new(cfg, hub, metrics, tracker.clone(), access, leasing);
    tracker.spawn(srv.serve(endpoint, cancel.clone()));

    stop.recv().await;
    tracing::info!("shutting down");
    cancel.cancel();
    tracker.close();
    tracker.wait().await;
    Ok(())
}

/// The gateway's signal handlers, installed before it binds anything.
struct Signals {
    /// SIGHUP (reload), where there is one.
    #[cfg(unix)]
    hangup: Option<tokio::signal::unix::Signal>,
    #[cfg(not(unix))]
    hangup: (),
    /// SIGTERM or Ctrl-C (stop).
    stop: Stop,
}

impl Signals {
    fn install() -> anyhow::Result<Signals> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            let hangup = match signal(SignalKind::hangup()) {
                Ok(s) => Some(s),
                Err(e) => {
                    tracing::error!(
                        "cannot install the SIGHUP handler ({e}); reload with POST /api/v1/reload"
                    );
                    None
                }
            };
            let term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
            let interrupt =
                signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
            Ok(Signals {
                hangup,
                stop: Stop { term, interrupt },
            })
        }
        #[cfg(not(unix))]
        Ok(Signals {
            hangup: (),
            stop: Stop {},
        })
    }
}

/// Resolves on SIGTERM or Ctrl-C (SIGINT).
struct Stop {
    #[cfg(unix)]
    term: tokio::signal::unix::Signal,
    #[cfg(unix)]
    interrupt: tokio::signal::unix::Signal,
}

impl Stop {
    async fn recv(&mut self) {
        #[cfg(unix)]
        tokio::select! {
            _ = self.interrupt.recv() => {},
            _ = self.term.recv() => {},
        }
        #[cfg(not(unix))]
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Reloads the configuration on every SIGHUP until shutdown.
#[cfg(unix)]
async fn reload_on_sighup(
    reloader: Arc<reload::Reloader>,
    hup: Option<tokio::signal::unix::Signal>,
    cancel: CancellationToken,
) {
    let Some(mut hup) = hup else {
        return;
    };
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            got = hup.recv() => if got.is_none() { return },
        }
        let r = reloader.clone();
        match tokio::task::spawn_blocking(move || r.reload()).await {
            Ok(Ok(report)) => tracing::info!(?report, "configuration reloaded (SIGHUP)"),
            Ok(Err(e)) => tracing::error!("configuration reload refused (SIGHUP): {e}"),
            Err(e) => tracing::error!("configuration reload task failed: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn cli_definition_is_consistent() {
        use clap::CommandFactory;
        super::Cli::command().debug_assert();
    }
}
