//! tidegate-loadtest: simulated cameras against a gateway, latency
//! histograms, a JSON report, an SVG picture of it ([`svg`]) and an SLO gate; and [`cluster`], which starts
//! a local cluster of real processes for tests and local runs; the
//! benchmarks behind `tidegate-bench` ([`schedbench`], [`relay`]).

pub mod cluster;
pub mod edge_harness;
pub mod relay;
pub mod report;
pub mod schedbench;
pub mod sim;
pub mod svg;
