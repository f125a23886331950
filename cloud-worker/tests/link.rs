//! The worker's link against a scripted gateway on 127.0.0.1: a real QUIC
//! connection (a throw-away CA and certificate made for the test), the real
//! `link::run`, and a fake backend on the real executor; the gateway given
//! by host name as well as by IP address.

use std::sync::Arc;
use std::time::Duration;

use tidegate_protocol::quic::{read_message, server_config};
use tidegate_protocol::{
    DType, Dispatch, DispatchItem, Drain, Geometry, Layout, Limits, Message, Register, Status,
    Tensor, Timings, Welcome,
};
use tidegate_worker::backend::{Backend, BackendError, FrameInput, FrameOutcome};
use tidegate_worker::executor::Executor;
use tidegate_worker::link::{self, LinkConfig, LinkEnd};
use tidegate_worker::model::ModelSpec;
use tokio_util::sync::CancellationToken;

/// Answers every frame `Ok`.
struct OkBackend;

impl Backend for OkBackend {
    fn models(&self) -> &[ModelSpec] {
        &[]
    }

    fn run(&mut self, _model: &str, frames: &[FrameInput]) -> Vec<FrameOutcome> {
        frames
            .iter()
            .map(|_| FrameOutcome {
                status: Status::Ok,
                detections: Vec::new(),
                timings: Timings::default(),
                outputs: Vec::new(),
            })
            .collect()
    }

    fn profile(&mut self, _: &str, _: &[u16]) -> Result<Vec<(u16, u32)>, BackendError> {
        Ok(Vec::new())
    }
}

/// A scripted gateway's QUIC endpoint on 127.0.0.1, with a throw-away CA
/// and a certificate for `localhost` (kept in the returned folder).
fn gateway_endpoint() -> (
    quinn::Endpoint,
    tidegate_protocol::certs::DevCerts,
    tempfile::TempDir,
) {
    let dir = tempfile::tempdir().unwrap();
    let tls = tidegate_protocol::certs::generate(dir.path(), &["localhost".to_string()])
        .expect("test certificates");
    let server = server_config(&tls.server_cert, &tls.server_key).unwrap();
    let endpoint = quinn::Endpoint::server(server, "127.0.0.1:0".parse().unwrap()).unwrap();
    (endpoint, tls, dir)
}

/// Accepts the worker's connection and its control stream, reads its
/// `Hello`, welcomes it and reads its `Register`.
async fn accept_worker(
    endpoint: &quinn::Endpoint,
    limits: &Limits,
) -> (quinn::Connection, quinn::SendStream, quinn::RecvStream) {
    let conn = endpoint.accept().await.unwrap().await.unwrap();
    let (mut ctl_send, mut ctl_recv) = conn.accept_bi().await.unwrap();
    let hello = read_message(&mut ctl_recv, limits).await.unwrap();
    assert!(matches!(hello, Some(Message::Hello(_))), "{hello:?}");
    let welcome = Message::Welcome(Welcome {
        session: 1,
        heartbeat_ms: 100,
    });
    tidegate_protocol::quic::write_message(&mut ctl_send, &welcome)
        .await
        .unwrap();
    let register = read_message(&mut ctl_recv, limits).await.unwrap();
    assert!(
        matches!(register, Some(Message::Register(_))),
        "{register:?}"
    );
    (conn, ctl_send, ctl_recv)
}

fn item(id: u64) -> DispatchItem {
    DispatchItem {
        id,
        camera: "cam".into(),
        seq: id,
        geometry: Geometry::stretch(2, 2, 2, 2),
        tensor: Tensor::raw(
            DType::U8,
            Layout::Nhwc,
            vec![1, 2, 2, 3],
            vec![7u8; 12].into(),
        ),
    }
}

/// A dispatch the gateway sent just before draining the worker, whose
/// bytes stall on the way for longer than the drain's quiet period: the
/// worker must keep the link open until it has read, run and answered it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_waits_for_a_dispatch_still_being_read() {
    let limits = Limits::default();
    let (endpoint, tls, _dir) = gateway_endpoint();
    let cfg = LinkConfig {
        gateway: endpoint.local_addr().unwrap().into(),
        server_name: "localhost".into(),
        ca: tls.ca_cert.clone(),
        name: "w".into(),
        token: "t".into(),
    };
    let executor = Arc::new(Executor::spawn(Box::new(OkBackend), 4));
    let register = Register {
        worker: "w".into(),
        device: "test".into(),
        models: Vec::new(),
        profile: Vec::new(),
        codecs: Vec::new(),
    };
    let worker = tokio::spawn({
        let executor = executor.clone();
        async move { link::run(&cfg, executor, register, CancellationToken::new()).await }
    });

    // Bounds a broken link so that the test fails instead of hanging; no
    // assertion depends on how fast anything runs.
    let script = async {
        let (conn, mut ctl_send, _ctl_recv) = accept_worker(&endpoint, &limits).await;

        // Half of a dispatch, then the drain.
        let dispatch = Message::Dispatch(Dispatch {
            batch: 7,
            model: "m".into(),
            items: vec![item(1), item(2)],
        });
        let mut bytes = Vec::new();
        dispatch.encode(&mut bytes);
        let half = bytes.len() / 2;
        let mut stream = conn.open_uni().await.unwrap();
        stream.write_all(&bytes[..half]).await.unwrap();
        let drain = Message::Drain(Drain {
            deadline_ms: 10_000,
        });
        tidegate_protocol::quic::write_message(&mut ctl_send, &drain)
            .await
            .unwrap();
        // The rest comes after several of the drain's quiet periods
        // (250 ms): a worker that stopped at the quiet period would have
        // closed the connection by now, the batch unanswered.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        stream.write_all(&bytes[half..]).await.unwrap();
        stream.finish().unwrap();

        let mut answer = conn.accept_uni().await.unwrap();
        let result = read_message(&mut answer, &limits).await.unwrap();
        let Some(Message::BatchResult(result)) = result else {
            panic!("expected a batch result, got {result:?}");
        };
        assert_eq!(result.batch, 7);
        let items: Vec<(u64, Status)> = result
            .items
            .iter()
            .map(|i| (i.id, i.status.clone()))
            .collect();
        assert_eq!(items, vec![(1, Status::Ok), (2, Status::Ok)]);
        // Read to the end, so the worker knows the answer arrived.
        assert!(read_message(&mut answer, &limits).await.unwrap().is_none());
        conn
    };
    let conn = tokio::time::timeout(Duration::from_secs(60), script)
        .await
        .expect("the scripted gateway did not finish within 60 s");
    let end = tokio::time::timeout(Duration::from_secs(60), worker)
        .await
        .expect("the link did not end within 60 s after the drain")
        .unwrap()
        .unwrap();
    assert_eq!(end, LinkEnd::Drained);
    match conn.closed().await {
        quinn::ConnectionError::ApplicationClosed(c) => assert_eq!(&c.reason[..], b"drained"),
        other => panic!("expected the worker to close with \"drained\", got {other:?}"),
    }
}

fn register() -> Register {
    Register {
        worker: "w".into(),
        device: "test".into(),
        models: Vec::new(),
        profile: Vec::new(),
        codecs: Vec::new(),
    }
}

/// The gateway given by name (`localhost:<port>`, as Kubernetes gives
/// `tidegate-gateway.tidegate.svc:4433`): the link resolves it, connects to
/// the endpoint on 127.0.0.1, and registers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn link_dials_a_gateway_given_by_host_name() {
    let limits = Limits::default();
    let (endpoint, tls, _dir) = gateway_endpoint();
    let port = endpoint.local_addr().unwrap().port();
    let cfg = LinkConfig {
        gateway: format!("localhost:{port}").parse().unwrap(),
        server_name: "localhost".into(),
        ca: tls.ca_cert.clone(),
        name: "w".into(),
        token: "t".into(),
    };
    assert_eq!(cfg.gateway.name(), Some("localhost"));
    let executor = Arc::new(Executor::spawn(Box::new(OkBackend), 4));
    let worker = tokio::spawn(async move {
        link::run(&cfg, executor, register(), CancellationToken::new()).await
    });

    let script = async {
        let (conn, mut ctl_send, ctl_recv) = accept_worker(&endpoint, &limits).await;
        assert!(conn.remote_address().ip().is_loopback());
        let drain = Message::Drain(Drain { deadline_ms: 1000 });
        tidegate_protocol::quic::write_message(&mut ctl_send, &drain)
            .await
            .unwrap();
        // Kept open until the link has ended: a finished control stream
        // would end it as closed rather than drained.
        (conn, ctl_send, ctl_recv)
    };
    // Bounds a broken link so that the test fails instead of hanging.
    let _gateway_side = tokio::time::timeout(Duration::from_secs(60), script)
        .await
        .expect("the worker did not dial in and register within 60 s");
    let end = tokio::time::timeout(Duration::from_secs(60), worker)
        .await
        .expect("the link did not end within 60 s after the drain")
        .unwrap()
        .unwrap();
    assert_eq!(end, LinkEnd::Drained);
}

/// A `Drain` whose bytes arrive in two parts, with heartbeat ticks in
/// between: the worker must read it whole. A read dropped when a tick won
/// the worker's control loop would lose the first part, never see the
/// Drain, and leave the control stream out of step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_split_across_heartbeat_ticks_is_still_read() {
    let limits = Limits::default();
    let (endpoint, tls, _dir) = gateway_endpoint();
    let cfg = LinkConfig {
        gateway: endpoint.local_addr().unwrap().into(),
        server_name: "localhost".into(),
        ca: tls.ca_cert.clone(),
        name: "w".into(),
        token: "t".into(),
    };
    let executor = Arc::new(Executor::spawn(Box::new(OkBackend), 4));
    let worker = tokio::spawn(async move {
        link::run(&cfg, executor, register(), CancellationToken::new()).await
    });

    let script = async {
        let (conn, mut ctl_send, mut ctl_recv) = accept_worker(&endpoint, &limits).await;
        let mut drain = Vec::new();
        Message::Drain(Drain {
            deadline_ms: 10_000,
        })
        .encode(&mut drain);
        // Part of the header only, then several heartbeats (every 100 ms,
        // as welcomed) while the worker waits for the rest.
        ctl_send.write_all(&drain[..5]).await.unwrap();
        for _ in 0..5 {
            let msg = read_message(&mut ctl_recv, &limits).await.unwrap();
            assert!(matches!(msg, Some(Message::Heartbeat(_))), "{msg:?}");
        }
        ctl_send.write_all(&drain[5..]).await.unwrap();
        // Kept open until the link has ended: a finished control stream
        // would end it as closed rather than drained.
        (conn, ctl_send, ctl_recv)
    };
    // Bounds a broken link so that the test fails instead of hanging.
    let _gateway_side = tokio::time::timeout(Duration::from_secs(60), script)
        .await
        .expect("the worker did not register and heartbeat within 60 s");
    let end = tokio::time::timeout(Duration::from_secs(30), worker)
        .await
        .expect("the link did not end within 30 s of the split Drain: it was not read")
        .unwrap()
        .unwrap();
    assert_eq!(end, LinkEnd::Drained);
}

/// A name that does not resolve (`.invalid` is reserved, RFC 6761) fails
/// the dial at once, naming the host, as an error worth redialling (DNS may
/// not know a new Service yet).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unresolvable_gateway_name_fails_the_dial_naming_the_host() {
    let dir = tempfile::tempdir().unwrap();
    let tls = tidegate_protocol::certs::generate(dir.path(), &["localhost".to_string()])
        .expect("test certificates");
    let cfg = LinkConfig {
        gateway: "gateway.invalid:4433".parse().unwrap(),
        server_name: "localhost".into(),
        ca: tls.ca_cert.clone(),
        name: "w".into(),
        token: "t".into(),
    };
    let executor = Arc::new(Executor::spawn(Box::new(OkBackend), 4));
    // Resolving gives up after RESOLVE_TIMEOUT (10 s) at worst.
    let err = tokio::time::timeout(
        Duration::from_secs(30),
        link::run(&cfg, executor, register(), CancellationToken::new()),
    )
    .await
    .expect("the dial did not fail within 30 s")
    .unwrap_err();
    assert!(
        matches!(
            &err,
            link::LinkError::Dial(tidegate_protocol::quic::DialError::Resolve { host, .. })
                if host == "gateway.invalid"
        ),
        "{err:?}"
    );
    assert!(err.is_retryable());
    let text = err.to_string();
    assert!(
        text.starts_with(
            "cannot resolve gateway host \"gateway.invalid\" (of gateway.invalid:4433): "
        ),
        "{text}"
    );
}
