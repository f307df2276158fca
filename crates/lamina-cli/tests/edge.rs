//! The edge fixture (every tar/layer corner case of `mkimage.py edge`) and the
//! small misc images: convert, mount with the kernel, compare the mounted
//! tree with two independent unpackers (umoci and tests/tools/ociunpack.py),
//! and check the EROFS image with fsck.erofs.

mod common;

use common::*;

/// Empty-valued xattrs, which umoci drops (Go's archive/tar reads an empty
/// PAX value as "unset"); lamina and ociunpack.py keep them (issue 7).
const EMPTY_XATTRS: &[(&str, &str)] = &[
    ("xattrs/user", "user.empty"),
    ("xattrs/only-empty", "user.empty"),
    ("xattrs/dir-empty", "user.empty"),
    ("xattrs/symlink-empty", "trusted.empty"),
];

/// convert oci:FIX/edge:edge -> oci:OUT:edge, mount, then:
/// * treecmp vs `umoci unpack` of edge-gz (ignoring the empty-valued
///   xattrs, which umoci drops), 0 differences;
/// * treecmp vs ociunpack.py of edge, no ignores, 0 differences;
/// * every empty-valued xattr reads back from the mount as present and empty;
/// * the POSIX ACL is enforced (user nobody reads through it);
/// * fsck.erofs with the blob caches as devices, exit 0;
/// * lamina's own EROFS reader (the FUSE path's) sees what the kernel
///   mounts, entry by entry and byte by byte.
#[test]
fn edge_mount_matches_umoci_and_ociunpack() {
    if !require(&["umoci", "fsck.erofs", "zstd"]) {
        return;
    }
    let t = TestDir::new("edge");
    let out = t.join("out");
    let image = oci_ref(&out, "edge");
    let report = lamina([
        "convert",
        "--json",
        &oci_ref(&edge_layout(), "edge"),
        &image,
    ])
    .ok()
    .json();
    let m = Mount::new(&image, &t.join("mnt"), &t.join("cache"));
    assert_eq!(
        m.info["manifest_digest"], report["manifest_digest"],
        "mount and convert disagree on the manifest digest"
    );

    let umoci = umoci_edge_rootfs();
    let n = treecmp(UMOCI_IGNORES, umoci, &m.path);
    assert!(n >= 5000, "edge has ~5,200 entries, compared only {n}");

    let reference = ociunpack(&edge_layout(), "edge");
    treecmp(&[], &reference, &m.path);
    for (path, name) in EMPTY_XATTRS {
        let mut buf = [0u8; 16];
        let got = rustix::fs::lgetxattr(m.path.join(path), *name, &mut buf[..]);
        assert_eq!(got, Ok(0), "{path}: {name} should be present and empty");
    }

    assert_edge_acl_enforced(&t, &m.path);
    fsck_erofs(&m);
    let read = reader_matches_kernel(&m);
    assert!(read >= 5000, "the reader compared only {read} entries");
    m.unmount();
}

/// The mount options of the mount at `mnt` (from /proc/self/mounts).
fn mount_options(mnt: &std::path::Path) -> String {
    let canonical = std::fs::canonicalize(mnt).unwrap();
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
    mounts
        .lines()
        .rev()
        .find_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            (f.len() > 3 && std::path::Path::new(f[1]) == canonical).then(|| f[3].to_string())
        })
        .unwrap_or_else(|| panic!("{} is not mounted", mnt.display()))
}

/// A kernel mount of an image without xattrs (its manifest says so) is
/// `noacl`, eager or lazy: ACL requests get EOPNOTSUPP from the kernel, so
/// `ls -l` stops asking. The edge image, which has ACLs, keeps them (its
/// test above enforces one).
#[test]
fn kernel_mounts_of_images_without_xattrs_are_noacl() {
    if !require(&[]) {
        return;
    }
    let t = TestDir::new("noacl");
    let image = converted_without_xattrs(&t);
    for (name, args) in [("eager", &[][..]), ("lazy", &["--lazy"][..])] {
        let mut args = args.to_vec();
        args.extend(["--mode", "kernel"]);
        let m = Mount::with_args(&image, &t.join(name), &t.join("cache"), &args);
        let options = mount_options(&m.path);
        assert!(
            options.split(',').any(|o| o == "noacl"),
            "{name}: {options}"
        );
        let mut buf = [0u8; 64];
        let path = m.path.join("hello");
        let acl = rustix::fs::getxattr(path, "system.posix_acl_access", &mut buf[..]);
        assert_eq!(acl, Err(rustix::io::Errno::NOTSUP), "{name}");
        let hello = std::fs::read(m.path.join("hello")).unwrap();
        assert_eq!(hello, b"hello world\n", "{name}");
        m.unmount();
    }
    let edge = oci_ref(&t.join("out"), "edge");
    lamina(["convert", &oci_ref(&edge_layout(), "edge"), &edge]).ok();
    let m = Mount::new(&edge, &t.join("edge"), &t.join("cache"));
    let options = mount_options(&m.path);
    assert!(!options.split(',').any(|o| o == "noacl"), "edge: {options}");
    m.unmount();
}

/// Issue 28 point 4: a mount is `nosuid,nodev` unless asked (`--suid
/// --dev`), on both paths, eager or lazy: the edge image's `dev/null`
/// (`c 1 3`, mode 0666) cannot be opened through it, nor its setuid bits
/// honoured, by any local user.
#[test]
fn mounts_are_nosuid_nodev_unless_asked() {
    if !require(&[]) {
        return;
    }
    let t = TestDir::new("nosuid");
    let edge = oci_ref(&t.join("out"), "edge");
    lamina(["convert", &oci_ref(&edge_layout(), "edge"), &edge]).ok();
    let cases: [(&str, &[&str]); 6] = [
        ("kernel-eager", &["--mode", "kernel"]),
        ("kernel-lazy", &["--mode", "kernel", "--lazy"]),
        ("fuse-eager", &["--mode", "fuse"]),
        ("fuse-lazy", &["--mode", "fuse", "--lazy"]),
        ("kernel-asked", &["--mode", "kernel", "--suid", "--dev"]),
        (
            "fuse-asked",
            &["--mode", "fuse", "--lazy", "--suid", "--dev"],
        ),
    ];
    for (name, args) in cases {
        let asked = name.ends_with("asked");
        let m = Mount::with_args(&edge, &t.join(name), &t.join("cache"), args);
        let options = mount_options(&m.path);
        let has = |o: &str| options.split(',').any(|x| x == o);
        assert_eq!(has("nosuid"), !asked, "{name}: {options}");
        assert_eq!(has("nodev"), !asked, "{name}: {options}");
        let opened = std::fs::File::open(m.path.join("dev/null")).map(drop);
        match asked {
            true => assert!(opened.is_ok(), "{name}: {opened:?}"),
            false => assert_eq!(
                opened.map_err(|e| e.raw_os_error()),
                Err(Some(rustix::io::Errno::ACCESS.raw_os_error())),
                "{name}: a device node opened through a nodev mount"
            ),
        }
        m.unmount();
    }
}

/// Issue 29 point 6: an eager kernel mount reads its cache files with
/// direct I/O (`directio`), each page cached once, in EROFS's page cache;
/// a lazy one does not (its worker writes fills through the page cache).
/// Both read the image's tree (as umoci unpacks it). Before, every page
/// of a fully local file was read into the cache file's page cache and
/// copied (fincore showed both 512 MiB of a fio file and its cache files
/// resident), and random 4 KiB reads ran at 0.9x ext4's.
#[test]
fn eager_kernel_mounts_read_cache_files_directly() {
    if !require(&[]) {
        return;
    }
    let t = TestDir::new("directio");
    let edge = oci_ref(&t.join("out"), "edge");
    lamina(["convert", &oci_ref(&edge_layout(), "edge"), &edge]).ok();
    let reference = ociunpack(&edge_layout(), "edge");
    for (name, lazy) in [("eager", false), ("lazy", true)] {
        let mut args = vec!["--mode", "kernel"];
        if lazy {
            args.push("--lazy");
        }
        let m = Mount::with_args(
            &edge,
            &t.join(name),
            &t.join(&format!("cache-{name}")),
            &args,
        );
        let options = mount_options(&m.path);
        let direct = options.split(',').any(|x| x == "directio");
        assert_eq!(direct, !lazy, "{name}: {options}");
        treecmp(&[], &reference, &m.path);
        m.unmount();
    }
}

/// The same tree with the smallest chunk size (4 KiB): more chunks per file,
/// chunk-index paths of the EROFS writer exercised.
#[test]
fn edge_with_4k_chunks_matches_ociunpack() {
    if !require(&["fsck.erofs", "zstd"]) {
        return;
    }
    let t = TestDir::new("edge4k");
    let out = t.join("out");
    let image = oci_ref(&out, "edge");
    let report = lamina([
        "convert",
        "--json",
        "--chunk-size",
        "4096",
        &oci_ref(&edge_layout(), "edge"),
        &image,
    ])
    .ok()
    .json();
    let inspect = lamina(["inspect", "--json", &image]).ok().json();
    assert_eq!(inspect["chunk_size"], 4096, "inspect: {inspect}");
    assert_eq!(inspect["manifest_digest"], report["manifest_digest"]);
    let m = Mount::new(&image, &t.join("mnt"), &t.join("cache"));
    treecmp(&[], &ociunpack(&edge_layout(), "edge"), &m.path);
    fsck_erofs(&m);
    assert!(reader_matches_kernel(&m) >= 5000);
    m.unmount();
}

/// Images of format 3 (every chunk in the index: what lamina wrote before
/// the paged index, and `convert --format-version 3` still writes) and of
/// format 4 with 4 KiB chunks (many blobs, each ending with its chunk
/// table) mount lazily through the kernel and FUSE, and eagerly, and read
/// as ociunpack.py unpacks them.
#[test]
fn paged_and_unpaged_indexes_mount_every_way() {
    if !require(&["zstd"]) {
        return;
    }
    let t = TestDir::new("edge-formats");
    for (label, flags, format, paged) in [
        ("v3", &["--format-version", "3"][..], 3, false),
        ("v4-4k", &["--chunk-size", "4096"][..], 4, true),
    ] {
        let image = oci_ref(&t.join(label), "edge");
        let mut args = vec!["convert"];
        args.extend(flags);
        let src = oci_ref(&edge_layout(), "edge");
        args.extend([src.as_str(), image.as_str()]);
        lamina(args).ok();
        let inspect = lamina(["inspect", "--json", &image]).ok().json();
        assert_eq!(inspect["format"], format, "{label}: {inspect}");
        assert_eq!(inspect["paged_index"], paged, "{label}: {inspect}");
        if paged {
            let blobs = inspect["blobs"].as_array().unwrap();
            assert!(
                blobs.len() > 1,
                "{label}: 4 KiB chunks fill more than one blob: {inspect}"
            );
            assert!(blobs.iter().all(|b| b["chunks"].as_u64().unwrap() <= 1024));
        }
        let reference = ociunpack(&edge_layout(), "edge");
        for (how, extra) in [
            ("lazy-kernel", &["--lazy", "--mode", "kernel"][..]),
            ("lazy-fuse", &["--lazy", "--mode", "fuse"][..]),
            ("eager", &["--mode", "kernel"][..]),
        ] {
            let cache = t.join(&format!("cache-{label}-{how}"));
            let m = Mount::with_args(
                &image,
                &t.join(&format!("mnt-{label}-{how}")),
                &cache,
                extra,
            );
            treecmp(&[], &reference, &m.path);
            m.unmount();
            // A paged image's tables are kept beside the blobs read.
            let tables = cache_files_in(&cache, "blobs")
                .into_iter()
                .filter(|p| p.extension().is_some_and(|x| x == "table"))
                .count();
            assert_eq!(
                tables > 0,
                paged,
                "{label} {how}: {tables} chunk tables kept"
            );
        }
    }
}

/// misc: minimal, empty (no layers), implicit parents, whiteouts with
/// implicit parents; each compared with ociunpack.py (no ignores).
#[test]
fn misc_images_match_ociunpack() {
    if !require(&["fsck.erofs"]) {
        return;
    }
    let misc = fixtures().join("misc");
    let t = TestDir::new("misc");
    let out = t.join("out");
    let cache = t.join("cache");
    for tag in [
        "minimal",
        "empty",
        "implicit-parents",
        "whiteout-implicit-parent",
    ] {
        let image = oci_ref(&out, tag);
        lamina(["convert", &oci_ref(&misc, tag), &image]).ok();
        let m = Mount::new(&image, &t.join(&format!("mnt-{tag}")), &cache);
        treecmp(&[], &ociunpack(&misc, tag), &m.path);
        fsck_erofs(&m);
        m.unmount();
    }
}
