//! A missing ONNX Runtime library, in its own test binary: ONNX Runtime can
//! be loaded once per process, and these tests must run where none is.

use std::path::Path;

use tidegate_worker::backend::OrtBackend;
use tidegate_worker::model::Repository;
use tidegate_worker::runtime::{Runtime, RuntimeError, RuntimeOptions};

const BOGUS: &str = "/nonexistent/tidegate/libonnxruntime.so";

#[test]
fn missing_library_is_one_line_saying_what_where_and_how_to_fix() {
    let err = Runtime::init(Some(Path::new(BOGUS))).unwrap_err();
    assert!(matches!(err, RuntimeError::NotFound { .. }), "{err:?}");
    assert_eq!(
        err.to_string(),
        format!(
            "ONNX Runtime library not found: looked for {BOGUS} (from the worker config); \
             run `make setup`, or set ORT_DYLIB_PATH to a libonnxruntime.so (ONNX Runtime 1.31)"
        )
    );
    assert!(Runtime::get().is_none());
}

#[test]
fn file_that_is_not_a_library_fails_to_load_in_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let fake = dir.path().join("libonnxruntime.so");
    std::fs::write(&fake, b"not a shared object").unwrap();
    let err = Runtime::init(Some(&fake)).unwrap_err();
    assert!(matches!(err, RuntimeError::Load { .. }), "{err:?}");
    let text = err.to_string();
    assert!(!text.contains('\n'), "{text}");
    assert!(
        text.starts_with(&format!("cannot load ONNX Runtime from {}", fake.display())),
        "{text}"
    );
    assert!(
        text.ends_with(
            "run `make setup`, or set ORT_DYLIB_PATH to a libonnxruntime.so (ONNX Runtime 1.31)"
        ),
        "{text}"
    );
}

#[test]
fn backend_open_reports_the_missing_library() {
    let models = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models");
    let repo = Repository::load(&models, Some(&["blazeface".to_string()])).unwrap();
    let options = RuntimeOptions {
        library: Some(BOGUS.into()),
        ..RuntimeOptions::default()
    };
    let err = OrtBackend::open(&repo, &options).unwrap_err().to_string();
    assert!(
        err.starts_with("ONNX Runtime library not found: looked for"),
        "{err}"
    );
    assert!(err.contains(BOGUS) && !err.contains('\n'), "{err}");
}
