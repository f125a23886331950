//! The page's HTML document: the template, the model embedded so that no
//! name can close its script, and the first paint of every panel.

use crate::api::json::FrameTotals;

use super::cameras::{TOP_CAMERAS, cameras_html};
use super::format::escape;
use super::leases::{costs_html, leases_html};
use super::models::models_html;
use super::page_model::StatusModel;
use super::table::{Cell, table_html};
use super::workers::workers_html;

/// How often the page fetches the model again (ms).
pub const POLL_MS: u32 = 2000;

/// The page's document: the model as of the request, embedded, drawn once
/// on the server (so that a client without script, or before it runs,
/// sees the tables and the banner), and the script that draws it again
/// with the plots and polls for the next.
pub fn page(model: &StatusModel) -> String {
    let json = serde_json::to_string(model).unwrap_or_else(|_| "null".into());
    // In a <script> element only `</script` ends it; escaping every `<`
    // (and `>`, `&`) as a JSON \u escape keeps any name inside the data.
    let json = json
        .replace('<', "\\u003c")
        .replace('>', "\\u003e")
        .replace('&', "\\u0026");
    let mut out = PAGE.to_string();
    for (mark, html) in first_paint(model) {
        out = out.replace(mark, &html);
    }
    out.replace("/*POLL_MS*/2000", &POLL_MS.to_string())
        .replace("/*MODEL*/null", &json)
}

/// The page's first paint: each placeholder in `status_page.html` and the
/// markup the script would draw there.
fn first_paint(m: &StatusModel) -> Vec<(&'static str, String)> {
    let hidden = |h: bool| {
        if h {
            " hidden".to_string()
        } else {
            String::new()
        }
    };
    let problems: String = m
        .problems
        .iter()
        .map(|p| format!("<li data-kind=\"{}\">{}</li>", p.kind, escape(&p.message)))
        .collect();
    let more = m.cameras.len().saturating_sub(TOP_CAMERAS);
    let l = m.leasing.as_ref();
    vec![
        ("<!--BANNER_HIDDEN-->", hidden(m.problems.is_empty())),
        ("<!--PROBLEMS-->", problems),
        ("<!--WORKERS-->", workers_html(m)),
        ("<!--MODELS-->", models_html(m)),
        ("<!--CAMERAS-->", cameras_html(m)),
        ("<!--MORE_HIDDEN-->", hidden(more == 0)),
        ("<!--MORE-->", format!("{more} more")),
        ("<!--LEASING_HIDDEN-->", hidden(l.is_none())),
        (
            "<!--LEASES-->",
            l.map(|l| leases_html(l, m.generated_at.0))
                .unwrap_or_default(),
        ),
        ("<!--COSTS-->", l.map(costs_html).unwrap_or_default()),
        ("<!--TOTALS-->", totals_html(&m.totals)),
    ]
}

fn totals_html(t: &FrameTotals) -> String {
    let row = [
        t.admitted,
        t.ok,
        t.shed,
        t.expired,
        t.failed,
        t.queued,
        t.dispatched,
    ]
    .iter()
    .map(|v| Cell::from(v.to_string()))
    .collect();
    table_html(
        &[
            "admitted",
            "ok",
            "shed",
            "expired",
            "failed",
            "queued",
            "on workers",
        ],
        vec![row],
        "",
        &[0, 1, 2, 3, 4, 5, 6],
        None,
    )
}

/// The page's template: HTML, CSS and script, all inline.
const PAGE: &str = include_str!("../status_page.html");

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::LeasingView;
    use crate::status::build;
    use crate::status::fixtures::{NOW, camera, lease, snapshot};
    use tidegate_lease::billing::Granularity;
    use tidegate_lease::ledger::CostReport;

    #[test]
    fn the_page_embeds_the_model_with_no_way_out_of_its_script() {
        let mut s = snapshot(0);
        s.cameras.push(camera(
            1,
            "lobby & <b>co</b>",
            "</script><img src=x onerror=alert(1)>",
            "blazeface",
        ));
        s.workers[0].name = "<i>w</i>".into();
        let m = build(&s, None, NOW);
        let html = page(&m);
        assert!(html.contains("<td>&lt;/script&gt;&lt;img src=x onerror=alert(1)&gt;</td>"));
        assert!(html.contains("<td>lobby &amp; &lt;b&gt;co&lt;/b&gt;</td>"));
        assert!(html.contains("<td>&lt;i&gt;w&lt;/i&gt;</td>"));
        assert!(!html.contains("<i>w"), "a name leaked as markup");
        assert!(!html.contains("<img"), "a name leaked as markup");
        assert!(!html.contains("<b>co"), "a name leaked as markup");
        assert_eq!(
            html.matches("</script>").count(),
            2,
            "only the page's own two scripts end"
        );
        assert!(html.contains(r"\u003c/script\u003e\u003cimg src=x onerror=alert(1)\u003e"));
        assert!(
            !html.contains("/*MODEL*/") && html.contains(&format!("const POLL_MS = {POLL_MS};"))
        );
        // what the script parses is the model
        let start = html.find(r#"type="application/json">"#).unwrap() + 24;
        let end = start + html[start..].find("</script>").unwrap();
        let back: serde_json::Value = serde_json::from_str(&html[start..end]).unwrap();
        assert_eq!(back, serde_json::to_value(&m).unwrap());
        // The only URL is the SVG namespace (a name, never fetched).
        let urls = html.matches("http://").count() + html.matches("https://").count();
        let svg_ns = html.matches("\"http://www.w3.org/2000/svg\"").count();
        assert_eq!(urls, svg_ns, "nothing is fetched from elsewhere");
        assert!(
            !html.contains("innerHTML"),
            "names go in through textContent only"
        );
    }

    #[test]
    fn the_first_paint_draws_the_tables_with_long_lists_collapsed() {
        let mut s = snapshot(60);
        for k in 0..12 {
            s.cameras
                .push(camera(2, "yard", &format!("extra-{k:02}"), "blazeface"));
        }
        let live = [lease(4, 5.0, Some(NOW - 100 * 60_000), Granularity::Hour)];
        let costs = CostReport::default();
        let view = LeasingView {
            live: &live,
            costs: &costs,
            recent: &costs,
            spend_cap_per_hour: None,
        };
        let m = build(&s, Some(view), NOW);
        let html = page(&m);
        assert!(!html.contains("<!--"), "every placeholder is filled");
        assert_eq!(m.cameras.len(), 15);
        let cameras = &html[html.find("<div id=\"cameras\">").unwrap()..];
        let cameras = &cameras[..cameras.find("</div>").unwrap()];
        assert_eq!(cameras.matches("<tr>").count(), 1 + TOP_CAMERAS);
        assert_eq!(cameras.matches("<tr hidden=\"\">").count(), 5);
        assert!(cameras.starts_with("<div id=\"cameras\"><table><tr><th>edge</th>"));
        assert!(cameras.contains("<tr><td>lobby</td><td>door</td><td>blazeface</td><td class=\"n\">10.00</td><td class=\"n\">9.00</td><td class=\"n\">10.0 %</td><td>none</td></tr>"), "{cameras}");
        assert!(html.contains("<button id=\"cameras-more\">5 more</button>"));
        // 60 of 780 shed at the door: flagged, before any script runs
        assert!(
            html.contains("<div id=\"banner\"><b>Problems</b><ul id=\"problems\"><li data-kind=\"shedding\">7.7 % of frames shed"),
            "{html}"
        );
        assert!(page(&build(&snapshot(0), None, NOW)).contains("<div id=\"banner\" hidden>"));
        assert!(html.contains("<td>lease-4</td><td>process</td><td>a100</td><td>spot</td><td>ready</td><td class=\"n\">5.00 EUR/h</td><td><time"), "{html}");
        assert!(
            html.contains(">in 20 min</time> (20 min left)</td>"),
            "{html}"
        );
        assert!(html.contains("<td>w-1</td><td>blazeface</td><td>cpu</td><td>serving</td><td class=\"n\">10</td><td class=\"n\">40</td><td class=\"n\">4.0</td><td class=\"n\">12.0 ms</td><td class=\"n\">15.0 ms</td><td class=\"n\">9.0 ms</td><td class=\"n\">10.0 ms</td><td class=\"n\">× 0.90</td>"), "{html}");
    }
}
