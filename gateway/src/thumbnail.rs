//! Camera thumbnails for the status page: a small JPEG of a camera's latest
//! served frame with its detections drawn.
//!
//! [`render`] is pure: a frame's tensor (u8 pixels, raw in either layout,
//! JPEG or PNG), its [`Geometry`] and its detections (source pixels) → a
//! JPEG of the content area only (a letterbox's padding cropped), scaled to
//! the source's aspect ratio with its long side at most `max_px`, each box
//! outlined 2 px wide. It refuses what is not a picture with an error, and
//! never panics on any input.
//!
//! [`Thumbnails`] is the store the hub fills and the API reads: at most one
//! JPEG per open camera, at most one render of a camera under way, and at
//! most one started per camera per interval.

use std::collections::HashMap;
use std::io::Cursor;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use image::codecs::jpeg::{JpegDecoder, JpegEncoder};
use image::codecs::png::PngDecoder;
use image::{ColorType, ImageDecoder, Limits, RgbImage};
use tidegate_protocol::{Codec, DType, Detection, Encoding, Geometry, Layout, Tensor};

/// Outline width of a box (px).
const LINE_PX: i64 = 2;

/// A box's outline: lime, the colour furthest from skin, sky and road.
const BOX_RGB: [u8; 3] = [0, 255, 0];

/// A landmark's 3×3 dot: magenta, apart from the boxes.
const KEYPOINT_RGB: [u8; 3] = [255, 0, 255];

/// JPEG quality of a thumbnail: boxes stay sharp at a few kB.
const QUALITY: u8 = 80;

/// What a PNG decoder may allocate beyond the pixels (its line buffers).
const PNG_SIDE_ALLOC: u64 = 1 << 20;

/// The hub's thumbnail settings (`[status]` in the config).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThumbnailConfig {
    /// Least time between two renders of one camera.
    pub interval: Duration,
    /// Longest side of a thumbnail (px).
    pub max_px: u32,
}

/// Why a frame gives no thumbnail.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ThumbnailError {
    /// The tensor is not one picture of u8 pixels.
    #[error(
        "its frames are {dtype} {layout} {shape} {codec} tensors, which are no picture: a thumbnail needs one u8 image of 1 or 3 channels (NHWC or NCHW, raw, JPEG or PNG)"
    )]
    NotAnImage {
        /// Element type.
        dtype: DType,
        /// Layout.
        layout: Layout,
        /// Shape, as `[1,128,128,3]`.
        shape: String,
        /// Codec.
        codec: Codec,
    },
    /// A raw payload's length does not match its shape.
    #[error("a raw frame of shape {shape} needs {expected} bytes, it has {actual}")]
    Length {
        /// Shape.
        shape: String,
        /// Bytes the shape implies.
        expected: usize,
        /// Bytes present.
        actual: usize,
    },
    /// The image file does not decode to the shape it declares.
    #[error("the frame's {codec} file does not decode to its shape {shape}: {reason}")]
    Corrupt {
        /// Codec.
        codec: Codec,
        /// The declared shape.
        shape: String,
        /// What the decoder said, or what it found.
        reason: String,
    },
    /// The geometry's content rectangle is empty or outside the input.
    #[error(
        "the frame's geometry puts its content ({x},{y} {w}×{h}) outside its {width}×{height} input"
    )]
    Geometry {
        /// Content left.
        x: u32,
        /// Content top.
        y: u32,
        /// Content width.
        w: u32,
        /// Content height.
        h: u32,
        /// Input width.
        width: u32,
        /// Input height.
        height: u32,
    },
    /// The JPEG encoder failed.
    #[error("encoding the thumbnail failed: {0}")]
    Encode(String),
}

/// Pixels of a decoded input image: interleaved or planar u8, 1 or 3
/// channels.
struct Pixels<'a> {
    data: &'a [u8],
    width: usize,
    height: usize,
    channels: usize,
    planar: bool,
}

impl Pixels<'_> {
    /// RGB at (x, y), which the caller keeps inside the image.
    fn rgb(&self, x: usize, y: usize) -> [u8; 3] {
        let at = |c: usize| {
            let i = if self.planar {
                (c * self.height + y) * self.width + x
            } else {
                (y * self.width + x) * self.channels + c
            };
            self.data[i]
        };
        if self.channels == 1 {
            let v = at(0);
            [v, v, v]
        } else {
            [at(0), at(1), at(2)]
        }
    }
}

/// The image a tensor declares: (width, height, channels, planar).
fn declared(t: &Tensor) -> Result<(u32, u32, u32, bool), ThumbnailError> {
    let not_an_image = || ThumbnailError::NotAnImage {
        dtype: t.dtype,
        layout: t.layout,
        shape: tidegate_protocol::tensor::shape_string(&t.shape),
        codec: t.encoding.codec(),
    };
    if t.dtype != DType::U8 {
        return Err(not_an_image());
    }
    let dims = match t.shape.as_slice() {
        [1, a, b, c] | [a, b, c] => [*a, *b, *c],
        _ => return Err(not_an_image()),
    };
    let (w, h, c, planar) = match (t.layout, t.encoding.codec()) {
        (Layout::Nhwc, _) => (dims[1], dims[0], dims[2], false),
        (Layout::Nchw, Codec::Raw) => (dims[2], dims[1], dims[0], true),
        (Layout::Nchw, _) => return Err(not_an_image()),
    };
    if w == 0 || h == 0 || !matches!(c, 1 | 3) {
        return Err(not_an_image());
    }
    Ok((w, h, c, planar))
}

/// Decodes an image file whose header must say `width`×`height` of
/// `channels`, allocating only once it does.
fn decode_file(
    t: &Tensor,
    width: u32,
    height: u32,
    channels: u32,
) -> Result<Vec<u8>, ThumbnailError> {
    let codec = t.encoding.codec();
    let corrupt = |reason: String| ThumbnailError::Corrupt {
        codec,
        shape: tidegate_protocol::tensor::shape_string(&t.shape),
        reason,
    };
    let len = width as usize * height as usize * channels as usize;
    let file = Cursor::new(&t.data[..]);
    fn read(
        decoder: impl ImageDecoder,
        want: (u32, u32, ColorType),
        len: usize,
    ) -> Result<Vec<u8>, String> {
        let (w, h) = decoder.dimensions();
        let color = decoder.color_type();
        if (w, h, color) != want {
            return Err(format!("it holds {w}×{h} {color:?}"));
        }
        let mut pixels = vec![0u8; len];
        decoder.read_image(&mut pixels).map_err(|e| e.to_string())?;
        Ok(pixels)
    }
    let color = if channels == 1 {
        ColorType::L8
    } else {
        ColorType::Rgb8
    };
    let want = (width, height, color);
    match codec {
        Codec::Jpeg => {
            let d = JpegDecoder::new(file).map_err(|e| corrupt(e.to_string()))?;
            read(d, want, len).map_err(corrupt)
        }
        Codec::Png => {
            let mut limits = Limits::default();
            limits.max_alloc = Some(PNG_SIDE_ALLOC + len as u64);
            let d = PngDecoder::with_limits(file, limits).map_err(|e| corrupt(e.to_string()))?;
            read(d, want, len).map_err(corrupt)
        }
        Codec::Raw => Ok(t.data.to_vec()),
    }
}

/// A thumbnail's size: the source's aspect ratio (the content's when the
/// source size is unknown), its long side `max_px` or the source's if
/// smaller, each side at least 1.
fn thumbnail_size(source: (u32, u32), max_px: u32) -> (u32, u32) {
    let (sw, sh) = (u64::from(source.0.max(1)), u64::from(source.1.max(1)));
    let long = sw.max(sh);
    let side = long.min(u64::from(max_px.max(1)));
    let w = (sw * side + long / 2) / long;
    let h = (sh * side + long / 2) / long;
    (w.clamp(1, side) as u32, h.clamp(1, side) as u32)
}

/// A thumbnail of a frame: the content area of `tensor` (where `geometry`
/// says the source sits), scaled to at most `max_px` on its long side,
/// with `detections` (source pixels) outlined, as a JPEG file.
pub fn render(
    tensor: &Tensor,
    geometry: &Geometry,
    detections: &[Detection],
    max_px: u32,
) -> Result<Vec<u8>, ThumbnailError> {
    let (width, height, channels, planar) = declared(tensor)?;
    if tensor.encoding == Encoding::Raw {
        let expected = Tensor::expected_len(DType::U8, &tensor.shape).unwrap_or(usize::MAX);
        if expected != tensor.data.len() {
            return Err(ThumbnailError::Length {
                shape: tidegate_protocol::tensor::shape_string(&tensor.shape),
                expected,
                actual: tensor.data.len(),
            });
        }
    }
    let g = geometry;
    let fits = |start: u32, len: u32, whole: u32| {
        len > 0 && start.checked_add(len).is_some_and(|end| end <= whole)
    };
    if !fits(g.content_x, g.content_width, width) || !fits(g.content_y, g.content_height, height) {
        return Err(ThumbnailError::Geometry {
            x: g.content_x,
            y: g.content_y,
            w: g.content_width,
            h: g.content_height,
            width,
            height,
        });
    }
    let decoded;
    let data: &[u8] = if tensor.encoding == Encoding::Raw {
        &tensor.data
    } else {
        decoded = decode_file(tensor, width, height, channels)?;
        &decoded
    };
    let px = Pixels {
        data,
        width: width as usize,
        height: height as usize,
        channels: channels as usize,
        planar,
    };
    let content = RgbImage::from_fn(g.content_width, g.content_height, |x, y| {
        image::Rgb(px.rgb((g.content_x + x) as usize, (g.content_y + y) as usize))
    });
    let source = if g.source_width > 0 && g.source_height > 0 {
        (g.source_width, g.source_height)
    } else {
        (g.content_width, g.content_height)
    };
    let (tw, th) = thumbnail_size(source, max_px);
    let mut thumb = if (tw, th) == (g.content_width, g.content_height) {
        content
    } else {
        image::imageops::resize(&content, tw, th, image::imageops::FilterType::Triangle)
    };
    // Source pixels to thumbnail pixels: the content is the whole source.
    let (fx, fy) = (tw as f32 / source.0 as f32, th as f32 / source.1 as f32);
    for d in detections {
        outline(&mut thumb, d.x1 * fx, d.y1 * fy, d.x2 * fx, d.y2 * fy);
        for [x, y] in &d.keypoints {
            dot(&mut thumb, x * fx, y * fy);
        }
    }
    let mut out = Vec::new();
    JpegEncoder::new_with_quality(&mut out, QUALITY)
        .encode_image(&thumb)
        .map_err(|e| ThumbnailError::Encode(e.to_string()))?;
    Ok(out)
}

/// Fills the pixels of `[x0, x1) × [y0, y1)` inside `img`.
fn fill(img: &mut RgbImage, x0: i64, y0: i64, x1: i64, y1: i64, rgb: [u8; 3]) {
    let (w, h) = (i64::from(img.width()), i64::from(img.height()));
    for y in y0.max(0)..y1.min(h) {
        for x in x0.max(0)..x1.min(w) {
            img.put_pixel(x as u32, y as u32, image::Rgb(rgb));
        }
    }
}

/// Outlines the box with corners (x1, y1), (x2, y2) (either order), its
/// [`LINE_PX`] lines just inside it; a box of non-finite corners is left
/// out, and one past the edges clipped.
fn outline(img: &mut RgbImage, x1: f32, y1: f32, x2: f32, y2: f32) {
    if ![x1, y1, x2, y2].iter().all(|v| v.is_finite()) {
        return;
    }
    // `as` saturates: a corner far outside is clipped, never wrapped.
    let (l, r) = (x1.min(x2).round() as i64, x1.max(x2).round() as i64);
    let (t, b) = (y1.min(y2).round() as i64, y1.max(y2).round() as i64);
    // At least the line's width, so a tiny box still shows.
    let (r, b) = (
        r.max(l.saturating_add(LINE_PX)),
        b.max(t.saturating_add(LINE_PX)),
    );
    fill(img, l, t, r, t.saturating_add(LINE_PX), BOX_RGB);
    fill(img, l, b.saturating_sub(LINE_PX), r, b, BOX_RGB);
    fill(img, l, t, l.saturating_add(LINE_PX), b, BOX_RGB);
    fill(img, r.saturating_sub(LINE_PX), t, r, b, BOX_RGB);
}

/// A 3×3 dot centred on (x, y); left out when not finite.
fn dot(img: &mut RgbImage, x: f32, y: f32) {
    if !(x.is_finite() && y.is_finite()) {
        return;
    }
    let (x, y) = (x.round() as i64, y.round() as i64);
    fill(
        img,
        x.saturating_sub(1),
        y.saturating_sub(1),
        x.saturating_add(2),
        y.saturating_add(2),
        KEYPOINT_RGB,
    );
}

/// A camera, as the API names it: its edge's configured name and its own.
type CameraKey = (String, String);

/// One camera's thumbnail state.
#[derive(Debug, Default)]
struct Slot {
    /// The latest JPEG and its number.
    jpeg: Option<(u64, Bytes)>,
    /// The render under way: its ticket's number.
    running: Option<u64>,
    /// When the last render began.
    started: Option<Instant>,
    /// Why its last frame gave no thumbnail.
    refused: Option<String>,
}

#[derive(Debug, Default)]
struct Store {
    config: Option<ThumbnailConfig>,
    cameras: HashMap<CameraKey, Slot>,
    next: u64,
    refused: u64,
}

/// Leave to render one camera's thumbnail, from [`Thumbnails::begin`];
/// hand it back to [`Thumbnails::finish`].
#[derive(Debug)]
#[must_use = "a ticket not finished keeps its camera from another render"]
pub struct Ticket {
    key: CameraKey,
    id: u64,
    /// The thumbnail's longest side (px).
    pub max_px: u32,
}

/// Why a camera has no thumbnail to serve.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NoThumbnail {
    /// `[status] thumbnails` is off.
    #[error(
        "thumbnails are off: set `thumbnails = true` under `[status]` in the gateway's config and restart it"
    )]
    Off,
    /// The camera is not open, or none of its frames has been served `ok`
    /// since thumbnails were turned on.
    #[error(
        "no thumbnail of camera {camera:?} of edge {edge:?} yet: one is made from a frame served ok, when the camera is open (GET /api/v1/cameras lists them)"
    )]
    NoneYet {
        /// Edge name.
        edge: String,
        /// Camera name.
        camera: String,
    },
    /// Its frames give no picture.
    #[error("no thumbnail of camera {camera:?} of edge {edge:?}: {why}")]
    Refused {
        /// Edge name.
        edge: String,
        /// Camera name.
        camera: String,
        /// Why.
        why: String,
    },
}

/// The latest thumbnail of each open camera, shared by the hub (which
/// fills it) and the API (which serves it). Holds at most one JPEG of at
/// most `max_px` square per camera the hub keeps in it.
#[derive(Debug, Clone, Default)]
pub struct Thumbnails {
    store: Arc<Mutex<Store>>,
}

impl Thumbnails {
    fn lock(&self) -> std::sync::MutexGuard<'_, Store> {
        // Nothing here panics while the lock is held; a poisoned lock still
        // holds consistent maps.
        self.store.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Turns thumbnails on (`Some`) or off (`None`, dropping them all).
    pub fn configure(&self, config: Option<ThumbnailConfig>) {
        let mut s = self.lock();
        s.config = config;
        if config.is_none() {
            s.cameras.clear();
        }
    }

    /// The settings in force; `None` when off.
    pub fn config(&self) -> Option<ThumbnailConfig> {
        self.lock().config
    }

    /// Frames that gave no thumbnail (not a picture, or corrupt) since
    /// the start.
    pub fn refused(&self) -> u64 {
        self.lock().refused
    }

    /// Leave to render a thumbnail of `camera` of `edge` at `now`: `None`
    /// when thumbnails are off, one of the camera is under way, or the last
    /// one began less than the interval ago.
    pub fn begin(&self, edge: &str, camera: &str, now: Instant) -> Option<Ticket> {
        let mut s = self.lock();
        let config = s.config?;
        let id = s.next + 1;
        let key = (edge.to_string(), camera.to_string());
        let slot = s.cameras.entry(key.clone()).or_default();
        let due = slot
            .started
            .is_none_or(|t| now.saturating_duration_since(t) >= config.interval);
        if slot.running.is_some() || !due {
            return None;
        }
        slot.running = Some(id);
        slot.started = Some(now);
        s.next = id;
        Some(Ticket {
            key,
            id,
            max_px: config.max_px,
        })
    }

    /// Ends a render: keeps its JPEG, or its refusal. Returns the refusal
    /// when it is the camera's first in a row (to be logged once). A
    /// ticket of a camera forgotten since is dropped.
    pub fn finish(
        &self,
        ticket: Ticket,
        rendered: Result<Vec<u8>, ThumbnailError>,
    ) -> Option<ThumbnailError> {
        let mut s = self.lock();
        if rendered.is_err() {
            s.refused += 1;
        }
        let slot = s.cameras.get_mut(&ticket.key)?;
        if slot.running != Some(ticket.id) {
            return None;
        }
        slot.running = None;
        match rendered {
            Ok(jpeg) => {
                slot.refused = None;
                slot.jpeg = Some((ticket.id, Bytes::from(jpeg)));
                None
            }
            Err(e) => {
                let first = slot.refused.is_none();
                slot.refused = Some(e.to_string());
                first.then_some(e)
            }
        }
    }

    /// Drops a camera's thumbnail (it closed, or its edge went).
    pub fn forget(&self, edge: &str, camera: &str) {
        self.lock()
            .cameras
            .remove(&(edge.to_string(), camera.to_string()));
    }

    /// The camera's latest thumbnail: its number (which changes with
    /// each new one) and its JPEG.
    pub fn get(&self, edge: &str, camera: &str) -> Result<(u64, Bytes), NoThumbnail> {
        let s = self.lock();
        if s.config.is_none() {
            return Err(NoThumbnail::Off);
        }
        let slot = s.cameras.get(&(edge.to_string(), camera.to_string()));
        match slot {
            Some(Slot { jpeg: Some(j), .. }) => Ok(j.clone()),
            Some(Slot {
                refused: Some(why), ..
            }) => Err(NoThumbnail::Refused {
                edge: edge.into(),
                camera: camera.into(),
                why: why.clone(),
            }),
            _ => Err(NoThumbnail::NoneYet {
                edge: edge.into(),
                camera: camera.into(),
            }),
        }
    }

    /// The number of each camera's latest thumbnail, by edge and camera.
    pub fn numbers(&self) -> HashMap<CameraKey, u64> {
        self.lock()
            .cameras
            .iter()
            .filter_map(|(k, s)| s.jpeg.as_ref().map(|(n, _)| (k.clone(), *n)))
            .collect()
    }

    /// Cameras it keeps state for.
    pub fn cameras(&self) -> usize {
        self.lock().cameras.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn detection(x1: f32, y1: f32, x2: f32, y2: f32) -> Detection {
        Detection {
            x1,
            y1,
            x2,
            y2,
            score: 0.9,
            class: 0,
            keypoints: Vec::new(),
        }
    }

    /// A grey u8 NHWC frame of `w`×`h`, black where `black` says.
    fn frame(w: u32, h: u32, black: impl Fn(u32, u32) -> bool) -> Tensor {
        let mut data = Vec::with_capacity((w * h * 3) as usize);
        for y in 0..h {
            for x in 0..w {
                let v = if black(x, y) { 0 } else { 128 };
                data.extend([v, v, v]);
            }
        }
        Tensor::raw(DType::U8, Layout::Nhwc, vec![1, h, w, 3], data.into())
    }

    fn decode(jpeg: &[u8]) -> RgbImage {
        image::load_from_memory_with_format(jpeg, image::ImageFormat::Jpeg)
            .expect("a JPEG")
            .to_rgb8()
    }

    fn is_box(p: &image::Rgb<u8>) -> bool {
        p[1] > 170 && p[0] < 110 && p[2] < 110
    }

    fn is_grey(p: &image::Rgb<u8>) -> bool {
        p.0.iter().all(|&c| (100..=156).contains(&c))
    }

    #[test]
    fn a_box_is_drawn_where_the_detection_says_in_source_pixels() {
        // Source 320×320 stretched to a 64×64 input; thumbnail of 160:
        // source pixels scale by a half.
        let t = frame(64, 64, |_, _| false);
        let g = Geometry::stretch(320, 320, 64, 64);
        let jpeg = render(&t, &g, &[detection(80.0, 80.0, 240.0, 200.0)], 160).unwrap();
        let img = decode(&jpeg);
        assert_eq!(img.dimensions(), (160, 160));
        // The outline runs just inside x 40..120, y 40..100.
        for (x, y) in [(80, 40), (80, 41), (80, 99), (40, 70), (41, 70), (119, 70)] {
            assert!(
                is_box(img.get_pixel(x, y)),
                "({x},{y}): {:?}",
                img.get_pixel(x, y)
            );
        }
        for (x, y) in [(80, 70), (60, 60), (100, 88), (80, 30), (80, 110), (20, 20)] {
            assert!(
                is_grey(img.get_pixel(x, y)),
                "({x},{y}): {:?}",
                img.get_pixel(x, y)
            );
        }
    }

    #[test]
    fn a_letterbox_is_cropped_and_the_thumbnail_keeps_the_sources_aspect() {
        // 1920×1080 letterboxed into 128×128: content 128×72 at y 28; the
        // padding is black, the content grey.
        let g = Geometry::letterbox(1920, 1080, 128, 128);
        let t = frame(128, 128, |_, y| !(28..100).contains(&y));
        let jpeg = render(&t, &g, &[], 160).unwrap();
        let img = decode(&jpeg);
        assert_eq!(img.dimensions(), (160, 90));
        for y in [0, 1, 45, 88, 89] {
            for x in [0, 80, 159] {
                assert!(is_grey(img.get_pixel(x, y)), "({x},{y}) is padding");
            }
        }
    }

    #[test]
    fn every_format_gives_the_same_picture_bounded_by_max_px() {
        let g = Geometry::stretch(640, 480, 64, 48);
        let nhwc = frame(64, 48, |x, _| x < 32);
        let mut planar = vec![0u8; 64 * 48 * 3];
        for c in 0..3 {
            for y in 0..48 {
                for x in 0..64 {
                    planar[(c * 48 + y) * 64 + x] = if x < 32 { 0 } else { 128 };
                }
            }
        }
        let nchw = Tensor::raw(DType::U8, Layout::Nchw, vec![1, 3, 48, 64], planar.into());
        let rgb = RgbImage::from_raw(64, 48, nhwc.data.to_vec()).unwrap();
        let mut png = Vec::new();
        rgb.write_to(&mut Cursor::new(&mut png), image::ImageFormat::Png)
            .unwrap();
        let mut jpg = Vec::new();
        JpegEncoder::new_with_quality(&mut jpg, 95)
            .encode_image(&rgb)
            .unwrap();
        let mut as_png = nhwc.clone();
        (as_png.encoding, as_png.data) = (Encoding::Png, png.into());
        let mut as_jpeg = nhwc.clone();
        (as_jpeg.encoding, as_jpeg.data) = (Encoding::Jpeg { quality: 95 }, jpg.into());
        let grey = Tensor::raw(
            DType::U8,
            Layout::Nhwc,
            vec![48, 64, 1],
            nhwc.data
                .iter()
                .step_by(3)
                .copied()
                .collect::<Vec<_>>()
                .into(),
        );
        for (name, t) in [
            ("nhwc", nhwc),
            ("nchw", nchw),
            ("png", as_png),
            ("jpeg", as_jpeg),
            ("grey", grey),
        ] {
            let img = decode(&render(&t, &g, &[], 32).unwrap());
            assert_eq!(img.dimensions(), (32, 24), "{name}");
            let (l, r) = (img.get_pixel(4, 12), img.get_pixel(28, 12));
            assert!(l[0] < 40 && is_grey(r), "{name}: {l:?} {r:?}");
        }
    }

    #[test]
    fn garbage_and_non_pictures_are_refused_with_a_reason() {
        let g = Geometry::stretch(64, 64, 64, 64);
        let mut t = frame(64, 64, |_, _| false);
        t.encoding = Encoding::Jpeg { quality: 90 };
        t.data = Bytes::from_static(b"\xff\xd8 not a jpeg at all");
        let e = render(&t, &g, &[], 160).unwrap_err();
        assert!(matches!(e, ThumbnailError::Corrupt { .. }), "{e}");
        t.encoding = Encoding::Png;
        assert!(matches!(
            render(&t, &g, &[], 160),
            Err(ThumbnailError::Corrupt { .. })
        ));
        let f32s = Tensor::raw(
            DType::F32,
            Layout::Nchw,
            vec![1, 3, 8, 8],
            vec![0; 768].into(),
        );
        let e = render(&f32s, &g, &[], 160).unwrap_err().to_string();
        assert!(e.contains("f32") && e.contains("[1,3,8,8]"), "{e}");
        let short = Tensor::raw(
            DType::U8,
            Layout::Nhwc,
            vec![1, 8, 8, 3],
            vec![0; 10].into(),
        );
        assert!(matches!(
            render(&short, &g, &[], 160),
            Err(ThumbnailError::Length { .. })
        ));
        let outside = Geometry::stretch(64, 64, 65, 64);
        let e = render(&frame(64, 64, |_, _| false), &outside, &[], 160).unwrap_err();
        assert!(matches!(e, ThumbnailError::Geometry { .. }), "{e}");
    }

    #[test]
    fn rendering_at_the_largest_size_is_cheap_enough_for_a_blocking_task() {
        // Not asserted (the machine may be busy): read with --nocapture.
        let t = frame(640, 640, |x, y| (x / 40 + y / 40) % 2 == 0);
        let g = Geometry::letterbox(1920, 1080, 640, 640);
        let boxes: Vec<Detection> = (0..50)
            .map(|i| detection(i as f32 * 30.0, 100.0, i as f32 * 30.0 + 200.0, 700.0))
            .collect();
        let start = Instant::now();
        let jpeg = render(&t, &g, &boxes, 640).unwrap();
        println!(
            "640×640 input to a 640 px thumbnail with 50 boxes: {:?}, {} bytes",
            start.elapsed(),
            jpeg.len()
        );
    }

    #[test]
    fn the_store_starts_one_render_per_camera_per_interval_and_forgets_cameras() {
        let store = Thumbnails::default();
        let t0 = Instant::now();
        assert!(store.begin("e", "c", t0).is_none(), "off by default");
        assert_eq!(store.get("e", "c"), Err(NoThumbnail::Off));
        store.configure(Some(ThumbnailConfig {
            interval: Duration::from_millis(500),
            max_px: 64,
        }));
        let ticket = store.begin("e", "c", t0).unwrap();
        assert_eq!(ticket.max_px, 64);
        assert!(
            store.begin("e", "c", t0 + Duration::from_secs(9)).is_none(),
            "one under way"
        );
        assert!(matches!(
            store.get("e", "c"),
            Err(NoThumbnail::NoneYet { .. })
        ));
        assert!(store.finish(ticket, Ok(vec![1, 2, 3])).is_none());
        let (n, jpeg) = store.get("e", "c").unwrap();
        assert_eq!(&jpeg[..], &[1, 2, 3]);
        assert!(
            store
                .begin("e", "c", t0 + Duration::from_millis(499))
                .is_none(),
            "too soon"
        );
        let again = store
            .begin("e", "c", t0 + Duration::from_millis(500))
            .unwrap();
        let refusal = ThumbnailError::Encode("x".into());
        assert!(
            store.finish(again, Err(refusal.clone())).is_some(),
            "first refusal logged"
        );
        assert_eq!(store.get("e", "c").unwrap().0, n, "the last good one stays");
        let never = store.begin("e", "f32", t0).unwrap();
        assert!(store.finish(never, Err(refusal.clone())).is_some());
        let e = store.get("e", "f32").unwrap_err().to_string();
        assert!(
            e.contains("\"f32\"") && e.contains("encoding the thumbnail"),
            "{e}"
        );
        let third = store.begin("e", "c", t0 + Duration::from_secs(1)).unwrap();
        assert!(
            store.finish(third, Err(refusal)).is_none(),
            "logged once in a row"
        );
        assert_eq!(store.refused(), 3);
        // A render that ends after its camera went keeps nothing.
        let late = store.begin("e", "c", t0 + Duration::from_secs(2)).unwrap();
        store.forget("e", "c");
        assert!(store.finish(late, Ok(vec![4])).is_none());
        store.forget("e", "f32");
        assert_eq!(store.cameras(), 0);
        assert!(store.numbers().is_empty());
        let other = store.begin("e", "d", t0).unwrap();
        assert!(store.finish(other, Ok(vec![5])).is_none());
        assert!(store.numbers()[&("e".to_string(), "d".to_string())] > n);
        store.configure(None);
        assert_eq!(
            (store.cameras(), store.get("e", "d")),
            (0, Err(NoThumbnail::Off))
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn any_shape_geometry_and_boxes_never_panic_nor_exceed_the_bound(
            w in 0u32..80, h in 0u32..80, c in 0u32..5, nchw in any::<bool>(),
            batch in 0u32..3, short in any::<bool>(),
            gx in 0u32..90, gy in 0u32..90, gw in 0u32..90, gh in 0u32..90,
            sw in 0u32..5000, sh in 0u32..5000, max_px in 1u32..200,
            boxes in prop::collection::vec(
                (prop::num::f32::ANY, prop::num::f32::ANY, prop::num::f32::ANY, prop::num::f32::ANY,
                 prop::collection::vec((prop::num::f32::ANY, prop::num::f32::ANY), 0..3)),
                0..6),
        ) {
            let shape = if nchw { vec![batch, c, h, w] } else { vec![batch, h, w, c] };
            let len = (batch * c * h * w) as usize;
            let data = vec![77u8; if short { len / 2 } else { len }];
            let layout = if nchw { Layout::Nchw } else { Layout::Nhwc };
            let t = Tensor::raw(DType::U8, layout, shape, data.into());
            let g = Geometry {
                source_width: sw, source_height: sh,
                content_x: gx, content_y: gy, content_width: gw, content_height: gh,
            };
            let dets: Vec<Detection> = boxes
                .into_iter()
                .map(|(x1, y1, x2, y2, kps)| Detection {
                    keypoints: kps.into_iter().map(|(x, y)| [x, y]).collect(),
                    ..detection(x1, y1, x2, y2)
                })
                .collect();
            if let Ok(jpeg) = render(&t, &g, &dets, max_px) {
                let img = decode(&jpeg);
                prop_assert!(img.width() <= max_px && img.height() <= max_px);
                prop_assert!(img.width() >= 1 && img.height() >= 1);
            }
        }

        #[test]
        fn any_bytes_as_an_image_file_are_refused_or_drawn_never_a_panic(
            bytes in prop::collection::vec(any::<u8>(), 0..512), png in any::<bool>(),
        ) {
            let mut t = frame(16, 16, |_, _| false);
            t.encoding = if png { Encoding::Png } else { Encoding::Jpeg { quality: 80 } };
            t.data = bytes.into();
            let _ = render(&t, &Geometry::stretch(16, 16, 16, 16), &[], 64);
        }
    }
}
