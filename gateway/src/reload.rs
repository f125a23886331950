//! Configuration reload while the gateway runs (SIGHUP, or `POST
//! /api/v1/reload`).
//!
//! The file is read and validated again, and the TLS certificate and key
//! it names are read and checked. If anything is unusable, nothing changes
//! and the error says why. Otherwise:
//! - its credentials (`[[edges]]`, `[[workers]]`, `http.admin_token_sha256`)
//!   replace the ones in force ([`Access::replace`]): new edges and workers
//!   may connect at once, and connections whose name and token are no
//!   longer listed are closed;
//! - a certificate or key that changed (other files, or new contents in
//!   the same files, as a certificate renewal writes them) serves every new
//!   QUIC handshake; connections already up keep theirs.
//!
//! The other sections are read at start only; the report names those that
//! now differ from what runs, so the operator knows a restart is needed.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::Serialize;
use sha2::{Digest, Sha256};
use tidegate_protocol::quic::Congestion;

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
    /// `reloaded` when the QUIC certificate or key changed and now serves
    /// new handshakes, else `unchanged`.
    pub tls: &'static str,
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
    /// The certificate or key it names is unusable; nothing changed.
    #[error(
        "QUIC certificate {cert} / key {key}: {message}; the configuration in force is unchanged"
    )]
    Tls {
        /// `quic.cert`.
        cert: PathBuf,
        /// `quic.key`.
        key: PathBuf,
        /// What was wrong.
        message: String,
    },
}

/// The QUIC endpoint whose certificate a reload swaps, and the files it
/// serves now.
pub struct TlsReload {
    endpoint: quinn::Endpoint,
    /// What the endpoint's connections send with (read at start only).
    congestion: Congestion,
    /// Paths and digest of what the endpoint serves; `None` digest: not
    /// known (then the next reload installs the files).
    serving: Mutex<(PathBuf, PathBuf, Option<[u8; 32]>)>,
}

impl std::fmt::Debug for TlsReload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let serving = self.serving.lock().unwrap_or_else(|e| e.into_inner());
        f.debug_struct("TlsReload")
            .field("cert", &serving.0)
            .field("key", &serving.1)
            .finish_non_exhaustive()
    }
}

impl TlsReload {
    /// `endpoint` serves `cert` and `key` now, with `congestion`, which a
    /// certificate change keeps.
    pub fn new(endpoint: quinn::Endpoint, cert: &Path, key: &Path, congestion: Congestion) -> Self {
        let digest = tls_digest(cert, key).ok();
        TlsReload {
            endpoint,
            congestion,
            serving: Mutex::new((cert.to_path_buf(), key.to_path_buf(), digest)),
        }
    }
}

/// The SHA-256 of a certificate file and a key file together.
fn tls_digest(cert: &Path, key: &Path) -> std::io::Result<[u8; 32]> {
    let mut h = Sha256::new();
    for p in [cert, key] {
        let bytes = std::fs::read(p)?;
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(bytes);
    }
    Ok(h.finalize().into())
}

/// A certificate change checked and ready to install.
struct TlsChange {
    config: quinn::ServerConfig,
    serving: (PathBuf, PathBuf, Option<[u8; 32]>),
}

impl TlsReload {
    /// Reads and checks `cert` and `key` if they differ from what is
    /// served; `None` when they do not.
    fn prepare(&self, cert: &Path, key: &Path) -> Result<Option<TlsChange>, ReloadError> {
        let bad = |message: String| ReloadError::Tls {
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
            message,
        };
        let digest = tls_digest(cert, key).map_err(|e| bad(e.to_string()))?;
        let serving = self.serving.lock().unwrap_or_else(|e| e.into_inner());
        if serving.0 == cert && serving.1 == key && serving.2 == Some(digest) {
            return Ok(None);
        }
        let config = tidegate_protocol::quic::login_gated_server_config(cert, key, self.congestion)
            .map_err(|e| bad(e.to_string()))?;
        Ok(Some(TlsChange {
            config,
            serving: (cert.to_path_buf(), key.to_path_buf(), Some(digest)),
        }))
    }

    fn install(&self, change: TlsChange) {
        self.endpoint.set_server_config(Some(change.config));
        *self.serving.lock().unwrap_or_else(|e| e.into_inner()) = change.serving;
    }
}

/// Reloads the configuration; shared by the SIGHUP handler and the API.
pub struct Reloader {
    load: Option<LoadConfig>,
    /// The configuration the gateway started with: its non-credential
    /// sections are what runs.
    running: Config,
    access: Arc<Access>,
    /// The endpoint's certificate; `None`: not reloadable (tests).
    tls: Option<TlsReload>,
    metrics: Metrics,
    /// One reload at a time, so reports never interleave.
    serial: Mutex<()>,
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
    /// the file again (`None`: started without one); `tls` swaps the QUIC
    /// endpoint's certificate.
    pub fn new(
        load: Option<LoadConfig>,
        running: Config,
        access: Arc<Access>,
        tls: Option<TlsReload>,
        metrics: Metrics,
    ) -> Self {
        Reloader {
            load,
            running,
            access,
            tls,
            metrics,
            serial: Mutex::new(()),
        }
    }

    fn apply(&self, load: &LoadConfig) -> Result<ReloadReport, ReloadError> {
        let new = load().map_err(ReloadError::Config)?;
        // Check everything before changing anything.
        let tls_change = match &self.tls {
            Some(t) => t.prepare(&new.quic.cert, &new.quic.key)?,
            None => None,
        };
        let credentials = self.access.replace(Credentials::from_config(&new));
        let tls = match (&self.tls, tls_change) {
            (Some(t), Some(change)) => {
                t.install(change);
                "reloaded"
            }
            _ => "unchanged",
        };
        Ok(ReloadReport {
            credentials,
            tls,
            needs_restart: needs_restart(&self.running, &new),
        })
    }

    /// Reads the file and applies its credentials. Blocking (file I/O):
    /// call it from a blocking thread.
    pub fn reload(&self) -> Result<ReloadReport, ReloadError> {
        let _one = self.serial.lock().unwrap_or_else(|e| e.into_inner());
        let outcome = match &self.load {
            None => Err(ReloadError::NoFile),
            Some(load) => self.apply(load),
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
            // Nothing was tried (a SIGHUP to a gateway started without
            // `--config`): the credentials in force are as they were, and
            // no later reload could clear an alert raised by it.
            Err(ReloadError::NoFile) => {}
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
    // (quic.cert and quic.key reload.)
    if running.quic.listen != new.quic.listen {
        out.push("quic.listen");
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
        let r = Reloader::new(Some(load), running, access.clone(), None, metrics.clone());
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
        assert_eq!(report.needs_restart, ["quic.listen", "scheduler"]);
        assert_eq!(report.tls, "unchanged", "no endpoint to reload");
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
        let metrics = Metrics::new();
        let r = Reloader::new(None, running, access, None, metrics.clone());
        assert!(matches!(r.reload(), Err(ReloadError::NoFile)));
        // Not a failed reload: the alert on failed reloads stays quiet.
        let text = metrics.render();
        assert!(
            text.contains("tidegate_config_last_reload_successful 1"),
            "{text}"
        );
        // Exported at 0 from the start, and still 0.
        assert!(
            text.contains("tidegate_config_reloads_total{result=\"error\"} 0"),
            "{text}"
        );
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
                tls: "unchanged",
                needs_restart: vec![],
            }
        );
    }

    /// A TLS client that trusts only `ca`, dialling `addr`: whether the
    /// handshake succeeds.
    async fn handshake_ok(addr: std::net::SocketAddr, ca: &Path) -> bool {
        let client = tidegate_protocol::quic::client_config(ca).expect("client config");
        tidegate_protocol::quic::dial(addr, "localhost", client)
            .await
            .is_ok()
    }

    #[tokio::test]
    async fn a_renewed_certificate_serves_new_handshakes_and_a_bad_one_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        let names = ["localhost".to_string()];
        crate::certs::generate(&a, &names).expect("certs a");
        crate::certs::generate(&b, &names).expect("certs b");
        let (cert, key) = (a.join("gateway.pem"), a.join("gateway.key"));
        let server = tidegate_protocol::quic::server_config(&cert, &key).unwrap();
        let endpoint = quinn::Endpoint::server(server, "127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = endpoint.local_addr().unwrap();
        let accept = {
            let endpoint = endpoint.clone();
            tokio::spawn(async move {
                while let Some(incoming) = endpoint.accept().await {
                    // Keep each connection until the client closes it.
                    if let Ok(conn) = incoming.await {
                        tokio::spawn(async move { conn.closed().await });
                    }
                }
            })
        };
        let file = |cert: &Path, key: &Path| {
            format!(
                "[quic]\ncert = \"{}\"\nkey = \"{}\"\n{}",
                cert.display(),
                key.display(),
                edge("e", "t")
            )
        };
        let text = Arc::new(Mutex::new(file(&cert, &key)));
        let running = config(&text.lock().unwrap());
        let access = Arc::new(Access::new(Credentials::from_config(&running)));
        let t = text.clone();
        let load: LoadConfig = Box::new(move || Ok(config(&t.lock().expect("test lock"))));
        let r = Reloader::new(
            Some(load),
            running,
            access,
            Some(TlsReload::new(
                endpoint.clone(),
                &cert,
                &key,
                Congestion::default(),
            )),
            Metrics::new(),
        );
        let (ca_a, ca_b) = (a.join("ca.pem"), b.join("ca.pem"));
        assert!(handshake_ok(addr, &ca_a).await);
        assert!(!handshake_ok(addr, &ca_b).await);
        assert_eq!(r.reload().unwrap().tls, "unchanged");

        // Renewed in place: the same paths, new contents (b's).
        std::fs::copy(b.join("gateway.pem"), &cert).unwrap();
        std::fs::copy(b.join("gateway.key"), &key).unwrap();
        assert!(handshake_ok(addr, &ca_a).await, "not reloaded yet");
        let report = r.reload().unwrap();
        assert_eq!(report.tls, "reloaded");
        assert!(report.needs_restart.is_empty(), "{report:?}");
        assert!(handshake_ok(addr, &ca_b).await);
        assert!(!handshake_ok(addr, &ca_a).await);
        assert_eq!(r.reload().unwrap().tls, "unchanged");

        // A key that does not parse: an error naming the files, and the
        // endpoint keeps serving b.
        std::fs::write(&key, "not a key").unwrap();
        let err = r.reload().unwrap_err().to_string();
        assert!(
            err.contains("gateway.key") && err.contains("unchanged"),
            "{err}"
        );
        assert!(handshake_ok(addr, &ca_b).await);
        // Other files: a new pair, c, under new names.
        let (cert2, key2) = (dir.path().join("c.pem"), dir.path().join("c.key"));
        crate::certs::generate(&dir.path().join("c"), &names).unwrap();
        std::fs::copy(dir.path().join("c/gateway.pem"), &cert2).unwrap();
        std::fs::copy(dir.path().join("c/gateway.key"), &key2).unwrap();
        *text.lock().unwrap() = file(&cert2, &key2);
        assert_eq!(r.reload().unwrap().tls, "reloaded");
        assert!(handshake_ok(addr, &dir.path().join("c/ca.pem")).await);
        endpoint.close(0u32.into(), b"done");
        accept.abort();
    }
}
