//! The HTTP webhook sink: results are POSTed as JSON arrays to a plain
//! `http://` URL by one background task.
//!
//! - **Bounded:** results wait in a queue of fixed size; when it is full a
//!   new result is dropped and counted (`dropped_full`), never blocking the
//!   edge.
//! - **Batched:** each POST carries what is queued, up to [`MAX_BATCH`]
//!   results, as one JSON array.
//! - **Retried:** connection errors, timeouts, 408, 429 and 5xx are retried
//!   with exponential backoff ([`RetryPolicy`]); other answers are final. A
//!   batch that exhausts its attempts is dropped and counted
//!   (`dropped_failed`).
//!
//! The HTTP/1.1 client is a few lines over a tokio `TcpStream`
//! (`Connection: close`), which keeps TLS stacks out of the edge's build.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;
use tracing::{Instrument, debug, info_span, warn};

/// Most results in one POST.
pub const MAX_BATCH: usize = 64;
/// Longest wait for one POST, connect to status line.
pub const POST_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a webhook URL cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WebhookError {
    /// Not an `http://` URL.
    #[error(
        "'{url}' is not a plain http:// URL; write it as http://host:port/path (put TLS in a local proxy)"
    )]
    Scheme {
        /// The URL as configured.
        url: String,
    },
    /// No host, or a port that is not a number.
    #[error("'{url}' has no usable host:port; write it as http://host:port/path")]
    Authority {
        /// The URL as configured.
        url: String,
    },
}

/// Where to POST: host, port and path of an `http://` URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// Host name or address.
    pub host: String,
    /// TCP port (80 when the URL gives none).
    pub port: u16,
    /// Path and query, starting with `/`.
    pub path: String,
}

impl Endpoint {
    /// Parses `http://host[:port][/path]`.
    pub fn parse(url: &str) -> Result<Self, WebhookError> {
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| WebhookError::Scheme { url: url.into() })?;
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/"),
        };
        let bad = || WebhookError::Authority { url: url.into() };
        let (host, port) = match authority.rsplit_once(':') {
            Some((h, p)) if !h.ends_with(']') || h.starts_with('[') => {
                (h, p.parse::<u16>().map_err(|_| bad())?)
            }
            _ => (authority, 80),
        };
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() || authority.contains('@') {
            return Err(bad());
        }
        Ok(Endpoint {
            host: host.to_string(),
            port,
            path: path.to_string(),
        })
    }
}

/// What one POST came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PostOutcome {
    /// The server answered with this status.
    Status(u16),
    /// No answer: connect, write, read or timeout failure.
    Io(String),
}

/// When to try a failed POST again. Pure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts per batch, the first included.
    pub max_attempts: u32,
    /// Delay before the second attempt; it doubles per attempt.
    pub base: Duration,
    /// Longest delay.
    pub max: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 5,
            base: Duration::from_millis(200),
            max: Duration::from_secs(5),
        }
    }
}

impl RetryPolicy {
    /// After attempt number `attempt` (1 = the first) ended in `outcome`:
    /// `None` when the batch is done (delivered, or not worth retrying, or
    /// out of attempts), else the delay before the next attempt.
    pub fn retry_after(&self, attempt: u32, outcome: &PostOutcome) -> Option<Duration> {
        let retryable = match outcome {
            PostOutcome::Status(s) => *s == 408 || *s == 429 || (500..600).contains(s),
            PostOutcome::Io(_) => true,
        };
        if !retryable || attempt >= self.max_attempts {
            return None;
        }
        let factor = 1u32 << (attempt - 1).min(16);
        Some((self.base * factor).min(self.max))
    }
}

/// Whether `outcome` means the batch was accepted.
pub fn delivered(outcome: &PostOutcome) -> bool {
    matches!(outcome, PostOutcome::Status(s) if (200..300).contains(s))
}

/// Counters of the webhook sink.
#[derive(Debug, Default)]
pub struct WebhookStats {
    /// Results accepted by the server (2xx).
    pub posted: AtomicU64,
    /// Results dropped because the queue was full.
    pub dropped_full: AtomicU64,
    /// Results dropped after a final failure or running out of attempts.
    pub dropped_failed: AtomicU64,
    /// POSTs retried.
    pub retries: AtomicU64,
}

/// A running webhook sink. Dropping it (or [`Webhook::close`]) ends the
/// queue; the task finishes what is queued, within its retry policy.
#[derive(Debug)]
pub struct Webhook {
    tx: mpsc::Sender<String>,
    stats: Arc<WebhookStats>,
    task: tokio::task::JoinHandle<()>,
}

impl Webhook {
    /// Starts the sink's task on the current tokio runtime.
    pub fn spawn(endpoint: Endpoint, queue: usize, policy: RetryPolicy) -> Webhook {
        let (tx, rx) = mpsc::channel(queue.max(1));
        let stats = Arc::new(WebhookStats::default());
        let span = info_span!("webhook", host = %endpoint.host, port = endpoint.port);
        let task = tokio::spawn(run(endpoint, rx, policy, stats.clone()).instrument(span));
        Webhook { tx, stats, task }
    }

    /// Queues one JSON result without waiting; counts it if the queue is full.
    pub fn push(&self, json: String) {
        if self.tx.try_send(json).is_err() {
            self.stats.dropped_full.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The sink's counters.
    pub fn stats(&self) -> &Arc<WebhookStats> {
        &self.stats
    }

    /// Ends the queue and waits up to `timeout` for what is queued to go out.
    pub async fn close(self, timeout: Duration) -> Arc<WebhookStats> {
        let Webhook { tx, stats, task } = self;
        drop(tx);
        if tokio::time::timeout(timeout, task).await.is_err() {
            warn!("webhook still busy after {timeout:?}; its queued results are dropped");
        }
        stats
    }
}

async fn run(
    endpoint: Endpoint,
    mut rx: mpsc::Receiver<String>,
    policy: RetryPolicy,
    stats: Arc<WebhookStats>,
) {
    let mut batch = Vec::with_capacity(MAX_BATCH);
    while rx.recv_many(&mut batch, MAX_BATCH).await > 0 {
        let body = format!("[{}]", batch.join(","));
        let n = batch.len() as u64;
        batch.clear();
        let mut attempt = 1;
        loop {
            let outcome = match tokio::time::timeout(POST_TIMEOUT, post(&endpoint, &body)).await {
                Ok(o) => o,
                Err(_) => PostOutcome::Io(format!("no answer within {POST_TIMEOUT:?}")),
            };
            if delivered(&outcome) {
                stats.posted.fetch_add(n, Ordering::Relaxed);
                debug!(results = n, "posted");
                break;
            }
            match policy.retry_after(attempt, &outcome) {
                Some(delay) => {
                    debug!(?outcome, attempt, "POST failed; retrying in {delay:?}");
                    stats.retries.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(delay).await;
                    attempt += 1;
                }
                None => {
                    warn!(
                        ?outcome,
                        attempt, "webhook POST failed for good; {n} results dropped"
                    );
                    stats.dropped_failed.fetch_add(n, Ordering::Relaxed);
                    break;
                }
            }
        }
    }
}

/// One POST; the connection is closed after the answer's status line.
async fn post(endpoint: &Endpoint, body: &str) -> PostOutcome {
    let io = |what: &str, e: std::io::Error| PostOutcome::Io(format!("{what}: {e}"));
    let mut s = match tokio::net::TcpStream::connect((endpoint.host.as_str(), endpoint.port)).await
    {
        Ok(s) => s,
        Err(e) => return io("connect", e),
    };
    let host = if endpoint.host.contains(':') {
        format!("[{}]:{}", endpoint.host, endpoint.port)
    } else {
        format!("{}:{}", endpoint.host, endpoint.port)
    };
    let head = format!(
        "POST {} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: tidegate-edge\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        endpoint.path,
        body.len()
    );
    if let Err(e) = s.write_all(head.as_bytes()).await {
        return io("write", e);
    }
    if let Err(e) = s.write_all(body.as_bytes()).await {
        return io("write", e);
    }
    let mut buf = Vec::with_capacity(256);
    let mut chunk = [0u8; 256];
    loop {
        if let Some(status) = parse_status(&buf) {
            return match status {
                Ok(code) => PostOutcome::Status(code),
                Err(e) => PostOutcome::Io(e),
            };
        }
        if buf.len() > 8192 {
            return PostOutcome::Io("no status line in the first 8 KiB of the answer".into());
        }
        match s.read(&mut chunk).await {
            Ok(0) => return PostOutcome::Io("connection closed before a status line".into()),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) => return io("read", e),
        }
    }
}

/// The status code of an HTTP/1.x answer: `None` until the status line is
/// complete, then the code or why the line is not valid.
pub fn parse_status(buf: &[u8]) -> Option<Result<u16, String>> {
    let end = buf.windows(2).position(|w| w == b"\r\n")?;
    let line = String::from_utf8_lossy(&buf[..end]);
    let mut parts = line.splitn(3, ' ');
    let version = parts.next().unwrap_or("");
    let code = parts.next().unwrap_or("");
    if !(version == "HTTP/1.1" || version == "HTTP/1.0") {
        return Some(Err(format!("not an HTTP/1.x status line: {line:?}")));
    }
    if code.len() != 3 || !code.bytes().all(|b| b.is_ascii_digit()) {
        return Some(Err(format!("bad status code in {line:?}")));
    }
    match code.parse::<u16>() {
        Ok(c) if (100..600).contains(&c) => Some(Ok(c)),
        _ => Some(Err(format!("bad status code in {line:?}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_parses_host_port_and_path() {
        assert_eq!(
            Endpoint::parse("http://127.0.0.1:8080/hooks/results?x=1").unwrap(),
            Endpoint {
                host: "127.0.0.1".into(),
                port: 8080,
                path: "/hooks/results?x=1".into()
            }
        );
        assert_eq!(
            Endpoint::parse("http://collector").unwrap(),
            Endpoint {
                host: "collector".into(),
                port: 80,
                path: "/".into()
            }
        );
        assert_eq!(Endpoint::parse("http://[::1]:9000/r").unwrap().host, "::1");
        assert!(matches!(
            Endpoint::parse("https://x/y"),
            Err(WebhookError::Scheme { .. })
        ));
        for bad in [
            "http://:80/x",
            "http://host:port/x",
            "http://u:p@h/x",
            "http:///x",
        ] {
            assert!(
                matches!(Endpoint::parse(bad), Err(WebhookError::Authority { .. })),
                "{bad}"
            );
        }
    }

    #[test]
    fn retry_policy_retries_server_and_network_errors_with_growing_delays() {
        let p = RetryPolicy {
            max_attempts: 4,
            base: Duration::from_millis(100),
            max: Duration::from_millis(250),
        };
        let io = PostOutcome::Io("refused".into());
        assert_eq!(p.retry_after(1, &io), Some(Duration::from_millis(100)));
        assert_eq!(p.retry_after(2, &io), Some(Duration::from_millis(200)));
        assert_eq!(p.retry_after(3, &io), Some(Duration::from_millis(250)));
        assert_eq!(p.retry_after(4, &io), None, "out of attempts");
        for s in [408, 429, 500, 502, 503] {
            assert!(p.retry_after(1, &PostOutcome::Status(s)).is_some(), "{s}");
        }
        for s in [200, 204, 301, 400, 401, 404, 413] {
            assert_eq!(p.retry_after(1, &PostOutcome::Status(s)), None, "{s}");
        }
        assert!(delivered(&PostOutcome::Status(204)));
        assert!(!delivered(&PostOutcome::Status(404)));
    }

    #[test]
    fn status_line_is_parsed_only_once_complete() {
        assert_eq!(parse_status(b"HTTP/1.1 20"), None);
        assert_eq!(parse_status(b"HTTP/1.1 204 No Content\r\n"), Some(Ok(204)));
        assert_eq!(
            parse_status(b"HTTP/1.0 503\r\nRetry-After: 1\r\n"),
            Some(Ok(503))
        );
        assert!(matches!(parse_status(b"SSH-2.0-OpenSSH\r\n"), Some(Err(_))));
        assert!(matches!(parse_status(b"HTTP/1.1 2x0 OK\r\n"), Some(Err(_))));
        assert!(matches!(
            parse_status(b"HTTP/1.1 999 Odd\r\n"),
            Some(Err(_))
        ));
    }
}
