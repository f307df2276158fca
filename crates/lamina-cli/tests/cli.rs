//! The command line itself: JSON reports (fields present, values consistent
//! across convert, inspect, mount, umount and with the OCI layout), exit
//! codes, umount of something that is not mounted.

mod common;

use std::fs;
use std::path::Path;

use common::*;
use serde_json::Value;

fn is_digest(v: &Value) -> bool {
    v.as_str().is_some_and(|s| {
        s.strip_prefix("sha256:").is_some_and(|h| {
            h.len() == 64
                && h.bytes()
                    .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
        })
    })
}

#[track_caller]
fn u64_field(doc: &Value, path: &[&str]) -> u64 {
    let mut v = doc;
    for p in path {
        v = &v[*p];
    }
    v.as_u64()
        .unwrap_or_else(|| panic!("{path:?} is not an unsigned integer in {doc:#}"))
}

// Over 100 lines: every command's --json report checked against the others on the same images
// (split, each part would convert them again).
#[test]
fn json_reports_are_complete_and_consistent() {
    if !require(&[]) {
        return;
    }
    let misc = fixtures().join("misc");
    let t = TestDir::new("json");
    let out = t.join("out");
    let image = oci_ref(&out, "minimal");

    // convert --json
    let r = lamina(["convert", "--json", &oci_ref(&misc, "minimal"), &image])
        .ok()
        .json();
    for key in ["manifest_digest", "source_manifest_digest"] {
        assert!(
            is_digest(&r[key]),
            "convert --json: {key} is not a digest: {r:#}"
        );
    }
    let metadata_bytes = u64_field(&r, &["metadata_bytes"]);
    assert!(
        metadata_bytes > 0 && metadata_bytes & 4095 == 0,
        "metadata_bytes {metadata_bytes}"
    );
    for key in [
        "entries",
        "files",
        "file_bytes",
        "chunks_stored",
        "stored_bytes",
        "compressed_bytes",
    ] {
        u64_field(&r, &["stats", key]);
    }
    assert_eq!(
        u64_field(&r, &["stats", "files"]),
        2,
        "minimal has 2 files: {r:#}"
    );
    assert!(
        r["dedup_ratio"].is_f64() || r["dedup_ratio"].is_u64(),
        "dedup_ratio: {r:#}"
    );
    assert!(
        r["seconds"].as_f64().is_some_and(|s| s >= 0.0),
        "seconds: {r:#}"
    );
    let blobs = r["blobs"]
        .as_array()
        .unwrap_or_else(|| panic!("blobs is not an array: {r:#}"));
    assert!(!blobs.is_empty(), "no data blobs: {r:#}");
    for b in blobs {
        assert!(is_digest(&b["digest"]), "blob digest: {b}");
        u64_field(b, &["size"]);
        u64_field(b, &["cache_size"]);
    }
    let digest = r["manifest_digest"].as_str().unwrap();
    let source = layout_tags(&misc)["minimal"].clone();
    assert_eq!(r["source_manifest_digest"], source.as_str());

    // ... agrees with the layout
    assert_eq!(layout_tags(&out)["minimal"], digest, "index.json tag");
    let manifest = read_manifest(&out, "minimal");
    let data_layers: Vec<&Value> = manifest["layers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|l| {
            l["mediaType"]
                .as_str()
                .is_some_and(|m| m.contains("lamina.blob"))
        })
        .collect();
    assert_eq!(data_layers.len(), blobs.len(), "manifest {manifest:#}");
    for (l, b) in data_layers.iter().zip(blobs) {
        assert_eq!(l["digest"], b["digest"]);
        assert_eq!(l["size"], b["size"]);
        let p = blob_path(&out, l["digest"].as_str().unwrap());
        assert_eq!(
            fs::metadata(&p).unwrap().len(),
            u64_field(b, &["size"]),
            "{}",
            p.display()
        );
    }

    // inspect --json
    let i = lamina(["inspect", "--json", &image]).ok().json();
    assert_eq!(i["lamina"], true, "{i:#}");
    assert_eq!(i["manifest_digest"], r["manifest_digest"]);
    assert_eq!(i["source_manifest_digest"], r["source_manifest_digest"]);
    assert_eq!(i["metadata_bytes"], r["metadata_bytes"]);
    assert_eq!(i["entries"], r["stats"]["entries"]);
    assert_eq!(i["files"], r["stats"]["files"]);
    assert_eq!(i["file_bytes"], r["stats"]["file_bytes"]);
    assert_eq!(i["chunk_size"], 262144, "the default chunk size");
    let inspect_blobs: Vec<&Value> = i["blobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| &b["digest"])
        .collect();
    let report_blobs: Vec<&Value> = blobs.iter().map(|b| &b["digest"]).collect();
    assert_eq!(inspect_blobs, report_blobs);

    // inspect --json of a plain image lists its layers
    let p = lamina(["inspect", "--json", &oci_ref(&misc, "minimal")])
        .ok()
        .json();
    assert_eq!(p["lamina"], false, "{p:#}");
    assert_eq!(p["manifest_digest"], source.as_str());
    let src_manifest = read_manifest(&misc, "minimal");
    let plain: Vec<&Value> = p["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| &l["digest"])
        .collect();
    let want: Vec<&Value> = src_manifest["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| &l["digest"])
        .collect();
    assert_eq!(plain, want);
    for l in p["layers"].as_array().unwrap() {
        assert!(
            is_digest(&l["diff_id"]) && l["media_type"].is_string() && l["size"].is_u64(),
            "{l}"
        );
    }

    // mount --json
    let cache = t.join("cache");
    let mnt = t.join("mnt");
    let m = Mount::new(&image, &mnt, &cache);
    let info = m.info.clone();
    assert_eq!(
        info["mountpoint"].as_str().map(Path::new),
        Some(mnt.canonicalize().unwrap().as_path()),
        "{info:#}"
    );
    assert_eq!(info["manifest_digest"], r["manifest_digest"]);
    assert_eq!(
        fs::metadata(m.metadata_path()).unwrap().len(),
        metadata_bytes
    );
    let paths = m.blob_paths();
    assert_eq!(paths.len(), blobs.len());
    for (p, b) in paths.iter().zip(blobs) {
        let hex = b["digest"].as_str().unwrap().trim_start_matches("sha256:");
        assert!(
            p.to_string_lossy().contains(hex),
            "blob_paths out of order: {paths:?}"
        );
        assert!(
            p.starts_with(&cache),
            "{} is not in the cache dir",
            p.display()
        );
        assert_eq!(
            fs::metadata(p).unwrap().len(),
            u64_field(b, &["cache_size"]),
            "{}",
            p.display()
        );
    }
    let total: u64 = blobs.iter().map(|b| u64_field(b, &["size"])).sum();
    assert_eq!(
        u64_field(&info, &["fetched_bytes"]),
        total,
        "a first mount fetches every blob"
    );
    assert_eq!(fs::read(mnt.join("hello")).unwrap(), b"hello world\n");
    assert_eq!(fs::read(mnt.join("etc/hostname")).unwrap(), b"minimal\n");

    // A second mount from the same cache fetches nothing.
    let m2 = Mount::new(&image, &t.join("mnt2"), &cache);
    assert_eq!(u64_field(&m2.info, &["fetched_bytes"]), 0, "{:#}", m2.info);
    assert_eq!(m2.info["blob_paths"], info["blob_paths"]);

    // status --json: an array (no lazy mounts here)
    let s = lamina(["status", "--json", "--cache-dir", cache.to_str().unwrap()])
        .ok()
        .json();
    assert!(s.is_array(), "status --json: {s:#}");

    // umount --json
    let u = m2.unmount();
    assert!(u.get("unmounted").is_some(), "umount --json: {u:#}");
    let u = m.unmount();
    assert_eq!(
        u["unmounted"]
            .as_str()
            .map(Path::new)
            .map(|p| p.ends_with("mnt")),
        Some(true),
        "{u:#}"
    );
}

#[test]
fn umount_of_a_non_mountpoint_fails() {
    if !require(&[]) {
        return;
    }
    let t = TestDir::new("umount");
    let dir = t.mkdir("not-mounted");
    let cache = t.join("cache");
    for p in [dir.clone(), t.join("does-not-exist")] {
        let o = lamina([
            "umount",
            p.to_str().unwrap(),
            "--cache-dir",
            cache.to_str().unwrap(),
        ])
        .failed();
        assert!(
            o.stderr.contains(p.to_str().unwrap()),
            "the message should name the path:\n{}",
            o.describe()
        );
        let o = lamina([
            "umount",
            "--json",
            p.to_str().unwrap(),
            "--cache-dir",
            cache.to_str().unwrap(),
        ])
        .failed();
        assert!(
            o.stdout.trim().is_empty() || serde_json::from_str::<Value>(&o.stdout).is_ok(),
            "{}",
            o.describe()
        );
    }
    assert!(dir.is_dir(), "umount removed the directory");
}

/// convert and inspect describe the same image; their dedup ratios (chunk
/// bytes the tree references / bytes stored) must agree. edge has sparse
/// files and files deleted by later layers, where the two can drift apart.
#[test]
fn inspect_agrees_with_the_convert_report() {
    if !require(&["zstd"]) {
        return;
    }
    let t = TestDir::new("dedup");
    let image = oci_ref(&t.join("out"), "edge");
    let r = lamina([
        "convert",
        "--json",
        &oci_ref(&edge_layout(), "edge"),
        &image,
    ])
    .ok()
    .json();
    let i = lamina(["inspect", "--json", &image]).ok().json();
    let mut f = Failures::default();
    for (ik, rk) in [
        ("entries", "entries"),
        ("files", "files"),
        ("file_bytes", "file_bytes"),
        ("chunks", "chunks_stored"),
        ("stored_bytes", "stored_bytes"),
        ("compressed_bytes", "compressed_bytes"),
    ] {
        f.check(i[ik] == r["stats"][rk], || {
            format!(
                "inspect {ik} = {}, convert stats.{rk} = {}",
                i[ik], r["stats"][rk]
            )
        });
    }
    let (a, b) = (
        r["dedup_ratio"].as_f64().unwrap_or(f64::NAN),
        i["dedup_ratio"].as_f64().unwrap_or(f64::NAN),
    );
    f.check((a - b).abs() < 1e-9, || {
        format!(
            "dedup_ratio: convert --json says {a} (referenced_bytes {} / stored_bytes {}), inspect --json says {b} \
             (file_bytes {} / stored_bytes {})",
            r["stats"]["referenced_bytes"], r["stats"]["stored_bytes"], i["file_bytes"], i["stored_bytes"]
        )
    });
    f.finish("inspect vs convert");
}

/// Exit codes: 2 usage / bad reference, 3 content refused, 4 not found.
// Over 100 lines: a table of commands and the exit code each must give.
#[test]
fn exit_codes_for_local_images() {
    if !require(&[]) {
        return;
    }
    let fix = fixtures();
    let misc = fix.join("misc");
    let t = TestDir::new("exit");
    let mnt = t.mkdir("mnt");
    let cache = t.join("cache");
    let out = t.join("out");
    let (mnt_s, cache_s) = (
        mnt.to_str().unwrap().to_string(),
        cache.to_str().unwrap().to_string(),
    );
    let dst = oci_ref(&out, "x");
    let missing_dir = t.join("no-such-layout");
    let missing_tar = t.join("no-such.tar");
    let archive = fix.join("edge/edge.docker.tar");
    let mut f = Failures::default();
    let mut expect = |code: i32, why: &str, args: Vec<String>| {
        let _unmount_if_mounted = MountWatch(mnt.clone(), cache.clone());
        let o = lamina(&args);
        f.check(
            o.code() == Some(code) && !o.stderr.trim().is_empty(),
            || {
                format!(
                    "{why}: expected exit {code} with a message:\n{}",
                    o.describe()
                )
            },
        );
        f.check(!is_mountpoint(&mnt), || {
            format!("{why}: {} got mounted", mnt.display())
        });
    };
    let s = |v: &str| v.to_string();
    let mount = |img: String| {
        vec![
            s("mount"),
            img,
            mnt_s.clone(),
            s("--cache-dir"),
            cache_s.clone(),
        ]
    };

    // 2: usage and references
    expect(2, "unknown subcommand", vec![s("frobnicate")]);
    expect(
        2,
        "missing argument",
        vec![s("convert"), oci_ref(&misc, "minimal")],
    );
    expect(2, "unknown transport", vec![s("inspect"), s("tarball:/x")]);
    expect(
        2,
        "empty oci dir",
        vec![s("convert"), s("oci:"), dst.clone()],
    );
    expect(
        2,
        "bad destination",
        vec![
            s("convert"),
            oci_ref(&misc, "minimal"),
            s("docker://127.0.0.1:1/UPPER"),
        ],
    );
    expect(
        2,
        "--chunk-size not a power of two",
        vec![
            s("convert"),
            s("--chunk-size"),
            s("1000"),
            oci_ref(&misc, "minimal"),
            dst.clone(),
        ],
    );
    expect(
        2,
        "--chunk-size too large",
        vec![
            s("convert"),
            s("--chunk-size"),
            s("33554432"),
            oci_ref(&misc, "minimal"),
            dst.clone(),
        ],
    );

    // 4: not found
    for (what, img) in [
        ("missing tag", oci_ref(&misc, "no-such-tag")),
        ("missing layout dir", oci_ref(&missing_dir, "x")),
        (
            "missing docker archive",
            format!("docker-archive:{}", missing_tar.display()),
        ),
        (
            "missing image in a docker archive",
            format!("docker-archive:{}:nope:latest", archive.display()),
        ),
    ] {
        expect(
            4,
            &format!("inspect, {what}"),
            vec![s("inspect"), img.clone()],
        );
        expect(
            4,
            &format!("convert, {what}"),
            vec![s("convert"), img.clone(), dst.clone()],
        );
        expect(4, &format!("mount, {what}"), mount(img.clone()));
    }

    // 3: a plain (not converted) image is refused by mount
    expect(
        3,
        "mount of a plain OCI image",
        mount(oci_ref(&misc, "minimal")),
    );

    f.check(layout_tags(&out).is_empty(), || {
        format!("failed conversions left tags in {}", out.display())
    });
    f.finish("exit codes");
}
