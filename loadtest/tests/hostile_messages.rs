//! Hostile edges and HTTP clients against the real gateway binary on
//! 127.0.0.1: refusals quoting the longest names a peer may send, a
//! control-message flood beside a legitimate camera, and slowloris
//! connections on the HTTP API. Each test is bounded in count and time,
//! and asserts invariants (what is decoded, counted, answered and closed),
//! never speed.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use tidegate_loadtest::attack::edge::{latency_report_flood, name_of, read_error, refused_login};
use tidegate_loadtest::attack::http::{closed_by_server, half_a_request};
use tidegate_loadtest::attack::{AttackError, Target, login};
use tidegate_loadtest::cluster::{Cluster, ClusterOptions, metric_value};
use tidegate_loadtest::loadgen;
use tidegate_protocol::quic::{HandshakeError, write_message};
use tidegate_protocol::{CUT_MARK, CameraOpen, Encoding, ErrorCode, ErrorMsg, Limits, Message};

fn runtime() -> tokio::runtime::Runtime {
    tidegate_loadtest::attack::runtime().unwrap()
}

/// The value of the counter series `series` (name and labels, exactly as
/// exported) in a Prometheus text exposition; 0 when absent.
fn counter(metrics: &str, series: &str) -> f64 {
    metric_value(metrics, series).unwrap_or(0.0)
}

/// `GET /metrics`, retried for up to `within` while it fails.
fn metrics_within(c: &Cluster, within: Duration) -> String {
    let until = Instant::now() + within;
    loop {
        match c.get("/metrics") {
            Ok((200, body)) => return body,
            other if Instant::now() > until => {
                panic!(
                    "/metrics did not answer within {within:?}: {other:?}\n{}",
                    c.gateway_log()
                )
            }
            _ => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

fn assert_fitted(e: &ErrorMsg, quoted: &str) {
    let limits = Limits::default();
    assert!(e.message.len() <= limits.max_string_bytes, "{e:?}");
    assert!(
        e.message.ends_with(CUT_MARK),
        "a cut reason is marked: {e:?}"
    );
    // What is kept of the quote is a prefix of it, on a char boundary.
    let start = e.message.find('\'').expect("the reason quotes the name") + 1;
    let kept = e.message[start..].trim_end_matches(CUT_MARK);
    let kept = kept.split('\'').next().unwrap_or(kept);
    assert!(quoted.starts_with(kept), "quoted a prefix of the name");
}

#[test]
fn a_login_refusal_quoting_a_1024_byte_name_is_decoded_as_a_refusal() {
    let c = Cluster::start(&ClusterOptions::default()).expect("gateway starts");
    let rt = runtime();
    rt.block_on(async {
        let target = Target::of(&c);
        for name in [name_of('é', 1024), name_of('🦀', 1024), name_of('n', 1024)] {
            let e = refused_login(&target, &name)
                .await
                .expect("an Error the protocol decodes");
            assert_eq!(e.code, ErrorCode::Unauthorized, "{e:?}");
            assert!(e.message.starts_with("edge '"), "{e:?}");
            assert_fitted(&e, &name);
        }
    });
}

/// 40 logins with a wrong token: each is refused with its reason and
/// counted, but the gateway's log takes a burst of them and then a line a
/// second, each saying how many it held back, and quotes each 1024-byte
/// name cut to 128 bytes: a stranger guessing tokens cannot fill the disk.
#[test]
fn refused_logins_are_all_counted_and_their_log_lines_sampled() {
    let c = Cluster::start(&ClusterOptions {
        // nobody shut out: every login reaches its refusal
        limits: "refused_logins_per_address = 0".into(),
        ..ClusterOptions::default()
    })
    .expect("gateway starts");
    let rt = runtime();
    let started = std::time::Instant::now();
    rt.block_on(async {
        let target = Target::of(&c);
        for _ in 0..40 {
            let e = refused_login(&target, &name_of('n', 1024))
                .await
                .expect("an Error the protocol decodes");
            assert_eq!(e.code, ErrorCode::Unauthorized, "{e:?}");
        }
    });
    let seconds = started.elapsed().as_secs();
    let (_, metrics) = c.get("/metrics").expect("GET /metrics");
    assert!(
        metrics.contains("tidegate_quic_connections_refused_total{reason=\"credentials\"} 40"),
        "every refusal counted"
    );
    let log = c.gateway_log();
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("refused: unknown name or wrong token"))
        .collect();
    // A burst of 10, then at most one a second (and one for the second
    // the last refusal fell in).
    assert!(
        lines.len() >= 10 && lines.len() as u64 <= 10 + seconds + 1,
        "{} lines in {seconds} s",
        lines.len()
    );
    assert!(
        lines.iter().all(|l| !l.contains(&"n".repeat(129))),
        "names cut for the log"
    );
}

/// A stranger guessing tokens from one address gets its burst of refusals,
/// then its connections are dropped unanswered before their handshake,
/// its right-token ones too (it is the address that is shut out), and
/// counted; another address logs in meanwhile, and once the refusals'
/// rate is paid the address is answered again.
#[test]
fn an_address_whose_logins_keep_being_refused_is_dropped_before_its_handshake() {
    let c = Cluster::start(&ClusterOptions {
        limits: "refused_logins_per_address = 4\nrefused_logins_per_second = 1".into(),
        ..ClusterOptions::default()
    })
    .expect("gateway starts");
    let rt = runtime();
    rt.block_on(async {
        let guesser = Target::of(&c);
        let name = name_of('n', 64);
        for i in 0..4 {
            let e = refused_login(&guesser, &name)
                .await
                .unwrap_or_else(|e| panic!("refusal {i} of the burst: {e}"));
            assert_eq!(e.code, ErrorCode::Unauthorized, "{e:?}");
        }
        // Shut out for a second from the fourth refusal. A client that
        // would not send its Initial again within the dial's 2 s, so that
        // the one Initial it sends falls in the shut-out.
        let mut once = guesser.client().expect("client config");
        let mut transport = quinn::TransportConfig::default();
        transport.initial_rtt(Duration::from_secs(10));
        once.transport_config(std::sync::Arc::new(transport));
        match guesser.dial(once).await {
            Err(AttackError::NoAnswer { .. }) => {}
            Err(e) => panic!("a shut-out address's dial failed otherwise: {e}"),
            Ok(_) => panic!("a shut-out address was answered\n{}", c.gateway_log()),
        }
        // Another host logs in meanwhile.
        let (conn, _send, _recv) = login(
            &guesser.clone().from("127.0.0.1".parse().unwrap()),
            "edge-1",
        )
        .await
        .expect("another address logs in");
        conn.close(0u32.into(), b"done");
        // A second after its last refusal the address is answered again.
        tokio::time::sleep(Duration::from_millis(1100)).await;
        let e = refused_login(&guesser, &name)
            .await
            .expect("answered once the shut-out is over");
        assert_eq!(e.code, ErrorCode::Unauthorized, "{e:?}");
    });
    let metrics = metrics_within(&c, Duration::from_secs(10));
    let refused = |reason: &str| {
        counter(
            &metrics,
            &format!("tidegate_quic_connections_refused_total{{reason=\"{reason}\"}}"),
        )
    };
    assert_eq!(refused("credentials"), 5.0, "the burst and the one after");
    assert!(refused("shut_out") >= 1.0, "the dropped dial is counted");
    assert!(
        c.gateway_log().contains("address shut out"),
        "the shut-out is logged"
    );
}

#[test]
fn a_camera_refusal_quoting_1024_byte_camera_and_model_names_is_decoded_as_a_refusal() {
    let c = Cluster::start(&ClusterOptions::default()).expect("gateway starts");
    let rt = runtime();
    rt.block_on(async {
        let (_conn, mut send, mut recv) = login(&Target::of(&c), "edge-1")
            .await
            .expect("edge-1 logs in");
        // No worker serves the model: the refusal quotes both names, and
        // the camera's connection stays open for the next.
        let cases = [
            (name_of('é', 1024), name_of('€', 1024)),
            (name_of('🦀', 1024), name_of('m', 1024)),
        ];
        for (camera, model) in cases {
            let open = Message::CameraOpen(CameraOpen {
                camera: camera.clone(),
                model,
                budget_ms: 80,
                encoding: Encoding::Raw,
                copies: 1,
            });
            write_message(&mut send, &open)
                .await
                .expect("CameraOpen sent");
            let e = read_error(&mut recv, Duration::from_secs(20))
                .await
                .expect("an Error the protocol decodes");
            assert_eq!(e.code, ErrorCode::Unavailable, "{e:?}");
            assert!(e.message.starts_with("camera '"), "{e:?}");
            assert_fitted(&e, &camera);
        }
    });
}

#[test]
fn a_latency_report_flood_is_dropped_counted_and_closed_while_a_camera_beside_it_gets_every_result()
{
    let mut c = Cluster::start(&ClusterOptions {
        edges: vec!["edge-1".into(), "flooder".into()],
        // Low enough that any flood a loaded test machine can send goes
        // over it; the legitimate camera's reports (10 a second) do not.
        limits:
            "control_messages_per_second = 100\ncontrol_burst = 100\ncontrol_flood_drops = 2000\ncontrol_flood_cooldown_ms = 60000"
                .into(),
        ..ClusterOptions::default()
    })
    .expect("gateway starts");
    c.spawn_worker("worker-1").expect("worker starts");
    c.wait_for_workers(1, Duration::from_secs(60))
        .expect("worker registers");

    // The legitimate camera: 10 fps for 6 s on its own connection.
    let legit = c.load_options("edge-1", 1, 10.0, 6.0);
    let camera = std::thread::spawn(move || loadgen::run_blocking(&legit));

    let rt = runtime();
    let flood = rt.block_on(async {
        // At most 200,000 reports or 20 s, whichever ends first; the
        // gateway closes the connection long before either.
        latency_report_flood(&Target::of(&c), "flooder", 200_000, Duration::from_secs(20))
            .await
            .expect("the flooder logs in")
    });
    let (sent, refusal) = (flood.sent, flood.refusal);

    let report = camera
        .join()
        .expect("camera thread")
        .expect("the legitimate camera runs");
    let (code, message) = refusal.unwrap_or_else(|| {
        panic!(
            "the flood ({sent} reports sent) was not refused\n{}",
            c.gateway_log()
        )
    });
    assert_eq!(code, ErrorCode::Overloaded, "{message}");
    assert!(message.starts_with("control stream flooded"), "{message}");

    // Its name is kept out for the cooldown (a minute here, so that no
    // machine is slow enough to see it end): logging in again at once, with
    // the right token, is refused saying when to come back.
    let again = rt.block_on(login(&Target::of(&c), "flooder"));
    match again {
        Err(AttackError::Login {
            source: HandshakeError::Refused { code, message },
            ..
        }) => {
            assert_eq!(code, ErrorCode::Overloaded, "{message}");
            assert!(
                message.starts_with("edge 'flooder' refused: its connection was closed for flooding its control stream; log in again in "),
                "{message}"
            );
        }
        Err(e) => panic!("the flooder's next login failed otherwise: {e}"),
        Ok(_) => panic!("the flooder logged in again during its cooldown"),
    }

    let metrics = metrics_within(&c, Duration::from_secs(10));
    assert_eq!(
        counter(
            &metrics,
            "tidegate_quic_connections_refused_total{reason=\"flood_cooldown\"}"
        ),
        1.0,
        "one login refused for the cooldown"
    );
    let dropped = counter(
        &metrics,
        "tidegate_control_messages_dropped_total{kind=\"latency_report\"}",
    );
    assert!(dropped >= 2000.0, "dropped {dropped} of {sent}");

    // Beside it, every frame the camera sent ended once, and none is
    // missing or answered twice.
    assert!(report.sent > 0, "{report:#?}");
    assert_eq!(report.missing, 0, "{report:#?}");
    assert_eq!(report.duplicates, 0, "{report:#?}");
    assert_eq!(
        report.results() + report.reset + report.refused + report.lost_with_connection,
        report.sent,
        "one result per frame sent: {report:#?}"
    );
    assert_eq!(report.lost_with_connection, 0, "{report:#?}");
    assert!(report.results() > 0, "{report:#?}");
}

#[test]
fn slowloris_connections_beyond_the_cap_are_closed_at_once_and_metrics_answers_once_they_go() {
    const CAP: usize = 16;
    const SLOW: usize = 300;
    // A header timeout far longer than the test: the connections within
    // the cap stay held until the client lets go.
    let c = Cluster::start(&ClusterOptions {
        http: format!("max_connections = {CAP}\nheader_read_timeout_ms = 120000"),
        ..ClusterOptions::default()
    })
    .expect("gateway starts");
    // Wait for the API before taking its slots.
    metrics_within(&c, Duration::from_secs(10));

    let mut slow: Vec<TcpStream> = (0..SLOW)
        .map(|i| half_a_request(c.http).unwrap_or_else(|e| panic!("connection {i}: {e}")))
        .collect();
    // Every connection beyond the cap is closed as it is accepted; wait
    // (bounded) until they all have been, then check no more were.
    let until = Instant::now() + Duration::from_secs(30);
    let mut closed = vec![false; SLOW];
    loop {
        for (s, done) in slow.iter_mut().zip(closed.iter_mut()) {
            if !*done {
                *done = closed_by_server(s);
            }
        }
        let n = closed.iter().filter(|d| **d).count();
        if n >= SLOW - CAP || Instant::now() > until {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let n_closed = closed.iter().filter(|d| **d).count();
    assert_eq!(
        n_closed,
        SLOW - CAP,
        "all but the cap's {CAP} are closed at once\n{}",
        c.gateway_log()
    );
    // While the cap is held, another client is turned away too (closed,
    // not queued).
    if let Ok((status, _)) = c.get("/metrics") {
        panic!("answered {status} with every slot held");
    }

    // The slowloris client lets go: the API answers again, and counted
    // every connection it turned away.
    slow.clear();
    let metrics = metrics_within(&c, Duration::from_secs(15));
    let refused = counter(&metrics, "tidegate_http_connections_refused_total");
    assert!(
        refused >= (SLOW - CAP + 1) as f64,
        "refused {refused}, expected at least {}",
        SLOW - CAP + 1
    );
}

#[test]
fn a_connection_that_sends_half_a_request_head_or_idles_after_one_is_closed_after_the_timeout() {
    let c = Cluster::start(&ClusterOptions {
        http: "header_read_timeout_ms = 500".into(),
        ..ClusterOptions::default()
    })
    .expect("gateway starts");
    metrics_within(&c, Duration::from_secs(10));

    // Half a head, then nothing.
    let mut half = half_a_request(c.http).expect("connects");
    // A whole request on a keep-alive connection, answered, then nothing.
    let mut idle = TcpStream::connect_timeout(&c.http, Duration::from_secs(2)).expect("connects");
    idle.write_all(b"GET /healthz HTTP/1.1\r\nHost: tidegate\r\n\r\n")
        .expect("request sent");

    // Both end within a bound far above the timeout; the idle one after
    // its answer.
    for (what, s) in [("half a head", &mut half), ("idle keep-alive", &mut idle)] {
        s.set_read_timeout(Some(Duration::from_secs(30)))
            .expect("read timeout");
        let mut got = Vec::new();
        let read = s.read_to_end(&mut got);
        assert!(
            read.is_ok()
                || read
                    .as_ref()
                    .is_err_and(|e| e.kind() == ErrorKind::ConnectionReset),
            "{what}: the server closes the connection (not our read timeout): {read:?}"
        );
        let text = String::from_utf8_lossy(&got);
        if what == "idle keep-alive" {
            assert!(
                text.starts_with("HTTP/1.1 200"),
                "{what}: answered first: {text}"
            );
        } else {
            assert!(
                !text.starts_with("HTTP/1.1 200"),
                "{what}: not served: {text}"
            );
        }
    }
    // The API still answers a client that sends its request whole.
    let (status, _) = c.get("/healthz").expect("healthz");
    assert_eq!(status, 200);
}
