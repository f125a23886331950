//! The MQTT sink: one JSON event per result, published to a broker on a
//! topic made from a template (`tidegate/{edge}/{camera}/detections`), with
//! the edge's and each camera's availability retained beside them, as
//! Frigate and DeepStream users wire detections into a site (Home
//! Assistant, Node-RED).
//!
//! - **Availability:** the edge's status topic (`tidegate/{edge}/status`)
//!   holds a retained `online` while the edge is connected and `offline`
//!   once it stops, and the broker publishes `offline` there itself when
//!   the connection dies (MQTT's last will). Each camera's availability
//!   topic holds a retained `online` from its first result on each
//!   connection, and `offline` once the edge stops.
//! - **Bounded:** results wait in a queue bounded by count and by bytes
//!   ([`MqttLimits`]); when either bound would be passed, a new result is
//!   dropped and counted (`dropped_full`), never blocking the edge.
//! - **Delivered or counted, never silently lost:** a result is
//!   `published` once the broker acknowledged it (QoS 1: its `PUBACK`) or
//!   once it was written to the connection (QoS 0, at most once by
//!   definition). The [`Ledger`] keeps every result until then, in order.
//!   When the connection drops the client reconnects with backoff, and
//!   what the broker had not acknowledged is sent again: by the client
//!   itself when the broker kept the session, by the ledger when it did
//!   not (a broker restart without persistence). At QoS 1 a result may so
//!   arrive twice, never not at all. When the sink closes it waits a
//!   bounded time for the rest; what is still unacknowledged then is
//!   `dropped_shutdown`. `pushed = published + dropped_full +
//!   dropped_shutdown` once closed.
//!
//! The client is rumqttc (MQTT 3.1.1) over TCP, or TLS with rustls and ring
//! (`mqtts://`, trusting `ca` or the system's roots), with a user name from
//! the config and the password from `TIDEGATE_MQTT_PASSWORD`.

use std::collections::{BTreeSet, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use rumqttc::{AsyncClient, Event, EventLoop, LastWill, MqttOptions, Outgoing, Packet, QoS};
use serde::Deserialize;
use tokio::sync::{mpsc, oneshot};
use tracing::{Instrument, debug, info, info_span, warn};

/// The environment variable holding the broker password, if any.
pub const PASSWORD_ENV: &str = "TIDEGATE_MQTT_PASSWORD";
/// Messages handed to the client at once: the client's in-flight window.
const WINDOW: usize = 64;
/// Least and most wait between two connection attempts.
const RECONNECT_BASE: Duration = Duration::from_millis(200);
/// See [`RECONNECT_BASE`].
const RECONNECT_MAX: Duration = Duration::from_secs(5);
/// The least time between two warnings about a failed connection.
const WARN_EVERY: Duration = Duration::from_secs(10);

/// `[sinks.mqtt]`: where and how results are published.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MqttConfig {
    /// `mqtt://host[:port]` (1883 by default) or `mqtts://host[:port]`
    /// (8883).
    pub url: String,
    /// Topic of each result's event; `{edge}` and `{camera}` are replaced
    /// by the edge's and the camera's names.
    #[serde(default = "default_topic")]
    pub topic: String,
    /// Topic of each camera's retained availability (`online`, `offline`).
    #[serde(default = "default_availability_topic")]
    pub availability_topic: String,
    /// Topic of the edge's retained status (`online`, `offline`), and of its
    /// last will.
    #[serde(default = "default_status_topic")]
    pub status_topic: String,
    /// 0 (at most once) or 1 (at least once).
    #[serde(default = "default_qos")]
    pub qos: u8,
    /// For `mqtts://`: the PEM CA certificate(s) to trust instead of the
    /// system's roots (relative paths resolve against the config file).
    #[serde(default)]
    pub ca: Option<PathBuf>,
    /// User name; the password is read from `TIDEGATE_MQTT_PASSWORD`.
    #[serde(default)]
    pub username: Option<String>,
    /// The MQTT client id; `{edge}` is replaced. Unique per broker.
    #[serde(default = "default_client_id")]
    pub client_id: String,
    /// Results waiting at most (at least 1).
    #[serde(default = "default_queue")]
    pub queue: usize,
    /// Bytes of results waiting at most (at least 1 KiB).
    #[serde(default = "default_queue_bytes")]
    pub queue_bytes: usize,
    /// Keep-alive interval (s, at least 5): a dead broker is noticed within
    /// about one and a half of it.
    #[serde(default = "default_keep_alive_s")]
    pub keep_alive_s: u64,
}

fn default_topic() -> String {
    "tidegate/{edge}/{camera}/detections".into()
}
fn default_availability_topic() -> String {
    "tidegate/{edge}/{camera}/availability".into()
}
fn default_status_topic() -> String {
    "tidegate/{edge}/status".into()
}
fn default_qos() -> u8 {
    1
}
fn default_client_id() -> String {
    "tidegate-{edge}".into()
}
fn default_queue() -> usize {
    1024
}
fn default_queue_bytes() -> usize {
    16 << 20
}
fn default_keep_alive_s() -> u64 {
    15
}

/// Why an MQTT sink cannot be set up.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MqttError {
    /// Not an `mqtt://` or `mqtts://` URL with a host and a numeric port.
    #[error("sinks.mqtt.url '{url}': {why}; write it as mqtt://host:1883 or mqtts://host:8883")]
    Url {
        /// The URL as configured.
        url: String,
        /// What is wrong with it.
        why: String,
    },
    /// A topic template that cannot make valid topics.
    #[error("sinks.mqtt.{field} '{template}': {why}")]
    Topic {
        /// Which template.
        field: &'static str,
        /// The template as configured.
        template: String,
        /// What is wrong with it.
        why: String,
    },
    /// A QoS other than 0 and 1.
    #[error(
        "sinks.mqtt.qos = {0}: use 0 (at most once) or 1 (at least once); QoS 2 is not supported"
    )]
    Qos(u8),
    /// A queue bound below its least.
    #[error("sinks.mqtt.{field} = {value} is below its least, {least}")]
    Bound {
        /// Which bound.
        field: &'static str,
        /// The value configured.
        value: u64,
        /// The least accepted.
        least: u64,
    },
    /// The TLS client for `mqtts://` cannot be set up.
    #[error("sinks.mqtt TLS: {0}")]
    Tls(String),
    /// A CA file for a plain `mqtt://` broker, which would not use it.
    #[error("sinks.mqtt.ca is set but the url is mqtt://; use mqtts:// or remove ca")]
    CaWithoutTls,
}

/// A broker address from [`MqttConfig::url`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Broker {
    /// Host name or address.
    pub host: String,
    /// TCP port.
    pub port: u16,
    /// `mqtts://`.
    pub tls: bool,
}

impl Broker {
    /// Parses `mqtt[s]://host[:port]` (an IPv6 address in brackets).
    pub fn parse(url: &str) -> Result<Self, MqttError> {
        let bad = |why: &str| MqttError::Url {
            url: url.into(),
            why: why.into(),
        };
        let (rest, tls) = match (url.strip_prefix("mqtt://"), url.strip_prefix("mqtts://")) {
            (Some(r), _) => (r, false),
            (_, Some(r)) => (r, true),
            _ => return Err(bad("not an mqtt:// or mqtts:// URL")),
        };
        let rest = rest.strip_suffix('/').unwrap_or(rest);
        if rest.contains('/') {
            return Err(bad("a broker URL has no path"));
        }
        let default_port = if tls { 8883 } else { 1883 };
        let (host, port) = if let Some(v6) = rest.strip_prefix('[') {
            let (host, after) = v6.split_once(']').ok_or_else(|| bad("unclosed '['"))?;
            let port = match after.strip_prefix(':') {
                Some(p) => p.parse().map_err(|_| bad("the port is not a number"))?,
                None if after.is_empty() => default_port,
                None => return Err(bad("text after the IPv6 address")),
            };
            (host.to_string(), port)
        } else {
            match rest.rsplit_once(':') {
                Some((h, p)) => (
                    h.to_string(),
                    p.parse().map_err(|_| bad("the port is not a number"))?,
                ),
                None => (rest.to_string(), default_port),
            }
        };
        if host.is_empty() {
            return Err(bad("no host"));
        }
        if port == 0 {
            return Err(bad("port 0"));
        }
        Ok(Broker { host, port, tls })
    }
}

/// A topic template: text with `{edge}` and `{camera}` in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicTemplate(String);

impl TopicTemplate {
    /// Checks `template` (configured as `field`): not empty, no MQTT
    /// wildcards, no `$` at the start (broker topics), and no placeholder
    /// other than `{edge}` and `{camera}`; `needs_camera` asks for
    /// `{camera}`, so that cameras do not share a topic.
    pub fn parse(
        field: &'static str,
        template: &str,
        needs_camera: bool,
    ) -> Result<Self, MqttError> {
        let bad = |why: &str| MqttError::Topic {
            field,
            template: template.into(),
            why: why.into(),
        };
        if template.is_empty() {
            return Err(bad("empty"));
        }
        if template.contains(['+', '#']) {
            return Err(bad(
                "'+' and '#' are subscription wildcards, not topic characters",
            ));
        }
        if template.starts_with('$') {
            return Err(bad("topics starting with '$' are the broker's"));
        }
        let stripped = template.replace("{edge}", "").replace("{camera}", "");
        if stripped.contains(['{', '}']) {
            return Err(bad("the only placeholders are {edge} and {camera}"));
        }
        if needs_camera && !template.contains("{camera}") {
            return Err(bad(
                "needs {camera}, or every camera would publish on one topic",
            ));
        }
        Ok(TopicTemplate(template.into()))
    }

    /// The topic for `edge` and `camera`. A name's `/`, `+`, `#` and
    /// control characters become `_`: a camera named `door/1` must not
    /// open a level of its own, nor a wildcard.
    pub fn topic(&self, edge: &str, camera: &str) -> String {
        let clean = |s: &str| {
            s.chars()
                .map(|c| {
                    if matches!(c, '/' | '+' | '#') || c.is_control() {
                        '_'
                    } else {
                        c
                    }
                })
                .collect::<String>()
        };
        self.0
            .replace("{edge}", &clean(edge))
            .replace("{camera}", &clean(camera))
    }
}

/// What the sink holds at most before it drops new results.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MqttLimits {
    /// Results held (at least 1).
    pub results: usize,
    /// Bytes of results held (at least 1 KiB).
    pub bytes: usize,
}

/// Everything the sink needs, checked.
#[derive(Debug, Clone)]
pub struct MqttSettings {
    /// The broker.
    pub broker: Broker,
    /// The edge's name.
    pub edge: String,
    /// Result topics.
    pub topic: TopicTemplate,
    /// Camera availability topics.
    pub availability: TopicTemplate,
    /// The edge's status topic.
    pub status: String,
    /// Delivery guarantee.
    pub qos: QoS,
    /// Client id.
    pub client_id: String,
    /// User name and password.
    pub credentials: Option<(String, String)>,
    /// TLS, for `mqtts://`.
    pub tls: Option<Arc<tokio_rustls::rustls::ClientConfig>>,
    /// Queue bounds.
    pub limits: MqttLimits,
    /// Keep-alive.
    pub keep_alive: Duration,
}

impl MqttSettings {
    /// Checks `config` for the edge `edge`; `password` is the value of
    /// [`PASSWORD_ENV`], if set. Reads the CA file of an `mqtts://` broker.
    pub fn new(
        config: &MqttConfig,
        edge: &str,
        password: Option<String>,
    ) -> Result<Self, MqttError> {
        let broker = Broker::parse(&config.url)?;
        let qos = match config.qos {
            0 => QoS::AtMostOnce,
            1 => QoS::AtLeastOnce,
            n => return Err(MqttError::Qos(n)),
        };
        let least = |field, value: usize, least: usize| {
            if value < least {
                Err(MqttError::Bound {
                    field,
                    value: value as u64,
                    least: least as u64,
                })
            } else {
                Ok(())
            }
        };
        least("queue", config.queue, 1)?;
        least("queue_bytes", config.queue_bytes, 1024)?;
        least("keep_alive_s", config.keep_alive_s as usize, 5)?;
        let status = TopicTemplate::parse("status_topic", &config.status_topic, false)?;
        let tls = match (broker.tls, &config.ca) {
            (true, ca) => Some(Arc::new(
                super::tls::client_config(ca.as_deref()).map_err(MqttError::Tls)?,
            )),
            (false, Some(_)) => return Err(MqttError::CaWithoutTls),
            (false, None) => None,
        };
        Ok(MqttSettings {
            broker,
            edge: edge.into(),
            topic: TopicTemplate::parse("topic", &config.topic, true)?,
            availability: TopicTemplate::parse(
                "availability_topic",
                &config.availability_topic,
                true,
            )?,
            status: status.topic(edge, ""),
            qos,
            client_id: config.client_id.replace("{edge}", edge),
            credentials: config
                .username
                .clone()
                .map(|u| (u, password.unwrap_or_default())),
            tls,
            limits: MqttLimits {
                results: config.queue,
                bytes: config.queue_bytes,
            },
            keep_alive: Duration::from_secs(config.keep_alive_s),
        })
    }

    fn options(&self) -> MqttOptions {
        let mut o = MqttOptions::new(&self.client_id, &self.broker.host, self.broker.port);
        o.set_keep_alive(self.keep_alive);
        // A new session on every connection: what the broker had not
        // acknowledged is sent again by the ledger.
        o.set_clean_session(true);
        o.set_inflight(WINDOW as u16);
        o.set_last_will(LastWill::new(
            &self.status,
            "offline",
            QoS::AtLeastOnce,
            true,
        ));
        if let Some((user, password)) = &self.credentials {
            o.set_credentials(user, password);
        }
        if let Some(tls) = &self.tls {
            o.set_transport(rumqttc::Transport::tls_with_config(
                rumqttc::TlsConfiguration::Rustls(tls.clone()),
            ));
        }
        o
    }
}

/// Where a message is on its way to the broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Not yet handed to the client.
    Waiting,
    /// Handed to the client (the n-th handing), not yet written to the
    /// connection.
    Handed(u64),
    /// Written with this packet id, waiting for its `PUBACK`.
    Sent(u16),
}

/// One message the ledger holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// Its topic.
    pub topic: String,
    /// Its payload.
    pub payload: Vec<u8>,
    /// Whether the broker keeps it as the topic's last value.
    pub retain: bool,
    /// A result (counted in the sink's statistics), not an availability
    /// message.
    pub result: bool,
    state: State,
}

impl Message {
    /// A message not yet handed to the client.
    pub fn new(topic: String, payload: Vec<u8>, retain: bool, result: bool) -> Self {
        Message {
            topic,
            payload,
            retain,
            result,
            state: State::Waiting,
        }
    }
}

/// What became of messages, as the [`Ledger`] tells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Settled {
    /// Results published (acknowledged, or written at QoS 0).
    pub results: u64,
    /// Bytes of those results.
    pub bytes: u64,
}

/// The sink's bookkeeping, without IO: every message not yet published, in
/// the order it was pushed, and where it is. The shell feeds it the
/// client's events; it says what to hand to the client next. See the module
/// docs for the guarantees it keeps.
#[derive(Debug)]
pub struct Ledger {
    qos: QoS,
    messages: VecDeque<Message>,
    connected: bool,
    /// Messages handed again after a connection that lost them.
    resent: u64,
    /// The number of the next handing.
    handings: u64,
}

impl Ledger {
    /// An empty ledger for messages published at `qos`.
    pub fn new(qos: QoS) -> Self {
        Ledger {
            qos,
            messages: VecDeque::new(),
            connected: false,
            resent: 0,
            handings: 0,
        }
    }

    /// Adds a message; it goes after every one already held.
    pub fn push(&mut self, m: Message) {
        self.messages.push_back(Message {
            state: State::Waiting,
            ..m
        });
    }

    /// Adds a message ahead of every one waiting (the edge's `online`
    /// after a connection).
    pub fn push_first(&mut self, m: Message) {
        self.messages.push_front(Message {
            state: State::Waiting,
            ..m
        });
    }

    /// Messages held.
    pub fn len(&self) -> usize {
        self.messages.len()
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.messages.is_empty()
    }

    /// Results held (not availability messages).
    pub fn results_held(&self) -> usize {
        self.messages.iter().filter(|m| m.result).count()
    }

    /// Messages handed again after a connection lost them.
    pub fn resent(&self) -> u64 {
        self.resent
    }

    /// The next message to hand to the client, marked handed: the first
    /// waiting one, while connected and fewer than `window` are with the
    /// client. `None` otherwise.
    pub fn next_to_hand(&mut self, window: usize) -> Option<&Message> {
        if !self.connected {
            return None;
        }
        let with_client = self
            .messages
            .iter()
            .filter(|m| m.state != State::Waiting)
            .count();
        if with_client >= window {
            return None;
        }
        let m = self
            .messages
            .iter_mut()
            .find(|m| m.state == State::Waiting)?;
        m.state = State::Handed(self.handings);
        self.handings += 1;
        Some(m)
    }

    /// Index of the handed message with the least (`first`) or the
    /// greatest handing number.
    fn handed(&self, first: bool) -> Option<usize> {
        let handed = self
            .messages
            .iter()
            .enumerate()
            .filter_map(|(i, m)| match m.state {
                State::Handed(n) => Some((n, i)),
                _ => None,
            });
        let pick = if first { handed.min() } else { handed.max() };
        pick.map(|(_, i)| i)
    }

    /// The client could not take the message just handed: it waits again.
    pub fn unhand_last(&mut self) {
        if let Some(i) = self.handed(false) {
            self.messages[i].state = State::Waiting;
        }
    }

    /// The client wrote a `PUBLISH` with packet id `pkid` (0 at QoS 0). The
    /// client writes what it is handed in the order it was handed, so this
    /// is the message handed first of those not yet written; a packet id
    /// already sent is a retransmission.
    /// Returns what it published (QoS 0: the message is done once
    /// written).
    pub fn on_written(&mut self, pkid: u16) -> Settled {
        if self.qos != QoS::AtMostOnce && self.messages.iter().any(|m| m.state == State::Sent(pkid))
        {
            return Settled::default();
        }
        let Some(i) = self.handed(true) else {
            return Settled::default();
        };
        if self.qos == QoS::AtMostOnce {
            let m = self.messages.remove(i).expect("found above");
            return settled(&m);
        }
        self.messages[i].state = State::Sent(pkid);
        Settled::default()
    }

    /// The broker acknowledged packet `pkid`. Returns what it published.
    pub fn on_acked(&mut self, pkid: u16) -> Settled {
        match self
            .messages
            .iter()
            .position(|m| m.state == State::Sent(pkid))
        {
            Some(i) => {
                let m = self.messages.remove(i).expect("found above");
                settled(&m)
            }
            None => Settled::default(),
        }
    }

    /// The client connected; `session_present` is the broker's word that it
    /// kept the last session. Without it the client has dropped what it
    /// had not delivered, so every message handed or sent and not
    /// acknowledged waits to be handed again, in its order.
    pub fn on_connected(&mut self, session_present: bool) {
        self.connected = true;
        if session_present {
            return;
        }
        for m in &mut self.messages {
            if m.state != State::Waiting {
                m.state = State::Waiting;
                self.resent += 1;
            }
        }
    }

    /// The connection dropped: nothing is handed until it is back.
    pub fn on_disconnected(&mut self) {
        self.connected = false;
    }

    /// Empties the ledger: returns the results and bytes it still held.
    pub fn drain(&mut self) -> Settled {
        let mut left = Settled::default();
        for m in self.messages.drain(..) {
            let s = settled(&m);
            left.results += s.results;
            left.bytes += s.bytes;
        }
        left
    }
}

fn settled(m: &Message) -> Settled {
    if m.result {
        Settled {
            results: 1,
            bytes: m.payload.len() as u64,
        }
    } else {
        Settled::default()
    }
}

/// The sink's counters.
#[derive(Debug, Default)]
pub struct MqttStats {
    /// Results handed to the sink.
    pub pushed: AtomicU64,
    /// Results published.
    pub published: AtomicU64,
    /// Results dropped because the queue was full.
    pub dropped_full: AtomicU64,
    /// Results still unpublished when the sink closed.
    pub dropped_shutdown: AtomicU64,
    /// Connections made to the broker.
    pub connections: AtomicU64,
    /// Messages sent again after a connection lost them.
    pub resent: AtomicU64,
    /// Results held now (queued or with the client).
    pub held: AtomicU64,
    /// Bytes of results held now.
    pub held_bytes: AtomicU64,
}

impl MqttStats {
    fn release(&self, s: Settled) {
        self.held.fetch_sub(s.results, Ordering::Relaxed);
        self.held_bytes.fetch_sub(s.bytes, Ordering::Relaxed);
    }
}

/// A request from the edge to the sink's task.
#[derive(Debug)]
enum Request {
    Result { camera: String, json: String },
}

/// The running sink. Cheap to push to from any thread.
#[derive(Debug)]
pub struct Mqtt {
    tx: mpsc::UnboundedSender<Request>,
    stats: Arc<MqttStats>,
    limits: MqttLimits,
    stop: Option<oneshot::Sender<Duration>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Mqtt {
    /// Starts the sink's task on the current runtime; it connects (and
    /// reconnects) by itself.
    pub fn spawn(settings: MqttSettings) -> Self {
        let stats = Arc::new(MqttStats::default());
        let (tx, rx) = mpsc::unbounded_channel();
        let (stop_tx, stop_rx) = oneshot::channel();
        let limits = settings.limits;
        let span = info_span!("mqtt", broker = %format!("{}:{}", settings.broker.host, settings.broker.port));
        let task = tokio::spawn(run(settings, rx, stop_rx, stats.clone()).instrument(span));
        Mqtt {
            tx,
            stats,
            limits,
            stop: Some(stop_tx),
            task: Some(task),
        }
    }

    /// Queues the event of one result of `camera` (its JSON line). Never
    /// blocks: past the queue's bounds the result is dropped and counted.
    pub fn push(&self, camera: &str, json: String) {
        let s = &self.stats;
        s.pushed.fetch_add(1, Ordering::Relaxed);
        let len = json.len() as u64;
        let limits = self.limits;
        let fits = s
            .held
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |h| {
                (h < limits.results as u64).then_some(h + 1)
            })
            .is_ok();
        if !fits {
            s.dropped_full.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let fits = s
            .held_bytes
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |h| {
                h.checked_add(len).filter(|&b| b <= limits.bytes as u64)
            })
            .is_ok();
        if !fits {
            s.held.fetch_sub(1, Ordering::Relaxed);
            s.dropped_full.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let request = Request::Result {
            camera: camera.to_string(),
            json,
        };
        if self.tx.send(request).is_err() {
            s.release(Settled {
                results: 1,
                bytes: len,
            });
            s.dropped_shutdown.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The sink's counters.
    pub fn stats(&self) -> &Arc<MqttStats> {
        &self.stats
    }

    /// Publishes the cameras' and the edge's `offline`, waits up to
    /// `timeout` for what is held to be published, then disconnects; what
    /// is still held is counted as `dropped_shutdown`. Returns the
    /// counters.
    pub async fn close(mut self, timeout: Duration) -> Arc<MqttStats> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(timeout);
        }
        if let Some(task) = self.task.take() {
            // The task bounds its own wait; this only guards a wedged one.
            if tokio::time::timeout(timeout + Duration::from_secs(2), task)
                .await
                .is_err()
            {
                warn!("the MQTT sink did not stop in time");
            }
        }
        self.stats.clone()
    }
}

/// The client's event loop, on a task of its own (its `poll` is not meant
/// to be dropped half-way): forwards every event, and after a failed
/// connection waits with the client kit's jittered backoff (200 ms
/// doubling to 5 s) before the next. Ends when the sink's task
/// no longer listens.
async fn poll_events(
    mut events: impl Events,
    tx: mpsc::Sender<Result<Event, String>>,
    client_id: String,
) {
    let mut backoff =
        tidegate_kit::backoff::Backoff::seeded(RECONNECT_BASE, RECONNECT_MAX, &client_id);
    let mut last_warn: Option<tokio::time::Instant> = None;
    loop {
        match events.next().await {
            Ok(e) => {
                if matches!(e, Event::Incoming(Packet::ConnAck(_))) {
                    backoff.reset();
                }
                if tx.send(Ok(e)).await.is_err() {
                    return;
                }
            }
            Err(e) => {
                let delay = backoff.next_delay();
                let now = tokio::time::Instant::now();
                if last_warn.is_none_or(|t| now.duration_since(t) >= WARN_EVERY) {
                    last_warn = Some(now);
                    warn!("MQTT broker unreachable: {e}; retrying in {delay:?}");
                } else {
                    debug!("MQTT connection: {e}");
                }
                if tx.send(Err(e)).await.is_err() {
                    return;
                }
                tokio::time::sleep(delay).await;
            }
        }
    }
}

/// Where [`poll_events`] reads the client's events: rumqttc's event loop,
/// or a test's script (so that the reconnect schedule runs on a paused
/// clock, without a broker).
trait Events {
    /// The next event, or why the connection failed.
    fn next(&mut self) -> impl std::future::Future<Output = Result<Event, String>> + Send;
}

impl Events for EventLoop {
    async fn next(&mut self) -> Result<Event, String> {
        self.poll().await.map_err(|e| e.to_string())
    }
}

/// The sink's task: moves results into the ledger, hands the client what
/// the ledger says, and feeds the ledger the client's events.
async fn run(
    settings: MqttSettings,
    mut rx: mpsc::UnboundedReceiver<Request>,
    mut stop: oneshot::Receiver<Duration>,
    stats: Arc<MqttStats>,
) {
    let (client, event_loop) = AsyncClient::new(settings.options(), WINDOW);
    let (events_tx, mut events) = mpsc::channel(WINDOW);
    let poller = tokio::spawn(
        poll_events(event_loop, events_tx, settings.client_id.clone()).in_current_span(),
    );
    let mut ledger = Ledger::new(settings.qos);
    let mut cameras: BTreeSet<String> = BTreeSet::new();
    let mut online: BTreeSet<String> = BTreeSet::new();
    let deadline = loop {
        hand(&client, &mut ledger);
        tokio::select! {
            request = rx.recv() => match request {
                Some(Request::Result { camera, json }) => {
                    cameras.insert(camera.clone());
                    if online.insert(camera.clone()) {
                        ledger.push(availability(&settings, &camera, "online"));
                    }
                    let topic = settings.topic.topic(&settings.edge, &camera);
                    ledger.push(Message::new(topic, json.into_bytes(), false, true));
                }
                None => break tokio::time::Instant::now() + Duration::from_secs(1),
            },
            timeout = &mut stop => {
                break tokio::time::Instant::now() + timeout.unwrap_or(Duration::ZERO);
            }
            event = events.recv() => match event {
                Some(Ok(e)) => on_event(e, &settings, &mut ledger, &stats, &mut online),
                Some(Err(_)) => {
                    ledger.on_disconnected();
                    online.clear();
                }
                None => break tokio::time::Instant::now(),
            },
        }
    };
    // Closing: what arrived before the stop is published, then every
    // camera's and the edge's `offline`.
    while let Ok(Request::Result { camera, json }) = rx.try_recv() {
        cameras.insert(camera.clone());
        let topic = settings.topic.topic(&settings.edge, &camera);
        ledger.push(Message::new(topic, json.into_bytes(), false, true));
    }
    for camera in &cameras {
        ledger.push(availability(&settings, camera, "offline"));
    }
    ledger.push(Message::new(
        settings.status.clone(),
        b"offline".to_vec(),
        true,
        false,
    ));
    while !ledger.is_empty() {
        hand(&client, &mut ledger);
        match tokio::time::timeout_at(deadline, events.recv()).await {
            Ok(Some(Ok(e))) => on_event(e, &settings, &mut ledger, &stats, &mut online),
            Ok(Some(Err(_))) => ledger.on_disconnected(),
            Ok(None) | Err(_) => break,
        }
    }
    let left = ledger.drain();
    stats.release(left);
    stats
        .dropped_shutdown
        .fetch_add(left.results, Ordering::Relaxed);
    // Results pushed after the stop, if any.
    rx.close();
    while let Ok(Request::Result { json, .. }) = rx.try_recv() {
        stats.release(Settled {
            results: 1,
            bytes: json.len() as u64,
        });
        stats.dropped_shutdown.fetch_add(1, Ordering::Relaxed);
    }
    // A clean DISCONNECT: the broker does not publish the last will (the
    // status already says `offline`).
    let _ = client.try_disconnect();
    let _ = tokio::time::timeout(Duration::from_millis(500), async {
        while let Some(Ok(e)) = events.recv().await {
            if matches!(e, Event::Outgoing(Outgoing::Disconnect)) {
                break;
            }
        }
    })
    .await;
    drop(events);
    poller.abort();
    info!(
        pushed = stats.pushed.load(Ordering::Relaxed),
        published = stats.published.load(Ordering::Relaxed),
        dropped_full = stats.dropped_full.load(Ordering::Relaxed),
        dropped_shutdown = stats.dropped_shutdown.load(Ordering::Relaxed),
        resent = stats.resent.load(Ordering::Relaxed),
        "MQTT sink closed"
    );
}

/// Hands the client what the ledger says it may take now.
fn hand(client: &AsyncClient, ledger: &mut Ledger) {
    let qos = ledger.qos;
    while let Some(m) = ledger.next_to_hand(WINDOW) {
        if client
            .try_publish(m.topic.clone(), qos, m.retain, m.payload.clone())
            .is_err()
        {
            ledger.unhand_last();
            break;
        }
    }
}

/// Applies one client event.
fn on_event(
    event: Event,
    settings: &MqttSettings,
    ledger: &mut Ledger,
    stats: &MqttStats,
    online: &mut BTreeSet<String>,
) {
    match event {
        Event::Incoming(Packet::ConnAck(ack)) => {
            let resent_before = ledger.resent();
            ledger.on_connected(ack.session_present);
            stats
                .resent
                .fetch_add(ledger.resent() - resent_before, Ordering::Relaxed);
            stats.connections.fetch_add(1, Ordering::Relaxed);
            info!(held = ledger.results_held(), "connected to the MQTT broker");
            online.clear();
            // Ahead of the results waiting: the edge is back.
            let status = Message::new(settings.status.clone(), b"online".to_vec(), true, false);
            ledger.push_first(status);
        }
        Event::Incoming(Packet::PubAck(ack)) => publish(stats, ledger.on_acked(ack.pkid)),
        Event::Outgoing(Outgoing::Publish(pkid)) => publish(stats, ledger.on_written(pkid)),
        _ => {}
    }
}

fn publish(stats: &MqttStats, s: Settled) {
    if s.results > 0 {
        stats.published.fetch_add(s.results, Ordering::Relaxed);
        stats.release(s);
    }
}

fn availability(settings: &MqttSettings, camera: &str, state: &str) -> Message {
    Message::new(
        settings.availability.topic(&settings.edge, camera),
        state.as_bytes().to_vec(),
        true,
        false,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(n: u8) -> Message {
        Message::new("t".into(), vec![n], false, true)
    }

    #[test]
    fn broker_urls_parse_and_bad_ones_say_why() {
        let b = Broker::parse("mqtt://127.0.0.1:1884").unwrap();
        assert_eq!((b.host.as_str(), b.port, b.tls), ("127.0.0.1", 1884, false));
        let b = Broker::parse("mqtts://broker.example").unwrap();
        assert_eq!((b.port, b.tls), (8883, true));
        let b = Broker::parse("mqtt://[::1]").unwrap();
        assert_eq!((b.host.as_str(), b.port), ("::1", 1883));
        for (url, why) in [
            ("http://x", "not an mqtt://"),
            ("mqtt://x:port", "not a number"),
            ("mqtt://x/topic", "no path"),
            ("mqtt://:1883", "no host"),
            ("mqtt://[::1", "unclosed"),
        ] {
            let e = Broker::parse(url).unwrap_err().to_string();
            assert!(e.contains(why) && e.contains(url), "{url}: {e}");
        }
    }

    #[test]
    fn topic_templates_are_checked_and_names_cannot_open_levels_or_wildcards() {
        let t = TopicTemplate::parse("topic", "site/{edge}/{camera}/det", true).unwrap();
        assert_eq!(t.topic("edge-1", "door"), "site/edge-1/door/det");
        assert_eq!(t.topic("edge-1", "door/1+#"), "site/edge-1/door_1__/det");
        for (tpl, why) in [
            ("", "empty"),
            ("a/+/b/{camera}", "wildcards"),
            ("$SYS/{camera}", "broker's"),
            ("a/{site}/{camera}", "only placeholders"),
            ("a/{edge}", "needs {camera}"),
        ] {
            let e = TopicTemplate::parse("topic", tpl, true)
                .unwrap_err()
                .to_string();
            assert!(e.contains(why), "{tpl}: {e}");
        }
    }

    #[test]
    fn settings_refuse_qos_2_small_bounds_and_a_ca_without_tls() {
        let config: MqttConfig = toml::from_str("url = \"mqtt://127.0.0.1:1883\"").unwrap();
        let s = MqttSettings::new(&config, "edge-1", None).unwrap();
        assert_eq!(s.status, "tidegate/edge-1/status");
        assert_eq!(s.client_id, "tidegate-edge-1");
        assert_eq!(s.qos, QoS::AtLeastOnce);
        let with = |extra: &str| {
            let c: MqttConfig =
                toml::from_str(&format!("url = \"mqtt://127.0.0.1:1883\"\n{extra}")).unwrap();
            MqttSettings::new(&c, "edge-1", None).unwrap_err()
        };
        assert_eq!(with("qos = 2"), MqttError::Qos(2));
        assert!(with("queue = 0").to_string().contains("queue = 0"));
        assert!(with("queue_bytes = 10").to_string().contains("queue_bytes"));
        assert_eq!(with("ca = \"ca.pem\""), MqttError::CaWithoutTls);
        let unknown = toml::from_str::<MqttConfig>("url = \"mqtt://x\"\nqos_level = 1");
        assert!(unknown.unwrap_err().to_string().contains("qos_level"));
    }

    #[test]
    fn at_qos_1_a_result_is_published_only_once_acknowledged() {
        let mut l = Ledger::new(QoS::AtLeastOnce);
        l.push(result(1));
        assert!(
            l.next_to_hand(8).is_none(),
            "nothing handed before a connection"
        );
        l.on_connected(false);
        assert_eq!(l.next_to_hand(8).map(|m| m.payload.clone()), Some(vec![1]));
        assert_eq!(l.on_written(7), Settled::default());
        assert_eq!(l.on_acked(8), Settled::default(), "another packet's ack");
        assert_eq!(l.on_acked(7).results, 1);
        assert!(l.is_empty());
    }

    #[test]
    fn a_new_session_sends_again_what_was_not_acknowledged_in_order() {
        let mut l = Ledger::new(QoS::AtLeastOnce);
        l.on_connected(false);
        for n in 1..=3 {
            l.push(result(n));
        }
        for _ in 0..3 {
            l.next_to_hand(8);
        }
        l.on_written(1);
        l.on_written(2);
        assert_eq!(l.on_acked(1).results, 1);
        l.on_disconnected();
        assert!(l.next_to_hand(8).is_none());
        // The broker forgot the session: 2 (sent) and 3 (handed) go again.
        l.on_connected(false);
        assert_eq!(l.resent(), 2);
        let again: Vec<u8> =
            std::iter::from_fn(|| l.next_to_hand(8).map(|m| m.payload[0])).collect();
        assert_eq!(again, vec![2, 3]);
    }

    #[test]
    fn a_kept_session_leaves_resending_to_the_client_and_ignores_its_retransmissions() {
        let mut l = Ledger::new(QoS::AtLeastOnce);
        l.on_connected(false);
        l.push(result(1));
        l.push(result(2));
        l.next_to_hand(8);
        l.on_written(5);
        l.on_disconnected();
        l.on_connected(true);
        assert_eq!(l.resent(), 0);
        // The client sends packet 5 again: not a new message.
        l.on_written(5);
        assert_eq!(l.next_to_hand(8).map(|m| m.payload[0]), Some(2));
        l.on_written(6);
        assert_eq!(l.on_acked(5).results, 1);
        assert_eq!(l.on_acked(6).results, 1);
        assert!(l.is_empty());
    }

    #[test]
    fn at_qos_0_a_result_is_published_once_written() {
        let mut l = Ledger::new(QoS::AtMostOnce);
        l.on_connected(false);
        l.push(result(1));
        l.push(Message::new("a".into(), b"online".to_vec(), true, false));
        l.next_to_hand(8);
        l.next_to_hand(8);
        assert_eq!(l.on_written(0).results, 1);
        assert_eq!(l.on_written(0).results, 0, "availability is not a result");
        assert!(l.is_empty());
    }

    #[test]
    fn the_window_bounds_what_the_client_holds() {
        let mut l = Ledger::new(QoS::AtLeastOnce);
        l.on_connected(false);
        for n in 0..10 {
            l.push(result(n));
        }
        let handed = std::iter::from_fn(|| l.next_to_hand(4).map(|_| ())).count();
        assert_eq!(handed, 4);
        l.unhand_last();
        assert_eq!(
            std::iter::from_fn(|| l.next_to_hand(4).map(|_| ())).count(),
            1
        );
        assert_eq!(l.drain().results, 10);
    }

    /// A client's events from a script, then none ever; records the
    /// instant of every poll.
    struct ScriptedEvents {
        script: VecDeque<Result<Event, String>>,
        polled: Arc<std::sync::Mutex<Vec<tokio::time::Instant>>>,
    }

    impl Events for ScriptedEvents {
        async fn next(&mut self) -> Result<Event, String> {
            self.polled
                .lock()
                .unwrap()
                .push(tokio::time::Instant::now());
            match self.script.pop_front() {
                Some(event) => event,
                None => std::future::pending().await,
            }
        }
    }

    /// A broker that refuses seven times, accepts, then refuses twice: each
    /// wait lies in its step's jitter band (the upper half of 200 ms
    /// doubling to 5 s), never past the 5 s max, and the `ConnAck` starts
    /// the steps again from 200 ms.
    #[tokio::test(start_paused = true)]
    async fn a_refusing_broker_is_redialled_after_growing_delays_and_a_connack_starts_them_again() {
        // tokio's timer rounds a deadline up to its next millisecond
        const TICK: Duration = Duration::from_millis(1);
        let refused = || Err::<Event, String>("connection refused".into());
        let connack = rumqttc::ConnAck::new(rumqttc::ConnectReturnCode::Success, false);
        let mut script: VecDeque<_> = std::iter::repeat_with(refused).take(7).collect();
        script.push_back(Ok(Event::Incoming(Packet::ConnAck(connack))));
        script.extend(std::iter::repeat_with(refused).take(2));
        let polled = Arc::new(std::sync::Mutex::new(Vec::new()));
        let events = ScriptedEvents {
            script,
            polled: polled.clone(),
        };
        let (tx, mut rx) = mpsc::channel(WINDOW);
        let task = tokio::spawn(poll_events(events, tx, "edge-1".into()));

        let mut forwarded = Vec::new();
        for _ in 0..10 {
            forwarded.push(rx.recv().await.unwrap().is_ok());
        }
        let mut want = vec![false; 7];
        want.extend([true, false, false]);
        assert_eq!(forwarded, want, "every event forwarded, in order");
        // past the last wait: the poll that finds nothing more
        tokio::time::sleep(RECONNECT_MAX).await;
        let at = polled.lock().unwrap().clone();
        assert_eq!(at.len(), 11, "one poll per event, and one after the last");

        let waits: Vec<Duration> = at.windows(2).map(|w| w[1] - w[0]).collect();
        let ms = Duration::from_millis;
        let steps = [200, 400, 800, 1600, 3200, 5000, 5000, 0, 200, 400].map(ms);
        for (i, (wait, step)) in waits.iter().zip(steps).enumerate() {
            assert!(
                *wait >= step / 2 && *wait <= step + TICK,
                "wait {i}: {wait:?} outside [{:?}, {step:?}]; all: {waits:?}",
                step / 2
            );
            assert!(*wait <= RECONNECT_MAX + TICK, "{waits:?}");
        }
        assert_eq!(
            waits[7],
            Duration::ZERO,
            "read on at once after the ConnAck"
        );
        task.abort();
    }
}
