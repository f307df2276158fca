//! Mounting an unmodified image through its tar index (`lamina index`):
//! the index is found as a referrer of the image's manifest, checked to
//! name that manifest as its subject, and its metadata mounted over the
//! layers' uncompressed tars as cache files.
//!
//! A lazy mount leaves each tar sparse and the worker fills it span by span
//! (`lamina_daemon`, with `DaemonConfig::tar_index`); an eager one fills the
//! tars whole before the mount, each checked against the layer digest, the
//! config's diff_id and every span digest.

use std::path::Path;

use lamina_format::lookup::LOOKUP_HEADER_LEN;
use lamina_format::tar_index::TarIndex;
use lamina_image::artifact::{
    check_lookup_for, ArtifactError, ARTIFACT_TYPE_TAR_INDEX, MAX_TAR_INDEX_SIZE,
    MEDIA_TYPE_LOOKUP, MEDIA_TYPE_METADATA, MEDIA_TYPE_TAR_INDEX,
};
use lamina_oci::{
    open_source, Descriptor, ImageRef, ImageSource, RegistryClient, RegistryRef, RegistryReference,
    SourceImage,
};

use crate::cache::materialize_tar;
use crate::common::{io_err, MountError, MountInfo, MountOptions};
use crate::layers::{cache_layer_file, Record};
use lamina_fetch::store::{BlobStore, EntryKey};

/// A tar index artifact, where it is and opened.
pub type FoundIndex = (ImageRef, Box<dyn ImageSource>);

/// The tar index of `img` (opened from `image`), and where it is: the one
/// `opts` names, else one found as a referrer of its manifest in its own
/// repository (then pinned by digest); `None` when there is none or the
/// image is not in a registry.
pub fn find(
    image: &ImageRef,
    img: &SourceImage,
    opts: &MountOptions,
) -> Result<Option<FoundIndex>, MountError> {
    if let Some(named) = &opts.index {
        let artifact = open_source(named, &opts.source)?;
        check_subject(artifact.image(), img)?;
        tracing::info!(index = %named, "mounting {} through the index named", img.manifest_digest);
        return Ok(Some((named.clone(), artifact)));
    }
    let ImageRef::Registry(reg) = image else {
        return Ok(None);
    };
    let client = RegistryClient::new(&reg.host, &opts.source)?;
    let (found, how) = client.find_referrers(
        &reg.repository,
        &img.manifest_digest,
        ARTIFACT_TYPE_TAR_INDEX,
    )?;
    // The last one listed: the fallback tag's list grows at its end.
    let Some(desc) = found.last() else {
        return Ok(None);
    };
    tracing::info!(
        index = %desc.digest,
        listed = ?how,
        "{} has a tar index", img.manifest_digest
    );
    let at = ImageRef::Registry(RegistryRef {
        host: reg.host.clone(),
        repository: reg.repository.clone(),
        reference: RegistryReference::Digest(desc.digest.clone()),
    });
    let artifact = open_source(&at, &opts.source)?;
    check_subject(artifact.image(), img)?;
    Ok(Some((at, artifact)))
}

/// An index must say it is one and name the image's manifest as its
/// subject: a referrer of another manifest (a registry that lists wrongly,
/// a hostile tag) is refused.
fn check_subject(artifact: &SourceImage, img: &SourceImage) -> Result<(), MountError> {
    let manifest = &artifact.manifest;
    let subject = manifest.subject.as_ref().map(|s| &s.digest);
    if manifest.artifact_type.as_deref() != Some(ARTIFACT_TYPE_TAR_INDEX)
        || subject != Some(&img.manifest_digest)
    {
        return Err(ArtifactError::NotLamina(format!(
            "{} is listed as a tar index of {} but names {:?} as its subject",
            artifact.manifest_digest, img.manifest_digest, subject
        ))
        .into());
    }
    Ok(())
}

/// The artifact's layer of `media_type`.
pub(crate) fn layer<'a>(
    artifact: &'a SourceImage,
    media_type: &str,
) -> Result<&'a Descriptor, MountError> {
    artifact
        .manifest
        .layers
        .iter()
        .find(|l| l.media_type == media_type)
        .ok_or_else(|| {
            ArtifactError::NotLamina(format!("tar index without a {media_type} layer")).into()
        })
}

/// An image's tar index as a mount uses it: the span table (parsed and
/// checked against the image), and the cached metadata and lookup table.
pub(crate) struct IndexFiles {
    pub index: TarIndex,
    pub spans_path: std::path::PathBuf,
    pub metadata_path: std::path::PathBuf,
    pub lookup_path: Option<std::path::PathBuf>,
}

/// Caches `artifact`'s span table, metadata and (if `lookup`) lookup table
/// for a mount of `img`, each checked against its digest and recorded.
pub(crate) fn cache_index_files(
    img: &SourceImage,
    artifact: &dyn ImageSource,
    opts: &MountOptions,
    lookup: bool,
) -> Result<IndexFiles, MountError> {
    let art = artifact.image();
    let meta_dir = opts.cache_dir.join("meta");
    let cached = |media_type: &str, suffix: &str, what: &'static str, read: bool| {
        let desc = layer(art, media_type)?;
        let path = meta_dir.join(format!("{}.{suffix}", desc.digest.hex()));
        let bytes = cache_layer_file(artifact, desc, what, &path, read, Record::Now)?;
        Ok::<_, MountError>((path, bytes))
    };
    let (spans_path, spans) = cached(MEDIA_TYPE_TAR_INDEX, "tarindex", "tar index", true)?;
    let (metadata_path, _) = cached(MEDIA_TYPE_METADATA, "erofs", "metadata", false)?;
    let lookup_path = match lookup {
        true => {
            let (path, _) = cached(MEDIA_TYPE_LOOKUP, "lookup", "lookup table", false)?;
            // Bound to this index's metadata, as a lamina image's is
            // (layers::cached_lookup): the header says which it was built for.
            let mut header = [0; LOOKUP_HEADER_LEN];
            std::fs::File::open(&path)
                .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut header))
                .map_err(io_err(&path))?;
            check_lookup_for(&header, layer(art, MEDIA_TYPE_METADATA)?)?;
            Some(path)
        }
        false => None,
    };
    Ok(IndexFiles {
        index: parse(&spans.unwrap_or_default(), img)?,
        spans_path,
        metadata_path,
        lookup_path,
    })
}

/// Fills the cache for a mount of `source`'s image through its tar index
/// `artifact`: span table, metadata (and the lookup table if `lookup`),
/// and every layer's tar whole.
pub(crate) fn fill_cache(
    source: &dyn ImageSource,
    artifact: &dyn ImageSource,
    mountpoint: &Path,
    opts: &MountOptions,
    lookup: bool,
) -> Result<MountInfo, MountError> {
    let img = source.image();
    let files = cache_index_files(img, artifact, opts, lookup)?;
    let blob_dir = opts.cache_dir.join("blobs");
    let mut blob_paths = Vec::new();
    let mut fetched = 0;
    for (i, layer) in files.index.layers.iter().enumerate() {
        let key = EntryKey::of(&layer.blob);
        let (path, _) = lamina_fetch::store::store_paths(&blob_dir, &key);
        if !BlobStore::recorded_complete(&blob_dir, &key, &layer.blob.summary())
            .map_err(io_err(&path))?
        {
            let tar = source.open_layer(i)?;
            let file = materialize_tar(&path, &layer.blob, tar)?;
            BlobStore::record_complete(&blob_dir, &layer.blob, &file).map_err(io_err(&path))?;
            fetched += img.layers[i].descriptor.size;
        }
        blob_paths.push(path);
    }
    Ok(MountInfo {
        mountpoint: mountpoint.to_path_buf(),
        manifest_digest: img.manifest_digest.to_string(),
        metadata_path: files.metadata_path,
        blob_paths,
        lookup_path: files.lookup_path,
        xattrs: true,
        fetched_bytes: fetched,
    })
}

/// The error for an unmodified image without a tar index.
pub(crate) fn not_indexed(image: &ImageRef, why: &str) -> MountError {
    ArtifactError::NotLamina(format!(
        "{why}; and no tar index of it was found (make one with `lamina index {image} [DST]`; \
         name it with --index unless it is beside the image in its registry)"
    ))
    .into()
}

/// The span table, checked to describe exactly the image's layers.
fn parse(bytes: &[u8], img: &SourceImage) -> Result<TarIndex, MountError> {
    let corrupt = |reason: String| ArtifactError::Corrupt {
        what: "tar index",
        reason,
    };
    if bytes.len() as u64 > MAX_TAR_INDEX_SIZE {
        return Err(corrupt(format!("{} bytes", bytes.len())).into());
    }
    let index = TarIndex::from_bytes(bytes).map_err(|e| corrupt(e.to_string()))?;
    let same = index.layers.len() == img.layers.len()
        && index.layers.iter().zip(&img.layers).all(|(l, src)| {
            src.descriptor.digest.hex() == hex::encode(l.blob.digest)
                && src.descriptor.size == l.blob.compressed_size
        });
    if !same {
        return Err(corrupt("its layers are not the image's".into()).into());
    }
    Ok(index)
}
