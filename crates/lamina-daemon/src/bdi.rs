//! A mount's readahead (its backing device info's `read_ahead_kb`), lowered
//! while a lazy mount's blobs are incomplete: every page the kernel reads
//! ahead is a page that must be fetched, so a start recorded or served
//! from boot pages would otherwise fetch whole readahead windows. Both the
//! holder (kernel path) and the FUSE daemon use it.

use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// The mount's readahead, lowered while blobs are incomplete and put back
/// when the last one completes (from then on reads never leave the kernel).
#[derive(Debug)]
pub struct BdiReadahead {
    path: PathBuf,
    original: String,
}

impl BdiReadahead {
    /// Sets the read_ahead_kb of the filesystem mounted at `mountpoint`
    /// to `kb`, remembering what it was.
    pub fn lower(mountpoint: &Path, kb: u32) -> io::Result<BdiReadahead> {
        let root = File::open(mountpoint)?;
        // EROFS names its bdi (FS_IOC_GETFSSYSFSPATH); FUSE does not, and
        // names it after its anonymous device: "MAJOR:MINOR".
        let bdi = match lamina_sys::fs_sysfs_path(root.as_fd()) {
            Ok(name) => name.rsplit('/').next().unwrap_or_default().to_string(),
            Err(_) => {
                let dev = root.metadata()?.dev();
                format!("{}:{}", rustix::fs::major(dev), rustix::fs::minor(dev))
            }
        };
        let path = Path::new("/sys/class/bdi").join(bdi).join("read_ahead_kb");
        let original = std::fs::read_to_string(&path)?.trim().to_string();
        std::fs::write(&path, kb.to_string())?;
        tracing::info!(
            "{} {original} -> {kb} until every blob is complete",
            path.display()
        );
        Ok(BdiReadahead { path, original })
    }

    /// Puts the remembered value back.
    pub fn restore(self) {
        if let Err(e) = std::fs::write(&self.path, &self.original) {
            tracing::warn!("restoring {}: {e}", self.path.display());
        }
    }
}
