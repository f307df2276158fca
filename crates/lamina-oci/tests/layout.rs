//! OCI layout sink and source.

mod common;

use std::fs;
use std::path::Path;

use common::{check_layers, drain, TestImage};
use lamina_oci::layout::{blob_path, OciLayoutSink};
use lamina_oci::{
    media_types as mt, open_sink, open_source, Descriptor, Digest, ImageIndex, ImageRef, ImageSink,
    OciError, Platform, SourceOptions,
};

fn oci(dir: &Path, tag: Option<&str>) -> ImageRef {
    ImageRef::Oci {
        dir: dir.to_path_buf(),
        tag: tag.map(str::to_string),
    }
}

fn index_of(dir: &Path) -> ImageIndex {
    serde_json::from_slice(&fs::read(dir.join("index.json")).expect("index")).expect("parse")
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .expect("readdir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn round_trip_and_tag_replacement() {
    let tmp = tempfile::tempdir().expect("tmp");
    let dir = tmp.path().join("layout");
    let opts = SourceOptions::default();

    let img1 = TestImage::simple("one");
    let d1 = img1.push(
        open_sink(&oci(&dir, Some("v1")), &opts).expect("sink"),
        tmp.path(),
    );
    assert_eq!(d1, img1.manifest_digest());
    assert_eq!(names(&dir), vec!["blobs", "index.json", "oci-layout"]);

    let src = open_source(&oci(&dir, Some("v1")), &opts).expect("source");
    let image = src.image();
    assert_eq!(image.manifest_digest, d1);
    assert_eq!(image.manifest_bytes, img1.manifest_bytes);
    assert_eq!(image.config_bytes, img1.config);
    assert_eq!(image.config["config"]["Env"][0], "MARKER=one");
    assert_eq!(
        image.layers[0].diff_id,
        Digest::of_bytes(&img1.layers[0].tar)
    );
    check_layers(src.as_ref(), &img1);
    let cfg = drain(&mut src.open_blob(&img1.config_desc).expect("blob")).expect("read");
    assert_eq!(cfg, img1.config);

    // Single image: no tag needed.
    let src = open_source(&oci(&dir, None), &opts).expect("untagged source");
    assert_eq!(src.image().manifest_digest, d1);

    // Second tag, then replace v1 with a different image.
    let img2 = TestImage::simple("two");
    img2.push(
        open_sink(&oci(&dir, Some("v2")), &opts).expect("sink"),
        tmp.path(),
    );
    let img3 = TestImage::simple("three");
    img3.push(
        open_sink(&oci(&dir, Some("v1")), &opts).expect("sink"),
        tmp.path(),
    );
    let index = index_of(&dir);
    let tags: Vec<(Option<&str>, &Digest)> = index
        .manifests
        .iter()
        .map(|d| (d.ref_name(), &d.digest))
        .collect();
    assert_eq!(tags.len(), 2, "{tags:?}");
    assert!(tags.contains(&(Some("v1"), &img3.manifest_digest())));
    assert!(tags.contains(&(Some("v2"), &img2.manifest_digest())));
    let src = open_source(&oci(&dir, Some("v1")), &opts).expect("v1");
    assert_eq!(src.image().config["config"]["Env"][0], "MARKER=three");
    check_layers(src.as_ref(), &img3);

    // Two images now: no tag is ambiguous, and the error lists the tags.
    let err = open_source(&oci(&dir, None), &opts).expect_err("ambiguous");
    let msg = err.to_string();
    assert!(msg.contains("v1") && msg.contains("v2"), "{msg}");
    let err = open_source(&oci(&dir, Some("nope")), &opts).expect_err("missing");
    assert!(matches!(err, OciError::NotFound { .. }), "{err}");

    // Default tag is "latest"; no staging dirs are left behind.
    img1.push(
        open_sink(&oci(&dir, None), &opts).expect("sink"),
        tmp.path(),
    );
    assert!(open_source(&oci(&dir, Some("latest")), &opts).is_ok());
    assert_eq!(names(&dir), vec!["blobs", "index.json", "oci-layout"]);
}

#[test]
fn dropped_sink_leaves_nothing() {
    let tmp = tempfile::tempdir().expect("tmp");
    let dir = tmp.path().join("new-layout");
    let img = TestImage::simple("x");
    {
        let mut sink = open_sink(&oci(&dir, Some("t")), &SourceOptions::default()).expect("sink");
        sink.put_blob_bytes(&img.config_desc, &img.config)
            .expect("put");
        sink.put_blob_bytes(&img.layers[0].descriptor, &img.layers[0].blob)
            .expect("put");
        assert!(dir.exists());
        // dropped without commit
    }
    assert!(!dir.exists(), "sink-created directory should be removed");

    // In an existing layout: the staging dir goes, existing content stays.
    let existing = tmp.path().join("existing");
    img.push(
        open_sink(&oci(&existing, Some("a")), &SourceOptions::default()).expect("s"),
        tmp.path(),
    );
    let before = index_of(&existing);
    let other = TestImage::simple("other");
    {
        let mut sink = OciLayoutSink::open(&existing, Some("a")).expect("sink");
        sink.put_blob_bytes(&other.config_desc, &other.config)
            .expect("put");
        assert_eq!(names(&existing).len(), 4, "staging dir while open");
    }
    assert_eq!(names(&existing), vec!["blobs", "index.json", "oci-layout"]);
    assert_eq!(index_of(&existing), before);
    assert!(!blob_path(&existing, &other.config_desc.digest).exists());
}

#[test]
fn sink_refuses_bad_blobs_and_incomplete_manifests() {
    let tmp = tempfile::tempdir().expect("tmp");
    let dir = tmp.path().join("l");
    let img = TestImage::simple("x");
    let mut sink = open_sink(&oci(&dir, None), &SourceOptions::default()).expect("sink");
    let mut wrong = img.config_desc.clone();
    wrong.digest = Digest::of_bytes(b"other");
    let err = sink
        .put_blob_bytes(&wrong, &img.config)
        .expect_err("digest");
    assert!(matches!(err, OciError::DigestMismatch { .. }), "{err}");
    let mut wrong = img.config_desc.clone();
    wrong.size += 1;
    let err = sink.put_blob_bytes(&wrong, &img.config).expect_err("size");
    assert!(matches!(err, OciError::SizeMismatch { .. }), "{err}");
    let p = tmp.path().join("f");
    fs::write(&p, b"not the layer").expect("write");
    let err = sink
        .put_blob(&img.layers[0].descriptor, &p)
        .expect_err("file digest");
    assert!(matches!(err, OciError::DigestMismatch { .. }), "{err}");

    // Config put, layers missing: commit refuses, nothing gets tagged.
    sink.put_blob_bytes(&img.config_desc, &img.config)
        .expect("put");
    let err = sink
        .commit(&img.manifest_bytes, mt::OCI_MANIFEST)
        .expect_err("incomplete");
    assert!(err.to_string().contains("references blob"), "{err}");
    assert!(!dir.exists());
}

#[test]
fn sink_refuses_foreign_directory() {
    let tmp = tempfile::tempdir().expect("tmp");
    fs::write(tmp.path().join("something"), b"x").expect("write");
    let err = open_sink(&oci(tmp.path(), None), &SourceOptions::default()).expect_err("refuse");
    assert!(matches!(err, OciError::Layout { .. }), "{err}");
}

/// Write a layout by hand: an index with platform entries under one tag.
#[test]
fn index_resolves_platform() {
    let tmp = tempfile::tempdir().expect("tmp");
    let dir = tmp.path().join("multi");
    let amd = TestImage::simple("amd64");
    let arm = TestImage::simple("arm64");
    let mut sink = OciLayoutSink::open(&dir, Some("multi")).expect("sink");
    let mut entries = Vec::new();
    for (img, arch) in [(&amd, "amd64"), (&arm, "arm64")] {
        for l in &img.layers {
            sink.put_blob_bytes(&l.descriptor, &l.blob).expect("layer");
        }
        sink.put_blob_bytes(&img.config_desc, &img.config)
            .expect("config");
        let mut d = Descriptor::of_bytes(mt::OCI_MANIFEST, &img.manifest_bytes);
        sink.put_blob_bytes(&d, &img.manifest_bytes)
            .expect("manifest");
        d.platform = Some(Platform {
            os: "linux".into(),
            architecture: arch.into(),
            ..Platform::default()
        });
        entries.push(d);
    }
    let index = ImageIndex {
        manifests: entries,
        ..ImageIndex::default()
    };
    let index_bytes = serde_json::to_vec(&index).expect("json");
    Box::new(sink)
        .commit(&index_bytes, mt::OCI_INDEX)
        .expect("commit");

    for (arch, img) in [("amd64", &amd), ("arm64", &arm)] {
        let opts = SourceOptions {
            platform: ("linux".into(), arch.into()),
            ..SourceOptions::default()
        };
        let src = open_source(&oci(&dir, Some("multi")), &opts).expect("source");
        assert_eq!(src.image().manifest_digest, img.manifest_digest(), "{arch}");
        check_layers(src.as_ref(), img);
    }
    let opts = SourceOptions {
        platform: ("linux".into(), "riscv64".into()),
        ..SourceOptions::default()
    };
    let err = open_source(&oci(&dir, Some("multi")), &opts).expect_err("no platform");
    assert!(matches!(err, OciError::NoMatchingPlatform { .. }), "{err}");
}

#[test]
fn source_verifies_blobs() {
    let tmp = tempfile::tempdir().expect("tmp");
    let dir = tmp.path().join("l");
    let img = TestImage::simple("x");
    img.push(
        open_sink(&oci(&dir, None), &SourceOptions::default()).expect("sink"),
        tmp.path(),
    );

    // Corrupt a layer blob in place (same size): detected while streaming.
    let layer = blob_path(&dir, &img.layers[1].descriptor.digest);
    let mut bytes = fs::read(&layer).expect("read");
    bytes[600] ^= 0xff;
    fs::write(&layer, &bytes).expect("write");
    let src = open_source(&oci(&dir, None), &SourceOptions::default()).expect("source");
    let err = drain(&mut src.open_layer(1).expect("open")).expect_err("corrupt");
    assert!(
        matches!(
            OciError::from_io(&err),
            Some(OciError::DigestMismatch { .. })
        ),
        "{err}"
    );
    let err =
        drain(&mut src.open_blob(&img.layers[1].descriptor).expect("open")).expect_err("corrupt");
    assert!(
        matches!(
            OciError::from_io(&err),
            Some(OciError::DigestMismatch { .. })
        ),
        "{err}"
    );
    assert!(matches!(
        src.open_layer(5),
        Err(OciError::LayerIndex { .. })
    ));

    // Corrupt the config: opening fails.
    let config = blob_path(&dir, &img.config_desc.digest);
    fs::write(&config, b"{}").expect("write");
    let err = open_source(&oci(&dir, None), &SourceOptions::default()).expect_err("config");
    assert!(matches!(err, OciError::SizeMismatch { .. }), "{err}");
}

#[test]
fn traversal_digest_in_index_is_rejected() {
    let tmp = tempfile::tempdir().expect("tmp");
    let dir = tmp.path();
    fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#).expect("w");
    fs::write(
        dir.join("index.json"),
        br#"{"schemaVersion":2,"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:../../x","size":2}]}"#,
    )
    .expect("w");
    let err = open_source(&oci(dir, None), &SourceOptions::default()).expect_err("traversal");
    assert!(err.to_string().contains("sha256:../../x"), "{err}");

    fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"2.0.0"}"#).expect("w");
    let err = open_source(&oci(dir, None), &SourceOptions::default()).expect_err("version");
    assert!(err.to_string().contains("imageLayoutVersion"), "{err}");
}

#[test]
fn sink_trait_object_is_debug() {
    let tmp = tempfile::tempdir().expect("tmp");
    let sink: Box<dyn ImageSink> =
        open_sink(&oci(&tmp.path().join("d"), None), &SourceOptions::default()).expect("sink");
    assert!(format!("{sink:?}").contains("OciLayoutSink"));
    let err = open_sink(
        &"docker-archive:/tmp/x.tar".parse().expect("ref"),
        &SourceOptions::default(),
    )
    .expect_err("archive sink");
    assert!(err.to_string().contains("not supported"), "{err}");
}

#[test]
fn stale_staging_of_dead_process_is_removed() {
    let tmp = tempfile::tempdir().expect("tmp");
    let dir = tmp.path().join("l");
    let img = TestImage::simple("x");
    img.push(
        open_sink(&oci(&dir, None), &SourceOptions::default()).expect("sink"),
        tmp.path(),
    );
    // PIDs are below 2^22 on Linux; this one cannot be alive.
    let stale = dir.join(".lamina-staging-99999999-abcdef");
    fs::create_dir(&stale).expect("mkdir");
    fs::write(stale.join("blob"), b"half").expect("write");
    let live = dir.join(format!(".lamina-staging-{}-keepme", std::process::id()));
    fs::create_dir(&live).expect("mkdir");
    let sink = OciLayoutSink::open(&dir, None).expect("sink");
    drop(sink);
    if Path::new("/proc/self").exists() {
        assert!(!stale.exists());
    }
    assert!(live.exists());
}

#[test]
fn adopted_blobs_are_moved_from_scratch_and_checked_elsewhere() {
    let tmp = tempfile::tempdir().expect("tmp");
    let dir = tmp.path().join("l");
    let img = TestImage::simple("x");
    let mut sink = open_sink(&oci(&dir, Some("t")), &SourceOptions::default()).expect("sink");
    let scratch = sink
        .scratch_dir()
        .expect("layout sinks have scratch")
        .to_path_buf();
    assert!(scratch.starts_with(&dir), "{}", scratch.display());

    // Outside the scratch directory the file is hashed like put_blob.
    let outside = tmp.path().join("outside");
    fs::write(&outside, b"not the layer").expect("write");
    let err = sink
        .adopt_blob(&img.layers[0].descriptor, &outside)
        .expect_err("digest");
    assert!(matches!(err, OciError::DigestMismatch { .. }), "{err}");

    // A wrong size is refused even in scratch; nothing is moved.
    let layer = &img.layers[0];
    let inside = scratch.join("blob-0");
    fs::write(&inside, &layer.blob).expect("write");
    let mut wrong = layer.descriptor.clone();
    wrong.size += 1;
    let err = sink.adopt_blob(&wrong, &inside).expect_err("size");
    assert!(matches!(err, OciError::SizeMismatch { .. }), "{err}");
    assert!(inside.exists());

    // In scratch it is renamed, not copied, and the image commits.
    sink.adopt_blob(&layer.descriptor, &inside).expect("adopt");
    assert!(!inside.exists(), "adopted file was copied, not moved");
    for l in &img.layers[1..] {
        sink.put_blob_bytes(&l.descriptor, &l.blob).expect("layer");
    }
    sink.put_blob_bytes(&img.config_desc, &img.config)
        .expect("config");
    sink.commit(&img.manifest_bytes, mt::OCI_MANIFEST)
        .expect("commit");
    assert_eq!(
        fs::read(blob_path(&dir, &layer.descriptor.digest)).expect("blob"),
        layer.blob
    );
    assert!(!scratch.exists(), "scratch directory left behind");
}

/// index.json, manifests and configs are read whole, so each has a limit
/// (16 MiB, 4 MiB, 64 MiB) checked before a byte of a descriptor's size
/// is allocated; a descriptor claiming more is refused unread.
#[test]
fn metadata_sizes_are_bounded() {
    let tmp = tempfile::tempdir().expect("tmp");
    let dir = tmp.path();
    fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#).expect("w");
    let too_large = |what: &str| {
        let err = open_source(&oci(dir, None), &SourceOptions::default()).expect_err(what);
        assert!(matches!(err, OciError::TooLarge { .. }), "{what}: {err}");
    };

    // A sparse index.json one byte over 16 MiB.
    let f = fs::File::create(dir.join("index.json")).expect("create");
    f.set_len((16 << 20) + 1).expect("set_len");
    too_large("index.json");

    // A manifest descriptor of 4 MiB + 1 and of i64::MAX: not read.
    let blob = Digest::of_bytes(b"{}");
    fs::create_dir_all(dir.join("blobs/sha256")).expect("mkdir");
    fs::write(blob_path(dir, &blob), b"{}").expect("blob");
    for size in [(4u64 << 20) + 1, i64::MAX as u64] {
        let index = ImageIndex {
            manifests: vec![Descriptor::new(mt::OCI_MANIFEST, blob.clone(), size)],
            ..ImageIndex::default()
        };
        fs::write(
            dir.join("index.json"),
            serde_json::to_vec(&index).expect("json"),
        )
        .expect("w");
        too_large("manifest");
    }

    // A manifest whose config descriptor claims 64 MiB + 1.
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": mt::OCI_MANIFEST,
        "config": {"mediaType": mt::OCI_CONFIG, "digest": blob.to_string(), "size": (64u64 << 20) + 1},
        "layers": [],
    });
    let bytes = serde_json::to_vec(&manifest).expect("json");
    let md = Digest::of_bytes(&bytes);
    fs::write(blob_path(dir, &md), &bytes).expect("manifest");
    let index = ImageIndex {
        manifests: vec![Descriptor::of_bytes(mt::OCI_MANIFEST, &bytes)],
        ..ImageIndex::default()
    };
    fs::write(
        dir.join("index.json"),
        serde_json::to_vec(&index).expect("json"),
    )
    .expect("w");
    too_large("config");
}
