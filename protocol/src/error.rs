//! Error codes on the wire, classified once: whose fault, retryable or not,
//! and the HTTP status each maps to. Every component uses this one table.

use serde::{Deserialize, Serialize};

/// Whose fault an error is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fault {
    /// The peer sent something wrong (bad token, malformed bytes, wrong shape).
    Client,
    /// A worker failed.
    Worker,
    /// tidegate itself failed or is out of capacity.
    Internal,
}

/// An error code carried by [`crate::ErrorMsg`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum ErrorCode {
    /// Missing, unknown or wrong token.
    Unauthorized,
    /// The peer speaks a protocol version this side does not.
    UnsupportedVersion,
    /// Bytes that do not decode, or a message out of place.
    Malformed,
    /// A message over a size limit.
    TooLarge,
    /// A model nobody serves or knows.
    UnknownModel,
    /// A tensor that does not match the model's input.
    ShapeMismatch,
    /// A bound was hit; try again later.
    Overloaded,
    /// The receiver is draining and takes no new work.
    Draining,
    /// A bug or an unexpected failure.
    Internal,
    /// Nothing can serve the request yet (no worker has the model); retry.
    Unavailable,
}

/// Every code, in wire order (the index is the wire value).
const CODES: [ErrorCode; 10] = [
    ErrorCode::Unauthorized,
    ErrorCode::UnsupportedVersion,
    ErrorCode::Malformed,
    ErrorCode::TooLarge,
    ErrorCode::UnknownModel,
    ErrorCode::ShapeMismatch,
    ErrorCode::Overloaded,
    ErrorCode::Draining,
    ErrorCode::Internal,
    ErrorCode::Unavailable,
];

impl ErrorCode {
    /// The wire value.
    pub fn code(self) -> u16 {
        // Exhaustive, so a new variant cannot be sent as another code.
        match self {
            ErrorCode::Unauthorized => 0,
            ErrorCode::UnsupportedVersion => 1,
            ErrorCode::Malformed => 2,
            ErrorCode::TooLarge => 3,
            ErrorCode::UnknownModel => 4,
            ErrorCode::ShapeMismatch => 5,
            ErrorCode::Overloaded => 6,
            ErrorCode::Draining => 7,
            ErrorCode::Internal => 8,
            ErrorCode::Unavailable => 9,
        }
    }

    /// The code for a wire value; unknown values read as `Internal`.
    pub fn from_code(code: u16) -> Self {
        CODES
            .get(code as usize)
            .copied()
            .unwrap_or(ErrorCode::Internal)
    }

    /// The classification table: (fault, retryable, HTTP status).
    pub fn class(self) -> (Fault, bool, u16) {
        match self {
            ErrorCode::Unauthorized => (Fault::Client, false, 401),
            ErrorCode::UnsupportedVersion => (Fault::Client, false, 426),
            ErrorCode::Malformed => (Fault::Client, false, 400),
            ErrorCode::TooLarge => (Fault::Client, false, 413),
            ErrorCode::UnknownModel => (Fault::Client, false, 404),
            ErrorCode::ShapeMismatch => (Fault::Client, false, 422),
            ErrorCode::Overloaded => (Fault::Internal, true, 429),
            ErrorCode::Draining => (Fault::Worker, true, 503),
            ErrorCode::Internal => (Fault::Internal, true, 500),
            ErrorCode::Unavailable => (Fault::Internal, true, 503),
        }
    }

    /// Whose fault.
    pub fn fault(self) -> Fault {
        self.class().0
    }

    /// Whether the same request may succeed later.
    pub fn retryable(self) -> bool {
        self.class().1
    }

    /// The HTTP status an API maps this code to.
    pub fn http_status(self) -> u16 {
        self.class().2
    }

    /// The QUIC application error code used when closing a connection or
    /// resetting a stream for this reason (`0x100 + wire value`).
    pub fn quic_code(self) -> u32 {
        0x100 + self.code() as u32
    }

    /// The code a connection was closed with, when it is one of ours
    /// (`0x100 + code`); `None` for any other value (0 is a plain close,
    /// for example a gateway shutting down).
    pub fn from_quic_code(code: u64) -> Option<Self> {
        let wire = code.checked_sub(0x100)?;
        CODES.get(usize::try_from(wire).ok()?).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_our_close_codes_read_as_error_codes() {
        for c in CODES {
            assert_eq!(ErrorCode::from_quic_code(c.quic_code().into()), Some(c));
        }
        for other in [0, 1, 0xff, 0x100 + CODES.len() as u64, 0x1_0100, u64::MAX] {
            assert_eq!(ErrorCode::from_quic_code(other), None, "{other:#x}");
        }
    }

    #[test]
    fn every_code_round_trips_through_its_wire_value() {
        for (i, c) in CODES.into_iter().enumerate() {
            assert_eq!(c.code() as usize, i, "{c:?} is at its wire value in CODES");
            assert_eq!(ErrorCode::from_code(c.code()), c);
        }
        assert_eq!(ErrorCode::from_code(999), ErrorCode::Internal);
    }

    #[test]
    fn client_faults_are_not_retryable() {
        for c in CODES {
            if c.fault() == Fault::Client {
                assert!(!c.retryable(), "{c:?}");
                assert!((400..500).contains(&c.http_status()), "{c:?}");
            }
        }
    }
}
