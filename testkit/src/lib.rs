//! tidegate's test support, for integration tests only (a dev-dependency):
//! the doubles and fixtures that several test binaries share, one module
//! each, behind the feature of its area (testkit/Cargo.toml), and
//! [`eventually`], the one bounded poll.
//!
//! It holds no test of tidegate itself, and nothing in it may be used by
//! a binary or a library's non-test code.

use std::fmt::Display;
use std::time::Duration;

#[cfg(feature = "astronaut")]
pub mod astronaut;
#[cfg(feature = "capture")]
pub mod clip;
#[cfg(feature = "leasing")]
pub mod leasing;
#[cfg(feature = "kube")]
pub mod mini_kube;
#[cfg(feature = "slurm")]
pub mod mini_slurm;
#[cfg(feature = "worker")]
pub mod pb;
#[cfg(feature = "prometheus")]
pub mod promtool;
#[cfg(feature = "provider")]
pub mod provider;
#[cfg(feature = "edge")]
pub mod receiver;
#[cfg(feature = "edge")]
pub mod shaped_link;

/// How often [`eventually`] asks again.
pub const POLL: Duration = Duration::from_millis(50);

/// Asks `done` every [`POLL`] until it holds. Past `timeout` it panics with
/// `timed out after {timeout} waiting for {what}`; `what` is formatted only
/// then, so it may gather state for the failure (a cluster's logs).
///
/// The timeout only guards against a hang: a test asserts what happened,
/// never how fast. It runs on tokio's clock, so under a paused clock
/// (`tokio::time::pause`) it is virtual time.
pub async fn eventually(what: impl Display, timeout: Duration, mut done: impl FnMut() -> bool) {
    let until = tokio::time::Instant::now() + timeout;
    while !done() {
        assert!(
            tokio::time::Instant::now() < until,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(POLL).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    #[tokio::test]
    async fn eventually_asks_again_until_the_condition_holds() {
        let flag = Arc::new(AtomicBool::new(false));
        let set = flag.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            set.store(true, Ordering::SeqCst);
        });
        let mut asked = 0u32;
        eventually("the flag", Duration::from_secs(60), || {
            asked += 1;
            flag.load(Ordering::SeqCst)
        })
        .await;
        assert!(flag.load(Ordering::SeqCst));
        assert!(asked > 1, "asked {asked} times");
    }

    #[tokio::test]
    #[should_panic(expected = "timed out after 200ms waiting for the flag")]
    async fn eventually_names_what_it_waited_for_when_it_gives_up() {
        eventually("the flag", Duration::from_millis(200), || false).await;
    }

    #[tokio::test]
    async fn eventually_formats_what_only_when_it_gives_up() {
        struct Loud;
        impl Display for Loud {
            fn fmt(&self, _: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                panic!("formatted although the wait succeeded")
            }
        }
        eventually(Loud, Duration::from_secs(1), || true).await;
    }
}
