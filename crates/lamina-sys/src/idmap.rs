//! Idmapped mounts (Linux 5.12+; EROFS and overlayfs layers on 6.x): a
//! clone of a mount whose files show their owners shifted into a range of
//! host ids, so a container whose root is host uid `HOST` sees the image's
//! root-owned files as its own without a byte of the image changing
//! (`lamina run --userns`).

use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::Path;

use rustix::mount::{move_mount, open_tree, MoveMountFlags, OpenTreeFlags};

/// Ids `0..size` inside, `host..host+size` outside: one range for users and
/// groups alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdRange {
    /// The first host id (container id 0).
    pub host: u32,
    /// How many ids.
    pub size: u32,
}

impl IdRange {
    /// `size` ids from host id `host`: a range above root that fits in
    /// the id space, or why not.
    pub fn new(host: u32, size: u32) -> Result<IdRange, String> {
        if host == 0 || size == 0 || host.checked_add(size).is_none() {
            return Err(format!(
                "{host}:{size} is no range of host ids above root (e.g. 100000:65536)"
            ));
        }
        Ok(IdRange { host, size })
    }

    /// The `uid_map`/`gid_map` line.
    fn map_line(&self) -> String {
        format!("0 {} {}\n", self.host, self.size)
    }
}

/// A user namespace holding `range` for users and groups, as an fd (what an
/// idmapped mount takes). It is made by a short-lived child, since a
/// threaded process cannot unshare its own user namespace.
pub fn user_namespace(range: IdRange) -> io::Result<OwnedFd> {
    // Close-on-exec: another thread's child must not keep them open.
    let cloexec = rustix::pipe::PipeFlags::CLOEXEC;
    let (ready_r, ready_w) = rustix::pipe::pipe_with(cloexec)?;
    let (done_r, done_w) = rustix::pipe::pipe_with(cloexec)?;
    // SAFETY: the child calls only async-signal-safe syscalls (unshare,
    // write, read, _exit) before it exits, never returning into Rust code
    // that might take a lock another thread held at the fork.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(io::Error::last_os_error());
    }
    if pid == 0 {
        // SAFETY: see above; the fds are this child's copies. It closes its
        // copy of `done_w` first, or its read would never see EOF.
        unsafe {
            libc::close(done_w.as_raw_fd());
            libc::close(ready_r.as_raw_fd());
            let ok = libc::unshare(libc::CLONE_NEWUSER) == 0;
            let byte = [u8::from(ok)];
            libc::write(ready_w.as_raw_fd(), byte.as_ptr().cast(), 1);
            let mut buf = [0u8; 1];
            libc::read(done_r.as_raw_fd(), buf.as_mut_ptr().cast(), 1);
            libc::_exit(0);
        }
    }
    drop((ready_w, done_r));
    let made = namespace_of(pid, range, &ready_r);
    drop(done_w); // the child reads EOF and exits
    let mut status = 0;
    // SAFETY: waits for the child forked above, which exits at once.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    made
}

/// Once the child `pid` says it unshared, writes its maps and opens its
/// namespace.
fn namespace_of(pid: libc::pid_t, range: IdRange, ready: &OwnedFd) -> io::Result<OwnedFd> {
    let mut byte = [0u8; 1];
    let n = rustix::io::read(ready, &mut byte)?;
    if n != 1 || byte[0] != 1 {
        return Err(io::Error::other(
            "making a user namespace failed (are user namespaces allowed here?)",
        ));
    }
    let proc = format!("/proc/{pid}");
    std::fs::write(format!("{proc}/uid_map"), range.map_line())?;
    std::fs::write(format!("{proc}/gid_map"), range.map_line())?;
    Ok(std::fs::File::open(format!("{proc}/ns/user"))?.into())
}

/// `struct mount_attr` (linux/mount.h).
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

/// `MOUNT_ATTR_IDMAP`.
const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;

/// Mounts at `target` a clone of the mount at `source` (its root, not
/// recursive) with its ids mapped through the user namespace `userns`.
pub fn mount_idmapped(source: &Path, target: &Path, userns: &OwnedFd) -> io::Result<()> {
    let clone = open_tree(
        rustix::fs::CWD,
        source,
        OpenTreeFlags::OPEN_TREE_CLONE | OpenTreeFlags::OPEN_TREE_CLOEXEC,
    )?;
    let attr = MountAttr {
        attr_set: MOUNT_ATTR_IDMAP,
        attr_clr: 0,
        propagation: 0,
        userns_fd: userns.as_raw_fd() as u64,
    };
    // SAFETY: mount_setattr(2) on the detached clone's fd with an empty path
    // (AT_EMPTY_PATH) reads `attr`, a valid struct of the size passed, and
    // keeps no pointer to it.
    let r = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            clone.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    move_mount(
        clone.as_fd(),
        "",
        rustix::fs::CWD,
        target,
        MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
    )?;
    Ok(())
}
