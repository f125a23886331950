//! `[leasing]`: which provider leases workers, the autoscaler's policy and
//! bounds, and the models it scales. What is checked beyond serde is in
//! `checks.rs`; this module does not start or price anything itself.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::ConfigError;

mod checks;
#[cfg(test)]
mod tests;

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
    /// Paid-block-aware: how far past a block's end the renewal forecast
    /// looks (s), at least a start-up; unset: a start-up.
    #[serde(default)]
    pub renew_horizon_secs: Option<u64>,
    /// Paid-block-aware: the on-demand reserve held against spot
    /// preemptions, as a multiple of the spot workers the measured
    /// interruption rate takes out over one start-up; unset or 0: none.
    #[serde(default)]
    pub hedge_margin: Option<f64>,
    /// Spot types a model falls back to when its cheapest type's spot is
    /// refused: those whose worker serves at least this share of what the
    /// model's fastest type does, in [0, 1]; unset: 0.5.
    #[serde(default)]
    pub spot_fallback_min_share: Option<f64>,
    /// After a type's spot is refused, that model does not ask that
    /// type's spot again for this long (s); meanwhile the next type's spot
    /// or on-demand serves. Unset: 60.
    #[serde(default)]
    pub spot_refused_cooloff_secs: Option<u64>,
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
            .field("renew_horizon_secs", &self.renew_horizon_secs)
            .field("hedge_margin", &self.hedge_margin)
            .field("spot_fallback_min_share", &self.spot_fallback_min_share)
            .field("spot_refused_cooloff_secs", &self.spot_refused_cooloff_secs)
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
    #[serde(default = "super::default_true")]
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

    /// Resolves the relative paths (the ledger, the catalog, Slurm's
    /// `slurm_conf`, the kubeconfig) against `base`, the config file's
    /// directory.
    pub(super) fn resolve_paths(&mut self, base: &Path) {
        let slurm_conf = self.slurm.as_mut().and_then(|s| s.slurm_conf.as_mut());
        let kubeconfig = self.kubernetes.as_mut().and_then(|k| k.kubeconfig.as_mut());
        for p in [
            Some(&mut self.ledger),
            self.catalog.as_mut(),
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
}
