//! Arbitrary bytes into every decoder: `Message::decode` (default and tiny
//! limits, from `Bytes` and from `&[u8]`), `Header::peek`, and
//! `Message::decode_body` for the kind the first byte picks. Whatever decodes
//! must re-encode to the same bytes and decode to the same message.
//!
//! The checks live in `tidegate_protocol::fuzzing`, shared with
//! `protocol/tests/fuzz_corpus.rs`, which replays this target's corpus.
//!
//! Run from `protocol/`:
//! `cargo +nightly fuzz run decode -- -max_total_time=60`

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| tidegate_protocol::fuzzing::check(data));
