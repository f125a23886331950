//! CUDA on the worker, behind the `cuda` cargo feature: device discovery and
//! preprocessing on the GPU.
//!
//! Everything goes through cudarc with dynamic loading, so the crate builds
//! without a CUDA toolkit and the process starts without a driver. Before any
//! CUDA call, [`driver_present`] (and for NVRTC [`nvrtc_present`]) checks that
//! the library can be loaded at all; without it every function here returns
//! [`GpuError::NoDriver`] / [`GpuError::NoNvrtc`] instead of panicking (cudarc
//! panics when a symbol is first used from a library it cannot load).
//!
//! [`GpuPreprocessor`] compiles [`KERNEL_SOURCE`] with NVRTC once at start.
//! Per batch, the u8 frames are gathered into a page-locked staging buffer
//! and copied to the device in one transfer, as u8 (a quarter of the f32
//! bytes), and one kernel launch writes the model's f32 input (layout,
//! channel order, `(p * scale - mean) / std`) into a device buffer that ONNX
//! Runtime reads in place ([`crate::backend::run_in_place`]).

// cudarc's launch API and the raw device pointer ONNX Runtime reads are
// unsafe by nature; each use says why it holds.
#![allow(unsafe_code)]

use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PinnedHostSlice, PushKernelArg,
};
use tidegate_protocol::{DType, Layout};

use crate::model::{ColorOrder, InputSpec};

/// The kernel's entry point in [`KERNEL_SOURCE`].
pub const KERNEL_NAME: &str = "tidegate_preprocess";

/// u8 RGB frames (NHWC or NCHW) → f32 model input (NHWC or NCHW). Row
/// `blockIdx.y` of the grid is frame `blockIdx.y` of the batch; within it,
/// one thread per pixel (grid-stride), the three channels each. The
/// arithmetic is the CPU path's, in the same order and without fused
/// multiply-add, so both give the same floats.
pub const KERNEL_SOURCE: &str = r#"
extern "C" __global__ void tidegate_preprocess(
    const unsigned char* __restrict__ src, float* __restrict__ dst,
    long long pixels, int src_planar, int dst_planar,
    int c0, int c1, int c2, float scale,
    float m0, float m1, float m2, float s0, float s1, float s2)
{
    const long long frame = (long long)blockIdx.y * pixels * 3;
    src += frame;
    dst += frame;
    const int sc[3] = {c0, c1, c2};
    const float mean[3] = {m0, m1, m2};
    const float sd[3] = {s0, s1, s2};
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < pixels;
         i += (long long)gridDim.x * blockDim.x) {
        for (int c = 0; c < 3; ++c) {
            const unsigned char v = src_planar ? src[sc[c] * pixels + i] : src[i * 3 + sc[c]];
            const float out = ((float)v * scale - mean[c]) / sd[c];
            dst[dst_planar ? c * pixels + i : i * 3 + c] = out;
        }
    }
}
"#;

/// Threads per block.
pub const BLOCK: u32 = 256;

/// Blocks and threads for `frames` frames of `pixels` pixels: a row of
/// blocks per frame, one thread per pixel, at most 65535 blocks a row (the
/// kernel strides over the rest). `frames` is at most a batch, far below
/// the 65535 rows a grid may have.
pub fn launch_config(pixels: usize, frames: usize) -> LaunchConfig {
    let blocks = pixels.div_ceil(BLOCK as usize).clamp(1, 65_535) as u32;
    LaunchConfig {
        grid_dim: (blocks, frames.clamp(1, 65_535) as u32, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// What the kernel needs from a model's input spec.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KernelParams {
    /// Pixels per frame.
    pub pixels: usize,
    /// Whether the model input is NCHW.
    pub dst_planar: bool,
    /// For each model channel, the frame channel it takes.
    pub source_channel: [i32; 3],
    /// Multiplies the pixel first.
    pub scale: f32,
    /// Subtracted per model channel.
    pub mean: [f32; 3],
    /// Divides per model channel.
    pub std: [f32; 3],
}

impl KernelParams {
    /// The parameters for `input`; only f32 model inputs are converted on the
    /// GPU (u8 models take the frame as it is, on the CPU path).
    pub fn new(model: &str, input: &InputSpec) -> Result<Self, GpuError> {
        if input.model_dtype != DType::F32 {
            return Err(GpuError::Unsupported {
                model: model.to_string(),
                reason: format!(
                    "input.model_dtype is {}; GPU preprocessing writes f32",
                    input.model_dtype
                ),
            });
        }
        let n = &input.normalize;
        Ok(KernelParams {
            pixels: input.width as usize * input.height as usize,
            dst_planar: input.layout == Layout::Nchw,
            source_channel: match input.color {
                ColorOrder::Rgb => [0, 1, 2],
                ColorOrder::Bgr => [2, 1, 0],
            },
            scale: n.scale,
            mean: n.mean,
            std: n.std,
        })
    }
}

/// One CUDA device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    /// Its ordinal.
    pub ordinal: usize,
    /// Its name, e.g. `NVIDIA H200`.
    pub name: String,
    /// Its memory in bytes.
    pub total_memory: usize,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
}

impl std::fmt::Display for GpuInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "cuda:{} {} ({} MiB, sm_{}{})",
            self.ordinal,
            self.name,
            self.total_memory >> 20,
            self.compute_capability.0,
            self.compute_capability.1
        )
    }
}

/// Whether the CUDA driver library (libcuda) can be loaded. Call before any
/// other CUDA function: those panic when the library is missing.
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the driver library by its known names and
    // drops the handle; no CUDA function is called.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Whether NVRTC (libnvrtc) can be loaded.
pub fn nvrtc_present() -> bool {
    // SAFETY: as for `driver_present`, a dlopen probe only.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

fn cuda(what: &'static str) -> impl Fn(cudarc::driver::DriverError) -> GpuError {
    move |e| GpuError::Cuda {
        what,
        message: e.to_string(),
    }
}

/// How many CUDA devices there are. Call only once the driver is known to
/// be present.
fn device_count() -> Result<usize, GpuError> {
    let count = CudaContext::device_count().map_err(cuda("counting devices"))?;
    Ok(count.max(0) as usize)
}

/// Opens device `ordinal` and reads what it is. Call only once the driver
/// is known to be present.
fn open(ordinal: usize) -> Result<GpuInfo, GpuError> {
    let ctx = CudaContext::new(ordinal).map_err(cuda("opening a device"))?;
    Ok(GpuInfo {
        ordinal,
        name: ctx.name().map_err(cuda("reading the device name"))?,
        total_memory: ctx.total_mem().map_err(cuda("reading the device memory"))?,
        compute_capability: ctx
            .compute_capability()
            .map_err(cuda("reading the compute capability"))?,
    })
}

/// Every CUDA device, or why there are none. Never panics.
pub fn probe() -> Result<Vec<GpuInfo>, GpuError> {
    if !driver_present() {
        return Err(GpuError::NoDriver);
    }
    (0..device_count()?).map(open).collect()
}

/// The device `ordinal`, or an error naming what is there. Opens that
/// device alone: another GPU that is busy in exclusive mode, or broken,
/// does not keep a worker from the one it is configured for.
pub fn device(ordinal: usize) -> Result<GpuInfo, GpuError> {
    if !driver_present() {
        return Err(GpuError::NoDriver);
    }
    let count = device_count()?;
    if ordinal >= count {
        return Err(GpuError::NoSuchDevice { ordinal, count });
    }
    open(ordinal)
}

/// Compiles [`KERNEL_SOURCE`] to PTX, as [`GpuPreprocessor::new`] does, for
/// the virtual architecture `arch` (e.g. `compute_90`; `None`: NVRTC's
/// default, which the driver JIT-compiles for any later GPU). Needs NVRTC
/// only: no driver, no GPU.
pub fn compile_kernel(arch: Option<&'static str>) -> Result<cudarc::nvrtc::Ptx, GpuError> {
    compile_source(KERNEL_SOURCE, arch)
}

/// Compiles CUDA `source` with the kernel's options: no fused multiply-add,
/// so that the arithmetic rounds as the CPU path's does. A rejected source
/// is [`GpuError::Compile`] with NVRTC's log (file, line and message).
pub fn compile_source(
    source: &str,
    arch: Option<&'static str>,
) -> Result<cudarc::nvrtc::Ptx, GpuError> {
    use cudarc::nvrtc::CompileError;
    if !nvrtc_present() {
        return Err(GpuError::NoNvrtc);
    }
    cudarc::nvrtc::compile_ptx_with_opts(
        source,
        cudarc::nvrtc::CompileOptions {
            fmad: Some(false),
            arch,
            name: Some(KERNEL_FILE.into()),
            ..Default::default()
        },
    )
    .map_err(|e| {
        GpuError::Compile(match e {
            CompileError::CompileError { log, .. } => log.to_string_lossy().trim_end().to_string(),
            other => other.to_string(),
        })
    })
}

/// The file name NVRTC gives the kernel in its messages.
pub const KERNEL_FILE: &str = "tidegate_preprocess.cu";

/// The batch as runs of consecutive frames in the same layout, `(first
/// frame, frames, layout)`: one kernel launch each (one for a batch from one
/// edge).
pub fn layout_runs(layouts: impl IntoIterator<Item = Layout>) -> Vec<(usize, usize, Layout)> {
    let mut runs: Vec<(usize, usize, Layout)> = Vec::new();
    for (k, layout) in layouts.into_iter().enumerate() {
        match runs.last_mut() {
            Some((_, n, l)) if *l == layout => *n += 1,
            _ => runs.push((k, 1, layout)),
        }
    }
    runs
}

/// Preprocessing of one model's batches on one GPU.
pub struct GpuPreprocessor {
    stream: Arc<CudaStream>,
    function: CudaFunction,
    params: KernelParams,
    /// Page-locked host memory the batch is gathered into, `max_batch`
    /// frames, so that it crosses to the device in one DMA transfer.
    staging: PinnedHostSlice<u8>,
    /// The frames as uploaded (u8), `max_batch` frames.
    frames: CudaSlice<u8>,
    /// The model input (f32), `max_batch` frames.
    input: CudaSlice<f32>,
    max_batch: usize,
}

impl std::fmt::Debug for GpuPreprocessor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuPreprocessor")
            .field("params", &self.params)
            .field("max_batch", &self.max_batch)
            .finish_non_exhaustive()
    }
}

impl GpuPreprocessor {
    /// Compiles the kernel for device `ordinal` and allocates buffers for
    /// `max_batch` frames of `input`.
    pub fn new(
        model: &str,
        ordinal: usize,
        input: &InputSpec,
        max_batch: usize,
    ) -> Result<Self, GpuError> {
        let params = KernelParams::new(model, input)?;
        if !driver_present() {
            return Err(GpuError::NoDriver);
        }
        if !nvrtc_present() {
            return Err(GpuError::NoNvrtc);
        }
        let cuda = |what: &'static str| {
            move |e: cudarc::driver::DriverError| GpuError::Cuda {
                what,
                message: e.to_string(),
            }
        };
        let ctx = CudaContext::new(ordinal).map_err(cuda("opening the device"))?;
        let ptx = compile_kernel(None)?;
        let module = ctx.load_module(ptx).map_err(cuda("loading the kernel"))?;
        let function = module
            .load_function(KERNEL_NAME)
            .map_err(cuda("finding the kernel"))?;
        let stream = ctx.default_stream();
        let len = params.pixels * 3 * max_batch.max(1);
        // SAFETY: the memory is uninitialised until the write below, and
        // nothing reads it before.
        let mut staging = unsafe { ctx.alloc_pinned::<u8>(len) }
            .map_err(cuda("allocating the page-locked staging buffer"))?;
        // SAFETY: `staging` holds `len` bytes; this initialises all of them.
        unsafe {
            std::ptr::write_bytes(
                staging
                    .as_mut_ptr()
                    .map_err(cuda("initialising the staging buffer"))?,
                0,
                len,
            )
        };
        let frames = stream
            .alloc_zeros::<u8>(len)
            .map_err(cuda("allocating the frame buffer"))?;
        let input = stream
            .alloc_zeros::<f32>(len)
            .map_err(cuda("allocating the model input"))?;
        Ok(GpuPreprocessor {
            stream,
            function,
            params,
            staging,
            frames,
            input,
            max_batch: max_batch.max(1),
        })
    }

    /// The kernel parameters.
    pub fn params(&self) -> &KernelParams {
        &self.params
    }

    /// Uploads `frames` (u8, each `pixels * 3` bytes in its own layout) in
    /// one transfer and converts them into the model input on the device
    /// (one launch per [`layout_runs`] run); returns once the input is ready.
    pub fn convert(&mut self, frames: &[(&[u8], Layout)]) -> Result<(), GpuError> {
        let len = self.params.pixels * 3;
        if frames.len() > self.max_batch || frames.iter().any(|(f, _)| f.len() != len) {
            return Err(GpuError::Batch {
                frames: frames.len(),
                max_batch: self.max_batch,
                frame_len: len,
            });
        }
        let cuda = |what: &'static str| {
            move |e: cudarc::driver::DriverError| GpuError::Cuda {
                what,
                message: e.to_string(),
            }
        };
        let batch = frames.len() * len;
        {
            let staging = self
                .staging
                .as_mut_slice()
                .map_err(cuda("waiting for the staging buffer"))?;
            for ((data, _), slot) in frames.iter().zip(staging.chunks_exact_mut(len)) {
                slot.copy_from_slice(data);
            }
        }
        let staged = &self
            .staging
            .as_slice()
            .map_err(cuda("waiting for the staging buffer"))?[..batch];
        self.stream
            .memcpy_htod(staged, &mut self.frames.slice_mut(0..batch))
            .map_err(cuda("uploading the batch"))?;
        let p = &self.params;
        let pixels = p.pixels as i64;
        let dst_planar = i32::from(p.dst_planar);
        let [c0, c1, c2] = p.source_channel;
        let [m0, m1, m2] = p.mean;
        let [s0, s1, s2] = p.std;
        for (first, count, layout) in layout_runs(frames.iter().map(|(_, l)| *l)) {
            let range = first * len..(first + count) * len;
            let src = self.frames.slice(range.clone());
            let mut out = self.input.slice_mut(range);
            let src_planar = i32::from(layout == Layout::Nchw);
            let mut launch = self.stream.launch_builder(&self.function);
            launch
                .arg(&src)
                .arg(&mut out)
                .arg(&pixels)
                .arg(&src_planar)
                .arg(&dst_planar)
                .arg(&c0)
                .arg(&c1)
                .arg(&c2)
                .arg(&p.scale)
                .arg(&m0)
                .arg(&m1)
                .arg(&m2)
                .arg(&s0)
                .arg(&s1)
                .arg(&s2);
            // SAFETY: the arguments match the kernel's signature in type and
            // order; `src` and `out` hold `count` frames of `pixels * 3`
            // elements, and the grid has `count` rows, one per frame, so
            // every index the kernel touches is inside them.
            unsafe { launch.launch(launch_config(p.pixels, count)) }
                .map_err(cuda("launching the kernel"))?;
        }
        // ONNX Runtime reads the input on its own stream: finish ours first.
        self.stream
            .synchronize()
            .map_err(cuda("waiting for the kernel"))?;
        Ok(())
    }

    /// The device address of the model input and the CUDA stream's
    /// ordinal, for binding it to ONNX Runtime.
    pub fn input_ptr(&self) -> u64 {
        use cudarc::driver::DevicePtr;
        let (ptr, _sync) = self.input.device_ptr(&self.stream);
        ptr
    }

    /// The model input on the device as an ONNX Runtime tensor of `shape`
    /// (batch first, at most `max_batch` frames), which ONNX Runtime reads
    /// in place ([`crate::backend::run_in_place`]).
    pub fn input_tensor(
        &self,
        device_id: i32,
        shape: &[i64],
    ) -> Result<ort::value::TensorRefMut<'_, f32>, ort::Error> {
        use ort::memory::{AllocationDevice, AllocatorType, MemoryInfo, MemoryType};
        let elements: i64 = shape.iter().product();
        if shape.is_empty()
            || elements < 0
            || elements as usize > self.params.pixels * 3 * self.max_batch
        {
            return Err(ort::Error::new(format!(
                "shape {shape:?} does not fit the GPU input buffer of {} frames",
                self.max_batch
            )));
        }
        let info = MemoryInfo::new(
            AllocationDevice::CUDA,
            device_id,
            AllocatorType::Device,
            MemoryType::Default,
        )?;
        // SAFETY: the pointer is this preprocessor's device buffer on device
        // `device_id`, holding `max_batch` frames, of which `shape` covers at
        // most all (checked above); the returned tensor borrows `self`, so
        // the buffer outlives it.
        unsafe {
            ort::value::TensorRefMut::from_raw(
                info,
                self.input_ptr() as usize as *mut std::ffi::c_void,
                ort::value::Shape::new(shape.iter().copied()),
            )
        }
    }

    /// The first `frames` frames of model input, copied back (for tests and
    /// checks).
    pub fn download(&self, frames: usize) -> Result<Vec<f32>, GpuError> {
        let len = self.params.pixels * 3 * frames.min(self.max_batch);
        self.stream
            .clone_dtoh(&self.input.slice(0..len))
            .map_err(|e| GpuError::Cuda {
                what: "downloading the model input",
                message: e.to_string(),
            })
    }
}

/// Why CUDA cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GpuError {
    /// libcuda.so cannot be loaded: no NVIDIA driver here.
    #[error(
        "no CUDA driver: libcuda.so cannot be loaded; install the NVIDIA driver, or run on the CPU"
    )]
    NoDriver,
    /// libnvrtc.so cannot be loaded, so the kernel cannot be compiled.
    #[error(
        "NVRTC not found: libnvrtc.so cannot be loaded; install the CUDA runtime compiler (cuda-nvrtc) or put it on LD_LIBRARY_PATH"
    )]
    NoNvrtc,
    /// No device with that ordinal.
    #[error("no CUDA device {ordinal}: this machine has {count}")]
    NoSuchDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// Devices present.
        count: usize,
    },
    /// A CUDA call failed.
    #[error("CUDA failed {what}: {message}")]
    Cuda {
        /// What was being done.
        what: &'static str,
        /// CUDA's account.
        message: String,
    },
    /// NVRTC rejected the kernel (a worker bug).
    #[error("NVRTC could not compile the preprocessing kernel: {0}")]
    Compile(String),
    /// The model cannot be preprocessed on the GPU.
    #[error("model '{model}': no GPU preprocessing: {reason}")]
    Unsupported {
        /// The model.
        model: String,
        /// Why.
        reason: String,
    },
    /// A batch does not fit the buffers (a worker bug: the backend checks).
    #[error(
        "GPU preprocessing got {frames} frames (max {max_batch}) or a frame not of {frame_len} bytes"
    )]
    Batch {
        /// Frames given.
        frames: usize,
        /// Buffer capacity.
        max_batch: usize,
        /// Bytes per frame.
        frame_len: usize,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Normalize, Resize};

    fn input(layout: Layout, color: ColorOrder) -> InputSpec {
        InputSpec {
            name: "x".into(),
            layout,
            width: 9,
            height: 7,
            channels: 3,
            color,
            resize: Resize::Stretch,
            model_dtype: DType::F32,
            normalize: Normalize {
                scale: 1.0 / 255.0,
                mean: [0.485, 0.456, 0.406],
                std: [0.229, 0.224, 0.225],
            },
        }
    }

    #[test]
    fn kernel_source_declares_the_entry_point_with_every_argument() {
        assert!(KERNEL_SOURCE.contains(&format!("__global__ void {KERNEL_NAME}(")));
        // 15 arguments, as `convert` pushes them.
        let signature = KERNEL_SOURCE
            .split(&format!("{KERNEL_NAME}("))
            .nth(1)
            .and_then(|s| s.split(')').next())
            .unwrap();
        assert_eq!(signature.split(',').count(), 15, "{signature}");
    }

    #[test]
    fn launch_covers_every_pixel_within_grid_limits() {
        let c = launch_config(128 * 128, 8);
        assert_eq!(c.block_dim, (BLOCK, 1, 1));
        assert_eq!(c.grid_dim.0 as usize * BLOCK as usize, 128 * 128);
        assert_eq!(c.grid_dim.1, 8, "a row of blocks per frame");
        assert_eq!(launch_config(1, 1).grid_dim, (1, 1, 1));
        assert_eq!(launch_config(0, 0).grid_dim, (1, 1, 1));
        assert_eq!(launch_config(usize::MAX / 2, 32).grid_dim, (65_535, 32, 1));
    }

    #[test]
    fn a_batch_launches_once_per_run_of_one_layout() {
        use Layout::{Nchw, Nhwc};
        assert_eq!(layout_runs([]), vec![]);
        assert_eq!(layout_runs([Nhwc; 32]), vec![(0, 32, Nhwc)]);
        assert_eq!(
            layout_runs([Nhwc, Nhwc, Nchw, Nhwc, Nchw, Nchw]),
            vec![(0, 2, Nhwc), (2, 1, Nchw), (3, 1, Nhwc), (4, 2, Nchw)]
        );
    }

    #[test]
    fn u8_model_input_is_left_to_the_cpu_path() {
        let mut spec = input(Layout::Nhwc, ColorOrder::Rgb);
        spec.model_dtype = DType::U8;
        let err = KernelParams::new("probe", &spec).unwrap_err().to_string();
        assert!(err.contains("model 'probe'") && err.contains("u8"), "{err}");
    }

    /// Whether `TIDEGATE_REQUIRE_GPU=1` (scripts/gpu-check.sh sets it): no
    /// usable GPU is then a failure, not a skip.
    fn gpu_required() -> bool {
        std::env::var("TIDEGATE_REQUIRE_GPU").is_ok_and(|v| v == "1")
    }

    /// Without a driver, or with one but no usable device, discovery
    /// answers with an error and never panics, and so do the functions
    /// that need a device; with devices, it describes each. Under
    /// `TIDEGATE_REQUIRE_GPU=1` it must find at least one.
    #[test]
    fn discovery_never_panics() {
        let spec = input(Layout::Nhwc, ColorOrder::Rgb);
        match probe() {
            Err(e) => {
                assert!(
                    !gpu_required(),
                    "TIDEGATE_REQUIRE_GPU=1 but no usable CUDA device: {e}"
                );
                if e == GpuError::NoDriver {
                    assert!(!driver_present());
                } else {
                    assert!(driver_present(), "{e}");
                    assert!(matches!(e, GpuError::Cuda { .. }), "{e:?}");
                }
                eprintln!(
                    "no usable CUDA device here ({e}): GPU checks skipped (run scripts/gpu-check.sh on a GPU machine)"
                );
                if e == GpuError::NoDriver {
                    assert_eq!(device(0).unwrap_err(), e);
                    assert!(GpuPreprocessor::new("m", 0, &spec, 1).is_err());
                }
                // Otherwise one device was unusable; device(0) opens device
                // 0 alone and may well work.
            }
            Ok(devices) if devices.is_empty() => {
                assert!(
                    !gpu_required(),
                    "TIDEGATE_REQUIRE_GPU=1 but the CUDA driver lists no device"
                );
                eprintln!("the CUDA driver lists no device: GPU checks skipped");
                assert_eq!(
                    device(0).unwrap_err(),
                    GpuError::NoSuchDevice {
                        ordinal: 0,
                        count: 0
                    }
                );
            }
            Ok(devices) => {
                for (i, d) in devices.iter().enumerate() {
                    assert_eq!(d.ordinal, i, "{d}");
                    assert!(!d.name.is_empty() && d.total_memory > 0, "{d}");
                    assert!(d.compute_capability.0 >= 3, "{d}");
                    eprintln!("found {d}");
                    // Opened alone, the device reads the same.
                    assert_eq!(device(i).as_ref(), Ok(d));
                }
                let past = devices.len();
                assert_eq!(
                    device(past).unwrap_err(),
                    GpuError::NoSuchDevice {
                        ordinal: past,
                        count: past
                    }
                );
            }
        }
    }
}
