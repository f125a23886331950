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
//! The same goes for the runs before the worker registers: each warm-up
//! run as a session opens and each profiling run
//! ([`Phase::WarmUp`], [`Phase::Profiling`]), recorded in the same
//! [`Activity`] by [`OrtBackend::open_watched`]. A device that wedges in a
//! model's first run would otherwise hang the worker for ever before it
//! ever registers, and only a leased worker's start timeout would end it.
//! Those runs get their own limit, `runtime.warmup_wedged_after_secs`
//! ([`RunTimeouts::start_up`], 300 s by default and never below the batch
//! limit): a model's first run on a GPU creates the CUDA context and, with
//! cuDNN's exhaustive algorithm search, benchmarks every convolution's
//! algorithms, which can legitimately take minutes on a large model, far
//! beyond what a batch may take once serving. Opening a session (reading
//! and optimising the graph, which a slow disk or a large model can make
//! long) is not a run and is not watched.
//!
//! The decision is [`verdict`], a pure function of the running job and the
//! limits; [`watch`] polls it every [`TICK`]; [`spawn`] runs that on a
//! thread of its own for the life of the process, outside tokio, so that it
//! still fires while the runtime drains, shuts down, or is itself stuck.
//! The worker starts it before the first model runs.
//!
//! [`OrtBackend::open_watched`]: crate::backend::OrtBackend::open_watched
//!
//! [`Executor::shutdown`]: crate::executor::Executor::shutdown

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::Duration;

use crate::executor::{Activity, Phase, RunningJob};

/// The worker's exit status when the watchdog ends it: ONNX Runtime or the
/// device is wedged. 1 is a configuration or start-up error, 0 a drain.
pub const EXIT_WEDGED: i32 = 3;

/// How often the watchdog looks at the running job.
pub const TICK: Duration = Duration::from_secs(1);

/// If exiting itself hangs (an exit handler of the CUDA or ONNX Runtime
/// library waiting on the wedged device), the process aborts after this.
const EXIT_GRACE: Duration = Duration::from_secs(10);

/// How long one run may take before the watchdog takes ONNX Runtime or
/// the device for wedged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunTimeouts {
    /// For a batch the gateway sent (`runtime.wedged_after_secs`).
    pub serving: Duration,
    /// For a warm-up or profiling run before the worker registers
    /// (`runtime.warmup_wedged_after_secs`): a model's first runs on a
    /// device may legitimately take far longer than a batch later.
    pub start_up: Duration,
}

impl RunTimeouts {
    /// The limit for a run of `phase`.
    pub fn of(&self, phase: Phase) -> Duration {
        match phase {
            Phase::Serving => self.serving,
            Phase::WarmUp | Phase::Profiling => self.start_up,
        }
    }

    /// The setting that sets the limit for `phase`, as written in the
    /// config.
    pub fn setting(phase: Phase) -> &'static str {
        match phase {
            Phase::Serving => "runtime.wedged_after_secs",
            Phase::WarmUp | Phase::Profiling => "runtime.warmup_wedged_after_secs",
        }
    }
}

/// What the watchdog makes of the backend now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// No job runs, or the one running is within its phase's limit.
    Healthy,
    /// One job has run longer than its phase's limit.
    Wedged(Wedged),
}

/// A job that has run longer than its phase's limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wedged {
    /// The job, with its phase.
    pub job: RunningJob,
    /// The limit it passed: its phase's.
    pub limit: Duration,
}

impl std::fmt::Display for Wedged {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let job = &self.job;
        write!(
            f,
            "a {} of {} frame(s) for model '{}' has run for {:.1} s, longer than {} ({} s): ",
            job.phase,
            job.frames,
            job.model,
            job.running_for.as_secs_f64(),
            RunTimeouts::setting(job.phase),
            self.limit.as_secs_f64(),
        )?;
        if job.phase.is_start_up() {
            write!(
                f,
                "ONNX Runtime or the device is wedged in start-up, before the worker registered (a CUDA fault, a hung driver call); exiting with status {EXIT_WEDGED} so that the supervisor replaces this worker (check the device: dmesg for Xid errors, nvidia-smi; if this model's first runs on this device legitimately take longer, e.g. cuDNN's exhaustive algorithm search on a large model, raise {})",
                RunTimeouts::setting(job.phase),
            )
        } else {
            write!(
                f,
                "ONNX Runtime or the device is wedged (a CUDA fault, a hung driver call); exiting with status {EXIT_WEDGED} so that the supervisor replaces this worker (check the device: dmesg for Xid errors, nvidia-smi)"
            )
        }
    }
}

/// The verdict on `running` (the job the backend runs, `None` when idle):
/// wedged once it has run longer than `limits` allow for its phase.
pub fn verdict(running: Option<RunningJob>, limits: RunTimeouts) -> Verdict {
    match running {
        Some(job) if job.running_for > limits.of(job.phase) => {
            let limit = limits.of(job.phase);
            Verdict::Wedged(Wedged { job, limit })
        }
        _ => Verdict::Healthy,
    }
}

/// Looks at `activity` every `tick` and returns once a job has run longer
/// than `limits` allow for its phase; never while the backend is healthy.
pub fn watch(activity: &Activity, limits: RunTimeouts, tick: Duration) -> Wedged {
    loop {
        if let Verdict::Wedged(wedged) = verdict(activity.running(), limits) {
            return wedged;
        }
        thread::sleep(tick);
    }
}

/// Starts the watchdog on a thread named `tidegate-watchdog`, for the life
/// of the process: when a job (a batch, or a warm-up or profiling run) has
/// run longer than `limits` allow for its phase it logs why and exits with
/// [`EXIT_WEDGED`], without joining the thread running it. The watchdog's
/// thread is never joined; the process ends with it.
pub fn spawn(activity: Arc<Activity>, limits: RunTimeouts) -> std::io::Result<()> {
    thread::Builder::new()
        .name("tidegate-watchdog".into())
        .spawn(move || {
            let wedged = watch(&activity, limits, TICK);
            tracing::error!(
                phase = ?wedged.job.phase,
                model = %wedged.job.model,
                frames = wedged.job.frames,
                running_s = wedged.job.running_for.as_secs(),
                limit_s = wedged.limit.as_secs(),
                "{wedged}"
            );
            exit_wedged();
        })?;
    Ok(())
}

/// Set once the watchdog has decided to end the process.
static EXITING: AtomicBool = AtomicBool::new(false);

/// Whether the watchdog is ending the process with [`EXIT_WEDGED`]. Its
/// `exit` runs the libraries' exit handlers, which can tear down the very
/// run it found wedged (ONNX Runtime's, which then fails, while the process
/// exits): an error that surfaces afterwards is that, not a new fault, and
/// the worker reports it as such rather than as its own failure.
pub fn is_exiting() -> bool {
    EXITING.load(Ordering::SeqCst)
}

/// Exits with [`EXIT_WEDGED`]. `exit` runs the libraries' exit handlers;
/// should one wait on the wedged device, the process aborts after
/// [`EXIT_GRACE`] rather than stay up.
fn exit_wedged() -> ! {
    EXITING.store(true, Ordering::SeqCst);
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

    fn job(phase: Phase, model: &str, frames: usize, secs: f64) -> RunningJob {
        RunningJob {
            phase,
            model: model.into(),
            frames,
            running_for: Duration::from_secs_f64(secs),
        }
    }

    /// The defaults: a minute for a batch, five for a start-up run.
    const LIMITS: RunTimeouts = RunTimeouts {
        serving: Duration::from_secs(60),
        start_up: Duration::from_secs(300),
    };

    #[test]
    fn only_a_job_longer_than_the_limit_is_wedged() {
        let batch = |model, frames, secs| job(Phase::Serving, model, frames, secs);
        assert_eq!(verdict(None, LIMITS), Verdict::Healthy);
        assert_eq!(verdict(Some(batch("m", 8, 0.0)), LIMITS), Verdict::Healthy);
        assert_eq!(verdict(Some(batch("m", 8, 59.9)), LIMITS), Verdict::Healthy);
        assert_eq!(
            verdict(Some(batch("m", 8, 60.0)), LIMITS),
            Verdict::Healthy,
            "at the limit, not past it"
        );
        let Verdict::Wedged(w) = verdict(Some(batch("centernet", 8, 61.5)), LIMITS) else {
            panic!("61.5 s is past a 60 s limit");
        };
        assert_eq!(w.job, batch("centernet", 8, 61.5));
        assert_eq!(w.limit, LIMITS.serving);
        let text = w.to_string();
        for says in [
            "a batch of 8 frame(s) for model 'centernet'",
            "run for 61.5 s",
            "runtime.wedged_after_secs (60 s)",
            "wedged",
            "exiting with status 3",
        ] {
            assert!(text.contains(says), "{says:?} missing from: {text}");
        }
        assert!(!text.contains("start-up"), "{text}");
    }

    #[test]
    fn warm_up_and_profiling_runs_are_held_to_the_start_up_limit_and_say_so() {
        for (phase, what) in [
            (Phase::WarmUp, "a warm-up run of 1 frame(s)"),
            (Phase::Profiling, "a profiling run of 1 frame(s)"),
        ] {
            // Past the batch limit but within the start-up one: a slow
            // first run on the device, not a wedge.
            for secs in [61.0, 300.0] {
                assert_eq!(
                    verdict(Some(job(phase, "blazeface", 1, secs)), LIMITS),
                    Verdict::Healthy,
                    "{phase:?} after {secs} s"
                );
            }
            let Verdict::Wedged(w) = verdict(Some(job(phase, "blazeface", 1, 300.5)), LIMITS)
            else {
                panic!("{phase:?}: 300.5 s is past a 300 s limit");
            };
            assert_eq!(w.limit, LIMITS.start_up);
            assert_eq!(w.job.phase, phase);
            let text = w.to_string();
            for says in [
                what,
                "for model 'blazeface'",
                "run for 300.5 s",
                "longer than runtime.warmup_wedged_after_secs (300 s)",
                "wedged in start-up, before the worker registered",
                "exiting with status 3",
                "raise runtime.warmup_wedged_after_secs",
            ] {
                assert!(text.contains(says), "{says:?} missing from: {text}");
            }
            assert!(!text.contains("runtime.wedged_after_secs"), "{text}");
        }
        // And a start-up limit below the batch one is applied as given.
        let tight = RunTimeouts {
            serving: Duration::from_secs(60),
            start_up: Duration::from_secs(5),
        };
        assert!(matches!(
            verdict(Some(job(Phase::WarmUp, "m", 1, 5.5)), tight),
            Verdict::Wedged(Wedged { limit, .. }) if limit == tight.start_up
        ));
    }

    fn frame() -> FrameInput {
        FrameInput {
            tensor: Tensor::raw(DType::U8, Layout::Nhwc, vec![1, 1, 1, 1], vec![0u8].into()),
            geometry: Geometry::stretch(1, 1, 1, 1),
        }
    }

    #[test]
    fn watch_returns_wedged_for_a_job_that_never_returns() {
        let (exec, answer, release_tx) =
            executor_with_a_held_job("blazeface", vec![frame(), frame()], 2);
        let limits = RunTimeouts {
            serving: Duration::from_millis(50),
            start_up: Duration::from_secs(3600),
        };
        let activity = exec.activity();
        let (verdict_tx, verdict_rx) = mpsc::channel();
        thread::spawn(move || {
            let _ = verdict_tx.send(watch(&activity, limits, Duration::from_millis(5)));
        });
        let wedged = verdict_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the watchdog never found the stuck job wedged");
        assert_eq!(wedged.job.phase, Phase::Serving);
        assert_eq!(wedged.job.model, "blazeface");
        assert_eq!(wedged.job.frames, 2);
        assert!(wedged.job.running_for > limits.serving, "{wedged:?}");
        assert_eq!(wedged.limit, limits.serving);
        // Unwedge it, so that the executor joins its thread.
        release_tx.send(()).unwrap();
        assert_eq!(answer.blocking_recv().unwrap().len(), 2);
        exec.shutdown();
    }

    /// Set in the child processes of the tests below, to the child's name.
    const CHILD: &str = "TIDEGATE_TEST_WEDGED_CHILD";

    /// Whether this process is the child `name`, started by [`run_child`].
    fn is_child(name: &str) -> bool {
        std::env::var_os(CHILD).is_some_and(|c| c == name)
    }

    /// Runs the ignored test `watchdog::tests::NAME` in a child process and
    /// returns how it exited and its stderr. Fails if it has not exited
    /// after a minute.
    fn run_child(name: &str) -> (std::process::ExitStatus, String) {
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                &format!("watchdog::tests::{name}"),
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD, name)
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
                panic!("the wedged child {name} never exited");
            }
            thread::sleep(Duration::from_millis(20));
        };
        let mut stderr = String::new();
        std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
        (status, stderr)
    }

    /// The child: a backend wedged in a job, the watchdog started with a
    /// short limit, and the main thread stuck in `shutdown`'s join.
    #[test]
    #[ignore = "run in a child process by wedged_backend_ends_the_process_with_status_3_even_while_shutdown_joins"]
    fn wedged_child() {
        if !is_child("wedged_child") {
            return;
        }
        tracing_subscriber::fmt()
            .with_writer(std::io::stderr)
            .init();
        // held for good: the sender lives until the process ends
        let (exec, _answer, _release_tx) =
            executor_with_a_held_job("blazeface", vec![frame(); 4], 2);
        let limits = RunTimeouts {
            serving: Duration::from_millis(50),
            start_up: Duration::from_secs(3600),
        };
        spawn(exec.activity(), limits).unwrap();
        // Never returns: the backend thread never ends.
        exec.shutdown();
        eprintln!("shutdown returned");
    }

    #[test]
    fn wedged_backend_ends_the_process_with_status_3_even_while_shutdown_joins() {
        let (status, stderr) = run_child("wedged_child");
        assert_eq!(status.code(), Some(EXIT_WEDGED), "{stderr}");
        assert!(
            stderr.contains("a batch of 4 frame(s) for model 'blazeface'")
                && stderr.contains("runtime.wedged_after_secs")
                && stderr.contains("wedged"),
            "{stderr}"
        );
        assert!(!stderr.contains("shutdown returned"), "{stderr}");
    }

    /// The child: the watchdog started as the worker starts it, before any
    /// model runs, with an hour for a batch and a short start-up limit;
    /// then a profiling run on the main thread that never returns, as on a
    /// device that wedged before the worker registered. No executor exists
    /// yet.
    #[test]
    #[ignore = "run in a child process by wedged_profiling_run_ends_the_process_with_status_3_before_any_executor"]
    fn wedged_start_up_child() {
        if !is_child("wedged_start_up_child") {
            return;
        }
        tracing_subscriber::fmt()
            .with_writer(std::io::stderr)
            .init();
        let activity = Arc::new(Activity::default());
        let limits = RunTimeouts {
            serving: Duration::from_secs(3600),
            start_up: Duration::from_millis(50),
        };
        spawn(activity.clone(), limits).unwrap();
        let _run = activity.record(Phase::Profiling, "centernet", 2);
        // Never returns, like a run on a wedged device.
        let (_never_tx, never_rx) = mpsc::channel::<()>();
        let _ = never_rx.recv();
        eprintln!("the wedged run returned");
    }

    #[test]
    fn wedged_profiling_run_ends_the_process_with_status_3_before_any_executor() {
        let (status, stderr) = run_child("wedged_start_up_child");
        assert_eq!(status.code(), Some(EXIT_WEDGED), "{stderr}");
        for says in [
            "a profiling run of 2 frame(s) for model 'centernet'",
            "longer than runtime.warmup_wedged_after_secs (0.05 s)",
            "wedged in start-up, before the worker registered",
            "exiting with status 3",
        ] {
            assert!(stderr.contains(says), "{says:?} missing from: {stderr}");
        }
        assert!(!stderr.contains("the wedged run returned"), "{stderr}");
    }
}
