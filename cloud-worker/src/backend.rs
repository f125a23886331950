//! Inference backends: frames of one model in, one outcome per frame out.
//!
//! [`Backend`] is synchronous and blocking; it runs on the executor's own
//! thread ([`crate::executor`]), never on a tokio worker. [`OrtBackend`] is
//! the ONNX Runtime implementation: one session per model, on the CPU or on
//! ONNX Runtime's CUDA execution provider, checked against its model.toml
//! when opened, warmed up, and then fed preprocessed batches whose outputs
//! the model's decoder turns into detections. Its warm-up and profiling
//! runs are recorded in an [`Activity`] ([`OrtBackend::open_watched`]), so
//! that the [`watchdog`](crate::watchdog) ends a worker wedged in them as
//! it does one wedged in a batch. On CUDA, with the `cuda`
//! feature, f32 models are preprocessed on the GPU (`gpu` module); where
//! that cannot start, [`OrtBackend::preprocessing`] says so and why.
//!
//! JPEG and PNG frames are decoded into raw tensors first, before
//! preprocessing, by [`crate::codec`] on the backend's thread (a batch's
//! files spread over scoped helper threads); the GPU path gets raw u8 like
//! the CPU path.
//!
//! A bad frame fails alone, with a [`Status::Failed`] that says what was
//! wrong; the frames around it, and every later call, are served as usual.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use ort::ep::cuda::ConvAlgorithmSearch;
use ort::ep::{CUDA, ExecutionProvider};
use ort::session::{Session, SessionInputValue};
use ort::value::{Outlet, TensorElementType, TensorRef};
use tidegate_protocol::{
    DType, Detection, Encoding, Geometry, Layout, OutputTensor, Status, Tensor, Timings,
    shape_string,
};

use crate::codec;
use crate::decode::{Decoder, DecoderError, OutputView};
use crate::executor::{Activity, Phase};
use crate::model::{DimsDisplay, Model, ModelSpec, Repository};
use crate::preprocess::Preprocessor;
use crate::runtime::{
    ConvAlgoSearch, CudaOptions, Fallback, Provider, Runtime, RuntimeError, RuntimeOptions,
    one_line,
};

/// One frame for inference: u8 RGB pixels shaped `[1,H,W,C]` (NHWC) or
/// `[1,C,H,W]` (NCHW) at the model's input size, raw or as a JPEG or PNG
/// file of that NHWC shape, and how they were fitted from the source frame.
#[derive(Debug, Clone, PartialEq)]
pub struct FrameInput {
    /// The pixels.
    pub tensor: Tensor,
    /// Maps model-input coordinates back to source pixels.
    pub geometry: Geometry,
}

/// What became of one frame.
#[derive(Debug, Clone, PartialEq)]
pub struct FrameOutcome {
    /// `Ok`, or `Failed` with the reason.
    pub status: Status,
    /// Detections in source pixels (empty unless `Ok`).
    pub detections: Vec<Detection>,
    /// Time spent in each stage on the worker (`queue_us` is left 0 for the
    /// gateway to fill).
    pub timings: Timings,
    /// The frame's outputs, for models with the raw decoder (empty
    /// otherwise), as the link returns them in `ItemResult::outputs`.
    pub outputs: Vec<OutputTensor>,
}

impl FrameOutcome {
    /// A failed frame with the reason, no detections and no timings.
    pub fn failed(reason: impl Into<String>) -> Self {
        FrameOutcome {
            status: Status::Failed(reason.into()),
            detections: Vec::new(),
            timings: Timings::default(),
            outputs: Vec::new(),
        }
    }
}

/// Runs inference for a set of models.
pub trait Backend {
    /// The models served, sorted by name.
    fn models(&self) -> &[ModelSpec];

    /// Runs `frames` through `model`. Returns exactly one outcome per frame,
    /// in order; frames that cannot be run get [`Status::Failed`].
    fn run(&mut self, model: &str, frames: &[FrameInput]) -> Vec<FrameOutcome>;

    /// Measures the latency of a whole batch (preprocess, inference and
    /// decode) for each batch size the model accepts, after warming up, as
    /// `(batch, microseconds)`. Sizes of 0 or above the model's `max_batch`
    /// are left out.
    fn profile(
        &mut self,
        model: &str,
        batch_sizes: &[u16],
    ) -> Result<Vec<(u16, u32)>, BackendError>;
}

/// Why a frame cannot be run by `spec`, as the text of its failed status.
pub fn check_frame(spec: &ModelSpec, tensor: &Tensor) -> Result<(), String> {
    let want = spec.input.frame_shape(tensor.layout);
    let layout_note = match tensor.layout {
        Layout::Nhwc => "",
        Layout::Nchw => " (nchw)",
    };
    if tensor.dtype != DType::U8 || tensor.shape != want {
        return Err(format!(
            "model '{}' expects u8 {}{layout_note}, frame has {}{}",
            spec.name,
            shape_string(&want),
            if tensor.dtype == DType::U8 {
                ""
            } else {
                "f32 "
            },
            shape_string(&tensor.shape),
        ));
    }
    // An encoded frame's file is checked against the shape as it is
    // decoded (`codec::decode_frame`).
    let need = spec.input.frame_len();
    if tensor.encoding == Encoding::Raw && tensor.data.len() != need {
        return Err(format!(
            "model '{}': frame {} of u8 needs {need} bytes, payload has {}",
            spec.name,
            shape_string(&tensor.shape),
            tensor.data.len()
        ));
    }
    Ok(())
}

/// `n` mid-grey frames for `spec`, for warm-up and profiling.
fn grey_frames(spec: &ModelSpec, n: usize) -> Vec<FrameInput> {
    let (w, h) = (spec.input.width, spec.input.height);
    let tensor = Tensor::raw(
        DType::U8,
        Layout::Nhwc,
        spec.input.frame_shape(Layout::Nhwc).to_vec(),
        Bytes::from(vec![128u8; spec.input.frame_len()]),
    );
    let frame = FrameInput {
        tensor,
        geometry: Geometry::stretch(w, h, w, h),
    };
    vec![frame; n]
}

/// The placeholder every outcome starts as; a frame left with it is a bug.
const UNPROCESSED: &str = "worker bug: the backend did not process this frame";

fn micros(d: Duration) -> u32 {
    u32::try_from(d.as_micros()).unwrap_or(u32::MAX)
}

/// The model input buffer of one session, sized for `max_batch` frames.
#[derive(Debug)]
enum InputBuffer {
    F32(Vec<f32>),
    U8(Vec<u8>),
}

/// Where a model's frames become its input tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Preprocessing {
    /// On the CPU, for a session on the CPU.
    Cpu,
    /// On the CPU although the session runs on CUDA (frames are normalised
    /// on the CPU and uploaded as f32, or uploaded as they are for u8
    /// models), and why.
    CpuForCuda(String),
    /// On the GPU: each frame uploaded once as u8, normalised by the NVRTC
    /// kernel, and read by ONNX Runtime in place ([`run_in_place`]).
    Gpu,
}

impl std::fmt::Display for Preprocessing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Preprocessing::Cpu => f.write_str("cpu"),
            Preprocessing::CpuForCuda(why) => write!(f, "cpu ({why})"),
            Preprocessing::Gpu => f.write_str("gpu (u8 upload, NVRTC kernel, read in place)"),
        }
    }
}

/// One model's session and everything needed to feed and read it.
struct ModelSession {
    spec: ModelSpec,
    session: Session,
    preprocessor: Preprocessor,
    decoder: Decoder,
    /// The host input buffer of the CPU path (empty when the GPU path
    /// preprocesses).
    input: InputBuffer,
    preprocessing: Preprocessing,
    /// The batch sizes a batch is padded up to ([`batch_buckets`]); empty
    /// when batches run at their own size.
    buckets: Vec<usize>,
    /// Rows of the last run, padding included (0 before the first).
    last_run: usize,
    /// With `provider = "tensorrt"`: `Ok` when TensorRT serves the model,
    /// or why the CUDA provider serves it alone (one line).
    tensorrt: Option<Result<(), String>>,
    /// Set when the session runs on CUDA and preprocessing moved there too.
    #[cfg(feature = "cuda")]
    gpu: Option<GpuInput>,
}

impl std::fmt::Debug for ModelSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelSession")
            .field("model", &self.spec.name)
            .field("decoder", &self.decoder)
            .field("preprocessing", &self.preprocessing)
            .finish_non_exhaustive()
    }
}

/// The batch sizes a worker warms up and profiles for a model with
/// `max_batch`, and (with padding, [`RuntimeOptions::pad_batches`]) the only
/// sizes it runs: the powers of two below `max_batch`, and `max_batch`.
pub fn batch_buckets(max_batch: u16) -> Vec<u16> {
    let mut sizes: Vec<u16> = std::iter::successors(Some(1u16), |&b| b.checked_mul(2))
        .take_while(|&b| b < max_batch)
        .collect();
    sizes.push(max_batch.max(1));
    sizes
}

/// The step curve of [`OrtBackend::registered_profile`]: for each of
/// `buckets` (ascending) measured in `measured`, its time at the size after
/// the bucket below and at the bucket itself.
fn step_profile(buckets: &[usize], measured: &[(u16, u32)]) -> Vec<(u16, u32)> {
    let mut points: Vec<(u16, u32)> = Vec::with_capacity(2 * buckets.len());
    let mut below = 0usize;
    for &bucket in buckets {
        let Some(&(_, us)) = measured.iter().find(|(b, _)| usize::from(*b) == bucket) else {
            continue;
        };
        for n in [below + 1, bucket] {
            if points.last().is_none_or(|&(last, _)| usize::from(last) < n) {
                points.push((u16::try_from(n).unwrap_or(u16::MAX), us));
            }
        }
        below = bucket;
    }
    points
}

impl ModelSession {
    /// Rows a batch of `n` frames runs as: the smallest bucket that holds
    /// it, or `n` without padding.
    fn run_size(&self, n: usize) -> usize {
        self.buckets.iter().copied().find(|&b| b >= n).unwrap_or(n)
    }

    /// Runs frames `which` of `frames` (all valid, at most `max_batch`) as
    /// one batch, writing their outcomes. With padding, the rows after the
    /// frames hold what the input buffer held (zeros, or earlier frames);
    /// rows are independent, and only the frames' rows are decoded.
    fn run_batch(&mut self, frames: &[FrameInput], which: &[usize], outcomes: &mut [FrameOutcome]) {
        self.last_run = self.run_size(which.len());
        #[cfg(feature = "cuda")]
        if self.gpu.is_some() {
            return self.run_batch_gpu(frames, which, outcomes);
        }
        let rows = self.last_run;
        let ModelSession {
            spec,
            session,
            preprocessor,
            decoder,
            input,
            ..
        } = self;
        let n = which.len();
        let len = spec.input.frame_len();
        let mut preprocess_us = Vec::with_capacity(n);
        let shape: Vec<i64> = spec
            .input
            .model_shape(rows as u32)
            .iter()
            .map(|&d| i64::from(d))
            .collect();
        let prepared = which.iter().enumerate().try_for_each(|(slot, &i)| {
            let start = Instant::now();
            let src = &frames[i].tensor;
            let range = slot * len..(slot + 1) * len;
            let r = match input {
                InputBuffer::F32(buf) => {
                    preprocessor.to_f32(&src.data, src.layout, &mut buf[range])
                }
                InputBuffer::U8(buf) => preprocessor.to_u8(&src.data, src.layout, &mut buf[range]),
            };
            preprocess_us.push(micros(start.elapsed()));
            r
        });
        let value: Result<SessionInputValue<'_>, String> = match prepared {
            Err(e) => Err(e.to_string()),
            Ok(()) => match input {
                InputBuffer::F32(buf) => TensorRef::from_array_view((shape, &buf[..rows * len]))
                    .map(SessionInputValue::from)
                    .map_err(|e| e.to_string()),
                InputBuffer::U8(buf) => TensorRef::from_array_view((shape, &buf[..rows * len]))
                    .map(SessionInputValue::from)
                    .map_err(|e| e.to_string()),
            },
        };
        let value = match value {
            Ok(v) => v,
            Err(e) => {
                return fail_all(
                    spec,
                    which,
                    outcomes,
                    format!("model '{}': cannot build the input tensor: {e}", spec.name),
                );
            }
        };
        let start = Instant::now();
        let run = session.run(vec![(Cow::Borrowed(spec.input.name.as_str()), value)]);
        let inference_us = micros(start.elapsed());
        match run {
            Ok(results) => decode_batch(
                spec,
                decoder,
                &results,
                frames,
                which,
                &preprocess_us,
                inference_us,
                outcomes,
            ),
            Err(e) => fail_all(
                spec,
                which,
                outcomes,
                format!("model '{}': ONNX Runtime run failed: {e}", spec.name),
            ),
        }
    }

    /// [`ModelSession::run_batch`] with the frames uploaded once as u8,
    /// converted by the CUDA kernel, and read by ONNX Runtime in place.
    #[cfg(feature = "cuda")]
    fn run_batch_gpu(
        &mut self,
        frames: &[FrameInput],
        which: &[usize],
        outcomes: &mut [FrameOutcome],
    ) {
        let rows = self.last_run;
        let ModelSession {
            spec,
            session,
            decoder,
            gpu,
            ..
        } = self;
        let Some(gpu) = gpu.as_mut() else {
            return;
        };
        let n = which.len();
        let start = Instant::now();
        let batch: Vec<(&[u8], Layout)> = which
            .iter()
            .map(|&i| (&frames[i].tensor.data[..], frames[i].tensor.layout))
            .collect();
        if let Err(e) = gpu.preprocessor.convert(&batch) {
            return fail_all(spec, which, outcomes, format!("model '{}': {e}", spec.name));
        }
        // The kernel converts the whole batch at once; each frame is charged
        // its share.
        let preprocess_us = vec![micros(start.elapsed()) / n.max(1) as u32; n];
        let shape: Vec<i64> = spec
            .input
            .model_shape(rows as u32)
            .iter()
            .map(|&d| i64::from(d))
            .collect();
        let bound = gpu.preprocessor.input_tensor(gpu.device_id, &shape);
        let tensor = match bound {
            Ok(t) => t,
            Err(e) => {
                return fail_all(
                    spec,
                    which,
                    outcomes,
                    format!("model '{}': cannot bind the GPU input: {e}", spec.name),
                );
            }
        };
        let start = Instant::now();
        let run = run_in_place(session, spec.input.name.as_str(), tensor);
        let inference_us = micros(start.elapsed());
        match run {
            Ok(results) => decode_batch(
                spec,
                decoder,
                &results,
                frames,
                which,
                &preprocess_us,
                inference_us,
                outcomes,
            ),
            Err(e) => fail_all(
                spec,
                which,
                outcomes,
                format!("model '{}': ONNX Runtime run failed: {e}", spec.name),
            ),
        }
    }
}

/// Fails every frame of a batch with `reason`.
fn fail_all(spec: &ModelSpec, which: &[usize], outcomes: &mut [FrameOutcome], reason: String) {
    tracing::warn!(model = %spec.name, frames = which.len(), %reason, "batch failed");
    for &i in which {
        outcomes[i] = FrameOutcome::failed(reason.clone());
    }
}

/// Reads a run's outputs and decodes each frame of the batch.
#[allow(clippy::too_many_arguments)]
fn decode_batch(
    spec: &ModelSpec,
    decoder: &Decoder,
    results: &ort::session::SessionOutputs<'_>,
    frames: &[FrameInput],
    which: &[usize],
    preprocess_us: &[u32],
    inference_us: u32,
    outcomes: &mut [FrameOutcome],
) {
    let mut views = Vec::with_capacity(spec.outputs.len());
    for out in &spec.outputs {
        let extracted = results
            .get(out.name.as_str())
            .ok_or_else(|| "is missing from the run's results".to_string())
            .and_then(|v| v.try_extract_tensor::<f32>().map_err(|e| e.to_string()));
        match extracted {
            Ok((shape, data)) => views.push(OutputView {
                name: &out.name,
                shape,
                data,
            }),
            Err(e) => {
                return fail_all(
                    spec,
                    which,
                    outcomes,
                    format!("model '{}': output {:?} {e}", spec.name, out.name),
                );
            }
        }
    }
    for (slot, &i) in which.iter().enumerate() {
        let start = Instant::now();
        let decoded = decoder
            .decode(&views, slot, &frames[i].geometry)
            .and_then(|d| Ok((d, decoder.raw(&views, slot)?)));
        let postprocess_us = micros(start.elapsed());
        let timings = Timings {
            queue_us: 0,
            decode_us: 0,
            preprocess_us: preprocess_us[slot],
            inference_us,
            postprocess_us,
        };
        outcomes[i] = match decoded {
            Ok((detections, outputs)) => FrameOutcome {
                status: Status::Ok,
                detections,
                timings,
                outputs,
            },
            Err(e) => FrameOutcome {
                timings,
                ..FrameOutcome::failed(format!("model '{}': {e}", spec.name))
            },
        };
    }
}

/// Runs `session` on `input`, a tensor that already lies where the session
/// reads its input `name` (the GPU preprocessor's device buffer): ONNX
/// Runtime reads it there, without a copy, and returns the outputs in host
/// memory.
///
/// Not through `IoBinding::bind_input`: in ort 2.0.0-rc.15 it clones a
/// borrowed tensor that is already on the device the session wants it on,
/// and the clone binds it again under a lock the first bind holds, so the
/// call never returns (`tests/blazeface.rs` checks this path on the CPU,
/// where a CPU session and a borrowed host buffer take it too).
pub fn run_in_place<'s>(
    session: &'s mut Session,
    name: &str,
    input: ort::value::TensorRefMut<'_, f32>,
) -> ort::Result<ort::session::SessionOutputs<'s>> {
    session.run(vec![(Cow::Borrowed(name), SessionInputValue::from(input))])
}

/// The GPU side of a model session: the kernel and its device buffers.
#[cfg(feature = "cuda")]
struct GpuInput {
    preprocessor: crate::gpu::GpuPreprocessor,
    device_id: i32,
}

#[cfg(feature = "cuda")]
impl GpuInput {
    /// GPU preprocessing for `spec` on CUDA device `device_id`.
    fn new(spec: &ModelSpec, device_id: u32) -> Result<Self, String> {
        let preprocessor = crate::gpu::GpuPreprocessor::new(
            &spec.name,
            device_id as usize,
            &spec.input,
            spec.max_batch as usize,
        )
        .map_err(|e| e.to_string())?;
        Ok(GpuInput {
            preprocessor,
            device_id: i32::try_from(device_id).unwrap_or(i32::MAX),
        })
    }
}

/// ONNX Runtime, on the CPU or on CUDA: one session per model of a
/// [`Repository`].
#[derive(Debug)]
pub struct OrtBackend {
    specs: Vec<ModelSpec>,
    sessions: Vec<ModelSession>,
    options: RuntimeOptions,
    provider: Provider,
    fallback_reason: Option<String>,
    /// Where warm-up and profiling runs are recorded.
    activity: Arc<Activity>,
    /// Threads that decode a batch's JPEG and PNG frames: the host's cores.
    decode_threads: usize,
    /// Tests only: holds runs as a GPU's cold shapes and slow batches would.
    #[cfg(feature = "stand-in")]
    stand_in: Option<crate::stand_in::StandIn>,
}

impl OrtBackend {
    /// Loads ONNX Runtime (see [`Runtime::init`]), opens a session for every
    /// model in `repo`, checks each against its model.toml (input and output
    /// names, element types, fixed dimensions, batch) and warms it up.
    ///
    /// Where CUDA is asked for but cannot work (no CUDA build of ONNX
    /// Runtime, no such device, or a session that cannot be opened or warmed
    /// up on it although it can on the CPU), this is
    /// [`BackendError::ProviderUnavailable`] with the reason, or, with
    /// `fallback = "cpu"`, a warning and every model on the CPU.
    ///
    /// Its runs are recorded in an activity nobody watches; the worker uses
    /// [`OrtBackend::open_watched`].
    pub fn open(repo: &Repository, options: &RuntimeOptions) -> Result<Self, BackendError> {
        OrtBackend::open_watched(repo, options, Arc::new(Activity::default()))
    }

    /// [`OrtBackend::open`], recording each warm-up run (here) and each
    /// profiling run (in [`Backend::profile`]) in `activity`, with its model
    /// and batch size ([`Phase::WarmUp`], [`Phase::Profiling`]), for a
    /// [`watchdog`](crate::watchdog) started before to end the process
    /// should one never return. Opening a session (reading and optimising
    /// the graph) is not a run and is not recorded.
    pub fn open_watched(
        repo: &Repository,
        options: &RuntimeOptions,
        activity: Arc<Activity>,
    ) -> Result<Self, BackendError> {
        let runtime = Runtime::init(options.library.as_deref())?;
        let requested = options.provider.clone();
        let (provider, sessions, fallback_reason) =
            match open_sessions(runtime, repo, options, &requested, &activity) {
                Ok(sessions) => (requested, sessions, None),
                Err(err @ BackendError::ProviderUnavailable { .. })
                    if options.fallback == Fallback::Cpu && requested != Provider::Cpu =>
                {
                    tracing::warn!("{err}; runtime.fallback = \"cpu\": serving on the CPU");
                    let BackendError::ProviderUnavailable { reason, .. } = err else {
                        unreachable!("matched above")
                    };
                    let sessions =
                        open_sessions(runtime, repo, options, &Provider::Cpu, &activity)?;
                    (Provider::Cpu, sessions, Some(reason))
                }
                Err(err) => return Err(err),
            };
        Ok(OrtBackend {
            specs: sessions.iter().map(|s| s.spec.clone()).collect(),
            sessions,
            options: options.clone(),
            provider,
            fallback_reason,
            activity,
            decode_threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            #[cfg(feature = "stand-in")]
            stand_in: None,
        })
    }

    /// The provider sessions actually run on: the configured one, or the CPU
    /// after a fallback.
    pub fn provider(&self) -> &Provider {
        &self.provider
    }

    /// Why the configured provider was replaced by the CPU, if it was.
    pub fn fallback_reason(&self) -> Option<&str> {
        self.fallback_reason.as_deref()
    }

    /// Rows a batch of `n` frames of `model` runs as: `n`, or with padding
    /// the next of its [`batch_buckets`] (`None` for a model not served).
    pub fn run_size(&self, model: &str, n: usize) -> Option<usize> {
        let i = self.session_index(model).ok()?;
        Some(self.sessions[i].run_size(n))
    }

    /// The latency profile to register for `model` from `measured`, its
    /// profile at its [`batch_buckets`]: as measured, or with padding a
    /// step curve, each bucket's time from the size after the bucket below
    /// up to the bucket itself (two points a bucket, which the gateway joins
    /// with a flat line), so that its estimate of a batch of 5 is the batch
    /// of 8 it costs rather than a value between 4 and 8. That is 16 points
    /// at a `max_batch` of 256: the gateway takes at most `max_list` (1024)
    /// points from a worker, over all its models.
    pub fn registered_profile(&self, model: &str, measured: &[(u16, u32)]) -> Vec<(u16, u32)> {
        let Ok(i) = self.session_index(model) else {
            return measured.to_vec();
        };
        let ms = &self.sessions[i];
        if ms.buckets.is_empty() {
            return measured.to_vec();
        }
        step_profile(&ms.buckets, measured)
    }

    /// Tests only: holds this backend's runs as `stand_in` says (see
    /// [`crate::stand_in`]).
    #[cfg(feature = "stand-in")]
    pub fn set_stand_in(&mut self, stand_in: crate::stand_in::StandIn) {
        self.stand_in = Some(stand_in);
    }

    /// With `provider = "tensorrt"`: `Ok` when TensorRT serves `model`, or
    /// why the CUDA provider serves it alone. `None` for another provider
    /// or a model not served.
    pub fn tensorrt(&self, model: &str) -> Option<Result<(), &str>> {
        let i = self.session_index(model).ok()?;
        self.sessions[i]
            .tensorrt
            .as_ref()
            .map(|r| r.as_ref().copied().map_err(String::as_str))
    }

    /// Rows of `model`'s last ONNX Runtime run, padding included (0 before
    /// its first; `None` for a model not served).
    pub fn last_run_size(&self, model: &str) -> Option<usize> {
        let i = self.session_index(model).ok()?;
        Some(self.sessions[i].last_run)
    }

    /// Where `model`'s frames are preprocessed (`None` for a model not
    /// served).
    pub fn preprocessing(&self, model: &str) -> Option<&Preprocessing> {
        self.sessions
            .iter()
            .find(|s| s.spec.name == model)
            .map(|s| &s.preprocessing)
    }

    /// Whether `model`'s frames are preprocessed on the GPU (u8 upload,
    /// NVRTC kernel, input read in place). False on the CPU, and on CUDA where GPU
    /// preprocessing is off or could not start ([`OrtBackend::preprocessing`]
    /// says why).
    pub fn gpu_preprocessing(&self, model: &str) -> bool {
        self.preprocessing(model) == Some(&Preprocessing::Gpu)
    }

    /// The device as registered with the gateway: `cpu (N threads)` or
    /// `cuda:N`.
    pub fn device(&self) -> String {
        match &self.provider {
            Provider::Cpu => {
                let threads = match self.options.intra_threads {
                    0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
                    n => n,
                };
                format!("cpu ({threads} threads)")
            }
            Provider::Cuda(c) => format!("cuda:{}", c.device_id),
        }
    }

    fn session_index(&self, model: &str) -> Result<usize, BackendError> {
        self.sessions
            .iter()
            .position(|s| s.spec.name == model)
            .ok_or_else(|| BackendError::UnknownModel {
                model: model.to_string(),
                served: self.specs.iter().map(|s| s.name.clone()).collect(),
            })
    }
}

/// Opens every model of `repo` on `provider`, recording the warm-up runs in
/// `activity`. A CUDA provider that cannot serve them is
/// [`BackendError::ProviderUnavailable`].
fn open_sessions(
    runtime: &Runtime,
    repo: &Repository,
    options: &RuntimeOptions,
    provider: &Provider,
    activity: &Activity,
) -> Result<Vec<ModelSession>, BackendError> {
    if let Provider::Cuda(cuda) = provider {
        check_cuda(runtime, provider, cuda)?;
    }
    repo.models()
        .iter()
        .map(|model| open_model(runtime, model, options, provider, activity))
        .collect()
}

/// Whether the ONNX Runtime library loaded in this process was built with
/// the CUDA execution provider (the onnxruntime-gpu wheel's is, the CPU
/// wheel's is not). Asks the library only: no driver or GPU is needed.
pub fn cuda_provider_built() -> Result<bool, String> {
    CUDA::is_available().map_err(|e| one_line(&e.to_string()))
}

/// Whether the CUDA provider can be used at all: ONNX Runtime was built with
/// it, and (with the `cuda` feature, which can ask the driver) the device
/// exists.
fn check_cuda(
    runtime: &Runtime,
    provider: &Provider,
    cuda: &CudaOptions,
) -> Result<(), BackendError> {
    let unavailable = |reason: String| BackendError::ProviderUnavailable {
        provider: provider.to_string(),
        reason,
    };
    match CUDA::is_available() {
        Ok(true) => {}
        Ok(false) => {
            return Err(unavailable(format!(
                "the ONNX Runtime library {} was built without the CUDA execution provider (it is a CPU build); point runtime.library at the libonnxruntime.so of the onnxruntime-gpu wheel",
                runtime.path().display()
            )));
        }
        Err(e) => {
            return Err(unavailable(format!(
                "cannot list ONNX Runtime's providers: {}",
                one_line(&e.to_string())
            )));
        }
    }
    #[cfg(feature = "cuda")]
    crate::gpu::device(cuda.device_id as usize).map_err(|e| unavailable(e.to_string()))?;
    #[cfg(not(feature = "cuda"))]
    let _ = cuda;
    Ok(())
}

/// Opens one model on `provider`. On CUDA, a session that cannot be opened
/// or warmed up is tried on the CPU too, to tell whose fault it is: if the
/// CPU serves it, CUDA is unavailable (a bad device, a driver too old, out
/// of memory) and the error says so with ONNX Runtime's words; if not, the
/// CPU's error about the model is returned.
fn open_model(
    runtime: &Runtime,
    model: &Model,
    options: &RuntimeOptions,
    provider: &Provider,
    activity: &Activity,
) -> Result<ModelSession, BackendError> {
    match open_model_on(runtime, model, options, provider, activity) {
        Err(e @ (BackendError::Session { .. } | BackendError::WarmUp { .. }))
            if *provider != Provider::Cpu =>
        {
            tracing::debug!(model = %model.spec.name, "failed on {provider}: {e}; trying the CPU to tell whose fault it is");
            let on_cpu = open_model_on(runtime, model, options, &Provider::Cpu, activity).map(drop);
            Err(attribute_failure(provider, e, on_cpu))
        }
        other => other,
    }
}

/// The error for a model that failed on `provider` with `err`, given how
/// it fared on the CPU: `provider` unavailable when the CPU serves it,
/// otherwise the CPU's own error (the model is at fault).
fn attribute_failure(
    provider: &Provider,
    err: BackendError,
    on_cpu: Result<(), BackendError>,
) -> BackendError {
    if let Err(cpu_err) = on_cpu {
        return cpu_err;
    }
    let reason = match err {
        BackendError::Session { model, message, .. } => format!(
            "ONNX Runtime could not open model '{model}' on it (it opens on the CPU): {}",
            one_line(&message)
        ),
        BackendError::WarmUp {
            model,
            batch,
            reason,
        } => format!(
            "model '{model}' failed its warm-up at batch {batch} on it (it runs on the CPU): {}",
            one_line(&reason)
        ),
        other => one_line(&other.to_string()),
    };
    BackendError::ProviderUnavailable {
        provider: provider.to_string(),
        reason,
    }
}

/// Opens, checks and warms up one model's session on `provider`, recording
/// each warm-up run in `activity`.
fn open_model_on(
    runtime: &Runtime,
    model: &Model,
    options: &RuntimeOptions,
    provider: &Provider,
    activity: &Activity,
) -> Result<ModelSession, BackendError> {
    let session_error = |e: &dyn std::fmt::Display| BackendError::Session {
        model: model.spec.name.clone(),
        path: model.path.clone(),
        message: one_line(&e.to_string()),
    };
    let mut builder = Session::builder(runtime.environment()).map_err(|e| session_error(&e))?;
    if options.intra_threads > 0 {
        builder = builder
            .with_intra_threads(options.intra_threads)
            .map_err(|e| session_error(&e))?;
    }
    let mut tensorrt = None;
    if let Provider::Cuda(cuda) = provider {
        // TensorRT first, where asked: ONNX Runtime gives it what it can
        // run, and the CUDA provider the rest.
        if let Some(trt) = &cuda.tensorrt {
            let on = register_tensorrt(&mut builder, cuda.device_id, trt, model);
            if let Err(reason) = &on {
                tracing::warn!(model = %model.spec.name, "TensorRT unavailable: {reason}; serving on the CUDA provider");
            }
            tensorrt = Some(on);
        }
        cuda_provider(cuda).register(&mut builder).map_err(|e| {
            BackendError::ProviderUnavailable {
                provider: provider.to_string(),
                reason: format!(
                    "ONNX Runtime could not start it: {}",
                    one_line(&e.to_string())
                ),
            }
        })?;
    }
    let session = builder
        .commit_from_file(&model.path)
        .map_err(|e| session_error(&e))?;
    // The batch cap of the provider the session runs on.
    let spec = match provider {
        Provider::Cpu => model.spec.on_cpu(),
        Provider::Cuda(_) => model.spec.clone(),
    };
    let decoder = Decoder::new(&spec)?;
    check_session(&spec, session.inputs(), session.outputs())?;
    #[cfg(feature = "cuda")]
    let (gpu, preprocessing) = match provider {
        Provider::Cpu => (None, Preprocessing::Cpu),
        Provider::Cuda(cuda) if cuda.cpu_preprocess => (
            None,
            Preprocessing::CpuForCuda("runtime.cuda.cpu_preprocess is set".into()),
        ),
        Provider::Cuda(_) if spec.input.model_dtype != DType::F32 => (
            None,
            Preprocessing::CpuForCuda("the model takes u8 frames as they are".into()),
        ),
        Provider::Cuda(cuda) => match GpuInput::new(&spec, cuda.device_id) {
            Ok(g) => (Some(g), Preprocessing::Gpu),
            Err(reason) => {
                tracing::warn!(model = %spec.name, %reason, "GPU preprocessing unavailable; preprocessing on the CPU");
                (
                    None,
                    Preprocessing::CpuForCuda(format!(
                        "GPU preprocessing could not start: {reason}"
                    )),
                )
            }
        },
    };
    #[cfg(not(feature = "cuda"))]
    let preprocessing = match provider {
        Provider::Cpu => Preprocessing::Cpu,
        Provider::Cuda(_) => {
            Preprocessing::CpuForCuda("the worker was built without the `cuda` feature".into())
        }
    };
    // The GPU path uploads the frames themselves; only the CPU path needs a
    // host buffer for the model input.
    let capacity = if preprocessing == Preprocessing::Gpu {
        0
    } else {
        spec.input.frame_len() * spec.max_batch as usize
    };
    let input = match spec.input.model_dtype {
        DType::F32 => InputBuffer::F32(vec![0.0; capacity]),
        DType::U8 => InputBuffer::U8(vec![0; capacity]),
    };
    let pad = options
        .pad_batches
        .unwrap_or(matches!(provider, Provider::Cuda(_)));
    let buckets = if pad {
        batch_buckets(spec.max_batch)
            .into_iter()
            .map(usize::from)
            .collect()
    } else {
        Vec::new()
    };
    let mut ms = ModelSession {
        preprocessor: Preprocessor::new(&spec.input),
        spec,
        session,
        decoder,
        input,
        preprocessing,
        buckets,
        last_run: 0,
        tensorrt,
        #[cfg(feature = "cuda")]
        gpu,
    };
    let spec = ms.spec.clone();
    let mut sizes = vec![1usize];
    if spec.max_batch > 1 {
        sizes.push(spec.max_batch as usize);
    }
    for size in sizes {
        let frames = grey_frames(&spec, size);
        let which: Vec<usize> = (0..size).collect();
        for _ in 0..options.warmup_runs.max(1) {
            let mut outcomes = vec![FrameOutcome::failed(UNPROCESSED); size];
            // The model's first runs on the device: the watchdog ends the
            // process should one never return.
            let run = activity.record(Phase::WarmUp, &spec.name, size);
            ms.run_batch(&frames, &which, &mut outcomes);
            drop(run);
            if let Some(Status::Failed(reason)) = outcomes
                .into_iter()
                .map(|o| o.status)
                .find(|s| *s != Status::Ok)
            {
                return Err(BackendError::WarmUp {
                    model: spec.name.clone(),
                    batch: size,
                    reason,
                });
            }
        }
    }
    tracing::info!(model = %spec.name, path = %model.path.display(), %provider, preprocessing = %ms.preprocessing, "session ready");
    Ok(ms)
}

impl Backend for OrtBackend {
    fn models(&self) -> &[ModelSpec] {
        &self.specs
    }

    fn run(&mut self, model: &str, frames: &[FrameInput]) -> Vec<FrameOutcome> {
        let index = match self.session_index(model) {
            Ok(i) => i,
            Err(e) => return vec![FrameOutcome::failed(e.to_string()); frames.len()],
        };
        let decode_threads = self.decode_threads;
        let ms = &mut self.sessions[index];
        let mut outcomes = vec![FrameOutcome::failed(UNPROCESSED); frames.len()];
        let mut valid = Vec::with_capacity(frames.len());
        for (i, frame) in frames.iter().enumerate() {
            match check_frame(&ms.spec, &frame.tensor) {
                Ok(()) => valid.push(i),
                Err(reason) => {
                    tracing::debug!(model, frame = i, %reason, "frame rejected");
                    outcomes[i] = FrameOutcome::failed(reason);
                }
            }
        }
        // Encoded frames become raw here, before preprocessing, on this
        // thread (and helpers, for a batch): the batch then runs on a copy
        // of `frames` with the decoded tensors in their place (the other
        // frames' bytes shared, not copied).
        let encoded: Vec<usize> = valid
            .iter()
            .copied()
            .filter(|&i| frames[i].tensor.encoding != Encoding::Raw)
            .collect();
        let mut decode_us = vec![0u32; frames.len()];
        let mut decoded = None;
        if !encoded.is_empty() {
            let files: Vec<&Tensor> = encoded.iter().map(|&i| &frames[i].tensor).collect();
            let batch = decoded.insert(frames.to_vec());
            let results = codec::decode_frames(&ms.spec.name, &files, decode_threads);
            for (&i, (result, took)) in encoded.iter().zip(results) {
                // At least 1: 0 says the frame was raw.
                decode_us[i] = micros(took).max(1);
                match result {
                    Ok(tensor) => batch[i].tensor = tensor,
                    Err(e) => {
                        let reason = e.to_string();
                        tracing::debug!(model, frame = i, %reason, "frame rejected");
                        outcomes[i] = FrameOutcome::failed(reason);
                        outcomes[i].timings.decode_us = decode_us[i];
                        valid.retain(|&v| v != i);
                    }
                }
            }
        }
        let batch = decoded.as_deref().unwrap_or(frames);
        for chunk in valid.chunks(ms.spec.max_batch as usize) {
            ms.run_batch(batch, chunk, &mut outcomes);
            #[cfg(feature = "stand-in")]
            if let Some(stand_in) = self.stand_in.as_mut() {
                hold_as_a_gpu(stand_in, model, ms.last_run, chunk, &mut outcomes);
            }
        }
        for &i in &valid {
            outcomes[i].timings.decode_us = decode_us[i];
        }
        outcomes
    }

    fn profile(
        &mut self,
        model: &str,
        batch_sizes: &[u16],
    ) -> Result<Vec<(u16, u32)>, BackendError> {
        let index = self.session_index(model)?;
        let max_batch = self.sessions[index].spec.max_batch;
        let (warmup, runs) = (self.options.warmup_runs, self.options.profile_runs.max(1));
        let activity = self.activity.clone();
        let mut points = Vec::new();
        for &batch in batch_sizes {
            if batch == 0 || batch > max_batch {
                tracing::debug!(model, batch, max_batch, "batch size not profiled");
                continue;
            }
            let frames = grey_frames(&self.sessions[index].spec, batch as usize);
            let mut samples = Vec::with_capacity(runs as usize);
            for round in 0..warmup + runs {
                let run = activity.record(Phase::Profiling, model, batch as usize);
                let start = Instant::now();
                let outcomes = self.run(model, &frames);
                #[cfg(feature = "stand-in")]
                self.hold_profiling_run();
                let elapsed = micros(start.elapsed());
                drop(run);
                if let Some(Status::Failed(reason)) = outcomes
                    .into_iter()
                    .map(|o| o.status)
                    .find(|s| *s != Status::Ok)
                {
                    return Err(BackendError::Profile {
                        model: model.to_string(),
                        batch,
                        reason,
                    });
                }
                if round >= warmup {
                    samples.push(elapsed);
                }
            }
            samples.sort_unstable();
            points.push((batch, samples[samples.len() / 2]));
        }
        Ok(points)
    }
}

#[cfg(feature = "stand-in")]
impl OrtBackend {
    /// Tests only: holds a start-up profiling run as the stand-in's
    /// `busy_profile_ms` says (a host busy while the worker profiled).
    fn hold_profiling_run(&self) {
        let ms = self
            .stand_in
            .as_ref()
            .map_or(0, |s| s.settings().busy_profile_ms);
        if ms > 0 {
            std::thread::sleep(std::time::Duration::from_millis(ms));
        }
    }
}

/// Tests only: holds the run of `rows` rows that served `chunk` as the
/// stand-in says a GPU would, and adds the hold to those frames'
/// `inference_us`.
#[cfg(feature = "stand-in")]
fn hold_as_a_gpu(
    stand_in: &mut crate::stand_in::StandIn,
    model: &str,
    rows: usize,
    chunk: &[usize],
    outcomes: &mut [FrameOutcome],
) {
    let Some((held, why)) = stand_in.hold(model, rows) else {
        return;
    };
    tracing::info!(
        model,
        rows,
        held_ms = held.as_millis() as u64,
        ?why,
        cold_runs = stand_in.cold_runs,
        slow_runs = stand_in.slow_runs,
        "stand-in: run held"
    );
    std::thread::sleep(held);
    for &i in chunk {
        let t = &mut outcomes[i].timings;
        t.inference_us = t.inference_us.saturating_add(micros(held));
    }
}

/// Puts ONNX Runtime's TensorRT provider first on `builder` for `model`:
/// one optimisation profile from batch 1 to the model's `max_batch` (so
/// that no batch size builds an engine of its own), FP16 kernels if asked,
/// and the engine and timing caches in a folder of their own per model
/// file under `engine_cache_dir`. `Err` says in one line why it cannot
/// (TensorRT's libraries missing, a folder that cannot be made), and the
/// CUDA provider then serves alone.
fn register_tensorrt(
    builder: &mut ort::session::builder::SessionBuilder,
    device_id: u32,
    o: &crate::runtime::TensorRtOptions,
    model: &Model,
) -> Result<(), String> {
    let spec = &model.spec;
    let shape = |batch: u16| {
        let d = spec.input.model_shape(u32::from(batch));
        format!("{}:{}x{}x{}x{}", spec.input.name, d[0], d[1], d[2], d[3])
    };
    let mut ep = ort::ep::TensorRT::default()
        .with_device_id(i32::try_from(device_id).unwrap_or(i32::MAX))
        .with_fp16(o.fp16)
        .with_profile_min_shapes(shape(1))
        .with_profile_opt_shapes(shape(spec.max_batch))
        .with_profile_max_shapes(shape(spec.max_batch));
    if let Some(bytes) = o.max_workspace_bytes {
        ep = ep.with_max_workspace_size(usize::try_from(bytes).unwrap_or(usize::MAX));
    }
    if let Some(root) = &o.engine_cache_dir {
        let file = model
            .path
            .file_stem()
            .map_or_else(|| "model".into(), |s| s.to_string_lossy());
        let dir = root.join(format!("{}-v{}-{file}", spec.name, spec.version));
        std::fs::create_dir_all(&dir).map_err(|e| {
            format!(
                "cannot make its engine cache {}: {e} (runtime.tensorrt.engine_cache_dir)",
                dir.display()
            )
        })?;
        let dir = dir.display().to_string();
        ep = ep
            .with_engine_cache(true)
            .with_engine_cache_path(&dir)
            .with_timing_cache(true)
            .with_timing_cache_path(&dir);
    }
    ep.register(builder).map_err(|e| {
        format!(
            "ONNX Runtime could not start it: {}",
            one_line(&e.to_string())
        )
    })
}

/// The CUDA execution provider with the configured settings (public so that
/// the bench builds its raw ONNX Runtime session on the same one).
pub fn cuda_provider(o: &CudaOptions) -> CUDA {
    let device_id = i32::try_from(o.device_id).unwrap_or(i32::MAX);
    let mut ep = CUDA::default()
        .with_device_id(device_id)
        .with_conv_algorithm_search(match o.conv_algo_search {
            ConvAlgoSearch::Exhaustive => ConvAlgorithmSearch::Exhaustive,
            ConvAlgoSearch::Heuristic => ConvAlgorithmSearch::Heuristic,
            ConvAlgoSearch::Default => ConvAlgorithmSearch::Default,
        });
    if let Some(limit) = o.arena_limit_bytes {
        ep = ep.with_memory_limit(usize::try_from(limit).unwrap_or(usize::MAX));
    }
    ep
}

/// The graph's element type that a model.toml dtype means.
fn element_type(dtype: DType) -> TensorElementType {
    match dtype {
        DType::F32 => TensorElementType::Float32,
        DType::U8 => TensorElementType::Uint8,
    }
}

/// Checks a session's inputs and outputs against the spec. Dimensions the
/// graph leaves dynamic (-1) match anything; so does -1 in model.toml.
fn check_session(
    spec: &ModelSpec,
    inputs: &[Outlet],
    outputs: &[Outlet],
) -> Result<(), BackendError> {
    let mismatch = |field: String, expected: String, actual: String| BackendError::Mismatch {
        model: spec.name.clone(),
        field,
        expected,
        actual,
    };
    let names = |outlets: &[Outlet]| {
        let n: Vec<&str> = outlets.iter().map(Outlet::name).collect();
        format!("{n:?}")
    };
    let input = inputs
        .iter()
        .find(|i| i.name() == spec.input.name)
        .ok_or_else(|| {
            mismatch(
                "input.name".into(),
                format!("{:?}", spec.input.name),
                format!("inputs {}", names(inputs)),
            )
        })?;
    if inputs.len() != 1 {
        return Err(mismatch(
            "input.name".into(),
            format!("{:?} as the only input", spec.input.name),
            format!("inputs {}", names(inputs)),
        ));
    }
    let want_type = element_type(spec.input.model_dtype);
    if input.dtype().tensor_type() != Some(want_type) {
        return Err(mismatch(
            "input.model_dtype".into(),
            spec.input.model_dtype.to_string(),
            input
                .dtype()
                .tensor_type()
                .map_or_else(|| input.dtype().to_string(), |t| t.to_string()),
        ));
    }
    let want: Vec<i64> = spec
        .input
        .model_shape(1)
        .iter()
        .map(|&d| i64::from(d))
        .collect();
    let actual: Vec<i64> = input
        .dtype()
        .tensor_shape()
        .map(|s| s.to_vec())
        .unwrap_or_default();
    let dims_match = actual.len() == 4
        && want[1..]
            .iter()
            .zip(&actual[1..])
            .all(|(&w, &a)| a == -1 || w == a);
    if !dims_match {
        return Err(mismatch(
            "input (layout, width, height, channels)".into(),
            format!("{} [batch{}]", spec.input.layout, {
                let rest: Vec<String> = want[1..].iter().map(i64::to_string).collect();
                format!(",{}", rest.join(","))
            }),
            format!("{}", DimsDisplay(&actual)),
        ));
    }
    match (actual[0], spec.max_batch) {
        (-1, _) | (1, 1) => {}
        (b, m) => {
            return Err(mismatch(
                "max_batch".into(),
                format!("{m}"),
                if b == 1 {
                    "a batch dimension fixed at 1".into()
                } else {
                    format!("a batch dimension fixed at {b} (only 1 or dynamic is supported)")
                },
            ));
        }
    }
    for (i, out) in spec.outputs.iter().enumerate() {
        let Some(actual) = outputs.iter().find(|o| o.name() == out.name) else {
            return Err(mismatch(
                format!("outputs[{i}].name"),
                format!("{:?}", out.name),
                format!("outputs {}", names(outputs)),
            ));
        };
        if actual.dtype().tensor_type() != Some(TensorElementType::Float32) {
            return Err(mismatch(
                format!("outputs[{i}] ({:?}) element type", out.name),
                "f32 (the decoder reads f32)".into(),
                actual
                    .dtype()
                    .tensor_type()
                    .map_or_else(|| actual.dtype().to_string(), |t| t.to_string()),
            ));
        }
        let shape: Vec<i64> = actual
            .dtype()
            .tensor_shape()
            .map(|s| s.to_vec())
            .unwrap_or_default();
        let fits = shape.len() == out.shape.len()
            && shape
                .iter()
                .zip(&out.shape)
                .all(|(&a, &w)| a == -1 || w == -1 || a == w);
        if !fits {
            return Err(mismatch(
                format!("outputs[{i}].shape ({:?})", out.name),
                format!("{}", DimsDisplay(&out.shape)),
                format!("{}", DimsDisplay(&shape)),
            ));
        }
    }
    Ok(())
}

/// Why a backend could not be opened or profiled.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BackendError {
    /// ONNX Runtime itself could not be loaded.
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    /// ONNX Runtime could not open the model file.
    #[error(
        "model '{model}': ONNX Runtime cannot open {}: {message}; check that the file is a valid ONNX model (re-run `make setup` to fetch it again)",
        path.display()
    )]
    Session {
        /// The model's name.
        model: String,
        /// The model file.
        path: std::path::PathBuf,
        /// ONNX Runtime's account.
        message: String,
    },
    /// model.toml and the ONNX graph disagree.
    #[error(
        "model '{model}': {field} in model.toml is {expected}, but the ONNX file has {actual}; fix model.toml so they agree"
    )]
    Mismatch {
        /// The model's name.
        model: String,
        /// The model.toml field.
        field: String,
        /// What model.toml says.
        expected: String,
        /// What the graph has.
        actual: String,
    },
    /// The configured execution provider cannot be used and no fallback is
    /// allowed.
    #[error(
        "execution provider {provider} is unavailable: {reason}; fix that, or set runtime.fallback = \"cpu\" to serve on the CPU"
    )]
    ProviderUnavailable {
        /// The provider asked for, e.g. `cuda:0`.
        provider: String,
        /// Why it cannot be used.
        reason: String,
    },
    /// The decoder could not be built from the spec.
    #[error(transparent)]
    Decoder(#[from] DecoderError),
    /// The warm-up run failed.
    #[error("model '{model}': warm-up with a batch of {batch} failed: {reason}")]
    WarmUp {
        /// The model's name.
        model: String,
        /// The batch size tried.
        batch: usize,
        /// Why the run failed.
        reason: String,
    },
    /// A model was asked for that this backend does not serve.
    #[error("model '{model}' is not served by this worker (it serves: {}); add it to the worker's models", served.join(", "))]
    UnknownModel {
        /// The requested model.
        model: String,
        /// The models served.
        served: Vec<String>,
    },
    /// A profiling run failed.
    #[error("model '{model}': profiling a batch of {batch} failed: {reason}")]
    Profile {
        /// The model's name.
        model: String,
        /// The batch size.
        batch: u16,
        /// Why the run failed.
        reason: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ModelSpec;

    fn blazeface() -> ModelSpec {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/blazeface/model.toml");
        ModelSpec::from_toml(&std::fs::read_to_string(&path).unwrap(), &path).unwrap()
    }

    fn tensor(dtype: DType, layout: Layout, shape: &[u32], len: usize) -> Tensor {
        Tensor::raw(dtype, layout, shape.to_vec(), Bytes::from(vec![0u8; len]))
    }

    #[test]
    fn batch_buckets_are_powers_of_two_and_the_cap() {
        assert_eq!(batch_buckets(32), vec![1, 2, 4, 8, 16, 32]);
        assert_eq!(batch_buckets(12), vec![1, 2, 4, 8, 12]);
        assert_eq!(batch_buckets(4), vec![1, 2, 4]);
        assert_eq!(batch_buckets(1), vec![1]);
        assert_eq!(batch_buckets(0), vec![1]);
        let all = batch_buckets(u16::MAX);
        assert_eq!(all.len(), 17);
        assert_eq!(all[15..], [32_768, u16::MAX]);
    }

    #[test]
    fn a_padded_profile_is_a_step_curve_of_two_points_a_bucket() {
        let buckets: Vec<usize> = batch_buckets(32).into_iter().map(usize::from).collect();
        let measured: Vec<(u16, u32)> = batch_buckets(32)
            .into_iter()
            .map(|b| (b, 1_000 + u32::from(b)))
            .collect();
        assert_eq!(
            step_profile(&buckets, &measured),
            vec![
                (1, 1_001),
                (2, 1_002),
                (3, 1_004),
                (4, 1_004),
                (5, 1_008),
                (8, 1_008),
                (9, 1_016),
                (16, 1_016),
                (17, 1_032),
                (32, 1_032),
            ]
        );
        // However large the cap, a handful of points (the gateway reads at
        // most 1024 from a worker, over all its models).
        let buckets: Vec<usize> = batch_buckets(256).into_iter().map(usize::from).collect();
        let measured: Vec<(u16, u32)> = batch_buckets(256).into_iter().map(|b| (b, 5)).collect();
        let points = step_profile(&buckets, &measured);
        assert_eq!(points.len(), 16);
        assert_eq!(points.last(), Some(&(256, 5)));
        // A bucket that was not measured is left out, not guessed.
        assert_eq!(
            step_profile(&[1, 2, 4], &[(1, 10), (4, 40)]),
            vec![(1, 10), (2, 40), (4, 40)]
        );
    }

    #[test]
    fn wrong_shape_names_both_shapes() {
        let t = tensor(DType::U8, Layout::Nhwc, &[1, 64, 64, 3], 64 * 64 * 3);
        assert_eq!(
            check_frame(&blazeface(), &t).unwrap_err(),
            "model 'blazeface' expects u8 [1,128,128,3], frame has [1,64,64,3]"
        );
    }

    #[test]
    fn f32_frame_names_its_type() {
        let t = tensor(DType::F32, Layout::Nhwc, &[1, 128, 128, 3], 128 * 128 * 12);
        assert_eq!(
            check_frame(&blazeface(), &t).unwrap_err(),
            "model 'blazeface' expects u8 [1,128,128,3], frame has f32 [1,128,128,3]"
        );
    }

    #[test]
    fn empty_batch_is_rejected_naming_its_shape() {
        let t = tensor(DType::U8, Layout::Nhwc, &[0, 128, 128, 3], 0);
        assert_eq!(
            check_frame(&blazeface(), &t).unwrap_err(),
            "model 'blazeface' expects u8 [1,128,128,3], frame has [0,128,128,3]"
        );
    }

    #[test]
    fn planar_frame_is_checked_against_the_planar_shape() {
        let len = 128 * 128 * 3;
        assert!(
            check_frame(
                &blazeface(),
                &tensor(DType::U8, Layout::Nchw, &[1, 3, 128, 128], len)
            )
            .is_ok()
        );
        let err = check_frame(
            &blazeface(),
            &tensor(DType::U8, Layout::Nchw, &[1, 128, 128, 3], len),
        )
        .unwrap_err();
        assert_eq!(
            err,
            "model 'blazeface' expects u8 [1,3,128,128] (nchw), frame has [1,128,128,3]"
        );
    }

    #[test]
    fn payload_shorter_than_shape_is_rejected() {
        let t = tensor(DType::U8, Layout::Nhwc, &[1, 128, 128, 3], 10);
        let err = check_frame(&blazeface(), &t).unwrap_err();
        assert!(
            err.contains("49152 bytes") && err.contains("has 10"),
            "{err}"
        );
    }

    fn cuda0() -> Provider {
        Provider::Cuda(CudaOptions::default())
    }

    #[test]
    fn model_failing_on_cuda_but_not_on_the_cpu_blames_the_provider_in_ort_words() {
        let err = BackendError::Session {
            model: "m".into(),
            path: "/models/m/model.onnx".into(),
            message: "CUDA failure 100: no CUDA-capable device\n  is detected".into(),
        };
        let out = attribute_failure(&cuda0(), err, Ok(()));
        assert!(
            matches!(out, BackendError::ProviderUnavailable { .. }),
            "{out:?}"
        );
        let text = out.to_string();
        assert!(
            text.starts_with(
                "execution provider cuda:0 is unavailable: ONNX Runtime could not open model 'm' on it (it opens on the CPU): CUDA failure 100: no CUDA-capable device is detected"
            ),
            "{text}"
        );
        assert!(
            !text.contains("valid ONNX model") && !text.contains('\n'),
            "{text}"
        );
        assert!(text.contains("runtime.fallback = \"cpu\""), "{text}");

        let err = BackendError::WarmUp {
            model: "m".into(),
            batch: 32,
            reason: "model 'm': ONNX Runtime run failed: CUDA out of memory".into(),
        };
        let text = attribute_failure(&cuda0(), err, Ok(())).to_string();
        assert!(
            text.contains("model 'm' failed its warm-up at batch 32 on it (it runs on the CPU)")
                && text.contains("CUDA out of memory"),
            "{text}"
        );
    }

    #[test]
    fn model_failing_on_cuda_and_on_the_cpu_is_the_model_s_fault() {
        let on_cuda = BackendError::Session {
            model: "m".into(),
            path: "/models/m/model.onnx".into(),
            message: "CUDA: protobuf parsing failed".into(),
        };
        let on_cpu = BackendError::Session {
            model: "m".into(),
            path: "/models/m/model.onnx".into(),
            message: "protobuf parsing failed".into(),
        };
        let out = attribute_failure(&cuda0(), on_cuda, Err(on_cpu));
        assert!(matches!(out, BackendError::Session { .. }), "{out:?}");
        let text = out.to_string();
        assert!(
            text.contains("protobuf parsing failed")
                && !text.contains("CUDA")
                && text.contains("valid ONNX model"),
            "{text}"
        );
    }

    #[test]
    fn preprocessing_names_where_and_why() {
        assert_eq!(Preprocessing::Cpu.to_string(), "cpu");
        assert_eq!(
            Preprocessing::CpuForCuda("runtime.cuda.cpu_preprocess is set".into()).to_string(),
            "cpu (runtime.cuda.cpu_preprocess is set)"
        );
        assert!(Preprocessing::Gpu.to_string().starts_with("gpu"));
    }

    #[test]
    fn matching_frame_is_accepted() {
        let t = tensor(DType::U8, Layout::Nhwc, &[1, 128, 128, 3], 128 * 128 * 3);
        assert!(check_frame(&blazeface(), &t).is_ok());
    }
}
