//! The executor: a [`Backend`] on its own thread, fed by a bounded queue.
//!
//! Inference blocks for milliseconds, so it never runs on a tokio worker
//! thread. [`Executor::spawn`] moves the backend onto a dedicated
//! `std::thread`; async code hands it [`Job`]s with [`Executor::try_submit`],
//! which never blocks: a full queue is an immediate
//! [`SubmitError::Overloaded`] (to be answered with `Shed(Overloaded)`), not
//! back-pressure. Each job is answered through a `oneshot`, and runs inside
//! its caller's tracing span. [`Executor::busy_us`] counts the time the
//! backend spends running jobs, measured on its thread (queue wait is not
//! busy time), for the heartbeat's utilization. Its [`Activity`] says which
//! job runs and for how long, set and cleared on the backend thread, so
//! that the [`watchdog`](crate::watchdog) can tell a wedged runtime or
//! device (a job that never returns) from a busy one, and whether every job
//! taken is done ([`Activity::is_idle`]). The same [`Activity`] also
//! records the runs before serving ([`Phase::WarmUp`], [`Phase::Profiling`]:
//! [`Activity::record`]), so that one watchdog, started before the first
//! model runs, guards those too ([`Executor::spawn_with`] takes it over).
//! Dropping the executor (or
//! [`Executor::shutdown`]) finishes the queued jobs and joins the thread;
//! a thread wedged in a job never joins, which the watchdog bounds.

use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use tokio::sync::{Notify, oneshot};

use crate::backend::{Backend, FrameInput, FrameOutcome};
use crate::model::ModelSpec;

/// A batch of frames for one model.
#[derive(Debug)]
pub struct Job {
    /// The model to run.
    pub model: String,
    /// The frames, answered in this order.
    pub frames: Vec<FrameInput>,
    /// The caller's span; the backend runs inside it.
    pub span: tracing::Span,
}

/// A job and where its answer goes.
#[derive(Debug)]
struct Envelope {
    job: Job,
    reply: oneshot::Sender<Vec<FrameOutcome>>,
}

/// A backend running on its own thread.
#[derive(Debug)]
pub struct Executor {
    queue: Option<SyncSender<Envelope>>,
    thread: Option<JoinHandle<()>>,
    models: Vec<ModelSpec>,
    capacity: usize,
    busy_us: Arc<AtomicU64>,
    activity: Arc<Activity>,
}

/// What the backend thread is doing: the job it runs (set when the run
/// starts and cleared when it ends, on that thread) and how many jobs are
/// queued or running. Shared, so that the watchdog reads it without
/// holding the executor.
#[derive(Debug, Default)]
pub struct Activity {
    /// Jobs queued or running: counted at submission, uncounted when the
    /// backend has answered (or skipped) them.
    pending: AtomicUsize,
    /// The job being run, and since when.
    running: Mutex<Option<Current>>,
    /// Woken when `pending` falls to 0.
    idle: Notify,
}

/// The job being run, as recorded on the thread running it.
#[derive(Debug)]
struct Current {
    phase: Phase,
    model: String,
    frames: usize,
    since: Instant,
}

/// What a run of a model is for. The watchdog gives the runs before the
/// worker registers their own limit: a model's first runs on a device
/// (CUDA context, cuDNN's algorithm search) can take far longer than a
/// batch later.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// A batch the gateway sent, run by the executor.
    Serving,
    /// A warm-up run of grey frames, as a session opens.
    WarmUp,
    /// A run of grey frames measuring a batch size's latency, before the
    /// worker registers.
    Profiling,
}

impl Phase {
    /// Whether the run comes before serving (warm-up or profiling).
    pub fn is_start_up(self) -> bool {
        !matches!(self, Phase::Serving)
    }
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Phase::Serving => "batch",
            Phase::WarmUp => "warm-up run",
            Phase::Profiling => "profiling run",
        })
    }
}

/// The job the backend is running, as seen now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunningJob {
    /// What it is for: a batch, or a run at start-up.
    pub phase: Phase,
    /// Its model.
    pub model: String,
    /// Its batch size (frames).
    pub frames: usize,
    /// How long it has been running.
    pub running_for: Duration,
}

/// A run recorded by [`Activity::record`]; dropping it (when the run
/// returns, or unwinds) clears it.
#[derive(Debug)]
#[must_use = "the run is recorded only while this lives"]
pub struct RecordedRun<'a> {
    activity: &'a Activity,
}

impl Drop for RecordedRun<'_> {
    fn drop(&mut self) {
        self.activity.end();
    }
}

impl Activity {
    /// The job the backend is running, if any.
    pub fn running(&self) -> Option<RunningJob> {
        let current = self.running.lock().unwrap_or_else(PoisonError::into_inner);
        current.as_ref().map(|c| RunningJob {
            phase: c.phase,
            model: c.model.clone(),
            frames: c.frames,
            running_for: c.since.elapsed(),
        })
    }

    /// How long the job the backend is running has been running; `None`
    /// when it runs none.
    pub fn running_for(&self) -> Option<Duration> {
        let current = self.running.lock().unwrap_or_else(PoisonError::into_inner);
        current.as_ref().map(|c| c.since.elapsed())
    }

    /// Jobs queued or running.
    pub fn pending(&self) -> usize {
        self.pending.load(Ordering::SeqCst)
    }

    /// Whether every job submitted has been answered (or skipped): none
    /// runs and none waits in the queue.
    pub fn is_idle(&self) -> bool {
        self.pending() == 0
    }

    /// Resolves once the executor is idle ([`Activity::is_idle`]); at once
    /// when it is. Never, while a job is wedged.
    pub async fn idle(&self) {
        loop {
            let woken = self.idle.notified();
            tokio::pin!(woken);
            // Registered before the check, so a wake between the two is not
            // lost.
            woken.as_mut().enable();
            if self.is_idle() {
                return;
            }
            woken.await;
        }
    }

    /// Records a run of `frames` frames of `model`, for `phase`, as the
    /// running job from now until the returned guard is dropped, for the
    /// watchdog to judge. For the runs outside the executor: a session's
    /// warm-up and the profiling before the worker registers, on the thread
    /// that runs them. One run at a time: the executor's own jobs come
    /// after start-up.
    pub fn record(&self, phase: Phase, model: &str, frames: usize) -> RecordedRun<'_> {
        self.start(phase, model, frames, Instant::now());
        RecordedRun { activity: self }
    }

    fn start(&self, phase: Phase, model: &str, frames: usize, since: Instant) {
        *self.running.lock().unwrap_or_else(PoisonError::into_inner) = Some(Current {
            phase,
            model: model.to_string(),
            frames,
            since,
        });
    }

    fn end(&self) {
        *self.running.lock().unwrap_or_else(PoisonError::into_inner) = None;
    }

    /// A job was answered or skipped.
    fn done(&self) {
        if self.pending.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.idle.notify_waiters();
        }
    }
}

impl Executor {
    /// Moves `backend` onto a new thread named `tidegate-backend`, with a
    /// queue of `capacity` jobs (at least 1) in front of it.
    pub fn spawn(backend: Box<dyn Backend + Send>, capacity: usize) -> Executor {
        Executor::spawn_with(backend, capacity, Arc::new(Activity::default()))
    }

    /// [`Executor::spawn`], recording its jobs in `activity`: the one the
    /// backend's warm-up and profiling were recorded in, which a watchdog
    /// has watched since before the first model ran.
    pub fn spawn_with(
        backend: Box<dyn Backend + Send>,
        capacity: usize,
        activity: Arc<Activity>,
    ) -> Executor {
        let capacity = capacity.max(1);
        let models = backend.models().to_vec();
        let (tx, rx) = mpsc::sync_channel::<Envelope>(capacity);
        let busy_us = Arc::new(AtomicU64::new(0));
        let (busy, doing) = (busy_us.clone(), activity.clone());
        let thread = thread::Builder::new()
            .name("tidegate-backend".into())
            .spawn(move || serve(backend, rx, &busy, &doing))
            .expect("the OS refused to start the backend thread");
        Executor {
            queue: Some(tx),
            thread: Some(thread),
            models,
            capacity,
            busy_us,
            activity,
        }
    }

    /// What the backend is doing, to watch from another thread without
    /// keeping the executor alive.
    pub fn activity(&self) -> Arc<Activity> {
        self.activity.clone()
    }

    /// The job the backend is running (model, batch size, for how long);
    /// `None` when it runs none.
    pub fn running(&self) -> Option<RunningJob> {
        self.activity.running()
    }

    /// How long the backend's current job has been running; `None` when it
    /// runs none.
    pub fn running_for(&self) -> Option<Duration> {
        self.activity.running_for()
    }

    /// Whether no job runs and none is queued.
    pub fn is_idle(&self) -> bool {
        self.activity.is_idle()
    }

    /// Resolves once no job runs and none is queued.
    pub async fn idle(&self) {
        self.activity.idle().await
    }

    /// The models the backend serves.
    pub fn models(&self) -> &[ModelSpec] {
        &self.models
    }

    /// The queue's capacity in jobs.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Microseconds the backend has spent running jobs since the executor
    /// started, measured on the backend thread around each run: a job's
    /// wait in the queue is not counted, and neither are two queued jobs
    /// twice, so the growth over an interval divided by its length is the
    /// backend's utilization (0..1).
    pub fn busy_us(&self) -> u64 {
        self.busy_us.load(Ordering::Relaxed)
    }

    /// Queues `job` without blocking. The receiver yields one outcome per
    /// frame, in order. A full queue gives the job back as
    /// [`SubmitError::Overloaded`].
    pub fn try_submit(
        &self,
        job: Job,
    ) -> Result<oneshot::Receiver<Vec<FrameOutcome>>, SubmitError> {
        let (reply, rx) = oneshot::channel();
        let Some(queue) = &self.queue else {
            return Err(SubmitError::Stopped { job });
        };
        // Counted before it is queued, so that the backend never uncounts
        // a job not yet counted.
        self.activity.pending.fetch_add(1, Ordering::SeqCst);
        let unqueued = match queue.try_send(Envelope { job, reply }) {
            Ok(()) => return Ok(rx),
            Err(TrySendError::Full(e)) => SubmitError::Overloaded {
                job: e.job,
                capacity: self.capacity,
            },
            Err(TrySendError::Disconnected(e)) => SubmitError::Stopped { job: e.job },
        };
        self.activity.done();
        Err(unqueued)
    }

    /// Stops taking jobs, finishes the queued ones, and joins the thread.
    /// A thread wedged in a job never joins: the
    /// [`watchdog`](crate::watchdog) ends the process then.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        // Closing the queue ends the thread's loop once it is drained.
        self.queue.take();
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            tracing::error!("backend thread ended by a panic");
        }
    }
}

impl Drop for Executor {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The backend thread: answer jobs until the queue closes and is empty,
/// adding the time each run takes to `busy_us`, and recording in `activity`
/// the job being run.
fn serve(
    mut backend: Box<dyn Backend + Send>,
    rx: mpsc::Receiver<Envelope>,
    busy_us: &AtomicU64,
    activity: &Activity,
) {
    while let Ok(Envelope { job, reply }) = rx.recv() {
        if reply.is_closed() {
            // The caller gave up (deadline passed, connection gone): skip it.
            activity.done();
            continue;
        }
        let _entered = job.span.enter();
        let started = Instant::now();
        activity.start(Phase::Serving, &job.model, job.frames.len(), started);
        let outcomes = catch_unwind(AssertUnwindSafe(|| backend.run(&job.model, &job.frames)))
            .unwrap_or_else(|panic| {
                let reason = format!(
                    "model '{}': the backend panicked: {}",
                    job.model,
                    panic_message(&*panic)
                );
                tracing::error!(%reason, "backend panic; serving on");
                vec![FrameOutcome::failed(reason); job.frames.len()]
            });
        let ran = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
        activity.end();
        busy_us.fetch_add(ran, Ordering::Relaxed);
        // The caller may have gone meanwhile; nothing to do then.
        let _ = reply.send(outcomes);
        activity.done();
    }
}

fn panic_message(panic: &(dyn Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)")
}

/// Why a job was not queued. Each variant gives the job back.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SubmitError {
    /// The queue is full; answer the frames as shed (overloaded).
    #[error(
        "executor queue is full ({capacity} batches waiting for the backend); the batch is shed as overloaded"
    )]
    Overloaded {
        /// The job, unrun.
        job: Job,
        /// The queue's capacity.
        capacity: usize,
    },
    /// The backend thread has stopped.
    #[error("the backend thread has stopped; restart the worker")]
    Stopped {
        /// The job, unrun.
        job: Job,
    },
}

impl SubmitError {
    /// The job that was not queued.
    pub fn into_job(self) -> Job {
        match self {
            SubmitError::Overloaded { job, .. } | SubmitError::Stopped { job } => job,
        }
    }
}

/// Test support shared with the link's and the watchdog's tests.
#[cfg(test)]
pub(crate) mod test_support {
    use std::sync::mpsc::{self, Receiver, Sender};

    use tokio::sync::oneshot;

    use super::{Executor, Job};
    use crate::backend::{Backend, BackendError, FrameInput, FrameOutcome};
    use crate::model::ModelSpec;

    /// Runs each batch only once the test releases it, and says when a run
    /// starts: until then, a wedged runtime.
    pub(crate) struct GatedBackend {
        started: Sender<()>,
        release: Receiver<()>,
    }

    impl Backend for GatedBackend {
        fn models(&self) -> &[ModelSpec] {
            &[]
        }

        fn run(&mut self, _: &str, frames: &[FrameInput]) -> Vec<FrameOutcome> {
            let _ = self.started.send(());
            let _ = self.release.recv();
            vec![FrameOutcome::failed("released"); frames.len()]
        }

        fn profile(&mut self, _: &str, _: &[u16]) -> Result<Vec<(u16, u32)>, BackendError> {
            Ok(Vec::new())
        }
    }

    /// An executor (queue of `capacity`) over a [`GatedBackend`] that runs
    /// nothing yet.
    pub(crate) fn idle_executor(capacity: usize) -> Executor {
        Executor::spawn(
            Box::new(GatedBackend {
                started: mpsc::channel().0,
                release: mpsc::channel().1,
            }),
            capacity,
        )
    }

    /// An executor (queue of `capacity`) whose first job, `frames` of
    /// `model`, is running and held until the returned sender sends (or
    /// is dropped); with its answer.
    pub(crate) fn executor_with_a_held_job(
        model: &str,
        frames: Vec<FrameInput>,
        capacity: usize,
    ) -> (Executor, oneshot::Receiver<Vec<FrameOutcome>>, Sender<()>) {
        let (started_tx, started_rx) = mpsc::channel();
        let (release_tx, release_rx) = mpsc::channel();
        let executor = Executor::spawn(
            Box::new(GatedBackend {
                started: started_tx,
                release: release_rx,
            }),
            capacity,
        );
        let answer = executor
            .try_submit(Job {
                model: model.into(),
                frames,
                span: tracing::Span::none(),
            })
            .unwrap();
        started_rx.recv().unwrap();
        (executor, answer, release_tx)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc::{Receiver, Sender};
    use std::sync::{Arc, Mutex};

    use tidegate_protocol::{DType, Geometry, Layout, Status, Tensor, Timings};

    use super::*;
    use crate::backend::BackendError;

    /// Records the models it ran and the thread it ran on; blocks each run
    /// until the test sends a token on `gate` (when one is given).
    struct FakeBackend {
        ran: Arc<Mutex<Vec<(String, usize, String)>>>,
        gate: Option<Receiver<()>>,
        started: Option<Sender<()>>,
    }

    impl Backend for FakeBackend {
        fn models(&self) -> &[ModelSpec] {
            &[]
        }

        fn run(&mut self, model: &str, frames: &[FrameInput]) -> Vec<FrameOutcome> {
            if let Some(s) = &self.started {
                let _ = s.send(());
            }
            if let Some(g) = &self.gate {
                g.recv().unwrap();
            }
            if model == "boom" {
                panic!("fake backend exploded");
            }
            let thread = thread::current().name().unwrap_or("").to_string();
            self.ran
                .lock()
                .unwrap()
                .push((model.to_string(), frames.len(), thread));
            frames
                .iter()
                .map(|f| FrameOutcome {
                    status: Status::Ok,
                    detections: Vec::new(),
                    timings: Timings {
                        inference_us: f.tensor.data.len() as u32,
                        ..Timings::default()
                    },
                    outputs: Vec::new(),
                })
                .collect()
        }

        fn profile(&mut self, _: &str, _: &[u16]) -> Result<Vec<(u16, u32)>, BackendError> {
            Ok(Vec::new())
        }
    }

    fn frame(len: usize) -> FrameInput {
        FrameInput {
            tensor: Tensor::raw(
                DType::U8,
                Layout::Nhwc,
                vec![1, 1, len as u32, 1],
                vec![0u8; len].into(),
            ),
            geometry: Geometry::stretch(1, 1, 1, 1),
        }
    }

    fn job(model: &str, lens: &[usize]) -> Job {
        Job {
            model: model.into(),
            frames: lens.iter().map(|&l| frame(l)).collect(),
            span: tracing::Span::none(),
        }
    }

    type Ran = Arc<Mutex<Vec<(String, usize, String)>>>;

    /// A backend whose runs each wait for a token on the returned sender,
    /// and which says on the returned receiver when a run starts.
    fn gated_backend() -> (FakeBackend, Ran, Sender<()>, Receiver<()>) {
        let (gate_tx, gate_rx) = mpsc::channel();
        let (started_tx, started_rx) = mpsc::channel();
        let ran = Ran::default();
        let b = FakeBackend {
            ran: ran.clone(),
            gate: Some(gate_rx),
            started: Some(started_tx),
        };
        (b, ran, gate_tx, started_rx)
    }

    fn free_backend() -> (Box<dyn Backend + Send>, Ran) {
        let ran = Ran::default();
        let b = FakeBackend {
            ran: ran.clone(),
            gate: None,
            started: None,
        };
        (Box::new(b), ran)
    }

    #[tokio::test]
    async fn job_is_answered_in_order_on_the_backend_thread() {
        let (backend, ran) = free_backend();
        let exec = Executor::spawn(backend, 4);
        let rx = exec.try_submit(job("m", &[3, 1, 2])).unwrap();
        let out = rx.await.unwrap();
        let lens: Vec<u32> = out.iter().map(|o| o.timings.inference_us).collect();
        assert_eq!(lens, vec![3, 1, 2]);
        let ran = ran.lock().unwrap().clone();
        assert_eq!(
            ran,
            vec![("m".to_string(), 3, "tidegate-backend".to_string())]
        );
    }

    #[test]
    fn full_queue_is_overloaded_immediately_and_gives_the_job_back() {
        let (backend, _ran, gate_tx, started_rx) = gated_backend();
        let exec = Executor::spawn(Box::new(backend), 1);
        // The first job occupies the backend, the second fills the queue.
        let first = exec.try_submit(job("a", &[1])).unwrap();
        started_rx.recv().unwrap();
        let second = exec.try_submit(job("b", &[1])).unwrap();
        let err = exec.try_submit(job("c", &[5, 6])).unwrap_err();
        assert!(
            err.to_string().contains("queue is full (1 batches waiting"),
            "{err}"
        );
        let back = err.into_job();
        assert_eq!((back.model.as_str(), back.frames.len()), ("c", 2));
        gate_tx.send(()).unwrap();
        gate_tx.send(()).unwrap();
        assert_eq!(first.blocking_recv().unwrap().len(), 1);
        assert_eq!(second.blocking_recv().unwrap().len(), 1);
    }

    #[test]
    fn shutdown_finishes_queued_jobs_before_joining() {
        let (backend, ran, gate_tx, started_rx) = gated_backend();
        let exec = Executor::spawn(Box::new(backend), 4);
        let receivers: Vec<_> = ["a", "b", "c"]
            .iter()
            .map(|m| exec.try_submit(job(m, &[1])).unwrap())
            .collect();
        started_rx.recv().unwrap();
        for _ in 0..3 {
            gate_tx.send(()).unwrap();
        }
        exec.shutdown();
        let models: Vec<String> = ran.lock().unwrap().iter().map(|r| r.0.clone()).collect();
        assert_eq!(models, vec!["a", "b", "c"]);
        for rx in receivers {
            assert_eq!(rx.blocking_recv().unwrap()[0].status, Status::Ok);
        }
    }

    #[test]
    fn abandoned_job_is_skipped() {
        let (backend, ran, gate_tx, started_rx) = gated_backend();
        let exec = Executor::spawn(Box::new(backend), 4);
        let first = exec.try_submit(job("kept", &[1])).unwrap();
        started_rx.recv().unwrap();
        drop(exec.try_submit(job("abandoned", &[1])).unwrap());
        let last = exec.try_submit(job("last", &[1])).unwrap();
        gate_tx.send(()).unwrap();
        gate_tx.send(()).unwrap();
        assert!(first.blocking_recv().is_ok() && last.blocking_recv().is_ok());
        let models: Vec<String> = ran.lock().unwrap().iter().map(|r| r.0.clone()).collect();
        assert_eq!(models, vec!["kept", "last"]);
    }

    /// Busy time is the backend's run time: three jobs queued at once are
    /// counted once each, not with their wait in the queue (which would
    /// give 1 + 2 + 3 run lengths), and never more than the time that has
    /// passed.
    #[test]
    fn busy_time_counts_runs_on_the_backend_thread_not_queue_wait() {
        let (backend, _ran, gate_tx, started_rx) = gated_backend();
        let t0 = Instant::now();
        let exec = Executor::spawn(Box::new(backend), 4);
        assert_eq!(exec.busy_us(), 0);
        let receivers: Vec<_> = ["a", "b", "c"]
            .iter()
            .map(|m| exec.try_submit(job(m, &[1])).unwrap())
            .collect();
        // Hold each run for at least 20 ms before letting it finish.
        for _ in 0..3 {
            started_rx.recv().unwrap();
            thread::sleep(std::time::Duration::from_millis(20));
            gate_tx.send(()).unwrap();
        }
        for rx in receivers {
            rx.blocking_recv().unwrap();
        }
        let busy = exec.busy_us();
        let elapsed = u64::try_from(t0.elapsed().as_micros()).unwrap();
        assert!(busy >= 60_000, "busy {busy} µs for three runs of ≥ 20 ms");
        assert!(
            busy <= elapsed,
            "busy {busy} µs is more than the {elapsed} µs that passed"
        );
    }

    /// Bounds a wait that would hang if the behaviour under test were
    /// broken; no assertion depends on how fast anything runs.
    const BOUND: Duration = Duration::from_secs(10);

    /// Whether `fut` is ready when polled once, now.
    async fn ready_now(fut: impl std::future::Future<Output = ()>) -> bool {
        tokio::select! {
            biased;
            _ = fut => true,
            _ = std::future::ready(()) => false,
        }
    }

    #[tokio::test]
    async fn running_job_is_reported_while_it_runs_and_not_before_or_after() {
        let (backend, _ran, gate_tx, started_rx) = gated_backend();
        let exec = Executor::spawn(Box::new(backend), 4);
        assert_eq!(exec.running_for(), None);
        assert_eq!(exec.running(), None);
        assert!(exec.is_idle());
        let rx = exec.try_submit(job("blazeface", &[1, 1, 1])).unwrap();
        assert!(!exec.is_idle(), "a queued job is pending");
        started_rx.recv().unwrap();
        assert!(exec.running_for().is_some());
        let running = exec.running().unwrap();
        assert_eq!(
            (running.phase, running.model.as_str(), running.frames),
            (Phase::Serving, "blazeface", 3)
        );
        assert!(!exec.is_idle());
        // The watchdog reads the same through the shared activity.
        let activity = exec.activity();
        assert_eq!(activity.running().map(|r| r.frames), Some(3));
        gate_tx.send(()).unwrap();
        assert_eq!(rx.await.unwrap().len(), 3);
        assert_eq!(exec.running_for(), None, "cleared before the answer");
        tokio::time::timeout(BOUND, exec.idle())
            .await
            .expect("idle once the job is answered");
        assert!(exec.is_idle() && activity.is_idle());
    }

    #[tokio::test]
    async fn idle_waits_for_the_running_and_queued_jobs_only() {
        let (backend, _ran, gate_tx, started_rx) = gated_backend();
        let exec = Executor::spawn(Box::new(backend), 2);
        assert!(ready_now(exec.idle()).await, "idle at start");
        let first = exec.try_submit(job("a", &[1])).unwrap();
        started_rx.recv().unwrap();
        let second = exec.try_submit(job("b", &[1])).unwrap();
        drop(exec.try_submit(job("abandoned", &[1])).unwrap());
        // Refused jobs are not pending: the queue is full.
        let refused = exec.try_submit(job("c", &[1])).unwrap_err();
        assert!(matches!(refused, SubmitError::Overloaded { .. }));
        assert_eq!(exec.activity().pending(), 3);
        let idle = exec.idle();
        tokio::pin!(idle);
        assert!(!ready_now(&mut idle).await, "a job runs");
        gate_tx.send(()).unwrap();
        first.await.unwrap();
        started_rx.recv().unwrap();
        assert!(!ready_now(&mut idle).await, "the queued job runs now");
        assert_eq!(exec.running().unwrap().model, "b");
        gate_tx.send(()).unwrap();
        second.await.unwrap();
        // The abandoned job is skipped without running, and uncounted.
        tokio::time::timeout(BOUND, idle)
            .await
            .expect("idle once the running and queued jobs are done");
        assert_eq!(exec.activity().pending(), 0);
    }

    #[test]
    fn start_up_run_is_recorded_until_its_guard_drops_and_serving_jobs_follow_in_the_same_activity()
    {
        let activity = Arc::new(Activity::default());
        assert_eq!(activity.running(), None);
        {
            let _run = activity.record(Phase::WarmUp, "blazeface", 1);
            let running = activity.running().unwrap();
            assert_eq!(
                (running.phase, running.model.as_str(), running.frames),
                (Phase::WarmUp, "blazeface", 1)
            );
            assert!(
                activity.is_idle(),
                "a start-up run is no job taken from the gateway"
            );
        }
        assert_eq!(activity.running(), None, "cleared when the guard drops");
        let unwound = catch_unwind(AssertUnwindSafe(|| {
            let _run = activity.record(Phase::Profiling, "centernet", 2);
            panic!("the profiling run failed");
        }));
        assert!(unwound.is_err());
        assert_eq!(activity.running(), None, "cleared when the run unwinds");
        // The executor takes the activity over: the watchdog watching it
        // since start-up sees the batches too.
        let (backend, _ran, gate_tx, started_rx) = gated_backend();
        let exec = Executor::spawn_with(Box::new(backend), 2, activity.clone());
        let rx = exec.try_submit(job("m", &[1, 1])).unwrap();
        started_rx.recv().unwrap();
        assert_eq!(
            activity.running().map(|r| (r.phase, r.frames)),
            Some((Phase::Serving, 2))
        );
        assert!(!activity.is_idle());
        gate_tx.send(()).unwrap();
        assert_eq!(rx.blocking_recv().unwrap().len(), 2);
    }

    #[test]
    fn backend_panic_fails_that_job_and_serving_continues() {
        let (backend, _) = free_backend();
        let exec = Executor::spawn(backend, 2);
        let out = exec
            .try_submit(job("boom", &[1, 1]))
            .unwrap()
            .blocking_recv()
            .unwrap();
        assert_eq!(out.len(), 2);
        let Status::Failed(reason) = &out[0].status else {
            panic!("expected a failure, got {:?}", out[0].status);
        };
        assert!(
            reason.contains("model 'boom'") && reason.contains("fake backend exploded"),
            "{reason}"
        );
        let out = exec
            .try_submit(job("m", &[1]))
            .unwrap()
            .blocking_recv()
            .unwrap();
        assert_eq!(out[0].status, Status::Ok);
    }
}
