//! Bytes of partly received frames, bounded. A frame stream learns its
//! body's length from the 8-byte header; before it reads (and allocates) a
//! byte of the body it takes that many bytes from its edge's budget and
//! from the gateway's ([`InflightBudget::reserve`]), or its frame is
//! refused. The bytes come back when the frame has been handed on or
//! dropped. Without this, an edge could keep 4,096 streams of up to 64 MiB
//! each half sent, and the gateway would hold every byte of them.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use bytes::BytesMut;
use tidegate_protocol::quic::ReadError;
use tidegate_protocol::{ErrorCode, Frame, Header, Kind, Limits, Message};

/// A number of bytes shared by tasks: each takes what it is about to
/// allocate, or is told there is no room; what it took comes back when
/// its [`Taken`] is dropped.
#[derive(Debug)]
pub(crate) struct ByteBudget {
    cap: u64,
    used: AtomicU64,
}

impl ByteBudget {
    /// A budget of `cap` bytes, none taken.
    pub(crate) fn new(cap: u64) -> Arc<Self> {
        Arc::new(ByteBudget {
            cap,
            used: AtomicU64::new(0),
        })
    }

    /// Takes `bytes` if they fit beside what is taken; never more than the
    /// cap in all, however many tasks take at once.
    pub(crate) fn try_take(self: &Arc<Self>, bytes: u64) -> Option<Taken> {
        let mut used = self.used.load(Ordering::Relaxed);
        loop {
            let next = used.checked_add(bytes).filter(|n| *n <= self.cap)?;
            match self
                .used
                .compare_exchange_weak(used, next, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => {
                    return Some(Taken {
                        budget: self.clone(),
                        bytes,
                    });
                }
                Err(now) => used = now,
            }
        }
    }

    /// Bytes taken now.
    pub(crate) fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }

    /// Bytes that may be taken in all.
    pub(crate) fn cap(&self) -> u64 {
        self.cap
    }
}

/// Bytes taken from a [`ByteBudget`], given back on drop.
#[derive(Debug)]
pub(crate) struct Taken {
    budget: Arc<ByteBudget>,
    bytes: u64,
}

impl Drop for Taken {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// The two budgets a frame stream takes from: its edge's
/// (`limits.edge_inflight_bytes`, shared by the edge's connections) and
/// the gateway's (`limits.inflight_bytes_total`).
#[derive(Debug, Clone)]
pub(crate) struct InflightBudget {
    pub(crate) edge: Arc<ByteBudget>,
    pub(crate) total: Arc<ByteBudget>,
}

/// Room held for one frame's body in both budgets.
#[derive(Debug)]
pub(crate) struct Reservation {
    _edge: Taken,
    _total: Taken,
}

/// Why a frame found no room.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub(crate) enum BudgetError {
    /// The frame alone is over its edge's whole budget: it never fits.
    #[error(
        "a frame of {bytes} bytes is larger than its edge's budget of {cap} bytes for partly received frames; send smaller frames or raise limits.edge_inflight_bytes"
    )]
    LargerThanBudget {
        /// The frame's body.
        bytes: u64,
        /// The edge's budget.
        cap: u64,
    },
    /// Its edge's frames still being received hold the rest.
    #[error(
        "no room for a frame of {bytes} bytes: its edge's frames still being received hold {used} of {cap} bytes (limits.edge_inflight_bytes)"
    )]
    Edge {
        /// The frame's body.
        bytes: u64,
        /// Taken by the edge's frames.
        used: u64,
        /// The edge's budget.
        cap: u64,
    },
    /// All edges' frames still being received hold the rest.
    #[error(
        "no room for a frame of {bytes} bytes: frames still being received hold {used} of the gateway's {cap} bytes (limits.inflight_bytes_total)"
    )]
    Total {
        /// The frame's body.
        bytes: u64,
        /// Taken by all frames.
        used: u64,
        /// The gateway's budget.
        cap: u64,
    },
}

impl BudgetError {
    /// The code its stream is stopped with: a frame that can never fit is
    /// too large; one that found the budget full may be sent again.
    pub(crate) fn code(&self) -> ErrorCode {
        match self {
            BudgetError::LargerThanBudget { .. } => ErrorCode::TooLarge,
            BudgetError::Edge { .. } | BudgetError::Total { .. } => ErrorCode::Overloaded,
        }
    }
}

impl InflightBudget {
    /// Takes room for a body of `bytes` from both budgets, or neither.
    pub(crate) fn reserve(&self, bytes: u64) -> Result<Reservation, BudgetError> {
        if bytes > self.edge.cap() {
            return Err(BudgetError::LargerThanBudget {
                bytes,
                cap: self.edge.cap(),
            });
        }
        let edge = self.edge.try_take(bytes).ok_or_else(|| BudgetError::Edge {
            bytes,
            used: self.edge.used(),
            cap: self.edge.cap(),
        })?;
        // Dropping `edge` on this error gives its bytes back.
        let total = self
            .total
            .try_take(bytes)
            .ok_or_else(|| BudgetError::Total {
                bytes,
                used: self.total.used(),
                cap: self.total.cap(),
            })?;
        Ok(Reservation {
            _edge: edge,
            _total: total,
        })
    }
}

/// Why a frame stream gave no frame.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum FrameReadError {
    /// The stream failed, or its bytes were not one well-formed frame.
    #[error(transparent)]
    Read(#[from] ReadError),
    /// The frame's body found no room in the budgets.
    #[error(transparent)]
    Budget(#[from] BudgetError),
    /// The frame declared a body larger than any camera open on its
    /// connection can send: its model's input, in any encoding
    /// ([`Frame::max_body_len`] of [`InputSpec::max_frame_payload`]).
    ///
    /// [`InputSpec::max_frame_payload`]: tidegate_protocol::InputSpec::max_frame_payload
    #[error(
        "a frame of {bytes} bytes is larger than any camera open on its connection can send ({max} bytes: the largest model input of its cameras, in any encoding)"
    )]
    LargerThanItsCameras {
        /// The frame's declared body.
        bytes: usize,
        /// The largest body the connection's cameras can send (0 before
        /// any is open).
        max: usize,
    },
}

/// The one kind a frame stream carries.
const FRAME: &[Kind] = &[Kind::Frame];

/// Reads the one frame of a frame stream: its header, then room for its
/// body from `budget`, then the body. Any kind but `Frame`, a frame whose
/// body is longer than `max_body` (what the connection's open cameras can
/// send, read when the header is in), or one without room, is refused
/// before a byte of its body is read. Returns the frame with its room, to
/// be held until the frame is handed on; `None` when the stream finished
/// before a byte.
pub(crate) async fn read_frame(
    recv: &mut quinn::RecvStream,
    limits: &Limits,
    max_body: &AtomicUsize,
    budget: &InflightBudget,
) -> Result<Option<(Frame, Reservation)>, FrameReadError> {
    let mut head = [0u8; Header::LEN];
    match recv.read_exact(&mut head).await {
        Ok(()) => {}
        Err(quinn::ReadExactError::FinishedEarly(0)) => return Ok(None),
        Err(quinn::ReadExactError::FinishedEarly(got)) => {
            return Err(ReadError::Truncated {
                got,
                expected: Header::LEN,
            }
            .into());
        }
        Err(quinn::ReadExactError::ReadError(e)) => return Err(ReadError::Stream(e).into()),
    }
    let header = Header::peek(&head, limits).map_err(ReadError::Decode)?;
    if header.kind != Kind::Frame {
        return Err(ReadError::Unexpected {
            got: header.kind,
            expected: FRAME,
        }
        .into());
    }
    let max = max_body.load(Ordering::Acquire);
    if header.len > max {
        return Err(FrameReadError::LargerThanItsCameras {
            bytes: header.len,
            max,
        });
    }
    let room = budget.reserve(header.len as u64)?;
    // Exactly the room reserved: pages the edge never sends are never
    // touched.
    let mut body = BytesMut::with_capacity(header.len);
    while body.len() < header.len {
        match recv
            .read_chunk(header.len - body.len(), true)
            .await
            .map_err(ReadError::Stream)?
        {
            Some(chunk) => body.extend_from_slice(&chunk.bytes),
            None => {
                return Err(ReadError::Truncated {
                    got: Header::LEN + body.len(),
                    expected: Header::LEN + header.len,
                }
                .into());
            }
        }
    }
    match Message::decode_body(Kind::Frame, body.freeze(), limits).map_err(ReadError::Decode)? {
        Message::Frame(f) => Ok(Some((f, room))),
        other => Err(ReadError::Unexpected {
            got: other.kind(),
            expected: FRAME,
        }
        .into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn budget(edge: u64, total: u64) -> InflightBudget {
        InflightBudget {
            edge: ByteBudget::new(edge),
            total: ByteBudget::new(total),
        }
    }

    #[test]
    fn a_frame_takes_room_from_both_budgets_and_gives_it_back_when_dropped() {
        let b = budget(100, 150);
        let r = b.reserve(60).unwrap();
        assert_eq!((b.edge.used(), b.total.used()), (60, 60));
        assert_eq!(
            b.reserve(50).unwrap_err(),
            BudgetError::Edge {
                bytes: 50,
                used: 60,
                cap: 100
            }
        );
        drop(r);
        assert_eq!((b.edge.used(), b.total.used()), (0, 0));
        assert!(b.reserve(100).is_ok());
    }

    #[test]
    fn a_frame_larger_than_its_edges_budget_is_too_large_not_overloaded() {
        let b = budget(100, 1000);
        let e = b.reserve(101).unwrap_err();
        assert_eq!(e.code(), ErrorCode::TooLarge);
        assert!(e.to_string().contains("limits.edge_inflight_bytes"), "{e}");
        assert_eq!(b.edge.used(), 0);
    }

    #[test]
    fn a_full_gateway_budget_refuses_and_leaves_the_edges_budget_as_it_was() {
        let other_edge = budget(100, 150);
        let _held = other_edge.reserve(100).unwrap();
        let this_edge = InflightBudget {
            edge: ByteBudget::new(100),
            total: other_edge.total.clone(),
        };
        let e = this_edge.reserve(60).unwrap_err();
        assert!(matches!(e, BudgetError::Total { used: 100, .. }), "{e:?}");
        assert_eq!(e.code(), ErrorCode::Overloaded);
        assert_eq!(this_edge.edge.used(), 0, "the edge's share came back");
        assert!(this_edge.reserve(50).is_ok());
    }

    #[test]
    fn tasks_taking_at_once_never_take_more_than_the_cap() {
        let b = ByteBudget::new(1000);
        let held = std::sync::Mutex::new(Vec::new());
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..1000 {
                        if let Some(t) = b.try_take(7) {
                            assert!(b.used() <= 1000);
                            held.lock().unwrap().push(t);
                        }
                    }
                });
            }
        });
        assert_eq!(b.used(), 7 * held.lock().unwrap().len() as u64);
        assert!(b.used() <= 1000);
        held.lock().unwrap().clear();
        assert_eq!(b.used(), 0);
    }

    proptest! {
        /// Any order of reservations and drops: the budgets never exceed
        /// their caps, each always equals the sum of what is held, and all
        /// of it comes back.
        #[test]
        fn budgets_hold_exactly_what_is_reserved_and_never_exceed_their_caps(
            ops in proptest::collection::vec((0u64..80, any::<bool>(), 0usize..2), 1..200),
        ) {
            let total = ByteBudget::new(150);
            let edges = [
                InflightBudget { edge: ByteBudget::new(100), total: total.clone() },
                InflightBudget { edge: ByteBudget::new(100), total: total.clone() },
            ];
            let mut held: Vec<(usize, u64, Reservation)> = Vec::new();
            for (bytes, release, edge) in ops {
                if release && !held.is_empty() {
                    held.remove(bytes as usize % held.len());
                } else if let Ok(r) = edges[edge].reserve(bytes) {
                    held.push((edge, bytes, r));
                }
                for (i, e) in edges.iter().enumerate() {
                    let sum: u64 = held.iter().filter(|h| h.0 == i).map(|h| h.1).sum();
                    prop_assert_eq!(e.edge.used(), sum);
                    prop_assert!(e.edge.used() <= 100);
                }
                prop_assert_eq!(total.used(), held.iter().map(|h| h.1).sum::<u64>());
                prop_assert!(total.used() <= 150);
            }
            held.clear();
            prop_assert_eq!(total.used(), 0);
        }
    }
}
