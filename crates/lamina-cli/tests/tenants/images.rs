//! The images: generated sources, conversions, chunk tables, the forged
//! index of a hostile image, and the hostile registry that serves it.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::common::*;
use crate::{Timer, CHANGED, FILES, TOOLS};
use lamina_format::index::{BlobSummary, ChunkIndex, IndexTop};
use lamina_image::artifact::{
    ANNOTATION_UNCOMPRESSED_DIGEST, ANNOTATION_UNCOMPRESSED_SIZE, MEDIA_TYPE_BLOB, MEDIA_TYPE_INDEX,
};
use serde_json::Value;

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
pub(crate) fn build_sources(t: &TestDir) -> PathBuf {
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
pub(crate) fn begin(test: &'static str, dir: &str) -> Option<(Timer, TestDir, PathBuf)> {
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
pub(crate) fn reference(t: &TestDir, layout: &Path, tag: &str) -> PathBuf {
    umoci_unpack(
        &format!("{}:{tag}", layout.display()),
        &t.join(&format!("umoci-{tag}")),
    )
}

/// sha256 of every regular file below `root`, by relative path.
pub(crate) fn tree_hashes(root: &Path) -> BTreeMap<String, String> {
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
pub(crate) fn convert(src: &str, dst: &str) -> Value {
    lamina(["convert", "--json", src, dst]).ok().json()
}

/// The single data blob of a convert report: (digest, size, cache size).
#[track_caller]
pub(crate) fn only_blob(report: &Value) -> (String, u64, u64) {
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
pub(crate) fn layer_of(manifest: &Value, media_type: &str) -> usize {
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
pub(crate) fn index_top(layout: &Path, tag: &str, work: &Path) -> IndexTop {
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
pub(crate) fn blob_table(layout: &Path, tag: &str, work: &Path) -> Vec<BlobSummary> {
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

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The file-name stem of a blob's cache entry, `<blob hex>.<entry hex32>`
/// (lamina_fetch::store::EntryKey::stem, from the index alone).
pub(crate) fn entry_stem(blob: &BlobSummary) -> String {
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
pub(crate) fn forge(
    layout: &Path,
    tag: &str,
    new_tag: &str,
    victim_digest: &str,
    work: &Path,
) -> BlobSummary {
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
pub(crate) struct HostileRegistry {
    pub(crate) bg: Background,
    pub(crate) port: u16,
    pub(crate) log: PathBuf,
}

impl HostileRegistry {
    #[track_caller]
    pub(crate) fn start(dir: &Path, layout: &Path) -> HostileRegistry {
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
    pub(crate) fn ranges_served(&self, digest: &str) -> usize {
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
