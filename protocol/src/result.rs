//! What becomes of a frame: its status, detections and timings.

use serde::{Deserialize, Serialize};

use crate::tensor::OutputTensor;

/// A detected object, in source-image pixels.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Detection {
    /// Left edge.
    pub x1: f32,
    /// Top edge.
    pub y1: f32,
    /// Right edge.
    pub x2: f32,
    /// Bottom edge.
    pub y2: f32,
    /// Confidence in 0..=1.
    pub score: f32,
    /// Class index into the model's labels (0 for single-class models).
    pub class: u32,
    /// Named landmarks (for BlazeFace: eyes, nose, mouth, ears), source pixels.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub keypoints: Vec<[f32; 2]>,
}

/// Why a frame was shed before reaching a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ShedReason {
    /// A newer frame of the same camera replaced it in the queue.
    Superseded,
    /// No worker could finish it before its deadline.
    WouldMissDeadline,
    /// A queue bound (per edge or global) was full.
    Overloaded,
    /// No worker serves the frame's model.
    NoWorker,
    /// The frame arrived too late to be served: its age on arrival (time
    /// waiting on the edge and on the link, from `captured_at_us` and the
    /// edge's clock offset) plus the trip back leaves nothing of its budget.
    LateOnArrival,
    /// Its edge's connection closed while it was queued (or before it
    /// arrived): its result has nowhere to go, so it is never run. Never
    /// sent to an edge; it has a code so that every end of a frame has one.
    EdgeGone,
}

impl ShedReason {
    /// Snake-case name, as in JSON and metric labels.
    pub fn label(self) -> &'static str {
        match self {
            ShedReason::Superseded => "superseded",
            ShedReason::WouldMissDeadline => "would_miss_deadline",
            ShedReason::Overloaded => "overloaded",
            ShedReason::NoWorker => "no_worker",
            ShedReason::LateOnArrival => "late_on_arrival",
            ShedReason::EdgeGone => "edge_gone",
        }
    }

    /// Wire code.
    pub fn code(self) -> u8 {
        match self {
            ShedReason::Superseded => 0,
            ShedReason::WouldMissDeadline => 1,
            ShedReason::Overloaded => 2,
            ShedReason::NoWorker => 3,
            ShedReason::LateOnArrival => 4,
            ShedReason::EdgeGone => 5,
        }
    }

    /// The reason for a wire code, if known.
    pub fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            0 => ShedReason::Superseded,
            1 => ShedReason::WouldMissDeadline,
            2 => ShedReason::Overloaded,
            3 => ShedReason::NoWorker,
            4 => ShedReason::LateOnArrival,
            5 => ShedReason::EdgeGone,
            _ => return None,
        })
    }
}

/// The one outcome every admitted frame ends in.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "status", content = "reason", rename_all = "snake_case")]
pub enum Status {
    /// Inference ran; detections are valid.
    Ok,
    /// Dropped before dispatch.
    Shed(ShedReason),
    /// Its deadline passed while it waited.
    Expired,
    /// It could not be processed; the text says why.
    Failed(String),
}

impl Status {
    /// Label used for `tidegate_frames_total{status}`.
    pub fn label(&self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Shed(_) => "shed",
            Status::Expired => "expired",
            Status::Failed(_) => "failed",
        }
    }
}

/// Where a frame's time went, in microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Timings {
    /// Waiting in the gateway's queue.
    pub queue_us: u32,
    /// Decoding an encoded frame (JPEG, PNG) into its tensor, on the
    /// worker; 0 for raw frames.
    #[serde(default)]
    pub decode_us: u32,
    /// u8 → model input transform.
    pub preprocess_us: u32,
    /// ONNX Runtime run (the batch's, shared by its frames).
    pub inference_us: u32,
    /// Decoding outputs into detections.
    pub postprocess_us: u32,
}

impl Timings {
    /// The frame's time at the gateway and its worker, µs: its stages
    /// summed (in a `u64`, so never overflowing). The rest of its end-to-end time went on the
    /// links.
    pub fn total_us(&self) -> u64 {
        [
            self.queue_us,
            self.decode_us,
            self.preprocess_us,
            self.inference_us,
            self.postprocess_us,
        ]
        .iter()
        .map(|&us| u64::from(us))
        .sum()
    }
}

/// The result for one frame, addressed by camera and sequence number.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FrameResult {
    /// Camera name, as opened by the edge.
    pub camera: String,
    /// The frame's sequence number within its camera.
    pub seq: u64,
    /// Capture time echoed from the frame (edge clock, µs).
    pub captured_at_us: u64,
    /// Outcome.
    pub status: Status,
    /// Detections (empty unless `status` is `Ok`).
    pub detections: Vec<Detection>,
    /// Time spent in each stage.
    pub timings: Timings,
    /// The model's outputs for this frame, for models with the `raw`
    /// decoder (empty otherwise).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub outputs: Vec<OutputTensor>,
}

impl FrameResult {
    /// Roughly the memory this result holds, in bytes: the struct, its
    /// strings, detections with their keypoints, and its output tensors'
    /// data. What queues of results are bounded by (see the `queue`
    /// module). An output slicing a larger received buffer holds that
    /// buffer too; whoever keeps such a result for long copies its outputs
    /// out first.
    pub fn held_bytes(&self) -> usize {
        let reason = match &self.status {
            Status::Failed(why) => why.len(),
            _ => 0,
        };
        let detections: usize = self
            .detections
            .iter()
            .map(|d| std::mem::size_of::<Detection>() + std::mem::size_of_val(&d.keypoints[..]))
            .sum();
        let outputs: usize = self
            .outputs
            .iter()
            .map(|o| {
                std::mem::size_of::<OutputTensor>()
                    + o.name.len()
                    + std::mem::size_of_val(&o.shape[..])
                    + o.data.len()
            })
            .sum();
        std::mem::size_of::<FrameResult>() + self.camera.len() + reason + detections + outputs
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::DType;

    #[test]
    fn a_results_time_at_the_servers_sums_its_stages_without_overflow() {
        let t = Timings {
            queue_us: 1,
            decode_us: 20,
            preprocess_us: 300,
            inference_us: 4_000,
            postprocess_us: 50_000,
        };
        assert_eq!(t.total_us(), 54_321);
        let max = Timings {
            queue_us: u32::MAX,
            decode_us: u32::MAX,
            preprocess_us: u32::MAX,
            inference_us: u32::MAX,
            postprocess_us: u32::MAX,
        };
        assert_eq!(max.total_us(), 5 * u64::from(u32::MAX));
    }

    #[test]
    fn held_bytes_counts_strings_detections_keypoints_and_output_data() {
        let bare = FrameResult {
            camera: String::new(),
            seq: 1,
            captured_at_us: 2,
            status: Status::Ok,
            detections: Vec::new(),
            timings: Timings::default(),
            outputs: Vec::new(),
        };
        let base = bare.held_bytes();
        assert_eq!(base, std::mem::size_of::<FrameResult>());

        let detection = Detection {
            x1: 0.0,
            y1: 0.0,
            x2: 1.0,
            y2: 1.0,
            score: 0.5,
            class: 0,
            keypoints: vec![[0.0, 0.0]; 6],
        };
        let full = FrameResult {
            camera: "door".into(),
            status: Status::Failed("no worker".into()),
            detections: vec![detection.clone(), detection],
            outputs: vec![OutputTensor {
                name: "emb".into(),
                dtype: DType::F32,
                shape: vec![1, 256],
                data: bytes::Bytes::from(vec![0u8; 1024]),
            }],
            ..bare
        };
        let detection = std::mem::size_of::<Detection>() + 6 * 8;
        let output = std::mem::size_of::<OutputTensor>() + 3 + 2 * 4 + 1024;
        assert_eq!(full.held_bytes(), base + 4 + 9 + 2 * detection + output);
    }
}
