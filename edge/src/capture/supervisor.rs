//! A camera that restarts itself: [`SupervisedCapture`] wraps [`Capture`],
//! and when the pipeline fails (an RTSP server goes away, a device is
//! unplugged, a decoder errors) or stalls, it stops it and starts a new one
//! after a jittered exponential backoff. A file source can loop. Each camera
//! has its own supervisor, so one failing camera never holds up another.
//! Starting and stopping a pipeline (which may block: an RTSP server that is
//! slow to answer, a device slow to open) happen on tokio's blocking
//! threads, never on an async worker.

use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::{
    Capture, CaptureError, CaptureOptions, CaptureSpec, CapturedFrame, SourceUri, StreamError,
};
use crate::gate::CameraLimits;
use tidegate_kit::backoff::Backoff;

/// How a supervised camera restarts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SupervisorOptions {
    /// Options of each capture (its `first_seq` is managed here).
    pub capture: CaptureOptions,
    /// Play a `file://` source again from the start when it ends, instead of
    /// ending the camera.
    pub loop_file: bool,
    /// First restart delay; it doubles per failure up to `restart_max`.
    pub restart_base: Duration,
    /// Longest restart delay. The delay starts again from `restart_base`
    /// only once a pipeline has delivered frames for at least this long: a
    /// source that fails right after its first frame is restarted ever more
    /// slowly, not every `restart_base`.
    pub restart_max: Duration,
    /// A pipeline that produces no frame for this long is restarted.
    pub stall_timeout: Duration,
}

impl Default for SupervisorOptions {
    fn default() -> Self {
        SupervisorOptions {
            capture: CaptureOptions::default(),
            loop_file: false,
            restart_base: Duration::from_millis(250),
            restart_max: Duration::from_secs(5),
            stall_timeout: Duration::from_secs(10),
        }
    }
}

/// Why a supervised camera stopped for good.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CameraStopped {
    /// The camera cannot start, and retrying will not help (bad URI, missing
    /// file, missing plugin).
    #[error(transparent)]
    Start(#[from] CaptureError),
    /// A file source played to its end and looping is off.
    #[error(transparent)]
    Ended(StreamError),
}

/// A camera's counters, summed over its restarts.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct CaptureCounters {
    /// Frames the pipelines produced.
    pub seen: u64,
    /// Frames that passed the rate cap and motion gate.
    pub passed: u64,
    /// Frames over the rate cap.
    pub skipped_rate: u64,
    /// Frames the motion gate found static.
    pub skipped_static: u64,
    /// Frames that passed the gate but were evicted unread because the
    /// consumer fell behind.
    pub dropped_queue: u64,
    /// Pipeline restarts (failures, stalls and loops).
    pub restarts: u64,
    /// CameraLimits in force now.
    pub limits: Option<CameraLimits>,
}

impl CaptureCounters {
    /// Adds the counts of a later capture of the same camera (one that
    /// replaced this one); its limits, the later ones, are kept.
    pub fn accumulate(&mut self, later: &CaptureCounters) {
        self.seen += later.seen;
        self.passed += later.passed;
        self.skipped_rate += later.skipped_rate;
        self.skipped_static += later.skipped_static;
        self.dropped_queue += later.dropped_queue;
        self.restarts += later.restarts;
        self.limits = later.limits.or(self.limits);
    }
}

/// A [`Capture`] that restarts on failure. See the module docs.
#[derive(Debug)]
pub struct SupervisedCapture {
    spec: CaptureSpec,
    options: SupervisorOptions,
    is_file: bool,
    limits: CameraLimits,
    current: Option<Capture>,
    /// A pipeline being started on a blocking thread.
    starting: Option<JoinHandle<Result<Capture, CaptureError>>>,
    next_seq: u64,
    restart_at: Option<Instant>,
    backoff: Backoff,
    /// Frames seen by the current capture at `progress_at`.
    progress: (u64, Instant),
    /// When the current capture started.
    started_at: Instant,
    /// Counters of captures already stopped.
    past: CaptureCounters,
}

impl SupervisedCapture {
    /// A supervised camera; the first [`SupervisedCapture::recv`] starts it.
    /// A URI that cannot be parsed is refused here.
    pub fn new(spec: CaptureSpec, options: SupervisorOptions) -> Result<Self, CaptureError> {
        let source: SourceUri = spec.uri.parse().map_err(|source| CaptureError::Uri {
            camera: spec.camera.clone(),
            uri: spec.uri.clone(),
            source,
        })?;
        let limits = CameraLimits {
            max_fps: spec.max_fps,
            motion_threshold: options.capture.motion_threshold,
            keepalive_fps: options.capture.keepalive_fps,
        };
        Ok(SupervisedCapture {
            backoff: Backoff::seeded(options.restart_base, options.restart_max, &spec.camera),
            is_file: matches!(source, SourceUri::File { .. }),
            limits,
            current: None,
            starting: None,
            next_seq: options.capture.first_seq,
            restart_at: None,
            progress: (0, Instant::now()),
            started_at: Instant::now(),
            past: CaptureCounters::default(),
            spec,
            options,
        })
    }

    /// The spec it runs.
    pub fn spec(&self) -> &CaptureSpec {
        &self.spec
    }

    /// Whether a pipeline is running now.
    pub fn is_running(&self) -> bool {
        self.current.is_some()
    }

    /// Changes the rate cap and motion gate, now and after restarts.
    pub fn set_limits(&mut self, limits: CameraLimits) {
        self.limits = limits;
        if let Some(c) = &self.current {
            c.set_limits(limits);
        }
    }

    /// The limits in force.
    pub fn limits(&self) -> CameraLimits {
        self.limits
    }

    /// Counters summed over every capture so far.
    pub fn counters(&self) -> CaptureCounters {
        let mut c = self.past;
        if let Some(cap) = &self.current {
            add(&mut c, cap);
        }
        c.limits = Some(self.limits);
        c
    }

    /// The next frame, restarting the pipeline as often as needed. Returns
    /// an error only when the camera cannot go on (see [`CameraStopped`]).
    /// Cancel-safe: a pending restart, or a start in progress, survives a
    /// dropped `recv`.
    pub async fn recv(&mut self) -> Result<CapturedFrame, CameraStopped> {
        loop {
            if self.current.is_none() {
                let start = match &mut self.starting {
                    Some(start) => start,
                    None => {
                        if let Some(at) = self.restart_at {
                            tokio::time::sleep_until(at).await;
                            self.restart_at = None;
                        }
                        let spec = self.spec.clone();
                        let options = CaptureOptions {
                            first_seq: self.next_seq,
                            ..self.options.capture
                        };
                        self.starting.insert(tokio::task::spawn_blocking(move || {
                            Capture::start_with(spec, options)
                        }))
                    }
                };
                // Awaiting the handle by reference: dropping `recv` here
                // leaves the start running, and the next `recv` picks it up.
                let started = start.await;
                self.starting = None;
                match started {
                    Ok(Ok(c)) => {
                        c.set_limits(self.limits);
                        self.started_at = Instant::now();
                        self.progress = (0, self.started_at);
                        self.current = Some(c);
                    }
                    Ok(Err(e)) if e.retryable() => {
                        self.schedule_restart(&e.to_string());
                        continue;
                    }
                    Ok(Err(e)) => return Err(CameraStopped::Start(e)),
                    Err(e) => {
                        let why = format!(
                            "camera '{}': starting the pipeline for '{}' failed: {e}",
                            self.spec.camera, self.spec.uri
                        );
                        self.schedule_restart(&why);
                        continue;
                    }
                }
            }
            let Some(cap) = self.current.as_ref() else {
                continue;
            };
            let stall_at = self.progress.1 + self.options.stall_timeout;
            tokio::select! {
                r = cap.recv() => match r {
                    Ok(frame) => {
                        self.healthy();
                        return Ok(frame);
                    }
                    Err(e) => {
                        self.retire();
                        match e {
                            StreamError::EndOfStream { .. } if self.is_file && self.options.loop_file => {
                                self.past.restarts += 1;
                                tracing::info!(camera = %self.spec.camera, "file ended; playing it again");
                            }
                            StreamError::EndOfStream { .. } if self.is_file => {
                                return Err(CameraStopped::Ended(e));
                            }
                            e => self.schedule_restart(&e.to_string()),
                        }
                    }
                },
                _ = tokio::time::sleep_until(stall_at) => {
                    let seen = cap.frames_seen();
                    if seen == self.progress.0 {
                        self.retire();
                        let why = format!(
                            "camera '{}': no frame from '{}' for {:?}",
                            self.spec.camera, self.spec.uri, self.options.stall_timeout
                        );
                        self.schedule_restart(&why);
                    } else {
                        self.healthy();
                        self.progress = (seen, Instant::now());
                    }
                }
            }
        }
    }

    /// Stops the camera for good to hand over to a successor (a capture of
    /// the same camera at another input size), and returns what carries
    /// over: the counters summed over every capture so far, with the frames
    /// still queued unread counted in `dropped_queue` (they are dropped
    /// here), and the `seq` the successor starts at
    /// ([`CaptureOptions::first_seq`]), so that `seq` keeps increasing.
    ///
    /// The pipeline is stopped on a blocking thread and awaited, so that
    /// the counters are final. A start still in progress is abandoned as on
    /// drop: it never delivered a frame.
    pub async fn stop(mut self) -> (CaptureCounters, u64) {
        drop(self.starting.take());
        let Some(cap) = self.current.take() else {
            return (self.counters(), self.next_seq);
        };
        let mut before = self.past;
        add(&mut before, &cap);
        let before = (before, cap.next_seq());
        let past = self.past;
        let stopped = tokio::task::spawn_blocking(move || {
            cap.halt();
            let mut c = past;
            add(&mut c, &cap);
            c.dropped_queue += cap.frames_queued();
            (c, cap.next_seq())
        })
        .await;
        let (mut counters, next_seq) = match stopped {
            Ok(done) => done,
            // Stopping panicked: the counters as of the stop are the best
            // there is, and the seq it had reached.
            Err(e) => {
                tracing::warn!(camera = %self.spec.camera, "stopping the capture failed: {e}");
                before
            }
        };
        counters.limits = Some(self.limits);
        (counters, next_seq)
    }

    /// The current pipeline delivers frames: once it has done so for
    /// `restart_max`, the next failure is retried from `restart_base` again.
    fn healthy(&mut self) {
        self.backoff.reset_if_stable(self.started_at.elapsed());
    }

    fn schedule_restart(&mut self, why: &str) {
        self.past.restarts += 1;
        let delay = self.backoff.next_delay();
        tracing::warn!(camera = %self.spec.camera, "{why}; restarting the camera in {delay:?}");
        self.restart_at = Some(Instant::now() + delay);
    }

    /// Stops the current capture, keeping its counters and sequence.
    fn retire(&mut self) {
        if let Some(cap) = self.current.take() {
            add(&mut self.past, &cap);
            self.next_seq = cap.next_seq();
            stop_off_thread(cap);
        }
    }
}

fn add(c: &mut CaptureCounters, cap: &Capture) {
    let g = cap.gate_counts();
    c.seen += cap.frames_seen();
    c.passed += g.sent;
    c.skipped_rate += g.skipped_rate;
    c.skipped_static += g.skipped_static;
    c.dropped_queue += cap.frames_dropped();
}

/// Stopping a pipeline joins its streaming threads, and an RTSP source may
/// take a moment to tear down: keep that off the async worker threads.
fn stop_off_thread(cap: Capture) {
    match tokio::runtime::Handle::try_current() {
        Ok(handle) => {
            handle.spawn_blocking(move || drop(cap));
        }
        Err(_) => drop(cap),
    }
}

impl Drop for SupervisedCapture {
    fn drop(&mut self) {
        if let Some(cap) = self.current.take() {
            stop_off_thread(cap);
        }
        // A start still in progress finishes on its blocking thread, and the
        // capture it returns is dropped (stopped) there, unread.
        drop(self.starting.take());
    }
}
