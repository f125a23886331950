//! Execution providers from the config, on this CPU-only ONNX Runtime build
//! (the PyPI `onnxruntime` wheel has no CUDA provider): CUDA asked for without
//! a fallback refuses to start saying why; with `fallback = "cpu"` the worker
//! warns and serves (and registers) on the CPU.

use std::path::{Path, PathBuf};
use std::process::Command;

use tidegate_worker::backend::{Backend, BackendError, OrtBackend};
use tidegate_worker::model::Repository;
use tidegate_worker::runtime::{CudaOptions, Fallback, Provider, RuntimeOptions, TensorRtOptions};

fn models_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../models")
}

fn repo() -> Repository {
    Repository::load(&models_dir(), Some(&["blazeface".to_string()])).unwrap()
}

fn cuda_options(fallback: Fallback) -> RuntimeOptions {
    RuntimeOptions {
        intra_threads: 1,
        warmup_runs: 1,
        provider: Provider::Cuda(CudaOptions {
            device_id: 0,
            ..CudaOptions::default()
        }),
        fallback,
        ..RuntimeOptions::default()
    }
}

#[test]
fn cuda_on_a_cpu_build_without_fallback_is_refused_with_the_reason() {
    let err = OrtBackend::open(&repo(), &cuda_options(Fallback::None)).unwrap_err();
    assert!(
        matches!(err, BackendError::ProviderUnavailable { .. }),
        "{err}"
    );
    let text = err.to_string();
    assert!(
        text.starts_with("execution provider cuda:0 is unavailable: "),
        "{text}"
    );
    assert!(
        text.contains("without the CUDA execution provider") && text.contains("onnxruntime-gpu"),
        "{text}"
    );
    assert!(text.contains("runtime.fallback = \"cpu\""), "{text}");
    assert!(!text.contains('\n'), "{text}");
}

#[test]
fn cuda_on_a_cpu_build_with_cpu_fallback_serves_on_the_cpu() {
    let mut backend = OrtBackend::open(&repo(), &cuda_options(Fallback::Cpu)).unwrap();
    assert_eq!(backend.provider(), &Provider::Cpu);
    assert!(
        backend.device().starts_with("cpu ("),
        "{}",
        backend.device()
    );
    let reason = backend.fallback_reason().expect("the fallback is recorded");
    assert!(reason.contains("CUDA"), "{reason}");
    assert!(!backend.gpu_preprocessing("blazeface"));
    assert_eq!(
        backend.preprocessing("blazeface"),
        Some(&tidegate_worker::backend::Preprocessing::Cpu)
    );
    // And it serves.
    let points = backend.profile("blazeface", &[1]).unwrap();
    assert_eq!(points.len(), 1);
}

/// `tidegate-worker check-config` with `[runtime] provider = "cuda"` and the
/// given extra runtime lines: (exit code, stdout, stderr).
fn check_config(extra: &str) -> (Option<i32>, String, String) {
    let dir = tempfile::tempdir().unwrap();
    // the CA the config trusts: check-config reads it as the link does
    tidegate_protocol::certs::generate(dir.path(), &["localhost".to_string()]).unwrap();
    let cfg = dir.path().join("w.toml");
    std::fs::write(
        &cfg,
        format!(
            "name = \"w\"\ntoken = \"t\"\n[gateway]\naddr = \"127.0.0.1:9\"\nca = \"ca.pem\"\n[models]\ndir = \"{}\"\nonly = [\"blazeface\"]\n[runtime]\nintra_threads = 1\nprovider = \"cuda\"\n{extra}[runtime.cuda]\ndevice_id = 0\narena_limit_mb = 1024\nconv_algo_search = \"heuristic\"\n",
            models_dir().display()
        ),
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tidegate-worker"))
        .arg("--config")
        .arg(&cfg)
        .arg("check-config")
        .env("TIDEGATE_LOG", "warn")
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn worker_binary_refuses_cuda_it_cannot_have_and_falls_back_when_allowed() {
    let (code, _, stderr) = check_config("");
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains("tidegate-worker: error: execution provider cuda:0 is unavailable"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");

    let (code, stdout, stderr) = check_config("fallback = \"cpu\"\n");
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        stderr.contains("WARN") && stderr.contains("serving on the CPU"),
        "{stderr}"
    );
    assert!(
        stdout.contains("config ok: 1 model(s) load and run on cpu (1 threads)"),
        "{stdout}"
    );
    // Each model's preprocessing, in the form scripts/gpu-check.sh looks
    // for (`blazeface: preprocessing on gpu` on a GPU machine).
    assert!(
        stdout.contains("\n  blazeface: preprocessing on cpu\n"),
        "{stdout}"
    );
}

#[test]
fn tensorrt_on_a_cpu_build_is_refused_as_cuda_is_and_falls_back_to_the_cpu_when_allowed() {
    let tensorrt = |fallback| RuntimeOptions {
        provider: Provider::Cuda(CudaOptions {
            device_id: 0,
            tensorrt: Some(TensorRtOptions {
                engine_cache_dir: None,
                fp16: true,
                max_workspace_bytes: None,
            }),
            ..CudaOptions::default()
        }),
        ..cuda_options(fallback)
    };
    let text = OrtBackend::open(&repo(), &tensorrt(Fallback::None))
        .unwrap_err()
        .to_string();
    assert!(
        text.starts_with("execution provider tensorrt:0 is unavailable: ")
            && text.contains("without the CUDA execution provider"),
        "{text}"
    );
    assert!(!text.contains('\n'), "{text}");
    let backend = OrtBackend::open(&repo(), &tensorrt(Fallback::Cpu)).unwrap();
    assert_eq!(backend.provider(), &Provider::Cpu);
    // On the CPU TensorRT was never asked for.
    assert_eq!(backend.tensorrt("blazeface"), None);
}

#[test]
fn worker_binary_takes_tensorrt_and_fp16_from_its_config() {
    let (code, stdout, stderr) = check_config(
        "fallback = \"cpu\"\nprecision = \"fp16\"\n[runtime.tensorrt]\nengine_cache_dir = \"trt\"\n",
    );
    // provider = "cuda" in the helper; the [runtime.tensorrt] table is read
    // and checked even when another provider is chosen.
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stdout.contains("\n  precision fp16\n"), "{stdout}");
    let (code, _, stderr) = check_config("precision = \"fp8\"\n");
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("fp8"), "{stderr}");
}
