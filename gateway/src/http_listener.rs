//! The HTTP API's accept loop: at most [`HttpLimits::max_connections`]
//! connections at once (one more is closed as it is accepted, and
//! counted), and each is closed if a request head does not arrive whole
//! within [`HttpLimits::header_read_timeout`] — the first request's, or
//! the next one's on an idle keep-alive connection. So a slowloris client
//! (connections opened and fed a header byte at a time, or never) holds
//! at most the cap's descriptors, each for at most the timeout.
//!
//! It serves HTTP/1.1 with hyper's connection builder, the same protocol
//! `axum::serve` spoke, and stops the way `axum::serve`'s graceful
//! shutdown does: no new connections, idle ones closed, a request in
//! progress finished.

use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::debug;

use crate::metrics::Metrics;

/// What one HTTP client may hold (`[http]` `header_read_timeout_ms`,
/// `max_connections`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpLimits {
    /// Time a connection has to send a whole request head, from when it
    /// is accepted or its last response was written.
    pub header_read_timeout: Duration,
    /// Connections open at once.
    pub max_connections: usize,
}

/// How long the loop waits after `accept` fails (out of descriptors, say)
/// before it tries again, instead of spinning.
const ACCEPT_RETRY: Duration = Duration::from_millis(50);

/// Serves `router` on `listener` within `limits` until `shutdown` fires,
/// then stops accepting, lets every connection finish its request in
/// progress and returns when all have closed.
pub async fn serve(
    listener: TcpListener,
    router: axum::Router,
    limits: HttpLimits,
    metrics: Metrics,
    shutdown: CancellationToken,
) {
    let open = Arc::new(Semaphore::new(limits.max_connections));
    let connections = TaskTracker::new();
    loop {
        let accepted = tokio::select! {
            _ = shutdown.cancelled() => break,
            a = listener.accept() => a,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                debug!("HTTP accept failed: {e}; retrying in {ACCEPT_RETRY:?}");
                tokio::time::sleep(ACCEPT_RETRY).await;
                continue;
            }
        };
        let Ok(permit) = open.clone().try_acquire_owned() else {
            // Closed now: the client sees the connection end at once,
            // instead of waiting in the backlog for a slot.
            metrics.http_refused.inc();
            debug!(%peer, max = limits.max_connections, "HTTP connection refused: at the connection cap");
            drop(stream);
            continue;
        };
        let service = TowerToHyperService::new(router.clone());
        let shutdown = shutdown.clone();
        connections.spawn(async move {
            let _permit = permit;
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_read_timeout);
            let conn = builder.serve_connection(TokioIo::new(stream), service);
            let mut conn = std::pin::pin!(conn);
            let served = tokio::select! {
                r = conn.as_mut() => r,
                _ = shutdown.cancelled() => {
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
            };
            if let Err(e) = served {
                debug!(%peer, "HTTP connection ended: {e}");
            }
        });
    }
    connections.close();
    connections.wait().await;
}
