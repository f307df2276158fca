//! Mounting without root through `fusermount3`, libfuse's setuid helper.
//!
//! The protocol (libfuse's `util/fusermount.c`, `lib/mount.c`): the caller
//! passes one end of a `SOCK_STREAM` socketpair in the environment variable
//! `_FUSE_COMMFD` (its fd number, inherited across exec) and runs
//! `fusermount3 -o OPTIONS -- MOUNTPOINT`. The helper opens `/dev/fuse`,
//! mounts it (checking that the user may mount there) and sends the open
//! `/dev/fuse` fd back as one `SCM_RIGHTS` message with a one-byte payload,
//! then exits. The caller serves the filesystem on that fd; `fusermount3
//! -u MOUNTPOINT` unmounts it later.

use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;
use std::process::{Command, Stdio};

use rustix::net::{
    recvmsg, socketpair, AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags,
    SocketFlags, SocketType,
};

/// Mounts a FUSE filesystem at `mountpoint` with `options` (`-o` syntax,
/// e.g. `ro,default_permissions`) and returns the `/dev/fuse` fd to serve.
pub fn mount(mountpoint: &Path, options: &str) -> io::Result<OwnedFd> {
    let (ours, theirs) = socketpair(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::CLOEXEC,
        None,
    )?;
    // The helper's end must survive exec. A fork in another thread meanwhile
    // would only hold a copy of it, which is harmless: the fd comes back
    // once, and the helper exits after sending it.
    rustix::io::fcntl_setfd(&theirs, rustix::io::FdFlags::empty())?;
    let child = Command::new("fusermount3")
        .arg("-o")
        .arg(options)
        .arg("--")
        .arg(mountpoint)
        .env("_FUSE_COMMFD", theirs.as_raw_fd().to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| io::Error::new(e.kind(), format!("fusermount3: {e}")))?;
    drop(theirs);
    let received = receive_fd(&ours);
    let out = child.wait_with_output()?;
    match received {
        Ok(Some(fd)) => Ok(fd),
        Ok(None) | Err(_) => Err(io::Error::other(format!(
            "fusermount3 did not mount {} ({}): {}",
            mountpoint.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))),
    }
}

/// The fd the helper sends, or `None` if it closed the socket without one.
fn receive_fd(sock: &OwnedFd) -> io::Result<Option<OwnedFd>> {
    let mut byte = [0u8; 1];
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut anc = RecvAncillaryBuffer::new(&mut space);
    loop {
        match recvmsg(
            sock,
            &mut [io::IoSliceMut::new(&mut byte)],
            &mut anc,
            RecvFlags::CMSG_CLOEXEC,
        ) {
            Ok(_) => break,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    let mut fd = None;
    for message in anc.drain() {
        if let RecvAncillaryMessage::ScmRights(fds) = message {
            for f in fds {
                fd.get_or_insert(f);
            }
        }
    }
    Ok(fd)
}
