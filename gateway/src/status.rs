//! The status page (`GET /`): one HTML page an operator can open in a
//! browser, rendered on the server from the same snapshot as the JSON API,
//! with no script. It refreshes itself every few seconds.
//!
//! Every string that comes from outside (edge, camera, worker and model
//! names, device descriptions, lease provider data) is HTML-escaped.

use std::fmt::Write;

use tidegate_lease::ledger::{CostReport, LeaseRecord};

use crate::hub::Snapshot;

/// Seconds between the page's own refreshes.
pub const REFRESH_SECS: u32 = 5;

/// `s` with `&`, `<`, `>`, `"` and `'` escaped, for HTML or SVG text and
/// attribute values.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// A table: its caption, header cells and rows (already escaped), or a line
/// saying there is nothing.
fn table(out: &mut String, caption: &str, head: &[&str], rows: &[Vec<String>], none: &str) {
    let _ = writeln!(out, "<h2>{caption}</h2>");
    if rows.is_empty() {
        let _ = writeln!(out, "<p class=\"none\">{none}</p>");
        return;
    }
    out.push_str("<table>\n<tr>");
    for h in head {
        let _ = write!(out, "<th>{h}</th>");
    }
    out.push_str("</tr>\n");
    for r in rows {
        out.push_str("<tr>");
        for cell in r {
            let _ = write!(out, "<td>{cell}</td>");
        }
        out.push_str("</tr>\n");
    }
    out.push_str("</table>\n");
}

/// How far back the status page's cost by edge reaches: a day (the split
/// reads every usage row of the range).
pub const RECENT_MS: u64 = 24 * 3600 * 1000;

/// Leasing, when configured: the live leases and what all leases cost.
#[derive(Debug, Clone, Copy)]
pub struct LeasingView<'a> {
    /// Leases not ended.
    pub live: &'a [LeaseRecord],
    /// Cost of every lease so far.
    pub costs: &'a CostReport,
    /// The last [`RECENT_MS`], split by edge.
    pub recent: &'a CostReport,
}

/// The page. `now_ms` dates it.
pub fn render(snap: &Snapshot, leasing: Option<LeasingView<'_>>, now_ms: u64) -> String {
    let mut out = String::new();
    let _ = write!(
        out,
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta http-equiv=\"refresh\" content=\"{REFRESH_SECS}\">\
         <title>tidegate</title><style>\
         body{{font-family:system-ui,sans-serif;margin:1.5em;color:#222}}\
         table{{border-collapse:collapse;margin-bottom:1em}}\
         th,td{{border:1px solid #ccc;padding:.25em .6em;text-align:left}}\
         th{{background:#f0f0f0}}.none{{color:#777}}\
         </style></head><body>\n<h1>tidegate gateway</h1>\n\
         <p>At {now_ms} ms since the Unix epoch; refreshes every {REFRESH_SECS} s. \
         JSON: <a href=\"/api/v1/frames\">frames</a>, <a href=\"/api/v1/workers\">workers</a>, \
         <a href=\"/api/v1/leases\">leases</a>; <a href=\"/metrics\">metrics</a>.</p>\n"
    );
    let f = &snap.frames;
    table(
        &mut out,
        "Frames",
        &[
            "admitted",
            "ok",
            "shed",
            "expired",
            "failed",
            "queued",
            "on workers",
        ],
        &[[
            f.admitted,
            f.ok,
            f.shed,
            f.expired,
            f.failed,
            f.queued,
            f.dispatched,
        ]
        .iter()
        .map(u64::to_string)
        .collect()],
        "",
    );
    let models: Vec<Vec<String>> = snap
        .models
        .iter()
        .map(|m| {
            vec![
                escape(&m.name),
                m.version.to_string(),
                m.workers.to_string(),
                m.queued.to_string(),
                m.max_batch.to_string(),
            ]
        })
        .collect();
    table(
        &mut out,
        "Models",
        &["model", "version", "workers", "queued", "max batch"],
        &models,
        "No model is served: no worker has registered.",
    );
    let workers: Vec<Vec<String>> = snap
        .workers
        .iter()
        .map(|w| {
            vec![
                escape(&w.name),
                escape(&w.device),
                escape(&w.models.join(", ")),
                match (w.unbound, w.draining, w.lease) {
                    (true, _, _) => "unbound (waits for a lease)".into(),
                    (false, true, _) => "draining".into(),
                    (false, false, _) if w.demoted => "demoted (failing; probed)".into(),
                    (false, false, Some(l)) => format!("serving lease-{l}"),
                    (false, false, None) => "serving".into(),
                },
            ]
        })
        .collect();
    table(
        &mut out,
        "Workers",
        &["worker", "device", "models", "state"],
        &workers,
        "No worker is registered.",
    );
    let edge_name = |id: u64| {
        snap.edges
            .iter()
            .find(|e| e.id == id)
            .map_or_else(|| format!("#{id}"), |e| e.name.clone())
    };
    let cameras: Vec<Vec<String>> = snap
        .cameras
        .iter()
        .map(|c| {
            let (arrival, ok, cap) = match &c.load {
                Some(l) => (
                    format!("{:.1}", l.arrival_fps),
                    format!("{:.1}", l.ok_fps),
                    l.cap_fps
                        .map_or_else(|| "none".into(), |c| format!("{c:.1}")),
                ),
                None => ("…".into(), "…".into(), "none".into()),
            };
            vec![
                escape(&edge_name(c.edge)),
                escape(&c.camera),
                escape(&c.model),
                arrival,
                ok,
                cap,
            ]
        })
        .collect();
    table(
        &mut out,
        "Cameras",
        &["edge", "camera", "model", "frames/s in", "ok/s", "rate cap"],
        &cameras,
        "No camera is open.",
    );
    if let Some(l) = leasing {
        let rows: Vec<Vec<String>> = l
            .live
            .iter()
            .map(|r| {
                vec![
                    r.id.to_string(),
                    escape(&r.provider),
                    escape(&r.instance_type),
                    r.tier.as_str().into(),
                    r.state.label().into(),
                    format!("{} {}/h", r.price_per_hour, escape(&r.currency)),
                    format!("{}", r.cost),
                ]
            })
            .collect();
        table(
            &mut out,
            "Live leases",
            &[
                "lease",
                "provider",
                "type",
                "tier",
                "state",
                "price",
                "cost so far",
            ],
            &rows,
            "No lease is live.",
        );
        let c = l.costs;
        let currency = escape(c.currency.as_deref().unwrap_or(""));
        let per_1k = c
            .cost_per_1k_within_slo
            .map_or_else(|| "—".into(), |v| format!("{v:.4} {currency}"));
        let _ = writeln!(
            out,
            "<p>All leases so far: <b>{} {currency}</b>; frames within the SLO {}, late {}; cost per 1000 frames within the SLO {per_1k}.</p>",
            c.total, c.frames_within_slo, c.frames_late
        );
        let r = l.recent;
        let rows: Vec<Vec<String>> = r
            .by_edge
            .iter()
            .map(|(edge, s)| {
                vec![
                    escape(edge),
                    format!("{} {currency}", s.cost),
                    s.frames_within_slo.to_string(),
                    s.frames_late.to_string(),
                    format!("{:.1}", s.busy_seconds),
                    s.cost_per_1k_within_slo
                        .map_or_else(|| "—".into(), |v| format!("{v:.4} {currency}")),
                ]
            })
            .chain((r.idle.0 > 0).then(|| {
                vec![
                    "<i>idle leases</i>".into(),
                    format!("{} {currency}", r.idle),
                    "0".into(),
                    "0".into(),
                    "0.0".into(),
                    "—".into(),
                ]
            }))
            .collect();
        table(
            &mut out,
            "Cost by edge, last 24 hours (each lease's cost split by the worker time its frames took)",
            &[
                "edge",
                "cost",
                "within SLO",
                "late",
                "worker s",
                "per 1000 within SLO",
            ],
            &rows,
            "No lease has served a frame yet.",
        );
    }
    out.push_str("</body></html>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hub::{CameraView, EdgeView, WorkerView};

    #[test]
    fn the_cost_by_edge_table_escapes_names_and_shows_idle_leases() {
        use tidegate_lease::Money;
        use tidegate_lease::showback::Share;
        let mut costs = CostReport {
            currency: Some("CNY".into()),
            total: Money::from_units(30.0),
            idle: Money::from_units(10.0),
            ..CostReport::default()
        };
        costs.by_edge.insert(
            "<b>lobby</b>".into(),
            Share {
                cost: Money::from_units(20.0),
                frames_within_slo: 4000,
                frames_late: 3,
                busy_seconds: 12.5,
                cost_per_1k_within_slo: Some(5.0),
            },
        );
        let snap = Snapshot {
            frames: crate::scheduler::Counters::default(),
            edges: Vec::new(),
            cameras: Vec::new(),
            workers: Vec::new(),
            models: Vec::new(),
        };
        let leasing = LeasingView {
            live: &[],
            costs: &CostReport {
                currency: Some("CNY".into()),
                ..CostReport::default()
            },
            recent: &costs,
        };
        let html = render(&snap, Some(leasing), 0);
        assert!(html.contains("Cost by edge"), "{html}");
        assert!(
            html.contains("<td>&lt;b&gt;lobby&lt;/b&gt;</td><td>20.00 CNY</td><td>4000</td><td>3</td><td>12.5</td><td>5.0000 CNY</td>"),
            "{html}"
        );
        assert!(
            html.contains("<td><i>idle leases</i></td><td>10.00 CNY</td>"),
            "{html}"
        );
        assert!(!html.contains("<b>lobby"), "unescaped: {html}");
    }

    #[test]
    fn outside_strings_are_escaped() {
        assert_eq!(
            escape(r#"<script>alert("x&y's")</script>"#),
            "&lt;script&gt;alert(&quot;x&amp;y&#39;s&quot;)&lt;/script&gt;"
        );
        let snap = Snapshot {
            edges: vec![EdgeView {
                id: 1,
                name: "edge<1>".into(),
            }],
            cameras: vec![CameraView {
                edge: 1,
                camera: "<img src=x onerror=alert(1)>".into(),
                model: "blazeface".into(),
                load: None,
            }],
            workers: vec![WorkerView {
                id: 2,
                name: "w\"1".into(),
                device: "cpu".into(),
                models: vec!["blazeface".into()],
                profile: Vec::new(),
                draining: true,
                demoted: false,
                lease: None,
                unbound: false,
            }],
            ..Snapshot::default()
        };
        let page = render(&snap, None, 7);
        assert!(!page.contains("<img"), "{page}");
        assert!(
            page.contains("&lt;img src=x onerror=alert(1)&gt;"),
            "{page}"
        );
        assert!(page.contains("edge&lt;1&gt;"), "{page}");
        assert!(
            page.contains("w&quot;1") && page.contains("draining"),
            "{page}"
        );
        assert!(page.contains("No model is served"), "{page}");
        assert!(
            !page.contains("Live leases"),
            "no leasing section without leasing"
        );
    }
}
