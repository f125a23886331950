//! Detectors that already output boxes: rows of `x1, y1, x2, y2, score,
//! class` per frame (SSD/CenterNet post-processed heads, YOLO exports with
//! NMS left to us). Rows below the score threshold are dropped, then
//! greedy NMS runs per class, best first, up to `max_detections`.
//!
//! Coordinates are relative to the model input, either in its pixels or
//! normalised to 0..1 (`coords`), and in `xyxy` or TensorFlow's `yxyx`
//! order; they are mapped to source pixels through the frame's
//! [`Geometry`] and clamped to the source frame.

use tidegate_protocol::{Detection, Geometry, Limits};

use super::{DecodeError, DecoderError, OutputView, iou};
use crate::model::{BoxCoords, BoxOrder, BoxesSpec, ModelSpec};

/// Values per row.
pub const ROW: usize = 6;

/// The boxes decoder of one model.
#[derive(Debug, Clone)]
pub struct BoxesDecoder {
    output: String,
    width: u32,
    height: u32,
    coords: BoxCoords,
    order: BoxOrder,
    score_threshold: f32,
    iou_threshold: f32,
    max_detections: usize,
    labels: Vec<String>,
}

/// One row that passed the threshold, normalised, before NMS.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Row {
    rect: [f32; 4],
    score: f32,
    class: u32,
}

impl BoxesDecoder {
    /// Checks the spec's output against what the decoder reads.
    pub fn new(spec: &ModelSpec, params: &BoxesSpec) -> Result<Self, DecoderError> {
        let shape = super::output_shape(spec, "decoder.output", &params.output)?;
        if shape.len() != 3 || !(shape[2] == ROW as i64 || shape[2] == -1) {
            return Err(DecoderError::Shape {
                model: spec.name.clone(),
                field: "decoder.output".into(),
                output: params.output.clone(),
                shape,
                expected: "[batch,rows,6] (x1,y1,x2,y2,score,class per row)".into(),
            });
        }
        Ok(BoxesDecoder {
            output: params.output.clone(),
            width: spec.input.width,
            height: spec.input.height,
            coords: params.coords,
            order: params.order,
            score_threshold: params.score_threshold,
            iou_threshold: params.iou_threshold,
            // model.toml's check refuses more; capped here all the same.
            max_detections: params.max_detections.min(Limits::default().max_detections),
            labels: params.labels.clone(),
        })
    }

    /// The class names, indexed by `Detection::class`.
    pub fn labels(&self) -> &[String] {
        &self.labels
    }

    /// Rows of frame `frame` above the threshold, normalised, in row order.
    fn rows(&self, outputs: &[OutputView<'_>], frame: usize) -> Result<Vec<Row>, DecodeError> {
        let view = OutputView::find(outputs, &self.output)?;
        let data = view.frame(frame, view.per_frame())?;
        if data.len() % ROW != 0 {
            return Err(DecodeError::Layout {
                output: self.output.clone(),
                shape: view.shape.to_vec(),
                expected: "rows of 6 values (x1,y1,x2,y2,score,class)".into(),
            });
        }
        let (sx, sy) = match self.coords {
            BoxCoords::Pixels => (1.0 / self.width as f32, 1.0 / self.height as f32),
            BoxCoords::Normalized => (1.0, 1.0),
        };
        let mut rows = Vec::new();
        for r in data.chunks_exact(ROW) {
            let score = r[4];
            // NaN and infinite scores (an fp16 overflow) are dropped too:
            // the protocol carries finite numbers only
            if !score.is_finite() || score <= self.score_threshold {
                continue;
            }
            let class = r[5];
            if !(class >= 0.0 && (class as usize) < self.labels.len()) || class.fract() != 0.0 {
                return Err(DecodeError::Class {
                    output: self.output.clone(),
                    class,
                    labels: self.labels.len(),
                });
            }
            let [x1, y1, x2, y2] = match self.order {
                BoxOrder::Xyxy => [r[0], r[1], r[2], r[3]],
                BoxOrder::Yxyx => [r[1], r[0], r[3], r[2]],
            };
            if ![x1, y1, x2, y2].iter().all(|v| v.is_finite()) {
                continue;
            }
            rows.push(Row {
                rect: [
                    x1.min(x2) * sx,
                    y1.min(y2) * sy,
                    x1.max(x2) * sx,
                    y1.max(y2) * sy,
                ],
                score,
                class: class as u32,
            });
        }
        Ok(rows)
    }

    /// Greedy NMS within each class: best first, a row is dropped when it
    /// overlaps a kept row of its class by at least the IoU threshold.
    fn nms(&self, mut rows: Vec<Row>) -> Vec<Row> {
        rows.sort_by(|a, b| b.score.total_cmp(&a.score));
        let mut kept: Vec<Row> = Vec::new();
        for r in rows {
            if kept.len() == self.max_detections {
                break;
            }
            let suppressed = kept
                .iter()
                .any(|k| k.class == r.class && iou(&k.rect, &r.rect) >= self.iou_threshold);
            if !suppressed {
                kept.push(r);
            }
        }
        kept
    }

    /// Decodes frame `frame` of a batch into detections in source pixels.
    pub fn decode(
        &self,
        outputs: &[OutputView<'_>],
        frame: usize,
        geometry: &Geometry,
    ) -> Result<Vec<Detection>, DecodeError> {
        let kept = self.nms(self.rows(outputs, frame)?);
        let to_source = |x: f32, y: f32| geometry.to_source_clamped(self.width, self.height, x, y);
        Ok(kept
            .into_iter()
            .map(|r| {
                let (x1, y1) = to_source(r.rect[0], r.rect[1]);
                let (x2, y2) = to_source(r.rect[2], r.rect[3]);
                Detection {
                    x1,
                    y1,
                    x2,
                    y2,
                    score: r.score,
                    class: r.class,
                    keypoints: Vec::new(),
                }
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::DecoderSpec;

    fn spec(coords: &str, order: &str) -> ModelSpec {
        let text = format!(
            r#"
name = "det"
version = 1
file = "det.onnx"
max_batch = 2
[input]
name = "image"
layout = "nhwc"
width = 100
height = 50
channels = 3
color = "rgb"
resize = "stretch"
model_dtype = "f32"
[[outputs]]
name = "detections"
shape = [-1, 4, 6]
[decoder]
kind = "boxes"
output = "detections"
coords = "{coords}"
order = "{order}"
score_threshold = 0.3
iou_threshold = 0.5
max_detections = 3
labels = ["person", "car"]
"#
        );
        ModelSpec::from_toml(&text, std::path::Path::new("model.toml")).unwrap()
    }

    fn decoder(coords: &str, order: &str) -> BoxesDecoder {
        let spec = spec(coords, order);
        let DecoderSpec::Boxes(b) = &spec.decoder else {
            unreachable!()
        };
        BoxesDecoder::new(&spec, b).unwrap()
    }

    fn decode(d: &BoxesDecoder, rows: &[[f32; 6]], frame: usize) -> Vec<Detection> {
        // Frame 0 is all-zero rows; frame 1 holds `rows` (padded to 4).
        let mut data = vec![0.0; 4 * ROW];
        let mut second: Vec<f32> = rows.iter().flatten().copied().collect();
        second.resize(4 * ROW, 0.0);
        data.extend(second);
        let views = [OutputView {
            name: "detections",
            shape: &[2, 4, 6],
            data: &data,
        }];
        // Source 200×100: one model pixel is two source pixels.
        d.decode(&views, frame, &Geometry::stretch(200, 100, 100, 50))
            .unwrap()
    }

    #[test]
    fn pixel_rows_map_to_source_pixels_and_weak_rows_are_dropped() {
        let d = decoder("pixels", "xyxy");
        let got = decode(
            &d,
            &[
                [10.0, 5.0, 30.0, 25.0, 0.9, 1.0],
                [0.0, 0.0, 5.0, 5.0, 0.2, 0.0],
            ],
            1,
        );
        assert_eq!(got.len(), 1, "{got:?}");
        let g = &got[0];
        let near = |a: f32, b: f32| (a - b).abs() < 1e-4;
        assert!(
            near(g.x1, 20.0) && near(g.y1, 10.0) && near(g.x2, 60.0) && near(g.y2, 50.0),
            "{g:?}"
        );
        assert_eq!((g.score, g.class), (0.9, 1));
        assert_eq!(d.labels()[g.class as usize], "car");
        assert!(decode(&d, &[], 0).is_empty(), "all-zero rows score 0");
    }

    /// A row whose score overflowed (+inf, -inf, NaN) is dropped, as a row
    /// whose box did: one such row must not make the frame's result one
    /// the protocol refuses.
    #[test]
    fn rows_with_non_finite_scores_or_boxes_are_dropped() {
        let d = decoder("pixels", "xyxy");
        let got = decode(
            &d,
            &[
                [10.0, 10.0, 20.0, 20.0, f32::INFINITY, 0.0],
                [10.0, 10.0, 20.0, 20.0, f32::NAN, 0.0],
                [10.0, 10.0, f32::INFINITY, 20.0, 0.9, 0.0],
                [30.0, 5.0, 40.0, 15.0, 0.8, 1.0],
            ],
            1,
        );
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!((got[0].score, got[0].class), (0.8, 1));
    }

    #[test]
    fn normalised_yxyx_rows_are_reordered() {
        let d = decoder("normalized", "yxyx");
        let got = decode(&d, &[[0.1, 0.2, 0.5, 0.6, 0.8, 0.0]], 1);
        let g = &got[0];
        let near = |a: f32, b: f32| (a - b).abs() < 1e-4;
        assert!(
            near(g.x1, 40.0) && near(g.y1, 10.0) && near(g.x2, 120.0) && near(g.y2, 50.0),
            "{g:?}"
        );
    }

    #[test]
    fn nms_is_per_class_best_first_and_capped() {
        let d = decoder("pixels", "xyxy");
        let got = decode(
            &d,
            &[
                [10.0, 10.0, 30.0, 30.0, 0.6, 0.0],
                // Same place, better score, same class: wins, the 0.6 goes.
                [11.0, 10.0, 31.0, 30.0, 0.9, 0.0],
                // Same place, other class: kept.
                [10.0, 10.0, 30.0, 30.0, 0.7, 1.0],
                // Elsewhere.
                [60.0, 10.0, 80.0, 30.0, 0.5, 0.0],
            ],
            1,
        );
        let scores: Vec<f32> = got.iter().map(|g| g.score).collect();
        assert_eq!(scores, vec![0.9, 0.7, 0.5]);
        let classes: Vec<u32> = got.iter().map(|g| g.class).collect();
        assert_eq!(classes, vec![0, 1, 0]);
    }

    #[test]
    fn class_outside_the_labels_is_an_error_naming_it() {
        let d = decoder("pixels", "xyxy");
        let data = [0.0, 0.0, 1.0, 1.0, 0.9, 7.0];
        let views = [OutputView {
            name: "detections",
            shape: &[1, 1, 6],
            data: &data,
        }];
        let err = d
            .decode(&views, 0, &Geometry::stretch(100, 50, 100, 50))
            .unwrap_err()
            .to_string();
        assert!(err.contains("class 7") && err.contains("2 labels"), "{err}");
    }

    #[test]
    fn output_that_is_not_rows_of_six_is_rejected_at_load() {
        let text = spec("pixels", "xyxy");
        let mut s = text.clone();
        s.outputs[0].shape = vec![-1, 4, 5];
        let DecoderSpec::Boxes(b) = &text.decoder else {
            unreachable!()
        };
        let err = BoxesDecoder::new(&s, b).unwrap_err().to_string();
        assert!(
            err.contains("model 'det'")
                && err.contains("decoder.output")
                && err.contains("[batch,rows,6]"),
            "{err}"
        );
    }
}
