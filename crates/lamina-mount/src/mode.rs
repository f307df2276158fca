//! `--mode auto`: the kernel path where this host allows it, FUSE
//! otherwise, decided at run time from what the host is (not from a
//! failed attempt), with the reason said.
//!
//! The kernel path needs root, file-backed EROFS (Linux 6.12+) and a cache
//! dir on a disk filesystem (ext4, xfs, btrfs: file-backed EROFS refuses
//! tmpfs files with ENOTBLK, checked here); a lazy kernel mount also needs
//! fanotify pre-content events (Linux 6.14+), which tmpfs lacks too.

use std::fmt;
use std::path::Path;

/// How an image is served.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// File-backed EROFS in the kernel (eager or lazy).
    Kernel,
    /// A FUSE daemon (eager or lazy).
    Fuse,
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Mode::Kernel => "kernel",
            Mode::Fuse => "fuse",
        })
    }
}

/// What the choice depends on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostFacts {
    /// Effective uid 0.
    pub root: bool,
    /// The running kernel's (major, minor).
    pub kernel: (u32, u32),
    /// The cache dir's filesystem magic (statfs f_type), if known.
    pub cache_fs: Option<u64>,
}

const EXT4_MAGIC: u64 = 0xEF53;
const XFS_MAGIC: u64 = 0x5846_5342;
const BTRFS_MAGIC: u64 = 0x9123_683E;
const TMPFS_MAGIC: u64 = 0x0102_1994;
const OVERLAYFS_MAGIC: u64 = 0x794C_7630;

fn fs_name(magic: u64) -> String {
    match magic {
        EXT4_MAGIC => "ext4".into(),
        XFS_MAGIC => "xfs".into(),
        BTRFS_MAGIC => "btrfs".into(),
        TMPFS_MAGIC => "tmpfs".into(),
        OVERLAYFS_MAGIC => "overlayfs".into(),
        m => format!("a filesystem of type {m:#x}"),
    }
}

/// The mode for a mount that is `lazy` (or not) on a host with `facts`,
/// and why.
pub fn choose(facts: &HostFacts, lazy: bool) -> (Mode, String) {
    let (major, minor) = facts.kernel;
    let fuse = |why: String| (Mode::Fuse, why);
    if !facts.root {
        return fuse(
            "not root (of the host): the kernel path mounts EROFS, which needs root".into(),
        );
    }
    if facts.kernel < (6, 12) {
        return fuse(format!(
            "Linux {major}.{minor} has no file-backed EROFS (6.12 or later)"
        ));
    }
    if lazy && facts.kernel < (6, 14) {
        return fuse(format!(
            "Linux {major}.{minor} has no fanotify pre-content events (6.14 or later)"
        ));
    }
    let Some(fs @ (EXT4_MAGIC | XFS_MAGIC | BTRFS_MAGIC)) = facts.cache_fs else {
        // tmpfs (checked): file-backed EROFS refuses its files (ENOTBLK)
        // and it has no pre-content events.
        let on = facts
            .cache_fs
            .map_or_else(|| "an unknown filesystem".into(), fs_name);
        return fuse(format!(
            "the cache dir is on {on}; the kernel path needs it on ext4, xfs or btrfs \
             (file-backed EROFS{})",
            if lazy { " and pre-content events" } else { "" }
        ));
    };
    (
        Mode::Kernel,
        format!("root, Linux {major}.{minor}, cache dir on {}", fs_name(fs)),
    )
}

/// The facts of this host for a cache in `cache_dir` (which must exist).
pub fn host_facts(cache_dir: &Path) -> HostFacts {
    let uname = rustix::system::uname();
    let release = uname.release().to_string_lossy().into_owned();
    HostFacts {
        root: lamina_sys::is_host_root(),
        kernel: parse_release(&release),
        cache_fs: rustix::fs::statfs(cache_dir).ok().map(|s| s.f_type as u64),
    }
}

/// (major, minor) of a kernel release such as `6.18.44-fc-v782`; (0, 0)
/// when unreadable, which picks FUSE.
fn parse_release(release: &str) -> (u32, u32) {
    let mut parts = release.split(|c: char| !c.is_ascii_digit());
    let major = parts.next().and_then(|p| p.parse().ok());
    let minor = parts.next().and_then(|p| p.parse().ok());
    match (major, minor) {
        (Some(a), Some(b)) => (a, b),
        _ => (0, 0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(root: bool, kernel: (u32, u32), fs: u64) -> HostFacts {
        HostFacts {
            root,
            kernel,
            cache_fs: Some(fs),
        }
    }

    #[test]
    fn kernel_where_the_host_allows_it() {
        let (m, why) = choose(&facts(true, (6, 18), EXT4_MAGIC), true);
        assert_eq!(
            (m, why.as_str()),
            (Mode::Kernel, "root, Linux 6.18, cache dir on ext4")
        );
        assert_eq!(
            choose(&facts(true, (6, 14), XFS_MAGIC), true).0,
            Mode::Kernel
        );
        // Eager mounts need no pre-content events: 6.12 will do.
        assert_eq!(
            choose(&facts(true, (6, 12), BTRFS_MAGIC), false).0,
            Mode::Kernel
        );
    }

    #[test]
    fn fuse_otherwise_and_says_why() {
        let cases = [
            (facts(false, (6, 18), EXT4_MAGIC), true, "not root"),
            (
                facts(true, (5, 14), EXT4_MAGIC),
                false,
                "Linux 5.14 has no file-backed EROFS",
            ),
            (
                facts(true, (6, 8), EXT4_MAGIC),
                true,
                "Linux 6.8 has no file-backed EROFS",
            ),
            (
                facts(true, (6, 13), EXT4_MAGIC),
                true,
                "no fanotify pre-content events",
            ),
            (
                facts(true, (6, 18), TMPFS_MAGIC),
                true,
                "cache dir is on tmpfs",
            ),
            (
                facts(true, (6, 18), TMPFS_MAGIC),
                false,
                "cache dir is on tmpfs",
            ),
            (facts(true, (6, 18), OVERLAYFS_MAGIC), false, "on overlayfs"),
            (facts(true, (6, 18), 0x1234), true, "type 0x1234"),
        ];
        for (f, lazy, want) in cases {
            let (m, why) = choose(&f, lazy);
            assert_eq!(m, Mode::Fuse, "{f:?}");
            assert!(why.contains(want), "{why:?} should say {want:?}");
        }
    }

    #[test]
    fn kernel_releases_parse() {
        assert_eq!(parse_release("6.18.44-fc-v782"), (6, 18));
        assert_eq!(parse_release("5.14.0-427.el9.x86_64"), (5, 14));
        assert_eq!(parse_release("6.8"), (6, 8));
        assert_eq!(parse_release("garbage"), (0, 0));
    }
}
