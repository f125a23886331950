//! Prometheus metrics of the gateway, registered in one place. Histogram
//! buckets are sized for an 80 ms end-to-end budget.

use prometheus::{
    CounterVec, Encoder, Gauge, GaugeVec, HistogramOpts, HistogramVec, IntCounter, IntCounterVec,
    IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};

/// Latency buckets (seconds): fine below the 80 ms budget, coarse above.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.002, 0.005, 0.010, 0.015, 0.020, 0.030, 0.040, 0.050, 0.060, 0.070, 0.080, 0.100,
    0.150, 0.250, 0.500, 1.0,
];

/// Batch-size buckets.
pub const BATCH_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0];

/// Buckets of a batch's run time over what its worker's profile says it
/// takes: 1 is as profiled, 4 is four times slower.
pub const RATIO_BUCKETS: &[f64] = &[0.5, 0.8, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 10.0];

/// Most distinct worker names labelled at once; the workers past it share
/// the label [`OTHER_WORKERS`], so a fleet of thousands (or a worker that
/// reconnects under new names) cannot blow up the series count.
pub const MAX_WORKER_LABELS: usize = 64;

/// The `worker` label of the workers past [`MAX_WORKER_LABELS`].
pub const OTHER_WORKERS: &str = "other";

/// Every gateway metric.
#[derive(Debug, Clone)]
pub struct Metrics {
    registry: Registry,
    /// `tidegate_frames_total{model,status}`: frames by final status.
    pub frames: IntCounterVec,
    /// `tidegate_e2e_latency_seconds{model}`: edge-reported capture-to-result.
    pub e2e_latency: HistogramVec,
    /// `tidegate_queue_wait_seconds{model}`: time queued in the gateway.
    pub queue_wait: HistogramVec,
    /// `tidegate_frame_age_on_arrival_seconds{model}`: capture to arrival
    /// at the gateway (the edge's send path and the link), from the edge's
    /// clock offset: the transfer share of a frame's time, where
    /// `tidegate_queue_wait_seconds` is the workers' share.
    pub arrival_age: HistogramVec,
    /// `tidegate_batch_size{model}`: frames per dispatched batch.
    pub batch_size: HistogramVec,
    /// `tidegate_inference_seconds{model}`: worker-reported inference time per batch.
    pub inference: HistogramVec,
    /// `tidegate_workers{state}`: workers by state (idle, busy).
    pub workers: IntGaugeVec,
    /// `tidegate_edges_connected`: connected edges.
    pub edges_connected: IntGauge,
    /// `tidegate_frames_rejected_total{reason}`: frames refused before admission.
    pub rejected: IntCounterVec,
    /// `tidegate_control_messages_dropped_total{kind}`: edge control
    /// messages over their connection's rate, dropped before the hub
    /// (`latency_report`, `clock_echo`; `camera_open` ones are refused).
    pub control_dropped: IntCounterVec,
    /// `tidegate_quic_connections_refused_total{reason}`: QUIC connections
    /// refused: `unauthenticated` (at accept, `limits.max_unauthenticated`
    /// connections not logged in yet), `shut_out` (at accept, dropped
    /// unanswered: its address's logins refused too often,
    /// `limits.refused_logins_per_address`), `credentials` (at login, an
    /// unknown name or a wrong token), `edge_connections` (at login,
    /// `limits.max_connections_per_edge` of its name open) or
    /// `flood_cooldown` (at login, its name closed as a control flood
    /// moments ago: `limits.control_flood_cooldown_ms`).
    pub quic_refused: IntCounterVec,
    /// `tidegate_http_connections_refused_total`: HTTP connections closed
    /// as they were accepted, the API's connection cap being reached.
    pub http_refused: IntCounter,
    /// `tidegate_thumbnails_total{result}`: camera thumbnails drawn for
    /// the status page (`[status] thumbnails`): `rendered`, or `refused`
    /// when the frame was no picture or could not be encoded.
    pub thumbnails: IntCounterVec,
    /// `tidegate_results_undeliverable_total`: results whose edge had gone
    /// (before or while they were written), or had stopped taking them (its
    /// queue full).
    pub undeliverable: IntCounter,
    /// `tidegate_frames_dropped_total{reason}`: admitted frames dropped
    /// unserved because nobody would get their result: `edge_gone` (their
    /// edge's connection closed while they were queued, or before they
    /// arrived).
    pub frames_dropped: IntCounterVec,
    /// `tidegate_frames_retried_total`: frames a worker failed (or left
    /// unanswered in its result) that went to another worker instead of
    /// failing; once a frame.
    pub frames_retried: IntCounter,
    /// `tidegate_estimate_trials_total`: frames no worker's estimate could
    /// finish in time, sent alone to an idle worker as a trial of its
    /// estimate (the scheduler's `trial.rs`).
    pub estimate_trials: IntCounter,
    /// `tidegate_workers_stalled_total`: workers dropped because a batch
    /// went unanswered long past when it was due.
    pub workers_stalled: IntCounter,
    /// `tidegate_worker_demotions_total{model,reason}`: serving workers
    /// taken out of dispatch for failing their frames (`short_result`,
    /// `malformed_result`, `failure_ratio`); a failed probe is not counted
    /// again.
    pub worker_demotions: IntCounterVec,
    /// `tidegate_workers_demoted`: workers demoted now (backing off, or
    /// being probed).
    pub workers_demoted: IntGauge,
    /// `tidegate_hints_total{direction}`: frame-rate hints sent to cameras,
    /// `set` (a cap, lowered or raised) or `lift`.
    pub hints: IntCounterVec,
    /// `tidegate_leases{type,tier,state}`: leases known to this gateway.
    pub leases: IntGaugeVec,
    /// `tidegate_cost_total{tier,currency}`: cost charged in the ledger, in
    /// units of the catalog's currency (named by the label).
    pub cost_total: CounterVec,
    /// `tidegate_leased_busy_seconds_total`: time leased workers spent
    /// running batches. Over `tidegate_leased_paid_seconds_total`, as
    /// rates over a window, the utilisation of what is paid for.
    pub leased_busy: prometheus::Counter,
    /// `tidegate_leased_paid_seconds_total`: time leases were billed
    /// (from their billing start), summed over leases.
    pub leased_paid: prometheus::Counter,
    /// `tidegate_lease_frames_total{result}`: frames leased workers
    /// answered `ok` within their deadline (`within_slo`) or not (`late`):
    /// with `tidegate_cost_total`, the cost per frame over any window.
    pub lease_frames: IntCounterVec,
    /// `tidegate_cost_per_1k_frames_within_slo`: ledger cost per 1000
    /// frames answered ok within their deadline.
    pub cost_per_1k_within_slo: Gauge,
    /// `tidegate_gpu_utilization_ratio`: busy over leased GPU time since
    /// the gateway started (alerts and dashboards use the rates of
    /// `tidegate_leased_busy_seconds_total` and
    /// `tidegate_leased_paid_seconds_total` over a window instead).
    pub gpu_utilization: Gauge,
    /// `tidegate_lease_acquires_total{tier,result}`: leases asked of the
    /// provider, by result: `ok`, `no_capacity` (refused for capacity or
    /// quota, e.g. no spot to be had) or `error` (the provider failed).
    pub lease_acquires: IntCounterVec,
    /// `tidegate_lease_ends_total{tier,reason}`: leases ended, by reason
    /// (`released`, `preempted`, `lost`, `failed`).
    pub lease_ends: IntCounterVec,
    /// `tidegate_lease_release_failures_total`: provider releases that
    /// failed; the lease stays draining (it may still bill) and is retried.
    pub lease_release_failures: IntCounter,
    /// `tidegate_spend_cap_per_hour`: the configured hourly spend cap (no
    /// labels; absent without a cap), for spend alerts.
    pub spend_cap: GaugeVec,
    /// `tidegate_config_reloads_total{result}`: configuration reloads, `ok`
    /// or `error` (the file was unusable and nothing changed).
    pub config_reloads: IntCounterVec,
    /// `tidegate_config_last_reload_successful`: 1 until a reload fails,
    /// then 0 until one succeeds (the gateway runs on the previous
    /// credentials meanwhile).
    pub config_last_reload_ok: IntGauge,
    /// `tidegate_connections_revoked_total{role}`: connections closed
    /// because a reload took their credentials away.
    pub revoked: IntCounterVec,
    /// `tidegate_worker_busy_seconds_total{edge,model}`: worker time spent
    /// on each edge's frames (each batch's run time split evenly among its
    /// frames): who uses the GPUs, the basis of the cost split by edge.
    pub worker_busy: CounterVec,
    /// `tidegate_build_info{version}`: 1, labelled with the gateway's
    /// version, to join on and to see which version runs where.
    pub build_info: IntGaugeVec,
    /// `tidegate_queue_depth{model}`: frames queued in the gateway, not
    /// yet dispatched: the saturation signal (it grows before frames are
    /// shed).
    pub queue_depth: IntGaugeVec,
    /// `tidegate_worker_batch_seconds{worker,model}`: each batch's run
    /// time on the worker of that name (see [`WorkerLabels`]) as the
    /// gateway sees it: from its dispatch (or the end of the batch before
    /// it) to its result, transfer included, as the scheduler measures it.
    pub worker_batch: HistogramVec,
    /// `tidegate_worker_batch_over_profile{worker,model}`: the worker's own
    /// time on each batch (its frames' pre- and postprocessing and the
    /// inference run, as it reports them) over what its registered profile,
    /// which times the same work, says a batch of that size takes: the
    /// worker that is slower than it said.
    pub worker_batch_over_profile: HistogramVec,
    /// `tidegate_worker_frames_total{worker,status}`: frames each worker
    /// answered, by the status it answered.
    pub worker_frames: IntCounterVec,
}

/// The `worker` label of each connected worker: its name while fewer than
/// [`MAX_WORKER_LABELS`] names are labelled, else [`OTHER_WORKERS`].
/// Connections of one name share its label; a label's series are removed
/// when its last connection goes ([`WorkerLabels::release`]), so the
/// series count follows the fleet, not its history.
#[derive(Debug, Default)]
pub struct WorkerLabels {
    /// Label to the connections holding it.
    held: std::collections::HashMap<String, usize>,
}

impl WorkerLabels {
    /// The label of a connection of worker `name`, held until released.
    pub fn acquire(&mut self, name: &str) -> String {
        let named = self.held.len() - usize::from(self.held.contains_key(OTHER_WORKERS));
        let label = if self.held.contains_key(name) || named < MAX_WORKER_LABELS {
            name
        } else {
            OTHER_WORKERS
        };
        *self.held.entry(label.to_string()).or_insert(0) += 1;
        label.to_string()
    }

    /// A connection holding `label` went; the label once no connection
    /// holds it any more (its series are to be removed).
    pub fn release(&mut self, label: &str) -> Option<String> {
        let n = self.held.get_mut(label)?;
        *n -= 1;
        if *n > 0 {
            return None;
        }
        self.held.remove(label);
        Some(label.to_string())
    }

    /// Labels held now.
    pub fn len(&self) -> usize {
        self.held.len()
    }

    /// No label is held.
    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }
}

/// Every value each fixed label takes, exported at 0 from the start: a
/// counter that appears only at its first event hides that event from
/// `increase()`, and an alert on it needs one more.
pub mod known {
    /// `tidegate_frames_total{status}` (with each model, as it becomes
    /// known: [`super::Metrics::model_known`]), and
    /// `tidegate_worker_frames_total{status}` (with each worker label).
    pub const FRAME_STATUSES: [&str; 4] = ["ok", "shed", "expired", "failed"];
    /// `tidegate_frames_rejected_total{reason}`.
    pub const REJECTED: [&str; 8] = [
        "malformed",
        "camera_not_open",
        "duplicate",
        "read_timeout",
        "too_large",
        "memory_budget",
        "reset",
        "connection_lost",
    ];
    /// `tidegate_control_messages_dropped_total{kind}`.
    pub const CONTROL_KINDS: [&str; 4] = ["camera_open", "latency_report", "clock_echo", "other"];
    /// `tidegate_quic_connections_refused_total{reason}`.
    pub const QUIC_REFUSED: [&str; 5] = [
        "unauthenticated",
        "credentials",
        "edge_connections",
        "flood_cooldown",
        "shut_out",
    ];
    /// `tidegate_frames_dropped_total{reason}`.
    pub const FRAMES_DROPPED: [&str; 1] = ["edge_gone"];
    /// `tidegate_worker_demotions_total{reason}` (with each model).
    pub const DEMOTIONS: [&str; 3] = ["short_result", "malformed_result", "failure_ratio"];
    /// `tidegate_hints_total{direction}`.
    pub const HINTS: [&str; 2] = ["set", "lift"];
    /// `tidegate_lease_frames_total{result}`.
    pub const LEASE_FRAMES: [&str; 2] = ["within_slo", "late"];
    /// `tidegate_lease_acquires_total{result}` (with each tier).
    pub const ACQUIRE_RESULTS: [&str; 3] = ["ok", "no_capacity", "error"];
    /// `tidegate_config_reloads_total{result}`.
    pub const RELOADS: [&str; 2] = ["ok", "error"];
    /// `tidegate_thumbnails_total{result}`.
    pub const THUMBNAILS: [&str; 2] = ["rendered", "refused"];
    /// `tidegate_connections_revoked_total{role}`.
    pub const ROLES: [&str; 2] = ["edge", "worker"];
}

/// A metric's name and help text.
#[derive(Debug, Clone, Copy)]
pub struct Def {
    /// Its name, as Prometheus sees it.
    pub name: &'static str,
    /// Its help text (`# HELP`).
    pub help: &'static str,
}

/// Every gateway metric's name and help, one constant per [`Metrics`]
/// field (the field's name in capitals; the field documents it).
#[allow(missing_docs)]
pub mod defs {
    use super::Def;
    use tidegate_lease::metrics::names;

    pub const FRAMES: Def = Def {
        name: "tidegate_frames_total",
        help: "Admitted frames by final status.",
    };
    pub const E2E_LATENCY: Def = Def {
        name: "tidegate_e2e_latency_seconds",
        help: "Capture-to-result latency measured by edges on their own clock.",
    };
    pub const QUEUE_WAIT: Def = Def {
        name: "tidegate_queue_wait_seconds",
        help: "Time frames waited in the gateway's queue.",
    };
    pub const ARRIVAL_AGE: Def = Def {
        name: "tidegate_frame_age_on_arrival_seconds",
        help: "Capture to arrival at the gateway (edge send path and link), from the edge's clock offset.",
    };
    pub const BATCH_SIZE: Def = Def {
        name: "tidegate_batch_size",
        help: "Frames per dispatched batch.",
    };
    pub const INFERENCE: Def = Def {
        name: "tidegate_inference_seconds",
        help: "Inference time per batch, reported by workers.",
    };
    pub const WORKERS: Def = Def {
        name: "tidegate_workers",
        help: "Registered workers by state.",
    };
    pub const EDGES_CONNECTED: Def = Def {
        name: "tidegate_edges_connected",
        help: "Connected edges.",
    };
    pub const REJECTED: Def = Def {
        name: "tidegate_frames_rejected_total",
        help: "Frames refused before admission (malformed, unknown camera).",
    };
    pub const CONTROL_DROPPED: Def = Def {
        name: "tidegate_control_messages_dropped_total",
        help: "Edge control messages over their connection's rate, dropped before reaching the hub, by kind (latency_report, clock_echo, camera_open).",
    };
    pub const QUIC_REFUSED: Def = Def {
        name: "tidegate_quic_connections_refused_total",
        help: "QUIC connections refused, by reason: unauthenticated (too many not logged in at once), credentials (an unknown name or a wrong token at login), edge_connections (its edge name has its most connections open), flood_cooldown (its edge name was closed as a control flood moments ago).",
    };
    pub const HTTP_REFUSED: Def = Def {
        name: "tidegate_http_connections_refused_total",
        help: "HTTP API connections closed as they were accepted because [http] max_connections were open.",
    };
    pub const THUMBNAILS: Def = Def {
        name: "tidegate_thumbnails_total",
        help: "Camera thumbnails drawn for the status page, by result: rendered, or refused (the frame was no picture, or did not encode).",
    };
    pub const FRAMES_RETRIED: Def = Def {
        name: "tidegate_frames_retried_total",
        help: "Frames a worker failed that were sent to another worker instead of failing (at most once a frame, while their deadline allowed).",
    };
    pub const ESTIMATE_TRIALS: Def = Def {
        name: "tidegate_estimate_trials_total",
        help: "Frames that no worker's latency estimate could finish before their deadline, sent alone to an idle worker anyway as a trial of its estimate (at most one a second per worker and model): how a worker faster than the profile it registered is found out.",
    };
    pub const WORKERS_STALLED: Def = Def {
        name: "tidegate_workers_stalled_total",
        help: "Workers dropped because a batch went unanswered long past when it was due (a hung GPU or runtime).",
    };
    pub const WORKER_DEMOTIONS: Def = Def {
        name: "tidegate_worker_demotions_total",
        help: "Workers taken out of dispatch for failing their frames, by model and reason (short_result, malformed_result, failure_ratio).",
    };
    pub const WORKERS_DEMOTED: Def = Def {
        name: "tidegate_workers_demoted",
        help: "Workers demoted now for failing their frames: they get only probe batches until one succeeds.",
    };
    pub const UNDELIVERABLE: Def = Def {
        name: "tidegate_results_undeliverable_total",
        help: "Results that could not be sent: their edge had disconnected (before or while its result was written), or stopped taking results until its queue was full.",
    };
    pub const FRAMES_DROPPED: Def = Def {
        name: "tidegate_frames_dropped_total",
        help: "Admitted frames dropped unserved because nobody would get their result, by reason: edge_gone (their edge's connection closed while they were queued).",
    };
    pub const HINTS: Def = Def {
        name: "tidegate_hints_total",
        help: "Frame-rate hints sent to cameras whose frames were shed, by direction.",
    };
    pub const LEASES: Def = Def {
        name: names::LEASES,
        help: "Leases by instance type, tier and state.",
    };
    pub const COST_TOTAL: Def = Def {
        name: names::COST_TOTAL,
        help: "Lease cost charged in the ledger, by tier, in the catalog currency (the currency label).",
    };
    pub const COST_PER_1K_WITHIN_SLO: Def = Def {
        name: names::COST_PER_1K_WITHIN_SLO,
        help: "Lease cost per 1000 frames served within their deadline.",
    };
    pub const GPU_UTILIZATION: Def = Def {
        name: names::GPU_UTILIZATION,
        help: "Time leased workers spent running batches over the time they were leased.",
    };
    pub const LEASE_ACQUIRES: Def = Def {
        name: "tidegate_lease_acquires_total",
        help: "Leases asked of the provider, by tier and result (ok, no_capacity, error).",
    };
    pub const LEASE_ENDS: Def = Def {
        name: "tidegate_lease_ends_total",
        help: "Leases ended, by tier and reason (released, preempted, lost, failed).",
    };
    pub const LEASE_RELEASE_FAILURES: Def = Def {
        name: "tidegate_lease_release_failures_total",
        help: "Provider releases that failed; the lease stays draining, may still bill, and is retried.",
    };
    pub const SPEND_CAP: Def = Def {
        name: "tidegate_spend_cap_per_hour",
        help: "The configured cap on what live leases may cost per hour, in the catalog currency.",
    };
    pub const CONFIG_RELOADS: Def = Def {
        name: "tidegate_config_reloads_total",
        help: "Configuration reloads (SIGHUP or POST /api/v1/reload) by result.",
    };
    pub const CONFIG_LAST_RELOAD_OK: Def = Def {
        name: "tidegate_config_last_reload_successful",
        help: "Whether the last configuration reload succeeded (1) or was refused (0).",
    };
    pub const REVOKED: Def = Def {
        name: "tidegate_connections_revoked_total",
        help: "Connections closed because a reload took their credentials away, by role.",
    };
    pub const WORKER_BUSY: Def = Def {
        name: "tidegate_worker_busy_seconds_total",
        help: "Worker time spent on each edge's frames: each batch's run time split evenly among its frames.",
    };
    pub const LEASED_BUSY: Def = Def {
        name: "tidegate_leased_busy_seconds_total",
        help: "Time leased workers spent running batches.",
    };
    pub const LEASED_PAID: Def = Def {
        name: "tidegate_leased_paid_seconds_total",
        help: "Time leases were billed, summed over leases.",
    };
    pub const LEASE_FRAMES: Def = Def {
        name: "tidegate_lease_frames_total",
        help: "Frames leased workers answered ok within their deadline (within_slo) or not (late).",
    };
    pub const BUILD_INFO: Def = Def {
        name: "tidegate_build_info",
        help: "1, labelled with the version of the tidegate gateway running.",
    };
    pub const QUEUE_DEPTH: Def = Def {
        name: "tidegate_queue_depth",
        help: "Frames queued in the gateway and not yet dispatched, by model.",
    };
    pub const WORKER_BATCH: Def = Def {
        name: "tidegate_worker_batch_seconds",
        help: "Run time of each batch as the gateway sees it (dispatch to result, transfer included), by worker name (at most 64 names; the rest are worker=\"other\") and model.",
    };
    pub const WORKER_BATCH_OVER_PROFILE: Def = Def {
        name: "tidegate_worker_batch_over_profile",
        help: "The worker's own time on each batch (pre- and postprocessing and inference, as it reports them) over what its registered profile says a batch of its size takes, by worker and model.",
    };
    pub const WORKER_FRAMES: Def = Def {
        name: "tidegate_worker_frames_total",
        help: "Frames each worker answered, by worker name and the status it answered (ok, shed, expired, failed).",
    };
}

// Constructors of one metric each: the names and help texts are fixed in
// this file, so a failure is a bug here, not an input error.

fn int_counters(d: Def, labels: &[&str]) -> IntCounterVec {
    IntCounterVec::new(Opts::new(d.name, d.help), labels).expect("valid counter")
}

fn int_gauges(d: Def, labels: &[&str]) -> IntGaugeVec {
    IntGaugeVec::new(Opts::new(d.name, d.help), labels).expect("valid gauge")
}

fn counters(d: Def, labels: &[&str]) -> CounterVec {
    CounterVec::new(Opts::new(d.name, d.help), labels).expect("valid counter")
}

fn gauges(d: Def, labels: &[&str]) -> GaugeVec {
    GaugeVec::new(Opts::new(d.name, d.help), labels).expect("valid gauge")
}

fn int_counter(d: Def) -> IntCounter {
    IntCounter::new(d.name, d.help).expect("valid counter")
}

fn int_gauge(d: Def) -> IntGauge {
    IntGauge::new(d.name, d.help).expect("valid gauge")
}

fn counter(d: Def) -> prometheus::Counter {
    prometheus::Counter::new(d.name, d.help).expect("valid counter")
}

fn gauge(d: Def) -> Gauge {
    Gauge::new(d.name, d.help).expect("valid gauge")
}

fn histograms(d: Def, buckets: &[f64], labels: &[&str]) -> HistogramVec {
    HistogramVec::new(
        HistogramOpts::new(d.name, d.help).buckets(buckets.to_vec()),
        labels,
    )
    .expect("valid histogram")
}

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Self {
        let registry = Registry::new();
        let m = Metrics {
            frames: int_counters(defs::FRAMES, &["model", "status"]),
            e2e_latency: histograms(defs::E2E_LATENCY, LATENCY_BUCKETS, &["model"]),
            queue_wait: histograms(defs::QUEUE_WAIT, LATENCY_BUCKETS, &["model"]),
            arrival_age: histograms(defs::ARRIVAL_AGE, LATENCY_BUCKETS, &["model"]),
            batch_size: histograms(defs::BATCH_SIZE, BATCH_BUCKETS, &["model"]),
            inference: histograms(defs::INFERENCE, LATENCY_BUCKETS, &["model"]),
            workers: int_gauges(defs::WORKERS, &["state"]),
            edges_connected: int_gauge(defs::EDGES_CONNECTED),
            rejected: int_counters(defs::REJECTED, &["reason"]),
            control_dropped: int_counters(defs::CONTROL_DROPPED, &["kind"]),
            quic_refused: int_counters(defs::QUIC_REFUSED, &["reason"]),
            http_refused: int_counter(defs::HTTP_REFUSED),
            thumbnails: int_counters(defs::THUMBNAILS, &["result"]),
            frames_retried: int_counter(defs::FRAMES_RETRIED),
            estimate_trials: int_counter(defs::ESTIMATE_TRIALS),
            workers_stalled: int_counter(defs::WORKERS_STALLED),
            worker_demotions: int_counters(defs::WORKER_DEMOTIONS, &["model", "reason"]),
            workers_demoted: int_gauge(defs::WORKERS_DEMOTED),
            undeliverable: int_counter(defs::UNDELIVERABLE),
            frames_dropped: int_counters(defs::FRAMES_DROPPED, &["reason"]),
            hints: int_counters(defs::HINTS, &["direction"]),
            leases: int_gauges(defs::LEASES, &["type", "tier", "state"]),
            cost_total: counters(defs::COST_TOTAL, &["tier", "currency"]),
            cost_per_1k_within_slo: gauge(defs::COST_PER_1K_WITHIN_SLO),
            gpu_utilization: gauge(defs::GPU_UTILIZATION),
            lease_acquires: int_counters(defs::LEASE_ACQUIRES, &["tier", "result"]),
            lease_ends: int_counters(defs::LEASE_ENDS, &["tier", "reason"]),
            lease_release_failures: int_counter(defs::LEASE_RELEASE_FAILURES),
            spend_cap: gauges(defs::SPEND_CAP, &[]),
            config_reloads: int_counters(defs::CONFIG_RELOADS, &["result"]),
            config_last_reload_ok: int_gauge(defs::CONFIG_LAST_RELOAD_OK),
            revoked: int_counters(defs::REVOKED, &["role"]),
            worker_busy: counters(defs::WORKER_BUSY, &["edge", "model"]),
            leased_busy: counter(defs::LEASED_BUSY),
            leased_paid: counter(defs::LEASED_PAID),
            lease_frames: int_counters(defs::LEASE_FRAMES, &["result"]),
            build_info: int_gauges(defs::BUILD_INFO, &["version"]),
            queue_depth: int_gauges(defs::QUEUE_DEPTH, &["model"]),
            worker_batch: histograms(defs::WORKER_BATCH, LATENCY_BUCKETS, &["worker", "model"]),
            worker_batch_over_profile: histograms(
                defs::WORKER_BATCH_OVER_PROFILE,
                RATIO_BUCKETS,
                &["worker", "model"],
            ),
            worker_frames: int_counters(defs::WORKER_FRAMES, &["worker", "status"]),
            registry,
        };
        for c in m.collectors() {
            m.registry.register(c).expect("metric names are unique");
        }
        // exported from the start, so that "no worker" is a 0 an alert can
        // see rather than a missing series
        for state in ["idle", "busy"] {
            m.workers.with_label_values(&[state]).set(0);
        }
        m.config_last_reload_ok.set(1);
        m.build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION")])
            .set(1);
        m.known_labels_at_zero();
        // The process's CPU, memory, file descriptors and start time
        // (`process_*`), read from /proc at each scrape.
        #[cfg(target_os = "linux")]
        m.registry
            .register(Box::new(
                prometheus::process_collector::ProcessCollector::for_self(),
            ))
            .expect("process metrics register once");
        m
    }

    /// Exports every counter of a fixed label set at 0 ([`known`]).
    fn known_labels_at_zero(&self) {
        for r in known::REJECTED {
            self.rejected.with_label_values(&[r]);
        }
        for k in known::CONTROL_KINDS {
            self.control_dropped.with_label_values(&[k]);
        }
        for r in known::QUIC_REFUSED {
            self.quic_refused.with_label_values(&[r]);
        }
        for r in known::FRAMES_DROPPED {
            self.frames_dropped.with_label_values(&[r]);
        }
        for d in known::HINTS {
            self.hints.with_label_values(&[d]);
        }
        for r in known::RELOADS {
            self.config_reloads.with_label_values(&[r]);
        }
        for r in known::THUMBNAILS {
            self.thumbnails.with_label_values(&[r]);
        }
        for r in known::ROLES {
            self.revoked.with_label_values(&[r]);
        }
        for r in known::LEASE_FRAMES {
            self.lease_frames.with_label_values(&[r]);
        }
        for tier in tidegate_lease::catalog::Tier::ALL {
            for r in known::ACQUIRE_RESULTS {
                self.lease_acquires.with_label_values(&[tier.as_str(), r]);
            }
            for r in tidegate_lease::lifecycle::EndReason::ALL {
                self.lease_ends
                    .with_label_values(&[tier.as_str(), r.as_str()]);
            }
        }
    }

    /// A model became known (a worker registered serving it): its frame
    /// and demotion counters are exported at 0 from now on. Idempotent.
    pub fn model_known(&self, model: &str) {
        for s in known::FRAME_STATUSES {
            self.frames.with_label_values(&[model, s]);
        }
        self.queue_depth.with_label_values(&[model]);
        for r in known::DEMOTIONS {
            self.worker_demotions.with_label_values(&[model, r]);
        }
    }

    /// A worker label came into use ([`WorkerLabels::acquire`]): its frame
    /// counters are exported at 0 from now on.
    pub fn worker_known(&self, label: &str) {
        for s in known::FRAME_STATUSES {
            self.worker_frames.with_label_values(&[label, s]);
        }
    }

    /// No connection holds worker label `label` any more: its series go
    /// (those of `models`, the models its connections served).
    pub fn worker_gone<'a>(&self, label: &str, models: impl IntoIterator<Item = &'a str>) {
        for s in known::FRAME_STATUSES {
            let _ = self.worker_frames.remove_label_values(&[label, s]);
        }
        for m in models {
            let _ = self.worker_batch.remove_label_values(&[label, m]);
            let _ = self
                .worker_batch_over_profile
                .remove_label_values(&[label, m]);
        }
    }

    fn collectors(&self) -> Vec<Box<dyn prometheus::core::Collector>> {
        vec![
            Box::new(self.frames.clone()),
            Box::new(self.e2e_latency.clone()),
            Box::new(self.queue_wait.clone()),
            Box::new(self.arrival_age.clone()),
            Box::new(self.batch_size.clone()),
            Box::new(self.inference.clone()),
            Box::new(self.workers.clone()),
            Box::new(self.edges_connected.clone()),
            Box::new(self.rejected.clone()),
            Box::new(self.control_dropped.clone()),
            Box::new(self.quic_refused.clone()),
            Box::new(self.http_refused.clone()),
            Box::new(self.thumbnails.clone()),
            Box::new(self.undeliverable.clone()),
            Box::new(self.frames_dropped.clone()),
            Box::new(self.frames_retried.clone()),
            Box::new(self.estimate_trials.clone()),
            Box::new(self.workers_stalled.clone()),
            Box::new(self.worker_demotions.clone()),
            Box::new(self.workers_demoted.clone()),
            Box::new(self.hints.clone()),
            Box::new(self.leases.clone()),
            Box::new(self.cost_total.clone()),
            Box::new(self.cost_per_1k_within_slo.clone()),
            Box::new(self.gpu_utilization.clone()),
            Box::new(self.lease_acquires.clone()),
            Box::new(self.lease_ends.clone()),
            Box::new(self.lease_release_failures.clone()),
            Box::new(self.spend_cap.clone()),
            Box::new(self.config_reloads.clone()),
            Box::new(self.config_last_reload_ok.clone()),
            Box::new(self.revoked.clone()),
            Box::new(self.worker_busy.clone()),
            Box::new(self.build_info.clone()),
            Box::new(self.leased_busy.clone()),
            Box::new(self.leased_paid.clone()),
            Box::new(self.lease_frames.clone()),
            Box::new(self.queue_depth.clone()),
            Box::new(self.worker_batch.clone()),
            Box::new(self.worker_batch_over_profile.clone()),
            Box::new(self.worker_frames.clone()),
        ]
    }

    /// The name of every series this gateway can export, whether or not it
    /// has a value yet: a histogram's `_bucket`, `_sum` and `_count`, and
    /// every other metric's own name. Dashboards and alert rules are
    /// checked against it (`deploy/tests/deploy.rs`).
    pub fn series_names(&self) -> Vec<String> {
        let mut names = Vec::new();
        for c in self.collectors() {
            for family in c.collect() {
                let name = family.name().to_string();
                if family.get_field_type() == prometheus::proto::MetricType::HISTOGRAM {
                    names.extend(["_bucket", "_sum", "_count"].map(|s| format!("{name}{s}")));
                } else {
                    names.push(name);
                }
            }
        }
        // The process collector's, registered on its own.
        names.extend(
            self.registry
                .gather()
                .iter()
                .map(|f| f.name().to_string())
                .filter(|n| n.starts_with("process_")),
        );
        names.sort();
        names
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut buf)
            .expect("text encoding cannot fail");
        String::from_utf8(buf).expect("prometheus text is UTF-8")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::{MAX_WORKER_LABELS, Metrics, OTHER_WORKERS, WorkerLabels};

    /// Names are labels up to the bound, the rest share `other`; a label
    /// is released (its series to go) with its last connection only.
    #[test]
    fn worker_labels_are_bounded_shared_by_name_and_released_with_the_last_connection() {
        let mut l = WorkerLabels::default();
        for i in 0..MAX_WORKER_LABELS {
            assert_eq!(l.acquire(&format!("w{i}")), format!("w{i}"));
        }
        assert_eq!(l.acquire("w0"), "w0", "a second connection of a name");
        assert_eq!(l.acquire("late-1"), OTHER_WORKERS);
        assert_eq!(l.acquire("late-2"), OTHER_WORKERS);
        assert_eq!(l.len(), MAX_WORKER_LABELS + 1);
        assert_eq!(l.release("w0"), None, "one connection of w0 remains");
        assert_eq!(l.release("w0"), Some("w0".to_string()));
        assert_eq!(l.release("w0"), None, "released twice is a no-op");
        assert_eq!(l.acquire("late-3"), "late-3", "a freed name slot is reused");
        assert_eq!(l.release(OTHER_WORKERS), None);
        assert_eq!(l.release(OTHER_WORKERS), Some(OTHER_WORKERS.to_string()));
        for i in 1..MAX_WORKER_LABELS {
            l.release(&format!("w{i}"));
        }
        l.release("late-3");
        assert!(l.is_empty());
    }

    #[test]
    fn every_series_is_named_before_it_has_a_value() {
        let names = Metrics::new().series_names();
        for want in [
            "tidegate_frames_total",
            "tidegate_e2e_latency_seconds_bucket",
            "tidegate_e2e_latency_seconds_count",
            "tidegate_cost_total",
            "tidegate_gpu_utilization_ratio",
        ] {
            assert!(names.iter().any(|n| n == want), "{want} not in {names:?}");
        }
        assert!(!names.iter().any(|n| n == "tidegate_e2e_latency_seconds"));
        let process = names.iter().filter(|n| n.starts_with("process_")).count();
        assert!(process >= 5, "{names:?}");
        assert_eq!(names.len() - process, 41 + 7 * 2, "{names:?}");
    }

    #[test]
    fn counters_of_known_labels_the_version_and_the_process_are_exported_from_the_start() {
        let m = Metrics::new();
        let text = m.render();
        for line in [
            "tidegate_frames_rejected_total{reason=\"connection_lost\"} 0",
            "tidegate_quic_connections_refused_total{reason=\"unauthenticated\"} 0",
            "tidegate_config_reloads_total{result=\"ok\"} 0",
            "tidegate_lease_acquires_total{result=\"no_capacity\",tier=\"spot\"} 0",
            "tidegate_lease_ends_total{reason=\"preempted\",tier=\"spot\"} 0",
            "tidegate_hints_total{direction=\"lift\"} 0",
        ] {
            assert!(text.contains(line), "{line} not in:\n{text}");
        }
        let version = format!(
            "tidegate_build_info{{version=\"{}\"}} 1",
            env!("CARGO_PKG_VERSION")
        );
        assert!(text.contains(&version), "{text}");
        assert!(text.contains("process_resident_memory_bytes"), "{text}");
        assert!(!text.contains("model=\"blazeface\""));
        m.model_known("blazeface");
        let text = m.render();
        assert!(text.contains("tidegate_frames_total{model=\"blazeface\",status=\"shed\"} 0"));
        assert!(text.contains(
            "tidegate_worker_demotions_total{model=\"blazeface\",reason=\"failure_ratio\"} 0"
        ));
    }
}
