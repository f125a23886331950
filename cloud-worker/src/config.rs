//! The worker's configuration: a TOML file, with `TIDEGATE_*` environment
//! variables and flags layered on top by the binary.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use tidegate_protocol::GatewayAddr;

pub use crate::model::Precision;
use crate::runtime::{ConvAlgoSearch, CudaOptions, Fallback, Provider, TensorRtOptions};
use crate::watchdog::RunTimeouts;

/// Everything a worker needs.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerConfig {
    /// Name, as listed in the gateway's `[[workers]]`.
    pub name: String,
    /// Token. Prefer the `TIDEGATE_WORKER_TOKEN` environment variable.
    #[serde(default)]
    pub token: String,
    /// The gateway to dial.
    pub gateway: GatewayConfig,
    /// The model repository.
    #[serde(default)]
    pub models: ModelsConfig,
    /// ONNX Runtime settings.
    #[serde(default)]
    pub runtime: RuntimeConfig,
    /// The Prometheus endpoint (off unless `listen` is set).
    #[serde(default)]
    pub metrics: MetricsConfig,
}

/// `[metrics]`: where the worker serves `/metrics`
/// ([`crate::metrics`]).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsConfig {
    /// Address to serve `/metrics` on, e.g. `127.0.0.1:9101` (port 0: any
    /// free port, printed at start as `metrics listening on ADDR`). Unset:
    /// no metrics endpoint.
    #[serde(default)]
    pub listen: Option<std::net::SocketAddr>,
}

impl std::fmt::Debug for WorkerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerConfig")
            .field("name", &self.name)
            .field(
                "token",
                &if self.token.is_empty() {
                    "<unset>"
                } else {
                    "<redacted>"
                },
            )
            .field("gateway", &self.gateway)
            .field("models", &self.models)
            .field("runtime", &self.runtime)
            .field("metrics", &self.metrics)
            .finish()
    }
}

/// How to reach the gateway.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayConfig {
    /// QUIC address: an IP address or a host name, and the port
    /// (`10.0.0.5:4433`, `tidegate-gateway.tidegate.svc:4433`). A name is
    /// resolved at every dial.
    #[serde(deserialize_with = "tidegate_kit::gateway::deserialize_addr")]
    pub addr: GatewayAddr,
    /// Name in the gateway's certificate.
    #[serde(default = "tidegate_kit::gateway::default_server_name")]
    pub server_name: String,
    /// CA certificate (PEM) to trust.
    pub ca: PathBuf,
    /// After losing the gateway (it restarted, or the network failed), keep
    /// redialling for this long before giving up (seconds; 0 = exit at
    /// once).
    #[serde(default = "default_reconnect_secs")]
    pub reconnect_secs: u64,
}

fn default_reconnect_secs() -> u64 {
    60
}

/// Which models to serve.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelsConfig {
    /// Repository folder (one sub-folder per model).
    #[serde(default = "default_models_dir")]
    pub dir: PathBuf,
    /// Serve only these models (all when empty).
    #[serde(default)]
    pub only: Vec<String>,
}

impl Default for ModelsConfig {
    fn default() -> Self {
        ModelsConfig {
            dir: default_models_dir(),
            only: Vec::new(),
        }
    }
}

fn default_models_dir() -> PathBuf {
    PathBuf::from("models")
}

/// ONNX Runtime settings.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuntimeConfig {
    /// Path of libonnxruntime.so (default: ORT_DYLIB_PATH, then the cache).
    #[serde(default)]
    pub library: Option<PathBuf>,
    /// Intra-op threads per session (0 = one per core).
    #[serde(default)]
    pub intra_threads: usize,
    /// Execution provider: `cpu` (the default), `cuda`, or `tensorrt`
    /// (ONNX Runtime's TensorRT provider on the CUDA device, the CUDA
    /// provider serving what TensorRT does not; without TensorRT's
    /// libraries, the CUDA provider alone, said in one line).
    #[serde(default)]
    pub provider: ProviderKind,
    /// Which of each model's files to serve: `fp32` (the default) or
    /// `fp16` (its `[fp16]` variant, where its model.toml has one).
    #[serde(default)]
    pub precision: Precision,
    /// When the provider cannot be used: `none` (refuse to start, the
    /// default) or `cpu` (warn and serve on the CPU).
    #[serde(default)]
    pub fallback: Fallback,
    /// CUDA settings, read when `provider = "cuda"` or `"tensorrt"`.
    #[serde(default)]
    pub cuda: CudaConfig,
    /// TensorRT settings, read when `provider = "tensorrt"`.
    #[serde(default)]
    pub tensorrt: TensorRtConfig,
    /// Run each batch padded to the next batch size warmed up and profiled
    /// at start (1, 2, 4, … and `max_batch`), so that serving never runs an
    /// input shape for the first time. Unset: on CUDA (where a shape's first
    /// run costs seconds of cuDNN search), not on the CPU.
    #[serde(default)]
    pub pad_batches: Option<bool>,
    /// A batch still running after this long (seconds) means ONNX Runtime
    /// or the device is wedged: the worker exits with status 3
    /// ([`crate::watchdog::EXIT_WEDGED`]) for its supervisor to replace it.
    /// [`WEDGED_AFTER_SECS`] bounds it.
    #[serde(default = "default_wedged_after_secs")]
    pub wedged_after_secs: u64,
    /// A warm-up or profiling run (before the worker registers) still
    /// running after this long (seconds) means ONNX Runtime or the device
    /// is wedged: the worker exits with status 3 as for a batch. Unset:
    /// [`DEFAULT_WARMUP_WEDGED_AFTER_SECS`], or `wedged_after_secs` when
    /// that is longer ([`RuntimeConfig::watchdog_timeouts`]).
    /// [`WARMUP_WEDGED_AFTER_SECS`] bounds it, and it may not be below
    /// `wedged_after_secs`.
    #[serde(default)]
    pub warmup_wedged_after_secs: Option<u64>,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        RuntimeConfig {
            library: None,
            intra_threads: 0,
            provider: ProviderKind::default(),
            precision: Precision::default(),
            fallback: Fallback::default(),
            cuda: CudaConfig::default(),
            tensorrt: TensorRtConfig::default(),
            pad_batches: None,
            wedged_after_secs: default_wedged_after_secs(),
            warmup_wedged_after_secs: None,
        }
    }
}

fn default_wedged_after_secs() -> u64 {
    60
}

/// The `runtime.wedged_after_secs` accepted: at least 5 s, so that a slow
/// batch (a first run of a new batch size while cuDNN searches its
/// algorithms) is not taken for a wedge; at most an hour, so that a wedged
/// worker does not hold its GPU for longer.
pub const WEDGED_AFTER_SECS: std::ops::RangeInclusive<u64> = 5..=3600;

/// `runtime.warmup_wedged_after_secs` when unset (and `wedged_after_secs`
/// is shorter): five minutes. A model's first run on a GPU creates the CUDA
/// context and, with cuDNN's exhaustive algorithm search (the default),
/// benchmarks the algorithms of every convolution, which takes seconds on
/// the models here and can take minutes on a large one; steady-state
/// batches take milliseconds, so the batch limit would be too tight for
/// start-up, and start-up's too loose for serving. A separate, generous
/// limit still ends a worker wedged before it registers, which nothing else
/// does for a static or systemd worker.
pub const DEFAULT_WARMUP_WEDGED_AFTER_SECS: u64 = 300;

/// The `runtime.warmup_wedged_after_secs` accepted: as for
/// `wedged_after_secs` (5 s to an hour), and never below that (checked in
/// [`WorkerConfig::validate`]): a model's first runs are not faster than a
/// batch later.
pub const WARMUP_WEDGED_AFTER_SECS: std::ops::RangeInclusive<u64> = 5..=3600;

/// Which execution provider, as written in the config.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProviderKind {
    /// ONNX Runtime on the CPU.
    #[default]
    Cpu,
    /// ONNX Runtime's CUDA execution provider.
    Cuda,
    /// ONNX Runtime's TensorRT execution provider, before the CUDA one.
    Tensorrt,
}

/// `[runtime.tensorrt]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorRtConfig {
    /// Where built engines (and TensorRT's timing cache) are kept, so that
    /// a restart or a replacement worker on the same disk loads them
    /// instead of building them again (minutes). Unset: `tensorrt/` in the
    /// tidegate cache.
    #[serde(default)]
    pub engine_cache_dir: Option<PathBuf>,
    /// Let TensorRT choose FP16 kernels (default true).
    #[serde(default = "crate::model::yes")]
    pub fp16: bool,
    /// Most scratch memory TensorRT may use while it builds an engine, in
    /// MiB (unset: TensorRT's default).
    #[serde(default)]
    pub max_workspace_mb: Option<u64>,
}

impl Default for TensorRtConfig {
    fn default() -> Self {
        TensorRtConfig {
            engine_cache_dir: None,
            fp16: true,
            max_workspace_mb: None,
        }
    }
}

/// `[runtime.cuda]`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CudaConfig {
    /// The GPU's ordinal (`nvidia-smi -L`).
    #[serde(default)]
    pub device_id: u32,
    /// Cap on the CUDA provider's memory arena, in MiB (unset: no cap).
    #[serde(default)]
    pub arena_limit_mb: Option<u64>,
    /// cuDNN convolution algorithm search: `exhaustive` (default),
    /// `heuristic` or `default`.
    #[serde(default)]
    pub conv_algo_search: ConvAlgoSearch,
    /// Normalise on the CPU and upload f32 rather than upload u8 and
    /// normalise with the GPU kernel (default false).
    #[serde(default)]
    pub cpu_preprocess: bool,
}

/// The largest `runtime.cuda.arena_limit_mb` accepted: 1 TiB, above any
/// GPU's memory, so that a typo is caught rather than overflowing bytes.
pub const MAX_ARENA_LIMIT_MB: u64 = 1 << 20;

impl RuntimeConfig {
    /// The watchdog's limits: `wedged_after_secs` for a batch, and for a
    /// warm-up or profiling run `warmup_wedged_after_secs`, or when unset
    /// [`DEFAULT_WARMUP_WEDGED_AFTER_SECS`] or `wedged_after_secs`,
    /// whichever is longer.
    pub fn watchdog_timeouts(&self) -> RunTimeouts {
        let start_up = self
            .warmup_wedged_after_secs
            .unwrap_or(DEFAULT_WARMUP_WEDGED_AFTER_SECS.max(self.wedged_after_secs));
        RunTimeouts {
            serving: std::time::Duration::from_secs(self.wedged_after_secs),
            start_up: std::time::Duration::from_secs(start_up),
        }
    }

    /// The provider these settings ask for. An arena limit beyond
    /// [`MAX_ARENA_LIMIT_MB`] (which [`WorkerConfig::validate`] refuses)
    /// saturates instead of overflowing.
    pub fn provider(&self) -> Provider {
        let cuda = |tensorrt| CudaOptions {
            device_id: self.cuda.device_id,
            arena_limit_bytes: self
                .cuda
                .arena_limit_mb
                .map(|mb| mb.saturating_mul(1024 * 1024)),
            conv_algo_search: self.cuda.conv_algo_search,
            cpu_preprocess: self.cuda.cpu_preprocess,
            tensorrt,
        };
        match self.provider {
            ProviderKind::Cpu => Provider::Cpu,
            ProviderKind::Cuda => Provider::Cuda(cuda(None)),
            ProviderKind::Tensorrt => Provider::Cuda(cuda(Some(TensorRtOptions {
                engine_cache_dir: self
                    .tensorrt
                    .engine_cache_dir
                    .clone()
                    .or_else(|| crate::runtime::cache_dir().ok().map(|d| d.join("tensorrt"))),
                fp16: self.tensorrt.fp16,
                max_workspace_bytes: self
                    .tensorrt
                    .max_workspace_mb
                    .map(|mb| mb.saturating_mul(1024 * 1024)),
            }))),
        }
    }
}

/// Why the configuration is unusable (the client kit's, shared by every
/// binary).
pub use tidegate_kit::config::ConfigError;

impl WorkerConfig {
    /// Reads a file; relative paths resolve against its directory.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let mut cfg: WorkerConfig = tidegate_kit::config::read_toml(path)?;
        let base = path.parent().unwrap_or(Path::new("."));
        for p in [&mut cfg.gateway.ca, &mut cfg.models.dir] {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        }
        for p in [
            cfg.runtime.library.as_mut(),
            cfg.runtime.tensorrt.engine_cache_dir.as_mut(),
        ]
        .into_iter()
        .flatten()
        .filter(|p| p.is_relative())
        {
            *p = base.join(&*p);
        }
        Ok(cfg)
    }

    /// Checks what serde cannot.
    pub fn validate(&self) -> Result<(), ConfigError> {
        match self.runtime.cuda.arena_limit_mb {
            Some(0) => {
                return Err(ConfigError::Invalid(
                    "runtime.cuda.arena_limit_mb is 0; leave it unset for no cap, or give MiB"
                        .into(),
                ));
            }
            Some(mb) if mb > MAX_ARENA_LIMIT_MB => {
                return Err(ConfigError::Invalid(format!(
                    "runtime.cuda.arena_limit_mb is {mb} MiB, more than any GPU has (at most {MAX_ARENA_LIMIT_MB} MiB, 1 TiB); give the cap in MiB, e.g. 8192 for 8 GiB, or leave it unset for no cap"
                )));
            }
            _ => {}
        }
        if self.runtime.tensorrt.max_workspace_mb == Some(0) {
            return Err(ConfigError::Invalid(
                "runtime.tensorrt.max_workspace_mb is 0; leave it unset for TensorRT's default, or give MiB"
                    .into(),
            ));
        }
        let wedged = self.runtime.wedged_after_secs;
        if !WEDGED_AFTER_SECS.contains(&wedged) {
            return Err(ConfigError::Invalid(format!(
                "runtime.wedged_after_secs is {wedged}; give {}..={} seconds (default 60): how long one batch may run before the worker takes ONNX Runtime or the device for wedged and exits",
                WEDGED_AFTER_SECS.start(),
                WEDGED_AFTER_SECS.end()
            )));
        }
        if let Some(warmup) = self.runtime.warmup_wedged_after_secs {
            if !WARMUP_WEDGED_AFTER_SECS.contains(&warmup) {
                return Err(ConfigError::Invalid(format!(
                    "runtime.warmup_wedged_after_secs is {warmup}; give {}..={} seconds, at least runtime.wedged_after_secs (unset: {DEFAULT_WARMUP_WEDGED_AFTER_SECS}, or runtime.wedged_after_secs if longer): how long one warm-up or profiling run before the worker registers may take before the worker takes ONNX Runtime or the device for wedged and exits",
                    WARMUP_WEDGED_AFTER_SECS.start(),
                    WARMUP_WEDGED_AFTER_SECS.end()
                )));
            }
            if warmup < wedged {
                return Err(ConfigError::Invalid(format!(
                    "runtime.warmup_wedged_after_secs is {warmup}, below runtime.wedged_after_secs ({wedged}): a model's first runs at start-up (CUDA context, cuDNN's algorithm search) take at least as long as a batch later; give it {wedged} or more, or leave it unset"
                )));
            }
        }
        if self.token.is_empty() {
            return Err(ConfigError::Invalid(format!(
                "worker '{}' has no token: set TIDEGATE_WORKER_TOKEN or `token` in the config",
                self.name
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_paths_resolve_against_the_file_and_token_is_redacted() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("w.toml");
        std::fs::write(
            &p,
            "name = \"w\"\ntoken = \"hush\"\n[gateway]\naddr = \"127.0.0.1:1\"\nca = \"c/ca.pem\"\n[models]\ndir = \"m\"\n",
        )
        .unwrap();
        let cfg = WorkerConfig::load(&p).unwrap();
        assert_eq!(cfg.gateway.ca, dir.path().join("c/ca.pem"));
        assert_eq!(cfg.models.dir, dir.path().join("m"));
        assert!(!format!("{cfg:?}").contains("hush"));
        cfg.validate().unwrap();
        assert_eq!(cfg.runtime.provider(), Provider::Cpu);
        assert_eq!(cfg.runtime.fallback, Fallback::None);
        assert_eq!(cfg.runtime.wedged_after_secs, 60);
    }

    fn parse(runtime: &str) -> Result<WorkerConfig, ConfigError> {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("w.toml");
        std::fs::write(
            &p,
            format!("name = \"w\"\ntoken = \"t\"\n[gateway]\naddr = \"127.0.0.1:1\"\nca = \"ca.pem\"\n{runtime}"),
        )
        .unwrap();
        let cfg = WorkerConfig::load(&p)?;
        cfg.validate()?;
        Ok(cfg)
    }

    fn with_addr(addr: &str) -> Result<WorkerConfig, ConfigError> {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("w.toml");
        std::fs::write(
            &p,
            format!("name = \"w\"\ntoken = \"t\"\n[gateway]\naddr = \"{addr}\"\nca = \"ca.pem\"\n"),
        )
        .unwrap();
        WorkerConfig::load(&p)
    }

    #[test]
    fn gateway_addr_takes_a_host_name_or_an_ip_and_a_bad_one_names_the_field() {
        let cfg = with_addr("gw.example.com:4433").unwrap();
        assert_eq!(cfg.gateway.addr.name(), Some("gw.example.com"));
        assert_eq!(cfg.gateway.addr.port(), 4433);
        let cfg = with_addr("tidegate-gateway.tidegate.svc:4433").unwrap();
        assert_eq!(
            cfg.gateway.addr.to_string(),
            "tidegate-gateway.tidegate.svc:4433"
        );
        let cfg = with_addr("127.0.0.1:4433").unwrap();
        assert_eq!(
            cfg.gateway.addr.ip(),
            Some("127.0.0.1:4433".parse().unwrap())
        );
        for (addr, says) in [
            ("gw example:1", "contains whitespace"),
            ("gw.example.com", "has no port"),
            ("::1:4433", "in brackets"),
            ("quic://gw:4433", "has a scheme"),
        ] {
            let err = with_addr(addr).unwrap_err();
            assert!(matches!(err, ConfigError::Parse { .. }), "{err:?}");
            let text = err.to_string();
            assert!(
                text.contains("gateway.addr: gateway address") && text.contains(says),
                "{addr}: {text}"
            );
        }
    }

    #[test]
    fn cuda_section_becomes_the_cuda_provider_with_its_settings() {
        let cfg = parse(
            "[runtime]\nprovider = \"cuda\"\nfallback = \"cpu\"\n[runtime.cuda]\ndevice_id = 1\narena_limit_mb = 2048\nconv_algo_search = \"heuristic\"\ncpu_preprocess = true\n",
        )
        .unwrap();
        assert_eq!(cfg.runtime.fallback, Fallback::Cpu);
        assert_eq!(
            cfg.runtime.provider(),
            Provider::Cuda(CudaOptions {
                device_id: 1,
                arena_limit_bytes: Some(2048 << 20),
                conv_algo_search: ConvAlgoSearch::Heuristic,
                cpu_preprocess: true,
                tensorrt: None,
            })
        );
    }

    #[test]
    fn tensorrt_is_the_cuda_provider_with_tensorrt_before_it() {
        let cfg = parse(
            "[runtime]\nprovider = \"tensorrt\"\n[runtime.cuda]\ndevice_id = 2\n[runtime.tensorrt]\nengine_cache_dir = \"/var/cache/trt\"\nfp16 = false\nmax_workspace_mb = 4096\n",
        )
        .unwrap();
        let Provider::Cuda(c) = cfg.runtime.provider() else {
            panic!("not the CUDA device: {:?}", cfg.runtime.provider());
        };
        assert_eq!(c.device_id, 2);
        assert_eq!(
            c.tensorrt,
            Some(TensorRtOptions {
                engine_cache_dir: Some(PathBuf::from("/var/cache/trt")),
                fp16: false,
                max_workspace_bytes: Some(4096 << 20),
            })
        );
        assert_eq!(cfg.runtime.provider().to_string(), "tensorrt:2");
        // Unset: FP16 kernels allowed, engines kept in the tidegate cache.
        let cfg = parse("[runtime]\nprovider = \"tensorrt\"\n").unwrap();
        let Provider::Cuda(c) = cfg.runtime.provider() else {
            panic!("not the CUDA device");
        };
        let t = c.tensorrt.expect("TensorRT options");
        assert!(t.fp16);
        if let Ok(cache) = crate::runtime::cache_dir() {
            assert_eq!(t.engine_cache_dir, Some(cache.join("tensorrt")));
        }
        let err = parse("[runtime.tensorrt]\nmax_workspace_mb = 0\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("runtime.tensorrt.max_workspace_mb is 0"),
            "{err}"
        );
        let err = parse("[runtime.tensorrt]\nengine_cache = \"x\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("engine_cache"), "{err}");
    }

    #[test]
    fn precision_is_fp32_unless_fp16_is_asked_for() {
        assert_eq!(parse("").unwrap().runtime.precision, Precision::Fp32);
        assert_eq!(
            parse("[runtime]\nprecision = \"fp16\"\n")
                .unwrap()
                .runtime
                .precision,
            Precision::Fp16
        );
        let err = parse("[runtime]\nprecision = \"int8\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("int8") && err.contains("fp16"), "{err}");
    }

    #[test]
    fn pad_batches_is_the_providers_default_unless_set() {
        assert_eq!(parse("").unwrap().runtime.pad_batches, None);
        for (text, want) in [("true", Some(true)), ("false", Some(false))] {
            let cfg = parse(&format!("[runtime]\npad_batches = {text}\n")).unwrap();
            assert_eq!(cfg.runtime.pad_batches, want);
        }
        let err = parse("[runtime]\npad_batches = \"yes\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("pad_batches"), "{err}");
    }

    #[test]
    fn unknown_provider_and_cuda_field_are_rejected_by_name() {
        let err = parse("[runtime]\nprovider = \"tpu\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("tpu") && err.contains("cuda"), "{err}");
        let err = parse("[runtime.cuda]\ndevice = 0\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("device"), "{err}");
        let err = parse("[runtime.cuda]\narena_limit_mb = 0\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("runtime.cuda.arena_limit_mb"), "{err}");
    }

    #[test]
    fn wedged_after_defaults_to_a_minute_and_out_of_range_names_the_field() {
        assert_eq!(parse("").unwrap().runtime.wedged_after_secs, 60);
        assert_eq!(
            parse("[runtime]\nintra_threads = 1\n")
                .unwrap()
                .runtime
                .wedged_after_secs,
            60
        );
        assert_eq!(RuntimeConfig::default().wedged_after_secs, 60);
        for secs in [5, 3600] {
            let cfg = parse(&format!("[runtime]\nwedged_after_secs = {secs}\n")).unwrap();
            assert_eq!(cfg.runtime.wedged_after_secs, secs);
        }
        for secs in [0, 4, 3601] {
            let err = parse(&format!("[runtime]\nwedged_after_secs = {secs}\n")).unwrap_err();
            assert!(matches!(err, ConfigError::Invalid(_)), "{err:?}");
            let text = err.to_string();
            assert!(
                text.contains(&format!("runtime.wedged_after_secs is {secs}"))
                    && text.contains("5..=3600 seconds"),
                "{text}"
            );
        }
        let err = parse("[runtime]\nwedged_after_secs = -1\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("wedged_after_secs"), "{err}");
    }

    #[test]
    fn warmup_wedged_after_defaults_to_five_minutes_or_the_batch_limit_if_longer() {
        use std::time::Duration;
        let secs = |s| Duration::from_secs(s);
        let cfg = parse("").unwrap();
        assert_eq!(cfg.runtime.warmup_wedged_after_secs, None);
        assert_eq!(
            cfg.runtime.watchdog_timeouts(),
            RunTimeouts {
                serving: secs(60),
                start_up: secs(300)
            }
        );
        assert_eq!(
            RuntimeConfig::default().watchdog_timeouts(),
            cfg.runtime.watchdog_timeouts()
        );
        // Unset, it never falls below a longer batch limit.
        let cfg = parse("[runtime]\nwedged_after_secs = 900\n").unwrap();
        assert_eq!(
            cfg.runtime.watchdog_timeouts(),
            RunTimeouts {
                serving: secs(900),
                start_up: secs(900)
            }
        );
        let cfg = parse("[runtime]\nwedged_after_secs = 5\n").unwrap();
        assert_eq!(cfg.runtime.watchdog_timeouts().start_up, secs(300));
        // Set, it is taken as given.
        for (wedged, warmup) in [(5, 5), (60, 60), (60, 1200), (3600, 3600)] {
            let cfg = parse(&format!(
                "[runtime]\nwedged_after_secs = {wedged}\nwarmup_wedged_after_secs = {warmup}\n"
            ))
            .unwrap();
            assert_eq!(
                cfg.runtime.watchdog_timeouts(),
                RunTimeouts {
                    serving: secs(wedged),
                    start_up: secs(warmup)
                }
            );
        }
    }

    #[test]
    fn warmup_wedged_after_out_of_range_or_below_the_batch_limit_names_the_field() {
        for secs in [0, 4, 3601, u64::MAX >> 1] {
            let err = parse(&format!(
                "[runtime]\nwedged_after_secs = 5\nwarmup_wedged_after_secs = {secs}\n"
            ))
            .unwrap_err();
            assert!(matches!(err, ConfigError::Invalid(_)), "{err:?}");
            let text = err.to_string();
            assert!(
                text.contains(&format!("runtime.warmup_wedged_after_secs is {secs};"))
                    && text.contains("5..=3600 seconds")
                    && text.contains("warm-up or profiling run"),
                "{text}"
            );
        }
        let err = parse("[runtime]\nwarmup_wedged_after_secs = 30\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(
                "runtime.warmup_wedged_after_secs is 30, below runtime.wedged_after_secs (60)"
            ) && err.contains("give it 60 or more, or leave it unset"),
            "{err}"
        );
        let err = parse("[runtime]\nwarmup_wedged_after_secs = -1\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("warmup_wedged_after_secs"), "{err}");
        let err = parse("[runtime]\nwarmup_wedged_after = 300\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("warmup_wedged_after") && err.contains("unknown field"),
            "{err}"
        );
    }

    #[test]
    fn metrics_are_off_unless_listen_is_set_and_a_bad_address_names_the_field() {
        assert_eq!(parse("").unwrap().metrics.listen, None);
        let on = parse("[metrics]\nlisten = \"127.0.0.1:9101\"\n").unwrap();
        assert_eq!(on.metrics.listen, Some("127.0.0.1:9101".parse().unwrap()));
        let bad = parse("[metrics]\nlisten = \"localhost\"\n").unwrap_err();
        assert!(bad.to_string().contains("listen"), "{bad}");
        let unknown = parse("[metrics]\nport = 9101\n").unwrap_err();
        assert!(unknown.to_string().contains("port"), "{unknown}");
    }

    #[test]
    fn arena_limit_beyond_any_gpu_is_refused_and_never_overflows() {
        // 2^44 MiB would overflow u64 as bytes.
        for mb in [MAX_ARENA_LIMIT_MB + 1, 1 << 44, i64::MAX as u64] {
            let err = parse(&format!(
                "[runtime]\nprovider = \"cuda\"\n[runtime.cuda]\narena_limit_mb = {mb}\n"
            ))
            .unwrap_err()
            .to_string();
            assert!(
                err.contains(&format!("arena_limit_mb is {mb} MiB"))
                    && err.contains("at most 1048576 MiB"),
                "{err}"
            );
        }
        let cfg = parse(&format!(
            "[runtime]\nprovider = \"cuda\"\n[runtime.cuda]\narena_limit_mb = {MAX_ARENA_LIMIT_MB}\n"
        ))
        .unwrap();
        let Provider::Cuda(c) = cfg.runtime.provider() else {
            panic!("expected cuda");
        };
        assert_eq!(c.arena_limit_bytes, Some(1 << 40));
        // Unvalidated, an absurd value saturates rather than wrapping.
        let mut runtime = cfg.runtime.clone();
        runtime.cuda.arena_limit_mb = Some(u64::MAX);
        let Provider::Cuda(c) = runtime.provider() else {
            panic!("expected cuda");
        };
        assert_eq!(c.arena_limit_bytes, Some(u64::MAX));
    }
}
