//! Every `Error` the gateway sends on a control stream, in one enum: each
//! says its [`ErrorCode`] and its text, and [`ErrorReply::to_message`] is
//! the one way the server turns a reply into a wire message. That way
//! fits the text to the protocol's default string limit, so a reason that
//! quotes a peer's 1 KiB name still reaches a conforming peer as a reason
//! instead of as a malformed control stream.

use std::time::Duration;

use tidegate_protocol::{ErrorCode, ErrorMsg, Kind, Limits, Message, Role};

use crate::ratelimit::ControlRate;

/// What the gateway refuses, and why, as the peer is told.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum ErrorReply {
    /// The first message on a connection was not a `Hello`.
    NoHello {
        /// The kind that came instead (`None`: the stream ended).
        got: Option<Kind>,
    },
    /// A control stream's bytes could not be read as a message.
    Unreadable {
        /// The code the read error maps to (malformed, too large, version).
        code: ErrorCode,
        /// The read error, as it says itself.
        error: String,
    },
    /// The lease manager refused a leased or static worker's `Hello`.
    LeaseRefused {
        /// The worker's name.
        name: String,
        /// The lease manager's reason.
        reason: String,
        /// The worker may dial again later.
        retry_later: bool,
    },
    /// No credentials match this name and token.
    UnknownCredentials {
        /// Edge or worker.
        role: Role,
        /// The name it said in `Hello`.
        name: String,
    },
    /// A configuration reload took the credentials of a live connection
    /// away.
    Revoked {
        /// Edge or worker.
        role: Role,
        /// The name it said in `Hello`.
        name: String,
    },
    /// A worker sent no `Register` in time.
    NoRegister {
        /// The worker's name.
        name: String,
        /// How long it had.
        within: Duration,
    },
    /// A worker sent something else than `Register` after `Welcome`.
    NotRegister {
        /// The worker's name.
        name: String,
        /// What came instead.
        got: String,
    },
    /// A worker registered under a name other than its login's.
    RegisteredAs {
        /// The name it logged in with.
        name: String,
        /// The name in its `Register`.
        registered: String,
    },
    /// A `CameraOpen` with an empty camera name.
    EmptyCamera,
    /// A `CameraOpen` beyond the cameras one edge may have open over its
    /// connections.
    TooManyCameras {
        /// The camera.
        camera: String,
        /// The most cameras one edge may have open
        /// (`limits.max_cameras_per_edge`).
        max: usize,
    },
    /// An edge's login beyond what its name may hold (its connections).
    EdgeQuota {
        /// The edge's name.
        name: String,
        /// What it has too many of.
        quota: super::edge_quota::QuotaError,
    },
    /// A `CameraOpen` for a model no worker serves.
    NoWorker {
        /// The camera.
        camera: String,
        /// Its model.
        model: String,
    },
    /// The model's workers cannot take the camera's encoding (the hub's
    /// [`crate::hub::ServedModel::accepts`] says why).
    ModelRefused {
        /// The code the hub chose.
        code: ErrorCode,
        /// The hub's reason.
        reason: String,
    },
    /// A `CameraOpen` that came while the connection was over its
    /// control-message rate: not served, to be sent again.
    CameraOpenThrottled {
        /// The camera.
        camera: String,
        /// The rate it went over.
        rate: ControlRate,
    },
    /// A connection that kept sending control messages far above its rate;
    /// it is closed.
    ControlFlood {
        /// The rate it went over.
        rate: ControlRate,
        /// Messages dropped before it was closed.
        dropped: u64,
    },
}

impl ErrorReply {
    /// The code sent with the reply (and, when the connection is closed,
    /// the QUIC close code's base).
    pub(crate) fn code(&self) -> ErrorCode {
        match self {
            ErrorReply::NoHello { .. }
            | ErrorReply::NoRegister { .. }
            | ErrorReply::NotRegister { .. }
            | ErrorReply::EmptyCamera => ErrorCode::Malformed,
            ErrorReply::Unreadable { code, .. } | ErrorReply::ModelRefused { code, .. } => *code,
            ErrorReply::LeaseRefused { retry_later, .. } => {
                // `unavailable` is retryable: the worker dials again.
                if *retry_later {
                    ErrorCode::Unavailable
                } else {
                    ErrorCode::Unauthorized
                }
            }
            ErrorReply::UnknownCredentials { .. }
            | ErrorReply::Revoked { .. }
            | ErrorReply::RegisteredAs { .. } => ErrorCode::Unauthorized,
            ErrorReply::TooManyCameras { .. }
            | ErrorReply::EdgeQuota { .. }
            | ErrorReply::CameraOpenThrottled { .. }
            | ErrorReply::ControlFlood { .. } => ErrorCode::Overloaded,
            ErrorReply::NoWorker { .. } => ErrorCode::Unavailable,
        }
    }

    /// The reply's text fitted to what a conforming peer decodes (the
    /// protocol's default [`Limits::max_string_bytes`]), cut and marked
    /// when it is longer.
    pub(crate) fn text(&self) -> String {
        Limits::default().fit_string(&self.to_string()).into_owned()
    }

    /// The wire message: an `Error` whose text fits the protocol's default
    /// limits.
    pub(crate) fn to_message(&self) -> Message {
        Message::Error(ErrorMsg::within(
            &Limits::default(),
            self.code(),
            &self.to_string(),
        ))
    }
}

fn role_name(role: Role) -> &'static str {
    match role {
        Role::Edge => "edge",
        Role::Worker => "worker",
    }
}

impl std::fmt::Display for ErrorReply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ErrorReply::NoHello { got } => {
                write!(f, "expected Hello as the first message, got {got:?}")
            }
            ErrorReply::Unreadable { error, .. } => f.write_str(error),
            ErrorReply::LeaseRefused { name, reason, .. } => {
                write!(f, "worker '{name}' refused: {reason}")
            }
            ErrorReply::UnknownCredentials { role, name } => {
                let role = role_name(*role);
                write!(
                    f,
                    "{role} '{name}' refused: unknown name or wrong token (check its token and the gateway's [[{role}s]] entry)"
                )
            }
            ErrorReply::Revoked { role, name } => {
                let role = role_name(*role);
                write!(
                    f,
                    "{role} '{name}': credentials revoked by a configuration reload (no [[{role}s]] entry with this name and token any more)"
                )
            }
            ErrorReply::NoRegister { name, within } => {
                write!(
                    f,
                    "worker '{name}': no Register within {within:?} of its Welcome"
                )
            }
            ErrorReply::NotRegister { name, got } => {
                write!(
                    f,
                    "worker '{name}': expected Register after Welcome, got {got}"
                )
            }
            ErrorReply::RegisteredAs { name, registered } => write!(
                f,
                "worker '{name}' registered as '{registered}'; a worker registers under the name it authenticated with"
            ),
            ErrorReply::EmptyCamera => f.write_str("a camera's name must not be empty"),
            ErrorReply::TooManyCameras { camera, max } => write!(
                f,
                "camera '{camera}': this edge has {max} cameras open over its connections, the most one edge may (limits.max_cameras_per_edge)"
            ),
            ErrorReply::EdgeQuota { name, quota } => write!(f, "edge '{name}' refused: {quota}"),
            ErrorReply::NoWorker { camera, model } => write!(
                f,
                "camera '{camera}': no worker serves model '{model}' yet; retry later"
            ),
            ErrorReply::ModelRefused { reason, .. } => f.write_str(reason),
            ErrorReply::CameraOpenThrottled { camera, rate } => write!(
                f,
                "camera '{camera}': not opened, this connection sent control messages faster than {rate}; send the CameraOpen again in a second"
            ),
            ErrorReply::ControlFlood { rate, dropped } => write!(
                f,
                "control stream flooded: {dropped} messages over {rate} dropped; closing the connection (an edge sends a LatencyReport per result, a ClockEcho per probe)"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every reply the gateway can send, quoting `name` wherever it quotes
    /// a peer's string (and the worst lease and decode reasons: a name
    /// quoted inside).
    fn every_reply(name: &str) -> Vec<ErrorReply> {
        let rate = ControlRate::default();
        let s = || name.to_string();
        vec![
            ErrorReply::NoHello {
                got: Some(Kind::Frame),
            },
            ErrorReply::NoHello { got: None },
            ErrorReply::Unreadable {
                code: ErrorCode::TooLarge,
                error: format!("malformed message: camera '{name}' is too long"),
            },
            ErrorReply::LeaseRefused {
                name: s(),
                reason: format!("lease of '{name}' is already connected"),
                retry_later: true,
            },
            ErrorReply::LeaseRefused {
                name: s(),
                reason: s(),
                retry_later: false,
            },
            ErrorReply::UnknownCredentials {
                role: Role::Edge,
                name: s(),
            },
            ErrorReply::UnknownCredentials {
                role: Role::Worker,
                name: s(),
            },
            ErrorReply::Revoked {
                role: Role::Edge,
                name: s(),
            },
            ErrorReply::Revoked {
                role: Role::Worker,
                name: s(),
            },
            ErrorReply::NoRegister {
                name: s(),
                within: Duration::from_secs(10),
            },
            ErrorReply::NotRegister {
                name: s(),
                got: format!("{:?}", Some(name)),
            },
            ErrorReply::RegisteredAs {
                name: s(),
                registered: s(),
            },
            ErrorReply::EmptyCamera,
            ErrorReply::TooManyCameras {
                camera: s(),
                max: 1024,
            },
            ErrorReply::EdgeQuota {
                name: s(),
                quota: crate::server::edge_quota::QuotaError::Connections { max: 8 },
            },
            ErrorReply::EdgeQuota {
                name: s(),
                quota: crate::server::edge_quota::QuotaError::FloodCooldown {
                    retry_after_ms: u64::MAX,
                },
            },
            ErrorReply::NoWorker {
                camera: s(),
                model: s(),
            },
            ErrorReply::ModelRefused {
                code: ErrorCode::ShapeMismatch,
                reason: format!("model '{name}' cannot take jpeg frames: it wants f32"),
            },
            ErrorReply::CameraOpenThrottled { camera: s(), rate },
            ErrorReply::ControlFlood {
                rate,
                dropped: u64::MAX,
            },
        ]
    }

    /// 1024 bytes (the protocol's longest string) of ASCII, of two-byte,
    /// three-byte and four-byte chars, and of chars that straddle every
    /// byte offset.
    fn longest_names() -> Vec<String> {
        let max = Limits::default().max_string_bytes;
        let fill = |c: char| {
            let mut s = String::new();
            while s.len() + c.len_utf8() <= max {
                s.push(c);
            }
            while s.len() < max {
                s.push('a');
            }
            s
        };
        let mut names: Vec<String> = ['c', 'é', '€', '🦀'].into_iter().map(fill).collect();
        for pad in 1..4 {
            let mut s = "a".repeat(pad);
            s.push_str(&fill('🦀')[..max - pad - (max - pad) % 4]);
            names.push(s);
        }
        names
    }

    #[test]
    fn every_reply_quoting_the_longest_names_decodes_at_the_protocols_default_limits() {
        let limits = Limits::default();
        for name in longest_names() {
            assert!(name.len() <= limits.max_string_bytes);
            for reply in every_reply(&name) {
                let msg = reply.to_message();
                let mut wire = Vec::new();
                msg.encode(&mut wire);
                let decoded = Message::decode(&mut wire.as_slice(), &limits)
                    .unwrap_or_else(|e| panic!("{reply:?} does not decode: {e}"));
                let Message::Error(e) = decoded else {
                    panic!("{reply:?} decoded as {decoded:?}");
                };
                assert_eq!(e.code, reply.code(), "{reply:?}");
                assert!(e.message.len() <= limits.max_string_bytes);
                assert_eq!(e.message, reply.text(), "the close reason says the same");
                let full = reply.to_string();
                let kept = e
                    .message
                    .strip_suffix(tidegate_protocol::CUT_MARK)
                    .unwrap_or(&e.message);
                assert!(full.starts_with(kept), "a prefix of the full reason");
                assert!(!kept.is_empty());
            }
        }
    }

    #[test]
    fn a_reply_that_fits_is_sent_whole() {
        let reply = ErrorReply::NoWorker {
            camera: "door".into(),
            model: "blazeface".into(),
        };
        let Message::Error(e) = reply.to_message() else {
            panic!("an Error");
        };
        assert_eq!(
            e.message,
            "camera 'door': no worker serves model 'blazeface' yet; retry later"
        );
        assert_eq!(e.code, ErrorCode::Unavailable);
    }
}
