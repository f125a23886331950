//! A real Prometheus server (Debian's, unpacked into the cache by
//! `scripts/setup.sh`) on 127.0.0.1 scrapes, every second, a real gateway,
//! its CPU worker's `/metrics` and a real `tidegate-edge` with a `test://`
//! camera, as the jobs of docs/operations.md. It evaluates
//! `deploy/prometheus/rules.yml` and `workers_edges.yml` under a light load
//! and then under an overload, and every query of
//! `deploy/grafana/tidegate.json` is run against what it scraped.
//!
//! The rules are loaded with every duration divided by [`SCALE`] (a minute
//! becomes a second: `[5m]` is `[5s]`, `for: 2m` is `for: 2s`), so that an
//! hour of alerting plays out in a minute. What is asserted is that the
//! alerts agree with what the load generator measured, never a speed:
//! under light load no alert fires unless the load generator saw its
//! condition hold; under an overload that sheds most frames the fast SLO
//! burn fires; alerts about things that did not happen (no workers,
//! malformed frames, stalls, floods, leases) never fire.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use tidegate_loadtest::cluster::{Cluster, ClusterOptions, metric_sum, workspace_root};
use tidegate_loadtest::edge_harness::EdgeProcess;
use tidegate_loadtest::loadgen;
use tidegate_loadtest::report::Report;

/// Rule durations are divided by this: a minute of the rules is a second.
const SCALE: u64 = 60;

/// Alerts that must stay quiet whatever the load: nothing they watch
/// happens in this test.
const NEVER: &[&str] = &[
    "TidegateNoWorkers",
    "TidegateMalformedFrames",
    "TidegateWorkerStalled",
    "TidegateWorkerDemoted",
    "TidegateControlFlood",
    "TidegateHttpConnectionsRefused",
    "TidegateConfigReloadFailed",
    "TidegateSpendNearCap",
    "TidegateGpuUtilizationLow",
    "TidegateLeaseReleaseFailing",
    "TidegateLeaseAcquireErrors",
    "TidegateLeasesFailingToStart",
    "TidegateProviderNoCapacity",
    "TidegateLeasesLost",
    // workers_edges.yml: a CPU worker has no GPU to fill or heat, and an
    // edge on 127.0.0.1 loses no packets and keeps its one connection
    "TidegateWorkerGpuMemoryNearFull",
    "TidegateWorkerGpuHot",
    "TidegateEdgeUplinkLossHigh",
    "TidegateEdgeReconnecting",
    "TidegateEdgeUplinkDown",
];

/// `prometheus` from `TIDEGATE_PROMETHEUS`, else the cache's.
fn prometheus_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("TIDEGATE_PROMETHEUS").filter(|v| !v.is_empty()) {
        return PathBuf::from(p);
    }
    let p = tidegate_worker::runtime::cache_dir()
        .expect("the tidegate cache")
        .join("promtool/prometheus");
    assert!(
        p.exists(),
        "{} is missing: run scripts/setup.sh, which unpacks it from Debian's prometheus package",
        p.display()
    );
    p
}

/// `text` with every duration in a range selector or a `for:` divided by
/// [`SCALE`] (at least one second).
fn scaled(text: &str) -> String {
    let seconds = |n: u64, unit: &str| -> u64 {
        let s = match unit {
            "s" => n,
            "m" => n * 60,
            "h" => n * 3600,
            "d" => n * 86_400,
            _ => unreachable!("unit {unit}"),
        };
        (s / SCALE).max(1)
    };
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        let mut l = line.to_string();
        // `for: 10m`
        if let Some((head, d)) = l.split_once("for: ") {
            let (n, unit) = d.trim().split_at(d.trim().len() - 1);
            if let Ok(n) = n.parse::<u64>() {
                l = format!("{head}for: {}s", seconds(n, unit));
            }
        }
        // `[5m]`
        let mut rebuilt = String::new();
        let mut rest = l.as_str();
        while let Some(open) = rest.find('[') {
            let Some(close) = rest[open..].find(']') else {
                break;
            };
            let inner = &rest[open + 1..open + close];
            rebuilt.push_str(&rest[..open]);
            let (n, unit) = inner.split_at(inner.len().saturating_sub(1));
            match n.parse::<u64>() {
                Ok(n) if ["s", "m", "h", "d"].contains(&unit) => {
                    rebuilt.push_str(&format!("[{}s]", seconds(n, unit)));
                }
                _ => rebuilt.push_str(&rest[open..=open + close]),
            }
            rest = &rest[open + close + 1..];
        }
        rebuilt.push_str(rest);
        out.push_str(&rebuilt);
        out.push('\n');
    }
    out
}

/// A Prometheus server scraping its targets every second, killed on drop.
struct Prometheus {
    child: Child,
    addr: SocketAddr,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    /// Scrapes each `(job, address)` and evaluates both rule files.
    fn start(targets: &[(&str, SocketAddr)]) -> Prometheus {
        let dir = tempfile::tempdir().unwrap();
        for file in ["rules.yml", "workers_edges.yml"] {
            let rules =
                std::fs::read_to_string(workspace_root().join("deploy/prometheus").join(file))
                    .unwrap_or_else(|e| panic!("deploy/prometheus/{file}: {e}"));
            std::fs::write(dir.path().join(file), scaled(&rules)).unwrap();
        }
        let jobs: String = targets
            .iter()
            .map(|(job, addr)| {
                format!("  - job_name: {job}\n    static_configs:\n      - targets: ['{addr}']\n")
            })
            .collect();
        std::fs::write(
            dir.path().join("prometheus.yml"),
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files: [rules.yml, workers_edges.yml]\nscrape_configs:\n{jobs}"
            ),
        )
        .unwrap();
        // a free port: bound, read and let go (Prometheus binds it next)
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let log = std::fs::File::create(dir.path().join("prometheus.log")).unwrap();
        let child = Command::new(prometheus_binary())
            .current_dir(dir.path())
            .arg("--config.file=prometheus.yml")
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("prometheus starts");
        let p = Prometheus {
            child,
            addr,
            _dir: dir,
        };
        let until = Instant::now() + Duration::from_secs(60);
        while get(p.addr, "/-/ready").is_none_or(|(code, _)| code != 200) {
            assert!(Instant::now() < until, "prometheus not ready: {}", p.log());
            std::thread::sleep(Duration::from_millis(200));
        }
        p
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self._dir.path().join("prometheus.log")).unwrap_or_default()
    }

    /// The alerts by state (`firing`, `pending`).
    fn alerts(&self) -> Vec<(String, String)> {
        let (code, body) = get(self.addr, "/api/v1/alerts").expect("the alerts API answers");
        assert_eq!(code, 200, "{body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        v["data"]["alerts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| {
                (
                    a["labels"]["alertname"].as_str().unwrap().to_string(),
                    a["state"].as_str().unwrap().to_string(),
                )
            })
            .collect()
    }

    fn firing(&self) -> BTreeSet<String> {
        self.alerts()
            .into_iter()
            .filter(|(_, s)| s == "firing")
            .map(|(n, _)| n)
            .collect()
    }

    /// Whether `query` returns any series now; the error if it fails.
    fn has_data(&self, query: &str) -> Result<bool, String> {
        let path = format!("/api/v1/query?query={}", encode(query));
        let (code, body) = get(self.addr, &path).ok_or("no answer")?;
        let v: Value = serde_json::from_str(&body).map_err(|e| format!("{e}: {body}"))?;
        if code != 200 || v["status"] != "success" {
            return Err(body);
        }
        let r = &v["data"]["result"];
        Ok(match v["data"]["resultType"].as_str() {
            Some("vector") | Some("matrix") => r.as_array().is_some_and(|a| !a.is_empty()),
            _ => !r.is_null(),
        })
    }

    /// Whether the scrapes of `job` succeed.
    fn target_up(&self, job: &str) -> bool {
        self.has_data(&format!("up{{job=\"{job}\"}} == 1"))
            .unwrap_or(false)
    }

    /// Waits (bounded by [`BOUND`]) until every job's scrapes succeed.
    fn wait_until_up(&self, jobs: &[(&str, SocketAddr)]) {
        let until = Instant::now() + BOUND;
        for (job, addr) in jobs {
            while !self.target_up(job) {
                assert!(
                    Instant::now() < until,
                    "no scrape of {job} at {addr}: {}",
                    self.log()
                );
                std::thread::sleep(Duration::from_millis(500));
            }
        }
    }

    /// The `(title, query)` pairs that return no data now, as
    /// `title: query`; a query that fails fails the test.
    fn without_data<'q>(
        &self,
        queries: impl IntoIterator<Item = &'q (String, String)>,
    ) -> Vec<String> {
        let mut empty = Vec::new();
        for (title, q) in queries {
            match self.has_data(q) {
                Ok(true) => {}
                Ok(false) => empty.push(format!("{title}: {q}")),
                Err(e) => panic!("{title}: {q} failed: {e}"),
            }
        }
        empty
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Percent-encodes a query parameter.
fn encode(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// HTTP/1.0 GET: (status, body), or `None` when nothing answers.
fn get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut raw = String::new();
    s.read_to_string(&mut raw).ok()?;
    let (head, body) = raw.split_once("\r\n\r\n")?;
    let code = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((code, body.to_string()))
}

/// Runs a load on its own thread.
fn load(c: &Cluster, cameras: usize, fps: f64, seconds: f64) -> std::thread::JoinHandle<Report> {
    let mut opts = c.load_options("edge-1", cameras, fps, seconds);
    // an overload keeps overloading: the cameras ignore the rate hints
    opts.obey_hints = false;
    opts.in_step = false;
    std::thread::spawn(move || loadgen::run_blocking(&opts).expect("the load runs"))
}

/// The worker's batches over twice their profile, and all its batches, as
/// the gateway's own `/metrics` counts them (not through Prometheus).
fn batches_over_twice_their_profile(gateway: SocketAddr) -> (u64, u64) {
    let (code, body) = get(gateway, "/metrics").expect("the gateway serves /metrics");
    assert_eq!(code, 200, "{body}");
    let within = metric_sum(
        &body,
        "tidegate_worker_batch_over_profile_bucket",
        &["le=\"2\""],
    ) as u64;
    let all = metric_sum(&body, "tidegate_worker_batch_over_profile_count", &[]) as u64;
    (all - within, all)
}

/// Not ok over frames due, as the load generator saw them.
fn not_ok_share(r: &Report) -> f64 {
    1.0 - r.slo_attainment
}

/// The dashboard's queries, with Grafana's variables filled in.
fn dashboard_queries(root: &Path) -> Vec<(String, String)> {
    let d: Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("deploy/grafana/tidegate.json")).unwrap(),
    )
    .unwrap();
    let mut out = Vec::new();
    for p in d["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().into_iter().flatten() {
            if let Some(expr) = t["expr"].as_str() {
                let q = expr
                    .replace("$__rate_interval", "15s")
                    .replace("$__range", "120s")
                    .replace("$__interval", "5s")
                    .replace("$model", ".*");
                out.push((p["title"].as_str().unwrap_or("?").to_string(), q));
            }
        }
    }
    out
}

/// Series that exist only with leasing (this cluster has none), a spend
/// cap, or a worker label's ratio to its profile before a batch was timed
/// against one: their panels may be empty here.
const LEASING_ONLY: &[&str] = &[
    "tidegate_leases",
    "tidegate_cost_total",
    "tidegate_spend_cap_per_hour",
    "tidegate_leased_busy_seconds_total",
    "tidegate_leased_paid_seconds_total",
    "tidegate_lease_frames_total",
    "tidegate:cost_per_hour",
];

/// Series a worker exports only when NVML reads a GPU; this one runs on
/// the CPU and says so in `tidegate_worker_gpu_info{gpu="none"}`.
const GPU_ONLY: &[&str] = &[
    "tidegate_worker_gpu_utilization_ratio",
    "tidegate_worker_gpu_memory_used_bytes",
    "tidegate_worker_gpu_memory_total_bytes",
    "tidegate_worker_gpu_power_watts",
    "tidegate_worker_gpu_temperature_celsius",
];

/// Bounds each wait for a process to start or a scrape to succeed.
const BOUND: Duration = Duration::from_secs(90);

#[test]
fn alerts_agree_with_the_load_and_every_dashboard_query_runs_on_real_scrapes() {
    let mut c = Cluster::start(&ClusterOptions::default()).expect("gateway starts");
    c.spawn_worker_with_args("worker-1", &["--metrics-listen", "127.0.0.1:0"])
        .expect("worker starts");
    c.wait_for_workers(1, BOUND).expect("worker registers");
    let worker = c
        .worker_metrics_addr("worker-1", BOUND)
        .expect("the worker serves metrics");
    let edge = EdgeProcess::spawn_ball_with_metrics(&c).expect("the edge starts");
    let edge_metrics = edge.metrics_addr(BOUND).expect("the edge serves metrics");
    let jobs = [
        ("tidegate-gateway", c.http),
        ("tidegate-worker", worker),
        ("tidegate-edge", edge_metrics),
    ];
    let prom = Prometheus::start(&jobs);
    prom.wait_until_up(&jobs);
    edge.wait_for_results(BOUND, "the edge's first results", |r| !r.is_empty())
        .expect("the edge's camera gets results");

    // Light load: an alert may fire only if its condition held.
    let light = load(&c, 2, 5.0, 15.0).join().unwrap();
    let firing = prom.firing();
    for name in NEVER {
        assert!(
            !firing.contains(*name),
            "{name} fired under light load: {firing:?}"
        );
    }
    // how fast the worker runs beside other processes is not this test's
    // business; that the alert names a slowness the gateway measured is:
    // its own time over its profile, from the gateway's own counts
    let (over, all) = batches_over_twice_their_profile(c.http);
    assert!(all > 0, "the gateway timed the light load's batches");
    eprintln!("light: {over} of {all} batches over twice their profile");
    if firing.contains("TidegateWorkerSlowerThanProfile") {
        assert!(
            over > 0,
            "TidegateWorkerSlowerThanProfile fired, yet the gateway counted none of {all} \
             batches over twice their profile"
        );
    }
    if not_ok_share(&light) < 0.01 {
        assert!(
            !firing.contains("TidegateSloBurnFast") && !firing.contains("TidegateSloBurnSlow"),
            "an SLO burn fired with {:.2} % of frames not ok: {firing:?}",
            100.0 * not_ok_share(&light)
        );
    }
    if light.e2e_ms.p95 <= 80.0 {
        assert!(
            !firing.contains("TidegateE2eLatencyOverBudget"),
            "p95 {} ms, yet {firing:?}",
            light.e2e_ms.p95
        );
    }

    // Overload: far more than one CPU worker serves, hints ignored.
    let heavy = load(&c, 32, 30.0, 30.0);
    let mut fired = BTreeSet::new();
    let until = Instant::now() + Duration::from_secs(90);
    while !heavy.is_finished() || !fired.contains("TidegateSloBurnFast") {
        fired.extend(prom.firing());
        if Instant::now() > until {
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    let heavy = heavy.join().unwrap();
    fired.extend(prom.firing());
    eprintln!(
        "light: {:.2} % not ok, p95 {:.1} ms, firing {firing:?}; overload: {:.1} % not ok, fired {fired:?}",
        100.0 * not_ok_share(&light),
        light.e2e_ms.p95,
        100.0 * not_ok_share(&heavy)
    );
    assert_eq!(heavy.missing, 0, "every frame sent has its result");
    assert!(
        not_ok_share(&heavy) > 0.5,
        "not an overload: {:.1} % not ok (the test needs one to assert on)",
        100.0 * not_ok_share(&heavy)
    );
    assert!(
        fired.contains("TidegateSloBurnFast"),
        "{:.1} % of frames not ok, yet the fast burn did not fire: {fired:?}\n{}",
        100.0 * not_ok_share(&heavy),
        prom.log()
    );
    for name in NEVER {
        assert!(
            !fired.contains(*name),
            "{name} fired under an overload: {fired:?}"
        );
    }

    // Every dashboard query runs, on the gateway's, the worker's and the
    // edge's scrapes; each returns data unless it is about leasing, which
    // this cluster does not do, or a GPU, which its worker lacks.
    let queries = dashboard_queries(&workspace_root());
    let empty: Vec<String> = prom
        .without_data(&queries)
        .into_iter()
        .filter(|e| !LEASING_ONLY.iter().chain(GPU_ONLY).any(|s| e.contains(s)))
        .collect();
    assert!(
        empty.is_empty(),
        "dashboard queries with no data under load: {empty:#?}"
    );
}

/// Lease alerts that a gateway leasing one worker for a light load with
/// room under its spend cap never has cause to fire.
const NEVER_WHILE_LEASING: &[&str] = &[
    "TidegateNoWorkers",
    "TidegateSpendNearCap",
    "TidegateLeaseReleaseFailing",
    "TidegateLeaseAcquireErrors",
    "TidegateLeasesFailingToStart",
    "TidegateProviderNoCapacity",
    "TidegateLeasesLost",
];

#[test]
fn leasing_dashboard_queries_return_data_from_a_leasing_gateway_and_no_lease_alert_fires() {
    // The process provider leases one BlazeFace worker for a 10 frames/s
    // floor, on the test catalog (per-second billing, 2 s start-ups), under
    // a spend cap far above its price.
    let leasing = "catalog = \"catalog.toml\"\nledger = \"leases.db\"\npolicy = \"tidal\"\ntick_ms = 500\nheadroom = 0.0\nspend_cap_per_hour = 100.0\n[[leasing.models]]\nname = \"blazeface\"\ninstance_types = [\"cpu-test\"]\nmin_fps = 10\nworker_fps = 20\nmeasure = false\n";
    let mut c = Cluster::start_leasing(
        &ClusterOptions {
            edges: vec!["edge-1".into()],
            workers: Vec::new(),
            ..ClusterOptions::default()
        },
        leasing,
        "",
        &[("catalog.toml", tidegate_testkit::leasing::CATALOG)],
    )
    .expect("a leasing gateway starts");
    c.wait_for_workers(1, BOUND)
        .expect("the leased worker registers");
    let jobs = [("tidegate-gateway", c.http)];
    let prom = Prometheus::start(&jobs);
    prom.wait_until_up(&jobs);
    let light = load(&c, 2, 5.0, 15.0).join().unwrap();
    assert_eq!(light.missing, 0, "every frame sent has its result");

    let firing = prom.firing();
    for name in NEVER_WHILE_LEASING {
        assert!(
            !firing.contains(*name),
            "{name} fired while leasing one worker: {firing:?}"
        );
    }
    // Every query about leasing, which the other test cannot fill, returns
    // data here; waited for (bounded) since a counter's first rate takes
    // two scrapes.
    let leasing_queries: Vec<(String, String)> = dashboard_queries(&workspace_root())
        .into_iter()
        .filter(|(_, q)| LEASING_ONLY.iter().any(|s| q.contains(s)))
        .collect();
    assert!(
        leasing_queries.len() >= LEASING_ONLY.len(),
        "the dashboard shows every leasing series: {leasing_queries:#?}"
    );
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let empty = prom.without_data(&leasing_queries);
        if empty.is_empty() {
            break;
        }
        assert!(
            Instant::now() < until,
            "leasing queries with no data from a leasing gateway: {empty:#?}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

#[test]
fn durations_are_scaled_in_selectors_and_for_clauses_only() {
    let rules =
        "expr: rate(x[5m]) / y[1h] > 2 and z{a=\"[b]\"}\nfor: 10m\nsummary: \"over 15 minutes\"\n";
    assert_eq!(
        scaled(rules),
        "expr: rate(x[5s]) / y[60s] > 2 and z{a=\"[b]\"}\nfor: 10s\nsummary: \"over 15 minutes\"\n"
    );
}
