//! docker-archive (`docker save`) sources built with the tar crate.

mod common;

use std::path::{Path, PathBuf};

use common::{check_layers, drain, layer_tar, TestImage};
use lamina_oci::{
    media_types as mt, open_source, Compression, Digest, ImageRef, OciError, SourceOptions,
};

struct ArchiveBuilder {
    b: tar::Builder<Vec<u8>>,
}

impl ArchiveBuilder {
    fn new() -> Self {
        ArchiveBuilder {
            b: tar::Builder::new(Vec::new()),
        }
    }

    fn file(&mut self, name: &str, data: &[u8]) {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_entry_type(tar::EntryType::Regular);
        self.b.append_data(&mut h, name, data).expect("append");
    }

    fn symlink(&mut self, name: &str, target: &str) {
        let mut h = tar::Header::new_gnu();
        h.set_size(0);
        h.set_mode(0o777);
        h.set_entry_type(tar::EntryType::Symlink);
        self.b
            .append_link(&mut h, name, target)
            .expect("append link");
    }

    fn write(self, path: &Path) {
        std::fs::write(path, self.b.into_inner().expect("finish")).expect("write archive");
    }
}

fn archive_ref(path: &Path, r: Option<&str>) -> ImageRef {
    ImageRef::DockerArchive {
        path: path.to_path_buf(),
        reference: r.map(str::to_string),
    }
}

/// Classic layout: `<id>/layer.tar` and `<hex>.json`, uncompressed layers.
fn classic(dir: &Path, images: &[(&TestImage, &[&str])]) -> PathBuf {
    let mut a = ArchiveBuilder::new();
    let mut manifest = Vec::new();
    for (n, (img, tags)) in images.iter().enumerate() {
        let config_name = format!("{}.json", img.config_desc.digest.hex());
        a.file(&config_name, &img.config);
        let mut layers = Vec::new();
        for (i, l) in img.layers.iter().enumerate() {
            // A long directory name exercises GNU long-name entries.
            let id = format!("{}{n}{i}", "0123456789abcdef".repeat(7));
            a.file(&format!("{id}/VERSION"), b"1.0");
            a.file(&format!("{id}/layer.tar"), &l.blob);
            layers.push(format!("{id}/layer.tar"));
        }
        manifest
            .push(serde_json::json!({"Config": config_name, "RepoTags": tags, "Layers": layers}));
    }
    a.file(
        "manifest.json",
        &serde_json::to_vec(&manifest).expect("json"),
    );
    let path = dir.join("classic.tar");
    a.write(&path);
    path
}

fn plain_image(marker: &str) -> TestImage {
    let l1 = layer_tar(&[("etc/a", marker.as_bytes())]);
    let l2 = layer_tar(&[("etc/b", b"bbb")]);
    TestImage::new(&[(l1, Compression::None), (l2, Compression::None)], marker)
}

#[test]
fn classic_archive() {
    let tmp = tempfile::tempdir().expect("tmp");
    let img = plain_image("classic");
    let path = classic(tmp.path(), &[(&img, &["busybox:latest"])]);
    let opts = SourceOptions::default();
    let src = open_source(&archive_ref(&path, None), &opts).expect("open");
    let image = src.image();
    assert_eq!(image.config_bytes, img.config);
    assert_eq!(image.manifest.config.digest, img.config_desc.digest);
    assert_eq!(image.manifest.media_type.as_deref(), Some(mt::OCI_MANIFEST));
    assert_eq!(
        image.manifest_digest,
        Digest::of_bytes(&image.manifest_bytes)
    );
    let synthesized = serde_json::to_vec(&image.manifest).expect("json");
    assert_eq!(synthesized, image.manifest_bytes);
    for (sl, tl) in image.layers.iter().zip(&img.layers) {
        assert_eq!(sl.descriptor.digest, tl.descriptor.digest);
        assert_eq!(sl.descriptor.media_type, mt::OCI_LAYER_TAR);
        assert_eq!(sl.compression, Compression::None);
    }
    check_layers(src.as_ref(), &img);
    let cfg = drain(&mut src.open_blob(&image.manifest.config).expect("cfg")).expect("read");
    assert_eq!(cfg, img.config);

    for r in [
        "busybox",
        "busybox:latest",
        "docker.io/library/busybox:latest",
        "@0",
    ] {
        let src = open_source(&archive_ref(&path, Some(r)), &opts).expect(r);
        assert_eq!(src.image().config_bytes, img.config);
    }
    let err = open_source(&archive_ref(&path, Some("busybox:other")), &opts).expect_err("tag");
    assert!(err.to_string().contains("busybox:latest"), "{err}");
    assert!(open_source(&archive_ref(&path, Some("@1")), &opts).is_err());
}

#[test]
fn multi_image_archive() {
    let tmp = tempfile::tempdir().expect("tmp");
    let a = plain_image("a");
    let b = plain_image("b");
    let path = classic(tmp.path(), &[(&a, &["img:a"]), (&b, &["img:b", "other:1"])]);
    let opts = SourceOptions::default();
    let err = open_source(&archive_ref(&path, None), &opts).expect_err("ambiguous");
    assert!(matches!(err, OciError::Ambiguous { .. }), "{err}");
    assert!(err.to_string().contains("img:b"), "{err}");
    let src = open_source(&archive_ref(&path, Some("other:1")), &opts).expect("other");
    check_layers(src.as_ref(), &b);
    let src = open_source(&archive_ref(&path, Some("@0")), &opts).expect("@0");
    check_layers(src.as_ref(), &a);
}

/// Newer docker: OCI blobs inside, compressed layers, symlinked legacy names.
#[test]
fn blobs_archive_with_compression_and_symlinks() {
    let tmp = tempfile::tempdir().expect("tmp");
    let l1 = layer_tar(&[("x", b"gzip layer")]);
    let l2 = layer_tar(&[("y", b"zstd layer")]);
    let l3 = layer_tar(&[("z", b"plain layer")]);
    let img = TestImage::new(
        &[
            (l1, Compression::Gzip),
            (l2, Compression::Zstd),
            (l3, Compression::None),
        ],
        "blobs",
    );
    let mut a = ArchiveBuilder::new();
    a.file("oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#);
    let cfg_name = format!("blobs/sha256/{}", img.config_desc.digest.hex());
    a.file(&cfg_name, &img.config);
    let mut layers = Vec::new();
    for (i, l) in img.layers.iter().enumerate() {
        let name = format!("blobs/sha256/{}", l.descriptor.digest.hex());
        a.file(&name, &l.blob);
        if i == 0 {
            // Legacy name as a symlink to the blob.
            a.symlink("legacy/layer.tar", &format!("../{name}"));
            layers.push("legacy/layer.tar".to_string());
        } else if i == 1 {
            // A name that does not encode the digest: hashed at open.
            a.file("renamed/layer.tar.zst", &l.blob);
            layers.push("./renamed/layer.tar.zst".to_string());
        } else {
            layers.push(name);
        }
    }
    let manifest = serde_json::json!([{"Config": cfg_name, "RepoTags": null, "Layers": layers}]);
    a.file(
        "manifest.json",
        &serde_json::to_vec(&manifest).expect("json"),
    );
    let path = tmp.path().join("new.tar");
    a.write(&path);

    let src = open_source(&archive_ref(&path, None), &SourceOptions::default()).expect("open");
    let image = src.image();
    let kinds: Vec<Compression> = image.layers.iter().map(|l| l.compression).collect();
    assert_eq!(
        kinds,
        vec![Compression::Gzip, Compression::Zstd, Compression::None]
    );
    for (sl, tl) in image.layers.iter().zip(&img.layers) {
        assert_eq!(sl.descriptor.digest, tl.descriptor.digest);
        assert_eq!(sl.descriptor.size, tl.descriptor.size);
        assert_eq!(
            sl.descriptor.media_type,
            tl.compression.oci_layer_media_type()
        );
    }
    check_layers(src.as_ref(), &img);
}

#[test]
fn archive_verification_failures() {
    let tmp = tempfile::tempdir().expect("tmp");
    let img = plain_image("bad");
    let opts = SourceOptions::default();

    // Config named by a digest it does not have.
    let mut a = ArchiveBuilder::new();
    let wrong = Digest::of_bytes(b"not the config");
    a.file(&format!("{}.json", wrong.hex()), &img.config);
    a.file("l/layer.tar", &img.layers[0].blob);
    a.file("m/layer.tar", &img.layers[1].blob);
    let manifest = serde_json::json!([{"Config": format!("{}.json", wrong.hex()), "Layers": ["l/layer.tar", "m/layer.tar"]}]);
    a.file(
        "manifest.json",
        &serde_json::to_vec(&manifest).expect("json"),
    );
    let path = tmp.path().join("badcfg.tar");
    a.write(&path);
    let err = open_source(&archive_ref(&path, None), &opts).expect_err("config digest");
    assert!(matches!(err, OciError::DigestMismatch { .. }), "{err}");

    // Layers swapped: diff_ids do not match the content.
    let mut a = ArchiveBuilder::new();
    a.file("c.json", &img.config);
    a.file("l/layer.tar", &img.layers[1].blob);
    a.file("m/layer.tar", &img.layers[0].blob);
    let manifest =
        serde_json::json!([{"Config": "c.json", "Layers": ["l/layer.tar", "m/layer.tar"]}]);
    a.file(
        "manifest.json",
        &serde_json::to_vec(&manifest).expect("json"),
    );
    let path = tmp.path().join("swapped.tar");
    a.write(&path);
    let src = open_source(&archive_ref(&path, None), &opts).expect("open");
    let err = drain(&mut src.open_layer(0).expect("layer")).expect_err("diff id");
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidData);
    assert!(OciError::from_io(&err).is_some(), "{err}");

    // Missing layer member and layer count mismatch.
    let mut a = ArchiveBuilder::new();
    a.file("c.json", &img.config);
    let manifest =
        serde_json::json!([{"Config": "c.json", "Layers": ["l/layer.tar", "m/layer.tar"]}]);
    a.file(
        "manifest.json",
        &serde_json::to_vec(&manifest).expect("json"),
    );
    let path = tmp.path().join("missing.tar");
    a.write(&path);
    let err = open_source(&archive_ref(&path, None), &opts).expect_err("missing");
    assert!(err.to_string().contains("l/layer.tar"), "{err}");

    // Not an archive at all.
    let path = tmp.path().join("garbage.tar");
    std::fs::write(&path, vec![7u8; 5000]).expect("write");
    assert!(open_source(&archive_ref(&path, None), &opts).is_err());
    let err =
        open_source(&archive_ref(&tmp.path().join("absent.tar"), None), &opts).expect_err("absent");
    assert!(err.to_string().contains("absent.tar"), "{err}");
}

/// manifest.json is read whole: one over 16 MiB is refused.
#[test]
fn archive_manifest_size_is_bounded() {
    let tmp = tempfile::tempdir().expect("tmp");
    let mut a = ArchiveBuilder::new();
    a.file("manifest.json", &vec![b' '; (16 << 20) + 1]);
    let path = tmp.path().join("big.tar");
    a.write(&path);
    let err = open_source(&archive_ref(&path, None), &SourceOptions::default())
        .expect_err("manifest.json");
    assert!(matches!(err, OciError::TooLarge { .. }), "{err}");
}
