//! Hostile length fields are rejected before anything is allocated for them.
//! A counting global allocator measures the bytes each decode allocates on
//! this thread; a decoder that trusted a declared count or length would
//! reserve megabytes here.

// A global allocator cannot be written without `unsafe`; it only forwards to
// the system allocator and counts, and lives in this test binary alone.
#![allow(unsafe_code)]

mod common;

use std::alloc::{GlobalAlloc, Layout as AllocLayout, System};
use std::cell::Cell;

use bytes::Bytes;
use tidegate_protocol::codec::Writer;
use tidegate_protocol::*;

struct Counting;

thread_local! {
    static ALLOCATED: Cell<usize> = const { Cell::new(0) };
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: AllocLayout) -> *mut u8 {
        let _ = ALLOCATED.try_with(|a| a.set(a.get() + layout.size()));
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: AllocLayout) {
        // SAFETY: `ptr` came from `System.alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: AllocLayout, new_size: usize) -> *mut u8 {
        let _ = ALLOCATED.try_with(|a| a.set(a.get() + new_size));
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Bytes allocated on this thread while decoding `bytes` (already in memory).
fn allocated_by_decode(bytes: &Bytes, limits: &Limits) -> (usize, DecodeError) {
    let mut src = bytes.clone();
    let before = ALLOCATED.with(Cell::get);
    let err = Message::decode(&mut src, limits).unwrap_err();
    let after = ALLOCATED.with(Cell::get);
    (after - before, err)
}

/// More than an error message needs, far less than any hostile count implies.
const SMALL: usize = 1024;

fn roomy() -> Limits {
    Limits {
        max_list: u16::MAX.into(),
        max_batch: u16::MAX.into(),
        max_detections: u16::MAX.into(),
        max_keypoints: 255,
        ..Limits::default()
    }
}

fn assert_small(name: &str, bytes: Bytes, limits: &Limits) -> DecodeError {
    let (n, err) = allocated_by_decode(&bytes, limits);
    assert!(
        n < SMALL,
        "{name}: decoding allocated {n} bytes before failing with {err}"
    );
    err
}

#[test]
fn hostile_counts_allocate_nothing_for_their_items() {
    // Register with u16::MAX models and nothing after.
    let mut w = Writer::default();
    w.string("w");
    w.string("d");
    w.u16(u16::MAX);
    let err = assert_small(
        "models",
        Bytes::from(w.finish(Kind::Register).concat()),
        &roomy(),
    );
    assert_eq!(err, DecodeError::Truncated { what: "models" });

    // Dispatch with u16::MAX items.
    let mut w = Writer::default();
    w.u64(1);
    w.string("m");
    w.u16(u16::MAX);
    w.u64(0);
    let err = assert_small(
        "dispatch",
        Bytes::from(w.finish(Kind::Dispatch).concat()),
        &roomy(),
    );
    assert_eq!(
        err,
        DecodeError::Truncated {
            what: "dispatch items"
        }
    );

    // BatchResult with u16::MAX items.
    let mut w = Writer::default();
    w.u64(1);
    w.u16(u16::MAX);
    let err = assert_small(
        "batch",
        Bytes::from(w.finish(Kind::BatchResult).concat()),
        &roomy(),
    );
    assert_eq!(
        err,
        DecodeError::Truncated {
            what: "batch result items"
        }
    );

    // A result with u16::MAX detections.
    let mut w = Writer::default();
    w.string("c");
    w.u64(1);
    w.u64(1);
    w.u8(0);
    w.u16(u16::MAX);
    let err = assert_small(
        "detections",
        Bytes::from(w.finish(Kind::Result).concat()),
        &roomy(),
    );
    assert_eq!(err, DecodeError::Truncated { what: "detections" });

    // Under the default limits the counts are over the limit outright.
    let mut w = Writer::default();
    w.string("w");
    w.string("d");
    w.u16(u16::MAX);
    let err = assert_small(
        "models/default",
        Bytes::from(w.finish(Kind::Register).concat()),
        &Limits::default(),
    );
    assert!(
        matches!(err, DecodeError::TooLarge { what: "models", .. }),
        "{err:?}"
    );
}

#[test]
fn hostile_lengths_allocate_nothing_for_their_bytes() {
    // A header declaring the largest allowed Frame body, with no body: the
    // decoder waits, it does not reserve.
    let limits = Limits::default();
    let max = Kind::Frame.max_body(&limits);
    let mut head = b"TG\x03\x06".to_vec();
    head.extend_from_slice(&(max as u32).to_be_bytes());
    let (n, err) = allocated_by_decode(&Bytes::from(head), &limits);
    assert_eq!(err, DecodeError::Incomplete { needed: max });
    assert_eq!(n, 0, "waiting for a body allocated {n} bytes");

    // One past it is rejected outright.
    let mut head = b"TG\x03\x06".to_vec();
    head.extend_from_slice(&(max as u32 + 1).to_be_bytes());
    let (n, err) = allocated_by_decode(&Bytes::from(head), &limits);
    assert!(matches!(err, DecodeError::TooLarge { .. }), "{err:?}");
    assert_eq!(n, 0);

    // A string declaring 65535 bytes in a short body.
    let head = b"TG\x03\x01\x00\x00\x00\x03\x00\xff\xff".to_vec();
    let err = assert_small(
        "string",
        Bytes::from(head),
        &Limits {
            max_string_bytes: u16::MAX.into(),
            ..Limits::default()
        },
    );
    assert_eq!(err, DecodeError::Truncated { what: "name" });

    // A tensor declaring 64 MiB that is not there.
    let mut w = Writer::default();
    w.string("c");
    w.u64(1);
    w.u64(1);
    w.u32(1);
    w.string("m");
    w.geometry(&Geometry::stretch(1, 1, 1, 1));
    w.u8(0);
    w.u8(0);
    w.encoding(Encoding::Raw);
    w.u8(1);
    w.u32(64 * 1024 * 1024);
    w.u32(64 * 1024 * 1024);
    let err = assert_small(
        "tensor",
        Bytes::from(w.finish(Kind::Frame).concat()),
        &limits,
    );
    assert_eq!(
        err,
        DecodeError::Truncated {
            what: "tensor payload"
        }
    );
}

#[test]
fn counting_allocator_sees_a_real_decode() {
    // Guards the guard: a successful decode of a Register does allocate.
    let msg = common::samples()
        .into_iter()
        .find(|(n, _)| *n == "register")
        .unwrap()
        .1;
    let bytes = common::encode(&msg);
    let before = ALLOCATED.with(Cell::get);
    let back = Message::decode(&mut bytes.clone(), &Limits::default()).unwrap();
    let n = ALLOCATED.with(Cell::get) - before;
    assert_eq!(back, msg);
    assert!(n > 0);
}
