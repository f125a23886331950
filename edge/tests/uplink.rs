//! The uplink and the node against a minimal in-process gateway (real QUIC,
//! real protocol, on 127.0.0.1): stale frames are reset instead of sent,
//! hints change the frame rate live, a dropped connection is redialled with
//! every camera re-opened, and a malformed control stream or result stream
//! is answered as protocol §7.3 says. The gateway is reached by IP address
//! and by host name; a name that does not resolve is an error naming it. A
//! gateway that is connected but never answers is given up on and closed.
//! A node whose cameras stop waits for the result of every frame it sent; a
//! gateway that drops the edge right after `Welcome` is redialled ever more
//! slowly; a dial into a dead link is abandoned at its bound and started
//! afresh; frames awaiting their results when the connection drops are
//! counted lost with it, and every frame sent ends once; a CA file
//! rewritten while the edge runs does not stop a redial, and one missing
//! at start is reported as a local problem. The uplink's QUIC counters
//! cover what was sent, within QUIC's framing, and carry over reconnects,
//! each counted once with its reason. Every wait is bounded.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tidegate_edge::uplink::{
    HANDSHAKE_TIMEOUT, Incoming, LaneStats, Uplink, UplinkError, UplinkOptions,
};
use tidegate_protocol::quic::{read_message, write_message};
use tidegate_protocol::{
    CameraAccepted, ColorOrder, ControlHint, DType, Encoding, ErrorCode, Frame, FrameResult,
    GatewayAddr, Geometry, InputSpec, Layout, Limits, Message, Resize, Status, Tensor, Timings,
    Welcome,
};
use tokio::sync::{Notify, mpsc, oneshot};

const WAIT: Duration = Duration::from_secs(20);

/// Bytes that no decoder accepts: the header's magic is wrong.
const GARBAGE: [u8; 64] = [0xEE; 64];

/// One frame the gateway read whole.
#[derive(Debug, Clone)]
#[cfg_attr(not(feature = "capture"), allow(dead_code))]
struct Seen {
    camera: String,
    seq: u64,
    /// Which connection carried it: 1 for the first.
    conn: usize,
    /// Its tensor's encoding, shape and bytes.
    encoding: Encoding,
    shape: Vec<u32>,
    data: Bytes,
}

type Frames = Arc<Mutex<Vec<Seen>>>;

/// Just enough gateway: welcomes anyone, accepts every camera at 64×64 RGB,
/// records whole frames, sends hints on demand, and on demand drops the
/// connection or sends garbage on the control stream.
struct FakeGateway {
    addr: SocketAddr,
    _dir: tempfile::TempDir,
    ca: std::path::PathBuf,
    frames: Frames,
    opens: Arc<Mutex<Vec<String>>>,
    hints: Arc<Mutex<Option<mpsc::UnboundedSender<ControlHint>>>>,
    kick: Arc<Notify>,
    poison: Arc<Notify>,
    /// How each connection ended, in the order they ended.
    closes: Arc<Mutex<Vec<quinn::ConnectionError>>>,
    /// Connections accepted (QUIC handshake done).
    #[cfg_attr(not(feature = "capture"), allow(dead_code))]
    connections: Arc<AtomicUsize>,
}

/// The model input side (square) a [`FakeGateway`] announces on its
/// `n`th connection (1 for the first).
type SideOf = fn(usize) -> u32;

/// How a [`FakeGateway`] behaves beyond welcoming and accepting cameras.
#[derive(Clone, Copy)]
struct Behaviour {
    side: SideOf,
    /// Answer every frame read with an `ok` result this long after.
    answer_after: Option<Duration>,
    /// Also send, at once for every frame read, a result for a frame the
    /// edge is not waiting for (as for a frame it reset that the gateway had
    /// read anyway): seq + [`EXTRA_SEQ`].
    extra_results: bool,
    /// Close every connection this long after `Welcome`.
    drop_after_welcome: Option<Duration>,
}

impl Default for Behaviour {
    fn default() -> Self {
        Behaviour {
            side: |_| 64,
            answer_after: None,
            extra_results: false,
            drop_after_welcome: None,
        }
    }
}

/// What [`Behaviour::extra_results`] adds to a frame's seq.
#[cfg_attr(not(feature = "capture"), allow(dead_code))]
const EXTRA_SEQ: u64 = 1_000_000;

/// A test certificate and the server config that uses it.
fn tls() -> (tempfile::TempDir, std::path::PathBuf, quinn::ServerConfig) {
    let dir = tempfile::tempdir().unwrap();
    let key = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
    let (ca, key_path) = (dir.path().join("ca.pem"), dir.path().join("key.pem"));
    std::fs::write(&ca, key.cert.pem()).unwrap();
    std::fs::write(&key_path, key.signing_key.serialize_pem()).unwrap();
    let config = tidegate_protocol::quic::server_config(&ca, &key_path).unwrap();
    (dir, ca, config)
}

impl FakeGateway {
    fn start() -> FakeGateway {
        FakeGateway::start_as(Behaviour::default())
    }

    /// A gateway that announces a `side(n)`×`side(n)` input on its `n`th
    /// connection.
    #[cfg_attr(not(feature = "capture"), allow(dead_code))]
    fn start_with(side: SideOf) -> FakeGateway {
        FakeGateway::start_as(Behaviour {
            side,
            ..Behaviour::default()
        })
    }

    fn start_as(behaviour: Behaviour) -> FakeGateway {
        let (dir, ca, config) = tls();
        let endpoint = quinn::Endpoint::server(config, "127.0.0.1:0".parse().unwrap()).unwrap();
        let gw = FakeGateway {
            addr: endpoint.local_addr().unwrap(),
            _dir: dir,
            ca,
            frames: Frames::default(),
            opens: Arc::default(),
            hints: Arc::default(),
            kick: Arc::new(Notify::new()),
            poison: Arc::new(Notify::new()),
            closes: Arc::default(),
            connections: Arc::default(),
        };
        let shared = Shared {
            frames: gw.frames.clone(),
            opens: gw.opens.clone(),
            hints: gw.hints.clone(),
            kick: gw.kick.clone(),
            poison: gw.poison.clone(),
            behaviour,
        };
        let closes = gw.closes.clone();
        let connections = gw.connections.clone();
        tokio::spawn(async move {
            let mut n = 0;
            while let Some(incoming) = endpoint.accept().await {
                let Ok(conn) = incoming.await else { continue };
                n += 1;
                connections.fetch_add(1, Ordering::SeqCst);
                let (watched, closes) = (conn.clone(), closes.clone());
                tokio::spawn(async move {
                    let why = watched.closed().await;
                    closes.lock().unwrap().push(why);
                });
                tokio::spawn(serve(conn, n, shared.clone()));
            }
        });
        gw
    }

    #[cfg_attr(not(feature = "capture"), allow(dead_code))]
    fn hint(&self, camera: &str, max_fps: f32) {
        let tx = self
            .hints
            .lock()
            .unwrap()
            .clone()
            .expect("an edge is connected");
        tx.send(ControlHint {
            camera: camera.into(),
            max_fps,
            motion_threshold: 0.0,
        })
        .unwrap();
    }

    fn frames(&self) -> Vec<Seen> {
        self.frames.lock().unwrap().clone()
    }
}

/// What every connection of a [`FakeGateway`] shares.
#[derive(Clone)]
struct Shared {
    frames: Frames,
    opens: Arc<Mutex<Vec<String>>>,
    hints: Arc<Mutex<Option<mpsc::UnboundedSender<ControlHint>>>>,
    kick: Arc<Notify>,
    poison: Arc<Notify>,
    behaviour: Behaviour,
}

/// Sends `r` on a result stream of its own (the edge may be gone).
async fn send_result(conn: &quinn::Connection, r: FrameResult) {
    if let Ok(mut s) = conn.open_uni().await
        && write_message(&mut s, &Message::Result(r)).await.is_ok()
    {
        let _ = s.finish();
    }
}

/// The `ok` result of frame `seq` of `camera`.
fn result_of(camera: &str, seq: u64) -> FrameResult {
    FrameResult {
        camera: camera.into(),
        ..result(seq)
    }
}

async fn serve(conn: quinn::Connection, n: usize, shared: Shared) {
    let Shared {
        frames,
        opens,
        hints,
        kick,
        poison,
        behaviour,
    } = shared;
    let side = behaviour.side;
    let limits = Limits::default();
    let Ok((mut send, mut recv)) = conn.accept_bi().await else {
        return;
    };
    let Ok(Some(Message::Hello(_))) = read_message(&mut recv, &limits).await else {
        return;
    };
    let welcome = Message::Welcome(Welcome {
        session: 1,
        heartbeat_ms: 1000,
    });
    if write_message(&mut send, &welcome).await.is_err() {
        return;
    }
    if let Some(after) = behaviour.drop_after_welcome {
        tokio::time::sleep(after).await;
        conn.close(0u32.into(), b"dropped right after Welcome by the test");
        return;
    }
    let (tx, mut hint_rx) = mpsc::unbounded_channel();
    *hints.lock().unwrap() = Some(tx);
    let uni = conn.clone();
    tokio::spawn(async move {
        while let Ok(mut r) = uni.accept_uni().await {
            let frames = frames.clone();
            let conn = uni.clone();
            tokio::spawn(async move {
                let Ok(Some(Message::Frame(f))) = read_message(&mut r, &Limits::default()).await
                else {
                    return;
                };
                frames.lock().unwrap().push(Seen {
                    camera: f.camera.clone(),
                    seq: f.seq,
                    conn: n,
                    encoding: f.tensor.encoding,
                    shape: f.tensor.shape.clone(),
                    data: f.tensor.data.clone(),
                });
                if behaviour.extra_results {
                    send_result(&conn, result_of(&f.camera, f.seq + EXTRA_SEQ)).await;
                }
                if let Some(after) = behaviour.answer_after {
                    tokio::time::sleep(after).await;
                    send_result(&conn, result_of(&f.camera, f.seq)).await;
                }
            });
        }
    });
    loop {
        tokio::select! {
            msg = read_message(&mut recv, &limits) => match msg {
                Ok(Some(Message::CameraOpen(o))) => {
                    opens.lock().unwrap().push(o.camera.clone());
                    let accepted = Message::CameraAccepted(CameraAccepted {
                        camera: o.camera,
                        model: o.model,
                        input: InputSpec {
                            width: side(n),
                            height: side(n),
                            channels: 3,
                            dtype: DType::U8,
                            layout: Layout::Nhwc,
                            color: ColorOrder::Rgb,
                            resize: Resize::Stretch,
                        },
                        labels: vec!["face".into()],
                        encoding: o.encoding,
                        copies: o.copies,
                    });
                    if write_message(&mut send, &accepted).await.is_err() {
                        return;
                    }
                }
                Ok(Some(_)) => {}
                _ => return,
            },
            Some(h) = hint_rx.recv() => {
                if write_message(&mut send, &Message::ControlHint(h)).await.is_err() {
                    return;
                }
            }
            _ = kick.notified() => {
                conn.close(0u32.into(), b"kicked by the test");
                return;
            }
            _ = poison.notified() => {
                // The edge must close the connection; keep reading until it does.
                if send.write_all(&GARBAGE).await.is_err() {
                    return;
                }
            }
        }
    }
}

/// A gateway for one edge, scripted by the test: it welcomes the edge and
/// hands over its side of the connection and of the control stream.
struct ScriptedGateway {
    addr: SocketAddr,
    _dir: tempfile::TempDir,
    ca: std::path::PathBuf,
    accepted: oneshot::Receiver<(quinn::Connection, quinn::SendStream, quinn::RecvStream)>,
    _endpoint: quinn::Endpoint,
}

impl ScriptedGateway {
    fn start() -> ScriptedGateway {
        let (dir, ca, config) = tls();
        let endpoint = quinn::Endpoint::server(config, "127.0.0.1:0".parse().unwrap()).unwrap();
        let (tx, accepted) = oneshot::channel();
        let ep = endpoint.clone();
        tokio::spawn(async move {
            let conn = ep.accept().await.unwrap().await.unwrap();
            let (mut send, mut recv) = conn.accept_bi().await.unwrap();
            let hello = read_message(&mut recv, &Limits::default()).await.unwrap();
            assert!(matches!(hello, Some(Message::Hello(_))), "{hello:?}");
            let welcome = Message::Welcome(Welcome {
                session: 1,
                heartbeat_ms: 1000,
            });
            write_message(&mut send, &welcome).await.unwrap();
            let _ = tx.send((conn, send, recv));
        });
        ScriptedGateway {
            addr: endpoint.local_addr().unwrap(),
            _dir: dir,
            ca,
            accepted,
            _endpoint: endpoint,
        }
    }

    /// Connects an edge; returns it and the gateway's side (which lasts as
    /// long as `self`).
    async fn connect(
        &mut self,
    ) -> (
        Uplink,
        tidegate_protocol::queue::Receiver<Incoming>,
        (quinn::Connection, quinn::SendStream, quinn::RecvStream),
    ) {
        let addr = GatewayAddr::from(self.addr);
        self.connect_to(&addr).await
    }

    /// [`Self::connect`], the edge given `addr` for the gateway.
    async fn connect_to(
        &mut self,
        addr: &GatewayAddr,
    ) -> (
        Uplink,
        tidegate_protocol::queue::Receiver<Incoming>,
        (quinn::Connection, quinn::SendStream, quinn::RecvStream),
    ) {
        let connect = Uplink::connect(addr, "localhost", &self.ca, "edge-1", "t");
        let (up, incoming) = tokio::time::timeout(WAIT, connect)
            .await
            .expect("the edge connects in time")
            .expect("edge connects");
        let side = tokio::time::timeout(WAIT, &mut self.accepted)
            .await
            .expect("the gateway accepts")
            .unwrap();
        (up, incoming, side)
    }
}

/// A gateway whose QUIC stack is alive, so the edge's keep-alives hold the
/// connection open, but which never answers: it reads `Hello` and (with
/// `welcome`) sends `Welcome`, then reads on without a word. It reports how
/// the connection ended.
struct SilentGateway {
    addr: SocketAddr,
    _dir: tempfile::TempDir,
    ca: std::path::PathBuf,
    closed: oneshot::Receiver<quinn::ConnectionError>,
    _endpoint: quinn::Endpoint,
}

impl SilentGateway {
    fn start(welcome: bool) -> SilentGateway {
        let (dir, ca, config) = tls();
        let endpoint = quinn::Endpoint::server(config, "127.0.0.1:0".parse().unwrap()).unwrap();
        let (tx, closed) = oneshot::channel();
        let ep = endpoint.clone();
        tokio::spawn(async move {
            let conn = ep.accept().await.unwrap().await.unwrap();
            let (mut send, mut recv) = conn.accept_bi().await.unwrap();
            let hello = read_message(&mut recv, &Limits::default()).await.unwrap();
            assert!(matches!(hello, Some(Message::Hello(_))), "{hello:?}");
            if welcome {
                let welcome = Message::Welcome(Welcome {
                    session: 1,
                    heartbeat_ms: 1000,
                });
                write_message(&mut send, &welcome).await.unwrap();
            }
            // Read and ignore (a `CameraOpen`) until the edge gives up.
            while let Ok(Some(_)) = read_message(&mut recv, &Limits::default()).await {}
            let _ = tx.send(conn.closed().await);
        });
        SilentGateway {
            addr: endpoint.local_addr().unwrap(),
            _dir: dir,
            ca,
            closed,
            _endpoint: endpoint,
        }
    }

    /// How the edge ended the connection: a close with code 0 and a reason
    /// that names what went unanswered.
    async fn assert_closed_by_the_edge(self, unanswered: &str) {
        let why = tokio::time::timeout(WAIT, self.closed)
            .await
            .expect("the edge closes the connection")
            .unwrap();
        match &why {
            quinn::ConnectionError::ApplicationClosed(c) => {
                assert_eq!(u64::from(c.error_code), 0, "{why:?}");
                let reason = String::from_utf8_lossy(&c.reason);
                assert!(reason.contains(unanswered), "{reason}");
            }
            other => panic!("closed with {other:?}"),
        }
    }
}

/// The gateway's QUIC stack answers the keep-alives, so the idle timeout
/// never fires; only the edge's own deadline ends the wait for `Welcome`.
/// The bound below is the deadline plus slack, not a measure of speed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_that_never_welcomes_fails_the_connect_retryably_and_is_closed() {
    let gw = SilentGateway::start(false);
    let addr = GatewayAddr::from(gw.addr);
    let connect = Uplink::connect(&addr, "localhost", &gw.ca, "edge-1", "t");
    let err = tokio::time::timeout(HANDSHAKE_TIMEOUT + WAIT, connect)
        .await
        .expect("the connect gives up on a gateway that never answers Hello")
        .unwrap_err();
    assert!(
        matches!(
            &err,
            UplinkError::Unresponsive { waiting_for, after, remote }
                if waiting_for.contains("Welcome") && *after == HANDSHAKE_TIMEOUT && *remote == gw.addr
        ),
        "{err:?}"
    );
    assert!(err.retryable(), "the node redials after {err}");
    assert!(err.to_string().contains("did not answer"), "{err}");
    gw.assert_closed_by_the_edge("Welcome").await;
}

/// A UDP socket that reads every datagram and answers none: a link gone
/// dark. It records the port each datagram came from; every dial binds a
/// socket of its own, so each port is one dial.
struct DarkLink {
    addr: SocketAddr,
    ports: Arc<Mutex<Vec<u16>>>,
}

impl DarkLink {
    async fn start() -> DarkLink {
        let socket = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = socket.local_addr().unwrap();
        let ports: Arc<Mutex<Vec<u16>>> = Arc::default();
        let seen = ports.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 65536];
            while let Ok((_, from)) = socket.recv_from(&mut buf).await {
                seen.lock().unwrap().push(from.port());
            }
        });
        DarkLink { addr, ports }
    }

    /// Dials seen so far.
    #[cfg_attr(not(feature = "capture"), allow(dead_code))]
    fn dials(&self) -> usize {
        let mut ports = self.ports.lock().unwrap().clone();
        ports.sort_unstable();
        ports.dedup();
        ports.len()
    }
}

/// A dial into a dead link is abandoned at its bound, retryably, rather
/// than left to back its Initial packets off until QUIC's idle timeout.
/// The bound on the wait is the dial timeout plus slack, not a measure of
/// speed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dial_into_a_dead_link_is_abandoned_at_its_dial_timeout() {
    let (_dir, ca, _) = tls();
    let dark = DarkLink::start().await;
    let options = UplinkOptions {
        dial_timeout: Some(Duration::from_millis(300)),
        ..UplinkOptions::default()
    };
    let addr = GatewayAddr::from(dark.addr);
    let connect = Uplink::connect_with(&addr, "localhost", &ca, "edge-1", "t", options);
    let err = tokio::time::timeout(WAIT, connect)
        .await
        .expect("the dial gives up within its bound")
        .unwrap_err();
    assert!(matches!(err, UplinkError::DialTimeout { .. }), "{err:?}");
    assert!(err.retryable(), "the node redials after {err}");
    assert!(
        err.to_string().contains("no QUIC connection within"),
        "{err}"
    );
    assert!(
        !dark.ports.lock().unwrap().is_empty(),
        "the dial sent its Initial"
    );
}

/// Answers to `CameraOpen` come in order: one that never comes holds back
/// every later one, so the edge closes the connection (its owner redials).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_camera_open_never_answered_fails_retryably_and_closes_the_connection() {
    let gw = SilentGateway::start(true);
    let options = UplinkOptions {
        open_timeout: Duration::from_millis(300),
        ..UplinkOptions::default()
    };
    let addr = GatewayAddr::from(gw.addr);
    let connect = Uplink::connect_with(&addr, "localhost", &gw.ca, "edge-1", "t", options);
    let (up, mut incoming) = tokio::time::timeout(WAIT, connect)
        .await
        .expect("the edge connects in time")
        .expect("edge connects");
    let err = tokio::time::timeout(
        WAIT,
        up.open_camera("door", "m", 80, tidegate_protocol::Encoding::Raw),
    )
    .await
    .expect("the open gives up on a gateway that never answers it")
    .unwrap_err();
    assert!(
        matches!(
            &err,
            UplinkError::Unresponsive { waiting_for, after, .. }
                if waiting_for.contains("CameraOpen") && waiting_for.contains("'door'")
                    && *after == options.open_timeout
        ),
        "{err:?}"
    );
    assert!(err.retryable(), "{err}");
    assert!(up.is_closed(), "the connection is closed for a redial");
    // The owner (the node's link task) sees the end and redials.
    let end = tokio::time::timeout(WAIT, incoming.recv())
        .await
        .expect("the incoming stream ends");
    assert!(end.is_none(), "{end:?}");
    gw.assert_closed_by_the_edge("CameraOpen").await;
}

fn result(seq: u64) -> FrameResult {
    FrameResult {
        camera: "cam".into(),
        seq,
        captured_at_us: 1,
        status: Status::Ok,
        detections: vec![],
        timings: Timings::default(),
        outputs: vec![],
    }
}

fn bytes_of(msg: &Message) -> Vec<u8> {
    let mut out = Vec::new();
    msg.encode(&mut out);
    out
}

/// The gateway given by name, as on the internet or in a cluster: the edge
/// resolves `localhost:<port>` and reaches the gateway on 127.0.0.1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uplink_connects_to_a_gateway_given_by_host_name() {
    let mut gw = ScriptedGateway::start();
    let addr: GatewayAddr = format!("localhost:{}", gw.addr.port()).parse().unwrap();
    let (up, _incoming, (conn, _send, _recv)) = gw.connect_to(&addr).await;
    assert_eq!(up.remote_address(), gw.addr);
    assert!(conn.remote_address().ip().is_loopback());
    assert!(!up.is_closed());
}

/// A name that does not resolve (`.invalid` is reserved, RFC 6761): the
/// connect fails promptly, naming the host, and is retried by the node
/// (DNS may not know the name yet).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unresolvable_gateway_name_is_a_retryable_error_naming_the_host() {
    let (_dir, ca, _) = tls();
    let addr: GatewayAddr = "gateway.invalid:4433".parse().unwrap();
    // Resolving gives up after RESOLVE_TIMEOUT (10 s) at worst.
    let err = tokio::time::timeout(
        Duration::from_secs(30),
        Uplink::connect(&addr, "localhost", &ca, "edge-1", "t"),
    )
    .await
    .expect("the connect did not fail within 30 s")
    .unwrap_err();
    assert!(
        matches!(&err, UplinkError::Connect { addr: a, .. } if *a == addr),
        "{err:?}"
    );
    assert!(err.retryable());
    let text = err.to_string();
    assert!(
        text.starts_with(
            "connecting to gateway gateway.invalid:4433: cannot resolve gateway host \"gateway.invalid\""
        ),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_control_message_closes_the_connection_with_its_code() {
    let mut gw = ScriptedGateway::start();
    let (up, mut incoming, (conn, mut send, _recv)) = gw.connect().await;
    send.write_all(&GARBAGE).await.unwrap();
    // The edge closes the connection with the malformed code (0x102).
    let why = tokio::time::timeout(WAIT, conn.closed())
        .await
        .expect("the edge closes the connection");
    match &why {
        quinn::ConnectionError::ApplicationClosed(c) => {
            assert_eq!(
                u64::from(c.error_code),
                u64::from(ErrorCode::Malformed.quic_code()),
                "{why:?}"
            );
            let reason = String::from_utf8_lossy(&c.reason);
            assert!(reason.contains("malformed"), "{reason}");
        }
        other => panic!("closed with {other:?}"),
    }
    // The owner sees the loss: the incoming stream ends and the uplink is
    // closed, so it redials instead of waiting on a dead conversation.
    let end = tokio::time::timeout(WAIT, incoming.recv())
        .await
        .expect("the incoming stream ends");
    assert!(end.is_none(), "{end:?}");
    assert!(up.is_closed());
    let open = up
        .open_camera("cam", "m", 80, tidegate_protocol::Encoding::Raw)
        .await;
    assert!(matches!(open, Err(UplinkError::Lost(_))), "{open:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_control_message_split_around_a_command_arrives_whole() {
    let mut gw = ScriptedGateway::start();
    let (up, mut incoming, (_conn, mut send, mut recv)) = gw.connect().await;
    let hint = ControlHint {
        camera: "cam".into(),
        max_fps: 2.5,
        motion_threshold: 0.25,
    };
    let bytes = bytes_of(&Message::ControlHint(hint.clone()));
    let (head, tail) = bytes.split_at(bytes.len() / 2);
    send.write_all(head).await.unwrap();
    // Give the edge a moment to start reading the half message, so that the
    // command below lands in the middle of the read (the test holds either
    // way: this only makes a regression likely to show).
    tokio::time::sleep(Duration::from_millis(50)).await;
    up.report_latency("cam", 7, 12_000);
    let got = tokio::time::timeout(WAIT, read_message(&mut recv, &Limits::default()))
        .await
        .expect("the edge writes its command")
        .unwrap();
    assert!(
        matches!(&got, Some(Message::LatencyReport(r)) if r.seq == 7),
        "{got:?}"
    );
    send.write_all(tail).await.unwrap();
    match tokio::time::timeout(WAIT, incoming.recv()).await {
        Ok(Some(Incoming::Hint(h))) => assert_eq!(h, hint),
        other => panic!("expected the hint, got {other:?}"),
    }
    // And the conversation is still in step: a camera open is answered.
    let opening = tokio::spawn({
        let up = up.clone();
        async move {
            up.open_camera("cam", "m", 80, tidegate_protocol::Encoding::Raw)
                .await
        }
    });
    let open = tokio::time::timeout(WAIT, read_message(&mut recv, &Limits::default()))
        .await
        .expect("the edge sends CameraOpen")
        .unwrap();
    let Some(Message::CameraOpen(o)) = open else {
        panic!("expected CameraOpen, got {open:?}")
    };
    let input = InputSpec {
        width: 64,
        height: 64,
        channels: 3,
        dtype: DType::U8,
        layout: Layout::Nhwc,
        color: ColorOrder::Rgb,
        resize: Resize::Stretch,
    };
    let accepted = Message::CameraAccepted(CameraAccepted {
        camera: o.camera,
        model: o.model,
        input,
        labels: vec![],
        encoding: o.encoding,
        copies: o.copies,
    });
    write_message(&mut send, &accepted).await.unwrap();
    let accepted = tokio::time::timeout(WAIT, opening)
        .await
        .expect("the open is answered")
        .unwrap()
        .expect("the camera is accepted");
    assert_eq!(accepted.input, input);
    assert!(!up.is_closed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_result_stream_is_stopped_with_its_code_and_the_rest_go_on() {
    let mut gw = ScriptedGateway::start();
    let (_up, mut incoming, (conn, _send, _recv)) = gw.connect().await;
    let hint = bytes_of(&Message::ControlHint(ControlHint {
        camera: String::new(),
        max_fps: 1.0,
        motion_threshold: 0.0,
    }));
    for (what, bytes) in [("garbage", &GARBAGE[..]), ("a hint", &hint[..])] {
        let mut s = conn.open_uni().await.unwrap();
        s.write_all(bytes).await.unwrap();
        // Not finished: only a STOP_SENDING from the edge ends the wait.
        let code = tokio::time::timeout(WAIT, s.stopped())
            .await
            .unwrap_or_else(|_| panic!("the edge stops the stream carrying {what}"))
            .unwrap();
        assert_eq!(
            code.map(u64::from),
            Some(u64::from(ErrorCode::Malformed.quic_code())),
            "{what}"
        );
    }
    let mut s = conn.open_uni().await.unwrap();
    write_message(&mut s, &Message::Result(result(9)))
        .await
        .unwrap();
    s.finish().unwrap();
    match tokio::time::timeout(WAIT, incoming.recv()).await {
        Ok(Some(Incoming::Result(r))) => assert_eq!(r.seq, 9),
        other => panic!("expected the result, got {other:?}"),
    }
    assert!(conn.close_reason().is_none(), "the connection goes on");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn results_wait_for_a_slow_consumer_instead_of_being_dropped() {
    let mut gw = ScriptedGateway::start();
    let (_up, mut incoming, (conn, _send, _recv)) = gw.connect().await;
    // More results than the readers read at once; nobody consumes them yet.
    let n = 300u64;
    for seq in 0..n {
        let mut s = conn.open_uni().await.unwrap();
        write_message(&mut s, &Message::Result(result(seq)))
            .await
            .unwrap();
        s.finish().unwrap();
    }
    let mut seqs = Vec::new();
    while seqs.len() < n as usize {
        match tokio::time::timeout(WAIT, incoming.recv()).await {
            Ok(Some(Incoming::Result(r))) => seqs.push(r.seq),
            other => panic!("after {} results: {other:?}", seqs.len()),
        }
    }
    seqs.sort_unstable();
    assert_eq!(seqs, (0..n).collect::<Vec<_>>());
}

fn frame(seq: u64, bytes: usize) -> Frame {
    Frame {
        camera: "cam".into(),
        seq,
        captured_at_us: tidegate_edge::clock::now_us(),
        budget_us: 80_000,
        model: "m".into(),
        geometry: Geometry::stretch(64, 64, 64, 64),
        tensor: Tensor::raw(
            DType::U8,
            Layout::Nhwc,
            vec![1, 1, (bytes / 3) as u32, 3],
            Bytes::from(vec![7u8; bytes / 3 * 3]),
        ),
    }
}

/// The seqs the gateway read, once it has read `seq` (bounded), plus a
/// moment for anything that should not arrive to show up.
async fn seqs_once_seen(gw: &FakeGateway, seq: u64) -> Vec<u64> {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !gw.frames().iter().any(|f| f.seq == seq) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the gateway never read frame {seq}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    gw.frames().iter().map(|f| f.seq).collect()
}

async fn connect(gw: &FakeGateway) -> Uplink {
    Uplink::connect(&gw.addr.into(), "localhost", &gw.ca, "edge-1", "token")
        .await
        .expect("edge connects")
        .0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn newer_frame_supersedes_an_unacknowledged_one_which_is_reset_not_sent() {
    let gw = FakeGateway::start();
    let up = connect(&gw).await;
    let stats = Arc::new(LaneStats::default());
    let lane = up.lane("cam", 1, stats.clone());
    let far = tokio::time::Instant::now() + WAIT;
    // 4 MB cannot be acknowledged before the next frame is handed over: it
    // takes many round trips of congestion window to send.
    lane.send(frame(1, 4_000_000), far).await.unwrap();
    lane.send(frame(2, 12_288), far).await.unwrap();
    lane.settle(WAIT).await;
    let load = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(load(&stats.superseded), 1);
    assert_eq!(load(&stats.delivered), 1);
    assert_eq!(lane.in_flight(), 0);
    let seqs = seqs_once_seen(&gw, 2).await;
    assert_eq!(seqs, vec![2], "the superseded frame must not arrive");
    assert_eq!(load(&stats.lost), 0);
}

/// Frames go out newest first across all the connection's cameras: a
/// frame handed after another, of another camera with a lower `seq`, is
/// acknowledged first. (With priorities by `seq` the other would go first;
/// interleaved, the one with the head start.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frame_handed_later_goes_first_whichever_camera_it_is_from() {
    let gw = FakeGateway::start();
    let up = connect(&gw).await;
    let lane_a = up.lane("a", 1, Arc::new(LaneStats::default()));
    let lane_b = up.lane("b", 1, Arc::new(LaneStats::default()));
    let far = tokio::time::Instant::now() + WAIT;
    let big = 1_000_000;
    let a = lane_a
        .send_watched(
            Frame {
                camera: "a".into(),
                ..frame(5, big)
            },
            far,
        )
        .await
        .unwrap();
    let b = lane_b
        .send_watched(
            Frame {
                camera: "b".into(),
                ..frame(1, big)
            },
            far,
        )
        .await
        .unwrap();
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let watch = |name: &'static str, rx: oneshot::Receiver<tidegate_edge::uplink::WireFate>| {
        let order = order.clone();
        async move {
            let fate = tokio::time::timeout(WAIT, rx).await.unwrap().unwrap();
            order.lock().unwrap().push((name, fate));
        }
    };
    tokio::join!(watch("a", a), watch("b", b));
    let order = order.lock().unwrap().clone();
    use tidegate_edge::uplink::WireFate::Delivered;
    assert_eq!(order, vec![("b", Delivered), ("a", Delivered)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frame_past_its_deadline_is_reset_and_never_arrives() {
    let gw = FakeGateway::start();
    let up = connect(&gw).await;
    let stats = Arc::new(LaneStats::default());
    let lane = up.lane("cam", 4, stats.clone());
    let now = tokio::time::Instant::now();
    lane.send(frame(1, 12_288), now - Duration::from_millis(1))
        .await
        .unwrap();
    lane.send(frame(2, 12_288), now + WAIT).await.unwrap();
    lane.settle(WAIT).await;
    let load = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(load(&stats.expired), 1);
    assert_eq!(load(&stats.delivered), 1);
    let seqs = seqs_once_seen(&gw, 2).await;
    assert_eq!(seqs, vec![2], "the expired frame must not arrive");
}

#[cfg(feature = "capture")]
use tidegate_testkit::{clip, shaped_link};

#[cfg(feature = "capture")]
mod node {
    use super::*;
    use tidegate_edge::config::EdgeConfig;
    use tidegate_edge::node::{
        CameraSummary, DIAL_ATTEMPT, NodeError, NodeOptions, REDIAL_BASE, REDIAL_MAX, RESULT_DRAIN,
        Summary, run,
    };
    use tidegate_edge::sink::Sinks;
    use tidegate_edge::uplink_stats::{
        DialResult, DisconnectReason, QuicTotals, UplinkReading, UplinkStats,
    };
    use tokio::sync::watch;

    /// Waits until `pred(frames)` holds.
    async fn until(gw: &FakeGateway, what: &str, pred: impl Fn(&[Seen]) -> bool) {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            if pred(&gw.frames()) {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{what}: not within {WAIT:?} ({} frames)",
                gw.frames().len()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn on_conn(frames: &[Seen], conn: usize) -> usize {
        frames.iter().filter(|f| f.conn == conn).count()
    }

    /// A node with one 20 fps test camera, publishing its counters every
    /// 50 ms. It is given the gateway by name (`localhost:<port>`), so each
    /// redial resolves the name again.
    struct Node {
        stats: watch::Receiver<Vec<CameraSummary>>,
        stop: oneshot::Sender<()>,
        task: tokio::task::JoinHandle<Result<Summary, tidegate_edge::node::NodeError>>,
    }

    /// An edge config for `gw` (by name) with one camera, "cam", of these
    /// settings (`uri = ...`, ...).
    fn edge_config(gw: &FakeGateway, camera: &str) -> EdgeConfig {
        toml::from_str(&format!(
            "name = \"edge-1\"\ntoken = \"t\"\n[gateway]\naddr = \"localhost:{}\"\nca = \"{}\"\n\
             [[cameras]]\nname = \"cam\"\nmodel = \"m\"\n{camera}\n",
            gw.addr.port(),
            gw.ca.display()
        ))
        .unwrap()
    }

    impl Node {
        fn start(gw: &FakeGateway) -> Node {
            Node::start_cfg(edge_config(
                gw,
                "uri = \"test://ball?width=320&height=240\"\nmax_fps = 20",
            ))
        }

        fn start_cfg(cfg: EdgeConfig) -> Node {
            Node::start_recording(cfg, None)
        }

        /// [`Node::start_cfg`], the node recording its uplink in `uplink`.
        fn start_recording(cfg: EdgeConfig, uplink: Option<Arc<UplinkStats>>) -> Node {
            let (stats_tx, stats) = watch::channel(Vec::new());
            let (stop, stop_rx) = oneshot::channel::<()>();
            let options = NodeOptions {
                summary_every: Some(Duration::from_millis(50)),
                stats: Some(stats_tx),
                uplink,
                ..NodeOptions::default()
            };
            let task = tokio::spawn(run(cfg, Sinks::default(), options, async move {
                let _ = stop_rx.await;
            }));
            Node { stats, stop, task }
        }

        /// The camera's counters, once `pred` holds for them.
        async fn camera(
            &mut self,
            what: &str,
            pred: impl Fn(&CameraSummary) -> bool,
        ) -> CameraSummary {
            let got =
                tokio::time::timeout(WAIT, self.stats.wait_for(|c| c.first().is_some_and(&pred)))
                    .await
                    .map(|r| r.expect("the node publishes its counters")[0].clone());
            match got {
                Ok(c) => c,
                Err(_) => panic!("{what}: not within {WAIT:?}: {:?}", self.stats.borrow()),
            }
        }

        async fn stop(self) -> Summary {
            self.stop.send(()).unwrap();
            tokio::time::timeout(WAIT, self.task)
                .await
                .expect("node stops")
                .unwrap()
                .unwrap()
        }
    }

    /// Bytes of one frame's tensor: the camera sends raw 64×64 RGB.
    const RAW_FRAME: u64 = 64 * 64 * 3;
    /// What a `Frame` message adds to its tensor (header, camera, model,
    /// shape, geometry), at most.
    const FRAME_FRAMING: u64 = 256;
    /// What QUIC adds to a datagram beyond the stream data it carries
    /// (header, packet number, AEAD tag, frame headers, ACKs), or a
    /// datagram of its own carries (ACK, PING, a small control message),
    /// at most.
    const PER_DATAGRAM: u64 = 96;
    /// A connection's bytes beyond its frames and datagrams' overhead: the
    /// handshake (Initials padded to 1200 bytes), path MTU probes, `Hello`
    /// and `CameraOpen`, and a frame cut short when the connection went.
    const PER_CONNECTION: u64 = 32 * 1024;

    /// Every counter of `b` is at least `a`'s.
    fn not_backwards(a: &QuicTotals, b: &QuicTotals) -> bool {
        b.sent_bytes >= a.sent_bytes
            && b.received_bytes >= a.received_bytes
            && b.sent_datagrams >= a.sent_datagrams
            && b.sent_packets >= a.sent_packets
            && b.lost_packets >= a.lost_packets
            && b.congestion_events >= a.congestion_events
    }

    /// The uplink's QUIC counters on a real link (127.0.0.1): the bytes
    /// sent cover every frame the gateway read whole and stay within the
    /// frames handed plus QUIC's framing; the gateway closing the
    /// connection twice makes exactly two reconnects, each loss counted
    /// with its reason; and no counter goes backwards across them, read
    /// every few milliseconds throughout as a scrape would.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn uplink_counters_cover_what_was_sent_and_carry_over_reconnects() {
        const KICKS: u64 = 2;
        // Frames the gateway reads on each connection before the next step:
        // enough that one connection counted twice, or not at all, falls
        // outside the bounds below.
        const PER_LINK: usize = 20;
        let gw = FakeGateway::start();
        let cfg = edge_config(
            &gw,
            "uri = \"test://ball?width=320&height=240\"\nmax_fps = 20\nencoding = \"raw\"",
        );
        let uplink = tidegate_edge::node::uplink_stats(&cfg);
        let zero = uplink.read(std::time::Instant::now());
        assert_eq!(zero.totals, QuicTotals::default());
        assert!(!zero.connected && zero.dials == [0; 4] && zero.reconnects == 0);

        // Reads the record as a scrape does until told to stop (bounded).
        let (done_tx, mut done) = oneshot::channel::<()>();
        let sampler = tokio::spawn({
            let uplink = uplink.clone();
            async move {
                let deadline = tokio::time::Instant::now() + 8 * WAIT;
                let mut last: UplinkReading = uplink.read(std::time::Instant::now());
                let mut reads = 1u64;
                while tokio::time::Instant::now() < deadline && done.try_recv().is_err() {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    let now = uplink.read(std::time::Instant::now());
                    assert!(
                        not_backwards(&last.totals, &now.totals),
                        "a counter went backwards: {:?} then {:?}",
                        last.totals,
                        now.totals
                    );
                    assert!(now.reconnects >= last.reconnects && now.dials >= last.dials);
                    last = now;
                    reads += 1;
                }
                reads
            }
        });

        let node = Node::start_recording(cfg, Some(uplink.clone()));
        until(&gw, "frames on the first connection", |f| {
            on_conn(f, 1) >= PER_LINK
        })
        .await;
        let first = uplink.read(std::time::Instant::now());
        assert!(first.connected, "{first:?}");
        assert!(
            first.totals.sent_bytes >= PER_LINK as u64 * RAW_FRAME,
            "the gateway read {PER_LINK} frames of {RAW_FRAME} bytes: {first:?}"
        );
        assert!(first.cwnd > 0 && first.rtt > Duration::ZERO, "{first:?}");
        let mut kicked_at = std::time::Instant::now();
        for n in 2..=KICKS as usize + 1 {
            kicked_at = std::time::Instant::now();
            gw.kick.notify_one();
            until(&gw, "frames after the gateway closed the connection", |f| {
                on_conn(f, n) >= PER_LINK
            })
            .await;
        }
        let live = uplink.read(std::time::Instant::now());
        assert!(live.connected, "{live:?}");
        assert!(
            live.since_connect <= kicked_at.elapsed(),
            "the last connect came after the last kick: {live:?}"
        );
        let summary = node.stop().await;
        let _ = done_tx.send(());
        let reads = sampler.await.expect("no counter went backwards");
        assert!(reads > 1);

        let r = uplink.read(std::time::Instant::now());
        assert_eq!(r.reconnects, KICKS, "{r:?}");
        assert_eq!(r.dials(DialResult::Ok), KICKS + 1, "{r:?}");
        assert_eq!(
            r.disconnects(DisconnectReason::ClosedByGateway),
            KICKS,
            "{r:?}"
        );
        // The node closed the last connection as it stopped.
        assert_eq!(r.disconnects(DisconnectReason::ClosedByEdge), 1, "{r:?}");
        assert_eq!(r.disconnects.iter().sum::<u64>(), KICKS + 1, "{r:?}");
        assert!(!r.connected && r.cwnd == 0, "{r:?}");
        assert!(
            not_backwards(&live.totals, &r.totals),
            "{live:?} then {r:?}"
        );

        // Bounds, not speed: every frame the gateway read whole went out
        // at least once, on whichever connection; nothing went out beyond
        // the frames handed and QUIC's framing of them and of the rest.
        let connections = (KICKS + 1) as usize;
        assert_eq!(gw.connections.load(Ordering::SeqCst), connections);
        let read_whole = gw.frames().len() as u64;
        let handed = summary.cameras[0].handed;
        assert!(handed >= read_whole, "{summary:?}");
        let t = r.totals;
        assert!(
            t.sent_bytes >= read_whole * RAW_FRAME,
            "{read_whole} frames of {RAW_FRAME} bytes read, {t:?}"
        );
        let most = handed * (RAW_FRAME + FRAME_FRAMING)
            + t.sent_datagrams * PER_DATAGRAM
            + connections as u64 * PER_CONNECTION;
        assert!(
            t.sent_bytes <= most,
            "{handed} frames handed allow {most} bytes, {t:?}"
        );
        // A datagram carries one packet or more, and a frame's 12 KiB
        // need at least eight datagrams of at most 1500 bytes.
        assert!(t.sent_packets >= t.sent_datagrams, "{t:?}");
        assert!(t.sent_datagrams >= read_whole * (RAW_FRAME / 1500), "{t:?}");
        assert!(t.lost_packets <= t.sent_packets, "{t:?}");
        // Welcome, CameraAccepted and the acknowledgements came back.
        assert!(t.received_bytes > 0, "{t:?}");
    }

    // The test source runs at exactly 20 fps on its own clock, which is the
    // clock the gate measures (frame n at n × 50 ms), so its counters are
    // exact whatever the machine's speed: at the configured 20 fps cap the
    // gate skips nothing; under a 4 fps cap it passes one frame in five.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn hints_change_the_rate_live_and_a_reconnect_reopens_the_camera_without_them() {
        let gw = FakeGateway::start();
        let mut node = Node::start(&gw);
        until(&gw, "frames at the configured rate", |f| f.len() >= 15).await;
        let a = node
            .camera("counters of the first 15 frames", |c| c.passed >= 15)
            .await;
        assert_eq!(
            a.skipped_rate, 0,
            "at its own rate nothing is capped: {a:?}"
        );
        assert_eq!(a.max_fps, 20.0);

        // The gateway asks every camera for at most 4 fps.
        gw.hint("", 4.0);
        let b0 = node
            .camera("the hint in force", |c| {
                c.max_fps == 4.0 && c.skipped_rate > 0
            })
            .await;
        let b1 = node
            .camera("frames under the hint", |c| c.passed >= b0.passed + 5)
            .await;
        let passed = b1.passed - b0.passed;
        let skipped = b1.skipped_rate - b0.skipped_rate;
        // Four skips per frame sent, give or take the frames around the two
        // readings (the gate's arithmetic allows ±4, whatever the phase).
        assert!(
            skipped + 4 >= 4 * passed && skipped <= 4 * passed + 4,
            "under a 4 fps cap {passed} frames passed and {skipped} were skipped"
        );
        assert_eq!(b1.max_fps, 4.0);

        // The connection drops: the edge redials, opens the camera again and
        // forgets the old session's hint.
        let opens_before = gw.opens.lock().unwrap().len();
        gw.kick.notify_one();
        let c0 = node
            .camera("the hint gone after the reconnect", |c| c.max_fps == 20.0)
            .await;
        until(&gw, "frames after the reconnect", |f| on_conn(f, 2) >= 15).await;
        assert!(gw.opens.lock().unwrap().len() > opens_before);

        let summary = node.stop().await;
        let cam = &summary.cameras[0];
        assert_eq!(cam.max_fps, 20.0);
        // The 4 fps schedule runs at most one and a half of its intervals
        // (375 ms) ahead of the last frame sent, so it still skips up to 6
        // frames after the reset; had the hint survived, the 15 frames sent
        // since would have cost ~56.
        assert!(
            cam.skipped_rate <= c0.skipped_rate + 6,
            "skips went on after the reconnect: {c0:?} then {cam:?}"
        );
        assert!(cam.skipped_rate > 0, "{cam:?}");
        // The gateway read at least 30 whole frames (15 on each connection);
        // the frames in flight when the connection dropped (2 at most) may
        // be read without the edge seeing the ack.
        assert!(cam.delivered >= 28, "{cam:?}");
    }

    /// The gateway announces 64×64 on the first connection and 32×32 on the
    /// second: the edge starts a new capture at the new size, and the
    /// camera's `seq` and counters go on from the old capture's.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_new_input_on_reconnect_keeps_seq_increasing_and_counters_counting() {
        let gw = FakeGateway::start_with(|n| if n == 1 { 64 } else { 32 });
        let node = Node::start(&gw);
        // Every counter the node publishes, checked against the one before.
        let mut published = node.stats.clone();
        let watcher = tokio::spawn(async move {
            let mut last: Option<CameraSummary> = None;
            let mut backwards = Vec::new();
            while published.changed().await.is_ok() {
                let Some(now) = published.borrow_and_update().first().cloned() else {
                    continue;
                };
                if let Some(before) = &last {
                    let pairs = [
                        ("seen", before.seen, now.seen),
                        ("passed", before.passed, now.passed),
                        ("dropped_queue", before.dropped_queue, now.dropped_queue),
                        ("restarts", before.restarts, now.restarts),
                    ];
                    for (what, was, is) in pairs {
                        if is < was {
                            backwards.push(format!("{what} {was} -> {is}"));
                        }
                    }
                }
                last = Some(now);
            }
            backwards
        });
        until(&gw, "frames on the first connection", |f| {
            on_conn(f, 1) >= 5
        })
        .await;
        gw.kick.notify_one();
        until(&gw, "frames on the second connection", |f| {
            on_conn(f, 2) >= 5
        })
        .await;
        let frames = gw.frames();
        let last_first = frames.iter().filter(|f| f.conn == 1).map(|f| f.seq).max();
        let first_second = frames.iter().filter(|f| f.conn == 2).map(|f| f.seq).min();
        assert!(
            first_second > last_first,
            "seq went back on the new input: {last_first:?} then {first_second:?}"
        );
        let summary = node.stop().await;
        let backwards = tokio::time::timeout(WAIT, watcher)
            .await
            .expect("the node's counters end with it")
            .unwrap();
        assert!(
            backwards.is_empty(),
            "counters went backwards: {backwards:?}"
        );
        let cam = &summary.cameras[0];
        // Every frame the gateway read passed the gate of one capture or the
        // other, and the summary counts both.
        let read = gw.frames().len() as u64;
        assert!(cam.passed >= read, "{read} frames read: {cam:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_malformed_control_message_makes_the_edge_close_redial_and_reopen() {
        let gw = FakeGateway::start();
        let node = Node::start(&gw);
        until(&gw, "frames on the first connection", |f| {
            on_conn(f, 1) >= 3
        })
        .await;
        gw.poison.notify_one();
        until(&gw, "frames on a new connection", |f| on_conn(f, 2) >= 3).await;
        let first = gw.closes.lock().unwrap().first().cloned();
        match &first {
            Some(quinn::ConnectionError::ApplicationClosed(c)) => assert_eq!(
                u64::from(c.error_code),
                u64::from(ErrorCode::Malformed.quic_code()),
                "{first:?}"
            ),
            other => panic!("the first connection ended with {other:?}"),
        }
        assert!(
            gw.opens.lock().unwrap().len() >= 2,
            "the camera is re-opened"
        );
        let summary = node.stop().await;
        assert_eq!(summary.cameras[0].camera, "cam");
        assert!(
            gw.frames().iter().all(|f| f.camera == "cam"),
            "only the camera's frames arrive"
        );
    }

    /// Writes a 1.5 s, 30 fps MJPEG AVI: about 15 frames at a 10 fps cap.
    fn write_clip(path: &std::path::Path) {
        crate::clip::write_clip_at(path, 45, "30/1");
    }

    /// Runs `cfg` until it returns by itself (bounded), its results written
    /// to a file; returns the summary and the seqs written.
    async fn run_to_end(cfg: EdgeConfig, options: NodeOptions) -> (Summary, Vec<u64>) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("results.jsonl");
        let sinks = Sinks {
            stdout: false,
            file: Some(std::fs::File::create(&path).unwrap()),
            ..Sinks::default()
        };
        let summary = tokio::time::timeout(
            WAIT + RESULT_DRAIN,
            run(cfg, sinks, options, std::future::pending()),
        )
        .await
        .expect("the node returns once its cameras stop")
        .expect("the node runs");
        let written = std::fs::read_to_string(&path)
            .unwrap()
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["seq"]
                    .as_u64()
                    .unwrap()
            })
            .collect();
        (summary, written)
    }

    /// A `file://` camera without `loop` (how a clip is processed) ends
    /// while the gateway still works on its last frames: the node waits for
    /// their results instead of returning at once and losing them.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_file_camera_that_ends_gets_the_result_of_every_frame_it_sent() {
        let gw = FakeGateway::start_as(Behaviour {
            answer_after: Some(Duration::from_millis(300)),
            ..Behaviour::default()
        });
        let dir = tempfile::tempdir().unwrap();
        let clip = dir.path().join("clip.avi");
        write_clip(&clip);
        let cfg = edge_config(
            &gw,
            &format!(
                "uri = \"file://{}\"\nmax_fps = 10\nbudget_ms = 5000",
                clip.display()
            ),
        );
        let (summary, mut written) = run_to_end(cfg, NodeOptions::default()).await;
        let mut read: Vec<u64> = gw.frames().iter().map(|f| f.seq).collect();
        assert!(summary.sent >= 3, "{summary:?}");
        assert_eq!(summary.cameras[0].state, "stopped", "{summary:?}");
        assert_eq!(summary.results, written.len() as u64, "{summary:?}");
        written.sort_unstable();
        read.sort_unstable();
        assert_eq!(
            written, read,
            "every frame the gateway read has its result written ({summary:?})"
        );
        assert!(summary.results >= summary.sent, "{summary:?}");
    }

    /// With `--max-frames` the node waits for the result of each frame it
    /// sent, not for as many results as frames: results for frames it does
    /// not wait for (ones it reset that the gateway had read) do not end the
    /// wait early.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn max_frames_waits_for_each_frames_own_result_not_for_a_count() {
        let gw = FakeGateway::start_as(Behaviour {
            answer_after: Some(Duration::from_millis(300)),
            extra_results: true,
            ..Behaviour::default()
        });
        let cfg = edge_config(
            &gw,
            "uri = \"test://ball?width=320&height=240\"\nmax_fps = 20\nbudget_ms = 5000",
        );
        let options = NodeOptions {
            max_frames: Some(5),
            ..NodeOptions::default()
        };
        let (summary, written) = run_to_end(cfg, options).await;
        let read: Vec<u64> = gw.frames().iter().map(|f| f.seq).collect();
        assert_eq!(summary.sent, 5, "{summary:?}");
        for seq in &read {
            assert!(
                written.contains(seq) && written.contains(&(seq + EXTRA_SEQ)),
                "frame {seq}: results written {written:?} ({summary:?})"
            );
        }
        assert_eq!(summary.results, 2 * read.len() as u64, "{summary:?}");
    }

    /// The most dials the node can make within `elapsed` of its start if its
    /// redial delays double from [`REDIAL_BASE`] to [`REDIAL_MAX`] (each at
    /// least half of its step). An upper bound: a slow machine dials less.
    fn most_dials_within(elapsed: Duration) -> usize {
        let mut step = REDIAL_BASE;
        let mut at = Duration::ZERO;
        // Bounded: `at` grows by at least REDIAL_BASE / 2 a turn.
        for dials in 1..10_000 {
            at += step / 2;
            if at > elapsed {
                return dials;
            }
            step = (step * 2).min(REDIAL_MAX);
        }
        10_000
    }

    /// A gateway that welcomes the edge and drops it at once: the redial
    /// delay keeps doubling (it starts again only after a connection that
    /// stayed up), instead of a redial every 100-200 ms for ever.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_gateway_that_drops_the_edge_after_welcome_is_redialled_ever_more_slowly() {
        let gw = FakeGateway::start_as(Behaviour {
            drop_after_welcome: Some(Duration::from_millis(20)),
            ..Behaviour::default()
        });
        let started = tokio::time::Instant::now();
        let node = Node::start(&gw);
        let window = Duration::from_secs(4);
        tokio::time::sleep(window).await;
        let dials = gw.connections.load(Ordering::SeqCst);
        let elapsed = started.elapsed();
        let summary = node.stop().await;
        let most = most_dials_within(elapsed);
        assert!(dials >= 2, "{dials} dials: the edge redials");
        assert!(
            dials <= most,
            "{dials} dials in {elapsed:?}: at most {most} if the delays double ({summary:?})"
        );
    }

    /// Into a dead link the node dials afresh after each bounded attempt
    /// (a new socket, whose first Initial goes out at once), rather than
    /// waiting on one dial whose Initials back off until the idle timeout.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dead_link_is_dialled_afresh_after_each_bounded_attempt() {
        let (_dir, ca, _) = tls();
        let dark = DarkLink::start().await;
        let cfg = edge_with_cameras(
            dark.addr,
            &ca,
            "[[cameras]]\nname = \"cam\"\nmodel = \"m\"\nuri = \"test://ball\"\n",
        );
        let uplink = tidegate_edge::node::uplink_stats(&cfg);
        let node = Node::start_recording(cfg, Some(uplink.clone()));
        // Two attempts and the longest delays between: the third dial is
        // due by then. With 5 s of slack for a loaded machine, the wait is
        // still shorter than two QUIC idle timeouts (10 s each), which is
        // what three dials would take if an attempt were not bounded.
        let within = 2 * DIAL_ATTEMPT + 2 * REDIAL_MAX + Duration::from_secs(5);
        let deadline = tokio::time::Instant::now() + within;
        while dark.dials() < 3 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{} dials within {within:?}: each attempt should end after {DIAL_ATTEMPT:?}",
                dark.dials(),
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let summary = node.stop().await;
        let cam = &summary.cameras[0];
        assert_eq!((cam.handed, cam.results), (0, 0), "{cam:?}");
        // Each attempt that ended is one timeout, and sent its Initial; the
        // one under way when the node stopped, if any, is not counted.
        let r = uplink.read(std::time::Instant::now());
        let (timeouts, sent) = (r.dials(DialResult::Timeout), dark.dials() as u64);
        assert!(
            timeouts <= sent && sent <= timeouts + 1,
            "{sent} dials seen, {r:?}"
        );
        assert_eq!(r.dials.iter().sum::<u64>(), timeouts, "{r:?}");
        assert_eq!((r.reconnects, r.connected), (0, false), "{r:?}");
        assert_eq!(r.disconnects, [0; 5], "{r:?}");
    }

    /// A gateway that answers every frame 300 ms after reading it, and a
    /// node with one 20 fps test camera of `budget_ms` on it.
    fn answering_after_300_ms(budget_ms: u32) -> (FakeGateway, Node) {
        let gw = FakeGateway::start_as(Behaviour {
            answer_after: Some(Duration::from_millis(300)),
            ..Behaviour::default()
        });
        let node = Node::start_cfg(edge_config(
            &gw,
            &format!(
                "uri = \"test://ball?width=320&height=240\"\nmax_fps = 20\nbudget_ms = {budget_ms}"
            ),
        ));
        (gw, node)
    }

    /// A stopped node's camera: nothing awaits a result, and every frame it
    /// handed to the uplink ended exactly once.
    fn each_frame_ended_once(c: &CameraSummary) {
        assert_eq!(c.awaiting, 0, "{c:?}");
        assert_eq!(
            c.handed,
            c.results
                + c.reset_superseded
                + c.reset_expired
                + c.refused
                + c.lost
                + c.lost_connection
                + c.gave_up,
            "every frame handed ends once: {c:?}"
        );
    }

    /// A shutdown (SIGTERM in the binary) stops the cameras and waits for
    /// the results of the frames still out: the gateway answers each frame
    /// 300 ms after reading it, within the 2 s budget, and no frame the
    /// gateway read is lost with the connection. A rolling restart of an
    /// edge loses no answer.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_shutdown_waits_for_the_results_of_the_frames_still_out() {
        let (gw, mut node) = answering_after_300_ms(2000);
        // Frames out and unanswered at the moment of the shutdown: 300 ms
        // of a 20 fps camera.
        node.camera("results, and frames awaiting theirs", |c| {
            c.results >= 3 && c.awaiting >= 2
        })
        .await;
        let summary = node.stop().await;
        let c = &summary.cameras[0];
        each_frame_ended_once(c);
        assert_eq!(c.lost_connection, 0, "{c:?}");
        assert_eq!(
            c.results,
            gw.frames().len() as u64,
            "every frame the gateway read has its result: {c:?}"
        );
    }

    /// A shutdown's wait for results is bounded by the longest budget plus
    /// a grace: a gateway that never answers does not hold the edge, and
    /// the frames it read count as lost with the connection.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_shutdown_stops_waiting_for_results_that_never_come() {
        let gw = FakeGateway::start();
        let cfg = edge_config(
            &gw,
            "uri = \"test://ball?width=320&height=240\"\nmax_fps = 20\nbudget_ms = 200",
        );
        assert_eq!(
            tidegate_edge::node::shutdown_drain(&cfg),
            Duration::from_millis(200) + tidegate_edge::node::SHUTDOWN_GRACE
        );
        let mut node = Node::start_cfg(cfg);
        node.camera("frames awaiting results", |c| c.awaiting >= 3)
            .await;
        let summary = node.stop().await;
        let c = &summary.cameras[0];
        each_frame_ended_once(c);
        assert_eq!(c.results, 0, "{c:?}");
        assert!(c.lost_connection >= 3, "{c:?}");
    }

    /// The gateway answers each frame 300 ms after reading it, and drops
    /// the connection: the frames it had acknowledged and not answered are
    /// counted `lost_connection`, the edge goes on on a new connection, and
    /// every frame handed to the uplink ends exactly once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn frames_awaiting_their_results_are_lost_with_the_connection_and_every_frame_ends_once()
    {
        let (gw, mut node) = answering_after_300_ms(5000);
        node.camera("results on the first connection", |c| c.results >= 5)
            .await;
        gw.kick.notify_one();
        let lost = node
            .camera("frames lost with the first connection", |c| {
                c.lost_connection > 0
            })
            .await;
        until(&gw, "frames on the second connection", |f| {
            on_conn(f, 2) >= 5
        })
        .await;
        node.camera("results on the second connection", |c| {
            c.results >= lost.results + 5
        })
        .await;
        let summary = node.stop().await;
        let c = &summary.cameras[0];
        each_frame_ended_once(c);
        assert!(c.lost_connection >= lost.lost_connection, "{c:?}");
    }

    /// The CA is loaded once: rewriting it while the edge runs (a rotation
    /// half done, a config management run) does not stop the next redial.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_ca_file_rewritten_while_the_edge_runs_does_not_stop_a_redial() {
        let gw = FakeGateway::start();
        let node = Node::start(&gw);
        until(&gw, "frames on the first connection", |f| {
            on_conn(f, 1) >= 3
        })
        .await;
        std::fs::write(&gw.ca, "not a certificate").unwrap();
        gw.kick.notify_one();
        until(&gw, "frames after the redial", |f| on_conn(f, 2) >= 3).await;
        let summary = node.stop().await;
        assert!(summary.sent >= 6, "{summary:?}");
    }

    /// A CA file that cannot be loaded at start is this machine's problem,
    /// reported as such and naming the file, not as the gateway's refusal.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_missing_ca_file_is_a_local_error_naming_it_not_a_refusal() {
        let gw = FakeGateway::start();
        let mut cfg = edge_config(&gw, "uri = \"test://ball\"");
        cfg.gateway.ca = gw.ca.with_file_name("missing-ca.pem");
        let ran = tokio::time::timeout(
            WAIT,
            run(
                cfg,
                Sinks::default(),
                NodeOptions::default(),
                std::future::pending(),
            ),
        )
        .await
        .expect("the node stops at once");
        let err = ran.expect_err("no CA, no uplink");
        let text = err.to_string();
        assert!(matches!(err, NodeError::Local(_)), "{err:?}");
        assert!(
            text.contains("missing-ca.pem") && !text.contains("refused"),
            "{text}"
        );
        assert_eq!(gw.connections.load(Ordering::SeqCst), 0);
    }

    /// An edge config for `gw` with the cameras given as TOML.
    fn edge_with_cameras(addr: SocketAddr, ca: &std::path::Path, cameras: &str) -> EdgeConfig {
        toml::from_str(&format!(
            "name = \"edge-1\"\ntoken = \"t\"\n[gateway]\naddr = \"{addr}\"\nca = \"{}\"\n{cameras}",
            ca.display()
        ))
        .unwrap()
    }

    fn is_jpeg_file(data: &[u8]) -> bool {
        data.starts_with(&[0xFF, 0xD8]) && data.ends_with(&[0xFF, 0xD9])
    }

    /// Decodes an image file, checking it is `side`×`side` RGB.
    fn decode(data: &[u8], side: u32) -> Vec<u8> {
        let img = image::load_from_memory(data).expect("a valid image file");
        assert_eq!((img.width(), img.height()), (side, side));
        assert_eq!(img.color(), image::ColorType::Rgb8);
        img.into_rgb8().into_raw()
    }

    /// Three cameras of one scene, one per encoding: each frame reaches the
    /// gateway as one file of its camera's encoding that decodes to the
    /// accepted shape (PNG to exactly the raw pixels), and the counters
    /// name the encoding, the quality and the bytes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn each_camera_sends_frames_in_its_own_encoding_and_reports_it() {
        let gw = FakeGateway::start();
        let uri = format!(
            "uri = \"image://{}/../models/testdata/astronaut.png\"\nmax_fps = 10\n",
            env!("CARGO_MANIFEST_DIR")
        );
        let cameras = ["jpeg", "png", "raw"]
            .map(|e| {
                format!(
                    "[[cameras]]\nname = \"{e}\"\nmodel = \"m\"\n{uri}encoding = \"{e}\"\njpeg_quality = 80\nmin_jpeg_quality = 80\n"
                )
            })
            .concat();
        let node = Node::start_cfg(edge_with_cameras(gw.addr, &gw.ca, &cameras));
        let of = |f: &[Seen], cam: &str| f.iter().filter(|s| s.camera == cam).count();
        until(&gw, "frames of every camera", |f| {
            ["jpeg", "png", "raw"].iter().all(|c| of(f, c) >= 3)
        })
        .await;
        let frames = gw.frames();
        let first = |cam: &str| frames.iter().find(|s| s.camera == cam).unwrap().clone();
        let raw = first("raw");
        assert_eq!(raw.encoding, Encoding::Raw);
        assert_eq!(raw.shape, vec![1, 64, 64, 3]);
        assert_eq!(raw.data.len(), 64 * 64 * 3);
        for f in frames.iter().filter(|s| s.camera == "jpeg") {
            // Quality 80 is both the highest and the floor.
            assert!(
                matches!(f.encoding, Encoding::Jpeg { quality: 80 }),
                "{:?}",
                f.encoding
            );
            assert_eq!(f.shape, vec![1, 64, 64, 3]);
            assert!(is_jpeg_file(&f.data), "SOI .. EOI");
            let pixels = decode(&f.data, 64);
            let mad = pixels
                .iter()
                .zip(raw.data.iter())
                .map(|(a, b)| a.abs_diff(*b) as u64)
                .sum::<u64>() as f64
                / pixels.len() as f64;
            assert!(mad < 12.0, "a still scene: mean abs diff {mad:.2}");
        }
        for f in frames.iter().filter(|s| s.camera == "png") {
            assert_eq!(f.encoding, Encoding::Png);
            assert!(decode(&f.data, 64) == raw.data, "PNG is lossless");
        }
        let mut node = node;
        // Counters are published per window; wait for one with frames.
        let find = |c: &[CameraSummary], cam: &str| c.iter().find(|s| s.camera == cam).cloned();
        let got = tokio::time::timeout(
            WAIT,
            node.stats.wait_for(|c| {
                c.iter()
                    .all(|s| s.bytes_per_frame > 0 && (s.camera == "raw" || s.encode_us > 0))
            }),
        )
        .await
        .expect("a window with frames of every camera")
        .unwrap()
        .clone();
        let (jpeg, png, raw) = (
            find(&got, "jpeg").unwrap(),
            find(&got, "png").unwrap(),
            find(&got, "raw").unwrap(),
        );
        assert_eq!((jpeg.encoding, jpeg.quality), ("jpeg", 80), "{jpeg:?}");
        assert_eq!((png.encoding, png.quality), ("png", 0), "{png:?}");
        assert_eq!(
            (raw.encoding, raw.quality, raw.encoded),
            ("raw", 0, 0),
            "{raw:?}"
        );
        assert_eq!(raw.bytes_per_frame, 64 * 64 * 3);
        assert!(jpeg.bytes_per_frame < raw.bytes_per_frame / 2, "{jpeg:?}");
        assert!(jpeg.encoded > 0 && png.encoded > 0);
        assert_eq!(jpeg.encode_failed + png.encode_failed, 0);
        assert_eq!(jpeg.adapt_max_fps, 10.0);
        assert!(jpeg.rtt_ms > 0.0, "{jpeg:?}");
        node.stop().await;
    }

    /// A camera sending 128×128 JPEGs (4.1 KB at its floor, quality 50,
    /// where slow start begins) at 10 fps into a 30 KB/s uplink: frames
    /// miss their deadline, and with the quality at its floor the frame
    /// rate comes down; once the link is open again the rate comes back
    /// first, then the quality. At no time is the rate lowered above the
    /// quality floor.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_thin_uplink_lowers_the_quality_before_the_rate_and_the_rate_recovers_first() {
        const SLOW: Duration = Duration::from_secs(60);
        let gw = FakeGateway::start_with(|_| 128);
        let link =
            crate::shaped_link::ShapedLink::start(gw.addr, 30_000, Duration::from_millis(10)).await;
        let cameras = format!(
            "[[cameras]]\nname = \"cam\"\nmodel = \"m\"\n\
             uri = \"image://{}/../models/testdata/astronaut.png\"\n\
             max_fps = 10\nbudget_ms = 600\nencoding = \"jpeg\"\njpeg_quality = 90\nmin_jpeg_quality = 50\n",
            env!("CARGO_MANIFEST_DIR")
        );
        let mut node = Node::start_cfg(edge_with_cameras(link.addr, &gw.ca, &cameras));
        // Every state (quality, adaptation's rate) the camera went through.
        let mut published = node.stats.clone();
        let states = tokio::spawn(async move {
            let mut seen: Vec<(u8, f64)> = Vec::new();
            while published.changed().await.is_ok() {
                let Some(c) = published.borrow_and_update().first().cloned() else {
                    continue;
                };
                if c.encoding == "jpeg" && seen.last() != Some(&(c.quality, c.adapt_max_fps)) {
                    seen.push((c.quality, c.adapt_max_fps));
                }
            }
            seen
        });
        let wait = |what: &'static str, pred: fn(&CameraSummary) -> bool| {
            let mut stats = node.stats.clone();
            async move {
                let got =
                    tokio::time::timeout(SLOW, stats.wait_for(|c| c.first().is_some_and(pred)))
                        .await
                        .map(|r| r.unwrap()[0].clone());
                match got {
                    Ok(c) => c,
                    Err(_) => panic!("{what}: not within {SLOW:?}: {:?}", stats.borrow()),
                }
            }
        };
        let lowered = wait("the rate lowered", |c| c.adapt_max_fps < 10.0).await;
        assert_eq!(lowered.quality, 50, "{lowered:?}");
        // Reset on the wire: evicted from the full lane by newer frames
        // (`max_in_flight`), or at their deadline.
        assert!(
            lowered.reset_superseded + lowered.reset_expired > 0,
            "{lowered:?}"
        );
        assert!(lowered.max_fps <= lowered.adapt_max_fps, "{lowered:?}");
        // The link opens up.
        link.set_rate(0);
        wait("the rate back", |c| c.adapt_max_fps == 10.0).await;
        let raised = wait("the quality raised", |c| c.quality > 50).await;
        assert_eq!(raised.adapt_max_fps, 10.0, "{raised:?}");
        node.camera("the cap in force follows", |c| c.max_fps == 10.0)
            .await;
        until(&gw, "a frame at the raised quality", |f| {
            f.iter()
                .any(|s| s.encoding == Encoding::Jpeg { quality: 55 })
        })
        .await;
        let summary = node.stop().await;
        let states = states.await.unwrap();
        eprintln!(
            "states (quality, rate cap): {states:?}; {} datagrams dropped at the bottleneck",
            link.dropped.load(Ordering::Relaxed)
        );
        // Slow start: at the floor and the configured rate.
        assert_eq!(states.first(), Some(&(50, 10.0)), "{states:?}");
        for &(quality, fps) in &states {
            assert!((50..=90).contains(&quality), "{states:?}");
            assert!(fps > 0.0 && fps <= 10.0, "{states:?}");
            assert!(
                fps == 10.0 || quality == 50,
                "the rate moved while the quality was above its floor: {states:?}"
            );
        }
        // The frames that got across went at the qualities in force.
        let qualities: Vec<u8> = gw.frames().iter().map(|f| f.encoding.quality()).collect();
        assert!(qualities.contains(&50), "{qualities:?}");
        assert!(
            qualities.iter().all(|q| (50..=90).contains(q)),
            "{qualities:?}"
        );
        let cam = &summary.cameras[0];
        assert!(
            cam.reset_superseded + cam.reset_expired > 0 && cam.delivered > 0,
            "{cam:?}"
        );
    }
}
