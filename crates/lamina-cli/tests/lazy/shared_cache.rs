//! Section 11, many mounts, one cache: each chunk is fetched once, and a
//! dead holder fails no read of another mount, nor reads zeros.

use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use crate::common::*;
use crate::daemon::{
    daemon_logs, finish_with_logs, fully_cached, kill9, mib, num, pid_alive, settled_status, start,
    wait_status, Lazy,
};
use crate::faults::eio_sample;
use crate::holder::{holder_pid, largest_file, worker_pid, OpenFile};
use crate::readers::{check_reads, hash_files, hash_in_background};
use crate::stress::shuffled;
use crate::IMAGE;

// ---------------------------------------------------------------------------
// 11. many mounts, one cache (issue 7, point 4)

/// Compressed bytes of the image's data blobs (`lamina inspect`).
fn compressed_data_bytes(image: &str) -> u64 {
    let doc = lamina(["inspect", "--json", image]).ok().json();
    doc["blobs"]
        .as_array()
        .expect("blobs")
        .iter()
        .map(|b| b["compressed_bytes"].as_u64().expect("compressed_bytes"))
        .sum()
}

/// Two mounts of one image share a cache dir. A mount that prefetches the
/// whole image turns none of its writes into misses of an idle mount (on
/// main every background write was a miss of the other holder, which
/// fetched the chunk again). Then eight readers, four on each mount, read
/// every file at once: right bytes, and every chunk fetched once between
/// the two workers.
#[test]
fn mounts_sharing_a_cache_fetch_each_chunk_once() {
    let Some(Lazy { _time, deb, reg, t }) = start(
        "mounts_sharing_a_cache_fetch_each_chunk_once",
        "lazy-shared",
    ) else {
        return;
    };
    let image = reg.reference(IMAGE);
    let data_bytes = compressed_data_bytes(&image);
    let mut f = Failures::default();

    let cache = t.join("cache");
    let idle = Mount::with_args(&image, &t.join("idle"), &cache, &["--prefetch", "none"]);
    let busy = Mount::with_args(&image, &t.join("busy"), &cache, &["--prefetch", "all"]);
    wait_status(&busy, "whole image prefetched", TIMEOUT, fully_cached);
    let s = settled_status(&idle);
    f.check(
        num(&s, "misses") == 0 && num(&s, "fetched_bytes") == 0,
        || format!("the other mount's background fills reached the idle mount: {s}"),
    );
    busy.unmount();
    idle.unmount();

    let cache = t.join("cache2");
    let a = Mount::with_args(&image, &t.join("a"), &cache, &["--prefetch", "none"]);
    let b = Mount::with_args(&image, &t.join("b"), &cache, &["--prefetch", "none"]);
    let readers: Vec<_> = (0..8u64)
        .map(|i| {
            let root = if i % 2 == 0 { &a.path } else { &b.path };
            let files = shuffled(deb.files.clone(), 0x5eed ^ i);
            hash_in_background(
                root,
                files,
                t.path(),
                &format!("r{i}"),
                Duration::from_secs(600),
            )
        })
        .collect();
    for h in readers {
        match h.join().expect("reader thread") {
            Ok(got) => check_reads(&mut f, "shared-cache reader", deb, &deb.files, &got),
            Err(e) => f.check(false, || e),
        }
    }
    let (sa, sb) = (settled_status(&a), settled_status(&b));
    let fetched = num(&sa, "fetched_bytes") + num(&sb, "fetched_bytes");
    // Merged requests may carry the small gaps between chunks; twice the
    // chunks would be twice the image.
    f.check(fetched <= data_bytes + data_bytes / 20, || {
        format!(
            "the two mounts fetched {} together, the image's data is {}: chunks fetched twice\n{sa}\n{sb}",
            mib(fetched),
            mib(data_bytes)
        )
    });
    f.check(
        num(&sa, "failed_misses") + num(&sb, "failed_misses") == 0,
        || format!("failed misses:\n{sa}\n{sb}"),
    );
    eprintln!(
        "figures: two mounts, one cache: fetched {} + {} of {} image data; misses {} + {}",
        mib(num(&sa, "fetched_bytes")),
        mib(num(&sb, "fetched_bytes")),
        mib(data_bytes),
        num(&sa, "misses"),
        num(&sb, "misses")
    );
    finish_with_logs(
        f,
        &run_dir(&a),
        || daemon_logs(&run_dir(&b)),
        "shared cache",
    );
    a.unmount();
    b.unmount();
}

/// `kill -9` of the holder with a file half read: on main the group closed
/// and the rest of the file read as the cache file's holes (zeros). Now the
/// worker holds a copy of the group: the read gets the image's bytes or EIO,
/// never zeros, and the filesystem can still be unmounted, after which the
/// worker leaves.
/// Issue 28 point 5: two lazy mounts share the image's cache files, and the
/// holder of one (B) is killed with -9. Its worker takes the holder's place
/// (it keeps the fanotify group), so reads through the other mount (A), which
/// the kernel asks B's group about too, and through B itself get the image's
/// bytes. Before, B's worker answered every later event with EIO, and every
/// read of data not yet local failed through either mount.
#[test]
fn a_dead_holder_fails_no_reads_of_another_mount() {
    let Some(Lazy { _time, deb, reg, t }) = start(
        "a_dead_holder_fails_no_reads_of_another_mount",
        "lazy-holder-shared",
    ) else {
        return;
    };
    let cache = t.join("cache");
    let args = ["--prefetch", "none", "--timeout", "20", "--mode", "kernel"];
    let a = Mount::with_args(&reg.reference(IMAGE), &t.join("a"), &cache, &args);
    let b = Mount::with_args(&reg.reference(IMAGE), &t.join("b"), &cache, &args);
    let holder = holder_pid(&b);
    let worker = worker_pid(&b);
    kill9(holder);
    assert!(
        process_exits(holder, Duration::from_secs(10)),
        "holder survived kill -9"
    );
    let sample = eio_sample(deb, 12);
    let (through_a, through_b) = sample.split_at(sample.len() / 2);
    let mut f = Failures::default();
    let deadline = Duration::from_secs(300);
    for (name, m, files) in [("A", &a, through_a), ("B", &b, through_b)] {
        match hash_files(&m.path, files, t.path(), &format!("via-{name}"), deadline) {
            Ok(got) => check_reads(&mut f, &format!("through {name}"), deb, files, &got),
            Err(e) => f.check(false, || e),
        }
    }
    f.check(pid_alive(worker), || "B's worker left".into());
    let log = fs::read_to_string(run_dir(&b).join("worker.log")).unwrap_or_default();
    f.check(log.contains("serving the group here"), || {
        format!("B's worker log:\n{log}")
    });
    run(Command::new("umount").arg(&b.path), TIMEOUT).ok();
    std::mem::forget(b);
    f.check(process_exits(worker, Duration::from_secs(10)), || {
        format!("B's worker {worker} still runs after the unmount")
    });
    a.unmount();
    f.finish("a dead holder");
}

/// A lazy mount whose holder a test kills: nothing fetched ahead, and
/// reads that give up within 20 s.
fn mount_to_kill(reg: &Registry, t: &TestDir) -> Mount {
    Mount::with_args(
        &reg.reference(IMAGE),
        &t.join("mnt"),
        &t.join("cache"),
        &["--prefetch", "none", "--timeout", "20"],
    )
}

#[test]
fn holder_killed_reads_fail_closed_not_zeros() {
    let Some(Lazy { _time, deb, reg, t }) = start(
        "holder_killed_reads_fail_closed_not_zeros",
        "lazy-holder-kill",
    ) else {
        return;
    };
    let m = mount_to_kill(&reg, &t);
    let rd = run_dir(&m);
    let holder = holder_pid(&m);
    let worker = worker_pid(&m);
    let file = largest_file(deb);
    let open = OpenFile::open(&m.path.join(file));
    kill9(holder);
    assert!(
        process_exits(holder, Duration::from_secs(10)),
        "holder survived kill -9"
    );
    let got = open.finish();
    let mut f = Failures::default();
    f.check(got == deb.hashes[file] || got == "errno 5", || {
        format!(
            "after the holder's kill -9, {file} read {got} (reference {}): wrong bytes",
            deb.hashes[file]
        )
    });
    f.check(pid_alive(worker), || {
        "the worker left with the group".into()
    });
    let log = fs::read_to_string(rd.join("worker.log")).unwrap_or_default();
    f.check(log.contains("the holder died"), || {
        format!("worker log:\n{log}")
    });
    run(Command::new("umount").arg(&m.path), TIMEOUT).ok();
    std::mem::forget(m);
    f.check(process_exits(worker, Duration::from_secs(10)), || {
        format!("worker {worker} still runs after the unmount")
    });
    eprintln!(
        "figures: holder kill -9 mid-read: the reader got {}",
        if got == "errno 5" {
            "EIO"
        } else {
            "the image's bytes"
        }
    );
    f.finish("holder kill");
}

/// Issue 42, point 4: a worker that took a killed holder's place answers
/// EIO for a read it cannot tie to one of its cache files as the mount made
/// them. Here every cache file but one was replaced at its path (renamed
/// over) before the holder died: reads of those blobs' files, through the
/// kernel's own open files of the originals, get EIO, never their unfilled
/// ranges as zeros; the blob left alone is still served.
#[test]
fn a_takeover_fails_the_reads_it_cannot_attribute() {
    let Some(Lazy { _time, deb, reg, t }) = start(
        "a_takeover_fails_the_reads_it_cannot_attribute",
        "lazy-takeover-eio",
    ) else {
        return;
    };
    let m = mount_to_kill(&reg, &t);
    let rd = run_dir(&m);
    // One read served first: the worker has said hello and holds the group
    // (a holder killed before that leaves no one to guard it; see the note
    // of this stop).
    let first = largest_file(deb);
    let read = fs::read(m.path.join(first)).map(|b| sha256_hex(&b));
    assert_eq!(read.ok().as_ref(), Some(&deb.hashes[first]), "{first}");
    let blobs = m.blob_paths();
    assert!(
        blobs.len() > 1,
        "the test needs a blob left alone: {blobs:?}"
    );
    for (i, path) in blobs.iter().enumerate().skip(1) {
        let junk = t.join(&format!("junk-{i}"));
        fs::write(&junk, b"not the cache file").unwrap();
        fs::rename(&junk, path).unwrap();
    }
    let holder = holder_pid(&m);
    kill9(holder);
    assert!(
        process_exits(holder, Duration::from_secs(10)),
        "holder survived kill -9"
    );
    let started = std::time::Instant::now();
    let serving = loop {
        let log = fs::read_to_string(rd.join("worker.log")).unwrap_or_default();
        if log.contains("left unanswered failed; serving") || started.elapsed().as_secs() > 30 {
            break log.contains("serving");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let mut f = Failures::default();
    f.check(serving, || {
        "the worker never took the holder's place".into()
    });
    // Files from all over the tree, so from every blob.
    let step = (deb.hashes.len() / 400).max(1);
    let files: Vec<String> = deb.hashes.keys().step_by(step).cloned().collect();
    let got = hash_files(
        &m.path,
        &files,
        t.path(),
        "takeover",
        Duration::from_secs(300),
    );
    let got = got.unwrap_or_else(|e| panic!("{e}"));
    let (mut eio, mut right, mut wrong) = (0, 0, Vec::new());
    for p in &files {
        match (&got[p].sha256, got[p].errno) {
            (Some(h), _) if *h == deb.hashes[p] => right += 1,
            (None, Some(5)) => eio += 1,
            (h, errno) => wrong.push(format!("{p}: {h:?} errno {errno:?}")),
        }
    }
    f.check(wrong.is_empty(), || {
        format!("reads neither right nor EIO: {wrong:?}")
    });
    f.check(eio > 0, || {
        format!("no read failed ({right} right): the test saw nothing")
    });
    eprintln!("figures: after the takeover, {right} files read right, {eio} got EIO");
    run(Command::new("umount").arg(&m.path), TIMEOUT).ok();
    std::mem::forget(m);
    f.finish("takeover");
}

/// The last page of `path` as an mmap shows it: the file's last bytes and
/// what the kernel reads after them (python3's ctypes: Python's own mmap
/// maps no further than the file's end).
fn mmap_last_page(path: &std::path::Path) -> Vec<u8> {
    let script = r#"
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
fd = os.open(sys.argv[1], os.O_RDONLY)
last = (os.fstat(fd).st_size - 1) // 4096 * 4096
addr = libc.mmap(None, 4096, 1, 1, fd, last)  # PROT_READ, MAP_SHARED
if addr in (None, ctypes.c_void_p(-1).value):
    sys.exit("mmap: errno %d" % ctypes.get_errno())
sys.stdout.write(ctypes.string_at(addr, 4096).hex())
"#;
    let mut c = command("python3", ["-c", script]);
    c.arg(path);
    let out = run(&mut c, TIMEOUT).ok();
    hex::decode(out.stdout.trim()).expect("hex from the mmap script")
}

/// Issue 42, point 6, on a real mount: a file's last page read through an
/// mmap shows zeros after the file's end. Another writer (another image's
/// boot page, placed while the file's chunk was a hole) put 0xee bytes in
/// the cache file after the chunk, up to its page's end; the mount that
/// then reads the file fetches the chunk and writes zeros over them. Before
/// (chunks written alone), the mmap showed the 0xee bytes past the end.
#[test]
fn an_mmap_of_a_files_last_page_shows_zeros_past_its_end() {
    let Some(Lazy { _time, deb, reg, t }) = start(
        "an_mmap_of_a_files_last_page_shows_zeros_past_its_end",
        "lazy-tail",
    ) else {
        return;
    };
    let image = reg.reference(IMAGE);
    let doc = lamina(["inspect", "--json", "--chunks", &image])
        .ok()
        .json();
    let blobs = doc["blobs"].as_array().expect("blobs").clone();
    // A file of one chunk (its digest is the file's) that ends mid-page.
    let (path, size, blob, offset) = deb
        .files
        .iter()
        .filter(|p| (8192..200_000).contains(&deb.sizes[*p]) && deb.sizes[*p] % 4096 > 64)
        .find_map(|p| {
            let (blob, chunk) = blobs.iter().find_map(|b| {
                let list = b["chunk_list"].as_array()?;
                let found = list
                    .iter()
                    .find(|c| c["digest"] == deb.hashes[p].as_str())?;
                Some((b["digest"].as_str()?.to_string(), found.clone()))
            })?;
            Some((
                p.clone(),
                deb.sizes[p],
                blob,
                chunk["cache_offset"].as_u64()?,
            ))
        })
        .expect("a one-chunk file ending mid-page");
    let cache = t.join("cache");
    Mount::with_args(&image, &t.join("first"), &cache, &["--prefetch", "none"]).unmount();
    let hex = blob.trim_start_matches("sha256:");
    let file = cache_files_in(&cache, "blobs")
        .into_iter()
        .find(|f| {
            f.file_name()
                .is_some_and(|n| n.to_string_lossy().contains(hex))
        })
        .unwrap_or_else(|| panic!("no cache file of {blob}"));
    let (end, page_end) = (offset + size, (offset + size).div_ceil(4096) * 4096);
    let other = fs::OpenOptions::new().write(true).open(&file).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&other, &vec![0xee; (page_end - end) as usize], end)
        .unwrap();
    drop(other);
    let m = Mount::with_args(&image, &t.join("second"), &cache, &["--prefetch", "none"]);
    let page = mmap_last_page(&m.path.join(&path));
    let tail = (size % 4096) as usize;
    let content = fs::read(deb.rootfs.join(&path)).unwrap();
    assert_eq!(
        &page[..tail],
        &content[content.len() - tail..],
        "{path}: its last bytes"
    );
    let past: Vec<_> = page[tail..].iter().filter(|&&b| b != 0).collect();
    assert!(
        past.is_empty(),
        "{path}: {} bytes past its end are not zeros",
        past.len()
    );
    m.unmount();
}

/// Bytes of `files` in the page cache (`cachestat(2)`: `fincore` maps
/// each file, and mapping a watched cache file fills it whole).
fn resident_bytes(files: &[std::path::PathBuf]) -> u64 {
    files
        .iter()
        .filter_map(|p| std::fs::File::open(p).ok())
        .map(|f| lamina_sys::resident_bytes(&f).expect("cachestat"))
        .sum()
}

/// Issue 43: a lazy mount holds one copy of each page. A reader's page is
/// copied into EROFS's page cache (or the FUSE inode's) as it is read, and
/// the workers drop the cache files' clean pages each second, so what a
/// reader read sits there alone. Two kernel mounts and a FUSE mount share
/// the cache (the others' workers check the first's fills by reading
/// them). The reads are right; on main the cache files then held as much
/// again as the reader read (the cache file's copy of every page). An
/// eager FUSE mount on a cache of its own (no worker) holds one copy too:
/// its daemon drops its blob files' pages each second (before, they held
/// what its reader read).
#[test]
fn a_lazy_mount_holds_one_copy_of_each_page() {
    let Some(Lazy { _time, deb, reg, t }) =
        start("a_lazy_mount_holds_one_copy_of_each_page", "lazy-one-copy")
    else {
        return;
    };
    let image = reg.reference(IMAGE);
    let cache = t.join("cache");
    let lazy = ["--lazy", "--prefetch", "none"];
    let mount = |name: &str, mode: &str| {
        let args = [&lazy[..], &["--mode", mode]].concat();
        Mount::with_args(&image, &t.join(name), &cache, &args)
    };
    let a = mount("a", "kernel");
    let _b = mount("b", "kernel");
    let c = mount("c", "fuse");
    let eager_cache = t.join("cache-eager");
    let d = Mount::with_args(
        &image,
        &t.join("d"),
        &eager_cache,
        &["--eager", "--mode", "fuse"],
    );
    let mut f = Failures::default();
    let files: Vec<String> = deb
        .files
        .iter()
        .filter(|p| deb.sizes[*p] >= 1 << 20)
        .cloned()
        .collect();
    let read: u64 = files.iter().map(|p| deb.sizes[p]).sum();
    assert!(
        read >= 16 << 20,
        "only {read} bytes in files of 1 MiB or more"
    );
    let cache_files = |cache: &Path| -> Vec<_> {
        cache_files_in(cache, "blobs")
            .into_iter()
            .filter(|p| p.extension().is_some_and(|e| e == "cache"))
            .collect()
    };
    // The kernel mount fills the cache files; the FUSE mount then reads
    // them complete, through its daemon.
    for (name, m) in [("kernel", &a), ("fuse", &c), ("eager fuse", &d)] {
        let deadline = Duration::from_secs(300);
        match hash_files(
            &m.path,
            &files,
            t.path(),
            &format!("one-copy-{name}"),
            deadline,
        ) {
            Ok(got) => check_reads(
                &mut f,
                &format!("through the {name} mount"),
                deb,
                &files,
                &got,
            ),
            Err(e) => f.check(false, || e),
        }
        // The workers drop the cache files' clean pages each second.
        let until = std::time::Instant::now() + Duration::from_secs(10);
        let files_now = cache_files(&m.cache);
        assert!(
            !files_now.is_empty(),
            "{name}: no cache files in {}",
            m.cache.display()
        );
        let mut resident = resident_bytes(&files_now);
        while resident > read / 20 && std::time::Instant::now() < until {
            std::thread::sleep(Duration::from_millis(500));
            resident = resident_bytes(&cache_files(&m.cache));
        }
        eprintln!(
            "figures: {name}: read {read} B, {} cache files resident {resident} B",
            files_now.len()
        );
        f.check(resident <= read / 20, || {
            format!(
                "{name}: the cache files hold {resident} B of page cache after {read} B were read"
            )
        });
    }
    f.finish("one copy of each page");
}
