//! The `tidegate-worker` binary given the gateway by host name, as the
//! gateway's Kubernetes provider gives it to worker Pods
//! (`TIDEGATE_GATEWAY_ADDR = "tidegate-gateway.tidegate.svc:4433"`), and
//! malformed addresses refused in one line naming where they came from;
//! and `check-cuda` on this machine, which has no NVIDIA driver.

use std::path::Path;
use std::process::{Command, Output};

/// Variables of the caller's shell that would change what is tested.
const ISOLATE: [&str; 6] = [
    "TIDEGATE_GATEWAY_ADDR",
    "TIDEGATE_WORKER_TOKEN",
    "TIDEGATE_LEASE_ID",
    "TIDEGATE_LEASE_TOKEN",
    "TIDEGATE_MODELS",
    "TIDEGATE_CA",
];

/// `tidegate-worker --config <file> check-config` serving BlazeFace on one
/// CPU thread, with `gateway.addr = addr` in the file and `env` set.
fn check_config(addr: &str, env: &[(&str, &str)]) -> Output {
    worker(addr, env, &["check-config"])
}

/// `tidegate-worker --config <file> ARGS` with the config of
/// [`check_config`].
fn worker(addr: &str, env: &[(&str, &str)], args: &[&str]) -> Output {
    let dir = tempfile::tempdir().unwrap();
    // the CA the config trusts: check-config reads it as the link does
    tidegate_protocol::certs::generate(dir.path(), &["localhost".to_string()]).unwrap();
    let cfg = dir.path().join("w.toml");
    let models = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models");
    std::fs::write(
        &cfg,
        format!(
            "name = \"w\"\ntoken = \"t\"\n[gateway]\naddr = \"{addr}\"\nca = \"ca.pem\"\n[models]\ndir = \"{}\"\nonly = [\"blazeface\"]\n[runtime]\nintra_threads = 1\n",
            models.display()
        ),
    )
    .unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tidegate-worker"));
    cmd.arg("--config").arg(&cfg).args(args);
    for var in ISOLATE {
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
        "127.0.0.1:9",
        &[(
            "TIDEGATE_GATEWAY_ADDR",
            "tidegate-gateway.tidegate.svc:4433",
        )],
    );
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stdout.starts_with("config ok: 1 model(s)"), "{stdout}");

    let out = check_config("gw.example.com:4433", &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
}

/// The CA the link will trust is read as the link reads it: a config whose
/// CA is missing fails the check, naming the file and the setting.
#[test]
fn a_missing_ca_fails_check_config_naming_the_file_and_the_setting() {
    let out = worker(
        "127.0.0.1:9",
        &[],
        &["--ca", "/no/such/ca.pem", "check-config"],
    );
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("/no/such/ca.pem") && stderr.contains("gateway.ca"),
        "{stderr}"
    );
}

#[test]
fn malformed_gateway_addresses_are_refused_in_one_line_naming_the_source() {
    // From the environment: a usage error (exit 2) naming the flag.
    let out = check_config(
        "127.0.0.1:9",
        &[("TIDEGATE_GATEWAY_ADDR", "gw example:4433")],
    );
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--gateway") && stderr.contains("\"gw example:4433\" contains whitespace"),
        "{stderr}"
    );
    assert!(!stderr.contains("invalid socket address"), "{stderr}");

    // From the file: the config error names the field.
    let out = check_config("::1:4433", &[]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.starts_with("tidegate-worker: error: invalid config ")
            && stderr.contains("gateway.addr: gateway address \"::1:4433\" has more than one ':'"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// The lines `check-cuda` prints, and its exit code.
fn check_cuda(env: &[(&str, &str)], ort: Option<&Path>) -> (Option<i32>, String) {
    let mut args = vec!["check-cuda".to_string()];
    if let Some(lib) = ort {
        args.push(format!("--ort-lib={}", lib.display()));
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = worker("127.0.0.1:9", env, &args);
    let stderr = text(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    (out.status.code(), format!("{}{stderr}", text(&out.stdout)))
}

#[test]
fn check_cuda_names_each_thing_missing_on_a_machine_without_a_driver() {
    // make setup's ONNX Runtime is the CPU build.
    let (code, out) = check_cuda(&[], None);
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("ok       ONNX Runtime: "), "{out}");
    assert!(
        out.contains("MISSING  its CUDA execution provider: a CPU build"),
        "{out}"
    );
    if cfg!(feature = "cuda") {
        assert!(
            out.contains("MISSING  the NVIDIA driver and its devices: no CUDA driver"),
            "{out}"
        );
    } else {
        assert!(out.contains("built without the `cuda` feature"), "{out}");
    }
    assert!(
        out.contains(
            "tidegate-worker: error: cannot serve on CUDA here: its CUDA execution provider"
        ),
        "{out}"
    );

    // ONNX Runtime's GPU build and NVRTC, as the CUDA worker image has them
    // (make test's setup fetches both): only the driver is missing.
    let cache = tidegate_worker::runtime::cache_dir().unwrap();
    let gpu_build = cache.join(format!(
        "cuda-libs/onnxruntime-gpu-{}/onnxruntime/libonnxruntime.so",
        tidegate_worker::runtime::ORT_VERSION
    ));
    let nvrtc = cache.join("cuda-nvrtc/12.9.86");
    if !gpu_build.is_file() || !nvrtc.is_dir() {
        eprintln!(
            "SKIPPED the GPU build's half: no {} or {}",
            gpu_build.display(),
            nvrtc.display()
        );
        assert!(
            std::env::var_os("CI").is_none(),
            "CI is set, but make test's setup (scripts/setup.sh --cuda) did not fetch them"
        );
        return;
    }
    let path = nvrtc.to_string_lossy().into_owned();
    let (code, out) = check_cuda(&[("LD_LIBRARY_PATH", &path)], Some(&gpu_build));
    assert_eq!(code, Some(1), "{out}");
    assert!(
        out.contains("ok       its CUDA execution provider: built in"),
        "{out}"
    );
    if cfg!(feature = "cuda") {
        assert!(
            out.contains("ok       NVRTC and the preprocessing kernel: compiles"),
            "{out}"
        );
        assert!(
            out.contains("cannot serve on CUDA here: the NVIDIA driver and its devices\n"),
            "{out}"
        );
    }
}
