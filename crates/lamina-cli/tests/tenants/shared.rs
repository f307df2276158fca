//! Issue 43: `lamina mount --share-files`, the kernel path's files shared
//! by content. Each mount is an overlayfs of the image's metadata view
//! over the trust domain's shards; a file with the same bytes in two
//! images is read through one shard inode, one page cache.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::common::*;
use crate::images::{begin, convert, reference};
use crate::objects::resident;
use crate::reading::{check_reads, drop_caches, read_files};
use crate::{CHANGED, FILES};
use serde_json::Value;

const SHARE: &[&str] = &["--eager", "--mode", "kernel", "--share-files"];

/// A mount's run dir: `CACHE/mounts/<16 hex of the sha256 of its
/// canonical mountpoint>` (a lazy view's config names its shard's mount).
fn view_run_dir(m: &Mount) -> PathBuf {
    run_dir_for(&m.cache, &m.path)
}

/// The run dir a mount at `mountpoint` (which exists) with cache `cache` has.
fn run_dir_for(cache: &Path, mountpoint: &Path) -> PathBuf {
    use sha2::Digest as _;
    let me = mountpoint.canonicalize().unwrap();
    let digest = sha2::Sha256::digest(std::os::unix::ffi::OsStrExt::as_bytes(me.as_os_str()));
    cache.join("mounts").join(crate::images::hex(&digest[..8]))
}

/// The shards the view at `m` stacks, in order (its own last), as dirs.
#[track_caller]
fn shards_of(m: &Mount) -> Vec<PathBuf> {
    let record: Value =
        serde_json::from_slice(&fs::read(view_run_dir(m).join("view.json")).unwrap()).unwrap();
    let dir = PathBuf::from(record["shards_dir"].as_str().unwrap());
    let ids = record["shards"].as_array().unwrap();
    ids.iter()
        .map(|id| dir.join(id.as_str().unwrap()))
        .collect()
}

/// An xattr of `path` (not following a symlink), if it has it.
fn xattr(path: &Path, name: &str) -> Option<Vec<u8>> {
    let mut buf = vec![0u8; 4096];
    let n = rustix::fs::lgetxattr(path, name, &mut buf).ok()?;
    buf.truncate(n);
    Some(buf)
}

/// Where the view at `m` takes `path`'s data from: the object's path in
/// a shard (`/xx/<rest>`, the redirect its metadata view carries).
#[track_caller]
fn object_name(m: &Mount, path: &str) -> String {
    let view = view_run_dir(m).join("view").join(path);
    let redirect = xattr(&view, "trusted.overlay.redirect")
        .unwrap_or_else(|| panic!("{path}: no redirect in {}", view.display()));
    String::from_utf8(redirect).unwrap()
}

/// The object `name` in `shard`.
fn object(shard: &Path, name: &str) -> PathBuf {
    shard.join("mnt").join(name.trim_start_matches('/'))
}

/// b, h (b with `CHANGED` replaced: a rebuild, its own blob) and a2 (b's
/// layer under a second one: two images on one base) mounted with
/// `--share-files` on one cache. Each view equals `umoci unpack` entry by
/// entry. A file h or a2 shares with b, read only through h, is read
/// through b's shard (its pages are there, none in h's own); a changed one
/// through h's own. Packed files (s00-s03 share a pack, and s01 changed)
/// are shared by their bytes, and h keeps no copy of the ones b holds,
/// also when mounted again. Unmounting b keeps its shard for the others;
/// the last unmount takes every shard and view down.
#[test]
fn shared_files_are_read_through_one_shard() {
    let Some((_time, t, src)) = begin("shared_files_are_read_through_one_shard", "shared-files")
    else {
        return;
    };
    let cache = t.join("cache");
    let (mut mounts, mut refs) = (BTreeMap::new(), BTreeMap::new());
    // a2 before h: h then finds two shards holding its unchanged files,
    // and must take them from the one that held them first (b's), as b
    // and a2 do.
    for tag in ["b", "a2", "h"] {
        let image = oci_ref(&t.join("conv"), tag);
        convert(&oci_ref(&src, tag), &image);
        let m = Mount::with_args(&image, &t.join(&format!("mnt-{tag}")), &cache, SHARE);
        refs.insert(tag, reference(&t, &src, tag));
        treecmp(&[], &refs[tag], &m.path);
        // fsck.erofs takes both EROFS images a view is made of.
        fsck_erofs_file(&view_run_dir(&m).join("view.erofs"), &[]);
        let own = shards_of(&m).pop().unwrap();
        fsck_erofs_file(&own.join("shard.erofs"), &shard_devices(&own));
        mounts.insert(tag, m);
    }
    let (b, h) = (&mounts["b"], &mounts["h"]);
    let b_shard = shards_of(b).pop().unwrap();
    let a2_shards = shards_of(&mounts["a2"]);
    assert_eq!(a2_shards[0], b_shard, "a2 stacks b's shard first");
    let h_shards = shards_of(h);
    assert_eq!(h_shards.len(), 3, "{h_shards:?}");
    assert_eq!(
        h_shards[..2],
        [b_shard.clone(), a2_shards[1].clone()],
        "oldest first"
    );
    let h_own = h_shards.last().unwrap();
    assert_ne!(h_own, &b_shard);
    // Disk: h keeps only what b's cache files lack; its shard reads the
    // rest from b's (its extra devices), with no copy of its own.
    let (b_blobs, h_blobs) = (b.blob_paths(), h.blob_paths());
    let (b_disk, h_disk) = (allocated(&b_blobs), allocated(&h_blobs));
    eprintln!("cache files on disk: b {b_disk} B, h {h_disk} B");
    assert!(
        h_disk * 2 < b_disk,
        "h's cache files hold {h_disk} B, b's {b_disk} B: copies, not borrowed"
    );
    let h_devices = shard_devices(h_own);
    assert!(
        b_blobs.iter().all(|p| h_devices.contains(p)),
        "h's shard does not read b's cache files: {h_devices:?}"
    );
    // h's pack is new (s01 changed in it), but s00, s02 and s03 are b's
    // bytes: h's cache files hold s01's and none of theirs.
    let h_bytes: Vec<u8> = h_blobs.iter().flat_map(|p| fs::read(p).unwrap()).collect();
    let holds = |name: &str| {
        let want = fs::read(refs["h"].join(format!("data/{name}.bin"))).unwrap();
        h_bytes.windows(want.len()).any(|w| w == want)
    };
    assert!(
        holds("s01"),
        "h's changed packed file is not in its cache files"
    );
    for name in ["s00", "s02", "s03"] {
        assert!(
            !holds(name),
            "{name}: b's bytes copied into h's cache files"
        );
    }
    // Mounted again, h finds those files where they were, by their bytes
    // (its chunk verified whole with them), and fetches nothing.
    let h_conv = oci_ref(&t.join("conv"), "h");
    let h3 = Mount::with_args(&h_conv, &t.join("mnt-h3"), &cache, SHARE);
    assert_eq!(h3.info["fetched_bytes"], 0, "{}", h3.info);
    treecmp(&[], &refs["h"], &h3.path);
    drop(h3);
    // The skipped-ranges list is a hint: with s01's bytes in h's file
    // changed, its chunk no longer verifies with the ranges found, so the
    // next mount fetches it and reads the image's bytes.
    let s01 = fs::read(refs["h"].join("data/s01.bin")).unwrap();
    let (file, at) = h_blobs
        .iter()
        .find_map(|p| {
            let bytes = fs::read(p).unwrap();
            let at = bytes.windows(s01.len()).position(|w| w == s01)?;
            Some((p, at as u64))
        })
        .unwrap();
    let f = fs::OpenOptions::new().write(true).open(file).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, b"X", at).unwrap();
    drop(f);
    let h4 = Mount::with_args(&h_conv, &t.join("mnt-h4"), &cache, SHARE);
    assert!(
        h4.info["fetched_bytes"].as_u64().unwrap() > 0,
        "{}",
        h4.info
    );
    drop_caches();
    treecmp(&[], &refs["h"], &h4.path);
    drop(h4);

    let h_ref = &refs["h"];
    drop_caches();
    for (name, _) in FILES {
        let path = format!("data/{name}.bin");
        assert!(
            fs::read(h.path.join(&path)).unwrap() == fs::read(h_ref.join(&path)).unwrap(),
            "{path} through h"
        );
        let (in_b, in_h) = (object_name(b, &path), object_name(h, &path));
        let (b_copy, h_copy) = (object(&b_shard, &in_h), object(h_own, &in_h));
        if CHANGED.contains(name) {
            assert_ne!(in_b, in_h, "{path} changed in h: its own object");
            assert!(!b_copy.exists(), "{path}: h's bytes in b's shard");
            assert!(
                resident(&h_copy) > 0,
                "{path}: read, not in h's shard's cache"
            );
        } else {
            assert_eq!(in_b, in_h, "{path}: h names another object than b");
            assert_eq!(object_name(&mounts["a2"], &path), in_b, "{path} in a2");
            assert!(
                resident(&b_copy) > 0,
                "{path}: read through h, not in b's shard"
            );
            assert_eq!(resident(&h_copy), 0, "{path}: a second copy in h's shard");
        }
    }

    // b's shard outlives b while h and a2 stack it.
    mounts.remove("b").unwrap().unmount();
    assert!(is_mountpoint(&b_shard.join("mnt")), "b's shard went with b");
    treecmp(&[], &refs["a2"], &mounts["a2"].path);
    // b's cache files gone: h's shard reads the very files it checked (open
    // since), and a new mount of h fetches what it borrowed before.
    for p in &b_blobs {
        fs::remove_file(p).unwrap();
    }
    drop_caches();
    treecmp(&[], &refs["h"], &mounts["h"].path);
    let again = Mount::with_args(&h_conv, &t.join("mnt-h2"), &cache, SHARE);
    drop_caches();
    treecmp(&[], &refs["h"], &again.path);
    let again_own = shards_of(&again).pop().unwrap();
    assert_eq!(shard_devices(&again_own), h_blobs, "h's own files, whole");
    assert!(
        allocated(&h_blobs) > h_disk,
        "h's cache files were not filled"
    );
    drop(again);
    drop(mounts);
    assert_no_shards(&cache);
}

/// The cache files a shard reads (its `blobs.json`), in device order.
#[track_caller]
fn shard_devices(shard: &Path) -> Vec<PathBuf> {
    serde_json::from_slice(&fs::read(shard.join("blobs.json")).unwrap()).unwrap()
}

/// Bytes allocated on disk to `files`.
fn allocated(files: &[PathBuf]) -> u64 {
    files
        .iter()
        .map(|p| fs::metadata(p).unwrap().blocks() * 512)
        .sum()
}

/// An image's own `trusted.overlay.*` xattrs are its data, not overlayfs's
/// instructions: stored escaped in the metadata view, they show through the
/// view as the image has them (unescaped, Linux 6.7+); stored as given,
/// overlayfs took them as its own and hid them. A dir carrying
/// `trusted.overlay.redirect=/data` lists its own entries, a file carrying
/// one reads its own bytes, and the view equals a plain eager mount's tree,
/// xattrs included. And `--share-files` refuses the FUSE path with a usage
/// error.
#[test]
fn share_files_escapes_the_images_overlay_xattrs() {
    let time = crate::Timer(
        "share_files_escapes_the_images_overlay_xattrs",
        std::time::Instant::now(),
    );
    if !require(&["zstd"]) {
        return;
    }
    let t = TestDir::new("shared-escape");
    let layout = t.join("src");
    let script = format!(
        r#"
import sys
sys.path.insert(0, {fixtures:?})
from mkimage import DIR, F, Layout, MT_TAR, _layer, _tar
redirect = {{"trusted.overlay.redirect": b"/data", "trusted.overlay.opaque": b"y"}}
entries = [DIR("data"), F("data/own.txt", b"data's\n"), DIR("evil", xattrs=redirect),
           F("evil/mine.txt", b"mine\n"),
           F("evil-file", b"evil\n", xattrs={{"trusted.overlay.redirect": b"/data/own.txt"}})]
lay = Layout({layout:?})
lay.add_image("x", [_layer(_tar(entries), MT_TAR)])
lay.finish()
"#,
        fixtures = repo_root().join("tests/fixtures").display().to_string(),
        layout = layout.display().to_string(),
    );
    let py = t.join("mk.py");
    fs::write(&py, script).unwrap();
    run(&mut command(tool("python3"), [&py]), TIMEOUT).ok();
    let image = oci_ref(&t.join("conv"), "x");
    convert(&oci_ref(&layout, "x"), &image);
    let cache = t.join("cache");
    let view = Mount::with_args(&image, &t.join("mnt"), &cache, SHARE);
    let mut names: Vec<_> = fs::read_dir(view.path.join("evil"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        ["mine.txt"],
        "evil/ redirected by the image's own xattr"
    );
    assert_eq!(fs::read(view.path.join("evil-file")).unwrap(), b"evil\n");
    assert_eq!(
        xattr(&view.path.join("evil"), "trusted.overlay.redirect").as_deref(),
        Some(&b"/data"[..])
    );
    let plain = Mount::with_args(
        &image,
        &t.join("plain"),
        &cache,
        &["--eager", "--mode", "kernel"],
    );
    treecmp(&[], &plain.path, &view.path);

    let fuse = lamina_cmd(["mount", "--mode", "fuse", "--share-files", &image])
        .arg(t.mkdir("fuse"))
        .arg("--cache-dir")
        .arg(&cache)
        .output()
        .unwrap();
    assert_eq!(fuse.status.code(), Some(2), "{fuse:?}");
    let err = String::from_utf8_lossy(&fuse.stderr);
    assert!(err.contains("--share-files needs the kernel path"), "{err}");
    drop(time);
}

/// Lazy views (`--lazy --prefetch none`): b and h each mounted as a view
/// whose own shard is mounted by its holder. Both equal `umoci unpack`; h
/// stacks b's shard first and reads the unpacked files it shares with b
/// through it (packed files are named by their packs on a lazy mount, and
/// h's pack changed). Then b is unmounted while h still stacks b's shard:
/// b's holder must serve on, so the files h reads next, which nobody read
/// before (their chunks not fetched), get the image's bytes, not holes.
/// The last unmount takes every shard and holder down.
#[test]
fn lazy_views_share_and_outlive_their_image() {
    let Some((_time, t, src)) = begin("lazy_views_share_and_outlive_their_image", "shared-lazy")
    else {
        return;
    };
    let cache = t.join("cache");
    // Nothing fetched but what is read: no read ahead, no predictions.
    let lazy = [
        "--lazy",
        "--prefetch",
        "none",
        "--fill-ahead",
        "0",
        "--predict-max",
        "0",
        "--mode",
        "kernel",
        "--share-files",
    ];
    let (mut mounts, mut refs) = (BTreeMap::new(), BTreeMap::new());
    for tag in ["b", "h"] {
        let image = oci_ref(&t.join("conv"), tag);
        convert(&oci_ref(&src, tag), &image);
        let m = Mount::with_args(&image, &t.join(&format!("mnt-{tag}")), &cache, &lazy);
        refs.insert(tag, reference(&t, &src, tag));
        mounts.insert(tag, m);
    }
    let b_shard = shards_of(&mounts["b"]).pop().unwrap();
    let h_shards = shards_of(&mounts["h"]);
    assert_eq!(h_shards[0], b_shard, "h stacks b's shard first");
    for (name, size) in FILES {
        let path = format!("data/{name}.bin");
        let (in_b, in_h) = (
            object_name(&mounts["b"], &path),
            object_name(&mounts["h"], &path),
        );
        let shared = !CHANGED.contains(name) && *size > 16 << 10;
        assert_eq!(
            in_b == in_h,
            shared,
            "{path}: b's object {in_b}, h's {in_h}"
        );
    }
    let want = crate::images::tree_hashes(&refs["h"]);
    let files: Vec<String> = want.keys().cloned().collect();
    let (first, rest) = files.split_at(files.len() / 2);
    let mut f = Failures::default();
    let got = read_files(&mounts["h"].path, first, t.path(), "h-first");
    check_reads(&mut f, "h, first half", &want, first, &got);

    // b's cache files still have chunks to fetch: h's next reads need
    // b's holder.
    let b_mnt = b_shard.join("mnt");
    let b_status = shard_status(&cache, &b_shard);
    let (cached, total) = (
        &b_status["status"]["cached_bytes"],
        &b_status["status"]["total_bytes"],
    );
    assert!(
        cached.as_u64() < total.as_u64(),
        "b's cache is complete: {b_status}"
    );

    mounts.remove("b").unwrap().unmount();
    assert!(is_mountpoint(&b_mnt), "b's shard went with b");
    drop_caches();
    let got = read_files(&mounts["h"].path, rest, t.path(), "h-rest");
    check_reads(
        &mut f,
        "h after b's unmount, files nobody read",
        &want,
        rest,
        &got,
    );
    treecmp(&[], &refs["h"], &mounts["h"].path);
    f.finish("lazy views");
    drop(mounts);
    assert_no_shards(&cache);
}

/// `lamina status --json`'s entry of the lazy shard `shard` (its holder's).
#[track_caller]
fn shard_status(cache: &Path, shard: &Path) -> Value {
    let status = lamina(["status", "--json", "--cache-dir", cache.to_str().unwrap()]).ok();
    let status: Value = serde_json::from_str(&status.stdout).unwrap();
    let mnt = shard.join("mnt");
    let entry = status
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["mountpoint"].as_str() == mnt.to_str());
    entry
        .unwrap_or_else(|| panic!("no status of shard {}: {status}", shard.display()))
        .clone()
}

/// `lamina mount` arguments of a lazy `--share-files` kernel mount.
fn lazy_share(prefetch: &str) -> [&str; 6] {
    [
        "--lazy",
        "--prefetch",
        prefetch,
        "--mode",
        "kernel",
        "--share-files",
    ]
}

/// The fixture's image `tag` converted into `t/conv` and mounted at
/// `t/mnt-<tag>` with `args`; its `umoci unpack` goes in `refs`.
#[track_caller]
fn mount_tag(
    t: &TestDir,
    src: &Path,
    cache: &Path,
    refs: &mut BTreeMap<String, PathBuf>,
    (tag, args): (&str, &[&str]),
) -> Mount {
    let image = oci_ref(&t.join("conv"), tag);
    convert(&oci_ref(src, tag), &image);
    refs.insert(tag.to_string(), reference(t, src, tag));
    Mount::with_args(&image, &t.join(&format!("mnt-{tag}")), cache, args)
}

/// Waits until the prefetch of lazy shard `shard` has ended; its status.
#[track_caller]
fn prefetched(cache: &Path, shard: &Path) -> Value {
    let started = std::time::Instant::now();
    loop {
        let status = shard_status(cache, shard)["status"].clone();
        let (done, total) = (&status["prefetch_done"], &status["prefetch_total"]);
        if total.as_u64() > Some(0) && done == total {
            return status;
        }
        assert!(
            started.elapsed() < TIMEOUT,
            "the prefetch of {} did not end: {status}",
            shard.display()
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// A lazy view borrows what the node's complete cache files hold: b
/// mounted eagerly, then h (a rebuild) lazily with `--prefetch all`. h's
/// shard reads b's cache files for the chunks they hold, h's worker
/// fetches only the rest ahead (it fetched all of h before), and h reads
/// the image's bytes, also after b's cache files are deleted.
#[test]
fn lazy_views_borrow_chunks_the_node_holds() {
    let Some((_time, t, src)) = begin("lazy_views_borrow_chunks_the_node_holds", "shared-borrow")
    else {
        return;
    };
    let cache = t.join("cache");
    let mut refs = BTreeMap::new();
    let b = mount_tag(&t, &src, &cache, &mut refs, ("b", SHARE));
    let h = mount_tag(&t, &src, &cache, &mut refs, ("h", &lazy_share("all")));
    let h_own = shards_of(&h).pop().unwrap();
    let b_blobs = b.blob_paths();
    let h_devices = shard_devices(&h_own);
    assert!(
        b_blobs.iter().all(|p| h_devices.contains(p)),
        "h's shard does not read b's cache files: {h_devices:?}"
    );
    prefetched(&cache, &h_own);
    treecmp(&[], &refs["h"], &h.path);
    let h_blobs: Vec<PathBuf> = h_devices[..h_devices.len() - b_blobs.len()].to_vec();
    let (b_disk, h_disk) = (allocated(&b_blobs), allocated(&h_blobs));
    eprintln!("cache files on disk: b {b_disk} B, h {h_disk} B");
    assert!(
        h_disk * 2 < b_disk,
        "h's cache files hold {h_disk} B, b's {b_disk} B: fetched, not borrowed"
    );
    b.unmount();
    for p in &b_blobs {
        fs::remove_file(p).unwrap();
    }
    drop_caches();
    treecmp(&[], &refs["h"], &h.path);
    drop(h);
    assert_no_shards(&cache);
}

/// A lazy view does not fetch ahead what another shard serves it: b
/// mounted lazily (`--prefetch none`, nothing borrowable: its cache files
/// are not complete), then h (a rebuild) lazily with `--prefetch all`. h's
/// view takes the files it shares with b from b's shard, so h's worker
/// fetches only the chunks its own objects read (it fetched all of h
/// before), and h reads the image's bytes, b's holder fetching the rest.
#[test]
fn lazy_views_fetch_ahead_only_what_they_serve() {
    let Some((_time, t, src)) = begin("lazy_views_fetch_ahead_only_what_they_serve", "shared-own")
    else {
        return;
    };
    let cache = t.join("cache");
    let mut refs = BTreeMap::new();
    let b = mount_tag(&t, &src, &cache, &mut refs, ("b", &lazy_share("none")));
    let h = mount_tag(&t, &src, &cache, &mut refs, ("h", &lazy_share("all")));
    let h_own = shards_of(&h).pop().unwrap();
    let h_blobs = shard_devices(&h_own);
    let status = prefetched(&cache, &h_own);
    let total = status["total_bytes"].as_u64().unwrap();
    let h_disk = allocated(&h_blobs);
    eprintln!("h's cache files: {h_disk} B on disk of {total} B");
    assert!(
        h_disk * 2 < total,
        "h fetched ahead what b's shard serves it: {h_disk} B of {total} B"
    );
    treecmp(&[], &refs["h"], &h.path);
    assert_eq!(
        allocated(&h_blobs),
        h_disk,
        "reading h filled its own cache files further"
    );
    drop(b);
    drop_caches();
    treecmp(&[], &refs["h"], &h.path);
    drop(h);
    assert_no_shards(&cache);
}

/// An image converted without packing (each small file a chunk of its
/// own) borrows those chunks from the packs of an image converted with
/// it: found by their bytes, through b's named ranges lists. Its cache
/// files hold none of the small files' bytes, and it reads as `umoci
/// unpack` of the image, also with the page cache dropped.
#[test]
fn a_chunk_packed_elsewhere_is_borrowed_by_its_bytes() {
    let Some((_time, t, src)) = begin(
        "a_chunk_packed_elsewhere_is_borrowed_by_its_bytes",
        "shared-unpacked",
    ) else {
        return;
    };
    let cache = t.join("cache");
    let (packed, unpacked) = (oci_ref(&t.join("conv"), "b"), oci_ref(&t.join("conv"), "u"));
    convert(&oci_ref(&src, "b"), &packed);
    lamina([
        "convert",
        "--pack-limit",
        "0",
        &oci_ref(&src, "b"),
        &unpacked,
    ])
    .ok();
    let reference = reference(&t, &src, "b");
    let b = Mount::with_args(&packed, &t.join("mnt-b"), &cache, SHARE);
    let u = Mount::with_args(&unpacked, &t.join("mnt-u"), &cache, SHARE);
    assert_eq!(u.info["fetched_bytes"], 0, "{}", u.info);
    let u_bytes: Vec<u8> = u
        .blob_paths()
        .iter()
        .flat_map(|p| fs::read(p).unwrap())
        .collect();
    for name in ["s00", "s01", "s02", "s03"] {
        let want = fs::read(reference.join(format!("data/{name}.bin"))).unwrap();
        assert!(
            !u_bytes.windows(want.len()).any(|w| w == want),
            "{name}: copied into u's cache files, not borrowed from b's pack"
        );
    }
    drop_caches();
    treecmp(&[], &reference, &u.path);
    drop(u);
    // A plain lazy mount's worker copies them from b's pack too.
    let args = ["--lazy", "--prefetch", "all", "--mode", "kernel"];
    let plain = Mount::with_args(&unpacked, &t.join("mnt-u-lazy"), &cache, &args);
    plain.wait_complete(TIMEOUT);
    let status = plain.status().expect("a lazy mount has a status")["status"].clone();
    assert_eq!(
        status["fetched_bytes"], 0,
        "a plain lazy mount fetched what b's cache files hold: {status}"
    );
    treecmp(&[], &reference, &plain.path);
    drop(plain);
    drop(b);
    assert_no_shards(&cache);
}

/// No shard is left in `cache` (after the last view's unmount).
#[track_caller]
fn assert_no_shards(cache: &Path) {
    let domains = fs::read_dir(cache.join("shards")).unwrap().flatten();
    let left: Vec<_> = domains
        .flat_map(|d| fs::read_dir(d.path()).unwrap().flatten())
        .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
        .map(|e| e.path())
        .collect();
    assert!(
        left.is_empty(),
        "shards left after the last unmount: {left:?}"
    );
}

/// A view that cannot be made (here its metadata view's mountpoint is a
/// file) fails the mount and takes down the shard the mount made for it:
/// nothing stays mounted, no shard is left for other views to stack. The
/// same mount then succeeds once the obstacle is gone.
#[test]
fn a_view_that_cannot_be_made_leaves_no_shard() {
    let Some((_time, t, src)) = begin("a_view_that_cannot_be_made_leaves_no_shard", "shared-fail")
    else {
        return;
    };
    let cache = t.join("cache");
    let image = oci_ref(&t.join("conv"), "b");
    convert(&oci_ref(&src, "b"), &image);
    let mnt = t.mkdir("mnt");
    let run = run_dir_for(&cache, &mnt);
    fs::create_dir_all(&run).unwrap();
    fs::write(run.join("view"), b"in the way").unwrap();
    let failed = lamina_cmd([
        "mount",
        "--eager",
        "--mode",
        "kernel",
        "--share-files",
        &image,
    ])
    .arg(&mnt)
    .arg("--cache-dir")
    .arg(&cache)
    .output()
    .unwrap();
    assert!(!failed.status.success(), "{failed:?}");
    assert!(!is_mountpoint(&mnt), "{} mounted", mnt.display());
    let mounted = mounts_under(&cache);
    assert!(mounted.is_empty(), "left mounted: {mounted:?}");
    assert_no_shards(&cache);
    fs::remove_file(run.join("view")).unwrap();
    let m = Mount::with_args(&image, &mnt, &cache, SHARE);
    treecmp(&[], &reference(&t, &src, "b"), &m.path);
}

/// `lamina umount` of a lazy `--share-files` view from another cache dir
/// (the default one, say) finds the cache dir the view was made with from
/// the mount itself: the view, its holder and worker, its shard and its
/// metadata view all go. It used to unmount the view alone and leave the
/// rest mounted and running for good, with no record left to find them by.
#[test]
fn an_unmount_from_another_cache_dir_takes_down_the_whole_view() {
    let Some((_time, t, src)) = begin(
        "an_unmount_from_another_cache_dir_takes_down_the_whole_view",
        "shared-umount",
    ) else {
        return;
    };
    let cache = t.join("cache");
    let mut refs = BTreeMap::new();
    let m = mount_tag(&t, &src, &cache, &mut refs, ("b", &lazy_share("none")));
    treecmp(&[], &refs["b"], &m.path);
    let ready: Value =
        serde_json::from_slice(&fs::read(view_run_dir(&m).join("ready")).unwrap()).unwrap();
    let holder = ready["pid"].as_u64().expect("the holder's pid") as u32;
    let other = t.mkdir("other-cache");
    let out = lamina_cmd(["umount"])
        .arg(&m.path)
        .arg("--cache-dir")
        .arg(&other)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(!is_mountpoint(&m.path), "still mounted");
    let mounted = mounts_under(&cache);
    assert!(mounted.is_empty(), "left mounted: {mounted:?}");
    assert_no_shards(&cache);
    assert!(
        process_exits(holder, TIMEOUT),
        "the view's holder (pid {holder}) outlived its unmount"
    );
    drop(m);
}

/// Sharing stays inside a trust domain: the same image from two layouts
/// (two domains) mounted with `--share-files` on one cache gets a shard
/// in each domain, and each view stacks only its own: a file both have
/// is named alike but read through two objects, each over its own
/// domain's cache files.
#[test]
fn shards_are_not_shared_across_trust_domains() {
    let Some((_time, t, src)) = begin(
        "shards_are_not_shared_across_trust_domains",
        "shared-domains",
    ) else {
        return;
    };
    let cache = t.join("cache");
    let mut mounts = Vec::new();
    for layout in ["conv", "conv2"] {
        let image = oci_ref(&t.join(layout), "b");
        convert(&oci_ref(&src, "b"), &image);
        let mnt = t.join(&format!("mnt-{layout}"));
        mounts.push(Mount::with_args(&image, &mnt, &cache, SHARE));
    }
    let (one, two) = (shards_of(&mounts[0]), shards_of(&mounts[1]));
    assert_eq!((one.len(), two.len()), (1, 1), "{one:?} {two:?}");
    assert_ne!(
        one[0].parent(),
        two[0].parent(),
        "one shards dir per domain"
    );
    let path = "data/f04.bin";
    let name = object_name(&mounts[0], path);
    assert_eq!(object_name(&mounts[1], path), name);
    let (a, b) = (object(&one[0], &name), object(&two[0], &name));
    let (a, b) = (fs::metadata(a).unwrap(), fs::metadata(b).unwrap());
    assert_ne!(
        (a.dev(), a.ino()),
        (b.dev(), b.ino()),
        "{path}: one object for two domains"
    );
}
