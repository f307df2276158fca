//! Docker credential helpers: `docker-credential-<name> get` reads the
//! server URL on stdin and answers `{"ServerURL","Username","Secret"}` on
//! stdout, or exits non-zero saying "credentials not found".
//!
//! A helper is someone else's program: its output is bounded, it gets a
//! deadline and is killed when it passes it, with every process it started
//! (it runs in a process group of its own, and the group is killed).

use std::ffi::OsStr;
use std::io::{self, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::time::{Duration, Instant};

use serde::Deserialize;

use super::creds::Credentials;

/// How long a helper may take (it may be waiting on a keyring unlock).
pub(crate) const HELPER_TIMEOUT: Duration = Duration::from_secs(30);
/// Largest answer read from a helper (stdout and stderr each).
pub(crate) const MAX_HELPER_OUTPUT: u64 = 64 << 10;
/// The `Username` by which a helper marks `Secret` as an identity token.
const TOKEN_USERNAME: &str = "<token>";

/// Why a credential helper gave no usable answer.
#[derive(Debug, thiserror::Error)]
pub(crate) enum HelperError {
    /// The helper name would not make a plain program name.
    #[error("invalid credential helper name {0:?}")]
    BadName(String),
    /// No such program on PATH.
    #[error("{program} not found on PATH")]
    NotFound {
        /// `docker-credential-<name>`.
        program: String,
    },
    /// Spawning or waiting for it failed.
    #[error("{program}: {source}")]
    Run {
        /// The program.
        program: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// It did not finish in time and was killed.
    #[error("{program} did not answer within {} s and was killed", timeout.as_secs_f32())]
    Timeout {
        /// The program.
        program: PathBuf,
        /// The deadline it had.
        timeout: Duration,
    },
    /// It wrote more than [`MAX_HELPER_OUTPUT`] bytes and was killed.
    #[error("{program} wrote more than {MAX_HELPER_OUTPUT} bytes and was killed")]
    TooLarge {
        /// The program.
        program: PathBuf,
    },
    /// It exited non-zero for another reason than "credentials not found".
    #[error("{program} get failed ({status}): {output}")]
    Failed {
        /// The program.
        program: PathBuf,
        /// Its exit status.
        status: ExitStatus,
        /// The start of what it printed.
        output: String,
    },
    /// Its answer is not the expected JSON.
    #[error("{program} get answered with invalid JSON: {source}")]
    BadAnswer {
        /// The program.
        program: PathBuf,
        /// The parser's error.
        source: serde_json::Error,
    },
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct Answer {
    #[serde(default)]
    username: String,
    #[serde(default)]
    secret: String,
}

/// Ask helper `name` for the credentials of `server_url`, searching `path`
/// (a `PATH` value) for `docker-credential-<name>`. `Ok(None)`: the helper
/// has none (anonymous access).
pub(crate) fn helper_get(
    name: &str,
    server_url: &str,
    path: Option<&OsStr>,
    timeout: Duration,
) -> Result<Option<Credentials>, HelperError> {
    let valid = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    if name.is_empty() || !name.chars().all(valid) || name.starts_with('.') {
        return Err(HelperError::BadName(name.to_string()));
    }
    let program_name = format!("docker-credential-{name}");
    let program = find_program(&program_name, path).ok_or(HelperError::NotFound {
        program: program_name,
    })?;
    let out = run_bounded(&program, server_url.as_bytes(), timeout)?;
    if !out.status.success() {
        let stdout = String::from_utf8_lossy(&out.stdout);
        if stdout.contains("credentials not found") {
            return Ok(None);
        }
        return Err(HelperError::Failed {
            program,
            status: out.status,
            output: excerpt(&out.stdout, &out.stderr),
        });
    }
    let answer: Answer = serde_json::from_slice(&out.stdout)
        .map_err(|source| HelperError::BadAnswer { program, source })?;
    Ok(match answer {
        Answer { secret, .. } if secret.is_empty() => None,
        Answer { username, secret } if username == TOKEN_USERNAME => {
            Some(Credentials::IdentityToken(secret))
        }
        Answer { username, secret } => Some(Credentials::Basic {
            username,
            password: secret,
        }),
    })
}

/// The first executable `name` in the directories of `path`. Relative
/// entries are skipped: they would run whatever the working directory holds.
fn find_program(name: &str, path: Option<&OsStr>) -> Option<PathBuf> {
    std::env::split_paths(path?)
        .filter(|dir| dir.is_absolute())
        .map(|dir| dir.join(name))
        .find(|p| {
            std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// What a failing helper printed, shortened (its error, not a secret).
fn excerpt(stdout: &[u8], stderr: &[u8]) -> String {
    let text = format!(
        "{} {}",
        String::from_utf8_lossy(stdout).trim(),
        String::from_utf8_lossy(stderr).trim()
    );
    let text = text.trim();
    match text.char_indices().nth(300) {
        Some((i, _)) => format!("{}...", text.get(..i).unwrap_or(text)),
        None if text.is_empty() => "no output".to_string(),
        None => text.to_string(),
    }
}

struct Finished {
    status: ExitStatus,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
}

/// Run `program get` with `input` on stdin, bounded in output and time.
fn run_bounded(program: &Path, input: &[u8], timeout: Duration) -> Result<Finished, HelperError> {
    let deadline = Instant::now() + timeout;
    let run_err = |source| HelperError::Run {
        program: program.to_path_buf(),
        source,
    };
    let mut child = Command::new(program)
        .arg("get")
        // Its own group: a child it leaves behind goes when it is killed.
        .process_group(0)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(run_err)?;
    let stdout = read_in_background(child.stdout.take());
    let stderr = read_in_background(child.stderr.take());
    if let Some(mut stdin) = child.stdin.take() {
        // A helper that exits without reading is judged by its answer.
        let _ = stdin.write_all(input);
    }
    let left = deadline.saturating_duration_since(Instant::now());
    let Ok(stdout) = stdout.recv_timeout(left) else {
        kill(&mut child);
        return Err(HelperError::Timeout {
            program: program.to_path_buf(),
            timeout,
        });
    };
    if stdout.len() as u64 > MAX_HELPER_OUTPUT {
        kill(&mut child);
        return Err(HelperError::TooLarge {
            program: program.to_path_buf(),
        });
    }
    let status = wait_until(&mut child, deadline).map_err(run_err)?;
    let Some(status) = status else {
        return Err(HelperError::Timeout {
            program: program.to_path_buf(),
            timeout,
        });
    };
    let stderr = stderr
        .recv_timeout(Duration::from_millis(200))
        .unwrap_or_default();
    Ok(Finished {
        status,
        stdout,
        stderr,
    })
}

/// Read up to one byte more than [`MAX_HELPER_OUTPUT`] on a thread (so the
/// excess is seen); the result arrives at end of file or at the limit.
fn read_in_background<R: Read + Send + 'static>(pipe: Option<R>) -> Receiver<Vec<u8>> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        if let Some(pipe) = pipe {
            let _ = pipe.take(MAX_HELPER_OUTPUT + 1).read_to_end(&mut buf);
        }
        let _ = tx.send(buf);
    });
    rx
}

/// Wait for the child until `deadline`; past it, kill it (`Ok(None)`).
fn wait_until(child: &mut Child, deadline: Instant) -> io::Result<Option<ExitStatus>> {
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(Some(status));
        }
        if Instant::now() >= deadline {
            kill(child);
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn kill(child: &mut Child) {
    if let Some(group) = rustix::process::Pid::from_raw(child.id() as i32) {
        let _ = rustix::process::kill_process_group(group, rustix::process::Signal::KILL);
    }
    let _ = child.kill();
    let _ = child.wait();
}
