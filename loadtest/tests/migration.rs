//! QUIC connection migration through real processes on 127.0.0.1: an edge
//! behind a NAT whose mapping changes mid-stream (the edge's packets reach
//! the gateway from a new address and port, as when a home router or a
//! mobile carrier rebinds) keeps its one connection and its cameras, and
//! every frame it sends, before, during and after the change, gets exactly
//! one result. A TCP-based inference server would see its connection break
//! and the edge reconnect and reopen its cameras.
//!
//! The NAT is a UDP relay in this test: the edge dials it, and it forwards
//! to the gateway from an upstream socket that it swaps for a new one once
//! frames flow. Bounded in frames and time; nothing asserts on speed.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tidegate_testkit::astronaut::started_cluster;
use tokio::net::UdpSocket;
use tokio::sync::watch;

/// What the relay saw on each upstream socket.
#[derive(Debug, Default)]
struct Mapping {
    /// Datagrams from the edge sent on to the gateway through it.
    up: AtomicU64,
    /// Datagrams from the gateway received on it.
    down: AtomicU64,
}

/// A UDP relay standing in for a NAT: datagrams from the edge go to
/// `gateway` from the current upstream socket, and answers on any upstream
/// socket go back to the edge. Each message on `rebind` replaces the
/// upstream socket with a new one (a new source port). Returns the address
/// the edge dials and each mapping's counters, in order.
async fn nat(
    gateway: SocketAddr,
    mut rebind: watch::Receiver<u32>,
) -> (SocketAddr, Arc<std::sync::Mutex<Vec<Arc<Mapping>>>>) {
    let front = Arc::new(UdpSocket::bind("127.0.0.1:0").await.unwrap());
    let addr = front.local_addr().unwrap();
    let mappings: Arc<std::sync::Mutex<Vec<Arc<Mapping>>>> = Arc::default();
    let seen = mappings.clone();
    tokio::spawn(async move {
        let mut edge: Option<SocketAddr> = None;
        let (answers_tx, mut answers) = tokio::sync::mpsc::channel::<Vec<u8>>(1024);
        // One upstream socket: a task relays what the gateway sends on it.
        let open = |answers_tx: tokio::sync::mpsc::Sender<Vec<u8>>| {
            let seen = seen.clone();
            async move {
                let socket = Arc::new(UdpSocket::bind("127.0.0.1:0").await.unwrap());
                let mapping = Arc::new(Mapping::default());
                seen.lock().unwrap().push(mapping.clone());
                let (s, m) = (socket.clone(), mapping.clone());
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 65_536];
                    while let Ok(n) = s.recv(&mut buf).await {
                        m.down.fetch_add(1, Ordering::Relaxed);
                        if answers_tx.send(buf[..n].to_vec()).await.is_err() {
                            return;
                        }
                    }
                });
                socket.connect(gateway).await.unwrap();
                (socket, mapping)
            }
        };
        let (mut upstream, mut mapping) = open(answers_tx.clone()).await;
        let mut buf = vec![0u8; 65_536];
        loop {
            tokio::select! {
                got = front.recv_from(&mut buf) => {
                    let Ok((n, from)) = got else { return };
                    edge = Some(from);
                    if upstream.send(&buf[..n]).await.is_ok() {
                        mapping.up.fetch_add(1, Ordering::Relaxed);
                    }
                }
                Some(answer) = answers.recv() => {
                    if let Some(to) = edge {
                        let _ = front.send_to(&answer, to).await;
                    }
                }
                changed = rebind.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    (upstream, mapping) = open(answers_tx.clone()).await;
                }
            }
        }
    });
    (addr, mappings)
}

/// Frames the gateway has admitted so far.
fn admitted(c: &tidegate_loadtest::cluster::Cluster) -> u64 {
    let (code, body) = c.get("/api/v1/frames").expect("GET /api/v1/frames");
    assert_eq!(code, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    v["admitted"]
        .as_u64()
        .unwrap_or_else(|| panic!("no admitted count in {v}"))
}

/// Polls `check` every 100 ms until it holds, or panics after `timeout`.
fn eventually(timeout: Duration, what: &str, mut check: impl FnMut() -> bool) {
    let until = Instant::now() + timeout;
    while !check() {
        assert!(Instant::now() < until, "{what}: not within {timeout:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn an_edge_whose_nat_rebinds_keeps_its_connection_and_every_frame_gets_one_result() {
    let c = started_cluster();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (rebind, rebinds) = watch::channel(0u32);
    let (front, mappings) = rt.block_on(nat(c.quic, rebinds));
    // 2 cameras × 10 fps for 12 s: sending outlasts the rebind by far,
    // however slowly the machine starts.
    let mut opts = c.load_options("edge-1", 2, 10.0, 12.0);
    opts.gateway = front.into();
    let sim = rt.spawn(async move { tidegate_loadtest::loadgen::run(&opts).await });
    // Once frames flow, the NAT maps the edge to a new port.
    eventually(
        Duration::from_secs(30),
        "frames admitted before the rebind",
        || admitted(&c) >= 10,
    );
    assert!(
        !sim.is_finished(),
        "the cameras stopped sending before the rebind; the run proves nothing"
    );
    rebind.send(1).unwrap();
    let admitted_at_rebind = admitted(&c);
    let report = rt
        .block_on(async { tokio::time::timeout(Duration::from_secs(120), sim).await })
        .expect("the simulation ends")
        .expect("the simulation task")
        .expect("the simulation runs without reconnecting");

    // Every frame sent got exactly one result, on one connection.
    assert!(report.sent > 0, "{report:?}");
    assert_eq!(report.send_errors, 0, "{report:?}");
    assert_eq!(
        report.reconnects, 0,
        "one connection throughout: {report:?}"
    );
    assert_eq!(report.missing, 0, "{report:?}");
    assert_eq!(report.duplicates, 0, "{report:?}");
    assert_eq!(report.lost_with_connection, 0, "{report:?}");
    assert_eq!(
        report.results() + report.reset + report.refused,
        report.sent,
        "{report:?}"
    );
    // Served: ok, or shed or expired by the gateway's deadline rule when
    // the machine is too busy for the 80 ms budget; nothing failed.
    assert!(report.ok > 0, "{report:?}");
    assert_eq!(report.failed, 0, "{:?}", report.outcomes);
    // The path really changed: the gateway answered on both mappings, and
    // frames it admitted after the rebind came through the second.
    let after = admitted(&c) - admitted_at_rebind;
    assert!(after > 0, "no frame reached the gateway after the rebind");
    let mappings = mappings.lock().unwrap();
    assert_eq!(mappings.len(), 2, "{mappings:?}");
    for (i, m) in mappings.iter().enumerate() {
        let (up, down) = (m.up.load(Ordering::Relaxed), m.down.load(Ordering::Relaxed));
        assert!(up > 0 && down > 0, "mapping {i}: {up} up, {down} down");
    }
    // ... and carried at least a whole frame's datagrams (at most 1452
    // bytes each) from the edge.
    let second = mappings[1].up.load(Ordering::Relaxed);
    assert!(
        second * 1452 >= report.bytes_per_frame,
        "the second mapping carried {second} datagrams up, less than one frame of {} bytes",
        report.bytes_per_frame
    );
    // Had the connection broken, the generator would have redialled
    // (`reconnects`) and the frames in flight been lost with it (above).
}
