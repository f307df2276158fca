//! How a lamina image sits in an OCI registry or layout: an ordinary OCI
//! image manifest whose layers are the data blobs, the chunk index and the
//! EROFS metadata image, each with a lamina media type. The media types start
//! with `application/vnd.oci.image.layer.` because containerd hands only such
//! descriptors to a snapshotter.

use std::collections::BTreeMap;
use std::io::Read;

use lamina_format::index::ChunkIndex;
use lamina_oci::{Descriptor, Digest, ImageSource, Manifest};

/// Media type of a data blob: concatenated chunks, each a zstd frame or raw.
pub const MEDIA_TYPE_BLOB: &str = "application/vnd.oci.image.layer.lamina.blob.v1";
/// Media type of the EROFS metadata image, zstd-compressed.
pub const MEDIA_TYPE_METADATA: &str = "application/vnd.oci.image.layer.lamina.erofs.v1+zstd";
/// Media type of the chunk index, zstd-compressed.
pub const MEDIA_TYPE_INDEX: &str = "application/vnd.oci.image.layer.lamina.index.v1+zstd";
/// Media type of boot pages (`lamina_format::boot`), zstd-compressed: the
/// pages a recorded start read, fetched whole at mount.
pub const MEDIA_TYPE_BOOT: &str = "application/vnd.oci.image.layer.lamina.boot.v1+zstd";

/// Manifest annotation: lamina format version.
pub const ANNOTATION_FORMAT: &str = "dev.lamina.format";
/// Manifest annotation: digest of the source image's manifest.
pub const ANNOTATION_SOURCE: &str = "dev.lamina.source.manifest";
/// Manifest annotation: chunk size in bytes.
pub const ANNOTATION_CHUNK_SIZE: &str = "dev.lamina.chunk-size";
/// Manifest annotation: entries in the image tree.
pub const ANNOTATION_STATS_ENTRIES: &str = "dev.lamina.stats.entries";
/// Manifest annotation: regular files (inodes) in the image tree.
pub const ANNOTATION_STATS_FILES: &str = "dev.lamina.stats.files";
/// Manifest annotation: bytes of regular file content in the image tree.
pub const ANNOTATION_STATS_FILE_BYTES: &str = "dev.lamina.stats.file-bytes";
/// Manifest annotation: bytes of the tree's files that live in blobs (holes excluded).
pub const ANNOTATION_STATS_REFERENCED_BYTES: &str = "dev.lamina.stats.referenced-bytes";
/// Layer annotation: digest of the uncompressed content (metadata, index).
pub const ANNOTATION_UNCOMPRESSED_DIGEST: &str = "dev.lamina.uncompressed.digest";
/// Layer annotation: size of the uncompressed content; for blobs, the cache file size.
pub const ANNOTATION_UNCOMPRESSED_SIZE: &str = "dev.lamina.uncompressed.size";

/// The format version this build writes and reads.
pub const FORMAT_VERSION: &str = "1";

/// Largest metadata or index lamina will decompress (guards against zstd bombs).
const MAX_DECOMPRESSED: u64 = 1 << 32;

/// Why an image is not a usable lamina image.
#[derive(Debug, thiserror::Error)]
pub enum ArtifactError {
    /// The manifest is not a lamina manifest, or is malformed.
    #[error("not a lamina image: {0}")]
    NotLamina(String),
    /// Reading a blob failed (includes digest mismatches).
    #[error(transparent)]
    Oci(#[from] lamina_oci::OciError),
    /// A blob did not decompress, or its content digest did not match.
    #[error("{what}: {reason}")]
    Corrupt {
        /// Which blob.
        what: &'static str,
        /// Why.
        reason: String,
    },
    /// The chunk index is malformed.
    #[error(transparent)]
    Index(#[from] lamina_format::index::IndexError),
}

/// The layers of a lamina manifest, by role.
#[derive(Debug, Clone)]
pub struct LaminaLayers {
    /// EROFS metadata image.
    pub metadata: Descriptor,
    /// Chunk index.
    pub index: Descriptor,
    /// Data blobs in device order.
    pub blobs: Vec<Descriptor>,
    /// Boot pages, when the image was converted with a trace.
    pub boot: Option<Descriptor>,
}

impl LaminaLayers {
    /// Sorts a manifest's layers by role; refuses anything else.
    pub fn from_manifest(manifest: &Manifest) -> Result<Self, ArtifactError> {
        match manifest.annotations.get(ANNOTATION_FORMAT) {
            Some(v) if v == FORMAT_VERSION => {}
            Some(v) => {
                return Err(ArtifactError::NotLamina(format!(
                    "format version {v}, this build reads {FORMAT_VERSION}"
                )))
            }
            None => {
                return Err(ArtifactError::NotLamina(format!(
                    "manifest has no {ANNOTATION_FORMAT} annotation (convert it with `lamina convert` first)"
                )))
            }
        }
        let mut metadata = None;
        let mut index = None;
        let mut blobs = Vec::new();
        let mut boot = None;
        for layer in &manifest.layers {
            match layer.media_type.as_str() {
                MEDIA_TYPE_BLOB => blobs.push(layer.clone()),
                MEDIA_TYPE_METADATA if metadata.is_none() => metadata = Some(layer.clone()),
                MEDIA_TYPE_INDEX if index.is_none() => index = Some(layer.clone()),
                MEDIA_TYPE_BOOT if boot.is_none() => boot = Some(layer.clone()),
                other => {
                    return Err(ArtifactError::NotLamina(format!(
                        "unexpected layer type {other}"
                    )))
                }
            }
        }
        Ok(LaminaLayers {
            metadata: metadata
                .ok_or_else(|| ArtifactError::NotLamina("no metadata layer".into()))?,
            index: index.ok_or_else(|| ArtifactError::NotLamina("no index layer".into()))?,
            blobs,
            boot,
        })
    }
}

/// Reads a zstd-compressed lamina layer and checks its uncompressed digest.
pub fn read_compressed_layer(
    source: &dyn ImageSource,
    desc: &Descriptor,
    what: &'static str,
) -> Result<Vec<u8>, ArtifactError> {
    let raw = source.open_blob(desc)?;
    let mut out = Vec::new();
    let decoder = zstd::stream::read::Decoder::new(raw).map_err(|e| ArtifactError::Corrupt {
        what,
        reason: e.to_string(),
    })?;
    decoder
        .take(MAX_DECOMPRESSED)
        .read_to_end(&mut out)
        .map_err(|e| ArtifactError::Corrupt {
            what,
            reason: e.to_string(),
        })?;
    let expected = desc
        .annotations
        .get(ANNOTATION_UNCOMPRESSED_DIGEST)
        .ok_or_else(|| ArtifactError::NotLamina(format!("{what} layer has no content digest")))?;
    let actual = Digest::of_bytes(&out);
    if actual.to_string() != *expected {
        return Err(ArtifactError::Corrupt {
            what,
            reason: format!("content digest {actual} does not match {expected}"),
        });
    }
    Ok(out)
}

/// Loads and validates the chunk index, and checks it names the manifest's blobs.
pub fn read_index(
    source: &dyn ImageSource,
    layers: &LaminaLayers,
) -> Result<ChunkIndex, ArtifactError> {
    let bytes = read_compressed_layer(source, &layers.index, "chunk index")?;
    parse_index(&bytes, layers)
}

/// Parses index bytes (already read and digest-checked) and checks they
/// name the manifest's blobs.
pub fn parse_index(bytes: &[u8], layers: &LaminaLayers) -> Result<ChunkIndex, ArtifactError> {
    let index = ChunkIndex::from_bytes(bytes)?;
    if index.blobs.len() != layers.blobs.len() {
        return Err(ArtifactError::Corrupt {
            what: "chunk index",
            reason: format!(
                "{} blobs in the index, {} in the manifest",
                index.blobs.len(),
                layers.blobs.len()
            ),
        });
    }
    for (entry, desc) in index.blobs.iter().zip(&layers.blobs) {
        if hex::encode(entry.digest) != desc.digest.hex() || entry.compressed_size != desc.size {
            return Err(ArtifactError::Corrupt {
                what: "chunk index",
                reason: format!("blob {} does not match the manifest", desc.digest),
            });
        }
    }
    Ok(index)
}

/// Layer annotations for a zstd-compressed layer with content `raw`.
pub fn content_annotations(raw: &[u8]) -> BTreeMap<String, String> {
    BTreeMap::from([
        (
            ANNOTATION_UNCOMPRESSED_DIGEST.to_string(),
            Digest::of_bytes(raw).to_string(),
        ),
        (
            ANNOTATION_UNCOMPRESSED_SIZE.to_string(),
            raw.len().to_string(),
        ),
    ])
}
