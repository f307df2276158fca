//! `lamina mount --mode fuse`: the edge fixture served by the FUSE daemon,
//! eagerly and lazily, must be the tree two independent unpackers produce.

mod common;

use std::ffi::OsStr;
use std::fs;
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;

/// The filesystem type mounted at `mnt` (from /proc/self/mounts).
fn fs_type(mnt: &Path) -> Option<String> {
    let canonical = fs::canonicalize(mnt).ok()?;
    let mounts = fs::read_to_string("/proc/self/mounts").ok()?;
    // The last mount at a path is the one seen there.
    mounts.lines().rev().find_map(|l| {
        let f: Vec<&str> = l.split(' ').collect();
        (f.len() > 2 && Path::new(f[1]) == canonical).then(|| f[2].to_string())
    })
}

/// Pids of FUSE daemons serving from `cache`.
fn fuse_daemons(cache: &Path) -> Vec<u32> {
    let needle = format!("internal-fuse\0{}", cache.display());
    fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(&needle))
        })
        .collect()
}

/// The worker's status of a lazy mount, once it has written one (it writes
/// within ~25 ms of a change).
#[track_caller]
fn worker_status(m: &Mount) -> serde_json::Value {
    let started = std::time::Instant::now();
    loop {
        std::thread::sleep(Duration::from_millis(100));
        let s = m.status().map(|e| e["status"].clone());
        if let Some(s) = s.filter(|s| s.is_object()) {
            return s;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "no worker status for {} in 10 s",
            m.path.display()
        );
    }
}

/// The edge fixture converted into `t/out`: its reference.
fn converted_edge(t: &TestDir) -> String {
    let image = oci_ref(&t.join("out"), "edge");
    lamina(["convert", &oci_ref(&edge_layout(), "edge"), &image]).ok();
    image
}

/// The FUSE daemon's log of the mount at `mnt` served from `cache`.
fn fuse_log(cache: &Path, mnt: &Path) -> String {
    let config = fs::read_dir(cache.join("mounts"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .find(|run| {
            fs::read(run.join("fuse.json")).is_ok_and(|c| {
                let c: serde_json::Value = serde_json::from_slice(&c).unwrap_or_default();
                c["mountpoint"].as_str().map(Path::new) == Some(canonical(mnt).as_path())
            })
        });
    let run = config.unwrap_or_else(|| panic!("no FUSE daemon config for {}", mnt.display()));
    fs::read_to_string(run.join("fuse.log")).unwrap_or_default()
}

/// What the FUSE daemon logs when it answers lookups through the table.
const LOOKUP_TABLE_LINE: &str = "lookups through the lookup table";

/// A copy of `tag` in the layout `dir`, tagged `new_tag`, as images were
/// before lookup tables: no lookup layer, format version 2.
fn without_lookup_layer(dir: &Path, tag: &str, new_tag: &str) {
    let mut manifest = read_manifest(dir, tag);
    let layers = manifest["layers"].as_array_mut().unwrap();
    let lookup = "application/vnd.oci.image.layer.lamina.lookup.v1+zstd";
    let at = layers.iter().position(|l| l["mediaType"] == lookup);
    let removed = layers.remove(at.expect("the image has a lookup layer"));
    manifest["annotations"]["dev.lamina.format"] = "2".into();
    // The config lists the layers too.
    let config_path = blob_path(dir, manifest["config"]["digest"].as_str().unwrap());
    let mut config: serde_json::Value =
        serde_json::from_slice(&fs::read(config_path).unwrap()).unwrap();
    let diff_ids = config["rootfs"]["diff_ids"].as_array_mut().unwrap();
    diff_ids.retain(|d| *d != removed["digest"]);
    let config = serde_json::to_vec(&config).unwrap();
    manifest["config"]["digest"] = put_blob(dir, &config).into();
    manifest["config"]["size"] = config.len().into();
    tag_manifest(dir, tag, new_tag, &manifest);
}

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
    let dirs: Vec<_> = fs::read_dir(cache.join("objects"))
        .expect("no objects dir in the cache")
        .flatten()
        .map(|e| e.path())
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
        cache.join("meta").join(format!("{meta}.erofs")).exists(),
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

/// A lazy FUSE mount of a local image: nothing is filled at mount time,
/// and the lookup table is not fetched before the mount either: the worker
/// fetches it after, and the daemon takes it up once it is recorded;
/// reading the tree then fills it through the worker (misses counted in
/// `lamina status`), and it equals ociunpack.py's; `lamina umount` stops
/// the FUSE daemon and its worker, which leaves what it filled recorded as
/// verified: a second lazy mount of the same cache reads the tree without
/// fetching a byte.
///
/// The image's metadata is in frames of 4 KiB, so the daemon decompresses
/// it a frame at a time as requests need them (and the rest in the
/// background), then hashes and records it: the second mount takes it as
/// it is.
#[test]
fn lazy_fuse_mount_fills_on_read_and_equals_ociunpack() {
    if !require(&[]) {
        return;
    }
    let t = TestDir::new("fuse-lazy");
    let image = oci_ref(&t.join("out"), "edge");
    let edge = oci_ref(&edge_layout(), "edge");
    lamina(["convert", "--metadata-frame-size", "4K", &edge, &image]).ok();
    let cache = t.join("cache");
    let args = ["--mode", "fuse", "--lazy", "--prefetch", "none"];
    let m = Mount::with_args(&image, &t.join("mnt"), &cache, &args);
    assert_eq!(fs_type(&m.path).as_deref(), Some("fuse"));
    let before = worker_status(&m);
    assert_eq!(before["cached_bytes"], 0, "filled at mount time: {before}");
    let deadline = Instant::now() + Duration::from_secs(30);
    let log = loop {
        let log = fuse_log(&cache, &m.path);
        if log.contains("lookups through the lookup table from now on") {
            break log;
        }
        assert!(
            Instant::now() < deadline,
            "no lookup table after 30 s:\n{log}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let at_start =
        |l: &&str| l.contains("lookups through the lookup table") && !l.contains("from now on");
    assert!(
        !log.lines().any(|l| at_start(&l)),
        "the daemon started with the table, fetched before the mount:\n{log}"
    );

    treecmp(&[], &ociunpack(&edge_layout(), "edge"), &m.path);
    let frames = wait_for_log(&cache, &m.path, "metadata hashed and recorded");
    let written = frames
        .lines()
        .find(|l| l.contains("metadata frames all written"))
        .unwrap_or_else(|| panic!("no frames line:\n{frames}"));
    let count = written
        .split("frames=")
        .nth(1)
        .and_then(|v| v.split(' ').next());
    assert!(
        count.and_then(|c| c.parse::<u32>().ok()) > Some(3),
        "the metadata in several frames: {written}"
    );
    let after = worker_status(&m);
    let misses = after["misses"].as_u64().unwrap_or(0);
    assert!(misses > 0, "the tree read without misses: {after}");
    assert_eq!(after["failed_misses"], 0, "{after}");
    assert!(
        after["fetched_bytes"].as_u64().unwrap_or(0) > 0,
        "nothing fetched: {after}"
    );
    let daemons = fuse_daemons(&cache);
    assert_eq!(daemons.len(), 1, "one FUSE daemon serves the mount");
    let report = m.unmount();
    assert!(
        process_exits(daemons[0], Duration::from_secs(10)),
        "the FUSE daemon (pid {}) outlived its mount",
        daemons[0]
    );
    let workers = report["last_status"]["pid"].as_u64();
    assert!(workers.is_some(), "no worker status at umount: {report}");
    assert!(
        process_exits(workers.unwrap_or(0) as u32, Duration::from_secs(10)),
        "the worker outlived its mount: {report}"
    );

    let again = Mount::with_args(&image, &t.join("mnt2"), &cache, &args);
    treecmp(&[], &ociunpack(&edge_layout(), "edge"), &again.path);
    let s = worker_status(&again);
    assert_eq!(s["fetched_bytes"], 0, "a filled cache fetched again: {s}");
    let log = fuse_log(&cache, &again.path);
    assert!(
        !log.contains("metadata frames"),
        "the recorded metadata was not taken as it is:\n{log}"
    );
    again.unmount();
}

/// The FUSE daemon's log at `mnt` once it holds `line` (within 30 s).
#[track_caller]
fn wait_for_log(cache: &Path, mnt: &Path, line: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let log = fuse_log(cache, mnt);
        if log.contains(line) {
            return log;
        }
        assert!(Instant::now() < deadline, "no {line:?} in 30 s:\n{log}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The `read_ahead_kb` of the FUSE mount at `mnt` (its bdi is named after
/// its anonymous device).
fn fuse_read_ahead_kb(mnt: &Path) -> u32 {
    let dev = fs::metadata(mnt).unwrap().dev();
    let bdi = format!("{}:{}", rustix::fs::major(dev), rustix::fs::minor(dev));
    let path = Path::new("/sys/class/bdi").join(bdi).join("read_ahead_kb");
    let text = fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.trim().parse().unwrap()
}

/// A lazy FUSE mount asked for `--readahead 0` (as when recording a trace
/// or serving boot pages) has no readahead while blobs are missing, as the
/// kernel path has: each page read ahead is a page fetched. Once every blob
/// is complete (`--prefetch all`), the kernel's readahead is back.
#[test]
fn lazy_fuse_mount_lowers_readahead_until_complete() {
    if !require(&[]) {
        return;
    }
    let t = TestDir::new("fuse-readahead");
    let image = converted_edge(&t);
    let cache = t.join("cache");
    let args = [
        "--mode",
        "fuse",
        "--lazy",
        "--prefetch",
        "none",
        "--readahead",
        "0",
    ];
    let m = Mount::with_args(&image, &t.join("mnt"), &cache, &args);
    let started = std::time::Instant::now();
    while fuse_read_ahead_kb(&m.path) != 0 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "read_ahead_kb still {} while nothing is cached",
            fuse_read_ahead_kb(&m.path)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    m.unmount();

    let args = [
        "--mode",
        "fuse",
        "--lazy",
        "--prefetch",
        "all",
        "--readahead",
        "0",
    ];
    let m = Mount::with_args(&image, &t.join("mnt2"), &cache.join("2"), &args);
    let started = std::time::Instant::now();
    loop {
        let s = worker_status(&m);
        let complete = s["blobs"]
            .as_array()
            .is_some_and(|b| !b.is_empty() && b.iter().all(|b| b["complete"] == true));
        if complete && fuse_read_ahead_kb(&m.path) > 0 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "complete: {complete}, read_ahead_kb {}: {s}",
            fuse_read_ahead_kb(&m.path)
        );
    }
    m.unmount();
}

/// `--mode auto` (the default) on this host: the kernel path with the cache
/// on ext4; FUSE with the cache on a tmpfs the test mounts (file-backed
/// EROFS refuses tmpfs files and tmpfs has no pre-content events), for a
/// local image (eager) and for a registry image (lazy). Both say which path
/// and why, and the FUSE mounts serve the tree ociunpack.py produces.
#[test]
fn auto_mode_picks_fuse_where_the_kernel_path_cannot_serve() {
    if !require(&["docker-registry"]) {
        return;
    }
    let t = TestDir::new("fuse-auto");
    let local = oci_ref(&t.join("out"), "edge");
    lamina(["convert", &oci_ref(&edge_layout(), "edge"), &local]).ok();
    let reference = ociunpack(&edge_layout(), "edge");

    let k = Mount::new(&local, &t.join("kernel"), &t.join("cache"));
    assert_eq!(k.info["mode"], "kernel", "{}", k.info);
    assert!(
        k.info["mode_reason"]
            .as_str()
            .unwrap_or("")
            .contains("ext4"),
        "{}",
        k.info
    );
    assert_eq!(fs_type(&k.path).as_deref(), Some("erofs"));
    k.unmount();

    let tmpfs = t.join("tmpfs");
    fs::create_dir_all(&tmpfs).unwrap();
    run(
        &mut command(
            tool("mount"),
            [
                "-t".as_ref(),
                "tmpfs".as_ref(),
                "tmpfs".as_ref(),
                tmpfs.as_os_str(),
            ],
        ),
        SHORT,
    )
    .ok();
    let reg = Registry::start();
    let remote = format!("docker://{}/edge:lamina", reg.host());
    lamina(["convert", &oci_ref(&edge_layout(), "edge"), &remote]).ok();
    for (image, name) in [(&local, "local"), (&remote, "remote")] {
        let m = Mount::new(image, &t.join(name), &tmpfs.join("cache"));
        assert_eq!(m.info["mode"], "fuse", "{name}: {}", m.info);
        assert!(
            m.info["mode_reason"]
                .as_str()
                .unwrap_or("")
                .contains("tmpfs"),
            "{name}: {}",
            m.info
        );
        assert_eq!(fs_type(&m.path).as_deref(), Some("fuse"), "{name}");
        treecmp(&[], &reference, &m.path);
        m.unmount();
    }
    reg.stop();
}

/// The unprivileged user the rootless test runs as.
const NOBODY: u32 = 65534;

/// `lamina ARGS` as user nobody, with `home` as its home and cache root.
fn lamina_as_nobody(home: &Path, args: &[&OsStr]) -> Output {
    let mut c = command(
        tool("setpriv"),
        [
            OsStr::new(&format!("--reuid={NOBODY}")),
            OsStr::new(&format!("--regid={NOBODY}")),
            OsStr::new("--clear-groups"),
            OsStr::new(LAMINA),
        ],
    );
    c.args(args)
        .env_remove("LAMINA_CACHE_DIR")
        .env("HOME", home)
        .env("XDG_CACHE_HOME", home.join("cache"));
    run(&mut c, TIMEOUT)
}

/// Puts /dev/fuse's mode back when dropped.
struct DevFuseMode(u32);

/// The rootless tests open /dev/fuse to everyone for their run: one at a
/// time, or the first to end puts the mode back under the other (seen: the
/// podman test's mount failed with EACCES).
static DEV_FUSE: std::sync::Mutex<()> = std::sync::Mutex::new(());

impl Drop for DevFuseMode {
    fn drop(&mut self) {
        let _ = fs::set_permissions("/dev/fuse", fs::Permissions::from_mode(self.0));
    }
}

/// Rootless (issue 9): user nobody mounts the edge image lazily through
/// fusermount3 with no --cache-dir: auto mode says FUSE because it is not
/// root, the cache lands in `$XDG_CACHE_HOME/lamina` (0700), and the mount
/// belongs to nobody. Through it, and through a user namespace nobody
/// makes (as a rootless runtime does), every file nobody may read has the
/// reference bytes. nobody's `lamina umount` unmounts it (fusermount3 -u)
/// and the daemon exits.
///
/// A normal host's /dev/fuse is 0666 (fusermount3 opens it as the user);
/// where it is not (this CI's is 0600) the test opens it up and restores it.
#[test]
fn rootless_lazy_fuse_mount_through_fusermount3() {
    if !require(&["setpriv", "fusermount3", "unshare"]) {
        return;
    }
    let _one_at_a_time = DEV_FUSE.lock().unwrap_or_else(|e| e.into_inner());
    let mode = fs::metadata("/dev/fuse").unwrap().permissions().mode() & 0o7777;
    let _restore = DevFuseMode(mode);
    fs::set_permissions("/dev/fuse", fs::Permissions::from_mode(0o666)).unwrap();
    let t = TestDir::new("fuse-rootless");
    fs::set_permissions(t.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let image = oci_ref(&t.join("img"), "edge");
    lamina(["convert", &oci_ref(&edge_layout(), "edge"), &image]).ok();
    let (home, mnt) = (t.mkdir("home"), t.mkdir("mnt"));
    let chown = |p: &Path| {
        let mut c = command(
            "chown",
            [OsStr::new("-R"), OsStr::new("65534:65534"), p.as_os_str()],
        );
        run(&mut c, SHORT).ok();
    };
    for p in [&t.join("img"), &home, &mnt] {
        chown(p);
    }
    let _watch = MountWatch(mnt.clone(), home.join("cache/lamina"));

    let out = lamina_as_nobody(
        &home,
        &["mount", "--json", "--lazy", &image, mnt.to_str().unwrap()].map(OsStr::new),
    )
    .ok();
    let info = out.json();
    assert_eq!(info["mode"], "fuse", "{info}");
    assert!(
        info["mode_reason"]
            .as_str()
            .unwrap_or("")
            .contains("not root"),
        "{info}"
    );
    let cache = home.join("cache/lamina");
    let meta = fs::metadata(&cache).expect("the default rootless cache dir");
    assert_eq!(meta.permissions().mode() & 0o777, 0o700, "cache dir mode");
    assert_eq!(meta.uid(), NOBODY, "cache dir owner");
    let line = fs::read_to_string("/proc/self/mounts")
        .unwrap()
        .lines()
        .find(|l| l.split(' ').nth(1) == Some(mnt.to_str().unwrap()))
        .map(str::to_string)
        .expect("the mount in /proc/self/mounts");
    assert!(
        line.contains("fuse.lamina") && line.contains(&format!("user_id={NOBODY}")),
        "not nobody's FUSE mount: {line}"
    );

    // nobody reads every file it may read, directly and from inside a user
    // namespace of its own; root, not the mount's owner, is kept out.
    let reference = ociunpack(&edge_layout(), "edge");
    let script = "import hashlib,os,sys\n\
        for d,_,fs in os.walk(sys.argv[1]):\n\
        \x20 for f in fs:\n\
        \x20   p=os.path.join(d,f)\n\
        \x20   if os.path.isfile(p) and not os.path.islink(p) and os.access(p,os.R_OK):\n\
        \x20     print(hashlib.sha256(open(p,'rb').read()).hexdigest(), os.path.relpath(p,sys.argv[1]))\n";
    // The system python: a per-user one (pyenv under /root) is not for nobody.
    let (python, unshare) = (Path::new("/usr/bin/python3"), tool("unshare"));
    for userns in [false, true] {
        let mut args: Vec<&OsStr> = vec![
            OsStr::new("--reuid=65534"),
            OsStr::new("--regid=65534"),
            OsStr::new("--clear-groups"),
        ];
        if userns {
            args.extend([
                unshare.as_os_str(),
                OsStr::new("--user"),
                OsStr::new("--map-root-user"),
            ]);
        }
        args.extend([
            python.as_os_str(),
            OsStr::new("-c"),
            OsStr::new(script),
            mnt.as_os_str(),
        ]);
        let out = run(&mut command(tool("setpriv"), args), TIMEOUT).ok();
        let mut compared = 0;
        for line in out.stdout.lines() {
            let (hash, path) = line.split_once(' ').expect("hash path");
            assert_eq!(
                hash,
                sha256_file(&reference.join(path)),
                "{path} read by nobody (user namespace: {userns})"
            );
            compared += 1;
        }
        assert!(
            compared >= 1000,
            "only {compared} files readable by nobody (userns {userns})"
        );
    }
    assert!(
        fs::read_dir(&mnt).is_err(),
        "root could list nobody's mount made without allow_other"
    );

    let status = lamina_as_nobody(&home, &["status", "--json"].map(OsStr::new)).ok();
    assert!(status.stdout.contains("misses"), "{}", status.describe());
    let daemons = fuse_daemons(&cache);
    assert_eq!(daemons.len(), 1, "one FUSE daemon serves the mount");
    lamina_as_nobody(&home, &[OsStr::new("umount"), mnt.as_os_str()]).ok();
    assert!(!is_mountpoint(&mnt), "still mounted after nobody's umount");
    assert!(
        process_exits(daemons[0], Duration::from_secs(10)),
        "the FUSE daemon outlived its mount"
    );
}

/// User nobody's podman: `home` holds its storage, config and cache, and
/// `run` is its runtime dir, under a short name of its own: with an
/// XDG_RUNTIME_DIR of 40 characters or more, podman 4.3's exit command
/// refuses the runroot and `podman run` waits 20 s (docs/fuse.md).
///
/// Dropping it ends nobody's podman user namespace and any lamina daemon
/// serving from the cache under its home: a mount left in that namespace
/// would otherwise keep its daemon, and the daemon the namespace, alive.
struct NobodyPodman {
    home: PathBuf,
    run: tempfile::TempDir,
}

impl NobodyPodman {
    /// Makes `home` and a runtime dir, both nobody's.
    fn new(home: PathBuf) -> NobodyPodman {
        let run_dir = tempfile::Builder::new()
            .prefix("lamina-run-")
            .tempdir()
            .expect("a runtime dir");
        fs::set_permissions(run_dir.path(), fs::Permissions::from_mode(0o700)).unwrap();
        for p in [&home, run_dir.path()] {
            let mut c = command(
                "chown",
                [OsStr::new("-R"), OsStr::new("65534:65534"), p.as_os_str()],
            );
            run(&mut c, SHORT).ok();
        }
        NobodyPodman { home, run: run_dir }
    }

    /// `podman ARGS` as nobody.
    fn podman(&self, args: &[&str]) -> Output {
        let mut c = command(
            tool("setpriv"),
            [
                OsStr::new(&format!("--reuid={NOBODY}")),
                OsStr::new(&format!("--regid={NOBODY}")),
                OsStr::new("--clear-groups"),
                tool("podman").as_os_str(),
            ],
        );
        c.args(args)
            .env_remove("LAMINA_CACHE_DIR")
            .env("HOME", &self.home)
            .env("XDG_RUNTIME_DIR", self.run.path())
            .env("XDG_CONFIG_HOME", self.home.join("config"))
            .env("XDG_DATA_HOME", self.home.join("data"))
            .env("XDG_CACHE_HOME", self.home.join("cache"));
        run(&mut c, TIMEOUT)
    }
}

impl Drop for NobodyPodman {
    fn drop(&mut self) {
        let _ = self.podman(&["system", "migrate"]);
        let mut kill = command("pkill", [OsStr::new("-f"), self.home.as_os_str()]);
        let _ = try_run(&mut kill, SHORT);
    }
}

/// Hashes every file under /usr/lib/python3.11 in order: one digest.
const HASH_PYTHON_LIB: &str = "cd usr/lib/python3.11 && find . -type f | LC_ALL=C sort | \
                               xargs -d '\\n' sha256sum | sha256sum";

/// Rootless podman (issue 9): user nobody, with subordinate ids
/// (scripts/setup.sh gives it 200000-265535), mounts the Debian image lazily
/// inside podman's own user namespace (`podman unshare lamina mount`, so
/// the image's files belong to the container's users there), and `podman
/// run --rootfs MNT:O` runs python3 from it without root. The container's
/// write lands in podman's overlay, not in the image; the files of
/// /usr/lib/python3.11 read in the container hash as ociunpack.py's tree
/// has them; `podman unshare lamina umount` unmounts it.
#[test]
fn rootless_podman_runs_python3_from_a_lamina_mount() {
    if !require(&["setpriv", "podman", "newuidmap"]) {
        return;
    }
    let subuid = fs::read_to_string("/etc/subuid").unwrap_or_default();
    assert!(
        subuid.lines().any(|l| l.starts_with("nobody:")),
        "nobody has no subordinate uids: scripts/setup.sh adds them"
    );
    let _one_at_a_time = DEV_FUSE.lock().unwrap_or_else(|e| e.into_inner());
    let mode = fs::metadata("/dev/fuse").unwrap().permissions().mode() & 0o7777;
    let _restore = DevFuseMode(mode);
    fs::set_permissions("/dev/fuse", fs::Permissions::from_mode(0o666)).unwrap();
    let t = TestDir::new("podman-rootless");
    fs::set_permissions(t.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let image = oci_ref(&t.join("img"), "deb");
    lamina(["convert", &oci_ref(&debian_source(), "bookworm"), &image]).ok();
    let mnt = t.mkdir("mnt");
    for p in [&t.join("img"), &mnt] {
        let mut c = command(
            "chown",
            [OsStr::new("-R"), OsStr::new("65534:65534"), p.as_os_str()],
        );
        run(&mut c, SHORT).ok();
    }
    let nobody = NobodyPodman::new(t.mkdir("home"));
    let podman = |args: &[&str]| nobody.podman(args);
    let mnt_arg = mnt.to_str().unwrap();

    let out = podman(&[
        "unshare", LAMINA, "mount", "--json", "--lazy", &image, mnt_arg,
    ])
    .ok();
    let info = out.json();
    assert_eq!(info["mode"], "fuse", "{info}");
    assert!(
        info["mode_reason"]
            .as_str()
            .unwrap_or("")
            .contains("not root"),
        "root of a user namespace is not root of the host: {info}"
    );
    let script = format!(
        "python3 -c 'print(\"hello from rootless podman\")' && \
         echo written > /etc/lamina-test && cat /etc/lamina-test && cd / && {HASH_PYTHON_LIB}"
    );
    // --ulimit host: podman raises the open-files limit past nobody's
    // hard limit otherwise. cgroupfs: no systemd user session here.
    let rootfs = format!("{mnt_arg}:O");
    let out = podman(&[
        "--cgroup-manager=cgroupfs",
        "run",
        "--rm",
        "--network",
        "none",
        "--ulimit",
        "host",
        "--rootfs",
        &rootfs,
        "sh",
        "-c",
        &script,
    ])
    .ok();
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(
        lines.get(..2),
        Some(&["hello from rootless podman", "written"][..]),
        "{}",
        out.describe()
    );
    let reference = ociunpack(&debian_source(), "bookworm");
    let script = HASH_PYTHON_LIB.replace("cd usr", &format!("cd {}/usr", reference.display()));
    let want = run(&mut command("bash", ["-c", &script]), TIMEOUT)
        .ok()
        .stdout;
    assert_eq!(
        lines.get(2).copied(),
        Some(want.trim()),
        "{}",
        out.describe()
    );

    // The write went to podman's overlay, not into the image.
    let listed = podman(&["unshare", "ls", "-a", &format!("{mnt_arg}/etc")]).ok();
    assert!(
        listed.stdout.contains("os-release") && !listed.stdout.contains("lamina-test"),
        "{}",
        listed.describe()
    );
    podman(&["unshare", LAMINA, "umount", mnt_arg]).ok();
    let listed = podman(&["unshare", "ls", "-A", mnt_arg]).ok();
    assert_eq!(listed.stdout, "", "still mounted:\n{}", listed.describe());
}
