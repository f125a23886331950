//! The QUIC listener. Each connection gets its own task and tracing span.
//! The first bidirectional stream is the control stream and must start with
//! `Hello`; the token decides whether the peer is an edge or a worker. An
//! edge's connection then runs as an `EdgeSession` (`server/edge.rs`), a
//! worker's as a `WorkerSession` (`server/worker.rs`).

mod edge;
mod edge_quota;
mod error_reply;
mod inflight;
mod worker;

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tidegate_protocol::quic::{read_message_of, write_message};
use tidegate_protocol::{ErrorCode, Hello, Kind, Limits, Message, Role, Welcome};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, debug, info, info_span, warn};

use self::edge_quota::{EdgeLimits, EdgeQuotas, QuotaError};
use self::error_reply::ErrorReply;
use self::inflight::ByteBudget;
use crate::auth::Access;
use crate::config::Config;
use crate::hub::Hub;
use crate::leasing::{Leasing, WorkerPass};
use crate::metrics::Metrics;
use crate::ratelimit::{LogSampler, LoginStrikes};
use crate::scheduler::{EdgeId, WorkerId};

/// Results buffered per edge connection, and as many again being written,
/// before they are dropped (counted as undeliverable).
const RESULT_QUEUE: usize = 1024;
/// Bytes of results (see [`FrameResult::held_bytes`]) buffered and being
/// written per edge connection before they are dropped (counted as
/// undeliverable): 1024 results of a few detections take a few hundred
/// KiB, but of `raw` outputs they could take gigabytes.
const RESULT_QUEUE_BYTES: usize = 64 * 1024 * 1024;
/// Cameras one edge may have open over its connections unless
/// `limits.max_cameras_per_edge` says otherwise: each costs the hub a route
/// and the status API a row, so a buggy edge (a timestamp in each camera's
/// name) cannot grow them without bound.
pub const MAX_CAMERAS_PER_EDGE: usize = 1024;
/// Batches buffered per worker connection.
const DISPATCH_QUEUE: usize = 8;
/// Time an operator's drain gives a worker to finish its batches (ms), as
/// said in the `Drain` it is sent.
const OPERATOR_DRAIN_MS: u32 = 30_000;
/// Heartbeat interval asked of workers.
const HEARTBEAT_MS: u32 = 1000;
/// Heartbeats a worker may miss before it is declared lost.
const HEARTBEAT_LOSS: u32 = 3;
/// How long a worker has, once welcomed, to send its `Register`.
const REGISTER_TIMEOUT: Duration = Duration::from_secs(10);

/// Shared state of the listener.
#[derive(Debug)]
pub struct Server {
    config: Config,
    hub: Hub,
    metrics: Metrics,
    limits: Limits,
    sessions: AtomicU64,
    /// Owns every per-stream task, so shutdown drains them.
    tracker: TaskTracker,
    /// The credentials in force (a reload swaps them) and the connections
    /// they let in.
    access: Arc<Access>,
    /// The lease shell, when `[leasing]` is configured: workers started for
    /// a lease authenticate with its one-time token.
    leasing: Option<Leasing>,
    /// Deadlines and edge clock probes are read on this clock.
    clock: edge::GatewayClock,
    /// Bytes of partly received frames, all edges together
    /// (`limits.inflight_bytes_total`).
    inflight_total: Arc<ByteBudget>,
    /// Connections, cameras and partly received bytes per edge name.
    edge_quotas: Arc<EdgeQuotas>,
    /// Room for connections that have not logged in
    /// (`limits.max_unauthenticated`): one permit each, from accept to
    /// `Welcome`.
    unauthenticated: Arc<Semaphore>,
    /// Which refused logins are logged: a stranger guessing tokens as fast
    /// as it can gets a few lines a second, not one per guess.
    refused_logins: std::sync::Mutex<LogSampler>,
    /// Addresses whose logins keep being refused, shut out before their
    /// next handshake (`limits.refused_logins_per_address`), and which
    /// shut-outs are logged.
    strikes: std::sync::Mutex<(LoginStrikes, LogSampler)>,
}

/// Refused logins logged at most this many a second, and this many at
/// once.
const REFUSED_LOGINS_LOGGED: (u32, u32) = (1, 10);

/// Bytes of a peer-chosen name a log line quotes.
const LOGGED_NAME_BYTES: usize = 128;

impl Server {
    /// A server over `hub`: `access` lets edges and workers in, `leasing`
    /// authenticates leased workers.
    pub fn new(
        config: Config,
        hub: Hub,
        metrics: Metrics,
        tracker: TaskTracker,
        access: Arc<Access>,
        leasing: Option<Leasing>,
    ) -> Arc<Self> {
        let l = &config.limits;
        let edge_quotas = EdgeQuotas::new(EdgeLimits {
            connections: l.max_connections_per_edge,
            cameras: l.max_cameras_per_edge,
            inflight_bytes: l.edge_inflight_bytes,
            flood_cooldown: Duration::from_millis(l.control_flood_cooldown_ms),
        });
        let inflight_total = ByteBudget::new(l.inflight_bytes_total);
        let unauthenticated = Arc::new(Semaphore::new(l.max_unauthenticated));
        let (per_second, burst) = REFUSED_LOGINS_LOGGED;
        let strikes = (
            LoginStrikes::new(l.strike_rate()),
            LogSampler::new(per_second, burst),
        );
        Arc::new(Server {
            refused_logins: std::sync::Mutex::new(LogSampler::new(per_second, burst)),
            strikes: std::sync::Mutex::new(strikes),
            inflight_total,
            edge_quotas,
            unauthenticated,
            config,
            hub,
            metrics,
            limits: Limits::default(),
            sessions: AtomicU64::new(1),
            tracker,
            access,
            leasing,
            clock: edge::GatewayClock::new(Instant::now()),
        })
    }

    /// The control-message rate each edge connection is held to
    /// (`[limits] control_*`).
    fn control_rate(&self) -> crate::ratelimit::ControlRate {
        self.config.limits.control_rate()
    }

    /// Accepts connections until `cancel` fires; every connection task is
    /// tracked by `tracker`.
    pub async fn serve(self: Arc<Self>, endpoint: quinn::Endpoint, cancel: CancellationToken) {
        let tracker = self.tracker.clone();
        loop {
            let incoming = tokio::select! {
                _ = cancel.cancelled() => break,
                i = endpoint.accept() => match i {
                    Some(i) => i,
                    None => break,
                },
            };
            // Dropped unanswered, before the handshake costs anything: an
            // address whose logins keep being refused.
            if self.shut_out(incoming.remote_address().ip()) {
                self.metrics
                    .quic_refused
                    .with_label_values(&["shut_out"])
                    .inc();
                incoming.ignore();
                continue;
            }
            // Refused before the handshake costs anything: until they log
            // in, connections are strangers, and only so many at once.
            let Ok(login) = self.unauthenticated.clone().try_acquire_owned() else {
                debug!(peer = %incoming.remote_address(), "refused: too many connections not logged in");
                self.metrics
                    .quic_refused
                    .with_label_values(&["unauthenticated"])
                    .inc();
                incoming.refuse();
                continue;
            };
            let this = self.clone();
            let cancel = cancel.clone();
            let session = self.sessions.fetch_add(1, Ordering::Relaxed);
            let span = info_span!("conn", session, peer = %incoming.remote_address());
            tracker.spawn(
                async move {
                    // A stranger's handshake holds its place for no longer
                    // than a Hello may take (dropping it abandons it).
                    let hello_timeout =
                        Duration::from_millis(this.config.limits.hello_timeout_ms.into());
                    match tokio::time::timeout(hello_timeout, incoming).await {
                        Ok(Ok(conn)) => this.connection(session, conn, login, cancel).await,
                        Ok(Err(e)) => debug!("handshake failed: {e}"),
                        Err(_) => debug!("no handshake within {hello_timeout:?}; abandoned"),
                    }
                }
                .instrument(span),
            );
        }
        endpoint.close(0u32.into(), b"gateway shutting down");
    }

    /// Whether connections from `ip` are shut out now, its logins having
    /// been refused too often.
    fn shut_out(&self, ip: IpAddr) -> bool {
        let strikes = self.strikes.lock().expect("login strikes lock");
        strikes.0.shut_out(ip, Instant::now()).is_some()
    }

    /// Counts a login from `ip` refused; logs (sampled) when that shuts
    /// the address out.
    fn strike(&self, ip: IpAddr) {
        let now = Instant::now();
        let mut strikes = self.strikes.lock().expect("login strikes lock");
        let (book, log) = &mut *strikes;
        book.refused(ip, now);
        if let Some(shut_for) = book.shut_out(ip, now)
            && let Some(held_back) = log.write(now)
        {
            warn!(%ip, ?shut_for, held_back, "address shut out: its logins keep being refused, so its new connections are dropped unanswered before their handshake until then (limits.refused_logins_per_address; counted in tidegate_quic_connections_refused_total{{reason=\"shut_out\"}}; held_back: shut-outs not logged since the last line)");
        }
    }

    /// The connection's `Hello`, on its first bidirectional stream within
    /// `limits.hello_timeout_ms`, with that stream; `None` (the stranger
    /// refused with the reason where there is one) otherwise.
    async fn read_hello(
        &self,
        conn: &quinn::Connection,
    ) -> Option<(quinn::SendStream, quinn::RecvStream, Hello)> {
        let hello_timeout = Duration::from_millis(self.config.limits.hello_timeout_ms.into());
        // A Hello is two short strings: a stranger's body is read no
        // further than what its connection may send before login.
        let hello_limits = Limits {
            max_header_bytes: tidegate_protocol::quic::BEFORE_LOGIN_RECEIVE_WINDOW as usize,
            ..self.limits
        };
        tokio::time::timeout(hello_timeout, async {
            let (mut send, mut recv) = conn.accept_bi().await.ok()?;
            // Before login only a Hello is read: any other kind is refused
            // from its header, so a stranger cannot make the gateway buffer
            // or decode a tensor-sized body.
            match read_message_of(&mut recv, &hello_limits, &[Kind::Hello]).await {
                Ok(Some(Message::Hello(h))) => Some((send, recv, h)),
                Ok(other) => {
                    let reply = ErrorReply::NoHello {
                        got: other.map(|m| m.kind()),
                    };
                    refuse(conn, &mut send, &reply).await;
                    None
                }
                Err(e) => {
                    // Malformed, or an unsupported version or size, by name.
                    let reply = ErrorReply::Unreadable {
                        code: e.code(),
                        error: e.to_string(),
                    };
                    refuse(conn, &mut send, &reply).await;
                    None
                }
            }
        })
        .await
        .ok()
        .flatten()
    }

    /// A connection's credentials, checked after its `Hello`: a leased
    /// worker by its lease's one-time token, everyone else by name and
    /// token, and an edge against its name's quotas. A refusal is written
    /// to the peer, counted and logged here, and answers `None`.
    async fn log_in<'s>(
        &'s self,
        session: u64,
        conn: &quinn::Connection,
        send: &mut quinn::SendStream,
        hello: &Hello,
    ) -> Option<Login<'s>> {
        let Hello { role, name, token } = hello;
        // A leased worker proves its lease with the lease's one-time token;
        // a listed static worker, bound or not, with its own token.
        let mut pass = None;
        if *role == Role::Worker
            && let Some(leasing) = &self.leasing
        {
            match leasing.authenticate(name, token).await {
                Some(Ok(p)) => pass = Some(p),
                Some(Err(refusal)) => {
                    warn!(name, %refusal, retry_later = refusal.retry_later, "worker refused");
                    let reply = ErrorReply::LeaseRefused {
                        name: name.clone(),
                        reason: refusal.to_string(),
                        retry_later: refusal.retry_later,
                    };
                    refuse(conn, send, &reply).await;
                    return None;
                }
                None => {}
            }
        }
        // Everyone else by name and token; the admission lasts as long as
        // the connection, and a reload that drops its credentials revokes it.
        let admitted = match pass {
            Some(_) => None,
            None => self.access.admit(session, *role, name, token),
        };
        if pass.is_none() && admitted.is_none() {
            self.metrics
                .quic_refused
                .with_label_values(&["credentials"])
                .inc();
            let sampled = self
                .refused_logins
                .lock()
                .expect("refused-login sampler lock")
                .write(Instant::now());
            if let Some(held_back) = sampled {
                warn!(name = %tidegate_protocol::fit_string(name, LOGGED_NAME_BYTES), ?role, held_back, "refused: unknown name or wrong token (held_back: refusals not logged since the last line; all are counted in tidegate_quic_connections_refused_total{{reason=\"credentials\"}})");
            }
            self.strike(conn.remote_address().ip());
            let reply = ErrorReply::UnknownCredentials {
                role: *role,
                name: name.clone(),
            };
            refuse(conn, send, &reply).await;
            return None;
        }
        let edge_slot = match role {
            Role::Edge => match self.edge_quotas.connect(name, Instant::now()) {
                Ok(slot) => Some(slot),
                Err(quota) => {
                    warn!(name, %quota, "edge refused");
                    if matches!(quota, QuotaError::FloodCooldown { .. }) {
                        self.strike(conn.remote_address().ip());
                    }
                    self.metrics
                        .quic_refused
                        .with_label_values(&[quota.refused_reason()])
                        .inc();
                    let reply = ErrorReply::EdgeQuota {
                        name: name.clone(),
                        quota,
                    };
                    refuse(conn, send, &reply).await;
                    return None;
                }
            },
            Role::Worker => None,
        };
        Some(Login {
            pass,
            admitted,
            edge_slot,
        })
    }

    /// Serves one connection: its `Hello` within `limits.hello_timeout_ms`,
    /// then its role's session. `login` holds its place among the
    /// connections not logged in, until `Welcome`.
    async fn connection(
        &self,
        session: u64,
        conn: quinn::Connection,
        login: OwnedSemaphorePermit,
        cancel: CancellationToken,
    ) {
        let Some((mut send, recv, hello)) = self.read_hello(&conn).await else {
            debug!("no Hello; closing");
            conn.close(ErrorCode::Malformed.quic_code().into(), b"no Hello");
            return;
        };
        let Some(Login {
            pass,
            admitted,
            edge_slot,
        }) = self.log_in(session, &conn, &mut send, &hello).await
        else {
            return;
        };
        // Logged in: room for its frame and result streams (the credit goes
        // out with or before the Welcome; a peer's `open_uni` waits for it).
        // An edge's window grows with its cameras' frames as they open.
        let window = match hello.role {
            Role::Edge => tidegate_protocol::quic::edge_receive_window(0),
            Role::Worker => tidegate_protocol::quic::RECEIVE_WINDOW,
        };
        tidegate_protocol::quic::open_after_login(&conn, window);
        let welcome = Message::Welcome(Welcome {
            session,
            heartbeat_ms: HEARTBEAT_MS,
        });
        if write_message(&mut send, &welcome).await.is_err() {
            self.lease_link_closed(pass.as_ref()).await;
            return;
        }
        drop(login);
        info!(name = %hello.name, role = ?hello.role, "authenticated");
        // A leased worker's token is its lease's: no reload revokes it.
        let revoked = admitted
            .as_ref()
            .map(|a| a.revoked.clone())
            .unwrap_or_default();
        let link = Link {
            name: hello.name,
            conn,
            ctl_send: send,
            ctl_recv: recv,
            cancel,
            revoked,
        };
        match edge_slot {
            Some(slot) => edge::run(self, EdgeId(session), link, slot).await,
            None => worker::run(self, WorkerId(session), pass.as_ref(), link).await,
        }
        drop(admitted);
        self.lease_link_closed(pass.as_ref()).await;
    }

    /// A leased or static worker's connection ended, however it ended
    /// (even before it registered): its lease's token may be used again to
    /// redial; a static worker may connect again (its lease, if bound, is
    /// lost).
    async fn lease_link_closed(&self, pass: Option<&WorkerPass>) {
        let Some(leasing) = &self.leasing else {
            return;
        };
        match pass {
            Some(WorkerPass::Lease(l)) => leasing.disconnected(*l).await,
            Some(WorkerPass::Static(name)) => leasing.static_disconnected(name).await,
            None => {}
        }
    }
}

/// An authenticated connection's control stream and what ends it.
struct Link {
    /// The name it said in `Hello`.
    name: String,
    conn: quinn::Connection,
    ctl_send: quinn::SendStream,
    ctl_recv: quinn::RecvStream,
    /// The gateway is shutting down.
    cancel: CancellationToken,
    /// A reload took its credentials away.
    revoked: CancellationToken,
}

/// What a connection's login established: a leased worker's pass, or the
/// admission of a name and token (held as long as the connection), and an
/// edge's place among its name's connections.
struct Login<'s> {
    pass: Option<WorkerPass>,
    admitted: Option<crate::auth::Admitted<'s>>,
    edge_slot: Option<edge_quota::EdgeSlot>,
}

/// Sends `reply` on the control stream, then closes the connection with
/// its QUIC code. The one way a connection is refused: the reason is
/// fitted to the protocol's limits here (see [`ErrorReply::to_message`]),
/// so no caller can send one a peer cannot decode.
async fn refuse(conn: &quinn::Connection, send: &mut quinn::SendStream, reply: &ErrorReply) {
    let _ = write_message(send, &reply.to_message()).await;
    let _ = send.finish();
    // Give the peer a moment to read the reason before the close.
    tokio::time::sleep(Duration::from_millis(50)).await;
    conn.close(reply.code().quic_code().into(), reply.text().as_bytes());
}
