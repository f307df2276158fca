//! Serde types for OCI / docker v2 manifests, indexes and descriptors.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::digest::Digest;

/// Media type strings.
pub mod media_types {
    /// OCI image manifest.
    pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
    /// OCI image index.
    pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
    /// OCI image config.
    pub const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
    /// OCI uncompressed layer.
    pub const OCI_LAYER_TAR: &str = "application/vnd.oci.image.layer.v1.tar";
    /// OCI gzip layer.
    pub const OCI_LAYER_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
    /// OCI zstd layer.
    pub const OCI_LAYER_ZSTD: &str = "application/vnd.oci.image.layer.v1.tar+zstd";
    /// OCI non-distributable uncompressed layer (deprecated).
    pub const OCI_LAYER_NONDIST_TAR: &str =
        "application/vnd.oci.image.layer.nondistributable.v1.tar";
    /// OCI non-distributable gzip layer (deprecated).
    pub const OCI_LAYER_NONDIST_GZIP: &str =
        "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip";
    /// OCI non-distributable zstd layer (deprecated).
    pub const OCI_LAYER_NONDIST_ZSTD: &str =
        "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd";
    /// OCI empty JSON descriptor (`{}`), used as artifact config.
    pub const OCI_EMPTY: &str = "application/vnd.oci.empty.v1+json";
    /// Docker image manifest v2 schema 2.
    pub const DOCKER_MANIFEST_V2: &str = "application/vnd.docker.distribution.manifest.v2+json";
    /// Docker manifest list.
    pub const DOCKER_MANIFEST_LIST: &str =
        "application/vnd.docker.distribution.manifest.list.v2+json";
    /// Docker image config.
    pub const DOCKER_CONFIG: &str = "application/vnd.docker.container.image.v1+json";
    /// Docker gzip layer.
    pub const DOCKER_LAYER_GZIP: &str = "application/vnd.docker.image.rootfs.diff.tar.gzip";
    /// Docker uncompressed layer.
    pub const DOCKER_LAYER_TAR: &str = "application/vnd.docker.image.rootfs.diff.tar";
    /// Docker zstd layer (as written by buildkit).
    pub const DOCKER_LAYER_ZSTD: &str = "application/vnd.docker.image.rootfs.diff.tar.zstd";
    /// Docker foreign (non-distributable) gzip layer.
    pub const DOCKER_FOREIGN_LAYER_GZIP: &str =
        "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip";
    /// Docker foreign (non-distributable) uncompressed layer.
    pub const DOCKER_FOREIGN_LAYER_TAR: &str =
        "application/vnd.docker.image.rootfs.foreign.diff.tar";

    /// Whether `mt` is an image index / manifest list.
    pub fn is_index(mt: &str) -> bool {
        mt == OCI_INDEX || mt == DOCKER_MANIFEST_LIST
    }

    /// Whether `mt` is a single-image manifest.
    pub fn is_manifest(mt: &str) -> bool {
        mt == OCI_MANIFEST || mt == DOCKER_MANIFEST_V2
    }

    /// Whether `mt` is an image (not artifact) config.
    pub fn is_image_config(mt: &str) -> bool {
        mt == OCI_CONFIG || mt == DOCKER_CONFIG
    }
}

/// Annotation key naming a manifest in an OCI layout's `index.json`.
pub const ANNOTATION_REF_NAME: &str = "org.opencontainers.image.ref.name";

/// A content descriptor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Descriptor {
    /// Media type of the referenced content.
    pub media_type: String,
    /// Digest of the referenced content.
    pub digest: Digest,
    /// Size in bytes of the referenced content (at most `i64::MAX`, the
    /// spec's int64; negative or larger sizes do not parse).
    #[serde(deserialize_with = "descriptor_size")]
    pub size: u64,
    /// Annotations.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    /// Platform (index entries only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub platform: Option<Platform>,
    /// OCI 1.1: the artifact type of the manifest it points at (entries of
    /// a referrers list).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub artifact_type: Option<String>,
}

/// The OCI spec's int64, non-negative: sizes above it are refused as the
/// JSON is parsed, so no arithmetic on a size starts near `u64::MAX`.
fn descriptor_size<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    let size = u64::deserialize(d)?;
    if size > i64::MAX as u64 {
        return Err(serde::de::Error::custom(format!(
            "descriptor size {size} is out of range"
        )));
    }
    Ok(size)
}

impl Descriptor {
    /// A descriptor with no annotations and no platform.
    pub fn new(media_type: impl Into<String>, digest: Digest, size: u64) -> Self {
        Descriptor {
            media_type: media_type.into(),
            digest,
            size,
            annotations: BTreeMap::new(),
            platform: None,
            artifact_type: None,
        }
    }

    /// The descriptor of `bytes` with the given media type.
    pub fn of_bytes(media_type: impl Into<String>, bytes: &[u8]) -> Self {
        Descriptor::new(media_type, Digest::of_bytes(bytes), bytes.len() as u64)
    }

    /// The `org.opencontainers.image.ref.name` annotation, if any.
    pub fn ref_name(&self) -> Option<&str> {
        self.annotations
            .get(ANNOTATION_REF_NAME)
            .map(String::as_str)
    }
}

/// A platform, as found in image index entries.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Platform {
    /// CPU architecture (OCI / Go names: amd64, arm64...).
    pub architecture: String,
    /// Operating system (linux...).
    pub os: String,
    /// OS version.
    #[serde(
        rename = "os.version",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub os_version: Option<String>,
    /// OS features.
    #[serde(rename = "os.features", default, skip_serializing_if = "Vec::is_empty")]
    pub os_features: Vec<String>,
    /// CPU variant (v7, v8...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub variant: Option<String>,
}

impl fmt::Display for Platform {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.os, self.architecture)?;
        if let Some(v) = &self.variant {
            write!(f, "/{v}")?;
        }
        Ok(())
    }
}

fn schema_version_2() -> u32 {
    2
}

/// An image manifest (OCI or docker v2 schema 2).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Manifest {
    /// Always 2.
    #[serde(default = "schema_version_2")]
    pub schema_version: u32,
    /// Media type (OCI manifests may omit it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub media_type: Option<String>,
    /// The image config.
    pub config: Descriptor,
    /// The layers, base first.
    #[serde(default)]
    pub layers: Vec<Descriptor>,
    /// Annotations.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    /// OCI 1.1: what kind of artifact this manifest is (a lamina tar index).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub artifact_type: Option<String>,
    /// OCI 1.1: the manifest this one refers to (a tar index: the image it
    /// indexes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subject: Option<Box<Descriptor>>,
}

/// An image index or docker manifest list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ImageIndex {
    /// Always 2.
    #[serde(default = "schema_version_2")]
    pub schema_version: u32,
    /// Media type (OCI indexes may omit it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub media_type: Option<String>,
    /// The referenced manifests.
    #[serde(default)]
    pub manifests: Vec<Descriptor>,
    /// Annotations.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

impl Default for ImageIndex {
    fn default() -> Self {
        ImageIndex {
            schema_version: 2,
            media_type: Some(media_types::OCI_INDEX.to_string()),
            manifests: Vec::new(),
            annotations: BTreeMap::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptor_json_shape() {
        let d = Descriptor::of_bytes(media_types::OCI_CONFIG, b"{}");
        let v = serde_json::to_value(&d).expect("ser");
        assert_eq!(v["mediaType"], media_types::OCI_CONFIG);
        assert_eq!(v["size"], 2);
        assert!(v.get("annotations").is_none());
        assert!(v.get("platform").is_none());
    }

    #[test]
    fn descriptor_sizes_must_be_int64() {
        let desc = |size: &str| {
            serde_json::from_str::<Descriptor>(&format!(
                r#"{{"mediaType":"x","digest":"sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855","size":{size}}}"#
            ))
        };
        assert_eq!(
            desc("9223372036854775807").expect("max").size,
            i64::MAX as u64
        );
        for bad in [
            "-1",
            "1.5",
            "1e30",
            "9223372036854775808",
            "18446744073709551616",
            "\"1\"",
        ] {
            assert!(desc(bad).is_err(), "size {bad} parsed");
        }
    }

    #[test]
    fn parses_index_with_platform() {
        let json = r#"{"schemaVersion":2,"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json",
          "digest":"sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855","size":3,
          "platform":{"architecture":"arm64","os":"linux","variant":"v8","os.features":["x"]}}]}"#;
        let idx: ImageIndex = serde_json::from_str(json).expect("parse");
        let p = idx.manifests[0].platform.as_ref().expect("platform");
        assert_eq!(p.to_string(), "linux/arm64/v8");
        assert_eq!(p.os_features, vec!["x".to_string()]);
    }
}
