//! Private files and directories: image data is only ever readable by its
//! owner, temp files are created exclusively without following symlinks,
//! and a directory someone else could write to is refused.

use std::fs::{DirBuilder, File, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Mode of every directory lamina creates for cache or run state.
pub const DIR_MODE: u32 = 0o700;
/// Mode of every file lamina creates there.
pub const FILE_MODE: u32 = 0o600;

fn refuse(path: &Path, why: String) -> io::Error {
    io::Error::new(
        io::ErrorKind::PermissionDenied,
        format!("{}: {why}", path.display()),
    )
}

/// Creates `dir` (and missing parents, 0700) and checks that it is a real
/// directory owned by this user that nobody else may write to. A directory
/// of ours that others may read (an older lamina's 0755) is tightened to
/// 0700; one owned by another user, or writable by group or others, is
/// refused with a message that says so.
pub fn private_dir(dir: &Path) -> io::Result<()> {
    owned_dir(dir, DIR_MODE)
}

/// Like [`private_dir`], but others may pass through `dir` (0711): they can
/// reach what is inside by name, never list it. A user namespace's root
/// (`lamina run --userns`) must pass through the directories above its
/// root filesystem, whose own dir is then private to that range.
pub fn traversable_dir(dir: &Path) -> io::Result<()> {
    owned_dir(dir, 0o711)
}

/// `dir`, made with `wanted` if new; one of ours is brought to exactly the
/// group and other bits of `wanted`, one of another user's, or writable
/// by others, is refused.
fn owned_dir(dir: &Path, wanted: u32) -> io::Result<()> {
    DirBuilder::new().recursive(true).mode(wanted).create(dir)?;
    let meta = std::fs::symlink_metadata(dir)?;
    if !meta.is_dir() {
        return Err(refuse(
            dir,
            "not a directory (a symlink is not taken)".into(),
        ));
    }
    let me = rustix::process::geteuid().as_raw();
    if meta.uid() != me {
        return Err(refuse(
            dir,
            format!(
                "owned by uid {}, not by this user (uid {me}); choose a cache directory of your own",
                meta.uid()
            ),
        ));
    }
    check_ancestors(dir, me)?;
    let mode = meta.mode() & 0o7777;
    if mode & 0o022 != 0 {
        return Err(refuse(
            dir,
            format!("mode {mode:o} lets others write to it; make it {wanted:04o} or choose another cache directory"),
        ));
    }
    if mode & 0o077 != wanted & 0o077 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(wanted))?;
    }
    Ok(())
}

/// Whether others may pass through `dir` (a [`traversable_dir`]).
pub fn is_traversable(dir: &Path) -> bool {
    std::fs::symlink_metadata(dir).is_ok_and(|m| m.is_dir() && m.mode() & 0o7777 == 0o711)
}

/// Every directory above `dir` (its real path) must be owned by root or
/// this user, and writable by nobody else unless sticky: whoever may write
/// to a parent can move `dir` aside and put one of their own in its place,
/// and then no check of `dir` itself means anything.
fn check_ancestors(dir: &Path, me: u32) -> io::Result<()> {
    let real = std::fs::canonicalize(dir)?;
    // In a user namespace (`podman unshare`), directories of ids it does not
    // map (the host's root among them) show as the overflow uid: only the
    // host can change those.
    let unmapped = unmapped_uid();
    for parent in real.ancestors().skip(1) {
        let meta = std::fs::metadata(parent)?;
        let mode = meta.mode() & 0o7777;
        if meta.uid() != 0 && meta.uid() != me && Some(meta.uid()) != unmapped {
            return Err(refuse(
                dir,
                format!(
                    "its parent {} is owned by uid {}, neither root nor this user (uid {me}); \
                     choose a directory whose parents only root or you control",
                    parent.display(),
                    meta.uid()
                ),
            ));
        }
        if mode & 0o022 != 0 && mode & 0o1000 == 0 {
            return Err(refuse(
                dir,
                format!(
                    "its parent {} (mode {mode:o}) may be written by others and is not sticky: \
                     they could swap the directory for their own",
                    parent.display()
                ),
            ));
        }
    }
    Ok(())
}

/// The uid unmapped owners show as, when this process is in a user
/// namespace other than the initial one; `None` in the initial one.
fn unmapped_uid() -> Option<u32> {
    if lamina_sys::in_initial_user_namespace() {
        return None;
    }
    let overflow = std::fs::read_to_string("/proc/sys/kernel/overflowuid").ok();
    overflow.and_then(|s| s.trim().parse().ok()).or(Some(65534))
}

/// Creates `path` exclusively (`O_EXCL`, `O_NOFOLLOW`), mode 0600.
pub fn create_new(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(FILE_MODE)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
}

/// Opens an existing file read-write without following a symlink.
pub fn open_existing(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
}

/// Opens `path` for reading, without following a symlink, and checks that it
/// is a regular file owned by this user that nobody else may write to: what
/// a daemon may trust (its config, a cached copy of a layer).
pub fn open_trusted(path: &Path) -> io::Result<File> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)?;
    let meta = file.metadata()?;
    let me = rustix::process::geteuid().as_raw();
    if !meta.is_file() || meta.uid() != me || meta.mode() & 0o022 != 0 {
        return Err(refuse(
            path,
            format!(
                "not a private file of this user (uid {}, mode {:o}); not trusted",
                meta.uid(),
                meta.mode() & 0o7777
            ),
        ));
    }
    Ok(file)
}

/// Reads a file [`open_trusted`] accepts.
pub fn read_trusted(path: &Path) -> io::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    io::Read::read_to_end(&mut open_trusted(path)?, &mut bytes)?;
    Ok(bytes)
}

/// A temp name beside `path` that no other process or call uses.
pub fn temp_name(path: &Path, tag: &str) -> PathBuf {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let mut name = path.as_os_str().to_owned();
    name.push(format!(
        ".{tag}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    PathBuf::from(name)
}

/// Writes `bytes` to `path` (0600) via an exclusively created temp file and a
/// rename, so that readers see the old or the new content, never half.
/// With `durable`, the data is synced before the rename. Written in pieces,
/// for daemons that map the file (`lamina_sys::write_all_in_pieces`).
pub fn write_atomic(path: &Path, bytes: &[u8], durable: bool) -> io::Result<()> {
    write_atomic_file(path, bytes, durable).map(drop)
}

/// [`write_atomic`], returning the file written: the one that was renamed
/// into place (another process may have replaced it there since), for a
/// record bound to it.
pub fn write_atomic_file(path: &Path, bytes: &[u8], durable: bool) -> io::Result<File> {
    write_atomic_with(path, durable, |f| lamina_sys::write_all_in_pieces(f, bytes))
}

/// [`write_atomic_file`] of the bytes `fill` writes into the temp file (a
/// stream too big to hold in memory); when `fill` fails, nothing is left
/// behind, as with any other failure.
pub fn write_atomic_with(
    path: &Path,
    durable: bool,
    fill: impl FnOnce(&mut File) -> io::Result<()>,
) -> io::Result<File> {
    let tmp = temp_name(path, "tmp");
    let result = (|| {
        let mut f = create_new(&tmp)?;
        fill(&mut f)?;
        if durable {
            f.sync_data()?;
        }
        std::fs::rename(&tmp, path)?;
        Ok(f)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traversable_dirs_are_0711_exactly() {
        let t = tempfile::tempdir().unwrap();
        let mode = |d: &Path| std::fs::metadata(d).unwrap().permissions().mode() & 0o7777;
        let dir = t.path().join("state");
        traversable_dir(&dir).unwrap();
        assert_eq!(mode(&dir), 0o711);
        assert!(is_traversable(&dir));
        for was in [0o700, 0o755] {
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(was)).unwrap();
            traversable_dir(&dir).unwrap();
            assert_eq!(mode(&dir), 0o711, "from {was:o}");
        }
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o733)).unwrap();
        assert!(traversable_dir(&dir).is_err());
        // private_dir takes it back to 0700.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o711)).unwrap();
        private_dir(&dir).unwrap();
        assert_eq!(mode(&dir), 0o700);
        assert!(!is_traversable(&dir));
    }

    #[test]
    fn dirs_are_private_and_foreign_ones_refused() {
        let t = tempfile::tempdir().unwrap();
        let d = t.path().join("a/b");
        private_dir(&d).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().mode() & 0o777;
        assert_eq!(mode(&d), 0o700);
        assert_eq!(mode(&t.path().join("a")), 0o700);
        // An older lamina's 0755 is tightened.
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
        private_dir(&d).unwrap();
        assert_eq!(mode(&d), 0o700);
        // Writable by others: refused, not changed.
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = private_dir(&d).unwrap_err();
        assert!(e.to_string().contains("lets others write"), "{e}");
        assert_eq!(mode(&d), 0o777);
        // A symlink to a directory is not taken.
        let link = t.path().join("link");
        std::os::unix::fs::symlink(t.path().join("a"), &link).unwrap();
        assert!(private_dir(&link).is_err());
    }

    /// Issue 42, point 12: a parent others may write to (and not sticky)
    /// lets them swap the directory; a sticky one (as /tmp) does not.
    #[test]
    fn a_parent_others_may_write_to_is_refused_unless_sticky() {
        let t = tempfile::tempdir().unwrap();
        let open = t.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = private_dir(&open.join("cache")).unwrap_err();
        assert!(e.to_string().contains("not sticky"), "{e}");
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o1777)).unwrap();
        private_dir(&open.join("cache")).unwrap();
    }

    #[test]
    fn temp_files_are_exclusive_and_do_not_follow_symlinks() {
        let t = tempfile::tempdir().unwrap();
        let target = t.path().join("victim");
        std::fs::write(&target, b"keep").unwrap();
        let p = t.path().join("f");
        std::os::unix::fs::symlink(&target, &p).unwrap();
        assert!(create_new(&p).is_err());
        assert!(open_existing(&p).is_err());
        assert!(open_trusted(&p).is_err());
        assert_eq!(std::fs::read(&target).unwrap(), b"keep");
        let q = t.path().join("g");
        write_atomic(&q, b"new", true).unwrap();
        assert_eq!(std::fs::metadata(&q).unwrap().mode() & 0o777, 0o600);
        assert_eq!(read_trusted(&q).unwrap(), b"new");
        std::fs::set_permissions(&q, std::fs::Permissions::from_mode(0o666)).unwrap();
        assert!(
            read_trusted(&q).is_err(),
            "a file others may write is not trusted"
        );
    }
}
