//! Builds the GStreamer pipeline of one camera and its callbacks.
//!
//! Layout (element names in brackets):
//!
//! ```text
//! test://   videotestsrc[source] ! capsfilter[source-caps: W×H @ fps] !
//! image://  filesrc[source] ! decodebin[decoder] ~> imagefreeze[freeze] ! capsfilter[rate: fps] !
//! file://   uridecodebin[decoder] ~> videorate[rate] ! capsfilter[rate-caps: ≤ fps] !
//! rtsp://   uridecodebin[decoder] (rtspsrc: tcp|udp) ~> videorate[rate] ! capsfilter[rate-caps] !
//! v4l2://   v4l2src[source] ! decodebin[decoder] ~> videorate[rate] ! capsfilter[rate-caps] !
//!   videoscale[scale] ! capsfilter[content] ! videoconvert[convert] !
//!   (letterbox only) videobox[letterbox] ! appsink[sink: RGB width×height]
//! ```
//!
//! A probe on `scale`'s sink pad sees the source caps before any buffer; it
//! computes the [`Geometry`] and, for letterboxing, sets `content` to the
//! content size and `letterbox`'s negative borders to pad it out to the
//! model input, so the content lands exactly where [`Geometry::letterbox`]
//! says.
//!
//! The appsink callback asks the camera's [`crate::gate::FrameGate`] first:
//! a frame over the rate cap is dropped untouched, a static one after a
//! 32×32 grey thumbnail; only frames that pass are copied.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use bytes::Bytes;
use gstreamer as gst;
use gstreamer::glib;
use gstreamer::prelude::*;
use gstreamer_app as gst_app;
use gstreamer_video as gst_video;
use gstreamer_video::prelude::*;
use tidegate_protocol::Geometry;

use super::{
    CaptureError, CaptureOptions, CaptureSpec, CapturedFrame, Resize, RtspTransport, Shared,
    SourceUri, StreamError,
};
use crate::gate::{Decision, thumbnail};

/// Jitter buffer of `rtsp://` sources: small, since a late frame is worth
/// less than a dropped one.
const RTSP_LATENCY_MS: u32 = 50;
/// An RTSP source that delivers nothing for this long posts an error (and the
/// camera restarts).
const RTSP_TIMEOUT_US: u64 = 5_000_000;

/// Debian package that ships each element we use.
fn package_of(factory: &str) -> &'static str {
    match factory {
        "imagefreeze" | "videobox" | "v4l2src" | "rtspsrc" => "gstreamer1.0-plugins-good",
        _ => "gstreamer1.0-plugins-base",
    }
}

fn make(spec: &CaptureSpec, factory: &str, name: &str) -> Result<gst::Element, CaptureError> {
    gst::ElementFactory::make(factory)
        .name(name)
        .build()
        .map_err(|_| CaptureError::MissingElement {
            camera: spec.camera.clone(),
            element: factory.to_owned(),
            package: package_of(factory).to_owned(),
        })
}

fn build_error(spec: &CaptureSpec, reason: impl Into<String>) -> CaptureError {
    CaptureError::Build {
        camera: spec.camera.clone(),
        uri: spec.uri.clone(),
        reason: reason.into(),
    }
}

/// `max_fps` as a GStreamer fraction.
fn fps_fraction(max_fps: f64) -> gst::Fraction {
    gst::Fraction::approximate_f64(max_fps).unwrap_or_else(|| gst::Fraction::new(1, 1))
}

/// Builds the pipeline; it is left in the NULL state.
pub(super) fn build(
    spec: &CaptureSpec,
    source: &SourceUri,
    options: &CaptureOptions,
    shared: &Arc<Shared>,
) -> Result<gst::Pipeline, CaptureError> {
    let pipeline = gst::Pipeline::with_name(&format!("capture-{}", spec.camera));
    let fps = fps_fraction(spec.max_fps);

    // The common tail: scale → content size → RGB → (borders) → appsink.
    let scale = make(spec, "videoscale", "scale")?;
    // Black borders are ours (videobox), placed exactly; never videoscale's.
    scale.set_property("add-borders", false);
    let content = make(spec, "capsfilter", "content")?;
    content.set_property(
        "caps",
        gst::Caps::builder("video/x-raw")
            .field("width", spec.width as i32)
            .field("height", spec.height as i32)
            .build(),
    );
    let convert = make(spec, "videoconvert", "convert")?;
    let letterbox = match spec.resize {
        Resize::Letterbox => Some(make(spec, "videobox", "letterbox")?),
        Resize::Stretch => None,
    };
    // Files are paced by the pipeline clock; every other source is live.
    let live = !matches!(source, SourceUri::File { .. });
    let sink = gst_app::AppSink::builder()
        .name("sink")
        .caps(
            &gst_video::VideoCapsBuilder::new()
                .format(gst_video::VideoFormat::Rgb)
                .width(spec.width as i32)
                .height(spec.height as i32)
                .build(),
        )
        .max_buffers(1)
        .drop(true)
        // Live sources already run at max_fps; a file is paced by the clock.
        .sync(!live)
        .enable_last_sample(false)
        .build();

    let mut tail: Vec<&gst::Element> = vec![&scale, &content, &convert];
    if let Some(letterbox) = &letterbox {
        tail.push(letterbox);
    }
    tail.push(sink.upcast_ref());
    pipeline
        .add_many(tail.iter().copied())
        .map_err(|e| build_error(spec, e.to_string()))?;
    gst::Element::link_many(tail.iter().copied())
        .map_err(|e| build_error(spec, format!("linking scale → sink: {e}")))?;

    build_source(spec, source, options, &pipeline, &scale, fps, shared)?;
    watch_source_caps(spec, &scale, &content, letterbox.as_ref(), shared)?;
    sink.set_callbacks(
        gst_app::AppSinkCallbacks::builder()
            .new_sample({
                let shared = Arc::clone(shared);
                let (width, height) = (spec.width, spec.height);
                move |sink| on_sample(sink, &shared, width, height)
            })
            .build(),
    );
    Ok(pipeline)
}

/// Adds the source elements and links them (now or when decoded pads appear)
/// to `scale`.
fn build_source(
    spec: &CaptureSpec,
    source: &SourceUri,
    options: &CaptureOptions,
    pipeline: &gst::Pipeline,
    scale: &gst::Element,
    fps: gst::Fraction,
    shared: &Arc<Shared>,
) -> Result<(), CaptureError> {
    let add_and_link = |chain: &[&gst::Element]| -> Result<(), CaptureError> {
        pipeline
            .add_many(chain.iter().copied())
            .map_err(|e| build_error(spec, e.to_string()))?;
        gst::Element::link_many(chain.iter().copied().chain([scale]))
            .map_err(|e| build_error(spec, format!("linking the source to the scaler: {e}")))
    };
    match source {
        SourceUri::Test {
            pattern,
            width,
            height,
        } => {
            let src = make(spec, "videotestsrc", "source")?;
            src.set_property("is-live", true);
            set_pattern(spec, &src, pattern)?;
            let caps = make(spec, "capsfilter", "source-caps")?;
            caps.set_property(
                "caps",
                gst::Caps::builder("video/x-raw")
                    .field("width", *width as i32)
                    .field("height", *height as i32)
                    .field("framerate", fps)
                    .build(),
            );
            add_and_link(&[&src, &caps])
        }
        SourceUri::Image { path } => {
            let src = make(spec, "filesrc", "source")?;
            src.set_property("location", path.to_string_lossy().as_ref());
            let decoder = make(spec, "decodebin", "decoder")?;
            let freeze = make(spec, "imagefreeze", "freeze")?;
            freeze.set_property("is-live", true);
            let rate = make(spec, "capsfilter", "rate")?;
            rate.set_property(
                "caps",
                gst::Caps::builder("video/x-raw")
                    .field("framerate", fps)
                    .build(),
            );
            pipeline
                .add_many([&src, &decoder])
                .map_err(|e| build_error(spec, e.to_string()))?;
            src.link(&decoder)
                .map_err(|e| build_error(spec, format!("linking filesrc → decodebin: {e}")))?;
            add_and_link(&[&freeze, &rate])?;
            link_decoded_video(&decoder, &freeze, shared);
            Ok(())
        }
        SourceUri::File { uri, .. } | SourceUri::Rtsp { uri } => {
            let decoder = make(spec, "uridecodebin", "decoder")?;
            decoder.set_property("uri", uri.as_str());
            if matches!(source, SourceUri::Rtsp { .. }) {
                configure_rtsp(spec, &decoder, options.rtsp_transport)?;
            }
            let (rate, caps) = rate_cap(spec, fps)?;
            pipeline
                .add(&decoder)
                .map_err(|e| build_error(spec, e.to_string()))?;
            add_and_link(&[&rate, &caps])?;
            link_decoded_video(&decoder, &rate, shared);
            Ok(())
        }
        SourceUri::V4l2 { device } => {
            let src = make(spec, "v4l2src", "source")?;
            src.set_property("device", device.to_string_lossy().as_ref());
            let decoder = make(spec, "decodebin", "decoder")?;
            let (rate, caps) = rate_cap(spec, fps)?;
            pipeline
                .add_many([&src, &decoder])
                .map_err(|e| build_error(spec, e.to_string()))?;
            src.link(&decoder)
                .map_err(|e| build_error(spec, format!("linking v4l2src → decodebin: {e}")))?;
            add_and_link(&[&rate, &caps])?;
            link_decoded_video(&decoder, &rate, shared);
            Ok(())
        }
    }
}

/// `videorate` (dropping only, never duplicating) and a caps filter that
/// caps the decoded rate at `fps`.
fn rate_cap(
    spec: &CaptureSpec,
    fps: gst::Fraction,
) -> Result<(gst::Element, gst::Element), CaptureError> {
    let rate = make(spec, "videorate", "rate")?;
    rate.set_property("drop-only", true);
    let caps = make(spec, "capsfilter", "rate-caps")?;
    caps.set_property(
        "caps",
        gst::Caps::builder("video/x-raw")
            .field(
                "framerate",
                gst::FractionRange::new(gst::Fraction::new(0, 1), fps),
            )
            .build(),
    );
    Ok((rate, caps))
}

/// Sets up the `rtspsrc` that `uridecodebin` creates: lower transport, a
/// small jitter buffer, and timeouts so a silent server ends the stream.
fn configure_rtsp(
    spec: &CaptureSpec,
    decoder: &gst::Element,
    transport: RtspTransport,
) -> Result<(), CaptureError> {
    if gst::ElementFactory::find("rtspsrc").is_none() {
        return Err(CaptureError::MissingElement {
            camera: spec.camera.clone(),
            element: "rtspsrc".into(),
            package: package_of("rtspsrc").into(),
        });
    }
    let camera = spec.camera.clone();
    decoder.connect("source-setup", false, move |args| {
        let source = args.get(1).and_then(|v| v.get::<gst::Element>().ok())?;
        if source.factory().is_some_and(|f| f.name() == "rtspsrc") {
            source.set_property_from_str(
                "protocols",
                match transport {
                    RtspTransport::Tcp => "tcp",
                    RtspTransport::Udp => "udp",
                },
            );
            source.set_property("latency", RTSP_LATENCY_MS);
            source.set_property("drop-on-latency", true);
            source.set_property("timeout", RTSP_TIMEOUT_US);
            source.set_property("tcp-timeout", RTSP_TIMEOUT_US);
            tracing::debug!(camera = %camera, ?transport, "rtspsrc configured");
        }
        None
    });
    Ok(())
}

/// Sets `videotestsrc`'s pattern by nick, rejecting unknown names with the
/// list of valid ones (GStreamer's string setter would panic instead).
fn set_pattern(spec: &CaptureSpec, src: &gst::Element, pattern: &str) -> Result<(), CaptureError> {
    let class = src
        .property_type("pattern")
        .and_then(glib::EnumClass::with_type)
        .ok_or_else(|| build_error(spec, "videotestsrc has no enumerated 'pattern' property"))?;
    match class.to_value_by_nick(pattern) {
        Some(value) => {
            src.set_property_from_value("pattern", &value);
            Ok(())
        }
        None => Err(CaptureError::UnknownPattern {
            camera: spec.camera.clone(),
            uri: spec.uri.clone(),
            pattern: pattern.to_owned(),
            valid: class
                .values()
                .iter()
                .map(|v| v.nick())
                .collect::<Vec<_>>()
                .join(", "),
        }),
    }
}

/// Links the first decoded video pad of `decoder` to `target`'s sink pad.
/// Other streams (audio, extra video tracks) stay unlinked; decodebin keeps
/// running as long as one stream is linked.
fn link_decoded_video(decoder: &gst::Element, target: &gst::Element, shared: &Arc<Shared>) {
    let target = target.downgrade();
    let shared = Arc::clone(shared);
    decoder.connect_pad_added(move |decoder, pad| {
        let caps = pad.current_caps().unwrap_or_else(|| pad.query_caps(None));
        let is_video = caps
            .structure(0)
            .is_some_and(|s| s.name().starts_with("video/"));
        let Some(sink_pad) = target.upgrade().and_then(|t| t.static_pad("sink")) else {
            return;
        };
        if !is_video || sink_pad.is_linked() {
            tracing::debug!(camera = %shared.camera, %caps, "ignoring decoded stream");
            return;
        }
        if let Err(e) = pad.link(&sink_pad) {
            shared.end(StreamError::Pipeline {
                camera: shared.camera.to_string(),
                uri: shared.uri.clone(),
                element: decoder.path_string().to_string(),
                message: format!("decoded video ({caps}) cannot be linked to the scaler: {e:?}"),
                debug: None,
            });
        }
    });
}

/// Installs the probe that learns the source size from the caps entering the
/// scaler, records the geometry and sizes the letterbox.
fn watch_source_caps(
    spec: &CaptureSpec,
    scale: &gst::Element,
    content: &gst::Element,
    letterbox: Option<&gst::Element>,
    shared: &Arc<Shared>,
) -> Result<(), CaptureError> {
    let pad = scale
        .static_pad("sink")
        .ok_or_else(|| build_error(spec, "videoscale has no sink pad"))?;
    let content = content.downgrade();
    let letterbox = letterbox.map(|l| l.downgrade());
    let shared = Arc::clone(shared);
    let (width, height, resize) = (spec.width, spec.height, spec.resize);
    pad.add_probe(gst::PadProbeType::EVENT_DOWNSTREAM, move |_pad, info| {
        let Some(gst::PadProbeData::Event(event)) = &info.data else {
            return gst::PadProbeReturn::Ok;
        };
        let gst::EventView::Caps(caps) = event.view() else {
            return gst::PadProbeReturn::Ok;
        };
        let size = caps.caps().structure(0).and_then(|s| {
            let w = s.get::<i32>("width").ok()?;
            let h = s.get::<i32>("height").ok()?;
            Some((u32::try_from(w).ok()?, u32::try_from(h).ok()?))
        });
        let Some((source_width, source_height)) = size else {
            return gst::PadProbeReturn::Ok;
        };
        let geometry = match resize {
            Resize::Stretch => Geometry::stretch(source_width, source_height, width, height),
            Resize::Letterbox => Geometry::letterbox(source_width, source_height, width, height),
        };
        // Only property writes here: the scaler negotiates its output after
        // this probe returns, against the updated content caps.
        if let (Some(content), Some(letterbox)) = (
            content.upgrade(),
            letterbox.as_ref().and_then(|l| l.upgrade()),
        ) {
            apply_letterbox(&content, &letterbox, &geometry, width, height);
        }
        shared.set_geometry(geometry);
        tracing::debug!(camera = %shared.camera, ?geometry, "source caps: {}", caps.caps());
        gst::PadProbeReturn::Ok
    });
    Ok(())
}

/// Borders `videobox` adds around the content: (left, right, top, bottom),
/// negative as videobox expects for padding.
fn letterbox_borders(geometry: &Geometry, width: u32, height: u32) -> (i32, i32, i32, i32) {
    let pad = |v: u32| -(v as i32);
    (
        pad(geometry.content_x),
        pad(width - geometry.content_x - geometry.content_width),
        pad(geometry.content_y),
        pad(height - geometry.content_y - geometry.content_height),
    )
}

fn apply_letterbox(
    content: &gst::Element,
    letterbox: &gst::Element,
    geometry: &Geometry,
    width: u32,
    height: u32,
) {
    content.set_property(
        "caps",
        gst::Caps::builder("video/x-raw")
            .field("width", geometry.content_width as i32)
            .field("height", geometry.content_height as i32)
            .build(),
    );
    let (left, right, top, bottom) = letterbox_borders(geometry, width, height);
    letterbox.set_property("left", left);
    letterbox.set_property("right", right);
    letterbox.set_property("top", top);
    letterbox.set_property("bottom", bottom);
}

/// A buffer's running time (its timestamp in the pipeline's clock, µs), or
/// `None` for a buffer without one.
fn stream_time_us(sample: &gst::Sample, buffer: &gst::BufferRef) -> Option<u64> {
    let pts = buffer.pts()?;
    let running = match sample
        .segment()
        .and_then(|s| s.downcast_ref::<gst::ClockTime>())
    {
        Some(segment) => segment.to_running_time(pts)?,
        None => pts,
    };
    Some(running.useconds())
}

/// The appsink's new-sample callback: copy once, stamp, push, never wait.
fn on_sample(
    sink: &gst_app::AppSink,
    shared: &Shared,
    width: u32,
    height: u32,
) -> Result<gst::FlowSuccess, gst::FlowError> {
    let sample = sink.pull_sample().map_err(|_| gst::FlowError::Flushing)?;
    let captured_at_us = crate::clock::now_us();
    shared.seen.fetch_add(1, Ordering::Relaxed);
    let frame_error = |reason: String| {
        shared.end(StreamError::Frame {
            camera: shared.camera.to_string(),
            uri: shared.uri.clone(),
            reason,
        });
        gst::FlowError::Error
    };
    let buffer = sample
        .buffer()
        .ok_or_else(|| frame_error("the sample has no buffer".into()))?;
    let caps = sample
        .caps()
        .ok_or_else(|| frame_error("the sample has no caps".into()))?;
    let frame = map_rgb(buffer, caps, width, height).map_err(frame_error)?;
    let stride = usize::try_from(frame.plane_stride()[0])
        .map_err(|_| frame_error("negative row stride".into()))?;
    let plane = frame
        .plane_data(0)
        .map_err(|e| frame_error(format!("cannot read the RGB plane: {e}")))?;
    // The gate measures rates on the stream's own clock, so that a source
    // running at its cap loses no frame to delivery jitter on a loaded
    // machine; a stream without timestamps is measured on arrival.
    let stream_us = stream_time_us(&sample, buffer).unwrap_or(captured_at_us);
    let decision = {
        let mut gate = shared.gate();
        let thumb = if gate.wants_thumbnail() && gate.rate_allows(stream_us) {
            thumbnail(plane, stride, width as usize, height as usize)
        } else {
            None
        };
        gate.decide(stream_us, thumb.as_ref())
    };
    if decision != Decision::Send {
        return Ok(gst::FlowSuccess::Ok);
    }
    let data = pack_plane(plane, stride, width, height).map_err(frame_error)?;
    let geometry = shared
        .geometry()
        .ok_or_else(|| frame_error("a frame arrived before the source caps".into()))?;
    let seq = shared.next_seq.fetch_add(1, Ordering::Relaxed);
    shared.mailbox.push(CapturedFrame {
        camera: Arc::clone(&shared.camera),
        seq,
        captured_at_us,
        data,
        width,
        height,
        geometry,
    });
    Ok(gst::FlowSuccess::Ok)
}

/// Maps an RGB buffer for reading, checking it has the negotiated size.
fn map_rgb<'a>(
    buffer: &'a gst::BufferRef,
    caps: &gst::CapsRef,
    width: u32,
    height: u32,
) -> Result<gst_video::VideoFrameRef<&'a gst::BufferRef>, String> {
    let info = gst_video::VideoInfo::from_caps(caps)
        .map_err(|e| format!("caps {caps} are not raw video: {e}"))?;
    if info.format() != gst_video::VideoFormat::Rgb
        || info.width() != width
        || info.height() != height
    {
        return Err(format!(
            "negotiated {}x{} {}, expected {width}x{height} RGB",
            info.width(),
            info.height(),
            info.format()
        ));
    }
    gst_video::VideoFrameRef::from_buffer_ref_readable(buffer, &info)
        .map_err(|e| format!("cannot map the frame buffer: {e}"))
}

/// Copies an RGB plane into tightly packed rows (GStreamer pads each RGB row
/// to a multiple of 4 bytes).
fn pack_plane(plane: &[u8], stride: usize, width: u32, height: u32) -> Result<Bytes, String> {
    let row = width as usize * 3;
    let rows = height as usize;
    pack_rows(plane, stride, row, rows).ok_or_else(|| {
        format!(
            "the RGB plane holds {} bytes, {rows} rows of {row} bytes at stride {stride} need more",
            plane.len()
        )
    })
}

/// Packs `rows` rows of `row` bytes, `stride` apart, into one `Bytes`.
fn pack_rows(plane: &[u8], stride: usize, row: usize, rows: usize) -> Option<Bytes> {
    if rows == 0 {
        return Some(Bytes::new());
    }
    if stride < row || plane.len() < (rows - 1) * stride + row {
        return None;
    }
    if stride == row {
        return Some(Bytes::copy_from_slice(&plane[..row * rows]));
    }
    let mut out = Vec::with_capacity(row * rows);
    for chunk in plane.chunks(stride).take(rows) {
        out.extend_from_slice(&chunk[..row]);
    }
    Some(Bytes::from(out))
}

/// Routes bus messages to the mailbox from the posting thread, without
/// queueing them on the bus.
pub(super) fn watch_bus(pipeline: &gst::Pipeline, shared: &Arc<Shared>) {
    let Some(bus) = pipeline.bus() else {
        return;
    };
    let shared = Arc::clone(shared);
    bus.set_sync_handler(move |_bus, msg| {
        let element = || {
            msg.src()
                .map(|s| s.path_string().to_string())
                .unwrap_or_else(|| "pipeline".into())
        };
        match msg.view() {
            gst::MessageView::Eos(_) => shared.end(StreamError::EndOfStream {
                camera: shared.camera.to_string(),
                uri: shared.uri.clone(),
            }),
            gst::MessageView::Error(err) => shared.end(StreamError::Pipeline {
                camera: shared.camera.to_string(),
                uri: shared.uri.clone(),
                element: element(),
                message: err.error().to_string(),
                debug: err.debug().map(|d| d.to_string()),
            }),
            gst::MessageView::Warning(w) => {
                tracing::warn!(camera = %shared.camera, element = %element(), "GStreamer warning: {}", w.error());
            }
            _ => {}
        }
        gst::BusSyncReply::Drop
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn padded_rows_are_packed_tightly() {
        // 2 rows of 3 RGB pixels (9 bytes) at a stride of 12, padding = 0xEE.
        let mut plane = vec![0xEE; 24];
        for (i, b) in plane[0..9].iter_mut().enumerate() {
            *b = i as u8;
        }
        for (i, b) in plane[12..21].iter_mut().enumerate() {
            *b = 100 + i as u8;
        }
        let packed = pack_rows(&plane, 12, 9, 2).unwrap();
        let want: Vec<u8> = (0..9).chain(100..109).collect();
        assert_eq!(packed.as_ref(), want.as_slice());
    }

    #[test]
    fn short_plane_is_rejected_instead_of_read_past_its_end() {
        assert_eq!(pack_rows(&[0; 20], 12, 9, 2), None);
        assert_eq!(pack_rows(&[0; 24], 8, 9, 2), None);
        // The last row needs no padding after it.
        assert!(pack_rows(&[0; 21], 12, 9, 2).is_some());
    }

    #[test]
    fn letterbox_borders_pad_content_out_to_the_input() {
        let g = Geometry::letterbox(1920, 1080, 128, 128);
        assert_eq!(letterbox_borders(&g, 128, 128), (0, 0, -28, -28));
        let g = Geometry::letterbox(480, 640, 128, 128);
        let (l, r, t, b) = letterbox_borders(&g, 128, 128);
        assert_eq!((t, b), (0, 0));
        assert_eq!(-(l + r) as u32 + g.content_width, 128);
        assert_eq!(-l as u32, g.content_x);
    }

    #[test]
    fn fractional_frame_rates_become_exact_fractions() {
        assert_eq!(fps_fraction(10.0), gst::Fraction::new(10, 1));
        assert_eq!(fps_fraction(0.5), gst::Fraction::new(1, 2));
    }
}
