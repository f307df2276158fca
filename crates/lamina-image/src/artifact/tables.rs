//! The chunk index and the lookup table, checked against the manifest
//! they came with.

use lamina_format::index::{BlobSummary, ChunkIndex, IndexTop};
use lamina_format::lookup::LookupTable;
use lamina_oci::ImageSource;

use super::*;

/// Loads and validates the chunk index (either version: see
/// [`ChunkIndex::parse_top`]), and checks it names the manifest's blobs.
pub fn read_index(
    source: &dyn ImageSource,
    layers: &LaminaLayers,
) -> Result<IndexTop, ArtifactError> {
    let bytes = read_compressed_layer(source, &layers.index, "chunk index")?;
    parse_index(&bytes, layers)
}

/// Parses index bytes (already read and digest-checked) and checks they
/// name the manifest's blobs.
pub fn parse_index(bytes: &[u8], layers: &LaminaLayers) -> Result<IndexTop, ArtifactError> {
    let index = ChunkIndex::parse_top(bytes)?;
    check_blob_table(&index.blobs, layers)?;
    Ok(index)
}

/// Checks an index's blob table names the manifest's blobs, in order.
pub fn check_blob_table(table: &[BlobSummary], layers: &LaminaLayers) -> Result<(), ArtifactError> {
    if table.len() != layers.blobs.len() {
        return Err(ArtifactError::Corrupt {
            what: "chunk index",
            reason: format!(
                "{} blobs in the index, {} in the manifest",
                table.len(),
                layers.blobs.len()
            ),
        });
    }
    for (entry, desc) in table.iter().zip(&layers.blobs) {
        if hex::encode(entry.digest) != desc.digest.hex() || entry.compressed_size != desc.size {
            return Err(ArtifactError::Corrupt {
                what: "chunk index",
                reason: format!("blob {} does not match the manifest", desc.digest),
            });
        }
    }
    Ok(())
}

/// Checks that a lookup table, of which `header` holds at least the first
/// [`lamina_format::lookup::LOOKUP_HEADER_LEN`] bytes, was built for the
/// metadata layer `metadata` (a lamina image's or a tar index's): its image
/// digest must be the metadata layer's content digest. Reads nothing
/// beyond the header; the table's shape is checked where it is parsed.
pub fn check_lookup_for(header: &[u8], metadata: &Descriptor) -> Result<(), ArtifactError> {
    let corrupt = |reason: String| ArtifactError::Corrupt {
        what: "lookup table",
        reason,
    };
    let header = LookupTable::header(header).map_err(|e| corrupt(e.to_string()))?;
    let metadata = metadata
        .annotations
        .get(ANNOTATION_UNCOMPRESSED_DIGEST)
        .ok_or_else(|| ArtifactError::NotLamina("metadata layer has no content digest".into()))?;
    let built_for = Digest::from_sha256(header.image_digest);
    if built_for.to_string() != *metadata {
        return Err(corrupt(format!(
            "built for metadata {built_for}, the manifest's is {metadata}"
        )));
    }
    Ok(())
}

/// Checks a lookup-table layer's descriptor before a worker fetches it:
/// its annotated size within [`MAX_LOOKUP_SIZE`] (required: the worker
/// decompresses to exactly it), the compressed size within zstd's bound of
/// that. Returns the size.
pub fn check_lookup_layer(desc: &Descriptor) -> Result<u64, ArtifactError> {
    const WHAT: &str = "lookup table";
    let size = annotated_size(desc, WHAT)?.ok_or_else(|| ArtifactError::Corrupt {
        what: WHAT,
        reason: format!("layer has no {ANNOTATION_UNCOMPRESSED_SIZE} annotation"),
    })?;
    too_large(WHAT, size, MAX_LOOKUP_SIZE)?;
    too_large(WHAT, desc.size, compressed_limit(size))?;
    Ok(size)
}
