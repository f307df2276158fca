//! Lazy mounts' daemons: what every test starts with, the run dir's logs
//! and status, `lamina status` waits, and the daemons' processes.

use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::common::*;
use crate::fixture::{debian, Debian};
use crate::{Timer, TOOLS};
use serde_json::Value;

// ---------------------------------------------------------------------------
// lazy mounts: run dir, status, daemon processes

/// The log of the daemon in the holder's place: the holder (kernel path)
/// or the FUSE daemon.
pub(crate) fn relay_log(rd: &Path) -> String {
    ["holder.log", "fuse.log"]
        .iter()
        .find_map(|name| fs::read_to_string(rd.join(name)).ok())
        .unwrap_or_default()
}

/// The tails of the holder's (or FUSE daemon's) and worker's logs, for
/// messages.
pub(crate) fn daemon_logs(rd: &Path) -> String {
    let mut s = String::new();
    for name in ["holder.log", "fuse.log", "worker.log"] {
        let Ok(text) = fs::read_to_string(rd.join(name)) else {
            continue;
        };
        let lines: Vec<&str> = text.lines().collect();
        let from = lines.len().saturating_sub(30);
        s.push_str(&format!(
            "--- {name} ({} lines, last 30) ---\n{}\n",
            lines.len(),
            lines[from..].join("\n")
        ));
    }
    s
}

/// `status.json` of the run dir as the worker last wrote it.
pub(crate) fn status_file(rd: &Path) -> Option<Value> {
    serde_json::from_slice(&fs::read(rd.join("status.json")).ok()?).ok()
}

/// Appends diagnostics (daemon logs...) to the last recorded failure.
/// What every lazy test starts with: the reference image in a registry of
/// its own and a scratch directory (`None`: tools missing, test skipped).
pub(crate) struct Lazy {
    pub(crate) _time: Timer,
    pub(crate) deb: &'static Debian,
    pub(crate) reg: Registry,
    pub(crate) t: TestDir,
}

pub(crate) fn start(test: &'static str, dir: &str) -> Option<Lazy> {
    let _time = Timer(test, Instant::now());
    if !require(TOOLS) {
        return None;
    }
    let deb = debian();
    let reg = Registry::start_with_data(&deb.registry_data);
    Some(Lazy {
        _time,
        deb,
        reg,
        t: TestDir::new(dir),
    })
}

/// Fails the test if any check failed, with the daemons' logs (and
/// `extra`, e.g. a proxy's log) attached to the last failure.
pub(crate) fn finish_with_logs(
    mut f: Failures,
    rd: &Path,
    extra: impl FnOnce() -> String,
    what: &str,
) {
    if !f.0.is_empty() {
        let extra = extra();
        let logs = daemon_logs(rd);
        attach(
            &mut f,
            &if extra.is_empty() {
                logs
            } else {
                format!("{logs}\n{extra}")
            },
        );
    }
    f.finish(what);
}

fn attach(f: &mut Failures, text: &str) {
    if let Some(last) = f.0.last_mut() {
        last.push_str("\n\n");
        last.push_str(text);
    }
}

/// A number of a status document.
#[track_caller]
pub(crate) fn num(s: &Value, key: &str) -> u64 {
    s[key]
        .as_u64()
        .unwrap_or_else(|| panic!("no number {key:?} in status {s}"))
}

/// The mount's live figures from `lamina status --json` once `pred` holds;
/// panics (with the daemon logs) if it does not within `timeout`.
#[track_caller]
pub(crate) fn wait_status(
    m: &Mount,
    what: &str,
    timeout: Duration,
    pred: impl Fn(&Value) -> bool,
) -> Value {
    let start = Instant::now();
    loop {
        let entry = m.status();
        let s = entry
            .as_ref()
            .map(|e| e["status"].clone())
            .unwrap_or(Value::Null);
        if s.is_object() && pred(&s) {
            return s;
        }
        if start.elapsed() > timeout {
            panic!(
                "{what}: not reached within {} s; last `lamina status` entry: {}\n{}",
                timeout.as_secs(),
                entry.map_or("none".into(), |e| e.to_string()),
                daemon_logs(&run_dir(m))
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The figures after they settled: status.json is rewritten every 200 ms,
/// so anything done before this call is counted.
#[track_caller]
pub(crate) fn settled_status(m: &Mount) -> Value {
    std::thread::sleep(Duration::from_millis(700));
    wait_status(m, "status", Duration::from_secs(10), |_| true)
}

/// Whether every blob of a status is complete and all bytes are cached.
pub(crate) fn fully_cached(s: &Value) -> bool {
    s["cached_bytes"] == s["total_bytes"]
        && s["blobs"]
            .as_array()
            .is_some_and(|b| !b.is_empty() && b.iter().all(|b| b["complete"] == true))
}

pub(crate) fn pid_alive(pid: u32) -> bool {
    !process_exits(pid, Duration::ZERO)
}

pub(crate) fn kill9(pid: u32) {
    let p = rustix::process::Pid::from_raw(pid as i32).expect("pid > 0");
    rustix::process::kill_process(p, rustix::process::Signal::KILL)
        .unwrap_or_else(|e| panic!("kill -9 {pid}: {e}"));
}

pub(crate) fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1 << 20) as f64)
}
