//! Boot-pages layers: their descriptors and frames checked against the
//! image before anything is fetched.

use lamina_format::boot::{BootExtent, BootHeader, BootTable, BOOT_PAGE};
use lamina_format::index::BlobSummary;

use super::*;

/// A boot-pages layer's sizes and content digest, checked against the image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BootLayer {
    /// Size of the compressed layer (its descriptor's).
    pub compressed_size: u64,
    /// Size of the uncompressed boot pages.
    pub size: u64,
    /// Digest of the uncompressed boot pages.
    pub digest: Digest,
    /// Its zstd frames, in read order.
    pub frames: Vec<BootFrame>,
    /// Whether its pages were known from the image, not recorded
    /// ([`ANNOTATION_BOOT_SOURCE`]).
    pub from_image: bool,
}

/// One zstd frame of a boot-pages layer: one segment; its digest is that
/// of its compressed bytes.
pub type BootFrame = ListedFrame;

/// The [`ANNOTATION_BOOT_FRAMES`] value for frames of these compressed
/// bytes and sizes, in layer order.
pub fn boot_frames_annotation(frames: &[(&[u8], u64)]) -> String {
    let digests: Vec<Digest> = frames.iter().map(|(z, _)| Digest::of_bytes(z)).collect();
    let listed: Vec<(u64, u64, &Digest)> = frames
        .iter()
        .zip(&digests)
        .map(|((z, size), digest)| (z.len() as u64, *size, digest))
        .collect();
    frames_annotation(&listed)
}

/// A boot-pages layer's frames, from its annotation (else the whole layer
/// as one), checked to tile the layer and its uncompressed size exactly.
fn boot_frames(desc: &Descriptor, size: u64) -> Result<Vec<BootFrame>, ArtifactError> {
    const WHAT: &str = "boot pages";
    let Some(list) = desc.annotations.get(ANNOTATION_BOOT_FRAMES) else {
        return Ok(vec![BootFrame {
            offset: 0,
            compressed_size: desc.size,
            size,
            digest: desc.digest.clone(),
        }]);
    };
    let frames = super::frames::listed_frames(
        list,
        ANNOTATION_BOOT_FRAMES,
        WHAT,
        (desc.size, size),
        MAX_BOOT_FRAMES,
    )?;
    if let Some(f) = frames
        .iter()
        .find(|f| f.size < size_of::<BootHeader>() as u64)
    {
        return Err(ArtifactError::Corrupt {
            what: WHAT,
            reason: format!("a frame of {} bytes", f.size),
        });
    }
    Ok(frames)
}

/// Checks an image's boot-pages layers (its segments) before anything is
/// fetched: each as [`boot_layer`], and all together within the same bound
/// as one (a header each).
pub fn boot_layers(
    descs: &[Descriptor],
    index: &[BlobSummary],
) -> Result<Vec<BootLayer>, ArtifactError> {
    let layers = descs
        .iter()
        .map(|d| boot_layer(d, index))
        .collect::<Result<Vec<_>, _>>()?;
    let total = layers.iter().map(|l| l.size).fold(0, u64::saturating_add);
    let frames: usize = layers.iter().map(|l| l.frames.len()).sum();
    if frames > MAX_BOOT_FRAMES {
        return Err(ArtifactError::Corrupt {
            what: "boot pages",
            reason: format!("more than {MAX_BOOT_FRAMES} frames"),
        });
    }
    // Each frame is a segment with a header of its own.
    let headers = (size_of::<BootHeader>() * frames) as u64;
    too_large(
        "boot pages (uncompressed, all segments)",
        total,
        boot_pages_bound(index).saturating_add(headers),
    )?;
    Ok(layers)
}

/// The most boot-pages bytes, uncompressed, without the header, the image's
/// cache files allow: one extent per page at most, each page once, and
/// once more in the directory.
fn boot_pages_bound(index: &[BlobSummary]) -> u64 {
    let pages: u64 = index
        .iter()
        .map(|b| b.cache_size / BOOT_PAGE)
        .fold(0, u64::saturating_add);
    let per_page = BOOT_PAGE + 2 * size_of::<BootExtent>() as u64;
    let directory = size_of::<BootTable>() as u64;
    // And each blob's chunk table at most once (paged index).
    let tables: u64 = index
        .iter()
        .filter_map(|b| b.table_range())
        .map(|(_, len)| len + size_of::<BootTable>() as u64)
        .fold(0, u64::saturating_add);
    pages
        .saturating_mul(per_page)
        .saturating_add(tables)
        .saturating_add(directory)
        .min(MAX_BOOT_PAGES_SIZE)
}

/// Checks a boot-pages layer's descriptor before anything is fetched: the
/// uncompressed size must fit what boot pages over the index's cache files
/// can be (header, one extent per page at most, each page once) and
/// [`MAX_BOOT_PAGES_SIZE`]; the compressed size must fit zstd's bound of it.
pub fn boot_layer(desc: &Descriptor, index: &[BlobSummary]) -> Result<BootLayer, ArtifactError> {
    const WHAT: &str = "boot pages";
    let missing = |key: &str| ArtifactError::Corrupt {
        what: WHAT,
        reason: format!("layer has no {key} annotation"),
    };
    let size = annotated_size(desc, WHAT)?.ok_or_else(|| missing(ANNOTATION_UNCOMPRESSED_SIZE))?;
    let digest = desc
        .annotations
        .get(ANNOTATION_UNCOMPRESSED_DIGEST)
        .ok_or_else(|| missing(ANNOTATION_UNCOMPRESSED_DIGEST))?;
    let digest = Digest::parse(digest).map_err(|e| ArtifactError::Corrupt {
        what: WHAT,
        reason: format!("bad {ANNOTATION_UNCOMPRESSED_DIGEST} annotation: {e}"),
    })?;
    let frames = boot_frames(desc, size)?;
    // A header for each frame (each is a segment of its own).
    let most = boot_pages_bound(index)
        .saturating_add((size_of::<BootHeader>() * frames.len()) as u64)
        .min(MAX_BOOT_PAGES_SIZE);
    too_large("boot pages (uncompressed)", size, most)?;
    if size < size_of::<BootHeader>() as u64 {
        return Err(ArtifactError::Corrupt {
            what: WHAT,
            reason: format!("{size} bytes is shorter than the boot pages header"),
        });
    }
    too_large("boot pages (compressed)", desc.size, compressed_limit(size))?;
    Ok(BootLayer {
        compressed_size: desc.size,
        size,
        digest,
        frames,
        from_image: desc
            .annotations
            .get(ANNOTATION_BOOT_SOURCE)
            .map(String::as_str)
            == Some(BOOT_SOURCE_IMAGE),
    })
}
