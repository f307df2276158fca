//! FUSE passthrough: big files whose blobs are complete are handed to the
//! kernel with their own copy as the backing file.

use super::*;

/// What a passthrough-enabled daemon keeps.
#[derive(Debug)]
pub(crate) struct Passthrough {
    pub(crate) objects: Arc<Objects>,
    /// Makes the objects opens ask for, off the FUSE threads.
    pub(crate) maker: Maker,
    /// How each inode with open files is served. The kernel fails an open
    /// (EIO) that mixes passthrough and daemon-served opens of one inode,
    /// or two backing files for it; so an inode once passed through keeps
    /// its backing id for the daemon's life, and one with daemon-served
    /// opens stays served here until they are all released.
    pub(crate) inodes: Mutex<HashMap<u64, InodeIo>>,
    /// The kernel refused to register a backing file (no CAP_SYS_ADMIN in
    /// the initial user namespace): stop making objects.
    pub(crate) refused: AtomicBool,
}

#[derive(Debug)]
pub(crate) enum InodeIo {
    /// Open this many times, served by the daemon.
    Daemon(u32),
    /// Passed through to this backing file (registered while it lives).
    Backing(BackingId),
}

impl Passthrough {
    fn inodes(&self) -> std::sync::MutexGuard<'_, HashMap<u64, InodeIo>> {
        self.inodes.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl ImageFs {
    /// The size and pieces of file `nid` if it is one to pass through;
    /// `Ok(None)` when it is not (not regular, small, or with data in a
    /// blob still being filled).
    pub(crate) fn passthrough_pieces(
        &self,
        nid: u64,
    ) -> std::io::Result<Option<(u64, Vec<Piece>)>> {
        let Some(pt) = &self.passthrough else {
            return Ok(None);
        };
        let inode = self.image.inode(nid).map_err(std::io::Error::other)?;
        if inode.kind() != Some(Kind::Regular) || inode.size < pt.objects.min_size() {
            return Ok(None);
        }
        let pieces = self
            .pieces(&inode, 0, inode.size)
            .map_err(|e| std::io::Error::other(format!("chunk table: {e:?}")))?;
        let complete = pieces
            .iter()
            .all(|p| p.data.is_none_or(|(blob, _)| self.blob_complete(blob)));
        Ok(complete.then_some((inode.size, pieces)))
    }

    /// The object to pass file `nid` through to if it is ready (checked or
    /// made by this process). Else `None`, and if the file is one to pass
    /// through, its object is made or checked in the background, for a
    /// later open: this one is served here without waiting for it.
    pub(crate) fn ready_object(&self, pt: &Passthrough, nid: u64) -> Option<File> {
        if let Some(file) = pt.objects.open_known(nid) {
            return Some(file);
        }
        match self.passthrough_pieces(nid) {
            Ok(Some((size, pieces))) => pt.maker.request(nid, size, pieces),
            Ok(None) => {}
            Err(e) => tracing::warn!(nid, "not passed through, served here: {e}"),
        }
        None
    }

    /// Answers the open of regular file `nid`: passed through when its
    /// object is ready (and the inode is not served here already), else
    /// served here.
    pub(crate) fn open_file(&self, pt: &Passthrough, nid: u64, reply: ReplyOpen) {
        let decided = pt.inodes().contains_key(&nid) || pt.refused.load(Ordering::Relaxed);
        let backing = if decided {
            None
        } else {
            self.ready_object(pt, nid)
        };
        let mut inodes = pt.inodes();
        match inodes.get_mut(&nid) {
            Some(InodeIo::Backing(id)) => return self.opened_passthrough(nid, reply, id),
            Some(InodeIo::Daemon(n)) => *n += 1,
            None => match backing.map(|file| reply.open_backing(&file)) {
                Some(Ok(id)) => {
                    let io = inodes.entry(nid).or_insert(InodeIo::Backing(id));
                    if let InodeIo::Backing(id) = io {
                        return self.opened_passthrough(nid, reply, id);
                    }
                }
                Some(Err(e)) => {
                    tracing::warn!(nid, "registering the backing file: {e}; serving it here");
                    if e.raw_os_error() == Some(rustix::io::Errno::PERM.raw_os_error()) {
                        pt.refused.store(true, Ordering::Relaxed);
                    }
                    inodes.insert(nid, InodeIo::Daemon(1));
                }
                None => {
                    inodes.insert(nid, InodeIo::Daemon(1));
                }
            },
        }
        drop(inodes);
        self.opened_here(reply);
    }

    pub(crate) fn opened_passthrough(&self, nid: u64, reply: ReplyOpen, id: &BackingId) {
        let n = self.stats.passthrough_opens.fetch_add(1, Ordering::Relaxed) + 1;
        tracing::info!(nid, passthrough_opens = n, "open passed through");
        // The kernel takes no other open flags with passthrough (its page
        // cache is the backing file's).
        reply.opened_passthrough(PASSTHROUGH_FH, FopenFlags::empty(), id);
    }

    pub(crate) fn opened_here(&self, reply: ReplyOpen) {
        self.stats.daemon_opens.fetch_add(1, Ordering::Relaxed);
        reply.opened(DAEMON_FH, FopenFlags::FOPEN_KEEP_CACHE);
    }

    /// A daemon-served open of `nid` was released.
    pub(crate) fn released_here(&self, nid: u64) {
        let Some(pt) = &self.passthrough else { return };
        let mut inodes = pt.inodes();
        if let Some(InodeIo::Daemon(n)) = inodes.get_mut(&nid) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                inodes.remove(&nid);
            }
        }
    }
}
