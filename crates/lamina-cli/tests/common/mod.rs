//! Helpers shared by lamina's end-to-end tests.
//!
//! Everything here runs real commands (the `lamina` binary, umoci, skopeo,
//! docker-registry, fsck.erofs, the Python tools under `tests/`) and real
//! kernel mounts, so the tests need root. A test calls [`require`] first: when
//! root or a tool is missing the test FAILS, unless `LAMINA_SKIP_PRIVILEGED=1`
//! is set, in which case it prints `skipped: ...` and returns.
//!
//! Every command runs with a deadline ([`run`]); stdout and stderr go to
//! anonymous temp files (no pipe can fill up) and are shown in full context
//! when an assertion on them fails.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::fmt::Write as _;
use std::fs::{self, File};
use std::io::{Read, Seek, SeekFrom};
use std::net::TcpListener;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde_json::Value;
use sha2::{Digest, Sha256};

/// The binary under test.
pub const LAMINA: &str = env!("CARGO_BIN_EXE_lamina");

/// Default deadline for one command.
pub const TIMEOUT: Duration = Duration::from_secs(300);

/// Deadline for quick commands (umount, registry stop, ...).
pub const SHORT: Duration = Duration::from_secs(60);

/// The repository root (`/work/main`).
pub fn repo_root() -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    p.canonicalize()
        .unwrap_or_else(|e| panic!("cannot resolve the repository root {}: {e}", p.display()))
}

/// A file of the repository, e.g. `tests/tools/treecmp.py`.
pub fn repo_file(rel: &str) -> PathBuf {
    repo_root().join(rel)
}

// ---------------------------------------------------------------------------
// privileges and tools

/// Effective uid, from /proc/self/status (no unsafe code needed).
pub fn euid() -> Option<u32> {
    let status = fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("Uid:"))?;
    line.split_whitespace().nth(2)?.parse().ok()
}

/// Finds `name` on PATH (plus the sbin directories, where fsck.erofs and
/// chroot live and which a non-login PATH may lack).
pub fn find_tool(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(
            ["/usr/local/sbin", "/usr/sbin", "/sbin", "/usr/bin", "/bin"]
                .iter()
                .map(PathBuf::from),
        )
        .map(|d| d.join(name))
        .find(|p| fs::metadata(p).is_ok_and(|m| m.is_file() && m.mode() & 0o111 != 0))
}

/// Tool path for a command; panics if absent (call [`require`] first).
pub fn tool(name: &str) -> PathBuf {
    find_tool(name).unwrap_or_else(|| panic!("tool not found: {name} (run scripts/setup.sh)"))
}

/// Checks the test's prerequisites: root and `tools` (always also python3,
/// which runs the fixture generator and the comparison tools).
///
/// Returns true when the test can run. When something is missing, panics
/// with a clear message, or, if `LAMINA_SKIP_PRIVILEGED=1`, prints
/// `skipped: ...` and returns false (the caller then returns).
#[must_use]
#[track_caller]
pub fn require(tools: &[&str]) -> bool {
    let mut missing = Vec::new();
    if euid() != Some(0) {
        missing.push(format!(
            "root (effective uid is {})",
            euid().map_or("unknown".to_string(), |u| u.to_string())
        ));
    }
    for t in std::iter::once(&"python3").chain(tools) {
        if find_tool(t).is_none() {
            missing.push(format!("tool `{t}` on PATH"));
        }
    }
    if missing.is_empty() {
        return true;
    }
    let test = std::thread::current()
        .name()
        .unwrap_or("this test")
        .to_string();
    if std::env::var("LAMINA_SKIP_PRIVILEGED").as_deref() == Ok("1") {
        println!("skipped: {test} needs {}", missing.join(", "));
        return false;
    }
    panic!(
        "{test} needs {}.\nRun the tests as root on Debian bookworm after `bash scripts/setup.sh`, \
         or set LAMINA_SKIP_PRIVILEGED=1 to skip the tests that need root and these tools.",
        missing.join(", ")
    );
}

// ---------------------------------------------------------------------------
// running commands

/// The result of a finished command.
#[derive(Debug)]
pub struct Output {
    /// The command line, for messages.
    pub cmdline: String,
    /// Exit status.
    pub status: ExitStatus,
    /// Everything written to stdout (lossy UTF-8).
    pub stdout: String,
    /// Everything written to stderr (lossy UTF-8).
    pub stderr: String,
    /// Wall time.
    pub elapsed: Duration,
}

fn tail(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut start = s.len() - max;
    while !s.is_char_boundary(start) {
        start += 1;
    }
    format!("[... {} bytes cut ...]{}", start, &s[start..])
}

impl Output {
    /// Exit code (None when killed by a signal).
    pub fn code(&self) -> Option<i32> {
        self.status.code()
    }

    /// A readable description of the run: command, status, output tails.
    pub fn describe(&self) -> String {
        format!(
            "command: {}\nstatus: {} (after {:.1} s)\n--- stdout ---\n{}\n--- stderr ---\n{}\n--------------",
            self.cmdline,
            self.status,
            self.elapsed.as_secs_f64(),
            tail(&self.stdout, 6000),
            tail(&self.stderr, 6000)
        )
    }

    /// Asserts exit status 0.
    #[track_caller]
    pub fn ok(self) -> Self {
        assert!(
            self.status.success(),
            "command failed:\n{}",
            self.describe()
        );
        self
    }

    /// Asserts the exit code.
    #[track_caller]
    pub fn code_is(self, code: i32) -> Self {
        assert_eq!(
            self.code(),
            Some(code),
            "expected exit code {code}:\n{}",
            self.describe()
        );
        self
    }

    /// Asserts a non-zero exit and a non-empty error message on stderr.
    #[track_caller]
    pub fn failed(self) -> Self {
        assert!(
            !self.status.success(),
            "command unexpectedly succeeded:\n{}",
            self.describe()
        );
        assert!(
            !self.stderr.trim().is_empty(),
            "command failed without an error message:\n{}",
            self.describe()
        );
        self
    }

    /// stdout parsed as JSON.
    #[track_caller]
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("stdout is not a JSON document ({e}):\n{}", self.describe()))
    }
}

fn read_back(mut f: File) -> String {
    let mut buf = Vec::new();
    let _ = f.seek(SeekFrom::Start(0));
    let _ = f.read_to_end(&mut buf);
    String::from_utf8_lossy(&buf).into_owned()
}

/// Runs `cmd` (stdin from /dev/null) with a deadline; errors instead of
/// panicking (for use in `Drop`).
pub fn try_run(cmd: &mut Command, timeout: Duration) -> Result<Output, String> {
    let cmdline = format!("{cmd:?}");
    let out = tempfile::tempfile().map_err(|e| format!("temp file: {e}"))?;
    let err = tempfile::tempfile().map_err(|e| format!("temp file: {e}"))?;
    let clone = |f: &File| f.try_clone().map_err(|e| format!("dup: {e}"));
    cmd.stdin(Stdio::null())
        .stdout(Stdio::from(clone(&out)?))
        .stderr(Stdio::from(clone(&err)?));
    let start = Instant::now();
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot start {cmdline}: {e}"))?;
    let mut sleep = Duration::from_millis(5);
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) => {}
            Err(e) => return Err(format!("waiting for {cmdline}: {e}")),
        }
        if start.elapsed() > timeout {
            let _ = child.kill();
            let status = child
                .wait()
                .map_err(|e| format!("reaping {cmdline}: {e}"))?;
            let o = Output {
                cmdline,
                status,
                stdout: read_back(out),
                stderr: read_back(err),
                elapsed: start.elapsed(),
            };
            return Err(format!(
                "timed out after {} s and was killed:\n{}",
                timeout.as_secs(),
                o.describe()
            ));
        }
        std::thread::sleep(sleep);
        sleep = (sleep * 2).min(Duration::from_millis(100));
    };
    Ok(Output {
        cmdline,
        status,
        stdout: read_back(out),
        stderr: read_back(err),
        elapsed: start.elapsed(),
    })
}

/// Runs `cmd` with a deadline; panics on spawn failure or timeout.
#[track_caller]
pub fn run(cmd: &mut Command, timeout: Duration) -> Output {
    try_run(cmd, timeout).unwrap_or_else(|e| panic!("{e}"))
}

/// A `Command` for `program` with `args`.
pub fn command<I, S>(program: impl AsRef<OsStr>, args: I) -> Command
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut c = Command::new(program);
    c.args(args);
    c
}

/// A `Command` for the lamina binary (no inherited LAMINA_CACHE_DIR: tests
/// always pass --cache-dir).
pub fn lamina_cmd<I, S>(args: I) -> Command
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut c = command(LAMINA, args);
    c.env_remove("LAMINA_CACHE_DIR");
    c
}

/// Runs lamina with `args` (deadline [`TIMEOUT`]).
#[track_caller]
pub fn lamina<I, S>(args: I) -> Output
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    run(&mut lamina_cmd(args), TIMEOUT)
}

/// Runs lamina with `args` and a custom deadline.
#[track_caller]
pub fn lamina_timeout<I, S>(args: I, timeout: Duration) -> Output
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    run(&mut lamina_cmd(args), timeout)
}

/// Runs a python3 script of the repository.
#[track_caller]
pub fn python<I, S>(script: &str, args: I, timeout: Duration) -> Output
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut c = Command::new(tool("python3"));
    c.arg(repo_file(script)).args(args);
    run(&mut c, timeout)
}

/// `oci:DIR:TAG`.
pub fn oci_ref(dir: &Path, tag: &str) -> String {
    format!("oci:{}:{tag}", dir.display())
}

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

/// The reference Debian OCI layout (tag `bookworm`): `$LAMINA_DEBIAN_OCI`,
/// else `/var/cache/lamina-test/debian-oci`, built by scripts/debian-image.sh
/// once per machine (~2 min; a no-op when cached).
#[track_caller]
pub fn debian_source() -> PathBuf {
    let layout = std::env::var_os("LAMINA_DEBIAN_OCI")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/lamina-test/debian-oci"));
    let mut c = command(
        "bash",
        [
            repo_file("scripts/debian-image.sh").as_os_str(),
            layout.as_os_str(),
        ],
    );
    run(&mut c, Duration::from_secs(1800)).ok();
    layout
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

/// The port a test server started in `bg` writes to `port_file` once it
/// listens; panics (with its output) if it exits or takes over 20 s.
#[track_caller]
pub fn wait_port_file(bg: &mut Background, port_file: &Path, what: &str) -> u16 {
    let start = Instant::now();
    loop {
        if let Some(p) = fs::read_to_string(port_file)
            .ok()
            .and_then(|s| s.trim().parse::<u16>().ok())
        {
            return p;
        }
        assert!(bg.running(), "{what} exited:\n{}", bg.describe());
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "{what} did not start:\n{}",
            bg.describe()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
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
    let meta = m.metadata_path();
    let blobs = m.blob_paths();
    assert!(meta.is_file(), "metadata {} is not a file", meta.display());
    for b in &blobs {
        assert!(b.is_file(), "blob cache {} is not a file", b.display());
    }
    for extra in [None, Some("--extract")] {
        let mut c = Command::new(tool("fsck.erofs"));
        c.args(extra);
        for b in &blobs {
            let mut arg = std::ffi::OsString::from("--device=");
            arg.push(b);
            c.arg(arg);
        }
        c.arg(&meta);
        run(&mut c, TIMEOUT).code_is(0);
    }
}

/// Waits (bounded) until process `pid` is gone or a zombie.
pub fn process_exits(pid: u32, timeout: Duration) -> bool {
    let start = Instant::now();
    loop {
        match fs::read_to_string(format!("/proc/{pid}/stat")) {
            Err(_) => return true,
            Ok(stat)
                if stat
                    .rsplit_once(')')
                    .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')) =>
            {
                return true
            }
            Ok(_) => {}
        }
        if start.elapsed() > timeout {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

// ---------------------------------------------------------------------------
// registry

/// A throw-away registry (`tests/tools/registry.sh`), stopped on drop.
#[derive(Debug)]
pub struct Registry {
    dir: TestDir,
    /// Port on 127.0.0.1.
    pub port: u16,
}

impl Registry {
    /// Starts one; the script waits at most 20 s for it to answer, and the
    /// call itself is bounded by [`SHORT`].
    #[track_caller]
    pub fn start() -> Registry {
        Registry::start_in(TestDir::new("registry"))
    }

    /// Starts one serving a copy of `data`, the storage directory
    /// (`DIR/data`) of an earlier registry: images pushed once can be served
    /// by a fresh registry per test.
    #[track_caller]
    pub fn start_with_data(data: &Path) -> Registry {
        let dir = TestDir::new("registry");
        let mut c = command(
            "cp",
            [
                OsStr::new("-a"),
                data.as_os_str(),
                dir.join("data").as_os_str(),
            ],
        );
        run(&mut c, TIMEOUT).ok();
        Registry::start_in(dir)
    }

    /// Starts a pull-through cache of `remote` (distribution's proxy mode),
    /// with its access log in `registry.log`.
    #[track_caller]
    pub fn start_pull_through(remote: &Registry) -> Registry {
        let dir = TestDir::new("registry-mirror");
        let mut c = Registry::script("start", dir.path());
        c.env("PULL_THROUGH_OF", format!("http://{}", remote.host()));
        Registry::start_with(dir, c)
    }

    #[track_caller]
    fn start_in(dir: TestDir) -> Registry {
        let c = Registry::script("start", dir.path());
        Registry::start_with(dir, c)
    }

    #[track_caller]
    fn start_with(dir: TestDir, mut c: Command) -> Registry {
        let out = run(&mut c, SHORT);
        // Constructed before asserting so a half-started registry is stopped.
        let mut reg = Registry { dir, port: 0 };
        let out = out.ok();
        reg.port = out
            .stdout
            .trim()
            .lines()
            .last()
            .and_then(|l| l.trim().parse().ok())
            .unwrap_or_else(|| panic!("registry.sh start printed no port:\n{}", out.describe()));
        reg
    }

    fn script(cmd: &str, dir: &Path) -> Command {
        command(
            "bash",
            [
                repo_file("tests/tools/registry.sh").as_os_str(),
                OsStr::new(cmd),
                dir.as_os_str(),
            ],
        )
    }

    /// The registry's directory (`data/` is its storage, `registry.log`).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Stops the registry process (storage kept; [`Registry::restart`]
    /// brings it back on the same port).
    #[track_caller]
    pub fn stop(&self) {
        run(&mut Registry::script("stop", self.dir.path()), SHORT).ok();
    }

    /// Starts the registry again on its port and storage, e.g. after
    /// [`Registry::stop`]; waits until it answers.
    #[track_caller]
    pub fn restart(&self) {
        let mut c = Registry::script("start", self.dir.path());
        c.arg(self.port.to_string());
        let out = run(&mut c, SHORT).ok();
        assert_eq!(
            out.stdout.trim().lines().last(),
            Some(self.port.to_string().as_str()),
            "registry.sh did not restart on port {}:\n{}",
            self.port,
            out.describe()
        );
    }

    /// `127.0.0.1:PORT`.
    pub fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// `docker://127.0.0.1:PORT/REPO_TAG`.
    pub fn reference(&self, repo_tag: &str) -> String {
        format!("docker://{}/{repo_tag}", self.host())
    }

    /// Copies `layout:tag` in as `repo_tag` with skopeo, digests kept.
    pub fn push(&self, layout: &Path, tag: &str, repo_tag: &str) {
        let mut c = command(
            tool("skopeo"),
            [
                "copy".to_string(),
                "--quiet".to_string(),
                "--dest-tls-verify=false".to_string(),
                "--preserve-digests".to_string(),
                oci_ref(layout, tag),
                self.reference(repo_tag),
            ],
        );
        run(&mut c, TIMEOUT).ok();
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let mut c = command(
            "bash",
            [
                repo_file("tests/tools/registry.sh").as_os_str(),
                OsStr::new("stop"),
                self.dir.path().as_os_str(),
            ],
        );
        match try_run(&mut c, SHORT) {
            Ok(o) if o.status.success() => {}
            Ok(o) => eprintln!("warning: registry stop failed:\n{}", o.describe()),
            Err(e) => eprintln!("warning: registry stop: {e}"),
        }
    }
}

// ---------------------------------------------------------------------------
// background processes

/// A process running in the background (a server, a long reader), killed
/// and reaped on drop. Its stdout and stderr go to files in `log_dir`.
#[derive(Debug)]
pub struct Background {
    child: Option<std::process::Child>,
    /// What it is, for messages.
    pub label: String,
    /// Its stdout.
    pub stdout_path: PathBuf,
    /// Its stderr.
    pub stderr_path: PathBuf,
    cmdline: String,
}

impl Background {
    /// Spawns `cmd` (stdin from /dev/null) with output to
    /// `log_dir/LABEL.stdout` and `.stderr`.
    #[track_caller]
    pub fn spawn(label: &str, cmd: &mut Command, log_dir: &Path) -> Background {
        let stdout_path = log_dir.join(format!("{label}.stdout"));
        let stderr_path = log_dir.join(format!("{label}.stderr"));
        let create =
            |p: &Path| File::create(p).unwrap_or_else(|e| panic!("create {}: {e}", p.display()));
        let cmdline = format!("{cmd:?}");
        cmd.stdin(Stdio::null())
            .stdout(create(&stdout_path))
            .stderr(create(&stderr_path));
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {cmdline}: {e}"));
        Background {
            child: Some(child),
            label: label.to_string(),
            stdout_path,
            stderr_path,
            cmdline,
        }
    }

    /// Its pid.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, |c| c.id())
    }

    /// Whether it still runs (false once it exited).
    pub fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// Its output so far, for messages.
    pub fn describe(&self) -> String {
        let read = |p: &Path| tail(&fs::read_to_string(p).unwrap_or_default(), 6000);
        format!(
            "background {} (pid {}): {}\n--- stdout ---\n{}\n--- stderr ---\n{}\n--------------",
            self.label,
            self.pid(),
            self.cmdline,
            read(&self.stdout_path),
            read(&self.stderr_path)
        )
    }

    /// Kills (SIGKILL) and reaps it; returns how it ended.
    pub fn stop(&mut self) -> Option<ExitStatus> {
        let mut child = self.child.take()?;
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        let _ = child.kill();
        child.wait().ok()
    }

    /// Waits (bounded) for it to exit on its own; None on timeout.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let start = Instant::now();
        loop {
            let child = self.child.as_mut()?;
            if let Ok(Some(status)) = child.try_wait() {
                return Some(status);
            }
            if start.elapsed() > timeout {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        self.stop();
    }
}

// ---------------------------------------------------------------------------
// fixtures

fn fixture_root() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("lamina-fixtures")
}

/// Removes fixture dirs of earlier runs of this test binary whose process is
/// gone (each run builds its own, named `<binary>-<pid>`).
fn remove_stale_fixtures(root: &Path, stem: &str) {
    let Ok(entries) = fs::read_dir(root) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name.strip_prefix(&format!("{stem}-")) else {
            continue;
        };
        let Ok(pid) = pid.parse::<u32>() else {
            continue;
        };
        if pid != std::process::id()
            && !Path::new(&format!("/proc/{pid}")).exists()
            && mounts_under(&e.path()).is_empty()
        {
            let _ = fs::remove_dir_all(e.path());
        }
    }
}

/// The fixture directory of this test binary, built once on first use with
/// `tests/fixtures/mkimage.py all DIR`: `DIR/edge` (tags edge, edge-gz, and
/// `edge.docker.tar`), `DIR/hostile` (+ `hostile.json`), `DIR/misc`.
#[track_caller]
pub fn fixtures() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let root = fixture_root();
        fs::create_dir_all(&root).unwrap_or_else(|e| panic!("mkdir {}: {e}", root.display()));
        let stem = std::env::current_exe()
            .ok()
            .and_then(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "tests".into());
        remove_stale_fixtures(&root, &stem);
        let dir = root.join(format!("{stem}-{}", std::process::id()));
        if dir.exists() {
            fs::remove_dir_all(&dir).unwrap_or_else(|e| panic!("rm {}: {e}", dir.display()));
        }
        let out = python(
            "tests/fixtures/mkimage.py",
            [OsStr::new("all"), dir.as_os_str()],
            TIMEOUT,
        )
        .ok();
        for p in [
            "edge/index.json",
            "edge/edge.docker.tar",
            "hostile/hostile.json",
            "misc/index.json",
        ] {
            assert!(
                dir.join(p).is_file(),
                "mkimage.py did not write {p}:\n{}",
                out.describe()
            );
        }
        dir
    })
}

/// misc's `minimal` image converted into `t/out`, checked to have no
/// xattrs (its manifest says so, which the mounts act on): its reference.
pub fn converted_without_xattrs(t: &TestDir) -> String {
    let image = oci_ref(&t.join("out"), "minimal");
    let misc = fixtures().join("misc");
    let report = lamina(["convert", "--json", &oci_ref(&misc, "minimal"), &image])
        .ok()
        .json();
    assert_eq!(report["stats"]["xattr_inodes"], 0, "{report}");
    image
}

/// `python3 -c SCRIPT` chrooted into `root` (a Debian image's tree) prints
/// `ok`, with a clean environment.
#[track_caller]
pub fn python3_prints_ok(root: &Path, script: &str) {
    let mut chroot = command(
        tool("chroot"),
        [
            root.as_os_str(),
            "/usr/bin/python3".as_ref(),
            "-c".as_ref(),
            script.as_ref(),
        ],
    );
    chroot
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("LC_ALL", "C");
    let o = run(&mut chroot, TIMEOUT).ok();
    assert_eq!(
        o.stdout,
        "ok\n",
        "python3 in the image mounted at {}:\n{}",
        root.display(),
        o.describe()
    );
}

/// `FIX/edge` (an OCI layout with tags edge and edge-gz).
pub fn edge_layout() -> PathBuf {
    fixtures().join("edge")
}

/// treecmp options for comparing with umoci's unpack of edge: umoci drops
/// xattrs whose value is empty (Go's archive/tar reads an empty PAX value as
/// "unset"); compare with ociunpack.py, which keeps them, without ignores.
pub const UMOCI_IGNORES: &[&str] = &[
    "--ignore-xattr",
    "user.empty",
    "--ignore-xattr",
    "trusted.empty",
];

/// The rootfs of `umoci unpack --image FIX/edge:edge-gz`, built once per
/// test binary (umoci cannot read the zstd layers of tag edge).
#[track_caller]
pub fn umoci_edge_rootfs() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let bundle = fixtures().join("umoci-edge-gz");
        umoci_unpack(&format!("{}:edge-gz", edge_layout().display()), &bundle)
    })
}

/// `umoci unpack --image IMAGE BUNDLE`; returns `BUNDLE/rootfs`.
#[track_caller]
pub fn umoci_unpack(image: &str, bundle: &Path) -> PathBuf {
    let mut c = command(
        tool("umoci"),
        [
            OsStr::new("unpack"),
            OsStr::new("--image"),
            OsStr::new(image),
            bundle.as_os_str(),
        ],
    );
    run(&mut c, TIMEOUT).ok();
    let rootfs = bundle.join("rootfs");
    assert!(rootfs.is_dir(), "umoci unpack made no {}", rootfs.display());
    rootfs
}

/// The rootfs of `tests/tools/ociunpack.py LAYOUT:TAG`, built once per test
/// binary and image.
#[track_caller]
pub fn ociunpack(layout: &Path, tag: &str) -> PathBuf {
    static DONE: Mutex<BTreeMap<String, PathBuf>> = Mutex::new(BTreeMap::new());
    let key = format!("{}:{tag}", layout.display());
    let mut done = DONE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = done.get(&key) {
        return p.clone();
    }
    let dest = fixtures().join("ociunpack").join(format!(
        "{}-{tag}",
        layout.file_name().unwrap().to_string_lossy()
    ));
    if dest.exists() {
        fs::remove_dir_all(&dest).unwrap_or_else(|e| panic!("rm {}: {e}", dest.display()));
    }
    fs::create_dir_all(dest.parent().unwrap()).unwrap();
    python(
        "tests/tools/ociunpack.py",
        [OsStr::new(&key), dest.as_os_str()],
        TIMEOUT,
    )
    .ok();
    done.insert(key, dest.clone());
    dest
}

/// The parsed `FIX/hostile/hostile.json`.
pub fn hostile_descriptions() -> Vec<Value> {
    let p = fixtures().join("hostile/hostile.json");
    let v: Value = serde_json::from_slice(&fs::read(&p).unwrap()).unwrap();
    v.as_array().expect("hostile.json is an array").clone()
}

// ---------------------------------------------------------------------------
// comparing trees

/// Entries of a tree (the root included), not following symlinks.
pub fn count_entries(root: &Path) -> u64 {
    fn walk(p: &Path) -> u64 {
        let mut n = 1;
        if fs::symlink_metadata(p).is_ok_and(|m| m.is_dir()) {
            for e in fs::read_dir(p).unwrap_or_else(|e| panic!("readdir {}: {e}", p.display())) {
                n += walk(&e.unwrap().path());
            }
        }
        n
    }
    walk(root)
}

/// Regular files below `root` (relative paths), not following symlinks.
pub fn regular_files(root: &Path) -> Vec<PathBuf> {
    fn walk(root: &Path, p: &Path, out: &mut Vec<PathBuf>) {
        for e in fs::read_dir(p).unwrap_or_else(|e| panic!("readdir {}: {e}", p.display())) {
            let path = e.unwrap().path();
            let m = fs::symlink_metadata(&path).unwrap();
            if m.is_dir() {
                walk(root, &path, out);
            } else if m.is_file() {
                out.push(path.strip_prefix(root).unwrap().to_path_buf());
            }
        }
    }
    let mut out = Vec::new();
    walk(root, root, &mut out);
    out.sort();
    out
}

/// The edge fixture's POSIX ACL is enforced on the mount at `mnt` (whose
/// test dir `t` is opened to other users for it): user nobody reads
/// `xattrs/acl-nobody` (mode 0640, a named-user entry for nobody) and is
/// refused `xattrs/acl-control` (mode 0640, no ACL).
#[track_caller]
pub fn assert_edge_acl_enforced(t: &TestDir, mnt: &Path) {
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(t.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let cat_as_nobody = |file: &str| {
        let path = mnt.join("xattrs").join(file);
        let args = ["--reuid=65534", "--regid=65534", "--clear-groups", "cat"];
        let mut cmd = command("setpriv", args.iter().map(OsStr::new));
        cmd.arg(&path);
        run(&mut cmd, Duration::from_secs(30))
    };
    let granted = cat_as_nobody("acl-nobody").ok();
    assert_eq!(granted.stdout, "read through an ACL\n");
    let refused = cat_as_nobody("acl-control");
    assert!(
        !refused.status.success() && refused.stderr.contains("Permission denied"),
        "nobody read a 0640 file without an ACL:\n{}",
        refused.describe()
    );
}

/// `treecmp.py OPTS A B`: asserts exit 0 and the summary line
/// `treecmp: N entries compared, 0 differences` with N the entry count of A.
/// Returns N.
#[track_caller]
pub fn treecmp(opts: &[&str], a: &Path, b: &Path) -> u64 {
    let mut args: Vec<&OsStr> = opts.iter().map(OsStr::new).collect();
    args.push(a.as_os_str());
    args.push(b.as_os_str());
    let out = python("tests/tools/treecmp.py", args, TIMEOUT);
    assert_eq!(
        out.code(),
        Some(0),
        "trees differ ({} vs {}):\n{}",
        a.display(),
        b.display(),
        out.describe()
    );
    let last = out.stdout.lines().last().unwrap_or("");
    let n: u64 = last
        .strip_prefix("treecmp: ")
        .and_then(|r| r.strip_suffix(" entries compared, 0 differences"))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| {
            panic!(
                "unexpected treecmp summary line {last:?}:\n{}",
                out.describe()
            )
        });
    let expected = count_entries(a);
    assert_eq!(
        n,
        expected,
        "treecmp compared {n} entries, {} has {expected}:\n{}",
        a.display(),
        out.describe()
    );
    n
}

// ---------------------------------------------------------------------------
// OCI layouts

/// `tag -> manifest digest` of a layout's index.json (empty if absent).
pub fn layout_tags(dir: &Path) -> BTreeMap<String, String> {
    let Ok(bytes) = fs::read(dir.join("index.json")) else {
        return BTreeMap::new();
    };
    let v: Value = serde_json::from_slice(&bytes)
        .unwrap_or_else(|e| panic!("{}/index.json is not JSON: {e}", dir.display()));
    v["manifests"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| {
            Some((
                m["annotations"]["org.opencontainers.image.ref.name"]
                    .as_str()?
                    .to_string(),
                m["digest"].as_str()?.to_string(),
            ))
        })
        .collect()
}

/// Path of a blob in a layout.
pub fn blob_path(dir: &Path, digest: &str) -> PathBuf {
    let hex = digest
        .strip_prefix("sha256:")
        .unwrap_or_else(|| panic!("not a sha256 digest: {digest}"));
    dir.join("blobs/sha256").join(hex)
}

/// The manifest of `tag` in a layout.
#[track_caller]
pub fn read_manifest(dir: &Path, tag: &str) -> Value {
    let tags = layout_tags(dir);
    let digest = tags.get(tag).unwrap_or_else(|| {
        panic!(
            "tag {tag} not in {}/index.json (tags: {tags:?})",
            dir.display()
        )
    });
    serde_json::from_slice(&fs::read(blob_path(dir, digest)).unwrap()).unwrap()
}

/// sha256 hex of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest as _;
    sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Writes `bytes` as a blob of the layout `dir`; its digest.
pub fn put_blob(dir: &Path, bytes: &[u8]) -> String {
    let digest = format!("sha256:{}", sha256_hex(bytes));
    fs::write(blob_path(dir, &digest), bytes).unwrap();
    digest
}

/// Writes `manifest` into the layout `dir` and tags it `new_tag`, with the
/// index entry of `tag` (media type, platform) as its model.
pub fn tag_manifest(dir: &Path, tag: &str, new_tag: &str, manifest: &Value) {
    let bytes = serde_json::to_vec(manifest).unwrap();
    let digest = put_blob(dir, &bytes);
    let mut index: Value =
        serde_json::from_slice(&fs::read(dir.join("index.json")).unwrap()).unwrap();
    let entries = index["manifests"].as_array_mut().unwrap();
    let mut entry = entries
        .iter()
        .find(|m| m["annotations"]["org.opencontainers.image.ref.name"] == tag)
        .unwrap_or_else(|| panic!("tag {tag} not in {}/index.json", dir.display()))
        .clone();
    entry["digest"] = digest.into();
    entry["size"] = bytes.len().into();
    entry["annotations"]["org.opencontainers.image.ref.name"] = new_tag.into();
    entries.push(entry);
    fs::write(dir.join("index.json"), serde_json::to_vec(&index).unwrap()).unwrap();
}

/// sha256 hex of a file.
pub fn sha256_file(p: &Path) -> String {
    let mut f = File::open(p).unwrap_or_else(|e| panic!("open {}: {e}", p.display()));
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = f.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// Every path below `dir` (relative), with a type tag and for files the
/// size and sha256: a snapshot to compare before/after.
pub fn snapshot(dir: &Path) -> BTreeMap<PathBuf, String> {
    fn walk(root: &Path, p: &Path, out: &mut BTreeMap<PathBuf, String>) {
        let Ok(entries) = fs::read_dir(p) else { return };
        for e in entries.flatten() {
            let path = e.path();
            let rel = path.strip_prefix(root).unwrap().to_path_buf();
            let Ok(m) = fs::symlink_metadata(&path) else {
                continue;
            };
            if m.is_dir() {
                out.insert(rel, "dir".into());
                walk(root, &path, out);
            } else if m.is_file() {
                out.insert(rel, format!("file {} {}", m.len(), sha256_file(&path)));
            } else {
                out.insert(rel, format!("other {:o}", m.mode()));
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out
}

/// The differences between two snapshots, one line each.
pub fn snapshot_diff(
    before: &BTreeMap<PathBuf, String>,
    after: &BTreeMap<PathBuf, String>,
) -> Vec<String> {
    let mut d = Vec::new();
    for (p, v) in after {
        match before.get(p) {
            None => d.push(format!("added {} ({v})", p.display())),
            Some(b) if b != v => d.push(format!("changed {} ({b} -> {v})", p.display())),
            _ => {}
        }
    }
    for p in before.keys() {
        if !after.contains_key(p) {
            d.push(format!("removed {}", p.display()));
        }
    }
    d
}

/// Collects failed checks so one run reports all of them.
#[derive(Debug, Default)]
pub struct Failures(pub Vec<String>);

impl Failures {
    /// Records a failure when `cond` is false.
    pub fn check(&mut self, cond: bool, msg: impl FnOnce() -> String) {
        if !cond {
            self.0.push(msg());
        }
    }

    /// Panics with every recorded failure.
    #[track_caller]
    pub fn finish(self, what: &str) {
        if !self.0.is_empty() {
            panic!(
                "{what}: {} failed check(s):\n\n{}",
                self.0.len(),
                self.0.join("\n\n")
            );
        }
    }
}

// ---------------------------------------------------------------------------
// the fault proxy

/// A port on 127.0.0.1 that nothing listened on a moment ago.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// `tests/tools/faultproxy.py`, killed on drop (and bounded by its own
/// --lifetime and parent watchdog).
#[derive(Debug)]
pub struct FaultProxy {
    /// The proxy process.
    pub bg: Background,
    /// Its port on 127.0.0.1.
    pub port: u16,
    stats: PathBuf,
}

impl FaultProxy {
    /// Starts it on `listen` (0: any port) in front of `upstream`.
    #[track_caller]
    pub fn start(
        dir: &Path,
        label: &str,
        listen: u16,
        upstream: u16,
        mode: &str,
        extra: &[&str],
    ) -> FaultProxy {
        let port_file = dir.join(format!("{label}.port"));
        let stats = dir.join(format!("{label}.stats.json"));
        let _ = fs::remove_file(&port_file);
        let mut c = command(tool("python3"), [repo_file("tests/tools/faultproxy.py")]);
        c.args([listen.to_string(), upstream.to_string(), mode.to_string()])
            .arg("--port-file")
            .arg(&port_file)
            .arg("--stats")
            .arg(&stats)
            .args(["--lifetime", "600"])
            .args(extra);
        let mut bg = Background::spawn(label, &mut c, dir);
        let port = wait_port_file(&mut bg, &port_file, "faultproxy");
        FaultProxy { bg, port, stats }
    }

    /// Its counters (`requests`, `eligible`, `faults`), `null` before the first request.
    pub fn stats(&self) -> Value {
        fs::read(&self.stats)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or(Value::Null)
    }
}

/// `GET /metrics` over HTTP/1.1 on `addr`: the body.
pub fn scrape(addr: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap_or_else(|e| panic!("{addr}: {e}"));
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    std::io::Write::write_all(
        &mut s,
        format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    assert!(out.starts_with("HTTP/1.1 200"), "scrape of {addr}:\n{out}");
    out.split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default()
}

/// The value of the sample `series` (name and labels, exactly) in `text`.
pub fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// The EROFS reader (what the FUSE path serves from) against the kernel's
/// mount of the same metadata and blobs, entry by entry: type and mode,
/// owner, size, mtime, link count, device numbers, symlink targets,
/// directory listings, every xattr with its value (empty ones included),
/// and every regular file's bytes read through the chunk table from the
/// blob caches. The mount must be complete (not lazy). Returns the number
/// of entries compared.
#[track_caller]
pub fn reader_matches_kernel(m: &Mount) -> u64 {
    use lamina_format::erofs::{Chunk, Image, Kind};
    let meta = fs::read(m.metadata_path()).expect("read the metadata image");
    let img = Image::new(&meta).unwrap_or_else(|e| panic!("reader refuses the image: {e}"));
    let blobs: Vec<File> = m
        .blob_paths()
        .iter()
        .map(|p| File::open(p).unwrap())
        .collect();
    let mut stack = vec![(m.path.clone(), img.root_nid())];
    let mut compared = 0u64;
    while let Some((path, nid)) = stack.pop() {
        let inode = img
            .inode(nid)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let st = fs::symlink_metadata(&path).unwrap();
        let at = path.display();
        assert_eq!(inode.mode, st.mode(), "{at}: mode");
        assert_eq!((inode.uid, inode.gid), (st.uid(), st.gid()), "{at}: owner");
        assert_eq!(u64::from(inode.nlink), st.nlink(), "{at}: nlink");
        assert_eq!(
            (inode.mtime, i64::from(inode.mtime_nsec)),
            (st.mtime(), st.mtime_nsec()),
            "{at}: mtime"
        );
        assert_eq!(inode.size, st.size(), "{at}: size");
        let xattrs: BTreeMap<Vec<u8>, Vec<u8>> = img
            .xattrs(&inode)
            .unwrap()
            .into_iter()
            .map(|(k, v)| (k, v.to_vec()))
            .collect();
        assert_eq!(xattrs, kernel_xattrs(&path), "{at}: xattrs");
        match inode.kind().expect("a file type") {
            Kind::Directory => {
                let listed = img.entries(&inode).unwrap();
                let mut names: Vec<Vec<u8>> = listed
                    .iter()
                    .filter(|e| e.name != b"." && e.name != b"..")
                    .map(|e| e.name.to_vec())
                    .collect();
                let mut kernel: Vec<Vec<u8>> = fs::read_dir(&path)
                    .unwrap()
                    .map(|e| e.unwrap().file_name().into_encoded_bytes())
                    .collect();
                names.sort();
                kernel.sort();
                assert_eq!(names, kernel, "{at}: entries");
                for e in listed.iter().filter(|e| e.name != b"." && e.name != b"..") {
                    let found = img.lookup(&inode, e.name).unwrap();
                    assert_eq!(found, Some(*e), "{at}: lookup of {:?}", e.name);
                    let name = OsStr::from_bytes(e.name);
                    stack.push((path.join(name), e.nid));
                }
            }
            Kind::Symlink => {
                let target = img.symlink_target(&inode).unwrap();
                assert_eq!(
                    target,
                    fs::read_link(&path)
                        .unwrap()
                        .into_os_string()
                        .into_encoded_bytes(),
                    "{at}"
                );
            }
            Kind::Regular => {
                let chunks = img.chunks(&inode).unwrap();
                let want = fs::read(&path).unwrap();
                let mut got = Vec::with_capacity(want.len());
                let chunk = 1u64 << chunks.chunk_bits;
                for i in 0..chunks.len() {
                    let len = chunk.min(inode.size - i as u64 * chunk) as usize;
                    match chunks.get(i).unwrap() {
                        Chunk::Hole => got.resize(got.len() + len, 0),
                        Chunk::Data { device, offset } => {
                            let mut buf = vec![0u8; len];
                            std::os::unix::fs::FileExt::read_exact_at(
                                &blobs[usize::from(device) - 1],
                                &mut buf,
                                offset,
                            )
                            .unwrap();
                            got.extend_from_slice(&buf);
                        }
                    }
                }
                assert!(
                    got == want,
                    "{at}: content read through the chunk table differs"
                );
            }
            Kind::CharDevice | Kind::BlockDevice => {
                let (major, minor) = inode.rdev();
                assert_eq!(
                    (major, minor),
                    (rustix::fs::major(st.rdev()), rustix::fs::minor(st.rdev())),
                    "{at}: rdev"
                );
            }
            Kind::Fifo | Kind::Socket => {}
        }
        compared += 1;
    }
    compared
}

/// Every xattr of `path` (not following a symlink) with its value.
fn kernel_xattrs(path: &Path) -> BTreeMap<Vec<u8>, Vec<u8>> {
    let mut names = vec![0u8; 64 << 10];
    let n = rustix::fs::llistxattr(path, &mut names[..]).unwrap();
    let mut out = BTreeMap::new();
    for name in names[..n].split(|&b| b == 0).filter(|n| !n.is_empty()) {
        let mut value = vec![0u8; 64 << 10];
        let cname = std::ffi::CString::new(name).unwrap();
        let len = rustix::fs::lgetxattr(path, cname.as_c_str(), &mut value[..]).unwrap();
        value.truncate(len);
        out.insert(name.to_vec(), value);
    }
    out
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
