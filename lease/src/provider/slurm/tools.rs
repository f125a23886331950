//! Running the Slurm tools (`sbatch`, `squeue`, `scancel`, `scontrol`) with
//! this provider's `SLURM_CONF`, `TZ=UTC` and a deadline on every run: past
//! it the tool is killed and reaped, and the error says which command did
//! not answer within how long (and which setting set that bound). It turns
//! a run into stdout or a [`ProviderError`]; what the answer means for a
//! lease is the caller's, and nothing here holds or watches a job.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use super::super::{ProviderError, checked_secs};
use super::config::{MAX_TOOL_TIMEOUT_SECS, SlurmConfig};
use super::parse::{JobId, JobInfo, SQUEUE_FORMAT, parse_squeue};
use crate::table::LeaseId;

/// Most characters of a failing command's stderr kept in an error.
const STDERR_KEPT: usize = 400;

/// What bounds a tool run, for its timeout error.
pub(super) const TOOL_TIMEOUT: &str = "tool_timeout_secs";

/// The Slurm tools, with this provider's `SLURM_CONF` and `TZ=UTC`, each
/// run bounded by `tool_timeout_secs`.
#[derive(Debug, Clone)]
pub(super) struct Tools {
    pub(super) bin_dir: Option<PathBuf>,
    pub(super) slurm_conf: Option<PathBuf>,
    /// Longest one run of a tool may take.
    pub(super) timeout: Duration,
}

/// A Slurm tool that failed.
pub(super) fn tool_error(lease: Option<LeaseId>, what: String, detail: String) -> ProviderError {
    ProviderError::Slurm {
        lease,
        what,
        detail,
    }
}

/// `d` in seconds, to the millisecond: `30`, `1.5`.
fn secs(d: Duration) -> String {
    format!("{}", (d.as_secs_f64() * 1000.0).round() / 1000.0)
}

/// A tool that did not answer within `limit` (set by `bound`, the
/// setting named in the error) and was killed.
fn timeout_error(
    lease: Option<LeaseId>,
    what: String,
    limit: Duration,
    bound: &str,
) -> ProviderError {
    tool_error(
        lease,
        what,
        format!(
            "did not answer within {} s ({bound}) and was killed; is slurmctld up and answering?",
            secs(limit)
        ),
    )
}

/// Why a tool run failed.
#[derive(Debug)]
pub(super) struct ToolFailure {
    /// The error to return.
    pub(super) error: ProviderError,
    /// The tool did not answer in time and was killed: what it was asked
    /// may have been done all the same.
    pub(super) timed_out: bool,
}

impl From<ProviderError> for ToolFailure {
    fn from(error: ProviderError) -> ToolFailure {
        ToolFailure {
            error,
            timed_out: false,
        }
    }
}

/// All of `pipe`, read on the current task.
async fn read_all(pipe: Option<impl tokio::io::AsyncRead + Unpin>) -> std::io::Result<Vec<u8>> {
    use tokio::io::AsyncReadExt;
    let mut buf = Vec::new();
    if let Some(mut p) = pipe {
        p.read_to_end(&mut buf).await?;
    }
    Ok(buf)
}

impl Tools {
    pub(super) fn new(cfg: &SlurmConfig) -> Result<Tools, ProviderError> {
        let timeout = checked_secs(
            "tool_timeout_secs",
            cfg.tool_timeout_secs,
            MAX_TOOL_TIMEOUT_SECS,
        )
        .map_err(|e| tool_error(None, "leasing.slurm".into(), e))?;
        Ok(Tools {
            bin_dir: cfg.bin_dir.clone(),
            slurm_conf: cfg.slurm_conf.clone(),
            timeout,
        })
    }

    fn program(&self, tool: &str) -> PathBuf {
        match &self.bin_dir {
            Some(d) => d.join(tool),
            None => PathBuf::from(tool),
        }
    }

    fn env(&self) -> Vec<(OsString, OsString)> {
        let mut env = vec![(OsString::from("TZ"), OsString::from("UTC"))];
        if let Some(c) = &self.slurm_conf {
            env.push(("SLURM_CONF".into(), c.clone().into_os_string()));
        }
        env
    }

    /// The stdout of a tool that succeeded, else the error.
    fn check(
        lease: Option<LeaseId>,
        what: String,
        out: std::io::Result<std::process::Output>,
    ) -> Result<String, ProviderError> {
        let out = out.map_err(|e| tool_error(lease, what.clone(), e.to_string()))?;
        if out.status.success() {
            return Ok(String::from_utf8_lossy(&out.stdout).into_owned());
        }
        // some tools (scontrol) say what went wrong on stdout
        let stderr = String::from_utf8_lossy(&out.stderr);
        let stdout = String::from_utf8_lossy(&out.stdout);
        let mut detail = match stderr.trim() {
            "" => stdout.trim().to_string(),
            s => s.to_string(),
        };
        if detail.len() > STDERR_KEPT {
            let cut = (0..=STDERR_KEPT)
                .rev()
                .find(|i| detail.is_char_boundary(*i))
                .unwrap_or(0);
            detail.truncate(cut);
        }
        Err(tool_error(lease, what, format!("{}: {detail}", out.status)))
    }

    /// Runs a tool for at most `tool_timeout_secs`; `stdin` is written to
    /// it; `env` is added.
    pub(super) async fn run(
        &self,
        lease: Option<LeaseId>,
        tool: &str,
        args: &[String],
        stdin: Option<&str>,
        env: &[(String, String)],
    ) -> Result<String, ProviderError> {
        self.run_within(lease, tool, args, stdin, env, self.timeout, TOOL_TIMEOUT)
            .await
            .map_err(|f| f.error)
    }

    /// Runs a tool for at most `limit` (set by `bound`, named in the
    /// error): past it the tool is killed and reaped, and the failure says
    /// it timed out.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn run_within(
        &self,
        lease: Option<LeaseId>,
        tool: &str,
        args: &[String],
        stdin: Option<&str>,
        env: &[(String, String)],
        limit: Duration,
        bound: &str,
    ) -> Result<String, ToolFailure> {
        use tokio::io::AsyncWriteExt;
        let what = format!("{tool} {}", args.join(" "));
        let mut cmd = tokio::process::Command::new(self.program(tool));
        cmd.args(args)
            .envs(self.env())
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(if stdin.is_some() {
                std::process::Stdio::piped()
            } else {
                std::process::Stdio::null()
            })
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            // a run dropped half way (its caller gave up) kills the tool
            .kill_on_drop(true);
        let mut child = cmd
            .spawn()
            .map_err(|e| tool_error(lease, what.clone(), e.to_string()))?;
        let (pipe_in, pipe_out, pipe_err) =
            (child.stdin.take(), child.stdout.take(), child.stderr.take());
        let feed = async move {
            match (stdin, pipe_in) {
                // dropping the pipe after it closes the tool's stdin
                (Some(text), Some(mut pipe)) => pipe.write_all(text.as_bytes()).await,
                _ => Ok(()),
            }
        };
        let talk =
            async { tokio::join!(feed, read_all(pipe_out), read_all(pipe_err), child.wait()) };
        let talked = tokio::time::timeout(limit, talk).await;
        let Ok((fed, stdout, stderr, status)) = talked else {
            // kill it and reap it: no tool left talking to slurmctld, and
            // no zombie (an error is a tool that has exited meanwhile)
            let _ = child.kill().await;
            return Err(ToolFailure {
                error: timeout_error(lease, what, limit, bound),
                timed_out: true,
            });
        };
        let output = status.and_then(|status| {
            Ok(std::process::Output {
                status,
                stdout: stdout?,
                stderr: stderr?,
            })
        });
        let out = Tools::check(lease, what.clone(), output)?;
        // a tool that succeeded without reading all its input did not
        // get what it was asked
        fed.map_err(|e| tool_error(lease, what, format!("writing stdin: {e}")))?;
        Ok(out)
    }

    fn squeue_args(jobs: &[JobId]) -> Vec<String> {
        let ids: Vec<String> = jobs.iter().map(|j| j.to_string()).collect();
        vec![
            "--noheader".into(),
            "--states=all".into(),
            format!("--jobs={}", ids.join(",")),
            format!("--Format={SQUEUE_FORMAT}"),
        ]
    }

    /// `squeue` of `jobs`: the listed ones. Slurm fails the whole call
    /// when none of the ids is known; that is an empty list.
    fn squeue_result(out: Result<String, ProviderError>) -> Result<Vec<JobInfo>, ProviderError> {
        match out {
            Ok(text) => {
                let (jobs, bad) = parse_squeue(&text);
                if bad > 0 {
                    tracing::warn!(bad, "squeue printed lines that do not parse");
                }
                Ok(jobs)
            }
            Err(ProviderError::Slurm { ref detail, .. })
                if detail.contains("Invalid job id specified") =>
            {
                Ok(Vec::new())
            }
            Err(e) => Err(e),
        }
    }

    pub(super) async fn squeue(&self, jobs: &[JobId]) -> Result<Vec<JobInfo>, ProviderError> {
        self.squeue_within(None, jobs, self.timeout, TOOL_TIMEOUT)
            .await
    }

    /// [`Tools::squeue`] for `lease` (when it asks for one lease's job),
    /// for at most `limit` (see [`Tools::run_within`]).
    pub(super) async fn squeue_within(
        &self,
        lease: Option<LeaseId>,
        jobs: &[JobId],
        limit: Duration,
        bound: &str,
    ) -> Result<Vec<JobInfo>, ProviderError> {
        if jobs.is_empty() {
            return Ok(Vec::new());
        }
        let args = Tools::squeue_args(jobs);
        let out = self
            .run_within(lease, "squeue", &args, None, &[], limit, bound)
            .await
            .map_err(|f| f.error);
        Tools::squeue_result(out)
    }
}
