//! Chunks copied from elsewhere on the node instead of fetched, through
//! the cache's chunk locator (`lamina_fetch::locator`): before a fetch, each
//! chunk whose digest the locator knows (or, a chunk that is one small
//! file, whose bytes another image's named ranges list holds) is read from
//! the other entry's cache file, checked against this blob's own table,
//! and filled as a fetched chunk would be; after a fill, the chunk is
//! noted there for later images. From a complete cache file (whose bytes
//! never change) the fill is a `copy_file_range`, which shares the extents
//! on a filesystem with reflinks.

use std::fs::File;
use std::io;
use std::sync::atomic::Ordering;

use lamina_fetch::store::EntryKey;
use lamina_format::index::ChunkEntry;

use super::Shared;

impl Shared {
    /// Fills from other entries the chunks of `chunks` the locator finds;
    /// returns those still to fetch.
    pub(super) fn copy_located(
        &self,
        blob: u32,
        (entries, key): (&[ChunkEntry], &EntryKey),
        chunks: &[usize],
        via: Option<&File>,
    ) -> io::Result<Vec<usize>> {
        let Some(locator) = &self.locator else {
            return Ok(chunks.to_vec());
        };
        let mut rest = Vec::with_capacity(chunks.len());
        for &i in chunks {
            let entry = &entries[i];
            let size = u64::from(entry.size.get());
            // From a complete file: its extents shared where the filesystem
            // can (a chunk that is one small file also where another image
            // packed it); from one still filling, its bytes copied.
            let complete = locator
                .find(&entry.digest, entry.size.get(), key)
                .or_else(|| locator.find_named(&entry.digest, size, key));
            if let Some(found) = complete {
                self.lock_store(blob)?
                    .fill_copied(i, &found.quiet, found.cache_offset, via)?;
                found.drop_pages();
            } else if let Some(data) = locator.copy(&entry.digest, entry.size.get(), key) {
                self.lock_store(blob)?.fill(i, &data, via)?;
            } else {
                rest.push(i);
                continue;
            }
            self.note_located(entry, key);
            self.located_chunks.fetch_add(1, Ordering::Relaxed);
            self.located_bytes.fetch_add(size, Ordering::Relaxed);
        }
        if rest.len() < chunks.len() {
            tracing::debug!(
                blob,
                copied = chunks.len() - rest.len(),
                "chunks copied from other images on this node"
            );
        }
        Ok(rest)
    }

    /// Notes that `entry`'s verified bytes now lie in `key`'s cache file.
    pub(super) fn note_located(&self, entry: &ChunkEntry, key: &EntryKey) {
        if let Some(locator) = &self.locator {
            locator.note(
                &entry.digest,
                key,
                entry.cache_offset.get(),
                entry.size.get(),
            );
        }
    }
}
