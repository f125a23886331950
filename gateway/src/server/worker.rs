//! A worker's session: its `Register` (within [`REGISTER_TIMEOUT`]), its
//! place in the hub and the lease shell, then four loops side by side until
//! one ends: batches written ([`WorkerSession::write_dispatches`]), results
//! read ([`WorkerSession::read_results`]), the control stream read
//! (heartbeats, `Drain`: [`WorkerSession::read_control`]) and an
//! operator's drain told ([`WorkerSession::tell_drain`]). Then the hub is
//! told it has gone, and re-homes or fails what it held.
//!
//! It owns no frame: a batch comes from the hub (`HubMsg::WorkerConnected`
//! gave it the dispatch channel) and its result goes back to the hub
//! (`HubMsg::BatchDone`), which settles every frame in it.

use tidegate_protocol::quic::{read_message, read_message_of, write_message};
use tidegate_protocol::{Dispatch, Drain, Kind, Message, Register, Role};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::{
    DISPATCH_QUEUE, ErrorReply, HEARTBEAT_LOSS, HEARTBEAT_MS, Link, OPERATOR_DRAIN_MS,
    REGISTER_TIMEOUT, Server, refuse,
};
use crate::hub::HubMsg;
use crate::leasing::WorkerPass;
use crate::scheduler::WorkerId;
use std::time::Duration;

/// Why a worker's dispatch or result streams stopped.
#[derive(Debug, thiserror::Error)]
enum WorkerLinkError {
    /// The connection closed or failed.
    #[error("{0}")]
    Connection(#[from] quinn::ConnectionError),
    /// A batch could not be written.
    #[error("writing a batch: {0}")]
    Write(String),
    /// A batch result could not be read.
    #[error("unreadable batch result: {0}")]
    Unreadable(String),
}

/// One registered worker's connection.
struct WorkerSession<'s> {
    server: &'s Server,
    id: WorkerId,
    conn: quinn::Connection,
}

/// Serves a welcomed worker's connection until it ends, however it ends.
pub(super) async fn run(server: &Server, id: WorkerId, pass: Option<&WorkerPass>, link: Link) {
    let Link {
        name,
        conn,
        mut ctl_send,
        mut ctl_recv,
        cancel,
        revoked,
    } = link;
    let registered = await_register(
        server,
        &conn,
        (&mut ctl_send, &mut ctl_recv),
        name.clone(),
        (&cancel, &revoked),
    )
    .await;
    let Some(register) = registered else {
        return;
    };
    let session = WorkerSession {
        server,
        id,
        conn: conn.clone(),
    };
    let Some((dispatches, drain_request)) = session.join(register, pass).await else {
        return;
    };
    let mut was_revoked = false;
    tokio::select! {
        _ = cancel.cancelled() => conn.close(0u32.into(), b"gateway shutting down"),
        _ = revoked.cancelled() => was_revoked = true,
        _ = WorkerSession::tell_drain(&mut ctl_send, &drain_request) => {},
        r = session.write_dispatches(dispatches) => if let Err(e) = r {
            warn!("dispatch to worker failed: {e}")
        },
        e = session.read_results() => debug!("worker result streams ended: {e}"),
        _ = session.read_control(&mut ctl_recv) => {},
        _ = conn.closed() => {},
    }
    if was_revoked {
        // Its batches come back through WorkerGone below: re-homed or
        // failed, never lost.
        let reply = ErrorReply::Revoked {
            role: Role::Worker,
            name,
        };
        warn!("{reply}; closing the connection");
        refuse(&conn, &mut ctl_send, &reply).await;
    }
    info!("worker disconnected");
    conn.close(0u32.into(), b"bye");
    server.hub.send(HubMsg::WorkerGone { worker: id }).await;
}

/// The worker's `Register`, which it sends right after `Welcome` under the
/// name it logged in with. Until it comes the connection is bounded in time
/// and still answers a revocation (a reload that removed its entry) and
/// shutdown; anything else is refused, and `None`.
async fn await_register(
    server: &Server,
    conn: &quinn::Connection,
    (ctl_send, ctl_recv): (&mut quinn::SendStream, &mut quinn::RecvStream),
    name: String,
    (cancel, revoked): (&CancellationToken, &CancellationToken),
) -> Option<Register> {
    let read = tokio::select! {
        r = tokio::time::timeout(
            REGISTER_TIMEOUT,
            read_message_of(ctl_recv, &server.limits, &[Kind::Register]),
        ) => r,
        _ = revoked.cancelled() => {
            let reply = ErrorReply::Revoked { role: Role::Worker, name };
            warn!("{reply} before it registered; closing the connection");
            refuse(conn, ctl_send, &reply).await;
            return None;
        }
        _ = cancel.cancelled() => {
            conn.close(0u32.into(), b"gateway shutting down");
            return None;
        }
    };
    let reply = match read {
        Err(_) => ErrorReply::NoRegister {
            name,
            within: REGISTER_TIMEOUT,
        },
        // the name is what the API and the status page show, and what an
        // operator drains: a worker may not take another's
        Ok(Ok(Some(Message::Register(r)))) if r.worker != name => ErrorReply::RegisteredAs {
            name,
            registered: r.worker,
        },
        Ok(Ok(Some(Message::Register(r)))) => return Some(r),
        Ok(other) => ErrorReply::NotRegister {
            name,
            got: format!("{other:?}"),
        },
    };
    warn!("{reply}");
    refuse(conn, ctl_send, &reply).await;
    None
}

impl WorkerSession<'_> {
    /// Hands the registered worker to the hub (which may now dispatch to
    /// it) and tells the lease shell; its dispatch channel and the token
    /// an operator's drain cancels. `None` once the hub has stopped.
    async fn join(
        &self,
        register: Register,
        pass: Option<&WorkerPass>,
    ) -> Option<(mpsc::Receiver<Dispatch>, CancellationToken)> {
        info!(
            worker = %register.worker,
            device = %register.device,
            models = ?register.models.iter().map(|m| &m.name).collect::<Vec<_>>(),
            "worker registered"
        );
        let (dispatch_tx, dispatch_rx) = mpsc::channel(DISPATCH_QUEUE);
        let drain_request = CancellationToken::new();
        let joined = self
            .server
            .hub
            .send(HubMsg::WorkerConnected {
                worker: self.id,
                register,
                dispatch: dispatch_tx,
                lease: match pass {
                    Some(WorkerPass::Lease(l)) => Some(*l),
                    _ => None,
                },
                static_worker: match pass {
                    Some(WorkerPass::Static(name)) => Some(name.clone()),
                    _ => None,
                },
                drain: drain_request.clone(),
            })
            .await;
        if !joined {
            return None;
        }
        if let Some(leasing) = &self.server.leasing {
            match pass {
                Some(WorkerPass::Lease(l)) => leasing.registered(*l).await,
                Some(WorkerPass::Static(name)) => leasing.static_registered(name).await,
                None => {}
            }
        }
        Some((dispatch_rx, drain_request))
    }

    /// Writes each batch the hub dispatches on a stream of its own.
    async fn write_dispatches(
        &self,
        mut dispatches: mpsc::Receiver<Dispatch>,
    ) -> Result<(), WorkerLinkError> {
        while let Some(d) = dispatches.recv().await {
            let mut s = self.conn.open_uni().await?;
            write_message(&mut s, &Message::Dispatch(d))
                .await
                .map_err(|e| WorkerLinkError::Write(e.to_string()))?;
            s.finish()
                .map_err(|e| WorkerLinkError::Write(e.to_string()))?;
        }
        Ok(())
    }

    /// Reads batch results, one a stream, into the hub until the link
    /// fails; says how it failed.
    async fn read_results(&self) -> WorkerLinkError {
        loop {
            let mut recv = match self.conn.accept_uni().await {
                Ok(r) => r,
                Err(e) => return WorkerLinkError::Connection(e),
            };
            match read_message(&mut recv, &self.server.limits).await {
                Ok(Some(Message::BatchResult(result))) => {
                    self.server
                        .hub
                        .send(HubMsg::BatchDone {
                            worker: self.id,
                            result,
                        })
                        .await;
                }
                Ok(Some(other)) => {
                    warn!(kind = ?other.kind(), "unexpected message on a worker result stream")
                }
                Ok(None) => {}
                Err(e) => {
                    // A batch result we cannot read: the worker is broken.
                    // Treat it as lost so its frames are re-homed or
                    // failed, never forgotten.
                    warn!("unreadable batch result: {e}; dropping worker");
                    return WorkerLinkError::Unreadable(e.to_string());
                }
            }
        }
    }

    /// Reads the control stream: heartbeats, and the worker's own `Drain`.
    /// Returns when it ends, or when the worker has missed
    /// [`HEARTBEAT_LOSS`] heartbeats: a frozen worker is lost now, not when
    /// the QUIC idle timeout fires, so its batch is re-homed or failed
    /// while its frames may still make it.
    async fn read_control(&self, ctl_recv: &mut quinn::RecvStream) {
        loop {
            let read = tokio::time::timeout(
                Duration::from_millis((HEARTBEAT_LOSS * HEARTBEAT_MS) as u64),
                read_message(ctl_recv, &self.server.limits),
            );
            let Ok(msg) = read.await else {
                warn!(
                    missed = HEARTBEAT_LOSS,
                    "worker missed its heartbeats; treating it as lost"
                );
                return;
            };
            match msg {
                Ok(Some(Message::Drain(d))) => {
                    info!(
                        deadline_ms = d.deadline_ms,
                        "worker is draining; no new batches"
                    );
                    self.server
                        .hub
                        .send(HubMsg::WorkerDraining { worker: self.id })
                        .await;
                }
                Ok(Some(Message::Heartbeat(h))) => {
                    debug!(queue = h.queue_depth, util = h.utilization, "heartbeat")
                }
                Ok(Some(other)) => {
                    warn!(kind = ?other.kind(), "unexpected message on a worker control stream")
                }
                Ok(None) | Err(_) => return,
            }
        }
    }

    /// An operator's drain: tells the worker once, then waits for ever (the
    /// connection stays until the worker has finished its batches and
    /// gone).
    async fn tell_drain(ctl_send: &mut quinn::SendStream, drain_request: &CancellationToken) {
        drain_request.cancelled().await;
        let drain = Message::Drain(Drain {
            deadline_ms: OPERATOR_DRAIN_MS,
        });
        match write_message(ctl_send, &drain).await {
            Ok(()) => info!("operator drain sent to the worker"),
            Err(e) => warn!("sending Drain to the worker: {e}"),
        }
        std::future::pending::<()>().await
    }
}
