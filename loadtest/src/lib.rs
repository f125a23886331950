//! tidegate-loadtest: simulated cameras against a gateway, latency
//! histograms, a JSON report, an SVG picture of it ([`svg`]) and an SLO gate; and [`cluster`], which starts
//! a local cluster of real processes for tests and local runs; the
//! benchmarks behind `tidegate-bench` ([`schedbench`], [`relay`]).
//!
//! Every fallible operation has an error enum of its own
//! ([`cluster::ClusterError`], [`cluster::HttpError`],
//! [`edge_harness::EdgeHarnessError`], [`relay::RelayError`],
//! [`sim::SimError`], ...); an error about a child process carries that
//! process's log.

/// `Debug` as `Display`, for errors that carry a process's log: a test's
/// `expect` then prints the log as lines rather than as one escaped string
/// (the message already names every field).
macro_rules! debug_as_display {
    ($($t:ty),+ $(,)?) => {$(
        impl std::fmt::Debug for $t {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                std::fmt::Display::fmt(self, f)
            }
        }
    )+};
}

pub mod cluster;
pub mod edge_harness;
pub mod relay;
pub mod report;
pub mod schedbench;
pub mod sim;
pub mod svg;
