//! JPEG and PNG frames through the real backend: the real models on the real
//! ONNX Runtime, as in blazeface.rs and centernet.rs (`make setup` fetches
//! both models, astronaut.png and the vtest frames; without them these tests
//! fail with that fix).
//!
//! - detections from an encoded frame agree with the raw frame's: exactly
//!   for PNG (lossless), within 2 source pixels (BlazeFace) or one person
//!   (CenterNet) for JPEG at quality 90;
//! - a corrupt file, a header of another size or channel count, and a
//!   header claiming 60000×60000 each fail their own frame, naming what
//!   was wrong, and the rest of the batch is served;
//! - a hostile header is refused before anything sized by it is allocated
//!   (a counting allocator watches `codec::decode_frame`);
//! - `Timings::decode_us` is above 0 for every encoded frame, 0 for raw.
//!
//! Frames are encoded with the image crate's JpegEncoder and PngEncoder;
//! the edge encodes with GStreamer's jpegenc and pngenc, which the worker
//! decodes the same way (any baseline JPEG, any 8-bit PNG).

use std::path::{Path, PathBuf};

use image::codecs::jpeg::JpegEncoder;
use image::codecs::png::PngEncoder;
use image::imageops::{self, FilterType};
use image::{ExtendedColorType, ImageEncoder, RgbImage};
use tidegate_protocol::{DType, Detection, Encoding, Geometry, Layout, Status, Tensor};
use tidegate_worker::backend::{Backend, FrameInput, FrameOutcome, OrtBackend};
use tidegate_worker::codec::{self, FrameDecodeError};
use tidegate_worker::model::Repository;
use tidegate_worker::runtime::RuntimeOptions;

/// A global allocator that, on a thread that asks for it, records the
/// largest single allocation.
#[allow(unsafe_code)]
mod counting {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::cell::Cell;

    thread_local! {
        /// `Some(largest so far)` while this thread is watched. A const
        /// initialiser without a destructor, so reading it never allocates.
        static LARGEST: Cell<Option<usize>> = const { Cell::new(None) };
    }

    fn note(size: usize) {
        let _ = LARGEST.try_with(|c| {
            if let Some(m) = c.get() {
                c.set(Some(m.max(size)));
            }
        });
    }

    /// The system allocator, noting each request's size.
    pub struct Counting;

    // SAFETY: every call is passed to `System` unchanged.
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            note(layout.size());
            unsafe { System.alloc(layout) }
        }

        unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
            note(layout.size());
            unsafe { System.alloc_zeroed(layout) }
        }

        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            note(new_size);
            unsafe { System.realloc(ptr, layout, new_size) }
        }

        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            unsafe { System.dealloc(ptr, layout) }
        }
    }

    /// Runs `f` and returns its result with the largest allocation this
    /// thread made meanwhile, in bytes.
    pub fn largest_allocation<T>(f: impl FnOnce() -> T) -> (T, usize) {
        LARGEST.with(|c| c.set(Some(0)));
        let out = f();
        let largest = LARGEST.with(|c| c.replace(None)).unwrap_or(0);
        (out, largest)
    }
}

#[global_allocator]
static ALLOCATOR: counting::Counting = counting::Counting;

fn models_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../models")
}

/// `model`'s backend; panics with the fix when the model is missing.
fn backend(model: &str, threads: usize) -> OrtBackend {
    let repo = Repository::load(&models_dir(), Some(&[model.to_string()]))
        .unwrap_or_else(|e| panic!("{e}"));
    let options = RuntimeOptions {
        intra_threads: threads,
        warmup_runs: 1,
        ..RuntimeOptions::default()
    };
    OrtBackend::open(&repo, &options).unwrap_or_else(|e| panic!("{e}"))
}

fn image(path: &Path) -> RgbImage {
    image::open(path)
        .unwrap_or_else(|e| {
            panic!(
                "{}: {e}; run `make setup` (scripts/test-video.sh extracts the vtest frames)",
                path.display()
            )
        })
        .to_rgb8()
}

/// BlazeFace's frame of astronaut.png, as blazeface.rs makes it: 512×512
/// resized to 128×128 (square, so the letterbox fills it).
fn astronaut() -> FrameInput {
    let img = image(&models_dir().join("testdata/astronaut.png"));
    let small = imageops::resize(&img, 128, 128, FilterType::Triangle);
    raw(small, Geometry::letterbox(512, 512, 128, 128))
}

/// A vtest frame letterboxed into CenterNet's 512×512, as the edge does.
fn vtest(second: &str) -> FrameInput {
    let img = image(&models_dir().join(format!("testdata/vtest/frame-{second}.png")));
    let (w, h) = img.dimensions();
    let g = Geometry::letterbox(w, h, 512, 512);
    let content = imageops::resize(
        &img,
        g.content_width,
        g.content_height,
        FilterType::Triangle,
    );
    let mut canvas = RgbImage::new(512, 512);
    imageops::replace(
        &mut canvas,
        &content,
        i64::from(g.content_x),
        i64::from(g.content_y),
    );
    raw(canvas, g)
}

fn raw(pixels: RgbImage, geometry: Geometry) -> FrameInput {
    let (w, h) = pixels.dimensions();
    FrameInput {
        tensor: Tensor::raw(
            DType::U8,
            Layout::Nhwc,
            vec![1, h, w, 3],
            pixels.into_raw().into(),
        ),
        geometry,
    }
}

/// The file of `pixels` (`channels` 1 or 3) in `encoding`.
fn file(pixels: &[u8], w: u32, h: u32, channels: u32, encoding: Encoding) -> Vec<u8> {
    let color = match channels {
        1 => ExtendedColorType::L8,
        _ => ExtendedColorType::Rgb8,
    };
    let mut out = Vec::new();
    match encoding {
        Encoding::Jpeg { quality } => JpegEncoder::new_with_quality(&mut out, quality)
            .write_image(pixels, w, h, color)
            .unwrap(),
        Encoding::Png => PngEncoder::new(&mut out)
            .write_image(pixels, w, h, color)
            .unwrap(),
        Encoding::Raw => out.extend_from_slice(pixels),
    }
    out
}

/// `frame` with its pixels encoded, declaring the same shape.
fn encoded(frame: &FrameInput, encoding: Encoding) -> FrameInput {
    let t = &frame.tensor;
    let (h, w) = (t.shape[1], t.shape[2]);
    with_file(frame, encoding, file(&t.data, w, h, 3, encoding))
}

/// `frame` declaring its shape, carrying `data` as a file in `encoding`.
fn with_file(frame: &FrameInput, encoding: Encoding, data: Vec<u8>) -> FrameInput {
    FrameInput {
        tensor: Tensor {
            encoding,
            data: data.into(),
            ..frame.tensor.clone()
        },
        geometry: frame.geometry,
    }
}

const Q90: Encoding = Encoding::Jpeg { quality: 90 };

fn ok(outcome: &FrameOutcome) -> &[Detection] {
    assert_eq!(outcome.status, Status::Ok, "{outcome:?}");
    &outcome.detections
}

fn failed(outcome: &FrameOutcome) -> &str {
    match &outcome.status {
        Status::Failed(reason) => reason,
        other => panic!("expected a failure, got {other:?}: {outcome:?}"),
    }
}

/// The offset of the height in a JPEG's SOF0 segment (then the width),
/// found by walking the segments from SOI.
fn jpeg_sof_dims(jpeg: &[u8]) -> usize {
    let mut i = 2;
    loop {
        assert_eq!(jpeg[i], 0xFF, "not a marker at {i}");
        let marker = jpeg[i + 1];
        if marker == 0xC0 {
            // FF C0, length (2), precision (1), height (2), width (2).
            return i + 5;
        }
        assert_ne!(marker, 0xDA, "no SOF0 before the scan");
        i += 2 + usize::from(u16::from_be_bytes([jpeg[i + 2], jpeg[i + 3]]));
    }
}

/// `jpeg` with its header saying `width`×`height`.
fn jpeg_claiming(jpeg: &[u8], width: u16, height: u16) -> Vec<u8> {
    let mut out = jpeg.to_vec();
    let at = jpeg_sof_dims(&out);
    out[at..at + 2].copy_from_slice(&height.to_be_bytes());
    out[at + 2..at + 4].copy_from_slice(&width.to_be_bytes());
    out
}

/// CRC-32 (ISO-HDLC), as PNG chunks carry it.
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// `png` with its IHDR saying `width`×`height`, its CRC made valid again.
fn png_claiming(png: &[u8], width: u32, height: u32) -> Vec<u8> {
    let mut out = png.to_vec();
    // Signature (8), length (4), "IHDR" (4), width, height, 5 more bytes, CRC.
    assert_eq!(&out[12..16], b"IHDR");
    out[16..20].copy_from_slice(&width.to_be_bytes());
    out[20..24].copy_from_slice(&height.to_be_bytes());
    let crc = crc32(&out[12..29]);
    out[29..33].copy_from_slice(&crc.to_be_bytes());
    out
}

#[test]
fn a_quality_90_jpeg_of_the_astronaut_gives_blazeface_s_faces_within_2_px_of_raw() {
    let mut backend = backend("blazeface", 1);
    let raw = astronaut();
    let jpeg = encoded(&raw, Q90);
    println!(
        "astronaut 128×128: raw {} bytes, jpeg q90 {} bytes",
        raw.tensor.data.len(),
        jpeg.tensor.data.len()
    );
    let out = backend.run("blazeface", &[raw, jpeg]);
    let (want, got) = (ok(&out[0]), ok(&out[1]));
    assert_eq!(got.len(), want.len(), "raw {want:?}, jpeg {got:?}");
    assert_eq!(want.len(), 1, "{want:?}");
    for (g, w) in got.iter().zip(want) {
        let corners = [g.x1 - w.x1, g.y1 - w.y1, g.x2 - w.x2, g.y2 - w.y2];
        let keypoints = g
            .keypoints
            .iter()
            .zip(&w.keypoints)
            .flat_map(|(a, b)| [a[0] - b[0], a[1] - b[1]]);
        let worst = corners
            .into_iter()
            .chain(keypoints)
            .map(f32::abs)
            .fold(0.0, f32::max);
        println!(
            "score raw {:.4}, jpeg {:.4}; largest corner or keypoint shift {worst:.2} px",
            w.score, g.score
        );
        assert_eq!(g.keypoints.len(), w.keypoints.len());
        assert!(worst <= 2.0, "{worst} px off: raw {w:?}, jpeg {g:?}");
        assert_eq!(g.class, w.class);
    }
}

#[test]
fn a_png_of_the_astronaut_gives_exactly_the_raw_detections() {
    let mut backend = backend("blazeface", 1);
    let raw = astronaut();
    let png = encoded(&raw, Encoding::Png);
    let out = backend.run("blazeface", &[raw, png]);
    assert_eq!(ok(&out[0]).len(), 1);
    assert_eq!(ok(&out[1]), ok(&out[0]));
}

#[test]
fn quality_90_jpegs_of_vtest_frames_count_the_people_of_raw_within_one() {
    let mut backend = backend("centernet", 2);
    let raws: Vec<FrameInput> = ["00", "20", "40"].into_iter().map(vtest).collect();
    let jpegs: Vec<FrameInput> = raws.iter().map(|f| encoded(f, Q90)).collect();
    let people = |o: &FrameOutcome| ok(o).iter().filter(|d| d.class == 0).count();
    let from_raw = backend.run("centernet", &raws);
    let from_jpeg = backend.run("centernet", &jpegs);
    for (i, (r, j)) in from_raw.iter().zip(&from_jpeg).enumerate() {
        let (r_people, j_people) = (people(r), people(j));
        println!(
            "vtest frame {i}: {} jpeg bytes, {r_people} people raw, {j_people} from jpeg, decoded in {} µs",
            jpegs[i].tensor.data.len(),
            j.timings.decode_us
        );
        assert!(r_people > 0, "nobody in raw frame {i}");
        assert!(
            r_people.abs_diff(j_people) <= 1,
            "frame {i}: {r_people} people raw, {j_people} from jpeg"
        );
        assert!(j.timings.decode_us > 0 && r.timings.decode_us == 0);
    }
}

#[test]
fn corrupt_mismatched_and_huge_files_fail_alone_and_the_rest_of_the_batch_is_served() {
    let mut backend = backend("blazeface", 1);
    let raw = astronaut();
    let good_jpeg = file(&raw.tensor.data, 128, 128, 3, Q90);
    let good_png = file(&raw.tensor.data, 128, 128, 3, Encoding::Png);
    let small: Vec<u8> = imageops::resize(
        &RgbImage::from_raw(128, 128, raw.tensor.data.to_vec()).unwrap(),
        64,
        64,
        FilterType::Triangle,
    )
    .into_raw();
    let grey: Vec<u8> = raw
        .tensor
        .data
        .chunks_exact(3)
        .map(|p| ((u32::from(p[0]) + u32::from(p[1]) + u32::from(p[2])) / 3) as u8)
        .collect();
    let mut bad_png_data = good_png.clone();
    let mid = bad_png_data.len() / 2;
    bad_png_data[mid] ^= 0xFF;

    let frames = [
        raw.clone(),
        with_file(&raw, Q90, b"definitely not a JPEG file".to_vec()),
        with_file(&raw, Q90, good_jpeg[..120].to_vec()),
        encoded(&raw, Q90),
        with_file(&raw, Q90, file(&small, 64, 64, 3, Q90)),
        with_file(&raw, Q90, jpeg_claiming(&good_jpeg, 60000, 60000)),
        with_file(&raw, Encoding::Png, bad_png_data),
        with_file(&raw, Encoding::Png, png_claiming(&good_png, 60000, 60000)),
        with_file(&raw, Q90, file(&grey, 128, 128, 1, Q90)),
        with_file(&raw, Encoding::Png, good_png),
        // A PNG file labelled JPEG is not a JPEG.
        with_file(
            &raw,
            Q90,
            file(&raw.tensor.data, 128, 128, 3, Encoding::Png),
        ),
    ];
    let out = backend.run("blazeface", &frames);
    assert_eq!(out.len(), frames.len());
    for (i, o) in out.iter().enumerate() {
        println!(
            "frame {i}: {:?}, decode_us {}",
            o.status, o.timings.decode_us
        );
    }

    let corrupt = "model 'blazeface': the frame's jpeg (quality 90) file cannot be decoded: ";
    for i in [1, 2, 10] {
        let reason = failed(&out[i]);
        assert!(reason.starts_with(corrupt), "frame {i}: {reason}");
        assert!(!reason.contains('\n'), "frame {i}: {reason:?}");
    }
    assert!(
        failed(&out[6]).starts_with("model 'blazeface': the frame's png file cannot be decoded: "),
        "{:?}",
        out[6]
    );
    assert_eq!(
        failed(&out[4]),
        "model 'blazeface' expects u8 [1,128,128,3], frame has jpeg [1,64,64,3]"
    );
    assert_eq!(
        failed(&out[5]),
        "model 'blazeface' expects u8 [1,128,128,3], frame has jpeg [1,60000,60000,3]"
    );
    assert_eq!(
        failed(&out[7]),
        "model 'blazeface' expects u8 [1,128,128,3], frame has png [1,60000,60000,3]"
    );
    assert_eq!(
        failed(&out[8]),
        "model 'blazeface' expects u8 [1,128,128,3], frame has jpeg [1,128,128,1]"
    );

    // The raw frame and the good files are served, all finding the face.
    for i in [0, 3, 9] {
        assert_eq!(ok(&out[i]).len(), 1, "frame {i}: {:?}", out[i]);
    }
    assert_eq!(out[9].detections, out[0].detections);
    // Each encoded frame, failed or not, reports its decoding time; the raw
    // one none.
    assert_eq!(out[0].timings.decode_us, 0);
    for (i, o) in out.iter().enumerate().skip(1) {
        assert!(o.timings.decode_us > 0, "frame {i}: {o:?}");
    }
    // And the backend serves on.
    assert_eq!(
        ok(&backend.run("blazeface", &[encoded(&raw, Q90)])[0]).len(),
        1
    );
}

#[test]
fn a_header_claiming_60000_by_60000_is_refused_before_anything_that_size_is_allocated() {
    let raw = astronaut();
    let good_jpeg = file(&raw.tensor.data, 128, 128, 3, Q90);
    let good_png = file(&raw.tensor.data, 128, 128, 3, Encoding::Png);
    let frame_bytes = raw.tensor.data.len();

    // The counter works: a good frame allocates its 49152 bytes of pixels.
    let (decoded, largest) = counting::largest_allocation(|| {
        codec::decode_frame("blazeface", &with_file(&raw, Q90, good_jpeg.clone()).tensor)
    });
    assert!(decoded.is_ok(), "{decoded:?}");
    assert!(largest >= frame_bytes, "largest allocation {largest} bytes");

    for (what, frame) in [
        (
            "jpeg",
            with_file(&raw, Q90, jpeg_claiming(&good_jpeg, 60000, 60000)),
        ),
        (
            "png",
            with_file(&raw, Encoding::Png, png_claiming(&good_png, 60000, 60000)),
        ),
    ] {
        let (decoded, largest) =
            counting::largest_allocation(|| codec::decode_frame("blazeface", &frame.tensor));
        println!("{what} claiming 60000×60000: largest allocation {largest} bytes");
        assert!(
            matches!(decoded, Err(FrameDecodeError::Mismatch { .. })),
            "{what}: {decoded:?}"
        );
        // Only the header was read: nothing near 60000×60000×3 (10.8 GB),
        // nor even one row of it (180 kB); the png crate's buffer is
        // 128 KiB at most, whatever the header says.
        assert!(
            largest < 60000 * 3,
            "{what}: an allocation of {largest} bytes"
        );
    }
}
