//! Temp dirs and mounts: [`TestDir`] and [`Mount`] (unmounted on drop), the
//! mount table, a lazy mount's run dir, fsck.erofs, overlays.

use std::ffi::OsStr;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use super::{command, lamina, lamina_cmd, run, tool, try_run, SHORT, TIMEOUT};
use serde_json::Value;

// ---------------------------------------------------------------------------
// temp dirs and mounts

/// Mount points in this process's mount namespace.
pub fn mount_points() -> Vec<PathBuf> {
    let info = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    info.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|p| PathBuf::from(unescape_mount_path(p)))
        .collect()
}

/// Undoes the octal escapes of /proc/self/mountinfo (`\040` for a space...).
fn unescape_mount_path(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = (b[i] == b'\\' && i + 3 < b.len())
            .then(|| &b[i + 1..i + 4])
            .filter(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)))
            .and_then(|d| {
                u8::try_from(d.iter().fold(0u32, |v, c| v * 8 + u32::from(c - b'0'))).ok()
            });
        if let Some(v) = octal {
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

pub fn canonical(p: &Path) -> PathBuf {
    p.canonicalize().unwrap_or_else(|_| p.to_path_buf())
}

/// Whether something is mounted at `path`.
pub fn is_mountpoint(path: &Path) -> bool {
    let p = canonical(path);
    mount_points().contains(&p)
}

/// Mounts at or below `path`, deepest first.
pub fn mounts_under(path: &Path) -> Vec<PathBuf> {
    let p = canonical(path);
    let mut v: Vec<_> = mount_points()
        .into_iter()
        .filter(|m| m.starts_with(&p))
        .collect();
    v.sort_by_key(|m| std::cmp::Reverse(m.components().count()));
    v.dedup();
    v
}

/// Unmounts whatever is mounted at `path`: `lamina umount` (with the cache
/// dir, so a lazy mount's daemon is waited for and its run dir removed),
/// then `umount`, then a lazy `umount -l` as the last resort. Never panics;
/// returns what went wrong.
pub fn force_unmount(path: &Path, cache: Option<&Path>) -> Result<(), String> {
    let mut log = String::new();
    for attempt in 0..6 {
        if !is_mountpoint(path) {
            return Ok(());
        }
        let mut cmd = match attempt {
            0 | 1 => {
                let mut c = lamina_cmd([OsStr::new("umount"), path.as_os_str()]);
                if let Some(cache) = cache {
                    c.arg("--cache-dir").arg(cache);
                }
                c
            }
            2 | 3 => command("umount", [path]),
            _ => command("umount", [OsStr::new("-l"), path.as_os_str()]),
        };
        match try_run(&mut cmd, SHORT) {
            Ok(o) if o.status.success() => {}
            Ok(o) => {
                let _ = writeln!(log, "{}", o.describe());
            }
            Err(e) => {
                let _ = writeln!(log, "{e}");
            }
        }
    }
    if is_mountpoint(path) {
        Err(format!("could not unmount {}:\n{log}", path.display()))
    } else {
        Ok(())
    }
}

/// A temporary directory for one test; on drop, anything still mounted
/// below it is unmounted before the directory is removed.
#[derive(Debug)]
pub struct TestDir {
    dir: Option<tempfile::TempDir>,
}

impl TestDir {
    /// A new empty directory under the system temp dir (no commas in the
    /// path: lamina passes cache paths in a comma-separated mount option).
    #[track_caller]
    pub fn new(label: &str) -> Self {
        let dir = tempfile::Builder::new()
            .prefix(&format!("lamina-e2e-{label}-"))
            .tempdir()
            .unwrap_or_else(|e| panic!("cannot create a temp dir: {e}"));
        TestDir { dir: Some(dir) }
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        self.dir.as_ref().expect("live temp dir").path()
    }

    /// `path/rel` (not created).
    pub fn join(&self, rel: &str) -> PathBuf {
        self.path().join(rel)
    }

    /// `path/rel`, created as a directory.
    #[track_caller]
    pub fn mkdir(&self, rel: &str) -> PathBuf {
        let p = self.join(rel);
        fs::create_dir_all(&p).unwrap_or_else(|e| panic!("mkdir {}: {e}", p.display()));
        p
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        let Some(dir) = self.dir.take() else { return };
        let mut stuck = false;
        for m in mounts_under(dir.path()) {
            if let Err(e) = force_unmount(&m, None) {
                eprintln!("warning: {e}");
                stuck = true;
            }
        }
        if stuck {
            // Never recurse into a mount: keep the directory.
            let kept = dir.keep();
            eprintln!(
                "warning: kept {} (something is still mounted below it)",
                kept.display()
            );
        }
    }
}

/// A lamina mount, unmounted on drop.
#[derive(Debug)]
pub struct Mount {
    /// The mountpoint.
    pub path: PathBuf,
    /// The cache dir it was mounted with.
    pub cache: PathBuf,
    /// `lamina mount --json` output.
    pub info: Value,
}

impl Mount {
    /// `lamina mount --json IMAGE MNT --cache-dir CACHE`; asserts success
    /// and that MNT is a mountpoint afterwards.
    #[track_caller]
    pub fn new(image: &str, mnt: &Path, cache: &Path) -> Mount {
        Mount::with_args(image, mnt, cache, &[])
    }

    /// Like [`Mount::new`] with extra mount options (`--lazy`, ...).
    #[track_caller]
    pub fn with_args(image: &str, mnt: &Path, cache: &Path, extra: &[&str]) -> Mount {
        Mount::in_netns(None, image, mnt, cache, extra)
    }

    /// Like [`Mount::with_args`], the mount (and so its daemons) started in
    /// the network namespace `/run/netns/NETNS` when one is given (through
    /// `nsenter --net`, so the mount is seen here).
    #[track_caller]
    pub fn in_netns(
        netns: Option<&str>,
        image: &str,
        mnt: &Path,
        cache: &Path,
        extra: &[&str],
    ) -> Mount {
        fs::create_dir_all(mnt).unwrap_or_else(|e| panic!("mkdir {}: {e}", mnt.display()));
        assert!(
            !is_mountpoint(mnt),
            "{} is already a mountpoint",
            mnt.display()
        );
        // The guard exists before the mount, so a later panic still unmounts.
        let mut guard = Mount {
            path: mnt.to_path_buf(),
            cache: cache.to_path_buf(),
            info: Value::Null,
        };
        let mut args = vec![OsStr::new("mount"), OsStr::new("--json")];
        args.extend(extra.iter().map(OsStr::new));
        args.extend([
            OsStr::new(image),
            mnt.as_os_str(),
            OsStr::new("--cache-dir"),
            cache.as_os_str(),
        ]);
        let mut cmd = lamina_cmd(args);
        if let Some(ns) = netns {
            let mut entered = command("nsenter", [format!("--net=/run/netns/{ns}")]);
            entered.arg(cmd.get_program()).args(cmd.get_args());
            entered.env_remove("LAMINA_CACHE_DIR");
            cmd = entered;
        }
        let out = run(&mut cmd, TIMEOUT).ok();
        guard.info = out.json();
        assert!(
            is_mountpoint(mnt),
            "lamina mount succeeded but {} is not a mountpoint:\n{}",
            mnt.display(),
            out.describe()
        );
        guard
    }

    /// `metadata_path` of the mount report.
    #[track_caller]
    pub fn metadata_path(&self) -> PathBuf {
        PathBuf::from(
            self.info["metadata_path"]
                .as_str()
                .unwrap_or_else(|| panic!("no metadata_path in {}", self.info)),
        )
    }

    /// `blob_paths` of the mount report, in EROFS device order.
    #[track_caller]
    pub fn blob_paths(&self) -> Vec<PathBuf> {
        self.info["blob_paths"]
            .as_array()
            .unwrap_or_else(|| panic!("no blob_paths array in {}", self.info))
            .iter()
            .map(|v| PathBuf::from(v.as_str().expect("blob path is a string")))
            .collect()
    }

    /// This mount's entry of `lamina status --json` (lazy mounts only).
    #[track_caller]
    pub fn status(&self) -> Option<Value> {
        let out = lamina([
            OsStr::new("status"),
            OsStr::new("--json"),
            OsStr::new("--cache-dir"),
            self.cache.as_os_str(),
        ])
        .ok();
        let me = canonical(&self.path);
        out.json()
            .as_array()
            .unwrap_or_else(|| panic!("status --json is not an array:\n{}", out.describe()))
            .iter()
            .find(|m| m["mountpoint"].as_str().map(Path::new) == Some(me.as_path()))
            .cloned()
    }

    /// Waits until every blob of this (lazy) mount is complete, as `lamina
    /// status` says; panics after `limit` with the last status.
    #[track_caller]
    pub fn wait_complete(&self, limit: Duration) {
        let started = Instant::now();
        let complete = |s: &Value| {
            s["status"]["blobs"]
                .as_array()
                .is_some_and(|b| !b.is_empty() && b.iter().all(|b| b["complete"] == true))
        };
        while !self.status().is_some_and(|s| complete(&s)) {
            assert!(
                started.elapsed() < limit,
                "{} is not complete after {limit:?}: {:?}",
                self.path.display(),
                self.status()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `lamina umount --json MNT --cache-dir CACHE`, asserting success and
    /// that nothing stays mounted. Returns the JSON report.
    #[track_caller]
    pub fn unmount(self) -> Value {
        let out = lamina([
            OsStr::new("umount"),
            OsStr::new("--json"),
            self.path.as_os_str(),
            OsStr::new("--cache-dir"),
            self.cache.as_os_str(),
        ])
        .ok();
        assert!(
            !is_mountpoint(&self.path),
            "lamina umount succeeded but {} is still a mountpoint:\n{}",
            self.path.display(),
            out.describe()
        );
        out.json()
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if let Err(e) = force_unmount(&self.path, Some(&self.cache)) {
            eprintln!("warning: {e}");
        }
    }
}

/// The run directory of a lazy mount (`CACHE/mounts/<id>`), found by its
/// config's mountpoint.
#[track_caller]
pub fn run_dir(m: &Mount) -> PathBuf {
    let me = m.path.canonicalize().unwrap();
    let mounts = m.cache.join("mounts");
    for e in fs::read_dir(&mounts)
        .unwrap_or_else(|e| panic!("readdir {}: {e}", mounts.display()))
        .flatten()
    {
        let config: Option<Value> = fs::read(e.path().join("config.json"))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok());
        if config.is_some_and(|c| c["mountpoint"].as_str().map(Path::new) == Some(me.as_path())) {
            return e.path();
        }
    }
    panic!("no run dir for {} in {}", me.display(), mounts.display());
}

/// Unmounts `path` on drop if something is mounted there (for mounts that
/// are expected to fail).
#[derive(Debug)]
pub struct MountWatch(pub PathBuf, pub PathBuf);

impl Drop for MountWatch {
    fn drop(&mut self) {
        if let Err(e) = force_unmount(&self.0, Some(&self.1)) {
            eprintln!("warning: {e}");
        }
    }
}

/// Runs `fsck.erofs --device=B1 --device=B2 ... METADATA` (devices in the
/// order of the mount report) and asserts exit 0; then the same with
/// `--extract` (decodes every file).
#[track_caller]
pub fn fsck_erofs(m: &Mount) {
    fsck_erofs_file(&m.metadata_path(), &m.blob_paths());
}

/// `fsck.erofs` (and `--extract`) of the EROFS `meta` with `blobs` as its
/// devices, in order.
#[track_caller]
pub fn fsck_erofs_file(meta: &Path, blobs: &[PathBuf]) {
    assert!(meta.is_file(), "metadata {} is not a file", meta.display());
    for b in blobs {
        assert!(b.is_file(), "blob cache {} is not a file", b.display());
    }
    for extra in [None, Some("--extract")] {
        let mut c = Command::new(tool("fsck.erofs"));
        c.args(extra);
        for b in blobs {
            let mut arg = std::ffi::OsString::from("--device=");
            arg.push(b);
            c.arg(arg);
        }
        c.arg(meta);
        run(&mut c, TIMEOUT).code_is(0);
    }
}

/// An overlayfs over a (read-only) lamina mount, unmounted on drop.
#[derive(Debug)]
pub struct Overlay {
    /// Where the overlay is mounted.
    pub merged: PathBuf,
}

impl Overlay {
    #[track_caller]
    pub fn mount(lower: &Path, dir: &Path) -> Overlay {
        let (upper, work, merged) = (dir.join("upper"), dir.join("work"), dir.join("merged"));
        for d in [&upper, &work, &merged] {
            fs::create_dir_all(d).unwrap();
        }
        let guard = Overlay {
            merged: merged.clone(),
        };
        let opts = format!(
            "lowerdir={},upperdir={},workdir={}",
            lower.display(),
            upper.display(),
            work.display()
        );
        let mut c = command(
            "mount",
            [
                OsStr::new("-t"),
                OsStr::new("overlay"),
                OsStr::new("overlay"),
                OsStr::new("-o"),
                OsStr::new(&opts),
                merged.as_os_str(),
            ],
        );
        run(&mut c, SHORT).ok();
        guard
    }

    #[track_caller]
    pub fn unmount(&self) {
        run(&mut command("umount", [&self.merged]), SHORT).ok();
    }
}

impl Drop for Overlay {
    fn drop(&mut self) {
        for args in [vec!["umount"], vec!["umount", "-l"]] {
            if !is_mountpoint(&self.merged) {
                return;
            }
            let mut c = command(args[0], &args[1..]);
            c.arg(&self.merged);
            let _ = try_run(&mut c, SHORT);
        }
    }
}

/// The files of a cache dir's `sub` (`blobs` or `meta`): in the dirs of
/// its trust domains (`blobs/<domain>/`), and any right there.
pub fn cache_files_in(cache: &Path, sub: &str) -> Vec<PathBuf> {
    let entries = |dir: &Path| -> Vec<PathBuf> {
        std::fs::read_dir(dir)
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default()
    };
    let mut files = Vec::new();
    for path in entries(&cache.join(sub)) {
        match path.is_dir() {
            true => files.extend(entries(&path).into_iter().filter(|p| p.is_file())),
            false => files.push(path),
        }
    }
    files.sort();
    files
}

/// Whether the file at `path` has a block allocated for every byte (a
/// mount's `--reserve-space`), or what it has.
pub fn allocated_whole(path: &Path) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path).map_err(|e| format!("{}: {e}", path.display()))?;
    match meta.blocks() * 512 >= meta.len() {
        true => Ok(()),
        false => Err(format!(
            "{} is not allocated whole: {} of {} bytes",
            path.display(),
            meta.blocks() * 512,
            meta.len()
        )),
    }
}

/// An ext4 filesystem of `bytes` on a loop device, mounted at a dir of
/// `t` (256-byte inodes: birth times kept); lazily unmounted on drop.
pub struct LoopExt4(pub PathBuf);

impl LoopExt4 {
    #[track_caller]
    pub fn mount(t: &TestDir, name: &str, bytes: u64) -> LoopExt4 {
        let image = t.join(&format!("{name}.img"));
        let dir = t.mkdir(name);
        fs::File::create(&image).unwrap().set_len(bytes).unwrap();
        run(
            &mut command(
                "mkfs.ext4",
                ["-q", "-F", "-m", "0", image.to_str().unwrap()],
            ),
            SHORT,
        )
        .ok();
        let opts = [
            OsStr::new("-o"),
            OsStr::new("loop"),
            image.as_os_str(),
            dir.as_os_str(),
        ];
        run(&mut command("mount", opts), SHORT).ok();
        LoopExt4(dir)
    }
}

impl Drop for LoopExt4 {
    fn drop(&mut self) {
        let _ = run(
            &mut command("umount", [OsStr::new("-l"), self.0.as_os_str()]),
            SHORT,
        );
    }
}

/// The FUSE daemon's log of the mount at `mnt` served from `cache`.
pub fn fuse_log(cache: &Path, mnt: &Path) -> String {
    let config = fs::read_dir(cache.join("mounts"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .find(|run| {
            fs::read(run.join("fuse.json")).is_ok_and(|c| {
                let c: serde_json::Value = serde_json::from_slice(&c).unwrap_or_default();
                c["mountpoint"].as_str().map(Path::new) == Some(canonical(mnt).as_path())
            })
        });
    let run = config.unwrap_or_else(|| panic!("no FUSE daemon config for {}", mnt.display()));
    fs::read_to_string(run.join("fuse.log")).unwrap_or_default()
}

/// The FUSE daemon's log at `mnt` once it holds `line` (within 30 s).
#[track_caller]
pub fn wait_for_log(cache: &Path, mnt: &Path, line: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let log = fuse_log(cache, mnt);
        if log.contains(line) {
            return log;
        }
        assert!(Instant::now() < deadline, "no {line:?} in 30 s:\n{log}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The FUSE daemon's "metadata frames all written" line at `mnt`, once it
/// has hashed and recorded the metadata (within 30 s).
#[track_caller]
pub fn metadata_frames_written(cache: &Path, mnt: &Path) -> String {
    let log = wait_for_log(cache, mnt, "metadata hashed and recorded");
    let line = log
        .lines()
        .find(|l| l.contains("metadata frames all written"));
    line.unwrap_or_else(|| panic!("no frames line:\n{log}"))
        .to_string()
}

/// The number a log line gives as `name=N`.
pub fn log_field(line: &str, name: &str) -> Option<u64> {
    let value = line.split(&format!("{name}=")).nth(1)?;
    value.split(' ').next()?.parse().ok()
}
