//! `tidegate-edge`: captures cameras with GStreamer, sends frames over QUIC
//! to a tidegate gateway, and prints each result as a JSON line with its
//! end-to-end latency measured on this machine's clock.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use clap::{Parser, Subcommand};
use tidegate_edge::capture::{Capture, CaptureSpec};
use tidegate_edge::clock;
use tidegate_edge::config::{CameraConfig, EdgeConfig, Secret};
use tidegate_edge::sink::{ResultLine, Sink};
use tidegate_edge::uplink::{Incoming, Uplink, UplinkError};
use tidegate_protocol::{DType, Frame, InputSpec, Layout, Status, Tensor};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, error, info, info_span, warn};

/// tidegate edge node.
///
/// Runs one GStreamer pipeline per camera in the config, scales frames to
/// the model input the gateway announces, and streams them over QUIC. Each
/// result is printed as one JSON line (stdout, or --results FILE).
///
/// Example: tidegate-edge --config edge.toml
#[derive(Debug, Parser)]
#[command(version, about, long_about)]
struct Cli {
    /// Config file (TOML): name, [gateway], [[cameras]].
    #[arg(long, short, env = "TIDEGATE_EDGE_CONFIG")]
    config: PathBuf,
    /// Gateway address (overrides `gateway.addr`).
    #[arg(long, env = "TIDEGATE_GATEWAY_ADDR", global = true)]
    gateway: Option<SocketAddr>,
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
    /// Load and validate the config, print it (secrets redacted), exit.
    CheckConfig,
}

fn load_config(cli: &Cli) -> anyhow::Result<EdgeConfig> {
    let mut cfg = EdgeConfig::load(&cli.config)?;
    if let Some(a) = cli.gateway {
        cfg.gateway.addr = a;
    }
    if let Some(ca) = &cli.ca {
        cfg.gateway.ca = ca.clone();
    }
    if let Some(t) = &cli.token {
        cfg.token = Secret(t.clone());
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
            println!("{cfg:#?}\nconfig ok");
            Ok(())
        }
        Some(Command::Run) | None => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .context("starting the tokio runtime")?
            .block_on(run(cfg, cli.max_frames, cli.results)),
    }
}

#[derive(Debug, Default)]
struct Tally {
    sent: AtomicU64,
    results: AtomicU64,
    ok: AtomicU64,
}

async fn run(
    cfg: EdgeConfig,
    max_frames: Option<u64>,
    results: Option<PathBuf>,
) -> anyhow::Result<()> {
    let (uplink, mut incoming) = connect_with_retry(&cfg).await?;
    let mut sink = match &results {
        Some(p) => {
            Sink::file(p).with_context(|| format!("opening results file {}", p.display()))?
        }
        None => Sink::Stdout,
    };
    let cancel = CancellationToken::new();
    let tracker = TaskTracker::new();
    let tally = Arc::new(Tally::default());

    for cam in cfg.cameras.clone() {
        let span = info_span!("camera", camera = %cam.name, model = %cam.model);
        tracker.spawn(
            camera(
                cam,
                uplink.clone(),
                cancel.clone(),
                tally.clone(),
                max_frames,
            )
            .instrument(span),
        );
    }
    tracker.close();

    let mut cameras_done = false;
    let mut drain_deadline = None::<tokio::time::Instant>;
    loop {
        let done_sending = tracker.is_empty();
        if done_sending && !cameras_done {
            cameras_done = true;
            if max_frames.is_some() {
                drain_deadline = Some(tokio::time::Instant::now() + Duration::from_secs(10));
            }
        }
        if cameras_done
            && max_frames.is_some()
            && tally.results.load(Ordering::Relaxed) >= tally.sent.load(Ordering::Relaxed)
        {
            break;
        }
        let timeout = async {
            match drain_deadline {
                Some(t) => tokio::time::sleep_until(t).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = shutdown_signal() => { info!("shutting down"); break; }
            _ = timeout => { warn!("gave up waiting for the last results"); break; }
            _ = tokio::time::sleep(Duration::from_millis(100)) => {}
            msg = incoming.recv() => match msg {
                Some(Incoming::Result(r)) => {
                    let now = clock::now_us();
                    tally.results.fetch_add(1, Ordering::Relaxed);
                    if r.status == Status::Ok {
                        tally.ok.fetch_add(1, Ordering::Relaxed);
                    }
                    uplink.report_latency(&r.camera, r.seq, now.saturating_sub(r.captured_at_us));
                    sink.write(&ResultLine::new(&r, now)).context("writing a result")?;
                }
                Some(Incoming::Hint(h)) => info!(camera = %h.camera, max_fps = h.max_fps, "control hint"),
                None => { error!("connection to the gateway lost"); break; }
            },
        }
    }
    cancel.cancel();
    tracker.wait().await;
    eprintln!(
        "summary: sent={} results={} ok={}",
        tally.sent.load(Ordering::Relaxed),
        tally.results.load(Ordering::Relaxed),
        tally.ok.load(Ordering::Relaxed)
    );
    uplink.close();
    Ok(())
}

async fn connect_with_retry(
    cfg: &EdgeConfig,
) -> anyhow::Result<(Uplink, tokio::sync::mpsc::Receiver<Incoming>)> {
    let mut delay = Duration::from_millis(200);
    loop {
        match Uplink::connect(
            cfg.gateway.addr,
            &cfg.gateway.server_name,
            &cfg.gateway.ca,
            &cfg.name,
            &cfg.token.0,
        )
        .await
        {
            Ok(u) => {
                info!(gateway = %cfg.gateway.addr, "connected");
                return Ok(u);
            }
            Err(e) if e.retryable() => {
                warn!("{e}; retrying in {delay:?}");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(5));
            }
            Err(e) => return Err(e).context("connecting to the gateway"),
        }
    }
}

/// Opens the camera (waiting for a worker to serve its model), then streams
/// its frames until cancelled or `max_frames` are sent.
async fn camera(
    cam: CameraConfig,
    uplink: Uplink,
    cancel: CancellationToken,
    tally: Arc<Tally>,
    max_frames: Option<u64>,
) {
    let input = loop {
        match uplink
            .open_camera(&cam.name, &cam.model, cam.budget_ms)
            .await
        {
            Ok(spec) => break spec,
            Err(e @ UplinkError::Refused { .. }) if e.retryable() => {
                warn!("{e}; retrying in 1 s");
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
            }
            Err(e) => {
                error!("cannot open camera: {e}");
                return;
            }
        }
    };
    if input.dtype != DType::U8 || input.layout != Layout::Nhwc || input.channels != 3 {
        error!(
            "model '{}' wants {} {} with {} channels; this edge produces u8 nhwc RGB",
            cam.model, input.dtype, input.layout, input.channels
        );
        return;
    }
    let spec = CaptureSpec {
        camera: cam.name.clone(),
        uri: cam.uri.clone(),
        width: input.width,
        height: input.height,
        resize: input.resize,
        max_fps: cam.max_fps,
    };
    let capture = match Capture::start(spec) {
        Ok(c) => c,
        Err(e) => {
            error!("{e}");
            return;
        }
    };
    let mut sent = 0u64;
    loop {
        if max_frames.is_some_and(|m| sent >= m) {
            break;
        }
        let frame = tokio::select! {
            _ = cancel.cancelled() => break,
            f = capture.recv() => match f {
                Ok(f) => f,
                Err(e) => { error!("{e}"); break; }
            },
        };
        let budget_us = (cam.budget_ms as u64 * 1000)
            .saturating_sub(clock::now_us().saturating_sub(frame.captured_at_us));
        let msg = to_frame(
            &cam,
            &input,
            frame.seq,
            frame.captured_at_us,
            budget_us,
            frame.geometry,
            frame.data,
        );
        match uplink.send_frame(msg).await {
            Ok(()) => {
                sent += 1;
                tally.sent.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                error!("sending frame: {e}");
                break;
            }
        }
    }
    info!(sent, dropped = capture.frames_dropped(), "camera stopped");
}

fn to_frame(
    cam: &CameraConfig,
    input: &InputSpec,
    seq: u64,
    captured_at_us: u64,
    budget_us: u64,
    geometry: tidegate_protocol::Geometry,
    data: Bytes,
) -> Frame {
    Frame {
        camera: cam.name.clone(),
        seq,
        captured_at_us,
        budget_us: budget_us.min(u32::MAX as u64) as u32,
        model: cam.model.clone(),
        geometry,
        tensor: Tensor {
            dtype: DType::U8,
            layout: Layout::Nhwc,
            shape: input.frame_shape(),
            data,
        },
    }
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("installing the SIGTERM handler");
    tokio::select! {
        _ = ctrl_c => {},
        _ = term.recv() => {},
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
