//! Section 2, a warm cache: a second mount fetches nothing; `--prefetch
//! all` waits for the start; reads fetch
//! ahead, a first miss in a module fetches its directory's modules, a
//! second miss in a window of a large binary fetches the window, and a
//! start that waited long on misses in a blob gets the rest of it.

use std::time::{Duration, Instant};

use crate::common::*;
use crate::daemon::{
    daemon_logs, finish_with_logs, fully_cached, mib, num, settled_status, start, wait_status, Lazy,
};
use crate::fixture::Debian;
use crate::readers::{check_reads, chroot_python, hash_files};
use crate::IMAGE;

// ---------------------------------------------------------------------------
// 2. a warm cache

/// Once a cache dir holds the whole image, a new mount of it fetches
/// nothing: the registry is even stopped before reading every file.
#[test]
fn second_mount_of_cached_image_fetches_nothing() {
    let Some(Lazy { _time, deb, reg, t }) =
        start("second_mount_of_cached_image_fetches_nothing", "lazy-warm")
    else {
        return;
    };
    let (mnt, cache) = (t.join("mnt"), t.join("cache"));

    let m = Mount::with_args(&reg.reference(IMAGE), &mnt, &cache, &["--prefetch-all"]);
    let started = Instant::now();
    let s = wait_status(
        &m,
        "--prefetch-all fetched everything",
        Duration::from_secs(240),
        fully_cached,
    );
    eprintln!(
        "figures: --prefetch-all: {} fetched in {:.1} s, {} requests",
        mib(num(&s, "fetched_bytes")),
        started.elapsed().as_secs_f64(),
        num(&s, "requests")
    );
    m.unmount();

    let m = Mount::new(&reg.reference(IMAGE), &mnt, &cache);
    // From here on there is nothing to fetch from: any attempt would show.
    reg.stop();
    let got = hash_files(&m.path, &deb.files, t.path(), "warm", TIMEOUT)
        .unwrap_or_else(|e| panic!("{e}\n{}", daemon_logs(&run_dir(&m))));
    let mut f = Failures::default();
    check_reads(&mut f, "warm mount", deb, &deb.files, &got);
    let s = settled_status(&m);
    for key in ["fetched_bytes", "requests", "failed_misses"] {
        f.check(num(&s, key) == 0, || {
            format!("{key} should stay 0 on a fully cached image: {s}")
        });
    }
    f.check(fully_cached(&s), || format!("not fully cached: {s}"));
    eprintln!(
        "figures: warm mount read {} files, status {}",
        got.len(),
        serde_json::json!({"fetched_bytes": s["fetched_bytes"], "requests": s["requests"], "misses": s["misses"]})
    );
    f.finish("warm mount");
    m.unmount();
}

/// `--prefetch all` waits for the start: nothing of the image goes on the
/// wire before the mount's first read, and the rest comes in the background
/// once reads stop for a while, every byte right. Begun at mount, as before,
/// the background fetch took the link from the start's misses: the heavy
/// starts took 1.4-2.5x as long (docs/coldstart-heavy.md), and here the
/// image was on the wire before anything read it.
#[test]
fn prefetch_all_waits_for_the_start() {
    let Some(Lazy { _time, deb, reg, t }) =
        start("prefetch_all_waits_for_the_start", "lazy-warm-all")
    else {
        return;
    };
    let args = ["--prefetch", "all"];
    let m = Mount::with_args(
        &reg.reference(IMAGE),
        &t.join("mnt"),
        &t.join("cache"),
        &args,
    );
    let mut f = Failures::default();
    // Nothing reads yet (the container is still being set up): well under
    // the 10 s after which an unread mount counts as started.
    std::thread::sleep(Duration::from_secs(2));
    let idle = settled_status(&m);
    f.check(num(&idle, "prefetch_total") > 0, || {
        format!("nothing to prefetch (the test tests nothing): {idle}")
    });
    f.check(
        num(&idle, "prefetch_done") == 0 && num(&idle, "fetched_bytes") == 0,
        || format!("the image went on the wire before the start read anything: {idle}"),
    );
    // The start: a few files read, then nothing.
    let first = &deb.files[..deb.files.len().min(8)];
    let got = hash_files(&m.path, first, t.path(), "start", TIMEOUT)
        .unwrap_or_else(|e| panic!("{e}\n{}", daemon_logs(&run_dir(&m))));
    check_reads(&mut f, "the start's reads", deb, first, &got);
    let s = wait_status(
        &m,
        "--prefetch all fetched everything after the start",
        Duration::from_secs(240),
        fully_cached,
    );
    f.check(num(&s, "failed_misses") == 0, || {
        format!("failed misses: {s}")
    });
    let got = hash_files(&m.path, &deb.files, t.path(), "after", TIMEOUT)
        .unwrap_or_else(|e| panic!("{e}\n{}", daemon_logs(&run_dir(&m))));
    check_reads(&mut f, "the tree after the prefetch", deb, &deb.files, &got);
    eprintln!(
        "figures: --prefetch all after the start: {} fetched, {} requests",
        mib(num(&s, "fetched_bytes")),
        num(&s, "requests")
    );
    finish_with_logs(f, &run_dir(&m), String::new, "--prefetch all");
    m.unmount();
}

/// A reader of the whole tree in path order (the order the converter laid
/// the data out in, and the order `find`, `tar` or a scanner read it) gets
/// the data fetched ahead in a few large requests instead of one request
/// per file, and still every byte right; a python3 start (scattered reads)
/// fetches nothing ahead.
#[test]
fn reading_in_order_fetches_ahead_in_few_requests() {
    let Some(Lazy { _time, deb, reg, t }) = start(
        "reading_in_order_fetches_ahead_in_few_requests",
        "lazy-ahead",
    ) else {
        return;
    };
    let m = Mount::with_args(
        &reg.reference(IMAGE),
        &t.join("mnt"),
        &t.join("cache"),
        &["--prefetch", "none"],
    );
    let mut f = Failures::default();
    chroot_python(&m.path);
    let s = settled_status(&m);
    f.check(num(&s, "ahead_requests") == 0, || {
        format!("a python3 start (scattered reads) fetched ahead: {s}")
    });

    let started = Instant::now();
    let got = hash_files(&m.path, &deb.files, t.path(), "in-order", TIMEOUT)
        .unwrap_or_else(|e| panic!("{e}\n{}", daemon_logs(&run_dir(&m))));
    let secs = started.elapsed().as_secs_f64();
    check_reads(&mut f, "the tree read in path order", deb, &deb.files, &got);
    let s = settled_status(&m);
    let chunks: u64 = deb.model.iter().map(|b| b.chunks).sum();
    // One request per miss would be about one per chunk (7,000 here).
    f.check(num(&s, "requests") * 10 < chunks, || {
        format!(
            "{} requests for {chunks} chunks: not fetched ahead: {s}",
            num(&s, "requests")
        )
    });
    f.check(num(&s, "fetched_bytes") <= deb.compressed_bytes(), || {
        format!(
            "fetched more than the image's {} compressed bytes: {s}",
            deb.compressed_bytes()
        )
    });
    f.check(
        num(&s, "ahead_fetched_bytes") * 2 > num(&s, "fetched_bytes"),
        || format!("less than half the bytes were fetched ahead: {s}"),
    );
    // Issue 29: what was fetched ahead is accounted, and a whole-tree read
    // reads nearly all of it (every file is read; only the last windows
    // may run past what the reader still wanted).
    let (ahead, used) = (num(&s, "ahead_chunk_bytes"), num(&s, "ahead_used_bytes"));
    f.check(ahead > 0 && used <= ahead && used * 10 >= ahead * 9, || {
        format!("fetched ahead {ahead} chunk bytes, {used} of them read since: {s}")
    });
    f.check(num(&s, "failed_misses") == 0, || {
        format!("failed misses: {s}")
    });
    eprintln!(
        "figures: in-order read of {} files in {secs:.1} s: {} fetched in {} requests ({} ahead, {}), {} misses",
        deb.files.len(),
        mib(num(&s, "fetched_bytes")),
        num(&s, "requests"),
        num(&s, "ahead_requests"),
        mib(num(&s, "ahead_fetched_bytes")),
        num(&s, "misses")
    );
    finish_with_logs(f, &run_dir(&m), String::new, "fill-ahead");
    m.unmount();
}

/// Issue 29: a first miss in a module fetches its directory's other
/// modules (`lamina_daemon::predict`), so an import of the package after it
/// waits on no more round trips; `--predict-max 0` turns that off, and then
/// each module is a miss of its own. Reads give the reference bytes. (On
/// loopback misses come far faster than the rate predictions wait for.)
#[test]
fn a_first_miss_in_a_module_fetches_its_directorys_modules() {
    predicted_module_reads(
        "a_first_miss_in_a_module_fetches_its_directorys_modules",
        "kernel",
    );
}

/// The same through FUSE.
#[test]
fn fuse_a_first_miss_in_a_module_fetches_its_directorys_modules() {
    predicted_module_reads(
        "fuse_a_first_miss_in_a_module_fetches_its_directorys_modules",
        "fuse",
    );
}

/// Issue 44: a group is fetched ahead only once the start has missed four
/// times its bytes (`lamina_daemon::predict::worth_fetching`). On a fresh
/// mount, after a few small misses (enough to time the link), a first miss
/// in the standard library's top-level modules (a group of up to 4 MiB)
/// fetches nothing ahead: the next modules of the group miss. Before, the
/// whole group came on that first miss (python3's start fetched 1.59x its
/// bytes).
#[test]
fn a_group_larger_than_the_start_has_missed_waits() {
    let Some(Lazy { _time, deb, reg, t }) = start(
        "a_group_larger_than_the_start_has_missed_waits",
        "lazy-predict-cost",
    ) else {
        return;
    };
    let dir = "usr/lib/python3.11/";
    let top_level = |p: &&String| p.starts_with(dir) && !p[dir.len()..].contains('/');
    // Small files spread over the image, outside the group's directory:
    // each a miss of its own chunk, timed for the rate predictions wait for.
    let spread = small_files_spread(deb, 16, |p| !top_level(&p));
    let modules: Vec<String> = deb
        .files
        .iter()
        .filter(|p| top_level(p) && p.ends_with(".py"))
        .cloned()
        .collect();
    // The group's first modules: well within its first 4 MiB.
    let mut group = Vec::new();
    let mut bytes = 0;
    for m in &modules {
        if bytes > 1 << 20 {
            break;
        }
        bytes += deb.sizes[m];
        group.push(m.clone());
    }
    let (first, rest) = group
        .split_first()
        .expect("python3.11's modules in the image");
    let m = predicting_mount(&reg, &t, "8M");
    let mut f = Failures::default();
    for (label, files) in [
        ("small", &spread[..]),
        ("first", std::slice::from_ref(first)),
    ] {
        let got = hash_files(&m.path, files, t.path(), label, TIMEOUT)
            .unwrap_or_else(|e| panic!("{e}\n{}", daemon_logs(&run_dir(&m))));
        check_reads(&mut f, label, deb, files, &got);
    }
    let before = settled_status(&m);
    let got = hash_files(&m.path, rest, t.path(), "rest", TIMEOUT)
        .unwrap_or_else(|e| panic!("{e}\n{}", daemon_logs(&run_dir(&m))));
    check_reads(&mut f, "rest", deb, rest, &got);
    let after = settled_status(&m);
    let new = num(&after, "miss_requests") - num(&before, "miss_requests");
    eprintln!(
        "figures: {} small files ({} misses, {} bytes missed), then {} of {dir}: {} modules after \
         the first took {new} miss requests; predictions {}",
        spread.len(),
        num(&before, "misses"),
        num(&before, "miss_fetched_bytes"),
        first,
        rest.len(),
        num(&after, "predictions"),
    );
    f.check(new > 0, || {
        format!("the group was fetched ahead on its first miss: {after}")
    });
    finish_with_logs(f, &run_dir(&m), String::new, "predict-cost");
    m.unmount();
}

/// Issue 44: a mapped file over `--predict-max` is predicted in windows of
/// 1 MiB (`lamina_daemon::predict::WINDOW`), each fetched ahead once a
/// second chunk of it is missed. With `--predict-max 1M`, python3.11 (6.8
/// MB) is such a file: after misses elsewhere (small files and libraries:
/// the link timed, bytes missed), a read in the first chunk of its second
/// window predicts nothing, one in its second chunk fetches the window,
/// and reads of its last two chunks then take no miss request. Every
/// block read is checked against the reference tree.
#[test]
fn a_second_miss_in_a_window_of_a_large_binary_fetches_the_window() {
    let Some(Lazy { _time, deb, reg, t }) = start(
        "a_second_miss_in_a_window_of_a_large_binary_fetches_the_window",
        "lazy-predict-window",
    ) else {
        return;
    };
    const KIB: u64 = 1 << 10;
    let binary = "usr/bin/python3.11";
    assert!(
        deb.sizes[binary] > 2048 * KIB,
        "{binary}: {}",
        deb.sizes[binary]
    );
    let spread = small_files_spread(deb, 8, |p| !p.starts_with("usr/bin/"));
    // Then libraries: each of their misses brings more compressed bytes
    // than a small file's packed chunk, so the miss rate clears the bound that
    // predictions wait for (`MIN_RATE`, 4 MB/s: the small files alone gave
    // 3.5-5.8 MB/s on loopback, the registry's time per request most of
    // it) and the bytes missed pass four times the window's.
    let libraries = files_spread(deb, 24, 256 << 10..=1 << 20, |p| {
        p.starts_with("usr/lib/") && !p.contains("python3")
    });
    assert_eq!(libraries.len(), 24, "libraries of 256 KiB to 1 MiB");
    let m = predicting_mount(&reg, &t, "1M");
    let mut f = Failures::default();
    for (what, files) in [("small", &spread), ("libraries", &libraries)] {
        let got = hash_files(&m.path, files, t.path(), what, TIMEOUT)
            .unwrap_or_else(|e| panic!("{e}\n{}", daemon_logs(&run_dir(&m))));
        check_reads(&mut f, what, deb, files, &got);
    }
    // One 4 KiB block at `offset` of the binary, through the mount and in
    // the reference tree; then the status once the worker settled.
    let block = t.join("block");
    let mut read_at = |offset: u64| {
        let mut c = command(
            "dd",
            [
                format!("if={}", m.path.join(binary).display()),
                format!("of={}", block.display()),
                "bs=4096".into(),
                format!("skip={}", offset / 4096),
                "count=1".into(),
                "status=none".into(),
            ],
        );
        let out = try_run(&mut c, TIMEOUT).unwrap_or_else(|e| panic!("{e}"));
        let reference = std::fs::read(deb.rootfs.join(binary)).unwrap();
        let want = &reference[offset as usize..offset as usize + 4096];
        let got = std::fs::read(&block).unwrap_or_default();
        f.check(out.status.success() && got == want, || {
            format!(
                "{binary} at {offset}: wrong bytes or failed read: {}",
                out.describe()
            )
        });
        settled_status(&m)
    };
    let window = 1024 * KIB;
    let before = read_at(0);
    let first = read_at(window);
    let second = read_at(window + 256 * KIB);
    let rest = [read_at(window + 512 * KIB), read_at(window + 768 * KIB)];
    let predictions = |s: &serde_json::Value| num(s, "predictions");
    let miss_requests = |s: &serde_json::Value| num(s, "miss_requests");
    eprintln!(
        "figures: {} small files and {} libraries ({} bytes missed, misses answered at {} B/s); \
         predictions {} -> {} (first chunk) -> {} (second); miss requests {} -> {} -> {} -> {} -> {}",
        spread.len(),
        libraries.len(),
        num(&before, "miss_fetched_bytes"),
        num(&before, "miss_rate_bps"),
        predictions(&before),
        predictions(&first),
        predictions(&second),
        miss_requests(&before),
        miss_requests(&first),
        miss_requests(&second),
        miss_requests(&rest[0]),
        miss_requests(&rest[1]),
    );
    f.check(predictions(&first) == predictions(&before), || {
        format!("a first miss in the window predicted something: {first}")
    });
    f.check(predictions(&second) == predictions(&first) + 1, || {
        format!("a second miss in the window did not fetch it: {second}")
    });
    f.check(miss_requests(&rest[1]) == miss_requests(&second), || {
        format!(
            "the window's last chunks missed after it was fetched: {}",
            rest[1]
        )
    });
    // The rate predictions wait for, as status shows it.
    f.check(num(&second, "miss_rate_bps") > 0, || {
        format!("no miss rate in status: {second}")
    });
    f.check(num(&rest[1], "failed_misses") == 0, || {
        format!("failed misses: {}", rest[1])
    });
    finish_with_logs(f, &run_dir(&m), String::new, "predict-window");
    m.unmount();
}

/// `n` small files (1 byte to 16 KiB) spread over the image, of those
/// `keep` keeps: each a miss of its own chunk on a fresh mount, timed for
/// the rate predictions wait for.
fn small_files_spread(deb: &Debian, n: usize, keep: impl Fn(&String) -> bool) -> Vec<String> {
    files_spread(deb, n, 1..=16 << 10, keep)
}

/// `n` files of `sizes` bytes spread over the image, of those `keep` takes.
fn files_spread(
    deb: &Debian,
    n: usize,
    sizes: std::ops::RangeInclusive<u64>,
    keep: impl Fn(&String) -> bool,
) -> Vec<String> {
    let files: Vec<&String> = deb
        .files
        .iter()
        .filter(|p| keep(p) && sizes.contains(&deb.sizes[*p]))
        .collect();
    let step = (files.len() / n).max(1);
    files.into_iter().step_by(step).take(n).cloned().collect()
}

/// A kernel-path lazy mount of the image that prefetches nothing and
/// predicts with `--predict-max predict_max`.
fn predicting_mount(reg: &Registry, t: &TestDir, predict_max: &str) -> Mount {
    Mount::with_args(
        &reg.reference(IMAGE),
        &t.join("mnt"),
        &t.join("cache"),
        &[
            "--mode",
            "kernel",
            "--prefetch",
            "none",
            "--predict-max",
            predict_max,
        ],
    )
}

fn predicted_module_reads(test: &'static str, mode: &str) {
    let Some(Lazy { _time, deb, reg, t }) = start(test, &format!("lazy-predict-{mode}")) else {
        return;
    };
    let dir = "usr/lib/python3.11/asyncio/";
    let modules: Vec<String> = deb
        .files
        .iter()
        .filter(|p| p.starts_with(dir) && !p[dir.len()..].contains('/') && p.ends_with(".py"))
        .cloned()
        .collect();
    let (first, rest) = modules
        .split_first()
        .expect("asyncio's modules in the image");
    let mut f = Failures::default();
    let mut misses_after_first = Vec::new();
    for (predict, label) in [("8M", "predicted"), ("0", "not-predicted")] {
        let m = Mount::with_args(
            &reg.reference(IMAGE),
            &t.join(&format!("mnt-{label}")),
            &t.join(&format!("cache-{label}")),
            &[
                "--mode",
                mode,
                "--prefetch",
                "none",
                "--predict-max",
                predict,
            ],
        );
        // A python3 start first: predictions wait until misses were timed
        // (`lamina_daemon::predict::RateMeter`).
        chroot_python(&m.path);
        let one = hash_files(
            &m.path,
            std::slice::from_ref(first),
            t.path(),
            label,
            TIMEOUT,
        )
        .unwrap_or_else(|e| panic!("{e}\n{}", daemon_logs(&run_dir(&m))));
        check_reads(&mut f, label, deb, std::slice::from_ref(first), &one);
        // What was predicted counts once landed (a reader meeting it in
        // flight waits for it, and sends no request of its own either).
        wait_status(&m, "predicted chunks landed", TIMEOUT, |s| {
            s["predictions"].as_u64() == Some(0) || s["ahead_chunk_bytes"].as_u64() > Some(0)
        });
        let before = settled_status(&m);
        let label_rest = format!("{label}-rest");
        let got = hash_files(&m.path, rest, t.path(), &label_rest, TIMEOUT)
            .unwrap_or_else(|e| panic!("{e}\n{}", daemon_logs(&run_dir(&m))));
        check_reads(&mut f, &label_rest, deb, rest, &got);
        let after = settled_status(&m);
        let new = num(&after, "miss_requests") - num(&before, "miss_requests");
        eprintln!(
            "figures: {mode}, {label}: {} modules of {dir} after the first: {new} miss requests; \
             predictions {}, {} predicted requests, {} ahead / {} read",
            rest.len(),
            num(&after, "predictions"),
            num(&after, "predicted_requests"),
            num(&after, "ahead_chunk_bytes"),
            num(&after, "ahead_used_bytes"),
        );
        if predict == "0" {
            f.check(num(&after, "predictions") == 0, || {
                format!("--predict-max 0 predicted: {after}")
            });
        } else {
            f.check(num(&after, "predictions") >= 1, || {
                format!("the first miss in {first} predicted nothing: {after}")
            });
            f.check(num(&after, "ahead_used_bytes") > 0, || {
                format!("nothing predicted was read: {after}")
            });
        }
        misses_after_first.push(new);
        finish_with_logs(std::mem::take(&mut f), &run_dir(&m), String::new, label);
        m.unmount();
    }
    // Without predictions the package's modules span more than the first
    // one's chunk (else this test could not fail); with them, none missed.
    assert!(
        misses_after_first[1] > 0,
        "{dir} lies in one chunk: the test shows nothing"
    );
    assert_eq!(
        misses_after_first[0], 0,
        "modules predicted on the first miss were fetched again"
    );
}

/// With `--fetch-rests`, a start without a boot set that reads small files
/// all over the image (3,000 of them, each a miss) on a fast link waits on
/// misses in a blob as long as its rest takes at the link's rate, and the
/// worker fetches the rest in large ranges beside the misses
/// (`lamina_daemon::worker::rest`),
/// the whole tree then reads back right, and no chunk went on the wire
/// twice (all fetched, the misses' and the rests', within the image's
/// compressed bytes: a blob streamed whole instead fetched more than the
/// image, and so did rests that fetched chunks no file uses). With
/// `--predict-max 0` (only what is read), or without the flag, no rest is
/// fetched.
#[test]
fn a_start_waiting_long_on_a_blob_gets_the_rest_of_it() {
    let Some(Lazy { _time, deb, reg, t }) = start(
        "a_start_waiting_long_on_a_blob_gets_the_rest_of_it",
        "lazy-rest",
    ) else {
        return;
    };
    let spread = small_files_spread(deb, 3000, |_| true);
    // Rests with the flag and predictions on; none without either.
    for (k, predict_max, rests_on) in [(0, "8M", true), (1, "0", true), (2, "8M", false)] {
        let mut f = Failures::default();
        let mut args = vec!["--mode", "kernel", "--prefetch", "none"];
        args.extend(["--predict-max", predict_max]);
        args.extend(rests_on.then_some("--fetch-rests"));
        let m = Mount::with_args(
            &reg.reference(IMAGE),
            &t.join(&format!("mnt-{k}")),
            &t.join(&format!("cache-{k}")),
            &args,
        );
        let got = hash_files(&m.path, &spread, t.path(), "spread", TIMEOUT)
            .unwrap_or_else(|e| panic!("{e}\n{}", daemon_logs(&run_dir(&m))));
        check_reads(&mut f, "the start's reads", deb, &spread, &got);
        let s = settled_status(&m);
        let rests = num(&s, "rests");
        let wanted = predict_max == "8M" && rests_on;
        f.check(wanted == (rests > 0), || {
            format!("{args:?}: {rests} rests fetched: {s}")
        });
        if wanted {
            let s = wait_status(&m, "the rests fetched", Duration::from_secs(120), |s| {
                num(s, "rests_running") == 0
            });
            f.check(num(&s, "rest_fetched_bytes") > 0, || {
                format!("rests fetched nothing: {s}")
            });
            let got = hash_files(&m.path, &deb.files, t.path(), "after", TIMEOUT)
                .unwrap_or_else(|e| panic!("{e}\n{}", daemon_logs(&run_dir(&m))));
            check_reads(
                &mut f,
                "the whole tree after the rests",
                deb,
                &deb.files,
                &got,
            );
            let s = settled_status(&m);
            f.check(num(&s, "failed_misses") == 0, || {
                format!("failed misses: {s}")
            });
            f.check(num(&s, "fetched_bytes") <= deb.compressed_bytes(), || {
                format!(
                    "the whole tree fetched {} bytes, more than the image's {}: {s}",
                    num(&s, "fetched_bytes"),
                    deb.compressed_bytes()
                )
            });
            eprintln!(
                "figures: {} files read, {rests} rests; {} of misses, {} of rests, {} in all \
                 of {} (link {} MB/s)",
                spread.len(),
                mib(num(&s, "miss_fetched_bytes")),
                mib(num(&s, "rest_fetched_bytes")),
                mib(num(&s, "fetched_bytes")),
                mib(deb.compressed_bytes()),
                num(&s, "link_rate_bps") / 1_000_000
            );
        }
        finish_with_logs(f, &run_dir(&m), String::new, "rest of a blob");
        m.unmount();
    }
}

/// The same start through a proxy that sends blob answers of 128 KiB or
/// more at 2 MB/s after the first 10 (the link measured fast, then taken by
/// other traffic): a rest window comes slower than 12 MB/s, the worker says
/// so, and no rest fetches anything after that; every read is right, the
/// misses fetching their own chunks.
#[test]
fn a_slow_rest_of_a_blob_is_stopped_and_misses_go_on() {
    let Some(Lazy { _time, deb, reg, t }) = start(
        "a_slow_rest_of_a_blob_is_stopped_and_misses_go_on",
        "lazy-rest-slow",
    ) else {
        return;
    };
    let proxy = FaultProxy::start(
        t.path(),
        "proxy",
        0,
        reg.port,
        "none",
        &[
            "--large-rate",
            "2000000",
            "--large-at",
            "131072",
            "--large-after",
            "10",
        ],
    );
    let mut f = Failures::default();
    let stopped = "no more rests are fetched";
    let (m, s) = spread_start_with_rests((deb, &t), &proxy, &mut f, stopped);
    // Nothing fetched as a rest once they stopped.
    std::thread::sleep(Duration::from_secs(2));
    let later = settled_status(&m);
    f.check(
        num(&later, "rest_fetched_bytes") == num(&s, "rest_fetched_bytes"),
        || format!("rests went on after the stop: {s}, then {later}"),
    );
    let proxied = proxy.stats();
    f.check(proxied["slow_answers"].as_u64() > Some(0), || {
        format!("the proxy sent no large answer slowly: {proxied}")
    });
    f.check(num(&later, "failed_misses") == 0, || {
        format!("failed misses: {later}")
    });
    eprintln!(
        "figures: {} rests, {} fetched by them before they stopped; {} slow answers",
        num(&s, "rests"),
        mib(num(&s, "rest_fetched_bytes")),
        proxied["slow_answers"]
    );
    finish_with_logs(f, &run_dir(&m), || proxy.bg.describe(), "slow rest");
    m.unmount();
}

/// The same start through a proxy that answers every range read of 1 MiB
/// or more with a 500 (misses ask for a chunk or two; a rest's requests
/// for up to 2 MiB): the rest fails, the worker says so and gives its
/// chunks back, and the misses fetch them: the whole tree reads right
/// afterwards, no miss failed.
#[test]
fn a_failing_rest_of_a_blob_gives_its_chunks_back_to_the_misses() {
    let Some(Lazy { _time, deb, reg, t }) = start(
        "a_failing_rest_of_a_blob_gives_its_chunks_back_to_the_misses",
        "lazy-rest-fail",
    ) else {
        return;
    };
    let large = (1u32 << 20).to_string();
    let proxy = FaultProxy::start(
        t.path(),
        "proxy",
        0,
        reg.port,
        "500",
        &["--min-range", &large],
    );
    let mut f = Failures::default();
    let failed = "the rest of the blob stopped";
    let (m, s) = spread_start_with_rests((deb, &t), &proxy, &mut f, failed);
    let proxied = proxy.stats();
    f.check(proxied["faults"]["500"].as_u64() > Some(0), || {
        format!("the proxy failed no large range read: {proxied}")
    });
    // What the failed rests had claimed is the misses' again.
    let got = hash_files(&m.path, &deb.files, t.path(), "after", TIMEOUT)
        .unwrap_or_else(|e| panic!("{e}\n{}", daemon_logs(&run_dir(&m))));
    check_reads(
        &mut f,
        "the whole tree after the rests failed",
        deb,
        &deb.files,
        &got,
    );
    let later = settled_status(&m);
    f.check(num(&later, "failed_misses") == 0, || {
        format!("failed misses: {later}")
    });
    eprintln!(
        "figures: {} rests, {} fetched by them; {} large range reads failed by the proxy",
        num(&s, "rests"),
        mib(num(&s, "rest_fetched_bytes")),
        proxied["faults"]["500"]
    );
    finish_with_logs(f, &run_dir(&m), || proxy.bg.describe(), "failing rest");
    m.unmount();
}

/// A start of 3,000 small files spread over the image through `proxy`,
/// with `--fetch-rests`: every read right, then, once no rest runs, at
/// least one rest fetched and the worker's log saying `log_says`. The
/// mount, and its status then.
fn spread_start_with_rests(
    (deb, t): (&Debian, &TestDir),
    proxy: &FaultProxy,
    f: &mut Failures,
    log_says: &str,
) -> (Mount, serde_json::Value) {
    let image = format!("docker://127.0.0.1:{}/{IMAGE}", proxy.port);
    let args = ["--mode", "kernel", "--prefetch", "none", "--fetch-rests"];
    let m = Mount::with_args(&image, &t.join("mnt"), &t.join("cache"), &args);
    let spread = small_files_spread(deb, 3000, |_| true);
    let got = hash_files(&m.path, &spread, t.path(), "spread", TIMEOUT)
        .unwrap_or_else(|e| panic!("{e}\n{}", daemon_logs(&run_dir(&m))));
    check_reads(f, "the start's reads", deb, &spread, &got);
    let s = wait_status(&m, "no rest running", Duration::from_secs(120), |s| {
        num(s, "rests_running") == 0
    });
    f.check(num(&s, "rests") >= 1, || format!("no rest fetched: {s}"));
    f.check(daemon_logs(&run_dir(&m)).contains(log_says), || {
        format!("the worker's log does not say {log_says:?}: {s}")
    });
    (m, s)
}
