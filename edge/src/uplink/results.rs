//! The result streams' task: accepts each uni stream the gateway opens,
//! reads its one `Result`, drops later copies of a result already taken,
//! and hands the rest to the consumer's bounded queue ([`Incoming`]); the
//! consumer (the edge's node) takes them from there.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tidegate_protocol::queue;
use tidegate_protocol::quic::{ReadError, read_message};
use tidegate_protocol::{ErrorCode, FrameResult, Limits, Message};
use tokio::sync::Semaphore;
use tracing::{Instrument, debug, warn};

use super::Incoming;

/// Result streams read at once. Further streams wait unaccepted, within the
/// connection's stream and flow-control limits, while the readers wait for
/// room in the consumer's queue.
const RESULT_READERS: usize = 64;

/// The results taken of each camera opened with copies, by `seq` and
/// status: a later result of the same frame with the same status is a copy
/// and is dropped; one with another status is passed on, for the consumer
/// to see that a frame got two different results.
#[derive(Debug, Default)]
pub(super) struct ResultCopies {
    cameras: Mutex<HashMap<String, VecDeque<(u64, tidegate_protocol::Status)>>>,
    pub(super) dropped: AtomicU64,
}

impl ResultCopies {
    /// Results remembered per camera.
    const PER_CAMERA: usize = 256;

    /// Camera `camera` was opened with `copies`: with more than one, its
    /// results are deduplicated from now on; with one, no longer.
    pub(super) fn opened(&self, camera: &str, copies: u8) {
        let mut cams = self.cameras.lock().unwrap_or_else(PoisonError::into_inner);
        if copies > 1 {
            cams.entry(camera.to_string()).or_default();
        } else {
            cams.remove(camera);
        }
    }

    /// Whether `r` is to be passed on: not a copy of a result taken.
    fn take(&self, r: &FrameResult) -> bool {
        let mut cams = self.cameras.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(seen) = cams.get_mut(&r.camera) else {
            return true;
        };
        if seen
            .iter()
            .any(|(seq, status)| *seq == r.seq && *status == r.status)
        {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        if seen.len() == Self::PER_CAMERA {
            seen.pop_front();
        }
        seen.push_back((r.seq, r.status.clone()));
        true
    }
}

/// Accepts result streams and forwards their results, reading at most
/// [`RESULT_READERS`] streams at once. A reader waits for room in the
/// consumer's queue (a slot, and the result's bytes), so a slow consumer
/// slows the gateway down instead of losing results; what the edge holds
/// is bounded by that queue and the results its readers hold. A stream
/// that does not carry one well-formed `Result` is stopped with its error
/// code (protocol §7.3).
pub(super) async fn results(
    conn: quinn::Connection,
    incoming: queue::Sender<Incoming>,
    copies: Arc<ResultCopies>,
) {
    let readers = Arc::new(Semaphore::new(RESULT_READERS));
    loop {
        let permit = tokio::select! {
            p = readers.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break,
            },
            _ = conn.closed() => break,
        };
        let Ok(mut recv) = conn.accept_uni().await else {
            break;
        };
        let incoming = incoming.clone();
        let copies = copies.clone();
        tokio::spawn(
            async move {
                let _permit = permit;
                match read_message(&mut recv, &Limits::default()).await {
                    Ok(Some(Message::Result(r))) if !copies.take(&r) => {
                        debug!(camera = %r.camera, seq = r.seq, "a copy of a result taken; dropped");
                    }
                    Ok(Some(Message::Result(r))) => {
                        let size = r.held_bytes();
                        if incoming.send(Incoming::Result(r), size).await.is_err() {
                            debug!("result consumer gone");
                        }
                    }
                    Ok(Some(other)) => {
                        warn!(kind = ?other.kind(), "unexpected message on a result stream");
                        let _ = recv.stop(ErrorCode::Malformed.quic_code().into());
                    }
                    Ok(None) => {}
                    Err(ReadError::Stream(e)) => debug!("result stream failed: {e}"),
                    Err(e) => {
                        warn!("bad result stream: {e}");
                        let _ = recv.stop(e.code().quic_code().into());
                    }
                }
            }
            .in_current_span(),
        );
    }
}
