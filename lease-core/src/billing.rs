//! Billing blocks: the one definition of what a lease costs.
//!
//! Both the ledger (accruing cost as time passes, and recomputing it from
//! lease records) and the simulator call [`blocks`], so the two can never
//! disagree. A lease's cost is a sequence of canonical blocks, each charged
//! at a fixed instant:
//!
//! * `Hour`: blocks of one hour from the billing start, each paid in full
//!   as soon as time passes its start (a lease paid until 14:00 costs
//!   nothing more if released at 14:00 sharp). Block 0 is always charged.
//! * `Second { minimum_secs }`: block 0 is the minimum, paid when it begins;
//!   after it, one-minute blocks are charged in arrears when they end, for
//!   the seconds actually used (a final partial block is charged when the
//!   lease ends, rounded up to the whole second).
//!
//! Amounts are integer [`Money`], so summing blocks in any order gives the
//! same total.

use serde::{Deserialize, Serialize};

use crate::catalog::Money;

/// Milliseconds since the Unix epoch. Every clock in this crate is injected
/// as a value of this type.
pub type Millis = u64;

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's
/// algorithm); for parsing calendar times into [`Millis`].
pub fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// One hour in [`Millis`].
pub const HOUR_MS: Millis = 3_600_000;

/// Arrears block length for per-second billing after the minimum.
pub const SECOND_BILLING_BLOCK_MS: Millis = 60_000;

/// How time on a lease is billed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "unit", rename_all = "snake_case")]
pub enum Granularity {
    /// Whole hours, paid at the start of each hour.
    Hour,
    /// Per second, with a minimum charged up front.
    Second {
        /// The minimum billed duration.
        minimum_secs: u32,
    },
}

impl Granularity {
    /// `hour` or `second`.
    pub fn unit(self) -> &'static str {
        match self {
            Granularity::Hour => "hour",
            Granularity::Second { .. } => "second",
        }
    }

    /// The minimum in seconds (3600 for hourly billing).
    pub fn minimum_secs(self) -> u32 {
        match self {
            Granularity::Hour => 3600,
            Granularity::Second { minimum_secs } => minimum_secs,
        }
    }

    /// Rebuilds from [`Granularity::unit`] and [`Granularity::minimum_secs`].
    pub fn from_parts(unit: &str, minimum_secs: u32) -> Option<Granularity> {
        match unit {
            "hour" => Some(Granularity::Hour),
            "second" => Some(Granularity::Second { minimum_secs }),
            _ => None,
        }
    }
}

/// One charged block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Block {
    /// Index from the billing start (0 is the first block).
    pub index: u32,
    /// Start of the time it pays for.
    pub start: Millis,
    /// End of the time it pays for.
    pub end: Millis,
    /// When it is charged (start for prepaid blocks, end for arrears).
    pub charged_at: Millis,
    /// Amount.
    pub amount: Money,
}

/// Cost of `ms` of time at `price_per_hour`, rounded to the nearest unit.
pub fn cost_of(price_per_hour: Money, ms: Millis) -> Money {
    let num = i128::from(price_per_hour.0) * i128::from(ms);
    let h = i128::from(HOUR_MS);
    Money(((num + h / 2) / h) as i64)
}

/// Every block of a lease that has been charged by `now`.
///
/// `start` is the billing start, `end` the end of the lease if it has ended.
/// Blocks charged after `now` (a future hour, or an arrears block still
/// running) are not included.
pub fn blocks(
    start: Millis,
    end: Option<Millis>,
    now: Millis,
    granularity: Granularity,
    price_per_hour: Money,
) -> Vec<Block> {
    let mut out = Vec::new();
    // the horizon up to which time has been used
    let used_until = match end {
        Some(e) => e.max(start),
        None => now.max(start),
    };
    match granularity {
        Granularity::Hour => {
            // block k >= 1 is charged once time has passed its start
            let horizon = used_until.min(now);
            let mut k: u32 = 0;
            loop {
                let b_start = start + u64::from(k) * HOUR_MS;
                if k > 0 && b_start >= horizon {
                    break;
                }
                if b_start > now {
                    break;
                }
                out.push(Block {
                    index: k,
                    start: b_start,
                    end: b_start + HOUR_MS,
                    charged_at: b_start,
                    amount: cost_of(price_per_hour, HOUR_MS),
                });
                k += 1;
            }
        }
        Granularity::Second { minimum_secs } => {
            let min_ms = u64::from(minimum_secs) * 1000;
            if start <= now {
                out.push(Block {
                    index: 0,
                    start,
                    end: start + min_ms,
                    charged_at: start,
                    amount: cost_of(price_per_hour, min_ms),
                });
            }
            let mut k: u32 = 1;
            loop {
                let b_start = start + min_ms + u64::from(k - 1) * SECOND_BILLING_BLOCK_MS;
                if b_start >= used_until {
                    break;
                }
                let full_end = b_start + SECOND_BILLING_BLOCK_MS;
                let b_end = full_end.min(used_until);
                // a running partial block is not charged until the lease ends
                if b_end < full_end && end.is_none() {
                    break;
                }
                if b_end > now {
                    break;
                }
                // whole seconds, rounded up
                let secs = (b_end - b_start).div_ceil(1000);
                out.push(Block {
                    index: k,
                    start: b_start,
                    end: b_end,
                    charged_at: b_end,
                    amount: cost_of(price_per_hour, secs * 1000),
                });
                k += 1;
            }
        }
    }
    out
}

/// The earliest end of a lease that keeps `block`, once charged, among its
/// blocks with the same span and amount ([`blocks`] with that end gives it
/// back): the billing start for block 0 (any end keeps the first block),
/// just past its start for a later block paid up front (an hour), and its
/// end for one charged in arrears (a per-second minute). The ledger ends a
/// lease no earlier than this for its last charged block, so a lease ended
/// at a time before a block that was already charged (a worker last seen
/// before it) keeps paying that block, and its record still recomputes to
/// what was charged.
pub fn earliest_end_keeping(block: &Block) -> Millis {
    if block.charged_at > block.start {
        block.end
    } else if block.index == 0 {
        block.start
    } else {
        block.start + 1
    }
}

/// Until when a lease is already paid for at `now`: releasing it earlier
/// saves nothing. For hourly billing, the end of the current hour block;
/// for per-second billing, the end of the minimum (or `now` after it).
pub fn paid_until(start: Millis, now: Millis, granularity: Granularity) -> Millis {
    match granularity {
        Granularity::Hour => {
            let k = now.saturating_sub(start).div_ceil(HOUR_MS).max(1);
            start + k * HOUR_MS
        }
        Granularity::Second { minimum_secs } => (start + u64::from(minimum_secs) * 1000).max(now),
    }
}

/// Sum of the blocks of one lease charged within `[from, to)` by `now`.
pub fn cost_in_range(
    start: Millis,
    end: Option<Millis>,
    now: Millis,
    granularity: Granularity,
    price_per_hour: Money,
    from: Millis,
    to: Millis,
) -> Money {
    blocks(start, end, now, granularity, price_per_hour)
        .into_iter()
        .filter(|b| b.charged_at >= from && b.charged_at < to)
        .map(|b| b.amount)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: Money = Money(22_000_000); // 22.00 per hour

    #[test]
    fn hourly_lease_pays_each_started_hour_up_front() {
        // 0 .. 1h30m: two hours charged, the second at 1h.
        let b = blocks(0, Some(90 * 60_000), 10 * HOUR_MS, Granularity::Hour, P);
        assert_eq!(b.len(), 2);
        assert_eq!(b[1].charged_at, HOUR_MS);
        assert_eq!(b.iter().map(|b| b.amount).sum::<Money>(), Money(44_000_000));
        // ending exactly on the hour does not start another block
        let b = blocks(0, Some(HOUR_MS), 10 * HOUR_MS, Granularity::Hour, P);
        assert_eq!(b.len(), 1);
        // a live lease has paid one hour up to 60 min, two just after
        assert_eq!(blocks(0, None, HOUR_MS, Granularity::Hour, P).len(), 1);
        assert_eq!(blocks(0, None, HOUR_MS + 1, Granularity::Hour, P).len(), 2);
    }

    #[test]
    fn a_lease_ended_at_the_earliest_end_keeping_its_last_block_recomputes_to_its_blocks() {
        let start = 7_000;
        for g in [Granularity::Hour, Granularity::Second { minimum_secs: 60 }] {
            // charged while live, up to 3 h 10 min
            let charged = blocks(start, None, start + 190 * 60_000, g, P);
            for last in 0..charged.len() {
                let end = earliest_end_keeping(&charged[last]);
                assert_eq!(
                    blocks(start, Some(end), u64::MAX / 2, g, P),
                    charged[..=last],
                    "{g:?}, ended after block {last}"
                );
            }
        }
    }

    #[test]
    fn per_second_lease_pays_minimum_then_used_seconds() {
        let g = Granularity::Second { minimum_secs: 60 };
        // ended after 30 s: the minimum (60 s) is charged
        let b = blocks(0, Some(30_000), 100_000, g, P);
        assert_eq!(
            b.iter().map(|b| b.amount).sum::<Money>(),
            cost_of(P, 60_000)
        );
        // ended after 150.2 s: 60 + 60 + 31 (rounded up) seconds
        let b = blocks(0, Some(150_200), 1_000_000, g, P);
        assert_eq!(b.len(), 3);
        let total: Money = b.iter().map(|b| b.amount).sum();
        assert_eq!(
            total,
            cost_of(P, 60_000) + cost_of(P, 60_000) + cost_of(P, 31_000)
        );
        // live at 150 s: the running third block is not charged yet
        assert_eq!(blocks(0, None, 150_000, g, P).len(), 2);
    }

    #[test]
    fn paid_until_is_the_end_of_the_current_block() {
        assert_eq!(paid_until(1000, 1000, Granularity::Hour), 1000 + HOUR_MS);
        assert_eq!(
            paid_until(1000, 1000 + HOUR_MS, Granularity::Hour),
            1000 + HOUR_MS
        );
        assert_eq!(
            paid_until(1000, 1001 + HOUR_MS, Granularity::Hour),
            1000 + 2 * HOUR_MS
        );
        let g = Granularity::Second { minimum_secs: 60 };
        assert_eq!(paid_until(0, 10_000, g), 60_000);
        assert_eq!(paid_until(0, 70_000, g), 70_000);
    }
}
