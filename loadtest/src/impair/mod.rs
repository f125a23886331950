//! A seeded WAN impairment, sans IO: what happens to each datagram on one
//! direction of an emulated link.
//!
//! The kernel on our test machines has no netem, so [`Relay`] (the async
//! shell in [`relay`]) emulates WAN conditions in userspace, between a QUIC
//! client and the gateway. Every decision is made here, by [`Link`]: the
//! shell tells it the time since the relay started and a datagram's length
//! ([`Link::on_packet`]) and gets a [`Verdict`]: deliver at a given time, or
//! drop, and why. Nothing here reads a clock or touches a socket, so a test
//! runs a day of traffic in milliseconds, and the same seed with the same
//! packet times gives the same verdicts (given the same releases,
//! [`Link::on_released`], which matter only at the hold limit). That holds
//! for a given build: the seeded generator is [`rand::rngs::StdRng`], whose
//! algorithm may change between rand versions.
//!
//! A packet's fate on one direction, in order:
//! 1. four random draws, for every packet whatever happens to it, so that a
//!    blackout or a full queue does not shift which later packets are lost;
//! 2. inside a blackout ([`Blackout`], or one started at run time with
//!    [`Link::blackout`]): dropped, [`DropReason::Blackout`];
//! 3. random loss ([`LinkConfig::loss`]): [`DropReason::Loss`];
//! 4. Gilbert–Elliott bursty loss ([`GilbertElliott`]):
//!    [`DropReason::BurstLoss`]; the chain steps once per packet;
//! 5. behind the rate cap ([`LinkConfig::rate_bps`]): a packet that would
//!    wait longer than [`LinkConfig::queue_ms`] for the link is tail-dropped,
//!    [`DropReason::QueueFull`]; otherwise it leaves the bottleneck after
//!    its wait and its own serialization time;
//! 6. the relay's hard cap on packets it holds for later delivery
//!    ([`MAX_HELD_PACKETS`], [`MAX_HELD_BYTES`]): [`DropReason::HoldLimit`];
//! 7. delivered at departure + [`LinkConfig::delay_ms`] ± jitter (uniform in
//!    [−[`LinkConfig::jitter_ms`], +jitter]); without
//!    [`LinkConfig::reorder`] a packet is never delivered before the one
//!    offered ahead of it (delivery times are monotone per direction).
//!
//! A packet accepted before a blackout starts is still delivered: it was
//! already on the wire.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

pub mod relay;

pub use relay::{
    DirectionStats, FlowStats, ImpairError, MAX_FLOWS, Relay, RelayOptions, RelayStats,
};

/// The longest one-way delay a link accepts (ms): ten times a
/// geostationary satellite hop, far past any WAN we emulate; a longer one
/// is a typo.
pub const MAX_DELAY_MS: f64 = 10_000.0;

/// The longest queue behind a rate cap (ms), for the same reason.
pub const MAX_QUEUE_MS: u64 = 10_000;

/// The queue behind a rate cap when a config gives none (ms): a modest
/// bufferbloat, as on a home router's uplink.
pub const DEFAULT_QUEUE_MS: u64 = 100;

/// The slowest rate cap (bit/s): below it one 1,200-byte QUIC packet takes
/// ten seconds to serialize, which is a link that is down, not slow (use a
/// blackout for that).
pub const MIN_RATE_BPS: u64 = 1_000;

/// The most blackouts a config may schedule.
pub const MAX_BLACKOUTS: usize = 1_024;

/// The most packets one direction holds for later delivery: with a 10k
/// packets/s flow and a one-second delay that is 10k held, so real
/// conditions stay under it, and a flood cannot grow the relay's memory
/// without bound.
pub const MAX_HELD_PACKETS: usize = 16_384;

/// The most payload bytes one direction holds for later delivery (see
/// [`MAX_HELD_PACKETS`]).
pub const MAX_HELD_BYTES: usize = 32 << 20;

/// Both directions of an emulated link, and the blackouts that cut both.
///
/// From TOML (every field optional; unknown fields are refused):
/// ```toml
/// seed = 7
/// [uplink]           # client -> upstream
/// delay_ms = 25
/// jitter_ms = 5
/// loss = 0.01
/// rate_bps = 10_000_000
/// queue_ms = 50
/// [uplink.burst]
/// p_good_to_bad = 0.01
/// p_bad_to_good = 0.25
/// [downlink]         # upstream -> client
/// delay_ms = 25
/// [[blackouts]]
/// start_ms = 5_000
/// duration_ms = 2_000
/// ```
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ImpairConfig {
    /// Seed of every random draw: the uplink draws from `seed`, the
    /// downlink from `seed + 1` (wrapping), so the two directions are
    /// independent.
    pub seed: u64,
    /// Client → upstream.
    pub uplink: LinkConfig,
    /// Upstream → client.
    pub downlink: LinkConfig,
    /// Times, from the relay's start, when every packet in both directions
    /// is dropped.
    pub blackouts: Vec<Blackout>,
}

/// One direction of an emulated link. Every delay is one-way: a 50 ms round
/// trip is `delay_ms = 25` on each direction.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LinkConfig {
    /// One-way propagation delay (ms), in [0, [`MAX_DELAY_MS`]].
    pub delay_ms: f64,
    /// Each packet's delay varies uniformly within ±`jitter_ms` of
    /// `delay_ms`; at most `delay_ms`, so no packet arrives before it was
    /// sent.
    pub jitter_ms: f64,
    /// Probability in [0, 1] that a packet is lost, independently of the
    /// others.
    pub loss: f64,
    /// Bursty loss on top of `loss`; none when absent.
    pub burst: Option<GilbertElliott>,
    /// Whether jitter may reorder packets. When false, a packet is never
    /// delivered before the one offered ahead of it (a jittered packet
    /// waits for its predecessor), as on a single path.
    pub reorder: bool,
    /// Bandwidth cap (bit/s), at least [`MIN_RATE_BPS`]; no cap when absent.
    pub rate_bps: Option<u64>,
    /// How long a packet may wait behind the rate cap before it is
    /// tail-dropped (ms), at most [`MAX_QUEUE_MS`]; only with `rate_bps`.
    pub queue_ms: u64,
}

impl Default for LinkConfig {
    fn default() -> Self {
        LinkConfig {
            delay_ms: 0.0,
            jitter_ms: 0.0,
            loss: 0.0,
            burst: None,
            reorder: false,
            rate_bps: None,
            queue_ms: DEFAULT_QUEUE_MS,
        }
    }
}

/// Gilbert–Elliott bursty loss: a two-state Markov chain (good, bad) that
/// steps once per packet, each state with its own loss probability. The
/// mean burst lasts `1 / p_bad_to_good` packets; in the long run the link
/// spends `p_good_to_bad / (p_good_to_bad + p_bad_to_good)` of its packets
/// in the bad state ([`GilbertElliott::stationary_loss`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GilbertElliott {
    /// Probability in [0, 1] of moving from good to bad after a packet.
    pub p_good_to_bad: f64,
    /// Probability in [0, 1] of moving from bad to good after a packet;
    /// above 0 when `p_good_to_bad` is.
    pub p_bad_to_good: f64,
    /// Loss probability in the good state (default 0).
    #[serde(default)]
    pub loss_good: f64,
    /// Loss probability in the bad state (default 1).
    #[serde(default = "one")]
    pub loss_bad: f64,
}

fn one() -> f64 {
    1.0
}

impl GilbertElliott {
    /// The long-run fraction of packets this chain loses:
    /// `(1 − π) · loss_good + π · loss_bad` with
    /// `π = p_good_to_bad / (p_good_to_bad + p_bad_to_good)`, the chain's
    /// stationary probability of the bad state (0 when it never leaves the
    /// good state it starts in).
    pub fn stationary_loss(&self) -> f64 {
        let moves = self.p_good_to_bad + self.p_bad_to_good;
        let bad = if moves > 0.0 {
            self.p_good_to_bad / moves
        } else {
            0.0
        };
        (1.0 - bad) * self.loss_good + bad * self.loss_bad
    }
}

/// A time, from the relay's start, when every packet in both directions is
/// dropped. Written `START_MS+DURATION_MS` on the command line
/// (`5000+2000`: from 5 s to 7 s).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Blackout {
    /// When it starts (ms after the relay started).
    pub start_ms: u64,
    /// How long it lasts (ms), above 0.
    pub duration_ms: u64,
}

impl FromStr for Blackout {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let usage = || {
            format!(
                "{s:?} is not START_MS+DURATION_MS; 5000+2000 cuts the link from 5 s to 7 s after start"
            )
        };
        let (start, duration) = s.split_once('+').ok_or_else(usage)?;
        let start_ms = start.trim().parse().map_err(|_| usage())?;
        let duration_ms = duration.trim().parse().map_err(|_| usage())?;
        let b = Blackout {
            start_ms,
            duration_ms,
        };
        b.check(0).map_err(|e| e.to_string())?;
        Ok(b)
    }
}

impl fmt::Display for Blackout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}+{}", self.start_ms, self.duration_ms)
    }
}

impl Blackout {
    fn check(&self, index: usize) -> Result<(), ConfigError> {
        if self.duration_ms == 0 {
            return Err(ConfigError::EmptyBlackout { index });
        }
        if self.start_ms.checked_add(self.duration_ms).is_none() {
            return Err(ConfigError::BlackoutOverflows { index });
        }
        Ok(())
    }
}

/// What is wrong with an [`ImpairConfig`]; each message names the field and
/// says what to give instead.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A probability outside [0, 1], or not a number.
    #[error("{field} = {value} is not a probability in [0, 1]; 0.02 means 2 %")]
    Probability {
        /// The field, such as `uplink.loss`.
        field: String,
        /// What it was.
        value: f64,
    },
    /// A delay or jitter that is negative, not a number, or above
    /// [`MAX_DELAY_MS`].
    #[error(
        "{field} = {value} is not a time in [0, {MAX_DELAY_MS}] ms; give it in milliseconds, one way (a 50 ms round trip is 25 each way)"
    )]
    Delay {
        /// The field, such as `uplink.delay_ms`.
        field: String,
        /// What it was.
        value: f64,
    },
    /// Jitter larger than the delay it varies: a packet would arrive before
    /// it was sent.
    #[error(
        "{direction}.jitter_ms = {jitter} exceeds {direction}.delay_ms = {delay}, so a one-way delay could go negative; lower the jitter or raise the delay to at least {jitter} ms"
    )]
    JitterAboveDelay {
        /// `uplink` or `downlink`.
        direction: String,
        /// The jitter (ms).
        jitter: f64,
        /// The delay (ms).
        delay: f64,
    },
    /// A rate cap below [`MIN_RATE_BPS`].
    #[error(
        "{direction}.rate_bps = {rate} is below {MIN_RATE_BPS} bit/s; leave rate_bps out for no cap, or use a blackout for a link that is down"
    )]
    Rate {
        /// `uplink` or `downlink`.
        direction: String,
        /// The rate (bit/s).
        rate: u64,
    },
    /// A queue longer than [`MAX_QUEUE_MS`].
    #[error(
        "{direction}.queue_ms = {queue_ms} is above {MAX_QUEUE_MS}; give a queue of at most {MAX_QUEUE_MS} ms"
    )]
    Queue {
        /// `uplink` or `downlink`.
        direction: String,
        /// The queue (ms).
        queue_ms: u64,
    },
    /// A Gilbert–Elliott chain that can enter its bad state and never leave.
    #[error(
        "{direction}.burst.p_bad_to_good = 0 with p_good_to_bad = {p_good_to_bad}: once bad the link would stay bad forever; give p_bad_to_good > 0 (1 / the mean burst length in packets), or use a blackout"
    )]
    BurstNeverEnds {
        /// `uplink` or `downlink`.
        direction: String,
        /// The chance of entering the bad state.
        p_good_to_bad: f64,
    },
    /// A blackout of no duration.
    #[error("blackouts[{index}]: duration_ms = 0 drops nothing; give it a duration or remove it")]
    EmptyBlackout {
        /// Its place in the list.
        index: usize,
    },
    /// A blackout whose end does not fit in 64 bits of milliseconds.
    #[error(
        "blackouts[{index}] ends past the end of time (start_ms + duration_ms overflows); give a smaller start or duration"
    )]
    BlackoutOverflows {
        /// Its place in the list.
        index: usize,
    },
    /// More blackouts than [`MAX_BLACKOUTS`].
    #[error("{count} blackouts is more than {MAX_BLACKOUTS}; merge the ones that touch")]
    TooManyBlackouts {
        /// How many were given.
        count: usize,
    },
}

impl ImpairConfig {
    /// The same impairment on both directions; `link`'s delay is one-way.
    pub fn symmetric(link: LinkConfig) -> ImpairConfig {
        ImpairConfig {
            uplink: link.clone(),
            downlink: link,
            ..ImpairConfig::default()
        }
    }

    /// Checks every field; the first problem found is the error.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.uplink.check("uplink")?;
        self.downlink.check("downlink")?;
        if self.blackouts.len() > MAX_BLACKOUTS {
            return Err(ConfigError::TooManyBlackouts {
                count: self.blackouts.len(),
            });
        }
        for (i, b) in self.blackouts.iter().enumerate() {
            b.check(i)?;
        }
        Ok(())
    }

    /// The uplink's and the downlink's state, each with the scheduled
    /// blackouts, seeded as [`ImpairConfig::seed`] says.
    pub fn links(&self) -> Result<(Link, Link), ConfigError> {
        self.validate()?;
        let mut up = Link::unchecked(&self.uplink, self.seed);
        let mut down = Link::unchecked(&self.downlink, self.seed.wrapping_add(1));
        for b in &self.blackouts {
            let (start, duration) = (
                Duration::from_millis(b.start_ms),
                Duration::from_millis(b.duration_ms),
            );
            up.blackout(start, duration);
            down.blackout(start, duration);
        }
        Ok((up, down))
    }
}

impl LinkConfig {
    /// The one-way delay.
    pub fn delay(&self) -> Duration {
        Duration::from_secs_f64(self.delay_ms / 1_000.0)
    }

    /// The most a packet's delay departs from [`LinkConfig::delay`].
    pub fn jitter(&self) -> Duration {
        Duration::from_secs_f64(self.jitter_ms / 1_000.0)
    }

    /// Checks every field, naming them `{direction}.field` in errors.
    fn check(&self, direction: &str) -> Result<(), ConfigError> {
        let time = |name: &str, value: f64| {
            if (0.0..=MAX_DELAY_MS).contains(&value) {
                Ok(())
            } else {
                Err(ConfigError::Delay {
                    field: format!("{direction}.{name}"),
                    value,
                })
            }
        };
        time("delay_ms", self.delay_ms)?;
        time("jitter_ms", self.jitter_ms)?;
        if self.jitter_ms > self.delay_ms {
            return Err(ConfigError::JitterAboveDelay {
                direction: direction.into(),
                jitter: self.jitter_ms,
                delay: self.delay_ms,
            });
        }
        let probability = |name: &str, value: f64| {
            if (0.0..=1.0).contains(&value) {
                Ok(())
            } else {
                Err(ConfigError::Probability {
                    field: format!("{direction}.{name}"),
                    value,
                })
            }
        };
        probability("loss", self.loss)?;
        if let Some(ge) = &self.burst {
            probability("burst.p_good_to_bad", ge.p_good_to_bad)?;
            probability("burst.p_bad_to_good", ge.p_bad_to_good)?;
            probability("burst.loss_good", ge.loss_good)?;
            probability("burst.loss_bad", ge.loss_bad)?;
            if ge.p_good_to_bad > 0.0 && ge.p_bad_to_good == 0.0 {
                return Err(ConfigError::BurstNeverEnds {
                    direction: direction.into(),
                    p_good_to_bad: ge.p_good_to_bad,
                });
            }
        }
        if let Some(rate) = self.rate_bps
            && rate < MIN_RATE_BPS
        {
            return Err(ConfigError::Rate {
                direction: direction.into(),
                rate,
            });
        }
        if self.queue_ms > MAX_QUEUE_MS {
            return Err(ConfigError::Queue {
                direction: direction.into(),
                queue_ms: self.queue_ms,
            });
        }
        Ok(())
    }
}

/// What becomes of one packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Hand it on at `at` (time since the relay started), not before.
    Deliver {
        /// When it is due.
        at: Duration,
    },
    /// It is lost.
    Drop(DropReason),
}

/// Why a packet was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum DropReason {
    /// Random, independent loss ([`LinkConfig::loss`]).
    Loss,
    /// The Gilbert–Elliott chain lost it ([`LinkConfig::burst`]).
    BurstLoss,
    /// It would have waited longer than [`LinkConfig::queue_ms`] behind the
    /// rate cap.
    QueueFull,
    /// It came during a blackout.
    Blackout,
    /// The relay already held [`MAX_HELD_PACKETS`] packets or
    /// [`MAX_HELD_BYTES`] bytes for this direction.
    HoldLimit,
}

/// A count of packets and of their bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tally {
    /// Packets.
    pub packets: u64,
    /// Their payload bytes.
    pub bytes: u64,
}

impl Tally {
    fn add(&mut self, len: usize) {
        self.packets += 1;
        self.bytes += len as u64;
    }

    /// Both counts summed.
    pub fn plus(self, other: Tally) -> Tally {
        Tally {
            packets: self.packets + other.packets,
            bytes: self.bytes + other.bytes,
        }
    }
}

/// Packets dropped, by [`DropReason`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DropCounters {
    /// [`DropReason::Loss`].
    pub loss: Tally,
    /// [`DropReason::BurstLoss`].
    pub burst_loss: Tally,
    /// [`DropReason::QueueFull`].
    pub queue_full: Tally,
    /// [`DropReason::Blackout`].
    pub blackout: Tally,
    /// [`DropReason::HoldLimit`].
    pub hold_limit: Tally,
}

impl DropCounters {
    /// The count for one reason.
    pub fn of(&self, reason: DropReason) -> Tally {
        match reason {
            DropReason::Loss => self.loss,
            DropReason::BurstLoss => self.burst_loss,
            DropReason::QueueFull => self.queue_full,
            DropReason::Blackout => self.blackout,
            DropReason::HoldLimit => self.hold_limit,
        }
    }

    fn slot(&mut self, reason: DropReason) -> &mut Tally {
        match reason {
            DropReason::Loss => &mut self.loss,
            DropReason::BurstLoss => &mut self.burst_loss,
            DropReason::QueueFull => &mut self.queue_full,
            DropReason::Blackout => &mut self.blackout,
            DropReason::HoldLimit => &mut self.hold_limit,
        }
    }

    /// Every reason summed.
    pub fn total(&self) -> Tally {
        self.loss
            .plus(self.burst_loss)
            .plus(self.queue_full)
            .plus(self.blackout)
            .plus(self.hold_limit)
    }
}

/// What one direction did with the packets offered to it. Always
/// `offered == delivered + dropped.total()` ([`LinkCounters::balanced`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinkCounters {
    /// Every packet [`Link::on_packet`] was asked about.
    pub offered: Tally,
    /// Those given [`Verdict::Deliver`].
    pub delivered: Tally,
    /// Those given [`Verdict::Drop`], by reason.
    pub dropped: DropCounters,
}

impl LinkCounters {
    /// Whether every packet offered is counted once, delivered or dropped.
    pub fn balanced(&self) -> bool {
        self.offered == self.delivered.plus(self.dropped.total())
    }
}

/// One direction's state: its config, random generator, Gilbert–Elliott
/// state, bottleneck queue, blackouts, the packets it has told the shell to
/// hold, and its counters. Times are [`Duration`]s since the relay started;
/// an earlier `now` than one already seen is taken as the latest seen (time
/// never runs backwards for a link).
#[derive(Debug)]
pub struct Link {
    delay: Duration,
    jitter: Duration,
    loss: f64,
    burst: Option<GilbertElliott>,
    reorder: bool,
    rate_bps: Option<u64>,
    queue: Duration,
    /// Disjoint `[start, end)` intervals, sorted; the ones over are pruned.
    blackouts: Vec<(Duration, Duration)>,
    rng: StdRng,
    /// The Gilbert–Elliott chain's state.
    bad: bool,
    /// The latest `now` seen.
    now: Duration,
    /// When the bottleneck finishes serializing the last packet accepted.
    busy_until: Duration,
    /// The latest delivery time given.
    last_at: Duration,
    held_packets: usize,
    held_bytes: usize,
    counters: LinkCounters,
}

impl Link {
    /// A link with `config` and no blackouts, its draws seeded with `seed`.
    pub fn new(config: &LinkConfig, seed: u64) -> Result<Link, ConfigError> {
        config.check("link")?;
        Ok(Link::unchecked(config, seed))
    }

    fn unchecked(config: &LinkConfig, seed: u64) -> Link {
        Link {
            delay: config.delay(),
            jitter: config.jitter(),
            loss: config.loss,
            burst: config.burst.clone(),
            reorder: config.reorder,
            rate_bps: config.rate_bps,
            queue: Duration::from_millis(config.queue_ms),
            blackouts: Vec::new(),
            rng: StdRng::seed_from_u64(seed),
            bad: false,
            now: Duration::ZERO,
            busy_until: Duration::ZERO,
            last_at: Duration::ZERO,
            held_packets: 0,
            held_bytes: 0,
            counters: LinkCounters::default(),
        }
    }

    /// Decides the fate of a packet of `len` bytes offered at `now`, and
    /// counts it. A delivered packet counts against the hold limit until
    /// [`Link::on_released`].
    pub fn on_packet(&mut self, now: Duration, len: usize) -> Verdict {
        let now = now.max(self.now);
        self.now = now;
        // Always four draws, in this order (see the module's doc).
        let u_loss: f64 = self.rng.random();
        let u_burst: f64 = self.rng.random();
        let u_step: f64 = self.rng.random();
        let u_jitter: f64 = self.rng.random();
        let burst_lost = match &self.burst {
            Some(ge) => {
                let lost = u_burst < if self.bad { ge.loss_bad } else { ge.loss_good };
                self.bad = if self.bad {
                    u_step >= ge.p_bad_to_good
                } else {
                    u_step < ge.p_good_to_bad
                };
                lost
            }
            None => false,
        };
        self.counters.offered.add(len);
        let verdict = self.decide(now, len, u_loss < self.loss, burst_lost, u_jitter);
        match verdict {
            Verdict::Deliver { .. } => self.counters.delivered.add(len),
            Verdict::Drop(reason) => self.counters.dropped.slot(reason).add(len),
        }
        verdict
    }

    fn decide(
        &mut self,
        now: Duration,
        len: usize,
        lost: bool,
        burst_lost: bool,
        u_jitter: f64,
    ) -> Verdict {
        if self.in_blackout(now) {
            return Verdict::Drop(DropReason::Blackout);
        }
        if lost {
            return Verdict::Drop(DropReason::Loss);
        }
        if burst_lost {
            return Verdict::Drop(DropReason::BurstLoss);
        }
        let departure = match self.rate_bps {
            Some(rate) => {
                let start = self.busy_until.max(now);
                if start - now > self.queue {
                    return Verdict::Drop(DropReason::QueueFull);
                }
                start + serialization(len, rate)
            }
            None => now,
        };
        if self.held_packets >= MAX_HELD_PACKETS || self.held_bytes + len > MAX_HELD_BYTES {
            return Verdict::Drop(DropReason::HoldLimit);
        }
        if self.rate_bps.is_some() {
            self.busy_until = departure;
        }
        // Uniform in [-jitter, +jitter]; jitter <= delay, so never before
        // departure.
        let offset = (2.0 * u_jitter - 1.0) * self.jitter.as_nanos() as f64;
        let offset = Duration::from_nanos(offset.abs().round() as u64).min(self.jitter);
        let mut at = if u_jitter >= 0.5 {
            departure + self.delay + offset
        } else {
            departure + self.delay - offset
        };
        if !self.reorder {
            at = at.max(self.last_at);
        }
        self.last_at = self.last_at.max(at);
        self.held_packets += 1;
        self.held_bytes += len;
        Verdict::Deliver { at }
    }

    /// The shell has sent (or given up on) a delivered packet of `len`
    /// bytes: it no longer counts against the hold limit.
    pub fn on_released(&mut self, len: usize) {
        self.held_packets = self.held_packets.saturating_sub(1);
        self.held_bytes = self.held_bytes.saturating_sub(len);
    }

    /// Drops every packet offered from `start` for `duration`, on top of the
    /// blackouts already set; ones that overlap merge.
    pub fn blackout(&mut self, start: Duration, duration: Duration) {
        if duration.is_zero() {
            return;
        }
        self.blackouts.push((start, start.saturating_add(duration)));
        self.blackouts.sort_unstable();
        let mut merged: Vec<(Duration, Duration)> = Vec::with_capacity(self.blackouts.len());
        for &(s, e) in &self.blackouts {
            match merged.last_mut() {
                Some(last) if s <= last.1 => last.1 = last.1.max(e),
                _ => merged.push((s, e)),
            }
        }
        self.blackouts = merged;
    }

    fn in_blackout(&mut self, now: Duration) -> bool {
        let over = self.blackouts.iter().take_while(|b| b.1 <= now).count();
        self.blackouts.drain(..over);
        self.blackouts.first().is_some_and(|b| b.0 <= now)
    }

    /// What this direction has done so far.
    pub fn counters(&self) -> &LinkCounters {
        &self.counters
    }

    /// Packets (and their bytes) delivered and not yet released.
    pub fn held(&self) -> (usize, usize) {
        (self.held_packets, self.held_bytes)
    }
}

/// How long `len` bytes take to serialize at `rate_bps`, rounded up to the
/// nanosecond.
pub fn serialization(len: usize, rate_bps: u64) -> Duration {
    let nanos = (len as u128 * 8 * 1_000_000_000).div_ceil(u128::from(rate_bps.max(1)));
    Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// Offers packets at the given times and lengths, releasing each
    /// delivered packet at once (the shell would release it when due).
    fn run(link: &mut Link, packets: &[(Duration, usize)]) -> Vec<Verdict> {
        packets
            .iter()
            .map(|&(t, len)| {
                let v = link.on_packet(t, len);
                if let Verdict::Deliver { .. } = v {
                    link.on_released(len);
                }
                v
            })
            .collect()
    }

    fn every_ms(n: usize, len: usize) -> Vec<(Duration, usize)> {
        (0..n).map(|i| (ms(i as u64), len)).collect()
    }

    fn link_config() -> impl Strategy<Value = LinkConfig> {
        let burst = prop::option::of(
            (0.0..0.2f64, 0.05..1.0f64, 0.0..0.1f64, 0.5..=1.0f64).prop_map(|(p, r, g, b)| {
                GilbertElliott {
                    p_good_to_bad: p,
                    p_bad_to_good: r,
                    loss_good: g,
                    loss_bad: b,
                }
            }),
        );
        (
            0.0..200.0f64,
            0.0..=1.0f64,
            0.0..0.3f64,
            burst,
            any::<bool>(),
            prop::option::of(8_000u64..50_000_000),
            0u64..200,
        )
            .prop_map(
                |(delay_ms, jitter_share, loss, burst, reorder, rate_bps, queue_ms)| LinkConfig {
                    delay_ms,
                    jitter_ms: delay_ms * jitter_share,
                    loss,
                    burst,
                    reorder,
                    rate_bps,
                    queue_ms,
                },
            )
    }

    /// Packets at non-decreasing times (gaps of 0 to 20 ms), 1 to 1,500
    /// bytes each.
    fn packets() -> impl Strategy<Value = Vec<(Duration, usize)>> {
        prop::collection::vec((0u64..20_000, 1usize..1_500), 1..300).prop_map(|gaps| {
            let mut t = Duration::ZERO;
            gaps.into_iter()
                .map(|(gap_us, len)| {
                    t += Duration::from_micros(gap_us);
                    (t, len)
                })
                .collect()
        })
    }

    proptest! {
        #[test]
        fn the_same_seed_and_packet_times_give_the_same_verdicts(
            config in link_config(), packets in packets(), seed in any::<u64>()
        ) {
            let a = run(&mut Link::new(&config, seed).unwrap(), &packets);
            let b = run(&mut Link::new(&config, seed).unwrap(), &packets);
            prop_assert_eq!(a, b);
        }

        #[test]
        fn no_packet_is_delivered_before_now_plus_delay_minus_jitter(
            config in link_config(), packets in packets(), seed in any::<u64>()
        ) {
            let mut link = Link::new(&config, seed).unwrap();
            let earliest = config.delay() - config.jitter();
            for (&(t, _), v) in packets.iter().zip(run(&mut link, &packets)) {
                if let Verdict::Deliver { at } = v {
                    prop_assert!(at >= t + earliest, "offered at {t:?}, due at {at:?}");
                }
            }
        }

        #[test]
        fn without_reorder_delivery_times_never_decrease(
            config in link_config(), packets in packets(), seed in any::<u64>()
        ) {
            let config = LinkConfig { reorder: false, ..config };
            let mut link = Link::new(&config, seed).unwrap();
            let mut last = Duration::ZERO;
            for v in run(&mut link, &packets) {
                if let Verdict::Deliver { at } = v {
                    prop_assert!(at >= last, "{at:?} before {last:?}");
                    last = at;
                }
            }
        }

        #[test]
        fn no_delivered_packet_waits_behind_the_cap_longer_than_the_queue_bound(
            config in link_config(), packets in packets(), seed in any::<u64>(),
            rate in 8_000u64..2_000_000
        ) {
            // No jitter, so what is left after the delay is the wait behind
            // the cap plus the packet's own serialization.
            let config = LinkConfig { jitter_ms: 0.0, rate_bps: Some(rate), ..config };
            let mut link = Link::new(&config, seed).unwrap();
            for (&(t, len), v) in packets.iter().zip(run(&mut link, &packets)) {
                if let Verdict::Deliver { at } = v {
                    let waited = at - config.delay() - t;
                    let bound = Duration::from_millis(config.queue_ms) + serialization(len, rate);
                    prop_assert!(waited <= bound, "waited {waited:?} > {bound:?}");
                }
            }
        }

        #[test]
        fn packets_in_a_blackout_are_all_dropped(
            config in link_config(), packets in packets(), seed in any::<u64>(),
            start_ms in 0u64..3_000, duration_ms in 1u64..2_000
        ) {
            let cfg = ImpairConfig {
                seed,
                uplink: config,
                blackouts: vec![Blackout { start_ms, duration_ms }],
                ..ImpairConfig::default()
            };
            let (mut link, _) = cfg.links().unwrap();
            let (start, end) = (ms(start_ms), ms(start_ms + duration_ms));
            for (&(t, _), v) in packets.iter().zip(run(&mut link, &packets)) {
                let inside = start <= t && t < end;
                prop_assert_eq!(inside, v == Verdict::Drop(DropReason::Blackout), "at {:?}", t);
            }
        }

        #[test]
        fn offered_is_always_delivered_plus_dropped(
            config in link_config(), packets in packets(), seed in any::<u64>(),
            blackout_ms in 0u64..3_000
        ) {
            let mut link = Link::new(&config, seed).unwrap();
            link.blackout(ms(blackout_ms), ms(500));
            let mut held = Vec::new();
            for &(t, len) in &packets {
                // Release only what is due, as the shell does.
                held.retain(|&(at, l)| if at <= t { link.on_released(l); false } else { true });
                if let Verdict::Deliver { at } = link.on_packet(t, len) {
                    held.push((at, len));
                }
                let c = link.counters();
                prop_assert!(c.balanced(), "{c:?}");
                prop_assert_eq!(link.held().0, held.len());
            }
            prop_assert_eq!(link.counters().offered.packets, packets.len() as u64);
        }
    }

    #[test]
    fn random_loss_of_two_percent_over_100_000_packets_is_two_percent() {
        let config = LinkConfig {
            loss: 0.02,
            ..LinkConfig::default()
        };
        let mut link = Link::new(&config, 7).unwrap();
        run(&mut link, &every_ms(100_000, 100));
        let c = link.counters();
        assert_eq!(c.offered.packets, 100_000);
        let lost = c.dropped.loss.packets as f64 / 100_000.0;
        // One standard deviation is 0.00044: four and a half of them.
        assert!((lost - 0.02).abs() < 0.002, "lost {lost}");
        assert_eq!(c.dropped.total(), c.dropped.loss);
        assert!(c.balanced());
    }

    #[test]
    fn gilbert_elliott_long_run_loss_matches_its_stationary_formula() {
        let ge = GilbertElliott {
            p_good_to_bad: 0.01,
            p_bad_to_good: 0.25,
            loss_good: 0.001,
            loss_bad: 0.8,
        };
        let expected = ge.stationary_loss();
        assert!((expected - (0.25 / 0.26 * 0.001 + 0.01 / 0.26 * 0.8)).abs() < 1e-12);
        let config = LinkConfig {
            burst: Some(ge),
            ..LinkConfig::default()
        };
        let mut link = Link::new(&config, 11).unwrap();
        let n = 400_000;
        let verdicts = run(&mut link, &every_ms(n, 100));
        let lost = link.counters().dropped.burst_loss.packets as f64 / n as f64;
        assert!(
            (lost - expected).abs() < 0.1 * expected,
            "lost {lost}, stationary {expected}"
        );
        // Bursty: a loss is far more often followed by another than the
        // long-run rate.
        let after_loss = verdicts
            .windows(2)
            .filter(|w| w[0] == Verdict::Drop(DropReason::BurstLoss))
            .collect::<Vec<_>>();
        let again = after_loss.iter().filter(|w| w[1] == w[0]).count() as f64;
        assert!(
            again / after_loss.len() as f64 > 5.0 * expected,
            "{again} of {}",
            after_loss.len()
        );
    }

    #[test]
    fn with_reorder_jittered_packets_can_overtake_and_without_they_wait() {
        let config = LinkConfig {
            delay_ms: 20.0,
            jitter_ms: 10.0,
            reorder: true,
            ..LinkConfig::default()
        };
        let packets = every_ms(200, 100);
        let overtaken = |config: &LinkConfig| {
            let vs = run(&mut Link::new(config, 3).unwrap(), &packets);
            let ats: Vec<Duration> = vs
                .iter()
                .map(|v| match v {
                    Verdict::Deliver { at } => *at,
                    Verdict::Drop(r) => panic!("dropped: {r:?}"),
                })
                .collect();
            ats.windows(2).filter(|w| w[1] < w[0]).count()
        };
        assert!(overtaken(&config) > 10);
        let in_order = LinkConfig {
            reorder: false,
            ..config
        };
        assert_eq!(overtaken(&in_order), 0);
    }

    #[test]
    fn a_rate_cap_spaces_packets_by_their_serialization_time_and_tail_drops_a_burst() {
        // 1 Mbit/s: 1,250 bytes take 10 ms; a 25 ms queue holds the one
        // being sent plus two behind it, and a burst of 10 at once loses 7.
        let config = LinkConfig {
            delay_ms: 5.0,
            rate_bps: Some(1_000_000),
            queue_ms: 25,
            ..LinkConfig::default()
        };
        let mut link = Link::new(&config, 1).unwrap();
        let burst: Vec<(Duration, usize)> = (0..10).map(|_| (ms(100), 1_250)).collect();
        let vs = run(&mut link, &burst);
        let ats: Vec<Duration> = vs
            .iter()
            .filter_map(|v| match v {
                Verdict::Deliver { at } => Some(*at),
                Verdict::Drop(_) => None,
            })
            .collect();
        assert_eq!(ats, vec![ms(115), ms(125), ms(135)]);
        assert_eq!(link.counters().dropped.queue_full.packets, 7);
        assert_eq!(link.counters().dropped.queue_full.bytes, 7 * 1_250);
        // Once the queue has drained, a packet goes straight through.
        assert_eq!(
            link.on_packet(ms(200), 1_250),
            Verdict::Deliver { at: ms(215) }
        );
        assert_eq!(serialization(1_250, 1_000_000), ms(10));
    }

    #[test]
    fn a_blackout_started_at_run_time_drops_until_it_ends() {
        let mut link = Link::new(&LinkConfig::default(), 1).unwrap();
        assert_eq!(link.on_packet(ms(10), 1), Verdict::Deliver { at: ms(10) });
        link.blackout(ms(10), ms(100));
        for t in [10, 50, 109] {
            assert_eq!(
                link.on_packet(ms(t), 1),
                Verdict::Drop(DropReason::Blackout)
            );
        }
        assert_eq!(link.on_packet(ms(110), 1), Verdict::Deliver { at: ms(110) });
        assert_eq!(link.counters().dropped.blackout.packets, 3);
        assert!(link.counters().balanced());
    }

    #[test]
    fn overlapping_blackouts_merge_and_ended_ones_are_forgotten() {
        let mut link = Link::new(&LinkConfig::default(), 1).unwrap();
        for start in 0..2_000 {
            link.blackout(ms(start), ms(10));
        }
        assert_eq!(link.blackouts, vec![(ms(0), ms(2_009))]);
        link.blackout(ms(5_000), ms(1));
        assert_eq!(
            link.on_packet(ms(3_000), 1),
            Verdict::Deliver { at: ms(3_000) }
        );
        assert_eq!(link.blackouts, vec![(ms(5_000), ms(5_001))]);
    }

    #[test]
    fn a_blackout_does_not_change_which_later_packets_are_lost() {
        let config = LinkConfig {
            loss: 0.3,
            ..LinkConfig::default()
        };
        let packets = every_ms(1_000, 10);
        let plain = run(&mut Link::new(&config, 5).unwrap(), &packets);
        let mut cut = Link::new(&config, 5).unwrap();
        cut.blackout(ms(100), ms(200));
        let cut = run(&mut cut, &packets);
        assert_eq!(plain[300..], cut[300..]);
        assert!(
            cut[100..300]
                .iter()
                .all(|v| *v == Verdict::Drop(DropReason::Blackout))
        );
    }

    #[test]
    fn the_hold_limit_drops_until_packets_are_released() {
        let config = LinkConfig {
            delay_ms: 1_000.0,
            ..LinkConfig::default()
        };
        let mut link = Link::new(&config, 1).unwrap();
        for _ in 0..MAX_HELD_PACKETS {
            assert!(matches!(link.on_packet(ms(0), 1), Verdict::Deliver { .. }));
        }
        assert_eq!(
            link.on_packet(ms(0), 1),
            Verdict::Drop(DropReason::HoldLimit)
        );
        link.on_released(1);
        assert!(matches!(link.on_packet(ms(1), 1), Verdict::Deliver { .. }));
        assert_eq!(link.held(), (MAX_HELD_PACKETS, MAX_HELD_PACKETS));
        // Bytes too: one huge packet does not fit after a release.
        link.on_released(1);
        assert_eq!(
            link.on_packet(ms(2), MAX_HELD_BYTES),
            Verdict::Drop(DropReason::HoldLimit)
        );
        assert_eq!(link.counters().dropped.hold_limit.packets, 2);
    }

    #[test]
    fn a_clock_that_runs_backwards_is_taken_as_standing_still() {
        let config = LinkConfig {
            delay_ms: 10.0,
            ..LinkConfig::default()
        };
        let mut link = Link::new(&config, 1).unwrap();
        assert_eq!(link.on_packet(ms(100), 1), Verdict::Deliver { at: ms(110) });
        assert_eq!(link.on_packet(ms(50), 1), Verdict::Deliver { at: ms(110) });
    }

    #[test]
    fn the_two_directions_draw_independently_from_one_seed() {
        let cfg = ImpairConfig::symmetric(LinkConfig {
            loss: 0.5,
            ..LinkConfig::default()
        });
        let (mut up, mut down) = cfg.links().unwrap();
        let packets = every_ms(200, 1);
        assert_ne!(run(&mut up, &packets), run(&mut down, &packets));
    }

    #[test]
    fn a_probability_outside_zero_to_one_is_refused_naming_its_field() {
        for bad in [-0.1, 1.5, f64::NAN] {
            let cfg = ImpairConfig {
                downlink: LinkConfig {
                    loss: bad,
                    ..LinkConfig::default()
                },
                ..ImpairConfig::default()
            };
            let err = cfg.validate().unwrap_err().to_string();
            assert!(err.starts_with("downlink.loss = "), "{err}");
            assert!(err.contains("not a probability in [0, 1]"), "{err}");
        }
        let cfg = ImpairConfig::symmetric(LinkConfig {
            burst: Some(GilbertElliott {
                p_good_to_bad: 0.1,
                p_bad_to_good: 2.0,
                loss_good: 0.0,
                loss_bad: 1.0,
            }),
            ..LinkConfig::default()
        });
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.starts_with("uplink.burst.p_bad_to_good = 2"), "{err}");
    }

    #[test]
    fn jitter_above_the_delay_is_refused_with_what_to_change() {
        let err = Link::new(
            &LinkConfig {
                delay_ms: 5.0,
                jitter_ms: 8.0,
                ..LinkConfig::default()
            },
            0,
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "link.jitter_ms = 8 exceeds link.delay_ms = 5, so a one-way delay could go negative; \
             lower the jitter or raise the delay to at least 8 ms"
        );
        let err = Link::new(
            &LinkConfig {
                delay_ms: 20_000.0,
                ..LinkConfig::default()
            },
            0,
        )
        .unwrap_err();
        assert!(
            err.to_string()
                .contains("link.delay_ms = 20000 is not a time in [0, 10000] ms")
        );
    }

    #[test]
    fn a_rate_queue_or_burst_it_cannot_honour_is_refused() {
        let with = |link: LinkConfig| Link::new(&link, 0).unwrap_err();
        let err = with(LinkConfig {
            rate_bps: Some(0),
            ..LinkConfig::default()
        });
        assert!(matches!(err, ConfigError::Rate { rate: 0, .. }), "{err}");
        assert!(err.to_string().contains("leave rate_bps out for no cap"));
        let err = with(LinkConfig {
            queue_ms: MAX_QUEUE_MS + 1,
            ..LinkConfig::default()
        });
        assert!(matches!(err, ConfigError::Queue { .. }), "{err}");
        let err = with(LinkConfig {
            burst: Some(GilbertElliott {
                p_good_to_bad: 0.1,
                p_bad_to_good: 0.0,
                loss_good: 0.0,
                loss_bad: 1.0,
            }),
            ..LinkConfig::default()
        });
        assert!(err.to_string().contains("give p_bad_to_good > 0"), "{err}");
    }

    #[test]
    fn blackouts_parse_from_start_plus_duration_and_bad_ones_are_refused() {
        assert_eq!(
            "5000+2000".parse::<Blackout>(),
            Ok(Blackout {
                start_ms: 5_000,
                duration_ms: 2_000
            })
        );
        assert_eq!(Blackout::from_str("0+1").unwrap().to_string(), "0+1");
        for bad in ["5000", "5000-2000", "a+1", "1+", "-1+5"] {
            let err = bad.parse::<Blackout>().unwrap_err();
            assert!(err.contains("START_MS+DURATION_MS"), "{bad}: {err}");
        }
        assert!(
            "10+0"
                .parse::<Blackout>()
                .unwrap_err()
                .contains("drops nothing")
        );
        let cfg = ImpairConfig {
            blackouts: vec![
                Blackout {
                    start_ms: 0,
                    duration_ms: 1
                };
                MAX_BLACKOUTS + 1
            ],
            ..ImpairConfig::default()
        };
        assert!(matches!(
            cfg.validate(),
            Err(ConfigError::TooManyBlackouts { count: 1_025 })
        ));
    }

    #[test]
    fn a_config_reads_from_toml_with_defaults_and_refuses_unknown_fields() {
        let cfg: ImpairConfig = toml::from_str(
            "seed = 7\n\
             [uplink]\ndelay_ms = 25\njitter_ms = 5\nloss = 0.01\nrate_bps = 10_000_000\n\
             [uplink.burst]\np_good_to_bad = 0.01\np_bad_to_good = 0.25\n\
             [[blackouts]]\nstart_ms = 5_000\nduration_ms = 2_000\n",
        )
        .unwrap();
        cfg.validate().unwrap();
        assert_eq!(cfg.seed, 7);
        assert_eq!(cfg.uplink.delay(), ms(25));
        assert_eq!(cfg.uplink.queue_ms, DEFAULT_QUEUE_MS);
        let ge = cfg.uplink.burst.as_ref().unwrap();
        assert_eq!((ge.loss_good, ge.loss_bad), (0.0, 1.0));
        assert_eq!(cfg.downlink, LinkConfig::default());
        assert_eq!(cfg.blackouts[0].to_string(), "5000+2000");
        let err = toml::from_str::<ImpairConfig>("[uplink]\ndelay = 25\n").unwrap_err();
        assert!(err.to_string().contains("unknown field `delay`"), "{err}");
    }
}
