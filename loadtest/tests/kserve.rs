//! `tidegate-loadtest kserve` against real servers on 127.0.0.1: the
//! `tidegate-baseline` binary serving the real BlazeFace model, and a small
//! in-test server that answers 500s, malformed bodies, or never. Every
//! planned frame must land in exactly one bucket, the right one.

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::process::{Child, Stdio};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::Path;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use http_body_util::Full;
use hyper::Request;
use hyper::header::{CONTENT_TYPE, HOST};
use tidegate_loadtest::cluster::{command, workspace_root};
use tidegate_loadtest::kserve::codec::{
    CodecLimits, DataType, HEADER_LENGTH, InferRequest, InferResponse, ModelMetadata, Tensor,
};
use tidegate_loadtest::kserve::pool::{Answer, Pool, Target};
use tidegate_loadtest::kserve::{self, KserveOptions, KserveReport};

/// A `tidegate-baseline` process, killed when dropped.
struct BaselineProcess {
    child: Child,
    addr: SocketAddr,
}

impl BaselineProcess {
    /// Starts the baseline on 127.0.0.1:0 serving models/blazeface with
    /// one session of one thread, and waits (at most 60 s: a debug build
    /// on a busy machine) for its `listening on` line.
    fn start() -> BaselineProcess {
        let mut child = command("tidegate-baseline")
            .expect("the baseline is built (cargo build -p tidegate-loadtest --bins)")
            .args([
                "--port",
                "0",
                "--sessions",
                "1",
                "--threads",
                "1",
                "--model-dir",
            ])
            .arg(workspace_root().join("models/blazeface"))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("tidegate-baseline starts");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut first = String::new();
            let _ = BufReader::new(stdout).read_line(&mut first);
            let _ = tx.send(first);
        });
        let line = rx.recv_timeout(Duration::from_secs(60)).unwrap_or_default();
        let Some(addr) = line.trim().strip_prefix("listening on ") else {
            let _ = child.kill();
            let _ = child.wait();
            let mut log = String::new();
            let _ = child.stderr.take().unwrap().read_to_string(&mut log);
            panic!("tidegate-baseline printed {line:?}, not `listening on ADDR`; its log:\n{log}");
        };
        let addr = addr.parse().expect("an address");
        BaselineProcess { child, addr }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for BaselineProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn astronaut() -> std::path::PathBuf {
    workspace_root().join("models/testdata/astronaut.png")
}

/// Runs `opts` to its end, which is bounded: the last frame's due time
/// plus the budget, the grace and the settling time.
async fn run(opts: &KserveOptions) -> KserveReport {
    tokio::time::timeout(Duration::from_secs(60), kserve::run(opts))
        .await
        .expect("a run ends by its deadlines")
        .unwrap_or_else(|e| panic!("{e}"))
}

/// The accounting every finished report must satisfy.
fn assert_exact(r: &KserveReport) {
    assert_eq!(
        r.accounted(),
        r.planned,
        "every frame in one bucket: {r:#?}"
    );
    assert_eq!(r.missing, 0, "{r:#?}");
    assert_eq!(r.ok, r.ok_within_budget + r.late, "{r:#?}");
    assert_eq!(r.http_status.values().sum::<u64>(), r.http_errors, "{r:#?}");
    assert_eq!(r.outcomes.values().sum::<u64>(), r.planned, "{r:#?}");
    assert!(r.peak_connections <= r.max_connections, "{r:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_run_against_the_baseline_accounts_for_every_frame() {
    let baseline = BaselineProcess::start();
    let opts = KserveOptions {
        cameras: 2,
        fps: 5.0,
        duration: Duration::from_secs(2),
        image: Some(astronaut()),
        ..KserveOptions::blazeface(&baseline.url())
    };
    let r = run(&opts).await;
    assert_exact(&r);
    assert_eq!(r.planned, 20);
    assert!(r.ok > 0, "{r:#?}");
    // A healthy server under a light load: nothing refused, garbled or
    // dropped (how fast it answered is not asserted).
    assert_eq!(
        (
            r.http_errors,
            r.malformed,
            r.transport_errors,
            r.no_connection
        ),
        (0, 0, 0, 0),
        "{r:#?}"
    );
    assert_eq!(r.system, "tidegate-baseline");
    assert!(r.checked_against_metadata, "{r:#?}");
    assert!(r.bytes_per_frame as usize > 128 * 128 * 3, "{r:#?}");
    assert!(r.client_cpu_s >= 0.0, "{r:#?}");
}

/// `POST path` with `body`, `header_len` as the header length (`None`:
/// no header), on `pool`.
async fn post_raw(pool: &Arc<Pool>, path: &str, body: Bytes, header_len: Option<String>) -> Answer {
    let make = || {
        let mut req = Request::post(path)
            .header(HOST, pool.target().authority.as_str())
            .header(CONTENT_TYPE, "application/octet-stream");
        if let Some(n) = &header_len {
            req = req.header(HEADER_LENGTH, n.as_str());
        }
        req.body(Full::new(body.clone())).unwrap()
    };
    tokio::time::timeout(Duration::from_secs(30), pool.exchange(make, 1 << 24))
        .await
        .expect("an answer within 30 s")
        .expect("an answer")
}

fn frame_request(shape: &[u64]) -> InferRequest {
    let len = shape.iter().product::<u64>() as usize;
    let img = image::open(astronaut()).unwrap().to_rgb8();
    let small = image::imageops::resize(&img, 128, 128, image::imageops::FilterType::Triangle);
    let mut data = small.into_raw();
    data.resize(len, 0);
    InferRequest {
        id: Some("face".into()),
        inputs: vec![Tensor {
            name: "input:0".into(),
            datatype: DataType::Uint8,
            shape: shape.to_vec(),
            data: Bytes::from(data),
        }],
        outputs: Vec::new(),
    }
}

fn error_text(a: &Answer) -> String {
    let json: serde_json::Value = serde_json::from_slice(&a.body)
        .unwrap_or_else(|e| panic!("a JSON error ({e}): {:?}", String::from_utf8_lossy(&a.body)));
    json["error"].as_str().expect("an error field").to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_baseline_finds_the_face_and_refuses_bad_requests_saying_what_is_wrong() {
    let baseline = BaselineProcess::start();
    let pool = Pool::new(Target::resolve(&baseline.url()).await.unwrap(), 4);
    let infer = "/v2/models/blazeface/infer";

    // The astronaut frame, every output in binary: BlazeFace's four, and
    // an anchor scoring above the model's 0.75 threshold (the face), which
    // only the worker's [-1, 1] normalisation gives.
    let e = frame_request(&[1, 128, 128, 3]).encode();
    let a = post_raw(&pool, infer, e.body, Some(e.header_len.to_string())).await;
    assert_eq!(
        a.status,
        StatusCode::OK,
        "{:?}",
        String::from_utf8_lossy(&a.body)
    );
    let header_len = a.headers[HEADER_LENGTH].to_str().unwrap().parse().unwrap();
    let r = InferResponse::decode(&a.body, Some(header_len), &CodecLimits::default()).unwrap();
    assert_eq!(r.id.as_deref(), Some("face"));
    let shapes: Vec<(&str, &[u64])> = r
        .outputs
        .iter()
        .map(|t| (t.name.as_str(), &t.shape[..]))
        .collect();
    assert_eq!(
        shapes,
        [
            ("Identity:0", &[1, 512, 1][..]),
            ("Identity_1:0", &[1, 384, 1][..]),
            ("Identity_2:0", &[1, 512, 16][..]),
            ("Identity_3:0", &[1, 384, 16][..]),
        ]
    );
    let best = r.outputs[..2]
        .iter()
        .flat_map(|t| t.data.chunks_exact(4))
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .fold(f32::NEG_INFINITY, f32::max);
    let score = 1.0 / (1.0 + (-best).exp());
    assert!(score > 0.75, "best face score {score}");

    // Unknown model: 404, naming what is served.
    let e = frame_request(&[1, 128, 128, 3]).encode();
    let a = post_raw(
        &pool,
        "/v2/models/yolo/infer",
        e.body.clone(),
        Some(e.header_len.to_string()),
    )
    .await;
    assert_eq!(a.status, StatusCode::NOT_FOUND);
    assert!(
        error_text(&a).contains("serves 'blazeface'"),
        "{}",
        error_text(&a)
    );

    // A header length that is not a number, or past the body's end.
    let a = post_raw(&pool, infer, e.body.clone(), Some("abc".into())).await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    assert!(
        error_text(&a).contains("Inference-Header-Content-Length"),
        "{}",
        error_text(&a)
    );
    let a = post_raw(
        &pool,
        infer,
        e.body.slice(..e.header_len - 1),
        Some(e.header_len.to_string()),
    )
    .await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    assert!(error_text(&a).contains("truncated"), "{}", error_text(&a));

    // The wrong frame size, and an output the model does not have.
    let e = frame_request(&[1, 64, 64, 3]).encode();
    let a = post_raw(&pool, infer, e.body, Some(e.header_len.to_string())).await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    assert!(
        error_text(&a).contains("UINT8 [1, 128, 128, 3]"),
        "{}",
        error_text(&a)
    );
    let mut req = frame_request(&[1, 128, 128, 3]);
    req.outputs = vec!["scores".into()];
    let e = req.encode();
    let a = post_raw(&pool, infer, e.body, Some(e.header_len.to_string())).await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    assert!(
        error_text(&a).contains("no output \"scores\""),
        "{}",
        error_text(&a)
    );

    // What Triton clients ask before they infer.
    let get = |path: &'static str| {
        let pool = pool.clone();
        async move {
            let make = || {
                Request::get(path)
                    .header(HOST, "x")
                    .body(Full::new(Bytes::new()))
                    .unwrap()
            };
            pool.exchange(make, 1 << 20).await.unwrap()
        }
    };
    assert_eq!(get("/v2/health/ready").await.status, StatusCode::OK);
    let m = get("/v2/models/blazeface").await;
    assert_eq!(m.status, StatusCode::OK);
    let m: ModelMetadata = serde_json::from_slice(&m.body).unwrap();
    assert_eq!(m.inputs[0].shape, [1, 128, 128, 3]);
    assert_eq!(m.outputs.len(), 4);
    assert_eq!(get("/v2/models/yolo").await.status, StatusCode::NOT_FOUND);
    pool.close(Duration::from_secs(5)).await;
}

/// A server of misbehaving models: `fail` answers 500, `garbled` 200 with
/// a body that is not KServe, `partial` 200 without the output asked for,
/// `silent` never.
async fn misbehaving_server() -> (SocketAddr, tokio::task::JoinHandle<()>) {
    async fn infer(Path(model): Path<String>) -> Response {
        match model.as_str() {
            "fail" => (StatusCode::INTERNAL_SERVER_ERROR, "{\"error\":\"boom\"}").into_response(),
            "garbled" => {
                let mut r = Bytes::from_static(b"\x00\x01 not json").into_response();
                r.headers_mut()
                    .insert(HEADER_LENGTH, HeaderValue::from_static("5"));
                r
            }
            "partial" => {
                let e = InferResponse {
                    model_name: model,
                    model_version: None,
                    id: None,
                    outputs: vec![Tensor {
                        name: "other".into(),
                        datatype: DataType::Fp32,
                        shape: vec![1],
                        data: Bytes::from_static(&[0; 4]),
                    }],
                }
                .encode();
                let mut r = e.body.into_response();
                r.headers_mut()
                    .insert(HEADER_LENGTH, HeaderValue::from(e.header_len));
                r
            }
            _ => std::future::pending().await,
        }
    }
    let app = Router::new().route("/v2/models/{model}/infer", post(infer));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let serving = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (addr, serving)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_silence_and_refusals_are_each_counted_in_their_own_bucket_and_none_is_lost() {
    let (addr, serving) = misbehaving_server().await;
    // 5 frames a run; a grace long enough that an answer on a busy
    // machine is never mistaken for silence.
    let opts = |model: &str, url: String| KserveOptions {
        model: model.into(),
        system: Some("misbehaving".into()),
        fps: 5.0,
        duration: Duration::from_secs(1),
        grace: Duration::from_secs(2),
        output_names: vec!["Identity:0".into()],
        ..KserveOptions::blazeface(&url)
    };
    let url = format!("http://{addr}");

    let r = run(&opts("fail", url.clone())).await;
    assert_exact(&r);
    assert_eq!(
        (r.planned, r.http_errors, r.http_status.get(&500)),
        (5, 5, Some(&5)),
        "{r:#?}"
    );

    let r = run(&opts("garbled", url.clone())).await;
    assert_exact(&r);
    assert_eq!((r.malformed, r.ok), (5, 0), "{r:#?}");
    assert!(
        r.first_errors["malformed"].contains("JSON header"),
        "{r:#?}"
    );

    let r = run(&opts("partial", url.clone())).await;
    assert_exact(&r);
    assert_eq!((r.malformed, r.ok), (5, 0), "{r:#?}");
    assert!(
        r.first_errors["malformed"].contains("\"Identity:0\" is missing"),
        "{r:#?}"
    );

    // Silence: each frame is given up at its budget plus the grace.
    let r = run(&KserveOptions {
        grace: Duration::from_millis(300),
        ..opts("silent", url.clone())
    })
    .await;
    assert_exact(&r);
    assert_eq!((r.timed_out, r.ok), (5, 0), "{r:#?}");

    // Three frames at once on two connections to a silent model: two wait
    // out their grace, the third finds no connection and is not queued.
    let r = run(&KserveOptions {
        cameras: 3,
        fps: 1.0,
        in_step: true,
        max_connections: 2,
        ..opts("silent", url.clone())
    })
    .await;
    assert_exact(&r);
    assert_eq!(
        (r.planned, r.timed_out, r.no_connection),
        (3, 2, 1),
        "{r:#?}"
    );
    assert_eq!(r.sent, 2, "{r:#?}");
    serving.abort();

    // Nothing listening: every frame a transport error.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let r = run(&opts("fail", format!("http://{closed}"))).await;
    assert_exact(&r);
    assert_eq!(r.transport_errors, 5, "{r:#?}");
    assert!(r.first_errors["transport"].contains("connecting"), "{r:#?}");
}
