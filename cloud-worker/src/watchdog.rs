//! The watchdog: ends the worker when ONNX Runtime or the device is wedged.
//!
//! A CUDA fault (an Xid) or a hung driver call can keep the backend thread
//! in one job forever. Nothing inside the process can get that thread back,
//! and every way out that waits for it (a new registration whose batches
//! queue behind it, a drain, [`Executor::shutdown`]'s join) hangs too. So
//! once a job has run for longer than `runtime.wedged_after_secs` the
//! watchdog logs what was running and exits with [`EXIT_WEDGED`], leaving
//! the thread where it is, and the worker's supervisor (systemd,
//! Kubernetes, Slurm, the gateway's process provider) starts a new one.
//!
//! The decision is [`verdict`], a pure function of the running job and the
//! limit; [`watch`] polls it every [`TICK`]; [`spawn`] runs that on a thread
//! of its own for the life of the process, outside tokio, so that it still
//! fires while the runtime drains, shuts down, or is itself stuck.
//!
//! [`Executor::shutdown`]: crate::executor::Executor::shutdown

use std::sync::Arc;
use std::thread;
use std::time::Duration;

use crate::executor::{Activity, RunningJob};

/// The worker's exit status when the watchdog ends it: ONNX Runtime or the
/// device is wedged. 1 is a configuration or start-up error, 0 a drain.
pub const EXIT_WEDGED: i32 = 3;

/// How often the watchdog looks at the running job.
pub const TICK: Duration = Duration::from_secs(1);

/// If exiting itself hangs (an exit handler of the CUDA or ONNX Runtime
/// library waiting on the wedged device), the process aborts after this.
const EXIT_GRACE: Duration = Duration::from_secs(10);

/// What the watchdog makes of the backend now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// No job runs, or the one running is within the limit.
    Healthy,
    /// One job has run longer than the limit.
    Wedged(Wedged),
}

/// A job that has run longer than the limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wedged {
    /// The job.
    pub job: RunningJob,
    /// The limit it passed.
    pub limit: Duration,
}

impl std::fmt::Display for Wedged {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "a batch of {} frame(s) for model '{}' has run for {:.1} s, longer than runtime.wedged_after_secs ({} s): ONNX Runtime or the device is wedged (a CUDA fault, a hung driver call); exiting with status {EXIT_WEDGED} so that the supervisor replaces this worker (check the device: dmesg for Xid errors, nvidia-smi)",
            self.job.frames,
            self.job.model,
            self.job.running_for.as_secs_f64(),
            self.limit.as_secs_f64(),
        )
    }
}

/// The verdict on `running` (the job the backend runs, `None` when idle):
/// wedged once it has run longer than `limit`.
pub fn verdict(running: Option<RunningJob>, limit: Duration) -> Verdict {
    match running {
        Some(job) if job.running_for > limit => Verdict::Wedged(Wedged { job, limit }),
        _ => Verdict::Healthy,
    }
}

/// Looks at `activity` every `tick` and returns once a job has run longer
/// than `limit`; never while the backend is healthy.
pub fn watch(activity: &Activity, limit: Duration, tick: Duration) -> Wedged {
    loop {
        if let Verdict::Wedged(wedged) = verdict(activity.running(), limit) {
            return wedged;
        }
        thread::sleep(tick);
    }
}

/// Starts the watchdog on a thread named `tidegate-watchdog`, for the life
/// of the process: when a job has run longer than `limit` it logs why and
/// exits with [`EXIT_WEDGED`], without joining the backend thread. The
/// thread is never joined; the process ends with it.
pub fn spawn(activity: Arc<Activity>, limit: Duration) -> std::io::Result<()> {
    thread::Builder::new()
        .name("tidegate-watchdog".into())
        .spawn(move || {
            let wedged = watch(&activity, limit, TICK);
            tracing::error!(
                model = %wedged.job.model,
                frames = wedged.job.frames,
                running_s = wedged.job.running_for.as_secs(),
                limit_s = limit.as_secs(),
                "{wedged}"
            );
            exit_wedged();
        })?;
    Ok(())
}

/// Exits with [`EXIT_WEDGED`]. `exit` runs the libraries' exit handlers;
/// should one wait on the wedged device, the process aborts after
/// [`EXIT_GRACE`] rather than stay up.
fn exit_wedged() -> ! {
    let _ = thread::Builder::new()
        .name("tidegate-exit".into())
        .spawn(|| {
            thread::sleep(EXIT_GRACE);
            eprintln!(
                "tidegate-worker: exiting hung (an exit handler waits on the wedged device); aborting"
            );
            std::process::abort();
        });
    std::process::exit(EXIT_WEDGED)
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;

    use tidegate_protocol::{DType, Geometry, Layout, Tensor};

    use super::*;
    use crate::backend::FrameInput;
    use crate::executor::test_support::executor_with_a_held_job;

    fn job(model: &str, frames: usize, secs: f64) -> RunningJob {
        RunningJob {
            model: model.into(),
            frames,
            running_for: Duration::from_secs_f64(secs),
        }
    }

    #[test]
    fn only_a_job_longer_than_the_limit_is_wedged() {
        let limit = Duration::from_secs(60);
        assert_eq!(verdict(None, limit), Verdict::Healthy);
        assert_eq!(verdict(Some(job("m", 8, 0.0)), limit), Verdict::Healthy);
        assert_eq!(verdict(Some(job("m", 8, 59.9)), limit), Verdict::Healthy);
        assert_eq!(
            verdict(Some(job("m", 8, 60.0)), limit),
            Verdict::Healthy,
            "at the limit, not past it"
        );
        let Verdict::Wedged(w) = verdict(Some(job("centernet", 8, 61.5)), limit) else {
            panic!("61.5 s is past a 60 s limit");
        };
        assert_eq!(w.job, job("centernet", 8, 61.5));
        assert_eq!(w.limit, limit);
        let text = w.to_string();
        for says in [
            "8 frame(s) for model 'centernet'",
            "run for 61.5 s",
            "runtime.wedged_after_secs (60 s)",
            "wedged",
            "exiting with status 3",
        ] {
            assert!(text.contains(says), "{says:?} missing from: {text}");
        }
    }

    fn frame() -> FrameInput {
        FrameInput {
            tensor: Tensor {
                dtype: DType::U8,
                layout: Layout::Nhwc,
                shape: vec![1, 1, 1, 1],
                data: vec![0u8].into(),
            },
            geometry: Geometry::stretch(1, 1, 1, 1),
        }
    }

    #[test]
    fn watch_returns_wedged_for_a_job_that_never_returns() {
        let (exec, answer, release_tx) =
            executor_with_a_held_job("blazeface", vec![frame(), frame()], 2);
        let limit = Duration::from_millis(50);
        let activity = exec.activity();
        let (verdict_tx, verdict_rx) = mpsc::channel();
        thread::spawn(move || {
            let _ = verdict_tx.send(watch(&activity, limit, Duration::from_millis(5)));
        });
        let wedged = verdict_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the watchdog never found the stuck job wedged");
        assert_eq!(wedged.job.model, "blazeface");
        assert_eq!(wedged.job.frames, 2);
        assert!(wedged.job.running_for > limit, "{wedged:?}");
        assert_eq!(wedged.limit, limit);
        // Unwedge it, so that the executor joins its thread.
        release_tx.send(()).unwrap();
        assert_eq!(answer.blocking_recv().unwrap().len(), 2);
        exec.shutdown();
    }

    /// Set in the child process of
    /// `wedged_backend_ends_the_process_with_status_3_even_while_shutdown_joins`.
    const CHILD: &str = "TIDEGATE_TEST_WEDGED_CHILD";

    /// The child: a backend wedged in a job, the watchdog started with a
    /// short limit, and the main thread stuck in `shutdown`'s join.
    #[test]
    #[ignore = "run in a child process by wedged_backend_ends_the_process_with_status_3_even_while_shutdown_joins"]
    fn wedged_child() {
        if std::env::var_os(CHILD).is_none() {
            return;
        }
        tracing_subscriber::fmt()
            .with_writer(std::io::stderr)
            .init();
        // held for good: the sender lives until the process ends
        let (exec, _answer, _release_tx) =
            executor_with_a_held_job("blazeface", vec![frame(); 4], 2);
        spawn(exec.activity(), Duration::from_millis(50)).unwrap();
        // Never returns: the backend thread never ends.
        exec.shutdown();
        eprintln!("shutdown returned");
    }

    #[test]
    fn wedged_backend_ends_the_process_with_status_3_even_while_shutdown_joins() {
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "watchdog::tests::wedged_child",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD, "1")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // Bounds a wait for a child that never exits; no assertion depends
        // on how fast it does.
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if std::time::Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("the wedged child never exited");
            }
            thread::sleep(Duration::from_millis(20));
        };
        let mut stderr = String::new();
        std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
        assert_eq!(status.code(), Some(EXIT_WEDGED), "{stderr}");
        assert!(
            stderr.contains("4 frame(s) for model 'blazeface'")
                && stderr.contains("runtime.wedged_after_secs")
                && stderr.contains("wedged"),
            "{stderr}"
        );
        assert!(!stderr.contains("shutdown returned"), "{stderr}");
    }
}
