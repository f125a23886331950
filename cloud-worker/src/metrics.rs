//! Prometheus metrics of one worker process, served at `/metrics` on the
//! optional `[metrics] listen` address: the batches it answered, their run
//! time, its frames by outcome, the backend's queue and busy time, and its
//! GPUs through NVML.
//!
//! The GPU gauges are read at scrape time from a [`GpuSource`], never on the
//! batch path. [`Nvml`] is the real one; it loads `libnvidia-ml.so` at run
//! time, so a machine without an NVIDIA driver builds and runs the worker,
//! and exports `tidegate_worker_gpu_info{gpu="none"} 1` and no per-GPU
//! gauge instead.
//!
//! Two of the worker's series describe what the gateway also measures, and
//! are named apart from the gateway's on purpose:
//! `tidegate_worker_batch_run_seconds{model}` (the backend's own run time)
//! beside the gateway's `tidegate_worker_batch_seconds{worker,model}`
//! (dispatch to answer), and `tidegate_worker_answered_frames_total` beside
//! the gateway's `tidegate_worker_frames_total{worker,status}`. One name for
//! both would mix the two in every query that does not filter on the job.

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use prometheus::core::{Collector, Desc};
use prometheus::proto::{self, MetricFamily, MetricType};
use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
    TextEncoder,
};
use tokio_util::sync::CancellationToken;

use crate::executor::Activity;
use tidegate_protocol::ItemResult;

/// Run-time buckets (seconds): fine below the 80 ms end-to-end budget a
/// batch shares with the link and the gateway's queue, coarse above.
pub const RUN_BUCKETS: &[f64] = &[
    0.001, 0.002, 0.005, 0.010, 0.015, 0.020, 0.030, 0.040, 0.050, 0.060, 0.080, 0.100, 0.150,
    0.250, 0.500, 1.0,
];

/// The `gpu` label of the one `tidegate_worker_gpu_info` series of a worker
/// that reads no GPU (no NVIDIA driver, or NVML failed to start).
pub const NO_GPU: &str = "none";

/// The file, from the workspace root, that lists
/// [`WorkerMetrics::series_names`], one a line, for the dashboard's check.
pub const SERIES_FILE: &str = "deploy/grafana/series/worker.txt";

/// The frame statuses exported at 0 for every model from the start
/// ([`tidegate_protocol::Status::label`]).
pub const FRAME_STATUSES: [&str; 4] = ["ok", "shed", "expired", "failed"];

/// One GPU as read at a scrape. A field the driver does not report for this
/// GPU (power on some boards, temperature in some VMs) is `None`, and its
/// gauge is left out rather than exported as 0.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GpuReading {
    /// NVML's index of the GPU (`nvidia-smi -L`), the `gpu` label.
    pub index: u32,
    /// Its product name, e.g. `NVIDIA H200`.
    pub name: String,
    /// Share of the last sample period (about 1/6 s to 1 s, the driver's)
    /// in which a kernel ran, 0..=1.
    pub utilization: Option<f64>,
    /// Device memory allocated, in bytes.
    pub memory_used_bytes: Option<u64>,
    /// Device memory installed, in bytes.
    pub memory_total_bytes: Option<u64>,
    /// Power drawn by the board, in watts.
    pub power_watts: Option<f64>,
    /// Die temperature, in degrees Celsius.
    pub temperature_celsius: Option<f64>,
}

/// Where the GPU gauges come from: NVML ([`Nvml`]) on a worker, a fixed
/// reading in tests.
pub trait GpuSource: Send + Sync + std::fmt::Debug {
    /// Every GPU this process can see, read now. An error (the driver went
    /// away) leaves the GPUs out of this scrape; the text says why.
    fn read(&self) -> Result<Vec<GpuReading>, String>;
}

/// The NVIDIA Management Library, loaded once.
pub struct Nvml {
    nvml: nvml_wrapper::Nvml,
}

impl std::fmt::Debug for Nvml {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Nvml")
    }
}

impl Nvml {
    /// Loads `libnvidia-ml.so` and starts NVML. Fails on a machine without
    /// the NVIDIA driver, with NVML's reason.
    pub fn init() -> Result<Self, String> {
        nvml_wrapper::Nvml::init()
            .map(|nvml| Nvml { nvml })
            .map_err(|e| format!("NVML did not start ({e}); is the NVIDIA driver installed?"))
    }
}

impl GpuSource for Nvml {
    fn read(&self) -> Result<Vec<GpuReading>, String> {
        use nvml_wrapper::enum_wrappers::device::TemperatureSensor;
        let count = self
            .nvml
            .device_count()
            .map_err(|e| format!("NVML cannot count the GPUs: {e}"))?;
        let mut gpus = Vec::with_capacity(count as usize);
        for index in 0..count {
            // A GPU fallen off the bus is left out; the others are read.
            let Ok(d) = self.nvml.device_by_index(index) else {
                continue;
            };
            let memory = d.memory_info().ok();
            gpus.push(GpuReading {
                index,
                name: d.name().unwrap_or_default(),
                utilization: d.utilization_rates().ok().map(|u| f64::from(u.gpu) / 100.0),
                memory_used_bytes: memory.as_ref().map(|m| m.used),
                memory_total_bytes: memory.as_ref().map(|m| m.total),
                power_watts: d.power_usage().ok().map(|mw| f64::from(mw) / 1000.0),
                temperature_celsius: d.temperature(TemperatureSensor::Gpu).ok().map(f64::from),
            });
        }
        Ok(gpus)
    }
}

/// The GPU source of a worker process: NVML when it starts, else none, and
/// why, logged once at INFO.
pub fn gpu_source() -> Option<Arc<dyn GpuSource>> {
    match Nvml::init() {
        Ok(nvml) => Some(Arc::new(nvml)),
        Err(why) => {
            tracing::info!(
                "no GPU metrics: {why}; exporting tidegate_worker_gpu_info{{gpu=\"none\"}}"
            );
            None
        }
    }
}

/// The per-GPU gauges: (name, help, the reading's value).
type GpuGauge = (&'static str, &'static str, fn(&GpuReading) -> Option<f64>);

const GPU_GAUGES: [GpuGauge; 5] = [
    (
        "tidegate_worker_gpu_utilization_ratio",
        "Share of the driver's last sample period in which a kernel ran on the GPU (NVML), 0 to 1.",
        |g| g.utilization,
    ),
    (
        "tidegate_worker_gpu_memory_used_bytes",
        "GPU memory allocated, in bytes (NVML).",
        |g| g.memory_used_bytes.map(|b| b as f64),
    ),
    (
        "tidegate_worker_gpu_memory_total_bytes",
        "GPU memory installed, in bytes (NVML).",
        |g| g.memory_total_bytes.map(|b| b as f64),
    ),
    (
        "tidegate_worker_gpu_power_watts",
        "Power drawn by the GPU board, in watts (NVML).",
        |g| g.power_watts,
    ),
    (
        "tidegate_worker_gpu_temperature_celsius",
        "GPU die temperature, in degrees Celsius (NVML).",
        |g| g.temperature_celsius,
    ),
];

const GPU_INFO: &str = "tidegate_worker_gpu_info";
const GPU_INFO_HELP: &str = "1 per GPU the worker reads, labelled with its index and name; gpu=\"none\" when it reads none (no NVIDIA driver).";

/// A collector of the GPU gauges, reading its source at each scrape.
#[derive(Debug)]
struct GpuCollector {
    source: Option<Arc<dyn GpuSource>>,
    descs: Vec<Desc>,
    /// Whether the last read failed: a failure is logged once, until a
    /// read succeeds again.
    failing: std::sync::atomic::AtomicBool,
}

impl GpuCollector {
    fn new(source: Option<Arc<dyn GpuSource>>) -> Self {
        let mut descs = vec![
            Desc::new(
                GPU_INFO.into(),
                GPU_INFO_HELP.into(),
                vec!["gpu".into(), "name".into()],
                Default::default(),
            )
            .expect("valid desc"),
        ];
        for (name, help, _) in GPU_GAUGES {
            descs.push(
                Desc::new(
                    name.into(),
                    help.into(),
                    vec!["gpu".into()],
                    Default::default(),
                )
                .expect("valid desc"),
            );
        }
        GpuCollector {
            source,
            descs,
            failing: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// The readings of this scrape: `None` without a source, none when
    /// the read fails.
    fn readings(&self) -> Option<Vec<GpuReading>> {
        use std::sync::atomic::Ordering;
        let source = self.source.as_ref()?;
        match source.read() {
            Ok(gpus) => {
                self.failing.store(false, Ordering::Relaxed);
                Some(gpus)
            }
            Err(why) => {
                if !self.failing.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        "cannot read the GPUs: {why}; their metrics are left out until a read succeeds"
                    );
                }
                Some(Vec::new())
            }
        }
    }
}

impl Collector for GpuCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        gpu_families(self.readings().as_deref())
    }
}

/// The GPU families for `readings`: `None` is a worker that reads no GPU,
/// exported as `tidegate_worker_gpu_info{gpu="none"} 1` alone.
pub fn gpu_families(readings: Option<&[GpuReading]>) -> Vec<MetricFamily> {
    let gauge = |labels: &[(&str, &str)], v: f64| {
        let mut m = proto::Metric::default();
        m.set_label(
            labels
                .iter()
                .map(|(k, v)| {
                    let mut l = proto::LabelPair::default();
                    l.set_name(k.to_string());
                    l.set_value(v.to_string());
                    l
                })
                .collect(),
        );
        let mut g = proto::Gauge::default();
        g.set_value(v);
        m.set_gauge(g);
        m
    };
    let family = |name: &str, help: &str, metrics: Vec<proto::Metric>| {
        let mut f = MetricFamily::default();
        f.set_name(name.to_string());
        f.set_help(help.to_string());
        f.set_field_type(MetricType::GAUGE);
        f.set_metric(metrics);
        f
    };
    let Some(gpus) = readings else {
        return vec![family(
            GPU_INFO,
            GPU_INFO_HELP,
            vec![gauge(&[("gpu", NO_GPU), ("name", "")], 1.0)],
        )];
    };
    let mut families = vec![family(
        GPU_INFO,
        GPU_INFO_HELP,
        gpus.iter()
            .map(|g| gauge(&[("gpu", &g.index.to_string()), ("name", &g.name)], 1.0))
            .collect(),
    )];
    for (name, help, value) in GPU_GAUGES {
        let metrics: Vec<proto::Metric> = gpus
            .iter()
            .filter_map(|g| value(g).map(|v| gauge(&[("gpu", &g.index.to_string())], v)))
            .collect();
        if !metrics.is_empty() {
            families.push(family(name, help, metrics));
        }
    }
    families.retain(|f| !f.get_metric().is_empty());
    families
}

/// Every metric of a worker.
#[derive(Debug, Clone)]
pub struct WorkerMetrics {
    registry: Registry,
    /// `tidegate_worker_batches_total{model}`: batches answered, by model
    /// (run, or shed and failed unrun).
    pub batches: IntCounterVec,
    /// `tidegate_worker_batch_run_seconds{model}`: each batch's run time on
    /// the backend, from its stage timers (decode, preprocess, ONNX Runtime,
    /// postprocess); its wait in the executor's queue is not in it.
    pub batch_run: HistogramVec,
    /// `tidegate_worker_answered_frames_total{model,status}`: frames
    /// answered, by the status sent to the gateway.
    pub frames: IntCounterVec,
    /// `tidegate_worker_batches_pending`: batches queued for or running on
    /// the backend, read at scrape time.
    pub pending: IntGauge,
    /// `tidegate_worker_backend_busy_seconds_total`: time the backend spent
    /// running batches, read at scrape time (its rate is the backend's
    /// utilisation).
    pub busy: prometheus::Counter,
    /// `tidegate_worker_build_info{version,device}`: 1.
    pub build_info: IntGaugeVec,
    /// The executor whose queue and busy time are read at scrape time.
    backend: Arc<OnceLock<Backend>>,
}

/// What is read of the executor at scrape time.
struct Backend {
    activity: Arc<Activity>,
    busy_us: Box<dyn Fn() -> u64 + Send + Sync>,
}

impl std::fmt::Debug for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Backend")
            .field("activity", &self.activity)
            .finish_non_exhaustive()
    }
}

impl WorkerMetrics {
    /// Creates and registers every metric: `models`' counters at 0, the
    /// build labelled with `device` (as registered, e.g. `cpu (4 threads)`),
    /// and the GPUs of `gpus` (`None`: `gpu="none"`).
    pub fn new(models: &[String], device: &str, gpus: Option<Arc<dyn GpuSource>>) -> Self {
        let m = WorkerMetrics {
            registry: Registry::new(),
            batches: IntCounterVec::new(
                Opts::new(
                    "tidegate_worker_batches_total",
                    "Batches this worker answered, by model (run, or shed and failed unrun).",
                ),
                &["model"],
            )
            .expect("valid counter"),
            batch_run: HistogramVec::new(
                HistogramOpts::new(
                    "tidegate_worker_batch_run_seconds",
                    "Run time of each batch on this worker's backend (decode, preprocess, ONNX Runtime, postprocess), by model; queue wait excluded.",
                )
                .buckets(RUN_BUCKETS.to_vec()),
                &["model"],
            )
            .expect("valid histogram"),
            frames: IntCounterVec::new(
                Opts::new(
                    "tidegate_worker_answered_frames_total",
                    "Frames this worker answered, by model and the status sent (ok, shed, expired, failed).",
                ),
                &["model", "status"],
            )
            .expect("valid counter"),
            pending: IntGauge::new(
                "tidegate_worker_batches_pending",
                "Batches queued for or running on this worker's backend.",
            )
            .expect("valid gauge"),
            busy: prometheus::Counter::new(
                "tidegate_worker_backend_busy_seconds_total",
                "Time this worker's backend spent running batches (its rate is the backend's utilisation, 0 to 1).",
            )
            .expect("valid counter"),
            build_info: IntGaugeVec::new(
                Opts::new(
                    "tidegate_worker_build_info",
                    "1, labelled with the worker's version and the device it serves on.",
                ),
                &["version", "device"],
            )
            .expect("valid gauge"),
            backend: Arc::new(OnceLock::new()),
        };
        for c in m.collectors() {
            m.registry.register(c).expect("metric names are unique");
        }
        m.registry
            .register(Box::new(GpuCollector::new(gpus)))
            .expect("GPU metric names are unique");
        #[cfg(target_os = "linux")]
        m.registry
            .register(Box::new(
                prometheus::process_collector::ProcessCollector::for_self(),
            ))
            .expect("process metrics register once");
        m.build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION"), device])
            .set(1);
        for model in models {
            m.batches.with_label_values(&[model]);
            for s in FRAME_STATUSES {
                m.frames.with_label_values(&[model, s]);
            }
        }
        m
    }

    fn collectors(&self) -> Vec<Box<dyn Collector>> {
        vec![
            Box::new(self.batches.clone()),
            Box::new(self.batch_run.clone()),
            Box::new(self.frames.clone()),
            Box::new(self.pending.clone()),
            Box::new(self.busy.clone()),
            Box::new(self.build_info.clone()),
        ]
    }

    /// Reads the backend's queue (`activity`) and busy time (`busy_us`,
    /// microseconds since it started) at each scrape from now on. Once; a
    /// second call is ignored.
    pub fn watch_backend(
        &self,
        activity: Arc<Activity>,
        busy_us: impl Fn() -> u64 + Send + Sync + 'static,
    ) {
        let _ = self.backend.set(Backend {
            activity,
            busy_us: Box::new(busy_us),
        });
    }

    /// Counts one batch of `model` as answered with `items` (as sent to the
    /// gateway); `ran` is whether the backend ran it (its run time is then
    /// observed).
    pub fn on_batch(&self, model: &str, items: &[ItemResult], ran: bool) {
        self.batches.with_label_values(&[model]).inc();
        for o in items {
            self.frames
                .with_label_values(&[model, o.status.label()])
                .inc();
        }
        if ran {
            self.batch_run
                .with_label_values(&[model])
                .observe(run_time(items).as_secs_f64());
        }
    }

    /// The name of every series this worker can export, whether or not it
    /// has a value yet: a histogram's `_bucket`, `_sum` and `_count`, every
    /// GPU gauge, and every other metric's own name. It is kept in
    /// [`SERIES_FILE`] (a test holds the two equal), where
    /// `deploy/tests/deploy.rs` checks the dashboard against it.
    pub fn series_names(&self) -> Vec<String> {
        let mut names = Vec::new();
        for c in self.collectors() {
            for family in c.collect() {
                let name = family.name().to_string();
                if family.get_field_type() == MetricType::HISTOGRAM {
                    names.extend(["_bucket", "_sum", "_count"].map(|s| format!("{name}{s}")));
                } else {
                    names.push(name);
                }
            }
        }
        names.push(GPU_INFO.to_string());
        names.extend(GPU_GAUGES.iter().map(|(n, _, _)| n.to_string()));
        // the process collector's, by its descriptions: a scrape may lack one
        #[cfg(target_os = "linux")]
        names.extend(
            prometheus::process_collector::ProcessCollector::for_self()
                .desc()
                .iter()
                .map(|d| d.fq_name.clone()),
        );
        names.sort();
        names.dedup();
        names
    }

    /// The Prometheus text exposition of every metric, the backend's
    /// figures read now.
    pub fn render(&self) -> String {
        if let Some(b) = self.backend.get() {
            self.pending.set(b.activity.pending() as i64);
            let busy = (b.busy_us)() as f64 / 1e6;
            // a counter only goes up: add what the backend ran since
            let seen = self.busy.get();
            if busy > seen {
                self.busy.inc_by(busy - seen);
            }
        }
        let mut buf = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut buf)
            .expect("text encoding cannot fail");
        String::from_utf8(buf).expect("prometheus text is UTF-8")
    }
}

/// A batch's run time on the backend, from its frames' stage timers: each
/// frame's decode, preprocessing and postprocessing, and the batch's one
/// ONNX Runtime run (shared by its frames, so counted once).
pub fn run_time(items: &[ItemResult]) -> Duration {
    let per_frame: u64 = items
        .iter()
        .map(|o| {
            let t = &o.timings;
            u64::from(t.decode_us) + u64::from(t.preprocess_us) + u64::from(t.postprocess_us)
        })
        .sum();
    let inference = items
        .iter()
        .map(|o| o.timings.inference_us)
        .max()
        .unwrap_or(0);
    Duration::from_micros(per_frame + u64::from(inference))
}

/// Serves `/metrics` on `listener` until `cancel` fires.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: WorkerMetrics,
    cancel: CancellationToken,
) -> std::io::Result<()> {
    use axum::http::header;
    use axum::response::IntoResponse;
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let m = metrics.clone();
            async move {
                (
                    [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
                    m.render(),
                )
                    .into_response()
            }
        }),
    );
    axum::serve(listener, app)
        .with_graceful_shutdown(async move { cancel.cancelled().await })
        .await
}

/// Binds the metrics listener on `addr`; the error names the setting.
pub async fn bind(addr: SocketAddr) -> Result<tokio::net::TcpListener, std::io::Error> {
    tokio::net::TcpListener::bind(addr).await.map_err(|e| {
        std::io::Error::new(
            e.kind(),
            format!("cannot listen for metrics on {addr} (metrics.listen, --metrics-listen): {e}"),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tidegate_protocol::{ShedReason, Status, Timings};

    #[derive(Debug)]
    struct Fixed(Result<Vec<GpuReading>, String>);

    impl GpuSource for Fixed {
        fn read(&self) -> Result<Vec<GpuReading>, String> {
            self.0.clone()
        }
    }

    fn h200(index: u32) -> GpuReading {
        GpuReading {
            index,
            name: "NVIDIA H200".into(),
            utilization: Some(0.37),
            memory_used_bytes: Some(3 << 30),
            memory_total_bytes: Some(141 << 30),
            power_watts: Some(212.5),
            temperature_celsius: Some(41.0),
        }
    }

    fn metrics_with(gpus: Option<Arc<dyn GpuSource>>) -> WorkerMetrics {
        WorkerMetrics::new(&["blazeface".to_string()], "cuda:0", gpus)
    }

    #[test]
    fn a_worker_without_nvml_exports_gpu_none_and_no_per_gpu_gauge() {
        let text = metrics_with(None).render();
        assert!(
            text.contains("tidegate_worker_gpu_info{gpu=\"none\",name=\"\"} 1"),
            "{text}"
        );
        for (name, _, _) in GPU_GAUGES {
            assert!(!text.contains(name), "{name} in:\n{text}");
        }
    }

    #[test]
    fn each_gpu_reading_becomes_its_gauges_in_base_units() {
        let mut no_power = h200(1);
        no_power.power_watts = None;
        let source = Fixed(Ok(vec![h200(0), no_power]));
        let text = metrics_with(Some(Arc::new(source))).render();
        for line in [
            "tidegate_worker_gpu_info{gpu=\"0\",name=\"NVIDIA H200\"} 1",
            "tidegate_worker_gpu_info{gpu=\"1\",name=\"NVIDIA H200\"} 1",
            "tidegate_worker_gpu_utilization_ratio{gpu=\"0\"} 0.37",
            "tidegate_worker_gpu_memory_used_bytes{gpu=\"1\"} 3221225472",
            "tidegate_worker_gpu_memory_total_bytes{gpu=\"0\"} 151397597184",
            "tidegate_worker_gpu_power_watts{gpu=\"0\"} 212.5",
            "tidegate_worker_gpu_temperature_celsius{gpu=\"1\"} 41",
        ] {
            assert!(text.contains(line), "{line} not in:\n{text}");
        }
        // a field the driver does not report is left out, not exported as 0
        assert!(!text.contains("tidegate_worker_gpu_power_watts{gpu=\"1\"}"));
        assert!(!text.contains("{gpu=\"none\""));
    }

    #[test]
    fn a_failed_gpu_read_leaves_the_gpus_out_of_that_scrape_only() {
        let m = metrics_with(Some(Arc::new(Fixed(Err("GPU lost".into())))));
        let text = m.render();
        assert!(!text.contains("tidegate_worker_gpu_"), "{text}");
        assert!(text.contains("tidegate_worker_batches_total{model=\"blazeface\"} 0"));
    }

    fn outcome(status: Status, timings: Timings) -> ItemResult {
        ItemResult {
            id: 0,
            status,
            detections: Vec::new(),
            timings,
            outputs: Vec::new(),
        }
    }

    #[test]
    fn run_time_adds_each_frames_stages_and_the_shared_run_once() {
        let t = |decode_us, preprocess_us, postprocess_us| Timings {
            queue_us: 999,
            decode_us,
            preprocess_us,
            inference_us: 5000,
            postprocess_us,
        };
        let outcomes = [
            outcome(Status::Ok, t(100, 200, 30)),
            outcome(Status::Ok, t(0, 200, 40)),
        ];
        assert_eq!(
            run_time(&outcomes),
            Duration::from_micros(100 + 200 + 30 + 200 + 40 + 5000)
        );
        assert_eq!(run_time(&[]), Duration::ZERO);
    }

    #[test]
    fn batches_and_frames_are_counted_by_model_and_status_exactly() {
        let m = metrics_with(None);
        let ran = [
            outcome(Status::Ok, Timings::default()),
            outcome(Status::Failed("bad".into()), Timings::default()),
        ];
        m.on_batch("blazeface", &ran, true);
        let shed = vec![outcome(Status::Shed(ShedReason::Overloaded), Timings::default()); 3];
        m.on_batch("blazeface", &shed, false);
        let text = m.render();
        for line in [
            "tidegate_worker_batches_total{model=\"blazeface\"} 2",
            "tidegate_worker_answered_frames_total{model=\"blazeface\",status=\"ok\"} 1",
            "tidegate_worker_answered_frames_total{model=\"blazeface\",status=\"failed\"} 1",
            "tidegate_worker_answered_frames_total{model=\"blazeface\",status=\"shed\"} 3",
            "tidegate_worker_answered_frames_total{model=\"blazeface\",status=\"expired\"} 0",
            // only the batch the backend ran has a run time
            "tidegate_worker_batch_run_seconds_count{model=\"blazeface\"} 1",
            "tidegate_worker_build_info{device=\"cuda:0\",version=\"",
        ] {
            assert!(text.contains(line), "{line} not in:\n{text}");
        }
    }

    #[test]
    fn the_backends_queue_and_busy_time_are_read_at_each_scrape() {
        let m = metrics_with(None);
        let busy = Arc::new(std::sync::atomic::AtomicU64::new(1_500_000));
        let read = busy.clone();
        m.watch_backend(Arc::new(Activity::default()), move || {
            read.load(std::sync::atomic::Ordering::Relaxed)
        });
        assert!(
            m.render()
                .contains("tidegate_worker_backend_busy_seconds_total 1.5")
        );
        busy.store(2_000_000, std::sync::atomic::Ordering::Relaxed);
        let text = m.render();
        assert!(
            text.contains("tidegate_worker_backend_busy_seconds_total 2\n"),
            "{text}"
        );
        assert!(text.contains("tidegate_worker_batches_pending 0"), "{text}");
    }

    /// The list the dashboard is checked against is this worker's.
    #[test]
    fn the_series_file_lists_exactly_what_a_worker_exports() {
        let names = metrics_with(None).series_names();
        assert!(names.iter().any(|n| n == "tidegate_worker_gpu_power_watts"));
        assert!(
            names
                .iter()
                .any(|n| n == "tidegate_worker_batch_run_seconds_bucket")
        );
        assert!(names.iter().any(|n| n.starts_with("process_")), "{names:?}");
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(SERIES_FILE);
        let want = names.join("\n") + "\n";
        let have = std::fs::read_to_string(&path).unwrap_or_default();
        assert_eq!(
            have,
            want,
            "{} is out of date; write the list above into it",
            path.display()
        );
    }
}
