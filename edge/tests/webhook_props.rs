//! Property tests of the webhook's status-line parser, which reads bytes
//! from whatever answers on the configured address (also a fuzz target:
//! `edge/fuzz`, `webhook_status`).

use proptest::prelude::*;
use tidegate_edge::sink::webhook::parse_status;

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
}
