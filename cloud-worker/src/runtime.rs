//! Finding and loading the ONNX Runtime shared library, once per process.
//!
//! The library is looked for in this order, and the first place named is the
//! only one tried (a wrong explicit path is an error, not a cue to look
//! elsewhere):
//! 1. the path in the worker's configuration ([`RuntimeOptions::library`]);
//! 2. the `ORT_DYLIB_PATH` environment variable;
//! 3. the tidegate cache, where `make setup` (scripts/setup.sh) puts it:
//!    `$TIDEGATE_CACHE`, else `$XDG_CACHE_HOME/tidegate`, else
//!    `$HOME/.cache/tidegate`, then `onnxruntime/1.31.1/libonnxruntime.so`.
//!
//! ONNX Runtime can be loaded only once per process; [`Runtime::init`] keeps
//! the loaded library and its environment for the life of the process, and
//! answers later calls that resolve to the same path with the same runtime.

use std::ffi::OsString;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

/// The ONNX Runtime release `make setup` installs and this worker is built for.
pub const ORT_VERSION: &str = "1.31.1";

/// The environment variable naming the library, as ONNX Runtime's own tools use.
pub const ORT_DYLIB_ENV: &str = "ORT_DYLIB_PATH";

/// How the worker runs ONNX Runtime.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuntimeOptions {
    /// Path of `libonnxruntime.so`; `None` falls back to `ORT_DYLIB_PATH`,
    /// then to the tidegate cache.
    pub library: Option<PathBuf>,
    /// Threads each session uses inside one operator; 0 lets ONNX Runtime
    /// choose (one per core).
    pub intra_threads: usize,
    /// Untimed runs per batch size when a session opens and before profiling.
    pub warmup_runs: u32,
    /// Timed runs per batch size in [`crate::backend::Backend::profile`]; the
    /// median is reported.
    pub profile_runs: u32,
    /// Where sessions run.
    pub provider: Provider,
    /// What to do when `provider` cannot be used.
    pub fallback: Fallback,
    /// Whether a batch runs padded to the next of the model's
    /// [`batch_buckets`](crate::backend::batch_buckets), the sizes warmed up
    /// and profiled at start, so that serving never runs an input shape for
    /// the first time. `None`: on CUDA, where a shape's first run costs a
    /// cuDNN algorithm search and allocations (seconds, against
    /// milliseconds), and not on the CPU, where padding only adds work.
    pub pad_batches: Option<bool>,
}

/// The execution provider sessions run on.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Provider {
    /// ONNX Runtime's CPU provider, with `intra_threads` threads per session.
    #[default]
    Cpu,
    /// NVIDIA GPUs through ONNX Runtime's CUDA execution provider.
    Cuda(CudaOptions),
}

impl fmt::Display for Provider {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Provider::Cpu => f.write_str("cpu"),
            Provider::Cuda(c) if c.tensorrt.is_some() => write!(f, "tensorrt:{}", c.device_id),
            Provider::Cuda(c) => write!(f, "cuda:{}", c.device_id),
        }
    }
}

/// Settings of the CUDA execution provider.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CudaOptions {
    /// The GPU's ordinal.
    pub device_id: u32,
    /// Most bytes the provider's memory arena may hold (`None`: no limit).
    pub arena_limit_bytes: Option<u64>,
    /// How cuDNN picks convolution algorithms.
    pub conv_algo_search: ConvAlgoSearch,
    /// Normalise frames on the CPU and upload f32, instead of uploading the
    /// u8 frames (a quarter of the bytes) and normalising them with the
    /// NVRTC kernel (the default). For comparison, or where NVRTC is
    /// missing.
    pub cpu_preprocess: bool,
    /// TensorRT before the CUDA provider (`provider = "tensorrt"`).
    pub tensorrt: Option<TensorRtOptions>,
}

/// Settings of ONNX Runtime's TensorRT execution provider.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TensorRtOptions {
    /// Where engines and the timing cache are kept (`None`: not kept; each
    /// start builds them again).
    pub engine_cache_dir: Option<PathBuf>,
    /// Let TensorRT choose FP16 kernels.
    pub fp16: bool,
    /// Scratch memory TensorRT may use while it builds (`None`: its default).
    pub max_workspace_bytes: Option<u64>,
}

/// cuDNN's convolution algorithm search (ONNX Runtime `cudnn_conv_algo_search`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ConvAlgoSearch {
    /// Benchmark every algorithm on the first run of each shape (slow first
    /// run, fastest later; ONNX Runtime's default).
    #[default]
    Exhaustive,
    /// cuDNN's heuristics, no benchmarking.
    Heuristic,
    /// The implicit-precomp GEMM algorithm, no search (least memory).
    Default,
}

/// What the worker does when the configured provider cannot be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fallback {
    /// Refuse to start, saying why.
    #[default]
    None,
    /// Warn, and run (and register) on the CPU.
    Cpu,
}

impl Default for RuntimeOptions {
    fn default() -> Self {
        RuntimeOptions {
            library: None,
            intra_threads: 0,
            warmup_runs: 2,
            profile_runs: 5,
            provider: Provider::Cpu,
            fallback: Fallback::None,
            pad_batches: None,
        }
    }
}

/// Where the library path came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LibrarySource {
    /// The worker's configuration.
    Config,
    /// The `ORT_DYLIB_PATH` environment variable.
    Env,
    /// The tidegate cache directory.
    Cache,
}

impl fmt::Display for LibrarySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LibrarySource::Config => "the worker config",
            LibrarySource::Env => "ORT_DYLIB_PATH",
            LibrarySource::Cache => "the tidegate cache",
        })
    }
}

/// The loaded ONNX Runtime: where it came from and its environment, under
/// which every session is created.
pub struct Runtime {
    path: PathBuf,
    source: LibrarySource,
    environment: ort::environment::Environment,
}

impl fmt::Debug for Runtime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Runtime")
            .field("path", &self.path)
            .field("source", &self.source)
            .finish_non_exhaustive()
    }
}

static RUNTIME: OnceLock<Runtime> = OnceLock::new();
/// Serialises first-time loading, so that a failed attempt can be retried
/// with another path while a successful one is kept forever.
static LOADING: Mutex<()> = Mutex::new(());

impl Runtime {
    /// Loads ONNX Runtime from the library that `library` (or the
    /// environment, or the cache) names, once per process. A later call that
    /// resolves to the same path returns the same runtime; a different path
    /// is an error, since the process cannot load a second copy.
    pub fn init(library: Option<&Path>) -> Result<&'static Runtime, RuntimeError> {
        let (path, source) = locate(library)?;
        let _guard = LOADING
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(rt) = RUNTIME.get() {
            return if same_file(&rt.path, &path) {
                Ok(rt)
            } else {
                Err(RuntimeError::AlreadyLoaded {
                    loaded: rt.path.clone(),
                    requested: path,
                    origin: source,
                })
            };
        }
        if !path.is_file() {
            return Err(RuntimeError::NotFound {
                path,
                origin: source,
            });
        }
        let builder = ort::init_from(&path).map_err(|e| RuntimeError::Load {
            path: path.clone(),
            origin: source,
            message: one_line(&e.to_string()),
        })?;
        let environment = builder.with_name("tidegate-worker").build().map_err(|e| {
            RuntimeError::Environment {
                path: path.clone(),
                message: one_line(&e.to_string()),
            }
        })?;
        tracing::info!(path = %path.display(), %source, "loaded ONNX Runtime");
        Ok(RUNTIME.get_or_init(|| Runtime {
            path,
            source,
            environment,
        }))
    }

    /// The process's runtime, if one has been loaded.
    pub fn get() -> Option<&'static Runtime> {
        RUNTIME.get()
    }

    /// The library file loaded.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Where its path came from.
    pub fn source(&self) -> LibrarySource {
        self.source
    }

    /// The environment sessions are created under.
    pub fn environment(&self) -> &ort::environment::Environment {
        &self.environment
    }
}

/// Resolves the library path from the config, `ORT_DYLIB_PATH` and the cache,
/// without touching the file.
pub fn locate(library: Option<&Path>) -> Result<(PathBuf, LibrarySource), RuntimeError> {
    let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
    locate_with(
        library,
        var(ORT_DYLIB_ENV),
        var("TIDEGATE_CACHE"),
        var("XDG_CACHE_HOME"),
        var("HOME"),
    )
}

/// The tidegate cache, where `make setup` (scripts/cache.sh) puts what it
/// downloads: `TIDEGATE_CACHE`, else `$XDG_CACHE_HOME/tidegate`, else
/// `$HOME/.cache/tidegate`.
pub fn cache_dir() -> Result<PathBuf, RuntimeError> {
    let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
    cache_dir_with(var("TIDEGATE_CACHE"), var("XDG_CACHE_HOME"), var("HOME"))
        .ok_or(RuntimeError::NoCacheDir)
}

fn cache_dir_with(
    tidegate_cache: Option<OsString>,
    xdg_cache: Option<OsString>,
    home: Option<OsString>,
) -> Option<PathBuf> {
    tidegate_cache
        .map(PathBuf::from)
        .or_else(|| xdg_cache.map(|x| PathBuf::from(x).join("tidegate")))
        .or_else(|| home.map(|h| PathBuf::from(h).join(".cache").join("tidegate")))
}

/// [`locate`] over given environment values (unset or empty as `None`).
fn locate_with(
    library: Option<&Path>,
    ort_dylib: Option<OsString>,
    tidegate_cache: Option<OsString>,
    xdg_cache: Option<OsString>,
    home: Option<OsString>,
) -> Result<(PathBuf, LibrarySource), RuntimeError> {
    if let Some(p) = library {
        return Ok((p.to_path_buf(), LibrarySource::Config));
    }
    if let Some(p) = ort_dylib {
        return Ok((PathBuf::from(p), LibrarySource::Env));
    }
    let cache = cache_dir_with(tidegate_cache, xdg_cache, home).ok_or(RuntimeError::NoCacheDir)?;
    Ok((
        cache.join("onnxruntime").join(ORT_VERSION).join(format!(
            "{}onnxruntime{}",
            std::env::consts::DLL_PREFIX,
            std::env::consts::DLL_SUFFIX
        )),
        LibrarySource::Cache,
    ))
}

fn same_file(a: &Path, b: &Path) -> bool {
    a == b
        || matches!(
            (a.canonicalize(), b.canonicalize()),
            (Ok(x), Ok(y)) if x == y
        )
}

/// Error texts from the loader and ONNX Runtime can span lines; ours are
/// one line.
pub(crate) fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// What to do about a library that cannot be used.
const FIX: &str =
    "run `make setup`, or set ORT_DYLIB_PATH to a libonnxruntime.so (ONNX Runtime 1.31)";

/// Why ONNX Runtime could not be loaded. Every message is one line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RuntimeError {
    /// No file at the resolved path.
    #[error("ONNX Runtime library not found: looked for {} (from {origin}); {FIX}", path.display())]
    NotFound {
        /// The path tried.
        path: PathBuf,
        /// Where the path came from.
        origin: LibrarySource,
    },
    /// Neither a path, ORT_DYLIB_PATH, nor a cache directory is known.
    #[error(
        "ONNX Runtime library not found: no library path configured, ORT_DYLIB_PATH is unset, and no cache directory (TIDEGATE_CACHE, XDG_CACHE_HOME and HOME are all unset); {FIX}"
    )]
    NoCacheDir,
    /// The file exists but could not be loaded as ONNX Runtime.
    #[error("cannot load ONNX Runtime from {} (from {origin}): {message}; {FIX}", path.display())]
    Load {
        /// The path tried.
        path: PathBuf,
        /// Where the path came from.
        origin: LibrarySource,
        /// The loader's account.
        message: String,
    },
    /// The library loaded, but its environment could not be created.
    #[error("ONNX Runtime from {} loaded but could not start: {message}", path.display())]
    Environment {
        /// The library.
        path: PathBuf,
        /// ONNX Runtime's account.
        message: String,
    },
    /// A different library was already loaded in this process.
    #[error("ONNX Runtime is already loaded from {}; cannot also load {} (from {origin}) in the same process; use one path", loaded.display(), requested.display())]
    AlreadyLoaded {
        /// The library in use.
        loaded: PathBuf,
        /// The one asked for now.
        requested: PathBuf,
        /// Where the requested path came from.
        origin: LibrarySource,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(s: &str) -> Option<OsString> {
        Some(OsString::from(s))
    }

    #[test]
    fn explicit_path_wins_over_env_and_cache() {
        let (p, s) = locate_with(
            Some(Path::new("/opt/ort.so")),
            os("/env.so"),
            os("/c"),
            None,
            os("/h"),
        )
        .unwrap();
        assert_eq!(
            (p, s),
            (PathBuf::from("/opt/ort.so"), LibrarySource::Config)
        );
    }

    #[test]
    fn env_var_wins_over_cache() {
        let (p, s) = locate_with(None, os("/env.so"), os("/c"), None, os("/h")).unwrap();
        assert_eq!((p, s), (PathBuf::from("/env.so"), LibrarySource::Env));
    }

    #[test]
    fn cache_root_is_tidegate_cache_then_xdg_then_home() {
        let lib = "onnxruntime/1.31.1/libonnxruntime.so";
        let (p, s) = locate_with(None, None, os("/c"), os("/x"), os("/h")).unwrap();
        assert_eq!((p, s), (Path::new("/c").join(lib), LibrarySource::Cache));
        let (p, _) = locate_with(None, None, None, os("/x"), os("/h")).unwrap();
        assert_eq!(p, Path::new("/x/tidegate").join(lib));
        let (p, _) = locate_with(None, None, None, None, os("/h")).unwrap();
        assert_eq!(p, Path::new("/h/.cache/tidegate").join(lib));
    }

    #[test]
    fn no_path_and_no_home_is_a_one_line_error_saying_what_to_do() {
        let err = locate_with(None, None, None, None, None)
            .unwrap_err()
            .to_string();
        assert!(!err.contains('\n'));
        assert!(
            err.contains("make setup") && err.contains("ORT_DYLIB_PATH"),
            "{err}"
        );
    }

    #[test]
    fn loader_messages_are_flattened_to_one_line() {
        assert_eq!(one_line("a\n  b\tc "), "a b c");
    }
}
