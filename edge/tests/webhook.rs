//! The webhook sink against a real HTTP server on 127.0.0.1: retries on 5xx,
//! gives up on 4xx, drops (and counts) what its bounded queue cannot hold
//! while the receiver is down, by count and by bytes, and on close stops a POST that never ends,
//! counting what it still held. Over https:// (rustls on both sides, a CA
//! made for the test) it delivers with the bearer token to a server whose
//! certificate the configured CA signed, and refuses, counting the loss,
//! one signed by another CA. Every wait is bounded.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tidegate_edge::sink::webhook::{
    Client, Endpoint, QueueLimits, RetryPolicy, Webhook, WebhookError,
};
use tokio::net::TcpListener;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};

use tidegate_testkit::receiver::{Requests, answer, https_receiver};

/// A server that answers the n-th request with `statuses[n]` (the last one
/// repeats) and records each request's body.
async fn server(statuses: Vec<u16>) -> (Client, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let bodies = Arc::new(Mutex::new(Vec::new()));
    let seen = bodies.clone();
    tokio::spawn(async move {
        let mut n = 0usize;
        while let Ok((mut s, _)) = listener.accept().await {
            let (_, body) = answer(&mut s, statuses[n.min(statuses.len() - 1)]).await;
            seen.lock().unwrap().push(body);
            n += 1;
        }
    });
    (http(&format!("http://127.0.0.1:{port}/hook")), bodies)
}

/// A plain http:// client.
fn http(url: &str) -> Client {
    Client::new(Endpoint::parse(url).unwrap(), None, None).unwrap()
}

/// A new CA (PEM) and a certificate for `localhost` and 127.0.0.1 signed by
/// it (chain and PKCS#8 key, DER).
fn certs() -> (String, Vec<CertificateDer<'static>>, PrivateKeyDer<'static>) {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let key = KeyPair::generate().unwrap();
    let leaf = CertificateParams::new(vec!["localhost".into(), "127.0.0.1".into()])
        .unwrap()
        .signed_by(&key, &Issuer::from_params(&ca, &ca_key))
        .unwrap();
    let chain = vec![leaf.der().clone(), ca_cert.der().clone()];
    let key = PrivateKeyDer::Pkcs8(key.serialize_der().into());
    (ca_cert.pem(), chain, key)
}

/// An https:// server on 127.0.0.1 with a certificate from a new CA,
/// answering 200 and recording each request's head and body; its port and
/// the CA's PEM.
async fn tls_server() -> (u16, String, Requests) {
    let (ca_pem, chain, key) = certs();
    let (port, requests) = https_receiver(chain, key).await;
    (port, ca_pem, requests)
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
    let (client, bodies) = server(vec![503, 500, 204]).await;
    let hook = Webhook::spawn(client, 16, fast_policy(5));
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
    let (client, bodies) = server(vec![400]).await;
    let hook = Webhook::spawn(client, 16, fast_policy(5));
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
    let hook = Webhook::spawn(
        http(&format!("http://127.0.0.1:{port}/hook")),
        8,
        fast_policy(3),
    );
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

/// Results of a `raw` model can weigh megabytes each: the queue is bounded
/// by bytes too, counting the batch in the POST under way, and a result
/// that would pass the budget is dropped and counted like one over the
/// count. Freed bytes take new results again.
#[tokio::test]
async fn large_results_are_dropped_once_the_byte_budget_is_held() {
    // A port with nothing listening.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    const RESULT: usize = 100 * 1024;
    const BUDGET: usize = 1024 * 1024;
    // Slow retries: the first batch is still held while the rest is pushed.
    let policy = RetryPolicy {
        max_attempts: 2,
        base: Duration::from_secs(60),
        max: Duration::from_secs(60),
    };
    let limits = QueueLimits {
        results: 1024,
        bytes: BUDGET,
    };
    let hook = Webhook::spawn_with(
        http(&format!("http://127.0.0.1:{port}/hook")),
        limits,
        policy,
    );
    let stats = hook.stats().clone();
    let load = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
    let payload = |seq: usize| {
        let pad = "x".repeat(RESULT - 40);
        format!("{{\"seq\":{seq},\"pad\":\"{pad}\"}}")
    };
    // Nothing is freed meanwhile (the first POST waits 60 s to retry), so
    // which results fit is known exactly.
    let (mut held, mut dropped) = (0u64, 0u64);
    for seq in 0..30 {
        let json = payload(seq);
        let len = json.len() as u64;
        if held + len <= BUDGET as u64 {
            held += len;
        } else {
            dropped += 1;
        }
        hook.push(json);
        assert!(
            load(&stats.held_bytes) <= BUDGET as u64,
            "{} bytes held after {seq} results",
            load(&stats.held_bytes)
        );
    }
    // Far under the count bound, so only the bytes can have dropped them.
    assert!(dropped >= 19, "{dropped}");
    assert_eq!(load(&stats.dropped_full), dropped);
    assert_eq!(load(&stats.held_bytes), held);
    let full = dropped;
    // A result larger than the whole budget never fits.
    hook.push(format!("\"{}\"", "y".repeat(BUDGET)));
    assert_eq!(load(&stats.dropped_full), full + 1);
    let stats = hook.close(Duration::from_millis(200)).await;
    assert_eq!(load(&stats.pushed), 31);
    assert_eq!(
        load(&stats.posted)
            + load(&stats.dropped_full)
            + load(&stats.dropped_failed)
            + load(&stats.dropped_shutdown),
        31,
        "every result is accounted for"
    );
    assert_eq!(load(&stats.held_bytes), 0, "nothing held after close");

    // Small results are taken again as soon as bytes are free.
    let hook = Webhook::spawn_with(
        http(&format!("http://127.0.0.1:{port}/hook")),
        limits,
        policy,
    );
    for seq in 0..10 {
        hook.push(format!("{{\"seq\":{seq}}}"));
    }
    assert_eq!(load(&hook.stats().dropped_full), 0);
    hook.close(Duration::from_millis(200)).await;
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
    let hook = Webhook::spawn(
        http(&format!("http://127.0.0.1:{port}/hook")),
        256,
        fast_policy(5),
    );
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

#[tokio::test]
async fn https_delivers_with_the_bearer_token_to_a_server_the_configured_ca_signed() {
    let (port, ca_pem, requests) = tls_server().await;
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("hook-ca.pem");
    std::fs::write(&ca, ca_pem).unwrap();
    // By name: the certificate is for localhost.
    let endpoint = Endpoint::parse(&format!("https://localhost:{port}/hook")).unwrap();
    let client = Client::new(endpoint, Some(&ca), Some("s3cret".into())).unwrap();
    let hook = Webhook::spawn(client, 16, fast_policy(3));
    for seq in 0..3 {
        hook.push(format!("{{\"seq\":{seq}}}"));
    }
    let stats = hook.close(Duration::from_secs(10)).await;
    assert_eq!(stats.posted.load(Ordering::Relaxed), 3);
    assert_eq!(stats.dropped_failed.load(Ordering::Relaxed), 0);
    let requests = requests.lock().unwrap();
    assert!(!requests.is_empty());
    for (head, _) in requests.iter() {
        assert!(head.contains("authorization: bearer s3cret"), "{head}");
        assert!(head.contains(&format!("host: localhost:{port}")), "{head}");
    }
    let seqs: usize = requests
        .iter()
        .map(|(_, b)| {
            let v: serde_json::Value = serde_json::from_str(b).unwrap();
            v.as_array().unwrap().len()
        })
        .sum();
    assert_eq!(seqs, 3);
}

#[tokio::test]
async fn https_refuses_a_certificate_another_ca_signed_and_counts_the_results_lost() {
    let (port, _, requests) = tls_server().await;
    let (other_ca, _, _) = certs();
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("other-ca.pem");
    std::fs::write(&ca, other_ca).unwrap();
    let endpoint = Endpoint::parse(&format!("https://127.0.0.1:{port}/hook")).unwrap();
    let hook = Webhook::spawn(
        Client::new(endpoint, Some(&ca), None).unwrap(),
        16,
        fast_policy(2),
    );
    hook.push("{\"seq\":1}".into());
    let stats = hook.close(Duration::from_secs(10)).await;
    assert_eq!(stats.posted.load(Ordering::Relaxed), 0);
    assert_eq!(stats.dropped_failed.load(Ordering::Relaxed), 1);
    assert_eq!(
        stats.retries.load(Ordering::Relaxed),
        1,
        "a handshake failure is retried"
    );
    assert!(requests.lock().unwrap().is_empty(), "no request went out");
}

#[test]
fn a_client_says_what_is_wrong_with_its_tls_setup() {
    let dir = tempfile::tempdir().unwrap();
    let https = || Endpoint::parse("https://collector.example/hook").unwrap();
    let missing = dir.path().join("missing.pem");
    let e = Client::new(https(), Some(&missing), None).unwrap_err();
    assert!(
        matches!(&e, WebhookError::Tls(m) if m.contains("missing.pem")),
        "{e}"
    );
    let empty = dir.path().join("empty.pem");
    std::fs::write(&empty, "").unwrap();
    let e = Client::new(https(), Some(&empty), None).unwrap_err();
    assert!(e.to_string().contains("holds no PEM certificate"), "{e}");
    let e = Client::new(
        Endpoint::parse("http://collector.example/hook").unwrap(),
        Some(&empty),
        None,
    )
    .unwrap_err();
    assert!(e.to_string().contains("not https://"), "{e}");
    // Without a CA file, the system's roots (ca-certificates, which make
    // setup installs).
    Client::new(https(), None, None).expect("the system's root certificates");
}
