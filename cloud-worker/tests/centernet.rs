//! CenterNet through the `boxes` decoder on real images (opt-in: the model
//! and vtest.avi come from `make models-full`; without them each test says
//! so and returns).
//!
//! - astronaut.png: one person, the astronaut, where the converted model was
//!   first measured (pinned ONNX Runtime 1.31.1 in Python: (8.4, 8.8) -
//!   (368.9, 519.6), score 0.61);
//! - pedestrians in Debian opencv-doc's vtest.avi (frames at 0, 20, 40, 60 s).

use std::path::{Path, PathBuf};

use image::{RgbImage, imageops};
use tidegate_protocol::{DType, Detection, Geometry, Layout, Status, Tensor};
use tidegate_worker::backend::{Backend, FrameInput, OrtBackend};
use tidegate_worker::decode::iou;
use tidegate_worker::model::Repository;
use tidegate_worker::runtime::RuntimeOptions;

fn models_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../models")
}

/// The CenterNet backend, or `None` (with the reason printed) when the model
/// has not been fetched.
fn backend(test: &str) -> Option<OrtBackend> {
    let file = models_dir().join("centernet/model.onnx");
    if !file.is_file() {
        eprintln!(
            "SKIPPED {test}: {} is missing; run `make models-full` (scripts/models-full.sh) to fetch the opt-in CenterNet model",
            file.display()
        );
        return None;
    }
    let repo = Repository::load(&models_dir(), Some(&["centernet".to_string()])).unwrap();
    let options = RuntimeOptions {
        intra_threads: 2,
        warmup_runs: 1,
        ..RuntimeOptions::default()
    };
    Some(OrtBackend::open(&repo, &options).unwrap_or_else(|e| panic!("{e}")))
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
        tensor: Tensor {
            dtype: DType::U8,
            layout: Layout::Nhwc,
            shape: vec![1, 512, 512, 3],
            data: canvas.into_raw().into(),
        },
        geometry: g,
    }
}

fn people(d: &[Detection]) -> Vec<&Detection> {
    d.iter().filter(|d| d.class == 0).collect()
}

#[test]
fn astronaut_is_found_as_a_person() {
    let Some(mut backend) = backend("astronaut_is_found_as_a_person") else {
        return;
    };
    let img = image::open(models_dir().join("testdata/astronaut.png"))
        .unwrap()
        .to_rgb8();
    let out = backend.run("centernet", &[letterboxed(&img)]);
    assert_eq!(out[0].status, Status::Ok, "{:?}", out[0]);
    for d in &out[0].detections {
        println!("{d:?}");
    }
    let persons = people(&out[0].detections);
    assert!(!persons.is_empty(), "{:?}", out[0].detections);
    let best = persons[0];
    let measured = [8.4, 8.8, 368.9, 519.6];
    let overlap = iou(&[best.x1, best.y1, best.x2, best.y2], &measured);
    assert!(overlap > 0.8, "IoU {overlap} with {measured:?}: {best:?}");
    assert!(best.score > 0.5, "{best:?}");
}

#[test]
fn pedestrians_in_vtest_are_found_as_people() {
    let Some(mut backend) = backend("pedestrians_in_vtest_are_found_as_people") else {
        return;
    };
    let dir = models_dir().join("testdata/vtest");
    let mut frames = Vec::new();
    for s in ["00", "20", "40", "60"] {
        let path = dir.join(format!("frame-{s}.png"));
        if !path.is_file() {
            eprintln!(
                "SKIPPED pedestrians_in_vtest_are_found_as_people: {} is missing; run `make models-full`",
                path.display()
            );
            return;
        }
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
