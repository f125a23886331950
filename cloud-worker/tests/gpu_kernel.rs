//! The GPU preprocessing kernel, checked on machines without a GPU (built
//! with `--features cuda`; tests/gpu.rs runs it on a GPU).
//!
//! - NVRTC, a library that needs no driver, compiles [`gpu::KERNEL_SOURCE`]
//!   exactly as the worker does at start, for NVRTC's default architecture
//!   and for the H100/H200's (`compute_90`), and the PTX entry point takes
//!   the parameters `GpuPreprocessor::convert` passes, in order and type.
//! - A kernel NVRTC rejects is reported with NVRTC's own message.
//! - The same kernel source, compiled for this CPU by the system C++
//!   compiler with CUDA's built-in variables defined, and run thread by
//!   thread over the worker's launch configuration (one launch for the
//!   batch, a row of blocks per frame), gives the CPU
//!   preprocessor's floats for every layout and channel order. The kernel has
//!   no shared memory, no synchronisation and no atomics, and each thread
//!   writes its own pixels, so running its threads one after another is one
//!   of the orders a GPU may run them in. This checks the kernel's indexing
//!   and arithmetic; the device run (scripts/gpu-check.sh) checks the rest.
//!
//! NVRTC comes from `make setup` (the pinned `nvidia-cuda-nvrtc-cu12` wheel,
//! unpacked into the tidegate cache) unless one is already on the library
//! path. Without NVRTC or a C++ compiler a test says what is missing and
//! returns, except under CI (`CI` set), where `make setup` provides both and
//! a skip is a failure.

#![cfg(feature = "cuda")]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use tidegate_protocol::{DType, Layout};
use tidegate_worker::gpu::{self, GpuError, KernelParams};
use tidegate_worker::model::{ColorOrder, InputSpec, Normalize, Resize};
use tidegate_worker::preprocess::Preprocessor;

/// The NVRTC release `make setup` installs (scripts/setup.sh).
const NVRTC_VERSION: &str = "12.9.86";

fn skip(test: &str, why: &str) {
    eprintln!("SKIPPED {test}: {why}");
    assert!(
        std::env::var_os("CI").is_none(),
        "{test}: {why}, and under CI `make setup` provides it"
    );
}

/// Makes NVRTC loadable: if it is not on the library path, loads the cached
/// copy by its full path, globally, so that cudarc's later load by name
/// finds it already in the process. `Err` says what is missing.
fn nvrtc() -> Result<(), String> {
    static LOADED: OnceLock<Result<(), String>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            if gpu::nvrtc_present() {
                return Ok(());
            }
            let dir = tidegate_worker::runtime::cache_dir()
                .map_err(|e| e.to_string())?
                .join("cuda-nvrtc")
                .join(NVRTC_VERSION);
            let lib = dir.join("libnvrtc.so.12");
            if !lib.is_file() {
                return Err(format!(
                    "no NVRTC on the library path nor at {} (make setup installs it)",
                    lib.display()
                ));
            }
            use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
            // SAFETY: NVRTC's initialisers only set up its own state; the
            // handle is leaked so the library stays loaded for cudarc.
            #[allow(unsafe_code)]
            let handle = unsafe { Library::open(Some(&lib), RTLD_NOW | RTLD_GLOBAL) }
                .map_err(|e| format!("loading {}: {e}", lib.display()))?;
            std::mem::forget(handle);
            if gpu::nvrtc_present() {
                Ok(())
            } else {
                Err(format!(
                    "{} loaded, but cudarc still finds no NVRTC",
                    lib.display()
                ))
            }
        })
        .clone()
}

/// The `.param` types of PTX entry point `name`, in order.
fn entry_params(ptx: &str, name: &str) -> Vec<String> {
    let start = ptx
        .find(&format!(".entry {name}("))
        .unwrap_or_else(|| panic!("no entry point {name} in the PTX:\n{ptx}"));
    let list = &ptx[start..];
    let list = &list[list.find('(').unwrap() + 1..list.find(')').unwrap()];
    list.split(',')
        .map(|p| {
            let mut words = p.split_whitespace();
            assert_eq!(words.next(), Some(".param"), "parameter {p:?}");
            words.next().unwrap_or_default().to_string()
        })
        .collect()
}

#[test]
fn nvrtc_compiles_the_kernel_with_the_parameters_the_launch_passes() {
    if let Err(why) = nvrtc() {
        return skip(
            "nvrtc_compiles_the_kernel_with_the_parameters_the_launch_passes",
            &why,
        );
    }
    // `GpuPreprocessor::convert`'s arguments: the u8 frames and f32 input
    // (device pointers), pixels (i64), src_planar and dst_planar (i32), the
    // three source channels (i32), scale, three means and three stds (f32).
    let want: Vec<&str> = [".u64"; 3]
        .into_iter()
        .chain([".u32"; 5])
        .chain([".f32"; 7])
        .collect();
    for arch in [None, Some("compute_90")] {
        let ptx = gpu::compile_kernel(arch)
            .unwrap_or_else(|e| panic!("arch {arch:?}: {e}"))
            .to_src();
        assert_eq!(
            entry_params(&ptx, gpu::KERNEL_NAME),
            want,
            "arch {arch:?}: the kernel's parameters differ from the launch's"
        );
        if let Some(arch) = arch {
            let target = arch.replace("compute_", "sm_");
            assert!(
                ptx.contains(&format!(".target {target}")),
                "PTX not for {target}:\n{ptx}"
            );
        }
        // No fused multiply-add: the CPU path rounds after the multiply.
        assert!(!ptx.contains("fma."), "arch {arch:?}: PTX has an fma");
    }
}

#[test]
fn a_kernel_nvrtc_rejects_is_reported_with_its_message() {
    if let Err(why) = nvrtc() {
        return skip("a_kernel_nvrtc_rejects_is_reported_with_its_message", &why);
    }
    let broken = gpu::KERNEL_SOURCE.replace("const float out =", "const float out = undeclared +");
    match gpu::compile_source(&broken, None) {
        Err(GpuError::Compile(log)) => {
            assert!(
                log.contains(gpu::KERNEL_FILE) && log.contains("undeclared"),
                "the log names neither the file nor the identifier: {log}"
            );
            assert!(!log.contains("\\n"), "the log is escaped: {log}");
            let shown = GpuError::Compile(log).to_string();
            assert!(shown.starts_with("NVRTC could not compile"), "{shown}");
        }
        other => panic!("expected a compile error, got {other:?}"),
    }
}

/// The kernel source compiled for the host: a program that reads the frames
/// from a file, runs every thread of a grid over each frame and writes the
/// model input to a file.
struct HostKernel {
    exe: PathBuf,
    _dir: tempfile::TempDir,
}

const HOST_PRELUDE: &str = r#"
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
struct tidegate_dim3 { unsigned int x, y, z; };
static tidegate_dim3 blockIdx, blockDim, threadIdx, gridDim;
#define __global__
#define __restrict__ __restrict
"#;

const HOST_MAIN: &str = r#"
static float bits(const char* s) {
    unsigned int u = (unsigned int)strtoul(s, nullptr, 16);
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
// in out frames pixels src_planar dst_planar c0 c1 c2 scale m0 m1 m2 s0 s1 s2 grid block
int main(int argc, char** argv) {
    if (argc != 19) { fprintf(stderr, "usage: 18 arguments\n"); return 2; }
    long long frames = atoll(argv[3]), pixels = atoll(argv[4]);
    size_t len = (size_t)(pixels * 3);
    std::vector<unsigned char> src(len * frames);
    std::vector<float> dst(len * frames);
    FILE* in = fopen(argv[1], "rb");
    if (!in || fread(src.data(), 1, src.size(), in) != src.size()) { perror("in"); return 1; }
    fclose(in);
    // NaN marks what no thread wrote.
    for (auto& v : dst) { unsigned int u = 0x7fc00000u; memcpy(&v, &u, sizeof v); }
    // One launch over the whole batch: a row of blocks per frame.
    gridDim = {(unsigned int)atoi(argv[17]), (unsigned int)frames, 1};
    blockDim = {(unsigned int)atoi(argv[18]), 1, 1};
    for (unsigned int y = 0; y < gridDim.y; ++y)
        for (unsigned int b = 0; b < gridDim.x; ++b)
            for (unsigned int t = 0; t < blockDim.x; ++t) {
                blockIdx = {b, y, 0};
                threadIdx = {t, 0, 0};
                tidegate_preprocess(src.data(), dst.data(), pixels,
                    atoi(argv[5]), atoi(argv[6]), atoi(argv[7]), atoi(argv[8]), atoi(argv[9]),
                    bits(argv[10]), bits(argv[11]), bits(argv[12]), bits(argv[13]),
                    bits(argv[14]), bits(argv[15]), bits(argv[16]));
            }
    FILE* out = fopen(argv[2], "wb");
    if (!out || fwrite(dst.data(), sizeof(float), dst.size(), out) != dst.size()) { perror("out"); return 1; }
    return fclose(out) == 0 ? 0 : 1;
}
"#;

impl HostKernel {
    /// Compiles the kernel with `$CXX` (default `c++`), without contracting
    /// multiply and add (NVRTC's `fmad=false`); `Err` when there is no
    /// compiler.
    fn build() -> Result<Self, String> {
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let src = dir.path().join("kernel_host.cpp");
        let exe = dir.path().join("kernel_host");
        std::fs::write(
            &src,
            format!("{HOST_PRELUDE}{}{HOST_MAIN}", gpu::KERNEL_SOURCE),
        )
        .map_err(|e| e.to_string())?;
        let out = Command::new(&cxx)
            .args(["-std=c++17", "-O2", "-ffp-contract=off", "-Wall", "-Werror"])
            .arg(&src)
            .arg("-o")
            .arg(&exe)
            .output()
            .map_err(|e| format!("no C++ compiler ({cxx}: {e}); build-essential has one"))?;
        assert!(
            out.status.success(),
            "{cxx} rejected the kernel source:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(HostKernel { exe, _dir: dir })
    }

    /// Runs the kernel once over `frames` (each `pixels * 3` bytes, one row
    /// of the grid each) with rows of `grid` blocks of `block` threads.
    fn run(
        &self,
        params: &KernelParams,
        frames: &[u8],
        src_layout: Layout,
        grid: u32,
        block: u32,
    ) -> Vec<f32> {
        let dir = self.exe.parent().unwrap();
        let (input, output) = (dir.join("in.bin"), dir.join("out.bin"));
        std::fs::write(&input, frames).unwrap();
        let hex = |f: f32| format!("{:x}", f.to_bits());
        let mut args: Vec<String> = vec![
            path(&input),
            path(&output),
            (frames.len() / (params.pixels * 3)).to_string(),
            params.pixels.to_string(),
            u8::from(src_layout == Layout::Nchw).to_string(),
            u8::from(params.dst_planar).to_string(),
        ];
        args.extend(params.source_channel.iter().map(i32::to_string));
        args.push(hex(params.scale));
        args.extend(params.mean.iter().copied().map(hex));
        args.extend(params.std.iter().copied().map(hex));
        args.extend([grid.to_string(), block.to_string()]);
        let out = Command::new(&self.exe).args(&args).output().unwrap();
        assert!(
            out.status.success(),
            "the host kernel failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::fs::read(&output)
            .unwrap()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    }
}

fn path(p: &Path) -> String {
    p.to_str().expect("a UTF-8 temp path").to_string()
}

fn spec(width: u32, height: u32, layout: Layout, color: ColorOrder, n: Normalize) -> InputSpec {
    InputSpec {
        name: "x".into(),
        layout,
        width,
        height,
        channels: 3,
        color,
        resize: Resize::Stretch,
        model_dtype: DType::F32,
        normalize: n,
    }
}

#[test]
fn the_kernel_run_on_the_host_gives_the_cpu_preprocessors_floats() {
    let host = match HostKernel::build() {
        Ok(h) => h,
        Err(why) => {
            return skip(
                "the_kernel_run_on_the_host_gives_the_cpu_preprocessors_floats",
                &why,
            );
        }
    };
    let imagenet = Normalize {
        scale: 1.0 / 255.0,
        mean: [0.485, 0.456, 0.406],
        std: [0.229, 0.224, 0.225],
    };
    let symmetric = Normalize {
        scale: 1.0 / 127.5,
        mean: [1.0; 3],
        std: [1.0; 3],
    };
    // An odd size (9×7), so that a swapped width and height shows; BlazeFace's
    // 128×128 (64 blocks); every byte value occurs in each.
    for (width, height, n) in [(9, 7, imagenet), (128, 128, symmetric)] {
        let frame_len = (width * height * 3) as usize;
        let frames: Vec<u8> = (0..3 * frame_len).map(|i| (i * 37 % 256) as u8).collect();
        for layout in [Layout::Nhwc, Layout::Nchw] {
            for color in [ColorOrder::Rgb, ColorOrder::Bgr] {
                let spec = spec(width, height, layout, color, n);
                let params = KernelParams::new("m", &spec).unwrap();
                let cpu = Preprocessor::new(&spec);
                let launch = gpu::launch_config(params.pixels, 3);
                assert_eq!(launch.grid_dim.1, 3, "a row per frame");
                // The worker's launch, and a grid too small for the frame, so
                // that each thread strides over several pixels.
                let grids = [(launch.grid_dim.0, launch.block_dim.0), (2, 5)];
                for src_layout in [Layout::Nhwc, Layout::Nchw] {
                    let mut want = vec![f32::NAN; frames.len()];
                    for (f, out) in frames
                        .chunks_exact(frame_len)
                        .zip(want.chunks_exact_mut(frame_len))
                    {
                        cpu.to_f32(f, src_layout, out).unwrap();
                    }
                    for (grid, block) in grids {
                        let got = host.run(&params, &frames, src_layout, grid, block);
                        let what = format!(
                            "{width}×{height}, model {layout}/{color:?}, frames {src_layout}, grid {grid}×{block}"
                        );
                        assert_eq!(got.len(), want.len(), "{what}");
                        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                            assert!(
                                g.to_bits() == w.to_bits(),
                                "{what}: value {i} is {g}, the CPU path's {w}"
                            );
                        }
                    }
                }
            }
        }
    }
}
