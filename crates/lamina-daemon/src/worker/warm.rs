//! Warming the mount's page cache with boot pages as they land
//! ([`crate::warm`]), through a clone of the holder's mount.

use std::num::NonZeroU64;
use std::ops::Range;

use rustix::fs::{Advice, Mode, OFlags, ResolveFlags};

use super::*;
use crate::warm::{FileRange, WarmMap};

/// A blob and a range of its cache file.
pub(super) type Run = (u32, Range<u64>);

/// Runs kept until the holder names its mount: those of a few frames (it
/// does at once; a FUSE daemon never does).
const BACKLOG_MAX: usize = 1 << 16;

/// Bytes asked for per `posix_fadvise` call: the kernel reads at most the
/// larger of the mount's readahead (0 here) and its device's largest I/O
/// (128 KiB by default) per call.
const WARM_STEP: u64 = 128 << 10;

/// The map warming reads by.
#[derive(Default)]
pub(super) enum MapState {
    /// Not needed yet.
    #[default]
    NotBuilt,
    /// Built, while boot pages are coming.
    Built(Arc<WarmMap>),
    /// Not to be had (FUSE, a shard, a hostile or huge image), or dropped
    /// once every frame was applied and warmed.
    Gone,
}

/// EROFS's superblock magic (`statfs` f_type).
const EROFS_MAGIC: u64 = 0xE0F5_E1E2;

impl Shared {
    /// Reads `runs` (blob, cache range; every page ready) into the mount's
    /// page cache. Until the holder has named its mount they wait; on the
    /// FUSE path, which names none, they are never warmed.
    pub(super) fn warm(&self, runs: Vec<Run>) {
        if self.root_dev.get().is_none() {
            let mut backlog = self.warm_backlog.lock().unwrap_or_else(|p| p.into_inner());
            // Checked again under the lock `take_root_dev` takes.
            if self.root_dev.get().is_none() {
                match backlog.as_mut() {
                    Some(b) if b.len() < BACKLOG_MAX => b.extend(runs),
                    _ => *backlog = None, // FUSE: never named
                }
                return;
            }
        }
        let Some(map) = self.warm_map() else {
            return;
        };
        let Some(root) = self.mount_clone() else {
            return;
        };
        for (blob, run) in runs {
            for FileRange { path, range } in map.ranges(blob, run) {
                match warm_file(&root, &path, range) {
                    Ok(bytes) => {
                        self.warmed_bytes.fetch_add(bytes, Ordering::Relaxed);
                    }
                    Err(e) => tracing::debug!("warming {}: {e}", path.display()),
                }
            }
        }
    }

    /// Drops the map once nothing is left to warm: every frame applied,
    /// the runs that waited for the mount's name warmed.
    pub(super) fn forget_warm_map_when_done(&self) {
        let done = self.boot_pending.load(Ordering::SeqCst) == 0
            && self.warm_backlog_users.load(Ordering::SeqCst) == 0
            && self.root_dev.get().is_some();
        if done {
            *self.warm_map.lock().unwrap_or_else(|p| p.into_inner()) = MapState::Gone;
        }
    }

    /// The holder named its mount: warms what waited for it.
    pub(super) fn take_root_dev(&self, dev: u64) {
        let backlog = {
            let mut backlog = self.warm_backlog.lock().unwrap_or_else(|p| p.into_inner());
            if self.root_dev.set(dev).is_err() {
                return; // named again, to a worker started again
            }
            let backlog = backlog.take().unwrap_or_default();
            if !backlog.is_empty() {
                self.warm_backlog_users.fetch_add(1, Ordering::SeqCst);
            }
            backlog
        };
        if backlog.is_empty() {
            return;
        }
        let Some(me) = self.me.get().and_then(std::sync::Weak::upgrade) else {
            return;
        };
        std::thread::spawn(move || {
            me.warm(backlog);
            me.warm_backlog_users.fetch_sub(1, Ordering::SeqCst);
            me.forget_warm_map_when_done();
        });
    }

    /// A private clone of the mount at the mountpoint, if it is still the
    /// one the holder made. A clone holds the superblock only while it is
    /// open (here, for one batch), and never the mount itself: an unmount
    /// meanwhile goes through.
    fn mount_clone(&self) -> Option<OwnedFd> {
        use rustix::mount::{open_tree, OpenTreeFlags};
        let dev = *self.root_dev.get()?;
        let flags = OpenTreeFlags::OPEN_TREE_CLONE | OpenTreeFlags::OPEN_TREE_CLOEXEC;
        let clone = open_tree(rustix::fs::CWD, &self.config.mountpoint, flags)
            .map_err(|e| tracing::info!("boot pages not warmed: cloning the mount: {e}"))
            .ok()?;
        let ours = rustix::fs::fstat(&clone).is_ok_and(|st| st.st_dev == dev)
            && rustix::fs::fstatfs(&clone).is_ok_and(|fs| fs.f_type as u64 == EROFS_MAGIC);
        if !ours {
            tracing::info!("boot pages not warmed: the mount is gone or covered");
        }
        ours.then_some(clone)
    }

    fn warm_map(&self) -> Option<Arc<WarmMap>> {
        let mut state = self.warm_map.lock().unwrap_or_else(|p| p.into_inner());
        if matches!(*state, MapState::NotBuilt) {
            *state = match self.build_warm_map() {
                Ok(map) => MapState::Built(Arc::new(map)),
                Err(e) => {
                    tracing::info!("boot pages not warmed: {e}");
                    MapState::Gone
                }
            };
        }
        match &*state {
            MapState::Built(map) => Some(map.clone()),
            _ => None,
        }
    }

    fn build_warm_map(&self) -> io::Result<WarmMap> {
        // A `--share-files` shard lays files out otherwise.
        if self.config.mount_metadata.is_some() {
            return Err(io::Error::other("a shard is mounted"));
        }
        let bytes = super::ahead::read_metadata(File::open(&self.config.metadata_path)?)?;
        let image = Image::new(&bytes).map_err(io::Error::other)?;
        WarmMap::build(&image, self.stores.len()).map_err(io::Error::other)
    }
}

/// Asks the kernel to read `range` of the file at `path` under `root`
/// into its page cache (it does so at once, through the mount); the bytes
/// asked for.
fn warm_file(root: &OwnedFd, path: &Path, range: Range<u64>) -> io::Result<u64> {
    let resolve = ResolveFlags::BENEATH
        | ResolveFlags::NO_SYMLINKS
        | ResolveFlags::NO_MAGICLINKS
        | ResolveFlags::NO_XDEV;
    let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let file = rustix::fs::openat2(root, path, flags, Mode::empty(), resolve)?;
    let mut at = range.start;
    while let Some(len) = NonZeroU64::new(range.end.saturating_sub(at).min(WARM_STEP)) {
        rustix::fs::fadvise(&file, at, Some(len), Advice::WillNeed)?;
        at += len.get();
    }
    Ok(at - range.start)
}
