//! Sections 9 (umount) and 10 (the holder lives as long as anyone can read):
//! open files after a lazy unmount or an overmount, an overlay on the mount.

use std::ffi::OsStr;
use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::*;
use crate::daemon::{pid_alive, start, wait_status, Lazy};
use crate::fixture::Debian;
use crate::readers::{check_reads, chroot_python, hash_files};
use crate::IMAGE;

// ---------------------------------------------------------------------------
// 9. umount

/// `lamina umount` stops the holder and the worker and removes the run dir.
#[test]
fn umount_stops_holder_and_worker_and_removes_run_dir() {
    let Some(Lazy { _time, reg, t, .. }) = start(
        "umount_stops_holder_and_worker_and_removes_run_dir",
        "lazy-umount",
    ) else {
        return;
    };
    let cache = t.join("cache");
    let m = Mount::new(&reg.reference(IMAGE), &t.join("mnt"), &cache);
    chroot_python(&m.path);
    let rd = run_dir(&m);
    let entry = m.status().expect("the mount is listed by lamina status");
    let holder = entry["holder_pid"].as_u64().expect("holder pid") as u32;
    let worker = worker_pid(&m);
    assert!(
        pid_alive(holder) && pid_alive(worker),
        "daemon not running: {entry}"
    );
    assert_eq!(entry["alive"], true, "{entry}");
    let mnt = m.path.clone();
    let started = Instant::now();
    let last = m.unmount();
    let umount_secs = started.elapsed().as_secs_f64();
    let mut f = Failures::default();
    // Gone means gone or a zombie not yet reaped by init.
    f.check(process_exits(holder, Duration::ZERO), || {
        format!("holder {holder} still runs after lamina umount returned")
    });
    f.check(process_exits(worker, Duration::ZERO), || {
        format!("worker {worker} still runs after lamina umount returned")
    });
    f.check(!rd.exists(), || {
        format!("run dir {} still exists", rd.display())
    });
    f.check(last["last_status"].is_object(), || {
        format!("umount reported no last status: {last}")
    });
    let listed = lamina(["status", "--json", "--cache-dir", cache.to_str().unwrap()])
        .ok()
        .json();
    f.check(listed.as_array().is_some_and(|a| a.is_empty()), || {
        format!("lamina status still lists mounts: {listed}")
    });
    f.check(!is_mountpoint(&mnt), || "still mounted".into());
    eprintln!("figures: umount took {umount_secs:.2} s (holder {holder}, worker {worker})");
    f.finish("umount");
}

// ---------------------------------------------------------------------------
// 10. the holder lives as long as anyone can read (issue 7, point 2)

/// Opens a file, reads its first page, says `started`, waits for a line on
/// stdin, then reads the rest and prints the sha256 of the whole file (or
/// `errno N`).
const PARTIAL_READER: &str = r#"
import hashlib, sys
f = open(sys.argv[1], 'rb')
h = hashlib.sha256()
h.update(f.read(4096))
print('started', flush=True)
sys.stdin.readline()
try:
    while True:
        b = f.read(1 << 20)
        if not b:
            break
        h.update(b)
    print(h.hexdigest(), flush=True)
except OSError as e:
    print('errno', e.errno, flush=True)
"#;

/// A file held open across what the test does to the mount.
pub(crate) struct OpenFile {
    pub(crate) child: std::process::Child,
    pub(crate) out: std::io::BufReader<std::process::ChildStdout>,
}

impl OpenFile {
    pub(crate) fn open(path: &Path) -> OpenFile {
        use std::io::BufRead;
        let mut child = Command::new(tool("python3"))
            .arg("-c")
            .arg(PARTIAL_READER)
            .arg(path)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("python3");
        let mut out = std::io::BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        out.read_line(&mut line).expect("reader output");
        assert_eq!(line.trim(), "started", "the reader did not start");
        OpenFile { child, out }
    }

    /// Reads the rest; returns the whole file's sha256 or the error.
    pub(crate) fn finish(mut self) -> String {
        use std::io::{BufRead, Write};
        let mut stdin = self.child.stdin.take().expect("stdin");
        stdin.write_all(b"go\n").expect("to the reader");
        drop(stdin);
        let mut line = String::new();
        self.out.read_line(&mut line).expect("reader output");
        let _ = self.child.wait();
        line.trim().to_string()
    }
}

/// The largest file of the image: many chunks, most not yet read.
pub(crate) fn largest_file(deb: &Debian) -> &str {
    deb.files
        .iter()
        .max_by_key(|f| deb.sizes[*f])
        .expect("files")
}

/// The pid of the mount's worker, once it has written its status.
pub(crate) fn worker_pid(m: &Mount) -> u32 {
    wait_status(m, "worker pid", Duration::from_secs(10), |s| {
        s["pid"].as_u64().is_some()
    })["pid"]
        .as_u64()
        .unwrap() as u32
}

pub(crate) fn holder_pid(m: &Mount) -> u32 {
    m.status().expect("listed")["holder_pid"]
        .as_u64()
        .expect("holder pid") as u32
}

/// `umount -l` while a file is open, then something mounted over the
/// mountpoint: the open file still reads the image's bytes (on main the
/// holder left at the mountpoint change and the rest read as zeros), and
/// the holder leaves once the file is closed and the superblock is gone.
#[test]
fn holder_serves_open_files_after_lazy_unmount_and_overmount() {
    let Some(Lazy { _time, deb, reg, t }) = start(
        "holder_serves_open_files_after_lazy_unmount_and_overmount",
        "lazy-lifetime",
    ) else {
        return;
    };
    let file = largest_file(deb);
    let mut f = Failures::default();
    for how in ["umount -l", "overmount"] {
        let m = Mount::with_args(
            &reg.reference(IMAGE),
            &t.join("mnt"),
            &t.join("cache"),
            &["--prefetch", "none"],
        );
        let holder = holder_pid(&m);
        let open = OpenFile::open(&m.path.join(file));
        if how == "umount -l" {
            // lamina umount never detaches lazily: a file is open, so busy.
            let out = lamina([
                OsStr::new("umount"),
                m.path.as_os_str(),
                OsStr::new("--cache-dir"),
                m.cache.as_os_str(),
            ]);
            f.check(
                out.code() == Some(6)
                    && out.stderr.contains("still in use")
                    && is_mountpoint(&m.path),
                || {
                    format!(
                        "lamina umount of a mount with an open file:\n{}",
                        out.describe()
                    )
                },
            );
        }
        let tmpfs = m.path.clone();
        match how {
            "umount -l" => run(Command::new("umount").arg("-l").arg(&m.path), TIMEOUT).ok(),
            _ => run(
                Command::new("mount")
                    .args(["-t", "tmpfs", "tmpfs"])
                    .arg(&tmpfs),
                TIMEOUT,
            )
            .ok(),
        };
        std::thread::sleep(Duration::from_millis(600)); // the old holder looked every 200 ms
        let got = open.finish();
        f.check(got == deb.hashes[file], || {
            format!("{how}: {file} read {got}, reference {}", deb.hashes[file])
        });
        if how == "overmount" {
            run(Command::new("umount").arg(&tmpfs), TIMEOUT).ok();
            f.check(pid_alive(holder), || {
                format!("{how}: the holder left while the filesystem was mounted")
            });
            m.unmount();
        } else {
            std::mem::forget(m); // unmounted already
        }
        f.check(process_exits(holder, Duration::from_secs(10)), || {
            format!("{how}: holder {holder} still runs after the filesystem is gone")
        });
        // A fresh cache each round: the file is fetched again.
        let _ = fs::remove_dir_all(t.join("cache"));
    }
    f.finish("holder lifetime");
}

/// An overlay with the lazy mount as its lower dir keeps the filesystem
/// alive: `lamina umount` of the lower mount either reports it busy or
/// says the filesystem lives on, and reads through the overlay still get
/// the image's bytes.
#[test]
fn overlay_on_a_lazy_mount_keeps_it_served() {
    let Some(Lazy { _time, deb, reg, t }) =
        start("overlay_on_a_lazy_mount_keeps_it_served", "lazy-overlay")
    else {
        return;
    };
    let m = Mount::with_args(
        &reg.reference(IMAGE),
        &t.join("mnt"),
        &t.join("cache"),
        &["--prefetch", "none"],
    );
    let holder = holder_pid(&m);
    let (upper, work, merged) = (t.join("upper"), t.join("work"), t.join("merged"));
    for d in [&upper, &work, &merged] {
        fs::create_dir_all(d).unwrap();
    }
    let opts = format!(
        "lowerdir={},upperdir={},workdir={}",
        m.path.display(),
        upper.display(),
        work.display()
    );
    run(
        Command::new("mount")
            .args(["-t", "overlay", "overlay", "-o", &opts])
            .arg(&merged),
        TIMEOUT,
    )
    .ok();
    let out = lamina([
        OsStr::new("umount"),
        m.path.as_os_str(),
        OsStr::new("--cache-dir"),
        m.cache.as_os_str(),
    ]);
    let mut f = Failures::default();
    let busy = !out.status.success();
    f.check(
        if busy {
            out.stderr.contains("still in use")
        } else {
            out.stderr.contains("lives on")
        },
        || format!("lamina umount under an overlay said:\n{}", out.describe()),
    );
    let sample: Vec<String> = deb.files.iter().rev().take(40).cloned().collect();
    match hash_files(&merged, &sample, t.path(), "overlay", TIMEOUT) {
        Ok(got) => check_reads(&mut f, "through the overlay", deb, &sample, &got),
        Err(e) => f.check(false, || e),
    }
    run(Command::new("umount").arg(&merged), TIMEOUT).ok();
    if busy {
        m.unmount();
    } else {
        std::mem::forget(m);
    }
    f.check(process_exits(holder, Duration::from_secs(10)), || {
        format!("holder {holder} still runs after the overlay is gone")
    });
    eprintln!(
        "figures: lamina umount under an overlay: {}",
        if busy {
            "busy"
        } else {
            "unmounted, filesystem lives on"
        }
    );
    f.finish("overlay");
}

/// Issue 42, point 10: each mount's daemons (holder and worker) live in a
/// cgroup of their own, `lamina/mount-<run dir>` in every hierarchy with
/// the memory and pids controllers, with the limits of
/// `lamina_daemon::bounds::MOUNT_LIMITS`, so one tenant's storm of misses
/// takes from its own share. Before, they shared the cgroup of whoever
/// mounted (the snapshotter's, containerd's).
#[test]
fn each_mounts_daemons_have_a_cgroup_of_their_own() {
    let Some(Lazy {
        _time,
        deb: _,
        reg,
        t,
    }) = start(
        "each_mounts_daemons_have_a_cgroup_of_their_own",
        "lazy-cgroup",
    )
    else {
        return;
    };
    let cache = t.join("cache");
    let mounts: Vec<Mount> = ["a", "b"]
        .iter()
        .map(|n| {
            Mount::with_args(
                &reg.reference(IMAGE),
                &t.join(n),
                &cache,
                &["--mode", "kernel"],
            )
        })
        .collect();
    let mine = lamina_sys::cgroup::cgroups_of(std::process::id()).unwrap();
    let mut seen = Vec::new();
    for m in &mounts {
        let run = run_dir(m);
        let name = format!(
            "lamina/mount-{}",
            run.file_name().unwrap().to_string_lossy()
        );
        let (holder, worker) = (holder_pid(m), worker_pid(m));
        // The holder moves them right after the mount is ready.
        let deadline = Instant::now() + Duration::from_secs(10);
        let groups = loop {
            let groups = lamina_sys::cgroup::cgroups_of(holder).unwrap();
            let moved = |pid| {
                let g = lamina_sys::cgroup::cgroups_of(pid).unwrap();
                g.iter().any(|g| g.ends_with(&name))
            };
            if (moved(holder) && moved(worker)) || Instant::now() > deadline {
                break groups;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        assert_eq!(
            groups,
            lamina_sys::cgroup::cgroups_of(worker).unwrap(),
            "holder and worker"
        );
        let own: Vec<&String> = groups.iter().filter(|g| g.ends_with(&name)).collect();
        assert!(
            !own.is_empty(),
            "holder {holder} in {groups:?}, not in {name}; this test in {mine:?}"
        );
        let pids_max = ["/sys/fs/cgroup/pids", "/sys/fs/cgroup"]
            .iter()
            .find_map(|root| fs::read_to_string(Path::new(root).join(&name).join("pids.max")).ok());
        assert_eq!(pids_max.as_deref().map(str::trim), Some("1024"), "{name}");
        seen.push(name);
    }
    assert_ne!(seen[0], seen[1], "two mounts, one cgroup");
    for m in mounts {
        m.unmount();
    }
}
