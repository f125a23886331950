//! Frame encodings at the worker: what JPEG and PNG frames save on the
//! uplink and what decoding them costs the worker, against raw frames, in
//! one run.
//!
//! cargo run --release -p tidegate-worker --example codec_bench --
//!     [--report target/bench-codecs.json] [--seconds 1] [--path-rounds 30]
//!
//! Two frames: BlazeFace's 128×128 of astronaut.png (resized as
//! tests/blazeface.rs does) and CenterNet's 512×512 of vtest.avi at 0 s
//! (letterboxed as the edge does; `make setup` extracts it). Each is sent
//! raw, as PNG, and as JPEG at qualities 95, 90, 75 and 50, encoded here
//! with the image crate's encoders (the edge encodes with GStreamer's
//! jpegenc and pngenc; sizes differ a little, the decoder is the same).
//! For each:
//!
//! - bytes per frame, and the uplink per camera at 10 frames a second
//!   (payload only, Mbit/s);
//! - the worker's decode (`codec::decode_frame`, as the backend calls it):
//!   the median and 99th percentile of single decodes timed for `--seconds`,
//!   and the CPU time per frame of this thread over them (from
//!   /proc/thread-self/stat; the decoder is single-threaded);
//! - the worker's whole path for that frame (`Backend::run` of one frame:
//!   decode, preprocess, ONNX Runtime on one intra-op thread, decoder),
//!   median of `--path-rounds`, the encodings taking turns frame by frame
//!   so that load from other processes hits all alike, and its ratio to the
//!   raw frame's path;
//! - how close the decoded pixels are (PSNR against the raw frame, dB;
//!   "exact" when equal) and the detections the model finds (faces, or
//!   people at CenterNet's 0.3 threshold).
//!
//! - a batch of 32 JPEG frames (quality 90) decoded as the backend decodes
//!   a batch (`codec::decode_frames`), on one thread and spread over this
//!   machine's cores: median of `--path-rounds`.
//!
//! Prints Markdown tables for docs/benchmarks.md and, with `--report`,
//! writes the same numbers as JSON. Stops with the status if any frame
//! fails. The repository is `models/` of this checkout, or
//! `TIDEGATE_MODELS_DIR`.

use std::path::PathBuf;
use std::time::Instant;

use image::codecs::jpeg::JpegEncoder;
use image::codecs::png::PngEncoder;
use image::imageops::{self, FilterType};
use image::{ExtendedColorType, ImageEncoder, RgbImage};
use serde_json::json;
use tidegate_protocol::{DType, Encoding, Geometry, Layout, Status, Tensor};
use tidegate_worker::backend::{Backend, FrameInput, OrtBackend};
use tidegate_worker::codec;
use tidegate_worker::model::Repository;
use tidegate_worker::runtime::RuntimeOptions;

struct Args {
    report: Option<PathBuf>,
    seconds: f64,
    path_rounds: usize,
}

fn args() -> Args {
    let mut a = Args {
        report: None,
        seconds: 1.0,
        path_rounds: 30,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().expect("flag needs a value");
        match flag.as_str() {
            "--report" => a.report = Some(PathBuf::from(value())),
            "--seconds" => a.seconds = value().parse().expect("--seconds S"),
            "--path-rounds" => a.path_rounds = value().parse().expect("--path-rounds N"),
            other => panic!("unknown flag {other}; see the header of examples/codec_bench.rs"),
        }
    }
    a
}

/// Frames of the batch decode table.
const BATCH: usize = 32;

/// Frames a second per camera for the uplink column.
const FPS: f64 = 10.0;

const ENCODINGS: [Encoding; 6] = [
    Encoding::Raw,
    Encoding::Png,
    Encoding::Jpeg { quality: 95 },
    Encoding::Jpeg { quality: 90 },
    Encoding::Jpeg { quality: 75 },
    Encoding::Jpeg { quality: 50 },
];

/// CPU seconds this thread has used (user + system), Linux only.
fn thread_cpu() -> f64 {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap_or_default();
    // utime and stime: the 14th and 15th fields, in ticks of 1/100 s.
    let rest = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

/// The model repository: `TIDEGATE_MODELS_DIR`, else this checkout's.
fn models_dir() -> PathBuf {
    std::env::var_os("TIDEGATE_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models"))
}

/// Stops the bench with `why` (exit 1).
fn refuse(why: &str) -> ! {
    eprintln!("codec_bench: error: {why}");
    std::process::exit(1);
}

fn open_image(path: &std::path::Path) -> RgbImage {
    image::open(path)
        .unwrap_or_else(|e| refuse(&format!("{}: {e}; run `make setup`", path.display())))
        .to_rgb8()
}

/// The frames: (label, model, raw frame).
fn frames() -> Vec<(&'static str, &'static str, FrameInput)> {
    let models = models_dir();
    let astronaut = open_image(&models.join("testdata/astronaut.png"));
    let small = imageops::resize(&astronaut, 128, 128, FilterType::Triangle);
    let vtest = open_image(&models.join("testdata/vtest/frame-00.png"));
    let (w, h) = vtest.dimensions();
    let g = Geometry::letterbox(w, h, 512, 512);
    let content = imageops::resize(
        &vtest,
        g.content_width,
        g.content_height,
        FilterType::Triangle,
    );
    let mut canvas = RgbImage::new(512, 512);
    imageops::replace(
        &mut canvas,
        &content,
        i64::from(g.content_x),
        i64::from(g.content_y),
    );
    let raw = |img: RgbImage, geometry| {
        let (w, h) = img.dimensions();
        FrameInput {
            tensor: Tensor::raw(
                DType::U8,
                Layout::Nhwc,
                vec![1, h, w, 3],
                img.into_raw().into(),
            ),
            geometry,
        }
    };
    vec![
        (
            "astronaut 128×128 (blazeface)",
            "blazeface",
            raw(small, Geometry::letterbox(512, 512, 128, 128)),
        ),
        ("vtest 512×512 (centernet)", "centernet", raw(canvas, g)),
    ]
}

/// `frame` in `encoding`.
fn encode(frame: &FrameInput, encoding: Encoding) -> FrameInput {
    let t = &frame.tensor;
    let (h, w) = (t.shape[1], t.shape[2]);
    let mut file = Vec::new();
    match encoding {
        Encoding::Raw => return frame.clone(),
        Encoding::Jpeg { quality } => JpegEncoder::new_with_quality(&mut file, quality)
            .write_image(&t.data, w, h, ExtendedColorType::Rgb8)
            .unwrap(),
        Encoding::Png => PngEncoder::new(&mut file)
            .write_image(&t.data, w, h, ExtendedColorType::Rgb8)
            .unwrap(),
    }
    FrameInput {
        tensor: Tensor {
            encoding,
            data: file.into(),
            ..t.clone()
        },
        geometry: frame.geometry,
    }
}

/// PSNR of `b` against `a` in dB; infinite when equal.
fn psnr(a: &[u8], b: &[u8]) -> f64 {
    let se: f64 = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| (f64::from(x) - f64::from(y)).powi(2))
        .sum();
    let mse = se / a.len() as f64;
    10.0 * (255.0f64.powi(2) / mse).log10()
}

fn quantile(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * q).round() as usize]
}

/// One encoding of one frame, measured.
struct Row {
    encoding: Encoding,
    bytes: usize,
    decode_median_us: f64,
    decode_p99_us: f64,
    decode_cpu_us: f64,
    path_median_us: f64,
    psnr_db: f64,
    detections: usize,
}

/// Decodes `frame` for `seconds` (at least 20 times): (median µs, p99 µs,
/// CPU µs per decode).
fn time_decode(model: &str, frame: &FrameInput, seconds: f64) -> (f64, f64, f64) {
    let mut times = Vec::new();
    let started = Instant::now();
    let cpu = thread_cpu();
    while started.elapsed().as_secs_f64() < seconds || times.len() < 20 {
        let t = Instant::now();
        let decoded = codec::decode_frame(model, &frame.tensor);
        times.push(t.elapsed().as_secs_f64() * 1e6);
        std::hint::black_box(decoded).unwrap_or_else(|e| refuse(&e.to_string()));
    }
    let cpu_us = (thread_cpu() - cpu) * 1e6 / times.len() as f64;
    (
        quantile(&mut times, 0.5),
        quantile(&mut times, 0.99),
        cpu_us,
    )
}

fn main() {
    let a = args();
    let repo = Repository::load(
        &models_dir(),
        Some(&["blazeface".to_string(), "centernet".to_string()]),
    )
    .unwrap_or_else(|e| refuse(&e.to_string()));
    let options = RuntimeOptions {
        intra_threads: 1,
        warmup_runs: 2,
        ..RuntimeOptions::default()
    };
    let mut backend = OrtBackend::open(&repo, &options).unwrap_or_else(|e| refuse(&e.to_string()));
    eprintln!(
        "device {}; decode for {} s per case, the whole path {} rounds",
        backend.device(),
        a.seconds,
        a.path_rounds
    );
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut report = Vec::new();
    let mut batches = Vec::new();
    for (label, model, raw) in frames() {
        let encoded: Vec<FrameInput> = ENCODINGS.iter().map(|&e| encode(&raw, e)).collect();
        // Fidelity and detections, once; every frame must be served.
        let outcomes = backend.run(model, &encoded);
        for (o, e) in outcomes.iter().zip(ENCODINGS) {
            if o.status != Status::Ok {
                refuse(&format!("{label}, {e}: {:?}", o.status));
            }
        }
        // The whole path of one frame, the encodings taking turns.
        let mut paths = vec![Vec::with_capacity(a.path_rounds); ENCODINGS.len()];
        for _ in 0..a.path_rounds {
            for (i, frame) in encoded.iter().enumerate() {
                let t = Instant::now();
                let out = backend.run(model, std::slice::from_ref(frame));
                paths[i].push(t.elapsed().as_secs_f64() * 1e6);
                if out[0].status != Status::Ok {
                    refuse(&format!("{label}: {:?}", out[0].status));
                }
            }
        }
        let mut rows = Vec::new();
        for (i, frame) in encoded.iter().enumerate() {
            let (decode_median_us, decode_p99_us, decode_cpu_us) =
                time_decode(model, frame, a.seconds);
            let pixels = codec::decode_frame(model, &frame.tensor).unwrap();
            rows.push(Row {
                encoding: ENCODINGS[i],
                bytes: frame.tensor.data.len(),
                decode_median_us,
                decode_p99_us,
                decode_cpu_us,
                path_median_us: quantile(&mut paths[i], 0.5),
                psnr_db: psnr(&raw.tensor.data, &pixels.data),
                detections: outcomes[i]
                    .detections
                    .iter()
                    .filter(|d| d.class == 0)
                    .count(),
            });
        }
        // A batch of 32, on one thread and on every core.
        let q90 = &encoded[3];
        let batch: Vec<&Tensor> = vec![&q90.tensor; BATCH];
        let mut serial = Vec::with_capacity(a.path_rounds);
        let mut spread = Vec::with_capacity(a.path_rounds);
        for _ in 0..a.path_rounds {
            for (threads, times) in [(1, &mut serial), (cores, &mut spread)] {
                let t = Instant::now();
                let out = codec::decode_frames(model, &batch, threads);
                times.push(t.elapsed().as_secs_f64() * 1e3);
                if let Some((Err(e), _)) = out.iter().find(|(r, _)| r.is_err()) {
                    refuse(&e.to_string());
                }
            }
        }
        batches.push((
            label,
            quantile(&mut serial, 0.5),
            quantile(&mut spread, 0.5),
        ));
        report.push((label, model, rows));
    }

    println!(
        "| frame | encoding | bytes/frame | Mbit/s per camera at {FPS} fps | decode median (p99) µs | decode CPU µs/frame | worker path median µs | × raw path | PSNR dB | detections |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for (label, _, rows) in &report {
        let raw_path = rows[0].path_median_us;
        for r in rows {
            println!(
                "| {label} | {} | {} | {:.2} | {} | {} | {:.0} | {:.2} | {} | {} |",
                r.encoding,
                r.bytes,
                mbits(r.bytes),
                if r.encoding == Encoding::Raw {
                    "—".to_string()
                } else {
                    format!("{:.0} ({:.0})", r.decode_median_us, r.decode_p99_us)
                },
                if r.encoding == Encoding::Raw {
                    "—".to_string()
                } else {
                    format!("{:.0}", r.decode_cpu_us)
                },
                r.path_median_us,
                r.path_median_us / raw_path,
                if r.psnr_db.is_finite() {
                    format!("{:.1}", r.psnr_db)
                } else {
                    "exact".into()
                },
                r.detections
            );
        }
    }
    println!();
    println!(
        "| a batch of {BATCH} JPEG frames, quality 90 | decode, 1 thread (ms) | decode, {cores} threads (ms) | speed-up |"
    );
    println!("|---|---|---|---|");
    for (label, serial, spread) in &batches {
        println!(
            "| {label} | {serial:.2} | {spread:.2} | {:.2} |",
            serial / spread
        );
    }
    if let Some(path) = &a.report {
        let frames: Vec<_> = report
            .iter()
            .map(|(label, model, rows)| {
                let raw_path = rows[0].path_median_us;
                json!({
                    "frame": label,
                    "model": model,
                    "encodings": rows.iter().map(|r| json!({
                        "codec": r.encoding.codec().name(),
                        "quality": r.encoding.quality(),
                        "bytes_per_frame": r.bytes,
                        "uplink_mbit_s_at_10_fps": mbits(r.bytes),
                        "decode_median_us": r.decode_median_us,
                        "decode_p99_us": r.decode_p99_us,
                        "decode_cpu_us_per_frame": r.decode_cpu_us,
                        "worker_path_median_us": r.path_median_us,
                        "worker_path_ratio_to_raw": r.path_median_us / raw_path,
                        "psnr_db": r.psnr_db.is_finite().then_some(r.psnr_db),
                        "detections": r.detections,
                    })).collect::<Vec<_>>(),
                })
            })
            .collect();
        let batch_decode: Vec<_> = batches
            .iter()
            .map(|(label, serial, spread)| {
                json!({
                    "frame": label,
                    "frames": BATCH,
                    "encoding": "jpeg q90",
                    "decode_1_thread_ms": serial,
                    "threads": cores,
                    "decode_spread_ms": spread,
                })
            })
            .collect();
        let doc = json!({
            "device": backend.device(),
            "batch_decode": batch_decode,
            "decode_seconds_per_case": a.seconds,
            "path_rounds": a.path_rounds,
            "fps": FPS,
            "frames": frames,
        });
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).ok();
        }
        std::fs::write(path, serde_json::to_string_pretty(&doc).unwrap())
            .unwrap_or_else(|e| refuse(&format!("{}: {e}", path.display())));
        eprintln!("report written to {}", path.display());
    }
}

/// Mbit/s of one camera sending `bytes` a frame at [`FPS`].
fn mbits(bytes: usize) -> f64 {
    bytes as f64 * 8.0 * FPS / 1e6
}
