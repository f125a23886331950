//! GPU leasing through a real Slurm cluster on this host: a gateway whose
//! `slurm` provider submits each lease as a batch job, real BlazeFace
//! workers running as job steps that dial back over QUIC on 127.0.0.1,
//! simulated cameras, and Slurm's own preemption of the spot partition.
//!
//! The test cluster (`testkit/src/mini_slurm.rs`) has one node with
//! 2 GPUs; each lease asks for one. A spot lease is preempted when another
//! tenant's on-demand job needs both GPUs: Slurm signals the worker (it
//! drains), the gateway gets the notice, stops dispatching to it and leases
//! an on-demand replacement, which starts once the GPUs are free. Every
//! frame sent still gets exactly one result. On a clean stop the gateway
//! cancels its jobs. Every wait is bounded; nothing asserts on speed.

use std::time::Duration;

use serde_json::Value;
use tidegate_loadtest::cluster::Cluster;
use tidegate_testkit::leasing::{
    CATALOG, first_spot_lease, leases, one_edge, one_worker_leasing, settled_counters,
    spot_taken_and_replaced, state,
};
use tidegate_testkit::mini_slurm::MiniSlurm;

fn job_of(l: &Value) -> u64 {
    let data: Value = serde_json::from_str(l["provider_data"].as_str().expect("provider data"))
        .expect("provider data is JSON");
    data["job_id"].as_u64().expect("a job id")
}

/// The jobs and the Slurm logs, for a failure message.
fn slurm_context(slurm: &MiniSlurm) -> String {
    format!(
        "jobs: {:?}\n{}",
        slurm.tool("squeue", &["--states=all"]),
        slurm.logs()
    )
}

/// The Slurm provider's `tool_timeout_secs`: the longest one `sbatch`,
/// `scancel` or `squeue` may take.
const TOOL_TIMEOUT_SECS: u64 = 20;
/// Its `release_timeout_secs`: the longest one lease's release may take.
const RELEASE_TIMEOUT_SECS: u64 = 30;
/// How long a clean stop may take by the gateway's own bounds, with room
/// to spare: an acquisition under way (`sbatch`, then cancelling a job it
/// may have queued unanswered), the releases under way, one `scancel` of
/// every job, then the release of the one live lease, each at its deadline
/// on a machine too busy for Slurm to answer sooner. It stops in well under
/// a second when Slurm answers (the time is printed).
const STOP_WITHIN: Duration =
    Duration::from_secs(3 * TOOL_TIMEOUT_SECS + 2 * RELEASE_TIMEOUT_SECS + 60);

#[test]
fn slurm_jobs_serve_frames_and_slurm_preemption_replaces_the_worker() {
    let slurm = MiniSlurm::start();
    // The provider's deadlines, set here because the stop below waits for
    // them (see STOP_WITHIN).
    let section = format!(
        "slurm_conf = \"{}\"\noutput = \"{}/job-%j.out\"\npoll_interval_ms = 200\npartitions = {{ on_demand = \"ondemand\", spot = \"spot\" }}\ngres = {{ cpu-test = \"gpu:1\" }}\ntool_timeout_secs = {TOOL_TIMEOUT_SECS}\nrelease_timeout_secs = {RELEASE_TIMEOUT_SECS}\n",
        slurm.conf().display(),
        slurm.path().display()
    );
    let mut c = Cluster::start_leasing_slurm(
        &one_edge(),
        &one_worker_leasing(""),
        &section,
        &[("catalog.toml", CATALOG)],
    )
    .expect("leasing gateway starts");
    let first = first_spot_lease(&c, "slurm", || slurm_context(&slurm));
    let spot_job = job_of(&first);
    assert_eq!(slurm.job_state(spot_job).as_deref(), Some("RUNNING"));
    // the status page lists the live lease and its worker
    let (code, page) = c.get("/").expect("GET /");
    assert_eq!(code, 200, "{page}");
    for want in [
        "<h2>Live leases</h2>",
        "<td>slurm</td><td>cpu-test</td><td>spot</td><td>ready</td>",
        &format!("<td>lease-{}</td>", first["id"]),
    ] {
        assert!(
            page.contains(want),
            "{want} not on the status page:\n{page}"
        );
    }

    // Once the spot worker serves (well inside the 16 s of sending), another
    // tenant's on-demand job needs both GPUs for a few seconds.
    let tenant = spot_taken_and_replaced(
        &c,
        || slurm_context(&slurm),
        || {
            slurm
                .tool(
                    "sbatch",
                    &[
                        "--parsable",
                        "--partition=ondemand",
                        "--gres=gpu:2",
                        "--output=/dev/null",
                        "--wrap=sleep 4",
                    ],
                )
                .expect("the other tenant's job is submitted")
        },
    );
    assert_eq!(
        slurm.job_state(spot_job).as_deref().map(|s| s == "RUNNING"),
        Some(false)
    );
    let tenant: u64 = tenant.trim().parse().expect("tenant job id");
    assert_ne!(slurm.job_state(tenant).as_deref(), Some("PENDING"));

    settled_counters(&c);

    // a clean stop cancels every job the gateway holds
    // (a lease still being acquired has no job yet)
    let jobs: Vec<u64> = leases(&c, false)
        .iter()
        .filter(|l| state(l) != "requested")
        .map(job_of)
        .collect();
    let stopping = std::time::Instant::now();
    let status = c
        .stop_gateway(STOP_WITHIN)
        .expect("gateway stops on SIGTERM");
    let log = c.gateway_log();
    let shutdown = log.find("shutting down").map_or("", |at| &log[at..]);
    eprintln!(
        "the gateway stopped in {:?}; its log from the stop:\n{shutdown}",
        stopping.elapsed()
    );
    assert!(status.success(), "gateway exit: {status}");
    for job in jobs {
        let s = slurm.job_state(job).unwrap_or_default();
        assert!(
            !["RUNNING", "PENDING", "COMPLETING"].contains(&s.as_str()),
            "job {job} is {s}"
        );
    }
    assert!(slurm.live_jobs().is_empty(), "{:?}", slurm.live_jobs());
}
