//! The webhook's answer comes from whatever listens on the configured
//! address: parse arbitrary bytes as an HTTP status line. It must never
//! panic, and an accepted code is always a real HTTP status.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tidegate_edge::sink::webhook::parse_status;

fuzz_target!(|data: &[u8]| {
    if let Some(Ok(code)) = parse_status(data) {
        assert!((100..600).contains(&code));
        assert!(data.starts_with(b"HTTP/1."));
    }
});
