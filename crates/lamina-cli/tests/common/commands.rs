//! Running things: root and tools ([`require`]), commands with a deadline
//! ([`run`], [`lamina`], [`python`]) and processes in the background.

use std::ffi::OsStr;
use std::fs::{self, File};
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use super::{repo_file, LAMINA, TIMEOUT};
use serde_json::Value;

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
