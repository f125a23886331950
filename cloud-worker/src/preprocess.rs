//! Turns u8 RGB frames into what the graph's input wants: its layout (NHWC or
//! NCHW), its channel order (RGB or BGR) and its element type (f32 through
//! the per-channel normalisation, or u8 unchanged).
//!
//! Pure Rust, no allocation per frame: the caller owns the destination buffer
//! (the backend keeps one per model, sized for `max_batch` frames). The f32
//! path looks each value up in a 256-entry table per channel, computed once
//! from `(pixel * scale - mean[c]) / std[c]`.

use tidegate_protocol::Layout;

use crate::model::{ColorOrder, InputSpec};

/// Converts frames for one model input. Build once per model.
#[derive(Clone)]
pub struct Preprocessor {
    pixels: usize,
    layout: Layout,
    /// For each model channel, the frame channel it takes (frames are RGB).
    source_channel: [usize; 3],
    /// `table[c][p]`: the model value of pixel value `p` in model channel `c`.
    table: Box<[[f32; 256]; 3]>,
}

impl std::fmt::Debug for Preprocessor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Preprocessor")
            .field("pixels", &self.pixels)
            .field("layout", &self.layout)
            .field("source_channel", &self.source_channel)
            .finish_non_exhaustive()
    }
}

impl Preprocessor {
    /// A preprocessor for `input`, whose `channels` must be 3 (as
    /// [`crate::model::Repository::load`] checks).
    pub fn new(input: &InputSpec) -> Self {
        let n = &input.normalize;
        let mut table = Box::new([[0.0f32; 256]; 3]);
        for (c, row) in table.iter_mut().enumerate() {
            for (p, v) in row.iter_mut().enumerate() {
                *v = (p as f32 * n.scale - n.mean[c]) / n.std[c];
            }
        }
        Preprocessor {
            pixels: input.width as usize * input.height as usize,
            layout: input.layout,
            source_channel: match input.color {
                ColorOrder::Rgb => [0, 1, 2],
                ColorOrder::Bgr => [2, 1, 0],
            },
            table,
        }
    }

    /// Elements in one frame (and in one model input).
    pub fn frame_len(&self) -> usize {
        self.pixels * 3
    }

    /// Converts a batch of u8 RGB frames laid out as `src_layout` into f32
    /// model input. `src` and `dst` hold the same whole number of frames.
    pub fn to_f32(
        &self,
        src: &[u8],
        src_layout: Layout,
        dst: &mut [f32],
    ) -> Result<(), PreprocessError> {
        self.check(src.len(), dst.len())?;
        let t = &*self.table;
        self.convert(src, src_layout, dst, |c, p| t[c][p as usize]);
        Ok(())
    }

    /// Converts a batch of u8 RGB frames laid out as `src_layout` into u8
    /// model input (layout and channel order only; no normalisation).
    pub fn to_u8(
        &self,
        src: &[u8],
        src_layout: Layout,
        dst: &mut [u8],
    ) -> Result<(), PreprocessError> {
        self.check(src.len(), dst.len())?;
        self.convert(src, src_layout, dst, |_, p| p);
        Ok(())
    }

    fn check(&self, src: usize, dst: usize) -> Result<(), PreprocessError> {
        let frame = self.frame_len();
        if src != dst || !src.is_multiple_of(frame) {
            return Err(PreprocessError::Length { src, dst, frame });
        }
        Ok(())
    }

    /// The four layout pairs, each as a tight loop. `f(c, p)` maps pixel
    /// value `p` in model channel `c`.
    fn convert<T: Copy>(
        &self,
        src: &[u8],
        src_layout: Layout,
        dst: &mut [T],
        f: impl Fn(usize, u8) -> T,
    ) {
        let [s0, s1, s2] = self.source_channel;
        let hw = self.pixels;
        let frame = self.frame_len();
        match (src_layout, self.layout) {
            (Layout::Nhwc, Layout::Nhwc) => {
                for (s, d) in src.chunks_exact(3).zip(dst.chunks_exact_mut(3)) {
                    d[0] = f(0, s[s0]);
                    d[1] = f(1, s[s1]);
                    d[2] = f(2, s[s2]);
                }
            }
            (Layout::Nhwc, Layout::Nchw) => {
                for (s, d) in src.chunks_exact(frame).zip(dst.chunks_exact_mut(frame)) {
                    let (d0, rest) = d.split_at_mut(hw);
                    let (d1, d2) = rest.split_at_mut(hw);
                    for (i, px) in s.chunks_exact(3).enumerate() {
                        d0[i] = f(0, px[s0]);
                        d1[i] = f(1, px[s1]);
                        d2[i] = f(2, px[s2]);
                    }
                }
            }
            (Layout::Nchw, Layout::Nhwc) => {
                for (s, d) in src.chunks_exact(frame).zip(dst.chunks_exact_mut(frame)) {
                    let (p0, p1, p2) = (
                        &s[s0 * hw..(s0 + 1) * hw],
                        &s[s1 * hw..(s1 + 1) * hw],
                        &s[s2 * hw..(s2 + 1) * hw],
                    );
                    for (i, px) in d.chunks_exact_mut(3).enumerate() {
                        px[0] = f(0, p0[i]);
                        px[1] = f(1, p1[i]);
                        px[2] = f(2, p2[i]);
                    }
                }
            }
            (Layout::Nchw, Layout::Nchw) => {
                for (s, d) in src.chunks_exact(frame).zip(dst.chunks_exact_mut(frame)) {
                    for (c, plane) in d.chunks_exact_mut(hw).enumerate() {
                        let from = self.source_channel[c];
                        let src_plane = &s[from * hw..(from + 1) * hw];
                        for (o, &p) in plane.iter_mut().zip(src_plane) {
                            *o = f(c, p);
                        }
                    }
                }
            }
        }
    }
}

/// Why a batch could not be preprocessed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PreprocessError {
    /// Source and destination are not the same whole number of frames.
    #[error(
        "preprocess got {src} source and {dst} destination elements; both must be the same multiple of the frame size {frame} (a worker bug: the backend sizes both)"
    )]
    Length {
        /// Source elements.
        src: usize,
        /// Destination elements.
        dst: usize,
        /// Elements in one frame.
        frame: usize,
    },
}

#[cfg(test)]
mod tests {
    use tidegate_protocol::DType;

    use super::*;
    use crate::model::{Normalize, Resize};

    fn spec(layout: Layout, color: ColorOrder, width: u32, height: u32) -> InputSpec {
        InputSpec {
            name: "x".into(),
            layout,
            width,
            height,
            channels: 3,
            color,
            resize: Resize::Stretch,
            model_dtype: DType::F32,
            normalize: Normalize {
                scale: 1.0 / 255.0,
                mean: [0.485, 0.456, 0.406],
                std: [0.229, 0.224, 0.225],
            },
        }
    }

    /// Deterministic pseudo-random RGB bytes.
    fn frames(n: usize, w: usize, h: usize) -> Vec<u8> {
        let mut x: u32 = 0x9e37_79b9;
        (0..n * w * h * 3)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                (x >> 24) as u8
            })
            .collect()
    }

    /// The obvious nested loop: read pixel (n, y, x, source channel) from an
    /// NHWC RGB batch, normalise, write at the model layout's index.
    fn reference(input: &InputSpec, src: &[u8], n: usize) -> Vec<f32> {
        let (w, h) = (input.width as usize, input.height as usize);
        let norm = &input.normalize;
        let mut out = vec![0.0; src.len()];
        for b in 0..n {
            for y in 0..h {
                for x in 0..w {
                    for c in 0..3 {
                        let sc = match input.color {
                            ColorOrder::Rgb => c,
                            ColorOrder::Bgr => 2 - c,
                        };
                        let p = src[((b * h + y) * w + x) * 3 + sc] as f32;
                        let v = (p * norm.scale - norm.mean[c]) / norm.std[c];
                        let i = match input.layout {
                            Layout::Nhwc => ((b * h + y) * w + x) * 3 + c,
                            Layout::Nchw => ((b * 3 + c) * h + y) * w + x,
                        };
                        out[i] = v;
                    }
                }
            }
        }
        out
    }

    /// NHWC → NCHW of u8, by the obvious loop, to build planar sources.
    fn planar(src: &[u8], n: usize, w: usize, h: usize) -> Vec<u8> {
        let mut out = vec![0; src.len()];
        for b in 0..n {
            for y in 0..h {
                for x in 0..w {
                    for c in 0..3 {
                        out[((b * 3 + c) * h + y) * w + x] = src[((b * h + y) * w + x) * 3 + c];
                    }
                }
            }
        }
        out
    }

    fn assert_close(got: &[f32], want: &[f32]) {
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!((g - w).abs() <= 1e-6, "element {i}: got {g}, want {w}");
        }
    }

    #[test]
    fn matches_reference_for_every_layout_and_colour_order() {
        let (w, h, n) = (7, 5, 3);
        let src = frames(n, w, h);
        let src_planar = planar(&src, n, w, h);
        for layout in [Layout::Nhwc, Layout::Nchw] {
            for color in [ColorOrder::Rgb, ColorOrder::Bgr] {
                let input = spec(layout, color, w as u32, h as u32);
                let pre = Preprocessor::new(&input);
                let want = reference(&input, &src, n);
                let mut got = vec![f32::NAN; src.len()];
                pre.to_f32(&src, Layout::Nhwc, &mut got).unwrap();
                assert_close(&got, &want);
                // Planar frames give the same model input.
                let mut got = vec![f32::NAN; src.len()];
                pre.to_f32(&src_planar, Layout::Nchw, &mut got).unwrap();
                assert_close(&got, &want);
            }
        }
    }

    #[test]
    fn blazeface_normalisation_maps_0_and_255_to_minus_one_and_one() {
        let mut input = spec(Layout::Nhwc, ColorOrder::Rgb, 1, 2);
        input.normalize = Normalize {
            scale: 1.0,
            mean: [127.5; 3],
            std: [127.5; 3],
        };
        let pre = Preprocessor::new(&input);
        let mut out = [0.0; 6];
        pre.to_f32(&[0, 0, 0, 255, 255, 255], Layout::Nhwc, &mut out)
            .unwrap();
        assert_eq!(out, [-1.0, -1.0, -1.0, 1.0, 1.0, 1.0]);
    }

    #[test]
    fn u8_model_input_is_reordered_but_not_normalised() {
        let input = spec(Layout::Nchw, ColorOrder::Bgr, 2, 1);
        let pre = Preprocessor::new(&input);
        let mut out = [0u8; 6];
        // Two pixels: (r,g,b) = (1,2,3), (4,5,6).
        pre.to_u8(&[1, 2, 3, 4, 5, 6], Layout::Nhwc, &mut out)
            .unwrap();
        // Planes B, G, R.
        assert_eq!(out, [3, 6, 2, 5, 1, 4]);
    }

    #[test]
    fn length_that_is_not_whole_frames_is_an_error() {
        let pre = Preprocessor::new(&spec(Layout::Nhwc, ColorOrder::Rgb, 2, 2));
        let mut out = vec![0.0; 11];
        let err = pre.to_f32(&[0; 11], Layout::Nhwc, &mut out).unwrap_err();
        assert_eq!(
            err,
            PreprocessError::Length {
                src: 11,
                dst: 11,
                frame: 12
            }
        );
        let mut out = vec![0.0; 24];
        assert!(pre.to_f32(&[0; 12], Layout::Nhwc, &mut out).is_err());
    }
}
