//! CUDA checks, built with `--features cuda`. On a machine without an NVIDIA
//! driver (or NVRTC, or a CUDA build of ONNX Runtime) each test says what is
//! missing and returns: it cannot fail for lack of a GPU, and cannot pass
//! silently either (the skip is printed; `scripts/gpu-check.sh` runs them
//! where a GPU is and fails when they skip there).
//!
//! - the NVRTC kernel gives the same model input as the CPU preprocessor;
//! - BlazeFace on the CUDA execution provider, with GPU preprocessing and IO
//!   binding, finds the same faces as on the CPU, within tolerance.
//!
//! The CUDA run needs ONNX Runtime's GPU build: set TIDEGATE_ORT_GPU_LIB to
//! its libonnxruntime.so (gpu-check.sh does).

#![cfg(feature = "cuda")]

use std::path::{Path, PathBuf};

use image::imageops::{self, FilterType};
use tidegate_protocol::{DType, Geometry, Layout, Status, Tensor};
use tidegate_worker::backend::{Backend, FrameInput, OrtBackend};
use tidegate_worker::gpu::{self, GpuPreprocessor};
use tidegate_worker::model::Repository;
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

/// Why GPU tests cannot run here, if they cannot.
fn missing() -> Option<&'static str> {
    if !gpu::driver_present() {
        Some("no CUDA driver (libcuda.so)")
    } else if !gpu::nvrtc_present() {
        Some("no NVRTC (libnvrtc.so)")
    } else {
        None
    }
}

fn skip(test: &str, why: &str) {
    eprintln!("SKIPPED {test}: {why}; run scripts/gpu-check.sh on a GPU machine");
    if std::env::var_os("TIDEGATE_REQUIRE_GPU").is_some() {
        panic!("{test}: TIDEGATE_REQUIRE_GPU is set but {why}");
    }
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
                tensor: Tensor {
                    dtype: DType::U8,
                    layout: Layout::Nhwc,
                    shape: vec![1, 128, 128, 3],
                    data: small.into_raw().into(),
                },
                geometry: Geometry::stretch(w, h, 128, 128),
            }
        })
        .collect()
}

#[test]
fn kernel_matches_the_cpu_preprocessor() {
    if let Some(why) = missing() {
        return skip("kernel_matches_the_cpu_preprocessor", why);
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
    let worst = got
        .iter()
        .zip(&want)
        .map(|(g, w)| (g - w).abs())
        .fold(0.0f32, f32::max);
    eprintln!(
        "kernel vs CPU preprocessing: max |diff| {worst:e} over {} values",
        want.len()
    );
    assert!(worst <= 1e-6, "max |diff| {worst}");
}

#[test]
fn cuda_detections_match_the_cpu_within_tolerance() {
    if let Some(why) = missing() {
        return skip("cuda_detections_match_the_cpu_within_tolerance", why);
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
    let mut cuda = OrtBackend::open(&repo, &cuda_options).unwrap_or_else(|e| panic!("{e}"));
    assert!(matches!(cuda.provider(), Provider::Cuda(_)));
    let frames = frames();
    let a = cpu.run("blazeface", &frames);
    let b = cuda.run("blazeface", &frames);
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
    eprintln!(
        "CUDA vs CPU: {faces} faces agree; cuda timings {:?}",
        b[0].timings
    );
}
