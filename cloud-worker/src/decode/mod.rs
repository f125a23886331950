//! Decoders: from a model's raw outputs to detections in source pixels.
//!
//! A [`Decoder`] is built once per model from its [`ModelSpec`] (anchors and
//! the like are computed then) and is then applied to every frame. It sees the
//! outputs through [`OutputView`]s, plain slices, so it needs no ONNX Runtime
//! and is tested on synthetic tensors.

pub mod blazeface;
pub mod boxes;
pub mod classify;

use tidegate_protocol::{Detection, Geometry, Limits, OutputTensor};

use crate::model::{DecoderSpec, ModelSpec};

pub use blazeface::{BlazefaceDecoder, iou};
pub use boxes::BoxesDecoder;
pub use classify::ClassifyDecoder;

/// The declared shape of output `name`, or an error naming `field`.
pub(crate) fn output_shape(
    spec: &ModelSpec,
    field: &str,
    name: &str,
) -> Result<Vec<i64>, DecoderError> {
    spec.outputs
        .iter()
        .find(|o| o.name == name)
        .map(|o| o.shape.clone())
        .ok_or_else(|| DecoderError::UnknownOutput {
            model: spec.name.clone(),
            field: field.to_string(),
            output: name.to_string(),
        })
}

/// One output of a run: its name, its actual shape (batch first) and its f32
/// elements, row-major.
#[derive(Debug, Clone, Copy)]
pub struct OutputView<'a> {
    /// The graph output's name.
    pub name: &'a str,
    /// Its shape in this run; the first dimension is the batch.
    pub shape: &'a [i64],
    /// Its elements.
    pub data: &'a [f32],
}

impl<'a> OutputView<'a> {
    /// The output called `name` among `outputs`.
    pub fn find<'o>(
        outputs: &'o [OutputView<'a>],
        name: &str,
    ) -> Result<&'o OutputView<'a>, DecodeError> {
        outputs
            .iter()
            .find(|o| o.name == name)
            .ok_or_else(|| DecodeError::MissingOutput {
                output: name.to_string(),
            })
    }

    /// Elements per frame: all of them divided by the batch (the first
    /// dimension of the run's shape).
    pub fn per_frame(&self) -> usize {
        match self.shape.first() {
            Some(&b) if b > 0 => self.data.len() / b as usize,
            _ => 0,
        }
    }

    /// The slice of `per_frame` elements belonging to frame `frame` of the
    /// batch, or an error naming the output when it is too short.
    pub fn frame(&self, frame: usize, per_frame: usize) -> Result<&'a [f32], DecodeError> {
        let start = frame * per_frame;
        self.data
            .get(start..start + per_frame)
            .ok_or_else(|| DecodeError::ShortOutput {
                output: self.name.to_string(),
                shape: self.shape.to_vec(),
                frame,
                per_frame,
                len: self.data.len(),
            })
    }
}

/// Turns a model's outputs into detections; one per model.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Decoder {
    /// BlazeFace anchors, sigmoid and weighted NMS.
    Blazeface(BlazefaceDecoder),
    /// Rows of boxes, threshold and per-class NMS.
    Boxes(BoxesDecoder),
    /// Softmax and top-k classes.
    Classify(ClassifyDecoder),
    /// No decoding: each frame's slice of every output is passed on as an
    /// [`OutputTensor`] (batch dimension 1), with no detections.
    Raw(Vec<String>),
}

impl Decoder {
    /// Builds the decoder that `spec.decoder` names.
    pub fn new(spec: &ModelSpec) -> Result<Self, DecoderError> {
        match &spec.decoder {
            DecoderSpec::Blazeface(b) => Ok(Decoder::Blazeface(BlazefaceDecoder::new(spec, b)?)),
            DecoderSpec::Boxes(b) => Ok(Decoder::Boxes(BoxesDecoder::new(spec, b)?)),
            DecoderSpec::Classify(c) => Ok(Decoder::Classify(ClassifyDecoder::new(spec, c)?)),
            DecoderSpec::Raw(_) => {
                check_raw_size(spec, &Limits::default())?;
                Ok(Decoder::Raw(
                    spec.outputs.iter().map(|o| o.name.clone()).collect(),
                ))
            }
        }
    }

    /// Class names, indexed by `Detection::class` (empty for raw).
    pub fn labels(&self) -> &[String] {
        match self {
            Decoder::Blazeface(d) => d.labels(),
            Decoder::Boxes(d) => d.labels(),
            Decoder::Classify(d) => d.labels(),
            Decoder::Raw(_) => &[],
        }
    }

    /// Frame `frame`'s slice of every output, for the raw decoder; empty for
    /// the others. Fails when together they exceed what one result may carry
    /// (`Limits::max_output_bytes`).
    pub fn raw(
        &self,
        outputs: &[OutputView<'_>],
        frame: usize,
    ) -> Result<Vec<OutputTensor>, DecodeError> {
        let Decoder::Raw(names) = self else {
            return Ok(Vec::new());
        };
        let max = Limits::default().max_output_bytes;
        let mut bytes = 0usize;
        names
            .iter()
            .map(|name| {
                let view = OutputView::find(outputs, name)?;
                let data = view.frame(frame, view.per_frame())?;
                bytes = bytes.saturating_add(data.len() * 4);
                if bytes > max {
                    return Err(DecodeError::OutputsTooLarge { bytes, max });
                }
                let layout = || DecodeError::Layout {
                    output: name.clone(),
                    shape: view.shape.to_vec(),
                    expected: "a batch-first shape of u32 dimensions".into(),
                };
                let shape = std::iter::once(Ok(1))
                    .chain(view.shape.iter().skip(1).map(|&d| u32::try_from(d)))
                    .collect::<Result<Vec<u32>, _>>()
                    .map_err(|_| layout())?;
                OutputTensor::from_f32(name.clone(), shape, data).ok_or_else(layout)
            })
            .collect()
    }

    /// Decodes frame `frame` of a batch. `outputs` are found by name, in any
    /// order; `geometry` maps model-input coordinates to the frame's source
    /// pixels.
    pub fn decode(
        &self,
        outputs: &[OutputView<'_>],
        frame: usize,
        geometry: &Geometry,
    ) -> Result<Vec<Detection>, DecodeError> {
        match self {
            Decoder::Blazeface(d) => d.decode(outputs, frame, geometry),
            Decoder::Boxes(d) => d.decode(outputs, frame, geometry),
            Decoder::Classify(d) => d.decode(outputs, frame, geometry),
            Decoder::Raw(_) => Ok(Vec::new()),
        }
    }
}

/// Refuses, at start-up, a raw model whose declared outputs cannot travel
/// in a result: more than `max_output_bytes` per frame, or a full batch
/// over `max_tensor_bytes`. Dynamic dimensions (-1) are checked per frame
/// at run time instead.
fn check_raw_size(spec: &ModelSpec, limits: &Limits) -> Result<(), DecoderError> {
    let mut per_frame = 0usize;
    for o in &spec.outputs {
        let dims = o.shape.iter().skip(1);
        if dims.clone().any(|&d| d < 0) {
            return Ok(());
        }
        let bytes = dims.fold(4usize, |acc, &d| acc.saturating_mul(d as usize));
        per_frame = per_frame.saturating_add(bytes);
    }
    let batch = per_frame.saturating_mul(spec.max_batch.max(1) as usize);
    if per_frame > limits.max_output_bytes || batch > limits.max_tensor_bytes {
        return Err(DecoderError::RawTooLarge {
            model: spec.name.clone(),
            per_frame,
            max_batch: spec.max_batch as usize,
            max_frame: limits.max_output_bytes,
            max_batch_bytes: limits.max_tensor_bytes,
        });
    }
    Ok(())
}

/// Why a decoder could not be built from a spec.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecoderError {
    /// The decoder refers to an output the spec does not list.
    #[error(
        "model '{model}': {field} names output {output:?}, which is not in [[outputs]]; list it there or fix the name"
    )]
    UnknownOutput {
        /// The model's name.
        model: String,
        /// The referring field.
        field: String,
        /// The missing output's name.
        output: String,
    },
    /// An output's declared shape does not fit what the decoder reads.
    #[error("model '{model}': output {output:?} has shape {shape:?}, but {field} needs {expected}")]
    Shape {
        /// The model's name.
        model: String,
        /// The decoder field that reads it.
        field: String,
        /// The output's name.
        output: String,
        /// Its declared shape.
        shape: Vec<i64>,
        /// What the decoder needs, e.g. `[batch,512,1]`.
        expected: String,
    },
    /// A raw model's outputs are too large to return in results.
    #[error(
        "model '{model}': the raw decoder's outputs take {per_frame} bytes per frame, {max_batch} frames per batch; a result carries at most {max_frame} bytes per frame and {max_batch_bytes} per batch. Return fewer or smaller outputs, or lower max_batch"
    )]
    RawTooLarge {
        /// The model's name.
        model: String,
        /// Declared output bytes per frame.
        per_frame: usize,
        /// The model's max_batch.
        max_batch: usize,
        /// `Limits::max_output_bytes`.
        max_frame: usize,
        /// `Limits::max_tensor_bytes`.
        max_batch_bytes: usize,
    },
}

/// Why a frame's outputs could not be decoded.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// An output the decoder reads was not produced by the run.
    #[error("the run produced no output {output:?}; model.toml and the graph disagree")]
    MissingOutput {
        /// The output's name.
        output: String,
    },
    /// An output holds fewer elements than the decoder needs for this frame.
    #[error(
        "output {output:?} of shape {shape:?} has {len} elements, too few for frame {frame} at {per_frame} per frame; model.toml and the graph disagree"
    )]
    ShortOutput {
        /// The output's name.
        output: String,
        /// Its shape in the run.
        shape: Vec<i64>,
        /// The frame's index in the batch.
        frame: usize,
        /// Elements per frame the decoder expects.
        per_frame: usize,
        /// Elements present.
        len: usize,
    },
    /// An output's elements do not divide into what the decoder reads.
    #[error(
        "output {output:?} of shape {shape:?} does not hold {expected}; model.toml and the graph disagree"
    )]
    Layout {
        /// The output's name.
        output: String,
        /// Its shape in the run.
        shape: Vec<i64>,
        /// What the decoder needs.
        expected: String,
    },
    /// A raw frame's outputs exceed what one result may carry.
    #[error(
        "the frame's raw outputs take {bytes} bytes or more; a result carries at most {max} (Limits::max_output_bytes)"
    )]
    OutputsTooLarge {
        /// Bytes counted when the limit was passed.
        bytes: usize,
        /// The limit.
        max: usize,
    },
    /// An output holds NaN or infinity where the decoder needs a number.
    #[error(
        "output {output:?} holds {value} for this frame{where_}; the model produced no usable number (check its input normalisation in model.toml, or the graph)"
    )]
    NonFinite {
        /// The output's name.
        output: String,
        /// The offending value (NaN or ±infinity).
        value: f32,
        /// Where in the frame's slice, e.g. ` (class 2)`; may be empty.
        where_: String,
    },
    /// A box row names a class the model's labels do not have.
    #[error(
        "output {output:?} has a row of class {class}, but decoder.labels has {labels} labels; list every class the model emits"
    )]
    Class {
        /// The output's name.
        output: String,
        /// The class value in the row.
        class: f32,
        /// How many labels there are.
        labels: usize,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A raw model with one output of `shape` and `max_batch`.
    fn raw(shape: &str, max_batch: u16) -> Result<Decoder, String> {
        let text = format!(
            r#"
name = "emb"
version = 1
file = "model.onnx"
max_batch = {max_batch}
[input]
name = "x"
layout = "nhwc"
width = 8
height = 8
channels = 3
color = "rgb"
resize = "stretch"
model_dtype = "f32"
[[outputs]]
name = "embedding"
shape = {shape}
[decoder]
kind = "raw"
"#
        );
        let spec = ModelSpec::from_toml(&text, std::path::Path::new("model.toml"))
            .map_err(|e| e.to_string())?;
        Decoder::new(&spec).map_err(|e| e.to_string())
    }

    #[test]
    fn raw_outputs_too_large_for_a_result_are_refused_at_start_up() {
        // 512 floats per frame, 32 frames: 64 KiB a batch, fine.
        assert!(raw("[-1, 512]", 32).is_ok());
        // 2M floats = 8 MiB per frame: over max_output_bytes.
        let err = raw("[-1, 2048, 1024]", 1).unwrap_err();
        assert!(
            err.contains("model 'emb'")
                && err.contains("8388608 bytes per frame")
                && err.contains("at most 4194304 bytes per frame"),
            "{err}"
        );
        // 4 MiB per frame fits one result, but 32 of them overflow a batch.
        let err = raw("[-1, 1024, 1024]", 32).unwrap_err();
        assert!(err.contains("lower max_batch"), "{err}");
        assert!(raw("[-1, 1024, 1024]", 16).is_ok());
        // Dynamic dimensions are left to the per-frame check.
        assert!(raw("[-1, -1, 1024]", 32).is_ok());
    }

    #[test]
    fn raw_slices_each_frame_and_fails_a_frame_over_the_limit() {
        let d = raw("[-1, -1]", 4).unwrap();
        let data: Vec<f32> = (0..6).map(|i| i as f32).collect();
        let views = [OutputView {
            name: "embedding",
            shape: &[2, 3],
            data: &data,
        }];
        let frame1 = d.raw(&views, 1).unwrap();
        assert_eq!(frame1.len(), 1);
        assert_eq!(frame1[0].name, "embedding");
        assert_eq!(frame1[0].shape, vec![1, 3]);
        assert_eq!(frame1[0].values(), vec![3.0, 4.0, 5.0]);

        // A run whose dynamic dimension makes one frame 4 MiB + 4 bytes.
        let n = Limits::default().max_output_bytes / 4 + 1;
        let big = vec![0.5f32; n];
        let shape = [1, n as i64];
        let views = [OutputView {
            name: "embedding",
            shape: &shape,
            data: &big,
        }];
        let err = d.raw(&views, 0).unwrap_err();
        assert!(
            matches!(err, DecodeError::OutputsTooLarge { .. }),
            "{err:?}"
        );
        assert!(err.to_string().contains("at most 4194304"), "{err}");
    }
}
