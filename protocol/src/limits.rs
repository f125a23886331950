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
