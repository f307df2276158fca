//! zstd layers (spans are runs of whole frames) and uncompressed layers.

mod common;

use common::*;
use lamina_zran::{decode_span, Codec, SpanKind, ZranError};

/// A skippable frame (magic 0x184D2A5?) carrying `payload`.
fn skippable(payload: &[u8]) -> Vec<u8> {
    let mut frame = 0x184d_2a53u32.to_le_bytes().to_vec();
    frame.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    frame.extend_from_slice(payload);
    frame
}

/// Frames of uneven sizes with skippable frames among them and at the end:
/// the blob and the offsets where frames end.
fn multi_frame(data: &[u8]) -> (Vec<u8>, Vec<u64>) {
    let n = data.len();
    let cuts = [
        0,
        n / 15,
        n * 7 / 15,
        n * 29 / 60,
        n / 2,
        n * 13 / 15,
        n * 9 / 10,
        n,
    ];
    let mut blob = Vec::new();
    let mut ends = Vec::new();
    for (i, piece) in cuts.windows(2).enumerate() {
        blob.extend_from_slice(&zstd::bulk::compress(&data[piece[0]..piece[1]], 3).unwrap());
        ends.push(blob.len() as u64);
        if i == 2 {
            blob.extend_from_slice(&skippable(b"not data"));
            ends.push(blob.len() as u64);
        }
    }
    blob.extend_from_slice(&skippable(&[7; 100]));
    ends.push(blob.len() as u64);
    (blob, ends)
}

#[test]
fn several_frames() {
    let data = mixed_data(3_000_000, 31);
    let (blob, frame_ends) = multi_frame(&data);
    let (out, layer) = index(&blob, Codec::Zstd, SPAN).unwrap();
    assert!(out == data);
    check_layer(&blob, &data, &layer);
    assert!(layer.spans.len() >= 3, "{} spans", layer.spans.len());
    for (i, span) in layer.spans.iter().enumerate() {
        assert_eq!(span.kind, SpanKind::Zstd);
        assert!(span.window.is_empty() && span.skip_bits == 0);
        assert!(
            span.compressed.start == 0 || frame_ends.contains(&span.compressed.start),
            "{span:?}"
        );
        assert!(
            frame_ends.contains(&span.compressed.end),
            "{span:?} does not end at a frame end"
        );
        if i + 1 < layer.spans.len() {
            assert!(
                span.compressed.end - span.compressed.start >= SPAN,
                "{span:?} closed early"
            );
        }
    }
    // Spans are contiguous in the blob too: the skippable frame in the middle
    // is inside one.
    for pair in layer.spans.windows(2) {
        assert_eq!(pair[0].compressed.end, pair[1].compressed.start);
    }
    // The trailing skippable frame yields no bytes: it is in the last span,
    // or (when that span closed just before it) in none.
    let last_end = layer.spans.last().unwrap().compressed.end;
    assert!(last_end == blob.len() as u64 || last_end == frame_ends[frame_ends.len() - 2]);
}

#[test]
fn one_frame_is_one_span() {
    let data = mixed_data(2_000_000, 32);
    let blob = zstd::bulk::compress(&data, 3).unwrap();
    let (out, layer) = index(&blob, Codec::Zstd, SPAN).unwrap();
    assert!(out == data);
    assert_eq!(layer.spans.len(), 1);
    check_layer(&blob, &data, &layer);
}

#[test]
fn zstd_errors() {
    let data = mixed_data(1_000_000, 33);
    let (blob, _) = multi_frame(&data);
    let (_, layer) = index(&blob, Codec::Zstd, SPAN).unwrap();

    let err = index(&blob[..blob.len() - 10], Codec::Zstd, SPAN).unwrap_err();
    assert!(matches!(err, ZranError::Truncated { .. }), "{err}");
    let err = index(b"", Codec::Zstd, SPAN).unwrap_err();
    assert!(
        matches!(err, ZranError::Truncated { offset: 0, .. }),
        "{err}"
    );
    let err = index(b"not zstd at all", Codec::Zstd, SPAN).unwrap_err();
    assert!(matches!(err, ZranError::Zstd { offset: 0, .. }), "{err}");

    let mut rng = Rng::new(34);
    for span in &layer.spans {
        let mut bytes = compressed(&blob, span).to_vec();
        let at = rng.below(bytes.len());
        bytes[at] ^= 1 << rng.below(8);
        assert!(
            decode_span(span, &bytes).is_err(),
            "flipped byte {at} of {span:?} decoded"
        );
        let good = compressed(&blob, span);
        assert!(decode_span(span, &good[..good.len() - 1]).is_err());
        let mut long = span.clone();
        long.uncompressed.end += 1;
        assert!(decode_span(&long, good).is_err());
        let mut short = span.clone();
        short.uncompressed.end -= 1;
        assert!(matches!(
            decode_span(&short, good),
            Err(ZranError::LongSpan { .. })
        ));
    }
}

#[test]
fn plain_spans_tile_and_decode() {
    let data = mixed_data(1_000_003, 35);
    let (out, layer) = index(&data, Codec::Plain, 64 << 10).unwrap();
    assert!(out == data);
    check_layer(&data, &data, &layer);
    assert_eq!(layer.spans.len(), data.len().div_ceil(64 << 10));
    for span in &layer.spans {
        assert_eq!(span.kind, SpanKind::Plain);
        assert_eq!(span.compressed, span.uncompressed);
    }
    let span = &layer.spans[3];
    let mut bytes = compressed(&data, span).to_vec();
    bytes[100] ^= 1;
    assert!(matches!(
        decode_span(span, &bytes),
        Err(ZranError::DigestMismatch { .. })
    ));

    let (_, empty) = index(b"", Codec::Plain, 64 << 10).unwrap();
    assert!(empty.spans.is_empty() && empty.uncompressed_size == 0);
}
