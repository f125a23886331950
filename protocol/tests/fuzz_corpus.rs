//! Replays the fuzz corpus (`fuzz/corpus/decode/`, and `fuzz/artifacts/decode/`
//! when a fuzz run left crashes there) through the fuzz target's own check,
//! so `cargo test` exercises every corpus file without a fuzzer.
//!
//! The seed files are generated from the sample messages by
//! `seed_corpus_files_are_up_to_date`; after changing the samples or the
//! format, regenerate them with
//! `TIDEGATE_BLESS_CORPUS=1 cargo test -p tidegate-protocol --test fuzz_corpus`.

mod common;

use std::collections::BTreeSet;

use common::corpus::{files, fuzz_dir, replay};
use tidegate_protocol::fuzzing::{all_kinds, check};
use tidegate_protocol::{Header, Kind, Limits, Message};

/// The seed corpus: valid encodings of every sample, their bodies in the
/// form `check_decode_body` reads (first byte picks the kind), and
/// truncated and corrupted variants.
fn seeds() -> Vec<(String, Vec<u8>)> {
    let kinds = all_kinds();
    let mut out = Vec::new();
    let samples = common::samples();
    for (name, msg) in &samples {
        let bytes = common::encode(msg).to_vec();
        let pick = kinds.iter().position(|&k| k == msg.kind()).unwrap() as u8;
        let mut body = vec![pick];
        body.extend_from_slice(&bytes[Header::LEN..]);
        out.push((format!("body-{name}"), body));
        out.push((format!("valid-{name}"), bytes));
    }
    let enc = |name: &str| {
        let msg = &samples.iter().find(|(n, _)| *n == name).unwrap().1;
        common::encode(msg).to_vec()
    };

    // Truncated: inside the header, inside the metadata, inside a payload.
    for (name, cut) in [
        ("hello-edge", 5),
        ("hello-edge", 12),
        ("frame-u8", 40),
        ("frame-u8", 90),
        ("dispatch", 100),
        ("register", 50),
        ("result-ok", 60),
        ("batch-result", 30),
        ("result-outputs", 60),
        ("result-outputs", 80),
        ("batch-result-outputs", 70),
    ] {
        out.push((format!("trunc-{name}-{cut}"), enc(name)[..cut].to_vec()));
    }

    let patched = |name: &str, at: usize, with: &[u8]| {
        let mut b = enc(name);
        b[at..at + with.len()].copy_from_slice(with);
        b
    };
    let corrupt = [
        ("bad-magic", patched("drain", 0, b"XG")),
        // Version 1, from before labels and result outputs.
        ("bad-version", patched("drain", 2, &[1])),
        ("bad-kind", patched("drain", 3, &[17])),
        (
            "over-limit",
            patched("hello-edge", 4, &[0xff, 0xff, 0xff, 0xff]),
        ),
        ("trailing", {
            let mut b = patched("welcome", 7, &[13]);
            b.push(0);
            b
        }),
        // Role 7, dtype 9 and status 9: unknown enum codes.
        ("bad-role", patched("hello-edge", 8, &[7])),
        (
            "bad-dtype",
            patched("frame-u8", 8 + 6 + 8 + 8 + 4 + 11 + 24, &[9]),
        ),
        ("bad-status", patched("result-shed", 8 + 6 + 8 + 8, &[9])),
        // No copy of a frame, and JPEG at quality 0 (qualities are 1 to
        // 100); codec 9 (unknown).
        ("zero-copies", {
            let mut b = enc("camera-open");
            let last = b.len() - 1;
            b[last] = 0;
            b
        }),
        (
            "bad-codec",
            patched("frame-u8", 8 + 6 + 8 + 8 + 4 + 11 + 24 + 2, &[9]),
        ),
        (
            "bad-quality",
            patched("frame-jpeg", 8 + 6 + 8 + 8 + 4 + 11 + 24 + 3, &[0]),
        ),
        // The first output's dtype: after status, detections, timings,
        // the outputs count and the name "embedding".
        (
            "bad-output-dtype",
            patched("result-outputs", 8 + 6 + 8 + 8 + 1 + 2 + 20 + 2 + 11, &[9]),
        ),
        (
            "nan-hint",
            patched("control-hint", 8 + 2, &f32::NAN.to_be_bytes()),
        ),
        ("bad-utf8", patched("hello-edge", 8 + 1 + 2, &[0xc3, 0x28])),
        // Shape [1,4,4,3] declared as [1,4,4,4]: length mismatch.
        (
            "shape-mismatch",
            patched(
                "frame-u8",
                8 + 6 + 8 + 8 + 4 + 11 + 24 + 5 + 12,
                &[0, 0, 0, 4],
            ),
        ),
        (
            "hostile-count",
            patched("register-empty", 8 + 4 + 17, &[0xff, 0xff]),
        ),
        (
            "unknown-error-code",
            patched("error-overloaded", 8, &[0x03, 0xe7]),
        ),
        (
            "back-to-back",
            [enc("camera-open"), enc("frame-u8")].concat(),
        ),
    ];
    out.extend(
        corrupt
            .into_iter()
            .map(|(n, b)| (format!("corrupt-{n}"), b)),
    );
    out
}

#[test]
fn seed_corpus_files_are_up_to_date() {
    let dir = fuzz_dir("corpus", "decode");
    let bless = std::env::var_os("TIDEGATE_BLESS_CORPUS").is_some();
    if bless {
        std::fs::create_dir_all(&dir).unwrap();
    }
    let mut stale = Vec::new();
    for (name, bytes) in seeds() {
        let path = dir.join(&name);
        if bless {
            std::fs::write(&path, &bytes).unwrap();
        } else if std::fs::read(&path).ok().as_deref() != Some(&bytes[..]) {
            stale.push(name);
        }
    }
    assert!(
        stale.is_empty(),
        "seed corpus files missing or stale: {stale:?}; regenerate with \
         TIDEGATE_BLESS_CORPUS=1 cargo test -p tidegate-protocol --test fuzz_corpus"
    );
}

#[test]
fn seeds_are_what_their_names_say() {
    let limits = Limits::default();
    for (name, bytes) in seeds() {
        let res = Message::decode(&mut bytes.as_slice(), &limits);
        match name.split('-').next().unwrap() {
            "valid" => assert!(res.is_ok(), "{name}: {res:?}"),
            "trunc" => assert!(res.unwrap_err().is_incomplete(), "{name}"),
            "corrupt" if name.ends_with("unknown-error-code") || name.ends_with("back-to-back") => {
                assert!(res.is_ok(), "{name}: {res:?}");
            }
            "corrupt" => {
                let err = res.unwrap_err();
                assert!(!err.is_incomplete(), "{name}: {err}");
            }
            _ => {}
        }
    }
}

#[test]
fn corpus_replays_through_the_fuzz_check() {
    let corpus = files(&fuzz_dir("corpus", "decode"));
    assert!(
        corpus.len() >= seeds().len(),
        "fuzz/corpus/decode holds {} files; expected the {} seeds",
        corpus.len(),
        seeds().len()
    );
    replay(&corpus, check);

    // The corpus holds a valid encoding of every kind.
    let decoded: BTreeSet<u8> = corpus
        .iter()
        .filter_map(|(_, b)| Message::decode(&mut b.as_slice(), &Limits::default()).ok())
        .map(|m| m.kind() as u8)
        .collect();
    let every: BTreeSet<u8> = all_kinds().into_iter().map(|k: Kind| k as u8).collect();
    assert_eq!(decoded, every);
}

#[test]
fn crash_artifacts_replay_through_the_fuzz_check() {
    // Present only after a fuzz run found something; each must be fixed.
    replay(&files(&fuzz_dir("artifacts", "decode")), check);
}
