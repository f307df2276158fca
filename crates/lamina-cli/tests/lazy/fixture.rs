//! The Debian fixture: the reference image converted and pushed once per
//! test binary, its umoci unpack with hashes, and a model of its chunks.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::fs;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::common::*;
use crate::daemon::num;
use crate::readers::hash_files;
use crate::{IMAGE, SRC_TAG};
use serde_json::Value;

// ---------------------------------------------------------------------------
// the Debian fixture

/// The Debian image, converted and pushed once per test binary.
#[derive(Debug)]
pub(crate) struct Debian {
    /// Source OCI layout (tag `bookworm`).
    pub(crate) source: PathBuf,
    /// Storage of a registry holding the lamina image as [`IMAGE`].
    pub(crate) registry_data: PathBuf,
    /// `lamina convert --json` report.
    pub(crate) report: Value,
    /// `umoci unpack` of the source: the reference tree.
    pub(crate) rootfs: PathBuf,
    /// Regular files of the reference tree (relative), sorted.
    pub(crate) files: Vec<String>,
    /// sha256 of each of them.
    pub(crate) hashes: BTreeMap<String, String>,
    /// Size of each of them.
    pub(crate) sizes: BTreeMap<String, u64>,
    /// Per data blob (source layers that brought new chunks, in order): the
    /// chunks it holds and how many of them no file of the final tree uses
    /// (from layer files a later layer replaced), by [`CHUNK_MODEL`].
    pub(crate) model: Vec<BlobModel>,
}

/// What an independent model of the conversion says one data blob holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BlobModel {
    pub(crate) chunks: u64,
    pub(crate) bytes: u64,
    pub(crate) dead: u64,
    pub(crate) dead_bytes: u64,
}

impl Debian {
    /// Compressed bytes of all data blobs (what a full fetch transfers).
    pub(crate) fn compressed_bytes(&self) -> u64 {
        self.report["blobs"]
            .as_array()
            .unwrap_or_else(|| panic!("no blobs in the convert report {}", self.report))
            .iter()
            .map(|b| b["size"].as_u64().expect("blob size"))
            .sum()
    }

    /// Files below `prefix` (e.g. `usr/`).
    pub(crate) fn files_under(&self, prefix: &str) -> Vec<String> {
        self.files
            .iter()
            .filter(|f| f.starts_with(prefix))
            .cloned()
            .collect()
    }
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "unknown panic".into())
}

/// The shared fixture, built on first use. A failed build is remembered, so
/// later tests fail at once instead of converting again.
pub(crate) fn debian() -> &'static Debian {
    static D: OnceLock<Result<Debian, String>> = OnceLock::new();
    match D.get_or_init(|| std::panic::catch_unwind(build_debian).map_err(|p| panic_text(&*p))) {
        Ok(d) => d,
        Err(e) => panic!("the Debian fixture could not be built: {e}"),
    }
}

// Over 100 lines: the shared fixture built once, each step (image, convert, push, model) on the
// one before.
fn build_debian() -> Debian {
    let started = Instant::now();
    let source = debian_source();

    let dir = fixtures().join("debian-lazy");
    if dir.exists() {
        fs::remove_dir_all(&dir).unwrap_or_else(|e| panic!("rm {}: {e}", dir.display()));
    }
    fs::create_dir_all(&dir).unwrap();

    // Convert straight into a registry, then keep only its storage: every
    // test starts its own registry on a copy.
    let reg = Registry::start();
    let report = lamina_timeout(
        [
            "convert",
            "--json",
            &oci_ref(&source, SRC_TAG),
            &reg.reference(IMAGE),
        ],
        Duration::from_secs(1200),
    )
    .ok()
    .json();
    let convert_secs = started.elapsed().as_secs_f64();
    let inspect = lamina(["inspect", "--json", &reg.reference(IMAGE)])
        .ok()
        .json();
    let chunk_size = inspect["chunk_size"]
        .as_u64()
        .unwrap_or_else(|| panic!("no chunk_size in {inspect}"));
    reg.stop();
    let registry_data = dir.join("registry-data");
    let mut c = command(
        "cp",
        [
            OsStr::new("-a"),
            reg.dir().join("data").as_os_str(),
            registry_data.as_os_str(),
        ],
    );
    run(&mut c, TIMEOUT).ok();
    drop(reg);

    let rootfs = umoci_unpack(
        &format!("{}:{SRC_TAG}", source.display()),
        &dir.join("umoci"),
    );
    let files: Vec<String> = regular_files(&rootfs)
        .into_iter()
        .map(|p| {
            p.to_str()
                .unwrap_or_else(|| panic!("non-UTF-8 path {}", p.display()))
                .to_string()
        })
        .collect();
    assert!(files.len() > 5000, "only {} regular files", files.len());
    let got = hash_files(&rootfs, &files, &dir, "reference", TIMEOUT)
        .unwrap_or_else(|e| panic!("hashing the reference tree: {e}"));
    let mut hashes = BTreeMap::new();
    let mut sizes = BTreeMap::new();
    for f in &files {
        let r = &got[f];
        let h = r
            .sha256
            .clone()
            .unwrap_or_else(|| panic!("reference {f}: {}", r.error));
        hashes.insert(f.clone(), h);
        sizes.insert(
            f.clone(),
            fs::symlink_metadata(rootfs.join(f)).unwrap().len(),
        );
    }
    let script = dir.join("chunk-model.py");
    fs::write(&script, CHUNK_MODEL).unwrap();
    let mut c = command(tool("python3"), [script.as_os_str(), source.as_os_str()]);
    // Images converted before packing carry no pack limit: 0.
    let pack_limit = inspect["pack_limit"].as_u64().unwrap_or(0);
    c.args([
        SRC_TAG.to_string(),
        chunk_size.to_string(),
        pack_limit.to_string(),
    ])
    .arg(&rootfs);
    let out = run(&mut c, TIMEOUT).ok();
    let model: Vec<BlobModel> = out
        .json()
        .as_array()
        .unwrap_or_else(|| panic!("chunk model:\n{}", out.describe()))
        .iter()
        .map(|b| BlobModel {
            chunks: num(b, "chunks"),
            bytes: num(b, "bytes"),
            dead: num(b, "dead"),
            dead_bytes: num(b, "dead_bytes"),
        })
        .filter(|b| b.chunks > 0)
        .collect();
    let counts: Vec<u64> = inspect["blobs"]
        .as_array()
        .unwrap_or_else(|| panic!("no blobs in {inspect}"))
        .iter()
        .map(|b| num(b, "chunks"))
        .collect();
    assert_eq!(
        model.iter().map(|b| b.chunks).collect::<Vec<_>>(),
        counts,
        "the chunk model disagrees with the image's chunk index ({model:?} vs {inspect})"
    );
    eprintln!(
        "fixture: Debian converted and pushed in {convert_secs:.1} s, reference of {} files ready after {:.1} s",
        files.len(),
        started.elapsed().as_secs_f64()
    );
    Debian {
        source,
        registry_data,
        report,
        rootfs,
        files,
        hashes,
        sizes,
        model,
    }
}

/// An independent model of what `lamina convert` stores (docs/format.md):
/// each layer's regular files cut into chunks of the chunk size, all-zero
/// chunks left out, a chunk stored once, in the first layer that has it;
/// a layer's new chunks make blobs of at most 1,024 chunks (the paged
/// index's table). Prints, per data blob, the chunks it holds and those
/// that no file of the final tree (argv[5], the umoci unpack) contains.
const CHUNK_MODEL: &str = r#"
import hashlib, json, os, sys, tarfile
layout, tag, chunk, pack_limit, rootfs = (sys.argv[1], sys.argv[2], int(sys.argv[3]),
                                          int(sys.argv[4]), sys.argv[5])
pack_limit = min(pack_limit, chunk)
def blob(d):
    return os.path.join(layout, "blobs", *d.split(":"))
with open(os.path.join(layout, "index.json")) as f:
    index = json.load(f)
desc = next(m for m in index["manifests"]
            if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == tag)
with open(blob(desc["digest"])) as f:
    manifest = json.load(f)
def chunks(f, size):
    left = size
    while left > 0:
        b = f.read(min(chunk, left))
        if len(b) != min(chunk, left):
            raise SystemExit("short read")
        left -= len(b)
        if b.strip(b"\0"):
            yield hashlib.sha256(b).digest(), len(b)
# docs/format.md, "Small files": files of at most the pack limit share
# chunks (packs), each at a 4 KiB boundary; a pack is stored when the next
# file would carry it past the chunk size, before a larger file's new chunk,
# and at the layer's end; small files are deduplicated by content.
seen, layers = set(), []
for layer in manifest["layers"]:
    new = []  # (digests the chunk serves, bytes)
    pack, members = b"", []
    def store_pack():
        global pack, members
        if pack:
            seen.add(hashlib.sha256(pack).digest())
            new.append((members + [hashlib.sha256(pack).digest()], len(pack)))
        pack, members = b"", []
    with tarfile.open(blob(layer["digest"]), "r:*") as t:
        for ti in t:
            if not ti.isreg():
                continue
            f = t.extractfile(ti)
            if 0 < ti.size <= pack_limit:
                data = f.read()
                d = hashlib.sha256(data).digest()
                if not data.strip(b"\0") or d in seen:
                    continue
                at = -len(pack) % 4096 + len(pack)
                if pack and at + len(data) > chunk:
                    store_pack()
                    at = 0
                pack = pack.ljust(at, b"\0") + data
                members.append(d)
                seen.add(d)
                continue
            for d, n in chunks(f, ti.size):
                if d not in seen:
                    store_pack()
                    seen.add(d)
                    new.append(([d], n))
    store_pack()
    layers.append(new)
final = set()
for top, dirs, files in os.walk(rootfs):
    for name in files:
        p = os.path.join(top, name)
        if os.path.isfile(p) and not os.path.islink(p):
            with open(p, "rb") as f:
                final.update(d for d, _ in chunks(f, os.path.getsize(p)))
dead = lambda serves: not any(d in final for d in serves)
# docs/format.md, "The chunk index": a blob holds at most 1,024 chunks.
blobs = [new[i:i + 1024] for new in layers for i in range(0, len(new), 1024)]
print(json.dumps([{"chunks": len(new), "bytes": sum(n for _, n in new),
                   "dead": sum(1 for s, _ in new if dead(s)),
                   "dead_bytes": sum(n for s, n in new if dead(s))}
                  for new in blobs]))
"#;
