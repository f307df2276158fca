//! `/proc/self/mountinfo` (proc_pid_mountinfo(5)): the mounts of this
//! process's mount namespace, one line each:
//!
//! ```text
//! ID PARENT MAJ:MIN ROOT MOUNT_POINT MOUNT_OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER_OPTIONS
//! ```
//!
//! The kernel writes space, tab, newline and backslash in paths as `\ooo`
//! (and a filesystem may escape commas in its options the same way), so
//! fields split on spaces and options on commas before they are unescaped.

use std::ffi::OsString;
use std::io;
use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};

/// One mount: the fields lamina reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    /// Where it is mounted.
    pub mount_point: PathBuf,
    /// The filesystem type (`erofs`, `overlay`, `fuse`, ...).
    pub fs_type: String,
    /// The mount source as the filesystem shows it (a path for a
    /// file-backed EROFS; whatever its mounter named it otherwise).
    pub source: OsString,
    /// The superblock's options, each unescaped (`lowerdir+=/a/b`).
    pub super_options: Vec<String>,
}

/// This process's mounts, in mount order (the last on a mount point is
/// the one a path lookup sees).
pub fn mounts() -> io::Result<Vec<Mount>> {
    Ok(parse(&std::fs::read_to_string("/proc/self/mountinfo")?))
}

/// The mounts of a mountinfo text; lines not in its format are skipped.
pub fn parse(text: &str) -> Vec<Mount> {
    text.lines().filter_map(parse_line).collect()
}

fn parse_line(line: &str) -> Option<Mount> {
    let (head, tail) = line.split_once(" - ")?;
    let mount_point = head.split(' ').nth(4)?;
    let mut tail = tail.splitn(3, ' ');
    let (fs_type, source) = (tail.next()?, tail.next()?);
    let super_options = tail
        .next()
        .unwrap_or_default()
        .split(',')
        .filter(|o| !o.is_empty())
        .map(unescape)
        .collect();
    Some(Mount {
        // Paths as their bytes: a name need not be UTF-8.
        mount_point: PathBuf::from(OsString::from_vec(unescape_bytes(mount_point))),
        fs_type: unescape(fs_type),
        source: OsString::from_vec(unescape_bytes(source)),
        super_options,
    })
}

/// Whether `path` is a mount point here. mountinfo names mount points by
/// their resolved paths, so `path` is resolved first (a root reached
/// through a symlink must still find its mounts).
pub fn is_mount_point(path: &Path) -> bool {
    let resolved = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    mounts().is_ok_and(|all| all.iter().any(|m| m.mount_point == resolved))
}

/// `\ooo` (three octal digits) back to its byte; anything else as it is
/// (bytes that are not UTF-8 replaced: for names, not paths).
pub fn unescape(s: &str) -> String {
    String::from_utf8_lossy(&unescape_bytes(s)).into_owned()
}

/// `\ooo` (three octal digits) back to its byte; anything else as it is.
pub fn unescape_bytes(s: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(s.len());
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_give_their_mount_point_type_source_and_options() {
        let text = "\
43 27 0:39 / /var/tmp/a\\040b ro,nosuid,relatime shared:5 - erofs /c/meta/d/x.erofs ro,user_xattr,directio
44 27 0:40 / /mnt/view ro,relatime - overlay none ro,lowerdir+=/c/mounts/1f/view,datadir+=/c/shards/d/9\\054x
not a mountinfo line";
        let m = parse(text);
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].mount_point, PathBuf::from("/var/tmp/a b"));
        assert_eq!(
            (m[0].fs_type.as_str(), m[0].source.to_str()),
            ("erofs", Some("/c/meta/d/x.erofs"))
        );
        assert_eq!(m[0].super_options, ["ro", "user_xattr", "directio"]);
        assert_eq!(
            m[1].super_options,
            [
                "ro",
                "lowerdir+=/c/mounts/1f/view",
                "datadir+=/c/shards/d/9,x"
            ]
        );
    }

    #[test]
    fn a_mount_point_that_is_not_utf8_keeps_its_bytes() {
        let m = parse("43 27 0:39 / /mnt/\\377x ro - tmpfs none rw");
        assert_eq!(
            m[0].mount_point,
            PathBuf::from(OsString::from_vec(b"/mnt/\xffx".to_vec()))
        );
    }

    #[test]
    fn escapes_are_three_octal_digits() {
        assert_eq!(unescape(r"/a\040b\134c"), r"/a b\c");
        assert_eq!(unescape(r"/tail\04"), r"/tail\04");
        assert_eq!(unescape(r"/not\089"), r"/not\089");
    }

    #[test]
    fn proc_is_a_mount_point_and_a_temp_dir_is_not() {
        assert!(is_mount_point(Path::new("/proc")));
        let dir = std::env::temp_dir().join(format!("mountinfo-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(!is_mount_point(&dir));
        std::fs::remove_dir(&dir).unwrap();
    }
}
