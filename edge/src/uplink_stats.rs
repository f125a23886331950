//! What the edge's QUIC link to its gateway did, across connections: the
//! bytes, datagrams and packets of every connection (those that ended,
//! summed, plus the live one read now), the live path's congestion window
//! and round trip, and each dial and disconnect by outcome.
//!
//! The node's link task calls [`UplinkStats::dialled`],
//! [`UplinkStats::dial_failed`] and [`UplinkStats::disconnected`] as it
//! dials and loses connections; `/metrics` ([`crate::metrics`]) calls
//! [`UplinkStats::read`] at each scrape. quinn counts from zero on every
//! connection, so a connection's final figures are carried into the totals
//! the moment it is let go, under the same lock as the live one is dropped:
//! no count is read twice or lost, and the counters never go backwards.
//!
//! Every figure starts at 0, before the first connection. The clock is the
//! caller's (`now`), monotonic, so a wall clock stepped on a device without
//! a real-time clock cannot make the last connect's age jump.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tidegate_protocol::quic::Congestion;

use crate::uplink::{Uplink, UplinkError};

/// Counters of a QUIC connection, from its start.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QuicTotals {
    /// Bytes of UDP payload sent (QUIC headers, encryption and
    /// retransmissions included).
    pub sent_bytes: u64,
    /// Bytes of UDP payload received.
    pub received_bytes: u64,
    /// UDP datagrams sent.
    pub sent_datagrams: u64,
    /// QUIC packets sent (a datagram may carry several).
    pub sent_packets: u64,
    /// QUIC packets declared lost.
    pub lost_packets: u64,
    /// Times the congestion controller cut its window.
    pub congestion_events: u64,
}

impl QuicTotals {
    fn plus(self, o: QuicTotals) -> QuicTotals {
        QuicTotals {
            sent_bytes: self.sent_bytes + o.sent_bytes,
            received_bytes: self.received_bytes + o.received_bytes,
            sent_datagrams: self.sent_datagrams + o.sent_datagrams,
            sent_packets: self.sent_packets + o.sent_packets,
            lost_packets: self.lost_packets + o.lost_packets,
            congestion_events: self.congestion_events + o.congestion_events,
        }
    }
}

/// One connection's figures now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QuicReading {
    /// Its counters since it was set up.
    pub totals: QuicTotals,
    /// Its congestion window (bytes).
    pub cwnd: u64,
    /// Its smoothed round trip.
    pub rtt: Duration,
}

/// Where the live connection's figures are read.
pub trait QuicSource: Send + Sync + std::fmt::Debug {
    /// The connection's figures now; they only grow, and stay readable
    /// after the connection has ended.
    fn reading(&self) -> QuicReading;
}

impl QuicSource for Uplink {
    fn reading(&self) -> QuicReading {
        self.quic_reading()
    }
}

/// How a dial ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DialResult {
    /// Connected and welcomed.
    Ok,
    /// No QUIC connection within the dial's bound, or no `Welcome` within
    /// the handshake's: a dead link, or a gateway that does not answer.
    Timeout,
    /// The gateway answered with a refusal (bad token, overloaded...).
    Refused,
    /// Anything else: the name did not resolve, TLS failed, the gateway's
    /// QUIC stack closed the dial, the gateway broke the protocol, or no
    /// local socket.
    Failed,
}

impl DialResult {
    /// Every result, in the order of [`DialResult::name`]'s label values.
    pub const ALL: [DialResult; 4] = [
        DialResult::Ok,
        DialResult::Timeout,
        DialResult::Refused,
        DialResult::Failed,
    ];

    /// The label value.
    pub fn name(self) -> &'static str {
        match self {
            DialResult::Ok => "ok",
            DialResult::Timeout => "timeout",
            DialResult::Refused => "refused",
            DialResult::Failed => "failed",
        }
    }

    /// The result of a dial that failed with `e`.
    pub fn of(e: &UplinkError) -> DialResult {
        match e {
            UplinkError::DialTimeout { .. } | UplinkError::Unresponsive { .. } => {
                DialResult::Timeout
            }
            UplinkError::Refused { .. } => DialResult::Refused,
            _ => DialResult::Failed,
        }
    }
}

/// Why a connection ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DisconnectReason {
    /// The gateway went silent: nothing came back within QUIC's idle
    /// timeout, keep-alives included (a dead link or host).
    Timeout,
    /// A stateless reset: the gateway's host no longer knew the
    /// connection (it restarted).
    Reset,
    /// The gateway closed it (a restart or shutdown, an `Error`, a kick).
    ClosedByGateway,
    /// The edge closed it: the gateway did not answer in time, broke the
    /// protocol on the control stream, or the edge is stopping.
    ClosedByEdge,
    /// A QUIC transport error or anything else.
    Error,
}

impl DisconnectReason {
    /// Every reason, in label order.
    pub const ALL: [DisconnectReason; 5] = [
        DisconnectReason::Timeout,
        DisconnectReason::Reset,
        DisconnectReason::ClosedByGateway,
        DisconnectReason::ClosedByEdge,
        DisconnectReason::Error,
    ];

    /// The label value.
    pub fn name(self) -> &'static str {
        match self {
            DisconnectReason::Timeout => "timeout",
            DisconnectReason::Reset => "reset",
            DisconnectReason::ClosedByGateway => "closed_by_gateway",
            DisconnectReason::ClosedByEdge => "closed_by_edge",
            DisconnectReason::Error => "error",
        }
    }

    /// The reason for a connection that ended with `e`.
    pub fn of(e: &quinn::ConnectionError) -> DisconnectReason {
        use quinn::ConnectionError as E;
        match e {
            E::TimedOut => DisconnectReason::Timeout,
            E::Reset => DisconnectReason::Reset,
            E::ApplicationClosed(_) | E::ConnectionClosed(_) => DisconnectReason::ClosedByGateway,
            E::LocallyClosed => DisconnectReason::ClosedByEdge,
            _ => DisconnectReason::Error,
        }
    }
}

/// The link's figures at one moment, as `/metrics` exports them.
#[derive(Debug, Clone, PartialEq)]
pub struct UplinkReading {
    /// The gateway as configured (the metrics' `gateway` label).
    pub gateway: String,
    /// The congestion controller of what the edge sends.
    pub congestion: Congestion,
    /// Counters over every connection so far.
    pub totals: QuicTotals,
    /// The live connection's congestion window (0 without one).
    pub cwnd: u64,
    /// The live connection's smoothed round trip (0 without one).
    pub rtt: Duration,
    /// Whether a connection is up.
    pub connected: bool,
    /// Time since the last connection was set up (0 before the first).
    pub since_connect: Duration,
    /// Dials by [`DialResult`], in [`DialResult::ALL`]'s order.
    pub dials: [u64; 4],
    /// Connections lost by [`DisconnectReason`], in its `ALL` order.
    pub disconnects: [u64; 5],
    /// Connections set up after an earlier one (the first is not one).
    pub reconnects: u64,
}

impl UplinkReading {
    /// Dials that ended as `r`.
    pub fn dials(&self, r: DialResult) -> u64 {
        self.dials[slot(&DialResult::ALL, r)]
    }

    /// Connections lost for `r`.
    pub fn disconnects(&self, r: DisconnectReason) -> u64 {
        self.disconnects[slot(&DisconnectReason::ALL, r)]
    }
}

/// Where `x` is in `all` (which holds every value of its type).
fn slot<T: PartialEq + Copy>(all: &[T], x: T) -> usize {
    all.iter()
        .position(|&a| a == x)
        .expect("ALL lists every value")
}

#[derive(Debug, Default)]
struct State {
    live: Option<Arc<dyn QuicSource>>,
    /// Counters of the connections that ended, summed.
    ended: QuicTotals,
    dials: [u64; 4],
    disconnects: [u64; 5],
    reconnects: u64,
    last_connect: Option<Instant>,
}

/// The link's figures, shared by the node's link task (which records) and
/// the metrics (which read).
#[derive(Debug)]
pub struct UplinkStats {
    gateway: String,
    congestion: Congestion,
    state: Mutex<State>,
}

impl UplinkStats {
    /// Nothing recorded yet, for the link to `gateway` (as configured)
    /// whose frames go out under `congestion`.
    pub fn new(gateway: &str, congestion: Congestion) -> Self {
        UplinkStats {
            gateway: gateway.to_string(),
            congestion,
            state: Mutex::default(),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A dial connected at `now`: `live` is the connection's source from
    /// now on. A connection still recorded as live (never reported
    /// [`UplinkStats::disconnected`]) is carried into the totals first.
    pub fn dialled(&self, now: Instant, live: Arc<dyn QuicSource>) {
        let mut s = self.state();
        if let Some(old) = s.live.take() {
            s.ended = s.ended.plus(old.reading().totals);
        }
        if s.last_connect.is_some() {
            s.reconnects += 1;
        }
        s.dials[slot(&DialResult::ALL, DialResult::Ok)] += 1;
        s.live = Some(live);
        s.last_connect = Some(now);
    }

    /// A dial failed with `e`.
    pub fn dial_failed(&self, e: &UplinkError) {
        self.state().dials[slot(&DialResult::ALL, DialResult::of(e))] += 1;
    }

    /// The live connection ended for `why`: its figures go into the totals
    /// and it is let go. Nothing happens without a live connection.
    pub fn disconnected(&self, why: DisconnectReason) {
        let mut s = self.state();
        let Some(old) = s.live.take() else { return };
        s.ended = s.ended.plus(old.reading().totals);
        s.disconnects[slot(&DisconnectReason::ALL, why)] += 1;
    }

    /// The figures at `now`.
    pub fn read(&self, now: Instant) -> UplinkReading {
        let s = self.state();
        let live = s.live.as_ref().map(|l| l.reading());
        UplinkReading {
            gateway: self.gateway.clone(),
            congestion: self.congestion,
            totals: live.map_or(s.ended, |l| s.ended.plus(l.totals)),
            cwnd: live.map_or(0, |l| l.cwnd),
            rtt: live.map_or(Duration::ZERO, |l| l.rtt),
            connected: live.is_some(),
            since_connect: s
                .last_connect
                .map_or(Duration::ZERO, |t| now.saturating_duration_since(t)),
            dials: s.dials,
            disconnects: s.disconnects,
            reconnects: s.reconnects,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connection whose figures the test sets.
    #[derive(Debug, Default)]
    struct Fake(Mutex<QuicReading>);

    impl Fake {
        fn set(&self, sent_bytes: u64, lost_packets: u64) {
            let mut r = self.0.lock().unwrap();
            r.totals.sent_bytes = sent_bytes;
            r.totals.lost_packets = lost_packets;
            r.cwnd = 12_000;
            r.rtt = Duration::from_millis(30);
        }
    }

    impl QuicSource for Fake {
        fn reading(&self) -> QuicReading {
            *self.0.lock().unwrap()
        }
    }

    fn stats() -> UplinkStats {
        UplinkStats::new("gw:4433", Congestion::Bbr)
    }

    #[test]
    fn everything_reads_zero_before_the_first_connection() {
        let s = stats();
        s.dial_failed(&UplinkError::Lost("x".into()));
        s.disconnected(DisconnectReason::Reset);
        let r = s.read(Instant::now());
        assert_eq!(r.totals, QuicTotals::default());
        assert_eq!((r.cwnd, r.rtt, r.connected), (0, Duration::ZERO, false));
        assert_eq!(r.since_connect, Duration::ZERO);
        assert_eq!(r.reconnects, 0);
        assert_eq!(r.disconnects, [0; 5], "no connection was there to lose");
        assert_eq!(r.dials(DialResult::Failed), 1);
        assert_eq!(r.dials(DialResult::Ok), 0);
        assert_eq!(r.gateway, "gw:4433");
    }

    #[test]
    fn counters_carry_over_reconnects_and_never_go_backwards() {
        let s = stats();
        let t0 = Instant::now();
        let first = Arc::new(Fake::default());
        s.dialled(t0, first.clone());
        first.set(1000, 2);
        let a = s.read(t0 + Duration::from_secs(3));
        assert_eq!((a.totals.sent_bytes, a.totals.lost_packets), (1000, 2));
        assert!(a.connected && a.cwnd == 12_000);
        assert_eq!(a.since_connect, Duration::from_secs(3));
        // The connection ends after a last packet; the next starts at 0.
        first.set(1100, 3);
        s.disconnected(DisconnectReason::ClosedByGateway);
        let b = s.read(t0 + Duration::from_secs(4));
        assert_eq!((b.totals.sent_bytes, b.totals.lost_packets), (1100, 3));
        assert!(!b.connected && b.cwnd == 0 && b.rtt == Duration::ZERO);
        // A connection let go is not read again.
        first.set(5000, 9);
        let second = Arc::new(Fake::default());
        s.dialled(t0 + Duration::from_secs(5), second.clone());
        let c = s.read(t0 + Duration::from_secs(5));
        assert_eq!((c.totals.sent_bytes, c.totals.lost_packets), (1100, 3));
        second.set(40, 1);
        let d = s.read(t0 + Duration::from_secs(6));
        assert_eq!((d.totals.sent_bytes, d.totals.lost_packets), (1140, 4));
        assert_eq!(d.since_connect, Duration::from_secs(1));
        assert_eq!((d.reconnects, d.dials(DialResult::Ok)), (1, 2));
        assert_eq!(d.disconnects(DisconnectReason::ClosedByGateway), 1);
        assert_eq!(d.disconnects.iter().sum::<u64>(), 1);
    }

    #[test]
    fn a_connection_replaced_without_its_end_is_carried_not_dropped() {
        let s = stats();
        let t0 = Instant::now();
        let first = Arc::new(Fake::default());
        first.set(700, 0);
        s.dialled(t0, first);
        let second = Arc::new(Fake::default());
        second.set(10, 0);
        s.dialled(t0, second);
        assert_eq!(s.read(t0).totals.sent_bytes, 710);
    }

    #[test]
    fn dial_failures_and_disconnects_are_classified_into_their_fixed_sets() {
        use std::net::SocketAddr;
        let addr: SocketAddr = "127.0.0.1:1".parse().unwrap();
        for (e, want) in [
            (
                UplinkError::DialTimeout {
                    addr: addr.into(),
                    after: Duration::from_secs(1),
                },
                DialResult::Timeout,
            ),
            (
                UplinkError::Unresponsive {
                    waiting_for: "Hello with Welcome".into(),
                    after: Duration::from_secs(1),
                    remote: addr,
                },
                DialResult::Timeout,
            ),
            (
                UplinkError::Refused {
                    code: tidegate_protocol::ErrorCode::Unauthorized,
                    message: "bad token".into(),
                },
                DialResult::Refused,
            ),
            (
                UplinkError::Connect {
                    addr: addr.into(),
                    reason: "tls".into(),
                },
                DialResult::Failed,
            ),
            (UplinkError::Protocol("x".into()), DialResult::Failed),
        ] {
            assert_eq!(DialResult::of(&e), want, "{e}");
        }
        use quinn::ConnectionError as E;
        for (e, want) in [
            (E::TimedOut, DisconnectReason::Timeout),
            (E::Reset, DisconnectReason::Reset),
            (E::LocallyClosed, DisconnectReason::ClosedByEdge),
            (E::VersionMismatch, DisconnectReason::Error),
            (E::CidsExhausted, DisconnectReason::Error),
        ] {
            assert_eq!(DisconnectReason::of(&e), want, "{e}");
        }
        let names: Vec<&str> = DisconnectReason::ALL.iter().map(|r| r.name()).collect();
        assert_eq!(
            names,
            [
                "timeout",
                "reset",
                "closed_by_gateway",
                "closed_by_edge",
                "error"
            ]
        );
        let names: Vec<&str> = DialResult::ALL.iter().map(|r| r.name()).collect();
        assert_eq!(names, ["ok", "timeout", "refused", "failed"]);
    }
}
