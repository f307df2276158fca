//! Sections 3 to 5: concurrent readers, and full reads that lose nothing
//! while the worker is killed or the registry goes away and comes back.

use std::fs;
use std::net::TcpStream;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::common::*;
use crate::daemon::{
    daemon_logs, finish_with_logs, kill9, mib, num, pid_alive, relay_log, settled_status, start,
    status_file, Lazy,
};
use crate::readers::{check_reads, hash_in_background};
use crate::IMAGE;

// ---------------------------------------------------------------------------
// 3. concurrency

/// A small deterministic shuffle (xorshift).
pub(crate) fn shuffled(mut v: Vec<String>, mut seed: u64) -> Vec<String> {
    for i in (1..v.len()).rev() {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        v.swap(i, (seed % (i as u64 + 1)) as usize);
    }
    v
}

/// Eight readers at once on a fresh lazy mount, on disjoint and overlapping
/// file sets: every file hashes to the reference.
#[test]
fn concurrent_readers_get_reference_bytes() {
    let Some(Lazy { _time, deb, reg, t }) =
        start("concurrent_readers_get_reference_bytes", "lazy-concurrent")
    else {
        return;
    };
    let m = Mount::new(&reg.reference(IMAGE), &t.join("mnt"), &t.join("cache"));

    let files = &deb.files;
    let mut sets: Vec<(String, Vec<String>)> = (0..4)
        .map(|i| {
            (
                format!("quarter{i}"),
                files.iter().skip(i).step_by(4).cloned().collect(),
            )
        })
        .collect();
    sets.push(("usr-lib".into(), deb.files_under("usr/lib/")));
    sets.push(("reversed".into(), files.iter().rev().cloned().collect()));
    sets.push((
        "usr-shuffled".into(),
        shuffled(deb.files_under("usr/"), 0x9e37_79b9_7f4a_7c15),
    ));
    let mut by_size = files.clone();
    by_size.sort_by_key(|f| std::cmp::Reverse(deb.sizes[f]));
    by_size.truncate(300);
    sets.push(("largest-300".into(), by_size));

    let started = Instant::now();
    let readers: Vec<_> = sets
        .iter()
        .map(|(label, set)| {
            hash_in_background(
                &m.path,
                set.clone(),
                t.path(),
                label,
                Duration::from_secs(300),
            )
        })
        .collect();
    let mut f = Failures::default();
    for ((label, set), h) in sets.iter().zip(readers) {
        match h.join().expect("reader thread") {
            Ok(got) => check_reads(&mut f, label, deb, set, &got),
            Err(e) => f.check(false, || e),
        }
    }
    let secs = started.elapsed().as_secs_f64();
    let s = settled_status(&m);
    f.check(num(&s, "failed_misses") == 0, || {
        format!("failed misses: {s}")
    });
    f.check(num(&s, "bad_chunks") == 0, || format!("bad chunks: {s}"));
    eprintln!(
        "figures: 8 concurrent readers ({} file reads) in {secs:.1} s; fetched {} in {} requests, {} misses",
        sets.iter().map(|s| s.1.len()).sum::<usize>(),
        mib(num(&s, "fetched_bytes")),
        num(&s, "requests"),
        num(&s, "misses")
    );
    finish_with_logs(f, &run_dir(&m), String::new, "concurrent readers");
    m.unmount();
}

// ---------------------------------------------------------------------------
// 4. the worker dies

/// Waits for a worker that is not one of `killed`, alive, and has fetched
/// something (so it is mid-work); returns its pid.
#[track_caller]
fn busy_worker(rd: &Path, killed: &[u32], timeout: Duration) -> u32 {
    let start = Instant::now();
    loop {
        if let Some(s) = status_file(rd) {
            if let Some(pid) = s["pid"].as_u64().map(|p| p as u32) {
                if !killed.contains(&pid) && pid_alive(pid) && num(&s, "fetched_bytes") > 0 {
                    return pid;
                }
            }
        }
        assert!(
            start.elapsed() < timeout,
            "no busy worker other than {killed:?} within {} s; status {:?}\n{}",
            timeout.as_secs(),
            status_file(rd),
            daemon_logs(rd)
        );
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// Soak (issue 7): kill -9 of the worker, twenty times while the whole
/// image is being read: the holder starts a new one each time (backing off
/// when they die young), readers wait and get the right bytes, and every
/// read completes.
#[test]
fn worker_killed_twenty_times_during_a_full_read_loses_nothing() {
    worker_kills_during_a_full_read(
        "worker_killed_twenty_times_during_a_full_read_loses_nothing",
        "kernel",
        20,
    );
}

/// The same through FUSE (issue 9): the FUSE daemon relays misses as the
/// holder does, so killing its worker costs time, not reads.
#[test]
fn fuse_worker_killed_during_a_full_read_loses_nothing() {
    worker_kills_during_a_full_read(
        "fuse_worker_killed_during_a_full_read_loses_nothing",
        "fuse",
        8,
    );
}

fn worker_kills_during_a_full_read(test: &'static str, mode: &str, kills: usize) {
    let Some(Lazy { _time, deb, reg, t }) = start(test, &format!("lazy-kill-{mode}")) else {
        return;
    };
    let m = Mount::with_args(
        &reg.reference(IMAGE),
        &t.join("mnt"),
        &t.join("cache"),
        &["--timeout", "60", "--mode", mode],
    );
    let rd = run_dir(&m);
    // Shuffled: in path order the data is fetched ahead in a few large
    // requests and the read ends before the kills do; this tests misses.
    let usr = shuffled(deb.files.clone(), 0x2545_f491_4f6c_dd1d);
    let started = Instant::now();
    let reader = hash_in_background(
        &m.path,
        usr.clone(),
        t.path(),
        "all",
        Duration::from_secs(900),
    );
    let mut killed = Vec::new();
    let mut f = Failures::default();
    for _ in 0..kills {
        let pid = busy_worker(&rd, &killed, Duration::from_secs(60));
        f.check(!reader.is_finished(), || {
            format!(
                "the read finished before kill #{} (too fast to test a crash mid-read)",
                killed.len() + 1
            )
        });
        kill9(pid);
        killed.push(pid);
        assert!(
            process_exits(pid, Duration::from_secs(10)),
            "worker {pid} survived kill -9"
        );
        eprintln!(
            "killed worker {pid} after {:.1} s",
            started.elapsed().as_secs_f64()
        );
    }
    let got = reader.join().expect("reader thread");
    let secs = started.elapsed().as_secs_f64();
    match got {
        Ok(got) => check_reads(&mut f, "the image with worker kills", deb, &usr, &got),
        Err(e) => f.check(false, || e),
    }
    let holder_log = relay_log(&rd);
    let restarts = holder_log.matches("restarting").count();
    f.check(restarts >= killed.len(), || {
        format!(
            "the {mode} relay's log shows {restarts} restarts for {} kills",
            killed.len()
        )
    });
    f.check(!holder_log.contains("timed out"), || {
        format!("a reader timed out:\n{holder_log}")
    });
    let s = settled_status(&m);
    let pid = s["pid"].as_u64().unwrap_or(0) as u32;
    f.check(pid != 0 && !killed.contains(&pid) && pid_alive(pid), || {
        format!("no live replacement worker after the kills: {s}")
    });
    f.check(num(&s, "failed_misses") == 0, || {
        format!("failed misses: {s}")
    });
    eprintln!(
        "figures: soak ({mode}): {} files read in {secs:.1} s with {} worker kills, {restarts} restarts in the relay's log",
        usr.len(),
        killed.len()
    );
    finish_with_logs(f, &rd, String::new, "worker kills");
    m.unmount();
}

// ---------------------------------------------------------------------------
// 5. the registry goes away and comes back

/// The registry stops while the whole tree is being read and comes back on
/// the same port and storage 2 s later: no reader error, every byte right.
#[test]
fn registry_restart_mid_read_loses_nothing() {
    let Some(Lazy { _time, deb, reg, t }) = start(
        "registry_restart_mid_read_loses_nothing",
        "lazy-registry-restart",
    ) else {
        return;
    };
    // 1 MiB fill window: the whole tree in a few hundred requests (one per
    // miss by default) keeps the test short.
    let m = Mount::with_args(
        &reg.reference(IMAGE),
        &t.join("mnt"),
        &t.join("cache"),
        &["--timeout", "120", "--fill-window", "1048576"],
    );
    let rd = run_dir(&m);
    let started = Instant::now();
    let reader = hash_in_background(
        &m.path,
        deb.files.clone(),
        t.path(),
        "all",
        Duration::from_secs(400),
    );
    // Let the read get going.
    let wait = Instant::now();
    while status_file(&rd).map_or(0, |s| num(&s, "fetched_bytes")) < 8 << 20 {
        assert!(
            wait.elapsed() < Duration::from_secs(120),
            "the read does not progress: {:?}\n{}",
            status_file(&rd),
            daemon_logs(&rd)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut f = Failures::default();
    f.check(!reader.is_finished(), || {
        "the read finished before the registry was stopped".into()
    });
    reg.stop();
    let stopped_at = started.elapsed().as_secs_f64();
    let at_stop = status_file(&rd).map_or(0, |s| num(&s, "fetched_bytes"));
    f.check(TcpStream::connect(("127.0.0.1", reg.port)).is_err(), || {
        format!("port {} still accepts after the registry stopped", reg.port)
    });
    std::thread::sleep(Duration::from_secs(2));
    let while_down = status_file(&rd).map_or(0, |s| num(&s, "fetched_bytes"));
    f.check(!reader.is_finished(), || {
        "the read finished while the registry was down: nothing left to test".into()
    });
    reg.restart();
    let restarted_at = started.elapsed().as_secs_f64();
    let got = reader.join().expect("reader thread");
    match got {
        Ok(got) => check_reads(
            &mut f,
            "whole tree across a registry restart",
            deb,
            &deb.files,
            &got,
        ),
        Err(e) => f.check(false, || e),
    }
    let s = settled_status(&m);
    f.check(num(&s, "failed_misses") == 0, || {
        format!("failed misses: {s}")
    });
    f.check(num(&s, "fetched_bytes") > while_down, || {
        format!("nothing was fetched after the restart ({while_down} bytes before): {s}")
    });
    let worker_log = fs::read_to_string(rd.join("worker.log")).unwrap_or_default();
    eprintln!(
        "figures: registry stopped at {stopped_at:.1} s ({} fetched), restarted at {restarted_at:.1} s ({} fetched while down), read done at {:.1} s, {} fetched in all; worker.log {} lines",
        mib(at_stop),
        mib(while_down.saturating_sub(at_stop)),
        started.elapsed().as_secs_f64(),
        mib(num(&s, "fetched_bytes")),
        worker_log.lines().count()
    );
    finish_with_logs(f, &rd, String::new, "registry restart");
    m.unmount();
}
