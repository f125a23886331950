//! A case of the WAN matrix run by a real `tidegate-edge`: its cameras
//! play the astronaut still through their GStreamer pipelines, encode it
//! as the case says, and send it through the case's relay. The edge adapts
//! to its link as it would in the field (quality first, then frame rate),
//! and its results file and `camera_stats` counters are read back into the
//! load generator's [`Report`], so the matrix's columns and goals hold for
//! both clients.
//!
//! The edge's frames due are those it sent or could not send for want of a
//! connection (`handed` + `dropped_outage`); frames the adaptation or a
//! rate hint held back are not due, as the load generator's throttled
//! frames are not. Every frame it sent ends once, and the edge counts how
//! (`results`, `reset_*`, `refused`, `lost`, `lost_connection`,
//! `gave_up`); `missing` is what is left over.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use serde::Serialize;
use tidegate_edge::config::Copies;
use tidegate_protocol::{Encoding, ShedReason, Status};

use super::{Case, RunOptions, WanBenchError};
use crate::cluster::Cluster;
use crate::edge_harness::{EdgeCamera, EdgeProcess, edge_config_with, epoch_us};
use crate::impair::Relay;
use crate::report::Report;

/// How long the edge has to serve its first result (pipelines built, the
/// gateway dialled through the relay, the camera opened).
const FIRST_RESULT: Duration = Duration::from_secs(60);
/// How long the edge has to stop on SIGTERM.
const STOP: Duration = Duration::from_secs(30);

/// Where the edge's cameras settled by the end of a case: their JPEG
/// quality and frame rate in force (over every camera).
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Settled {
    /// Lowest JPEG quality in force (0 for other encodings).
    pub quality_min: u8,
    /// Highest JPEG quality in force.
    pub quality_max: u8,
    /// Lowest frame-rate cap in force (fps).
    pub fps_min: f64,
    /// Highest frame-rate cap in force (fps).
    pub fps_max: f64,
    /// Mean bytes of a frame handed to QUIC over the cameras' last window.
    pub bytes_per_frame: u64,
    /// Fewest copies of each frame in force.
    pub copies_min: u8,
    /// Most copies of each frame in force.
    pub copies_max: u8,
}

/// What the edge's run left behind: its counters and results.
#[derive(Debug)]
pub(super) struct EdgeRun {
    /// The load generator's report, filled from them.
    pub report: Report,
    /// Where the cameras settled.
    pub settled: Settled,
}

/// The edge config of `case`, its cameras `cam-0`… sending through
/// `relay`.
fn cameras(case: &Case, image: &Path) -> Vec<EdgeCamera> {
    (0..case.cameras)
        .map(|i| {
            let mut cam = EdgeCamera::new(
                &format!("cam-{i}"),
                &format!("image://{}", image.display()),
                &case.model,
                case.fps,
            );
            cam.fields.push(format!("budget_ms = {}", case.budget_ms));
            match case.copies {
                // The edge's default.
                Copies::Auto => {}
                Copies::Fixed(n) => cam.fields.push(format!("copies = {n}")),
            }
            match case.encoding {
                Encoding::Jpeg { quality } => {
                    cam.fields.push("encoding = \"jpeg\"".into());
                    cam.fields.push(format!("jpeg_quality = {quality}"));
                }
                Encoding::Png => cam.fields.push("encoding = \"png\"".into()),
                Encoding::Raw => cam.fields.push("encoding = \"raw\"".into()),
            }
            cam
        })
        .collect()
}

/// Runs `case` with a real edge through `relay` for `seconds` (counted
/// from its first result), blacking the link out as the case says.
pub(super) async fn run(
    cluster: &Cluster,
    case: &Case,
    relay: &Relay,
    run: &RunOptions,
) -> Result<EdgeRun, WanBenchError> {
    let seconds = run.seconds;
    let fail = |why: String| WanBenchError::Edge {
        case: case.name.clone(),
        why,
    };
    // The cluster's edge; the cases run one after another.
    let name = "edge-1";
    let config = edge_config_with(
        cluster,
        name,
        &cameras(case, &run.image),
        relay.local_addr(),
        &[format!("congestion = \"{}\"", case.congestion)],
    )
    .map_err(|e| fail(e.to_string()))?;
    // The results file is appended to: a rerun of the case starts afresh.
    let _ = std::fs::remove_file(cluster.dir().join(format!("{name}.results.jsonl")));
    let mut edge = EdgeProcess::spawn(cluster, &config, &[]).map_err(|e| fail(e.to_string()))?;
    let until = Instant::now() + FIRST_RESULT;
    while edge.results().is_empty() {
        if Instant::now() > until {
            return Err(fail(format!(
                "no result within {FIRST_RESULT:?}; log:\n{}",
                edge.log()
            )));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let start_us = epoch_us();
    let start = Instant::now();
    if let Some((at, lasting)) = case.blackout {
        tokio::time::sleep(at).await;
        relay.blackout(lasting);
    }
    tokio::time::sleep(Duration::from_secs_f64(seconds).saturating_sub(start.elapsed())).await;
    let status =
        tokio::task::block_in_place(|| edge.terminate(STOP)).map_err(|e| fail(e.to_string()))?;
    keep_log(&format!("{}.edge", case.name), &edge.log());
    keep_log(&format!("{}.gateway", case.name), &cluster.gateway_log());
    if !status.success() {
        return Err(fail(format!("exit {status}; log:\n{}", edge.log())));
    }
    let stats = edge.camera_stats();
    if stats.len() != case.cameras {
        return Err(fail(format!(
            "{} of {} cameras printed their counters; log:\n{}",
            stats.len(),
            case.cameras,
            edge.log()
        )));
    }
    let report = report(case, seconds, start_us, &stats, &edge.results());
    Ok(EdgeRun {
        settled: settled(&stats),
        report,
    })
}

/// With `TIDEGATE_WAN_KEEP_LOGS=DIR` set, writes `log` to `DIR/<name>.log`:
/// the edge's (its adaptation's decisions window by window) and the
/// gateway's (its hints, and why) after each case. A failure to write is
/// reported and changes nothing else.
fn keep_log(name: &str, log: &str) {
    let Some(dir) = std::env::var_os("TIDEGATE_WAN_KEEP_LOGS") else {
        return;
    };
    let path = std::path::Path::new(&dir).join(format!("{name}.log"));
    if let Err(e) = std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&path, log)) {
        eprintln!("keeping the edge's log in {}: {e}", path.display());
    }
}

/// A counter of a camera's `camera_stats` (0 when absent).
fn counter(stats: &serde_json::Value, key: &str) -> u64 {
    stats[key].as_u64().unwrap_or(0)
}

/// The load generator's report of an edge's run: its counters summed over
/// cameras, its results counted by status, ok within budget and placed on
/// the timeline from `start_us` by when they reached the edge.
fn report(
    case: &Case,
    seconds: f64,
    start_us: u64,
    stats: &BTreeMap<String, serde_json::Value>,
    results: &[serde_json::Value],
) -> Report {
    let sum = |keys: &[&str]| -> u64 {
        stats
            .values()
            .map(|s| keys.iter().map(|k| counter(s, k)).sum::<u64>())
            .sum()
    };
    let mut r = Report {
        cameras: case.cameras,
        fps: case.fps,
        duration_s: seconds,
        budget_ms: case.budget_ms,
        sent: sum(&["handed"]),
        send_errors: sum(&["dropped_outage"]),
        reset: sum(&["reset_superseded", "reset_expired"]),
        refused: sum(&["refused"]),
        lost_with_connection: sum(&["lost", "lost_connection"]),
        encoding: case.encoding.to_string(),
        congestion: case.congestion.to_string(),
        copies: case.copies.asked(),
        ..Report::default()
    };
    let mut hist = Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 3).expect("bounds");
    let mut seen = HashSet::new();
    for line in results {
        let (Some(camera), Some(seq)) = (line["camera"].as_str(), line["seq"].as_u64()) else {
            continue;
        };
        if !seen.insert((camera.to_string(), seq)) {
            r.duplicates += 1;
            continue;
        }
        let status = status_of(line);
        r.count(&status);
        let e2e_ms = line["e2e_ms"].as_f64().unwrap_or(f64::INFINITY);
        if status == Status::Ok {
            let _ = hist.record((e2e_ms * 1000.0).max(1.0) as u64);
            if e2e_ms <= f64::from(case.budget_ms) {
                r.ok_within_budget += 1;
                let at_us = line["captured_at_us"].as_u64().unwrap_or(0) + (e2e_ms * 1000.0) as u64;
                r.mark_ok_at(Duration::from_micros(at_us.saturating_sub(start_us)));
            }
        }
    }
    r.finish(&hist);
    // The edge's own ledger: frames it handed that had not ended when it
    // stopped, or whose result it gave up on, are missing too.
    r.missing += sum(&["awaiting", "gave_up"]);
    let windows: Vec<u64> = stats
        .values()
        .map(|s| counter(s, "bytes_per_frame"))
        .filter(|b| *b > 0)
        .collect();
    r.bytes_per_frame = windows.iter().sum::<u64>() / windows.len().max(1) as u64;
    r
}

/// A result line's status.
fn status_of(line: &serde_json::Value) -> Status {
    let reason = line["reason"].as_str().unwrap_or_default().to_string();
    match line["status"].as_str() {
        Some("ok") => Status::Ok,
        Some("expired") => Status::Expired,
        Some("shed") => (0..=u8::MAX)
            .filter_map(ShedReason::from_code)
            .find(|r| r.label() == reason)
            .map_or_else(
                || Status::Failed(format!("shed for an unknown reason {reason:?}")),
                Status::Shed,
            ),
        _ => Status::Failed(reason),
    }
}

/// Where the cameras' quality and frame rate stood at the end.
fn settled(stats: &BTreeMap<String, serde_json::Value>) -> Settled {
    let q: Vec<u8> = stats
        .values()
        .map(|s| counter(s, "quality") as u8)
        .collect();
    let fps: Vec<f64> = stats
        .values()
        .map(|s| s["max_fps"].as_f64().unwrap_or(0.0))
        .collect();
    let bytes: Vec<u64> = stats
        .values()
        .map(|s| counter(s, "bytes_per_frame"))
        .collect();
    let copies: Vec<u8> = stats
        .values()
        .map(|s| u8::try_from(counter(s, "copies")).unwrap_or(u8::MAX))
        .collect();
    Settled {
        quality_min: q.iter().copied().min().unwrap_or(0),
        quality_max: q.iter().copied().max().unwrap_or(0),
        fps_min: fps.iter().copied().fold(f64::INFINITY, f64::min),
        fps_max: fps.iter().copied().fold(0.0, f64::max),
        bytes_per_frame: bytes.iter().sum::<u64>() / bytes.len().max(1) as u64,
        copies_min: copies.iter().copied().min().unwrap_or(0),
        copies_max: copies.iter().copied().max().unwrap_or(0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wanbench::matrix;
    use serde_json::json;

    fn stats(handed: u64, results: u64, awaiting: u64) -> serde_json::Value {
        json!({
            "camera": "cam-0", "handed": handed, "results": results,
            "reset_expired": 1, "lost_connection": 1, "awaiting": awaiting,
            "dropped_outage": 2, "quality": 60, "max_fps": 7.5, "bytes_per_frame": 4000,
            "copies": 2,
        })
    }

    #[test]
    fn an_edges_counters_and_results_become_the_load_generators_report() {
        let case = matrix()
            .into_iter()
            .find(|c| c.name.starts_with("edge-"))
            .unwrap();
        let st = BTreeMap::from([("cam-0".to_string(), stats(6, 4, 0))]);
        let start = 1_000_000;
        let line = |seq: u64, status: &str, reason: Option<&str>, e2e: f64| {
            json!({"camera": "cam-0", "seq": seq, "captured_at_us": start + seq * 100_000,
                   "e2e_ms": e2e, "status": status, "reason": reason})
        };
        let results = vec![
            line(0, "ok", None, 50.0),
            line(1, "ok", None, 500.0),
            line(2, "shed", Some("late_on_arrival"), 10.0),
            line(3, "ok", None, 40.0),
            line(3, "ok", None, 40.0),
        ];
        let r = report(&case, 30.0, start, &st, &results);
        assert_eq!(r.sent, 6);
        assert_eq!(r.ok, 3);
        assert_eq!(r.outcomes["shed:late_on_arrival"], 1);
        assert_eq!(r.duplicates, 1);
        assert_eq!(r.ok_within_budget, 2, "one ok was over the budget");
        // 6 sent = 4 results + 1 reset + 1 lost with the connection.
        assert_eq!(r.missing, 0);
        assert_eq!(r.due(), 8, "frames found no connection are due");
        assert_eq!(r.first_ok_from(Duration::ZERO), Some(Duration::ZERO));
        // A frame still awaiting when the edge stopped is missing.
        let st = BTreeMap::from([("cam-0".to_string(), stats(7, 4, 1))]);
        let r = report(&case, 30.0, start, &st, &results[..4]);
        assert_eq!(r.missing, 2, "one unexplained, one still awaiting");
        let s = settled(&st);
        assert_eq!((s.quality_min, s.fps_max), (60, 7.5));
        assert_eq!((s.copies_min, s.copies_max), (2, 2));
    }
}
