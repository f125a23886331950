//! Arbitrary text into `GatewayAddr`'s parser, which reads the gateway's
//! address from configs, flags and environment variables: it never panics,
//! what it accepts round-trips through `Display` and agrees with std's
//! `SocketAddr` on IP literals, and each refusal quotes the input.
//!
//! The checks live in `tidegate_protocol::fuzzing::check_gateway_addr`,
//! shared with `protocol/tests/gateway_addr.rs`, which replays this target's
//! corpus.
//!
//! Run from `protocol/`:
//! `cargo +nightly fuzz run gateway_addr -- -max_total_time=30`

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| tidegate_protocol::fuzzing::check_gateway_addr(data));
