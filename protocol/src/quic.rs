//! QUIC adapters over the sans-IO codec: rustls configurations (ring only,
//! TLS 1.3) and reading/writing one message on a quinn stream. The body
//! length is checked against [`Limits`] before the body is allocated.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};

use crate::codec::{DecodeError, Header};
use crate::limits::Limits;
use crate::message::Message;

/// ALPN protocol id of tidegate over QUIC.
pub const ALPN: &[u8] = b"tidegate/1";

/// Why a TLS configuration could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    /// A PEM file could not be read.
    #[error(
        "cannot read {path}: {source}; create dev certificates with `tidegate-gateway dev-certs`"
    )]
    Read {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A PEM file held no usable item.
    #[error("{path} contains no {what}")]
    Empty {
        /// The file.
        path: String,
        /// What was expected (certificate, private key).
        what: &'static str,
    },
    /// rustls rejected the material.
    #[error("TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
    /// QUIC needs TLS 1.3 with a QUIC-capable cipher suite.
    #[error("TLS configuration is not usable for QUIC: {0}")]
    Quic(String),
}

fn read_pem(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.display().to_string(),
        source,
    })
}

fn load_certs(path: &Path) -> Result<Vec<rustls::pki_types::CertificateDer<'static>>, TlsError> {
    let pem = read_pem(path)?;
    let certs: Vec<_> = rustls_pemfile::certs(&mut pem.as_slice())
        .collect::<Result<_, _>>()
        .map_err(|source| TlsError::Read {
            path: path.display().to_string(),
            source,
        })?;
    if certs.is_empty() {
        return Err(TlsError::Empty {
            path: path.display().to_string(),
            what: "certificate",
        });
    }
    Ok(certs)
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn transport(keep_alive: bool) -> Arc<quinn::TransportConfig> {
    let mut t = quinn::TransportConfig::default();
    // One stream per frame and per result: allow plenty concurrently.
    t.max_concurrent_uni_streams(4096u32.into());
    t.max_concurrent_bidi_streams(16u32.into());
    t.max_idle_timeout(Some(
        Duration::from_secs(10)
            .try_into()
            .expect("10 s is a valid idle timeout"),
    ));
    if keep_alive {
        t.keep_alive_interval(Some(Duration::from_secs(2)));
    }
    // Room for several frames of 150 KB in flight per stream and connection.
    t.stream_receive_window((8u32 * 1024 * 1024).into());
    t.receive_window((64u32 * 1024 * 1024).into());
    t.send_window(64 * 1024 * 1024);
    Arc::new(t)
}

/// A server configuration from a PEM certificate chain and PEM private key.
pub fn server_config(cert_chain: &Path, key: &Path) -> Result<quinn::ServerConfig, TlsError> {
    let certs = load_certs(cert_chain)?;
    let pem = read_pem(key)?;
    let key_der = rustls_pemfile::private_key(&mut pem.as_slice())
        .map_err(|source| TlsError::Read {
            path: key.display().to_string(),
            source,
        })?
        .ok_or_else(|| TlsError::Empty {
            path: key.display().to_string(),
            what: "private key",
        })?;
    let mut tls = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_no_client_auth()
        .with_single_cert(certs, key_der)?;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    tls.max_early_data_size = 0;
    let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(tls)
        .map_err(|e| TlsError::Quic(e.to_string()))?;
    let mut cfg = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    cfg.transport_config(transport(false));
    Ok(cfg)
}

/// A client configuration that trusts the CA certificate(s) in `ca`.
pub fn client_config(ca: &Path) -> Result<quinn::ClientConfig, TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in load_certs(ca)? {
        roots.add(cert)?;
    }
    let mut tls = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_root_certificates(roots)
        .with_no_client_auth();
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls)
        .map_err(|e| TlsError::Quic(e.to_string()))?;
    let mut cfg = quinn::ClientConfig::new(Arc::new(crypto));
    cfg.transport_config(transport(true));
    Ok(cfg)
}

/// Why a message could not be read from a stream.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReadError {
    /// The bytes were malformed or over a limit.
    #[error("malformed message: {0}")]
    Decode(#[from] DecodeError),
    /// The stream ended in the middle of a message.
    #[error("stream ended after {got} of {expected} bytes of a message")]
    Truncated {
        /// Bytes of the message received.
        got: usize,
        /// Bytes the message needed.
        expected: usize,
    },
    /// The stream failed (reset, connection lost).
    #[error("stream failed: {0}")]
    Stream(#[from] quinn::ReadError),
}

impl ReadError {
    /// Whether the peer reset the stream (`RESET_STREAM`): it withdrew the
    /// message, which is not an error (protocol §7.3: treat it as never
    /// sent).
    pub fn is_reset(&self) -> bool {
        matches!(self, ReadError::Stream(quinn::ReadError::Reset(_)))
    }

    /// The error code to stop the stream (or close the connection) with.
    pub fn code(&self) -> crate::ErrorCode {
        match self {
            ReadError::Decode(e) => e.code(),
            ReadError::Truncated { .. } => crate::ErrorCode::Malformed,
            ReadError::Stream(_) => crate::ErrorCode::Internal,
        }
    }
}

async fn read_exact_or_eof(
    recv: &mut quinn::RecvStream,
    buf: &mut [u8],
    eof_ok: bool,
) -> Result<bool, ReadError> {
    match recv.read_exact(buf).await {
        Ok(()) => Ok(true),
        Err(quinn::ReadExactError::FinishedEarly(0)) if eof_ok => Ok(false),
        Err(quinn::ReadExactError::FinishedEarly(got)) => Err(ReadError::Truncated {
            got,
            expected: buf.len(),
        }),
        Err(quinn::ReadExactError::ReadError(e)) => Err(e.into()),
    }
}

/// Reads one message. Returns `Ok(None)` when the stream finished cleanly
/// before the first byte of a message.
pub async fn read_message(
    recv: &mut quinn::RecvStream,
    limits: &Limits,
) -> Result<Option<Message>, ReadError> {
    let mut head = [0u8; Header::LEN];
    if !read_exact_or_eof(recv, &mut head, true).await? {
        return Ok(None);
    }
    // Checked before the body is allocated.
    let header = Header::peek(&head, limits)?;
    // The buffer grows with the bytes that actually arrive, so a header that
    // merely declares a large body costs nothing (QUIC flow control bounds
    // what a peer can send).
    let mut body = BytesMut::with_capacity(header.len.min(64 * 1024));
    while body.len() < header.len {
        match recv.read_chunk(header.len - body.len(), true).await? {
            Some(chunk) => body.extend_from_slice(&chunk.bytes),
            None => {
                return Err(ReadError::Truncated {
                    got: Header::LEN + body.len(),
                    expected: Header::LEN + header.len,
                });
            }
        }
    }
    Ok(Some(Message::decode_body(
        header.kind,
        body.freeze(),
        limits,
    )?))
}

/// Writes one message, tensor payloads without copying.
pub async fn write_message(
    send: &mut quinn::SendStream,
    msg: &Message,
) -> Result<(), quinn::WriteError> {
    let mut chunks: Vec<Bytes> = msg.to_chunks();
    send.write_all_chunks(&mut chunks).await
}

/// Why dialling a gateway failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DialError {
    /// The local UDP socket could not be bound.
    #[error("binding a local UDP socket: {0}")]
    Bind(std::io::Error),
    /// The connection could not be set up (unreachable, TLS, ALPN).
    #[error("connecting to {addr}: {reason}")]
    Connect {
        /// The address dialled.
        addr: std::net::SocketAddr,
        /// What failed.
        reason: String,
    },
}

/// Opens a client endpoint on an ephemeral port and connects to `addr`,
/// expecting `server_name` in its certificate.
pub async fn dial(
    addr: std::net::SocketAddr,
    server_name: &str,
    config: quinn::ClientConfig,
) -> Result<quinn::Connection, DialError> {
    let bind: std::net::SocketAddr = if addr.is_ipv4() {
        (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let mut endpoint = quinn::Endpoint::client(bind).map_err(DialError::Bind)?;
    endpoint.set_default_client_config(config);
    let connect = |reason: String| DialError::Connect { addr, reason };
    endpoint
        .connect(addr, server_name)
        .map_err(|e| connect(e.to_string()))?
        .await
        .map_err(|e| connect(e.to_string()))
}

/// Why the `Hello` handshake failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HandshakeError {
    /// The gateway answered with an error (bad token, unknown name...).
    #[error("gateway refused: {message} ({code:?})")]
    Refused {
        /// Its code.
        code: crate::ErrorCode,
        /// Its explanation.
        message: String,
    },
    /// The gateway answered with something other than `Welcome` or `Error`.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The connection failed during the handshake.
    #[error("connection lost during the handshake: {0}")]
    Lost(String),
}

/// Opens the control stream, sends `hello` and waits for `Welcome`.
/// Returns the control stream's two halves and the welcome.
pub async fn handshake(
    conn: &quinn::Connection,
    hello: crate::Hello,
    limits: &Limits,
) -> Result<(quinn::SendStream, quinn::RecvStream, crate::Welcome), HandshakeError> {
    let lost = |e: &dyn std::fmt::Display| HandshakeError::Lost(e.to_string());
    let (mut send, mut recv) = conn.open_bi().await.map_err(|e| lost(&e))?;
    write_message(&mut send, &Message::Hello(hello))
        .await
        .map_err(|e| lost(&e))?;
    match read_message(&mut recv, limits).await {
        Ok(Some(Message::Welcome(w))) => Ok((send, recv, w)),
        Ok(Some(Message::Error(e))) => Err(HandshakeError::Refused {
            code: e.code,
            message: e.message,
        }),
        Ok(other) => Err(HandshakeError::Protocol(format!(
            "expected Welcome, got {:?}",
            other.map(|m| m.kind())
        ))),
        // The gateway may close before we read its Error: take the reason
        // from the close frame (`0x100 + code`). Any other close (0: the
        // gateway shutting down) is a lost connection, worth redialling.
        Err(e) => Err(match conn.close_reason() {
            Some(quinn::ConnectionError::ApplicationClosed(c)) => {
                match crate::ErrorCode::from_quic_code(c.error_code.into()) {
                    Some(code) => HandshakeError::Refused {
                        code,
                        message: String::from_utf8_lossy(&c.reason).into_owned(),
                    },
                    None => lost(&format!(
                        "closed by the gateway: {}",
                        String::from_utf8_lossy(&c.reason)
                    )),
                }
            }
            _ => lost(&e),
        }),
    }
}
