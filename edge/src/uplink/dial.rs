//! Dialling the gateway: the QUIC connection (TLS with the configured CA,
//! each dial optionally bounded), the `Hello` → `Welcome` handshake, and
//! the connection's two tasks, `control` and `results`. Owns nothing after
//! the dial: the [`Uplink`] it returns does. A frame does not pass here.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tidegate_protocol::queue;
use tidegate_protocol::quic::{HandshakeError, handshake};
use tidegate_protocol::{GatewayAddr, Hello, Limits, Role};
use tokio::sync::mpsc;
use tracing::{Instrument, info_span};

use super::control::control;
use super::results::{ResultCopies, results};
use super::{Incoming, Uplink, UplinkError, UplinkOptions, unresponsive};

/// Results and hints buffered for the consumer. When it is full nothing is
/// dropped: result streams wait to be read, and the gateway is held back by
/// QUIC flow control.
const INCOMING_QUEUE: usize = 4096;
/// Bytes of results and hints (see [`Incoming::held_bytes`]) buffered for
/// the consumer, whichever of this and [`INCOMING_QUEUE`] fills first:
/// 4096 results of `raw` outputs could otherwise take gigabytes.
const INCOMING_BYTES: usize = 64 * 1024 * 1024;

/// The number of the next connection [`Uplink::connect_client`] sets up.
static NEXT_CONNECTION: AtomicU64 = AtomicU64::new(1);

impl Uplink {
    /// Connects to the gateway at `addr` (resolving a host name now, see
    /// [`tidegate_protocol::quic::dial_addr`]), trusting `ca`, and
    /// authenticates as `name`. Returns the uplink and the stream of results
    /// and hints. Uses [`UplinkOptions::default`].
    pub async fn connect(
        addr: &GatewayAddr,
        server_name: &str,
        ca: &Path,
        name: &str,
        token: &str,
    ) -> Result<(Uplink, queue::Receiver<Incoming>), UplinkError> {
        Self::connect_with(addr, server_name, ca, name, token, UplinkOptions::default()).await
    }

    /// [`Uplink::connect`] with explicit deadlines. A gateway that does not
    /// answer `Hello` within `options.handshake_timeout` fails the connect
    /// with [`UplinkError::Unresponsive`] (retryable), its connection closed.
    pub async fn connect_with(
        addr: &GatewayAddr,
        server_name: &str,
        ca: &Path,
        name: &str,
        token: &str,
        options: UplinkOptions,
    ) -> Result<(Uplink, queue::Receiver<Incoming>), UplinkError> {
        let client = tidegate_protocol::quic::client_config(ca)?;
        Self::connect_client(addr, server_name, client, name, token, options).await
    }

    /// [`Uplink::connect_with`] with the QUIC client configuration (the CA
    /// to trust) already loaded, by
    /// [`tidegate_protocol::quic::client_config`]: a caller that redials
    /// loads it once, so a CA file rewritten meanwhile cannot fail a redial.
    pub async fn connect_client(
        addr: &GatewayAddr,
        server_name: &str,
        client: quinn::ClientConfig,
        name: &str,
        token: &str,
        options: UplinkOptions,
    ) -> Result<(Uplink, queue::Receiver<Incoming>), UplinkError> {
        let connect_err = |reason: String| UplinkError::Connect {
            addr: addr.clone(),
            reason,
        };
        let dial = tidegate_protocol::quic::dial_addr(addr, server_name, client);
        let dialled =
            match options.dial_timeout {
                // Dropping the dial abandons it: its endpoint and socket go.
                Some(limit) => tokio::time::timeout(limit, dial).await.map_err(|_| {
                    UplinkError::DialTimeout {
                        addr: addr.clone(),
                        after: limit,
                    }
                })?,
                None => dial.await,
            };
        let conn = dialled.map_err(|e| match e {
            tidegate_protocol::quic::DialError::Bind(e) => UplinkError::Bind(e),
            other => connect_err(other.to_string()),
        })?;
        let hello = Hello {
            role: Role::Edge,
            name: name.to_string(),
            token: token.to_string(),
        };
        // The keep-alives hold the connection open while the gateway's QUIC
        // stack answers, however long the gateway itself takes: bound it.
        let answered = tokio::time::timeout(
            options.handshake_timeout,
            handshake(&conn, hello, &Limits::default()),
        )
        .await
        .map_err(|_| unresponsive(&conn, "Hello with Welcome", options.handshake_timeout))?;
        let (send, recv, _welcome) = answered.map_err(|e| match e {
            HandshakeError::Refused { code, message } => UplinkError::Refused { code, message },
            HandshakeError::Protocol(m) => UplinkError::Protocol(m),
            other => UplinkError::Lost(other.to_string()),
        })?;

        let (in_tx, in_rx) = queue::channel(INCOMING_QUEUE, INCOMING_BYTES);
        let (cmd_tx, cmd_rx) = mpsc::channel(256);
        let span =
            info_span!("uplink", gateway = %addr, addr = %conn.remote_address(), edge = name);
        tokio::spawn(
            control(conn.clone(), send, recv, cmd_rx, in_tx.clone()).instrument(span.clone()),
        );
        let copies = Arc::new(ResultCopies::default());
        tokio::spawn(results(conn.clone(), in_tx, copies.clone()).instrument(span));
        Ok((
            Uplink {
                conn,
                id: NEXT_CONNECTION.fetch_add(1, Ordering::Relaxed),
                commands: cmd_tx,
                open_timeout: options.open_timeout,
                copies,
                order: Arc::default(),
                pressure: Arc::default(),
                refusals: Arc::default(),
            },
            in_rx,
        ))
    }
}
