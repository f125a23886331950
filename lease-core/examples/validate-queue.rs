//! The queueing model's side of a validation against a real load test:
//! one model's frames at a fixed rate on a pool of identical workers whose
//! batch cost is fitted to a measured latency profile.
//!
//! ```sh
//! cargo run --release -p tidegate-lease-core --example validate-queue -- \
//!     --profile 1:1192,2:2365,4:4638,8:9649 --workers 1 --fps 600 \
//!     --seconds 15 --network-ms 2.5 [--budget-ms 80] [--slot-us 100] \
//!     [--arrivals even|poisson] [--jitter 0.2] [--seed 1] [--json]
//! ```
//!
//! `--profile` is the worker's `(batch:latency µs)` list, as it logs it at
//! start (`profiled model=… batch=… latency_us=…`) and registers it with the
//! gateway; a least-squares `launch + b × frame` is fitted to it, capped at
//! its best-throughput batch as the gateway's scheduler caps batches
//! ([`BatchCost::fit_profile`]). Or give `--launch-us`, `--frame-us` and
//! `--max-batch` directly. `--network-ms` is the part of the end-to-end
//! latency outside the worker (the edge's send, the link, the gateway and
//! the result's way back): measure it as a light run's p50 minus a batch of
//! one. It prints what the load test reports: frames within the budget,
//! late and shed, SLO attainment and the latency percentiles, and the
//! model's own cost (wall time per simulated slot).

use std::time::Instant;

use tidegate_lease_core::queue::{Arrivals, BatchCost, ModelQueue, QueueConfig};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--help" || a == "-h") {
        println!("{}", HELP);
        return Ok(());
    }
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let num = |name: &str, default: f64| -> Result<f64, String> {
        flag(name).map_or(Ok(default), |v| {
            v.parse()
                .map_err(|_| format!("{name} {v:?} is not a number; see --help"))
        })
    };
    let cost = match flag("--profile") {
        Some(p) => BatchCost::fit_profile(&parse_profile(&p)?)?,
        None => BatchCost::new(
            num("--launch-us", 2_000.0)?,
            num("--frame-us", 928.0)?,
            num("--max-batch", 64.0)? as u32,
        )?,
    };
    let workers = num("--workers", 1.0)? as u64;
    let fps = num("--fps", 100.0)?;
    let seconds = num("--seconds", 15.0)?;
    let mut cfg = QueueConfig::new(num("--budget-ms", 80.0)?, num("--network-ms", 20.0)?);
    cfg.slot_us = num("--slot-us", 100.0)? as u64;
    cfg.batch_jitter = num("--jitter", 0.0)?;
    cfg.arrivals = match flag("--arrivals").as_deref() {
        None | Some("even") => Arrivals::Even,
        Some("poisson") => Arrivals::Poisson,
        Some(other) => return Err(format!("--arrivals {other:?}: give even or poisson").into()),
    };
    if !(fps >= 0.0 && seconds > 0.0 && seconds <= 7.0 * 86_400.0) {
        return Err("--fps must be ≥ 0 and --seconds within (0, 604800]".into());
    }
    let slot_us = cfg.slot_us;
    let mut q = ModelQueue::new(cfg, 0, num("--seed", 1.0)? as u64)?;
    q.set_fleet(&[("worker", cost, workers)]);

    // one-second steps, the frames of each exact (fractions carried)
    let started = Instant::now();
    let (mut arrived, mut within, mut late, mut shed, mut carry) = (0u64, 0u64, 0u64, 0u64, 0.0);
    let steps = seconds.ceil() as u64;
    for s in 1..=steps {
        let secs = (seconds - (s - 1) as f64).min(1.0);
        let exact = fps * secs + carry;
        let n = exact as u64;
        carry = exact - n as f64;
        let until = ((s - 1) as f64 * 1e6 + secs * 1e6) as u64;
        let o = q.advance(until, n);
        (arrived, within, late, shed) = (
            arrived + o.arrived,
            within + o.within_slo,
            late + o.late,
            shed + o.shed,
        );
    }
    let o = q.drain();
    (within, late, shed) = (within + o.within_slo, late + o.late, shed + o.shed);
    let wall = started.elapsed();
    q.take_tick_latency();
    let h = q.run_latency();
    let slots = (seconds * 1e6) as u64 / slot_us;
    let attainment = if arrived == 0 {
        1.0
    } else {
        within as f64 / arrived as f64
    };
    let report = serde_json::json!({
        "cost": cost,
        "workers": workers,
        "fps": fps,
        "seconds": seconds,
        "arrived": arrived,
        "within_slo": within,
        "late": late,
        "shed": shed,
        "slo_attainment": attainment,
        "capacity_fps": workers as f64 * cost.throughput_fps(u64::from(cost.max_batch)),
        "e2e_ms": {
            "p50": h.quantile_ms(0.50),
            "p95": h.quantile_ms(0.95),
            "p99": h.quantile_ms(0.99),
            "max": h.max_ms(),
        },
        "wall_ms": wall.as_secs_f64() * 1e3,
        "ns_per_slot": wall.as_secs_f64() * 1e9 / slots.max(1) as f64,
    });
    if args.iter().any(|a| a == "--json") {
        println!("{report}");
    } else {
        println!("{}", serde_json::to_string_pretty(&report)?);
    }
    Ok(())
}

const HELP: &str = "validate-queue: the queueing model on one pool at a fixed rate.
  --profile B:US,...      the worker's measured (batch:latency µs) profile, fitted
  --launch-us/--frame-us/--max-batch   or the batch cost itself (default 2000/928/64)
  --workers N (1)  --fps F (100)  --seconds S (15)
  --budget-ms (80)  --network-ms (20)  --slot-us (100)  --jitter (0)
  --arrivals even|poisson (even: cameras send on a period)  --seed (1)  --json";

/// `1:1192,2:2365` → [(1, 1192.0), (2, 2365.0)].
fn parse_profile(s: &str) -> Result<Vec<(u32, f64)>, String> {
    s.split(',')
        .map(|p| {
            let (b, l) = p
                .split_once(':')
                .ok_or_else(|| format!("--profile entry {p:?}: write batch:latency_us"))?;
            Ok((
                b.trim()
                    .parse()
                    .map_err(|_| format!("--profile batch {b:?} is not a whole number"))?,
                l.trim()
                    .parse()
                    .map_err(|_| format!("--profile latency {l:?} is not a number of µs"))?,
            ))
        })
        .collect()
}
