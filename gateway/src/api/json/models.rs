//! Served models and the input each takes from the edges
//! (`GET /api/v1/models`).

use serde::Serialize;
use utoipa::ToSchema;

use crate::hub::{ModelView, Snapshot};

/// The tensor a model takes from the edges.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, ToSchema)]
pub struct Input {
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
    /// Channels (3 for colour).
    pub channels: u8,
    /// Element type on the wire.
    #[schema(value_type = String, example = "u8")]
    pub dtype: tidegate_protocol::DType,
    /// Memory layout on the wire.
    #[schema(value_type = String, example = "nhwc")]
    pub layout: tidegate_protocol::Layout,
    /// Channel order.
    #[schema(value_type = String, example = "rgb")]
    pub color: tidegate_protocol::ColorOrder,
    /// How the edge fits a source frame into it.
    #[schema(value_type = String, example = "stretch")]
    pub resize: tidegate_protocol::Resize,
}

impl From<tidegate_protocol::InputSpec> for Input {
    fn from(i: tidegate_protocol::InputSpec) -> Self {
        let tidegate_protocol::InputSpec {
            width,
            height,
            channels,
            dtype,
            layout,
            color,
            resize,
        } = i;
        Input {
            width,
            height,
            channels,
            dtype,
            layout,
            color,
            resize,
        }
    }
}

/// A model served by at least one worker.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct Model {
    /// Name.
    pub name: String,
    /// Version.
    pub version: u32,
    /// Input the edges send.
    pub input: Input,
    /// Largest batch across workers.
    pub max_batch: u16,
    /// Frames queued now.
    pub queued: usize,
    /// Workers serving it.
    pub workers: usize,
    /// Class names, indexed by a detection's `class`.
    pub labels: Vec<String>,
    /// The budget its frames are held to (ms): the strictest its open
    /// cameras declared, else the latest frame's; 0 when neither is known.
    pub budget_ms: f64,
}

impl From<&ModelView> for Model {
    fn from(m: &ModelView) -> Self {
        let ModelView {
            name,
            version,
            input,
            max_batch,
            queued,
            workers,
            labels,
            budget_ms,
        } = m;
        Model {
            name: name.clone(),
            version: *version,
            input: (*input).into(),
            max_batch: *max_batch,
            queued: *queued,
            workers: *workers,
            labels: labels.clone(),
            budget_ms: *budget_ms,
        }
    }
}

/// Served models, by name.
pub fn models(s: &Snapshot) -> Vec<Model> {
    s.models.iter().map(Model::from).collect()
}
