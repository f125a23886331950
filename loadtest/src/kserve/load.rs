//! The load generator's shell: simulated cameras on the simulator's
//! open-loop schedules ([`crate::loadgen::camera_schedules`]), one KServe v2
//! request per frame over the connection [`Pool`], every answer checked
//! and counted in a [`Tally`].

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::Request;
use hyper::header::{CONTENT_LENGTH, CONTENT_TYPE, HOST};
use serde::de::DeserializeOwned;
use tidegate_protocol::{ColorOrder, DType, InputSpec, Layout, Resize};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::codec::{
    self, CodecLimits, DataType, HEADER_LENGTH, InferRequest, InferResponse, ModelMetadata,
    ServerMetadata, Tensor, TensorMetadata,
};
use super::pool::{Answer, ExchangeError, Pool, Target, TargetError};
use super::tally::{KserveReport, Outcome, Tally};
use crate::loadgen::{self, FPS_RANGE, FrameImageError};

/// BlazeFace's graph input, as models/blazeface/model.toml names it.
pub const DEFAULT_INPUT: &str = "input:0";
/// BlazeFace's graph outputs, as models/blazeface/model.toml names them.
pub const DEFAULT_OUTPUTS: [&str; 4] =
    ["Identity:0", "Identity_1:0", "Identity_2:0", "Identity_3:0"];
/// Connections the client may open: at the knee of a 2-core server
/// (hundreds of frames a second, each answered within 80 ms) tens are
/// busy at once; past it, frames wait out their grace on a connection
/// each, and the rest are counted `no_connection` rather than queued.
pub const DEFAULT_MAX_CONNECTIONS: usize = 256;
/// How long after its budget a request is given up (and counted
/// `timed_out`); an answer before then is `late`.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(1);
/// The longest answer body read: BlazeFace's four outputs are 61 KB.
pub const MAX_ANSWER_BYTES: usize = 16 * 1024 * 1024;
/// How long the metadata requests before the run may take.
const METADATA_TIMEOUT: Duration = Duration::from_secs(5);
/// How long past the last deadline (due + budget + grace) the run waits
/// for request tasks a busy machine has not yet scheduled; those still not
/// done are abandoned and counted `missing`.
const SETTLE: Duration = Duration::from_secs(5);

/// What to run against a KServe v2 server.
#[derive(Debug, Clone)]
pub struct KserveOptions {
    /// The server's base URL (`http://host:port`, optionally a path).
    pub url: String,
    /// The model to ask for.
    pub model: String,
    /// What to call the server in the report; `None`: the name it gives
    /// at `GET /v2`, else `unknown`.
    pub system: Option<String>,
    /// Simulated cameras.
    pub cameras: usize,
    /// Frames per second per camera.
    pub fps: f64,
    /// How long to send.
    pub duration: Duration,
    /// Budget per frame (ms), from when it is due.
    pub budget_ms: u32,
    /// How long after its budget a request is given up.
    pub grace: Duration,
    /// Every camera's frame due in the same instant (see
    /// [`loadgen::camera_schedules`]).
    pub in_step: bool,
    /// The model's input.
    pub input_name: String,
    /// The outputs asked for (empty: every output).
    pub output_names: Vec<String>,
    /// The most connections open at once.
    pub max_connections: usize,
    /// Image to send, resized as the simulator does; grey frames if absent.
    pub image: Option<PathBuf>,
    /// The frame's width and height (the model's input).
    pub size: (u32, u32),
}

impl KserveOptions {
    /// BlazeFace on `url`: one camera at 10 fps for 10 s, an 80 ms budget,
    /// grey 128×128 frames, the defaults above.
    pub fn blazeface(url: &str) -> Self {
        KserveOptions {
            url: url.to_string(),
            model: "blazeface".into(),
            system: None,
            cameras: 1,
            fps: 10.0,
            duration: Duration::from_secs(10),
            budget_ms: 80,
            grace: DEFAULT_GRACE,
            in_step: false,
            input_name: DEFAULT_INPUT.into(),
            output_names: DEFAULT_OUTPUTS.iter().map(|s| s.to_string()).collect(),
            max_connections: DEFAULT_MAX_CONNECTIONS,
            image: None,
            size: (128, 128),
        }
    }
}

/// Why a KServe run could not run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KserveError {
    /// The options ask for no camera.
    #[error("at least one camera is needed; set cameras to 1 or more")]
    NoCameras,
    /// The options ask for a frame rate outside [`FPS_RANGE`].
    #[error("fps = {0} is not in [{min}, {max}]; give a rate in that range", min = FPS_RANGE.start(), max = FPS_RANGE.end())]
    Fps(f64),
    /// The options ask for no connection, or an empty frame.
    #[error("{0}")]
    Options(String),
    /// The URL cannot be used.
    #[error(transparent)]
    Target(#[from] TargetError),
    /// The image would not open.
    #[error(transparent)]
    Image(#[from] FrameImageError),
    /// The model's metadata says the run cannot work.
    #[error("model '{model}' at {url}: {why}")]
    Metadata {
        /// The model.
        model: String,
        /// The server.
        url: String,
        /// What does not fit.
        why: String,
    },
    /// The runtime of [`run_blocking`] could not be built.
    #[error("building the load generator's runtime: {0}")]
    Runtime(#[source] std::io::Error),
    /// A camera's task panicked.
    #[error("camera task: {0}")]
    CameraTask(#[from] tokio::task::JoinError),
}

/// What every answer is checked against.
#[derive(Debug, Clone)]
struct Expectation {
    /// The outputs every answer must carry, once each.
    names: Vec<String>,
    /// Their types and shapes, when the server gave its model's metadata.
    metadata: Vec<TensorMetadata>,
}

impl Expectation {
    /// From the outputs asked for and the model's metadata (if any); an
    /// error when the metadata says the run cannot work.
    fn new(opts: &KserveOptions, metadata: Option<&ModelMetadata>) -> Result<Self, String> {
        let Some(m) = metadata else {
            return Ok(Expectation {
                names: opts.output_names.clone(),
                metadata: Vec::new(),
            });
        };
        if !m.inputs.is_empty() {
            let (w, h) = opts.size;
            let frame = Tensor {
                name: opts.input_name.clone(),
                datatype: DataType::Uint8,
                shape: vec![1, u64::from(h), u64::from(w), 3],
                data: Bytes::new(),
            };
            let Some(input) = m.inputs.iter().find(|i| i.name == opts.input_name) else {
                return Err(format!(
                    "it has inputs {:?}, not {:?}; set --input-name",
                    m.inputs.iter().map(|i| &i.name).collect::<Vec<_>>(),
                    opts.input_name
                ));
            };
            if !input.admits(&frame) {
                return Err(format!(
                    "input {:?} is {} {:?}; this generator sends UINT8 {:?} (NHWC RGB frames)",
                    input.name, input.datatype, input.shape, frame.shape
                ));
            }
        }
        let names = if opts.output_names.is_empty() {
            m.outputs.iter().map(|o| o.name.clone()).collect()
        } else {
            opts.output_names.clone()
        };
        let mut metadata = Vec::with_capacity(names.len());
        for name in &names {
            match m.outputs.iter().find(|o| &o.name == name) {
                Some(o) => metadata.push(o.clone()),
                None if m.outputs.is_empty() => {}
                None => {
                    return Err(format!(
                        "it has outputs {:?}, not {name:?}; set --output-names",
                        m.outputs.iter().map(|o| &o.name).collect::<Vec<_>>()
                    ));
                }
            }
        }
        Ok(Expectation { names, metadata })
    }

    /// Why `r` is not a well-formed answer, if it is not.
    fn check(&self, r: &InferResponse) -> Result<(), String> {
        if self.names.is_empty() && r.outputs.is_empty() {
            return Err("the answer has no outputs".into());
        }
        for name in &self.names {
            match r.outputs.iter().filter(|o| &o.name == name).count() {
                1 => {}
                0 => return Err(format!("output {name:?} is missing")),
                n => return Err(format!("output {name:?} is there {n} times")),
            }
        }
        for want in &self.metadata {
            let got = r.outputs.iter().find(|o| o.name == want.name);
            if let Some(got) = got
                && !want.admits(got)
            {
                return Err(format!(
                    "output {:?} is {} {:?}; the model's metadata says {} {:?}",
                    got.name, got.datatype, got.shape, want.datatype, want.shape
                ));
            }
        }
        Ok(())
    }
}

/// What every request task shares.
#[derive(Debug)]
struct Shared {
    pool: Arc<Pool>,
    /// `{prefix}/v2/models/{model}/infer`.
    path: String,
    input_name: String,
    shape: Vec<u64>,
    pixels: Bytes,
    outputs: Vec<String>,
    expect: Expectation,
    budget: Duration,
    grace: Duration,
    /// Taken when the run ends: a request ending later is not counted
    /// (it is `missing`).
    tally: Mutex<Option<Tally>>,
    limits: CodecLimits,
}

/// Runs the load and returns its report.
pub async fn run(opts: &KserveOptions) -> Result<KserveReport, KserveError> {
    let shared = prepare(opts).await?;
    drive(opts, shared).await
}

/// Checks `opts`, makes the frame, and asks the server about the model
/// and itself, before the clock starts (on connections the run then
/// reuses): what every request shares, its tally started.
async fn prepare(opts: &KserveOptions) -> Result<Arc<Shared>, KserveError> {
    if !FPS_RANGE.contains(&opts.fps) {
        return Err(KserveError::Fps(opts.fps));
    }
    if opts.cameras == 0 {
        return Err(KserveError::NoCameras);
    }
    if opts.max_connections == 0 {
        return Err(KserveError::Options(
            "max_connections is 0; allow at least one connection".into(),
        ));
    }
    let (w, h) = opts.size;
    if w == 0 || h == 0 {
        return Err(KserveError::Options(format!(
            "the frame is {w}x{h}; give the model's input size"
        )));
    }
    let target = Target::resolve(&opts.url).await?;
    let input = InputSpec {
        width: w,
        height: h,
        channels: 3,
        dtype: DType::U8,
        layout: Layout::Nhwc,
        color: ColorOrder::Rgb,
        resize: Resize::Letterbox,
    };
    let (pixels, _) = loadgen::frame_pixels(&input, opts.image.as_deref())?;
    let pool = Pool::new(target.clone(), opts.max_connections);
    let model_path = format!("{}/v2/models/{}", target.prefix, opts.model);
    let metadata = get_json::<ModelMetadata>(&pool, &model_path).await;
    if let Err(why) = &metadata {
        tracing::warn!(
            "no metadata for model '{}' ({why}): answers are checked for the outputs' names and sizes only",
            opts.model
        );
    }
    let expect =
        Expectation::new(opts, metadata.as_ref().ok()).map_err(|why| KserveError::Metadata {
            model: opts.model.clone(),
            url: opts.url.clone(),
            why,
        })?;
    let system = match &opts.system {
        Some(s) => s.clone(),
        None => get_json::<ServerMetadata>(&pool, &format!("{}/v2", target.prefix))
            .await
            .map_or_else(|_| "unknown".to_string(), |m| m.name),
    };

    let shared = Arc::new(Shared {
        pool,
        path: format!("{}/v2/models/{}/infer", target.prefix, opts.model),
        input_name: opts.input_name.clone(),
        shape: vec![1, u64::from(h), u64::from(w), 3],
        pixels,
        outputs: opts.output_names.clone(),
        expect,
        budget: Duration::from_millis(u64::from(opts.budget_ms)),
        grace: opts.grace,
        tally: Mutex::new(None),
        limits: CodecLimits::default(),
    });
    let header = KserveReport {
        system,
        url: opts.url.clone(),
        model: opts.model.clone(),
        cameras: opts.cameras,
        fps: opts.fps,
        duration_s: opts.duration.as_secs_f64(),
        budget_ms: opts.budget_ms,
        grace_ms: u64::try_from(opts.grace.as_millis()).unwrap_or(u64::MAX),
        in_step: opts.in_step,
        bytes_per_frame: shared.request(0, 0).body.len() as u64,
        planned: loadgen::frames_per_camera(opts.fps, opts.duration)
            .saturating_mul(opts.cameras as u64),
        checked_against_metadata: !shared.expect.metadata.is_empty(),
        max_connections: opts.max_connections,
        ..KserveReport::default()
    };
    *shared.tally.lock().expect("tally lock") = Some(Tally::new(header));
    Ok(shared)
}

/// Sends every camera's frames on its schedule, waits (bounded) for every
/// request to end, and finishes the report.
async fn drive(opts: &KserveOptions, shared: Arc<Shared>) -> Result<KserveReport, KserveError> {
    let cpu_before = process_cpu_seconds();
    let start = Instant::now();
    let requests = TaskTracker::new();
    let abandon = CancellationToken::new();
    let mut cameras = tokio::task::JoinSet::new();
    for (i, schedule) in loadgen::camera_schedules(
        opts.cameras,
        opts.fps,
        opts.duration,
        opts.in_step,
        start,
        0,
    )
    .into_iter()
    .enumerate()
    {
        let (shared, requests, abandon) = (shared.clone(), requests.clone(), abandon.clone());
        cameras.spawn(async move {
            for seq in 0..schedule.frames() {
                let Some(due) = schedule.wait_for(seq).await else {
                    return schedule.frames() - seq;
                };
                let (shared, abandon) = (shared.clone(), abandon.clone());
                requests.spawn(async move {
                    tokio::select! {
                        () = shared.frame(i, seq, due) => {}
                        () = abandon.cancelled() => {}
                    }
                });
            }
            0
        });
    }
    let mut failed = None;
    while let Some(unsent) = cameras.join_next().await {
        match unsent {
            Ok(n) => shared.count_unsent(n),
            Err(e) => failed = Some(e),
        }
    }
    requests.close();
    // Every request ends by its deadline (due + budget + grace); the last
    // is due before now.
    let settle = shared.budget + shared.grace + SETTLE;
    if tokio::time::timeout(settle, requests.wait()).await.is_err() {
        tracing::warn!(
            "{} requests still running {settle:?} after the last frame was due; abandoned (missing)",
            requests.len()
        );
    }
    let tally = shared.tally.lock().expect("tally lock").take();
    abandon.cancel();
    requests.wait().await;
    let wall = start.elapsed();
    let cpu_after = process_cpu_seconds();
    shared.pool.close(Duration::from_secs(5)).await;
    if let Some(e) = failed {
        return Err(KserveError::CameraTask(e));
    }
    let mut report = tally.expect("the tally is taken once").finish();
    let (opened, peak) = shared.pool.stats();
    report.connections_opened = opened;
    report.peak_connections = peak;
    report.wall_s = wall.as_secs_f64();
    report.client_cpu_s = match (cpu_before, cpu_after) {
        // Whole ticks: the difference without float noise.
        (Some(a), Some(b)) => ((b - a) * USER_HZ).round().max(0.0) / USER_HZ,
        _ => f64::NAN,
    };
    Ok(report)
}

/// [`run`] on a runtime of its own (two threads), for callers outside
/// async code.
pub fn run_blocking(opts: &KserveOptions) -> Result<KserveReport, KserveError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(KserveError::Runtime)?
        .block_on(run(opts))
}

impl Shared {
    /// Camera `i`'s frame `seq` as a request body.
    fn request(&self, i: usize, seq: u64) -> codec::Encoded {
        InferRequest {
            id: Some(format!("cam{i}-{seq}")),
            inputs: vec![Tensor {
                name: self.input_name.clone(),
                datatype: DataType::Uint8,
                shape: self.shape.clone(),
                data: self.pixels.clone(),
            }],
            outputs: self.outputs.clone(),
        }
        .encode()
    }

    /// Sends camera `i`'s frame `seq`, due at `due`, and counts how it
    /// ended: given up at its budget plus the grace.
    async fn frame(&self, i: usize, seq: u64, due: Instant) {
        let encoded = self.request(i, seq);
        let make = || {
            Request::post(self.path.as_str())
                .header(HOST, self.pool.target().authority.as_str())
                .header(CONTENT_TYPE, "application/octet-stream")
                .header(CONTENT_LENGTH, encoded.body.len())
                .header(HEADER_LENGTH, encoded.header_len)
                .body(Full::new(encoded.body.clone()))
                .expect("a valid request")
        };
        let deadline = due + self.budget + self.grace;
        let outcome =
            match tokio::time::timeout_at(deadline, self.pool.exchange(make, MAX_ANSWER_BYTES))
                .await
            {
                Err(_) => Outcome::TimedOut,
                Ok(Err(ExchangeError::NoConnection { .. })) => Outcome::NoConnection,
                Ok(Err(e @ ExchangeError::BodyTooLarge { .. })) => {
                    Outcome::Malformed(e.to_string())
                }
                Ok(Err(e)) => Outcome::Transport(e.to_string()),
                Ok(Ok(answer)) => self.classify(&answer),
            };
        let latency = Instant::now().saturating_duration_since(due);
        if let Some(t) = self.tally.lock().expect("tally lock").as_mut() {
            t.record(outcome, latency);
        }
    }

    /// Ok, an HTTP error, or malformed.
    fn classify(&self, answer: &Answer) -> Outcome {
        if answer.status != hyper::StatusCode::OK {
            return Outcome::Http(answer.status.as_u16());
        }
        match decode_answer(answer, &self.limits).and_then(|r| self.expect.check(&r)) {
            Ok(()) => Outcome::Ok,
            Err(why) => Outcome::Malformed(why),
        }
    }

    fn count_unsent(&self, n: u64) {
        if let Some(t) = self.tally.lock().expect("tally lock").as_mut() {
            t.unsent(n);
        }
    }
}

/// The answer's body as a KServe response.
fn decode_answer(answer: &Answer, limits: &CodecLimits) -> Result<InferResponse, String> {
    let header_len = match answer.headers.get(HEADER_LENGTH) {
        None => None,
        Some(v) => Some(
            codec::parse_header_length(v.to_str().unwrap_or("(not text)"))
                .map_err(|e| e.to_string())?,
        ),
    };
    InferResponse::decode(&answer.body, header_len, limits).map_err(|e| e.to_string())
}

/// `GET path` as JSON, within [`METADATA_TIMEOUT`]; why not, as text.
async fn get_json<T: DeserializeOwned>(pool: &Arc<Pool>, path: &str) -> Result<T, String> {
    let make = || {
        Request::get(path)
            .header(HOST, pool.target().authority.as_str())
            .body(Full::new(Bytes::new()))
            .expect("a valid request")
    };
    let answer = tokio::time::timeout(METADATA_TIMEOUT, pool.exchange(make, MAX_ANSWER_BYTES))
        .await
        .map_err(|_| format!("GET {path}: no answer within {METADATA_TIMEOUT:?}"))?
        .map_err(|e| format!("GET {path}: {e}"))?;
    if answer.status != hyper::StatusCode::OK {
        return Err(format!(
            "GET {path}: {} {}",
            answer.status,
            String::from_utf8_lossy(&answer.body[..answer.body.len().min(200)])
        ));
    }
    serde_json::from_slice(&answer.body).map_err(|e| format!("GET {path}: {e}"))
}

/// The kernel's clock ticks per second in /proc (`USER_HZ`): 100 on every
/// architecture this runs on (x86-64, arm64).
const USER_HZ: f64 = 100.0;

/// CPU time this process has used (user + system, s), from
/// /proc/self/stat; `None` where there is no /proc.
pub fn process_cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    cpu_seconds_from_stat(&stat)
}

/// Fields 14 and 15 (utime, stime) of a /proc/PID/stat line, in seconds.
/// The command name (field 2) is in parentheses and may hold spaces, so
/// fields are counted from its closing parenthesis.
fn cpu_seconds_from_stat(stat: &str) -> Option<f64> {
    let after = &stat[stat.rfind(')')? + 1..];
    let mut fields = after.split_whitespace();
    // After the name: state (3), ..., utime (14), stime (15).
    let utime: u64 = fields.nth(11)?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some((utime + stime) as f64 / USER_HZ)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_time_is_read_past_a_command_name_with_spaces_and_parentheses() {
        let line = "4242 (tidegate (x) y) S 1 4242 4242 0 -1 4194560 500 0 0 0 250 75 0 0 20 0 9 0 100 0 0";
        assert_eq!(cpu_seconds_from_stat(line), Some(3.25));
        assert_eq!(cpu_seconds_from_stat("4242 (x) S 1"), None);
        let own = process_cpu_seconds().expect("Linux has /proc/self/stat");
        assert!(own >= 0.0);
    }

    fn metadata() -> ModelMetadata {
        let t = |name: &str, datatype: &str, shape: &[i64]| TensorMetadata {
            name: name.into(),
            datatype: datatype.into(),
            shape: shape.to_vec(),
        };
        ModelMetadata {
            name: "blazeface".into(),
            versions: vec!["2".into()],
            platform: "onnxruntime_onnx".into(),
            inputs: vec![t("input:0", "UINT8", &[1, 128, 128, 3])],
            outputs: vec![
                t("Identity:0", "FP32", &[-1, 512, 1]),
                t("Identity_1:0", "FP32", &[-1, 384, 1]),
            ],
        }
    }

    fn answer(outputs: &[(&str, &[u64])]) -> InferResponse {
        InferResponse {
            model_name: "blazeface".into(),
            model_version: None,
            id: None,
            outputs: outputs
                .iter()
                .map(|(name, shape)| Tensor {
                    name: name.to_string(),
                    datatype: DataType::Fp32,
                    shape: shape.to_vec(),
                    data: Bytes::new(),
                })
                .collect(),
        }
    }

    #[test]
    fn an_answer_must_carry_every_output_asked_for_once_in_the_shape_the_model_gives() {
        let mut opts = KserveOptions::blazeface("http://127.0.0.1:1");
        opts.output_names = vec!["Identity:0".into(), "Identity_1:0".into()];
        let e = Expectation::new(&opts, Some(&metadata())).unwrap();
        let good = answer(&[("Identity:0", &[1, 512, 1]), ("Identity_1:0", &[1, 384, 1])]);
        assert_eq!(e.check(&good), Ok(()));
        let missing = answer(&[("Identity:0", &[1, 512, 1])]);
        assert!(e.check(&missing).unwrap_err().contains("missing"));
        let twice = answer(&[
            ("Identity:0", &[1, 512, 1]),
            ("Identity:0", &[1, 512, 1]),
            ("Identity_1:0", &[1, 384, 1]),
        ]);
        assert!(e.check(&twice).unwrap_err().contains("2 times"));
        let wrong = answer(&[("Identity:0", &[1, 1, 1]), ("Identity_1:0", &[1, 384, 1])]);
        assert!(e.check(&wrong).unwrap_err().contains("metadata says"));
        // Without metadata, names alone.
        let e = Expectation::new(&opts, None).unwrap();
        assert_eq!(e.check(&wrong), Ok(()));
        assert!(e.check(&missing).is_err());
    }

    #[test]
    fn metadata_that_cannot_fit_the_run_is_refused_before_it_starts() {
        let mut opts = KserveOptions::blazeface("http://127.0.0.1:1");
        opts.output_names = vec!["scores".into()];
        let err = Expectation::new(&opts, Some(&metadata())).unwrap_err();
        assert!(err.contains("--output-names"), "{err}");
        let mut opts = KserveOptions::blazeface("http://127.0.0.1:1");
        opts.input_name = "x".into();
        let err = Expectation::new(&opts, Some(&metadata())).unwrap_err();
        assert!(err.contains("--input-name"), "{err}");
        let mut opts = KserveOptions::blazeface("http://127.0.0.1:1");
        opts.size = (64, 64);
        opts.output_names.clear();
        let err = Expectation::new(&opts, Some(&metadata())).unwrap_err();
        assert!(err.contains("[1, 64, 64, 3]"), "{err}");
        // No outputs named: every output the metadata lists.
        opts.size = (128, 128);
        let e = Expectation::new(&opts, Some(&metadata())).unwrap();
        assert_eq!(e.names, ["Identity:0", "Identity_1:0"]);
    }
}
