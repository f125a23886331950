//! What one edge name may hold over all its connections at once:
//! connections (`limits.max_connections_per_edge`), cameras
//! (`limits.max_cameras_per_edge`) and bytes of partly received frames
//! (`limits.edge_inflight_bytes`). A limit per connection alone would let
//! an edge multiply it by opening more connections. A name whose
//! connection was closed as a control flood may not connect again until
//! its cooldown ends (`limits.control_flood_cooldown_ms`,
//! [`FloodCooldowns`]).
//!
//! An edge connection holds an [`EdgeSlot`] from login to its end; dropping
//! it gives back the connection and the cameras it opened.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::inflight::ByteBudget;
use crate::ratelimit::FloodCooldowns;

/// The limits [`EdgeQuotas`] enforces, per edge name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct EdgeLimits {
    /// Connections open at once.
    pub(crate) connections: usize,
    /// Distinct cameras open at once.
    pub(crate) cameras: usize,
    /// Bytes of partly received frames.
    pub(crate) inflight_bytes: u64,
    /// The first cooldown after a control flood (zero: none).
    pub(crate) flood_cooldown: Duration,
}

/// What each edge name holds now.
#[derive(Debug)]
pub(crate) struct EdgeQuotas {
    limits: EdgeLimits,
    names: Mutex<HashMap<String, NameUse>>,
    /// Names closed as control floods, refused until their cooldown ends.
    floods: Mutex<FloodCooldowns>,
}

/// One edge name's share, while it has a connection.
#[derive(Debug)]
struct NameUse {
    connections: usize,
    /// Open cameras, with how many of the name's connections opened each.
    cameras: HashMap<String, usize>,
    /// Shared by the name's connections.
    inflight: Arc<ByteBudget>,
}

/// Why an edge's connection or camera is refused.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub(crate) enum QuotaError {
    /// The edge has its most connections open.
    #[error(
        "this edge already has {max} connections open, the most one edge may (limits.max_connections_per_edge); close one first"
    )]
    Connections {
        /// The limit.
        max: usize,
    },
    /// The edge has its most cameras open.
    #[error(
        "this edge already has {max} cameras open over its connections, the most one edge may (limits.max_cameras_per_edge)"
    )]
    Cameras {
        /// The limit.
        max: usize,
    },
    /// A connection of the edge was closed as a control flood, and its
    /// cooldown has not ended ([`crate::ratelimit::FloodCooldowns`]).
    #[error(
        "its connection was closed for flooding its control stream; log in again in {retry_after_ms} ms (limits.control_flood_cooldown_ms, doubling with each flood in a row)"
    )]
    FloodCooldown {
        /// Time left in the cooldown.
        retry_after_ms: u64,
    },
}

impl QuotaError {
    /// The `reason` label of `tidegate_quic_connections_refused_total`
    /// for a refused login.
    pub(crate) fn refused_reason(&self) -> &'static str {
        match self {
            QuotaError::FloodCooldown { .. } => "flood_cooldown",
            QuotaError::Connections { .. } | QuotaError::Cameras { .. } => "edge_connections",
        }
    }
}

impl EdgeQuotas {
    /// No edge connected yet.
    pub(crate) fn new(limits: EdgeLimits) -> Arc<Self> {
        Arc::new(EdgeQuotas {
            limits,
            names: Mutex::new(HashMap::new()),
            floods: Mutex::new(FloodCooldowns::new(limits.flood_cooldown)),
        })
    }

    /// Counts a new connection of edge `name` at `now`, or refuses it when
    /// the name's cooldown after a control flood runs or it has its most
    /// connections open.
    pub(crate) fn connect(
        self: &Arc<Self>,
        name: &str,
        now: Instant,
    ) -> Result<EdgeSlot, QuotaError> {
        let cooling = self
            .floods
            .lock()
            .expect("flood cooldowns lock")
            .refused(name, now);
        if let Some(left) = cooling {
            return Err(QuotaError::FloodCooldown {
                retry_after_ms: u64::try_from(left.as_millis()).unwrap_or(u64::MAX).max(1),
            });
        }
        let mut names = self.names.lock().expect("edge quota lock");
        let usage = names.entry(name.to_string()).or_insert_with(|| NameUse {
            connections: 0,
            cameras: HashMap::new(),
            inflight: ByteBudget::new(self.limits.inflight_bytes),
        });
        if usage.connections >= self.limits.connections {
            return Err(QuotaError::Connections {
                max: self.limits.connections,
            });
        }
        usage.connections += 1;
        Ok(EdgeSlot {
            quotas: self.clone(),
            name: name.to_string(),
            cameras: Mutex::new(HashSet::new()),
            inflight: usage.inflight.clone(),
        })
    }

    /// Connections and distinct cameras edge `name` has open.
    #[cfg(test)]
    fn usage(&self, name: &str) -> (usize, usize) {
        let names = self.names.lock().expect("edge quota lock");
        names
            .get(name)
            .map_or((0, 0), |u| (u.connections, u.cameras.len()))
    }
}

/// One edge connection's share of its name's quota.
#[derive(Debug)]
pub(crate) struct EdgeSlot {
    quotas: Arc<EdgeQuotas>,
    name: String,
    /// The cameras this connection counted.
    cameras: Mutex<HashSet<String>>,
    inflight: Arc<ByteBudget>,
}

impl EdgeSlot {
    /// Counts `camera` as open on this connection: true when this call
    /// counted it (undo with [`EdgeSlot::close_camera`] if the camera is
    /// refused for another reason), false when this connection had it
    /// already. Refused when it is new to the edge and the edge has its
    /// most cameras; a camera another connection of the edge has open is
    /// no new camera.
    pub(crate) fn open_camera(&self, camera: &str) -> Result<bool, QuotaError> {
        let mut mine = self.cameras.lock().expect("edge slot lock");
        if mine.contains(camera) {
            return Ok(false);
        }
        let mut names = self.quotas.names.lock().expect("edge quota lock");
        let usage = names
            .get_mut(&self.name)
            .expect("a name with a slot has its usage");
        let open_now = usage.cameras.len();
        match usage.cameras.get_mut(camera) {
            Some(holders) => *holders += 1,
            None if open_now >= self.quotas.limits.cameras => {
                return Err(QuotaError::Cameras {
                    max: self.quotas.limits.cameras,
                });
            }
            None => {
                usage.cameras.insert(camera.to_string(), 1);
            }
        }
        mine.insert(camera.to_string());
        Ok(true)
    }

    /// Takes back what [`EdgeSlot::open_camera`] counted for `camera`.
    pub(crate) fn close_camera(&self, camera: &str) {
        let mut mine = self.cameras.lock().expect("edge slot lock");
        if mine.remove(camera) {
            let mut names = self.quotas.names.lock().expect("edge quota lock");
            if let Some(usage) = names.get_mut(&self.name) {
                release_camera(usage, camera);
            }
        }
    }

    /// This connection was closed as a control flood at `now`: its name's
    /// cooldown starts (or doubles). Returns how long it is refused.
    pub(crate) fn flooded(&self, now: Instant) -> Duration {
        self.quotas
            .floods
            .lock()
            .expect("flood cooldowns lock")
            .flooded(&self.name, now)
    }

    /// The budget for partly received frames that the edge's connections
    /// share.
    pub(crate) fn inflight(&self) -> &Arc<ByteBudget> {
        &self.inflight
    }
}

fn release_camera(usage: &mut NameUse, camera: &str) {
    if let Some(holders) = usage.cameras.get_mut(camera) {
        *holders -= 1;
        if *holders == 0 {
            usage.cameras.remove(camera);
        }
    }
}

impl Drop for EdgeSlot {
    fn drop(&mut self) {
        let mine = std::mem::take(self.cameras.get_mut().expect("edge slot lock"));
        let mut names = self.quotas.names.lock().expect("edge quota lock");
        let Some(usage) = names.get_mut(&self.name) else {
            return;
        };
        for camera in &mine {
            release_camera(usage, camera);
        }
        usage.connections -= 1;
        if usage.connections == 0 {
            names.remove(&self.name);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn quotas(connections: usize, cameras: usize) -> Arc<EdgeQuotas> {
        EdgeQuotas::new(EdgeLimits {
            connections,
            cameras,
            inflight_bytes: 100,
            flood_cooldown: Duration::from_secs(1),
        })
    }

    #[test]
    fn a_name_closed_as_a_flood_is_refused_until_its_cooldown_ends() {
        let q = quotas(4, 10);
        let t0 = Instant::now();
        let slot = q.connect("edge-1", t0).unwrap();
        assert_eq!(slot.flooded(t0), Duration::from_secs(1));
        drop(slot);
        let e = q.connect("edge-1", t0).unwrap_err();
        assert_eq!(
            e,
            QuotaError::FloodCooldown {
                retry_after_ms: 1000
            }
        );
        assert_eq!(e.refused_reason(), "flood_cooldown");
        assert!(
            e.to_string().contains("limits.control_flood_cooldown_ms"),
            "{e}"
        );
        // another name is not held back, and the name is back at the end
        assert!(q.connect("edge-2", t0).is_ok());
        assert!(q.connect("edge-1", t0 + Duration::from_secs(1)).is_ok());
    }

    #[test]
    fn an_edge_past_its_connections_is_refused_until_one_ends() {
        let q = quotas(2, 10);
        let a = q.connect("edge-1", Instant::now()).unwrap();
        let _b = q.connect("edge-1", Instant::now()).unwrap();
        let e = q.connect("edge-1", Instant::now()).unwrap_err();
        assert_eq!(e, QuotaError::Connections { max: 2 });
        assert!(e.to_string().contains("max_connections_per_edge"), "{e}");
        // Another name has its own count.
        let _other = q.connect("edge-2", Instant::now()).unwrap();
        drop(a);
        assert!(q.connect("edge-1", Instant::now()).is_ok());
    }

    #[test]
    fn cameras_count_over_all_of_an_edges_connections_and_once_each() {
        let q = quotas(4, 3);
        let a = q.connect("edge-1", Instant::now()).unwrap();
        let b = q.connect("edge-1", Instant::now()).unwrap();
        assert_eq!(a.open_camera("cam-0"), Ok(true));
        assert_eq!(a.open_camera("cam-1"), Ok(true));
        assert_eq!(a.open_camera("cam-1"), Ok(false), "opened again");
        assert_eq!(b.open_camera("cam-2"), Ok(true));
        assert_eq!(
            b.open_camera("cam-3"),
            Err(QuotaError::Cameras { max: 3 }),
            "a fourth camera over two connections"
        );
        // cam-0 is open on the other connection: no new camera.
        assert_eq!(b.open_camera("cam-0"), Ok(true));
        assert_eq!(q.usage("edge-1"), (2, 3));
        // cam-0 stays open on b when a goes; cam-1 goes with a.
        drop(a);
        assert_eq!(q.usage("edge-1"), (1, 2));
        assert_eq!(b.open_camera("cam-3"), Ok(true));
        drop(b);
        assert_eq!(q.usage("edge-1"), (0, 0));
    }

    #[test]
    fn a_camera_refused_for_another_reason_is_not_counted() {
        let q = quotas(1, 1);
        let a = q.connect("edge-1", Instant::now()).unwrap();
        assert_eq!(a.open_camera("cam-0"), Ok(true));
        a.close_camera("cam-0");
        assert_eq!(q.usage("edge-1"), (1, 0));
        assert_eq!(a.open_camera("cam-1"), Ok(true));
    }

    #[test]
    fn an_edges_connections_share_one_budget_for_partly_received_frames() {
        let q = quotas(2, 1);
        let a = q.connect("edge-1", Instant::now()).unwrap();
        let b = q.connect("edge-1", Instant::now()).unwrap();
        let held = a.inflight().try_take(80).unwrap();
        assert!(b.inflight().try_take(30).is_none());
        drop(held);
        assert!(b.inflight().try_take(30).is_some());
    }

    proptest! {
        /// Any sequence of connects, opens, closes and disconnects over two
        /// names: no name ever has more connections or distinct cameras
        /// than its limits, the counts match the slots alive, and nothing
        /// is left once every slot is gone.
        #[test]
        fn an_edges_counts_never_pass_its_limits_and_all_come_back(
            ops in proptest::collection::vec((0u8..4, 0usize..2, 0usize..6), 1..200),
        ) {
            let q = quotas(3, 4);
            let names = ["edge-1", "edge-2"];
            let mut slots: Vec<(usize, EdgeSlot)> = Vec::new();
            for (op, name, n) in ops {
                match op {
                    0 => {
                        if let Ok(s) = q.connect(names[name], Instant::now()) {
                            slots.push((name, s));
                        }
                    }
                    1 if !slots.is_empty() => {
                        slots.remove(n % slots.len());
                    }
                    2 if !slots.is_empty() => {
                        let _ = slots[n % slots.len()].1.open_camera(&format!("cam-{n}"));
                    }
                    3 if !slots.is_empty() => {
                        slots[n % slots.len()].1.close_camera(&format!("cam-{n}"));
                    }
                    _ => {}
                }
                for (i, name) in names.iter().enumerate() {
                    let (conns, cams) = q.usage(name);
                    prop_assert!(conns <= 3 && cams <= 4);
                    prop_assert_eq!(conns, slots.iter().filter(|s| s.0 == i).count());
                    let mut open: HashSet<String> = HashSet::new();
                    for (_, s) in slots.iter().filter(|s| s.0 == i) {
                        open.extend(s.cameras.lock().unwrap().iter().cloned());
                    }
                    prop_assert_eq!(cams, open.len());
                }
            }
            slots.clear();
            prop_assert!(q.names.lock().unwrap().is_empty());
        }
    }
}
