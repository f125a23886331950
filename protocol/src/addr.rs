//! The gateway's address as edges and workers are given it: a host, either
//! an IP literal or a DNS name, and a port. A Kubernetes Service
//! (`tidegate-gateway.tidegate.svc:4433`), a Slurm login node or an internet
//! host name is as good as `10.0.0.5:4433`.
//!
//! Parsing is pure and checks only the form. A name is resolved by
//! `quic::resolve` (feature `quic`) at every dial, so that a redial finds a
//! gateway that moved.

use std::fmt;
use std::net::{Ipv6Addr, SocketAddr};
use std::str::FromStr;

/// The longest DNS name, without its optional trailing dot (RFC 1035).
const MAX_NAME: usize = 253;
/// The longest label of a DNS name (RFC 1035).
const MAX_LABEL: usize = 63;
/// The form the errors ask for.
const EXAMPLE: &str = "host:port, e.g. gw.example.com:4433, 10.0.0.5:4433 or [fd00::5]:4433";

/// A gateway address: `1.2.3.4:4433`, `[::1]:4433`, `gw.example.com:4433`,
/// `localhost:4433`. Every string that [`SocketAddr`] parses (except port 0)
/// parses to the same address.
///
/// [`Display`](fmt::Display) writes the form [`FromStr`] reads back; serde
/// reads and writes that string.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct GatewayAddr(Host);

#[derive(Clone, PartialEq, Eq, Hash)]
enum Host {
    /// An IP literal: nothing to resolve.
    Ip(SocketAddr),
    /// A DNS name (as written) and the port.
    Name(String, u16),
}

impl GatewayAddr {
    /// The port.
    pub fn port(&self) -> u16 {
        match &self.0 {
            Host::Ip(a) => a.port(),
            Host::Name(_, port) => *port,
        }
    }

    /// The socket address, when the host is an IP literal (no lookup needed).
    pub fn ip(&self) -> Option<SocketAddr> {
        match &self.0 {
            Host::Ip(a) => Some(*a),
            Host::Name(..) => None,
        }
    }

    /// The DNS name, when the host is not an IP literal.
    pub fn name(&self) -> Option<&str> {
        match &self.0 {
            Host::Ip(_) => None,
            Host::Name(name, _) => Some(name),
        }
    }
}

impl From<SocketAddr> for GatewayAddr {
    /// The address as is, but for an IPv6 flow label, which has no textual
    /// form and nothing to do with which gateway is meant. A port of 0 is
    /// kept: dialling it fails.
    fn from(mut addr: SocketAddr) -> Self {
        if let SocketAddr::V6(v6) = &mut addr {
            v6.set_flowinfo(0);
        }
        GatewayAddr(Host::Ip(addr))
    }
}

impl fmt::Display for GatewayAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Host::Ip(a) => write!(f, "{a}"),
            Host::Name(name, port) => write!(f, "{name}:{port}"),
        }
    }
}

impl fmt::Debug for GatewayAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "GatewayAddr({self})")
    }
}

/// Why a string is not a gateway address. Every message quotes the input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GatewayAddrError {
    /// Nothing was given.
    #[error("gateway address is empty; give {EXAMPLE}")]
    Empty,
    /// Spaces, tabs or line breaks (a stray newline in an environment
    /// variable, say).
    #[error("gateway address {input:?} contains whitespace; give {EXAMPLE}")]
    Whitespace {
        /// The input.
        input: String,
    },
    /// A URL rather than an address.
    #[error("gateway address {input:?} has a scheme ({scheme}://); give {EXAMPLE}, without one")]
    Scheme {
        /// The input.
        input: String,
        /// The scheme written.
        scheme: String,
    },
    /// No `:port`.
    #[error("gateway address {input:?} has no port; give {EXAMPLE}")]
    MissingPort {
        /// The input.
        input: String,
    },
    /// The port is not a number from 1 to 65535.
    #[error(
        "gateway address {input:?}: port {port:?} is not a number from 1 to 65535; give {EXAMPLE}"
    )]
    BadPort {
        /// The input.
        input: String,
        /// The port as written.
        port: String,
    },
    /// Port 0 names no listener.
    #[error(
        "gateway address {input:?}: port 0 cannot be dialled; give the port of the gateway's quic.listen, e.g. 4433"
    )]
    ZeroPort {
        /// The input.
        input: String,
    },
    /// Nothing before `:port`.
    #[error("gateway address {input:?} has no host before the port; give {EXAMPLE}")]
    EmptyHost {
        /// The input.
        input: String,
    },
    /// More than one `:` outside brackets: most likely an IPv6 address
    /// without them.
    #[error(
        "gateway address {input:?} has more than one ':'; an IPv6 address goes in brackets, e.g. [::1]:4433"
    )]
    BareIpv6 {
        /// The input.
        input: String,
    },
    /// Brackets that do not hold exactly an IPv6 address followed by
    /// `:port`.
    #[error(
        "gateway address {input:?}: brackets hold an IPv6 address and nothing else, followed by :port, e.g. [::1]:4433"
    )]
    Brackets {
        /// The input.
        input: String,
    },
    /// The host is neither an IP address nor a valid DNS name.
    #[error(
        "gateway address {input:?}: {host:?} is not a valid host name ({reason}); a host name has letters, digits, '-' and '.', labels of 1 to 63 characters, at most 253 in all"
    )]
    BadHost {
        /// The input.
        input: String,
        /// The host part.
        host: String,
        /// What is wrong with it.
        reason: String,
    },
}

impl FromStr for GatewayAddr {
    type Err = GatewayAddrError;

    fn from_str(input: &str) -> Result<Self, Self::Err> {
        let owned = || input.to_string();
        if input.is_empty() {
            return Err(GatewayAddrError::Empty);
        }
        if input.chars().any(char::is_whitespace) {
            return Err(GatewayAddrError::Whitespace { input: owned() });
        }
        if let Some(at) = input.find("://") {
            return Err(GatewayAddrError::Scheme {
                input: owned(),
                scheme: input[..at].to_string(),
            });
        }
        // Whatever std reads as a socket address (IPv6 scope ids included)
        // means what it always meant.
        if let Ok(addr) = input.parse::<SocketAddr>() {
            if addr.port() == 0 {
                return Err(GatewayAddrError::ZeroPort { input: owned() });
            }
            return Ok(GatewayAddr::from(addr));
        }
        // Not an IP literal with a good port: find what is wrong, or a name.
        if let Some(rest) = input.strip_prefix('[') {
            let bad = || GatewayAddrError::Brackets { input: owned() };
            let (inside, after) = rest.split_once(']').ok_or_else(bad)?;
            if inside.parse::<Ipv6Addr>().is_err() && !is_scoped_ipv6(inside) {
                return Err(bad());
            }
            return match after.strip_prefix(':') {
                None if after.is_empty() => Err(GatewayAddrError::MissingPort { input: owned() }),
                None => Err(bad()),
                Some(port) => {
                    parse_port(input, port)?;
                    // The port and the address are each good, so std
                    // refused the pair for a reason of its own.
                    Err(bad())
                }
            };
        }
        let Some((host, port)) = input.rsplit_once(':') else {
            return Err(GatewayAddrError::MissingPort { input: owned() });
        };
        if host.contains(':') {
            return Err(GatewayAddrError::BareIpv6 { input: owned() });
        }
        let port = parse_port(input, port)?;
        if host.is_empty() {
            return Err(GatewayAddrError::EmptyHost { input: owned() });
        }
        check_name(host).map_err(|reason| GatewayAddrError::BadHost {
            input: owned(),
            host: host.to_string(),
            reason,
        })?;
        Ok(GatewayAddr(Host::Name(host.to_string(), port)))
    }
}

/// `fe80::1%eth0`-like text: an IPv6 address with a zone that std does
/// not read (only numeric zones are). Refused too, but as brackets that
/// hold an address, so the error is about the zone's form, not the port.
fn is_scoped_ipv6(inside: &str) -> bool {
    inside
        .split_once('%')
        .is_some_and(|(ip, _)| ip.parse::<Ipv6Addr>().is_ok())
}

/// A port from 1 to 65535, digits only.
fn parse_port(input: &str, port: &str) -> Result<u16, GatewayAddrError> {
    if port.is_empty() {
        return Err(GatewayAddrError::MissingPort {
            input: input.to_string(),
        });
    }
    let value = port
        .bytes()
        .all(|b| b.is_ascii_digit())
        .then(|| port.parse::<u16>().ok())
        .flatten()
        .ok_or_else(|| GatewayAddrError::BadPort {
            input: input.to_string(),
            port: port.to_string(),
        })?;
    if value == 0 {
        return Err(GatewayAddrError::ZeroPort {
            input: input.to_string(),
        });
    }
    Ok(value)
}

/// Checks a DNS host name (RFC 1123): labels of letters, digits and '-',
/// not starting or ending with '-', 1 to 63 characters each, at most 253 in
/// all; one trailing dot (a fully qualified name) is allowed. A last label
/// of digits only is refused: resolvers read such a name as an IPv4
/// address in some legacy form (`10.1` is 10.0.0.1), never as a name.
fn check_name(host: &str) -> Result<(), String> {
    let name = host.strip_suffix('.').unwrap_or(host);
    if name.len() > MAX_NAME {
        return Err(format!("{} characters, more than {MAX_NAME}", name.len()));
    }
    let mut last = "";
    for label in name.split('.') {
        if label.is_empty() {
            return Err("an empty label: a leading dot, or two dots in a row".into());
        }
        if label.len() > MAX_LABEL {
            return Err(format!(
                "label {label:?} has {} characters, more than {MAX_LABEL}",
                label.len()
            ));
        }
        if let Some(c) = label
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || *c == '-'))
        {
            return Err(format!("character {c:?} is not allowed"));
        }
        if label.starts_with('-') || label.ends_with('-') {
            return Err(format!("label {label:?} starts or ends with '-'"));
        }
        last = label;
    }
    if last.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!(
            "its last label {last:?} is all digits, so it is neither a host name nor an IPv4 address"
        ));
    }
    Ok(())
}

impl serde::Serialize for GatewayAddr {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for GatewayAddr {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = GatewayAddr;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "a gateway address string, {EXAMPLE}")
            }

            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<GatewayAddr, E> {
                v.parse().map_err(E::custom)
            }
        }
        deserializer.deserialize_str(Visitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(s: &str) -> GatewayAddr {
        s.parse()
            .unwrap_or_else(|e| panic!("{s:?} should parse: {e}"))
    }

    fn err(s: &str) -> GatewayAddrError {
        match s.parse::<GatewayAddr>() {
            Ok(a) => panic!("{s:?} should be refused, parsed as {a:?}"),
            Err(e) => e,
        }
    }

    #[test]
    fn ip_literals_and_names_parse_and_display_as_written() {
        for s in [
            "1.2.3.4:4433",
            "[::1]:4433",
            "[fe80::1%2]:4433",
            "gw.example.com:4433",
            "localhost:4433",
            "tidegate-gateway.tidegate.svc:4433",
            "tidegate-gateway.tidegate.svc.cluster.local.:4433",
            "GW-1.Example.COM:1",
            "xn--bcher-kva.example:65535",
            "a1.0a:9",
        ] {
            assert_eq!(ok(s).to_string(), s);
            assert_eq!(
                ok(s).port(),
                s.rsplit(':').next().unwrap().parse::<u16>().unwrap()
            );
        }
        assert_eq!(
            ok("1.2.3.4:4433").ip(),
            Some("1.2.3.4:4433".parse().unwrap())
        );
        assert_eq!(ok("[::1]:4433").ip(), Some("[::1]:4433".parse().unwrap()));
        assert_eq!(ok("[::1]:4433").name(), None);
        let name = ok("gw.example.com:4433");
        assert_eq!((name.ip(), name.name()), (None, Some("gw.example.com")));
        // std's leading zeros in the port, and the same address either way.
        assert_eq!(ok("10.0.0.5:04433"), ok("10.0.0.5:4433"));
        let sa: SocketAddr = "10.0.0.5:4433".parse().unwrap();
        assert_eq!(GatewayAddr::from(sa), ok("10.0.0.5:4433"));
        assert_eq!(format!("{:?}", ok("gw:1")), "GatewayAddr(gw:1)");
    }

    /// The variant's name, for the table below.
    fn kind(e: &GatewayAddrError) -> &'static str {
        use GatewayAddrError as E;
        match e {
            E::Empty => "Empty",
            E::Whitespace { .. } => "Whitespace",
            E::Scheme { .. } => "Scheme",
            E::MissingPort { .. } => "MissingPort",
            E::BadPort { .. } => "BadPort",
            E::ZeroPort { .. } => "ZeroPort",
            E::EmptyHost { .. } => "EmptyHost",
            E::BareIpv6 { .. } => "BareIpv6",
            E::Brackets { .. } => "Brackets",
            E::BadHost { .. } => "BadHost",
        }
    }

    #[test]
    fn each_malformed_address_is_refused_saying_what_is_wrong() {
        // (input, variant, what the message says)
        let cases = [
            ("", "Empty", "is empty"),
            ("gw.example.com", "MissingPort", "no port"),
            ("gw.example.com:", "MissingPort", "no port"),
            ("1.2.3.4", "MissingPort", "no port"),
            ("[::1]", "MissingPort", "no port"),
            ("gw:0", "ZeroPort", "port 0"),
            ("1.2.3.4:0", "ZeroPort", "port 0"),
            ("[::1]:0", "ZeroPort", "port 0"),
            ("gw:https", "BadPort", "\"https\" is not a number"),
            ("gw:65536", "BadPort", "1 to 65535"),
            ("gw:+1", "BadPort", "1 to 65535"),
            ("gw:-1", "BadPort", "1 to 65535"),
            ("[::1]:x", "BadPort", "\"x\""),
            (":4433", "EmptyHost", "no host"),
            ("::1", "BareIpv6", "in brackets"),
            ("::1:4433", "BareIpv6", "in brackets"),
            ("fd00::5:4433", "BareIpv6", "in brackets"),
            ("[1.2.3.4]:1", "Brackets", "brackets"),
            ("[gw]:1", "Brackets", "brackets"),
            ("[::1:4433", "Brackets", "brackets"),
            ("[::1]x:1", "Brackets", "brackets"),
            ("[fe80::1%eth0]:1", "Brackets", "brackets"),
            ("gw example:1", "Whitespace", "whitespace"),
            (" gw:1", "Whitespace", "whitespace"),
            ("gw:1\n", "Whitespace", "whitespace"),
            ("quic://gw:4433", "Scheme", "scheme (quic://)"),
            ("gw_1:4433", "BadHost", "'_' is not allowed"),
            ("gw/x:4433", "BadHost", "'/' is not allowed"),
            ("gw..example:1", "BadHost", "empty label"),
            (".gw:1", "BadHost", "empty label"),
            ("-gw:1", "BadHost", "starts or ends with '-'"),
            ("gw-.x:1", "BadHost", "starts or ends with '-'"),
            ("1.2.3.400:1", "BadHost", "nor an IPv4 address"),
            ("10.1:1", "BadHost", "label \"1\" is all digits"),
            ("ünï.example:1", "BadHost", "'ü' is not allowed"),
        ];
        for (input, variant, says) in cases {
            let e = err(input);
            let text = e.to_string();
            assert_eq!(kind(&e), variant, "{input:?}: {text}");
            assert!(text.contains(says), "{input:?}: {text}");
            if !input.is_empty() {
                assert!(text.contains(&format!("{input:?}")), "{input:?}: {text}");
            }
            assert!(!text.contains('\n'), "{input:?}: {text}");
        }
    }

    #[test]
    fn name_and_label_lengths_are_bounded() {
        let label = "a".repeat(63);
        ok(&format!("{label}.example:1"));
        let e = err(&format!("{label}a.example:1")).to_string();
        assert!(e.contains("has 64 characters, more than 63"), "{e}");
        // 4 labels of 63 and dots: 255 characters.
        let long = [label.as_str(); 4].join(".");
        let e = err(&format!("{long}:1")).to_string();
        assert!(e.contains("255 characters, more than 253"), "{e}");
        // 253 exactly, with and without the trailing dot.
        let fits = format!("{}.{}", [label.as_str(); 3].join("."), "b".repeat(61));
        assert_eq!(fits.len(), 253);
        ok(&format!("{fits}:1"));
        ok(&format!("{fits}.:1"));
    }

    #[test]
    fn serde_reads_and_writes_the_string_form() {
        #[derive(serde::Deserialize, serde::Serialize)]
        struct C {
            addr: GatewayAddr,
        }
        let c: C = serde_json::from_str(r#"{"addr":"gw.example.com:4433"}"#).unwrap();
        assert_eq!(c.addr, ok("gw.example.com:4433"));
        assert_eq!(
            serde_json::to_string(&C {
                addr: ok("[::1]:9")
            })
            .unwrap(),
            r#"{"addr":"[::1]:9"}"#
        );
        let e = serde_json::from_str::<C>(r#"{"addr":"gw example:1"}"#)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("contains whitespace"), "{e}");
        let e = serde_json::from_str::<C>(r#"{"addr":4433}"#)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("a gateway address string"), "{e}");
    }
}
