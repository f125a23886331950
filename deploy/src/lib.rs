//! `deploy/` checked against the code it deploys. The checks are this
//! crate's integration tests:
//!
//! - `tests/container_images.rs`: the container images that
//!   `scripts/image.py` builds from the workspace's binaries, taken apart as
//!   a runtime would, held to deploy/kubernetes/, and run under `chroot`;
//! - `tests/kubernetes_manifests.rs`: every manifest of deploy/kubernetes/
//!   against Kubernetes' own types, the lease provider's permissions and the
//!   gateway's config loader;
//! - `tests/deploy.rs`: the Prometheus rules and the Grafana dashboard
//!   against `promtool` and the series the gateway, workers and edges
//!   export.
//!
//! It ships nothing: no binary, and no crate depends on it. This library
//! holds only what those tests share: where the workspace is, where its
//! built binaries are, and how a check's problems fail a test.

use std::path::{Path, PathBuf};

/// The workspace's root, the folder above this crate's `deploy/`.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("deploy/ sits in the workspace")
        .to_path_buf()
}

/// Where the workspace's built binaries are: `TIDEGATE_BIN_DIR`, else the
/// folder of the running test executable, `target/<profile>/` (as
/// `tidegate_loadtest::cluster::bin_dir` finds them). This crate has no
/// binary of its own, so cargo builds none for its tests: `make test`
/// (`cargo test --workspace --all-features`) builds them first.
pub fn bin_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("TIDEGATE_BIN_DIR") {
        return PathBuf::from(dir);
    }
    let exe = std::env::current_exe().expect("the test executable's path");
    let mut dir = exe
        .parent()
        .expect("the test executable has a folder")
        .to_path_buf();
    // integration tests run from target/<profile>/deps/
    if dir.file_name().is_some_and(|n| n == "deps") {
        dir.pop();
    }
    dir
}

/// The path of the built binary `name` in [`bin_dir`]; panics, saying how
/// to build it, when it is not there.
pub fn bin(name: &str) -> PathBuf {
    let path = bin_dir().join(name);
    assert!(
        path.is_file(),
        "{} not found; build the binaries first: cargo build --workspace --bins --all-features \
         (or point TIDEGATE_BIN_DIR at them)",
        path.display()
    );
    path
}

/// Fails with every problem a check found, one per line.
pub fn assert_ok(problems: Vec<String>) {
    assert!(problems.is_empty(), "\n{}", problems.join("\n"));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_workspace_root_holds_the_workspace_manifest_and_deploy() {
        let root = workspace_root();
        let manifest = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
        assert!(manifest.contains("[workspace]"), "{manifest}");
        assert!(root.join("deploy/kubernetes").is_dir());
    }

    #[test]
    #[should_panic(expected = "build the binaries first: cargo build --workspace --bins")]
    fn a_missing_binary_says_how_to_build_it() {
        bin("tidegate-no-such-binary");
    }

    #[test]
    #[should_panic(expected = "\nfirst\nsecond")]
    fn assert_ok_lists_every_problem() {
        assert_ok(vec!["first".into(), "second".into()]);
    }
}
