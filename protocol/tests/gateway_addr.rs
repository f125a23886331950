//! [`GatewayAddr`] over generated input: every valid address (IP literals,
//! and DNS names up to the length limits) displays as text that parses back
//! to it; arbitrary text never panics the parser, and what it accepts holds
//! the fuzz target's invariants (`tidegate_protocol::fuzzing::check_gateway_addr`).
//! The fuzz target's corpus (`fuzz/corpus/gateway_addr/`, and
//! `fuzz/artifacts/gateway_addr/` after a fuzz run found something) replays
//! through the same check.

mod common;

use std::net::{IpAddr, SocketAddr};

use common::corpus::{files, fuzz_dir, replay};
use proptest::prelude::*;
use tidegate_protocol::GatewayAddr;
use tidegate_protocol::fuzzing::check_gateway_addr;

/// A DNS label: letters, digits and inner hyphens, 1 to 63 characters.
fn label() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-zA-Z0-9]",
        "[a-zA-Z0-9][a-zA-Z0-9-]{0,61}[a-zA-Z0-9]",
        "[a-z][a-z0-9-]{0,8}[a-z0-9]",
    ]
}

/// A valid host name: up to 253 characters (254 with a trailing dot), its
/// last label not all digits.
fn name() -> impl Strategy<Value = String> {
    (
        proptest::collection::vec(label(), 0..5),
        "[a-zA-Z][a-zA-Z0-9-]{0,20}[a-zA-Z0-9]|[a-zA-Z]",
        any::<bool>(),
    )
        .prop_filter_map("at most 253 characters", |(labels, last, dot)| {
            let mut name = labels.join(".");
            if !name.is_empty() {
                name.push('.');
            }
            name.push_str(&last);
            (name.len() <= 253).then(|| if dot { name + "." } else { name })
        })
}

/// A valid gateway address in its text form.
fn valid() -> impl Strategy<Value = String> {
    prop_oneof![
        (any::<IpAddr>(), 1..=u16::MAX)
            .prop_map(|(ip, port)| SocketAddr::new(ip, port).to_string()),
        (name(), 1..=u16::MAX).prop_map(|(name, port)| format!("{name}:{port}")),
    ]
}

/// Text shaped like an address, to reach the parser's every branch.
fn address_like() -> impl Strategy<Value = String> {
    "[a-z0-9.:\\[\\]%_ -]{0,24}(:[0-9+-]{0,6})?"
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    #[test]
    fn valid_addresses_round_trip_through_display(text in valid()) {
        let addr: GatewayAddr = text.parse().unwrap_or_else(|e| panic!("{text:?}: {e}"));
        prop_assert_eq!(addr.to_string(), text.clone());
        prop_assert_eq!(addr.to_string().parse::<GatewayAddr>().unwrap(), addr.clone());
        prop_assert_eq!(addr.ip(), text.parse::<SocketAddr>().ok());
        check_gateway_addr(text.as_bytes());
    }

    #[test]
    fn socket_addrs_convert_to_the_address_they_display_as(ip in any::<IpAddr>(), port in 1..=u16::MAX) {
        let sa = SocketAddr::new(ip, port);
        let addr = GatewayAddr::from(sa);
        prop_assert_eq!(addr.ip(), Some(sa));
        prop_assert_eq!(addr.to_string().parse::<GatewayAddr>().unwrap(), addr);
    }

    #[test]
    fn arbitrary_text_never_panics_the_parser(text in "\\PC{0,40}") {
        check_gateway_addr(text.as_bytes());
    }

    #[test]
    fn address_like_text_holds_the_fuzz_invariants(text in address_like()) {
        check_gateway_addr(text.as_bytes());
    }

    #[test]
    fn arbitrary_bytes_never_panic_the_parser(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
        check_gateway_addr(&bytes);
    }
}

#[test]
fn corpus_replays_through_the_fuzz_check_and_seeds_are_what_their_names_say() {
    let corpus = files(&fuzz_dir("corpus", "gateway_addr"));
    assert!(
        corpus.len() >= 10,
        "fuzz/corpus/gateway_addr holds {} files",
        corpus.len()
    );
    replay(&corpus, check_gateway_addr);
    for (path, bytes) in &corpus {
        let name = path.file_name().unwrap().to_string_lossy();
        let parsed = std::str::from_utf8(bytes)
            .ok()
            .and_then(|t| t.parse::<GatewayAddr>().ok());
        if name.starts_with("valid-") {
            assert!(parsed.is_some(), "{name} does not parse");
        } else if name.starts_with("bad-") {
            assert!(parsed.is_none(), "{name} parses as {parsed:?}");
        }
    }
}

#[test]
fn crash_artifacts_replay_through_the_fuzz_check() {
    // Present only after a fuzz run found something; each must be fixed.
    replay(
        &files(&fuzz_dir("artifacts", "gateway_addr")),
        check_gateway_addr,
    );
}
