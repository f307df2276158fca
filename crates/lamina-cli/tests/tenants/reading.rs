//! Reading: files hashed in a child process with a deadline, compared with
//! the reference; page cache drops and cache dir entries.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::Path;

use crate::common::*;
use crate::READ_DEADLINE;
use serde_json::Value;

// ---------------------------------------------------------------------------
// reading

/// Reads the files listed in argv[2] (JSON, relative to argv[1]) and writes
/// one JSON line per file to argv[3]: its sha256 or the error.
const READER: &str = r#"
import hashlib, json, os, sys
root, listfile, outfile = sys.argv[1:4]
with open(listfile) as f:
    paths = json.load(f)
with open(outfile, "w") as out:
    for p in paths:
        rec = {"path": p}
        try:
            h = hashlib.sha256()
            with open(os.path.join(root, p), "rb") as f:
                while True:
                    b = f.read(1 << 20)
                    if not b:
                        break
                    h.update(b)
            rec["sha256"] = h.hexdigest()
        except OSError as e:
            rec["error"] = str(e)
        out.write(json.dumps(rec) + "\n")
        out.flush()
"#;

/// Reads `files` below `root` in a child python3 killed at
/// [`READ_DEADLINE`]; panics if it does not finish (a hung read, named).
/// Each file's sha256, or the error its read got.
#[track_caller]
pub(crate) fn read_files(
    root: &Path,
    files: &[String],
    work: &Path,
    label: &str,
) -> BTreeMap<String, Result<String, String>> {
    let script = work.join("tenants-reader.py");
    if !script.exists() {
        fs::write(&script, READER).unwrap();
    }
    let list = work.join(format!("{label}.list.json"));
    let out = work.join(format!("{label}.reads.jsonl"));
    fs::write(&list, serde_json::to_vec(files).unwrap()).unwrap();
    let mut c = command(
        tool("python3"),
        [
            script.as_os_str(),
            root.as_os_str(),
            list.as_os_str(),
            out.as_os_str(),
        ],
    );
    let res = try_run(&mut c, READ_DEADLINE);
    let got: BTreeMap<String, Result<String, String>> = fs::read_to_string(&out)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .map(|v| {
            let path = v["path"].as_str().unwrap_or_default().to_string();
            let r = v["sha256"]
                .as_str()
                .map(str::to_string)
                .ok_or_else(|| v["error"].as_str().unwrap_or("?").to_string());
            (path, r)
        })
        .collect();
    match res {
        Ok(o) if o.status.success() && got.len() == files.len() => got,
        Ok(o) => panic!(
            "{label}: the reader failed ({} of {} files read):\n{}",
            got.len(),
            files.len(),
            o.describe()
        ),
        Err(e) => panic!(
            "{label}: reading {} files did not finish within {} s: {} done, stuck at {:?}\n{e}",
            files.len(),
            READ_DEADLINE.as_secs(),
            got.len(),
            files.iter().find(|f| !got.contains_key(*f))
        ),
    }
}

/// Records a failure unless every file of `files` was read with the
/// reference's bytes.
pub(crate) fn check_reads(
    f: &mut Failures,
    what: &str,
    want: &BTreeMap<String, String>,
    files: &[String],
    got: &BTreeMap<String, Result<String, String>>,
) {
    let mut bad = Vec::new();
    for p in files {
        match got.get(p) {
            Some(Ok(h)) if *h == want[p] => {}
            Some(Ok(h)) => bad.push(format!(
                "{p}: WRONG BYTES (sha256 {h}, reference {})",
                want[p]
            )),
            Some(Err(e)) => bad.push(format!("{p}: read failed: {e}")),
            None => bad.push(format!("{p}: not read")),
        }
    }
    f.check(bad.is_empty(), || {
        format!(
            "{what}: {} of {} files not read back equal to the reference:\n  {}",
            bad.len(),
            files.len(),
            bad.join("\n  ")
        )
    });
}

/// Empties the page cache, so the next reads of a mount go to its cache
/// files (and through its daemons) again.
#[track_caller]
pub(crate) fn drop_caches() {
    fs::write("/proc/sys/vm/drop_caches", "3")
        .unwrap_or_else(|e| panic!("echo 3 > /proc/sys/vm/drop_caches: {e}"));
}

/// Cache entries (file-name stems) of blob `digest` holding a cache file.
pub(crate) fn cache_entries(cache: &Path, digest: &str) -> BTreeSet<String> {
    let prefix = format!("{}.", digest.strip_prefix("sha256:").unwrap_or(digest));
    cache_files_in(cache, "blobs")
        .into_iter()
        .filter_map(|p| p.file_name()?.to_str().map(str::to_string))
        .filter(|n| n.starts_with(&prefix))
        .filter_map(|n| n.strip_suffix(".cache").map(str::to_string))
        .collect()
}

/// The file names of a mount's cache files (`blob_paths` of its report).
pub(crate) fn blob_names(m: &Mount) -> Vec<String> {
    m.blob_paths()
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect()
}
