//! The chunk index: for every stored chunk, where it sits compressed in its
//! data blob and where its bytes go in the blob's uncompressed cache file,
//! plus the digest its bytes must have before anyone may read them.
//!
//! ```text
//! IndexHeader (32 bytes)
//! BlobEntry   x blob_count     (96 bytes each, in device order: blob i is EROFS device i+1)
//! ChunkEntry  x chunk_count    (64 bytes each, grouped by blob, by cache offset)
//! u32         x prefetch_count (the boot set: chunk numbers, in the order to fetch them)
//! ```
//! All integers little-endian. That is version 1. Version 2 (*paged*) leaves
//! the chunk entries out: each blob's entries, its *chunk table*, are the
//! last `chunk_count * 64` bytes of the blob itself, at most
//! [`MAX_TABLE_CHUNKS`] of them, and `BlobEntry::table_digest` is their
//! sha256. So the index a mount fetches holds 96 bytes per blob, and a
//! blob's table is fetched (and verified) when the blob is first read.

use zerocopy::little_endian::{U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// `IndexHeader::magic`.
pub const INDEX_MAGIC: [u8; 8] = *b"LAMINDX\x01";
/// The version with the chunk entries in the index.
pub const INDEX_VERSION: u32 = 1;
/// The version with each blob's chunk entries at the blob's end.
pub const INDEX_VERSION_PAGED: u32 = 2;
/// Most chunks in one blob of a paged index: its chunk table is at most
/// 64 KiB, one range request, whatever the image's size.
pub const MAX_TABLE_CHUNKS: u32 = 1024;
/// `ChunkEntry::flags`: the stored bytes are one zstd frame (else raw).
pub const CHUNK_ZSTD: u32 = 1;
/// Chunk sizes lamina writes and reads, as log2: 4 KiB to 16 MiB.
pub const CHUNK_BITS: std::ops::RangeInclusive<u8> = 12..=24;
/// Most data blobs in an index: EROFS device ids are 16-bit and device 0 is
/// the metadata image itself.
pub const MAX_BLOBS: u32 = u16::MAX as u32 - 1;
/// Most chunks in an index: 1 TiB of distinct data at the default 256 KiB
/// chunk size, 16 GiB at 4 KiB.
pub const MAX_CHUNKS: u32 = 1 << 22;
/// The largest index [`MAX_BLOBS`] and [`MAX_CHUNKS`] allow (about 291 MB),
/// each chunk also in the boot set.
pub const MAX_INDEX_SIZE: u64 = size_of::<IndexHeader>() as u64
    + MAX_BLOBS as u64 * size_of::<BlobEntry>() as u64
    + MAX_CHUNKS as u64 * (size_of::<ChunkEntry>() as u64 + 4);

/// Start of the index.
#[derive(Debug, Clone, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct IndexHeader {
    /// [`INDEX_MAGIC`].
    pub magic: [u8; 8],
    /// [`INDEX_VERSION`].
    pub version: U32,
    /// log2 of the chunk size files were cut into.
    pub chunk_bits: U32,
    /// Number of [`BlobEntry`] records.
    pub blob_count: U32,
    /// Number of [`ChunkEntry`] records.
    pub chunk_count: U32,
    /// Number of boot-set entries after the chunks.
    pub prefetch_count: U32,
    /// Zero.
    pub reserved: [u8; 4],
}

/// One data blob.
#[derive(Debug, Clone, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct BlobEntry {
    /// sha256 of the compressed blob (its OCI descriptor digest).
    pub digest: [u8; 32],
    /// Size of the compressed blob in bytes.
    pub compressed_size: U64,
    /// Size of the uncompressed cache file (a multiple of 4096).
    pub cache_size: U64,
    /// First chunk of this blob in the chunk array.
    pub first_chunk: U32,
    /// Number of chunks in this blob.
    pub chunk_count: U32,
    /// Version 2: sha256 of the blob's chunk table (its last
    /// `chunk_count * 64` bytes). Version 1: zero.
    pub table_digest: [u8; 32],
    /// Version 2: the sum of the chunks' sizes (what a complete cache file
    /// holds, without the gaps). Version 1: zero.
    pub data_size: U64,
}

/// One stored chunk.
#[derive(Debug, Clone, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct ChunkEntry {
    /// Byte offset in the cache file (block-aligned).
    pub cache_offset: U64,
    /// Byte offset in the compressed blob.
    pub compressed_offset: U64,
    /// Stored length in the blob.
    pub compressed_size: U32,
    /// Length of the chunk's bytes.
    pub size: U32,
    /// [`CHUNK_ZSTD`] or 0.
    pub flags: U32,
    /// Zero.
    pub reserved: U32,
    /// sha256 of the chunk's uncompressed bytes.
    pub digest: [u8; 32],
}

const _: () = assert!(size_of::<IndexHeader>() == 32);
const _: () = assert!(size_of::<BlobEntry>() == 96);
const _: () = assert!(size_of::<ChunkEntry>() == 64);

/// A parsed index (owned; the index is small).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkIndex {
    /// log2 of the chunk size.
    pub chunk_bits: u8,
    /// Blobs in device order.
    pub blobs: Vec<IndexBlob>,
    /// The boot set: chunks in the order a recorded workload first needed
    /// them, as (blob, chunk) positions.
    pub prefetch: Vec<(u32, u32)>,
}

/// A blob and its chunks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexBlob {
    /// sha256 of the compressed blob.
    pub digest: [u8; 32],
    /// Compressed size.
    pub compressed_size: u64,
    /// Cache file size.
    pub cache_size: u64,
    /// Chunks ordered by cache offset.
    pub chunks: Vec<ChunkEntry>,
}

/// One data blob as the index's blob table has it, without its chunks
/// ([`ChunkIndex::read_blob_table`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlobSummary {
    /// sha256 of the compressed blob.
    pub digest: [u8; 32],
    /// Compressed size.
    pub compressed_size: u64,
    /// Cache file size.
    pub cache_size: u64,
    /// Chunks in the blob.
    pub chunk_count: usize,
    /// A paged index: sha256 of the chunk table at the blob's end. `None`:
    /// the index holds the chunks.
    pub table_digest: Option<[u8; 32]>,
    /// The sum of the chunks' sizes; `None` for a version 1 blob table read
    /// alone ([`ChunkIndex::read_blob_table`]).
    pub data_size: Option<u64>,
}

impl BlobSummary {
    /// Where the blob's chunk table is in the blob (offset, length), for a
    /// paged index. [`ChunkIndex::parse_top`] checked it fits.
    pub fn table_range(&self) -> Option<(u64, u64)> {
        self.table_digest?;
        let len = self.chunk_count as u64 * size_of::<ChunkEntry>() as u64;
        Some((self.compressed_size.saturating_sub(len), len))
    }

    /// The cache entry of a blob of a paged index
    /// ([`crate::fill::entry_id`]); `None` for a version 1 blob, whose
    /// chunks give it ([`IndexBlob::entry_id`]).
    pub fn entry_id(&self) -> Option<[u8; 32]> {
        let table = self.table_digest?;
        Some(crate::fill::entry_id(&self.digest, self.cache_size, &table))
    }

    /// Where chunks may be in the blob: all of it but the chunk table.
    fn data_end(&self) -> u64 {
        self.table_range()
            .map_or(self.compressed_size, |(at, _)| at)
    }
}

/// An index as a mount reads it: the blob table and the boot set, and
/// (version 1) every blob's chunks. With a paged index (version 2) each
/// blob's chunks come from its table ([`IndexBlob::from_table`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexTop {
    /// log2 of the chunk size.
    pub chunk_bits: u8,
    /// Blobs in device order.
    pub blobs: Vec<BlobSummary>,
    /// The boot set, as (blob, chunk) positions.
    pub prefetch: Vec<(u32, u32)>,
    /// Version 1: the blobs with their chunks. Empty for a paged index.
    pub inline: Vec<IndexBlob>,
}

impl IndexBlob {
    /// What the blob table says of this blob.
    pub fn summary(&self) -> BlobSummary {
        BlobSummary {
            digest: self.digest,
            compressed_size: self.compressed_size,
            cache_size: self.cache_size,
            chunk_count: self.chunks.len(),
            table_digest: None,
            data_size: Some(self.data_size()),
        }
    }

    /// The sum of the chunks' sizes.
    pub fn data_size(&self) -> u64 {
        self.chunks.iter().map(|c| u64::from(c.size.get())).sum()
    }

    /// The blob's chunk table, as a paged index keeps it at the blob's end.
    pub fn table_bytes(&self) -> Vec<u8> {
        chunk_table_bytes(&self.chunks)
    }

    /// sha256 of [`table_bytes`](Self::table_bytes): for a blob of a paged
    /// index, the `table_digest` its index gives.
    pub fn table_digest(&self) -> [u8; 32] {
        let mut out = [0u8; 32];
        let digest = ring::digest::digest(&ring::digest::SHA256, &self.table_bytes());
        out.copy_from_slice(digest.as_ref());
        out
    }

    /// The cache entry this blob's chunks are verified in
    /// ([`crate::fill::entry_id`]).
    pub fn entry_id(&self) -> [u8; 32] {
        crate::fill::entry_id(&self.digest, self.cache_size, &self.table_digest())
    }

    /// Parses and validates the chunk table `table` of the blob `summary`
    /// describes (paged index): its length and sha256 must be the ones the
    /// (verified) index gives, and its chunks must pass the checks of
    /// [`ChunkIndex::from_bytes`], inside the blob before the table.
    pub fn from_table(
        summary: &BlobSummary,
        chunk_bits: u8,
        table: &[u8],
    ) -> Result<IndexBlob, IndexError> {
        let (Some(want), Some((_, len))) = (summary.table_digest, summary.table_range()) else {
            return Err(IndexError::Inconsistent(
                "the index holds this blob's chunks".into(),
            ));
        };
        if table.len() as u64 != len {
            return Err(IndexError::Truncated);
        }
        if ring::digest::digest(&ring::digest::SHA256, table).as_ref() != want {
            return Err(IndexError::Inconsistent(
                "chunk table digest mismatch".into(),
            ));
        }
        let chunks = table
            .chunks_exact(size_of::<ChunkEntry>())
            .map(|c| ChunkEntry::read_from_bytes(c).map_err(|_| IndexError::Truncated))
            .collect::<Result<_, _>>()?;
        let blob = IndexBlob {
            digest: summary.digest,
            compressed_size: summary.compressed_size,
            cache_size: summary.cache_size,
            chunks,
        };
        blob.validate(chunk_bits, summary.data_end())?;
        if summary.data_size != Some(blob.data_size()) {
            return Err(IndexError::Inconsistent("blob data size".into()));
        }
        Ok(blob)
    }
}

/// A malformed index.
#[derive(Debug, thiserror::Error)]
pub enum IndexError {
    /// Too short for what it claims to hold.
    #[error("chunk index truncated")]
    Truncated,
    /// Not an index, or a version this build does not know.
    #[error("not a lamina chunk index (bad magic or version)")]
    BadMagic,
    /// Offsets that overlap or run past the blob or cache sizes.
    #[error("chunk index inconsistent: {0}")]
    Inconsistent(String),
    /// More blobs or chunks than lamina reads (see [`MAX_BLOBS`], [`MAX_CHUNKS`]).
    #[error("chunk index has {count} {what}, more than the limit of {limit}")]
    TooLarge {
        /// Blobs or chunks.
        what: &'static str,
        /// The count in the header.
        count: u32,
        /// The limit.
        limit: u32,
    },
}

impl ChunkIndex {
    /// Serialises the index (version 1: every chunk entry in it).
    pub fn to_bytes(&self) -> Vec<u8> {
        self.serialise(false)
    }

    /// Serialises the index as version 2 (paged): no chunk entries, each
    /// blob's table digest instead. Each blob must end with its
    /// [`IndexBlob::table_bytes`] (counted in `compressed_size`) and hold
    /// at most [`MAX_TABLE_CHUNKS`] chunks.
    pub fn to_paged_bytes(&self) -> Vec<u8> {
        self.serialise(true)
    }

    fn serialise(&self, paged: bool) -> Vec<u8> {
        let chunk_count: usize = self.blobs.iter().map(|b| b.chunks.len()).sum();
        let version = if paged {
            INDEX_VERSION_PAGED
        } else {
            INDEX_VERSION
        };
        let header = IndexHeader {
            magic: INDEX_MAGIC,
            version: version.into(),
            chunk_bits: u32::from(self.chunk_bits).into(),
            blob_count: (self.blobs.len() as u32).into(),
            chunk_count: (chunk_count as u32).into(),
            prefetch_count: (self.prefetch.len() as u32).into(),
            reserved: [0; 4],
        };
        let mut out = header.as_bytes().to_vec();
        let mut firsts = Vec::with_capacity(self.blobs.len());
        let mut first = 0u32;
        for blob in &self.blobs {
            let (table_digest, data_size) = match paged {
                true => {
                    let table = ring::digest::digest(&ring::digest::SHA256, &blob.table_bytes());
                    (
                        table.as_ref().try_into().unwrap_or([0; 32]),
                        blob.data_size(),
                    )
                }
                false => ([0; 32], 0),
            };
            let entry = BlobEntry {
                digest: blob.digest,
                compressed_size: blob.compressed_size.into(),
                cache_size: blob.cache_size.into(),
                first_chunk: first.into(),
                chunk_count: (blob.chunks.len() as u32).into(),
                table_digest,
                data_size: data_size.into(),
            };
            firsts.push(first);
            first += blob.chunks.len() as u32;
            out.extend_from_slice(entry.as_bytes());
        }
        if !paged {
            for chunk in self.blobs.iter().flat_map(|b| &b.chunks) {
                out.extend_from_slice(chunk.as_bytes());
            }
        }
        for &(blob, chunk) in &self.prefetch {
            let global = firsts.get(blob as usize).copied().unwrap_or(u32::MAX) + chunk;
            out.extend_from_slice(&global.to_le_bytes());
        }
        out
    }

    /// Parses an index of either version for a mount: version 1 whole (as
    /// [`from_bytes`](Self::from_bytes)), version 2 as its blob table and
    /// boot set, with each blob's table bounded by [`MAX_TABLE_CHUNKS`] and
    /// inside its blob.
    pub fn parse_top(bytes: &[u8]) -> Result<IndexTop, IndexError> {
        let (header, rest) =
            IndexHeader::read_from_prefix(bytes).map_err(|_| IndexError::Truncated)?;
        if header.magic == INDEX_MAGIC && header.version.get() == INDEX_VERSION {
            let index = Self::from_bytes(bytes)?;
            return Ok(IndexTop {
                chunk_bits: index.chunk_bits,
                blobs: index.blobs.iter().map(IndexBlob::summary).collect(),
                prefetch: index.prefetch,
                inline: index.blobs,
            });
        }
        let chunk_bits = check_header(&header, INDEX_VERSION_PAGED)?;
        let (blob_count, prefetch_count) = (header.blob_count.get(), header.prefetch_count.get());
        let blob_bytes = blob_count as usize * size_of::<BlobEntry>();
        if rest.len() != blob_bytes + prefetch_count as usize * 4 {
            return Err(IndexError::Truncated);
        }
        let (blob_area, prefetch_area) = rest.split_at(blob_bytes);
        let blobs = read_blob_entries(blob_area, header.chunk_count.get(), true)?;
        let mut firsts = Vec::with_capacity(blobs.len());
        let mut first = 0usize;
        for b in &blobs {
            firsts.push(first);
            first += b.chunk_count;
        }
        let prefetch = read_prefetch(prefetch_area, &firsts, first)?;
        Ok(IndexTop {
            chunk_bits,
            blobs,
            prefetch,
            inline: Vec::new(),
        })
    }

    /// The blob table alone, read from the start of an index: its header
    /// and blob entries, not its chunks. What a mount over complete cache
    /// files needs (the full index is the largest metadata of an image of
    /// many files). The index's bytes must have been verified (its content
    /// digest); the counts are checked against the limits, and the blobs'
    /// chunk runs against the chunk count, before anything is allocated.
    pub fn read_blob_table(mut index: impl std::io::Read) -> Result<Vec<BlobSummary>, IndexError> {
        let mut header = [0u8; size_of::<IndexHeader>()];
        index
            .read_exact(&mut header)
            .map_err(|_| IndexError::Truncated)?;
        let header = IndexHeader::read_from_bytes(&header).map_err(|_| IndexError::Truncated)?;
        let version = header.version.get();
        if version != INDEX_VERSION && version != INDEX_VERSION_PAGED {
            return Err(IndexError::BadMagic);
        }
        check_header(&header, version)?;
        let blob_count = header.blob_count.get();
        let mut table = vec![0u8; blob_count as usize * size_of::<BlobEntry>()];
        index
            .read_exact(&mut table)
            .map_err(|_| IndexError::Truncated)?;
        read_blob_entries(
            &table,
            header.chunk_count.get(),
            version == INDEX_VERSION_PAGED,
        )
    }

    /// Parses and validates a version 1 index: counts within [`MAX_BLOBS`]
    /// and [`MAX_CHUNKS`] and matching the input's length (checked before
    /// anything is allocated), every chunk of exactly one blob, inside its
    /// blob and cache file, and every boot-set entry naming a chunk.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, IndexError> {
        let (header, rest) =
            IndexHeader::read_from_prefix(bytes).map_err(|_| IndexError::Truncated)?;
        let chunk_bits = check_header(&header, INDEX_VERSION)?;
        let (blob_count, chunk_count, prefetch_count) = (
            header.blob_count.get(),
            header.chunk_count.get(),
            header.prefetch_count.get(),
        );
        // Within the limits checked these cannot overflow, even on 32 bits.
        let blob_bytes = blob_count as usize * size_of::<BlobEntry>();
        let chunk_bytes = chunk_count as usize * size_of::<ChunkEntry>();
        if rest.len() != blob_bytes + chunk_bytes + prefetch_count as usize * 4 {
            return Err(IndexError::Truncated);
        }
        let (blob_area, rest) = rest.split_at(blob_bytes);
        let (chunk_area, prefetch_area) = rest.split_at(chunk_bytes);
        let summaries = read_blob_entries(blob_area, chunk_count, false)?;
        let mut blobs = Vec::with_capacity(summaries.len());
        let mut firsts = Vec::with_capacity(summaries.len());
        let mut first = 0usize;
        for b in summaries {
            let end = first + b.chunk_count;
            let chunks = chunk_area
                .get(first * size_of::<ChunkEntry>()..end * size_of::<ChunkEntry>())
                .ok_or(IndexError::Truncated)?
                .chunks_exact(size_of::<ChunkEntry>())
                .map(|c| ChunkEntry::read_from_bytes(c).map_err(|_| IndexError::Truncated))
                .collect::<Result<_, _>>()?;
            let blob = IndexBlob {
                digest: b.digest,
                compressed_size: b.compressed_size,
                cache_size: b.cache_size,
                chunks,
            };
            blob.validate(chunk_bits, b.compressed_size)?;
            firsts.push(first);
            blobs.push(blob);
            first = end;
        }
        let prefetch = read_prefetch(prefetch_area, &firsts, chunk_count as usize)?;
        Ok(ChunkIndex {
            chunk_bits,
            blobs,
            prefetch,
        })
    }
}

/// A blob's chunk table: its chunk entries, as a paged index has them at
/// the blob's end.
pub fn chunk_table_bytes(chunks: &[ChunkEntry]) -> Vec<u8> {
    chunks.as_bytes().to_vec()
}

/// Checks a header's magic, `version`, chunk size and counts (within the
/// limits; no more boot-set entries than chunks); returns the chunk bits.
fn check_header(header: &IndexHeader, version: u32) -> Result<u8, IndexError> {
    if header.magic != INDEX_MAGIC || header.version.get() != version {
        return Err(IndexError::BadMagic);
    }
    let (blob_count, chunk_count) = (header.blob_count.get(), header.chunk_count.get());
    for (what, count, limit) in [
        ("blobs", blob_count, MAX_BLOBS),
        ("chunks", chunk_count, MAX_CHUNKS),
    ] {
        if count > limit {
            return Err(IndexError::TooLarge { what, count, limit });
        }
    }
    if header.prefetch_count.get() > chunk_count {
        return Err(IndexError::Inconsistent(
            "more boot-set entries than chunks".into(),
        ));
    }
    u8::try_from(header.chunk_bits.get())
        .ok()
        .filter(|b| CHUNK_BITS.contains(b))
        .ok_or_else(|| IndexError::Inconsistent("chunk bits".into()))
}

/// The blob entries of `area`: their chunk runs consecutive (so no chunk
/// is read twice: overlapping runs would multiply the memory used) and
/// covering all `chunk_count` chunks. `paged`: each table within
/// [`MAX_TABLE_CHUNKS`] and inside its blob.
fn read_blob_entries(
    area: &[u8],
    chunk_count: u32,
    paged: bool,
) -> Result<Vec<BlobSummary>, IndexError> {
    let mut next = 0u64;
    let mut blobs = Vec::with_capacity(area.len() / size_of::<BlobEntry>());
    for raw in area.chunks_exact(size_of::<BlobEntry>()) {
        let b = BlobEntry::read_from_bytes(raw).map_err(|_| IndexError::Truncated)?;
        let count = b.chunk_count.get();
        if u64::from(b.first_chunk.get()) != next {
            return Err(IndexError::Inconsistent("blob chunk range".into()));
        }
        next += u64::from(count);
        if next > u64::from(chunk_count) {
            return Err(IndexError::Inconsistent("blob chunk range".into()));
        }
        let table_len = u64::from(count) * size_of::<ChunkEntry>() as u64;
        if paged && (count > MAX_TABLE_CHUNKS || b.compressed_size.get() < table_len) {
            return Err(IndexError::Inconsistent("blob chunk table".into()));
        }
        blobs.push(BlobSummary {
            digest: b.digest,
            compressed_size: b.compressed_size.get(),
            cache_size: b.cache_size.get(),
            chunk_count: count as usize,
            table_digest: paged.then_some(b.table_digest),
            data_size: paged.then_some(b.data_size.get()),
        });
    }
    if next != u64::from(chunk_count) {
        return Err(IndexError::Inconsistent(
            "chunks that belong to no blob".into(),
        ));
    }
    Ok(blobs)
}

/// The boot set: `u32` chunk numbers as (blob, chunk), each naming one of
/// `chunk_count` chunks; `firsts` are the blobs' first chunks.
pub(crate) fn read_prefetch(
    area: &[u8],
    firsts: &[usize],
    chunk_count: usize,
) -> Result<Vec<(u32, u32)>, IndexError> {
    let mut prefetch = Vec::with_capacity(area.len() / 4);
    for raw in area.chunks_exact(4) {
        let global = u32::from_le_bytes([raw[0], raw[1], raw[2], raw[3]]) as usize;
        // The blob whose run holds `global`: the last one starting at or
        // before it (runs are consecutive; empty ones share a start).
        let blob = firsts
            .partition_point(|&f| f <= global)
            .checked_sub(1)
            .filter(|_| global < chunk_count)
            .ok_or_else(|| IndexError::Inconsistent("boot-set entry names no chunk".into()))?;
        prefetch.push((blob as u32, (global - firsts[blob]) as u32));
    }
    Ok(prefetch)
}

impl IndexBlob {
    /// Chunks are packed in the cache file as the writer lays them out (each
    /// at the next 4 KiB boundary, the file ending with the last one), and
    /// in order and apart in the blob; sizes within the chunk size, stored
    /// sizes within zstd's bound. So every offset and size is bounded, and
    /// no sum overflows.
    fn validate(&self, chunk_bits: u8, data_end: u64) -> Result<(), IndexError> {
        let bad = |what: &str| Err(IndexError::Inconsistent(what.into()));
        let mut cache_end = 0u64;
        let mut blob_end = 0u64;
        for c in &self.chunks {
            let size = u64::from(c.size.get());
            let stored = u64::from(c.compressed_size.get());
            if c.cache_offset.get() != cache_end.next_multiple_of(4096)
                || size == 0
                || size > 1 << chunk_bits
            {
                return bad("chunk cache range");
            }
            cache_end = c.cache_offset.get() + size;
            if c.flags.get() & !CHUNK_ZSTD != 0 {
                return bad("unknown chunk flags");
            }
            let zstd = c.flags.get() & CHUNK_ZSTD != 0;
            if (!zstd && stored != size)
                || (zstd && (stored == 0 || stored > crate::zstd_bound(size)))
            {
                return bad("chunk stored size");
            }
            let offset = c.compressed_offset.get();
            match offset.checked_add(stored) {
                Some(end) if offset >= blob_end && end <= data_end => blob_end = end,
                _ => return bad("chunk beyond blob size or out of order"),
            }
        }
        if self.cache_size != cache_end.next_multiple_of(4096) {
            return bad("cache size is not the end of the last chunk");
        }
        Ok(())
    }

    /// The chunks whose cache ranges intersect `[offset, offset + len)`.
    pub fn chunks_covering(&self, offset: u64, len: u64) -> &[ChunkEntry] {
        let end = offset.saturating_add(len);
        let first = self
            .chunks
            .partition_point(|c| c.cache_offset.get() + u64::from(c.size.get()) <= offset);
        let last = self.chunks.partition_point(|c| c.cache_offset.get() < end);
        &self.chunks[first..last.max(first)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(cache: u64, comp: u64, csize: u32, size: u32) -> ChunkEntry {
        ChunkEntry {
            cache_offset: cache.into(),
            compressed_offset: comp.into(),
            compressed_size: csize.into(),
            size: size.into(),
            flags: CHUNK_ZSTD.into(),
            reserved: 0.into(),
            digest: [cache as u8; 32],
        }
    }

    fn sample() -> ChunkIndex {
        ChunkIndex {
            prefetch: vec![(1, 0), (0, 1)],
            chunk_bits: 20,
            blobs: vec![
                IndexBlob {
                    digest: [1; 32],
                    compressed_size: 300,
                    cache_size: 3 * 4096,
                    chunks: vec![chunk(0, 0, 100, 5000), chunk(8192, 100, 50, 10)],
                },
                IndexBlob {
                    digest: [2; 32],
                    compressed_size: 50,
                    cache_size: 4096,
                    chunks: vec![chunk(0, 0, 50, 4096)],
                },
            ],
        }
    }

    #[test]
    fn round_trip() {
        let index = sample();
        assert_eq!(ChunkIndex::from_bytes(&index.to_bytes()).unwrap(), index);
    }

    /// A blob whose cache file and compressed bytes pass 4 GiB (issue 10):
    /// 400 raw chunks of 16 MiB; offsets past 2^32 survive the round trip
    /// and the reader's checks, and lookups past 4 GiB find their chunk.
    #[test]
    fn offsets_past_32_bits() {
        const SIZE: u32 = 1 << 24;
        let chunks: Vec<ChunkEntry> = (0..400u64)
            .map(|i| {
                let mut c = chunk(i * u64::from(SIZE), i * u64::from(SIZE), SIZE, SIZE);
                c.flags = 0.into();
                c.digest = [i as u8; 32];
                c
            })
            .collect();
        let total = 400 * u64::from(SIZE);
        let index = ChunkIndex {
            prefetch: vec![(0, 399), (0, 256)],
            chunk_bits: 24,
            blobs: vec![IndexBlob {
                digest: [7; 32],
                compressed_size: total,
                cache_size: total,
                chunks,
            }],
        };
        let back = ChunkIndex::from_bytes(&index.to_bytes()).unwrap();
        assert_eq!(back, index);
        let blob = &back.blobs[0];
        assert_eq!(blob.cache_size, 6400 << 20);
        assert_eq!(blob.chunks[256].cache_offset.get(), 1 << 32);
        assert_eq!(blob.chunks[399].compressed_offset.get(), 399 << 24);
        let at = blob.chunks_covering((5 << 30) + 12345, 1);
        assert_eq!(at.len(), 1);
        assert_eq!(at[0].cache_offset.get(), 5 << 30);
        assert_eq!(blob.chunks_covering((1 << 32) - 1, 2).len(), 2);
    }

    #[test]
    fn rejects_corruption() {
        let bytes = sample().to_bytes();
        assert!(matches!(
            ChunkIndex::from_bytes(&bytes[..40]),
            Err(IndexError::Truncated)
        ));
        let mut bad = bytes.clone();
        bad[0] = b'X';
        assert!(matches!(
            ChunkIndex::from_bytes(&bad),
            Err(IndexError::BadMagic)
        ));
        let mut index = sample();
        index.blobs[0].chunks[1].cache_offset = 4096.into(); // overlaps chunk 0
        assert!(ChunkIndex::from_bytes(&index.to_bytes()).is_err());
        let mut index = sample();
        index.blobs[1].chunks[0].compressed_size = 51.into(); // past blob end
        assert!(ChunkIndex::from_bytes(&index.to_bytes()).is_err());
    }

    fn header(chunk_bits: u32, blobs: u32, chunks: u32, prefetch: u32) -> Vec<u8> {
        IndexHeader {
            magic: INDEX_MAGIC,
            version: INDEX_VERSION.into(),
            chunk_bits: chunk_bits.into(),
            blob_count: blobs.into(),
            chunk_count: chunks.into(),
            prefetch_count: prefetch.into(),
            reserved: [0; 4],
        }
        .as_bytes()
        .to_vec()
    }

    /// The blob table read alone agrees with the whole index; a prefix too
    /// short for it, or counts past the limits, are refused.
    #[test]
    fn the_blob_table_reads_alone() {
        let index = sample();
        let bytes = index.to_bytes();
        let table = ChunkIndex::read_blob_table(&bytes[..]).unwrap();
        let want: Vec<BlobSummary> = index
            .blobs
            .iter()
            .map(|b| BlobSummary {
                digest: b.digest,
                compressed_size: b.compressed_size,
                cache_size: b.cache_size,
                chunk_count: b.chunks.len(),
                table_digest: None,
                data_size: None,
            })
            .collect();
        assert_eq!(table, want);
        let header_and_table = size_of::<IndexHeader>() + want.len() * size_of::<BlobEntry>();
        assert!(ChunkIndex::read_blob_table(&bytes[..header_and_table]).is_ok());
        assert!(matches!(
            ChunkIndex::read_blob_table(&bytes[..header_and_table - 1]),
            Err(IndexError::Truncated)
        ));
        assert!(matches!(
            ChunkIndex::read_blob_table(&header(18, u32::MAX, 0, 0)[..]),
            Err(IndexError::TooLarge { .. })
        ));
        // Blobs that do not cover the chunks exactly.
        let mut short = bytes.clone();
        let count = size_of::<IndexHeader>() + 32 + 8 + 8 + 4;
        short[count] ^= 1;
        assert!(ChunkIndex::read_blob_table(&short[..]).is_err());
    }

    /// Counts are checked against the limits and the input's length before
    /// anything is allocated: a 32-byte header claiming 4 billion chunks is
    /// refused at once.
    #[test]
    fn header_counts_are_bounded() {
        let too_many = |r| matches!(r, Err(IndexError::TooLarge { .. }));
        assert!(too_many(ChunkIndex::from_bytes(&header(
            18,
            0,
            u32::MAX,
            0
        ))));
        assert!(too_many(ChunkIndex::from_bytes(&header(
            18,
            u32::MAX,
            0,
            0
        ))));
        assert!(too_many(ChunkIndex::from_bytes(&header(
            18,
            0,
            MAX_CHUNKS + 1,
            0
        ))));
        for h in [
            header(18, 0, MAX_CHUNKS, 0),
            header(18, MAX_BLOBS, 0, 0),
            header(18, 1, 1, 1),
        ] {
            assert!(matches!(
                ChunkIndex::from_bytes(&h),
                Err(IndexError::Truncated)
            ));
        }
        assert!(matches!(
            ChunkIndex::from_bytes(&header(18, 0, 0, u32::MAX)),
            Err(IndexError::Inconsistent(_))
        ));
        const { assert!(MAX_INDEX_SIZE < 300 << 20) };
    }

    /// Chunk sizes within 1 << chunk_bits (chunk_bits at most 24: no 1 GiB
    /// chunks), stored sizes within zstd's bound, offsets that would
    /// overflow, cache sizes beyond the last chunk.
    #[test]
    fn chunk_sizes_and_offsets_are_bounded() {
        let refused = |index: &ChunkIndex| ChunkIndex::from_bytes(&index.to_bytes()).is_err();
        let mut index = sample();
        index.chunk_bits = 30;
        index.blobs[1].chunks[0].size = (1 << 30).into();
        index.blobs[1].cache_size = 1 << 30;
        assert!(refused(&index));
        let mut index = sample();
        index.blobs[1].chunks[0].size = (1 << 20 | 1).into(); // over the chunk size
        index.blobs[1].cache_size = (1 << 20) + 4096;
        assert!(refused(&index));
        let mut index = sample();
        index.blobs[1].compressed_size = 1 << 20;
        index.blobs[1].chunks[0].compressed_size = (4096 + 4096).into(); // over zstd's bound
        assert!(refused(&index));
        let mut index = sample();
        index.blobs[1].chunks[0].compressed_offset = (u64::MAX - 10).into();
        assert!(refused(&index));
        let mut index = sample();
        index.blobs[0].chunks[1].cache_offset = (u64::MAX - 4095).into();
        index.blobs[0].cache_size = u64::MAX - 4095;
        assert!(refused(&index));
        let mut index = sample();
        index.blobs[1].cache_size = 1 << 40; // a cache file far past its chunks
        assert!(refused(&index));
        let mut index = sample();
        index.blobs[0].chunks[1].compressed_offset = 50.into(); // overlaps chunk 0
        assert!(refused(&index));
    }

    /// Blobs own consecutive runs of chunks: two blobs naming the same run
    /// (which would copy it twice) and chunks of no blob are refused.
    #[test]
    fn blob_runs_are_consecutive() {
        let bytes = sample().to_bytes();
        let first_chunk = |blob: usize| 32 + 96 * blob + 48;
        let mut shared = bytes.clone();
        shared[first_chunk(1)..first_chunk(1) + 4].copy_from_slice(&0u32.to_le_bytes());
        assert!(ChunkIndex::from_bytes(&shared).is_err());
        let mut orphan = bytes.clone();
        orphan[first_chunk(1) + 4..first_chunk(1) + 8].copy_from_slice(&0u32.to_le_bytes());
        assert!(matches!(
            ChunkIndex::from_bytes(&orphan),
            Err(IndexError::Inconsistent(_))
        ));
    }

    #[test]
    fn boot_set_entries_name_chunks() {
        let mut index = sample();
        index.prefetch = vec![(0, 0), (1, 0), (0, 1)];
        assert_eq!(ChunkIndex::from_bytes(&index.to_bytes()).unwrap(), index);
        let mut bytes = index.to_bytes();
        let n = bytes.len();
        bytes[n - 4..].copy_from_slice(&3u32.to_le_bytes()); // 3 chunks: 0..=2
        assert!(matches!(
            ChunkIndex::from_bytes(&bytes),
            Err(IndexError::Inconsistent(_))
        ));
    }

    /// Found by the `chunk_index` fuzz target: a chunk at the top of the
    /// offset range overflowed computing its end (a panic with overflow
    /// checks, a wrapped end that passed the size check without).
    #[test]
    fn chunk_end_past_u64_is_rejected() {
        let mut index = sample();
        index.blobs[1].chunks[0].cache_offset = (u64::MAX - 4095).into();
        assert!(matches!(
            ChunkIndex::from_bytes(&index.to_bytes()),
            Err(IndexError::Inconsistent(_))
        ));
    }

    #[test]
    fn covering() {
        let index = sample();
        let b = &index.blobs[0];
        assert_eq!(b.chunks_covering(0, 1).len(), 1);
        assert_eq!(b.chunks_covering(4096, 4096).len(), 1); // tail of chunk 0
        assert_eq!(b.chunks_covering(5000, 3000).len(), 0); // gap
        assert_eq!(b.chunks_covering(0, 9000).len(), 2);
    }

    /// `sample()` as a paged index has it: each blob ends with its table.
    fn paged_sample() -> ChunkIndex {
        let mut index = sample();
        for b in &mut index.blobs {
            b.compressed_size += b.table_bytes().len() as u64;
        }
        index
    }

    #[test]
    fn paged_round_trip() {
        let index = paged_sample();
        let top = ChunkIndex::parse_top(&index.to_paged_bytes()).unwrap();
        assert_eq!(top.chunk_bits, index.chunk_bits);
        assert_eq!(top.prefetch, index.prefetch);
        assert!(top.inline.is_empty());
        for (summary, blob) in top.blobs.iter().zip(&index.blobs) {
            let table = blob.table_bytes();
            let (at, len) = summary.table_range().unwrap();
            assert_eq!((at + len, len), (blob.compressed_size, table.len() as u64));
            let parsed = IndexBlob::from_table(summary, top.chunk_bits, &table).unwrap();
            assert_eq!(&parsed, blob);
        }
        // The blob table reads alone from either version.
        let alone = ChunkIndex::read_blob_table(&index.to_paged_bytes()[..]).unwrap();
        assert_eq!(alone, top.blobs);
        // Version 1 parses whole, its chunks inline.
        let v1 = ChunkIndex::parse_top(&sample().to_bytes()).unwrap();
        assert_eq!(v1.inline, sample().blobs);
        assert!(v1.blobs.iter().all(|b| b.table_digest.is_none()));
    }

    #[test]
    fn a_chunk_table_must_be_the_one_the_index_names() {
        let index = paged_sample();
        let top = ChunkIndex::parse_top(&index.to_paged_bytes()).unwrap();
        let (summary, table) = (&top.blobs[0], index.blobs[0].table_bytes());
        let mut flipped = table.clone();
        flipped[3] ^= 1;
        for bad in [
            &flipped[..],
            &table[..table.len() - 1],
            &index.blobs[1].table_bytes(),
        ] {
            assert!(IndexBlob::from_table(summary, top.chunk_bits, bad).is_err());
        }
        // A chunk reaching into the table is refused even with the right
        // digest (an index written so).
        let mut over = paged_sample();
        let table_at = over.blobs[0].compressed_size - over.blobs[0].table_bytes().len() as u64;
        over.blobs[0].chunks[1].compressed_offset = (table_at - 10).into();
        let top = ChunkIndex::parse_top(&over.to_paged_bytes()).unwrap();
        assert!(matches!(
            IndexBlob::from_table(&top.blobs[0], top.chunk_bits, &over.blobs[0].table_bytes()),
            Err(IndexError::Inconsistent(_))
        ));
        // A version 1 summary has no table.
        let v1 = sample().blobs[0].summary();
        assert!(IndexBlob::from_table(&v1, 20, &table).is_err());
    }

    #[test]
    fn paged_tables_are_bounded_and_inside_their_blob() {
        let mut big = paged_sample();
        let c = big.blobs[1].chunks[0].clone();
        big.blobs[1].chunks = (0..=MAX_TABLE_CHUNKS as u64)
            .map(|i| {
                let mut c = c.clone();
                c.cache_offset = (i * 4096).into();
                c.compressed_offset = (i * 50).into();
                c
            })
            .collect();
        big.blobs[1].cache_size = (MAX_TABLE_CHUNKS as u64 + 1) * 4096;
        big.blobs[1].compressed_size = 1 << 30;
        assert!(matches!(
            ChunkIndex::parse_top(&big.to_paged_bytes()),
            Err(IndexError::Inconsistent(_))
        ));
        let mut short = paged_sample();
        short.blobs[1].compressed_size = 63; // less than its one-entry table
        assert!(ChunkIndex::parse_top(&short.to_paged_bytes()).is_err());
        let mut bytes = paged_sample().to_paged_bytes();
        bytes.push(0);
        assert!(matches!(
            ChunkIndex::parse_top(&bytes),
            Err(IndexError::Truncated)
        ));
        let mut bytes = paged_sample().to_paged_bytes();
        bytes[8] = 3; // version 3
        assert!(matches!(
            ChunkIndex::parse_top(&bytes),
            Err(IndexError::BadMagic)
        ));
    }
}
