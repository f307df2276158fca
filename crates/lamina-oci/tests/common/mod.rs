//! Helpers shared by the integration tests: build small images in memory.
#![allow(dead_code)]

use std::io::Write;

use lamina_oci::{media_types as mt, Compression, Descriptor, Digest, ImageSink, Manifest};

/// A tar with the given regular files.
pub fn layer_tar(files: &[(&str, &[u8])]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (name, data) in files {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_mtime(0);
        h.set_entry_type(tar::EntryType::Regular);
        b.append_data(&mut h, name, *data).expect("append");
    }
    b.into_inner().expect("finish tar")
}

pub fn gzip(data: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(data).expect("gzip");
    e.finish().expect("gzip finish")
}

pub fn zstd(data: &[u8]) -> Vec<u8> {
    zstd::stream::encode_all(data, 3).expect("zstd")
}

pub fn compress(data: &[u8], c: Compression) -> Vec<u8> {
    match c {
        Compression::None => data.to_vec(),
        Compression::Gzip => gzip(data),
        Compression::Zstd => zstd(data),
    }
}

/// One layer: blob bytes as stored, and the uncompressed tar.
#[derive(Debug, Clone)]
pub struct TestLayer {
    pub blob: Vec<u8>,
    pub tar: Vec<u8>,
    pub compression: Compression,
    pub descriptor: Descriptor,
}

#[derive(Debug, Clone)]
pub struct TestImage {
    pub config: Vec<u8>,
    pub config_desc: Descriptor,
    pub layers: Vec<TestLayer>,
    pub manifest: Manifest,
    pub manifest_bytes: Vec<u8>,
}

impl TestImage {
    pub fn new(layers: &[(Vec<u8>, Compression)], marker: &str) -> TestImage {
        let layers: Vec<TestLayer> = layers
            .iter()
            .map(|(tar, c)| {
                let blob = compress(tar, *c);
                let descriptor = Descriptor::of_bytes(c.oci_layer_media_type(), &blob);
                TestLayer {
                    blob,
                    tar: tar.clone(),
                    compression: *c,
                    descriptor,
                }
            })
            .collect();
        let diff_ids: Vec<String> = layers
            .iter()
            .map(|l| Digest::of_bytes(&l.tar).to_string())
            .collect();
        let config = serde_json::to_vec(&serde_json::json!({
            "architecture": "amd64",
            "os": "linux",
            "config": {"Env": [format!("MARKER={marker}")]},
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        }))
        .expect("config json");
        let config_desc = Descriptor::of_bytes(mt::OCI_CONFIG, &config);
        let manifest = Manifest {
            schema_version: 2,
            media_type: Some(mt::OCI_MANIFEST.to_string()),
            config: config_desc.clone(),
            layers: layers.iter().map(|l| l.descriptor.clone()).collect(),
            annotations: Default::default(),
            artifact_type: None,
            subject: None,
        };
        let manifest_bytes = serde_json::to_vec(&manifest).expect("manifest json");
        TestImage {
            config,
            config_desc,
            layers,
            manifest,
            manifest_bytes,
        }
    }

    /// Two small layers, gzip and plain.
    pub fn simple(marker: &str) -> TestImage {
        let l1 = layer_tar(&[("etc/hello", b"hello\n"), ("bin/x", marker.as_bytes())]);
        let l2 = layer_tar(&[("etc/world", b"world\n")]);
        TestImage::new(&[(l1, Compression::Gzip), (l2, Compression::None)], marker)
    }

    pub fn manifest_digest(&self) -> Digest {
        Digest::of_bytes(&self.manifest_bytes)
    }

    /// Put all blobs (layers from files in `tmp`, config from memory) and commit.
    pub fn push(&self, mut sink: Box<dyn ImageSink>, tmp: &std::path::Path) -> Digest {
        for (i, l) in self.layers.iter().enumerate() {
            let p = tmp.join(format!("layer-{i}"));
            std::fs::write(&p, &l.blob).expect("write layer file");
            sink.put_blob(&l.descriptor, &p).expect("put layer");
        }
        sink.put_blob_bytes(&self.config_desc, &self.config)
            .expect("put config");
        sink.commit(&self.manifest_bytes, mt::OCI_MANIFEST)
            .expect("commit")
    }
}

/// Read a layer stream to the end.
pub fn drain(r: &mut dyn std::io::Read) -> std::io::Result<Vec<u8>> {
    let mut v = Vec::new();
    r.read_to_end(&mut v)?;
    Ok(v)
}

/// Check a source serves exactly `img`'s layers.
pub fn check_layers(src: &dyn lamina_oci::ImageSource, img: &TestImage) {
    assert_eq!(src.image().layers.len(), img.layers.len());
    for (i, l) in img.layers.iter().enumerate() {
        let mut r = src.open_layer(i).expect("open layer");
        let got = drain(&mut r).expect("read layer");
        assert_eq!(got, l.tar, "layer {i}");
    }
}
