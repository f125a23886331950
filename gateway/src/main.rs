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
    ///   tidegate-gateway simulate --trace lease/traces/day-night.csv --policy paid-block-aware
    Simulate {
        /// Trace file (CSV: `t_secs,model,fps`, one row per minute).
        #[arg(long)]
        trace: PathBuf,
        /// Policy: static-peak, reactive-idle-timeout, tidal or paid-block-aware.
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
    let endpoint = quinn::Endpoint::server(server_config, cfg.quic.listen)
        .map_err(|e| anyhow::anyhow!("{}", bind_error(Listener::Quic, cfg.quic.listen, &e)))?;
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
    let limits = scheduler::Limits {
        max_queued: cfg.scheduler.max_queued,
        max_queued_per_edge: cfg.scheduler.max_queued_per_edge,
        pipeline_depth: cfg.scheduler.pipeline_depth,
        stall_us: u64::from(cfg.scheduler.stall_timeout_ms) * 1000,
        health: cfg.scheduler.health.policy(),
        ..scheduler::Limits::default()
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
