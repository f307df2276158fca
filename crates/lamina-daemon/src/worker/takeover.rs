//! When the holder dies: the worker answers the kernel itself through its
//! copy of the fanotify group, until the mount is gone.

use super::*;

/// Every fd number the holder could have had (its limit, which this worker
/// inherited): see `take_over_after_holder`.
pub(super) fn orphan_fd_bound() -> i32 {
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    let bound = limit.current.unwrap_or(1 << 20).min(1 << 20);
    i32::try_from(bound).unwrap_or(i32::MAX)
}

impl Shared {
    /// After the holder was killed: the group stays open in this process, so
    /// the kernel does not let reads of unfilled ranges see zeros, and this
    /// worker takes the holder's place. The misses in hand are finished and
    /// answered by the holder's fd numbers. Events the holder read but never
    /// forwarded are pending under fd numbers of its table, which an answer
    /// of ours could name: every fd number it could have had is answered
    /// EIO first (numbers no event has are refused by the kernel, harmless),
    /// so that none is left. Then this worker reads the group's events and
    /// serves them as misses, answering by its own fd numbers, until the
    /// superblock is gone. Readers of this mount, and of every other mount
    /// of the same cache files (asked too), go on getting the image's bytes.
    pub(super) fn take_over_after_holder(&self, jobs: &MissPool<Job>) -> io::Result<()> {
        let (Some(group), Some(superblock)) = (self.group.get(), self.superblock.get()) else {
            // A FUSE daemon never hands over a group: its mount dies with
            // it, so no read can see unfilled bytes and there is nothing
            // to guard. A holder that died this early left no group either.
            tracing::warn!(
                "the mount's daemon is gone and left no fanotify group to guard \
                 (a FUSE daemon, or a holder that died before handing it over): exiting"
            );
            return Ok(());
        };
        tracing::error!("the holder died; finishing the misses in hand, then serving the group here until unmounted");
        while self.active_misses.load(Ordering::SeqCst) > 0 {
            std::thread::sleep(Duration::from_millis(10));
        }
        self.save_records(Duration::ZERO);
        let orphans = orphan_fd_bound();
        for fd in 0..orphans {
            let _ = group.respond(fd, Response::DenyErrno(libc::EIO));
        }
        tracing::info!(
            fd_numbers = orphans,
            "events the holder left unanswered failed; serving"
        );
        let watched = self.cache_inodes();
        let mut buf = Vec::new();
        loop {
            let group_fd = group.as_fd();
            let mut fds = [
                PollFd::new(&group_fd, PollFlags::IN),
                PollFd::new(superblock, PollFlags::IN),
            ];
            match poll(&mut fds, None) {
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
            if !fds[1].revents().is_empty() && crate::holder::superblock_gone(superblock) {
                tracing::info!("the filesystem is gone; exiting");
                return Ok(());
            }
            if fds[0].revents().contains(PollFlags::IN) {
                for ev in group.read_events(&mut buf)? {
                    self.take_event(group, ev, &watched, jobs);
                }
            }
        }
    }

    /// `(device, inode)` of each blob's cache file, as the mount made it.
    pub(super) fn cache_inodes(&self) -> HashMap<(u64, u64), u32> {
        let mut inodes = HashMap::new();
        for (i, spec) in self.config.blobs.iter().enumerate() {
            match spec.open_checked().and_then(|f| Ok(rustix::fs::fstat(&f)?)) {
                Ok(st) => {
                    inodes.insert((st.st_dev, st.st_ino), i as u32);
                }
                Err(e) => tracing::warn!("blob {i}: {e}; its reads get EIO"),
            }
        }
        inodes
    }

    /// One event read in the holder's place: a read of a watched cache file
    /// becomes a miss served by the miss threads (answered by this
    /// process's fd number); this worker's own reads and writes go through;
    /// anything else fails with EIO.
    pub(super) fn take_event(
        &self,
        group: &FanotifyGroup,
        ev: lamina_sys::Event,
        watched: &HashMap<(u64, u64), u32>,
        jobs: &MissPool<Job>,
    ) {
        let Some(file) = ev.file else {
            tracing::error!("fanotify queue overflow");
            return;
        };
        // This worker's own reads and writes (verified data) go through.
        if ev.pid == std::process::id() as i32 {
            let _ = group.respond(ev.response_fd, Response::Allow);
            return;
        }
        let stat = rustix::fs::fstat(&file);
        let blob = stat
            .as_ref()
            .ok()
            .and_then(|st| watched.get(&(st.st_dev, st.st_ino)).copied());
        // The group marks this mount's cache files only: an event this
        // worker cannot tie to one of them (a cache file it could not open
        // as the mount made it) is a read of unverified bytes. Fail it.
        let (Ok(stat), Some(blob)) = (stat, blob) else {
            tracing::warn!(
                "a read of a marked file that is none of this mount's cache files as it made \
                 them: EIO"
            );
            let _ = group.respond(ev.response_fd, Response::DenyErrno(libc::EIO));
            return;
        };
        let (offset, count) = ev.range.unwrap_or((0, stat.st_size as u64));
        self.misses.fetch_add(1, Ordering::Relaxed);
        self.active_misses.fetch_add(1, Ordering::Relaxed);
        let job = Job {
            id: 0,
            blob,
            offset,
            count,
            file: Some(File::from(file)),
            response_fd: ev.response_fd,
            received: Instant::now(),
        };
        if let Err(e) = jobs.submit(job) {
            let _ = group.respond(e.0.response_fd, Response::DenyErrno(libc::EIO));
        }
    }
}
