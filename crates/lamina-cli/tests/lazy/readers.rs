//! Readers in child processes: the hashing reader (`hash_files`,
//! `check_reads`) and the image's own programs (python3, TCP servers).

use std::collections::BTreeMap;
use std::fs;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::common::*;
use crate::fixture::Debian;
use serde_json::Value;

// ---------------------------------------------------------------------------
// hashing readers

/// Reads the listed files (relative to argv[1]) and writes one JSON line per
/// file: sha256 or errno, and the seconds the read took.
const HASHER: &str = r#"
import hashlib, json, os, sys, time
root, listfile, outfile = sys.argv[1:4]
with open(listfile) as f:
    paths = json.load(f)
with open(outfile, "w") as out:
    for p in paths:
        t0 = time.monotonic()
        h = hashlib.sha256()
        rec = {"path": p}
        try:
            with open(os.path.join(root, p), "rb") as f:
                while True:
                    b = f.read(1 << 20)
                    if not b:
                        break
                    h.update(b)
            rec["sha256"] = h.hexdigest()
        except OSError as e:
            rec["errno"] = e.errno
            rec["error"] = str(e)
        rec["secs"] = time.monotonic() - t0
        out.write(json.dumps(rec) + "\n")
        out.flush()
"#;

fn hasher_script() -> &'static Path {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| {
        let p = fixtures().join("lazy-hasher.py");
        fs::write(&p, HASHER).unwrap();
        p
    })
}

/// What reading one file gave.
#[derive(Debug, Clone)]
pub(crate) struct FileRead {
    pub(crate) sha256: Option<String>,
    pub(crate) errno: Option<i64>,
    pub(crate) error: String,
    pub(crate) secs: f64,
}

fn parse_reads(out: &Path) -> BTreeMap<String, FileRead> {
    let text = fs::read_to_string(out).unwrap_or_default();
    text.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .map(|v| {
            (
                v["path"].as_str().unwrap_or_default().to_string(),
                FileRead {
                    sha256: v["sha256"].as_str().map(str::to_string),
                    errno: v["errno"].as_i64(),
                    error: v["error"].as_str().unwrap_or_default().to_string(),
                    secs: v["secs"].as_f64().unwrap_or(0.0),
                },
            )
        })
        .collect()
}

/// Reads `files` below `root` in one python3 process (killed at `deadline`).
/// Err when it did not finish: a hung read, with the file it was stuck on.
pub(crate) fn hash_files(
    root: &Path,
    files: &[String],
    work: &Path,
    label: &str,
    deadline: Duration,
) -> Result<BTreeMap<String, FileRead>, String> {
    let list = work.join(format!("{label}.list.json"));
    let out = work.join(format!("{label}.reads.jsonl"));
    fs::write(&list, serde_json::to_vec(files).unwrap()).unwrap();
    let mut c = command(
        tool("python3"),
        [
            hasher_script().as_os_str(),
            root.as_os_str(),
            list.as_os_str(),
            out.as_os_str(),
        ],
    );
    let res = try_run(&mut c, deadline);
    let got = parse_reads(&out);
    match res {
        Ok(o) if o.status.success() && got.len() == files.len() => Ok(got),
        Ok(o) => Err(format!(
            "{label}: the reader failed ({} of {} files read):\n{}",
            got.len(),
            files.len(),
            o.describe()
        )),
        Err(e) => Err(format!(
            "{label}: reading {} files did not finish within {} s: {} done, stuck at {:?}\n{e}",
            files.len(),
            deadline.as_secs(),
            got.len(),
            files.iter().find(|f| !got.contains_key(*f))
        )),
    }
}

/// [`hash_files`] on a thread, for reads that run while the test acts.
pub(crate) fn hash_in_background(
    root: &Path,
    files: Vec<String>,
    work: &Path,
    label: &str,
    deadline: Duration,
) -> JoinHandle<Result<BTreeMap<String, FileRead>, String>> {
    let (root, work, label) = (root.to_path_buf(), work.to_path_buf(), label.to_string());
    std::thread::spawn(move || hash_files(&root, &files, &work, &label, deadline))
}

/// Records a failure for every file of `files` that was not read back equal
/// to the reference (wrong bytes, an error, or not read at all).
pub(crate) fn check_reads(
    f: &mut Failures,
    what: &str,
    deb: &Debian,
    files: &[String],
    got: &BTreeMap<String, FileRead>,
) {
    let mut bad = Vec::new();
    let mut wrong = 0;
    for p in files {
        let want = &deb.hashes[p];
        match got.get(p) {
            None => bad.push(format!("{p}: not read")),
            Some(FileRead {
                sha256: Some(h), ..
            }) if h == want => {}
            Some(FileRead {
                sha256: Some(h), ..
            }) => {
                wrong += 1;
                bad.push(format!("{p}: WRONG BYTES (sha256 {h}, reference {want})"));
            }
            Some(r) => bad.push(format!(
                "{p}: read failed after {:.1} s: errno {:?}: {}",
                r.secs, r.errno, r.error
            )),
        }
    }
    f.check(bad.is_empty(), || {
        format!(
            "{what}: {} of {} files not read back equal to the reference ({wrong} with wrong bytes):\n  {}{}",
            bad.len(),
            files.len(),
            bad.iter().take(25).cloned().collect::<Vec<_>>().join("\n  "),
            if bad.len() > 25 { "\n  ..." } else { "" }
        )
    });
}

// ---------------------------------------------------------------------------
// programs in the image

/// `chroot ROOT /usr/bin/python3 -c 'print("ok")'`, asserting it prints ok.
#[track_caller]
pub(crate) fn chroot_python(root: &Path) -> Output {
    let mut c = command(
        tool("chroot"),
        [
            root.as_os_str(),
            "/usr/bin/python3".as_ref(),
            "-c".as_ref(),
            "print(\"ok\")".as_ref(),
        ],
    );
    c.env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("LC_ALL", "C");
    let o = run(&mut c, TIMEOUT).ok();
    assert_eq!(
        o.stdout,
        "ok\n",
        "python3 in the lazy mount:\n{}",
        o.describe()
    );
    o
}

/// Waits until something accepts on 127.0.0.1:`port` while `bg` runs.
#[track_caller]
pub(crate) fn wait_tcp(port: u16, bg: &mut Background, timeout: Duration) {
    let start = Instant::now();
    loop {
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return;
        }
        assert!(
            bg.running(),
            "{} exited before listening:\n{}",
            bg.label,
            bg.describe()
        );
        assert!(
            start.elapsed() < timeout,
            "{} does not listen on port {port} after {} s:\n{}",
            bg.label,
            timeout.as_secs(),
            bg.describe()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Sends `request` to 127.0.0.1:`port` and reads the answer to EOF.
pub(crate) fn tcp_exchange(port: u16, request: &[u8], until_eof: bool) -> std::io::Result<Vec<u8>> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    s.write_all(request)?;
    let mut buf = Vec::new();
    if until_eof {
        s.read_to_end(&mut buf)?;
    } else {
        let mut b = [0u8; 256];
        while !buf.ends_with(b"\r\n") {
            let n = s.read(&mut b)?;
            if n == 0 {
                break;
            }
            buf.extend_from_slice(&b[..n]);
        }
    }
    Ok(buf)
}
