//! Camera thumbnails on the page: whether they are on, each camera's
//! latest, and the URL it is fetched from.

use serde::Serialize;
use utoipa::ToSchema;

use super::page_model::StatusModel;

/// Camera thumbnails, as configured under `[status]`.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct ThumbnailInfo {
    /// Least time between two thumbnails of a camera (ms).
    pub interval_ms: u64,
    /// Longest side of a thumbnail (px).
    pub max_px: u32,
    /// Frames that gave no thumbnail (no picture, or corrupt) since the
    /// gateway started.
    pub refused: u64,
}

/// Says in `model` whether thumbnails are on, and which cameras have one
/// (its number).
pub fn add_thumbnails(model: &mut StatusModel, thumbnails: &crate::thumbnail::Thumbnails) {
    let Some(config) = thumbnails.config() else {
        return;
    };
    model.thumbnails = Some(ThumbnailInfo {
        interval_ms: config.interval.as_millis() as u64,
        max_px: config.max_px,
        refused: thumbnails.refused(),
    });
    let numbers = thumbnails.numbers();
    for c in &mut model.cameras {
        c.thumbnail = numbers.get(&(c.edge.clone(), c.camera.clone())).copied();
    }
}

/// `s` as one URL path segment: unreserved bytes kept, the rest
/// percent-encoded (as the page's `encodeURIComponent`).
fn path_segment(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                char::from(b).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A camera's thumbnail: the URL of its number `n`.
pub fn thumbnail_url(edge: &str, camera: &str, n: u64) -> String {
    format!(
        "/api/v1/cameras/{}/{}/thumbnail.jpg?n={n}",
        path_segment(edge),
        path_segment(camera)
    )
}
