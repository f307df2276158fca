//! gzip layers: one member, many members with every header field, odd read
//! sizes, compressible stretches, and every way the input can be wrong.

mod common;

use std::io::{Read, Write};
use std::ops::Range;

use common::*;
use flate2::write::DeflateEncoder;
use flate2::{Compression, Crc, GzBuilder};
use lamina_zran::{
    decode_span, Codec, LayerSpans, SpanIndexer, SpanKind, ZranError, MAX_SPAN_EXPANSION,
};

/// Compressed bytes per span: each span but a member's last has at least
/// `SPAN`; no more spans than `SPAN` per compressed byte plus one per member.
fn check_counts(layer: &LayerSpans, members: usize) {
    let count = layer.spans.len() as u64;
    let expected = layer.compressed_size / SPAN;
    assert!(
        count >= expected.saturating_sub(1) && count <= expected + members as u64,
        "{count} spans for {} compressed bytes",
        layer.compressed_size
    );
    for pair in layer.spans.windows(2) {
        if pair[1].kind == SpanKind::GzipInside {
            assert!(
                pair[0].compressed.end - pair[0].compressed.start >= SPAN,
                "{:?} is short",
                pair[0]
            );
        }
    }
}

/// Each span lies inside one member, and each non-empty member starts a span.
fn check_members(layer: &LayerSpans, members: &[Range<u64>]) {
    for span in &layer.spans {
        let member = members
            .iter()
            .find(|m| m.contains(&span.compressed.start))
            .unwrap();
        assert!(
            span.compressed.end <= member.end,
            "{span:?} crosses the end of member {member:?}"
        );
        let starts_member = span.kind == SpanKind::GzipMemberStart;
        assert_eq!(starts_member, span.window.is_empty(), "{span:?}");
    }
    let starts = layer
        .spans
        .iter()
        .filter(|s| s.kind == SpanKind::GzipMemberStart)
        .count();
    assert_eq!(starts, members.len() - 1, "one member is empty");
}

/// A span inside a member: a non-empty window of at most 32 KiB, narrowed
/// to what the span reads (most are shorter, all decode: `check_layer`);
/// somewhere a non-zero bit skip (which only decodes if the checkpoint's
/// bit offset is right).
fn check_inside_points(layer: &LayerSpans) {
    let inside: Vec<_> = layer
        .spans
        .iter()
        .filter(|s| s.kind == SpanKind::GzipInside)
        .collect();
    assert!(inside.len() > 5, "too few points inside members");
    let size = lamina_zran::WINDOW_SIZE;
    assert!(inside.iter().all(|s| (1..=size).contains(&s.window.len())));
    let narrowed = inside.iter().filter(|s| s.window.len() < size).count();
    assert!(
        narrowed * 2 > inside.len(),
        "{narrowed} of {} narrowed",
        inside.len()
    );
    assert!(
        inside.iter().any(|s| s.skip_bits != 0),
        "no point off a byte boundary"
    );
}

#[test]
fn one_member() {
    let data = big_data();
    let blob = gzip(data, 6);
    let (out, layer) = index(&blob, Codec::Gzip, SPAN).unwrap();
    assert!(out == data, "indexer output differs from the original");
    assert_eq!(layer.codec, Codec::Gzip);
    check_layer(&blob, data, &layer);
    check_counts(&layer, 1);
    check_inside_points(&layer);
    assert_eq!(layer.spans[0].kind, SpanKind::GzipMemberStart);
}

/// A member with FHCRC (and FNAME) built by hand: flate2 cannot write one.
fn member_with_hcrc(data: &[u8]) -> Vec<u8> {
    let mut header = vec![0x1f, 0x8b, 8, 0x02 | 0x08, 0, 0, 0, 0, 0, 3];
    header.extend_from_slice(b"with-hcrc.tar\0");
    let mut crc = Crc::new();
    crc.update(&header);
    header.extend_from_slice(&(crc.sum() as u16).to_le_bytes());
    let mut enc = DeflateEncoder::new(header, Compression::new(4));
    enc.write_all(data).unwrap();
    let mut blob = enc.finish().unwrap();
    let mut crc = Crc::new();
    crc.update(data);
    blob.extend_from_slice(&crc.sum().to_le_bytes());
    blob.extend_from_slice(&(data.len() as u32).to_le_bytes());
    blob
}

fn member_with_fields(data: &[u8]) -> Vec<u8> {
    let mut enc = GzBuilder::new()
        .filename("layer.tar")
        .extra(vec![b'L', b'Z', 4, 0, 1, 2, 3, 4])
        .comment("written by lamina-zran's tests")
        .write(Vec::new(), Compression::new(9));
    enc.write_all(data).unwrap();
    enc.finish().unwrap()
}

/// Concatenated members of uneven sizes, with an empty one in the middle:
/// the blob and each member's byte range.
fn multi_member(data: &[u8]) -> (Vec<u8>, Vec<Range<u64>>) {
    let n = data.len();
    let cuts = [
        0,
        n * 3 / 20,
        n * 31 / 200,
        n * 9 / 20,
        n * 9 / 20,
        n * 31 / 40,
        n,
    ];
    let mut blob = Vec::new();
    let mut members = Vec::new();
    for (i, piece) in cuts.windows(2).enumerate() {
        let piece = &data[piece[0]..piece[1]];
        let member = match i % 3 {
            0 => gzip(piece, 6),
            1 => member_with_fields(piece),
            _ => member_with_hcrc(piece),
        };
        members.push(blob.len() as u64..(blob.len() + member.len()) as u64);
        blob.extend_from_slice(&member);
    }
    (blob, members)
}

#[test]
fn several_members() {
    let data = big_data();
    let (blob, members) = multi_member(data);
    let (out, layer) = index(&blob, Codec::Gzip, SPAN).unwrap();
    assert!(out == data, "indexer output differs from the original");
    check_layer(&blob, data, &layer);
    check_counts(&layer, members.len());
    check_members(&layer, &members);
    check_inside_points(&layer);

    // A member's last span needs no trailer bytes.
    let last = layer.spans.last().unwrap();
    assert_eq!(last.compressed.end, blob.len() as u64 - 8);
}

/// Hands out at most a few bytes per read, of varying sizes.
struct Dribble<'a> {
    data: &'a [u8],
    rng: Rng,
    max: usize,
}

impl Read for Dribble<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = (1 + self.rng.below(self.max))
            .min(buf.len())
            .min(self.data.len());
        buf[..n].copy_from_slice(&self.data[..n]);
        self.data = &self.data[n..];
        Ok(n)
    }
}

/// Tiny inner reads (trailers split across refills) and tiny outer reads
/// give the very same spans as one big pass.
#[test]
fn read_sizes_do_not_matter() {
    let data = mixed_data(1_500_000, 7);
    let (blob, _) = multi_member(&data[..]);
    let (_, expected) = index(&blob, Codec::Gzip, 64 << 10).unwrap();
    assert!(expected.spans.len() > 10);

    let inner = Dribble {
        data: &blob,
        rng: Rng::new(3),
        max: 23,
    };
    let mut indexer = SpanIndexer::new(inner, Codec::Gzip, 64 << 10).unwrap();
    let (mut out, mut rng) = (Vec::new(), Rng::new(5));
    let mut buf = [0u8; 700];
    loop {
        let want = 1 + rng.below(buf.len());
        match indexer.read(&mut buf[..want]).unwrap() {
            0 => break,
            n => out.extend_from_slice(&buf[..n]),
        }
    }
    assert!(out == data);
    assert_eq!(indexer.finish().unwrap(), expected);
}

/// Zeros compress ~1000:1; spans still stop near `MAX_SPAN_EXPANSION` x
/// span size uncompressed (plus at most one deflate block). Not level 1:
/// zlib-rs's (like zlib-ng's) writes the whole stream as one block.
#[test]
fn compressible_data_spans_are_bounded() {
    let data = vec![0u8; 40 << 20];
    let blob = gzip(&data, 6);
    let (_, layer) = index(&blob, Codec::Gzip, SPAN).unwrap();
    let cap = SPAN * MAX_SPAN_EXPANSION;
    assert!(
        layer.spans.len() >= 4,
        "{} spans for {} zeros",
        layer.spans.len(),
        data.len()
    );
    for span in &layer.spans {
        assert!(span.len() < 2 * cap, "{span:?} is {} bytes", span.len());
    }
    check_layer(&blob, &data, &layer);
}

#[test]
fn trailing_zeros_are_padding() {
    let data = mixed_data(300_000, 11);
    let mut blob = gzip(&data, 6);
    blob.extend_from_slice(&[0; 1000]);
    let (out, layer) = index(&blob, Codec::Gzip, SPAN).unwrap();
    assert!(out == data);
    check_layer(&blob, &data, &layer);
}

fn index_error(blob: &[u8]) -> ZranError {
    match index(blob, Codec::Gzip, SPAN) {
        Ok(_) => panic!("indexing bad input succeeded"),
        Err(err) => err,
    }
}

#[test]
fn trailing_garbage_is_an_error() {
    let mut blob = gzip(b"hello", 6);
    let end = blob.len() as u64;
    blob.extend_from_slice(&[0, 0, 7, 0]);
    assert!(matches!(index_error(&blob), ZranError::TrailingData { offset } if offset == end + 2));
}

#[test]
fn bad_crc_or_size_trailer_is_an_error() {
    let blob = gzip(&mixed_data(200_000, 2), 6);
    let n = blob.len();
    for (at, field) in [(n - 8, "CRC32"), (n - 1, "ISIZE")] {
        let mut bad = blob.clone();
        bad[at] ^= 0x40;
        match index_error(&bad) {
            ZranError::GzipTrailer {
                field: f, offset, ..
            } => {
                assert_eq!((f, offset), (field, n as u64 - 8));
            }
            other => panic!("{other}"),
        }
    }
}

#[test]
fn truncated_stream_is_an_error() {
    let blob = gzip(&mixed_data(1_000_000, 4), 6);
    for cut in [5, 15, blob.len() / 2, blob.len() - 4] {
        let err = index_error(&blob[..cut]);
        assert!(
            matches!(err, ZranError::Truncated { offset, .. } if offset == cut as u64),
            "cut {cut}: {err}"
        );
    }
    assert!(matches!(
        index_error(b""),
        ZranError::Truncated { offset: 0, .. }
    ));
}

#[test]
fn bad_headers_are_errors() {
    let blob = gzip(b"some data", 6);
    let header_error = |bytes: &[u8]| match index_error(bytes) {
        ZranError::GzipHeader { offset, reason } => (offset, reason),
        other => panic!("{other}"),
    };
    let mut bad = blob.clone();
    bad[1] = 0x8c;
    assert!(header_error(&bad).1.contains("magic"));
    let mut bad = blob.clone();
    bad[2] = 7;
    assert_eq!(header_error(&bad).0, 2);
    let mut bad = blob.clone();
    bad[3] = 0x20;
    assert!(header_error(&bad).1.contains("reserved"));

    // FHCRC that does not match.
    let mut bad = member_with_hcrc(b"data");
    bad[24] ^= 1;
    assert!(header_error(&bad).1.contains("CRC16"));

    // An FNAME that never ends is cut off at 64 KiB, not read to the end.
    let mut long_name = vec![0x1f, 0x8b, 8, 0x08, 0, 0, 0, 0, 0, 3];
    long_name.resize(200_000, b'a');
    let (offset, reason) = header_error(&long_name);
    assert_eq!(offset, 10);
    assert!(reason.contains("longer than 65536"), "{reason}");
}

#[test]
fn absurd_extra_length_is_a_bounded_error() {
    // XLEN = 65535 (the most a u16 can say) but only a few bytes follow.
    let blob = [0x1f, 0x8b, 8, 0x04, 0, 0, 0, 0, 0, 3, 0xff, 0xff, 1, 2, 3];
    let err = index_error(&blob);
    assert!(
        matches!(
            err,
            ZranError::Truncated {
                offset: 15,
                inside: "a gzip header"
            }
        ),
        "{err}"
    );
}

#[test]
fn finish_before_the_end_is_an_error() {
    let blob = gzip(&mixed_data(500_000, 9), 6);
    let mut indexer = SpanIndexer::new(&blob[..], Codec::Gzip, SPAN).unwrap();
    let mut buf = vec![0u8; 100_000];
    indexer.read_exact(&mut buf).unwrap();
    assert!(matches!(
        indexer.finish(),
        Err(ZranError::NotFinished { .. })
    ));

    let mut bad = blob.clone();
    bad[blob.len() / 2] ^= 0xff;
    let mut indexer = SpanIndexer::new(&bad[..], Codec::Gzip, SPAN).unwrap();
    assert!(std::io::copy(&mut indexer, &mut std::io::sink()).is_err());
    assert!(
        indexer.read(&mut buf).is_err(),
        "a failed indexer must stay failed"
    );
    assert!(matches!(indexer.finish(), Err(ZranError::Failed(_))));
}

#[test]
fn span_size_below_the_minimum_is_refused() {
    assert!(matches!(
        SpanIndexer::new(&b""[..], Codec::Gzip, 1000),
        Err(ZranError::SpanSize(1000))
    ));
}

/// Any flipped byte in a span's range fails the decode: a data error or a
/// digest mismatch, never wrong bytes.
#[test]
fn corrupt_span_bytes_are_caught() {
    let data = mixed_data(3_000_000, 21);
    let blob = gzip(&data, 6);
    let (_, layer) = index(&blob, Codec::Gzip, SPAN).unwrap();
    let mut rng = Rng::new(8);
    for span in &layer.spans {
        let mut bytes = compressed(&blob, span).to_vec();
        for _ in 0..4 {
            let at = 1 + rng.below(bytes.len() - 2);
            bytes[at] ^= 1 << rng.below(8);
            let err = decode_span(span, &bytes).expect_err("corrupt span decoded");
            assert!(
                matches!(
                    err,
                    ZranError::Deflate { .. }
                        | ZranError::DigestMismatch { .. }
                        | ZranError::ShortSpan { .. }
                        | ZranError::Truncated { .. }
                ),
                "{err}"
            );
            bytes.copy_from_slice(compressed(&blob, span));
        }
    }
}

#[test]
fn wrong_length_window_or_bits_are_caught() {
    let data = mixed_data(3_000_000, 22);
    let blob = gzip(&data, 6);
    let (_, layer) = index(&blob, Codec::Gzip, SPAN).unwrap();
    let span = layer
        .spans
        .iter()
        .find(|s| s.kind == SpanKind::GzipInside && s.skip_bits != 0)
        .unwrap();
    let bytes = compressed(&blob, span);

    let err = decode_span(span, &bytes[..bytes.len() - 1]).unwrap_err();
    assert!(matches!(err, ZranError::CompressedLength { .. }), "{err}");

    let mut wrong = span.clone();
    wrong.window.iter_mut().for_each(|b| *b = b'x');
    assert!(decode_span(&wrong, bytes).is_err());

    let mut wrong = span.clone();
    wrong.skip_bits = (span.skip_bits + 1) % 8;
    assert!(decode_span(&wrong, bytes).is_err());

    // The index claims fewer compressed bytes than the span needs.
    let mut wrong = span.clone();
    wrong.compressed.end -= 1000;
    assert!(decode_span(&wrong, &bytes[..bytes.len() - 1000]).is_err());

    let mut wrong = span.clone();
    wrong.uncompressed.end += 1;
    assert!(decode_span(&wrong, bytes).is_err());

    let mut wrong = span.clone();
    wrong.uncompressed.end = wrong.uncompressed.start + (1 << 40);
    assert!(matches!(
        decode_span(&wrong, bytes),
        Err(ZranError::InvalidSpan(_))
    ));
}

/// `len` bytes of 40-byte words drawn from a pool of 2,000 random ones (80
/// KB, more than a window): most copies reach far back into the window.
fn words(len: usize) -> Vec<u8> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let pool: Vec<Vec<u8>> = (0..2_000)
        .map(|_| (0..40).map(|_| next() as u8).collect())
        .collect();
    let mut out = Vec::with_capacity(len + 40);
    while out.len() < len {
        out.extend_from_slice(&pool[(next() % 2_000) as usize]);
    }
    out.truncate(len);
    out
}

/// Windows that the spans read all over (random words from a pool larger
/// than the window) cost what `WINDOW_BUDGET` allows and no more: the
/// spans grow instead, and each still decodes.
#[test]
fn costly_windows_stay_within_the_budget() {
    let data = words(6_000_000);
    let blob = gzip(&data, 6);
    let (out, layer) = index(&blob, Codec::Gzip, lamina_zran::MIN_SPAN_SIZE).unwrap();
    assert!(out == data, "indexer output differs from the original");
    check_layer(&blob, &data, &layer);
    let cost: u64 = layer
        .spans
        .iter()
        .map(|s| s.window.iter().filter(|&&b| b != 0).count() as u64)
        .sum();
    let (budget, size) = (lamina_zran::WINDOW_BUDGET, layer.compressed_size);
    let one_window = lamina_zran::WINDOW_SIZE as u64;
    assert!(
        cost * budget <= size + one_window * budget,
        "windows cost {cost} bytes for {size} compressed"
    );
    let inside = layer
        .spans
        .iter()
        .filter(|s| s.kind == SpanKind::GzipInside)
        .count() as u64;
    assert!(inside >= 2, "{inside} points inside the member");
    assert!(
        size / (inside + 1) > 2 * lamina_zran::MIN_SPAN_SIZE,
        "{inside} points in {size} bytes: the budget did not lengthen the spans"
    );
}
