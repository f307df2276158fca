//! Scale (issue 10): a file of 6 GiB, so file offsets past 32 bits, and an
//! image of 120 layers, so 120 data blobs and EROFS devices; each converted
//! from an OCI layout straight into a local registry, mounted lazily (kernel
//! and FUSE), read and compared with `umoci unpack` of the source.
//!
//! The images come from `tests/fixtures/mkscale.py`. The 6 GiB file is all
//! zeros but for a few pseudo-random regions, some beyond 4 GiB; its layer is
//! a zstd-compressed plain tar (lamina's tar reader takes no sparse tars)
//! of a few hundred KB. Cache offsets beyond 4 GiB inside a data blob would
//! take more than 4 GiB of distinct data, too slow here: unit tests cover them
//! (`lamina-format`'s index and EROFS reader/writer, `lamina-image`'s build).

mod common;

use std::ffi::OsStr;
use std::fs::{self, File};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

const TOOLS: &[&str] = &[
    "umoci",
    "docker-registry",
    "fsck.erofs",
    "zstd",
    "mount",
    "umount",
];

const GIB: u64 = 1 << 30;

/// mtime of the big file in the fixture (mkscale.py's T0 + 77).
const BIG_MTIME: i64 = 1_700_000_077;

/// Prints the test's wall time when dropped (also when it fails).
#[derive(Debug)]
struct Timer(&'static str, Instant);

impl Drop for Timer {
    fn drop(&mut self) {
        eprintln!("time: {} {:.1} s", self.0, self.1.elapsed().as_secs_f64());
    }
}

/// `mkscale.py ARGS`: its JSON description of what it wrote.
#[track_caller]
fn mkscale(args: &[&OsStr]) -> Value {
    python("tests/fixtures/mkscale.py", args, TIMEOUT)
        .ok()
        .json()
}

/// sha256 of `len` bytes of `f` at `offset` (read with pread), and whether
/// they were all zero.
fn pread_hash(f: &File, offset: u64, len: u64) -> (String, bool) {
    let mut buf = vec![0u8; len as usize];
    f.read_exact_at(&mut buf, offset)
        .unwrap_or_else(|e| panic!("pread of {len} bytes at {offset}: {e}"));
    (sha256_hex(&buf), buf.iter().all(|&b| b == 0))
}

/// sha256 of a whole (large) file, by python's hashlib (the test binary's
/// sha2 is unoptimised).
fn sha256_big(path: &Path) -> String {
    let mut c = command(
        tool("python3"),
        [
            OsStr::new("-c"),
            OsStr::new(
                "import hashlib,sys\nh=hashlib.sha256()\nf=open(sys.argv[1],'rb')\n\
                 for b in iter(lambda: f.read(1<<22), b''): h.update(b)\nprint(h.hexdigest())",
            ),
            path.as_os_str(),
        ],
    );
    run(&mut c, TIMEOUT).ok().stdout.trim().to_string()
}

/// Regions of the big file: (offset, length, sha256).
fn regions(desc: &Value) -> Vec<(u64, u64, String)> {
    desc["regions"]
        .as_array()
        .unwrap_or_else(|| panic!("no regions in {desc}"))
        .iter()
        .map(|r| {
            (
                r["offset"].as_u64().unwrap(),
                r["length"].as_u64().unwrap(),
                r["sha256"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// Reads the big file at `path` (the mount's or an overlay's) at every
/// region and around it, and a hole in between: the regions hold their
/// bytes, the 4 KiB on either side and the holes are zeros, reads at and
/// past the end return nothing.
#[track_caller]
fn check_big_file(path: &Path, desc: &Value) {
    let size = desc["size"].as_u64().unwrap();
    let st = fs::metadata(path).unwrap_or_else(|e| panic!("stat {}: {e}", path.display()));
    assert_eq!(st.size(), size, "{}: size", path.display());
    assert_eq!(st.mode(), 0o100640, "{}: mode", path.display());
    assert_eq!(st.mtime(), BIG_MTIME, "{}: mtime", path.display());
    let f = File::open(path).unwrap();
    let regions = regions(desc);
    for (off, len, sha) in &regions {
        let (got, zero) = pread_hash(&f, *off, *len);
        assert!(!zero, "{}: region at {off} reads as zeros", path.display());
        assert_eq!(&got, sha, "{}: region at {off} (+{len})", path.display());
        let before = off.saturating_sub(4096);
        if before < *off {
            let (_, zero) = pread_hash(&f, before, off - before);
            assert!(zero, "{}: bytes before {off} are not zeros", path.display());
        }
        let after = (off + len + 4096).min(size);
        if after > off + len {
            let (_, zero) = pread_hash(&f, off + len, after - off - len);
            assert!(
                zero,
                "{}: bytes after {off}+{len} are not zeros",
                path.display()
            );
        }
    }
    for hole in [GIB, 4 * GIB + 64 * 1024 * 1024, 5 * GIB + 300 * 1024 * 1024] {
        let (_, zero) = pread_hash(&f, hole, 1 << 20);
        assert!(zero, "{}: the hole at {hole} is not zeros", path.display());
    }
    // A read across 2^32: the region straddling it, by the byte.
    let mut b = [0u8; 2];
    f.read_exact_at(&mut b, (1 << 32) - 1).unwrap();
    assert_ne!(b, [0, 0], "{}: bytes at 2^32-1 and 2^32", path.display());
    let mut tail = [0u8; 16];
    assert_eq!(f.read_at(&mut tail, size).unwrap(), 0, "read at the end");
    assert_eq!(
        f.read_at(&mut tail, size + GIB).unwrap(),
        0,
        "read past the end"
    );
    assert_eq!(
        f.read_at(&mut tail, size - 5).unwrap(),
        5,
        "read over the end"
    );
}

/// The metadata image seen by lamina's EROFS reader: the big file's inode
/// (size past 32 bits) and chunk table, a chunk stored exactly where a region
/// lies and a hole everywhere else. Returns the number of data chunks.
#[track_caller]
fn check_chunk_table(m: &Mount, desc: &Value) -> usize {
    use lamina_format::erofs::{Chunk, Image};
    let meta = fs::read(m.metadata_path()).unwrap();
    let img = Image::new(&meta).unwrap_or_else(|e| panic!("reader refuses the image: {e}"));
    let mut inode = img.inode(img.root_nid()).unwrap();
    for name in ["data", "huge.bin"] {
        let e = img
            .lookup(&inode, name.as_bytes())
            .unwrap()
            .unwrap_or_else(|| panic!("no {name} in the metadata image"));
        inode = img.inode(e.nid).unwrap();
    }
    let size = desc["size"].as_u64().unwrap();
    assert_eq!(inode.size, size, "inode size");
    let chunks = img.chunks(&inode).unwrap();
    let chunk = 1u64 << chunks.chunk_bits;
    assert_eq!(chunks.len() as u64, size.div_ceil(chunk), "chunk count");
    let regions = regions(desc);
    let mut data = 0;
    for i in 0..chunks.len() {
        let (start, end) = (i as u64 * chunk, (i as u64 + 1) * chunk);
        let nonzero = regions
            .iter()
            .any(|(off, len, _)| *off < end && off + len > start);
        match chunks.get(i).unwrap() {
            Chunk::Hole => assert!(!nonzero, "chunk {i} holds a region but is a hole"),
            Chunk::Data { device, .. } => {
                assert!(nonzero, "chunk {i} is all zeros but stored");
                assert_eq!(device, 1, "chunk {i}: device");
                data += 1;
            }
        }
    }
    data
}

/// `image` mounted lazily in `mode` (no prefetch) under `t`: the mount
/// took that path and is in `lamina status`.
#[track_caller]
fn lazy_mount(t: &TestDir, image: &str, mode: &str) -> Mount {
    let m = Mount::with_args(
        image,
        &t.join(&format!("mnt-{mode}")),
        &t.join(&format!("cache-{mode}")),
        &["--mode", mode, "--prefetch", "none"],
    );
    assert_eq!(m.info["mode"], mode, "mount report {}", m.info);
    assert!(
        m.status().is_some(),
        "{mode}: a lazy mount is in `lamina status`"
    );
    m
}

/// A 6 GiB file (regions past 4 GiB, the last bytes of the file), converted
/// from an OCI layout into a registry, mounted lazily with the kernel and
/// then with FUSE; on each mount:
/// * the file's size, mode and mtime; every region by pread at its offset,
///   zeros around it and in the holes, reads at and past the end;
/// * the whole file's sha256 against the generator's (kernel mount only: a
///   debug build's FUSE daemon would take minutes over 6 GiB of holes);
/// * the rest of the tree against `umoci unpack` of the same image without the
///   big file (umoci takes over a minute and 6 GiB of disk to unpack it, as
///   it writes the holes out);
/// * the chunk table as lamina's EROFS reader sees it; fsck.erofs;
/// * an overlay on top takes a write next to the big file and reads the big
///   file right, without copying it up.
#[test]
fn file_of_6_gib_mounts_lazily_and_reads_right() {
    if !require(TOOLS) {
        return;
    }
    let _timer = Timer("file_of_6_gib", Instant::now());
    let t = TestDir::new("scale-big");
    let layout = t.join("src");
    let started = Instant::now();
    let desc = mkscale(&[OsStr::new("big"), layout.as_os_str()]);
    eprintln!("mkscale big: {:.1} s", started.elapsed().as_secs_f64());
    let size = desc["size"].as_u64().unwrap();
    assert!(size > 5 * GIB, "the big file is {size} bytes");
    assert!(
        regions(&desc).iter().any(|(off, _, _)| *off > 5 * GIB),
        "no region beyond 5 GiB: {desc}"
    );

    let reg = Registry::start();
    let image = reg.reference("big:1");
    let started = Instant::now();
    let report = lamina_timeout(
        ["convert", "--json", &oci_ref(&layout, "big"), &image],
        Duration::from_secs(600),
    )
    .ok()
    .json();
    eprintln!("convert: {:.1} s", started.elapsed().as_secs_f64());
    let blobs = report["blobs"].as_array().expect("blobs in the report");
    assert_eq!(blobs.len(), 1, "one data blob: {report}");
    assert_eq!(
        report["stats"]["file_bytes"].as_u64().map(|b| b > size),
        Some(true),
        "file bytes in {report}"
    );
    let twin = umoci_unpack(&format!("{}:twin", layout.display()), &t.join("umoci-twin"));

    for mode in ["kernel", "fuse"] {
        let m = lazy_mount(&t, &image, mode);
        let big = m.path.join("data/huge.bin");
        check_big_file(&big, &desc);
        let data_chunks = check_chunk_table(&m, &desc);
        assert!(data_chunks >= 6, "only {data_chunks} data chunks");
        if mode == "kernel" {
            let started = Instant::now();
            assert_eq!(
                sha256_big(&big),
                desc["sha256"].as_str().unwrap(),
                "sha256 of the whole file"
            );
            eprintln!("hashing 6 GiB: {:.1} s", started.elapsed().as_secs_f64());
        }
        let n = treecmp(&["--exclude", "data/huge.bin"], &twin, &m.path);
        assert!(n >= 7, "compared only {n} entries");

        // An overlay on top: a write beside the big file, which reads right.
        let o = Overlay::mount(&m.path, &t.mkdir(&format!("ovl-{mode}")));
        let neighbour = o.merged.join("data/neighbour.txt");
        let mut text = fs::read(&neighbour).unwrap();
        assert_eq!(text, b"the big file's neighbour\n");
        text.extend_from_slice(b"written through the overlay\n");
        fs::write(&neighbour, &text).unwrap();
        fs::write(o.merged.join("data/new.txt"), b"new\n").unwrap();
        assert_eq!(fs::read(&neighbour).unwrap(), text);
        check_big_file(&o.merged.join("data/huge.bin"), &desc);
        let upper = t.join(&format!("ovl-{mode}/upper/data"));
        assert_eq!(fs::read(upper.join("neighbour.txt")).unwrap(), text);
        assert!(
            !upper.join("huge.bin").exists(),
            "the big file was copied up"
        );
        o.unmount();
        // The lower mount is unchanged.
        assert_eq!(
            fs::read(m.path.join("data/neighbour.txt")).unwrap(),
            b"the big file's neighbour\n"
        );
        if mode == "kernel" {
            fsck_erofs(&m);
        }
        m.unmount();
    }
}

/// 120 layers, each bringing a file of its own (so a data blob of its own),
/// whiting out files of earlier ones, one making a directory opaque, one
/// removing a directory a later one re-creates: converted into a registry,
/// mounted lazily with the kernel (120 EROFS devices) and with FUSE; the
/// tree equals `umoci unpack` of the source; fsck.erofs takes the 120
/// devices.
#[test]
fn image_of_120_layers_mounts_lazily_and_matches_umoci() {
    if !require(TOOLS) {
        return;
    }
    let _timer = Timer("image_of_120_layers", Instant::now());
    let t = TestDir::new("scale-deep");
    let layout = t.join("src");
    let desc = mkscale(&[OsStr::new("deep"), layout.as_os_str()]);
    assert_eq!(desc["layers"], 120, "{desc}");
    let manifest = read_manifest(&layout, "deep");
    assert_eq!(manifest["layers"].as_array().map(Vec::len), Some(120));

    let reg = Registry::start();
    let image = reg.reference("deep:1");
    let report = lamina(["convert", "--json", &oci_ref(&layout, "deep"), &image])
        .ok()
        .json();
    let blobs = report["blobs"].as_array().expect("blobs in the report");
    assert_eq!(blobs.len(), 120, "one data blob per layer: {report}");
    let inspect = lamina(["inspect", "--json", &image]).ok().json();
    assert_eq!(
        inspect["blobs"].as_array().map(Vec::len),
        Some(120),
        "inspect: {inspect}"
    );

    let rootfs = umoci_unpack(&format!("{}:deep", layout.display()), &t.join("umoci"));
    // The reference says what the layers did (so treecmp compares something).
    for (path, present) in [
        ("gone/c", true),
        ("gone/a", false),
        ("layers/l005.txt", false),
        ("layers/l115.txt", false),
        ("layers/l116.txt", true),
        ("layers/l002.txt/inside", true),
        ("opq/f059", false),
        ("opq/f060", true),
        ("opq/f120", true),
    ] {
        assert_eq!(
            rootfs.join(path).exists(),
            present,
            "umoci's tree: {path} present"
        );
    }
    assert_eq!(fs::read(rootfs.join("shared/counter")).unwrap(), b"120\n");

    for mode in ["kernel", "fuse"] {
        let m = lazy_mount(&t, &image, mode);
        assert_eq!(m.blob_paths().len(), 120, "devices of {}", m.info);
        let n = treecmp(&[], &rootfs, &m.path);
        assert!(n >= 150, "compared only {n} entries");
        if mode == "kernel" {
            fsck_erofs(&m);
        }
        m.unmount();
    }
}
