//! The gateway's configuration: a TOML file, with `TIDEGATE_*` environment
//! variables and command-line flags layered on top (flags left unset never
//! clobber the file).
//!
//! This module owns the file's schema, its defaults, reading it and
//! checking what serde cannot; each section lives in a child module
//! (`listeners`, `principals`, `scheduling`, `limits`, `status_page`,
//! `leasing`). It must not act on what it reads: no socket is bound, no
//! certificate or ledger opened, no provider started here (`preflight.rs`
//! and `main.rs` do that).

use std::path::Path;

use serde::Deserialize;

mod leasing;
mod limits;
mod listeners;
mod principals;
mod scheduling;
mod status_page;

pub use leasing::{
    LeasingConfig, MAX_LEASING_SECS, MAX_SPEND_CAP_PER_HOUR, OnStop, ProcessProviderConfig,
    ProviderKind, ScaledModel,
};
pub use limits::LimitsConfig;
pub use listeners::{HttpConfig, QuicConfig};
pub use principals::Principal;
pub use scheduling::SchedulerConfig;
pub use status_page::StatusConfig;

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
    /// GPU leasing and autoscaling; absent: no leasing, workers come from
    /// `[[workers]]` only.
    #[serde(default)]
    pub leasing: Option<LeasingConfig>,
    /// What one peer may make the gateway hold: partly received frames,
    /// connections before login, connections and cameras per edge name.
    #[serde(default)]
    pub limits: LimitsConfig,
    /// The status page: its camera thumbnails.
    #[serde(default)]
    pub status: StatusConfig,
}

/// Why the configuration is unusable (the client kit's, shared by every
/// binary).
pub use tidegate_kit::config::ConfigError;

impl Config {
    /// Reads a config file. Relative certificate and `[leasing]` paths are
    /// resolved against the file's directory.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let mut cfg: Config = tidegate_kit::config::read_toml(path)?;
        let base = path.parent().unwrap_or(Path::new("."));
        for p in [&mut cfg.quic.cert, &mut cfg.quic.key] {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        }
        if let Some(l) = cfg.leasing.as_mut() {
            l.resolve_paths(base);
        }
        Ok(cfg)
    }

    /// The defaults (no file).
    pub fn default_config() -> Config {
        toml::from_str("").expect("empty config uses defaults")
    }

    /// Checks values that serde cannot. The first fault found, in the
    /// order of the sections below, is the one reported.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.http.validate()?;
        self.validate_principals()?;
        self.scheduler.validate()?;
        self.validate_weights()?;
        self.limits.validate()?;
        self.status.validate()?;
        if let Some(l) = &self.leasing {
            l.validate()?;
        }
        Ok(())
    }
}

/// serde's default for the switches that are on unless turned off.
fn default_true() -> bool {
    true
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
    fn debug_output_redacts_token_digests() {
        let cfg: Config = toml::from_str(&format!(
            "[[edges]]\nname = \"e\"\ntoken_sha256 = \"{}\"\n",
            "a".repeat(64)
        ))
        .unwrap();
        assert!(!format!("{cfg:?}").contains(&"a".repeat(64)));
        let cfg: Config = toml::from_str(&format!(
            "[http]\nadmin_token_sha256 = \"{}\"\n",
            "b".repeat(64)
        ))
        .unwrap();
        cfg.validate().unwrap();
        assert!(!format!("{cfg:?}").contains(&"b".repeat(64)));
        let bad: Config = toml::from_str("[http]\nadmin_token_sha256 = \"s3cret\"\n").unwrap();
        let e = bad.validate().unwrap_err().to_string();
        assert!(
            e.contains("http.admin_token_sha256") && e.contains("hash-token"),
            "{e}"
        );
    }
}
