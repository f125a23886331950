//! The classify decoder on a real classifier and a real face: BlazeFace finds
//! the face in astronaut.png, the face is cropped from the source image as
//! human does (the box enlarged 1.4 times, squared) and stretched to 64×64,
//! and the facial-expression model (models/emotion: oarriaga's FER2013
//! mini-XCEPTION from npm @vladmandic/human@3.3.6, converted by
//! models/emotion/convert.py) classifies it through the worker's own backend,
//! preprocessing and decoder, on the real ONNX Runtime.

use std::path::{Path, PathBuf};

use image::RgbImage;
use image::imageops::{self, FilterType};
use tidegate_protocol::{DType, Detection, Geometry, Layout, Status, Tensor};
use tidegate_worker::backend::{Backend, FrameInput, FrameOutcome, OrtBackend};
use tidegate_worker::model::{DecoderSpec, Repository};
use tidegate_worker::runtime::RuntimeOptions;

const SIDE: u32 = 64;
/// human's `face.detector.scale`: the detector's box, enlarged around its
/// centre, is what the face models see.
const ENLARGE: f32 = 1.4;

fn models_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../models")
}

fn backend() -> OrtBackend {
    let only = ["blazeface".to_string(), "emotion".to_string()];
    let repo = Repository::load(&models_dir(), Some(&only)).unwrap();
    let options = RuntimeOptions {
        intra_threads: 1,
        warmup_runs: 1,
        profile_runs: 3,
        ..RuntimeOptions::default()
    };
    OrtBackend::open(&repo, &options).unwrap_or_else(|e| panic!("{e}"))
}

fn astronaut() -> RgbImage {
    image::open(models_dir().join("testdata/astronaut.png"))
        .unwrap()
        .to_rgb8()
}

fn frame(pixels: &RgbImage, geometry: Geometry) -> FrameInput {
    let (w, h) = pixels.dimensions();
    FrameInput {
        tensor: Tensor::raw(
            DType::U8,
            Layout::Nhwc,
            vec![1, h, w, 3],
            pixels.as_raw().clone().into(),
        ),
        geometry,
    }
}

fn ok(outcome: &FrameOutcome) -> &[Detection] {
    assert_eq!(outcome.status, Status::Ok, "{outcome:?}");
    &outcome.detections
}

/// The one face BlazeFace finds in `img` (square, so letterbox = stretch).
fn find_face(backend: &mut OrtBackend, img: &RgbImage) -> Detection {
    let small = imageops::resize(img, 128, 128, FilterType::Triangle);
    let (w, h) = img.dimensions();
    let out = backend.run(
        "blazeface",
        &[frame(&small, Geometry::letterbox(w, h, 128, 128))],
    );
    let faces = ok(&out[0]);
    assert_eq!(faces.len(), 1, "{faces:?}");
    assert!(faces[0].score > 0.8, "{faces:?}");
    faces[0].clone()
}

/// A square around the face, `ENLARGE` times its larger side, kept inside
/// the image: `(x, y, side)` in source pixels.
fn face_square(face: &Detection, img: &RgbImage) -> (u32, u32, u32) {
    let (cx, cy) = ((face.x1 + face.x2) / 2.0, (face.y1 + face.y2) / 2.0);
    let side = ((face.x2 - face.x1).max(face.y2 - face.y1) * ENLARGE).round() as u32;
    let side = side.min(img.width()).min(img.height());
    let clamp = |c: f32, limit: u32| {
        (c - side as f32 / 2.0)
            .round()
            .clamp(0.0, (limit - side) as f32) as u32
    };
    (clamp(cx, img.width()), clamp(cy, img.height()), side)
}

/// The `w`×`h` region at (`x`, `y`), stretched to the model's 64×64, as an
/// edge would send it.
fn crop(img: &RgbImage, x: u32, y: u32, w: u32, h: u32) -> FrameInput {
    let region = imageops::crop_imm(img, x, y, w, h).to_image();
    let small = imageops::resize(&region, SIDE, SIDE, FilterType::Triangle);
    frame(&small, Geometry::stretch(w, h, SIDE, SIDE))
}

fn mirrored(f: &FrameInput) -> FrameInput {
    let img = RgbImage::from_raw(SIDE, SIDE, f.tensor.data.to_vec()).unwrap();
    frame(&imageops::flip_horizontal(&img), f.geometry)
}

fn labels(backend: &OrtBackend) -> Vec<String> {
    let spec = backend
        .models()
        .iter()
        .find(|m| m.name == "emotion")
        .unwrap();
    let DecoderSpec::Classify(c) = &spec.decoder else {
        panic!("emotion is not a classifier: {:?}", spec.decoder);
    };
    c.labels.clone()
}

/// The classes of one outcome as `(label, probability)`, checked for what
/// the classify decoder promises: `top_k` = 3 of them, best first,
/// probabilities in 0..=1 summing to at most 1 (the graph ends in softmax),
/// each a box over the whole source region of `frame`.
fn classes(outcome: &FrameOutcome, frame: &FrameInput, labels: &[String]) -> Vec<(String, f32)> {
    let found = ok(outcome);
    assert_eq!(found.len(), 3, "{found:?}");
    let g = frame.geometry;
    let whole = (0.0, 0.0, g.source_width as f32, g.source_height as f32);
    for pair in found.windows(2) {
        assert!(pair[0].score >= pair[1].score, "not best first: {found:?}");
    }
    assert!(
        found.iter().all(|d| (0.0..=1.0).contains(&d.score)),
        "{found:?}"
    );
    assert!(
        found.iter().map(|d| d.score).sum::<f32>() <= 1.0 + 1e-5,
        "{found:?}"
    );
    assert!(
        found.iter().all(|d| (d.x1, d.y1, d.x2, d.y2) == whole),
        "{found:?}"
    );
    found
        .iter()
        .map(|d| (labels[d.class as usize].clone(), d.score))
        .collect()
}

fn probability(found: &[(String, f32)], label: &str) -> f32 {
    found.iter().find(|(l, _)| l == label).map_or(0.0, |c| c.1)
}

/// The face crop and the regions without a face the tests use.
fn crops(backend: &mut OrtBackend) -> Vec<(&'static str, FrameInput)> {
    let img = astronaut();
    let face = find_face(backend, &img);
    let (x, y, side) = face_square(&face, &img);
    let face_crop = crop(&img, x, y, side, side);
    vec![
        ("face", face_crop.clone()),
        ("face mirrored", mirrored(&face_crop)),
        // The flag on the right, the suit, the sky at the top left.
        ("flag", crop(&img, 380, 280, 132, 132)),
        ("suit", crop(&img, 150, 300, 200, 200)),
        ("sky", crop(&img, 0, 0, 120, 120)),
    ]
}

#[test]
fn smiling_astronaut_is_classified_happy() {
    let mut backend = backend();
    let labels = labels(&backend);
    assert_eq!(
        labels,
        [
            "angry", "disgust", "fear", "happy", "sad", "surprise", "neutral"
        ]
    );
    let img = astronaut();
    let face = find_face(&mut backend, &img);
    let (x, y, side) = face_square(&face, &img);
    println!("face {face:?}: crop ({x}, {y}) {side}x{side}");
    let face_crop = crop(&img, x, y, side, side);
    let out = backend.run("emotion", std::slice::from_ref(&face_crop));
    let found = classes(&out[0], &face_crop, &labels);
    println!("face: {found:?}");
    // Measured with this pipeline (ONNX Runtime 1.31.1, CPU): happy
    // 0.999996, crop (159, 62) 132x132. TensorFlow running the original
    // graph agrees: happy 0.9985, 1.0000 and 0.9903 for the box enlarged
    // 1.0, 1.4 and 1.8 times (models/emotion/crosscheck.sh). So the class
    // does not hang on the crop; below 0.9 the pixels, their normalisation
    // or the labels have gone wrong.
    assert_eq!(found[0].0, "happy", "{found:?}");
    assert!(found[0].1 > 0.9, "{found:?}");
}

#[test]
fn mirrored_face_stays_happy_and_faceless_regions_are_neither_happy_nor_sure() {
    let mut backend = backend();
    let labels = labels(&backend);
    for (name, f) in crops(&mut backend) {
        let out = backend.run("emotion", std::slice::from_ref(&f));
        let found = classes(&out[0], &f, &labels);
        println!("{name}: {found:?}");
        let happy = probability(&found, "happy");
        if name.starts_with("face") {
            assert_eq!(found[0].0, "happy", "{name}: {found:?}");
            assert!(happy > 0.9, "{name}: {found:?}");
        } else {
            // Measured: flag sad 0.86, suit sad 0.56, sky fear 0.31, happy
            // in the top 3 of none. A model or a preprocessing that calls
            // everything happy fails here, and so does one that saturates:
            // fed raw 0..255 pixels (normalisation lost) the model still
            // calls the face happy, but every region 1.0 sure.
            assert_ne!(found[0].0, "happy", "{name}: {found:?}");
            assert!(happy < 0.1, "{name}: {found:?}");
            assert!(found[0].1 < 0.95, "{name}: {found:?}");
        }
        if name == "flag" {
            assert_eq!(found[0].0, "sad", "{found:?}");
            assert!((found[0].1 - 0.86).abs() < 0.05, "{found:?}");
        }
    }
}

#[test]
fn batch_of_crops_gives_the_same_classes_as_single_runs() {
    let mut backend = backend();
    let labels = labels(&backend);
    let spec = backend
        .models()
        .iter()
        .find(|m| m.name == "emotion")
        .unwrap();
    assert_eq!(spec.max_batch, 32);
    let named = crops(&mut backend);
    let frames: Vec<FrameInput> = named.iter().map(|(_, f)| f.clone()).collect();
    let batched = backend.run("emotion", &frames);
    assert_eq!(batched.len(), frames.len());
    for (i, (name, f)) in named.iter().enumerate() {
        let single = backend.run("emotion", std::slice::from_ref(f));
        let (b, s) = (
            classes(&batched[i], f, &labels),
            classes(&single[0], f, &labels),
        );
        for ((bl, bp), (sl, sp)) in b.iter().zip(&s) {
            assert!(
                bl == sl && (bp - sp).abs() <= 1e-5,
                "{name}: batch {b:?} vs single {s:?}"
            );
        }
        // One run carried them all.
        assert_eq!(
            batched[i].timings.inference_us,
            batched[0].timings.inference_us
        );
    }
}
