//! Prometheus's tools for the tests that check rules and dashboards: the
//! `promtool` and `prometheus` binaries that `scripts/setup.sh` unpacks
//! from Debian's `prometheus` package into tidegate's cache, and the
//! series names a rule or query reads. Used by the gateway's deploy tests,
//! the edge's alert-rule tests and the worker's and edge's metrics tests.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

/// tidegate's cache, as `scripts/setup.sh` fills it: `$TIDEGATE_CACHE`,
/// else `$XDG_CACHE_HOME/tidegate`, else `~/.cache/tidegate`.
pub fn cache_dir() -> PathBuf {
    let var = |n: &str| std::env::var_os(n).filter(|v| !v.is_empty());
    var("TIDEGATE_CACHE")
        .map(PathBuf::from)
        .or_else(|| var("XDG_CACHE_HOME").map(|x| PathBuf::from(x).join("tidegate")))
        .or_else(|| var("HOME").map(|h| PathBuf::from(h).join(".cache/tidegate")))
        .expect("HOME is set")
}

/// `$TIDEGATE_PROMTOOL`, else `promtool/promtool` in [`cache_dir`]; fails
/// the test, saying how to get it, when it is not there.
pub fn promtool() -> PathBuf {
    if let Some(p) = std::env::var_os("TIDEGATE_PROMTOOL").filter(|v| !v.is_empty()) {
        return PathBuf::from(p);
    }
    let p = cache_dir().join("promtool/promtool");
    assert!(
        p.exists(),
        "{} is missing: run scripts/setup.sh, which unpacks promtool from Debian's prometheus package",
        p.display()
    );
    p
}

/// Runs promtool with `args` in `dir`; its output, or a failure with it.
pub fn run_promtool(args: &[&str], dir: &Path) -> String {
    let out = Command::new(promtool())
        .args(args)
        .current_dir(dir)
        .output()
        .expect("promtool runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "promtool {args:?} failed:\n{text}");
    text
}

/// Every `tidegate_…` series name in `text` (a rules file, a dashboard, a
/// query). Recording rules, named `tidegate:…`, are not series.
pub fn series_in(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while let Some(at) = text[i..].find("tidegate_") {
        let start = i + at;
        let boundary = start == 0 || {
            let b = bytes[start - 1];
            !(b.is_ascii_alphanumeric() || b == b'_' || b == b':')
        };
        let end = text[start..]
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .map_or(text.len(), |n| start + n);
        if boundary {
            out.insert(text[start..end].to_string());
        }
        i = end;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn series_are_whole_names_and_recording_rules_are_not_series() {
        let got = series_in(
            "sum(rate(tidegate_frames_total[5m])) / tidegate:cost_per_hour + xtidegate_no + tidegate_queue_depth",
        );
        let want: BTreeSet<String> = ["tidegate_frames_total", "tidegate_queue_depth"]
            .into_iter()
            .map(String::from)
            .collect();
        assert_eq!(got, want);
    }
}
