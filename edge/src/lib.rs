//! tidegate-edge: runs beside the cameras. GStreamer pipelines decode and
//! scale each camera to the model's input ([`capture`], feature `capture`);
//! the [`uplink`] sends each frame over QUIC to the gateway and receives
//! results, which go to a [`sink`] with their end-to-end latency measured on
//! the edge's own [`clock`]; [`uplink_stats`] keeps what the QUIC link did
//! across its connections. With `[metrics] listen`, `metrics` (feature
//! `capture`) serves each camera's counters to Prometheus.

pub mod adapt;
#[cfg(feature = "capture")]
pub mod capture;
pub mod clock;
pub mod config;
pub mod gate;
#[cfg(feature = "capture")]
pub mod metrics;
#[cfg(feature = "capture")]
pub mod node;
#[cfg(feature = "capture")]
pub mod outbound;
pub mod redundancy;
pub mod sink;
pub mod uplink;
pub mod uplink_stats;
