//! The read side: [`ImageSource`], [`SourceImage`] and [`open_source`].

use std::io::Read;
use std::path::PathBuf;

use crate::compression::{Compression, LayerReader};
use crate::digest::Digest;
use crate::error::OciError;
use crate::hosts::HostsConfig;
use crate::reference::ImageRef;
use crate::types::{media_types as mt, Descriptor, ImageIndex, Manifest};

/// Largest manifest or index held in memory.
pub(crate) const MAX_MANIFEST_SIZE: u64 = 4 << 20;
/// Largest image config held in memory.
pub(crate) const MAX_CONFIG_SIZE: u64 = 64 << 20;
/// How many index levels are followed before giving up.
pub(crate) const MAX_INDEX_DEPTH: usize = 4;

/// One layer of a [`SourceImage`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceLayer {
    /// The layer blob's descriptor, as in the manifest.
    pub descriptor: Descriptor,
    /// How the blob is compressed.
    pub compression: Compression,
    /// Digest of the uncompressed tar (from the config's `rootfs.diff_ids`).
    pub diff_id: Digest,
}

/// A resolved single-platform image: manifest, config and layers.
#[derive(Debug, Clone)]
pub struct SourceImage {
    /// The parsed manifest.
    pub manifest: Manifest,
    /// The manifest exactly as stored (what `manifest_digest` is over).
    pub manifest_bytes: Vec<u8>,
    /// Digest of `manifest_bytes`.
    pub manifest_digest: Digest,
    /// The config blob exactly as stored, verified against
    /// `manifest.config.digest`.
    pub config_bytes: Vec<u8>,
    /// The parsed config.
    pub config: serde_json::Value,
    /// Layers, base first.
    pub layers: Vec<SourceLayer>,
    /// The entries of the image index this manifest was chosen from (its
    /// own entry among them), when the reference named an index: what the
    /// index's digest covers beside the manifest, such as a tar index bound
    /// to it (`lamina index`). Empty when the reference named the manifest.
    pub index_entries: Vec<Descriptor>,
    /// The digest of that image index: a reference by it resolves to this
    /// manifest again, with the same entries.
    pub index_digest: Option<Digest>,
}

impl SourceImage {
    /// Build from a verified manifest and verified config bytes.
    ///
    /// For image configs (OCI or docker media type) `rootfs.diff_ids` must
    /// have one entry per layer and every layer must have a known layer media
    /// type. For other (artifact) configs the diff_ids are used when their
    /// count matches; otherwise each layer's diff_id is its blob digest and
    /// layers of unknown media type are treated as uncompressed.
    pub fn from_parts(
        manifest: Manifest,
        manifest_bytes: Vec<u8>,
        manifest_digest: Digest,
        config_bytes: Vec<u8>,
    ) -> Result<SourceImage, OciError> {
        let config_digest = manifest.config.digest.clone();
        let config: serde_json::Value = serde_json::from_slice(&config_bytes)
            .map_err(|e| OciError::json(format!("image config {config_digest}"), e))?;
        let is_image = mt::is_image_config(&manifest.config.media_type);
        let diff_ids = parse_diff_ids(&config, &config_digest, is_image)?;
        let diff_ids = match diff_ids {
            Some(ids) if ids.len() == manifest.layers.len() => Some(ids),
            Some(ids) if is_image => {
                return Err(OciError::Config {
                    config: config_digest,
                    message: format!(
                        "rootfs.diff_ids has {} entries but manifest {} has {} layers",
                        ids.len(),
                        manifest_digest,
                        manifest.layers.len()
                    ),
                })
            }
            _ => None,
        };
        let mut layers = Vec::with_capacity(manifest.layers.len());
        for (i, desc) in manifest.layers.iter().enumerate() {
            // Layers of other types (lamina's own) open as raw blobs only;
            // `layer()` refuses them as tar streams.
            let compression =
                Compression::from_media_type(&desc.media_type).unwrap_or(Compression::None);
            let diff_id = match diff_ids.as_ref().and_then(|ids| ids.get(i)) {
                Some(d) => d.clone(),
                None => desc.digest.clone(),
            };
            layers.push(SourceLayer {
                descriptor: desc.clone(),
                compression,
                diff_id,
            });
        }
        Ok(SourceImage {
            manifest,
            manifest_bytes,
            manifest_digest,
            config_bytes,
            config,
            layers,
            index_entries: Vec::new(),
            index_digest: None,
        })
    }

    /// The manifest's media type (from the document, defaulting to OCI).
    pub fn manifest_media_type(&self) -> &str {
        self.manifest
            .media_type
            .as_deref()
            .unwrap_or(mt::OCI_MANIFEST)
    }

    /// The layer at `index`, or a [`OciError::LayerIndex`] error.
    /// Layers whose media type is not a tar (plain, gzip or zstd) are refused
    /// when the config is an image config, since they cannot be unpacked.
    pub fn layer(&self, index: usize) -> Result<&SourceLayer, OciError> {
        let layer = self.layers.get(index).ok_or(OciError::LayerIndex {
            index,
            count: self.layers.len(),
        })?;
        if mt::is_image_config(&self.manifest.config.media_type)
            && Compression::from_media_type(&layer.descriptor.media_type).is_none()
        {
            return Err(OciError::UnsupportedMediaType {
                what: format!(
                    "layer {index} ({}) of manifest {}",
                    layer.descriptor.digest, self.manifest_digest
                ),
                media_type: layer.descriptor.media_type.clone(),
            });
        }
        Ok(layer)
    }
}

fn parse_diff_ids(
    config: &serde_json::Value,
    config_digest: &Digest,
    required: bool,
) -> Result<Option<Vec<Digest>>, OciError> {
    let bad = |message: String| OciError::Config {
        config: config_digest.clone(),
        message,
    };
    let Some(ids) = config.get("rootfs").and_then(|r| r.get("diff_ids")) else {
        return if required {
            Err(bad("missing rootfs.diff_ids".to_string()))
        } else {
            Ok(None)
        };
    };
    let Some(arr) = ids.as_array() else {
        return Err(bad("rootfs.diff_ids is not an array".to_string()));
    };
    let mut out = Vec::with_capacity(arr.len());
    for (i, v) in arr.iter().enumerate() {
        let s = v
            .as_str()
            .ok_or_else(|| bad(format!("rootfs.diff_ids[{i}] is not a string")))?;
        let d = s
            .parse::<Digest>()
            .map_err(|e| bad(format!("rootfs.diff_ids[{i}]: {e}")))?;
        out.push(d);
    }
    Ok(Some(out))
}

/// Options for opening sources and sinks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceOptions {
    /// Docker `config.json` with registry credentials, and then the only
    /// credentials (`LAMINA_REGISTRY_AUTH` is not read); `None` means
    /// `LAMINA_REGISTRY_AUTH`, then `$DOCKER_CONFIG/config.json`, else
    /// `~/.docker/config.json`.
    pub docker_config: Option<PathBuf>,
    /// Registry hosts (`host` or `host:port`) reached over plain HTTP.
    /// Loopback hosts (by resolved address) always are, unless listed in
    /// `tls_hosts`.
    pub insecure_hosts: Vec<String>,
    /// Loopback registry hosts (`host` or `host:port`) reached over TLS.
    pub tls_hosts: Vec<String>,
    /// PEM file of CA certificates trusted for registry TLS, besides the
    /// system store.
    pub ca_file: Option<PathBuf>,
    /// Mirrors, CAs, client certificates and headers per registry host
    /// (containerd's `hosts.toml` directory); none by default.
    pub hosts: HostsConfig,
    /// Scratch directory for sources or sinks that need one (none does yet).
    pub tmp_dir: Option<PathBuf>,
    /// `(os, architecture)` picked from image indexes, OCI names.
    pub platform: (String, String),
    /// The floor rate of a registry answer, bytes per second: each may take
    /// the request timeout plus its size at this rate, and is ended then
    /// (`--registry-min-rate`).
    pub min_rate: u64,
}

impl Default for SourceOptions {
    fn default() -> Self {
        SourceOptions {
            docker_config: None,
            insecure_hosts: Vec::new(),
            tls_hosts: Vec::new(),
            ca_file: None,
            hosts: HostsConfig::none(),
            tmp_dir: None,
            platform: (
                "linux".to_string(),
                oci_arch(std::env::consts::ARCH).to_string(),
            ),
            min_rate: crate::registry::DEFAULT_MIN_RATE,
        }
    }
}

/// Map a Rust `std::env::consts::ARCH` name to the OCI (Go) name.
pub fn oci_arch(rust_arch: &str) -> &str {
    match rust_arch {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        "powerpc64" => "ppc64le",
        "loongarch64" => "loong64",
        other => other,
    }
}

/// A readable image.
pub trait ImageSource: Send + Sync + std::fmt::Debug {
    /// The resolved image.
    fn image(&self) -> &SourceImage;

    /// The layer's uncompressed tar stream. The compressed bytes are checked
    /// against the descriptor digest and size and the uncompressed bytes
    /// against the diff_id; a mismatch (or truncated/corrupt compression)
    /// surfaces as an `io::Error` (kind `InvalidData`, inner error an
    /// [`OciError`]) no later than the read that hits end-of-stream. Callers
    /// must drain the stream to the end.
    fn open_layer(&self, index: usize) -> Result<Box<dyn Read + Send + '_>, OciError>;

    /// Any blob of the image, raw, verified the same way (digest and size).
    fn open_blob(&self, desc: &Descriptor) -> Result<Box<dyn Read + Send + '_>, OciError>;

    /// `len` bytes of blob `desc` from `offset`, unverified (a range cannot
    /// be checked against the blob's digest: the caller checks them against
    /// one of its own). `None`: this source reads blobs whole only.
    fn read_blob_range(
        &self,
        desc: &Descriptor,
        offset: u64,
        len: u64,
    ) -> Result<Option<Vec<u8>>, OciError> {
        let _ = (desc, offset, len);
        Ok(None)
    }
}

/// Open the image named by `r`.
pub fn open_source(r: &ImageRef, opts: &SourceOptions) -> Result<Box<dyn ImageSource>, OciError> {
    match r {
        ImageRef::Oci { dir, tag } => Ok(Box::new(crate::layout::OciLayoutSource::open(
            dir,
            tag.as_deref(),
            opts,
        )?)),
        ImageRef::DockerArchive { path, reference } => Ok(Box::new(
            crate::archive::DockerArchiveSource::open(path, reference.as_deref())?,
        )),
        ImageRef::Registry(rr) => Ok(Box::new(crate::registry::RegistrySource::open(rr, opts)?)),
    }
}

/// The platforms `r` offers when it names an image index: each entry's
/// `(os, architecture)`, in index order, once, without entries of unknown
/// platform (build attestations); empty when it names one manifest.
pub fn platforms(r: &ImageRef, opts: &SourceOptions) -> Result<Vec<(String, String)>, OciError> {
    let (bytes, media_type, digest) = match r {
        ImageRef::Oci { dir, tag } => crate::layout::top_document(dir, tag.as_deref())?,
        ImageRef::Registry(rr) => {
            let client = crate::registry::RegistryClient::new(&rr.host, opts)?;
            let fetched = client.get_manifest(&rr.repository, &rr.reference)?;
            (fetched.bytes, fetched.media_type, fetched.digest)
        }
        ImageRef::DockerArchive { .. } => return Ok(Vec::new()),
    };
    let Document::Index(index) = parse_document(&bytes, media_type.as_deref(), &digest)? else {
        return Ok(Vec::new());
    };
    let mut found: Vec<(String, String)> = Vec::new();
    for p in index.manifests.iter().filter_map(|d| d.platform.as_ref()) {
        let platform = (p.os.clone(), p.architecture.clone());
        if p.os != "unknown" && p.architecture != "unknown" && !found.contains(&platform) {
            found.push(platform);
        }
    }
    Ok(found)
}

/// Wrap a raw blob stream of `layer` into the verified, decompressed stream.
pub(crate) fn layer_stream<'a>(
    raw: Box<dyn Read + Send + 'a>,
    layer: &SourceLayer,
) -> Result<Box<dyn Read + Send + 'a>, OciError> {
    Ok(Box::new(LayerReader::new(
        raw,
        &layer.descriptor,
        layer.compression,
        layer.diff_id.clone(),
    )?))
}

/// A manifest-ish document: either an index or an image manifest.
#[derive(Debug)]
pub(crate) enum Document {
    Index(ImageIndex),
    Manifest(Box<Manifest>),
}

/// Parse a manifest or index, using `media_type_hint` (from the parent
/// descriptor or HTTP Content-Type) or else the document's own `mediaType`.
pub(crate) fn parse_document(
    bytes: &[u8],
    media_type_hint: Option<&str>,
    digest: &Digest,
) -> Result<Document, OciError> {
    let what = || format!("manifest {digest}");
    let value: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| OciError::json(what(), e))?;
    let own = value.get("mediaType").and_then(|v| v.as_str());
    let hint = media_type_hint
        .map(|m| m.split(';').next().unwrap_or(m).trim())
        .filter(|m| mt::is_index(m) || mt::is_manifest(m));
    let media_type = match (hint, own) {
        (Some(h), _) => h.to_string(),
        (None, Some(o)) => o.to_string(),
        (None, None) if value.get("manifests").is_some() => mt::OCI_INDEX.to_string(),
        (None, None) if value.get("config").is_some() => mt::OCI_MANIFEST.to_string(),
        (None, None) => {
            return Err(OciError::UnsupportedMediaType {
                what: what(),
                media_type: media_type_hint.unwrap_or("").to_string(),
            })
        }
    };
    if mt::is_index(&media_type) {
        serde_json::from_value(value)
            .map(Document::Index)
            .map_err(|e| OciError::json(what(), e))
    } else if mt::is_manifest(&media_type) {
        serde_json::from_value(value)
            .map(|m| Document::Manifest(Box::new(m)))
            .map_err(|e| OciError::json(what(), e))
    } else {
        Err(OciError::UnsupportedMediaType {
            what: what(),
            media_type,
        })
    }
}

/// Pick the index entry for `platform` (os, architecture).
pub(crate) fn select_platform(
    index: &ImageIndex,
    index_digest: &Digest,
    platform: &(String, String),
) -> Result<Descriptor, OciError> {
    let (os, arch) = platform;
    let candidates: Vec<&Descriptor> = index
        .manifests
        .iter()
        .filter(|d| mt::is_manifest(&d.media_type) || mt::is_index(&d.media_type))
        .collect();
    if candidates.iter().all(|d| d.platform.is_none()) && candidates.len() == 1 {
        if let Some(only) = candidates.first() {
            return Ok((*only).clone());
        }
    }
    let matching: Vec<&Descriptor> = candidates
        .iter()
        .copied()
        .filter(|d| {
            d.platform
                .as_ref()
                .is_some_and(|p| &p.os == os && &p.architecture == arch)
        })
        .collect();
    // Prefer the entry without variant or with the usual one for arm64.
    let best = matching
        .iter()
        .find(|d| {
            d.platform.as_ref().is_some_and(|p| {
                p.variant.is_none() || (arch == "arm64" && p.variant.as_deref() == Some("v8"))
            })
        })
        .or(matching.first());
    match best {
        Some(d) => Ok((*d).clone()),
        None => Err(OciError::NoMatchingPlatform {
            index: index_digest.clone(),
            wanted: format!("{os}/{arch}"),
            available: index
                .manifests
                .iter()
                .filter_map(|d| d.platform.as_ref().map(|p| p.to_string()))
                .collect(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::Platform;

    fn entry(os: &str, arch: &str, variant: Option<&str>, n: u8) -> Descriptor {
        let mut d = Descriptor::of_bytes(mt::OCI_MANIFEST, &[n]);
        d.platform = Some(Platform {
            os: os.into(),
            architecture: arch.into(),
            variant: variant.map(str::to_string),
            ..Platform::default()
        });
        d
    }

    #[test]
    fn platform_selection() {
        let index = ImageIndex {
            manifests: vec![
                entry("linux", "arm", Some("v7"), 1),
                entry("linux", "arm64", Some("v8"), 2),
                entry("linux", "amd64", None, 3),
                entry("unknown", "unknown", None, 4),
            ],
            ..ImageIndex::default()
        };
        let dig = Digest::of_bytes(b"idx");
        let got = select_platform(&index, &dig, &("linux".into(), "amd64".into())).expect("amd64");
        assert_eq!(got.digest, Digest::of_bytes(&[3]));
        let got = select_platform(&index, &dig, &("linux".into(), "arm64".into())).expect("arm64");
        assert_eq!(got.digest, Digest::of_bytes(&[2]));
        let err =
            select_platform(&index, &dig, &("linux".into(), "s390x".into())).expect_err("none");
        let msg = err.to_string();
        assert!(
            msg.contains("linux/s390x") && msg.contains("linux/arm/v7"),
            "{msg}"
        );
    }

    #[test]
    fn arch_names() {
        assert_eq!(oci_arch("x86_64"), "amd64");
        assert_eq!(oci_arch("aarch64"), "arm64");
        assert_eq!(oci_arch("riscv64"), "riscv64");
        assert_eq!(SourceOptions::default().platform.0, "linux");
    }
}
