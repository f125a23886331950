//! Every message that edges, the gateway and workers exchange.
//!
//! Streams (see docs/protocol.md):
//! - **control** (bidirectional, opened by the client first): `Hello` →
//!   `Welcome` | `Error`; then for edges `CameraOpen` → `CameraAccepted` |
//!   `Error`, `ControlHint` and `ClockProbe` (gateway → edge), `ClockEcho`
//!   and `LatencyReport` (edge → gateway); for workers `Register`,
//!   `Heartbeat`, `Drain`.
//! - **frame** (unidirectional, edge → gateway): exactly one `Frame`.
//! - **result** (unidirectional, gateway → edge): exactly one `Result`.
//! - **dispatch** (unidirectional, gateway → worker): exactly one `Dispatch`.
//! - **batch result** (unidirectional, worker → gateway): one `BatchResult`.

use bytes::{Buf, Bytes};
use serde::{Deserialize, Serialize};

use crate::codec::{DecodeError, Header, Kind, Reader, Writer};
use crate::error::ErrorCode;
use crate::limits::Limits;
use crate::result::{Detection, FrameResult, ShedReason, Status, Timings};
use crate::tensor::{Codec, DType, Encoding, Geometry, Layout, OutputTensor, Tensor};

/// Who is connecting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// A camera-side edge node.
    Edge,
    /// A cloud inference worker.
    Worker,
}

/// First message on a connection's control stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// Edge or worker.
    pub role: Role,
    /// The edge's or worker's name (unique per gateway).
    pub name: String,
    /// Its secret token.
    pub token: String,
}

/// The gateway's answer to a good `Hello`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Welcome {
    /// Session number, unique for this gateway process.
    pub session: u64,
    /// How often workers should send `Heartbeat`, in milliseconds.
    pub heartbeat_ms: u32,
}

/// An error. Answering `Hello` (or on a malformed control stream), the
/// sender then closes the connection with QUIC code `0x100 + code`;
/// answering `CameraOpen`, the control stream stays open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorMsg {
    /// Classified code.
    pub code: ErrorCode,
    /// What was wrong and what to do about it.
    pub message: String,
}

impl ErrorMsg {
    /// An error whose message fits `limits` (cut and marked by
    /// [`crate::limits::fit_string`] when it would not): a reason that
    /// quotes a peer's long name must still reach that peer as a reason,
    /// not as a malformed stream.
    pub fn within(limits: &Limits, code: ErrorCode, message: &str) -> ErrorMsg {
        ErrorMsg {
            code,
            message: limits.fit_string(message).into_owned(),
        }
    }
}

/// How the edge fits a source frame into the model's input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Resize {
    /// Scale each axis independently to fill the input.
    Stretch,
    /// Keep the aspect ratio, centre, pad with black.
    Letterbox,
}

/// Channel order of an image input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ColorOrder {
    /// Red, green, blue.
    Rgb,
    /// Blue, green, red.
    Bgr,
}

/// What a model wants from the edge: the tensor the edge must send.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct InputSpec {
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
    /// Channels (3 for colour).
    pub channels: u8,
    /// Element type on the wire (u8 for camera frames).
    pub dtype: DType,
    /// Memory layout on the wire.
    pub layout: Layout,
    /// Channel order.
    pub color: ColorOrder,
    /// How to fit the source frame.
    pub resize: Resize,
}

impl InputSpec {
    /// The shape of one frame: `[1,H,W,C]` or `[1,C,H,W]`.
    pub fn frame_shape(&self) -> Vec<u32> {
        let c = self.channels as u32;
        match self.layout {
            Layout::Nhwc => vec![1, self.height, self.width, c],
            Layout::Nchw => vec![1, c, self.height, self.width],
        }
    }

    /// Bytes of one frame of this input, raw.
    pub fn raw_frame_bytes(&self) -> usize {
        (self.width as usize)
            .saturating_mul(self.height as usize)
            .saturating_mul(self.channels as usize)
            .saturating_mul(self.dtype.size())
    }

    /// The most payload bytes a frame of this input can carry in any
    /// encoding: raw, or a JPEG or PNG file that decodes to it. A JPEG of
    /// noise at quality 100 with full-resolution colour is at most about
    /// 3.4 times its raw pixels (27 bits for each of a block's 64
    /// coefficients, against 8), and a PNG barely more than raw; so four
    /// times raw, plus [`FILE_OVERHEAD`](Self::FILE_OVERHEAD) for the
    /// file's headers and tables. A larger frame cannot be this input's,
    /// and a gateway refuses it from its header.
    pub fn max_frame_payload(&self) -> usize {
        self.raw_frame_bytes()
            .saturating_mul(4)
            .saturating_add(Self::FILE_OVERHEAD)
    }

    /// Room for an encoded file's headers and tables, beside its pixels
    /// ([`InputSpec::max_frame_payload`]).
    pub const FILE_OVERHEAD: usize = 64 * 1024;
}

impl Frame {
    /// The longest body (the bytes after its [`Header`]) a frame can have
    /// whose payload is at most `payload` bytes and whose names are within
    /// `limits`: the camera and model names with their lengths, the
    /// sequence number, capture time, budget and geometry, and the
    /// tensor's metadata with the most dimensions.
    pub fn max_body_len(payload: usize, limits: &Limits) -> usize {
        let names = 2 * (2 + limits.max_string_bytes);
        let fields = 8 + 8 + 4 + Geometry::WIRE_LEN;
        // dtype, layout, encoding (codec and quality), the dims' count,
        // the dims, the payload's length
        let tensor = 1 + 1 + 2 + 1 + 4 * limits.max_dims + 4;
        (names + fields + tensor).saturating_add(payload)
    }
}

/// Edge → gateway: start a camera on a model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CameraOpen {
    /// Camera name, unique within the edge.
    pub camera: String,
    /// Model to run on its frames.
    pub model: String,
    /// End-to-end budget per frame, in milliseconds.
    pub budget_ms: u32,
    /// How the camera's frames will be encoded (JPEG: its highest quality;
    /// the camera may lower it frame by frame).
    pub encoding: Encoding,
    /// Copies of each frame the camera sends, each on a stream of its own
    /// (1 to [`MAX_COPIES`]), and of each result it asks back: on a link
    /// that loses packets at random, a second copy arrives when the first
    /// would need a retransmission, which costs a round trip the budget
    /// may not have. The gateway serves the first copy and drops the rest.
    pub copies: u8,
}

/// The most copies of a frame (and of its result) a camera may ask for.
pub const MAX_COPIES: u8 = 3;

/// Gateway → edge: the camera is open; send frames shaped like this.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CameraAccepted {
    /// Camera name.
    pub camera: String,
    /// Model name.
    pub model: String,
    /// The input the model expects.
    pub input: InputSpec,
    /// Class names, indexed by `Detection::class` (empty when the model has
    /// none, as with the `raw` decoder).
    pub labels: Vec<String>,
    /// The encoding accepted: the one asked for (a gateway that cannot
    /// take it refuses the camera instead).
    pub encoding: Encoding,
    /// Copies of each result the gateway will send (and of each frame it
    /// expects at most): the camera's, within 1 to [`MAX_COPIES`].
    pub copies: u8,
}

/// Edge → gateway: one frame, on its own unidirectional stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// Camera name (opened on this connection).
    pub camera: String,
    /// Sequence number, increasing per camera.
    pub seq: u64,
    /// Capture time on the edge's clock (µs); echoed in the result.
    pub captured_at_us: u64,
    /// The frame's whole budget, counted from `captured_at_us` (µs): its
    /// result is due at `captured_at_us + budget_us` on the edge's clock,
    /// however long it waited before and while it was sent.
    pub budget_us: u32,
    /// Model to run.
    pub model: String,
    /// Where the input came from, to map results back to source pixels.
    pub geometry: Geometry,
    /// The preprocessed input.
    pub tensor: Tensor,
}

/// Gateway → edge: adjust a camera to relieve (or use) capacity.
#[derive(Debug, Clone, PartialEq)]
pub struct ControlHint {
    /// Camera name; empty for every camera of the edge.
    pub camera: String,
    /// Highest frame rate to send (frames per second).
    pub max_fps: f32,
    /// Motion-gate threshold (fraction of changed pixels, 0..1).
    pub motion_threshold: f32,
}

/// Edge → gateway: the end-to-end latency the edge measured for a result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LatencyReport {
    /// Camera name.
    pub camera: String,
    /// Frame sequence number.
    pub seq: u64,
    /// Capture to result, on the edge's clock (µs).
    pub e2e_us: u32,
}

/// A model a worker serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelInfo {
    /// Model name.
    pub name: String,
    /// Model version from its model.toml.
    pub version: u32,
    /// The input it expects from edges.
    pub input: InputSpec,
    /// Largest batch it runs at once.
    pub max_batch: u16,
    /// Class names, indexed by `Detection::class` (empty when none).
    pub labels: Vec<String>,
}

/// A measured latency for a model at a batch size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProfilePoint {
    /// Model name.
    pub model: String,
    /// Batch size.
    pub batch: u16,
    /// Latency of one run of that batch (µs).
    pub latency_us: u32,
}

/// Worker → gateway: what the worker is and serves; it is ready after this.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Register {
    /// Worker name.
    pub worker: String,
    /// Device description (e.g. "cpu (2 threads)", "NVIDIA H200").
    pub device: String,
    /// Models served.
    pub models: Vec<ModelInfo>,
    /// Latency per model and batch size, measured during warm-up.
    pub profile: Vec<ProfilePoint>,
    /// The frame encodings the worker decodes (always including raw).
    pub codecs: Vec<Codec>,
}

/// Gateway → edge: a clock probe. The edge answers at once with
/// [`ClockEcho`], from which the gateway estimates the edge's clock offset
/// (NTP-style: offset = edge − (sent + received) / 2, trusting the probes
/// with the shortest round trip), and so how long a frame waited on the
/// edge before it arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClockProbe {
    /// When the gateway sent it, on the gateway's clock (µs, opaque to
    /// the edge).
    pub gateway_us: u64,
}

/// Edge → gateway: the answer to a [`ClockProbe`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClockEcho {
    /// The probe's `gateway_us`, echoed.
    pub gateway_us: u64,
    /// The edge's clock when it read the probe, on the clock its frames'
    /// `captured_at_us` use (µs).
    pub edge_us: u64,
}

/// Worker → gateway: periodic liveness and load.
#[derive(Debug, Clone, PartialEq)]
pub struct Heartbeat {
    /// Batches waiting in the worker.
    pub queue_depth: u32,
    /// Busy fraction since the previous heartbeat (0..1).
    pub utilization: f32,
}

/// One frame of a dispatched batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DispatchItem {
    /// Gateway-assigned frame id, echoed in the result.
    pub id: u64,
    /// Camera name (for tracing).
    pub camera: String,
    /// Frame sequence number (for tracing).
    pub seq: u64,
    /// Source geometry.
    pub geometry: Geometry,
    /// The frame's tensor.
    pub tensor: Tensor,
}

/// Gateway → worker: run a batch of frames of one model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dispatch {
    /// Batch id, echoed in the result.
    pub batch: u64,
    /// Model name.
    pub model: String,
    /// The frames.
    pub items: Vec<DispatchItem>,
}

/// The result for one dispatched frame.
#[derive(Debug, Clone, PartialEq)]
pub struct ItemResult {
    /// The frame id from `DispatchItem::id`.
    pub id: u64,
    /// Outcome.
    pub status: Status,
    /// Detections (empty unless ok).
    pub detections: Vec<Detection>,
    /// Stage timings.
    pub timings: Timings,
    /// The frame's model outputs, for the `raw` decoder (empty otherwise).
    pub outputs: Vec<OutputTensor>,
}

/// Worker → gateway: results for every item of a batch.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchResult {
    /// Batch id.
    pub batch: u64,
    /// One result per dispatched item.
    pub items: Vec<ItemResult>,
}

/// Gateway → worker: stop taking batches; finish or hand back what you
/// hold. Worker → gateway: I am draining; send me no new batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Drain {
    /// Time left before the worker is killed (ms).
    pub deadline_ms: u32,
}

/// Any message.
#[derive(Debug, Clone, PartialEq)]
#[allow(missing_docs)]
pub enum Message {
    Hello(Hello),
    Welcome(Welcome),
    Error(ErrorMsg),
    CameraOpen(CameraOpen),
    CameraAccepted(CameraAccepted),
    Frame(Frame),
    Result(FrameResult),
    ControlHint(ControlHint),
    LatencyReport(LatencyReport),
    Register(Register),
    Heartbeat(Heartbeat),
    Dispatch(Dispatch),
    BatchResult(BatchResult),
    Drain(Drain),
    ClockProbe(ClockProbe),
    ClockEcho(ClockEcho),
}

impl Message {
    /// The wire kind of this message.
    pub fn kind(&self) -> Kind {
        match self {
            Message::Hello(_) => Kind::Hello,
            Message::Welcome(_) => Kind::Welcome,
            Message::Error(_) => Kind::Error,
            Message::CameraOpen(_) => Kind::CameraOpen,
            Message::CameraAccepted(_) => Kind::CameraAccepted,
            Message::Frame(_) => Kind::Frame,
            Message::Result(_) => Kind::Result,
            Message::ControlHint(_) => Kind::ControlHint,
            Message::LatencyReport(_) => Kind::LatencyReport,
            Message::Register(_) => Kind::Register,
            Message::Heartbeat(_) => Kind::Heartbeat,
            Message::Dispatch(_) => Kind::Dispatch,
            Message::BatchResult(_) => Kind::BatchResult,
            Message::Drain(_) => Kind::Drain,
            Message::ClockProbe(_) => Kind::ClockProbe,
            Message::ClockEcho(_) => Kind::ClockEcho,
        }
    }

    /// Encodes as chunks: header + metadata first, then each tensor payload
    /// as the original `Bytes` (no copy). Write them in order.
    pub fn to_chunks(&self) -> Vec<Bytes> {
        let mut w = Writer::default();
        match self {
            Message::Hello(m) => {
                w.u8(match m.role {
                    Role::Edge => 0,
                    Role::Worker => 1,
                });
                w.string(&m.name);
                w.string(&m.token);
            }
            Message::Welcome(m) => {
                w.u64(m.session);
                w.u32(m.heartbeat_ms);
            }
            Message::Error(m) => {
                w.u16(m.code.code());
                w.string(&m.message);
            }
            Message::CameraOpen(m) => {
                w.string(&m.camera);
                w.string(&m.model);
                w.u32(m.budget_ms);
                w.encoding(m.encoding);
                w.u8(m.copies);
            }
            Message::CameraAccepted(m) => {
                w.string(&m.camera);
                w.string(&m.model);
                write_input(&mut w, &m.input);
                write_labels(&mut w, &m.labels);
                w.encoding(m.encoding);
                w.u8(m.copies);
            }
            Message::Frame(m) => {
                w.string(&m.camera);
                w.u64(m.seq);
                w.u64(m.captured_at_us);
                w.u32(m.budget_us);
                w.string(&m.model);
                w.geometry(&m.geometry);
                w.tensor(&m.tensor);
            }
            Message::Result(m) => {
                w.string(&m.camera);
                w.u64(m.seq);
                w.u64(m.captured_at_us);
                write_outcome(&mut w, &m.status, &m.detections, &m.timings, &m.outputs);
            }
            Message::ControlHint(m) => {
                w.string(&m.camera);
                w.f32(m.max_fps);
                w.f32(m.motion_threshold);
            }
            Message::LatencyReport(m) => {
                w.string(&m.camera);
                w.u64(m.seq);
                w.u32(m.e2e_us);
            }
            Message::Register(m) => {
                w.string(&m.worker);
                w.string(&m.device);
                w.count(m.models.len());
                for info in &m.models {
                    w.string(&info.name);
                    w.u32(info.version);
                    write_input(&mut w, &info.input);
                    w.u16(info.max_batch);
                    write_labels(&mut w, &info.labels);
                }
                w.count(m.profile.len());
                for p in &m.profile {
                    w.string(&p.model);
                    w.u16(p.batch);
                    w.u32(p.latency_us);
                }
                w.count(m.codecs.len());
                for c in &m.codecs {
                    w.u8(c.code());
                }
            }
            Message::Heartbeat(m) => {
                w.u32(m.queue_depth);
                w.f32(m.utilization);
            }
            Message::Dispatch(m) => {
                w.u64(m.batch);
                w.string(&m.model);
                w.count(m.items.len());
                for item in &m.items {
                    w.u64(item.id);
                    w.string(&item.camera);
                    w.u64(item.seq);
                    w.geometry(&item.geometry);
                    w.tensor(&item.tensor);
                }
            }
            Message::BatchResult(m) => {
                w.u64(m.batch);
                w.count(m.items.len());
                for item in &m.items {
                    w.u64(item.id);
                    write_outcome(
                        &mut w,
                        &item.status,
                        &item.detections,
                        &item.timings,
                        &item.outputs,
                    );
                }
            }
            Message::Drain(m) => w.u32(m.deadline_ms),
            Message::ClockProbe(m) => w.u64(m.gateway_us),
            Message::ClockEcho(m) => {
                w.u64(m.gateway_us);
                w.u64(m.edge_us);
            }
        }
        w.finish(self.kind())
    }

    /// Encodes into `dst` (copies tensor payloads; see [`Message::to_chunks`]
    /// for the zero-copy form).
    pub fn encode(&self, dst: &mut impl bytes::BufMut) {
        for chunk in self.to_chunks() {
            dst.put_slice(&chunk);
        }
    }

    /// Decodes one message from the front of `src`.
    ///
    /// On [`DecodeError::Incomplete`] nothing is consumed: append more bytes
    /// and call again. Any other error means the bytes are malformed and the
    /// stream should be closed. `src` must present the 8-byte header in its
    /// first chunk (true for `Bytes`, `BytesMut`, `&[u8]` and `Vec<u8>`).
    pub fn decode<B: Buf>(src: &mut B, limits: &Limits) -> Result<Message, DecodeError> {
        let chunk = src.chunk();
        if chunk.len() < Header::LEN && chunk.len() < src.remaining() {
            return Err(DecodeError::Invalid {
                what: "buffer",
                detail: "header split across chunks; pass a contiguous buffer".into(),
            });
        }
        let header = Header::peek(chunk, limits)?;
        let have = src.remaining() - Header::LEN;
        if have < header.len {
            return Err(DecodeError::Incomplete {
                needed: header.len - have,
            });
        }
        src.advance(Header::LEN);
        let body = src.copy_to_bytes(header.len);
        Self::decode_body(header.kind, body, limits)
    }

    /// Decodes a body of `kind` whose header was already read and checked
    /// (this is what stream readers use after [`Header::peek`]).
    pub fn decode_body(kind: Kind, body: Bytes, limits: &Limits) -> Result<Message, DecodeError> {
        let mut r = Reader::new(body, limits);
        let msg = match kind {
            Kind::Hello => {
                let role = match r.u8("role")? {
                    0 => Role::Edge,
                    1 => Role::Worker,
                    v => {
                        return Err(DecodeError::Invalid {
                            what: "role",
                            detail: format!("unknown role {v}"),
                        });
                    }
                };
                Message::Hello(Hello {
                    role,
                    name: r.string("name")?,
                    token: r.string("token")?,
                })
            }
            Kind::Welcome => Message::Welcome(Welcome {
                session: r.u64("session")?,
                heartbeat_ms: r.u32("heartbeat_ms")?,
            }),
            Kind::Error => Message::Error(ErrorMsg {
                code: ErrorCode::from_code(r.u16("error code")?),
                message: r.string("error message")?,
            }),
            Kind::CameraOpen => Message::CameraOpen(CameraOpen {
                camera: r.string("camera")?,
                model: r.string("model")?,
                budget_ms: r.u32("budget_ms")?,
                encoding: r.encoding("encoding")?,
                copies: read_copies(&mut r)?,
            }),
            Kind::CameraAccepted => Message::CameraAccepted(CameraAccepted {
                camera: r.string("camera")?,
                model: r.string("model")?,
                input: read_input(&mut r)?,
                labels: read_labels(&mut r)?,
                encoding: r.encoding("encoding")?,
                copies: read_copies(&mut r)?,
            }),
            Kind::Frame => {
                let camera = r.string("camera")?;
                let seq = r.u64("seq")?;
                let captured_at_us = r.u64("captured_at_us")?;
                let budget_us = r.u32("budget_us")?;
                let model = r.string("model")?;
                let geometry = r.geometry()?;
                r.tensor_meta()?;
                let tensor = r.finish_tensors()?.pop().ok_or(DecodeError::Truncated {
                    what: "tensor payload",
                })?;
                return Ok(Message::Frame(Frame {
                    camera,
                    seq,
                    captured_at_us,
                    budget_us,
                    model,
                    geometry,
                    tensor,
                }));
            }
            Kind::Result => {
                let camera = r.string("camera")?;
                let seq = r.u64("seq")?;
                let captured_at_us = r.u64("captured_at_us")?;
                let (status, detections, timings, _) = read_outcome(&mut r)?;
                let outputs = r.finish_outputs()?;
                Message::Result(FrameResult {
                    camera,
                    seq,
                    captured_at_us,
                    status,
                    detections,
                    timings,
                    outputs,
                })
            }
            Kind::ControlHint => Message::ControlHint(ControlHint {
                camera: r.string("camera")?,
                max_fps: r.f32("max_fps")?,
                motion_threshold: r.f32("motion_threshold")?,
            }),
            Kind::LatencyReport => Message::LatencyReport(LatencyReport {
                camera: r.string("camera")?,
                seq: r.u64("seq")?,
                e2e_us: r.u32("e2e_us")?,
            }),
            Kind::Register => {
                let worker = r.string("worker")?;
                let device = r.string("device")?;
                let max = r.limits().max_list;
                let n = r.count("models", max, 2 + 4 + INPUT_SPEC_LEN + 2 + 2)?;
                let mut models = Vec::with_capacity(n);
                for _ in 0..n {
                    let name = r.string("model name")?;
                    let version = r.u32("model version")?;
                    let input = read_input(&mut r)?;
                    // A batch the gateway could never dispatch (nor the
                    // worker read back) is refused at registration.
                    let max_batch = r.u16("max_batch")?;
                    let limit = r.limits().max_batch;
                    if max_batch == 0 || usize::from(max_batch) > limit {
                        return Err(DecodeError::Invalid {
                            what: "max_batch",
                            detail: format!(
                                "model '{name}' declares {max_batch}; it must be 1 to {limit}"
                            ),
                        });
                    }
                    models.push(ModelInfo {
                        name,
                        version,
                        input,
                        max_batch,
                        labels: read_labels(&mut r)?,
                    });
                }
                let n = r.count("profile", max, 2 + 2 + 4)?;
                let mut profile = Vec::with_capacity(n);
                for _ in 0..n {
                    profile.push(ProfilePoint {
                        model: r.string("profile model")?,
                        batch: r.u16("profile batch")?,
                        latency_us: r.u32("profile latency")?,
                    });
                }
                let n = r.count("codecs", Codec::ALL.len(), 1)?;
                let mut codecs = Vec::with_capacity(n);
                for _ in 0..n {
                    let code = r.u8("codec")?;
                    codecs.push(Codec::from_code(code).ok_or_else(|| invalid("codec", code))?);
                }
                Message::Register(Register {
                    worker,
                    device,
                    models,
                    profile,
                    codecs,
                })
            }
            Kind::Heartbeat => Message::Heartbeat(Heartbeat {
                queue_depth: r.u32("queue_depth")?,
                utilization: r.f32("utilization")?,
            }),
            Kind::Dispatch => {
                let batch = r.u64("batch")?;
                let model = r.string("model")?;
                let max = r.limits().max_batch;
                // id + camera len + seq + geometry + minimal tensor meta
                // (dtype, layout, codec, quality, ndims, one dim, length).
                let n = r.count("dispatch items", max, 8 + 2 + 8 + 24 + 5 + 4 + 4)?;
                let mut heads = Vec::with_capacity(n);
                for _ in 0..n {
                    let id = r.u64("item id")?;
                    let camera = r.string("item camera")?;
                    let seq = r.u64("item seq")?;
                    let geometry = r.geometry()?;
                    r.tensor_meta()?;
                    heads.push((id, camera, seq, geometry));
                }
                let tensors = r.finish_tensors()?;
                let items = heads
                    .into_iter()
                    .zip(tensors)
                    .map(|((id, camera, seq, geometry), tensor)| DispatchItem {
                        id,
                        camera,
                        seq,
                        geometry,
                        tensor,
                    })
                    .collect();
                return Ok(Message::Dispatch(Dispatch {
                    batch,
                    model,
                    items,
                }));
            }
            Kind::BatchResult => {
                let batch = r.u64("batch")?;
                let max = r.limits().max_batch;
                // id + status + detections count + timings + outputs count.
                let n = r.count("batch result items", max, 8 + 1 + 2 + 20 + 2)?;
                let mut heads = Vec::with_capacity(n);
                for _ in 0..n {
                    let id = r.u64("item id")?;
                    heads.push((id, read_outcome(&mut r)?));
                }
                let mut outputs = r.finish_outputs()?.into_iter();
                let items = heads
                    .into_iter()
                    .map(|(id, (status, detections, timings, n))| ItemResult {
                        id,
                        status,
                        detections,
                        timings,
                        outputs: outputs.by_ref().take(n).collect(),
                    })
                    .collect();
                Message::BatchResult(BatchResult { batch, items })
            }
            Kind::Drain => Message::Drain(Drain {
                deadline_ms: r.u32("deadline_ms")?,
            }),
            Kind::ClockProbe => Message::ClockProbe(ClockProbe {
                gateway_us: r.u64("gateway_us")?,
            }),
            Kind::ClockEcho => Message::ClockEcho(ClockEcho {
                gateway_us: r.u64("gateway_us")?,
                edge_us: r.u64("edge_us")?,
            }),
        };
        r.end()?;
        Ok(msg)
    }
}

/// A copy count: 1 to [`MAX_COPIES`].
fn read_copies(r: &mut Reader<'_>) -> Result<u8, DecodeError> {
    match r.u8("copies")? {
        n @ 1..=MAX_COPIES => Ok(n),
        n => Err(DecodeError::Invalid {
            what: "copies",
            detail: format!("{n}; a camera sends 1 to {MAX_COPIES} copies of a frame"),
        }),
    }
}

/// Encoded size of an [`InputSpec`].
const INPUT_SPEC_LEN: usize = 4 + 4 + 1 + 1 + 1 + 1 + 1;

fn write_input(w: &mut Writer, s: &InputSpec) {
    w.u32(s.width);
    w.u32(s.height);
    w.u8(s.channels);
    w.u8(s.dtype.code());
    w.u8(s.layout.code());
    w.u8(match s.color {
        ColorOrder::Rgb => 0,
        ColorOrder::Bgr => 1,
    });
    w.u8(match s.resize {
        Resize::Stretch => 0,
        Resize::Letterbox => 1,
    });
}

fn invalid(what: &'static str, v: u8) -> DecodeError {
    DecodeError::Invalid {
        what,
        detail: format!("unknown code {v}"),
    }
}

fn read_input(r: &mut Reader<'_>) -> Result<InputSpec, DecodeError> {
    let width = r.u32("input width")?;
    let height = r.u32("input height")?;
    let channels = r.u8("input channels")?;
    let d = r.u8("input dtype")?;
    let dtype = DType::from_code(d).ok_or_else(|| invalid("input dtype", d))?;
    let l = r.u8("input layout")?;
    let layout = Layout::from_code(l).ok_or_else(|| invalid("input layout", l))?;
    let color = match r.u8("input color")? {
        0 => ColorOrder::Rgb,
        1 => ColorOrder::Bgr,
        v => return Err(invalid("input color", v)),
    };
    let resize = match r.u8("input resize")? {
        0 => Resize::Stretch,
        1 => Resize::Letterbox,
        v => return Err(invalid("input resize", v)),
    };
    Ok(InputSpec {
        width,
        height,
        channels,
        dtype,
        layout,
        color,
        resize,
    })
}

/// Class names: a `list<string>`.
fn write_labels(w: &mut Writer, labels: &[String]) {
    w.count(labels.len());
    for l in labels {
        w.string(l);
    }
}

fn read_labels(r: &mut Reader<'_>) -> Result<Vec<String>, DecodeError> {
    let max = r.limits().max_list;
    let n = r.count("labels", max, 2)?;
    (0..n).map(|_| r.string("label")).collect()
}

fn write_outcome(
    w: &mut Writer,
    status: &Status,
    detections: &[Detection],
    t: &Timings,
    outputs: &[OutputTensor],
) {
    match status {
        Status::Ok => w.u8(0),
        Status::Shed(reason) => {
            w.u8(1);
            w.u8(reason.code());
        }
        Status::Expired => w.u8(2),
        Status::Failed(reason) => {
            w.u8(3);
            w.string(reason);
        }
    }
    w.count(detections.len());
    for d in detections {
        for v in [d.x1, d.y1, d.x2, d.y2, d.score] {
            w.f32(v);
        }
        w.u32(d.class);
        w.u8(d.keypoints.len().min(u8::MAX as usize) as u8);
        for [x, y] in d.keypoints.iter().take(u8::MAX as usize) {
            w.f32(*x);
            w.f32(*y);
        }
    }
    for v in [
        t.queue_us,
        t.decode_us,
        t.preprocess_us,
        t.inference_us,
        t.postprocess_us,
    ] {
        w.u32(v);
    }
    w.count(outputs.len());
    for o in outputs {
        w.output(o);
    }
}

/// An outcome's fields, and how many output tensors it has (their payloads
/// are claimed after all metadata, by [`Reader::finish_outputs`]).
type Outcome = (Status, Vec<Detection>, Timings, usize);

fn read_outcome(r: &mut Reader<'_>) -> Result<Outcome, DecodeError> {
    let status = match r.u8("status")? {
        0 => Status::Ok,
        1 => {
            let v = r.u8("shed reason")?;
            Status::Shed(ShedReason::from_code(v).ok_or_else(|| invalid("shed reason", v))?)
        }
        2 => Status::Expired,
        3 => Status::Failed(r.string("failure reason")?),
        v => return Err(invalid("status", v)),
    };
    let max = r.limits().max_detections;
    let n = r.count("detections", max, 5 * 4 + 4 + 1)?;
    let mut detections = Vec::with_capacity(n);
    for _ in 0..n {
        let what = "detection";
        let (x1, y1, x2, y2, score) = (
            r.f32(what)?,
            r.f32(what)?,
            r.f32(what)?,
            r.f32(what)?,
            r.f32(what)?,
        );
        let class = r.u32(what)?;
        let k = r.u8("keypoint count")? as usize;
        let max_k = r.limits().max_keypoints;
        if k > max_k {
            return Err(DecodeError::TooLarge {
                what: "keypoints",
                len: k,
                max: max_k,
            });
        }
        let mut keypoints = Vec::with_capacity(k);
        for _ in 0..k {
            keypoints.push([r.f32("keypoint")?, r.f32("keypoint")?]);
        }
        detections.push(Detection {
            x1,
            y1,
            x2,
            y2,
            score,
            class,
            keypoints,
        });
    }
    let timings = Timings {
        queue_us: r.u32("timings")?,
        decode_us: r.u32("timings")?,
        preprocess_us: r.u32("timings")?,
        inference_us: r.u32("timings")?,
        postprocess_us: r.u32("timings")?,
    };
    // name + dtype + ndims + one dim + payload length.
    let n = r.count("outputs", r.limits().max_list, 2 + 1 + 1 + 4 + 4)?;
    let mut bytes = 0usize;
    for _ in 0..n {
        bytes = bytes.saturating_add(r.output_meta()?);
        let max = r.limits().max_output_bytes;
        if bytes > max {
            return Err(DecodeError::TooLarge {
                what: "outputs of one result",
                len: bytes,
                max,
            });
        }
    }
    Ok((status, detections, timings, n))
}
