//! Lazy FUSE mounts: filled on read, readahead lowered until complete, and
//! `--mode auto` picking FUSE where the kernel path cannot serve.

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::common::*;
use crate::{converted_edge, fs_type, fuse_daemons, worker_status};

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

/// Issue 44: a lazy FUSE mount from a registry fetches only the first
/// frame of the metadata before it returns (the manifest lists the
/// frames and their digests); the daemon fetches the others by range as
/// reads need them and the rest in the background. Every second range
/// answer after the mount's is corrupted (one byte in 512): each is
/// fetched again, none is written, and the tree equals ociunpack.py's.
/// Then the metadata is whole, hashed and recorded.
#[test]
fn lazy_fuse_mount_fetches_metadata_frames_as_needed() {
    if !require(&[]) {
        return;
    }
    let t = TestDir::new("fuse-frames");
    let layout = t.join("src");
    python(
        "bench/harness/synthetic.py",
        [
            std::ffi::OsStr::new("small-files"),
            std::ffi::OsStr::new("--files"),
            std::ffi::OsStr::new("4000"),
            std::ffi::OsStr::new("--out"),
            layout.as_os_str(),
            std::ffi::OsStr::new("--tag"),
            std::ffi::OsStr::new("src"),
        ],
        TIMEOUT,
    )
    .ok();
    let out = t.join("out");
    let report = lamina([
        "convert",
        "--json",
        "--metadata-frame-size",
        "16K",
        &oci_ref(&layout, "src"),
        &oci_ref(&out, "frames"),
    ])
    .ok()
    .json();
    let metadata = report["metadata_compressed_bytes"].as_u64().unwrap();
    let manifest = read_manifest(&out, "frames");
    let layers = manifest["layers"].as_array().unwrap();
    let metadata_layer = layers
        .iter()
        .find(|l| l["mediaType"] == lamina_image::artifact::MEDIA_TYPE_METADATA)
        .unwrap_or_else(|| panic!("no metadata layer: {manifest}"));
    let reg = Registry::start();
    reg.push(&out, "frames", "frames:v1");
    // The metadata layer's range reads: the mount's (the first frame)
    // untouched, then every second one corrupted.
    let digest = metadata_layer["digest"].as_str().unwrap();
    let only = ["--blob", digest];
    let proxy = FaultProxy::start(t.path(), "proxy", 0, reg.port, "ok,flip", &only);
    let image = format!("docker://127.0.0.1:{}/frames:v1", proxy.port);
    let cache = t.join("cache");
    let args = ["--mode", "fuse", "--lazy", "--prefetch", "none"];
    let m = Mount::with_args(&image, &t.join("mnt"), &cache, &args);
    // Before the mount returned: one request for the metadata, a range
    // of its first frame.
    let before = proxy.stats();
    let reads: Vec<&str> = before["log"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|l| l.as_str())
        .filter(|l| l.contains(digest))
        .collect();
    let first: Option<(u64, u64)> = match reads[..] {
        [one] => one
            .split("bytes=")
            .nth(1)
            .and_then(|r| r.split_once('-'))
            .and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?))),
        _ => None,
    };
    assert!(
        first.is_some_and(|(start, end)| start == 0 && (end + 1) * 4 < metadata),
        "the metadata ({metadata} bytes) read before the mount returned: {reads:?}"
    );
    treecmp(&[], &ociunpack(&layout, "src"), &m.path);
    let written = metadata_frames_written(&cache, &m.path);
    let field =
        |name: &str| log_field(&written, name).unwrap_or_else(|| panic!("no {name} in {written}"));
    assert!(field("frames") > 3, "{written}");
    assert!(field("fetched_bytes") >= metadata / 2, "{written}");
    assert!(field("bad_answers") > 0, "{written}");
    // `lamina status` shows the daemon's figures, once complete the log's.
    let deadline = Instant::now() + Duration::from_secs(10);
    let shown = loop {
        let shown = m.status().map(|e| e["fuse"]["metadata_frames"].clone());
        if let Some(f) = shown.filter(|f| f["complete"] == true) {
            break f;
        }
        assert!(
            Instant::now() < deadline,
            "no complete frames in lamina status: {:?}",
            m.status()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    for name in ["frames", "fetched_bytes", "requests", "bad_answers"] {
        assert_eq!(
            shown[name].as_u64(),
            Some(field(name)),
            "{name}: {shown} against {written}"
        );
    }
    assert_eq!(shown["written"], shown["frames"], "{shown}");
    let stats = proxy.stats();
    assert!(
        stats["faults"]["flip"].as_u64().unwrap_or(0) > 0,
        "no answer corrupted: {stats}"
    );
    m.unmount();
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
