//! Who the GPU money went to: each lease's cost split among the edges (or
//! models) its worker served, in proportion to the worker time their frames
//! took. Pure: the ledger reads the rows, this splits them.
//!
//! A lease's whole cost is split, idle time included (a fully loaded
//! showback): a lease rented for one edge costs that edge the hour even if
//! it was busy for ten minutes. A lease that served nothing in the range
//! has no one to charge and counts as idle. Amounts are whole micro-units,
//! split by largest remainder, so the shares of a lease add up to its cost
//! exactly, and the shares plus idle add up to the total.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::catalog::Money;
use crate::table::LeaseId;

/// Work one user (an edge, or a model) got from one lease.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Frames answered `ok` before their deadline.
    pub within_slo: u64,
    /// Frames answered otherwise (`ok` too late, or `failed`).
    pub late: u64,
    /// The worker time its frames took (µs): each batch's run time split
    /// evenly among the batch's frames.
    pub busy_us: u64,
}

impl std::ops::AddAssign for Usage {
    fn add_assign(&mut self, o: Usage) {
        self.within_slo += o.within_slo;
        self.late += o.late;
        self.busy_us += o.busy_us;
    }
}

/// One user's share of the cost in a range.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Share {
    /// Its share of the leases' cost.
    pub cost: Money,
    /// Frames served within the SLO.
    pub frames_within_slo: u64,
    /// Frames served late or failed.
    pub frames_late: u64,
    /// Worker time its frames took (s).
    pub busy_seconds: f64,
    /// `cost` per 1000 frames within the SLO (None without such frames).
    pub cost_per_1k_within_slo: Option<f64>,
}

/// The split of a range's cost.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Attribution {
    /// Per user.
    pub shares: BTreeMap<String, Share>,
    /// Cost of leases that served no frame in the range.
    pub idle: Money,
}

/// Splits each lease's cost (`costs`, one entry per lease) among the users
/// in `usage` (rows of lease, user and usage; a lease and user may repeat)
/// by busy time, or by frames for a lease whose usage has no busy time.
pub fn attribute(costs: &[(LeaseId, Money)], usage: &[(LeaseId, String, Usage)]) -> Attribution {
    let mut per_lease: BTreeMap<LeaseId, BTreeMap<&str, Usage>> = BTreeMap::new();
    for (lease, user, u) in usage {
        *per_lease
            .entry(*lease)
            .or_default()
            .entry(user.as_str())
            .or_default() += *u;
    }
    let mut out = Attribution::default();
    for users in per_lease.values() {
        for (user, u) in users {
            let s = out.shares.entry((*user).to_string()).or_default();
            s.frames_within_slo += u.within_slo;
            s.frames_late += u.late;
            s.busy_seconds += u.busy_us as f64 / 1e6;
        }
    }
    for (lease, cost) in costs {
        let users = per_lease.get(lease);
        let weights: Vec<(&str, u128)> = users
            .map(|users| {
                let by_busy = users.values().any(|u| u.busy_us > 0);
                users
                    .iter()
                    .map(|(user, u)| {
                        let w = if by_busy {
                            u.busy_us
                        } else {
                            u.within_slo + u.late
                        };
                        (*user, u128::from(w))
                    })
                    .filter(|(_, w)| *w > 0)
                    .collect()
            })
            .unwrap_or_default();
        if weights.is_empty() {
            out.idle += *cost;
            continue;
        }
        for (user, amount) in split(*cost, &weights) {
            out.shares.entry(user.to_string()).or_default().cost += amount;
        }
    }
    for s in out.shares.values_mut() {
        s.cost_per_1k_within_slo = crate::metrics::cost_per_1k(s.cost, s.frames_within_slo);
    }
    out
}

/// `total` split in proportion to `weights` (all > 0) in whole micro-units:
/// each gets the floor of its exact share, and the micro-units left go one
/// each to the largest remainders (ties to the earlier entry).
fn split<'a>(total: Money, weights: &[(&'a str, u128)]) -> Vec<(&'a str, Money)> {
    let sum: u128 = weights.iter().map(|(_, w)| w).sum();
    // Costs are never negative (the ledger's CHECK); a negative one would be
    // a corrupt row, charged whole to the first user rather than lost.
    let Ok(amount) = u128::try_from(total.0) else {
        return vec![(weights[0].0, total)];
    };
    let mut parts: Vec<(usize, u128, u128)> = weights
        .iter()
        .enumerate()
        .map(|(i, (_, w))| {
            let exact = amount * w;
            (i, exact / sum, exact % sum)
        })
        .collect();
    let given: u128 = parts.iter().map(|p| p.1).sum();
    let left = amount - given;
    let mut order: Vec<usize> = (0..parts.len()).collect();
    order.sort_by(|&a, &b| parts[b].2.cmp(&parts[a].2).then(a.cmp(&b)));
    for &i in order.iter().take(left as usize) {
        parts[i].1 += 1;
    }
    parts
        .into_iter()
        .map(|(i, micro, _)| (weights[i].0, Money(micro as i64)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage(busy_us: u64, within_slo: u64) -> Usage {
        Usage {
            within_slo,
            late: 0,
            busy_us,
        }
    }

    #[test]
    fn a_lease_is_split_by_busy_time_and_an_unused_one_is_idle() {
        let costs = [(LeaseId(1), Money(3_000_000)), (LeaseId(2), Money(500))];
        let rows = [
            (LeaseId(1), "cam-a".to_string(), usage(200, 10)),
            (LeaseId(1), "cam-b".to_string(), usage(150, 30)),
            (LeaseId(1), "cam-a".to_string(), usage(100, 5)),
        ];
        let a = attribute(&costs, &rows);
        assert_eq!(a.idle, Money(500));
        let (x, y) = (a.shares["cam-a"], a.shares["cam-b"]);
        assert_eq!((x.cost, y.cost), (Money(2_000_000), Money(1_000_000)));
        assert_eq!((x.frames_within_slo, y.frames_within_slo), (15, 30));
        assert!((x.busy_seconds - 300e-6).abs() < 1e-12);
        assert_eq!(x.cost_per_1k_within_slo, Some(2.0 * 1000.0 / 15.0));
    }

    #[test]
    fn usage_without_busy_time_splits_by_frames_and_users_without_cost_keep_their_frames() {
        let costs = [(LeaseId(1), Money(90))];
        let rows = [
            (LeaseId(1), "a".to_string(), usage(0, 2)),
            (LeaseId(1), "b".to_string(), usage(0, 1)),
            // served by a lease whose blocks were charged outside the range
            (LeaseId(7), "c".to_string(), usage(50, 4)),
        ];
        let a = attribute(&costs, &rows);
        assert_eq!(a.shares["a"].cost, Money(60));
        assert_eq!(a.shares["b"].cost, Money(30));
        assert_eq!(a.shares["c"].cost, Money::ZERO);
        assert_eq!(a.shares["c"].frames_within_slo, 4);
        assert_eq!(a.idle, Money::ZERO);
    }

    #[test]
    fn remainders_go_to_the_largest_fractions_and_nothing_is_lost() {
        // 100 µ¤ in thirds: 33.3 each, the one left over to the first.
        let w = [("a", 1), ("b", 1), ("c", 1)];
        let got = split(Money(100), &w);
        assert_eq!(
            got,
            vec![("a", Money(34)), ("b", Money(33)), ("c", Money(33))]
        );
        // 10 in 1:2:7 → 1, 2, 7 exactly; 11 → 1.1, 2.2, 7.7 → the .7 wins.
        let w = [("a", 1), ("b", 2), ("c", 7)];
        assert_eq!(
            split(Money(11), &w),
            vec![("a", Money(1)), ("b", Money(2)), ("c", Money(8))]
        );
    }

    proptest::proptest! {
        #[test]
        fn shares_and_idle_add_up_to_the_total(
            costs in proptest::collection::vec((0u64..6, 0i64..10_000_000_000), 0..6),
            rows in proptest::collection::vec(
                (0u64..6, 0usize..4, 0u64..1_000_000, 0u64..50, 0u64..50), 0..20),
        ) {
            let mut seen = std::collections::BTreeSet::new();
            let costs: Vec<(LeaseId, Money)> = costs
                .into_iter()
                .filter(|(l, _)| seen.insert(*l))
                .map(|(l, c)| (LeaseId(l), Money(c)))
                .collect();
            let rows: Vec<(LeaseId, String, Usage)> = rows
                .into_iter()
                .map(|(l, u, busy_us, within_slo, late)| {
                    (LeaseId(l), format!("user-{u}"), Usage { within_slo, late, busy_us })
                })
                .collect();
            let a = attribute(&costs, &rows);
            let total: Money = costs.iter().map(|c| c.1).sum();
            let shared: Money = a.shares.values().map(|s| s.cost).sum();
            proptest::prop_assert_eq!(shared + a.idle, total);
            let frames: u64 = rows.iter().map(|r| r.2.within_slo + r.2.late).sum();
            let counted: u64 = a.shares.values().map(|s| s.frames_within_slo + s.frames_late).sum();
            proptest::prop_assert_eq!(counted, frames);
            for s in a.shares.values() {
                proptest::prop_assert!(s.cost.0 >= 0);
            }
        }
    }
}
