//! Where results go: JSON lines on stdout, appended to a file, or POSTed to
//! an HTTP [`webhook`]. [`Sinks`] fans each result out to every one that is
//! configured.

pub mod webhook;

use std::io::Write;
use std::path::Path;

use serde::Serialize;
use tidegate_protocol::{Detection, FrameResult, OutputTensor, Status, Timings};

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
            Status::Shed(reason) => Some(reason.name().to_string()),
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

/// A result sink.
#[derive(Debug)]
pub enum Sink {
    /// JSON lines on standard output.
    Stdout,
    /// JSON lines appended to a file.
    File(std::fs::File),
}

impl Sink {
    /// An append-only file sink.
    pub fn file(path: &Path) -> std::io::Result<Sink> {
        Ok(Sink::File(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)?,
        ))
    }

    /// Writes one line.
    pub fn write(&mut self, line: &ResultLine<'_>) -> std::io::Result<()> {
        let mut text = serde_json::to_string(line).map_err(std::io::Error::other)?;
        text.push('\n');
        match self {
            Sink::Stdout => {
                let mut out = std::io::stdout().lock();
                out.write_all(text.as_bytes())?;
                out.flush()
            }
            Sink::File(f) => f.write_all(text.as_bytes()),
        }
    }
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
}

impl Sinks {
    /// Writes one result to every sink. The webhook never blocks: when its
    /// queue is full the result is dropped for it and counted.
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
        if let Some(w) = &self.webhook {
            w.push(text);
        }
        Ok(())
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
            let r = FrameResult {
                camera: "door".into(),
                seq,
                captured_at_us: 1_000,
                status: Status::Ok,
                detections: vec![],
                timings: Timings::default(),
                outputs: vec![],
            };
            sinks.write(&ResultLine::new(&r, 2_000, &[])).unwrap();
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
