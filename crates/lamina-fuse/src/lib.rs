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

use std::ffi::OsStr;
use std::fs::File;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, UNIX_EPOCH};

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, InitFlags,
    KernelConfig, LockOwner, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyDirectoryPlus,
    ReplyEntry, ReplyOpen, ReplyStatfs, ReplyXattr, Request,
};
use std::sync::Arc;

use lamina_daemon::config::write_atomic;
use lamina_daemon::filler::Filler;
use lamina_daemon::holder::Ready;
use lamina_format::erofs::{Chunk, Entry, Image, Inode, Kind, ReadError, Xattr};
use lamina_format::lookup::LookupTable;
use serde::{Deserialize, Serialize};

pub mod fusermount;

/// Entries and attributes never change: the kernel may keep them for good
/// (a year is "forever" without overflowing the kernel's jiffies).
const FOREVER: Duration = Duration::from_secs(365 * 24 * 3600);

/// One image served through FUSE.
#[derive(Debug)]
pub struct ImageFs {
    image: Image<'static>,
    /// Cache files of the data blobs, in device-table order.
    blobs: Vec<File>,
    /// A lazy mount's link to its worker; `None`: every blob is complete.
    filler: Option<Arc<Filler>>,
    /// The image's lookup table: names found with one hash, not a search
    /// of the directory. `None` in images converted before it.
    lookup: Option<LookupTable<'static>>,
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
        let image = Image::new(meta)?;
        if image.devices().len() != blobs.len() {
            return Err(ReadError::Corrupt(format!(
                "{} devices in the image, {} blob files given",
                image.devices().len(),
                blobs.len()
            )));
        }
        Ok(ImageFs {
            image,
            blobs,
            filler,
            lookup: None,
        })
    }

    /// Answers lookups from `table`, the image's lookup table. Its bytes'
    /// digest must have been checked, and the table's binding to this
    /// image (see `lamina_image::artifact::check_lookup`): this checks only
    /// its shape and root, so nothing is read in proportion to its size.
    pub fn with_lookup(mut self, table: &'static [u8]) -> Result<Self, ReadError> {
        let table = LookupTable::parse_without_digest(table)
            .map_err(|e| ReadError::Corrupt(format!("lookup table: {e}")))?;
        if table.root_nid() != self.image.root_nid() {
            return Err(ReadError::Corrupt(format!(
                "lookup table: root nid {}, the image's is {}",
                table.root_nid(),
                self.image.root_nid()
            )));
        }
        self.lookup = Some(table);
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
        let nid = match &self.lookup {
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
        let dir = self.inode(ino)?;
        if dir.kind() != Some(Kind::Directory) {
            return Err(Errno::ENOTDIR);
        }
        self.image.entries(&dir).map_err(|e| eio(&e))
    }

    /// Up to `size` bytes of a regular file from `offset`: holes as zeros,
    /// data from the blob cache files (filled first where a lazy mount's
    /// blob is incomplete); short only at the end of the file. `pid` is
    /// the reading process.
    pub fn read_at(&self, ino: u64, offset: u64, size: u32, pid: u32) -> Result<Vec<u8>, Errno> {
        let inode = self.inode(ino)?;
        if inode.kind() != Some(Kind::Regular) {
            return Err(Errno::EISDIR);
        }
        let end = inode.size.min(offset.saturating_add(u64::from(size)));
        let mut out = vec![0; end.saturating_sub(offset) as usize];
        for piece in self.pieces(&inode, offset, end)? {
            let Some((blob, at)) = piece.data else {
                continue; // a hole reads as zeros
            };
            let into = &mut out[piece.start..piece.start + piece.len];
            if let Some(filler) = &self.filler {
                filler
                    .fill(blob, at, piece.len as u64, pid as i32)
                    .map_err(|errno| {
                        tracing::error!(
                            nid = inode.nid,
                            blob,
                            at,
                            "lazy read failed: errno {errno}"
                        );
                        Errno::from_i32(errno)
                    })?;
            }
            self.blobs[blob as usize]
                .read_exact_at(into, at)
                .map_err(|e| {
                    tracing::error!(nid = inode.nid, blob, "reading the blob cache: {e}");
                    Errno::EIO
                })?;
        }
        Ok(out)
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
struct Piece {
    start: usize,
    len: usize,
    data: Option<(u32, u64)>,
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

    fn open(&self, _req: &Request, _ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        reply.opened(FileHandle(0), FopenFlags::FOPEN_KEEP_CACHE);
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
        match self.read_at(ino.0, offset, size, req.pid()) {
            Ok(bytes) => reply.data(&bytes),
            Err(e) => reply.error(e),
        }
    }

    fn opendir(&self, _req: &Request, _ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
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
        let entries = match self.entries_of(ino.0) {
            Ok(e) => e,
            Err(e) => return reply.error(e),
        };
        for (i, e) in entries.iter().enumerate().skip(offset as usize) {
            let name = OsStr::from_bytes(e.name);
            if reply.add(
                INodeNo(self.ino_of(e.nid)),
                i as u64 + 1,
                file_type(e.kind()),
                name,
            ) {
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
        let entries = match self.entries_of(ino.0) {
            Ok(e) => e,
            Err(e) => return reply.error(e),
        };
        for (i, e) in entries.iter().enumerate().skip(offset as usize) {
            let attr = match self.getattr_of(self.ino_of(e.nid)) {
                Ok(a) => a,
                Err(err) => return reply.error(err),
            };
            let name = OsStr::from_bytes(e.name);
            if reply.add(attr.ino, i as u64 + 1, name, &FOREVER, &attr, Generation(0)) {
                break;
            }
        }
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        reply.statfs(0, 0, 0, 0, 0, 4096, 255, 4096);
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        match self.xattrs_of(ino.0) {
            Ok(xattrs) => match xattrs.iter().find(|(n, _)| n == name.as_bytes()) {
                Some((_, value)) => reply_sized(reply, size, value),
                None => reply.error(Errno::ENODATA),
            },
            Err(e) => reply.error(e),
        }
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
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

/// What the FUSE daemon serves, written by `lamina mount --mode fuse`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ServeConfig {
    /// The verified EROFS metadata image.
    pub metadata_path: PathBuf,
    /// Its lookup table, verified and checked to be built for it; `None`
    /// for images converted before lookup tables.
    #[serde(default)]
    pub lookup_path: Option<PathBuf>,
    /// Complete blob cache files, in device-table order.
    pub blob_paths: Vec<PathBuf>,
    /// Where to mount.
    pub mountpoint: PathBuf,
    /// A lazy mount: the worker's config (its blobs are filled on demand
    /// by a worker started from it). `None`: the blobs are complete.
    #[serde(default)]
    pub worker_config: Option<PathBuf>,
    /// Threads serving requests.
    pub threads: usize,
    /// Written (atomically) once mounted or when mounting failed: the same
    /// `ready` file as a lazy mount's holder writes.
    pub ready_path: PathBuf,
}

/// The FUSE daemon: mounts `config`'s image and serves it until unmounted.
pub fn serve(config: &ServeConfig) -> std::io::Result<()> {
    let _ = rustix::process::setsid();
    // As the holder: the mount dies with this process, so a stray SIGTERM
    // must not take it; it ends when the filesystem is unmounted.
    lamina_sys::ignore_termination_signals()?;
    let report = |error: Option<String>| {
        let ready = Ready {
            pid: std::process::id(),
            error,
        };
        let bytes = serde_json::to_vec(&ready).map_err(std::io::Error::other)?;
        write_atomic(&config.ready_path, &bytes)
    };
    // Without root, fusermount3 mounts first and hands over /dev/fuse.
    let rootless_fd = if is_root() {
        None
    } else {
        match fusermount::mount(&config.mountpoint, ROOTLESS_OPTIONS) {
            Ok(fd) => Some(fd),
            Err(e) => {
                report(Some(e.to_string()))?;
                return Err(e);
            }
        }
    };
    let rootless = rootless_fd.is_some();
    let undo_mount = || {
        if rootless {
            let _ = std::process::Command::new("fusermount3")
                .arg("-u")
                .arg(&config.mountpoint)
                .status();
        }
    };
    let filler = match &config.worker_config {
        Some(path) => match Filler::start(path) {
            Ok(f) => Some(Arc::new(f)),
            Err(e) => {
                undo_mount();
                let e = format!("starting the worker: {e}");
                report(Some(e.clone()))?;
                return Err(std::io::Error::other(e));
            }
        },
        None => None,
    };
    let session = match open_session(config, filler.clone(), rootless_fd) {
        Ok(s) => s,
        Err(e) => {
            undo_mount();
            if let Some(f) = &filler {
                f.shutdown();
            }
            report(Some(e.clone()))?;
            return Err(std::io::Error::other(e));
        }
    };
    report(None)?;
    tracing::info!(
        mountpoint = %config.mountpoint.display(),
        lazy = filler.is_some(),
        "serving through FUSE"
    );
    let served = session.run();
    tracing::info!("unmounted; exiting");
    if let Some(f) = &filler {
        // The worker saves its fill records before it exits.
        f.shutdown();
    }
    served
}

/// What fusermount3 mounts a rootless FUSE mount with (it adds nosuid and
/// nodev itself).
const ROOTLESS_OPTIONS: &str = "ro,fsname=lamina,subtype=lamina,default_permissions";

/// The session serving `config`'s image: on `fuse_fd` when fusermount3 has
/// mounted it already, else mounted here.
fn open_session(
    config: &ServeConfig,
    filler: Option<Arc<Filler>>,
    fuse_fd: Option<std::os::fd::OwnedFd>,
) -> Result<fuser::Session<ImageFs>, String> {
    // Mapped, not read: the daemon serves this one image for its whole
    // life, and touches only the pages lookups and reads need.
    let meta = map_forever(&config.metadata_path)?;
    let blobs = config
        .blob_paths
        .iter()
        .map(|p| File::open(p).map_err(|e| format!("{}: {e}", p.display())))
        .collect::<Result<Vec<_>, _>>()?;
    let mut fs = ImageFs::new(meta, blobs, filler).map_err(|e| e.to_string())?;
    if let Some(path) = &config.lookup_path {
        let table = map_forever(path)?;
        fs = fs
            .with_lookup(table)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        tracing::info!(bytes = table.len(), "lookups through the lookup table");
    }
    let fuse = fuse_config(config.threads);
    match fuse_fd {
        Some(fd) => fuser::Session::from_fd(fs, fd, fuse.acl, fuse),
        None => fuser::Session::new(fs, &config.mountpoint, &fuse),
    }
    .map_err(|e| format!("FUSE mount at {}: {e}", config.mountpoint.display()))
}

/// The file at `path`, mapped read-only for the daemon's life.
fn map_forever(path: &Path) -> Result<&'static [u8], String> {
    File::open(path)
        .and_then(|f| lamina_sys::map_file_forever(&f))
        .map_err(|e| format!("{}: {e}", path.display()))
}

fn fuse_config(threads: usize) -> fuser::Config {
    use fuser::MountOption as O;
    let mut c = fuser::Config::default();
    c.mount_options = vec![
        O::RO,
        O::FSName("lamina".into()),
        O::Subtype("lamina".into()),
        // The kernel checks permissions from the modes it is given.
        O::DefaultPermissions,
    ];
    if is_root() {
        // A container's root filesystem: setuid binaries and device nodes
        // work, and every user (a container's) may read it.
        c.mount_options.extend([O::Suid, O::Dev]);
        c.acl = fuser::SessionACL::All;
    } else {
        // Rootless (mounted by fusermount3): only the mounting user, and
        // the user namespaces it owns, read it; allow_other would need
        // user_allow_other in /etc/fuse.conf.
        c.acl = fuser::SessionACL::Owner;
    }
    c.n_threads = Some(threads.max(1));
    c.clone_fd = true;
    c
}

fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

/// Reads a daemon config written by the mounting command.
pub fn load_config(path: &Path) -> std::io::Result<ServeConfig> {
    let bytes = std::fs::read(path)?;
    serde_json::from_slice(&bytes).map_err(std::io::Error::other)
}

#[cfg(test)]
mod tests {
    use super::*;
    use lamina_format::erofs::{write_image, ChunkAddr, Device, FileChunks};
    use lamina_tree::{DirEntry, Metadata, Node, NodeKind, Tree};
    use std::io::Write;

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
        assert!(hashed.lookup.is_some() && searched.lookup.is_none());
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
    fn device_count_must_match() {
        let tmp = tempfile::tempdir().unwrap();
        let (_, meta) = fixture_bytes(tmp.path());
        assert!(matches!(
            ImageFs::new(meta, Vec::new(), None),
            Err(ReadError::Corrupt(_))
        ));
    }
}
