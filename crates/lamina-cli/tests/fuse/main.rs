//! `lamina mount --mode fuse`: the edge fixture served by the FUSE daemon,
//! eagerly and lazily, must be the tree two independent unpackers produce.

#[path = "../common/mod.rs"]
mod common;

mod eager;
mod lazy;
mod rootless;

use std::fs;
use std::path::Path;
use std::time::Duration;

use common::*;

/// The filesystem type mounted at `mnt` (from /proc/self/mounts).
fn fs_type(mnt: &Path) -> Option<String> {
    let canonical = fs::canonicalize(mnt).ok()?;
    let mounts = fs::read_to_string("/proc/self/mounts").ok()?;
    // The last mount at a path is the one seen there.
    mounts.lines().rev().find_map(|l| {
        let f: Vec<&str> = l.split(' ').collect();
        (f.len() > 2 && Path::new(f[1]) == canonical).then(|| f[2].to_string())
    })
}

/// Pids of FUSE daemons serving from `cache`.
fn fuse_daemons(cache: &Path) -> Vec<u32> {
    let needle = format!("internal-fuse\0{}", cache.display());
    fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(&needle))
        })
        .collect()
}

/// The worker's status of a lazy mount, once it has written one (it writes
/// within ~25 ms of a change).
#[track_caller]
fn worker_status(m: &Mount) -> serde_json::Value {
    let started = std::time::Instant::now();
    loop {
        std::thread::sleep(Duration::from_millis(100));
        let s = m.status().map(|e| e["status"].clone());
        if let Some(s) = s.filter(|s| s.is_object()) {
            return s;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "no worker status for {} in 10 s",
            m.path.display()
        );
    }
}

/// The edge fixture converted into `t/out`: its reference.
fn converted_edge(t: &TestDir) -> String {
    let image = oci_ref(&t.join("out"), "edge");
    lamina(["convert", &oci_ref(&edge_layout(), "edge"), &image]).ok();
    image
}

/// What the FUSE daemon logs when it answers lookups through the table.
const LOOKUP_TABLE_LINE: &str = "lookups through the lookup table";

/// A copy of `tag` in the layout `dir`, tagged `new_tag`, as images were
/// before lookup tables: no lookup layer, format version 2.
fn without_lookup_layer(dir: &Path, tag: &str, new_tag: &str) {
    let mut manifest = read_manifest(dir, tag);
    let layers = manifest["layers"].as_array_mut().unwrap();
    let lookup = "application/vnd.oci.image.layer.lamina.lookup.v1+zstd";
    let at = layers.iter().position(|l| l["mediaType"] == lookup);
    let removed = layers.remove(at.expect("the image has a lookup layer"));
    manifest["annotations"]["dev.lamina.format"] = "2".into();
    // The config lists the layers too.
    let config_path = blob_path(dir, manifest["config"]["digest"].as_str().unwrap());
    let mut config: serde_json::Value =
        serde_json::from_slice(&fs::read(config_path).unwrap()).unwrap();
    let diff_ids = config["rootfs"]["diff_ids"].as_array_mut().unwrap();
    diff_ids.retain(|d| *d != removed["digest"]);
    let config = serde_json::to_vec(&config).unwrap();
    manifest["config"]["digest"] = put_blob(dir, &config).into();
    manifest["config"]["size"] = config.len().into();
    tag_manifest(dir, tag, new_tag, &manifest);
}
