//! A blob's cache file and its fill record.
//!
//! The cache file (`<hex>.cache`) is sparse: chunks appear at their cache
//! offsets as they are fetched. The fill record (`<hex>.state`) has one bit
//! per chunk, set only *after* the chunk's bytes were written. A crash between
//! the two leaves the bit clear, so the chunk is fetched again. The record is
//! still only a hint: when a store is opened every chunk it claims is hashed
//! again and any that does not match its digest is forgotten, so a torn write
//! (power loss, a second writer) is never served as filled.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use lamina_format::index::IndexBlob;
use lamina_oci::sha256;

const STATE_MAGIC: &[u8; 8] = b"LMSTATE1";
const STATE_HEADER: usize = 16;
const FLAG_COMPLETE: u32 = 1;
const PAGE: u64 = 4096;

/// One blob's cache file plus its fill record.
#[derive(Debug)]
pub struct BlobStore {
    /// The blob as the index describes it.
    pub blob: IndexBlob,
    /// Path of the cache file (what EROFS gets as `device=`).
    pub cache_path: PathBuf,
    state_path: PathBuf,
    cache: File,
    state: File,
    filled: Vec<bool>,
    filled_count: usize,
    filled_bytes: u64,
    /// Pages filled from verified boot pages, one bit per 4 KiB page. Kept
    /// in memory only: a new worker applies the boot pages again.
    boot_pages: Vec<u64>,
    boot_bytes: u64,
}

/// Paths of a blob's cache and state files under `dir`.
pub fn store_paths(dir: &Path, blob_hex: &str) -> (PathBuf, PathBuf) {
    (
        dir.join(format!("{blob_hex}.cache")),
        dir.join(format!("{blob_hex}.state")),
    )
}

impl BlobStore {
    /// Opens (creating if needed) the store for `blob` in `dir` and re-verifies
    /// every chunk the fill record claims.
    ///
    /// A cache file with no fill record was written whole and renamed into
    /// place by an eager mount: it is complete and is recorded as such.
    pub fn open(dir: &Path, blob: IndexBlob) -> io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let hex = hex::encode(blob.digest);
        let (cache_path, state_path) = store_paths(dir, &hex);
        let eager_complete = !state_path.exists()
            && std::fs::metadata(&cache_path).is_ok_and(|m| m.len() == blob.cache_size);
        let cache = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&cache_path)?;
        if cache.metadata()?.len() != blob.cache_size {
            cache.set_len(blob.cache_size)?;
        }
        let state = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&state_path)?;
        let n = blob.chunks.len();
        let mut store = BlobStore {
            blob,
            cache_path,
            state_path,
            cache,
            state,
            filled: vec![false; n],
            filled_count: 0,
            filled_bytes: 0,
            boot_pages: Vec::new(),
            boot_bytes: 0,
        };
        if eager_complete {
            store.mark_all_filled();
            store.write_state_full()?;
        } else {
            store.load_and_verify()?;
        }
        Ok(store)
    }

    fn load_and_verify(&mut self) -> io::Result<()> {
        let n = self.filled.len();
        let mut raw = vec![0u8; STATE_HEADER + n.div_ceil(8)];
        let len = self.state.metadata()?.len() as usize;
        let valid = len == raw.len() && {
            self.state.read_exact_at(&mut raw, 0)?;
            &raw[..8] == STATE_MAGIC
                && u32::from_le_bytes([raw[8], raw[9], raw[10], raw[11]]) as usize == n
        };
        if !valid {
            // No record, or one for another layout: start empty.
            return self.write_state_full();
        }
        let flags = u32::from_le_bytes([raw[12], raw[13], raw[14], raw[15]]);
        let all_bits = (0..n).all(|i| raw[STATE_HEADER + i / 8] & (1 << (i % 8)) != 0);
        if flags & FLAG_COMPLETE != 0 && all_bits {
            // The complete flag is written only after the cache file was
            // synced, so it needs no second check.
            self.mark_all_filled();
            return Ok(());
        }
        let mut buf = Vec::new();
        let mut changed = false;
        for i in 0..n {
            if raw[STATE_HEADER + i / 8] & (1 << (i % 8)) == 0 {
                continue;
            }
            let chunk = &self.blob.chunks[i];
            buf.resize(chunk.size.get() as usize, 0);
            self.cache
                .read_exact_at(&mut buf, chunk.cache_offset.get())?;
            if sha256(&buf) == chunk.digest {
                self.mark_filled(i);
            } else {
                changed = true;
            }
        }
        if changed {
            self.write_state_full()?;
        }
        Ok(())
    }

    fn mark_all_filled(&mut self) {
        self.filled = vec![true; self.filled.len()];
        self.filled_count = self.filled.len();
        self.filled_bytes = self
            .blob
            .chunks
            .iter()
            .map(|c| u64::from(c.size.get()))
            .sum();
    }

    fn write_state_full(&mut self) -> io::Result<()> {
        let n = self.filled.len();
        let mut raw = vec![0u8; STATE_HEADER + n.div_ceil(8)];
        raw[..8].copy_from_slice(STATE_MAGIC);
        raw[8..12].copy_from_slice(&(n as u32).to_le_bytes());
        let flags = if self.is_complete() { FLAG_COMPLETE } else { 0 };
        raw[12..16].copy_from_slice(&flags.to_le_bytes());
        for (i, f) in self.filled.iter().enumerate() {
            if *f {
                raw[STATE_HEADER + i / 8] |= 1 << (i % 8);
            }
        }
        self.state.set_len(raw.len() as u64)?;
        self.state.write_all_at(&raw, 0)
    }

    /// Whether every chunk is present.
    pub fn is_complete(&self) -> bool {
        self.filled_count == self.filled.len()
    }

    /// Whether chunk `i` is present and verified.
    pub fn is_filled(&self, i: usize) -> bool {
        self.filled[i]
    }

    /// Chunks present, and their bytes.
    pub fn filled(&self) -> (usize, u64) {
        (self.filled_count, self.filled_bytes)
    }

    /// Indices of the chunks whose cache ranges meet `[offset, offset + len)`.
    pub fn chunks_covering(&self, offset: u64, len: u64) -> std::ops::Range<usize> {
        let end = offset.saturating_add(len);
        let chunks = &self.blob.chunks;
        let first =
            chunks.partition_point(|c| c.cache_offset.get() + u64::from(c.size.get()) <= offset);
        let last = chunks.partition_point(|c| c.cache_offset.get() < end);
        first..last.max(first)
    }

    /// Writes verified chunk bytes through `via` (for a miss: the fanotify
    /// event's own fd, which raises no new event) and then records them.
    pub fn fill(&mut self, i: usize, data: &[u8], via: Option<&File>) -> io::Result<()> {
        if self.filled[i] {
            return Ok(());
        }
        let chunk = &self.blob.chunks[i];
        if data.len() != chunk.size.get() as usize {
            return Err(io::Error::other("chunk size does not match the index"));
        }
        via.unwrap_or(&self.cache)
            .write_all_at(data, chunk.cache_offset.get())?;
        self.mark_filled(i);
        // Data first, then the bit: a crash in between only costs a refetch.
        // OR with the byte on disk: another mount may share this blob.
        let byte_at = (STATE_HEADER + i / 8) as u64;
        let mut byte = [0u8];
        self.state.read_exact_at(&mut byte, byte_at)?;
        byte[0] |= 1 << (i % 8);
        self.state.write_all_at(&byte, byte_at)?;
        if self.is_complete() {
            self.cache.sync_data()?;
            self.state.write_all_at(&FLAG_COMPLETE.to_le_bytes(), 12)?;
            self.state.sync_data()?;
        }
        Ok(())
    }

    /// Takes chunk `i` as filled if another process sharing this cache
    /// recorded it and its bytes, read through `via`, match the digest.
    /// Returns whether the chunk is now filled.
    pub fn adopt(&mut self, i: usize, via: &File) -> io::Result<bool> {
        if self.filled[i] {
            return Ok(true);
        }
        let mut byte = [0u8];
        self.state
            .read_exact_at(&mut byte, (STATE_HEADER + i / 8) as u64)?;
        if byte[0] & (1 << (i % 8)) == 0 {
            return Ok(false);
        }
        let chunk = &self.blob.chunks[i];
        let mut buf = vec![0u8; chunk.size.get() as usize];
        via.read_exact_at(&mut buf, chunk.cache_offset.get())?;
        if sha256(&buf) != chunk.digest {
            return Ok(false);
        }
        self.mark_filled(i);
        Ok(true)
    }

    /// Counts chunk `i` (verified, its bytes in the cache file) as filled.
    fn mark_filled(&mut self, i: usize) {
        if !self.filled[i] {
            self.filled[i] = true;
            self.filled_count += 1;
            self.filled_bytes += u64::from(self.blob.chunks[i].size.get());
        }
    }

    /// Writes pages from verified boot pages at `offset` (page-aligned),
    /// skipping those whose chunks are already filled, and records them in
    /// memory. Returns the bytes written.
    pub fn fill_pages(&mut self, offset: u64, data: &[u8]) -> io::Result<u64> {
        if !offset.is_multiple_of(PAGE) || !(data.len() as u64).is_multiple_of(PAGE) {
            return Err(io::Error::other("boot pages not page-aligned"));
        }
        if self.boot_pages.is_empty() {
            self.boot_pages = vec![0; (self.blob.cache_size / PAGE).div_ceil(64) as usize];
        }
        let mut written = 0;
        for (k, page) in data.chunks_exact(PAGE as usize).enumerate() {
            let at = offset + k as u64 * PAGE;
            if self.page_ready(at / PAGE) {
                continue;
            }
            self.cache.write_all_at(page, at)?;
            let p = (at / PAGE) as usize;
            self.boot_pages[p / 64] |= 1 << (p % 64);
            self.boot_bytes += PAGE;
            written += PAGE;
        }
        Ok(written)
    }

    /// Bytes filled from boot pages by this process.
    pub fn boot_bytes(&self) -> u64 {
        self.boot_bytes
    }

    fn page_ready(&self, page: u64) -> bool {
        let p = page as usize;
        if self
            .boot_pages
            .get(p / 64)
            .is_some_and(|w| w & (1 << (p % 64)) != 0)
        {
            return true;
        }
        let chunks = self.chunks_covering(page * PAGE, PAGE);
        !chunks.is_empty() && chunks.into_iter().all(|i| self.filled[i])
    }

    /// Whether every byte of `[offset, offset + len)` may be read: each page
    /// is in a filled chunk or came from boot pages.
    pub fn range_ready(&self, offset: u64, len: u64) -> bool {
        let end = offset.saturating_add(len.max(1)).min(self.blob.cache_size);
        (offset / PAGE..end.div_ceil(PAGE)).all(|p| self.page_ready(p))
    }

    /// Path of the fill record.
    pub fn state_path(&self) -> &Path {
        &self.state_path
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lamina_format::index::{ChunkEntry, CHUNK_ZSTD};

    fn blob(chunks: &[&[u8]]) -> IndexBlob {
        let mut off = 0;
        let entries = chunks
            .iter()
            .map(|c| {
                let e = ChunkEntry {
                    cache_offset: off.into(),
                    compressed_offset: 0.into(),
                    compressed_size: 1.into(),
                    size: (c.len() as u32).into(),
                    flags: CHUNK_ZSTD.into(),
                    reserved: 0.into(),
                    digest: sha256(c),
                };
                off += (c.len() as u64).next_multiple_of(4096);
                e
            })
            .collect();
        IndexBlob {
            digest: [5; 32],
            compressed_size: 10,
            cache_size: off,
            chunks: entries,
        }
    }

    #[test]
    fn fill_record_survives_reopen_and_rejects_torn_data() {
        let dir = tempfile::tempdir().unwrap();
        let data: [&[u8]; 3] = [b"first", b"second chunk", b"third"];
        let mut s = BlobStore::open(dir.path(), blob(&data)).unwrap();
        assert_eq!(s.filled().0, 0);
        s.fill(0, data[0], None).unwrap();
        s.fill(2, data[2], None).unwrap();
        assert!(!s.is_complete());
        let cache_path = s.cache_path.clone();
        drop(s);

        // A torn write: chunk 2's bytes damaged behind the record's back.
        let f = OpenOptions::new().write(true).open(&cache_path).unwrap();
        f.write_all_at(b"X", 8192).unwrap();
        let mut s = BlobStore::open(dir.path(), blob(&data)).unwrap();
        assert!(s.is_filled(0));
        assert!(!s.is_filled(2), "damaged chunk must be forgotten");
        s.fill(1, data[1], None).unwrap();
        s.fill(2, data[2], None).unwrap();
        assert!(s.is_complete());
        assert_eq!(s.chunks_covering(4096, 1), 1..2);
        assert_eq!(s.chunks_covering(0, 3 * 4096), 0..3);
        assert!(s.fill(1, b"wrong size", None).is_ok()); // already filled: no-op
    }

    #[test]
    fn boot_pages_make_ranges_ready_without_filling_chunks() {
        let dir = tempfile::tempdir().unwrap();
        let big = vec![3u8; 3 * 4096];
        let data: [&[u8]; 2] = [&big, b"tail"];
        let mut s = BlobStore::open(dir.path(), blob(&data)).unwrap();
        assert!(!s.range_ready(0, 1));
        assert_eq!(s.fill_pages(4096, &big[..4096]).unwrap(), 4096);
        assert!(s.range_ready(4096, 4096));
        assert!(!s.range_ready(4096, 4097), "next page is not there");
        assert!(!s.range_ready(0, 4096));
        assert!(!s.is_filled(0), "boot pages do not fill chunks");
        s.fill(1, data[1], None).unwrap();
        assert!(s.range_ready(3 * 4096, 100));
        // Pages of filled chunks are not written again.
        assert_eq!(s.fill_pages(3 * 4096, &[9u8; 4096]).unwrap(), 0);
        assert!(s.fill_pages(100, &[0u8; 4096]).is_err());
        let mut back = vec![0u8; 4096];
        File::open(&s.cache_path)
            .unwrap()
            .read_exact_at(&mut back, 4096)
            .unwrap();
        assert_eq!(back, big[..4096]);
        // A new store (a restarted worker) knows nothing of boot pages.
        let s = BlobStore::open(dir.path(), blob(&data)).unwrap();
        assert!(!s.range_ready(4096, 1));
    }

    #[test]
    fn eager_cache_file_counts_as_complete() {
        let dir = tempfile::tempdir().unwrap();
        let data: [&[u8]; 1] = [b"x"];
        let b = blob(&data);
        let (cache, _) = store_paths(dir.path(), &hex::encode(b.digest));
        let f = File::create(&cache).unwrap();
        f.write_all_at(b"x", 0).unwrap();
        f.set_len(4096).unwrap();
        let s = BlobStore::open(dir.path(), b).unwrap();
        assert!(s.is_complete());
    }
}
