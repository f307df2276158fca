//! The reference workload: a 2-layer Debian bookworm image (debootstrap
//! minbase + python3, nginx-light, redis-server) built by
//! scripts/debian-image.sh and cached per machine.

mod common;

use std::time::Duration;

use common::*;

/// Size target from the issue: the EROFS metadata of the Debian image.
const METADATA_LIMIT: u64 = 1_100_000;

#[test]
fn debian_bookworm_converts_mounts_and_runs() {
    if !require(&["umoci", "debootstrap", "jq", "chroot", "fsck.erofs", "zstd"]) {
        return;
    }
    let layout = debian_source();

    let t = TestDir::new("debian");
    let out = t.join("out");
    let image = oci_ref(&out, "bookworm");
    let report = lamina_timeout(
        ["convert", "--json", &oci_ref(&layout, "bookworm"), &image],
        Duration::from_secs(1200),
    )
    .ok()
    .json();
    let metadata = report["metadata_bytes"]
        .as_u64()
        .unwrap_or_else(|| panic!("no metadata_bytes in {report}"));
    let entries = report["stats"]["entries"].as_u64().unwrap_or(0);
    assert!(
        entries > 5000,
        "a Debian tree has thousands of entries, report says {entries}"
    );
    assert!(
        metadata <= METADATA_LIMIT,
        "metadata is {metadata} bytes, the target is <= {METADATA_LIMIT} ({entries} entries)"
    );

    let m = Mount::new(&image, &t.join("mnt"), &t.join("cache"));
    python3_prints_ok(&m.path, "print('ok')");

    let rootfs = umoci_unpack(&format!("{}:bookworm", layout.display()), &t.join("bundle"));
    let n = treecmp(&[], &rootfs, &m.path);
    assert!(n > 5000, "compared only {n} entries");
    fsck_erofs(&m);
    let read = reader_matches_kernel(&m);
    assert!(read > 5000, "the reader compared only {read} entries");
    m.unmount();

    // The same image through FUSE, from the same (now complete) cache.
    let f = Mount::with_args(
        &image,
        &t.join("fuse"),
        &t.join("cache"),
        &["--mode", "fuse"],
    );
    assert_eq!(
        f.info["fetched_bytes"], 0,
        "the cache was complete: {}",
        f.info
    );
    let n = treecmp(&[], &rootfs, &f.path);
    assert!(n > 5000, "FUSE: compared only {n} entries");
    python3_prints_ok(&f.path, "print('ok')");
    f.unmount();
}
