//! Conversion is a pure function of the image content: the same source gives
//! byte-identical metadata, index and data blobs, whatever the destination
//! and whatever the source transport (OCI layout or `docker save` archive).

mod common;

use std::collections::BTreeMap;

use common::*;
use serde_json::Value;

const SOURCE_ANNOTATION: &str = "dev.lamina.source.manifest";

fn layer_digests(manifest: &Value) -> Vec<String> {
    manifest["layers"]
        .as_array()
        .unwrap_or_else(|| panic!("manifest without layers: {manifest}"))
        .iter()
        .map(|l| l["digest"].as_str().unwrap().to_string())
        .collect()
}

fn inspect_blobs(image: &str) -> (Value, Vec<String>) {
    let doc = lamina(["inspect", "--json", image]).ok().json();
    assert_eq!(doc["lamina"], true, "inspect {image}: {doc}");
    let blobs = doc["blobs"]
        .as_array()
        .unwrap_or_else(|| panic!("inspect {image}: no blobs array: {doc}"))
        .iter()
        .map(|b| b["digest"].as_str().unwrap().to_string())
        .collect();
    (doc, blobs)
}

/// Every blob a manifest names, with its sha256, read from the layout.
fn blob_hashes(dir: &std::path::Path, manifest: &Value) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let config = manifest["config"]["digest"].as_str().unwrap().to_string();
    for d in layer_digests(manifest).into_iter().chain([config]) {
        let p = blob_path(dir, &d);
        let h = format!("sha256:{}", sha256_file(&p));
        assert_eq!(h, d, "blob {} does not hash to its name", p.display());
        out.insert(d, h);
    }
    out
}

#[test]
fn conversion_is_reproducible_across_destinations_and_transports() {
    if !require(&["zstd"]) {
        return;
    }
    let t = TestDir::new("repro");
    let src = oci_ref(&edge_layout(), "edge");
    let (a, b, c) = (t.join("a"), t.join("b"), t.join("c"));
    // Different layouts, tags and work dirs.
    let ra = lamina(["convert", "--json", &src, &oci_ref(&a, "one")])
        .ok()
        .json();
    let work = t.mkdir("work");
    let rb = lamina([
        "convert",
        "--json",
        "--work-dir",
        work.to_str().unwrap(),
        &src,
        &oci_ref(&b, "two"),
    ])
    .ok()
    .json();
    assert_eq!(
        ra["manifest_digest"], rb["manifest_digest"],
        "two conversions of the same image differ"
    );
    assert_eq!(
        layout_tags(&a)["one"],
        ra["manifest_digest"].as_str().unwrap()
    );
    assert_eq!(
        layout_tags(&b)["two"],
        rb["manifest_digest"].as_str().unwrap()
    );
    let (ma, mb) = (read_manifest(&a, "one"), read_manifest(&b, "two"));
    assert_eq!(ma, mb);
    assert_eq!(blob_hashes(&a, &ma), blob_hashes(&b, &mb));
    assert_eq!(
        std::fs::read_dir(&work).unwrap().count(),
        0,
        "--work-dir {} not cleaned up",
        work.display()
    );

    // docker-archive: same tree, other source manifest.
    let archive = format!(
        "docker-archive:{}",
        edge_layout().join("edge.docker.tar").display()
    );
    let rc = lamina(["convert", "--json", &archive, &oci_ref(&c, "three")])
        .ok()
        .json();
    let mc = read_manifest(&c, "three");
    assert_eq!(
        layer_digests(&ma),
        layer_digests(&mc),
        "oci: and docker-archive: conversions of the same image give other layers"
    );
    assert_eq!(ma["config"], mc["config"], "config descriptors differ");
    assert_ne!(
        ma["annotations"][SOURCE_ANNOTATION], mc["annotations"][SOURCE_ANNOTATION],
        "the source annotation should name each source's own manifest"
    );
    let strip = |m: &Value| {
        let mut m = m.clone();
        m["annotations"]
            .as_object_mut()
            .expect("manifest annotations")
            .remove(SOURCE_ANNOTATION);
        m
    };
    assert_eq!(
        strip(&ma),
        strip(&mc),
        "the manifests should differ only by {SOURCE_ANNOTATION}"
    );
    assert_eq!(ra["metadata_bytes"], rc["metadata_bytes"]);
    assert_eq!(ra["blobs"], rc["blobs"]);

    // inspect agrees on the data blobs, in order.
    let (ia, blobs_a) = inspect_blobs(&oci_ref(&a, "one"));
    let (ic, blobs_c) = inspect_blobs(&oci_ref(&c, "three"));
    assert!(!blobs_a.is_empty());
    assert_eq!(blobs_a, blobs_c);
    let report_blobs: Vec<_> = ra["blobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["digest"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        blobs_a, report_blobs,
        "inspect and convert list other blobs"
    );
    assert_eq!(ia["metadata_bytes"], ic["metadata_bytes"]);
    assert_eq!(ia["source_manifest_digest"], ra["source_manifest_digest"]);
}
