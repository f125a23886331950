//! `tidegate-gateway check-config` and `run` as an operator meets them: a
//! good configuration gets a short summary and `config ok`; a missing
//! certificate, an unusable ledger or a port in use fails the check,
//! naming the file or the flag to change; `run` on a taken port says the
//! same.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn gateway(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tidegate-gateway"))
        .current_dir(dir)
        .args(args)
        .env_remove("TIDEGATE_GATEWAY_CONFIG")
        .env_remove("TIDEGATE_QUIC_LISTEN")
        .env_remove("TIDEGATE_HTTP_LISTEN")
        .output()
        .expect("the gateway binary runs")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// A folder with development certificates and a config naming them (and
/// `extra` appended), listening on ports 0.
fn setup(extra: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let made = gateway(dir.path(), &["dev-certs", "--out", "certs"]);
    assert!(made.status.success(), "{}", text(&made));
    std::fs::write(
        dir.path().join("gateway.toml"),
        format!(
            "[quic]\nlisten = \"127.0.0.1:0\"\ncert = \"certs/gateway.pem\"\nkey = \"certs/gateway.key\"\n\n[http]\nlisten = \"127.0.0.1:0\"\n{extra}"
        ),
    )
    .unwrap();
    dir
}

#[test]
fn a_good_config_is_a_short_summary_ending_config_ok() {
    let dir = setup("");
    let o = gateway(dir.path(), &["--config", "gateway.toml", "check-config"]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.trim_end().ends_with("config ok"), "{out}");
    assert!(out.lines().count() <= 15, "a summary, not a dump:\n{out}");
    assert!(!out.contains("Config {"), "no debug dump:\n{out}");
}

#[test]
fn a_missing_certificate_an_unusable_ledger_and_a_missing_worker_fail_the_check_naming_them() {
    let dir = setup(concat!(
        "\n[leasing]\nprovider = \"process\"\nledger = \"ledger.db\"\n",
        "[leasing.process]\ncommand = \"no-such-tidegate-worker\"\n",
        "[[leasing.models]]\nname = \"blazeface\"\ninstance_types = [\"cpu-32\"]\nworker_fps = 50\n",
    ));
    std::fs::remove_file(dir.path().join("certs/gateway.pem")).unwrap();
    std::fs::write(dir.path().join("ledger.db"), "not sqlite").unwrap();
    let o = gateway(dir.path(), &["--config", "gateway.toml", "check-config"]);
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(
        t.contains("FAIL TLS certificate and key") && t.contains("gateway.pem"),
        "{t}"
    );
    assert!(
        t.contains("FAIL ledger") && t.contains("not an SQLite database"),
        "{t}"
    );
    assert!(
        t.contains("FAIL worker command") && t.contains("not on PATH"),
        "{t}"
    );
    assert!(t.contains("3 check(s) failed"), "{t}");
}

#[test]
fn a_port_in_use_names_the_flag_in_the_check_and_in_run() {
    let dir = setup("");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let flags = ["--config", "gateway.toml", "--http-listen", addr.as_str()];
    let o = gateway(dir.path(), &[&flags[..], &["check-config"]].concat());
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(
        t.contains("is in use") && t.contains("--http-listen"),
        "{t}"
    );

    // run stops at once with the same advice; bounded in case it does not
    let mut child = Command::new(env!("CARGO_BIN_EXE_tidegate-gateway"))
        .current_dir(dir.path())
        .args(flags)
        .arg("run")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let until = Instant::now() + Duration::from_secs(30);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > until {
            let _ = child.kill();
            panic!("run did not stop on a taken port");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let o = child.wait_with_output().unwrap();
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(
        t.contains("is in use") && t.contains("--http-listen"),
        "{t}"
    );
}

#[test]
fn the_version_is_the_binarys_name_and_the_workspaces_version() {
    let dir = tempfile::tempdir().unwrap();
    let o = gateway(dir.path(), &["--version"]);
    assert_eq!(
        String::from_utf8_lossy(&o.stdout).trim(),
        format!("tidegate-gateway {}", env!("CARGO_PKG_VERSION"))
    );
}
