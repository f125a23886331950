//! Runs one camera's capture path exactly as tidegate-edge does — the
//! GStreamer pipeline, the rate cap and motion gate, the one copy into
//! `Bytes`, the mailbox and the async consumer — on a source until it ends,
//! and prints how many frames it delivered. `scripts/bench-edge.sh` times it
//! against `gst-launch-1.0` running the same pipeline into `fakesink`.
//!
//! Usage: bench_capture URI WIDTH HEIGHT [MAX_FPS] [MOTION_THRESHOLD]

use tidegate_edge::capture::{Capture, CaptureOptions, CaptureSpec, Resize, StreamError};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 4 {
        return Err("usage: bench_capture URI WIDTH HEIGHT [MAX_FPS] [MOTION_THRESHOLD]".into());
    }
    let spec = CaptureSpec {
        camera: "bench".into(),
        uri: args[1].clone(),
        width: args[2].parse()?,
        height: args[3].parse()?,
        resize: Resize::Letterbox,
        max_fps: args.get(4).map(|s| s.parse()).transpose()?.unwrap_or(30.0),
    };
    let options = CaptureOptions {
        // Deep enough that a slow consumer never drops: every frame counts.
        queue_depth: 64,
        motion_threshold: args.get(5).map(|s| s.parse()).transpose()?.unwrap_or(0.0),
        keepalive_fps: 1.0,
        ..CaptureOptions::default()
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (frames, bytes, seen) = rt.block_on(async move {
        let capture = Capture::start_with(spec, options)?;
        let (mut frames, mut bytes) = (0u64, 0usize);
        loop {
            match capture.recv().await {
                Ok(f) => {
                    frames += 1;
                    bytes += f.data.len();
                }
                Err(StreamError::EndOfStream { .. }) => break,
                Err(e) => return Err(Box::new(e) as Box<dyn std::error::Error>),
            }
        }
        Ok((frames, bytes, capture.frames_seen()))
    })?;
    println!("frames={frames} seen={seen} bytes={bytes}");
    Ok(())
}
