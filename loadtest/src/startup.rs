//! `tidegate-bench startup`: a worker's time to ready, from process start to
//! registered with a gateway (models loaded, checked, warmed and profiled,
//! the QUIC connection made and the registration accepted), against the same
//! worker's `check-config` (the same loading, warm-up and profiling, then
//! exit, no network) in the same run. The ratio is what dialling in and
//! registering add.
//!
//! The runs alternate between the two, so that a disturbance of the shared
//! machine falls on both; medians are reported.

use std::process::Stdio;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::cluster::{Cluster, ClusterError, ClusterOptions, command, workspace_root};
use crate::median;

/// Most runs of each kind.
pub const MAX_RUNS: usize = 20;

/// How long one worker may take to register (or `check-config` to finish).
const RUN_LIMIT: Duration = Duration::from_secs(120);

/// How often the gateway's worker list is polled while a worker starts.
const POLL: Duration = Duration::from_millis(5);

/// The report.
#[derive(Debug, Clone, Serialize)]
pub struct StartupReport {
    /// The model the workers serve.
    pub model: String,
    /// Runs of each kind.
    pub runs: usize,
    /// Process start → listed in the gateway's `/api/v1/workers`, each run (ms).
    pub registered_ms: Vec<f64>,
    /// Process start → `check-config` exited 0, each run (ms).
    pub check_config_ms: Vec<f64>,
    /// Median of `registered_ms`.
    pub registered_median_ms: f64,
    /// Median of `check_config_ms`.
    pub check_config_median_ms: f64,
    /// `registered_median_ms / check_config_median_ms`.
    pub ratio_registered_over_check_config: f64,
    /// The resolution of `registered_ms` (the poll interval, ms).
    pub poll_ms: f64,
}

/// Why the benchmark could not run. `Debug` shows the message (and a
/// worker's log) as written.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum StartupError {
    /// The local cluster failed.
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    /// A worker did something other than start.
    #[error("worker {name}: {what}")]
    Worker {
        /// The worker.
        name: String,
        /// What happened, with its log.
        what: String,
    },
    /// `runs` out of range.
    #[error("runs must be in 1..={MAX_RUNS}, not {0}")]
    Runs(usize),
}

debug_as_display!(StartupError);

/// Runs `runs` registrations and `runs` `check-config`s of a worker serving
/// `model` from the repository's models/, alternating.
pub fn run(runs: usize, model: &str) -> Result<StartupReport, StartupError> {
    if !(1..=MAX_RUNS).contains(&runs) {
        return Err(StartupError::Runs(runs));
    }
    let names: Vec<String> = (1..=runs).map(|k| format!("worker-{k}")).collect();
    let mut cluster = Cluster::start(&ClusterOptions {
        workers: names.clone(),
        ..ClusterOptions::default()
    })?;
    let models = workspace_root().join("models");
    let mut registered = Vec::with_capacity(runs);
    let mut checked = Vec::with_capacity(runs);
    for (k, name) in names.iter().enumerate() {
        // Odd runs register first, even ones check first.
        if k % 2 == 0 {
            registered.push(time_to_registered(&mut cluster, name, &models, model)?);
            checked.push(time_check_config(&cluster, name, &models, model)?);
        } else {
            checked.push(time_check_config(&cluster, name, &models, model)?);
            registered.push(time_to_registered(&mut cluster, name, &models, model)?);
        }
    }
    let (r, c) = (median(&registered), median(&checked));
    Ok(StartupReport {
        model: model.to_string(),
        runs,
        registered_ms: registered,
        check_config_ms: checked,
        registered_median_ms: r,
        check_config_median_ms: c,
        ratio_registered_over_check_config: r / c,
        poll_ms: POLL.as_secs_f64() * 1e3,
    })
}

/// Starts worker `name` and times it until the gateway lists it; then stops
/// it (SIGTERM) and waits for its exit.
fn time_to_registered(
    cluster: &mut Cluster,
    name: &str,
    models: &std::path::Path,
    model: &str,
) -> Result<f64, StartupError> {
    let start = Instant::now();
    cluster.spawn_worker_serving(name, models, &[model])?;
    let worker_err = |cluster: &Cluster, what: String| StartupError::Worker {
        name: name.to_string(),
        what: format!("{what}; its log:\n{}", cluster.worker_log(name)),
    };
    let elapsed = loop {
        if let Ok((200, body)) = cluster.get("/api/v1/workers")
            && listed(&body, name)
        {
            break start.elapsed();
        }
        if let Some(status) = cluster.worker_exit(name) {
            return Err(worker_err(
                cluster,
                format!("exited ({status}) before registering"),
            ));
        }
        if start.elapsed() > RUN_LIMIT {
            return Err(worker_err(
                cluster,
                format!("not registered within {RUN_LIMIT:?}"),
            ));
        }
        std::thread::sleep(POLL);
    };
    cluster.signal_worker(name, "TERM")?;
    let stop = Instant::now();
    loop {
        match cluster.worker_exit(name) {
            Some(s) if s.success() => break,
            Some(s) => return Err(worker_err(cluster, format!("exited {s} on SIGTERM"))),
            None if stop.elapsed() > RUN_LIMIT => {
                return Err(worker_err(
                    cluster,
                    format!("still running {RUN_LIMIT:?} after SIGTERM"),
                ));
            }
            None => std::thread::sleep(Duration::from_millis(20)),
        }
    }
    Ok(elapsed.as_secs_f64() * 1e3)
}

/// Times `tidegate-worker check-config` on worker `name`'s config.
fn time_check_config(
    cluster: &Cluster,
    name: &str,
    models: &std::path::Path,
    model: &str,
) -> Result<f64, StartupError> {
    let cfg = cluster.worker_config(name, models, &[model])?;
    let start = Instant::now();
    let out = command("tidegate-worker")
        .map_err(ClusterError::from)?
        .arg("--config")
        .arg(&cfg)
        .arg("check-config")
        .env("TIDEGATE_WORKER_TOKEN", cluster.worker_token())
        .stdin(Stdio::null())
        .output()
        .map_err(|e| StartupError::Worker {
            name: name.to_string(),
            what: format!("cannot run check-config: {e}"),
        })?;
    let elapsed = start.elapsed();
    if !out.status.success() {
        return Err(StartupError::Worker {
            name: name.to_string(),
            what: format!(
                "check-config exited {}:\n{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            ),
        });
    }
    Ok(elapsed.as_secs_f64() * 1e3)
}

/// Whether the gateway's `/api/v1/workers` body lists a worker `name`.
fn listed(body: &str, name: &str) -> bool {
    serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|v| {
            v.as_array()
                .map(|a| a.iter().any(|w| w["name"].as_str() == Some(name)))
        })
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_is_listed_only_by_its_own_name() {
        let body = r#"[{"id":1,"name":"worker-1"},{"id":2,"name":"worker-12"}]"#;
        assert!(listed(body, "worker-1"));
        assert!(listed(body, "worker-12"));
        assert!(!listed(body, "worker-2"));
        assert!(!listed("not json", "worker-1"));
        assert!(!listed("{}", "worker-1"));
    }
}
