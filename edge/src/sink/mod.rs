//! Where results go: JSON lines on stdout, appended to a file, POSTed to
//! an HTTP [`webhook`], or published to an [`mqtt`] broker. [`Sinks`] fans each result out to every one that is
//! configured; [`SinkWriter`] runs them on a thread of their own, so that
//! serialising a result and writing it to stdout or a file never blocks an
//! async worker.

pub mod mqtt;
pub mod tls;
pub mod webhook;

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use tidegate_protocol::queue;
use tidegate_protocol::{Detection, FrameResult, OutputTensor, Status, Timings};
use tokio::sync::oneshot;

/// One result as a JSON line.
#[derive(Debug, Serialize)]
pub struct ResultLine<'a> {
    /// Camera name.
    pub camera: &'a str,
    /// Frame sequence number.
    pub seq: u64,
    /// Capture time (edge clock, µs since the UNIX epoch).
    pub captured_at_us: u64,
    /// Capture to result on the edge's clock (ms).
    pub e2e_ms: f64,
    /// ok | shed | expired | failed.
    pub status: &'static str,
    /// Why it was shed or failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Detections in source pixels, each with its class name.
    pub detections: Vec<LabeledDetection<'a>>,
    /// Stage timings (µs).
    pub timings: Timings,
    /// The model's outputs, for `raw` models (absent otherwise).
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    pub outputs: &'a [OutputTensor],
}

/// A detection and the name of its class: `{"label": "person", "x1": …}`.
#[derive(Debug, Serialize)]
pub struct LabeledDetection<'a> {
    /// The class name from the model's labels (absent when the model has
    /// none, or the class is beyond them).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub label: Option<&'a str>,
    /// The detection.
    #[serde(flatten)]
    pub detection: &'a Detection,
}

impl<'a> ResultLine<'a> {
    /// The line for `r`, received at `now_us` on the edge clock; `labels`
    /// are the model's class names, from `CameraAccepted`.
    pub fn new(r: &'a FrameResult, now_us: u64, labels: &'a [String]) -> Self {
        let reason = match &r.status {
            Status::Ok | Status::Expired => None,
            Status::Shed(reason) => Some(reason.label().to_string()),
            Status::Failed(reason) => Some(reason.clone()),
        };
        ResultLine {
            camera: &r.camera,
            seq: r.seq,
            captured_at_us: r.captured_at_us,
            e2e_ms: now_us.saturating_sub(r.captured_at_us) as f64 / 1000.0,
            status: r.status.label(),
            reason,
            detections: r
                .detections
                .iter()
                .map(|d| LabeledDetection {
                    label: labels.get(d.class as usize).map(String::as_str),
                    detection: d,
                })
                .collect(),
            timings: r.timings,
            outputs: &r.outputs,
        }
    }
}

/// Opens (creating it if missing) the results file at `path` for appending.
/// A file that does not end in a newline (a write cut short, by a full disk
/// say, before the edge stopped) gets one first, so the next result starts
/// a line of its own instead of running on from the fragment.
pub fn open_results_file(path: &Path) -> std::io::Result<std::fs::File> {
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .create(true)
        .append(true)
        .open(path)?;
    if f.metadata()?.len() > 0 {
        let mut last = [0u8; 1];
        f.seek(SeekFrom::End(-1))?;
        f.read_exact(&mut last)?;
        if last[0] != b'\n' {
            // Append mode: this goes to the end whatever the position.
            f.write_all(b"\n")?;
        }
    }
    Ok(f)
}

/// Every configured sink. A result is serialised once and handed to each.
#[derive(Debug, Default)]
pub struct Sinks {
    /// JSON lines on stdout.
    pub stdout: bool,
    /// The append-only file, if any.
    pub file: Option<std::fs::File>,
    /// The webhook, if any.
    pub webhook: Option<webhook::Webhook>,
    /// The MQTT broker, if any.
    pub mqtt: Option<mqtt::Mqtt>,
}

impl Sinks {
    /// Writes one result to every sink. Writing to stdout and the file
    /// blocks: call this from [`SinkWriter`]'s thread, not from an async
    /// task. The webhook and MQTT never block: when a queue is full the result is
    /// dropped for it and counted.
    pub fn write(&mut self, line: &ResultLine<'_>) -> std::io::Result<()> {
        let text = serde_json::to_string(line).map_err(std::io::Error::other)?;
        if self.stdout {
            let mut out = std::io::stdout().lock();
            out.write_all(text.as_bytes())?;
            out.write_all(b"\n")?;
            out.flush()?;
        }
        if let Some(f) = &mut self.file {
            let mut bytes = Vec::with_capacity(text.len() + 1);
            bytes.extend_from_slice(text.as_bytes());
            bytes.push(b'\n');
            f.write_all(&bytes)?;
        }
        if let Some(m) = &self.mqtt {
            m.push(line.camera, text.clone());
        }
        if let Some(w) = &self.webhook {
            w.push(text);
        }
        Ok(())
    }

    /// Starts a thread that writes results to these sinks, in the order
    /// they are queued, from a queue of at most `results` results and
    /// `bytes` bytes of them (see [`FrameResult::held_bytes`]).
    pub fn spawn(self, results: usize, bytes: usize) -> std::io::Result<SinkWriter> {
        let (tx, mut rx) = queue::channel::<Queued>(results, bytes);
        let (done_tx, done) = oneshot::channel();
        let mut sinks = self;
        std::thread::Builder::new()
            .name("tidegate-sinks".into())
            .spawn(move || {
                let mut written = 0u64;
                let mut error = None;
                // After the writer is finished this drains what is queued.
                while let Some(q) = rx.blocking_recv() {
                    if let Err(e) =
                        sinks.write(&ResultLine::new(&q.result, q.received_at_us, &q.labels))
                    {
                        error = Some(e);
                        break;
                    }
                    written += 1;
                }
                let unwritten = rx.len() as u64;
                drop(rx);
                let _ = done_tx.send(SinkReport {
                    sinks,
                    written,
                    unwritten,
                    error,
                });
            })?;
        Ok(SinkWriter {
            tx: Some(tx),
            done,
            report: None,
        })
    }
}

/// A result waiting for the sink thread.
#[derive(Debug)]
struct Queued {
    result: FrameResult,
    received_at_us: u64,
    labels: Arc<Vec<String>>,
}

/// What the sink thread did, once it has stopped.
#[derive(Debug)]
pub struct SinkReport {
    /// The sinks, handed back (the webhook still has to be closed).
    pub sinks: Sinks,
    /// Results written to every sink.
    pub written: u64,
    /// Results still queued when a write failed, never written.
    pub unwritten: u64,
    /// The write that failed and stopped the thread, if one did.
    pub error: Option<std::io::Error>,
}

/// The sink thread stopped (a write failed): see [`SinkWriter::finish`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the result sinks have stopped after a failed write")]
pub struct SinksStopped;

/// Why [`SinkWriter::finish`] has no report.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FinishError {
    /// The thread was still writing (stdout or the file blocked) when the
    /// time ran out; what it still held is not written.
    #[error(
        "the result sinks were still writing after {0:?}; results still queued are not written"
    )]
    Timeout(Duration),
    /// The thread panicked.
    #[error("the result sink thread panicked")]
    Panicked,
}

/// [`Sinks`] running on a dedicated thread, fed by a bounded queue: results
/// are serialised and written there one at a time, in order. See
/// [`Sinks::spawn`].
#[derive(Debug)]
pub struct SinkWriter {
    tx: Option<queue::Sender<Queued>>,
    done: oneshot::Receiver<SinkReport>,
    /// The thread's report, once [`SinkWriter::stopped`] has seen it.
    report: Option<Result<SinkReport, FinishError>>,
}

impl SinkWriter {
    /// Queues a result, received at `received_at_us` on the edge clock, with
    /// the model's class names; waits while the queue is full. Fails once
    /// the thread has stopped after a failed write.
    pub async fn write(
        &self,
        result: FrameResult,
        received_at_us: u64,
        labels: Arc<Vec<String>>,
    ) -> Result<(), SinksStopped> {
        let tx = self.tx.as_ref().ok_or(SinksStopped)?;
        let size = result.held_bytes();
        tx.send(
            Queued {
                result,
                received_at_us,
                labels,
            },
            size,
        )
        .await
        .map_err(|_| SinksStopped)
    }

    /// Resolves when the thread stops by itself: a write failed (or it
    /// panicked). Pending for as long as it runs. Cancel-safe.
    pub async fn stopped(&mut self) {
        if self.report.is_none() {
            let report = (&mut self.done).await.map_err(|_| FinishError::Panicked);
            self.report = Some(report);
        }
    }

    /// Ends the queue and waits up to `timeout` for the thread to write what
    /// is queued; returns its report.
    pub async fn finish(mut self, timeout: Duration) -> Result<SinkReport, FinishError> {
        drop(self.tx.take());
        if let Some(report) = self.report.take() {
            return report;
        }
        match tokio::time::timeout(timeout, &mut self.done).await {
            Ok(Ok(report)) => Ok(report),
            Ok(Err(_)) => Err(FinishError::Panicked),
            Err(_) => Err(FinishError::Timeout(timeout)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tidegate_protocol::ShedReason;

    #[test]
    fn file_sink_appends_one_json_line_per_result() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.jsonl");
        std::fs::write(&path, "{\"earlier\":true}\n").unwrap();
        let mut sinks = Sinks {
            file: Some(
                std::fs::OpenOptions::new()
                    .append(true)
                    .open(&path)
                    .unwrap(),
            ),
            ..Sinks::default()
        };
        for seq in [1, 2] {
            sinks
                .write(&ResultLine::new(&ok_result(seq), 2_000, &[]))
                .unwrap();
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 3, "appended after what was there: {text}");
        assert_eq!(lines[2]["seq"], 2);
        assert_eq!(lines[2]["status"], "ok");
    }

    #[test]
    fn reopened_file_ending_in_a_fragment_gets_a_newline_before_new_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.jsonl");
        // A line cut short by a failed write before a restart.
        std::fs::write(&path, "{\"seq\":0}\n{\"camera\":\"do").unwrap();
        let mut sinks = Sinks {
            file: Some(open_results_file(&path).unwrap()),
            ..Sinks::default()
        };
        sinks
            .write(&ResultLine::new(&ok_result(1), 2_000, &[]))
            .unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert_eq!(lines[1], "{\"camera\":\"do", "the fragment stays alone");
        let last: serde_json::Value = serde_json::from_str(lines[2]).unwrap();
        assert_eq!(last["seq"], 1);
    }

    #[test]
    fn opening_a_whole_or_new_results_file_adds_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let whole = dir.path().join("whole.jsonl");
        std::fs::write(&whole, "{\"seq\":0}\n").unwrap();
        drop(open_results_file(&whole).unwrap());
        assert_eq!(std::fs::read_to_string(&whole).unwrap(), "{\"seq\":0}\n");
        let new = dir.path().join("new.jsonl");
        drop(open_results_file(&new).unwrap());
        assert_eq!(std::fs::read(&new).unwrap(), b"");
    }

    fn ok_result(seq: u64) -> FrameResult {
        FrameResult {
            camera: "door".into(),
            seq,
            captured_at_us: 1_000,
            status: Status::Ok,
            detections: vec![],
            timings: Timings::default(),
            outputs: vec![],
        }
    }

    #[tokio::test]
    async fn sink_thread_writes_every_result_in_order_and_drains_its_queue_on_finish() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.jsonl");
        let file = std::fs::File::create(&path).unwrap();
        // A queue with slots for a thousand results but bytes for three:
        // `write` waits for room.
        let writer = Sinks {
            file: Some(file),
            ..Sinks::default()
        }
        .spawn(1000, 3 * ok_result(0).held_bytes())
        .unwrap();
        let labels = Arc::new(vec!["person".to_string()]);
        for seq in 0..200 {
            writer
                .write(ok_result(seq), 2_000, labels.clone())
                .await
                .unwrap();
        }
        let report = writer.finish(Duration::from_secs(30)).await.unwrap();
        assert!(report.error.is_none(), "{:?}", report.error);
        assert_eq!((report.written, report.unwritten), (200, 0));
        let text = std::fs::read_to_string(&path).unwrap();
        let seqs: Vec<u64> = text
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["seq"]
                    .as_u64()
                    .unwrap()
            })
            .collect();
        assert_eq!(seqs, (0..200).collect::<Vec<_>>());
    }

    #[tokio::test]
    async fn a_failed_write_stops_the_sink_thread_and_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.jsonl");
        std::fs::write(&path, "").unwrap();
        // Opened for reading only: every write fails.
        let file = std::fs::File::open(&path).unwrap();
        let mut writer = Sinks {
            file: Some(file),
            ..Sinks::default()
        }
        .spawn(4, 1 << 20)
        .unwrap();
        writer
            .write(ok_result(1), 2_000, Arc::default())
            .await
            .unwrap();
        tokio::time::timeout(Duration::from_secs(30), writer.stopped())
            .await
            .expect("the thread stops on the failed write");
        assert_eq!(
            writer.write(ok_result(2), 2_000, Arc::default()).await,
            Err(SinksStopped)
        );
        let report = writer.finish(Duration::from_secs(30)).await.unwrap();
        assert!(report.error.is_some());
        assert_eq!(report.written, 0);
    }

    #[test]
    fn shed_result_line_names_status_reason_and_latency() {
        let r = FrameResult {
            camera: "door".into(),
            seq: 7,
            captured_at_us: 1_000,
            status: Status::Shed(ShedReason::WouldMissDeadline),
            detections: vec![],
            timings: Timings::default(),
            outputs: vec![],
        };
        let v: serde_json::Value = serde_json::to_value(ResultLine::new(&r, 13_500, &[])).unwrap();
        assert_eq!(v["status"], "shed");
        assert_eq!(v["reason"], "would_miss_deadline");
        assert_eq!(v["e2e_ms"], 12.5);
        assert_eq!(v["seq"], 7);
        assert!(v.get("outputs").is_none());
    }

    fn detection(class: u32) -> Detection {
        Detection {
            x1: 1.0,
            y1: 2.0,
            x2: 30.0,
            y2: 40.0,
            score: 0.5,
            class,
            keypoints: vec![],
        }
    }

    #[test]
    fn detections_are_named_by_the_models_labels() {
        let r = FrameResult {
            camera: "yard".into(),
            seq: 1,
            captured_at_us: 0,
            status: Status::Ok,
            detections: vec![detection(0), detection(2), detection(9)],
            timings: Timings::default(),
            outputs: vec![],
        };
        let labels = ["person".to_string(), "bicycle".into(), "car".into()];
        let v = serde_json::to_value(ResultLine::new(&r, 0, &labels)).unwrap();
        let d = &v["detections"];
        assert_eq!(d[0]["label"], "person");
        assert_eq!(d[1]["label"], "car");
        assert_eq!(d[1]["class"], 2);
        assert_eq!(d[1]["x2"], 30.0);
        // A class beyond the labels keeps its index and gets no name.
        assert!(d[2].get("label").is_none());
        assert_eq!(d[2]["class"], 9);
        // Without labels, detections look as they always did.
        let v = serde_json::to_value(ResultLine::new(&r, 0, &[])).unwrap();
        assert!(v["detections"][0].get("label").is_none());
    }

    #[test]
    fn raw_outputs_are_written_as_numbers() {
        let r = FrameResult {
            camera: "yard".into(),
            seq: 1,
            captured_at_us: 0,
            status: Status::Ok,
            detections: vec![],
            timings: Timings::default(),
            outputs: vec![
                OutputTensor::from_f32("embedding", vec![1, 3], &[0.5, -2.0, 8.0]).unwrap(),
            ],
        };
        let v = serde_json::to_value(ResultLine::new(&r, 0, &[])).unwrap();
        assert_eq!(
            v["outputs"],
            serde_json::json!([{"name": "embedding", "dtype": "f32", "shape": [1, 3], "data": [0.5, -2.0, 8.0]}])
        );
    }
}
