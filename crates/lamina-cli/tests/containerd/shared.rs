//! Issue 43: `lamina snapshotter --share-files`. Two lamina images of the
//! same files in other blobs (the second converted without packing), run
//! through containerd: each image's mount is a view over the cache's
//! shards, and the second reads the files it shares with the first through
//! the first's shard: python3.11 is one object for both.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::common::*;
use crate::fixture::images;
use crate::node::Node;
use crate::{Version, LAMINA_IMAGE, SRC_TAG};
use serde_json::Value;

/// The views' run dirs under the snapshotter's cache (`mounts/*/view.json`).
fn views(cache: &Path) -> Vec<(PathBuf, Value)> {
    let runs = fs::read_dir(cache.join("mounts"))
        .into_iter()
        .flatten()
        .flatten();
    runs.filter_map(|e| {
        let record = fs::read(e.path().join("view.json")).ok()?;
        Some((e.path(), serde_json::from_slice(&record).ok()?))
    })
    .collect()
}

/// Where `view` (a run dir) takes `path`'s data from.
fn redirect(view: &Path, path: &str) -> Option<String> {
    let mut buf = vec![0u8; 512];
    let n = rustix::fs::lgetxattr(
        view.join("view").join(path),
        "trusted.overlay.redirect",
        &mut buf,
    )
    .ok()?;
    Some(String::from_utf8_lossy(&buf[..n]).into_owned())
}

fn shared_files_through_containerd(version: Version) {
    let Some(node) = Node::start_with(version, false, &["--share-files", "--mode", "kernel"])
    else {
        return;
    };
    let unpacked = "deb:unpacked";
    lamina_timeout(
        [
            "convert",
            "--pack-limit",
            "0",
            &oci_ref(&images().source, SRC_TAG),
            &format!("docker://{}", node.image(unpacked)),
        ],
        Duration::from_secs(1200),
    )
    .ok();
    let mut f = Failures::default();
    for (tag, id) in [(LAMINA_IMAGE, "first"), (unpacked, "second")] {
        let pulled = node.pull(tag);
        f.check(pulled.status.success(), || {
            format!("pull {tag}:\n{}", pulled.describe())
        });
        let out = node.run_rm(tag, id, &["python3", "-c", "print(6 * 7)"]);
        f.check(out.status.success() && out.stdout.trim() == "42", || {
            format!("python3 from {tag}:\n{}", out.describe())
        });
    }
    f.finish("containers with --share-files");
    let cache = node.t.join("snapshotter").join("cache");
    let views = views(&cache);
    assert_eq!(views.len(), 2, "views: {views:?}");
    let (one, two) = if views[0].1["shards"].as_array().unwrap().len() == 1 {
        (&views[0], &views[1])
    } else {
        (&views[1], &views[0])
    };
    let first_own = one.1["shards"][0].clone();
    assert_eq!(
        two.1["shards"][0], first_own,
        "the second view stacks the first's shard first"
    );
    let python = "usr/bin/python3.11";
    let (a, b) = (redirect(&one.0, python), redirect(&two.0, python));
    assert!(a.is_some() && a == b, "python3.11: {a:?} and {b:?}");
}

#[test]
fn containerd_2_shares_files_across_images() {
    shared_files_through_containerd(Version::V2);
}
