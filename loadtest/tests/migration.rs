//! QUIC connection migration through real processes on 127.0.0.1: an edge
//! behind a NAT whose mapping changes mid-stream (the edge's packets reach
//! the gateway from a new address and port, as when a home router or a
//! mobile carrier rebinds) keeps its one connection and its cameras, and
//! every frame it sends, before, during and after the change, gets exactly
//! one result. A TCP-based inference server would see its connection break
//! and the edge reconnect and reopen its cameras.
//!
//! The NAT is a UDP relay in this test: the edge dials it, and it forwards
//! to the gateway from an upstream socket that it swaps for a new one
//! halfway through. Bounded in frames and time; nothing asserts on speed.

#[path = "support/astronaut.rs"]
mod astronaut;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use astronaut::started_cluster;
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
    let mut opts = c.sim_options("edge-1", 2, 10.0, 6.0);
    opts.gateway = front.into();
    let sim = rt.spawn(async move { tidegate_loadtest::sim::run(&opts).await });
    // Halfway through the sending, the NAT maps the edge to a new port.
    rt.block_on(async { tokio::time::sleep(Duration::from_secs(3)).await });
    rebind.send(1).unwrap();
    let report = rt
        .block_on(async { tokio::time::timeout(Duration::from_secs(60), sim).await })
        .expect("the simulation ends")
        .expect("the simulation task")
        .expect("the simulation runs without reconnecting");

    // Every frame sent got exactly one result, and all of them were ok.
    assert!(report.sent >= 100, "{report:?}");
    assert_eq!(report.send_errors, 0, "{report:?}");
    assert_eq!(
        report.reconnects, 0,
        "one connection throughout: {report:?}"
    );
    assert_eq!(report.missing, 0, "{report:?}");
    assert_eq!(report.duplicates, 0, "{report:?}");
    assert_eq!(report.ok, report.sent, "{report:?}");
    // The path really changed: the gateway answered on both mappings, and
    // the second carried frames of its own.
    let mappings = mappings.lock().unwrap();
    assert_eq!(mappings.len(), 2, "{mappings:?}");
    for (i, m) in mappings.iter().enumerate() {
        let (up, down) = (m.up.load(Ordering::Relaxed), m.down.load(Ordering::Relaxed));
        assert!(up > 50 && down > 10, "mapping {i}: {up} up, {down} down");
    }
    // Had the connection broken, the generator would have redialled
    // (`reconnects`) and the frames in flight been lost with it (above).
}
