//! MediaPipe BlazeFace: SSD anchors, sigmoid scores and score-weighted NMS.
//!
//! Each anchor layer is a `grid`×`grid` lattice over the model input with
//! `anchors_per_cell` unit anchors at every cell centre, enumerated row by row
//! (`cy`, then `cx`, then the anchor within the cell), matching the order of
//! the graph's outputs. Per anchor the graph gives one score logit and
//! `4 + 2k` regressors in input pixels relative to the anchor centre:
//! `dx, dy, w, h`, then `(x, y)` per keypoint. Coordinates are normalised to
//! 0..1 over the model input, y down, until the last step maps them to source
//! pixels through the frame's [`Geometry`].

use tidegate_protocol::{Detection, Geometry, Limits};

use super::{DecodeError, DecoderError, OutputView};
use crate::model::{BlazefaceSpec, ModelSpec};

/// Logits beyond this magnitude are clamped before `exp` (sigmoid is 0 or 1
/// to f32 precision there), so huge or infinite logits cannot overflow.
const LOGIT_CLAMP: f32 = 80.0;

/// The BlazeFace decoder of one model, anchors precomputed.
#[derive(Debug, Clone)]
pub struct BlazefaceDecoder {
    width: u32,
    height: u32,
    score_threshold: f32,
    iou_threshold: f32,
    max_detections: usize,
    keypoints: usize,
    layers: Vec<Layer>,
    labels: Vec<String>,
}

#[derive(Debug, Clone)]
struct Layer {
    scores: String,
    boxes: String,
    /// Regressors per anchor (`4 + 2 * keypoints`).
    values: usize,
    /// Anchor centres, normalised, in output order.
    anchors: Vec<[f32; 2]>,
}

/// A detection in normalised model-input coordinates, before mapping.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    /// Sigmoid score.
    pub score: f32,
    /// `[x1, y1, x2, y2]`, normalised.
    pub rect: [f32; 4],
    /// Keypoints `(x, y)`, normalised.
    pub keypoints: Vec<[f32; 2]>,
}

/// Anchor centres of one layer, in output order: `cy`, then `cx`, then the
/// anchor within the cell. The caller bounds the count
/// ([`crate::model::AnchorLayer::anchors`]).
pub fn anchors(grid: u32, anchors_per_cell: u32) -> Vec<[f32; 2]> {
    let g = grid as f32;
    let count = (grid as usize)
        .saturating_mul(grid as usize)
        .saturating_mul(anchors_per_cell as usize);
    let mut out = Vec::with_capacity(count.min(crate::model::MAX_ANCHORS_PER_LAYER));
    for cy in 0..grid {
        for cx in 0..grid {
            for _ in 0..anchors_per_cell {
                out.push([(cx as f32 + 0.5) / g, (cy as f32 + 0.5) / g]);
            }
        }
    }
    out
}

/// The logistic function, with the logit clamped to stay finite.
pub fn sigmoid(logit: f32) -> f32 {
    let x = logit.clamp(-LOGIT_CLAMP, LOGIT_CLAMP);
    1.0 / (1.0 + (-x).exp())
}

/// Intersection over union of two `[x1, y1, x2, y2]` rectangles; 0 when the
/// union is empty.
pub fn iou(a: &[f32; 4], b: &[f32; 4]) -> f32 {
    let iw = (a[2].min(b[2]) - a[0].max(b[0])).max(0.0);
    let ih = (a[3].min(b[3]) - a[1].max(b[1])).max(0.0);
    let inter = iw * ih;
    let area = |r: &[f32; 4]| (r[2] - r[0]).max(0.0) * (r[3] - r[1]).max(0.0);
    let union = area(a) + area(b) - inter;
    if union > 0.0 { inter / union } else { 0.0 }
}

impl BlazefaceDecoder {
    /// Builds the decoder, generating every layer's anchors.
    pub fn new(spec: &ModelSpec, params: &BlazefaceSpec) -> Result<Self, DecoderError> {
        let mut layers = Vec::with_capacity(params.layers.len());
        let mut keypoints = None;
        for (i, l) in params.layers.iter().enumerate() {
            let shape_of = |field: &str, name: &str| {
                super::output_shape(spec, &format!("decoder.layers[{i}].{field}"), name)
            };
            let shape_error =
                |field: &str, name: &str, shape: Vec<i64>, expected: String| DecoderError::Shape {
                    model: spec.name.clone(),
                    field: format!("decoder.layers[{i}].{field}"),
                    output: name.to_string(),
                    shape,
                    expected,
                };
            let s = shape_of("scores", &l.scores)?;
            // Too many anchors (or an overflowing count) cannot match an
            // output: model.toml's check says so first.
            let n = l
                .anchors()
                .and_then(|n| i64::try_from(n).ok())
                .ok_or_else(|| {
                    shape_error(
                        "scores",
                        &l.scores,
                        s.clone(),
                        format!(
                            "grid² × anchors_per_cell anchors, at most {}",
                            crate::model::MAX_ANCHORS_PER_LAYER
                        ),
                    )
                })?;
            if s.len() != 3 || s[1] != n || s[2] != 1 {
                return Err(shape_error(
                    "scores",
                    &l.scores,
                    s,
                    format!("[batch,{n},1]"),
                ));
            }
            let b = shape_of("boxes", &l.boxes)?;
            if b.len() != 3 || b[1] != n || b[2] < 4 || (b[2] - 4) % 2 != 0 {
                return Err(shape_error(
                    "boxes",
                    &l.boxes,
                    b,
                    format!("[batch,{n},4+2k]"),
                ));
            }
            let k = (b[2] as usize - 4) / 2;
            // A result carries at most `max_keypoints` per detection.
            let max_k = Limits::default().max_keypoints;
            if k > max_k {
                return Err(shape_error(
                    "boxes",
                    &l.boxes,
                    b,
                    format!(
                        "[batch,{n},4+2k] with k ≤ {max_k} keypoints (the protocol's max_keypoints); \
                         this one has k = {k}"
                    ),
                ));
            }
            if *keypoints.get_or_insert(k) != k {
                return Err(shape_error(
                    "boxes",
                    &l.boxes,
                    b,
                    "the same keypoint count as the other layers".into(),
                ));
            }
            layers.push(Layer {
                scores: l.scores.clone(),
                boxes: l.boxes.clone(),
                values: b[2] as usize,
                anchors: anchors(l.grid, l.anchors_per_cell),
            });
        }
        Ok(BlazefaceDecoder {
            width: spec.input.width,
            height: spec.input.height,
            score_threshold: params.score_threshold,
            iou_threshold: params.iou_threshold,
            // model.toml's check refuses more; capped here all the same, so
            // that no result is one the gateway cannot read.
            max_detections: params.max_detections.min(Limits::default().max_detections),
            keypoints: keypoints.unwrap_or(0),
            layers,
            labels: params.labels.clone(),
        })
    }

    /// The class names (BlazeFace has one, `face`).
    pub fn labels(&self) -> &[String] {
        &self.labels
    }

    /// Anchors above the score threshold, decoded, in normalised input
    /// coordinates, in anchor order (before NMS).
    pub fn candidates(
        &self,
        outputs: &[OutputView<'_>],
        frame: usize,
    ) -> Result<Vec<Candidate>, DecodeError> {
        let (w, h) = (self.width as f32, self.height as f32);
        let mut out = Vec::new();
        for layer in &self.layers {
            let n = layer.anchors.len();
            let scores = OutputView::find(outputs, &layer.scores)?.frame(frame, n)?;
            let boxes = OutputView::find(outputs, &layer.boxes)?.frame(frame, n * layer.values)?;
            for ((&logit, r), &[ax, ay]) in scores
                .iter()
                .zip(boxes.chunks_exact(layer.values))
                .zip(&layer.anchors)
            {
                let score = sigmoid(logit);
                // NaN logits give NaN scores, dropped too.
                if score.is_nan() || score <= self.score_threshold {
                    continue;
                }
                let (cx, cy) = (ax + r[0] / w, ay + r[1] / h);
                let (bw, bh) = (r[2] / w, r[3] / h);
                let keypoints: Vec<[f32; 2]> = r[4..4 + 2 * self.keypoints]
                    .chunks_exact(2)
                    .map(|k| [ax + k[0] / w, ay + k[1] / h])
                    .collect();
                let rect = [cx - bw / 2.0, cy - bh / 2.0, cx + bw / 2.0, cy + bh / 2.0];
                // NaN or infinite regressors give no box to report (nor to
                // merge: one NaN would poison a whole NMS group).
                if !rect
                    .iter()
                    .chain(keypoints.iter().flatten())
                    .all(|v| v.is_finite())
                {
                    continue;
                }
                out.push(Candidate {
                    score,
                    rect,
                    keypoints,
                });
            }
        }
        Ok(out)
    }

    /// Score-weighted NMS, the MediaPipe way: take the best remaining
    /// candidate, merge every remaining one overlapping it by at least the IoU
    /// threshold into the score-weighted mean of their boxes and keypoints
    /// (keeping the best score), and repeat. Best first, at most
    /// `max_detections`.
    pub fn weighted_nms(&self, mut candidates: Vec<Candidate>) -> Vec<Candidate> {
        candidates.sort_by(|a, b| b.score.total_cmp(&a.score));
        let mut out = Vec::new();
        let mut remaining = candidates;
        while !remaining.is_empty() && out.len() < self.max_detections {
            let top = remaining[0].rect;
            let (mut group, mut rest) = (Vec::new(), Vec::new());
            for (i, c) in remaining.into_iter().enumerate() {
                // The best one always joins its own group, even if degenerate.
                if i == 0 || iou(&top, &c.rect) >= self.iou_threshold {
                    group.push(c);
                } else {
                    rest.push(c);
                }
            }
            remaining = rest;
            out.push(blend(&group));
        }
        out
    }

    /// Decodes frame `frame` of a batch into detections in source pixels,
    /// clamped to the source frame.
    pub fn decode(
        &self,
        outputs: &[OutputView<'_>],
        frame: usize,
        geometry: &Geometry,
    ) -> Result<Vec<Detection>, DecodeError> {
        let merged = self.weighted_nms(self.candidates(outputs, frame)?);
        let to_source = |x: f32, y: f32| {
            let (x, y) = geometry.to_source_clamped(self.width, self.height, x, y);
            [x, y]
        };
        Ok(merged
            .into_iter()
            .map(|c| {
                let [x1, y1] = to_source(c.rect[0], c.rect[1]);
                let [x2, y2] = to_source(c.rect[2], c.rect[3]);
                Detection {
                    x1,
                    y1,
                    x2,
                    y2,
                    score: c.score,
                    class: 0,
                    keypoints: c.keypoints.iter().map(|k| to_source(k[0], k[1])).collect(),
                }
            })
            .collect())
    }
}

/// The score-weighted mean of a group's boxes and keypoints, with the first
/// (best) member's score.
fn blend(group: &[Candidate]) -> Candidate {
    let best = &group[0];
    let total: f32 = group.iter().map(|c| c.score).sum();
    let mut rect = [0.0f32; 4];
    let mut keypoints = vec![[0.0f32; 2]; best.keypoints.len()];
    for c in group {
        let wgt = c.score / total;
        for (r, v) in rect.iter_mut().zip(c.rect) {
            *r += wgt * v;
        }
        for (k, v) in keypoints.iter_mut().zip(&c.keypoints) {
            k[0] += wgt * v[0];
            k[1] += wgt * v[1];
        }
    }
    Candidate {
        score: best.score,
        rect,
        keypoints,
    }
}

#[cfg(test)]
mod tests {
    use tidegate_protocol::{DType, Layout};

    use super::*;
    use crate::model::{
        AnchorLayer, ColorOrder, DecoderSpec, InputSpec, Normalize, OutputSpec, Resize,
    };

    /// A 128×128 model with one 2×2 layer of 2 anchors (8 anchors) and one
    /// keypoint (6 regressors).
    fn spec() -> (ModelSpec, BlazefaceSpec) {
        let params = BlazefaceSpec {
            score_threshold: 0.5,
            iou_threshold: 0.3,
            max_detections: 10,
            labels: vec!["face".into()],
            layers: vec![AnchorLayer {
                scores: "s".into(),
                boxes: "b".into(),
                grid: 2,
                anchors_per_cell: 2,
            }],
        };
        let spec = ModelSpec {
            name: "tiny".into(),
            version: 1,
            file: "tiny.onnx".into(),
            sha256: None,
            optional: false,
            max_batch: 2,
            cpu_max_batch: None,
            input: InputSpec {
                name: "in".into(),
                layout: Layout::Nhwc,
                width: 128,
                height: 128,
                channels: 3,
                color: ColorOrder::Rgb,
                resize: Resize::Letterbox,
                model_dtype: DType::F32,
                normalize: Normalize::default(),
            },
            outputs: vec![
                OutputSpec {
                    name: "s".into(),
                    shape: vec![-1, 8, 1],
                },
                OutputSpec {
                    name: "b".into(),
                    shape: vec![-1, 8, 6],
                },
            ],
            decoder: DecoderSpec::Blazeface(params.clone()),
            fp16: None,
        };
        (spec, params)
    }

    fn decoder() -> BlazefaceDecoder {
        let (spec, params) = spec();
        BlazefaceDecoder::new(&spec, &params).unwrap()
    }

    /// Outputs for one frame: every anchor far below threshold unless set.
    struct Frame {
        scores: Vec<f32>,
        boxes: Vec<f32>,
    }

    impl Frame {
        fn new() -> Self {
            Frame {
                scores: vec![-20.0; 8],
                boxes: vec![0.0; 8 * 6],
            }
        }

        /// Sets anchor `i`'s logit and regressors (input pixels).
        fn set(&mut self, i: usize, logit: f32, regress: [f32; 6]) -> &mut Self {
            self.scores[i] = logit;
            self.boxes[i * 6..i * 6 + 6].copy_from_slice(&regress);
            self
        }

        fn views(&self) -> [OutputView<'_>; 2] {
            [
                OutputView {
                    name: "b",
                    shape: &[1, 8, 6],
                    data: &self.boxes,
                },
                OutputView {
                    name: "s",
                    shape: &[1, 8, 1],
                    data: &self.scores,
                },
            ]
        }
    }

    fn logit(p: f32) -> f32 {
        (p / (1.0 - p)).ln()
    }

    fn close(a: f32, b: f32) -> bool {
        (a - b).abs() < 1e-4
    }

    #[test]
    fn anchors_are_cell_centres_row_major_repeated_per_cell() {
        let a = anchors(2, 2);
        assert_eq!(
            a,
            vec![
                [0.25, 0.25],
                [0.25, 0.25],
                [0.75, 0.25],
                [0.75, 0.25],
                [0.25, 0.75],
                [0.25, 0.75],
                [0.75, 0.75],
                [0.75, 0.75],
            ]
        );
        let a = anchors(16, 2);
        assert_eq!(a.len(), 512);
        // Cell (cx=5, cy=3), second anchor.
        assert_eq!(a[(3 * 16 + 5) * 2 + 1], [5.5 / 16.0, 3.5 / 16.0]);
    }

    #[test]
    fn sigmoid_is_logistic_and_finite_for_extreme_logits() {
        assert_eq!(sigmoid(0.0), 0.5);
        assert!(close(sigmoid(logit(0.92)), 0.92));
        assert_eq!(sigmoid(f32::INFINITY), 1.0);
        assert_eq!(sigmoid(1e30), 1.0);
        assert_eq!(sigmoid(f32::NEG_INFINITY), sigmoid(-LOGIT_CLAMP));
        assert!(sigmoid(-1e30).is_finite());
    }

    #[test]
    fn regressors_are_offsets_in_input_pixels_from_the_anchor() {
        let mut f = Frame::new();
        // Anchor 6 sits at (0.75, 0.75). Centre moves by (+12.8, -6.4) px,
        // size 32×16 px, keypoint at (-12.8, +12.8) px from the anchor.
        f.set(6, logit(0.9), [12.8, -6.4, 32.0, 16.0, -12.8, 12.8]);
        let c = decoder().candidates(&f.views(), 0).unwrap();
        assert_eq!(c.len(), 1);
        let c = &c[0];
        assert!(close(c.score, 0.9));
        let (cx, cy) = (0.75 + 0.1, 0.75 - 0.05);
        let want = [cx - 0.125, cy - 0.0625, cx + 0.125, cy + 0.0625];
        for (g, w) in c.rect.iter().zip(want) {
            assert!(close(*g, w), "{:?} vs {want:?}", c.rect);
        }
        assert!(close(c.keypoints[0][0], 0.65) && close(c.keypoints[0][1], 0.85));
    }

    #[test]
    fn scores_at_or_below_threshold_and_nan_are_dropped() {
        let mut f = Frame::new();
        f.set(0, 0.0, [0.0, 0.0, 10.0, 10.0, 0.0, 0.0]); // exactly 0.5
        f.set(1, f32::NAN, [0.0, 0.0, 10.0, 10.0, 0.0, 0.0]);
        f.set(2, 0.01, [0.0, 0.0, 10.0, 10.0, 0.0, 0.0]);
        let c = decoder().candidates(&f.views(), 0).unwrap();
        assert_eq!(c.len(), 1);
        assert!(c[0].score > 0.5);
    }

    #[test]
    fn candidates_with_non_finite_box_or_keypoint_are_dropped() {
        let mut f = Frame::new();
        f.set(0, logit(0.9), [f32::NAN, 0.0, 10.0, 10.0, 0.0, 0.0]);
        f.set(1, logit(0.9), [0.0, 0.0, f32::INFINITY, 10.0, 0.0, 0.0]);
        f.set(
            2,
            logit(0.9),
            [0.0, 0.0, 10.0, 10.0, 0.0, f32::NEG_INFINITY],
        );
        f.set(3, logit(0.9), [0.0, 0.0, 10.0, 10.0, f32::NAN, 0.0]);
        // Anchor 4's box overlaps anchor 5's: a NaN one merged into it
        // would make the blend NaN.
        f.set(4, logit(0.8), [0.0, 0.0, 10.0, 10.0, 0.0, 0.0]);
        f.set(5, logit(0.95), [f32::NAN; 6]);
        let d = decoder();
        let c = d.candidates(&f.views(), 0).unwrap();
        assert_eq!(c.len(), 1, "{c:?}");
        assert!(close(c[0].score, 0.8));
        let out = d
            .decode(&f.views(), 0, &Geometry::stretch(128, 128, 128, 128))
            .unwrap();
        assert_eq!(out.len(), 1);
        let o = &out[0];
        assert!(
            [o.x1, o.y1, o.x2, o.y2]
                .iter()
                .chain(o.keypoints.iter().flatten())
                .all(|v| v.is_finite()),
            "{o:?}"
        );
    }

    #[test]
    fn layer_with_more_anchors_than_supported_is_refused_without_overflow() {
        let (mut spec, mut params) = spec();
        // 65536² × 2 = 2^33 anchors: over u32 and over the bound.
        params.layers[0].grid = 65_536;
        spec.outputs[0].shape = vec![-1, 1 << 33, 1];
        spec.outputs[1].shape = vec![-1, 1 << 33, 6];
        let err = BlazefaceDecoder::new(&spec, &params)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("decoder.layers[0].scores") && err.contains("at most 1048576"),
            "{err}"
        );
    }

    #[test]
    fn overlapping_candidates_merge_into_score_weighted_mean_with_max_score() {
        let mut f = Frame::new();
        // Two anchors at the same cell: boxes 32 px wide, 8 px apart in x
        // (IoU 0.6), scores 0.9 and 0.6.
        f.set(0, logit(0.9), [0.0, 0.0, 32.0, 32.0, 0.0, 0.0]);
        f.set(1, logit(0.6), [8.0, 0.0, 32.0, 32.0, 8.0, 0.0]);
        // A far-away one stays separate.
        f.set(7, logit(0.7), [0.0, 0.0, 32.0, 32.0, 0.0, 0.0]);
        let d = decoder();
        let out = d.weighted_nms(d.candidates(&f.views(), 0).unwrap());
        assert_eq!(out.len(), 2);
        assert!(close(out[0].score, 0.9));
        // x shift = (0.6 * 8 px) / 1.5 = 3.2 px.
        let shift = 3.2 / 128.0;
        assert!(close(out[0].rect[0], 0.25 - 0.125 + shift), "{:?}", out[0]);
        assert!(close(out[0].rect[2], 0.25 + 0.125 + shift), "{:?}", out[0]);
        assert!(close(out[0].rect[1], 0.25 - 0.125));
        assert!(close(out[0].keypoints[0][0], 0.25 + shift));
        assert!(close(out[1].score, 0.7));
        assert!(close(out[1].rect[0], 0.75 - 0.125));
    }

    #[test]
    fn candidates_below_iou_threshold_are_kept_apart() {
        let mut f = Frame::new();
        // 32 px boxes 24 px apart: IoU = 8/56 ≈ 0.14 < 0.3.
        f.set(0, logit(0.9), [0.0, 0.0, 32.0, 32.0, 0.0, 0.0]);
        f.set(1, logit(0.8), [24.0, 0.0, 32.0, 32.0, 0.0, 0.0]);
        let d = decoder();
        let out = d.weighted_nms(d.candidates(&f.views(), 0).unwrap());
        assert_eq!(out.len(), 2);
        assert!(close(out[0].rect[0], 0.125) && close(out[1].rect[0], 0.125 + 24.0 / 128.0));
    }

    #[test]
    fn zero_area_candidates_do_not_stall_nms() {
        let mut f = Frame::new();
        f.set(0, logit(0.9), [0.0; 6]);
        f.set(1, logit(0.8), [0.0; 6]);
        let d = decoder();
        assert_eq!(
            d.weighted_nms(d.candidates(&f.views(), 0).unwrap()).len(),
            2
        );
    }

    #[test]
    fn at_most_max_detections_are_returned_best_first() {
        let (spec, mut params) = spec();
        params.max_detections = 2;
        let d = BlazefaceDecoder::new(&spec, &params).unwrap();
        let mut f = Frame::new();
        // Four separate cells.
        for (i, p) in [(0, 0.6), (2, 0.9), (4, 0.7), (6, 0.8)] {
            f.set(i, logit(p), [0.0, 0.0, 16.0, 16.0, 0.0, 0.0]);
        }
        let out = d.weighted_nms(d.candidates(&f.views(), 0).unwrap());
        let scores: Vec<f32> = out.iter().map(|c| c.score).collect();
        assert_eq!(scores.len(), 2);
        assert!(close(scores[0], 0.9) && close(scores[1], 0.8), "{scores:?}");
    }

    #[test]
    fn letterboxed_detection_maps_to_source_pixels() {
        let mut f = Frame::new();
        // Anchor 6 at (0.75, 0.75) → move to the input centre (-32, -32 px);
        // 32×18 input px; keypoint on the centre.
        f.set(6, logit(0.9), [-32.0, -32.0, 32.0, 18.0, -32.0, -32.0]);
        // 1920×1080 letterboxed into 128×128: content 128×72 at y = 28,
        // 15 source px per input px.
        let g = Geometry::letterbox(1920, 1080, 128, 128);
        let d = decoder().decode(&f.views(), 0, &g).unwrap();
        assert_eq!(d.len(), 1);
        let d = &d[0];
        assert!(
            close(d.x1, 960.0 - 240.0) && close(d.x2, 960.0 + 240.0),
            "{d:?}"
        );
        assert!(
            close(d.y1, 540.0 - 135.0) && close(d.y2, 540.0 + 135.0),
            "{d:?}"
        );
        assert!(close(d.keypoints[0][0], 960.0) && close(d.keypoints[0][1], 540.0));
        assert_eq!(d.class, 0);
    }

    #[test]
    fn boxes_reaching_into_letterbox_padding_are_clamped_to_the_frame() {
        let mut f = Frame::new();
        // Anchor 0 at (0.25, 0.25) = input (32, 32), inside the top padding
        // (content starts at y = 28); a 64 px box reaches above the content.
        f.set(0, logit(0.9), [0.0, 0.0, 64.0, 64.0, 0.0, -30.0]);
        let g = Geometry::letterbox(1920, 1080, 128, 128);
        let d = &decoder().decode(&f.views(), 0, &g).unwrap()[0];
        assert_eq!((d.x1, d.y1), (0.0, 0.0));
        assert!(
            close(d.x2, 64.0 * 15.0) && close(d.y2, (64.0 - 28.0) * 15.0),
            "{d:?}"
        );
        assert_eq!(d.keypoints[0], [480.0, 0.0]);
    }

    #[test]
    fn second_frame_of_a_batch_reads_its_own_slice() {
        let mut a = Frame::new();
        a.set(0, logit(0.9), [0.0, 0.0, 16.0, 16.0, 0.0, 0.0]);
        let mut b = Frame::new();
        b.set(7, logit(0.8), [0.0, 0.0, 16.0, 16.0, 0.0, 0.0]);
        let scores = [a.scores.clone(), b.scores.clone()].concat();
        let boxes = [a.boxes.clone(), b.boxes.clone()].concat();
        let views = [
            OutputView {
                name: "s",
                shape: &[2, 8, 1],
                data: &scores,
            },
            OutputView {
                name: "b",
                shape: &[2, 8, 6],
                data: &boxes,
            },
        ];
        let c = decoder().candidates(&views, 1).unwrap();
        assert_eq!(c.len(), 1);
        assert!(close(c[0].score, 0.8) && close(c[0].rect[0], 0.75 - 0.0625));
    }

    #[test]
    fn short_or_missing_output_is_an_error_naming_it() {
        let f = Frame::new();
        let views = f.views();
        let err = decoder().candidates(&views, 1).unwrap_err().to_string();
        assert!(err.contains("\"s\"") && err.contains("frame 1"), "{err}");
        let err = decoder()
            .candidates(&views[..1], 0)
            .unwrap_err()
            .to_string();
        assert!(err.contains("no output \"s\""), "{err}");
    }

    #[test]
    fn spec_whose_box_output_is_too_narrow_is_rejected() {
        let (mut spec, params) = spec();
        spec.outputs[1].shape = vec![1, 8, 3];
        let err = BlazefaceDecoder::new(&spec, &params)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("decoder.layers[0].boxes") && err.contains("[batch,8,4+2k]"),
            "{err}"
        );
    }

    #[test]
    fn iou_of_disjoint_identical_and_half_overlapping_boxes() {
        let a = [0.0, 0.0, 2.0, 2.0];
        assert_eq!(iou(&a, &[3.0, 3.0, 4.0, 4.0]), 0.0);
        assert_eq!(iou(&a, &a), 1.0);
        assert!(close(iou(&a, &[1.0, 0.0, 3.0, 2.0]), 2.0 / 6.0));
        assert_eq!(iou(&[0.0; 4], &[0.0; 4]), 0.0);
    }
}
