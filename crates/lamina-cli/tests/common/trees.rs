//! Comparing results: trees (treecmp.py, the EROFS reader against the
//! kernel), file hashes, before/after snapshots and [`Failures`].

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::fs::{self, File};
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::{command, python, run, Mount, TestDir, TIMEOUT};
use sha2::{Digest, Sha256};

// ---------------------------------------------------------------------------
// comparing trees

/// Entries of a tree (the root included), not following symlinks.
pub fn count_entries(root: &Path) -> u64 {
    fn walk(p: &Path) -> u64 {
        let mut n = 1;
        if fs::symlink_metadata(p).is_ok_and(|m| m.is_dir()) {
            for e in fs::read_dir(p).unwrap_or_else(|e| panic!("readdir {}: {e}", p.display())) {
                n += walk(&e.unwrap().path());
            }
        }
        n
    }
    walk(root)
}

/// Regular files below `root` (relative paths), not following symlinks.
pub fn regular_files(root: &Path) -> Vec<PathBuf> {
    fn walk(root: &Path, p: &Path, out: &mut Vec<PathBuf>) {
        for e in fs::read_dir(p).unwrap_or_else(|e| panic!("readdir {}: {e}", p.display())) {
            let path = e.unwrap().path();
            let m = fs::symlink_metadata(&path).unwrap();
            if m.is_dir() {
                walk(root, &path, out);
            } else if m.is_file() {
                out.push(path.strip_prefix(root).unwrap().to_path_buf());
            }
        }
    }
    let mut out = Vec::new();
    walk(root, root, &mut out);
    out.sort();
    out
}

/// The edge fixture's POSIX ACL is enforced on the mount at `mnt` (whose
/// test dir `t` is opened to other users for it): user nobody reads
/// `xattrs/acl-nobody` (mode 0640, a named-user entry for nobody) and is
/// refused `xattrs/acl-control` (mode 0640, no ACL).
#[track_caller]
pub fn assert_edge_acl_enforced(t: &TestDir, mnt: &Path) {
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(t.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let cat_as_nobody = |file: &str| {
        let path = mnt.join("xattrs").join(file);
        let args = ["--reuid=65534", "--regid=65534", "--clear-groups", "cat"];
        let mut cmd = command("setpriv", args.iter().map(OsStr::new));
        cmd.arg(&path);
        run(&mut cmd, Duration::from_secs(30))
    };
    let granted = cat_as_nobody("acl-nobody").ok();
    assert_eq!(granted.stdout, "read through an ACL\n");
    let refused = cat_as_nobody("acl-control");
    assert!(
        !refused.status.success() && refused.stderr.contains("Permission denied"),
        "nobody read a 0640 file without an ACL:\n{}",
        refused.describe()
    );
}

/// `treecmp.py OPTS A B`: asserts exit 0 and the summary line
/// `treecmp: N entries compared, 0 differences` with N the entry count of A.
/// Returns N.
#[track_caller]
pub fn treecmp(opts: &[&str], a: &Path, b: &Path) -> u64 {
    let mut args: Vec<&OsStr> = opts.iter().map(OsStr::new).collect();
    args.push(a.as_os_str());
    args.push(b.as_os_str());
    let out = python("tests/tools/treecmp.py", args, TIMEOUT);
    assert_eq!(
        out.code(),
        Some(0),
        "trees differ ({} vs {}):\n{}",
        a.display(),
        b.display(),
        out.describe()
    );
    let last = out.stdout.lines().last().unwrap_or("");
    let n: u64 = last
        .strip_prefix("treecmp: ")
        .and_then(|r| r.strip_suffix(" entries compared, 0 differences"))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| {
            panic!(
                "unexpected treecmp summary line {last:?}:\n{}",
                out.describe()
            )
        });
    let expected = count_entries(a);
    assert_eq!(
        n,
        expected,
        "treecmp compared {n} entries, {} has {expected}:\n{}",
        a.display(),
        out.describe()
    );
    n
}

/// sha256 hex of a file.
pub fn sha256_file(p: &Path) -> String {
    let mut f = File::open(p).unwrap_or_else(|e| panic!("open {}: {e}", p.display()));
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = f.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// Every path below `dir` (relative), with a type tag and for files the
/// size and sha256: a snapshot to compare before/after.
pub fn snapshot(dir: &Path) -> BTreeMap<PathBuf, String> {
    fn walk(root: &Path, p: &Path, out: &mut BTreeMap<PathBuf, String>) {
        let Ok(entries) = fs::read_dir(p) else { return };
        for e in entries.flatten() {
            let path = e.path();
            let rel = path.strip_prefix(root).unwrap().to_path_buf();
            let Ok(m) = fs::symlink_metadata(&path) else {
                continue;
            };
            if m.is_dir() {
                out.insert(rel, "dir".into());
                walk(root, &path, out);
            } else if m.is_file() {
                out.insert(rel, format!("file {} {}", m.len(), sha256_file(&path)));
            } else {
                out.insert(rel, format!("other {:o}", m.mode()));
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out
}

/// The differences between two snapshots, one line each.
pub fn snapshot_diff(
    before: &BTreeMap<PathBuf, String>,
    after: &BTreeMap<PathBuf, String>,
) -> Vec<String> {
    let mut d = Vec::new();
    for (p, v) in after {
        match before.get(p) {
            None => d.push(format!("added {} ({v})", p.display())),
            Some(b) if b != v => d.push(format!("changed {} ({b} -> {v})", p.display())),
            _ => {}
        }
    }
    for p in before.keys() {
        if !after.contains_key(p) {
            d.push(format!("removed {}", p.display()));
        }
    }
    d
}

/// Collects failed checks so one run reports all of them.
#[derive(Debug, Default)]
pub struct Failures(pub Vec<String>);

impl Failures {
    /// Records a failure when `cond` is false.
    pub fn check(&mut self, cond: bool, msg: impl FnOnce() -> String) {
        if !cond {
            self.0.push(msg());
        }
    }

    /// Panics with every recorded failure.
    #[track_caller]
    pub fn finish(self, what: &str) {
        if !self.0.is_empty() {
            panic!(
                "{what}: {} failed check(s):\n\n{}",
                self.0.len(),
                self.0.join("\n\n")
            );
        }
    }
}

/// The EROFS reader (what the FUSE path serves from) against the kernel's
/// mount of the same metadata and blobs, entry by entry: type and mode,
/// owner, size, mtime, link count, device numbers, symlink targets,
/// directory listings, every xattr with its value (empty ones included),
/// and every regular file's bytes read through the chunk table from the
/// blob caches. The mount must be complete (not lazy). Returns the number
/// of entries compared.
// Over 100 lines: one comparison per attribute, in the order the doc lists them.
#[track_caller]
pub fn reader_matches_kernel(m: &Mount) -> u64 {
    use lamina_format::erofs::{Chunk, Image, Kind};
    let meta = fs::read(m.metadata_path()).expect("read the metadata image");
    let img = Image::new(&meta).unwrap_or_else(|e| panic!("reader refuses the image: {e}"));
    let blobs: Vec<File> = m
        .blob_paths()
        .iter()
        .map(|p| File::open(p).unwrap())
        .collect();
    let mut stack = vec![(m.path.clone(), img.root_nid())];
    let mut compared = 0u64;
    while let Some((path, nid)) = stack.pop() {
        let inode = img
            .inode(nid)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let st = fs::symlink_metadata(&path).unwrap();
        let at = path.display();
        assert_eq!(inode.mode, st.mode(), "{at}: mode");
        assert_eq!((inode.uid, inode.gid), (st.uid(), st.gid()), "{at}: owner");
        assert_eq!(u64::from(inode.nlink), st.nlink(), "{at}: nlink");
        assert_eq!(
            (inode.mtime, i64::from(inode.mtime_nsec)),
            (st.mtime(), st.mtime_nsec()),
            "{at}: mtime"
        );
        assert_eq!(inode.size, st.size(), "{at}: size");
        let xattrs: BTreeMap<Vec<u8>, Vec<u8>> = img
            .xattrs(&inode)
            .unwrap()
            .into_iter()
            .map(|(k, v)| (k, v.to_vec()))
            .collect();
        assert_eq!(xattrs, kernel_xattrs(&path), "{at}: xattrs");
        match inode.kind().expect("a file type") {
            Kind::Directory => {
                let listed = img.entries(&inode).unwrap();
                let mut names: Vec<Vec<u8>> = listed
                    .iter()
                    .filter(|e| e.name != b"." && e.name != b"..")
                    .map(|e| e.name.to_vec())
                    .collect();
                let mut kernel: Vec<Vec<u8>> = fs::read_dir(&path)
                    .unwrap()
                    .map(|e| e.unwrap().file_name().into_encoded_bytes())
                    .collect();
                names.sort();
                kernel.sort();
                assert_eq!(names, kernel, "{at}: entries");
                for e in listed.iter().filter(|e| e.name != b"." && e.name != b"..") {
                    let found = img.lookup(&inode, e.name).unwrap();
                    assert_eq!(found, Some(*e), "{at}: lookup of {:?}", e.name);
                    let name = OsStr::from_bytes(e.name);
                    stack.push((path.join(name), e.nid));
                }
            }
            Kind::Symlink => {
                let target = img.symlink_target(&inode).unwrap();
                assert_eq!(
                    target,
                    fs::read_link(&path)
                        .unwrap()
                        .into_os_string()
                        .into_encoded_bytes(),
                    "{at}"
                );
            }
            Kind::Regular => {
                let chunks = img.chunks(&inode).unwrap();
                let want = fs::read(&path).unwrap();
                let mut got = Vec::with_capacity(want.len());
                let chunk = 1u64 << chunks.chunk_bits;
                for i in 0..chunks.len() {
                    let len = chunk.min(inode.size - i as u64 * chunk) as usize;
                    match chunks.get(i).unwrap() {
                        Chunk::Hole => got.resize(got.len() + len, 0),
                        Chunk::Data { device, offset } => {
                            let mut buf = vec![0u8; len];
                            std::os::unix::fs::FileExt::read_exact_at(
                                &blobs[usize::from(device) - 1],
                                &mut buf,
                                offset,
                            )
                            .unwrap();
                            got.extend_from_slice(&buf);
                        }
                    }
                }
                assert!(
                    got == want,
                    "{at}: content read through the chunk table differs"
                );
            }
            Kind::CharDevice | Kind::BlockDevice => {
                let (major, minor) = inode.rdev();
                assert_eq!(
                    (major, minor),
                    (rustix::fs::major(st.rdev()), rustix::fs::minor(st.rdev())),
                    "{at}: rdev"
                );
            }
            Kind::Fifo | Kind::Socket => {}
        }
        compared += 1;
    }
    compared
}

/// Every xattr of `path` (not following a symlink) with its value.
fn kernel_xattrs(path: &Path) -> BTreeMap<Vec<u8>, Vec<u8>> {
    let mut names = vec![0u8; 64 << 10];
    let n = rustix::fs::llistxattr(path, &mut names[..]).unwrap();
    let mut out = BTreeMap::new();
    for name in names[..n].split(|&b| b == 0).filter(|n| !n.is_empty()) {
        let mut value = vec![0u8; 64 << 10];
        let cname = std::ffi::CString::new(name).unwrap();
        let len = rustix::fs::lgetxattr(path, cname.as_c_str(), &mut value[..]).unwrap();
        value.truncate(len);
        out.insert(name.to_vec(), value);
    }
    out
}
