//! Camera source URIs: what each scheme means and how it is checked, before
//! any GStreamer element exists.
//!
//! Each scheme maps to one [`SourceUri`] variant; a new source is a new
//! variant here plus a new arm in the pipeline builder.

use std::path::PathBuf;
use std::str::FromStr;

/// Source size of a `test://` pattern when the URI gives none.
pub const DEFAULT_TEST_WIDTH: u32 = 640;
/// Source size of a `test://` pattern when the URI gives none.
pub const DEFAULT_TEST_HEIGHT: u32 = 480;
/// Largest source side a `test://` URI may ask for.
pub const MAX_TEST_SIDE: u32 = 16_384;

/// The schemes this build understands, for error messages.
const SUPPORTED: &str = "rtsp://host:554/path, v4l2:///dev/video0, file:///abs/video.mp4, image:///abs/still.png or test://smpte?width=1920&height=1080";

/// A parsed camera source.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SourceUri {
    /// `image:///abs/path.png`: a still image, decoded once and played as live
    /// video.
    Image {
        /// Absolute path of the image file.
        path: PathBuf,
    },
    /// `test://<pattern>?width=W&height=H`: a live GStreamer test pattern.
    Test {
        /// `videotestsrc` pattern nick (`smpte`, `ball`, `white`, ...).
        pattern: String,
        /// Source width in pixels.
        width: u32,
        /// Source height in pixels.
        height: u32,
    },
    /// `file:///abs/video.mp4`: a video file, played at most at the camera's
    /// frame rate.
    File {
        /// Absolute path of the file.
        path: PathBuf,
        /// The URI as given, for `uridecodebin`.
        uri: String,
    },
    /// `rtsp://[user:pass@]host[:port]/path` (or `rtsps://`): a network
    /// camera, over TCP or UDP as the camera's configuration says.
    Rtsp {
        /// The URI as given, for `rtspsrc`.
        uri: String,
    },
    /// `v4l2:///dev/videoN`: a local camera through Video4Linux2.
    V4l2 {
        /// The device node.
        device: PathBuf,
    },
}

/// Why a source URI cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum UriError {
    /// The URI has no `scheme://` prefix.
    #[error("it has no scheme; write it as {SUPPORTED}")]
    NoScheme,
    /// The scheme is not one this build can capture from.
    #[error("scheme '{scheme}' is not supported; use {SUPPORTED}")]
    UnsupportedScheme {
        /// The scheme found.
        scheme: String,
    },
    /// An `rtsp://` URI names no host.
    #[error("it names no host; write it as rtsp://host[:port]/path")]
    MissingHost,
    /// A `v4l2://` URI does not name an absolute device path.
    #[error("it does not name a device; write it as v4l2:///dev/video0")]
    BadDevice,
    /// An `image://` or `file://` URI does not name an absolute local path.
    #[error(
        "it does not name an absolute local file ({reason}); write it as {scheme}:///absolute/path"
    )]
    BadPath {
        /// The scheme (`image` or `file`).
        scheme: &'static str,
        /// What GLib said about the path.
        reason: String,
    },
    /// A `test://` URI names no pattern.
    #[error("test:// needs a pattern name, e.g. test://smpte or test://ball?width=1280&height=720")]
    MissingPattern,
    /// A `test://` query parameter is unknown or its value is not valid.
    #[error(
        "query parameter '{param}' is not valid; test:// accepts width and height as integers from 1 to {MAX_TEST_SIDE}, e.g. test://ball?width=1280&height=720"
    )]
    BadQuery {
        /// The offending `key=value` pair.
        param: String,
    },
}

impl FromStr for SourceUri {
    type Err = UriError;

    fn from_str(uri: &str) -> Result<Self, UriError> {
        let (scheme, rest) = uri.split_once("://").ok_or(UriError::NoScheme)?;
        match scheme.to_ascii_lowercase().as_str() {
            "image" => Ok(SourceUri::Image {
                path: local_path("image", rest)?,
            }),
            "file" => Ok(SourceUri::File {
                path: local_path("file", rest)?,
                uri: uri.to_owned(),
            }),
            "test" => parse_test(rest),
            "rtsp" | "rtsps" => {
                let host = rest.split(['/', '?']).next().unwrap_or("");
                let host = host.rsplit_once('@').map_or(host, |(_, h)| h);
                if host.is_empty() || host.starts_with(':') {
                    return Err(UriError::MissingHost);
                }
                Ok(SourceUri::Rtsp {
                    uri: uri.to_owned(),
                })
            }
            "v4l2" => {
                let device = PathBuf::from(rest);
                if !device.is_absolute() || rest.len() < 2 || rest.contains('?') {
                    return Err(UriError::BadDevice);
                }
                Ok(SourceUri::V4l2 { device })
            }
            "" => Err(UriError::NoScheme),
            other => Err(UriError::UnsupportedScheme {
                scheme: other.to_owned(),
            }),
        }
    }
}

/// Decodes the path part of a local URI (percent escapes, `localhost` host)
/// the way GStreamer itself does.
fn local_path(scheme: &'static str, rest: &str) -> Result<PathBuf, UriError> {
    let file_uri = format!("file://{rest}");
    gstreamer::glib::filename_from_uri(&file_uri)
        .map(|(path, _host)| path)
        .map_err(|e| UriError::BadPath {
            scheme,
            reason: e.message().to_owned(),
        })
}

fn parse_test(rest: &str) -> Result<SourceUri, UriError> {
    let (pattern, query) = rest.split_once('?').unwrap_or((rest, ""));
    let pattern = pattern.trim_end_matches('/');
    if pattern.is_empty() {
        return Err(UriError::MissingPattern);
    }
    let (mut width, mut height) = (DEFAULT_TEST_WIDTH, DEFAULT_TEST_HEIGHT);
    for param in query.split('&').filter(|p| !p.is_empty()) {
        let bad = || UriError::BadQuery {
            param: param.to_owned(),
        };
        let (key, value) = param.split_once('=').ok_or_else(bad)?;
        let value: u32 = value
            .parse()
            .ok()
            .filter(|v| (1..=MAX_TEST_SIDE).contains(v))
            .ok_or_else(bad)?;
        match key {
            "width" => width = value,
            "height" => height = value,
            _ => return Err(bad()),
        }
    }
    Ok(SourceUri::Test {
        pattern: pattern.to_owned(),
        width,
        height,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_uri_reads_pattern_and_source_size() {
        let uri: SourceUri = "test://smpte?width=1920&height=1080".parse().unwrap();
        assert_eq!(
            uri,
            SourceUri::Test {
                pattern: "smpte".into(),
                width: 1920,
                height: 1080
            }
        );
    }

    #[test]
    fn test_uri_without_query_uses_default_size() {
        let uri: SourceUri = "test://ball".parse().unwrap();
        assert_eq!(
            uri,
            SourceUri::Test {
                pattern: "ball".into(),
                width: DEFAULT_TEST_WIDTH,
                height: DEFAULT_TEST_HEIGHT
            }
        );
    }

    #[test]
    fn test_uri_rejects_unknown_or_zero_query_values() {
        for uri in [
            "test://ball?depth=3",
            "test://ball?width=0",
            "test://ball?width=abc",
            "test://ball?height",
        ] {
            let err = uri.parse::<SourceUri>().unwrap_err();
            assert!(matches!(err, UriError::BadQuery { .. }), "{uri}: {err}");
        }
    }

    #[test]
    fn test_uri_without_pattern_is_rejected() {
        assert_eq!(
            "test://".parse::<SourceUri>().unwrap_err(),
            UriError::MissingPattern
        );
    }

    #[test]
    fn image_uri_decodes_percent_escapes_to_an_absolute_path() {
        let uri: SourceUri = "image:///srv/cams/front%20door.png".parse().unwrap();
        assert_eq!(
            uri,
            SourceUri::Image {
                path: PathBuf::from("/srv/cams/front door.png")
            }
        );
    }

    #[test]
    fn relative_image_path_is_rejected_with_a_hint() {
        let err = "image://still.png".parse::<SourceUri>().unwrap_err();
        assert!(matches!(err, UriError::BadPath { .. }));
        assert!(err.to_string().contains("image:///absolute/path"), "{err}");
    }

    #[test]
    fn file_uri_keeps_the_original_uri_for_the_decoder() {
        let uri: SourceUri = "file:///tmp/a.mp4".parse().unwrap();
        assert_eq!(
            uri,
            SourceUri::File {
                path: PathBuf::from("/tmp/a.mp4"),
                uri: "file:///tmp/a.mp4".into()
            }
        );
    }

    #[test]
    fn rtsp_uri_is_kept_whole_and_needs_a_host() {
        for uri in [
            "rtsp://cam.local:8554/stream",
            "rtsp://user:secret@10.0.0.7/h264",
            "RTSPS://cam/x",
        ] {
            assert_eq!(
                uri.parse::<SourceUri>().unwrap(),
                SourceUri::Rtsp { uri: uri.into() }
            );
        }
        for uri in ["rtsp:///path", "rtsp://:554/x", "rtsp://user@/x"] {
            assert_eq!(
                uri.parse::<SourceUri>().unwrap_err(),
                UriError::MissingHost,
                "{uri}"
            );
        }
    }

    #[test]
    fn v4l2_uri_names_an_absolute_device() {
        assert_eq!(
            "v4l2:///dev/video2".parse::<SourceUri>().unwrap(),
            SourceUri::V4l2 {
                device: PathBuf::from("/dev/video2")
            }
        );
        for uri in ["v4l2://video0", "v4l2://", "v4l2:///"] {
            assert_eq!(
                uri.parse::<SourceUri>().unwrap_err(),
                UriError::BadDevice,
                "{uri}"
            );
        }
    }

    #[test]
    fn unknown_schemes_list_the_supported_ones() {
        let err = "ftp://host/x".parse::<SourceUri>().unwrap_err();
        assert!(matches!(
            &err,
            UriError::UnsupportedScheme { scheme } if scheme == "ftp"
        ));
        assert!(err.to_string().contains("rtsp://"), "{err}");
        assert_eq!(
            "/dev/video0".parse::<SourceUri>().unwrap_err(),
            UriError::NoScheme
        );
    }
}
