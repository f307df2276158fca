//! Issue 7 regressions: never a wrong byte, private cache data. Each test
//! names the point of the issue it reproduces; each failed on main before
//! the fix.
mod common;
use common::*;

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// The first non-empty regular file below `root`, read whole.
fn read_one_file(root: &Path) -> usize {
    let mut dirs = vec![root.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in fs::read_dir(&d).unwrap().flatten() {
            let m = e.metadata().unwrap();
            if m.is_dir() {
                dirs.push(e.path());
            } else if m.is_file() && m.len() > 0 {
                return fs::read(e.path()).unwrap().len();
            }
        }
    }
    panic!("no non-empty file below {}", root.display());
}

/// The edge fixture converted into `t/out` (tag edge).
fn converted_edge(t: &TestDir) -> String {
    let image = oci_ref(&t.join("out"), "edge");
    lamina(["convert", &oci_ref(&edge_layout(), "edge"), &image]).ok();
    image
}

/// Point 1: a lazy mount leaves full-length sparse cache files behind; an
/// eager mount of the same image from the same cache dir took them for
/// complete and served the holes as file content (48 of 49 files of a test
/// image read as zeros). It must fetch what no fill record vouches for.
#[test]
fn eager_mount_after_a_lazy_one_reads_the_image_not_holes() {
    if !require(&["zstd"]) {
        return;
    }
    let t = TestDir::new("integrity-lazy-eager");
    let image = converted_edge(&t);
    let cache = t.join("cache");
    let lazy = Mount::with_args(
        &image,
        &t.join("mnt-lazy"),
        &cache,
        &["--lazy", "--prefetch", "none"],
    );
    assert!(read_one_file(&lazy.path) > 0);
    lazy.unmount();

    let eager = Mount::new(&image, &t.join("mnt"), &cache);
    treecmp(&[], &ociunpack(&edge_layout(), "edge"), &eager.path);
    eager.unmount();
}

/// Point 5: cache files held the contents of the image's 0600 files with
/// mode 0644; run dirs, records and logs were world-readable.
#[test]
fn cache_and_run_state_are_private() {
    if !require(&["zstd"]) {
        return;
    }
    let t = TestDir::new("integrity-private");
    let image = converted_edge(&t);
    let cache = t.join("cache");
    let m = Mount::with_args(&image, &t.join("mnt"), &cache, &["--lazy"]);
    read_one_file(&m.path);
    let mut loose = Vec::new();
    let mut dirs = vec![cache.clone()];
    while let Some(d) = dirs.pop() {
        let mode = fs::symlink_metadata(&d).unwrap().mode() & 0o777;
        if mode != 0o700 {
            loose.push(format!("{} {mode:o}", d.display()));
        }
        for e in fs::read_dir(&d).unwrap().flatten() {
            let meta = fs::symlink_metadata(e.path()).unwrap();
            let mode = meta.mode() & 0o777;
            if meta.is_dir() {
                dirs.push(e.path());
            } else if mode & 0o077 != 0 {
                loose.push(format!("{} {mode:o}", e.path().display()));
            }
        }
    }
    m.unmount();
    assert!(
        loose.is_empty(),
        "cache entries others may read: {loose:#?}"
    );

    // A cache dir others may write to is refused, with a message that says so.
    let open = t.join("open-cache");
    fs::create_dir_all(&open).unwrap();
    fs::set_permissions(&open, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    fs::create_dir_all(t.join("mnt2")).unwrap();
    let out = lamina([
        "mount",
        "--lazy",
        &image,
        t.join("mnt2").to_str().unwrap(),
        "--cache-dir",
        open.to_str().unwrap(),
    ]);
    let out = out.failed();
    assert!(
        out.stderr.contains("lets others write"),
        "{}",
        out.describe()
    );
    assert!(!is_mountpoint(&t.join("mnt2")));
}
