//! The models panel: each model with workers, and each one cameras ask for.

use serde::Serialize;
use utoipa::ToSchema;

use crate::hub::Snapshot;

use super::page_model::StatusModel;
use super::table::table_html;

/// A model with workers, or one cameras ask for.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct ModelRow {
    /// Name.
    pub name: String,
    /// Version (`None`: no worker serves it).
    pub version: Option<u32>,
    /// Workers that may serve it.
    pub workers: usize,
    /// Frames queued now.
    pub queued: usize,
    /// Largest batch.
    pub max_batch: u16,
    /// Open cameras sending it frames.
    pub cameras: usize,
    /// Budget (ms; 0 when not known).
    pub budget_ms: f64,
}

pub(super) fn model_rows(snap: &Snapshot) -> Vec<ModelRow> {
    let cameras_of = |name: &str| snap.cameras.iter().filter(|c| c.model == name).count();
    let mut rows: Vec<ModelRow> = snap
        .models
        .iter()
        .map(|m| ModelRow {
            name: m.name.clone(),
            version: Some(m.version),
            workers: m.workers,
            queued: m.queued,
            max_batch: m.max_batch,
            cameras: cameras_of(&m.name),
            budget_ms: m.budget_ms,
        })
        .collect();
    for c in &snap.cameras {
        if !rows.iter().any(|r| r.name == c.model) {
            rows.push(ModelRow {
                name: c.model.clone(),
                version: None,
                workers: 0,
                queued: 0,
                max_batch: 0,
                cameras: cameras_of(&c.model),
                budget_ms: 0.0,
            });
        }
    }
    rows.sort_by(|a, b| a.name.cmp(&b.name));
    rows
}

pub(super) fn models_html(m: &StatusModel) -> String {
    let rows = m
        .models
        .iter()
        .map(|r| {
            vec![
                r.name.as_str().into(),
                r.version
                    .map_or_else(|| "—".into(), |v| v.to_string())
                    .into(),
                r.workers.to_string().into(),
                r.cameras.to_string().into(),
                r.queued.to_string().into(),
                r.max_batch.to_string().into(),
                (if r.budget_ms > 0.0 {
                    format!("{} ms", r.budget_ms)
                } else {
                    "—".into()
                })
                .into(),
            ]
        })
        .collect();
    table_html(
        &[
            "model",
            "version",
            "workers",
            "cameras",
            "queued",
            "max batch",
            "budget",
        ],
        rows,
        "No model is served and no camera is open.",
        &[2, 3, 4, 5, 6],
        None,
    )
}
