//! Each case's attack, kept up from when it starts until the bench stops
//! it: an attack the gateway ends (a refused wave, a closed flood) starts
//! again, so that the legitimate load runs beside it throughout. Each runs
//! on a thread and runtime of its own and returns its tally as JSON.

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tidegate_protocol::quic::HandshakeError;
use tidegate_protocol::{ErrorCode, Message};
use tokio_util::sync::CancellationToken;

use super::{Attack, HOSTILE};
use crate::attack::edge::{self, ControlFlood};
use crate::attack::stranger::{Strangers, strangers};
use crate::attack::worker::{self, LiarOptions, Received};
use crate::attack::{AttackError, MIB, Target, http, login, runtime};
use crate::cluster::Cluster;

/// An attack running on its own thread; its tally when it ends.
pub(super) type Running = std::thread::JoinHandle<Result<Value, AttackError>>;

/// The model the legitimate edge and the attackers' cameras use.
const MODEL: &str = "blazeface";
/// Partial frames: streams a wave, and their declared and sent bytes.
const PARTIAL_STREAMS: usize = 32;
const PARTIAL_DECLARED: usize = 40 * MIB as usize;
/// A wave's connection is closed after this, and the next opened.
const PARTIAL_WAVE: Duration = Duration::from_secs(3);
/// Trickling streams at once, one byte a second each, each declaring a
/// frame its camera could send.
const TRICKLE_STREAMS: usize = 16;
const TRICKLE_DECLARED: usize = 64 * 1024;
/// Strangers a wave.
const STRANGERS: usize = 32;
/// The starving edge: connections, cameras on each, frames/s per camera.
const FLOOD_CONNECTIONS: usize = 2;
const FLOOD_CAMERAS: usize = 64;
const FLOOD_FPS: f64 = 4.0;
/// Most `LatencyReport`s per flooding connection.
const FLOOD_REPORTS: u64 = 400_000;
/// Half-open HTTP connections held.
const SLOWLORIS: usize = 1000;
/// Connections and cameras each tried under one edge name.
const MANY_CONNECTIONS: usize = 12;
const MANY_CAMERAS: usize = 160;
/// The liar's largest batch.
const LIAR_MAX_BATCH: u16 = 8;

/// Starts `attack` against `c`; it runs until `stop` fires, and at most
/// `max_time`.
pub(super) fn spawn(
    attack: Attack,
    c: &Cluster,
    stop: CancellationToken,
    max_time: Duration,
) -> Result<Running, AttackError> {
    let t = Target::of(c);
    let until = Instant::now() + max_time;
    Ok(match attack {
        Attack::Liar(lie) => {
            let opts = LiarOptions {
                gateway: t.quic,
                ca: t.ca.clone(),
                token: t.worker_token.clone(),
                name: "liar".into(),
                model: worker::model_as_registered(c, MODEL, LIAR_MAX_BATCH)?,
                lie,
            };
            let received = Received::default();
            let thread = worker::spawn_liar(
                opts,
                received.clone(),
                stop.clone(),
                Duration::from_secs(20),
            )?;
            std::thread::spawn(move || {
                wait(&stop, until);
                stop.cancel();
                let ended = thread.join();
                let batches = received.lock().unwrap_or_else(|e| e.into_inner()).clone();
                let frames: usize = batches.iter().map(|(_, n)| n).sum();
                match ended {
                    Ok(r) => r?,
                    Err(_) => return Err(AttackError::Task("the liar panicked".into())),
                }
                Ok(json!({ "lie": lie, "batches": batches.len(), "frames": frames }))
            })
        }
        Attack::Slowloris => std::thread::spawn(move || {
            let held = http::hold(t.http, SLOWLORIS, Duration::from_secs(1), &stop, until);
            Ok(json!(held))
        }),
        Attack::Starve => {
            let mut opts =
                c.load_options(HOSTILE, FLOOD_CAMERAS, FLOOD_FPS, max_time.as_secs_f64());
            opts.encoding = tidegate_protocol::Encoding::Jpeg { quality: 90 };
            std::thread::spawn(move || {
                let floods = edge::flood_thread(opts, FLOOD_CONNECTIONS, stop)
                    .join()
                    .map_err(|_| AttackError::Task("the flood panicked".into()))??;
                let frames: u64 = floods.iter().map(|f| f.frames).sum();
                Ok(json!({
                    "connections": FLOOD_CONNECTIONS,
                    "cameras_each": FLOOD_CAMERAS,
                    "fps": FLOOD_FPS,
                    "budget_us": u32::MAX,
                    "frames": frames,
                }))
            })
        }
        _ => std::thread::spawn(move || runtime()?.block_on(on_quic(attack, t, stop, until))),
    })
}

/// Sleeps until `stop` fires or `until` passes.
fn wait(stop: &CancellationToken, until: Instant) {
    while !stop.is_cancelled() && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Whether the attack is to go on.
fn going(stop: &CancellationToken, until: Instant) -> bool {
    !stop.is_cancelled() && Instant::now() < until
}

/// The attacks that speak QUIC from this runtime.
async fn on_quic(
    attack: Attack,
    t: Target,
    stop: CancellationToken,
    until: Instant,
) -> Result<Value, AttackError> {
    match attack {
        Attack::PartialFrames => partial_frames(&t, &stop, until).await,
        Attack::Trickle => trickle(&t, &stop, until).await,
        Attack::BeforeHello => {
            let (mut total, mut waves) = (Strangers::default(), 0u64);
            while going(&stop, until) {
                total.add(strangers(&t, STRANGERS).await?);
                waves += 1;
            }
            Ok(json!({ "waves": waves, "each": STRANGERS, "strangers": total }))
        }
        Attack::LongNames => long_names(&t, &stop, until).await,
        Attack::ControlFlood => control_flood(&t, &stop, until).await,
        Attack::ManyConnections => {
            let left = until.saturating_duration_since(Instant::now());
            let m = edge::multiply(&t, HOSTILE, MANY_CONNECTIONS, MANY_CAMERAS, stop, left).await?;
            Ok(
                json!({ "connections_tried": MANY_CONNECTIONS, "cameras_each": MANY_CAMERAS, "got": m }),
            )
        }
        Attack::Starve | Attack::Slowloris | Attack::Liar(_) => {
            unreachable!("started on threads of their own by `spawn`")
        }
    }
}

/// Waves of [`PARTIAL_STREAMS`] frames of 40 MiB, each sent but for its
/// last byte, on a new connection (with a camera open) every
/// [`PARTIAL_WAVE`].
async fn partial_frames(
    t: &Target,
    stop: &CancellationToken,
    until: Instant,
) -> Result<Value, AttackError> {
    let mut waves = 0u64;
    while going(stop, until) {
        let conn = edge::partial_frames(
            t,
            HOSTILE,
            MODEL,
            PARTIAL_STREAMS,
            PARTIAL_DECLARED,
            PARTIAL_DECLARED - 1,
        )
        .await?;
        waves += 1;
        tokio::select! {
            _ = tokio::time::sleep(PARTIAL_WAVE) => {}
            _ = stop.cancelled() => {}
        }
        conn.close(0u32.into(), b"wave over");
    }
    Ok(json!({
        "waves": waves,
        "streams_each": PARTIAL_STREAMS,
        "declared_bytes": PARTIAL_DECLARED,
    }))
}

/// [`TRICKLE_STREAMS`] frame streams at once on one connection, one byte
/// a second each, each opened again when the gateway stops it.
async fn trickle(
    t: &Target,
    stop: &CancellationToken,
    until: Instant,
) -> Result<Value, AttackError> {
    let (conn, mut send, mut recv) = login(t, HOSTILE).await?;
    edge::open_camera(&mut send, &mut recv, "trickle", MODEL).await?;
    crate::attack::hold_control(&conn, send, recv);
    let streams: Vec<_> = (0..TRICKLE_STREAMS)
        .map(|_| {
            let (conn, stop) = (conn.clone(), stop.clone());
            tokio::spawn(async move {
                let (mut opened, mut stopped, mut bytes) = (0u64, 0u64, 0u64);
                while going(&stop, until) {
                    let left = until.saturating_duration_since(Instant::now()).as_secs();
                    let every = Duration::from_secs(1);
                    let tr =
                        edge::trickle(&conn, TRICKLE_DECLARED, every, left.max(1), &stop).await?;
                    opened += 1;
                    bytes += tr.bytes;
                    stopped +=
                        u64::from(tr.stopped_with == Some(ErrorCode::Overloaded.quic_code()));
                }
                Ok::<_, AttackError>((opened, stopped, bytes))
            })
        })
        .collect();
    let (mut opened, mut stopped, mut bytes) = (0, 0, 0);
    for s in streams {
        let (o, st, b) = s.await.map_err(|e| AttackError::Task(e.to_string()))??;
        (opened, stopped, bytes) = (opened + o, stopped + st, bytes + b);
    }
    conn.close(0u32.into(), b"attack over");
    Ok(json!({
        "streams_at_once": TRICKLE_STREAMS,
        "streams": opened,
        "stopped_by_the_gateway": stopped,
        "bytes": bytes,
    }))
}

/// Logins with 1024-byte names (two- and four-byte UTF-8, and ASCII) and
/// a wrong token, one after another, and beside them camera opens quoting a
/// 1024-byte camera and model on a connection logged in first; every
/// refusal must decode and be fitted. Once the attacker's address is shut
/// out, its logins go unanswered (counted, and tried again at once); a
/// camera-open connection closed as a control flood logs in again at once.
async fn long_names(
    t: &Target,
    stop: &CancellationToken,
    until: Instant,
) -> Result<Value, AttackError> {
    let first = login(t, HOSTILE).await?;
    let logins = async {
        let names = [
            edge::name_of('é', 1024),
            edge::name_of('🦀', 1024),
            edge::name_of('n', 1024),
        ];
        let mut tally = Refusals::default();
        while going(stop, until) {
            for name in &names {
                match edge::refused_login(t, name).await {
                    Ok(e) if e.code == ErrorCode::Unauthorized => tally.check(&e, name),
                    Ok(e) => tally.unfitted(format!("login refused with {:?}", e.code)),
                    Err(AttackError::NoAnswer { .. }) => tally.unanswered += 1,
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(tally)
    };
    let opens = async {
        let (camera, model) = (edge::name_of('🦀', 1024), edge::name_of('€', 1024));
        let mut tally = Refusals::default();
        let mut link = Some(first);
        while going(stop, until) {
            let Some((_, send, recv)) = link.as_mut() else {
                // closed as a flood: in again at once, as a flooder would
                match login(t, HOSTILE).await {
                    Ok(l) => link = Some(l),
                    Err(AttackError::Login {
                        source:
                            HandshakeError::Refused {
                                code: ErrorCode::Overloaded,
                                ..
                            },
                        ..
                    }) => tally.kept_out += 1,
                    Err(AttackError::NoAnswer { .. }) => tally.unanswered += 1,
                    Err(e) => return Err(e),
                }
                continue;
            };
            let open = edge::camera_open(&camera, &model);
            match edge::ask_camera(send, recv, open).await {
                Ok(Message::Error(e)) if e.message.starts_with("control stream flooded") => {
                    tally.closed_as_floods += 1;
                    link = None;
                }
                Ok(Message::Error(e)) => tally.check(&e, &camera),
                Ok(other) => tally.unfitted(format!("camera answered {:?}", other.kind())),
                // the stream ended: its connection closed
                Err(AttackError::Protocol { .. }) => {
                    tally.closed_as_floods += 1;
                    link = None;
                }
                Err(e) => return Err(e),
            }
        }
        if let Some((conn, _, _)) = link {
            conn.close(0u32.into(), b"attack over");
        }
        Ok(tally)
    };
    let (logins, opens) = tokio::try_join!(logins, opens)?;
    let mut unfitted = [logins.unfitted, opens.unfitted].concat();
    unfitted.truncate(10);
    Ok(json!({
        "login_refusals": logins.refusals,
        "logins_unanswered": logins.unanswered,
        "camera_refusals": opens.refusals,
        "camera_connections_closed_as_floods": opens.closed_as_floods,
        "camera_logins_refused_in_cooldown": opens.kept_out,
        "camera_logins_unanswered": opens.unanswered,
        "fitted": logins.fitted + opens.fitted,
        "not_fitted_first_10": unfitted,
    }))
}

/// What [`long_names`] saw of the refusals of one kind.
#[derive(Default)]
struct Refusals {
    refusals: u64,
    fitted: u64,
    unfitted: Vec<String>,
    /// Dials its address's shut-out left unanswered.
    unanswered: u64,
    /// Connections closed as control floods.
    closed_as_floods: u64,
    /// Logins refused while its name's flood cooldown ran.
    kept_out: u64,
}

impl Refusals {
    /// A refusal quoting `quoted`: fitted to the protocol's limits or not.
    fn check(&mut self, e: &tidegate_protocol::ErrorMsg, quoted: &str) {
        self.refusals += 1;
        match edge::fitted(e, quoted) {
            Ok(()) => self.fitted += 1,
            Err(why) => self.unfitted.push(why),
        }
    }

    /// An answer that was no fitted refusal at all.
    fn unfitted(&mut self, what: String) {
        self.refusals += 1;
        if self.unfitted.len() < 10 {
            self.unfitted.push(what);
        }
    }
}

/// Floods `LatencyReport`s from one connection after another, logging in
/// again as soon as each is closed, as a flooder would; a login refused
/// while its name's cooldown runs, or left unanswered once its address is
/// shut out, is counted and tried again at once.
async fn control_flood(
    t: &Target,
    stop: &CancellationToken,
    until: Instant,
) -> Result<Value, AttackError> {
    let (mut floods, mut sent, mut refused, mut cooled) = (0u64, 0u64, 0u64, 0u64);
    let mut unanswered = 0u64;
    while going(stop, until) {
        let left = until.saturating_duration_since(Instant::now());
        let flood = tokio::select! {
            f = edge::latency_report_flood(t, HOSTILE, FLOOD_REPORTS, left) => f,
            _ = stop.cancelled() => break,
        };
        let ControlFlood { sent: n, refusal } = match flood {
            Ok(f) => f,
            Err(AttackError::Login {
                source:
                    HandshakeError::Refused {
                        code: ErrorCode::Overloaded,
                        ..
                    },
                ..
            }) => {
                cooled += 1;
                continue;
            }
            // its address shut out: dropped unanswered
            Err(AttackError::NoAnswer { .. }) => {
                unanswered += 1;
                continue;
            }
            Err(e) => return Err(e),
        };
        floods += 1;
        sent += n;
        refused += u64::from(refusal.is_some_and(|(code, _)| code == ErrorCode::Overloaded));
    }
    Ok(json!({
        "connections": floods,
        "reports_sent": sent,
        "closed_as_floods": refused,
        "logins_refused_in_cooldown": cooled,
        "logins_unanswered": unanswered,
    }))
}
