//! Filling cache files from data blobs, verifying every chunk on the way.

use std::fs::{self, File};
use std::io::{self, Read};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use lamina_fetch::fetch::decode_chunk;
use lamina_fetch::locator::{ChunkLocator, Found};
use lamina_fetch::private;
use lamina_fetch::store::{BlobStore, EntryKey};
use lamina_format::index::{BlobSummary, IndexBlob};

/// Why the cache could not be filled.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// Local file I/O.
    #[error("cache {path}: {source}")]
    Io {
        /// File concerned.
        path: PathBuf,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// Reading the blob failed (network, digest mismatch at the end, ...).
    #[error("reading blob {blob}: {source}")]
    Read {
        /// Blob digest.
        blob: String,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// A chunk did not decompress to its recorded size and digest.
    #[error("blob {blob}: chunk at blob offset {offset} failed verification: {reason}")]
    BadChunk {
        /// Blob digest.
        blob: String,
        /// Compressed offset of the chunk.
        offset: u64,
        /// What was wrong.
        reason: String,
    },
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> CacheError + '_ {
    move |source| CacheError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Writes `bytes`, verified to have the content digest `digest`, to `path`
/// atomically (exclusive temp file, synced, rename), 0600 in a private
/// directory, then its fill record (`lamina_fetch::store::record_whole`),
/// so later mounts use it without hashing it again.
pub fn store_metadata(path: &Path, bytes: &[u8], digest: &[u8; 32]) -> Result<(), CacheError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    private::private_dir(dir).map_err(io_err(dir))?;
    let file = private::write_atomic_file(path, bytes, true).map_err(io_err(path))?;
    lamina_fetch::store::record_whole(&file, path, digest).map_err(io_err(path))
}

/// Writes `bytes`, verified, to `path` atomically (exclusive temp file,
/// rename), 0600 in a private directory, neither synced nor recorded: not
/// trusted by a later mount until `lamina_fetch::store::adopt_whole` has
/// hashed, synced and recorded it.
pub fn store_unrecorded(path: &Path, bytes: &[u8]) -> Result<(), CacheError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    private::private_dir(dir).map_err(io_err(dir))?;
    private::write_atomic_file(path, bytes, false).map_err(io_err(path))?;
    Ok(())
}

/// Writes a layer to `path` atomically (exclusive temp file, rename), 0600
/// in a private directory, as [`store_metadata`] (`record` given: synced,
/// then recorded as having that content digest) or [`store_unrecorded`]
/// do; but its bytes come from `fill`, which writes them into the temp
/// file and verifies them before it returns `Ok`. On any error the temp
/// file is removed and nothing appears under `path`.
pub fn store_streamed<E: From<CacheError>>(
    path: &Path,
    record: Option<&[u8; 32]>,
    fill: impl FnOnce(&mut File) -> Result<(), E>,
) -> Result<(), E> {
    let dir = path.parent().unwrap_or(Path::new("."));
    private::private_dir(dir).map_err(io_err(dir))?;
    // `fill`'s own error, kept whole: the writer sees only that it failed.
    let mut failed = None;
    let written = private::write_atomic_with(path, record.is_some(), |file| {
        fill(file).map_err(|e| {
            failed = Some(e);
            io::Error::other("the layer did not fill its file")
        })
    });
    if let Some(e) = failed {
        return Err(e);
    }
    let file = written.map_err(io_err(path))?;
    if let Some(digest) = record {
        lamina_fetch::store::record_whole(&file, path, digest).map_err(io_err(path))?;
    }
    Ok(())
}

/// Fills the cache file `path` for `blob` from `reader` (the blob's bytes,
/// in order, digest-checked by the reader at EOF). Each chunk is decompressed
/// and checked against its digest before it is written; the file appears
/// under `path` only when the whole blob verified, synced. Returns it, for
/// the fill record to be bound to this very file.
pub fn materialize_blob(
    path: &Path,
    blob: &IndexBlob,
    mut reader: impl Read,
) -> Result<File, CacheError> {
    via_temp_file(path, blob, |file, tmp| {
        file.set_len(blob.cache_size).map_err(io_err(tmp))?;
        let all: Vec<usize> = (0..blob.chunks.len()).collect();
        decode_stream(blob, &all, &mut reader, |i, data| {
            file.write_all_at(data, blob.chunks[i].cache_offset.get())
                .map_err(io_err(tmp))
        })
    })
}

/// Reads `reader` (blob `blob`'s bytes, in order, digest-checked by the
/// reader at EOF) to its end, handing `each` of the chunks `wanted`
/// (indices, any order) decompressed and checked against its digest.
pub(crate) fn decode_stream(
    blob: &IndexBlob,
    wanted: &[usize],
    mut reader: impl Read,
    mut each: impl FnMut(usize, &[u8]) -> Result<(), CacheError>,
) -> Result<(), CacheError> {
    let name = hex::encode(blob.digest);
    let read_err = |source| CacheError::Read {
        blob: name.clone(),
        source,
    };
    let mut wanted = wanted.to_vec();
    wanted.sort_by_key(|&i| blob.chunks[i].compressed_offset.get());
    let (mut pos, mut stored) = (0u64, Vec::new());
    let mut decompressor = zstd::bulk::Decompressor::new().map_err(read_err)?;
    for i in wanted {
        let chunk = &blob.chunks[i];
        let offset = chunk.compressed_offset.get();
        let bad = |reason: String| CacheError::BadChunk {
            blob: name.clone(),
            offset,
            reason,
        };
        if offset < pos {
            return Err(bad("chunks overlap in the blob".into()));
        }
        io::copy(&mut (&mut reader).take(offset - pos), &mut io::sink()).map_err(read_err)?;
        stored.resize(chunk.compressed_size.get() as usize, 0);
        reader.read_exact(&mut stored).map_err(read_err)?;
        pos = offset + stored.len() as u64;
        each(
            i,
            &decode_chunk(&mut decompressor, chunk, &stored).map_err(bad)?,
        )?;
    }
    // The rest of the blob, so the reader checks the whole-blob digest.
    io::copy(&mut reader, &mut io::sink()).map_err(read_err)?;
    Ok(())
}

/// Fills chunks `need` (indices, any order) of `store`'s blob from
/// `reader` (the blob's bytes, in order, digest-checked by the reader at
/// EOF): each decompressed and checked against its digest before it is
/// written; the fill record follows (`BlobStore::save`) once the whole
/// blob verified.
pub fn fill_chunks(
    store: &mut BlobStore,
    need: &[usize],
    reader: impl Read,
) -> Result<(), CacheError> {
    let blob = store.blob().clone();
    let path = store.cache_path().to_path_buf();
    decode_stream(&blob, need, reader, |i, data| {
        store.fill(i, data, None).map_err(io_err(&path))
    })?;
    store.save().map_err(io_err(&path))
}

/// Fills blob `table`'s cache file in `blob_dir` from the node where the
/// chunk locator finds its chunks in complete cache files (by
/// `copy_file_range`: blocks shared where the filesystem has reflinks,
/// copied in the kernel elsewhere), and the rest from `open` (the blob,
/// streamed, each chunk verified). `None` when the node holds none of
/// them (the caller fetches the blob whole, as ever); else the bytes read
/// from the source (0 when every chunk was on the node).
pub fn fill_from_node<R: Read, O, E: From<CacheError> + From<O>>(
    locator: &ChunkLocator,
    table: IndexBlob,
    blob_dir: &Path,
    open: impl FnOnce() -> Result<R, O>,
) -> Result<Option<u64>, E> {
    let Some((mut store, found)) = find_on_node(locator, table, blob_dir)? else {
        return Ok(None);
    };
    let path = store.cache_path().to_path_buf();
    for (i, found) in found.iter().enumerate() {
        if let Some(at) = found.as_ref().filter(|_| !store.is_filled(i)) {
            store
                .fill_copied(i, &at.quiet, at.cache_offset, None)
                .map_err(io_err(&path))?;
            at.drop_pages();
        }
    }
    let need: Vec<usize> = (0..found.len()).filter(|&i| !store.is_filled(i)).collect();
    let mut read = 0;
    if !need.is_empty() {
        fill_chunks(&mut store, &need, open()?)?;
        read = store.blob().compressed_size;
        let mut fetched = vec![false; found.len()];
        need.iter().for_each(|&i| fetched[i] = true);
        note_chunks(locator, store.blob(), Some(&fetched));
    }
    store.save().map_err(io_err(&path))?;
    if !store.is_complete() {
        return Err(io_err(&path)(io::Error::other("not every chunk was filled")).into());
    }
    Ok(Some(read))
}

/// A blob's cache file store, and where the node holds each of its chunks.
pub(crate) type OnNode = (BlobStore, Vec<Option<Found>>);

/// Where the node holds blob `table`'s chunks, by the chunk locator (in
/// complete cache files; `ChunkLocator::find`), and the store of its own
/// cache file in `blob_dir`, writing quietly (a live lazy mount may watch
/// the file: its fills raise no event); `None` when the node holds none.
pub(crate) fn find_on_node(
    locator: &ChunkLocator,
    table: IndexBlob,
    blob_dir: &Path,
) -> Result<Option<OnNode>, CacheError> {
    let found = find_chunks(locator, &table);
    if found.iter().all(Option::is_none) {
        return Ok(None);
    }
    Ok(Some((quiet_store(blob_dir, table)?, found)))
}

/// Where the chunk locator finds each of blob `table`'s chunks in other
/// entries' complete cache files: a stored chunk of those bytes, or a
/// packed file of them (a chunk that is one small file, where another
/// image packed it with others; its named ranges list).
pub(crate) fn find_chunks(locator: &ChunkLocator, table: &IndexBlob) -> Vec<Option<Found>> {
    let key = EntryKey::of(table);
    table
        .chunks
        .iter()
        .map(|c| {
            let (digest, size) = (&c.digest, c.size.get());
            locator
                .find(digest, size, &key)
                .or_else(|| locator.find_named(digest, u64::from(size), &key))
        })
        .collect()
}

/// The store of blob `table`'s cache file in `blob_dir`, writing quietly
/// (a live lazy mount may watch the file: its fills raise no event).
pub(crate) fn quiet_store(blob_dir: &Path, table: IndexBlob) -> Result<BlobStore, CacheError> {
    let mut store = BlobStore::open(blob_dir, table).map_err(io_err(blob_dir))?;
    if let Ok(quiet) = lamina_sys::open_quiet(store.cache_file()) {
        store.set_writer(quiet).map_err(io_err(blob_dir))?;
    }
    Ok(store)
}

/// Notes in the domain's chunk locator where `blob`'s chunks (those
/// `only` flags, or all) lie verified, so that later images find them.
pub fn note_chunks(locator: &ChunkLocator, blob: &IndexBlob, only: Option<&[bool]>) {
    let key = EntryKey::of(blob);
    for (i, c) in blob.chunks.iter().enumerate() {
        if only.is_none_or(|only| only[i]) {
            locator.note(&c.digest, &key, c.cache_offset.get(), c.size.get());
        }
    }
}

/// Puts the verified, synced cache file `file` (at `tmp`) in place at
/// `path`; returns the file that is there now. A cache file already at
/// `path` may be a live lazy mount's, whose holder, worker and kernel mount
/// hold that inode: it is never renamed over. Its chunks are written in
/// place instead, through a quiet fd (no mount is asked about the
/// writes), with bytes the same table verified, so whoever reads it gets
/// the same bytes before and after; each under its write lock, so that no
/// boot page lands on it.
fn install(tmp: &Path, file: &File, path: &Path, blob: &IndexBlob) -> Result<File, CacheError> {
    let placed = rustix::fs::renameat_with(
        rustix::fs::CWD,
        tmp,
        rustix::fs::CWD,
        path,
        rustix::fs::RenameFlags::NOREPLACE,
    );
    match placed {
        Ok(()) => return file.try_clone().map_err(io_err(path)),
        Err(rustix::io::Errno::EXIST) => {}
        Err(e) => return Err(io_err(path)(e.into())),
    }
    let there = private::open_existing(path).map_err(io_err(path))?;
    if there.metadata().map_err(io_err(path))?.len() != blob.cache_size {
        return Err(io_err(path)(io::Error::other(
            "a cache file of the wrong size is in the way",
        )));
    }
    // Without fanotify rights (no root) no holder can watch it either.
    let quiet = match lamina_sys::open_quiet(&there) {
        Ok(quiet) => quiet,
        Err(_) => there.try_clone().map_err(io_err(path))?,
    };
    let mut buf = Vec::new();
    for (i, chunk) in blob.chunks.iter().enumerate() {
        buf.resize(chunk.size.get() as usize, 0);
        file.read_exact_at(&mut buf, chunk.cache_offset.get())
            .map_err(io_err(tmp))?;
        lamina_fetch::store::write_chunk(&quiet, blob, i, &buf).map_err(io_err(path))?;
    }
    quiet.sync_data().map_err(io_err(path))?;
    Ok(there)
}

/// A layer's cache file in a tar-index mount: its uncompressed tar from
/// `tar` (a reader that checks the compressed digest and the diff_id at its
/// end), each span checked against its digest as it passes, written to a
/// temporary file and installed as [`materialize_blob`] does. `blob` is the
/// layer with its spans as chunks (`lamina_format::tar_index`).
pub fn materialize_tar(
    path: &Path,
    blob: &IndexBlob,
    mut tar: impl Read,
) -> Result<File, CacheError> {
    let name = hex::encode(blob.digest);
    let read_err = |source| CacheError::Read {
        blob: name.clone(),
        source,
    };
    via_temp_file(path, blob, |file, tmp| {
        let mut buf = Vec::new();
        for span in &blob.chunks {
            buf.resize(span.size.get() as usize, 0);
            tar.read_exact(&mut buf).map_err(read_err)?;
            if lamina_oci::sha256(&buf) != span.digest {
                return Err(CacheError::BadChunk {
                    blob: name.clone(),
                    offset: span.compressed_offset.get(),
                    reason: format!(
                        "the span of tar bytes {}+{} has another digest than the index gives",
                        span.cache_offset.get(),
                        buf.len()
                    ),
                });
            }
            file.write_all_at(&buf, span.cache_offset.get())
                .map_err(io_err(tmp))?;
        }
        // The end: the tar must end with the last span, and the reader
        // checks its digests there.
        if io::copy(&mut tar, &mut io::sink()).map_err(read_err)? != 0 {
            return Err(read_err(io::Error::other(
                "the tar is longer than its index says",
            )));
        }
        file.set_len(blob.cache_size).map_err(io_err(tmp))
    })
}

/// A cache file for `blob` written by `fill` into a fresh private temporary
/// file beside `path` (given as `fill`'s second argument), synced, and
/// installed under `path` ([`install`]); the temporary file never stays.
fn via_temp_file(
    path: &Path,
    blob: &IndexBlob,
    fill: impl FnOnce(&File, &Path) -> Result<(), CacheError>,
) -> Result<File, CacheError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    private::private_dir(dir).map_err(io_err(dir))?;
    let tmp = private::temp_name(path, "partial");
    let file = private::create_new(&tmp).map_err(io_err(&tmp))?;
    let result = fill(&file, &tmp).and_then(|()| {
        file.sync_all().map_err(io_err(&tmp))?;
        install(&tmp, &file, path, blob)
    });
    let _ = fs::remove_file(&tmp);
    result
}

/// [`materialize_blob`] for a blob of a paged index, whose chunk table is
/// at its end: the blob is first copied to a temporary file beside `path`
/// (`reader` checks its digest at EOF), then its table is read, verified
/// against the index and kept (`store::save_table`), then its chunks are
/// decompressed from the copy. Returns the cache file and the table.
pub fn materialize_paged_blob(
    path: &Path,
    summary: &BlobSummary,
    chunk_bits: u8,
    mut reader: impl Read,
) -> Result<(File, IndexBlob), CacheError> {
    let name = hex::encode(summary.digest);
    let dir = path.parent().unwrap_or(Path::new("."));
    private::private_dir(dir).map_err(io_err(dir))?;
    let tmp = private::temp_name(path, "download");
    let result = (|| {
        let mut copy = private::create_new(&tmp).map_err(io_err(&tmp))?;
        io::copy(&mut reader, &mut copy).map_err(|source| CacheError::Read {
            blob: name.clone(),
            source,
        })?;
        let (at, len) = summary.table_range().unwrap_or((0, 0));
        let mut table = vec![0u8; len as usize];
        copy.read_exact_at(&mut table, at).map_err(io_err(&tmp))?;
        let blob = IndexBlob::from_table(summary, chunk_bits, &table).map_err(|e| {
            CacheError::BadChunk {
                blob: name.clone(),
                offset: at,
                reason: e.to_string(),
            }
        })?;
        let file = materialize_blob(path, &blob, File::open(&tmp).map_err(io_err(&tmp))?)?;
        lamina_fetch::store::save_table(dir, summary, &table).map_err(io_err(dir))?;
        Ok((file, blob))
    })();
    let _ = fs::remove_file(&tmp);
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use lamina_format::index::{ChunkEntry, CHUNK_ZSTD};
    use std::io::Write;

    fn blob_with(data: &[u8]) -> (IndexBlob, Vec<u8>) {
        let z = zstd::bulk::compress(data, 1).unwrap();
        let mut stored = vec![0xEE; 7]; // bytes the index does not name
        stored.extend_from_slice(&z);
        let blob = IndexBlob {
            digest: [9; 32],
            compressed_size: stored.len() as u64,
            cache_size: 8192,
            chunks: vec![ChunkEntry {
                cache_offset: 4096.into(),
                compressed_offset: 7.into(),
                compressed_size: (z.len() as u32).into(),
                size: (data.len() as u32).into(),
                flags: CHUNK_ZSTD.into(),
                reserved: 0.into(),
                digest: lamina_oci::sha256(data),
            }],
        };
        (blob, stored)
    }

    /// A streamed layer appears under its name only once `fill` verified
    /// it; recorded when asked; on an error no file is left, temp or not.
    #[test]
    fn streamed_layers_appear_only_verified() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("meta/m.erofs");
        let digest = lamina_oci::sha256(b"layer");
        for record in [Some(&digest), None] {
            store_streamed::<CacheError>(&path, record, |f| {
                f.write_all(b"layer").map_err(io_err(&path))
            })
            .unwrap();
            assert_eq!(fs::read(&path).unwrap(), b"layer");
            let file = File::open(&path).unwrap();
            let recorded = lamina_fetch::store::recorded_whole(&file, &path, &digest).unwrap();
            assert_eq!(recorded, record.is_some());
            fs::remove_file(&path).unwrap();
            let _ = fs::remove_file(path.with_extension("erofs.fill"));
        }
        let err = store_streamed::<CacheError>(&path, Some(&digest), |f| {
            f.write_all(b"half").unwrap();
            Err(io_err(&path)(io::Error::other("digest mismatch")))
        })
        .unwrap_err();
        assert!(err.to_string().contains("digest mismatch"), "{err}");
        let left: Vec<_> = fs::read_dir(dir.path().join("meta")).unwrap().collect();
        assert!(left.is_empty(), "left behind: {left:?}");
    }

    #[test]
    fn fills_and_verifies() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("b.cache");
        let (blob, stored) = blob_with(b"hello chunk");
        materialize_blob(&path, &blob, &stored[..]).unwrap();
        let got = fs::read(&path).unwrap();
        assert_eq!(got.len(), 8192);
        assert_eq!(&got[4096..4096 + 11], b"hello chunk");
        assert!(got[..4096].iter().all(|&b| b == 0));
    }

    #[test]
    fn corrupt_chunk_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("b.cache");
        let (blob, mut stored) = blob_with(b"hello chunk");
        let last = stored.len() - 3;
        stored[last] ^= 0xFF;
        assert!(materialize_blob(&path, &blob, &stored[..]).is_err());
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
        // Truncated input too.
        let (blob, stored) = blob_with(b"hello chunk");
        assert!(materialize_blob(&path, &blob, &stored[..10]).is_err());
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
