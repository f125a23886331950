//! The encoder stage against real GStreamer pipelines: frames captured from
//! a real file and a test source, scaled and letterboxed, then encoded as
//! JPEG or PNG, decoded again with the `image` crate and compared with the
//! raw frame. Every wait is bounded.

#![cfg(feature = "capture")]

use std::time::Duration;

use bytes::Bytes;
use tidegate_edge::capture::{
    Capture, CaptureSpec, CapturedFrame, EncodeError, FrameEncoder, Resize,
};
use tidegate_protocol::{Codec, Encoding};

const ASTRONAUT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../models/testdata/astronaut.png"
);
const WAIT: Duration = Duration::from_secs(10);

/// One raw frame of `uri`, scaled to `width`×`height` as a camera would.
async fn raw_frame(uri: &str, width: u32, height: u32, resize: Resize) -> CapturedFrame {
    let capture = Capture::start(CaptureSpec {
        camera: "cam-under-test".into(),
        uri: uri.into(),
        width,
        height,
        resize,
        max_fps: 15.0,
    })
    .unwrap();
    match tokio::time::timeout(WAIT, capture.recv()).await {
        Ok(Ok(frame)) => frame,
        Ok(Err(e)) => panic!("capture stopped: {e}"),
        Err(_) => panic!("no frame from {uri} within {WAIT:?}"),
    }
}

async fn encode(encoder: &FrameEncoder, pixels: &Bytes, quality: u8) -> Bytes {
    let e = tokio::time::timeout(WAIT, encoder.encode(pixels.clone(), quality))
        .await
        .expect("the encoder answers in time")
        .expect("the frame encodes");
    let want = match encoder.codec() {
        Codec::Jpeg => Encoding::Jpeg { quality },
        _ => Encoding::Png,
    };
    assert_eq!(e.encoding, want);
    assert!(e.took < WAIT, "{:?}", e.took);
    e.data
}

/// Decodes `data` as `format` into packed RGB rows, checking its size.
fn decode(data: &[u8], format: image::ImageFormat, width: u32, height: u32) -> Vec<u8> {
    let img = image::load_from_memory_with_format(data, format).expect("a valid image file");
    assert_eq!(
        (img.width(), img.height()),
        (width, height),
        "the file must decode to exactly the declared shape"
    );
    assert_eq!(img.color(), image::ColorType::Rgb8, "three u8 channels");
    img.into_rgb8().into_raw()
}

fn mean_abs_diff(a: &[u8], b: &[u8]) -> f64 {
    assert_eq!(a.len(), b.len());
    let sum: u64 = a.iter().zip(b).map(|(x, y)| x.abs_diff(*y) as u64).sum();
    sum as f64 / a.len() as f64
}

fn is_jpeg_file(data: &[u8]) -> bool {
    data.starts_with(&[0xFF, 0xD8]) && data.ends_with(&[0xFF, 0xD9])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jpeg_frame_is_one_jpeg_file_of_the_declared_shape_close_to_the_raw_frame() {
    let raw = raw_frame(&format!("image://{ASTRONAUT}"), 128, 128, Resize::Letterbox).await;
    let encoder = FrameEncoder::start("cam-under-test", Codec::Jpeg, 128, 128)
        .await
        .unwrap();
    let data = encode(&encoder, &raw.data, 90).await;
    assert!(is_jpeg_file(&data), "SOI .. EOI: {:02x?}", &data[..4]);
    let pixels = decode(&data, image::ImageFormat::Jpeg, 128, 128);
    let mad = mean_abs_diff(&pixels, &raw.data);
    eprintln!(
        "128x128 astronaut: raw {} B, jpeg q90 {} B, mean abs diff {mad:.2}",
        raw.data.len(),
        data.len()
    );
    // 4:2:0 chroma and 8-bit YCbCr cost about 4 levels on this detailed
    // image (4:4:4 would cost 3.3, for a quarter more bytes).
    assert!(mad < 6.0, "quality 90 moves pixels by {mad:.2} on average");
    assert!(
        data.len() * 4 < raw.data.len(),
        "a JPEG at quality 90 ({} B) is a fraction of the raw frame ({} B)",
        data.len(),
        raw.data.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_png_frame_decodes_to_exactly_the_raw_pixels() {
    let raw = raw_frame(&format!("image://{ASTRONAUT}"), 128, 128, Resize::Letterbox).await;
    let encoder = FrameEncoder::start("cam-under-test", Codec::Png, 128, 128)
        .await
        .unwrap();
    let data = encode(&encoder, &raw.data, 90).await;
    assert!(
        data.starts_with(b"\x89PNG\r\n\x1a\n"),
        "{:02x?}",
        &data[..8]
    );
    let pixels = decode(&data, image::ImageFormat::Png, 128, 128);
    assert!(pixels == raw.data, "PNG is lossless");
    eprintln!("128x128 astronaut: png {} B", data.len());
}

/// 65×49: rows of 195 bytes, which GStreamer would pad to 196 by default.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_whose_rows_are_not_a_multiple_of_four_bytes_encode_unskewed() {
    let raw = raw_frame("test://smpte?width=320&height=240", 65, 49, Resize::Stretch).await;
    let png = FrameEncoder::start("cam-under-test", Codec::Png, 65, 49)
        .await
        .unwrap();
    let data = encode(&png, &raw.data, 0).await;
    assert!(decode(&data, image::ImageFormat::Png, 65, 49) == raw.data);
    let jpeg = FrameEncoder::start("cam-under-test", Codec::Jpeg, 65, 49)
        .await
        .unwrap();
    let data = encode(&jpeg, &raw.data, 95).await;
    let mad = mean_abs_diff(&decode(&data, image::ImageFormat::Jpeg, 65, 49), &raw.data);
    // A skewed image (rows read 1 byte apart) would differ by tens of levels.
    assert!(mad < 12.0, "mean abs diff {mad:.2}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_quality_asked_for_each_frame_applies_to_that_frame() {
    let raw = raw_frame(&format!("image://{ASTRONAUT}"), 128, 128, Resize::Letterbox).await;
    let encoder = FrameEncoder::start("cam-under-test", Codec::Jpeg, 128, 128)
        .await
        .unwrap();
    let mut sizes = Vec::new();
    for quality in [90, 50, 90, 20, 50, 80, 70, 60] {
        let data = encode(&encoder, &raw.data, quality).await;
        assert!(is_jpeg_file(&data));
        let mad = mean_abs_diff(
            &decode(&data, image::ImageFormat::Jpeg, 128, 128),
            &raw.data,
        );
        sizes.push((quality, data.len(), mad));
    }
    eprintln!("(quality, bytes, mean abs diff): {sizes:?}");
    let at = |i: usize| sizes[i].1;
    // The same image at the same quality encodes to the same bytes.
    assert_eq!(at(0), at(2));
    assert_eq!(at(1), at(4));
    assert!(at(3) < at(1) && at(1) < at(0), "{sizes:?}");
    assert!(sizes[3].2 > sizes[0].2, "{sizes:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frame_of_the_wrong_size_fails_alone() {
    let encoder = FrameEncoder::start("cam-under-test", Codec::Jpeg, 32, 32)
        .await
        .unwrap();
    let err = encoder
        .encode(Bytes::from(vec![0u8; 31 * 32 * 3]), 90)
        .await
        .unwrap_err();
    assert!(matches!(err, EncodeError::Size { .. }), "{err:?}");
    assert!(err.frame_only());
    let msg = err.to_string();
    assert!(
        msg.contains("cam-under-test") && msg.contains("32x32"),
        "{msg}"
    );
    let data = encode(&encoder, &Bytes::from(vec![128u8; 32 * 32 * 3]), 90).await;
    let pixels = decode(&data, image::ImageFormat::Jpeg, 32, 32);
    assert!(mean_abs_diff(&pixels, &[128u8; 32 * 32 * 3]) < 1.0);
}

#[tokio::test]
async fn raw_needs_no_encoder() {
    let err = FrameEncoder::start("cam-under-test", Codec::Raw, 32, 32)
        .await
        .unwrap_err();
    assert!(matches!(err, EncodeError::Raw { .. }), "{err:?}");
}

/// The worst frame an encoder can make, noise at JPEG quality 100 (and as
/// PNG), is within `InputSpec::max_frame_payload`: the bound a gateway
/// refuses a frame's header by never refuses a frame this edge encodes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn noise_at_the_highest_quality_fits_the_payload_bound_a_gateway_holds_frames_to() {
    use tidegate_protocol::{ColorOrder, DType, InputSpec, Layout};
    let (width, height) = (128u32, 128u32);
    let input = InputSpec {
        width,
        height,
        channels: 3,
        dtype: DType::U8,
        layout: Layout::Nhwc,
        color: ColorOrder::Rgb,
        resize: tidegate_protocol::Resize::Stretch,
    };
    // xorshift noise: no two neighbours alike, the worst case for both
    // codecs
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let noise: Vec<u8> = (0..input.raw_frame_bytes())
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    let noise = Bytes::from(noise);
    for codec in [Codec::Jpeg, Codec::Png] {
        let encoder = FrameEncoder::start("cam-noise", codec, width, height)
            .await
            .unwrap();
        let data = encode(&encoder, &noise, Encoding::MAX_QUALITY).await;
        assert!(
            data.len() > input.raw_frame_bytes() / 2,
            "{codec}: noise does not compress ({} bytes)",
            data.len()
        );
        assert!(
            data.len() <= input.max_frame_payload(),
            "{codec}: {} bytes over the bound {}",
            data.len(),
            input.max_frame_payload()
        );
    }
}
