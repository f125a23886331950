//! The live status page (`GET /`) and the model it renders
//! (`GET /api/v1/status`).
//!
//! [`build`] turns the hub's [`Snapshot`](crate::hub::Snapshot) (with its
//! [`crate::timeline`]), the lease ledger's view and the clock into a
//! [`StatusModel`]: rates over the last minute that add up, cameras sorted
//! worst first, each worker's batch times against its profile, each
//! lease's time left in the block it has paid for, and the [`Problem`]s
//! the banner shows. It is pure, and tested without sockets.
//!
//! [`page`](fn@page) is one HTML document, served by the gateway with
//! everything inline (no CDN, no fetch anywhere else): the model as of the
//! request, and a small script (`status_page.html`) that draws it, plots
//! the last 15 minutes as inline SVG, and fetches `/api/v1/status` every
//! [`POLL_MS`] to draw it again. Every name from outside (edge, camera,
//! worker, model, provider) reaches the document through `textContent`
//! only; the embedded JSON has its `<`, `>` and `&` escaped, so no name can
//! close its `<script>`.
//!
//! One child module per panel (`workers`, `models`, `cameras`, `leases`:
//! its rows and how they are drawn), and `problems` (the banner),
//! `thumbnails`, `page_model` (the model and [`build`]), `page` (the
//! document), `table` and `format` (how cells are written); this file
//! re-exports what the rest of the gateway names. Nothing here may do I/O,
//! read a clock or reach for the hub: the API's handlers pass the
//! snapshot, the ledger's view and `now` in, and serve what comes out.

mod cameras;
#[cfg(test)]
mod fixtures;
mod format;
mod leases;
mod models;
mod page;
mod page_model;
mod problems;
mod table;
mod thumbnails;
mod workers;

pub use cameras::{CameraRow, TOP_CAMERAS};
pub use format::{escape, iso8601, span};
pub use leases::{EdgeCostRow, LeaseRow, LeasingModel, LeasingView, RECENT_MS};
pub use models::ModelRow;
pub use page::{POLL_MS, page};
pub use page_model::{StatusModel, Window, build};
pub use problems::{
    Problem, SHED_ALERT_MIN_FRAMES, SHED_ALERT_RATIO, SPEND_ALERT_RATIO, STALL_SHOWN_MS, problems,
};
pub use thumbnails::{ThumbnailInfo, add_thumbnails, thumbnail_url};
pub use workers::WorkerRow;
