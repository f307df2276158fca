//! Objects: one file's bytes in a file of their own, for FUSE passthrough.
//!
//! Passthrough maps a FUSE file onto a backing file from offset 0, but an
//! image file's bytes are chunks inside per-blob cache files; so a file
//! passed through gets its own copy, an object, at `<dir>/<nid>`, with its
//! record (`lamina_format::object`) at `<dir>/<nid>.record`. An object is
//! made only from blobs that are complete in the cache (verified), copied
//! in the kernel (`copy_file_range`: a reflink where the filesystem can)
//! with holes left as holes, and hashed once written.
//!
//! Objects are kept by content: the file's bytes are hashed from the blobs
//! first, and the object is `<content>/<sha256>` (made there when no
//! trusted one is), hard-linked as `<dir>/<nid>`, where `<content>` is the
//! trust domain's (`objects/content/<domain>`, see `lamina_mount`). Every
//! image of one trust domain with the same bytes in a file, whatever layer
//! or blob they came in, is passed through to the same inode: one copy on
//! disk and one in the page cache. An object's link count is its users:
//! gc removes a content object once no image's dir links it.
//!
//! Trust: an object found on disk is used only after this process checked
//! it once: its record names that very file (inode and birth time), the
//! size is the inode's, and its bytes hash to the record's digest. Then the
//! nid is remembered with the file's identity for this process's life.
//! Anything else is removed and made anew; when that fails too, the caller
//! serves the file itself.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc, Mutex};

use lamina_fetch::private;
use lamina_fetch::store::identity;
use lamina_format::fill::FileIdentity;
use lamina_format::object::ObjectRecord;
use ring::digest::{Context, SHA256};

use crate::{Piece, Stats};

/// Bytes hashed or copied per step.
const STEP: usize = 1 << 20;

/// The dir of content objects in a cache's `objects/`.
pub const CONTENT_DIR: &str = "content";

/// The objects of one image, under `<cache>/objects/<metadata-layer-hex>`.
#[derive(Debug)]
pub struct Objects {
    dir: PathBuf,
    /// The objects by the sha256 of their bytes, one trust domain's.
    content: PathBuf,
    min_size: u64,
    /// Objects this process checked or made: nid -> the object's identity.
    trusted: Mutex<HashMap<u64, FileIdentity>>,
    /// Content objects this process checked or made, by sha256.
    trusted_content: Mutex<HashMap<[u8; 32], FileIdentity>>,
    stats: Arc<Stats>,
}

impl Objects {
    /// The objects in `dir`, links of those by content in `content`, for
    /// files of at least `min_size` bytes, counted in `stats`.
    pub fn new(dir: PathBuf, content: PathBuf, min_size: u64, stats: Arc<Stats>) -> Objects {
        Objects {
            dir,
            content,
            min_size,
            trusted: Mutex::new(HashMap::new()),
            trusted_content: Mutex::new(HashMap::new()),
            stats,
        }
    }

    /// Files smaller than this are served by the daemon.
    pub fn min_size(&self) -> u64 {
        self.min_size
    }

    /// Paths of the object of `nid` and of its record.
    pub fn paths(&self, nid: u64) -> (PathBuf, PathBuf) {
        (
            self.dir.join(nid.to_string()),
            self.dir.join(format!("{nid}.record")),
        )
    }

    /// Paths of the content object of bytes hashing to `sha256` and of its
    /// record.
    pub fn content_paths(&self, sha256: &[u8; 32]) -> (PathBuf, PathBuf) {
        let hex = hex::encode(sha256);
        (
            self.content.join(&hex),
            self.content.join(format!("{hex}.record")),
        )
    }

    /// The object of `nid` if this process checked or made it already and
    /// it is still that file: no hashing, one open.
    pub(crate) fn open_known(&self, nid: u64) -> Option<File> {
        let known = *self.lock().get(&nid)?;
        let file = private::open_trusted(&self.paths(nid).0).ok()?;
        (identity(&file).ok()?? == known).then_some(file)
    }

    /// The trusted object of file `nid` (`size` bytes at `pieces` in the
    /// complete blob files `blobs`), checked or made here.
    pub(crate) fn backing(
        &self,
        nid: u64,
        size: u64,
        pieces: &[Piece],
        blobs: &[File],
    ) -> io::Result<File> {
        self.found_or_made(
            &format!("object of nid {nid}"),
            || self.open_verified(nid, size),
            || self.remove(nid),
            || self.create(nid, size, pieces, blobs),
        )
    }

    /// What `open` finds, when it is trusted; else `make`s it (an untrusted
    /// one `remove`d first), or, when another process made it first,
    /// checks theirs.
    fn found_or_made<T>(
        &self,
        what: &str,
        open: impl Fn() -> io::Result<Option<T>>,
        remove: impl FnOnce(),
        make: impl FnOnce() -> io::Result<T>,
    ) -> io::Result<T> {
        match open() {
            Ok(Some(found)) => return Ok(found),
            Ok(None) => {}
            Err(why) => {
                self.stats.objects_rejected.fetch_add(1, Ordering::Relaxed);
                tracing::warn!("{what} not trusted, making it anew: {why}");
                remove();
            }
        }
        match make() {
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                open()?.ok_or_else(|| io::Error::other(format!("{what} vanished while made")))
            }
            other => other,
        }
    }

    /// The object of `nid` if it exists and is trusted; `Ok(None)` if
    /// there is none; `Err(why)` if there is one that is not trusted.
    pub(crate) fn open_verified(&self, nid: u64, size: u64) -> io::Result<Option<File>> {
        let (path, record_path) = self.paths(nid);
        let known = self.lock().get(&nid).copied();
        let Some((file, record)) = checked(&path, &record_path, size, known)? else {
            return Ok(None);
        };
        self.lock().insert(nid, record.file);
        Ok(Some(file))
    }

    /// The content object of bytes hashing to `sha256` if it exists and is
    /// trusted (as [`Objects::open_verified`]), with its record.
    fn open_content(
        &self,
        sha256: &[u8; 32],
        size: u64,
    ) -> io::Result<Option<(File, ObjectRecord)>> {
        let (path, record_path) = self.content_paths(sha256);
        let known = self.lock_content().get(sha256).copied();
        let Some((file, record)) = checked(&path, &record_path, size, known)? else {
            return Ok(None);
        };
        if record.content_sha256 != *sha256 {
            return Err(untrusted("its record is of other bytes"));
        }
        self.lock_content().insert(*sha256, record.file);
        Ok(Some((file, record)))
    }

    /// Links the content object of the file's bytes (checked, or made
    /// here) as the object of `nid`, without replacing one that appeared
    /// meanwhile (AlreadyExists).
    fn create(&self, nid: u64, size: u64, pieces: &[Piece], blobs: &[File]) -> io::Result<File> {
        let sha256 = hash_pieces(pieces, blobs)?;
        let (file, record) = self.content_object(&sha256, size, pieces, blobs)?;
        private::private_dir(&self.dir)?;
        let (path, record_path) = self.paths(nid);
        let tmp = private::temp_name(&path, "tmp");
        let linked = (|| {
            link_file(&file, &tmp)?;
            rename_noreplace(&tmp, &path)?;
            private::write_atomic(&record_path, &record.to_bytes(), true)
        })();
        let _ = std::fs::remove_file(&tmp);
        linked?;
        self.lock().insert(nid, record.file);
        Ok(file)
    }

    /// The trusted content object of bytes hashing to `sha256`: one found
    /// and checked, else made from the pieces (an untrusted one is removed
    /// first).
    fn content_object(
        &self,
        sha256: &[u8; 32],
        size: u64,
        pieces: &[Piece],
        blobs: &[File],
    ) -> io::Result<(File, ObjectRecord)> {
        self.found_or_made(
            &format!("content object {}", hex::encode(sha256)),
            || self.open_content(sha256, size),
            || self.remove_content(sha256),
            || self.make_content(sha256, size, pieces, blobs),
        )
    }

    /// Makes the content object under a temp name, then moves it into
    /// place without replacing one that appeared meanwhile (AlreadyExists).
    fn make_content(
        &self,
        sha256: &[u8; 32],
        size: u64,
        pieces: &[Piece],
        blobs: &[File],
    ) -> io::Result<(File, ObjectRecord)> {
        private::private_dir(&self.content)?;
        let (path, record_path) = self.content_paths(sha256);
        let tmp = private::temp_name(&path, "tmp");
        let tmp_record = private::temp_name(&record_path, "tmp");
        let made = (|| -> io::Result<(File, ObjectRecord)> {
            let file = private::create_new(&tmp)?;
            copy_pieces(&file, size, pieces, blobs)?;
            // What the copy holds, not what was meant to be copied.
            if hash_file(&file, size)? != *sha256 {
                return Err(untrusted("the copy's bytes differ from the blobs'"));
            }
            file.sync_all()?;
            // Its pages, clean now, would be a second copy of what the
            // open that asked for it reads through the daemon; a later
            // passed-through open reads them from disk once.
            let _ = rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::DontNeed);
            let id = identity(&file)?.ok_or_else(|| untrusted("no birth time to bind to"))?;
            let record = ObjectRecord {
                file: id,
                size,
                content_sha256: *sha256,
            };
            private::write_atomic(&tmp_record, &record.to_bytes(), true)?;
            rename_noreplace(&tmp, &path)?;
            std::fs::rename(&tmp_record, &record_path)?;
            Ok((file, record))
        })();
        let _ = std::fs::remove_file(&tmp);
        let _ = std::fs::remove_file(&tmp_record);
        let (file, record) = made?;
        self.lock_content().insert(*sha256, record.file);
        self.stats.objects_created.fetch_add(1, Ordering::Relaxed);
        Ok((file, record))
    }

    /// Removes the content object of `sha256` and its record.
    fn remove_content(&self, sha256: &[u8; 32]) {
        self.lock_content().remove(sha256);
        let (path, record_path) = self.content_paths(sha256);
        let _ = std::fs::remove_file(path);
        let _ = std::fs::remove_file(record_path);
    }

    /// Removes the object of `nid` and its record (either may be missing).
    fn remove(&self, nid: u64) {
        self.lock().remove(&nid);
        let (path, record_path) = self.paths(nid);
        let _ = std::fs::remove_file(path);
        let _ = std::fs::remove_file(record_path);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, FileIdentity>> {
        self.trusted.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn lock_content(&self) -> std::sync::MutexGuard<'_, HashMap<[u8; 32], FileIdentity>> {
        self.trusted_content
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }
}

/// The object at `path` with its record at `record_path`, if there is one
/// and it is trusted: the record names that very file, the size is
/// `size`, and its bytes hash to the record's digest (not hashed again
/// when it is the file `known`, checked by this process). `Ok(None)`: no
/// object; `Err(why)`: one that is not trusted.
fn checked(
    path: &Path,
    record_path: &Path,
    size: u64,
    known: Option<FileIdentity>,
) -> io::Result<Option<(File, ObjectRecord)>> {
    let file = match private::open_trusted(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let id = identity(&file)?.ok_or_else(|| untrusted("no birth time to bind to"))?;
    let record = private::read_trusted(record_path)?;
    let record = ObjectRecord::from_bytes(&record).map_err(|e| untrusted(&e.to_string()))?;
    if record.file != id {
        return Err(untrusted("its record describes another file"));
    }
    if record.size != size || file.metadata()?.len() != size {
        return Err(untrusted("size differs from the image's file"));
    }
    if known != Some(id) && hash_file(&file, size)? != record.content_sha256 {
        return Err(untrusted("content differs from its record"));
    }
    Ok(Some((file, record)))
}

/// Gives `file` the name `to` too (a hard link by fd: it is the file
/// checked, whatever its path names now).
fn link_file(file: &File, to: &Path) -> io::Result<()> {
    use rustix::fs::{linkat, AtFlags, CWD};
    linkat(file, "", CWD, to, AtFlags::EMPTY_PATH).map_err(io::Error::from)
}

/// A file whose object is wanted: `size` bytes at `pieces`.
struct Job {
    nid: u64,
    size: u64,
    pieces: Vec<Piece>,
}

/// Makes or checks objects on a thread of its own, one at a time, so an
/// open never waits for a copy or a hash of a whole file: the open that
/// asks is served by the daemon, and a later one is passed through.
#[derive(Debug)]
pub(crate) struct Maker {
    jobs: mpsc::Sender<Job>,
    /// Nids asked for and not done yet: each is queued once.
    pending: Arc<Mutex<HashSet<u64>>>,
}

impl Maker {
    /// Starts the thread; it ends when the maker is dropped.
    pub(crate) fn start(objects: Arc<Objects>, blobs: Arc<[File]>) -> io::Result<Maker> {
        let (jobs, queue) = mpsc::channel::<Job>();
        let pending: Arc<Mutex<HashSet<u64>>> = Arc::default();
        let done = pending.clone();
        std::thread::Builder::new()
            .name("lamina-objects".into())
            .spawn(move || {
                for job in queue {
                    match objects.backing(job.nid, job.size, &job.pieces, &blobs) {
                        Ok(_) => tracing::debug!(nid = job.nid, "object ready"),
                        Err(e) => tracing::warn!(nid = job.nid, "no object: {e}"),
                    }
                    done.lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .remove(&job.nid);
                }
            })?;
        Ok(Maker { jobs, pending })
    }

    /// Queues the object of `nid` unless it is queued already.
    pub(crate) fn request(&self, nid: u64, size: u64, pieces: Vec<Piece>) {
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        if pending.insert(nid) && self.jobs.send(Job { nid, size, pieces }).is_err() {
            pending.remove(&nid);
        }
    }
}

fn untrusted(why: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, why.to_string())
}

/// The sha256 of the file's bytes at `pieces` in `blobs`, holes as zeros.
fn hash_pieces(pieces: &[Piece], blobs: &[File]) -> io::Result<[u8; 32]> {
    let mut hash = Context::new(&SHA256);
    let zeros = vec![0u8; STEP];
    let mut buf = vec![0u8; STEP];
    for piece in pieces {
        match piece.data {
            None => {
                for n in steps(piece.len as u64) {
                    hash.update(&zeros[..n]);
                }
            }
            Some((blob, at)) => {
                let blob = &blobs[blob as usize];
                let mut pos = at;
                for n in steps(piece.len as u64) {
                    blob.read_exact_at(&mut buf[..n], pos)?;
                    hash.update(&buf[..n]);
                    pos += n as u64;
                }
            }
        }
    }
    Ok(digest_bytes(hash))
}

/// Writes the file's `size` bytes into `out`: each data piece copied in
/// the kernel from its blob file, holes left unwritten (sparse).
fn copy_pieces(out: &File, size: u64, pieces: &[Piece], blobs: &[File]) -> io::Result<()> {
    out.set_len(size)?;
    for piece in pieces {
        if let Some((blob, at)) = piece.data {
            let blob = &blobs[blob as usize];
            copy_range(blob, at, out, piece.start as u64, piece.len as u64)?;
        }
    }
    Ok(())
}

/// `len` bytes from `from` at `from_at` to `to` at `to_at`, in the kernel.
fn copy_range(from: &File, from_at: u64, to: &File, to_at: u64, len: u64) -> io::Result<()> {
    let (mut src, mut dst, mut left) = (from_at, to_at, len);
    while left > 0 {
        let n = rustix::fs::copy_file_range(
            from,
            Some(&mut src),
            to,
            Some(&mut dst),
            left.min(1 << 30) as usize,
        )?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "blob cache file shorter than its chunks",
            ));
        }
        left -= n as u64;
    }
    Ok(())
}

/// The sha256 of the first `size` bytes of `file`.
fn hash_file(file: &File, size: u64) -> io::Result<[u8; 32]> {
    let mut hash = Context::new(&SHA256);
    let mut buf = vec![0u8; STEP];
    let mut pos = 0;
    for n in steps(size) {
        file.read_exact_at(&mut buf[..n], pos)?;
        hash.update(&buf[..n]);
        pos += n as u64;
    }
    Ok(digest_bytes(hash))
}

/// Lengths of the steps that cover `len` bytes.
fn steps(len: u64) -> impl Iterator<Item = usize> {
    let step = STEP as u64;
    (0..len.div_ceil(step)).map(move |i| (len - i * step).min(step) as usize)
}

fn digest_bytes(hash: Context) -> [u8; 32] {
    let mut out = [0u8; 32];
    out.copy_from_slice(hash.finish().as_ref());
    out
}

/// Renames `from` to `to` unless `to` exists (then AlreadyExists).
fn rename_noreplace(from: &Path, to: &Path) -> io::Result<()> {
    use rustix::fs::{renameat_with, RenameFlags, CWD};
    renameat_with(CWD, from, CWD, to, RenameFlags::NOREPLACE).map_err(io::Error::from)
}
