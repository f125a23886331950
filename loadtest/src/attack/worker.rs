//! A worker that lies: it registers a model with a profile far faster than
//! a real worker's, so that the scheduler prefers it, and then answers its
//! batches wrongly.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use tidegate_protocol::quic::{client_config, dial, handshake, read_message, write_message};
use tidegate_protocol::{
    BatchResult, Codec, Heartbeat, Hello, InputSpec, ItemResult, Limits, Message, ModelInfo,
    ProfilePoint, Register, Role, ShedReason, Status,
};
use tokio_util::sync::CancellationToken;

use super::AttackError;
use crate::cluster::Cluster;

/// How the liar answers a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Lie {
    /// Answers the first half of the frames `ok` (rounded down: nothing of
    /// a batch of one, so that its single-frame probes fail too), and
    /// nothing for the rest.
    HalfOfEachBatch,
    /// Answers every frame `shed`, a status only the gateway may assign.
    ShedEverything,
}

/// The batches the liar was sent: when, and how many frames.
pub type Received = Arc<Mutex<Vec<(Instant, usize)>>>;

/// Who the liar is and how it lies.
#[derive(Debug, Clone)]
pub struct LiarOptions {
    /// The gateway's QUIC address.
    pub gateway: SocketAddr,
    /// The CA its certificate is checked against.
    pub ca: PathBuf,
    /// A valid worker token.
    pub token: String,
    /// The worker name it registers as (one the gateway knows).
    pub name: String,
    /// The model it claims to serve (see [`model_as_registered`]).
    pub model: ModelInfo,
    /// How it answers.
    pub lie: Lie,
}

/// Model `name` as the cluster's real worker registered it (from the
/// gateway's API), with `max_batch` as its largest batch.
pub fn model_as_registered(
    c: &Cluster,
    name: &str,
    max_batch: u16,
) -> Result<ModelInfo, AttackError> {
    let (status, body) = c
        .get("/api/v1/models")
        .map_err(|e| AttackError::Api(format!("GET /api/v1/models: {e}")))?;
    let bad = |why: &str| AttackError::Api(format!("/api/v1/models ({status}): {why}: {body}"));
    if status != 200 {
        return Err(bad("not 200"));
    }
    let models: serde_json::Value = serde_json::from_str(&body).map_err(|_| bad("not JSON"))?;
    let m = models
        .as_array()
        .and_then(|a| a.iter().find(|m| m["name"] == name))
        .ok_or_else(|| bad(&format!("no model {name:?}")))?;
    Ok(ModelInfo {
        name: name.into(),
        version: m["version"].as_u64().ok_or_else(|| bad("no version"))? as u32,
        input: serde_json::from_value::<InputSpec>(m["input"].clone())
            .map_err(|_| bad("no input spec"))?,
        max_batch,
        labels: serde_json::from_value(m["labels"].clone()).map_err(|_| bad("no labels"))?,
    })
}

/// Runs the liar until `stop` fires or the gateway closes it: registers
/// `opts.model` as worker `opts.name`, heartbeats, and answers every batch
/// as `opts.lie` says, noting each batch in `received`. Sends `()` on
/// `registered` once it has registered.
pub async fn liar(
    opts: LiarOptions,
    received: Received,
    registered: std::sync::mpsc::Sender<()>,
    stop: CancellationToken,
) -> Result<(), AttackError> {
    let limits = Limits::default();
    let conn = dial(opts.gateway, "localhost", client_config(&opts.ca)?).await?;
    let hello = Hello {
        role: Role::Worker,
        name: opts.name.clone(),
        token: opts.token.clone(),
    };
    let (mut ctl_send, _ctl_recv, welcome) =
        handshake(&conn, hello, &limits)
            .await
            .map_err(|source| AttackError::Login {
                name: opts.name.clone(),
                source,
            })?;
    let point = |batch, latency_us| ProfilePoint {
        model: opts.model.name.clone(),
        batch,
        latency_us,
    };
    let register = Register {
        worker: opts.name.clone(),
        device: "a liar".into(),
        // Far faster than a CPU: the scheduler prefers it.
        profile: vec![point(1, 300), point(opts.model.max_batch, 600)],
        models: vec![opts.model.clone()],
        codecs: vec![Codec::Raw],
    };
    write_message(&mut ctl_send, &Message::Register(register))
        .await
        .map_err(|e| AttackError::Protocol {
            what: "registering the liar".into(),
            detail: e.to_string(),
        })?;
    let _ = registered.send(());
    let heartbeats = async move {
        let every = Duration::from_millis(u64::from(welcome.heartbeat_ms.max(100)));
        loop {
            let hb = Message::Heartbeat(Heartbeat {
                queue_depth: 0,
                utilization: 0.0,
            });
            if write_message(&mut ctl_send, &hb).await.is_err() {
                break;
            }
            tokio::time::sleep(every).await;
        }
    };
    tokio::select! {
        _ = heartbeats => {},
        _ = answer_batches(&conn, opts.lie, &received) => {},
        _ = stop.cancelled() => conn.close(0u32.into(), b"liar stopped"),
    }
    Ok(())
}

/// Answers every batch `conn` is sent as `lie` says, until the connection
/// ends.
async fn answer_batches(conn: &quinn::Connection, lie: Lie, received: &Received) {
    let limits = Limits::default();
    while let Ok(mut recv) = conn.accept_uni().await {
        let Ok(Some(Message::Dispatch(d))) = read_message(&mut recv, &limits).await else {
            continue;
        };
        received
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((Instant::now(), d.items.len()));
        let answer = |id, status| ItemResult {
            id,
            status,
            detections: Vec::new(),
            timings: Default::default(),
            outputs: Vec::new(),
        };
        let items = match lie {
            Lie::HalfOfEachBatch => d
                .items
                .iter()
                .take(d.items.len() / 2)
                .map(|i| answer(i.id, Status::Ok))
                .collect(),
            Lie::ShedEverything => d
                .items
                .iter()
                .map(|i| answer(i.id, Status::Shed(ShedReason::Overloaded)))
                .collect(),
        };
        let result = Message::BatchResult(BatchResult {
            batch: d.batch,
            items,
        });
        let Ok(mut s) = conn.open_uni().await else {
            break;
        };
        if write_message(&mut s, &result).await.is_ok() {
            let _ = s.finish();
        }
    }
}

/// Runs [`liar`] on a thread with a runtime of its own; returns once it
/// has registered (or failed to, within `within`), with the thread.
pub fn spawn_liar(
    opts: LiarOptions,
    received: Received,
    stop: CancellationToken,
    within: Duration,
) -> Result<std::thread::JoinHandle<Result<(), AttackError>>, AttackError> {
    let (registered_tx, registered) = std::sync::mpsc::channel();
    let thread = std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(AttackError::io("building the liar's runtime"))?
            .block_on(liar(opts, received, registered_tx, stop))
    });
    match registered.recv_timeout(within) {
        Ok(()) => Ok(thread),
        Err(_) if thread.is_finished() => match thread.join() {
            Ok(Err(e)) => Err(e),
            _ => Err(AttackError::Task(
                "the liar's thread ended unregistered".into(),
            )),
        },
        Err(_) => Err(AttackError::NoAnswer {
            what: "the liar's registration".into(),
            after: within,
        }),
    }
}
