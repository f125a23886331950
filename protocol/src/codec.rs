//! Framing and primitive encodings.
//!
//! Every message is `header (8 bytes) + body`:
//!
//! ```text
//! 0      2        3      4              8
//! +------+--------+------+--------------+----------------------+
//! | "TG" | version| kind | body length  | body (length bytes)  |
//! +------+--------+------+--------------+----------------------+
//! ```
//!
//! Integers are big-endian. The body length is checked against [`Limits`]
//! before any body byte is read or allocated.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::limits::Limits;
use crate::tensor::{
    Codec, DType, Encoding, Geometry, Layout, OutputTensor, Tensor, TensorError, check_payload,
};

/// The two bytes every message starts with.
pub const MAGIC: [u8; 2] = *b"TG";
/// The protocol version this crate speaks.
pub const VERSION: u8 = 3;

/// The message kinds, with their wire values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Kind {
    /// [`crate::Hello`]
    Hello = 1,
    /// [`crate::Welcome`]
    Welcome = 2,
    /// [`crate::ErrorMsg`]
    Error = 3,
    /// [`crate::CameraOpen`]
    CameraOpen = 4,
    /// [`crate::CameraAccepted`]
    CameraAccepted = 5,
    /// [`crate::Frame`]
    Frame = 6,
    /// [`crate::FrameResult`]
    Result = 7,
    /// [`crate::ControlHint`]
    ControlHint = 8,
    /// [`crate::LatencyReport`]
    LatencyReport = 9,
    /// [`crate::Register`]
    Register = 10,
    /// [`crate::Heartbeat`]
    Heartbeat = 11,
    /// [`crate::Dispatch`]
    Dispatch = 12,
    /// [`crate::BatchResult`]
    BatchResult = 13,
    /// [`crate::Drain`]
    Drain = 14,
    /// [`crate::ClockProbe`]
    ClockProbe = 15,
    /// [`crate::ClockEcho`]
    ClockEcho = 16,
}

impl Kind {
    /// The kind for a wire value.
    pub fn from_u8(v: u8) -> Option<Kind> {
        use Kind::*;
        Some(match v {
            1 => Hello,
            2 => Welcome,
            3 => Error,
            4 => CameraOpen,
            5 => CameraAccepted,
            6 => Frame,
            7 => Result,
            8 => ControlHint,
            9 => LatencyReport,
            10 => Register,
            11 => Heartbeat,
            12 => Dispatch,
            13 => BatchResult,
            14 => Drain,
            15 => ClockProbe,
            16 => ClockEcho,
            _ => return None,
        })
    }

    /// Whether this kind carries tensor payloads (and so a larger size
    /// limit): frames and dispatches their inputs, results their `raw`
    /// outputs.
    pub fn carries_tensors(self) -> bool {
        matches!(
            self,
            Kind::Frame | Kind::Dispatch | Kind::Result | Kind::BatchResult
        )
    }

    /// Largest body this kind may have under `limits`.
    pub fn max_body(self, limits: &Limits) -> usize {
        if self.carries_tensors() {
            limits
                .max_header_bytes
                .saturating_add(limits.max_tensor_bytes)
        } else {
            limits.max_header_bytes
        }
    }
}

/// A parsed message header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// What the body is.
    pub kind: Kind,
    /// Body length in bytes.
    pub len: usize,
}

impl Header {
    /// Encoded size of a header.
    pub const LEN: usize = 8;

    /// Parses and checks a header from the front of `src` without consuming
    /// it. Fails with [`DecodeError::Incomplete`] when fewer than 8 bytes are
    /// there, and with a malformed error when the magic, version or kind is
    /// wrong or the body would exceed `limits`.
    pub fn peek(src: &[u8], limits: &Limits) -> Result<Header, DecodeError> {
        if src.len() < Self::LEN {
            return Err(DecodeError::Incomplete {
                needed: Self::LEN - src.len(),
            });
        }
        if src[0..2] != MAGIC {
            return Err(DecodeError::BadMagic([src[0], src[1]]));
        }
        if src[2] != VERSION {
            return Err(DecodeError::UnsupportedVersion(src[2]));
        }
        let kind = Kind::from_u8(src[3]).ok_or(DecodeError::UnknownKind(src[3]))?;
        let len = u32::from_be_bytes([src[4], src[5], src[6], src[7]]) as usize;
        let max = kind.max_body(limits);
        if len > max {
            return Err(DecodeError::TooLarge {
                what: "message body",
                len,
                max,
            });
        }
        Ok(Header { kind, len })
    }

    /// Writes a header.
    pub fn encode(&self, dst: &mut impl BufMut) {
        dst.put_slice(&MAGIC);
        dst.put_u8(VERSION);
        dst.put_u8(self.kind as u8);
        dst.put_u32(self.len as u32);
    }
}

/// Why bytes did not decode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// Not an error in the bytes: at least `needed` more bytes are required.
    #[error("incomplete message: {needed} more bytes needed")]
    Incomplete {
        /// Minimum number of further bytes before decoding can progress.
        needed: usize,
    },
    /// The message does not start with "TG".
    #[error("bad magic {0:02x?}: not a tidegate message (expected \"TG\")")]
    BadMagic([u8; 2]),
    /// A protocol version this build does not speak.
    #[error("unsupported protocol version {0}; this build speaks version {VERSION}")]
    UnsupportedVersion(u8),
    /// An unknown message kind.
    #[error("unknown message kind {0}")]
    UnknownKind(u8),
    /// A length field exceeds its limit.
    #[error("{what} of {len} bytes/items exceeds the limit of {max}")]
    TooLarge {
        /// Which field.
        what: &'static str,
        /// The declared length or count.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The body ended before a field was complete.
    #[error("truncated message: body ends inside {what}")]
    Truncated {
        /// The field being read.
        what: &'static str,
    },
    /// A field holds a value that is not allowed.
    #[error("invalid {what}: {detail}")]
    Invalid {
        /// Which field.
        what: &'static str,
        /// What was wrong.
        detail: String,
    },
    /// Bytes were left over after the last field.
    #[error("{0} unexpected bytes after the end of the message")]
    TrailingBytes(usize),
    /// A tensor whose payload does not match its shape.
    #[error(transparent)]
    Tensor(#[from] TensorError),
}

impl DecodeError {
    /// True when more bytes may complete the message (not malformed).
    pub fn is_incomplete(&self) -> bool {
        matches!(self, DecodeError::Incomplete { .. })
    }

    /// The protocol error code this error is answered with (one table, used
    /// by every component; see docs/protocol.md).
    pub fn code(&self) -> crate::ErrorCode {
        use crate::ErrorCode;
        match self {
            DecodeError::UnsupportedVersion(_) => ErrorCode::UnsupportedVersion,
            DecodeError::TooLarge { .. } => ErrorCode::TooLarge,
            DecodeError::Tensor(TensorError::TooLarge { .. }) => ErrorCode::TooLarge,
            DecodeError::Tensor(TensorError::EncodedLength { len, max, .. }) if len > max => {
                ErrorCode::TooLarge
            }
            _ => ErrorCode::Malformed,
        }
    }
}

/// Reads primitive fields from a message body. Strings and lists are bounded
/// by [`Limits`] before anything is allocated; a field running past the end
/// of the body is [`DecodeError::Truncated`].
#[derive(Debug)]
pub struct Reader<'l> {
    body: Bytes,
    limits: &'l Limits,
    /// Tensor metadata read so far, whose payloads follow all metadata.
    pending: Vec<Pending>,
    /// The sum of `pending`'s payload lengths, kept as they are read so
    /// that checking it stays constant-time: a `BatchResult` may list
    /// 256 × 1024 empty outputs, and summing the list for each of them
    /// would take minutes.
    pending_bytes: usize,
}

/// The metadata of a tensor whose payload is still to be claimed.
#[derive(Debug)]
struct Pending {
    dtype: DType,
    shape: Vec<u32>,
    len: usize,
    what: PendingKind,
}

/// An image tensor (with a layout and an encoding) or a named output tensor.
#[derive(Debug)]
enum PendingKind {
    Image(Layout, Encoding),
    Output(String),
}

impl<'l> Reader<'l> {
    /// Wraps a complete body.
    pub fn new(body: Bytes, limits: &'l Limits) -> Self {
        Reader {
            body,
            limits,
            pending: Vec::new(),
            pending_bytes: 0,
        }
    }

    /// The limits in force.
    pub fn limits(&self) -> &Limits {
        self.limits
    }

    fn need(&self, n: usize, what: &'static str) -> Result<(), DecodeError> {
        if self.body.remaining() < n {
            Err(DecodeError::Truncated { what })
        } else {
            Ok(())
        }
    }

    /// A `u8`.
    pub fn u8(&mut self, what: &'static str) -> Result<u8, DecodeError> {
        self.need(1, what)?;
        Ok(self.body.get_u8())
    }

    /// A big-endian `u16`.
    pub fn u16(&mut self, what: &'static str) -> Result<u16, DecodeError> {
        self.need(2, what)?;
        Ok(self.body.get_u16())
    }

    /// A big-endian `u32`.
    pub fn u32(&mut self, what: &'static str) -> Result<u32, DecodeError> {
        self.need(4, what)?;
        Ok(self.body.get_u32())
    }

    /// A big-endian `u64`.
    pub fn u64(&mut self, what: &'static str) -> Result<u64, DecodeError> {
        self.need(8, what)?;
        Ok(self.body.get_u64())
    }

    /// A big-endian IEEE-754 `f32`; NaN and infinities are rejected.
    pub fn f32(&mut self, what: &'static str) -> Result<f32, DecodeError> {
        self.need(4, what)?;
        let v = self.body.get_f32();
        if !v.is_finite() {
            return Err(DecodeError::Invalid {
                what,
                detail: format!("{v} is not a finite number"),
            });
        }
        Ok(v)
    }

    /// A string: `u16` length, then UTF-8 bytes.
    pub fn string(&mut self, what: &'static str) -> Result<String, DecodeError> {
        let len = self.u16(what)? as usize;
        if len > self.limits.max_string_bytes {
            return Err(DecodeError::TooLarge {
                what,
                len,
                max: self.limits.max_string_bytes,
            });
        }
        self.need(len, what)?;
        let raw = self.body.split_to(len);
        String::from_utf8(raw.to_vec()).map_err(|_| DecodeError::Invalid {
            what,
            detail: "not valid UTF-8".into(),
        })
    }

    /// A list count (`u16`), checked against `max` and against the bytes left
    /// (each item takes at least `min_item_bytes`), so a hostile count cannot
    /// make the caller allocate.
    pub fn count(
        &mut self,
        what: &'static str,
        max: usize,
        min_item_bytes: usize,
    ) -> Result<usize, DecodeError> {
        let n = self.u16(what)? as usize;
        if n > max {
            return Err(DecodeError::TooLarge { what, len: n, max });
        }
        if n.saturating_mul(min_item_bytes) > self.body.remaining() {
            return Err(DecodeError::Truncated { what });
        }
        Ok(n)
    }

    /// Frame geometry: six `u32`s.
    pub fn geometry(&mut self) -> Result<Geometry, DecodeError> {
        let what = "geometry";
        let g = Geometry {
            source_width: self.u32(what)?,
            source_height: self.u32(what)?,
            content_x: self.u32(what)?,
            content_y: self.u32(what)?,
            content_width: self.u32(what)?,
            content_height: self.u32(what)?,
        };
        Ok(g)
    }

    /// Tensor metadata (dtype, layout, encoding, dims, payload length). The
    /// payload is claimed later by [`Reader::finish_tensors`], in the same
    /// order.
    pub fn tensor_meta(&mut self) -> Result<(), DecodeError> {
        let dtype = self.dtype("tensor dtype")?;
        let layout_code = self.u8("tensor layout")?;
        let layout = Layout::from_code(layout_code).ok_or_else(|| DecodeError::Invalid {
            what: "tensor layout",
            detail: format!("unknown code {layout_code}"),
        })?;
        let encoding = self.encoding("tensor encoding")?;
        self.payload_meta(dtype, PendingKind::Image(layout, encoding))?;
        Ok(())
    }

    /// An encoding: its codec code, then its quality byte (JPEG: 1 to 100;
    /// the others: 0).
    pub fn encoding(&mut self, what: &'static str) -> Result<Encoding, DecodeError> {
        let code = self.u8(what)?;
        let quality = self.u8(what)?;
        let codec = Codec::from_code(code).ok_or_else(|| DecodeError::Invalid {
            what,
            detail: format!("unknown codec {code}"),
        })?;
        Encoding::from_parts(codec, quality).ok_or_else(|| DecodeError::Invalid {
            what,
            detail: format!("{codec} with quality {quality} (JPEG takes 1 to 100, the others 0)"),
        })
    }

    /// Output-tensor metadata (name, dtype, dims, payload length); returns
    /// the payload length. The payload is claimed later by
    /// [`Reader::finish_outputs`], in the same order.
    pub fn output_meta(&mut self) -> Result<usize, DecodeError> {
        let name = self.string("output name")?;
        let dtype = self.dtype("output dtype")?;
        self.payload_meta(dtype, PendingKind::Output(name))
    }

    fn dtype(&mut self, what: &'static str) -> Result<DType, DecodeError> {
        let code = self.u8(what)?;
        DType::from_code(code).ok_or_else(|| DecodeError::Invalid {
            what,
            detail: format!("unknown code {code}"),
        })
    }

    /// Dims and payload length, checked against the limits and each other.
    fn payload_meta(&mut self, dtype: DType, what: PendingKind) -> Result<usize, DecodeError> {
        let ndims = self.u8("tensor dims")? as usize;
        if ndims == 0 || ndims > self.limits.max_dims {
            return Err(TensorError::Dims {
                dims: ndims,
                max: self.limits.max_dims,
            }
            .into());
        }
        self.need(ndims * 4, "tensor dims")?;
        let shape: Vec<u32> = (0..ndims).map(|_| self.body.get_u32()).collect();
        let len = self.u32("tensor length")? as usize;
        let max = self.limits.max_tensor_bytes;
        let (layout, encoding) = match &what {
            PendingKind::Image(layout, encoding) => (*layout, *encoding),
            PendingKind::Output(_) => (Layout::Nhwc, Encoding::Raw),
        };
        check_payload(dtype, layout, &shape, encoding, len, self.limits)?;
        // Both are at most `max`, so the sum cannot overflow.
        let total = self.pending_bytes + len;
        if total > max {
            return Err(DecodeError::TooLarge {
                what: "tensor payloads",
                len: total,
                max,
            });
        }
        self.pending.push(Pending {
            dtype,
            shape,
            len,
            what,
        });
        self.pending_bytes = total;
        Ok(len)
    }

    /// Claims every pending payload, in order, as zero-copy slices of the
    /// body. The payloads must be exactly the rest of the body.
    fn take_payloads(&mut self) -> Result<Vec<(Pending, Bytes)>, DecodeError> {
        let total = self.pending_bytes;
        let left = self.body.remaining();
        if left < total {
            return Err(DecodeError::Truncated {
                what: "tensor payload",
            });
        }
        if left > total {
            return Err(DecodeError::TrailingBytes(left - total));
        }
        let pending = std::mem::take(&mut self.pending);
        self.pending_bytes = 0;
        Ok(pending
            .into_iter()
            .map(|p| {
                let data = self.body.split_to(p.len);
                (p, data)
            })
            .collect())
    }

    /// Claims the payloads of every tensor whose metadata was read by
    /// [`Reader::tensor_meta`], in order, as zero-copy slices of the body.
    /// The payloads must be exactly the rest of the body.
    pub fn finish_tensors(&mut self) -> Result<Vec<Tensor>, DecodeError> {
        self.take_payloads()?
            .into_iter()
            .map(|(p, data)| match p.what {
                PendingKind::Image(layout, encoding) => Ok(Tensor {
                    dtype: p.dtype,
                    layout,
                    shape: p.shape,
                    encoding,
                    data,
                }),
                PendingKind::Output(_) => Err(mixed()),
            })
            .collect()
    }

    /// Claims the payloads of every output whose metadata was read by
    /// [`Reader::output_meta`], like [`Reader::finish_tensors`].
    pub fn finish_outputs(&mut self) -> Result<Vec<OutputTensor>, DecodeError> {
        self.take_payloads()?
            .into_iter()
            .map(|(p, data)| match p.what {
                PendingKind::Output(name) => Ok(OutputTensor {
                    name,
                    dtype: p.dtype,
                    shape: p.shape,
                    data,
                }),
                PendingKind::Image(..) => Err(mixed()),
            })
            .collect()
    }

    /// Checks that the whole body was consumed.
    pub fn end(self) -> Result<(), DecodeError> {
        match self.body.remaining() {
            0 => Ok(()),
            n => Err(DecodeError::TrailingBytes(n)),
        }
    }
}

/// A message decoder asked for image tensors and output tensors at once
/// (no message kind has both).
fn mixed() -> DecodeError {
    DecodeError::Invalid {
        what: "tensor",
        detail: "image and output tensors mixed in one message".into(),
    }
}

/// Writes primitive fields into a message body. Tensor payloads are kept
/// aside as `Bytes` so that they can be sent without copying.
#[derive(Debug, Default)]
pub struct Writer {
    meta: BytesMut,
    payloads: Vec<Bytes>,
}

impl Writer {
    /// A `u8`.
    pub fn u8(&mut self, v: u8) {
        self.meta.put_u8(v);
    }
    /// A `u16`.
    pub fn u16(&mut self, v: u16) {
        self.meta.put_u16(v);
    }
    /// A `u32`.
    pub fn u32(&mut self, v: u32) {
        self.meta.put_u32(v);
    }
    /// A `u64`.
    pub fn u64(&mut self, v: u64) {
        self.meta.put_u64(v);
    }
    /// An `f32`.
    pub fn f32(&mut self, v: f32) {
        self.meta.put_f32(v);
    }
    /// A string; longer than 65535 bytes is truncated at a char boundary
    /// (the peer's limit rejects long strings anyway).
    pub fn string(&mut self, s: &str) {
        let mut end = s.len().min(u16::MAX as usize);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        self.meta.put_u16(end as u16);
        self.meta.put_slice(&s.as_bytes()[..end]);
    }
    /// A list count.
    pub fn count(&mut self, n: usize) {
        self.meta.put_u16(n.min(u16::MAX as usize) as u16);
    }
    /// Frame geometry.
    pub fn geometry(&mut self, g: &Geometry) {
        for v in [
            g.source_width,
            g.source_height,
            g.content_x,
            g.content_y,
            g.content_width,
            g.content_height,
        ] {
            self.u32(v);
        }
    }
    /// Tensor metadata now, payload after all metadata.
    pub fn tensor(&mut self, t: &Tensor) {
        self.u8(t.dtype.code());
        self.u8(t.layout.code());
        self.encoding(t.encoding);
        self.u8(t.shape.len().min(u8::MAX as usize) as u8);
        for &d in t.shape.iter().take(u8::MAX as usize) {
            self.u32(d);
        }
        self.u32(t.data.len() as u32);
        self.payloads.push(t.data.clone());
    }

    /// An encoding: codec code, then quality byte.
    pub fn encoding(&mut self, e: Encoding) {
        self.u8(e.codec().code());
        self.u8(e.quality());
    }

    /// Output-tensor metadata now (name, dtype, dims, length), payload after
    /// all metadata.
    pub fn output(&mut self, t: &OutputTensor) {
        self.string(&t.name);
        self.u8(t.dtype.code());
        self.u8(t.shape.len().min(u8::MAX as usize) as u8);
        for &d in t.shape.iter().take(u8::MAX as usize) {
            self.u32(d);
        }
        self.u32(t.data.len() as u32);
        self.payloads.push(t.data.clone());
    }

    /// Finishes a message of `kind`: the header and metadata as one chunk,
    /// followed by the payload chunks (zero-copy).
    pub fn finish(self, kind: Kind) -> Vec<Bytes> {
        let len = self.meta.len() + self.payloads.iter().map(Bytes::len).sum::<usize>();
        let mut head = BytesMut::with_capacity(Header::LEN + self.meta.len());
        Header { kind, len }.encode(&mut head);
        head.put_slice(&self.meta);
        let mut chunks = Vec::with_capacity(1 + self.payloads.len());
        chunks.push(head.freeze());
        chunks.extend(self.payloads.into_iter().filter(|p| !p.is_empty()));
        chunks
    }
}
