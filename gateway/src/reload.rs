//! Configuration reload while the gateway runs (SIGHUP, or `POST
//! /api/v1/reload`).
//!
//! The file is read and validated again. If it is unusable, nothing changes
//! and the error says why. If it is usable, its credentials (`[[edges]]`,
//! `[[workers]]`, `http.admin_token_sha256`) replace the ones in force
//! ([`Access::replace`]): new edges and workers may connect at once, and
//! connections whose name and token are no longer listed are closed. The
//! other sections are read at start only; the report names those that now
//! differ from what runs, so the operator knows a restart is needed.

use std::sync::Arc;

use serde::Serialize;

use crate::auth::{Access, CredentialChanges, Credentials};
use crate::config::{Config, ConfigError};
use crate::metrics::Metrics;

/// Reads the configuration again (the file, then the command line's
/// overrides) and validates it.
pub type LoadConfig = Box<dyn Fn() -> Result<Config, ConfigError> + Send + Sync>;

/// What a reload did.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReloadReport {
    /// The credential changes and the connections they closed.
    #[serde(flatten)]
    pub credentials: CredentialChanges,
    /// Sections that differ from the running configuration and were not
    /// applied: they take effect at the next restart.
    pub needs_restart: Vec<&'static str>,
}

/// Why a reload changed nothing.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReloadError {
    /// The gateway runs on built-in defaults: there is no file to read.
    #[error("the gateway was started without --config: there is no file to reload")]
    NoFile,
    /// The file is unreadable or invalid; the configuration in force stays.
    #[error("{0}; the configuration in force is unchanged")]
    Config(#[source] ConfigError),
}

/// Reloads the configuration; shared by the SIGHUP handler and the API.
pub struct Reloader {
    load: Option<LoadConfig>,
    /// The configuration the gateway started with: its non-credential
    /// sections are what runs.
    running: Config,
    access: Arc<Access>,
    metrics: Metrics,
    /// One reload at a time, so reports never interleave.
    serial: std::sync::Mutex<()>,
}

impl std::fmt::Debug for Reloader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reloader")
            .field("has_file", &self.load.is_some())
            .finish_non_exhaustive()
    }
}

impl Reloader {
    /// A reloader for a gateway that started with `running`; `load` reads
    /// the file again (`None`: started without one).
    pub fn new(
        load: Option<LoadConfig>,
        running: Config,
        access: Arc<Access>,
        metrics: Metrics,
    ) -> Self {
        Reloader {
            load,
            running,
            access,
            metrics,
            serial: std::sync::Mutex::new(()),
        }
    }

    /// Reads the file and applies its credentials. Blocking (file I/O):
    /// call it from a blocking thread.
    pub fn reload(&self) -> Result<ReloadReport, ReloadError> {
        let _one = self.serial.lock().unwrap_or_else(|e| e.into_inner());
        let outcome = match &self.load {
            None => Err(ReloadError::NoFile),
            Some(load) => load().map_err(ReloadError::Config).map(|new| {
                let needs_restart = needs_restart(&self.running, &new);
                let credentials = self.access.replace(Credentials::from_config(&new));
                ReloadReport {
                    credentials,
                    needs_restart,
                }
            }),
        };
        match &outcome {
            Ok(r) => {
                self.metrics.config_reloads.with_label_values(&["ok"]).inc();
                self.metrics.config_last_reload_ok.set(1);
                for v in &r.credentials.revoked {
                    let role = match v.role {
                        tidegate_protocol::Role::Edge => "edge",
                        tidegate_protocol::Role::Worker => "worker",
                    };
                    self.metrics.revoked.with_label_values(&[role]).inc();
                }
            }
            Err(_) => {
                let m = &self.metrics;
                m.config_reloads.with_label_values(&["error"]).inc();
                m.config_last_reload_ok.set(0);
            }
        }
        outcome
    }
}

/// The sections of `new` that differ from `running` and that only a
/// restart applies.
pub fn needs_restart(running: &Config, new: &Config) -> Vec<&'static str> {
    let mut out = Vec::new();
    if running.quic != new.quic {
        out.push("quic");
    }
    if running.http.listen != new.http.listen {
        out.push("http.listen");
    }
    if running.scheduler != new.scheduler {
        out.push("scheduler");
    }
    if running.leasing != new.leasing {
        out.push("leasing");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::hash_token;

    fn config(text: &str) -> Config {
        let c: Config = toml::from_str(text).expect("test config parses");
        c.validate().expect("test config is valid");
        c
    }

    fn edge(name: &str, token: &str) -> String {
        format!(
            "[[edges]]\nname = \"{name}\"\ntoken_sha256 = \"{}\"\n",
            hash_token(token)
        )
    }

    /// A reloader whose file is the `text` in the returned cell.
    fn reloader(
        first: &str,
    ) -> (
        Reloader,
        Arc<std::sync::Mutex<String>>,
        Arc<Access>,
        Metrics,
    ) {
        let file = Arc::new(std::sync::Mutex::new(first.to_string()));
        let running = config(first);
        let access = Arc::new(Access::new(Credentials::from_config(&running)));
        let metrics = Metrics::new();
        let f = file.clone();
        let load: LoadConfig = Box::new(move || {
            let text = f.lock().expect("test lock").clone();
            let c: Config = toml::from_str(&text).map_err(|e| ConfigError::Parse {
                path: "gateway.toml".into(),
                message: e.to_string(),
            })?;
            c.validate()?;
            Ok(c)
        });
        let r = Reloader::new(Some(load), running, access.clone(), metrics.clone());
        (r, file, access, metrics)
    }

    #[test]
    fn a_reload_applies_credentials_and_names_what_needs_a_restart() {
        let first = edge("a", "ta");
        let (r, file, access, metrics) = reloader(&first);
        let a = access
            .admit(1, tidegate_protocol::Role::Edge, "a", "ta")
            .expect("a admitted");
        *file.lock().unwrap() = format!(
            "[scheduler]\nmax_queued = 10\n[quic]\nlisten = \"127.0.0.1:5000\"\n{}",
            edge("b", "tb")
        );
        let report = r.reload().expect("valid file reloads");
        assert_eq!(report.credentials.edges.added, ["b"]);
        assert_eq!(report.credentials.edges.removed, ["a"]);
        assert_eq!(report.needs_restart, ["quic", "scheduler"]);
        assert_eq!(report.credentials.revoked.len(), 1);
        assert!(a.revoked.is_cancelled());
        assert!(
            access
                .admit(2, tidegate_protocol::Role::Edge, "b", "tb")
                .is_some()
        );
        let text = metrics.render();
        assert!(text.contains("tidegate_config_reloads_total{result=\"ok\"} 1"));
        assert!(text.contains("tidegate_connections_revoked_total{role=\"edge\"} 1"));
        assert!(text.contains("tidegate_config_last_reload_successful 1"));
    }

    #[test]
    fn an_invalid_file_changes_nothing_and_says_why() {
        let first = edge("a", "ta");
        let (r, file, access, metrics) = reloader(&first);
        for bad in [
            "[[edges]]\nname = \"a\"\n".to_string(),
            "[[edges]]\nname = \"a\"\ntoken_sha256 = \"not-hex\"\n".to_string(),
            format!("{}{}", edge("a", "x"), edge("a", "x")),
            "[scheduler]\npipeline_depth = 9\n".to_string(),
        ] {
            *file.lock().unwrap() = bad.clone();
            let err = r.reload().expect_err(&bad).to_string();
            assert!(
                err.ends_with("the configuration in force is unchanged"),
                "{err}"
            );
            assert!(
                access
                    .admit(1, tidegate_protocol::Role::Edge, "a", "ta")
                    .is_some(),
                "after {bad:?}"
            );
        }
        let text = metrics.render();
        assert!(text.contains("tidegate_config_reloads_total{result=\"error\"} 4"));
        assert!(text.contains("tidegate_config_last_reload_successful 0"));
        // and a good file again clears it
        *file.lock().unwrap() = first.clone();
        r.reload().expect("valid again");
        assert!(
            metrics
                .render()
                .contains("tidegate_config_last_reload_successful 1")
        );
    }

    #[test]
    fn without_a_file_there_is_nothing_to_reload() {
        let running = Config::default_config();
        let access = Arc::new(Access::new(Credentials::from_config(&running)));
        let r = Reloader::new(None, running, access, Metrics::new());
        assert!(matches!(r.reload(), Err(ReloadError::NoFile)));
    }

    #[test]
    fn an_unchanged_file_changes_nothing() {
        let first = format!(
            "[http]\nadmin_token_sha256 = \"{}\"\n{}",
            hash_token("adm"),
            edge("a", "ta")
        );
        let (r, _file, _access, _metrics) = reloader(&first);
        let report = r.reload().expect("reloads");
        assert_eq!(
            report,
            ReloadReport {
                credentials: CredentialChanges {
                    edges: Default::default(),
                    workers: Default::default(),
                    admin_token: "unchanged",
                    revoked: vec![],
                },
                needs_restart: vec![],
            }
        );
    }
}
