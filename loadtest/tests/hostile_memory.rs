//! Hostile peers against a real gateway process on 127.0.0.1, each bounded
//! by a `[limits]` key, with a legitimate edge's cameras served beside the
//! memory attacks:
//!
//! - partly sent frames take no more than the edge's budget for them, the
//!   frames past it are refused, and the memory comes back afterwards;
//! - a frame trickled in is reset once its read timeout has passed;
//! - connections that never log in can open no stream to push into, and
//!   only so many are let in at once;
//! - one edge name gets only so many connections, and only so many
//!   cameras over all of them.
//!
//! Memory is the gateway's resident set (`VmRSS`); the bounds are the
//! configured budgets plus fixed slack, never a speed. Every attack is
//! bounded in streams, bytes and time.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tidegate_loadtest::cluster::{Cluster, ClusterOptions};
use tidegate_loadtest::report::Report;
use tidegate_loadtest::sim;
use tidegate_protocol::quic::{
    BEFORE_LOGIN_RECEIVE_WINDOW, HandshakeError, RECEIVE_WINDOW, client_config, dial, handshake,
    read_answer, write_message,
};
use tidegate_protocol::{
    CameraOpen, Encoding, ErrorCode, Header, Hello, Kind, Limits, Message, Role,
};

const MIB: u64 = 1024 * 1024;

/// The tests here load the machine on purpose and measure one process's
/// memory: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Bounds each test's async part: far above what it needs on a loaded
/// machine, far below the harness's patience.
const WAIT: Duration = Duration::from_secs(45);

/// Allocator slack on top of a bound: QUIC's per-connection state, packet
/// buffers, the allocator's own caches.
const SLACK: u64 = 48 * MIB;

/// A gateway with edges `edge-1` (the legitimate one) and `edge-hostile`,
/// `[limits]` lines `limits`, and worker `worker-1` serving BlazeFace.
fn cluster(limits: &str) -> Cluster {
    let mut c = Cluster::start(&ClusterOptions {
        edges: vec!["edge-1".into(), "edge-hostile".into(), "edge-2".into()],
        limits: limits.into(),
        ..ClusterOptions::default()
    })
    .expect("gateway starts");
    c.spawn_worker("worker-1").expect("worker starts");
    c.wait_for_workers(1, Duration::from_secs(60))
        .expect("worker registers");
    c
}

/// The gateway's resident set (bytes), from /proc.
fn rss(c: &Cluster) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", c.gateway_pid()))
        .expect("the gateway's /proc status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS in /proc/<pid>/status");
    kib * 1024
}

/// Samples the gateway's resident set every 20 ms on a thread of its own
/// until dropped; [`Peak::max`] is the highest seen.
struct Peak {
    max: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Peak {
    fn watch(c: &Cluster) -> Peak {
        let path = format!("/proc/{}/status", c.gateway_pid());
        let max = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (max, stop) = (max.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let kib = std::fs::read_to_string(&path).ok().and_then(|s| {
                        s.lines()
                            .find_map(|l| l.strip_prefix("VmRSS:"))
                            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
                    });
                    if let Some(kib) = kib {
                        max.fetch_max(kib * 1024, Ordering::Relaxed);
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            })
        };
        Peak {
            max,
            stop,
            thread: Some(thread),
        }
    }

    fn max(&self) -> u64 {
        self.max.load(Ordering::Relaxed)
    }
}

impl Drop for Peak {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The legitimate edge: 4 cameras × 10 fps for `seconds`, on a thread.
fn legitimate_load(c: &Cluster, seconds: f64) -> std::thread::JoinHandle<Report> {
    let opts = c.sim_options("edge-1", 4, 10.0, seconds);
    std::thread::spawn(move || sim::run_blocking(&opts).expect("the legitimate load runs"))
}

/// Every frame of the legitimate edge got one result (or was reset by its
/// own lane at the end of its budget, or refused): none missing, none
/// twice, none lost with its connection.
fn assert_served(r: &Report) {
    assert!(r.sent > 0, "the legitimate edge sent nothing: {r:?}");
    assert_eq!(r.missing, 0, "frames without a result: {r:?}");
    assert_eq!(r.duplicates, 0, "frames with two results: {r:?}");
    assert_eq!(r.lost_with_connection, 0, "its connection was lost: {r:?}");
    assert_eq!(
        r.results() + r.reset + r.refused + r.lost_with_connection,
        r.sent,
        "{r:?}"
    );
}

/// `tidegate_frames_rejected_total{reason="<reason>"}` now.
fn rejected(c: &Cluster, reason: &str) -> u64 {
    counter(
        c,
        &format!("tidegate_frames_rejected_total{{reason=\"{reason}\"}}"),
    )
}

/// A counter's value in `/metrics` (0 when absent).
fn counter(c: &Cluster, series: &str) -> u64 {
    let (_, text) = c.get("/metrics").expect("GET /metrics");
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

/// Logs in as edge `name`: the connection and its control stream.
async fn login(
    c: &Cluster,
    name: &str,
) -> Result<(quinn::Connection, quinn::SendStream, quinn::RecvStream), HandshakeError> {
    login_with(c, name, client_config(&c.ca()).unwrap()).await
}

/// [`login`] for an attacker that buffers as much as it likes: its own
/// send window never holds it back, only the gateway's flow control.
async fn login_greedy(
    c: &Cluster,
    name: &str,
) -> Result<(quinn::Connection, quinn::SendStream, quinn::RecvStream), HandshakeError> {
    let mut cfg = client_config(&c.ca()).unwrap();
    let mut t = quinn::TransportConfig::default();
    t.send_window(4 << 30);
    cfg.transport_config(Arc::new(t));
    login_with(c, name, cfg).await
}

async fn login_with(
    c: &Cluster,
    name: &str,
    cfg: quinn::ClientConfig,
) -> Result<(quinn::Connection, quinn::SendStream, quinn::RecvStream), HandshakeError> {
    let conn = dial(c.quic, "localhost", cfg).await.expect("dial");
    let hello = Hello {
        role: Role::Edge,
        name: name.into(),
        token: c.edge_token.clone(),
    };
    let (send, recv, _) = handshake(&conn, hello, &Limits::default()).await?;
    Ok((conn, send, recv))
}

/// Opens a frame stream declaring a `declared`-byte body and sends the
/// header and `sent` bytes of it, never finishing it; returns when the
/// stream fails (stopped by the gateway) or its connection closes.
///
/// The attacker's own view of a stop is not reliable: quinn reports a
/// write blocked on connection flow control as blocked before it looks at
/// whether the stream was stopped. The gateway's counters are what the
/// test reads.
async fn partial_frame(conn: quinn::Connection, declared: usize, sent: usize) {
    let Ok(mut s) = conn.open_uni().await else {
        return;
    };
    let mut head = Vec::new();
    Header {
        kind: Kind::Frame,
        len: declared,
    }
    .encode(&mut head);
    if s.write_all(&head).await.is_err() {
        return;
    }
    let chunk = vec![0u8; MIB as usize];
    let mut left = sent;
    while left > 0 {
        let n = left.min(chunk.len());
        if s.write_all(&chunk[..n]).await.is_err() {
            return;
        }
        left -= n;
    }
    // Held open: dropping it would finish it.
    conn.closed().await;
}

/// 32 streams of 40 MiB, never finished, from one logged-in edge: the
/// first frame takes 40 MiB of the edge's 48 MiB budget, the others are
/// refused from their headers (`memory_budget`), and one that fitted is
/// reset when its read timeout passes (`read_timeout`). The gateway's
/// memory stays within its baseline plus the edge's budget and one
/// connection's QUIC receive window, gives the memory back once the attack
/// is over (within twice its baseline), and serves the legitimate edge's
/// cameras throughout.
#[test]
fn partly_sent_frames_hold_no_more_than_the_edges_budget_and_are_reset() {
    let _serial = serial();
    let edge_budget = 48 * MIB;
    let c = cluster(&format!(
        "edge_inflight_bytes = {edge_budget}\ninflight_bytes_total = {}\nframe_read_timeout_ms = 3000\n",
        2 * edge_budget
    ));
    let load = legitimate_load(&c, 8.0);
    std::thread::sleep(Duration::from_millis(1500));
    let baseline = rss(&c);
    let peak = Peak::watch(&c);
    let rt = runtime();
    let conn = rt.block_on(async {
        let (conn, send, recv) = tokio::time::timeout(WAIT, login_greedy(&c, "edge-hostile"))
            .await
            .expect("in time")
            .expect("welcome");
        for _ in 0..32 {
            tokio::spawn(partial_frame(
                conn.clone(),
                40 * MIB as usize,
                40 * MIB as usize - 1,
            ));
        }
        // The control stream stays open with the connection.
        tokio::spawn(async move {
            let _control = (send, recv);
            std::future::pending::<()>().await
        });
        conn
    });
    // Until the gateway has refused or reset every stream.
    let until = Instant::now() + WAIT;
    let (mut budget, mut timeout) = (0, 0);
    while budget + timeout < 32 && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(200));
        (budget, timeout) = (rejected(&c, "memory_budget"), rejected(&c, "read_timeout"));
    }
    conn.close(0u32.into(), b"attack over");
    drop(rt);
    let peak_rss = peak.max();
    drop(peak);
    let report = load.join().expect("the legitimate load's thread");
    eprintln!(
        "baseline {} MiB, peak {} MiB during the attack; {budget} refused, {timeout} timed out",
        baseline / MIB,
        peak_rss / MIB
    );
    // One frame fits the budget at a time: the others are refused from
    // their headers, and each one that fitted is reset at its timeout.
    assert_eq!(
        budget + timeout,
        32,
        "{budget} refused, {timeout} timed out"
    );
    assert!(
        timeout >= 1 && budget >= 24,
        "{budget} refused, {timeout} timed out"
    );
    let bound = baseline + edge_budget + u64::from(RECEIVE_WINDOW) + SLACK;
    assert!(
        peak_rss <= bound,
        "peak {} MiB over baseline {} MiB + budget {} MiB + window {} MiB + slack {} MiB",
        peak_rss / MIB,
        baseline / MIB,
        edge_budget / MIB,
        RECEIVE_WINDOW as u64 / MIB,
        SLACK / MIB
    );
    assert_served(&report);
    // Given back: within twice the baseline, polled for at most 30 s.
    let until = Instant::now() + Duration::from_secs(30);
    let mut after = rss(&c);
    while after > 2 * baseline && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(250));
        after = rss(&c);
    }
    eprintln!("{} MiB after the attack", after / MIB);
    assert!(
        after <= 2 * baseline,
        "{} MiB after the attack, baseline {} MiB",
        after / MIB,
        baseline / MIB
    );
}

/// A frame sent a byte at a time is reset once `frame_read_timeout_ms`
/// has passed since its stream was accepted, and counted; the gateway does
/// not wait for the QUIC idle timeout, which the trickle keeps from firing.
#[test]
fn a_trickling_frame_stream_is_reset_after_its_read_timeout() {
    let _serial = serial();
    let c = cluster("frame_read_timeout_ms = 1000\n");
    let rt = runtime();
    let stopped = rt.block_on(async {
        let (conn, _send, _recv) = login(&c, "edge-hostile").await.expect("welcome");
        let mut s = conn.open_uni().await.expect("a frame stream opens");
        let mut head = Vec::new();
        Header {
            kind: Kind::Frame,
            len: MIB as usize,
        }
        .encode(&mut head);
        s.write_all(&head).await.expect("header");
        // One byte every 100 ms, until the gateway stops the stream or
        // `WAIT` passes.
        let trickle = async {
            for _ in 0..(WAIT.as_millis() / 100) {
                if s.write_all(&[0]).await.is_err() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        };
        trickle.await;
        tokio::time::timeout(Duration::from_secs(5), s.stopped()).await
    });
    match stopped {
        Ok(Ok(Some(code))) => assert_eq!(
            u32::try_from(code.into_inner()).ok(),
            Some(ErrorCode::Overloaded.quic_code())
        ),
        other => panic!("the trickling stream was not stopped: {other:?}"),
    }
    assert_eq!(rejected(&c, "read_timeout"), 1);
}

/// Ten connections that never log in: they can open no unidirectional
/// stream (no credit before `Hello`), only `max_unauthenticated` = 4 of
/// them are let in at all (the other six refused as they arrive, and
/// counted), the four are closed at their Hello timeout, and the gateway's
/// memory stays within its baseline plus their small pre-login windows. The
/// legitimate edge, logged in before, is served throughout, and a new edge
/// logs in once the four are gone.
#[test]
fn connections_that_never_log_in_can_push_nothing_and_only_so_many_are_let_in() {
    let _serial = serial();
    let c = cluster("max_unauthenticated = 4\nhello_timeout_ms = 4000\n");
    let load = legitimate_load(&c, 8.0);
    std::thread::sleep(Duration::from_millis(1500));
    let baseline = rss(&c);
    let peak = Peak::watch(&c);
    let rt = runtime();
    let (connected, refused, pushed) = rt.block_on(async {
        tokio::time::timeout(WAIT, async {
            let attempts: Vec<_> = (0..10)
                .map(|_| {
                    let (addr, cfg) = (c.quic, client_config(&c.ca()).unwrap());
                    tokio::spawn(async move { stranger(addr, cfg).await })
                })
                .collect();
            let (mut connected, mut refused, mut pushed) = (0, 0, 0);
            for a in attempts {
                match a.await.expect("stranger task") {
                    Stranger::Refused => refused += 1,
                    Stranger::Closed { pushed: p } => {
                        connected += 1;
                        pushed += p;
                    }
                }
            }
            (connected, refused, pushed)
        })
        .await
        .expect("the strangers end in time")
    });
    let peak_rss = peak.max();
    drop(peak);
    eprintln!(
        "baseline {} MiB, peak {} MiB; {connected} let in, {refused} refused",
        baseline / MIB,
        peak_rss / MIB
    );
    assert_eq!((connected, refused), (4, 6));
    assert_eq!(pushed, 0, "no stranger opened a unidirectional stream");
    assert_eq!(
        counter(
            &c,
            "tidegate_quic_connections_refused_total{reason=\"unauthenticated\"}"
        ),
        6
    );
    let bound = baseline + 10 * u64::from(BEFORE_LOGIN_RECEIVE_WINDOW) + SLACK / 4;
    assert!(
        peak_rss <= bound,
        "peak {} MiB over baseline {} MiB + 12 MiB",
        peak_rss / MIB,
        baseline / MIB
    );
    // The strangers have gone: an edge logs in again.
    rt.block_on(async {
        let (conn, _, _) = tokio::time::timeout(WAIT, login(&c, "edge-2"))
            .await
            .expect("in time")
            .expect("welcome once the strangers are gone");
        conn.close(0u32.into(), b"done");
    });
    assert_served(&load.join().expect("the legitimate load's thread"));
}

/// How a connection that never logs in fared.
#[derive(Debug)]
enum Stranger {
    /// Refused as it arrived (QUIC `CONNECTION_REFUSED`).
    Refused,
    /// Let in, then closed by the gateway; `pushed` is 1 if it could open
    /// a unidirectional stream at all.
    Closed { pushed: u32 },
}

/// Connects without logging in, tries to open a unidirectional stream (to
/// push 64 MiB into), and waits for the gateway to close the connection.
async fn stranger(addr: std::net::SocketAddr, cfg: quinn::ClientConfig) -> Stranger {
    let mut endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    endpoint.set_default_client_config(cfg);
    let conn = match endpoint.connect(addr, "localhost").unwrap().await {
        Ok(conn) => conn,
        Err(quinn::ConnectionError::ConnectionClosed(close))
            if close.error_code == quinn::TransportErrorCode::CONNECTION_REFUSED =>
        {
            return Stranger::Refused;
        }
        Err(e) => panic!("a stranger's connection failed otherwise: {e}"),
    };
    let push = async {
        let mut s = conn.open_uni().await.ok()?;
        let chunk = vec![0u8; MIB as usize];
        for _ in 0..64 {
            s.write_all(&chunk).await.ok()?;
        }
        Some(())
    };
    let pushed = tokio::select! {
        p = push => u32::from(p.is_some()),
        _ = conn.closed() => 0,
    };
    conn.closed().await;
    Stranger::Closed { pushed }
}

/// `max_connections_per_edge` = 2: an edge's third connection is refused
/// at login with a reason that names the limit, another edge is not, and
/// once one of the two has gone the edge logs in again.
#[test]
fn an_edge_past_its_connections_is_refused_with_the_limit_named() {
    let _serial = serial();
    let c = cluster("max_connections_per_edge = 2\n");
    let rt = runtime();
    rt.block_on(async {
        tokio::time::timeout(WAIT, async {
            let (first, _s1, _r1) = login(&c, "edge-hostile").await.expect("first");
            let (_second, _s2, _r2) = login(&c, "edge-hostile").await.expect("second");
            match login(&c, "edge-hostile").await {
                Err(HandshakeError::Refused { code, message }) => {
                    assert_eq!(code, ErrorCode::Overloaded, "{message}");
                    assert!(message.contains("max_connections_per_edge"), "{message}");
                    assert!(message.contains("edge-hostile"), "{message}");
                }
                other => panic!("a third connection: {:?}", other.map(|_| "welcome")),
            }
            let (_other, _s, _r) = login(&c, "edge-2").await.expect("another edge");
            first.close(0u32.into(), b"making room");
            // The gateway sees the close within a round trip; poll.
            let until = Instant::now() + Duration::from_secs(10);
            loop {
                match login(&c, "edge-hostile").await {
                    Ok(_) => break,
                    Err(e) if Instant::now() < until => {
                        let _ = e;
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    Err(e) => panic!("no room after a connection closed: {e}"),
                }
            }
        })
        .await
        .expect("in time")
    });
    let refused = counter(
        &c,
        "tidegate_quic_connections_refused_total{reason=\"edge_connections\"}",
    );
    assert!(refused >= 1, "{refused} counted");
}

/// `max_cameras_per_edge` = 3 over two connections of one edge: the
/// fourth distinct camera is refused (naming the camera and the limit), a
/// camera open on the other connection is no new camera, and the cameras
/// of a connection that ends are counted out.
#[test]
fn an_edges_cameras_are_capped_over_all_its_connections() {
    let _serial = serial();
    let c = cluster("max_cameras_per_edge = 3\n");
    let rt = runtime();
    rt.block_on(async {
        tokio::time::timeout(WAIT, async {
            let limits = Limits::default();
            let (a, mut a_send, mut a_recv) = login(&c, "edge-hostile").await.expect("a");
            let (_b, mut b_send, mut b_recv) = login(&c, "edge-hostile").await.expect("b");
            let open = |camera: &str| {
                Message::CameraOpen(CameraOpen {
                    camera: camera.into(),
                    model: "blazeface".into(),
                    budget_ms: 80,
                    encoding: Encoding::Raw,
                    copies: 1,
                })
            };
            let ask =
                async |send: &mut quinn::SendStream, recv: &mut quinn::RecvStream, camera: &str| {
                    write_message(send, &open(camera)).await.unwrap();
                    read_answer(recv, &limits).await.unwrap().unwrap()
                };
            for cam in ["cam-0", "cam-1"] {
                let m = ask(&mut a_send, &mut a_recv, cam).await;
                assert!(matches!(m, Message::CameraAccepted(_)), "{cam}: {m:?}");
            }
            let m = ask(&mut b_send, &mut b_recv, "cam-2").await;
            assert!(matches!(m, Message::CameraAccepted(_)), "cam-2: {m:?}");
            match ask(&mut b_send, &mut b_recv, "cam-3").await {
                Message::Error(e) => {
                    assert_eq!(e.code, ErrorCode::Overloaded, "{e:?}");
                    assert!(e.message.contains("cam-3"), "{e:?}");
                    assert!(e.message.contains("max_cameras_per_edge"), "{e:?}");
                }
                other => panic!("a fourth camera: {other:?}"),
            }
            let m = ask(&mut b_send, &mut b_recv, "cam-0").await;
            assert!(
                matches!(m, Message::CameraAccepted(_)),
                "cam-0 again: {m:?}"
            );
            // a's cameras go with it (cam-1; cam-0 stays open on b).
            a.close(0u32.into(), b"making room");
            let until = Instant::now() + Duration::from_secs(10);
            loop {
                match ask(&mut b_send, &mut b_recv, "cam-3").await {
                    Message::CameraAccepted(_) => break,
                    Message::Error(e) if Instant::now() < until => {
                        let _ = e;
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    other => panic!("cam-3 after a closed: {other:?}"),
                }
            }
        })
        .await
        .expect("in time")
    });
}
