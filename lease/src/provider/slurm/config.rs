//! `[leasing.slurm]` and what is built from it: the `sbatch` arguments of a
//! lease and its batch script. Pure: nothing here runs a Slurm tool or
//! reads the cluster (the provider checks the partitions at connect).

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::super::{LeaseSpec, MAX_NOTICE_PERIOD_SECS, ProviderError, checked_secs};
use crate::catalog::{InstanceType, Tier};

/// Longest `release_timeout_secs` accepted: an hour.
pub const MAX_RELEASE_TIMEOUT_SECS: f64 = 3600.0;
/// Longest `tool_timeout_secs` accepted: ten minutes.
pub const MAX_TOOL_TIMEOUT_SECS: f64 = 600.0;

/// Configuration of the Slurm provider (`[leasing.slurm]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlurmConfig {
    /// Worker command, as the compute nodes see it (`tidegate-worker`).
    pub command: String,
    /// Its arguments.
    #[serde(default)]
    pub args: Vec<String>,
    /// Extra environment for every worker, e.g. `TIDEGATE_GATEWAY_ADDR`:
    /// the address at which the compute nodes reach this gateway.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// The partition of each tier.
    pub partitions: SlurmPartitions,
    /// Reserved leases run in this reservation (`--reservation`).
    #[serde(default)]
    pub reservation: Option<String>,
    /// `--gres` per catalog instance type; a type not listed gets
    /// `gpu:<its gpus>` (and no `--gres` when it has none).
    #[serde(default)]
    pub gres: BTreeMap<String, String>,
    /// Further `sbatch` options for every job (`--cpus-per-task=8`,
    /// `--mem=32G`, `--time=…`).
    #[serde(default)]
    pub sbatch_args: Vec<String>,
    /// `SLURM_CONF` for the Slurm tools; unset: theirs.
    #[serde(default)]
    pub slurm_conf: Option<PathBuf>,
    /// Folder holding `sbatch`, `squeue`, `scancel`, `scontrol`; unset:
    /// `PATH`.
    #[serde(default)]
    pub bin_dir: Option<PathBuf>,
    /// Where each job writes its output (`--output`, `%j` is the job id);
    /// unset: Slurm's default, `slurm-%j.out` in the gateway's folder.
    #[serde(default)]
    pub output: Option<String>,
    /// Job name prefix; the job of lease 12 is `<job_name>-12`.
    #[serde(default = "default_job_name")]
    pub job_name: String,
    /// How often the jobs are polled (ms).
    #[serde(default = "default_poll_ms")]
    pub poll_interval_ms: u64,
    /// Notice period of a preempted spot job (s); unset: the spot
    /// partition's `GraceTime`.
    #[serde(default)]
    pub notice_period_secs: Option<f64>,
    /// Longest `release` waits for a cancelled job to end (s).
    #[serde(default = "default_release_timeout_secs")]
    pub release_timeout_secs: f64,
    /// Longest one run of a Slurm tool (`sbatch`, `squeue`, `scancel`,
    /// `scontrol`) may take (s); past it the tool is killed and the call
    /// fails, so a hung slurmctld cannot stall the gateway.
    #[serde(default = "default_tool_timeout_secs")]
    pub tool_timeout_secs: f64,
}

/// `[leasing.slurm.partitions]`: where each tier's jobs go.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlurmPartitions {
    /// On-demand leases (a partition nothing preempts).
    pub on_demand: String,
    /// Spot leases: a partition that higher-priority partitions preempt
    /// (`PreemptMode=CANCEL` or `REQUEUE`, with a `GraceTime`); unset: no
    /// spot leases.
    #[serde(default)]
    pub spot: Option<String>,
    /// Reserved leases; unset: the on-demand partition.
    #[serde(default)]
    pub reserved: Option<String>,
}

fn default_job_name() -> String {
    "tidegate".into()
}
fn default_poll_ms() -> u64 {
    1000
}
pub(super) fn default_release_timeout_secs() -> f64 {
    60.0
}
fn default_tool_timeout_secs() -> f64 {
    30.0
}

impl SlurmConfig {
    /// A config running `command args…` with on-demand jobs in `on_demand`.
    pub fn new(command: impl Into<String>, args: &[&str], on_demand: &str) -> SlurmConfig {
        SlurmConfig {
            command: command.into(),
            args: args.iter().map(|s| s.to_string()).collect(),
            env: BTreeMap::new(),
            partitions: SlurmPartitions {
                on_demand: on_demand.into(),
                spot: None,
                reserved: None,
            },
            reservation: None,
            gres: BTreeMap::new(),
            sbatch_args: Vec::new(),
            slurm_conf: None,
            bin_dir: None,
            output: None,
            job_name: default_job_name(),
            poll_interval_ms: default_poll_ms(),
            notice_period_secs: None,
            release_timeout_secs: default_release_timeout_secs(),
            tool_timeout_secs: default_tool_timeout_secs(),
        }
    }

    /// Checks what serde cannot; the message names the field.
    pub fn validate(&self) -> Result<(), String> {
        if self.command.trim().is_empty() {
            return Err("command is empty; name the tidegate-worker binary".into());
        }
        if !(50..=600_000).contains(&self.poll_interval_ms) {
            return Err(format!(
                "poll_interval_ms = {} must be between 50 and 600000",
                self.poll_interval_ms
            ));
        }
        if let Some(n) = self.notice_period_secs {
            checked_secs("notice_period_secs", n, MAX_NOTICE_PERIOD_SECS)?;
        }
        let t = self.release_timeout_secs;
        checked_secs("release_timeout_secs", t, MAX_RELEASE_TIMEOUT_SECS)?;
        if t <= 0.0 {
            return Err(format!("release_timeout_secs = {t} must be > 0"));
        }
        let t = self.tool_timeout_secs;
        checked_secs("tool_timeout_secs", t, MAX_TOOL_TIMEOUT_SECS)?;
        if t <= 0.0 {
            return Err(format!("tool_timeout_secs = {t} must be > 0"));
        }
        let name_ok = |s: &str| {
            !s.is_empty()
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        };
        if !name_ok(&self.job_name) {
            return Err(format!(
                "job_name = {:?} must be letters, digits, '-', '_' or '.'",
                self.job_name
            ));
        }
        let parts = &self.partitions;
        for (field, p) in [
            ("partitions.on_demand", Some(&parts.on_demand)),
            ("partitions.spot", parts.spot.as_ref()),
            ("partitions.reserved", parts.reserved.as_ref()),
        ] {
            if let Some(p) = p
                && !name_ok(p)
            {
                return Err(format!("{field} = {p:?} is not a partition name"));
            }
        }
        Ok(())
    }

    /// The partition for `tier`, or why there is none.
    pub fn partition(&self, tier: Tier) -> Option<&str> {
        match tier {
            Tier::OnDemand => Some(&self.partitions.on_demand),
            Tier::Spot => self.partitions.spot.as_deref(),
            Tier::Reserved => Some(
                self.partitions
                    .reserved
                    .as_deref()
                    .unwrap_or(&self.partitions.on_demand),
            ),
        }
    }

    /// `--gres` for an instance type; `None` for a CPU type.
    pub fn gres_for(&self, instance: &InstanceType) -> Option<String> {
        match self.gres.get(&instance.name) {
            Some(g) => Some(g.clone()),
            None if instance.gpus > 0 => Some(format!("gpu:{}", instance.gpus)),
            None => None,
        }
    }

    /// The `sbatch` arguments for a lease (the script comes on stdin).
    pub fn sbatch_args(&self, spec: &LeaseSpec) -> Result<Vec<String>, ProviderError> {
        let partition = self
            .partition(spec.tier)
            .ok_or_else(|| ProviderError::NoCapacity {
                instance_type: spec.instance.name.clone(),
                tier: spec.tier,
                detail: "no Slurm partition is configured for spot leases \
                         (leasing.slurm.partitions.spot)"
                    .into(),
            })?;
        let mut args = vec![
            "--parsable".to_string(),
            format!("--job-name={}-{}", self.job_name, spec.lease.0),
            format!("--partition={partition}"),
            "--ntasks=1".into(),
            "--export=ALL".into(),
        ];
        if let Some(g) = self.gres_for(&spec.instance) {
            args.push(format!("--gres={g}"));
        }
        if spec.tier == Tier::Reserved
            && let Some(r) = &self.reservation
        {
            args.push(format!("--reservation={r}"));
        }
        if let Some(o) = &self.output {
            args.push(format!("--output={o}"));
        }
        args.extend(self.sbatch_args.iter().cloned());
        Ok(args)
    }

    /// The batch script: the worker as one job step, so that Slurm's
    /// preemption signal reaches it.
    pub fn script(&self) -> String {
        let argv: Vec<String> = std::iter::once(&self.command)
            .chain(&self.args)
            .map(|a| shell_quote(a))
            .collect();
        format!(
            "#!/bin/sh\n# tidegate lease: one worker as one job step\nexec srun --ntasks=1 --kill-on-bad-exit=1 -- {}\n",
            argv.join(" ")
        )
    }
}

/// `s` as one POSIX shell word.
pub fn shell_quote(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:,@%+".contains(c))
    {
        return s.to_string();
    }
    format!("'{}'", s.replace('\'', r"'\''"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::Catalog;
    use crate::table::{LeaseId, LeaseToken};

    fn spec(tier: Tier, instance: &str) -> LeaseSpec {
        LeaseSpec {
            lease: LeaseId(12),
            token: LeaseToken::generate().unwrap(),
            instance: Catalog::default_catalog().get(instance).unwrap().clone(),
            tier,
            preempt_after: None,
        }
    }

    #[test]
    fn sbatch_arguments_follow_the_tier_and_the_instance() {
        let mut cfg = SlurmConfig::new("tidegate-worker", &["--config", "w.toml", "run"], "gpu");
        cfg.partitions.spot = Some("spot".into());
        cfg.reservation = Some("tidegate-rsv".into());
        cfg.output = Some("/var/log/tidegate/%j.out".into());
        cfg.sbatch_args = vec!["--cpus-per-task=8".into()];
        cfg.gres.insert("a100".into(), "gpu:a100:1".into());
        let a = cfg.sbatch_args(&spec(Tier::Spot, "h100")).unwrap();
        assert_eq!(
            a,
            [
                "--parsable",
                "--job-name=tidegate-12",
                "--partition=spot",
                "--ntasks=1",
                "--export=ALL",
                "--gres=gpu:1",
                "--output=/var/log/tidegate/%j.out",
                "--cpus-per-task=8"
            ]
        );
        let r = cfg.sbatch_args(&spec(Tier::Reserved, "a100")).unwrap();
        assert!(r.contains(&"--partition=gpu".to_string()), "{r:?}");
        assert!(r.contains(&"--gres=gpu:a100:1".to_string()), "{r:?}");
        assert!(
            r.contains(&"--reservation=tidegate-rsv".to_string()),
            "{r:?}"
        );
        let cpu = cfg.sbatch_args(&spec(Tier::OnDemand, "cpu-32")).unwrap();
        assert!(!cpu.iter().any(|a| a.starts_with("--gres")), "{cpu:?}");
        cfg.partitions.spot = None;
        match cfg.sbatch_args(&spec(Tier::Spot, "h100")) {
            Err(ProviderError::NoCapacity { detail, .. }) => {
                assert!(detail.contains("partitions.spot"), "{detail}")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_script_runs_the_worker_as_a_quoted_job_step() {
        let cfg = SlurmConfig::new(
            "/opt/tidegate/bin/tidegate-worker",
            &["--config", "it's here.toml"],
            "gpu",
        );
        let s = cfg.script();
        assert!(s.starts_with("#!/bin/sh\n"), "{s}");
        assert!(
            s.contains("exec srun --ntasks=1 --kill-on-bad-exit=1 -- /opt/tidegate/bin/tidegate-worker --config 'it'\\''s here.toml'\n"),
            "{s}"
        );
        assert_eq!(shell_quote(""), "''");
        assert_eq!(shell_quote("$(rm -rf /)"), "'$(rm -rf /)'");
    }

    #[test]
    fn config_errors_name_the_field() {
        let mut cfg = SlurmConfig::new("w", &[], "gpu");
        assert!(cfg.validate().is_ok());
        cfg.partitions.spot = Some("spot partition".into());
        assert!(cfg.validate().unwrap_err().contains("partitions.spot"));
        let mut cfg = SlurmConfig::new("w", &[], "gpu");
        cfg.poll_interval_ms = 10;
        assert!(cfg.validate().unwrap_err().contains("poll_interval_ms"));
        let mut cfg = SlurmConfig::new(" ", &[], "gpu");
        assert!(cfg.validate().unwrap_err().contains("command"));
        // values that would panic a Duration, or wait for ever
        let mut big = SlurmConfig::new("w", &[], "gpu");
        big.notice_period_secs = Some(1e20);
        assert!(big.validate().unwrap_err().contains("notice_period_secs"));
        big.notice_period_secs = Some(30.0);
        for t in [1e20, 0.0, f64::NAN] {
            big.release_timeout_secs = t;
            assert!(
                big.validate().unwrap_err().contains("release_timeout_secs"),
                "{t}"
            );
        }
        cfg.command = "w".into();
        cfg.job_name = "a b".into();
        assert!(cfg.validate().unwrap_err().contains("job_name"));
    }

    #[test]
    fn a_tool_timeout_is_read_from_the_config_file_and_defaults_to_30_s() {
        let file = "command = \"w\"\npartitions = { on_demand = \"gpu\" }\n";
        let cfg: SlurmConfig = toml::from_str(file).unwrap();
        assert_eq!(cfg.tool_timeout_secs, 30.0);
        let cfg: SlurmConfig = toml::from_str(&format!("{file}tool_timeout_secs = 5\n")).unwrap();
        assert_eq!(cfg.tool_timeout_secs, 5.0);
    }
}
