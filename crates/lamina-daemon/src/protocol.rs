//! Holder <-> worker messages over a SOCK_SEQPACKET socketpair. Each message
//! is one fixed 40-byte record; a miss from the kernel path carries the
//! fanotify event's fd as SCM_RIGHTS (a FUSE miss carries none, and -1 as
//! its event fd number), and so do the two hand-overs of the holder's fds.
//!
//! ```text
//! byte 0      kind (1 hello, 2 miss, 3 done, 4 complete, 5 group fd, 6 superblock fd,
//!             7 shutdown, 8 ready, 9 answered, 10 root dev)
//! bytes 4-8   blob (miss, complete, ready) or errno (done), u32 LE
//! bytes 8-16  request id (miss, done), readers' events (answered) or
//!             st_dev (root dev), u64 LE
//! bytes 16-24 cache offset (miss, ready) or the worker's events (answered), u64 LE
//! bytes 24-32 byte count (miss, ready), u64 LE
//! bytes 32-36 the event's fd number in the holder (miss), i32 LE
//! ```

use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::net::{
    recvmsg, sendmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

const MSG_LEN: usize = 40;

/// A message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Message {
    /// Worker -> holder: ready; events may be forwarded.
    Hello,
    /// Holder -> worker: fill `[offset, offset + count)` of blob `blob`
    /// (comes with the event fd).
    Miss {
        /// Request id.
        id: u64,
        /// Blob index (device order).
        blob: u32,
        /// Cache file offset.
        offset: u64,
        /// Bytes.
        count: u64,
        /// The event's fd number in the holder: what answers the event if
        /// the worker must answer it itself (the holder died).
        response_fd: i32,
    },
    /// Worker -> holder: request `id` done; `errno` 0 means filled.
    Done {
        /// Request id.
        id: u64,
        /// 0 or an errno for the reader.
        errno: i32,
    },
    /// Worker -> holder: blob complete, stop watching it.
    Complete {
        /// Blob index.
        blob: u32,
    },
    /// Holder -> worker: a copy of the fanotify group (comes with its fd),
    /// so that the group outlives a holder killed with `kill -9`.
    GroupFd,
    /// Holder -> worker: the inotify watch on the mount's root (comes with
    /// its fd), which tells when the superblock is gone.
    SuperblockFd,
    /// Holder -> worker: the mount is gone; save and exit (the socket
    /// closing without this means the holder died).
    Shutdown,
    /// Worker -> holder: `[offset, offset + len)` of blob `blob` holds
    /// verified boot pages, so the holder answers later reads within it
    /// itself, without a trip to the worker.
    Ready {
        /// Blob index.
        blob: u32,
        /// Cache file offset.
        offset: u64,
        /// Bytes.
        len: u64,
    },
    /// Holder -> worker: how many events the holder has answered itself
    /// so far, since the mount.
    Answered {
        /// Readers' reads within ranges announced [`Message::Ready`].
        readers: u64,
        /// The worker's own writes and reads.
        worker: u64,
    },
    /// Holder -> worker: the `st_dev` of the filesystem the holder mounted,
    /// by which the worker knows the mount it reads boot pages through
    /// (`crate::warm`).
    RootDev {
        /// `st_dev` of the mount's root.
        dev: u64,
    },
}

impl Message {
    fn encode(&self) -> [u8; MSG_LEN] {
        let mut b = [0u8; MSG_LEN];
        match *self {
            Message::Hello => b[0] = 1,
            Message::Miss {
                id,
                blob,
                offset,
                count,
                response_fd,
            } => {
                b[0] = 2;
                b[4..8].copy_from_slice(&blob.to_le_bytes());
                b[8..16].copy_from_slice(&id.to_le_bytes());
                b[16..24].copy_from_slice(&offset.to_le_bytes());
                b[24..32].copy_from_slice(&count.to_le_bytes());
                b[32..36].copy_from_slice(&response_fd.to_le_bytes());
            }
            Message::Done { id, errno } => {
                b[0] = 3;
                b[4..8].copy_from_slice(&errno.to_le_bytes());
                b[8..16].copy_from_slice(&id.to_le_bytes());
            }
            Message::Complete { blob } => {
                b[0] = 4;
                b[4..8].copy_from_slice(&blob.to_le_bytes());
            }
            Message::GroupFd => b[0] = 5,
            Message::SuperblockFd => b[0] = 6,
            Message::Shutdown => b[0] = 7,
            Message::Ready { blob, offset, len } => {
                b[0] = 8;
                b[4..8].copy_from_slice(&blob.to_le_bytes());
                b[16..24].copy_from_slice(&offset.to_le_bytes());
                b[24..32].copy_from_slice(&len.to_le_bytes());
            }
            Message::Answered { readers, worker } => {
                b[0] = 9;
                b[8..16].copy_from_slice(&readers.to_le_bytes());
                b[16..24].copy_from_slice(&worker.to_le_bytes());
            }
            Message::RootDev { dev } => {
                b[0] = 10;
                b[8..16].copy_from_slice(&dev.to_le_bytes());
            }
        }
        b
    }

    fn decode(b: &[u8]) -> io::Result<Self> {
        if b.len() != MSG_LEN {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "bad message length",
            ));
        }
        let u32_at = |at: usize| u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
        let u64_at = |at: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[at..at + 8]);
            u64::from_le_bytes(x)
        };
        Ok(match b[0] {
            1 => Message::Hello,
            2 => Message::Miss {
                blob: u32_at(4),
                id: u64_at(8),
                offset: u64_at(16),
                count: u64_at(24),
                response_fd: u32_at(32) as i32,
            },
            3 => Message::Done {
                errno: u32_at(4) as i32,
                id: u64_at(8),
            },
            4 => Message::Complete { blob: u32_at(4) },
            5 => Message::GroupFd,
            6 => Message::SuperblockFd,
            7 => Message::Shutdown,
            8 => Message::Ready {
                blob: u32_at(4),
                offset: u64_at(16),
                len: u64_at(24),
            },
            9 => Message::Answered {
                readers: u64_at(8),
                worker: u64_at(16),
            },
            10 => Message::RootDev { dev: u64_at(8) },
            _ => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "bad message kind",
                ))
            }
        })
    }
}

/// Sends a message, with an fd attached if given.
pub fn send(sock: BorrowedFd<'_>, msg: Message, fd: Option<BorrowedFd<'_>>) -> io::Result<()> {
    let bytes = msg.encode();
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut anc = SendAncillaryBuffer::new(&mut space);
    let fds;
    if let Some(fd) = fd {
        fds = [fd];
        if !anc.push(SendAncillaryMessage::ScmRights(&fds)) {
            return Err(io::Error::other("ancillary buffer too small"));
        }
    }
    loop {
        match sendmsg(
            sock,
            &[io::IoSlice::new(&bytes)],
            &mut anc,
            SendFlags::NOSIGNAL,
        ) {
            Ok(_) => return Ok(()),
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// Receives one message and its fd, if any. `Ok(None)` means the peer is
/// gone: it closed, or it died with messages it had not read (the kernel
/// then resets the connection).
pub fn recv(sock: BorrowedFd<'_>) -> io::Result<Option<(Message, Option<OwnedFd>)>> {
    let mut bytes = [0u8; MSG_LEN];
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(2))];
    let mut anc = RecvAncillaryBuffer::new(&mut space);
    let got = loop {
        match recvmsg(
            sock,
            &mut [io::IoSliceMut::new(&mut bytes)],
            &mut anc,
            RecvFlags::CMSG_CLOEXEC,
        ) {
            Ok(r) => break r,
            Err(rustix::io::Errno::INTR) => continue,
            Err(rustix::io::Errno::CONNRESET) => return Ok(None),
            Err(e) => return Err(e.into()),
        }
    };
    let mut fd = None;
    for m in anc.drain() {
        if let RecvAncillaryMessage::ScmRights(fds) = m {
            for f in fds {
                if fd.is_none() {
                    fd = Some(f);
                }
            }
        }
    }
    if got.bytes == 0 {
        return Ok(None);
    }
    Ok(Some((Message::decode(&bytes[..got.bytes])?, fd)))
}

/// Helper for callers holding an `OwnedFd`.
pub fn send_owned(sock: &OwnedFd, msg: Message, fd: Option<&OwnedFd>) -> io::Result<()> {
    send(sock.as_fd(), msg, fd.map(|f| f.as_fd()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustix::net::{socketpair, AddressFamily, SocketFlags, SocketType};

    /// A peer killed with messages it never read resets the connection:
    /// that is the peer gone (`Ok(None)`), as a clean close is, not an
    /// error. A worker whose holder was killed so exited instead of taking
    /// its place (CI: "Connection reset by peer", then reads failed).
    #[test]
    fn a_peer_gone_with_unread_messages_is_a_close() {
        let (a, b) = socketpair(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        send(a.as_fd(), Message::Hello, None).unwrap();
        drop(b);
        assert!(recv(a.as_fd()).unwrap().is_none());
    }

    #[test]
    fn round_trip_with_fd() {
        let (a, b) = socketpair(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        let file = std::fs::File::open("/proc/self/exe").unwrap();
        let msg = Message::Miss {
            id: 7,
            blob: 2,
            offset: 1 << 40,
            count: 4096,
            response_fd: 17,
        };
        send(a.as_fd(), msg, Some(file.as_fd())).unwrap();
        let (got, fd) = recv(b.as_fd()).unwrap().unwrap();
        assert_eq!(got, msg);
        assert!(fd.is_some());
        send(b.as_fd(), Message::Done { id: 7, errno: 5 }, None).unwrap();
        assert_eq!(
            recv(a.as_fd()).unwrap().unwrap().0,
            Message::Done { id: 7, errno: 5 }
        );
        for msg in [
            Message::Ready {
                blob: 3,
                offset: 1 << 33,
                len: 12 << 12,
            },
            Message::Answered {
                readers: 1 << 40,
                worker: 7,
            },
            Message::RootDev { dev: 0xfd_0001 },
        ] {
            send(b.as_fd(), msg, None).unwrap();
            assert_eq!(recv(a.as_fd()).unwrap().unwrap().0, msg);
        }
        drop(b);
        assert!(recv(a.as_fd()).unwrap().is_none());
    }
}
