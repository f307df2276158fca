//! Test images: the fixtures of mkimage.py, the Debian layout, unpacks by
//! umoci and ociunpack.py, and reading and writing OCI layouts.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use super::{
    command, lamina, mounts_under, oci_ref, python, repo_file, run, tool, TestDir, TIMEOUT,
};
use serde_json::Value;

// ---------------------------------------------------------------------------
// fixtures

fn fixture_root() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("lamina-fixtures")
}

/// Removes the fixture dirs (`<binary>-<pid>`) of every earlier test run
/// whose process is gone, whichever binary made it: the binaries run one
/// after another, so a full run keeps one binary's fixtures on disk, not all
/// of them (~0.3-0.5 GB each).
fn remove_stale_fixtures(root: &Path) {
    let Ok(entries) = fs::read_dir(root) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .rsplit_once('-')
            .and_then(|(_, p)| p.parse::<u32>().ok())
        else {
            continue;
        };
        if pid != std::process::id()
            && !Path::new(&format!("/proc/{pid}")).exists()
            && mounts_under(&e.path()).is_empty()
        {
            let _ = fs::remove_dir_all(e.path());
        }
    }
}

/// The fixture directory of this test binary, built once on first use with
/// `tests/fixtures/mkimage.py all DIR`: `DIR/edge` (tags edge, edge-gz, and
/// `edge.docker.tar`), `DIR/hostile` (+ `hostile.json`), `DIR/misc`.
#[track_caller]
pub fn fixtures() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let root = fixture_root();
        fs::create_dir_all(&root).unwrap_or_else(|e| panic!("mkdir {}: {e}", root.display()));
        let stem = std::env::current_exe()
            .ok()
            .and_then(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "tests".into());
        remove_stale_fixtures(&root);
        let dir = root.join(format!("{stem}-{}", std::process::id()));
        if dir.exists() {
            fs::remove_dir_all(&dir).unwrap_or_else(|e| panic!("rm {}: {e}", dir.display()));
        }
        let out = python(
            "tests/fixtures/mkimage.py",
            [OsStr::new("all"), dir.as_os_str()],
            TIMEOUT,
        )
        .ok();
        for p in [
            "edge/index.json",
            "edge/edge.docker.tar",
            "hostile/hostile.json",
            "misc/index.json",
        ] {
            assert!(
                dir.join(p).is_file(),
                "mkimage.py did not write {p}:\n{}",
                out.describe()
            );
        }
        dir
    })
}

/// misc's `minimal` image converted into `t/out`, checked to have no
/// xattrs (its manifest says so, which the mounts act on): its reference.
pub fn converted_without_xattrs(t: &TestDir) -> String {
    let image = oci_ref(&t.join("out"), "minimal");
    let misc = fixtures().join("misc");
    let report = lamina(["convert", "--json", &oci_ref(&misc, "minimal"), &image])
        .ok()
        .json();
    assert_eq!(report["stats"]["xattr_inodes"], 0, "{report}");
    image
}

/// `python3 -c SCRIPT` chrooted into `root` (a Debian image's tree) prints
/// `ok`, with a clean environment.
#[track_caller]
pub fn python3_prints_ok(root: &Path, script: &str) {
    let mut chroot = command(
        tool("chroot"),
        [
            root.as_os_str(),
            "/usr/bin/python3".as_ref(),
            "-c".as_ref(),
            script.as_ref(),
        ],
    );
    chroot
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("LC_ALL", "C");
    let o = run(&mut chroot, TIMEOUT).ok();
    assert_eq!(
        o.stdout,
        "ok\n",
        "python3 in the image mounted at {}:\n{}",
        root.display(),
        o.describe()
    );
}

/// `FIX/edge` (an OCI layout with tags edge and edge-gz).
pub fn edge_layout() -> PathBuf {
    fixtures().join("edge")
}

/// treecmp options for comparing with umoci's unpack of edge: umoci drops
/// xattrs whose value is empty (Go's archive/tar reads an empty PAX value as
/// "unset"); compare with ociunpack.py, which keeps them, without ignores.
pub const UMOCI_IGNORES: &[&str] = &[
    "--ignore-xattr",
    "user.empty",
    "--ignore-xattr",
    "trusted.empty",
];

/// The rootfs of `umoci unpack --image FIX/edge:edge-gz`, built once per
/// test binary (umoci cannot read the zstd layers of tag edge).
#[track_caller]
pub fn umoci_edge_rootfs() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let bundle = fixtures().join("umoci-edge-gz");
        umoci_unpack(&format!("{}:edge-gz", edge_layout().display()), &bundle)
    })
}

/// `umoci unpack --image IMAGE BUNDLE`; returns `BUNDLE/rootfs`.
#[track_caller]
pub fn umoci_unpack(image: &str, bundle: &Path) -> PathBuf {
    let mut c = command(
        tool("umoci"),
        [
            OsStr::new("unpack"),
            OsStr::new("--image"),
            OsStr::new(image),
            bundle.as_os_str(),
        ],
    );
    run(&mut c, TIMEOUT).ok();
    let rootfs = bundle.join("rootfs");
    assert!(rootfs.is_dir(), "umoci unpack made no {}", rootfs.display());
    rootfs
}

/// The rootfs of `tests/tools/ociunpack.py LAYOUT:TAG`, built once per test
/// binary and image.
#[track_caller]
pub fn ociunpack(layout: &Path, tag: &str) -> PathBuf {
    static DONE: Mutex<BTreeMap<String, PathBuf>> = Mutex::new(BTreeMap::new());
    let key = format!("{}:{tag}", layout.display());
    let mut done = DONE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = done.get(&key) {
        return p.clone();
    }
    let dest = fixtures().join("ociunpack").join(format!(
        "{}-{tag}",
        layout.file_name().unwrap().to_string_lossy()
    ));
    if dest.exists() {
        fs::remove_dir_all(&dest).unwrap_or_else(|e| panic!("rm {}: {e}", dest.display()));
    }
    fs::create_dir_all(dest.parent().unwrap()).unwrap();
    python(
        "tests/tools/ociunpack.py",
        [OsStr::new(&key), dest.as_os_str()],
        TIMEOUT,
    )
    .ok();
    done.insert(key, dest.clone());
    dest
}

/// The parsed `FIX/hostile/hostile.json`.
pub fn hostile_descriptions() -> Vec<Value> {
    let p = fixtures().join("hostile/hostile.json");
    let v: Value = serde_json::from_slice(&fs::read(&p).unwrap()).unwrap();
    v.as_array().expect("hostile.json is an array").clone()
}

/// The reference Debian OCI layout (tag `bookworm`): `$LAMINA_DEBIAN_OCI`,
/// else `/var/cache/lamina-test/debian-oci`, built by scripts/debian-image.sh
/// once per machine (~2 min; a no-op when cached).
#[track_caller]
pub fn debian_source() -> PathBuf {
    let layout = std::env::var_os("LAMINA_DEBIAN_OCI")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/lamina-test/debian-oci"));
    let mut c = command(
        "bash",
        [
            repo_file("scripts/debian-image.sh").as_os_str(),
            layout.as_os_str(),
        ],
    );
    run(&mut c, Duration::from_secs(1800)).ok();
    layout
}

// ---------------------------------------------------------------------------
// OCI layouts

/// `tag -> manifest digest` of a layout's index.json (empty if absent).
pub fn layout_tags(dir: &Path) -> BTreeMap<String, String> {
    let Ok(bytes) = fs::read(dir.join("index.json")) else {
        return BTreeMap::new();
    };
    let v: Value = serde_json::from_slice(&bytes)
        .unwrap_or_else(|e| panic!("{}/index.json is not JSON: {e}", dir.display()));
    v["manifests"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| {
            Some((
                m["annotations"]["org.opencontainers.image.ref.name"]
                    .as_str()?
                    .to_string(),
                m["digest"].as_str()?.to_string(),
            ))
        })
        .collect()
}

/// Path of a blob in a layout.
pub fn blob_path(dir: &Path, digest: &str) -> PathBuf {
    let hex = digest
        .strip_prefix("sha256:")
        .unwrap_or_else(|| panic!("not a sha256 digest: {digest}"));
    dir.join("blobs/sha256").join(hex)
}

/// The manifest of `tag` in a layout.
#[track_caller]
pub fn read_manifest(dir: &Path, tag: &str) -> Value {
    let tags = layout_tags(dir);
    let digest = tags.get(tag).unwrap_or_else(|| {
        panic!(
            "tag {tag} not in {}/index.json (tags: {tags:?})",
            dir.display()
        )
    });
    serde_json::from_slice(&fs::read(blob_path(dir, digest)).unwrap()).unwrap()
}

/// sha256 hex of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest as _;
    sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Writes `bytes` as a blob of the layout `dir`; its digest.
pub fn put_blob(dir: &Path, bytes: &[u8]) -> String {
    let digest = format!("sha256:{}", sha256_hex(bytes));
    fs::write(blob_path(dir, &digest), bytes).unwrap();
    digest
}

/// Writes `manifest` into the layout `dir` and tags it `new_tag`, with the
/// index entry of `tag` (media type, platform) as its model.
pub fn tag_manifest(dir: &Path, tag: &str, new_tag: &str, manifest: &Value) {
    let bytes = serde_json::to_vec(manifest).unwrap();
    let digest = put_blob(dir, &bytes);
    let mut index: Value =
        serde_json::from_slice(&fs::read(dir.join("index.json")).unwrap()).unwrap();
    let entries = index["manifests"].as_array_mut().unwrap();
    let mut entry = entries
        .iter()
        .find(|m| m["annotations"]["org.opencontainers.image.ref.name"] == tag)
        .unwrap_or_else(|| panic!("tag {tag} not in {}/index.json", dir.display()))
        .clone();
    entry["digest"] = digest.into();
    entry["size"] = bytes.len().into();
    entry["annotations"]["org.opencontainers.image.ref.name"] = new_tag.into();
    entries.push(entry);
    fs::write(dir.join("index.json"), serde_json::to_vec(&index).unwrap()).unwrap();
}
