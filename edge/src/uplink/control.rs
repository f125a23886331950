//! The control stream's task: writes the edge's commands (`CameraOpen`,
//! `LatencyReport`), answers clock probes, matches `CameraAccepted` and
//! `Error` to the opens in order, and passes hints on to the consumer. A
//! stream that fails closes the connection with its error code. Frames and
//! results never travel here.

use std::collections::VecDeque;
use std::time::Duration;

use tidegate_protocol::queue;
use tidegate_protocol::quic::{ReadError, read_message, write_message};
use tidegate_protocol::{
    CameraAccepted, CameraOpen, ClockEcho, ErrorCode, ErrorMsg, LatencyReport, Limits, Message,
};
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, warn};

use super::{Incoming, UplinkError};

/// How long a failing control stream waits for its `Error` to be
/// acknowledged before the connection is closed anyway.
const ERROR_LINGER: Duration = Duration::from_secs(1);

/// What an [`Uplink`](super::Uplink) asks of its control task.
pub(super) enum Command {
    Open(
        CameraOpen,
        oneshot::Sender<Result<CameraAccepted, UplinkError>>,
    ),
    Latency(LatencyReport),
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Command::Open(o, _) => write!(f, "Open({})", o.camera),
            Command::Latency(r) => write!(f, "Latency({}#{})", r.camera, r.seq),
        }
    }
}

/// Why the control conversation ended.
enum ControlEnd {
    /// Every [`Uplink`] is gone: nobody can send a command any more.
    Dropped,
    /// The gateway finished the control stream.
    Finished,
    /// The control stream failed; the connection is closed with this code.
    Failed(ErrorCode, String),
}

/// Reads the next control message. It owns the stream while it reads and
/// hands it back, so that one read can stay in progress across the turns of
/// [`control`]'s loop: `read_message` is not cancel-safe, and a read dropped
/// half way through a message would desynchronise the stream.
async fn read_control(
    mut recv: quinn::RecvStream,
) -> (quinn::RecvStream, Result<Option<Message>, ReadError>) {
    let msg = read_message(&mut recv, &Limits::default()).await;
    (recv, msg)
}

/// Owns the control stream: writes commands, reads replies and hints. When
/// the stream fails it says why (`Error`, if it still can) and closes the
/// connection with the error's code (protocol §7.3), so that the uplink's
/// owner sees the connection end and redials.
pub(super) async fn control(
    conn: quinn::Connection,
    mut send: quinn::SendStream,
    recv: quinn::RecvStream,
    mut commands: mpsc::Receiver<Command>,
    incoming: queue::Sender<Incoming>,
) {
    // Camera opens are answered in order on this stream.
    let mut pending: VecDeque<oneshot::Sender<Result<CameraAccepted, UplinkError>>> =
        VecDeque::new();
    let mut read = Box::pin(read_control(recv));
    let end = loop {
        tokio::select! {
            cmd = commands.recv() => {
                let Some(cmd) = cmd else { break ControlEnd::Dropped };
                let msg = match cmd {
                    Command::Open(open, reply) => {
                        pending.push_back(reply);
                        Message::CameraOpen(open)
                    }
                    Command::Latency(r) => Message::LatencyReport(r),
                };
                if let Err(e) = write_message(&mut send, &msg).await {
                    break ControlEnd::Failed(
                        ErrorCode::Internal,
                        format!("writing the control stream: {e}"),
                    );
                }
            }
            (recv, msg) = &mut read => match msg {
                Ok(Some(msg)) => {
                    read.set(read_control(recv));
                    let Some(reply) = on_control_message(msg, &mut pending, &incoming).await else {
                        continue;
                    };
                    if let Err(e) = write_message(&mut send, &reply).await {
                        break ControlEnd::Failed(
                            ErrorCode::Internal,
                            format!("writing the control stream: {e}"),
                        );
                    }
                }
                Ok(None) => break ControlEnd::Finished,
                Err(e) => break ControlEnd::Failed(e.code(), format!("reading the control stream: {e}")),
            },
        }
    };
    let why = match end {
        ControlEnd::Dropped => "the uplink was dropped".to_string(),
        ControlEnd::Finished => {
            warn!("the gateway ended the control stream; closing the connection");
            conn.close(0u32.into(), b"the gateway ended the control stream");
            "the gateway ended it".to_string()
        }
        ControlEnd::Failed(code, message) => {
            if conn.close_reason().is_none() {
                warn!(?code, "{message}; closing the connection");
                // Say what was wrong if we still can, and give it a moment
                // to be acknowledged before the close discards it.
                let error = Message::Error(ErrorMsg {
                    code,
                    message: message.clone(),
                });
                let _ = tokio::time::timeout(ERROR_LINGER, async {
                    if write_message(&mut send, &error).await.is_ok() && send.finish().is_ok() {
                        let _ = send.stopped().await;
                    }
                })
                .await;
                conn.close(code.quic_code().into(), message.as_bytes());
            } else {
                debug!("control stream ended with the connection: {message}");
            }
            message
        }
    };
    for reply in pending {
        let _ = reply.send(Err(UplinkError::Lost(format!(
            "control stream closed: {why}"
        ))));
    }
}

/// Handles one message from the gateway's side of the control stream;
/// returns the answer to write back, if it needs one.
async fn on_control_message(
    msg: Message,
    pending: &mut VecDeque<oneshot::Sender<Result<CameraAccepted, UplinkError>>>,
    incoming: &queue::Sender<Incoming>,
) -> Option<Message> {
    match msg {
        // Answered at once, stamped on the clock `captured_at_us` uses: the
        // gateway estimates this edge's clock offset from it.
        Message::ClockProbe(p) => {
            return Some(Message::ClockEcho(ClockEcho {
                gateway_us: p.gateway_us,
                edge_us: crate::clock::now_us(),
            }));
        }
        Message::CameraAccepted(a) => match pending.pop_front() {
            Some(reply) => {
                let _ = reply.send(Ok(a));
            }
            None => warn!(camera = %a.camera, "CameraAccepted that answers no CameraOpen"),
        },
        Message::Error(e) => match pending.pop_front() {
            Some(reply) => {
                let _ = reply.send(Err(UplinkError::Refused {
                    code: e.code,
                    message: e.message,
                }));
            }
            None => warn!(code = ?e.code, "gateway error: {}", e.message),
        },
        // Waits for room rather than dropping the hint: a hint is rare and
        // the latest one is the one in force.
        Message::ControlHint(h) => {
            let hint = Incoming::Hint(h);
            let size = hint.held_bytes();
            if incoming.send(hint, size).await.is_err() {
                debug!("hint consumer gone");
            }
        }
        other => warn!(kind = ?other.kind(), "unexpected message on the control stream"),
    }
    None
}
