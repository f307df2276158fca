//! A blob's cache file and its fill record.
//!
//! A cache entry is a blob as one chunk table describes it ([`EntryKey`]):
//! images that describe the blob the same way share the entry, any other
//! description gets an entry of its own. Nothing but that table's checks
//! decides what goes into an entry, so an image that names another image's
//! blob with a chunk table (and bytes) of its own can never change what the
//! other image reads.
//!
//! The cache file (`<entry>.cache`, 0600) is sparse: chunks appear at their
//! cache offsets as they are fetched and verified. Which chunks a process may
//! serve is decided by two things only: chunks this process verified itself
//! (fetched and checked, or re-hashed), kept in memory, and the fill record
//! (`<entry>.fill`, format in [`lamina_format::fill`]) that some process wrote
//! after it synced the cache file, bound to the cache file's identity. A
//! cache file that was deleted and recreated, replaced, or has the wrong size
//! inherits nothing; its length, a flag, or a process being alive never count.
//!
//! Opening a store reads the record and nothing else: no work in proportion
//! to the bytes cached. Verified chunks are saved to the record in batches
//! (at most every [`SAVE_INTERVAL`], and at once when the blob is complete),
//! each batch after an `fdatasync` of the cache file. A crash before a save
//! costs a re-hash (the bytes are still there) or a refetch, never a wrong
//! byte.

use std::fs::File;
use std::io;
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use lamina_format::fill::{FileIdentity, FillRecord};
use lamina_format::index::{BlobSummary, IndexBlob};
use lamina_oci::sha256;

use crate::private;

const PAGE: u64 = 4096;
/// Verified chunks are written to the fill record at most this long after
/// they were filled.
pub const SAVE_INTERVAL: Duration = Duration::from_secs(1);

/// A cache entry: a blob as one chunk table lays it out in a cache file.
/// Its files in the blob dir are `<blob hex>.<id hex, first 32 digits>`
/// with `.cache`, `.fill` and `.table`; the fill record binds the whole id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EntryKey {
    /// sha256 of the compressed blob.
    pub blob: [u8; 32],
    /// [`lamina_format::fill::entry_id`] of the blob, its cache size and
    /// its chunk table.
    pub id: [u8; 32],
}

impl EntryKey {
    /// The entry of `blob` as its chunks describe it.
    pub fn of(blob: &IndexBlob) -> EntryKey {
        EntryKey {
            blob: blob.digest,
            id: blob.entry_id(),
        }
    }

    /// The entry of a blob of a paged index, known before its chunk table
    /// is; `None` for a version 1 blob (use [`EntryKey::of`]).
    pub fn of_paged(summary: &BlobSummary) -> Option<EntryKey> {
        Some(EntryKey {
            blob: summary.digest,
            id: summary.entry_id()?,
        })
    }

    /// The entry's file name without its extension.
    pub fn stem(&self) -> String {
        format!("{}.{}", hex::encode(self.blob), hex::encode(&self.id[..16]))
    }
}

/// One blob's cache file plus its fill record.
#[derive(Debug)]
pub struct BlobStore {
    /// The blob as the index describes it.
    pub blob: IndexBlob,
    /// The entry it is cached in.
    pub key: EntryKey,
    /// Path of the cache file (what EROFS gets as `device=`).
    pub cache_path: PathBuf,
    record_path: PathBuf,
    cache: File,
    /// Where background fills are written and adopted chunks read: a quiet
    /// fd (see `lamina_sys::open_quiet`) once set, so that other mounts
    /// sharing the file are not asked about them.
    writer: Option<File>,
    /// `None` where the filesystem reports no birth time: nothing can be
    /// bound to the file, so no record is written or trusted.
    identity: Option<FileIdentity>,
    /// The record file last read: inode and mtime.
    record_seen: Option<(u64, i64, i64)>,
    filled: Vec<bool>,
    filled_count: usize,
    filled_bytes: u64,
    /// Chunks verified since the record was last saved.
    unsaved: usize,
    last_save: Instant,
    /// Pages filled from verified boot pages, one bit per 4 KiB page. Kept
    /// in memory only: a new worker applies the boot pages again.
    boot_pages: Vec<u64>,
    boot_bytes: u64,
}

/// A cache file made ready for a mount before its chunks are known
/// ([`BlobStore::prepare`]).
#[derive(Debug)]
pub struct Prepared {
    /// Where it is.
    pub cache_path: PathBuf,
    /// Whether a record says it is complete.
    pub complete: bool,
    /// The file's identity: the daemons serve this file and no other.
    pub identity: Option<FileIdentity>,
}

/// What [`BlobStore::place_page`] did with a boot page.
enum PagePlaced {
    /// The page was a hole: the boot page is there now.
    Written,
    /// The page held these very bytes.
    AlreadyThere,
    /// The page holds other bytes, or its range is being written.
    Refused,
}

/// A save between its two halves: see [`BlobStore::begin_save`].
#[derive(Debug)]
pub struct PendingSave {
    file: File,
    filled: Vec<bool>,
    chunks: usize,
    identity: FileIdentity,
}

impl PendingSave {
    /// Makes the bytes of the chunks this save will record durable.
    pub fn sync(&self) -> io::Result<()> {
        self.file.sync_data()
    }
}

/// Where the locks of writes into a cache file start: a lock space of
/// their own, apart from the chunk claims (the ranges themselves, held for
/// a whole fetch). A write holds the lock of its range only while it
/// writes; a boot page is checked to be a hole and written under its lock,
/// so no chunk write lands between the check and the page.
const WRITE_LOCKS: u64 = 1 << 62;

/// Writes verified chunk `i` of `blob` (its bytes `data`) into the cache
/// file `fd`, and zeros over the gap after it ([`tail_gap`]), under the
/// write lock of that range: what every writer of verified chunks does (a
/// worker's fills, an eager mount's install into a live file).
pub fn write_chunk(fd: &File, blob: &IndexBlob, i: usize, data: &[u8]) -> io::Result<()> {
    let offset = blob.chunks[i].cache_offset.get();
    let gap = tail_gap(blob, i);
    let len = gap.end - offset;
    lamina_sys::lock_range(fd, WRITE_LOCKS + offset, len)?;
    let written = fd
        .write_all_at(data, offset)
        .and_then(|()| write_zeros(fd, gap));
    lamina_sys::unlock_range(fd, WRITE_LOCKS + offset, len)?;
    written
}

/// The bytes after chunk `i` up to its page's end that no chunk holds.
/// They are zeros in every cache file: the kernel reads a file's last
/// block whole, so an mmap of its last page shows them past the file's
/// end, and a boot page of another image may have put its bytes there
/// (boot pages are whole pages). Empty where the next chunk starts in
/// the same page (tar spans, which follow one another).
pub fn tail_gap(blob: &IndexBlob, i: usize) -> std::ops::Range<u64> {
    let chunk = &blob.chunks[i];
    let end = chunk.cache_offset.get() + u64::from(chunk.size.get());
    let next = blob
        .chunks
        .get(i + 1)
        .map_or(blob.cache_size, |c| c.cache_offset.get());
    end..end.max(next.min(end.next_multiple_of(PAGE)).min(blob.cache_size))
}

/// `len` bytes of `src` at `from` to `dst` at `to`, by `copy_file_range`
/// (whole blocks may be remapped, the rest copied: it returns short).
fn copy_range(src: &File, mut from: u64, dst: &File, mut to: u64, len: u64) -> io::Result<()> {
    let end = from + len;
    while from < end {
        let want = usize::try_from(end - from).unwrap_or(usize::MAX);
        if rustix::fs::copy_file_range(src, Some(&mut from), dst, Some(&mut to), want)? == 0 {
            return Err(io::Error::other("copy_file_range: the source ended early"));
        }
    }
    Ok(())
}

fn write_zeros(fd: &File, range: std::ops::Range<u64>) -> io::Result<()> {
    if range.is_empty() {
        return Ok(());
    }
    fd.write_all_at(
        &[0; PAGE as usize][..(range.end - range.start) as usize],
        range.start,
    )
}

/// Paths of an entry's cache file and fill record under `dir`.
pub fn store_paths(dir: &Path, key: &EntryKey) -> (PathBuf, PathBuf) {
    let stem = key.stem();
    (
        dir.join(format!("{stem}.cache")),
        dir.join(format!("{stem}.fill")),
    )
}

/// Where an entry's chunk table (paged index) is kept: `<entry>.table`,
/// beside its cache file.
fn table_path(dir: &Path, key: &EntryKey) -> PathBuf {
    dir.join(format!("{}.table", key.stem()))
}

/// The entry of a blob of a paged index (what `load_table` and
/// `save_table` are for).
fn paged_key(blob: &BlobSummary) -> io::Result<EntryKey> {
    EntryKey::of_paged(blob).ok_or_else(|| io::Error::other("a version 1 blob has no chunk table"))
}

/// The chunk table of `blob` kept in `dir`, if there is one and it is the
/// one the (verified) index names: it is verified on every load (64 KiB at
/// most), so it needs no fill record. `Ok(None)`: none kept; an error: the
/// kept one is not that table (the caller fetches it again).
pub fn load_table(dir: &Path, blob: &BlobSummary, chunk_bits: u8) -> io::Result<Option<IndexBlob>> {
    let path = table_path(dir, &paged_key(blob)?);
    let bytes = match std::fs::read(&path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    IndexBlob::from_table(blob, chunk_bits, &bytes)
        .map(Some)
        .map_err(|e| io::Error::other(format!("{}: {e}", path.display())))
}

/// Keeps a verified chunk table beside its cache file (private, replaced
/// atomically).
pub fn save_table(dir: &Path, blob: &BlobSummary, table: &[u8]) -> io::Result<()> {
    private::private_dir(dir)?;
    private::write_atomic(&table_path(dir, &paged_key(blob)?), table, false)
}

/// The fill record of a file cached whole (metadata, chunk index, lookup
/// table): `<path>.fill`.
pub fn whole_record_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".fill");
    PathBuf::from(name)
}

/// Whether `file`, open at `path`, holds content `digest` verified whole:
/// a fill record of one chunk, bound to this very file and its size, says
/// so. Reads the record only, nothing in proportion to the file.
pub fn recorded_whole(file: &File, path: &Path, digest: &[u8; 32]) -> io::Result<bool> {
    let Some(id) = identity(file)? else {
        return Ok(false);
    };
    let size = file.metadata()?.len();
    Ok(read_record(&whole_record_path(path))
        .is_some_and(|r| r.describes(digest, size, 1, id) && r.filled == [true]))
}

/// Records that `file`, in place at `path`, holds content `digest` whole:
/// the caller verified the bytes and synced them.
pub fn record_whole(file: &File, path: &Path, digest: &[u8; 32]) -> io::Result<()> {
    let Some(id) = identity(file)? else {
        return Ok(()); // no birth time: never trusted, always re-hashed
    };
    let record = FillRecord {
        subject: *digest,
        cache_size: file.metadata()?.len(),
        file: id,
        filled: vec![true],
    };
    private::write_atomic(&whole_record_path(path), &record.to_bytes(), true)
}

/// Trusts `path`'s content from now on if it hashes to `digest`: synced,
/// then recorded (true). False when it does not hash so (left unrecorded).
/// Streams the file: a lazy mount's worker adopts the metadata it wrote
/// without a record, in the background, without holding it in memory.
pub fn adopt_whole(path: &Path, digest: &[u8; 32]) -> io::Result<bool> {
    use std::io::Read;
    let mut file = private::open_existing(path)?;
    if recorded_whole(&file, path, digest)? {
        return Ok(true);
    }
    let mut hasher = lamina_oci::Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    if hasher.finalize() != *digest {
        return Ok(false);
    }
    file.sync_data()?;
    record_whole(&file, path, digest)?;
    Ok(true)
}

/// Bytes of the cache file `file` that no block is allocated for yet:
/// what its fills would still take from the filesystem.
pub fn unallocated(file: &File) -> io::Result<u64> {
    let meta = file.metadata()?;
    Ok(meta.len().saturating_sub(meta.blocks() * 512))
}

/// Allocates every block of the cache file `file` that is a hole, so that
/// no later fill of it needs space the filesystem may no longer have (a
/// mount's reservation). Bytes already there stay; new blocks read as
/// zeros, and what is served is still decided by the fill record alone.
/// Through a quiet fd where there is one: a watching mount is asked about
/// an fallocate as about a write, and none should fetch for it.
pub fn reserve(file: &File) -> io::Result<()> {
    if unallocated(file)? == 0 {
        return Ok(());
    }
    let quiet = lamina_sys::open_quiet(file);
    let fd = quiet.as_ref().unwrap_or(file);
    let len = file.metadata()?.len();
    rustix::fs::fallocate(fd, rustix::fs::FallocateFlags::empty(), 0, len)?;
    Ok(())
}

/// The identity a fill record is bound to: inode number and birth time;
/// `None` where the filesystem keeps no birth time (nothing can be bound).
pub fn identity(file: &File) -> io::Result<Option<FileIdentity>> {
    use rustix::fs::{statx, AtFlags, StatxFlags};
    let st = statx(
        file,
        "",
        AtFlags::EMPTY_PATH,
        StatxFlags::INO | StatxFlags::BTIME,
    )?;
    if st.stx_mask & StatxFlags::BTIME.bits() == 0 {
        return Ok(None);
    }
    Ok(Some(FileIdentity {
        ino: st.stx_ino,
        btime_sec: st.stx_btime.tv_sec,
        btime_nsec: st.stx_btime.tv_nsec,
    }))
}

/// The record at `path`, if there is a well-formed one.
fn read_record(path: &Path) -> Option<FillRecord> {
    let bytes = private::read_trusted(path).ok()?;
    FillRecord::from_bytes(&bytes).ok()
}

/// Opens the cache file at `path` if it is a regular file of `size` bytes;
/// otherwise puts a new, empty one (sparse, 0600) in its place. A live mount
/// that uses a replaced file keeps its inode.
fn open_cache_file(path: &Path, size: u64) -> io::Result<File> {
    for _ in 0..3 {
        let replace = match private::open_existing(path) {
            Ok(f) => {
                let meta = f.metadata()?;
                if meta.is_file() && meta.len() == size {
                    if meta.mode() & 0o077 != 0 {
                        f.set_permissions(std::fs::Permissions::from_mode(private::FILE_MODE))?;
                    }
                    return Ok(f);
                }
                true
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => false,
            Err(e) => {
                return Err(io::Error::new(
                    e.kind(),
                    format!("cache file {}: {e}", path.display()),
                ))
            }
        };
        let tmp = private::temp_name(path, "new");
        let created = private::create_new(&tmp).and_then(|f| f.set_len(size));
        let placed = created.and_then(|()| {
            if replace {
                std::fs::rename(&tmp, path)
            } else {
                // Never over a file another process has just created.
                rustix::fs::renameat_with(
                    rustix::fs::CWD,
                    &tmp,
                    rustix::fs::CWD,
                    path,
                    rustix::fs::RenameFlags::NOREPLACE,
                )
                .map_err(io::Error::from)
            }
        });
        match placed {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                let _ = std::fs::remove_file(&tmp);
            }
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                return Err(e);
            }
        }
    }
    Err(io::Error::other(format!(
        "cache file {}: replaced while opening it, three times",
        path.display()
    )))
}

impl BlobStore {
    /// Opens (creating if needed) the store for `blob` in `dir`: a cache file
    /// of the right size, and the chunks a fill record bound to that very
    /// file says are verified and durable. Reads nothing else.
    pub fn open(dir: &Path, blob: IndexBlob) -> io::Result<Self> {
        private::private_dir(dir)?;
        let key = EntryKey::of(&blob);
        let (cache_path, record_path) = store_paths(dir, &key);
        let cache = open_cache_file(&cache_path, blob.cache_size)?;
        let identity = identity(&cache)?;
        let n = blob.chunks.len();
        let mut store = BlobStore {
            blob,
            key,
            cache_path,
            record_path,
            cache,
            writer: None,
            identity,
            record_seen: None,
            filled: vec![false; n],
            filled_count: 0,
            filled_bytes: 0,
            unsaved: 0,
            last_save: Instant::now(),
            boot_pages: Vec::new(),
            boot_bytes: 0,
        };
        store.merge_record(true);
        Ok(store)
    }

    /// Takes the chunks that the record on disk, if it describes this very
    /// cache file, says are verified and durable, and returns them. A record
    /// is replaced by rename, so the one last read is not read again unless
    /// `force`d (a miss asks for every chunk it claims).
    fn merge_record(&mut self, force: bool) -> Option<Vec<bool>> {
        let id = self.identity?;
        let meta = std::fs::symlink_metadata(&self.record_path).ok()?;
        let stamp = (meta.ino(), meta.mtime(), meta.mtime_nsec());
        if !force && self.record_seen == Some(stamp) {
            return None;
        }
        let record = read_record(&self.record_path)?;
        self.record_seen = Some(stamp);
        let n = self.filled.len();
        if !record.describes(&self.key.id, self.blob.cache_size, n, id) {
            return None;
        }
        for (i, _) in record.filled.iter().enumerate().filter(|(_, f)| **f) {
            self.mark_filled(i);
        }
        Some(record.filled)
    }

    /// Writes the record: syncs the cache file, then replaces the record
    /// with one that has every chunk this process verified plus those a
    /// record of another process sharing the file already had. Does nothing
    /// when no chunk was verified since the last save.
    pub fn save(&mut self) -> io::Result<()> {
        match self.begin_save(Duration::ZERO)? {
            Some(pending) => {
                pending.sync()?;
                self.finish_save(pending)
            }
            None => Ok(()),
        }
    }

    /// First half of a save that is due (chunks have waited `interval`):
    /// what to sync and which chunks the sync covers. The caller syncs
    /// without holding this store (fills go on meanwhile) and then calls
    /// [`finish_save`](Self::finish_save).
    pub fn begin_save(&mut self, interval: Duration) -> io::Result<Option<PendingSave>> {
        if self.unsaved == 0 || self.last_save.elapsed() < interval {
            return Ok(None);
        }
        let Some(id) = self.identity else {
            self.unsaved = 0;
            return Ok(None);
        };
        // Our file was replaced under its name (an eager mount installed a
        // complete copy): its record is not ours to write.
        if std::fs::symlink_metadata(&self.cache_path)
            .map(|m| m.ino())
            .ok()
            != Some(id.ino)
        {
            self.unsaved = 0;
            return Ok(None);
        }
        Ok(Some(PendingSave {
            file: self.cache.try_clone()?,
            filled: self.filled.clone(),
            chunks: self.unsaved,
            identity: id,
        }))
    }

    /// Second half: writes a record of the chunks the sync covered, merged
    /// with the record on disk under a lock, so two savers sharing the file
    /// never drop each other's chunks.
    pub fn finish_save(&mut self, pending: PendingSave) -> io::Result<()> {
        let lock = rustix::fs::FlockOperation::LockExclusive;
        rustix::fs::flock(&self.cache, lock)?;
        let written = self.write_record(pending.identity, pending.filled);
        rustix::fs::flock(&self.cache, rustix::fs::FlockOperation::Unlock)?;
        written?;
        self.unsaved = self.unsaved.saturating_sub(pending.chunks);
        self.last_save = Instant::now();
        Ok(())
    }

    fn write_record(&mut self, id: FileIdentity, mut synced: Vec<bool>) -> io::Result<()> {
        if let Some(on_disk) = self.merge_record(true) {
            synced.iter_mut().zip(on_disk).for_each(|(s, d)| *s |= d);
        }
        let record = FillRecord {
            subject: self.key.id,
            cache_size: self.blob.cache_size,
            file: id,
            filled: synced,
        };
        private::write_atomic(&self.record_path, &record.to_bytes(), true)
    }

    /// Creates `blob`'s cache file in `dir` at its size if need be, before
    /// its chunks are known (paged index: the table comes with the first
    /// read); returns its path and whether a record says it is complete.
    pub fn prepare(dir: &Path, blob: &BlobSummary) -> io::Result<Prepared> {
        private::private_dir(dir)?;
        let key = paged_key(blob)?;
        let (cache_path, _) = store_paths(dir, &key);
        let file = open_cache_file(&cache_path, blob.cache_size)?;
        let complete = Self::recorded_complete(dir, &key, blob)?;
        Ok(Prepared {
            identity: identity(&file)?,
            cache_path,
            complete,
        })
    }

    /// Whether `blob`'s cache file in `dir` exists and a fill record bound
    /// to it says every chunk is there. Creates nothing: an eager mount asks
    /// this before it fetches, and a blob that turns out corrupt must leave
    /// no cache file behind.
    pub fn recorded_complete(dir: &Path, key: &EntryKey, blob: &BlobSummary) -> io::Result<bool> {
        let (cache_path, record_path) = store_paths(dir, key);
        let cache = match private::open_existing(&cache_path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(e),
        };
        if cache.metadata()?.len() != blob.cache_size {
            return Ok(false);
        }
        let Some(id) = identity(&cache)? else {
            return Ok(false);
        };
        let n = blob.chunk_count;
        Ok(read_record(&record_path).is_some_and(|r| {
            r.describes(&key.id, blob.cache_size, n, id) && r.filled.iter().all(|f| *f)
        }))
    }

    /// Whether the fill record at `record_path` is bound to `cache` (an
    /// open cache file of an entry whose id starts with `id_prefix`) and
    /// says every chunk is there: then no byte of `cache` changes again
    /// (a fill only ever writes the entry's own verified chunks).
    pub fn complete_by_record(
        cache: &File,
        record_path: &Path,
        id_prefix: &[u8; 16],
    ) -> io::Result<bool> {
        let Some(id) = identity(cache)? else {
            return Ok(false);
        };
        let size = cache.metadata()?.len();
        Ok(read_record(record_path).is_some_and(|r| {
            r.subject[..16] == id_prefix[..]
                && r.describes(&r.subject, size, r.filled.len(), id)
                && r.filled.iter().all(|f| *f)
        }))
    }

    /// Records that `file`, now in place as this blob's cache file in `dir`,
    /// holds every chunk: the caller verified each of them and synced it.
    pub fn record_complete(dir: &Path, blob: &IndexBlob, file: &File) -> io::Result<()> {
        let key = EntryKey::of(blob);
        let (_, record_path) = store_paths(dir, &key);
        let Some(id) = identity(file)? else {
            return Ok(());
        };
        let record = FillRecord {
            subject: key.id,
            cache_size: blob.cache_size,
            file: id,
            filled: vec![true; blob.chunks.len()],
        };
        rustix::fs::flock(file, rustix::fs::FlockOperation::LockExclusive)?;
        let written = private::write_atomic(&record_path, &record.to_bytes(), true);
        rustix::fs::flock(file, rustix::fs::FlockOperation::Unlock)?;
        written
    }

    /// Writes fills that come with no fd of their own through `file` (a
    /// quiet fd of this cache file) instead of the store's own fd.
    pub fn set_writer(&mut self, file: File) -> io::Result<()> {
        if file.metadata()?.ino() != self.cache.metadata()?.ino() {
            return Err(io::Error::other("the writer is not this cache file"));
        }
        self.writer = Some(file);
        Ok(())
    }

    fn io_fd<'a>(&'a self, via: Option<&'a File>) -> &'a File {
        via.or(self.writer.as_ref()).unwrap_or(&self.cache)
    }

    /// Takes the cross-process lock of chunk `i` (its cache range), so that
    /// mounts sharing this file fetch it once. `Ok(false)`: another process
    /// holds it (is fetching the chunk).
    pub fn try_lock_chunk(&self, i: usize) -> io::Result<bool> {
        let c = &self.blob.chunks[i];
        lamina_sys::try_lock_range(&self.cache, c.cache_offset.get(), c.size.get().into())
    }

    /// Releases [`try_lock_chunk`](Self::try_lock_chunk).
    pub fn unlock_chunk(&self, i: usize) -> io::Result<()> {
        let c = &self.blob.chunks[i];
        lamina_sys::unlock_range(&self.cache, c.cache_offset.get(), c.size.get().into())
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
    /// event's own fd, which raises no new event) and counts the chunk as
    /// filled. The record follows at the next save; a complete blob is
    /// saved at once.
    pub fn fill(&mut self, i: usize, data: &[u8], via: Option<&File>) -> io::Result<()> {
        if self.filled[i] {
            return Ok(());
        }
        let chunk = &self.blob.chunks[i];
        if data.len() != chunk.size.get() as usize {
            return Err(io::Error::other("chunk size does not match the index"));
        }
        write_chunk(self.io_fd(via), &self.blob, i, data)?;
        self.mark_filled(i);
        self.unsaved += 1;
        if self.is_complete() {
            self.save()?;
        }
        Ok(())
    }

    /// Writes chunk `i`'s verified bytes `data` but for the ranges `skip`
    /// (cache offsets inside the chunk, sorted): bytes the node holds
    /// elsewhere, which a shard reads there. The chunk stays unfilled by
    /// the fill record, so a mount that reads this file fetches it whole.
    pub fn write_partial(
        &mut self,
        i: usize,
        data: &[u8],
        skip: &[std::ops::Range<u64>],
    ) -> io::Result<()> {
        let offset = self.blob.chunks[i].cache_offset.get();
        if self.filled[i] || data.len() != self.blob.chunks[i].size.get() as usize {
            return Ok(());
        }
        let end = offset + data.len() as u64;
        let fd = self.io_fd(None);
        lamina_sys::lock_range(fd, WRITE_LOCKS + offset, end - offset)?;
        let mut at = offset;
        let mut written = Ok(());
        for part in skip.iter().chain(std::iter::once(&(end..end))) {
            let (from, to) = (at.min(end), part.start.clamp(at, end));
            let bytes = &data[(from - offset) as usize..(to - offset) as usize];
            written = written.and_then(|()| fd.write_all_at(bytes, from));
            at = at.max(part.end);
        }
        lamina_sys::unlock_range(fd, WRITE_LOCKS + offset, end - offset)?;
        written
    }

    /// Fills chunk `i` from `src` at `src_offset`: another entry's cache
    /// file, complete by its fill record, where the chunk locator found
    /// this chunk's verified bytes ([`crate::locator::ChunkLocator::find`]).
    /// Copied with `copy_file_range(2)`, so the filesystem shares the
    /// extents where it can (reflinks: XFS, btrfs) and copies in the kernel
    /// where it cannot (ext4); the rest of its page is zeros, as a fill
    /// writes it.
    pub fn fill_copied(
        &mut self,
        i: usize,
        src: &File,
        src_offset: u64,
        via: Option<&File>,
    ) -> io::Result<()> {
        if self.filled[i] {
            return Ok(());
        }
        let offset = self.blob.chunks[i].cache_offset.get();
        let size = u64::from(self.blob.chunks[i].size.get());
        let gap = tail_gap(&self.blob, i);
        let len = gap.end - offset;
        let fd = self.io_fd(via);
        lamina_sys::lock_range(fd, WRITE_LOCKS + offset, len)?;
        let copied =
            copy_range(src, src_offset, fd, offset, size).and_then(|()| write_zeros(fd, gap));
        lamina_sys::unlock_range(fd, WRITE_LOCKS + offset, len)?;
        copied?;
        self.mark_filled(i);
        self.unsaved += 1;
        if self.is_complete() {
            self.save()?;
        }
        Ok(())
    }

    /// Takes chunk `i` as filled when a record saved by another process
    /// sharing this cache file says so, or when bytes are there (written by
    /// another process, or by a worker killed before it saved) and, read
    /// through `via`, match the chunk's digest. Returns whether the chunk is
    /// now filled.
    pub fn adopt(&mut self, i: usize, via: Option<&File>) -> io::Result<bool> {
        if self.filled[i] {
            return Ok(true);
        }
        self.merge_record(false);
        if self.filled[i] {
            return Ok(true);
        }
        let chunk = &self.blob.chunks[i];
        let (start, size) = (chunk.cache_offset.get(), u64::from(chunk.size.get()));
        let via = self.io_fd(via);
        // A hole is never a filled chunk: skip the read and the hash.
        match rustix::fs::seek(via, rustix::fs::SeekFrom::Data(start)) {
            Ok(data_at) if data_at < start + size => {}
            _ => return Ok(false),
        }
        let mut buf = vec![0u8; size as usize];
        via.read_exact_at(&mut buf, start)?;
        if sha256(&buf) != chunk.digest {
            return Ok(false);
        }
        self.zero_tail_gap(i, via)?;
        self.mark_filled(i);
        self.unsaved += 1;
        Ok(true)
    }

    /// Makes the gap after chunk `i` zeros where it holds other bytes (a
    /// boot page of another image, placed while the chunk was a hole).
    fn zero_tail_gap(&self, i: usize, via: &File) -> io::Result<()> {
        let gap = tail_gap(&self.blob, i);
        let mut there = vec![0u8; (gap.end - gap.start) as usize];
        via.read_exact_at(&mut there, gap.start)?;
        if there.iter().all(|&b| b == 0) {
            return Ok(());
        }
        let len = gap.end - gap.start;
        lamina_sys::lock_range(via, WRITE_LOCKS + gap.start, len)?;
        let written = write_zeros(via, gap.clone());
        lamina_sys::unlock_range(via, WRITE_LOCKS + gap.start, len)?;
        written
    }

    /// Counts chunk `i` (verified, its bytes in the cache file) as filled.
    fn mark_filled(&mut self, i: usize) {
        if !self.filled[i] {
            self.filled[i] = true;
            self.filled_count += 1;
            self.filled_bytes += u64::from(self.blob.chunks[i].size.get());
        }
    }

    /// Writes pages from verified boot pages at `offset` (page-aligned) and
    /// records in memory those this process may serve from now on. Boot
    /// pages are parts of chunks, so the entry's table cannot check them:
    /// one image's pages must never change what another reads. So a page
    /// goes only into a hole (under a lock on its range, which a chunk's
    /// fetcher holds while writing), and a page already there counts only
    /// if it holds exactly these bytes; pages of filled chunks are skipped.
    /// Returns the bytes written.
    pub fn fill_pages(&mut self, offset: u64, data: &[u8]) -> io::Result<u64> {
        if !offset.is_multiple_of(PAGE) || !(data.len() as u64).is_multiple_of(PAGE) {
            return Err(io::Error::other("boot pages not page-aligned"));
        }
        if self.boot_pages.is_empty() {
            self.boot_pages = vec![0; (self.blob.cache_size / PAGE).div_ceil(64) as usize];
        }
        // Chunks another process filled and recorded are served as chunks.
        self.merge_record(false);
        let mut written = 0;
        for (k, page) in data.chunks_exact(PAGE as usize).enumerate() {
            let at = offset + k as u64 * PAGE;
            if self.page_ready(at / PAGE) {
                continue;
            }
            let page = self.chunk_bytes_only(at, page);
            let placed = match self.place_page(at, &page)? {
                PagePlaced::Written => {
                    written += PAGE;
                    true
                }
                PagePlaced::AlreadyThere => true,
                PagePlaced::Refused => false,
            };
            if placed {
                let p = (at / PAGE) as usize;
                self.boot_pages[p / 64] |= 1 << (p % 64);
                self.boot_bytes += PAGE;
            }
        }
        Ok(written)
    }

    /// `page` (at `at`) with every byte that lies in no chunk made zero:
    /// a boot page carries chunk bytes only, as honest fills leave the
    /// gaps ([`tail_gap`]).
    fn chunk_bytes_only<'p>(&self, at: u64, page: &'p [u8]) -> std::borrow::Cow<'p, [u8]> {
        let mut gaps = Vec::new();
        let mut covered = at;
        for i in self.chunks_covering(at, PAGE) {
            let chunk = &self.blob.chunks[i];
            let start = chunk.cache_offset.get();
            if start > covered {
                gaps.push(covered..start);
            }
            covered = covered.max(start + u64::from(chunk.size.get()));
        }
        if covered < at + PAGE {
            gaps.push(covered..at + PAGE);
        }
        let gaps: Vec<_> = gaps
            .into_iter()
            .filter(|g| {
                page[(g.start - at) as usize..(g.end - at) as usize]
                    .iter()
                    .any(|&b| b != 0)
            })
            .collect();
        if gaps.is_empty() {
            return std::borrow::Cow::Borrowed(page);
        }
        let mut clean = page.to_vec();
        for g in gaps {
            clean[(g.start - at) as usize..(g.end - at) as usize].fill(0);
        }
        std::borrow::Cow::Owned(clean)
    }

    /// Puts one boot page at `at` if that page of the file is a hole, or
    /// finds it there already; refuses where the page holds other bytes or
    /// another process is writing the range.
    fn place_page(&self, at: u64, page: &[u8]) -> io::Result<PagePlaced> {
        let fd = self.io_fd(None);
        if !lamina_sys::try_lock_range(fd, WRITE_LOCKS + at, PAGE)? {
            return Ok(PagePlaced::Refused);
        }
        let placed = (|| {
            let hole = match rustix::fs::seek(fd, rustix::fs::SeekFrom::Data(at)) {
                Ok(data_at) => data_at >= at + PAGE,
                Err(rustix::io::Errno::NXIO) => true,
                Err(e) => return Err(io::Error::from(e)),
            };
            if hole {
                fd.write_all_at(page, at)?;
                return Ok(PagePlaced::Written);
            }
            let mut there = vec![0u8; PAGE as usize];
            fd.read_exact_at(&mut there, at)?;
            Ok(match there == page {
                true => PagePlaced::AlreadyThere,
                false => PagePlaced::Refused,
            })
        })();
        lamina_sys::unlock_range(fd, WRITE_LOCKS + at, PAGE)?;
        placed
    }

    /// The runs of pages of `[offset, offset + len)` that may be read
    /// ([`Self::range_ready`] page by page), in order.
    pub fn ready_runs(&self, offset: u64, len: u64) -> Vec<std::ops::Range<u64>> {
        let end = offset.saturating_add(len).min(self.blob.cache_size);
        let mut runs: Vec<std::ops::Range<u64>> = Vec::new();
        for p in offset / PAGE..end.div_ceil(PAGE) {
            if !self.page_ready(p) {
                continue;
            }
            match runs.last_mut() {
                Some(run) if run.end == p * PAGE => run.end += PAGE,
                _ => runs.push(p * PAGE..(p + 1) * PAGE),
            }
        }
        runs
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

    /// The identity of the cache file this store was opened on (`None`
    /// where the filesystem keeps no birth time).
    pub fn identity(&self) -> Option<FileIdentity> {
        self.identity
    }

    /// The cache file this store was opened on.
    pub fn cache_file(&self) -> &File {
        &self.cache
    }

    /// Path of the fill record.
    pub fn record_path(&self) -> &Path {
        &self.record_path
    }

    /// Path of the cache file.
    pub fn cache_path(&self) -> &Path {
        &self.cache_path
    }

    /// The blob's chunk table.
    pub fn blob(&self) -> &IndexBlob {
        &self.blob
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

    fn open(dir: &Path, data: &[&[u8]]) -> BlobStore {
        BlobStore::open(dir, blob(data)).unwrap()
    }

    #[test]
    fn record_is_saved_after_sync_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let data: [&[u8]; 3] = [b"first", b"second chunk", b"third"];
        let mut s = open(dir.path(), &data);
        assert_eq!(s.filled().0, 0);
        s.fill(0, data[0], None).unwrap();
        s.fill(2, data[2], None).unwrap();
        assert!(s.is_filled(0) && !s.is_complete());
        // Not saved yet: a new store trusts nothing it did not verify.
        assert_eq!(open(dir.path(), &data).filled().0, 0);
        s.save().unwrap();
        let mut t = open(dir.path(), &data);
        assert!(t.is_filled(0) && t.is_filled(2) && !t.is_filled(1));
        t.fill(1, data[1], None).unwrap();
        assert!(t.is_complete(), "complete is saved at once");
        assert!(open(dir.path(), &data).is_complete());
        assert_eq!(t.chunks_covering(4096, 1), 1..2);
        assert_eq!(t.chunks_covering(0, 3 * 4096), 0..3);
        assert!(t.fill(1, b"wrong size", None).is_ok()); // already filled: no-op
        let mode = |p: &Path| std::fs::metadata(p).unwrap().mode() & 0o777;
        assert_eq!(mode(&t.cache_path), 0o600);
        assert_eq!(mode(t.record_path()), 0o600);
        assert_eq!(mode(dir.path()), 0o700);
    }

    /// A chunk written but for ranges the node holds elsewhere keeps holes
    /// there and stays unfilled, also after a save.
    #[test]
    fn a_partial_write_leaves_holes_and_no_record() {
        let dir = tempfile::tempdir().unwrap();
        let big = vec![7u8; 3 * 4096];
        let data: [&[u8]; 2] = [&big, b"next"];
        let mut s = open(dir.path(), &data);
        s.write_partial(0, &big, &[0..4096, 8192..12288]).unwrap();
        s.save().unwrap();
        assert!(!s.is_filled(0) && !open(dir.path(), &data).is_filled(0));
        let file = File::open(&s.cache_path).unwrap();
        let data_at = |at| rustix::fs::seek(&file, rustix::fs::SeekFrom::Data(at)).ok();
        assert_eq!(data_at(0), Some(4096), "the first range was skipped");
        let mut middle = vec![0u8; 4096];
        file.read_exact_at(&mut middle, 4096).unwrap();
        assert_eq!(middle, vec![7u8; 4096]);
        let mut last = vec![1u8; 4096];
        file.read_exact_at(&mut last, 8192).unwrap();
        assert_eq!(last, vec![0u8; 4096], "the last range was skipped");
        // Filled later (a plain mount fetched it): whole, and recorded.
        s.fill(0, &big, None).unwrap();
        s.save().unwrap();
        assert!(open(dir.path(), &data).is_filled(0));
    }

    /// Issue 7, point 1: a full-length sparse cache file was taken for a
    /// complete one, and a recreated file inherited the old record.
    #[test]
    fn full_length_or_recreated_files_inherit_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let data: [&[u8]; 2] = [b"x", b"y"];
        let b = blob(&data);
        let (cache, _) = store_paths(dir.path(), &EntryKey::of(&b));
        let f = File::create(&cache).unwrap();
        f.set_len(b.cache_size).unwrap();
        drop(f);
        let mut s = open(dir.path(), &data);
        assert_eq!(s.filled().0, 0, "a full-length file without a record");
        s.fill(0, data[0], None).unwrap();
        s.fill(1, data[1], None).unwrap();
        assert!(open(dir.path(), &data).is_complete());
        // Deleted and recreated at full length: the record is not its own.
        std::fs::remove_file(&cache).unwrap();
        File::create(&cache).unwrap().set_len(b.cache_size).unwrap();
        assert_eq!(open(dir.path(), &data).filled().0, 0);
        // Replaced by rename: likewise.
        let mut s = open(dir.path(), &data);
        s.fill(0, data[0], None).unwrap();
        s.fill(1, data[1], None).unwrap();
        let other = dir.path().join("other");
        File::create(&other).unwrap().set_len(b.cache_size).unwrap();
        std::fs::rename(&other, &cache).unwrap();
        assert_eq!(open(dir.path(), &data).filled().0, 0);
        // Truncated: replaced by a new empty file, nothing inherited.
        let mut s = open(dir.path(), &data);
        s.fill(0, data[0], None).unwrap();
        s.fill(1, data[1], None).unwrap();
        let before = std::fs::metadata(&cache).unwrap().ino();
        File::options()
            .write(true)
            .open(&cache)
            .unwrap()
            .set_len(10)
            .unwrap();
        let s = open(dir.path(), &data);
        assert_eq!(s.filled().0, 0);
        assert_ne!(std::fs::metadata(&cache).unwrap().ino(), before);
        assert_eq!(std::fs::metadata(&cache).unwrap().len(), b.cache_size);
    }

    #[test]
    fn adopt_verifies_unrecorded_bytes_and_skips_holes_and_damage() {
        let dir = tempfile::tempdir().unwrap();
        let data: [&[u8]; 3] = [b"alpha", b"beta", b"gamma"];
        let mut writer = open(dir.path(), &data);
        writer.fill(0, data[0], None).unwrap();
        writer.fill(1, data[1], None).unwrap();
        // A worker killed before it saved: bytes there, no record.
        let path = writer.cache_path.clone();
        drop(writer);
        let f = File::options().write(true).open(path).unwrap();
        f.write_all_at(b"BETA", 4096).unwrap(); // chunk 1 damaged
        let mut s = open(dir.path(), &data);
        assert_eq!(s.filled().0, 0);
        let via = File::open(&s.cache_path).unwrap();
        assert!(
            s.adopt(0, Some(&via)).unwrap(),
            "verified bytes are adopted"
        );
        assert!(!s.adopt(1, Some(&via)).unwrap(), "damaged bytes are not");
        assert!(!s.adopt(2, None).unwrap(), "a hole is not");
        // Another process's saved record is adopted without a read.
        let mut other = open(dir.path(), &data);
        other.fill(2, data[2], None).unwrap();
        other.save().unwrap();
        assert!(s.adopt(2, Some(&via)).unwrap());
        // Chunk locks: another store (another process's fd) is kept out.
        assert!(s.try_lock_chunk(0).unwrap());
        assert!(!other.try_lock_chunk(0).unwrap());
        assert!(other.try_lock_chunk(1).unwrap());
        s.unlock_chunk(0).unwrap();
        assert!(other.try_lock_chunk(0).unwrap());
    }

    /// What a lazy mount's worker does with the layer files the mount
    /// wrote unrecorded: a file that hashes right is recorded, one that
    /// does not (replaced since) is left unrecorded, never trusted.
    #[test]
    fn adopt_whole_records_only_the_right_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let (good, bad) = (dir.path().join("good"), dir.path().join("bad"));
        let bytes = vec![7u8; 3 << 20];
        let digest = sha256(&bytes);
        std::fs::write(&good, &bytes).unwrap();
        std::fs::write(&bad, &bytes[1..]).unwrap();
        let recorded = |p: &Path| recorded_whole(&File::open(p).unwrap(), p, &digest).unwrap();
        assert!(!recorded(&good));
        assert!(adopt_whole(&good, &digest).unwrap());
        assert!(recorded(&good));
        assert!(adopt_whole(&good, &digest).unwrap(), "already recorded");
        assert!(!adopt_whole(&bad, &digest).unwrap());
        assert!(!recorded(&bad));
        assert!(!whole_record_path(&bad).exists());
        assert!(adopt_whole(&dir.path().join("gone"), &digest).is_err());
    }

    #[test]
    fn record_complete_binds_an_installed_file() {
        let dir = tempfile::tempdir().unwrap();
        let data: [&[u8]; 1] = [b"x"];
        let b = blob(&data);
        let (cache, _) = store_paths(dir.path(), &EntryKey::of(&b));
        let f = File::create(&cache).unwrap();
        f.write_all_at(b"x", 0).unwrap();
        f.set_len(4096).unwrap();
        assert!(!open(dir.path(), &data).is_complete());
        assert!(
            !BlobStore::recorded_complete(dir.path(), &EntryKey::of(&b), &b.summary()).unwrap()
        );
        BlobStore::record_complete(dir.path(), &b, &f).unwrap();
        assert!(open(dir.path(), &data).is_complete());
        assert!(BlobStore::recorded_complete(dir.path(), &EntryKey::of(&b), &b.summary()).unwrap());
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
        assert_eq!(
            s.ready_runs(0, 8 * 4096),
            [4096..2 * 4096, 3 * 4096..4 * 4096]
        );
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

    /// Point 1 of the many-tenants issue: an image that names a blob of
    /// another with a chunk table (and bytes) of its own, same sizes and
    /// chunk count, gets an entry of its own: the first image never sees
    /// its bytes or adopts its record.
    #[test]
    fn images_that_describe_a_blob_differently_never_share_its_entry() {
        let dir = tempfile::tempdir().unwrap();
        let honest: [&[u8]; 3] = [b"alpha", b"beta", b"gamma"];
        let hostile: [&[u8]; 3] = [b"ALPHA", b"beta", b"gamma"];
        assert_eq!(blob(&honest).digest, blob(&hostile).digest);
        let mut theirs = open(dir.path(), &hostile);
        theirs.fill(0, hostile[0], None).unwrap();
        theirs.save().unwrap();
        let mut ours = open(dir.path(), &honest);
        assert_ne!(ours.cache_path, theirs.cache_path);
        assert!(!ours.is_filled(0), "their record is not ours");
        assert!(!ours.adopt(0, None).unwrap(), "their bytes are not ours");
        ours.fill(0, honest[0], None).unwrap();
        ours.save().unwrap();
        let mut back = [0u8; 5];
        File::open(&ours.cache_path)
            .unwrap()
            .read_exact_at(&mut back, 0)
            .unwrap();
        assert_eq!(&back, b"alpha");
        File::open(&theirs.cache_path)
            .unwrap()
            .read_exact_at(&mut back, 0)
            .unwrap();
        assert_eq!(&back, b"ALPHA");
        assert!(open(dir.path(), &honest).is_filled(0));
        assert!(!open(dir.path(), &hostile).is_filled(1));
    }

    /// Point 3: boot pages (which no chunk digest covers) never overwrite
    /// bytes another store verified, and one store's pages are never
    /// served by another: a page goes only into a hole, and a page already
    /// there counts only where it holds the very same bytes.
    #[test]
    fn boot_pages_never_change_what_another_store_reads() {
        let dir = tempfile::tempdir().unwrap();
        let big = vec![3u8; 3 * 4096];
        let data: [&[u8]; 4] = [&big, b"tail", b"end", b"more"];
        let mut verified = open(dir.path(), &data);
        verified.fill(0, data[0], None).unwrap();
        verified.save().unwrap();
        // A store with other pages for a chunk another one recorded.
        let mut hostile = open(dir.path(), &data);
        assert_eq!(hostile.fill_pages(4096, &[9u8; 4096]).unwrap(), 0);
        let mut back = vec![0u8; 4096];
        let file = File::open(&verified.cache_path).unwrap();
        file.read_exact_at(&mut back, 4096).unwrap();
        assert_eq!(back, big[..4096], "verified bytes unchanged");
        // Its pages go into a hole, and only it serves them.
        assert_eq!(hostile.fill_pages(3 * 4096, &[9u8; 4096]).unwrap(), 4096);
        assert!(hostile.range_ready(3 * 4096, 1));
        let mut honest_page = b"tail".to_vec();
        honest_page.resize(4096, 0);
        let mut honest = open(dir.path(), &data);
        assert_eq!(honest.fill_pages(3 * 4096, &honest_page).unwrap(), 0);
        assert!(!honest.range_ready(3 * 4096, 1), "their page is not ours");
        honest.fill(1, data[1], None).unwrap();
        assert!(honest.range_ready(3 * 4096, 1));
        // Pages already there with our bytes count (a restarted worker).
        let mut end_page = b"end".to_vec();
        end_page.resize(4096, 0);
        assert_eq!(honest.fill_pages(4 * 4096, &end_page).unwrap(), 4096);
        let mut restarted = open(dir.path(), &data);
        assert_eq!(restarted.fill_pages(4 * 4096, &end_page).unwrap(), 0);
        assert!(restarted.range_ready(4 * 4096, 1));
        // A page whose range another process is writing is left alone.
        let mut other = open(dir.path(), &data);
        let (writing, at) = (verified.cache_file(), WRITE_LOCKS + 5 * 4096);
        assert!(lamina_sys::try_lock_range(writing, at, 4096).unwrap());
        assert_eq!(other.fill_pages(5 * 4096, &[1u8; 4096]).unwrap(), 0);
        assert!(!other.range_ready(5 * 4096, 1));
        lamina_sys::unlock_range(writing, at, 4096).unwrap();
    }

    /// Issue 42 point 6: the kernel reads a file's last block whole, so the
    /// bytes after a chunk up to its page's end show past the file's end
    /// in an mmap. They are zeros whatever another image's boot pages
    /// put there: a boot page carries chunk bytes only, and a fill (or
    /// the adoption of bytes already there) zeros the gap after its chunk.
    #[test]
    fn bytes_after_a_chunk_in_its_page_are_zeros() {
        let dir = tempfile::tempdir().unwrap();
        let data: [&[u8]; 3] = [b"first", b"second", b"third"];
        let page_of = |chunk: &[u8]| {
            let mut page = chunk.to_vec();
            page.resize(4096, 0xee);
            page
        };
        let read_page = |store: &BlobStore, at: u64| {
            let mut back = vec![0u8; 4096];
            File::open(&store.cache_path)
                .unwrap()
                .read_exact_at(&mut back, at)
                .unwrap();
            back
        };
        let zeros_after = |page: &[u8], len: usize| page[len..].iter().all(|&b| b == 0);
        // Boot pages whose gap holds other bytes.
        let mut theirs = open(dir.path(), &data);
        assert_eq!(theirs.fill_pages(0, &page_of(data[0])).unwrap(), 4096);
        assert!(zeros_after(&read_page(&theirs, 0), 5), "boot page's gap");
        // A page put there by another writer, then filled, or adopted.
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(&theirs.cache_path)
            .unwrap();
        file.write_all_at(&page_of(data[1]), 4096).unwrap();
        file.write_all_at(&page_of(data[2]), 2 * 4096).unwrap();
        let mut ours = open(dir.path(), &data);
        ours.fill(1, data[1], None).unwrap();
        assert!(
            zeros_after(&read_page(&ours, 4096), 6),
            "filled chunk's gap"
        );
        assert!(ours.adopt(2, None).unwrap());
        assert!(
            zeros_after(&read_page(&ours, 2 * 4096), 5),
            "adopted chunk's gap"
        );
        assert_eq!(&read_page(&ours, 2 * 4096)[..5], b"third");
    }
}
