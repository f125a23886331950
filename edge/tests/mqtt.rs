//! The MQTT sink against a real broker: Debian's mosquitto, started by each
//! test on 127.0.0.1 with a private config and persistence directory.
//!
//! Every result pushed ends as published (the broker acknowledged it) or
//! counted as dropped; across a broker restart nothing is silently lost,
//! and a subscriber receives every result published.

use std::collections::BTreeSet;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rumqttc::{AsyncClient, Event, MqttOptions, Packet, QoS};
use tidegate_edge::sink::mqtt::{Mqtt, MqttConfig, MqttSettings, MqttStats};

/// Longest wait for anything in these tests.
const WAIT: Duration = Duration::from_secs(30);

/// A mosquitto broker on 127.0.0.1, stopped (SIGTERM, so that it saves its
/// sessions) on drop.
struct Broker {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
}

fn mosquitto() -> PathBuf {
    ["/usr/sbin/mosquitto", "/usr/bin/mosquitto"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .expect("mosquitto is not installed: run scripts/setup.sh (Debian package mosquitto)")
}

impl Broker {
    fn start(dir: &Path) -> Broker {
        // Started as root, mosquitto drops to its own user, which must be
        // able to write its persistence file and log here.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut b = Broker {
            child: None,
            port,
            dir: dir.to_path_buf(),
        };
        b.restart();
        b
    }

    /// Starts it (again) on the same port and persistence directory.
    fn restart(&mut self) {
        let conf = self.dir.join("mosquitto.conf");
        std::fs::write(
            &conf,
            format!(
                "listener {} 127.0.0.1\nallow_anonymous true\npersistence true\npersistence_location {}/\nlog_dest file {}/mosquitto.log\nlog_type all\n",
                self.port,
                self.dir.display(),
                self.dir.display()
            ),
        )
        .unwrap();
        let child = Command::new(mosquitto())
            .arg("-c")
            .arg(&conf)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("mosquitto starts");
        self.child = Some(child);
        let until = std::time::Instant::now() + WAIT;
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                std::time::Instant::now() < until,
                "mosquitto did not listen"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stops it with SIGTERM and waits for it to exit.
    fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = tidegate_kit::signal::terminate(c.id());
            let until = std::time::Instant::now() + WAIT;
            while c.try_wait().unwrap().is_none() {
                if std::time::Instant::now() > until {
                    let _ = c.kill();
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }

    fn url(&self) -> String {
        format!("mqtt://127.0.0.1:{}", self.port)
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Everything a subscriber to `tidegate/#` received, as (topic, payload);
/// its subscription acknowledged is `("", "subscribed")`.
type Received = Arc<Mutex<Vec<(String, String)>>>;

/// A subscriber with a persistent session (the broker queues QoS 1
/// messages for it while it is away), resubscribing whenever the broker
/// forgot it.
fn subscribe(port: u16) -> (Received, tokio::task::JoinHandle<()>) {
    let mut o = MqttOptions::new("tidegate-test-subscriber", "127.0.0.1", port);
    o.set_clean_session(false);
    o.set_keep_alive(Duration::from_secs(5));
    let (client, mut events) = AsyncClient::new(o, 16);
    let got: Received = Arc::default();
    let sink = got.clone();
    let task = tokio::spawn(async move {
        loop {
            match events.poll().await {
                Ok(Event::Incoming(Packet::ConnAck(ack))) if !ack.session_present => {
                    let _ = client.subscribe("tidegate/#", QoS::AtLeastOnce).await;
                }
                Ok(Event::Incoming(Packet::SubAck(_))) => {
                    sink.lock()
                        .unwrap()
                        .push((String::new(), "subscribed".into()));
                }
                Ok(Event::Incoming(Packet::Publish(p))) => {
                    let text = String::from_utf8_lossy(&p.payload).into_owned();
                    sink.lock().unwrap().push((p.topic.clone(), text));
                }
                Ok(_) => {}
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    });
    (got, task)
}

fn settings(url: &str, extra: &str) -> MqttSettings {
    let config: MqttConfig = toml::from_str(&format!("url = \"{url}\"\n{extra}")).unwrap();
    MqttSettings::new(&config, "edge-1", None).unwrap()
}

fn event(seq: u64) -> String {
    format!("{{\"camera\":\"door\",\"seq\":{seq}}}")
}

/// Waits until `pred` holds, for at most [`WAIT`].
async fn until(what: &str, mut pred: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !pred() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: not within {WAIT:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The seqs of the detection events received.
fn seqs(got: &Received) -> BTreeSet<u64> {
    got.lock()
        .unwrap()
        .iter()
        .filter(|(t, _)| t == "tidegate/edge-1/door/detections")
        .map(|(_, p)| {
            let v: serde_json::Value = serde_json::from_str(p).unwrap();
            v["seq"].as_u64().unwrap()
        })
        .collect()
}

fn subscribed(got: &Received) -> bool {
    got.lock()
        .unwrap()
        .iter()
        .any(|(t, p)| t.is_empty() && p == "subscribed")
}

fn load(c: &std::sync::atomic::AtomicU64) -> u64 {
    c.load(Ordering::Relaxed)
}

fn accounted(s: &MqttStats) -> bool {
    load(&s.pushed) == load(&s.published) + load(&s.dropped_full) + load(&s.dropped_shutdown)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn results_survive_a_broker_restart_published_or_counted_and_every_one_reaches_the_subscriber()
 {
    let dir = tempfile::tempdir().unwrap();
    let mut broker = Broker::start(dir.path());
    let (got, subscriber) = subscribe(broker.port);
    until("the subscription in place", || subscribed(&got)).await;
    let sink = Mqtt::spawn(settings(&broker.url(), "qos = 1"));
    for seq in 0..20 {
        sink.push("door", event(seq));
    }
    let stats = sink.stats().clone();
    until("the first 20 published", || load(&stats.published) == 20).await;
    until("the first 20 received", || seqs(&got).len() == 20).await;
    let online = got
        .lock()
        .unwrap()
        .iter()
        .any(|(t, p)| t == "tidegate/edge-1/door/availability" && p == "online");
    assert!(online, "the camera's availability says online");

    // The broker goes away; results keep coming and wait in the sink.
    broker.stop();
    for seq in 20..40 {
        sink.push("door", event(seq));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        load(&stats.published) < 40,
        "nothing is published without a broker"
    );
    broker.restart();
    until("all 40 published", || load(&stats.published) == 40).await;
    let deadline = tokio::time::Instant::now() + WAIT;
    while seqs(&got).len() < 40 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the subscriber received only {:?}; broker log:\n{}",
            seqs(&got),
            std::fs::read_to_string(dir.path().join("mosquitto.log")).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(seqs(&got), (0..40).collect::<BTreeSet<u64>>());
    assert!(load(&stats.connections) >= 2, "it reconnected");

    let stats = sink.close(Duration::from_secs(5)).await;
    assert!(accounted(&stats));
    assert_eq!(
        (
            load(&stats.pushed),
            load(&stats.dropped_full),
            load(&stats.dropped_shutdown)
        ),
        (40, 0, 0)
    );
    until("the edge's offline status", || {
        got.lock()
            .unwrap()
            .iter()
            .any(|(t, p)| t == "tidegate/edge-1/status" && p == "offline")
    })
    .await;
    subscriber.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_broker_results_past_the_queue_are_dropped_and_the_rest_counted_at_close() {
    // A port nobody listens on.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let sink = Mqtt::spawn(settings(&format!("mqtt://127.0.0.1:{port}"), "queue = 5"));
    for seq in 0..20 {
        sink.push("door", event(seq));
    }
    let stats = sink.close(Duration::from_millis(300)).await;
    assert_eq!(load(&stats.pushed), 20);
    assert_eq!(load(&stats.published), 0);
    assert_eq!(load(&stats.dropped_full), 15);
    assert_eq!(load(&stats.dropped_shutdown), 5);
    assert!(accounted(&stats));
    assert_eq!(load(&stats.held), 0);
    assert_eq!(load(&stats.held_bytes), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_qos_0_results_are_published_once_written_and_cameras_get_their_own_topics() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(dir.path());
    let (got, subscriber) = subscribe(broker.port);
    until("the subscription in place", || subscribed(&got)).await;
    let sink = Mqtt::spawn(settings(
        &broker.url(),
        "qos = 0\ntopic = \"site/{edge}/{camera}\"",
    ));
    sink.push("yard/2", event(1));
    let stats = sink.stats().clone();
    until("published", || load(&stats.published) == 1).await;
    let stats = sink.close(Duration::from_secs(5)).await;
    assert!(accounted(&stats));
    // The subscriber listens to tidegate/#: the result went elsewhere, the
    // availability (default template) came here, with the name made safe.
    until("the camera's availability", || {
        got.lock()
            .unwrap()
            .iter()
            .any(|(t, _)| t == "tidegate/edge-1/yard_2/availability")
    })
    .await;
    assert!(seqs(&got).is_empty());
    subscriber.abort();
}
