//! Reading a TOML config file, as the gateway, the edge and the worker each
//! do: one error type, so that a missing file and a bad one read alike
//! whichever binary was given it. What the file means (its schema, its
//! defaults, which of its paths resolve against its folder) stays with
//! each binary.

use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;

/// Why the configuration is unusable.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not valid TOML for the binary's schema.
    #[error("invalid config {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What the parser said (with line and column).
        message: String,
    },
    /// A value is wrong, or inconsistent with another.
    #[error("invalid config: {0}")]
    Invalid(String),
}

/// Reads the TOML file at `path` as a `T`. Paths inside it are left as
/// written: the caller resolves the relative ones against `path`'s folder.
pub fn read_toml<T: DeserializeOwned>(path: &Path) -> Result<T, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    toml::from_str(&text).map_err(|e| ConfigError::Parse {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Section {
        name: String,
    }

    #[test]
    fn a_file_is_read_or_its_error_names_the_file_and_what_is_wrong() {
        let dir = std::env::temp_dir().join(format!("tidegate-kit-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("good.toml");
        std::fs::write(&good, "name = \"gw\"\n").unwrap();
        assert_eq!(
            read_toml::<Section>(&good).unwrap(),
            Section { name: "gw".into() }
        );

        let bad = dir.join("bad.toml");
        std::fs::write(&bad, "name = \"gw\"\nport = 1\n").unwrap();
        let err = read_toml::<Section>(&bad).unwrap_err();
        let said = err.to_string();
        assert!(matches!(err, ConfigError::Parse { .. }), "{said}");
        assert!(
            said.starts_with(&format!("invalid config {}: ", bad.display()))
                && said.contains("port")
                && said.contains("line 2"),
            "{said}"
        );

        let missing = dir.join("missing.toml");
        let err = read_toml::<Section>(&missing).unwrap_err();
        assert!(matches!(err, ConfigError::Read { .. }), "{err}");
        assert!(
            err.to_string()
                .starts_with(&format!("cannot read config {}: ", missing.display())),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
