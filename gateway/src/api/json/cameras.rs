//! Open cameras, with the load the back-pressure policy measured
//! (`GET /api/v1/cameras`), and the schema of a camera's thumbnail.

use serde::Serialize;
use utoipa::ToSchema;

use crate::hub::{CameraView, Snapshot};

/// What the back-pressure policy measured of a camera over its last window.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, ToSchema)]
pub struct CameraLoad {
    /// Arrival rate (frames per second).
    pub arrival_fps: f64,
    /// Rate served `ok` (frames per second).
    pub ok_fps: f64,
    /// Fraction of the window's frames lost to overload.
    pub lost_ratio: f64,
    /// The frame-rate cap in force; `null` when uncapped.
    pub cap_fps: Option<f64>,
    /// Hints sent to this camera so far.
    pub hints: u64,
}

impl From<crate::backpressure::CameraLoad> for CameraLoad {
    fn from(l: crate::backpressure::CameraLoad) -> Self {
        let crate::backpressure::CameraLoad {
            arrival_fps,
            ok_fps,
            lost_ratio,
            cap_fps,
            hints,
        } = l;
        CameraLoad {
            arrival_fps,
            ok_fps,
            lost_ratio,
            cap_fps,
            hints,
        }
    }
}

/// An open camera.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct Camera {
    /// Its edge's configured name.
    pub edge: String,
    /// Its edge's connection number.
    pub session: u64,
    /// Camera name.
    pub camera: String,
    /// Model its frames are for.
    pub model: String,
    /// Measured load and the frame-rate cap in force (after its first
    /// measurement window).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub load: Option<CameraLoad>,
}

impl From<&CameraView> for Camera {
    fn from(c: &CameraView) -> Self {
        let CameraView {
            session,
            edge,
            camera,
            model,
            load,
        } = c;
        Camera {
            edge: edge.clone(),
            session: *session,
            camera: camera.clone(),
            model: model.clone(),
            load: load.map(CameraLoad::from),
        }
    }
}

/// Open cameras, by edge name, session and camera.
pub fn cameras(s: &Snapshot) -> Vec<Camera> {
    s.cameras.iter().map(Camera::from).collect()
}

/// A JPEG file, as a body's schema in the document (the body itself is
/// the file's bytes).
#[derive(Debug)]
pub struct Jpeg;

impl utoipa::PartialSchema for Jpeg {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{KnownFormat, ObjectBuilder, SchemaFormat, Type};
        ObjectBuilder::new()
            .schema_type(Type::String)
            .format(Some(SchemaFormat::KnownFormat(KnownFormat::Binary)))
            .description(Some("A JPEG file."))
            .into()
    }
}

impl ToSchema for Jpeg {}
