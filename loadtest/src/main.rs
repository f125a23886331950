//! `tidegate-loadtest`: simulated cameras against a tidegate gateway, with a
//! JSON report and an SLO gate.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::error::ErrorKind;
use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches, Parser};
use tidegate_loadtest::cluster::{Cluster, ClusterOptions, workspace_root};
use tidegate_loadtest::report::write_atomically;
use tidegate_loadtest::scenario::{MAX_CAMERAS, PhaseReport, Scenario, ScenarioReport};
use tidegate_loadtest::sim::{self, SimOptions};
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
#[derive(Debug, Parser)]
#[command(version, about, long_about)]
struct Cli {
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
    /// Log filter.
    #[arg(long, env = "TIDEGATE_LOG", default_value = "warn")]
    log: String,
}

/// Runs the phases of `s` in order with `base` (the command line's options)
/// for what they leave out; writes the report (and a picture per phase);
/// fails when a phase fails its gate.
fn run_scenario(
    runtime: &tokio::runtime::Runtime,
    s: &Scenario,
    base: &SimOptions,
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
            .block_on(sim::run(&opts))
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

/// What the --local workers run their models on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum WorkerProvider {
    Cpu,
    Cuda,
}

impl WorkerProvider {
    /// The worker config's `[runtime]` lines.
    fn runtime(self) -> &'static str {
        match self {
            WorkerProvider::Cpu => "intra_threads = 1\n",
            WorkerProvider::Cuda => "provider = \"cuda\"\n",
        }
    }
}

/// The command line. With --local, --gateway, --ca and --token given as
/// flags are refused; set in the environment they are ignored (they name a
/// remote gateway, and --local starts its own).
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
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(&cli.log))
        .with_writer(std::io::stderr)
        .init();
    anyhow::ensure!(
        cli.seconds > 0.0 && cli.seconds <= 600.0,
        "--seconds must be in (0, 600]"
    );
    anyhow::ensure!(
        sim::FPS_RANGE.contains(&cli.fps),
        "--fps {} is not in [{}, {}]; give a rate in that range",
        cli.fps,
        sim::FPS_RANGE.start(),
        sim::FPS_RANGE.end()
    );
    // Read before anything starts: a bad file costs no cluster.
    let scenario = cli.scenario.as_deref().map(Scenario::load).transpose()?;
    let models = match &scenario {
        Some(s) => s.models(&cli.model),
        None => vec![cli.model.clone()],
    };
    let mut cluster = None;
    // Absolute: the workers read it from a config in another folder.
    let repository = match &cli.models_dir {
        Some(dir) => {
            std::path::absolute(dir).with_context(|| format!("--models-dir {}", dir.display()))?
        }
        None => workspace_root().join("models"),
    };
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
                .unwrap_or_else(|| repository.join("testdata/astronaut.png")),
        ),
        obey_hints: !cli.ignore_hints,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    if let Some(s) = &scenario {
        let result = run_scenario(&runtime, s, &opts, &cli);
        drop(cluster);
        return result;
    }
    let report = runtime.block_on(sim::run(&opts))?;
    let json = serde_json::to_string_pretty(&report)?;
    println!("{json}");
    if let Some(p) = &cli.report {
        write_atomically(p, &json).with_context(|| format!("writing {}", p.display()))?;
    }
    if let Some(p) = &cli.svg {
        write_atomically(p, tidegate_loadtest::svg::render(&report))
            .with_context(|| format!("writing {}", p.display()))?;
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
