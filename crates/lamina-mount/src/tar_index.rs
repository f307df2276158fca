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

use lamina_fetch::store::Prepared;
use lamina_format::lookup::LOOKUP_HEADER_LEN;
use lamina_format::tar_index::{TarIndex, TarLayer, SPAN_ZSTD};
use lamina_image::artifact::{
    check_lookup_for, ArtifactError, ARTIFACT_TYPE_TAR_INDEX, MAX_TAR_INDEX_SIZE, MEDIA_TYPE_BOOT,
    MEDIA_TYPE_LOOKUP, MEDIA_TYPE_METADATA, MEDIA_TYPE_TAR_INDEX, MEDIA_TYPE_TAR_WINDOWS,
};
use lamina_oci::{
    open_source, Descriptor, ImageRef, ImageSource, RegistryClient, RegistryRef, RegistryReference,
    SourceImage,
};

use crate::cache::materialize_tar;
use crate::kernel::{cache_layer_file, io_err, MountError, MountInfo, MountOptions, Record};
use crate::lazy::{
    blob_spec, boot_specs, daemon_config, readahead_for_boot, source_spec, start_serving,
    FuseExtras, LazyOptions, LazyPlan,
};
use crate::mode::Mode;
use lamina_daemon::config::WindowsSpec;
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
fn layer<'a>(artifact: &'a SourceImage, media_type: &str) -> Result<&'a Descriptor, MountError> {
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
struct IndexFiles {
    index: TarIndex,
    spans_path: std::path::PathBuf,
    metadata_path: std::path::PathBuf,
    lookup_path: Option<std::path::PathBuf>,
}

/// Caches `artifact`'s span table, metadata and (if `lookup`) lookup table
/// for a mount of `img`, each checked against its digest and recorded.
fn cache_index_files(
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
            // (kernel::cached_lookup): the header says which it was built for.
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

/// Mounts `img` lazily through its tar index `artifact`: the span table,
/// metadata (and for FUSE the lookup table) are cached now; each layer's
/// cache file is its uncompressed tar, sparse, which the worker fills span
/// by span from the original layer blob as reads need them.
pub(crate) fn mount_lazy(
    image: &ImageRef,
    img: &SourceImage,
    (index_ref, artifact): (&ImageRef, &dyn ImageSource),
    mountpoint: std::path::PathBuf,
    opts: &MountOptions,
    lazy: &LazyOptions,
    mode: Mode,
) -> Result<MountInfo, MountError> {
    let files = cache_index_files(img, artifact, opts, mode == Mode::Fuse)?;
    let blob_dir = opts.cache_dir.join("blobs");
    let mut blobs = Vec::new();
    for (layer, src) in files.index.layers.iter().zip(&img.layers) {
        note_single_frame(layer, &src.descriptor);
        let store = BlobStore::open(&blob_dir, layer.blob.clone()).map_err(io_err(&blob_dir))?;
        let prepared = Prepared {
            cache_path: store.cache_path.clone(),
            complete: store.is_complete(),
            identity: store.identity(),
        };
        blobs.push(blob_spec(&src.descriptor.digest, prepared));
    }
    tracing::info!(
        "{image}: mounting lazily through its tar index ({} layers, {} spans)",
        blobs.len(),
        files
            .index
            .layers
            .iter()
            .map(|l| l.blob.chunks.len())
            .sum::<usize>()
    );
    let plan = LazyPlan {
        image,
        manifest_digest: img.manifest_digest.to_string(),
        mountpoint,
        metadata_path: files.metadata_path,
        index_path: files.spans_path,
        blobs,
        tar_index: true,
    };
    let (mut config, run) = daemon_config(plan, opts, lazy)?;
    let boot: Vec<Descriptor> = artifact
        .image()
        .manifest
        .layers
        .iter()
        .filter(|l| l.media_type == MEDIA_TYPE_BOOT)
        .cloned()
        .collect();
    let summaries: Vec<_> = files
        .index
        .layers
        .iter()
        .map(|l| l.blob.summary())
        .collect();
    // The worker fetches boot pages from the image's repository.
    if same_repository(image, index_ref) {
        config.boot_pages = boot_specs(&boot, &summaries, &opts.cache_dir.join("meta"))?;
    } else if !boot.is_empty() {
        tracing::warn!(
            "{index_ref} has boot pages, but is not in {image}'s repository: the mount goes \
             without them"
        );
    }
    readahead_for_boot(&mut config, lazy);
    // Predictions fetch whole spans and windows for whole files: a python3
    // start at 100 Mbit/s took 0.99 s with them and 0.66 s without, moving
    // twice the bytes (docs/index.md).
    config.predict_max = 0;
    // The worker checks each window's range against the blob's size.
    config.tar_windows = match layer(artifact.image(), MEDIA_TYPE_TAR_WINDOWS) {
        Ok(desc) => Some(WindowsSpec {
            digest: desc.digest.to_string(),
            size: desc.size,
            source: source_spec(index_ref, opts, &config.mountpoint)?,
        }),
        Err(_) => None,
    };
    let fuse = FuseExtras {
        lookup: files.lookup_path,
        ..FuseExtras::default()
    };
    start_serving(&opts.cache_dir, &config, &run, mode, fuse)
}

/// Whether `a` and `b` are in one registry repository.
fn same_repository(a: &ImageRef, b: &ImageRef) -> bool {
    match (a, b) {
        (ImageRef::Registry(a), ImageRef::Registry(b)) => {
            a.host == b.host && a.repository == b.repository
        }
        _ => false,
    }
}

/// Says so when a layer is one zstd frame: it cannot be split, so its first
/// read fetches it whole.
fn note_single_frame(layer: &TarLayer, desc: &Descriptor) {
    let spans = &layer.blob.chunks;
    if spans.len() == 1 && spans[0].flags.get() == SPAN_ZSTD {
        tracing::info!(
            "layer {} is a single zstd frame: its first read fetches it whole ({} bytes)",
            desc.digest,
            desc.size
        );
    }
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
