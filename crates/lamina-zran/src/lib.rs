//! Random access into a container layer's compressed stream: [`SpanIndexer`]
//! records span points while the layer streams through once, and
//! [`decode_span`] decodes one span from only its fetched compressed bytes.
//!
//! Codecs: gzip (one or many members; checkpoints inside a member are a bit
//! offset plus the 32 KiB of history before it, as zlib's `zran.c`), zstd
//! (spans are runs of whole frames) and uncompressed layers. The on-disk form
//! of the spans is `lamina_format::tar_index` ([`span_of_entry`] reads it
//! back); the fetching is other crates' business.
#![deny(unsafe_code)]
#![warn(missing_docs)]

mod decode;
mod entry;
mod error;
mod gzip;
mod indexer;
mod input;
#[allow(unsafe_code)]
mod raw;
mod record;
mod sparse;
mod zst;

use std::fmt;
use std::ops::Range;

pub use decode::decode_span;
pub use entry::{decode_entry, span_of_entry};
pub use error::ZranError;
pub use indexer::SpanIndexer;

/// Default distance between span points, in compressed bytes; the caller
/// tunes it by measurement.
pub const DEFAULT_SPAN_SIZE: u64 = 4 << 20;

/// The smallest span size [`SpanIndexer::new`] accepts: below it the 32 KiB
/// window of each gzip point would outweigh the span.
pub const MIN_SPAN_SIZE: u64 = 64 << 10;

/// A span is also closed at the first possible point after this many times
/// `span_size` uncompressed bytes, so a very compressible stretch (a file of
/// zeros) cannot make one span that decodes to gigabytes. A single zstd frame
/// cannot be split, so it bounds zstd spans only at frame boundaries.
pub const MAX_SPAN_EXPANSION: u64 = 16;

/// Windows are kept to about 1/`WINDOW_BUDGET` of the compressed bytes
/// (their non-zero bytes, about what they cost to store once narrowed): no
/// point is placed while the windows so far are over that share of the
/// compressed bytes read, so a stretch whose windows cost more gets longer
/// spans. The windows then cost a registry at most about 2% of the layer,
/// whatever it holds (plus one window).
pub const WINDOW_BUDGET: u64 = 50;

/// The deflate history a gzip point inside a member carries.
pub const WINDOW_SIZE: usize = 32 << 10;

/// How a layer blob is compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Codec {
    /// One or more concatenated gzip members (RFC 1952).
    Gzip,
    /// One or more concatenated zstd frames, skippable frames allowed.
    Zstd,
    /// Not compressed: the blob is the tar.
    Plain,
}

/// How a span's compressed bytes are decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SpanKind {
    /// Raw deflate from the first byte after a gzip member's header; no
    /// window, no skipped bits.
    GzipMemberStart,
    /// Raw deflate from a block boundary inside a member: skip
    /// [`Span::skip_bits`] of the first byte, [`Span::window`] is the
    /// dictionary.
    GzipInside,
    /// One or more whole zstd frames (skippable frames among them are fine).
    Zstd,
    /// The bytes themselves.
    Plain,
}

/// One independently decodable piece of a layer's uncompressed stream.
#[derive(Clone, PartialEq, Eq)]
pub struct Span {
    /// Where its bytes are in the uncompressed stream (the tar).
    pub uncompressed: Range<u64>,
    /// The compressed bytes a reader must fetch to decode it: `[start, end)`
    /// of the blob.
    pub compressed: Range<u64>,
    /// [`SpanKind::GzipInside`]: the low bits of the first fetched byte that
    /// belong to the previous span (0..=7). Zero for every other kind.
    pub skip_bits: u8,
    /// [`SpanKind::GzipInside`]: the last (up to) [`WINDOW_SIZE`] uncompressed
    /// bytes of the member before the span. Empty for every other kind.
    pub window: Vec<u8>,
    /// How to decode it.
    pub kind: SpanKind,
    /// sha256 of its uncompressed bytes.
    pub digest: [u8; 32],
}

impl Span {
    /// The number of uncompressed bytes in the span.
    pub fn len(&self) -> u64 {
        self.uncompressed
            .end
            .saturating_sub(self.uncompressed.start)
    }

    /// Whether the span holds no bytes (the indexer never records one).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

// By hand: 32 KiB of window would drown a log line.
impl fmt::Debug for Span {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let digest: String = self.digest.iter().map(|b| format!("{b:02x}")).collect();
        f.debug_struct("Span")
            .field("uncompressed", &self.uncompressed)
            .field("compressed", &self.compressed)
            .field("skip_bits", &self.skip_bits)
            .field("window_len", &self.window.len())
            .field("kind", &self.kind)
            .field("digest", &digest)
            .finish()
    }
}

/// A layer's spans, in stream order; they tile `0..uncompressed_size`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerSpans {
    /// The layer's codec.
    pub codec: Codec,
    /// Non-empty spans in order, contiguous in the uncompressed stream.
    pub spans: Vec<Span>,
    /// Length of the uncompressed stream.
    pub uncompressed_size: u64,
    /// Length of the blob, trailing padding included.
    pub compressed_size: u64,
}

#[cfg(test)]
mod tests {
    /// The caller may index on one thread and hand the indexer on.
    #[test]
    fn indexer_is_send() {
        fn send<T: Send>() {}
        send::<crate::SpanIndexer<std::fs::File>>();
        send::<crate::ZranError>();
    }
}
