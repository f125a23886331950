//! `[quic]` and `[http]`: where the gateway listens, with what certificate,
//! and what one HTTP client may hold. Nothing is bound here.

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::Deserialize;
use tidegate_protocol::quic::Congestion;

use super::ConfigError;
use super::principals::is_sha256_hex;

/// QUIC listener settings.
#[derive(Debug, Clone, PartialEq, Deserialize)]
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
    /// Congestion controller for what the gateway sends (results to
    /// edges, batches to workers): `cubic`, `newreno` or `bbr`. Each end
    /// controls its own sending; an edge's frames follow the edge's
    /// setting (docs/operations.md says which to pick).
    #[serde(default)]
    pub congestion: Congestion,
}

impl Default for QuicConfig {
    fn default() -> Self {
        QuicConfig {
            listen: default_quic_listen(),
            cert: default_cert(),
            key: default_key(),
            congestion: Congestion::default(),
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

/// HTTP listener settings. `Debug` leaves out the admin token's digest.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpConfig {
    /// Address to bind (TCP).
    #[serde(default = "default_http_listen")]
    pub listen: SocketAddr,
    /// Hex SHA-256 of the admin token that the mutating routes (`POST
    /// /api/v1/...`) require as `Authorization: Bearer <token>`; unset:
    /// those routes are refused.
    #[serde(default)]
    pub admin_token_sha256: Option<String>,
    /// Time a connection has to send a whole request head (ms), from when
    /// it is accepted or its last response was written; then it is
    /// closed. Bounds what a slowloris client or an idle keep-alive
    /// connection holds.
    #[serde(default = "default_header_read_timeout_ms")]
    pub header_read_timeout_ms: u32,
    /// Connections open at once; one more is closed as it is accepted
    /// (`tidegate_http_connections_refused_total`).
    #[serde(default = "default_http_max_connections")]
    pub max_connections: usize,
}

impl std::fmt::Debug for HttpConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpConfig")
            .field("listen", &self.listen)
            .field(
                "admin_token_sha256",
                &self.admin_token_sha256.as_ref().map(|_| "<redacted>"),
            )
            .field("header_read_timeout_ms", &self.header_read_timeout_ms)
            .field("max_connections", &self.max_connections)
            .finish()
    }
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            listen: default_http_listen(),
            admin_token_sha256: None,
            header_read_timeout_ms: default_header_read_timeout_ms(),
            max_connections: default_http_max_connections(),
        }
    }
}

impl HttpConfig {
    /// What one HTTP client may hold, for the API's accept loop.
    pub fn limits(&self) -> crate::http_listener::HttpLimits {
        crate::http_listener::HttpLimits {
            header_read_timeout: std::time::Duration::from_millis(
                self.header_read_timeout_ms.into(),
            ),
            max_connections: self.max_connections,
        }
    }

    /// Checks what serde cannot: the admin token's digest is one, and a
    /// client has time to send a request and room to connect.
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if let Some(d) = &self.admin_token_sha256
            && !is_sha256_hex(d)
        {
            return Err(ConfigError::Invalid(
                "http.admin_token_sha256 is not a 64-digit hex SHA-256; make one with `tidegate-gateway hash-token <TOKEN>`".into(),
            ));
        }
        if self.header_read_timeout_ms < 100 {
            return Err(ConfigError::Invalid(format!(
                "http.header_read_timeout_ms = {} leaves no time to send a request; use at least 100",
                self.header_read_timeout_ms
            )));
        }
        if self.max_connections == 0 {
            return Err(ConfigError::Invalid(
                "http.max_connections = 0 would refuse every API client; use at least 1".into(),
            ));
        }
        Ok(())
    }
}

/// Ten seconds: a request head is one packet from a scraper or a browser
/// on any real link.
fn default_header_read_timeout_ms() -> u32 {
    10_000
}

/// A few Prometheus servers, dashboards and operators' scripts need a
/// handful; 256 descriptors are cheap.
fn default_http_max_connections() -> usize {
    256
}

fn default_http_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9090))
}
