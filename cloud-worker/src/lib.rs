//! tidegate's cloud worker: runs ONNX models on frames the gateway dispatches.
//!
//! The data path through this crate, one hop per module:
//! 1. [`model`] loads the model repository: every `models/<name>/model.toml`
//!    and its checked `.onnx` file.
//! 2. [`runtime`] finds and loads the ONNX Runtime library, once per process.
//! 3. [`backend`] opens one session per model ([`backend::OrtBackend`]),
//!    validates each frame, and runs batches: [`codec`] decodes JPEG and
//!    PNG frames into raw u8 tensors,
//!    [`preprocess`] turns u8 RGB frames into the model's input, ONNX Runtime
//!    runs it, and [`decode`] turns the outputs into detections in source
//!    pixels.
//! 4. [`executor`] runs the backend on its own thread behind a bounded queue,
//!    so that async code (the QUIC link) submits jobs without blocking.
//!
//! Beside the data path, [`watchdog`] watches the executor's running job
//! and ends the process when ONNX Runtime or the device is wedged, and
//! [`metrics`] serves the worker's batches and GPUs to Prometheus.

pub mod backend;
pub mod codec;
pub mod config;
pub mod decode;
pub mod executor;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod link;
pub mod metrics;
pub mod model;
pub mod preprocess;
pub mod runtime;
#[cfg(feature = "stand-in")]
pub mod stand_in;
pub mod watchdog;
