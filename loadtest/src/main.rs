//! `tidegate-loadtest`: simulated cameras against a tidegate gateway, with a
//! JSON report and an SLO gate; and `tidegate-loadtest impair`, a WAN
//! impairment relay to put in front of a gateway.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::builder::TypedValueParser;
use clap::error::ErrorKind;
use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches, Parser};
use tidegate_loadtest::cluster::{
    Cluster, ClusterOptions, WorkerProvider, model_repository, workspace_root,
};
use tidegate_loadtest::impair::{
    Blackout, DEFAULT_QUEUE_MS, GilbertElliott, ImpairConfig, LinkConfig, MAX_FLOWS, Relay,
    RelayOptions,
};
use tidegate_loadtest::kserve::{self, KserveOptions};
use tidegate_loadtest::loadgen::{self, LoadOptions};
use tidegate_loadtest::report::write_atomically;
use tidegate_loadtest::scenario::{MAX_CAMERAS, PhaseReport, Scenario, ScenarioReport};
use tidegate_protocol::GatewayAddr;

/// tidegate load generator.
///
/// Simulates N cameras sending frames at a fixed rate for a bounded time,
/// records every result's end-to-end latency, prints a JSON report, and
/// exits non-zero when the SLO gate fails.
///
/// Against a local cluster it starts itself (gateway + workers on
/// 127.0.0.1 serving --model, BlazeFace by default; astronaut.png):
///   tidegate-loadtest --local --workers 1 --cameras 4 --fps 10 --seconds 10
///
/// To emulate a WAN between it and a gateway: tidegate-loadtest impair --help
///
/// To drive a KServe v2 server (Triton, tidegate-baseline) the same way:
/// tidegate-loadtest kserve --help
#[derive(Debug, Parser)]
#[command(
    version,
    about,
    long_about,
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// Start a local gateway and workers (serving --model to edge --edge)
    /// instead of using --gateway, --ca and --token: those flags are
    /// refused with it, and their environment variables ignored.
    #[arg(long)]
    local: bool,
    /// Workers for --local.
    #[arg(long, default_value_t = 1)]
    workers: usize,
    /// Execution provider of the --local workers: cpu (one intra-op
    /// thread each) or cuda (the worker's `runtime.provider = "cuda"`,
    /// ONNX Runtime from ORT_DYLIB_PATH; for a GPU machine).
    #[arg(long, value_enum, default_value_t = WorkerProvider::Cpu, requires = "local")]
    worker_provider: WorkerProvider,
    /// Model repository: the --local workers serve from it, and the
    /// default image is its testdata/astronaut.png (default: this
    /// checkout's models/).
    #[arg(long, env = "TIDEGATE_MODELS_DIR")]
    models_dir: Option<PathBuf>,
    /// Gateway QUIC address, host:port: an IP address or a host name.
    #[arg(long, env = "TIDEGATE_GATEWAY_ADDR", required_unless_present = "local")]
    gateway: Option<GatewayAddr>,
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
    /// Simulated cameras (1 to 1024, as in a scenario's phase).
    #[arg(long, default_value_t = 4, value_parser = camera_count)]
    cameras: usize,
    /// Frames per second per camera.
    #[arg(long, default_value_t = 10.0)]
    fps: f64,
    /// Seconds of sending (bounded: at most 600).
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// Run the phases of this scenario file (TOML, loadtest/scenarios/)
    /// one after another instead of one run of --cameras × --fps for
    /// --seconds; --model, --budget-ms, --ignore-hints and
    /// --min-slo-attainment are the defaults of its phases. The report
    /// has one entry per phase; --svg FILE draws each as FILE-<phase>.svg.
    #[arg(long, conflicts_with_all = ["cameras", "fps", "seconds"])]
    scenario: Option<PathBuf>,
    /// Model (with --local, the workers serve it from the repository's
    /// models/).
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
    /// SLO gate: exit non-zero unless at least this fraction (0 to 1) of
    /// the frames tried is ok within budget, or if any frame gets two
    /// results.
    #[arg(long, value_parser = fraction)]
    min_slo_attainment: Option<f64>,
    /// Keep sending at --fps even when the gateway hints a lower rate.
    #[arg(long)]
    ignore_hints: bool,
    /// All cameras on one schedule: their frames fall due at the same
    /// instant (the burst case). By default their phases are spread over
    /// a period, as real cameras' are.
    #[arg(long)]
    in_step: bool,
    /// How frames travel: jpeg (as a real edge does by default), png
    /// (lossless) or raw (as on a LAN). The generator encodes its one frame
    /// once, with the image crate; a real edge encodes every frame with
    /// GStreamer and adapts its quality to the link.
    #[arg(long, value_parser = ["raw", "jpeg", "png"], default_value = "jpeg")]
    encoding: String,
    /// JPEG quality (1 to 100) with --encoding jpeg.
    #[arg(long, default_value_t = 90, value_parser = clap::value_parser!(u8).range(1..=100))]
    jpeg_quality: u8,
    /// Congestion controller for the frames sent: bbr, cubic or newreno.
    #[arg(long, default_value = "bbr")]
    congestion: tidegate_protocol::quic::Congestion,
    /// Copies of each frame sent side by side (1 to 3), and of each result
    /// asked back: 2 on a lossy link whose round trip leaves no time for a
    /// retransmission within the budget.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=3))]
    copies: u8,
    /// Print a progress line on stderr (sent, ok, shed, p99 so far) every
    /// this many seconds; 0: none.
    #[arg(long, default_value_t = 1.0, value_parser = progress_secs)]
    progress: f64,
    /// With --local: once the run is done, keep the gateway and workers up
    /// (their URLs are printed) until interrupted (Ctrl-C or SIGTERM), for
    /// a look at the status page, the metrics and the API.
    #[arg(long, requires = "local")]
    keep_up: bool,
    /// Log filter.
    #[arg(long, env = "TIDEGATE_LOG", default_value = "warn")]
    log: String,
}

/// `--progress`: seconds between progress lines, 0 for none.
fn progress_secs(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|e| format!("{s:?}: {e}"))?;
    if v == 0.0 || (0.1..=3600.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!(
            "{v} is not 0 (no progress) or in [0.1, 3600] seconds"
        ))
    }
}

/// What the binary can do besides the load generator (which its flat flags
/// run).
#[derive(Debug, clap::Subcommand)]
enum Command {
    /// Relay UDP (QUIC) through an emulated WAN: delay, jitter, loss,
    /// bursts, a rate cap, blackouts.
    ///
    /// Without netem in the kernel, this relays datagrams in userspace
    /// between clients (an edge, this load generator) and --upstream (a
    /// gateway), impairing each direction. When ready it prints one line,
    /// `impair: listening on ADDR -> UPSTREAM`: point the client at ADDR.
    /// Each client address gets its own flow to the upstream, so a client
    /// that changes port looks like a NAT rebinding. On exit (--seconds,
    /// Ctrl-C or SIGTERM) it prints the counters as JSON (offered,
    /// delivered and dropped by reason, each way) and writes them to
    /// --stats.
    ///
    /// Delay, jitter, loss, bursts and the rate cap apply to each
    /// direction; --rtt-ms is split in half each way. The same --seed and
    /// the same traffic give the same losses.
    ///
    /// Example: a 50 ms round trip, ±5 ms jitter and 1 % loss each way, and
    /// a 20 Mbit/s cap, in front of a local gateway:
    ///
    ///   tidegate-loadtest impair --upstream 127.0.0.1:4433 --rtt-ms 50 --jitter-ms 5 --loss 0.01 --rate-mbit 20
    Impair(ImpairArgs),
    /// Drive a KServe v2 server (Triton, a FastAPI server,
    /// tidegate-baseline) with the simulator's open-loop cameras.
    ///
    /// Each frame is one `POST {url}/v2/models/{model}/infer` in the binary
    /// tensor extension: the 128×128 RGB u8 astronaut frame, as the
    /// simulator sends it raw. Frames are due on the simulator's schedule
    /// (camera phases spread over a period; --in-step: all at once),
    /// whatever is outstanding, over at most --max-connections keep-alive
    /// connections; a frame that finds none free is counted
    /// `no_connection`, never queued. Every answer is checked (JSON header,
    /// each output asked for, sizes; types and shapes against `GET
    /// /v2/models/{model}` when the server gives it) and every planned
    /// frame counted once: ok within --budget-ms, late, HTTP error by
    /// status, malformed, transport error, timed out (no answer by the
    /// budget plus --grace-ms), no connection, unsent, missing (must be
    /// 0). Prints the JSON report on stdout (--report: to a file too) and
    /// a one-line summary on stderr; exits non-zero if a frame is missing.
    ///
    /// Example, against tidegate-baseline on port 8000:
    ///
    ///   tidegate-loadtest kserve --url http://127.0.0.1:8000 --cameras 20 --fps 10 --seconds 15 --report target/kserve.json
    Kserve(KserveArgs),
}

/// The flags of `tidegate-loadtest kserve`.
#[derive(Debug, clap::Args)]
struct KserveArgs {
    /// The server's base URL (http:// only).
    #[arg(long)]
    url: String,
    /// The model to ask for.
    #[arg(long, default_value = "blazeface")]
    model: String,
    /// What to call the server in the report (default: the name it gives
    /// at GET /v2, else "unknown").
    #[arg(long)]
    system: Option<String>,
    /// Simulated cameras (1 to 1024).
    #[arg(long, default_value_t = 4, value_parser = camera_count)]
    cameras: usize,
    /// Frames per second per camera.
    #[arg(long, default_value_t = 10.0)]
    fps: f64,
    /// Seconds of sending (bounded: at most 600).
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// Budget per frame (ms), from when it is due.
    #[arg(long, default_value_t = 80)]
    budget_ms: u32,
    /// How long after its budget a request is given up and counted
    /// timed out (ms); an answer before then is late.
    #[arg(long, default_value_t = kserve::load::DEFAULT_GRACE.as_millis() as u64)]
    grace_ms: u64,
    /// Every camera's frame due in the same instant (a burst a period)
    /// instead of phases spread over the period.
    #[arg(long)]
    in_step: bool,
    /// Write the JSON report here too.
    #[arg(long)]
    report: Option<PathBuf>,
    /// The model's input.
    #[arg(long, default_value = kserve::load::DEFAULT_INPUT)]
    input_name: String,
    /// The outputs to ask for, comma-separated (BlazeFace's four by
    /// default; "" for every output the server has).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "Identity:0,Identity_1:0,Identity_2:0,Identity_3:0"
    )]
    output_names: Vec<String>,
    /// The most connections open at once.
    #[arg(long, default_value_t = kserve::load::DEFAULT_MAX_CONNECTIONS, value_parser = clap::value_parser!(u32).range(1..=65_535).map(|n| n as usize))]
    max_connections: usize,
    /// Image to send (default: models/testdata/astronaut.png).
    #[arg(long)]
    image: Option<PathBuf>,
    /// The frame's size, WIDTHxHEIGHT: the model's input.
    #[arg(long, default_value = "128x128", value_parser = frame_size)]
    size: (u32, u32),
    /// Log filter.
    #[arg(long, env = "TIDEGATE_LOG", default_value = "warn")]
    log: String,
}

impl KserveArgs {
    /// The run these flags ask for.
    fn options(&self) -> anyhow::Result<KserveOptions> {
        anyhow::ensure!(
            self.seconds > 0.0 && self.seconds <= 600.0,
            "--seconds must be in (0, 600]"
        );
        anyhow::ensure!(
            loadgen::FPS_RANGE.contains(&self.fps),
            "--fps {} is not in [{}, {}]; give a rate in that range",
            self.fps,
            loadgen::FPS_RANGE.start(),
            loadgen::FPS_RANGE.end()
        );
        Ok(KserveOptions {
            url: self.url.clone(),
            model: self.model.clone(),
            system: self.system.clone(),
            cameras: self.cameras,
            fps: self.fps,
            duration: Duration::from_secs_f64(self.seconds),
            budget_ms: self.budget_ms,
            grace: Duration::from_millis(self.grace_ms),
            in_step: self.in_step,
            input_name: self.input_name.clone(),
            output_names: self
                .output_names
                .iter()
                .filter(|n| !n.is_empty())
                .cloned()
                .collect(),
            max_connections: self.max_connections,
            image: Some(
                self.image
                    .clone()
                    .unwrap_or_else(|| workspace_root().join("models/testdata/astronaut.png")),
            ),
            size: self.size,
        })
    }
}

/// Logs to stderr with `filter` (stdout carries the report).
fn log_to_stderr(filter: &str) {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_writer(std::io::stderr)
        .init();
}

/// `tidegate-loadtest kserve`: one run, its report on stdout (and in
/// --report), its summary on stderr.
fn run_kserve(args: &KserveArgs) -> anyhow::Result<()> {
    log_to_stderr(&args.log);
    let opts = args.options()?;
    let report = kserve::run_blocking(&opts)
        .with_context(|| format!("driving {} ({})", opts.url, opts.model))?;
    let json = serde_json::to_string_pretty(&report)?;
    println!("{json}");
    if let Some(p) = &args.report {
        write_atomically(p, &json).with_context(|| format!("writing {}", p.display()))?;
    }
    eprintln!("{}", report.summary());
    anyhow::ensure!(
        report.missing == 0,
        "{} frames were never accounted for (a load generator bug)",
        report.missing
    );
    Ok(())
}

/// `WIDTHxHEIGHT`, for --size.
fn frame_size(s: &str) -> Result<(u32, u32), String> {
    let bad = || format!("{s:?} is not WIDTHxHEIGHT, such as 128x128");
    let (w, h) = s.split_once(['x', 'X']).ok_or_else(bad)?;
    let (w, h): (u32, u32) = (w.parse().map_err(|_| bad())?, h.parse().map_err(|_| bad())?);
    if w == 0 || h == 0 {
        return Err(bad());
    }
    Ok((w, h))
}

/// The flags of `tidegate-loadtest impair`.
#[derive(Debug, clap::Args)]
struct ImpairArgs {
    /// Where clients send (port 0: any free port, printed on start).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Where to relay to, IP:port: the gateway's QUIC address.
    #[arg(long)]
    upstream: SocketAddr,
    /// Round-trip delay to add (ms): half on the way up, half back.
    #[arg(long, default_value_t = 0.0)]
    rtt_ms: f64,
    /// Jitter each way (ms): a packet's one-way delay varies uniformly
    /// within ± this; at most half of --rtt-ms.
    #[arg(long, default_value_t = 0.0)]
    jitter_ms: f64,
    /// Random loss each way, 0 to 1 (0.01: 1 % of the packets each way).
    #[arg(long, default_value_t = 0.0, value_parser = probability)]
    loss: f64,
    /// Bursty (Gilbert–Elliott) loss each way: the chance, per packet, of
    /// entering the bad state; with --ge-r.
    #[arg(long, requires = "ge_r", value_parser = probability)]
    ge_p: Option<f64>,
    /// The chance, per packet, of leaving the bad state (1 / the mean
    /// burst length in packets); with --ge-p.
    #[arg(long, requires = "ge_p", value_parser = probability)]
    ge_r: Option<f64>,
    /// Loss in the bad state (in the good state: none).
    #[arg(long, default_value_t = 1.0, requires = "ge_p", value_parser = probability)]
    ge_loss_bad: f64,
    /// Let jitter reorder packets; without it a packet never overtakes the
    /// one sent before it.
    #[arg(long)]
    reorder: bool,
    /// Bandwidth cap each way (Mbit/s); none without it.
    #[arg(long, value_parser = mbit)]
    rate_mbit: Option<f64>,
    /// With --rate-mbit: how long a packet may wait behind the cap before
    /// it is dropped (ms).
    #[arg(long, default_value_t = DEFAULT_QUEUE_MS, requires = "rate_mbit")]
    queue_ms: u64,
    /// Drop everything, both ways, from START_MS after start for
    /// DURATION_MS (repeatable): --blackout 5000+2000 cuts from 5 s to 7 s.
    #[arg(long, value_name = "START_MS+DURATION_MS")]
    blackout: Vec<Blackout>,
    /// Seed of every random draw (loss, bursts, jitter).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Stop after this many seconds (default: run until Ctrl-C or SIGTERM).
    #[arg(long)]
    seconds: Option<f64>,
    /// Write the counters here as JSON on exit.
    #[arg(long)]
    stats: Option<PathBuf>,
    /// Allow --listen and --upstream off this machine (not 127.0.0.0/8 or
    /// ::1), to impair a real network path.
    #[arg(long)]
    allow_non_loopback: bool,
    /// Log filter.
    #[arg(long, env = "TIDEGATE_LOG", default_value = "warn")]
    log: String,
}

impl ImpairArgs {
    /// The same impairment each way, the round trip split in half.
    fn config(&self) -> ImpairConfig {
        let burst = self.ge_p.zip(self.ge_r).map(|(p, r)| GilbertElliott {
            p_good_to_bad: p,
            p_bad_to_good: r,
            loss_good: 0.0,
            loss_bad: self.ge_loss_bad,
        });
        ImpairConfig {
            seed: self.seed,
            blackouts: self.blackout.clone(),
            ..ImpairConfig::symmetric(LinkConfig {
                delay_ms: self.rtt_ms / 2.0,
                jitter_ms: self.jitter_ms,
                loss: self.loss,
                burst,
                reorder: self.reorder,
                rate_bps: self.rate_mbit.map(|m| (m * 1e6).round() as u64),
                queue_ms: self.queue_ms,
            })
        }
    }
}

/// `tidegate-loadtest impair`: relays until --seconds, Ctrl-C or SIGTERM,
/// then prints the counters and writes --stats.
fn impair(args: &ImpairArgs) -> anyhow::Result<()> {
    log_to_stderr(&args.log);
    let config = args.config();
    config.validate().context(
        "checking the impairment flags (--rtt-ms is split in half each way; --jitter-ms, \
         --loss, --rate-mbit and --queue-ms apply to each direction)",
    )?;
    let run_for = match args.seconds {
        Some(s) if s > 0.0 && s.is_finite() => Some(Duration::from_secs_f64(s)),
        Some(s) => {
            anyhow::bail!("--seconds {s} is not a time above 0; leave it out to run until Ctrl-C")
        }
        None => None,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        // Before the address is printed: a script may stop us right after.
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .context("installing the SIGTERM handler")?;
        let relay = Relay::start(RelayOptions {
            listen: args.listen,
            upstream: args.upstream,
            config,
            allow_non_loopback: args.allow_non_loopback,
            max_flows: MAX_FLOWS,
        })
        .await?;
        println!(
            "impair: listening on {} -> {}",
            relay.local_addr(),
            args.upstream
        );
        let timer = async {
            match run_for {
                Some(d) => tokio::time::sleep(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
            () = timer => {}
        }
        let stats = relay.stop().await;
        let json = serde_json::to_string_pretty(&stats)?;
        println!("{json}");
        if let Some(p) = &args.stats {
            write_atomically(p, &json).with_context(|| format!("writing {}", p.display()))?;
        }
        Ok(())
    })
}

/// A probability in [0, 1], for the impair flags.
fn probability(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .parse()
        .map_err(|_| format!("{s:?} is not a number; give a probability such as 0.01"))?;
    if !(0.0..=1.0).contains(&v) {
        return Err(format!(
            "{s} is not a probability in [0, 1]; 0.01 means 1 % of the packets"
        ));
    }
    Ok(v)
}

/// A rate above 0 (Mbit/s), for --rate-mbit.
fn mbit(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v > 0.0 && v.is_finite() => Ok(v),
        _ => Err(format!(
            "{s:?} is not a rate above 0 Mbit/s; leave --rate-mbit out for no cap"
        )),
    }
}

/// Runs the phases of `s` in order with `base` (the command line's options)
/// for what they leave out; writes the report (and a picture per phase);
/// fails when a phase fails its gate.
fn run_scenario(
    runtime: &tokio::runtime::Runtime,
    s: &Scenario,
    base: &LoadOptions,
    cli: &Cli,
) -> anyhow::Result<()> {
    let name = s.name.clone().unwrap_or_default();
    let mut phases = Vec::with_capacity(s.phases.len());
    for p in &s.phases {
        let opts = s.options(p, base);
        tracing::warn!(
            phase = %p.name,
            cameras = opts.cameras,
            fps = opts.fps,
            seconds = p.seconds,
            model = %opts.model,
            "scenario {name:?}: phase starts"
        );
        let report = runtime
            .block_on(loadgen::run(&opts))
            .with_context(|| format!("phase {:?}", p.name))?;
        let gate = s.gate(p, cli.min_slo_attainment);
        phases.push(PhaseReport::new(&p.name, &opts.model, gate, report));
    }
    let report = ScenarioReport::new(&name, phases);
    let json = serde_json::to_string_pretty(&report)?;
    println!("{json}");
    if let Some(path) = &cli.report {
        write_atomically(path, &json).with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(svg) = &cli.svg {
        for p in &report.phases {
            let path = phase_svg(svg, &p.name);
            write_atomically(&path, tidegate_loadtest::svg::render(&p.report))
                .with_context(|| format!("writing {}", path.display()))?;
        }
    }
    let why = report.failures();
    anyhow::ensure!(why.is_empty(), "SLO gate failed: {}", why.join("; "));
    Ok(())
}

/// `dir/stem-<phase>.svg` for `--svg dir/stem.svg`, the phase name reduced
/// to letters, digits, `-` and `_`.
fn phase_svg(svg: &std::path::Path, phase: &str) -> PathBuf {
    let safe: String = phase
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    let stem = svg
        .file_stem()
        .map_or_else(|| "report".into(), |s| s.to_string_lossy());
    svg.with_file_name(format!("{stem}-{safe}.svg"))
}

/// A fraction in [0, 1], for --min-slo-attainment.
fn fraction(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .parse()
        .map_err(|_| format!("{s:?} is not a number; give a fraction such as 0.99"))?;
    if !(0.0..=1.0).contains(&v) {
        return Err(format!(
            "{s} is not a fraction in [0, 1]; 0.99 means 99 % of frames ok within budget"
        ));
    }
    Ok(v)
}

/// A camera count in `1..=MAX_CAMERAS`, for --cameras.
fn camera_count(s: &str) -> Result<usize, String> {
    let n: usize = s
        .parse()
        .map_err(|_| format!("{s:?} is not a whole number of cameras"))?;
    if !(1..=MAX_CAMERAS).contains(&n) {
        return Err(format!(
            "{n} cameras is not in 1..={MAX_CAMERAS}; simulate more with several load generators"
        ));
    }
    Ok(n)
}

/// The command line. With --local, --gateway, --ca and --token given as
/// flags are refused; set in the environment they are ignored (they name a
/// remote gateway, and --local starts its own).
impl Cli {
    /// The encoding --encoding and --jpeg-quality ask for.
    fn wire_encoding(&self) -> anyhow::Result<tidegate_protocol::Encoding> {
        use tidegate_protocol::Encoding;
        Ok(match self.encoding.as_str() {
            "raw" => Encoding::Raw,
            "png" => Encoding::Png,
            "jpeg" => Encoding::Jpeg {
                quality: self.jpeg_quality,
            },
            other => anyhow::bail!("--encoding {other}: use raw, jpeg or png"),
        })
    }
}

fn parse_cli() -> Cli {
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    if cli.local {
        for flag in ["gateway", "ca", "token"] {
            if matches.value_source(flag) == Some(ValueSource::CommandLine) {
                Cli::command()
                    .error(
                        ErrorKind::ArgumentConflict,
                        format!(
                            "--{flag} cannot be used with --local, which starts its own gateway"
                        ),
                    )
                    .exit();
            }
        }
    }
    cli
}

fn main() -> anyhow::Result<()> {
    let cli = parse_cli();
    match &cli.command {
        Some(Command::Impair(args)) => return impair(args),
        Some(Command::Kserve(args)) => return run_kserve(args),
        None => {}
    }
    log_to_stderr(&cli.log);
    anyhow::ensure!(
        cli.seconds > 0.0 && cli.seconds <= 600.0,
        "--seconds must be in (0, 600]"
    );
    anyhow::ensure!(
        loadgen::FPS_RANGE.contains(&cli.fps),
        "--fps {} is not in [{}, {}]; give a rate in that range",
        cli.fps,
        loadgen::FPS_RANGE.start(),
        loadgen::FPS_RANGE.end()
    );
    // Read before anything starts: a bad file costs no cluster.
    let scenario = cli.scenario.as_deref().map(Scenario::load).transpose()?;
    let models = match &scenario {
        Some(s) => s.models(&cli.model),
        None => vec![cli.model.clone()],
    };
    let mut cluster = None;
    let repository = model_repository(cli.models_dir.as_deref())
        .with_context(|| format!("--models-dir {:?}", cli.models_dir))?;
    let (gateway, ca, token) = if cli.local {
        let mut c = Cluster::start(&ClusterOptions {
            edges: vec![cli.edge.clone()],
            workers: (1..=cli.workers).map(|i| format!("worker-{i}")).collect(),
            worker_runtime: cli.worker_provider.runtime().into(),
            ..ClusterOptions::default()
        })?;
        let serve: Vec<&str> = models.iter().map(String::as_str).collect();
        for i in 1..=cli.workers {
            c.spawn_worker_serving(&format!("worker-{i}"), &repository, &serve)?;
        }
        c.wait_for_workers(cli.workers, Duration::from_secs(60))?;
        eprintln!(
            "gateway: quic {}, status page http://{http}/, metrics http://{http}/metrics, API http://{http}/api/v1/",
            c.quic,
            http = c.http
        );
        let out = (GatewayAddr::from(c.quic), c.ca(), c.edge_token.clone());
        cluster = Some(c);
        out
    } else {
        (
            cli.gateway.clone().context("--gateway is required")?,
            cli.ca.clone().context("--ca is required")?,
            cli.token.clone().context("--token is required")?,
        )
    };
    let opts = LoadOptions {
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
                .unwrap_or_else(|| repository.join("testdata/astronaut.png")),
        ),
        obey_hints: !cli.ignore_hints,
        encoding: cli.wire_encoding()?,
        congestion: cli.congestion,
        copies: cli.copies,
        in_step: cli.in_step,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    if let Some(s) = &scenario {
        let result = run_scenario(&runtime, s, &opts, &cli);
        drop(cluster);
        return result;
    }
    let every = (cli.progress > 0.0).then(|| Duration::from_secs_f64(cli.progress));
    let report = runtime.block_on(loadgen::run_with_progress(&opts, every))?;
    let json = serde_json::to_string_pretty(&report)?;
    println!("{json}");
    if let Some(p) = &cli.report {
        write_atomically(p, &json).with_context(|| format!("writing {}", p.display()))?;
    }
    if let Some(p) = &cli.svg {
        write_atomically(p, tidegate_loadtest::svg::render(&report))
            .with_context(|| format!("writing {}", p.display()))?;
    }
    if let (true, Some(c)) = (cli.keep_up, &cluster) {
        // caught before it is announced: a SIGTERM right after the line
        // below ends the wait, not the process (which would leave its
        // cluster running)
        let stop = {
            let _in = runtime.enter();
            tidegate_kit::signal::Stop::install().context("installing the signal handlers")?
        };
        eprintln!(
            "keeping the cluster up: status page http://{http}/, metrics http://{http}/metrics; Ctrl-C or SIGTERM ends it",
            http = c.http
        );
        runtime.block_on(stop.wait());
    }
    drop(cluster);
    if let Some(min) = cli.min_slo_attainment {
        let why = report.slo_failures(min);
        anyhow::ensure!(why.is_empty(), "SLO gate failed: {}", why.join("; "));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_camera_count_outside_what_a_scenario_allows_is_refused() {
        assert_eq!(camera_count("1"), Ok(1));
        assert_eq!(camera_count("1024"), Ok(MAX_CAMERAS));
        for bad in ["0", "1025", "18446744073709551615", "-1", "many"] {
            let err = camera_count(bad).unwrap_err();
            assert!(err.contains(bad), "{bad}: {err}");
        }
        assert!(camera_count("1025").unwrap_err().contains("1..=1024"));
        // Through clap, as the binary parses it.
        let err =
            Cli::try_parse_from(["tidegate-loadtest", "--local", "--cameras", "5000"]).unwrap_err();
        assert!(err.to_string().contains("--cameras"), "{err}");
        let cli = Cli::try_parse_from(["tidegate-loadtest", "--local"]).unwrap();
        assert_eq!(cli.cameras, 4);
    }

    #[test]
    fn impair_flags_split_the_round_trip_and_apply_the_rest_each_way() {
        let cli = Cli::try_parse_from([
            "tidegate-loadtest",
            "impair",
            "--upstream",
            "127.0.0.1:4433",
            "--rtt-ms",
            "50",
            "--jitter-ms",
            "5",
            "--loss",
            "0.01",
            "--ge-p",
            "0.02",
            "--ge-r",
            "0.5",
            "--rate-mbit",
            "20",
            "--blackout",
            "5000+2000",
            "--blackout",
            "9000+1",
            "--seed",
            "9",
        ])
        .unwrap();
        let Some(Command::Impair(args)) = &cli.command else {
            panic!("{cli:?}");
        };
        let config = args.config();
        config.validate().unwrap();
        assert_eq!(config.uplink, config.downlink);
        let link = &config.uplink;
        assert_eq!(
            (link.delay_ms, link.jitter_ms, link.loss),
            (25.0, 5.0, 0.01)
        );
        assert_eq!(link.rate_bps, Some(20_000_000));
        assert_eq!(link.queue_ms, DEFAULT_QUEUE_MS);
        let ge = link.burst.as_ref().unwrap();
        assert_eq!(
            (ge.p_good_to_bad, ge.p_bad_to_good, ge.loss_bad),
            (0.02, 0.5, 1.0)
        );
        assert_eq!(config.blackouts.len(), 2);
        assert_eq!(config.seed, 9);
        // The load generator's flags are not taken with it.
        let err = Cli::try_parse_from([
            "tidegate-loadtest",
            "--cameras",
            "2",
            "impair",
            "--upstream",
            "127.0.0.1:4433",
        ])
        .unwrap_err();
        assert!(err.to_string().contains("impair"), "{err}");
    }

    #[test]
    fn kserve_flags_become_the_run_they_ask_for() {
        let cli = Cli::try_parse_from([
            "tidegate-loadtest",
            "kserve",
            "--url",
            "http://127.0.0.1:8000",
            "--cameras",
            "20",
            "--fps",
            "12.5",
            "--seconds",
            "15",
            "--in-step",
            "--output-names",
            "a,b",
            "--max-connections",
            "64",
            "--size",
            "64x32",
        ])
        .unwrap();
        let Some(Command::Kserve(args)) = &cli.command else {
            panic!("{cli:?}");
        };
        let o = args.options().unwrap();
        assert_eq!((o.cameras, o.fps, o.in_step), (20, 12.5, true));
        assert_eq!(o.duration, Duration::from_secs(15));
        assert_eq!((o.budget_ms, o.grace), (80, kserve::load::DEFAULT_GRACE));
        assert_eq!(o.output_names, ["a", "b"]);
        assert_eq!((o.max_connections, o.size), (64, (64, 32)));
        assert_eq!(o.input_name, "input:0");
        assert!(o.image.unwrap().ends_with("models/testdata/astronaut.png"));
        // The defaults: BlazeFace's outputs; "" asks for every output.
        let cli =
            Cli::try_parse_from(["tidegate-loadtest", "kserve", "--url", "http://h:1"]).unwrap();
        let Some(Command::Kserve(args)) = &cli.command else {
            panic!("{cli:?}");
        };
        assert_eq!(args.options().unwrap().output_names.len(), 4);
        let cli = Cli::try_parse_from([
            "tidegate-loadtest",
            "kserve",
            "--url",
            "http://h:1",
            "--output-names",
            "",
        ])
        .unwrap();
        let Some(Command::Kserve(args)) = &cli.command else {
            panic!("{cli:?}");
        };
        assert!(args.options().unwrap().output_names.is_empty());
        for bad in [
            &["--max-connections", "0"][..],
            &["--size", "128"],
            &["--size", "0x128"],
            &["--cameras", "0"],
        ] {
            let argv = ["tidegate-loadtest", "kserve", "--url", "http://h:1"]
                .iter()
                .chain(bad);
            assert!(Cli::try_parse_from(argv).is_err(), "{bad:?}");
        }
        // --url is required.
        assert!(Cli::try_parse_from(["tidegate-loadtest", "kserve"]).is_err());
    }

    #[test]
    fn local_workers_run_on_the_provider_asked_for() {
        let cli = Cli::try_parse_from(["tidegate-loadtest", "--local"]).unwrap();
        assert_eq!(cli.worker_provider, WorkerProvider::Cpu);
        assert_eq!(cli.worker_provider.runtime(), "intra_threads = 1\n");
        let cli = Cli::try_parse_from([
            "tidegate-loadtest",
            "--local",
            "--worker-provider",
            "cuda",
            "--models-dir",
            "/kit/models",
        ])
        .unwrap();
        assert_eq!(cli.worker_provider.runtime(), "provider = \"cuda\"\n");
        assert_eq!(cli.models_dir, Some(PathBuf::from("/kit/models")));
        let err = Cli::try_parse_from(["tidegate-loadtest", "--local", "--worker-provider", "tpu"])
            .unwrap_err();
        assert!(err.to_string().contains("tpu"), "{err}");
        // Workers are only started with --local; the default, not given,
        // does not need it.
        let remote = [
            "tidegate-loadtest",
            "--gateway",
            "127.0.0.1:4433",
            "--ca",
            "ca.pem",
            "--token",
            "t",
        ];
        Cli::try_parse_from(remote).unwrap();
        let with_provider = remote.iter().chain(&["--worker-provider", "cuda"]);
        let err = Cli::try_parse_from(with_provider).unwrap_err();
        assert!(err.to_string().contains("--local"), "{err}");
    }
}
