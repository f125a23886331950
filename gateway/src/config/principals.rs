//! `[[edges]]` and `[[workers]]`: who may connect, with which token digest,
//! and each edge's weight in the scheduler's fair share. Tokens themselves
//! are checked at login (`auth.rs`), not here.

use serde::Deserialize;

use super::{Config, ConfigError};

/// An edge or worker allowed to connect, with its token's SHA-256 digest.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Principal {
    /// Name it says in `Hello`.
    pub name: String,
    /// Hex SHA-256 of its token (`tidegate-gateway hash-token`).
    pub token_sha256: String,
    /// `[[edges]]` only: the edge's share of the gateway's queue and
    /// workers against the other edges' when they compete (1 when unset,
    /// at most [`crate::scheduler::MAX_WEIGHT`]); every connection under its
    /// name shares it.
    #[serde(default)]
    pub weight: Option<u32>,
}

impl Principal {
    /// Its weight (1 when unset).
    pub fn weight(&self) -> u32 {
        self.weight.unwrap_or(1)
    }
}

impl std::fmt::Debug for Principal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Principal")
            .field("name", &self.name)
            .field("token_sha256", &"<redacted>")
            .finish()
    }
}

/// Whether `s` is a 64-digit hex SHA-256.
pub(super) fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

impl Config {
    /// Every token digest is one, and no name is listed twice with the same
    /// token.
    pub(super) fn validate_principals(&self) -> Result<(), ConfigError> {
        for p in self.edges.iter().chain(&self.workers) {
            if !is_sha256_hex(&p.token_sha256) {
                return Err(ConfigError::Invalid(format!(
                    "token_sha256 of '{}' is not a 64-digit hex SHA-256; make one with `tidegate-gateway hash-token <TOKEN>`",
                    p.name
                )));
            }
        }
        // A name may be listed twice with two tokens (so that a token
        // rotation can overlap), never twice with the same one.
        for (role, list) in [("edge", &self.edges), ("worker", &self.workers)] {
            let mut pairs: Vec<(&str, String)> = list
                .iter()
                .map(|p| (p.name.as_str(), p.token_sha256.to_ascii_lowercase()))
                .collect();
            pairs.sort_unstable();
            if let Some(w) = pairs.windows(2).find(|w| w[0] == w[1]) {
                return Err(ConfigError::Invalid(format!(
                    "{role} '{}' is listed twice with the same token",
                    w[0].0
                )));
            }
        }
        Ok(())
    }

    /// Edge weights are in `1..=MAX_WEIGHT` and the same for every entry of
    /// a name; workers have none.
    pub(super) fn validate_weights(&self) -> Result<(), ConfigError> {
        let max = crate::scheduler::MAX_WEIGHT;
        if let Some(w) = self.workers.iter().find(|w| w.weight.is_some()) {
            return Err(ConfigError::Invalid(format!(
                "worker '{}' has a weight; weights share the queue among [[edges]] only",
                w.name
            )));
        }
        let mut seen: std::collections::HashMap<&str, u32> = std::collections::HashMap::new();
        for e in &self.edges {
            let w = e.weight();
            if !(1..=max).contains(&w) {
                return Err(ConfigError::Invalid(format!(
                    "edge '{}' has weight {w}; use 1..={max} (1 is everyone's default)",
                    e.name
                )));
            }
            if let Some(other) = seen.insert(e.name.as_str(), w)
                && other != w
            {
                return Err(ConfigError::Invalid(format!(
                    "edge '{}' is listed with weights {other} and {w}; give every entry of a name the same weight",
                    e.name
                )));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    #[test]
    fn bad_token_digest_is_reported_with_the_fix() {
        let cfg: Config =
            toml::from_str("[[edges]]\nname = \"e\"\ntoken_sha256 = \"abc\"\n").unwrap();
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.contains("hash-token") && err.contains("'e'"), "{err}");
    }

    #[test]
    fn a_name_may_have_two_tokens_but_not_the_same_one_twice() {
        let entry = |kind: &str, token: &str| {
            format!(
                "[[{kind}]]\nname = \"n\"\ntoken_sha256 = \"{}\"\n",
                crate::auth::hash_token(token)
            )
        };
        for kind in ["edges", "workers"] {
            let two: Config = toml::from_str(&(entry(kind, "old") + &entry(kind, "new"))).unwrap();
            two.validate().expect("an overlapping rotation is valid");
            let same: Config = toml::from_str(&(entry(kind, "old") + &entry(kind, "old"))).unwrap();
            let e = same.validate().unwrap_err().to_string();
            assert!(e.contains("'n' is listed twice with the same token"), "{e}");
        }
    }

    #[test]
    fn edge_weights_default_to_one_and_bad_ones_name_the_edge() {
        let entry = |kind: &str, token: &str, weight: &str| {
            format!(
                "[[{kind}]]\nname = \"n\"\ntoken_sha256 = \"{}\"\n{weight}",
                crate::auth::hash_token(token)
            )
        };
        let cfg: Config = toml::from_str(&entry("edges", "t", "")).unwrap();
        cfg.validate().unwrap();
        assert_eq!(cfg.edges[0].weight(), 1);
        assert_eq!(cfg.scheduler.max_budget_ms, 10_000);
        for (toml, want) in [
            (entry("edges", "t", "weight = 0\n"), "edge 'n' has weight 0"),
            (
                entry("workers", "t", "weight = 2\n"),
                "worker 'n' has a weight",
            ),
            (
                entry("edges", "a", "weight = 2\n") + &entry("edges", "b", "weight = 3\n"),
                "edge 'n' is listed with weights 2 and 3",
            ),
            (
                "[scheduler]\nmax_budget_ms = 0\n".to_string(),
                "max_budget_ms = 0",
            ),
        ] {
            let cfg: Config = toml::from_str(&toml).unwrap();
            let e = cfg.validate().unwrap_err().to_string();
            assert!(e.contains(want), "{toml}: {e}");
        }
    }
}
