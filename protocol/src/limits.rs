//! Size limits that every decoder checks before it allocates.

/// Bounds on what a peer may send. Decoders check these before allocating.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest body of a message without a tensor payload (bytes).
    pub max_header_bytes: usize,
    /// Largest tensor payload of one message (bytes).
    pub max_tensor_bytes: usize,
    /// Most dimensions a tensor may have.
    pub max_dims: usize,
    /// Longest string field (bytes of UTF-8).
    pub max_string_bytes: usize,
    /// Most detections in one frame result.
    pub max_detections: usize,
    /// Most keypoints in one detection.
    pub max_keypoints: usize,
    /// Most frames in one batch (dispatch or result).
    pub max_batch: usize,
    /// Most entries in a list field (models, labels, profile points, outputs).
    pub max_list: usize,
    /// Largest sum of output-tensor payloads in one outcome (one frame's
    /// `raw` decoder outputs), bytes. The payloads of a whole message are
    /// bounded by `max_tensor_bytes` as well.
    pub max_output_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_header_bytes: 256 * 1024,
            // A 4K RGB u8 frame is 24.9 MB; 64 MiB leaves room for small batches.
            max_tensor_bytes: 64 * 1024 * 1024,
            max_dims: 8,
            max_string_bytes: 1024,
            max_detections: 1024,
            max_keypoints: 64,
            max_batch: 256,
            max_list: 1024,
            // An embedding or a small feature map per frame; a 1x21x160x160
            // f32 segmentation map (2.1 MB) fits, a full-size one does not.
            max_output_bytes: 4 * 1024 * 1024,
        }
    }
}

/// Marks the end of a string that [`fit_string`] cut: a reader sees that
/// the text went on.
pub const CUT_MARK: &str = "…";

/// `s` cut to at most `max_bytes` bytes of UTF-8, for a string field whose
/// peer decodes at [`Limits::max_string_bytes`]: unchanged when it fits,
/// else its longest prefix that ends on a char boundary and leaves room for
/// [`CUT_MARK`], followed by the mark (just the prefix when `max_bytes` is
/// smaller than the mark).
///
/// A message that quotes what a peer sent (a 1 KiB camera name, say) is
/// longer than the quote, and a peer must still decode it.
pub fn fit_string(s: &str, max_bytes: usize) -> std::borrow::Cow<'_, str> {
    if s.len() <= max_bytes {
        return std::borrow::Cow::Borrowed(s);
    }
    let mark = if max_bytes >= CUT_MARK.len() {
        CUT_MARK
    } else {
        ""
    };
    let mut end = max_bytes - mark.len();
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    let mut cut = String::with_capacity(end + mark.len());
    cut.push_str(&s[..end]);
    cut.push_str(mark);
    std::borrow::Cow::Owned(cut)
}

impl Limits {
    /// `s` fitted to [`Limits::max_string_bytes`] (see [`fit_string`]).
    pub fn fit_string<'a>(&self, s: &'a str) -> std::borrow::Cow<'a, str> {
        fit_string(s, self.max_string_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_string_that_fits_is_returned_as_it_is() {
        assert_eq!(fit_string("camera-1", 8), "camera-1");
        assert!(matches!(
            fit_string("camera-1", 1024),
            std::borrow::Cow::Borrowed(_)
        ));
    }

    #[test]
    fn a_long_string_is_cut_on_a_char_boundary_and_marked() {
        // "é" is two bytes: a cut at 6 would split the third one.
        let s = "éééééé";
        let cut = fit_string(s, 6 + CUT_MARK.len() - 1);
        assert_eq!(cut, "éé…");
        assert_eq!(fit_string("abcdef", 4), "a…");
        // Too small for the mark: the prefix alone.
        assert_eq!(fit_string("abcdef", 2), "ab");
        assert_eq!(fit_string("éé", 1), "");
    }

    proptest! {
        #[test]
        fn a_fitted_string_fits_and_is_a_marked_prefix_on_a_char_boundary(
            s in ".{0,64}",
            max in 0usize..300,
        ) {
            let out = fit_string(&s, max);
            prop_assert!(out.len() <= max || out == s);
            if s.len() <= max {
                prop_assert_eq!(&*out, &*s, "unchanged when it fits");
            } else {
                prop_assert!(out.len() <= max);
                let prefix = out.strip_suffix(CUT_MARK).unwrap_or(&out);
                prop_assert!(s.starts_with(prefix), "{:?} is a prefix of {:?}", prefix, s);
                prop_assert!(s.is_char_boundary(prefix.len()));
                // Cut no shorter than it must be: the next char would not fit.
                let next = s[prefix.len()..].chars().next().map_or(0, char::len_utf8);
                let mark = out.len() - prefix.len();
                prop_assert!(prefix.len() + next + mark > max);
            }
        }
    }
}
