//! Frame codecs: a JPEG or PNG frame becomes the raw u8 NHWC tensor the
//! model reads.
//!
//! An encoded frame's `data` is one image file that must decode to exactly
//! the shape the frame declares (`[1,H,W,C]`, u8, NHWC, C 1 or 3), which the
//! backend has already checked against the model ([`check_frame`]). The
//! protocol bounds the file's size but never looks inside it, so the
//! file's header is read first, and its width, height, channels and sample
//! depth are compared with the declared shape before the pixel buffer is
//! allocated: a header claiming 60000×60000 fails its frame having cost the
//! header's parse (the decoders allocate nothing sized by the header's
//! dimensions before that point: zune-jpeg's headers allocate per
//! component, the png crate's a row buffer of at most 128 KiB). The
//! buffer is then exactly the declared shape's bytes.
//!
//! Nothing is converted: a grey (1-channel) file for a 3-channel frame, an
//! RGBA or 16-bit PNG, is refused with both shapes named, because the edge
//! encodes what the model's input spec says and anything else is its bug.
//! An EXIF orientation is not applied: the file's pixels are the frame.
//!
//! [`decode_frame`] is blocking CPU work (about 0.1 ms for a 128×128 JPEG
//! and 1 ms for a 512×512 one, docs/benchmarks.md): the backend calls
//! [`decode_frames`] on the executor's thread, before preprocessing, which
//! spreads a batch over scoped threads, and reports each frame's time in
//! `Timings::decode_us`. Nothing decodes on a tokio thread.
//!
//! [`check_frame`]: crate::backend::check_frame

use std::io::Cursor;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::{Duration, Instant};

use image::codecs::jpeg::JpegDecoder;
use image::codecs::png::PngDecoder;
use image::{ColorType, ImageDecoder, Limits};
use tidegate_protocol::{Codec, DType, Encoding, Layout, Tensor, shape_string};

use crate::runtime::one_line;

/// The codecs this worker decodes, as it advertises them in `Register`.
pub const SUPPORTED: [Codec; 3] = [Codec::Raw, Codec::Jpeg, Codec::Png];

/// What the png crate may allocate besides the pixels (ancillary chunks,
/// its row buffers): far more than any camera frame's metadata needs.
const PNG_SIDE_ALLOC: u64 = 8 * 1024 * 1024;

/// Why an encoded frame could not become its tensor. The text is the
/// frame's failed status.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameDecodeError {
    /// The file's header describes another image than the frame declares
    /// (size, channels or sample depth); nothing was allocated for it.
    #[error(
        "model '{model}' expects u8 {}, frame has {codec} {}{depth}",
        shape_string(declared),
        shape_string(found),
        depth = if *bits == 8 { String::new() } else { format!(" of {bits}-bit samples") }
    )]
    Mismatch {
        /// The model's name.
        model: String,
        /// The codec of the file.
        codec: Codec,
        /// The frame's declared shape, which the model expects.
        declared: Vec<u32>,
        /// `[1,height,width,channels]` as the file's header says.
        found: Vec<u32>,
        /// Bits per sample in the file.
        bits: u32,
    },
    /// The file is not a valid image of its codec (bad header, corrupt or
    /// truncated data).
    #[error("model '{model}': the frame's {encoding} file cannot be decoded: {reason}")]
    Corrupt {
        /// The model's name.
        model: String,
        /// The frame's encoding.
        encoding: Encoding,
        /// The decoder's account, on one line.
        reason: String,
    },
    /// The decoder panicked on the file (a decoder bug, which a hostile
    /// file may find); the other frames are decoded as usual.
    #[error("model '{model}': the decoder panicked on the frame's {encoding} file: {message}")]
    Panicked {
        /// The model's name.
        model: String,
        /// The frame's encoding.
        encoding: Encoding,
        /// The panic's message.
        message: String,
    },
    /// The frame declares a tensor that no image file holds (not u8 NHWC
    /// `[1,H,W,C]` with C 1 or 3). The protocol's decoder refuses such
    /// frames, so this is a frame built in-process.
    #[error(
        "model '{model}': a {encoding} frame must declare u8 nhwc [1,H,W,C] with C 1 or 3, this one declares {dtype} {} {}",
        layout.name(),
        shape_string(shape)
    )]
    NotAnImage {
        /// The model's name.
        model: String,
        /// The frame's encoding.
        encoding: Encoding,
        /// The declared element type.
        dtype: DType,
        /// The declared layout.
        layout: Layout,
        /// The declared shape.
        shape: Vec<u32>,
    },
}

/// Decodes each of `frames` as [`decode_frame`] does, spread over at most
/// `threads` threads (the calling thread and scoped ones that end before
/// this returns), and times each frame on the thread that decodes it. A
/// decoder that panics fails its frame only ([`FrameDecodeError::Panicked`]).
///
/// One thread decodes a batch of 32 CenterNet JPEGs in about 33 ms, as long
/// as the batch runs on an H200 (docs/benchmarks.md), so a batch is spread
/// over the host's cores; a thread starts in tens of microseconds, less
/// than one frame's decode.
pub fn decode_frames(
    model: &str,
    frames: &[&Tensor],
    threads: usize,
) -> Vec<(Result<Tensor, FrameDecodeError>, Duration)> {
    let timed = |tensor: &Tensor| {
        let start = Instant::now();
        let decoded = catch_unwind(AssertUnwindSafe(|| decode_frame(model, tensor)))
            .unwrap_or_else(|panic| {
                Err(FrameDecodeError::Panicked {
                    model: model.to_string(),
                    encoding: tensor.encoding,
                    message: panic_message(&*panic),
                })
            });
        (decoded, start.elapsed())
    };
    let decode_all = |chunk: &[&Tensor]| chunk.iter().map(|t| timed(t)).collect::<Vec<_>>();
    let threads = threads.clamp(1, frames.len().max(1));
    if threads == 1 {
        return decode_all(frames);
    }
    let per_thread = frames.len().div_ceil(threads);
    std::thread::scope(|scope| {
        let mut chunks = frames.chunks(per_thread);
        let own = chunks.next().unwrap_or_default();
        let helpers: Vec<_> = chunks
            .map(|chunk| {
                std::thread::Builder::new()
                    .name("tidegate-decode".into())
                    .spawn_scoped(scope, move || decode_all(chunk))
                    .map_err(|_| chunk)
            })
            .collect();
        let mut out = decode_all(own);
        for helper in helpers {
            match helper {
                // `timed` catches the decoders' panics, so a helper ends
                // normally; were it not so, the panic goes on here.
                Ok(handle) => out.extend(
                    handle
                        .join()
                        .unwrap_or_else(|panic| std::panic::resume_unwind(panic)),
                ),
                // No thread to be had: this one decodes the chunk.
                Err(chunk) => out.extend(decode_all(chunk)),
            }
        }
        out
    })
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}

/// Decodes `tensor`, an encoded frame for `model` (named in errors), into a
/// raw tensor of the shape it declares. A raw tensor comes back as it is
/// (its `Bytes` shared, not copied).
///
/// The declared shape bounds what is allocated, so the caller bounds it:
/// the backend decodes only frames whose shape is the model's input, and
/// the protocol's decoder admits none larger than `max_tensor_bytes`.
pub fn decode_frame(model: &str, tensor: &Tensor) -> Result<Tensor, FrameDecodeError> {
    let codec = tensor.encoding.codec();
    if codec == Codec::Raw {
        return Ok(tensor.clone());
    }
    let corrupt = |e: image::ImageError| FrameDecodeError::Corrupt {
        model: model.to_string(),
        encoding: tensor.encoding,
        reason: one_line(&e.to_string()),
    };
    let declared = match (tensor.dtype, tensor.layout, tensor.shape.as_slice()) {
        (DType::U8, Layout::Nhwc, &[1, h, w, c]) if h > 0 && w > 0 && matches!(c, 1 | 3) => {
            Declared {
                width: w,
                height: h,
                channels: c,
            }
        }
        _ => {
            return Err(FrameDecodeError::NotAnImage {
                model: model.to_string(),
                encoding: tensor.encoding,
                dtype: tensor.dtype,
                layout: tensor.layout,
                shape: tensor.shape.clone(),
            });
        }
    };
    let file = Cursor::new(&tensor.data[..]);
    let pixels = match codec {
        Codec::Jpeg => {
            let decoder = JpegDecoder::new(file).map_err(corrupt)?;
            read_checked(model, codec, &tensor.shape, declared, decoder)
        }
        Codec::Png => {
            let mut limits = Limits::default();
            limits.max_alloc = Some(PNG_SIDE_ALLOC + declared.len() as u64);
            let decoder = PngDecoder::with_limits(file, limits).map_err(corrupt)?;
            read_checked(model, codec, &tensor.shape, declared, decoder)
        }
        Codec::Raw => unreachable!("returned above"),
    }?
    .map_err(corrupt)?;
    Ok(Tensor::raw(
        DType::U8,
        Layout::Nhwc,
        tensor.shape.clone(),
        pixels.into(),
    ))
}

/// The image a frame declares.
#[derive(Debug, Clone, Copy)]
struct Declared {
    width: u32,
    height: u32,
    channels: u32,
}

impl Declared {
    /// Bytes of its pixels.
    fn len(self) -> usize {
        self.width as usize * self.height as usize * self.channels as usize
    }

    /// The colour type the file must decode to.
    fn color_type(self) -> ColorType {
        if self.channels == 1 {
            ColorType::L8
        } else {
            ColorType::Rgb8
        }
    }
}

/// Compares `decoder`'s header with the declared image, and only if they
/// agree allocates the pixels and decodes into them. The outer error is a
/// mismatch, the inner one the decoder's.
fn read_checked(
    model: &str,
    codec: Codec,
    shape: &[u32],
    declared: Declared,
    decoder: impl ImageDecoder,
) -> Result<image::ImageResult<Vec<u8>>, FrameDecodeError> {
    let (width, height) = decoder.dimensions();
    let color = decoder.color_type();
    if (width, height) != (declared.width, declared.height) || color != declared.color_type() {
        let channels = u32::from(color.channel_count());
        return Err(FrameDecodeError::Mismatch {
            model: model.to_string(),
            codec,
            declared: shape.to_vec(),
            found: vec![1, height, width, channels],
            bits: u32::from(color.bits_per_pixel()) / channels.max(1),
        });
    }
    // The header matches, so this is the declared shape's size, which the
    // model's input bounds.
    let mut pixels = vec![0u8; declared.len()];
    Ok(decoder.read_image(&mut pixels).map(|()| pixels))
}

#[cfg(test)]
mod tests {
    use super::*;
    use image::codecs::jpeg::JpegEncoder;
    use image::codecs::png::PngEncoder;
    use image::{ExtendedColorType, ImageEncoder};

    /// A smooth gradient, which JPEG keeps well.
    fn pixels(w: u32, h: u32, channels: u32) -> Vec<u8> {
        (0..h)
            .flat_map(|y| {
                (0..w).flat_map(move |x| (0..channels).map(move |c| (x * 8 + y * 4 + c * 40) as u8))
            })
            .collect()
    }

    fn color(channels: u32) -> ExtendedColorType {
        if channels == 1 {
            ExtendedColorType::L8
        } else {
            ExtendedColorType::Rgb8
        }
    }

    fn png(w: u32, h: u32, channels: u32) -> Vec<u8> {
        let mut out = Vec::new();
        PngEncoder::new(&mut out)
            .write_image(&pixels(w, h, channels), w, h, color(channels))
            .unwrap();
        out
    }

    fn jpeg(w: u32, h: u32, channels: u32) -> Vec<u8> {
        let mut out = Vec::new();
        JpegEncoder::new_with_quality(&mut out, 90)
            .write_image(&pixels(w, h, channels), w, h, color(channels))
            .unwrap();
        out
    }

    fn frame(encoding: Encoding, shape: &[u32], data: Vec<u8>) -> Tensor {
        Tensor {
            encoding,
            ..Tensor::raw(DType::U8, Layout::Nhwc, shape.to_vec(), data.into())
        }
    }

    #[test]
    fn every_codec_advertised_is_decoded() {
        for codec in SUPPORTED {
            let (encoding, data) = match codec {
                Codec::Raw => (Encoding::Raw, pixels(16, 8, 3)),
                Codec::Jpeg => (Encoding::Jpeg { quality: 90 }, jpeg(16, 8, 3)),
                Codec::Png => (Encoding::Png, png(16, 8, 3)),
            };
            let out = decode_frame("m", &frame(encoding, &[1, 8, 16, 3], data))
                .unwrap_or_else(|e| panic!("{codec}: {e}"));
            assert_eq!(
                (out.encoding, out.data.len()),
                (Encoding::Raw, 16 * 8 * 3),
                "{codec}"
            );
        }
    }

    #[test]
    fn png_decodes_to_its_exact_pixels() {
        for channels in [1, 3] {
            let t = frame(Encoding::Png, &[1, 8, 16, channels], png(16, 8, channels));
            let raw = decode_frame("m", &t).unwrap();
            assert_eq!(raw.encoding, Encoding::Raw);
            assert_eq!(raw.shape, [1, 8, 16, channels]);
            assert_eq!(raw.data[..], pixels(16, 8, channels)[..]);
        }
    }

    #[test]
    fn jpeg_decodes_close_to_its_pixels() {
        let t = frame(
            Encoding::Jpeg { quality: 90 },
            &[1, 8, 16, 3],
            jpeg(16, 8, 3),
        );
        let raw = decode_frame("m", &t).unwrap();
        assert_eq!(raw.data.len(), 16 * 8 * 3);
        let worst = raw
            .data
            .iter()
            .zip(pixels(16, 8, 3))
            .map(|(&a, b)| a.abs_diff(b))
            .max()
            .unwrap();
        assert!(worst <= 12, "a pixel is {worst} off");
    }

    #[test]
    fn raw_frame_comes_back_sharing_its_bytes() {
        let t = Tensor::raw(
            DType::U8,
            Layout::Nhwc,
            vec![1, 1, 2, 3],
            vec![1u8; 6].into(),
        );
        let out = decode_frame("m", &t).unwrap();
        assert_eq!(out, t);
        assert_eq!(out.data.as_ptr(), t.data.as_ptr());
    }

    #[test]
    fn a_batch_spread_over_threads_decodes_each_frame_in_its_place() {
        // Frames of different sizes, some bad, so that a mix-up would show.
        let frames: Vec<Tensor> = (1..=7u32)
            .map(|i| match i % 3 {
                0 => frame(Encoding::Png, &[1, 1, 4, 3], b"not a png".to_vec()),
                _ => frame(Encoding::Png, &[1, i, 16, 3], png(16, i, 3)),
            })
            .collect();
        let refs: Vec<&Tensor> = frames.iter().collect();
        let one_by_one: Vec<_> = frames.iter().map(|t| decode_frame("m", t)).collect();
        for threads in [0, 1, 2, 3, 7, 64] {
            let spread: Vec<_> = decode_frames("m", &refs, threads)
                .into_iter()
                .map(|(decoded, _)| decoded)
                .collect();
            assert_eq!(spread, one_by_one, "{threads} threads");
        }
        assert!(decode_frames("m", &[], 4).is_empty());
    }

    #[test]
    fn grey_jpeg_for_a_colour_frame_names_both_shapes() {
        let t = frame(
            Encoding::Jpeg { quality: 90 },
            &[1, 8, 16, 3],
            jpeg(16, 8, 1),
        );
        assert_eq!(
            decode_frame("blazeface", &t).unwrap_err().to_string(),
            "model 'blazeface' expects u8 [1,8,16,3], frame has jpeg [1,8,16,1]"
        );
    }

    #[test]
    fn sixteen_bit_png_is_refused_naming_its_depth() {
        let data: Vec<u8> = vec![0; 16 * 8 * 3 * 2];
        let mut file = Vec::new();
        PngEncoder::new(&mut file)
            .write_image(&data, 16, 8, ExtendedColorType::Rgb16)
            .unwrap();
        let t = frame(Encoding::Png, &[1, 8, 16, 3], file);
        assert_eq!(
            decode_frame("m", &t).unwrap_err().to_string(),
            "model 'm' expects u8 [1,8,16,3], frame has png [1,8,16,3] of 16-bit samples"
        );
    }

    #[test]
    fn rgba_png_is_refused_naming_its_channels() {
        let mut file = Vec::new();
        PngEncoder::new(&mut file)
            .write_image(&[9; 16 * 8 * 4], 16, 8, ExtendedColorType::Rgba8)
            .unwrap();
        let t = frame(Encoding::Png, &[1, 8, 16, 3], file);
        assert_eq!(
            decode_frame("m", &t).unwrap_err().to_string(),
            "model 'm' expects u8 [1,8,16,3], frame has png [1,8,16,4]"
        );
    }

    #[test]
    fn a_png_sent_as_jpeg_is_corrupt() {
        let t = frame(
            Encoding::Jpeg { quality: 50 },
            &[1, 8, 16, 3],
            png(16, 8, 3),
        );
        let err = decode_frame("m", &t).unwrap_err();
        assert!(matches!(err, FrameDecodeError::Corrupt { .. }), "{err:?}");
        assert!(
            err.to_string()
                .starts_with("model 'm': the frame's jpeg (quality 50) file cannot be decoded: "),
            "{err}"
        );
    }

    #[test]
    fn a_jpeg_cut_short_in_its_scan_decodes_leniently() {
        // zune-jpeg, like browsers, fills in what is missing rather than
        // failing; a file cut in its header fails (tests/encodings.rs).
        let full = jpeg(64, 64, 3);
        let cut = full[..full.len() * 3 / 4].to_vec();
        let t = frame(Encoding::Jpeg { quality: 90 }, &[1, 64, 64, 3], cut);
        assert_eq!(decode_frame("m", &t).unwrap().data.len(), 64 * 64 * 3);
    }

    #[test]
    fn a_frame_no_image_holds_is_refused() {
        let mut t = frame(Encoding::Png, &[1, 3, 8, 16], png(16, 8, 3));
        t.layout = Layout::Nchw;
        assert_eq!(
            decode_frame("m", &t).unwrap_err().to_string(),
            "model 'm': a png frame must declare u8 nhwc [1,H,W,C] with C 1 or 3, this one declares u8 nchw [1,3,8,16]"
        );
    }
}
