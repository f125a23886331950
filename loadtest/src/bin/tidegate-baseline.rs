//! `tidegate-baseline`: the floor of what serving costs. The simplest
//! KServe v2 server (HTTP, binary tensor extension) around the worker's
//! ONNX Runtime, model repository and preprocessing: N sessions × T
//! intra-op threads, one frame per run, no batching. What
//! `tidegate-loadtest kserve` measures tidegate and Triton against.

use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use clap::builder::TypedValueParser;
use tidegate_loadtest::kserve::baseline::{self, Baseline, BaselineOptions};

/// The simplest KServe v2 server around tidegate's ONNX Runtime worker
/// code: the floor of what serving a model costs.
///
/// Serves the model in --model-dir (its model.toml and .onnx, as the
/// worker reads them) on --sessions ONNX Runtime sessions of --threads
/// intra-op threads each, one frame per run (no batching). ONNX Runtime is
/// loaded as the worker loads it: ORT_DYLIB_PATH, else the tidegate cache
/// that `make setup` fills.
///
/// Routes: POST /v2/models/{name}/infer (binary tensor extension: UINT8
/// frames of shape 1xHxWx3 in, the raw FP32 outputs back), GET /v2, GET
/// /v2/health/ready, GET /v2/health/live, GET /v2/models/{name}, GET
/// /v2/models/{name}/ready. Prints `listening on ADDR` as its first line
/// on stdout once the sessions are warm; stops on Ctrl-C or SIGTERM.
///
///   tidegate-baseline --model-dir models/blazeface --sessions 2 --threads 1 --port 8000
#[derive(Debug, Parser)]
#[command(name = "tidegate-baseline", version, about, long_about)]
struct Cli {
    /// The model's folder.
    #[arg(long, default_value = "models/blazeface")]
    model_dir: PathBuf,
    /// ONNX Runtime sessions, each running one frame at a time on its own
    /// thread.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=256).map(usize::from))]
    sessions: usize,
    /// Intra-op threads per session.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=256).map(usize::from))]
    threads: usize,
    /// Requests that may wait for a session; more are answered 503.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=65_536).map(|n| n as usize))]
    queue: usize,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// Port to listen on (0: any free port, printed on start).
    #[arg(long, default_value_t = 0)]
    port: u16,
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
    let served = Baseline::open(&BaselineOptions {
        model_dir: cli.model_dir.clone(),
        sessions: cli.sessions,
        threads: cli.threads,
        queue: cli.queue,
    })
    .with_context(|| format!("starting on {}", cli.model_dir.display()))?;
    let served = Arc::new(served);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("building the runtime")?;
    runtime.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .context("installing the SIGTERM handler")?;
        let addr = SocketAddr::new(cli.host, cli.port);
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("listening on {addr}"))?;
        let local = listener.local_addr()?;
        println!("listening on {local}");
        std::io::stdout().flush()?;
        tracing::info!(
            model = %served.spec().name,
            sessions = cli.sessions,
            threads = cli.threads,
            "{} serving on {local}",
            baseline::SERVER_NAME
        );
        axum::serve(listener, baseline::router(served.clone()))
            .with_graceful_shutdown(async move {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            })
            .await
            .context("serving")
    })?;
    // The routes are gone with the runtime; the sessions finish the frames
    // they hold.
    drop(runtime);
    match Arc::try_unwrap(served) {
        Ok(b) => {
            if !b.shutdown(Duration::from_secs(10)) {
                tracing::warn!("a session was still running 10 s after shutdown began");
            }
        }
        Err(_) => tracing::warn!("requests still held the sessions at shutdown"),
    }
    Ok(())
}
