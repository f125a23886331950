//! The `tidegate-worker` binary wedged before it registers, on the real
//! ONNX Runtime: its watchdog ends it with exit status 3 and says which
//! warm-up or profiling run never returned, as it does for a batch.
//!
//! The wedge is a graph written here byte by byte: `spin` takes `pixels`
//! `[batch,8,8,3]` f32 and returns them as `y` through a `Loop` with no
//! trip count whose condition is `batch == SPIN_BATCH` and which carries it
//! on unchanged. At any other batch size the loop runs no iteration; at
//! `SPIN_BATCH` it never ends, keeping ONNX Runtime in one run for ever,
//! like a device that stopped answering. The worker warms a model up at
//! batches 1 and `max_batch` (4 here) and profiles 1, 2 and 4, so
//! `SPIN_BATCH = 1` wedges its first warm-up run and `SPIN_BATCH = 2` its
//! profiling.

use std::fs;
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use tidegate_testkit::pb;

const FLOAT: i64 = 1;
const INT64: i64 = 7;
const BOOL: i64 = 9;

/// A tensor's type: `None` for a scalar, else the symbol `batch` followed
/// by `dims`.
fn value_info(out: &mut Vec<u8>, field: u64, name: &str, elem: i64, dims: Option<&[i64]>) {
    pb::msg(out, field, |v| {
        pb::bytes(v, 1, name.as_bytes());
        pb::msg(v, 2, |t| {
            pb::msg(t, 1, |tt| {
                pb::int(tt, 1, elem);
                pb::msg(tt, 2, |shape| {
                    if let Some(dims) = dims {
                        pb::msg(shape, 1, |d| pb::bytes(d, 2, b"batch"));
                        for &dim in dims {
                            pb::msg(shape, 1, |d| pb::int(d, 1, dim));
                        }
                    }
                });
            });
        });
    });
}

/// A scalar int64 initializer.
fn scalar(out: &mut Vec<u8>, name: &str, value: i64) {
    pb::msg(out, 5, |t| {
        pb::int(t, 2, INT64);
        pb::bytes(t, 8, name.as_bytes());
        pb::bytes(t, 9, &value.to_le_bytes());
    });
}

/// A node; `body` is a `Loop`'s body graph.
fn node(out: &mut Vec<u8>, op: &str, inputs: &[&str], output: &str, body: Option<&[u8]>) {
    pb::msg(out, 1, |n| {
        for i in inputs {
            pb::bytes(n, 1, i.as_bytes());
        }
        pb::bytes(n, 2, output.as_bytes());
        pb::bytes(n, 3, output.as_bytes());
        pb::bytes(n, 4, op.as_bytes());
        if let Some(body) = body {
            pb::msg(n, 5, |a| {
                pb::bytes(a, 1, b"body");
                pb::bytes(a, 6, body);
                pb::int(a, 20, 5); // AttributeType GRAPH
            });
        }
    });
}

const FRAME: [i64; 3] = [8, 8, 3];

/// The `spin` graph: never returns from a run of `spin_batch` frames.
fn spin_onnx(spin_batch: i64) -> Vec<u8> {
    // The loop's body: carries its condition and the pixels on unchanged.
    let mut body = Vec::new();
    node(&mut body, "Identity", &["cond_in"], "cond_out", None);
    node(&mut body, "Identity", &["v_in"], "v_out", None);
    pb::bytes(&mut body, 2, b"spin_body");
    value_info(&mut body, 11, "iteration", INT64, None);
    value_info(&mut body, 11, "cond_in", BOOL, None);
    value_info(&mut body, 11, "v_in", FLOAT, Some(&FRAME));
    value_info(&mut body, 12, "cond_out", BOOL, None);
    value_info(&mut body, 12, "v_out", FLOAT, Some(&FRAME));

    let mut graph = Vec::new();
    node(&mut graph, "Shape", &["pixels"], "shape", None);
    node(&mut graph, "Gather", &["shape", "zero"], "batch", None);
    node(&mut graph, "Equal", &["batch", "spin_batch"], "spin", None);
    // No trip count (""): a while loop on `spin`.
    node(
        &mut graph,
        "Loop",
        &["", "spin", "pixels"],
        "y",
        Some(&body),
    );
    pb::bytes(&mut graph, 2, b"spin");
    scalar(&mut graph, "zero", 0);
    scalar(&mut graph, "spin_batch", spin_batch);
    value_info(&mut graph, 11, "pixels", FLOAT, Some(&FRAME));
    value_info(&mut graph, 12, "y", FLOAT, Some(&FRAME));
    let mut model = Vec::new();
    pb::int(&mut model, 1, 8); // IR version
    pb::bytes(&mut model, 2, b"tidegate-test");
    pb::bytes(&mut model, 7, &graph);
    pb::msg(&mut model, 8, |o| {
        pb::bytes(o, 1, b"");
        pb::int(o, 2, 13);
    });
    model
}

const SPIN_TOML: &str = r#"
name = "spin"
version = 1
file = "spin.onnx"
max_batch = 4

[input]
name = "pixels"
layout = "nhwc"
width = 8
height = 8
channels = 3
color = "rgb"
resize = "stretch"
model_dtype = "f32"

[[outputs]]
name = "y"
shape = [-1, 8, 8, 3]

[decoder]
kind = "raw"
"#;

/// Variables of the caller's shell that would change what is tested.
const ISOLATE: [&str; 7] = [
    "TIDEGATE_GATEWAY_ADDR",
    "TIDEGATE_WORKER_TOKEN",
    "TIDEGATE_LEASE_ID",
    "TIDEGATE_LEASE_TOKEN",
    "TIDEGATE_MODELS",
    "TIDEGATE_CA",
    "TIDEGATE_WORKER_CONFIG",
];

/// Bounds the wait for a worker that never exits (the behaviour under test
/// broken); no assertion depends on how fast it does.
const SAFETY_NET: Duration = Duration::from_secs(120);

/// How a worker run ended.
struct Ended {
    status: ExitStatus,
    stdout: String,
    stderr: String,
}

/// Runs `tidegate-worker ARGS` (no args: serving, the default command) on
/// a repository holding only `spin` wedging at `spin_batch`, with `runtime`
/// in its `[runtime]` section. The gateway address is never dialled when
/// the worker wedges before that.
fn run_worker(spin_batch: i64, runtime: &str, args: &[&str]) -> Ended {
    let dir = tempfile::tempdir().unwrap();
    // the CA the config trusts: check-config reads it as the link does
    tidegate_protocol::certs::generate(dir.path(), &["localhost".to_string()]).unwrap();
    let models = dir.path().join("models");
    let folder = models.join("spin");
    fs::create_dir_all(&folder).unwrap();
    fs::write(folder.join("spin.onnx"), spin_onnx(spin_batch)).unwrap();
    fs::write(folder.join("model.toml"), SPIN_TOML).unwrap();
    let cfg = dir.path().join("w.toml");
    fs::write(
        &cfg,
        format!(
            "name = \"w\"\ntoken = \"t\"\n[gateway]\naddr = \"127.0.0.1:9\"\nca = \"ca.pem\"\n[models]\ndir = \"{}\"\n[runtime]\nintra_threads = 1\n{runtime}",
            models.display()
        ),
    )
    .unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tidegate-worker"));
    cmd.arg("--config").arg(&cfg).args(args);
    for var in ISOLATE {
        cmd.env_remove(var);
    }
    let mut child = cmd
        .env("TIDEGATE_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Read on threads of their own, so that a chatty child never blocks on
    // a full pipe.
    let read = |mut pipe: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = pipe.read_to_string(&mut text);
            text
        })
    };
    let stdout = read(Box::new(child.stdout.take().unwrap()));
    let stderr = read(Box::new(child.stderr.take().unwrap()));
    let deadline = Instant::now() + SAFETY_NET;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "the worker never exited (wedged at batch {spin_batch}):\n{}",
                stderr.join().unwrap()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Ended {
        status,
        stdout: stdout.join().unwrap(),
        stderr: stderr.join().unwrap(),
    }
}

fn assert_says(stderr: &str, says: &[&str]) {
    for s in says {
        assert!(stderr.contains(s), "{s:?} missing from:\n{stderr}");
    }
}

#[test]
fn worker_wedged_in_its_first_warm_up_run_exits_3_naming_the_run() {
    // The start-up limit applies, not the batch one.
    let end = run_worker(
        1,
        "wedged_after_secs = 5\nwarmup_wedged_after_secs = 6\n",
        &[],
    );
    let stderr = &end.stderr;
    assert_eq!(end.status.code(), Some(3), "{stderr}");
    assert_says(
        stderr,
        &[
            "a warm-up run of 1 frame(s) for model 'spin' has run for",
            "longer than runtime.warmup_wedged_after_secs (6 s)",
            "wedged in start-up, before the worker registered",
            "exiting with status 3",
        ],
    );
    assert!(!stderr.contains("session ready"), "{stderr}");
    assert_wedge_is_the_last_word(stderr);
}

/// The exit can tear ONNX Runtime down under the wedged run, which then
/// fails: the worker never reports that as a start-up error of its own, nor
/// dials the gateway.
fn assert_wedge_is_the_last_word(stderr: &str) {
    assert!(!stderr.contains("tidegate-worker: error:"), "{stderr}");
    assert!(!stderr.contains("dialling the gateway"), "{stderr}");
}

#[test]
fn worker_wedged_in_profiling_exits_3_naming_the_run_after_warming_up() {
    let end = run_worker(
        2,
        "wedged_after_secs = 5\nwarmup_wedged_after_secs = 6\n",
        &[],
    );
    let stderr = &end.stderr;
    assert_eq!(end.status.code(), Some(3), "{stderr}");
    assert_says(
        stderr,
        &[
            // Warm-up (batches 1 and 4) and batch 1's profiling passed.
            "session ready",
            "a profiling run of 2 frame(s) for model 'spin' has run for",
            "longer than runtime.warmup_wedged_after_secs (6 s)",
            "wedged in start-up, before the worker registered",
        ],
    );
    assert_wedge_is_the_last_word(stderr);
}

/// The same graph at other batch sizes runs, and a model that starts within
/// the limits is not taken for wedged: `check-config` (watched like a
/// start) warms it up and profiles it (batches 1, 2 and 4) and exits 0.
#[test]
fn spin_graph_runs_at_other_batch_sizes_and_check_config_passes_under_the_watchdog() {
    // Wedges only at batch 3, which the worker never runs at start-up.
    let end = run_worker(
        3,
        "wedged_after_secs = 5\nwarmup_wedged_after_secs = 5\n",
        &["check-config"],
    );
    assert_eq!(end.status.code(), Some(0), "{}", end.stderr);
    assert!(
        end.stdout.starts_with("config ok: 1 model(s)"),
        "{}",
        end.stdout
    );
    assert_says(&end.stderr, &["profiled"]);
}
