//! Helpers for end-to-end tests of the real `tidegate-edge` binary against a
//! [`Cluster`]: test videos made with `gst-launch-1.0`, edge configs with
//! every camera option, and a running edge process whose results, counters
//! and memory the test can read.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::cluster::{BinaryNotFound, Cluster, command};

/// Why an edge-harness operation (making a test video, writing an edge
/// config, starting an edge, reading its memory, waiting for its results or
/// its exit) failed. An error about a running edge carries its log.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum EdgeHarnessError {
    /// `gst-launch-1.0` could not be run.
    #[error("running gst-launch-1.0 (install gstreamer1.0-tools: make setup): {source}")]
    Gstreamer {
        /// The I/O error.
        source: std::io::Error,
    },
    /// `gst-launch-1.0` ran and did not write the video.
    #[error(
        "gst-launch-1.0 could not write {out}: {status}; check that x264enc (gstreamer1.0-plugins-ugly) is installed"
    )]
    Encode {
        /// The video it was to write.
        out: PathBuf,
        /// How it exited.
        status: ExitStatus,
    },
    /// A config or log file could not be written.
    #[error("cannot write {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// `tidegate-edge` is not built.
    #[error(transparent)]
    Binary(#[from] BinaryNotFound),
    /// `tidegate-edge` could not be started.
    #[error("starting tidegate-edge: {source}")]
    Spawn {
        /// The I/O error.
        source: std::io::Error,
    },
    /// The edge's /proc status could not be read (has it exited?).
    #[error("reading /proc/{pid}/status of the edge: {source}; has it exited?")]
    ProcStatus {
        /// The edge's process id.
        pid: u32,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The edge's /proc status has no VmRSS line.
    #[error("no VmRSS line in /proc/{pid}/status of the edge; is it a zombie?")]
    NoRss {
        /// The edge's process id.
        pid: u32,
    },
    /// The results waited for did not come in time.
    #[error("{what}: not within {timeout:?} ({results} results); edge log:\n{log}")]
    ResultsTimeout {
        /// What was waited for.
        what: String,
        /// How long.
        timeout: Duration,
        /// Results by then.
        results: usize,
        /// The edge's log.
        log: String,
    },
    /// An edge started with `--metrics-listen` never said where.
    #[error("the edge did not print `metrics listening on ADDR` within {timeout:?}; log:\n{log}")]
    NoMetricsAddr {
        /// How long.
        timeout: Duration,
        /// The edge's log.
        log: String,
    },
    /// The edge's state could not be read.
    #[error("waiting for the edge to exit: {source}")]
    Wait {
        /// The I/O error.
        source: std::io::Error,
    },
    /// The edge did not exit in time; it has been killed.
    #[error("edge did not exit within {timeout:?} of {what}; log:\n{log}")]
    ExitTimeout {
        /// What it should have exited on.
        what: String,
        /// How long it was given.
        timeout: Duration,
        /// The edge's log.
        log: String,
    },
}

debug_as_display!(EdgeHarnessError);

/// Encodes `image` (a PNG) as an H.264 MP4 of `frames` frames at `fps`
/// with `gst-launch-1.0` (x264enc from gst-plugins-ugly).
pub fn h264_mp4_from_png(
    image: &Path,
    out: &Path,
    frames: u32,
    fps: u32,
) -> Result<(), EdgeHarnessError> {
    let status = Command::new("gst-launch-1.0")
        .arg("-q")
        .args(["filesrc", &format!("location={}", image.display())])
        .args(["!", "pngdec", "!", "videoconvert", "!"])
        .args(["imagefreeze", &format!("num-buffers={frames}")])
        .args(["!", &format!("video/x-raw,framerate={fps}/1")])
        .args(["!", "videoconvert", "!", "video/x-raw,format=I420"])
        .args(["!", "x264enc", "speed-preset=ultrafast", "key-int-max=10"])
        .args(["!", "mp4mux", "!", "filesink"])
        .arg(format!("location={}", out.display()))
        .stdout(Stdio::null())
        .status()
        .map_err(|source| EdgeHarnessError::Gstreamer { source })?;
    if !status.success() {
        return Err(EdgeHarnessError::Encode {
            out: out.to_path_buf(),
            status,
        });
    }
    Ok(())
}

/// One `[[cameras]]` entry: the fields, as TOML values, beyond the name.
#[derive(Debug, Clone)]
pub struct EdgeCamera {
    /// Camera name.
    pub name: String,
    /// Extra TOML lines (`uri = "..."`, `model = "..."`, `max_fps = 10`, ...).
    pub fields: Vec<String>,
}

impl EdgeCamera {
    /// A camera with `uri`, `model` and `max_fps`.
    pub fn new(name: &str, uri: &str, model: &str, max_fps: f64) -> Self {
        EdgeCamera {
            name: name.into(),
            fields: vec![
                format!("uri = \"{uri}\""),
                format!("model = \"{model}\""),
                format!("max_fps = {max_fps}"),
            ],
        }
    }
}

/// Writes an edge config for `cluster` named `name` with `cameras`.
pub fn edge_config(
    cluster: &Cluster,
    name: &str,
    cameras: &[EdgeCamera],
) -> Result<PathBuf, EdgeHarnessError> {
    edge_config_via(cluster, name, cameras, cluster.quic)
}

/// [`edge_config`] with the edge sent to `gateway` instead of the
/// cluster's QUIC port: a relay in front of it (an impaired link, see
/// [`crate::impair`]). The certificate is still the cluster gateway's.
pub fn edge_config_via(
    cluster: &Cluster,
    name: &str,
    cameras: &[EdgeCamera],
    gateway: SocketAddr,
) -> Result<PathBuf, EdgeHarnessError> {
    edge_config_with(cluster, name, cameras, gateway, &[])
}

/// [`edge_config_via`] with more `[gateway]` fields, as TOML lines
/// (`congestion = "bbr"`).
pub fn edge_config_with(
    cluster: &Cluster,
    name: &str,
    cameras: &[EdgeCamera],
    gateway: SocketAddr,
    gateway_fields: &[String],
) -> Result<PathBuf, EdgeHarnessError> {
    let mut toml = format!(
        "name = \"{name}\"\n[gateway]\naddr = \"{gateway}\"\nca = \"{}\"\n",
        cluster.ca().display()
    );
    for f in gateway_fields {
        toml += f;
        toml.push('\n');
    }
    for c in cameras {
        toml += &format!("[[cameras]]\nname = \"{}\"\n", c.name);
        for f in &c.fields {
            toml += f;
            toml.push('\n');
        }
    }
    let path = cluster.dir().join(format!("{name}.toml"));
    std::fs::write(&path, toml).map_err(|source| EdgeHarnessError::Write {
        path: path.clone(),
        source,
    })?;
    Ok(path)
}

/// A running `tidegate-edge`, killed on drop.
#[derive(Debug)]
pub struct EdgeProcess {
    child: Child,
    results: PathBuf,
    log: PathBuf,
}

impl EdgeProcess {
    /// Starts the edge with `config`, results appended to a file in the
    /// cluster's directory and counters printed every second to its log.
    pub fn spawn(
        cluster: &Cluster,
        config: &Path,
        args: &[&str],
    ) -> Result<Self, EdgeHarnessError> {
        let stem = config
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "edge".into());
        let results = cluster.dir().join(format!("{stem}.results.jsonl"));
        let log = cluster.dir().join(format!("{stem}.log"));
        let stderr = std::fs::File::create(&log).map_err(|source| EdgeHarnessError::Write {
            path: log.clone(),
            source,
        })?;
        let child = command("tidegate-edge")?
            .arg("--config")
            .arg(config)
            .arg("--results")
            .arg(&results)
            .args(["--summary-every", "1"])
            .args(args)
            .env("TIDEGATE_EDGE_TOKEN", &cluster.edge_token)
            .env("TIDEGATE_LOG", "info")
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .map_err(|source| EdgeHarnessError::Spawn { source })?;
        Ok(EdgeProcess {
            child,
            results,
            log,
        })
    }

    /// Edge `edge-1` of `cluster` with one BlazeFace camera, `ball`, on a
    /// 320×240 `test://` source at 10 fps, serving `/metrics` on a free
    /// port of 127.0.0.1 (its address: [`EdgeProcess::metrics_addr`]).
    pub fn spawn_ball_with_metrics(cluster: &Cluster) -> Result<Self, EdgeHarnessError> {
        let cfg = edge_config(
            cluster,
            "edge-1",
            &[EdgeCamera::new(
                "ball",
                "test://ball?width=320&height=240",
                "blazeface",
                10.0,
            )],
        )?;
        Self::spawn(cluster, &cfg, &["--metrics-listen", "127.0.0.1:0"])
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Resident memory (VmRSS) in KiB, from /proc.
    pub fn rss_kib(&self) -> Result<u64, EdgeHarnessError> {
        let pid = self.pid();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
            .map_err(|source| EdgeHarnessError::ProcStatus { pid, source })?;
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .ok_or(EdgeHarnessError::NoRss { pid })
    }

    /// Every result so far, one JSON value per line.
    pub fn results(&self) -> Vec<serde_json::Value> {
        let Ok(f) = std::fs::File::open(&self.results) else {
            return Vec::new();
        };
        BufReader::new(f)
            .lines()
            .map_while(Result::ok)
            .filter_map(|l| serde_json::from_str(&l).ok())
            .collect()
    }

    /// Its stderr so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Where an edge started with `--metrics-listen` serves `/metrics`,
    /// read from its `metrics listening on ADDR` line within `timeout`.
    pub fn metrics_addr(&self, timeout: Duration) -> Result<SocketAddr, EdgeHarnessError> {
        crate::cluster::metrics_addr_in(|| self.log(), timeout)
            .map_err(|log| EdgeHarnessError::NoMetricsAddr { timeout, log })
    }

    /// The latest `camera_stats` line of each camera.
    pub fn camera_stats(&self) -> std::collections::BTreeMap<String, serde_json::Value> {
        let mut out = std::collections::BTreeMap::new();
        for line in self.log().lines() {
            if let Some(json) = line.strip_prefix("camera_stats ")
                && let Ok(v) = serde_json::from_str::<serde_json::Value>(json)
                && let Some(name) = v["camera"].as_str()
            {
                out.insert(name.to_string(), v.clone());
            }
        }
        out
    }

    /// Waits until `pred(results)` holds, or fails after `timeout` with the
    /// edge's log.
    pub fn wait_for_results(
        &self,
        timeout: Duration,
        what: &str,
        pred: impl Fn(&[serde_json::Value]) -> bool,
    ) -> Result<Vec<serde_json::Value>, EdgeHarnessError> {
        let until = Instant::now() + timeout;
        loop {
            let r = self.results();
            if pred(&r) {
                return Ok(r);
            }
            if Instant::now() > until {
                return Err(EdgeHarnessError::ResultsTimeout {
                    what: what.into(),
                    timeout,
                    results: r.len(),
                    log: self.log(),
                });
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Sends SIGTERM and waits (bounded) for the edge to exit.
    pub fn terminate(&mut self, timeout: Duration) -> Result<ExitStatus, EdgeHarnessError> {
        // Gone already: waiting tells how it ended.
        let _ = tidegate_kit::signal::terminate(self.pid());
        self.wait_exit(timeout, "SIGTERM")
    }

    /// Waits (bounded) for the edge to exit by itself; on timeout it is
    /// killed and the error names `what` it was waiting for.
    pub fn wait_exit(
        &mut self,
        timeout: Duration,
        what: &str,
    ) -> Result<ExitStatus, EdgeHarnessError> {
        let until = Instant::now() + timeout;
        loop {
            let exited = self
                .child
                .try_wait()
                .map_err(|source| EdgeHarnessError::Wait { source })?;
            if let Some(status) = exited {
                return Ok(status);
            }
            if Instant::now() > until {
                let _ = self.child.kill();
                return Err(EdgeHarnessError::ExitTimeout {
                    what: what.into(),
                    timeout,
                    log: self.log(),
                });
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for EdgeProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Microseconds since the UNIX epoch now, the edge clock's anchor.
pub fn epoch_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}
