//! Starting a mount's daemons (holder, FUSE daemon) and waiting for them
//! to report; reaping those that exit.

use std::fs;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use lamina_daemon::holder::Ready;
use lamina_fetch::private;

use crate::common::{io_err, MountError};

/// The daemons this process started that outlive their start (holders,
/// FUSE daemons): a long-lived process (the snapshotter) reaps exactly
/// these ([`reap_daemons`]), never a child another thread waits for.
static STARTED: std::sync::Mutex<Vec<Child>> = std::sync::Mutex::new(Vec::new());

/// Reaps the daemons this process started that have exited; returns how
/// many.
pub fn reap_daemons() -> usize {
    let mut started = STARTED.lock().unwrap_or_else(|p| p.into_inner());
    let before = started.len();
    started.retain_mut(|c| matches!(c.try_wait(), Ok(None)));
    before - started.len()
}

/// Starts this binary's `subcommand CONFIG` (a mount daemon, `what` in
/// messages) with its output in `log_path`, and waits until it has written
/// the `ready` file next to its config: Ok once mounted, its error
/// otherwise, or why it never reported (it exited: its log; 60 s passed).
pub(crate) fn start_daemon(
    subcommand: &str,
    config_path: &Path,
    log_path: &Path,
    what: &str,
) -> Result<(), MountError> {
    let log = private::create_new(log_path).map_err(io_err(log_path))?;
    let mut daemon = Command::new(lamina_sys::OWN_BINARY)
        .arg0("lamina")
        .arg(subcommand)
        .arg(config_path)
        .stdin(Stdio::null())
        .stdout(log.try_clone().map_err(io_err(log_path))?)
        .stderr(log)
        .spawn()
        .map_err(io_err(config_path))?;
    let ready_path = config_path.with_file_name("ready");
    let result = wait_ready(&mut daemon, &ready_path, log_path, what);
    // Running (serving, or left running): reaped by `reap_daemons`.
    if matches!(daemon.try_wait(), Ok(None)) {
        STARTED
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(daemon);
    }
    result
}

fn wait_ready(
    daemon: &mut Child,
    ready_path: &Path,
    log_path: &Path,
    what: &str,
) -> Result<(), MountError> {
    let started = Instant::now();
    loop {
        if let Ok(bytes) = fs::read(ready_path) {
            let ready: Ready = serde_json::from_slice(&bytes)
                .map_err(|e| MountError::Daemon(format!("bad ready file: {e}")))?;
            if let Some(err) = ready.error {
                let _ = daemon.wait();
                return Err(MountError::Daemon(err));
            }
            return Ok(());
        }
        if let Ok(Some(status)) = daemon.try_wait() {
            let log = fs::read_to_string(log_path).unwrap_or_default();
            return Err(MountError::Daemon(format!(
                "{what} exited ({status}) before mounting: {}",
                log.trim()
            )));
        }
        if started.elapsed() > Duration::from_secs(60) {
            // Never killed: if it has mounted by now, its death would let
            // readers see holes as zeros (or a dead FUSE mount). It exits by
            // itself once unmounted.
            return Err(MountError::Daemon(format!(
                "{what} (pid {}) did not report in 60 s; it is left running, see {}",
                daemon.id(),
                log_path.display()
            )));
        }
        // Short: every start of a container waits here.
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Whether `pid` is a lamina daemon (`internal-holder`, `-worker`,
/// `-fuse`), not whatever process took its number since.
pub(crate) fn is_lamina_daemon(pid: u32) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .is_ok_and(|c| c.split(|b| *b == 0).any(|a| a.starts_with(b"internal-")))
}
