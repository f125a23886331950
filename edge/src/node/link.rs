//! The link: one task that keeps a connection to the gateway. It dials
//! (and redials with backoff), publishes the live [`Uplink`] and the
//! gateway's hints ([`HintBoard`]) to the camera tasks, and forwards each
//! result, then the connection's end ([`FromLink`]), to the node's loop in
//! `run`, which hands them to the sinks. It sends no frame: the cameras do,
//! through their lanes.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tidegate_protocol::ControlHint;
use tidegate_protocol::FrameResult;
use tidegate_protocol::queue;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::config::EdgeConfig;
use crate::gate::GatewayLimits;
use crate::uplink::{Incoming, Uplink, UplinkError, UplinkOptions};
use crate::uplink_stats::{DisconnectReason, UplinkStats};
use tidegate_kit::backoff::{Backoff, Loudness, Outage};

/// First delay before redialling the gateway; it doubles per failure up to
/// [`REDIAL_MAX`]. Each delay is drawn from the upper half of its step
/// ([`Backoff`]'s equal jitter): when a gateway restarts, its edges, cut
/// off in the same instant, do not all dial it again in the same instant.
pub const REDIAL_BASE: Duration = Duration::from_millis(200);
/// Longest delay before redialling the gateway (so 0.5-1 s once the delays
/// have grown). Short, because an edge should serve again within 2 s of
/// its link's return: with [`DIAL_ATTEMPT`], at most 1.5 s pass between
/// two Initial packets toward the gateway (an attempt's second one, 1 s in,
/// then at most 0.5 s of the attempt and 1 s of delay), and the dial that
/// follows the return needs a round trip or two. Long enough that 1000
/// edges redialling a restarted gateway spread their handshakes over a
/// second or more rather than a few milliseconds. The delay starts again
/// from [`REDIAL_BASE`] only after a connection has stayed up this long,
/// so a gateway that accepts and then drops the edge at once is redialled
/// once a second at most, not five times a second.
pub const REDIAL_MAX: Duration = Duration::from_secs(1);

/// While the gateway stays unreachable, a WARN line this often (with the
/// attempts and how long it has been); the redials between are DEBUG.
pub const OUTAGE_REMINDER: Duration = Duration::from_secs(30);
/// Longest one dial may take to get a QUIC connection up. A dial into a
/// dead link backs its Initial packets off (sent at 0, ~1 s, ~3 s, ~7 s at
/// QUIC's default initial RTT): past this one is abandoned and, after the
/// redial delay, a fresh one starts whose first Initial goes out at once.
/// 1.5 s lets an attempt send two Initials (one may be lost on a lossy
/// link) and ends it before the 2 s silence that would follow. A gateway
/// that is reachable but slow to answer `Hello` is not cut short by this:
/// the wait for `Welcome` has its own bound (`uplink::HANDSHAKE_TIMEOUT`).
pub const DIAL_ATTEMPT: Duration = Duration::from_millis(1500);

/// The gateway's hints in force: the latest for all cameras, and the latest
/// per camera. A hint replaces the one before it; one for all cameras
/// replaces every per-camera hint too. A new connection starts with none.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HintBoard {
    all: Option<GatewayLimits>,
    per_camera: HashMap<String, GatewayLimits>,
}

impl HintBoard {
    /// Applies a hint from the gateway.
    pub fn apply(&mut self, h: &ControlHint) {
        let hint = GatewayLimits {
            max_fps: h.max_fps as f64,
            motion_threshold: h.motion_threshold as f64,
        };
        if h.camera.is_empty() {
            self.per_camera.clear();
            self.all = Some(hint);
        } else {
            self.per_camera.insert(h.camera.clone(), hint);
        }
    }

    /// The hint that applies to `camera`.
    pub fn for_camera(&self, camera: &str) -> Option<GatewayLimits> {
        self.per_camera.get(camera).copied().or(self.all)
    }
}

/// What the link task hands the node, in the order it happened.
#[derive(Debug)]
pub(super) enum FromLink {
    /// A frame's result.
    Result(FrameResult),
    /// Connection [`Uplink::id`] has ended, and every result it delivered
    /// came before this.
    Ended(u64),
}

impl FromLink {
    /// Roughly the memory it holds, in bytes.
    fn held_bytes(&self) -> usize {
        match self {
            FromLink::Result(r) => r.held_bytes(),
            FromLink::Ended(_) => std::mem::size_of::<FromLink>(),
        }
    }
}

/// A record of the uplink to `cfg`'s gateway, labelled with its address
/// as configured, for [`NodeOptions::uplink`] and the metrics.
///
/// [`NodeOptions::uplink`]: super::NodeOptions::uplink
pub fn uplink_stats(cfg: &EdgeConfig) -> Arc<UplinkStats> {
    Arc::new(UplinkStats::new(
        &cfg.gateway.addr.to_string(),
        cfg.gateway.congestion,
    ))
}

/// What the link task hands on and listens to, beside its config.
pub(super) struct LinkShell {
    /// The live uplink, for the cameras (`None` between connections).
    pub(super) link_tx: watch::Sender<Option<Uplink>>,
    pub(super) hints_tx: watch::Sender<HintBoard>,
    pub(super) results: queue::Sender<FromLink>,
    /// A failure that ends the node (a refusal for good, a local fault).
    pub(super) fatal: mpsc::Sender<UplinkError>,
    /// Each dial and each connection's end, for the metrics.
    pub(super) stats: Arc<UplinkStats>,
    pub(super) cancel: CancellationToken,
}

/// How [`LinkShell::serve`] ended.
#[derive(Debug, PartialEq, Eq)]
enum Served {
    /// The connection ended and the node has been told, after its results.
    Ended,
    /// The edge is stopping (or the node stopped reading): the link ends.
    Stopped,
}

/// Keeps a connection to the gateway: dials with jittered exponential
/// backoff (each dial bounded by [`DIAL_ATTEMPT`]), publishes the uplink,
/// forwards results, applies hints ([`LinkShell::serve`]), and starts over
/// when the connection is lost, telling the node after the connection's
/// last result. The CA is loaded once, here: a redial never reads it again.
/// The backoff starts again from [`REDIAL_BASE`] only after a connection
/// has stayed up [`REDIAL_MAX`]. Every dial and every connection's end is
/// recorded in the shell's [`UplinkStats`].
pub(super) async fn link(cfg: EdgeConfig, shell: LinkShell) {
    let client = match tidegate_protocol::quic::client_config_with(
        &cfg.gateway.ca,
        cfg.gateway.congestion,
    ) {
        Ok(c) => c,
        Err(e) => {
            let e = UplinkError::Tls(e);
            error!("gateway.ca: {e}");
            let _ = shell.fatal.send(e).await;
            return;
        }
    };
    // Resolved at every dial: a redial follows a gateway that moved.
    let dial = || {
        Uplink::connect_client(
            &cfg.gateway.addr,
            &cfg.gateway.server_name,
            client.clone(),
            &cfg.name,
            &cfg.token.0,
            UplinkOptions {
                dial_timeout: Some(DIAL_ATTEMPT),
                ..UplinkOptions::default()
            },
        )
    };
    redial(&cfg.name, shell, dial).await;
}

/// [`link`]'s loop, with each dial made by `dial`, so that tests run its
/// redial schedule on a paused clock.
async fn redial<F>(name: &str, shell: LinkShell, mut dial: impl FnMut() -> F)
where
    F: std::future::Future<Output = Result<(Uplink, queue::Receiver<Incoming>), UplinkError>>,
{
    let mut backoff = Backoff::seeded(REDIAL_BASE, REDIAL_MAX, name);
    // one WARN for an outage, then one every OUTAGE_REMINDER: not one per
    // redial
    let mut outage = Outage::new(OUTAGE_REMINDER);
    let mut connected_before = false;
    loop {
        let connected = tokio::select! {
            _ = shell.cancel.cancelled() => return,
            r = dial() => r,
        };
        let (uplink, incoming) = match connected {
            Ok(u) => u,
            Err(e) => {
                shell.stats.dial_failed(&e);
                // A local failure (no UDP socket) once the edge has worked
                // is passing: retried like the gateway's.
                if !(e.retryable() || (connected_before && e.is_local())) {
                    error!("{e}");
                    let _ = shell.fatal.send(e).await;
                    return;
                }
                let delay = backoff.next_delay();
                match outage.failed(std::time::Instant::now()) {
                    Loudness::Warn { attempts, down_for } => {
                        warn!(attempts, ?down_for, "{e}; retrying in {delay:?}");
                    }
                    Loudness::Debug => debug!("{e}; retrying in {delay:?}"),
                }
                tokio::select! {
                    _ = shell.cancel.cancelled() => return,
                    _ = tokio::time::sleep(delay) => continue,
                }
            }
        };
        connected_before = true;
        let up_since = Instant::now();
        match outage.recovered(std::time::Instant::now()) {
            Some((attempts, down_for)) => {
                info!(addr = %uplink.remote_address(), attempts, ?down_for, "connected again")
            }
            None => info!(addr = %uplink.remote_address(), "connected"),
        }
        shell
            .stats
            .dialled(std::time::Instant::now(), Arc::new(uplink.clone()));
        if shell.serve(&uplink, incoming).await == Served::Stopped {
            return;
        }
        let why = uplink.closed().await;
        shell.link_tx.send_replace(None);
        if let Some(e) = uplink.close_reason() {
            shell.stats.disconnected(DisconnectReason::of(&e));
        }
        let up_for = up_since.elapsed();
        if !backoff.reset_if_stable(up_for) {
            debug!(
                ?up_for,
                "the connection did not stay up; the redial delay keeps growing"
            );
        }
        let delay = backoff.next_delay();
        // the outage's one loud line; the redials that fail are quiet
        let _ = outage.failed(std::time::Instant::now());
        warn!(
            "connection to the gateway lost ({why}); frames are dropped until it is back; reconnecting in {delay:?}"
        );
        tokio::select! {
            _ = shell.cancel.cancelled() => return,
            _ = tokio::time::sleep(delay) => {}
        }
    }
}

impl LinkShell {
    /// Publishes `uplink` to the cameras, forwards its results to the node
    /// and applies its hints until the connection ends, then tells the node
    /// that it ended (after its last result).
    async fn serve(&self, uplink: &Uplink, mut incoming: queue::Receiver<Incoming>) -> Served {
        self.hints_tx.send_modify(|h| *h = HintBoard::default());
        self.link_tx.send_replace(Some(uplink.clone()));
        loop {
            tokio::select! {
                _ = self.cancel.cancelled() => return self.stop(uplink),
                msg = incoming.recv() => match msg {
                    Some(Incoming::Result(r)) => {
                        let e2e = crate::clock::now_us().saturating_sub(r.captured_at_us);
                        uplink.report_latency(&r.camera, r.seq, e2e);
                        let r = FromLink::Result(r);
                        let size = r.held_bytes();
                        // The node stops reading when it stops: so may we.
                        tokio::select! {
                            _ = self.cancel.cancelled() => return self.stop(uplink),
                            sent = self.results.send(r, size) => if sent.is_err() {
                                return Served::Stopped;
                            },
                        }
                    }
                    Some(Incoming::Hint(h)) => {
                        info!(camera = %h.camera, max_fps = h.max_fps, motion_threshold = h.motion_threshold, "control hint");
                        self.hints_tx.send_modify(|b| b.apply(&h));
                    }
                    None => break,
                },
            }
        }
        // Every result the connection delivered has been forwarded: the
        // frames still waiting for one will never get it. The node counts
        // them once it has handled those results.
        let ended = FromLink::Ended(uplink.id());
        let size = ended.held_bytes();
        tokio::select! {
            _ = self.cancel.cancelled() => Served::Stopped,
            sent = self.results.send(ended, size) => if sent.is_err() {
                Served::Stopped
            } else {
                Served::Ended
            },
        }
    }

    /// The edge is stopping: the cameras let go of `uplink`, which is
    /// closed.
    fn stop(&self, uplink: &Uplink) -> Served {
        self.link_tx.send_replace(None);
        uplink.close();
        self.stats.disconnected(DisconnectReason::ClosedByEdge);
        Served::Stopped
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gate::CameraLimits;

    fn hint(camera: &str, max_fps: f32, motion_threshold: f32) -> ControlHint {
        ControlHint {
            camera: camera.into(),
            max_fps,
            motion_threshold,
        }
    }

    #[test]
    fn a_hint_replaces_the_previous_one_and_all_cameras_replaces_every_hint() {
        let mut b = HintBoard::default();
        assert_eq!(b.for_camera("door"), None);
        b.apply(&hint("door", 5.0, 0.0));
        assert_eq!(b.for_camera("door").unwrap().max_fps, 5.0);
        assert_eq!(b.for_camera("yard"), None);
        b.apply(&hint("door", 0.0, 0.1));
        let d = b.for_camera("door").unwrap();
        assert_eq!((d.max_fps, d.motion_threshold as f32), (0.0, 0.1));
        b.apply(&hint("", 2.0, 0.0));
        assert_eq!(b.for_camera("door").unwrap().max_fps, 2.0);
        assert_eq!(b.for_camera("yard").unwrap().max_fps, 2.0);
        b.apply(&hint("yard", 1.0, 0.0));
        assert_eq!(b.for_camera("yard").unwrap().max_fps, 1.0);
        assert_eq!(b.for_camera("door").unwrap().max_fps, 2.0);
    }

    #[test]
    fn effective_limits_follow_the_latest_hint_only() {
        let cam_limits = CameraLimits {
            max_fps: 10.0,
            motion_threshold: 0.0,
            keepalive_fps: 0.5,
        };
        let mut b = HintBoard::default();
        b.apply(&hint("", 4.0, 0.05));
        let l = cam_limits.under_gateway(b.for_camera("c"));
        assert_eq!(l.max_fps, 4.0);
        assert!((l.motion_threshold - 0.05).abs() < 1e-6);
        // The next hint lifts the cap again: it replaces, it does not stack.
        b.apply(&hint("", 0.0, 0.0));
        assert_eq!(cam_limits.under_gateway(b.for_camera("c")), cam_limits);
    }

    /// An edge config pointing nowhere: [`redial`]'s tests dial through
    /// their own closure.
    fn config() -> EdgeConfig {
        toml::from_str(
            "name = \"edge-1\"\ntoken = \"t\"\n[gateway]\naddr = \"127.0.0.1:1\"\nca = \"ca.pem\"\n",
        )
        .unwrap()
    }

    /// A shell for `cfg`, with its fatal errors and its published uplink.
    fn shell(
        cfg: &EdgeConfig,
    ) -> (
        LinkShell,
        mpsc::Receiver<UplinkError>,
        watch::Receiver<Option<Uplink>>,
    ) {
        let (link_tx, link_rx) = watch::channel(None);
        let (hints_tx, _) = watch::channel(HintBoard::default());
        let (results, _) = queue::channel(16, 1 << 20);
        let (fatal, fatal_rx) = mpsc::channel(1);
        let shell = LinkShell {
            link_tx,
            hints_tx,
            results,
            fatal,
            stats: uplink_stats(cfg),
            cancel: CancellationToken::new(),
        };
        (shell, fatal_rx, link_rx)
    }

    /// A gateway that never answers: each dial ends at its bound, and each
    /// redial waits within its step's band (the upper half of 200 ms
    /// doubling to the 1 s max), never past the max; every dial is counted.
    #[tokio::test(start_paused = true)]
    async fn a_gateway_that_never_answers_is_redialled_after_growing_delays_never_past_the_max() {
        // tokio's timer rounds a deadline up to its next millisecond
        const TICK: Duration = Duration::from_millis(1);
        let cfg = config();
        let (shell, mut fatal, published) = shell(&cfg);
        let (stats, cancel) = (shell.stats.clone(), shell.cancel.clone());
        let start = Instant::now();
        let mut dials = Vec::new();
        redial(&cfg.name, shell, || {
            dials.push(start.elapsed());
            if dials.len() == 9 {
                cancel.cancel();
            }
            let addr = cfg.gateway.addr.clone();
            async move {
                tokio::time::sleep(DIAL_ATTEMPT).await;
                Err(UplinkError::DialTimeout {
                    addr,
                    after: DIAL_ATTEMPT,
                })
            }
        })
        .await;
        assert_eq!(dials.len(), 9, "ended by the cancel at the ninth dial");
        let waits: Vec<Duration> = dials
            .windows(2)
            .map(|w| w[1] - w[0] - DIAL_ATTEMPT)
            .collect();
        let steps = [200, 400, 800, 1000, 1000, 1000, 1000, 1000].map(Duration::from_millis);
        for (i, (wait, step)) in waits.iter().zip(steps).enumerate() {
            assert!(
                *wait >= step / 2 && *wait <= step + TICK,
                "wait {i}: {wait:?} outside [{:?}, {step:?}]; all: {waits:?}",
                step / 2
            );
            assert!(*wait <= REDIAL_MAX + TICK, "{waits:?}");
        }
        let reading = stats.read(std::time::Instant::now());
        assert_eq!(reading.dials(crate::uplink_stats::DialResult::Timeout), 8);
        assert!(!reading.connected);
        assert!(published.borrow().is_none(), "no uplink published");
        assert!(fatal.try_recv().is_err(), "a dead link is not fatal");
    }

    /// A refusal no retry can fix (a wrong token) ends the link at once: no
    /// redial, no wait, and the node is told why.
    #[tokio::test(start_paused = true)]
    async fn a_refusal_for_good_ends_the_link_at_once_without_a_redial() {
        let cfg = config();
        let (shell, mut fatal, _published) = shell(&cfg);
        let stats = shell.stats.clone();
        let start = Instant::now();
        let mut dials = 0;
        redial(&cfg.name, shell, || {
            dials += 1;
            async {
                Err(UplinkError::Refused {
                    code: tidegate_protocol::ErrorCode::Unauthorized,
                    message: "bad token".into(),
                })
            }
        })
        .await;
        assert_eq!(dials, 1);
        assert_eq!(start.elapsed(), Duration::ZERO);
        assert!(matches!(
            fatal.try_recv(),
            Ok(UplinkError::Refused { message, .. }) if message == "bad token"
        ));
        let reading = stats.read(std::time::Instant::now());
        assert_eq!(reading.dials(crate::uplink_stats::DialResult::Refused), 1);
    }
}
