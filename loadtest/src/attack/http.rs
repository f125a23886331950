//! Slowloris on the gateway's HTTP API: connections that send half a
//! request head and hold it.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio_util::sync::CancellationToken;

/// Connects to `addr` and sends half a request head: a slowloris client's
/// opening.
pub fn half_a_request(addr: SocketAddr) -> std::io::Result<TcpStream> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: tidegate\r\nX-Slow: ")?;
    Ok(s)
}

/// Whether the server has closed `s` (end of stream or reset), without
/// waiting. Leaves `s` non-blocking.
pub fn closed_by_server(s: &mut TcpStream) -> bool {
    let mut buf = [0u8; 512];
    if s.set_nonblocking(true).is_err() {
        return true;
    }
    // Bounded: a server that keeps sending is read at most 64 KiB a call.
    for _ in 0..128 {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == ErrorKind::WouldBlock => return false,
            Err(_) => return true,
        }
    }
    false
}

/// What a slowloris client held and lost.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Slowloris {
    /// Connections opened (half a request head each), reopenings included.
    pub opened: u64,
    /// Connections that failed to open.
    pub failed_to_open: u64,
    /// Connections the server closed.
    pub closed_by_server: u64,
    /// Connections held open at the end.
    pub held_at_end: u64,
    /// Most open on this side at once, at a check (those beyond the
    /// server's cap are closed by it as they arrive, and seen at the next).
    pub most_held: u64,
}

/// Holds `n` half-open connections to `addr` until `stop` fires or `until`
/// passes: every `every`, those the server has closed are counted and
/// opened again.
pub fn hold(
    addr: SocketAddr,
    n: usize,
    every: Duration,
    stop: &CancellationToken,
    until: Instant,
) -> Slowloris {
    let mut out = Slowloris::default();
    let mut held: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
    let every = every.max(Duration::from_millis(10));
    let going = || Instant::now() < until && !stop.is_cancelled();
    while going() {
        for slot in &mut held {
            if let Some(s) = slot
                && closed_by_server(s)
            {
                out.closed_by_server += 1;
                *slot = None;
            }
            if slot.is_none() && going() {
                match half_a_request(addr) {
                    Ok(s) => {
                        out.opened += 1;
                        *slot = Some(s);
                    }
                    Err(_) => out.failed_to_open += 1,
                }
            }
        }
        let open = held.iter().flatten().count() as u64;
        out.most_held = out.most_held.max(open);
        std::thread::sleep(every.min(until.saturating_duration_since(Instant::now())));
    }
    out.held_at_end = held
        .iter_mut()
        .flatten()
        .map(|s| !closed_by_server(s))
        .filter(|open| *open)
        .count() as u64;
    out
}
