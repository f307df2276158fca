//! Boot sets from a trace (`lamina mount --record-trace`).
//!
//! A trace line is `DIGEST OFFSET LEN`: a read of `LEN` bytes at `OFFSET`
//! inside the chunk whose bytes hash to `DIGEST` (64 hex digits), in the
//! order the workload read. A line with only a digest means the whole chunk.
//! Chunk digests name content, not places, so a trace recorded on one
//! conversion of an image applies to any other with the same chunk size.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

use lamina_format::boot::{BootPages, BOOT_PAGE};
use lamina_format::index::chunk_table_bytes;
use lamina_format::index::CHUNK_ZSTD;

use crate::build::BuiltImage;

/// One read of a traced workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceEntry {
    /// Digest of the chunk read.
    pub digest: [u8; 32],
    /// Offset and length of the read inside the chunk; `None`: all of it.
    pub range: Option<(u64, u64)>,
}

/// A trace line that could not be parsed.
#[derive(Debug, thiserror::Error)]
#[error("{path}:{line}: bad trace line {text:?} (want DIGEST [OFFSET LEN])")]
pub struct TraceError {
    /// The trace file.
    pub path: String,
    /// 1-based line number.
    pub line: usize,
    /// The line.
    pub text: String,
}

/// Parses a trace.
pub fn parse_trace(path: &Path, text: &str) -> Result<Vec<TraceEntry>, TraceError> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let bad = || TraceError {
            path: path.display().to_string(),
            line: n + 1,
            text: line.to_string(),
        };
        let mut fields = line.split_ascii_whitespace();
        let mut digest = [0u8; 32];
        hex::decode_to_slice(fields.next().ok_or_else(bad)?, &mut digest).map_err(|_| bad())?;
        let range = match (fields.next(), fields.next(), fields.next()) {
            (None, _, _) => None,
            (Some(off), Some(len), None) => Some((
                off.parse().map_err(|_| bad())?,
                len.parse().map_err(|_| bad())?,
            )),
            _ => return Err(bad()),
        };
        out.push(TraceEntry { digest, range });
    }
    Ok(out)
}

/// The traced chunks, each once, in the order they were first read.
pub fn boot_chunks(trace: &[TraceEntry]) -> Vec<[u8; 32]> {
    let mut seen = HashSet::new();
    trace
        .iter()
        .filter(|e| seen.insert(e.digest))
        .map(|e| e.digest)
        .collect()
}

/// A read a boot set serves: `len` bytes from `offset` of chunk `chunk` of
/// blob `blob` (positions in the built image).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkRead {
    /// Blob (device order).
    pub blob: usize,
    /// Chunk within the blob.
    pub chunk: usize,
    /// Offset of the read inside the chunk.
    pub offset: u64,
    /// Its length.
    pub len: u64,
}

/// The reads of a trace (lines with a range) in this image, in order.
/// Trace lines naming chunks this image does not store are skipped.
pub fn trace_reads(image: &BuiltImage, trace: &[TraceEntry]) -> Vec<ChunkRead> {
    trace
        .iter()
        .filter_map(|entry| {
            let (blob, chunk, within) = image.locate(&entry.digest)?;
            let (offset, len) = entry.range?;
            // A packed file's digest names content inside its pack.
            Some(ChunkRead {
                blob,
                chunk,
                offset: within.saturating_add(offset),
                len,
            })
        })
        .collect()
}

/// The chunks of `reads`, each once, in the order they were first read.
pub fn read_chunks(reads: &[ChunkRead]) -> Vec<(usize, usize)> {
    let mut seen = HashSet::new();
    reads
        .iter()
        .map(|r| (r.blob, r.chunk))
        .filter(|c| seen.insert(*c))
        .collect()
}

/// Packs the pages `reads` read into boot pages, in the order they were
/// first read. Chunk bytes are read back from the built blobs and checked
/// against their digests.
pub fn build_boot_pages(image: &BuiltImage, reads: &[ChunkRead]) -> io::Result<BootPages> {
    // (blob, page, chunk) in first-read order.
    let mut pages: Vec<(usize, u64, usize)> = Vec::new();
    let mut seen = HashSet::new();
    for read in reads {
        let (b, i) = (read.blob, read.chunk);
        let chunk = &image.blobs[b].chunks[i];
        let base = chunk.cache_offset.get();
        let size = u64::from(chunk.size.get());
        let start = base + read.offset.min(size);
        let end = base + read.offset.saturating_add(read.len).min(size);
        for page in start / BOOT_PAGE..end.div_ceil(BOOT_PAGE) {
            if seen.insert((b, page)) {
                pages.push((b, page, i));
            }
        }
    }

    let mut boot = BootPages::default();
    let mut reader = ChunkReader::default();
    for (b, page, i) in pages {
        let data = reader.chunk(image, b, i)?;
        let chunk = &image.blobs[b].chunks[i];
        let from = (page * BOOT_PAGE - chunk.cache_offset.get()) as usize;
        let to = (from + BOOT_PAGE as usize).min(data.len());
        let mut bytes = data[from..to].to_vec();
        bytes.resize(BOOT_PAGE as usize, 0);
        boot.push_page(b as u32, page, &bytes);
    }
    // The chunk tables of the blobs the pages are in (paged index), so the
    // start needs no table request for them.
    let mut carried = HashSet::new();
    for e in boot.extents.iter().filter(|_| image.paged) {
        let b = e.blob.get();
        if carried.insert(b) {
            boot.tables
                .push((b, chunk_table_bytes(&image.blobs[b as usize].chunks)));
        }
    }
    Ok(boot)
}

/// Chunks of a built image read back from its blobs, each checked against
/// its digest once and kept.
#[derive(Debug, Default)]
pub(crate) struct ChunkReader {
    files: HashMap<usize, File>,
    chunks: HashMap<(usize, usize), Vec<u8>>,
}

impl ChunkReader {
    /// Chunk `chunk` of blob `blob`, uncompressed.
    pub(crate) fn chunk(
        &mut self,
        image: &BuiltImage,
        blob: usize,
        chunk: usize,
    ) -> io::Result<&[u8]> {
        if !self.chunks.contains_key(&(blob, chunk)) {
            let file = match self.files.entry(blob) {
                std::collections::hash_map::Entry::Occupied(f) => f.into_mut(),
                std::collections::hash_map::Entry::Vacant(f) => {
                    f.insert(File::open(&image.blobs[blob].path)?)
                }
            };
            let data = read_chunk(file, &image.blobs[blob].chunks[chunk])?;
            self.chunks.insert((blob, chunk), data);
        }
        Ok(&self.chunks[&(blob, chunk)])
    }
}

fn read_chunk(file: &File, chunk: &lamina_format::index::ChunkEntry) -> io::Result<Vec<u8>> {
    let mut stored = vec![0u8; chunk.compressed_size.get() as usize];
    file.read_exact_at(&mut stored, chunk.compressed_offset.get())?;
    let size = chunk.size.get() as usize;
    let data = if chunk.flags.get() & CHUNK_ZSTD != 0 {
        zstd::bulk::decompress(&stored, size)?
    } else {
        stored
    };
    if data.len() != size || lamina_oci::sha256(&data) != chunk.digest {
        return Err(io::Error::other(
            "built blob does not match its chunk digest",
        ));
    }
    Ok(data)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::build::tests::layer;
    use crate::build::{BuildOptions, ImageBuilder};

    /// A chunk's bytes, read back from its blob and checked.
    pub(crate) fn chunk_bytes(file: &File, chunk: &lamina_format::index::ChunkEntry) -> Vec<u8> {
        read_chunk(file, chunk).unwrap()
    }

    #[test]
    fn boot_pages_hold_exactly_the_traced_pages_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let opts = BuildOptions {
            chunk_bits: 14, // 16 KiB chunks: 4 pages each
            zstd_level: 1,
            pack_limit: 0,
            paged: true,
        };
        let mut b = ImageBuilder::new(&opts, dir.path()).unwrap();
        let data: Vec<u8> = (0..40_000u32).map(|i| (i / 4096 + 1) as u8).collect();
        b.add_layer(&layer(&[("f", data.clone())])[..]).unwrap();
        let img = b.finish(&[]).unwrap();
        let chunks = &img.blobs[0].chunks;
        assert_eq!(chunks.len(), 3);
        let trace = [
            // Last chunk (7,232 bytes, pages 8-9), its second page only.
            TraceEntry {
                digest: chunks[2].digest,
                range: Some((5000, 10)),
            },
            // First chunk, pages 1 and 2 (a read across the boundary).
            TraceEntry {
                digest: chunks[0].digest,
                range: Some((4095, 2)),
            },
            // Again: nothing new.
            TraceEntry {
                digest: chunks[0].digest,
                range: Some((4096, 1)),
            },
            // Whole-chunk lines and unknown chunks add no pages.
            TraceEntry {
                digest: chunks[1].digest,
                range: None,
            },
            TraceEntry {
                digest: [9; 32],
                range: Some((0, 1)),
            },
        ];
        let boot = build_boot_pages(&img, &trace_reads(&img, &trace)).unwrap();
        let runs: Vec<(u64, u32)> = boot
            .extents
            .iter()
            .map(|e| (e.cache_offset.get() / BOOT_PAGE, e.pages.get()))
            .collect();
        assert_eq!(runs, vec![(9, 1), (0, 2)]);
        // Page 9 holds bytes 36,864..40,000 of the file, then zeros.
        let page9 = &boot.data[..4096];
        assert_eq!(&page9[..40_000 - 36_864], &data[36_864..]);
        assert!(page9[40_000 - 36_864..].iter().all(|&b| b == 0));
        assert_eq!(&boot.data[4096..], &data[..8192]);
        let sizes = [img.blobs[0].cache_size];
        let lens = [img.blobs[0].chunks.len() as u64 * 64];
        assert_eq!(boot.tables.len(), 1, "the table of the one blob read");
        assert_eq!(
            BootPages::from_bytes(&boot.to_bytes(), &sizes, &lens).unwrap(),
            boot
        );
    }

    #[test]
    fn trace_lines_parse_and_bad_ones_are_named() {
        let d = "ab".repeat(32);
        let text = format!("{d}\n\n{d} 4096 100\n");
        let t = parse_trace(Path::new("t"), &text).unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(t[0].range, None);
        assert_eq!(t[1].range, Some((4096, 100)));
        assert_eq!(boot_chunks(&t).len(), 1);
        for bad in [
            "xyz",
            &format!("{d} 1"),
            &format!("{d} 1 2 3"),
            &format!("{d} -1 2"),
        ] {
            let e = parse_trace(Path::new("t"), bad).unwrap_err();
            assert_eq!(e.line, 1, "{bad}");
        }
    }
}
