//! `tidegate-worker`: serves ONNX models to a tidegate gateway.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Parser, Subcommand};
use tidegate_protocol::{
    ColorOrder, DType, GatewayAddr, Layout, ModelInfo, ProfilePoint, Register,
};
use tidegate_worker::backend::{Backend, OrtBackend, Preprocessing, batch_buckets};
use tidegate_worker::config::WorkerConfig;
use tidegate_worker::executor::{Activity, Executor};
use tidegate_worker::link::{self, LinkConfig};
use tidegate_worker::metrics::{self, WorkerMetrics};
use tidegate_worker::model::Repository;
use tidegate_worker::runtime::{Runtime, RuntimeOptions};
use tidegate_worker::watchdog;
use tokio_util::sync::CancellationToken;
use tracing::info;

/// tidegate cloud worker.
///
/// Loads the model repository, opens an ONNX Runtime session per model,
/// measures each model's latency per batch size, then dials the gateway,
/// registers, and runs the batches it is sent. SIGTERM drains: batches
/// already taken are finished and answered, then the worker exits 0. A
/// batch still running after `runtime.wedged_after_secs` (ONNX Runtime or
/// the GPU is wedged), or a warm-up or profiling run at start still running
/// after `runtime.warmup_wedged_after_secs` (300 s by default), ends the
/// worker with exit status 3, for its supervisor to replace it.
///
/// Example: TIDEGATE_WORKER_TOKEN=... tidegate-worker --config worker.toml
#[derive(Debug, Parser)]
#[command(version, about, long_about)]
struct Cli {
    /// Config file (TOML): name, [gateway], [models], [runtime], [metrics].
    #[arg(long, short, env = "TIDEGATE_WORKER_CONFIG")]
    config: PathBuf,
    /// Gateway address, host:port (overrides `gateway.addr`): an IP address
    /// or a host name, resolved at every dial, e.g.
    /// tidegate-gateway.tidegate.svc:4433 or 10.0.0.5:4433.
    #[arg(long, env = "TIDEGATE_GATEWAY_ADDR", global = true)]
    gateway: Option<GatewayAddr>,
    /// CA certificate to trust (overrides `gateway.ca`).
    #[arg(long, env = "TIDEGATE_CA", global = true)]
    ca: Option<PathBuf>,
    /// The worker's token (overrides `token`; prefer the environment variable).
    #[arg(
        long,
        env = "TIDEGATE_WORKER_TOKEN",
        hide_env_values = true,
        global = true
    )]
    token: Option<String>,
    /// Model repository folder (overrides `models.dir`).
    #[arg(long, env = "TIDEGATE_MODELS", global = true)]
    models: Option<PathBuf>,
    /// libonnxruntime.so to load (overrides `runtime.library`).
    #[arg(long, env = "TIDEGATE_ORT_LIB", global = true)]
    ort_lib: Option<PathBuf>,
    /// Serve Prometheus metrics at http://ADDR/metrics (overrides
    /// `metrics.listen`), e.g. 127.0.0.1:9101; port 0 takes a free one,
    /// printed as `metrics listening on ADDR`. Off when unset.
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
    /// Run the worker (the default).
    Run,
    /// Validate the config, the ONNX Runtime library and every model, exit.
    CheckConfig,
    /// Check, one line each, what serving on CUDA needs here, without
    /// loading a model: ONNX Runtime's CUDA provider, the NVIDIA driver and
    /// its devices, and NVRTC compiling the preprocessing kernel. Exits 0
    /// only when all are there.
    CheckCuda,
}

fn load_config(cli: &Cli) -> anyhow::Result<WorkerConfig> {
    let mut cfg = WorkerConfig::load(&cli.config)?;
    if let Some(a) = &cli.gateway {
        cfg.gateway.addr = a.clone();
    }
    if let Some(ca) = &cli.ca {
        cfg.gateway.ca = ca.clone();
    }
    if let Some(t) = &cli.token {
        cfg.token = t.clone();
    }
    // Started for a lease (the gateway's process provider): the worker is
    // that lease, with its one-time token.
    if let (Ok(id), Ok(token)) = (
        std::env::var("TIDEGATE_LEASE_ID"),
        std::env::var("TIDEGATE_LEASE_TOKEN"),
    ) {
        cfg.name = format!("lease-{id}");
        cfg.token = token;
    }
    if let Some(m) = &cli.models {
        cfg.models.dir = m.clone();
    }
    if let Some(l) = &cli.ort_lib {
        cfg.runtime.library = Some(l.clone());
    }
    if let Some(a) = cli.metrics_listen {
        cfg.metrics.listen = Some(a);
    }
    cfg.validate()?;
    Ok(cfg)
}

fn main() {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(&cli.log))
        .with_writer(std::io::stderr)
        .init();
    let result = real_main(cli);
    if watchdog::is_exiting() {
        // The watchdog is ending the process with EXIT_WEDGED, and its exit
        // can make the wedged run fail (ONNX Runtime torn down under it):
        // whatever came back is that. Leave the exit to the watchdog (only
        // one thread may exit; std blocks any other), never report it as a
        // start-up error or end with another status.
        if let Err(e) = result {
            eprintln!(
                "tidegate-worker: exiting with status {} (wedged, see above); the run it was stuck in ended as the process exits: {e:#}",
                watchdog::EXIT_WEDGED
            );
        }
        loop {
            std::thread::park();
        }
    }
    // Errors are one line that says what to do, not a backtrace.
    if let Err(e) = result {
        eprintln!("tidegate-worker: error: {e:#}");
        std::process::exit(1);
    }
}

fn real_main(cli: Cli) -> anyhow::Result<()> {
    let started = Instant::now();
    let cfg = load_config(&cli)?;
    if matches!(cli.command, Some(Command::CheckCuda)) {
        return check_cuda(&cfg);
    }
    let options = RuntimeOptions {
        library: cfg.runtime.library.clone(),
        intra_threads: cfg.runtime.intra_threads,
        provider: cfg.runtime.provider(),
        fallback: cfg.runtime.fallback,
        pad_batches: cfg.runtime.pad_batches,
        ..RuntimeOptions::default()
    };
    let only = (!cfg.models.only.is_empty()).then_some(cfg.models.only.as_slice());
    let (repo, notes) =
        Repository::load(&cfg.models.dir, only)?.at_precision(cfg.runtime.precision)?;
    for note in &notes {
        tracing::warn!("runtime.precision = \"{}\": {note}", cfg.runtime.precision);
    }
    Runtime::init(options.library.as_deref())?;
    // Started before the first model runs and kept for the rest of the
    // process (drain and shutdown included): a warm-up or profiling run, or
    // later a batch, that never returns ends the process with EXIT_WEDGED.
    // Opening a session (reading, checking and optimising the graph) is not
    // a run and is not watched: it can legitimately take long on a large
    // model or a slow disk; only the supervisor bounds it (a leased
    // worker's start timeout).
    let activity = Arc::new(Activity::default());
    watchdog::spawn(activity.clone(), cfg.runtime.watchdog_timeouts())
        .context("starting the watchdog thread")?;
    let mut backend = OrtBackend::open_watched(&repo, &options, activity.clone())?;
    #[cfg(feature = "stand-in")]
    if let Some(stand_in) = tidegate_worker::stand_in::StandIn::from_env()? {
        tracing::warn!(settings = ?stand_in.settings(), "test stand-in: runs are held as a GPU's cold shapes and slow batches would be");
        backend.set_stand_in(stand_in);
    }
    let mut models = Vec::new();
    let mut profile = Vec::new();
    for spec in backend.models().to_vec() {
        let sizes = batch_buckets(spec.max_batch);
        let measured = backend
            .profile(&spec.name, &sizes)
            .with_context(|| format!("profiling model '{}'", spec.name))?;
        for &(batch, latency_us) in &measured {
            info!(model = %spec.name, batch, latency_us, "profiled");
        }
        for (batch, latency_us) in backend.registered_profile(&spec.name, &measured) {
            profile.push(ProfilePoint {
                model: spec.name.clone(),
                batch,
                latency_us,
            });
        }
        models.push(ModelInfo {
            name: spec.name.clone(),
            version: spec.version,
            // What edges send: u8 RGB NHWC at the model's size. The worker
            // converts to the graph's layout, colour order and type.
            input: tidegate_protocol::InputSpec {
                width: spec.input.width,
                height: spec.input.height,
                channels: 3,
                dtype: DType::U8,
                layout: Layout::Nhwc,
                color: ColorOrder::Rgb,
                resize: match spec.input.resize {
                    tidegate_worker::model::Resize::Stretch => tidegate_protocol::Resize::Stretch,
                    tidegate_worker::model::Resize::Letterbox => {
                        tidegate_protocol::Resize::Letterbox
                    }
                },
            },
            max_batch: spec.max_batch,
            labels: spec.decoder.labels().to_vec(),
        });
    }
    let device = device_name(&backend);
    for m in &models {
        if let Some(p) = backend.preprocessing(&m.name) {
            info!(model = %m.name, preprocessing = %p, "serving");
        }
    }
    if cli_is_check(&cli) {
        // the CA the link will trust, read as the link reads it
        tidegate_protocol::quic::client_config(&cfg.gateway.ca).with_context(|| {
            format!(
                "the CA certificate {} (gateway.ca, or --ca)",
                cfg.gateway.ca.display()
            )
        })?;
        println!(
            "config ok: {} model(s) load and run on {device}, trusting {}",
            models.len(),
            cfg.gateway.ca.display()
        );
        println!("  gateway {} as {}", cfg.gateway.addr, cfg.name);
        for m in &models {
            if let Some(p) = backend.preprocessing(&m.name) {
                println!("  {}: preprocessing on {p}", m.name);
            }
            match backend.tensorrt(&m.name) {
                Some(Ok(())) => println!("  {}: TensorRT, then the CUDA provider", m.name),
                Some(Err(why)) => {
                    println!(
                        "  {}: the CUDA provider alone (TensorRT unavailable: {why})",
                        m.name
                    );
                }
                None => {}
            }
        }
        println!("  precision {}", cfg.runtime.precision);
        for note in &notes {
            println!("  {note}");
        }
        return Ok(());
    }
    let register = Register {
        worker: cfg.name.clone(),
        device,
        models,
        profile,
        codecs: tidegate_worker::codec::SUPPORTED.to_vec(),
    };
    // The executor records its batches where the watchdog looks.
    let executor = Arc::new(Executor::spawn_with(
        Box::new(backend),
        EXECUTOR_QUEUE,
        activity,
    ));
    let metrics = cfg
        .metrics
        .listen
        .map(|addr| (addr, worker_metrics(&register, &executor)));
    let reconnect = Duration::from_secs(cfg.gateway.reconnect_secs);
    let link = LinkConfig {
        gateway: cfg.gateway.addr.clone(),
        server_name: cfg.gateway.server_name.clone(),
        ca: cfg.gateway.ca.clone(),
        name: cfg.name.clone(),
        token: cfg.token.clone(),
    };
    info!(
        ready_ms = started.elapsed().as_millis() as u64,
        "models warmed; dialling the gateway"
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    let end = rt.block_on(async {
        let cancel = CancellationToken::new();
        let on_signal = cancel.clone();
        tokio::spawn(async move {
            tidegate_kit::signal::shutdown().await;
            info!("SIGTERM/Ctrl-C: draining");
            on_signal.cancel();
        });
        let observed = match metrics {
            Some((addr, m)) => Some(serve_metrics(addr, m, cancel.clone()).await?),
            None => None,
        };
        serve(
            &link,
            executor.clone(),
            register,
            cancel,
            reconnect,
            observed,
        )
        .await
    })?;
    info!(?end, "exiting");
    // Joins the backend thread; should a job be wedged, the watchdog ends
    // the process instead.
    if let Ok(executor) = Arc::try_unwrap(executor) {
        executor.shutdown();
    }
    Ok(())
}

/// Keeps the worker linked to its gateway: when the link breaks (the
/// gateway restarted or the network failed) it redials with jittered
/// backoff and, once the backend has finished the old link's batches,
/// registers again, for up to `reconnect` since the link was last up. A
/// drain ends it; so does a refusal (a wrong or spent token), which no
/// retry can fix.
async fn serve(
    link: &LinkConfig,
    executor: Arc<Executor>,
    register: Register,
    cancel: CancellationToken,
    reconnect: Duration,
    metrics: Option<WorkerMetrics>,
) -> anyhow::Result<link::LinkEnd> {
    let run_link = || {
        link::run_observed(
            link,
            executor.clone(),
            register.clone(),
            cancel.clone(),
            metrics.clone(),
        )
    };
    // Batches of the lost link still on the backend would hold up the new
    // link's; a wedged one never ends, and the watchdog ends the process
    // instead of this worker registering again.
    let settle = || link::settle(&executor, &cancel);
    redial(link, run_link, settle, &cancel, reconnect).await
}

/// [`serve`]'s loop, with one link's run (`run_link`) and the wait for the
/// lost link's batches (`settle`) given, so that tests run its schedule on
/// a paused clock. Its times are tokio's (the same clock as std's unless
/// paused).
async fn redial<R, S>(
    link: &LinkConfig,
    mut run_link: impl FnMut() -> R,
    mut settle: impl FnMut() -> S,
    cancel: &CancellationToken,
    reconnect: Duration,
) -> anyhow::Result<link::LinkEnd>
where
    R: Future<Output = Result<link::LinkEnd, link::LinkError>>,
    S: Future<Output = link::Settled>,
{
    use tokio::time::Instant;
    /// A link that stayed up this long counts as a fresh start.
    const STABLE: Duration = Duration::from_secs(10);
    let mut backoff = link::redial_backoff(&link.name);
    let mut attempt = 0u32;
    let mut down_since: Option<Instant> = None;
    // one WARN for an outage, then one every 30 s: not one per redial
    let mut outage = tidegate_kit::backoff::Outage::new(Duration::from_secs(30));
    loop {
        let began = Instant::now();
        let result = run_link().await;
        let why = match result {
            Ok(link::LinkEnd::Drained) => return Ok(link::LinkEnd::Drained),
            Ok(link::LinkEnd::Closed) => "the gateway closed the link".to_string(),
            Err(e) if e.is_retryable() => e.to_string(),
            Err(e) => return Err(e.into()),
        };
        if cancel.is_cancelled() {
            return Ok(link::LinkEnd::Closed);
        }
        if backoff.reset_if_up_for(began.elapsed(), STABLE) {
            attempt = 0;
            down_since = None;
            if let Some((attempts, down_for)) = outage.recovered(began.into_std()) {
                tracing::info!(attempts, ?down_for, "the link to the gateway was back");
            }
        }
        let since = *down_since.get_or_insert_with(Instant::now);
        if since.elapsed() >= reconnect {
            anyhow::bail!(
                "gave up on the gateway at {} after {:.0?} without a link ({why}); check that it runs, or raise gateway.reconnect_secs",
                link.gateway,
                since.elapsed()
            );
        }
        let delay = backoff.next_delay();
        attempt += 1;
        match outage.failed(Instant::now().into_std()) {
            tidegate_kit::backoff::Loudness::Warn { down_for, .. } => tracing::warn!(
                attempt,
                ?delay,
                ?down_for,
                "link to the gateway lost ({why}); redialling"
            ),
            tidegate_kit::backoff::Loudness::Debug => tracing::debug!(
                attempt,
                ?delay,
                "link to the gateway lost ({why}); redialling"
            ),
        }
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = cancel.cancelled() => return Ok(link::LinkEnd::Closed),
        }
        if settle().await == link::Settled::Cancelled {
            return Ok(link::LinkEnd::Closed);
        }
    }
}

/// The worker's metrics: its models and device as registered, its GPUs
/// (NVML, or `gpu="none"`), and `executor`'s queue and busy time.
fn worker_metrics(register: &Register, executor: &Arc<Executor>) -> WorkerMetrics {
    let models: Vec<String> = register.models.iter().map(|m| m.name.clone()).collect();
    let m = WorkerMetrics::new(&models, &register.device, metrics::gpu_source());
    // A weak hold: the executor is joined at exit only once no one else
    // holds it.
    let e = Arc::downgrade(executor);
    m.watch_backend(executor.activity(), move || {
        e.upgrade().map_or(0, |e| e.busy_us())
    });
    m
}

/// Binds `[metrics] listen`, says where on stdout (`metrics listening on
/// ADDR`, the port chosen when it was 0), and serves `/metrics` until
/// `cancel` fires; `metrics`, for the link to count its batches in.
async fn serve_metrics(
    addr: std::net::SocketAddr,
    metrics: WorkerMetrics,
    cancel: CancellationToken,
) -> anyhow::Result<WorkerMetrics> {
    let listener = metrics::bind(addr).await?;
    let bound = listener
        .local_addr()
        .context("reading the metrics listener's address")?;
    println!("metrics listening on {bound}");
    info!(%bound, "serving /metrics");
    let served = metrics.clone();
    tokio::spawn(async move {
        if let Err(e) = metrics::serve(listener, served, cancel).await {
            tracing::warn!("the metrics listener stopped: {e}");
        }
    });
    Ok(metrics)
}

/// The device as registered: the backend's (`cpu (N threads)`, `cuda:N`),
/// with the GPU's name, memory and compute capability when the `cuda`
/// feature can read them, and on CUDA where frames are preprocessed: `GPU
/// preprocessing`, or the models preprocessed on the CPU.
fn device_name(backend: &OrtBackend) -> String {
    let mut device = backend.device();
    if let tidegate_worker::runtime::Provider::Cuda(_c) = backend.provider() {
        #[cfg(feature = "cuda")]
        match tidegate_worker::gpu::device(_c.device_id as usize) {
            Ok(gpu) => device = gpu.to_string(),
            Err(e) => tracing::warn!("cannot describe the GPU: {e}"),
        }
        let on_cpu: Vec<&str> = backend
            .models()
            .iter()
            .filter(|m| backend.preprocessing(&m.name) != Some(&Preprocessing::Gpu))
            .map(|m| m.name.as_str())
            .collect();
        if on_cpu.is_empty() {
            device.push_str(", GPU preprocessing");
        } else {
            device.push_str(&format!(", CPU preprocessing for {}", on_cpu.join(", ")));
        }
    }
    device
}

/// Batches that may wait for the backend while it runs one. The gateway
/// keeps at most its `pipeline_depth` (2 by default) batches in flight per
/// worker, so this fills only if that is raised above it; a batch beyond it
/// is answered `Shed(Overloaded)` at once rather than queued behind work it
/// would wait for.
const EXECUTOR_QUEUE: usize = 4;

/// `check-cuda`: each thing serving on CUDA needs, found (`ok`) or not
/// (`MISSING`, with why), on stdout; an error names what is missing.
fn check_cuda(cfg: &WorkerConfig) -> anyhow::Result<()> {
    let mut missing = Vec::new();
    let mut report = |what: &str, found: Result<String, String>| match found {
        Ok(found) => println!("ok       {what}: {found}"),
        Err(why) => {
            println!("MISSING  {what}: {why}");
            missing.push(what.to_string());
        }
    };
    let ort = Runtime::init(cfg.runtime.library.as_deref()).map_err(|e| e.to_string());
    report(
        "ONNX Runtime",
        ort.as_ref()
            .map(|rt| rt.path().display().to_string())
            .map_err(Clone::clone),
    );
    let provider = ort.and_then(|_| match tidegate_worker::backend::cuda_provider_built()? {
        true => Ok("built in".to_string()),
        false => Err("a CPU build; use the onnxruntime-gpu wheel's libonnxruntime.so".into()),
    });
    report("its CUDA execution provider", provider);
    #[cfg(feature = "cuda")]
    {
        use tidegate_worker::gpu;
        let devices = gpu::probe().map_err(|e| e.to_string()).and_then(|all| {
            let all: Vec<String> = all.iter().map(ToString::to_string).collect();
            match all.is_empty() {
                true => Err("the driver lists no device".to_string()),
                false => Ok(all.join("; ")),
            }
        });
        report("the NVIDIA driver and its devices", devices);
        let kernel = gpu::compile_kernel(None)
            .map(|ptx| format!("compiles ({} bytes of PTX)", ptx.to_src().len()))
            .map_err(|e| e.to_string());
        report("NVRTC and the preprocessing kernel", kernel);
    }
    #[cfg(not(feature = "cuda"))]
    report(
        "the NVIDIA driver and GPU preprocessing",
        Err("this worker was built without the `cuda` feature".into()),
    );
    if !missing.is_empty() {
        anyhow::bail!("cannot serve on CUDA here: {}", missing.join(", "));
    }
    println!("cuda ok");
    Ok(())
}

fn cli_is_check(cli: &Cli) -> bool {
    matches!(cli.command, Some(Command::CheckConfig))
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
        let p = dir.path().join("w.toml");
        std::fs::write(
            &p,
            "name = \"w\"\ntoken = \"t\"\n[gateway]\naddr = \"127.0.0.1:1\"\nca = \"ca.pem\"\n[metrics]\nlisten = \"127.0.0.1:9101\"\n",
        )
        .unwrap();
        let path = p.to_str().unwrap();
        let listen = |extra: &[&str]| {
            let args = [&["tidegate-worker", "--config", path], extra].concat();
            let cli = super::Cli::try_parse_from(args).unwrap();
            super::load_config(&cli).unwrap().metrics.listen
        };
        assert_eq!(listen(&[]), Some("127.0.0.1:9101".parse().unwrap()));
        let flag = listen(&["--metrics-listen", "127.0.0.1:0"]);
        assert_eq!(flag, Some("127.0.0.1:0".parse().unwrap()));
    }

    /// A link config for [`super::redial`]'s tests (nothing is dialled).
    fn link_config() -> super::LinkConfig {
        super::LinkConfig {
            gateway: "127.0.0.1:1".parse().unwrap(),
            server_name: "localhost".into(),
            ca: "ca.pem".into(),
            name: "w".into(),
            token: "t".into(),
        }
    }

    // tokio's timer rounds a deadline up to its next millisecond
    const TICK: std::time::Duration = std::time::Duration::from_millis(1);

    /// Asserts that each wait lies in its step's band (the upper half of
    /// the step, equal jitter) and never past the redial's max.
    fn assert_in_bands(waits: &[std::time::Duration], steps_ms: &[u64]) {
        use tidegate_worker::link::REDIAL_MAX;
        assert_eq!(waits.len(), steps_ms.len(), "{waits:?}");
        for (i, (wait, step)) in waits.iter().zip(steps_ms).enumerate() {
            let step = std::time::Duration::from_millis(*step);
            assert!(
                *wait >= step / 2 && *wait <= step + TICK,
                "wait {i}: {wait:?} outside [{:?}, {step:?}]; all: {waits:?}",
                step / 2
            );
            assert!(*wait <= REDIAL_MAX + TICK, "{waits:?}");
        }
    }

    /// A gateway that stays lost: each redial waits within its step's
    /// band, 200 ms doubling to the 5 s max and never more, and the worker
    /// gives up at the first failure `reconnect` (20 s) after the first.
    #[tokio::test(start_paused = true)]
    async fn a_lost_gateway_is_redialled_after_growing_delays_never_past_the_max_then_given_up() {
        use tidegate_worker::link::{LinkError, Settled};
        let start = tokio::time::Instant::now();
        let reconnect = std::time::Duration::from_secs(20);
        let mut dials = Vec::new();
        let mut settled = 0;
        let end = super::redial(
            &link_config(),
            || {
                dials.push(start.elapsed());
                async { Err(LinkError::Broken("connection lost".into())) }
            },
            || {
                settled += 1;
                async { Settled::Idle }
            },
            &tokio_util::sync::CancellationToken::new(),
            reconnect,
        )
        .await;
        let e = end.expect_err("a gateway lost for good is given up");
        assert!(e.to_string().contains("gave up on the gateway"), "{e}");
        let waits: Vec<_> = dials.windows(2).map(|w| w[1] - w[0]).collect();
        // 200, 400, 800, 1600, 3200 ms, then the 5 s max until 20 s
        let mut steps = vec![200, 400, 800, 1600, 3200];
        steps.resize(waits.len(), 5000);
        assert_in_bands(&waits, &steps);
        let last = *dials.last().unwrap();
        assert!(last >= reconnect, "gave up too soon: {dials:?}");
        assert!(
            dials[dials.len() - 2] < reconnect,
            "gave up too late: {dials:?}"
        );
        assert_eq!(start.elapsed(), last, "no wait after giving up");
        assert_eq!(settled, dials.len() - 1, "one settle before each redial");
    }

    /// A link that stayed up 10 s (the loop's STABLE) counts as a fresh
    /// start: the next redial waits the first step again, and the outage
    /// before it no longer counts toward `reconnect` (6 s here, less than
    /// the whole run). A drain then ends the loop.
    #[tokio::test(start_paused = true)]
    async fn a_link_that_stayed_up_starts_the_redials_again_from_the_first_step() {
        use tidegate_worker::link::{LinkEnd, LinkError, Settled};
        let start = tokio::time::Instant::now();
        let up = std::time::Duration::from_secs(10);
        let mut dials = Vec::new();
        let end = super::redial(
            &link_config(),
            || {
                dials.push(start.elapsed());
                let n = dials.len();
                async move {
                    match n {
                        5 => {
                            tokio::time::sleep(up).await;
                            Ok(LinkEnd::Closed)
                        }
                        8 => Ok(LinkEnd::Drained),
                        _ => Err(LinkError::Broken("connection lost".into())),
                    }
                }
            },
            || async { Settled::Idle },
            &tokio_util::sync::CancellationToken::new(),
            std::time::Duration::from_secs(6),
        )
        .await;
        assert_eq!(end.unwrap(), LinkEnd::Drained);
        assert_eq!(dials.len(), 8, "{dials:?}");
        // the wait after each link's end; the fifth link was up for `up`
        let ends: Vec<_> = dials
            .iter()
            .enumerate()
            .map(|(i, at)| if i == 4 { *at + up } else { *at })
            .collect();
        let waits: Vec<_> = (1..dials.len()).map(|i| dials[i] - ends[i - 1]).collect();
        assert_in_bands(&waits, &[200, 400, 800, 1600, 200, 400, 800]);
        assert!(start.elapsed() > std::time::Duration::from_secs(6));
    }
}
