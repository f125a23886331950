//! What serde cannot check in `[leasing]`: the policy, the catalog and every
//! instance type named, the provider's section, the models and the numbers.
//! Pure: it reads the catalog file, and starts no provider.

use super::{LeasingConfig, MAX_LEASING_SECS, MAX_SPEND_CAP_PER_HOUR, OnStop, ProviderKind};
use crate::config::ConfigError;

impl LeasingConfig {
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
            ("renew_horizon_secs", self.renew_horizon_secs),
            ("spot_refused_cooloff_secs", self.spot_refused_cooloff_secs),
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
        if let Some(m) = self.hedge_margin
            && !(0.0..=10.0).contains(&m)
        {
            return bad(format!("leasing.hedge_margin = {m} must be in [0, 10]"));
        }
        if let Some(m) = self.spot_fallback_min_share
            && !(0.0..=1.0).contains(&m)
        {
            return bad(format!(
                "leasing.spot_fallback_min_share = {m} must be in [0, 1]"
            ));
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
