//! The webhook sink against a real HTTP server on 127.0.0.1: retries on 5xx,
//! gives up on 4xx, drops (and counts) what its bounded queue cannot hold
//! while the receiver is down, and on close stops a POST that never ends,
//! counting what it still held. Every wait is bounded.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tidegate_edge::sink::webhook::{Endpoint, RetryPolicy, Webhook};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// A server that answers the n-th request with `statuses[n]` (the last one
/// repeats) and records each request's body.
async fn server(statuses: Vec<u16>) -> (Endpoint, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let bodies = Arc::new(Mutex::new(Vec::new()));
    let seen = bodies.clone();
    tokio::spawn(async move {
        let mut n = 0usize;
        while let Ok((mut s, _)) = listener.accept().await {
            let mut buf = Vec::new();
            let mut chunk = [0u8; 4096];
            // Read the head, then Content-Length bytes of body.
            let (head_end, len) = loop {
                let k = s.read(&mut chunk).await.unwrap();
                assert!(k > 0, "client closed early");
                buf.extend_from_slice(&chunk[..k]);
                if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                    let head = String::from_utf8_lossy(&buf[..i]).to_lowercase();
                    assert!(head.starts_with("post /hook http/1.1"), "{head}");
                    assert!(head.contains("content-type: application/json"), "{head}");
                    let len = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length: "))
                        .and_then(|v| v.trim().parse::<usize>().ok())
                        .expect("content-length");
                    break (i + 4, len);
                }
            };
            while buf.len() < head_end + len {
                let k = s.read(&mut chunk).await.unwrap();
                assert!(k > 0);
                buf.extend_from_slice(&chunk[..k]);
            }
            seen.lock()
                .unwrap()
                .push(String::from_utf8_lossy(&buf[head_end..head_end + len]).into_owned());
            let status = statuses[n.min(statuses.len() - 1)];
            n += 1;
            let answer =
                format!("HTTP/1.1 {status} X\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
            let _ = s.write_all(answer.as_bytes()).await;
        }
    });
    (
        Endpoint::parse(&format!("http://127.0.0.1:{port}/hook")).unwrap(),
        bodies,
    )
}

fn fast_policy(max_attempts: u32) -> RetryPolicy {
    RetryPolicy {
        max_attempts,
        base: Duration::from_millis(20),
        max: Duration::from_millis(100),
    }
}

#[tokio::test]
async fn server_errors_are_retried_until_the_results_are_accepted() {
    let (endpoint, bodies) = server(vec![503, 500, 204]).await;
    let hook = Webhook::spawn(endpoint, 16, fast_policy(5));
    for seq in 0..3 {
        hook.push(format!("{{\"camera\":\"door\",\"seq\":{seq}}}"));
    }
    let stats = hook.close(Duration::from_secs(10)).await;
    assert_eq!(stats.posted.load(Ordering::Relaxed), 3);
    assert!(stats.retries.load(Ordering::Relaxed) >= 2);
    assert_eq!(stats.dropped_failed.load(Ordering::Relaxed), 0);
    let bodies = bodies.lock().unwrap();
    // The first batch is sent three times (503, 500, then 204), whole.
    assert!(bodies.len() >= 3, "{bodies:?}");
    assert_eq!(bodies[0], bodies[1]);
    assert_eq!(bodies[1], bodies[2]);
    // Every result arrives exactly once among the accepted POSTs.
    let mut seqs: Vec<u64> = bodies[2..]
        .iter()
        .flat_map(|b| {
            let v: serde_json::Value = serde_json::from_str(b).unwrap();
            v.as_array()
                .unwrap()
                .iter()
                .map(|r| r["seq"].as_u64().unwrap())
                .collect::<Vec<_>>()
        })
        .collect();
    seqs.sort_unstable();
    assert_eq!(seqs, vec![0, 1, 2], "{bodies:?}");
}

#[tokio::test]
async fn client_errors_are_not_retried_and_are_counted_as_dropped() {
    let (endpoint, bodies) = server(vec![400]).await;
    let hook = Webhook::spawn(endpoint, 16, fast_policy(5));
    hook.push("{\"seq\":1}".into());
    let stats = hook.close(Duration::from_secs(10)).await;
    assert_eq!(stats.posted.load(Ordering::Relaxed), 0);
    assert_eq!(stats.retries.load(Ordering::Relaxed), 0);
    assert_eq!(stats.dropped_failed.load(Ordering::Relaxed), 1);
    assert_eq!(bodies.lock().unwrap().len(), 1);
}

#[tokio::test]
async fn unreachable_receiver_fills_the_bounded_queue_and_drops_are_counted() {
    // A port with nothing listening.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let endpoint = Endpoint::parse(&format!("http://127.0.0.1:{port}/hook")).unwrap();
    let hook = Webhook::spawn(endpoint, 8, fast_policy(3));
    for seq in 0..200 {
        hook.push(format!("{{\"seq\":{seq}}}"));
    }
    let stats = hook.close(Duration::from_secs(20)).await;
    let full = stats.dropped_full.load(Ordering::Relaxed);
    let failed = stats.dropped_failed.load(Ordering::Relaxed);
    assert_eq!(stats.posted.load(Ordering::Relaxed), 0);
    // At most the queue plus one batch in hand were ever held.
    assert!(
        failed <= 8 + 64,
        "{failed} results held while the receiver was down"
    );
    assert!(full >= 200 - 8 - 64, "{full}");
    assert_eq!(full + failed, 200, "every result is accounted for");
    assert_eq!(stats.pushed.load(Ordering::Relaxed), 200);
    assert_eq!(stats.dropped_shutdown.load(Ordering::Relaxed), 0);
}

#[tokio::test]
async fn close_stops_a_stuck_post_and_counts_what_it_still_held() {
    // A receiver that takes the request and never answers: the POST cannot
    // finish before close gives up, however fast the machine is.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (held_tx, mut held_rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((s, _)) = listener.accept().await {
            let _ = held_tx.send(s);
        }
    });
    let endpoint = Endpoint::parse(&format!("http://127.0.0.1:{port}/hook")).unwrap();
    let hook = Webhook::spawn(endpoint, 256, fast_policy(5));
    for seq in 0..100 {
        hook.push(format!("{{\"seq\":{seq}}}"));
    }
    // The first batch is on the wire.
    let _held = tokio::time::timeout(Duration::from_secs(10), held_rx.recv())
        .await
        .expect("the webhook connects")
        .unwrap();
    let stats = hook.close(Duration::from_millis(200)).await;
    let load = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
    assert_eq!(load(&stats.pushed), 100);
    assert_eq!(load(&stats.posted), 0);
    assert_eq!(load(&stats.dropped_full), 0);
    assert_eq!(load(&stats.dropped_failed), 0);
    // The batch in the unanswered POST and the rest of the queue.
    assert_eq!(load(&stats.dropped_shutdown), 100);
}
