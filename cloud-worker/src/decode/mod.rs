//! Decoders: from a model's raw outputs to detections in source pixels.
//!
//! A [`Decoder`] is built once per model from its [`ModelSpec`] (anchors and
//! the like are computed then) and is then applied to every frame. It sees the
//! outputs through [`OutputView`]s, plain slices, so it needs no ONNX Runtime
//! and is tested on synthetic tensors.

pub mod blazeface;

use tidegate_protocol::{Detection, Geometry};

use crate::model::{DecoderSpec, ModelSpec};

pub use blazeface::BlazefaceDecoder;

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
    /// No decoding: every frame has no detections.
    Raw,
}

impl Decoder {
    /// Builds the decoder that `spec.decoder` names.
    pub fn new(spec: &ModelSpec) -> Result<Self, DecoderError> {
        match &spec.decoder {
            DecoderSpec::Blazeface(b) => Ok(Decoder::Blazeface(BlazefaceDecoder::new(spec, b)?)),
            DecoderSpec::Raw(_) => Ok(Decoder::Raw),
        }
    }

    /// Whether [`Decoder::decode`] reads any output (the raw decoder does not).
    pub fn reads_outputs(&self) -> bool {
        !matches!(self, Decoder::Raw)
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
            Decoder::Raw => Ok(Vec::new()),
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
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
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
}
