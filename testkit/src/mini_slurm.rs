//! A private, real Slurm cluster on this host for tests: `munged`,
//! `slurmctld` and `slurmd` (Debian's Slurm 22.05, installed by
//! `scripts/setup.sh`) in a temporary folder, on free 127.0.0.1 ports.
//!
//! One node, `tg1`, with 2 CPUs and 2 GPUs (`gres/gpu` backed by
//! `/dev/null` and `/dev/zero`: Slurm only counts and assigns them), and
//! three partitions: `ondemand` (never preempted), `spot` (preempted by
//! `ondemand` with `PreemptMode=CANCEL` and `GraceTime=3`, so its jobs get
//! SIGTERM, then SIGKILL 3 s later) and `spotrq` (the same with
//! `PreemptMode=REQUEUE`: a preempted job goes back to the queue).
//! Dropping it cancels every job, then stops the daemons. Used by
//! `lease/tests/slurm_provider.rs` and `loadtest/tests/slurm_leasing.rs`.
//! Feature `slurm`.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Seconds a preempted spot job has before it is killed.
pub const GRACE_SECS: u64 = 3;
/// How long the cluster may take to come up (a guard against a hang).
const START_GUARD: Duration = Duration::from_secs(60);

/// A running test cluster.
#[derive(Debug)]
pub struct MiniSlurm {
    dir: tempfile::TempDir,
    daemons: Vec<(&'static str, Child)>,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port on 127.0.0.1")
}

fn require(tool: &str) -> PathBuf {
    for dir in ["/usr/sbin", "/usr/bin", "/sbin", "/bin"] {
        let p = Path::new(dir).join(tool);
        if p.exists() {
            return p;
        }
    }
    panic!(
        "{tool} is not installed; the Slurm tests need Debian's slurmctld, slurmd, slurm-client \
         and munge packages: run scripts/setup.sh"
    );
}

impl MiniSlurm {
    /// Starts the cluster and waits until its node is idle.
    pub fn start() -> MiniSlurm {
        let dir = tempfile::Builder::new()
            .prefix("tidegate-slurm-")
            .tempdir()
            .expect("temp dir");
        let d = dir.path().to_path_buf();
        for sub in ["state", "spool", "log"] {
            std::fs::create_dir(d.join(sub)).expect("cluster folders");
        }
        set_mode(&d, 0o700);
        // munge: a fresh key, a private socket
        let mut key = vec![0u8; 1024];
        use std::io::Read;
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut key))
            .expect("random munge key");
        std::fs::write(d.join("munge.key"), &key).expect("munge key");
        set_mode(&d.join("munge.key"), 0o600);
        for (i, dev) in ["/dev/null", "/dev/zero"].iter().enumerate() {
            std::os::unix::fs::symlink(dev, d.join(format!("gpu{i}"))).expect("gpu device link");
        }
        let (ctl_port, d_port) = (free_port(), free_port());
        let name = format!("tg{}", std::process::id() % 100_000);
        // the daemons run as whoever runs the tests (root in CI)
        let user = Command::new("id")
            .arg("-un")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .ok()
            .filter(|u| !u.is_empty())
            .unwrap_or_else(|| "root".into());
        std::fs::write(
            d.join("slurm.conf"),
            format!(
                "ClusterName={name}
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctl_port}
SlurmdPort={d_port}
AuthType=auth/munge
AuthInfo=socket={d}/munge.sock
CredType=cred/munge
SlurmUser={user}
SlurmdUser={user}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
KillWait=5
MinJobAge=300
GresTypes=gpu
PreemptType=preempt/partition_prio
PreemptMode=CANCEL
NodeName=tg1 NodeHostname=localhost NodeAddr=127.0.0.1 CPUs=2 RealMemory=1000 Gres=gpu:2 State=UNKNOWN
PartitionName=ondemand Nodes=tg1 PriorityTier=10 PreemptMode=OFF Default=YES MaxTime=INFINITE State=UP
PartitionName=spot Nodes=tg1 PriorityTier=1 PreemptMode=CANCEL GraceTime={GRACE_SECS} MaxTime=INFINITE State=UP
PartitionName=spotrq Nodes=tg1 PriorityTier=1 PreemptMode=REQUEUE GraceTime={GRACE_SECS} MaxTime=INFINITE State=UP
",
                d = d.display()
            ),
        )
        .expect("slurm.conf");
        std::fs::write(
            d.join("gres.conf"),
            format!("NodeName=tg1 Name=gpu File={}/gpu[0-1]\n", d.display()),
        )
        .expect("gres.conf");
        let mut cluster = MiniSlurm {
            dir,
            daemons: Vec::new(),
        };
        let munged = require("munged");
        cluster.spawn(
            "munged",
            Command::new(munged).args([
                "--foreground",
                "--force",
                &format!("--socket={}/munge.sock", d.display()),
                &format!("--key-file={}/munge.key", d.display()),
                &format!("--pid-file={}/munged.pid", d.display()),
                &format!("--log-file={}/log/munged.log", d.display()),
                &format!("--seed-file={}/munged.seed", d.display()),
            ]),
        );
        cluster.wait_for("munge socket", |_| d.join("munge.sock").exists());
        let ctld = require("slurmctld");
        cluster.spawn("slurmctld", Command::new(ctld).args(["-D", "-i"]));
        let slurmd = require("slurmd");
        cluster.spawn("slurmd", Command::new(slurmd).args(["-D", "-N", "tg1"]));
        cluster.wait_for("node tg1 idle", |cluster| {
            let states = cluster
                .tool("sinfo", &["--noheader", "--Node", "--format=%t"])
                .unwrap_or_default();
            let states: Vec<&str> = states.split_whitespace().collect();
            if states
                .iter()
                .any(|s| ["inval", "drain", "down"].iter().any(|b| s.starts_with(b)))
            {
                let _ = cluster.tool("scontrol", &["update", "nodename=tg1", "state=resume"]);
            }
            !states.is_empty() && states.iter().all(|s| *s == "idle")
        });
        cluster
    }

    fn spawn(&mut self, name: &'static str, cmd: &mut Command) {
        let log = std::fs::File::create(self.path().join(format!("log/{name}.stderr")))
            .expect("daemon log");
        let child = cmd
            .env("SLURM_CONF", self.conf())
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {name}: {e}"));
        self.daemons.push((name, child));
    }

    fn wait_for(&mut self, what: &str, mut ready: impl FnMut(&MiniSlurm) -> bool) {
        let until = Instant::now() + START_GUARD;
        while !ready(self) {
            let dead = self
                .daemons
                .iter_mut()
                .find_map(|(name, child)| child.try_wait().ok().flatten().map(|s| (*name, s)));
            if let Some((name, status)) = dead {
                panic!(
                    "{name} exited ({status}) while waiting for {what}:\n{}",
                    self.logs()
                );
            }
            assert!(
                Instant::now() < until,
                "the test Slurm cluster is not up ({what}) after {START_GUARD:?}:\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Its folder.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Its `slurm.conf` (what `SLURM_CONF` must name).
    pub fn conf(&self) -> PathBuf {
        self.path().join("slurm.conf")
    }

    /// Runs a Slurm tool against this cluster: its stdout, or its stderr.
    pub fn tool(&self, tool: &str, args: &[&str]) -> Result<String, String> {
        let out = Command::new(require(tool))
            .args(args)
            .env("SLURM_CONF", self.conf())
            .env("TZ", "UTC")
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("{tool}: {e}"))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(format!(
                "{tool} {args:?}: {}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        }
    }

    /// A job's state (`RUNNING`, `PREEMPTED`, …), if Slurm knows it.
    pub fn job_state(&self, job: u64) -> Option<String> {
        self.tool(
            "squeue",
            &[
                "--noheader",
                "--states=all",
                &format!("--jobs={job}"),
                "--format=%T",
            ],
        )
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
    }

    /// Ids of the jobs that are pending, running or completing.
    pub fn live_jobs(&self) -> Vec<u64> {
        self.tool("squeue", &["--noheader", "--format=%i"])
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }

    /// The daemons' logs and the jobs' output (`job-*.out` in its folder),
    /// for a failure message.
    pub fn logs(&self) -> String {
        let mut out = String::new();
        let mut jobs: Vec<PathBuf> = std::fs::read_dir(self.path())
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        jobs.retain(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("job-"))
        });
        jobs.sort();
        for p in jobs {
            let text = std::fs::read_to_string(&p).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(15).collect();
            out.push_str(&format!("--- {}\n", p.display()));
            for l in tail.into_iter().rev() {
                out.push_str(l);
                out.push('\n');
            }
        }
        for name in [
            "munged.log",
            "slurmctld.log",
            "slurmd.log",
            "slurmctld.stderr",
            "slurmd.stderr",
        ] {
            let text =
                std::fs::read_to_string(self.path().join("log").join(name)).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(15).collect();
            out.push_str(&format!("--- {name}\n"));
            for l in tail.into_iter().rev() {
                out.push_str(l);
                out.push('\n');
            }
        }
        out
    }
}

fn set_mode(p: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).expect("chmod");
}

impl Drop for MiniSlurm {
    fn drop(&mut self) {
        // jobs first: their step daemons outlive slurmd by design
        if !self.live_jobs().is_empty() {
            let _ = self.tool("scancel", &["--full", "--partition=ondemand,spot,spotrq"]);
            let until = Instant::now() + Duration::from_secs(15);
            while !self.live_jobs().is_empty() && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        for (_, child) in self.daemons.iter_mut().rev() {
            let _ = tidegate_kit::signal::terminate(child.id());
            let until = Instant::now() + Duration::from_secs(5);
            while matches!(child.try_wait(), Ok(None)) && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
