//! Chunks found on this node instead of fetched: the cache's chunk locator
//! (format in [`lamina_format::locate`]) says where a verified copy of a
//! chunk lies, by its digest; [`ChunkLocator::copy`] reads it from there
//! and hands it back only if it hashes to the digest the reader's own table
//! gives. An update of an image (a rebuilt base, most files unchanged) and
//! two images sharing files then fetch only the chunks the node does not
//! hold.
//!
//! Other entries' cache files are read through quiet fds: a plain read of a
//! file a kernel lazy mount serves would raise that mount's pre-content
//! event, and a stale slot would make it fetch. Where quiet fds cannot be
//! had (no fanotify: an unprivileged FUSE mount), nothing is copied.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use lamina_format::locate::{
    level_window, parse_ranges, ranges_bytes, slot_offset, victim, ChunkSlot, ContentRange,
    LocatorHeader, FILE_LEN, HEADER_LEN, LEVELS, SLOT_LEN,
};
use lamina_oci::sha256;
use zerocopy::IntoBytes;

use crate::private;
use crate::store::{store_paths, EntryKey};

/// The locator's file in a cache's blob directory.
pub const LOCATOR_FILE: &str = "chunks.locate";

/// Block size of the EROFS that reads a found chunk in place.
const BLOCK: u64 = 4096;

/// Quiet fds kept open at once (other entries' cache files).
const OPEN_FILES: usize = 64;

/// Most named ranges one locator reads into memory.
const NAMED_MAX: usize = 1 << 20;

/// Named ranges by (sha256, length): the slots they would be.
type NamedIndex = HashMap<([u8; 32], u64), Vec<ChunkSlot>>;

/// A complete cache file and a quiet fd of it, shared by every chunk found
/// in it: two fds per file, however many chunks a mount borrows there.
type SharedFiles = (Arc<File>, Arc<File>);

/// A cache's chunk locator.
#[derive(Debug)]
pub struct ChunkLocator {
    file: File,
    dir: PathBuf,
    /// Quiet fds of other entries' cache files, by stem; `None`: that file
    /// cannot be opened quietly (or at all).
    open: Mutex<HashMap<String, Option<File>>>,
    /// Other entries' cache files found complete (the file and a quiet fd
    /// of it), by stem: a complete file stays complete, so its fill record
    /// is read once per file, not once per chunk found in it.
    complete: Mutex<HashMap<String, SharedFiles>>,
    /// The named ranges lists of the dir, read at the first lookup.
    named: Mutex<Option<Arc<NamedIndex>>>,
    /// How a quiet fd is had ([`lamina_sys::open_quiet`]; tests without
    /// fanotify use a plain one).
    quiet: fn(&File) -> io::Result<File>,
}

impl ChunkLocator {
    /// Opens the locator of the blob directory `dir`, creating it (0600,
    /// sparse) if there is none; one of another version is replaced.
    pub fn open(dir: &Path) -> io::Result<ChunkLocator> {
        private::private_dir(dir)?;
        let path = dir.join(LOCATOR_FILE);
        let file = match open_valid(&path)? {
            Some(file) => file,
            None => create(&path)?,
        };
        // Slots are read a window at a time: readahead would only cache the
        // holes around them, as pages of zeros.
        let _ = rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::Random);
        Ok(ChunkLocator {
            file,
            dir: dir.to_path_buf(),
            open: Mutex::new(HashMap::new()),
            complete: Mutex::new(HashMap::new()),
            named: Mutex::new(None),
            quiet: lamina_sys::open_quiet,
        })
    }

    /// Whether any chunk may have been noted (a cheap gate before lookups
    /// that need chunk tables): the slots sharing the header's block are
    /// read, and past it the file is sparse, so a slot written there is
    /// data. A wrong `true` only costs lookups that find nothing.
    pub fn may_hold_any(&self) -> bool {
        const BLOCK: u64 = 4096;
        let mut first = vec![0u8; BLOCK as usize - HEADER_LEN];
        if self
            .file
            .read_exact_at(&mut first, HEADER_LEN as u64)
            .is_err()
            || first.iter().any(|&b| b != 0)
        {
            return true;
        }
        !matches!(
            rustix::fs::seek(&self.file, rustix::fs::SeekFrom::Data(BLOCK)),
            Err(rustix::io::Errno::NXIO)
        )
    }

    /// Notes that chunk `digest` (`size` bytes) lies verified at
    /// `cache_offset` of `key`'s cache file. Best effort: a slot that is
    /// not written only costs a fetch later.
    pub fn note(&self, digest: &[u8; 32], key: &EntryKey, cache_offset: u64, size: u32) {
        let mut entry = [0; 16];
        entry.copy_from_slice(&key.id[..16]);
        let slot = ChunkSlot::new(*digest, (key.blob, entry), cache_offset, size);
        let mut free = None;
        // Level by level, up to the first with room: the levels above are
        // not read (a read of a hole would cache a page of zeros).
        for level in 0..LEVELS {
            for (i, old) in self.level_slots(digest, level) {
                match old {
                    Some(old) if old == slot => return,
                    Some(old) if old.digest == *digest => {
                        free = Some(i);
                        break;
                    }
                    Some(_) => {}
                    None => {
                        free = free.or(Some(i));
                    }
                }
            }
            if free.is_some() {
                break;
            }
        }
        let at = slot_offset(free.unwrap_or_else(|| victim(digest)));
        if let Err(e) = self.file.write_all_at(slot.as_bytes(), at) {
            tracing::debug!("chunk locator: {e}");
        }
    }

    /// The bytes of chunk `digest` (`size` bytes), copied from another
    /// entry than `not` where the locator says one holds it, and only if
    /// they hash to `digest`.
    pub fn copy(&self, digest: &[u8; 32], size: u32, not: &EntryKey) -> Option<Vec<u8>> {
        // Not our own file: a fill of it would be a no-op.
        self.slots_of(digest, size, not)
            .find_map(|slot| self.read_verified(&slot))
    }

    /// Where a verified copy of chunk `digest` (`size` bytes) lies in
    /// another entry's cache file than `not`, for a reader to read it there
    /// instead of keeping a copy: only in a file whose fill record says it is
    /// complete (its bytes never change again), at a block-aligned offset,
    /// and only if the bytes there hash to `digest` now. The fd returned is
    /// that very file, for the reader to open by it, not by its path.
    pub fn find(&self, digest: &[u8; 32], size: u32, not: &EntryKey) -> Option<Found> {
        self.slots_of(digest, size, not)
            .filter(|slot| slot.cache_offset.get() % BLOCK == 0)
            .find_map(|slot| self.found_at(&slot))
    }

    /// Notes that `ranges` of `key`'s cache file, complete by its fill
    /// record, hold the bytes their sha256 names (packed files named by
    /// their bytes): its named ranges list, written once (an entry's bytes
    /// never differ). Best effort, like [`ChunkLocator::note`].
    pub fn note_named(&self, key: &EntryKey, ranges: &[ContentRange]) {
        let path = self.dir.join(format!("{}.named", key.stem()));
        if ranges.is_empty() || path.exists() {
            return;
        }
        if let Err(e) = private::write_atomic(&path, &ranges_bytes(ranges), false) {
            tracing::debug!("named ranges {}: {e}", path.display());
        }
    }

    /// Where the `len` bytes whose sha256 is `sha256` lie in another entry's
    /// cache file than `not`, by the named ranges lists: as
    /// [`ChunkLocator::find`] finds a chunk (a complete file, a block, the
    /// bytes hashed now).
    pub fn find_named(&self, sha256: &[u8; 32], len: u64, not: &EntryKey) -> Option<Found> {
        let index = self.named_index()?;
        let ours = |slot: &ChunkSlot| slot.blob == not.blob && slot.entry == not.id[..16];
        index
            .get(&(*sha256, len))?
            .iter()
            .filter(|slot| !ours(slot) && slot.cache_offset.get() % BLOCK == 0)
            .find_map(|slot| self.found_at(slot))
    }

    /// The dir's named ranges lists, read once.
    fn named_index(&self) -> Option<Arc<NamedIndex>> {
        let mut named = self.named.lock().ok()?;
        if let Some(index) = named.as_ref() {
            return Some(index.clone());
        }
        let mut index = NamedIndex::new();
        let mut count = 0;
        for entry in std::fs::read_dir(&self.dir).ok()?.flatten() {
            let name = entry.file_name();
            let Some(stem) = name.to_str().and_then(|n| n.strip_suffix(".named")) else {
                continue;
            };
            let (Some(owner), Ok(bytes)) = (entry_of_stem(stem), std::fs::read(entry.path()))
            else {
                continue;
            };
            for r in parse_ranges(&bytes).unwrap_or_default() {
                let Ok(size) = u32::try_from(r.len) else {
                    continue;
                };
                let slot = ChunkSlot::new(r.sha256, owner, r.offset, size);
                index.entry((r.sha256, r.len)).or_default().push(slot);
                count += 1;
            }
            if count >= NAMED_MAX {
                break;
            }
        }
        let index = Arc::new(index);
        *named = Some(index.clone());
        Some(index)
    }

    /// The slots that say another entry than `not` holds chunk `digest`
    /// (`size` bytes).
    fn slots_of<'a>(
        &self,
        digest: &'a [u8; 32],
        size: u32,
        not: &'a EntryKey,
    ) -> impl Iterator<Item = ChunkSlot> + 'a {
        let ours = |slot: &ChunkSlot| slot.blob == not.blob && slot.entry == not.id[..16];
        self.window(digest)
            .into_iter()
            .filter_map(|(_, slot)| slot)
            .filter(move |s| s.digest == *digest && s.size.get() == size && !ours(s))
    }

    fn found_at(&self, slot: &ChunkSlot) -> Option<Found> {
        let key = slot_key(slot);
        let path = store_paths(&self.dir, &key).0;
        let (file, quiet) = self.complete_file(&key)?;
        let (start, size) = (slot.cache_offset.get(), u64::from(slot.size.get()));
        let mut buf = vec![0u8; size as usize];
        quiet.read_exact_at(&mut buf, start).ok()?;
        (sha256(&buf) == slot.digest).then_some(Found {
            path,
            file,
            quiet,
            cache_offset: start,
            size,
        })
    }

    /// `key`'s cache file and a quiet fd of it, if its fill record, bound to
    /// that very file, says it is complete.
    fn complete_file(&self, key: &EntryKey) -> Option<SharedFiles> {
        let stem = key.stem();
        if let Some(known) = self.complete.lock().ok()?.get(&stem) {
            return Some(known.clone());
        }
        let (path, record) = store_paths(&self.dir, key);
        let file = private::open_trusted(&path).ok()?;
        let mut prefix = [0; 16];
        prefix.copy_from_slice(&key.id[..16]);
        if !crate::store::BlobStore::complete_by_record(&file, &record, &prefix).ok()? {
            return None;
        }
        let quiet = (self.quiet)(&file).ok()?;
        let found = (Arc::new(file), Arc::new(quiet));
        let out = Some(found.clone());
        let mut complete = self.complete.lock().ok()?;
        if complete.len() >= OPEN_FILES {
            complete.clear();
        }
        complete.insert(stem, found);
        out
    }

    /// The slots probed for `digest` and what each holds (`None`: empty,
    /// torn or unreadable). The window is contiguous except where it wraps
    /// past the last slot: one read per run, not one per slot (a miss looks
    /// up every chunk it fetches).
    fn window(&self, digest: &[u8; 32]) -> Vec<(u64, Option<ChunkSlot>)> {
        (0..LEVELS)
            .flat_map(|level| self.level_slots(digest, level))
            .collect()
    }

    /// `digest`'s window in `level` and what each slot holds. A run of
    /// slots in a hole of the sparse file is not read: a read would cache
    /// a page of zeros, and lookups probe every level.
    fn level_slots(&self, digest: &[u8; 32], level: u32) -> Vec<(u64, Option<ChunkSlot>)> {
        let slots: Vec<u64> = level_window(digest, level).collect();
        let mut out = Vec::with_capacity(slots.len());
        for run in slots.chunk_by(|a, b| *b == a + 1) {
            let (start, len) = (slot_offset(run[0]), (run.len() * SLOT_LEN) as u64);
            let data = rustix::fs::seek(&self.file, rustix::fs::SeekFrom::Data(start));
            let hole = !matches!(data, Ok(at) if at < start + len);
            let mut buf = vec![0u8; run.len() * SLOT_LEN];
            let read = !hole && self.file.read_exact_at(&mut buf, start).is_ok();
            for (i, bytes) in run.iter().zip(buf.chunks_exact(SLOT_LEN)) {
                out.push((*i, read.then(|| ChunkSlot::parse(bytes)).flatten()));
            }
        }
        out
    }

    /// Reads the slot's range from its entry's cache file (quietly) and
    /// returns it if it hashes to the slot's digest.
    fn read_verified(&self, slot: &ChunkSlot) -> Option<Vec<u8>> {
        let key = slot_key(slot);
        let stem = key.stem();
        // Read and hashed outside the lock: misses copy side by side.
        let file = {
            let mut open = self.open.lock().ok()?;
            if open.len() >= OPEN_FILES && !open.contains_key(&stem) {
                open.clear();
            }
            open.entry(stem)
                .or_insert_with(|| open_quiet(&store_paths(&self.dir, &key).0, self.quiet))
                .as_ref()?
                .try_clone()
                .ok()?
        };
        let (start, size) = (slot.cache_offset.get(), u64::from(slot.size.get()));
        // A hole is never a chunk: skip the read and the hash.
        match rustix::fs::seek(&file, rustix::fs::SeekFrom::Data(start)) {
            Ok(data_at) if data_at < start + size => {}
            _ => return None,
        }
        let mut buf = vec![0u8; size as usize];
        file.read_exact_at(&mut buf, start).ok()?;
        (sha256(&buf) == slot.digest).then_some(buf)
    }
}

/// The (blob, first 16 bytes of the id) of an entry's file stem.
fn entry_of_stem(stem: &str) -> Option<([u8; 32], [u8; 16])> {
    let (blob, id) = stem.split_once('.')?;
    let mut out = ([0; 32], [0; 16]);
    hex::decode_to_slice(blob, &mut out.0).ok()?;
    hex::decode_to_slice(id, &mut out.1).ok()?;
    Some(out)
}

/// The entry a slot names (the first 16 bytes of its id: all a path needs).
fn slot_key(slot: &ChunkSlot) -> EntryKey {
    let mut id = [0; 32];
    id[..16].copy_from_slice(&slot.entry);
    EntryKey {
        blob: slot.blob,
        id,
    }
}

/// A verified chunk in another entry's complete cache file.
#[derive(Debug)]
pub struct Found {
    /// The cache file's path (what keeps it from garbage collection).
    pub path: PathBuf,
    /// The file itself, opened before its bytes were checked.
    pub file: Arc<File>,
    /// A quiet fd of it (reads raise no pre-content event).
    pub quiet: Arc<File>,
    /// Where the chunk starts in it.
    pub cache_offset: u64,
    /// The chunk's size.
    pub size: u64,
}

impl Found {
    /// Drops the chunk's pages from the page cache: read to be checked,
    /// they are not a reader's.
    pub fn drop_pages(&self) {
        let len = std::num::NonZeroU64::new(self.size);
        let _ = rustix::fs::fadvise(
            &self.quiet,
            self.cache_offset,
            len,
            rustix::fs::Advice::DontNeed,
        );
    }
}

/// Opens the locator at `path` if it is one this code reads.
fn open_valid(path: &Path) -> io::Result<Option<File>> {
    let file = match private::open_existing(path) {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut header = [0u8; HEADER_LEN];
    let valid = file.read_exact_at(&mut header, 0).is_ok()
        && LocatorHeader::is_valid(&header)
        && file.metadata()?.len() == FILE_LEN;
    Ok(valid.then_some(file))
}

/// Creates a locator at `path` (replacing what is there): a temp file with
/// the header, sparse to its full length, renamed into place. Two workers
/// creating it at once each rename a valid empty one.
fn create(path: &Path) -> io::Result<File> {
    private::write_atomic_with(path, false, |file| {
        file.write_all_at(LocatorHeader::new().as_bytes(), 0)?;
        file.set_len(FILE_LEN)
    })
}

/// A quiet fd of the cache file at `path` (a private regular file of this
/// user, not followed through a symlink), or `None` (logged once per file).
fn open_quiet(path: &Path, quiet: fn(&File) -> io::Result<File>) -> Option<File> {
    let opened = private::open_trusted(path).and_then(|f| quiet(&f));
    match opened {
        Ok(file) => Some(file),
        Err(e) => {
            tracing::debug!("chunk locator: {}: {e}", path.display());
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lamina_format::locate::{probe, LEVEL0_SLOTS, PROBE, SLOTS};

    fn key(b: u8) -> EntryKey {
        EntryKey {
            blob: [b; 32],
            id: [b; 32],
        }
    }

    #[test]
    fn a_locator_is_created_once_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let blobs = dir.path().join("blobs");
        let first = ChunkLocator::open(&blobs).unwrap();
        first.note(&[3; 32], &key(1), 0, 10);
        drop(first);
        let again = ChunkLocator::open(&blobs).unwrap();
        let slots: Vec<ChunkSlot> = again
            .window(&[3; 32])
            .into_iter()
            .filter_map(|w| w.1)
            .collect();
        assert_eq!(slots.len(), 1, "the note survived reopening");
        let meta = std::fs::metadata(blobs.join(LOCATOR_FILE)).unwrap();
        assert_eq!(meta.len(), FILE_LEN);
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    }

    /// Bytes are copied only from another entry, and only when they hash
    /// to the digest: a forged slot, a hole or our own entry give nothing.
    #[test]
    fn copies_only_verified_bytes_of_other_entries() {
        let dir = tempfile::tempdir().unwrap();
        let mut locator = ChunkLocator::open(dir.path()).unwrap();
        locator.quiet = File::try_clone;
        let data = b"the chunk's bytes".repeat(100);
        let digest = sha256(&data);
        let size = data.len() as u32;
        let (theirs, ours) = (key(1), key(2));
        let cache = store_paths(dir.path(), &theirs).0;
        std::fs::write(&cache, [vec![0u8; 8192], data.clone()].concat()).unwrap();
        assert_eq!(locator.copy(&digest, size, &ours), None, "nothing noted");
        locator.note(&digest, &theirs, 8192, size);
        assert_eq!(locator.copy(&digest, size, &ours), Some(data.clone()));
        assert_eq!(locator.copy(&digest, size, &theirs), None, "our own file");
        assert_eq!(locator.copy(&digest, size + 1, &ours), None, "other size");
        // A slot that names other bytes (stale or forged) is not believed.
        let forged = sha256(b"other bytes");
        locator.note(&forged, &theirs, 8192, size);
        assert_eq!(locator.copy(&forged, size, &ours), None);
        // Nor one pointing at a hole.
        let sparse = store_paths(dir.path(), &key(3)).0;
        File::create(&sparse).unwrap().set_len(1 << 20).unwrap();
        let hole = sha256(&vec![0u8; data.len()]);
        locator.note(&hole, &key(3), 0, size);
        assert_eq!(locator.copy(&hole, size, &ours), None);
    }

    /// Writes `key`'s fill record for its cache file in `dir`: `filled`
    /// chunks of which every one is there or not.
    fn record(dir: &Path, key: &EntryKey, chunks: usize, all: bool) {
        let (cache, record) = store_paths(dir, key);
        let file = File::open(&cache).unwrap();
        let mut filled = vec![true; chunks];
        filled[0] = all;
        let record_bytes = lamina_format::fill::FillRecord {
            subject: key.id,
            cache_size: file.metadata().unwrap().len(),
            file: crate::store::identity(&file).unwrap().unwrap(),
            filled,
        }
        .to_bytes();
        private::write_atomic(&record, &record_bytes, false).unwrap();
    }

    #[test]
    fn finds_chunks_only_in_complete_files_where_they_verify() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let mut locator = ChunkLocator::open(dir.path()).unwrap();
        locator.quiet = File::try_clone;
        let data = b"the chunk's bytes".repeat(300);
        let (digest, size) = (sha256(&data), data.len() as u32);
        let (theirs, ours) = (key(1), key(2));
        let cache = store_paths(dir.path(), &theirs).0;
        std::fs::write(&cache, [vec![0u8; 8192], data.clone()].concat()).unwrap();
        locator.note(&digest, &theirs, 8192, size);
        assert!(locator.find(&digest, size, &ours).is_none(), "no record");
        record(dir.path(), &theirs, 3, false);
        assert!(locator.find(&digest, size, &ours).is_none(), "incomplete");
        record(dir.path(), &theirs, 3, true);
        let found = locator
            .find(&digest, size, &ours)
            .expect("complete, verified");
        assert_eq!(
            (found.path.as_path(), found.cache_offset),
            (cache.as_path(), 8192)
        );
        let ino = std::fs::metadata(&cache).unwrap().ino();
        assert_eq!(found.file.metadata().unwrap().ino(), ino);
        assert!(
            locator.find(&digest, size, &theirs).is_none(),
            "our own file"
        );
        // A slot naming other bytes is not believed, complete or not.
        let forged = sha256(b"other bytes");
        locator.note(&forged, &theirs, 8192, size);
        assert!(locator.find(&forged, size, &ours).is_none());
        // Nor one off a block boundary (an EROFS reads blocks).
        let odd = key(4);
        let odd_cache = store_paths(dir.path(), &odd).0;
        let other = b"other chunk".repeat(50);
        std::fs::write(&odd_cache, [vec![0u8; 100], other.clone()].concat()).unwrap();
        record(dir.path(), &odd, 1, true);
        locator.note(&sha256(&other), &odd, 100, other.len() as u32);
        assert!(locator
            .find(&sha256(&other), other.len() as u32, &ours)
            .is_none());
    }

    /// Packed files by their bytes: found through another entry's named
    /// ranges list in a complete file where they verify, and nowhere else.
    #[test]
    fn finds_named_ranges_only_in_complete_files_where_they_verify() {
        let dir = tempfile::tempdir().unwrap();
        let mut locator = ChunkLocator::open(dir.path()).unwrap();
        locator.quiet = File::try_clone;
        let (small, other) = (b"a packed file".repeat(10), b"its neighbour".to_vec());
        let (theirs, ours) = (key(1), key(2));
        let cache = store_paths(dir.path(), &theirs).0;
        let mut bytes = vec![0u8; 3 * 4096];
        bytes[4096..4096 + small.len()].copy_from_slice(&small);
        bytes[8192..8192 + other.len()].copy_from_slice(&other);
        std::fs::write(&cache, &bytes).unwrap();
        let range = |offset, b: &[u8]| ContentRange {
            offset,
            len: b.len() as u64,
            sha256: sha256(b),
        };
        // The second range is forged: those are not its bytes.
        let forged = ContentRange {
            sha256: sha256(b"else"),
            ..range(8192, &other)
        };
        locator.note_named(&theirs, &[range(4096, &small), forged]);
        let len = small.len() as u64;
        let fresh = || {
            let mut l = ChunkLocator::open(dir.path()).unwrap();
            l.quiet = File::try_clone;
            l
        };
        assert!(
            fresh().find_named(&sha256(&small), len, &ours).is_none(),
            "no record"
        );
        record(dir.path(), &theirs, 1, true);
        let l = fresh();
        let found = l.find_named(&sha256(&small), len, &ours).expect("found");
        // Every find in one file shares its fds: two per file, not per find.
        let again = l.find_named(&sha256(&small), len, &ours).expect("found");
        assert!(Arc::ptr_eq(&found.file, &again.file));
        assert!(Arc::ptr_eq(&found.quiet, &again.quiet));
        assert_eq!((found.path, found.cache_offset), (cache, 4096));
        assert!(
            l.find_named(&sha256(&small), len, &theirs).is_none(),
            "our own"
        );
        assert!(
            l.find_named(&sha256(&small), len + 1, &ours).is_none(),
            "other length"
        );
        assert!(l
            .find_named(&sha256(b"else"), other.len() as u64, &ours)
            .is_none());
        assert!(l
            .find_named(&sha256(&other), other.len() as u64, &ours)
            .is_none());
    }

    #[test]
    fn holds_nothing_until_a_chunk_is_noted() {
        let dir = tempfile::tempdir().unwrap();
        let locator = ChunkLocator::open(dir.path()).unwrap();
        assert!(!locator.may_hold_any(), "a new locator");
        // Digests whose first slot (their first 8 bytes, little-endian,
        // modulo level 0's slots) lies in the header's block, and past it.
        let (mut near, mut far) = ([0u8; 32], [0u8; 32]);
        near[0] = 1;
        far[0] = LEVEL0_SLOTS as u8 - 10;
        assert!(slot_offset(probe(&near).next().unwrap()) < 4096);
        assert!(slot_offset(probe(&far).next().unwrap()) > 4096);
        for digest in [near, far] {
            let dir = tempfile::tempdir().unwrap();
            let locator = ChunkLocator::open(dir.path()).unwrap();
            locator.note(&digest, &key(1), 0, 10);
            assert!(locator.may_hold_any(), "noted {:?}", &digest[..4]);
        }
    }

    #[test]
    fn a_foreign_file_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(LOCATOR_FILE), b"not a locator").unwrap();
        let locator = ChunkLocator::open(dir.path()).unwrap();
        locator.note(&[4; 32], &key(1), 0, 10);
        assert!(locator.window(&[4; 32]).iter().any(|w| w.1.is_some()));
    }

    /// Notes of one digest replace each other; a full window evicts one
    /// slot and the table never grows.
    #[test]
    fn notes_replace_and_evict_within_the_window() {
        let dir = tempfile::tempdir().unwrap();
        let locator = ChunkLocator::open(dir.path()).unwrap();
        let digest = [9; 32];
        locator.note(&digest, &key(1), 0, 10);
        locator.note(&digest, &key(2), 0, 10);
        let found: Vec<ChunkSlot> = locator
            .window(&digest)
            .into_iter()
            .filter_map(|w| w.1)
            .collect();
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].blob, [2; 32]);
        // Other digests with the same home slots fill the windows, level 0
        // first, then evict in the last level.
        let windows = (PROBE * u64::from(LEVELS)) as usize;
        for k in 0..windows + 3 {
            let mut other = digest;
            other[30..].copy_from_slice(&(k as u16 + 1).to_le_bytes());
            locator.note(&other, &key(3), k as u64, 10);
            if k < PROBE as usize {
                let offset = slot_offset(probe(&other).next().unwrap());
                assert!(offset < 2 * 4096, "level 0 first: {offset}");
            }
        }
        // A window that wraps past a level's last slot is read in two runs.
        let mut wrapped = [5u8; 32];
        let last = LEVEL0_SLOTS << (LEVELS - 1);
        wrapped[..8].copy_from_slice(&(last - 3).to_le_bytes());
        locator.note(&wrapped, &key(4), 0, 10);
        let window = locator.window(&wrapped);
        let slots: Vec<u64> = window.iter().map(|w| w.0).collect();
        assert_eq!(slots, probe(&wrapped).collect::<Vec<_>>());
        let last_base = SLOTS - last;
        assert!(slots.contains(&last_base) && slots.contains(&(SLOTS - 1)));
        assert!(window
            .iter()
            .any(|w| w.1.as_ref().is_some_and(|s| s.digest == wrapped)));
        let len = std::fs::metadata(dir.path().join(LOCATOR_FILE))
            .unwrap()
            .len();
        assert_eq!(len, FILE_LEN);
        let live = locator
            .window(&digest)
            .iter()
            .filter(|w| w.1.is_some())
            .count();
        assert_eq!(live, windows);
    }

    /// Notes fill the file from its start: a few thousand chunks take about
    /// their slots' bytes on disk, not a block each.
    #[test]
    fn notes_are_dense_on_disk() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let locator = ChunkLocator::open(dir.path()).unwrap();
        let n = 2000u32;
        for i in 0..n {
            locator.note(&sha256(&i.to_le_bytes()), &key(1), u64::from(i), 10);
        }
        let found = (0..n)
            .filter(|i| {
                let digest = sha256(&i.to_le_bytes());
                locator
                    .window(&digest)
                    .iter()
                    .any(|w| w.1.as_ref().is_some_and(|s| s.digest == digest))
            })
            .count();
        assert_eq!(found, n as usize, "every note is found");
        let disk = std::fs::metadata(dir.path().join(LOCATOR_FILE))
            .unwrap()
            .blocks()
            * 512;
        let slots = u64::from(n) * SLOT_LEN as u64;
        assert!(disk < 4 * slots, "{disk} B on disk for {slots} B of slots");
    }
}
