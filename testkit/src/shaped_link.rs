//! A UDP relay on 127.0.0.1 that plays a thin uplink: datagrams from the
//! edge to the gateway leave at most `rate` bytes per second (0: as fast as
//! they come) after a one-way delay, and are dropped when more than
//! [`QUEUE`] of them would wait (a bottleneck's drop-tail buffer). The way
//! back is not shaped. The rate can change while it runs. Used by
//! `edge/tests/uplink.rs`. Feature `edge`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::net::UdpSocket;
use tokio::sync::mpsc;
use tokio::time::Instant;

/// The longest wait in the bottleneck's buffer.
pub const QUEUE: Duration = Duration::from_millis(300);

/// A running relay; dropping it stops it.
#[derive(Debug)]
pub struct ShapedLink {
    /// Where the edge sends (the gateway's address for it).
    pub addr: SocketAddr,
    rate: Arc<AtomicU64>,
    /// Datagrams dropped at the bottleneck.
    pub dropped: Arc<AtomicU64>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for ShapedLink {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl ShapedLink {
    /// A relay to `gateway`, `rate` bytes per second (0: unlimited), each
    /// datagram delayed by `delay` towards the gateway.
    pub async fn start(gateway: SocketAddr, rate: u64, delay: Duration) -> ShapedLink {
        let edge_side = Arc::new(UdpSocket::bind("127.0.0.1:0").await.unwrap());
        let gw_side = Arc::new(UdpSocket::bind("127.0.0.1:0").await.unwrap());
        gw_side.connect(gateway).await.unwrap();
        let addr = edge_side.local_addr().unwrap();
        let rate = Arc::new(AtomicU64::new(rate));
        let dropped = Arc::new(AtomicU64::new(0));
        let edge_addr = Arc::new(std::sync::Mutex::new(None::<SocketAddr>));
        let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
        let up = tokio::spawn({
            let (sock, rate, dropped, edge_addr) = (
                edge_side.clone(),
                rate.clone(),
                dropped.clone(),
                edge_addr.clone(),
            );
            async move {
                let mut buf = vec![0u8; 65536];
                // When the bottleneck is next free.
                let mut free_at = Instant::now();
                loop {
                    let Ok((n, from)) = sock.recv_from(&mut buf).await else {
                        return;
                    };
                    *edge_addr.lock().unwrap() = Some(from);
                    let now = Instant::now();
                    let r = rate.load(Ordering::Relaxed);
                    let start = free_at.max(now);
                    if r > 0 && start - now > QUEUE {
                        dropped.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                    let sent = if r > 0 {
                        start + Duration::from_secs_f64(n as f64 / r as f64)
                    } else {
                        now
                    };
                    free_at = sent;
                    if tx.send((sent + delay, buf[..n].to_vec())).is_err() {
                        return;
                    }
                }
            }
        });
        let deliver = tokio::spawn({
            let sock = gw_side.clone();
            async move {
                while let Some((at, datagram)) = rx.recv().await {
                    tokio::time::sleep_until(at).await;
                    let _ = sock.send(&datagram).await;
                }
            }
        });
        let down = tokio::spawn({
            let (from, to) = (gw_side, edge_side);
            async move {
                let mut buf = vec![0u8; 65536];
                loop {
                    let Ok(n) = from.recv(&mut buf).await else {
                        return;
                    };
                    let edge = *edge_addr.lock().unwrap();
                    if let Some(edge) = edge {
                        let _ = to.send_to(&buf[..n], edge).await;
                    }
                }
            }
        });
        ShapedLink {
            addr,
            rate,
            dropped,
            tasks: vec![up, deliver, down],
        }
    }

    /// Changes the rate (bytes per second; 0: unlimited) from the next
    /// datagram on.
    pub fn set_rate(&self, rate: u64) {
        self.rate.store(rate, Ordering::Relaxed);
    }
}
