//! Decoders: from a model's raw outputs to detections in source pixels.
//!
//! A [`Decoder`] is built once per model from its [`ModelSpec`] (anchors and
//! the like are computed then) and is then applied to every frame. It sees the
//! outputs through [`OutputView`]s, plain slices, so it needs no ONNX Runtime
//! and is tested on synthetic tensors.

pub mod blazeface;
pub mod boxes;
pub mod classify;

use tidegate_protocol::{Detection, Geometry};

use crate::model::{DecoderSpec, ModelSpec};

pub use blazeface::{BlazefaceDecoder, iou};
pub use boxes::BoxesDecoder;
pub use classify::ClassifyDecoder;

/// One frame's slice of one output, as the raw decoder passes it on.
#[derive(Debug, Clone, PartialEq)]
pub struct RawTensor {
    /// The graph output's name.
    pub name: String,
    /// Its shape for this frame alone (the batch dimension is 1).
    pub shape: Vec<i64>,
    /// Its elements, row-major.
    pub data: Vec<f32>,
}

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
    /// No decoding: the outputs are passed on per frame as
    /// [`RawTensor`]s, with no detections.
    Raw(Vec<String>),
}

impl Decoder {
    /// Builds the decoder that `spec.decoder` names.
    pub fn new(spec: &ModelSpec) -> Result<Self, DecoderError> {
        match &spec.decoder {
            DecoderSpec::Blazeface(b) => Ok(Decoder::Blazeface(BlazefaceDecoder::new(spec, b)?)),
            DecoderSpec::Boxes(b) => Ok(Decoder::Boxes(BoxesDecoder::new(spec, b)?)),
            DecoderSpec::Classify(c) => Ok(Decoder::Classify(ClassifyDecoder::new(spec, c)?)),
            DecoderSpec::Raw(_) => Ok(Decoder::Raw(
                spec.outputs.iter().map(|o| o.name.clone()).collect(),
            )),
        }
    }

    /// Whether the decoder reads outputs; every one does (the raw decoder
    /// passes them on).
    pub fn reads_outputs(&self) -> bool {
        true
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
    /// the others.
    pub fn raw(
        &self,
        outputs: &[OutputView<'_>],
        frame: usize,
    ) -> Result<Vec<RawTensor>, DecodeError> {
        let Decoder::Raw(names) = self else {
            return Ok(Vec::new());
        };
        names
            .iter()
            .map(|name| {
                let view = OutputView::find(outputs, name)?;
                let data = view.frame(frame, view.per_frame())?;
                let mut shape = view.shape.to_vec();
                if let Some(b) = shape.first_mut() {
                    *b = 1;
                }
                Ok(RawTensor {
                    name: name.clone(),
                    shape,
                    data: data.to_vec(),
                })
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
