//! The model repository: a folder of models, one subfolder each, every one
//! described by a `model.toml` next to its `.onnx` file.
//!
//! [`Repository::load`] parses and checks what can be checked without ONNX
//! Runtime: the TOML against [`ModelSpec`] (unknown fields are errors), the
//! internal consistency of the spec, that the model file exists, and its
//! sha256 when one is pinned. Checking the spec against the ONNX graph itself
//! (input and output names, fixed dimensions) happens when the backend opens
//! the session ([`crate::backend::OrtBackend::open`]).

use std::collections::HashSet;
use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use sha2::{Digest, Sha256};
use tidegate_protocol::{DType, Layout, Limits};

/// The file name that marks a folder as a model.
pub const SPEC_FILE: &str = "model.toml";

/// One model as described by its `model.toml`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// The model's name; equal to its folder's name. Frames address it by this.
    pub name: String,
    /// Version of the model, bumped when the file changes.
    pub version: u32,
    /// The ONNX file, relative to the model's folder.
    pub file: PathBuf,
    /// Lower-case hex sha256 of `file`; checked at load when present.
    #[serde(default)]
    pub sha256: Option<String>,
    /// An opt-in model, one that `make setup` does not fetch (none of the
    /// shipped ones is): when its file is missing, loading the whole
    /// repository skips it with a warning rather than failing. Named in
    /// `only`, it must be there.
    #[serde(default)]
    pub optional: bool,
    /// Most frames one inference run may carry (1 when the graph's batch
    /// dimension is fixed at 1).
    pub max_batch: u16,
    /// A lower cap for workers on the CPU provider, where a heavy model
    /// gains nothing from batching and profiling every batch size up to
    /// `max_batch` would slow start-up (unset: `max_batch`).
    #[serde(default)]
    pub cpu_max_batch: Option<u16>,
    /// The image input.
    pub input: InputSpec,
    /// The outputs the decoder reads, in the order it reads them.
    pub outputs: Vec<OutputSpec>,
    /// How outputs become detections.
    pub decoder: DecoderSpec,
    /// The half-precision variant `runtime.precision = "fp16"` serves, if
    /// the model has one: the same graph with FP16 weights and
    /// activations, its inputs and outputs still FP32 (so preprocessing
    /// and the decoder are the same), built by models/fetch.sh.
    #[serde(default)]
    pub fp16: Option<VariantSpec>,
}

/// Another file of the same model (`[fp16]` in model.toml).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VariantSpec {
    /// The ONNX file, relative to the model's folder.
    pub file: PathBuf,
    /// Lower-case hex sha256 of `file`; checked when it is opened.
    pub sha256: String,
}

/// Which of a model's files a worker serves (`runtime.precision`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Precision {
    /// The model's own file (FP32).
    #[default]
    Fp32,
    /// The model's `[fp16]` variant where it has one; FP32 where not.
    Fp16,
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Precision::Fp32 => "fp32",
            Precision::Fp16 => "fp16",
        })
    }
}

/// The model's image input. Frames always arrive as u8 RGB; this says what the
/// graph wants and how the edge fits the source frame into it.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InputSpec {
    /// Name of the graph input.
    pub name: String,
    /// Memory layout of the graph input.
    pub layout: Layout,
    /// Input width in pixels.
    pub width: u32,
    /// Input height in pixels.
    pub height: u32,
    /// Channels per pixel; only 3 is supported.
    pub channels: u32,
    /// Channel order the graph wants.
    pub color: ColorOrder,
    /// How the edge fits the source frame into `width`×`height`.
    pub resize: Resize,
    /// Element type of the graph input.
    pub model_dtype: DType,
    /// Per-channel transform from pixel to model value (f32 models only).
    #[serde(default)]
    pub normalize: Normalize,
}

impl InputSpec {
    /// Shape of a batch of `batch` inputs in the model's layout.
    pub fn model_shape(&self, batch: u32) -> [u32; 4] {
        match self.layout {
            Layout::Nhwc => [batch, self.height, self.width, self.channels],
            Layout::Nchw => [batch, self.channels, self.height, self.width],
        }
    }

    /// Shape a single frame of the given layout must have.
    pub fn frame_shape(&self, layout: Layout) -> [u32; 4] {
        match layout {
            Layout::Nhwc => [1, self.height, self.width, self.channels],
            Layout::Nchw => [1, self.channels, self.height, self.width],
        }
    }

    /// Elements in one frame (`width * height * channels`).
    pub fn frame_len(&self) -> usize {
        self.width as usize * self.height as usize * self.channels as usize
    }
}

pub use tidegate_protocol::{ColorOrder, Resize};

/// `model value = (pixel * scale - mean[c]) / std[c]`, with `c` the channel of
/// the model input (so in BGR models `mean[0]` applies to blue).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Normalize {
    /// Multiplies the raw 0..=255 pixel first.
    pub scale: f32,
    /// Subtracted per channel after scaling.
    pub mean: [f32; 3],
    /// Divides per channel last; must be non-zero.
    pub std: [f32; 3],
}

impl Default for Normalize {
    /// The identity: model value = pixel.
    fn default() -> Self {
        Normalize {
            scale: 1.0,
            mean: [0.0; 3],
            std: [1.0; 3],
        }
    }
}

/// One graph output the decoder reads.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutputSpec {
    /// Name of the graph output.
    pub name: String,
    /// Its shape for a batch of one; -1 marks a dimension the graph leaves
    /// dynamic. The first dimension is the batch.
    pub shape: Vec<i64>,
}

/// How a model's outputs become detections, chosen by `kind`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
#[non_exhaustive]
pub enum DecoderSpec {
    /// MediaPipe BlazeFace: SSD anchors, sigmoid scores, weighted NMS.
    Blazeface(BlazefaceSpec),
    /// Rows of `x1,y1,x2,y2,score,class`: threshold and per-class NMS.
    Boxes(BoxesSpec),
    /// One score per class: softmax and top-k.
    Classify(ClassifySpec),
    /// No decoding: every listed output is passed on per frame as a tensor,
    /// returned to the edge in the result's `outputs` (embeddings, feature
    /// maps, or benchmarking a graph), with no detections.
    Raw(RawSpec),
}

impl DecoderSpec {
    /// The `kind` string, as written in model.toml.
    pub fn kind(&self) -> &'static str {
        match self {
            DecoderSpec::Blazeface(_) => "blazeface",
            DecoderSpec::Boxes(_) => "boxes",
            DecoderSpec::Classify(_) => "classify",
            DecoderSpec::Raw(_) => "raw",
        }
    }

    /// Class names, indexed by `Detection::class`; empty for `raw`. Workers
    /// register them so that edges can name what was found.
    pub fn labels(&self) -> &[String] {
        match self {
            DecoderSpec::Blazeface(b) => &b.labels,
            DecoderSpec::Boxes(b) => &b.labels,
            DecoderSpec::Classify(c) => &c.labels,
            DecoderSpec::Raw(_) => &[],
        }
    }
}

/// Parameters of the BlazeFace decoder.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlazefaceSpec {
    /// Keep anchors whose sigmoid score is above this.
    pub score_threshold: f32,
    /// Anchors overlapping the best one by at least this IoU merge into it.
    pub iou_threshold: f32,
    /// Most detections returned per frame (best first).
    pub max_detections: usize,
    /// Class names; BlazeFace has one, `face`.
    pub labels: Vec<String>,
    /// One anchor layer per pair of outputs.
    pub layers: Vec<AnchorLayer>,
}

/// One SSD anchor layer: a `grid`×`grid` lattice over the input with
/// `anchors_per_cell` anchors at each cell centre.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AnchorLayer {
    /// Output holding one logit per anchor, shape `[batch, anchors, 1]`.
    pub scores: String,
    /// Output holding the regressors per anchor, shape `[batch, anchors, 4 + 2k]`.
    pub boxes: String,
    /// Cells per side.
    pub grid: u32,
    /// Anchors in each cell.
    pub anchors_per_cell: u32,
}

/// The most anchors one BlazeFace layer may have: 2^20, a thousand times
/// BlazeFace's 512, so that a typo in `grid` is an error rather than
/// gigabytes of anchors.
pub const MAX_ANCHORS_PER_LAYER: usize = 1 << 20;

impl AnchorLayer {
    /// Anchors in this layer (`grid² × anchors_per_cell`), or `None` when
    /// that is more than [`MAX_ANCHORS_PER_LAYER`].
    pub fn anchors(&self) -> Option<usize> {
        (self.grid as usize)
            .checked_mul(self.grid as usize)?
            .checked_mul(self.anchors_per_cell as usize)
            .filter(|&n| n <= MAX_ANCHORS_PER_LAYER)
    }
}

/// Parameters of the boxes decoder.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BoxesSpec {
    /// Output of shape `[batch, rows, 6]`.
    pub output: String,
    /// Units of the coordinates.
    #[serde(default)]
    pub coords: BoxCoords,
    /// Order of the four coordinates in a row.
    #[serde(default)]
    pub order: BoxOrder,
    /// Keep rows whose score is above this.
    pub score_threshold: f32,
    /// Within a class, a row overlapping a better one by at least this IoU
    /// is dropped.
    pub iou_threshold: f32,
    /// Most detections returned per frame (best first).
    pub max_detections: usize,
    /// Class names; a row's class indexes them.
    pub labels: Vec<String>,
}

/// Units of box coordinates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BoxCoords {
    /// Pixels of the model input.
    #[default]
    Pixels,
    /// 0..1 over the model input.
    Normalized,
}

/// Order of a row's four coordinates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BoxOrder {
    /// `x1, y1, x2, y2`.
    #[default]
    Xyxy,
    /// `y1, x1, y2, x2` (TensorFlow's detection APIs).
    Yxyx,
}

/// Parameters of the classify decoder.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassifySpec {
    /// Output of shape `[batch, classes]`.
    pub output: String,
    /// Apply softmax (the graph gives logits); false when it gives
    /// probabilities already.
    #[serde(default = "yes")]
    pub softmax: bool,
    /// Classes reported per frame, best first.
    pub top_k: usize,
    /// Classes below this probability are left out.
    #[serde(default)]
    pub min_score: f32,
    /// Class names, one per score.
    pub labels: Vec<String>,
}

/// `true`, for serde defaults.
pub(crate) fn yes() -> bool {
    true
}

/// Parameters of the raw decoder (none yet).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawSpec {}

impl ModelSpec {
    /// This spec as a worker on the CPU provider serves it: `max_batch`
    /// lowered to `cpu_max_batch` when that is set.
    pub fn on_cpu(&self) -> ModelSpec {
        let mut spec = self.clone();
        if let Some(cap) = self.cpu_max_batch {
            spec.max_batch = spec.max_batch.min(cap);
        }
        spec
    }

    /// Parses a model.toml. `origin` names the file in errors.
    pub fn from_toml(text: &str, origin: &Path) -> Result<Self, RepositoryError> {
        let spec: ModelSpec = toml::from_str(text).map_err(|e| RepositoryError::Parse {
            path: origin.to_path_buf(),
            message: e.to_string().trim_end().to_string(),
        })?;
        spec.check()?;
        Ok(spec)
    }

    /// Checks what the TOML grammar cannot: values in range, and names that
    /// refer to each other.
    fn check(&self) -> Result<(), RepositoryError> {
        let invalid = |field: &str, problem: String| RepositoryError::Invalid {
            model: self.name.clone(),
            field: field.to_string(),
            problem,
        };
        // What the protocol carries (a receiver refuses more): results of
        // this model must be readable by the gateway.
        let limits = Limits::default();
        if self.name.is_empty() {
            return Err(invalid("name", "is empty; give the model a name".into()));
        }
        if self.name.len() > limits.max_string_bytes {
            return Err(invalid(
                "name",
                format!(
                    "is {} bytes long; the protocol carries strings of at most {} bytes \
                     (max_string_bytes): shorten it",
                    self.name.len(),
                    limits.max_string_bytes
                ),
            ));
        }
        if self.max_batch == 0 || usize::from(self.max_batch) > limits.max_batch {
            return Err(invalid(
                "max_batch",
                format!(
                    "is {}; it must be in 1..={} (the protocol's max_batch: the most frames \
                     one Dispatch or BatchResult carries)",
                    self.max_batch, limits.max_batch
                ),
            ));
        }
        if let Some(cap) = self.cpu_max_batch
            && (cap == 0 || cap > self.max_batch)
        {
            return Err(invalid(
                "cpu_max_batch",
                format!("is {cap}; it must be in 1..={} (max_batch)", self.max_batch),
            ));
        }
        let input = &self.input;
        if input.width == 0 || input.height == 0 {
            return Err(invalid(
                "input.width/height",
                format!(
                    "is {}x{}; both must be at least 1",
                    input.width, input.height
                ),
            ));
        }
        if input.channels != 3 {
            return Err(invalid(
                "input.channels",
                format!("is {}; only 3 (RGB or BGR) is supported", input.channels),
            ));
        }
        let n = &input.normalize;
        if !n.scale.is_finite() || n.mean.iter().chain(&n.std).any(|v| !v.is_finite()) {
            return Err(invalid(
                "input.normalize",
                "has a non-finite value; use plain numbers".into(),
            ));
        }
        if let Some(c) = n.std.iter().position(|&s| s == 0.0) {
            return Err(invalid(
                "input.normalize.std",
                format!("has 0 for channel {c}; a divisor must be non-zero"),
            ));
        }
        for (field, sha) in [
            ("sha256", self.sha256.as_ref()),
            ("fp16.sha256", self.fp16.as_ref().map(|v| &v.sha256)),
        ] {
            if let Some(sha) = sha
                && (sha.len() != 64 || !sha.bytes().all(|b| b.is_ascii_hexdigit()))
            {
                return Err(invalid(
                    field,
                    format!("is {sha:?}; it must be 64 hex digits (the output of sha256sum)"),
                ));
            }
        }
        let mut seen = HashSet::new();
        for (i, out) in self.outputs.iter().enumerate() {
            if !seen.insert(out.name.as_str()) {
                return Err(invalid(
                    &format!("outputs[{i}].name"),
                    format!("{:?} is listed twice", out.name),
                ));
            }
            if out.shape.is_empty() || out.shape.iter().any(|&d| d == 0 || d < -1) {
                return Err(invalid(
                    &format!("outputs[{i}].shape"),
                    format!(
                        "is {:?}; give one dimension per axis, each positive or -1 (dynamic)",
                        out.shape
                    ),
                ));
            }
        }
        match &self.decoder {
            DecoderSpec::Blazeface(b) => self.check_blazeface(b),
            DecoderSpec::Boxes(b) => self.check_boxes(b),
            DecoderSpec::Classify(c) => self.check_classify(c),
            DecoderSpec::Raw(_) => self.check_raw(&limits),
        }
    }

    /// Raw outputs travel by name, one tensor each, in every result.
    fn check_raw(&self, limits: &Limits) -> Result<(), RepositoryError> {
        let invalid = |field: String, problem: String| RepositoryError::Invalid {
            model: self.name.clone(),
            field,
            problem,
        };
        if self.outputs.len() > limits.max_list {
            return Err(invalid(
                "outputs".into(),
                format!(
                    "has {} entries; a result carries at most {} outputs (the protocol's \
                     max_list): list fewer",
                    self.outputs.len(),
                    limits.max_list
                ),
            ));
        }
        if let Some((i, out)) = self
            .outputs
            .iter()
            .enumerate()
            .find(|(_, o)| o.name.len() > limits.max_string_bytes)
        {
            return Err(invalid(
                format!("outputs[{i}].name"),
                format!(
                    "is {} bytes long; the raw decoder returns it in every result, and the \
                     protocol carries strings of at most {} bytes (max_string_bytes)",
                    out.name.len(),
                    limits.max_string_bytes
                ),
            ));
        }
        crate::decode::Decoder::new(self)?;
        Ok(())
    }

    /// `decoder.max_detections`: at least 1, and no more than one result
    /// carries.
    fn check_max_detections(&self, n: usize) -> Result<(), RepositoryError> {
        let max = Limits::default().max_detections;
        if n == 0 || n > max {
            return Err(RepositoryError::Invalid {
                model: self.name.clone(),
                field: "decoder.max_detections".into(),
                problem: format!(
                    "is {n}; it must be in 1..={max} (the protocol's max_detections: the most \
                     one result carries)"
                ),
            });
        }
        Ok(())
    }

    /// `decoder.labels`: registered with the gateway (`ModelInfo.labels`),
    /// so within the protocol's list and string limits.
    fn check_labels(&self, labels: &[String]) -> Result<(), RepositoryError> {
        let limits = Limits::default();
        let invalid = |field: String, problem: String| RepositoryError::Invalid {
            model: self.name.clone(),
            field,
            problem,
        };
        if labels.len() > limits.max_list {
            return Err(invalid(
                "decoder.labels".into(),
                format!(
                    "has {} entries; the worker registers them with the gateway, and the \
                     protocol carries at most {} (max_list): this model cannot be served",
                    labels.len(),
                    limits.max_list
                ),
            ));
        }
        if let Some((i, label)) = labels
            .iter()
            .enumerate()
            .find(|(_, l)| l.len() > limits.max_string_bytes)
        {
            let start: String = label.chars().take(24).collect();
            return Err(invalid(
                format!("decoder.labels[{i}]"),
                format!(
                    "({start:?}…) is {} bytes long; the protocol carries strings of at most \
                     {} bytes (max_string_bytes): shorten it",
                    label.len(),
                    limits.max_string_bytes
                ),
            ));
        }
        Ok(())
    }

    fn check_boxes(&self, b: &BoxesSpec) -> Result<(), RepositoryError> {
        let invalid = |field: &str, problem: String| RepositoryError::Invalid {
            model: self.name.clone(),
            field: field.to_string(),
            problem,
        };
        if !(0.0..1.0).contains(&b.score_threshold) {
            return Err(invalid(
                "decoder.score_threshold",
                format!("is {}; it must be in 0..1", b.score_threshold),
            ));
        }
        if !(b.iou_threshold > 0.0 && b.iou_threshold <= 1.0) {
            return Err(invalid(
                "decoder.iou_threshold",
                format!("is {}; it must be in (0, 1]", b.iou_threshold),
            ));
        }
        self.check_max_detections(b.max_detections)?;
        if b.labels.is_empty() {
            return Err(invalid(
                "decoder.labels",
                "is empty; list the class names, in class-index order".into(),
            ));
        }
        self.check_labels(&b.labels)?;
        crate::decode::Decoder::new(self)?;
        Ok(())
    }

    fn check_classify(&self, c: &ClassifySpec) -> Result<(), RepositoryError> {
        let invalid = |field: &str, problem: String| RepositoryError::Invalid {
            model: self.name.clone(),
            field: field.to_string(),
            problem,
        };
        if c.labels.is_empty() {
            return Err(invalid(
                "decoder.labels",
                "is empty; list the class names, one per score".into(),
            ));
        }
        let max_detections = Limits::default().max_detections;
        if c.top_k == 0 || c.top_k > c.labels.len().min(max_detections) {
            let bound = if c.labels.len() <= max_detections {
                format!("{} (the number of labels)", c.labels.len())
            } else {
                format!(
                    "{max_detections} (the protocol's max_detections: the most one result carries)"
                )
            };
            return Err(invalid(
                "decoder.top_k",
                format!("is {}; it must be in 1..={bound}", c.top_k),
            ));
        }
        self.check_labels(&c.labels)?;
        if !(0.0..=1.0).contains(&c.min_score) {
            return Err(invalid(
                "decoder.min_score",
                format!("is {}; it must be in 0..=1", c.min_score),
            ));
        }
        crate::decode::Decoder::new(self)?;
        Ok(())
    }

    fn check_blazeface(&self, b: &BlazefaceSpec) -> Result<(), RepositoryError> {
        let invalid = |field: String, problem: String| RepositoryError::Invalid {
            model: self.name.clone(),
            field,
            problem,
        };
        if !(0.0..1.0).contains(&b.score_threshold) {
            return Err(invalid(
                "decoder.score_threshold".into(),
                format!("is {}; it must be in 0..1", b.score_threshold),
            ));
        }
        if !(b.iou_threshold > 0.0 && b.iou_threshold <= 1.0) {
            return Err(invalid(
                "decoder.iou_threshold".into(),
                format!("is {}; it must be in (0, 1]", b.iou_threshold),
            ));
        }
        self.check_max_detections(b.max_detections)?;
        if b.labels.is_empty() {
            return Err(invalid(
                "decoder.labels".into(),
                "is empty; BlazeFace needs one label, e.g. [\"face\"]".into(),
            ));
        }
        self.check_labels(&b.labels)?;
        if b.layers.is_empty() {
            return Err(invalid(
                "decoder.layers".into(),
                "is empty; add one [[decoder.layers]] per score/box output pair".into(),
            ));
        }
        for (i, layer) in b.layers.iter().enumerate() {
            if layer.grid == 0 || layer.anchors_per_cell == 0 {
                return Err(invalid(
                    format!("decoder.layers[{i}]"),
                    format!(
                        "has grid = {} and anchors_per_cell = {}; both must be at least 1",
                        layer.grid, layer.anchors_per_cell
                    ),
                ));
            }
            if layer.anchors().is_none() {
                return Err(invalid(
                    format!("decoder.layers[{i}]"),
                    format!(
                        "has grid = {} and anchors_per_cell = {}: {} anchors, more than the {MAX_ANCHORS_PER_LAYER} supported; check grid (cells per side)",
                        layer.grid,
                        layer.anchors_per_cell,
                        u128::from(layer.grid).pow(2) * u128::from(layer.anchors_per_cell)
                    ),
                ));
            }
        }
        // Output names and shapes: the decoder checks what it reads.
        crate::decode::Decoder::new(self)?;
        Ok(())
    }
}

/// A model found in the repository: its spec and where its file is.
#[derive(Debug, Clone, PartialEq)]
pub struct Model {
    /// The parsed model.toml.
    pub spec: ModelSpec,
    /// The model's folder.
    pub dir: PathBuf,
    /// The ONNX file (`dir` joined with `spec.file`).
    pub path: PathBuf,
}

/// The models a worker serves, sorted by name.
#[derive(Debug, Clone, PartialEq)]
pub struct Repository {
    root: PathBuf,
    models: Vec<Model>,
}

impl Repository {
    /// Loads every subfolder of `dir` that holds a model.toml, or, with
    /// `only`, exactly the named ones (each must exist).
    pub fn load(dir: &Path, only: Option<&[String]>) -> Result<Self, RepositoryError> {
        let mut folders = Vec::new();
        match only {
            Some(names) => {
                let mut seen = HashSet::new();
                for name in names {
                    if !seen.insert(name.as_str()) {
                        continue;
                    }
                    let folder = dir.join(name);
                    if !folder.join(SPEC_FILE).is_file() {
                        return Err(RepositoryError::NotFound {
                            name: name.clone(),
                            dir: dir.to_path_buf(),
                            available: Self::available(dir),
                        });
                    }
                    folders.push((name.clone(), folder));
                }
            }
            None => {
                let entries = fs::read_dir(dir).map_err(|source| RepositoryError::ReadDir {
                    dir: dir.to_path_buf(),
                    source,
                })?;
                for entry in entries {
                    let entry = entry.map_err(|source| RepositoryError::ReadDir {
                        dir: dir.to_path_buf(),
                        source,
                    })?;
                    let folder = entry.path();
                    if folder.join(SPEC_FILE).is_file() {
                        let name = entry.file_name().to_string_lossy().into_owned();
                        folders.push((name, folder));
                    }
                }
            }
        }
        if folders.is_empty() {
            return Err(RepositoryError::Empty {
                dir: dir.to_path_buf(),
            });
        }
        let mut models = Vec::with_capacity(folders.len());
        for (folder_name, folder) in folders {
            match Self::load_model(&folder_name, &folder) {
                Ok(m) => models.push(m),
                Err(RepositoryError::MissingFile {
                    model,
                    path,
                    optional: true,
                }) if only.is_none() => {
                    tracing::warn!(%model, path = %path.display(), "opt-in model (optional = true) not there; skipped");
                }
                Err(e) => return Err(e),
            }
        }
        if models.is_empty() {
            return Err(RepositoryError::Empty {
                dir: dir.to_path_buf(),
            });
        }
        models.sort_by(|a, b| a.spec.name.cmp(&b.spec.name));
        Ok(Repository {
            root: dir.to_path_buf(),
            models,
        })
    }

    fn load_model(folder_name: &str, folder: &Path) -> Result<Model, RepositoryError> {
        let spec_path = folder.join(SPEC_FILE);
        let text = fs::read_to_string(&spec_path).map_err(|source| RepositoryError::Read {
            path: spec_path.clone(),
            source,
        })?;
        let spec = ModelSpec::from_toml(&text, &spec_path)?;
        if spec.name != folder_name {
            return Err(RepositoryError::Invalid {
                model: spec.name.clone(),
                field: "name".into(),
                problem: format!(
                    "does not match its folder {}; rename one so they agree",
                    folder.display()
                ),
            });
        }
        let path = folder.join(&spec.file);
        if !path.is_file() {
            return Err(RepositoryError::MissingFile {
                model: spec.name.clone(),
                path,
                optional: spec.optional,
            });
        }
        if let Some(expected) = &spec.sha256 {
            check_sha256(&spec.name, &path, expected)?;
        }
        Ok(Model {
            spec,
            dir: folder.to_path_buf(),
            path,
        })
    }

    /// The repository at `precision`: with [`Precision::Fp16`], each model
    /// that has an `[fp16]` variant opens that file (there, and checked
    /// against its sha256: a missing variant is an error naming the fix),
    /// and each that has none stays FP32, named in the returned notes.
    pub fn at_precision(
        mut self,
        precision: Precision,
    ) -> Result<(Repository, Vec<String>), RepositoryError> {
        let mut notes = Vec::new();
        if precision == Precision::Fp32 {
            return Ok((self, notes));
        }
        for m in &mut self.models {
            let Some(variant) = &m.spec.fp16 else {
                notes.push(format!(
                    "model '{}' has no [fp16] variant in its model.toml; it is served in FP32",
                    m.spec.name
                ));
                continue;
            };
            let path = m.dir.join(&variant.file);
            if !path.is_file() {
                return Err(RepositoryError::MissingVariant {
                    model: m.spec.name.clone(),
                    precision,
                    path,
                });
            }
            check_sha256(&m.spec.name, &path, &variant.sha256)?;
            m.path = path;
        }
        Ok((self, notes))
    }

    /// Names of the folders in `dir` that hold a model.toml, for error messages.
    fn available(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.path().join(SPEC_FILE).is_file())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    /// The folder the models were loaded from.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The models, sorted by name.
    pub fn models(&self) -> &[Model] {
        &self.models
    }

    /// The model called `name`.
    pub fn get(&self, name: &str) -> Option<&Model> {
        self.models.iter().find(|m| m.spec.name == name)
    }
}

/// `path`'s sha256 must be `expected`.
fn check_sha256(model: &str, path: &Path, expected: &str) -> Result<(), RepositoryError> {
    let actual = sha256_file(path).map_err(|source| RepositoryError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    if actual.eq_ignore_ascii_case(expected) {
        return Ok(());
    }
    Err(RepositoryError::Checksum {
        model: model.to_string(),
        path: path.to_path_buf(),
        expected: expected.to_string(),
        actual,
    })
}

/// Lower-case hex sha256 of a file, streamed.
fn sha256_file(path: &Path) -> io::Result<String> {
    let mut hasher = Sha256::new();
    let mut file = fs::File::open(path)?;
    io::copy(&mut file, &mut hasher)?;
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// Why the model repository could not be loaded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RepositoryError {
    /// The repository folder could not be listed.
    #[error("cannot list the model folder {}: {source}; check the models path in the worker config", dir.display())]
    ReadDir {
        /// The folder.
        dir: PathBuf,
        /// What the OS said.
        source: io::Error,
    },
    /// No subfolder holds a model.toml.
    #[error("no models in {}: no subfolder holds a model.toml; point the worker at the repository's models/ folder", dir.display())]
    Empty {
        /// The folder searched.
        dir: PathBuf,
    },
    /// A model asked for by name has no folder with a model.toml.
    #[error("model '{name}' not found: {}/{name}/model.toml does not exist (models there: {})", dir.display(), list(available))]
    NotFound {
        /// The requested name.
        name: String,
        /// The repository folder.
        dir: PathBuf,
        /// Models that do exist.
        available: Vec<String>,
    },
    /// A file could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        source: io::Error,
    },
    /// A model.toml is not valid TOML or does not match the spec's fields.
    #[error("{}: {message}", path.display())]
    Parse {
        /// The model.toml.
        path: PathBuf,
        /// The parser's account, with line and column.
        message: String,
    },
    /// A model.toml parses but a value is out of range or inconsistent.
    #[error("model '{model}': {field} {problem}")]
    Invalid {
        /// The model's name.
        model: String,
        /// The offending field, as a TOML path.
        field: String,
        /// What is wrong and what to do.
        problem: String,
    },
    /// The decoder section does not fit the outputs.
    #[error(transparent)]
    Decoder(#[from] crate::decode::DecoderError),
    /// The model's ONNX file does not exist.
    #[error("model '{model}': file {} is missing; {}", path.display(), if *optional {
        "it is opt-in (optional = true in its model.toml): fetch or convert it as its model.toml says, or serve other models"
    } else {
        "run `make setup` (models/fetch.sh) to fetch it"
    })]
    MissingFile {
        /// The model's name.
        model: String,
        /// Where the file was expected.
        path: PathBuf,
        /// Whether the model is opt-in (`optional = true`).
        optional: bool,
    },
    /// `runtime.precision` asks for a variant whose file is not there.
    #[error("model '{model}': runtime.precision = \"{precision}\" serves {}, which is not there; run `make setup` (models/fetch.sh builds it), or set runtime.precision = \"fp32\"", path.display())]
    MissingVariant {
        /// The model.
        model: String,
        /// The precision asked for.
        precision: Precision,
        /// The variant's file.
        path: PathBuf,
    },
    /// The model file's sha256 differs from the pinned one.
    #[error("model '{model}': {} has sha256 {actual}, model.toml pins {expected}; the file is corrupt or a different version: delete it and run `make setup`", path.display())]
    Checksum {
        /// The model's name.
        model: String,
        /// The model file.
        path: PathBuf,
        /// The sha256 in model.toml.
        expected: String,
        /// The file's sha256.
        actual: String,
    },
}

fn list(names: &[String]) -> String {
    if names.is_empty() {
        "none".to_string()
    } else {
        names.join(", ")
    }
}

/// Shapes as in model.toml and error messages: `[1,512,-1]`.
pub(crate) struct DimsDisplay<'a>(pub &'a [i64]);

impl fmt::Display for DimsDisplay<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blazeface_toml() -> String {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/blazeface/model.toml");
        fs::read_to_string(path).unwrap()
    }

    fn parse(text: &str) -> Result<ModelSpec, RepositoryError> {
        ModelSpec::from_toml(text, Path::new("model.toml"))
    }

    #[test]
    fn shipped_blazeface_spec_parses_into_the_expected_fields() {
        let spec = parse(&blazeface_toml()).unwrap();
        assert_eq!(spec.name, "blazeface");
        assert_eq!(spec.max_batch, 32);
        assert_eq!(spec.input.name, "input:0");
        assert_eq!(spec.input.layout, Layout::Nhwc);
        assert_eq!(spec.input.model_dtype, DType::F32);
        assert_eq!(spec.input.resize, Resize::Letterbox);
        assert_eq!(spec.input.normalize.mean, [127.5; 3]);
        assert_eq!(spec.outputs.len(), 4);
        assert_eq!(spec.outputs[2].shape, vec![-1, 512, 16]);
        let DecoderSpec::Blazeface(b) = &spec.decoder else {
            panic!("expected the blazeface decoder, got {:?}", spec.decoder);
        };
        assert_eq!(b.layers.len(), 2);
        assert_eq!(b.layers[1].anchors(), Some(384));
        assert_eq!(b.labels, vec!["face".to_string()]);
    }

    #[test]
    fn unknown_field_is_rejected_with_its_name() {
        let text = blazeface_toml().replace("max_batch = 32", "max_batch = 32\nmax_bacth = 2");
        let err = parse(&text).unwrap_err().to_string();
        assert!(err.contains("max_bacth"), "{err}");
    }

    #[test]
    fn unknown_field_inside_decoder_is_rejected() {
        let text =
            blazeface_toml().replace("max_detections = 64", "max_detections = 64\nnms = true");
        let err = parse(&text).unwrap_err().to_string();
        assert!(err.contains("nms"), "{err}");
    }

    #[test]
    fn unknown_decoder_kind_is_rejected_naming_it() {
        let text = blazeface_toml().replace("kind = \"blazeface\"", "kind = \"yolo\"");
        let err = parse(&text).unwrap_err().to_string();
        assert!(err.contains("yolo"), "{err}");
    }

    #[test]
    fn raw_decoder_needs_no_parameters() {
        let text = r#"
            name = "probe"
            version = 1
            file = "probe.onnx"
            max_batch = 8
            [input]
            name = "images"
            layout = "nchw"
            width = 64
            height = 32
            channels = 3
            color = "bgr"
            resize = "stretch"
            model_dtype = "u8"
            [[outputs]]
            name = "out"
            shape = [-1, 10]
            [decoder]
            kind = "raw"
        "#;
        let spec = parse(text).unwrap();
        assert_eq!(spec.decoder, DecoderSpec::Raw(RawSpec {}));
        assert_eq!(spec.input.normalize, Normalize::default());
        assert_eq!(spec.input.model_shape(8), [8, 3, 32, 64]);
        assert_eq!(spec.input.frame_shape(Layout::Nhwc), [1, 32, 64, 3]);
        assert!(spec.sha256.is_none());
    }

    #[test]
    fn layer_naming_a_missing_output_is_an_error_naming_the_layer() {
        let text = blazeface_toml().replace("boxes = \"Identity_3:0\"", "boxes = \"Identity_9:0\"");
        let err = parse(&text).unwrap_err().to_string();
        assert!(err.contains("model 'blazeface'"), "{err}");
        assert!(err.contains("decoder.layers[1].boxes"), "{err}");
        assert!(err.contains("Identity_9:0"), "{err}");
    }

    #[test]
    fn layer_whose_anchor_count_disagrees_with_its_output_is_an_error() {
        let text = blazeface_toml().replace("grid = 8", "grid = 9");
        let err = parse(&text).unwrap_err().to_string();
        assert!(err.contains("decoder.layers[1].scores"), "{err}");
        assert!(err.contains("[batch,486,1]"), "{err}");
    }

    #[test]
    fn layer_with_an_absurd_grid_is_refused_before_any_anchor_is_made() {
        // 4294967295² × 6 overflows u32 and u64 alike.
        let text = blazeface_toml().replace("grid = 8", "grid = 4294967295");
        let err = parse(&text).unwrap_err().to_string();
        assert!(
            err.contains("decoder.layers[1]")
                && err.contains("110680464390717702150")
                && err.contains("more than the 1048576 supported"),
            "{err}"
        );
    }

    #[test]
    fn zero_std_is_rejected() {
        let text =
            blazeface_toml().replace("std = [127.5, 127.5, 127.5]", "std = [127.5, 0.0, 127.5]");
        let err = parse(&text).unwrap_err().to_string();
        assert!(
            err.contains("input.normalize.std") && err.contains("channel 1"),
            "{err}"
        );
    }

    #[test]
    fn malformed_sha256_is_rejected() {
        let text = blazeface_toml().replace("sha256 = \"5c71", "sha256 = \"zz71");
        let err = parse(&text).unwrap_err().to_string();
        assert!(
            err.contains("sha256") && err.contains("64 hex digits"),
            "{err}"
        );
    }

    #[test]
    fn single_channel_input_is_rejected() {
        let text = blazeface_toml().replace("channels = 3", "channels = 1");
        let err = parse(&text).unwrap_err().to_string();
        assert!(err.contains("input.channels"), "{err}");
    }

    /// A repository folder with one model `name` whose file holds `bytes`.
    fn repo_with(name: &str, bytes: &[u8], sha: Option<String>) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let folder = dir.path().join(name);
        fs::create_dir(&folder).unwrap();
        let mut text =
            blazeface_toml().replace("name = \"blazeface\"", &format!("name = \"{name}\""));
        let sha_line = text
            .lines()
            .find(|l| l.starts_with("sha256"))
            .unwrap()
            .to_string();
        text = match sha {
            Some(s) => text.replace(&sha_line, &format!("sha256 = \"{s}\"")),
            None => text.replace(&sha_line, ""),
        };
        fs::write(folder.join(SPEC_FILE), text).unwrap();
        fs::write(folder.join("model.onnx"), bytes).unwrap();
        dir
    }

    #[test]
    fn an_fp16_table_names_its_file_and_a_malformed_pin_is_refused_naming_the_field() {
        let spec = parse(&blazeface_toml()).unwrap();
        let v = spec
            .fp16
            .expect("the shipped BlazeFace has an FP16 variant");
        assert_eq!(v.file, PathBuf::from("model.fp16.onnx"));
        assert_eq!(v.sha256.len(), 64);
        let text = blazeface_toml().replace(&v.sha256, "not-a-digest");
        let err = parse(&text).unwrap_err().to_string();
        assert!(
            err.contains("fp16.sha256") && err.contains("64 hex digits"),
            "{err}"
        );
        let text = blazeface_toml().replace("[fp16]\n", "[fp16]\nquality = 1\n");
        let err = parse(&text).unwrap_err().to_string();
        assert!(err.contains("quality"), "{err}");
    }

    #[test]
    fn repository_loads_every_model_folder_and_skips_others() {
        let dir = repo_with("face", b"onnx", None);
        fs::create_dir(dir.path().join("notes")).unwrap();
        let repo = Repository::load(dir.path(), None).unwrap();
        assert_eq!(repo.models().len(), 1);
        let model = repo.get("face").unwrap();
        assert_eq!(model.path, dir.path().join("face/model.onnx"));
        assert!(repo.get("blazeface").is_none());
    }

    #[test]
    fn matching_sha256_is_accepted() {
        // `printf onnx | sha256sum`
        let sha = "87e93f89f2be0db364e8be052f79f389e6c2da239831922e24513288af522a43";
        let dir = repo_with("face", b"onnx", Some(sha.to_string()));
        assert_eq!(
            sha256_file(&dir.path().join("face/model.onnx")).unwrap(),
            sha
        );
        assert!(Repository::load(dir.path(), None).is_ok());
    }

    #[test]
    fn wrong_sha256_names_model_and_both_digests() {
        let pinned = "0".repeat(64);
        let dir = repo_with("face", b"onnx", Some(pinned.clone()));
        let err = Repository::load(dir.path(), None).unwrap_err().to_string();
        assert!(err.contains("model 'face'"), "{err}");
        assert!(err.contains(&pinned), "{err}");
        assert!(err.contains("make setup"), "{err}");
    }

    #[test]
    fn missing_model_file_says_how_to_fetch_it() {
        let dir = repo_with("face", b"onnx", None);
        fs::remove_file(dir.path().join("face/model.onnx")).unwrap();
        let err = Repository::load(dir.path(), None).unwrap_err().to_string();
        let want = format!(
            "model 'face': file {} is missing; run `make setup` (models/fetch.sh) to fetch it",
            dir.path().join("face/model.onnx").display()
        );
        assert_eq!(err, want);
    }

    #[test]
    fn only_loads_the_named_models_and_rejects_unknown_names() {
        let dir = repo_with("face", b"onnx", None);
        let only = vec!["face".to_string()];
        assert_eq!(
            Repository::load(dir.path(), Some(&only))
                .unwrap()
                .models()
                .len(),
            1
        );
        let only = vec!["yolo".to_string()];
        let err = Repository::load(dir.path(), Some(&only))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("model 'yolo' not found") && err.contains("face"),
            "{err}"
        );
    }

    #[test]
    fn folder_and_name_must_agree() {
        let dir = repo_with("face", b"onnx", None);
        fs::rename(dir.path().join("face"), dir.path().join("faces")).unwrap();
        let err = Repository::load(dir.path(), None).unwrap_err().to_string();
        assert!(
            err.contains("model 'face': name") && err.contains("faces"),
            "{err}"
        );
    }

    #[test]
    fn cpu_max_batch_caps_the_cpu_batch_and_must_fit_max_batch() {
        let path = Path::new("model.toml");
        let with = |cap: &str| {
            ModelSpec::from_toml(
                &blazeface_toml().replace("max_batch = 32", &format!("max_batch = 32\n{cap}")),
                path,
            )
        };
        let spec = with("cpu_max_batch = 8").unwrap();
        assert_eq!((spec.max_batch, spec.on_cpu().max_batch), (32, 8));
        assert_eq!(with("").unwrap().on_cpu().max_batch, 32);
        for bad in ["cpu_max_batch = 0", "cpu_max_batch = 33"] {
            let err = with(bad).unwrap_err().to_string();
            assert!(
                err.contains("cpu_max_batch") && err.contains("1..=32"),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn missing_opt_in_model_is_skipped_unless_asked_for() {
        let dir = repo_with("face", b"onnx", None);
        let folder = dir.path().join("extra");
        fs::create_dir(&folder).unwrap();
        let text =
            blazeface_toml().replace("name = \"blazeface\"", "name = \"extra\"\noptional = true");
        fs::write(folder.join(SPEC_FILE), text).unwrap();
        let repo = Repository::load(dir.path(), None).unwrap();
        let names: Vec<&str> = repo.models().iter().map(|m| m.spec.name.as_str()).collect();
        assert_eq!(names, vec!["face"]);
        let only = vec!["extra".to_string()];
        let err = Repository::load(dir.path(), Some(&only))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("model 'extra'") && err.contains("opt-in"),
            "{err}"
        );
    }

    #[test]
    fn shipped_centernet_spec_is_a_pinned_box_detector_with_80_coco_labels() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/centernet/model.toml");
        let spec = ModelSpec::from_toml(&fs::read_to_string(&path).unwrap(), &path).unwrap();
        assert!(!spec.optional && spec.sha256.is_some());
        assert_eq!(
            (spec.max_batch, spec.input.width, spec.input.height),
            (32, 512, 512)
        );
        // A CPU worker batches it by 4 at most.
        assert_eq!(spec.on_cpu().max_batch, 4);
        let DecoderSpec::Boxes(b) = &spec.decoder else {
            panic!("{:?}", spec.decoder);
        };
        assert_eq!(b.labels.len(), 80);
        assert_eq!(
            (b.labels[0].as_str(), b.labels[79].as_str()),
            ("person", "toothbrush")
        );
    }

    #[test]
    fn shipped_emotion_spec_is_a_pinned_classifier_of_probabilities() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/emotion/model.toml");
        let spec = ModelSpec::from_toml(&fs::read_to_string(&path).unwrap(), &path).unwrap();
        assert!(!spec.optional && spec.sha256.is_some());
        assert_eq!((spec.input.width, spec.input.height), (64, 64));
        assert_eq!(spec.input.resize, Resize::Stretch);
        let DecoderSpec::Classify(c) = &spec.decoder else {
            panic!("{:?}", spec.decoder);
        };
        assert!(!c.softmax, "the graph ends in Softmax already");
        assert_eq!(
            c.labels,
            [
                "angry", "disgust", "fear", "happy", "sad", "surprise", "neutral"
            ]
        );
    }

    /// Loads a repository holding the shipped model `model` (its sha256 pin
    /// dropped, its file a stand-in), with its model.toml edited by `edit`.
    fn load_edited(
        model: &str,
        edit: impl Fn(String) -> String,
    ) -> Result<Repository, RepositoryError> {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../models/{model}/model.toml"));
        // Without the model file's pin (the top-level sha256; a variant's
        // table keeps its own).
        let mut in_table = false;
        let text: String = fs::read_to_string(path)
            .unwrap()
            .lines()
            .filter(|l| {
                in_table |= l.starts_with('[');
                in_table || !l.starts_with("sha256")
            })
            .map(|l| format!("{l}\n"))
            .collect();
        let dir = tempfile::tempdir().unwrap();
        let folder = dir.path().join(model);
        fs::create_dir(&folder).unwrap();
        fs::write(folder.join(SPEC_FILE), edit(text)).unwrap();
        fs::write(folder.join("model.onnx"), b"onnx").unwrap();
        Repository::load(dir.path(), None)
    }

    fn load_error(model: &str, edit: impl Fn(String) -> String) -> String {
        match load_edited(model, edit) {
            Ok(_) => panic!("model '{model}' loaded; expected it to be refused"),
            Err(e) => e.to_string(),
        }
    }

    /// `n` labels `c0`, `c1`, … as a TOML array.
    fn labels_toml(n: usize) -> String {
        let names: Vec<String> = (0..n).map(|i| format!("\"c{i}\"")).collect();
        format!("labels = [{}]", names.join(", "))
    }

    #[test]
    fn max_batch_above_the_protocols_batch_limit_is_refused_at_load() {
        let err = load_error("blazeface", |t| {
            t.replace("max_batch = 32", "max_batch = 257")
        });
        assert!(
            err.starts_with("model 'blazeface': max_batch is 257; it must be in 1..=256")
                && err.contains("max_batch"),
            "{err}"
        );
        assert!(
            load_edited("blazeface", |t| t
                .replace("max_batch = 32", "max_batch = 256"))
            .is_ok()
        );
    }

    #[test]
    fn max_detections_above_what_a_result_carries_is_refused_at_load() {
        for (model, line) in [
            ("blazeface", "max_detections = 64"),
            ("centernet", "max_detections = 50"),
        ] {
            let err = load_error(model, |t| t.replace(line, "max_detections = 1025"));
            assert!(
                err.starts_with(&format!(
                    "model '{model}': decoder.max_detections is 1025; it must be in 1..=1024 \
                     (the protocol's max_detections"
                )),
                "{err}"
            );
            assert!(load_edited(model, |t| t.replace(line, "max_detections = 1024")).is_ok());
        }
    }

    #[test]
    fn blazeface_with_more_keypoints_than_a_detection_carries_is_refused_at_load() {
        // 4 + 2k regressors: 134 is k = 65, one more than max_keypoints.
        let with = |values: u32| {
            move |t: String| {
                t.replace("[-1, 512, 16]", &format!("[-1, 512, {values}]"))
                    .replace("[-1, 384, 16]", &format!("[-1, 384, {values}]"))
            }
        };
        let err = load_error("blazeface", with(134));
        assert!(
            err.contains("model 'blazeface'")
                && err.contains("decoder.layers[0].boxes")
                && err.contains("k = 65")
                && err.contains("k ≤ 64 keypoints (the protocol's max_keypoints)"),
            "{err}"
        );
        assert!(load_edited("blazeface", with(132)).is_ok());
    }

    #[test]
    fn more_labels_than_the_protocol_lists_are_refused_at_load() {
        // A 1100-class classifier (top_k within bounds) and a box detector.
        let err = load_error("emotion", |t| {
            let labels = t.lines().find(|l| l.starts_with("labels")).unwrap();
            t.replace(labels, &labels_toml(1100))
                .replace("shape = [-1, 7]", "shape = [-1, 1100]")
        });
        assert!(
            err.starts_with("model 'emotion': decoder.labels has 1100 entries")
                && err.contains("at most 1024 (max_list)"),
            "{err}"
        );
        let err = load_error("centernet", |t| {
            let labels = t.lines().find(|l| l.starts_with("labels")).unwrap();
            t.replace(labels, &labels_toml(1025))
        });
        assert!(
            err.starts_with("model 'centernet': decoder.labels has 1025 entries"),
            "{err}"
        );
        let at_limit = load_edited("centernet", |t| {
            let labels = t.lines().find(|l| l.starts_with("labels")).unwrap();
            t.replace(labels, &labels_toml(1024))
        });
        assert!(at_limit.is_ok(), "{at_limit:?}");
    }

    #[test]
    fn classifier_top_k_above_what_a_result_carries_is_refused_at_load() {
        let err = load_error("emotion", |t| {
            let labels = t.lines().find(|l| l.starts_with("labels")).unwrap();
            t.replace(labels, &labels_toml(1100))
                .replace("shape = [-1, 7]", "shape = [-1, 1100]")
                .replace("top_k = 3", "top_k = 1100")
        });
        assert!(
            err.starts_with(
                "model 'emotion': decoder.top_k is 1100; it must be in 1..=1024 \
                 (the protocol's max_detections"
            ),
            "{err}"
        );
    }

    #[test]
    fn label_longer_than_the_protocols_string_limit_is_refused_at_load() {
        // 513 two-byte characters: 1026 bytes.
        let long = "é".repeat(513);
        let err = load_error("centernet", |t| {
            t.replace("\"bicycle\"", &format!("\"{long}\""))
        });
        assert!(
            err.starts_with("model 'centernet': decoder.labels[1] (\"éééé")
                && err.contains("is 1026 bytes long")
                && err.contains("at most 1024 bytes (max_string_bytes)"),
            "{err}"
        );
        let fits = "é".repeat(512);
        assert!(
            load_edited("centernet", |t| t
                .replace("\"bicycle\"", &format!("\"{fits}\"")))
            .is_ok()
        );
    }

    #[test]
    fn raw_output_name_longer_than_the_protocols_string_limit_is_refused() {
        let name = "o".repeat(1025);
        let text = format!(
            r#"
            name = "probe"
            version = 1
            file = "probe.onnx"
            max_batch = 8
            [input]
            name = "images"
            layout = "nhwc"
            width = 8
            height = 8
            channels = 3
            color = "rgb"
            resize = "stretch"
            model_dtype = "u8"
            [[outputs]]
            name = "{name}"
            shape = [-1, 10]
            [decoder]
            kind = "raw"
        "#
        );
        let err = parse(&text).unwrap_err().to_string();
        assert!(
            err.starts_with("model 'probe': outputs[0].name is 1025 bytes long"),
            "{err}"
        );
    }

    #[test]
    fn empty_repository_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let err = Repository::load(dir.path(), None).unwrap_err().to_string();
        assert!(err.contains("no models in"), "{err}");
    }
}
