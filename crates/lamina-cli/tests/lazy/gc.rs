//! Section 8, gc: it evicts only unused images and keeps live mounts' files;
//! a live mount outlives its removed binary and a replaced cache file.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::common::*;
use crate::daemon::{finish_with_logs, kill9, num, settled_status, start, status_file, Lazy};
use crate::holder::worker_pid;
use crate::readers::{check_reads, chroot_python, hash_files};
use crate::IMAGE;
use serde_json::Value;

// ---------------------------------------------------------------------------
// 8. gc

/// Files of a cache dir's blobs/ and meta/ (absolute paths).
fn cache_files(cache: &Path) -> BTreeSet<PathBuf> {
    let mut out = BTreeSet::new();
    for sub in ["blobs", "meta"] {
        out.extend(cache_files_in(cache, sub));
    }
    out
}

/// Files a live lazy mount uses, from its run dir's config.json.
fn live_files(rd: &Path) -> BTreeSet<PathBuf> {
    let c: Value = serde_json::from_slice(&fs::read(rd.join("config.json")).unwrap()).unwrap();
    let mut out = BTreeSet::new();
    for key in ["metadata_path", "index_path"] {
        let p = PathBuf::from(c[key].as_str().unwrap());
        // The fill record of a file cached whole, `<file>.fill`: a lazy
        // mount leaves it to its worker, which writes it in the background.
        let mut record = p.clone().into_os_string();
        record.push(".fill");
        let record = PathBuf::from(record);
        let deadline = Instant::now() + Duration::from_secs(30);
        while !record.exists() {
            assert!(
                Instant::now() < deadline,
                "the worker did not record {} within 30 s",
                p.display()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        out.insert(record);
        out.insert(p);
    }
    for boot in c["boot_pages"].as_array().unwrap() {
        // Each frame's copy, `<path>.<k>`.
        let frames = boot["frames"].as_array().map_or(1, Vec::len);
        for k in 0..frames {
            out.insert(PathBuf::from(format!(
                "{}.{k}",
                boot["path"].as_str().unwrap()
            )));
        }
    }
    for b in c["blobs"].as_array().unwrap() {
        let p = PathBuf::from(b["cache_path"].as_str().unwrap());
        // The fill record exists once the worker saved verified chunks,
        // the chunk table once a read needed the blob (paged index).
        for kept in ["fill", "table"] {
            if p.with_extension(kept).exists() {
                out.insert(p.with_extension(kept));
            }
        }
        out.insert(p);
    }
    out
}

/// The edge fixture converted into `dir` (tag edge), lazily mountable from
/// the layout with --lazy.
fn edge_image(dir: &Path) -> String {
    let image = oci_ref(dir, "edge");
    lamina(["convert", &oci_ref(&edge_layout(), "edge"), &image]).ok();
    image
}

/// Issue 28 point 6: a lazy mount made by a binary that is then removed (an
/// upgrade, a cleaned build dir) still restarts its worker after a `kill
/// -9`, from the very binary it runs (`/proc/self/exe`), and reads every
/// file right. Before, the holder looked for the binary by its path and
/// retried forever, and readers got EIO.
#[test]
fn a_removed_binary_still_restarts_its_worker() {
    if !require(&[]) {
        return;
    }
    let t = TestDir::new("lazy-moved-binary");
    let edge = edge_image(&t.join("edge"));
    let bin = t.join("bin");
    fs::create_dir_all(&bin).unwrap();
    let copy = bin.join("lamina");
    fs::copy(LAMINA, &copy).unwrap();
    let (mnt, cache) = (t.join("mnt"), t.join("cache"));
    fs::create_dir_all(&mnt).unwrap();
    let mut args = vec!["mount", "--json", "--lazy", "--mode", "kernel", &edge];
    args.extend([
        mnt.to_str().unwrap(),
        "--cache-dir",
        cache.to_str().unwrap(),
    ]);
    let out = run(&mut command(&copy, args), TIMEOUT).ok();
    let m = Mount {
        path: mnt.clone(),
        cache: cache.clone(),
        info: out.json(),
    };
    fs::remove_dir_all(&bin).unwrap();
    let worker = worker_pid(&m);
    kill9(worker);
    treecmp(&[], &ociunpack(&edge_layout(), "edge"), &m.path);
    let restarted = worker_pid(&m);
    assert_ne!(restarted, worker, "the worker was not restarted");
    m.unmount();
}

/// Issue 28 point 2: a cache file replaced under a live lazy mount (here
/// by hand: a new sparse file renamed over each, then the worker killed so
/// that it opens its stores again) is never served from: reads fail with
/// EIO, never zeros. Before, the new worker filled the new file and let the
/// kernel read the old, sparse inode: zeros.
#[test]
fn a_cache_file_replaced_under_a_live_mount_is_never_served_from() {
    if !require(&[]) {
        return;
    }
    let t = TestDir::new("lazy-replaced");
    let edge = edge_image(&t.join("edge"));
    let cache = t.join("cache");
    let m = Mount::with_args(
        &edge,
        &t.join("mnt"),
        &cache,
        &["--lazy", "--mode", "kernel"],
    );
    let worker = worker_pid(&m);
    for blob in m.blob_paths() {
        let size = fs::metadata(&blob).unwrap().len();
        let other = blob.with_extension("other");
        fs::File::create(&other).unwrap().set_len(size).unwrap();
        fs::rename(&other, &blob).unwrap();
    }
    kill9(worker);
    let reference = ociunpack(&edge_layout(), "edge");
    let (mut failed, mut wrong) = (0, Vec::new());
    for rel in regular_files(&reference) {
        let want = fs::read(reference.join(&rel)).unwrap();
        match fs::read(m.path.join(&rel)) {
            Ok(got) if got == want => {}
            Ok(_) => wrong.push(rel),
            Err(e) => {
                assert_eq!(e.raw_os_error(), Some(5), "{}: {e}", rel.display());
                failed += 1;
            }
        }
    }
    assert!(wrong.is_empty(), "wrong bytes read from {wrong:?}");
    assert!(failed > 0, "no read failed: the replaced files were served");
    let log = fs::read_to_string(run_dir(&m).join("worker.log")).unwrap();
    assert!(log.contains("replaced since"), "worker log:\n{log}");
    drop(m);
}

/// One live lazy mount (Debian) and one image mounted and unmounted before
/// (edge) in one cache dir: gc --max-size 0 evicts exactly the edge files and
/// the live mount reads every file right afterwards.
#[test]
fn gc_evicts_only_the_unused_image() {
    let Some(Lazy { _time, deb, reg, t }) = start("gc_evicts_only_the_unused_image", "lazy-gc")
    else {
        return;
    };
    let cache = t.join("cache");

    let edge = edge_image(&t.join("edge"));
    let me = Mount::with_args(&edge, &t.join("mnt-edge"), &cache, &["--lazy"]);
    treecmp(&[], &ociunpack(&edge_layout(), "edge"), &me.path);
    let edge_files = live_files(&run_dir(&me));
    me.unmount();

    // 1 MiB fill window: the full read after gc takes fewer requests.
    let m = Mount::with_args(
        &reg.reference(IMAGE),
        &t.join("mnt"),
        &cache,
        &["--fill-window", "1048576"],
    );
    chroot_python(&m.path);
    let rd = run_dir(&m);
    let live = live_files(&rd);
    let before = cache_files(&cache);
    let mut f = Failures::default();
    f.check(
        edge_files.is_subset(&before) && live.is_subset(&before),
        || {
            format!(
                "cache files before gc {before:?} lack some of edge {edge_files:?} / live {live:?}"
            )
        },
    );
    f.check(edge_files.is_disjoint(&live), || {
        "edge and Debian share cache files".into()
    });

    let report = lamina([
        "gc",
        "--json",
        "--max-size",
        "0",
        "--cache-dir",
        cache.to_str().unwrap(),
    ])
    .ok()
    .json();
    let evicted: BTreeSet<PathBuf> = report["evicted"]
        .as_array()
        .unwrap_or_else(|| panic!("no evicted list: {report}"))
        .iter()
        .map(|p| PathBuf::from(p.as_str().unwrap()))
        .collect();
    let after = cache_files(&cache);
    f.check(evicted == edge_files, || {
        format!("gc evicted {evicted:?}, expected exactly the unused image's files {edge_files:?}")
    });
    // Read again: the worker may have saved a fill record since (it saves
    // verified chunks within a second), and gc rightly keeps it. The chunk
    // locators stay too: bounded, one per trust domain (the edge layout's
    // and the registry's), shared by every entry of theirs.
    let mut live = live_files(&rd);
    let config: Value = serde_json::from_slice(&fs::read(rd.join("config.json")).unwrap()).unwrap();
    let blob_dir = PathBuf::from(config["blob_dir"].as_str().unwrap());
    assert!(blob_dir.starts_with(cache.join("blobs")), "{blob_dir:?}");
    let locators: BTreeSet<PathBuf> = before
        .iter()
        .filter(|p| p.ends_with(lamina_fetch::locator::LOCATOR_FILE))
        .cloned()
        .collect();
    f.check(
        locators.contains(&blob_dir.join(lamina_fetch::locator::LOCATOR_FILE)),
        || format!("no chunk locator in the live mount's domain: {locators:?}"),
    );
    live.extend(locators);
    f.check(after == live, || {
        format!("after gc the cache holds {after:?}, expected exactly the live mount's files and the chunk locators {live:?}")
    });
    let got = hash_files(&m.path, &deb.files, t.path(), "after-gc", TIMEOUT);
    match got {
        Ok(got) => check_reads(&mut f, "live mount after gc", deb, &deb.files, &got),
        Err(e) => f.check(false, || e),
    }
    let s = settled_status(&m);
    f.check(num(&s, "failed_misses") == 0, || {
        format!("failed misses: {s}")
    });
    eprintln!(
        "figures: gc evicted {} files, freed {} bytes, kept {} bytes, {} in use",
        evicted.len(),
        report["freed_bytes"],
        report["kept_bytes"],
        report["in_use"]
    );
    finish_with_logs(f, &rd, String::new, "gc");
    m.unmount();
}

/// The same cache dir named by a relative path (as `lamina gc --cache-dir
/// cache` from its parent): gc must still see the live mount's files as in
/// use, and the mount must keep working, also after its worker restarts.
#[test]
fn gc_with_relative_cache_dir_keeps_live_mount_files() {
    let Some(Lazy { _time, deb, reg, t }) = start(
        "gc_with_relative_cache_dir_keeps_live_mount_files",
        "lazy-gc-rel",
    ) else {
        return;
    };
    let cache = t.join("cache");
    let m = Mount::with_args(
        &reg.reference(IMAGE),
        &t.join("mnt"),
        &cache,
        &["--timeout", "5"],
    );
    chroot_python(&m.path);
    let rd = run_dir(&m);
    let live = live_files(&rd);

    let mut c = lamina_cmd(["gc", "--json", "--max-size", "0", "--cache-dir", "cache"]);
    c.current_dir(t.path());
    let out = run(&mut c, TIMEOUT).ok();
    let report = out.json();
    let after = cache_files(&cache);
    let mut f = Failures::default();
    f.check(report["evicted"].as_array().is_some_and(|e| e.is_empty()), || {
        format!(
            "`lamina gc --max-size 0 --cache-dir cache` (relative) evicted files of the live mount: {}",
            report["evicted"]
        )
    });
    f.check(live.is_subset(&after), || {
        format!(
            "live mount files gone after gc: {:?}",
            live.difference(&after).collect::<Vec<_>>()
        )
    });

    // What that costs: the next worker (after a crash) must still serve.
    let pid = status_file(&rd)
        .and_then(|s| s["pid"].as_u64())
        .expect("worker pid") as u32;
    kill9(pid);
    let sample = vec!["usr/sbin/nginx".to_string(), "usr/bin/perl".to_string()]
        .into_iter()
        .filter(|p| deb.hashes.contains_key(p))
        .collect::<Vec<_>>();
    match hash_files(
        &m.path,
        &sample,
        t.path(),
        "after-gc",
        Duration::from_secs(120),
    ) {
        Ok(got) => check_reads(
            &mut f,
            "live mount after gc and a worker restart",
            deb,
            &sample,
            &got,
        ),
        Err(e) => f.check(false, || e),
    }
    finish_with_logs(f, &rd, String::new, "gc with a relative cache dir");
    m.unmount();
}

/// Issue 42, point 7: one image's fills no reader waits for never take the
/// space another tenant's reads need. On a cache filesystem smaller than
/// the Debian image, Debian is mounted with `--prefetch all` and a 64 MiB
/// reserve; once its prefetch has ended, another tenant's image (edge, an
/// OCI layout) is mounted lazily on the same cache dir and reads like
/// `umoci unpack`, and python3 still starts on Debian (its misses may use
/// the reserve). With no reserve (`--cache-reserve 0`, as before) the
/// prefetch filled the filesystem and made no progress for the 10 minutes
/// this test waits; with one smaller than the other image needs (24 MiB)
/// that tenant's reads failed with EIO.
#[test]
fn a_prefetch_all_leaves_the_reserve_to_other_tenants() {
    let Some(Lazy {
        _time,
        deb: _,
        reg,
        t,
    }) = start(
        "a_prefetch_all_leaves_the_reserve_to_other_tenants",
        "lazy-reserve",
    )
    else {
        return;
    };
    // Below the image: its prefetch alone could fill the filesystem.
    let (image_bytes, fs_bytes, small) = below_the_image(&t, &reg.reference(IMAGE));
    let cache = small.0.join("cache");
    let args = ["--prefetch", "all", "--cache-reserve", "64M"];
    let a = Mount::with_args(&reg.reference(IMAGE), &t.join("mnt-a"), &cache, &args);
    let deadline = Instant::now() + Duration::from_secs(600);
    let status = loop {
        let s = settled_status(&a);
        let (done, total) = (num(&s, "prefetch_done"), num(&s, "prefetch_total"));
        if total > 0 && done >= total {
            break s;
        }
        assert!(Instant::now() < deadline, "prefetch never ended: {s}");
        std::thread::sleep(Duration::from_millis(200));
    };
    let free = rustix::fs::statvfs(&cache).map(|s| s.f_bavail * s.f_frsize);
    eprintln!(
        "figures: image {image_bytes} B, cache filesystem {fs_bytes} B, {} B fetched by the prefetch, {free:?} B free after it",
        num(&status, "fetched_bytes")
    );
    let mut f = Failures::default();
    let log = fs::read_to_string(run_dir(&a).join("worker.log")).unwrap_or_default();
    f.check(log.contains("reserve"), || {
        format!("the prefetch never met the reserve (the test tests nothing):\n{log}")
    });
    // The other tenant's mount writes its metadata and index, then its
    // reads fill its own cache files.
    let edge = edge_image(&t.join("edge"));
    let b = Mount::with_args(&edge, &t.join("mnt-b"), &cache, &["--lazy"]);
    treecmp(&[], &ociunpack(&edge_layout(), "edge"), &b.path);
    b.unmount();
    chroot_python(&a.path);
    a.unmount();
    f.finish("the cache reserve");
}

/// The uncompressed bytes of `image`'s blobs, and a filesystem three
/// quarters that size (96 MiB at least), mounted in `t`, with its size.
fn below_the_image(t: &TestDir, image: &str) -> (u64, u64, LoopExt4) {
    let inspect = lamina(["inspect", "--json", image]).ok().json();
    let image_bytes: u64 = inspect["blobs"]
        .as_array()
        .expect("blobs")
        .iter()
        .map(|b| b["cache_bytes"].as_u64().expect("cache_bytes"))
        .sum();
    let fs_bytes = (image_bytes * 3 / 4).max(96 << 20);
    (image_bytes, fs_bytes, LoopExt4::mount(t, "small", fs_bytes))
}

/// Issue 42 point 7, per image: with `--reserve-space` a mount takes its
/// cache files' space when it mounts, as an overlayfs snapshot takes it at
/// pull time. Tenant B's small image is mounted first; tenant A's image,
/// bigger than what is left, is then refused at mount with a clear error,
/// so B's reads never meet a full filesystem. Without the reservation A
/// mounted, reading A filled the filesystem, and B's reads failed with EIO
/// (this test then reads A whole and fails on B's tree).
#[test]
fn a_reserved_mount_never_loses_its_space_to_another_images_fills() {
    let Some(Lazy {
        _time,
        deb: _,
        reg,
        t,
    }) = start(
        "a_reserved_mount_never_loses_its_space_to_another_images_fills",
        "lazy-reserve-space",
    )
    else {
        return;
    };
    let (image_bytes, fs_bytes, small) = below_the_image(&t, &reg.reference(IMAGE));
    let cache = small.0.join("cache");
    let mut f = Failures::default();

    let edge = edge_image(&t.join("edge"));
    let b = Mount::with_args(
        &edge,
        &t.join("mnt-b"),
        &cache,
        &["--lazy", "--reserve-space"],
    );
    for path in b.blob_paths() {
        let whole = allocated_whole(&path);
        f.check(whole.is_ok(), || whole.unwrap_err());
    }

    let mnt_a = t.join("mnt-a");
    fs::create_dir_all(&mnt_a).unwrap();
    let a = lamina([
        "mount",
        "--json",
        "--reserve-space",
        "--prefetch",
        "none",
        &reg.reference(IMAGE),
        mnt_a.to_str().unwrap(),
        "--cache-dir",
        cache.to_str().unwrap(),
    ]);
    if a.status.success() {
        f.check(false, || {
            format!(
                "A ({image_bytes} B) mounted on a {fs_bytes} B cache:\n{}",
                a.describe()
            )
        });
        // What the reservation is for: A's readers fill the filesystem.
        let read_all = format!(
            "find {} -type f -exec cat {{}} + >/dev/null 2>&1; true",
            mnt_a.display()
        );
        run(&mut command("sh", ["-c", &read_all]), TIMEOUT);
    } else {
        f.check(a.stderr.contains("no room"), || {
            format!("A was refused without saying why:\n{}", a.describe())
        });
        f.check(!is_mountpoint(&mnt_a), || "A is mounted after all".into());
    }
    treecmp(&[], &ociunpack(&edge_layout(), "edge"), &b.path);
    let _ = lamina([
        "umount",
        mnt_a.to_str().unwrap(),
        "--cache-dir",
        cache.to_str().unwrap(),
    ]);
    b.unmount();
    f.finish("per-image reservation");
}
