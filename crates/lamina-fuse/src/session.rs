//! Serving a mount: the daemon's config, the FUSE session (privileged or
//! through fusermount3), the lazy mount's filler, status and readahead.

use super::*;

/// What the FUSE daemon serves, written by `lamina mount --mode fuse`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ServeConfig {
    /// The verified EROFS metadata image (or, with `metadata_frames`, the
    /// sparse file its frames are to be written into).
    pub metadata_path: PathBuf,
    /// A lazy mount's metadata, left in compressed frames: written as
    /// requests need them and in the background, then recorded.
    #[serde(default)]
    pub metadata_frames: Option<MetadataFrames>,
    /// Its lookup table, verified and checked to be built for it; `None`
    /// for images converted before lookup tables.
    #[serde(default)]
    pub lookup_path: Option<PathBuf>,
    /// Or its lookup table, to be fetched by the worker after the mount.
    #[serde(default)]
    pub lookup_later: Option<LookupLater>,
    /// Whether the image may hold extended attributes. `false` (its
    /// manifest says no inode has any): getxattr gets EOPNOTSUPP, which
    /// `ls -l` takes as "none on this filesystem" and stops asking (it asks
    /// two per file otherwise), listxattr ENOSYS.
    #[serde(default = "yes")]
    pub xattrs: bool,
    /// Complete blob cache files, in device-table order.
    pub blob_paths: Vec<PathBuf>,
    /// The identity of each, as the mount found or made it: the daemon
    /// serves from those files and no other (`None` or missing: no birth
    /// time to check).
    #[serde(default)]
    pub blob_files: Vec<Option<lamina_daemon::config::CacheFileId>>,
    /// Where to mount.
    pub mountpoint: PathBuf,
    /// A lazy mount: the worker's config (its blobs are filled on demand
    /// by a worker started from it). `None`: the blobs are complete.
    #[serde(default)]
    pub worker_config: Option<PathBuf>,
    /// Threads serving requests.
    pub threads: usize,
    /// setuid and device nodes: off (`nosuid,nodev`) unless asked for.
    #[serde(default)]
    pub privileges: lamina_daemon::config::Privileges,
    /// Written (atomically) once mounted or when mounting failed: the same
    /// `ready` file as a lazy mount's holder writes.
    pub ready_path: PathBuf,
    /// This image's objects (`<cache>/objects/<metadata-layer-hex>`): files
    /// passed through to the kernel are copied there. `None`, or a daemon
    /// not running as root (registering a backing file needs
    /// CAP_SYS_ADMIN): no passthrough.
    #[serde(default)]
    pub objects_dir: Option<PathBuf>,
    /// The objects by content of the image's trust domain
    /// (`<cache>/objects/content/<domain>`), which `objects_dir` links:
    /// one object for every image's file with those bytes. `None` (a
    /// config from before): a store of the image's own, inside
    /// `objects_dir`.
    #[serde(default)]
    pub objects_content_dir: Option<PathBuf>,
    /// Smaller files are never passed through: copying one costs more than
    /// the single FUSE round trip its reads take, and the page cache keeps
    /// its bytes after the first read anyway.
    #[serde(default = "default_passthrough_min_size")]
    pub passthrough_min_size: u64,
    /// Where the daemon keeps its counters ([`Stats`]) as JSON, rewritten
    /// atomically when they change.
    #[serde(default)]
    pub status_path: Option<PathBuf>,
}

/// [`ServeConfig::passthrough_min_size`] unless configured.
pub const DEFAULT_PASSTHROUGH_MIN_SIZE: u64 = 64 << 10;

pub(crate) fn default_passthrough_min_size() -> u64 {
    DEFAULT_PASSTHROUGH_MIN_SIZE
}

pub(crate) fn yes() -> bool {
    true
}

/// The FUSE daemon: mounts `config`'s image and serves it until unmounted.
pub fn serve(config: &ServeConfig) -> std::io::Result<()> {
    let _ = rustix::process::setsid();
    // As the holder: the mount dies with this process, so a stray SIGTERM
    // must not take it; it ends when the filesystem is unmounted.
    lamina_sys::ignore_termination_signals()?;
    if is_root() {
        if let Some(run_dir) = config.ready_path.parent() {
            lamina_daemon::bounds::enter_mount_cgroup(run_dir, &[]);
        }
    }
    let report = |error: Option<String>| {
        let ready = Ready {
            pid: std::process::id(),
            error,
        };
        let bytes = serde_json::to_vec(&ready).map_err(std::io::Error::other)?;
        write_atomic(&config.ready_path, &bytes)
    };
    // Without root, fusermount3 mounts first and hands over /dev/fuse.
    let rootless_fd = if is_root() {
        None
    } else {
        match fusermount::mount(&config.mountpoint, ROOTLESS_OPTIONS) {
            Ok(fd) => Some(fd),
            Err(e) => {
                report(Some(e.to_string()))?;
                return Err(e);
            }
        }
    };
    let rootless = rootless_fd.is_some();
    let undo_mount = || {
        if rootless {
            let _ = std::process::Command::new("fusermount3")
                .arg("-u")
                .arg(&config.mountpoint)
                .status();
        }
    };
    let filler = match &config.worker_config {
        Some(path) => match Filler::start(path) {
            Ok(f) => Some(Arc::new(f)),
            Err(e) => {
                undo_mount();
                let e = format!("starting the worker: {e}");
                report(Some(e.clone()))?;
                return Err(std::io::Error::other(e));
            }
        },
        None => None,
    };
    let (session, stats, frames) = match open_session(config, filler.clone(), rootless_fd) {
        Ok(s) => s,
        Err(e) => {
            undo_mount();
            if let Some(f) = &filler {
                f.shutdown();
            }
            report(Some(e.clone()))?;
            return Err(std::io::Error::other(e));
        }
    };
    report(None)?;
    if let Some(path) = &config.status_path {
        write_status_while_serving(path.clone(), stats, frames.clone());
    }
    if let Some(frames) = frames {
        let threads = std::thread::available_parallelism().map_or(2, usize::from);
        let path = config.metadata_path.clone();
        frames::fill_in_background(frames, path, threads);
    }
    if let Some(f) = &filler {
        lower_readahead_while_incomplete(config, f.clone());
    }
    tracing::info!(
        mountpoint = %config.mountpoint.display(),
        lazy = filler.is_some(),
        "serving through FUSE"
    );
    let served = session.run();
    tracing::info!("unmounted; exiting");
    if let Some(f) = &filler {
        // The worker saves its fill records before it exits.
        f.shutdown();
    }
    served
}

/// Rewrites the status file at `path` whenever `stats` (or the metadata
/// `frames` the daemon writes) changed (checked every quarter second), for
/// the daemon's life.
pub(crate) fn write_status_while_serving(
    path: PathBuf,
    stats: Arc<Stats>,
    frames: Option<Arc<frames::FrameFill>>,
) {
    let spawned = std::thread::Builder::new()
        .name("status".into())
        .spawn(move || {
            let mut last = serde_json::Value::Null;
            loop {
                let mut now = stats.to_json();
                if let Some(frames) = &frames {
                    now["metadata_frames"] = frames.to_json();
                }
                if now != last {
                    if let Err(e) = write_atomic(&path, now.to_string().as_bytes()) {
                        tracing::warn!("{}: {e}", path.display());
                    }
                    last = now;
                }
                std::thread::sleep(Duration::from_millis(250));
            }
        });
    if let Err(e) = spawned {
        tracing::warn!("no status thread: {e}");
    }
}

/// Every [`BLOB_PAGE_DROP_INTERVAL`], drops the page cache of the (complete)
/// blob files an eager mount serves from, for the daemon's life: each page
/// read for a reader is kept in the FUSE inode's page cache (or, passed
/// through, in its object's), so the blob file's copy is a second one, as
/// are the pages the object maker read. Clean pages: dropping costs no
/// write, and a page dropped early is read again, never wrong.
pub(crate) fn drop_blob_pages_while_serving(blobs: Arc<[File]>) {
    let spawned = std::thread::Builder::new()
        .name("page-drop".into())
        .spawn(move || loop {
            std::thread::sleep(BLOB_PAGE_DROP_INTERVAL);
            for blob in blobs.iter() {
                let _ = rustix::fs::fadvise(blob, 0, None, rustix::fs::Advice::DontNeed);
            }
        });
    if let Err(e) = spawned {
        tracing::warn!("blob pages kept: no thread to drop them: {e}");
    }
}

/// How often an eager mount's daemon drops its blob files' pages (as a lazy
/// mount's worker does its cache files', after each save of its records).
pub(crate) const BLOB_PAGE_DROP_INTERVAL: Duration = Duration::from_secs(1);

/// In a lazy mount whose worker config asks for it (`readahead_kb`: when
/// recording a trace or serving boot pages), lowers the mount's readahead
/// until every blob is complete, as the holder does for a kernel mount:
/// each page read ahead is a page to fetch. On a thread, since opening the
/// mount's root needs the session to be serving.
pub(crate) fn lower_readahead_while_incomplete(config: &ServeConfig, filler: Arc<Filler>) {
    let Some(path) = &config.worker_config else {
        return;
    };
    let kb = match lamina_daemon::config::DaemonConfig::load(path) {
        Ok(c) => c.readahead_kb,
        Err(e) => return tracing::warn!("read_ahead_kb left as is: {e}"),
    };
    let (Some(kb), false) = (kb, filler.all_complete()) else {
        return;
    };
    let mountpoint = config.mountpoint.clone();
    let spawned = std::thread::Builder::new()
        .name("readahead".into())
        .spawn(move || {
            let lowered = match BdiReadahead::lower(&mountpoint, kb) {
                Ok(r) => r,
                Err(e) => return tracing::warn!("read_ahead_kb left as is: {e}"),
            };
            while !filler.all_complete() {
                std::thread::sleep(Duration::from_millis(200));
            }
            lowered.restore();
        });
    if let Err(e) = spawned {
        tracing::warn!("read_ahead_kb left as is: {e}");
    }
}

/// What fusermount3 mounts a rootless FUSE mount with (it adds nosuid and
/// nodev itself).
pub(crate) const ROOTLESS_OPTIONS: &str = "ro,fsname=lamina,subtype=lamina,default_permissions";

/// Opens a blob's cache file, checked to be the file the mount was made
/// with (`want`): one put at its path since is never served from.
pub(crate) fn open_blob(
    path: &Path,
    want: Option<lamina_daemon::config::CacheFileId>,
) -> Result<File, String> {
    let file = File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let Some(want) = want else {
        return Ok(file);
    };
    let got =
        lamina_fetch::store::identity(&file).map_err(|e| format!("{}: {e}", path.display()))?;
    match got.map(lamina_daemon::config::CacheFileId::from) == Some(want) {
        true => Ok(file),
        false => Err(format!(
            "{}: not the cache file this mount was made with (replaced since); not serving from it",
            path.display()
        )),
    }
}

/// The session serving `config`'s image: on `fuse_fd` when fusermount3 has
/// mounted it already, else mounted here; its counters; and the metadata's
/// frames when they are still being written.
#[allow(clippy::type_complexity)]
pub(crate) fn open_session(
    config: &ServeConfig,
    filler: Option<Arc<Filler>>,
    fuse_fd: Option<std::os::fd::OwnedFd>,
) -> Result<(fuser::Session<ImageFs>, Arc<Stats>, Option<Arc<FrameFill>>), String> {
    let blobs = config
        .blob_paths
        .iter()
        .enumerate()
        .map(|(i, p)| open_blob(p, config.blob_files.get(i).copied().flatten()))
        .collect::<Result<Vec<_>, _>>()?;
    let path = &config.metadata_path;
    let at = |e: std::io::Error| format!("{}: {e}", path.display());
    // Mapped, not read: the daemon serves this one image for its whole
    // life, and touches only the pages lookups and reads need.
    let (fs, frames) = match &config.metadata_frames {
        None => (ImageFs::new(map_forever(path)?, blobs, filler), None),
        Some(spec) => {
            // The file mapped is the file filled, whatever is renamed
            // over its path meanwhile.
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(path)
                .map_err(at)?;
            let meta = lamina_sys::map_file_forever(&file).map_err(at)?;
            let frames = Arc::new(FrameFill::new(spec, file).map_err(at)?);
            let fs = ImageFs::filling(meta, frames.clone(), blobs, filler);
            (fs, Some(frames))
        }
    };
    let mut fs = fs.map_err(|e| e.to_string())?;
    if let Some(path) = &config.lookup_path {
        let table = map_forever(path)?;
        fs = fs
            .with_lookup(table)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        tracing::info!(bytes = table.len(), "lookups through the lookup table");
    } else if let Some(later) = &config.lookup_later {
        await_lookup(later.clone(), fs.lookup.clone(), fs.image.root_nid());
    }
    // Backing files need CAP_SYS_ADMIN in the initial user namespace.
    if let Some(dir) = config
        .objects_dir
        .clone()
        .filter(|_| lamina_sys::is_host_root())
    {
        let content = config
            .objects_content_dir
            .clone()
            .unwrap_or_else(|| dir.join(CONTENT_DIR));
        fs = fs.with_passthrough(dir, content, config.passthrough_min_size);
    }
    if !config.xattrs {
        fs = fs.without_xattrs();
    }
    let stats = fs.stats();
    keep_mapped_pages_bounded(stats.clone());
    if config.worker_config.is_none() {
        // A lazy mount's worker drops its cache files' pages itself.
        drop_blob_pages_while_serving(fs.blob_files());
    }
    let fuse = fuse_config(config.threads, config.privileges);
    let session = match fuse_fd {
        Some(fd) => fuser::Session::from_fd(fs, fd, fuse.acl, fuse),
        None => fuser::Session::new(fs, &config.mountpoint, &fuse),
    }
    .map_err(|e| format!("FUSE mount at {}: {e}", config.mountpoint.display()))?;
    Ok((session, stats, frames))
}

/// The file at `path`, mapped read-only for the daemon's life.
pub(crate) fn map_forever(path: &Path) -> Result<&'static [u8], String> {
    File::open(path)
        .and_then(|f| lamina_sys::map_file_forever(&f))
        .map_err(|e| format!("{}: {e}", path.display()))
}

pub(crate) fn fuse_config(
    threads: usize,
    privileges: lamina_daemon::config::Privileges,
) -> fuser::Config {
    use fuser::MountOption as O;
    let mut c = fuser::Config::default();
    c.mount_options = vec![
        O::RO,
        O::FSName("lamina".into()),
        O::Subtype("lamina".into()),
        // The kernel checks permissions from the modes it is given.
        O::DefaultPermissions,
    ];
    if is_root() {
        // Every user (a container's) may read it, as a kernel mount; the
        // modes decide (DefaultPermissions). setuid binaries and device
        // nodes work only where asked for (a container runtime's private
        // mount dir): otherwise they would be every local user's.
        c.mount_options
            .push(if privileges.suid { O::Suid } else { O::NoSuid });
        c.mount_options
            .push(if privileges.dev { O::Dev } else { O::NoDev });
        c.acl = fuser::SessionACL::All;
    } else {
        // Rootless (mounted by fusermount3): only the mounting user, and
        // the user namespaces it owns, read it; allow_other would need
        // user_allow_other in /etc/fuse.conf.
        c.acl = fuser::SessionACL::Owner;
    }
    c.n_threads = Some(threads.max(1));
    c.clone_fd = true;
    c
}

pub(crate) fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

/// Reads a daemon config written by the mounting command: only a private
/// file of this user is trusted (the daemon does what it says, as root when
/// mounted by root), as the holder's is (`DaemonConfig::load`).
pub fn load_config(path: &Path) -> std::io::Result<ServeConfig> {
    let bytes = lamina_fetch::private::read_trusted(path)?;
    serde_json::from_slice(&bytes).map_err(std::io::Error::other)
}
