//! The gateway's configuration: a TOML file, with `TIDEGATE_*` environment
//! variables and command-line flags layered on top (flags left unset never
//! clobber the file).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use tidegate_protocol::quic::Congestion;

/// Everything the gateway needs to run.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// QUIC listener for edges and workers.
    #[serde(default)]
    pub quic: QuicConfig,
    /// HTTP listener for `/metrics` and the API.
    #[serde(default)]
    pub http: HttpConfig,
    /// Scheduling bounds and margins.
    #[serde(default)]
    pub scheduler: SchedulerConfig,
    /// Edges allowed to connect.
    #[serde(default)]
    pub edges: Vec<Principal>,
    /// Workers allowed to connect.
    #[serde(default)]
    pub workers: Vec<Principal>,
    /// GPU leasing and autoscaling; absent: no leasing, workers come from
    /// `[[workers]]` only.
    #[serde(default)]
    pub leasing: Option<LeasingConfig>,
    /// What one peer may make the gateway hold: partly received frames,
    /// connections before login, connections and cameras per edge name.
    #[serde(default)]
    pub limits: LimitsConfig,
    /// The status page: its camera thumbnails.
    #[serde(default)]
    pub status: StatusConfig,
}

/// Where leases come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProviderKind {
    /// Spawn `tidegate-worker` processes on this host (`[leasing.process]`).
    Process,
    /// Bind workers that exist and dial in (`[[leasing.static_workers]]`).
    Static,
    /// Submit each lease as a Slurm batch job (`[leasing.slurm]`).
    Slurm,
    /// Create each lease as a Kubernetes Pod (`[leasing.kubernetes]`).
    Kubernetes,
}

/// What a clean stop does with the live leases (`[leasing] on_stop`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnStop {
    /// Release every lease: its worker is stopped and its billing ends.
    #[default]
    Release,
    /// Keep every lease live, its worker running: the next start adopts
    /// them (their workers redial within `gateway.reconnect_secs`).
    Keep,
}

/// `[leasing]`: the lease manager and its autoscaler. `Debug` leaves out
/// the static workers' token digests.
#[derive(Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeasingConfig {
    /// `process`, `static`, `slurm` or `kubernetes`.
    pub provider: ProviderKind,
    /// Pricing catalog (TOML); default: the built-in one.
    #[serde(default)]
    pub catalog: Option<PathBuf>,
    /// The SQLite ledger file (created if missing).
    pub ledger: PathBuf,
    /// Scaling policy: `paid-block-aware` (default), `tidal`,
    /// `reactive-idle-timeout`, `idle-timeout-spot` or `static-peak`.
    #[serde(default = "default_policy")]
    pub policy: String,
    /// Autoscaler tick (ms).
    #[serde(default = "default_tick_ms")]
    pub tick_ms: u64,
    /// A lease whose worker has not registered this long after it was
    /// requested is ended as `failed` and released (s).
    #[serde(default = "default_start_timeout_secs")]
    pub start_timeout_secs: u64,
    /// A ready lease whose worker's connection has been gone this long
    /// (it died, hung, or lost its network) is ended as `lost` and
    /// released, so that a new lease replaces it; also counted from a
    /// restart for the leases adopted (s). Longer than the worker's own
    /// `gateway.reconnect_secs` (60), so that a worker that can redial
    /// does.
    #[serde(default = "default_rejoin_timeout_secs")]
    pub rejoin_timeout_secs: u64,
    /// Most the leases not ended may cost together, per hour, in the
    /// catalog's currency; unset: no cap.
    #[serde(default)]
    pub spend_cap_per_hour: Option<f64>,
    /// Capacity kept above the observed rate (0.03 = 3 %); unset: the
    /// policy's default.
    #[serde(default)]
    pub headroom: Option<f64>,
    /// Scale-down looks at the highest rate over this window (s); unset:
    /// the policy's default (600).
    #[serde(default)]
    pub down_window_secs: Option<u64>,
    /// Paid-block-aware: release at most this long before a paid block
    /// ends (s); unset: the policy's default (180).
    #[serde(default)]
    pub release_window_secs: Option<u64>,
    /// Reactive policy: release a lease idle this long (s); unset: 300.
    #[serde(default)]
    pub idle_timeout_secs: Option<u64>,
    /// What a clean stop (SIGTERM) does with the live leases: `release`
    /// them (default), or `keep` them for the next start to adopt, so a
    /// restart (an upgrade, a config change) pays no new billing block.
    #[serde(default)]
    pub on_stop: OnStop,
    /// The process provider (required with `provider = "process"`).
    #[serde(default)]
    pub process: Option<ProcessProviderConfig>,
    /// The static provider's workers (with `provider = "static"`).
    #[serde(default)]
    pub static_workers: Vec<tidegate_lease::provider::static_workers::StaticWorker>,
    /// The Slurm provider (required with `provider = "slurm"`).
    #[serde(default)]
    pub slurm: Option<tidegate_lease::provider::slurm::SlurmConfig>,
    /// The Kubernetes provider (required with `provider = "kubernetes"`).
    #[serde(default)]
    pub kubernetes: Option<tidegate_lease::provider::kubernetes::KubernetesConfig>,
    /// The models to scale.
    #[serde(default)]
    pub models: Vec<ScaledModel>,
}

impl std::fmt::Debug for LeasingConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let statics: Vec<String> = self
            .static_workers
            .iter()
            .map(|w| {
                format!(
                    "{} ({}, {}, token <redacted>)",
                    w.name, w.instance_type, w.tier
                )
            })
            .collect();
        f.debug_struct("LeasingConfig")
            .field("provider", &self.provider)
            .field("catalog", &self.catalog)
            .field("ledger", &self.ledger)
            .field("policy", &self.policy)
            .field("tick_ms", &self.tick_ms)
            .field("start_timeout_secs", &self.start_timeout_secs)
            .field("rejoin_timeout_secs", &self.rejoin_timeout_secs)
            .field("spend_cap_per_hour", &self.spend_cap_per_hour)
            .field("headroom", &self.headroom)
            .field("down_window_secs", &self.down_window_secs)
            .field("release_window_secs", &self.release_window_secs)
            .field("idle_timeout_secs", &self.idle_timeout_secs)
            .field("on_stop", &self.on_stop)
            .field("process", &self.process)
            .field("static_workers", &statics)
            .field("slurm", &self.slurm)
            .field("kubernetes", &self.kubernetes)
            .field("models", &self.models)
            .finish()
    }
}

/// `[leasing.process]`: how to start a worker.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProcessProviderConfig {
    /// The worker command (`tidegate-worker`, or a path to it).
    pub command: String,
    /// Its arguments (e.g. `["--config", "worker.toml", "run"]`).
    #[serde(default)]
    pub args: Vec<String>,
    /// Extra environment for every worker.
    #[serde(default)]
    pub env: std::collections::BTreeMap<String, String>,
    /// Spot preemption notice period (s).
    #[serde(default = "default_notice_period_secs")]
    pub notice_period_secs: f64,
    /// Simulated spot preemption: every spot lease gets its notice this
    /// long after it starts (s); unset: never (drills and tests only).
    #[serde(default)]
    pub preempt_spot_after_secs: Option<f64>,
}

/// `[[leasing.models]]`: a model the autoscaler sizes capacity for.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScaledModel {
    /// Model name (as workers register it and edges ask for it).
    pub name: String,
    /// Catalog instance types it may be leased on.
    pub instance_types: Vec<String>,
    /// Capacity kept at all times (frames/s): with no worker, no camera can
    /// open, so a model with no load and `min_fps = 0` is never leased.
    #[serde(default)]
    pub min_fps: f64,
    /// Frames/s one worker is planned to serve within the budget, until a
    /// worker of that type registers and its profile is measured.
    pub worker_fps: f64,
    /// Replace `worker_fps` by the throughput measured from the registered
    /// workers' profiles. Turn off where the profile over-states what a
    /// worker delivers (several workers sharing the same CPU cores).
    #[serde(default = "default_true")]
    pub measure: bool,
    /// Reserved leases kept for this model (first instance type).
    #[serde(default)]
    pub reserved: u32,
}

fn default_policy() -> String {
    "paid-block-aware".into()
}
fn default_tick_ms() -> u64 {
    1000
}
fn default_start_timeout_secs() -> u64 {
    600
}
fn default_rejoin_timeout_secs() -> u64 {
    120
}
fn default_notice_period_secs() -> f64 {
    120.0
}

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

/// Whether `s` is a 64-digit hex SHA-256.
fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

fn default_http_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9090))
}

/// The status page's settings.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StatusConfig {
    /// Keep a JPEG of each camera's latest served frame with its
    /// detections drawn, for the status page and
    /// `/api/v1/cameras/{edge}/{camera}/thumbnail.jpg`. Off by default: it
    /// decodes and encodes frames on the gateway.
    #[serde(default)]
    pub thumbnails: bool,
    /// Least time between two thumbnails of one camera (ms).
    #[serde(default = "default_thumbnail_interval_ms")]
    pub thumbnail_interval_ms: u32,
    /// Longest side of a thumbnail (pixels).
    #[serde(default = "default_thumbnail_max_px")]
    pub thumbnail_max_px: u32,
}

impl Default for StatusConfig {
    fn default() -> Self {
        StatusConfig {
            thumbnails: false,
            thumbnail_interval_ms: default_thumbnail_interval_ms(),
            thumbnail_max_px: default_thumbnail_max_px(),
        }
    }
}

impl StatusConfig {
    /// Checks values that serde cannot: a rate a page can follow and a
    /// size that is a thumbnail.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.thumbnail_interval_ms < 250 {
            return Err(ConfigError::Invalid(format!(
                "status.thumbnail_interval_ms = {} would encode frames faster than a page shows them; use at least 250",
                self.thumbnail_interval_ms
            )));
        }
        if !(32..=640).contains(&self.thumbnail_max_px) {
            return Err(ConfigError::Invalid(format!(
                "status.thumbnail_max_px = {} must be 32..=640",
                self.thumbnail_max_px
            )));
        }
        Ok(())
    }

    /// The hub's thumbnail settings; `None` when thumbnails are off.
    pub fn thumbnails(&self) -> Option<crate::thumbnail::ThumbnailConfig> {
        self.thumbnails.then(|| crate::thumbnail::ThumbnailConfig {
            interval: std::time::Duration::from_millis(self.thumbnail_interval_ms.into()),
            max_px: self.thumbnail_max_px,
        })
    }
}

/// A page redraws every 2 s: a thumbnail as often is as fresh as it shows.
fn default_thumbnail_interval_ms() -> u32 {
    2000
}

/// A row of a table: readable boxes at a few kilobytes a JPEG.
fn default_thumbnail_max_px() -> u32 {
    160
}

/// Scheduling settings.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SchedulerConfig {
    /// Time reserved to send a result back, on top of the measured RTT (ms).
    #[serde(default = "default_return_margin_ms")]
    pub return_margin_ms: u32,
    /// Most frames queued in total.
    #[serde(default = "default_max_queued")]
    pub max_queued: usize,
    /// Most frames queued per edge name (all its connections together).
    #[serde(default = "default_max_queued_per_edge")]
    pub max_queued_per_edge: usize,
    /// The longest budget a frame is held to (ms): a frame (or a camera's
    /// `CameraOpen`) that declares more is served as if it had declared
    /// this, so that no edge can park frames in the queue for longer.
    #[serde(default = "default_max_budget_ms")]
    pub max_budget_ms: u32,
    /// Batches sent to a worker before the previous ones return (1..=4).
    #[serde(default = "default_pipeline_depth")]
    pub pipeline_depth: usize,
    /// Send cameras frame-rate hints when their frames are being shed.
    #[serde(default = "default_true")]
    pub hints: bool,
    /// Hint measurement window (ms).
    #[serde(default = "default_hint_window_ms")]
    pub hint_window_ms: u32,
    /// Fraction of a window's frames lost to overload that lowers the rate.
    #[serde(default = "default_hint_shed_ratio")]
    pub hint_shed_ratio: f64,
    /// How long past its expected end a worker's running batch may go
    /// unanswered before the worker counts as stalled and is dropped (ms).
    #[serde(default = "default_stall_timeout_ms")]
    pub stall_timeout_ms: u32,
    /// `[scheduler.health]`: when a worker failing its frames is demoted,
    /// and how it is probed back.
    #[serde(default)]
    pub health: crate::health::HealthSettings,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            return_margin_ms: default_return_margin_ms(),
            max_queued: default_max_queued(),
            max_queued_per_edge: default_max_queued_per_edge(),
            max_budget_ms: default_max_budget_ms(),
            pipeline_depth: default_pipeline_depth(),
            hints: true,
            hint_window_ms: default_hint_window_ms(),
            hint_shed_ratio: default_hint_shed_ratio(),
            stall_timeout_ms: default_stall_timeout_ms(),
            health: Default::default(),
        }
    }
}

fn default_stall_timeout_ms() -> u32 {
    10_000
}

fn default_pipeline_depth() -> usize {
    2
}
fn default_true() -> bool {
    true
}
fn default_hint_window_ms() -> u32 {
    1000
}
fn default_hint_shed_ratio() -> f64 {
    0.1
}

fn default_return_margin_ms() -> u32 {
    2
}
fn default_max_queued() -> usize {
    4096
}
fn default_max_queued_per_edge() -> usize {
    256
}
/// Ten seconds: a hundred times an 80 ms budget, far beyond any camera's
/// need, and short enough that a queue filled with such frames drains.
fn default_max_budget_ms() -> u32 {
    10_000
}

/// `[limits]`: bounds on what peers may make the gateway hold, so that one
/// authenticated edge, or strangers that never log in, cannot take its
/// memory (docs/operations.md, "Limits").
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsConfig {
    /// Bytes of partly received frames one connection may hold: each frame
    /// reserves its declared length before its body is read, and a frame
    /// that finds no room is refused (`memory_budget`). A frame larger than
    /// this is always refused.
    #[serde(default = "default_edge_inflight_bytes")]
    pub edge_inflight_bytes: u64,
    /// Bytes of partly received frames all connections together may hold.
    #[serde(default = "default_inflight_bytes_total")]
    pub inflight_bytes_total: u64,
    /// Time a frame stream has, from when it is accepted, to deliver its
    /// whole frame; a slower one is reset and counted (`read_timeout`): a
    /// frame this late is past any real-time budget (ms).
    #[serde(default = "default_frame_read_timeout_ms")]
    pub frame_read_timeout_ms: u32,
    /// Time a connection has to send its `Hello` (ms).
    #[serde(default = "default_hello_timeout_ms")]
    pub hello_timeout_ms: u32,
    /// Connections that have not logged in yet (handshaking, or waiting
    /// for their `Hello`) at once; more are refused as they arrive.
    #[serde(default = "default_max_unauthenticated")]
    pub max_unauthenticated: usize,
    /// Connections one edge name may have open at once.
    #[serde(default = "default_max_connections_per_edge")]
    pub max_connections_per_edge: usize,
    /// Cameras one edge name may have open at once, over all its
    /// connections (a camera open on two of them counts once).
    #[serde(default = "default_max_cameras_per_edge")]
    pub max_cameras_per_edge: usize,
    /// Control messages one edge connection may send a second, sustained;
    /// more are dropped before the hub
    /// (`tidegate_control_messages_dropped_total`).
    #[serde(default = "default_control_messages_per_second")]
    pub control_messages_per_second: u32,
    /// Control messages one edge connection may send at once above the
    /// sustained rate.
    #[serde(default = "default_control_burst")]
    pub control_burst: u32,
    /// Messages over the rate an edge connection may have dropped, beyond
    /// what the rate refills, before it is closed as a flood.
    #[serde(default = "default_control_flood_drops")]
    pub control_flood_drops: u32,
    /// How long an edge name is refused at login after one of its
    /// connections was closed as a flood (ms); doubles with each flood in
    /// a row, up to a minute. 0: never refused.
    #[serde(default = "default_control_flood_cooldown_ms")]
    pub control_flood_cooldown_ms: u64,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            edge_inflight_bytes: default_edge_inflight_bytes(),
            inflight_bytes_total: default_inflight_bytes_total(),
            frame_read_timeout_ms: default_frame_read_timeout_ms(),
            hello_timeout_ms: default_hello_timeout_ms(),
            max_unauthenticated: default_max_unauthenticated(),
            max_connections_per_edge: default_max_connections_per_edge(),
            max_cameras_per_edge: default_max_cameras_per_edge(),
            control_messages_per_second: default_control_messages_per_second(),
            control_burst: default_control_burst(),
            control_flood_drops: default_control_flood_drops(),
            control_flood_cooldown_ms: default_control_flood_cooldown_ms(),
        }
    }
}

impl LimitsConfig {
    /// The control-message rate each edge connection is held to.
    pub fn control_rate(&self) -> crate::ratelimit::ControlRate {
        crate::ratelimit::ControlRate {
            per_second: self.control_messages_per_second,
            burst: self.control_burst,
            flood: self.control_flood_drops,
        }
    }
}

fn default_control_messages_per_second() -> u32 {
    crate::ratelimit::ControlRate::DEFAULT_PER_SECOND
}
fn default_control_burst() -> u32 {
    crate::ratelimit::ControlRate::DEFAULT_BURST
}
fn default_control_flood_drops() -> u32 {
    crate::ratelimit::ControlRate::DEFAULT_FLOOD
}
fn default_control_flood_cooldown_ms() -> u64 {
    crate::ratelimit::FloodCooldowns::DEFAULT_BASE.as_millis() as u64
}

/// A 4K RGB frame (24.9 MB) twice over; a 720p one (2.8 MB) 24 times.
fn default_edge_inflight_bytes() -> u64 {
    64 * 1024 * 1024
}
/// Eight edges each holding their whole budget.
fn default_inflight_bytes_total() -> u64 {
    512 * 1024 * 1024
}
/// Far above a real-time budget (80 ms to 1 s), far below the QUIC idle
/// timeout (10 s) that would otherwise be a trickling stream's only bound.
fn default_frame_read_timeout_ms() -> u32 {
    2000
}
/// A `Hello` is one round trip after the handshake.
fn default_hello_timeout_ms() -> u32 {
    2000
}
/// Each costs at most a few tens of KiB before login
/// (`tidegate_protocol::quic::BEFORE_LOGIN_RECEIVE_WINDOW` and QUIC's own
/// state); a fleet reconnecting at once beyond this redials with backoff.
fn default_max_unauthenticated() -> usize {
    256
}
/// An edge needs one; a few more cover a redial that overlaps the old
/// connection's idle timeout.
fn default_max_connections_per_edge() -> usize {
    8
}
fn default_max_cameras_per_edge() -> usize {
    crate::server::MAX_CAMERAS_PER_EDGE
}

/// An edge or worker allowed to connect, with its token's SHA-256 digest.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Principal {
    /// Name it says in `Hello`.
    pub name: String,
    /// Hex SHA-256 of its token (`tidegate-gateway hash-token`).
    pub token_sha256: String,
    /// `[[edges]]` only: the edge's share of the gateway's queue and
    /// workers against the other edges' when they compete (1 when unset,
    /// at most [`crate::scheduler::MAX_WEIGHT`]); every connection under its
    /// name shares it.
    #[serde(default)]
    pub weight: Option<u32>,
}

impl Principal {
    /// Its weight (1 when unset).
    pub fn weight(&self) -> u32 {
        self.weight.unwrap_or(1)
    }
}

impl Config {
    /// Edge weights are in `1..=MAX_WEIGHT` and the same for every entry of
    /// a name; workers have none.
    fn validate_weights(&self) -> Result<(), ConfigError> {
        let max = crate::scheduler::MAX_WEIGHT;
        if let Some(w) = self.workers.iter().find(|w| w.weight.is_some()) {
            return Err(ConfigError::Invalid(format!(
                "worker '{}' has a weight; weights share the queue among [[edges]] only",
                w.name
            )));
        }
        let mut seen: std::collections::HashMap<&str, u32> = std::collections::HashMap::new();
        for e in &self.edges {
            let w = e.weight();
            if !(1..=max).contains(&w) {
                return Err(ConfigError::Invalid(format!(
                    "edge '{}' has weight {w}; use 1..={max} (1 is everyone's default)",
                    e.name
                )));
            }
            if let Some(other) = seen.insert(e.name.as_str(), w)
                && other != w
            {
                return Err(ConfigError::Invalid(format!(
                    "edge '{}' is listed with weights {other} and {w}; give every entry of a name the same weight",
                    e.name
                )));
            }
        }
        Ok(())
    }
}

impl std::fmt::Debug for Principal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Principal")
            .field("name", &self.name)
            .field("token_sha256", &"<redacted>")
            .finish()
    }
}

/// Why the configuration is unusable.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not valid TOML for this schema.
    #[error("invalid config {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What the parser said (with line and column).
        message: String,
    },
    /// A value is inconsistent.
    #[error("invalid config: {0}")]
    Invalid(String),
}

impl Config {
    /// Reads a config file. Relative certificate paths are resolved against
    /// the file's directory.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let mut cfg: Config = toml::from_str(&text).map_err(|e| ConfigError::Parse {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        let base = path.parent().unwrap_or(Path::new("."));
        for p in [&mut cfg.quic.cert, &mut cfg.quic.key] {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        }
        if let Some(l) = cfg.leasing.as_mut() {
            let slurm_conf = l.slurm.as_mut().and_then(|s| s.slurm_conf.as_mut());
            let kubeconfig = l.kubernetes.as_mut().and_then(|k| k.kubeconfig.as_mut());
            for p in [
                Some(&mut l.ledger),
                l.catalog.as_mut(),
                slurm_conf,
                kubeconfig,
            ]
            .into_iter()
            .flatten()
            {
                if p.is_relative() {
                    *p = base.join(&*p);
                }
            }
        }
        Ok(cfg)
    }

    /// The defaults (no file).
    pub fn default_config() -> Config {
        toml::from_str("").expect("empty config uses defaults")
    }

    /// Checks values that serde cannot.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if let Some(d) = &self.http.admin_token_sha256
            && !is_sha256_hex(d)
        {
            return Err(ConfigError::Invalid(
                "http.admin_token_sha256 is not a 64-digit hex SHA-256; make one with `tidegate-gateway hash-token <TOKEN>`".into(),
            ));
        }
        if self.http.header_read_timeout_ms < 100 {
            return Err(ConfigError::Invalid(format!(
                "http.header_read_timeout_ms = {} leaves no time to send a request; use at least 100",
                self.http.header_read_timeout_ms
            )));
        }
        if self.http.max_connections == 0 {
            return Err(ConfigError::Invalid(
                "http.max_connections = 0 would refuse every API client; use at least 1".into(),
            ));
        }
        for p in self.edges.iter().chain(&self.workers) {
            if !is_sha256_hex(&p.token_sha256) {
                return Err(ConfigError::Invalid(format!(
                    "token_sha256 of '{}' is not a 64-digit hex SHA-256; make one with `tidegate-gateway hash-token <TOKEN>`",
                    p.name
                )));
            }
        }
        // A name may be listed twice with two tokens (so that a token
        // rotation can overlap), never twice with the same one.
        for (role, list) in [("edge", &self.edges), ("worker", &self.workers)] {
            let mut pairs: Vec<(&str, String)> = list
                .iter()
                .map(|p| (p.name.as_str(), p.token_sha256.to_ascii_lowercase()))
                .collect();
            pairs.sort_unstable();
            if let Some(w) = pairs.windows(2).find(|w| w[0] == w[1]) {
                return Err(ConfigError::Invalid(format!(
                    "{role} '{}' is listed twice with the same token",
                    w[0].0
                )));
            }
        }
        if !(1..=4).contains(&self.scheduler.pipeline_depth) {
            return Err(ConfigError::Invalid(format!(
                "scheduler.pipeline_depth = {} must be 1..=4",
                self.scheduler.pipeline_depth
            )));
        }
        if self.scheduler.stall_timeout_ms < 1000 {
            return Err(ConfigError::Invalid(format!(
                "scheduler.stall_timeout_ms = {} would drop workers over a slow batch; use at least 1000",
                self.scheduler.stall_timeout_ms
            )));
        }
        self.scheduler
            .health
            .validate()
            .map_err(ConfigError::Invalid)?;
        if self.scheduler.hint_window_ms < 100 {
            return Err(ConfigError::Invalid(format!(
                "scheduler.hint_window_ms = {} is too short to measure a rate; use at least 100",
                self.scheduler.hint_window_ms
            )));
        }
        if !(0.0..1.0).contains(&self.scheduler.hint_shed_ratio) {
            return Err(ConfigError::Invalid(format!(
                "scheduler.hint_shed_ratio = {} must be in [0, 1)",
                self.scheduler.hint_shed_ratio
            )));
        }
        if self.scheduler.max_queued == 0 || self.scheduler.max_queued_per_edge == 0 {
            return Err(ConfigError::Invalid(
                "scheduler.max_queued and max_queued_per_edge must be at least 1".into(),
            ));
        }
        if self.scheduler.max_budget_ms == 0 {
            return Err(ConfigError::Invalid(
                "scheduler.max_budget_ms = 0 would make every frame late; use at least 1".into(),
            ));
        }
        self.validate_weights()?;
        self.limits.validate()?;
        self.status.validate()?;
        if let Some(l) = &self.leasing {
            l.validate()?;
        }
        Ok(())
    }
}

impl LimitsConfig {
    /// Checks values that serde cannot: every limit lets something through.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let l = self;
        if l.edge_inflight_bytes == 0 || l.inflight_bytes_total < l.edge_inflight_bytes {
            return Err(ConfigError::Invalid(format!(
                "limits.edge_inflight_bytes = {} must be at least 1 and at most limits.inflight_bytes_total = {}",
                l.edge_inflight_bytes, l.inflight_bytes_total
            )));
        }
        for (key, v) in [
            ("frame_read_timeout_ms", l.frame_read_timeout_ms),
            ("hello_timeout_ms", l.hello_timeout_ms),
        ] {
            if v < 100 {
                return Err(ConfigError::Invalid(format!(
                    "limits.{key} = {v} leaves no time to send over a real link; use at least 100"
                )));
            }
        }
        for (key, v) in [
            ("max_unauthenticated", l.max_unauthenticated),
            ("max_connections_per_edge", l.max_connections_per_edge),
            ("max_cameras_per_edge", l.max_cameras_per_edge),
        ] {
            if v == 0 {
                return Err(ConfigError::Invalid(format!(
                    "limits.{key} = 0 would refuse every edge; use at least 1"
                )));
            }
        }
        for (key, v) in [
            ("control_messages_per_second", l.control_messages_per_second),
            ("control_burst", l.control_burst),
            ("control_flood_drops", l.control_flood_drops),
        ] {
            if v == 0 {
                return Err(ConfigError::Invalid(format!(
                    "limits.{key} = 0 would drop or close every edge's control stream; use at least 1"
                )));
            }
        }
        let most = crate::ratelimit::FloodCooldowns::MAX.as_millis() as u64;
        if l.control_flood_cooldown_ms > most {
            return Err(ConfigError::Invalid(format!(
                "limits.control_flood_cooldown_ms = {} is over the longest cooldown, {most} ms (it doubles up to that with each flood in a row); use at most {most}, or 0 to turn it off",
                l.control_flood_cooldown_ms
            )));
        }
        Ok(())
    }
}

/// Longest of the `[leasing]` durations in seconds (start timeout, down,
/// release and idle windows): a week. Far above any sensible value, and
/// small enough that their milliseconds never overflow.
pub const MAX_LEASING_SECS: u64 = 7 * 86_400;

/// Highest `leasing.spend_cap_per_hour` accepted, in currency units.
pub const MAX_SPEND_CAP_PER_HOUR: f64 = 1e9;

impl LeasingConfig {
    /// The catalog: the configured file, or the built-in one.
    pub fn load_catalog(&self) -> Result<tidegate_lease::Catalog, ConfigError> {
        match &self.catalog {
            Some(p) => tidegate_lease::Catalog::load(p).map_err(|e| {
                ConfigError::Invalid(format!(
                    "leasing.catalog {}: {}",
                    p.display(),
                    crate::simulate::one_line(&e)
                ))
            }),
            None => Ok(tidegate_lease::Catalog::default_catalog()),
        }
    }

    /// The policy.
    pub fn policy_name(&self) -> Result<tidegate_lease::autoscale::PolicyName, ConfigError> {
        self.policy
            .parse()
            .map_err(|e| ConfigError::Invalid(format!("leasing.policy: {e}")))
    }

    /// Checks what serde cannot: the policy, the catalog and every
    /// instance type named, the provider's section, and the numbers. The
    /// first fault found, in the order of the steps below, is the one
    /// reported.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.policy_name()?;
        let catalog = self.load_catalog()?;
        self.validate_numbers()?;
        self.validate_sections_match_provider()?;
        match self.provider {
            ProviderKind::Process => self.validate_process()?,
            ProviderKind::Static => self.validate_static(&catalog)?,
            ProviderKind::Slurm => self.validate_slurm(&catalog)?,
            ProviderKind::Kubernetes => self.validate_kubernetes(&catalog)?,
        }
        self.validate_models(&catalog)?;
        self.validate_release_window(&catalog)
    }

    /// The tick, the spend cap, the timeouts and windows, the headroom.
    fn validate_numbers(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if !(100..=3_600_000).contains(&self.tick_ms) {
            return bad(format!(
                "leasing.tick_ms = {} must be between 100 and 3600000",
                self.tick_ms
            ));
        }
        if let Some(cap) = self.spend_cap_per_hour
            && !(cap.is_finite() && cap > 0.0 && cap <= MAX_SPEND_CAP_PER_HOUR)
        {
            return bad(format!(
                "leasing.spend_cap_per_hour = {cap} must be a positive amount per hour, at most {MAX_SPEND_CAP_PER_HOUR}"
            ));
        }
        for (field, secs) in [
            ("start_timeout_secs", Some(self.start_timeout_secs)),
            ("rejoin_timeout_secs", Some(self.rejoin_timeout_secs)),
            ("down_window_secs", self.down_window_secs),
            ("release_window_secs", self.release_window_secs),
            ("idle_timeout_secs", self.idle_timeout_secs),
        ] {
            if let Some(s) = secs
                && !(1..=MAX_LEASING_SECS).contains(&s)
            {
                return bad(format!(
                    "leasing.{field} = {s} must be between 1 and {MAX_LEASING_SECS} (a week)"
                ));
            }
        }
        if let Some(h) = self.headroom
            && !(0.0..=10.0).contains(&h)
        {
            return bad(format!("leasing.headroom = {h} must be in [0, 10]"));
        }
        Ok(())
    }

    /// No provider section is set but the chosen provider's.
    fn validate_sections_match_provider(&self) -> Result<(), ConfigError> {
        let sections = [
            (
                ProviderKind::Process,
                "[leasing.process]",
                self.process.is_some(),
            ),
            (
                ProviderKind::Static,
                "[[leasing.static_workers]]",
                !self.static_workers.is_empty(),
            ),
            (ProviderKind::Slurm, "[leasing.slurm]", self.slurm.is_some()),
            (
                ProviderKind::Kubernetes,
                "[leasing.kubernetes]",
                self.kubernetes.is_some(),
            ),
        ];
        for (kind, section, present) in sections {
            if present && kind != self.provider {
                let name = match kind {
                    ProviderKind::Process => "process",
                    ProviderKind::Static => "static",
                    ProviderKind::Slurm => "slurm",
                    ProviderKind::Kubernetes => "kubernetes",
                };
                return Err(ConfigError::Invalid(format!(
                    "{section} is only used with provider = \"{name}\""
                )));
            }
        }
        Ok(())
    }

    /// `provider = "process"`: its section, with a command and sane
    /// notice and preemption times.
    fn validate_process(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        let Some(p) = &self.process else {
            return bad(
                "leasing.provider = \"process\" needs a [leasing.process] section with the worker `command`".into(),
            );
        };
        if p.command.trim().is_empty() {
            return bad("leasing.process.command is empty; name the tidegate-worker binary".into());
        }
        use tidegate_lease::provider::{MAX_NOTICE_PERIOD_SECS, checked_secs};
        checked_secs(
            "leasing.process.notice_period_secs",
            p.notice_period_secs,
            MAX_NOTICE_PERIOD_SECS,
        )
        .map_err(ConfigError::Invalid)?;
        if let Some(t) = p.preempt_spot_after_secs {
            checked_secs(
                "leasing.process.preempt_spot_after_secs",
                t,
                MAX_LEASING_SECS as f64,
            )
            .map_err(ConfigError::Invalid)?;
        }
        Ok(())
    }

    /// `provider = "static"`: at least one worker, each of a catalog
    /// type, as the static provider accepts them; not `on_stop = "keep"`.
    fn validate_static(&self, catalog: &tidegate_lease::Catalog) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if self.on_stop == OnStop::Keep {
            return bad("leasing.on_stop = \"keep\" needs workers that the next start adopts (process, slurm or kubernetes); static workers are bound again as they dial in".into());
        }
        if self.static_workers.is_empty() {
            return bad(
                "leasing.provider = \"static\" needs at least one [[leasing.static_workers]]"
                    .into(),
            );
        }
        for w in &self.static_workers {
            if catalog.get(&w.instance_type).is_none() {
                return bad(format!(
                    "static worker '{}': instance type '{}' is not in the catalog",
                    w.name, w.instance_type
                ));
            }
        }
        tidegate_lease::provider::static_workers::StaticProvider::new(
            tidegate_lease::provider::static_workers::StaticConfig {
                workers: self.static_workers.clone(),
            },
        )
        .map_err(|e| ConfigError::Invalid(format!("leasing.static_workers: {e}")))?;
        Ok(())
    }

    /// `provider = "slurm"`: its section, valid, its `gres` types in the
    /// catalog.
    fn validate_slurm(&self, catalog: &tidegate_lease::Catalog) -> Result<(), ConfigError> {
        let Some(s) = &self.slurm else {
            return Err(ConfigError::Invalid(
                "leasing.provider = \"slurm\" needs a [leasing.slurm] section with the worker `command` and [leasing.slurm.partitions]".into(),
            ));
        };
        s.validate()
            .map_err(|e| ConfigError::Invalid(format!("leasing.slurm.{e}")))?;
        if let Some(t) = s.gres.keys().find(|t| catalog.get(t).is_none()) {
            return Err(ConfigError::Invalid(format!(
                "leasing.slurm.gres: instance type '{t}' is not in the catalog"
            )));
        }
        Ok(())
    }

    /// `provider = "kubernetes"`: its section, valid, every instance type
    /// it maps in the catalog.
    fn validate_kubernetes(&self, catalog: &tidegate_lease::Catalog) -> Result<(), ConfigError> {
        let Some(k) = &self.kubernetes else {
            return Err(ConfigError::Invalid(
                "leasing.provider = \"kubernetes\" needs a [leasing.kubernetes] section with the worker `image`".into(),
            ));
        };
        k.validate()
            .map_err(|e| ConfigError::Invalid(format!("leasing.kubernetes.{e}")))?;
        for (field, types) in [
            ("gpus", k.gpus.keys().collect::<Vec<_>>()),
            (
                "instance_node_selectors",
                k.instance_node_selectors.keys().collect(),
            ),
        ] {
            if let Some(t) = types.into_iter().find(|t| catalog.get(t).is_none()) {
                return Err(ConfigError::Invalid(format!(
                    "leasing.kubernetes.{field}: instance type '{t}' is not in the catalog"
                )));
            }
        }
        Ok(())
    }

    /// At least one model, none twice, each with catalog instance types
    /// and sane rates.
    fn validate_models(&self, catalog: &tidegate_lease::Catalog) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if self.models.is_empty() {
            return bad("[leasing] scales nothing: add a [[leasing.models]] with its name, instance_types and worker_fps".into());
        }
        let mut names: Vec<&str> = self.models.iter().map(|m| m.name.as_str()).collect();
        names.sort_unstable();
        if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
            return bad(format!("leasing.models: '{}' is listed twice", w[0]));
        }
        for m in &self.models {
            if m.instance_types.is_empty() {
                return bad(format!(
                    "leasing model '{}' has no instance_types; name at least one catalog type",
                    m.name
                ));
            }
            for t in &m.instance_types {
                if catalog.get(t).is_none() {
                    let known: Vec<&str> =
                        catalog.instances.iter().map(|i| i.name.as_str()).collect();
                    return bad(format!(
                        "leasing model '{}': instance type '{t}' is not in the catalog (known: {})",
                        m.name,
                        known.join(", ")
                    ));
                }
            }
            if !(m.worker_fps.is_finite() && m.worker_fps > 0.0) {
                return bad(format!(
                    "leasing model '{}': worker_fps = {} must be > 0 (frames/s one worker serves)",
                    m.name, m.worker_fps
                ));
            }
            if !(m.min_fps.is_finite() && m.min_fps >= 0.0) {
                return bad(format!(
                    "leasing model '{}': min_fps = {} must be >= 0",
                    m.name, m.min_fps
                ));
            }
        }
        Ok(())
    }

    /// Paid-block-aware releases a surplus lease at a tick within
    /// `release_window_secs` of its paid block's end, and the release takes
    /// [`crate::leasing::RELEASE_LEAD`] to complete. For hourly (prepaid)
    /// blocks some tick must fall in the window early enough: the window
    /// must fit a tick plus the lead, or the policy can miss the block end
    /// and pay for the next one. Per-second billing has no block to miss
    /// past its minimum, so any window above zero works there.
    fn validate_release_window(
        &self,
        catalog: &tidegate_lease::Catalog,
    ) -> Result<(), ConfigError> {
        use tidegate_lease::autoscale::{PolicyConfig, PolicyName};
        use tidegate_lease::billing::Granularity;
        let policy = self.policy_name()?;
        if policy != PolicyName::PaidBlockAware {
            return Ok(());
        }
        let hourly = self
            .models
            .iter()
            .flat_map(|m| &m.instance_types)
            .filter_map(|t| catalog.get(t))
            .find(|i| i.granularity == Granularity::Hour);
        let Some(hourly) = hourly else {
            return Ok(());
        };
        let (window_ms, set) = match self.release_window_secs {
            Some(s) => (s.saturating_mul(1000), "set"),
            None => (PolicyConfig::new(policy).release_window_ms, "the default"),
        };
        let lead_ms = crate::leasing::RELEASE_LEAD.as_millis() as u64;
        let need_ms = self.tick_ms.saturating_add(lead_ms);
        if window_ms < need_ms {
            return Err(ConfigError::Invalid(format!(
                "leasing.release_window_secs = {} ({set}) is shorter than a tick (tick_ms = {}) plus the {} s a release takes: \
                 paid-block-aware could miss the end of a paid hour of '{}' and pay for the next; \
                 set release_window_secs to at least {} or lower tick_ms",
                window_ms / 1000,
                self.tick_ms,
                lead_ms / 1000,
                hourly.name,
                need_ms.div_ceil(1000),
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thumbnails_are_off_by_default_and_bad_rates_sizes_and_keys_are_refused_by_name() {
        let cfg = Config::default_config();
        assert_eq!(cfg.status, StatusConfig::default());
        assert!(!cfg.status.thumbnails && cfg.status.thumbnails().is_none());
        assert_eq!(
            (
                cfg.status.thumbnail_interval_ms,
                cfg.status.thumbnail_max_px
            ),
            (2000, 160)
        );
        let on: Config =
            toml::from_str("[status]\nthumbnails = true\nthumbnail_max_px = 640\n").unwrap();
        on.validate().unwrap();
        let t = on.status.thumbnails().unwrap();
        assert_eq!((t.interval.as_millis(), t.max_px), (2000, 640));
        for (text, key) in [
            ("thumbnail_interval_ms = 249", "thumbnail_interval_ms"),
            ("thumbnail_max_px = 31", "thumbnail_max_px"),
            ("thumbnail_max_px = 641", "thumbnail_max_px"),
        ] {
            let cfg: Config = toml::from_str(&format!("[status]\n{text}\n")).unwrap();
            let e = cfg.validate().unwrap_err().to_string();
            assert!(e.contains(key), "{text}: {e}");
        }
        let e = toml::from_str::<Config>("[status]\nthumbnail = true\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown field `thumbnail`"), "{e}");
    }

    #[test]
    fn limits_default_to_bounded_budgets_and_values_that_let_nothing_through_are_refused() {
        let cfg = Config::default_config();
        assert_eq!(cfg.limits, LimitsConfig::default());
        assert_eq!(cfg.limits.edge_inflight_bytes, 64 * 1024 * 1024);
        assert_eq!(cfg.limits.inflight_bytes_total, 512 * 1024 * 1024);
        assert_eq!(cfg.limits.max_connections_per_edge, 8);
        assert_eq!(cfg.limits.max_cameras_per_edge, 1024);
        cfg.validate().unwrap();
        for (text, key) in [
            ("edge_inflight_bytes = 0", "edge_inflight_bytes"),
            (
                "edge_inflight_bytes = 200\ninflight_bytes_total = 100",
                "inflight_bytes_total",
            ),
            ("frame_read_timeout_ms = 10", "frame_read_timeout_ms"),
            ("hello_timeout_ms = 0", "hello_timeout_ms"),
            ("max_unauthenticated = 0", "max_unauthenticated"),
            ("max_connections_per_edge = 0", "max_connections_per_edge"),
            ("max_cameras_per_edge = 0", "max_cameras_per_edge"),
        ] {
            let cfg: Config = toml::from_str(&format!("[limits]\n{text}\n")).unwrap();
            let e = cfg.validate().unwrap_err().to_string();
            assert!(e.contains(key), "{text}: {e}");
        }
    }

    #[test]
    fn worker_health_settings_parse_under_the_scheduler_and_bad_ones_name_their_key() {
        let cfg: Config = toml::from_str(
            "[scheduler.health]\nwindow = 16\nmax_failure_ratio = 0.25\nprobe_frames = 2\n",
        )
        .unwrap();
        let p = cfg.scheduler.health.policy();
        assert_eq!(
            (p.window, p.min_samples),
            (16, 8),
            "unset keys keep defaults"
        );
        assert_eq!((p.max_failure_permille, p.probe_frames), (250, 2));
        cfg.validate().unwrap();
        let cfg: Config = toml::from_str("[scheduler.health]\nbackoff_ms = 0\n").unwrap();
        let e = cfg.validate().unwrap_err().to_string();
        assert!(e.contains("scheduler.health.backoff_ms"), "{e}");
        assert!(toml::from_str::<Config>("[scheduler.health]\nwindw = 3\n").is_err());
    }

    #[test]
    fn unknown_field_is_rejected_with_its_name() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("g.toml");
        std::fs::write(&p, "[quic]\nlisten = \"127.0.0.1:1\"\nbogus = 1\n").unwrap();
        let err = Config::load(&p).unwrap_err().to_string();
        assert!(err.contains("bogus"), "{err}");
    }

    #[test]
    fn relative_cert_paths_resolve_against_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("g.toml");
        std::fs::write(&p, "[quic]\ncert = \"c/x.pem\"\n").unwrap();
        let cfg = Config::load(&p).unwrap();
        assert_eq!(cfg.quic.cert, dir.path().join("c/x.pem"));
    }

    #[test]
    fn bad_token_digest_is_reported_with_the_fix() {
        let cfg: Config =
            toml::from_str("[[edges]]\nname = \"e\"\ntoken_sha256 = \"abc\"\n").unwrap();
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.contains("hash-token") && err.contains("'e'"), "{err}");
    }

    fn leasing(extra: &str) -> Result<(), ConfigError> {
        let text = format!("[leasing]\nprovider = \"process\"\nledger = \"l.db\"\n{extra}\n");
        let cfg: Config = toml::from_str(&text).map_err(|e| ConfigError::Invalid(e.to_string()))?;
        cfg.validate()
    }

    const PROCESS: &str = "[leasing.process]\ncommand = \"tidegate-worker\"\n";
    const MODEL: &str = "[[leasing.models]]\nname = \"blazeface\"\ninstance_types = [\"cpu-32\"]\nworker_fps = 50\n";

    #[test]
    fn a_name_may_have_two_tokens_but_not_the_same_one_twice() {
        let entry = |kind: &str, token: &str| {
            format!(
                "[[{kind}]]\nname = \"n\"\ntoken_sha256 = \"{}\"\n",
                crate::auth::hash_token(token)
            )
        };
        for kind in ["edges", "workers"] {
            let two: Config = toml::from_str(&(entry(kind, "old") + &entry(kind, "new"))).unwrap();
            two.validate().expect("an overlapping rotation is valid");
            let same: Config = toml::from_str(&(entry(kind, "old") + &entry(kind, "old"))).unwrap();
            let e = same.validate().unwrap_err().to_string();
            assert!(e.contains("'n' is listed twice with the same token"), "{e}");
        }
    }

    #[test]
    fn edge_weights_default_to_one_and_bad_ones_name_the_edge() {
        let entry = |kind: &str, token: &str, weight: &str| {
            format!(
                "[[{kind}]]\nname = \"n\"\ntoken_sha256 = \"{}\"\n{weight}",
                crate::auth::hash_token(token)
            )
        };
        let cfg: Config = toml::from_str(&entry("edges", "t", "")).unwrap();
        cfg.validate().unwrap();
        assert_eq!(cfg.edges[0].weight(), 1);
        assert_eq!(cfg.scheduler.max_budget_ms, 10_000);
        for (toml, want) in [
            (entry("edges", "t", "weight = 0\n"), "edge 'n' has weight 0"),
            (
                entry("workers", "t", "weight = 2\n"),
                "worker 'n' has a weight",
            ),
            (
                entry("edges", "a", "weight = 2\n") + &entry("edges", "b", "weight = 3\n"),
                "edge 'n' is listed with weights 2 and 3",
            ),
            (
                "[scheduler]\nmax_budget_ms = 0\n".to_string(),
                "max_budget_ms = 0",
            ),
        ] {
            let cfg: Config = toml::from_str(&toml).unwrap();
            let e = cfg.validate().unwrap_err().to_string();
            assert!(e.contains(want), "{toml}: {e}");
        }
    }

    #[test]
    fn leasing_is_optional_and_a_full_section_validates() {
        assert!(Config::default_config().leasing.is_none());
        leasing(&format!("policy = \"tidal\"\nspend_cap_per_hour = 20.0\ntick_ms = 500\n{PROCESS}env = {{ A = \"b\" }}\nnotice_period_secs = 1\n{MODEL}")).unwrap();
    }

    #[test]
    fn leasing_errors_name_the_field_and_the_fix() {
        let e = leasing(&format!("policy = \"cheap\"\n{PROCESS}{MODEL}"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("leasing.policy") && e.contains("paid-block-aware"),
            "{e}"
        );
        let e = leasing(MODEL).unwrap_err().to_string();
        assert!(e.contains("[leasing.process]"), "{e}");
        let e = leasing(PROCESS).unwrap_err().to_string();
        assert!(e.contains("[[leasing.models]]"), "{e}");
        let e = leasing(&format!("{PROCESS}{}", MODEL.replace("cpu-32", "tpu")))
            .unwrap_err()
            .to_string();
        assert!(e.contains("'tpu'") && e.contains("h100"), "{e}");
        let e = leasing(&format!("{PROCESS}{}", MODEL.replace("50", "0")))
            .unwrap_err()
            .to_string();
        assert!(e.contains("worker_fps"), "{e}");
        let e = leasing(&format!("spend_cap_per_hour = -1.0\n{PROCESS}{MODEL}"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("spend_cap_per_hour"), "{e}");
        let e = leasing(&format!(
            "catalog = \"/nonexistent/c.toml\"\n{PROCESS}{MODEL}"
        ))
        .unwrap_err()
        .to_string();
        assert!(e.contains("/nonexistent/c.toml"), "{e}");
        let e = leasing(&format!("{PROCESS}{MODEL}{MODEL}"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("twice"), "{e}");
    }

    #[test]
    fn leasing_values_that_would_overflow_or_panic_are_refused_naming_the_field() {
        for (extra, field) in [
            ("notice_period_secs = 1e20\n", "notice_period_secs"),
            ("notice_period_secs = -1\n", "notice_period_secs"),
            ("notice_period_secs = inf\n", "notice_period_secs"),
            (
                "preempt_spot_after_secs = 1e300\n",
                "preempt_spot_after_secs",
            ),
        ] {
            let e = leasing(&format!("{PROCESS}{extra}{MODEL}"))
                .unwrap_err()
                .to_string();
            assert!(e.contains(&format!("leasing.process.{field}")), "{e}");
        }
        for (extra, field) in [
            (
                "release_window_secs = 18446744073709551615",
                "release_window_secs",
            ),
            ("release_window_secs = 0", "release_window_secs"),
            (
                "down_window_secs = 18446744073709551615",
                "down_window_secs",
            ),
            ("idle_timeout_secs = 0", "idle_timeout_secs"),
            (
                "start_timeout_secs = 18446744073709551615",
                "start_timeout_secs",
            ),
            ("rejoin_timeout_secs = 0", "rejoin_timeout_secs"),
            ("spend_cap_per_hour = 1e300", "spend_cap_per_hour"),
        ] {
            let e = leasing(&format!("{extra}\n{PROCESS}{MODEL}"))
                .unwrap_err()
                .to_string();
            assert!(e.contains(&format!("leasing.{field}")), "{extra}: {e}");
        }
    }

    #[test]
    fn a_release_window_must_fit_a_tick_and_a_release_for_hourly_blocks() {
        let hourly = MODEL.replace("cpu-32", "h100");
        // the default window (180 s) with a tick of an hour: refused
        let e = leasing(&format!("tick_ms = 3600000\n{PROCESS}{hourly}"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("leasing.release_window_secs = 180 (the default)")
                && e.contains("'h100'")
                && e.contains("at least 3603"),
            "{e}"
        );
        // a window of 3 s with a 500 ms tick: a release takes 3 s
        let e = leasing(&format!(
            "tick_ms = 500\nrelease_window_secs = 3\n{PROCESS}{hourly}"
        ))
        .unwrap_err()
        .to_string();
        assert!(e.contains("at least 4"), "{e}");
        leasing(&format!(
            "tick_ms = 500\nrelease_window_secs = 4\n{PROCESS}{hourly}"
        ))
        .unwrap();
        // per-second billing (cpu-32) past its minimum has no block to
        // miss, and the other policies do not use the window
        leasing(&format!(
            "tick_ms = 500\nrelease_window_secs = 1\n{PROCESS}{MODEL}"
        ))
        .unwrap();
        leasing(&format!(
            "policy = \"tidal\"\ntick_ms = 3600000\n{PROCESS}{hourly}"
        ))
        .unwrap();
    }

    const SLURM: &str = "[leasing.slurm]\ncommand = \"tidegate-worker\"\nslurm_conf = \"slurm.conf\"\npartitions = { on_demand = \"gpu\", spot = \"spot\" }\ngres = { h100 = \"gpu:h100:1\" }\n";

    #[test]
    fn a_slurm_section_validates_and_its_errors_name_the_field() {
        let slurm = |extra: &str| -> Result<(), ConfigError> {
            let text =
                format!("[leasing]\nprovider = \"slurm\"\nledger = \"l.db\"\n{MODEL}{extra}\n");
            let cfg: Config =
                toml::from_str(&text).map_err(|e| ConfigError::Invalid(e.to_string()))?;
            cfg.validate()
        };
        slurm(SLURM).unwrap();
        let e = slurm("").unwrap_err().to_string();
        assert!(
            e.contains("[leasing.slurm]") && e.contains("partitions"),
            "{e}"
        );
        let e = slurm(&SLURM.replace("h100 =", "tpu ="))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("leasing.slurm.gres") && e.contains("'tpu'"),
            "{e}"
        );
        let e = slurm(&SLURM.replace("spot = \"spot\"", "spot = \"a b\""))
            .unwrap_err()
            .to_string();
        assert!(e.contains("leasing.slurm.partitions.spot"), "{e}");
        let e = slurm(&format!("{SLURM}{PROCESS}")).unwrap_err().to_string();
        assert!(
            e.contains("[leasing.process] is only used with provider = \"process\""),
            "{e}"
        );
        let e = slurm(&SLURM.replace("partitions", "partition"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("partition"), "{e}");
    }

    const KUBERNETES: &str = "[leasing.kubernetes]\nimage = \"w:1\"\nkubeconfig = \"kube/config\"\ngpus = { h100 = 1 }\n[leasing.kubernetes.tiers.on_demand]\n[leasing.kubernetes.tiers.spot]\nnode_selector = { \"cloud.google.com/gke-spot\" = \"true\" }\n";

    #[test]
    fn a_kubernetes_section_validates_and_its_errors_name_the_field() {
        let kube = |extra: &str| -> Result<Config, ConfigError> {
            let text = format!(
                "[leasing]\nprovider = \"kubernetes\"\nledger = \"l.db\"\n{MODEL}{extra}\n"
            );
            let cfg: Config =
                toml::from_str(&text).map_err(|e| ConfigError::Invalid(e.to_string()))?;
            cfg.validate().map(|()| cfg)
        };
        let cfg = kube(KUBERNETES).unwrap();
        let k = cfg.leasing.unwrap().kubernetes.unwrap();
        assert!(k.tiers.spot.is_some() && k.tiers.on_demand.is_some());
        let e = kube("").unwrap_err().to_string();
        assert!(
            e.contains("[leasing.kubernetes]") && e.contains("image"),
            "{e}"
        );
        let e = kube(&KUBERNETES.replace("h100 =", "tpu ="))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("leasing.kubernetes.gpus") && e.contains("'tpu'"),
            "{e}"
        );
        let e = kube(&KUBERNETES.replace("\"true\"", "\"a b\""))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("leasing.kubernetes.tiers.spot.node_selector"),
            "{e}"
        );
        let e = kube(&format!("{KUBERNETES}{SLURM}"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("[leasing.slurm] is only used with provider = \"slurm\""),
            "{e}"
        );
        let e = kube(&KUBERNETES.replace("image", "images"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("images"), "{e}");
    }

    #[test]
    fn on_stop_keep_is_for_providers_whose_workers_are_adopted() {
        let parse = |provider: &str, section: &str, on_stop: &str| -> Result<Config, ConfigError> {
            let text = format!(
                "[leasing]\nprovider = \"{provider}\"\nledger = \"l.db\"\n{on_stop}{MODEL}{section}\n"
            );
            let cfg: Config =
                toml::from_str(&text).map_err(|e| ConfigError::Invalid(e.to_string()))?;
            cfg.validate().map(|()| cfg)
        };
        let cfg = parse("kubernetes", KUBERNETES, "").unwrap();
        assert_eq!(cfg.leasing.unwrap().on_stop, OnStop::Release);
        for (provider, section) in [
            ("kubernetes", KUBERNETES),
            ("slurm", SLURM),
            ("process", PROCESS),
        ] {
            let cfg = parse(provider, section, "on_stop = \"keep\"\n").unwrap();
            assert_eq!(cfg.leasing.unwrap().on_stop, OnStop::Keep, "{provider}");
        }
        let statics = format!(
            "[[leasing.static_workers]]\nname = \"w\"\ninstance_type = \"h100\"\ntier = \"on_demand\"\ntoken_sha256 = \"{}\"\n",
            "a".repeat(64)
        );
        parse("static", &statics, "").unwrap();
        let e = parse("static", &statics, "on_stop = \"keep\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("on_stop") && e.contains("static"), "{e}");
        let e = parse("process", PROCESS, "on_stop = \"hold\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("hold"), "{e}");
    }

    #[test]
    fn leasing_paths_resolve_against_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("g.toml");
        std::fs::write(
            &p,
            format!("[leasing]\nprovider = \"process\"\nledger = \"data/l.db\"\n{PROCESS}{MODEL}"),
        )
        .unwrap();
        let cfg = Config::load(&p).unwrap();
        let l = cfg.leasing.unwrap();
        assert_eq!(l.ledger, dir.path().join("data/l.db"));
        assert_eq!(l.process.unwrap().notice_period_secs, 120.0);
        std::fs::write(
            &p,
            format!("[leasing]\nprovider = \"slurm\"\nledger = \"l.db\"\n{SLURM}{MODEL}"),
        )
        .unwrap();
        let l = Config::load(&p).unwrap().leasing.unwrap();
        assert_eq!(
            l.slurm.unwrap().slurm_conf,
            Some(dir.path().join("slurm.conf"))
        );
        std::fs::write(
            &p,
            format!("[leasing]\nprovider = \"kubernetes\"\nledger = \"l.db\"\n{KUBERNETES}{MODEL}"),
        )
        .unwrap();
        let l = Config::load(&p).unwrap().leasing.unwrap();
        assert_eq!(
            l.kubernetes.unwrap().kubeconfig,
            Some(dir.path().join("kube/config"))
        );
    }

    #[test]
    fn debug_output_redacts_token_digests() {
        let cfg: Config = toml::from_str(&format!(
            "[[edges]]\nname = \"e\"\ntoken_sha256 = \"{}\"\n",
            "a".repeat(64)
        ))
        .unwrap();
        assert!(!format!("{cfg:?}").contains(&"a".repeat(64)));
        let cfg: Config = toml::from_str(&format!(
            "[http]\nadmin_token_sha256 = \"{}\"\n",
            "b".repeat(64)
        ))
        .unwrap();
        cfg.validate().unwrap();
        assert!(!format!("{cfg:?}").contains(&"b".repeat(64)));
        let bad: Config = toml::from_str("[http]\nadmin_token_sha256 = \"s3cret\"\n").unwrap();
        let e = bad.validate().unwrap_err().to_string();
        assert!(
            e.contains("http.admin_token_sha256") && e.contains("hash-token"),
            "{e}"
        );
    }

    #[test]
    fn hostile_client_bounds_default_to_documented_values_and_zero_is_refused_by_name() {
        let cfg = Config::default_config();
        let http = cfg.http.limits();
        assert_eq!(http.header_read_timeout, std::time::Duration::from_secs(10));
        assert_eq!(http.max_connections, 256);
        assert_eq!(
            cfg.limits.control_rate(),
            crate::ratelimit::ControlRate::default()
        );
        let cfg: Config = toml::from_str(
            "[http]\nheader_read_timeout_ms = 500\nmax_connections = 4\n[limits]\ncontrol_messages_per_second = 10\ncontrol_burst = 20\ncontrol_flood_drops = 30\n",
        )
        .unwrap();
        cfg.validate().unwrap();
        assert_eq!(cfg.http.limits().max_connections, 4);
        assert_eq!(
            cfg.limits.control_rate(),
            crate::ratelimit::ControlRate {
                per_second: 10,
                burst: 20,
                flood: 30
            }
        );
        for (text, key) in [
            (
                "[http]\nheader_read_timeout_ms = 10",
                "http.header_read_timeout_ms",
            ),
            ("[http]\nmax_connections = 0", "http.max_connections"),
            (
                "[limits]\ncontrol_messages_per_second = 0",
                "limits.control_messages_per_second",
            ),
            ("[limits]\ncontrol_burst = 0", "limits.control_burst"),
            (
                "[limits]\ncontrol_flood_drops = 0",
                "limits.control_flood_drops",
            ),
            (
                "[limits]\ncontrol_flood_cooldown_ms = 60001",
                "limits.control_flood_cooldown_ms",
            ),
        ] {
            let cfg: Config = toml::from_str(&format!("{text}\n")).unwrap();
            let e = cfg.validate().unwrap_err().to_string();
            assert!(e.contains(key), "{text}: {e}");
        }
    }
}
