//! `[status]`: the status page's camera thumbnails, how often and how large.
//! The thumbnails themselves are drawn by `crate::thumbnail`.

use serde::Deserialize;

use super::ConfigError;

/// The status page's settings.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StatusConfig {
    /// Keep a JPEG of each camera's latest served frame with its
    /// detections drawn, for the status page and
    /// `/api/v1/cameras/{edge}/{camera}/thumbnail.jpg`. Off by default: it
    /// decodes and encodes frames on the gateway.
    #[serde(default)]
    pub thumbnails: bool,
    /// Least time between two thumbnails of one camera (ms).
    #[serde(default = "default_thumbnail_interval_ms")]
    pub thumbnail_interval_ms: u32,
    /// Longest side of a thumbnail (pixels).
    #[serde(default = "default_thumbnail_max_px")]
    pub thumbnail_max_px: u32,
}

impl Default for StatusConfig {
    fn default() -> Self {
        StatusConfig {
            thumbnails: false,
            thumbnail_interval_ms: default_thumbnail_interval_ms(),
            thumbnail_max_px: default_thumbnail_max_px(),
        }
    }
}

impl StatusConfig {
    /// Checks values that serde cannot: a rate a page can follow and a
    /// size that is a thumbnail.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.thumbnail_interval_ms < 250 {
            return Err(ConfigError::Invalid(format!(
                "status.thumbnail_interval_ms = {} would encode frames faster than a page shows them; use at least 250",
                self.thumbnail_interval_ms
            )));
        }
        if !(32..=640).contains(&self.thumbnail_max_px) {
            return Err(ConfigError::Invalid(format!(
                "status.thumbnail_max_px = {} must be 32..=640",
                self.thumbnail_max_px
            )));
        }
        Ok(())
    }

    /// The hub's thumbnail settings; `None` when thumbnails are off.
    pub fn thumbnails(&self) -> Option<crate::thumbnail::ThumbnailConfig> {
        self.thumbnails.then(|| crate::thumbnail::ThumbnailConfig {
            interval: std::time::Duration::from_millis(self.thumbnail_interval_ms.into()),
            max_px: self.thumbnail_max_px,
        })
    }
}

/// A page redraws every 2 s: a thumbnail as often is as fresh as it shows.
fn default_thumbnail_interval_ms() -> u32 {
    2000
}

/// A row of a table: readable boxes at a few kilobytes a JPEG.
fn default_thumbnail_max_px() -> u32 {
    160
}

#[cfg(test)]
mod tests {
    use super::StatusConfig;
    use crate::config::Config;

    #[test]
    fn thumbnails_are_off_by_default_and_bad_rates_sizes_and_keys_are_refused_by_name() {
        let cfg = Config::default_config();
        assert_eq!(cfg.status, StatusConfig::default());
        assert!(!cfg.status.thumbnails && cfg.status.thumbnails().is_none());
        assert_eq!(
            (
                cfg.status.thumbnail_interval_ms,
                cfg.status.thumbnail_max_px
            ),
            (2000, 160)
        );
        let on: Config =
            toml::from_str("[status]\nthumbnails = true\nthumbnail_max_px = 640\n").unwrap();
        on.validate().unwrap();
        let t = on.status.thumbnails().unwrap();
        assert_eq!((t.interval.as_millis(), t.max_px), (2000, 640));
        for (text, key) in [
            ("thumbnail_interval_ms = 249", "thumbnail_interval_ms"),
            ("thumbnail_max_px = 31", "thumbnail_max_px"),
            ("thumbnail_max_px = 641", "thumbnail_max_px"),
        ] {
            let cfg: Config = toml::from_str(&format!("[status]\n{text}\n")).unwrap();
            let e = cfg.validate().unwrap_err().to_string();
            assert!(e.contains(key), "{text}: {e}");
        }
        let e = toml::from_str::<Config>("[status]\nthumbnail = true\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown field `thumbnail`"), "{e}");
    }
}
