//! Serving a lamina image through FUSE: the EROFS metadata read in
//! userspace ([`lamina_format::erofs::Image`]), file bytes read from the
//! data blobs' cache files through each file's chunk table.
//!
//! The image is immutable, so the kernel may cache everything: entries and
//! attributes never time out, file pages and directory listings are kept
//! across opens, symlink targets are cached. The operations are plain
//! methods returning errno values ([`ImageFs::lookup_entry`], ...), so they
//! are tested without a mount; the [`fuser::Filesystem`] impl only adapts.
//!
//! Blobs complete in the cache are read straight from their files. In a
//! lazy mount, a read that touches an incomplete blob first asks the
//! worker for its byte ranges ([`Filler::fill`]) and reads them only once
//! the worker has verified and written them; otherwise the reader gets the
//! worker's errno (EIO), never bytes that were not verified.
//!
//! Passthrough: a daemon running as root with an objects dir hands big
//! files whose blobs are all complete to the kernel (FUSE passthrough): the
//! file's own copy ([`Objects`]) becomes the open file's backing file, so
//! its reads never reach the daemon and overlayfs can stack on the mount.
//! An open never waits for that copy: the first open of such a file is
//! served here while a thread of its own makes (or checks) the object, and
//! opens after it are passed through. Every other file is served here.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs::File;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, UNIX_EPOCH};

use fuser::{
    BackingId, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo,
    InitFlags, KernelConfig, LockOwner, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory,
    ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyXattr, Request,
};
use std::sync::Arc;

use lamina_daemon::bdi::BdiReadahead;
use lamina_daemon::config::write_atomic;
use lamina_daemon::filler::Filler;
use lamina_daemon::holder::Ready;
use lamina_format::erofs::{Chunk, Entry, Image, Inode, Kind, ReadError, Xattr};
use lamina_format::lookup::LookupTable;
use serde::{Deserialize, Serialize};

pub mod frames;
pub mod fusermount;
mod lookups;
mod mapped;
mod misses;
mod objects;
mod passthrough;
mod session;

use lookups::{await_lookup, checked_table};
use mapped::keep_mapped_pages_bounded;
use passthrough::Passthrough;

pub use lookups::LookupLater;
pub use session::{load_config, serve, ServeConfig, DEFAULT_PASSTHROUGH_MIN_SIZE};

use frames::{FrameFill, MetadataFrames};
use objects::Maker;
pub use objects::{Objects, CONTENT_DIR};

/// Most directory entries one readdir call parses: more than a reply
/// buffer holds, and at most a few blocks.
const LISTING_BATCH: usize = 512;

/// Entries and attributes never change: the kernel may keep them for good
/// (a year is "forever" without overflowing the kernel's jiffies).
const FOREVER: Duration = Duration::from_secs(365 * 24 * 3600);

/// One image served through FUSE.
#[derive(Debug)]
pub struct ImageFs {
    image: Image<'static>,
    /// Bytes of the metadata image.
    image_len: usize,
    /// Cache files of the data blobs, in device-table order.
    blobs: Arc<[File]>,
    /// A lazy mount's link to its worker; `None`: every blob is complete.
    filler: Option<Arc<Filler>>,
    /// The image's lookup table: names found with one hash, not a search
    /// of the directory. Unset in images converted before it, and in a lazy
    /// mount until its worker has fetched it ([`LookupLater`]).
    lookup: Arc<OnceLock<LookupTable<'static>>>,
    /// The image may hold extended attributes (else getxattr is answered
    /// EOPNOTSUPP and listxattr ENOSYS, see [`ImageFs::without_xattrs`]).
    xattrs: bool,
    /// The kernel opens directories without asking (FUSE_NO_OPENDIR_SUPPORT):
    /// opendir is answered ENOSYS once, and no later opendir or releasedir
    /// is sent. The kernel's default for such opens keeps the page cache and
    /// the cached listing, as this daemon's opendir would ask.
    no_opendir: bool,
    /// Set when files may be passed through to the kernel.
    passthrough: Option<Passthrough>,
    /// A lazy mount's reads that wait for fills, off the FUSE threads.
    misses: Option<misses::MissPool>,
    stats: Arc<Stats>,
}

/// File handle of an open served by the daemon.
const DAEMON_FH: FileHandle = FileHandle(0);
/// File handle of an open passed through to the kernel.
const PASSTHROUGH_FH: FileHandle = FileHandle(1);

/// What the daemon counts, for its status file.
#[derive(Debug, Default)]
pub struct Stats {
    /// Passthrough was negotiated with the kernel.
    pub passthrough: AtomicBool,
    /// Opens passed through to an object.
    pub passthrough_opens: AtomicU64,
    /// Opens of regular files served by the daemon.
    pub daemon_opens: AtomicU64,
    /// Reads served by the daemon.
    pub daemon_reads: AtomicU64,
    /// Objects made.
    pub objects_created: AtomicU64,
    /// Objects found on disk and not trusted.
    pub objects_rejected: AtomicU64,
    /// getxattr and listxattr requests that reached the daemon.
    pub xattr_requests: AtomicU64,
    /// opendir requests that reached the daemon.
    pub opendir_requests: AtomicU64,
    /// Times the mapped metadata left the resident set (over its budget).
    pub mapped_releases: AtomicU64,
}

impl Stats {
    /// The counters as JSON.
    pub fn to_json(&self) -> serde_json::Value {
        let n = |c: &AtomicU64| c.load(Ordering::Relaxed);
        serde_json::json!({
            "passthrough": self.passthrough.load(Ordering::Relaxed),
            "passthrough_opens": n(&self.passthrough_opens),
            "daemon_opens": n(&self.daemon_opens),
            "daemon_reads": n(&self.daemon_reads),
            "objects_created": n(&self.objects_created),
            "objects_rejected": n(&self.objects_rejected),
            "xattr_requests": n(&self.xattr_requests),
            "opendir_requests": n(&self.opendir_requests),
            "mapped_releases": n(&self.mapped_releases),
        })
    }
}

impl ImageFs {
    /// The filesystem of the metadata image `meta` over the cache files
    /// `blobs` (one per device of the image, in table order), complete
    /// unless a `filler` fills them on demand.
    pub fn new(
        meta: &'static [u8],
        blobs: Vec<File>,
        filler: Option<Arc<Filler>>,
    ) -> Result<Self, ReadError> {
        Self::of_image(Image::new(meta)?, meta.len(), blobs, filler)
    }

    /// [`ImageFs::new`] over metadata still being filled: every byte is
    /// read only once `frames` has written it.
    pub fn filling(
        meta: &'static [u8],
        frames: Arc<FrameFill>,
        blobs: Vec<File>,
        filler: Option<Arc<Filler>>,
    ) -> Result<Self, ReadError> {
        Self::of_image(Image::gated(meta, frames)?, meta.len(), blobs, filler)
    }

    fn of_image(
        image: Image<'static>,
        image_len: usize,
        blobs: Vec<File>,
        filler: Option<Arc<Filler>>,
    ) -> Result<Self, ReadError> {
        if image.devices().len() != blobs.len() {
            return Err(ReadError::Corrupt(format!(
                "{} devices in the image, {} blob files given",
                image.devices().len(),
                blobs.len()
            )));
        }
        let blobs: Arc<[File]> = blobs.into();
        let misses = filler
            .as_ref()
            .map(|f| misses::MissPool::start(blobs.clone(), f.clone()));
        Ok(ImageFs {
            image,
            image_len,
            blobs,
            misses,
            filler,
            lookup: Arc::default(),
            xattrs: true,
            no_opendir: false,
            passthrough: None,
            stats: Arc::default(),
        })
    }

    /// For an image whose tree holds no extended attributes (its manifest
    /// says so): getxattr is answered EOPNOTSUPP, listxattr ENOSYS (the
    /// kernel then answers every later listxattr itself).
    ///
    /// Not ENOSYS for getxattr too: after it the kernel answers a plain
    /// xattr itself, but an ACL with ENODATA, and `ls -l` asks for the ACL
    /// of every file. EOPNOTSUPP it takes as "no ACLs on this filesystem"
    /// and stops asking: a warm `ls -lR` of a million files took 2.4 s
    /// instead of 3.8 s (manual runs). The price is a round trip for a
    /// getxattr from a program that does not remember the answer (the
    /// kernel's look for `security.capability` at each exec).
    pub fn without_xattrs(mut self) -> Self {
        self.xattrs = false;
        self
    }

    /// The blob files this image is served from.
    pub(crate) fn blob_files(&self) -> Arc<[File]> {
        self.blobs.clone()
    }

    /// Lets files of at least `min_size` bytes whose blobs are complete be
    /// passed through to their objects in `objects_dir`, links of the
    /// objects by content in `content_dir` (once the kernel agrees, see
    /// [`Filesystem::init`]). Without a thread to make objects on, every
    /// file is served here.
    pub fn with_passthrough(
        mut self,
        objects_dir: PathBuf,
        content_dir: PathBuf,
        min_size: u64,
    ) -> Self {
        let objects = Arc::new(Objects::new(
            objects_dir,
            content_dir,
            min_size,
            self.stats.clone(),
        ));
        match Maker::start(objects.clone(), self.blobs.clone()) {
            Ok(maker) => {
                self.passthrough = Some(Passthrough {
                    objects,
                    maker,
                    inodes: Mutex::new(HashMap::new()),
                    refused: AtomicBool::new(false),
                })
            }
            Err(e) => tracing::warn!("no passthrough: starting its thread: {e}"),
        }
        self
    }

    /// The daemon's counters.
    pub fn stats(&self) -> Arc<Stats> {
        self.stats.clone()
    }

    fn blob_complete(&self, blob: u32) -> bool {
        self.filler.as_ref().is_none_or(|f| f.blob_complete(blob))
    }

    /// Answers lookups from `table`, the image's lookup table. Its bytes'
    /// digest must have been checked, and the table's binding to this
    /// image (see `lamina_image::artifact::check_lookup_for`): this checks only
    /// its shape and root, so nothing is read in proportion to its size.
    pub fn with_lookup(self, table: &'static [u8]) -> Result<Self, ReadError> {
        let _ = self
            .lookup
            .set(checked_table(table, self.image.root_nid())?);
        Ok(self)
    }

    /// The FUSE inode number of `nid`: the root is 1, as FUSE wants; every
    /// other nid is shifted past it, so no two nids share a number.
    pub fn ino_of(&self, nid: u64) -> u64 {
        if nid == self.image.root_nid() {
            1
        } else {
            nid + 2
        }
    }

    fn nid_of(&self, ino: u64) -> Result<u64, Errno> {
        match ino {
            1 => Ok(self.image.root_nid()),
            0 | 2 => Err(Errno::ENOENT),
            n => Ok(n - 2),
        }
    }

    fn inode(&self, ino: u64) -> Result<Inode<'static>, Errno> {
        let nid = self.nid_of(ino)?;
        self.image.inode(nid).map_err(|e| eio(&e))
    }

    /// The attributes stat shows for `inode`.
    pub fn attr(&self, inode: &Inode<'_>) -> FileAttr {
        let mtime = if inode.mtime >= 0 {
            UNIX_EPOCH + Duration::new(inode.mtime as u64, inode.mtime_nsec.min(999_999_999))
        } else {
            UNIX_EPOCH - Duration::from_secs(inode.mtime.unsigned_abs())
                + Duration::from_nanos(u64::from(inode.mtime_nsec.min(999_999_999)))
        };
        FileAttr {
            ino: INodeNo(self.ino_of(inode.nid)),
            size: inode.size,
            blocks: inode.size.div_ceil(512),
            atime: mtime,
            mtime,
            ctime: mtime,
            crtime: mtime,
            kind: file_type(inode.kind()),
            perm: (inode.mode & 0o7777) as u16,
            nlink: inode.nlink,
            uid: inode.uid,
            gid: inode.gid,
            rdev: inode.encoded_rdev(),
            blksize: 4096,
            flags: 0,
        }
    }

    /// The attributes of inode number `ino`.
    pub fn getattr_of(&self, ino: u64) -> Result<FileAttr, Errno> {
        Ok(self.attr(&self.inode(ino)?))
    }

    /// `name` in directory `parent`: its attributes.
    pub fn lookup_entry(&self, parent: u64, name: &[u8]) -> Result<FileAttr, Errno> {
        let dir = self.inode(parent)?;
        if dir.kind() != Some(Kind::Directory) {
            return Err(Errno::ENOTDIR);
        }
        let nid = match self.lookup.get() {
            // The table holds no `.` and `..` (the kernel resolves them
            // itself; only an NFS export would ask).
            Some(table) if name != b"." && name != b".." => table.lookup(dir.nid, name),
            _ => self
                .image
                .lookup(&dir, name)
                .map_err(|e| eio(&e))?
                .map(|e| e.nid),
        };
        match nid {
            Some(nid) => self.getattr_of(self.ino_of(nid)),
            None => Err(Errno::ENOENT),
        }
    }

    /// A symlink's target.
    pub fn readlink_of(&self, ino: u64) -> Result<Vec<u8>, Errno> {
        let inode = self.inode(ino)?;
        if inode.kind() != Some(Kind::Symlink) {
            return Err(Errno::EINVAL);
        }
        self.image.symlink_target(&inode).map_err(|e| eio(&e))
    }

    /// A directory's entries (`.` and `..` included).
    pub fn entries_of(&self, ino: u64) -> Result<Vec<Entry<'static>>, Errno> {
        let entries = self.entries_at(ino, 0, usize::MAX)?;
        Ok(entries.into_iter().map(|(_, e)| e).collect())
    }

    /// Up to `max` entries of a directory from listing position
    /// `position` on, each with the position after it (the offset FUSE
    /// hands back to resume): a listing read in many calls parses each
    /// block once, not the whole directory per call.
    pub fn entries_at(
        &self,
        ino: u64,
        position: u64,
        max: usize,
    ) -> Result<Vec<(u64, Entry<'static>)>, Errno> {
        let dir = self.inode(ino)?;
        if dir.kind() != Some(Kind::Directory) {
            return Err(Errno::ENOTDIR);
        }
        self.image
            .entries_from(&dir, position, max)
            .map_err(|e| eio(&e))
    }

    /// Blocks of 4 KiB the image spans: its metadata and its blobs.
    fn blocks(&self) -> u64 {
        let data: u64 = self
            .image
            .devices()
            .iter()
            .map(|d| u64::from(d.blocks))
            .sum();
        (self.image_len as u64).div_ceil(4096) + data
    }

    /// Up to `size` bytes of a regular file from `offset`: holes as zeros,
    /// data from the blob cache files (filled first where a lazy mount's
    /// blob is incomplete); short only at the end of the file. `pid` is
    /// the reading process.
    pub fn read_at(&self, ino: u64, offset: u64, size: u32, pid: u32) -> Result<Vec<u8>, Errno> {
        let (nid, len, pieces) = self.plan_read(ino, offset, size)?;
        let filler = self.filler.as_deref();
        misses::fill_and_read(&self.blobs, filler, len, &pieces, pid, nid)
    }

    /// Where a read's bytes are: the inode's nid, the reply's length and
    /// its pieces. Reads metadata only.
    fn plan_read(
        &self,
        ino: u64,
        offset: u64,
        size: u32,
    ) -> Result<(u64, usize, Vec<Piece>), Errno> {
        let inode = self.inode(ino)?;
        if inode.kind() != Some(Kind::Regular) {
            return Err(Errno::EISDIR);
        }
        let end = inode.size.min(offset.saturating_add(u64::from(size)));
        let pieces = self.pieces(&inode, offset, end)?;
        Ok((inode.nid, end.saturating_sub(offset) as usize, pieces))
    }

    /// Whether reading `pieces` may wait for the worker.
    fn may_wait(&self, pieces: &[Piece]) -> bool {
        pieces
            .iter()
            .any(|p| p.data.is_some_and(|(blob, _)| !self.blob_complete(blob)))
    }

    /// Where bytes `[offset, end)` of a regular file are: runs of holes and
    /// of contiguous bytes in one blob, in file order.
    fn pieces(&self, inode: &Inode<'_>, offset: u64, end: u64) -> Result<Vec<Piece>, Errno> {
        let chunks = self.image.chunks(inode).map_err(|e| eio(&e))?;
        let chunk_size = 1u64 << chunks.chunk_bits;
        let mut pieces: Vec<Piece> = Vec::new();
        let mut pos = offset;
        while pos < end {
            let i = (pos / chunk_size) as usize;
            let within = pos % chunk_size;
            let n = (chunk_size - within).min(end - pos) as usize;
            let data = match chunks.get(i) {
                Some(Chunk::Hole) => None,
                Some(Chunk::Data { device, offset: at }) => {
                    let blob = u32::from(device).wrapping_sub(1);
                    if blob as usize >= self.blobs.len() {
                        tracing::error!(nid = inode.nid, device, "chunk names no blob");
                        return Err(Errno::EIO);
                    }
                    Some((blob, at + within))
                }
                None => {
                    tracing::error!(nid = inode.nid, chunk = i, "no chunk for this offset");
                    return Err(Errno::EIO);
                }
            };
            let start = (pos - offset) as usize;
            match pieces.last_mut() {
                Some(last) if last.follows_with(data) => last.len += n,
                _ => pieces.push(Piece {
                    start,
                    len: n,
                    data,
                }),
            }
            pos += n as u64;
        }
        Ok(pieces)
    }

    /// The xattrs of `ino`: full names and values.
    pub fn xattrs_of(&self, ino: u64) -> Result<Vec<Xattr<'static>>, Errno> {
        let inode = self.inode(ino)?;
        self.image.xattrs(&inode).map_err(|e| eio(&e))
    }
}

/// A run of a read: `len` bytes at `start` in the reply, a hole or bytes
/// at `(blob, offset)` in a blob's cache file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Piece {
    pub(crate) start: usize,
    pub(crate) len: usize,
    pub(crate) data: Option<(u32, u64)>,
}

impl Piece {
    /// Whether `next`, the run right after this one, continues it.
    fn follows_with(&self, next: Option<(u32, u64)>) -> bool {
        match (self.data, next) {
            (None, None) => true,
            (Some((b, at)), Some((nb, nat))) => b == nb && at + self.len as u64 == nat,
            _ => false,
        }
    }
}

/// A corrupt or unsupported image is EIO to the reader, with why in the log.
fn eio(e: &ReadError) -> Errno {
    tracing::error!("{e}");
    Errno::EIO
}

fn file_type(kind: Option<Kind>) -> FileType {
    match kind {
        Some(Kind::Directory) => FileType::Directory,
        Some(Kind::Symlink) => FileType::Symlink,
        Some(Kind::CharDevice) => FileType::CharDevice,
        Some(Kind::BlockDevice) => FileType::BlockDevice,
        Some(Kind::Fifo) => FileType::NamedPipe,
        Some(Kind::Socket) => FileType::Socket,
        Some(Kind::Regular) | None => FileType::RegularFile,
    }
}

/// The answer to getxattr/listxattr: the size when asked for 0 bytes,
/// ERANGE when the caller's buffer is too small.
fn reply_sized(reply: ReplyXattr, size: u32, data: &[u8]) {
    if size == 0 {
        reply.size(data.len() as u32);
    } else if (size as usize) < data.len() {
        reply.error(Errno::ERANGE);
    } else {
        reply.data(data);
    }
}

impl Filesystem for ImageFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // Each is only a hint: an older kernel without one still works.
        for flag in [
            InitFlags::FUSE_DO_READDIRPLUS,
            InitFlags::FUSE_READDIRPLUS_AUTO,
            InitFlags::FUSE_CACHE_SYMLINKS,
            InitFlags::FUSE_PARALLEL_DIROPS,
        ] {
            let _ = config.add_capabilities(flag);
        }
        if self.misses.is_some() {
            // Readahead of local data must not queue in the kernel behind
            // readahead waiting on a stalled registry (misses.rs).
            let _ = config.set_max_background(misses::MAX_BACKGROUND);
        }
        // Otherwise every directory listed costs an opendir and a
        // releasedir round trip, the only ones left in a warm `ls -lR`.
        self.no_opendir = config
            .add_capabilities(InitFlags::FUSE_NO_OPENDIR_SUPPORT)
            .is_ok();
        if self.xattrs {
            // The kernel then asks for an inode's ACL once and keeps it (a
            // plain xattr it would ask for at every `ls -l`), and enforces
            // it, as it does on EROFS.
            let _ = config.add_capabilities(InitFlags::FUSE_POSIX_ACL);
        }
        if self.passthrough.is_some() {
            // Depth 1: backing files on a plain filesystem, and overlayfs
            // may still stack on this mount.
            let offered = config.add_capabilities(InitFlags::FUSE_PASSTHROUGH).is_ok()
                && config.set_max_stack_depth(1).is_ok();
            if offered {
                self.stats.passthrough.store(true, Ordering::Relaxed);
                tracing::info!("FUSE passthrough on");
            } else {
                tracing::warn!("the kernel offers no FUSE passthrough; every file served here");
                self.passthrough = None;
            }
        }
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        match self.lookup_entry(parent.0, name.as_bytes()) {
            Ok(attr) => reply.entry(&FOREVER, &attr, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.getattr_of(ino.0) {
            Ok(attr) => reply.attr(&FOREVER, &attr),
            Err(e) => reply.error(e),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        match self.readlink_of(ino.0) {
            Ok(target) => reply.data(&target),
            Err(e) => reply.error(e),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let Some(pt) = &self.passthrough else {
            return self.opened_here(reply);
        };
        match self.nid_of(ino.0) {
            Ok(nid) => self.open_file(pt, nid, reply),
            Err(e) => reply.error(e),
        }
    }

    fn release(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        if fh == DAEMON_FH {
            if let Ok(nid) = self.nid_of(ino.0) {
                self.released_here(nid);
            }
        }
        reply.ok();
    }

    fn read(
        &self,
        req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        self.stats.daemon_reads.fetch_add(1, Ordering::Relaxed);
        let (nid, len, pieces) = match self.plan_read(ino.0, offset, size) {
            Ok(plan) => plan,
            Err(e) => return reply.error(e),
        };
        let filler = self.filler.as_deref();
        if let (Some(pool), true) = (&self.misses, self.may_wait(&pieces)) {
            let pid = req.pid();
            let read = misses::PendingRead {
                len,
                pieces,
                pid,
                nid,
                reply,
            };
            return pool.submit(read, &self.blobs, filler);
        }
        match misses::fill_and_read(&self.blobs, filler, len, &pieces, req.pid(), nid) {
            Ok(bytes) => reply.data(&bytes),
            Err(e) => reply.error(e),
        }
    }

    fn opendir(&self, _req: &Request, _ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        self.stats.opendir_requests.fetch_add(1, Ordering::Relaxed);
        if self.no_opendir {
            return reply.error(Errno::ENOSYS);
        }
        reply.opened(
            FileHandle(0),
            FopenFlags::FOPEN_KEEP_CACHE | FopenFlags::FOPEN_CACHE_DIR,
        );
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let entries = match self.entries_at(ino.0, offset, LISTING_BATCH) {
            Ok(e) => e,
            Err(e) => return reply.error(e),
        };
        for (next, e) in entries {
            let name = OsStr::from_bytes(e.name);
            if reply.add(INodeNo(self.ino_of(e.nid)), next, file_type(e.kind()), name) {
                break;
            }
        }
        reply.ok();
    }

    fn readdirplus(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        let entries = match self.entries_at(ino.0, offset, LISTING_BATCH) {
            Ok(e) => e,
            Err(e) => return reply.error(e),
        };
        for (next, e) in entries {
            let attr = match self.getattr_of(self.ino_of(e.nid)) {
                Ok(a) => a,
                Err(err) => return reply.error(err),
            };
            let name = OsStr::from_bytes(e.name);
            if reply.add(attr.ino, next, name, &FOREVER, &attr, Generation(0)) {
                break;
            }
        }
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        // Read-only: everything is used, nothing is free.
        reply.statfs(self.blocks(), 0, 0, 0, 0, 4096, 255, 4096);
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        self.stats.xattr_requests.fetch_add(1, Ordering::Relaxed);
        if !self.xattrs {
            return reply.error(Errno::EOPNOTSUPP); // see without_xattrs
        }
        match self.xattrs_of(ino.0) {
            Ok(xattrs) => match xattrs.iter().find(|(n, _)| n == name.as_bytes()) {
                Some((_, value)) => reply_sized(reply, size, value),
                None => reply.error(Errno::ENODATA),
            },
            Err(e) => reply.error(e),
        }
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        self.stats.xattr_requests.fetch_add(1, Ordering::Relaxed);
        if !self.xattrs {
            return reply.error(Errno::ENOSYS);
        }
        match self.xattrs_of(ino.0) {
            Ok(xattrs) => {
                let mut names = Vec::new();
                for (n, _) in &xattrs {
                    names.extend_from_slice(n);
                    names.push(0);
                }
                reply_sized(reply, size, &names);
            }
            Err(e) => reply.error(e),
        }
    }
}

/// The bytes of a `sha256:<hex>` digest from a daemon config, if it is one.
pub(crate) fn sha256_digest(s: &str) -> Option<[u8; 32]> {
    lamina_oci::Digest::parse(s).ok().map(|d| d.to_sha256())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mapped::{
        release_due, release_mapped, MAPPED_RSS_ALLOWANCE, MAPPED_RSS_IDLE_CHECKS,
    };
    use crate::session::map_forever;
    use lamina_format::erofs::{write_image, ChunkAddr, Device, FileChunks};
    use lamina_format::object::ObjectRecord;
    use lamina_tree::{DirEntry, Metadata, Node, NodeKind, Tree};
    use std::io::Write;
    use std::os::unix::fs::FileExt;

    fn add(
        t: &mut Tree<FileChunks>,
        dir: usize,
        name: &[u8],
        meta: Metadata,
        kind: NodeKind<FileChunks>,
    ) {
        let id = t.add_node(Node { meta, kind });
        if let NodeKind::Directory { entries } = &mut t.nodes[dir].kind {
            entries.insert(name.to_vec(), DirEntry { node: id, layer: 0 });
        }
    }

    /// Byte `i` of the blob.
    fn blob_byte(i: u64) -> u8 {
        (i * 7 + i / 4096) as u8
    }

    /// An image with a 3-chunk file (4 KiB chunks: data, hole, data tail),
    /// a symlink, a device, xattrs and an old mtime; its blob on disk.
    fn fixture(dir: &Path) -> ImageFs {
        fixture_bytes(dir).0
    }

    fn fixture_bytes(dir: &Path) -> (ImageFs, &'static [u8]) {
        let mut t: Tree<FileChunks> = Tree::new();
        let meta = |mode, mtime| Metadata {
            mode,
            mtime,
            ..Metadata::default()
        };
        let mut m = meta(0o4755, -10);
        m.mtime_nsec = 5;
        m.uid = 1000;
        m.xattrs.insert(b"user.empty".to_vec(), Vec::new());
        m.xattrs.insert(b"user.k".to_vec(), b"value".to_vec());
        let chunks = vec![
            ChunkAddr::Data {
                device: 1,
                blkaddr: 2,
            },
            ChunkAddr::Hole,
            ChunkAddr::Data {
                device: 1,
                blkaddr: 0,
            },
        ];
        let file = NodeKind::Regular {
            size: 2 * 4096 + 100,
            content: FileChunks {
                chunk_bits: 12,
                chunks,
            },
        };
        add(&mut t, 0, b"file", m, file);
        add(
            &mut t,
            0,
            b"link",
            meta(0o777, 1),
            NodeKind::Symlink {
                target: b"file".to_vec(),
            },
        );
        add(
            &mut t,
            0,
            b"null",
            meta(0o666, 1),
            NodeKind::CharDevice { major: 1, minor: 3 },
        );
        add(
            &mut t,
            0,
            b"sub",
            meta(0o700, 1),
            NodeKind::Directory {
                entries: Default::default(),
            },
        );
        let (bytes, _) = write_image(
            &t,
            &[Device {
                tag: "blob".into(),
                blocks: 3,
            }],
        )
        .unwrap();
        let path = dir.join("blob");
        let mut f = File::create(&path).unwrap();
        f.write_all(&(0..3 * 4096).map(blob_byte).collect::<Vec<u8>>())
            .unwrap();
        let bytes: &'static [u8] = Vec::leak(bytes);
        (
            ImageFs::new(bytes, vec![File::open(&path).unwrap()], None).unwrap(),
            bytes,
        )
    }

    #[test]
    fn reads_cross_chunks_holes_and_the_end() {
        let tmp = tempfile::tempdir().unwrap();
        let fs = fixture(tmp.path());
        let file = fs.lookup_entry(1, b"file").unwrap();
        assert_eq!(file.size, 8292);
        let ino = file.ino.0;
        let whole = fs.read_at(ino, 0, 1 << 20, 1).unwrap();
        assert_eq!(whole.len(), 8292, "short only at the end of the file");
        let want: Vec<u8> = (0..4096)
            .map(|i| blob_byte(2 * 4096 + i))
            .chain(std::iter::repeat_n(0, 4096))
            .chain((0..100).map(blob_byte))
            .collect();
        assert!(whole == want);
        // Across the data/hole boundary, and past the end.
        assert_eq!(fs.read_at(ino, 4090, 12, 1).unwrap(), want[4090..4102]);
        assert_eq!(fs.read_at(ino, 8290, 10, 1).unwrap(), want[8290..]);
        assert!(fs.read_at(ino, 9000, 10, 1).unwrap().is_empty());
        assert_eq!(fs.read_at(1, 0, 10, 1), Err(Errno::EISDIR));
    }

    #[test]
    fn attributes_names_and_xattrs() {
        let tmp = tempfile::tempdir().unwrap();
        let fs = fixture(tmp.path());
        let root = fs.getattr_of(1).unwrap();
        assert_eq!(root.kind, FileType::Directory);
        let file = fs.lookup_entry(1, b"file").unwrap();
        assert_eq!(
            (file.perm, file.uid, file.kind),
            (0o4755, 1000, FileType::RegularFile)
        );
        assert_eq!(
            file.mtime,
            UNIX_EPOCH - Duration::from_secs(10) + Duration::from_nanos(5)
        );
        assert_eq!(fs.getattr_of(file.ino.0).unwrap().ino, file.ino);
        let null = fs.lookup_entry(1, b"null").unwrap();
        assert_eq!((null.kind, null.rdev), (FileType::CharDevice, 0x103));
        let link = fs.lookup_entry(1, b"link").unwrap();
        assert_eq!(fs.readlink_of(link.ino.0).unwrap(), b"file");
        assert_eq!(fs.readlink_of(file.ino.0), Err(Errno::EINVAL));
        assert_eq!(fs.lookup_entry(1, b"nope"), Err(Errno::ENOENT));
        assert_eq!(fs.lookup_entry(file.ino.0, b"x"), Err(Errno::ENOTDIR));
        let names: Vec<&[u8]> = fs.entries_of(1).unwrap().iter().map(|e| e.name).collect();
        assert_eq!(names, [&b"."[..], b"..", b"file", b"link", b"null", b"sub"]);
        let sub = fs.lookup_entry(1, b"sub").unwrap();
        let dots = fs.entries_of(sub.ino.0).unwrap();
        assert_eq!(fs.ino_of(dots[1].nid), 1, "the root is inode 1 as `..` too");
        let x = fs.xattrs_of(file.ino.0).unwrap();
        assert_eq!(
            x,
            vec![
                (b"user.empty".to_vec(), &b""[..]),
                (b"user.k".to_vec(), &b"value"[..])
            ]
        );
        assert_eq!(fs.getattr_of(0), Err(Errno::ENOENT));
    }

    /// The fixture's filesystem answering lookups from its lookup table.
    fn fixture_with_table(dir: &Path) -> ImageFs {
        let (fs, meta) = fixture_bytes(dir);
        let table = lamina_format::lookup::build_from_image(meta).unwrap();
        fs.with_lookup(Vec::leak(table)).unwrap()
    }

    #[test]
    fn lookups_through_the_table_answer_as_the_directory_does() {
        let tmp = tempfile::tempdir().unwrap();
        let searched = fixture(tmp.path());
        let hashed = fixture_with_table(tmp.path());
        assert!(hashed.lookup.get().is_some() && searched.lookup.get().is_none());
        let sub = searched.lookup_entry(1, b"sub").unwrap().ino.0;
        let file = searched.lookup_entry(1, b"file").unwrap().ino.0;
        let names: [&[u8]; 9] = [
            b"file", b"link", b"null", b"sub", b"nope", b".", b"..", b"", b"fil",
        ];
        for dir in [1, sub, file, 999_999] {
            for name in names {
                let want = searched.lookup_entry(dir, name).map(|a| a.ino);
                let got = hashed.lookup_entry(dir, name).map(|a| a.ino);
                assert_eq!(got, want, "{dir}/{}", String::from_utf8_lossy(name));
            }
        }
    }

    /// A table fetched after the mount is taken up only once recorded, and
    /// only if built for this metadata: one for other metadata, recorded
    /// all the same, is never used.
    #[test]
    fn a_later_table_is_used_once_recorded_and_bound() {
        let tmp = tempfile::tempdir().unwrap();
        let (fs, meta) = fixture_bytes(tmp.path());
        let table = lamina_format::lookup::build_from_image(meta).unwrap();
        let digest = |b: &[u8]| format!("sha256:{}", hex::encode(sha256_of(b)));
        let later = |name: &str, metadata: &[u8]| LookupLater {
            path: tmp.path().join(name),
            digest: digest(&table),
            metadata_digest: digest(metadata),
        };
        let wait_set = |slot: &Arc<OnceLock<LookupTable<'static>>>| {
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            while slot.get().is_none() && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            slot.get().is_some()
        };
        let bound = later("bound", meta);
        await_lookup(bound.clone(), fs.lookup.clone(), fs.image.root_nid());
        std::fs::write(&bound.path, &table).unwrap();
        std::thread::sleep(Duration::from_millis(300));
        assert!(fs.lookup.get().is_none(), "taken up before its record");
        let file = File::open(&bound.path).unwrap();
        lamina_fetch::store::record_whole(&file, &bound.path, &sha256_of(&table)).unwrap();
        assert!(wait_set(&fs.lookup), "not taken up once recorded");
        assert!(fs.lookup_entry(1, b"file").is_ok());

        let other = later("other", b"some other metadata");
        let slot = Arc::new(OnceLock::new());
        std::fs::write(&other.path, &table).unwrap();
        let file = File::open(&other.path).unwrap();
        lamina_fetch::store::record_whole(&file, &other.path, &sha256_of(&table)).unwrap();
        await_lookup(other, slot.clone(), fs.image.root_nid());
        assert!(
            !wait_set(&slot),
            "a table built for other metadata was used"
        );
    }

    fn sha256_of(bytes: &[u8]) -> [u8; 32] {
        let d = ring::digest::digest(&ring::digest::SHA256, bytes);
        d.as_ref().try_into().unwrap()
    }

    /// The fixture with passthrough for every size, objects in `dir`;
    /// its file's nid and inode number.
    fn passthrough_fixture(dir: &Path) -> (ImageFs, u64, u64) {
        passthrough_fixture_in(dir, &dir.join("objects/content"))
    }

    /// [`passthrough_fixture`] with its objects by content in `content`.
    fn passthrough_fixture_in(dir: &Path, content: &Path) -> (ImageFs, u64, u64) {
        let fs = fixture(dir).with_passthrough(dir.join("objects/meta"), content.into(), 0);
        let ino = fs.lookup_entry(1, b"file").unwrap().ino.0;
        let nid = fs.nid_of(ino).unwrap();
        (fs, nid, ino)
    }

    impl ImageFs {
        /// The trusted object of file `nid`, checked or made now.
        fn backing_file(&self, nid: u64) -> std::io::Result<Option<File>> {
            let Some((size, pieces)) = self.passthrough_pieces(nid)? else {
                return Ok(None);
            };
            objects(self)
                .backing(nid, size, &pieces, &self.blobs)
                .map(Some)
        }

        /// What `open` would pass file `nid` through to now.
        fn object_at_open(&self, nid: u64) -> Option<File> {
            self.ready_object(self.passthrough.as_ref().unwrap(), nid)
        }
    }

    /// Waits (at most 10 s) for `counter` to reach `n`.
    fn await_stat(fs: &ImageFs, counter: fn(&Stats) -> &AtomicU64, n: u64) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while stat(fs, counter) < n {
            assert!(
                std::time::Instant::now() < deadline,
                "counter stuck below {n}"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Released, the mapped image pages leave the resident set (and are
    /// counted), and the image reads the same.
    #[test]
    fn mapped_pages_are_released() {
        let tmp = tempfile::tempdir().unwrap();
        let (_, heap) = fixture_bytes(tmp.path());
        // Mapped from a file, as the daemon maps it.
        std::fs::write(tmp.path().join("meta"), heap).unwrap();
        let meta = map_forever(&tmp.path().join("meta")).unwrap();
        let blob = File::open(tmp.path().join("blob")).unwrap();
        let fs = ImageFs::new(meta, vec![blob], None).unwrap();
        let sum = |b: &[u8]| b.iter().map(|&x| u64::from(x)).sum::<u64>();
        let before = sum(meta);
        let after = release_mapped(&fs.stats).unwrap();
        assert_eq!(stat(&fs, |s| &s.mapped_releases), 1);
        assert!(after > 0, "the binary's own pages stay resident");
        assert_eq!(sum(meta), before, "the metadata reads the same");
        assert!(fs.lookup_entry(1, b"file").is_ok());
    }

    /// Busy, the daemon releases only past the allowance; idle, anything
    /// mapped since the last release goes.
    #[test]
    fn mapped_pages_go_past_the_allowance_or_when_idle() {
        let mark = 8 << 20;
        let busy = 0;
        assert!(!release_due(mark, mark, busy));
        assert!(!release_due(mark + MAPPED_RSS_ALLOWANCE, mark, busy));
        assert!(release_due(mark + MAPPED_RSS_ALLOWANCE + 4096, mark, busy));
        let idle = MAPPED_RSS_IDLE_CHECKS;
        assert!(!release_due(mark + 4096, mark, idle - 1), "not idle yet");
        assert!(release_due(mark + 4096, mark, idle));
        assert!(!release_due(mark, mark, idle), "nothing mapped since");
        assert!(
            !release_due(mark - 4096, mark, idle),
            "fewer pages than at the mark"
        );
    }

    #[test]
    fn an_open_never_waits_for_its_object() {
        let tmp = tempfile::tempdir().unwrap();
        let (fs, nid, ino) = passthrough_fixture(tmp.path());
        let want = fs.read_at(ino, 0, 1 << 20, 1).unwrap();
        assert!(
            fs.object_at_open(nid).is_none(),
            "no object yet: served here"
        );
        await_stat(&fs, |s| &s.objects_created, 1);
        // The maker marks the object trusted right after counting it.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let object = loop {
            if let Some(object) = fs.object_at_open(nid) {
                break object;
            }
            assert!(std::time::Instant::now() < deadline, "object never ready");
            std::thread::sleep(Duration::from_millis(5));
        };
        let mut got = vec![0; want.len()];
        object.read_exact_at(&mut got, 0).unwrap();
        assert!(got == want, "the object's bytes");
        assert_eq!(stat(&fs, |s| &s.objects_created), 1, "made once");

        // A new daemon checks the object on disk before its first use, in
        // the background too; a bad one is made anew there.
        let (fresh, _, _) = passthrough_fixture(tmp.path());
        let (path, _) = objects(&fs).paths(nid);
        let writer = std::fs::OpenOptions::new().write(true).open(path).unwrap();
        writer.write_all_at(&[want[0] ^ 1], 0).unwrap();
        assert!(fresh.object_at_open(nid).is_none(), "not checked yet");
        await_stat(&fresh, |s| &s.objects_created, 1);
        // The image's name of it, then the content object: one inode.
        assert_eq!(stat(&fresh, |s| &s.objects_rejected), 2);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while fresh.object_at_open(nid).is_none() {
            assert!(std::time::Instant::now() < deadline, "object never ready");
            std::thread::sleep(Duration::from_millis(5));
        }
        // Small files are never queued.
        let small = fixture(tmp.path()).with_passthrough(
            tmp.path().join("o2"),
            tmp.path().join("c2"),
            8293,
        );
        assert!(small.object_at_open(nid).is_none());
        std::thread::sleep(Duration::from_millis(100));
        assert!(
            !tmp.path().join("o2").exists(),
            "a small file got an object"
        );
    }

    fn objects(fs: &ImageFs) -> &Objects {
        &fs.passthrough.as_ref().unwrap().objects
    }

    fn stat(fs: &ImageFs, counter: fn(&Stats) -> &AtomicU64) -> u64 {
        counter(&fs.stats).load(Ordering::Relaxed)
    }

    fn sha256(bytes: &[u8]) -> Vec<u8> {
        ring::digest::digest(&ring::digest::SHA256, bytes)
            .as_ref()
            .to_vec()
    }

    #[test]
    fn an_object_holds_the_files_bytes_with_its_holes() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let (fs, nid, ino) = passthrough_fixture(tmp.path());
        let want = fs.read_at(ino, 0, 1 << 20, 1).unwrap();
        let object = fs.backing_file(nid).unwrap().expect("an object");
        let mut got = vec![0; want.len()];
        object.read_exact_at(&mut got, 0).unwrap();
        assert!(got == want, "the object's bytes differ from the file's");
        assert_eq!(object.metadata().unwrap().len(), 8292);
        // Chunk 1 (4096..8192) is a hole in the image: none in the object.
        let data = rustix::fs::seek(&object, rustix::fs::SeekFrom::Data(4096)).unwrap();
        assert_eq!(data, 8192, "the hole was written");

        let (path, record_path) = objects(&fs).paths(nid);
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&path), 0o600);
        assert_eq!(mode(path.parent().unwrap()), 0o700);
        let record = ObjectRecord::from_bytes(&std::fs::read(&record_path).unwrap()).unwrap();
        assert_eq!(record.size, 8292);
        assert_eq!(record.content_sha256.to_vec(), sha256(&want));
        let id = lamina_fetch::store::identity(&object).unwrap().unwrap();
        assert_eq!(record.file, id, "the record names the object");
        assert_eq!(stat(&fs, |s| &s.objects_created), 1);

        // Opened again, it is the same object, not made anew.
        let again = fs.backing_file(nid).unwrap().unwrap();
        assert_eq!(lamina_fetch::store::identity(&again).unwrap(), Some(id));
        assert_eq!(stat(&fs, |s| &s.objects_created), 1);
        // Smaller than the minimum: served by the daemon, no object.
        let small = fixture(tmp.path()).with_passthrough(
            tmp.path().join("o2"),
            tmp.path().join("c2"),
            8293,
        );
        assert!(small.backing_file(nid).unwrap().is_none());
        assert!(!tmp.path().join("o2").exists());
    }

    /// Issue 43: two images with the same bytes in a file, each in blobs
    /// of its own (a rebuild), pass it through to one object: one copy on
    /// disk and one in the page cache.
    #[test]
    fn images_with_the_same_bytes_share_one_object() {
        let tmp = tempfile::tempdir().unwrap();
        let content = tmp.path().join("content");
        let (dir_a, dir_r) = (tmp.path().join("a"), tmp.path().join("r"));
        std::fs::create_dir_all(&dir_a).unwrap();
        std::fs::create_dir_all(&dir_r).unwrap();
        let (a, nid, ino) = passthrough_fixture_in(&dir_a, &content);
        let (r, nid_r, _) = passthrough_fixture_in(&dir_r, &content);
        let want = a.read_at(ino, 0, 1 << 20, 1).unwrap();
        let object_a = a.backing_file(nid).unwrap().unwrap();
        let object_r = r.backing_file(nid_r).unwrap().unwrap();
        let id = |f: &File| lamina_fetch::store::identity(f).unwrap().unwrap();
        assert_eq!(id(&object_a), id(&object_r), "one object for both images");
        assert_eq!(stat(&a, |s| &s.objects_created), 1);
        assert_eq!(stat(&r, |s| &s.objects_created), 0, "R linked A's");
        let (object, record) = objects(&a).content_paths(&sha256(&want).try_into().unwrap());
        let links = std::os::unix::fs::MetadataExt::nlink(&std::fs::metadata(&object).unwrap());
        assert_eq!(links, 3, "content, A, R");
        assert!(record.exists());
        let mut got = vec![0; want.len()];
        object_r.read_exact_at(&mut got, 0).unwrap();
        assert!(got == want, "R's object holds the file's bytes");

        // A content object whose bytes were changed is not linked: R
        // makes a good one (and A, checking again, finds the bad bytes).
        std::fs::create_dir_all(tmp.path().join("f")).unwrap();
        let (fresh, nid_f, _) = passthrough_fixture_in(&tmp.path().join("f"), &content);
        std::fs::OpenOptions::new()
            .write(true)
            .open(&object)
            .unwrap()
            .write_all_at(&[want[0] ^ 1], 0)
            .unwrap();
        let made = fresh.backing_file(nid_f).unwrap().unwrap();
        made.read_exact_at(&mut got, 0).unwrap();
        assert!(got == want, "the new object's bytes");
        assert_eq!(stat(&fresh, |s| &s.objects_rejected), 1);
        assert_eq!(stat(&fresh, |s| &s.objects_created), 1);
        assert_ne!(id(&made), id(&object_a), "made anew");
    }

    #[test]
    fn a_tampered_object_is_not_trusted() {
        for what in ["bytes changed", "record of another file", "wrong size"] {
            let tmp = tempfile::tempdir().unwrap();
            let (fs, nid, ino) = passthrough_fixture(tmp.path());
            let want = fs.read_at(ino, 0, 1 << 20, 1).unwrap();
            let object = fs.backing_file(nid).unwrap().unwrap();
            let size = want.len() as u64;
            match what {
                "bytes changed" => object.write_all_at(&[want[0] ^ 1], 0).unwrap(),
                "record of another file" => {
                    // A record of the same bytes, naming another file.
                    let (path, record_path) = objects(&fs).paths(nid);
                    let other = tmp.path().join("other");
                    std::fs::copy(&path, &other).unwrap();
                    let record = ObjectRecord {
                        file: lamina_fetch::store::identity(&File::open(&other).unwrap())
                            .unwrap()
                            .unwrap(),
                        size,
                        content_sha256: sha256(&want).try_into().unwrap(),
                    };
                    std::fs::write(record_path, record.to_bytes()).unwrap();
                }
                _ => object.set_len(size + 1).unwrap(),
            }
            // A daemon that has not checked it yet.
            let (fresh, _, _) = passthrough_fixture(tmp.path());
            let e = objects(&fresh).open_verified(nid, size).unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::InvalidData, "{what}: {e}");
            // Opening the file replaces it with a good one.
            let made = fresh.backing_file(nid).unwrap().unwrap();
            let mut got = vec![0; want.len()];
            made.read_exact_at(&mut got, 0).unwrap();
            assert!(got == want, "{what}: the new object's bytes");
            assert_eq!(made.metadata().unwrap().len(), size, "{what}");
            // Changed bytes or size are the content object's too (one
            // inode): it is made anew. A bad record is the image's link's
            // alone: the content object is linked again.
            let (rejected, created) = match what {
                "record of another file" => (1, 0),
                _ => (2, 1),
            };
            assert_eq!(stat(&fresh, |s| &s.objects_rejected), rejected, "{what}");
            assert_eq!(stat(&fresh, |s| &s.objects_created), created, "{what}");
            assert!(objects(&fresh).open_verified(nid, size).unwrap().is_some());
        }
    }

    #[test]
    fn a_table_of_another_shape_or_root_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let (fs, meta) = fixture_bytes(tmp.path());
        let mut table = lamina_format::lookup::build_from_image(meta).unwrap();
        table.truncate(table.len() - 1);
        assert!(fs.with_lookup(Vec::leak(table)).is_err(), "a short table");
        let (fs, meta) = fixture_bytes(tmp.path());
        let image = Image::new(meta).unwrap();
        let entries = lamina_format::lookup::BuildEntry {
            parent: image.root_nid() + 1,
            name: b"x",
            child: 5,
            is_dir: false,
        };
        let other_root = lamina_format::lookup::build(
            image.root_nid() + 1,
            [0; 32],
            [entries],
            &Default::default(),
            1,
        )
        .unwrap();
        assert!(
            fs.with_lookup(Vec::leak(other_root)).is_err(),
            "a table of another root"
        );
    }

    #[test]
    fn a_record_bound_to_a_replaced_file_is_not_trusted() {
        let tmp = tempfile::tempdir().unwrap();
        let (fs, nid, _) = passthrough_fixture(tmp.path());
        let object = fs.backing_file(nid).unwrap().unwrap();
        let size = object.metadata().unwrap().len();
        // Same bytes, same size, the record untouched: another file.
        let (path, _) = objects(&fs).paths(nid);
        let copy = tmp.path().join("copy");
        std::fs::copy(&path, &copy).unwrap();
        std::fs::rename(&copy, &path).unwrap();
        for (who, fs) in [
            ("this daemon", &fs),
            ("a new one", &passthrough_fixture(tmp.path()).0),
        ] {
            let e = objects(fs).open_verified(nid, size).unwrap_err();
            assert!(e.to_string().contains("another file"), "{who}: {e}");
        }
    }

    #[test]
    fn device_count_must_match() {
        let tmp = tempfile::tempdir().unwrap();
        let (_, meta) = fixture_bytes(tmp.path());
        assert!(matches!(
            ImageFs::new(meta, Vec::new(), None),
            Err(ReadError::Corrupt(_))
        ));
    }
}
