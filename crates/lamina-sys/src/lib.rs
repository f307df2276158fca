//! The syscall boundary: fanotify pre-content events (Linux 6.14+).
//!
//! A pre-content group gets a `FAN_PRE_ACCESS` event before any read of a
//! marked file reaches its page cache, with the byte range about to be read.
//! The listener fills the range by writing through the event's own fd (which
//! the kernel opened with `FMODE_NONOTIFY`, so the write raises no event) and
//! then answers allow, or deny with an errno. Only `fanotify_init` and
//! `fanotify_mark` need `unsafe`; reading events and writing responses go
//! through rustix, and event records are parsed as plain bytes
//! ([`parse_events`], pure) before [`FanotifyGroup::read_events`] takes
//! ownership of the fds they name.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

pub mod cgroup;
pub mod idmap;
pub mod mountinfo;
mod quiet;
/// The path of `file`'s own fd, `/proc/self/fd/N`: opening it, marking it
/// or mounting it reaches that very inode, whatever its name now names.
pub fn fd_path(file: &impl std::os::fd::AsRawFd) -> std::path::PathBuf {
    std::path::PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()))
}

/// This very binary, for starting lamina's own daemons: `/proc/self/exe`
/// names the file this process runs even after it was replaced (an upgrade)
/// or removed (a build dir cleaned), so a holder always restarts its worker
/// from the binary it speaks the protocol of, and never strands a reader
/// for want of a path.
pub const OWN_BINARY: &str = "/proc/self/exe";

pub use quiet::{lock_range, open_quiet, try_lock_range, unlock_range};

/// `FAN_CLASS_PRE_CONTENT`.
const FAN_CLASS_PRE_CONTENT: u32 = 0x08;
/// `FAN_CLOEXEC`.
const FAN_CLOEXEC: u32 = 0x01;
/// `FAN_UNLIMITED_QUEUE`: a burst of misses must not overflow the queue.
const FAN_UNLIMITED_QUEUE: u32 = 0x10;
/// `FAN_MARK_ADD`.
const FAN_MARK_ADD: u32 = 0x01;
/// `FAN_MARK_REMOVE`.
const FAN_MARK_REMOVE: u32 = 0x02;
/// `FAN_PRE_ACCESS` (uapi `linux/fanotify.h`, 6.14).
pub const FAN_PRE_ACCESS: u64 = 0x0010_0000;
/// `FAN_ALLOW`.
const FAN_ALLOW: u32 = 0x01;
/// `FAN_DENY`; with an errno in the top byte (`FAN_DENY_ERRNO`) since 6.14.
const FAN_DENY: u32 = 0x02;
/// `FAN_EVENT_INFO_TYPE_RANGE`.
const INFO_TYPE_RANGE: u8 = 6;
/// `FANOTIFY_METADATA_VERSION`.
const METADATA_VERSION: u8 = 3;
/// `sizeof(struct fanotify_event_metadata)`.
const METADATA_LEN: usize = 24;

/// A fanotify group of class pre-content.
#[derive(Debug)]
pub struct FanotifyGroup {
    fd: OwnedFd,
}

/// One event read from the group.
#[derive(Debug)]
pub struct Event {
    /// The event's file, opened by the kernel without notification: fill
    /// through it. `None` for queue overflow events.
    pub file: Option<OwnedFd>,
    /// The fd number the response must name (the event fd in the reading
    /// process's table when it was read).
    pub response_fd: RawFd,
    /// Event mask.
    pub mask: u64,
    /// Reading process.
    pub pid: i32,
    /// Byte range about to be read (offset, count), if reported.
    pub range: Option<(u64, u64)>,
}

/// An answer to a permission event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Response {
    /// Let the read proceed.
    Allow,
    /// Fail the read with this errno (e.g. `libc::EIO`).
    DenyErrno(i32),
}

/// A new fanotify group of class and flags `flags`, whose event fds are
/// opened read-write.
pub(crate) fn fanotify_init(flags: u32) -> io::Result<OwnedFd> {
    let event_f_flags = (libc::O_RDWR | libc::O_LARGEFILE | libc::O_CLOEXEC) as u32;
    // SAFETY: fanotify_init takes two integer flag words and returns a new
    // fd or -1; no memory is passed.
    let fd = unsafe { libc::fanotify_init(flags, event_f_flags) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd was just returned by fanotify_init and is owned by no one else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `fanotify_mark(group, flags, mask, AT_FDCWD, path)`.
pub(crate) fn fanotify_mark(
    group: BorrowedFd<'_>,
    flags: u32,
    mask: u64,
    path: &Path,
) -> io::Result<()> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains NUL"))?;
    // SAFETY: the group fd is valid for the call, c is a valid NUL-terminated
    // string that outlives it, AT_FDCWD is a valid dirfd.
    let rc =
        unsafe { libc::fanotify_mark(group.as_raw_fd(), flags, mask, libc::AT_FDCWD, c.as_ptr()) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

impl FanotifyGroup {
    /// Creates a pre-content group whose event fds are opened read-write.
    pub fn new() -> io::Result<Self> {
        let fd = fanotify_init(FAN_CLASS_PRE_CONTENT | FAN_CLOEXEC | FAN_UNLIMITED_QUEUE)?;
        Ok(FanotifyGroup { fd })
    }

    /// Wraps a group fd received from another process.
    pub fn from_fd(fd: OwnedFd) -> Self {
        FanotifyGroup { fd }
    }

    fn mark(&self, flags: u32, path: &Path) -> io::Result<()> {
        fanotify_mark(self.fd.as_fd(), flags, FAN_PRE_ACCESS, path)
    }

    /// Asks for pre-access events on reads of `path` (a regular file).
    /// Fails with EINVAL on kernels or filesystems without pre-content support.
    pub fn watch(&self, path: &Path) -> io::Result<()> {
        self.mark(FAN_MARK_ADD, path)
    }

    /// Stops watching `path`: reads of it no longer reach userspace.
    pub fn unwatch(&self, path: &Path) -> io::Result<()> {
        self.mark(FAN_MARK_REMOVE, path)
    }

    /// Blocks until events arrive and returns them.
    pub fn read_events(&self, buf: &mut Vec<u8>) -> io::Result<Vec<Event>> {
        buf.resize(64 * 1024, 0);
        let n = loop {
            match rustix::io::read(&self.fd, &mut buf[..]) {
                Ok(n) => break n,
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
            }
        };
        let mut events = Vec::new();
        for record in parse_events(&buf[..n]) {
            let record = record?;
            let file = if record.fd >= 0 {
                // SAFETY: the kernel installed this fd in our table for this
                // event and nothing else owns it; each record is read once, so
                // ownership is taken exactly once.
                Some(unsafe { OwnedFd::from_raw_fd(record.fd) })
            } else {
                None
            };
            events.push(Event {
                file,
                response_fd: record.fd,
                mask: record.mask,
                pid: record.pid,
                range: record.range,
            });
        }
        Ok(events)
    }

    /// Answers the event whose response fd is `fd`.
    pub fn respond(&self, fd: RawFd, response: Response) -> io::Result<()> {
        let code = match response {
            Response::Allow => FAN_ALLOW,
            Response::DenyErrno(errno) => FAN_DENY | (((errno as u32) & 0xff) << 24),
        };
        let mut msg = [0u8; 8];
        msg[..4].copy_from_slice(&fd.to_ne_bytes());
        msg[4..].copy_from_slice(&code.to_ne_bytes());
        let n = rustix::io::write(&self.fd, &msg)?;
        if n != msg.len() {
            return Err(io::Error::other("short fanotify response write"));
        }
        Ok(())
    }

    /// The group fd, e.g. to pass to another process.
    pub fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// One event record as the kernel wrote it, before anyone owns its fd.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawEvent {
    /// The event fd's number in the reading process's table (negative, e.g.
    /// `FAN_NOFD`, for queue overflow events). Only a record the kernel just
    /// wrote names an fd that this process may take ownership of.
    pub fd: RawFd,
    /// Event mask.
    pub mask: u64,
    /// Reading process.
    pub pid: i32,
    /// Byte range about to be read (offset, count), if reported.
    pub range: Option<(u64, u64)>,
}

/// Parses the event records of one `read` of a fanotify group: plain bytes
/// in, records out, no fd touched. Yields an error for a malformed record and
/// nothing after it; trailing bytes too short for a record are ignored.
pub fn parse_events(buf: &[u8]) -> EventRecords<'_> {
    EventRecords { buf, failed: false }
}

/// Iterator over event records; see [`parse_events`].
#[derive(Debug, Clone)]
pub struct EventRecords<'a> {
    buf: &'a [u8],
    failed: bool,
}

impl Iterator for EventRecords<'_> {
    type Item = io::Result<RawEvent>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed || self.buf.len() < METADATA_LEN {
            return None;
        }
        let record = parse_record(self.buf);
        match &record {
            Ok((_, event_len)) => self.buf = &self.buf[*event_len..],
            Err(_) => self.failed = true,
        }
        Some(record.map(|(event, _)| event))
    }
}

/// Parses the record at the start of `buf` (at least [`METADATA_LEN`] bytes
/// long) and returns it with its length.
fn parse_record(buf: &[u8]) -> io::Result<(RawEvent, usize)> {
    let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidData, format!("fanotify: {what}"));
    let u32_at = |b: &[u8], at: usize| u32::from_ne_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
    let event_len = u32_at(buf, 0) as usize;
    let vers = buf[4];
    let metadata_len = u16::from_ne_bytes([buf[6], buf[7]]) as usize;
    if vers != METADATA_VERSION {
        return Err(bad("unexpected metadata version"));
    }
    if event_len < METADATA_LEN
        || event_len > buf.len()
        || metadata_len < METADATA_LEN
        || metadata_len > event_len
    {
        return Err(bad("malformed event length"));
    }
    let mut mask_bytes = [0u8; 8];
    mask_bytes.copy_from_slice(&buf[8..16]);
    let mask = u64::from_ne_bytes(mask_bytes);
    let fd = u32_at(buf, 16) as i32;
    let pid = u32_at(buf, 20) as i32;
    let mut range = None;
    let mut info = &buf[metadata_len..event_len];
    while info.len() >= 4 {
        let info_type = info[0];
        let len = u16::from_ne_bytes([info[2], info[3]]) as usize;
        if len < 4 || len > info.len() {
            return Err(bad("malformed info record"));
        }
        if info_type == INFO_TYPE_RANGE && len >= 24 {
            let mut o = [0u8; 8];
            let mut c = [0u8; 8];
            o.copy_from_slice(&info[8..16]);
            c.copy_from_slice(&info[16..24]);
            range = Some((u64::from_ne_bytes(o), u64::from_ne_bytes(c)));
        }
        info = &info[len..];
    }
    Ok((
        RawEvent {
            fd,
            mask,
            pid,
            range,
        },
        event_len,
    ))
}

/// Whether this process is root of the host: uid 0 in the initial user
/// namespace, whose uid map is the identity over every uid. Root inside a
/// user namespace (`podman unshare`, `unshare --map-root-user`) may mount
/// FUSE there, but not EROFS, register FUSE backing files, or write the
/// host's /var/lib.
pub fn is_host_root() -> bool {
    rustix::process::geteuid().is_root() && in_initial_user_namespace()
}

/// Whether this process is in the initial user namespace.
pub fn in_initial_user_namespace() -> bool {
    std::fs::read_to_string("/proc/self/uid_map").is_ok_and(|map| is_identity_uid_map(&map))
}

/// Whether `map` (a `/proc/PID/uid_map`) is the initial namespace's: one
/// line mapping 0 to 0 for all 2^32 - 1 uids.
fn is_identity_uid_map(map: &str) -> bool {
    let lines: Vec<Vec<&str>> = map
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    lines == [["0", "0", "4294967295"]]
}

/// Maps the whole of `file` read-only for the rest of the process's life
/// (a daemon serving one image): the pages are read as they are touched,
/// so nothing is read in proportion to the file's size up front. An empty
/// file maps to an empty slice.
///
/// The caller must only map files nobody truncates while the process
/// lives, and whose bytes never change once read: lamina's cache files of
/// metadata and lookup tables are written once under a temporary name and
/// renamed into place, and are private to their owner. The one exception,
/// a lazy FUSE mount's metadata, is a sparse file that this process fills
/// a frame at a time, each range written once and before anything reads it
/// (`lamina_fuse::frames`); other writers of that file write the same
/// bytes.
pub fn map_file_forever(file: &std::fs::File) -> io::Result<&'static [u8]> {
    let len = usize::try_from(file.metadata()?.len()).map_err(io::Error::other)?;
    if len == 0 {
        return Ok(&[]);
    }
    let addr = map_read_only(file, len)?;
    mapped_files().push((addr as usize, len));
    // SAFETY: `addr` is a fresh private read-only mapping of `len` bytes.
    // It is never unmapped, so the slice may live for 'static; no byte
    // changes once read (see above), so the bytes under the slice that are
    // read never change.
    Ok(unsafe { std::slice::from_raw_parts(addr.cast::<u8>(), len) })
}

/// A file mapped read-only for as long as the value lives: for bytes read
/// once (a check before a mount) by a process that lives on (the
/// snapshotter), where [`map_file_forever`] would keep every mapping.
#[derive(Debug)]
pub struct MappedFile {
    addr: *mut libc::c_void,
    len: usize,
}

impl MappedFile {
    /// Maps all of `file`, which must not change while mapped (a verified
    /// cache file, renamed into place once and private to its owner).
    pub fn map(file: &std::fs::File) -> io::Result<MappedFile> {
        let len = usize::try_from(file.metadata()?.len()).map_err(io::Error::other)?;
        let addr = match len {
            0 => std::ptr::null_mut(),
            _ => map_read_only(file, len)?,
        };
        Ok(MappedFile { addr, len })
    }

    /// The file's bytes.
    pub fn bytes(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `addr` is a private read-only mapping of `len` bytes,
        // unmapped only when `self` is dropped, which the borrow outlives
        // not; the file does not change while mapped (see `map`).
        unsafe { std::slice::from_raw_parts(self.addr.cast::<u8>(), self.len) }
    }
}

impl Drop for MappedFile {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: unmaps exactly the mapping `map` made, which no
            // slice outlives (they borrow `self`).
            unsafe { libc::munmap(self.addr, self.len) };
        }
    }
}

// SAFETY: the mapping is read-only and owned by the value; sharing or
// moving it between threads shares or moves only reads of it.
unsafe impl Send for MappedFile {}
// SAFETY: as above: `&MappedFile` gives only reads.
unsafe impl Sync for MappedFile {}

/// A fresh private read-only mapping of the first `len` bytes of `file`.
fn map_read_only(file: &std::fs::File, len: usize) -> io::Result<*mut libc::c_void> {
    // SAFETY: maps `len` bytes of an open file at an address the kernel
    // picks; no existing memory is touched.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_PRIVATE,
            file.as_raw_fd(),
            0,
        )
    };
    if addr == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(addr)
}

/// Largest write [`write_all_at_in_pieces`] makes.
pub const MAPPED_WRITE_PIECE: usize = 64 << 10;

/// Writes all of `bytes` at `offset` of `file`, in writes of at most
/// [`MAPPED_WRITE_PIECE`] bytes: for files that a daemon maps
/// ([`map_file_forever`]). Linux sizes a page-cache folio after the write
/// that creates it (ext4 since 6.16, like XFS before it), and a fault in a
/// mapping maps the whole folio: on 6.18, a file written in 1 MiB writes
/// costs a MiB of resident set per byte touched, one written in 64 KiB
/// writes 64 KiB (the kernel's default fault-around maps as much anyway).
/// A lookup that touches three places of a 37 MB lookup table then adds
/// some 200 KiB, not 10 MiB, to the daemon's resident set. Costs a syscall
/// per 64 KiB, which the copy into the page cache outweighs.
pub fn write_all_at_in_pieces(file: &std::fs::File, bytes: &[u8], offset: u64) -> io::Result<()> {
    use std::os::unix::fs::FileExt;
    let mut at = offset;
    for piece in bytes.chunks(MAPPED_WRITE_PIECE) {
        file.write_all_at(piece, at)?;
        at += piece.len() as u64;
    }
    Ok(())
}

/// [`write_all_at_in_pieces`] for a writer without offsets (a stream into
/// a file): all of `bytes`, in writes of at most [`MAPPED_WRITE_PIECE`].
pub fn write_all_in_pieces(out: &mut (impl io::Write + ?Sized), bytes: &[u8]) -> io::Result<()> {
    bytes
        .chunks(MAPPED_WRITE_PIECE)
        .try_for_each(|piece| out.write_all(piece))
}

/// The mappings [`map_file_forever`] made: (address, length).
fn mapped_files() -> std::sync::MutexGuard<'static, Vec<(usize, usize)>> {
    static MAPPED: std::sync::Mutex<Vec<(usize, usize)>> = std::sync::Mutex::new(Vec::new());
    MAPPED.lock().unwrap_or_else(|e| e.into_inner())
}

/// Drops every page of the files [`map_file_forever`] mapped from this
/// process's page tables (they stay in the page cache): the next touch of
/// one maps it again, a minor fault. So a daemon that has read through a
/// big metadata image does not keep all of it in its resident set.
pub fn release_mapped_files() -> io::Result<()> {
    for &(addr, len) in mapped_files().iter() {
        // SAFETY: (addr, len) is a whole read-only private mapping of a
        // file, made by `map_file_forever` and never unmapped. Its pages
        // are never written (PROT_READ), so none is a private copy: after
        // MADV_DONTNEED a touch reads the file's page again, the same
        // bytes (none changes once read), and every slice over
        // the mapping stays valid.
        let done = unsafe { libc::madvise(addr as *mut libc::c_void, len, libc::MADV_DONTNEED) };
        if done != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Allocations of at least this many bytes get a mapping of their own
/// (see [`unmap_big_allocations_on_free`]).
pub const OWN_MAPPING_MIN: usize = 1 << 20;

/// Makes the C allocator give every allocation of at least
/// [`OWN_MAPPING_MIN`] bytes a mapping of its own, unmapped when it is
/// freed. By default glibc raises that threshold (to up to 32 MiB) each
/// time such a block is freed, and blocks under it are then carved from
/// heaps that are seldom returned: a mount daemon fetching 16 MiB chunks
/// kept 170-270 MB of anonymous memory after reading a 2 GiB image whole,
/// and 5 MB with this. Setting the threshold also fixes glibc's trim
/// threshold. Elsewhere than glibc, nothing to do.
pub fn unmap_big_allocations_on_free() -> io::Result<()> {
    #[cfg(target_env = "gnu")]
    {
        let bytes = OWN_MAPPING_MIN as libc::c_int;
        // SAFETY: mallopt only changes the allocator's tuning, under its
        // own lock; blocks already allocated are freed as they were made.
        if unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, bytes) } != 1 {
            return Err(io::Error::other("mallopt(M_MMAP_THRESHOLD) refused"));
        }
    }
    Ok(())
}

/// Runs the calling thread, and the threads it starts after this, only
/// when no other thread wants its CPU (`SCHED_IDLE`): for background work
/// that must never delay a request or the workload the mount serves.
pub fn run_this_thread_when_idle() -> io::Result<()> {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: pid 0 is the calling thread; `param` is a valid sched_param
    // that the kernel only reads.
    if unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Gives the calling thread's I/O the idle class (`ioprio_set`,
/// `IOPRIO_CLASS_IDLE`): its reads and writes go to the disk only when no
/// other I/O waits. For prefetching, which must not slow the workload.
pub fn do_io_when_idle() -> io::Result<()> {
    const IOPRIO_WHO_PROCESS: libc::c_long = 1;
    const IOPRIO_CLASS_IDLE: libc::c_long = 3;
    const IOPRIO_CLASS_SHIFT: u32 = 13;
    // SAFETY: ioprio_set takes three integers; who = 0 is the calling
    // thread. No memory is passed.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_ioprio_set,
            IOPRIO_WHO_PROCESS,
            0,
            IOPRIO_CLASS_IDLE << IOPRIO_CLASS_SHIFT,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The calling thread's I/O priority class (`ioprio_get`): 0 none (the
/// default, from its CPU niceness), 1 realtime, 2 best effort, 3 idle.
pub fn io_class() -> io::Result<u32> {
    // SAFETY: as in `do_io_when_idle`: integers only.
    let rc = unsafe { libc::syscall(libc::SYS_ioprio_get, 1 as libc::c_long, 0 as libc::c_long) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(u32::try_from(rc >> 13).unwrap_or(0))
}

/// This process's resident pages that are mapped from files (its binary,
/// libraries and [`map_file_forever`]'s mappings), in bytes: the
/// `shared` field of `/proc/self/statm`.
pub fn resident_file_bytes() -> io::Result<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm")?;
    let pages: u64 = statm
        .split_whitespace()
        .nth(2)
        .and_then(|f| f.parse().ok())
        .ok_or_else(|| io::Error::other(format!("/proc/self/statm: {statm:?}")))?;
    // SAFETY: sysconf has no memory effects.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    Ok(pages * u64::try_from(page).unwrap_or(4096))
}

/// Makes SIGTERM, SIGINT, SIGHUP and SIGPIPE no-ops for this process.
///
/// The holder of a fanotify group must not die of a stray signal: when the
/// group's last fd closes, the kernel lets every pending and later read of an
/// unfilled range through as zeros.
pub fn ignore_termination_signals() -> io::Result<()> {
    for sig in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP, libc::SIGPIPE] {
        // SAFETY: SIG_IGN installs no handler code; signal() only changes this
        // process's disposition for a valid signal number.
        let prev = unsafe { libc::signal(sig, libc::SIG_IGN) };
        if prev == libc::SIG_ERR {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// `FS_IOC_GETFSSYSFSPATH` (Linux 6.10): `_IOR(0x15, 1, struct fs_sysfs_path)`.
const FS_IOC_GETFSSYSFSPATH: libc::c_ulong = 0x8081_1501;

/// `struct fs_sysfs_path` of `linux/fs.h`.
#[repr(C)]
struct FsSysfsPath {
    len: u8,
    name: [u8; 128],
}

/// The sysfs name of the filesystem `fd` lives on, such as `erofs/erofs-12`
/// (its last part also names the superblock's backing device info, so
/// `/sys/class/bdi/erofs-12/read_ahead_kb` is its readahead).
pub fn fs_sysfs_path(fd: BorrowedFd<'_>) -> io::Result<String> {
    let mut out = FsSysfsPath {
        len: 0,
        name: [0; 128],
    };
    // SAFETY: the ioctl writes at most size_of::<FsSysfsPath>() bytes (the
    // size encoded in the request number) into `out`, which lives across the
    // call; `fd` is a valid open descriptor for the duration of the borrow.
    let rc = unsafe {
        libc::ioctl(
            fd.as_raw_fd(),
            FS_IOC_GETFSSYSFSPATH,
            &mut out as *mut FsSysfsPath,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    let name = out.name.get(..usize::from(out.len)).unwrap_or(&out.name);
    Ok(String::from_utf8_lossy(name).into_owned())
}

/// Takes ownership of an fd this process inherited (its number passed on the
/// command line), after checking that it is open.
pub fn adopt_inherited_fd(fd: RawFd) -> io::Result<OwnedFd> {
    // SAFETY: F_GETFD only reads the fd's flags; an invalid number yields EBADF.
    if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
        return Err(io::Error::last_os_error());
    }
    if fd <= 2 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "refusing to adopt stdio",
        ));
    }
    // SAFETY: the fd is open (checked above), was handed to us by our parent
    // for exactly this purpose, and nothing else in this process owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

const _: () = assert!(size_of::<FsSysfsPath>() == 129);

/// `cachestat(2)`'s syscall number (Linux 6.5+; the same on x86_64 and
/// arm64, not yet in libc for glibc targets).
const SYS_CACHESTAT: libc::c_long = 451;

/// `struct cachestat_range`: the whole file.
#[repr(C)]
struct CachestatRange {
    off: u64,
    len: u64,
}

/// `struct cachestat` (all of it: the kernel writes every field).
#[repr(C)]
#[derive(Default)]
#[allow(dead_code)]
struct Cachestat {
    nr_cache: u64,
    nr_dirty: u64,
    nr_writeback: u64,
    nr_evicted: u64,
    nr_recently_evicted: u64,
}

/// Bytes of `file` in the page cache, by `cachestat(2)`. Not by mapping it
/// and asking `mincore` (what `fincore` does): mapping a file watched for
/// pre-content events raises one for the whole mapping (Linux 6.14+), so a
/// lazy mount's cache file looked at that way is filled.
pub fn resident_bytes(file: &impl AsFd) -> io::Result<u64> {
    let range = CachestatRange { off: 0, len: 0 };
    let mut stat = Cachestat::default();
    // SAFETY: cachestat reads `range` and writes `stat`, both valid structs
    // of the kernel's layout that outlive the call; it keeps no pointer.
    let rc = unsafe {
        libc::syscall(
            SYS_CACHESTAT,
            file.as_fd().as_raw_fd(),
            &range as *const CachestatRange,
            &mut stat as *mut Cachestat,
            0 as libc::c_uint,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: sysconf takes an integer and reads no memory.
    let page = u64::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
    Ok(stat.nr_cache * page)
}

#[cfg(test)]
mod tests {
    #[test]
    fn resident_bytes_counts_a_files_cached_pages() {
        use std::io::Write;
        let mut file = tempfile::tempfile().unwrap();
        file.write_all(&vec![7u8; 1 << 20]).unwrap();
        file.sync_all().unwrap();
        assert_eq!(super::resident_bytes(&file).unwrap(), 1 << 20);
        rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::DontNeed).unwrap();
        assert_eq!(super::resident_bytes(&file).unwrap(), 0);
    }

    #[test]
    fn a_thread_can_do_its_io_when_idle() {
        let class = std::thread::spawn(|| {
            do_io_when_idle().unwrap();
            io_class().unwrap()
        })
        .join()
        .unwrap();
        assert_eq!(class, 3);
        // Per thread: this one keeps its own.
        assert_ne!(io_class().unwrap(), 3);
    }

    #[test]
    fn only_the_identity_map_is_the_initial_namespace() {
        assert!(is_identity_uid_map("         0          0 4294967295\n"));
        assert!(!is_identity_uid_map("         0      65534          1\n"));
        assert!(!is_identity_uid_map("0 65534 1\n1 200000 65536\n"));
        assert!(!is_identity_uid_map(""));
    }

    use super::*;

    /// Resident KiB of the mapping that starts at `addr`, from smaps.
    fn mapping_rss_kib(addr: usize) -> u64 {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let start = format!("{addr:x}-");
        let vma = smaps.split_once(&start).expect("mapping in smaps").1;
        let rss = vma.split_once("\nRss:").unwrap().1;
        rss.split_whitespace().next().unwrap().parse().unwrap()
    }

    /// Maps the file at `path` (not through `map_file_forever`, whose
    /// mappings another test releases), touches one byte in each MiB and
    /// returns the mapping's resident KiB.
    fn resident_after_touching_each_mib(path: &std::path::Path, len: usize) -> u64 {
        let addr = map_read_only(&std::fs::File::open(path).unwrap(), len).unwrap();
        // SAFETY: `addr` maps `len` bytes of a file of that length, read
        // through volatile loads within it, then unmapped; nothing else
        // refers to it.
        unsafe {
            for mib in 0..len >> 20 {
                std::ptr::read_volatile(addr.cast::<u8>().add((mib << 20) + 12345));
            }
            let kib = mapping_rss_kib(addr as usize);
            libc::munmap(addr, len);
            kib
        }
    }

    /// A file written in pieces is mapped a piece at a time: touching 16
    /// bytes, a MiB apart, maps 16 x 64 KiB (the fault-around), not the
    /// 16 MiB that the large folios of one big write map on Linux 6.18.
    #[test]
    fn a_file_written_in_pieces_maps_little_per_touch() {
        let dir = tempfile::tempdir().unwrap();
        let data: Vec<u8> = (0..16u32 << 20).map(|i| (i % 251) as u8).collect();
        let pieces = dir.path().join("pieces");
        let file = std::fs::File::create(&pieces).unwrap();
        write_all_at_in_pieces(&file, &data[..1000], 0).unwrap();
        write_all_at_in_pieces(&file, &data[1000..], 1000).unwrap();
        assert!(std::fs::read(&pieces).unwrap() == data, "bytes differ");
        let streamed = dir.path().join("streamed");
        write_all_in_pieces(&mut std::fs::File::create(&streamed).unwrap(), &data).unwrap();
        assert!(std::fs::read(&streamed).unwrap() == data, "bytes differ");
        let whole = dir.path().join("whole");
        std::fs::write(&whole, &data).unwrap();
        let (p, s, w) = (
            resident_after_touching_each_mib(&pieces, data.len()),
            resident_after_touching_each_mib(&streamed, data.len()),
            resident_after_touching_each_mib(&whole, data.len()),
        );
        eprintln!(
            "16 touches map {p} and {s} KiB of the files in pieces, {w} KiB of the whole one"
        );
        assert!(p <= 16 * 128, "{p} KiB resident after 16 touches");
        assert!(s <= 16 * 128, "{s} KiB resident after 16 touches");
    }

    /// Released pages leave the resident set and read back the same.
    #[test]
    fn released_mappings_leave_the_resident_set_and_read_the_same() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("meta");
        let data: Vec<u8> = (0..16u32 << 20).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &data).unwrap();
        let bytes = map_file_forever(&std::fs::File::open(&path).unwrap()).unwrap();
        let before = resident_file_bytes().unwrap();
        let sum: u64 = bytes.iter().step_by(4096).map(|&b| u64::from(b)).sum();
        let touched = resident_file_bytes().unwrap();
        assert!(touched >= before + (12 << 20), "{before} -> {touched}");
        release_mapped_files().unwrap();
        let released = resident_file_bytes().unwrap();
        assert!(released + (12 << 20) <= touched, "{touched} -> {released}");
        assert_eq!(
            bytes
                .iter()
                .step_by(4096)
                .map(|&b| u64::from(b))
                .sum::<u64>(),
            sum
        );
        assert!(bytes == &data[..], "the bytes changed");
    }

    #[test]
    fn parses_event_with_range() {
        let mut b = Vec::new();
        b.extend_from_slice(&48u32.to_ne_bytes());
        b.push(METADATA_VERSION);
        b.push(0);
        b.extend_from_slice(&(METADATA_LEN as u16).to_ne_bytes());
        b.extend_from_slice(&FAN_PRE_ACCESS.to_ne_bytes());
        b.extend_from_slice(&(-1i32).to_ne_bytes());
        b.extend_from_slice(&1234i32.to_ne_bytes());
        b.push(INFO_TYPE_RANGE);
        b.push(0);
        b.extend_from_slice(&24u16.to_ne_bytes());
        b.extend_from_slice(&0u32.to_ne_bytes());
        b.extend_from_slice(&8192u64.to_ne_bytes());
        b.extend_from_slice(&4096u64.to_ne_bytes());
        let parse = |b: &[u8]| parse_events(b).collect::<io::Result<Vec<_>>>();
        let ev = parse(&b).unwrap();
        assert_eq!(ev.len(), 1);
        assert_eq!(ev[0].range, Some((8192, 4096)));
        assert_eq!(ev[0].pid, 1234);
        assert_eq!(ev[0].fd, -1);
        b[0] = 200; // longer than the buffer
        assert!(parse(&b).is_err());
    }

    /// Found by the `fanotify_events` fuzz target: a metadata length past the
    /// end of its event panicked on a slice index.
    #[test]
    fn metadata_longer_than_event_is_an_error() {
        let mut b = Vec::new();
        b.extend_from_slice(&48u32.to_ne_bytes());
        b.push(METADATA_VERSION);
        b.push(0);
        b.extend_from_slice(&6157u16.to_ne_bytes());
        b.resize(48, 0);
        let records: Vec<_> = parse_events(&b).collect();
        assert_eq!(records.len(), 1);
        assert!(records[0].is_err());
    }
}
