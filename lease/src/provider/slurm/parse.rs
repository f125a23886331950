//! What the Slurm tools print, read: `sbatch --parsable` job ids, `squeue`
//! rows and states, `scontrol`'s `GraceTime`, Slurm's UTC times. Pure: text
//! in, values out; it runs no tool and decides nothing about a lease (that
//! is [`super::watch`]).

use serde::{Deserialize, Serialize};

use crate::billing::{Millis, days_from_civil};

/// A Slurm job id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct JobId(pub u64);

impl std::fmt::Display for JobId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Parses `sbatch --parsable` output: `<id>` or `<id>;<cluster>`.
pub fn parse_job_id(stdout: &str) -> Option<JobId> {
    let line = stdout.lines().map(str::trim).find(|l| !l.is_empty())?;
    let id = line.split(';').next()?.trim();
    id.parse().ok().filter(|n| *n > 0).map(JobId)
}

/// A job's state, as `squeue` names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobState {
    /// Waiting for resources (or requeued).
    Pending,
    /// Nodes are booting for it.
    Configuring,
    /// Running.
    Running,
    /// Stopped and held.
    Suspended,
    /// Ending: its processes are being cleaned up.
    Completing,
    /// Ended; the state name (`COMPLETED`, `CANCELLED`, `PREEMPTED`,
    /// `FAILED`, `NODE_FAIL`, `TIMEOUT`, …).
    Ended(String),
}

impl JobState {
    /// Parses an `squeue` `State`: every state not known to be live is an
    /// end, so a Slurm with new end states cannot keep a lease alive.
    pub fn parse(s: &str) -> JobState {
        match s.trim() {
            "PENDING" | "REQUEUED" | "REQUEUE_HOLD" | "REQUEUE_FED" | "RESV_DEL_HOLD" => {
                JobState::Pending
            }
            "CONFIGURING" | "POWER_UP_NODE" | "RESIZING" => JobState::Configuring,
            "RUNNING" | "SIGNALING" | "STAGE_OUT" => JobState::Running,
            "SUSPENDED" | "STOPPED" => JobState::Suspended,
            "COMPLETING" => JobState::Completing,
            other => JobState::Ended(other.to_string()),
        }
    }
}

/// One `squeue` row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobInfo {
    /// The job.
    pub id: JobId,
    /// Its state.
    pub state: JobState,
    /// When Slurm chose to preempt it (ms since epoch).
    pub preempt_time: Option<Millis>,
    /// When it ended, for an ended job (ms since epoch); for a live one
    /// Slurm prints when its time limit runs out, which is not read.
    pub end_time: Option<Millis>,
    /// Slurm's reason (why pending, why it failed).
    pub reason: String,
}

/// The `squeue -O` format [`parse_squeue`] reads, times in UTC.
pub const SQUEUE_FORMAT: &str = "JobID:|,State:|,PreemptTime:|,EndTime:|,Reason:|";

/// Parses `squeue --noheader -O` [`SQUEUE_FORMAT`] output. Lines that do
/// not parse are skipped (and counted in the second value).
pub fn parse_squeue(stdout: &str) -> (Vec<JobInfo>, usize) {
    let mut jobs = Vec::new();
    let mut bad = 0;
    for line in stdout.lines().filter(|l| !l.trim().is_empty()) {
        let mut f = line.split('|');
        let (Some(id), Some(state), Some(preempt), Some(end)) =
            (f.next(), f.next(), f.next(), f.next())
        else {
            bad += 1;
            continue;
        };
        let reason = f.next().unwrap_or("").trim().to_string();
        // array and het jobs print `12_3` / `12+1`; ours are plain
        let Ok(id) = id.trim().parse::<u64>() else {
            bad += 1;
            continue;
        };
        let state = JobState::parse(state);
        let end_time = match state {
            JobState::Ended(_) => parse_utc(end.trim()),
            _ => None,
        };
        jobs.push(JobInfo {
            id: JobId(id),
            state,
            preempt_time: parse_utc(preempt.trim()),
            end_time,
            reason,
        });
    }
    (jobs, bad)
}

/// Parses Slurm's `YYYY-MM-DDTHH:MM:SS` (printed in UTC: the tools run
/// with `TZ=UTC`) to ms since the epoch; `N/A`, `None`, `Unknown` → `None`.
pub fn parse_utc(s: &str) -> Option<Millis> {
    let (date, time) = s.split_once('T')?;
    let mut d = date.split('-').map(|p| p.parse::<i64>());
    let (y, mo, da) = (d.next()?.ok()?, d.next()?.ok()?, d.next()?.ok()?);
    let mut t = time.split(':').map(|p| p.parse::<i64>());
    let (h, mi, se) = (t.next()?.ok()?, t.next()?.ok()?, t.next()?.ok()?);
    if d.next().is_some()
        || t.next().is_some()
        || !(1..=12).contains(&mo)
        || !(1..=31).contains(&da)
        || !(0..24).contains(&h)
        || !(0..60).contains(&mi)
        || !(0..=60).contains(&se)
    {
        return None;
    }
    let days = days_from_civil(y, mo, da);
    let secs = days * 86_400 + h * 3600 + mi * 60 + se;
    u64::try_from(secs).ok().map(|s| s * 1000)
}

/// Parses `GraceTime=<secs>` from `scontrol show partition -o` output.
pub fn parse_grace_secs(stdout: &str) -> Option<u64> {
    stdout
        .split_whitespace()
        .find_map(|kv| kv.strip_prefix("GraceTime="))
        .and_then(|v| v.parse().ok())
}

/// The live jobs in `squeue --format=%i|%j|%T` output: id and name. Jobs
/// already on their way out (`COMPLETING`, or ended) and lines that do not
/// parse are left out.
pub fn parse_stray_jobs(stdout: &str) -> Vec<(JobId, String)> {
    stdout
        .lines()
        .filter_map(|line| {
            let mut f = line.trim().splitn(3, '|');
            let (id, name, state) = (f.next()?, f.next()?, f.next()?);
            let id = id.trim().parse::<u64>().ok()?;
            match JobState::parse(state) {
                JobState::Completing | JobState::Ended(_) => None,
                _ => Some((JobId(id), name.trim().to_string())),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_ids_parse_with_and_without_a_cluster() {
        assert_eq!(parse_job_id("123\n"), Some(JobId(123)));
        assert_eq!(parse_job_id("\n45;gpu-cluster\n"), Some(JobId(45)));
        assert_eq!(parse_job_id(""), None);
        assert_eq!(parse_job_id("Submitted batch job 9"), None);
        assert_eq!(parse_job_id("0"), None);
    }

    #[test]
    fn squeue_rows_parse_and_bad_rows_are_counted() {
        let text = "3|COMPLETED|2026-12-03T03:38:56|2026-12-03T03:39:01|None|\n\
                    4|PENDING|N/A|2026-12-04T03:39:01|Resources|\n\
                    12_3|RUNNING|N/A|N/A|None|\n\
                    5|RUNNING|N/A|\n\
                    garbage\n\n";
        let (jobs, bad) = parse_squeue(text);
        assert_eq!(bad, 2);
        assert_eq!(jobs.len(), 3);
        assert_eq!(jobs[0].id, JobId(3));
        assert_eq!(jobs[0].state, JobState::Ended("COMPLETED".into()));
        assert_eq!(jobs[0].preempt_time, Some(1_796_269_136_000));
        assert_eq!(
            jobs[0].end_time,
            Some(1_796_269_141_000),
            "an ended job's end"
        );
        assert_eq!(jobs[1].state, JobState::Pending);
        assert_eq!(jobs[1].preempt_time, None);
        assert_eq!(jobs[1].end_time, None, "a live job's time limit is no end");
        assert_eq!(jobs[1].reason, "Resources");
        assert_eq!((jobs[2].id, jobs[2].reason.as_str()), (JobId(5), ""));
    }

    #[test]
    fn stray_jobs_are_the_live_rows_of_squeue() {
        let out = "17|tg-3|PENDING\n18|tg-4|RUNNING\n19|tg-5|COMPLETING\n20|tg-6|CANCELLED\nnot a row\n21_2|tg-7|RUNNING\n";
        assert_eq!(
            parse_stray_jobs(out),
            vec![
                (JobId(17), "tg-3".to_string()),
                (JobId(18), "tg-4".to_string())
            ]
        );
        assert!(parse_stray_jobs("").is_empty());
    }

    #[test]
    fn utc_times_parse_like_the_calendar() {
        assert_eq!(parse_utc("1970-01-01T00:00:00"), Some(0));
        assert_eq!(parse_utc("2000-03-01T00:00:00"), Some(951_868_800_000));
        assert_eq!(parse_utc("2024-02-29T23:59:59"), Some(1_709_251_199_000));
        for bad in [
            "N/A",
            "None",
            "Unknown",
            "2024-13-01T00:00:00",
            "2024-01-01T24:00:00",
            "2024-01-01",
            "1969-12-31T23:59:59",
        ] {
            assert_eq!(parse_utc(bad), None, "{bad}");
        }
    }

    #[test]
    fn unknown_states_end_the_lease() {
        assert_eq!(JobState::parse("RUNNING"), JobState::Running);
        assert_eq!(JobState::parse("REQUEUED"), JobState::Pending);
        assert_eq!(
            JobState::parse("NODE_FAIL"),
            JobState::Ended("NODE_FAIL".into())
        );
        assert_eq!(
            JobState::parse("SOMETHING_NEW"),
            JobState::Ended("SOMETHING_NEW".into())
        );
    }

    #[test]
    fn grace_time_is_read_from_scontrol() {
        let out = "PartitionName=spot AllowGroups=ALL GraceTime=120 Hidden=NO PreemptMode=CANCEL";
        assert_eq!(parse_grace_secs(out), Some(120));
        assert_eq!(parse_grace_secs("PartitionName=x"), None);
    }

    fn leap(y: i64) -> bool {
        (y % 4 == 0 && y % 100 != 0) || y % 400 == 0
    }

    fn days_in(y: i64, m: i64) -> i64 {
        match m {
            2 if leap(y) => 29,
            2 => 28,
            4 | 6 | 9 | 11 => 30,
            _ => 31,
        }
    }

    proptest::proptest! {
        #[test]
        fn squeue_parsing_never_panics(text in "\\PC{0,300}") {
            let (jobs, bad) = parse_squeue(&text);
            proptest::prop_assert!(jobs.len() + bad <= text.lines().count());
        }

        /// One second later is 1000 ms later, across every day, month and
        /// year boundary (checked against a plain calendar walk).
        #[test]
        fn the_last_second_of_a_day_is_one_second_before_the_next(
            y in 1970i64..2400, m in 1i64..=12, d_frac in 0.0f64..1.0
        ) {
            let d = 1 + ((days_in(y, m) as f64 * d_frac) as i64).min(days_in(y, m) - 1);
            let last = parse_utc(&format!("{y:04}-{m:02}-{d:02}T23:59:59")).unwrap();
            let (ny, nm, nd) = if d < days_in(y, m) {
                (y, m, d + 1)
            } else if m < 12 {
                (y, m + 1, 1)
            } else {
                (y + 1, 1, 1)
            };
            let next = parse_utc(&format!("{ny:04}-{nm:02}-{nd:02}T00:00:00")).unwrap();
            proptest::prop_assert_eq!(next, last + 1000);
            let midnight = parse_utc(&format!("{y:04}-{m:02}-{d:02}T00:00:00")).unwrap();
            proptest::prop_assert_eq!(midnight % 86_400_000, 0);
        }
    }
}
