//! How the API writes an instant: [`Timestamp`], RFC 3339 UTC with
//! milliseconds, and its schema in the document.

use serde::Serialize;
use utoipa::ToSchema;

/// An instant: ms since the Unix epoch inside, RFC 3339 UTC with
/// milliseconds on the wire (`2026-12-05T22:57:07.123Z`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(pub u64);

/// The pattern every [`Timestamp`] matches (also in the document).
pub const TIMESTAMP_PATTERN: &str = r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z$";

impl Serialize for Timestamp {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&rfc3339(self.0))
    }
}

impl utoipa::PartialSchema for Timestamp {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{KnownFormat, ObjectBuilder, SchemaFormat, Type};
        ObjectBuilder::new()
            .schema_type(Type::String)
            .format(Some(SchemaFormat::KnownFormat(KnownFormat::DateTime)))
            .pattern(Some(TIMESTAMP_PATTERN))
            .description(Some("An instant: RFC 3339, UTC, with milliseconds."))
            .examples([serde_json::json!("2026-12-05T22:57:07.123Z")])
            .into()
    }
}

impl ToSchema for Timestamp {}

/// `ms` since the Unix epoch as RFC 3339 UTC with milliseconds
/// (`2026-12-05T22:57:07.123Z`).
pub fn rfc3339(ms: u64) -> String {
    let secs = ms / 1000;
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        ms % 1000
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instants_are_rfc3339_utc_with_milliseconds() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(1_764_694_800_250), "2025-12-02T17:00:00.250Z");
        assert_eq!(rfc3339(951_782_400_007), "2000-02-29T00:00:00.007Z");
        assert_eq!(
            serde_json::to_value(Timestamp(1_709_213_400_999)).unwrap(),
            serde_json::json!("2024-02-29T13:30:00.999Z")
        );
    }

    proptest::proptest! {
        /// What the API writes, its `from`/`to` parse back to the same ms.
        #[test]
        fn written_instants_parse_back(ms in 0u64..253_402_300_800_000) {
            let text = rfc3339(ms);
            proptest::prop_assert_eq!(crate::api::parse_time(&text), Ok(ms));
            proptest::prop_assert_eq!(text.len(), 24);
        }
    }
}
