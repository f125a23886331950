//! The HTTP webhook sink: results are POSTed as JSON arrays to an `http://`
//! or `https://` URL by one background task.
//!
//! - **Bounded:** results wait in a queue bounded by count and by bytes
//!   ([`QueueLimits`]: a `raw` model's results can weigh megabytes each);
//!   when either bound would be passed a new result is dropped and counted
//!   (`dropped_full`), never blocking the edge. The bytes counted are those
//!   of every result held: queued, or in the POST under way.
//! - **Batched:** each POST carries what is queued, up to [`MAX_BATCH`]
//!   results, as one JSON array.
//! - **Retried:** connection errors, timeouts, 408, 429 and 5xx are retried
//!   with exponential backoff ([`RetryPolicy`]); other answers are final. A
//!   batch that exhausts its attempts is dropped and counted
//!   (`dropped_failed`).
//! - **Accounted:** [`Webhook::close`] waits a bounded time for what is
//!   queued to go out, then stops the task; what it still held is dropped
//!   and counted (`dropped_shutdown`). Every result pushed ends up in exactly
//!   one counter: `pushed = posted + dropped_full + dropped_failed +
//!   dropped_shutdown`.
//!
//! The HTTP/1.1 client is a few lines over a tokio `TcpStream`
//! (`Connection: close`). For `https://` it runs over rustls with ring, the
//! TLS stack the edge's QUIC uplink already links (TLS 1.2 and 1.3), trusting
//! the CA file configured (`sinks.webhook_ca`) or else the system's roots. A
//! bearer token (`TIDEGATE_WEBHOOK_TOKEN`) goes in an `Authorization` header.

use std::path::Path;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio_rustls::TlsConnector;
use tokio_rustls::rustls;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info_span, warn};

/// Most results in one POST.
pub const MAX_BATCH: usize = 64;
/// Longest wait for one POST, connect to status line.
pub const POST_TIMEOUT: Duration = Duration::from_secs(5);
/// How long [`Webhook::close`] waits for the stopped task to count what it
/// held before aborting it.
const STOP_GRACE: Duration = Duration::from_secs(1);
/// Results the queue holds at most by default (`sinks.webhook_queue`).
pub const DEFAULT_QUEUE_RESULTS: usize = 1024;
/// Bytes of results the webhook holds at most by default
/// (`sinks.webhook_queue_bytes`): 64 MiB.
pub const DEFAULT_QUEUE_BYTES: usize = 64 << 20;

/// What the webhook holds at most before it drops new results: whichever
/// bound is reached first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueLimits {
    /// Results queued (at least 1).
    pub results: usize,
    /// Bytes of JSON held, queued or in the POST under way (at least 1). A
    /// single result larger than this is always dropped.
    pub bytes: usize,
}

impl Default for QueueLimits {
    fn default() -> Self {
        QueueLimits {
            results: DEFAULT_QUEUE_RESULTS,
            bytes: DEFAULT_QUEUE_BYTES,
        }
    }
}

/// Why a webhook URL cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WebhookError {
    /// Neither an `http://` nor an `https://` URL.
    #[error("'{url}' is not an http:// or https:// URL; write it as https://host:port/path")]
    Scheme {
        /// The URL as configured.
        url: String,
    },
    /// The TLS client for an `https://` webhook cannot be set up.
    #[error("webhook TLS: {0}")]
    Tls(String),
    /// No host, a port that is not a number, or brackets around something
    /// other than an IPv6 address.
    #[error(
        "'{url}' has no usable host:port; write it as https://host:port/path (an IPv6 address in brackets: https://[::1]:8443/path)"
    )]
    Authority {
        /// The URL as configured.
        url: String,
    },
}

/// Where to POST: host, port and path of an `http://` or `https://` URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// Host name or address.
    pub host: String,
    /// TCP port (80, or 443 for https, when the URL gives none).
    pub port: u16,
    /// Path and query, starting with `/`.
    pub path: String,
    /// Whether it is `https://`.
    pub tls: bool,
}

impl Endpoint {
    /// Parses `http[s]://host[:port][/path]`, where `host` is a name, an IPv4
    /// address or an IPv6 address in brackets (`https://[::1]:8443/x`).
    pub fn parse(url: &str) -> Result<Self, WebhookError> {
        let (rest, tls) = match (url.strip_prefix("http://"), url.strip_prefix("https://")) {
            (Some(rest), _) => (rest, false),
            (_, Some(rest)) => (rest, true),
            _ => return Err(WebhookError::Scheme { url: url.into() }),
        };
        let default_port = if tls { 443 } else { 80 };
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/"),
        };
        let bad = || WebhookError::Authority { url: url.into() };
        let port_of = |p: &str| p.parse::<u16>().map_err(|_| bad());
        let (host, port) = match authority.strip_prefix('[') {
            // `[v6]` or `[v6]:port`.
            Some(bracketed) => {
                let (host, after) = bracketed.split_once(']').ok_or_else(bad)?;
                if host.parse::<std::net::Ipv6Addr>().is_err() {
                    return Err(bad());
                }
                let port = match after {
                    "" => default_port,
                    _ => port_of(after.strip_prefix(':').ok_or_else(bad)?)?,
                };
                (host, port)
            }
            None => match authority.split_once(':') {
                Some((h, p)) => (h, port_of(p)?),
                None => (authority, default_port),
            },
        };
        if host.is_empty() || authority.contains('@') || host.contains(['[', ']']) {
            return Err(bad());
        }
        Ok(Endpoint {
            host: host.to_string(),
            port,
            path: path.to_string(),
            tls,
        })
    }
}

/// Where and how to POST: the endpoint, its TLS client when it is
/// `https://`, and the `Authorization` header, if any.
#[derive(Clone)]
pub struct Client {
    endpoint: Endpoint,
    tls: Option<TlsConnector>,
    authorization: Option<String>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("endpoint", &self.endpoint)
            .field("tls", &self.tls.is_some())
            .field("authorization", &self.authorization.as_ref().map(|_| "…"))
            .finish()
    }
}

impl Client {
    /// A client for `endpoint`. For `https://` it trusts the PEM
    /// certificates in `ca`, or else the system's roots (the
    /// `ca-certificates` store); `bearer` is sent as `Authorization: Bearer`.
    pub fn new(
        endpoint: Endpoint,
        ca: Option<&Path>,
        bearer: Option<String>,
    ) -> Result<Client, WebhookError> {
        let tls = if endpoint.tls {
            Some(tls_connector(ca)?)
        } else {
            if let Some(ca) = ca {
                return Err(WebhookError::Tls(format!(
                    "a CA ({}) is set, but the webhook is not https://",
                    ca.display()
                )));
            }
            None
        };
        Ok(Client {
            endpoint,
            tls,
            authorization: bearer.map(|t| format!("Bearer {t}")),
        })
    }

    /// How it sends, for `check-config`: TLS or not, and whether a bearer
    /// token goes with each request (never the token).
    pub fn describe(&self) -> &'static str {
        match (self.tls.is_some(), self.authorization.is_some()) {
            (true, true) => "TLS, bearer token",
            (true, false) => "TLS, no token",
            (false, true) => "plain HTTP, bearer token",
            (false, false) => "plain HTTP, no token",
        }
    }

    /// The endpoint.
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }
}

/// A TLS client trusting `ca` (PEM), or the system's roots.
fn tls_connector(ca: Option<&Path>) -> Result<TlsConnector, WebhookError> {
    let config = super::tls::client_config(ca).map_err(WebhookError::Tls)?;
    Ok(TlsConnector::from(Arc::new(config)))
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
        Some(tidegate_kit::backoff::step(
            self.base,
            self.max,
            attempt.saturating_sub(1),
        ))
    }
}

/// Whether `outcome` means the batch was accepted.
pub fn delivered(outcome: &PostOutcome) -> bool {
    matches!(outcome, PostOutcome::Status(s) if (200..300).contains(s))
}

/// Counters of the webhook sink. Once [`Webhook::close`] has returned,
/// `pushed = posted + dropped_full + dropped_failed + dropped_shutdown`.
#[derive(Debug, Default)]
pub struct WebhookStats {
    /// Results handed to [`Webhook::push`].
    pub pushed: AtomicU64,
    /// Results accepted by the server (2xx).
    pub posted: AtomicU64,
    /// Results dropped because the queue was full, by count or by bytes.
    pub dropped_full: AtomicU64,
    /// Results dropped after a final failure or running out of attempts.
    pub dropped_failed: AtomicU64,
    /// Results still queued or being posted when [`Webhook::close`] ran out
    /// of time (or pushed after the task had stopped).
    pub dropped_shutdown: AtomicU64,
    /// POSTs retried.
    pub retries: AtomicU64,
    /// Bytes of JSON held now, queued or in the POST under way: at most
    /// [`QueueLimits::bytes`]. Zero once [`Webhook::close`] has returned.
    pub held_bytes: AtomicU64,
}

impl WebhookStats {
    /// Releases `n` bytes held.
    fn release(&self, n: u64) {
        // Never below zero, even if an accounting slip happened.
        let _ = self
            .held_bytes
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |h| {
                Some(h.saturating_sub(n))
            });
    }
}

/// A running webhook sink. Dropping it ends the queue, and the task finishes
/// what is queued, within its retry policy; [`Webhook::close`] also bounds
/// the time that takes.
#[derive(Debug)]
pub struct Webhook {
    tx: mpsc::Sender<String>,
    stats: Arc<WebhookStats>,
    /// [`QueueLimits::bytes`].
    max_bytes: u64,
    /// Whether a result larger than the whole byte budget was logged.
    warned_oversize: AtomicBool,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Webhook {
    /// Starts the sink's task on the current tokio runtime, with a queue of
    /// `queue` results and the default byte budget
    /// ([`DEFAULT_QUEUE_BYTES`]).
    pub fn spawn(client: Client, queue: usize, policy: RetryPolicy) -> Webhook {
        let limits = QueueLimits {
            results: queue,
            ..QueueLimits::default()
        };
        Webhook::spawn_with(client, limits, policy)
    }

    /// Starts the sink's task on the current tokio runtime, holding at most
    /// `limits`.
    pub fn spawn_with(client: Client, limits: QueueLimits, policy: RetryPolicy) -> Webhook {
        let (tx, rx) = mpsc::channel(limits.results.max(1));
        let stats = Arc::new(WebhookStats::default());
        let stop = CancellationToken::new();
        let e = &client.endpoint;
        let span = info_span!("webhook", host = %e.host, port = e.port, tls = e.tls);
        let task =
            tokio::spawn(run(client, rx, policy, stats.clone(), stop.clone()).instrument(span));
        Webhook {
            tx,
            stats,
            max_bytes: limits.bytes.max(1) as u64,
            warned_oversize: AtomicBool::new(false),
            stop,
            task,
        }
    }

    /// Queues one JSON result without waiting; counts it if the queue is
    /// full, by count or by bytes. Works from any thread, inside a tokio
    /// runtime or not.
    pub fn push(&self, json: String) {
        let stats = &self.stats;
        stats.pushed.fetch_add(1, Ordering::Relaxed);
        let len = json.len() as u64;
        let reserved =
            stats
                .held_bytes
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |held| {
                    held.checked_add(len).filter(|&h| h <= self.max_bytes)
                });
        if reserved.is_err() {
            if len > self.max_bytes && !self.warned_oversize.swap(true, Ordering::Relaxed) {
                warn!(
                    bytes = len,
                    budget = self.max_bytes,
                    "a result is larger than the webhook's whole byte budget \
                     (sinks.webhook_queue_bytes); such results are dropped for the webhook"
                );
            }
            stats.dropped_full.fetch_add(1, Ordering::Relaxed);
            return;
        }
        match self.tx.try_send(json) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(_)) => {
                stats.release(len);
                stats.dropped_full.fetch_add(1, Ordering::Relaxed);
            }
            Err(mpsc::error::TrySendError::Closed(_)) => {
                stats.release(len);
                stats.dropped_shutdown.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// The sink's counters.
    pub fn stats(&self) -> &Arc<WebhookStats> {
        &self.stats
    }

    /// Ends the queue and waits up to `timeout` for what is queued to go
    /// out. Then it stops the task: results it still held (queued, or in a
    /// POST not yet answered) are dropped and counted in `dropped_shutdown`.
    pub async fn close(self, timeout: Duration) -> Arc<WebhookStats> {
        let Webhook {
            tx,
            stats,
            stop,
            mut task,
            ..
        } = self;
        drop(tx);
        if tokio::time::timeout(timeout, &mut task).await.is_err() {
            stop.cancel();
            // Every wait of the task watches `stop`: it counts what it held
            // and returns at once. Abort it if it somehow does not.
            if tokio::time::timeout(STOP_GRACE, &mut task).await.is_err() {
                task.abort();
                let _ = task.await;
                let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
                let settled = load(&stats.posted)
                    + load(&stats.dropped_full)
                    + load(&stats.dropped_failed)
                    + load(&stats.dropped_shutdown);
                stats.dropped_shutdown.fetch_add(
                    load(&stats.pushed).saturating_sub(settled),
                    Ordering::Relaxed,
                );
                // What the aborted task held is freed with it.
                stats.held_bytes.store(0, Ordering::Relaxed);
            }
            warn!(
                dropped = stats.dropped_shutdown.load(Ordering::Relaxed),
                "webhook still busy after {timeout:?}; the results it still held are dropped"
            );
        }
        stats
    }
}

async fn run(
    client: Client,
    mut rx: mpsc::Receiver<String>,
    policy: RetryPolicy,
    stats: Arc<WebhookStats>,
    stop: CancellationToken,
) {
    let mut batch = Vec::with_capacity(MAX_BATCH);
    loop {
        let n = tokio::select! {
            biased;
            _ = stop.cancelled() => break,
            n = rx.recv_many(&mut batch, MAX_BATCH) => n,
        };
        if n == 0 {
            break;
        }
        let held: u64 = batch.iter().map(|j| j.len() as u64).sum();
        let body = format!("[{}]", batch.join(","));
        let n = batch.len() as u64;
        batch.clear();
        let stopped = tokio::select! {
            biased;
            _ = stop.cancelled() => {
                stats.dropped_shutdown.fetch_add(n, Ordering::Relaxed);
                true
            }
            _ = deliver(&client, &body, n, &policy, &stats) => false,
        };
        // The batch is posted or dropped: its bytes are free.
        drop(body);
        stats.release(held);
        if stopped {
            break;
        }
    }
    // Stopped, or the queue ended: whatever is still queued is dropped.
    rx.close();
    let mut left = 0u64;
    // Bounded: the queue is closed, so it only empties.
    while let Ok(json) = rx.try_recv() {
        stats.release(json.len() as u64);
        left += 1;
    }
    stats.dropped_shutdown.fetch_add(left, Ordering::Relaxed);
}

/// Posts one batch of `n` results, retrying within `policy`; counts it as
/// posted or as dropped for good.
async fn deliver(client: &Client, body: &str, n: u64, policy: &RetryPolicy, stats: &WebhookStats) {
    deliver_with(|| post(client, body), n, policy, stats).await;
}

/// [`deliver`] with each attempt made by `post`: the retry schedule
/// without a socket, so that tests run it on a paused clock.
async fn deliver_with<F: std::future::Future<Output = PostOutcome>>(
    mut post: impl FnMut() -> F,
    n: u64,
    policy: &RetryPolicy,
    stats: &WebhookStats,
) {
    let mut attempt = 1;
    loop {
        let outcome = match tokio::time::timeout(POST_TIMEOUT, post()).await {
            Ok(o) => o,
            Err(_) => PostOutcome::Io(format!("no answer within {POST_TIMEOUT:?}")),
        };
        if delivered(&outcome) {
            stats.posted.fetch_add(n, Ordering::Relaxed);
            debug!(results = n, "posted");
            return;
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
                return;
            }
        }
    }
}

/// One POST; the connection is closed after the answer's status line.
async fn post(client: &Client, body: &str) -> PostOutcome {
    let endpoint = &client.endpoint;
    let s = match tokio::net::TcpStream::connect((endpoint.host.as_str(), endpoint.port)).await {
        Ok(s) => s,
        Err(e) => return PostOutcome::Io(format!("connect: {e}")),
    };
    let host = if endpoint.host.contains(':') {
        format!("[{}]:{}", endpoint.host, endpoint.port)
    } else {
        format!("{}:{}", endpoint.host, endpoint.port)
    };
    let auth = client
        .authorization
        .as_ref()
        .map_or_else(String::new, |a| format!("Authorization: {a}\r\n"));
    let head = format!(
        "POST {} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: tidegate-edge\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        endpoint.path,
        body.len()
    );
    let Some(tls) = &client.tls else {
        return exchange(s, &head, body).await;
    };
    let name = match rustls::pki_types::ServerName::try_from(endpoint.host.clone()) {
        Ok(n) => n,
        Err(e) => {
            return PostOutcome::Io(format!(
                "tls: {:?} is not a server name: {e}",
                endpoint.host
            ));
        }
    };
    match tls.connect(name, s).await {
        Ok(s) => exchange(s, &head, body).await,
        Err(e) => PostOutcome::Io(format!("tls: {e}")),
    }
}

/// Writes the request and reads the answer's status line.
async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(
    mut s: S,
    head: &str,
    body: &str,
) -> PostOutcome {
    let io = |what: &str, e: std::io::Error| PostOutcome::Io(format!("{what}: {e}"));
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
                path: "/hooks/results?x=1".into(),
                tls: false,
            }
        );
        assert_eq!(
            Endpoint::parse("http://collector").unwrap(),
            Endpoint {
                host: "collector".into(),
                port: 80,
                path: "/".into(),
                tls: false,
            }
        );
        assert_eq!(
            Endpoint::parse("https://collector/hook").unwrap(),
            Endpoint {
                host: "collector".into(),
                port: 443,
                path: "/hook".into(),
                tls: true,
            }
        );
        assert_eq!(Endpoint::parse("https://c:8443").unwrap().port, 8443);
        for bad in ["ftp://x/y", "HTTPS://x/y", "x:80/y", "https:/x"] {
            assert!(
                matches!(Endpoint::parse(bad), Err(WebhookError::Scheme { .. })),
                "{bad}"
            );
        }
        for bad in [
            "http://:80/x",
            "http://host:port/x",
            "http://u:p@h/x",
            "http:///x",
            "http://host:99999/x",
        ] {
            assert!(
                matches!(Endpoint::parse(bad), Err(WebhookError::Authority { .. })),
                "{bad}"
            );
        }
    }

    #[test]
    fn endpoint_takes_an_ipv6_address_in_brackets_with_or_without_a_port() {
        let v6 = |host: &str, port, path: &str| Endpoint {
            host: host.into(),
            port,
            path: path.into(),
            tls: false,
        };
        for (url, want) in [
            ("http://[::1]/x", v6("::1", 80, "/x")),
            ("http://[::1]", v6("::1", 80, "/")),
            ("http://[::1]:8080", v6("::1", 8080, "/")),
            ("http://[::1]:9000/r?a=1", v6("::1", 9000, "/r?a=1")),
            (
                "http://[2001:db8::7]:443/hook",
                v6("2001:db8::7", 443, "/hook"),
            ),
            (
                "https://[::1]/x",
                Endpoint {
                    tls: true,
                    ..v6("::1", 443, "/x")
                },
            ),
        ] {
            assert_eq!(Endpoint::parse(url).unwrap(), want, "{url}");
        }
        for bad in [
            "http://[::1/x",
            "http://[::1]x/y",
            "http://[::1]:/x",
            "http://[::1]:port/x",
            "http://[::1]:65536/x",
            "http://[]/x",
            "http://[collector]/x",
            "http://[127.0.0.1]/x",
            "http://[::1]]/x",
            "http://::1/x",
            "http://::1:80/x",
            "http://u@[::1]/x",
        ] {
            assert!(
                matches!(Endpoint::parse(bad), Err(WebhookError::Authority { .. })),
                "{bad}: {:?}",
                Endpoint::parse(bad)
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

    /// Runs [`deliver_with`] for a batch of `n` results on the (paused)
    /// clock, each attempt answered by the next of `script` (`None`: no
    /// answer ever): the instant of each attempt, from the first, and the
    /// counters.
    async fn scripted(
        script: Vec<Option<PostOutcome>>,
        n: u64,
        policy: RetryPolicy,
    ) -> (Vec<Duration>, WebhookStats) {
        let stats = WebhookStats::default();
        let start = tokio::time::Instant::now();
        let attempts = std::cell::RefCell::new(Vec::new());
        let mut script = script.into_iter();
        let post = || {
            attempts.borrow_mut().push(start.elapsed());
            let answer = script.next().expect("an attempt past the script");
            async move {
                match answer {
                    Some(outcome) => outcome,
                    None => std::future::pending::<PostOutcome>().await,
                }
            }
        };
        deliver_with(post, n, &policy, &stats).await;
        (attempts.into_inner(), stats)
    }

    fn ms(ms: u64) -> Duration {
        Duration::from_millis(ms)
    }

    fn load(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }

    #[tokio::test(start_paused = true)]
    async fn a_webhook_that_fails_three_times_is_retried_after_the_backoffs_delays_and_delivered_once()
     {
        let script = vec![
            Some(PostOutcome::Status(503)),
            Some(PostOutcome::Io("connect: refused".into())),
            Some(PostOutcome::Status(429)),
            Some(PostOutcome::Status(204)),
        ];
        let (at, stats) = scripted(script, 7, RetryPolicy::default()).await;
        // 200 ms, then 400, then 800: the default policy's steps, no jitter.
        assert_eq!(at, [ms(0), ms(200), ms(600), ms(1400)]);
        assert_eq!(load(&stats.posted), 7, "delivered once, all 7 results");
        assert_eq!(load(&stats.retries), 3);
        assert_eq!(load(&stats.dropped_failed), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_batch_out_of_attempts_waits_never_more_than_the_max_and_is_dropped_once() {
        let policy = RetryPolicy {
            max_attempts: 6,
            base: Duration::from_secs(1),
            max: Duration::from_secs(3),
        };
        let script = vec![Some(PostOutcome::Status(500)); 6];
        let start = tokio::time::Instant::now();
        let (at, stats) = scripted(script, 5, policy).await;
        // delays 1 s, 2 s, then the 3 s max three times
        assert_eq!(at, [0, 1, 3, 6, 9, 12].map(Duration::from_secs));
        assert_eq!(
            start.elapsed(),
            Duration::from_secs(12),
            "no wait after the last attempt"
        );
        assert_eq!(load(&stats.dropped_failed), 5, "the batch, dropped once");
        assert_eq!((load(&stats.posted), load(&stats.retries)), (0, 5));
    }

    #[tokio::test(start_paused = true)]
    async fn a_post_that_never_answers_is_cut_at_the_post_timeout_and_retried() {
        let script = vec![None, None, Some(PostOutcome::Status(200))];
        let (at, stats) = scripted(script, 2, RetryPolicy::default()).await;
        let first = POST_TIMEOUT + ms(200);
        assert_eq!(at, [ms(0), first, first + POST_TIMEOUT + ms(400)]);
        assert_eq!((load(&stats.posted), load(&stats.retries)), (2, 2));
    }

    #[tokio::test(start_paused = true)]
    async fn a_final_answer_ends_the_batch_at_once_without_a_retry() {
        let policy = RetryPolicy::default();
        for status in [400, 404, 413] {
            let start = tokio::time::Instant::now();
            let (at, stats) = scripted(vec![Some(PostOutcome::Status(status))], 3, policy).await;
            assert_eq!(at, [ms(0)], "{status}");
            assert_eq!(start.elapsed(), Duration::ZERO, "{status}: no wait");
            assert_eq!((load(&stats.dropped_failed), load(&stats.retries)), (3, 0));
        }
    }
}
