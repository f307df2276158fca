//! Reads that wait for a lazy mount's worker, off the FUSE threads.
//!
//! A read of data not yet local waits for the worker to fetch it, up to the
//! mount's timeout. Served on a FUSE thread, a few such reads from a slow
//! registry would hold every FUSE thread, and lookups and reads of local
//! data would queue behind them. So a read that needs a fill is planned on
//! the FUSE thread (which pieces of which blobs: metadata only) and handed
//! to this pool, whose threads wait for the fill, read the cache files and
//! reply; the FUSE thread takes the next request at once.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use fuser::{Errno, ReplyData};
use lamina_daemon::filler::Filler;
use lamina_daemon::pool::MissPool as Pool;

use crate::Piece;

/// Threads started with the pool: misses mostly wait on the network, so
/// more of them than cores.
pub(crate) const MISS_THREADS: usize = 16;

/// Reads the kernel keeps outstanding at once for background work
/// (readahead), which the FUSE init raises to this from its default 16: a
/// stalled registry holding 16 readahead requests would otherwise queue a
/// read of local data behind them in the kernel.
pub(crate) const MAX_BACKGROUND: u16 = 96;

/// The pool grows to this many threads when every one waits: one for each
/// request the kernel may have outstanding (background plus a synchronous
/// read per FUSE thread), so a read of local data never queues behind reads
/// waiting on the network.
const MAX_MISS_THREADS: usize = MAX_BACKGROUND as usize + 32;

/// A read handed off: its pieces, where the reply goes.
pub(crate) struct PendingRead {
    /// Bytes the reply holds (holes included).
    pub len: usize,
    /// Where they are.
    pub pieces: Vec<Piece>,
    /// The reading process, for the worker's failure bookkeeping.
    pub pid: u32,
    /// The inode, for logs.
    pub nid: u64,
    /// Where the answer goes.
    pub reply: ReplyData,
}

/// The pool of threads that serve handed-off reads (the daemon's growing
/// pool: `lamina_daemon::pool`).
#[derive(Debug)]
pub(crate) struct MissPool(Pool<PendingRead>);

impl MissPool {
    /// Starts [`MISS_THREADS`] threads reading `blobs`, filled by `filler`.
    pub(crate) fn start(blobs: Arc<[File]>, filler: Arc<Filler>) -> MissPool {
        MissPool(Pool::new(MISS_THREADS, MAX_MISS_THREADS, move |read| {
            serve(&blobs, Some(&filler), read)
        }))
    }

    /// Hands `read` to the pool (growing it when no thread is free); served
    /// here if the pool is gone.
    pub(crate) fn submit(&self, read: PendingRead, blobs: &[File], filler: Option<&Filler>) {
        if let Err(e) = self.0.submit(read) {
            serve(blobs, filler, e.0);
        }
    }
}

fn serve(blobs: &[File], filler: Option<&Filler>, read: PendingRead) {
    match fill_and_read(blobs, filler, read.len, &read.pieces, read.pid, read.nid) {
        Ok(bytes) => read.reply.data(&bytes),
        Err(e) => read.reply.error(e),
    }
}

/// The bytes of a planned read: each piece's range filled first (when
/// `filler` is given), then read from its blob's cache file; holes are
/// zeros.
pub(crate) fn fill_and_read(
    blobs: &[File],
    filler: Option<&Filler>,
    len: usize,
    pieces: &[Piece],
    pid: u32,
    nid: u64,
) -> Result<Vec<u8>, Errno> {
    let mut out = vec![0; len];
    for piece in pieces {
        let Some((blob, at)) = piece.data else {
            continue; // a hole reads as zeros
        };
        let into = &mut out[piece.start..piece.start + piece.len];
        if let Some(filler) = filler {
            filler
                .fill(blob, at, piece.len as u64, pid as i32)
                .map_err(|errno| {
                    tracing::error!(nid, blob, at, "lazy read failed: errno {errno}");
                    Errno::from_i32(errno)
                })?;
        }
        blobs[blob as usize].read_exact_at(into, at).map_err(|e| {
            tracing::error!(nid, blob, "reading the blob cache: {e}");
            Errno::EIO
        })?;
    }
    Ok(out)
}
