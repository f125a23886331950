//! The worker's configuration: a TOML file, with `TIDEGATE_*` environment
//! variables and flags layered on top by the binary.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

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
            .finish()
    }
}

/// How to reach the gateway.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayConfig {
    /// QUIC address.
    pub addr: SocketAddr,
    /// Name in the gateway's certificate.
    #[serde(default = "default_server_name")]
    pub server_name: String,
    /// CA certificate (PEM) to trust.
    pub ca: PathBuf,
}

fn default_server_name() -> String {
    "localhost".into()
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
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuntimeConfig {
    /// Path of libonnxruntime.so (default: ORT_DYLIB_PATH, then the cache).
    #[serde(default)]
    pub library: Option<PathBuf>,
    /// Intra-op threads per session (0 = one per core).
    #[serde(default)]
    pub intra_threads: usize,
}

/// Why the configuration is unusable.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file does not parse.
    #[error("invalid config {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        message: String,
    },
    /// A value is wrong.
    #[error("invalid config: {0}")]
    Invalid(String),
}

impl WorkerConfig {
    /// Reads a file; relative paths resolve against its directory.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let mut cfg: WorkerConfig = toml::from_str(&text).map_err(|e| ConfigError::Parse {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        let base = path.parent().unwrap_or(Path::new("."));
        for p in [&mut cfg.gateway.ca, &mut cfg.models.dir] {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        }
        if let Some(lib) = cfg.runtime.library.as_mut().filter(|l| l.is_relative()) {
            *lib = base.join(&*lib);
        }
        Ok(cfg)
    }

    /// Checks what serde cannot.
    pub fn validate(&self) -> Result<(), ConfigError> {
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
    }
}
