//! The fuzz targets' files on disk (`protocol/fuzz/{corpus,artifacts}/<target>`),
//! replayed through their checks by the integration tests.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};

/// `protocol/fuzz/<sub>/<target>` (`sub`: `corpus` or `artifacts`).
pub fn fuzz_dir(sub: &str, target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz")
        .join(sub)
        .join(target)
}

/// Every file directly in `dir`, sorted; none when the folder is absent.
pub fn files(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<_> = entries
        .map(|e| e.expect("readable corpus entry").path())
        .filter(|p| p.is_file())
        .map(|p| {
            let bytes = std::fs::read(&p).expect("readable corpus file");
            (p, bytes)
        })
        .collect();
    out.sort();
    out
}

/// Replays files through `check`, naming every file that fails.
pub fn replay(files: &[(PathBuf, Vec<u8>)], check: fn(&[u8])) {
    let failed: Vec<String> = files
        .iter()
        .filter(|(_, bytes)| catch_unwind(AssertUnwindSafe(|| check(bytes))).is_err())
        .map(|(p, _)| p.display().to_string())
        .collect();
    assert!(failed.is_empty(), "fuzz check failed on: {failed:#?}");
}
