//! Classifiers: one score per class and frame, optionally through softmax,
//! reported as the top `k` classes above `min_score`, best first.
//!
//! The protocol carries detections only, so each class becomes a
//! [`Detection`] whose box is the whole source frame, whose `score` is the
//! class probability and whose `class` indexes the model's labels.

use tidegate_protocol::{Detection, Geometry, Limits};

use super::{DecodeError, DecoderError, OutputView};
use crate::model::{ClassifySpec, ModelSpec};

/// The classify decoder of one model.
#[derive(Debug, Clone)]
pub struct ClassifyDecoder {
    output: String,
    softmax: bool,
    top_k: usize,
    min_score: f32,
    labels: Vec<String>,
}

/// Softmax of `logits`, computed stably (the largest logit is subtracted
/// first). A logit of -inf gets probability 0. NaN or +inf logits, or all
/// of them -inf, give NaN probabilities: [`ClassifyDecoder::decode`] refuses
/// those logits before calling it.
pub fn softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = logits.iter().map(|&l| (l - max).exp()).collect();
    let sum: f32 = exps.iter().sum();
    exps.into_iter().map(|e| e / sum).collect()
}

impl ClassifyDecoder {
    /// Checks the output's class count against the labels and `top_k`.
    pub fn new(spec: &ModelSpec, params: &ClassifySpec) -> Result<Self, DecoderError> {
        let shape = super::output_shape(spec, "decoder.output", &params.output)?;
        let shape_error = |expected: String| DecoderError::Shape {
            model: spec.name.clone(),
            field: "decoder.output".into(),
            output: params.output.clone(),
            shape: shape.clone(),
            expected,
        };
        if shape.len() < 2 {
            return Err(shape_error("[batch,classes]".into()));
        }
        let labels_error = || {
            shape_error(format!(
                "[batch,{}] to match the {} entries of decoder.labels",
                params.labels.len(),
                params.labels.len()
            ))
        };
        // Classes per frame, when every dimension after the batch is fixed;
        // a product too large for i64 cannot match the labels either.
        let classes: Option<i64> = if shape[1..].iter().all(|&d| d > 0) {
            Some(
                shape[1..]
                    .iter()
                    .try_fold(1i64, |acc, &d| acc.checked_mul(d))
                    .ok_or_else(labels_error)?,
            )
        } else {
            None
        };
        if classes.is_some_and(|c| usize::try_from(c).ok() != Some(params.labels.len())) {
            return Err(labels_error());
        }
        Ok(ClassifyDecoder {
            output: params.output.clone(),
            softmax: params.softmax,
            // model.toml's check refuses more; capped here all the same.
            top_k: params.top_k.min(Limits::default().max_detections),
            min_score: params.min_score,
            labels: params.labels.clone(),
        })
    }

    /// The class names, indexed by `Detection::class`.
    pub fn labels(&self) -> &[String] {
        &self.labels
    }

    /// The top classes of frame `frame`, each as a whole-frame detection.
    /// A NaN or +inf score fails the frame ([`DecodeError::NonFinite`]); so
    /// does -inf where no softmax follows, or in every class. Through
    /// softmax a -inf logit is a probability of 0.
    pub fn decode(
        &self,
        outputs: &[OutputView<'_>],
        frame: usize,
        geometry: &Geometry,
    ) -> Result<Vec<Detection>, DecodeError> {
        let view = OutputView::find(outputs, &self.output)?;
        let scores = view.frame(frame, view.per_frame())?;
        if scores.len() != self.labels.len() {
            return Err(DecodeError::Layout {
                output: self.output.clone(),
                shape: view.shape.to_vec(),
                expected: format!("{} scores per frame, one per label", self.labels.len()),
            });
        }
        let non_finite = |i: usize| DecodeError::NonFinite {
            output: self.output.clone(),
            value: scores[i],
            where_: format!(" (class {i}, {:?})", self.labels[i]),
        };
        let bad = scores.iter().position(|&v| {
            v.is_nan() || v == f32::INFINITY || (!self.softmax && v == f32::NEG_INFINITY)
        });
        if let Some(i) = bad {
            return Err(non_finite(i));
        }
        if !scores.is_empty() && scores.iter().all(|&v| v == f32::NEG_INFINITY) {
            return Err(non_finite(0));
        }
        let probs = if self.softmax {
            softmax(scores)
        } else {
            scores.to_vec()
        };
        let mut order: Vec<usize> = (0..probs.len()).collect();
        // Best first; ties keep the lower class index first.
        order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
        Ok(order
            .into_iter()
            .take(self.top_k)
            .filter(|&i| probs[i] >= self.min_score)
            .map(|i| Detection {
                x1: 0.0,
                y1: 0.0,
                x2: geometry.source_width as f32,
                y2: geometry.source_height as f32,
                score: probs[i],
                class: i as u32,
                keypoints: Vec::new(),
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::DecoderSpec;

    fn decoder(extra: &str, shape: &str) -> Result<ClassifyDecoder, String> {
        let text = format!(
            r#"
name = "cls"
version = 1
file = "cls.onnx"
max_batch = 4
[input]
name = "image"
layout = "nchw"
width = 8
height = 8
channels = 3
color = "rgb"
resize = "stretch"
model_dtype = "f32"
[[outputs]]
name = "logits"
shape = {shape}
[decoder]
kind = "classify"
output = "logits"
labels = ["cat", "dog", "fish", "bird"]
{extra}
"#
        );
        let spec = ModelSpec::from_toml(&text, std::path::Path::new("model.toml"))
            .map_err(|e| e.to_string())?;
        let DecoderSpec::Classify(c) = &spec.decoder else {
            unreachable!()
        };
        ClassifyDecoder::new(&spec, c).map_err(|e| e.to_string())
    }

    fn try_run(d: &ClassifyDecoder, logits: &[f32]) -> Result<Vec<Detection>, DecodeError> {
        let views = [OutputView {
            name: "logits",
            shape: &[1, 4],
            data: logits,
        }];
        d.decode(&views, 0, &Geometry::stretch(640, 480, 8, 8))
    }

    fn run(d: &ClassifyDecoder, logits: &[f32]) -> Vec<Detection> {
        try_run(d, logits).unwrap()
    }

    #[test]
    fn nan_or_positive_infinite_logit_fails_the_frame_naming_the_class() {
        let d = decoder("top_k = 2", "[-1, 4]").unwrap();
        for (bad, shown) in [(f32::NAN, "NaN"), (f32::INFINITY, "inf")] {
            let err = try_run(&d, &[0.0, 1.0, bad, 2.0]).unwrap_err();
            assert!(matches!(err, DecodeError::NonFinite { .. }), "{err:?}");
            let text = err.to_string();
            assert!(
                text.contains(&format!("\"logits\" holds {shown}"))
                    && text.contains("class 2, \"fish\""),
                "{text}"
            );
        }
    }

    #[test]
    fn negative_infinite_logit_is_probability_zero_through_softmax() {
        let d = decoder("top_k = 4", "[-1, 4]").unwrap();
        let got = run(&d, &[0.0, f32::NEG_INFINITY, 1.0, 0.5]);
        let p = softmax(&[0.0, 1.0, 0.5]);
        let by_class: Vec<(u32, f32)> = got.iter().map(|g| (g.class, g.score)).collect();
        assert_eq!(by_class.len(), 4, "{by_class:?}");
        assert_eq!(by_class[3], (1, 0.0));
        assert!((by_class[0].1 - p[1]).abs() < 1e-6, "{by_class:?}");
        assert!(got.iter().all(|g| g.score.is_finite()));
        // Every class at -inf has no distribution at all.
        let all = [f32::NEG_INFINITY; 4];
        assert!(matches!(
            try_run(&d, &all),
            Err(DecodeError::NonFinite { .. })
        ));
    }

    #[test]
    fn any_non_finite_score_fails_without_softmax() {
        let d = decoder("top_k = 2\nsoftmax = false", "[-1, 4]").unwrap();
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let err = try_run(&d, &[0.1, bad, 0.2, 0.3]).unwrap_err();
            assert!(
                matches!(&err, DecodeError::NonFinite { where_, .. } if where_.contains("class 1")),
                "{bad}: {err:?}"
            );
        }
    }

    #[test]
    fn class_count_whose_product_overflows_is_refused_not_wrapped() {
        // 2^32 * 2^32 = 2^64 overflows i64.
        let err = decoder("top_k = 2", "[-1, 4294967296, 4294967296]").unwrap_err();
        assert!(
            err.contains("decoder.output") && err.contains("[batch,4]"),
            "{err}"
        );
        // A product that fits but is not 4 is refused the same way.
        let err = decoder("top_k = 2", "[-1, 2, 3]").unwrap_err();
        assert!(err.contains("[batch,4]"), "{err}");
        assert!(decoder("top_k = 2", "[-1, 2, 2]").is_ok());
    }

    #[test]
    fn softmax_sums_to_one_and_survives_huge_logits() {
        let p = softmax(&[1.0, 2.0, 3.0]);
        assert!((p.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        let e = [1.0f32.exp(), 2.0f32.exp(), 3.0f32.exp()];
        let total: f32 = e.iter().sum();
        for (got, want) in p.iter().zip(e.iter().map(|x| x / total)) {
            assert!((got - want).abs() < 1e-6);
        }
        let p = softmax(&[1000.0, 0.0]);
        assert_eq!(p, vec![1.0, 0.0]);
    }

    #[test]
    fn top_k_classes_best_first_with_whole_frame_boxes() {
        let d = decoder("top_k = 2", "[-1, 4]").unwrap();
        let got = run(&d, &[0.0, 3.0, 1.0, 2.0]);
        let classes: Vec<u32> = got.iter().map(|g| g.class).collect();
        assert_eq!(classes, vec![1, 3]);
        assert_eq!(d.labels()[1], "dog");
        let p = softmax(&[0.0, 3.0, 1.0, 2.0]);
        assert!((got[0].score - p[1]).abs() < 1e-6);
        assert_eq!(
            (got[0].x1, got[0].y1, got[0].x2, got[0].y2),
            (0.0, 0.0, 640.0, 480.0)
        );
    }

    #[test]
    fn probabilities_pass_through_without_softmax_and_min_score_filters() {
        let d = decoder("top_k = 2\nsoftmax = false\nmin_score = 0.3", "[1, 4]").unwrap();
        let got = run(&d, &[0.1, 0.5, 0.25, 0.15]);
        assert_eq!(got.len(), 1);
        assert_eq!((got[0].class, got[0].score), (1, 0.5));
    }

    #[test]
    fn label_count_must_match_the_output() {
        let err = decoder("top_k = 2", "[-1, 1000]").unwrap_err();
        assert!(
            err.contains("model 'cls'")
                && err.contains("decoder.output")
                && err.contains("[batch,4]"),
            "{err}"
        );
        let err = decoder("top_k = 0", "[-1, 4]").unwrap_err();
        assert!(err.contains("decoder.top_k"), "{err}");
    }
}
