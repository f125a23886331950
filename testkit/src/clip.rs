//! Test clips written with GStreamer, for the edge's file sources
//! (`edge/tests/sources.rs`, `uplink.rs`). Feature `capture`.

use gstreamer as gst;
use gstreamer::prelude::*;

/// Writes an MJPEG AVI of `frames` 160×120 test frames at `rate` frames
/// per second (`"30/1"`).
pub fn write_clip_at(path: &std::path::Path, frames: u32, rate: &str) {
    gst::init().unwrap();
    let pipeline = gst::parse::launch(&format!(
        "videotestsrc num-buffers={frames} ! video/x-raw,width=160,height=120,framerate={rate} \
         ! jpegenc ! avimux ! filesink location={}",
        path.display()
    ))
    .unwrap();
    pipeline.set_state(gst::State::Playing).unwrap();
    let msg = pipeline
        .bus()
        .unwrap()
        .timed_pop_filtered(
            gst::ClockTime::from_seconds(10),
            &[gst::MessageType::Eos, gst::MessageType::Error],
        )
        .expect("writing the clip timed out");
    pipeline.set_state(gst::State::Null).unwrap();
    assert_eq!(msg.type_(), gst::MessageType::Eos);
}
