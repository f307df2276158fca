//! Issue 28: images of different tenants share one cache dir, and none of
//! them may change what another reads.
//!
//! * Point 1: a hostile image names another image's data blob (its digest
//!   and size) with a chunk table of its own, and its registry serves its
//!   own bytes under that digest. Every chunk it fetches verifies against
//!   its own table, so a cache keyed by blob digest alone let it write its
//!   bytes where the honest image reads (or let the honest image trust its
//!   fill record). The honest image must read its own bytes whichever
//!   mounted first, on the kernel path and through FUSE, and the cache must
//!   hold two entries for the blob.
//! * Point 2: an eager mount of an image that shares a blob with a live
//!   lazy mount must not put a new cache file in place of the one the lazy
//!   mount's kernel mount, holder and worker hold.
//!
//! The images are small generated trees (`MKIMAGE` below, built with
//! `tests/fixtures/mkimage.py`'s writers): one uncompressed tar layer of
//! incompressible files from 100 bytes (packed) to 600,000 (three chunks),
//! so each converts to a single data blob. Every byte read is compared
//! with `umoci unpack` of the source; every read runs in a child process
//! with a deadline.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsStr;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;
use lamina_format::index::{BlobSummary, ChunkEntry, ChunkIndex, IndexBlob, IndexTop};
use lamina_image::artifact::{
    ANNOTATION_UNCOMPRESSED_DIGEST, ANNOTATION_UNCOMPRESSED_SIZE, MEDIA_TYPE_BLOB, MEDIA_TYPE_INDEX,
};
use serde_json::Value;

/// Tools the tests need besides root and python3.
const TOOLS: &[&str] = &["umoci", "docker-registry", "curl", "zstd"];

/// A reader's deadline: the images are a few MB, read on loopback.
const READ_DEADLINE: Duration = Duration::from_secs(120);

/// Seconds a lazy mount's reader waits for data before EIO: short, so a
/// read of the hostile image that cannot be served fails well within
/// [`READ_DEADLINE`].
const MISS_TIMEOUT: &str = "15";

/// Files of the honest image, `data/NAME.bin` of SIZE bytes: four packed
/// (at most the 16 KiB pack limit) in one pack, the others one chunk each
/// or, past the 256 KiB chunk size, two and three.
const FILES: &[(&str, u64)] = &[
    ("s00", 100),
    ("s01", 3000),
    ("s02", 5000),
    ("s03", 12000),
    ("f00", 17000),
    ("f01", 20000),
    ("f02", 40000),
    ("f03", 70000),
    ("f04", 262_144),
    ("f05", 300_000),
    ("f06", 600_000),
];

/// Files whose content the hostile image changes (sizes kept): one in the
/// pack, one single-chunk file, one of two chunks.
const CHANGED: &[&str] = &["s01", "f02", "f05"];

/// Prints the test's wall time when dropped (also when it fails).
#[derive(Debug)]
struct Timer(&'static str, Instant);

impl Drop for Timer {
    fn drop(&mut self) {
        eprintln!("time: {} {:.1} s", self.0, self.1.elapsed().as_secs_f64());
    }
}

// ---------------------------------------------------------------------------
// the images

/// Writes an OCI layout (argv[2]) with the images of a JSON spec (argv[3]):
/// `{TAG: [LAYER, ...]}`, a layer being `[[PATH, SEED, SIZE], ...]`, an
/// uncompressed tar of those files (content: mkimage.py's `prng(SEED,
/// SIZE)`) and their parent dirs. argv[1] is the repository root.
const MKIMAGE: &str = r#"
import json, os, sys
sys.path.insert(0, os.path.join(sys.argv[1], "tests", "fixtures"))
from mkimage import DIR, F, Layout, MT_TAR, T0, _layer, _tar, prng

def layer(files):
    seen, entries = set(), []
    for path, seed, size in files:
        parts = path.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            d = "/".join(parts[:i])
            if d not in seen:
                seen.add(d)
                entries.append(DIR(d, mtime=T0))
        entries.append(F(path, prng(seed, size), mtime=T0 + 1))
    return _layer(_tar(entries), MT_TAR)

with open(sys.argv[3]) as f:
    spec = json.load(f)
lay = Layout(sys.argv[2])
for tag, layers in spec.items():
    lay.add_image(tag, [layer(l) for l in layers])
lay.finish()
"#;

/// The source layout `DIR/src` with tags `b` (the honest image, also image
/// A of point 2), `h` (b with the content of [`CHANGED`] replaced, sizes
/// kept) and `a2` (b's layer plus a second layer under `extra/`).
#[track_caller]
fn build_sources(t: &TestDir) -> PathBuf {
    let honest: Vec<Value> = FILES
        .iter()
        .map(|(n, size)| serde_json::json!([format!("data/{n}.bin"), format!("b-{n}"), size]))
        .collect();
    let hostile: Vec<Value> = FILES
        .iter()
        .map(|(n, size)| {
            let seed = if CHANGED.contains(n) { "h" } else { "b" };
            serde_json::json!([format!("data/{n}.bin"), format!("{seed}-{n}"), size])
        })
        .collect();
    let extra: Vec<Value> = FILES
        .iter()
        .map(|(n, size)| serde_json::json!([format!("extra/{n}.bin"), format!("x-{n}"), size]))
        .collect();
    let spec = serde_json::json!({
        "b": [honest],
        "h": [hostile],
        "a2": [honest, extra],
    });
    let spec_path = t.join("spec.json");
    fs::write(&spec_path, serde_json::to_vec(&spec).unwrap()).unwrap();
    let script = t.join("mkimage-tenants.py");
    fs::write(&script, MKIMAGE).unwrap();
    let layout = t.join("src");
    let mut c = command(
        tool("python3"),
        [
            script.as_os_str(),
            repo_root().as_os_str(),
            layout.as_os_str(),
            spec_path.as_os_str(),
        ],
    );
    run(&mut c, TIMEOUT).ok();
    let tags = layout_tags(&layout);
    for tag in ["b", "h", "a2"] {
        assert!(tags.contains_key(tag), "no tag {tag} in {tags:?}");
    }
    layout
}

/// A test's start over the source layout: its timer, its dir and the
/// layout; `None` when a tool is missing (`require` says which).
#[track_caller]
fn begin(test: &'static str, dir: &str) -> Option<(Timer, TestDir, PathBuf)> {
    let time = Timer(test, Instant::now());
    if !require(TOOLS) {
        return None;
    }
    let t = TestDir::new(dir);
    let src = build_sources(&t);
    Some((time, t, src))
}

/// `umoci unpack` of `layout:tag` into `t/umoci-TAG`: its rootfs.
#[track_caller]
fn reference(t: &TestDir, layout: &Path, tag: &str) -> PathBuf {
    umoci_unpack(
        &format!("{}:{tag}", layout.display()),
        &t.join(&format!("umoci-{tag}")),
    )
}

/// sha256 of every regular file below `root`, by relative path.
fn tree_hashes(root: &Path) -> BTreeMap<String, String> {
    regular_files(root)
        .into_iter()
        .map(|p| {
            let h = sha256_file(&root.join(&p));
            (p.to_string_lossy().into_owned(), h)
        })
        .collect()
}

/// `lamina convert --json SRC DST`: the report.
#[track_caller]
fn convert(src: &str, dst: &str) -> Value {
    lamina(["convert", "--json", src, dst]).ok().json()
}

/// The single data blob of a convert report: (digest, size, cache size).
#[track_caller]
fn only_blob(report: &Value) -> (String, u64, u64) {
    let blobs = report["blobs"]
        .as_array()
        .unwrap_or_else(|| panic!("no blobs in {report}"));
    assert_eq!(blobs.len(), 1, "expected one data blob: {report}");
    let b = &blobs[0];
    (
        b["digest"].as_str().unwrap().to_string(),
        b["size"].as_u64().unwrap(),
        b["cache_size"].as_u64().unwrap(),
    )
}

/// The layer of `media_type` in a manifest (the only one), by position.
#[track_caller]
fn layer_of(manifest: &Value, media_type: &str) -> usize {
    let layers = manifest["layers"].as_array().unwrap();
    let found: Vec<usize> = (0..layers.len())
        .filter(|&i| layers[i]["mediaType"] == media_type)
        .collect();
    assert_eq!(found.len(), 1, "{media_type} layers in {manifest}");
    found[0]
}

/// `zstd -d` of a file.
#[track_caller]
fn unzstd(path: &Path, work: &Path) -> Vec<u8> {
    let out = work.join("unzstd.out");
    let mut c = command(
        tool("zstd"),
        [OsStr::new("-q"), OsStr::new("-d"), OsStr::new("-f")],
    );
    c.arg(path).arg("-o").arg(&out);
    run(&mut c, SHORT).ok();
    let bytes = fs::read(&out).unwrap();
    fs::remove_file(&out).unwrap();
    bytes
}

/// `zstd` of bytes.
#[track_caller]
fn zstd(bytes: &[u8], work: &Path) -> Vec<u8> {
    let (raw, out) = (work.join("zstd.in"), work.join("zstd.out"));
    fs::write(&raw, bytes).unwrap();
    let mut c = command(tool("zstd"), [OsStr::new("-q"), OsStr::new("-f")]);
    c.arg(&raw).arg("-o").arg(&out);
    run(&mut c, SHORT).ok();
    let z = fs::read(&out).unwrap();
    fs::remove_file(&raw).unwrap();
    fs::remove_file(&out).unwrap();
    z
}

/// The top of the index of `layout:tag` (a paged index).
#[track_caller]
fn index_top(layout: &Path, tag: &str, work: &Path) -> IndexTop {
    let manifest = read_manifest(layout, tag);
    let index = &manifest["layers"][layer_of(&manifest, MEDIA_TYPE_INDEX)];
    let bytes = unzstd(&blob_path(layout, index["digest"].as_str().unwrap()), work);
    let top = ChunkIndex::parse_top(&bytes)
        .unwrap_or_else(|e| panic!("index of {}:{tag}: {e}", layout.display()));
    assert!(
        top.blobs.iter().all(|b| b.table_digest.is_some()),
        "{}:{tag} has no paged index",
        layout.display()
    );
    top
}

/// The blob table of the index of `layout:tag` (a paged index).
#[track_caller]
fn blob_table(layout: &Path, tag: &str, work: &Path) -> Vec<BlobSummary> {
    index_top(layout, tag, work).blobs
}

fn unhex32(s: &str) -> [u8; 32] {
    let s = s.strip_prefix("sha256:").unwrap_or(s);
    assert_eq!(s.len(), 64, "not a sha256 hex digest: {s}");
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap();
    }
    out
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The file-name stem of a blob's cache entry, `<blob hex>.<entry hex32>`
/// (lamina_fetch::store::EntryKey::stem, from the index alone).
fn entry_stem(blob: &BlobSummary) -> String {
    let id = blob.entry_id().expect("a paged blob names its entry");
    format!("{}.{}", hex(&blob.digest), hex(&id[..16]))
}

/// Forges the hostile image in `layout` (a converted image, tag `tag`, one
/// data blob): a manifest tagged `new_tag` whose data layer is
/// `victim_digest` (with the size the layout's own blob has), and an index
/// whose blob entry names that digest with the layout's own chunk table;
/// the file of `victim_digest` in the layout holds the layout's own blob.
/// Returns the forged blob entry.
#[track_caller]
fn forge(layout: &Path, tag: &str, new_tag: &str, victim_digest: &str, work: &Path) -> BlobSummary {
    let mut manifest = read_manifest(layout, tag);
    let data = layer_of(&manifest, MEDIA_TYPE_BLOB);
    let index = layer_of(&manifest, MEDIA_TYPE_INDEX);
    let own = manifest["layers"][data]["digest"]
        .as_str()
        .unwrap()
        .to_string();
    assert_ne!(own, victim_digest, "the two images have the same data blob");

    let mut bytes = unzstd(
        &blob_path(
            layout,
            manifest["layers"][index]["digest"].as_str().unwrap(),
        ),
        work,
    );
    let before = ChunkIndex::parse_top(&bytes).unwrap();
    assert_eq!(before.blobs.len(), 1, "{before:?}");
    // docs/format.md: a 32-byte header, then 96-byte blob entries whose
    // first 32 bytes are the blob's sha256.
    assert_eq!(&bytes[32..64], &unhex32(&own), "the index's first blob");
    bytes[32..64].copy_from_slice(&unhex32(victim_digest));
    let after = ChunkIndex::parse_top(&bytes).unwrap();
    let forged = after.blobs[0].clone();
    assert_eq!(
        hex(&forged.digest),
        victim_digest.strip_prefix("sha256:").unwrap()
    );
    assert_eq!(forged.table_digest, before.blobs[0].table_digest);

    let z = zstd(&bytes, work);
    let index_digest = put_blob(layout, &z);
    let layer = &mut manifest["layers"][index];
    layer["digest"] = index_digest.into();
    layer["size"] = z.len().into();
    layer["annotations"][ANNOTATION_UNCOMPRESSED_DIGEST] =
        format!("sha256:{}", sha256_hex(&bytes)).into();
    layer["annotations"][ANNOTATION_UNCOMPRESSED_SIZE] = bytes.len().to_string().into();
    manifest["layers"][data]["digest"] = victim_digest.into();
    // The bytes served under the victim's digest are this image's own.
    fs::copy(blob_path(layout, &own), blob_path(layout, victim_digest)).unwrap();
    tag_manifest(layout, tag, new_tag, &manifest);
    forged
}

// ---------------------------------------------------------------------------
// the hostile registry

/// `tests/tools/hostile_registry.py` serving one OCI layout, killed on drop.
#[derive(Debug)]
struct HostileRegistry {
    bg: Background,
    port: u16,
    log: PathBuf,
}

impl HostileRegistry {
    #[track_caller]
    fn start(dir: &Path, layout: &Path) -> HostileRegistry {
        let port_file = dir.join("hostile.port");
        let log = dir.join("hostile.requests.jsonl");
        let mut c = command(
            tool("python3"),
            [repo_file("tests/tools/hostile_registry.py")],
        );
        c.arg(layout)
            .arg("--port-file")
            .arg(&port_file)
            .arg("--log")
            .arg(&log)
            .args(["--lifetime", "900"]);
        let mut bg = Background::spawn("hostile-registry", &mut c, dir);
        let port = wait_port_file(&mut bg, &port_file, "hostile registry");
        HostileRegistry { bg, port, log }
    }

    /// Range requests it answered for blob `digest` so far.
    fn ranges_served(&self, digest: &str) -> usize {
        let suffix = format!("/blobs/{digest}");
        fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|r| {
                r["method"] == "GET"
                    && r["status"] == 206
                    && r["path"].as_str().is_some_and(|p| p.ends_with(&suffix))
            })
            .count()
    }
}

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
fn read_files(
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
fn check_reads(
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
fn drop_caches() {
    fs::write("/proc/sys/vm/drop_caches", "3")
        .unwrap_or_else(|e| panic!("echo 3 > /proc/sys/vm/drop_caches: {e}"));
}

/// Cache entries (file-name stems) of blob `digest` holding a cache file.
fn cache_entries(cache: &Path, digest: &str) -> BTreeSet<String> {
    let prefix = format!("{}.", digest.strip_prefix("sha256:").unwrap_or(digest));
    fs::read_dir(cache.join("blobs"))
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str().map(str::to_string))
                .filter(|n| n.starts_with(&prefix))
                .filter_map(|n| n.strip_suffix(".cache").map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// The file names of a mount's cache files (`blob_paths` of its report).
fn blob_names(m: &Mount) -> Vec<String> {
    m.blob_paths()
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect()
}

// ---------------------------------------------------------------------------
// point 1

/// What every round of point 1 uses.
struct Tenants<'a> {
    t: &'a TestDir,
    honest: String,
    hostile: String,
    registry: &'a HostileRegistry,
    victim: String,
    honest_entry: String,
    hostile_entry: String,
    /// `umoci unpack` of B.
    ref_b: PathBuf,
    want_b: BTreeMap<String, String>,
    want_h: BTreeMap<String, String>,
    files: Vec<String>,
    /// Files of the honest image that share no chunk with a file the
    /// hostile image changes (not packed, not changed).
    apart: Vec<String>,
}

impl Tenants<'_> {
    /// One round on a fresh cache dir, both images mounted lazily
    /// (`mode`). B first: B mounted and the files read that share no chunk
    /// with what H changes (with no read-ahead, fill-ahead or prefetch, so
    /// those reads fill only their own chunks: H has chunks of the blob left
    /// that it could fill with its own bytes if the two shared a cache
    /// file), then H mounted and every file of H read. H first: H mounted
    /// and every file read, then B mounted. Then, with the page cache
    /// dropped, B reads every file with its own bytes, and the cache holds
    /// two entries for X, B's and H's.
    fn round(&self, f: &mut Failures, mode: &str, b_first: bool) {
        let label = format!("{mode}-{}", if b_first { "b-first" } else { "h-first" });
        let started = Instant::now();
        let cache = self.t.join(&format!("cache-{label}"));
        let opts = [
            "--lazy",
            "--mode",
            mode,
            "--timeout",
            MISS_TIMEOUT,
            "--prefetch",
            "none",
            "--fill-ahead",
            "0",
            "--readahead",
            "0",
        ];
        let served_before = self.registry.ranges_served(&self.victim);
        let mount_b = || {
            Mount::with_args(
                &self.honest,
                &self.t.join(&format!("mnt-b-{label}")),
                &cache,
                &opts,
            )
        };
        let mount_h = || {
            Mount::with_args(
                &self.hostile,
                &self.t.join(&format!("mnt-h-{label}")),
                &cache,
                &opts,
            )
        };
        // B first: mounted, and the files H cannot touch read.
        let early = b_first.then(|| {
            let b = mount_b();
            let got = read_files(&b.path, &self.apart, self.t.path(), &format!("{label}-b0"));
            check_reads(
                f,
                &format!("{label}: B before H"),
                &self.want_b,
                &self.apart,
                &got,
            );
            b
        });

        // H reads everything: its reads may get its bytes or fail, but end.
        let h = mount_h();
        let got_h = read_files(&h.path, &self.files, self.t.path(), &format!("{label}-h"));
        let served = self.registry.ranges_served(&self.victim) - served_before;
        f.check(served > 0, || {
            format!(
                "{label}: the hostile registry served no range of {} (H never fetched its bytes: the test tests nothing)",
                self.victim
            )
        });
        let tally = |want: &BTreeMap<String, String>| {
            got_h
                .iter()
                .filter(|(p, r)| r.as_ref().is_ok_and(|h| *h == want[*p]))
                .count()
        };
        eprintln!(
            "{label}: H read {} files: {} with H's bytes, {} with B's, {} failed; {served} range requests to the hostile registry",
            got_h.len(),
            tally(&self.want_h),
            tally(&self.want_b),
            got_h.values().filter(|r| r.is_err()).count()
        );

        // H first: B mounted after H read everything.
        let b = early.unwrap_or_else(mount_b);
        for (who, m, entry) in [
            ("B", &b, &self.honest_entry),
            ("H", &h, &self.hostile_entry),
        ] {
            f.check(blob_names(m) == [format!("{entry}.cache")], || {
                format!(
                    "{label}: {who}'s cache files {:?}, expected its own entry {entry}",
                    m.blob_paths()
                )
            });
        }

        // B, from its cache files: every byte its own.
        drop_caches();
        let got_b = read_files(&b.path, &self.files, self.t.path(), &format!("{label}-b"));
        let failed = f.0.len();
        check_reads(
            f,
            &format!("{label}: B after H"),
            &self.want_b,
            &self.files,
            &got_b,
        );
        if f.0.len() == failed {
            // The rest of the tree (metadata) too; after wrong bytes, the
            // next rounds run instead, and report theirs.
            drop_caches();
            treecmp(&[], &self.ref_b, &b.path);
        }

        let entries = cache_entries(&cache, &self.victim);
        let expected: BTreeSet<String> =
            [self.honest_entry.clone(), self.hostile_entry.clone()].into();
        f.check(entries == expected, || {
            format!(
                "{label}: cache entries of {}: {entries:?}, expected B's and H's: {expected:?}",
                self.victim
            )
        });
        h.unmount();
        b.unmount();
        eprintln!(
            "{label}: round took {:.1} s",
            started.elapsed().as_secs_f64()
        );
    }
}

/// Issue 28 point 1. Image H is image B with three files' content changed
/// (same sizes, so the same chunk count and cache size; incompressible, so
/// even the same blob size), forged to name B's data blob X with H's own
/// chunk table, and served by a registry that answers X's ranges with H's
/// bytes; B comes from a real registry. On one cache dir per round, B and H
/// are mounted lazily, B first (having read only files H cannot touch) or H
/// first, on the kernel path and through FUSE; H reads everything (not
/// checked beyond ending in time); then, with the page cache dropped, every
/// file of B must equal `umoci unpack` of B, and the cache must hold two
/// entries for X: B's and H's, named by (X, cache size, table digest).
#[test]
fn a_hostile_image_naming_anothers_blob_never_changes_its_bytes() {
    let Some((_time, t, src)) = begin(
        "a_hostile_image_naming_anothers_blob_never_changes_its_bytes",
        "tenants-hostile",
    ) else {
        return;
    };
    let ref_b = reference(&t, &src, "b");
    let ref_h = reference(&t, &src, "h");
    let (want_b, want_h) = (tree_hashes(&ref_b), tree_hashes(&ref_h));
    let files: Vec<String> = want_b.keys().cloned().collect();
    assert_eq!(files.len(), FILES.len());
    let changed: Vec<&String> = files.iter().filter(|p| want_b[*p] != want_h[*p]).collect();
    assert_eq!(changed.len(), CHANGED.len(), "changed files: {changed:?}");
    let apart: Vec<String> = files
        .iter()
        .filter(|p| want_b[*p] == want_h[*p] && fs::metadata(ref_b.join(p)).unwrap().len() > 16384)
        .cloned()
        .collect();
    assert!(apart.len() >= 4, "{apart:?}");

    // B: into the real registry, and into a layout for its index.
    let reg = Registry::start();
    let honest = reg.reference("tenant:b");
    let report_b = convert(&oci_ref(&src, "b"), &honest);
    let out_b = t.join("out-b");
    let layout_b = convert(&oci_ref(&src, "b"), &oci_ref(&out_b, "b"));
    assert_eq!(report_b["manifest_digest"], layout_b["manifest_digest"]);
    let (victim, size_b, cache_b) = only_blob(&report_b);

    // H: converted, then forged to name X.
    let out_h = t.join("out-h");
    let report_h = convert(&oci_ref(&src, "h"), &oci_ref(&out_h, "h"));
    let (own_h, size_h, cache_h) = only_blob(&report_h);
    assert_ne!(own_h, victim);
    assert_eq!(cache_h, cache_b, "H must have B's cache size");
    let table_b = blob_table(&out_b, "b", t.path());
    let forged = forge(&out_h, "h", "forged", &victim, t.path());
    assert_eq!(forged.chunk_count, table_b[0].chunk_count);
    assert_eq!(forged.cache_size, table_b[0].cache_size);
    assert_ne!(forged.table_digest, table_b[0].table_digest);
    let forged_manifest = read_manifest(&out_h, "forged");
    let data = &forged_manifest["layers"][layer_of(&forged_manifest, MEDIA_TYPE_BLOB)];
    assert_eq!(data["digest"], victim.as_str());
    eprintln!(
        "blob X {victim}: {size_b} bytes in B, H's bytes {size_h} (served as X), cache size {cache_b}, {} chunks",
        forged.chunk_count
    );
    let honest_entry = entry_stem(&table_b[0]);
    let hostile_entry = entry_stem(&forged);
    assert_ne!(honest_entry, hostile_entry);

    let registry = HostileRegistry::start(t.path(), &out_h);
    let tenants = Tenants {
        t: &t,
        honest,
        hostile: format!("docker://127.0.0.1:{}/hostile:forged", registry.port),
        registry: &registry,
        victim,
        honest_entry,
        hostile_entry,
        ref_b,
        want_b,
        want_h,
        files,
        apart,
    };
    let mut f = Failures::default();
    for (mode, b_first) in [
        ("kernel", true),
        ("kernel", false),
        ("fuse", true),
        ("fuse", false),
    ] {
        tenants.round(&mut f, mode, b_first);
    }
    if !f.0.is_empty() {
        let log = fs::read_to_string(&registry.log).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        f.0.push(format!(
            "hostile registry: {}\nits last requests:\n{}",
            registry.bg.describe(),
            lines[lines.len().saturating_sub(20)..].join("\n")
        ));
    }
    f.finish("a hostile image naming another's blob");
}

// ---------------------------------------------------------------------------
// point 2

/// The pid of the lazy mount's live worker, from its `status.json`.
#[track_caller]
fn worker_pid(rd: &Path, timeout: Duration) -> u32 {
    let start = Instant::now();
    loop {
        let status: Option<Value> = fs::read(rd.join("status.json"))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok());
        if let Some(pid) = status.as_ref().and_then(|s| s["pid"].as_u64()) {
            let pid = pid as u32;
            if !process_exits(pid, Duration::ZERO) {
                return pid;
            }
        }
        assert!(
            start.elapsed() < timeout,
            "no live worker in {} within {} s: {status:?}",
            rd.display(),
            timeout.as_secs()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Issue 28 point 2. Image A2 is A plus a layer, so it shares A's data blob
/// with the same chunk table, hence A's cache entry. A is mounted lazily
/// (kernel path, no read-ahead or prefetch) and one file read; then A2 is
/// mounted eagerly on the same cache, which fetches the shared blob whole.
/// The cache file A's mount uses must still be the same inode (nothing
/// renamed over it), and with the page cache dropped each time, A's files
/// must equal `umoci unpack` of A (the bug: they read zeros): half of them
/// read by the worker that served before the eager mount, then all of them
/// after a `kill -9` of the worker (the other half only by its successor,
/// which opens the cache entry again), then all again after a second kill.
/// A2's mount equals its reference too.
#[test]
fn an_eager_mount_never_swaps_a_live_lazy_mounts_cache_file() {
    let _time = Timer(
        "an_eager_mount_never_swaps_a_live_lazy_mounts_cache_file",
        Instant::now(),
    );
    if !require(TOOLS) {
        return;
    }
    let t = TestDir::new("tenants-eager");
    let src = build_sources(&t);
    let ref_a = reference(&t, &src, "b");
    let ref_a2 = reference(&t, &src, "a2");
    let want_a = tree_hashes(&ref_a);
    let files: Vec<String> = want_a.keys().cloned().collect();

    let reg = Registry::start();
    let image_a = reg.reference("tenant:a");
    let image_a2 = reg.reference("tenant:a2");
    let report_a = convert(&oci_ref(&src, "b"), &image_a);
    let report_a2 = convert(&oci_ref(&src, "a2"), &image_a2);
    let (shared, _, _) = only_blob(&report_a);
    assert_eq!(
        report_a2["blobs"][0]["digest"],
        shared.as_str(),
        "A2 does not share A's data blob: {report_a2}"
    );

    let cache = t.join("cache");
    let lazy = Mount::with_args(
        &image_a,
        &t.join("mnt-a"),
        &cache,
        &[
            "--lazy",
            "--mode",
            "kernel",
            "--timeout",
            "30",
            "--prefetch",
            "none",
            "--fill-ahead",
            "0",
            "--readahead",
            "0",
        ],
    );
    let rd = run_dir(&lazy);
    let mut f = Failures::default();
    let first = vec!["data/f00.bin".to_string()];
    let got = read_files(&lazy.path, &first, t.path(), "a-first");
    check_reads(&mut f, "A before the eager mount", &want_a, &first, &got);
    let lazy_blob = lazy.blob_paths()[0].clone();
    let inode_before = fs::metadata(&lazy_blob).unwrap().ino();

    let eager = Mount::with_args(
        &image_a2,
        &t.join("mnt-a2"),
        &cache,
        &["--eager", "--mode", "kernel"],
    );
    assert_eq!(
        eager.blob_paths()[0],
        lazy_blob,
        "the eager mount does not use the lazy mount's cache entry for the shared blob"
    );
    let inode_after = fs::metadata(&lazy_blob).unwrap().ino();
    f.check(inode_after == inode_before, || {
        format!(
            "the eager mount replaced the live lazy mount's cache file {} (inode {inode_before} -> {inode_after})",
            lazy_blob.display()
        )
    });

    // Half of A's files while the worker from before the eager mount
    // serves; the other half only after it was killed, by its successor,
    // which opens the cache entry anew; then everything again after
    // another kill.
    let before_kill: Vec<String> = files
        .iter()
        .step_by(2)
        .filter(|p| !first.contains(p))
        .cloned()
        .collect();
    drop_caches();
    let got = read_files(&lazy.path, &before_kill, t.path(), "a-after-eager");
    check_reads(
        &mut f,
        "A after the eager mount of A2, its first worker",
        &want_a,
        &before_kill,
        &got,
    );
    for kill in 1..=2 {
        let pid = worker_pid(&rd, Duration::from_secs(20));
        let p = rustix::process::Pid::from_raw(pid as i32).expect("pid > 0");
        rustix::process::kill_process(p, rustix::process::Signal::KILL)
            .unwrap_or_else(|e| panic!("kill -9 {pid}: {e}"));
        assert!(
            process_exits(pid, Duration::from_secs(10)),
            "worker {pid} survived kill -9"
        );
        drop_caches();
        let got = read_files(
            &lazy.path,
            &files,
            t.path(),
            &format!("a-after-kill-{kill}"),
        );
        check_reads(
            &mut f,
            &format!("A after kill -9 #{kill} of its worker"),
            &want_a,
            &files,
            &got,
        );
    }
    f.check(
        fs::metadata(&lazy_blob).unwrap().ino() == inode_before,
        || format!("{} was replaced", lazy_blob.display()),
    );
    if f.0.is_empty() {
        drop_caches();
        treecmp(&[], &ref_a, &lazy.path);
        treecmp(&[], &ref_a2, &eager.path);
    }
    if !f.0.is_empty() {
        let mut logs = String::new();
        for name in ["holder.log", "worker.log"] {
            let text = fs::read_to_string(rd.join(name)).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            logs.push_str(&format!(
                "--- {name} (last 30 lines) ---\n{}\n",
                lines[lines.len().saturating_sub(30)..].join("\n")
            ));
        }
        f.0.push(logs);
    }
    f.finish("an eager mount beside a live lazy one");
    eager.unmount();
    lazy.unmount();
}

/// Seconds the soak runs: `LAMINA_SOAK_SECS`, else 60 (the full soak of
/// issue 28 is 600: `LAMINA_SOAK_SECS=600 cargo test --test tenants soak`).
fn soak_secs() -> u64 {
    std::env::var("LAMINA_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60)
}

/// A small deterministic generator (xorshift64*), seeded from the clock
/// and printed, so that a failing run can be replayed with `LAMINA_SOAK_SEED`.
struct Dice(u64);

impl Dice {
    fn roll(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as usize % n.max(1)
    }
}

/// One mount of the soak: where, which image, how.
struct Slot {
    mount: Mount,
    tag: &'static str,
    how: &'static str,
}

/// Issue 28's race soak: on one cache, lazy and eager mounts (kernel and
/// FUSE) of two images that share a blob are started and stopped at
/// random, `lamina gc --max-size 0` runs, workers are killed with -9, and
/// every file of a random live mount is read and compared with `umoci
/// unpack`: no wrong byte, no reader past its deadline (a read that fails
/// is counted and allowed: a mount whose worker was just killed may answer
/// EIO at its timeout). Runs [`soak_secs`].
#[test]
fn soak_mounts_gc_and_kills_never_give_a_wrong_byte() {
    let _time = Timer(
        "soak_mounts_gc_and_kills_never_give_a_wrong_byte",
        Instant::now(),
    );
    if !require(TOOLS) {
        return;
    }
    let t = TestDir::new("tenants-soak");
    let src = build_sources(&t);
    let want: BTreeMap<&str, BTreeMap<String, String>> = ["b", "a2"]
        .into_iter()
        .map(|tag| (tag, tree_hashes(&reference(&t, &src, tag))))
        .collect();
    let reg = Registry::start();
    for tag in ["b", "a2"] {
        convert(&oci_ref(&src, tag), &reg.reference(&format!("soak:{tag}")));
    }
    let seed = std::env::var("LAMINA_SOAK_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
            now.map_or(7, |d| d.as_nanos() as u64) | 1
        });
    eprintln!("soak seed {seed} (LAMINA_SOAK_SEED replays it)");
    let mut dice = Dice(seed);
    let cache = t.join("cache");
    let hows: [(&str, &[&str]); 4] = [
        (
            "lazy-kernel",
            &["--lazy", "--mode", "kernel", "--timeout", "20"],
        ),
        ("eager-kernel", &["--eager", "--mode", "kernel"]),
        (
            "lazy-fuse",
            &["--lazy", "--mode", "fuse", "--timeout", "20"],
        ),
        ("eager-fuse", &["--eager", "--mode", "fuse"]),
    ];
    let mut slots: Vec<Option<Slot>> = (0..4).map(|_| None).collect();
    let (mut reads, mut failed_reads, mut mounts, mut gcs, mut kills) = (0, 0, 0, 0, 0);
    let mut f = Failures::default();
    let until = Instant::now() + Duration::from_secs(soak_secs());
    let mut step = 0;
    while Instant::now() < until {
        step += 1;
        let i = dice.roll(slots.len());
        match dice.roll(10) {
            0..=2 => match slots[i].take() {
                None => {
                    let tag = ["b", "a2"][dice.roll(2)];
                    let (how, args) = hows[dice.roll(hows.len())];
                    let image = reg.reference(&format!("soak:{tag}"));
                    let mnt = t.join(&format!("mnt-{i}"));
                    let mount = Mount::with_args(&image, &mnt, &cache, args);
                    mounts += 1;
                    slots[i] = Some(Slot { mount, tag, how });
                }
                Some(slot) => {
                    // Busy (a reader still on it) is fine: keep it.
                    let out = lamina_timeout(
                        [
                            "umount",
                            slot.mount.path.to_str().unwrap(),
                            "--cache-dir",
                            cache.to_str().unwrap(),
                        ],
                        SHORT,
                    );
                    if !out.status.success() {
                        slots[i] = Some(slot);
                    }
                }
            },
            3..=6 => {
                let Some(slot) = &slots[i] else { continue };
                let files: Vec<String> = want[slot.tag].keys().cloned().collect();
                drop_caches();
                let label = format!("read-{step}");
                let got = read_files(&slot.mount.path, &files, t.path(), &label);
                reads += files.len();
                for (p, r) in &got {
                    match r {
                        Ok(h) if *h == want[slot.tag][p] => {}
                        Ok(h) => f.check(false, || {
                            format!(
                                "step {step}: {} {} {p}: WRONG BYTES ({h})",
                                slot.how, slot.tag
                            )
                        }),
                        Err(_) => failed_reads += 1,
                    }
                }
            }
            7 => {
                lamina_timeout(
                    [
                        "gc",
                        "--max-size",
                        "0",
                        "--cache-dir",
                        cache.to_str().unwrap(),
                    ],
                    SHORT,
                )
                .ok();
                gcs += 1;
            }
            _ => {
                // kill -9 a worker of this cache.
                let workers = command("pgrep", ["-f", "internal-worker"]);
                let out = run(&mut { workers }, SHORT);
                let pids: Vec<u32> = out
                    .stdout
                    .lines()
                    .filter_map(|l| l.trim().parse().ok())
                    .collect();
                let ours: Vec<u32> = pids
                    .into_iter()
                    .filter(|p| {
                        fs::read(format!("/proc/{p}/cmdline")).is_ok_and(|c| {
                            String::from_utf8_lossy(&c).contains(cache.to_str().unwrap())
                        })
                    })
                    .collect();
                if !ours.is_empty() {
                    let pid = ours[dice.roll(ours.len())];
                    let _ = run(&mut command("kill", ["-9", &pid.to_string()]), SHORT);
                    kills += 1;
                }
            }
        }
    }
    eprintln!(
        "figures: soak {} s, {step} steps: {mounts} mounts, {reads} file reads ({failed_reads} failed), {gcs} gc runs, {kills} workers killed",
        soak_secs()
    );
    for slot in slots.into_iter().flatten() {
        drop(slot.mount);
    }
    f.finish("soak");
}

// ---------------------------------------------------------------------------
// issue 31: an update fetches only what changed

/// The chunks of the single data blob of `layout:tag` (a paged index): its
/// table read from the end of the blob.
#[track_caller]
fn blob_chunks(layout: &Path, tag: &str, work: &Path) -> Vec<ChunkEntry> {
    let top = index_top(layout, tag, work);
    let [summary] = &top.blobs[..] else {
        panic!("{}:{tag}: {} data blobs", layout.display(), top.blobs.len());
    };
    let (at, len) = summary.table_range().expect("a paged index");
    let blob = fs::read(blob_path(
        layout,
        &format!("sha256:{}", hex(&summary.digest)),
    ))
    .unwrap();
    let table = &blob[at as usize..(at + len) as usize];
    IndexBlob::from_table(summary, top.chunk_bits, table)
        .unwrap()
        .chunks
}

/// Waits until the worker of `m` holds every chunk of its image (its
/// `status.json` says each blob is complete).
#[track_caller]
fn wait_complete(m: &Mount) {
    let start = Instant::now();
    loop {
        let status = worker_status(m).unwrap_or(Value::Null);
        let blobs = status["blobs"].as_array().cloned().unwrap_or_default();
        if !blobs.is_empty() && blobs.iter().all(|b| b["complete"] == true) {
            return;
        }
        assert!(start.elapsed() < SHORT, "never complete: {status}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The worker's `status.json` as it is now (`None`: not there or torn).
fn worker_status(m: &Mount) -> Option<Value> {
    serde_json::from_slice(&fs::read(run_dir(m).join("status.json")).ok()?).ok()
}

/// The worker's `status.json` once its figures stopped changing.
#[track_caller]
fn settled_status(m: &Mount) -> Value {
    let read = || worker_status(m);
    let start = Instant::now();
    let mut last = read();
    loop {
        std::thread::sleep(Duration::from_millis(300));
        let now = read();
        if let Some(settled) = now.as_ref().filter(|_| now == last) {
            return settled.clone();
        }
        assert!(
            start.elapsed() < SHORT,
            "status.json never settled: {now:?}"
        );
        last = now;
    }
}

/// Issue 31 point 3. Image v2 is image v1 rebuilt with three files changed
/// (another layer, another blob, most chunks the same). On one cache, a
/// lazy mount of v1 reads every file; then a lazy mount of v2 reads every
/// file: it must get v2's bytes, copy every chunk v1 holds from v1's cache
/// file (found by digest through the cache's chunk locator) and fetch only
/// the chunks that changed: at most 1.2x their compressed size, plus v2's
/// chunk table. A mount of v2 on a fresh cache fetches them all (the
/// measure would see a copy that did not happen). Kernel path and FUSE.
#[test]
fn an_update_fetches_only_the_chunks_the_node_does_not_hold() {
    let Some((_time, t, src)) = begin(
        "an_update_fetches_only_the_chunks_the_node_does_not_hold",
        "tenants-update",
    ) else {
        return;
    };
    let (ref_1, ref_2) = (reference(&t, &src, "b"), reference(&t, &src, "h"));
    let (want_1, want_2) = (tree_hashes(&ref_1), tree_hashes(&ref_2));
    let files: Vec<String> = want_2.keys().cloned().collect();

    let reg = Registry::start();
    let out = t.join("out");
    for (tag, from) in [("v1", "b"), ("v2", "h")] {
        let pushed = convert(&oci_ref(&src, from), &reg.reference(&format!("app:{tag}")));
        let kept = convert(&oci_ref(&src, from), &oci_ref(&out, tag));
        assert_eq!(pushed["manifest_digest"], kept["manifest_digest"]);
    }
    let (v1, v2) = (
        blob_chunks(&out, "v1", t.path()),
        blob_chunks(&out, "v2", t.path()),
    );
    let held: BTreeSet<[u8; 32]> = v1.iter().map(|c| c.digest).collect();
    let changed: Vec<&ChunkEntry> = v2.iter().filter(|c| !held.contains(&c.digest)).collect();
    let changed_bytes: u64 = changed
        .iter()
        .map(|c| u64::from(c.compressed_size.get()))
        .sum();
    let all_bytes: u64 = v2.iter().map(|c| u64::from(c.compressed_size.get())).sum();
    let table_bytes = v2.len() as u64 * size_of::<ChunkEntry>() as u64;
    eprintln!(
        "v2: {} chunks, {} changed ({changed_bytes} of {all_bytes} compressed bytes)",
        v2.len(),
        changed.len()
    );
    assert!(
        !changed.is_empty() && changed.len() < v2.len() / 2,
        "the images must share most chunks"
    );

    let opts = |mode: &'static str| {
        [
            "--lazy",
            "--mode",
            mode,
            "--prefetch",
            "none",
            "--fill-ahead",
            "0",
            "--readahead",
            "0",
        ]
    };
    let mut f = Failures::default();
    for mode in ["kernel", "fuse"] {
        let cache = t.join(&format!("cache-{mode}"));
        let m1 = Mount::with_args(
            &reg.reference("app:v1"),
            &t.join(&format!("mnt-v1-{mode}")),
            &cache,
            &opts(mode),
        );
        let got = read_files(&m1.path, &files, t.path(), &format!("{mode}-v1"));
        check_reads(&mut f, &format!("{mode}: v1"), &want_1, &files, &got);
        m1.unmount();

        for (label, cache) in [
            ("updated", cache),
            ("fresh", t.join(&format!("fresh-{mode}"))),
        ] {
            let m2 = Mount::with_args(
                &reg.reference("app:v2"),
                &t.join(&format!("mnt-v2-{mode}-{label}")),
                &cache,
                &opts(mode),
            );
            let got = read_files(&m2.path, &files, t.path(), &format!("{mode}-v2-{label}"));
            check_reads(
                &mut f,
                &format!("{mode}: v2 {label}"),
                &want_2,
                &files,
                &got,
            );
            let status = settled_status(&m2);
            m2.unmount();
            let fetched = status["fetched_bytes"].as_u64().unwrap_or(u64::MAX);
            let located = status["located_chunks"].as_u64().unwrap_or(0);
            eprintln!(
                "{mode}, v2 {label}: fetched {fetched} bytes, {located} chunks copied on the node"
            );
            if label == "fresh" {
                f.check(fetched >= all_bytes && located == 0, || {
                    format!("{mode}: v2 on a fresh cache fetched {fetched} of {all_bytes} bytes, copied {located} chunks")
                });
                continue;
            }
            let bound = changed_bytes * 6 / 5 + table_bytes;
            f.check(fetched >= changed_bytes && fetched <= bound, || {
                format!(
                    "{mode}: the update fetched {fetched} bytes; the changed chunks are {changed_bytes} (bound {bound})"
                )
            });
            let shared = (v2.len() - changed.len()) as u64;
            f.check(located == shared, || {
                format!("{mode}: {located} chunks copied on the node, {shared} shared with v1")
            });
        }
    }
    f.finish("an update");
}

/// Issue 31 point 3, with boot pages: v1 and v2 converted with the boot
/// pages of one recorded start (v1 reading a few files v2 shares). A node
/// that ran v1 (read all of it, and its boot set's whole chunks came after
/// the start) mounts v2: every chunk of the boot set is on the
/// node already, so the worker copies them and does not fetch v2's boot
/// pages (its log says so); v2 reads right and the update fetches at most
/// 1.2x the changed chunks plus v2's chunk table, as without boot pages.
/// On a fresh cache v2 still takes its boot pages.
#[test]
fn an_update_skips_boot_pages_the_node_holds() {
    let Some((_time, t, src)) = begin(
        "an_update_skips_boot_pages_the_node_holds",
        "tenants-update-boot",
    ) else {
        return;
    };
    let (ref_1, ref_2) = (reference(&t, &src, "b"), reference(&t, &src, "h"));
    let (want_1, want_2) = (tree_hashes(&ref_1), tree_hashes(&ref_2));
    let files: Vec<String> = want_2.keys().cloned().collect();
    let shared_files: Vec<String> = files
        .iter()
        .filter(|f| want_1.get(*f) == want_2.get(*f))
        .take(4)
        .cloned()
        .collect();
    assert!(!shared_files.is_empty(), "v1 and v2 share no file");

    let reg = Registry::start();
    convert(&oci_ref(&src, "b"), &reg.reference("app:plain"));
    let trace = t.join("start.trace");
    let rec = Mount::with_args(
        &reg.reference("app:plain"),
        &t.join("mnt-record"),
        &t.join("cache-record"),
        &["--lazy", "--record-trace", trace.to_str().unwrap()],
    );
    read_files(&rec.path, &shared_files, t.path(), "record");
    rec.unmount();
    let out = t.join("out");
    for (tag, from) in [("v1", "b"), ("v2", "h")] {
        let args = ["--prefetch", trace.to_str().unwrap()];
        let src_ref = oci_ref(&src, from);
        for dst in [reg.reference(&format!("app:{tag}")), oci_ref(&out, tag)] {
            lamina(["convert", "--json", args[0], args[1], &src_ref, &dst]).ok();
        }
    }
    let (v1, v2) = (
        blob_chunks(&out, "v1", t.path()),
        blob_chunks(&out, "v2", t.path()),
    );
    let held: BTreeSet<[u8; 32]> = v1.iter().map(|c| c.digest).collect();
    let changed_bytes: u64 = v2
        .iter()
        .filter(|c| !held.contains(&c.digest))
        .map(|c| u64::from(c.compressed_size.get()))
        .sum();
    let bound = changed_bytes * 6 / 5 + v2.len() as u64 * size_of::<ChunkEntry>() as u64;

    let mut f = Failures::default();
    let cache = t.join("cache");
    let m1 = Mount::with_args(
        &reg.reference("app:v1"),
        &t.join("mnt-v1"),
        &cache,
        &["--lazy"],
    );
    let got = read_files(&m1.path, &files, t.path(), "v1");
    check_reads(&mut f, "v1", &want_1, &files, &got);
    // A node that ran v1: its boot set's whole chunks came after the start.
    wait_complete(&m1);
    m1.unmount();
    for (label, cache) in [("updated", cache), ("fresh", t.join("cache-fresh"))] {
        let m2 = Mount::with_args(
            &reg.reference("app:v2"),
            &t.join(&format!("mnt-v2-{label}")),
            &cache,
            &["--lazy", "--fill-ahead", "0", "--readahead", "0"],
        );
        let got = read_files(&m2.path, &files, t.path(), &format!("v2-{label}"));
        check_reads(&mut f, &format!("v2 {label}"), &want_2, &files, &got);
        let status = settled_status(&m2);
        let log = fs::read_to_string(run_dir(&m2).join("worker.log")).unwrap_or_default();
        m2.unmount();
        let fetched = status["fetched_bytes"].as_u64().unwrap_or(u64::MAX);
        let skipped = log.contains("boot pages not fetched");
        eprintln!("v2 {label}: fetched {fetched} bytes (changed chunks {changed_bytes}, bound {bound}), boot pages skipped: {skipped}");
        if label == "fresh" {
            f.check(
                !skipped && status["boot_page_bytes"].as_u64() > Some(0),
                || format!("v2 on a fresh cache took no boot pages:\n{log}"),
            );
            continue;
        }
        f.check(skipped, || {
            format!("v2 after v1 fetched its boot pages though the node held the boot set:\n{log}")
        });
        f.check(fetched <= bound, || {
            format!("the update fetched {fetched} bytes; the changed chunks are {changed_bytes} (bound {bound})")
        });
    }
    f.finish("an update with boot pages");
}
