//! Mounting through FUSE: a daemon (`lamina internal-fuse CONFIG`, see
//! `lamina_fuse`) mounts the image and serves it from the cache until it is
//! unmounted. An eager mount fills and verifies the cache first, as for a
//! kernel mount; a lazy one ([`crate::mount`] with lazy options) gives the daemon
//! a worker that fills it on demand.

use std::fs;
use std::path::{Path, PathBuf};

use lamina_daemon::config::{CacheFileId, Privileges};
use lamina_fetch::private;
use lamina_fuse::ServeConfig;
use lamina_oci::ImageRef;

use crate::common::{io_err, MountError, MountInfo, MountOptions};
use crate::daemons::start_daemon;
use crate::kernel::{fill_cache, record_eager};

/// Threads of a FUSE daemon: requests block on reads of the cache.
pub const FUSE_THREADS: usize = 4;

/// The FUSE daemon's counters, in its run dir.
pub const FUSE_STATUS: &str = "fuse-status.json";

/// The objects dir of the image whose metadata is `meta/<layer-hex>.erofs`
/// and whose data is in the cache entries `blobs`:
/// `objects/<layer-hex>.<entries>`, where `<entries>` is the first 32 hex
/// digits of the sha256 of the entries' file names. An object is a copy of
/// bytes verified in those entries, so images that describe a blob another
/// way (another entry) never share an object with this one. gc keeps the
/// dir exactly while the metadata file is in use.
pub(crate) fn objects_dir(cache_dir: &Path, metadata: &Path, blobs: &[PathBuf]) -> Option<PathBuf> {
    let hex = metadata.file_stem()?.to_str()?;
    let mut names = Vec::new();
    for blob in blobs {
        names.extend_from_slice(blob.file_name()?.as_encoded_bytes());
        names.push(b'\n');
    }
    let entries = hex::encode(&lamina_oci::sha256(&names)[..16]);
    Some(cache_dir.join("objects").join(format!("{hex}.{entries}")))
}

/// The objects by content of the trust domain whose cache files are
/// `blobs` (`blobs/<domain>/…`): `objects/content/<domain>`. Files with the
/// same bytes in any image of the domain are passed through to one object
/// there; images of other domains never share one.
pub(crate) fn content_dir(cache_dir: &Path, blobs: &[PathBuf]) -> PathBuf {
    let blob_dir = cache_dir.join("blobs");
    let domain = blobs
        .first()
        .and_then(|b| b.parent())
        .filter(|d| *d != blob_dir)
        .and_then(|d| d.file_name())
        .map_or_else(|| "_".into(), |d| d.to_string_lossy().into_owned());
    cache_dir
        .join("objects")
        .join(lamina_fuse::CONTENT_DIR)
        .join(domain)
}

/// The identity of the (complete, recorded) cache file at `path`, as an
/// eager mount hands it to its daemon.
fn file_id(path: &Path) -> Option<CacheFileId> {
    let file = private::open_existing(path).ok()?;
    lamina_fetch::store::identity(&file)
        .ok()?
        .map(CacheFileId::from)
}

/// Mounts `image` at `mountpoint` through FUSE, filling the cache first.
pub fn mount_fuse(
    image: &ImageRef,
    mountpoint: &Path,
    opts: &MountOptions,
) -> Result<MountInfo, MountError> {
    let mut info = fill_cache(image, mountpoint, opts, true)?;
    info.mountpoint = fs::canonicalize(mountpoint).map_err(io_err(mountpoint))?;
    let run = crate::common::run_dir(&opts.cache_dir, mountpoint);
    private::private_dir(&run).map_err(io_err(&run))?;
    let image = FuseImage {
        metadata: &info.metadata_path,
        frames: None,
        lookup: info.lookup_path.as_deref(),
        lookup_later: None,
        blobs: &info.blob_paths,
        xattrs: info.xattrs,
        privileges: opts.privileges,
        blob_files: info.blob_paths.iter().map(|p| file_id(p)).collect(),
    };
    start_fuse_daemon(&opts.cache_dir, &run, &image, &info.mountpoint, None)?;
    record_eager(opts, &info);
    Ok(info)
}

/// What a FUSE daemon serves: files in the cache.
pub(crate) struct FuseImage<'a> {
    /// The verified metadata image.
    pub metadata: &'a Path,
    /// Or the file its frames are to be written into, and those frames.
    pub frames: Option<lamina_fuse::frames::MetadataFrames>,
    /// Its lookup table, when the image has one.
    pub lookup: Option<&'a Path>,
    /// Or the lookup table a lazy mount's worker fetches after the mount.
    pub lookup_later: Option<lamina_fuse::LookupLater>,
    /// The blobs' cache files, in device order.
    pub blobs: &'a [PathBuf],
    /// Whether the tree may hold extended attributes.
    pub xattrs: bool,
    /// setuid and device nodes: off unless asked for.
    pub privileges: Privileges,
    /// The identity of each blob's cache file, as the mount found or made
    /// it.
    pub blob_files: Vec<Option<CacheFileId>>,
}

/// Starts the FUSE daemon serving `image` (in `cache_dir`) at `mountpoint`,
/// with its files in the run dir `run`; a lazy mount passes its worker's
/// config. Returns once it has mounted.
pub(crate) fn start_fuse_daemon(
    cache_dir: &Path,
    run: &Path,
    image: &FuseImage<'_>,
    mountpoint: &Path,
    worker_config: Option<PathBuf>,
) -> Result<(), MountError> {
    let metadata = image.metadata;
    // Whatever an earlier mount at this point left must not be read as ours.
    for stale in ["ready", "fuse.json", "fuse.log", "eager.json", FUSE_STATUS] {
        let _ = fs::remove_file(run.join(stale));
    }
    let config = ServeConfig {
        metadata_path: metadata.to_path_buf(),
        metadata_frames: image.frames.clone(),
        lookup_path: image.lookup.map(Path::to_path_buf),
        lookup_later: image.lookup_later.clone(),
        xattrs: image.xattrs,
        privileges: image.privileges,
        blob_paths: image.blobs.to_vec(),
        blob_files: image.blob_files.clone(),
        mountpoint: mountpoint.to_path_buf(),
        worker_config,
        threads: FUSE_THREADS,
        ready_path: run.join("ready"),
        // Only the host's root may register backing files: without it,
        // no objects.
        objects_dir: lamina_sys::is_host_root()
            .then(|| objects_dir(cache_dir, metadata, image.blobs))
            .flatten(),
        objects_content_dir: Some(content_dir(cache_dir, image.blobs)),
        passthrough_min_size: lamina_fuse::DEFAULT_PASSTHROUGH_MIN_SIZE,
        status_path: Some(run.join(FUSE_STATUS)),
    };
    let config_path = run.join("fuse.json");
    let bytes =
        serde_json::to_vec_pretty(&config).map_err(|e| MountError::Daemon(e.to_string()))?;
    private::write_atomic(&config_path, &bytes, false).map_err(io_err(&config_path))?;
    start_daemon(
        "internal-fuse",
        &config_path,
        &run.join("fuse.log"),
        "FUSE daemon",
    )
}
