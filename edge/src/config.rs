//! The edge's configuration: a TOML file, with `TIDEGATE_*` environment
//! variables and flags layered on top by the binary.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// Everything an edge needs.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EdgeConfig {
    /// This edge's name, as listed in the gateway's `[[edges]]`.
    pub name: String,
    /// Its token. Prefer the `TIDEGATE_EDGE_TOKEN` environment variable.
    #[serde(default)]
    pub token: Secret,
    /// How to reach the gateway.
    pub gateway: GatewayConfig,
    /// The cameras.
    #[serde(default)]
    pub cameras: Vec<CameraConfig>,
}

/// How to reach the gateway.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayConfig {
    /// Gateway QUIC address.
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

/// One camera.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CameraConfig {
    /// Name, unique within this edge.
    pub name: String,
    /// Source: `image:///path.png`, `test://smpte`, `file:///path.mp4`.
    pub uri: String,
    /// Model to run on its frames.
    pub model: String,
    /// End-to-end budget per frame (ms).
    #[serde(default = "default_budget_ms")]
    pub budget_ms: u32,
    /// Frame-rate cap.
    #[serde(default = "default_max_fps")]
    pub max_fps: f64,
}

fn default_budget_ms() -> u32 {
    80
}
fn default_max_fps() -> f64 {
    10.0
}

/// A secret string: redacted in `Debug`.
#[derive(Clone, Default, Deserialize)]
#[serde(transparent)]
pub struct Secret(pub String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_empty() {
            "<unset>"
        } else {
            "<redacted>"
        })
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

impl EdgeConfig {
    /// Reads a file; a relative `gateway.ca` resolves against its directory.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let mut cfg: EdgeConfig = toml::from_str(&text).map_err(|e| ConfigError::Parse {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        if cfg.gateway.ca.is_relative() {
            cfg.gateway.ca = path
                .parent()
                .unwrap_or(Path::new("."))
                .join(&cfg.gateway.ca);
        }
        Ok(cfg)
    }

    /// Checks what serde cannot. Errors name the camera.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.token.0.is_empty() {
            return Err(ConfigError::Invalid(format!(
                "edge '{}' has no token: set TIDEGATE_EDGE_TOKEN or `token` in the config",
                self.name
            )));
        }
        let mut seen = std::collections::HashSet::new();
        for c in &self.cameras {
            if !seen.insert(&c.name) {
                return Err(ConfigError::Invalid(format!(
                    "camera '{}' is listed twice",
                    c.name
                )));
            }
            if c.model.trim().is_empty() {
                return Err(ConfigError::Invalid(format!(
                    "camera '{}' has no model: set `model = \"blazeface\"` (or another model the gateway serves)",
                    c.name
                )));
            }
            if !(c.max_fps > 0.0 && c.max_fps <= 240.0) {
                return Err(ConfigError::Invalid(format!(
                    "camera '{}': max_fps {} must be in (0, 240]",
                    c.name, c.max_fps
                )));
            }
            if c.budget_ms == 0 {
                return Err(ConfigError::Invalid(format!(
                    "camera '{}': budget_ms must be positive",
                    c.name
                )));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> EdgeConfig {
        toml::from_str(text).unwrap()
    }

    const BASE: &str =
        "name = \"e\"\ntoken = \"t\"\n[gateway]\naddr = \"127.0.0.1:4433\"\nca = \"ca.pem\"\n";

    #[test]
    fn camera_without_model_is_named_in_the_error() {
        let cfg = parse(&format!(
            "{BASE}[[cameras]]\nname = \"door\"\nuri = \"test://smpte\"\nmodel = \"\"\n"
        ));
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.contains("'door'") && err.contains("model"), "{err}");
    }

    #[test]
    fn defaults_give_an_80_ms_budget() {
        let cfg = parse(&format!(
            "{BASE}[[cameras]]\nname = \"c\"\nuri = \"test://smpte\"\nmodel = \"m\"\n"
        ));
        cfg.validate().unwrap();
        assert_eq!(cfg.cameras[0].budget_ms, 80);
    }

    #[test]
    fn token_is_redacted_in_debug() {
        let cfg = parse(BASE);
        let dbg = format!("{cfg:?}");
        assert!(dbg.contains("<redacted>") && !dbg.contains("token: Secret(\"t\")"));
    }
}
