//! Quiet fds and chunk locks: what lets several mounts share one cache file.
//!
//! Fanotify marks belong to the cache file's inode, so every group watching
//! it is asked about every read and write of it, through any fd that is not
//! quiet. A fanotify event's own fd is quiet: the kernel opens it with
//! `FMODE_NONOTIFY`, for groups of every class (verified on 6.18: a write
//! through a notification group's `FAN_OPEN` event fd raised no
//! `FAN_PRE_ACCESS` in a pre-content group marking the same file, while a
//! write through a normal fd did). [`open_quiet`] gets one that way, so a
//! worker's background fills never become misses in other mounts' holders.
//!
//! [`try_lock_range`] takes an open-file-description byte-range lock, so
//! that workers of different mounts fetch a chunk once: the one that holds
//! the lock fetches and writes, the others wait for it and then verify.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};

use crate::{FAN_CLOEXEC, FAN_MARK_ADD};

/// `FAN_CLASS_NOTIF`.
const FAN_CLASS_NOTIF: u32 = 0x00;
/// `FAN_OPEN`.
const FAN_OPEN: u64 = 0x20;
/// `sizeof(struct fanotify_event_metadata)`.
const METADATA_LEN: usize = 24;

/// Opens `file`'s inode (a regular file) again, read-write, through an fd
/// whose reads and writes raise no fanotify events: the fd of a `FAN_OPEN`
/// event that a short-lived notification group receives when this call
/// opens the file. Both the mark and the open go through `file`'s own fd
/// (`/proc/self/fd/N`), never through a name that could meanwhile name
/// another file; the result is checked to be that inode.
pub fn open_quiet(file: &File) -> io::Result<File> {
    let path = crate::fd_path(file);
    let want = file.metadata()?;
    let group = crate::fanotify_init(FAN_CLASS_NOTIF | FAN_CLOEXEC)?;
    crate::fanotify_mark(group.as_fd(), FAN_MARK_ADD, FAN_OPEN, &path)?;
    let _probe = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(&path)?;
    // Our open queued an event before `open` returned; others' opens of the
    // same file may queue theirs too: any of them names the same inode.
    let mut buf = [0u8; 4096];
    let n = rustix::io::read(&group, &mut buf)?;
    let mut events = &buf[..n];
    let mut found = None;
    while events.len() >= METADATA_LEN {
        let event_len = u32::from_ne_bytes([events[0], events[1], events[2], events[3]]) as usize;
        let fd = i32::from_ne_bytes([events[16], events[17], events[18], events[19]]);
        if event_len < METADATA_LEN || event_len > events.len() {
            break;
        }
        if fd >= 0 {
            // SAFETY: the kernel installed this fd in our table for this
            // event and nothing else owns it; we take ownership exactly once.
            let owned = unsafe { OwnedFd::from_raw_fd(fd) };
            if found.is_none() {
                found = Some(File::from(owned));
            }
        }
        events = &events[event_len..];
    }
    let quiet = found.ok_or_else(|| io::Error::other("no fanotify open event for the file"))?;
    let got = quiet.metadata()?;
    if (got.dev(), got.ino()) != (want.dev(), want.ino()) {
        return Err(io::Error::other("the quiet fd names another file"));
    }
    Ok(quiet)
}

fn ofd_lock(fd: BorrowedFd<'_>, kind: i16, start: u64, len: u64) -> io::Result<bool> {
    let (Ok(start), Ok(len)) = (libc::off_t::try_from(start), libc::off_t::try_from(len)) else {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "lock range"));
    };
    let lock = libc::flock {
        l_type: kind,
        l_whence: libc::SEEK_SET as i16,
        l_start: start,
        l_len: len,
        l_pid: 0, // must be 0 for open-file-description locks
    };
    // SAFETY: fd is a valid open fd for the duration of the call and `lock`
    // is a properly initialised struct flock that outlives it; F_OFD_SETLK
    // does not keep the pointer.
    let rc = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_OFD_SETLK, &lock) };
    if rc == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EAGAIN) | Some(libc::EACCES) => Ok(false),
        _ => Err(e),
    }
}

/// Takes an exclusive lock on `[start, start + len)` of `fd`'s file for
/// this open file description, without waiting. `Ok(false)`: another open
/// file description (another process) holds a lock that meets the range.
/// Advisory: it changes nothing about reads and writes. `fd` must be open
/// for writing.
pub fn try_lock_range(fd: impl AsFd, start: u64, len: u64) -> io::Result<bool> {
    ofd_lock(fd.as_fd(), libc::F_WRLCK as i16, start, len)
}

/// Takes the lock of [`try_lock_range`], waiting while another open file
/// description holds one that meets the range (held only briefly: the
/// writes of `lamina_fetch::store`).
pub fn lock_range(fd: impl AsFd, start: u64, len: u64) -> io::Result<()> {
    loop {
        match ofd_lock_wait(fd.as_fd(), start, len) {
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
            other => return other,
        }
    }
}

fn ofd_lock_wait(fd: BorrowedFd<'_>, start: u64, len: u64) -> io::Result<()> {
    let (Ok(start), Ok(len)) = (libc::off_t::try_from(start), libc::off_t::try_from(len)) else {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "lock range"));
    };
    let lock = libc::flock {
        l_type: libc::F_WRLCK as i16,
        l_whence: libc::SEEK_SET as i16,
        l_start: start,
        l_len: len,
        l_pid: 0, // must be 0 for open-file-description locks
    };
    // SAFETY: fd is a valid open fd for the duration of the call and `lock`
    // is a properly initialised struct flock that outlives it; F_OFD_SETLKW
    // does not keep the pointer.
    let rc = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_OFD_SETLKW, &lock) };
    match rc {
        0 => Ok(()),
        _ => Err(io::Error::last_os_error()),
    }
}

/// Releases a lock taken with [`try_lock_range`].
pub fn unlock_range(fd: impl AsFd, start: u64, len: u64) -> io::Result<()> {
    ofd_lock(fd.as_fd(), libc::F_UNLCK as i16, start, len).map(|_| ())
}
