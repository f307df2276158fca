//! An image of many small files (issue 10): 100,000 files of 100 to 3,000
//! bytes, 1,000 per directory, from `bench/harness/synthetic.py`. Converted
//! into the local registry (small files packed, the default), it mounts
//! lazily through a counting proxy: what crosses the wire before the first
//! read is a small part of the image, reading one file takes at most two
//! range requests, and the whole tree equals `umoci unpack` of the source.

mod common;

use std::ffi::OsStr;

use common::*;

const FILES: u64 = 100_000;

#[test]
fn many_small_files_mount_lazily_fetching_little_and_equal_umoci() {
    if !require(&["umoci"]) {
        return;
    }
    let t = TestDir::new("many");
    let layout = t.join("src");
    let files = FILES.to_string();
    python(
        "bench/harness/synthetic.py",
        [
            OsStr::new("small-files"),
            OsStr::new("--files"),
            OsStr::new(&files),
            OsStr::new("--out"),
            layout.as_os_str(),
            OsStr::new("--tag"),
            OsStr::new("src"),
        ],
        TIMEOUT,
    )
    .ok();
    let reg = Registry::start();
    let report = lamina([
        "convert",
        "--json",
        &oci_ref(&layout, "src"),
        &reg.reference("many:v1"),
    ])
    .ok()
    .json();
    let stats = &report["stats"];
    assert_eq!(stats["files"], FILES, "{report}");
    // 1,000 files of 100-3,000 bytes (16 KiB a file at most, with padding)
    // fill a 256 KiB pack at least 16 at a time.
    let packs = stats["packs"].as_u64().unwrap();
    assert!(
        stats["packed_files"] == FILES && packs <= FILES / 16,
        "small files not packed: {report}"
    );
    // Metadata of several frames: the lazy mount below decompresses
    // them in parallel, the path no smaller image takes.
    let metadata = report["metadata_bytes"].as_u64().unwrap();
    let frame = lamina_image::artifact::METADATA_FRAME_SIZE as u64;
    assert!(metadata > 2 * frame, "{metadata} bytes of metadata");
    let inspect = lamina(["inspect", "--json", &reg.reference("many:v1")])
        .ok()
        .json();
    let data_bytes = inspect["compressed_bytes"].as_u64().unwrap();

    let proxy = FaultProxy::start(t.path(), "proxy", 0, reg.port, "none", &[]);
    let image = format!("docker://127.0.0.1:{}/many:v1", proxy.port);
    let m = Mount::with_args(
        &image,
        &t.join("mnt"),
        &t.join("cache"),
        &["--prefetch", "none"],
    );
    let before = proxy.stats();
    let mounted = before["body_bytes"].as_u64().unwrap();
    assert!(
        mounted * 20 < data_bytes,
        "the mount moved {mounted} bytes before the first read, 5% of the image's {data_bytes} or more: {inspect}"
    );

    let one = m.path.join("d000061/f234.bin");
    let bytes = std::fs::read(&one).unwrap_or_else(|e| panic!("{}: {e}", one.display()));
    let after = proxy.stats();
    let requests = after["eligible"].as_u64().unwrap() - before["eligible"].as_u64().unwrap();
    assert!(
        (1..=2).contains(&requests),
        "reading one file of {} bytes took {requests} range requests: {after}",
        bytes.len()
    );

    let rootfs = umoci_unpack(&format!("{}:src", layout.display()), &t.join("umoci"));
    treecmp(&[], &rootfs, &m.path);
    m.unmount();
    eprintln!(
        "many: {FILES} files, {packs} packs; {mounted} bytes before the first read ({:.2}% of {data_bytes}); one file: {requests} request(s)",
        mounted as f64 * 100.0 / data_bytes as f64
    );
}
