//! Lazy mounts of unmodified images through their tar index
//! (`crate::tar_index` finds and caches it).

use lamina_daemon::config::WindowsSpec;
use lamina_format::tar_index::{TarLayer, SPAN_ZSTD};
use lamina_image::artifact::{MEDIA_TYPE_BOOT, MEDIA_TYPE_LOOKUP, MEDIA_TYPE_TAR_WINDOWS};
use lamina_oci::{Descriptor, SourceImage};

use crate::tar_index::{cache_lookup, cache_metadata_whole, cache_spans, layer, metadata_file};

use super::*;

/// Mounts `img` lazily through its tar index `artifact`: the span table is
/// cached now, and the metadata on the kernel path; a FUSE daemon fetches
/// the metadata's frames as requests need them, and the worker the lookup
/// table after the mount (as for a lamina image, `super::mount_lazy`).
/// Each layer's cache file is its uncompressed tar, sparse, which the
/// worker fills span by span from the original layer blob as reads need
/// them.
pub(crate) fn mount_lazy(
    image: &ImageRef,
    img: &SourceImage,
    (index_ref, artifact): (&ImageRef, &dyn ImageSource),
    mountpoint: std::path::PathBuf,
    opts: &MountOptions,
    lazy: &LazyOptions,
    mode: Mode,
) -> Result<MountInfo, MountError> {
    let dirs = crate::common::DomainDirs::of(opts, image);
    let (index, spans_path) = cache_spans(img, artifact, &dirs.meta)?;
    let (metadata, metadata_path) = metadata_file(artifact.image(), &dirs.meta)?;
    let tables = match mode {
        Mode::Kernel => {
            cache_metadata_whole(artifact, metadata, &metadata_path)?;
            FuseTables::default()
        }
        // The worker fetches from the image's repository: a lookup table
        // elsewhere is fetched now.
        Mode::Fuse => fuse_tables(
            artifact,
            (metadata, &metadata_path),
            &dirs.meta,
            same_repository(image, index_ref),
        )?,
    };
    let blob_dir = &dirs.blobs;
    let mut blobs = Vec::new();
    for (layer, src) in index.layers.iter().zip(&img.layers) {
        note_single_frame(layer, &src.descriptor);
        let store = BlobStore::open(blob_dir, layer.blob.clone()).map_err(io_err(blob_dir))?;
        let prepared = Prepared {
            cache_path: store.cache_path.clone(),
            complete: store.is_complete(),
            identity: store.identity(),
        };
        blobs.push(blob_spec(&src.descriptor.digest, prepared));
    }
    if lazy.reserve_space {
        super::reserve_cache_files(blob_dir, &blobs)?;
    }
    tracing::info!(
        "{image}: mounting lazily through its tar index ({} layers, {} spans)",
        blobs.len(),
        index
            .layers
            .iter()
            .map(|l| l.blob.chunks.len())
            .sum::<usize>()
    );
    let plan = LazyPlan {
        image,
        manifest_digest: img.manifest_digest.to_string(),
        mountpoint,
        metadata_path,
        index_path: spans_path,
        blobs,
        blob_dir: dirs.blobs.clone(),
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
    let summaries: Vec<_> = index.layers.iter().map(|l| l.blob.summary()).collect();
    // The worker fetches boot pages from the image's repository.
    if same_repository(image, index_ref) {
        config.boot_pages = boot_specs(&boot, &summaries, &dirs.meta)?;
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
    // Only what the worker or daemon fetches from it needs the index's
    // source (a reference that has none fails only then).
    let mountpoint = config.mountpoint.clone();
    let index_source = || source_spec(index_ref, opts, &mountpoint);
    config.tar_windows = match layer(artifact.image(), MEDIA_TYPE_TAR_WINDOWS) {
        Ok(desc) => Some(WindowsSpec {
            digest: desc.digest.to_string(),
            size: desc.size,
            source: index_source()?,
        }),
        Err(_) => None,
    };
    if tables.frames.is_some() {
        config.metadata_fill = Some(MetadataFill::Frames {
            digest: hex::encode(content_digest(metadata, "metadata")?),
        });
    } else if mode == Mode::Fuse {
        // Cached, or decompressed whole unrecorded (a layer not in sized
        // frames): the worker records it.
        config.adopt = vec![AdoptSpec {
            path: config.metadata_path.clone(),
            digest: format!(
                "sha256:{}",
                hex::encode(content_digest(metadata, "metadata")?)
            ),
        }];
    }
    config.later_layers = tables
        .lookup_later
        .iter()
        .map(|(spec, _)| spec.clone())
        .collect();
    let frames = match tables.frames {
        Some(layer) => {
            let remote = (index_source()?, config.timeout_secs);
            Some(frames_for_daemon(layer, &run, metadata, remote)?)
        }
        None => None,
    };
    let fuse = FuseExtras {
        frames,
        lookup: tables.lookup,
        lookup_later: tables.lookup_later.map(|(_, later)| later),
    };
    start_serving(&opts.cache_dir, &config, &run, mode, fuse)
}

/// What a lazy FUSE mount takes of a tar index beyond its span table.
#[derive(Default)]
struct FuseTables {
    /// The metadata's frames for the daemon to write (`None`: cached).
    frames: Option<MetadataLayer>,
    /// The lookup table, when cached.
    lookup: Option<PathBuf>,
    /// Or the one the worker fetches after the mount.
    lookup_later: Option<(LayerSpec, LookupLater)>,
}

/// The metadata's first frame (or its whole layer, when its frames are not
/// listed), and the lookup table: now, or after the mount if `later` (when
/// the worker's source holds it).
fn fuse_tables(
    artifact: &dyn ImageSource,
    (metadata, metadata_path): (&Descriptor, &Path),
    meta_dir: &Path,
    later: bool,
) -> Result<FuseTables, MountError> {
    let frames = cache_metadata_frames(artifact, metadata, metadata_path, true)?;
    let lookup = layer(artifact.image(), MEDIA_TYPE_LOOKUP).ok();
    let (lookup, lookup_later) = match (lookup, later) {
        (None, _) => (None, None),
        (Some(desc), true) => lookup_now_or_later(Some(desc), metadata, meta_dir)?,
        (Some(_), false) => (Some(cache_lookup(artifact, meta_dir)?), None),
    };
    Ok(FuseTables {
        frames,
        lookup,
        lookup_later,
    })
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
