//! Resolving and dialling a [`GatewayAddr`] with real sockets: a literal IP
//! needs no DNS, a host name reaches a real quinn endpoint on 127.0.0.1, and
//! a name that does not resolve fails promptly, naming the host.
#![cfg(all(feature = "quic", feature = "dev-certs"))]

use std::net::SocketAddr;
use std::time::Duration;

use tidegate_protocol::GatewayAddr;
use tidegate_protocol::quic::{DialError, client_config, dial_addr, resolve, server_config};

/// Bounds every network wait: a hang fails the test instead.
const WAIT: Duration = Duration::from_secs(30);

#[tokio::test]
async fn a_literal_ip_resolves_to_itself() {
    for text in ["127.0.0.1:4433", "[::1]:4433", "10.0.0.5:9"] {
        let addr: GatewayAddr = text.parse().unwrap();
        let found = resolve(&addr).await.unwrap();
        assert_eq!(found, vec![text.parse::<SocketAddr>().unwrap()]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_name_resolves_and_dials_the_endpoint_behind_it() {
    let dir = tempfile::tempdir().unwrap();
    let tls = tidegate_protocol::certs::generate(dir.path(), &["localhost".to_string()]).unwrap();
    let server = server_config(&tls.server_cert, &tls.server_key).unwrap();
    let endpoint = quinn::Endpoint::server(server, "127.0.0.1:0".parse().unwrap()).unwrap();
    let listening = endpoint.local_addr().unwrap();
    let addr: GatewayAddr = format!("localhost:{}", listening.port()).parse().unwrap();

    let found = resolve(&addr).await.unwrap();
    assert!(
        found.contains(&listening),
        "localhost resolved to {found:?}"
    );
    assert!(found.iter().all(|a| a.port() == listening.port()));

    let accept = async { endpoint.accept().await.unwrap().await.unwrap() };
    let dial = dial_addr(&addr, "localhost", client_config(&tls.ca_cert).unwrap());
    let (server_side, client) = tokio::time::timeout(WAIT, async { tokio::join!(accept, dial) })
        .await
        .expect("connected within 30 s");
    let client = client.unwrap();
    assert_eq!(client.remote_address(), listening);
    assert!(server_side.remote_address().ip().is_loopback());
}

#[tokio::test]
async fn an_unresolvable_name_fails_naming_the_host() {
    let dir = tempfile::tempdir().unwrap();
    let tls = tidegate_protocol::certs::generate(dir.path(), &["localhost".to_string()]).unwrap();
    // `.invalid` never resolves (RFC 6761).
    let addr: GatewayAddr = "gateway.invalid:4433".parse().unwrap();
    let err = tokio::time::timeout(WAIT, resolve(&addr))
        .await
        .expect("resolving gave up within 30 s")
        .unwrap_err();
    assert!(
        matches!(&err, DialError::Resolve { host, addr: a, .. } if host == "gateway.invalid" && *a == addr),
        "{err:?}"
    );
    let text = err.to_string();
    assert!(
        text.starts_with(
            "cannot resolve gateway host \"gateway.invalid\" (of gateway.invalid:4433): "
        ) && text.ends_with("; check the name and this machine's DNS"),
        "{text}"
    );
    let err = tokio::time::timeout(
        WAIT,
        dial_addr(&addr, "localhost", client_config(&tls.ca_cert).unwrap()),
    )
    .await
    .expect("dialling gave up within 30 s")
    .unwrap_err();
    assert!(matches!(err, DialError::Resolve { .. }), "{err:?}");
}
