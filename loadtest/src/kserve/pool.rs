//! HTTP/1.1 keep-alive connections to one server, at most `max` open.
//!
//! A request takes an idle connection, or opens one while fewer than `max`
//! are open, or is refused at once ([`ExchangeError::NoConnection`]): an
//! open-loop load never queues in the client behind a busy connection.
//! A connection goes back to the idle list once its answer has been read
//! whole; one whose request was abandoned (the caller dropped the future
//! at its deadline) is closed, as HTTP/1 cannot cancel a request on a
//! connection and keep it.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::client::conn::http1::{self, SendRequest};
use hyper::{HeaderMap, Request, StatusCode, Uri};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

type Sender = SendRequest<Full<Bytes>>;

/// Where requests go: the server's address, its `Host`, and the URL's path
/// (a prefix for every request path).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// The resolved address.
    pub addr: SocketAddr,
    /// The `Host` header: the URL's authority.
    pub authority: String,
    /// The URL's path without its trailing `/` (empty for `http://h:p/`).
    pub prefix: String,
}

/// Why a server URL cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TargetError {
    /// Not a URL, or not an `http://` one.
    #[error("--url {url:?}: {why}; give the server's base URL, such as http://127.0.0.1:8000")]
    Url {
        /// The URL given.
        url: String,
        /// What is wrong with it.
        why: String,
    },
    /// The host name does not resolve.
    #[error("resolving {host}:{port}: {source}")]
    Resolve {
        /// The host.
        host: String,
        /// The port.
        port: u16,
        /// The resolver's error.
        source: std::io::Error,
    },
}

impl Target {
    /// The target `url` names (`http://host[:port][/prefix]`), its host
    /// resolved once, now.
    pub async fn resolve(url: &str) -> Result<Target, TargetError> {
        let bad = |why: &str| TargetError::Url {
            url: url.to_string(),
            why: why.to_string(),
        };
        let uri: Uri = url
            .parse()
            .map_err(|e: hyper::http::uri::InvalidUri| bad(&format!("not a URL ({e})")))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some(other) => {
                return Err(bad(&format!(
                    "the scheme is {other}; only http:// is spoken (put a TLS terminator in front for https)"
                )));
            }
            None => return Err(bad("it has no scheme")),
        }
        if uri.query().is_some() {
            return Err(bad("it has a query; give the base URL alone"));
        }
        let authority = uri.authority().ok_or_else(|| bad("it has no host"))?;
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']');
        let port = authority.port_u16().unwrap_or(80);
        let addr = tokio::net::lookup_host((host, port))
            .await
            .map_err(|source| TargetError::Resolve {
                host: host.to_string(),
                port,
                source,
            })?
            .next()
            .ok_or_else(|| TargetError::Resolve {
                host: host.to_string(),
                port,
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "no address"),
            })?;
        Ok(Target {
            addr,
            authority: authority.as_str().to_string(),
            prefix: uri.path().trim_end_matches('/').to_string(),
        })
    }
}

/// An answer read whole.
#[derive(Debug, Clone)]
pub struct Answer {
    /// Its status.
    pub status: StatusCode,
    /// Its headers.
    pub headers: HeaderMap,
    /// Its body.
    pub body: Bytes,
}

/// Why a request got no answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ExchangeError {
    /// Every connection was busy and `max` were open: the request was not
    /// sent.
    #[error("all {max} connections busy; raise --max-connections")]
    NoConnection {
        /// The pool's bound.
        max: usize,
    },
    /// The connection could not be opened.
    #[error("connecting to {addr}: {message}")]
    Connect {
        /// The server.
        addr: SocketAddr,
        /// Why.
        message: String,
    },
    /// The request could not be written or its answer read.
    #[error("{0}")]
    Exchange(String),
    /// The answer's body is longer than the caller allows.
    #[error("the answer's body is over {max} bytes")]
    BodyTooLarge {
        /// The bound.
        max: usize,
    },
}

#[derive(Debug, Default)]
struct PoolState {
    idle: Vec<Sender>,
    /// Connections open: idle, in use, or being opened.
    open: usize,
    opened: u64,
    peak: usize,
}

/// At most `max` keep-alive connections to a [`Target`].
#[derive(Debug)]
pub struct Pool {
    target: Target,
    max: usize,
    state: Mutex<PoolState>,
    /// Every connection's task.
    tasks: TaskTracker,
    stop: CancellationToken,
}

/// A connection held for one exchange; it goes back to the pool's idle
/// list with [`Conn::release`], and is closed if dropped instead.
struct Conn {
    sender: Sender,
    slot: Slot,
    reused: bool,
}

/// One of the pool's `max` places, given back when dropped unless the
/// connection went back to the idle list.
struct Slot {
    pool: Arc<Pool>,
    held: bool,
}

impl Drop for Slot {
    fn drop(&mut self) {
        if self.held {
            self.pool.state.lock().expect("pool lock").open -= 1;
        }
    }
}

impl Conn {
    /// Back to the idle list, if the server kept it open.
    fn release(self) {
        let Conn {
            sender, mut slot, ..
        } = self;
        if !sender.is_closed() {
            slot.pool.state.lock().expect("pool lock").idle.push(sender);
            slot.held = false;
        }
    }
}

/// Attempts at one request when a reused connection turns out closed
/// before anything was written on it (the server closed it while idle).
const ATTEMPTS: usize = 3;

impl Pool {
    /// A pool of at most `max` (at least 1) connections to `target`.
    pub fn new(target: Target, max: usize) -> Arc<Pool> {
        Arc::new(Pool {
            target,
            max: max.max(1),
            state: Mutex::default(),
            tasks: TaskTracker::new(),
            stop: CancellationToken::new(),
        })
    }

    /// The server.
    pub fn target(&self) -> &Target {
        &self.target
    }

    /// Connections opened so far, and the most open at once.
    pub fn stats(&self) -> (u64, usize) {
        let st = self.state.lock().expect("pool lock");
        (st.opened, st.peak)
    }

    /// An idle connection, else a new one while fewer than `max` are open,
    /// else `None`.
    async fn checkout(self: &Arc<Self>) -> Result<Option<Conn>, ExchangeError> {
        let idle = {
            let mut st = self.state.lock().expect("pool lock");
            let mut found = None;
            // Bounded by the idle list, which only shrinks here.
            while let Some(s) = st.idle.pop() {
                if s.is_closed() {
                    st.open -= 1;
                } else {
                    found = Some(s);
                    break;
                }
            }
            if found.is_none() {
                if st.open >= self.max {
                    return Ok(None);
                }
                st.open += 1;
                st.opened += 1;
                st.peak = st.peak.max(st.open);
            }
            found
        };
        let slot = Slot {
            pool: self.clone(),
            held: true,
        };
        if let Some(sender) = idle {
            return Ok(Some(Conn {
                sender,
                slot,
                reused: true,
            }));
        }
        let addr = self.target.addr;
        let connect_error = |e: &dyn std::fmt::Display| ExchangeError::Connect {
            addr,
            message: e.to_string(),
        };
        let stream = TcpStream::connect(addr)
            .await
            .map_err(|e| connect_error(&e))?;
        // A request is written in two parts (head, body): without this,
        // Nagle's algorithm holds the body for the server's delayed ACK.
        stream.set_nodelay(true).map_err(|e| connect_error(&e))?;
        let (sender, connection) = http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| connect_error(&e))?;
        let stop = self.stop.clone();
        self.tasks.spawn(async move {
            tokio::select! {
                r = connection => {
                    if let Err(e) = r {
                        tracing::debug!("connection to {addr} ended: {e}");
                    }
                }
                () = stop.cancelled() => {}
            }
        });
        Ok(Some(Conn {
            sender,
            slot,
            reused: false,
        }))
    }

    /// Sends the request `make` builds on a connection of the pool and
    /// reads its answer whole (at most `max_body` bytes of body). A reused
    /// connection found closed before the request was written is replaced,
    /// at most `ATTEMPTS` (3) times. Dropping the future abandons the
    /// request and closes its connection.
    pub async fn exchange(
        self: &Arc<Self>,
        make: impl Fn() -> Request<Full<Bytes>>,
        max_body: usize,
    ) -> Result<Answer, ExchangeError> {
        let mut last = String::new();
        for _ in 0..ATTEMPTS {
            let Some(mut conn) = self.checkout().await? else {
                return Err(ExchangeError::NoConnection { max: self.max });
            };
            if let Err(e) = conn.sender.ready().await {
                last = format!("the connection closed before the request: {e}");
                if conn.reused {
                    continue;
                }
                return Err(ExchangeError::Exchange(last));
            }
            let response = conn
                .sender
                .send_request(make())
                .await
                .map_err(|e| ExchangeError::Exchange(error_chain(&e)))?;
            let (parts, body) = response.into_parts();
            let body = Limited::new(body, max_body)
                .collect()
                .await
                .map_err(|e| {
                    if e.is::<LengthLimitError>() {
                        ExchangeError::BodyTooLarge { max: max_body }
                    } else {
                        ExchangeError::Exchange(format!("reading the answer: {}", error_chain(&*e)))
                    }
                })?
                .to_bytes();
            conn.release();
            return Ok(Answer {
                status: parts.status,
                headers: parts.headers,
                body,
            });
        }
        Err(ExchangeError::Exchange(last))
    }

    /// Closes every connection and waits, at most `within`, for their
    /// tasks to end.
    pub async fn close(&self, within: Duration) {
        self.state.lock().expect("pool lock").idle.clear();
        self.stop.cancel();
        self.tasks.close();
        let _ = tokio::time::timeout(within, self.tasks.wait()).await;
    }
}

/// An error and its sources, on one line (hyper's own message is often
/// just "connection error").
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    // Bounded: error chains are short, and this caps them anyway.
    for _ in 0..8 {
        let Some(inner) = source else { break };
        s.push_str(": ");
        s.push_str(&inner.to_string());
        source = inner.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_url_is_resolved_once_with_its_port_and_prefix() {
        let t = Target::resolve("http://127.0.0.1:8000").await.unwrap();
        assert_eq!(t.addr, "127.0.0.1:8000".parse().unwrap());
        assert_eq!(
            (t.authority.as_str(), t.prefix.as_str()),
            ("127.0.0.1:8000", "")
        );
        let t = Target::resolve("http://127.0.0.1/triton/").await.unwrap();
        assert_eq!(t.addr.port(), 80);
        assert_eq!(t.prefix, "/triton");
        let t = Target::resolve("http://[::1]:9/").await.unwrap();
        assert_eq!(t.addr, "[::1]:9".parse().unwrap());
    }

    #[tokio::test]
    async fn a_url_that_is_not_plain_http_is_refused_saying_why() {
        for (url, why) in [
            ("https://127.0.0.1:8000", "only http://"),
            ("127.0.0.1:8000", "no scheme"),
            ("http://127.0.0.1:8000/?x=1", "query"),
            ("http://", "not a URL"),
        ] {
            let err = Target::resolve(url).await.unwrap_err().to_string();
            assert!(err.contains(why), "{url}: {err}");
        }
    }

    #[tokio::test]
    async fn no_more_than_max_connections_are_opened_and_the_next_request_is_refused_at_once() {
        // A server that accepts and never answers: each request holds its
        // connection until it is abandoned.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepting = tokio::spawn(async move {
            let mut held = Vec::new();
            // Bounded: the test opens 2 connections.
            while held.len() < 8 {
                let Ok((s, _)) = listener.accept().await else {
                    break;
                };
                held.push(s);
            }
        });
        let target = Target {
            addr,
            authority: addr.to_string(),
            prefix: String::new(),
        };
        let pool = Pool::new(target, 2);
        let make = || {
            Request::get("/")
                .header(hyper::header::HOST, "x")
                .body(Full::new(Bytes::new()))
                .unwrap()
        };
        let mut stuck = tokio::task::JoinSet::new();
        for _ in 0..2 {
            let pool = pool.clone();
            stuck.spawn(async move { pool.exchange(make, 1024).await });
        }
        // Wait (bounded) until both connections are open.
        for _ in 0..500 {
            if pool.stats().0 == 2 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(pool.stats(), (2, 2));
        let refused = tokio::time::timeout(Duration::from_secs(5), pool.exchange(make, 1024))
            .await
            .expect("refused at once, not queued");
        assert_eq!(refused.unwrap_err(), ExchangeError::NoConnection { max: 2 });
        // Abandoning the requests closes their connections and frees the
        // places.
        stuck.abort_all();
        while stuck.join_next().await.is_some() {}
        assert_eq!(pool.state.lock().unwrap().open, 0);
        pool.close(Duration::from_secs(5)).await;
        accepting.abort();
    }
}
