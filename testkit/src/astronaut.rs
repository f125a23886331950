//! The walking skeleton's fixture, used by `loadtest/tests/` (`slice.rs`,
//! `edge_e2e.rs`, `edge_wan.rs`, `wan.rs`, `migration.rs`,
//! `hostile_messages.rs`): a gateway with one BlazeFace worker, the
//! astronaut test image, and where BlazeFace finds the face in it.
//! Feature `astronaut`.

use std::path::PathBuf;
use std::time::Duration;

use tidegate_loadtest::cluster::{Cluster, ClusterOptions, workspace_root};

/// The face in astronaut.png, measured once with BlazeFace through the
/// edge's GStreamer pipeline (512x512 -> 128x128) and the worker's decoder:
/// (179.3, 81.6) - (271.5, 173.8), score 0.92. The worker's own test, which
/// resizes with the `image` crate, measured (177.3, 80.6) - (271.8, 175.1).
pub const FACE: [f64; 4] = [179.3, 81.6, 271.5, 173.8];

/// models/testdata/astronaut.png.
pub fn astronaut() -> PathBuf {
    workspace_root().join("models/testdata/astronaut.png")
}

/// A gateway (edge `edge-1`) with worker `worker-1` serving BlazeFace,
/// registered.
pub fn started_cluster() -> Cluster {
    let mut c = Cluster::start(&ClusterOptions::default()).expect("gateway starts");
    c.spawn_worker("worker-1").expect("worker starts");
    c.wait_for_workers(1, Duration::from_secs(60))
        .expect("worker registers");
    c
}
