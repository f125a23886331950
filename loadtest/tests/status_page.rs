//! The live status page in a real browser: a gateway and a CPU BlazeFace
//! worker on 127.0.0.1, a short load from simulated cameras, then headless
//! Chromium loads `GET /`, runs its script (which fetches
//! `/api/v1/status` again) and dumps the document it drew.
//!
//! What must hold, whatever the machine's speed:
//! - under a light load: both plots have their lines, with points; the
//!   last minute's p95 is a number of ms no larger than the largest
//!   latency any interval saw; the worker's row has its batch time and
//!   its profile's; the cameras past the top ten are collapsed behind
//!   "N more"; times read "… ago" with ISO 8601 in their title, and no
//!   epoch milliseconds are shown; the problems banner is hidden; the
//!   script raised nothing (the page's own error box is empty, and
//!   Chromium logged no console message);
//! - with cameras open for a model whose last worker was drained, the
//!   banner says that no worker serves it; and the page, once its polls
//!   fail, keeps that state and says since when it is stale; thumbnails
//!   being off, the thumbnail route answers a JSON 404 saying how to turn
//!   them on, and the page has no thumbnail column;
//! - with `[status] thumbnails = true`, every camera sending JPEG frames
//!   has a thumbnail: a JPEG within `thumbnail_max_px` from the route, and
//!   on the page an `<img>` that loads.
//!
//! Skipped, saying so, when no Chromium is installed (`scripts/setup.sh`
//! installs Debian's `chromium`). Every wait is bounded; nothing asserts
//! on speed. `TIDEGATE_STATUS_SCREENSHOT=<path.png>` also saves the
//! light-load page there (how `docs/status-page.png` was taken).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::Value;
use tidegate_loadtest::cluster::{Cluster, ClusterOptions};
use tidegate_loadtest::loadgen;

/// One browser and one cluster at a time: two of each at once would load
/// a small machine enough to shed frames under the "light" load.
static SERIAL: Mutex<()> = Mutex::new(());

/// How long the cameras of the problem case send (s): long enough to
/// outlast the worker's drain and the page's rendering.
const PROBLEM_LOAD_SECS: f64 = 30.0;

/// Longest a Chromium run may take before it is killed.
const CHROMIUM_TIMEOUT: Duration = Duration::from_secs(90);

/// Cameras of the light load (1 frame/s each): more than the page lists
/// before collapsing.
const CAMERAS: usize = 12;

/// The light load's budget: one a CPU worker on a busy CI machine still
/// meets for 12 frames/s, so that nothing is shed and the banner stays
/// hidden (the page, not the machine's speed, is under test).
const LIGHT_BUDGET_MS: u32 = 250;

/// The browser: `TIDEGATE_CHROMIUM`, else the first of the usual names on
/// `PATH`.
fn chromium() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("TIDEGATE_CHROMIUM") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH")?;
    ["chromium", "chromium-browser", "google-chrome"]
        .iter()
        .flat_map(|name| std::env::split_paths(&path).map(move |d| d.join(name)))
        .find(|p| p.is_file())
}

/// `GET path` as JSON.
fn json(c: &Cluster, path: &str) -> Value {
    let (code, body) = c.get(path).unwrap_or_else(|e| panic!("GET {path}: {e:#}"));
    assert_eq!(code, 200, "GET {path}: {body}");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("{path}: {e}: {body}"))
}

/// Polls `check` every 200 ms until it holds, for at most `timeout`; a
/// failure quotes what it saw last.
fn wait_until(
    c: &Cluster,
    timeout: Duration,
    what: &str,
    mut check: impl FnMut() -> Result<(), String>,
) {
    let until = Instant::now() + timeout;
    loop {
        let seen = match check() {
            Ok(()) => return,
            Err(seen) => seen,
        };
        assert!(
            Instant::now() < until,
            "{what} within {timeout:?}; last saw {seen}\n{}",
            c.gateway_log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// What Chromium made of the page.
struct Rendered {
    /// The document after its script ran.
    dom: String,
    /// Chromium's log (console messages included).
    log: String,
}

/// Renders the status page in headless Chromium with `args` added,
/// letting its script run for 7 s of virtual time (three polls); killed
/// past [`CHROMIUM_TIMEOUT`].
fn render(browser: &Path, c: &Cluster, args: &[String]) -> Rendered {
    render_url(browser, c, &format!("http://{}/", c.http), args)
}

/// [`render`] of any `url` (its files in `c`'s directory).
fn render_url(browser: &Path, c: &Cluster, url: &str, args: &[String]) -> Rendered {
    let profile = tempfile::tempdir().expect("a temporary profile");
    let out = c.dir().join("chromium.out");
    let err = c.dir().join("chromium.err");
    let mut child = Command::new(browser)
        .args([
            "--headless",
            "--disable-gpu",
            "--no-sandbox",
            "--no-first-run",
            "--disable-dev-shm-usage",
            "--enable-logging=stderr",
            "--v=0",
            "--virtual-time-budget=7000",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args(args)
        .arg(url)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).expect("chromium's stdout file"))
        .stderr(std::fs::File::create(&err).expect("chromium's stderr file"))
        .spawn()
        .unwrap_or_else(|e| panic!("{}: {e}", browser.display()));
    let until = Instant::now() + CHROMIUM_TIMEOUT;
    let status = loop {
        if let Some(s) = child.try_wait().expect("chromium's status") {
            break s;
        }
        if Instant::now() > until {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "chromium did not finish within {CHROMIUM_TIMEOUT:?}: {}",
                std::fs::read_to_string(&err).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let log = std::fs::read_to_string(&err).unwrap_or_default();
    assert!(status.success(), "chromium failed ({status}): {log}");
    Rendered {
        dom: std::fs::read_to_string(&out).unwrap_or_default(),
        log,
    }
}

/// The element that starts with `start` up to the first `end` after it.
fn between<'a>(dom: &'a str, start: &str, end: &str) -> &'a str {
    let from = dom
        .find(start)
        .unwrap_or_else(|| panic!("no {start:?} in the page:\n{dom}"));
    let rest = &dom[from..];
    &rest[..rest.find(end).map_or(rest.len(), |i| i + end.len())]
}

/// The `points` of each `<polyline class="{class}">` in `svg`, counted.
fn plotted_points(svg: &str, class: &str) -> usize {
    let tag = format!("<polyline class=\"{class}\" points=\"");
    svg.match_indices(&tag)
        .map(|(i, _)| {
            let rest = &svg[i + tag.len()..];
            let points = &rest[..rest.find('"').unwrap_or(0)];
            points
                .split(' ')
                .filter(|p| {
                    let xy: Vec<f64> = p.split(',').filter_map(|v| v.parse().ok()).collect();
                    xy.len() == 2 && xy.iter().all(|v| v.is_finite())
                })
                .count()
        })
        .sum()
}

/// The text of each `<td>` of the table row holding `<td>{first}</td>`.
fn row_cells(table: &str, first: &str) -> Vec<String> {
    let row = between(table, &format!("<tr><td>{first}</td>"), "</tr>");
    row.split("<td")
        .skip(1)
        .map(|c| {
            let c = &c[c.find('>').map_or(0, |i| i + 1)..];
            c.split("</td>").next().unwrap_or("").to_string()
        })
        .collect()
}

/// The page with its two scripts taken out: what a reader sees.
fn visible(dom: &str) -> String {
    let mut out = String::new();
    let mut rest = dom;
    while let Some(i) = rest.find("<script") {
        out += &rest[..i];
        rest = rest[i..]
            .find("</script>")
            .map_or("", |j| &rest[i + j + "</script>".len()..]);
    }
    out + rest
}

/// The most digits in a row in `s` (epoch milliseconds have 13).
fn longest_digit_run(s: &str) -> usize {
    s.split(|c: char| !c.is_ascii_digit())
        .map(str::len)
        .max()
        .unwrap_or(0)
}

/// No console message, no uncaught exception, and an empty error box.
fn assert_script_ran_clean(r: &Rendered) {
    let console: Vec<&str> = r
        .log
        .lines()
        .filter(|l| l.contains(":CONSOLE") || l.contains("Uncaught"))
        .collect();
    assert!(console.is_empty(), "the page logged: {console:#?}");
    assert!(
        r.dom.contains("<pre id=\"page-errors\" hidden=\"\"></pre>"),
        "the page caught an error: {}",
        between(&r.dom, "<pre id=\"page-errors\"", "</pre>")
    );
}

/// Starts a gateway and one CPU worker, and sends `cameras` × `fps` for
/// `seconds` with a `budget_ms` budget, obeying the gateway's frame-rate
/// hints or not.
fn cluster_under_load(
    cameras: usize,
    fps: f64,
    seconds: f64,
    budget_ms: u32,
    obey_hints: bool,
) -> Cluster {
    let mut c = Cluster::start(&ClusterOptions::default()).expect("gateway starts");
    c.spawn_worker("worker-1").expect("worker starts");
    c.wait_for_workers(1, Duration::from_secs(90))
        .expect("worker registers");
    let mut opts = c.load_options("edge-1", cameras, fps, seconds);
    opts.in_step = false;
    opts.budget_ms = budget_ms;
    opts.obey_hints = obey_hints;
    loadgen::run_blocking(&opts).expect("the simulated edge runs");
    c
}

/// The plots' lines, with points, against their limits; and the last
/// minute's p95 card, in ms, within what the intervals saw.
fn assert_plots_drawn(dom: &str, status: &Value) {
    // The plots: each percentile's line and the shed rate's, with points.
    let latency = between(dom, "<svg id=\"latency-plot\"", "</svg>");
    for class in ["p50", "p95", "p99"] {
        let n = plotted_points(latency, class);
        assert!(n >= 2, "{class}: {n} points in {latency}");
    }
    assert!(
        latency.contains("class=\"limit\""),
        "the budget line: {latency}"
    );
    let key = format!("<span id=\"budget-key\">budget {LIGHT_BUDGET_MS} ms</span>");
    assert!(dom.contains(&key), "the budget's key");
    let shed = between(dom, "<svg id=\"shed-plot\"", "</svg>");
    assert!(plotted_points(shed, "shed") >= 2, "{shed}");

    // The last minute's p95, in ms, within what the intervals saw.
    let card = between(dom, "<div class=\"card\" id=\"card-p95\">", "</div>");
    let p95: f64 = between(card, "<b>", "</b>")
        .trim_start_matches("<b>")
        .trim_end_matches(" ms</b>")
        .parse()
        .unwrap_or_else(|e| panic!("p95 card {card}: {e}"));
    let worst = status["points"]
        .as_array()
        .expect("points")
        .iter()
        .filter_map(|p| p["latency"]["max_ms"].as_f64())
        .fold(0.0, f64::max);
    assert!(
        p95 > 0.0 && p95 <= worst + 0.05,
        "p95 {p95} ms, worst {worst} ms"
    );
}

/// The worker's row with its batch time and its profile's; the cameras
/// past the top ten collapsed behind a button.
fn assert_tables_drawn(dom: &str) {
    // The worker's row: batches, their time, and its profile's.
    let workers = between(dom, "<div id=\"workers\">", "</div>");
    let cells = row_cells(workers, "worker-1");
    assert_eq!(cells[1], "blazeface", "{cells:?}");
    let batches: u64 = cells[4].parse().expect("batches");
    assert!(batches > 0, "{cells:?}");
    for (i, what) in [
        (7, "mean batch time"),
        (9, "worker's own time"),
        (10, "profile at mean batch"),
    ] {
        assert!(
            cells[i].ends_with(" ms") && cells[i] != "— ms",
            "{what}: {cells:?}"
        );
    }
    assert!(cells[11].starts_with("× "), "own vs profile: {cells:?}");

    // Cameras: the top ten, then the rest behind a button.
    let more = between(dom, "<button id=\"cameras-more\"", "</button>");
    assert!(
        more.ends_with(&format!(">{} more</button>", CAMERAS - 10)),
        "{more}"
    );
    let cameras = between(dom, "<div id=\"cameras\">", "</div>");
    assert_eq!(cameras.matches("<tr>").count(), 1 + 10, "{cameras}");
    assert_eq!(
        cameras.matches("<tr hidden=\"\">").count(),
        CAMERAS - 10,
        "{cameras}"
    );
}

#[test]
fn the_status_page_draws_latency_workers_and_cameras_live_and_flags_nothing_under_light_load() {
    let Some(browser) = chromium() else {
        eprintln!(
            "SKIPPED: no chromium on PATH (scripts/setup.sh installs Debian's chromium; or set TIDEGATE_CHROMIUM)"
        );
        return;
    };
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let c = cluster_under_load(CAMERAS, 1.0, 15.0, LIGHT_BUDGET_MS, true);
    // Two closed intervals with latency reports, for lines of two points.
    wait_until(
        &c,
        Duration::from_secs(30),
        "two intervals with latency",
        || {
            let t = json(&c, "/api/v1/timeline");
            let with = t["points"]
                .as_array()
                .map_or(0, |p| p.iter().filter(|p| !p["latency"].is_null()).count());
            if with >= 2 {
                Ok(())
            } else {
                Err(t["points"].to_string())
            }
        },
    );
    let shot = c.dir().join("status.png");
    let mut args = vec![
        "--dump-dom".to_string(),
        "--window-size=1280,900".into(),
        format!("--screenshot={}", shot.display()),
    ];
    if let Some(keep) = std::env::var_os("TIDEGATE_STATUS_SCREENSHOT") {
        args[2] = format!("--screenshot={}", Path::new(&keep).display());
    }
    let r = render(&browser, &c, &args);
    let status = json(&c, "/api/v1/status");
    assert_script_ran_clean(&r);

    assert_plots_drawn(&r.dom, &status);
    assert_tables_drawn(&r.dom);

    // Times read as people read them, never as epoch milliseconds.
    let seen = visible(&r.dom);
    assert!(seen.contains(" ago</time>"), "{seen}");
    assert!(seen.contains("title=\"20"), "ISO 8601 titles: {seen}");
    assert!(
        longest_digit_run(&seen) < 13,
        "an epoch ms on the page: {seen}"
    );

    // Nothing is wrong.
    assert!(
        r.dom.contains("<div id=\"banner\" hidden=\"\">"),
        "{}",
        between(&r.dom, "<div id=\"banner\"", "</div>")
    );
    assert_eq!(status["problems"], Value::Array(Vec::new()));

    let png =
        std::fs::read(std::env::var_os("TIDEGATE_STATUS_SCREENSHOT").map_or(shot, PathBuf::from))
            .expect("the screenshot");
    assert!(
        png.starts_with(b"\x89PNG\r\n\x1a\n") && png.len() > 10_000,
        "a PNG of the page"
    );
}

#[test]
fn the_status_page_banner_flags_cameras_whose_model_lost_its_last_worker() {
    let Some(browser) = chromium() else {
        eprintln!(
            "SKIPPED: no chromium on PATH (scripts/setup.sh installs Debian's chromium; or set TIDEGATE_CHROMIUM)"
        );
        return;
    };
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut c = Cluster::start(&ClusterOptions::default()).expect("gateway starts");
    c.spawn_worker("worker-1").expect("worker starts");
    c.wait_for_workers(1, Duration::from_secs(90))
        .expect("worker registers");
    // Cameras open while the worker serves, and keep sending after it
    // has gone (for at most PROBLEM_LOAD_SECS).
    let mut opts = c.load_options("edge-1", 4, 2.0, PROBLEM_LOAD_SECS);
    opts.in_step = false;
    let load = std::thread::spawn(move || loadgen::run_blocking(&opts));
    wait_until(&c, Duration::from_secs(30), "4 cameras open", || {
        let cams = json(&c, "/api/v1/cameras");
        match cams.as_array().map_or(0, Vec::len) {
            4 => Ok(()),
            _ => Err(cams.to_string()),
        }
    });
    // The operator drains the only worker: it finishes and leaves.
    let (code, body) = c
        .post("/api/v1/workers/worker-1/drain", Some(&c.admin_token))
        .expect("POST drain");
    assert_eq!(code, 202, "{body}");
    wait_until(&c, Duration::from_secs(30), "the worker gone", || {
        let workers = json(&c, "/api/v1/workers");
        match workers.as_array().map_or(0, Vec::len) {
            0 => Ok(()),
            _ => Err(workers.to_string()),
        }
    });
    let r = render(&browser, &c, &["--dump-dom".to_string()]);
    assert_script_ran_clean(&r);
    let banner = between(&r.dom, "<div id=\"banner\"", "</div>");
    assert!(!banner.contains("hidden"), "{banner}");
    let item = between(banner, "<li data-kind=\"no_worker\">", "</li>");
    assert!(
        item.contains("no worker serves model blazeface for its 4 open camera(s)"),
        "{item}"
    );
    // Thumbnails are off by default: the route says how to turn them on,
    // and the page has no column for them.
    let (code, body) = c
        .get("/api/v1/cameras/edge-1/cam-0/thumbnail.jpg")
        .expect("GET thumbnail");
    assert_eq!(code, 404, "{body}");
    let error: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
    let message = error["error"].as_str().unwrap_or_default();
    assert!(
        message.contains("[status]") && message.contains("thumbnails = true"),
        "{body}"
    );
    assert!(
        !r.dom.contains("<th>latest frame</th>"),
        "no thumbnail column when off"
    );
    // The page while the cameras are still open, for the stale check.
    let (code, html) = c.get("/").expect("GET /");
    assert_eq!(code, 200, "{html}");
    load.join()
        .expect("the simulated edge did not panic")
        .expect("the simulated edge ran to its end");

    // The same page opened where its polls cannot reach the gateway: it
    // keeps the state it came with, and says it is stale.
    let saved = c.dir().join("saved-status.html");
    std::fs::write(&saved, html).expect("the page saved");
    let url = format!("file://{}", saved.display());
    let r = render_url(&browser, &c, &url, &["--dump-dom".to_string()]);
    let stale = between(&r.dom, "<span id=\"stale\"", "</span>");
    assert!(
        stale.starts_with("<span id=\"stale\">Stale since <time")
            && stale.contains("the last fetch failed")
            && stale.ends_with("; showing the last state</span>"),
        "{stale}"
    );
    assert!(
        r.dom.contains("<li data-kind=\"no_worker\">"),
        "the last state is kept"
    );
    assert!(
        r.dom.contains("<div class=\"card\" id=\"card-p95\">"),
        "the script drew the state it came with"
    );
}

/// `GET path` on the gateway: the head (lower-case) and the body's bytes.
fn get_bytes(c: &Cluster, path: &str) -> (String, Vec<u8>) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(c.http).expect("the gateway's HTTP port");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("a read timeout");
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: gateway\r\nConnection: close\r\n\r\n"
    )
    .expect("the request sent");
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("the answer read");
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no head: {}", String::from_utf8_lossy(&raw)));
    let head = String::from_utf8_lossy(&raw[..end]).to_ascii_lowercase();
    (head, raw[end + 4..].to_vec())
}

/// Longest side of the thumbnails of the case below (px).
const THUMBNAIL_MAX_PX: u32 = 96;

#[test]
fn camera_thumbnails_when_on_are_bounded_jpegs_that_the_page_shows() {
    let Some(browser) = chromium() else {
        eprintln!(
            "SKIPPED: no chromium on PATH (scripts/setup.sh installs Debian's chromium; or set TIDEGATE_CHROMIUM)"
        );
        return;
    };
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // ClusterOptions has no `[status]` lines; its `[limits]` lines end
    // the file, so a `[status]` table can follow them.
    let opts = ClusterOptions {
        limits: format!(
            "\n[status]\nthumbnails = true\nthumbnail_interval_ms = 500\nthumbnail_max_px = {THUMBNAIL_MAX_PX}\n"
        ),
        ..ClusterOptions::default()
    };
    let mut c = Cluster::start(&opts).expect("gateway starts");
    c.spawn_worker("worker-1").expect("worker starts");
    c.wait_for_workers(1, Duration::from_secs(90))
        .expect("worker registers");
    // Cameras stay open for the whole case (a thumbnail goes with its
    // camera), sending JPEG frames of the test picture.
    let mut load_opts = c.load_options("edge-1", 3, 2.0, PROBLEM_LOAD_SECS);
    load_opts.in_step = false;
    load_opts.budget_ms = LIGHT_BUDGET_MS;
    load_opts.encoding = tidegate_protocol::Encoding::Jpeg { quality: 85 };
    let load = std::thread::spawn(move || loadgen::run_blocking(&load_opts));
    wait_until(
        &c,
        Duration::from_secs(30),
        "a thumbnail of each of 3 cameras",
        || {
            let status = json(&c, "/api/v1/status");
            let cams = status["cameras"].as_array().cloned().unwrap_or_default();
            let with = cams.iter().filter(|c| c["thumbnail"].is_u64()).count();
            if with == 3 && status["thumbnails"]["max_px"] == THUMBNAIL_MAX_PX {
                Ok(())
            } else {
                Err(status.to_string())
            }
        },
    );
    let status = json(&c, "/api/v1/status");
    for cam in status["cameras"].as_array().expect("cameras") {
        let (edge, camera) = (
            cam["edge"].as_str().unwrap(),
            cam["camera"].as_str().unwrap(),
        );
        let (head, body) = get_bytes(
            &c,
            &format!("/api/v1/cameras/{edge}/{camera}/thumbnail.jpg"),
        );
        assert!(head.starts_with("http/1.1 200"), "{head}");
        assert!(head.contains("content-type: image/jpeg"), "{head}");
        assert!(head.contains("cache-control: no-store"), "{head}");
        let img = image::load_from_memory_with_format(&body, image::ImageFormat::Jpeg)
            .unwrap_or_else(|e| panic!("{camera}: not a JPEG ({e})"));
        let (w, h) = (img.width(), img.height());
        assert!(
            w > 0 && h > 0 && w.max(h) <= THUMBNAIL_MAX_PX,
            "{camera}: {w}×{h}"
        );
        // BlazeFace finds the test picture's face: its box is drawn.
        let lime = img
            .to_rgb8()
            .pixels()
            .filter(|p| p[1] > 180 && p[0] < 100 && p[2] < 100)
            .count();
        assert!(lime >= 8, "{camera}: no box outline ({lime} lime pixels)");
    }

    let r = render(&browser, &c, &["--dump-dom".to_string()]);
    assert_script_ran_clean(&r);
    let cameras = between(&r.dom, "<div id=\"cameras\">", "</div>");
    assert!(cameras.contains("<th>latest frame</th>"), "{cameras}");
    let imgs: Vec<&str> = cameras
        .match_indices("<img ")
        .map(|(i, _)| &cameras[i..i + cameras[i..].find('>').unwrap_or(0)])
        .collect();
    assert_eq!(imgs.len(), 3, "{cameras}");
    for img in imgs {
        assert!(img.contains("thumbnail.jpg?n="), "{img}");
        // The page puts the drawn size in the title once it has loaded.
        let title = between(img, "title=\"", " px\"");
        let size: Vec<u32> = title
            .trim_start_matches("title=\"")
            .trim_end_matches(" px\"")
            .split('×')
            .filter_map(|v| v.parse().ok())
            .collect();
        assert!(
            size.len() == 2 && size[0] > 0 && size[0].max(size[1]) <= THUMBNAIL_MAX_PX,
            "loaded within the bound: {img}"
        );
    }
    load.join()
        .expect("the simulated edge did not panic")
        .expect("the simulated edge ran to its end");

    // The metrics count each render once: every camera's was rendered,
    // and the refusals are the status page's (none: JPEG pictures).
    let status = json(&c, "/api/v1/status");
    let (code, metrics) = c.get("/metrics").expect("GET /metrics");
    assert_eq!(code, 200, "{metrics}");
    let counted = |result: &str| -> f64 {
        let series = format!("tidegate_thumbnails_total{{result=\"{result}\"}} ");
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(series.as_str()))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {series} in:\n{metrics}"))
    };
    assert!(counted("rendered") >= 3.0, "{metrics}");
    assert_eq!(
        counted("refused"),
        status["thumbnails"]["refused"]
            .as_f64()
            .expect("thumbnails.refused"),
        "{status}"
    );
}
