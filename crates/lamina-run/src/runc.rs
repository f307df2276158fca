//! Driving runc: `run` in the foreground, `kill`, `delete`, and telling
//! runc's own failures apart from the container's exit status.

use std::fs;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};

/// One runc binary and the state root lamina's containers share
/// (`runc --root`), so `runc --root ROOT list` shows them all.
#[derive(Debug, Clone)]
pub(crate) struct Runc {
    pub bin: PathBuf,
    pub root: PathBuf,
}

/// How runc's stdio is wired.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Stdio3 {
    /// Pass lamina's stdin on (`-i`); otherwise /dev/null.
    pub stdin: bool,
    /// runc gets a process group of its own: a terminal's Ctrl-C then
    /// reaches only lamina, which stops the container its own way. Not
    /// with a terminal or stdin: runc must stay in the foreground group to
    /// read from the terminal.
    pub own_group: bool,
}

impl Runc {
    fn command(&self, log: Option<&Path>) -> Command {
        let mut c = Command::new(&self.bin);
        c.arg("--root").arg(&self.root);
        if let Some(log) = log {
            c.arg("--log").arg(log).args(["--log-format", "json"]);
        }
        c
    }

    /// Starts `runc run` in the foreground (it exits with the container).
    pub fn spawn_run(
        &self,
        bundle: &Path,
        id: &str,
        log: &Path,
        io: Stdio3,
    ) -> std::io::Result<Child> {
        let mut c = self.command(Some(log));
        c.arg("run").arg("--bundle").arg(bundle).arg(id);
        if !io.stdin {
            c.stdin(Stdio::null());
        }
        if io.own_group {
            c.process_group(0);
        }
        c.spawn()
    }

    /// `runc kill ID SIGNAL`; false when runc refused (e.g. the container
    /// is not created yet or already gone).
    pub fn kill(&self, id: &str, signal: &str) -> bool {
        self.quiet(&["kill", id, signal])
    }

    /// `runc delete --force ID`; false when there was nothing to delete.
    pub fn delete(&self, id: &str) -> bool {
        self.quiet(&["delete", "--force", id])
    }

    /// Whether runc still has state for `id`.
    pub fn exists(&self, id: &str) -> bool {
        self.root.join(id).exists()
    }

    fn quiet(&self, args: &[&str]) -> bool {
        self.command(None)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }
}

/// The exit code `runc run` ended with, as a shell reports it: a death by
/// signal N is 128 + N.
pub(crate) fn exit_code(status: ExitStatus) -> i32 {
    match (status.code(), status.signal()) {
        (Some(code), _) => code,
        (None, Some(sig)) => 128 + sig,
        (None, None) => 125,
    }
}

/// Why runc itself failed, from its JSON log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// docker's code: 127 the command was not found, 126 it could not be
    /// executed, 125 anything else.
    pub code: u8,
    /// runc's message.
    pub message: String,
}

/// Reads runc's log after a non-zero exit. A container that exits with
/// status 1 leaves no error there; a container that runc could not start
/// leaves `runc run failed: ...`.
pub(crate) fn failure(log: &Path) -> Option<Failure> {
    classify(&fs::read_to_string(log).ok()?)
}

pub(crate) fn classify(log: &str) -> Option<Failure> {
    let message = log
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| matches!(v["level"].as_str(), Some("error" | "fatal")))
        .filter_map(|v| v["msg"].as_str().map(str::to_string))
        .next_back()?;
    // runc words exec failures as `exec: "ARG0": <reason>`; other reasons
    // (a mount that failed, say) are runc's and map to 125.
    let exec = message.split_once("exec: ").map(|(_, rest)| rest);
    let code = match exec {
        Some(r) if r.contains("executable file not found") => 127,
        Some(r) if r.contains("no such file or directory") => 127,
        Some(r) if r.contains("permission denied") || r.contains("exec format error") => 126,
        _ => 125,
    };
    Some(Failure { code, message })
}

#[cfg(test)]
mod tests {
    use super::*;

    // Lines as runc 1.1.5 writes them with --log-format json.
    #[test]
    fn exec_failures_map_to_docker_codes() {
        let log = r#"{"level":"error","msg":"runc run failed: unable to start container process: exec: \"nope\": executable file not found in $PATH","time":"2026-11-23T07:29:38Z"}"#;
        assert_eq!(classify(log).map(|f| f.code), Some(127));
        let log = r#"{"level":"error","msg":"runc run failed: unable to start container process: exec: \"/nope\": stat /nope: no such file or directory","time":"t"}"#;
        assert_eq!(classify(log).map(|f| f.code), Some(127));
        let log = r#"{"level":"error","msg":"runc run failed: unable to start container process: exec: \"/etc/passwd\": permission denied","time":"t"}"#;
        let f = classify(log).unwrap();
        assert_eq!(f.code, 126);
        assert!(f.message.contains("/etc/passwd"));
    }

    #[test]
    fn other_runc_failures_are_125_and_no_error_is_none() {
        let log = "{\"level\":\"warning\",\"msg\":\"x\"}\n\
            {\"level\":\"error\",\"msg\":\"runc run failed: error mounting \\\"/x\\\": no such file or directory\"}\n";
        assert_eq!(classify(log).map(|f| f.code), Some(125));
        assert_eq!(classify("{\"level\":\"warning\",\"msg\":\"x\"}\n"), None);
        assert_eq!(classify(""), None);
        assert_eq!(classify("not json\n"), None);
    }

    #[test]
    fn signals_are_128_plus() {
        assert_eq!(exit_code(ExitStatus::from_raw(3 << 8)), 3);
        assert_eq!(exit_code(ExitStatus::from_raw(9)), 137);
    }
}
