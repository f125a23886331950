//! Capture against real GStreamer pipelines. Every wait is bounded.

#![cfg(feature = "capture")]

use std::time::Duration;

use gstreamer as gst;
use gstreamer::prelude::*;
use tidegate_edge::capture::{
    Capture, CaptureError, CaptureSpec, CapturedFrame, Resize, StreamError,
};
use tidegate_protocol::Geometry;

const ASTRONAUT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../models/testdata/astronaut.png"
);
const WAIT: Duration = Duration::from_secs(10);

fn spec(uri: &str, width: u32, height: u32, resize: Resize) -> CaptureSpec {
    CaptureSpec {
        camera: "cam-under-test".into(),
        uri: uri.into(),
        width,
        height,
        resize,
        max_fps: 15.0,
    }
}

async fn next_frame(capture: &Capture) -> CapturedFrame {
    match tokio::time::timeout(WAIT, capture.recv()).await {
        Ok(Ok(frame)) => frame,
        Ok(Err(e)) => panic!("capture stopped: {e}"),
        Err(_) => panic!("no frame from {} within {WAIT:?}", capture.spec().uri),
    }
}

/// Mean of the bytes of pixel rows `rows`, over all columns.
fn row_mean(frame: &CapturedFrame, rows: std::ops::Range<u32>) -> f64 {
    let row = frame.width as usize * 3;
    let bytes = &frame.data[rows.start as usize * row..rows.end as usize * row];
    bytes.iter().map(|&b| b as f64).sum::<f64>() / bytes.len() as f64
}

/// Mean of the bytes of pixel columns `cols`, over all rows.
fn col_mean(frame: &CapturedFrame, cols: std::ops::Range<u32>) -> f64 {
    let row = frame.width as usize * 3;
    let (mut sum, mut n) = (0.0, 0usize);
    for line in frame.data.chunks(row) {
        for &b in &line[cols.start as usize * 3..cols.end as usize * 3] {
            sum += b as f64;
            n += 1;
        }
    }
    sum / n as f64
}

#[tokio::test]
async fn hd_test_pattern_letterboxed_to_128_carries_exact_size_and_geometry() {
    let capture = Capture::start(spec(
        "test://smpte?width=1920&height=1080",
        128,
        128,
        Resize::Letterbox,
    ))
    .unwrap();
    let first = next_frame(&capture).await;
    let second = next_frame(&capture).await;

    assert_eq!(first.data.len(), 128 * 128 * 3);
    assert_eq!((first.width, first.height), (128, 128));
    assert_eq!(&*first.camera, "cam-under-test");
    assert_eq!(
        first.geometry,
        Geometry {
            source_width: 1920,
            source_height: 1080,
            content_x: 0,
            content_y: 28,
            content_width: 128,
            content_height: 72,
        }
    );
    assert!(second.seq > first.seq);
    assert!(second.captured_at_us > first.captured_at_us);
    assert_eq!(capture.geometry(), Some(first.geometry));
    assert!(capture.frames_captured() >= 2);
}

/// Checks that a white source letterboxed into `width`×`height` is white
/// exactly inside the geometry's content rectangle (within 1 px) and black
/// outside it.
async fn assert_white_content_matches_geometry(uri: &str, width: u32, height: u32) -> Geometry {
    let capture = Capture::start(spec(uri, width, height, Resize::Letterbox)).unwrap();
    let frame = next_frame(&capture).await;
    let g = frame.geometry;
    assert_eq!(frame.data.len(), (width * height * 3) as usize);
    let (top, bottom) = (g.content_y, g.content_y + g.content_height);
    let (left, right) = (g.content_x, g.content_x + g.content_width);
    if top > 1 {
        assert!(
            row_mean(&frame, 0..top - 1) < 5.0,
            "rows above {g:?} not black"
        );
    }
    if bottom + 1 < height {
        assert!(
            row_mean(&frame, bottom + 1..height) < 5.0,
            "rows below {g:?} not black"
        );
    }
    if left > 1 {
        assert!(
            col_mean(&frame, 0..left - 1) < 5.0,
            "columns left of {g:?} not black"
        );
    }
    if right + 1 < width {
        assert!(
            col_mean(&frame, right + 1..width) < 5.0,
            "columns right of {g:?} not black"
        );
    }
    let row = width as usize * 3;
    for y in top + 1..bottom - 1 {
        let line = &frame.data[y as usize * row..(y as usize + 1) * row];
        let content = &line[(left as usize + 1) * 3..(right as usize - 1) * 3];
        assert!(
            content.iter().all(|&b| b >= 250),
            "row {y} inside {g:?} is not white"
        );
    }
    g
}

#[tokio::test]
async fn letterbox_pads_black_exactly_outside_the_geometry_content() {
    // Wide source: bars above and below.
    let g = assert_white_content_matches_geometry("test://white?width=1920&height=1080", 128, 128)
        .await;
    assert_eq!((g.content_y, g.content_height), (28, 72));
    // 4:3 source into a 150-wide input: bars left and right, an odd border
    // (11 px) and RGB rows of 450 bytes, which GStreamer pads to 452.
    let g =
        assert_white_content_matches_geometry("test://white?width=640&height=480", 150, 96).await;
    assert_eq!(g, Geometry::letterbox(640, 480, 150, 96));
    assert_eq!((g.content_x, g.content_width), (11, 128));
}

#[tokio::test]
async fn stretch_fills_every_pixel_of_an_unpadded_odd_width_frame() {
    // 102 px × 3 = 306-byte rows: packed tightly, padding must not leak in.
    let capture = Capture::start(spec(
        "test://white?width=1920&height=1080",
        102,
        90,
        Resize::Stretch,
    ))
    .unwrap();
    let frame = next_frame(&capture).await;
    assert_eq!(frame.data.len(), 102 * 90 * 3);
    assert_eq!(frame.geometry, Geometry::stretch(1920, 1080, 102, 90));
    let dark = frame.data.iter().filter(|&&b| b < 250).count();
    assert_eq!(
        dark, 0,
        "{dark} bytes of a stretched white frame are not white"
    );
}

#[tokio::test]
async fn still_image_plays_as_live_video_no_faster_than_max_fps() {
    let mut s = spec(&format!("image://{ASTRONAUT}"), 128, 128, Resize::Letterbox);
    s.max_fps = 10.0;
    let started = std::time::Instant::now();
    let capture = Capture::start(s).unwrap();

    // It keeps producing: five frames, each waited for (bounded).
    let mut frames = Vec::new();
    while frames.len() < 5 {
        frames.push(next_frame(&capture).await);
    }
    assert!(frames.windows(2).all(|w| w[1].seq > w[0].seq));
    // And it is paced like live video: a live source waits for the clock
    // before each frame (frame n at n × 100 ms after it started), so it can
    // never have produced more than one frame per 100 ms elapsed, plus the
    // first. A slow machine only makes it produce fewer; a source that is
    // not live would have produced hundreds. (`seen` is read before
    // `elapsed`, so the bound only grows.)
    let seen = capture.frames_seen();
    let elapsed = started.elapsed();
    let most = (elapsed.as_millis() / 100) as u64 + 2;
    assert!(
        seen <= most,
        "{seen} frames in {elapsed:?} from a 10 fps live source"
    );

    let frame = &frames[0];
    assert_eq!(frame.data.len(), 128 * 128 * 3);
    assert_eq!(frame.geometry, Geometry::stretch(512, 512, 128, 128));
    let min = *frame.data.iter().min().unwrap();
    let max = *frame.data.iter().max().unwrap();
    assert!(
        max - min > 100,
        "astronaut frame looks uniform ({min}..={max})"
    );
}

#[tokio::test]
async fn missing_image_fails_at_start_naming_camera_and_path() {
    let err = Capture::start(spec(
        "image:///nonexistent/tidegate/still.png",
        128,
        128,
        Resize::Stretch,
    ))
    .unwrap_err();
    assert!(matches!(err, CaptureError::Unreadable { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("cam-under-test") && msg.contains("/nonexistent/tidegate/still.png"),
        "{msg}"
    );
}

#[tokio::test]
async fn unknown_scheme_fails_at_start_naming_camera_and_uri() {
    let err = Capture::start(spec("ftp://example/cam", 128, 128, Resize::Stretch)).unwrap_err();
    assert!(matches!(err, CaptureError::Uri { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("cam-under-test")
            && msg.contains("ftp://example/cam")
            && msg.contains("test://"),
        "{msg}"
    );
}

#[tokio::test]
async fn unknown_test_pattern_fails_at_start_listing_valid_patterns() {
    let err = Capture::start(spec("test://plaid", 128, 128, Resize::Stretch)).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, CaptureError::UnknownPattern { .. }),
        "{err:?}"
    );
    assert!(
        msg.contains("cam-under-test") && msg.contains("plaid") && msg.contains("smpte"),
        "{msg}"
    );
}

#[tokio::test]
async fn undecodable_image_is_reported_by_recv_with_the_element_message() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("not-an-image.png");
    std::fs::write(&path, b"this is not a PNG file, just text").unwrap();
    let capture = Capture::start(spec(
        &format!("image://{}", path.display()),
        64,
        64,
        Resize::Stretch,
    ))
    .unwrap();
    let got = tokio::time::timeout(WAIT, capture.recv()).await;
    let err = match got {
        Ok(Err(e)) => e,
        Ok(Ok(frame)) => panic!("decoded a frame from a text file: {frame:?}"),
        Err(_) => panic!("no error within {WAIT:?}"),
    };
    assert!(matches!(err, StreamError::Pipeline { .. }), "{err:?}");
    assert!(err.to_string().contains("cam-under-test"), "{err}");
}

/// Writes a 1 s, 30 fps MJPEG AVI of `frames` frames.
fn write_test_video(path: &std::path::Path, frames: u32) {
    gst::init().unwrap();
    let pipeline = gst::parse::launch(&format!(
        "videotestsrc num-buffers={frames} ! video/x-raw,width=320,height=240,framerate=30/1 \
         ! jpegenc ! avimux ! filesink location={}",
        path.display()
    ))
    .unwrap();
    pipeline.set_state(gst::State::Playing).unwrap();
    let bus = pipeline.bus().unwrap();
    let msg = bus
        .timed_pop_filtered(
            gst::ClockTime::from_seconds(10),
            &[gst::MessageType::Eos, gst::MessageType::Error],
        )
        .expect("writing the test video timed out");
    pipeline.set_state(gst::State::Null).unwrap();
    assert_eq!(
        msg.type_(),
        gst::MessageType::Eos,
        "writing the test video failed"
    );
}

#[tokio::test]
async fn video_file_is_paced_to_max_fps_then_reports_end_of_stream() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("clip.avi");
    write_test_video(&path, 15); // 0.5 s at 30 fps
    let mut s = spec(
        &format!("file://{}", path.display()),
        64,
        64,
        Resize::Letterbox,
    );
    s.max_fps = 10.0;
    // A deep queue so no frame is dropped before we read it.
    let capture = Capture::start_with(
        s,
        tidegate_edge::capture::CaptureOptions {
            queue_depth: 64,
            first_seq: 1000,
            ..Default::default()
        },
    )
    .unwrap();

    let mut frames = Vec::new();
    let end = loop {
        match tokio::time::timeout(WAIT, capture.recv()).await {
            Ok(Ok(frame)) => frames.push(frame),
            Ok(Err(e)) => break e,
            Err(_) => panic!("no end of stream within {WAIT:?}"),
        }
    };
    assert!(matches!(end, StreamError::EndOfStream { .. }), "{end:?}");
    assert!(end.to_string().contains("cam-under-test"), "{end}");
    // 0.5 s at 10 fps is about 5 frames; 15 would mean no rate limit.
    assert!((2..=8).contains(&frames.len()), "{} frames", frames.len());
    assert_eq!(frames[0].seq, 1000);
    assert_eq!(frames[0].geometry, Geometry::letterbox(320, 240, 64, 64));
    assert_eq!(capture.frames_dropped(), 0);
}
