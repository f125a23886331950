//! CUDA checks, built with `--features cuda`. Where no CUDA device can be
//! used (no driver, a driver but no GPU or a CUDA error, no NVRTC, no CUDA
//! build of ONNX Runtime) each test says what is missing and returns: it
//! cannot fail for lack of a GPU, and cannot pass silently either (the skip
//! is printed; with `TIDEGATE_REQUIRE_GPU=1`, as `scripts/gpu-check.sh`
//! runs them, a skip is a failure).
//!
//! - the NVRTC kernel gives the same model input as the CPU preprocessor,
//!   for every layout and channel order, and for a batch of real frames;
//! - BlazeFace on the CUDA execution provider, with GPU preprocessing
//!   (asserted to be in use) whose device buffer ONNX Runtime reads in
//!   place, finds the same faces as on the CPU, within tolerance; a hang
//!   there fails the test after ten minutes instead of holding the GPU
//!   check for ever.
//!
//! The CUDA run needs ONNX Runtime's GPU build: set TIDEGATE_ORT_GPU_LIB to
//! its libonnxruntime.so (gpu-check.sh does).

#![cfg(feature = "cuda")]

use std::path::{Path, PathBuf};

use image::imageops::{self, FilterType};
use tidegate_protocol::{DType, Geometry, Layout, Status, Tensor};
use tidegate_worker::backend::{Backend, FrameInput, OrtBackend, Preprocessing};
use tidegate_worker::gpu::{self, GpuPreprocessor};
use tidegate_worker::model::{ColorOrder, InputSpec, Normalize, Repository, Resize};
use tidegate_worker::preprocess::Preprocessor;
use tidegate_worker::runtime::{CudaOptions, Fallback, Provider, RuntimeOptions};

/// The model repository: `TIDEGATE_MODELS_DIR` (a GPU kit built by
/// scripts/gpu-kit.sh runs these tests away from the checkout), else this
/// checkout's `models/`.
fn models_dir() -> PathBuf {
    std::env::var_os("TIDEGATE_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../models"))
}

/// Why GPU tests cannot run here, if they cannot: asks the driver for its
/// devices, so a machine with the driver's libraries but no GPU skips too.
fn missing() -> Option<String> {
    match gpu::probe() {
        Err(e) => Some(format!("no usable CUDA device ({e})")),
        Ok(devices) if devices.is_empty() => Some("the CUDA driver lists no device".into()),
        Ok(_) if !gpu::nvrtc_present() => Some("no NVRTC (libnvrtc.so)".into()),
        Ok(_) => None,
    }
}

/// Whether `TIDEGATE_REQUIRE_GPU=1`: a skip is then a failure.
fn gpu_required() -> bool {
    std::env::var("TIDEGATE_REQUIRE_GPU").is_ok_and(|v| v == "1")
}

fn skip(test: &str, why: &str) {
    eprintln!("SKIPPED {test}: {why}; run scripts/gpu-check.sh on a GPU machine");
    assert!(!gpu_required(), "{test}: TIDEGATE_REQUIRE_GPU=1 but {why}");
}

/// Eight different 128×128 frames from astronaut.png: crops and flips.
fn frames() -> Vec<FrameInput> {
    let img = image::open(models_dir().join("testdata/astronaut.png"))
        .unwrap()
        .to_rgb8();
    (0..8u32)
        .map(|i| {
            let side = 512 - 32 * (i % 4);
            let mut crop = imageops::crop_imm(
                &img,
                16 * (i % 3),
                8 * (i % 2),
                side - 16 * (i % 3),
                side - 8 * (i % 2),
            )
            .to_image();
            if i >= 4 {
                crop = imageops::flip_horizontal(&crop);
            }
            let (w, h) = crop.dimensions();
            let small = imageops::resize(&crop, 128, 128, FilterType::Triangle);
            FrameInput {
                tensor: Tensor::raw(
                    DType::U8,
                    Layout::Nhwc,
                    vec![1, 128, 128, 3],
                    small.into_raw().into(),
                ),
                geometry: Geometry::stretch(w, h, 128, 128),
            }
        })
        .collect()
}

/// Largest |a - b| over two equally long slices; NaN anywhere is infinite.
fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            let d = (x - y).abs();
            if d.is_nan() { f32::INFINITY } else { d }
        })
        .fold(0.0f32, f32::max)
}

#[test]
fn kernel_matches_the_cpu_preprocessor_for_every_layout_and_channel_order() {
    if let Some(why) = missing() {
        return skip(
            "kernel_matches_the_cpu_preprocessor_for_every_layout_and_channel_order",
            &why,
        );
    }
    // An odd size (9×7), so that a swapped width and height shows.
    let src: Vec<u8> = (0..2 * 9 * 7 * 3).map(|i| (i * 37 % 256) as u8).collect();
    let frame_len = 9 * 7 * 3;
    for layout in [Layout::Nhwc, Layout::Nchw] {
        for color in [ColorOrder::Rgb, ColorOrder::Bgr] {
            let spec = InputSpec {
                name: "x".into(),
                layout,
                width: 9,
                height: 7,
                channels: 3,
                color,
                resize: Resize::Stretch,
                model_dtype: DType::F32,
                normalize: Normalize {
                    scale: 1.0 / 255.0,
                    mean: [0.485, 0.456, 0.406],
                    std: [0.229, 0.224, 0.225],
                },
            };
            let mut pre = GpuPreprocessor::new("m", 0, &spec, 2).unwrap();
            // One layout for the batch (one launch), and a mixed batch (a
            // launch per run of one layout).
            let (nhwc, nchw) = (Layout::Nhwc, Layout::Nchw);
            for src_layouts in [[nhwc, nhwc], [nchw, nchw], [nhwc, nchw]] {
                let batch: Vec<(&[u8], Layout)> =
                    src.chunks_exact(frame_len).zip(src_layouts).collect();
                pre.convert(&batch).unwrap();
                let got = pre.download(2).unwrap();
                let mut want = vec![f32::NAN; src.len()];
                let cpu = Preprocessor::new(&spec);
                for ((f, src_layout), out) in batch.iter().zip(want.chunks_exact_mut(frame_len)) {
                    cpu.to_f32(f, *src_layout, out).unwrap();
                }
                let worst = max_diff(&got, &want);
                assert!(
                    worst <= 1e-6,
                    "model {layout}/{color:?}, frames {src_layouts:?}: max |diff| {worst}"
                );
            }
        }
    }
}

#[test]
fn kernel_matches_the_cpu_preprocessor_on_a_batch_of_real_frames() {
    if let Some(why) = missing() {
        return skip(
            "kernel_matches_the_cpu_preprocessor_on_a_batch_of_real_frames",
            &why,
        );
    }
    let repo = Repository::load(&models_dir(), Some(&["blazeface".to_string()])).unwrap();
    let spec = &repo.get("blazeface").unwrap().spec;
    let frames = frames();
    let mut pre = GpuPreprocessor::new("blazeface", 0, &spec.input, 8).unwrap();
    let batch: Vec<(&[u8], Layout)> = frames
        .iter()
        .map(|f| (&f.tensor.data[..], Layout::Nhwc))
        .collect();
    pre.convert(&batch).unwrap();
    let got = pre.download(8).unwrap();
    let cpu = Preprocessor::new(&spec.input);
    let all: Vec<u8> = frames.iter().flat_map(|f| f.tensor.data.to_vec()).collect();
    let mut want = vec![0.0; all.len()];
    cpu.to_f32(&all, Layout::Nhwc, &mut want).unwrap();
    let worst = max_diff(&got, &want);
    eprintln!(
        "kernel vs CPU preprocessing: max |diff| {worst:e} over {} values",
        want.len()
    );
    assert!(worst <= 1e-6, "max |diff| {worst}");
}

#[test]
fn cuda_detections_match_the_cpu_within_tolerance() {
    if let Some(why) = missing() {
        return skip("cuda_detections_match_the_cpu_within_tolerance", &why);
    }
    let Some(lib) = std::env::var_os("TIDEGATE_ORT_GPU_LIB") else {
        return skip(
            "cuda_detections_match_the_cpu_within_tolerance",
            "TIDEGATE_ORT_GPU_LIB (ONNX Runtime's GPU build) is not set",
        );
    };
    let repo = Repository::load(&models_dir(), Some(&["blazeface".to_string()])).unwrap();
    let base = RuntimeOptions {
        library: Some(PathBuf::from(lib)),
        warmup_runs: 1,
        ..RuntimeOptions::default()
    };
    let mut cpu = OrtBackend::open(&repo, &base).unwrap();
    let cuda_options = RuntimeOptions {
        provider: Provider::Cuda(CudaOptions::default()),
        fallback: Fallback::None,
        ..base
    };
    assert_eq!(cpu.preprocessing("blazeface"), Some(&Preprocessing::Cpu));
    let frames = frames();
    let a = cpu.run("blazeface", &frames);
    // on a thread of its own: a CUDA session or run that hangs (a wedged
    // GPU, a deadlock) fails the check instead of holding it for ever
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn({
        let frames = frames.clone();
        move || {
            let mut cuda = OrtBackend::open(&repo, &cuda_options).unwrap_or_else(|e| panic!("{e}"));
            let provider = cuda.provider().clone();
            let preprocessing = cuda.preprocessing("blazeface").cloned();
            let gpu = cuda.gpu_preprocessing("blazeface");
            let all = cuda.run("blazeface", &frames);
            // Three frames run padded to the profiled batch of 4.
            let three = cuda.run("blazeface", &frames[..3]);
            let rows = cuda.last_run_size("blazeface");
            let _ = tx.send((provider, preprocessing, gpu, all, three, rows));
        }
    });
    let (provider, preprocessing, gpu, b, three, rows) = rx
        .recv_timeout(std::time::Duration::from_secs(600))
        .expect("the CUDA session opened and ran within ten minutes (it hung, or panicked)");
    assert!(matches!(provider, Provider::Cuda(_)));
    // Otherwise the kernel and the in-place read would go untested: the
    // worker serves on, preprocessing on the CPU, when they cannot start.
    assert_eq!(
        preprocessing,
        Some(Preprocessing::Gpu),
        "GPU preprocessing is off"
    );
    assert!(gpu);
    let mut faces = 0;
    for (i, (a, b)) in a.iter().zip(&b).enumerate() {
        assert_eq!(a.status, Status::Ok, "{a:?}");
        assert_eq!(b.status, Status::Ok, "{b:?}");
        assert_eq!(
            a.detections.len(),
            b.detections.len(),
            "frame {i}: {a:?} vs {b:?}"
        );
        for (x, y) in a.detections.iter().zip(&b.detections) {
            faces += 1;
            assert!(
                (x.score - y.score).abs() <= 1e-3,
                "frame {i}: {x:?} vs {y:?}"
            );
            for (p, q) in [x.x1, x.y1, x.x2, x.y2]
                .iter()
                .zip([y.x1, y.y1, y.x2, y.y2])
            {
                assert!((p - q).abs() <= 0.5, "frame {i}: {x:?} vs {y:?}");
            }
        }
    }
    assert!(faces >= 4, "only {faces} faces in 8 astronaut crops");
    assert_eq!(rows, Some(4), "a batch of 3 on CUDA runs padded to 4");
    for (i, (x, y)) in b.iter().zip(&three).enumerate() {
        assert_eq!(y.status, Status::Ok, "{y:?}");
        assert_eq!(x.detections.len(), y.detections.len(), "frame {i}");
        for (p, q) in x.detections.iter().zip(&y.detections) {
            assert!(
                (p.score - q.score).abs() <= 1e-3,
                "frame {i}: {p:?} vs {q:?}"
            );
            assert!(
                (p.x1 - q.x1).abs() <= 0.5 && (p.y2 - q.y2).abs() <= 0.5,
                "frame {i}"
            );
        }
    }
    eprintln!(
        "CUDA vs CPU: {faces} faces agree; cuda timings {:?}",
        b[0].timings
    );
}

/// A CUDA device that cannot be used, asked of ONNX Runtime's GPU build:
/// device 99 (beyond any machine's; on a machine without a usable GPU, any
/// device) is refused at start with the reason, and with `fallback = "cpu"`
/// every model serves on the CPU. Runs with or without a GPU, wherever
/// TIDEGATE_ORT_GPU_LIB is set.
#[test]
fn unusable_cuda_device_is_refused_with_the_reason_or_served_on_the_cpu() {
    let Some(lib) = std::env::var_os("TIDEGATE_ORT_GPU_LIB") else {
        return skip(
            "unusable_cuda_device_is_refused_with_the_reason_or_served_on_the_cpu",
            "TIDEGATE_ORT_GPU_LIB (ONNX Runtime's GPU build) is not set",
        );
    };
    let repo = Repository::load(&models_dir(), Some(&["blazeface".to_string()])).unwrap();
    let options = |fallback| RuntimeOptions {
        library: Some(PathBuf::from(&lib)),
        warmup_runs: 1,
        provider: Provider::Cuda(CudaOptions {
            device_id: 99,
            ..CudaOptions::default()
        }),
        fallback,
        ..RuntimeOptions::default()
    };
    let err = OrtBackend::open(&repo, &options(Fallback::None)).unwrap_err();
    let text = err.to_string();
    assert!(
        text.starts_with("execution provider cuda:99 is unavailable: "),
        "{text}"
    );
    // The device check names what is wrong: no such device, or no
    // usable CUDA at all.
    assert!(
        text.contains("no CUDA device 99") || missing().is_some(),
        "{text}"
    );
    assert!(!text.contains("valid ONNX model"), "{text}");
    eprintln!("device 99: {text}");

    let mut backend = OrtBackend::open(&repo, &options(Fallback::Cpu)).unwrap();
    assert_eq!(backend.provider(), &Provider::Cpu);
    assert_eq!(
        backend.preprocessing("blazeface"),
        Some(&Preprocessing::Cpu)
    );
    assert!(backend.fallback_reason().is_some());
    let out = backend.run("blazeface", &frames()[..2]);
    assert!(out.iter().all(|o| o.status == Status::Ok), "{out:?}");
}
