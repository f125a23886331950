//! Side by side with the inference servers operators know (Triton, a
//! FastAPI server): the KServe v2 protocol over HTTP with its binary tensor
//! extension, a load generator that speaks it (`tidegate-loadtest kserve`),
//! and the floor it is measured against (`tidegate-baseline`).
//!
//! - [`codec`]: request and response bodies, sans IO, bounded before they
//!   allocate.
//! - [`load`]: the generator: the simulator's open-loop camera schedules
//!   ([`crate::loadgen::camera_schedules`]), one HTTP request per frame.
//! - [`pool`]: its keep-alive connections, at most `max` open; a frame
//!   that finds none free is counted, never queued.
//! - [`tally`]: its accounting, pure: every planned frame in exactly one
//!   bucket, and the [`tally::KserveReport`].
//! - [`baseline`]: the simplest server around the worker's ONNX Runtime
//!   and preprocessing: N sessions, one frame per run, no batching.

pub mod baseline;
pub mod codec;
pub mod load;
pub mod pool;
pub mod tally;

pub use load::{KserveError, KserveOptions, run, run_blocking};
pub use tally::{KserveReport, Outcome};
