//! What a holder of a valid edge token can try against the gateway.

use std::time::{Duration, Instant};

use serde::Serialize;
use tidegate_edge::uplink::{Uplink, UplinkOptions};
use tidegate_protocol::quic::{read_answer, read_message, write_message};
use tidegate_protocol::{
    CUT_MARK, CameraOpen, DType, Encoding, ErrorCode, ErrorMsg, Frame, Header, Hello, InputSpec,
    Kind, LatencyReport, Layout, Limits, Message, Role, Tensor,
};
use tokio_util::sync::CancellationToken;

use super::{AttackError, MIB, Target, hold_control, login, login_greedy};
use crate::loadgen::{self, LoadOptions};

/// Opens a frame stream declaring a `declared`-byte body and sends the
/// header and `sent` bytes of it, never finishing it; returns when the
/// stream fails (stopped by the gateway) or its connection closes.
///
/// The attacker's own view of a stop is not reliable: quinn reports a
/// write blocked on connection flow control as blocked before it looks at
/// whether the stream was stopped. The gateway's counters are what a
/// caller reads.
pub async fn partial_frame(conn: quinn::Connection, declared: usize, sent: usize) {
    let Ok(mut s) = conn.open_uni().await else {
        return;
    };
    let mut head = Vec::new();
    Header {
        kind: Kind::Frame,
        len: declared,
    }
    .encode(&mut head);
    if s.write_all(&head).await.is_err() {
        return;
    }
    let chunk = vec![0u8; MIB as usize];
    let mut left = sent;
    while left > 0 {
        let n = left.min(chunk.len());
        if s.write_all(&chunk[..n]).await.is_err() {
            return;
        }
        left -= n;
    }
    // Held open: dropping it would finish it.
    conn.closed().await;
}

/// Logs in as `edge` (greedily: see [`super::login_greedy`]), opens a
/// camera on `model` as a real edge would (so that its frames are not
/// refused for want of one), and opens `streams` frame streams of
/// [`partial_frame`], each declaring `declared` bytes and sending `sent`
/// of them, on tasks of the current runtime that end with the connection.
/// Returns the connection: closing it ends the attack.
pub async fn partial_frames(
    t: &Target,
    edge: &str,
    model: &str,
    streams: usize,
    declared: usize,
    sent: usize,
) -> Result<quinn::Connection, AttackError> {
    let (conn, mut send, mut recv) = login_greedy(t, edge).await?;
    open_camera(&mut send, &mut recv, "partial", model).await?;
    for _ in 0..streams {
        tokio::spawn(partial_frame(conn.clone(), declared, sent));
    }
    hold_control(&conn, send, recv);
    Ok(conn)
}

/// How a trickled frame stream ended.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Trickled {
    /// Body bytes written before the stream failed or the trickle ended.
    pub bytes: u64,
    /// The code the gateway stopped the stream with (QUIC `STOP_SENDING`),
    /// if it did within 5 s of the last write.
    pub stopped_with: Option<u32>,
}

/// Opens a frame stream declaring a `declared`-byte body, sends its header
/// and then one byte every `every`, at most `max_bytes` of them, until a
/// write fails (the gateway stopped the stream) or the bytes are sent; then
/// waits up to 5 s for the gateway's stop. The stream is reset, never
/// finished, when the trickle ends, or at once when `stop` fires.
pub async fn trickle(
    conn: &quinn::Connection,
    declared: usize,
    every: Duration,
    max_bytes: u64,
    stop: &CancellationToken,
) -> Result<Trickled, AttackError> {
    let mut s = conn.open_uni().await.map_err(|e| AttackError::Protocol {
        what: "opening a frame stream".into(),
        detail: e.to_string(),
    })?;
    let mut head = Vec::new();
    Header {
        kind: Kind::Frame,
        len: declared,
    }
    .encode(&mut head);
    let mut out = Trickled::default();
    let trickling = async {
        if s.write_all(&head).await.is_ok() {
            while out.bytes < max_bytes {
                if s.write_all(&[0]).await.is_err() {
                    break;
                }
                out.bytes += 1;
                tokio::time::sleep(every).await;
            }
        }
        if let Ok(Ok(Some(code))) = tokio::time::timeout(Duration::from_secs(5), s.stopped()).await
        {
            out.stopped_with = u32::try_from(code.into_inner()).ok();
        }
    };
    tokio::select! {
        () = trickling => {}
        _ = stop.cancelled() => {}
    }
    // Dropped, the stream would be finished: a short frame, not a trickle.
    let _ = s.reset(0u32.into());
    Ok(out)
}

/// What a control-message flood achieved.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ControlFlood {
    /// `LatencyReport`s written.
    pub sent: u64,
    /// The gateway's refusal: the `Error` on the control stream, or (if
    /// the close overtook it) the connection's close code and reason.
    pub refusal: Option<(ErrorCode, String)>,
}

/// Logs in as `edge` and writes `LatencyReport`s as fast as the connection
/// takes them, at most `max_reports` or for `max_time`, reading the control
/// stream beside it for the gateway's refusal.
pub async fn latency_report_flood(
    t: &Target,
    edge: &str,
    max_reports: u64,
    max_time: Duration,
) -> Result<ControlFlood, AttackError> {
    let (conn, mut send, mut recv) = login(t, edge).await?;
    let reader = tokio::spawn(async move {
        tokio::time::timeout(
            max_time + Duration::from_secs(10),
            read_message(&mut recv, &Limits::default()),
        )
        .await
    });
    let until = Instant::now() + max_time;
    let mut sent = 0u64;
    while sent < max_reports && Instant::now() < until {
        let report = Message::LatencyReport(LatencyReport {
            camera: "nobody".into(),
            seq: sent,
            e2e_us: 1,
        });
        if write_message(&mut send, &report).await.is_err() {
            break;
        }
        sent += 1;
    }
    let read = reader.await.map_err(|e| AttackError::Task(e.to_string()))?;
    let refusal = match read {
        Ok(Ok(Some(Message::Error(e)))) => Some((e.code, e.message)),
        _ => match conn.close_reason() {
            Some(quinn::ConnectionError::ApplicationClosed(a)) => {
                ErrorCode::from_quic_code(a.error_code.into())
                    .map(|code| (code, String::from_utf8_lossy(&a.reason).into_owned()))
            }
            _ => None,
        },
    };
    conn.close(0u32.into(), b"flood over");
    Ok(ControlFlood { sent, refusal })
}

/// `len` bytes of UTF-8 made of `c`, padded with ASCII: the longest string
/// the protocol lets a peer send is 1024 bytes.
pub fn name_of(c: char, len: usize) -> String {
    let mut s = String::new();
    while s.len() + c.len_utf8() <= len {
        s.push(c);
    }
    while s.len() < len {
        s.push('x');
    }
    s
}

/// The `Error` a conforming client reads on its control stream, at the
/// protocol's default limits, passing over the clock probes and hints the
/// gateway sends beside it; anything else, or nothing within `within`, is
/// an error.
pub async fn read_error(
    recv: &mut quinn::RecvStream,
    within: Duration,
) -> Result<ErrorMsg, AttackError> {
    let what = "the gateway's Error on the control stream";
    let until = tokio::time::Instant::now() + within;
    loop {
        let read = tokio::time::timeout_at(until, read_message(recv, &Limits::default()))
            .await
            .map_err(|_| AttackError::NoAnswer {
                what: what.into(),
                after: within,
            })?;
        match read {
            Ok(Some(Message::Error(e))) => return Ok(e),
            Ok(Some(Message::ClockProbe(_) | Message::ControlHint(_))) => continue,
            other => {
                return Err(AttackError::Protocol {
                    what: what.into(),
                    detail: format!("expected an Error the protocol decodes, got {other:?}"),
                });
            }
        }
    }
}

/// Dials the gateway and sends `Hello` as edge `name` with a wrong token;
/// returns the refusal it reads back (see [`read_error`]).
pub async fn refused_login(t: &Target, name: &str) -> Result<ErrorMsg, AttackError> {
    let conn = t.dial(t.client()?).await?;
    let (mut send, mut recv) = conn.open_bi().await.map_err(|e| AttackError::Protocol {
        what: "opening the control stream".into(),
        detail: e.to_string(),
    })?;
    let hello = Message::Hello(Hello {
        role: Role::Edge,
        name: name.into(),
        token: "not-the-token".into(),
    });
    write_message(&mut send, &hello)
        .await
        .map_err(|e| AttackError::Protocol {
            what: "sending Hello".into(),
            detail: e.to_string(),
        })?;
    let e = read_error(&mut recv, Duration::from_secs(20)).await;
    conn.close(0u32.into(), b"done");
    e
}

/// A `CameraOpen` of `camera` for `model` with an 80 ms budget, raw frames
/// and one copy.
pub fn camera_open(camera: &str, model: &str) -> CameraOpen {
    CameraOpen {
        camera: camera.into(),
        model: model.into(),
        budget_ms: 80,
        encoding: Encoding::Raw,
        copies: 1,
    }
}

/// Sends `open` on a logged-in edge's control stream and returns the
/// gateway's answer to it (passing over clock probes and hints).
pub async fn ask_camera(
    send: &mut quinn::SendStream,
    recv: &mut quinn::RecvStream,
    open: CameraOpen,
) -> Result<Message, AttackError> {
    let broken = |detail: String| AttackError::Protocol {
        what: "the answer to CameraOpen".into(),
        detail,
    };
    write_message(send, &Message::CameraOpen(open))
        .await
        .map_err(|e| broken(e.to_string()))?;
    read_answer(recv, &Limits::default())
        .await
        .map_err(|e| broken(e.to_string()))?
        .ok_or_else(|| broken("the control stream ended".into()))
}

/// Opens `camera` on `model` as a real edge would, with [`camera_open`]'s
/// settings; an answer other than `CameraAccepted` is an error. Returns the
/// input its frames must have.
pub async fn open_camera(
    send: &mut quinn::SendStream,
    recv: &mut quinn::RecvStream,
    camera: &str,
    model: &str,
) -> Result<InputSpec, AttackError> {
    match ask_camera(send, recv, camera_open(camera, model)).await? {
        Message::CameraAccepted(a) => Ok(a.input),
        other => Err(AttackError::Protocol {
            what: "the answer to CameraOpen".into(),
            detail: format!("not accepted: {other:?}"),
        }),
    }
}

/// Whether a refusal that quotes `quoted` is fitted to the protocol: no
/// longer than its string limit, marked as cut, and quoting a prefix of
/// `quoted` on a char boundary. `Err` says which of these it is not.
pub fn fitted(e: &ErrorMsg, quoted: &str) -> Result<(), String> {
    if e.message.len() > Limits::default().max_string_bytes {
        return Err(format!("{} bytes, over the limit", e.message.len()));
    }
    if !e.message.ends_with(CUT_MARK) {
        return Err("not marked as cut".into());
    }
    let start = e
        .message
        .find('\'')
        .ok_or_else(|| "quotes no name".to_string())?
        + 1;
    let kept = e.message[start..].trim_end_matches(CUT_MARK);
    let kept = kept.split('\'').next().unwrap_or(kept);
    if !quoted.starts_with(kept) {
        return Err("quotes something other than a prefix of the name".into());
    }
    Ok(())
}

/// What one flooding connection did.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Flooded {
    /// Frames handed to the connection's lanes.
    pub frames: u64,
}

/// One flooding connection: opens `opts.cameras` cameras declaring the
/// longest budget there is (`u32::MAX` µs), sends each a frame every
/// `1 / opts.fps` s without ever obeying a hint, reads (and drops) its
/// results, and when `stop` fires, or `opts.duration` has passed, closes
/// the connection at once, with whatever it has queued at the gateway, as a
/// crashing or vanishing edge does.
pub async fn flood(opts: LoadOptions, stop: CancellationToken) -> Result<Flooded, AttackError> {
    let uplink_err = |source| AttackError::Uplink {
        edge: opts.edge.clone(),
        source: Box::new(source),
    };
    let client = tidegate_protocol::quic::client_config_with(&opts.ca, opts.congestion)?;
    let (uplink, mut incoming) = Uplink::connect_client(
        &opts.gateway,
        &opts.server_name,
        client,
        &opts.edge,
        &opts.token,
        UplinkOptions::default(),
    )
    .await
    .map_err(uplink_err)?;
    let mut lanes = Vec::with_capacity(opts.cameras);
    let mut input = None;
    for i in 0..opts.cameras {
        let camera = format!("flood-{i}");
        let accepted = uplink
            .open_camera_with(CameraOpen {
                budget_ms: u32::MAX,
                encoding: opts.encoding,
                ..camera_open(&camera, &opts.model)
            })
            .await
            .map_err(uplink_err)?;
        input = Some(accepted.input);
        lanes.push((camera.clone(), uplink.lane(&camera, 4, Default::default())));
    }
    let input = input.ok_or_else(|| AttackError::Frame("a flood needs a camera".into()))?;
    let (pixels, geometry) = loadgen::frame_pixels(&input, opts.image.as_deref())
        .map_err(|e| AttackError::Frame(e.to_string()))?;
    let data = loadgen::encode_frame(&pixels, input.width, input.height, opts.encoding)
        .map_err(|e| AttackError::Frame(e.to_string()))?;
    let mut tensor = Tensor::raw(DType::U8, Layout::Nhwc, input.frame_shape(), data);
    tensor.encoding = opts.encoding;
    let results = tokio::spawn(async move { while incoming.recv().await.is_some() {} });
    let mut out = Flooded::default();
    let sending = async {
        let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / opts.fps));
        for seq in 1.. {
            tick.tick().await;
            for (camera, lane) in &lanes {
                let frame = Frame {
                    camera: camera.clone(),
                    seq,
                    captured_at_us: tidegate_edge::clock::now_us(),
                    budget_us: u32::MAX,
                    model: opts.model.clone(),
                    geometry,
                    tensor: tensor.clone(),
                };
                let until = tokio::time::Instant::now() + Duration::from_secs(60);
                if lane.send(frame, until).await.is_err() {
                    return;
                }
                out.frames += 1;
            }
        }
    };
    tokio::select! {
        _ = stop.cancelled() => {}
        _ = tokio::time::timeout(opts.duration, sending) => {}
    }
    uplink.close();
    results.abort();
    Ok(out)
}

/// `connections` flooding connections (see [`flood`]) under one edge name,
/// on a thread and runtime of their own, until `stop` fires (or
/// `opts.duration` passes); the thread ends once every connection has
/// closed, with the frames each sent.
pub fn flood_thread(
    opts: LoadOptions,
    connections: usize,
    stop: CancellationToken,
) -> std::thread::JoinHandle<Result<Vec<Flooded>, AttackError>> {
    std::thread::spawn(move || {
        super::runtime()?.block_on(async {
            let floods: Vec<_> = (0..connections)
                .map(|_| tokio::spawn(flood(opts.clone(), stop.clone())))
                .collect();
            let mut out = Vec::with_capacity(connections);
            for f in floods {
                out.push(f.await.map_err(|e| AttackError::Task(e.to_string()))??);
            }
            // A moment for the closes to reach the gateway.
            tokio::time::sleep(Duration::from_millis(300)).await;
            Ok(out)
        })
    })
}

/// What an edge trying more connections and cameras than it may have got.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Multiplied {
    /// Connections welcomed.
    pub welcomed: u64,
    /// Connections refused at login (`max_connections_per_edge`).
    pub refused: u64,
    /// Cameras accepted over all of them.
    pub cameras_accepted: u64,
    /// Cameras refused (`max_cameras_per_edge`).
    pub cameras_refused: u64,
}

/// Logs in as `edge` `connections` times, opens `cameras_each` distinct
/// cameras on each connection welcomed, and holds them all until `stop`
/// fires or `max_time` passes; then closes them.
pub async fn multiply(
    t: &Target,
    edge: &str,
    connections: usize,
    cameras_each: usize,
    stop: CancellationToken,
    max_time: Duration,
) -> Result<Multiplied, AttackError> {
    let mut out = Multiplied::default();
    let mut held = Vec::new();
    for c in 0..connections {
        let (conn, mut send, mut recv) = match login(t, edge).await {
            Ok(l) => l,
            Err(AttackError::Login { .. }) => {
                out.refused += 1;
                continue;
            }
            Err(e) => return Err(e),
        };
        out.welcomed += 1;
        for i in 0..cameras_each {
            let open = camera_open(&format!("many-{c}-{i}"), "blazeface");
            match ask_camera(&mut send, &mut recv, open).await? {
                Message::CameraAccepted(_) => out.cameras_accepted += 1,
                _ => out.cameras_refused += 1,
            }
        }
        held.push((conn, send, recv));
    }
    tokio::select! {
        _ = stop.cancelled() => {}
        _ = tokio::time::sleep(max_time) => {}
    }
    for (conn, _, _) in &held {
        conn.close(0u32.into(), b"attack over");
    }
    Ok(out)
}
