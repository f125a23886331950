//! The impairment relay end to end, on 127.0.0.1 only: a UDP echo server
//! behind a [`Relay`], driven by real client sockets; and the
//! `tidegate-loadtest impair` command.
//!
//! Bounded in datagrams and time. Nothing asserts on speed: a round trip is
//! at least the configured delay, never at most; where a check needs the
//! relay to have seen a datagram within a window, it is made only when the
//! test observed that it did.

use std::collections::{BTreeSet, HashSet};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tidegate_loadtest::impair::{
    Blackout, DropReason, ImpairConfig, ImpairError, Link, LinkConfig, Relay, RelayOptions,
    RelayStats, Verdict,
};
use tokio::net::UdpSocket;

/// How long a test waits for something that should take milliseconds
/// before it fails; generous, for a busy machine.
const PATIENCE: Duration = Duration::from_secs(30);

/// A UDP echo server on 127.0.0.1: it sends every datagram back to its
/// sender, and records who sent it.
struct Echo {
    addr: SocketAddr,
    peers: Arc<Mutex<Vec<SocketAddr>>>,
    received: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Echo {
    async fn start() -> Echo {
        let socket = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = socket.local_addr().unwrap();
        let peers = Arc::new(Mutex::new(Vec::new()));
        let received = Arc::new(AtomicU64::new(0));
        let (p, r) = (Arc::clone(&peers), Arc::clone(&received));
        let task = tokio::spawn(async move {
            let mut buf = vec![0u8; 65_535];
            while let Ok((len, from)) = socket.recv_from(&mut buf).await {
                p.lock().unwrap().push(from);
                r.fetch_add(1, Ordering::SeqCst);
                let _ = socket.send_to(&buf[..len], from).await;
            }
        });
        Echo {
            addr,
            peers,
            received,
            task,
        }
    }
}

impl Drop for Echo {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn client() -> UdpSocket {
    UdpSocket::bind("127.0.0.1:0").await.unwrap()
}

async fn relay(upstream: SocketAddr, config: ImpairConfig) -> Relay {
    Relay::start(RelayOptions::new(upstream, config))
        .await
        .unwrap()
}

/// Sends `payload` to `to` and waits for a datagram back; its round trip.
async fn round_trip(socket: &UdpSocket, to: SocketAddr, payload: &[u8]) -> Duration {
    let start = Instant::now();
    socket.send_to(payload, to).await.unwrap();
    let mut buf = vec![0u8; 65_535];
    let (len, _) = tokio::time::timeout(PATIENCE, socket.recv_from(&mut buf))
        .await
        .expect("a reply through the relay")
        .unwrap();
    assert_eq!(&buf[..len], payload);
    start.elapsed()
}

/// Waits until `done` holds of the relay's counters; fails after
/// [`PATIENCE`].
async fn until(relay: &Relay, what: &str, done: impl Fn(&RelayStats) -> bool) -> RelayStats {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let stats = relay.stats();
        if done(&stats) {
            return stats;
        }
        assert!(Instant::now() < deadline, "{what}: {stats:#?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn assert_balanced(stats: &RelayStats) {
    for (name, d) in [("uplink", &stats.uplink), ("downlink", &stats.downlink)] {
        assert!(d.link.balanced(), "{name}: {stats:#?}");
    }
}

fn one_way(delay_ms: f64) -> LinkConfig {
    LinkConfig {
        delay_ms,
        ..LinkConfig::default()
    }
}

#[tokio::test]
async fn round_trips_through_the_relay_take_at_least_the_configured_rtt_and_counters_add_up() {
    let echo = Echo::start().await;
    // 20 ms round trip: 10 ms each way.
    let relay = relay(echo.addr, ImpairConfig::symmetric(one_way(10.0))).await;
    let socket = client().await;
    for i in 0..20u32 {
        let rtt = round_trip(&socket, relay.local_addr(), &i.to_be_bytes()).await;
        assert!(rtt >= Duration::from_millis(20), "round trip {i}: {rtt:?}");
    }
    let stats = relay.stop().await;
    assert_balanced(&stats);
    for d in [&stats.uplink, &stats.downlink] {
        assert_eq!(d.link.offered.packets, 20, "{stats:#?}");
        assert_eq!(d.link.offered.bytes, 80, "{stats:#?}");
        assert_eq!(d.link.delivered, d.link.offered, "{stats:#?}");
        assert_eq!(d.send_errors, 0, "{stats:#?}");
    }
    assert_eq!(stats.flows.opened, 1);
    assert_eq!(stats.flows.refused_packets, 0);
}

#[tokio::test]
async fn loss_of_one_half_with_a_fixed_seed_loses_exactly_the_packets_the_core_says() {
    let echo = Echo::start().await;
    let lossy = LinkConfig {
        loss: 0.5,
        ..LinkConfig::default()
    };
    let config = ImpairConfig {
        seed: 42,
        uplink: lossy.clone(),
        ..ImpairConfig::default()
    };
    // Loss alone does not depend on time: the core, seeded alike, says
    // which of the 400 are lost.
    let (mut core, _) = config.links().unwrap();
    let expected: BTreeSet<u32> = (0..400u32)
        .filter(|_| matches!(core.on_packet(Duration::ZERO, 4), Verdict::Deliver { .. }))
        .collect();
    assert!(expected.len() > 100 && expected.len() < 300, "{expected:?}");

    let relay = relay(echo.addr, config).await;
    let socket = Arc::new(client().await);
    let to = relay.local_addr();
    let replies = Arc::new(Mutex::new(BTreeSet::new()));
    let reader = {
        let (socket, replies) = (Arc::clone(&socket), Arc::clone(&replies));
        tokio::spawn(async move {
            let mut buf = [0u8; 64];
            while let Ok(4) = socket.recv(&mut buf).await {
                let id = u32::from_be_bytes(buf[..4].try_into().unwrap());
                replies.lock().unwrap().insert(id);
            }
        })
    };
    // In steps of 20, each step seen by the relay before the next, so that
    // no socket buffer overflows on a busy machine.
    for step in 0..20u32 {
        for id in step * 20..(step + 1) * 20 {
            socket.send_to(&id.to_be_bytes(), to).await.unwrap();
        }
        let sent = u64::from((step + 1) * 20);
        until(&relay, "the relay sees every datagram sent", |s| {
            s.uplink.link.offered.packets == sent
        })
        .await;
    }
    let want = expected.len();
    let deadline = Instant::now() + PATIENCE;
    while replies.lock().unwrap().len() < want {
        assert!(Instant::now() < deadline, "{:?}", relay.stats());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    reader.abort();
    let stats = relay.stop().await;
    assert_balanced(&stats);
    assert_eq!(*replies.lock().unwrap(), expected);
    assert_eq!(echo.received.load(Ordering::SeqCst), want as u64);
    let up = &stats.uplink.link;
    assert_eq!(up.offered.packets, 400);
    assert_eq!(up.delivered.packets, want as u64);
    assert_eq!(up.dropped.of(DropReason::Loss).packets, 400 - want as u64);
    assert_eq!(up.dropped.total(), up.dropped.loss);
    // The downlink was left clean.
    assert_eq!(stats.downlink.link.delivered.packets, want as u64);
    assert_eq!(stats.downlink.link.dropped.total().packets, 0);
}

#[tokio::test]
async fn a_blackout_started_at_run_time_drops_everything_during_it_and_traffic_flows_after() {
    const CUT: Duration = Duration::from_millis(1_500);
    let echo = Echo::start().await;
    let relay = relay(echo.addr, ImpairConfig::default()).await;
    let socket = client().await;
    let to = relay.local_addr();
    round_trip(&socket, to, b"before").await;

    let cut_at = Instant::now();
    relay.blackout(CUT);
    for i in 0..5u8 {
        socket.send_to(&[i], to).await.unwrap();
    }
    let seen = until(&relay, "the relay sees the five", |s| {
        s.uplink.link.offered.packets == 6
    })
    .await;
    // Whether all five were offered inside the blackout (on a busy machine
    // the relay may only have read them after it).
    let five_inside = cut_at.elapsed() < CUT;
    if five_inside {
        assert_eq!(seen.uplink.link.dropped.blackout.packets, 5, "{seen:#?}");
    }

    // Probe until one comes back: nothing does before the blackout ends.
    let mut buf = [0u8; 16];
    let back = loop {
        assert!(cut_at.elapsed() < PATIENCE, "{:?}", relay.stats());
        socket.send_to(b"probe", to).await.unwrap();
        if let Ok(got) =
            tokio::time::timeout(Duration::from_millis(100), socket.recv(&mut buf)).await
        {
            got.unwrap();
            break cut_at.elapsed();
        }
    };
    assert!(back >= CUT, "a reply came {back:?} into a {CUT:?} blackout");
    if five_inside {
        assert!(buf.starts_with(b"probe"), "{buf:?}");
    }
    let stats = relay.stop().await;
    assert_balanced(&stats);
    let up = &stats.uplink.link;
    assert!(up.dropped.blackout.packets >= 1, "{stats:#?}");
    // Nothing but the blackout dropped anything, and what it let through
    // was echoed.
    assert_eq!(up.dropped.total(), up.dropped.blackout);
    assert_eq!(echo.received.load(Ordering::SeqCst), up.delivered.packets);
}

#[tokio::test]
async fn a_rate_cap_with_a_small_queue_tail_drops_a_burst_and_counts_queue_full() {
    let echo = Echo::start().await;
    // 16 kbit/s: a 1,000-byte datagram takes 500 ms to serialize, and a
    // 100 ms queue holds none behind it, so a burst of 30 keeps its first
    // (the link is idle) and loses the rest unless they trickle in over 12 s.
    let capped = LinkConfig {
        rate_bps: Some(16_000),
        queue_ms: 100,
        ..LinkConfig::default()
    };
    let relay = relay(
        echo.addr,
        ImpairConfig {
            uplink: capped,
            ..ImpairConfig::default()
        },
    )
    .await;
    let socket = client().await;
    let to = relay.local_addr();
    let sent_at = Instant::now();
    for i in 0..30u8 {
        socket.send_to(&[i; 1_000], to).await.unwrap();
    }
    let stats = until(&relay, "the relay sees the burst", |s| {
        s.uplink.link.offered.packets == 30
    })
    .await;
    let up = &stats.uplink.link;
    assert!(up.delivered.packets >= 1, "{stats:#?}");
    assert!(up.dropped.queue_full.packets >= 1, "{stats:#?}");
    assert_eq!(
        up.dropped.queue_full.bytes,
        up.dropped.queue_full.packets * 1_000
    );
    assert_eq!(up.dropped.total(), up.dropped.queue_full);
    assert_balanced(&stats);

    // What got through comes back, none before its serialization time, the
    // first datagram first.
    let mut buf = vec![0u8; 2_000];
    let mut first = true;
    for _ in 0..up.delivered.packets {
        let len = tokio::time::timeout(PATIENCE, socket.recv(&mut buf))
            .await
            .expect("a reply")
            .unwrap();
        assert_eq!(len, 1_000);
        assert!(sent_at.elapsed() >= Duration::from_millis(500));
        if first {
            assert_eq!(buf[0], 0, "the datagram that found the link idle");
            first = false;
        }
    }
    let stats = relay.stop().await;
    assert_eq!(echo.received.load(Ordering::SeqCst), up.delivered.packets);
    assert_balanced(&stats);
}

#[tokio::test]
async fn each_client_port_is_its_own_flow_to_the_upstream() {
    let echo = Echo::start().await;
    let relay = relay(echo.addr, ImpairConfig::default()).await;
    let (a, b) = (client().await, client().await);
    let to = relay.local_addr();
    for _ in 0..3 {
        round_trip(&a, to, b"from a").await;
        round_trip(&b, to, b"from b").await;
    }
    let peers: HashSet<SocketAddr> = echo.peers.lock().unwrap().iter().copied().collect();
    assert_eq!(peers.len(), 2, "{peers:?}");
    for client in [&a, &b] {
        assert!(!peers.contains(&client.local_addr().unwrap()));
    }
    assert!(!peers.contains(&to));
    let stats = relay.stop().await;
    assert_eq!(stats.flows.opened, 2);
    assert_eq!(stats.flows.active, 2);
}

#[tokio::test]
async fn a_full_flow_table_refuses_new_clients_and_counts_them() {
    let echo = Echo::start().await;
    let relay = Relay::start(RelayOptions {
        max_flows: 1,
        ..RelayOptions::new(echo.addr, ImpairConfig::default())
    })
    .await
    .unwrap();
    let (a, b) = (client().await, client().await);
    let to = relay.local_addr();
    round_trip(&a, to, b"first").await;
    b.send_to(b"second", to).await.unwrap();
    let stats = until(&relay, "the second client refused", |s| {
        s.flows.refused_packets == 1
    })
    .await;
    assert_eq!(stats.flows.active, 1);
    assert_eq!(stats.uplink.link.offered.packets, 1);
    // The first client's flow still works.
    round_trip(&a, to, b"again").await;
    drop(relay);
}

#[tokio::test]
async fn a_relay_refuses_addresses_off_this_machine_and_bad_configs() {
    let upstream: SocketAddr = "127.0.0.1:9".parse().unwrap();
    let err = Relay::start(RelayOptions::new(
        "192.0.2.1:4433".parse().unwrap(),
        ImpairConfig::default(),
    ))
    .await
    .unwrap_err();
    assert!(
        matches!(
            err,
            ImpairError::NotLoopback {
                role: "upstream",
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("--allow-non-loopback"), "{err}");
    let err = Relay::start(RelayOptions {
        listen: "0.0.0.0:0".parse().unwrap(),
        ..RelayOptions::new(upstream, ImpairConfig::default())
    })
    .await
    .unwrap_err();
    assert!(
        matches!(err, ImpairError::NotLoopback { role: "listen", .. }),
        "{err}"
    );
    let err = Relay::start(RelayOptions::new(
        upstream,
        ImpairConfig {
            blackouts: vec![Blackout {
                start_ms: 1,
                duration_ms: 0,
            }],
            ..ImpairConfig::default()
        },
    ))
    .await
    .unwrap_err();
    assert!(err.to_string().contains("drops nothing"), "{err}");
    let err = Relay::start(RelayOptions {
        max_flows: 0,
        ..RelayOptions::new(upstream, ImpairConfig::default())
    })
    .await
    .unwrap_err();
    assert!(matches!(err, ImpairError::MaxFlows(0)), "{err}");
    // IPv6 loopback is loopback.
    let v6 = RelayOptions {
        listen: "[::1]:0".parse().unwrap(),
        ..RelayOptions::new("[::1]:9".parse().unwrap(), ImpairConfig::default())
    };
    if std::net::UdpSocket::bind("[::1]:0").is_ok() {
        Relay::start(v6).await.unwrap().stop().await;
    }
    // A link on its own checks the same way.
    assert!(Link::new(&one_way(-1.0), 0).is_err());
}

fn loadtest() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tidegate-loadtest"));
    // A shell set up for a remote gateway does not get in impair's way.
    c.env("TIDEGATE_GATEWAY_ADDR", "127.0.0.1:9")
        .env("TIDEGATE_CA", "/nonexistent/ca.pem")
        .env("TIDEGATE_EDGE_TOKEN", "t");
    c
}

#[tokio::test]
async fn the_impair_command_prints_its_address_relays_and_writes_its_stats_on_sigterm() {
    let echo = Echo::start().await;
    let dir = tempfile::tempdir().unwrap();
    let stats_path = dir.path().join("stats.json");
    let mut child = loadtest()
        .args(["impair", "--upstream", &echo.addr.to_string()])
        .args(["--rtt-ms", "10", "--seed", "3", "--blackout", "600000+1000"])
        .arg("--stats")
        .arg(&stats_path)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (line, stdout) = tokio::task::spawn_blocking(move || {
        let mut lines = BufReader::new(stdout);
        let mut line = String::new();
        lines.read_line(&mut line).unwrap();
        (line, lines)
    })
    .await
    .unwrap();
    let want = format!(" -> {}\n", echo.addr);
    let listen = line
        .strip_prefix("impair: listening on ")
        .and_then(|l| l.strip_suffix(&want))
        .unwrap_or_else(|| panic!("first line: {line:?}"));
    let listen: SocketAddr = listen.parse().unwrap();
    let socket = client().await;
    for i in 0..5u8 {
        let rtt = round_trip(&socket, listen, &[i; 100]).await;
        assert!(rtt >= Duration::from_millis(10), "{rtt:?}");
    }
    tidegate_kit::signal::terminate(child.id()).expect("SIGTERM to the relay");
    let (rest, out) = tokio::task::spawn_blocking(move || {
        let mut stdout = stdout;
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut stdout, &mut rest).unwrap();
        (rest, child.wait_with_output().unwrap())
    })
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}: {stderr}", out.status);
    let written: RelayStats =
        serde_json::from_str(&std::fs::read_to_string(&stats_path).unwrap()).unwrap();
    let printed: RelayStats = serde_json::from_str(&rest).unwrap_or_else(|e| panic!("{e}: {rest}"));
    assert_eq!(written, printed);
    for d in [&written.uplink, &written.downlink] {
        assert_eq!(d.link.offered.packets, 5, "{written:#?}");
        assert_eq!(d.link.delivered.bytes, 500, "{written:#?}");
    }
    assert_eq!(written.flows.opened, 1);
}

#[test]
fn the_impair_command_refuses_what_it_cannot_honour_and_explains_its_flags() {
    let run = |args: &[&str]| loadtest().arg("impair").args(args).output().unwrap();
    let out = run(&["--help"]);
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{help}");
    for flag in [
        "--upstream",
        "--rtt-ms",
        "--jitter-ms",
        "--loss",
        "--ge-p",
        "--ge-r",
        "--reorder",
        "--rate-mbit",
        "--queue-ms",
        "--blackout",
        "--seed",
        "--seconds",
        "--stats",
        "--allow-non-loopback",
    ] {
        assert!(help.contains(flag), "{flag}: {help}");
    }
    // The load generator's own usage is unchanged.
    let out = loadtest().arg("--help").output().unwrap();
    let top = String::from_utf8_lossy(&out.stdout);
    assert!(top.contains("--local") && top.contains("impair"), "{top}");

    let up = ["--upstream", "127.0.0.1:9"];
    let refused = |extra: &[&str], code: i32, says: &str| {
        let out = run(&[&up[..], extra].concat());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{extra:?}: {stderr}");
        assert!(stderr.contains(says), "{extra:?}: {stderr}");
    };
    refused(&["--loss", "1.5"], 2, "not a probability in [0, 1]");
    refused(&["--blackout", "5000"], 2, "START_MS+DURATION_MS");
    refused(&["--ge-p", "0.1"], 2, "--ge-r");
    refused(&["--rtt-ms", "20", "--jitter-ms", "15"], 1, "--jitter-ms");
    refused(&["--rate-mbit", "0"], 2, "--rate-mbit");
    let out = loadtest()
        .args(["impair", "--upstream", "192.0.2.1:4433", "--seconds", "1"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("--allow-non-loopback"), "{stderr}");
    // The flat flags and impair do not mix.
    let out = loadtest()
        .args(["--local", "impair", "--upstream", "127.0.0.1:9"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}
