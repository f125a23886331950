//! The rate cap and motion gate on real pipelines: a static scene sends at
//! most the keep-alive rate, a moving one every frame up to the cap, and a
//! lower cap applied live thins the stream. Counts are compared with what
//! the pipeline produced (the gate runs on the stream's own clock), never
//! with wall-clock speed; every wait is bounded.

#![cfg(feature = "capture")]

use std::time::Duration;

use tidegate_edge::capture::{Capture, CaptureOptions, CaptureSpec, CapturedFrame, Resize};
use tidegate_edge::gate::{CameraLimits, GateCounts};

const WAIT: Duration = Duration::from_secs(10);
const ASTRONAUT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../models/testdata/astronaut.png"
);

fn spec(uri: &str, max_fps: f64) -> CaptureSpec {
    CaptureSpec {
        camera: "gate-under-test".into(),
        uri: uri.into(),
        width: 128,
        height: 128,
        resize: Resize::Letterbox,
        max_fps,
    }
}

fn gated(motion_threshold: f64, keepalive_fps: f64) -> CaptureOptions {
    CaptureOptions {
        queue_depth: 64,
        motion_threshold,
        keepalive_fps,
        ..CaptureOptions::default()
    }
}

/// Frames delivered until the pipeline has produced `seen` frames in all
/// (bounded: a minute at most).
async fn collect_until_seen(capture: &Capture, seen: u64) -> Vec<CapturedFrame> {
    let mut frames = Vec::new();
    let deadline = tokio::time::Instant::now() + 6 * WAIT;
    while capture.frames_seen() < seen {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the pipeline produced only {} of {seen} frames in {:?}",
            capture.frames_seen(),
            6 * WAIT
        );
        match tokio::time::timeout(Duration::from_millis(200), capture.recv()).await {
            Ok(Ok(f)) => frames.push(f),
            Ok(Err(e)) => panic!("capture stopped: {e}"),
            Err(_) => {}
        }
    }
    // Whatever passed the gate is queued by now. Bounded: a stream that
    // sends a frame every 50 ms or faster would keep the 50 ms wait from
    // ever running out.
    let drained_by = tokio::time::Instant::now() + Duration::from_secs(1);
    while tokio::time::Instant::now() < drained_by {
        match tokio::time::timeout(Duration::from_millis(50), capture.recv()).await {
            Ok(Ok(f)) => frames.push(f),
            _ => break,
        }
    }
    frames
}

/// The gate's counts, with the pipeline's frame count read just before
/// (`lo`) and just after (`hi`). The pipeline counts a frame as seen just
/// before the gate decides it, so the frames decided at the reading are in
/// `lo - 1 ..= hi`, however the threads interleave.
fn snapshot(capture: &Capture) -> (GateCounts, u64, u64) {
    let lo = capture.frames_seen();
    let counts = capture.gate_counts();
    let hi = capture.frames_seen();
    (counts, lo, hi)
}

fn decided(c: &GateCounts) -> u64 {
    c.sent + c.skipped_rate + c.skipped_static
}

async fn first_frame(capture: &Capture) -> CapturedFrame {
    tokio::time::timeout(WAIT, capture.recv())
        .await
        .expect("a first frame")
        .expect("capture running")
}

#[tokio::test]
async fn static_scene_sends_at_most_the_keepalive_rate() {
    // A still photograph played as live video: nothing moves. (videotestsrc's
    // smpte pattern is no good here: it has a patch of noise.)
    let capture = Capture::start_with(
        spec(&format!("image://{ASTRONAUT}"), 10.0),
        gated(0.01, 1.0),
    )
    .unwrap();
    let first = first_frame(&capture).await;
    let frames = collect_until_seen(&capture, 30).await;
    let (counts, lo, seen) = snapshot(&capture);
    // The gate measures time on the stream's clock, where the still plays at
    // exactly 10 fps (frame n at n × 100 ms): the first frame is sent, then
    // one keep-alive per second of stream, that is one frame in ten,
    // however fast or slow the frames reach the callback.
    let mut sent = vec![first];
    sent.extend(frames);
    assert_eq!(counts.sent as usize, sent.len());
    assert!(sent.windows(2).all(|w| w[1].seq == w[0].seq + 1));
    assert_eq!(counts.skipped_rate, 0, "{counts:?}");
    assert!(
        (lo.saturating_sub(1)..=seen).contains(&decided(&counts)),
        "every frame seen ({lo}..={seen}) was decided: {counts:?}"
    );
    assert!(
        counts.sent <= seen.div_ceil(10) && counts.sent + 1 >= seen.div_ceil(10),
        "{seen} frames of a static scene at 10 fps with a 1 fps keep-alive: {counts:?}"
    );
}

#[tokio::test]
async fn moving_pattern_sends_every_frame_up_to_the_cap() {
    let capture = Capture::start_with(
        spec("test://ball?width=640&height=480", 10.0),
        gated(0.002, 0.5),
    )
    .unwrap();
    let first = first_frame(&capture).await;
    let frames = collect_until_seen(&capture, 30).await;
    let counts = capture.gate_counts();
    assert_eq!(counts.skipped_rate, 0, "{counts:?}");
    assert!(
        counts.skipped_static <= 1,
        "a moving ball was found static: {counts:?}"
    );
    assert_eq!(counts.sent as usize, frames.len() + 1, "{counts:?}");
    assert!(frames.iter().all(|f| f.seq > first.seq));
}

#[tokio::test]
async fn lower_cap_applied_live_thins_the_stream_to_it() {
    let capture = Capture::start_with(
        spec("test://ball?width=320&height=240", 20.0),
        gated(0.0, 0.0),
    )
    .unwrap();
    first_frame(&capture).await;
    collect_until_seen(&capture, 10).await;
    assert_eq!(
        capture.gate_counts().skipped_rate,
        0,
        "at its own rate nothing is capped"
    );
    let limits = CameraLimits {
        max_fps: 5.0,
        ..capture.limits()
    };
    capture.set_limits(limits);
    assert_eq!(capture.limits(), limits);
    // Counted from here on: every frame after this decided under the cap.
    let (before, lo0, hi0) = snapshot(&capture);
    collect_until_seen(&capture, hi0 + 40).await;
    let (after, lo1, hi1) = snapshot(&capture);
    let sent = after.sent - before.sent;
    let seen = hi1 - hi0;
    // 20 fps capped to 5 fps: a quarter, plus the GCRA's one-frame burst.
    assert!(
        sent <= seen / 4 + 2,
        "{sent} of {seen} frames sent under a 5 fps cap"
    );
    assert!(sent >= seen / 4 - 2, "{sent} of {seen} frames sent");
    // Every frame the pipeline produced was decided by the gate, and the
    // cap skipped all it did not send (see `snapshot` for the bounds).
    assert_eq!(
        after.skipped_static, before.skipped_static,
        "no motion gate"
    );
    let decided = decided(&after) - decided(&before);
    let (least, most) = ((lo1 - 1).saturating_sub(hi0), hi1 - (lo0 - 1));
    assert!(
        (least..=most).contains(&decided),
        "{decided} frames decided while {least}..={most} were seen"
    );
}
