//! The load-test report as one SVG picture: the end-to-end latency CDF
//! against the budget, and how every sent frame ended. Plain SVG written
//! by hand (no plotting library, no fonts needed); it opens in any browser.

use std::fmt::Write;

use tidegate_gateway::status::escape;

use crate::report::Report;

/// Picture size (px).
const WIDTH: f64 = 900.0;
const HEIGHT: f64 = 420.0;
/// The CDF plot's area.
const PLOT_X: f64 = 70.0;
const PLOT_Y: f64 = 60.0;
const PLOT_W: f64 = 520.0;
const PLOT_H: f64 = 300.0;
/// The outcome bars' column.
const BARS_X: f64 = 650.0;
const BARS_W: f64 = 200.0;

/// The latency axis' end: a round number above the budget and the p99.
pub fn axis_end_ms(report: &Report) -> f64 {
    let top = (report.budget_ms as f64 * 1.25).max(report.e2e_ms.p99 * 1.1);
    let step = nice_step(top / 5.0);
    (top / step).ceil() * step
}

/// 1, 2 or 5 × 10^k at or above `raw`.
fn nice_step(raw: f64) -> f64 {
    if !(raw.is_finite() && raw > 0.0) {
        return 1.0;
    }
    let mag = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag)
}

/// The picture.
pub fn render(report: &Report) -> String {
    let mut out = String::new();
    let x_end = axis_end_ms(report);
    let x = |ms: f64| PLOT_X + (ms.clamp(0.0, x_end) / x_end) * PLOT_W;
    let y = |q: f64| PLOT_Y + PLOT_H - q.clamp(0.0, 1.0) * PLOT_H;
    let _ = writeln!(
        out,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{HEIGHT}\" \
         viewBox=\"0 0 {WIDTH} {HEIGHT}\" font-family=\"sans-serif\" font-size=\"12\">"
    );
    let _ = writeln!(
        out,
        "<rect width=\"{WIDTH}\" height=\"{HEIGHT}\" fill=\"white\"/>"
    );
    let title = format!(
        "tidegate loadtest: {} cameras × {} fps for {} s, budget {} ms; {:.2}% ok within the budget",
        report.cameras,
        report.fps,
        report.duration_s,
        report.budget_ms,
        report.slo_attainment * 100.0
    );
    let _ = writeln!(
        out,
        "<text x=\"{PLOT_X}\" y=\"28\" font-size=\"15\" font-weight=\"bold\">{}</text>",
        escape(&title)
    );
    // axes, grid and ticks
    let _ = writeln!(
        out,
        "<g stroke=\"#999\" stroke-width=\"1\"><line x1=\"{PLOT_X}\" y1=\"{}\" x2=\"{}\" y2=\"{}\"/>\
         <line x1=\"{PLOT_X}\" y1=\"{PLOT_Y}\" x2=\"{PLOT_X}\" y2=\"{}\"/></g>",
        PLOT_Y + PLOT_H,
        PLOT_X + PLOT_W,
        PLOT_Y + PLOT_H,
        PLOT_Y + PLOT_H
    );
    let step = x_end / 5.0;
    for i in 0..=5 {
        let ms = step * i as f64;
        let _ = writeln!(
            out,
            "<line x1=\"{0:.1}\" y1=\"{PLOT_Y}\" x2=\"{0:.1}\" y2=\"{1}\" stroke=\"#eee\"/>\
             <text x=\"{0:.1}\" y=\"{2}\" text-anchor=\"middle\">{3}</text>",
            x(ms),
            PLOT_Y + PLOT_H,
            PLOT_Y + PLOT_H + 16.0,
            ms
        );
    }
    for q in [0.0, 0.25, 0.5, 0.75, 1.0] {
        let _ = writeln!(
            out,
            "<line x1=\"{PLOT_X}\" y1=\"{0:.1}\" x2=\"{1}\" y2=\"{0:.1}\" stroke=\"#eee\"/>\
             <text x=\"{2}\" y=\"{3:.1}\" text-anchor=\"end\">{4}%</text>",
            y(q),
            PLOT_X + PLOT_W,
            PLOT_X - 6.0,
            y(q) + 4.0,
            q * 100.0
        );
    }
    let _ = writeln!(
        out,
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">end-to-end latency of ok frames (ms, edge clock)</text>",
        PLOT_X + PLOT_W / 2.0,
        PLOT_Y + PLOT_H + 34.0
    );
    // the budget
    let bx = x(report.budget_ms as f64);
    let _ = writeln!(
        out,
        "<line id=\"budget\" x1=\"{bx:.1}\" y1=\"{PLOT_Y}\" x2=\"{bx:.1}\" y2=\"{}\" stroke=\"#c00\" \
         stroke-dasharray=\"6 4\"/><text x=\"{:.1}\" y=\"{}\" fill=\"#c00\">budget {} ms</text>",
        PLOT_Y + PLOT_H,
        bx + 4.0,
        PLOT_Y + 12.0,
        report.budget_ms
    );
    // the CDF, as steps
    if report.e2e_cdf_ms.is_empty() {
        let _ = writeln!(
            out,
            "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">no frame ended ok</text>",
            PLOT_X + PLOT_W / 2.0,
            PLOT_Y + PLOT_H / 2.0
        );
    } else {
        let mut points = format!("{:.1},{:.1}", x(0.0), y(0.0));
        for [ms, q] in &report.e2e_cdf_ms {
            let _ = write!(points, " {:.1},{:.1}", x(*ms), y(*q));
        }
        let _ = writeln!(
            out,
            "<polyline id=\"cdf\" fill=\"none\" stroke=\"#1f5fbf\" stroke-width=\"2\" points=\"{points}\"/>"
        );
        let p = &report.e2e_ms;
        let _ = writeln!(
            out,
            "<text x=\"{}\" y=\"{}\">p50 {:.1} · p95 {:.1} · p99 {:.1} · max {:.1} ms</text>",
            PLOT_X,
            PLOT_Y - 10.0,
            p.p50,
            p.p95,
            p.p99,
            p.max
        );
    }
    // outcomes: one bar per status, and one for the frames due that were
    // never sent (a send error, the generator behind at the end, or held
    // by flow control), scaled to the frames due
    let _ = writeln!(
        out,
        "<text x=\"{BARS_X}\" y=\"{}\" font-weight=\"bold\">{} frames sent of {} due</text>",
        PLOT_Y - 10.0,
        report.sent,
        report.due()
    );
    let rows = [
        ("ok", report.ok, "#2e8b57"),
        ("shed", report.shed, "#e69500"),
        ("expired", report.expired, "#b8860b"),
        ("failed", report.failed, "#c00"),
        ("no result", report.missing, "#555"),
        (
            "not sent",
            report.send_errors + report.unsent + report.pending,
            "#999",
        ),
    ];
    let total = report.due().max(1) as f64;
    for (i, (label, n, colour)) in rows.iter().enumerate() {
        let top = PLOT_Y + i as f64 * 56.0;
        let w = (*n as f64 / total).min(1.0) * BARS_W;
        let _ = writeln!(
            out,
            "<g class=\"outcome\"><text x=\"{BARS_X}\" y=\"{:.1}\">{label}: {n}</text>\
             <rect x=\"{BARS_X}\" y=\"{:.1}\" width=\"{BARS_W}\" height=\"16\" fill=\"#f2f2f2\"/>\
             <rect x=\"{BARS_X}\" y=\"{:.1}\" width=\"{w:.1}\" height=\"16\" fill=\"{colour}\"/></g>",
            top + 12.0,
            top + 18.0,
            top + 18.0
        );
    }
    out.push_str("</svg>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::Percentiles;

    fn report() -> Report {
        Report {
            cameras: 4,
            fps: 10.0,
            duration_s: 10.0,
            budget_ms: 80,
            sent: 400,
            ok: 396,
            shed: 4,
            ok_within_budget: 396,
            slo_attainment: 0.99,
            e2e_ms: Percentiles {
                p50: 4.7,
                p90: 6.0,
                p95: 6.5,
                p99: 7.2,
                max: 9.9,
            },
            e2e_cdf_ms: vec![[3.0, 0.0], [4.7, 0.5], [7.2, 0.99], [9.9, 1.0]],
            ..Report::default()
        }
    }

    /// The numbers in `points="…"` of the element with `id`.
    fn points(svg: &str, id: &str) -> Vec<(f64, f64)> {
        let at = svg.find(&format!("id=\"{id}\"")).expect("element");
        let rest = &svg[at..];
        let start = rest.find("points=\"").expect("points") + 8;
        let end = start + rest[start..].find('"').unwrap();
        rest[start..end]
            .split_whitespace()
            .map(|p| {
                let (a, b) = p.split_once(',').unwrap();
                (a.parse().unwrap(), b.parse().unwrap())
            })
            .collect()
    }

    #[test]
    fn the_cdf_rises_left_to_right_and_the_budget_sits_at_its_latency() {
        let r = report();
        let svg = render(&r);
        assert!(svg.starts_with("<svg ") && svg.trim_end().ends_with("</svg>"));
        assert_eq!(axis_end_ms(&r), 100.0);
        let pts = points(&svg, "cdf");
        assert_eq!(pts.len(), r.e2e_cdf_ms.len() + 1);
        for w in pts.windows(2) {
            assert!(w[1].0 >= w[0].0, "x goes back: {pts:?}");
            assert!(
                w[1].1 <= w[0].1,
                "the CDF falls (svg y grows down): {pts:?}"
            );
        }
        // the last point is 100 % (the plot's top); 9.9 ms of a 100 ms axis
        let (lx, ly) = *pts.last().unwrap();
        assert!((ly - PLOT_Y).abs() < 0.05, "{ly}");
        assert!((lx - (PLOT_X + 0.099 * PLOT_W)).abs() < 0.05, "{lx}");
        // the budget line: 80 of 100 ms
        let want = format!("x1=\"{:.1}\"", PLOT_X + 0.8 * PLOT_W);
        let budget = &svg[svg.find("id=\"budget\"").unwrap()..];
        assert!(budget.contains(&want), "{budget}");
        assert!(svg.contains("ok: 396") && svg.contains("shed: 4"), "{svg}");
        assert_eq!(svg.matches("class=\"outcome\"").count(), 6);
        assert!(svg.contains("400 frames sent of 400 due"), "{svg}");
        assert_eq!(svg.matches('<').count(), svg.matches('>').count());
    }

    #[test]
    fn frames_due_but_never_sent_get_their_own_bar() {
        let mut r = report();
        (r.unsent, r.pending, r.send_errors) = (70, 20, 10);
        let svg = render(&r);
        assert!(svg.contains("400 frames sent of 500 due"), "{svg}");
        assert!(svg.contains("not sent: 100"), "{svg}");
        // its bar is a fifth of the column; ok's (396 of 500) is wider
        let widths: Vec<f64> = svg
            .match_indices("fill=\"#999\"")
            .filter_map(|(i, _)| {
                let rect = &svg[svg[..i].rfind("<rect").unwrap()..i];
                let w = rect.split("width=\"").nth(1)?.split('"').next()?;
                w.parse().ok()
            })
            .collect();
        assert_eq!(widths, vec![BARS_W * 0.2], "{svg}");
    }

    #[test]
    fn a_run_with_no_ok_frame_still_draws_and_slow_runs_widen_the_axis() {
        let mut r = report();
        r.e2e_cdf_ms.clear();
        assert!(render(&r).contains("no frame ended ok"));
        r.e2e_ms.p99 = 430.0;
        assert_eq!(axis_end_ms(&r), 500.0);
        assert_eq!(nice_step(0.0), 1.0);
        assert_eq!(nice_step(17.0), 20.0);
        assert_eq!(nice_step(0.3), 0.5);
    }
}
