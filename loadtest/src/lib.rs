//! tidegate-loadtest: simulated cameras against a gateway ([`loadgen`], the
//! load generator), latency histograms, a JSON report, an SVG picture of it ([`svg`]) and an SLO gate; and [`cluster`], which starts
//! a local cluster of real processes for tests and local runs; the
//! benchmarks behind `tidegate-bench` ([`schedbench`], [`relay`]); and
//! [`impair`], a seeded userspace WAN impairment relay (`tidegate-loadtest
//! impair`) to put between a QUIC client and the gateway.
//!
//! Every fallible operation has an error enum of its own
//! ([`cluster::ClusterError`], [`cluster::HttpError`],
//! [`edge_harness::EdgeHarnessError`], [`relay::RelayError`],
//! [`loadgen::LoadError`], ...); an error about a child process carries that
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

pub mod attack;
pub mod cluster;
pub mod edge_harness;
pub mod hostilebench;
pub mod impair;
pub mod kserve;
pub mod loadgen;
pub mod relay;
pub mod report;
pub mod scenario;
pub mod schedbench;
pub mod startup;
pub mod svg;
pub mod wanbench;

/// The median of `xs` (the mean of the middle two for an even count; NaN
/// for none).
pub(crate) fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(super::median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(super::median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(super::median(&[]).is_nan());
    }
}
