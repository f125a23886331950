//! BlazeFace end to end: the real model file on the real ONNX Runtime
//! (found the way the worker finds it: ORT_DYLIB_PATH, else the tidegate
//! cache that `make setup` fills).

use std::fs;
use std::path::{Path, PathBuf};

use image::imageops::{self, FilterType};
use tidegate_protocol::{DType, Detection, Geometry, Layout, Status, Tensor};
use tidegate_worker::backend::{Backend, BackendError, FrameInput, OrtBackend};
use tidegate_worker::model::{Precision, Repository};
use tidegate_worker::runtime::{Runtime, RuntimeError, RuntimeOptions};

fn models_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../models")
}

fn options() -> RuntimeOptions {
    RuntimeOptions {
        intra_threads: 1,
        warmup_runs: 1,
        profile_runs: 3,
        ..RuntimeOptions::default()
    }
}

fn backend() -> OrtBackend {
    let repo = Repository::load(&models_dir(), Some(&["blazeface".to_string()])).unwrap();
    OrtBackend::open(&repo, &options()).unwrap_or_else(|e| panic!("{e}"))
}

/// astronaut.png (512×512) resized to 128×128 with a triangle filter; square,
/// so letterbox and stretch agree.
fn astronaut() -> FrameInput {
    let img = image::open(models_dir().join("testdata/astronaut.png"))
        .unwrap()
        .to_rgb8();
    assert_eq!(img.dimensions(), (512, 512));
    let small = imageops::resize(&img, 128, 128, FilterType::Triangle);
    FrameInput {
        tensor: Tensor::raw(
            DType::U8,
            Layout::Nhwc,
            vec![1, 128, 128, 3],
            small.into_raw().into(),
        ),
        geometry: Geometry::letterbox(512, 512, 128, 128),
    }
}

fn frame(shape: &[u32]) -> FrameInput {
    let len: u32 = shape.iter().product();
    FrameInput {
        tensor: Tensor::raw(
            DType::U8,
            Layout::Nhwc,
            shape.to_vec(),
            vec![0u8; len as usize].into(),
        ),
        geometry: Geometry::letterbox(128, 128, 128, 128),
    }
}

fn faces(outcome: &tidegate_worker::backend::FrameOutcome) -> &[Detection] {
    assert_eq!(outcome.status, Status::Ok, "{outcome:?}");
    &outcome.detections
}

/// Measured once with this test's own pipeline (triangle resize to 128×128,
/// [-1,1] normalisation, ONNX Runtime 1.31.1 on the CPU): score 0.921, box
/// (177.3, 80.6)-(271.8, 175.1) in the 512×512 image, i.e. centre
/// (224.6, 127.9), 94.5 px square. The Python reference gave score ≈ 0.92,
/// centre ≈ (225, 128), size ≈ 95 px.
const ASTRONAUT_FACE: [f32; 4] = [177.3, 80.6, 271.8, 175.1];

#[test]
fn astronaut_has_one_face_where_measured() {
    let mut backend = backend();
    let out = backend.run("blazeface", &[astronaut()]);
    assert_eq!(out.len(), 1);
    let faces = faces(&out[0]);
    for f in faces {
        println!(
            "face: score {:.3} box ({:.1}, {:.1})-({:.1}, {:.1}), {} keypoints",
            f.score,
            f.x1,
            f.y1,
            f.x2,
            f.y2,
            f.keypoints.len()
        );
    }
    assert_eq!(faces.len(), 1, "{faces:?}");
    let f = &faces[0];
    assert!(f.score > 0.8, "{f:?}");
    assert_eq!(f.class, 0);
    for (got, want) in [f.x1, f.y1, f.x2, f.y2].into_iter().zip(ASTRONAUT_FACE) {
        assert!(
            (got - want).abs() <= 10.0,
            "box {f:?} is off the measured {ASTRONAUT_FACE:?}"
        );
    }
    // Six landmarks (eyes, nose, mouth, ears), all near the face.
    assert_eq!(f.keypoints.len(), 6);
    for [x, y] in &f.keypoints {
        assert!(
            *x > f.x1 - 20.0 && *x < f.x2 + 20.0 && *y > f.y1 - 20.0 && *y < f.y2 + 20.0,
            "{f:?}"
        );
    }
    let t = out[0].timings;
    assert!(t.inference_us > 0 && t.queue_us == 0, "{t:?}");
}

#[test]
fn wrong_shape_fails_naming_both_shapes_and_later_frames_still_succeed() {
    let mut backend = backend();
    let out = backend.run("blazeface", &[frame(&[1, 64, 64, 3]), astronaut()]);
    assert_eq!(out.len(), 2);
    assert_eq!(
        out[0].status,
        Status::Failed("model 'blazeface' expects u8 [1,128,128,3], frame has [1,64,64,3]".into())
    );
    assert_eq!(faces(&out[1]).len(), 1);
    let out = backend.run("blazeface", &[astronaut()]);
    assert_eq!(faces(&out[0]).len(), 1);
}

#[test]
fn f32_frame_and_empty_batch_fail_alone() {
    let mut backend = backend();
    let mut f32_frame = frame(&[1, 128, 128, 12]);
    f32_frame.tensor.dtype = DType::F32;
    f32_frame.tensor.shape = vec![1, 128, 128, 3];
    let out = backend.run(
        "blazeface",
        &[f32_frame, frame(&[0, 128, 128, 3]), astronaut()],
    );
    assert_eq!(
        out[0].status,
        Status::Failed(
            "model 'blazeface' expects u8 [1,128,128,3], frame has f32 [1,128,128,3]".into()
        )
    );
    assert_eq!(
        out[1].status,
        Status::Failed(
            "model 'blazeface' expects u8 [1,128,128,3], frame has [0,128,128,3]".into()
        )
    );
    assert_eq!(faces(&out[2]).len(), 1);
    assert!(backend.run("blazeface", &[]).is_empty());
}

#[test]
fn planar_frame_gives_the_same_face() {
    let mut backend = backend();
    let nhwc = astronaut();
    let mut planar = vec![0u8; nhwc.tensor.data.len()];
    for (i, px) in nhwc.tensor.data.chunks_exact(3).enumerate() {
        for c in 0..3 {
            planar[c * 128 * 128 + i] = px[c];
        }
    }
    let nchw = FrameInput {
        tensor: Tensor {
            layout: Layout::Nchw,
            shape: vec![1, 3, 128, 128],
            data: planar.into(),
            ..nhwc.tensor.clone()
        },
        geometry: nhwc.geometry,
    };
    let out = backend.run("blazeface", &[nhwc, nchw]);
    assert_eq!(faces(&out[0]), faces(&out[1]));
}

#[test]
fn unknown_model_fails_every_frame_naming_what_is_served() {
    let mut backend = backend();
    let out = backend.run("yolo", &[astronaut(), astronaut()]);
    assert_eq!(out.len(), 2);
    let Status::Failed(reason) = &out[1].status else {
        panic!("{:?}", out[1]);
    };
    assert!(
        reason.contains("model 'yolo' is not served") && reason.contains("blazeface"),
        "{reason}"
    );
}

/// Eight different frames: the astronaut, mirrored, shifted, darkened, and
/// plain fills (no face), so that a batch mixing up its slots would show.
fn eight_frames() -> Vec<FrameInput> {
    let base = astronaut();
    let pixels = base.tensor.data.to_vec();
    let variant = |f: &dyn Fn(usize, usize, usize) -> u8| {
        let mut data = vec![0u8; pixels.len()];
        for y in 0..128 {
            for x in 0..128 {
                for c in 0..3 {
                    data[(y * 128 + x) * 3 + c] = f(x, y, c);
                }
            }
        }
        FrameInput {
            tensor: Tensor {
                data: data.into(),
                ..base.tensor.clone()
            },
            geometry: base.geometry,
        }
    };
    let px = |x: usize, y: usize, c: usize| pixels[(y * 128 + x) * 3 + c];
    vec![
        base.clone(),
        variant(&|x, y, c| px(127 - x, y, c)),
        variant(&|x, y, c| if x >= 16 { px(x - 16, y, c) } else { 0 }),
        variant(&|x, y, c| px(x, y, c) / 2),
        variant(&|_, _, _| 128),
        variant(&|x, y, c| if y >= 12 { px(x, y - 12, c) } else { 255 }),
        variant(&|x, y, _| ((x * 7 + y * 13) % 256) as u8),
        base,
    ]
}

#[test]
fn batch_of_8_gives_the_same_detections_as_8_single_runs() {
    let mut backend = backend();
    assert_eq!(backend.models()[0].max_batch, 32);
    let frames = eight_frames();
    let batched = backend.run("blazeface", &frames);
    assert_eq!(batched.len(), 8);
    let mut faces_seen = 0;
    for (i, frame) in frames.iter().enumerate() {
        let single = backend.run("blazeface", std::slice::from_ref(frame));
        let (b, s) = (faces(&batched[i]), faces(&single[0]));
        faces_seen += s.len();
        assert_eq!(b.len(), s.len(), "frame {i}: batch {b:?} vs single {s:?}");
        for (bd, sd) in b.iter().zip(s) {
            let close = |x: f32, y: f32| (x - y).abs() <= 1e-3;
            assert!(
                close(bd.score, sd.score)
                    && [bd.x1, bd.y1, bd.x2, bd.y2]
                        .iter()
                        .zip([sd.x1, sd.y1, sd.x2, sd.y2])
                        .all(|(a, b)| close(*a, b))
                    && bd.keypoints.len() == sd.keypoints.len()
                    && bd.class == sd.class,
                "frame {i}: batch {bd:?} vs single {sd:?}"
            );
        }
        // One run carried all eight: the batch shares its inference time.
        assert_eq!(
            batched[i].timings.inference_us,
            batched[0].timings.inference_us
        );
    }
    // The astronaut and most of its variants have a face; the fills do not.
    assert!(faces_seen >= 4, "{faces_seen} faces in 8 frames");
    assert!(faces(&batched[4]).is_empty() && faces(&batched[6]).is_empty());
}

#[test]
fn profile_measures_the_batch_sizes_the_model_accepts() {
    let mut backend = backend();
    assert_eq!(backend.models().len(), 1);
    assert_eq!(backend.models()[0].max_batch, 32);
    let points = backend.profile("blazeface", &[1, 4, 32, 64]).unwrap();
    let sizes: Vec<u16> = points.iter().map(|p| p.0).collect();
    assert_eq!(sizes, vec![1, 4, 32], "{points:?}");
    assert!(points.iter().all(|p| p.1 > 0), "{points:?}");
    let err = backend.profile("yolo", &[1]).unwrap_err();
    assert!(matches!(err, BackendError::UnknownModel { .. }), "{err}");
}

#[test]
fn second_runtime_path_in_one_process_is_refused() {
    let _ = backend();
    let loaded = Runtime::get().unwrap().path().to_path_buf();
    assert!(Runtime::init(Some(&loaded)).is_ok());
    let other = Path::new("/opt/elsewhere/libonnxruntime.so");
    let err = Runtime::init(Some(other)).unwrap_err();
    assert!(matches!(err, RuntimeError::AlreadyLoaded { .. }), "{err}");
    assert!(
        err.to_string().contains("/opt/elsewhere/libonnxruntime.so"),
        "{err}"
    );
}

/// A copy of models/blazeface in a temp dir, with `edit` applied to model.toml.
/// `model.toml` text without the model file's pinned sha256 (the top-level
/// one; the `[fp16]` variant keeps its own).
fn unpinned(text: &str) -> String {
    let mut in_table = false;
    text.lines()
        .filter(|l| {
            in_table |= l.starts_with('[');
            in_table || !l.starts_with("sha256")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn edited_repo(edit: impl Fn(String) -> String) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let src = models_dir().join("blazeface");
    let dst = dir.path().join("blazeface");
    fs::create_dir(&dst).unwrap();
    fs::copy(src.join("model.onnx"), dst.join("model.onnx")).unwrap();
    let text = fs::read_to_string(src.join("model.toml")).unwrap();
    fs::write(dst.join("model.toml"), edit(text)).unwrap();
    dir
}

fn open_error(edit: impl Fn(String) -> String) -> String {
    let dir = edited_repo(edit);
    let repo = Repository::load(dir.path(), None).unwrap();
    let err = OrtBackend::open(&repo, &options()).unwrap_err().to_string();
    println!("{err}");
    err
}

#[test]
fn wrong_input_name_names_model_field_and_both_names() {
    let err = open_error(|t| t.replace("name = \"input:0\"", "name = \"image\""));
    assert!(err.starts_with("model 'blazeface': input.name"), "{err}");
    assert!(
        err.contains("\"image\"") && err.contains("\"input:0\""),
        "{err}"
    );
}

#[test]
fn wrong_input_size_names_both_shapes() {
    let err = open_error(|t| t.replace("width = 128", "width = 160"));
    assert!(err.starts_with("model 'blazeface': input"), "{err}");
    assert!(
        err.contains("[batch,128,160,3]") && err.contains("[-1,128,128,3]"),
        "{err}"
    );
}

#[test]
fn wrong_output_name_names_the_output_field() {
    let err = open_error(|t| t.replace("Identity_3:0", "Identity_4:0"));
    assert!(
        err.starts_with("model 'blazeface': outputs[3].name"),
        "{err}"
    );
    assert!(
        err.contains("\"Identity_4:0\"") && err.contains("\"Identity_3:0\""),
        "{err}"
    );
}

#[test]
fn batch_above_the_graphs_fixed_batch_is_refused() {
    // The npm original, whose batch is fixed at 1, under a max_batch of 4.
    let dir = edited_repo(|t| unpinned(&t).replace("max_batch = 32", "max_batch = 4"));
    fs::copy(
        models_dir().join("blazeface/fixed-batch.onnx"),
        dir.path().join("blazeface/model.onnx"),
    )
    .unwrap();
    let repo = Repository::load(dir.path(), None).unwrap();
    let err = OrtBackend::open(&repo, &options()).unwrap_err().to_string();
    assert!(err.starts_with("model 'blazeface': max_batch"), "{err}");
    assert!(
        err.contains("is 4, but the ONNX file has a batch dimension fixed at 1"),
        "{err}"
    );
}

#[test]
fn u8_model_dtype_against_an_f32_graph_is_refused() {
    let err = open_error(|t| t.replace("model_dtype = \"f32\"", "model_dtype = \"u8\""));
    assert!(
        err.starts_with("model 'blazeface': input.model_dtype"),
        "{err}"
    );
    assert!(err.contains("is u8, but the ONNX file has f32"), "{err}");
}

#[test]
fn missing_model_file_says_how_to_fetch_it() {
    let dir = edited_repo(|t| t);
    let file = dir.path().join("blazeface/model.onnx");
    fs::remove_file(&file).unwrap();
    let err = Repository::load(dir.path(), None).unwrap_err().to_string();
    assert_eq!(
        err,
        format!(
            "model 'blazeface': file {} is missing; run `make setup` (models/fetch.sh) to fetch it",
            file.display()
        )
    );
}

#[test]
fn corrupted_model_file_fails_its_checksum() {
    let dir = edited_repo(|t| t);
    fs::write(dir.path().join("blazeface/model.onnx"), b"not a model").unwrap();
    let err = Repository::load(dir.path(), None).unwrap_err().to_string();
    assert!(
        err.starts_with("model 'blazeface':") && err.contains("sha256"),
        "{err}"
    );
}

#[test]
fn unpinned_garbage_model_file_fails_to_open_naming_the_model_and_file() {
    let dir = edited_repo(|t| unpinned(&t));
    let file = dir.path().join("blazeface/model.onnx");
    fs::write(&file, b"not a model").unwrap();
    let repo = Repository::load(dir.path(), None).unwrap();
    let err = OrtBackend::open(&repo, &options()).unwrap_err();
    assert!(matches!(err, BackendError::Session { .. }), "{err}");
    let text = err.to_string();
    let want = format!(
        "model 'blazeface': ONNX Runtime cannot open {}: ",
        file.display()
    );
    assert!(text.starts_with(&want), "{text}");
}

/// The GPU path hands ONNX Runtime its input where the kernel wrote it, a
/// tensor borrowed from the preprocessor's buffer on the device the session
/// reads it from (`backend::run_in_place`). ort 2.0.0-rc.15's
/// `IoBinding::bind_input` never returns for such a tensor; a CPU session
/// and a borrowed host buffer take the same path, so this runs here without
/// a GPU (on a thread, so that a hang fails the test), and reads what an
/// owned copy of the same input gives.
#[test]
#[allow(unsafe_code)]
fn a_borrowed_input_on_the_sessions_own_device_is_read_in_place() {
    use ort::memory::{AllocationDevice, AllocatorType, MemoryInfo, MemoryType};
    use ort::session::Session;
    use ort::value::{Shape, Tensor, TensorRefMut};

    drop(backend()); // loads ONNX Runtime
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = Runtime::get().expect("loaded");
        let mut session = Session::builder(runtime.environment())
            .unwrap()
            .commit_from_file(models_dir().join("blazeface/model.onnx"))
            .unwrap();
        let name = session.inputs()[0].name().to_string();
        let shape = [1i64, 128, 128, 3];
        let mut input: Vec<f32> = (0..128 * 128 * 3)
            .map(|i| (i % 251) as f32 / 125.0 - 1.0)
            .collect();
        let owned = Tensor::from_array((shape, input.clone())).unwrap();
        let expected: Vec<Vec<f32>> = {
            let out = session.run(ort::inputs![name.as_str() => owned]).unwrap();
            out.values()
                .map(|v| v.try_extract_tensor::<f32>().unwrap().1.to_vec())
                .collect()
        };
        let host = MemoryInfo::new(
            AllocationDevice::CPU,
            0,
            AllocatorType::Device,
            MemoryType::Default,
        )
        .unwrap();
        // SAFETY: `input` holds 1×128×128×3 f32 and outlives the tensor,
        // which is dropped by the run below
        let borrowed = unsafe {
            TensorRefMut::<f32>::from_raw(host, input.as_mut_ptr().cast(), Shape::new(shape))
        }
        .unwrap();
        let out = tidegate_worker::backend::run_in_place(&mut session, &name, borrowed)
            .map(|out| {
                out.values()
                    .map(|v| v.try_extract_tensor::<f32>().unwrap().1.to_vec())
                    .collect::<Vec<_>>()
            })
            .map_err(|e| e.to_string());
        let _ = tx.send((expected, out));
    });
    let (expected, out) = rx
        .recv_timeout(std::time::Duration::from_secs(120))
        .expect("the run returned (IoBinding::bind_input would never have)");
    let out = out.unwrap();
    assert_eq!(out.len(), expected.len());
    assert!(!out.is_empty() && out.iter().all(|o| !o.is_empty()));
    assert_eq!(out, expected, "the borrowed input reads as its owned copy");
}

/// The FP16 variant (`runtime.precision = "fp16"`, built and pinned by
/// models/fetch.sh) on the same ONNX Runtime: the astronaut's face where
/// FP32 finds it, within 2 px, with the same landmarks and about the same
/// score. On the CPU provider ONNX Runtime runs it with casts around the
/// FP16 nodes; on a GPU it is the variant that runs faster
/// (scripts/gpu-check.sh compares them there).
#[test]
fn fp16_variant_finds_the_astronauts_face_within_2_px_of_fp32() {
    let repo = Repository::load(&models_dir(), Some(&["blazeface".to_string()])).unwrap();
    let (half, notes) = repo
        .clone()
        .at_precision(Precision::Fp16)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(notes.is_empty(), "{notes:?}");
    let model = &half.models()[0];
    assert_eq!(
        model.path.file_name().and_then(|n| n.to_str()),
        Some("model.fp16.onnx")
    );
    let full = backend().run("blazeface", &[astronaut()]);
    let mut backend16 = OrtBackend::open(&half, &options()).unwrap_or_else(|e| panic!("{e}"));
    let out = backend16.run("blazeface", &[astronaut()]);
    let (a, b) = (faces(&full[0]), faces(&out[0]));
    assert_eq!((a.len(), b.len()), (1, 1), "fp32 {a:?}, fp16 {b:?}");
    let (a, b) = (&a[0], &b[0]);
    for (x, y) in [a.x1, a.y1, a.x2, a.y2]
        .into_iter()
        .zip([b.x1, b.y1, b.x2, b.y2])
    {
        assert!((x - y).abs() <= 2.0, "fp16 box {b:?} vs fp32 {a:?}");
    }
    assert!(
        (a.score - b.score).abs() <= 0.02,
        "fp16 {b:?} vs fp32 {a:?}"
    );
    assert_eq!(a.keypoints.len(), b.keypoints.len());
    for (p, q) in a.keypoints.iter().zip(&b.keypoints) {
        assert!(
            (p[0] - q[0]).abs() <= 2.0 && (p[1] - q[1]).abs() <= 2.0,
            "{p:?} vs {q:?}"
        );
    }
}

#[test]
fn fp16_asked_for_a_model_without_its_variant_file_names_the_file_and_the_fix() {
    // A repository whose model.toml names the variant but lacks the file.
    let dir = edited_repo(|t| t);
    let repo = Repository::load(dir.path(), None).unwrap();
    let err = repo.at_precision(Precision::Fp16).unwrap_err().to_string();
    assert!(
        err.contains("model.fp16.onnx")
            && err.contains("make setup")
            && err.contains("runtime.precision"),
        "{err}"
    );
    // One with no [fp16] table is served in FP32, and said so.
    let dir = edited_repo(|t| {
        let start = t.find("[fp16]").expect("model.toml has an [fp16] table");
        let end = start + t[start..].find("\n\n").expect("the table ends");
        format!("{}{}", &t[..start], &t[end..])
    });
    let repo = Repository::load(dir.path(), None).unwrap();
    let (same, notes) = repo.clone().at_precision(Precision::Fp16).unwrap();
    assert_eq!(same, repo);
    assert_eq!(notes.len(), 1);
    assert!(
        notes[0].contains("no [fp16] variant") && notes[0].contains("FP32"),
        "{notes:?}"
    );
    // A variant whose bytes are not the pinned ones is refused.
    let dir = edited_repo(|t| t);
    fs::write(
        dir.path().join("blazeface/model.fp16.onnx"),
        b"not the variant",
    )
    .unwrap();
    let repo = Repository::load(dir.path(), None).unwrap();
    let err = repo.at_precision(Precision::Fp16).unwrap_err().to_string();
    assert!(err.contains("sha256"), "{err}");
}
