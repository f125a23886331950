//! CenterNet through the `boxes` decoder on real images. The model comes
//! with `make setup` (models/fetch.sh converts it from human's TF.js graph
//! with models/centernet/convert.py; its sha256 is pinned), so a missing
//! model fails these tests with the fix.
//!
//! - astronaut.png: one person, the astronaut. The same model gives
//!   (8.3, 8.8) - (368.9, 519.6), score 0.6096 in Python on ONNX Runtime
//!   1.31.1, as TensorFlow does on the TF.js graph (models/centernet/crosscheck.sh);
//! - pedestrians in Debian opencv-doc's vtest.avi (frames at 0, 20, 40, 60 s).
//!   `make setup` fetches the video (scripts/test-video.sh) and extracts the
//!   frames; without them the test fails with the fix;
//! - a batch of those five frames gives the detections of five single runs,
//!   to the bit (the converted graph's batch is dynamic).

use std::path::{Path, PathBuf};

use image::{RgbImage, imageops};
use tidegate_protocol::{DType, Detection, Geometry, Layout, Status, Tensor};
use tidegate_worker::backend::{Backend, FrameInput, OrtBackend};
use tidegate_worker::decode::iou;
use tidegate_worker::model::{Precision, Repository};
use tidegate_worker::runtime::RuntimeOptions;

fn models_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../models")
}

/// The CenterNet backend; panics with the fix when the model is missing.
fn backend() -> OrtBackend {
    let repo = Repository::load(&models_dir(), Some(&["centernet".to_string()]))
        .unwrap_or_else(|e| panic!("{e}"));
    let options = RuntimeOptions {
        intra_threads: 2,
        warmup_runs: 1,
        ..RuntimeOptions::default()
    };
    OrtBackend::open(&repo, &options).unwrap_or_else(|e| panic!("{e}"))
}

/// `img` letterboxed into 512×512 the way the edge does it, as a frame.
fn letterboxed(img: &RgbImage) -> FrameInput {
    let (w, h) = img.dimensions();
    let g = Geometry::letterbox(w, h, 512, 512);
    let content = imageops::resize(
        img,
        g.content_width,
        g.content_height,
        imageops::FilterType::Triangle,
    );
    let mut canvas = RgbImage::new(512, 512);
    imageops::replace(
        &mut canvas,
        &content,
        i64::from(g.content_x),
        i64::from(g.content_y),
    );
    FrameInput {
        tensor: Tensor::raw(
            DType::U8,
            Layout::Nhwc,
            vec![1, 512, 512, 3],
            canvas.into_raw().into(),
        ),
        geometry: g,
    }
}

/// The astronaut, then the vtest frames at 0, 20, 40 and 60 s, letterboxed.
fn astronaut_and_vtest() -> Vec<FrameInput> {
    let mut frames = vec![letterboxed(
        &image::open(models_dir().join("testdata/astronaut.png"))
            .unwrap()
            .to_rgb8(),
    )];
    for s in ["00", "20", "40", "60"] {
        let path = models_dir().join(format!("testdata/vtest/frame-{s}.png"));
        let img = image::open(&path)
            .unwrap_or_else(|e| panic!("{}: {e}; run `make setup`", path.display()))
            .to_rgb8();
        frames.push(letterboxed(&img));
    }
    frames
}

fn people(d: &[Detection]) -> Vec<&Detection> {
    d.iter().filter(|d| d.class == 0).collect()
}

#[test]
fn astronaut_is_the_one_person_found_where_tensorflow_finds_it() {
    let mut backend = backend();
    let img = image::open(models_dir().join("testdata/astronaut.png"))
        .unwrap()
        .to_rgb8();
    let out = backend.run("centernet", &[letterboxed(&img)]);
    assert_eq!(out[0].status, Status::Ok, "{:?}", out[0]);
    for d in &out[0].detections {
        println!("{d:?}");
    }
    // Nothing else in the picture scores 0.3 (the decoder's threshold).
    let [best] = out[0].detections.as_slice() else {
        panic!("expected one detection: {:?}", out[0].detections);
    };
    assert_eq!(best.class, 0, "{best:?}");
    // TensorFlow's box, clamped to the 512×512 image as the decoder does.
    let tensorflow = [8.3, 8.8, 368.9, 512.0];
    let overlap = iou(&[best.x1, best.y1, best.x2, best.y2], &tensorflow);
    assert!(
        overlap > 0.99,
        "IoU {overlap} with {tensorflow:?}: {best:?}"
    );
    assert!((best.score - 0.6096).abs() < 1e-3, "{best:?}");
}

#[test]
fn pedestrians_in_vtest_are_found_as_people() {
    let mut backend = backend();
    let dir = models_dir().join("testdata/vtest");
    let mut frames = Vec::new();
    for s in ["00", "20", "40", "60"] {
        let path = dir.join(format!("frame-{s}.png"));
        assert!(
            path.is_file(),
            "{} is missing; run `make setup` (scripts/test-video.sh fetches vtest.avi and extracts its frames)",
            path.display()
        );
        let img = image::open(&path).unwrap().to_rgb8();
        assert_eq!(img.dimensions(), (768, 576));
        frames.push(letterboxed(&img));
    }
    let out = backend.run("centernet", &frames);
    let mut total = 0;
    for (s, o) in ["00", "20", "40", "60"].iter().zip(&out) {
        assert_eq!(o.status, Status::Ok, "{o:?}");
        let persons = people(&o.detections);
        println!("vtest at {s} s: {} people", persons.len());
        for p in &persons {
            println!("  {p:?}");
            // Mapped back through the letterbox into the 768×576 frame.
            assert!(
                p.x1 >= 0.0 && p.x2 <= 768.0 && p.y1 >= 0.0 && p.y2 <= 576.0,
                "{p:?}"
            );
        }
        assert!(!persons.is_empty(), "nobody at {s} s: {:?}", o.detections);
        total += persons.len();
    }
    assert!(total >= 8, "only {total} people in four street frames");
}

#[test]
fn batch_of_five_frames_gives_the_same_detections_as_five_single_runs() {
    let mut backend = backend();
    let max_batch = backend.models()[0].max_batch;
    assert!(max_batch > 1, "centernet's max_batch is {max_batch}");
    let frames = astronaut_and_vtest();
    // Runs of at most max_batch frames: 4 + 1 with max_batch = 4.
    let batched = backend.run("centernet", &frames);
    assert_eq!(batched.len(), frames.len());
    for (i, frame) in frames.iter().enumerate() {
        let single = backend.run("centernet", std::slice::from_ref(frame));
        let (b, s) = (&batched[i], &single[0]);
        assert_eq!(b.status, Status::Ok, "frame {i}: {b:?}");
        assert!(!s.detections.is_empty(), "frame {i}: nothing found");
        // The graph computes each image's rows as a single run does, bit for
        // bit (models/centernet/convert.py checks it), so the decoded boxes
        // are equal, not merely close.
        assert_eq!(b.detections, s.detections, "frame {i}: batch vs single run");
    }
}

/// The FP16 variant (`runtime.precision = "fp16"`, built and pinned by
/// models/fetch.sh), on the same ONNX Runtime: the people counted in each
/// vtest frame within ±1 of FP32's, and the astronaut found where FP32
/// finds her (IoU ≥ 0.9). On the CPU provider ONNX Runtime runs it with
/// casts; a GPU is where it is faster (scripts/gpu-check.sh step 8).
#[test]
fn fp16_variant_counts_the_people_fp32_counts_within_one() {
    let repo = Repository::load(&models_dir(), Some(&["centernet".to_string()]))
        .unwrap_or_else(|e| panic!("{e}"));
    let (half, notes) = repo
        .at_precision(Precision::Fp16)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(notes.is_empty(), "{notes:?}");
    let options = RuntimeOptions {
        intra_threads: 2,
        warmup_runs: 1,
        ..RuntimeOptions::default()
    };
    let mut fp16 = OrtBackend::open(&half, &options).unwrap_or_else(|e| panic!("{e}"));
    let mut fp32 = backend();
    let frames = astronaut_and_vtest();
    let (a, b) = (
        fp32.run("centernet", &frames),
        fp16.run("centernet", &frames),
    );
    for (i, (a, b)) in a.iter().zip(&b).enumerate() {
        assert_eq!(b.status, Status::Ok, "frame {i}: {b:?}");
        let (pa, pb) = (people(&a.detections), people(&b.detections));
        println!(
            "frame {i}: {} people in FP32, {} in FP16",
            pa.len(),
            pb.len()
        );
        assert!(
            pa.len().abs_diff(pb.len()) <= 1,
            "frame {i}: FP32 {pa:?}\nFP16 {pb:?}"
        );
    }
    let (a, b) = (people(&a[0].detections), people(&b[0].detections));
    let [a] = a.as_slice() else {
        panic!("FP32 finds one astronaut: {a:?}")
    };
    let best = b
        .iter()
        .map(|d| iou(&[a.x1, a.y1, a.x2, a.y2], &[d.x1, d.y1, d.x2, d.y2]))
        .fold(0.0f32, f32::max);
    assert!(best >= 0.9, "FP16 {b:?} against FP32 {a:?}: IoU {best}");
}
