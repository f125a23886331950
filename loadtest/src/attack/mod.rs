//! Hostile peers against a gateway, written once for the tests that prove
//! each bound (`loadtest/tests/hostile_memory.rs`, `hostile_messages.rs`,
//! `fair_share.rs`, `worker_health.rs`) and for `tidegate-bench hostile`
//! ([`crate::hostilebench`]), which runs each beside a legitimate load:
//!
//! - [`edge`]: what a holder of an edge token can try: frames declared and
//!   never finished, or trickled; frames with the longest budget from many
//!   connections and cameras; a control-message flood; refusals quoting
//!   the longest names; more connections and cameras than an edge may have;
//! - [`stranger`]: connections that never log in;
//! - [`worker`]: a worker that lies about its batches;
//! - [`http`]: slowloris connections on the HTTP API;
//! - [`rss`]: the gateway's resident set, sampled.
//!
//! Every attack is bounded in streams, bytes and time: each takes its
//! counts and a deadline (or a stop token), and nothing it spawns outlives
//! the connection it belongs to.

pub mod edge;
pub mod http;
pub mod rss;
pub mod stranger;
pub mod worker;

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tidegate_protocol::quic::{
    DialError, HandshakeError, TlsError, client_config, dial_from, handshake,
};
use tidegate_protocol::{Hello, Limits, Role};

use crate::cluster::Cluster;

/// A mebibyte.
pub const MIB: u64 = 1024 * 1024;

/// Where an attack aims, and the credentials it holds.
#[derive(Clone)]
pub struct Target {
    /// The gateway's QUIC address.
    pub quic: SocketAddr,
    /// The gateway's HTTP address.
    pub http: SocketAddr,
    /// The CA the gateway's certificate is checked against.
    pub ca: PathBuf,
    /// A valid edge token (good for every edge name the cluster knows).
    pub edge_token: String,
    /// A valid worker token.
    pub worker_token: String,
    /// The local address the attacker dials from: [`ATTACKER`] by default,
    /// another host on the loopback network than the legitimate load's
    /// `127.0.0.1`, so that what the gateway does to the attacker's address
    /// (`limits.refused_logins_per_address`) is not done to theirs.
    pub from: IpAddr,
}

/// The loopback address attackers dial from by default: Linux routes all of
/// `127.0.0.0/8` to the loopback interface, so it stands for a host of its
/// own beside the legitimate load's `127.0.0.1`.
pub const ATTACKER: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(127, 0, 0, 2));

/// How long an attacker's dial waits for the gateway to answer: a gateway
/// that drops an address's connections unanswered lets the dial run to its
/// QUIC idle timeout (10 s) otherwise.
pub const DIAL_TIMEOUT: Duration = Duration::from_secs(2);

impl Target {
    /// The gateway of `c`, with its tokens.
    pub fn of(c: &Cluster) -> Target {
        Target {
            quic: c.quic,
            http: c.http,
            ca: c.ca(),
            edge_token: c.edge_token.clone(),
            worker_token: c.worker_token().to_string(),
            from: ATTACKER,
        }
    }

    /// This target, dialled from `from` instead.
    pub fn from(self, from: IpAddr) -> Target {
        Target { from, ..self }
    }

    /// Dials the gateway from [`Target::from`] with `cfg`, within
    /// [`DIAL_TIMEOUT`] ([`AttackError::NoAnswer`] past it).
    pub async fn dial(&self, cfg: quinn::ClientConfig) -> Result<quinn::Connection, AttackError> {
        let bind = SocketAddr::new(self.from, 0);
        match tokio::time::timeout(DIAL_TIMEOUT, dial_from(bind, self.quic, "localhost", cfg)).await
        {
            Ok(conn) => Ok(conn?),
            Err(_) => Err(AttackError::NoAnswer {
                what: format!("dialling the gateway from {}", self.from),
                after: DIAL_TIMEOUT,
            }),
        }
    }

    /// A client configuration trusting the gateway's CA.
    pub fn client(&self) -> Result<quinn::ClientConfig, AttackError> {
        Ok(client_config(&self.ca)?)
    }
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target")
            .field("quic", &self.quic)
            .field("http", &self.http)
            .field("ca", &self.ca)
            .field("edge_token", &"<redacted>")
            .field("worker_token", &"<redacted>")
            .field("from", &self.from)
            .finish()
    }
}

/// Why an attack could not be carried out (not whether the gateway held:
/// that is what the attack's tally and the caller's checks say).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AttackError {
    /// The gateway's CA could not be loaded.
    #[error("loading the gateway's CA: {0}")]
    Tls(#[from] TlsError),
    /// The QUIC connection could not be set up.
    #[error(transparent)]
    Dial(#[from] DialError),
    /// Logging in was refused or failed.
    #[error("logging in as {name:?}: {source}")]
    Login {
        /// The name the attacker logged in with.
        name: String,
        /// Why it failed.
        source: HandshakeError,
    },
    /// The edge uplink (the real edge's client) failed.
    #[error("edge {edge:?}: {source}")]
    Uplink {
        /// The edge name.
        edge: String,
        /// Why (boxed: it is large).
        source: Box<tidegate_edge::uplink::UplinkError>,
    },
    /// The frame the attacker sends could not be made.
    #[error("making the attacker's frame: {0}")]
    Frame(String),
    /// The gateway did not answer in time.
    #[error("{what}: no answer within {after:?}")]
    NoAnswer {
        /// What was awaited.
        what: String,
        /// How long.
        after: Duration,
    },
    /// The gateway answered something unexpected, or broke the stream.
    #[error("{what}: {detail}")]
    Protocol {
        /// What was awaited.
        what: String,
        /// What came instead.
        detail: String,
    },
    /// A socket or thread operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The gateway's HTTP API did not answer as expected.
    #[error("the gateway's API: {0}")]
    Api(String),
    /// An attack's task panicked or was cancelled by its runtime.
    #[error("an attack task ended abnormally: {0}")]
    Task(String),
}

impl AttackError {
    /// An I/O error while doing `what`.
    pub(crate) fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> AttackError {
        let what = what.into();
        move |source| AttackError::Io { what, source }
    }
}

/// A logged-in edge: its connection and its control stream's two halves.
pub type LoggedIn = (quinn::Connection, quinn::SendStream, quinn::RecvStream);

/// Logs in as edge `name` with the target's edge token.
pub async fn login(t: &Target, name: &str) -> Result<LoggedIn, AttackError> {
    login_with(t, name, t.client()?).await
}

/// [`login`] for an attacker that buffers as much as it likes: its own
/// send window never holds it back, only the gateway's flow control.
pub async fn login_greedy(t: &Target, name: &str) -> Result<LoggedIn, AttackError> {
    let mut cfg = t.client()?;
    let mut transport = quinn::TransportConfig::default();
    transport.send_window(4 << 30);
    cfg.transport_config(Arc::new(transport));
    login_with(t, name, cfg).await
}

async fn login_with(
    t: &Target,
    name: &str,
    cfg: quinn::ClientConfig,
) -> Result<LoggedIn, AttackError> {
    let conn = t.dial(cfg).await?;
    let hello = Hello {
        role: Role::Edge,
        name: name.into(),
        token: t.edge_token.clone(),
    };
    let (send, recv, _) = handshake(&conn, hello, &Limits::default())
        .await
        .map_err(|source| AttackError::Login {
            name: name.into(),
            source,
        })?;
    Ok((conn, send, recv))
}

/// Keeps a connection's control stream open until the connection closes
/// (dropping it would finish the stream), on a task of its own that ends
/// with the connection.
pub fn hold_control(conn: &quinn::Connection, send: quinn::SendStream, recv: quinn::RecvStream) {
    let conn = conn.clone();
    tokio::spawn(async move {
        let _control = (send, recv);
        conn.closed().await;
    });
}

/// A multi-threaded tokio runtime of two workers for an attacker of its
/// own, apart from the legitimate load's.
pub fn runtime() -> Result<tokio::runtime::Runtime, AttackError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(AttackError::io("building a tokio runtime"))
}
