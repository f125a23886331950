//! The peers of `make bench-peers`, each started for real and driven by
//! `tidegate-loadtest kserve` for a short, bounded run: FastAPI +
//! onnxruntime, and NVIDIA Triton through PyTriton (python backend with
//! onnxruntime, dynamic batching), from the pinned venv
//! `loadtest/peers/setup.sh` builds (`scripts/setup.sh` does it once).
//!
//! What is checked is the accounting, never the speed: every planned frame
//! ends in exactly one bucket, none is missing, and answers come back ok.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tidegate_loadtest::cluster::{command, workspace_root};

/// Longest wait for a peer to be ready (Triton starts its server and two
/// python stubs).
const READY: Duration = Duration::from_secs(120);

/// The peers' python, from their venv (created if missing).
fn peers_python() -> PathBuf {
    let out = Command::new("bash")
        .arg(workspace_root().join("loadtest/peers/setup.sh"))
        .stderr(Stdio::inherit())
        .output()
        .expect("bash runs");
    assert!(
        out.status.success(),
        "loadtest/peers/setup.sh failed: run scripts/setup.sh"
    );
    let text = String::from_utf8(out.stdout).unwrap();
    PathBuf::from(text.lines().last().expect("a python path").trim())
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A peer server in a process group of its own, stopped (the whole group:
/// Triton's server and stubs too) on drop.
struct Peer {
    child: Child,
    port: u16,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Peer {
    fn start(script: &str, args: &[&str], env: &[(&str, String)]) -> Peer {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("peer.log");
        let port = free_port();
        let mut cmd = Command::new(peers_python());
        cmd.arg(workspace_root().join("loadtest/peers").join(script))
            .arg("--model-dir")
            .arg(workspace_root().join("models/blazeface"))
            .args(["--port", &port.to_string()])
            .args(args)
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(std::fs::File::create(dir.path().join("peer.err")).unwrap())
            .process_group(0);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().expect("the peer starts");
        let peer = Peer {
            child,
            port,
            log,
            _dir: dir,
        };
        peer.wait_ready();
        peer
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Waits for `GET /v2/models/blazeface/ready` to answer 200 (Triton's
    /// server is ready before its model is loaded).
    fn wait_ready(&self) {
        let until = Instant::now() + READY;
        loop {
            if ready(self.port) {
                return;
            }
            assert!(
                Instant::now() < until,
                "the peer was not ready within {READY:?}; log:\n{}\n{}",
                std::fs::read_to_string(&self.log).unwrap_or_default(),
                std::fs::read_to_string(self.log.with_file_name("peer.err")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let group = self.child.id();
        let _ = tidegate_kit::signal::send_group(group, tidegate_kit::signal::Signal::Term);
        let until = Instant::now() + Duration::from_secs(10);
        while Instant::now() < until && self.child.try_wait().ok().flatten().is_none() {
            std::thread::sleep(Duration::from_millis(50));
        }
        // Whatever of the group is left (Triton's server outlives PyTriton).
        std::thread::sleep(Duration::from_millis(500));
        let _ = tidegate_kit::signal::send_group(group, tidegate_kit::signal::Signal::Kill);
        let _ = self.child.wait();
    }
}

/// A minimal `GET /v2/models/blazeface/ready` on 127.0.0.1:`port`:
/// answered 200?
fn ready(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    let req =
        "GET /v2/models/blazeface/ready HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
    if s.write_all(req.as_bytes()).is_err() {
        return false;
    }
    let mut head = [0u8; 12];
    s.read_exact(&mut head).is_ok() && head.starts_with(b"HTTP/1.1 200")
}

/// Runs `tidegate-loadtest kserve` against `url` for 2 s (2 cameras at
/// 5 fps) and returns its report.
fn drive(url: &str) -> serde_json::Value {
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("report.json");
    let out = command("tidegate-loadtest")
        .expect("tidegate-loadtest is built")
        .args(["kserve", "--url", url, "--model", "blazeface"])
        .args(["--cameras", "2", "--fps", "5", "--seconds", "2"])
        .arg("--report")
        .arg(&report)
        .output()
        .expect("the load generator runs");
    assert!(
        out.status.success(),
        "tidegate-loadtest kserve failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap()
}

/// Every planned frame in exactly one bucket, none missing, answers ok.
fn check_accounting(system: &str, r: &serde_json::Value) {
    let n = |k: &str| {
        r[k].as_u64()
            .unwrap_or_else(|| panic!("{system}: no {k} in {r}"))
    };
    let buckets: u64 = r["outcomes"]
        .as_object()
        .unwrap_or_else(|| panic!("{system}: no outcomes in {r}"))
        .values()
        .map(|v| v.as_u64().unwrap())
        .sum();
    assert_eq!(n("planned"), 20, "{system}: {r}");
    assert_eq!(buckets, n("planned"), "{system}: {r}");
    assert_eq!(n("missing"), 0, "{system}: {r}");
    assert!(n("ok") > 0, "{system}: nothing answered ok: {r}");
    assert_eq!(
        n("http_errors") + n("malformed"),
        0,
        "{system}: a well-formed request was refused or answered badly: {r}"
    );
}

#[test]
fn a_fastapi_peer_serves_blazeface_over_kserve_and_every_frame_is_accounted_for() {
    let peer = Peer::start("fastapi_server.py", &["--workers", "1"], &[]);
    check_accounting("fastapi", &drive(&peer.url()));
}

#[test]
fn a_triton_peer_serves_blazeface_over_kserve_and_every_frame_is_accounted_for() {
    let python = peers_python();
    // Debian 12: Triton's python backend stub needs the interpreter's
    // libpython.
    let libdir = Command::new(&python)
        .args([
            "-c",
            "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))",
        ])
        .output()
        .expect("python runs");
    let libdir = String::from_utf8(libdir.stdout).unwrap().trim().to_string();
    let peer = Peer::start(
        "triton_server.py",
        &["--instances", "1"],
        &[("LD_LIBRARY_PATH", libdir)],
    );
    check_accounting("triton", &drive(&peer.url()));
}
