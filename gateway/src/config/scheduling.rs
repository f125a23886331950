//! `[scheduler]`: queue bounds, the budget cap, pipelining, frame-rate hints
//! and when a worker counts as stalled or unhealthy. The scheduler itself
//! (`crate::scheduler`) reads these; nothing here schedules.

use serde::Deserialize;

use super::ConfigError;

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
    #[serde(default = "super::default_true")]
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

impl SchedulerConfig {
    /// Checks what serde cannot: every bound lets frames through and every
    /// window is long enough to measure.
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if !(1..=4).contains(&self.pipeline_depth) {
            return Err(ConfigError::Invalid(format!(
                "scheduler.pipeline_depth = {} must be 1..=4",
                self.pipeline_depth
            )));
        }
        if self.stall_timeout_ms < 1000 {
            return Err(ConfigError::Invalid(format!(
                "scheduler.stall_timeout_ms = {} would drop workers over a slow batch; use at least 1000",
                self.stall_timeout_ms
            )));
        }
        self.health.validate().map_err(ConfigError::Invalid)?;
        if self.hint_window_ms < 100 {
            return Err(ConfigError::Invalid(format!(
                "scheduler.hint_window_ms = {} is too short to measure a rate; use at least 100",
                self.hint_window_ms
            )));
        }
        if !(0.0..1.0).contains(&self.hint_shed_ratio) {
            return Err(ConfigError::Invalid(format!(
                "scheduler.hint_shed_ratio = {} must be in [0, 1)",
                self.hint_shed_ratio
            )));
        }
        if self.max_queued == 0 || self.max_queued_per_edge == 0 {
            return Err(ConfigError::Invalid(
                "scheduler.max_queued and max_queued_per_edge must be at least 1".into(),
            ));
        }
        if self.max_budget_ms == 0 {
            return Err(ConfigError::Invalid(
                "scheduler.max_budget_ms = 0 would make every frame late; use at least 1".into(),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

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
}
