//! The `tidegate-edge` binary given the gateway by host name, in the file
//! or in `TIDEGATE_GATEWAY_ADDR`, and malformed addresses refused naming
//! where they came from; an https:// webhook's TLS set up by
//! `check-config`, and a CA file it cannot use refused naming the file;
//! cameras that `run` would disable (bad URI, missing file) named by
//! `check-config`.
#![cfg(feature = "capture")]

use std::process::{Command, Output};

/// `tidegate-edge --config <file> check-config`, with `gateway.addr = addr`
/// in the file and `env` set.
fn check_config(addr: &str, env: &[(&str, &str)]) -> Output {
    check_config_with(addr, "", env)
}

/// [`check_config`] with `more` appended to the file.
fn check_config_with(addr: &str, more: &str, env: &[(&str, &str)]) -> Output {
    let dir = tempfile::tempdir().unwrap();
    // the CA the config trusts: check-config reads it as the uplink does
    tidegate_protocol::certs::generate(dir.path(), &["localhost".to_string()]).unwrap();
    let cfg = dir.path().join("edge.toml");
    std::fs::write(
        &cfg,
        format!(
            "name = \"e\"\ntoken = \"t\"\n[gateway]\naddr = \"{addr}\"\nca = \"ca.pem\"\n{more}"
        ),
    )
    .unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tidegate-edge"));
    cmd.arg("--config").arg(&cfg).arg("check-config");
    for var in [
        "TIDEGATE_GATEWAY_ADDR",
        "TIDEGATE_EDGE_TOKEN",
        "TIDEGATE_CA",
        "TIDEGATE_WEBHOOK_TOKEN",
    ] {
        cmd.env_remove(var);
    }
    cmd.env("TIDEGATE_LOG", "warn").envs(env.iter().copied());
    cmd.output().unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn gateway_host_names_from_the_environment_and_the_file_pass_check_config() {
    let out = check_config(
        "127.0.0.1:4433",
        &[("TIDEGATE_GATEWAY_ADDR", "gw.example.com:4433")],
    );
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stdout.contains("gateway  gw.example.com:4433 (")
            && stdout.ends_with("config ok\n")
            && stdout.lines().count() < 10,
        "{stdout}"
    );

    let out = check_config("localhost:4433", &[]);
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(stdout.contains("gateway  localhost:4433 ("), "{stdout}");
}

#[test]
fn malformed_gateway_addresses_are_refused_naming_the_source() {
    let out = check_config(
        "127.0.0.1:4433",
        &[("TIDEGATE_GATEWAY_ADDR", "quic://gw:4433")],
    );
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--gateway") && stderr.contains("has a scheme (quic://)"),
        "{stderr}"
    );

    let out = check_config("gw example:4433", &[]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("gateway.addr: gateway address \"gw example:4433\" contains whitespace"),
        "{stderr}"
    );
}

#[test]
fn check_config_sets_up_an_https_webhook_and_refuses_a_ca_it_cannot_use() {
    let ok = check_config_with(
        "127.0.0.1:4433",
        "[sinks]\nwebhook = \"https://collector.example/hook\"\n",
        &[("TIDEGATE_WEBHOOK_TOKEN", "s3cret")],
    );
    let out = text(&ok.stdout);
    assert!(ok.status.success(), "{out}{}", text(&ok.stderr));
    assert!(
        out.contains("webhook https://collector.example/hook (TLS, bearer token)"),
        "{out}"
    );
    assert!(!out.contains("s3cret"), "the token is printed: {out}");
    let bad = check_config_with(
        "127.0.0.1:4433",
        "[sinks]\nwebhook = \"https://collector.example/hook\"\nwebhook_ca = \"nowhere/ca.pem\"\n",
        &[],
    );
    let err = text(&bad.stderr);
    assert!(!bad.status.success());
    assert!(
        err.contains("sinks.webhook") && err.contains("nowhere/ca.pem"),
        "{err}"
    );
}

#[test]
fn a_gateway_ca_that_is_missing_fails_check_config_naming_the_file_and_the_setting() {
    let out = check_config(
        "127.0.0.1:4433",
        &[("TIDEGATE_CA", "/no/such/gateway-ca.pem")],
    );
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("/no/such/gateway-ca.pem") && stderr.contains("gateway.ca"),
        "{stderr}"
    );
}

/// `check-config` makes the checks `run` makes before it reaches the
/// gateway: a camera whose URI has an unknown scheme or no host, or names a
/// file that is not there, would be disabled, so it is not "config ok".
#[test]
fn check_config_names_every_camera_that_run_would_disable() {
    let cameras = [
        ("ftp", "ftp://x/y"),
        ("gone", "file:///nonexistent/tidegate/clip.mp4"),
        ("nohost", "rtsp:///nohost"),
        ("fine", "test://smpte"),
    ]
    .iter()
    .map(|(name, uri)| format!("[[cameras]]\nname = \"{name}\"\nuri = \"{uri}\"\nmodel = \"m\"\n"))
    .collect::<String>();
    let out = check_config_with("127.0.0.1:4433", &cameras, &[]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(1), "{stdout}{stderr}");
    assert!(!stdout.contains("config ok"), "{stdout}");
    assert!(stderr.contains("3 camera(s) would be disabled"), "{stderr}");
    for (camera, says) in [
        ("'ftp'", "scheme 'ftp' is not supported"),
        ("'gone'", "/nonexistent/tidegate/clip.mp4"),
        ("'nohost'", "names no host"),
    ] {
        assert!(
            stderr
                .lines()
                .any(|l| l.contains(camera) && l.contains(says)),
            "{camera}: {stderr}"
        );
    }
    assert!(!stderr.contains("'fine'"), "{stderr}");
}
