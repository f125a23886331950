//! Tensor payloads: element type, memory layout, shape, and the frame geometry
//! that maps model-input pixels back to source pixels.

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::limits::Limits;

/// Element type of a tensor on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// Unsigned 8-bit integers (camera pixels).
    U8,
    /// IEEE-754 32-bit floats, little-endian.
    F32,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::U8 => 1,
            DType::F32 => 4,
        }
    }

    /// The wire code of this type.
    pub fn code(self) -> u8 {
        match self {
            DType::U8 => 0,
            DType::F32 => 1,
        }
    }

    /// The type for a wire code, if known.
    pub fn from_code(code: u8) -> Option<Self> {
        match code {
            0 => Some(DType::U8),
            1 => Some(DType::F32),
            _ => None,
        }
    }

    /// Lower-case name, as in model.toml.
    pub fn name(self) -> &'static str {
        match self {
            DType::U8 => "u8",
            DType::F32 => "f32",
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Memory layout of an image tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Layout {
    /// Batch, height, width, channels (interleaved pixels, as cameras produce).
    Nhwc,
    /// Batch, channels, height, width (planar).
    Nchw,
}

impl Layout {
    /// The wire code of this layout.
    pub fn code(self) -> u8 {
        match self {
            Layout::Nhwc => 0,
            Layout::Nchw => 1,
        }
    }

    /// The layout for a wire code, if known.
    pub fn from_code(code: u8) -> Option<Self> {
        match code {
            0 => Some(Layout::Nhwc),
            1 => Some(Layout::Nchw),
            _ => None,
        }
    }

    /// Lower-case name, as in model.toml.
    pub fn name(self) -> &'static str {
        match self {
            Layout::Nhwc => "nhwc",
            Layout::Nchw => "nchw",
        }
    }
}

impl std::fmt::Display for Layout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Renders a shape as `[1,128,128,3]`, the form every error message uses.
pub fn shape_string(shape: &[u32]) -> String {
    let dims: Vec<String> = shape.iter().map(u32::to_string).collect();
    format!("[{}]", dims.join(","))
}

/// A family of image encodings: what a worker can decode, and what a camera
/// asks for at `CameraOpen`. [`Encoding`] adds the quality.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Codec {
    /// Row-major elements, as the model reads them.
    Raw,
    /// Baseline JPEG (lossy): one self-contained JPEG file per frame.
    Jpeg,
    /// PNG (lossless): one self-contained PNG file per frame.
    Png,
}

impl Codec {
    /// Every codec, in wire-code order.
    pub const ALL: [Codec; 3] = [Codec::Raw, Codec::Jpeg, Codec::Png];

    /// The wire code of this codec.
    pub fn code(self) -> u8 {
        match self {
            Codec::Raw => 0,
            Codec::Jpeg => 1,
            Codec::Png => 2,
        }
    }

    /// The codec for a wire code, if known.
    pub fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            0 => Codec::Raw,
            1 => Codec::Jpeg,
            2 => Codec::Png,
            _ => return None,
        })
    }

    /// Lower-case name, as in configuration files and JSON.
    pub fn name(self) -> &'static str {
        match self {
            Codec::Raw => "raw",
            Codec::Jpeg => "jpeg",
            Codec::Png => "png",
        }
    }

    /// Whether an image input of this type, layout and channel count can
    /// travel in this codec. Image codecs carry interleaved (NHWC) u8
    /// pixels of one (grey) or three (colour) channels; raw carries
    /// anything. The error says what the input is and what to use instead.
    pub fn carries(self, dtype: DType, layout: Layout, channels: u32) -> Result<(), String> {
        if self == Codec::Raw
            || (dtype == DType::U8 && layout == Layout::Nhwc && matches!(channels, 1 | 3))
        {
            return Ok(());
        }
        Err(format!(
            "{} carries u8 NHWC images of 1 or 3 channels; this input is {dtype} {} with {channels} channels (use raw)",
            self.name(),
            layout.name().to_uppercase()
        ))
    }
}

impl std::fmt::Display for Codec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// How an image tensor's bytes are encoded on the wire. Every frame is
/// encoded alone (no inter-frame prediction), because each travels on its
/// own stream and may be withdrawn or lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(tag = "codec", rename_all = "lowercase")]
pub enum Encoding {
    /// Row-major elements: `len == product(shape) * dtype.size()`.
    #[default]
    Raw,
    /// A JPEG file that decodes to exactly the tensor's shape.
    Jpeg {
        /// The encoder's quality, 1 to 100 (what the camera chose; the
        /// decoder does not need it).
        quality: u8,
    },
    /// A PNG file that decodes to exactly the tensor's shape.
    Png,
}

impl Encoding {
    /// Highest JPEG quality.
    pub const MAX_QUALITY: u8 = 100;

    /// The codec family.
    pub fn codec(self) -> Codec {
        match self {
            Encoding::Raw => Codec::Raw,
            Encoding::Jpeg { .. } => Codec::Jpeg,
            Encoding::Png => Codec::Png,
        }
    }

    /// The quality byte on the wire: the JPEG quality, 0 for the others.
    pub fn quality(self) -> u8 {
        match self {
            Encoding::Jpeg { quality } => quality,
            Encoding::Raw | Encoding::Png => 0,
        }
    }

    /// The encoding for a codec and quality byte, if they go together
    /// (JPEG: 1 to 100; raw and PNG: 0).
    pub fn from_parts(codec: Codec, quality: u8) -> Option<Self> {
        match codec {
            Codec::Raw if quality == 0 => Some(Encoding::Raw),
            Codec::Png if quality == 0 => Some(Encoding::Png),
            Codec::Jpeg if (1..=Self::MAX_QUALITY).contains(&quality) => {
                Some(Encoding::Jpeg { quality })
            }
            _ => None,
        }
    }
}

impl std::fmt::Display for Encoding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Encoding::Jpeg { quality } => write!(f, "jpeg (quality {quality})"),
            other => f.write_str(other.codec().name()),
        }
    }
}

/// A tensor: type, layout, shape and its bytes (zero-copy `Bytes`), raw or
/// encoded as an image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tensor {
    /// Element type (of the decoded tensor).
    pub dtype: DType,
    /// Memory layout (of the decoded tensor).
    pub layout: Layout,
    /// Dimensions, outermost first (of the decoded tensor).
    pub shape: Vec<u32>,
    /// How `data` is encoded.
    pub encoding: Encoding,
    /// Raw: row-major element bytes, `len == product(shape) * dtype.size()`.
    /// Otherwise one image file of at most `max_tensor_bytes` that decodes
    /// to `shape`.
    pub data: Bytes,
}

impl Tensor {
    /// Number of bytes the shape and type imply, or `None` on overflow.
    pub fn expected_len(dtype: DType, shape: &[u32]) -> Option<usize> {
        shape
            .iter()
            .try_fold(dtype.size(), |acc, &d| acc.checked_mul(d as usize))
    }

    /// A raw tensor.
    pub fn raw(dtype: DType, layout: Layout, shape: Vec<u32>, data: Bytes) -> Self {
        Tensor {
            dtype,
            layout,
            shape,
            encoding: Encoding::Raw,
            data,
        }
    }

    /// Checks the shape against `limits` and the data length against the
    /// shape and encoding.
    pub fn validate(&self, limits: &Limits) -> Result<(), TensorError> {
        if self.shape.is_empty() || self.shape.len() > limits.max_dims {
            return Err(TensorError::Dims {
                dims: self.shape.len(),
                max: limits.max_dims,
            });
        }
        check_payload(
            self.dtype,
            self.layout,
            &self.shape,
            self.encoding,
            self.data.len(),
            limits,
        )
    }
}

/// Checks a payload of `len` bytes against its decoded shape and its
/// encoding: a raw payload is exactly the shape's bytes; an encoded one
/// fits the tensor's limit, and its shape is one image (`[1,H,W,C]`, u8,
/// NHWC, C 1 or 3) no larger than the limit once decoded.
pub(crate) fn check_payload(
    dtype: DType,
    layout: Layout,
    shape: &[u32],
    encoding: Encoding,
    len: usize,
    limits: &Limits,
) -> Result<(), TensorError> {
    let max = limits.max_tensor_bytes;
    let want = Tensor::expected_len(dtype, shape)
        .filter(|&n| n <= max)
        .ok_or_else(|| TensorError::TooLarge {
            shape: shape_string(shape),
            max,
        })?;
    if encoding == Encoding::Raw {
        if want != len {
            return Err(TensorError::Length {
                shape: shape_string(shape),
                dtype,
                expected: want,
                actual: len,
            });
        }
        return Ok(());
    }
    let one_image = shape.len() == 4 && shape[0] == 1 && shape[1] > 0 && shape[2] > 0;
    let carried = if one_image {
        encoding.codec().carries(dtype, layout, shape[3])
    } else {
        Err("an encoded tensor must be one image, shaped [1,H,W,C]".into())
    };
    if let Err(why) = carried {
        return Err(TensorError::Encoding {
            shape: shape_string(shape),
            encoding,
            why,
        });
    }
    if len == 0 || len > max {
        return Err(TensorError::EncodedLength { encoding, len, max });
    }
    Ok(())
}

/// A named model output passed through to the client (the `raw` decoder's
/// result): element type, shape and bytes. Unlike [`Tensor`] it has no image
/// layout; its elements are row-major, f32 little-endian as on the wire.
///
/// In JSON it is `{"name", "dtype", "shape", "data": [numbers]}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "OutputJson", try_from = "OutputJson")]
pub struct OutputTensor {
    /// The graph output's name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Dimensions, outermost first.
    pub shape: Vec<u32>,
    /// Row-major element bytes; `len == product(shape) * dtype.size()`.
    pub data: Bytes,
}

impl OutputTensor {
    /// An f32 output from its values (row-major); `None` when the shape does
    /// not hold exactly `values.len()` elements.
    pub fn from_f32(name: impl Into<String>, shape: Vec<u32>, values: &[f32]) -> Option<Self> {
        let want = Tensor::expected_len(DType::F32, &shape)?;
        if want != values.len() * 4 {
            return None;
        }
        let data: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Some(OutputTensor {
            name: name.into(),
            dtype: DType::F32,
            shape,
            data: Bytes::from(data),
        })
    }

    /// The elements as f32 (u8 elements widened).
    pub fn values(&self) -> Vec<f32> {
        match self.dtype {
            DType::U8 => self.data.iter().map(|&b| f32::from(b)).collect(),
            DType::F32 => self
                .data
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        }
    }
}

/// The JSON form of an [`OutputTensor`]: its elements as numbers.
#[derive(Serialize, Deserialize)]
struct OutputJson {
    name: String,
    dtype: DType,
    shape: Vec<u32>,
    data: Vec<f32>,
}

impl From<OutputTensor> for OutputJson {
    fn from(t: OutputTensor) -> Self {
        OutputJson {
            data: t.values(),
            name: t.name,
            dtype: t.dtype,
            shape: t.shape,
        }
    }
}

impl TryFrom<OutputJson> for OutputTensor {
    type Error = String;

    fn try_from(j: OutputJson) -> Result<Self, String> {
        let elements = Tensor::expected_len(DType::U8, &j.shape)
            .ok_or_else(|| format!("output {:?}: shape overflows", j.name))?;
        if elements != j.data.len() {
            return Err(format!(
                "output {:?}: shape {} holds {elements} elements, data has {}",
                j.name,
                shape_string(&j.shape),
                j.data.len()
            ));
        }
        let data: Vec<u8> = match j.dtype {
            DType::F32 => j.data.iter().flat_map(|v| v.to_le_bytes()).collect(),
            DType::U8 => j
                .data
                .iter()
                .map(|&v| {
                    if v.fract() == 0.0 && (0.0..=255.0).contains(&v) {
                        Ok(v as u8)
                    } else {
                        Err(format!("output {:?}: {v} is not a u8", j.name))
                    }
                })
                .collect::<Result<_, _>>()?,
        };
        Ok(OutputTensor {
            name: j.name,
            dtype: j.dtype,
            shape: j.shape,
            data: Bytes::from(data),
        })
    }
}

/// Why a tensor is not well formed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TensorError {
    /// The number of dimensions is zero or above the limit.
    #[error("tensor has {dims} dimensions; 1 to {max} are allowed")]
    Dims {
        /// Dimensions found.
        dims: usize,
        /// The limit.
        max: usize,
    },
    /// The shape implies more bytes than allowed (or overflows).
    #[error("tensor shape {shape} exceeds the limit of {max} bytes")]
    TooLarge {
        /// The offending shape.
        shape: String,
        /// The limit in bytes.
        max: usize,
    },
    /// The payload length does not match the shape.
    #[error("tensor shape {shape} of {dtype} needs {expected} bytes, payload has {actual}")]
    Length {
        /// The declared shape.
        shape: String,
        /// The declared type.
        dtype: DType,
        /// Bytes the shape implies.
        expected: usize,
        /// Bytes present.
        actual: usize,
    },
    /// The encoding cannot carry a tensor of this shape and type.
    #[error("tensor shape {shape} cannot travel as {encoding}: {why}")]
    Encoding {
        /// The declared shape.
        shape: String,
        /// The declared encoding.
        encoding: Encoding,
        /// What the encoding carries instead.
        why: String,
    },
    /// An encoded payload is empty or over the tensor limit.
    #[error("a {encoding} payload of {len} bytes; it must be 1 to {max} bytes")]
    EncodedLength {
        /// The declared encoding.
        encoding: Encoding,
        /// Bytes present.
        len: usize,
        /// The limit.
        max: usize,
    },
}

/// Where the model-input image came from: the source frame size and the
/// rectangle of the model input that the (scaled) source occupies. With
/// stretching the content rectangle is the whole input; with letterboxing it is
/// centred with padding on two sides. Results are mapped back through it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Geometry {
    /// Source frame width in pixels.
    pub source_width: u32,
    /// Source frame height in pixels.
    pub source_height: u32,
    /// Left edge of the content inside the model input, in input pixels.
    pub content_x: u32,
    /// Top edge of the content inside the model input, in input pixels.
    pub content_y: u32,
    /// Width of the content inside the model input, in input pixels.
    pub content_width: u32,
    /// Height of the content inside the model input, in input pixels.
    pub content_height: u32,
}

impl Geometry {
    /// Bytes of a geometry on the wire: its six `u32`s.
    pub const WIRE_LEN: usize = 6 * 4;

    /// Geometry of a source stretched over the whole `width`×`height` input.
    pub fn stretch(source_width: u32, source_height: u32, width: u32, height: u32) -> Self {
        Geometry {
            source_width,
            source_height,
            content_x: 0,
            content_y: 0,
            content_width: width,
            content_height: height,
        }
    }

    /// Geometry of a source scaled to fit `width`×`height` with its aspect
    /// ratio kept, centred, padded on the short side.
    pub fn letterbox(source_width: u32, source_height: u32, width: u32, height: u32) -> Self {
        let (sw, sh) = (source_width.max(1) as u64, source_height.max(1) as u64);
        let (w, h) = (width as u64, height as u64);
        // Scale = min(w/sw, h/sh), computed in integers to stay exact.
        let (cw, ch) = if w * sh <= h * sw {
            (w, (sh * w + sw / 2) / sw)
        } else {
            ((sw * h + sh / 2) / sh, h)
        };
        let (cw, ch) = (cw.clamp(1, w) as u32, ch.clamp(1, h) as u32);
        Geometry {
            source_width,
            source_height,
            content_x: (width - cw) / 2,
            content_y: (height - ch) / 2,
            content_width: cw,
            content_height: ch,
        }
    }

    /// Maps a point given in normalised model-input coordinates (0..1 over the
    /// whole input of `width`×`height`) to source pixels.
    pub fn to_source(&self, width: u32, height: u32, nx: f32, ny: f32) -> (f32, f32) {
        let ix = nx * width as f32;
        let iy = ny * height as f32;
        let sx = (ix - self.content_x as f32) * self.source_width as f32
            / self.content_width.max(1) as f32;
        let sy = (iy - self.content_y as f32) * self.source_height as f32
            / self.content_height.max(1) as f32;
        (sx, sy)
    }

    /// [`Geometry::to_source`], clamped to the source frame: what a decoder
    /// reports for a box corner or a landmark.
    pub fn to_source_clamped(&self, width: u32, height: u32, nx: f32, ny: f32) -> (f32, f32) {
        let (x, y) = self.to_source(width, height, nx, ny);
        (
            x.clamp(0.0, self.source_width as f32),
            y.clamp(0.0, self.source_height as f32),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clamped_mapping_stays_inside_the_source() {
        let g = Geometry::letterbox(1920, 1080, 128, 128);
        // The top padding maps above the source; clamped, it is its edge.
        assert_eq!(g.to_source_clamped(128, 128, 0.0, 0.0), (0.0, 0.0));
        assert_eq!(g.to_source_clamped(128, 128, 1.0, 1.0), (1920.0, 1080.0));
        assert_eq!(
            g.to_source_clamped(128, 128, 0.5, 0.5),
            g.to_source(128, 128, 0.5, 0.5)
        );
    }

    #[test]
    fn letterbox_of_wide_source_pads_top_and_bottom() {
        let g = Geometry::letterbox(1920, 1080, 128, 128);
        assert_eq!((g.content_width, g.content_height), (128, 72));
        assert_eq!((g.content_x, g.content_y), (0, 28));
        let (x, y) = g.to_source(128, 128, 0.5, 0.5);
        assert!((x - 960.0).abs() < 1e-3 && (y - 540.0).abs() < 1e-3);
    }

    #[test]
    fn square_source_letterbox_equals_stretch() {
        assert_eq!(
            Geometry::letterbox(512, 512, 128, 128),
            Geometry::stretch(512, 512, 128, 128)
        );
    }

    #[test]
    fn length_mismatch_names_shape_and_sizes() {
        let t = Tensor::raw(
            DType::U8,
            Layout::Nhwc,
            vec![1, 64, 64, 3],
            Bytes::from_static(&[0; 10]),
        );
        let err = t.validate(&Limits::default()).unwrap_err().to_string();
        assert!(err.contains("[1,64,64,3]") && err.contains("12288") && err.contains("10"));
    }

    #[test]
    fn an_encoded_image_may_be_shorter_than_its_decoded_shape() {
        let mut t = Tensor::raw(
            DType::U8,
            Layout::Nhwc,
            vec![1, 64, 64, 3],
            Bytes::from_static(&[0xff; 10]),
        );
        t.encoding = Encoding::Jpeg { quality: 90 };
        t.validate(&Limits::default()).unwrap();
        t.encoding = Encoding::Png;
        t.validate(&Limits::default()).unwrap();
    }

    #[test]
    fn an_image_codec_refuses_what_is_not_one_u8_nhwc_image_and_says_what_to_use() {
        let mut t = Tensor::raw(
            DType::F32,
            Layout::Nchw,
            vec![1, 3, 8, 8],
            Bytes::from_static(&[0xff; 10]),
        );
        t.encoding = Encoding::Jpeg { quality: 90 };
        let err = t.validate(&Limits::default()).unwrap_err().to_string();
        assert!(
            err.contains("[1,3,8,8]") && err.contains("use raw"),
            "{err}"
        );
        let mut batch = Tensor::raw(DType::U8, Layout::Nhwc, vec![2, 8, 8, 3], Bytes::new());
        batch.encoding = Encoding::Png;
        let err = batch.validate(&Limits::default()).unwrap_err().to_string();
        assert!(err.contains("[1,H,W,C]"), "{err}");
        let mut empty = Tensor::raw(DType::U8, Layout::Nhwc, vec![1, 8, 8, 3], Bytes::new());
        empty.encoding = Encoding::Png;
        assert!(matches!(
            empty.validate(&Limits::default()),
            Err(TensorError::EncodedLength { len: 0, .. })
        ));
    }

    #[test]
    fn a_quality_goes_with_jpeg_alone() {
        for codec in Codec::ALL {
            assert_eq!(Codec::from_code(codec.code()), Some(codec));
        }
        assert_eq!(Codec::from_code(3), None);
        assert_eq!(
            Encoding::from_parts(Codec::Jpeg, 90),
            Some(Encoding::Jpeg { quality: 90 })
        );
        assert_eq!(Encoding::from_parts(Codec::Jpeg, 0), None);
        assert_eq!(Encoding::from_parts(Codec::Jpeg, 101), None);
        assert_eq!(Encoding::from_parts(Codec::Png, 1), None);
        assert_eq!(Encoding::from_parts(Codec::Raw, 0), Some(Encoding::Raw));
    }
}
