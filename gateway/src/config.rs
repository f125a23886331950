//! The gateway's configuration: a TOML file, with `TIDEGATE_*` environment
//! variables and command-line flags layered on top (flags left unset never
//! clobber the file).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// Everything the gateway needs to run.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// QUIC listener for edges and workers.
    #[serde(default)]
    pub quic: QuicConfig,
    /// HTTP listener for `/metrics` and the API.
    #[serde(default)]
    pub http: HttpConfig,
    /// Scheduling bounds and margins.
    #[serde(default)]
    pub scheduler: SchedulerConfig,
    /// Edges allowed to connect.
    #[serde(default)]
    pub edges: Vec<Principal>,
    /// Workers allowed to connect.
    #[serde(default)]
    pub workers: Vec<Principal>,
}

/// QUIC listener settings.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuicConfig {
    /// Address to bind (UDP).
    #[serde(default = "default_quic_listen")]
    pub listen: SocketAddr,
    /// PEM certificate chain.
    #[serde(default = "default_cert")]
    pub cert: PathBuf,
    /// PEM private key.
    #[serde(default = "default_key")]
    pub key: PathBuf,
}

impl Default for QuicConfig {
    fn default() -> Self {
        QuicConfig {
            listen: default_quic_listen(),
            cert: default_cert(),
            key: default_key(),
        }
    }
}

fn default_quic_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 4433))
}
fn default_cert() -> PathBuf {
    PathBuf::from("certs/gateway.pem")
}
fn default_key() -> PathBuf {
    PathBuf::from("certs/gateway.key")
}

/// HTTP listener settings.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpConfig {
    /// Address to bind (TCP).
    #[serde(default = "default_http_listen")]
    pub listen: SocketAddr,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            listen: default_http_listen(),
        }
    }
}

fn default_http_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9090))
}

/// Scheduling settings.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SchedulerConfig {
    /// Time reserved to send a result back, on top of the measured RTT (ms).
    #[serde(default = "default_return_margin_ms")]
    pub return_margin_ms: u32,
    /// Most frames queued in total.
    #[serde(default = "default_max_queued")]
    pub max_queued: usize,
    /// Most frames queued per edge.
    #[serde(default = "default_max_queued_per_edge")]
    pub max_queued_per_edge: usize,
    /// Batches sent to a worker before the previous ones return (1..=4).
    #[serde(default = "default_pipeline_depth")]
    pub pipeline_depth: usize,
    /// Send cameras frame-rate hints when their frames are being shed.
    #[serde(default = "default_true")]
    pub hints: bool,
    /// Hint measurement window (ms).
    #[serde(default = "default_hint_window_ms")]
    pub hint_window_ms: u32,
    /// Fraction of a window's frames lost to overload that lowers the rate.
    #[serde(default = "default_hint_shed_ratio")]
    pub hint_shed_ratio: f64,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            return_margin_ms: default_return_margin_ms(),
            max_queued: default_max_queued(),
            max_queued_per_edge: default_max_queued_per_edge(),
            pipeline_depth: default_pipeline_depth(),
            hints: true,
            hint_window_ms: default_hint_window_ms(),
            hint_shed_ratio: default_hint_shed_ratio(),
        }
    }
}

fn default_pipeline_depth() -> usize {
    2
}
fn default_true() -> bool {
    true
}
fn default_hint_window_ms() -> u32 {
    1000
}
fn default_hint_shed_ratio() -> f64 {
    0.1
}

fn default_return_margin_ms() -> u32 {
    2
}
fn default_max_queued() -> usize {
    4096
}
fn default_max_queued_per_edge() -> usize {
    256
}

/// An edge or worker allowed to connect, with its token's SHA-256 digest.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Principal {
    /// Name it says in `Hello`.
    pub name: String,
    /// Hex SHA-256 of its token (`tidegate-gateway hash-token`).
    pub token_sha256: String,
}

impl std::fmt::Debug for Principal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Principal")
            .field("name", &self.name)
            .field("token_sha256", &"<redacted>")
            .finish()
    }
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
    /// The file is not valid TOML for this schema.
    #[error("invalid config {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What the parser said (with line and column).
        message: String,
    },
    /// A value is inconsistent.
    #[error("invalid config: {0}")]
    Invalid(String),
}

impl Config {
    /// Reads a config file. Relative certificate paths are resolved against
    /// the file's directory.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let mut cfg: Config = toml::from_str(&text).map_err(|e| ConfigError::Parse {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        let base = path.parent().unwrap_or(Path::new("."));
        for p in [&mut cfg.quic.cert, &mut cfg.quic.key] {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        }
        Ok(cfg)
    }

    /// The defaults (no file).
    pub fn default_config() -> Config {
        toml::from_str("").expect("empty config uses defaults")
    }

    /// Checks values that serde cannot.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for p in self.edges.iter().chain(&self.workers) {
            let ok =
                p.token_sha256.len() == 64 && p.token_sha256.bytes().all(|b| b.is_ascii_hexdigit());
            if !ok {
                return Err(ConfigError::Invalid(format!(
                    "token_sha256 of '{}' is not a 64-digit hex SHA-256; make one with `tidegate-gateway hash-token <TOKEN>`",
                    p.name
                )));
            }
        }
        let mut names: Vec<&str> = self.edges.iter().map(|p| p.name.as_str()).collect();
        names.sort_unstable();
        if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
            return Err(ConfigError::Invalid(format!(
                "edge '{}' is listed twice",
                w[0]
            )));
        }
        if !(1..=4).contains(&self.scheduler.pipeline_depth) {
            return Err(ConfigError::Invalid(format!(
                "scheduler.pipeline_depth = {} must be 1..=4",
                self.scheduler.pipeline_depth
            )));
        }
        if self.scheduler.hint_window_ms < 100 {
            return Err(ConfigError::Invalid(format!(
                "scheduler.hint_window_ms = {} is too short to measure a rate; use at least 100",
                self.scheduler.hint_window_ms
            )));
        }
        if !(0.0..1.0).contains(&self.scheduler.hint_shed_ratio) {
            return Err(ConfigError::Invalid(format!(
                "scheduler.hint_shed_ratio = {} must be in [0, 1)",
                self.scheduler.hint_shed_ratio
            )));
        }
        if self.scheduler.max_queued == 0 || self.scheduler.max_queued_per_edge == 0 {
            return Err(ConfigError::Invalid(
                "scheduler.max_queued and max_queued_per_edge must be at least 1".into(),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_field_is_rejected_with_its_name() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("g.toml");
        std::fs::write(&p, "[quic]\nlisten = \"127.0.0.1:1\"\nbogus = 1\n").unwrap();
        let err = Config::load(&p).unwrap_err().to_string();
        assert!(err.contains("bogus"), "{err}");
    }

    #[test]
    fn relative_cert_paths_resolve_against_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("g.toml");
        std::fs::write(&p, "[quic]\ncert = \"c/x.pem\"\n").unwrap();
        let cfg = Config::load(&p).unwrap();
        assert_eq!(cfg.quic.cert, dir.path().join("c/x.pem"));
    }

    #[test]
    fn bad_token_digest_is_reported_with_the_fix() {
        let cfg: Config =
            toml::from_str("[[edges]]\nname = \"e\"\ntoken_sha256 = \"abc\"\n").unwrap();
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.contains("hash-token") && err.contains("'e'"), "{err}");
    }

    #[test]
    fn debug_output_redacts_token_digests() {
        let cfg: Config = toml::from_str(&format!(
            "[[edges]]\nname = \"e\"\ntoken_sha256 = \"{}\"\n",
            "a".repeat(64)
        ))
        .unwrap();
        assert!(!format!("{cfg:?}").contains(&"a".repeat(64)));
    }
}
