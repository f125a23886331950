//! A local tidegate cluster of real processes on 127.0.0.1: a gateway on
//! ephemeral ports, workers and edges, with throw-away certificates and
//! tokens in a temporary directory. Used by the integration tests and by
//! `tidegate-loadtest --local`. Every child is killed on drop.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::loadgen::LoadOptions;

/// A tidegate binary is not where [`bin_dir`] says the binaries are.
#[derive(Debug, thiserror::Error)]
#[error("{path} not found; build the binaries first: cargo build --workspace --bins")]
#[non_exhaustive]
pub struct BinaryNotFound {
    /// Where it was looked for.
    pub path: PathBuf,
}

/// Why a [`Cluster`] operation (starting or restarting the gateway,
/// starting, signalling or waiting for a worker, running an edge, stopping)
/// failed. An error about a child process carries its log.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum ClusterError {
    /// A tidegate binary is missing.
    #[error(transparent)]
    Binary(#[from] BinaryNotFound),
    /// The temporary directory for certificates, configs and logs could
    /// not be made.
    #[error(
        "creating a temporary directory for the cluster: {source}; check TMPDIR and free space"
    )]
    TempDir {
        /// The I/O error.
        source: std::io::Error,
    },
    /// A config, log or other file in the cluster's directory could not be
    /// written.
    #[error("cannot write {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A file in the cluster's directory could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A child process could not be started.
    #[error("cannot start {program}: {source}")]
    Spawn {
        /// What was started (`tidegate-worker`, `tidegate-gateway dev-certs`, ...).
        program: &'static str,
        /// The I/O error.
        source: std::io::Error,
    },
    /// `tidegate-gateway dev-certs` ran and failed (its stderr says why).
    #[error("tidegate-gateway dev-certs failed ({status}); its stderr above says why")]
    DevCerts {
        /// How it exited.
        status: std::process::ExitStatus,
    },
    /// The gateway did not print a usable listening line (it exited, hung
    /// or printed something else); it has been killed.
    #[error("{reason}; gateway log:\n{log}")]
    GatewayStart {
        /// What went wrong with the listening line.
        reason: String,
        /// The gateway's log.
        log: String,
    },
    /// A restarted gateway did not get its old QUIC port back.
    #[error(
        "restarted gateway listens on {got}, expected {expected}; the old port was taken by another process"
    )]
    RestartedElsewhere {
        /// Where it listens now.
        got: SocketAddr,
        /// Where it listened before.
        expected: SocketAddr,
    },
    /// No worker of that name was started by this cluster.
    #[error("no worker named {name} in this cluster; start it with spawn_worker first")]
    NoWorker {
        /// The name asked for.
        name: String,
    },
    /// The signal's name is not one `kill -s` takes.
    #[error("signalling {who}: {source}")]
    UnknownSignal {
        /// Which process.
        who: String,
        /// The name given.
        source: tidegate_kit::signal::UnknownSignal,
    },
    /// The signal could not be sent (the process is gone, say); the
    /// source names the signal and the pid.
    #[error("signalling {who}: {source}")]
    Signal {
        /// Which process.
        who: String,
        /// Why, with the signal and the pid.
        source: tidegate_kit::signal::SignalError,
    },
    /// The state of a child process could not be read.
    #[error("waiting for {who}: {source}")]
    Wait {
        /// Which process.
        who: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A worker exited while the cluster waited for it to register.
    #[error("worker {name} exited with {status}; its log:\n{log}")]
    WorkerExited {
        /// The worker.
        name: String,
        /// How it exited.
        status: std::process::ExitStatus,
        /// Its log.
        log: String,
    },
    /// The workers did not all register in time.
    #[error("fewer than {n} workers registered after {timeout:?}; gateway log:\n{log}")]
    WorkersNotRegistered {
        /// Workers waited for.
        n: usize,
        /// How long.
        timeout: Duration,
        /// The gateway's log.
        log: String,
    },
    /// A worker started with `--metrics-listen` never said where.
    #[error(
        "worker {name} did not print `metrics listening on ADDR` within {timeout:?}; its log:\n{log}"
    )]
    NoMetricsAddr {
        /// The worker.
        name: String,
        /// How long.
        timeout: Duration,
        /// Its log.
        log: String,
    },
    /// `GET /api/v1/workers` answered 200 with something other than JSON.
    #[error("GET /api/v1/workers answered 200 but not JSON ({source}): {body}")]
    WorkersNotJson {
        /// The JSON error.
        source: serde_json::Error,
        /// What it answered.
        body: String,
    },
    /// The gateway did not exit after SIGTERM; it has been killed.
    #[error(
        "the gateway did not exit within {timeout:?} of SIGTERM (it was killed); gateway log:\n{log}"
    )]
    StopTimeout {
        /// How long it was given.
        timeout: Duration,
        /// The gateway's log.
        log: String,
    },
}

debug_as_display!(ClusterError);

/// Why a request to the gateway's HTTP API failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HttpError {
    /// Connecting, sending or reading failed.
    #[error("{method} {path} on the gateway at {addr}: {source}; is the gateway running?")]
    Io {
        /// The request method.
        method: &'static str,
        /// The request path.
        path: String,
        /// The gateway's HTTP address.
        addr: SocketAddr,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The answer has no HTTP status line.
    #[error("{method} {path} on the gateway at {addr}: bad HTTP response: {text:?}")]
    BadResponse {
        /// The request method.
        method: &'static str,
        /// The request path.
        path: String,
        /// The gateway's HTTP address.
        addr: SocketAddr,
        /// What came back.
        text: String,
    },
}

/// `s` as a TOML basic string: a JSON string's escapes (`\"`, `\\`,
/// `\n`, `\uXXXX`) are TOML's too.
fn toml_string(s: &str) -> String {
    serde_json::Value::String(s.to_string()).to_string()
}

/// `std::fs::write`, naming the file in the error.
fn write_file(path: &Path, text: impl AsRef<[u8]>) -> Result<(), ClusterError> {
    std::fs::write(path, text).map_err(|source| ClusterError::Write {
        path: path.to_path_buf(),
        source,
    })
}

/// Where the tidegate binaries are: `TIDEGATE_BIN_DIR`, else next to the
/// running executable (`target/<profile>/`, also from `deps/`).
pub fn bin_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("TIDEGATE_BIN_DIR") {
        return PathBuf::from(d);
    }
    let exe = std::env::current_exe().expect("current executable path");
    let mut dir = exe.parent().expect("executable has a folder").to_path_buf();
    if dir.file_name().is_some_and(|n| n == "deps") {
        dir.pop();
    }
    dir
}

/// The path of binary `name`, or an error that says how to build it.
pub fn bin(name: &str) -> Result<PathBuf, BinaryNotFound> {
    let path = bin_dir().join(name);
    if !path.exists() {
        return Err(BinaryNotFound { path });
    }
    Ok(path)
}

/// Environment variables that describe a deployment: where the gateway
/// is, whom to trust, tokens, leases, models, listen addresses, configs.
/// The harness's children never inherit them from the caller's shell: a
/// local cluster is described entirely by the configs and flags the
/// harness writes (and a listen address from the shell would put the
/// gateway off 127.0.0.1:0).
const DEPLOYMENT_ENV: [&str; 12] = [
    "TIDEGATE_GATEWAY_ADDR",
    "TIDEGATE_CA",
    "TIDEGATE_EDGE_TOKEN",
    "TIDEGATE_WORKER_TOKEN",
    "TIDEGATE_LEASE_ID",
    "TIDEGATE_LEASE_TOKEN",
    "TIDEGATE_MODELS",
    "TIDEGATE_QUIC_LISTEN",
    "TIDEGATE_HTTP_LISTEN",
    "TIDEGATE_GATEWAY_CONFIG",
    "TIDEGATE_WORKER_CONFIG",
    "TIDEGATE_EDGE_CONFIG",
];

/// A command for binary `name` (see [`bin`]) that does not inherit the
/// caller's deployment variables (`DEPLOYMENT_ENV`).
pub fn command(name: &str) -> Result<Command, BinaryNotFound> {
    let mut cmd = Command::new(bin(name)?);
    for var in DEPLOYMENT_ENV {
        cmd.env_remove(var);
    }
    Ok(cmd)
}

/// The value of series `name` in a Prometheus text exposition, summed over
/// its label sets that carry every one of `labels` (`le="2"`, say; none:
/// all of them).
pub fn metric_sum(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            let (series, value) = rest.rsplit_once(' ')?;
            let named = series.is_empty() || series.starts_with('{');
            (named && labels.iter().all(|want| series.contains(want))).then_some(value)
        })
        .filter_map(|v| v.parse::<f64>().ok())
        .sum()
}

/// The value of one series, its name and labels exactly as exported
/// (`x_total{reason="a"}`), in a Prometheus text exposition; `None` when it
/// has none.
pub fn metric_value(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        l.strip_prefix(series)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}

/// The model repository a `--models-dir` names, made absolute (the workers
/// read it from configs in another folder), or this checkout's models/.
pub fn model_repository(dir: Option<&Path>) -> std::io::Result<PathBuf> {
    match dir {
        Some(dir) => std::path::absolute(dir),
        None => Ok(workspace_root().join("models")),
    }
}

/// The workspace root (for models/ and test imagery).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("loadtest sits in the workspace")
        .to_path_buf()
}

fn random_token() -> String {
    let mut b = [0u8; 16];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        let _ = f.read_exact(&mut b);
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    format!(
        "{}{nanos:x}",
        b.iter().map(|x| format!("{x:02x}")).collect::<String>()
    )
}

/// Sends `signal` (a `kill -s` name: TERM, KILL, STOP, CONT, HUP, ...) to
/// `pid` through `kill(2)`; `who` names the process in the error.
fn kill(pid: u32, signal: &str, who: &str) -> Result<(), ClusterError> {
    let signal = signal
        .parse()
        .map_err(|source| ClusterError::UnknownSignal {
            who: who.into(),
            source,
        })?;
    tidegate_kit::signal::send(pid, signal).map_err(|source| ClusterError::Signal {
        who: who.into(),
        source,
    })
}

/// The address in the first `metrics listening on ADDR` line that `log`
/// (re-read every 100 ms) shows within `timeout`, as a worker or an edge
/// started with `--metrics-listen` prints it; else the log as it was.
pub(crate) fn metrics_addr_in(
    log: impl Fn() -> String,
    timeout: Duration,
) -> Result<SocketAddr, String> {
    let until = Instant::now() + timeout;
    loop {
        let text = log();
        if let Some(addr) = text.lines().find_map(|l| {
            l.strip_prefix("metrics listening on ")
                .and_then(|a| a.trim().parse().ok())
        }) {
            return Ok(addr);
        }
        if Instant::now() >= until {
            return Err(text);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A running gateway with its workers.
#[derive(Debug)]
pub struct Cluster {
    dir: tempfile::TempDir,
    /// Gateway QUIC address.
    pub quic: SocketAddr,
    /// Gateway HTTP address.
    pub http: SocketAddr,
    gateway: Child,
    workers: Vec<(String, Child)>,
    /// Token of the edge named `edge-1` (and of every edge in `edges`).
    pub edge_token: String,
    /// Token of the workers.
    worker_token: String,
    /// The admin token the mutating API routes need.
    pub admin_token: String,
    /// `ClusterOptions::worker_runtime`.
    worker_runtime: String,
}

/// What a local cluster's workers run their models on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum WorkerProvider {
    /// ONNX Runtime's CPU provider, one intra-op thread a worker.
    Cpu,
    /// The worker's `runtime.provider = "cuda"` (ONNX Runtime from
    /// `ORT_DYLIB_PATH`; for a GPU machine).
    Cuda,
}

impl WorkerProvider {
    /// The worker config's `[runtime]` lines
    /// ([`ClusterOptions::worker_runtime`]).
    pub fn runtime(self) -> &'static str {
        match self {
            WorkerProvider::Cpu => "intra_threads = 1\n",
            WorkerProvider::Cuda => "provider = \"cuda\"\n",
        }
    }
}

/// What to start.
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    /// Edge names the gateway accepts (all share one token).
    pub edges: Vec<String>,
    /// Worker names the gateway accepts.
    pub workers: Vec<String>,
    /// Extra `[scheduler]` lines for the gateway config.
    pub scheduler: String,
    /// The `[runtime]` lines of the worker configs the cluster writes.
    pub worker_runtime: String,
    /// The gateway config's `[limits]` lines (none: its defaults).
    pub limits: String,
    /// Extra `[http]` lines for the gateway config (its header-read
    /// timeout and connection cap, say).
    pub http: String,
}

impl Default for ClusterOptions {
    fn default() -> Self {
        ClusterOptions {
            edges: vec!["edge-1".into()],
            workers: vec!["worker-1".into()],
            scheduler: String::new(),
            worker_runtime: WorkerProvider::Cpu.runtime().into(),
            limits: String::new(),
            http: String::new(),
        }
    }
}

impl Cluster {
    /// Starts a gateway (not yet any worker).
    pub fn start(opts: &ClusterOptions) -> Result<Cluster, ClusterError> {
        Self::launch(opts, |_| Ok(String::new()))
    }

    /// Makes certificates and tokens in a new temporary directory, writes
    /// the gateway config (`extra`, given the directory, adds sections after
    /// `[scheduler]`) and starts the gateway.
    fn launch(
        opts: &ClusterOptions,
        extra: impl FnOnce(&Path) -> Result<String, ClusterError>,
    ) -> Result<Cluster, ClusterError> {
        let dir = tempfile::tempdir().map_err(|source| ClusterError::TempDir { source })?;
        let status = command("tidegate-gateway")?
            .args(["dev-certs", "--out"])
            .arg(dir.path().join("certs"))
            .stdout(Stdio::null())
            .status()
            .map_err(|source| ClusterError::Spawn {
                program: "tidegate-gateway dev-certs",
                source,
            })?;
        if !status.success() {
            return Err(ClusterError::DevCerts { status });
        }
        let edge_token = random_token();
        let worker_token = random_token();
        let admin_token = random_token();
        let hash = tidegate_gateway::auth::hash_token;
        let mut toml = format!(
            "[quic]\nlisten = \"127.0.0.1:0\"\ncert = \"certs/gateway.pem\"\nkey = \"certs/gateway.key\"\n[http]\nlisten = \"127.0.0.1:0\"\nadmin_token_sha256 = \"{}\"\n{}\n[scheduler]\n{}\n{}",
            hash(&admin_token),
            opts.http,
            opts.scheduler,
            extra(dir.path())?
        );
        for e in &opts.edges {
            toml += &format!(
                "[[edges]]\nname = \"{e}\"\ntoken_sha256 = \"{}\"\n",
                hash(&edge_token)
            );
        }
        for w in &opts.workers {
            toml += &format!(
                "[[workers]]\nname = \"{w}\"\ntoken_sha256 = \"{}\"\n",
                hash(&worker_token)
            );
        }
        if !opts.limits.is_empty() {
            toml += &format!("[limits]\n{}\n", opts.limits);
        }
        let cfg = dir.path().join("gateway.toml");
        write_file(&cfg, toml)?;
        let log_path = dir.path().join("gateway.log");
        let log = std::fs::File::create(&log_path).map_err(|source| ClusterError::Write {
            path: log_path,
            source,
        })?;
        let (gateway, quic, http) = spawn_gateway(dir.path(), &cfg, log)?;
        Ok(Cluster {
            dir,
            quic,
            http,
            gateway,
            workers: Vec::new(),
            edge_token,
            worker_token,
            admin_token,
            worker_runtime: opts.worker_runtime.clone(),
        })
    }

    /// The temporary directory holding certs, configs and logs.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The CA certificate clients trust.
    pub fn ca(&self) -> PathBuf {
        self.dir.path().join("certs/ca.pem")
    }

    /// The gateway's log so far.
    pub fn gateway_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("gateway.log")).unwrap_or_default()
    }

    /// Writes a worker config serving `models` from `models_dir`.
    pub fn worker_config(
        &self,
        name: &str,
        models_dir: &Path,
        models: &[&str],
    ) -> Result<PathBuf, ClusterError> {
        let only: Vec<String> = models.iter().map(|m| format!("\"{m}\"")).collect();
        let path = self.dir.path().join(format!("{name}.toml"));
        write_file(
            &path,
            format!(
                "name = \"{name}\"\n[gateway]\naddr = \"{}\"\nca = \"certs/ca.pem\"\n[models]\ndir = \"{}\"\nonly = [{}]\n[runtime]\n{}",
                self.quic,
                models_dir.display(),
                only.join(", "),
                self.worker_runtime
            ),
        )?;
        Ok(path)
    }

    /// Starts a worker serving BlazeFace from the repository's models/.
    pub fn spawn_worker(&mut self, name: &str) -> Result<(), ClusterError> {
        self.spawn_worker_serving(name, &workspace_root().join("models"), &["blazeface"])
    }

    /// Starts a worker serving `models` from the repository `models_dir`.
    pub fn spawn_worker_serving(
        &mut self,
        name: &str,
        models_dir: &Path,
        models: &[&str],
    ) -> Result<(), ClusterError> {
        self.spawn_worker_with(name, models_dir, models, &[])
    }

    /// Starts a worker serving BlazeFace with `args` added to its command
    /// line (`--metrics-listen 127.0.0.1:0`, say). Its stdout and stderr
    /// both go to its log ([`Cluster::worker_log`]).
    pub fn spawn_worker_with_args(
        &mut self,
        name: &str,
        args: &[&str],
    ) -> Result<(), ClusterError> {
        self.spawn_worker_with(name, &workspace_root().join("models"), &["blazeface"], args)
    }

    /// Starts a worker serving BlazeFace with `env` added to its
    /// environment (`TIDEGATE_STAND_IN`, say).
    pub fn spawn_worker_with_env(
        &mut self,
        name: &str,
        env: &[(&str, &str)],
    ) -> Result<(), ClusterError> {
        let models = workspace_root().join("models");
        self.spawn_worker_in(name, &models, &["blazeface"], &[], env)
    }

    fn spawn_worker_with(
        &mut self,
        name: &str,
        models_dir: &Path,
        models: &[&str],
        args: &[&str],
    ) -> Result<(), ClusterError> {
        self.spawn_worker_in(name, models_dir, models, args, &[])
    }

    fn spawn_worker_in(
        &mut self,
        name: &str,
        models_dir: &Path,
        models: &[&str],
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Result<(), ClusterError> {
        let cfg = self.worker_config(name, models_dir, models)?;
        let log_path = self.dir.path().join(format!("{name}.log"));
        let log = std::fs::File::create(&log_path).map_err(|source| ClusterError::Write {
            path: log_path.clone(),
            source,
        })?;
        let out = log.try_clone().map_err(|source| ClusterError::Write {
            path: log_path,
            source,
        })?;
        let child = command("tidegate-worker")?
            .arg("--config")
            .arg(cfg)
            .args(args)
            .env("TIDEGATE_WORKER_TOKEN", &self.worker_token)
            .env("TIDEGATE_LOG", "info")
            .env_remove("TIDEGATE_METRICS_LISTEN")
            .envs(env.iter().copied())
            .stdout(out)
            .stderr(log)
            .spawn()
            .map_err(|source| ClusterError::Spawn {
                program: "tidegate-worker",
                source,
            })?;
        self.workers.push((name.to_string(), child));
        Ok(())
    }

    /// The worker token (for tests that start workers by hand).
    pub fn worker_token(&self) -> &str {
        &self.worker_token
    }

    /// A worker's log so far.
    pub fn worker_log(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.path().join(format!("{name}.log"))).unwrap_or_default()
    }

    /// Where a worker started with `--metrics-listen` serves `/metrics`,
    /// read from its `metrics listening on ADDR` line within `timeout`.
    pub fn worker_metrics_addr(
        &self,
        name: &str,
        timeout: Duration,
    ) -> Result<SocketAddr, ClusterError> {
        metrics_addr_in(|| self.worker_log(name), timeout).map_err(|log| {
            ClusterError::NoMetricsAddr {
                name: name.to_string(),
                timeout,
                log,
            }
        })
    }

    /// Sends `signal` (a `kill -s` name: STOP, CONT, TERM, ...) to a worker.
    pub fn signal_worker(&self, name: &str, signal: &str) -> Result<(), ClusterError> {
        let (_, c) = self
            .workers
            .iter()
            .find(|(n, _)| n == name)
            .ok_or_else(|| ClusterError::NoWorker { name: name.into() })?;
        kill(c.id(), signal, &format!("worker {name}"))
    }

    /// Sends `signal` (HUP reloads its config) to the gateway.
    pub fn signal_gateway(&self, signal: &str) -> Result<(), ClusterError> {
        kill(self.gateway.id(), signal, "the gateway")
    }

    /// The gateway's config file; tests rewrite it and reload.
    pub fn gateway_config(&self) -> PathBuf {
        self.dir.path().join("gateway.toml")
    }

    /// The gateway's process id (to read its memory in /proc, say).
    pub fn gateway_pid(&self) -> u32 {
        self.gateway.id()
    }

    /// The process id of worker `name`, while the harness holds it.
    pub fn worker_pid(&self, name: &str) -> Option<u32> {
        self.workers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, c)| c.id())
    }

    /// Waits until `n` workers are registered, or fails with their logs.
    pub fn wait_for_workers(&mut self, n: usize, timeout: Duration) -> Result<(), ClusterError> {
        let until = Instant::now() + timeout;
        loop {
            if let Ok((200, body)) = self.get("/api/v1/workers") {
                let v: serde_json::Value = match serde_json::from_str(&body) {
                    Ok(v) => v,
                    Err(source) => return Err(ClusterError::WorkersNotJson { source, body }),
                };
                if v.as_array().map_or(0, Vec::len) >= n {
                    return Ok(());
                }
            }
            for (name, c) in &mut self.workers {
                if let Ok(Some(status)) = c.try_wait() {
                    return Err(ClusterError::WorkerExited {
                        name: name.clone(),
                        status,
                        log: std::fs::read_to_string(self.dir.path().join(format!("{name}.log")))
                            .unwrap_or_default(),
                    });
                }
            }
            if Instant::now() > until {
                return Err(ClusterError::WorkersNotRegistered {
                    n,
                    timeout,
                    log: self.gateway_log(),
                });
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Simulated cameras of edge `edge` against this cluster: `cameras` ×
    /// `fps` for `seconds`, sending astronaut.png to BlazeFace with an
    /// 80 ms budget and obeying the gateway's frame-rate hints.
    pub fn load_options(&self, edge: &str, cameras: usize, fps: f64, seconds: f64) -> LoadOptions {
        LoadOptions {
            gateway: self.quic.into(),
            server_name: "localhost".into(),
            ca: self.ca(),
            edge: edge.into(),
            token: self.edge_token.clone(),
            cameras,
            fps,
            duration: Duration::from_secs_f64(seconds),
            model: "blazeface".into(),
            budget_ms: 80,
            image: Some(workspace_root().join("models/testdata/astronaut.png")),
            obey_hints: true,
            // Raw, as on a LAN: these runs measure the gateway and the
            // workers, not a link (the WAN tests and bench set JPEG).
            encoding: tidegate_protocol::Encoding::Raw,
            congestion: tidegate_protocol::quic::Congestion::default(),
            copies: 1,
            // In step: the tests written on this cluster keep several
            // workers busy with each period's burst.
            in_step: true,
        }
    }

    /// HTTP GET on the gateway's API: (status, body).
    pub fn get(&self, path: &str) -> Result<(u16, String), HttpError> {
        http_request(self.http, "GET", path, "")
    }

    /// `POST path` (empty body) on the gateway's HTTP API, with `token` as
    /// the bearer token: status and body.
    pub fn post(&self, path: &str, token: Option<&str>) -> Result<(u16, String), HttpError> {
        let auth = token.map_or_else(String::new, |t| format!("Authorization: Bearer {t}\r\n"));
        http_request(
            self.http,
            "POST",
            path,
            &format!("Content-Length: 0\r\n{auth}"),
        )
    }

    /// The exit status of worker `name`, once it has exited by itself.
    pub fn worker_exit(&mut self, name: &str) -> Option<std::process::ExitStatus> {
        let (_, child) = self.workers.iter_mut().find(|(n, _)| n == name)?;
        child.try_wait().ok().flatten()
    }

    /// Runs an edge to completion with `args` and returns its output.
    pub fn run_edge(&self, config: &Path, args: &[&str]) -> Result<Output, ClusterError> {
        self.run_edge_with_env(config, args, &[])
    }

    /// [`Cluster::run_edge`] with `env` set too.
    pub fn run_edge_with_env(
        &self,
        config: &Path,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Result<Output, ClusterError> {
        command("tidegate-edge")?
            .arg("--config")
            .arg(config)
            .args(args)
            .env("TIDEGATE_EDGE_TOKEN", &self.edge_token)
            .env("TIDEGATE_LOG", "warn")
            .envs(env.iter().copied())
            .output()
            .map_err(|source| ClusterError::Spawn {
                program: "tidegate-edge",
                source,
            })
    }

    /// Kills the gateway abruptly (SIGKILL), as a crash would; its clients
    /// get no CONNECTION_CLOSE.
    pub fn kill_gateway(&mut self) {
        let _ = self.gateway.kill();
        let _ = self.gateway.wait();
    }

    /// Starts the gateway again (killing it first if it still runs) on the
    /// same QUIC and HTTP ports, with the same certificates, edges, workers
    /// and tokens. Its log is appended to the same `gateway.log`.
    pub fn restart_gateway(&mut self) -> Result<(), ClusterError> {
        self.kill_gateway();
        let old = self.dir.path().join("gateway.toml");
        let text = std::fs::read_to_string(&old)
            .map_err(|source| ClusterError::Read { path: old, source })?;
        let text = text
            .replacen(
                "listen = \"127.0.0.1:0\"",
                &format!("listen = \"{}\"", self.quic),
                1,
            )
            .replacen(
                "listen = \"127.0.0.1:0\"",
                &format!("listen = \"{}\"", self.http),
                1,
            );
        let cfg = self.dir.path().join("gateway-restarted.toml");
        write_file(&cfg, text)?;
        let log_path = self.dir.path().join("gateway.log");
        let log = std::fs::OpenOptions::new()
            .append(true)
            .open(&log_path)
            .map_err(|source| ClusterError::Write {
                path: log_path,
                source,
            })?;
        let (mut gateway, quic, _) = spawn_gateway(self.dir.path(), &cfg, log)?;
        if quic != self.quic {
            let _ = gateway.kill();
            let _ = gateway.wait();
            return Err(ClusterError::RestartedElsewhere {
                got: quic,
                expected: self.quic,
            });
        }
        self.gateway = gateway;
        Ok(())
    }

    /// Replaces worker `name` with a fresh process (a worker redials a
    /// restarted gateway by itself; this starts over from a clean one).
    pub fn respawn_worker(&mut self, name: &str) -> Result<(), ClusterError> {
        if let Some(i) = self.workers.iter().position(|(n, _)| n == name) {
            let (_, mut old) = self.workers.remove(i);
            let _ = old.kill();
            let _ = old.wait();
        }
        self.spawn_worker(name)
    }
    /// Starts a gateway that leases its own workers (`[leasing]` with the
    /// process provider). `leasing` holds the `[leasing]` keys and the
    /// `[[leasing.models]]` tables; `process` holds extra
    /// `[leasing.process]` keys (such as `notice_period_secs = 1`);
    /// `files` are (name, text) written into [`Cluster::dir`] first (a
    /// test catalog, say), where relative `ledger` and `catalog` paths
    /// resolve. The workers serve BlazeFace from the repository's models/
    /// with one intra-op thread; their logs go to the gateway's log.
    pub fn start_leasing(
        opts: &ClusterOptions,
        leasing: &str,
        process: &str,
        files: &[(&str, &str)],
    ) -> Result<Cluster, ClusterError> {
        Self::start_leasing_with(opts, leasing, "process", process, files)
    }

    /// Like [`Cluster::start_leasing`] with the Slurm provider: `slurm`
    /// holds the `[leasing.slurm]` keys besides the worker `command` and
    /// `args` (its `partitions`, `slurm_conf`, …).
    pub fn start_leasing_slurm(
        opts: &ClusterOptions,
        leasing: &str,
        slurm: &str,
        files: &[(&str, &str)],
    ) -> Result<Cluster, ClusterError> {
        Self::start_leasing_with(opts, leasing, "slurm", slurm, files)
    }

    /// Like [`Cluster::start_leasing`] with the Kubernetes provider:
    /// `kubernetes` holds the `[leasing.kubernetes]` keys besides the
    /// worker `image` (`local/tidegate-worker`), `command` and `args` (its
    /// `kubeconfig`, `namespace`, `tiers`, …). The worker environment of
    /// this process (`ORT_DYLIB_PATH`, `TIDEGATE_CACHE`, `XDG_CACHE_HOME`)
    /// is passed on, since a Pod's container inherits nothing.
    pub fn start_leasing_kubernetes(
        opts: &ClusterOptions,
        leasing: &str,
        kubernetes: &str,
        files: &[(&str, &str)],
    ) -> Result<Cluster, ClusterError> {
        Self::start_leasing_with(opts, leasing, "kubernetes", kubernetes, files)
    }

    fn start_leasing_with(
        opts: &ClusterOptions,
        leasing: &str,
        provider: &str,
        section: &str,
        files: &[(&str, &str)],
    ) -> Result<Cluster, ClusterError> {
        let worker = bin("tidegate-worker")?;
        Self::launch(opts, |dir| {
            for (name, text) in files {
                write_file(&dir.join(name), text)?;
            }
            // The gateway hands each worker its address (TIDEGATE_GATEWAY_ADDR)
            // and its lease (TIDEGATE_LEASE_ID / _TOKEN); the file holds the rest.
            let worker_cfg = dir.join("leased-worker.toml");
            write_file(
                &worker_cfg,
                format!(
                    "name = \"leased\"\n[gateway]\naddr = \"127.0.0.1:1\"\nca = \"{}\"\n[models]\ndir = \"{}\"\nonly = [\"blazeface\"]\n[runtime]\nintra_threads = 1\n",
                    dir.join("certs/ca.pem").display(),
                    workspace_root().join("models").display()
                ),
            )?;
            let worker = toml_string(&worker.display().to_string());
            let args = format!(
                "args = [\"--config\", {}]",
                toml_string(&worker_cfg.display().to_string())
            );
            if provider == "kubernetes" {
                let mut env = vec!["TIDEGATE_LOG = \"info\"".to_string()];
                for var in ["ORT_DYLIB_PATH", "TIDEGATE_CACHE", "XDG_CACHE_HOME"] {
                    if let Some(v) = std::env::var_os(var).filter(|v| !v.is_empty()) {
                        env.push(format!("{var} = {}", toml_string(&v.to_string_lossy())));
                    }
                }
                return Ok(format!(
                    "[leasing]\nprovider = \"kubernetes\"\n{leasing}\n[leasing.kubernetes]\nimage = \"local/tidegate-worker\"\ncommand = [{worker}]\n{args}\nenv = {{ {} }}\n{section}\n",
                    env.join(", ")
                ));
            }
            Ok(format!(
                "[leasing]\nprovider = \"{provider}\"\n{leasing}\n[leasing.{provider}]\ncommand = {worker}\n{args}\nenv = {{ TIDEGATE_LOG = \"info\" }}\n{section}\n",
            ))
        })
    }

    /// Stops the gateway gracefully (SIGTERM) and waits up to `timeout`
    /// for it to exit (then kills it). A leasing gateway releases every
    /// lease, and so ends its workers, before it exits.
    pub fn stop_gateway(
        &mut self,
        timeout: Duration,
    ) -> Result<std::process::ExitStatus, ClusterError> {
        kill(self.gateway.id(), "TERM", "the gateway")?;
        let until = Instant::now() + timeout;
        loop {
            let exited = self
                .gateway
                .try_wait()
                .map_err(|source| ClusterError::Wait {
                    who: "the gateway".into(),
                    source,
                })?;
            if let Some(s) = exited {
                return Ok(s);
            }
            if Instant::now() > until {
                self.kill_gateway();
                return Err(ClusterError::StopTimeout {
                    timeout,
                    log: self.gateway_log(),
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for (_, c) in &mut self.workers {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = self.gateway.kill();
        let _ = self.gateway.wait();
    }
}

/// How long a starting gateway may take to print its listening line.
const LISTENING_LINE_TIMEOUT: Duration = Duration::from_secs(30);

/// Starts `tidegate-gateway --config cfg run` with its log on `log` and
/// returns it with the QUIC and HTTP addresses from its listening line
/// (killing it, and failing with its log, if none comes within 30 s).
fn spawn_gateway(
    dir: &Path,
    cfg: &Path,
    log: std::fs::File,
) -> Result<(Child, SocketAddr, SocketAddr), ClusterError> {
    let mut gateway = command("tidegate-gateway")?
        .arg("--config")
        .arg(cfg)
        .arg("run")
        .env("TIDEGATE_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(log)
        .spawn()
        .map_err(|source| ClusterError::Spawn {
            program: "tidegate-gateway",
            source,
        })?;
    // Read the listening line on a thread of its own, so a gateway that
    // neither prints it nor exits cannot hang the caller.
    let stdout = gateway.stdout.take().expect("piped stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let read = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(read.map(|_| line));
    });
    let (read, line) = match rx.recv_timeout(LISTENING_LINE_TIMEOUT) {
        Ok(Ok(line)) => (Ok(()), line),
        Ok(Err(e)) => (
            Err(format!("reading the gateway's listening line: {e}")),
            String::new(),
        ),
        Err(_) => (
            Err(format!(
                "the gateway printed no listening line within {LISTENING_LINE_TIMEOUT:?}"
            )),
            String::new(),
        ),
    };
    // "listening quic=127.0.0.1:PORT http=127.0.0.1:PORT"
    let addr = |key: &str| -> Result<SocketAddr, String> {
        let value = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix(key))
            .ok_or_else(|| format!("gateway printed {line:?}, expected {key}ADDR"))?;
        value
            .parse()
            .map_err(|e| format!("gateway printed {line:?}: {key}{value} is not an address ({e})"))
    };
    match (read, addr("quic="), addr("http=")) {
        (Ok(_), Ok(q), Ok(h)) => Ok((gateway, q, h)),
        (read, q, h) => {
            let _ = gateway.kill();
            let _ = gateway.wait();
            let reason = match (read, q, h) {
                (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => e,
                _ => unreachable!("handled above"),
            };
            let log = std::fs::read_to_string(dir.join("gateway.log")).unwrap_or_default();
            Err(ClusterError::GatewayStart { reason, log })
        }
    }
}

/// One minimal HTTP/1.0 request (no body, no chunking) against `addr`:
/// `headers` are extra header lines, each ending in CRLF; status and body.
fn http_request(
    addr: SocketAddr,
    method: &'static str,
    path: &str,
    headers: &str,
) -> Result<(u16, String), HttpError> {
    let io = |source| HttpError::Io {
        method,
        path: path.into(),
        addr,
        source,
    };
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).map_err(io)?;
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(io)?;
    write!(
        s,
        "{method} {path} HTTP/1.0\r\n{headers}Host: {addr}\r\n\r\n"
    )
    .map_err(io)?;
    let mut text = String::new();
    s.read_to_string(&mut text).map_err(io)?;
    let status: Option<u16> = text.split_whitespace().nth(1).and_then(|c| c.parse().ok());
    let Some(status) = status else {
        return Err(HttpError::BadResponse {
            method,
            path: path.into(),
            addr,
            text,
        });
    };
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((status, body))
}

/// A process's log without its terminal colour sequences (`ESC [ … m`):
/// the gateway's, the edge's and the workers' logs are coloured.
pub fn plain(log: &str) -> String {
    let mut out = String::with_capacity(log.len());
    let mut chars = log.chars();
    while let Some(ch) = chars.next() {
        if ch == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(ch);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{metric_sum, metric_value};

    #[test]
    fn a_series_is_summed_over_the_label_sets_asked_for_and_no_other_series() {
        let text = "# HELP x_total a counter\n\
                    x_total{reason=\"a\"} 2\n\
                    x_total{reason=\"b\"} 3\n\
                    x_total_more 100\n\
                    h_bucket{model=\"m\",le=\"2\"} 7\n\
                    h_bucket{model=\"m\",le=\"+Inf\"} 9\n\
                    y 1.5\n";
        assert_eq!(metric_sum(text, "x_total", &[]), 5.0);
        assert_eq!(metric_sum(text, "x_total", &["reason=\"b\""]), 3.0);
        assert_eq!(metric_sum(text, "h_bucket", &["le=\"2\""]), 7.0);
        assert_eq!(metric_sum(text, "y", &[]), 1.5);
        assert_eq!(metric_sum(text, "z", &[]), 0.0);
        assert_eq!(metric_value(text, "x_total{reason=\"b\"}"), Some(3.0));
        assert_eq!(metric_value(text, "x_total"), None, "a name, not a series");
        assert_eq!(metric_value(text, "x_total_more"), Some(100.0));
        assert_eq!(metric_value(text, "y"), Some(1.5));
        assert_eq!(metric_value(text, "z"), None);
    }
}
