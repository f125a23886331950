//! Property tests of the webhook's status-line parser, which reads bytes
//! from whatever answers on the configured address (also a fuzz target:
//! `edge/fuzz`, `webhook_status`), and of its URL parser: every well-formed
//! `http://` or `https://` URL reads back as its parts.

use proptest::prelude::*;
use tidegate_edge::sink::webhook::{Endpoint, parse_status};

proptest! {
    #![proptest_config(ProptestConfig { cases: 2048, ..ProptestConfig::default() })]

    /// Arbitrary bytes never panic; an accepted code is a real status from
    /// an HTTP/1.x line; no answer is given before the line is complete.
    #[test]
    fn arbitrary_answers_never_panic_and_accepted_codes_are_real(
        data in prop::collection::vec(any::<u8>(), 0..512)
    ) {
        match parse_status(&data) {
            None => prop_assert!(!data.windows(2).any(|w| w == b"\r\n")),
            Some(Ok(code)) => {
                prop_assert!((100..600).contains(&code));
                prop_assert!(data.starts_with(b"HTTP/1.1 ") || data.starts_with(b"HTTP/1.0 "));
            }
            Some(Err(_)) => {}
        }
    }

    /// Every well-formed status line is read back exactly, whatever
    /// follows it and however it is split.
    #[test]
    fn well_formed_lines_round_trip(
        minor in 0u8..2,
        code in 100u16..600,
        reason in "[A-Za-z ]{0,20}",
        rest in prop::collection::vec(any::<u8>(), 0..64),
        cut in 0usize..64,
    ) {
        let line = format!("HTTP/1.{minor} {code} {reason}\r\n");
        let mut data = line.clone().into_bytes();
        data.extend_from_slice(&rest);
        prop_assert_eq!(parse_status(&data), Some(Ok(code)));
        // A prefix that stops before the CRLF is not an answer yet.
        let cut = cut.min(line.len() - 2);
        prop_assert_eq!(parse_status(&data[..cut]), None);
    }

    /// A URL built from a scheme, a host (a name, an IPv4 address, or an
    /// IPv6 address in brackets), an optional port and a path parses back
    /// to those parts, with the scheme's default port when none is given.
    #[test]
    fn well_formed_urls_parse_back_to_their_parts(
        tls in any::<bool>(),
        host in prop_oneof![
            "[a-z][a-z0-9-]{0,20}(\\.[a-z][a-z0-9-]{0,10}){0,2}",
            any::<std::net::Ipv4Addr>().prop_map(|a| a.to_string()),
            any::<std::net::Ipv6Addr>().prop_map(|a| format!("[{a}]")),
        ],
        port in proptest::option::of(any::<u16>()),
        path in "(/[A-Za-z0-9._~?=&-]{0,12}){0,3}",
    ) {
        let scheme = if tls { "https" } else { "http" };
        let port_part = port.map_or_else(String::new, |p| format!(":{p}"));
        let url = format!("{scheme}://{host}{port_part}{path}");
        let e = Endpoint::parse(&url).map_err(|e| TestCaseError::fail(format!("{url}: {e}")))?;
        prop_assert_eq!(e.tls, tls);
        prop_assert_eq!(e.host, host.trim_start_matches('[').trim_end_matches(']'));
        prop_assert_eq!(e.port, port.unwrap_or(if tls { 443 } else { 80 }));
        let want_path = if path.is_empty() { "/" } else { path.as_str() };
        prop_assert_eq!(e.path, want_path);
    }

    /// Any string is parsed or refused, never a panic.
    #[test]
    fn any_string_is_parsed_or_refused(url in "(https?://)?\\PC{0,40}") {
        let _ = Endpoint::parse(&url);
    }
}
