//! Worker efficiency: frames per second of the worker's backend (frame
//! checks, preprocessing, ONNX Runtime, decoding) against raw ONNX Runtime
//! (`Session::run` on an input prepared once, outputs dropped) on the same
//! model, same threads, same process, per batch size. Also the start-up
//! cost: opening and warming the backend, and profiling every batch size.
//!
//! cargo run --release -p tidegate-worker --example bench -- [--threads 1]
//!     [--seconds 2] [--sizes 1,2,4,8,16,32] [--cuda] [--model blazeface]
//!     [--conv-algo-search exhaustive|heuristic|default]
//!
//! With `--cuda` a third column runs the worker with `cpu_preprocess`:
//! frames normalised on the CPU and uploaded as f32, against the default u8
//! upload and NVRTC normalisation on the GPU. The bench refuses to run when
//! GPU preprocessing is off for the model (the worker would serve on with
//! CPU preprocessing, and that column would compare the CPU with itself).
//! Every frame of the first run at each batch size, on each backend, must
//! come back `Ok`, or the bench stops with the status. Batch sizes above the model's
//! `max_batch` (on the CPU: `cpu_max_batch`, when set) are skipped. The
//! repository is `models/` of this checkout, or `TIDEGATE_MODELS_DIR`.
//!
//! Prints a Markdown table for docs/benchmarks.md. Raw and worker runs
//! alternate one batch at a time, and each side's median batch time is
//! reported, so that load from other processes hits both alike; the
//! worker's batch latency is given as its median and 99th percentile. With one
//! intra-op thread ONNX Runtime runs on the calling thread, so the table
//! also gives frames per CPU-second of this thread (from
//! /proc/thread-self/stat), which other processes on a shared machine
//! disturb far less than wall-clock time; the efficiency ratio uses it.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use image::imageops::{self, FilterType};
use ort::session::Session;
use ort::value::TensorRef;
use tidegate_protocol::{DType, Geometry, Layout, Status, Tensor};
use tidegate_worker::backend::{Backend, FrameInput, OrtBackend, cuda_provider};
use tidegate_worker::model::Repository;
use tidegate_worker::preprocess::Preprocessor;
use tidegate_worker::runtime::{ConvAlgoSearch, CudaOptions, Provider, Runtime, RuntimeOptions};

struct Args {
    threads: usize,
    seconds: f64,
    sizes: Vec<usize>,
    cuda: bool,
    rounds: usize,
    model: String,
    conv_algo_search: ConvAlgoSearch,
}

fn args() -> Args {
    let mut a = Args {
        threads: 1,
        seconds: 2.0,
        sizes: vec![1, 2, 4, 8, 16, 32],
        cuda: false,
        rounds: 3,
        model: "blazeface".into(),
        conv_algo_search: ConvAlgoSearch::default(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().expect("flag needs a value");
        match flag.as_str() {
            "--threads" => a.threads = value().parse().expect("--threads N"),
            "--seconds" => a.seconds = value().parse().expect("--seconds S"),
            "--rounds" => a.rounds = value().parse().expect("--rounds N"),
            "--sizes" => {
                a.sizes = value()
                    .split(',')
                    .map(|s| s.parse().expect("--sizes 1,2,4"))
                    .collect()
            }
            "--cuda" => a.cuda = true,
            "--model" => a.model = value(),
            "--conv-algo-search" => {
                a.conv_algo_search = match value().as_str() {
                    "exhaustive" => ConvAlgoSearch::Exhaustive,
                    "heuristic" => ConvAlgoSearch::Heuristic,
                    "default" => ConvAlgoSearch::Default,
                    other => panic!("--conv-algo-search exhaustive|heuristic|default, not {other}"),
                }
            }
            other => panic!("unknown flag {other}; see the header of examples/bench.rs"),
        }
    }
    a
}

/// CPU seconds this thread has used (user + system), Linux only.
fn thread_cpu() -> f64 {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap_or_default();
    // Fields after the command name in parentheses; utime and stime are the
    // 14th and 15th fields of the line, in clock ticks (100 per second).
    let rest = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

/// Runs `f` for `seconds` of wall time; (batches, CPU seconds of this thread).
fn cpu_block(seconds: f64, mut f: impl FnMut()) -> (f64, f64) {
    let until = Instant::now() + Duration::from_secs_f64(seconds);
    let c = thread_cpu();
    let mut n = 0.0;
    while Instant::now() < until {
        f();
        n += 1.0;
    }
    (n, thread_cpu() - c)
}

/// Batch times of one [`paired`] run, in seconds.
struct Pair {
    /// Median of the first closure (raw ONNX Runtime).
    raw: f64,
    /// Median of the second closure (the worker).
    worker: f64,
    /// 99th percentile of the second closure.
    worker_p99: f64,
}

/// Alternates `raw` and `worker` (one batch each) for `seconds`.
fn paired(seconds: f64, mut raw: impl FnMut(), mut worker: impl FnMut()) -> Pair {
    let until = Instant::now() + Duration::from_secs_f64(seconds);
    let (mut a, mut b) = (Vec::new(), Vec::new());
    while Instant::now() < until || a.len() < 5 {
        let t = Instant::now();
        raw();
        a.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        worker();
        b.push(t.elapsed().as_secs_f64());
    }
    a.sort_by(f64::total_cmp);
    b.sort_by(f64::total_cmp);
    let at = |v: &[f64], q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    Pair {
        raw: at(&a, 0.5),
        worker: at(&b, 0.5),
        worker_p99: at(&b, 0.99),
    }
}

/// Stops the bench with `why` (exit 1).
fn refuse(why: &str) -> ! {
    eprintln!("bench: error: {why}");
    std::process::exit(1);
}

/// Stops the bench unless every frame of one run of `frames` on `backend`
/// comes back `Ok`.
fn check_run(backend: &mut OrtBackend, what: &str, model: &str, frames: &[FrameInput]) {
    let outcomes = backend.run(model, frames);
    if outcomes.len() != frames.len() {
        refuse(&format!(
            "{what}: {} outcomes for a batch of {}",
            outcomes.len(),
            frames.len()
        ));
    }
    if let Some((i, o)) = outcomes
        .iter()
        .enumerate()
        .find(|(_, o)| o.status != Status::Ok)
    {
        refuse(&format!(
            "{what}, batch of {}: frame {i} is {:?}, not Ok; nothing to measure",
            frames.len(),
            o.status
        ));
    }
}

/// The model repository: `TIDEGATE_MODELS_DIR`, else this checkout's.
fn models_dir() -> PathBuf {
    std::env::var_os("TIDEGATE_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models"))
}

fn main() {
    let a = args();
    let models = models_dir();
    let repo = Repository::load(&models, Some(std::slice::from_ref(&a.model))).unwrap();
    let model = repo.get(&a.model).unwrap().clone();
    let name = a.model.as_str();
    let cuda = |cpu_preprocess| {
        Provider::Cuda(CudaOptions {
            cpu_preprocess,
            conv_algo_search: a.conv_algo_search,
            ..CudaOptions::default()
        })
    };
    let options = RuntimeOptions {
        intra_threads: a.threads,
        provider: if a.cuda { cuda(false) } else { Provider::Cpu },
        ..RuntimeOptions::default()
    };
    let t = Instant::now();
    let mut backend = OrtBackend::open(&repo, &options).unwrap_or_else(|e| refuse(&e.to_string()));
    let opened = t.elapsed();
    let preprocessing = backend
        .preprocessing(name)
        .map_or_else(|| "?".to_string(), |p| p.to_string());
    if a.cuda && !backend.gpu_preprocessing(name) {
        refuse(&format!(
            "--cuda, but model {name} is preprocessed on {preprocessing}: the u8 upload + GPU normalise column would measure the CPU path against itself; fix GPU preprocessing (NVRTC on LD_LIBRARY_PATH, see the worker's warning above)"
        ));
    }
    let t = Instant::now();
    // The cap of the provider the backend runs on (cpu_max_batch on a CPU).
    let max_batch = backend
        .models()
        .iter()
        .find(|m| m.name == name)
        .map_or(1, |m| m.max_batch);
    let sizes16: Vec<u16> = [1u16, 2, 4, 8, 16, 32]
        .into_iter()
        .filter(|&b| b <= max_batch)
        .collect();
    backend
        .profile(name, &sizes16)
        .unwrap_or_else(|e| refuse(&e.to_string()));
    let profiled = t.elapsed();
    eprintln!(
        "model {name}, device {}, preprocessing on {preprocessing}: open + warm-up {:.0} ms, profile of {sizes16:?} {:.0} ms",
        backend.device(),
        opened.as_secs_f64() * 1e3,
        profiled.as_secs_f64() * 1e3
    );
    // The same worker with CPU preprocessing and f32 upload (CUDA only).
    let mut f32_upload = a.cuda.then(|| {
        let options = RuntimeOptions {
            provider: cuda(true),
            ..options.clone()
        };
        let b = OrtBackend::open(&repo, &options).unwrap_or_else(|e| refuse(&e.to_string()));
        if b.gpu_preprocessing(name) {
            refuse(
                "the cpu_preprocess backend preprocesses on the GPU; the comparison would be void",
            );
        }
        b
    });
    // Raw ONNX Runtime on the same file, same threads (and provider).
    let runtime = Runtime::get().expect("the backend loaded ONNX Runtime");
    let mut builder = Session::builder(runtime.environment()).unwrap();
    if a.threads > 0 {
        builder = builder.with_intra_threads(a.threads).unwrap();
    }
    if let Provider::Cuda(o) = &options.provider {
        use ort::ep::ExecutionProvider;
        cuda_provider(o).register(&mut builder).unwrap();
    }
    let mut raw = builder.commit_from_file(&model.path).unwrap();

    let spec = &model.spec;
    let (w, h) = (spec.input.width, spec.input.height);
    let img = image::open(models.join("testdata/astronaut.png"))
        .unwrap()
        .to_rgb8();
    let small = imageops::resize(&img, w, h, FilterType::Triangle).into_raw();
    let frame = FrameInput {
        tensor: Tensor::raw(
            DType::U8,
            Layout::Nhwc,
            vec![1, h, w, 3],
            small.clone().into(),
        ),
        geometry: Geometry::stretch(512, 512, w, h),
    };
    let mut one = vec![0.0f32; small.len()];
    Preprocessor::new(&spec.input)
        .to_f32(&small, Layout::Nhwc, &mut one)
        .unwrap();

    println!(
        "| batch | raw ORT frames/s (wall) | worker frames/s (wall) | worker ms/batch p50 / p99 | raw frames/CPU-s | worker frames/CPU-s | worker / raw (CPU) |{}",
        if a.cuda {
            " worker, f32 upload frames/s (wall) | u8 + GPU normalise / f32 upload |"
        } else {
            ""
        }
    );
    println!(
        "|---|---|---|---|---|---|---|{}",
        if a.cuda { "---|---|" } else { "" }
    );
    for &b in a.sizes.iter().filter(|&&b| b <= max_batch as usize) {
        let frames = vec![frame.clone(); b];
        let input: Vec<f32> = one.iter().copied().cycle().take(one.len() * b).collect();
        let shape = vec![b as i64, h as i64, w as i64, 3];
        check_run(&mut backend, "worker", name, &frames);
        if let Some(f32_backend) = f32_upload.as_mut() {
            check_run(f32_backend, "worker with cpu_preprocess", name, &frames);
        }
        let mut runs = Vec::new();
        let (mut raw_cpu, mut worker_cpu) = ((0.0, 0.0), (0.0, 0.0));
        let run_raw = |raw: &mut Session| {
            let t = TensorRef::from_array_view((shape.clone(), &input[..])).unwrap();
            let out = raw
                .run(ort::inputs![spec.input.name.as_str() => t])
                .unwrap();
            std::hint::black_box(out);
        };
        for _ in 0..a.rounds {
            runs.push(paired(
                a.seconds,
                || run_raw(&mut raw),
                || {
                    let out = backend.run(name, &frames);
                    std::hint::black_box(out);
                },
            ));
            // Alternating half-second blocks, CPU time per side.
            for _ in 0..(a.seconds.ceil() as usize).max(1) {
                let (n, c) = cpu_block(0.5, || run_raw(&mut raw));
                raw_cpu = (raw_cpu.0 + n, raw_cpu.1 + c);
                let (n, c) = cpu_block(0.5, || {
                    std::hint::black_box(backend.run(name, &frames));
                });
                worker_cpu = (worker_cpu.0 + n, worker_cpu.1 + c);
            }
        }
        // The round with the fastest raw median: the least disturbed one.
        let best = runs
            .into_iter()
            .min_by(|x, y| x.raw.total_cmp(&y.raw))
            .expect("at least one round");
        let per_cpu = |(n, c): (f64, f64)| n * b as f64 / c.max(1e-9);
        let (raw_c, worker_c) = (per_cpu(raw_cpu), per_cpu(worker_cpu));
        // u8 upload + GPU normalise against CPU normalise + f32 upload,
        // alternating batch by batch like the raw/worker pair.
        let upload = f32_upload.as_mut().map(|f32_backend| {
            let Pair {
                raw: u8_s,
                worker: f32_s,
                ..
            } = paired(
                a.seconds * a.rounds as f64,
                || {
                    std::hint::black_box(backend.run(name, &frames));
                },
                || {
                    std::hint::black_box(f32_backend.run(name, &frames));
                },
            );
            format!(" {:.0} | {:.2} |", b as f64 / f32_s, f32_s / u8_s)
        });
        println!(
            "| {b} | {:.0} | {:.0} | {:.2} / {:.2} | {raw_c:.0} | {worker_c:.0} | {:.2} |{}",
            b as f64 / best.raw,
            b as f64 / best.worker,
            best.worker * 1e3,
            best.worker_p99 * 1e3,
            worker_c / raw_c,
            upload.unwrap_or_default()
        );
    }
}
