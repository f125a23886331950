//! The edge clock. Capture times and end-to-end latency are both read from
//! it, so latency needs no clock synchronisation with the gateway.

use std::sync::OnceLock;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Microseconds: UNIX-epoch time at the first call, then advanced by a
/// monotonic [`Instant`], so it never goes backwards.
pub fn now_us() -> u64 {
    static ANCHOR: OnceLock<(u64, Instant)> = OnceLock::new();
    let (epoch_us, anchor) = *ANCHOR.get_or_init(|| {
        let since_epoch = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        (
            u64::try_from(since_epoch.as_micros()).unwrap_or(u64::MAX),
            Instant::now(),
        )
    });
    let elapsed = u64::try_from(anchor.elapsed().as_micros()).unwrap_or(u64::MAX);
    epoch_us.saturating_add(elapsed)
}

#[cfg(test)]
mod tests {
    #[test]
    fn clock_never_goes_backwards() {
        let mut last = super::now_us();
        for _ in 0..1000 {
            let t = super::now_us();
            assert!(t >= last);
            last = t;
        }
        // Anchored to the UNIX epoch: later than 2020-01-01.
        assert!(last > 1_577_836_800_000_000);
    }
}
