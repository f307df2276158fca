//! `lamina mount --mode fuse`: the edge fixture served by the FUSE daemon
//! from the cache must be the tree two independent unpackers produce, and
//! what the FUSE path does not do yet (lazy reads) is refused clearly.

mod common;

use std::ffi::OsStr;
use std::fs;
use std::path::Path;
use std::time::Duration;

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

/// convert oci:FIX/edge:edge, mount with --mode fuse, then:
/// * it is a FUSE mount (not the kernel's EROFS) with its daemon running;
/// * treecmp vs ociunpack.py of edge (no ignores) and vs `umoci unpack`
///   of edge-gz (ignoring the empty-valued xattrs umoci drops): 0
///   differences, every entry compared (type, mode, owner, size, content,
///   link target, device numbers, xattrs, mtime, hardlinks);
/// * empty-valued xattrs read back as present and empty;
/// * `lamina umount` unmounts and the daemon exits.
#[test]
fn fuse_mount_of_edge_matches_umoci_and_ociunpack() {
    if !require(&["umoci", "zstd"]) {
        return;
    }
    let t = TestDir::new("fuse-edge");
    let image = oci_ref(&t.join("out"), "edge");
    lamina(["convert", &oci_ref(&edge_layout(), "edge"), &image]).ok();
    let cache = t.join("cache");
    let m = Mount::with_args(&image, &t.join("mnt"), &cache, &["--mode", "fuse"]);
    assert_eq!(
        fs_type(&m.path).as_deref(),
        Some("fuse"),
        "not a FUSE mount"
    );
    let daemons = fuse_daemons(&cache);
    assert_eq!(daemons.len(), 1, "one FUSE daemon serves the mount");

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

    m.unmount();
    assert!(
        process_exits(daemons[0], Duration::from_secs(10)),
        "the FUSE daemon (pid {}) outlived its mount",
        daemons[0]
    );
}

/// Lazy FUSE mounts do not exist yet: asking for one fails with a clear
/// message and mounts nothing.
#[test]
fn fuse_mount_refuses_what_it_cannot_do_yet() {
    if !require(&[]) {
        return;
    }
    let t = TestDir::new("fuse-lazy");
    let image = oci_ref(&t.join("out"), "edge");
    lamina(["convert", &oci_ref(&edge_layout(), "edge"), &image]).ok();
    let mnt = t.join("mnt");
    fs::create_dir_all(&mnt).unwrap();
    let _watch = MountWatch(mnt.clone(), t.join("cache"));
    let out = lamina([
        OsStr::new("mount"),
        OsStr::new("--mode"),
        OsStr::new("fuse"),
        OsStr::new("--lazy"),
        OsStr::new(&image),
        mnt.as_os_str(),
        OsStr::new("--cache-dir"),
        t.join("cache").as_os_str(),
    ])
    .failed();
    assert!(
        out.stderr.contains("lazy FUSE mounts"),
        "unclear refusal:\n{}",
        out.describe()
    );
    assert!(!is_mountpoint(&mnt), "something was mounted");
}

/// `--mode auto` (the default) on this host: the kernel path with the cache
/// on ext4; FUSE with the cache on a tmpfs the test mounts (file-backed
/// EROFS refuses tmpfs files and tmpfs has no pre-content events), for a
/// local image and for a registry image that would otherwise mount lazily
/// (its cache is filled whole first). Both say which path and why, and
/// the FUSE mounts serve the tree ociunpack.py produces.
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
