//! The KServe run's accounting, pure: every planned frame ends in exactly
//! one bucket, and the report says which and how fast.

use std::collections::BTreeMap;
use std::time::Duration;

use hdrhistogram::Histogram;
use serde::Serialize;

use crate::report::Percentiles;

/// How one request ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// 200 with a well-formed body carrying every output asked for.
    Ok,
    /// Any other HTTP status.
    Http(u16),
    /// 200 whose body is not a well-formed answer (the reason).
    Malformed(String),
    /// No HTTP answer: the connection could not be made, broke, or the
    /// body could not be read (the reason).
    Transport(String),
    /// No answer by the frame's budget plus the grace.
    TimedOut,
    /// Every connection of the pool was busy and none could be opened: the
    /// frame was never sent (it does not wait for one).
    NoConnection,
}

impl Outcome {
    /// The bucket's name in [`KserveReport::outcomes`]: `ok`, `http:503`,
    /// `malformed`, `transport`, `timed_out`, `no_connection`.
    pub fn label(&self) -> String {
        match self {
            Outcome::Ok => "ok".into(),
            Outcome::Http(status) => format!("http:{status}"),
            Outcome::Malformed(_) => "malformed".into(),
            Outcome::Transport(_) => "transport".into(),
            Outcome::TimedOut => "timed_out".into(),
            Outcome::NoConnection => "no_connection".into(),
        }
    }
}

/// What a KServe run measured. Field names are the simulator's
/// ([`crate::report::Report`]) where they mean the same.
///
/// Every planned frame is in one bucket: `planned` is the sum of
/// `ok_within_budget`, `late`, `http_errors`, `malformed`,
/// `transport_errors`, `timed_out`, `no_connection`, `unsent` and
/// `missing` ([`KserveReport::accounted`]), and `missing` (frames whose
/// request never ended) must stay 0.
#[derive(Debug, Clone, Default, Serialize)]
pub struct KserveReport {
    /// What was measured (`triton`, `fastapi`, `tidegate-baseline`, ...).
    pub system: String,
    /// The server's base URL.
    pub url: String,
    /// The model asked for.
    pub model: String,
    /// Simulated cameras.
    pub cameras: usize,
    /// Frames per second per camera.
    pub fps: f64,
    /// Sending time (s).
    pub duration_s: f64,
    /// Budget per frame (ms), counted from when the frame was due.
    pub budget_ms: u32,
    /// How long after its budget a request is given up (ms).
    pub grace_ms: u64,
    /// Every camera's frame due in the same instant.
    pub in_step: bool,
    /// Bytes of one request body (JSON header and the raw frame).
    pub bytes_per_frame: u64,
    /// Frames the schedule called for: cameras × round(fps × duration).
    pub planned: u64,
    /// Requests sent (a connection was had for them).
    pub sent: u64,
    /// 200s with a well-formed answer, within budget or late.
    pub ok: u64,
    /// Ok within the budget.
    pub ok_within_budget: u64,
    /// Ok, but after the budget.
    pub late: u64,
    /// Answers with another HTTP status.
    pub http_errors: u64,
    /// Those answers by status.
    pub http_status: BTreeMap<u16, u64>,
    /// 200s whose body was not a well-formed answer.
    pub malformed: u64,
    /// Requests without an HTTP answer: connect, write or read failed.
    pub transport_errors: u64,
    /// Requests with no answer by the budget plus the grace.
    pub timed_out: u64,
    /// Frames never sent because every connection was busy and the pool
    /// was at `max_connections`.
    pub no_connection: u64,
    /// Frames never sent because the generator fell behind past the end of
    /// the sending time.
    pub unsent: u64,
    /// Frames whose request never ended in a bucket: must stay 0.
    pub missing: u64,
    /// Fraction of `planned` ok within budget.
    pub slo_attainment: f64,
    /// Latency of ok answers, from when the frame was due to when its
    /// answer was read and checked.
    pub e2e_ms: Percentiles,
    /// Their distribution: `[latency ms, fraction at or below it]` at every
    /// percentile and at 99.9 %.
    pub e2e_cdf_ms: Vec<[f64; 2]>,
    /// Outcomes by bucket ([`Outcome::label`]).
    pub outcomes: BTreeMap<String, u64>,
    /// The first error seen in each bucket that has a reason, for the
    /// operator (`malformed`, `transport`).
    pub first_errors: BTreeMap<String, String>,
    /// How answers were checked: against the model's metadata (`GET
    /// /v2/models/{model}`: names, types and shapes), or for the outputs'
    /// names and self-consistent sizes only, when the server gave none.
    pub checked_against_metadata: bool,
    /// The client's bound on open connections.
    pub max_connections: usize,
    /// Connections opened during the run.
    pub connections_opened: u64,
    /// The most connections open at once.
    pub peak_connections: usize,
    /// CPU time this load generator used during the run (user + system,
    /// s), from /proc/self/stat: to subtract from or report beside the
    /// server's when both share a machine.
    pub client_cpu_s: f64,
    /// Wall time of the run, from the first frame due to the last request
    /// ended (s).
    pub wall_s: f64,
}

impl KserveReport {
    /// The buckets' sum: `planned` once the run is finished.
    pub fn accounted(&self) -> u64 {
        self.ok_within_budget
            + self.late
            + self.http_errors
            + self.malformed
            + self.transport_errors
            + self.timed_out
            + self.no_connection
            + self.unsent
            + self.missing
    }

    /// The one-line summary printed on stderr.
    pub fn summary(&self) -> String {
        format!(
            "kserve {} at {}: {} planned, {} ok within {} ms ({:.2} %), {} late, {} http errors, {} malformed, {} transport errors, {} timed out, {} no connection, {} unsent, {} missing; p50 {:.1} ms, p99 {:.1} ms; client CPU {:.2} s over {:.1} s",
            self.system,
            self.url,
            self.planned,
            self.ok_within_budget,
            self.budget_ms,
            self.slo_attainment * 100.0,
            self.late,
            self.http_errors,
            self.malformed,
            self.transport_errors,
            self.timed_out,
            self.no_connection,
            self.unsent,
            self.missing,
            self.e2e_ms.p50,
            self.e2e_ms.p99,
            self.client_cpu_s,
            self.wall_s,
        )
    }
}

/// Counts outcomes into a [`KserveReport`].
#[derive(Debug)]
pub struct Tally {
    report: KserveReport,
    hist: Histogram<u64>,
    budget: Duration,
}

impl Tally {
    /// An empty tally for `report`'s run (its header fields filled in,
    /// `planned` among them).
    pub fn new(report: KserveReport) -> Self {
        Tally {
            budget: Duration::from_millis(u64::from(report.budget_ms)),
            report,
            hist: Histogram::new_with_bounds(1, 60_000_000, 3).expect("valid histogram bounds"),
        }
    }

    /// Counts one request that ended as `outcome`, `latency` after its
    /// frame was due.
    pub fn record(&mut self, outcome: Outcome, latency: Duration) {
        let r = &mut self.report;
        *r.outcomes.entry(outcome.label()).or_default() += 1;
        if outcome != Outcome::NoConnection {
            r.sent += 1;
        }
        match outcome {
            Outcome::Ok => {
                r.ok += 1;
                // Past the histogram's 60 s it counts as 60 s.
                let us = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);
                self.hist.saturating_record(us.max(1));
                if latency <= self.budget {
                    r.ok_within_budget += 1;
                } else {
                    r.late += 1;
                }
            }
            Outcome::Http(status) => {
                r.http_errors += 1;
                *r.http_status.entry(status).or_default() += 1;
            }
            Outcome::Malformed(why) => {
                r.malformed += 1;
                r.first_errors.entry("malformed".into()).or_insert(why);
            }
            Outcome::Transport(why) => {
                r.transport_errors += 1;
                r.first_errors.entry("transport".into()).or_insert(why);
            }
            Outcome::TimedOut => r.timed_out += 1,
            Outcome::NoConnection => r.no_connection += 1,
        }
    }

    /// Counts `n` frames the generator never reached.
    pub fn unsent(&mut self, n: u64) {
        self.report.unsent += n;
        if n > 0 {
            *self.report.outcomes.entry("unsent".into()).or_default() += n;
        }
    }

    /// The report: `missing` is what no bucket holds, and the attainment
    /// and percentiles derive from the counts.
    pub fn finish(mut self) -> KserveReport {
        let r = &mut self.report;
        r.missing = 0;
        r.missing = r.planned.saturating_sub(r.accounted());
        r.slo_attainment = if r.planned == 0 {
            0.0
        } else {
            r.ok_within_budget as f64 / r.planned as f64
        };
        if let Some((p, cdf)) = Percentiles::of(&self.hist) {
            r.e2e_ms = p;
            r.e2e_cdf_ms = cdf;
        }
        self.report
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn planned(n: u64) -> Tally {
        Tally::new(KserveReport {
            budget_ms: 80,
            planned: n,
            ..KserveReport::default()
        })
    }

    #[test]
    fn every_outcome_lands_in_its_own_bucket() {
        let mut t = planned(10);
        let ms = Duration::from_millis;
        t.record(Outcome::Ok, ms(10));
        t.record(Outcome::Ok, ms(80));
        t.record(Outcome::Ok, ms(81));
        t.record(Outcome::Http(500), ms(5));
        t.record(Outcome::Http(503), ms(5));
        t.record(Outcome::Malformed("no outputs".into()), ms(5));
        t.record(Outcome::Transport("connection refused".into()), ms(1));
        t.record(Outcome::TimedOut, ms(1080));
        t.record(Outcome::NoConnection, ms(0));
        t.unsent(1);
        let r = t.finish();
        assert_eq!((r.ok, r.ok_within_budget, r.late), (3, 2, 1));
        assert_eq!(r.http_errors, 2);
        assert_eq!(r.http_status, BTreeMap::from([(500, 1), (503, 1)]));
        assert_eq!(
            (
                r.malformed,
                r.transport_errors,
                r.timed_out,
                r.no_connection,
                r.unsent
            ),
            (1, 1, 1, 1, 1)
        );
        assert_eq!(r.sent, 8, "a frame without a connection was not sent");
        assert_eq!((r.accounted(), r.missing), (10, 0));
        assert_eq!(r.outcomes["http:500"], 1);
        assert_eq!(r.first_errors["malformed"], "no outputs");
        assert!((r.slo_attainment - 0.2).abs() < 1e-9);
        // Percentiles are of ok answers only, late ones included.
        assert!((r.e2e_ms.max - 81.0).abs() < 0.1, "{:?}", r.e2e_ms);
    }

    #[test]
    fn a_frame_whose_request_never_ended_is_missing() {
        let mut t = planned(3);
        t.record(Outcome::Ok, Duration::from_millis(3));
        t.record(Outcome::TimedOut, Duration::from_millis(200));
        let r = t.finish();
        assert_eq!(r.missing, 1);
        assert_eq!(r.accounted(), r.planned);
        assert!(r.summary().contains("1 missing"), "{}", r.summary());
    }

    fn any_outcome() -> impl Strategy<Value = Outcome> {
        prop_oneof![
            Just(Outcome::Ok),
            (100u16..600).prop_map(Outcome::Http),
            "[a-z]{0,8}".prop_map(Outcome::Malformed),
            "[a-z]{0,8}".prop_map(Outcome::Transport),
            Just(Outcome::TimedOut),
            Just(Outcome::NoConnection),
        ]
    }

    proptest! {
        #[test]
        fn the_buckets_always_sum_to_the_plan(
            outcomes in prop::collection::vec((any_outcome(), 0u64..200_000), 0..200),
            unsent in 0u64..50,
            unrecorded in 0u64..5,
        ) {
            let n = outcomes.len() as u64 + unsent + unrecorded;
            let mut t = planned(n);
            for (o, us) in outcomes {
                t.record(o, Duration::from_micros(us));
            }
            t.unsent(unsent);
            let r = t.finish();
            prop_assert_eq!(r.accounted(), r.planned);
            prop_assert_eq!(r.missing, unrecorded);
            prop_assert_eq!(r.outcomes.values().sum::<u64>(), n - unrecorded);
            prop_assert_eq!(r.http_status.values().sum::<u64>(), r.http_errors);
            prop_assert_eq!(r.ok, r.ok_within_budget + r.late);
            prop_assert!((0.0..=1.0).contains(&r.slo_attainment));
        }
    }
}
