//! tidegate's wire protocol: the messages that edges, the gateway and workers
//! exchange, and a sans-IO codec for them over [`bytes::Buf`]/[`bytes::BufMut`].
//!
//! The core knows bytes, not sockets or clocks. Every decoder checks
//! [`Limits`] before it allocates, and tells "need more bytes"
//! ([`DecodeError::Incomplete`]) apart from "malformed" (every other variant).
//! Tensor payloads are zero-copy [`bytes::Bytes`] slices of the received buffer.
//!
//! [`GatewayAddr`] is the gateway's address as edges and workers are given
//! it: an IP literal or a DNS name, and a port.
//!
//! The optional `quic` feature adds the adapters that read and write these
//! messages on quinn streams, builds the rustls configurations, and resolves
//! and dials a [`GatewayAddr`]. It also adds the `queue` module: a queue
//! bounded by bytes as well as by items, where results wait between the
//! tasks that pass them on.
//! `docs/protocol.md` specifies the format for implementers in other languages.

pub mod addr;
#[cfg(feature = "dev-certs")]
pub mod certs;
pub mod codec;
pub mod error;
#[doc(hidden)]
pub mod fuzzing;
pub mod limits;
pub mod message;
#[cfg(feature = "quic")]
pub mod queue;
#[cfg(feature = "quic")]
pub mod quic;
pub mod result;
pub mod tensor;

pub use addr::{GatewayAddr, GatewayAddrError};
pub use codec::{DecodeError, Header, Kind, MAGIC, VERSION};
pub use error::{ErrorCode, Fault};
pub use limits::{CUT_MARK, Limits, fit_string};
pub use message::*;
pub use result::{Detection, FrameResult, ShedReason, Status, Timings};
pub use tensor::{
    Codec, DType, Encoding, Geometry, Layout, OutputTensor, Tensor, TensorError, shape_string,
};
