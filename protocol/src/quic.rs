//! QUIC adapters over the sans-IO codec: rustls configurations (ring only,
//! TLS 1.3), reading/writing one message on a quinn stream, and resolving and
//! dialling a gateway. The body length is checked against [`Limits`] before
//! the body is allocated.

use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};

use crate::addr::GatewayAddr;
use crate::codec::{DecodeError, Header, Kind};
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

/// The congestion controller of a QUIC connection (each end controls what
/// it sends: the edge its frames, the gateway its results).
///
/// An edge's uplink loses packets at random (Wi-Fi, cellular: 1–5 %), not
/// only when a queue overflows. Loss-based controllers (`cubic`,
/// `newreno`) read every loss as congestion and halve their window, which
/// caps throughput near MSS/RTT × 1.22/√p: about 1.7 Mbit/s at 50 ms RTT
/// and 2 % loss. `bbr` paces at the bottleneck rate it measures and does
/// not back off on random loss. docs/benchmarks.md ("WAN") compares the
/// three on the same impaired links.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Congestion {
    /// CUBIC (RFC 9438): quinn's own default, loss-based.
    Cubic,
    /// NewReno (RFC 9002's reference controller): loss-based.
    NewReno,
    /// BBR: model-based, tolerates random loss. The default: on the same
    /// impaired links it served 99.7 % of frames within budget at 20 ms
    /// RTT and 1 % loss against CUBIC's 94.8 % and NewReno's 90.8 %, and
    /// 85.2 % at 50 ms and 2 % against 9.1 % and 10.8 %
    /// (docs/benchmarks.md, "WAN"). quinn marks its BBR experimental; pick
    /// `cubic` to go back.
    #[default]
    Bbr,
}

impl Congestion {
    /// Every controller, for help texts and benchmarks.
    pub const ALL: [Congestion; 3] = [Congestion::Cubic, Congestion::NewReno, Congestion::Bbr];

    /// Lower-case name, as in configuration files.
    pub fn name(self) -> &'static str {
        match self {
            Congestion::Cubic => "cubic",
            Congestion::NewReno => "newreno",
            Congestion::Bbr => "bbr",
        }
    }
}

impl std::fmt::Display for Congestion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Congestion {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Congestion::ALL
            .into_iter()
            .find(|c| c.name() == s)
            .ok_or_else(|| {
                format!("unknown congestion controller '{s}'; use cubic, newreno or bbr")
            })
    }
}

/// Unidirectional streams a logged-in peer may have open at once: one per
/// frame and per result, so plenty.
pub const MAX_UNI_STREAMS: u32 = 4096;
/// Bidirectional streams a logged-in peer may have open at once (the
/// control stream is one).
pub const MAX_BIDI_STREAMS: u32 = 16;
/// Bytes a logged-in peer may have sent that the reader has not yet taken,
/// over all its streams: room for several frames of 150 KB in flight.
pub const RECEIVE_WINDOW: u32 = 64 * 1024 * 1024;
/// A logged-in edge's connection window ([`edge_receive_window`]) before
/// it opens a camera, and the least it has after.
pub const EDGE_MIN_RECEIVE_WINDOW: u32 = 2 * 1024 * 1024;
/// Frames of its largest camera a logged-in edge may have sent and the
/// gateway not yet read ([`edge_receive_window`]).
pub const EDGE_WINDOW_FRAMES: usize = 32;

/// The connection window (bytes a peer may have sent that the reader has
/// not yet taken) of a logged-in edge whose cameras' frames have bodies of
/// at most `max_frame_body` bytes: [`EDGE_WINDOW_FRAMES`] of them, within
/// [`EDGE_MIN_RECEIVE_WINDOW`] and [`RECEIVE_WINDOW`]. The window bounds
/// what an edge can push at the gateway in one go: data on streams the
/// gateway stops from their headers is decrypted and dropped, and a 64 MiB
/// window let an edge make the gateway do that for 64 MiB at a time. 32
/// BlazeFace frames (8 MiB) still cover a link of 1.3 Gbit/s at 50 ms.
pub fn edge_receive_window(max_frame_body: usize) -> u32 {
    let frames = max_frame_body.saturating_mul(EDGE_WINDOW_FRAMES);
    let frames = u32::try_from(frames).unwrap_or(u32::MAX);
    frames.clamp(EDGE_MIN_RECEIVE_WINDOW, RECEIVE_WINDOW)
}

/// [`RECEIVE_WINDOW`] for a peer that has not logged in yet (see
/// [`login_gated_server_config`]): a `Hello` (two strings of at most
/// [`Limits::max_string_bytes`] each) fits many times over, a frame does
/// not.
pub const BEFORE_LOGIN_RECEIVE_WINDOW: u32 = 16 * 1024;

fn transport(keep_alive: bool, congestion: Congestion) -> quinn::TransportConfig {
    let mut t = quinn::TransportConfig::default();
    let factory: Arc<dyn quinn::congestion::ControllerFactory + Send + Sync> = match congestion {
        Congestion::Cubic => Arc::new(quinn::congestion::CubicConfig::default()),
        Congestion::NewReno => Arc::new(quinn::congestion::NewRenoConfig::default()),
        Congestion::Bbr => Arc::new(quinn::congestion::BbrConfig::default()),
    };
    t.congestion_controller_factory(factory);
    t.max_concurrent_uni_streams(MAX_UNI_STREAMS.into());
    t.max_concurrent_bidi_streams(MAX_BIDI_STREAMS.into());
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
    t.receive_window(RECEIVE_WINDOW.into());
    t.send_window(64 * 1024 * 1024);
    t
}

/// Bytes asked of the kernel for each QUIC socket's receive and send
/// buffers. The default (208 KiB on Linux) overflows when a burst of
/// frames lands at once, 20 cameras in step sending 48 KiB each: the
/// kernel drops the datagrams, QUIC resends them a round trip later, and
/// frames wait on loss recovery (docs/benchmarks.md, "Peers"). Linux caps
/// the request at `net.core.rmem_max` / `wmem_max`; [`udp_socket`] warns
/// when it got less.
pub const SOCKET_BUFFER_BYTES: usize = 4 * 1024 * 1024;

/// The buffer sizes a QUIC socket got from the kernel (bytes; what
/// `getsockopt` reads back).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SocketBuffers {
    /// `SO_RCVBUF`.
    pub recv: usize,
    /// `SO_SNDBUF`.
    pub send: usize,
}

/// A UDP socket bound to `addr` for a QUIC endpoint, with receive and
/// send buffers of [`SOCKET_BUFFER_BYTES`] asked for. Logs one warning
/// (per process) naming the sysctl to raise when the kernel granted less;
/// the socket is usable either way.
pub fn udp_socket(addr: SocketAddr) -> std::io::Result<(std::net::UdpSocket, SocketBuffers)> {
    let socket = std::net::UdpSocket::bind(addr)?;
    let s = socket2::SockRef::from(&socket);
    // Best effort: a kernel that refuses keeps its default, read back below.
    let _ = s.set_recv_buffer_size(SOCKET_BUFFER_BYTES);
    let _ = s.set_send_buffer_size(SOCKET_BUFFER_BYTES);
    let got = SocketBuffers {
        recv: s.recv_buffer_size()?,
        send: s.send_buffer_size()?,
    };
    static WARNED: std::sync::Once = std::sync::Once::new();
    // Linux reads back twice what it granted (the doubling covers its
    // bookkeeping): a full grant reads back as twice the request.
    let full = if cfg!(target_os = "linux") {
        2 * SOCKET_BUFFER_BYTES
    } else {
        SOCKET_BUFFER_BYTES
    };
    if got.recv < full || got.send < full {
        WARNED.call_once(|| {
            tracing::warn!(
                recv = got.recv,
                send = got.send,
                wanted = SOCKET_BUFFER_BYTES,
                "the kernel granted QUIC sockets smaller buffers than asked: bursts of frames may be dropped and resent; raise net.core.rmem_max and net.core.wmem_max to at least {SOCKET_BUFFER_BYTES} (docs/operations.md)"
            );
        });
    }
    Ok((socket, got))
}

/// A QUIC server endpoint on `addr` ([`udp_socket`]'s buffers) with
/// `config`, on the current Tokio runtime.
pub fn server_endpoint(
    config: quinn::ServerConfig,
    addr: SocketAddr,
) -> std::io::Result<(quinn::Endpoint, SocketBuffers)> {
    let (socket, got) = udp_socket(addr)?;
    let endpoint = quinn::Endpoint::new(
        quinn::EndpointConfig::default(),
        Some(config),
        socket,
        Arc::new(quinn::TokioRuntime),
    )?;
    Ok((endpoint, got))
}

/// A QUIC client endpoint on `bind` ([`udp_socket`]'s buffers), on the
/// current Tokio runtime.
pub fn client_endpoint(bind: SocketAddr) -> std::io::Result<quinn::Endpoint> {
    let (socket, _) = udp_socket(bind)?;
    quinn::Endpoint::new(
        quinn::EndpointConfig::default(),
        None,
        socket,
        Arc::new(quinn::TokioRuntime),
    )
}

/// A server configuration from a PEM certificate chain and PEM private key,
/// with the default congestion controller.
pub fn server_config(cert_chain: &Path, key: &Path) -> Result<quinn::ServerConfig, TlsError> {
    server_config_with(cert_chain, key, Congestion::default())
}

/// [`server_config`] with `congestion` controlling what the server sends.
pub fn server_config_with(
    cert_chain: &Path,
    key: &Path,
    congestion: Congestion,
) -> Result<quinn::ServerConfig, TlsError> {
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
    cfg.transport_config(Arc::new(transport(false, congestion)));
    Ok(cfg)
}

/// [`server_config_with`] for a server that lets peers in by their
/// `Hello`: until [`open_after_login`] is called on a connection, its peer
/// may open no unidirectional stream and one bidirectional stream (the
/// control stream), and have at most [`BEFORE_LOGIN_RECEIVE_WINDOW`] bytes
/// unread in all. A stranger cannot make the server buffer the 64 MiB of
/// stream data that a logged-in peer may. A client opens its frame and
/// result streams after `Welcome`; `open_uni` waits for the credit that
/// [`open_after_login`] sends.
pub fn login_gated_server_config(
    cert_chain: &Path,
    key: &Path,
    congestion: Congestion,
) -> Result<quinn::ServerConfig, TlsError> {
    let mut cfg = server_config_with(cert_chain, key, congestion)?;
    let mut t = transport(false, congestion);
    t.max_concurrent_uni_streams(0u32.into());
    t.max_concurrent_bidi_streams(1u32.into());
    t.receive_window(BEFORE_LOGIN_RECEIVE_WINDOW.into());
    cfg.transport_config(Arc::new(t));
    Ok(cfg)
}

/// Raises a connection accepted under [`login_gated_server_config`] to
/// the limits of a logged-in peer ([`MAX_UNI_STREAMS`],
/// [`MAX_BIDI_STREAMS`]) and a connection window of `receive_window`
/// bytes ([`RECEIVE_WINDOW`] for a worker, [`edge_receive_window`] for an
/// edge); call it once the peer is authenticated, before answering
/// `Welcome`. The window may be raised later with
/// `quinn::Connection::set_receive_window`.
pub fn open_after_login(conn: &quinn::Connection, receive_window: u32) {
    conn.set_max_concurrent_uni_streams(MAX_UNI_STREAMS.into());
    conn.set_max_concurrent_bi_streams(MAX_BIDI_STREAMS.into());
    conn.set_receive_window(receive_window.into());
}

/// A client configuration that trusts the CA certificate(s) in `ca`, with
/// the default congestion controller.
pub fn client_config(ca: &Path) -> Result<quinn::ClientConfig, TlsError> {
    client_config_with(ca, Congestion::default())
}

/// [`client_config`] with `congestion` controlling what the client sends.
pub fn client_config_with(
    ca: &Path,
    congestion: Congestion,
) -> Result<quinn::ClientConfig, TlsError> {
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
    cfg.transport_config(Arc::new(transport(true, congestion)));
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
    /// A message of a kind this stream does not carry, refused from its
    /// header before its body was read.
    #[error("expected {}, got {got:?}", kinds(expected))]
    Unexpected {
        /// The kind the header named.
        got: Kind,
        /// The kinds this stream carries.
        expected: &'static [Kind],
    },
}

fn kinds(expected: &[Kind]) -> String {
    let names: Vec<String> = expected.iter().map(|k| format!("{k:?}")).collect();
    names.join(" or ")
}

impl ReadError {
    /// Whether the stream failed because its connection did (closed, timed
    /// out, reset): nothing was wrong with its bytes.
    pub fn is_connection_lost(&self) -> bool {
        matches!(self, ReadError::Stream(quinn::ReadError::ConnectionLost(_)))
    }

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
            ReadError::Truncated { .. } | ReadError::Unexpected { .. } => {
                crate::ErrorCode::Malformed
            }
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
    read_checked(recv, limits, None).await
}

/// Reads the next message on an edge's control stream that answers it:
/// any `ClockProbe` read on the way is skipped, unanswered (the gateway
/// then dates the edge's frames as if sent when captured). For a simple
/// client that opens cameras and waits for each answer; a full client (the
/// edge's uplink) answers every probe with `ClockEcho`.
pub async fn read_answer(
    recv: &mut quinn::RecvStream,
    limits: &Limits,
) -> Result<Option<Message>, ReadError> {
    loop {
        match read_message(recv, limits).await? {
            Some(Message::ClockProbe(_)) => continue,
            other => return Ok(other),
        }
    }
}

/// Reads one message of one of the `expected` kinds, as [`read_message`]
/// does. Any other kind is [`ReadError::Unexpected`] as soon as its 8-byte
/// header is in, before a byte of its body is read or buffered: a peer that
/// has not logged in can make the gateway read a `Hello` (at most
/// `max_header_bytes`) and nothing larger.
pub async fn read_message_of(
    recv: &mut quinn::RecvStream,
    limits: &Limits,
    expected: &'static [Kind],
) -> Result<Option<Message>, ReadError> {
    read_checked(recv, limits, Some(expected)).await
}

async fn read_checked(
    recv: &mut quinn::RecvStream,
    limits: &Limits,
    expected: Option<&'static [Kind]>,
) -> Result<Option<Message>, ReadError> {
    let mut head = [0u8; Header::LEN];
    if !read_exact_or_eof(recv, &mut head, true).await? {
        return Ok(None);
    }
    // Checked before the body is allocated.
    let header = Header::peek(&head, limits)?;
    if let Some(expected) = expected
        && !expected.contains(&header.kind)
    {
        return Err(ReadError::Unexpected {
            got: header.kind,
            expected,
        });
    }
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
    /// The gateway's host name did not resolve (no such name, no address
    /// for it, or no answer from DNS in time).
    #[error(
        "cannot resolve gateway host {host:?} (of {addr}): {reason}; check the name and this machine's DNS"
    )]
    Resolve {
        /// The host name.
        host: String,
        /// The address it is part of.
        addr: GatewayAddr,
        /// What failed.
        reason: String,
    },
    /// The connection could not be set up (unreachable, TLS, ALPN).
    #[error("connecting to {addr}: {reason}")]
    Connect {
        /// The address dialled.
        addr: SocketAddr,
        /// What failed.
        reason: String,
    },
}

/// Longest wait for DNS before a dial fails (and the caller's redial tries
/// again): the QUIC idle timeout, the longest a handshake may take.
pub const RESOLVE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long one address has to connect before the next one is tried
/// alongside it (RFC 8305's connection attempt delay): a name with an IPv6
/// and an IPv4 address, of which the gateway listens on one, costs this
/// rather than a whole handshake timeout.
pub const ATTEMPT_DELAY: Duration = Duration::from_millis(250);

/// The socket addresses of `addr`, in the resolver's order of preference
/// and without repeats. An IP literal is returned as is, without DNS; a name
/// is looked up now (the system resolver, getaddrinfo), so every
/// call sees where the name points at that moment.
pub async fn resolve(addr: &GatewayAddr) -> Result<Vec<SocketAddr>, DialError> {
    let Some(host) = addr.name() else {
        return Ok(addr.ip().into_iter().collect());
    };
    let failed = |reason: String| DialError::Resolve {
        host: host.to_string(),
        addr: addr.clone(),
        reason,
    };
    let found = tokio::time::timeout(
        RESOLVE_TIMEOUT,
        tokio::net::lookup_host((host, addr.port())),
    )
    .await
    .map_err(|_| failed(format!("no answer within {RESOLVE_TIMEOUT:?}")))?
    .map_err(|e| failed(e.to_string()))?;
    let mut out: Vec<SocketAddr> = Vec::new();
    for a in found {
        if !out.contains(&a) {
            out.push(a);
        }
    }
    if out.is_empty() {
        return Err(failed("the name has no address".into()));
    }
    Ok(out)
}

/// Opens a client endpoint on an ephemeral port and connects to `addr`,
/// expecting `server_name` in its certificate.
pub async fn dial(
    addr: SocketAddr,
    server_name: &str,
    config: quinn::ClientConfig,
) -> Result<quinn::Connection, DialError> {
    let bind: SocketAddr = if addr.is_ipv4() {
        (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    dial_from(bind, addr, server_name, config).await
}

/// [`dial`] from the local address `bind` (port 0: an ephemeral one), as
/// a test's peer that stands for another host does (`127.0.0.2`).
pub async fn dial_from(
    bind: SocketAddr,
    addr: SocketAddr,
    server_name: &str,
    config: quinn::ClientConfig,
) -> Result<quinn::Connection, DialError> {
    let mut endpoint = client_endpoint(bind).map_err(DialError::Bind)?;
    endpoint.set_default_client_config(config);
    let connect = |reason: String| DialError::Connect { addr, reason };
    endpoint
        .connect(addr, server_name)
        .map_err(|e| connect(e.to_string()))?
        .await
        .map_err(|e| connect(e.to_string()))
}

/// Resolves `addr` (see [`resolve`]) and connects to one of its addresses,
/// expecting `server_name` in the gateway's certificate. Resolving at every
/// call is what lets a redial find a gateway that moved (a new Pod IP behind
/// a headless Service).
///
/// The addresses are tried in order: each starts when the one before it
/// fails, or after [`ATTEMPT_DELAY`] without connecting, while the earlier
/// ones go on. The first to connect wins and the others are abandoned; when
/// all fail, the error is the last failure's. The connection's
/// `remote_address()` is the address that answered.
pub async fn dial_addr(
    addr: &GatewayAddr,
    server_name: &str,
    config: quinn::ClientConfig,
) -> Result<quinn::Connection, DialError> {
    let addrs = resolve(addr).await?;
    dial_any(addrs, server_name, config).await
}

/// Connects to the first of `addrs` (at least one) that answers, as
/// [`dial_addr`] describes.
async fn dial_any(
    addrs: Vec<SocketAddr>,
    server_name: &str,
    config: quinn::ClientConfig,
) -> Result<quinn::Connection, DialError> {
    let mut queue = addrs.into_iter();
    let attempt = |to: SocketAddr| Box::pin(dial(to, server_name, config.clone()));
    let mut attempts: Vec<_> = queue.next().map(attempt).into_iter().collect();
    let mut last = None;
    // Returning drops (abandons) the attempts still running.
    while !attempts.is_empty() {
        let first_done = std::future::poll_fn(|cx| {
            for i in 0..attempts.len() {
                if let std::task::Poll::Ready(r) = attempts[i].as_mut().poll(cx) {
                    drop(attempts.swap_remove(i));
                    return std::task::Poll::Ready(r);
                }
            }
            std::task::Poll::Pending
        });
        tokio::select! {
            done = first_done => match done {
                Ok(conn) => return Ok(conn),
                Err(e) => {
                    last = Some(e);
                    if attempts.is_empty() {
                        attempts.extend(queue.next().map(attempt));
                    }
                }
            },
            _ = tokio::time::sleep(ATTEMPT_DELAY), if queue.len() > 0 => {
                attempts.extend(queue.next().map(attempt));
            }
        }
    }
    Err(last.expect("dial_any is given at least one address, and ends after a failed attempt"))
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

#[cfg(all(test, feature = "dev-certs"))]
mod tests {
    use super::*;

    /// A listener for `localhost` on 127.0.0.1 that accepts connections
    /// until dropped, and the client configuration that trusts it.
    struct Listener {
        addr: SocketAddr,
        client: quinn::ClientConfig,
        _endpoint: quinn::Endpoint,
        _dir: tempfile::TempDir,
    }

    fn listener() -> Listener {
        let dir = tempfile::tempdir().unwrap();
        let tls = crate::certs::generate(dir.path(), &["localhost".to_string()]).unwrap();
        let server = server_config(&tls.server_cert, &tls.server_key).unwrap();
        let (endpoint, _) = server_endpoint(server, "127.0.0.1:0".parse().unwrap()).unwrap();
        let accepting = endpoint.clone();
        tokio::spawn(async move {
            while let Some(incoming) = accepting.accept().await {
                if let Ok(conn) = incoming.await {
                    tokio::spawn(async move { conn.closed().await });
                }
            }
        });
        Listener {
            addr: endpoint.local_addr().unwrap(),
            client: client_config(&tls.ca_cert).unwrap(),
            _endpoint: endpoint,
            _dir: dir,
        }
    }

    /// Bounds every dial of these tests: far above what they need, below
    /// the 10 s handshake timeout that a black hole costs.
    const WAIT: Duration = Duration::from_secs(5);

    /// A login-gated server on 127.0.0.1, and a client configuration that
    /// trusts it (their certificates are in the directory).
    fn gated_server() -> (tempfile::TempDir, quinn::Endpoint, quinn::ClientConfig) {
        let dir = tempfile::tempdir().unwrap();
        let tls = crate::certs::generate(dir.path(), &["localhost".to_string()]).unwrap();
        let server =
            login_gated_server_config(&tls.server_cert, &tls.server_key, Congestion::default())
                .unwrap();
        let endpoint = quinn::Endpoint::server(server, "127.0.0.1:0".parse().unwrap()).unwrap();
        let client = client_config(&tls.ca_cert).unwrap();
        (dir, endpoint, client)
    }

    #[tokio::test]
    async fn a_peer_gets_no_unidirectional_stream_before_login_and_gets_them_after() {
        let (_dir, endpoint, client) = gated_server();
        let addr = endpoint.local_addr().unwrap();
        let (login_tx, login_rx) = tokio::sync::oneshot::channel::<()>();
        let accepting = endpoint.clone();
        tokio::spawn(async move {
            let conn = accepting.accept().await.unwrap().await.unwrap();
            let _ = login_rx.await;
            open_after_login(&conn, RECEIVE_WINDOW);
            conn.closed().await
        });
        let conn = tokio::time::timeout(WAIT, dial(addr, "localhost", client))
            .await
            .expect("connects in time")
            .unwrap();
        assert!(
            tokio::time::timeout(Duration::from_millis(300), conn.open_uni())
                .await
                .is_err(),
            "no unidirectional stream before login"
        );
        login_tx.send(()).unwrap();
        let mut opened = Vec::new();
        for _ in 0..8 {
            let s = tokio::time::timeout(WAIT, conn.open_uni())
                .await
                .expect("credit after login")
                .unwrap();
            opened.push(s);
        }
    }

    #[test]
    fn an_edges_window_holds_32_of_its_largest_frames_within_its_bounds() {
        assert_eq!(edge_receive_window(0), EDGE_MIN_RECEIVE_WINDOW);
        assert_eq!(edge_receive_window(1 << 20), 32 << 20);
        assert_eq!(edge_receive_window(usize::MAX), RECEIVE_WINDOW);
    }

    /// A logged-in peer whose streams the reader does not read can have
    /// sent at most its connection window, over all its streams; raising
    /// the window lets more in.
    #[tokio::test]
    async fn a_logged_in_peer_can_push_no_more_than_its_window_unread() {
        const WINDOW: u32 = 256 * 1024;
        let (_dir, endpoint, client) = gated_server();
        let addr = endpoint.local_addr().unwrap();
        let (raise_tx, raise_rx) = tokio::sync::oneshot::channel::<()>();
        let accepting = endpoint.clone();
        tokio::spawn(async move {
            let conn = accepting.accept().await.unwrap().await.unwrap();
            open_after_login(&conn, WINDOW);
            // Streams accepted and held, never read.
            let mut held = Vec::new();
            let raise = async {
                let _ = raise_rx.await;
                conn.set_receive_window((4 * WINDOW).into());
                std::future::pending::<()>().await
            };
            tokio::pin!(raise);
            loop {
                tokio::select! {
                    s = conn.accept_uni() => match s {
                        Ok(s) => held.push(s),
                        Err(_) => return,
                    },
                    _ = &mut raise => {}
                }
            }
        });
        let conn = tokio::time::timeout(WAIT, dial(addr, "localhost", client))
            .await
            .expect("connects in time")
            .unwrap();
        // Writes on 8 streams until none moves for 300 ms.
        let chunk = vec![0u8; 16 * 1024];
        let mut streams = Vec::new();
        for _ in 0..8 {
            streams.push(
                tokio::time::timeout(WAIT, conn.open_uni())
                    .await
                    .expect("credit after login")
                    .unwrap(),
            );
        }
        async fn push(streams: &mut [quinn::SendStream], chunk: &[u8]) -> usize {
            let mut sent = 0;
            loop {
                let mut moved = false;
                for s in streams.iter_mut() {
                    if let Ok(Ok(n)) =
                        tokio::time::timeout(Duration::from_millis(300), s.write(chunk)).await
                    {
                        sent += n;
                        moved = true;
                    }
                }
                if !moved {
                    return sent;
                }
            }
        }
        let first = push(&mut streams, &chunk).await;
        assert!(
            first <= WINDOW as usize,
            "{first} bytes sent unread, over the window of {WINDOW}"
        );
        assert!(first >= WINDOW as usize / 2, "only {first} bytes went");
        raise_tx.send(()).unwrap();
        let more = push(&mut streams, &chunk).await;
        assert!(
            first + more <= 4 * WINDOW as usize && first + more > WINDOW as usize,
            "{first} then {more} bytes, against windows of {WINDOW} and {}",
            4 * WINDOW
        );
    }

    #[tokio::test]
    async fn an_address_that_fails_is_followed_by_the_next_in_order() {
        let l = listener();
        // Port 0 fails at once.
        let dead: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let conn = tokio::time::timeout(
            WAIT,
            dial_any(vec![dead, l.addr], "localhost", l.client.clone()),
        )
        .await
        .expect("connects in time")
        .unwrap();
        assert_eq!(conn.remote_address(), l.addr);
    }

    #[tokio::test]
    async fn an_address_that_never_answers_does_not_hold_up_the_next() {
        let l = listener();
        // A UDP socket that never reads: the handshake to it would wait out
        // the whole handshake timeout (10 s).
        let hole = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let silent = hole.local_addr().unwrap();
        let conn = tokio::time::timeout(
            WAIT,
            dial_any(vec![silent, l.addr], "localhost", l.client.clone()),
        )
        .await
        .expect("the second address connects while the first is still silent")
        .unwrap();
        assert_eq!(conn.remote_address(), l.addr);
    }

    #[tokio::test]
    async fn when_every_address_fails_the_error_is_the_last_ones() {
        let l = listener();
        let (a, b): (SocketAddr, SocketAddr) = (
            "127.0.0.1:0".parse().unwrap(),
            "127.0.0.2:0".parse().unwrap(),
        );
        let err = tokio::time::timeout(WAIT, dial_any(vec![a, b], "localhost", l.client.clone()))
            .await
            .expect("fails in time")
            .unwrap_err();
        assert!(
            matches!(&err, DialError::Connect { addr, .. } if *addr == b),
            "{err:?}"
        );
    }

    /// What Linux grants for a request of `want` bytes under `cap` (its
    /// `net.core.*mem_max`): the request, at most the cap and at least
    /// its floor, doubled.
    fn linux_grant(want: usize, cap: &str) -> usize {
        let cap: usize = std::fs::read_to_string(format!("/proc/sys/net/core/{cap}"))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        want.min(cap).max(2304) * 2
    }

    #[tokio::test]
    async fn quic_sockets_ask_for_large_buffers_and_get_what_the_kernel_allows() {
        let (socket, got) = udp_socket("127.0.0.1:0".parse().unwrap()).unwrap();
        assert_eq!(got.recv, linux_grant(SOCKET_BUFFER_BYTES, "rmem_max"));
        assert_eq!(got.send, linux_grant(SOCKET_BUFFER_BYTES, "wmem_max"));
        // what the socket itself reports, not a figure made up beside it
        let s = socket2::SockRef::from(&socket);
        assert_eq!(s.recv_buffer_size().unwrap(), got.recv);
        // the server endpoint carries them, and a client dials through one
        let l = listener();
        let conn = dial(l.addr, "localhost", l.client.clone()).await.unwrap();
        conn.close(0u32.into(), b"done");
    }
}
