//! `[limits]`: what one peer may make the gateway hold (partly received
//! frames, connections before login, connections and cameras per edge name,
//! control messages). `server/` enforces them; this module only reads and
//! checks them.

use serde::Deserialize;

use super::ConfigError;

/// `[limits]`: bounds on what peers may make the gateway hold, so that one
/// authenticated edge, or strangers that never log in, cannot take its
/// memory (docs/operations.md, "Limits").
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsConfig {
    /// Bytes of partly received frames one connection may hold: each frame
    /// reserves its declared length before its body is read, and a frame
    /// that finds no room is refused (`memory_budget`). A frame larger than
    /// this is always refused, as is one larger than any camera open on
    /// its connection can send (`too_large`).
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
    /// Refused logins (an unknown name or a wrong token, an edge name in
    /// its flood cooldown) one address may have at once before its new
    /// connections are dropped unanswered, before their handshake; an IPv6
    /// address counts by its /64. 0: nobody is shut out.
    #[serde(default = "default_refused_logins_per_address")]
    pub refused_logins_per_address: u32,
    /// Refused logins a second an address may go on having once past
    /// them.
    #[serde(default = "default_refused_logins_per_second")]
    pub refused_logins_per_second: u32,
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
            refused_logins_per_address: default_refused_logins_per_address(),
            refused_logins_per_second: default_refused_logins_per_second(),
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

    /// How many refused logins shut an address out.
    pub fn strike_rate(&self) -> crate::ratelimit::StrikeRate {
        crate::ratelimit::StrikeRate {
            burst: self.refused_logins_per_address,
            per_second: self.refused_logins_per_second,
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
fn default_refused_logins_per_address() -> u32 {
    crate::ratelimit::StrikeRate::DEFAULT_BURST
}
fn default_refused_logins_per_second() -> u32 {
    crate::ratelimit::StrikeRate::DEFAULT_PER_SECOND
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
        if l.refused_logins_per_address > 0 && !(1..=1000).contains(&l.refused_logins_per_second) {
            return Err(ConfigError::Invalid(format!(
                "limits.refused_logins_per_second = {} must be 1 to 1000 (the refused logins a second an address may go on having); to shut nobody out set limits.refused_logins_per_address = 0",
                l.refused_logins_per_second
            )));
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

#[cfg(test)]
mod tests {
    use super::LimitsConfig;
    use crate::config::Config;

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
    fn hostile_client_bounds_default_to_documented_values_and_zero_is_refused_by_name() {
        let cfg = Config::default_config();
        let http = cfg.http.limits();
        assert_eq!(http.header_read_timeout, std::time::Duration::from_secs(10));
        assert_eq!(http.max_connections, 256);
        assert_eq!(
            cfg.limits.control_rate(),
            crate::ratelimit::ControlRate::default()
        );
        assert_eq!(
            cfg.limits.strike_rate(),
            crate::ratelimit::StrikeRate::default()
        );
        // shutting nobody out needs no rate
        let off: Config = toml::from_str(
            "[limits]\nrefused_logins_per_address = 0\nrefused_logins_per_second = 0\n",
        )
        .unwrap();
        off.validate().unwrap();
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
            (
                "[limits]\nrefused_logins_per_second = 0",
                "limits.refused_logins_per_second",
            ),
            (
                "[limits]\nrefused_logins_per_second = 1001",
                "limits.refused_logins_per_second",
            ),
        ] {
            let cfg: Config = toml::from_str(&format!("{text}\n")).unwrap();
            let e = cfg.validate().unwrap_err().to_string();
            assert!(e.contains(key), "{text}: {e}");
        }
    }
}
