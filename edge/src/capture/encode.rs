//! Encodes a camera's frames as JPEG or PNG, after the capture pipeline has
//! scaled, letterboxed and gated them: the image encoded is exactly the
//! RGB width×height frame that raw mode sends.
//!
//! ```text
//!   camera task ──Job (pixels, quality)──► bounded channel (1)
//!        ▲                                     │
//!        └──── oneshot (bytes, time) ◄── encoder thread "encode-<camera>":
//!                                          appsrc ! jpegenc|pngenc ! appsink
//! ```
//!
//! The encoder pipeline is separate from the capture pipeline because the
//! motion gate works on pixels, frames the gate skips are never encoded,
//! and the appsink callback must never block. It runs on a dedicated
//! `std::thread` per camera, never on a tokio worker: the camera task
//! awaits the answer. Every frame is encoded alone (JPEG and PNG have no
//! inter-frame prediction), one at a time: the thread pushes the frame,
//! then pulls its encoded sample, so a quality set for a frame
//! (`jpegenc`'s `quality` may change while playing) applies to exactly
//! that frame. A frame that fails (an element error, no output within
//! [`ENCODE_TIMEOUT`]) fails alone: the error says why, and the pipeline
//! is built afresh for the next frame.

use std::time::{Duration, Instant};

use bytes::Bytes;
use gstreamer as gst;
use gstreamer::prelude::*;
use gstreamer_app as gst_app;
use gstreamer_video as gst_video;
use tidegate_protocol::{Codec, Encoding};
use tokio::sync::{mpsc, oneshot};

use super::init_gstreamer;

/// How long the encoder thread waits for one frame's output before it
/// gives up on the frame and rebuilds its pipeline. Far above a frame's
/// encoding time (about a millisecond at 128×128), far below a stall
/// that would go unnoticed.
pub const ENCODE_TIMEOUT: Duration = Duration::from_secs(2);

/// Why a frame (or the encoder) failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EncodeError {
    /// A GStreamer element is not installed.
    #[error(
        "camera '{camera}': GStreamer element '{element}' is missing; install {package} to encode frames as {codec}, or set `encoding = \"raw\"`"
    )]
    MissingElement {
        /// Camera name.
        camera: String,
        /// The element factory.
        element: String,
        /// Debian package that ships it.
        package: String,
        /// The codec asked for.
        codec: Codec,
    },
    /// The encoder pipeline could not be built or started.
    #[error("camera '{camera}': cannot start the {codec} encoder: {reason}")]
    Build {
        /// Camera name.
        camera: String,
        /// The codec asked for.
        codec: Codec,
        /// What failed.
        reason: String,
    },
    /// Raw frames are not encoded.
    #[error("camera '{camera}': raw frames need no encoder")]
    Raw {
        /// Camera name.
        camera: String,
    },
    /// The frame is not the size the encoder was started for.
    #[error(
        "camera '{camera}': a frame of {actual} bytes reached the {width}x{height} RGB encoder, which takes {expected}"
    )]
    Size {
        /// Camera name.
        camera: String,
        /// Encoder width.
        width: u32,
        /// Encoder height.
        height: u32,
        /// Bytes expected.
        expected: usize,
        /// Bytes given.
        actual: usize,
    },
    /// The encoder failed on this frame.
    #[error(
        "camera '{camera}': encoding a frame as {codec} failed: {reason}; the frame is dropped"
    )]
    Failed {
        /// Camera name.
        camera: String,
        /// The codec.
        codec: Codec,
        /// The element's message, or what went wrong.
        reason: String,
    },
    /// The encoder thread has stopped.
    #[error("camera '{camera}': the encoder thread has stopped")]
    Stopped {
        /// Camera name.
        camera: String,
    },
    /// The encoder thread could not be started.
    #[error("camera '{camera}': cannot start the encoder thread: {reason}")]
    Thread {
        /// Camera name.
        camera: String,
        /// The OS's reason.
        reason: String,
    },
}

impl EncodeError {
    /// Whether only this frame failed (the encoder goes on).
    pub fn frame_only(&self) -> bool {
        matches!(self, EncodeError::Failed { .. } | EncodeError::Size { .. })
    }
}

/// One encoded frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Encoded {
    /// One self-contained JPEG or PNG file.
    pub data: Bytes,
    /// How it is encoded (JPEG: the quality used).
    pub encoding: Encoding,
    /// Time on the encoder thread, from handing the frame to the encoder to
    /// its output.
    pub took: Duration,
}

struct Job {
    pixels: Bytes,
    quality: u8,
    reply: oneshot::Sender<Result<Encoded, EncodeError>>,
}

/// A camera's encoder: a dedicated thread running `appsrc ! jpegenc|pngenc
/// ! appsink`. Dropping it stops the thread once its frame in hand (if
/// any) is done.
#[derive(Debug)]
pub struct FrameEncoder {
    camera: String,
    codec: Codec,
    width: u32,
    height: u32,
    jobs: mpsc::Sender<Job>,
}

impl FrameEncoder {
    /// Starts the encoder of `camera` for `width`×`height` packed RGB
    /// frames, checking that its elements exist and its pipeline starts.
    pub async fn start(
        camera: &str,
        codec: Codec,
        width: u32,
        height: u32,
    ) -> Result<Self, EncodeError> {
        if codec == Codec::Raw {
            return Err(EncodeError::Raw {
                camera: camera.into(),
            });
        }
        // One frame at a time: the camera task awaits each answer.
        let (jobs, rx) = mpsc::channel::<Job>(1);
        let (ready_tx, ready) = oneshot::channel();
        let shape = Shape {
            camera: camera.to_string(),
            codec,
            width,
            height,
        };
        let span = tracing::info_span!("encoder", camera = %camera, %codec);
        std::thread::Builder::new()
            .name(format!("encode-{camera}"))
            .spawn(move || {
                let _entered = span.enter();
                run(shape, rx, ready_tx);
            })
            .map_err(|e| EncodeError::Thread {
                camera: camera.into(),
                reason: e.to_string(),
            })?;
        ready.await.map_err(|_| EncodeError::Stopped {
            camera: camera.into(),
        })??;
        Ok(FrameEncoder {
            camera: camera.to_string(),
            codec,
            width,
            height,
            jobs,
        })
    }

    /// The codec.
    pub fn codec(&self) -> Codec {
        self.codec
    }

    /// The frame size it takes.
    pub fn size(&self) -> (u32, u32) {
        (self.width, self.height)
    }

    /// Encodes one packed RGB frame (`height` rows of `width × 3` bytes);
    /// `quality` (1–100) is used for JPEG and ignored for PNG.
    pub async fn encode(&self, pixels: Bytes, quality: u8) -> Result<Encoded, EncodeError> {
        let expected = self.width as usize * self.height as usize * 3;
        if pixels.len() != expected {
            return Err(EncodeError::Size {
                camera: self.camera.clone(),
                width: self.width,
                height: self.height,
                expected,
                actual: pixels.len(),
            });
        }
        let (reply, answer) = oneshot::channel();
        let stopped = || EncodeError::Stopped {
            camera: self.camera.clone(),
        };
        self.jobs
            .send(Job {
                pixels,
                quality: quality.clamp(1, Encoding::MAX_QUALITY),
                reply,
            })
            .await
            .map_err(|_| stopped())?;
        answer.await.map_err(|_| stopped())?
    }
}

#[derive(Debug, Clone)]
struct Shape {
    camera: String,
    codec: Codec,
    width: u32,
    height: u32,
}

/// The encoder thread: builds the pipeline, says whether it could, then
/// encodes jobs until the sender is dropped.
fn run(
    shape: Shape,
    mut jobs: mpsc::Receiver<Job>,
    ready: oneshot::Sender<Result<(), EncodeError>>,
) {
    let mut pipeline = match EncoderPipeline::build(&shape) {
        Ok(p) => Some(p),
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    if ready.send(Ok(())).is_err() {
        return;
    }
    while let Some(job) = jobs.blocking_recv() {
        let p = match pipeline.take() {
            Some(p) => Ok(p),
            None => EncoderPipeline::build(&shape),
        };
        let outcome = p.and_then(|mut p| {
            let r = p.encode(&shape, job.pixels, job.quality);
            if r.is_ok() {
                // A failed pipeline is dropped (stopped) and built afresh
                // for the next frame: no stale output can follow.
                pipeline = Some(p);
            }
            r
        });
        let _ = job.reply.send(outcome);
    }
    tracing::debug!("encoder stopped");
}

/// An element of the encoder pipeline, or the error naming its package.
fn make(shape: &Shape, factory: &str) -> Result<gst::Element, EncodeError> {
    gst::ElementFactory::make(factory)
        .build()
        .map_err(|_| EncodeError::MissingElement {
            camera: shape.camera.clone(),
            element: factory.into(),
            package: match factory {
                "jpegenc" | "pngenc" => "gstreamer1.0-plugins-good",
                _ => "gstreamer1.0-plugins-base",
            }
            .into(),
            codec: shape.codec,
        })
}

struct EncoderPipeline {
    pipeline: gst::Pipeline,
    src: gst_app::AppSrc,
    encoder: gst::Element,
    sink: gst_app::AppSink,
    quality: Option<u8>,
    frames: u64,
}

impl Drop for EncoderPipeline {
    fn drop(&mut self) {
        let _ = self.pipeline.set_state(gst::State::Null);
    }
}

impl EncoderPipeline {
    fn build(shape: &Shape) -> Result<Self, EncodeError> {
        let build_error = |reason: String| EncodeError::Build {
            camera: shape.camera.clone(),
            codec: shape.codec,
            reason,
        };
        init_gstreamer().map_err(|e| build_error(e.to_string()))?;
        let factory = match shape.codec {
            Codec::Jpeg => "jpegenc",
            Codec::Png => "pngenc",
            Codec::Raw => {
                return Err(EncodeError::Raw {
                    camera: shape.camera.clone(),
                });
            }
        };
        let encoder = make(shape, factory)?;
        let caps = gst_video::VideoCapsBuilder::new()
            .format(gst_video::VideoFormat::Rgb)
            .width(shape.width as i32)
            .height(shape.height as i32)
            .framerate(gst::Fraction::new(0, 1))
            .build();
        let src = gst_app::AppSrc::builder()
            .name("src")
            .caps(&caps)
            .format(gst::Format::Time)
            .is_live(false)
            .block(false)
            .build();
        let sink = gst_app::AppSink::builder()
            .name("sink")
            .sync(false)
            .max_buffers(2)
            .enable_last_sample(false)
            .build();
        let pipeline = gst::Pipeline::with_name(&format!("encode-{}", shape.camera));
        let mut chain: Vec<gst::Element> = vec![src.clone().upcast()];
        if shape.codec == Codec::Jpeg {
            // jpegenc codes RGB input as RGB, without the YCbCr transform
            // that JPEG's compression is built on: twice the bytes of
            // 4:4:4 YCbCr, and 2.6 times those of 4:2:0. 4:2:0 is what
            // every camera's video already is, and what any JPEG decoder
            // expects.
            let convert = make(shape, "videoconvert")?;
            let yuv = make(shape, "capsfilter")?;
            // JPEG's (JFIF's) YCbCr is BT.601 over the full 0–255 range,
            // not video's 16–235: decoders assume it.
            let jfif = gst_video::VideoColorimetry::new(
                gst_video::VideoColorRange::Range0_255,
                gst_video::VideoColorMatrix::Bt601,
                gst_video::VideoTransferFunction::Unknown,
                gst_video::VideoColorPrimaries::Unknown,
            );
            yuv.set_property(
                "caps",
                gst::Caps::builder("video/x-raw")
                    .field("format", gst_video::VideoFormat::I420.to_str())
                    .field("colorimetry", jfif.to_string())
                    .build(),
            );
            chain.extend([convert, yuv]);
        }
        chain.extend([encoder.clone(), sink.clone().upcast()]);
        pipeline
            .add_many(&chain)
            .map_err(|e| build_error(e.to_string()))?;
        gst::Element::link_many(&chain)
            .map_err(|e| build_error(format!("linking appsrc → {factory} → appsink: {e}")))?;
        let p = EncoderPipeline {
            pipeline,
            src,
            encoder,
            sink,
            quality: None,
            frames: 0,
        };
        if p.pipeline.set_state(gst::State::Playing).is_err() {
            return Err(build_error(p.bus_error().unwrap_or_else(|| {
                "the state change to PLAYING failed without an error message".into()
            })));
        }
        Ok(p)
    }

    /// The first error on the bus, if any.
    fn bus_error(&self) -> Option<String> {
        let bus = self.pipeline.bus()?;
        let msg = bus.pop_filtered(&[gst::MessageType::Error])?;
        let gst::MessageView::Error(e) = msg.view() else {
            return None;
        };
        Some(match e.debug() {
            Some(d) => format!("{} ({d})", e.error()),
            None => e.error().to_string(),
        })
    }

    fn encode(
        &mut self,
        shape: &Shape,
        pixels: Bytes,
        quality: u8,
    ) -> Result<Encoded, EncodeError> {
        let failed = |reason: String| EncodeError::Failed {
            camera: shape.camera.clone(),
            codec: shape.codec,
            reason,
        };
        let encoding = match shape.codec {
            Codec::Jpeg => {
                if self.quality != Some(quality) {
                    self.encoder.set_property("quality", i32::from(quality));
                    self.quality = Some(quality);
                }
                Encoding::Jpeg { quality }
            }
            _ => Encoding::Png,
        };
        let mut buffer = gst::Buffer::from_slice(pixels);
        {
            let b = buffer
                .get_mut()
                .ok_or_else(|| failed("a new buffer is not writable".into()))?;
            // Frames arrive one at a time; their timestamps only need to
            // increase.
            b.set_pts(gst::ClockTime::from_mseconds(self.frames));
            // The rows are tightly packed, which GStreamer's default RGB
            // stride (rows padded to 4 bytes) is not for every width.
            gst_video::VideoMeta::add_full(
                b,
                gst_video::VideoFrameFlags::empty(),
                gst_video::VideoFormat::Rgb,
                shape.width,
                shape.height,
                &[0],
                &[(shape.width * 3) as i32],
            )
            .map_err(|e| failed(format!("describing the frame: {e}")))?;
        }
        self.frames += 1;
        let started = Instant::now();
        self.src.push_buffer(buffer).map_err(|e| {
            failed(
                self.bus_error()
                    .unwrap_or_else(|| format!("the encoder refused the frame: {e:?}")),
            )
        })?;
        let timeout = gst::ClockTime::from_nseconds(ENCODE_TIMEOUT.as_nanos() as u64);
        let Some(sample) = self.sink.try_pull_sample(timeout) else {
            return Err(failed(
                self.bus_error()
                    .unwrap_or_else(|| format!("no output within {ENCODE_TIMEOUT:?}")),
            ));
        };
        let took = started.elapsed();
        let buffer = sample
            .buffer()
            .ok_or_else(|| failed("the encoder's sample has no buffer".into()))?;
        let map = buffer
            .map_readable()
            .map_err(|e| failed(format!("cannot read the encoded frame: {e}")))?;
        if map.is_empty() {
            return Err(failed("the encoder produced an empty frame".into()));
        }
        Ok(Encoded {
            data: Bytes::copy_from_slice(map.as_slice()),
            encoding,
            took,
        })
    }
}
