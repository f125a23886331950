//! The server-drawn tables, written as the page's script draws them.

use super::format::escape;

/// A cell of a server-drawn table: text (escaped when drawn) or markup.
pub(super) enum Cell {
    Text(String),
    Markup(String),
}

impl From<String> for Cell {
    fn from(s: String) -> Cell {
        Cell::Text(s)
    }
}

impl From<&str> for Cell {
    fn from(s: &str) -> Cell {
        Cell::Text(s.to_string())
    }
}

/// A table as the page's script draws it (`table()` in
/// `status_page.html`): `numeric` columns right-aligned, rows from
/// `hide_from` on hidden; or a line saying there is nothing.
pub(super) fn table_html(
    head: &[&str],
    rows: Vec<Vec<Cell>>,
    none: &str,
    numeric: &[usize],
    hide_from: Option<usize>,
) -> String {
    if rows.is_empty() {
        return format!("<p class=\"none\">{}</p>", escape(none));
    }
    let mut out = String::from("<table><tr>");
    for h in head {
        out += &format!("<th>{}</th>", escape(h));
    }
    out += "</tr>";
    for (k, row) in rows.into_iter().enumerate() {
        let hidden = hide_from.is_some_and(|h| k >= h);
        out += if hidden { "<tr hidden=\"\">" } else { "<tr>" };
        for (i, c) in row.into_iter().enumerate() {
            let class = if numeric.contains(&i) {
                " class=\"n\""
            } else {
                ""
            };
            let inner = match c {
                Cell::Text(t) => escape(&t),
                Cell::Markup(m) => m,
            };
            out += &format!("<td{class}>{inner}</td>");
        }
        out += "</tr>";
    }
    out + "</table>"
}
