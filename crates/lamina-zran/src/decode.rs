//! [`decode_span`]: one span from its compressed bytes alone.

use ring::digest;

use crate::{gzip, zst, Span, SpanKind, ZranError, WINDOW_SIZE};

/// The most uncompressed bytes one compressed byte can give: deflate tops
/// out near 1032:1, zstd (RLE blocks: 3 header bytes + 1 for 128 KiB) near
/// 32768:1. A span claiming more is a corrupt index, refused before its
/// buffer is allocated.
const MAX_DEFLATE_RATIO: u64 = 1032;
const MAX_ZSTD_RATIO: u64 = 1 << 15;

/// Decodes one span alone from `compressed`, the blob's bytes
/// `span.compressed` (exactly that many). Returns exactly the span's
/// uncompressed bytes, checked against its sha256; allocates no more than
/// the span's length plus small buffers.
///
/// Errors: a slice of the wrong length, an inconsistent span, corrupt or
/// truncated data, a length other than the span's, or
/// [`ZranError::DigestMismatch`].
pub fn decode_span(span: &Span, compressed: &[u8]) -> Result<Vec<u8>, ZranError> {
    let len = check_span(span, compressed)?;
    let offset = span.compressed.start;
    let out = match span.kind {
        SpanKind::GzipMemberStart | SpanKind::GzipInside => {
            gzip::decode(compressed, span.skip_bits, &span.window, len, offset)?
        }
        SpanKind::Zstd => zst::decode(compressed, len, offset)?,
        SpanKind::Plain => compressed.to_vec(),
    };
    if digest::digest(&digest::SHA256, &out).as_ref() != span.digest {
        return Err(ZranError::DigestMismatch { offset });
    }
    Ok(out)
}

/// The span's length in bytes, once its fields agree with each other and
/// with `compressed`.
fn check_span(span: &Span, compressed: &[u8]) -> Result<usize, ZranError> {
    let invalid = |reason: &str| Err(ZranError::InvalidSpan(format!("{span:?}: {reason}")));
    let (Some(expected), Some(len)) = (
        span.compressed.end.checked_sub(span.compressed.start),
        span.uncompressed.end.checked_sub(span.uncompressed.start),
    ) else {
        return invalid("inverted range");
    };
    if compressed.len() as u64 != expected {
        return Err(ZranError::CompressedLength {
            expected,
            given: compressed.len() as u64,
        });
    }
    let inside = span.kind == SpanKind::GzipInside;
    if !inside && (span.skip_bits != 0 || !span.window.is_empty()) {
        return invalid("only a gzip point inside a member has skip bits or a window");
    }
    if span.skip_bits > 7 || span.window.len() > WINDOW_SIZE {
        return invalid("skip bits above 7 or window above 32 KiB");
    }
    let max_len = match span.kind {
        SpanKind::GzipMemberStart | SpanKind::GzipInside => {
            (expected + 1).saturating_mul(MAX_DEFLATE_RATIO)
        }
        SpanKind::Zstd => (expected + 1).saturating_mul(MAX_ZSTD_RATIO),
        SpanKind::Plain => expected,
    };
    if len > max_len || (span.kind == SpanKind::Plain && len != expected) {
        return invalid("uncompressed length impossible for its compressed length");
    }
    usize::try_from(len).or_else(|_| invalid("too long for this platform"))
}
