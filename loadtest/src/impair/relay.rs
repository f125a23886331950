//! The async shell around [`Link`]: UDP in, a timer, UDP out.
//!
//! One socket faces the clients. Each client address gets a flow: a socket
//! of its own, connected to the upstream, so the upstream sees one flow per
//! client, and a client that changes port is a new flow (what a NAT
//! rebinding looks like from the server). Replies that reach a flow's
//! socket go back to its client from the client-facing socket.
//!
//! Tasks, all on one [`TaskTracker`] and stopped by one
//! [`CancellationToken`] ([`Relay::stop`], or dropping the [`Relay`]):
//! - the listener: client datagram → uplink verdict → uplink delay line;
//!   it opens flows;
//! - one per flow: upstream datagram → downlink verdict → downlink delay
//!   line;
//! - one per direction: sends what is due, then sleeps until the next due
//!   time or a new earliest packet (never a task per packet).
//!
//! Each direction's [`Link`] and its delay line sit under one mutex, held
//! only to decide or to pop, never across an `.await`; the time given to
//! the link is read under that mutex, so it never runs backwards. Time is
//! tokio's clock since [`Relay::start`].
//!
//! Bounds: at most [`RelayOptions::max_flows`] flows (when the table is
//! full, flows idle for [`FLOW_IDLE`] are closed to make room; if none is,
//! the new client's datagram is dropped and counted in
//! [`FlowStats::refused_packets`]); per direction, the link's hold limit
//! ([`super::MAX_HELD_PACKETS`], [`super::MAX_HELD_BYTES`]) bounds the
//! delay line.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::net::UdpSocket;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::{ConfigError, ImpairConfig, Link, LinkCounters, Verdict};

/// The most client flows a relay keeps: far more than the cameras of one
/// edge, few enough that a port scan cannot exhaust the relay's sockets.
pub const MAX_FLOWS: usize = 256;

/// How long a flow may see no datagram, either way, before a new client may
/// take its place when the table is full: 30 s, the usual NAT UDP timeout
/// (and QUIC keeps a live connection busier than that).
pub const FLOW_IDLE: Duration = Duration::from_secs(30);

/// The largest UDP payload; every receive buffer is this big, so no
/// datagram is cut short.
const MAX_DATAGRAM: usize = 65_535;

/// How to start a [`Relay`].
#[derive(Debug, Clone)]
pub struct RelayOptions {
    /// Where clients send (default 127.0.0.1:0, any free port).
    pub listen: SocketAddr,
    /// Where their datagrams go (the gateway's QUIC address).
    pub upstream: SocketAddr,
    /// What happens to datagrams on the way, each direction.
    pub config: ImpairConfig,
    /// Allow `listen` and `upstream` outside 127.0.0.0/8 and ::1. Off by
    /// default: a relay is a test tool, and should neither forward to a real
    /// network nor take traffic from one by accident.
    pub allow_non_loopback: bool,
    /// The most client flows at once, 1 to [`MAX_FLOWS`].
    pub max_flows: usize,
}

impl RelayOptions {
    /// Listen on 127.0.0.1:0, relay to `upstream` through `config`, loopback
    /// only, up to [`MAX_FLOWS`] flows.
    pub fn new(upstream: SocketAddr, config: ImpairConfig) -> RelayOptions {
        RelayOptions {
            listen: SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
            upstream,
            config,
            allow_non_loopback: false,
            max_flows: MAX_FLOWS,
        }
    }
}

/// Why a [`Relay`] did not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ImpairError {
    /// The impairment config is invalid.
    #[error("impairment config: {0}")]
    Config(#[from] ConfigError),
    /// An address outside loopback, without
    /// [`RelayOptions::allow_non_loopback`].
    #[error(
        "{role} address {addr} is not loopback (127.0.0.0/8 or ::1); the relay stays on this machine unless told otherwise: pass --allow-non-loopback (RelayOptions::allow_non_loopback) if you mean to impair a real network path"
    )]
    NotLoopback {
        /// `listen` or `upstream`.
        role: &'static str,
        /// The address.
        addr: SocketAddr,
    },
    /// A flow limit outside 1..=[`MAX_FLOWS`].
    #[error("max_flows = {0} is not in 1..={MAX_FLOWS}; give a limit in that range")]
    MaxFlows(usize),
    /// The client-facing socket could not be bound.
    #[error(
        "binding the relay's socket on {addr}: {source}; pick another address, or port 0 for any free one"
    )]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// A snapshot of a relay's counters (JSON: `--stats FILE`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RelayStats {
    /// Client → upstream.
    pub uplink: DirectionStats,
    /// Upstream → client.
    pub downlink: DirectionStats,
    /// Client flows.
    pub flows: FlowStats,
}

/// One direction's counters: its link's verdicts, and what the sockets did
/// with the packets delivered.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirectionStats {
    /// Offered, delivered, dropped by reason.
    #[serde(flatten)]
    pub link: LinkCounters,
    /// Packets delivered and not yet due (waiting in the delay line).
    pub held_packets: u64,
    /// Delivered packets whose send failed (they are counted delivered:
    /// the link let them through).
    pub send_errors: u64,
}

/// The client flow table's counters.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlowStats {
    /// Flows open now.
    pub active: u64,
    /// Flows opened since start.
    pub opened: u64,
    /// Flows closed after [`FLOW_IDLE`] to make room for a new client.
    pub closed_idle: u64,
    /// Datagrams from new clients dropped because the table was full (or
    /// their flow's socket could not be opened); never offered to the
    /// uplink.
    pub refused_packets: u64,
}

/// A running impairment relay; [`Relay::stop`] or dropping it stops every
/// task it started.
#[derive(Debug)]
pub struct Relay {
    local_addr: SocketAddr,
    shared: Arc<Shared>,
    cancel: CancellationToken,
    tracker: TaskTracker,
}

impl Relay {
    /// Checks the options, binds the client-facing socket and starts
    /// relaying. Needs a tokio runtime with time and I/O enabled.
    pub async fn start(opts: RelayOptions) -> Result<Relay, ImpairError> {
        if !opts.allow_non_loopback {
            for (role, addr) in [("listen", opts.listen), ("upstream", opts.upstream)] {
                if !addr.ip().to_canonical().is_loopback() {
                    return Err(ImpairError::NotLoopback { role, addr });
                }
            }
        }
        if !(1..=MAX_FLOWS).contains(&opts.max_flows) {
            return Err(ImpairError::MaxFlows(opts.max_flows));
        }
        let (uplink, downlink) = opts.config.links()?;
        let socket = UdpSocket::bind(opts.listen)
            .await
            .map_err(|source| ImpairError::Bind {
                addr: opts.listen,
                source,
            })?;
        let local_addr = socket.local_addr().map_err(|source| ImpairError::Bind {
            addr: opts.listen,
            source,
        })?;
        let clients = Arc::new(socket);
        let shared = Arc::new(Shared {
            epoch: Instant::now(),
            uplink: Direction::new(uplink),
            downlink: Direction::new(downlink),
            flows: Mutex::new(FlowStats::default()),
        });
        let cancel = CancellationToken::new();
        let tracker = TaskTracker::new();
        let upstream = Upstream {
            addr: opts.upstream,
            max_flows: opts.max_flows,
        };
        tracker.spawn(listen(
            Arc::clone(&shared),
            Arc::clone(&clients),
            upstream,
            cancel.clone(),
            tracker.clone(),
        ));
        for dir in [Dir::Up, Dir::Down] {
            tracker.spawn(deliver(
                Arc::clone(&shared),
                dir,
                Arc::clone(&clients),
                cancel.clone(),
            ));
        }
        tracing::info!(%local_addr, upstream = %opts.upstream, "impair: relaying");
        Ok(Relay {
            local_addr,
            shared,
            cancel,
            tracker,
        })
    }

    /// Where clients send.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The counters now.
    pub fn stats(&self) -> RelayStats {
        RelayStats {
            uplink: self.shared.uplink.stats(),
            downlink: self.shared.downlink.stats(),
            flows: self.shared.flows.lock().unwrap().clone(),
        }
    }

    /// Cuts both directions from now for `duration`: every datagram offered
    /// meanwhile is dropped ([`super::DropReason::Blackout`]); those already
    /// on their way are still delivered.
    pub fn blackout(&self, duration: Duration) {
        for dir in [&self.shared.uplink, &self.shared.downlink] {
            let mut state = dir.lock();
            let now = self.shared.now();
            state.link.blackout(now, duration);
        }
    }

    /// Stops every task, waits for them to end, and returns the final
    /// counters. Packets still held are not sent.
    pub async fn stop(self) -> RelayStats {
        self.cancel.cancel();
        self.tracker.close();
        self.tracker.wait().await;
        self.stats()
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// What every task shares.
#[derive(Debug)]
struct Shared {
    /// Time zero of the links' clock.
    epoch: Instant,
    uplink: Direction,
    downlink: Direction,
    flows: Mutex<FlowStats>,
}

impl Shared {
    fn now(&self) -> Duration {
        self.epoch.elapsed()
    }

    fn direction(&self, dir: Dir) -> &Direction {
        match dir {
            Dir::Up => &self.uplink,
            Dir::Down => &self.downlink,
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Dir {
    Up,
    Down,
}

/// One direction: its link and delay line, and the wake-up of its sender.
#[derive(Debug)]
struct Direction {
    state: Mutex<DirectionState>,
    /// Told when a packet becomes the earliest due.
    earliest_changed: Notify,
}

#[derive(Debug)]
struct DirectionState {
    link: Link,
    /// Delivered packets by due time, ties in arrival order.
    line: BinaryHeap<Reverse<Pending>>,
    /// Arrival order, for ties.
    seq: u64,
    send_errors: u64,
}

impl Direction {
    fn new(link: Link) -> Direction {
        Direction {
            state: Mutex::new(DirectionState {
                link,
                line: BinaryHeap::new(),
                seq: 0,
                send_errors: 0,
            }),
            earliest_changed: Notify::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, DirectionState> {
        self.state.lock().unwrap()
    }

    /// Asks the link about `payload` now, and queues it for its due time
    /// when it is delivered.
    fn offer(&self, shared: &Shared, to: Dest, payload: &[u8]) {
        let mut state = self.lock();
        let now = shared.now();
        let Verdict::Deliver { at } = state.link.on_packet(now, payload.len()) else {
            return;
        };
        let earliest = state.line.peek().map(|p| p.0.at);
        let seq = state.seq;
        state.seq += 1;
        state.line.push(Reverse(Pending {
            at,
            seq,
            to,
            payload: payload.to_vec(),
        }));
        drop(state);
        if earliest.is_none_or(|e| at < e) {
            self.earliest_changed.notify_one();
        }
    }

    fn stats(&self) -> DirectionStats {
        let state = self.lock();
        DirectionStats {
            link: *state.link.counters(),
            held_packets: state.line.len() as u64,
            send_errors: state.send_errors,
        }
    }
}

/// A packet waiting for its due time.
#[derive(Debug)]
struct Pending {
    at: Duration,
    seq: u64,
    to: Dest,
    payload: Vec<u8>,
}

impl PartialEq for Pending {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}

impl Eq for Pending {}

impl PartialOrd for Pending {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Pending {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(other.at, other.seq))
    }
}

/// Where a packet goes when due.
#[derive(Debug)]
enum Dest {
    /// Upstream, from its client's flow socket.
    Upstream(Arc<UdpSocket>),
    /// Back to a client, from the client-facing socket.
    Client(SocketAddr),
}

#[derive(Debug, Clone, Copy)]
struct Upstream {
    addr: SocketAddr,
    max_flows: usize,
}

/// A client's flow, as the listener keeps it.
#[derive(Debug)]
struct Flow {
    socket: Arc<UdpSocket>,
    /// Milliseconds since the epoch of its last datagram, either way.
    last_seen_ms: Arc<AtomicU64>,
    cancel: CancellationToken,
}

/// Receives from clients, opens their flows and offers their datagrams to
/// the uplink.
async fn listen(
    shared: Arc<Shared>,
    clients: Arc<UdpSocket>,
    upstream: Upstream,
    cancel: CancellationToken,
    tracker: TaskTracker,
) {
    let mut flows: HashMap<SocketAddr, Flow> = HashMap::new();
    let mut buf = vec![0u8; MAX_DATAGRAM];
    loop {
        let (len, from) = tokio::select! {
            biased;
            () = cancel.cancelled() => break,
            r = clients.recv_from(&mut buf) => match r {
                Ok(got) => got,
                Err(e) => {
                    tracing::debug!("impair: receiving from clients: {e}");
                    continue;
                }
            },
        };
        let now_ms = millis(shared.now());
        if !flows.contains_key(&from) {
            if flows.len() >= upstream.max_flows {
                close_idle(&shared, &mut flows, now_ms);
            }
            let opened = if flows.len() < upstream.max_flows {
                open_flow(&shared, from, upstream.addr, &cancel, &tracker).await
            } else {
                None
            };
            let mut stats = shared.flows.lock().unwrap();
            match opened {
                Some(flow) => {
                    flows.insert(from, flow);
                    stats.opened += 1;
                    stats.active = flows.len() as u64;
                }
                None => {
                    stats.refused_packets += 1;
                    continue;
                }
            }
        }
        let flow = &flows[&from];
        flow.last_seen_ms.store(now_ms, Ordering::Relaxed);
        shared.uplink.offer(
            &shared,
            Dest::Upstream(Arc::clone(&flow.socket)),
            &buf[..len],
        );
    }
}

/// Closes the flows idle for [`FLOW_IDLE`].
fn close_idle(shared: &Shared, flows: &mut HashMap<SocketAddr, Flow>, now_ms: u64) {
    let idle = millis(FLOW_IDLE);
    let before = flows.len();
    flows.retain(|_, f| {
        let keep = now_ms.saturating_sub(f.last_seen_ms.load(Ordering::Relaxed)) < idle;
        if !keep {
            f.cancel.cancel();
        }
        keep
    });
    let mut stats = shared.flows.lock().unwrap();
    stats.closed_idle += (before - flows.len()) as u64;
    stats.active = flows.len() as u64;
}

/// A socket connected to the upstream for `client`, and the task that
/// relays its replies; `None` (logged) when the socket cannot be opened.
async fn open_flow(
    shared: &Arc<Shared>,
    client: SocketAddr,
    upstream: SocketAddr,
    cancel: &CancellationToken,
    tracker: &TaskTracker,
) -> Option<Flow> {
    let local: IpAddr = match upstream.ip() {
        ip if ip.is_loopback() => ip,
        IpAddr::V4(_) => Ipv4Addr::UNSPECIFIED.into(),
        IpAddr::V6(_) => Ipv6Addr::UNSPECIFIED.into(),
    };
    let socket = match UdpSocket::bind((local, 0)).await {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(%client, "impair: opening a flow socket: {e}");
            return None;
        }
    };
    if let Err(e) = socket.connect(upstream).await {
        tracing::warn!(%client, %upstream, "impair: connecting a flow socket: {e}");
        return None;
    }
    let socket = Arc::new(socket);
    let last_seen_ms = Arc::new(AtomicU64::new(millis(shared.now())));
    let flow_cancel = cancel.child_token();
    tracker.spawn(relay_replies(
        Arc::clone(shared),
        Arc::clone(&socket),
        client,
        Arc::clone(&last_seen_ms),
        flow_cancel.clone(),
    ));
    tracing::debug!(%client, "impair: new flow");
    Some(Flow {
        socket,
        last_seen_ms,
        cancel: flow_cancel,
    })
}

/// Offers each datagram from the upstream on a flow's socket to the
/// downlink, addressed to the flow's client.
async fn relay_replies(
    shared: Arc<Shared>,
    socket: Arc<UdpSocket>,
    client: SocketAddr,
    last_seen_ms: Arc<AtomicU64>,
    cancel: CancellationToken,
) {
    let mut buf = vec![0u8; MAX_DATAGRAM];
    loop {
        let len = tokio::select! {
            biased;
            () = cancel.cancelled() => break,
            r = socket.recv(&mut buf) => match r {
                Ok(len) => len,
                // An earlier send met a closed port (ICMP unreachable): the
                // upstream may come back; keep the flow.
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => continue,
                Err(e) => {
                    tracing::warn!(%client, "impair: receiving from upstream, flow closed: {e}");
                    break;
                }
            },
        };
        last_seen_ms.store(millis(shared.now()), Ordering::Relaxed);
        shared
            .downlink
            .offer(&shared, Dest::Client(client), &buf[..len]);
    }
}

/// Sends one direction's packets when they are due.
async fn deliver(
    shared: Arc<Shared>,
    dir: Dir,
    clients: Arc<UdpSocket>,
    cancel: CancellationToken,
) {
    let direction = shared.direction(dir);
    let mut due = Vec::new();
    loop {
        let next = {
            let mut state = direction.lock();
            let now = shared.now();
            while let Some(Reverse(p)) = state.line.peek()
                && p.at <= now
            {
                let Reverse(p) = state.line.pop().expect("peeked");
                state.link.on_released(p.payload.len());
                due.push(p);
            }
            state.line.peek().map(|p| p.0.at)
        };
        let mut failed = 0;
        for p in due.drain(..) {
            let sent = match &p.to {
                Dest::Upstream(socket) => socket.send(&p.payload).await,
                Dest::Client(addr) => clients.send_to(&p.payload, addr).await,
            };
            if let Err(e) = sent {
                tracing::debug!(?dir, "impair: sending: {e}");
                failed += 1;
            }
        }
        if failed > 0 {
            direction.lock().send_errors += failed;
        }
        let wake = async {
            match next {
                Some(at) => tokio::time::sleep_until(shared.epoch + at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            () = cancel.cancelled() => break,
            () = direction.earliest_changed.notified() => {}
            () = wake => {}
        }
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
