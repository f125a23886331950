//! The edge's configuration: a TOML file, with `TIDEGATE_*` environment
//! variables and flags layered on top by the binary.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use tidegate_protocol::{Codec, Encoding, GatewayAddr};

/// Everything an edge needs.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EdgeConfig {
    /// This edge's name, as listed in the gateway's `[[edges]]`.
    pub name: String,
    /// Its token. Prefer the `TIDEGATE_EDGE_TOKEN` environment variable.
    #[serde(default)]
    pub token: Secret,
    /// How to reach the gateway.
    pub gateway: GatewayConfig,
    /// The cameras.
    #[serde(default)]
    pub cameras: Vec<CameraConfig>,
    /// Where results go.
    #[serde(default)]
    pub sinks: SinksConfig,
    /// The Prometheus endpoint (off unless `listen` is set).
    #[serde(default)]
    pub metrics: MetricsConfig,
}

/// `[metrics]`: where the edge serves `/metrics` (`crate::metrics`, with
/// the `capture` feature).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsConfig {
    /// Address to serve `/metrics` on, e.g. `127.0.0.1:9102` (port 0: any
    /// free port, printed at start as `metrics listening on ADDR`). Unset:
    /// no metrics endpoint.
    #[serde(default)]
    pub listen: Option<std::net::SocketAddr>,
}

/// Where results go; every sink configured gets every result.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SinksConfig {
    /// JSON lines on standard output.
    #[serde(default = "yes")]
    pub stdout: bool,
    /// JSON lines appended to this file (relative paths resolve against the
    /// config file).
    #[serde(default)]
    pub file: Option<PathBuf>,
    /// `http[s]://host:port/path`: results are POSTed there as JSON arrays
    /// (with `Authorization: Bearer $TIDEGATE_WEBHOOK_TOKEN` when that is
    /// set).
    #[serde(default)]
    pub webhook: Option<String>,
    /// For an `https://` webhook: the PEM CA certificate(s) to trust instead
    /// of the system's roots (relative paths resolve against the config
    /// file).
    #[serde(default)]
    pub webhook_ca: Option<PathBuf>,
    /// Results waiting for the webhook. When the queue is full a new result
    /// is dropped for the webhook (counted as `dropped_full`); the other
    /// sinks still get it.
    #[serde(default = "default_webhook_queue")]
    pub webhook_queue: usize,
    /// Bytes of JSON the webhook holds at most, queued or in the POST under
    /// way (default 64 MiB; at least 1 KiB): a `raw` model's results can
    /// weigh megabytes each. A result that would pass it is dropped for the
    /// webhook and counted as `dropped_full`, as when the queue is full.
    #[serde(default = "default_webhook_queue_bytes")]
    pub webhook_queue_bytes: usize,
    /// `[sinks.mqtt]`: one JSON event per result published to an MQTT
    /// broker, with the edge's and each camera's availability
    /// ([`crate::sink::mqtt`]).
    #[serde(default)]
    pub mqtt: Option<crate::sink::mqtt::MqttConfig>,
}

impl Default for SinksConfig {
    fn default() -> Self {
        SinksConfig {
            stdout: true,
            file: None,
            webhook: None,
            webhook_ca: None,
            webhook_queue: default_webhook_queue(),
            webhook_queue_bytes: default_webhook_queue_bytes(),
            mqtt: None,
        }
    }
}

fn yes() -> bool {
    true
}
fn default_webhook_queue() -> usize {
    crate::sink::webhook::DEFAULT_QUEUE_RESULTS
}
fn default_webhook_queue_bytes() -> usize {
    crate::sink::webhook::DEFAULT_QUEUE_BYTES
}
/// The least `sinks.webhook_queue_bytes` accepted.
const MIN_WEBHOOK_QUEUE_BYTES: usize = 1024;

/// How to reach the gateway.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayConfig {
    /// Gateway QUIC address: an IP address or a host name, and the port
    /// (`10.0.0.5:4433`, `gw.example.com:4433`). A name is resolved at
    /// every dial.
    #[serde(deserialize_with = "tidegate_kit::gateway::deserialize_addr")]
    pub addr: GatewayAddr,
    /// Name in the gateway's certificate.
    #[serde(default = "tidegate_kit::gateway::default_server_name")]
    pub server_name: String,
    /// CA certificate (PEM) to trust.
    pub ca: PathBuf,
    /// Congestion controller for the frames this edge sends: `bbr`
    /// (default: it tolerates the random loss of Wi-Fi and cellular
    /// uplinks), `cubic` or `newreno` (docs/benchmarks.md, "WAN").
    #[serde(default)]
    pub congestion: tidegate_protocol::quic::Congestion,
}

/// One camera.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CameraConfig {
    /// Name, unique within this edge.
    pub name: String,
    /// Source: `rtsp://host/path`, `v4l2:///dev/video0`,
    /// `file:///path.mp4`, `image:///path.png`, `test://smpte`.
    #[serde(default)]
    pub uri: String,
    /// Model to run on its frames.
    #[serde(default)]
    pub model: String,
    /// End-to-end budget per frame (ms).
    #[serde(default = "default_budget_ms")]
    pub budget_ms: u32,
    /// Frame-rate cap. The gateway's hints may lower it, never raise it.
    #[serde(default = "default_max_fps")]
    pub max_fps: f64,
    /// Motion gate: the fraction (0–1) of a 32×32 grey thumbnail that must
    /// change, against the last frame sent, for a frame to be sent. 0 (the
    /// default) sends every frame up to the cap. Hints may raise it.
    #[serde(default)]
    pub motion_threshold: f64,
    /// Least frames per second sent while the motion gate finds the scene
    /// static, so the gateway still sees the camera.
    #[serde(default = "default_keepalive_fps")]
    pub keepalive_fps: f64,
    /// Lower transport of an `rtsp://` source: `tcp` (default) or `udp`.
    #[serde(default)]
    pub rtsp_transport: RtspTransport,
    /// Play a `file://` source again from the start when it ends.
    #[serde(default, rename = "loop")]
    pub loop_file: bool,
    /// Frames of this camera on the wire, unacknowledged, at most; a newer
    /// frame abandons the oldest beyond that.
    #[serde(default = "default_max_in_flight")]
    pub max_in_flight: usize,
    /// How frames travel: `jpeg` (the default), `png` or `raw`. Encoded
    /// after scaling and letterboxing, so the image is exactly the model's
    /// input. JPEG by default because the edge's link is usually a WAN: a
    /// 128×128 RGB frame is 49 KB raw, 4–9 KB as JPEG (4:2:0); `raw` (no
    /// encoding cost on either side) suits a LAN, `png` (lossless, but
    /// 80–90 % of raw for a camera image) a model that must see exact
    /// pixels.
    #[serde(default = "default_encoding")]
    pub encoding: Codec,
    /// JPEG only: the highest quality (1–100), what the gateway is told at
    /// `CameraOpen`, and where a camera that does not adapt stays (one
    /// that adapts starts at `min_jpeg_quality` and climbs: slow start).
    #[serde(default = "default_jpeg_quality")]
    pub jpeg_quality: u8,
    /// JPEG only: the lowest quality adaptation may go down to (1 to
    /// `jpeg_quality`) before it lowers the frame rate instead.
    #[serde(default = "default_min_jpeg_quality")]
    pub min_jpeg_quality: u8,
    /// Fit the camera to its uplink: lower the JPEG quality, then the frame
    /// rate, while frames miss their deadline on the wire, and raise them
    /// back slowly once the link has room ([`crate::adapt`]). `false` keeps
    /// `jpeg_quality` and `max_fps` (the gateway's hints still apply).
    #[serde(default = "yes")]
    pub adapt: bool,
    /// Copies of each frame to send, side by side, each on a stream of its
    /// own, and of each result to get back: `"auto"` (the default) or a
    /// fixed 1 to 3. On a link that loses packets at random (Wi-Fi,
    /// cellular) with a round trip too long for a retransmission within
    /// the budget, 2 serves frames that one copy loses, at twice the
    /// uplink's bytes (docs/benchmarks.md, "WAN"). `auto` opens the camera
    /// with 2 and sends each frame once or twice, as the path's loss and
    /// round trip say ([`crate::redundancy`]).
    #[serde(default)]
    pub copies: Copies,
}

/// A camera's `copies`: fixed, or chosen frame by frame from the path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Copies {
    /// Opened with [`Copies::AUTO_MAX`]; each frame goes once or more as
    /// [`crate::redundancy::Redundancy`] decides.
    #[default]
    Auto,
    /// Every frame this many times (1 to the protocol's `MAX_COPIES`).
    Fixed(u8),
}

impl Copies {
    /// The copies an `auto` camera opens with: each result comes back
    /// twice (a result is one packet, so two copies cost little and lose
    /// one result in 2,500 at 2 % loss), and each frame goes once or twice.
    pub const AUTO_MAX: u8 = 2;

    /// The copies to ask for at `CameraOpen`.
    pub fn asked(self) -> u8 {
        match self {
            Copies::Auto => Self::AUTO_MAX,
            Copies::Fixed(n) => n,
        }
    }
}

impl std::fmt::Display for Copies {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Copies::Auto => f.write_str("auto"),
            Copies::Fixed(n) => write!(f, "{n}"),
        }
    }
}

impl serde::Serialize for Copies {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Copies::Auto => s.serialize_str("auto"),
            Copies::Fixed(n) => s.serialize_u8(*n),
        }
    }
}

impl<'de> Deserialize<'de> for Copies {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Number(i64),
            Word(String),
        }
        match Raw::deserialize(d)? {
            Raw::Word(w) if w == "auto" => Ok(Copies::Auto),
            Raw::Word(w) => Err(serde::de::Error::custom(format!(
                "copies = {w:?}: expected \"auto\" or a number from 1 to {}",
                tidegate_protocol::MAX_COPIES
            ))),
            // Checked against the protocol's range by `validate`.
            Raw::Number(n) => Ok(Copies::Fixed(u8::try_from(n).unwrap_or(0))),
        }
    }
}

fn default_budget_ms() -> u32 {
    80
}
fn default_max_fps() -> f64 {
    10.0
}
fn default_keepalive_fps() -> f64 {
    0.5
}
fn default_max_in_flight() -> usize {
    2
}
fn default_encoding() -> Codec {
    Codec::Jpeg
}
/// Highest JPEG quality by default: a detailed 128×128 frame at quality 90
/// is 8.8 KB, a fifth of its 49 KB raw, and its pixels move by about 4
/// levels (of 255) on average.
pub const DEFAULT_JPEG_QUALITY: u8 = 90;
/// Lowest JPEG quality adaptation goes to by default: below about 50, 8×8
/// blocking starts to move the boxes of small objects in a 128×128 input,
/// while the bytes saved get small (the same frame is 4.1 KB at 50, 2.6 KB
/// at 20).
pub const DEFAULT_MIN_JPEG_QUALITY: u8 = 50;
fn default_jpeg_quality() -> u8 {
    DEFAULT_JPEG_QUALITY
}
fn default_min_jpeg_quality() -> u8 {
    DEFAULT_MIN_JPEG_QUALITY
}

impl CameraConfig {
    /// Checks this camera's entry. An error here disables this camera only.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |what: String| {
            Err(ConfigError::Invalid(format!(
                "camera '{}': {what}",
                self.name
            )))
        };
        if self.name.trim().is_empty() {
            // the gateway refuses it: an empty camera in a hint means every
            // camera of the edge
            return Err(ConfigError::Invalid(format!(
                "a camera (uri {:?}) has no name: set `name = \"door\"`, unique within the edge",
                self.uri
            )));
        }
        if self.model.trim().is_empty() {
            return Err(ConfigError::Invalid(format!(
                "camera '{}' has no model: set `model = \"blazeface\"` (or another model the gateway serves)",
                self.name
            )));
        }
        if self.uri.trim().is_empty() {
            return bad("it has no uri: set `uri = \"rtsp://host/path\"` (or file://, v4l2://, image://, test://)".into());
        }
        if !(self.max_fps > 0.0 && self.max_fps <= 240.0) {
            return bad(format!("max_fps {} must be in (0, 240]", self.max_fps));
        }
        if self.budget_ms == 0 {
            return bad("budget_ms must be positive".into());
        }
        if !(0.0..=1.0).contains(&self.motion_threshold) {
            return bad(format!(
                "motion_threshold {} must be a fraction from 0 (off) to 1",
                self.motion_threshold
            ));
        }
        if !(self.keepalive_fps >= 0.0 && self.keepalive_fps <= self.max_fps) {
            return bad(format!(
                "keepalive_fps {} must be from 0 to max_fps ({})",
                self.keepalive_fps, self.max_fps
            ));
        }
        if !(1..=64).contains(&self.max_in_flight) {
            return bad(format!(
                "max_in_flight {} must be from 1 to 64",
                self.max_in_flight
            ));
        }
        if !(1..=Encoding::MAX_QUALITY).contains(&self.jpeg_quality) {
            return bad(format!(
                "jpeg_quality {} must be from 1 to {} (the default is {DEFAULT_JPEG_QUALITY})",
                self.jpeg_quality,
                Encoding::MAX_QUALITY
            ));
        }
        if let Copies::Fixed(n) = self.copies
            && !(1..=tidegate_protocol::MAX_COPIES).contains(&n)
        {
            return bad(format!(
                "copies = {n} must be \"auto\" (the default) or from 1 to {}; 1 sends each frame once, 2 suits a lossy WAN",
                tidegate_protocol::MAX_COPIES
            ));
        }
        if !(1..=self.jpeg_quality).contains(&self.min_jpeg_quality) {
            return bad(format!(
                "min_jpeg_quality {} must be from 1 to jpeg_quality ({}); the default is {DEFAULT_MIN_JPEG_QUALITY}",
                self.min_jpeg_quality, self.jpeg_quality
            ));
        }
        Ok(())
    }

    /// The encoding this camera asks for at `CameraOpen`: for JPEG, its
    /// highest quality.
    pub fn wire_encoding(&self) -> Encoding {
        match self.encoding {
            Codec::Raw => Encoding::Raw,
            Codec::Jpeg => Encoding::Jpeg {
                quality: self.jpeg_quality,
            },
            Codec::Png => Encoding::Png,
        }
    }
}

/// Lower transport of an `rtsp://` camera.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RtspTransport {
    /// RTP interleaved on the RTSP TCP connection: works through NAT and
    /// firewalls, never loses packets.
    #[default]
    Tcp,
    /// RTP over UDP: lower latency on a clean LAN, packets may be lost.
    Udp,
}

/// A secret string: redacted in `Debug`.
#[derive(Clone, Default, Deserialize)]
#[serde(transparent)]
pub struct Secret(pub String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_empty() {
            "<unset>"
        } else {
            "<redacted>"
        })
    }
}

/// Why the configuration is unusable (the client kit's, shared by every
/// binary).
pub use tidegate_kit::config::ConfigError;

impl EdgeConfig {
    /// Reads a file; a relative `gateway.ca` resolves against its directory.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let mut cfg: EdgeConfig = tidegate_kit::config::read_toml(path)?;
        let dir = path.parent().unwrap_or(Path::new("."));
        if cfg.gateway.ca.is_relative() {
            cfg.gateway.ca = dir.join(&cfg.gateway.ca);
        }
        let mqtt_ca = cfg.sinks.mqtt.as_mut().and_then(|m| m.ca.as_mut());
        for f in [
            cfg.sinks.file.as_mut(),
            cfg.sinks.webhook_ca.as_mut(),
            mqtt_ca,
        ]
        .into_iter()
        .flatten()
        {
            if f.is_relative() {
                *f = dir.join(&*f);
            }
        }
        Ok(cfg)
    }

    /// Checks what serde cannot, for the edge as a whole. A camera's own
    /// entry is checked by [`CameraConfig::validate`]: a bad one disables
    /// that camera, not the edge.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.token.0.is_empty() {
            return Err(ConfigError::Invalid(format!(
                "edge '{}' has no token: set TIDEGATE_EDGE_TOKEN or `token` in the config",
                self.name
            )));
        }
        let mut seen = std::collections::HashSet::new();
        for c in &self.cameras {
            if !seen.insert(&c.name) {
                return Err(ConfigError::Invalid(format!(
                    "camera '{}' is listed twice",
                    c.name
                )));
            }
        }
        if self.sinks.webhook_queue == 0 {
            return Err(ConfigError::Invalid(
                "sinks.webhook_queue must be at least 1".into(),
            ));
        }
        if self.sinks.webhook_queue_bytes < MIN_WEBHOOK_QUEUE_BYTES {
            return Err(ConfigError::Invalid(format!(
                "sinks.webhook_queue_bytes {} must be at least {MIN_WEBHOOK_QUEUE_BYTES} (the default is {})",
                self.sinks.webhook_queue_bytes,
                default_webhook_queue_bytes()
            )));
        }
        match (&self.sinks.webhook, &self.sinks.webhook_ca) {
            (Some(url), ca) => {
                let e = crate::sink::webhook::Endpoint::parse(url)
                    .map_err(|e| ConfigError::Invalid(format!("sinks.webhook: {e}")))?;
                if ca.is_some() && !e.tls {
                    return Err(ConfigError::Invalid(
                        "sinks.webhook_ca is set, but sinks.webhook is not an https:// URL".into(),
                    ));
                }
            }
            (None, Some(_)) => {
                return Err(ConfigError::Invalid(
                    "sinks.webhook_ca is set, but there is no sinks.webhook".into(),
                ));
            }
            (None, None) => {}
        }
        if let Some(m) = &self.sinks.mqtt {
            // The password is read when the sink starts; the CA file too.
            let checked = crate::sink::mqtt::MqttSettings::new(
                &crate::sink::mqtt::MqttConfig {
                    ca: None,
                    ..m.clone()
                },
                &self.name,
                None,
            );
            match checked {
                Err(crate::sink::mqtt::MqttError::Tls(_)) | Ok(_) => {}
                Err(e) => return Err(ConfigError::Invalid(e.to_string())),
            }
            if m.ca.is_some() && !m.url.starts_with("mqtts://") {
                return Err(ConfigError::Invalid(
                    crate::sink::mqtt::MqttError::CaWithoutTls.to_string(),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> EdgeConfig {
        toml::from_str(text).unwrap()
    }

    const BASE: &str =
        "name = \"e\"\ntoken = \"t\"\n[gateway]\naddr = \"127.0.0.1:4433\"\nca = \"ca.pem\"\n";

    #[test]
    fn metrics_are_off_unless_listen_is_set_and_unknown_keys_are_refused() {
        assert_eq!(parse(BASE).metrics.listen, None);
        let on = parse(&format!("{BASE}[metrics]\nlisten = \"127.0.0.1:9102\"\n"));
        assert_eq!(on.metrics.listen, Some("127.0.0.1:9102".parse().unwrap()));
        let bad = toml::from_str::<EdgeConfig>(&format!("{BASE}[metrics]\nlisten = \"nowhere\"\n"))
            .unwrap_err();
        assert!(bad.to_string().contains("listen"), "{bad}");
        let unknown =
            toml::from_str::<EdgeConfig>(&format!("{BASE}[metrics]\nport = 1\n")).unwrap_err();
        assert!(unknown.to_string().contains("port"), "{unknown}");
    }

    #[test]
    fn camera_without_model_is_named_in_the_error() {
        let cfg = parse(&format!(
            "{BASE}[[cameras]]\nname = \"door\"\nuri = \"test://smpte\"\nmodel = \"\"\n"
        ));
        cfg.validate().unwrap();
        let err = cfg.cameras[0].validate().unwrap_err().to_string();
        assert!(err.contains("'door'") && err.contains("model"), "{err}");
    }

    #[test]
    fn camera_without_a_name_is_refused_naming_its_uri() {
        let cfg = parse(&format!(
            "{BASE}[[cameras]]\nname = \" \"\nuri = \"test://smpte\"\nmodel = \"m\"\n"
        ));
        let err = cfg.cameras[0].validate().unwrap_err().to_string();
        assert!(
            err.contains("no name") && err.contains("test://smpte"),
            "{err}"
        );
    }

    #[test]
    fn camera_without_model_key_still_parses_so_the_others_can_run() {
        let cfg = parse(&format!(
            "{BASE}[[cameras]]\nname = \"a\"\nuri = \"test://smpte\"\n[[cameras]]\nname = \"b\"\nuri = \"test://ball\"\nmodel = \"m\"\n"
        ));
        cfg.validate().unwrap();
        assert!(cfg.cameras[0].validate().is_err());
        cfg.cameras[1].validate().unwrap();
    }

    #[test]
    fn camera_options_parse_and_are_range_checked() {
        let cfg = parse(&format!(
            "{BASE}[[cameras]]\nname = \"gate\"\nuri = \"rtsp://cam/x\"\nmodel = \"m\"\nmax_fps = 15\nmotion_threshold = 0.02\nkeepalive_fps = 1\nrtsp_transport = \"udp\"\nloop = true\n"
        ));
        let c = &cfg.cameras[0];
        c.validate().unwrap();
        assert_eq!(c.rtsp_transport, RtspTransport::Udp);
        assert!(c.loop_file);
        assert_eq!((c.motion_threshold, c.keepalive_fps), (0.02, 1.0));
        let mut bad = c.clone();
        bad.motion_threshold = 1.5;
        assert!(
            bad.validate()
                .unwrap_err()
                .to_string()
                .contains("motion_threshold")
        );
        let mut bad = c.clone();
        bad.keepalive_fps = 30.0;
        assert!(
            bad.validate()
                .unwrap_err()
                .to_string()
                .contains("keepalive_fps")
        );
        assert!(
            toml::from_str::<EdgeConfig>(&format!(
                "{BASE}[[cameras]]\nname = \"x\"\nuri = \"rtsp://c/x\"\nmodel = \"m\"\nrtsp_transport = \"http\"\n"
            ))
            .is_err()
        );
    }

    #[test]
    fn copies_are_auto_by_default_or_a_number_from_one_to_three() {
        let cam = |copies: &str| {
            toml::from_str::<EdgeConfig>(&format!(
                "{BASE}[[cameras]]\nname = \"c\"\nuri = \"test://smpte\"\nmodel = \"m\"\n{copies}"
            ))
            .map(|cfg| cfg.cameras[0].clone())
        };
        let auto = cam("").unwrap();
        assert_eq!(auto.copies, Copies::Auto);
        assert_eq!(auto.copies.asked(), Copies::AUTO_MAX);
        assert_eq!(cam("copies = \"auto\"\n").unwrap().copies, Copies::Auto);
        let two = cam("copies = 2\n").unwrap();
        two.validate().unwrap();
        assert_eq!(two.copies.asked(), 2);
        for bad in [
            "copies = 0\n",
            "copies = 4\n",
            "copies = -1\n",
            "copies = 300\n",
        ] {
            let err = cam(bad).unwrap().validate().unwrap_err().to_string();
            assert!(
                err.contains("copies") && err.contains("auto"),
                "{bad}: {err}"
            );
        }
        let err = cam("copies = \"many\"\n").unwrap_err().to_string();
        assert!(err.contains("\"many\"") && err.contains("auto"), "{err}");
    }

    #[test]
    fn relative_ca_results_file_and_webhook_ca_resolve_against_the_config_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("edge.toml");
        std::fs::write(
            &path,
            format!(
                "{BASE}[sinks]\nstdout = false\nfile = \"out/results.jsonl\"\nwebhook = \"https://h/x\"\nwebhook_ca = \"hook-ca.pem\"\n"
            ),
        )
        .unwrap();
        let cfg = EdgeConfig::load(&path).unwrap();
        assert_eq!(cfg.gateway.ca, dir.path().join("ca.pem"));
        assert_eq!(cfg.sinks.file, Some(dir.path().join("out/results.jsonl")));
        assert_eq!(cfg.sinks.webhook_ca, Some(dir.path().join("hook-ca.pem")));
        assert!(!cfg.sinks.stdout);
    }

    #[test]
    fn an_mqtt_sink_parses_resolves_its_ca_and_bad_settings_say_which() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("edge.toml");
        std::fs::write(
            &path,
            format!(
                "{BASE}[sinks.mqtt]\nurl = \"mqtts://broker:8883\"\nca = \"mqtt-ca.pem\"\nqos = 0\n"
            ),
        )
        .unwrap();
        let cfg = EdgeConfig::load(&path).unwrap();
        let m = cfg.sinks.mqtt.as_ref().unwrap();
        assert_eq!(m.ca, Some(dir.path().join("mqtt-ca.pem")));
        assert_eq!(
            (m.qos, m.topic.as_str()),
            (0, "tidegate/{edge}/{camera}/detections")
        );
        // The CA file is read when the sink starts, not by the check.
        cfg.validate().unwrap();
        let check = |mqtt: &str| {
            parse(&format!("{BASE}[sinks.mqtt]\n{mqtt}"))
                .validate()
                .map_err(|e| e.to_string())
        };
        check("url = \"mqtt://127.0.0.1:1883\"\n").unwrap();
        for (mqtt, says) in [
            ("url = \"tcp://x\"\n", "sinks.mqtt.url"),
            ("url = \"mqtt://x\"\nqos = 2\n", "QoS 2"),
            ("url = \"mqtt://x\"\ntopic = \"a/#\"\n", "sinks.mqtt.topic"),
            ("url = \"mqtt://x\"\nca = \"ca.pem\"\n", "mqtts://"),
        ] {
            let err = check(mqtt).unwrap_err();
            assert!(err.contains(says), "{mqtt}: {err}");
        }
    }

    #[test]
    fn sinks_default_to_stdout_and_check_the_webhook_url() {
        let cfg = parse(BASE);
        assert!(cfg.sinks.stdout && cfg.sinks.file.is_none() && cfg.sinks.webhook.is_none());
        let cfg = parse(&format!(
            "{BASE}[sinks]\nstdout = false\nwebhook = \"ftp://x/y\"\n"
        ));
        let err = cfg.validate().unwrap_err().to_string();
        assert!(
            err.contains("sinks.webhook") && err.contains("https://"),
            "{err}"
        );
        let ok = |sinks: &str| parse(&format!("{BASE}[sinks]\n{sinks}")).validate();
        ok("webhook = \"https://x/y\"\nwebhook_ca = \"ca.pem\"\n").unwrap();
        ok("webhook = \"http://x/y\"\n").unwrap();
        for (sinks, says) in [
            (
                "webhook = \"http://x/y\"\nwebhook_ca = \"ca.pem\"\n",
                "not an https://",
            ),
            ("webhook_ca = \"ca.pem\"\n", "no sinks.webhook"),
        ] {
            let err = ok(sinks).unwrap_err().to_string();
            assert!(err.contains(says), "{sinks}: {err}");
        }
    }

    #[test]
    fn webhook_queue_bytes_defaults_to_64_mib_and_is_range_checked() {
        let cfg = parse(BASE);
        assert_eq!(cfg.sinks.webhook_queue_bytes, 64 << 20);
        let with = |bytes: usize| {
            parse(&format!("{BASE}[sinks]\nwebhook_queue_bytes = {bytes}\n")).validate()
        };
        with(1024).unwrap();
        with(8 << 20).unwrap();
        for bad in [0, 1023] {
            let err = with(bad).unwrap_err().to_string();
            assert!(
                err.contains("sinks.webhook_queue_bytes") && err.contains("at least 1024"),
                "{err}"
            );
        }
    }

    #[test]
    fn cameras_default_to_jpeg_from_90_down_to_50_with_adaptation_on() {
        let cfg = parse(&format!(
            "{BASE}[[cameras]]\nname = \"c\"\nuri = \"test://smpte\"\nmodel = \"m\"\n"
        ));
        let c = &cfg.cameras[0];
        c.validate().unwrap();
        assert_eq!(c.encoding, Codec::Jpeg);
        assert_eq!(
            (c.jpeg_quality, c.min_jpeg_quality, c.adapt),
            (90, 50, true)
        );
        assert_eq!(c.wire_encoding(), Encoding::Jpeg { quality: 90 });
    }

    #[test]
    fn encoding_and_jpeg_qualities_are_parsed_and_range_checked() {
        let cam = |keys: &str| {
            parse(&format!(
                "{BASE}[[cameras]]\nname = \"door\"\nuri = \"test://smpte\"\nmodel = \"m\"\n{keys}"
            ))
            .cameras
            .remove(0)
        };
        assert_eq!(cam("encoding = \"raw\"\n").wire_encoding(), Encoding::Raw);
        assert_eq!(cam("encoding = \"png\"\n").wire_encoding(), Encoding::Png);
        let c = cam("jpeg_quality = 75\nmin_jpeg_quality = 75\nadapt = false\n");
        c.validate().unwrap();
        assert_eq!(c.wire_encoding(), Encoding::Jpeg { quality: 75 });
        assert!(!c.adapt);
        for (keys, says) in [
            ("jpeg_quality = 0\n", "jpeg_quality 0 must be from 1 to 100"),
            ("jpeg_quality = 101\n", "jpeg_quality 101"),
            (
                "min_jpeg_quality = 95\n",
                "min_jpeg_quality 95 must be from 1 to jpeg_quality (90)",
            ),
            ("min_jpeg_quality = 0\n", "min_jpeg_quality 0"),
        ] {
            let err = cam(keys).validate().unwrap_err().to_string();
            assert!(
                err.contains("'door'") && err.contains(says),
                "{keys}: {err}"
            );
        }
        let err = toml::from_str::<EdgeConfig>(&format!(
            "{BASE}[[cameras]]\nname = \"door\"\nencoding = \"jpg\"\n"
        ))
        .unwrap_err()
        .to_string();
        assert!(err.contains("jpeg") && err.contains("png"), "{err}");
    }

    #[test]
    fn defaults_give_an_80_ms_budget() {
        let cfg = parse(&format!(
            "{BASE}[[cameras]]\nname = \"c\"\nuri = \"test://smpte\"\nmodel = \"m\"\n"
        ));
        cfg.validate().unwrap();
        assert_eq!(cfg.cameras[0].budget_ms, 80);
    }

    #[test]
    fn gateway_addr_takes_a_host_name_or_an_ip_and_a_bad_one_names_the_field() {
        let with = |addr: &str| {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("edge.toml");
            std::fs::write(
                &path,
                BASE.replace("addr = \"127.0.0.1:4433\"", &format!("addr = \"{addr}\"")),
            )
            .unwrap();
            EdgeConfig::load(&path)
        };
        let cfg = with("gw.example.com:4433").unwrap();
        assert_eq!(cfg.gateway.addr.name(), Some("gw.example.com"));
        assert_eq!(cfg.gateway.addr.port(), 4433);
        let cfg = with("[::1]:4433").unwrap();
        assert_eq!(cfg.gateway.addr.ip(), Some("[::1]:4433".parse().unwrap()));
        assert_eq!(
            parse(BASE).gateway.addr.ip(),
            Some("127.0.0.1:4433".parse().unwrap())
        );
        for (addr, says) in [
            ("gw example:1", "contains whitespace"),
            ("gw.example.com:0", "port 0"),
            ("gw_1.example.com:4433", "not a valid host name"),
        ] {
            let err = with(addr).unwrap_err();
            assert!(matches!(err, ConfigError::Parse { .. }), "{err:?}");
            let text = err.to_string();
            assert!(
                text.contains("gateway.addr: gateway address") && text.contains(says),
                "{addr}: {text}"
            );
        }
    }

    #[test]
    fn token_is_redacted_in_debug() {
        let cfg = parse(BASE);
        let dbg = format!("{cfg:?}");
        assert!(dbg.contains("<redacted>") && !dbg.contains("token: Secret(\"t\")"));
    }
}
