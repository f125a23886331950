//! One camera's task, for the life of the edge: its entry checked
//! ([`preflight`]), the camera opened on every new connection, its capture
//! (replaced when the model's input changes), the gateway's hints and the
//! adaptation applied to its gate, and each frame encoded and handed to its
//! lane on the live connection, or dropped and counted during an outage.
//! A frame goes from here to [`Lane::send`], and on to the gateway; its
//! result comes back to the node's loop, not here. It never waits for a
//! connection with a frame in hand: a frame is never sent late.

use std::ops::ControlFlow;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tidegate_protocol::{CameraAccepted, DType, Frame, InputSpec, Layout};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use super::link::HintBoard;
use super::sleep_until_opt;
use super::stats::CameraStats;
use crate::capture::{
    CameraStopped, CaptureCounters, CaptureOptions, CaptureSpec, CapturedFrame, SourceUri,
    SupervisedCapture, SupervisorOptions,
};
use crate::config::{CameraConfig, ConfigError};
use crate::gate::CameraLimits;
use crate::outbound::Outbound;
use crate::uplink::{Lane, Unanswered, Uplink, UplinkError};

/// How long a finished camera waits for its frames in flight to settle.
const SETTLE: Duration = Duration::from_secs(5);

/// The configured limits of a camera.
fn configured_limits(cam: &CameraConfig) -> CameraLimits {
    CameraLimits {
        max_fps: cam.max_fps,
        motion_threshold: cam.motion_threshold,
        keepalive_fps: cam.keepalive_fps,
    }
}

/// Why a camera entry cannot run, found before the gateway is reached.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PreflightError {
    /// The entry itself is wrong (no model, no uri, a value out of range).
    #[error(transparent)]
    Entry(#[from] ConfigError),
    /// The URI cannot be used (unknown scheme, no host, not an absolute
    /// path).
    #[error("camera '{camera}': cannot use source URI '{uri}': {source}")]
    Uri {
        /// The camera.
        camera: String,
        /// The URI as configured.
        uri: String,
        /// What is wrong with it.
        source: crate::capture::UriError,
    },
    /// The local file of a `file://` or `image://` URI is not a regular
    /// file.
    #[error("camera '{camera}': '{}' from URI '{uri}' is not a regular file", path.display())]
    NotAFile {
        /// The camera.
        camera: String,
        /// The URI as configured.
        uri: String,
        /// The path it names.
        path: std::path::PathBuf,
    },
    /// The local file of a `file://` or `image://` URI cannot be read.
    #[error(
        "camera '{camera}': cannot open '{}' from URI '{uri}': {source}; check that the file exists and is readable",
        path.display()
    )]
    Unreadable {
        /// The camera.
        camera: String,
        /// The URI as configured.
        uri: String,
        /// The path it names.
        path: std::path::PathBuf,
        /// Why it cannot be read.
        source: std::io::Error,
    },
}

/// Checks what can be checked of a camera entry before the gateway is
/// reached: the entry, the URI, and that a local file exists. `run` disables
/// a camera that fails it; `check-config` reports it.
pub fn preflight(cam: &CameraConfig) -> Result<(), PreflightError> {
    cam.validate()?;
    let source: SourceUri = cam.uri.parse().map_err(|source| PreflightError::Uri {
        camera: cam.name.clone(),
        uri: cam.uri.clone(),
        source,
    })?;
    match source {
        SourceUri::File { path, .. } | SourceUri::Image { path } => {
            match std::fs::metadata(&path) {
                Ok(m) if m.is_file() => Ok(()),
                Ok(_) => Err(PreflightError::NotAFile {
                    camera: cam.name.clone(),
                    uri: cam.uri.clone(),
                    path,
                }),
                Err(source) => Err(PreflightError::Unreadable {
                    camera: cam.name.clone(),
                    uri: cam.uri.clone(),
                    path,
                    source,
                }),
            }
        }
        _ => Ok(()),
    }
}

/// A camera's capture, and what the captures it replaced left behind. A
/// gateway that announces another input on a new connection gets a new
/// capture, which goes on from the old one: its `seq` continues, and the
/// camera's counters keep counting up.
#[derive(Debug, Default)]
struct CameraCapture {
    current: Option<SupervisedCapture>,
    /// Counters of the captures stopped so far, summed.
    stopped: CaptureCounters,
    /// The `seq` the next capture starts at.
    next_seq: u64,
}

impl CameraCapture {
    /// The camera's counters, over every capture it has had.
    fn counters(&self) -> CaptureCounters {
        let mut c = self.stopped;
        if let Some(current) = &self.current {
            c.accumulate(&current.counters());
        }
        c
    }

    /// Stops the current capture, if any, keeping its counters (frames it
    /// still queued count as `dropped_queue`) and where its `seq` got to.
    async fn stop(&mut self) {
        if let Some(old) = self.current.take() {
            let (counters, next_seq) = old.stop().await;
            self.stopped.accumulate(&counters);
            self.next_seq = next_seq;
        }
    }

    /// Replaces the capture with `start(first_seq)`.
    async fn replace<E>(
        &mut self,
        start: impl FnOnce(u64) -> Result<SupervisedCapture, E>,
    ) -> Result<(), E> {
        self.stop().await;
        self.current = Some(start(self.next_seq)?);
        Ok(())
    }

    fn set_limits(&mut self, limits: CameraLimits) {
        if let Some(c) = &mut self.current {
            c.set_limits(limits);
        }
    }

    /// The next frame; pending for ever without a capture.
    async fn recv(&mut self) -> Result<crate::capture::CapturedFrame, CameraStopped> {
        match &mut self.current {
            Some(c) => c.recv().await,
            None => std::future::pending().await,
        }
    }
}

/// One camera, for the life of the edge: checks its entry, then turns
/// ([`CameraTask::turn`]) until the edge stops, the camera stops, or it has
/// handed `max_frames` frames, and settles what it sent.
pub(super) async fn camera(
    cam: CameraConfig,
    link_rx: watch::Receiver<Option<Uplink>>,
    hints_rx: watch::Receiver<HintBoard>,
    stats: Arc<CameraStats>,
    unanswered: Arc<Unanswered>,
    cancel: CancellationToken,
    max_frames: Option<u64>,
) {
    if let Err(e) = preflight(&cam) {
        error!("{e}; this camera is disabled, the others run");
        stats.set_state("failed");
        return;
    }
    let mut task = CameraTask::new(cam, link_rx, hints_rx, stats, unanswered);
    while max_frames.is_none_or(|m| task.handed < m) {
        if task.turn(&cancel).await.is_break() {
            break;
        }
    }
    task.finish().await;
}

/// One camera's task: where its frames come from (its capture), where
/// they go (its lane on the live connection), and the limits in force.
struct CameraTask {
    cam: CameraConfig,
    link_rx: watch::Receiver<Option<Uplink>>,
    hints_rx: watch::Receiver<HintBoard>,
    stats: Arc<CameraStats>,
    unanswered: Arc<Unanswered>,
    /// The limits configured; with the gateway's hint (`hinted`); then with
    /// the adaptation's cap too (`limits`, what the capture applies).
    configured: CameraLimits,
    hinted: CameraLimits,
    limits: CameraLimits,
    outbound: Outbound,
    capture: CameraCapture,
    /// The model's input, as the gateway last announced it.
    input: Option<InputSpec>,
    /// Where frames go: `None` while the camera is not open on a
    /// connection.
    lane: Option<Lane>,
    /// The connection the camera should be opened on, and when to try.
    open_on: Option<Uplink>,
    open_at: Option<Instant>,
    /// Frames handed to the uplink.
    handed: u64,
    /// Counters refreshed, and the camera fitted to its uplink, once a
    /// window.
    refresh: tokio::time::Interval,
}

impl CameraTask {
    fn new(
        cam: CameraConfig,
        mut link_rx: watch::Receiver<Option<Uplink>>,
        mut hints_rx: watch::Receiver<HintBoard>,
        stats: Arc<CameraStats>,
        unanswered: Arc<Unanswered>,
    ) -> Self {
        let configured = configured_limits(&cam);
        let outbound = Outbound::new(&cam);
        let hinted = configured.under_gateway(hints_rx.borrow_and_update().for_camera(&cam.name));
        let limits = hinted.with_rate_cap(outbound.max_fps());
        {
            let mut snap = stats.snapshot();
            snap.limits = Some(limits);
            snap.outbound = Some(outbound.report());
        }
        stats.set_state("waiting");
        let open_on = link_rx.borrow_and_update().clone();
        let mut refresh = tokio::time::interval(crate::outbound::WINDOW);
        refresh.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        CameraTask {
            cam,
            link_rx,
            hints_rx,
            stats,
            unanswered,
            configured,
            hinted,
            limits,
            outbound,
            capture: CameraCapture::default(),
            input: None,
            lane: None,
            open_on,
            open_at: Some(Instant::now()),
            handed: 0,
            refresh,
        }
    }

    /// Waits for the next thing to do and does it; `Break` stops the
    /// camera.
    async fn turn(&mut self, cancel: &CancellationToken) -> ControlFlow<()> {
        tokio::select! {
            biased;
            _ = cancel.cancelled() => ControlFlow::Break(()),
            changed = self.link_rx.changed() => {
                if changed.is_err() {
                    return ControlFlow::Break(());
                }
                self.on_link_changed();
                ControlFlow::Continue(())
            }
            _ = self.hints_rx.changed() => {
                self.on_hint();
                ControlFlow::Continue(())
            }
            _ = sleep_until_opt(self.open_at), if self.open_on.is_some() => self.open(cancel).await,
            _ = self.refresh.tick() => {
                self.on_window();
                ControlFlow::Continue(())
            }
            frame = self.capture.recv() => match frame {
                Ok(frame) => {
                    self.send(frame).await;
                    ControlFlow::Continue(())
                }
                Err(e) => {
                    self.on_capture_stopped(e).await;
                    ControlFlow::Break(())
                }
            },
        }
    }

    /// A new connection (open the camera on it at once), or none: frames
    /// are dropped until the camera is open again.
    fn on_link_changed(&mut self) {
        self.lane = None;
        self.open_on = self.link_rx.borrow_and_update().clone();
        self.open_at = self.open_on.as_ref().map(|_| Instant::now());
        if self.open_on.is_none() {
            self.stats.set_state("waiting");
        }
    }

    /// The gateway's hints changed: the limits follow the latest.
    fn on_hint(&mut self) {
        let hint = self.hints_rx.borrow_and_update().for_camera(&self.cam.name);
        self.hinted = self.configured.under_gateway(hint);
        if let Some(was) = self.refit_limits() {
            info!(
                max_fps = self.limits.max_fps,
                motion_threshold = self.limits.motion_threshold,
                was_max_fps = was.max_fps,
                was_motion_threshold = was.motion_threshold,
                "limits changed by the gateway's hint"
            );
            let mut snap = self.stats.snapshot();
            // Counters as of the change, so that a reader sees the new
            // limits with the counts they start from.
            snap.capture = self.capture.counters();
            snap.limits = Some(self.limits);
        }
    }

    /// Puts in force the hinted limits under the adaptation's cap; returns
    /// the limits they replace, if they changed.
    fn refit_limits(&mut self) -> Option<CameraLimits> {
        let now = self.hinted.with_rate_cap(self.outbound.max_fps());
        if now == self.limits {
            return None;
        }
        let was = std::mem::replace(&mut self.limits, now);
        self.capture.set_limits(now);
        Some(was)
    }

    /// Opens the camera on the connection it waits for (`open_on`). A
    /// refusal that may pass is tried again; one that cannot, or a model
    /// this edge cannot feed, stops the camera (`Break`).
    async fn open(&mut self, cancel: &CancellationToken) -> ControlFlow<()> {
        self.open_at = None;
        let Some(uplink) = self.open_on.clone() else {
            return ControlFlow::Continue(());
        };
        let opened = tokio::select! {
            _ = cancel.cancelled() => return ControlFlow::Break(()),
            r = uplink.open_camera_with(tidegate_protocol::CameraOpen {
                camera: self.cam.name.clone(),
                model: self.cam.model.clone(),
                budget_ms: self.cam.budget_ms,
                encoding: self.outbound.asked(),
                copies: self.cam.copies.asked(),
            }) => r,
        };
        match opened {
            Ok(accepted) => self.on_accepted(&uplink, accepted).await,
            Err(e) if e.retryable() => {
                self.on_open_failed(&uplink, &e);
                ControlFlow::Continue(())
            }
            Err(e) => {
                error!("cannot open camera: {e}; this camera is disabled, the others run");
                self.stats.set_state("failed");
                ControlFlow::Break(())
            }
        }
    }

    /// The gateway accepted the camera on `uplink`: capture at the model's
    /// input, encode as accepted, and send through a fresh lane.
    async fn on_accepted(&mut self, uplink: &Uplink, accepted: CameraAccepted) -> ControlFlow<()> {
        let spec = accepted.input;
        self.stats.snapshot().labels = Arc::new(accepted.labels);
        if spec.dtype != DType::U8 || spec.layout != Layout::Nhwc || spec.channels != 3 {
            error!(
                "model '{}' wants {} {} with {} channels; this edge produces u8 nhwc RGB; this camera is disabled",
                self.cam.model, spec.dtype, spec.layout, spec.channels
            );
            self.stats.set_state("failed");
            return ControlFlow::Break(());
        }
        self.capture_at(spec).await?;
        let (width, height) = (spec.width, spec.height);
        if let Err(e) = self
            .outbound
            .open(&self.cam, accepted.encoding, accepted.copies, width, height)
            .await
        {
            error!("{e}; this camera is disabled, the others run");
            self.stats.set_state("failed");
            return ControlFlow::Break(());
        }
        // The adaptation starts afresh on every connection
        // (`Outbound::open`): its cap in force goes with it, or a cap
        // learned in an outage would hold the camera down while the fresh
        // policy, already at its top, has nothing to raise.
        if self.refit_limits().is_some() {
            self.stats.snapshot().limits = Some(self.limits);
        }
        self.stats.snapshot().outbound = Some(self.outbound.report());
        info!(width, height, encoding = %accepted.encoding, "camera open");
        let lane = uplink
            .lane_with(
                &self.cam.name,
                self.cam.max_in_flight,
                self.stats.lane.clone(),
                Some(self.unanswered.clone()),
            )
            .with_copies(accepted.copies);
        lane.set_copies(self.outbound.copies());
        self.lane = Some(lane);
        self.stats.set_state("running");
        ControlFlow::Continue(())
    }

    /// Captures at the model's input `spec`: a new capture unless the
    /// current one already produces it. Frames go on from the old
    /// capture's `seq`; its counters stay in the camera's. A capture that
    /// cannot start stops the camera (`Break`).
    async fn capture_at(&mut self, spec: InputSpec) -> ControlFlow<()> {
        let same = self.input.as_ref().is_some_and(|i| {
            (i.width, i.height, i.resize) == (spec.width, spec.height, spec.resize)
        });
        if same {
            return ControlFlow::Continue(());
        }
        let (cam, limits) = (&self.cam, self.limits);
        let started = self
            .capture
            .replace(|first_seq| start_capture(cam, &spec, limits, first_seq))
            .await;
        self.stats.snapshot().capture = self.capture.counters();
        if let Err(e) = started {
            error!("{e}; this camera is disabled, the others run");
            self.stats.set_state("failed");
            return ControlFlow::Break(());
        }
        self.input = Some(spec);
        ControlFlow::Continue(())
    }

    /// Opening the camera failed in a way that may pass: wait for the next
    /// connection if this one is gone, or try again in a second.
    fn on_open_failed(&mut self, uplink: &Uplink, e: &UplinkError) {
        if uplink.is_closed() {
            // the link logs the connection's loss once
            debug!("{e}; opening the camera again once the gateway is redialled");
            self.open_on = None;
            self.stats.set_state("waiting");
            return;
        }
        let first = match e {
            UplinkError::Refused { code, .. } => uplink.first_refusal(*code, &self.cam.model),
            _ => true,
        };
        if first {
            warn!(
                "{e}; retrying in 1 s (cameras of model {} refused alike on this connection retry quietly)",
                self.cam.model
            );
        } else {
            debug!("{e}; retrying in 1 s");
        }
        self.open_at = Some(Instant::now() + Duration::from_secs(1));
    }

    /// A window has passed: fits the camera to its uplink and refreshes the
    /// counters.
    fn on_window(&mut self) {
        // The window counts whatever the connection; the policy decides
        // only while the camera is open on one.
        let open = self.lane.as_ref().and(self.open_on.as_ref());
        let decided = self.outbound.on_window(
            crate::clock::now_us(),
            &self.stats.lane,
            self.stats.result_counts(),
            open.map(Uplink::path_stats),
        );
        // One bottleneck: the other cameras on it back off too.
        if let (Some(queued), Some(uplink)) = (self.outbound.uplink_report(), open) {
            uplink.report_pressed(queued);
        }
        if let (true, Some(uplink)) = (self.outbound.pressed(), open) {
            uplink.report_slow_start_over();
        }
        if let Some(lane) = &self.lane {
            lane.set_copies(self.outbound.copies());
        }
        let refitted = decided.is_some() && self.refit_limits().is_some();
        let mut snap = self.stats.snapshot();
        if refitted {
            snap.limits = Some(self.limits);
        }
        snap.capture = self.capture.counters();
        snap.outbound = Some(self.outbound.report());
    }

    /// Encodes a captured frame and hands it to the lane; without a lane
    /// (no connection, or the camera not open on it) it is dropped and
    /// counted.
    async fn send(&mut self, frame: CapturedFrame) {
        {
            let mut snap = self.stats.snapshot();
            snap.capture = self.capture.counters();
            snap.outbound = Some(self.outbound.report());
        }
        let Some(l) = &self.lane else {
            self.stats.dropped_outage.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let Some(spec) = &self.input else { return };
        // The whole budget travels, counted from capture: the gateway
        // knows how long the frame waited on the way.
        let budget_us = self.cam.budget_ms as u64 * 1000;
        let left_us =
            budget_us.saturating_sub(crate::clock::now_us().saturating_sub(frame.captured_at_us));
        let deadline = Instant::now() + Duration::from_micros(left_us);
        // Encoded as the gateway accepted; a frame the encoder fails is
        // dropped alone (counted and logged there).
        let Some(tensor) = self.outbound.tensor(frame.data, spec.frame_shape()).await else {
            return;
        };
        let bytes = tensor.data.len();
        let msg = Frame {
            camera: self.cam.name.clone(),
            seq: frame.seq,
            captured_at_us: frame.captured_at_us,
            budget_us: budget_us.min(u32::MAX as u64) as u32,
            model: self.cam.model.clone(),
            geometry: frame.geometry,
            tensor,
        };
        match l.send(msg, deadline).await {
            Ok(()) => {
                self.handed += 1;
                self.stats.handed.fetch_add(1, Ordering::Relaxed);
                self.outbound.handed(bytes);
            }
            Err(e) => {
                if matches!(e, UplinkError::Lost(_)) {
                    // the link logs the connection's loss once
                    debug!("sending a frame: {e}; dropping frames until the camera is open again");
                } else {
                    warn!("sending a frame: {e}; dropping frames until the camera is open again");
                }
                self.stats.dropped_outage.fetch_add(1, Ordering::Relaxed);
                self.lane = None;
            }
        }
    }

    /// The capture stopped for good: a file played to its end, or a
    /// failure.
    async fn on_capture_stopped(&mut self, e: CameraStopped) {
        match &e {
            CameraStopped::Ended(_) => {
                info!("{e}");
                self.stats.set_state("stopped");
            }
            _ => {
                error!("{e}; this camera is disabled, the others run");
                self.stats.set_state("failed");
            }
        }
        self.capture.stop().await;
        self.stats.snapshot().capture = self.capture.counters();
    }

    /// Waits (at most [`SETTLE`]) for the frames in flight to settle, and
    /// leaves the final counters.
    async fn finish(mut self) {
        if let Some(l) = &self.lane {
            l.settle(SETTLE).await;
        }
        self.outbound.on_window(
            crate::clock::now_us(),
            &self.stats.lane,
            self.stats.result_counts(),
            None,
        );
        self.stats.snapshot().outbound = Some(self.outbound.report());
        self.stats.snapshot().capture = self.capture.counters();
        {
            let mut snap = self.stats.snapshot();
            if matches!(snap.state, "running" | "waiting" | "") {
                snap.state = "stopped";
            }
        }
        info!(handed = self.handed, "camera stopped");
    }
}

/// A capture of `cam` at the model's `input`, its first frame numbered
/// `first_seq`.
fn start_capture(
    cam: &CameraConfig,
    input: &InputSpec,
    limits: CameraLimits,
    first_seq: u64,
) -> Result<SupervisedCapture, crate::capture::CaptureError> {
    let spec = CaptureSpec {
        camera: cam.name.clone(),
        uri: cam.uri.clone(),
        width: input.width,
        height: input.height,
        resize: input.resize,
        max_fps: cam.max_fps,
    };
    let options = SupervisorOptions {
        capture: CaptureOptions {
            rtsp_transport: cam.rtsp_transport,
            motion_threshold: cam.motion_threshold,
            keepalive_fps: cam.keepalive_fps,
            first_seq,
            ..CaptureOptions::default()
        },
        loop_file: cam.loop_file,
        ..SupervisorOptions::default()
    };
    let mut c = SupervisedCapture::new(spec, options)?;
    c.set_limits(limits);
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cam(uri: &str, model: &str) -> CameraConfig {
        toml::from_str(&format!(
            "name = \"c\"\nuri = \"{uri}\"\nmodel = \"{model}\"\n"
        ))
        .unwrap()
    }

    fn square(side: u32) -> InputSpec {
        InputSpec {
            width: side,
            height: side,
            channels: 3,
            dtype: DType::U8,
            layout: Layout::Nhwc,
            color: tidegate_protocol::ColorOrder::Rgb,
            resize: tidegate_protocol::Resize::Stretch,
        }
    }

    /// A new input (the gateway announced another size on a reconnect)
    /// replaces the capture: the new one numbers its frames on from the old
    /// one, and the camera's counters keep the old one's, frames it still
    /// had queued counted as dropped.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_replaced_capture_goes_on_from_the_old_ones_seq_and_counters() {
        const WAIT: Duration = Duration::from_secs(20);
        let mut cam = cam("test://ball?width=320&height=240", "m");
        cam.max_fps = 20.0;
        let limits = configured_limits(&cam);
        let mut capture = CameraCapture::default();
        capture
            .replace(|first| start_capture(&cam, &square(64), limits, first))
            .await
            .unwrap();
        let mut received = 0u64;
        let mut last_seq = 0;
        while received < 5 {
            let f = tokio::time::timeout(WAIT, capture.recv())
                .await
                .expect("a frame from the first capture")
                .unwrap();
            assert_eq!(f.width, 64);
            last_seq = f.seq;
            received += 1;
        }
        // Leave frames unread in the queue (2 at most; older ones evicted).
        let deadline = Instant::now() + WAIT;
        while capture.counters().passed < received + 2 {
            assert!(Instant::now() < deadline, "{:?}", capture.counters());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let old = capture.counters();
        capture
            .replace(|first| start_capture(&cam, &square(32), limits, first))
            .await
            .unwrap();
        let carried = capture.counters();
        assert!(
            carried.seen >= old.seen && carried.passed >= old.passed,
            "{old:?} then {carried:?}"
        );
        // Every frame that passed the old gate was read here or dropped
        // (evicted, or still queued when the capture stopped).
        assert_eq!(
            carried.passed,
            received + carried.dropped_queue,
            "{carried:?}"
        );
        assert!(carried.dropped_queue >= 2, "{carried:?}");
        let f = tokio::time::timeout(WAIT, capture.recv())
            .await
            .expect("a frame from the new capture")
            .unwrap();
        assert_eq!(f.width, 32);
        // The old capture numbered its frames 0..passed.
        assert!(f.seq > last_seq, "seq {last_seq} then {}", f.seq);
        assert_eq!(f.seq, carried.passed, "{carried:?}");
        let now = capture.counters();
        assert!(now.passed > carried.passed, "{carried:?} then {now:?}");
    }

    #[test]
    fn preflight_names_the_camera_for_each_kind_of_bad_entry() {
        for (c, want) in [
            (cam("test://smpte", ""), "no model"),
            (cam("ftp://x/y", "m"), "ftp"),
            (cam("rtsp:///nohost", "m"), "names no host"),
            (
                cam("file:///nonexistent/tidegate.mp4", "m"),
                "/nonexistent/tidegate.mp4",
            ),
        ] {
            let err = preflight(&c).unwrap_err().to_string();
            assert!(err.contains("'c'") && err.contains(want), "{err}");
        }
        preflight(&cam("test://smpte", "m")).unwrap();
        preflight(&cam("rtsp://127.0.0.1:1/x", "m")).unwrap();
    }
}
