//! Issue 43: FUSE passthrough objects kept by content, one per trust
//! domain for every image with those bytes.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::common::*;
use crate::images::{begin, convert, reference};
use crate::{CHANGED, FILES};

/// Files FUSE passes through: at least `DEFAULT_PASSTHROUGH_MIN_SIZE`.
const MIN_SIZE: u64 = 64 << 10;

/// The objects dirs of the images in `cache` (`objects/<hex>.<entries>`).
fn image_object_dirs(cache: &Path) -> Vec<PathBuf> {
    fs::read_dir(cache.join("objects"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_dir() && !p.ends_with("content"))
        .collect()
}

/// The content objects of `cache` (`objects/content/<domain>/<sha256>`).
fn content_objects(cache: &Path) -> Vec<PathBuf> {
    let domains = fs::read_dir(cache.join("objects/content"))
        .into_iter()
        .flatten()
        .flatten();
    domains
        .flat_map(|d| fs::read_dir(d.path()).into_iter().flatten().flatten())
        .map(|e| e.path())
        .filter(|p| p.extension().is_none())
        .collect()
}

/// The objects dir of the image mounted at `m`: `objects/<hex>.<entries>`,
/// `<hex>` its metadata's name (`meta/<hex>.erofs`).
fn objects_dir_of(m: &Mount) -> PathBuf {
    objects_dir_of_when_made(m)
        .unwrap_or_else(|| panic!("no objects dir of the image at {}", m.path.display()))
}

/// Reads `path` under the mount `m` until its second open is passed
/// through (the first is served by the daemon while the object is made):
/// the inode of the image's object of it, after checking both reads
/// against `want`. A `new` object (no image had those bytes) has none of
/// its pages cached when it appears.
#[track_caller]
fn passed_through(m: &Mount, path: &str, want: &[u8], new: bool) -> u64 {
    let file = m.path.join(path);
    assert!(
        fs::read(&file).unwrap() == want,
        "{path} through the daemon"
    );
    let nid = fs::metadata(&file).unwrap().ino() - 2; // the root is 1, nid 0 is 2
    let start = Instant::now();
    let object = loop {
        let object = objects_dir_of_when_made(m).map(|d| d.join(nid.to_string()));
        if let Some(object) = object.filter(|o| o.exists()) {
            // Made while the daemon served the first open: none of its
            // pages cached (they would be a second copy of the reader's).
            if new {
                assert_eq!(resident(&object), 0, "{path}: its new object's pages");
            }
            assert!(
                fs::read(&object).unwrap() == want,
                "{path}: its object's bytes"
            );
            break fs::metadata(object).unwrap().ino();
        }
        assert!(
            start.elapsed() < SHORT,
            "no object of {path} with its bytes"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert!(fs::read(&file).unwrap() == want, "{path} passed through");
    object
}

/// Bytes of `file` in the page cache (`cachestat(2)`: `fincore` maps the
/// file, and mapping a lazy mount's cache file fills it).
pub(crate) fn resident(file: &Path) -> u64 {
    let opened = fs::File::open(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    lamina_sys::resident_bytes(&opened)
        .unwrap_or_else(|e| panic!("cachestat of {}: {e}", file.display()))
}

/// [`objects_dir_of`] once the first object made it.
fn objects_dir_of_when_made(m: &Mount) -> Option<PathBuf> {
    let hex = m.metadata_path().file_stem()?.to_string_lossy().to_string();
    image_object_dirs(&m.cache).into_iter().find(|d| {
        d.file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with(&format!("{hex}."))
    })
}

/// Issue 43: b and its rebuild h (the files of `CHANGED` replaced: another
/// layer, another blob, most files the same bytes), mounted eagerly
/// through FUSE on one cache. Each big file h shares with b is passed
/// through to the very object b's is (one inode: one copy on disk, one in
/// the page cache), each changed one to an object of its own; the cache
/// holds one content object per distinct content. Every read matches
/// `umoci unpack`. Before, each image copied each file into an object of
/// its own.
#[test]
fn fuse_objects_are_shared_by_content_across_images() {
    let Some((_time, t, src)) = begin(
        "fuse_objects_are_shared_by_content_across_images",
        "objects-by-content",
    ) else {
        return;
    };
    let cache = t.join("cache");
    let big: Vec<&str> = FILES
        .iter()
        .filter(|(_, size)| *size >= MIN_SIZE)
        .map(|(n, _)| *n)
        .collect();
    let mut objects: BTreeMap<(&str, &str), u64> = BTreeMap::new();
    let mut mounts = Vec::new();
    for tag in ["b", "h"] {
        let image = oci_ref(&t.join("conv"), tag);
        convert(&oci_ref(&src, tag), &image);
        let m = Mount::with_args(
            &image,
            &t.join(&format!("mnt-{tag}")),
            &cache,
            &["--mode", "fuse"],
        );
        let rootfs = reference(&t, &src, tag);
        for name in &big {
            let path = format!("data/{name}.bin");
            let want = fs::read(rootfs.join(&path)).unwrap();
            let new = tag == "b" || CHANGED.contains(name);
            objects.insert((tag, name), passed_through(&m, &path, &want, new));
        }
        mounts.push(m);
    }
    for name in &big {
        let (b, h) = (objects[&("b", *name)], objects[&("h", *name)]);
        match CHANGED.contains(name) {
            true => assert_ne!(b, h, "{name} changed in h: its own object"),
            false => assert_eq!(b, h, "{name}: h's object is not b's"),
        }
    }
    let changed = big.iter().filter(|n| CHANGED.contains(n)).count();
    let content = content_objects(&cache);
    assert_eq!(content.len(), big.len() + changed, "{content:?}");
    let dirs = [objects_dir_of(&mounts[0]), objects_dir_of(&mounts[1])];
    assert_ne!(dirs[0], dirs[1], "one objects dir per image");
    drop(mounts);
}
