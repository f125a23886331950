//! The load-test report: counts by status, latency percentiles, and the
//! SLO verdict, serialisable as JSON.

use std::io::Write;
use std::path::Path;

use hdrhistogram::Histogram;
use serde::Serialize;
use tidegate_protocol::Status;

use crate::loadgen::LoadOptions;

/// Latency percentiles in milliseconds.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Percentiles {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 95th percentile.
    pub p95: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Maximum.
    pub max: f64,
}

impl Percentiles {
    /// The percentiles of a histogram of microseconds, in milliseconds, and
    /// its distribution: `[latency ms, fraction at or below it]` at every
    /// percentile and at 99.9 %. `None` for an empty histogram.
    pub fn of(hist: &Histogram<u64>) -> Option<(Percentiles, Vec<[f64; 2]>)> {
        if hist.is_empty() {
            return None;
        }
        let ms = |q: f64| hist.value_at_quantile(q) as f64 / 1000.0;
        let p = Percentiles {
            p50: ms(0.50),
            p90: ms(0.90),
            p95: ms(0.95),
            p99: ms(0.99),
            max: hist.max() as f64 / 1000.0,
        };
        let mut qs: Vec<f64> = (0..=100).map(|i| i as f64 / 100.0).collect();
        qs.insert(100, 0.999);
        Some((p, qs.into_iter().map(|q| [ms(q), q]).collect()))
    }
}

/// What a run measured.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Report {
    /// Simulated cameras.
    pub cameras: usize,
    /// Frames per second per camera.
    pub fps: f64,
    /// Sending time (s).
    pub duration_s: f64,
    /// Budget per frame (ms).
    pub budget_ms: u32,
    /// Frames handed to QUIC.
    pub sent: u64,
    /// Frames due while no connection could take them (the gateway was
    /// being redialled, or the stream could not open because the
    /// connection had just gone): not sent, never sent late.
    pub send_errors: u64,
    /// Results by status.
    pub ok: u64,
    /// Shed before dispatch.
    pub shed: u64,
    /// Expired in the queue.
    pub expired: u64,
    /// Failed.
    pub failed: u64,
    /// Sent frames with no result by the end of the run (the budget plus
    /// [`crate::loadgen::RESULT_GRACE`] after the last send) that were neither
    /// reset, refused nor lost with their connection: unexplained, and
    /// must stay 0. `sent` = results + `reset` + `refused` +
    /// `lost_with_connection` + `missing`.
    pub missing: u64,
    /// Sent frames without a result that the sender reset (`RESET_STREAM`):
    /// still unacknowledged at the end of their budget, or superseded by a
    /// newer frame of their camera, as a real edge's lane does.
    pub reset: u64,
    /// Sent frames without a result whose stream the gateway stopped with
    /// an error.
    pub refused: u64,
    /// Sent frames without a result whose connection died first: their
    /// results had nowhere to go.
    pub lost_with_connection: u64,
    /// Times the generator dialled the gateway again after losing it.
    pub reconnects: u64,
    /// How frames travelled (`raw`, `jpeg (quality 90)`, `png`).
    pub encoding: String,
    /// Bytes of one frame's tensor payload on the wire (the encoded file).
    pub bytes_per_frame: u64,
    /// The generator's congestion controller.
    pub congestion: String,
    /// Copies of each frame sent (and of each result asked back).
    pub copies: u8,
    /// Results ok within budget per [`Report::TIMELINE_STEP`] since the run
    /// started, by when they arrived: when serving stopped and started
    /// again (a blackout's recovery). At most [`Report::TIMELINE_MAX`]
    /// steps; later results fall in the last.
    pub ok_timeline: Vec<u32>,
    /// Ok results within the budget.
    pub ok_within_budget: u64,
    /// Fraction of the frames due ([`Report::due`]: `sent`, `send_errors`,
    /// `unsent` and `pending`, i.e. `planned` less `throttled`) answered ok
    /// within budget. A frame the generator was too slow to send, or could
    /// not finish sending, counts as not ok: a stalled generator cannot
    /// hide its own slowness (coordinated omission).
    pub slo_attainment: f64,
    /// End-to-end latency of ok results (edge clock).
    pub e2e_ms: Percentiles,
    /// Their distribution: `[latency ms, fraction at or below it]` at every
    /// percentile and at 99.9 %, for plotting (`svg.rs`).
    pub e2e_cdf_ms: Vec<[f64; 2]>,
    /// Control hints received.
    pub hints: u64,
    /// Results by status and reason (`ok`, `shed:superseded`,
    /// `failed:worker lost`, ...).
    pub outcomes: std::collections::BTreeMap<String, u64>,
    /// Results for a frame that already had one (must stay 0).
    pub duplicates: u64,
    /// Frames not sent because a hint capped the camera's rate.
    pub throttled: u64,
    /// Frames never sent because the sending time was up: the senders fell
    /// behind their frame rate (a stalled or overloaded load generator).
    /// Counted as not ok in `slo_attainment`.
    pub unsent: u64,
    /// Frames the cameras started sending that QUIC had neither taken nor
    /// refused when the run ended (flow control still held them after the
    /// result grace). Counted as not ok in `slo_attainment`.
    pub pending: u64,
    /// Frames the schedule called for: cameras × round(fps × duration)
    /// (at least one per camera). Once a run has ended, `sent` +
    /// `send_errors` + `throttled` + `unsent` + `pending` = `planned`.
    pub planned: u64,
}

impl Report {
    /// The width of one step of `ok_timeline`.
    pub const TIMELINE_STEP: std::time::Duration = std::time::Duration::from_millis(100);
    /// The most steps `ok_timeline` keeps (an hour).
    pub const TIMELINE_MAX: usize = 36_000;

    /// Places one result ok within budget on the timeline, `at` after the
    /// run started.
    pub fn mark_ok_at(&mut self, at: std::time::Duration) {
        let step = (at.as_millis() / Self::TIMELINE_STEP.as_millis()) as usize;
        let step = step.min(Self::TIMELINE_MAX - 1);
        if self.ok_timeline.len() <= step {
            self.ok_timeline.resize(step + 1, 0);
        }
        self.ok_timeline[step] += 1;
    }

    /// The first time at or after `from` (since the run started) at which
    /// a result came back ok within budget, to the timeline's step.
    pub fn first_ok_from(&self, from: std::time::Duration) -> Option<std::time::Duration> {
        let first = (from.as_millis() / Self::TIMELINE_STEP.as_millis()) as usize;
        self.ok_timeline
            .iter()
            .enumerate()
            .skip(first)
            .find(|(_, n)| **n > 0)
            .map(|(i, _)| Self::TIMELINE_STEP * i as u32)
    }

    /// An empty report for `opts`.
    pub fn new(opts: &LoadOptions) -> Self {
        Report {
            cameras: opts.cameras,
            fps: opts.fps,
            duration_s: opts.duration.as_secs_f64(),
            budget_ms: opts.budget_ms,
            planned: crate::loadgen::frames_per_camera(opts.fps, opts.duration)
                .saturating_mul(opts.cameras as u64),
            ..Report::default()
        }
    }

    /// Counts one result.
    pub fn count(&mut self, status: &Status) {
        let key = match status {
            Status::Ok | Status::Expired => status.label().to_string(),
            Status::Shed(r) => format!("shed:{}", r.label()),
            Status::Failed(reason) => format!("failed:{reason}"),
        };
        *self.outcomes.entry(key).or_default() += 1;
        match status {
            Status::Ok => self.ok += 1,
            Status::Shed(_) => self.shed += 1,
            Status::Expired => self.expired += 1,
            Status::Failed(_) => self.failed += 1,
        }
    }

    /// Results received.
    pub fn results(&self) -> u64 {
        self.ok + self.shed + self.expired + self.failed
    }

    /// Frames due: every frame the schedule called for except those a
    /// rate hint held back (`sent` + `send_errors` + `unsent` + `pending`).
    /// The denominator of `slo_attainment`.
    pub fn due(&self) -> u64 {
        self.sent + self.send_errors + self.unsent + self.pending
    }

    /// Fills the derived fields.
    pub fn finish(&mut self, hist: &Histogram<u64>) {
        self.missing = self
            .sent
            .saturating_sub(self.results() + self.reset + self.refused + self.lost_with_connection);
        let due = self.due();
        self.slo_attainment = if due == 0 {
            0.0
        } else {
            self.ok_within_budget as f64 / due as f64
        };
        if let Some((p, cdf)) = Percentiles::of(hist) {
            self.e2e_ms = p;
            self.e2e_cdf_ms = cdf;
        }
    }

    /// The SLO gate on a finished report: why it fails, one reason a line
    /// (empty: it passes). It fails when less than `min_attainment` of the
    /// frames due (sent, failed to send, never sent because the generator
    /// fell behind, or still being sent at the end) were ok within budget,
    /// and whenever a frame got two results.
    pub fn slo_failures(&self, min_attainment: f64) -> Vec<String> {
        let mut why = Vec::new();
        if self.slo_attainment < min_attainment {
            why.push(format!(
                "attainment {:.4} < {min_attainment}: {} of {} frames due ({} sent, {} send errors, {} unsent, {} pending) were ok within {} ms",
                self.slo_attainment,
                self.ok_within_budget,
                self.due(),
                self.sent,
                self.send_errors,
                self.unsent,
                self.pending,
                self.budget_ms
            ));
        }
        if self.duplicates > 0 {
            why.push(format!(
                "{} results for frames that already had one (each frame must get exactly one)",
                self.duplicates
            ));
        }
        why
    }
}

/// Writes `contents` to `path` whole or not at all: to a temporary file
/// beside it (`.<name>.<pid>.tmp`), synced, then renamed over `path`. A
/// reader never sees a half-written report, and one interrupted run leaves
/// the previous report in place. The temporary file is removed on failure.
pub fn write_atomically(path: &Path, contents: impl AsRef<[u8]>) -> std::io::Result<()> {
    let name = path.file_name().ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{} names no file", path.display()),
        )
    })?;
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(name);
    tmp_name.push(format!(".{}.tmp", std::process::id()));
    let tmp = path.with_file_name(tmp_name);
    let written = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)?;
        f.write_all(contents.as_ref())?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

#[cfg(test)]
mod tests {
    use super::*;
    use tidegate_protocol::ShedReason;

    #[test]
    fn missing_and_attainment_derive_from_counts() {
        let mut r = Report {
            sent: 10,
            ok_within_budget: 6,
            ..Report::default()
        };
        for _ in 0..7 {
            r.count(&Status::Ok);
        }
        r.count(&Status::Shed(ShedReason::Overloaded));
        let mut h = Histogram::<u64>::new(3).unwrap();
        h.record(20_000).unwrap();
        r.finish(&h);
        assert_eq!(r.missing, 2);
        assert!((r.slo_attainment - 0.6).abs() < 1e-9);
        assert!((r.e2e_ms.p50 - 20.0).abs() < 0.1);
    }

    #[test]
    fn frames_that_could_not_be_sent_count_against_attainment() {
        let mut r = Report {
            sent: 6,
            send_errors: 4,
            ok_within_budget: 6,
            ..Report::default()
        };
        r.finish(&Histogram::<u64>::new(3).unwrap());
        assert!(
            (r.slo_attainment - 0.6).abs() < 1e-9,
            "{}",
            r.slo_attainment
        );
        assert_eq!(r.slo_failures(0.6), Vec::<String>::new());
        let why = r.slo_failures(0.9);
        assert_eq!(why.len(), 1, "{why:?}");
        assert!(why[0].contains("4 send errors"), "{why:?}");
    }

    #[test]
    fn frames_the_generator_never_sent_fail_a_gate_that_sent_frames_alone_pass() {
        // A stalled generator sent half its planned frames, every one ok
        // within budget: over the frames sent alone the attainment is 1.0.
        let mut r = Report {
            sent: 50,
            unsent: 50,
            ok_within_budget: 50,
            ..Report::default()
        };
        for _ in 0..50 {
            r.count(&Status::Ok);
        }
        let mut h = Histogram::<u64>::new(3).unwrap();
        h.record(10_000).unwrap();
        r.finish(&h);
        assert!(
            (r.slo_attainment - 0.5).abs() < 1e-9,
            "{}",
            r.slo_attainment
        );
        let why = r.slo_failures(0.99);
        assert_eq!(why.len(), 1, "{why:?}");
        assert!(why[0].contains("50 unsent"), "{why:?}");
    }

    #[test]
    fn frames_still_being_sent_at_the_end_fail_a_gate_that_sent_frames_alone_pass() {
        // Flow control held 25 frames past the result grace: they were
        // neither sent nor refused. Over sent + send errors the attainment
        // would be 1.0.
        let mut r = Report {
            sent: 75,
            pending: 25,
            ok_within_budget: 75,
            ..Report::default()
        };
        for _ in 0..75 {
            r.count(&Status::Ok);
        }
        r.finish(&Histogram::<u64>::new(3).unwrap());
        assert_eq!(r.missing, 0, "a pending frame was never sent: not missing");
        assert_eq!(r.due(), 100);
        assert!(
            (r.slo_attainment - 0.75).abs() < 1e-9,
            "{}",
            r.slo_attainment
        );
        assert_eq!(r.slo_failures(0.75), Vec::<String>::new());
        let why = r.slo_failures(0.9);
        assert_eq!(why.len(), 1, "{why:?}");
        assert!(
            why[0].contains("75 of 100 frames due") && why[0].contains("25 pending"),
            "{why:?}"
        );
    }

    #[test]
    fn frames_held_back_by_a_hint_stay_out_of_attainment() {
        // 100 planned: 60 sent (all ok), 20 held back by an obeyed hint,
        // 10 never sent, 10 still being sent at the end.
        let mut r = Report {
            sent: 60,
            throttled: 20,
            unsent: 10,
            pending: 10,
            planned: 100,
            ok_within_budget: 60,
            ..Report::default()
        };
        r.finish(&Histogram::<u64>::new(3).unwrap());
        assert_eq!(
            r.sent + r.send_errors + r.throttled + r.unsent + r.pending,
            r.planned
        );
        assert_eq!(r.due(), r.planned - r.throttled);
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(
            (json["pending"].as_u64(), json["planned"].as_u64()),
            (Some(10), Some(100))
        );
        assert!(
            (r.slo_attainment - 0.75).abs() < 1e-9,
            "{}",
            r.slo_attainment
        );
    }

    #[test]
    fn a_duplicate_result_fails_the_gate_whatever_the_attainment() {
        let mut r = Report {
            sent: 10,
            ok_within_budget: 10,
            duplicates: 1,
            ..Report::default()
        };
        r.finish(&Histogram::<u64>::new(3).unwrap());
        assert!((r.slo_attainment - 1.0).abs() < 1e-9);
        let why = r.slo_failures(0.0);
        assert_eq!(why.len(), 1, "{why:?}");
        assert!(why[0].contains("exactly one"), "{why:?}");
    }

    #[test]
    fn a_report_replaces_the_old_one_whole_and_leaves_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("report.json");
        std::fs::write(&path, "old report").unwrap();
        // A reader that opened the old report before the write.
        let reader = std::fs::File::open(&path).unwrap();
        write_atomically(&path, "new report").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "new report");
        // The old file was replaced, not truncated and rewritten in place.
        assert_eq!(
            std::io::read_to_string(reader).unwrap(),
            "old report",
            "the reader sees the old report, whole"
        );
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["report.json"]);
        // A new file too.
        let fresh = dir.path().join("fresh.svg");
        write_atomically(&fresh, "<svg/>").unwrap();
        assert_eq!(std::fs::read_to_string(&fresh).unwrap(), "<svg/>");
    }

    #[test]
    fn a_failed_report_write_leaves_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        // A directory where the report should go: the rename fails.
        let path = dir.path().join("report.json");
        std::fs::create_dir(&path).unwrap();
        std::fs::write(path.join("keep"), "").unwrap();
        assert!(write_atomically(&path, "r").is_err());
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["report.json"]);
    }
}
