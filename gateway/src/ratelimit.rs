//! How many control messages one edge connection may send: a pure token
//! bucket on an injected clock, and [`ControlGate`], the per-connection
//! policy built of two of them.
//!
//! An edge's legitimate control traffic is small: a `LatencyReport` per
//! result it gets, a `ClockEcho` per clock probe (a few a second) and a
//! `CameraOpen` per camera. Every message read is a hub message, and the
//! hub's inbox is shared with every frame of every edge: one edge sending
//! half a million reports a second raised everyone's p99 several times
//! over. Messages over the rate are dropped before they reach the hub (the
//! shell counts them by kind); a connection that keeps sending far over it
//! is closed, and its edge name is kept out for a while
//! ([`FloodCooldowns`]): without that, a flooder closed within a tenth of
//! a second logs in again at once, and each new connection's burst and
//! tolerated drops are read and decoded again, a hundred times a minute.
//!
//! Every refused login cost a TLS handshake first, so an address whose
//! logins keep being refused is shut out before its next handshake
//! ([`LoginStrikes`]).

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

/// A token bucket: `per_second` tokens a second, holding at most `burst`.
/// Starts full. Pure: the caller says what time it is.
#[derive(Debug, Clone)]
pub struct TokenBucket {
    per_second: f64,
    burst: f64,
    tokens: f64,
    last: Option<Instant>,
}

impl TokenBucket {
    /// A full bucket.
    pub fn new(per_second: u32, burst: u32) -> Self {
        TokenBucket {
            per_second: f64::from(per_second),
            burst: f64::from(burst.max(1)),
            tokens: f64::from(burst.max(1)),
            last: None,
        }
    }

    /// Takes one token at `now`: false when the bucket is empty. A `now`
    /// earlier than the last (a clock stepped back) refills nothing.
    pub fn take(&mut self, now: Instant) -> bool {
        if let Some(last) = self.last {
            let elapsed = now.saturating_duration_since(last).as_secs_f64();
            self.tokens = (self.tokens + elapsed * self.per_second).min(self.burst);
        }
        self.last = Some(self.last.map_or(now, |last| last.max(now)));
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// Which lines of one kind of log get written: `per_second` a second and
/// `burst` at once ([`TokenBucket`]); the lines held back are counted, and
/// the next line written says how many. A peer that can make the gateway
/// log (a wrong token, a refused name) cannot fill its disk. Pure.
#[derive(Debug, Clone)]
pub struct LogSampler {
    bucket: TokenBucket,
    held_back: u64,
}

impl LogSampler {
    /// A sampler that writes its first `burst` lines at once.
    pub fn new(per_second: u32, burst: u32) -> Self {
        LogSampler {
            bucket: TokenBucket::new(per_second, burst),
            held_back: 0,
        }
    }

    /// Whether to write a line at `now`: `Some` with how many were held
    /// back since the last one written, or `None` to hold this one back.
    pub fn write(&mut self, now: Instant) -> Option<u64> {
        if self.bucket.take(now) {
            Some(std::mem::take(&mut self.held_back))
        } else {
            self.held_back += 1;
            None
        }
    }
}

/// The control-message rate one edge connection is held to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ControlRate {
    /// Messages a second, sustained.
    pub per_second: u32,
    /// Messages at once above the sustained rate (the bucket's size).
    pub burst: u32,
    /// Dropped messages above the sustained rate that a connection may
    /// pile up before it is closed: it is closed once it has sent more
    /// than twice `per_second` for long enough to drop this many more
    /// than `per_second` allows.
    pub flood: u32,
}

impl ControlRate {
    /// 2,000 messages a second: one `LatencyReport` per result covers 64
    /// cameras at 30 fps on one connection (1,920 a second), with clock
    /// echoes and opens beside. The flood that prompted this sent 544,000.
    pub const DEFAULT_PER_SECOND: u32 = 2_000;
    /// Two seconds of the sustained rate: every camera of an edge
    /// reconnecting at once reopens and reports in one go.
    pub const DEFAULT_BURST: u32 = 4_000;
    /// Ten bursts' worth of drops: a short spike is dropped, not closed,
    /// but 544,000 messages a second close the connection within about
    /// a tenth of a second.
    pub const DEFAULT_FLOOD: u32 = 40_000;
}

impl Default for ControlRate {
    fn default() -> Self {
        ControlRate {
            per_second: Self::DEFAULT_PER_SECOND,
            burst: Self::DEFAULT_BURST,
            flood: Self::DEFAULT_FLOOD,
        }
    }
}

impl std::fmt::Display for ControlRate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} messages/s (bursts of {})",
            self.per_second, self.burst
        )
    }
}

/// What becomes of one control message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ControlVerdict {
    /// Within the rate: handle it.
    Pass,
    /// Over the rate: drop it (and count it).
    Drop,
    /// Over the rate for too long: drop it and close the connection.
    Close,
}

/// One connection's control-message policy: an allowance bucket at the
/// [`ControlRate`], and a tolerance bucket that every dropped message
/// draws on (refilled at the same rate, holding [`ControlRate::flood`]).
#[derive(Debug, Clone)]
pub struct ControlGate {
    rate: ControlRate,
    allowed: TokenBucket,
    tolerated: TokenBucket,
    dropped: u64,
}

impl ControlGate {
    /// A gate for a new connection: a full burst allowed.
    pub fn new(rate: ControlRate) -> Self {
        ControlGate {
            rate,
            allowed: TokenBucket::new(rate.per_second, rate.burst),
            tolerated: TokenBucket::new(rate.per_second, rate.flood),
            dropped: 0,
        }
    }

    /// The verdict on a message read at `now`.
    pub fn on_message(&mut self, now: Instant) -> ControlVerdict {
        if self.allowed.take(now) {
            return ControlVerdict::Pass;
        }
        self.dropped += 1;
        if self.tolerated.take(now) {
            ControlVerdict::Drop
        } else {
            ControlVerdict::Close
        }
    }

    /// Messages dropped on this connection so far.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// The rate it holds the connection to.
    pub fn rate(&self) -> ControlRate {
        self.rate
    }
}

/// Edge names whose connection was closed as a control flood, and until
/// when each is refused at login. The cooldown is `base` for a name's
/// first flood and doubles with each flood that follows within
/// [`FloodCooldowns::FORGET_AFTER`] of the last cooldown's end, up to
/// [`FloodCooldowns::MAX`]. A `base` of zero turns it off. Pure: the
/// caller says what time it is.
#[derive(Debug, Clone)]
pub struct FloodCooldowns {
    base: Duration,
    names: HashMap<String, Strikes>,
}

/// One name's floods.
#[derive(Debug, Clone, Copy)]
struct Strikes {
    /// Floods in a row (each within [`FloodCooldowns::FORGET_AFTER`] of
    /// the last cooldown's end).
    count: u32,
    /// Refused at login until then.
    until: Instant,
}

impl FloodCooldowns {
    /// The longest cooldown.
    pub const MAX: Duration = Duration::from_secs(60);
    /// A name that has not flooded for this long after its cooldown ended
    /// starts again from `base`, and is forgotten.
    pub const FORGET_AFTER: Duration = Duration::from_secs(300);
    /// Names remembered at once; past it, the one whose cooldown ended
    /// first is forgotten. Only authenticated edges flood, so this is far
    /// above any fleet's need.
    pub const MAX_NAMES: usize = 4096;
    /// The first cooldown by default: one second takes a flooder that
    /// reconnects at once from a hundred closes a minute to a handful
    /// (1 + 2 + 4 + 8 + 16 + 32 s), while an edge that flooded once by
    /// mistake is back within a second.
    pub const DEFAULT_BASE: Duration = Duration::from_secs(1);

    /// Nobody refused; `base` is the first cooldown (zero: never refuse).
    pub fn new(base: Duration) -> Self {
        FloodCooldowns {
            base: base.min(Self::MAX),
            names: HashMap::new(),
        }
    }

    /// Records that a connection of `name` was closed as a flood at `now`;
    /// returns how long the name is refused from then.
    pub fn flooded(&mut self, name: &str, now: Instant) -> Duration {
        if self.base.is_zero() {
            return Duration::ZERO;
        }
        self.forget_old(now);
        let count = match self.names.get(name) {
            Some(s) if now < s.until + Self::FORGET_AFTER => s.count.saturating_add(1),
            _ => 1,
        };
        let doublings = (count - 1).min(16);
        let cooldown = self.base.saturating_mul(1u32 << doublings).min(Self::MAX);
        if !self.names.contains_key(name) && self.names.len() >= Self::MAX_NAMES {
            let first = self
                .names
                .iter()
                .min_by_key(|(_, s)| s.until)
                .map(|(n, _)| n.clone());
            if let Some(first) = first {
                self.names.remove(&first);
            }
        }
        // a cooldown never ends earlier than one already imposed
        let until = self
            .names
            .get(name)
            .map_or(now + cooldown, |s| s.until.max(now + cooldown));
        self.names
            .insert(name.to_string(), Strikes { count, until });
        until - now
    }

    /// How much longer `name` is refused at `now`; `None` when it may log
    /// in.
    pub fn refused(&self, name: &str, now: Instant) -> Option<Duration> {
        let s = self.names.get(name)?;
        (now < s.until).then(|| s.until - now)
    }

    /// Names remembered now.
    pub fn len(&self) -> usize {
        self.names.len()
    }

    /// Whether no name is remembered.
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    fn forget_old(&mut self, now: Instant) {
        self.names.retain(|_, s| now < s.until + Self::FORGET_AFTER);
    }
}

/// How many refused logins one address may have before it is shut out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StrikeRate {
    /// Refused logins an address may have at once (0: nobody is ever
    /// shut out).
    pub burst: u32,
    /// Refused logins a second an address may go on having, sustained.
    pub per_second: u32,
}

impl StrikeRate {
    /// An edge fleet behind one NAT that redials with stale tokens after a
    /// rotation stays under it for a while; a stranger guessing tokens
    /// (about 460 handshakes a second on a 2-vCPU gateway) is shut out
    /// after a tenth of a second.
    pub const DEFAULT_BURST: u32 = 32;
    /// Two handshakes a second is what a shut-out guesser goes on costing.
    pub const DEFAULT_PER_SECOND: u32 = 2;
}

impl Default for StrikeRate {
    fn default() -> Self {
        StrikeRate {
            burst: Self::DEFAULT_BURST,
            per_second: Self::DEFAULT_PER_SECOND,
        }
    }
}

/// Addresses whose logins keep being refused (a wrong token or name, an
/// edge name in its flood cooldown), and which are shut out before their
/// next handshake: each refusal cost the gateway a TLS handshake, so a
/// stranger guessing tokens, or a flooder redialling into its cooldown,
/// could keep a core busy without ever logging in. An address may have
/// [`StrikeRate::burst`] refusals at once, then [`StrikeRate::per_second`]
/// a second (a GCRA: each refusal adds one interval of debt, and the
/// address is shut out while its debt is over the burst's); a connection
/// from it meanwhile is dropped unanswered, costing nothing.
///
/// Addresses are grouped as a host holds them: an IPv4 address alone (an
/// IPv4-mapped IPv6 one as its IPv4 address), an IPv6 one by its /64, the
/// block one host is given. Several edges behind one NAT share one
/// address, so one of them failing its logins shuts the others' *new*
/// connections out too (connections already up are never touched); the
/// rate is set so that this needs far more refusals than a fleet's stale
/// token makes. Pure: the caller says what time it is.
#[derive(Debug, Clone)]
pub struct LoginStrikes {
    rate: StrikeRate,
    /// Per address group, when its debt is paid off.
    debts: HashMap<IpAddr, Instant>,
}

impl LoginStrikes {
    /// Address groups remembered at once. Past it the groups whose debt is
    /// paid are forgotten, then the one least in debt: memory is bounded
    /// whatever the number of addresses an attacker has.
    pub const MAX_ADDRESSES: usize = 4096;

    /// Nobody shut out.
    pub fn new(rate: StrikeRate) -> Self {
        LoginStrikes {
            rate,
            debts: HashMap::new(),
        }
    }

    /// The group `ip` is counted in.
    pub fn group(ip: IpAddr) -> IpAddr {
        match ip.to_canonical() {
            IpAddr::V6(v6) => {
                let prefix = u128::from(v6) & !((1u128 << 64) - 1);
                IpAddr::V6(prefix.into())
            }
            v4 => v4,
        }
    }

    fn interval(&self) -> Duration {
        Duration::from_secs(1) / self.rate.per_second.max(1)
    }

    /// The debt an address may carry and still be let in: a burst's
    /// refusals at once leave it at the burst's last.
    fn tolerance(&self) -> Duration {
        self.interval()
            .saturating_mul(self.rate.burst.saturating_sub(1))
    }

    /// Records a login from `ip` refused at `now`.
    pub fn refused(&mut self, ip: IpAddr, now: Instant) {
        if self.rate.burst == 0 {
            return;
        }
        let key = Self::group(ip);
        if !self.debts.contains_key(&key) && self.debts.len() >= Self::MAX_ADDRESSES {
            self.debts.retain(|_, paid| *paid > now);
            if self.debts.len() >= Self::MAX_ADDRESSES {
                let least = self.debts.iter().min_by_key(|(_, paid)| **paid);
                if let Some(least) = least.map(|(k, _)| *k) {
                    self.debts.remove(&least);
                }
            }
        }
        let interval = self.interval();
        let paid = self.debts.entry(key).or_insert(now);
        *paid = (*paid).max(now) + interval;
    }

    /// How much longer `ip` is shut out at `now`; `None` when its next
    /// connection may log in.
    pub fn shut_out(&self, ip: IpAddr, now: Instant) -> Option<Duration> {
        let paid = *self.debts.get(&Self::group(ip))?;
        let free_from = paid.checked_sub(self.tolerance())?;
        (free_from > now).then(|| free_from - now)
    }

    /// Address groups remembered now.
    pub fn len(&self) -> usize {
        self.debts.len()
    }

    /// Whether no address is remembered.
    pub fn is_empty(&self) -> bool {
        self.debts.is_empty()
    }
}

#[cfg(test)]
mod login_strikes_tests {
    use super::*;

    fn strikes(burst: u32, per_second: u32) -> LoginStrikes {
        LoginStrikes::new(StrikeRate { burst, per_second })
    }

    #[test]
    fn an_address_is_shut_out_after_its_burst_and_let_back_at_its_rate() {
        let (mut s, t0) = (strikes(4, 2), Instant::now());
        let ip: IpAddr = "192.0.2.7".parse().unwrap();
        for i in 0..4 {
            assert_eq!(s.shut_out(ip, t0), None, "refusal {i}");
            s.refused(ip, t0);
        }
        // four at once are the burst: the fifth connection is dropped
        assert_eq!(s.shut_out(ip, t0), Some(Duration::from_millis(500)));
        assert_eq!(
            s.shut_out(ip, t0 + Duration::from_millis(499)),
            Some(Duration::from_millis(1))
        );
        // one interval later one more login is let in; refused, it shuts
        // the address out for one more interval
        let t1 = t0 + Duration::from_millis(500);
        assert_eq!(s.shut_out(ip, t1), None);
        s.refused(ip, t1);
        assert_eq!(s.shut_out(ip, t1), Some(Duration::from_millis(500)));
        // others are not touched
        let other: IpAddr = "192.0.2.8".parse().unwrap();
        assert_eq!(s.shut_out(other, t1), None);
        // quiet for the burst's time, the debt is paid: a whole burst again
        let t2 = t1 + Duration::from_secs(3);
        for _ in 0..4 {
            assert_eq!(s.shut_out(ip, t2), None);
            s.refused(ip, t2);
        }
        assert!(s.shut_out(ip, t2).is_some());
    }

    #[test]
    fn a_guesser_at_any_speed_gets_the_burst_then_the_rate() {
        let (mut s, t0) = (strikes(32, 2), Instant::now());
        let ip: IpAddr = "198.51.100.1".parse().unwrap();
        // a guess every millisecond for ten seconds: shut-out ones are
        // dropped unanswered and cost nothing, so they add no debt
        let mut let_in = 0;
        for ms in 0..10_000 {
            let now = t0 + Duration::from_millis(ms);
            if s.shut_out(ip, now).is_none() {
                let_in += 1;
                s.refused(ip, now);
            }
        }
        // the burst, then one every half second
        assert!((32 + 19..=32 + 20).contains(&let_in), "{let_in}");
    }

    #[test]
    fn ipv6_is_counted_by_its_64_and_mapped_ipv4_as_ipv4() {
        let (mut s, t0) = (strikes(1, 1), Instant::now());
        let a: IpAddr = "2001:db8:1:2::1".parse().unwrap();
        let same_64: IpAddr = "2001:db8:1:2:ffff::9".parse().unwrap();
        let other_64: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        s.refused(a, t0);
        s.refused(same_64, t0);
        assert!(s.shut_out(a, t0).is_some());
        assert!(s.shut_out(same_64, t0).is_some());
        assert_eq!(s.shut_out(other_64, t0), None);
        let v4: IpAddr = "203.0.113.5".parse().unwrap();
        let mapped: IpAddr = "::ffff:203.0.113.5".parse().unwrap();
        s.refused(mapped, t0);
        s.refused(v4, t0);
        assert!(s.shut_out(v4, t0).is_some());
        assert_eq!(LoginStrikes::group(mapped), v4);
    }

    #[test]
    fn a_zero_burst_shuts_nobody_out_and_remembers_nothing() {
        let (mut s, t0) = (strikes(0, 2), Instant::now());
        let ip: IpAddr = "192.0.2.1".parse().unwrap();
        for _ in 0..1000 {
            s.refused(ip, t0);
        }
        assert_eq!(s.shut_out(ip, t0), None);
        assert!(s.is_empty());
    }

    #[test]
    fn the_addresses_remembered_are_bounded_and_the_most_indebted_kept() {
        let (mut s, t0) = (strikes(1, 1), Instant::now());
        let guesser: IpAddr = "192.0.2.200".parse().unwrap();
        for _ in 0..10 {
            s.refused(guesser, t0);
        }
        for i in 0..(LoginStrikes::MAX_ADDRESSES as u32 * 2) {
            let ip = IpAddr::V4(std::net::Ipv4Addr::from(0x0a00_0000 + i));
            s.refused(ip, t0 + Duration::from_millis(1));
        }
        assert_eq!(s.len(), LoginStrikes::MAX_ADDRESSES);
        assert!(s.shut_out(guesser, t0 + Duration::from_millis(1)).is_some());
        // paid-off addresses are forgotten first
        let later = t0 + Duration::from_secs(5);
        s.refused("192.0.2.201".parse().unwrap(), later);
        assert!(s.len() < 10, "{}", s.len());
        assert!(s.shut_out(guesser, later).is_some());
    }
}

#[cfg(test)]
mod log_sampler_tests {
    use super::*;

    #[test]
    fn a_burst_is_written_then_held_back_and_the_next_line_counts_what_was() {
        let t0 = Instant::now();
        let mut s = LogSampler::new(1, 10);
        for _ in 0..10 {
            assert_eq!(s.write(t0), Some(0));
        }
        for _ in 0..500 {
            assert_eq!(s.write(t0), None);
        }
        assert_eq!(s.write(t0 + Duration::from_secs(1)), Some(500));
        assert_eq!(s.write(t0 + Duration::from_secs(1)), None);
        assert_eq!(s.write(t0 + Duration::from_secs(2)), Some(1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flooded_name_is_refused_for_a_doubling_cooldown_and_others_are_not() {
        let t0 = Instant::now();
        let mut c = FloodCooldowns::new(Duration::from_secs(1));
        assert_eq!(c.refused("e", t0), None);
        assert_eq!(c.flooded("e", t0), Duration::from_secs(1));
        assert_eq!(c.refused("e", t0), Some(Duration::from_secs(1)));
        assert_eq!(c.refused("other", t0), None);
        let t1 = t0 + Duration::from_secs(1);
        assert_eq!(c.refused("e", t1), None, "refused until, not at, its end");
        // floods again as soon as it is back: 2 s, then 4 s, ...
        assert_eq!(c.flooded("e", t1), Duration::from_secs(2));
        let t2 = t1 + Duration::from_secs(2);
        assert_eq!(c.flooded("e", t2), Duration::from_secs(4));
        // ... up to a minute, however many floods follow
        let mut t = t2;
        for _ in 0..40 {
            t += Duration::from_secs(61);
            assert!(c.flooded("e", t) <= FloodCooldowns::MAX);
        }
        assert_eq!(c.refused("e", t), Some(FloodCooldowns::MAX));
    }

    #[test]
    fn a_name_quiet_long_enough_starts_again_from_the_base_and_is_forgotten() {
        let t0 = Instant::now();
        let mut c = FloodCooldowns::new(Duration::from_millis(500));
        c.flooded("e", t0);
        c.flooded("e", t0 + Duration::from_secs(1));
        let ended = t0 + Duration::from_secs(2);
        let later = ended + FloodCooldowns::FORGET_AFTER;
        assert_eq!(c.flooded("x", later), Duration::from_millis(500));
        assert_eq!(c.len(), 1, "e forgotten once x's flood was recorded");
        assert_eq!(c.flooded("e", later), Duration::from_millis(500));
    }

    #[test]
    fn a_flood_seen_twice_at_once_never_shortens_the_cooldown() {
        // two connections of one name closed in the same instant: the
        // second flood doubles, and a later, shorter one cannot cut it
        let t0 = Instant::now();
        let mut c = FloodCooldowns::new(Duration::from_secs(8));
        c.flooded("e", t0);
        assert_eq!(c.flooded("e", t0), Duration::from_secs(16));
        assert_eq!(c.refused("e", t0), Some(Duration::from_secs(16)));
    }

    #[test]
    fn a_zero_base_refuses_nobody_and_remembers_nothing() {
        let t0 = Instant::now();
        let mut c = FloodCooldowns::new(Duration::ZERO);
        assert_eq!(c.flooded("e", t0), Duration::ZERO);
        assert_eq!(c.refused("e", t0), None);
        assert!(c.is_empty());
    }

    #[test]
    fn the_names_remembered_are_bounded() {
        let t0 = Instant::now();
        let mut c = FloodCooldowns::new(Duration::from_secs(1));
        for i in 0..FloodCooldowns::MAX_NAMES + 10 {
            c.flooded(&format!("e{i}"), t0 + Duration::from_millis(i as u64));
        }
        assert_eq!(c.len(), FloodCooldowns::MAX_NAMES);
        // the earliest to end were the ones let go
        assert_eq!(c.refused("e0", t0), None);
        let last = FloodCooldowns::MAX_NAMES + 9;
        assert!(c.refused(&format!("e{last}"), t0).is_some());
    }

    #[test]
    fn a_full_bucket_passes_a_burst_then_refuses() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(10, 5);
        for _ in 0..5 {
            assert!(b.take(t0));
        }
        assert!(!b.take(t0));
    }

    #[test]
    fn a_bucket_refills_at_its_rate_and_never_above_its_burst() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(10, 5);
        for _ in 0..5 {
            assert!(b.take(t0));
        }
        // 100 ms at 10/s: one token.
        let t1 = t0 + Duration::from_millis(100);
        assert!(b.take(t1));
        assert!(!b.take(t1));
        // An hour idle fills it to its burst, no further.
        let t2 = t1 + Duration::from_secs(3600);
        let passed = (0..100).filter(|_| b.take(t2)).count();
        assert_eq!(passed, 5);
    }

    #[test]
    fn a_clock_stepped_back_refills_nothing() {
        let t0 = Instant::now() + Duration::from_secs(10);
        let mut b = TokenBucket::new(10, 1);
        assert!(b.take(t0));
        let earlier = t0 - Duration::from_secs(5);
        assert!(!b.take(earlier));
        // Nor does returning to where it was: the 5 s back were not time.
        assert!(!b.take(t0));
        assert!(b.take(t0 + Duration::from_millis(100)));
    }

    #[test]
    fn over_a_long_run_a_bucket_passes_its_rate_plus_its_burst() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(200, 400);
        // 10,000 messages a second for 10 s, in 1 ms steps.
        let mut passed = 0u64;
        for ms in 0..10_000u64 {
            let now = t0 + Duration::from_millis(ms);
            passed += (0..10).filter(|_| b.take(now)).count() as u64;
        }
        // 200/s × 10 s (less the last step's refill) + the first burst.
        assert!((2_398..=2_400).contains(&passed), "{passed}");
    }

    #[test]
    fn a_gate_passes_traffic_within_its_rate_forever() {
        let t0 = Instant::now();
        let rate = ControlRate {
            per_second: 100,
            burst: 10,
            flood: 50,
        };
        let mut g = ControlGate::new(rate);
        // 50/s for an hour of simulated time.
        for i in 0..180_000u64 {
            let now = t0 + Duration::from_millis(20 * i);
            assert_eq!(g.on_message(now), ControlVerdict::Pass);
        }
        assert_eq!(g.dropped(), 0);
    }

    #[test]
    fn a_gate_drops_a_spike_over_its_rate_without_closing() {
        let t0 = Instant::now();
        let rate = ControlRate {
            per_second: 100,
            burst: 10,
            flood: 50,
        };
        let mut g = ControlGate::new(rate);
        let verdicts: Vec<_> = (0..40).map(|_| g.on_message(t0)).collect();
        assert!(verdicts[..10].iter().all(|v| *v == ControlVerdict::Pass));
        assert!(verdicts[10..].iter().all(|v| *v == ControlVerdict::Drop));
        assert_eq!(g.dropped(), 30);
        // A second later it is within its rate again.
        assert_eq!(
            g.on_message(t0 + Duration::from_secs(1)),
            ControlVerdict::Pass
        );
    }

    #[test]
    fn a_gate_closes_a_connection_that_keeps_flooding() {
        let t0 = Instant::now();
        let rate = ControlRate {
            per_second: 100,
            burst: 10,
            flood: 50,
        };
        let mut g = ControlGate::new(rate);
        // 1,000/s: ten times the rate.
        let mut closed_at = None;
        for i in 0..10_000u64 {
            let now = t0 + Duration::from_millis(i);
            if g.on_message(now) == ControlVerdict::Close {
                closed_at = Some(i);
                break;
            }
        }
        let closed_at = closed_at.expect("a flood is closed");
        // 10 passed, then each ms: 0.1 allowed and 0.1 tolerated come
        // back; 50 tolerated drops last about 60 ms.
        assert!(closed_at < 1_000, "closed after {closed_at} ms");
        assert!(g.dropped() >= 50);
    }

    #[test]
    fn twice_the_rate_is_dropped_but_never_closed() {
        let t0 = Instant::now();
        let rate = ControlRate {
            per_second: 100,
            burst: 10,
            flood: 50,
        };
        let mut g = ControlGate::new(rate);
        // 200/s for ten minutes: half dropped, each drop refilled in time.
        for i in 0..120_000u64 {
            let now = t0 + Duration::from_millis(5 * i);
            assert_ne!(g.on_message(now), ControlVerdict::Close, "message {i}");
        }
        assert!(g.dropped() > 0);
    }
}
