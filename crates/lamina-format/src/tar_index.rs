//! The span table of a tar index: for each layer of an *unmodified* OCI
//! image, where each span of its uncompressed tar lies in the original
//! compressed layer blob, how to decode it alone, and the digest its bytes
//! must have before anyone may read them.
//!
//! ```text
//! TarIndexHeader (32 bytes)
//! BlobEntry   x layer_count   (96 bytes each, in layer order: layer i is EROFS device i+1)
//! ChunkEntry  x span_count    (64 bytes each, grouped by layer, by tar offset)
//! u32         x prefetch_count (the boot set: span numbers, in the order to fetch them)
//! ChunkEntry  x window_count  (64 bytes each: one per span with SPAN_WINDOW, in span order)
//! ```
//! All integers little-endian. The entries are the chunk index's
//! ([`crate::index`]), read differently: a layer's `BlobEntry` names the
//! original compressed layer (digest and size as its manifest gives them),
//! `cache_size` and `data_size` are the uncompressed tar's size (the cache
//! file *is* the tar, sparse), `table_digest` is the sha256 of the layer's
//! span entries (so a cache entry is named by the layer and the spans that
//! verified it, [`crate::fill::entry_id`]). A span's `ChunkEntry` gives its
//! place in the tar (`cache_offset`, `size`: spans tile the tar, unaligned),
//! the compressed bytes to fetch (`compressed_offset`, `compressed_size`),
//! how to decode them (`flags`: [`SPAN_PLAIN`], [`SPAN_ZSTD`], [`SPAN_GZIP`])
//! and, for gzip, in `reserved`: the bits of the first fetched byte already
//! consumed (low 3 bits) and [`SPAN_WINDOW`] when the span needs history
//! before it (a checkpoint inside a gzip member). Its window is the last
//! `size` bytes of that history (at most 32 KiB, at least 1): from the first
//! byte the span's copies read, with the bytes they do not read zeroed
//! (the indexer narrows each window so, and checks the narrowed one decodes
//! the span's start alike).
//!
//! Windows are most of an index's bytes (about 2 KiB stored per checkpoint
//! once narrowed, against 64 bytes of entry), and a start needs those of
//! the spans it reads only; so
//! they live in a blob of their own beside the table (the artifact's windows
//! layer), each one zstd frame, fetched with the spans that need them. A
//! window's entry says where: `compressed_offset` and `compressed_size` in
//! the windows blob, `size` (at most 32 KiB), `flags` [`crate::index::CHUNK_ZSTD`],
//! `digest` the sha256 of the window, `cache_offset` and `reserved` 0. A
//! window is checked on its own, so that a windows blob damaged on the way
//! is told from a bad layer. A window and its span's digest come from the
//! same index: one forged with both can put bytes that are in no layer into
//! a span that passes its digest. So an index is trusted only as its
//! publisher or the node's operator vouches for it (docs/index.md, *Who is
//! trusted with what*), never because its digests agree.

use zerocopy::little_endian::U32;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

use crate::index::{
    read_prefetch, BlobEntry, ChunkEntry, IndexBlob, IndexError, CHUNK_ZSTD, MAX_BLOBS, MAX_CHUNKS,
};

/// `TarIndexHeader::magic`.
pub const TAR_INDEX_MAGIC: [u8; 8] = *b"LAMTARX\x01";
/// The version this build writes and reads.
pub const TAR_INDEX_VERSION: u32 = 2;
/// `ChunkEntry::flags`: the span's bytes are stored as they are (a plain
/// tar layer); `compressed_offset` equals `cache_offset`.
pub const SPAN_PLAIN: u32 = 0;
/// `ChunkEntry::flags`: one or more whole zstd frames.
pub const SPAN_ZSTD: u32 = 1;
/// `ChunkEntry::flags`: raw deflate data from a gzip member's start (just
/// after its header) or from a checkpoint inside it.
pub const SPAN_GZIP: u32 = 2;
/// `ChunkEntry::reserved` of a gzip span: it needs its window.
pub const SPAN_WINDOW: u32 = 1 << 8;
/// `ChunkEntry::reserved` of a gzip span: bits of the first fetched byte
/// already consumed.
pub const SPAN_SKIP_BITS_MASK: u32 = 7;
/// The largest window: deflate's history.
pub const MAX_WINDOW: usize = 32 << 10;
/// Largest span sizes, as log2 of the bound the header gives: 64 KiB to
/// 4 GiB of uncompressed bytes (a single-frame zstd layer is one span).
pub const SPAN_BITS: std::ops::RangeInclusive<u8> = 16..=32;

/// Start of a tar index.
#[derive(Debug, Clone, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct TarIndexHeader {
    /// [`TAR_INDEX_MAGIC`].
    pub magic: [u8; 8],
    /// [`TAR_INDEX_VERSION`].
    pub version: U32,
    /// log2 of the bound on a span's uncompressed size.
    pub span_bits: U32,
    /// Number of layer entries.
    pub layer_count: U32,
    /// Number of span entries.
    pub span_count: U32,
    /// Number of boot-set entries after the spans.
    pub prefetch_count: U32,
    /// Number of window entries after the boot set.
    pub window_count: U32,
}

const _: () = assert!(size_of::<TarIndexHeader>() == 32);

/// A parsed tar index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TarIndex {
    /// log2 of the bound on a span's uncompressed size.
    pub span_bits: u8,
    /// Layers in order, each with its spans as chunks.
    pub layers: Vec<TarLayer>,
    /// The boot set, as (layer, span) positions.
    pub prefetch: Vec<(u32, u32)>,
}

/// One layer: its spans (as a blob of chunks) and where their windows are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TarLayer {
    /// The layer blob and its spans, in tar order.
    pub blob: IndexBlob,
    /// Per span: where its window is in the windows blob, when its
    /// `reserved` has [`SPAN_WINDOW`].
    pub windows: Vec<Option<ChunkEntry>>,
}

impl TarIndex {
    /// Serialises the index.
    pub fn to_bytes(&self) -> Vec<u8> {
        let spans = self
            .layers
            .iter()
            .map(|l| l.blob.chunks.len())
            .sum::<usize>();
        let windows = self.layers.iter().flat_map(|l| &l.windows).flatten();
        let header = TarIndexHeader {
            magic: TAR_INDEX_MAGIC,
            version: TAR_INDEX_VERSION.into(),
            span_bits: u32::from(self.span_bits).into(),
            layer_count: (self.layers.len() as u32).into(),
            span_count: (spans as u32).into(),
            prefetch_count: (self.prefetch.len() as u32).into(),
            window_count: (windows.clone().count() as u32).into(),
        };
        let mut out = header.as_bytes().to_vec();
        let mut firsts = Vec::with_capacity(self.layers.len());
        let mut first = 0u32;
        for layer in &self.layers {
            let blob = &layer.blob;
            let entry = BlobEntry {
                digest: blob.digest,
                compressed_size: blob.compressed_size.into(),
                cache_size: blob.cache_size.into(),
                first_chunk: first.into(),
                chunk_count: (blob.chunks.len() as u32).into(),
                table_digest: blob.table_digest(),
                data_size: blob.data_size().into(),
            };
            out.extend_from_slice(entry.as_bytes());
            firsts.push(first);
            first += blob.chunks.len() as u32;
        }
        for span in self.layers.iter().flat_map(|l| &l.blob.chunks) {
            out.extend_from_slice(span.as_bytes());
        }
        for &(layer, span) in &self.prefetch {
            let global = firsts.get(layer as usize).copied().unwrap_or(u32::MAX) + span;
            out.extend_from_slice(&global.to_le_bytes());
        }
        for window in windows {
            out.extend_from_slice(window.as_bytes());
        }
        out
    }

    /// Parses and validates an index whose bytes were verified against the
    /// digest its artifact gives: every count within the limits before
    /// anything is allocated, spans tiling each tar, compressed ranges
    /// inside their layer and in order, window entries where (and only
    /// where) a span says it needs one.
    pub fn from_bytes(bytes: &[u8]) -> Result<TarIndex, IndexError> {
        let (header, rest) =
            TarIndexHeader::read_from_prefix(bytes).map_err(|_| IndexError::Truncated)?;
        let span_bits = check_header(&header)?;
        let (layer_count, span_count) = (header.layer_count.get(), header.span_count.get());
        let layer_bytes = layer_count as usize * size_of::<BlobEntry>();
        let span_bytes = span_count as usize * size_of::<ChunkEntry>();
        let prefetch_bytes = header.prefetch_count.get() as usize * 4;
        if rest.len() < layer_bytes + span_bytes + prefetch_bytes {
            return Err(IndexError::Truncated);
        }
        let (layer_area, rest) = rest.split_at(layer_bytes);
        let (span_area, rest) = rest.split_at(span_bytes);
        let (prefetch_area, mut window_area) = rest.split_at(prefetch_bytes);
        let mut layers = Vec::with_capacity(layer_count as usize);
        let mut firsts = Vec::with_capacity(layer_count as usize);
        let mut first = 0usize;
        for raw in layer_area.chunks_exact(size_of::<BlobEntry>()) {
            let entry = BlobEntry::read_from_bytes(raw).map_err(|_| IndexError::Truncated)?;
            let count = entry.chunk_count.get() as usize;
            if entry.first_chunk.get() as usize != first || first + count > span_count as usize {
                return Err(inconsistent("layer span range"));
            }
            let spans = span_area[first * size_of::<ChunkEntry>()..]
                .chunks_exact(size_of::<ChunkEntry>())
                .take(count)
                .map(|c| ChunkEntry::read_from_bytes(c).map_err(|_| IndexError::Truncated))
                .collect::<Result<Vec<_>, _>>()?;
            let blob = IndexBlob {
                digest: entry.digest,
                compressed_size: entry.compressed_size.get(),
                cache_size: entry.cache_size.get(),
                chunks: spans,
            };
            validate_spans(&blob, span_bits)?;
            if entry.table_digest != blob.table_digest() || entry.data_size.get() != blob.cache_size
            {
                return Err(inconsistent("layer span table digest or size"));
            }
            let windows = read_windows(&blob.chunks, &mut window_area)?;
            layers.push(TarLayer { blob, windows });
            firsts.push(first);
            first += count;
        }
        if first != span_count as usize || !window_area.is_empty() {
            return Err(inconsistent("spans or windows left over"));
        }
        let prefetch = read_prefetch(prefetch_area, &firsts, first)?;
        Ok(TarIndex {
            span_bits,
            layers,
            prefetch,
        })
    }
}

fn inconsistent(what: &str) -> IndexError {
    IndexError::Inconsistent(what.into())
}

fn check_header(header: &TarIndexHeader) -> Result<u8, IndexError> {
    if header.magic != TAR_INDEX_MAGIC || header.version.get() != TAR_INDEX_VERSION {
        return Err(IndexError::BadMagic);
    }
    let spans = header.span_count.get();
    for (what, count, limit) in [
        ("layers", header.layer_count.get(), MAX_BLOBS),
        ("spans", spans, MAX_CHUNKS),
        ("boot-set entries", header.prefetch_count.get(), spans),
        ("windows", header.window_count.get(), spans),
    ] {
        if count > limit {
            return Err(IndexError::TooLarge { what, count, limit });
        }
    }
    u8::try_from(header.span_bits.get())
        .ok()
        .filter(|b| SPAN_BITS.contains(b))
        .ok_or_else(|| inconsistent("span bits"))
}

/// Spans tile `[0, cache_size)` in order; each decodes from a compressed
/// range inside the layer, ranges in order (a gzip checkpoint's first byte
/// may be the previous span's last); flags and skip bits known.
fn validate_spans(blob: &IndexBlob, span_bits: u8) -> Result<(), IndexError> {
    let mut tar_end = 0u64;
    let mut last_offset = 0u64;
    for span in &blob.chunks {
        let (size, stored) = (
            u64::from(span.size.get()),
            u64::from(span.compressed_size.get()),
        );
        if span.cache_offset.get() != tar_end || size == 0 || size > 1u64 << span_bits {
            return Err(inconsistent("span tar range"));
        }
        tar_end += size;
        let offset = span.compressed_offset.get();
        let inside = offset
            .checked_add(stored)
            .is_some_and(|end| end <= blob.compressed_size);
        if !inside || offset < last_offset || stored == 0 {
            return Err(inconsistent("span beyond its layer or out of order"));
        }
        last_offset = offset;
        let (flags, extra) = (span.flags.get(), span.reserved.get());
        let fits = match flags {
            SPAN_PLAIN => extra == 0 && stored == size && offset == span.cache_offset.get(),
            SPAN_ZSTD => extra == 0,
            SPAN_GZIP => extra & !(SPAN_WINDOW | SPAN_SKIP_BITS_MASK) == 0,
            _ => false,
        };
        if !fits {
            return Err(inconsistent("span flags"));
        }
    }
    if tar_end != blob.cache_size {
        return Err(inconsistent("spans do not end at the tar's end"));
    }
    Ok(())
}

/// The window entries of `spans` from the front of `area`, advancing it.
fn read_windows(
    spans: &[ChunkEntry],
    area: &mut &[u8],
) -> Result<Vec<Option<ChunkEntry>>, IndexError> {
    let mut windows = Vec::with_capacity(spans.len());
    for span in spans {
        if span.flags.get() != SPAN_GZIP || span.reserved.get() & SPAN_WINDOW == 0 {
            windows.push(None);
            continue;
        }
        let (entry, rest) =
            ChunkEntry::read_from_prefix(area).map_err(|_| IndexError::Truncated)?;
        let size = entry.size.get() as usize;
        let fits = size > 0
            && size <= MAX_WINDOW
            && entry.compressed_size.get() > 0
            && entry.flags.get() == CHUNK_ZSTD
            && entry.cache_offset.get() == 0
            && entry.reserved.get() == 0
            && entry
                .compressed_offset
                .get()
                .checked_add(entry.compressed_size.get().into())
                .is_some();
        if !fits {
            return Err(inconsistent("window entry"));
        }
        windows.push(Some(entry));
        *area = rest;
    }
    Ok(windows)
}

/// The entry of a window stored at `offset` in the windows blob as the
/// `stored` bytes of one zstd frame.
pub fn window_entry(window: &[u8], offset: u64, stored: u32) -> ChunkEntry {
    ChunkEntry {
        cache_offset: 0.into(),
        compressed_offset: offset.into(),
        compressed_size: stored.into(),
        size: (window.len() as u32).into(),
        flags: CHUNK_ZSTD.into(),
        reserved: 0.into(),
        digest: {
            let mut out = [0u8; 32];
            out.copy_from_slice(ring::digest::digest(&ring::digest::SHA256, window).as_ref());
            out
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(tar: u64, comp: u64, stored: u32, size: u32, flags: u32, extra: u32) -> ChunkEntry {
        ChunkEntry {
            cache_offset: tar.into(),
            compressed_offset: comp.into(),
            compressed_size: stored.into(),
            size: size.into(),
            flags: flags.into(),
            reserved: extra.into(),
            digest: [tar as u8; 32],
        }
    }

    fn sample() -> TarIndex {
        let gzip = TarLayer {
            blob: IndexBlob {
                digest: [1; 32],
                compressed_size: 5000,
                cache_size: 30_000,
                chunks: vec![
                    span(0, 10, 2001, 12_000, SPAN_GZIP, 0),
                    span(12_000, 2010, 2000, 10_000, SPAN_GZIP, SPAN_WINDOW | 5),
                    span(22_000, 4009, 900, 8_000, SPAN_GZIP, SPAN_WINDOW),
                ],
            },
            windows: vec![
                None,
                Some(window_entry(&[7; MAX_WINDOW], 0, 300)),
                Some(window_entry(&[8; 100], 300, 20)),
            ],
        };
        let plain = TarLayer {
            blob: IndexBlob {
                digest: [2; 32],
                compressed_size: 2048,
                cache_size: 2048,
                chunks: vec![
                    span(0, 0, 1024, 1024, SPAN_PLAIN, 0),
                    span(1024, 1024, 1024, 1024, SPAN_PLAIN, 0),
                ],
            },
            windows: vec![None, None],
        };
        TarIndex {
            span_bits: 20,
            layers: vec![gzip, plain],
            prefetch: vec![(1, 1), (0, 2)],
        }
    }

    #[test]
    fn the_fuzz_seed_parses() {
        let seed = include_bytes!("../../../fuzz/seeds/tar_index/gzip-two-spans");
        let index = TarIndex::from_bytes(seed).unwrap();
        assert!(index.layers[0].windows.iter().any(Option::is_some));
    }

    #[test]
    fn round_trips() {
        let index = sample();
        let bytes = index.to_bytes();
        assert_eq!(TarIndex::from_bytes(&bytes).unwrap(), index);
    }

    #[test]
    fn bad_indexes_are_errors() {
        let good = sample();
        let mut cases: Vec<(&str, TarIndex)> = Vec::new();
        let mut gap = good.clone();
        gap.layers[0].blob.chunks[1].cache_offset = 12_001.into();
        cases.push(("a gap between spans", gap));
        let mut short = good.clone();
        short.layers[0].blob.cache_size = 31_000;
        cases.push(("spans short of the tar", short));
        let mut outside = good.clone();
        outside.layers[0].blob.chunks[2].compressed_size = 2000.into();
        cases.push(("a span past its layer", outside));
        let mut back = good.clone();
        back.layers[0].blob.chunks[2].compressed_offset = 2000.into();
        cases.push(("a span before the one before", back));
        let mut flags = good.clone();
        flags.layers[0].blob.chunks[0].flags = 9.into();
        cases.push(("unknown flags", flags));
        let mut plain = good.clone();
        plain.layers[1].blob.chunks[1].compressed_offset = 1000.into();
        cases.push(("a plain span elsewhere in the blob", plain));
        let mut big = good.clone();
        big.span_bits = 16;
        big.layers[1].blob = IndexBlob {
            digest: [2; 32],
            compressed_size: 70_000,
            cache_size: 70_000,
            chunks: vec![span(0, 0, 70_000, 70_000, SPAN_PLAIN, 0)],
        };
        big.layers[1].windows = vec![None];
        big.prefetch.clear();
        cases.push(("a span over the bound", big));
        let mut bits = good.clone();
        bits.span_bits = 33;
        cases.push(("span bits out of range", bits));
        for (what, index) in cases {
            assert!(TarIndex::from_bytes(&index.to_bytes()).is_err(), "{what}");
        }
        let bytes = good.to_bytes();
        for cut in [0, 31, 32 + 96, bytes.len() - 1] {
            assert!(TarIndex::from_bytes(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(TarIndex::from_bytes(&longer).is_err(), "a byte left over");
        // A window over 32 KiB: the first window entry's size field.
        let mut window = bytes.clone();
        let at = bytes.len() - 2 * size_of::<ChunkEntry>() + 20;
        window[at..at + 4].copy_from_slice(&(MAX_WINDOW as u32 + 1).to_le_bytes());
        assert!(TarIndex::from_bytes(&window).is_err(), "a window too long");
        let mut stored = good.clone();
        if let Some(w) = stored.layers[0].windows[1].as_mut() {
            w.flags = 0.into();
        }
        assert!(
            TarIndex::from_bytes(&stored.to_bytes()).is_err(),
            "a window not stored as zstd"
        );
        let mut counts = bytes;
        counts[16..20].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            TarIndex::from_bytes(&counts),
            Err(IndexError::TooLarge { .. })
        ));
    }

    #[test]
    fn a_span_table_names_its_cache_entry() {
        let index = sample();
        let mut other = index.clone();
        other.layers[0].blob.chunks[0].digest = [9; 32];
        assert_ne!(
            index.layers[0].blob.entry_id(),
            other.layers[0].blob.entry_id(),
            "another span digest, another cache entry"
        );
    }
}
