//! Protobuf encoding, just enough for an ONNX ModelProto: the worker
//! tests' hand-encoded models (`cloud-worker/tests/batching.rs`,
//! `watchdog.rs`). Feature `worker`.

pub fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

pub fn int(out: &mut Vec<u8>, field: u64, v: i64) {
    varint(out, field << 3);
    varint(out, v as u64);
}

pub fn bytes(out: &mut Vec<u8>, field: u64, b: &[u8]) {
    varint(out, (field << 3) | 2);
    varint(out, b.len() as u64);
    out.extend_from_slice(b);
}

pub fn msg(out: &mut Vec<u8>, field: u64, build: impl FnOnce(&mut Vec<u8>)) {
    let mut inner = Vec::new();
    build(&mut inner);
    bytes(out, field, &inner);
}
