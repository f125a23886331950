//! The `tidegate-edge` binary's metrics listener refused in one line that
//! names what to change: without summaries to read, and on an address
//! already taken. (`loadtest/tests/edge_metrics.rs` scrapes one serving.)
#![cfg(feature = "capture")]

use std::process::{Command, Output};

/// `tidegate-edge --config <file> ARGS` with `more` appended to a config
/// of one test:// camera and an unreachable gateway.
fn edge(more: &str, args: &[&str]) -> Output {
    let dir = tempfile::tempdir().unwrap();
    tidegate_protocol::certs::generate(dir.path(), &["localhost".to_string()]).unwrap();
    let cfg = dir.path().join("edge.toml");
    std::fs::write(
        &cfg,
        format!(
            "name = \"e\"\ntoken = \"t\"\n[gateway]\naddr = \"127.0.0.1:9\"\nca = \"ca.pem\"\n\
             [[cameras]]\nname = \"c\"\nuri = \"test://ball\"\nmodel = \"m\"\n{more}"
        ),
    )
    .unwrap();
    Command::new(env!("CARGO_BIN_EXE_tidegate-edge"))
        .arg("--config")
        .arg(&cfg)
        .args(args)
        .env_remove("TIDEGATE_METRICS_LISTEN")
        .env_remove("TIDEGATE_GATEWAY_ADDR")
        .env_remove("TIDEGATE_SUMMARY_EVERY")
        .env("TIDEGATE_LOG", "warn")
        .output()
        .unwrap()
}

#[test]
fn metrics_without_summaries_are_refused_naming_the_flag() {
    let out = edge(
        "",
        &["--metrics-listen", "127.0.0.1:0", "--summary-every", "0"],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("--summary-every above 0"), "{stderr}");
}

#[test]
fn a_metrics_address_in_use_is_refused_naming_the_setting() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let out = edge(&format!("[metrics]\nlisten = \"{addr}\"\n"), &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "cannot listen for metrics on {addr} (metrics.listen"
        )),
        "{stderr}"
    );
}
