//! The KServe v2 inference protocol over HTTP with its binary tensor data
//! extension (what Triton speaks), sans IO: bodies in, bodies out.
//!
//! A body is a JSON header, then every binary tensor's bytes one after
//! another, in the order the header lists them. The HTTP header
//! `Inference-Header-Content-Length` ([`HEADER_LENGTH`]) gives the JSON
//! header's length; without it the whole body is JSON. Each binary tensor
//! says its byte count in `parameters.binary_data_size`. A client asks for
//! an output in binary with `parameters.binary_data: true` on it (or for
//! every output with the request's `binary_data_output`).
//!
//! Decoding checks every length against [`CodecLimits`] and against the
//! bytes actually there before it allocates anything sized by them; a
//! tensor's bytes are a slice of the body, not a copy. Tensors whose data
//! is a JSON array are refused with a clear error: the load generator and
//! the baseline server both send and ask for binary tensors, and a server
//! that ignores the request for binary outputs is told so.

use bytes::{Bytes, BytesMut};
use serde::{Deserialize, Serialize};

/// The HTTP header that gives the JSON header's length in bytes.
pub const HEADER_LENGTH: &str = "inference-header-content-length";

/// Bounds on what a body may declare, checked before anything is allocated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CodecLimits {
    /// Bytes of JSON header.
    pub max_header_bytes: usize,
    /// Tensors in one body.
    pub max_tensors: usize,
    /// Dimensions of one tensor.
    pub max_dims: usize,
    /// Bytes of one tensor.
    pub max_tensor_bytes: u64,
}

impl Default for CodecLimits {
    /// 64 KiB of header (a BlazeFace request's is about 200 bytes), 64
    /// tensors of at most 8 dimensions and 64 MiB each (a 2048×2048 RGB f32
    /// frame is 48 MiB).
    fn default() -> Self {
        CodecLimits {
            max_header_bytes: 64 * 1024,
            max_tensors: 64,
            max_dims: 8,
            max_tensor_bytes: 64 * 1024 * 1024,
        }
    }
}

/// A tensor element type of the protocol with a fixed size (`BYTES`, whose
/// elements are length-prefixed strings, is not supported).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DataType {
    /// `BOOL`, one byte.
    Bool,
    /// `UINT8`.
    Uint8,
    /// `UINT16`.
    Uint16,
    /// `UINT32`.
    Uint32,
    /// `UINT64`.
    Uint64,
    /// `INT8`.
    Int8,
    /// `INT16`.
    Int16,
    /// `INT32`.
    Int32,
    /// `INT64`.
    Int64,
    /// `FP16`.
    Fp16,
    /// `BF16`.
    Bf16,
    /// `FP32`.
    Fp32,
    /// `FP64`.
    Fp64,
}

impl DataType {
    const ALL: [DataType; 13] = [
        DataType::Bool,
        DataType::Uint8,
        DataType::Uint16,
        DataType::Uint32,
        DataType::Uint64,
        DataType::Int8,
        DataType::Int16,
        DataType::Int32,
        DataType::Int64,
        DataType::Fp16,
        DataType::Bf16,
        DataType::Fp32,
        DataType::Fp64,
    ];

    /// The name on the wire (`FP32`, `UINT8`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            DataType::Bool => "BOOL",
            DataType::Uint8 => "UINT8",
            DataType::Uint16 => "UINT16",
            DataType::Uint32 => "UINT32",
            DataType::Uint64 => "UINT64",
            DataType::Int8 => "INT8",
            DataType::Int16 => "INT16",
            DataType::Int32 => "INT32",
            DataType::Int64 => "INT64",
            DataType::Fp16 => "FP16",
            DataType::Bf16 => "BF16",
            DataType::Fp32 => "FP32",
            DataType::Fp64 => "FP64",
        }
    }

    /// Bytes of one element.
    pub fn size(self) -> u64 {
        match self {
            DataType::Bool | DataType::Uint8 | DataType::Int8 => 1,
            DataType::Uint16 | DataType::Int16 | DataType::Fp16 | DataType::Bf16 => 2,
            DataType::Uint32 | DataType::Int32 | DataType::Fp32 => 4,
            DataType::Uint64 | DataType::Int64 | DataType::Fp64 => 8,
        }
    }

    /// The type named `s` on the wire, if it is one with a fixed size.
    pub fn parse(s: &str) -> Option<DataType> {
        DataType::ALL.into_iter().find(|t| t.as_str() == s)
    }

    /// Bytes of a tensor of this type and `shape`; `None` when that
    /// overflows.
    pub fn bytes_for(self, shape: &[u64]) -> Option<u64> {
        shape
            .iter()
            .try_fold(self.size(), |acc, &d| acc.checked_mul(d))
    }
}

impl std::fmt::Display for DataType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A tensor as it travels: its bytes are the elements in row-major order,
/// little-endian.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tensor {
    /// The graph input's or output's name.
    pub name: String,
    /// Element type.
    pub datatype: DataType,
    /// Dimensions.
    pub shape: Vec<u64>,
    /// The elements, `datatype.size() × product(shape)` bytes.
    pub data: Bytes,
}

/// `POST /v2/models/{model}/infer`'s body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InferRequest {
    /// Echoed in the response (optional in the protocol).
    pub id: Option<String>,
    /// The inputs, each sent binary.
    pub inputs: Vec<Tensor>,
    /// The outputs asked for, each in binary; empty asks for every output
    /// (in binary, with the request's `binary_data_output`).
    pub outputs: Vec<String>,
}

/// The answer to an [`InferRequest`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InferResponse {
    /// The model that ran.
    pub model_name: String,
    /// Its version, if the server says.
    pub model_version: Option<String>,
    /// The request's `id`, if it had one.
    pub id: Option<String>,
    /// The outputs, each sent binary.
    pub outputs: Vec<Tensor>,
}

/// A body and the value of its [`HEADER_LENGTH`] header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Encoded {
    /// JSON header, then the tensors' bytes.
    pub body: Bytes,
    /// Bytes of JSON header at the start of `body`.
    pub header_len: usize,
}

/// Why a body could not be decoded. Every message names what was wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CodecError {
    /// The `Inference-Header-Content-Length` value is not a byte count.
    #[error(
        "Inference-Header-Content-Length is {value:?}, not a byte count; give the JSON header's length in bytes"
    )]
    HeaderLengthValue {
        /// The header's value.
        value: String,
    },
    /// The header length says more bytes than the body has: the body was
    /// cut short, or the length is wrong.
    #[error(
        "Inference-Header-Content-Length is {header_len} but the body has only {body_len} bytes: the body is truncated or the length is wrong"
    )]
    Truncated {
        /// The declared JSON header length.
        header_len: usize,
        /// The body's length.
        body_len: usize,
    },
    /// The JSON header is longer than [`CodecLimits::max_header_bytes`].
    #[error("the JSON header is {header_len} bytes, over the limit of {max}")]
    HeaderTooLarge {
        /// The declared JSON header length.
        header_len: usize,
        /// The limit.
        max: usize,
    },
    /// The JSON header is not JSON, or not a request or response.
    #[error("the JSON header is not a KServe v2 {what}: {message}")]
    Json {
        /// `request` or `response`.
        what: &'static str,
        /// The parser's account.
        message: String,
    },
    /// More tensors than [`CodecLimits::max_tensors`].
    #[error("{count} tensors, over the limit of {max}")]
    TooManyTensors {
        /// Tensors in the header.
        count: usize,
        /// The limit.
        max: usize,
    },
    /// A tensor with more dimensions than [`CodecLimits::max_dims`].
    #[error("tensor '{tensor}' has {dims} dimensions, over the limit of {max}")]
    TooManyDims {
        /// The tensor.
        tensor: String,
        /// Its dimensions.
        dims: usize,
        /// The limit.
        max: usize,
    },
    /// A negative dimension (allowed in model metadata, not in data).
    #[error("tensor '{tensor}' has shape {shape:?}; a tensor's dimensions must be 0 or more")]
    NegativeDim {
        /// The tensor.
        tensor: String,
        /// Its shape as sent.
        shape: Vec<i64>,
    },
    /// An element type that is not one of [`DataType`]'s.
    #[error(
        "tensor '{tensor}' has datatype {datatype:?}; use a fixed-size type (BOOL, UINT8..UINT64, INT8..INT64, FP16, BF16, FP32, FP64)"
    )]
    Datatype {
        /// The tensor.
        tensor: String,
        /// The type named.
        datatype: String,
    },
    /// A tensor without `binary_data_size`: its data is JSON, or missing.
    #[error(
        "tensor '{tensor}' is not in the binary data extension (no parameters.binary_data_size); send it binary, or ask for binary outputs (parameters.binary_data: true)"
    )]
    NotBinary {
        /// The tensor.
        tensor: String,
    },
    /// A binary size that is not what the shape and type make.
    #[error(
        "tensor '{tensor}' ({datatype} {shape:?}) declares binary_data_size {declared}; that shape and type are {expected} bytes"
    )]
    Size {
        /// The tensor.
        tensor: String,
        /// Its type.
        datatype: DataType,
        /// Its shape.
        shape: Vec<u64>,
        /// `binary_data_size`.
        declared: u64,
        /// What the shape and type make (`u64::MAX` when that overflows).
        expected: u64,
    },
    /// A tensor larger than [`CodecLimits::max_tensor_bytes`].
    #[error("tensor '{tensor}' is {bytes} bytes, over the limit of {max}")]
    TensorTooLarge {
        /// The tensor.
        tensor: String,
        /// Its size.
        bytes: u64,
        /// The limit.
        max: u64,
    },
    /// The tensors declare more bytes than follow the JSON header.
    #[error(
        "tensor '{tensor}' needs {size} bytes at offset {offset} of the binary data, which has only {available}: the body is truncated or a binary_data_size is wrong"
    )]
    PastEnd {
        /// The tensor.
        tensor: String,
        /// Where its bytes start, after the JSON header.
        offset: u64,
        /// Its declared size.
        size: u64,
        /// Bytes of binary data in the body.
        available: u64,
    },
    /// Bytes left over after the last tensor.
    #[error(
        "{extra} bytes follow the last tensor's data (the tensors declare {used} of {available}): a binary_data_size or the header length is wrong"
    )]
    Trailing {
        /// Bytes the tensors declare.
        used: u64,
        /// Bytes of binary data in the body.
        available: u64,
        /// `available - used`.
        extra: u64,
    },
}

/// The JSON header length an `Inference-Header-Content-Length` value gives.
pub fn parse_header_length(value: &str) -> Result<usize, CodecError> {
    let v = value.trim();
    if v.is_empty() || !v.bytes().all(|b| b.is_ascii_digit()) {
        return Err(CodecError::HeaderLengthValue {
            value: value.to_string(),
        });
    }
    v.parse().map_err(|_| CodecError::HeaderLengthValue {
        value: value.to_string(),
    })
}

/// A tensor's entry in a JSON header.
#[derive(Debug, Serialize, Deserialize)]
struct WireTensor {
    name: String,
    #[serde(default)]
    shape: Vec<i64>,
    datatype: String,
    /// A tensor with JSON `data` instead has no `binary_data_size`, and is
    /// refused as [`CodecError::NotBinary`].
    #[serde(default)]
    parameters: WireParameters,
}

/// A tensor's or an output request's `parameters`; other parameters are
/// kept off (servers add their own).
#[derive(Debug, Default, Serialize, Deserialize)]
struct WireParameters {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    binary_data_size: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    binary_data: Option<bool>,
}

/// An output asked for.
#[derive(Debug, Serialize, Deserialize)]
struct WireOutput {
    name: String,
    #[serde(default)]
    parameters: WireParameters,
}

/// A request's `parameters`.
#[derive(Debug, Default, Serialize, Deserialize)]
struct WireRequestParameters {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    binary_data_output: Option<bool>,
}

#[derive(Debug, Serialize, Deserialize)]
struct WireRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    id: Option<String>,
    #[serde(default, skip_serializing_if = "is_default_request_parameters")]
    parameters: WireRequestParameters,
    inputs: Vec<WireTensor>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    outputs: Vec<WireOutput>,
}

fn is_default_request_parameters(p: &WireRequestParameters) -> bool {
    p.binary_data_output.is_none()
}

#[derive(Debug, Serialize, Deserialize)]
struct WireResponse {
    model_name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    model_version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    id: Option<String>,
    outputs: Vec<WireTensor>,
}

/// The JSON header and the binary tensors after it, as one body.
fn join(header: Vec<u8>, tensors: &[Tensor]) -> Encoded {
    let header_len = header.len();
    let total = header_len + tensors.iter().map(|t| t.data.len()).sum::<usize>();
    let mut body = BytesMut::with_capacity(total);
    body.extend_from_slice(&header);
    for t in tensors {
        body.extend_from_slice(&t.data);
    }
    Encoded {
        body: body.freeze(),
        header_len,
    }
}

fn wire_tensor(t: &Tensor) -> WireTensor {
    WireTensor {
        name: t.name.clone(),
        shape: t
            .shape
            .iter()
            .map(|&d| i64::try_from(d).unwrap_or(i64::MAX))
            .collect(),
        datatype: t.datatype.as_str().to_string(),
        parameters: WireParameters {
            binary_data_size: Some(t.data.len() as u64),
            binary_data: None,
        },
    }
}

/// The JSON part of `body` and the binary part after it, checked against
/// `limits` before the JSON is parsed. `header_len` is the
/// [`HEADER_LENGTH`] header's value; `None`: the whole body is JSON.
fn split(
    body: &Bytes,
    header_len: Option<usize>,
    limits: &CodecLimits,
) -> Result<(Bytes, Bytes), CodecError> {
    let header_len = header_len.unwrap_or(body.len());
    if header_len > limits.max_header_bytes {
        return Err(CodecError::HeaderTooLarge {
            header_len,
            max: limits.max_header_bytes,
        });
    }
    if header_len > body.len() {
        return Err(CodecError::Truncated {
            header_len,
            body_len: body.len(),
        });
    }
    Ok((body.slice(..header_len), body.slice(header_len..)))
}

/// The JSON header of `body` parsed as a `what` (see [`split`]), and the
/// binary part after it.
fn parse<T: serde::de::DeserializeOwned>(
    body: &Bytes,
    header_len: Option<usize>,
    limits: &CodecLimits,
    what: &'static str,
) -> Result<(T, Bytes), CodecError> {
    let (json, binary) = split(body, header_len, limits)?;
    let wire = serde_json::from_slice(&json).map_err(|e| CodecError::Json {
        what,
        message: e.to_string(),
    })?;
    Ok((wire, binary))
}

/// The tensors a header lists, each a slice of `binary` in order, checked
/// against `limits` and against the bytes there.
fn take_tensors(
    wire: Vec<WireTensor>,
    binary: &Bytes,
    limits: &CodecLimits,
) -> Result<Vec<Tensor>, CodecError> {
    if wire.len() > limits.max_tensors {
        return Err(CodecError::TooManyTensors {
            count: wire.len(),
            max: limits.max_tensors,
        });
    }
    let available = binary.len() as u64;
    let mut offset = 0u64;
    let mut tensors = Vec::with_capacity(wire.len());
    for w in wire {
        if w.shape.len() > limits.max_dims {
            return Err(CodecError::TooManyDims {
                tensor: w.name,
                dims: w.shape.len(),
                max: limits.max_dims,
            });
        }
        let Some(datatype) = DataType::parse(&w.datatype) else {
            return Err(CodecError::Datatype {
                tensor: w.name,
                datatype: w.datatype,
            });
        };
        if w.shape.iter().any(|&d| d < 0) {
            return Err(CodecError::NegativeDim {
                tensor: w.name,
                shape: w.shape,
            });
        }
        let shape: Vec<u64> = w.shape.iter().map(|&d| d as u64).collect();
        let Some(size) = w.parameters.binary_data_size else {
            return Err(CodecError::NotBinary { tensor: w.name });
        };
        let expected = datatype.bytes_for(&shape);
        if expected != Some(size) {
            return Err(CodecError::Size {
                tensor: w.name,
                datatype,
                shape,
                declared: size,
                expected: expected.unwrap_or(u64::MAX),
            });
        }
        if size > limits.max_tensor_bytes {
            return Err(CodecError::TensorTooLarge {
                tensor: w.name,
                bytes: size,
                max: limits.max_tensor_bytes,
            });
        }
        if size > available - offset {
            return Err(CodecError::PastEnd {
                tensor: w.name,
                offset,
                size,
                available,
            });
        }
        let data = binary.slice(offset as usize..(offset + size) as usize);
        offset += size;
        tensors.push(Tensor {
            name: w.name,
            datatype,
            shape,
            data,
        });
    }
    if offset != available {
        return Err(CodecError::Trailing {
            used: offset,
            available,
            extra: available - offset,
        });
    }
    Ok(tensors)
}

impl InferRequest {
    /// The body: every input binary, every output asked for in binary.
    pub fn encode(&self) -> Encoded {
        let wire = WireRequest {
            id: self.id.clone(),
            parameters: WireRequestParameters {
                binary_data_output: self.outputs.is_empty().then_some(true),
            },
            inputs: self.inputs.iter().map(wire_tensor).collect(),
            outputs: self
                .outputs
                .iter()
                .map(|name| WireOutput {
                    name: name.clone(),
                    parameters: WireParameters {
                        binary_data_size: None,
                        binary_data: Some(true),
                    },
                })
                .collect(),
        };
        let header = serde_json::to_vec(&wire).expect("a request serialises");
        join(header, &self.inputs)
    }

    /// Reads a request body; `header_len` is its [`HEADER_LENGTH`] header
    /// (`None`: the body is all JSON, so it has no binary input).
    pub fn decode(
        body: &Bytes,
        header_len: Option<usize>,
        limits: &CodecLimits,
    ) -> Result<Self, CodecError> {
        let (wire, binary): (WireRequest, _) = parse(body, header_len, limits, "request")?;
        if wire.outputs.len() > limits.max_tensors {
            return Err(CodecError::TooManyTensors {
                count: wire.outputs.len(),
                max: limits.max_tensors,
            });
        }
        Ok(InferRequest {
            id: wire.id,
            inputs: take_tensors(wire.inputs, &binary, limits)?,
            outputs: wire.outputs.into_iter().map(|o| o.name).collect(),
        })
    }
}

impl InferResponse {
    /// The body: every output binary.
    pub fn encode(&self) -> Encoded {
        let wire = WireResponse {
            model_name: self.model_name.clone(),
            model_version: self.model_version.clone(),
            id: self.id.clone(),
            outputs: self.outputs.iter().map(wire_tensor).collect(),
        };
        let header = serde_json::to_vec(&wire).expect("a response serialises");
        join(header, &self.outputs)
    }

    /// Reads a response body; `header_len` is its [`HEADER_LENGTH`]
    /// header (`None`: the body is all JSON).
    pub fn decode(
        body: &Bytes,
        header_len: Option<usize>,
        limits: &CodecLimits,
    ) -> Result<Self, CodecError> {
        let (wire, binary): (WireResponse, _) = parse(body, header_len, limits, "response")?;
        Ok(InferResponse {
            model_name: wire.model_name,
            model_version: wire.model_version,
            id: wire.id,
            outputs: take_tensors(wire.outputs, &binary, limits)?,
        })
    }
}

/// A tensor of a model's metadata: `-1` marks a dimension that varies.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorMetadata {
    /// The tensor's name.
    pub name: String,
    /// Its element type's wire name.
    pub datatype: String,
    /// Its shape, `-1` where it varies.
    pub shape: Vec<i64>,
}

impl TensorMetadata {
    /// Whether `t` is of this type and shape (`-1` matching any size).
    pub fn admits(&self, t: &Tensor) -> bool {
        self.datatype == t.datatype.as_str()
            && self.shape.len() == t.shape.len()
            && self
                .shape
                .iter()
                .zip(&t.shape)
                .all(|(&want, &got)| want < 0 || want as u64 == got)
    }
}

/// `GET /v2/models/{model}`'s answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelMetadata {
    /// The model's name.
    pub name: String,
    /// Its versions.
    #[serde(default)]
    pub versions: Vec<String>,
    /// What runs it (`onnxruntime_onnx` on Triton).
    #[serde(default)]
    pub platform: String,
    /// Its inputs.
    #[serde(default)]
    pub inputs: Vec<TensorMetadata>,
    /// Its outputs.
    #[serde(default)]
    pub outputs: Vec<TensorMetadata>,
}

/// `GET /v2`'s answer: the server's name and version.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerMetadata {
    /// The server's name (`triton` for Triton).
    pub name: String,
    /// Its version.
    #[serde(default)]
    pub version: String,
    /// The protocol extensions it supports.
    #[serde(default)]
    pub extensions: Vec<String>,
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn tensor(name: &str, datatype: DataType, shape: &[u64]) -> Tensor {
        let len = datatype.bytes_for(shape).unwrap() as usize;
        Tensor {
            name: name.into(),
            datatype,
            shape: shape.to_vec(),
            data: Bytes::from((0..len).map(|i| (i * 7 + 3) as u8).collect::<Vec<_>>()),
        }
    }

    fn frame_request() -> InferRequest {
        InferRequest {
            id: Some("cam0-7".into()),
            inputs: vec![tensor("input:0", DataType::Uint8, &[1, 4, 4, 3])],
            outputs: vec!["Identity:0".into(), "Identity_1:0".into()],
        }
    }

    #[test]
    fn a_request_reads_as_the_protocol_spells_it() {
        let e = frame_request().encode();
        let json: serde_json::Value = serde_json::from_slice(&e.body[..e.header_len]).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "id": "cam0-7",
                "inputs": [{"name": "input:0", "shape": [1, 4, 4, 3], "datatype": "UINT8",
                            "parameters": {"binary_data_size": 48}}],
                "outputs": [{"name": "Identity:0", "parameters": {"binary_data": true}},
                            {"name": "Identity_1:0", "parameters": {"binary_data": true}}],
            })
        );
        assert_eq!(e.body.len(), e.header_len + 48);
        // No outputs named: every output, in binary.
        let all = InferRequest {
            outputs: Vec::new(),
            ..frame_request()
        }
        .encode();
        let json: serde_json::Value = serde_json::from_slice(&all.body[..all.header_len]).unwrap();
        assert_eq!(json["parameters"]["binary_data_output"], true);
        assert!(json.get("outputs").is_none());
    }

    #[test]
    fn a_response_as_triton_writes_it_decodes() {
        // A Triton-style response: extra parameters and fields are ignored.
        let header = br#"{"model_name":"blazeface","model_version":"1","outputs":[{"name":"Identity:0","datatype":"FP32","shape":[1,2,1],"parameters":{"binary_data_size":8}}],"parameters":{"sequence_id":0}}"#;
        let mut body = header.to_vec();
        body.extend_from_slice(&1.5f32.to_le_bytes());
        body.extend_from_slice(&(-2.0f32).to_le_bytes());
        let r = InferResponse::decode(
            &Bytes::from(body),
            Some(header.len()),
            &CodecLimits::default(),
        )
        .unwrap();
        assert_eq!(r.model_name, "blazeface");
        assert_eq!(r.model_version.as_deref(), Some("1"));
        assert_eq!(r.outputs.len(), 1);
        assert_eq!(r.outputs[0].shape, [1, 2, 1]);
        assert_eq!(&r.outputs[0].data[..4], &1.5f32.to_le_bytes());
    }

    #[test]
    fn a_truncated_body_is_refused_naming_both_lengths() {
        let e = frame_request().encode();
        let limits = CodecLimits::default();
        // The header length past the end of the body.
        let short = e.body.slice(..e.header_len - 1);
        let err = InferRequest::decode(&short, Some(e.header_len), &limits).unwrap_err();
        assert_eq!(
            err,
            CodecError::Truncated {
                header_len: e.header_len,
                body_len: e.header_len - 1
            }
        );
        assert!(err.to_string().contains("truncated"), "{err}");
        // The binary part cut short.
        let cut = e.body.slice(..e.body.len() - 1);
        let err = InferRequest::decode(&cut, Some(e.header_len), &limits).unwrap_err();
        assert!(
            matches!(&err, CodecError::PastEnd { tensor, size: 48, available: 47, .. } if tensor == "input:0"),
            "{err}"
        );
        // A byte too many.
        let mut long = e.body.to_vec();
        long.push(0);
        let err =
            InferRequest::decode(&Bytes::from(long), Some(e.header_len), &limits).unwrap_err();
        assert!(
            matches!(err, CodecError::Trailing { extra: 1, .. }),
            "{err}"
        );
        // The header length pointing into the JSON.
        let err = InferRequest::decode(&e.body, Some(e.header_len - 2), &limits).unwrap_err();
        assert!(matches!(err, CodecError::Json { .. }), "{err}");
    }

    #[test]
    fn an_oversize_header_is_refused_before_it_is_parsed() {
        let limits = CodecLimits {
            max_header_bytes: 16,
            ..CodecLimits::default()
        };
        let e = frame_request().encode();
        let err = InferRequest::decode(&e.body, Some(e.header_len), &limits).unwrap_err();
        assert_eq!(
            err,
            CodecError::HeaderTooLarge {
                header_len: e.header_len,
                max: 16
            }
        );
        // A declared length beyond the limit is refused as such, even when
        // the body is shorter still.
        let err = InferRequest::decode(&Bytes::from_static(b"{}"), Some(usize::MAX), &limits)
            .unwrap_err();
        assert!(matches!(err, CodecError::HeaderTooLarge { .. }), "{err}");
        // Without the header length the body is all JSON: the limit holds.
        let err = InferRequest::decode(&e.body, None, &limits).unwrap_err();
        assert!(matches!(err, CodecError::HeaderTooLarge { .. }), "{err}");
    }

    #[test]
    fn a_size_that_disagrees_with_the_shape_is_refused_naming_the_tensor() {
        let header = br#"{"inputs":[{"name":"x","shape":[1,2],"datatype":"FP32","parameters":{"binary_data_size":4}}]}"#;
        let mut body = header.to_vec();
        body.extend_from_slice(&[0; 4]);
        let err = InferRequest::decode(
            &Bytes::from(body),
            Some(header.len()),
            &CodecLimits::default(),
        )
        .unwrap_err();
        assert!(
            matches!(&err, CodecError::Size { tensor, declared: 4, expected: 8, .. } if tensor == "x"),
            "{err}"
        );
        assert!(err.to_string().contains("'x'"), "{err}");
    }

    #[test]
    fn json_data_bytes_and_negative_dims_are_refused_with_what_to_do() {
        let limits = CodecLimits::default();
        let cases: [(&[u8], &str); 4] = [
            (
                br#"{"outputs":[{"name":"y","shape":[2],"datatype":"FP32","data":[1.0,2.0]}],"model_name":"m"}"#,
                "binary_data: true",
            ),
            (
                br#"{"outputs":[{"name":"y","shape":[1],"datatype":"BYTES","parameters":{"binary_data_size":5}}],"model_name":"m"}"#,
                "fixed-size",
            ),
            (
                br#"{"outputs":[{"name":"y","shape":[-1],"datatype":"FP32","parameters":{"binary_data_size":0}}],"model_name":"m"}"#,
                "0 or more",
            ),
            (br#"{"outputs":"#, "not a KServe v2 response"),
        ];
        for (header, want) in cases {
            let err =
                InferResponse::decode(&Bytes::from_static(header), None, &limits).unwrap_err();
            assert!(err.to_string().contains(want), "{want}: {err}");
        }
    }

    #[test]
    fn header_length_values_are_byte_counts() {
        assert_eq!(parse_header_length("123"), Ok(123));
        assert_eq!(parse_header_length(" 7 "), Ok(7));
        for bad in ["", "-1", "12a", "1e3", "99999999999999999999999"] {
            let err = parse_header_length(bad).unwrap_err();
            assert!(err.to_string().contains("byte count"), "{bad}: {err}");
        }
    }

    #[test]
    fn metadata_shapes_admit_any_size_where_they_say_minus_one() {
        let m = TensorMetadata {
            name: "Identity:0".into(),
            datatype: "FP32".into(),
            shape: vec![-1, 512, 1],
        };
        assert!(m.admits(&tensor("Identity:0", DataType::Fp32, &[1, 512, 1])));
        assert!(!m.admits(&tensor("Identity:0", DataType::Fp32, &[1, 384, 1])));
        assert!(!m.admits(&tensor("Identity:0", DataType::Fp64, &[1, 512, 1])));
        assert!(!m.admits(&tensor("Identity:0", DataType::Fp32, &[512, 1])));
    }

    fn any_datatype() -> impl Strategy<Value = DataType> {
        prop::sample::select(DataType::ALL.to_vec())
    }

    fn any_tensor() -> impl Strategy<Value = Tensor> {
        (
            "[a-zA-Z_:0-9]{1,12}",
            any_datatype(),
            prop::collection::vec(0u64..5, 0..4),
            any::<u8>(),
        )
            .prop_map(|(name, datatype, shape, fill)| {
                let len = datatype.bytes_for(&shape).unwrap() as usize;
                Tensor {
                    name,
                    datatype,
                    shape,
                    data: Bytes::from(vec![fill; len]),
                }
            })
    }

    proptest! {
        #[test]
        fn requests_round_trip(
            id in proptest::option::of("[ -~]{0,16}"),
            inputs in prop::collection::vec(any_tensor(), 0..4),
            outputs in prop::collection::vec("[a-z:0-9]{1,8}", 0..4),
        ) {
            let r = InferRequest { id, inputs, outputs };
            let e = r.encode();
            let back = InferRequest::decode(&e.body, Some(e.header_len), &CodecLimits::default());
            prop_assert_eq!(back, Ok(r));
        }

        #[test]
        fn responses_round_trip(
            model_name in "[a-z]{1,8}",
            model_version in proptest::option::of("[0-9]{1,3}"),
            id in proptest::option::of("[ -~]{0,16}"),
            outputs in prop::collection::vec(any_tensor(), 0..5),
        ) {
            let r = InferResponse { model_name, model_version, id, outputs };
            let e = r.encode();
            let back = InferResponse::decode(&e.body, Some(e.header_len), &CodecLimits::default());
            prop_assert_eq!(back, Ok(r));
        }

        #[test]
        fn every_cut_of_a_body_is_refused_never_misread(cut in 0usize..4096) {
            let e = frame_request().encode();
            let cut = cut % e.body.len();
            let short = e.body.slice(..cut);
            prop_assert!(InferRequest::decode(&short, Some(e.header_len), &CodecLimits::default()).is_err());
        }

        #[test]
        fn arbitrary_bytes_never_panic(
            body in prop::collection::vec(any::<u8>(), 0..256),
            header_len in proptest::option::of(0usize..300),
        ) {
            let body = Bytes::from(body);
            let limits = CodecLimits::default();
            // What decodes encodes back to a body that decodes the same.
            if let Ok(r) = InferRequest::decode(&body, header_len, &limits) {
                let e = r.encode();
                prop_assert_eq!(InferRequest::decode(&e.body, Some(e.header_len), &limits), Ok(r));
            }
            if let Ok(r) = InferResponse::decode(&body, header_len, &limits) {
                let e = r.encode();
                prop_assert_eq!(InferResponse::decode(&e.body, Some(e.header_len), &limits), Ok(r));
            }
        }
    }
}
