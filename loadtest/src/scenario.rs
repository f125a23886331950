//! Load-test scenarios: phases of load run one after another against the
//! same gateway (a quiet start, a rush, a spike, a model mix), each with its
//! own report and SLO gate.
//!
//! ```toml
//! name = "rush hour"
//! min_slo_attainment = 0.95        # every phase's gate unless it sets its own
//!
//! [[phases]]
//! name = "quiet"
//! seconds = 5
//! cameras = 4
//! fps = 5
//!
//! [[phases]]
//! name = "rush"
//! seconds = 10
//! cameras = 24
//! fps = 20
//! model = "blazeface"              # default: the command line's --model
//! budget_ms = 80                   # default: --budget-ms
//! min_slo_attainment = 0.8
//! ignore_hints = false             # default: --ignore-hints
//! ```
//!
//! Every bound is checked when the file is read, before anything starts.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::loadgen::{FPS_RANGE, LoadOptions};
use crate::report::Report;

/// Most phases in a scenario.
pub const MAX_PHASES: usize = 32;
/// Longest phase (s), as for a single run.
pub const MAX_PHASE_SECONDS: f64 = 600.0;
/// Longest scenario, all phases together (s).
pub const MAX_TOTAL_SECONDS: f64 = 3600.0;
/// Most cameras in a phase.
pub const MAX_CAMERAS: usize = 1024;

/// A scenario file.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// Its name, for the report (default: the file's stem).
    #[serde(default)]
    pub name: Option<String>,
    /// The gate of every phase that sets none.
    #[serde(default)]
    pub min_slo_attainment: Option<f64>,
    /// The phases, in order.
    pub phases: Vec<Phase>,
}

/// One phase of load.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Phase {
    /// Its name, unique in the scenario.
    pub name: String,
    /// How long it sends (s).
    pub seconds: f64,
    /// Simulated cameras.
    pub cameras: usize,
    /// Frames per second per camera.
    pub fps: f64,
    /// The model (default: the command line's).
    #[serde(default)]
    pub model: Option<String>,
    /// The budget per frame (ms; default: the command line's).
    #[serde(default)]
    pub budget_ms: Option<u32>,
    /// The fraction of frames tried that must be ok within budget.
    #[serde(default)]
    pub min_slo_attainment: Option<f64>,
    /// Cameras ignore the gateway's frame-rate hints (default: the command
    /// line's).
    #[serde(default)]
    pub ignore_hints: Option<bool>,
}

/// Why a scenario cannot be run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ScenarioError {
    /// The file could not be read.
    #[error("reading scenario {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not a scenario.
    #[error("scenario {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What the TOML parser said.
        message: String,
    },
    /// A value is out of bounds.
    #[error("scenario {path}: {message}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong, naming the phase and field.
        message: String,
    },
}

impl Scenario {
    /// Reads and checks `path`.
    pub fn load(path: &Path) -> Result<Scenario, ScenarioError> {
        let text = std::fs::read_to_string(path).map_err(|source| ScenarioError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let mut s: Scenario = toml::from_str(&text).map_err(|e| ScenarioError::Parse {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        if s.name.is_none() {
            s.name = path.file_stem().map(|n| n.to_string_lossy().into_owned());
        }
        s.validate().map_err(|message| ScenarioError::Invalid {
            path: path.to_path_buf(),
            message,
        })?;
        Ok(s)
    }

    /// Checks every bound; the message names the phase and the field.
    pub fn validate(&self) -> Result<(), String> {
        if self.phases.is_empty() || self.phases.len() > MAX_PHASES {
            return Err(format!(
                "it has {} phases; give 1 to {MAX_PHASES} [[phases]]",
                self.phases.len()
            ));
        }
        let fraction = |v: Option<f64>, what: &str| match v {
            Some(f) if !(0.0..=1.0).contains(&f) => {
                Err(format!("{what} = {f} is not a fraction in [0, 1]"))
            }
            _ => Ok(()),
        };
        fraction(self.min_slo_attainment, "min_slo_attainment")?;
        let mut names = BTreeSet::new();
        let mut total = 0.0;
        for p in &self.phases {
            let n = &p.name;
            if n.is_empty() || !names.insert(n.as_str()) {
                return Err(format!(
                    "phase name {n:?} is empty or used twice; name each phase once"
                ));
            }
            if !(p.seconds > 0.0 && p.seconds <= MAX_PHASE_SECONDS) {
                return Err(format!(
                    "phase {n:?}: seconds = {} is not in (0, {MAX_PHASE_SECONDS}]",
                    p.seconds
                ));
            }
            if !FPS_RANGE.contains(&p.fps) {
                return Err(format!(
                    "phase {n:?}: fps = {} is not in [{}, {}]",
                    p.fps,
                    FPS_RANGE.start(),
                    FPS_RANGE.end()
                ));
            }
            if !(1..=MAX_CAMERAS).contains(&p.cameras) {
                return Err(format!(
                    "phase {n:?}: cameras = {} is not in 1..={MAX_CAMERAS}",
                    p.cameras
                ));
            }
            if p.budget_ms == Some(0) {
                return Err(format!("phase {n:?}: budget_ms must be at least 1"));
            }
            if p.model.as_deref() == Some("") {
                return Err(format!("phase {n:?}: model is empty"));
            }
            fraction(
                p.min_slo_attainment,
                &format!("phase {n:?}: min_slo_attainment"),
            )?;
            total += p.seconds;
        }
        if total > MAX_TOTAL_SECONDS {
            return Err(format!(
                "its phases last {total} s together; at most {MAX_TOTAL_SECONDS} s"
            ));
        }
        Ok(())
    }

    /// Every model the phases use, `default` for those that name none.
    pub fn models(&self, default: &str) -> Vec<String> {
        let all: BTreeSet<&str> = self
            .phases
            .iter()
            .map(|p| p.model.as_deref().unwrap_or(default))
            .collect();
        all.into_iter().map(String::from).collect()
    }

    /// The options of phase `p`, from `base` (the command line's).
    pub fn options(&self, p: &Phase, base: &LoadOptions) -> LoadOptions {
        LoadOptions {
            cameras: p.cameras,
            fps: p.fps,
            duration: Duration::from_secs_f64(p.seconds),
            model: p.model.clone().unwrap_or_else(|| base.model.clone()),
            budget_ms: p.budget_ms.unwrap_or(base.budget_ms),
            obey_hints: p.ignore_hints.map_or(base.obey_hints, |i| !i),
            encoding: base.encoding,
            congestion: base.congestion,
            copies: base.copies,
            in_step: base.in_step,
            ..base.clone()
        }
    }

    /// The gate of phase `p`: its own, else the scenario's, else `default`.
    pub fn gate(&self, p: &Phase, default: Option<f64>) -> Option<f64> {
        p.min_slo_attainment.or(self.min_slo_attainment).or(default)
    }
}

/// One phase's outcome.
#[derive(Debug, Clone, Serialize)]
pub struct PhaseReport {
    /// The phase.
    pub name: String,
    /// The model it sent to.
    pub model: String,
    /// Its gate, if any.
    pub min_slo_attainment: Option<f64>,
    /// Why its gate failed (empty: it passed, or there is none; a frame
    /// with two results always fails).
    pub slo_failures: Vec<String>,
    /// What it measured.
    pub report: Report,
}

impl PhaseReport {
    /// The report of phase `name` on `model`, judged against `gate`.
    pub fn new(name: &str, model: &str, gate: Option<f64>, report: Report) -> PhaseReport {
        PhaseReport {
            name: name.to_string(),
            model: model.to_string(),
            min_slo_attainment: gate,
            slo_failures: report.slo_failures(gate.unwrap_or(0.0)),
            report,
        }
    }
}

/// The whole scenario's outcome.
#[derive(Debug, Clone, Serialize)]
pub struct ScenarioReport {
    /// The scenario's name.
    pub scenario: String,
    /// Whether every phase passed its gate.
    pub passed: bool,
    /// Each phase, in order.
    pub phases: Vec<PhaseReport>,
}

impl ScenarioReport {
    /// The report of `phases`.
    pub fn new(scenario: &str, phases: Vec<PhaseReport>) -> ScenarioReport {
        ScenarioReport {
            scenario: scenario.to_string(),
            passed: phases.iter().all(|p| p.slo_failures.is_empty()),
            phases,
        }
    }

    /// One line per failed phase: its name and why.
    pub fn failures(&self) -> Vec<String> {
        self.phases
            .iter()
            .filter(|p| !p.slo_failures.is_empty())
            .map(|p| format!("phase {:?}: {}", p.name, p.slo_failures.join("; ")))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TWO: &str = r#"
        min_slo_attainment = 0.9
        [[phases]]
        name = "quiet"
        seconds = 2
        cameras = 2
        fps = 5
        [[phases]]
        name = "rush"
        seconds = 3
        cameras = 16
        fps = 20
        model = "centernet"
        budget_ms = 120
        min_slo_attainment = 0.5
        ignore_hints = true
    "#;

    fn parse(text: &str) -> Scenario {
        toml::from_str(text).unwrap()
    }

    fn base() -> LoadOptions {
        LoadOptions {
            gateway: "127.0.0.1:4433".parse().unwrap(),
            server_name: "localhost".into(),
            ca: "ca.pem".into(),
            edge: "edge-1".into(),
            token: "t".into(),
            cameras: 1,
            fps: 1.0,
            duration: Duration::from_secs(1),
            model: "blazeface".into(),
            budget_ms: 80,
            image: None,
            obey_hints: true,
            encoding: tidegate_protocol::Encoding::Raw,
            congestion: tidegate_protocol::quic::Congestion::default(),
            copies: 1,
            in_step: false,
        }
    }

    #[test]
    fn phases_take_the_command_line_for_what_they_leave_out() {
        let s = parse(TWO);
        s.validate().unwrap();
        assert_eq!(s.models("blazeface"), vec!["blazeface", "centernet"]);
        let (quiet, rush) = (&s.phases[0], &s.phases[1]);
        let q = s.options(quiet, &base());
        assert_eq!((q.cameras, q.fps, q.model.as_str()), (2, 5.0, "blazeface"));
        assert_eq!((q.budget_ms, q.obey_hints), (80, true));
        assert_eq!(q.duration, Duration::from_secs(2));
        let r = s.options(rush, &base());
        assert_eq!(
            (r.model.as_str(), r.budget_ms, r.obey_hints),
            ("centernet", 120, false)
        );
        assert_eq!(s.gate(quiet, Some(0.1)), Some(0.9), "the scenario's gate");
        assert_eq!(s.gate(rush, Some(0.1)), Some(0.5), "the phase's own");
        let no_gate = parse("[[phases]]\nname = \"a\"\nseconds = 1\ncameras = 1\nfps = 1\n");
        assert_eq!(no_gate.gate(&no_gate.phases[0], None), None);
        assert_eq!(no_gate.gate(&no_gate.phases[0], Some(0.3)), Some(0.3));
    }

    #[test]
    fn every_bound_is_checked_naming_the_phase_and_field() {
        let phase = |extra: &str| {
            format!("[[phases]]\nname = \"p\"\nseconds = 1\ncameras = 1\nfps = 1\n{extra}")
        };
        for (text, says) in [
            ("phases = []".to_string(), "1 to 32"),
            (
                phase("").replace("seconds = 1", "seconds = 0"),
                "seconds = 0",
            ),
            (
                phase("").replace("seconds = 1", "seconds = 601"),
                "seconds = 601",
            ),
            (phase("").replace("fps = 1", "fps = 1001"), "fps = 1001"),
            (
                phase("").replace("fps = 1", "fps = 0.0001"),
                "fps = 0.0001 is not in [0.001, 1000]",
            ),
            (
                phase("").replace("cameras = 1", "cameras = 0"),
                "cameras = 0",
            ),
            (phase("budget_ms = 0"), "budget_ms"),
            (phase("model = \"\""), "model is empty"),
            (phase("min_slo_attainment = 1.5"), "not a fraction"),
            (
                format!("min_slo_attainment = -1\n{}", phase("")),
                "not a fraction",
            ),
            (format!("{}{}", phase(""), phase("")), "used twice"),
            (
                (0..7)
                    .map(|i| {
                        phase("")
                            .replace("\"p\"", &format!("\"p{i}\""))
                            .replace("seconds = 1", "seconds = 600")
                    })
                    .collect::<String>(),
                "at most 3600",
            ),
        ] {
            let err = parse(&text).validate().unwrap_err();
            assert!(err.contains(says), "{text}: {err}");
        }
        let err = toml::from_str::<Scenario>(&phase("fsp = 3")).unwrap_err();
        assert!(err.to_string().contains("fsp"), "{err}");
    }

    #[test]
    fn a_file_is_named_by_its_stem_and_its_errors_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("night-shift.toml");
        std::fs::write(&path, TWO).unwrap();
        assert_eq!(
            Scenario::load(&path).unwrap().name.as_deref(),
            Some("night-shift")
        );
        std::fs::write(&path, "[[phases]]\nname = \"p\"\n").unwrap();
        let err = Scenario::load(&path).unwrap_err().to_string();
        assert!(
            err.contains("night-shift.toml") && err.contains("seconds"),
            "{err}"
        );
        let err = Scenario::load(&dir.path().join("none.toml"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("none.toml"), "{err}");
    }

    #[test]
    fn the_scenario_passes_only_when_every_phase_does() {
        let ok = Report {
            sent: 10,
            ok: 10,
            ok_within_budget: 10,
            slo_attainment: 1.0,
            ..Report::default()
        };
        let late = Report {
            slo_attainment: 0.2,
            sent: 10,
            ok_within_budget: 2,
            ..Report::default()
        };
        let r = ScenarioReport::new(
            "s",
            vec![
                PhaseReport::new("a", "m", Some(0.9), ok.clone()),
                PhaseReport::new("b", "m", None, late.clone()),
            ],
        );
        assert!(r.passed && r.failures().is_empty(), "{r:?}");
        let r = ScenarioReport::new(
            "s",
            vec![
                PhaseReport::new("a", "m", Some(0.9), ok),
                PhaseReport::new("b", "m", Some(0.5), late),
            ],
        );
        assert!(!r.passed);
        let f = r.failures();
        assert_eq!(f.len(), 1);
        assert!(
            f[0].starts_with("phase \"b\": attainment 0.2000 < 0.5"),
            "{f:?}"
        );
    }
}
