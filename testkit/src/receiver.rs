//! A test receiver of webhook POSTs, plain or over TLS (used by
//! `edge/tests/webhook.rs` and `loadtest/tests/edge_e2e.rs`): it reads one
//! HTTP/1.1 request per connection, checks it is a JSON POST to `/hook`,
//! records its head (lowercased) and body, and answers. Feature `edge`.

use std::sync::{Arc, Mutex};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// The head (lowercased) and body of each request, in arrival order.
pub type Requests = Arc<Mutex<Vec<(String, String)>>>;

/// Reads one request (head, then Content-Length bytes of body) and answers
/// it with `status`; returns the head, lowercased, and the body.
pub async fn answer<S: AsyncRead + AsyncWrite + Unpin>(s: &mut S, status: u16) -> (String, String) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let (head, head_end, len) = loop {
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
            break (head, i + 4, len);
        }
    };
    while buf.len() < head_end + len {
        let k = s.read(&mut chunk).await.unwrap();
        assert!(k > 0);
        buf.extend_from_slice(&chunk[..k]);
    }
    let body = String::from_utf8_lossy(&buf[head_end..head_end + len]).into_owned();
    let reply = format!("HTTP/1.1 {status} X\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
    let _ = s.write_all(reply.as_bytes()).await;
    let _ = s.shutdown().await;
    (head, body)
}

/// An https:// receiver on 127.0.0.1 presenting `chain` (leaf first) with
/// `key`, answering 200; its port and what it received. A client that
/// refuses the certificate sends nothing, so records nothing.
pub async fn https_receiver(
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> (u16, Requests) {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let requests = Requests::default();
    let seen = requests.clone();
    tokio::spawn(async move {
        while let Ok((s, _)) = listener.accept().await {
            if let Ok(mut s) = acceptor.accept(s).await {
                let got = answer(&mut s, 200).await;
                seen.lock().unwrap().push(got);
            }
        }
    });
    (port, requests)
}
