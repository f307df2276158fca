//! Issue 31: an update fetches only what changed: the chunks and boot
//! pages the node does not hold yet.

use std::collections::BTreeSet;
use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::common::*;
use crate::images::{begin, convert, hex, index_top, reference, tree_hashes};
use crate::reading::{check_reads, drop_caches, read_files};
use lamina_format::index::{ChunkEntry, IndexBlob};
use serde_json::Value;

// ---------------------------------------------------------------------------
// issue 31: an update fetches only what changed

/// The chunks of the single data blob of `layout:tag` (a paged index): its
/// table read from the end of the blob.
#[track_caller]
fn blob_chunks(layout: &Path, tag: &str, work: &Path) -> Vec<ChunkEntry> {
    let top = index_top(layout, tag, work);
    let [summary] = &top.blobs[..] else {
        panic!("{}:{tag}: {} data blobs", layout.display(), top.blobs.len());
    };
    let (at, len) = summary.table_range().expect("a paged index");
    let blob = fs::read(blob_path(
        layout,
        &format!("sha256:{}", hex(&summary.digest)),
    ))
    .unwrap();
    let table = &blob[at as usize..(at + len) as usize];
    IndexBlob::from_table(summary, top.chunk_bits, table)
        .unwrap()
        .chunks
}

/// Waits until the worker of `m` holds every chunk of its image (its
/// `status.json` says each blob is complete).
#[track_caller]
fn wait_complete(m: &Mount) {
    let start = Instant::now();
    loop {
        let status = worker_status(m).unwrap_or(Value::Null);
        let blobs = status["blobs"].as_array().cloned().unwrap_or_default();
        if !blobs.is_empty() && blobs.iter().all(|b| b["complete"] == true) {
            return;
        }
        assert!(start.elapsed() < SHORT, "never complete: {status}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The worker's `status.json` as it is now (`None`: not there or torn).
fn worker_status(m: &Mount) -> Option<Value> {
    serde_json::from_slice(&fs::read(run_dir(m).join("status.json")).ok()?).ok()
}

/// The worker's `status.json` once its figures stopped changing.
#[track_caller]
fn settled_status(m: &Mount) -> Value {
    let read = || worker_status(m);
    let start = Instant::now();
    let mut last = read();
    loop {
        std::thread::sleep(Duration::from_millis(300));
        let now = read();
        if let Some(settled) = now.as_ref().filter(|_| now == last) {
            return settled.clone();
        }
        assert!(
            start.elapsed() < SHORT,
            "status.json never settled: {now:?}"
        );
        last = now;
    }
}

/// Issue 31 point 3. Image v2 is image v1 rebuilt with three files changed
/// (another layer, another blob, most chunks the same). On one cache, a
/// lazy mount of v1 reads every file; then a lazy mount of v2 reads every
/// file: it must get v2's bytes, copy every chunk v1 holds from v1's cache
/// file (found by digest through the cache's chunk locator) and fetch only
/// the chunks that changed: at most 1.2x their compressed size, plus v2's
/// chunk table. A mount of v2 on a fresh cache fetches them all (the
/// measure would see a copy that did not happen). Kernel path and FUSE.
// Over 100 lines: v1 then v2 on one cache, the counts checked between.
#[test]
fn an_update_fetches_only_the_chunks_the_node_does_not_hold() {
    let Some((_time, t, src)) = begin(
        "an_update_fetches_only_the_chunks_the_node_does_not_hold",
        "tenants-update",
    ) else {
        return;
    };
    let (ref_1, ref_2) = (reference(&t, &src, "b"), reference(&t, &src, "h"));
    let (want_1, want_2) = (tree_hashes(&ref_1), tree_hashes(&ref_2));
    let files: Vec<String> = want_2.keys().cloned().collect();

    let reg = Registry::start();
    let out = t.join("out");
    for (tag, from) in [("v1", "b"), ("v2", "h")] {
        let pushed = convert(&oci_ref(&src, from), &reg.reference(&format!("app:{tag}")));
        let kept = convert(&oci_ref(&src, from), &oci_ref(&out, tag));
        assert_eq!(pushed["manifest_digest"], kept["manifest_digest"]);
    }
    let (v1, v2) = (
        blob_chunks(&out, "v1", t.path()),
        blob_chunks(&out, "v2", t.path()),
    );
    let held: BTreeSet<[u8; 32]> = v1.iter().map(|c| c.digest).collect();
    let changed: Vec<&ChunkEntry> = v2.iter().filter(|c| !held.contains(&c.digest)).collect();
    let changed_bytes: u64 = changed
        .iter()
        .map(|c| u64::from(c.compressed_size.get()))
        .sum();
    let all_bytes: u64 = v2.iter().map(|c| u64::from(c.compressed_size.get())).sum();
    let table_bytes = v2.len() as u64 * size_of::<ChunkEntry>() as u64;
    eprintln!(
        "v2: {} chunks, {} changed ({changed_bytes} of {all_bytes} compressed bytes)",
        v2.len(),
        changed.len()
    );
    assert!(
        !changed.is_empty() && changed.len() < v2.len() / 2,
        "the images must share most chunks"
    );

    let opts = |mode: &'static str| {
        [
            "--lazy",
            "--mode",
            mode,
            "--prefetch",
            "none",
            "--fill-ahead",
            "0",
            "--readahead",
            "0",
        ]
    };
    let mut f = Failures::default();
    for mode in ["kernel", "fuse"] {
        let cache = t.join(&format!("cache-{mode}"));
        let m1 = Mount::with_args(
            &reg.reference("app:v1"),
            &t.join(&format!("mnt-v1-{mode}")),
            &cache,
            &opts(mode),
        );
        let got = read_files(&m1.path, &files, t.path(), &format!("{mode}-v1"));
        check_reads(&mut f, &format!("{mode}: v1"), &want_1, &files, &got);
        m1.unmount();

        for (label, cache) in [
            ("updated", cache),
            ("fresh", t.join(&format!("fresh-{mode}"))),
        ] {
            let m2 = Mount::with_args(
                &reg.reference("app:v2"),
                &t.join(&format!("mnt-v2-{mode}-{label}")),
                &cache,
                &opts(mode),
            );
            let got = read_files(&m2.path, &files, t.path(), &format!("{mode}-v2-{label}"));
            check_reads(
                &mut f,
                &format!("{mode}: v2 {label}"),
                &want_2,
                &files,
                &got,
            );
            let status = settled_status(&m2);
            m2.unmount();
            let fetched = status["fetched_bytes"].as_u64().unwrap_or(u64::MAX);
            let located = status["located_chunks"].as_u64().unwrap_or(0);
            eprintln!(
                "{mode}, v2 {label}: fetched {fetched} bytes, {located} chunks copied on the node"
            );
            if label == "fresh" {
                f.check(fetched >= all_bytes && located == 0, || {
                    format!("{mode}: v2 on a fresh cache fetched {fetched} of {all_bytes} bytes, copied {located} chunks")
                });
                continue;
            }
            let bound = changed_bytes * 6 / 5 + table_bytes;
            f.check(fetched >= changed_bytes && fetched <= bound, || {
                format!(
                    "{mode}: the update fetched {fetched} bytes; the changed chunks are {changed_bytes} (bound {bound})"
                )
            });
            let shared = (v2.len() - changed.len()) as u64;
            f.check(located == shared, || {
                format!("{mode}: {located} chunks copied on the node, {shared} shared with v1")
            });
        }
    }
    f.finish("an update");
}

/// Issue 31 point 3, with boot pages: v1 and v2 converted with the boot
/// pages of one recorded start (v1 reading a few files v2 shares). A node
/// that ran v1 (read all of it, and its boot set's whole chunks came after
/// the start) mounts v2: every chunk of the boot set is on the
/// node already, so the worker copies them and does not fetch v2's boot
/// pages (its log says so); v2 reads right and the update fetches at most
/// 1.2x the changed chunks plus v2's chunk table, as without boot pages.
/// On a fresh cache v2 still takes its boot pages.
#[test]
fn an_update_skips_boot_pages_the_node_holds() {
    let Some((_time, t, src)) = begin(
        "an_update_skips_boot_pages_the_node_holds",
        "tenants-update-boot",
    ) else {
        return;
    };
    let (ref_1, ref_2) = (reference(&t, &src, "b"), reference(&t, &src, "h"));
    let (want_1, want_2) = (tree_hashes(&ref_1), tree_hashes(&ref_2));
    let files: Vec<String> = want_2.keys().cloned().collect();
    let shared_files: Vec<String> = files
        .iter()
        .filter(|f| want_1.get(*f) == want_2.get(*f))
        .take(4)
        .cloned()
        .collect();
    assert!(!shared_files.is_empty(), "v1 and v2 share no file");

    let reg = Registry::start();
    convert(&oci_ref(&src, "b"), &reg.reference("app:plain"));
    let trace = t.join("start.trace");
    let rec = Mount::with_args(
        &reg.reference("app:plain"),
        &t.join("mnt-record"),
        &t.join("cache-record"),
        &["--lazy", "--record-trace", trace.to_str().unwrap()],
    );
    read_files(&rec.path, &shared_files, t.path(), "record");
    rec.unmount();
    let out = t.join("out");
    for (tag, from) in [("v1", "b"), ("v2", "h")] {
        let args = ["--prefetch", trace.to_str().unwrap()];
        let src_ref = oci_ref(&src, from);
        for dst in [reg.reference(&format!("app:{tag}")), oci_ref(&out, tag)] {
            lamina(["convert", "--json", args[0], args[1], &src_ref, &dst]).ok();
        }
    }
    let (v1, v2) = (
        blob_chunks(&out, "v1", t.path()),
        blob_chunks(&out, "v2", t.path()),
    );
    let held: BTreeSet<[u8; 32]> = v1.iter().map(|c| c.digest).collect();
    let changed_bytes: u64 = v2
        .iter()
        .filter(|c| !held.contains(&c.digest))
        .map(|c| u64::from(c.compressed_size.get()))
        .sum();
    let bound = changed_bytes * 6 / 5 + v2.len() as u64 * size_of::<ChunkEntry>() as u64;

    let mut f = Failures::default();
    let cache = t.join("cache");
    let m1 = Mount::with_args(
        &reg.reference("app:v1"),
        &t.join("mnt-v1"),
        &cache,
        &["--lazy"],
    );
    let got = read_files(&m1.path, &files, t.path(), "v1");
    check_reads(&mut f, "v1", &want_1, &files, &got);
    // A node that ran v1: its boot set's whole chunks came after the start.
    wait_complete(&m1);
    m1.unmount();
    for (label, cache) in [("updated", cache), ("fresh", t.join("cache-fresh"))] {
        let m2 = Mount::with_args(
            &reg.reference("app:v2"),
            &t.join(&format!("mnt-v2-{label}")),
            &cache,
            &["--lazy", "--fill-ahead", "0", "--readahead", "0"],
        );
        let got = read_files(&m2.path, &files, t.path(), &format!("v2-{label}"));
        check_reads(&mut f, &format!("v2 {label}"), &want_2, &files, &got);
        let status = settled_status(&m2);
        let log = fs::read_to_string(run_dir(&m2).join("worker.log")).unwrap_or_default();
        m2.unmount();
        let fetched = status["fetched_bytes"].as_u64().unwrap_or(u64::MAX);
        let skipped = log.contains("boot pages not fetched");
        eprintln!("v2 {label}: fetched {fetched} bytes (changed chunks {changed_bytes}, bound {bound}), boot pages skipped: {skipped}");
        if label == "fresh" {
            f.check(
                !skipped && status["boot_page_bytes"].as_u64() > Some(0),
                || format!("v2 on a fresh cache took no boot pages:\n{log}"),
            );
            continue;
        }
        f.check(skipped, || {
            format!("v2 after v1 fetched its boot pages though the node held the boot set:\n{log}")
        });
        f.check(fetched <= bound, || {
            format!("the update fetched {fetched} bytes; the changed chunks are {changed_bytes} (bound {bound})")
        });
    }
    f.finish("an update with boot pages");
}

/// Bytes of `file`'s extents that share their blocks with another file's
/// (FIEMAP's `FIEMAP_EXTENT_SHARED`, 0x2000, as `xfs_io fiemap -v` shows
/// it), and of all its extents.
#[track_caller]
fn shared_extent_bytes(file: &Path) -> (u64, u64) {
    let out = run(
        command("xfs_io", ["-r", "-c", "fiemap -v"]).arg(file),
        TIMEOUT,
    )
    .ok();
    let (mut shared, mut all) = (0, 0);
    for line in out.stdout.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        // "N: [a..b]: c..d  TOTAL  FLAGS" (TOTAL in 512-byte units); holes
        // have no flags.
        let [_, _, range, total, flags] = fields[..] else {
            continue;
        };
        let (Ok(total), Some(flags)) = (total.parse::<u64>(), flags.strip_prefix("0x")) else {
            continue;
        };
        if range == "hole" {
            continue;
        }
        let flags = u32::from_str_radix(flags, 16).unwrap();
        all += total * 512;
        if flags & 0x2000 != 0 {
            shared += total * 512;
        }
    }
    (shared, all)
}

/// A chunk the chunk locator finds in a complete cache file is filled with
/// `copy_file_range`: on a filesystem with reflinks (XFS here, loop-mounted)
/// the update's cache file shares its unchanged chunks' blocks with the
/// first image's instead of holding a second copy (it held none shared
/// when the locator's copies were written, and an eager mount copied
/// nothing from the node). v1 mounted eagerly (complete), then v2 on the
/// same cache, lazily with `--prefetch all` and, on a cache of its own,
/// eagerly; v2 reads its bytes.
#[test]
fn located_chunks_share_blocks_on_a_filesystem_with_reflinks() {
    let Some((_time, t, src)) = begin(
        "located_chunks_share_blocks_on_a_filesystem_with_reflinks",
        "tenants-reflink",
    ) else {
        return;
    };
    let image = t.join("xfs.img");
    fs::File::create(&image)
        .unwrap()
        .set_len(320 << 20)
        .unwrap();
    run(
        command("mkfs.xfs", ["-q", "-m", "reflink=1"]).arg(&image),
        TIMEOUT,
    )
    .ok();
    let xfs = t.join("xfs");
    fs::create_dir(&xfs).unwrap();
    run(
        command("mount", ["-o", "loop"]).arg(&image).arg(&xfs),
        TIMEOUT,
    )
    .ok();
    let want = reference(&t, &src, "h");
    let lazy: &[&str] = &["--lazy", "--prefetch", "all", "--mode", "kernel"];
    let eager: &[&str] = &["--eager", "--mode", "kernel"];
    for (how, args) in [("lazy", lazy), ("eager", eager)] {
        let cache = xfs.join(format!("cache-{how}"));
        let mount = |tag: &str, args: &[&str]| {
            let conv = oci_ref(&t.join("conv"), tag);
            convert(&oci_ref(&src, tag), &conv);
            Mount::with_args(&conv, &t.join(&format!("mnt-{how}-{tag}")), &cache, args)
        };
        let v1 = mount("b", eager);
        let v2 = mount("h", args);
        if how == "lazy" {
            wait_complete(&v2);
            let status = settled_status(&v2);
            assert!(
                status["located_chunks"].as_u64() > Some(0),
                "v2 copied no chunk from v1: {status}"
            );
        }
        let [v2_file] = &v2.blob_paths()[..] else {
            panic!("v2 has more than one data blob");
        };
        let (shared, all) = shared_extent_bytes(v2_file);
        eprintln!("{how} v2's cache file: {shared} of {all} bytes in blocks shared with v1's");
        assert!(
            shared * 2 > all,
            "{how}: v2's cache file shares {shared} of its {all} bytes: copies, not shared blocks"
        );
        drop_caches();
        treecmp(&[], &want, &v2.path);
        drop((v1, v2));
    }
}
