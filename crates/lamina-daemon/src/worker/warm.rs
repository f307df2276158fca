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
                match warm_file(&root, &path, range.clone()) {
                    Ok(()) => {
                        let len = range.end - range.start;
                        self.warmed_bytes.fetch_add(len, Ordering::Relaxed);
                    }
                    Err(e) => tracing::debug!("warming {}: {e}", path.display()),
                }
            }
        }
    }

    /// The holder named its mount: warms what waited for it.
    pub(super) fn take_root_dev(&self, dev: u64) {
        let backlog = {
            let mut backlog = self.warm_backlog.lock().unwrap_or_else(|p| p.into_inner());
            if self.root_dev.set(dev).is_err() {
                return; // named again, to a worker started again
            }
            backlog.take().unwrap_or_default()
        };
        let me = self.me.get().and_then(std::sync::Weak::upgrade);
        if let (Some(me), false) = (me, backlog.is_empty()) {
            std::thread::spawn(move || me.warm(backlog));
        }
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

    fn warm_map(&self) -> Option<&WarmMap> {
        self.warm_map
            .get_or_init(|| {
                let map = self.build_warm_map();
                if let Err(e) = &map {
                    tracing::info!("boot pages not warmed: {e}");
                }
                map.ok()
            })
            .as_ref()
    }

    fn build_warm_map(&self) -> io::Result<WarmMap> {
        // A `--share-files` shard lays files out otherwise.
        if self.config.mount_metadata.is_some() {
            return Err(io::Error::other("a shard is mounted"));
        }
        let file = File::open(&self.config.metadata_path)?;
        let len = file.metadata()?.len();
        if len > PREDICT_METADATA_MAX {
            return Err(io::Error::other(format!("metadata of {len} bytes")));
        }
        let mut bytes = Vec::with_capacity(len as usize);
        io::Read::read_to_end(&mut io::Read::take(file, len), &mut bytes)?;
        let image = Image::new(&bytes).map_err(io::Error::other)?;
        WarmMap::build(&image, self.stores.len()).map_err(io::Error::other)
    }
}

/// Asks the kernel to read `range` of the file at `path` under `root`
/// into its page cache (it does so at once, through the mount).
fn warm_file(root: &OwnedFd, path: &Path, range: Range<u64>) -> io::Result<()> {
    let resolve = ResolveFlags::BENEATH
        | ResolveFlags::NO_SYMLINKS
        | ResolveFlags::NO_MAGICLINKS
        | ResolveFlags::NO_XDEV;
    let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let file = rustix::fs::openat2(root, path, flags, Mode::empty(), resolve)?;
    let Some(len) = NonZeroU64::new(range.end - range.start) else {
        return Ok(());
    };
    rustix::fs::fadvise(&file, range.start, Some(len), Advice::WillNeed)?;
    Ok(())
}
