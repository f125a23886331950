//! Camera capture: one GStreamer pipeline per camera, delivering model-sized,
//! tightly packed RGB frames (H×W×3 `u8`) with the [`Geometry`] that maps them
//! back to source pixels.
//!
//! ```text
//! source (test:// | image:// | file:// | rtsp:// | v4l2://) → videoscale
//!   → [content size] → videoconvert → [videobox: letterbox borders]
//!   → appsink (RGB W×H, newest only)
//!   → new-sample callback: rate cap + motion gate ([`crate::gate`]) on a
//!     32×32 grey thumbnail; a frame that passes is copied once into Bytes
//!     and stamped with seq + edge clock
//!   → latest-frames mailbox (drops the oldest) → Capture::recv().await
//!   → (JPEG, PNG) FrameEncoder: appsrc ! jpegenc|pngenc ! appsink on the
//!     camera's own thread, one frame at a time
//! ```
//!
//! GStreamer's streaming threads never block on the consumer: the appsink
//! callback and the bus sync handler only push into a bounded mailbox. Bus
//! errors and end-of-stream end the mailbox; [`Capture::recv`] then returns a
//! [`StreamError`] and the caller restarts the camera by dropping the
//! [`Capture`] (which stops the pipeline) and starting a new one;
//! [`SupervisedCapture`] does that by itself, with backoff.

mod encode;
mod pipeline;
mod queue;
mod supervisor;
mod uri;

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use bytes::Bytes;
use gstreamer as gst;
use gstreamer::prelude::*;
use tidegate_protocol::Geometry;

pub use self::encode::{ENCODE_TIMEOUT, EncodeError, Encoded, FrameEncoder};
use self::queue::Mailbox;
pub use self::supervisor::{CameraStopped, CaptureCounters, SupervisedCapture, SupervisorOptions};
pub use self::uri::{SourceUri, UriError};
pub use crate::config::RtspTransport;
use crate::gate::{CameraLimits, FrameGate, GateCounts};

/// Undelivered frames a camera keeps when its consumer falls behind.
pub const DEFAULT_QUEUE_DEPTH: usize = 2;
/// Largest model-input side a capture may produce.
pub const MAX_SIDE: u32 = 8192;
/// Highest frame rate a capture may ask for.
pub const MAX_FPS: f64 = 1000.0;

pub use tidegate_protocol::Resize;

/// What one camera captures and how it is shaped for the model.
#[derive(Debug, Clone, PartialEq)]
pub struct CaptureSpec {
    /// Camera name, unique within the edge; it appears in every frame and error.
    pub camera: String,
    /// Source: `image:///abs/still.png`, `test://<pattern>[?width=W&height=H]`
    /// or `file:///abs/video.mp4`.
    pub uri: String,
    /// Model input width in pixels.
    pub width: u32,
    /// Model input height in pixels.
    pub height: u32,
    /// How the source is fitted to `width`×`height`.
    pub resize: Resize,
    /// Most frames per second to deliver (live sources produce exactly this).
    pub max_fps: f64,
}

/// Tuning that most callers leave at its default.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CaptureOptions {
    /// Undelivered frames to keep; pushing into a full queue drops the oldest.
    pub queue_depth: usize,
    /// Sequence number of the first frame. Pass [`Capture::next_seq`] of the
    /// previous capture when restarting a camera to keep `seq` increasing.
    pub first_seq: u64,
    /// Lower transport for `rtsp://` sources.
    pub rtsp_transport: RtspTransport,
    /// Motion gate threshold (fraction of changed thumbnail cells); 0 = off.
    pub motion_threshold: f64,
    /// Least frames per second sent from a static scene; 0 = none.
    pub keepalive_fps: f64,
}

impl Default for CaptureOptions {
    fn default() -> Self {
        CaptureOptions {
            queue_depth: DEFAULT_QUEUE_DEPTH,
            first_seq: 0,
            rtsp_transport: RtspTransport::Tcp,
            motion_threshold: 0.0,
            keepalive_fps: 0.0,
        }
    }
}

/// One model-sized frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CapturedFrame {
    /// Camera name.
    pub camera: Arc<str>,
    /// Sequence number, increasing per camera.
    pub seq: u64,
    /// When the frame reached the edge, on [`crate::clock::now_us`].
    pub captured_at_us: u64,
    /// Tightly packed RGB rows: `height * width * 3` bytes, no row padding.
    pub data: Bytes,
    /// Frame width in pixels (the model input width).
    pub width: u32,
    /// Frame height in pixels (the model input height).
    pub height: u32,
    /// Source size and where the source sits inside this frame.
    pub geometry: Geometry,
}

/// Why a capture could not start.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CaptureError {
    /// A field of the [`CaptureSpec`] is out of range.
    #[error("camera '{camera}': {reason}")]
    InvalidSpec {
        /// Camera name.
        camera: String,
        /// What is wrong and what is allowed.
        reason: String,
    },
    /// The source URI cannot be parsed or uses an unsupported scheme.
    #[error("camera '{camera}': cannot use source URI '{uri}': {source}")]
    Uri {
        /// Camera name.
        camera: String,
        /// The URI as configured.
        uri: String,
        /// What is wrong with it.
        source: UriError,
    },
    /// The file an `image://` or `file://` URI names cannot be opened.
    #[error(
        "camera '{camera}': cannot open '{path}' from URI '{uri}': {reason}; check that the file exists and is readable"
    )]
    Unreadable {
        /// Camera name.
        camera: String,
        /// The URI as configured.
        uri: String,
        /// The decoded path.
        path: String,
        /// The operating system's reason.
        reason: String,
    },
    /// The device a `v4l2://` URI names cannot be used.
    #[error(
        "camera '{camera}': video device '{device}' from URI '{uri}' cannot be used: {reason}; check that the camera is plugged in and that this user may open it (group 'video')"
    )]
    NoDevice {
        /// Camera name.
        camera: String,
        /// The URI as configured.
        uri: String,
        /// The device node.
        device: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A `test://` URI names a pattern `videotestsrc` does not have.
    #[error(
        "camera '{camera}': test pattern '{pattern}' in URI '{uri}' does not exist; use one of: {valid}"
    )]
    UnknownPattern {
        /// Camera name.
        camera: String,
        /// The URI as configured.
        uri: String,
        /// The pattern asked for.
        pattern: String,
        /// The patterns available, comma separated.
        valid: String,
    },
    /// `gstreamer::init` failed.
    #[error(
        "GStreamer failed to initialise: {reason}; check that the GStreamer 1.22 runtime (libgstreamer1.0-0) is installed"
    )]
    Init {
        /// GStreamer's reason.
        reason: String,
    },
    /// A GStreamer element the pipeline needs is not installed.
    #[error("camera '{camera}': GStreamer element '{element}' is not available; install {package}")]
    MissingElement {
        /// Camera name.
        camera: String,
        /// Element factory name.
        element: String,
        /// Debian package that provides it.
        package: String,
    },
    /// The pipeline could not be assembled.
    #[error("camera '{camera}': cannot build the pipeline for '{uri}': {reason}")]
    Build {
        /// Camera name.
        camera: String,
        /// The URI as configured.
        uri: String,
        /// What failed.
        reason: String,
    },
    /// The pipeline refused to start playing.
    #[error("camera '{camera}': the pipeline for '{uri}' failed to start: {message}")]
    Start {
        /// Camera name.
        camera: String,
        /// The URI as configured.
        uri: String,
        /// The element's error message, when it posted one.
        message: String,
    },
}

impl CaptureError {
    /// Whether starting again later may succeed without a config change: a
    /// device that may be plugged in, a source that may come back. Wrong
    /// URIs, missing files and missing plugins are permanent.
    pub fn retryable(&self) -> bool {
        matches!(
            self,
            CaptureError::NoDevice { .. } | CaptureError::Start { .. }
        )
    }

    /// The camera the error is about (empty for [`CaptureError::Init`]).
    pub fn camera(&self) -> &str {
        match self {
            CaptureError::InvalidSpec { camera, .. }
            | CaptureError::Uri { camera, .. }
            | CaptureError::Unreadable { camera, .. }
            | CaptureError::NoDevice { camera, .. }
            | CaptureError::UnknownPattern { camera, .. }
            | CaptureError::MissingElement { camera, .. }
            | CaptureError::Build { camera, .. }
            | CaptureError::Start { camera, .. } => camera,
            CaptureError::Init { .. } => "",
        }
    }
}

/// Why a running capture stopped delivering frames. The camera must be
/// restarted (drop the [`Capture`], start a new one).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StreamError {
    /// The source ended (a file played to its end).
    #[error(
        "camera '{camera}': source '{uri}' reached end of stream; restart the camera to play it again"
    )]
    EndOfStream {
        /// Camera name.
        camera: String,
        /// The URI as configured.
        uri: String,
    },
    /// A GStreamer element posted an error.
    #[error(
        "camera '{camera}': GStreamer element '{element}' failed on '{uri}': {message}{}; restart the camera, and check its URI if this repeats",
        debug.as_deref().map(|d| format!(" ({d})")).unwrap_or_default()
    )]
    Pipeline {
        /// Camera name.
        camera: String,
        /// The URI as configured.
        uri: String,
        /// Path of the element that failed.
        element: String,
        /// The element's message.
        message: String,
        /// GStreamer's debug detail, if any.
        debug: Option<String>,
    },
    /// A sample did not match the negotiated RGB frame layout.
    #[error("camera '{camera}': cannot read a frame from '{uri}': {reason}")]
    Frame {
        /// Camera name.
        camera: String,
        /// The URI as configured.
        uri: String,
        /// What did not match.
        reason: String,
    },
}

/// Initialises GStreamer once per process.
fn init_gstreamer() -> Result<(), CaptureError> {
    static INIT: OnceLock<Result<(), String>> = OnceLock::new();
    INIT.get_or_init(|| gst::init().map_err(|e| e.to_string()))
        .clone()
        .map_err(|reason| CaptureError::Init { reason })
}

/// State shared between the pipeline's threads and the consumer.
struct Shared {
    camera: Arc<str>,
    uri: String,
    mailbox: Mailbox<CapturedFrame, StreamError>,
    next_seq: AtomicU64,
    /// Geometry of the frames now flowing; set when the source caps arrive.
    geometry: Mutex<Option<Geometry>>,
    /// Rate cap and motion gate, consulted by the appsink callback.
    gate: Mutex<FrameGate>,
    /// Frames the appsink delivered (sent or skipped by the gate).
    seen: AtomicU64,
}

impl Shared {
    fn geometry(&self) -> Option<Geometry> {
        *self.geometry.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn set_geometry(&self, geometry: Geometry) {
        *self.geometry.lock().unwrap_or_else(PoisonError::into_inner) = Some(geometry);
    }

    fn gate(&self) -> std::sync::MutexGuard<'_, FrameGate> {
        // Every gate update is a few field writes; a poisoned lock is usable.
        self.gate.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Ends the stream; later reasons are only logged.
    fn end(&self, reason: StreamError) {
        if self.mailbox.end(reason.clone()) {
            tracing::warn!(camera = %self.camera, "capture stopped: {reason}");
        } else {
            tracing::debug!(camera = %self.camera, "capture already stopped; also: {reason}");
        }
    }
}

impl fmt::Debug for Shared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shared")
            .field("camera", &self.camera)
            .field("uri", &self.uri)
            .field("frames_captured", &self.mailbox.pushed())
            .field("frames_dropped", &self.mailbox.dropped())
            .field("next_seq", &self.next_seq.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// A running camera pipeline. Dropping it stops the pipeline.
#[derive(Debug)]
pub struct Capture {
    spec: CaptureSpec,
    pipeline: gst::Pipeline,
    shared: Arc<Shared>,
}

impl Capture {
    /// Starts capturing with [`CaptureOptions::default`].
    ///
    /// Checks the spec, the URI and (for local files) that the file opens,
    /// then builds the pipeline and sets it playing. Decoding errors found
    /// later arrive through [`Capture::recv`]. Does not wait for the first
    /// frame.
    pub fn start(spec: CaptureSpec) -> Result<Self, CaptureError> {
        Self::start_with(spec, CaptureOptions::default())
    }

    /// Starts capturing with explicit [`CaptureOptions`].
    pub fn start_with(spec: CaptureSpec, options: CaptureOptions) -> Result<Self, CaptureError> {
        validate(&spec)?;
        let source: SourceUri = spec.uri.parse().map_err(|source| CaptureError::Uri {
            camera: spec.camera.clone(),
            uri: spec.uri.clone(),
            source,
        })?;
        check_readable(&spec, &source)?;
        init_gstreamer()?;

        let shared = Arc::new(Shared {
            camera: Arc::from(spec.camera.as_str()),
            uri: spec.uri.clone(),
            mailbox: Mailbox::new(options.queue_depth),
            next_seq: AtomicU64::new(options.first_seq),
            geometry: Mutex::new(None),
            gate: Mutex::new(FrameGate::new(CameraLimits {
                max_fps: spec.max_fps,
                motion_threshold: options.motion_threshold,
                keepalive_fps: options.keepalive_fps,
            })),
            seen: AtomicU64::new(0),
        });
        let pipeline = pipeline::build(&spec, &source, &options, &shared)?;
        pipeline::watch_bus(&pipeline, &shared);

        if pipeline.set_state(gst::State::Playing).is_err() {
            let message = match shared.mailbox.ended() {
                Some(StreamError::Pipeline { message, debug, .. }) => match debug {
                    Some(debug) => format!("{message} ({debug})"),
                    None => message,
                },
                Some(other) => other.to_string(),
                None => "the state change to PLAYING failed without an error message".into(),
            };
            stop(&pipeline, &spec.camera);
            return Err(CaptureError::Start {
                camera: spec.camera,
                uri: spec.uri,
                message,
            });
        }
        tracing::info!(camera = %spec.camera, uri = %spec.uri, width = spec.width,
            height = spec.height, resize = ?spec.resize, max_fps = spec.max_fps, "capture started");
        Ok(Capture {
            spec,
            pipeline,
            shared,
        })
    }

    /// The next frame, oldest first among those kept, waiting for one.
    ///
    /// Once the pipeline fails or ends, frames already queued are delivered,
    /// then every call returns the same [`StreamError`]. Cancel-safe: a
    /// `recv` dropped in a `select!` loses no frame.
    pub async fn recv(&self) -> Result<CapturedFrame, StreamError> {
        self.shared.mailbox.recv().await
    }

    /// The spec this capture runs.
    pub fn spec(&self) -> &CaptureSpec {
        &self.spec
    }

    /// Camera name.
    pub fn camera(&self) -> &str {
        &self.spec.camera
    }

    /// Frames that passed the gate so far (delivered, queued or dropped).
    pub fn frames_captured(&self) -> u64 {
        self.shared.mailbox.pushed()
    }

    /// Frames the pipeline produced, whether the gate passed them or not.
    pub fn frames_seen(&self) -> u64 {
        self.shared.seen.load(Ordering::Relaxed)
    }

    /// What the rate cap and motion gate decided so far.
    pub fn gate_counts(&self) -> GateCounts {
        self.shared.gate().counts()
    }

    /// The rate cap and motion gate in force.
    pub fn limits(&self) -> CameraLimits {
        self.shared.gate().limits()
    }

    /// Changes the rate cap and motion gate from the next frame on. The
    /// pipeline keeps producing at most `spec.max_fps`; a higher cap here has
    /// no effect beyond it.
    pub fn set_limits(&self, limits: CameraLimits) {
        self.shared.gate().set_limits(limits);
    }

    /// Frames dropped unread because the consumer fell behind.
    pub fn frames_dropped(&self) -> u64 {
        self.shared.mailbox.dropped()
    }

    /// Frames that passed the gate and wait in the queue, not yet read.
    pub fn frames_queued(&self) -> u64 {
        self.shared.mailbox.queued() as u64
    }

    /// Stops the pipeline now, as dropping it would, joining its streaming
    /// threads (so it may block): no frame is produced after it returns,
    /// and the counters are final. Dropping it later does nothing more.
    fn halt(&self) {
        stop(&self.pipeline, &self.spec.camera);
    }

    /// Sequence number the next frame will get; pass it as
    /// [`CaptureOptions::first_seq`] when restarting the camera.
    pub fn next_seq(&self) -> u64 {
        self.shared.next_seq.load(Ordering::Relaxed)
    }

    /// Geometry of the frames now flowing, once the source size is known.
    pub fn geometry(&self) -> Option<Geometry> {
        self.shared.geometry()
    }
}

// Captures are driven from tokio tasks.
const _: () = {
    const fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Capture>();
    assert_send_sync::<CapturedFrame>();
};

impl Drop for Capture {
    fn drop(&mut self) {
        stop(&self.pipeline, &self.spec.camera);
    }
}

/// Sets the pipeline to NULL, which joins its streaming threads. They never
/// wait on the consumer, so this returns promptly.
fn stop(pipeline: &gst::Pipeline, camera: &str) {
    if let Some(bus) = pipeline.bus() {
        bus.unset_sync_handler();
    }
    if let Err(e) = pipeline.set_state(gst::State::Null) {
        tracing::warn!(camera, "stopping the capture pipeline failed: {e}");
    }
}

fn validate(spec: &CaptureSpec) -> Result<(), CaptureError> {
    let invalid = |reason: String| CaptureError::InvalidSpec {
        camera: spec.camera.clone(),
        reason,
    };
    if spec.camera.trim().is_empty() {
        return Err(invalid(format!(
            "the camera for '{}' has an empty name; give every camera a unique name",
            spec.uri
        )));
    }
    for (name, value) in [("width", spec.width), ("height", spec.height)] {
        if !(1..=MAX_SIDE).contains(&value) {
            return Err(invalid(format!(
                "model input {name} {value} is out of range; use 1 to {MAX_SIDE} pixels"
            )));
        }
    }
    if !(spec.max_fps.is_finite() && spec.max_fps > 0.0 && spec.max_fps <= MAX_FPS) {
        return Err(invalid(format!(
            "max_fps {} is out of range; use a frame rate above 0 and at most {MAX_FPS}",
            spec.max_fps
        )));
    }
    Ok(())
}

/// Opens local files up front so a wrong path fails at start, naming it.
fn check_readable(spec: &CaptureSpec, source: &SourceUri) -> Result<(), CaptureError> {
    let path = match source {
        SourceUri::Image { path } | SourceUri::File { path, .. } => path,
        SourceUri::V4l2 { device } => return check_device(spec, device),
        SourceUri::Test { .. } | SourceUri::Rtsp { .. } => return Ok(()),
    };
    let unreadable = |reason: String| CaptureError::Unreadable {
        camera: spec.camera.clone(),
        uri: spec.uri.clone(),
        path: path.display().to_string(),
        reason,
    };
    let file = std::fs::File::open(path).map_err(|e| unreadable(e.to_string()))?;
    let meta = file.metadata().map_err(|e| unreadable(e.to_string()))?;
    if !meta.is_file() {
        return Err(unreadable("it is not a regular file".into()));
    }
    Ok(())
}

/// A `v4l2://` device must exist and be a character device; v4l2src
/// itself checks that it can capture when the pipeline starts.
fn check_device(spec: &CaptureSpec, device: &std::path::Path) -> Result<(), CaptureError> {
    use std::os::unix::fs::FileTypeExt;
    let no_device = |reason: String| CaptureError::NoDevice {
        camera: spec.camera.clone(),
        uri: spec.uri.clone(),
        device: device.display().to_string(),
        reason,
    };
    let meta = std::fs::metadata(device).map_err(|e| no_device(e.to_string()))?;
    if !meta.file_type().is_char_device() {
        return Err(no_device("it is not a character device".into()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(uri: &str) -> CaptureSpec {
        CaptureSpec {
            camera: "front".into(),
            uri: uri.into(),
            width: 128,
            height: 128,
            resize: Resize::Letterbox,
            max_fps: 10.0,
        }
    }

    #[test]
    fn out_of_range_spec_fields_are_named() {
        let mut s = spec("test://smpte");
        s.width = 0;
        let err = validate(&s).unwrap_err().to_string();
        assert!(err.contains("front") && err.contains("width 0"), "{err}");

        let mut s = spec("test://smpte");
        s.max_fps = f64::NAN;
        let err = validate(&s).unwrap_err().to_string();
        assert!(err.contains("max_fps NaN"), "{err}");

        let mut s = spec("test://smpte");
        s.camera = " ".into();
        assert!(validate(&s).is_err());

        assert_eq!(validate(&spec("test://smpte")), Ok(()));
    }

    #[test]
    fn a_directory_is_not_a_readable_image() {
        let dir = tempfile::tempdir().unwrap();
        let s = spec(&format!("image://{}", dir.path().display()));
        let source: SourceUri = s.uri.parse().unwrap();
        let err = check_readable(&s, &source).unwrap_err();
        assert!(err.to_string().contains("not a regular file"), "{err}");
        assert!(!err.retryable());
    }

    #[test]
    fn missing_or_non_device_v4l2_node_is_a_retryable_device_error() {
        let s = spec("v4l2:///dev/video-tidegate-missing");
        let source: SourceUri = s.uri.parse().unwrap();
        let err = check_readable(&s, &source).unwrap_err();
        assert!(matches!(err, CaptureError::NoDevice { .. }), "{err:?}");
        assert!(err.retryable());
        let msg = err.to_string();
        assert!(
            msg.contains("'front'") && msg.contains("/dev/video-tidegate-missing"),
            "{msg}"
        );
        let dir = tempfile::tempdir().unwrap();
        let s = spec(&format!("v4l2://{}", dir.path().display()));
        let source: SourceUri = s.uri.parse().unwrap();
        let err = check_readable(&s, &source).unwrap_err();
        assert!(err.to_string().contains("not a character device"), "{err}");
    }
}
