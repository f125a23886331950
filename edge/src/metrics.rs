//! Prometheus metrics of one edge, served at `/metrics` on the optional
//! `[metrics] listen` address: each configured camera's frames (seen,
//! passed, skipped, dropped, handed, delivered, ended without a result),
//! its results, the frame rate and quality in force, and its uplink's round
//! trip; and what the QUIC link itself did (bytes, datagrams, packets sent
//! and lost, congestion window, round trip, dials, disconnects and
//! reconnects).
//!
//! Nothing is counted twice: the camera series are read at scrape time from
//! the node's own per-camera counters, the [`CameraSummary`] it publishes
//! with each `camera_stats` line ([`crate::node::NodeOptions::stats`], every
//! `--summary-every` seconds). A scrape therefore shows the figures of the
//! last `camera_stats` line, never newer ones. The `camera` label takes only
//! the configured cameras' names, each exported from the start (at 0 until
//! its first summary). The uplink series are read at scrape time from the
//! link's [`UplinkStats`] ([`crate::node::NodeOptions::uplink`]): the live
//! connection's QUIC statistics plus the totals of those that ended. Their
//! one label, `gateway`, is the gateway's address as configured.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use prometheus::core::{Collector, Desc};
use prometheus::proto::{self, MetricFamily, MetricType};
use prometheus::{Encoder, IntGaugeVec, Opts, Registry, TextEncoder};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::node::CameraSummary;
use crate::uplink_stats::{DialResult, DisconnectReason, UplinkReading, UplinkStats};
use tidegate_protocol::quic::Congestion;

/// The file, from the workspace root, that lists
/// [`EdgeMetrics::series_names`], one a line, for the dashboard's check.
pub const SERIES_FILE: &str = "deploy/grafana/series/edge.txt";

/// Whether a family only goes up (a counter) or is a level (a gauge).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Counter,
    Gauge,
}

/// The value of one series, read from what the family describes (a
/// camera's summary, the uplink's reading).
type Read<T> = fn(&T) -> f64;

/// One exported family: its name, help and kind, the label beside the
/// source's own (`camera`, `gateway`), if any, and a value per label value
/// (`""` without a label).
struct Family<T: 'static> {
    name: &'static str,
    help: &'static str,
    kind: Kind,
    label: Option<&'static str>,
    values: &'static [(&'static str, Read<T>)],
}

/// The states a camera's task reports (`CameraSummary::state`).
pub const CAMERA_STATES: [&str; 5] = ["starting", "running", "waiting", "stopped", "failed"];

const FAMILIES: &[Family<CameraSummary>] = &[
    Family {
        name: "tidegate_edge_frames_seen_total",
        help: "Frames the camera's pipeline produced.",
        kind: Kind::Counter,
        label: None,
        values: &[("", |c| c.seen as f64)],
    },
    Family {
        name: "tidegate_edge_frames_passed_total",
        help: "Frames that passed the rate cap and the motion gate.",
        kind: Kind::Counter,
        label: None,
        values: &[("", |c| c.passed as f64)],
    },
    Family {
        name: "tidegate_edge_frames_skipped_total",
        help: "Frames skipped at the gate, by reason: rate (over the frame-rate cap), static (no motion).",
        kind: Kind::Counter,
        label: Some("reason"),
        values: &[
            ("rate", |c| c.skipped_rate as f64),
            ("static", |c| c.skipped_static as f64),
        ],
    },
    Family {
        name: "tidegate_edge_frames_dropped_total",
        help: "Frames dropped on the edge, by reason: queue (evicted from the capture queue unread), outage (no connection could take them), encode (the encoder failed them).",
        kind: Kind::Counter,
        label: Some("reason"),
        values: &[
            ("queue", |c| c.dropped_queue as f64),
            ("outage", |c| c.dropped_outage as f64),
            ("encode", |c| c.encode_failed as f64),
        ],
    },
    Family {
        name: "tidegate_edge_frames_handed_total",
        help: "Frames handed to the uplink (a QUIC stream opened for each).",
        kind: Kind::Counter,
        label: None,
        values: &[("", |c| c.handed as f64)],
    },
    Family {
        name: "tidegate_edge_frames_delivered_total",
        help: "Frames the gateway's QUIC stack acknowledged.",
        kind: Kind::Counter,
        label: None,
        values: &[("", |c| c.delivered as f64)],
    },
    Family {
        name: "tidegate_edge_frames_unanswered",
        help: "Frames handed that ended without a result, by end: reset_superseded, reset_expired, refused, lost (stream open when the connection was lost), lost_connection (acknowledged, result never came), gave_up. A gauge: a result that comes late for a frame counted reset moves it to the results.",
        kind: Kind::Gauge,
        label: Some("end"),
        values: &[
            ("reset_superseded", |c| c.reset_superseded as f64),
            ("reset_expired", |c| c.reset_expired as f64),
            ("refused", |c| c.refused as f64),
            ("lost", |c| c.lost as f64),
            ("lost_connection", |c| c.lost_connection as f64),
            ("gave_up", |c| c.gave_up as f64),
        ],
    },
    Family {
        name: "tidegate_edge_frames_awaiting",
        help: "Frames handed that have not ended yet: on the wire, or acknowledged and awaiting their result.",
        kind: Kind::Gauge,
        label: None,
        values: &[("", |c| c.awaiting as f64)],
    },
    Family {
        name: "tidegate_edge_results_total",
        help: "Results received, by status: ok, or not_ok (shed, expired or failed).",
        kind: Kind::Counter,
        label: Some("status"),
        values: &[
            ("ok", |c| c.ok as f64),
            ("not_ok", |c| c.results.saturating_sub(c.ok) as f64),
        ],
    },
    Family {
        name: "tidegate_edge_results_late_total",
        help: "Results late: ok but over the camera's budget, or shed by the gateway as late on arrival.",
        kind: Kind::Counter,
        label: None,
        values: &[("", |c| c.late as f64)],
    },
    Family {
        name: "tidegate_edge_camera_restarts_total",
        help: "Restarts of the camera's pipeline.",
        kind: Kind::Counter,
        label: None,
        values: &[("", |c| c.restarts as f64)],
    },
    Family {
        name: "tidegate_edge_camera_state",
        help: "1 for the state the camera is in: starting, running, waiting (for the gateway or a worker), stopped or failed.",
        kind: Kind::Gauge,
        label: Some("state"),
        values: &[
            ("starting", |c| {
                f64::from(u8::from(c.state == CAMERA_STATES[0]))
            }),
            ("running", |c| {
                f64::from(u8::from(c.state == CAMERA_STATES[1]))
            }),
            ("waiting", |c| {
                f64::from(u8::from(c.state == CAMERA_STATES[2]))
            }),
            ("stopped", |c| {
                f64::from(u8::from(c.state == CAMERA_STATES[3]))
            }),
            ("failed", |c| {
                f64::from(u8::from(c.state == CAMERA_STATES[4]))
            }),
        ],
    },
    Family {
        name: "tidegate_edge_camera_max_fps",
        help: "Frame-rate cap in force: the configured one, the gateway's hint and the adaptation's, whichever is strictest (0 before the camera runs).",
        kind: Kind::Gauge,
        label: None,
        values: &[("", |c| c.max_fps)],
    },
    Family {
        name: "tidegate_edge_camera_adapt_max_fps",
        help: "The uplink adaptation's own frame-rate cap.",
        kind: Kind::Gauge,
        label: None,
        values: &[("", |c| c.adapt_max_fps)],
    },
    Family {
        name: "tidegate_edge_camera_copies",
        help: "Copies of each frame sent now: fixed by `copies`, or chosen by `copies = \"auto\"` from the path's random loss and round trip (0 before the camera is open).",
        kind: Kind::Gauge,
        label: None,
        values: &[("", |c| f64::from(c.copies))],
    },
    Family {
        name: "tidegate_edge_camera_jpeg_quality",
        help: "JPEG quality in force (0 for raw and PNG frames).",
        kind: Kind::Gauge,
        label: None,
        values: &[("", |c| f64::from(c.quality))],
    },
    Family {
        name: "tidegate_edge_frame_bytes",
        help: "Mean bytes of a frame handed to QUIC, over the last 1 s window that sent any.",
        kind: Kind::Gauge,
        label: None,
        values: &[("", |c| c.bytes_per_frame as f64)],
    },
    Family {
        name: "tidegate_edge_encode_seconds",
        help: "Mean time to encode a frame, over the last 1 s window that encoded any (0 for raw).",
        kind: Kind::Gauge,
        label: None,
        values: &[("", |c| c.encode_us as f64 / 1e6)],
    },
    Family {
        name: "tidegate_edge_uplink_rtt_seconds",
        help: "The uplink's smoothed round trip as the camera last saw it (0 without a connection).",
        kind: Kind::Gauge,
        label: None,
        values: &[("", |c| c.rtt_ms / 1e3)],
    },
];

/// The uplink's families, one series per label value, labelled `gateway`.
const UPLINK_FAMILIES: &[Family<UplinkReading>] = &[
    Family {
        name: "tidegate_edge_uplink_sent_bytes_total",
        help: "Bytes of UDP payload sent to the gateway over every connection (QUIC headers, encryption and retransmissions included).",
        kind: Kind::Counter,
        label: None,
        values: &[("", |r| r.totals.sent_bytes as f64)],
    },
    Family {
        name: "tidegate_edge_uplink_received_bytes_total",
        help: "Bytes of UDP payload received from the gateway over every connection.",
        kind: Kind::Counter,
        label: None,
        values: &[("", |r| r.totals.received_bytes as f64)],
    },
    Family {
        name: "tidegate_edge_uplink_sent_datagrams_total",
        help: "UDP datagrams sent to the gateway over every connection.",
        kind: Kind::Counter,
        label: None,
        values: &[("", |r| r.totals.sent_datagrams as f64)],
    },
    Family {
        name: "tidegate_edge_uplink_sent_packets_total",
        help: "QUIC packets sent over every connection (a datagram may carry several): what the loss share is of.",
        kind: Kind::Counter,
        label: None,
        values: &[("", |r| r.totals.sent_packets as f64)],
    },
    Family {
        name: "tidegate_edge_uplink_lost_packets_total",
        help: "QUIC packets sent and declared lost, over every connection.",
        kind: Kind::Counter,
        label: None,
        values: &[("", |r| r.totals.lost_packets as f64)],
    },
    Family {
        name: "tidegate_edge_uplink_congestion_events_total",
        help: "Times the congestion controller cut its window, over every connection.",
        kind: Kind::Counter,
        label: None,
        values: &[("", |r| r.totals.congestion_events as f64)],
    },
    Family {
        name: "tidegate_edge_uplink_cwnd_bytes",
        help: "The live connection's congestion window (0 without a connection).",
        kind: Kind::Gauge,
        label: None,
        values: &[("", |r| r.cwnd as f64)],
    },
    Family {
        name: "tidegate_edge_uplink_smoothed_rtt_seconds",
        help: "The live connection's smoothed round trip (0 without a connection).",
        kind: Kind::Gauge,
        label: None,
        values: &[("", |r| r.rtt.as_secs_f64())],
    },
    Family {
        name: "tidegate_edge_uplink_congestion_controller",
        help: "1 for the congestion controller of what the edge sends (gateway.congestion), 0 for the others.",
        kind: Kind::Gauge,
        label: Some("controller"),
        values: &[
            ("cubic", |r| {
                f64::from(u8::from(r.congestion == Congestion::Cubic))
            }),
            ("newreno", |r| {
                f64::from(u8::from(r.congestion == Congestion::NewReno))
            }),
            ("bbr", |r| {
                f64::from(u8::from(r.congestion == Congestion::Bbr))
            }),
        ],
    },
    Family {
        name: "tidegate_edge_uplink_connected",
        help: "1 while a connection to the gateway is up, else 0.",
        kind: Kind::Gauge,
        label: None,
        values: &[("", |r| f64::from(u8::from(r.connected)))],
    },
    Family {
        name: "tidegate_edge_uplink_last_connect_age_seconds",
        help: "Seconds since the last connection to the gateway was set up (0 before the first), on the edge's monotonic clock.",
        kind: Kind::Gauge,
        label: None,
        values: &[("", |r| r.since_connect.as_secs_f64())],
    },
    Family {
        name: "tidegate_edge_uplink_dials_total",
        help: "Dials of the gateway by result: ok (connected and welcomed), timeout (no QUIC connection or no Welcome in time), refused (the gateway said no), failed (name, TLS, protocol or local socket).",
        kind: Kind::Counter,
        label: Some("result"),
        values: &[
            ("ok", |r| r.dials(DialResult::Ok) as f64),
            ("timeout", |r| r.dials(DialResult::Timeout) as f64),
            ("refused", |r| r.dials(DialResult::Refused) as f64),
            ("failed", |r| r.dials(DialResult::Failed) as f64),
        ],
    },
    Family {
        name: "tidegate_edge_uplink_disconnects_total",
        help: "Connections to the gateway that ended, by reason: timeout (QUIC idle timeout), reset (stateless reset), closed_by_gateway, closed_by_edge (no answer in time, a broken control stream, or stopping), error (a QUIC transport error).",
        kind: Kind::Counter,
        label: Some("reason"),
        values: &[
            ("timeout", |r| {
                r.disconnects(DisconnectReason::Timeout) as f64
            }),
            ("reset", |r| r.disconnects(DisconnectReason::Reset) as f64),
            ("closed_by_gateway", |r| {
                r.disconnects(DisconnectReason::ClosedByGateway) as f64
            }),
            ("closed_by_edge", |r| {
                r.disconnects(DisconnectReason::ClosedByEdge) as f64
            }),
            ("error", |r| r.disconnects(DisconnectReason::Error) as f64),
        ],
    },
    Family {
        name: "tidegate_edge_uplink_reconnects_total",
        help: "Connections to the gateway set up after an earlier one (the first is not a reconnect).",
        kind: Kind::Counter,
        label: None,
        values: &[("", |r| r.reconnects as f64)],
    },
];

/// A camera's summary before its first `camera_stats`: every count 0.
pub fn starting(camera: &str) -> CameraSummary {
    CameraSummary {
        camera: camera.to_string(),
        state: CAMERA_STATES[0],
        seen: 0,
        passed: 0,
        skipped_rate: 0,
        skipped_static: 0,
        dropped_queue: 0,
        dropped_outage: 0,
        handed: 0,
        delivered: 0,
        reset_superseded: 0,
        reset_expired: 0,
        refused: 0,
        lost: 0,
        lost_connection: 0,
        gave_up: 0,
        awaiting: 0,
        results: 0,
        ok: 0,
        restarts: 0,
        max_fps: 0.0,
        motion_threshold: 0.0,
        encoding: "",
        quality: 0,
        adapt_max_fps: 0.0,
        bytes_per_frame: 0,
        encode_us: 0,
        encoded: 0,
        encode_failed: 0,
        late: 0,
        rtt_ms: 0.0,
        copies: 0,
    }
}

/// The camera families of the configured cameras, read from the node's
/// latest summaries at each scrape.
struct CameraCollector {
    cameras: Vec<String>,
    stats: watch::Receiver<Vec<CameraSummary>>,
    descs: Vec<Desc>,
}

impl std::fmt::Debug for CameraCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CameraCollector")
            .field("cameras", &self.cameras)
            .finish_non_exhaustive()
    }
}

impl Collector for CameraCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let latest = self.stats.borrow();
        let now: Vec<CameraSummary> = self
            .cameras
            .iter()
            .map(|name| {
                latest
                    .iter()
                    .find(|c| &c.camera == name)
                    .cloned()
                    .unwrap_or_else(|| starting(name))
            })
            .collect();
        camera_families(&now)
    }
}

/// The camera families for `cameras`, one series per camera and label value.
pub fn camera_families(cameras: &[CameraSummary]) -> Vec<MetricFamily> {
    let sources: Vec<(&str, &CameraSummary)> =
        cameras.iter().map(|c| (c.camera.as_str(), c)).collect();
    families(FAMILIES, "camera", &sources)
}

/// The families of `table` for `sources`, one series per source and label
/// value, each source's series labelled `key` with its name.
fn families<T>(table: &[Family<T>], key: &str, sources: &[(&str, &T)]) -> Vec<MetricFamily> {
    table
        .iter()
        .map(|f| {
            let mut metrics = Vec::new();
            for (name, source) in sources {
                for (value, read) in f.values {
                    let mut labels = vec![label(key, name)];
                    if let Some(name) = f.label {
                        labels.push(label(name, value));
                    }
                    let mut m = proto::Metric::default();
                    m.set_label(labels);
                    match f.kind {
                        Kind::Counter => {
                            let mut v = proto::Counter::default();
                            v.set_value(read(source));
                            m.set_counter(v);
                        }
                        Kind::Gauge => {
                            let mut v = proto::Gauge::default();
                            v.set_value(read(source));
                            m.set_gauge(v);
                        }
                    }
                    metrics.push(m);
                }
            }
            let mut family = MetricFamily::default();
            family.set_name(f.name.to_string());
            family.set_help(f.help.to_string());
            family.set_field_type(match f.kind {
                Kind::Counter => MetricType::COUNTER,
                Kind::Gauge => MetricType::GAUGE,
            });
            family.set_metric(metrics);
            family
        })
        .filter(|f| !f.get_metric().is_empty())
        .collect()
}

/// The descriptions of `table`'s families, labelled `key` and their own
/// label.
fn descs<T>(table: &[Family<T>], key: &str) -> Vec<Desc> {
    table
        .iter()
        .map(|f| {
            let mut labels = vec![key.to_string()];
            labels.extend(f.label.map(str::to_string));
            Desc::new(f.name.into(), f.help.into(), labels, Default::default()).expect("valid desc")
        })
        .collect()
}

/// The uplink's families, read from the link's record at each scrape.
#[derive(Debug)]
struct UplinkCollector {
    stats: Arc<UplinkStats>,
    descs: Vec<Desc>,
}

impl Collector for UplinkCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let r = self.stats.read(Instant::now());
        families(UPLINK_FAMILIES, "gateway", &[(r.gateway.as_str(), &r)])
    }
}

fn label(name: &str, value: &str) -> proto::LabelPair {
    let mut l = proto::LabelPair::default();
    l.set_name(name.to_string());
    l.set_value(value.to_string());
    l
}

/// Every metric of an edge.
#[derive(Debug, Clone)]
pub struct EdgeMetrics {
    registry: Registry,
}

impl EdgeMetrics {
    /// Registers the camera families of `cameras` (the configured names),
    /// read from `stats` (the node's summaries) at each scrape, the
    /// uplink's, read from `uplink` (the record the node's link keeps,
    /// [`crate::node::NodeOptions::uplink`]) at each scrape, the build and
    /// the process.
    pub fn new(
        cameras: &[String],
        stats: watch::Receiver<Vec<CameraSummary>>,
        uplink: Arc<UplinkStats>,
    ) -> Self {
        let registry = Registry::new();
        let mut unique = cameras.to_vec();
        unique.sort();
        unique.dedup();
        registry
            .register(Box::new(CameraCollector {
                cameras: unique,
                stats,
                descs: descs(FAMILIES, "camera"),
            }))
            .expect("camera metric names are unique");
        registry
            .register(Box::new(UplinkCollector {
                stats: uplink,
                descs: descs(UPLINK_FAMILIES, "gateway"),
            }))
            .expect("uplink metric names are unique");
        let build = IntGaugeVec::new(
            Opts::new(
                "tidegate_edge_build_info",
                "1, labelled with the version of the tidegate edge running.",
            ),
            &["version"],
        )
        .expect("valid gauge");
        build.with_label_values(&[env!("CARGO_PKG_VERSION")]).set(1);
        registry
            .register(Box::new(build))
            .expect("build info registers once");
        #[cfg(target_os = "linux")]
        registry
            .register(Box::new(
                prometheus::process_collector::ProcessCollector::for_self(),
            ))
            .expect("process metrics register once");
        EdgeMetrics { registry }
    }

    /// The name of every series an edge can export. It is kept in
    /// [`SERIES_FILE`] (a test holds the two equal), where
    /// `deploy/tests/deploy.rs` checks the dashboard against it.
    pub fn series_names() -> Vec<String> {
        let mut names: Vec<String> = FAMILIES.iter().map(|f| f.name.to_string()).collect();
        names.extend(UPLINK_FAMILIES.iter().map(|f| f.name.to_string()));
        names.push("tidegate_edge_build_info".into());
        #[cfg(target_os = "linux")]
        names.extend(
            prometheus::process_collector::ProcessCollector::for_self()
                .desc()
                .iter()
                .map(|d| d.fq_name.clone()),
        );
        names.sort();
        names
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut buf)
            .expect("text encoding cannot fail");
        String::from_utf8(buf).expect("prometheus text is UTF-8")
    }
}

/// Binds `addr` and serves `/metrics` there until `cancel` fires, in a
/// task of its own; the address bound (the port chosen when it was 0). The
/// error names the setting.
pub async fn serve(
    addr: SocketAddr,
    metrics: EdgeMetrics,
    cancel: CancellationToken,
) -> std::io::Result<SocketAddr> {
    use axum::http::header;
    use axum::response::IntoResponse;
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| {
        std::io::Error::new(
            e.kind(),
            format!("cannot listen for metrics on {addr} (metrics.listen, --metrics-listen): {e}"),
        )
    })?;
    let bound = listener.local_addr()?;
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let m = metrics.clone();
            async move {
                (
                    [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
                    m.render(),
                )
                    .into_response()
            }
        }),
    );
    tokio::spawn(async move {
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(async move { cancel.cancelled().await })
            .await;
        if let Err(e) = served {
            tracing::warn!("the metrics listener stopped: {e}");
        }
    });
    Ok(bound)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metrics(cameras: &[&str]) -> (EdgeMetrics, watch::Sender<Vec<CameraSummary>>) {
        let (m, tx, _) = metrics_with_uplink(cameras);
        (m, tx)
    }

    fn metrics_with_uplink(
        cameras: &[&str],
    ) -> (
        EdgeMetrics,
        watch::Sender<Vec<CameraSummary>>,
        Arc<UplinkStats>,
    ) {
        let (tx, rx) = watch::channel(Vec::new());
        let names: Vec<String> = cameras.iter().map(|c| c.to_string()).collect();
        let uplink = Arc::new(UplinkStats::new("gw.example:4433", Congestion::Bbr));
        (EdgeMetrics::new(&names, rx, uplink.clone()), tx, uplink)
    }

    /// A connection whose figures are fixed.
    #[derive(Debug)]
    struct Fixed(crate::uplink_stats::QuicReading);

    impl crate::uplink_stats::QuicSource for Fixed {
        fn reading(&self) -> crate::uplink_stats::QuicReading {
            self.0
        }
    }

    #[test]
    fn the_uplink_is_exported_at_zero_before_its_first_connection() {
        let (m, _tx, _uplink) = metrics_with_uplink(&["door"]);
        let text = m.render();
        let g = "gateway=\"gw.example:4433\"";
        for line in [
            format!("tidegate_edge_uplink_sent_bytes_total{{{g}}} 0"),
            format!("tidegate_edge_uplink_received_bytes_total{{{g}}} 0"),
            format!("tidegate_edge_uplink_sent_datagrams_total{{{g}}} 0"),
            format!("tidegate_edge_uplink_lost_packets_total{{{g}}} 0"),
            format!("tidegate_edge_uplink_cwnd_bytes{{{g}}} 0"),
            format!("tidegate_edge_uplink_smoothed_rtt_seconds{{{g}}} 0"),
            format!("tidegate_edge_uplink_connected{{{g}}} 0"),
            format!("tidegate_edge_uplink_last_connect_age_seconds{{{g}}} 0"),
            format!("tidegate_edge_uplink_reconnects_total{{{g}}} 0"),
            format!("tidegate_edge_uplink_congestion_controller{{{g},controller=\"bbr\"}} 1"),
            format!("tidegate_edge_uplink_congestion_controller{{{g},controller=\"cubic\"}} 0"),
            "# TYPE tidegate_edge_uplink_sent_bytes_total counter".to_string(),
            "# TYPE tidegate_edge_uplink_cwnd_bytes gauge".to_string(),
        ] {
            assert!(text.contains(&line), "{line} not in:\n{text}");
        }
        for r in DialResult::ALL {
            let line = format!(
                "tidegate_edge_uplink_dials_total{{{g},result=\"{}\"}} 0",
                r.name()
            );
            assert!(text.contains(&line), "{line} not in:\n{text}");
        }
        for r in DisconnectReason::ALL {
            let line = format!(
                "tidegate_edge_uplink_disconnects_total{{{g},reason=\"{}\"}} 0",
                r.name()
            );
            assert!(text.contains(&line), "{line} not in:\n{text}");
        }
    }

    #[test]
    fn the_uplink_reading_is_exported_as_it_is() {
        use crate::uplink_stats::{QuicReading, QuicTotals};
        let (m, _tx, uplink) = metrics_with_uplink(&["door"]);
        let ended = QuicReading {
            totals: QuicTotals {
                sent_bytes: 5000,
                received_bytes: 700,
                sent_datagrams: 5,
                sent_packets: 6,
                lost_packets: 1,
                congestion_events: 1,
            },
            cwnd: 9000,
            rtt: std::time::Duration::from_millis(40),
        };
        let t0 = Instant::now();
        uplink.dialled(t0, Arc::new(Fixed(ended)));
        uplink.disconnected(DisconnectReason::Reset);
        let live = QuicReading {
            totals: QuicTotals {
                sent_bytes: 100,
                sent_packets: 2,
                ..QuicTotals::default()
            },
            cwnd: 14_720,
            rtt: std::time::Duration::from_millis(25),
        };
        uplink.dialled(t0, Arc::new(Fixed(live)));
        let text = m.render();
        let g = "gateway=\"gw.example:4433\"";
        for line in [
            format!("tidegate_edge_uplink_sent_bytes_total{{{g}}} 5100"),
            format!("tidegate_edge_uplink_received_bytes_total{{{g}}} 700"),
            format!("tidegate_edge_uplink_sent_packets_total{{{g}}} 8"),
            format!("tidegate_edge_uplink_lost_packets_total{{{g}}} 1"),
            format!("tidegate_edge_uplink_cwnd_bytes{{{g}}} 14720"),
            format!("tidegate_edge_uplink_smoothed_rtt_seconds{{{g}}} 0.025"),
            format!("tidegate_edge_uplink_connected{{{g}}} 1"),
            format!("tidegate_edge_uplink_reconnects_total{{{g}}} 1"),
            format!("tidegate_edge_uplink_dials_total{{{g},result=\"ok\"}} 2"),
            format!("tidegate_edge_uplink_disconnects_total{{{g},reason=\"reset\"}} 1"),
        ] {
            assert!(text.contains(&line), "{line} not in:\n{text}");
        }
        assert!(!text.contains("camera=\"door\",gateway"), "{text}");
    }

    /// The label values written in the table are the classifications'
    /// own names, in the same order.
    #[test]
    fn uplink_label_values_are_the_fixed_sets() {
        let values = |name: &str| -> Vec<&str> {
            UPLINK_FAMILIES
                .iter()
                .find(|f| f.name == name)
                .unwrap()
                .values
                .iter()
                .map(|(v, _)| *v)
                .collect()
        };
        let dials: Vec<&str> = DialResult::ALL.iter().map(|r| r.name()).collect();
        assert_eq!(values("tidegate_edge_uplink_dials_total"), dials);
        let reasons: Vec<&str> = DisconnectReason::ALL.iter().map(|r| r.name()).collect();
        assert_eq!(values("tidegate_edge_uplink_disconnects_total"), reasons);
        let controllers: Vec<&str> = Congestion::ALL.iter().map(|c| c.name()).collect();
        assert_eq!(
            values("tidegate_edge_uplink_congestion_controller"),
            controllers
        );
    }

    #[test]
    fn configured_cameras_are_exported_at_zero_before_their_first_summary() {
        let (m, _tx) = metrics(&["door", "yard"]);
        let text = m.render();
        for line in [
            "tidegate_edge_frames_seen_total{camera=\"door\"} 0",
            "tidegate_edge_frames_dropped_total{camera=\"yard\",reason=\"outage\"} 0",
            "tidegate_edge_results_total{camera=\"door\",status=\"not_ok\"} 0",
            "tidegate_edge_camera_state{camera=\"yard\",state=\"starting\"} 1",
            "tidegate_edge_camera_state{camera=\"yard\",state=\"running\"} 0",
        ] {
            assert!(text.contains(line), "{line} not in:\n{text}");
        }
        let version = format!(
            "tidegate_edge_build_info{{version=\"{}\"}} 1",
            env!("CARGO_PKG_VERSION")
        );
        assert!(text.contains(&version), "{text}");
    }

    #[test]
    fn a_summary_is_exported_as_it_is_and_unknown_cameras_are_not() {
        let (m, tx) = metrics(&["door"]);
        let mut door = starting("door");
        door.state = "running";
        door.seen = 100;
        door.passed = 40;
        door.skipped_rate = 50;
        door.skipped_static = 10;
        door.handed = 38;
        door.dropped_outage = 2;
        door.delivered = 37;
        door.results = 36;
        door.ok = 33;
        door.lost_connection = 1;
        door.max_fps = 5.0;
        door.quality = 70;
        door.rtt_ms = 12.5;
        door.encode_us = 1500;
        // a camera that is not in the config never gets a label
        let mut stray = starting("stray");
        stray.seen = 7;
        tx.send_replace(vec![door, stray]);
        let text = m.render();
        for line in [
            "tidegate_edge_frames_seen_total{camera=\"door\"} 100",
            "tidegate_edge_frames_passed_total{camera=\"door\"} 40",
            "tidegate_edge_frames_skipped_total{camera=\"door\",reason=\"rate\"} 50",
            "tidegate_edge_frames_skipped_total{camera=\"door\",reason=\"static\"} 10",
            "tidegate_edge_frames_dropped_total{camera=\"door\",reason=\"outage\"} 2",
            "tidegate_edge_frames_handed_total{camera=\"door\"} 38",
            "tidegate_edge_frames_delivered_total{camera=\"door\"} 37",
            "tidegate_edge_frames_unanswered{camera=\"door\",end=\"lost_connection\"} 1",
            "tidegate_edge_results_total{camera=\"door\",status=\"ok\"} 33",
            "tidegate_edge_results_total{camera=\"door\",status=\"not_ok\"} 3",
            "tidegate_edge_camera_state{camera=\"door\",state=\"running\"} 1",
            "tidegate_edge_camera_state{camera=\"door\",state=\"starting\"} 0",
            "tidegate_edge_camera_max_fps{camera=\"door\"} 5",
            "tidegate_edge_camera_jpeg_quality{camera=\"door\"} 70",
            "tidegate_edge_uplink_rtt_seconds{camera=\"door\"} 0.0125",
            "tidegate_edge_encode_seconds{camera=\"door\"} 0.0015",
            "# TYPE tidegate_edge_frames_seen_total counter",
            "# TYPE tidegate_edge_frames_unanswered gauge",
        ] {
            assert!(text.contains(line), "{line} not in:\n{text}");
        }
        assert!(!text.contains("stray"), "{text}");
    }

    #[test]
    fn each_camera_state_is_a_label_value() {
        for (i, state) in CAMERA_STATES.iter().enumerate() {
            let mut c = starting("c");
            c.state = state;
            let families = camera_families(&[c]);
            let f = families
                .iter()
                .find(|f| f.name() == "tidegate_edge_camera_state")
                .unwrap();
            let ones: Vec<usize> = f
                .get_metric()
                .iter()
                .enumerate()
                .filter(|(_, m)| m.get_gauge().get_value() == 1.0)
                .map(|(j, _)| j)
                .collect();
            assert_eq!(ones, vec![i], "{state}");
        }
    }

    /// The list the dashboard is checked against is this edge's.
    #[test]
    fn the_series_file_lists_exactly_what_an_edge_exports() {
        let (m, _tx) = metrics(&["c"]);
        let mut rendered: Vec<String> = m
            .registry
            .gather()
            .iter()
            .map(|f| f.name().to_string())
            .collect();
        rendered.sort();
        let names = EdgeMetrics::series_names();
        for n in &rendered {
            assert!(names.contains(n), "{n} exported but not in {names:?}");
        }
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(SERIES_FILE);
        let want = names.join("\n") + "\n";
        let have = std::fs::read_to_string(&path).unwrap_or_default();
        assert_eq!(
            have,
            want,
            "{} is out of date; write the list above into it",
            path.display()
        );
    }
}
