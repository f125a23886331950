//! How the page writes what it shows: text escaped for HTML, numbers or a
//! dash, instants as ISO 8601 UTC, lengths of time and times in words.

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

/// `v` to `digits` decimals, or a dash.
pub(super) fn num(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "—".into(), |v| format!("{v:.digits$}"))
}

/// `v` ms to a tenth, or a dash.
pub(super) fn ms(v: Option<f64>) -> String {
    v.map_or_else(|| "—".into(), |v| format!("{v:.1} ms"))
}

/// A ratio as a percentage, or a dash.
pub(super) fn pct(r: Option<f64>) -> String {
    r.map_or_else(|| "—".into(), |r| format!("{:.1} %", r * 100.0))
}

/// `ms` since the Unix epoch as ISO 8601 UTC, to the second
/// (`2026-12-05T04:37:13Z`).
pub fn iso8601(ms: u64) -> String {
    let full = crate::api::json::rfc3339(ms);
    format!("{}Z", &full[..19])
}

/// A length of time in words: `45 s`, `12 min`, `3 h 5 min`, `4 d`.
pub fn span(ms: u64) -> String {
    let s = (ms + 500) / 1000;
    match s {
        0..60 => format!("{s} s"),
        60..3600 => format!("{} min", s / 60),
        3600..172_800 => format!("{} h {} min", s / 3600, s / 60 % 60),
        _ => format!("{} d", s / 86_400),
    }
}

/// A time as people read it (`3 min ago`, `in 12 min`), with its ISO 8601
/// UTC in the title (`when()` in the script).
pub(super) fn when(at_ms: u64, now_ms: u64) -> String {
    let text = match at_ms.abs_diff(now_ms) {
        0..2000 => "just now".to_string(),
        d if at_ms < now_ms => format!("{} ago", span(d)),
        d => format!("in {}", span(d)),
    };
    let iso = iso8601(at_ms);
    format!("<time datetime=\"{iso}\" title=\"{iso}\">{text}</time>")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::fixtures::NOW;

    #[test]
    fn times_read_as_iso_8601_and_in_words() {
        assert_eq!(iso8601(0), "1970-01-01T00:00:00Z");
        assert_eq!(iso8601(NOW), "2025-12-02T17:00:00Z");
        assert_eq!(iso8601(951_782_400_999), "2000-02-29T00:00:00Z");
        assert_eq!(iso8601(1_709_213_400_000), "2024-02-29T13:30:00Z");
        // every instant parses back to itself, to the second
        for ms in [
            0,
            86_399_000,
            951_868_799_000,
            NOW + 59_000,
            4_102_444_800_000,
        ] {
            assert_eq!(crate::api::parse_time(&iso8601(ms)), Ok(ms), "{ms}");
        }
        assert_eq!(span(44_600), "45 s");
        assert_eq!(span(12 * 60_000 + 59_000), "12 min");
        assert_eq!(span(3 * 3_600_000 + 5 * 60_000), "3 h 5 min");
        assert_eq!(span(4 * 86_400_000), "4 d");
        assert_eq!(
            when(NOW - 180_000, NOW),
            "<time datetime=\"2025-12-02T16:57:00Z\" title=\"2025-12-02T16:57:00Z\">3 min ago</time>"
        );
        assert!(when(NOW + 20 * 60_000, NOW).ends_with(">in 20 min</time>"));
        assert!(when(NOW - 1_000, NOW).ends_with(">just now</time>"));
    }

    #[test]
    fn outside_strings_are_escaped() {
        assert_eq!(
            escape(r#"<script>alert("x&y's")</script>"#),
            "&lt;script&gt;alert(&quot;x&amp;y&#39;s&quot;)&lt;/script&gt;"
        );
    }
}
