//! The invariants that the cargo-fuzz targets (protocol/fuzz) check on
//! arbitrary bytes: `decode` ([`check`]) and `gateway_addr`
//! ([`check_gateway_addr`]). `tests/fuzz_corpus.rs` and
//! `tests/gateway_addr.rs` replay the fuzz corpora through the same checks,
//! so `cargo test` exercises every corpus file without a fuzzer and the two
//! never drift apart.
//!
//! Not a stable API: hidden from the docs, for the fuzz target and tests only.
//! Every function panics when an invariant does not hold.

use std::net::SocketAddr;

use bytes::{Buf, Bytes};

use crate::addr::GatewayAddr;
use crate::codec::{DecodeError, Header, Kind, MAGIC, VERSION};
use crate::limits::Limits;
use crate::message::Message;

/// Limits small enough that short fuzz inputs reach every limit check.
pub fn tiny_limits() -> Limits {
    Limits {
        max_header_bytes: 96,
        max_tensor_bytes: 64,
        max_dims: 3,
        max_string_bytes: 8,
        max_detections: 2,
        max_keypoints: 2,
        max_batch: 2,
        max_list: 2,
        max_output_bytes: 16,
    }
}

/// Every message kind, in wire order.
pub fn all_kinds() -> Vec<Kind> {
    (0..=u8::MAX).filter_map(Kind::from_u8).collect()
}

/// The tensor payloads a message carries (input tensors and result
/// outputs), in wire order.
pub fn payloads(msg: &Message) -> Vec<&Bytes> {
    match msg {
        Message::Frame(f) => vec![&f.tensor.data],
        Message::Dispatch(d) => d.items.iter().map(|i| &i.tensor.data).collect(),
        Message::Result(r) => r.outputs.iter().map(|o| &o.data).collect(),
        Message::BatchResult(b) => b
            .items
            .iter()
            .flat_map(|i| i.outputs.iter().map(|o| &o.data))
            .collect(),
        _ => Vec::new(),
    }
}

/// Asserts that every non-empty tensor payload of `msg` is a slice of `src`
/// (decoding did not copy it).
pub fn assert_zero_copy(msg: &Message, src: &Bytes) {
    let range = src.as_ptr_range();
    for p in payloads(msg) {
        if p.is_empty() {
            continue;
        }
        let data = p.as_ptr_range();
        assert!(
            range.start <= data.start && data.end <= range.end,
            "tensor payload {:?} was copied out of the source buffer {:?}",
            data,
            range
        );
    }
}

/// Runs every decoder on `data` under the default and the tiny limits.
/// This is the whole body of the fuzz target.
pub fn check(data: &[u8]) {
    for limits in [Limits::default(), tiny_limits()] {
        check_peek(data, &limits);
        check_decode(data, &limits);
        check_decode_body(data, &limits);
    }
}

/// [`Header::peek`]: a header is parsed from exactly 8 bytes, `Incomplete`
/// only when fewer are there, and an accepted length is within the limit.
pub fn check_peek(data: &[u8], limits: &Limits) {
    match Header::peek(data, limits) {
        Ok(h) => {
            assert!(data.len() >= Header::LEN);
            assert_eq!(h.kind as u8, data[3]);
            assert_eq!(
                h.len as u64,
                u32::from_be_bytes([data[4], data[5], data[6], data[7]]) as u64
            );
            assert!(h.len <= h.kind.max_body(limits), "{h:?} over the limit");
            let mut again = Vec::new();
            h.encode(&mut again);
            assert_eq!(again, data[..Header::LEN], "header does not re-encode");
        }
        Err(DecodeError::Incomplete { needed }) => {
            assert!(data.len() < Header::LEN, "Incomplete with a full header");
            assert_eq!(needed, Header::LEN - data.len());
        }
        Err(e) => {
            assert!(
                data.len() >= Header::LEN,
                "{e} before the header was complete"
            );
            let _ = e.to_string();
        }
    }
}

/// [`Message::decode`] from `Bytes` and from `&[u8]` agree; `Incomplete`
/// consumes nothing and names exactly the bytes missing; a decoded message
/// consumed exactly its header and body, re-encodes to the same bytes, and
/// its tensor payloads were not copied.
pub fn check_decode(data: &[u8], limits: &Limits) {
    let src = Bytes::copy_from_slice(data);
    let mut buf = src.clone();
    let res = Message::decode(&mut buf, limits);

    let mut slice = data;
    let res_slice = Message::decode(&mut slice, limits);
    assert_eq!(res, res_slice, "decoding from Bytes and from &[u8] differ");
    assert_eq!(
        buf.remaining(),
        slice.len(),
        "Bytes and &[u8] consumed differently"
    );

    match res {
        Ok(msg) => {
            let header = Header::peek(data, limits).expect("a decoded message has a good header");
            let used = Header::LEN + header.len;
            assert_eq!(
                data.len() - buf.remaining(),
                used,
                "consumed more or less than one message"
            );
            assert_eq!(msg.kind(), header.kind);
            assert_zero_copy(&msg, &src);
            check_roundtrip(&msg, Some(&data[..used]), limits);
        }
        Err(DecodeError::Incomplete { needed }) => {
            assert_eq!(buf.remaining(), data.len(), "Incomplete consumed bytes");
            assert!(needed > 0);
            if data.len() < Header::LEN {
                assert_eq!(needed, Header::LEN - data.len());
            } else {
                let header = Header::peek(data, limits).expect("Incomplete implies a good header");
                assert_eq!(data.len() + needed, Header::LEN + header.len);
                // Exactly `needed` more bytes end the wait (skip huge bodies).
                if needed <= 1 << 20 {
                    let mut more = data.to_vec();
                    more.resize(data.len() + needed, 0);
                    let again = Message::decode(&mut more.as_slice(), limits);
                    assert!(
                        !matches!(again, Err(DecodeError::Incomplete { .. })),
                        "still Incomplete after the {needed} bytes asked for"
                    );
                }
            }
        }
        Err(e) => {
            let _ = e.to_string();
        }
    }
}

/// [`Message::decode_body`] for the kind picked by the first byte, on the
/// rest: never `Incomplete` (the body is whole), and a decoded message
/// round-trips.
pub fn check_decode_body(data: &[u8], limits: &Limits) {
    let Some((&pick, rest)) = data.split_first() else {
        return;
    };
    let kinds = all_kinds();
    let kind = kinds[pick as usize % kinds.len()];
    let body = Bytes::copy_from_slice(rest);
    match Message::decode_body(kind, body.clone(), limits) {
        Ok(msg) => {
            assert_eq!(msg.kind(), kind);
            assert_zero_copy(&msg, &body);
            let mut original = Vec::with_capacity(Header::LEN + rest.len());
            Header {
                kind,
                len: rest.len(),
            }
            .encode(&mut original);
            original.extend_from_slice(rest);
            check_roundtrip(&msg, Some(&original), limits);
        }
        Err(e) => {
            assert!(!e.is_incomplete(), "decode_body said {e} on a whole body");
            let _ = e.to_string();
        }
    }
}

/// `msg` encodes the same through [`Message::encode`] and
/// [`Message::to_chunks`], its header is right, it decodes back to itself,
/// and (given the bytes it was decoded from) the encoding is canonical: the
/// same bytes, except an unknown error code, which decodes as `Internal`.
pub fn check_roundtrip(msg: &Message, original: Option<&[u8]>, limits: &Limits) {
    let mut encoded = Vec::new();
    msg.encode(&mut encoded);
    let chunks = msg.to_chunks();
    assert_eq!(chunks.concat(), encoded, "to_chunks and encode differ");

    assert!(encoded.len() >= Header::LEN);
    assert_eq!(encoded[..2], MAGIC);
    assert_eq!(encoded[2], VERSION);
    assert_eq!(encoded[3], msg.kind() as u8);
    let len = u32::from_be_bytes([encoded[4], encoded[5], encoded[6], encoded[7]]) as usize;
    assert_eq!(
        len,
        encoded.len() - Header::LEN,
        "header length is not the body length"
    );

    let encoded = Bytes::from(encoded);
    let body = encoded.slice(Header::LEN..);
    let again = Message::decode_body(msg.kind(), body.clone(), limits)
        .unwrap_or_else(|e| panic!("re-encoded {:?} does not decode: {e}", msg.kind()));
    assert_eq!(&again, msg, "re-decoded message differs");
    assert_zero_copy(&again, &body);

    if len <= msg.kind().max_body(limits) {
        let mut buf = encoded.clone();
        let again = Message::decode(&mut buf, limits)
            .unwrap_or_else(|e| panic!("re-encoded {:?} does not decode: {e}", msg.kind()));
        assert_eq!(&again, msg, "re-decoded message differs");
        assert_eq!(buf.remaining(), 0);
    }

    if let Some(original) = original {
        if let Message::Error(_) = msg {
            // Bytes 8..10 are the error code; unknown codes read as Internal.
            assert_eq!(original.len(), encoded.len());
            assert_eq!(original[..8], encoded[..8]);
            assert_eq!(original[10..], encoded[10..]);
        } else {
            assert_eq!(original, &encoded[..], "encoding is not canonical");
        }
    }
}

/// [`GatewayAddr`]'s parser on arbitrary text (the bytes as UTF-8, invalid
/// sequences replaced): it never panics; an accepted address has a port,
/// displays as text that parses back to the same address, is an IP literal
/// exactly when std reads the text as a [`SocketAddr`], and a name holds
/// only letters, digits, '-' and '.'; a refusal quotes the input, and std
/// reads no refused text as a socket address but one with port 0. This is
/// the whole body of the fuzz target `gateway_addr`.
pub fn check_gateway_addr(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let std = text.parse::<SocketAddr>().ok();
    match text.parse::<GatewayAddr>() {
        Ok(addr) => {
            assert_ne!(addr.port(), 0, "{text:?} parsed with port 0");
            let shown = addr.to_string();
            let again: GatewayAddr = shown.parse().unwrap_or_else(|e| {
                panic!("{text:?} displays as {shown:?}, which is refused: {e}")
            });
            assert_eq!(
                again, addr,
                "{text:?} does not round-trip through {shown:?}"
            );
            assert_eq!(again.to_string(), shown);
            assert_eq!(addr.ip(), std, "{text:?}: IP literal or not, std disagrees");
            assert_eq!(addr.ip().is_some(), addr.name().is_none());
            if let Some(name) = addr.name() {
                assert!(
                    name.bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.'),
                    "{text:?}: name {name:?}"
                );
                assert!(name.len() <= 254, "{text:?}: name of {} bytes", name.len());
            }
        }
        Err(e) => {
            let message = e.to_string();
            if !text.is_empty() {
                assert!(
                    message.contains(&format!("{text:?}")),
                    "{text:?}: the error does not quote the input: {message}"
                );
            }
            if let Some(sa) = std {
                assert_eq!(
                    sa.port(),
                    0,
                    "std reads {text:?} but it is refused: {message}"
                );
            }
        }
    }
}
