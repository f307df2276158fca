//! Lazy mounts of unmodified images through their tar index
//! (`crate::tar_index` finds and caches it).

use lamina_daemon::config::WindowsSpec;
use lamina_format::tar_index::{TarLayer, SPAN_ZSTD};
use lamina_image::artifact::{MEDIA_TYPE_BOOT, MEDIA_TYPE_TAR_WINDOWS};
use lamina_oci::{Descriptor, SourceImage};

use crate::tar_index::{cache_index_files, layer};

use super::*;

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
    let dirs = crate::common::DomainDirs::of(opts, image);
    let files = cache_index_files(img, artifact, &dirs.meta, mode == Mode::Fuse)?;
    let blob_dir = &dirs.blobs;
    let mut blobs = Vec::new();
    for (layer, src) in files.index.layers.iter().zip(&img.layers) {
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
    let summaries: Vec<_> = files
        .index
        .layers
        .iter()
        .map(|l| l.blob.summary())
        .collect();
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
