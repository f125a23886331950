//! The `tidegate-worker` binary with `[metrics] listen` on 127.0.0.1:0,
//! serving BlazeFace on the CPU to a scripted gateway (a real QUIC
//! connection, a throw-away CA): it prints where its metrics listen, and
//! once it has answered a batch, a scrape over HTTP shows the batch and its
//! frames counted exactly, `gpu="none"` on a machine without an NVIDIA
//! driver, and an exposition that `promtool check metrics` accepts.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use tidegate_protocol::quic::{read_message, server_config, write_message};
use tidegate_protocol::{
    DType, Dispatch, DispatchItem, Geometry, Layout, Limits, Message, Status, Tensor, Welcome,
};
use tidegate_testkit::promtool::promtool;

/// Bounds every wait, so that a broken worker fails the test instead of
/// hanging it; no assertion depends on how fast anything runs.
const BOUND: Duration = Duration::from_secs(120);

/// Frames in the one batch dispatched.
const FRAMES: u64 = 3;

/// Kills the worker when the test ends, however it ends.
struct Worker(Child);

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts the worker against `gateway`, with its metrics on 127.0.0.1:0
/// given by `--metrics-listen`; its stdout lines come on the receiver.
fn start_worker(dir: &Path, gateway: SocketAddr) -> (Worker, mpsc::Receiver<String>) {
    let cfg = dir.join("w.toml");
    let models = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models");
    std::fs::write(
        &cfg,
        format!(
            "name = \"w\"\ntoken = \"t\"\n[gateway]\naddr = \"{gateway}\"\nca = \"ca.pem\"\nserver_name = \"localhost\"\n[models]\ndir = \"{}\"\nonly = [\"blazeface\"]\n[runtime]\nintra_threads = 1\n",
            models.display()
        ),
    )
    .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_tidegate-worker"))
        .arg("--config")
        .arg(&cfg)
        .args(["--metrics-listen", "127.0.0.1:0"])
        .env("TIDEGATE_LOG", "info")
        .env_remove("TIDEGATE_GATEWAY_ADDR")
        .env_remove("TIDEGATE_WORKER_TOKEN")
        .env_remove("TIDEGATE_LEASE_ID")
        .env_remove("TIDEGATE_METRICS_LISTEN")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    (Worker(child), rx)
}

/// The address in the worker's `metrics listening on ADDR` line.
fn metrics_addr(lines: &mpsc::Receiver<String>) -> SocketAddr {
    loop {
        let line = lines
            .recv_timeout(BOUND)
            .expect("the worker never said where its metrics listen");
        if let Some(addr) = line.strip_prefix("metrics listening on ") {
            return addr.parse().expect("a socket address");
        }
    }
}

/// `GET /metrics` over plain HTTP/1.1: the status line and the body.
fn scrape(addr: SocketAddr) -> (String, String) {
    let mut s = TcpStream::connect_timeout(&addr, BOUND).unwrap();
    s.set_read_timeout(Some(BOUND)).unwrap();
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").expect("an HTTP response");
    let status = head.lines().next().unwrap_or_default().to_string();
    // axum sends a body of known length, not chunks
    (status, body.to_string())
}

/// A grey 128×128 RGB frame, BlazeFace's input.
fn frame(id: u64) -> DispatchItem {
    DispatchItem {
        id,
        camera: "cam".into(),
        seq: id,
        geometry: Geometry::stretch(128, 128, 128, 128),
        tensor: Tensor::raw(
            DType::U8,
            Layout::Nhwc,
            vec![1, 128, 128, 3],
            vec![128u8; 128 * 128 * 3].into(),
        ),
    }
}

/// Welcomes the worker, dispatches one batch of [`FRAMES`] frames and
/// returns the statuses of its result; the connection is kept open.
async fn serve_one_batch(endpoint: &quinn::Endpoint) -> (quinn::Connection, Vec<Status>) {
    let limits = Limits::default();
    let conn = endpoint.accept().await.unwrap().await.unwrap();
    let (mut ctl_send, mut ctl_recv) = conn.accept_bi().await.unwrap();
    let hello = read_message(&mut ctl_recv, &limits).await.unwrap();
    assert!(matches!(hello, Some(Message::Hello(_))), "{hello:?}");
    let welcome = Message::Welcome(Welcome {
        session: 1,
        heartbeat_ms: 200,
    });
    write_message(&mut ctl_send, &welcome).await.unwrap();
    let register = read_message(&mut ctl_recv, &limits).await.unwrap();
    let Some(Message::Register(r)) = register else {
        panic!("{register:?}");
    };
    assert_eq!(r.models[0].name, "blazeface");
    let dispatch = Message::Dispatch(Dispatch {
        batch: 1,
        model: "blazeface".into(),
        items: (1..=FRAMES).map(frame).collect(),
    });
    let mut s = conn.open_uni().await.unwrap();
    write_message(&mut s, &dispatch).await.unwrap();
    s.finish().unwrap();
    let mut back = conn.accept_uni().await.unwrap();
    let result = read_message(&mut back, &limits).await.unwrap();
    let Some(Message::BatchResult(result)) = result else {
        panic!("{result:?}");
    };
    // keep the control stream: dropping it would end the link
    std::mem::forget((ctl_send, ctl_recv));
    (conn, result.items.into_iter().map(|i| i.status).collect())
}

/// The value of the series whose line starts with `series ` in `text`.
fn value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_serving_workers_metrics_count_its_batches_and_show_no_gpu_here() {
    let dir = tempfile::tempdir().unwrap();
    let tls = tidegate_protocol::certs::generate(dir.path(), &["localhost".to_string()]).unwrap();
    let server = server_config(&tls.server_cert, &tls.server_key).unwrap();
    let endpoint = quinn::Endpoint::server(server, "127.0.0.1:0".parse().unwrap()).unwrap();
    let (_worker, lines) = start_worker(dir.path(), endpoint.local_addr().unwrap());
    let addr = tokio::task::spawn_blocking(move || metrics_addr(&lines))
        .await
        .unwrap();

    // Before any batch: the model's counters at 0, the device, no GPU.
    let (status, before) = tokio::task::spawn_blocking(move || scrape(addr))
        .await
        .unwrap();
    assert!(status.contains("200"), "{status}");
    assert_eq!(
        value(
            &before,
            "tidegate_worker_batches_total{model=\"blazeface\"}"
        ),
        Some(0.0),
        "{before}"
    );

    let (conn, statuses) = tokio::time::timeout(BOUND, serve_one_batch(&endpoint))
        .await
        .expect("the worker never answered its batch");
    assert_eq!(statuses, vec![Status::Ok; FRAMES as usize]);

    let (_, after) = tokio::task::spawn_blocking(move || scrape(addr))
        .await
        .unwrap();
    let v = |s: &str| value(&after, s);
    assert_eq!(
        v("tidegate_worker_batches_total{model=\"blazeface\"}"),
        Some(1.0),
        "{after}"
    );
    assert_eq!(
        v("tidegate_worker_answered_frames_total{model=\"blazeface\",status=\"ok\"}"),
        Some(FRAMES as f64)
    );
    assert_eq!(
        v("tidegate_worker_answered_frames_total{model=\"blazeface\",status=\"failed\"}"),
        Some(0.0)
    );
    assert_eq!(
        v("tidegate_worker_batch_run_seconds_count{model=\"blazeface\"}"),
        Some(1.0)
    );
    let run = v("tidegate_worker_batch_run_seconds_sum{model=\"blazeface\"}").unwrap();
    let busy = v("tidegate_worker_backend_busy_seconds_total").unwrap();
    assert!(run > 0.0, "a batch that ran took some time: {run}");
    // the stage timers sit inside the backend's own measure of the run
    assert!(run <= busy, "run {run} s, backend busy {busy} s");
    // The backend uncounts a batch just after answering it: the gauge
    // falls back to 0 (bounded in scrapes and time).
    let mut pending = v("tidegate_worker_batches_pending");
    for _ in 0..100 {
        if pending == Some(0.0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        let (_, text) = tokio::task::spawn_blocking(move || scrape(addr))
            .await
            .unwrap();
        pending = value(&text, "tidegate_worker_batches_pending");
    }
    assert_eq!(pending, Some(0.0));
    assert!(
        after.contains("tidegate_worker_build_info{device=\"cpu"),
        "{after}"
    );
    assert!(after.contains("process_resident_memory_bytes"), "{after}");
    if tidegate_worker::metrics::Nvml::init().is_err() {
        // no NVIDIA driver (this machine): one gpu="none" series, no gauges
        assert_eq!(
            v("tidegate_worker_gpu_info{gpu=\"none\",name=\"\"}"),
            Some(1.0),
            "{after}"
        );
        assert!(!after.contains("tidegate_worker_gpu_utilization_ratio{"));
    } else {
        // a GPU machine: GPU 0's memory, as NVML reads it
        let total = v("tidegate_worker_gpu_memory_total_bytes{gpu=\"0\"}");
        assert!(total.is_some_and(|b| b > 0.0), "{after}");
        assert!(!after.contains("{gpu=\"none\""), "{after}");
    }

    let file = dir.path().join("scrape.prom");
    std::fs::write(&file, &after).unwrap();
    let out = Command::new(promtool())
        .args(["check", "metrics"])
        .stdin(std::fs::File::open(&file).unwrap())
        .output()
        .expect("promtool runs");
    assert!(
        out.status.success(),
        "promtool check metrics:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    conn.close(0u32.into(), b"done");
}
