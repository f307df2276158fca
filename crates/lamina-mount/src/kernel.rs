//! Mounting a lamina image with the kernel: the metadata image as a
//! file-backed EROFS, each data blob's cache file as one `device=`.
//!
//! util-linux's `mount` would wrap the image in a loop device, after which the
//! kernel refuses file paths as `device=`; calling mount(2) on the regular
//! file keeps EROFS in file-backed mode, where `device=` takes files too.

use std::fs;
use std::path::{Path, PathBuf};

use lamina_image::artifact::{self, ArtifactError, LaminaLayers};
use lamina_oci::{open_source, ImageRef, SourceOptions};
use rustix::mount::{MountFlags, UnmountFlags};

use crate::cache::{materialize_blob, store_metadata, CacheError};
use lamina_fetch::store::BlobStore;

/// Local I/O on `path` failed.
pub(crate) fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> MountError + '_ {
    move |e| MountError::Io(path.to_path_buf(), e)
}

/// Mount settings.
#[derive(Debug, Clone)]
pub struct MountOptions {
    /// Cache directory.
    pub cache_dir: PathBuf,
    /// How to reach the image.
    pub source: SourceOptions,
}

/// Why a mount failed.
#[derive(Debug, thiserror::Error)]
pub enum MountError {
    /// Opening the image.
    #[error(transparent)]
    Oci(#[from] lamina_oci::OciError),
    /// The image is not a lamina image or its metadata is corrupt.
    #[error(transparent)]
    Artifact(#[from] ArtifactError),
    /// Filling the cache.
    #[error(transparent)]
    Cache(#[from] CacheError),
    /// The mountpoint is unusable.
    #[error("mountpoint {0}: {1}")]
    Mountpoint(PathBuf, String),
    /// The mount(2) or umount(2) call failed.
    #[error("{op} {path}: {errno}{hint}")]
    Syscall {
        /// Which call.
        op: &'static str,
        /// Mountpoint.
        path: PathBuf,
        /// The error.
        errno: rustix::io::Errno,
        /// What might help.
        hint: &'static str,
    },
    /// A cache path the kernel's option parser cannot take.
    #[error("cache path {0} contains a comma; choose another --cache-dir")]
    BadCachePath(PathBuf),
    /// Local I/O.
    #[error("{0}: {1}")]
    Io(PathBuf, std::io::Error),
    /// A mount daemon (holder or FUSE daemon) could not start or mount.
    #[error("mount daemon: {0}")]
    Daemon(String),
}

/// A live mount.
#[derive(Debug, Clone, serde::Serialize)]
pub struct MountInfo {
    /// Where it is mounted.
    pub mountpoint: PathBuf,
    /// Manifest digest of the mounted image.
    pub manifest_digest: String,
    /// The EROFS metadata image.
    pub metadata_path: PathBuf,
    /// The cache files, in device order.
    pub blob_paths: Vec<PathBuf>,
    /// The lookup table: FUSE mounts of images that carry one.
    pub lookup_path: Option<PathBuf>,
    /// Bytes of blobs read from the source (0 when all were cached).
    pub fetched_bytes: u64,
}

/// The image's lookup table (when it has one), cached at
/// `meta/<layer-hex>.lookup` and checked to be built for the manifest's
/// metadata. Only FUSE mounts read it; the kernel does its own lookups.
pub(crate) fn cached_lookup(
    source: &dyn lamina_oci::ImageSource,
    layers: &LaminaLayers,
    meta_dir: &Path,
) -> Result<Option<PathBuf>, MountError> {
    let Some(desc) = &layers.lookup else {
        return Ok(None);
    };
    let path = meta_dir.join(format!("{}.lookup", desc.digest.hex()));
    let bytes = cached_layer(source, desc, "lookup table", &path)?;
    artifact::check_lookup(&bytes, layers)?;
    Ok(Some(path))
}

/// A zstd-compressed lamina layer (metadata, chunk index), kept
/// uncompressed at `path`: a cached copy is used only if it still
/// hashes to the layer's content digest; otherwise the layer is fetched,
/// checked and stored atomically. Both mount paths go through here.
pub(crate) fn cached_layer(
    source: &dyn lamina_oci::ImageSource,
    desc: &lamina_oci::Descriptor,
    what: &'static str,
    path: &Path,
) -> Result<Vec<u8>, MountError> {
    let expected = desc
        .annotations
        .get(artifact::ANNOTATION_UNCOMPRESSED_DIGEST)
        .ok_or_else(|| ArtifactError::NotLamina(format!("{what} layer has no content digest")))?;
    if let Ok(bytes) = fs::read(path) {
        if lamina_oci::Digest::of_bytes(&bytes).to_string() == *expected {
            return Ok(bytes);
        }
    }
    let bytes = artifact::read_compressed_layer(source, desc, what)?;
    store_metadata(path, &bytes)?;
    Ok(bytes)
}

/// Mounts `image` (read-only) at `mountpoint`, filling the cache first.
pub fn mount_image(
    image: &ImageRef,
    mountpoint: &Path,
    opts: &MountOptions,
) -> Result<MountInfo, MountError> {
    let info = fill_cache(image, mountpoint, opts, false)?;
    let data_c =
        lamina_daemon::holder::device_options(info.blob_paths.iter().map(PathBuf::as_path))
            .map_err(MountError::BadCachePath)?;
    rustix::mount::mount(
        info.metadata_path.as_path(),
        mountpoint,
        "erofs",
        MountFlags::RDONLY,
        Some(data_c.as_c_str()),
    )
    .map_err(|errno| MountError::Syscall {
        op: "mount",
        path: mountpoint.to_path_buf(),
        errno,
        hint: match errno {
            rustix::io::Errno::PERM | rustix::io::Errno::ACCESS => " (mounting needs root)",
            rustix::io::Errno::NODEV => " (the kernel has no EROFS support: modprobe erofs)",
            rustix::io::Errno::NOTBLK | rustix::io::Errno::INVAL => {
                " (the kernel needs CONFIG_EROFS_FS_BACKED_BY_FILE, Linux 6.12 or later, and \
                 the cache dir on a disk filesystem: it refuses tmpfs files; --mode auto \
                 serves through FUSE there)"
            }
            _ => "",
        },
    })?;
    record_eager(opts, &info);
    Ok(info)
}

/// Fetches and verifies everything a mount of `image` reads (metadata,
/// index, every blob whole; the lookup table if `lookup`) into the cache,
/// for a mount at `mountpoint`.
pub(crate) fn fill_cache(
    image: &ImageRef,
    mountpoint: &Path,
    opts: &MountOptions,
    lookup: bool,
) -> Result<MountInfo, MountError> {
    let meta = fs::metadata(mountpoint)
        .map_err(|e| MountError::Mountpoint(mountpoint.to_path_buf(), e.to_string()))?;
    if !meta.is_dir() {
        return Err(MountError::Mountpoint(
            mountpoint.to_path_buf(),
            "not a directory".into(),
        ));
    }
    lamina_fetch::private::private_dir(&opts.cache_dir).map_err(io_err(&opts.cache_dir))?;
    let source = open_source(image, &opts.source)?;
    let img = source.image();
    let layers = LaminaLayers::from_manifest(&img.manifest)?;
    let meta_dir = opts.cache_dir.join("meta");
    let index_bytes = cached_layer(
        source.as_ref(),
        &layers.index,
        "chunk index",
        &meta_dir.join(format!("{}.index", layers.index.digest.hex())),
    )?;
    let index = artifact::parse_index(&index_bytes, &layers)?;
    let meta_path = meta_dir.join(format!("{}.erofs", layers.metadata.digest.hex()));
    cached_layer(source.as_ref(), &layers.metadata, "metadata", &meta_path)?;
    let lookup_path = match lookup {
        true => cached_lookup(source.as_ref(), &layers, &meta_dir)?,
        false => None,
    };

    let mut blob_paths = Vec::new();
    let mut fetched = 0;
    for (desc, blob) in layers.blobs.iter().zip(&index.blobs) {
        // Complete only if a fill record bound to this cache file says so:
        // a lazy mount's sparse file has the full length too.
        let blob_dir = opts.cache_dir.join("blobs");
        let (path, _) = lamina_fetch::store::store_paths(&blob_dir, &hex::encode(blob.digest));
        if !BlobStore::recorded_complete(&blob_dir, blob).map_err(io_err(&path))? {
            let reader = source.open_blob(desc)?;
            let file = materialize_blob(&path, blob, reader)?;
            BlobStore::record_complete(&blob_dir, blob, &file).map_err(io_err(&path))?;
            fetched += desc.size;
        }
        blob_paths.push(path);
    }
    Ok(MountInfo {
        mountpoint: mountpoint.to_path_buf(),
        manifest_digest: img.manifest_digest.to_string(),
        metadata_path: meta_path,
        blob_paths,
        lookup_path,
        fetched_bytes: fetched,
    })
}

/// A record of a mount over complete cache files, for gc and umount;
/// losing it only makes gc less careful.
pub(crate) fn record_eager(opts: &MountOptions, info: &MountInfo) {
    let Ok(m) = fs::metadata(&info.mountpoint) else {
        return;
    };
    let run = crate::lazy::run_dir(&opts.cache_dir, &info.mountpoint);
    let mut files = info.blob_paths.clone();
    files.push(info.metadata_path.clone());
    files.extend(info.lookup_path.clone());
    let record = crate::gc::EagerRecord {
        mountpoint: fs::canonicalize(&info.mountpoint).unwrap_or_else(|_| info.mountpoint.clone()),
        dev: std::os::unix::fs::MetadataExt::dev(&m),
        files,
    };
    if lamina_fetch::private::private_dir(&run).is_ok() {
        if let Ok(bytes) = serde_json::to_vec(&record) {
            let _ = lamina_fetch::private::write_atomic(&run.join("eager.json"), &bytes, false);
        }
    }
}

/// Unmounts a lamina mount.
pub fn unmount(mountpoint: &Path) -> Result<(), MountError> {
    let unmounted = rustix::mount::unmount(mountpoint, UnmountFlags::empty());
    if unmounted == Err(rustix::io::Errno::PERM) && !rustix::process::geteuid().is_root() {
        // A rootless FUSE mount: the setuid helper unmounts what its user
        // mounted.
        return fusermount_unmount(mountpoint);
    }
    unmounted.map_err(|errno| MountError::Syscall {
        op: "umount",
        path: mountpoint.to_path_buf(),
        errno,
        hint: match errno {
            rustix::io::Errno::BUSY => " (still in use)",
            rustix::io::Errno::INVAL => " (not a mount point)",
            _ => "",
        },
    })
}

/// `fusermount3 -u MNT` (or `fusermount -u`): how a user who is not root
/// unmounts the FUSE mount they made.
fn fusermount_unmount(mountpoint: &Path) -> Result<(), MountError> {
    let mut last = String::from("neither fusermount3 nor fusermount found");
    for helper in ["fusermount3", "fusermount"] {
        match std::process::Command::new(helper)
            .arg("-u")
            .arg(mountpoint)
            .stdin(std::process::Stdio::null())
            .output()
        {
            Ok(out) if out.status.success() => return Ok(()),
            Ok(out) => {
                last = format!(
                    "{helper} -u: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                );
                break;
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => {
                last = format!("{helper}: {e}");
                break;
            }
        }
    }
    Err(MountError::Daemon(format!(
        "unmounting {}: {last}",
        mountpoint.display()
    )))
}
