//! What every way of mounting shares: the mount settings, the mount it
//! makes, the error, and where a mount keeps its run files.

use std::fs;
use std::path::{Path, PathBuf};

use lamina_daemon::config::Privileges;
use lamina_image::artifact::ArtifactError;
use lamina_oci::{ImageRef, SourceOptions};

use crate::cache::CacheError;

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
    /// setuid and device nodes: off (`nosuid,nodev`) unless asked for.
    pub privileges: Privileges,
    /// An unmodified image's tar index, named (`--index`): else one is
    /// looked for among the image's referrers.
    pub index: Option<ImageRef>,
    /// Which tar indexes may be used (bound, named, pinned; audit mode).
    pub index_trust: crate::tar_index::IndexTrust,
    /// Files shared across images by content (`--share-files`): the mount
    /// is an overlayfs of the image's metadata view over the trust
    /// domain's shards (`shared.rs`). Eager kernel mounts only, for now.
    pub share_files: bool,
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
    /// A tar index nothing the node trusts vouches for.
    #[error("tar index refused: {0}")]
    UntrustedIndex(String),
    /// The cache filesystem cannot hold what a mount reserves.
    #[error(
        "no room in {dir} for the image: its cache files need {need} more bytes, {free} are \
         free (--reserve-space); remove what no mount uses with `lamina gc`, or give the \
         cache more space"
    )]
    NoRoom {
        /// The blobs dir.
        dir: PathBuf,
        /// Bytes the mount's cache files still need.
        need: u64,
        /// Bytes free for an unprivileged writer.
        free: u64,
    },
    /// A mount daemon (holder or FUSE daemon) could not start or mount.
    #[error("mount daemon: {0}")]
    Daemon(String),
    /// `--share-files` cannot share this image's files.
    #[error("--share-files: {0}")]
    Share(String),
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
    /// The verified chunk index (a lamina image's; not a tar index's).
    #[serde(skip)]
    pub index_path: Option<PathBuf>,
    /// The lookup table: FUSE mounts of images that carry one.
    pub lookup_path: Option<PathBuf>,
    /// Whether the image's tree may hold extended attributes (false when
    /// its manifest says no inode has any).
    pub xattrs: bool,
    /// Bytes of blobs read from the source (0 when all were cached).
    pub fetched_bytes: u64,
}

/// The run directory of the mount at `mountpoint`.
pub fn run_dir(cache_dir: &Path, mountpoint: &Path) -> PathBuf {
    let canonical = fs::canonicalize(mountpoint).unwrap_or_else(|_| mountpoint.to_path_buf());
    let digest = lamina_oci::sha256(canonical.as_os_str().as_encoded_bytes());
    cache_dir.join("mounts").join(hex::encode(&digest[..8]))
}

/// The cache dir a lamina mount at `mountpoint` was made with, found from
/// the mount itself: a kernel-path mount's source is its metadata in the
/// cache, a `--share-files` view's overlay names its metadata view there.
/// The cache dir is the nearest ancestor of one of those paths that holds
/// this mountpoint's run dir. `None` for a FUSE mount (its source names no
/// path) or anything else.
pub fn cache_dir_of(mountpoint: &Path) -> Option<PathBuf> {
    let want = fs::canonicalize(mountpoint).ok()?;
    let mounts = lamina_sys::mountinfo::mounts().ok()?;
    let top = mounts.iter().rev().find(|m| m.mount_point == want)?;
    let mut paths: Vec<PathBuf> = Vec::new();
    match top.fs_type.as_str() {
        "erofs" => paths.push(PathBuf::from(&top.source)),
        "overlay" => {
            for option in &top.super_options {
                let lower = ["lowerdir+=", "lowerdir="]
                    .iter()
                    .find_map(|key| option.strip_prefix(key));
                paths.extend(
                    lower
                        .into_iter()
                        .flat_map(|l| l.split(':'))
                        .map(PathBuf::from),
                );
            }
        }
        _ => {}
    }
    paths
        .iter()
        .filter(|p| p.is_absolute())
        .flat_map(|p| p.ancestors().skip(1))
        .find(|dir| run_dir(dir, mountpoint).is_dir())
        .map(Path::to_path_buf)
}

/// Where the cache keeps what a mount of an image reads, in the dirs of
/// the image's trust domain ([`domain_id`]).
#[derive(Debug, Clone)]
pub(crate) struct DomainDirs {
    /// `blobs/<domain>`: cache files of the image's blobs, their records
    /// and chunk tables, the domain's chunk locator.
    pub blobs: PathBuf,
    /// `meta/<domain>`: metadata, chunk or span index, lookup table, boot
    /// pages (file names and modes are an image's bytes too).
    pub meta: PathBuf,
    /// `shards/<domain>`: shards of objects shared by content
    /// (`--share-files`, `shared.rs`).
    pub shards: PathBuf,
}

impl DomainDirs {
    /// The dirs of `image`'s trust domain in `opts`' cache dir.
    pub(crate) fn of(opts: &MountOptions, image: &ImageRef) -> DomainDirs {
        let id = domain_id(opts, image);
        DomainDirs {
            blobs: opts.cache_dir.join("blobs").join(&id),
            meta: opts.cache_dir.join("meta").join(&id),
            shards: opts.cache_dir.join("shards").join(id),
        }
    }
}

/// The trust domain `image` is read in: what a registry tells one client
/// from another by. That is the host with its settings (plain HTTP or TLS,
/// CAs, the hosts.toml dir, which names mirrors, client certificates and
/// headers) and the credentials this process presents
/// ([`lamina_oci::credentials_identity`]); a local layout or archive is
/// a domain of its own. Mounts share cache files (so each other's fetches,
/// and the listeners the kernel asks about every read of a shared file)
/// only within a domain, where each may fetch whatever the others may: an
/// image that names another tenant's layers gets cache files of its own
/// and only what its own registry serves it.
fn domain_id(opts: &MountOptions, image: &ImageRef) -> String {
    let domain = match image {
        ImageRef::Registry(r) => serde_json::json!({
            "registry": r.host,
            "insecure": opts.source.insecure_hosts.contains(&r.host),
            "tls": opts.source.tls_hosts.contains(&r.host),
            "ca_file": opts.source.ca_file,
            "hosts_dir": opts.source.hosts.dir(),
            "credentials": lamina_oci::credentials_identity(&opts.source),
        }),
        ImageRef::Oci { dir, .. } => serde_json::json!({ "layout": absolute(dir) }),
        ImageRef::DockerArchive { path, .. } => serde_json::json!({ "archive": absolute(path) }),
    };
    let id = hex::encode(&lamina_oci::sha256(domain.to_string().as_bytes())[..8]);
    // Not the description: it holds a digest of LAMINA_REGISTRY_AUTH.
    tracing::debug!("{image}: trust domain {id}");
    id
}

fn absolute(path: &Path) -> PathBuf {
    fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf())
}
