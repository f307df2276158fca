//! Eager FUSE mounts of local images: the edge tree, images without a
//! lookup table or xattrs, idle memory, passthrough to cached objects.

use std::ffi::OsStr;
use std::fs;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;
use std::time::Duration;

use crate::common::*;
use crate::{converted_edge, fs_type, fuse_daemons, without_lookup_layer, LOOKUP_TABLE_LINE};

/// convert oci:FIX/edge:edge, mount with --mode fuse, then:
/// * it is a FUSE mount (not the kernel's EROFS) with its daemon running;
/// * the daemon answers lookups from the image's lookup table;
/// * treecmp vs ociunpack.py of edge (no ignores) and vs `umoci unpack`
///   of edge-gz (ignoring the empty-valued xattrs umoci drops): 0
///   differences, every entry compared (type, mode, owner, size, content,
///   link target, device numbers, xattrs, mtime, hardlinks);
/// * empty-valued xattrs read back as present and empty;
/// * the POSIX ACL is enforced (user nobody reads through it);
/// * `lamina umount` unmounts and the daemon exits.
#[test]
fn fuse_mount_of_edge_matches_umoci_and_ociunpack() {
    if !require(&["umoci", "zstd"]) {
        return;
    }
    let t = TestDir::new("fuse-edge");
    let image = converted_edge(&t);
    let cache = t.join("cache");
    let m = Mount::with_args(&image, &t.join("mnt"), &cache, &["--mode", "fuse"]);
    assert_eq!(
        fs_type(&m.path).as_deref(),
        Some("fuse"),
        "not a FUSE mount"
    );
    let daemons = fuse_daemons(&cache);
    assert_eq!(daemons.len(), 1, "one FUSE daemon serves the mount");
    let table = m.info["lookup_path"].as_str().map(Path::new);
    assert!(
        table.is_some_and(|p| p.is_file()),
        "no lookup table cached: {}",
        m.info
    );
    let log = fuse_log(&cache, &m.path);
    assert!(log.contains(LOOKUP_TABLE_LINE), "fuse.log:\n{log}");

    let n = treecmp(&[], &ociunpack(&edge_layout(), "edge"), &m.path);
    assert!(n >= 5000, "edge has ~5,200 entries, compared only {n}");
    treecmp(UMOCI_IGNORES, umoci_edge_rootfs(), &m.path);
    for (path, name) in [
        ("xattrs/user", "user.empty"),
        ("xattrs/dir-empty", "user.empty"),
    ] {
        let mut buf = [0u8; 16];
        let got = rustix::fs::lgetxattr(m.path.join(path), name, &mut buf[..]);
        assert_eq!(got, Ok(0), "{path}: {name} should be present and empty");
    }
    // FUSE_POSIX_ACL: the kernel asks for the ACL and enforces it.
    assert_edge_acl_enforced(&t, &m.path);

    m.unmount();
    assert!(
        process_exits(daemons[0], Duration::from_secs(10)),
        "the FUSE daemon (pid {}) outlived its mount",
        daemons[0]
    );
}

/// An image converted before lookup tables (no lookup layer, format 2)
/// still mounts through FUSE: lookups search the directories, and the tree
/// equals ociunpack.py's.
#[test]
fn fuse_mount_of_an_image_without_lookup_table_searches_directories() {
    if !require(&[]) {
        return;
    }
    let t = TestDir::new("fuse-old");
    let out = t.join("out");
    lamina([
        "convert",
        &oci_ref(&edge_layout(), "edge"),
        &oci_ref(&out, "edge"),
    ])
    .ok();
    without_lookup_layer(&out, "edge", "old");
    let cache = t.join("cache");
    let m = Mount::with_args(
        &oci_ref(&out, "old"),
        &t.join("mnt"),
        &cache,
        &["--mode", "fuse"],
    );
    assert!(m.info["lookup_path"].is_null(), "{}", m.info);
    let n = treecmp(&[], &ociunpack(&edge_layout(), "edge"), &m.path);
    assert!(n >= 5000, "edge has ~5,200 entries, compared only {n}");
    let log = fuse_log(&cache, &m.path);
    assert!(!log.contains(LOOKUP_TABLE_LINE), "fuse.log:\n{log}");
    m.unmount();
}

/// The FUSE daemon's counters (`fuse-status.json` in the mount's run dir)
/// once `ready` says they are settled; panics after 10 s.
#[track_caller]
fn fuse_counters(cache: &Path, ready: impl Fn(&serde_json::Value) -> bool) -> serde_json::Value {
    let started = std::time::Instant::now();
    loop {
        let status = fs::read_dir(cache.join("mounts"))
            .into_iter()
            .flatten()
            .flatten()
            .find_map(|e| fs::read(e.path().join("fuse-status.json")).ok())
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok());
        if let Some(s) = status.filter(&ready) {
            return s;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "no settled fuse-status.json under {}",
            cache.display()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// An image whose manifest says no inode has extended attributes (misc's
/// minimal): the daemon answers getxattr EOPNOTSUPP, for ACLs too, which
/// `ls -l` (it asks for `security.selinux` and the ACL of every file) takes
/// as "none on this filesystem" and stops asking: each listing sends two
/// getxattr requests, not two per file. A listxattr is answered ENOSYS
/// once; the kernel answers every later one itself. Directories are
/// opened without asking (FUSE_NO_OPENDIR_SUPPORT): one opendir reaches
/// the daemon, not one per directory and listing.
#[test]
fn an_image_without_xattrs_costs_no_xattr_or_opendir_round_trips() {
    if !require(&[]) {
        return;
    }
    let t = TestDir::new("fuse-noxattr");
    let image = converted_without_xattrs(&t);
    let cache = t.join("cache");
    let m = Mount::with_args(&image, &t.join("mnt"), &cache, &["--mode", "fuse"]);
    const LISTINGS: u64 = 3;
    let mut entries = 0;
    for _ in 0..LISTINGS {
        let out = run(
            &mut command("ls", [OsStr::new("-lR"), m.path.as_os_str()]),
            SHORT,
        )
        .ok();
        let listed = out
            .stdout
            .lines()
            .filter(|l| l.starts_with(['-', 'd', 'l']))
            .count() as u64;
        entries = listed;
    }
    assert!(entries >= 3, "minimal lists {entries} entries");
    // The daemon rewrites its counters when they change: wait for the
    // first request to show, then give any later one time to.
    fuse_counters(&cache, |c| c["xattr_requests"].as_u64() > Some(0));
    std::thread::sleep(Duration::from_millis(500));
    let counters = fuse_counters(&cache, |_| true);
    let asked = counters["xattr_requests"].as_u64().unwrap();
    // Asked per entry, it would be at least two per entry and listing.
    assert!(
        asked <= 2 * LISTINGS,
        "{asked} xattr requests reached the daemon for {LISTINGS} listings of {entries} \
         entries: {counters}"
    );
    let mut buf = [0u8; 64];
    for file in ["hello", "etc/hostname"] {
        let path = m.path.join(file);
        let got = rustix::fs::lgetxattr(&path, "user.x", &mut buf[..]);
        assert_eq!(got, Err(rustix::io::Errno::NOTSUP), "{file}");
        let acl = rustix::fs::getxattr(&path, "system.posix_acl_access", &mut buf[..]);
        assert_eq!(acl, Err(rustix::io::Errno::NOTSUP), "{file}: ACL");
        let listed = rustix::fs::llistxattr(&path, &mut buf[..]);
        assert_eq!(listed, Err(rustix::io::Errno::NOTSUP), "{file}: list");
    }
    assert_eq!(
        counters["opendir_requests"], 1,
        "three listings of a tree of several directories: {counters}"
    );
    assert_eq!(
        fs::read(m.path.join("hello")).unwrap(),
        b"hello world\n",
        "and the files read right"
    );
    m.unmount();
}

/// Flat memory (issues 9, 10): a FUSE daemon at rest gives back the pages
/// of the metadata it mapped while serving. After a listing maps them, a
/// second without new pages counts as idle, and the daemon releases them
/// (counted as `mapped_releases`), however few; the image still reads right.
#[test]
fn an_idle_fuse_daemon_releases_the_pages_it_mapped() {
    if !require(&[]) {
        return;
    }
    let t = TestDir::new("fuse-idle");
    let image = converted_edge(&t);
    let cache = t.join("cache");
    let m = Mount::with_args(&image, &t.join("mnt"), &cache, &["--mode", "fuse"]);
    // Whatever the start mapped is released once it is idle, or was not
    // enough to: either way the counters settle.
    std::thread::sleep(Duration::from_millis(2500));
    let before = fuse_counters(&cache, |_| true)["mapped_releases"]
        .as_u64()
        .expect("mapped_releases counted");
    let list = || {
        run(
            &mut command("ls", [OsStr::new("-lR"), m.path.as_os_str()]),
            SHORT,
        )
        .ok()
        .stdout
    };
    let tree = list();
    // Panics unless a release is counted within 10 s.
    fuse_counters(&cache, |c| c["mapped_releases"].as_u64() > Some(before));
    assert!(tree.len() > 100, "a listing of the edge tree");
    assert!(list() == tree, "the tree lists the same after the release");
    m.unmount();
}

/// Passthrough (issue 9): an eager FUSE mount as root passes a big file
/// through to its object under cache/objects/<metadata-hex>/<nid>. The
/// first open does not wait for the object: the daemon serves it while the
/// object is made; the next open is passed through, and it is the kernel
/// that reads it: bytes written into the object while the file is open
/// show through the mount (the daemon would read the blob cache instead);
/// the daemon counts the passthrough open. A small file is
/// read through the daemon and gets no object. An overlay on the mount
/// (stack depth 1) reads the big file's bytes and takes writes.
// Over 100 lines: one mount checked each way a file is served, in the order its doc gives.
#[test]
fn fuse_passthrough_serves_big_complete_files_from_their_objects() {
    if !require(&[]) {
        return;
    }
    let t = TestDir::new("fuse-passthrough");
    let image = converted_edge(&t);
    let cache = t.join("cache");
    let m = Mount::with_args(&image, &t.join("mnt"), &cache, &["--mode", "fuse"]);
    let reference = ociunpack(&edge_layout(), "edge");
    let (big, small) = ("files/big-1m5", "files/size-4097");
    let want = fs::read(reference.join(big)).unwrap();
    assert!(want.len() >= 64 << 10, "{big} is not big");

    // The first open: served by the daemon, the object made meanwhile.
    let first = fs::File::open(m.path.join(big)).unwrap();
    let mut whole = vec![0u8; want.len()];
    first.read_exact_at(&mut whole, 0).unwrap();
    assert!(whole == want, "{big} through the daemon");
    drop(first);
    let s = fuse_counters(&cache, |s| s["objects_created"].as_u64() >= Some(1));
    assert_eq!(s["passthrough_opens"], 0, "the first open waited: {s}");
    assert!(s["daemon_reads"].as_u64() >= Some(1), "{s}");

    let file = fs::File::open(m.path.join(big)).unwrap();
    // The mount's inode numbers are nids + 2 (the root is 1).
    let nid = file.metadata().unwrap().ino() - 2;
    // Beside objects/content: the objects by content the image's link.
    let dirs: Vec<_> = fs::read_dir(cache.join("objects"))
        .expect("no objects dir in the cache")
        .flatten()
        .map(|e| e.path())
        .filter(|p| !p.ends_with("content"))
        .collect();
    assert_eq!(dirs.len(), 1, "one objects dir per image: {dirs:?}");
    let object = dirs[0].join(nid.to_string());
    assert!(
        fs::read(&object).ok() == Some(want.clone()),
        "{} does not hold {big}'s bytes",
        object.display()
    );
    // objects/<metadata layer hex>.<entries>: named by what its objects
    // were copied from (docs/lazy.md, "Many tenants").
    let name = dirs[0].file_name().unwrap().to_string_lossy().to_string();
    let (meta, entries) = name.split_once('.').expect("objects/<metadata>.<entries>");
    assert!(
        cache_files_in(&cache, "meta")
            .iter()
            .any(|p| p.file_name() == Some(OsStr::new(&format!("{meta}.erofs")))),
        "objects dir {name} is not named after the metadata"
    );
    assert_eq!(entries.len(), 32, "objects dir {name}: entries part");

    // Who reads: change the object under the open file.
    let at = 4096 + 7;
    let writer = fs::OpenOptions::new().write(true).open(&object).unwrap();
    writer.write_all_at(b"PASSTHRU", at).unwrap();
    let mut got = [0u8; 8];
    file.read_exact_at(&mut got, at).unwrap();
    assert_eq!(
        &got, b"PASSTHRU",
        "the mount's reads do not come from the object"
    );
    writer.write_all_at(&want[at as usize..][..8], at).unwrap();
    file.read_exact_at(&mut whole, 0).unwrap();
    assert!(
        whole == want,
        "{big} through the mount differs from the reference"
    );
    drop(file);
    let s = fuse_counters(&cache, |s| s["passthrough_opens"].as_u64() >= Some(1));
    assert_eq!(s["passthrough"], true, "{s}");
    assert_eq!(s["objects_created"], 1, "only {big} was opened: {s}");

    // A small file: read by the daemon, no object.
    let before = s["daemon_reads"].as_u64().unwrap_or(0);
    let small_file = fs::File::open(m.path.join(small)).unwrap();
    let small_nid = small_file.metadata().unwrap().ino() - 2;
    drop(small_file);
    assert_eq!(
        fs::read(m.path.join(small)).unwrap(),
        fs::read(reference.join(small)).unwrap(),
        "{small} through the mount"
    );
    assert!(
        !dirs[0].join(small_nid.to_string()).exists(),
        "{small} got an object"
    );
    let s = fuse_counters(&cache, |s| s["daemon_reads"].as_u64() > Some(before));
    assert_eq!(s["objects_created"], 1, "{s}");

    // An overlay on top (a container's writable layer).
    let ovl = Overlay::mount(&m.path, &t.mkdir("ovl"));
    assert!(
        fs::read(ovl.merged.join(big)).unwrap() == want,
        "{big} through the overlay"
    );
    fs::write(ovl.merged.join("files/written"), b"upper\n").unwrap();
    let mut changed = want.clone();
    changed[..5].copy_from_slice(b"HELLO");
    fs::write(ovl.merged.join(big), &changed).unwrap();
    assert_eq!(
        fs::read(ovl.merged.join("files/written")).unwrap(),
        b"upper\n"
    );
    assert!(
        fs::read(ovl.merged.join(big)).unwrap() == changed,
        "write through the overlay"
    );
    assert!(
        fs::read(t.join("ovl/upper").join(big)).unwrap() == changed,
        "copy-up"
    );
    ovl.unmount();
    assert!(
        fs::read(m.path.join(big)).unwrap() == want,
        "the lower changed"
    );
    m.unmount();
}
