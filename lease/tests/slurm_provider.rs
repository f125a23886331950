//! The Slurm provider against a real Slurm cluster on this host
//! (`testkit/src/mini_slurm.rs`: munged + slurmctld + slurmd on 127.0.0.1). A
//! shell script stands in for `tidegate-worker`: it writes its environment
//! to a file, and on SIGTERM writes a `drained` file and exits 0, as the
//! worker drains. The tests of the tools' deadlines (a slurmctld that does
//! not answer) run stand-in tools, shell scripts written into a temporary
//! folder, with or without the cluster. Waits are bounded by timeouts that
//! only guard against a hang; no test asserts how fast anything happens.

use std::path::Path;
use std::time::Duration;

use tidegate_lease::catalog::{Catalog, Tier};
use tidegate_lease::ledger::{Ledger, NewLease};
use tidegate_lease::lifecycle::{EndReason, LeaseState};
use tidegate_lease::provider::slurm::{JobId, SlurmConfig, SlurmData, SlurmProvider};
use tidegate_lease::provider::{Provider, ProviderError, ProviderEvent, wall_clock_ms};
use tidegate_lease::table::LeaseId;
use tidegate_testkit::mini_slurm::{GRACE_SECS, MiniSlurm};
use tidegate_testkit::provider::{
    GUARD, WORKER, acquire_recorded, ended, env_of, next_event, spec, var, wait_for,
};

fn config(slurm: &MiniSlurm, out: &Path, script: &str) -> SlurmConfig {
    let mut cfg = SlurmConfig::new("sh", &["-c", script], "ondemand");
    cfg.partitions.spot = Some("spot".into());
    cfg.slurm_conf = Some(slurm.conf());
    cfg.output = Some(format!("{}/job-%j.out", out.display()));
    cfg.poll_interval_ms = 200;
    cfg.env.insert("OUT".into(), out.display().to_string());
    // a spot lease of type h200 takes both GPUs of the test node
    cfg.gres.insert("h200".into(), "gpu:2".into());
    cfg
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_is_a_job_step_with_its_gpus_and_token_and_release_cancels_it() {
    let slurm = MiniSlurm::start();
    let out = tempfile::tempdir().unwrap();
    let mut p = SlurmProvider::connect(config(&slurm, out.path(), WORKER))
        .await
        .unwrap();
    assert_eq!(p.notice_period(), Duration::from_secs(GRACE_SECS));
    let s = spec(1, Tier::OnDemand, "h100");
    let token = s.token.expose().to_string();
    let acquired = p.acquire(s).await.unwrap();
    let data: SlurmData = serde_json::from_str(acquired.provider_data.as_deref().unwrap()).unwrap();
    assert_eq!(data.partition, "ondemand");
    assert_eq!(p.job(LeaseId(1)), Some(data.job_id));
    wait_for(
        "the worker's environment",
        || slurm.logs(),
        || env_of(out.path(), 1).is_some(),
    )
    .await;
    let env = env_of(out.path(), 1).unwrap();
    assert_eq!(var(&env, "TIDEGATE_LEASE_TOKEN"), Some(token.as_str()));
    assert_eq!(var(&env, "TIDEGATE_LEASE_ID"), Some("1"));
    assert_eq!(var(&env, "TIDEGATE_INSTANCE_TYPE"), Some("h100"));
    assert_eq!(var(&env, "TIDEGATE_LEASE_TIER"), Some("on_demand"));
    assert_eq!(var(&env, "SLURM_JOB_PARTITION"), Some("ondemand"));
    // one GPU of the two, assigned by Slurm, and the worker is a job step
    assert_eq!(
        var(&env, "CUDA_VISIBLE_DEVICES").map(|v| v.split(',').count()),
        Some(1),
        "{env}"
    );
    assert!(var(&env, "SLURM_STEP_ID").is_some(), "{env}");
    // the token is on no command line Slurm keeps
    let shown = slurm
        .tool("scontrol", &["show", "job", &data.job_id.to_string()])
        .unwrap();
    assert!(!shown.contains(&token), "{shown}");
    assert_eq!(slurm.job_state(data.job_id.0).as_deref(), Some("RUNNING"));

    p.release(LeaseId(1)).await.unwrap();
    let state = slurm.job_state(data.job_id.0).unwrap_or_default();
    assert!(state == "CANCELLED" || state == "COMPLETED", "{state}");
    // scancel's SIGTERM reached the worker, which drained
    assert!(out.path().join("lease-1.drained").exists());
    assert!(slurm.live_jobs().is_empty(), "{:?}", slurm.live_jobs());
    assert!(matches!(
        p.release(LeaseId(1)).await,
        Err(ProviderError::UnknownLease(_))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slurm_preempting_a_spot_job_is_the_notice_and_the_worker_drains() {
    let slurm = MiniSlurm::start();
    let out = tempfile::tempdir().unwrap();
    let mut p = SlurmProvider::connect(config(&slurm, out.path(), WORKER))
        .await
        .unwrap();
    let mut events = p.take_events().unwrap();
    let spot = p.acquire(spec(1, Tier::Spot, "h200")).await.unwrap();
    let spot_job: SlurmData = serde_json::from_str(spot.provider_data.as_deref().unwrap()).unwrap();
    assert_eq!(spot_job.partition, "spot");
    wait_for(
        "the spot worker",
        || slurm.logs(),
        || env_of(out.path(), 1).is_some(),
    )
    .await;
    let env = env_of(out.path(), 1).unwrap();
    assert_eq!(
        var(&env, "CUDA_VISIBLE_DEVICES").map(|v| v.split(',').count()),
        Some(2),
        "{env}"
    );

    // an on-demand lease needs a GPU the spot job holds: Slurm preempts it
    let before = wall_clock_ms();
    p.acquire(spec(2, Tier::OnDemand, "h100")).await.unwrap();
    match next_event(&mut events).await {
        ProviderEvent::PreemptionNotice { lease, deadline } => {
            assert_eq!(lease, LeaseId(1));
            // PreemptTime (whole seconds) + GraceTime
            assert!(
                deadline + 1000 >= before + GRACE_SECS * 1000,
                "{deadline} vs {before}"
            );
            assert!(
                deadline <= wall_clock_ms() + GRACE_SECS * 1000,
                "{deadline}"
            );
        }
        other => panic!("expected the spot notice, got {other:?}"),
    }
    let (reason, detail) = ended(&mut events, LeaseId(1)).await;
    assert_eq!(reason, EndReason::Preempted, "{detail}");
    // the worker got SIGTERM at the start of the grace time and drained
    assert!(out.path().join("lease-1.drained").exists());
    wait_for(
        "the on-demand worker",
        || slurm.logs(),
        || env_of(out.path(), 2).is_some(),
    )
    .await;
    // the preempted lease's job has ended: it is no longer held
    assert_eq!(p.held(), vec![LeaseId(2)]);
    p.shutdown().await;
    assert!(slurm.live_jobs().is_empty(), "{:?}", slurm.live_jobs());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spot_job_slurm_requeues_is_cancelled_and_ends_preempted() {
    let slurm = MiniSlurm::start();
    let out = tempfile::tempdir().unwrap();
    // a worker that does not drain in time: Slurm kills it at the end of
    // the grace time and puts its job back in the queue
    let stubborn = r#"env > "$OUT/lease-$TIDEGATE_LEASE_ID.env"
trap '' TERM
while :; do sleep 0.1; done"#;
    let mut cfg = config(&slurm, out.path(), stubborn);
    cfg.partitions.spot = Some("spotrq".into());
    let mut p = SlurmProvider::connect(cfg).await.unwrap();
    let mut events = p.take_events().unwrap();
    let spot = p.acquire(spec(1, Tier::Spot, "h200")).await.unwrap();
    let job: SlurmData = serde_json::from_str(spot.provider_data.as_deref().unwrap()).unwrap();
    wait_for(
        "the spot worker",
        || slurm.logs(),
        || env_of(out.path(), 1).is_some(),
    )
    .await;
    p.acquire(spec(2, Tier::OnDemand, "h100")).await.unwrap();
    match next_event(&mut events).await {
        ProviderEvent::PreemptionNotice { lease, .. } => assert_eq!(lease, LeaseId(1)),
        other => panic!("expected the spot notice, got {other:?}"),
    }
    let (reason, detail) = ended(&mut events, LeaseId(1)).await;
    assert_eq!(reason, EndReason::Preempted, "{detail}");
    // Slurm put the job back in the queue; a lease is one run, so the
    // provider cancelled it rather than let it start again
    assert!(detail.contains("requeued"), "{detail}");
    wait_for(
        "the requeued job to be cancelled",
        || slurm.logs(),
        || slurm.job_state(job.job_id.0).as_deref() == Some("CANCELLED"),
    )
    .await;
    wait_for(
        "the on-demand worker",
        || slurm.logs(),
        || env_of(out.path(), 2).is_some(),
    )
    .await;
    p.shutdown().await;
    assert!(slurm.live_jobs().is_empty(), "{:?}", slurm.live_jobs());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_dies_ends_its_lease_lost_and_a_job_that_never_ran_failed() {
    let slurm = MiniSlurm::start();
    let out = tempfile::tempdir().unwrap();
    let script = r#"env > "$OUT/lease-$TIDEGATE_LEASE_ID.env"; sleep 0.5; exit 3"#;
    let mut p = SlurmProvider::connect(config(&slurm, out.path(), script))
        .await
        .unwrap();
    let mut events = p.take_events().unwrap();
    p.acquire(spec(1, Tier::OnDemand, "h100")).await.unwrap();
    let (reason, detail) = ended(&mut events, LeaseId(1)).await;
    assert_eq!(reason, EndReason::Lost, "{detail}");
    assert!(detail.contains("FAILED"), "{detail}");
    assert!(env_of(out.path(), 1).is_some());
    // a job that ended is no longer held: there is nothing to release (or
    // to cancel at shutdown), and the provider's map does not keep it
    assert!(p.held().is_empty());
    assert_eq!(p.job(LeaseId(1)), None);
    assert!(matches!(
        p.release(LeaseId(1)).await,
        Err(ProviderError::UnknownLease(LeaseId(1)))
    ));

    // a pending job cancelled behind our back never ran: a failed start
    let mut hold = config(&slurm, out.path(), WORKER);
    hold.sbatch_args = vec!["--hold".into()];
    let mut p = SlurmProvider::connect(hold).await.unwrap();
    let mut events = p.take_events().unwrap();
    let a = p.acquire(spec(2, Tier::OnDemand, "h100")).await.unwrap();
    let job: SlurmData = serde_json::from_str(a.provider_data.as_deref().unwrap()).unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    slurm.tool("scancel", &[&job.job_id.to_string()]).unwrap();
    let (reason, detail) = ended(&mut events, LeaseId(2)).await;
    assert_eq!(reason, EndReason::Failed, "{detail}");
    assert!(detail.contains("CANCELLED"), "{detail}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_partitions_and_impossible_jobs_are_clear_errors() {
    let slurm = MiniSlurm::start();
    let out = tempfile::tempdir().unwrap();
    let mut cfg = config(&slurm, out.path(), WORKER);
    cfg.partitions.spot = Some("preemptible".into());
    let e = SlurmProvider::connect(cfg).await.unwrap_err().to_string();
    assert!(e.contains("spot partition \"preemptible\""), "{e}");
    assert!(e.contains("not found"), "{e}");

    let mut cfg = config(&slurm, out.path(), WORKER);
    cfg.gres.insert("a100".into(), "gpu:8".into());
    let mut p = SlurmProvider::connect(cfg).await.unwrap();
    let e = p
        .acquire(spec(1, Tier::OnDemand, "a100"))
        .await
        .unwrap_err();
    let text = e.to_string();
    assert!(
        matches!(
            e,
            ProviderError::Slurm {
                lease: Some(LeaseId(1)),
                ..
            }
        ),
        "{text}"
    );
    assert!(
        text.contains("sbatch") && text.contains("--gres=gpu:8"),
        "{text}"
    );
    assert!(text.to_lowercase().contains("not available"), "{text}");
    assert!(p.held().is_empty());
    assert!(slurm.live_jobs().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_gateway_adopts_running_jobs_and_ends_the_gone() {
    let slurm = MiniSlurm::start();
    let out = tempfile::tempdir().unwrap();
    let db = tempfile::tempdir().unwrap();
    let mut ledger = Ledger::open(&db.path().join("leases.db")).unwrap();
    let mut p = SlurmProvider::connect(config(&slurm, out.path(), WORKER))
        .await
        .unwrap();
    let mut jobs = Vec::new();
    for _ in 0..2 {
        let data = acquire_recorded(&mut p, &mut ledger, "slurm", None).await;
        let data: SlurmData = serde_json::from_str(&data).unwrap();
        jobs.push(data.job_id);
    }
    wait_for(
        "both workers",
        || slurm.logs(),
        || env_of(out.path(), 1).is_some() && env_of(out.path(), 2).is_some(),
    )
    .await;
    // lease 3's job is submitted, but the gateway dies before it records it
    let catalog = Catalog::default_catalog();
    let third = ledger
        .insert_requested(&NewLease {
            provider: "slurm",
            model: Some("blazeface"),
            instance: catalog.get("h100").unwrap(),
            tier: Tier::OnDemand,
            currency: &catalog.currency,
            requested_at: wall_clock_ms(),
            token: None,
        })
        .unwrap();
    let unrecorded = p
        .acquire(spec(third.0, Tier::OnDemand, "h100"))
        .await
        .unwrap();
    let unrecorded: SlurmData =
        serde_json::from_str(unrecorded.provider_data.as_deref().unwrap()).unwrap();
    // the gateway dies; while it is down, job 2 is cancelled
    p.detach_all().await;
    let before_cancel = wall_clock_ms();
    slurm.tool("scancel", &[&jobs[1].to_string()]).unwrap();
    wait_for(
        "job 2 to end",
        || slurm.logs(),
        || slurm.job_state(jobs[1].0).as_deref() == Some("CANCELLED"),
    )
    .await;
    let ended_by = wall_clock_ms();
    assert_eq!(slurm.job_state(jobs[0].0).as_deref(), Some("RUNNING"));
    // the gateway stays down a while longer
    tokio::time::sleep(std::time::Duration::from_millis(2500)).await;

    let mut p = SlurmProvider::connect(config(&slurm, out.path(), WORKER))
        .await
        .unwrap();
    let restart = wall_clock_ms();
    let adoption = p.adopt(&mut ledger, restart).await.unwrap();
    assert_eq!(adoption.adopted, vec![LeaseId(1)]);
    assert_eq!(
        adoption.ended,
        vec![(LeaseId(2), EndReason::Lost), (third, EndReason::Failed)]
    );
    // the job it never recorded is found by its name and cancelled
    wait_for(
        "the unrecorded job cancelled",
        || slurm.logs(),
        || !slurm.live_jobs().contains(&unrecorded.job_id.0),
    )
    .await;
    let gone = ledger.lease(LeaseId(2)).unwrap().unwrap();
    assert_eq!(gone.state, LeaseState::Ended(EndReason::Lost));
    // billed to the job's end as Slurm recorded it (whole seconds), not to
    // the restart
    let ended_at = gone.ended_at.unwrap();
    assert!(
        (before_cancel.saturating_sub(1000)..=ended_by).contains(&ended_at),
        "ended at {ended_at}, cancelled in {before_cancel}..={ended_by}, restart {restart}"
    );
    assert_eq!(p.job(LeaseId(1)), Some(jobs[0]));
    // the adopted job is watched: cancelling it ends the lease
    let mut events = p.take_events().unwrap();
    slurm.tool("scancel", &[&jobs[0].to_string()]).unwrap();
    let (reason, detail) = ended(&mut events, LeaseId(1)).await;
    assert_eq!(reason, EndReason::Lost, "{detail}");
    assert!(slurm.live_jobs().is_empty());
}

/// The Slurm tool `tool` as installed (see `testkit/src/mini_slurm.rs`).
fn installed(tool: &str) -> std::path::PathBuf {
    ["/usr/bin", "/usr/sbin", "/bin", "/sbin"]
        .iter()
        .map(|d| Path::new(d).join(tool))
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("{tool} is not installed; run scripts/setup.sh"))
}

/// A folder `bin` in `out` with links to Slurm's installed tools, all but
/// `stand_in`, which the test writes.
fn real_tools_but(out: &Path, stand_in: &str) -> std::path::PathBuf {
    let bin = out.join("bin");
    std::fs::create_dir(&bin).unwrap();
    for tool in ["sbatch", "squeue", "scontrol", "scancel"] {
        if tool != stand_in {
            std::os::unix::fs::symlink(installed(tool), bin.join(tool)).unwrap();
        }
    }
    bin
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_that_fails_keeps_the_job_held_and_watched_until_it_ends() {
    let slurm = MiniSlurm::start();
    let out = tempfile::tempdir().unwrap();
    // Slurm's own tools, but an `scancel` that fails while `scancel.fail`
    // exists next to it (a controller that does not answer)
    let bin = real_tools_but(out.path(), "scancel");
    let scancel = format!(
        "if [ -e \"$(dirname \"$0\")/scancel.fail\" ]; then\n  echo 'scancel: error: Unable to contact slurm controller' >&2\n  exit 1\nfi\nexec {} \"$@\"",
        installed("scancel").display()
    );
    fake_tool(&bin, "scancel", &scancel);
    let mut cfg = config(&slurm, out.path(), WORKER);
    cfg.bin_dir = Some(bin.clone());
    let mut p = SlurmProvider::connect(cfg).await.unwrap();
    let mut events = p.take_events().unwrap();
    let a = p.acquire(spec(1, Tier::OnDemand, "h100")).await.unwrap();
    let job: SlurmData = serde_json::from_str(a.provider_data.as_deref().unwrap()).unwrap();
    wait_for(
        "the worker",
        || slurm.logs(),
        || env_of(out.path(), 1).is_some(),
    )
    .await;

    // the cancel fails: the release fails, and the job, which still runs
    // (and bills), is still held and watched rather than forgotten
    std::fs::write(bin.join("scancel.fail"), "").unwrap();
    let e = p.release(LeaseId(1)).await.unwrap_err();
    assert!(e.to_string().contains("scancel"), "{e}");
    assert_eq!(p.held(), vec![LeaseId(1)]);
    assert_eq!(p.job(LeaseId(1)), Some(job.job_id));
    assert_eq!(slurm.job_state(job.job_id.0).as_deref(), Some("RUNNING"));
    assert!(events.try_recv().is_err(), "no end while the job runs");

    // the retry succeeds once scancel works again
    std::fs::remove_file(bin.join("scancel.fail")).unwrap();
    p.release(LeaseId(1)).await.unwrap();
    assert!(p.held().is_empty());
    let state = slurm.job_state(job.job_id.0).unwrap_or_default();
    assert!(state == "CANCELLED" || state == "COMPLETED", "{state}");

    // a job whose release failed and that then ends by itself is reported
    // ended by the poller (it was still watched) and is no longer held
    let b = p.acquire(spec(2, Tier::OnDemand, "h100")).await.unwrap();
    let job2: SlurmData = serde_json::from_str(b.provider_data.as_deref().unwrap()).unwrap();
    wait_for(
        "the second worker",
        || slurm.logs(),
        || env_of(out.path(), 2).is_some(),
    )
    .await;
    std::fs::write(bin.join("scancel.fail"), "").unwrap();
    assert!(p.release(LeaseId(2)).await.is_err());
    slurm.tool("scancel", &[&job2.job_id.to_string()]).unwrap();
    // (lease 1's end was its release's: no event came of it)
    let (reason, detail) = ended(&mut events, LeaseId(2)).await;
    // lost if a poll saw it running, failed if none did: either way ended
    assert!(
        matches!(reason, EndReason::Lost | EndReason::Failed),
        "{reason:?}: {detail}"
    );
    assert!(detail.contains("CANCELLED"), "{detail}");
    assert!(p.held().is_empty());
    assert!(slurm.live_jobs().is_empty(), "{:?}", slurm.live_jobs());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn begin_release_drains_every_worker_at_once_then_each_release_waits() {
    let slurm = MiniSlurm::start();
    let out = tempfile::tempdir().unwrap();
    let mut p = SlurmProvider::connect(config(&slurm, out.path(), WORKER))
        .await
        .unwrap();
    let mut events = p.take_events().unwrap();
    for id in [1, 2] {
        p.acquire(spec(id, Tier::OnDemand, "h100")).await.unwrap();
    }
    wait_for(
        "both workers",
        || slurm.logs(),
        || env_of(out.path(), 1).is_some() && env_of(out.path(), 2).is_some(),
    )
    .await;
    p.begin_release(&[LeaseId(1), LeaseId(2)]).await;
    // one scancel: both workers got SIGTERM and drained before any release
    // waited
    wait_for(
        "both workers to drain",
        || slurm.logs(),
        || {
            out.path().join("lease-1.drained").exists()
                && out.path().join("lease-2.drained").exists()
        },
    )
    .await;
    p.release(LeaseId(1)).await.unwrap();
    p.release(LeaseId(2)).await.unwrap();
    assert!(p.held().is_empty());
    assert!(slurm.live_jobs().is_empty(), "{:?}", slurm.live_jobs());
    // releasing is no news
    assert!(events.try_recv().is_err());
}

/// Writes the stand-in tool `name` into `dir`: a `/bin/sh` script of
/// `body`. `install` writes it, not this process: a file this process held
/// open for writing could be inherited by a process another test forks
/// meanwhile, and running the script would then fail (`ETXTBSY`).
fn fake_tool(dir: &Path, name: &str, body: &str) {
    let src = dir.join(format!("{name}.sh"));
    std::fs::write(&src, format!("#!/bin/sh\n{body}\n")).unwrap();
    let status = std::process::Command::new("install")
        .args(["-m", "755"])
        .arg(&src)
        .arg(dir.join(name))
        .status()
        .expect("install runs");
    assert!(status.success(), "installing the stand-in {name}");
}

/// The body of a stand-in tool that never answers (a hung slurmctld):
/// it records its pid in `<name>.pids` next to it, then sleeps for ten
/// minutes as that same process.
fn hung(name: &str) -> String {
    format!("echo $$ >> \"$(dirname \"$0\")/{name}.pids\"\nexec sleep 600")
}

/// A folder of stand-in Slurm tools that answer at once: `scontrol`
/// knows every partition, `sbatch` queues job 4242, `squeue` shows it
/// running, and `scancel` records its arguments in `scancel.args` (a line
/// a call). Each test replaces the one it makes hang.
fn fake_tools() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    fake_tool(d, "scontrol", r#"echo "PartitionName=$4 GraceTime=0""#);
    fake_tool(d, "sbatch", "cat > /dev/null\necho 4242");
    fake_tool(d, "squeue", "echo '4242|RUNNING|N/A|N/A|None|'");
    fake_tool(
        d,
        "scancel",
        r#"echo "$*" >> "$(dirname "$0")/scancel.args""#,
    );
    dir
}

/// A provider config running the stand-in tools in `bin`. The poller
/// polls every ten minutes, so that it runs no tool during a test.
fn fake_config(bin: &Path) -> SlurmConfig {
    let mut cfg = SlurmConfig::new("tidegate-worker", &[], "ondemand");
    cfg.bin_dir = Some(bin.to_path_buf());
    cfg.poll_interval_ms = 600_000;
    cfg
}

/// What the stand-in `scancel` in `bin` was called with, a line a call.
fn scancel_calls(bin: &Path) -> String {
    std::fs::read_to_string(bin.join("scancel.args")).unwrap_or_default()
}

/// Waits until every process recorded in `pids` is gone: killed and
/// reaped (a zombie keeps its `/proc` entry).
async fn wait_gone(pids: &Path) {
    let text = std::fs::read_to_string(pids)
        .unwrap_or_else(|e| panic!("the hung tool recorded its pid in {}: {e}", pids.display()));
    assert!(!text.trim().is_empty(), "no pid in {}", pids.display());
    for pid in text.split_whitespace() {
        let proc = Path::new("/proc").join(pid);
        wait_for(
            &format!("the hung tool (pid {pid}) to be killed and reaped"),
            || std::fs::read_to_string(proc.join("status")).unwrap_or_default(),
            || !proc.exists(),
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sbatch_that_does_not_answer_is_killed_and_any_job_of_its_name_cancelled() {
    let bin = fake_tools();
    fake_tool(bin.path(), "sbatch", &hung("sbatch"));
    let mut cfg = fake_config(bin.path());
    cfg.job_name = "tg-test".into();
    cfg.tool_timeout_secs = 2.0;
    let mut p = SlurmProvider::connect(cfg).await.unwrap();
    let e = tokio::time::timeout(GUARD, p.acquire(spec(7, Tier::OnDemand, "h100")))
        .await
        .expect("the acquire gives up at the tool's deadline")
        .unwrap_err();
    let text = e.to_string();
    assert!(
        matches!(
            e,
            ProviderError::Slurm {
                lease: Some(LeaseId(7)),
                ..
            }
        ),
        "{text}"
    );
    assert!(
        text.contains("sbatch --parsable --job-name=tg-test-7"),
        "{text}"
    );
    assert!(
        text.contains("did not answer within 2 s (tool_timeout_secs)"),
        "{text}"
    );
    wait_gone(&bin.path().join("sbatch.pids")).await;
    // Slurm may have queued the job and lost the answer: any job of the
    // lease's name is cancelled, once
    assert_eq!(scancel_calls(bin.path()), "--name=tg-test-7\n");
    assert!(p.held().is_empty());
    assert_eq!(p.job(LeaseId(7)), None);

    // a refusal is no timeout: no job was queued, and none is cancelled
    fake_tool(
        bin.path(),
        "sbatch",
        "cat > /dev/null\necho 'sbatch: error: Batch job submission failed: Invalid partition name specified' >&2\nexit 1",
    );
    let e = tokio::time::timeout(GUARD, p.acquire(spec(8, Tier::OnDemand, "h100")))
        .await
        .expect("a refusal within the guard")
        .unwrap_err()
        .to_string();
    assert!(e.contains("Invalid partition name"), "{e}");
    assert!(!e.contains("did not answer"), "{e}");
    assert_eq!(scancel_calls(bin.path()), "--name=tg-test-7\n");

    // the provider goes on: once sbatch answers, leases are acquired
    fake_tool(bin.path(), "sbatch", "cat > /dev/null\necho 4242");
    tokio::time::timeout(GUARD, p.acquire(spec(9, Tier::OnDemand, "h100")))
        .await
        .expect("an acquire within the guard")
        .unwrap();
    assert_eq!(p.held(), vec![LeaseId(9)]);
    assert_eq!(p.job(LeaseId(9)), Some(JobId(4242)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_whose_squeue_hangs_fails_at_the_release_deadline_and_keeps_the_job() {
    let bin = fake_tools();
    let mut cfg = fake_config(bin.path());
    cfg.release_timeout_secs = 2.0;
    // no tool deadline within the test: only the release's can end it
    cfg.tool_timeout_secs = 600.0;
    let mut p = SlurmProvider::connect(cfg).await.unwrap();
    p.acquire(spec(1, Tier::OnDemand, "h100")).await.unwrap();
    fake_tool(bin.path(), "squeue", &hung("squeue"));
    let e = tokio::time::timeout(GUARD, p.release(LeaseId(1)))
        .await
        .expect("the release gives up at its deadline")
        .unwrap_err();
    let text = e.to_string();
    assert!(
        matches!(
            e,
            ProviderError::Slurm {
                lease: Some(LeaseId(1)),
                ..
            }
        ),
        "{text}"
    );
    assert!(text.contains("squeue"), "{text}");
    assert!(text.contains("release_timeout_secs"), "{text}");
    wait_gone(&bin.path().join("squeue.pids")).await;
    assert_eq!(scancel_calls(bin.path()), "4242\n");
    // the job may still run (and bill): still held, its release retried
    assert_eq!(p.held(), vec![LeaseId(1)]);
    assert_eq!(p.job(LeaseId(1)), Some(JobId(4242)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_whose_scancel_hangs_fails_at_the_tool_deadline_and_keeps_the_job() {
    let bin = fake_tools();
    let mut cfg = fake_config(bin.path());
    cfg.release_timeout_secs = 600.0;
    cfg.tool_timeout_secs = 1.0;
    let mut p = SlurmProvider::connect(cfg).await.unwrap();
    p.acquire(spec(1, Tier::OnDemand, "h100")).await.unwrap();
    fake_tool(bin.path(), "scancel", &hung("scancel"));
    let e = tokio::time::timeout(GUARD, p.release(LeaseId(1)))
        .await
        .expect("the release gives up at the tool's deadline")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("scancel 4242") && e.contains("did not answer within 1 s (tool_timeout_secs)"),
        "{e}"
    );
    wait_gone(&bin.path().join("scancel.pids")).await;
    assert_eq!(p.held(), vec![LeaseId(1)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_up_check_whose_scontrol_hangs_fails_at_the_tool_deadline() {
    let bin = fake_tools();
    fake_tool(bin.path(), "scontrol", &hung("scontrol"));
    let mut cfg = fake_config(bin.path());
    cfg.tool_timeout_secs = 1.0;
    // the guard only keeps a hung connect from holding the test up
    let e = tokio::time::timeout(GUARD, SlurmProvider::connect(cfg))
        .await
        .expect("the start-up check gives up at the tool's deadline")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("scontrol show partition --oneliner ondemand")
            && e.contains("did not answer within 1 s (tool_timeout_secs)"),
        "{e}"
    );
    wait_gone(&bin.path().join("scontrol.pids")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_queued_by_an_sbatch_whose_answer_was_lost_is_cancelled_by_name() {
    let slurm = MiniSlurm::start();
    let out = tempfile::tempdir().unwrap();
    let bin = real_tools_but(out.path(), "sbatch");
    // Slurm's sbatch queues the job; then its answer never comes
    let sbatch = format!(
        "{} \"$@\" > \"$(dirname \"$0\")/sbatch.out\"\n{}",
        installed("sbatch").display(),
        hung("sbatch")
    );
    fake_tool(&bin, "sbatch", &sbatch);
    let mut cfg = config(&slurm, out.path(), WORKER);
    cfg.bin_dir = Some(bin.clone());
    cfg.tool_timeout_secs = 5.0;
    let mut p = SlurmProvider::connect(cfg).await.unwrap();
    let e = tokio::time::timeout(GUARD, p.acquire(spec(1, Tier::OnDemand, "h100")))
        .await
        .expect("the acquire gives up at the tool's deadline")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("did not answer within 5 s (tool_timeout_secs)"),
        "{e}"
    );
    let queued = std::fs::read_to_string(bin.join("sbatch.out"))
        .expect("Slurm's sbatch answered the stand-in within the deadline");
    let job: u64 = queued.trim().split(';').next().unwrap().parse().unwrap();
    wait_gone(&bin.join("sbatch.pids")).await;
    // nobody knows its id, but its name says whose it is
    wait_for(
        "the job whose answer was lost to be cancelled",
        || slurm.logs(),
        || !slurm.live_jobs().contains(&job),
    )
    .await;
    assert!(p.held().is_empty());
    assert!(slurm.live_jobs().is_empty(), "{:?}", slurm.live_jobs());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_the_controller_queues_after_its_sbatch_gave_up_is_cancelled_when_it_appears() {
    let slurm = MiniSlurm::start();
    let out = tempfile::tempdir().unwrap();
    let bin = real_tools_but(out.path(), "sbatch");
    // the request waits in a busy controller's queue: Slurm's sbatch
    // queues the job 4 s later, well after the stand-in was killed at its
    // deadline and the provider's cancel by name found nothing
    let sbatch = format!(
        "d=\"$(dirname \"$0\")\"\ncat > \"$d/job.sh\"\n\
         ( sleep 4; {} \"$@\" < \"$d/job.sh\" > \"$d/sbatch.tmp\" && mv \"$d/sbatch.tmp\" \"$d/sbatch.out\" ) < /dev/null > /dev/null 2>&1 &\n{}",
        installed("sbatch").display(),
        hung("sbatch")
    );
    fake_tool(&bin, "sbatch", &sbatch);
    let mut cfg = config(&slurm, out.path(), WORKER);
    cfg.bin_dir = Some(bin.clone());
    cfg.job_name = "tg-late".into();
    cfg.tool_timeout_secs = 1.0;
    let mut p = SlurmProvider::connect(cfg).await.unwrap();
    let e = tokio::time::timeout(GUARD, p.acquire(spec(1, Tier::OnDemand, "h100")))
        .await
        .expect("the acquire gives up at the tool's deadline")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("did not answer within 1 s (tool_timeout_secs)"),
        "{e}"
    );
    assert!(
        !bin.join("sbatch.out").exists(),
        "queued before the deadline"
    );
    assert!(p.held().is_empty());
    wait_for(
        "Slurm's sbatch to queue the job late",
        || slurm.logs(),
        || bin.join("sbatch.out").exists(),
    )
    .await;
    let text = std::fs::read_to_string(bin.join("sbatch.out")).unwrap();
    let job: u64 = text.trim().split(';').next().unwrap().parse().unwrap();
    // the poller finds it by its name and cancels it
    wait_for(
        "the job queued after its acquire gave up to be cancelled",
        || slurm.logs(),
        || !slurm.live_jobs().contains(&job),
    )
    .await;
    assert_eq!(
        slurm.job_state(job).as_deref(),
        Some("CANCELLED"),
        "{}",
        slurm.logs()
    );
    assert!(p.held().is_empty());
}
