//! Connections that never log in: they try to push data before `Hello`.

use std::net::SocketAddr;

use serde::Serialize;

use super::{AttackError, MIB, Target};

/// How a connection that never logs in fared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stranger {
    /// Refused as it arrived (QUIC `CONNECTION_REFUSED`).
    Refused,
    /// Let in, then closed by the gateway; `pushed` is 1 if it could open
    /// a unidirectional stream at all.
    Closed {
        /// 1 if it opened a unidirectional stream, else 0.
        pushed: u32,
    },
}

/// Most bytes a stranger tries to push: 64 MiB.
pub const PUSH_BYTES: u64 = 64 * MIB;

/// Connects to `addr` without logging in, tries to open a unidirectional
/// stream and push [`PUSH_BYTES`] into it, and waits for the gateway to
/// close the connection.
pub async fn stranger(addr: SocketAddr, cfg: quinn::ClientConfig) -> Result<Stranger, AttackError> {
    let mut endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().expect("an address"))
        .map_err(AttackError::io("binding a stranger's UDP socket"))?;
    endpoint.set_default_client_config(cfg);
    let connecting = endpoint
        .connect(addr, "localhost")
        .map_err(|e| AttackError::Protocol {
            what: "a stranger's connection".into(),
            detail: e.to_string(),
        })?;
    let conn = match connecting.await {
        Ok(conn) => conn,
        Err(quinn::ConnectionError::ConnectionClosed(close))
            if close.error_code == quinn::TransportErrorCode::CONNECTION_REFUSED =>
        {
            return Ok(Stranger::Refused);
        }
        Err(e) => {
            return Err(AttackError::Protocol {
                what: "a stranger's connection".into(),
                detail: format!("failed otherwise than refused: {e}"),
            });
        }
    };
    let push = async {
        let mut s = conn.open_uni().await.ok()?;
        let chunk = vec![0u8; MIB as usize];
        for _ in 0..PUSH_BYTES / MIB {
            s.write_all(&chunk).await.ok()?;
        }
        Some(())
    };
    let pushed = tokio::select! {
        p = push => u32::from(p.is_some()),
        _ = conn.closed() => 0,
    };
    conn.closed().await;
    Ok(Stranger::Closed { pushed })
}

/// What a wave of strangers got.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Strangers {
    /// Let in (then closed at their `Hello` timeout).
    pub connected: u64,
    /// Refused as they arrived.
    pub refused: u64,
    /// Those that could open a unidirectional stream at all (must be 0).
    pub pushed: u64,
}

impl Strangers {
    /// Adds another wave's counts.
    pub fn add(&mut self, other: Strangers) {
        self.connected += other.connected;
        self.refused += other.refused;
        self.pushed += other.pushed;
    }
}

/// `n` [`stranger`]s at once, each on a task of its own; returns once the
/// gateway has refused or closed every one of them.
pub async fn strangers(t: &Target, n: usize) -> Result<Strangers, AttackError> {
    let attempts: Vec<_> = (0..n)
        .map(|_| t.client().map(|cfg| tokio::spawn(stranger(t.quic, cfg))))
        .collect::<Result<_, _>>()?;
    let mut out = Strangers::default();
    for a in attempts {
        match a.await.map_err(|e| AttackError::Task(e.to_string()))?? {
            Stranger::Refused => out.refused += 1,
            Stranger::Closed { pushed } => {
                out.connected += 1;
                out.pushed += u64::from(pushed);
            }
        }
    }
    Ok(out)
}
