//! Spans as a tar index stores them ([`lamina_format::tar_index`]): the
//! index's entry and window back into a [`Span`], decoded alone.

use lamina_format::index::ChunkEntry;
use lamina_format::tar_index::{
    SPAN_GZIP, SPAN_PLAIN, SPAN_SKIP_BITS_MASK, SPAN_WINDOW, SPAN_ZSTD,
};

use crate::{decode_span, Span, SpanKind, ZranError};

/// The span `entry` describes, with `window` when it needs one.
pub fn span_of_entry(entry: &ChunkEntry, window: Option<&[u8]>) -> Result<Span, ZranError> {
    let invalid = |why: &str| ZranError::InvalidSpan(format!("{entry:?}: {why}"));
    let extra = entry.reserved.get();
    let kind = match entry.flags.get() {
        SPAN_PLAIN => SpanKind::Plain,
        SPAN_ZSTD => SpanKind::Zstd,
        SPAN_GZIP if extra & SPAN_WINDOW != 0 => SpanKind::GzipInside,
        SPAN_GZIP => SpanKind::GzipMemberStart,
        _ => return Err(invalid("unknown flags")),
    };
    let window = match (kind, window) {
        (SpanKind::GzipInside, Some(w)) => w.to_vec(),
        (SpanKind::GzipInside, None) => return Err(invalid("no window")),
        (_, None) => Vec::new(),
        (_, Some(_)) => return Err(invalid("a window it does not need")),
    };
    let start = entry.cache_offset.get();
    let at = entry.compressed_offset.get();
    Ok(Span {
        uncompressed: start..start + u64::from(entry.size.get()),
        compressed: at..at + u64::from(entry.compressed_size.get()),
        skip_bits: (extra & SPAN_SKIP_BITS_MASK) as u8,
        window,
        kind,
        digest: entry.digest,
    })
}

/// Decodes the span `entry` describes from `compressed`, its compressed
/// range's bytes, and checks its digest ([`decode_span`]).
pub fn decode_entry(
    entry: &ChunkEntry,
    window: Option<&[u8]>,
    compressed: &[u8],
) -> Result<Vec<u8>, ZranError> {
    decode_span(&span_of_entry(entry, window)?, compressed)
}
