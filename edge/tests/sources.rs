//! Source kinds and supervision on real pipelines: v4l2 error paths, file
//! looping and end of stream, restart after failure. Every wait is bounded.

#![cfg(feature = "capture")]

use std::time::Duration;

use tidegate_edge::capture::{
    CameraStopped, Capture, CaptureError, CaptureOptions, CaptureSpec, Resize, StreamError,
    SupervisedCapture, SupervisorOptions,
};
use tidegate_testkit::clip;

const WAIT: Duration = Duration::from_secs(15);

fn spec(camera: &str, uri: &str) -> CaptureSpec {
    CaptureSpec {
        camera: camera.into(),
        uri: uri.into(),
        width: 64,
        height: 64,
        resize: Resize::Letterbox,
        max_fps: 10.0,
    }
}

#[tokio::test]
async fn missing_v4l2_device_is_a_clear_retryable_error_for_that_camera() {
    let err = Capture::start(spec("porch", "v4l2:///dev/video-tidegate-none")).unwrap_err();
    assert!(matches!(err, CaptureError::NoDevice { .. }), "{err:?}");
    assert!(err.retryable());
    let msg = err.to_string();
    assert!(
        msg.contains("'porch'")
            && msg.contains("/dev/video-tidegate-none")
            && msg.contains("plugged in"),
        "{msg}"
    );
}

#[tokio::test]
async fn v4l2_pipeline_on_a_device_that_is_not_a_camera_fails_naming_the_camera() {
    // /dev/null is a character device, so the pipeline is built and v4l2src
    // itself refuses it when the pipeline starts: the real error path of a
    // node that is not a capture device.
    let outcome = Capture::start(spec("garage", "v4l2:///dev/null"));
    let msg = match outcome {
        Err(e) => {
            assert!(matches!(e, CaptureError::Start { .. }), "{e:?}");
            e.to_string()
        }
        Ok(capture) => match tokio::time::timeout(WAIT, capture.recv()).await {
            Ok(Err(e)) => {
                assert!(matches!(e, StreamError::Pipeline { .. }), "{e:?}");
                e.to_string()
            }
            Ok(Ok(f)) => panic!("a frame from /dev/null: {f:?}"),
            Err(_) => panic!("no error from v4l2src on /dev/null within {WAIT:?}"),
        },
    };
    assert!(
        msg.contains("'garage'") && msg.contains("/dev/null"),
        "{msg}"
    );
}

/// Writes a 0.5 s, 30 fps MJPEG AVI.
fn write_clip(path: &std::path::Path) {
    clip::write_clip_at(path, 15, "30/1");
}

fn options(loop_file: bool) -> SupervisorOptions {
    SupervisorOptions {
        capture: CaptureOptions {
            queue_depth: 64,
            ..CaptureOptions::default()
        },
        loop_file,
        restart_base: Duration::from_millis(50),
        restart_max: Duration::from_millis(500),
        stall_timeout: Duration::from_secs(5),
    }
}

#[tokio::test]
async fn looping_file_plays_again_with_increasing_seq() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("clip.avi");
    write_clip(&path);
    let mut cam = SupervisedCapture::new(
        spec("lobby", &format!("file://{}", path.display())),
        options(true),
    )
    .unwrap();
    let mut seqs = Vec::new();
    // ~5 frames per pass at 10 fps: 16 frames need at least three passes.
    while seqs.len() < 16 {
        let f = tokio::time::timeout(WAIT, cam.recv())
            .await
            .expect("looping file keeps producing")
            .expect("looping file never ends");
        seqs.push(f.seq);
    }
    assert!(seqs.windows(2).all(|w| w[1] > w[0]), "{seqs:?}");
    let c = cam.counters();
    assert!(c.restarts >= 2, "{c:?}");
    assert_eq!(c.limits.unwrap().max_fps, 10.0);
}

#[tokio::test]
async fn file_without_loop_ends_the_camera_after_its_frames() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("clip.avi");
    write_clip(&path);
    let mut cam = SupervisedCapture::new(
        spec("lobby", &format!("file://{}", path.display())),
        options(false),
    )
    .unwrap();
    let mut frames = 0;
    let end = loop {
        match tokio::time::timeout(WAIT, cam.recv())
            .await
            .expect("bounded")
        {
            Ok(_) => frames += 1,
            Err(e) => break e,
        }
    };
    assert!(matches!(end, CameraStopped::Ended(_)), "{end:?}");
    assert!((2..=8).contains(&frames), "{frames}");
    assert_eq!(cam.counters().restarts, 0, "an end is not a restart");
}

#[tokio::test]
async fn missing_file_stops_only_that_supervised_camera_with_a_clear_error() {
    let mut bad = SupervisedCapture::new(
        spec("attic", "file:///nonexistent/tidegate/clip.mp4"),
        options(true),
    )
    .unwrap();
    let mut good = SupervisedCapture::new(spec("hall", "test://ball"), options(false)).unwrap();
    let err = tokio::time::timeout(WAIT, bad.recv())
        .await
        .expect("bounded")
        .unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, CameraStopped::Start(CaptureError::Unreadable { .. }))
            && msg.contains("'attic'")
            && msg.contains("/nonexistent/tidegate/clip.mp4"),
        "{msg}"
    );
    for _ in 0..3 {
        tokio::time::timeout(WAIT, good.recv())
            .await
            .expect("the other camera runs")
            .expect("the other camera runs");
    }
    assert!(
        SupervisedCapture::new(spec("x", "gopher://h/x"), options(false)).is_err(),
        "a bad URI is refused at once"
    );
}

/// The most restarts a supervisor with `o` can make within `elapsed` of its
/// creation if its delays double as they should (each is at least half of
/// its step, the step doubling from `restart_base` to `restart_max`), when
/// each pipeline also takes at least `up` to fail. An upper bound: a slow
/// machine only makes fewer.
fn most_restarts_within(elapsed: Duration, up: Duration, o: &SupervisorOptions) -> u64 {
    let mut step = o.restart_base;
    let mut at = Duration::ZERO;
    // Bounded: `at` grows by at least restart_base / 2 a turn.
    for n in 0..10_000 {
        at += up;
        if at > elapsed {
            return n;
        }
        at += step / 2;
        step = (step * 2).min(o.restart_max);
    }
    10_000
}

/// Polls `cam` (cancel-safe `recv`, in slices) until `done` holds for its
/// counters or `WAIT` passes; a frame or an end is a failure.
async fn restart_until(cam: &mut SupervisedCapture, done: impl Fn(u64) -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !done(cam.counters().restarts) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} restarts in {WAIT:?}",
            cam.counters().restarts
        );
        match tokio::time::timeout(Duration::from_millis(100), cam.recv()).await {
            Ok(Ok(f)) => panic!("a frame from a failing source: {f:?}"),
            Ok(Err(e)) => panic!("gave up: {e}"),
            Err(_) => {}
        }
    }
}

#[tokio::test]
async fn failing_pipeline_is_restarted_with_backoff() {
    // An undecodable image fails every start: the supervisor retries it
    // (the file exists, so it is not a configuration error) and counts.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("broken.png");
    std::fs::write(&path, b"not a png").unwrap();
    let opts = SupervisorOptions {
        restart_base: Duration::from_millis(50),
        restart_max: Duration::from_secs(2),
        ..options(false)
    };
    let started = tokio::time::Instant::now();
    let mut cam =
        SupervisedCapture::new(spec("shed", &format!("image://{}", path.display())), opts).unwrap();
    restart_until(&mut cam, |n| n >= 3).await;
    // Keep it failing for a while: the delays double, so the restarts thin
    // out (at a constant 25-50 ms there would be dozens).
    let window = Duration::from_secs(2);
    restart_until(&mut cam, |_| started.elapsed() >= window).await;
    let restarts = cam.counters().restarts;
    let most = most_restarts_within(started.elapsed(), Duration::ZERO, &opts);
    assert!(
        restarts <= most,
        "{restarts} restarts in {:?}: the delays do not double (at most {most})",
        started.elapsed()
    );
    // Once the file is fixed, the next restart picks it up.
    std::fs::copy(
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../models/testdata/astronaut.png"
        ),
        &path,
    )
    .unwrap();
    let f = tokio::time::timeout(WAIT, cam.recv())
        .await
        .expect("recovers once the file is good")
        .expect("recovers");
    assert_eq!(f.data.len(), 64 * 64 * 3);
}

/// A source that delivers one frame and then nothing (a clip at one frame a
/// minute stalls after its first frame) is restarted with growing delays:
/// a frame alone does not start the backoff again, only a pipeline that has
/// delivered frames for `restart_max`.
#[tokio::test]
async fn a_source_that_fails_right_after_its_first_frame_backs_off() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("slow.avi");
    clip::write_clip_at(&path, 2, "1/60");
    let opts = SupervisorOptions {
        restart_base: Duration::from_millis(200),
        restart_max: Duration::from_secs(10),
        stall_timeout: Duration::from_millis(100),
        ..options(false)
    };
    let started = tokio::time::Instant::now();
    let mut cam =
        SupervisedCapture::new(spec("alley", &format!("file://{}", path.display())), opts).unwrap();
    let window = Duration::from_secs(5);
    let mut frames = 0u64;
    while started.elapsed() < window {
        match tokio::time::timeout(Duration::from_millis(100), cam.recv()).await {
            Ok(Ok(_)) => frames += 1,
            Ok(Err(e)) => panic!("gave up: {e}"),
            Err(_) => {}
        }
    }
    let restarts = cam.counters().restarts;
    assert!(
        restarts >= 2 && frames >= 2,
        "{restarts} restarts, {frames} frames"
    );
    // Each pipeline runs at least one stall timeout before it is restarted.
    let most = most_restarts_within(started.elapsed(), opts.stall_timeout, &opts);
    assert!(
        restarts <= most,
        "{restarts} restarts in {:?} ({frames} frames): the backoff starts again at every \
         frame (at most {most} if the delays double)",
        started.elapsed()
    );
}

#[tokio::test]
async fn a_recv_dropped_while_the_pipeline_starts_leaves_the_start_to_the_next_recv() {
    let mut cam = SupervisedCapture::new(spec("porch", "test://ball"), options(false)).unwrap();
    // Each recv is polled once and dropped: the start it began runs on a
    // blocking thread, and a later recv picks it up instead of starting
    // another (or losing it, which would leave the camera without frames).
    let deadline = tokio::time::Instant::now() + WAIT;
    let frame = loop {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no frame within {WAIT:?} of recvs dropped at once"
        );
        match tokio::time::timeout(Duration::ZERO, cam.recv()).await {
            Ok(f) => break f.expect("the test source runs"),
            Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    };
    assert_eq!(frame.seq, 0, "the first frame of the first pipeline");
    assert!(cam.is_running());
    assert_eq!(cam.counters().restarts, 0, "{:?}", cam.counters());
}
