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

use lamina_format::tar_index::TarIndex;
use lamina_image::artifact::{
    bound_index, ArtifactError, ARTIFACT_TYPE_TAR_INDEX, MAX_TAR_INDEX_SIZE, MEDIA_TYPE_LOOKUP,
    MEDIA_TYPE_METADATA, MEDIA_TYPE_TAR_INDEX,
};
use lamina_oci::{
    open_source, Descriptor, Digest, ImageRef, ImageSource, RegistryClient, RegistryRef,
    RegistryReference, SourceImage,
};

use crate::cache::materialize_tar;
use crate::common::{io_err, MountError, MountInfo, MountOptions};
use crate::layers::{cache_layer_file, cached_lookup_for, Record};
use lamina_fetch::store::{BlobStore, EntryKey};

/// A tar index artifact, where it is and opened.
pub type FoundIndex = (ImageRef, Box<dyn ImageSource>);

/// Which tar indexes this node mounts images through (docs/index.md, *Who
/// is trusted with what*). An index says which tar bytes are which file,
/// with which mode and owner, so it is used only when someone the node
/// trusts vouches for it: the image's publisher, by binding it into the
/// image index the user named (its digest covers the index), or the
/// node's operator, by naming it (`--index`, by digest in a registry) or
/// pinning its digest here. A referrer nothing vouches for is refused.
#[derive(Debug, Clone, Default)]
pub struct IndexTrust {
    /// Use a referrer nothing vouches for, with a warning in the log,
    /// instead of refusing it: for finding out what enforcing would refuse.
    pub audit: bool,
    /// Tar index manifests the operator vouches for, by digest.
    pub pinned: Vec<Digest>,
    /// Keys whose cosign signature of a tar index manifest vouches for it
    /// (its publisher's, or the operator's own).
    pub keys: Vec<lamina_oci::cosign::TrustedKey>,
}

/// Most referrer indexes whose signatures are looked for: each costs
/// requests, and anyone with push rights can list more.
const MAX_SIGNED_CANDIDATES: usize = 8;

/// Why an index is used: who vouched for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Vouch {
    /// Bound into the image index the image was named by.
    Bound,
    /// Named by the operator (`--index`).
    Named,
    /// Its digest is in the node's pinned list.
    Pinned,
    /// Signed with one of the node's keys.
    Signed,
    /// Nothing: used because the policy is in audit mode.
    Audit,
}

/// The tar index of `img` (opened from `image`), and where it is: the one
/// `opts` names; else the one bound to its manifest in the image index it
/// was named by; else a referrer of its manifest that the node pins (or
/// any, in audit mode). `None` when there is none; an error when there are
/// referrers but nothing vouches for them.
pub fn find(
    image: &ImageRef,
    img: &SourceImage,
    opts: &MountOptions,
) -> Result<Option<FoundIndex>, MountError> {
    let Some((at, vouch)) = locate(image, img, opts)? else {
        return Ok(None);
    };
    let artifact = open_source(&at, &opts.source)?;
    check_subject(artifact.image(), img)?;
    tracing::info!(index = %at, vouched = ?vouch, "mounting {} through its tar index", img.manifest_digest);
    Ok(Some((at, artifact)))
}

/// Where the index to use is, and who vouches for it.
fn locate(
    image: &ImageRef,
    img: &SourceImage,
    opts: &MountOptions,
) -> Result<Option<(ImageRef, Vouch)>, MountError> {
    let trust = &opts.index_trust;
    if let Some(named) = &opts.index {
        let by_tag = matches!(named, ImageRef::Registry(r) if matches!(r.reference, RegistryReference::Tag(_)));
        if by_tag && !trust.audit {
            return Err(MountError::UntrustedIndex(format!(
                "--index {named} names a tag, which whoever can push to it may move: name the \
                 index by digest (REPO@sha256:...)"
            )));
        }
        return Ok(Some((named.clone(), Vouch::Named)));
    }
    let ImageRef::Registry(reg) = image else {
        return Ok(None);
    };
    let at = |digest: &Digest| {
        ImageRef::Registry(RegistryRef {
            host: reg.host.clone(),
            repository: reg.repository.clone(),
            reference: RegistryReference::Digest(digest.clone()),
        })
    };
    if let Some(bound) = bound_index(&img.index_entries, &img.manifest_digest) {
        return Ok(Some((at(&bound.digest), Vouch::Bound)));
    }
    let client = RegistryClient::new(&reg.host, &opts.source)?;
    let (found, how) = client.find_referrers(
        &reg.repository,
        &img.manifest_digest,
        ARTIFACT_TYPE_TAR_INDEX,
    )?;
    // The last one listed: the fallback tag's list grows at its end.
    if let Some(pinned) = found
        .iter()
        .rev()
        .find(|d| trust.pinned.contains(&d.digest))
    {
        return Ok(Some((at(&pinned.digest), Vouch::Pinned)));
    }
    // Newest first: a re-made index (boot pages recorded) signed again wins.
    for candidate in found.iter().rev().take(MAX_SIGNED_CANDIDATES) {
        let signer = client.cosign_signer(&reg.repository, &candidate.digest, &trust.keys)?;
        if let Some(key) = signer {
            tracing::info!(index = %candidate.digest, key = %key.name, "the tar index is signed by a trusted key");
            return Ok(Some((at(&candidate.digest), Vouch::Signed)));
        }
    }
    let Some(last) = found.last() else {
        return Ok(None);
    };
    if trust.audit {
        tracing::warn!(
            index = %last.digest,
            listed = ?how,
            "audit: {} has a tar index that nothing vouches for (not bound to the image, \
             not pinned); enforcing would refuse it",
            img.manifest_digest
        );
        return Ok(Some((at(&last.digest), Vouch::Audit)));
    }
    Err(MountError::UntrustedIndex(format!(
        "{image} ({}) has {} tar index(es) listed as referrers ({how:?}), and nothing this node \
         trusts vouches for any: whoever can push a referrer chooses what such an index shows. \
         Bind the index to the image (`lamina index {image}` pushes an image index listing both \
         under the tag; mount that tag or its digest), pin one by digest (--index \
         {}/{}@{}, or `pinned` in the config's [index] section), or sign it with cosign and \
         trust the key (--trust-index-key cosign.pub, `keys` in [index])",
        img.manifest_digest,
        found.len(),
        reg.host,
        reg.repository,
        last.digest,
    )))
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

/// An image's tar index as an eager mount uses it: the span table (parsed
/// and checked against the image), and the cached metadata and lookup table.
pub(crate) struct IndexFiles {
    pub index: TarIndex,
    pub metadata_path: std::path::PathBuf,
    pub lookup_path: Option<std::path::PathBuf>,
}

/// Caches `artifact`'s span table, metadata and (if `lookup`) lookup table
/// for a mount of `img`, each checked against its digest and recorded.
pub(crate) fn cache_index_files(
    img: &SourceImage,
    artifact: &dyn ImageSource,
    meta_dir: &Path,
    lookup: bool,
) -> Result<IndexFiles, MountError> {
    let (index, _) = cache_spans(img, artifact, meta_dir)?;
    let (metadata, metadata_path) = metadata_file(artifact.image(), meta_dir)?;
    cache_metadata_whole(artifact, metadata, &metadata_path)?;
    let lookup_path = match lookup {
        true => Some(cache_lookup(artifact, meta_dir)?),
        false => None,
    };
    Ok(IndexFiles {
        index,
        metadata_path,
        lookup_path,
    })
}

/// The artifact's metadata layer and the file a mount keeps it in.
pub(crate) fn metadata_file<'a>(
    art: &'a SourceImage,
    meta_dir: &Path,
) -> Result<(&'a Descriptor, std::path::PathBuf), MountError> {
    let desc = layer(art, MEDIA_TYPE_METADATA)?;
    Ok((desc, meta_dir.join(format!("{}.erofs", desc.digest.hex()))))
}

/// Caches the metadata layer `desc` whole at `path`, checked against its
/// digest and recorded (eager mounts and the kernel path).
pub(crate) fn cache_metadata_whole(
    artifact: &dyn ImageSource,
    desc: &Descriptor,
    path: &Path,
) -> Result<(), MountError> {
    cache_layer_file(artifact, desc, "metadata", path, false, Record::Now).map(drop)
}

/// Caches `artifact`'s span table, checked against its digest, recorded
/// and parsed against `img`; the table and its path.
pub(crate) fn cache_spans(
    img: &SourceImage,
    artifact: &dyn ImageSource,
    meta_dir: &Path,
) -> Result<(TarIndex, std::path::PathBuf), MountError> {
    let desc = layer(artifact.image(), MEDIA_TYPE_TAR_INDEX)?;
    let path = meta_dir.join(format!("{}.tarindex", desc.digest.hex()));
    let spans = cache_layer_file(artifact, desc, "tar index", &path, true, Record::Now)?;
    Ok((parse(&spans.unwrap_or_default(), img)?, path))
}

/// Caches `artifact`'s lookup table, checked against its digest, recorded
/// and bound to the index's metadata (its header names the metadata it was
/// built for, as a lamina image's does: `layers::cached_lookup`).
pub(crate) fn cache_lookup(
    artifact: &dyn ImageSource,
    meta_dir: &Path,
) -> Result<std::path::PathBuf, MountError> {
    let art = artifact.image();
    let (desc, metadata) = (
        layer(art, MEDIA_TYPE_LOOKUP)?,
        layer(art, MEDIA_TYPE_METADATA)?,
    );
    cached_lookup_for(artifact, desc, metadata, meta_dir, Record::Now)
}

/// Fills the cache for a mount of `source`'s image through its tar index
/// `artifact`: span table, metadata (and the lookup table if `lookup`),
/// and every layer's tar whole.
pub(crate) fn fill_cache(
    source: &dyn ImageSource,
    artifact: &dyn ImageSource,
    image: &ImageRef,
    mountpoint: &Path,
    opts: &MountOptions,
    lookup: bool,
) -> Result<MountInfo, MountError> {
    let img = source.image();
    let dirs = crate::common::DomainDirs::of(opts, image);
    let files = cache_index_files(img, artifact, &dirs.meta, lookup)?;
    let blob_dir = &dirs.blobs;
    let mut blob_paths = Vec::new();
    let mut fetched = 0;
    for (i, layer) in files.index.layers.iter().enumerate() {
        let key = EntryKey::of(&layer.blob);
        let (path, _) = lamina_fetch::store::store_paths(blob_dir, &key);
        if !BlobStore::recorded_complete(blob_dir, &key, &layer.blob.summary())
            .map_err(io_err(&path))?
        {
            let tar = source.open_layer(i)?;
            let file = materialize_tar(&path, &layer.blob, tar)?;
            BlobStore::record_complete(blob_dir, &layer.blob, &file).map_err(io_err(&path))?;
            fetched += img.layers[i].descriptor.size;
        }
        blob_paths.push(path);
    }
    Ok(MountInfo {
        mountpoint: mountpoint.to_path_buf(),
        manifest_digest: img.manifest_digest.to_string(),
        metadata_path: files.metadata_path,
        blob_paths,
        index_path: None,
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
