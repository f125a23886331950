//! The floor of what serving costs: the simplest KServe v2 server around
//! the worker's ONNX Runtime, model repository and preprocessing
//! (`tidegate-baseline`).
//!
//! A request's frame is decoded ([`super::codec`]), preprocessed exactly as
//! the worker does (`tidegate_worker::preprocess`: u8 NHWC RGB to the
//! model's input, with its normalisation), and run alone, never batched, on
//! one of N sessions, each on a thread of its own behind one bounded queue
//! ([`Engine`]). The raw output tensors go back in the binary extension.
//! A full queue is answered 503 at once; nothing waits without bound.

use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::{DefaultBodyLimit, Path as UrlPath, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use ort::session::{Session, SessionInputValue};
use ort::value::{TensorElementType, TensorRef};
use tidegate_protocol::{DType, Layout};
use tidegate_worker::model::{ModelSpec, Repository, RepositoryError};
use tidegate_worker::preprocess::Preprocessor;
use tidegate_worker::runtime::{Runtime, RuntimeError};
use tokio::sync::oneshot;

use super::codec::{
    self, CodecLimits, DataType, HEADER_LENGTH, InferRequest, InferResponse, ModelMetadata,
    ServerMetadata, Tensor, TensorMetadata,
};

/// The name the server gives at `GET /v2`.
pub const SERVER_NAME: &str = "tidegate-baseline";

/// The largest request body read (a 2048×2048 RGB u8 frame is 12 MiB).
pub const MAX_REQUEST_BYTES: usize = 16 * 1024 * 1024;

/// What to serve, and on how many sessions.
#[derive(Debug, Clone)]
pub struct BaselineOptions {
    /// The model's folder (`models/blazeface`: its model.toml and .onnx).
    pub model_dir: PathBuf,
    /// Sessions, each on its own thread, each running one frame at a time.
    pub sessions: usize,
    /// ONNX Runtime intra-op threads per session.
    pub threads: usize,
    /// Requests waiting for a session at most; more are answered 503.
    pub queue: usize,
}

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BaselineError {
    /// The options ask for no session, thread or queue.
    #[error("{0}")]
    Options(String),
    /// The model folder does not hold a model.
    #[error("loading the model from {dir}: {source}")]
    Model {
        /// The folder.
        dir: PathBuf,
        /// Why.
        source: Box<RepositoryError>,
    },
    /// ONNX Runtime would not load.
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    /// A session would not open, or its graph does not match model.toml.
    #[error("model '{model}': {message}")]
    Session {
        /// The model.
        model: String,
        /// What ONNX Runtime or the check said.
        message: String,
    },
    /// A session thread would not start.
    #[error("starting session thread {index}: {source}")]
    Thread {
        /// Which.
        index: usize,
        /// Why.
        source: std::io::Error,
    },
}

/// One frame to run, and where its outputs go.
struct Job {
    pixels: Bytes,
    /// Indices into the model's outputs, in the order asked for.
    outputs: Vec<usize>,
    reply: oneshot::Sender<Result<Vec<Tensor>, String>>,
}

/// One session and its input buffer, owned by its thread.
struct Runner {
    spec: Arc<ModelSpec>,
    session: Session,
    preprocessor: Preprocessor,
    input: InputBuffer,
}

/// The model input of one frame.
enum InputBuffer {
    F32(Vec<f32>),
    U8(Vec<u8>),
}

impl Runner {
    /// Runs one u8 NHWC RGB frame and returns outputs `which`.
    fn run(&mut self, pixels: &[u8], which: &[usize]) -> Result<Vec<Tensor>, String> {
        let Runner {
            spec,
            session,
            preprocessor,
            input,
        } = self;
        let shape: Vec<i64> = spec
            .input
            .model_shape(1)
            .iter()
            .map(|&d| i64::from(d))
            .collect();
        let value: SessionInputValue<'_> = match input {
            InputBuffer::F32(buf) => {
                preprocessor
                    .to_f32(pixels, Layout::Nhwc, buf)
                    .map_err(|e| e.to_string())?;
                TensorRef::from_array_view((shape, &buf[..]))
                    .map_err(|e| e.to_string())?
                    .into()
            }
            InputBuffer::U8(buf) => {
                preprocessor
                    .to_u8(pixels, Layout::Nhwc, buf)
                    .map_err(|e| e.to_string())?;
                TensorRef::from_array_view((shape, &buf[..]))
                    .map_err(|e| e.to_string())?
                    .into()
            }
        };
        let results = session
            .run(vec![(Cow::Borrowed(spec.input.name.as_str()), value)])
            .map_err(|e| format!("ONNX Runtime run failed: {e}"))?;
        let mut out = Vec::with_capacity(which.len());
        for &i in which {
            let name = &spec.outputs[i].name;
            let (shape, data) = results
                .get(name.as_str())
                .ok_or_else(|| format!("output {name:?} is missing from the run's results"))?
                .try_extract_tensor::<f32>()
                .map_err(|e| format!("output {name:?}: {e}"))?;
            let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
            out.push(Tensor {
                name: name.clone(),
                datatype: DataType::Fp32,
                shape: shape.iter().map(|&d| d.max(0) as u64).collect(),
                data: Bytes::from(bytes),
            });
        }
        Ok(out)
    }
}

/// N sessions, each on a thread of its own, fed from one bounded queue.
#[derive(Debug)]
pub struct Engine {
    jobs: Option<SyncSender<Job>>,
    /// Each thread says here when it ends (in a mutex: the engine is
    /// shared by the request handlers, and a receiver is not `Sync`).
    ended: Mutex<mpsc::Receiver<()>>,
    threads: usize,
    queue: usize,
}

/// Why a frame was not run.
#[derive(Debug, Clone, PartialEq, Eq)]
enum RunError {
    /// The queue is full.
    Overloaded { queue: usize },
    /// The run failed (the reason).
    Failed(String),
}

impl Engine {
    /// Sends `job` to the next free session; refused at once when `queue`
    /// jobs are waiting already.
    fn submit(&self, job: Job) -> Result<(), RunError> {
        let Some(jobs) = &self.jobs else {
            return Err(RunError::Failed("the server is shutting down".into()));
        };
        jobs.try_send(job).map_err(|e| match e {
            TrySendError::Full(_) => RunError::Overloaded { queue: self.queue },
            TrySendError::Disconnected(_) => {
                RunError::Failed("every session thread has ended".into())
            }
        })
    }

    /// Stops taking jobs and waits, at most `within`, for the threads to
    /// finish the ones they hold; true when they all did.
    pub fn shutdown(mut self, within: Duration) -> bool {
        self.jobs = None;
        let ended = self
            .ended
            .into_inner()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let until = std::time::Instant::now() + within;
        // Bounded: one message per thread, each waited for until `until`.
        for _ in 0..self.threads {
            let left = until.saturating_duration_since(std::time::Instant::now());
            if ended.recv_timeout(left).is_err() {
                return false;
            }
        }
        true
    }
}

/// The model served, and the sessions serving it.
#[derive(Debug)]
pub struct Baseline {
    spec: Arc<ModelSpec>,
    engine: Engine,
    limits: CodecLimits,
}

impl Baseline {
    /// Loads ONNX Runtime as the worker does (`ORT_DYLIB_PATH`, else the
    /// tidegate cache), the model in `opts.model_dir`, opens
    /// `opts.sessions` sessions of `opts.threads` intra-op threads, checks
    /// each against model.toml, warms each up with one frame, and starts
    /// their threads.
    pub fn open(opts: &BaselineOptions) -> Result<Baseline, BaselineError> {
        if opts.sessions == 0 || opts.threads == 0 || opts.queue == 0 {
            return Err(BaselineError::Options(format!(
                "sessions = {}, threads = {}, queue = {}: each must be 1 or more",
                opts.sessions, opts.threads, opts.queue
            )));
        }
        let (parent, name) = split_model_dir(&opts.model_dir)?;
        let repo = Repository::load(&parent, Some(std::slice::from_ref(&name))).map_err(|e| {
            BaselineError::Model {
                dir: opts.model_dir.clone(),
                source: Box::new(e),
            }
        })?;
        let model = repo.models()[0].clone();
        let spec = Arc::new(model.spec.clone());
        let runtime = Runtime::init(None)?;
        let (jobs, queue) = mpsc::sync_channel::<Job>(opts.queue);
        let queue = Arc::new(Mutex::new(queue));
        let (ended_tx, ended) = mpsc::channel();
        let mut runners = Vec::with_capacity(opts.sessions);
        for _ in 0..opts.sessions {
            runners.push(open_runner(runtime, &model.path, &spec, opts.threads)?);
        }
        for (index, mut runner) in runners.into_iter().enumerate() {
            let queue = queue.clone();
            let ended = ended_tx.clone();
            std::thread::Builder::new()
                .name(format!("session-{index}"))
                .spawn(move || {
                    loop {
                        // One thread waits on the queue at a time; the
                        // others wait for the lock.
                        let next = queue.lock().expect("queue lock").recv();
                        let Ok(job) = next else { break };
                        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            runner.run(&job.pixels, &job.outputs)
                        }));
                        let result = ran.unwrap_or_else(|_| {
                            Err("the session panicked on this frame".to_string())
                        });
                        // The client may have gone: nobody to tell.
                        let _ = job.reply.send(result);
                    }
                    let _ = ended.send(());
                })
                .map_err(|source| BaselineError::Thread { index, source })?;
        }
        Ok(Baseline {
            spec,
            engine: Engine {
                jobs: Some(jobs),
                ended: Mutex::new(ended),
                threads: opts.sessions,
                queue: opts.queue,
            },
            limits: CodecLimits::default(),
        })
    }

    /// The model served.
    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// Stops the sessions (see [`Engine::shutdown`]).
    pub fn shutdown(self, within: Duration) -> bool {
        self.engine.shutdown(within)
    }

    /// The frame shape requests must send: `[1, H, W, 3]`.
    fn frame_shape(&self) -> Vec<u64> {
        let i = &self.spec.input;
        vec![
            1,
            u64::from(i.height),
            u64::from(i.width),
            u64::from(i.channels),
        ]
    }

    /// `GET /v2/models/{name}`'s answer.
    pub fn metadata(&self) -> ModelMetadata {
        let s = &self.spec;
        ModelMetadata {
            name: s.name.clone(),
            versions: vec![s.version.to_string()],
            platform: "onnxruntime_onnx".into(),
            inputs: vec![TensorMetadata {
                name: s.input.name.clone(),
                datatype: DataType::Uint8.as_str().into(),
                shape: self.frame_shape().iter().map(|&d| d as i64).collect(),
            }],
            outputs: s
                .outputs
                .iter()
                .map(|o| TensorMetadata {
                    name: o.name.clone(),
                    datatype: DataType::Fp32.as_str().into(),
                    shape: o.shape.clone(),
                })
                .collect(),
        }
    }

    /// The frame's bytes and the outputs asked for (indices), or why the
    /// request cannot be run.
    fn admit(&self, req: &InferRequest) -> Result<(Bytes, Vec<usize>), ApiError> {
        let s = &self.spec;
        let Some(input) = req.inputs.iter().find(|t| t.name == s.input.name) else {
            return Err(ApiError::BadRequest(format!(
                "model '{}' takes input {:?}; the request has {:?}",
                s.name,
                s.input.name,
                req.inputs.iter().map(|t| &t.name).collect::<Vec<_>>()
            )));
        };
        if req.inputs.len() != 1 {
            return Err(ApiError::BadRequest(format!(
                "model '{}' takes one input, {:?}; the request has {}",
                s.name,
                s.input.name,
                req.inputs.len()
            )));
        }
        let want = self.frame_shape();
        if input.datatype != DataType::Uint8 || input.shape != want {
            return Err(ApiError::BadRequest(format!(
                "model '{}' expects UINT8 {want:?} (NHWC RGB), input {:?} is {} {:?}",
                s.name, input.name, input.datatype, input.shape
            )));
        }
        let outputs = if req.outputs.is_empty() {
            (0..s.outputs.len()).collect()
        } else {
            let mut which = Vec::with_capacity(req.outputs.len());
            for name in &req.outputs {
                let Some(i) = s.outputs.iter().position(|o| &o.name == name) else {
                    return Err(ApiError::BadRequest(format!(
                        "model '{}' has no output {name:?}; it has {:?}",
                        s.name,
                        s.outputs.iter().map(|o| &o.name).collect::<Vec<_>>()
                    )));
                };
                which.push(i);
            }
            which
        };
        Ok((input.data.clone(), outputs))
    }
}

/// `models/blazeface` as the repository `models` and the model
/// `blazeface`.
fn split_model_dir(dir: &Path) -> Result<(PathBuf, String), BaselineError> {
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .ok_or_else(|| {
            BaselineError::Options(format!(
                "--model-dir {} names no folder; give the model's folder, such as models/blazeface",
                dir.display()
            ))
        })?;
    let parent = match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    Ok((parent, name))
}

/// Opens one session of `spec` from `path`, checks its input and outputs
/// against model.toml, and warms it up with one grey frame.
fn open_runner(
    runtime: &Runtime,
    path: &Path,
    spec: &Arc<ModelSpec>,
    threads: usize,
) -> Result<Runner, BaselineError> {
    let fail = |message: String| BaselineError::Session {
        model: spec.name.clone(),
        message,
    };
    let opening = |e: &dyn std::fmt::Display| fail(format!("opening {}: {e}", path.display()));
    let mut builder = Session::builder(runtime.environment())
        .map_err(|e| opening(&e))?
        .with_intra_threads(threads)
        .map_err(|e| opening(&e))?;
    let session = builder.commit_from_file(path).map_err(|e| opening(&e))?;
    let want = match spec.input.model_dtype {
        DType::F32 => TensorElementType::Float32,
        DType::U8 => TensorElementType::Uint8,
    };
    let inputs: Vec<&str> = session.inputs().iter().map(|o| o.name()).collect();
    match session
        .inputs()
        .iter()
        .find(|o| o.name() == spec.input.name)
    {
        Some(o) if o.dtype().tensor_type() == Some(want) => {}
        Some(o) => {
            return Err(fail(format!(
                "input {:?} is {} in the graph, {} in model.toml",
                spec.input.name,
                o.dtype(),
                spec.input.model_dtype
            )));
        }
        None => {
            return Err(fail(format!(
                "the graph has inputs {inputs:?}, not {:?}",
                spec.input.name
            )));
        }
    }
    for out in &spec.outputs {
        match session.outputs().iter().find(|o| o.name() == out.name) {
            Some(o) if o.dtype().tensor_type() == Some(TensorElementType::Float32) => {}
            Some(o) => {
                return Err(fail(format!(
                    "output {:?} is {}; the baseline returns f32 outputs only",
                    out.name,
                    o.dtype()
                )));
            }
            None => {
                return Err(fail(format!(
                    "the graph has no output {:?} (model.toml names it)",
                    out.name
                )));
            }
        }
    }
    let len = spec.input.frame_len();
    let input = match spec.input.model_dtype {
        DType::F32 => InputBuffer::F32(vec![0.0; len]),
        DType::U8 => InputBuffer::U8(vec![0; len]),
    };
    let mut runner = Runner {
        spec: spec.clone(),
        session,
        preprocessor: Preprocessor::new(&spec.input),
        input,
    };
    let all: Vec<usize> = (0..spec.outputs.len()).collect();
    runner
        .run(&vec![128u8; len], &all)
        .map_err(|e| fail(format!("warm-up run: {e}")))?;
    Ok(runner)
}

/// An answer other than 200, as KServe servers give it: `{"error": ...}`.
#[derive(Debug, Clone, PartialEq, Eq)]
enum ApiError {
    /// No such model: 404.
    UnknownModel { asked: String, served: String },
    /// The request is malformed or does not fit the model: 400.
    BadRequest(String),
    /// The queue is full: 503, retry later.
    Overloaded { queue: usize },
    /// The run failed: 500.
    Failed(String),
}

impl ApiError {
    /// The one table from error to status.
    fn status(&self) -> StatusCode {
        match self {
            ApiError::UnknownModel { .. } => StatusCode::NOT_FOUND,
            ApiError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ApiError::Overloaded { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Failed(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn message(&self) -> String {
        match self {
            ApiError::UnknownModel { asked, served } => {
                format!("unknown model '{asked}'; this server serves '{served}'")
            }
            ApiError::BadRequest(m) | ApiError::Failed(m) => m.clone(),
            ApiError::Overloaded { queue } => format!(
                "overloaded: {queue} requests already wait for a session; retry later or start more sessions"
            ),
        }
    }
}

impl From<RunError> for ApiError {
    fn from(e: RunError) -> Self {
        match e {
            RunError::Overloaded { queue } => ApiError::Overloaded { queue },
            RunError::Failed(m) => ApiError::Failed(m),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({ "error": self.message() });
        (self.status(), axum::Json(body)).into_response()
    }
}

/// The server's routes over `baseline`: `POST /v2/models/{name}/infer`
/// (and `.../versions/{version}/infer`), `GET /v2`, `GET
/// /v2/health/{live,ready}`, `GET /v2/models/{name}` and `GET
/// /v2/models/{name}/ready`.
pub fn router(baseline: Arc<Baseline>) -> Router {
    Router::new()
        .route("/v2", get(server_metadata))
        .route("/v2/health/live", get(|| async { StatusCode::OK }))
        .route("/v2/health/ready", get(|| async { StatusCode::OK }))
        .route("/v2/models/{name}", get(model_metadata))
        .route("/v2/models/{name}/ready", get(model_ready))
        .route("/v2/models/{name}/infer", post(infer))
        .route(
            "/v2/models/{name}/versions/{version}/infer",
            post(infer_version),
        )
        .layer(DefaultBodyLimit::max(MAX_REQUEST_BYTES))
        .with_state(baseline)
}

async fn server_metadata() -> axum::Json<ServerMetadata> {
    axum::Json(ServerMetadata {
        name: SERVER_NAME.into(),
        version: env!("CARGO_PKG_VERSION").into(),
        extensions: vec!["binary_tensor_data".into()],
    })
}

impl Baseline {
    fn served(&self, name: &str) -> Result<(), ApiError> {
        if name == self.spec.name {
            Ok(())
        } else {
            Err(ApiError::UnknownModel {
                asked: name.to_string(),
                served: self.spec.name.clone(),
            })
        }
    }
}

async fn model_metadata(
    State(b): State<Arc<Baseline>>,
    UrlPath(name): UrlPath<String>,
) -> Result<axum::Json<ModelMetadata>, ApiError> {
    b.served(&name)?;
    Ok(axum::Json(b.metadata()))
}

async fn model_ready(
    State(b): State<Arc<Baseline>>,
    UrlPath(name): UrlPath<String>,
) -> Result<StatusCode, ApiError> {
    b.served(&name)?;
    Ok(StatusCode::OK)
}

async fn infer_version(
    State(b): State<Arc<Baseline>>,
    UrlPath((name, version)): UrlPath<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    b.served(&name)?;
    if version != b.spec.version.to_string() {
        return Err(ApiError::UnknownModel {
            asked: format!("{name}' version '{version}"),
            served: format!("{}' version '{}", b.spec.name, b.spec.version),
        });
    }
    infer(State(b), UrlPath(name), headers, body).await
}

async fn infer(
    State(b): State<Arc<Baseline>>,
    UrlPath(name): UrlPath<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    b.served(&name)?;
    let header_len = match headers.get(HEADER_LENGTH) {
        None => None,
        Some(v) => Some(
            codec::parse_header_length(v.to_str().unwrap_or("(not text)"))
                .map_err(|e| ApiError::BadRequest(e.to_string()))?,
        ),
    };
    let req = InferRequest::decode(&body, header_len, &b.limits)
        .map_err(|e| ApiError::BadRequest(e.to_string()))?;
    let (pixels, outputs) = b.admit(&req)?;
    let (reply, answer) = oneshot::channel();
    b.engine.submit(Job {
        pixels,
        outputs,
        reply,
    })?;
    let tensors = answer
        .await
        .map_err(|_| ApiError::Failed("the session thread dropped the frame".into()))?
        .map_err(|e| ApiError::Failed(format!("model '{}': {e}", b.spec.name)))?;
    let encoded = InferResponse {
        model_name: b.spec.name.clone(),
        model_version: Some(b.spec.version.to_string()),
        id: req.id,
        outputs: tensors,
    }
    .encode();
    let mut response = encoded.body.into_response();
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    h.insert(HEADER_LENGTH, HeaderValue::from(encoded.header_len));
    Ok(response)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_model_folder_splits_into_its_repository_and_name() {
        assert_eq!(
            split_model_dir(Path::new("models/blazeface")).unwrap(),
            (PathBuf::from("models"), "blazeface".to_string())
        );
        assert_eq!(
            split_model_dir(Path::new("blazeface")).unwrap(),
            (PathBuf::from("."), "blazeface".to_string())
        );
        let err = split_model_dir(Path::new("/")).unwrap_err().to_string();
        assert!(err.contains("models/blazeface"), "{err}");
    }

    #[test]
    fn every_error_has_one_status_and_a_message_saying_what_to_do() {
        let cases = [
            (
                ApiError::UnknownModel {
                    asked: "yolo".into(),
                    served: "blazeface".into(),
                },
                404,
                "serves 'blazeface'",
            ),
            (ApiError::BadRequest("bad".into()), 400, "bad"),
            (ApiError::Overloaded { queue: 8 }, 503, "retry later"),
            (ApiError::Failed("boom".into()), 500, "boom"),
        ];
        for (e, status, text) in cases {
            assert_eq!(e.status().as_u16(), status, "{e:?}");
            assert!(e.message().contains(text), "{e:?}");
        }
        assert_eq!(
            ApiError::from(RunError::Overloaded { queue: 3 }).status(),
            StatusCode::SERVICE_UNAVAILABLE
        );
    }
}
