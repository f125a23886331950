//! The cameras panel: open cameras and those with frames in the last
//! minute, worst shed share first, the first [`TOP_CAMERAS`] shown.

use serde::Serialize;
use utoipa::ToSchema;

use crate::api::json::FrameCounts;
use crate::hub::Snapshot;

use super::format::{escape, num, pct};
use super::page_model::{StatusModel, rate};
use super::table::{Cell, table_html};
use super::thumbnails::thumbnail_url;

/// A camera, over the window.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct CameraRow {
    /// Its edge's configured name.
    pub edge: String,
    /// Camera name.
    pub camera: String,
    /// Model (`None` for a camera closed since).
    pub model: Option<String>,
    /// Open now.
    pub open: bool,
    /// Its frames in the window.
    pub frames: FrameCounts,
    /// Admitted per second over the window.
    pub admitted_fps: Option<f64>,
    /// `ok` per second over the window.
    pub ok_fps: Option<f64>,
    /// Shed over ended.
    pub shed_ratio: Option<f64>,
    /// The frame-rate cap the gateway's hints hold it to, if any.
    pub cap_fps: Option<f64>,
    /// The number of its latest thumbnail, which changes with each new
    /// one (the page puts it in the thumbnail's URL to fetch a new one);
    /// `None` while it has none, and when thumbnails are off.
    pub thumbnail: Option<u64>,
}

/// Camera rows shown before the rest are collapsed behind "N more".
pub const TOP_CAMERAS: usize = 10;

/// Open cameras and those with frames in the window, sorted by shed share
/// (worst first), then by frames admitted, then by name.
pub(super) fn camera_rows(snap: &Snapshot, seconds: f64) -> Vec<CameraRow> {
    let recent = &snap.timeline.recent.cameras;
    let row =
        |edge: String, camera: String, model, open, frames: crate::timeline::FrameCounts, cap| {
            CameraRow {
                edge,
                camera,
                model,
                open,
                admitted_fps: rate(frames.admitted, seconds),
                ok_fps: rate(frames.ok, seconds),
                shed_ratio: frames.shed_ratio(),
                frames: frames.into(),
                cap_fps: cap,
                thumbnail: None,
            }
        };
    let mut rows: Vec<CameraRow> = snap
        .cameras
        .iter()
        .map(|c| {
            let edge = c.edge.clone();
            let frames = recent
                .iter()
                .find(|r| r.edge == edge && r.camera == c.camera)
                .map(|r| r.frames)
                .unwrap_or_default();
            let cap = c.load.as_ref().and_then(|l| l.cap_fps);
            row(
                edge,
                c.camera.clone(),
                Some(c.model.clone()),
                true,
                frames,
                cap,
            )
        })
        .collect();
    for r in recent {
        if !rows
            .iter()
            .any(|o| o.edge == r.edge && o.camera == r.camera)
        {
            rows.push(row(
                r.edge.clone(),
                r.camera.clone(),
                None,
                false,
                r.frames,
                None,
            ));
        }
    }
    rows.sort_by(|a, b| {
        let shed = |r: &CameraRow| r.shed_ratio.unwrap_or(0.0);
        shed(b)
            .total_cmp(&shed(a))
            .then(b.frames.admitted.cmp(&a.frames.admitted))
            .then_with(|| (&a.edge, &a.camera).cmp(&(&b.edge, &b.camera)))
    });
    rows
}

pub(super) fn cameras_html(m: &StatusModel) -> String {
    let rows = m
        .cameras
        .iter()
        .map(|c| {
            let mut row: Vec<Cell> = vec![
                c.edge.as_str().into(),
                c.camera.as_str().into(),
                c.model
                    .as_deref()
                    .filter(|_| c.open)
                    .unwrap_or("(closed)")
                    .into(),
                num(c.admitted_fps, 2).into(),
                num(c.ok_fps, 2).into(),
                pct(c.shed_ratio).into(),
                c.cap_fps
                    .map_or_else(|| "none".into(), |f| format!("{f:.1}/s"))
                    .into(),
            ];
            if m.thumbnails.is_some() {
                row.push(match c.thumbnail {
                    Some(n) => Cell::Markup(format!(
                        "<img class=\"thumb\" src=\"{}\" alt=\"{}\">",
                        escape(&thumbnail_url(&c.edge, &c.camera, n)),
                        escape(&format!("latest frame of {}", c.camera))
                    )),
                    None => "—".into(),
                });
            }
            row
        })
        .collect();
    let mut head = vec![
        "edge",
        "camera",
        "model",
        "admitted/s",
        "ok/s",
        "shed",
        "rate cap",
    ];
    if m.thumbnails.is_some() {
        head.push("latest frame");
    }
    table_html(
        &head,
        rows,
        "No camera is open.",
        &[3, 4, 5],
        Some(TOP_CAMERAS),
    )
}

#[cfg(test)]
mod tests {
    use crate::status::build;
    use crate::status::fixtures::{NOW, snapshot};

    #[test]
    fn camera_rates_add_up_to_the_admitted_rate_and_sort_worst_first() {
        let m = build(&snapshot(60), None, NOW);
        assert_eq!(m.window.length_s, 60.0);
        assert_eq!(m.window.admitted_fps, Some(13.0));
        let names: Vec<(&str, &str, bool)> = m
            .cameras
            .iter()
            .map(|c| (c.edge.as_str(), c.camera.as_str(), c.open))
            .collect();
        assert_eq!(
            names,
            [
                ("lobby", "door", true),
                ("yard", "gate", true),
                ("dock", "gone", false)
            ],
            "shed first, then by frames admitted"
        );
        let sum: f64 = m.cameras.iter().filter_map(|c| c.admitted_fps).sum();
        assert!((sum - 13.0).abs() < 1e-9, "{sum}");
        assert_eq!(m.cameras[0].shed_ratio, Some(0.1));
        assert_eq!(m.cameras[0].admitted_fps, Some(10.0));
        assert_eq!(m.cameras[2].model, None);
    }
}
