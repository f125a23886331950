//! KServe v2 bodies come from whatever answers (a peer under test) or asks
//! (a client of `tidegate-baseline`): decode arbitrary bytes, with an
//! arbitrary header length, as a request and as a response. It must never
//! panic, and what decodes encodes back to a body that decodes the same.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use tidegate_loadtest::kserve::codec::{CodecLimits, InferRequest, InferResponse};

fuzz_target!(|data: &[u8]| {
    let Some((&len, body)) = data.split_first() else {
        return;
    };
    // The first byte picks the header length: none (all JSON), or a
    // length within or past the body.
    let header_len = (len != 0).then(|| usize::from(len) * 4);
    let body = Bytes::copy_from_slice(body);
    let limits = CodecLimits::default();
    if let Ok(r) = InferRequest::decode(&body, header_len, &limits) {
        let again = r.encode();
        let back = InferRequest::decode(&again.body, Some(again.header_len), &limits)
            .expect("an encoded request decodes");
        assert_eq!(back, r);
    }
    if let Ok(r) = InferResponse::decode(&body, header_len, &limits) {
        let again = r.encode();
        let back = InferResponse::decode(&again.body, Some(again.header_len), &limits)
            .expect("an encoded response decodes");
        assert_eq!(back, r);
    }
});
