//! Lazy mounts: fetch manifest, index and metadata, create sparse cache
//! files, then hand over to a daemon that mounts and serves misses: the
//! holder (kernel path, see `lamina-daemon`) or the FUSE daemon (see
//! `lamina-fuse`), each with a worker that fetches and verifies. Returns
//! once the mount is usable.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use lamina_daemon::config::{
    AdoptSpec, BlobSpec, BootFrameSpec, BootPagesSpec, CacheFileId, DaemonConfig, LayerSpec,
    MetadataFill, SourceSpec,
};
use lamina_daemon::holder::Ready;
use lamina_fetch::private;
use lamina_fetch::store::{BlobStore, Prepared};
use lamina_fuse::frames::{FrameSpan, MetadataFrames, RemoteFrames};
use lamina_fuse::LookupLater;
use lamina_image::artifact::{self, ArtifactError, LaminaLayers};
use lamina_oci::{open_source, ImageRef, ImageSource, RegistryRef};

use crate::common::{io_err, run_dir, MountError, MountInfo, MountOptions};
use crate::daemons::start_daemon;
use crate::layers::{
    cache_layer_file, cache_metadata_frames, cached_layer, check_lookup_file, content_digest,
    open_recorded, MetadataFrames as MetadataLayer, Record,
};
use crate::mode::Mode;

mod tar;

/// What a lazy mount fetches without a reader waiting for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Prefetch {
    /// Nothing: every byte on first read.
    None,
    /// The image's boot pages only.
    Pages,
    /// Boot pages, then the boot set's whole chunks once the start is over
    /// (images without boot pages: the boot set's chunks at once).
    #[default]
    Boot,
    /// As `Boot`, then the rest of the image, yielding to every miss.
    All,
}

/// Settings of the on-demand path.
#[derive(Debug, Clone)]
pub struct LazyOptions {
    /// A reader waits at most this long for its bytes, then gets EIO.
    pub timeout: Duration,
    /// A miss fetches the chunks in this many bytes around it.
    pub fill_window: u64,
    /// Largest window fetched ahead of a reader reading a blob in order
    /// (0: never).
    pub fill_ahead: u64,
    /// Threads serving misses.
    pub workers: usize,
    /// What to fetch without a reader waiting.
    pub prefetch: Prefetch,
    /// Record every miss, in order, to this file.
    pub record_trace: Option<PathBuf>,
    /// `read_ahead_kb` of the mount while blobs are incomplete (default: 0
    /// when recording a trace or when the image has boot pages, else the
    /// kernel's).
    pub readahead_kb: Option<u32>,
    /// Hedge slow range requests (`lamina_fetch::hedge`).
    pub hedge: bool,
    /// Largest shared library or executable fetched whole on its first
    /// miss (`lamina_daemon::predict`; 0: never).
    pub predict_max: u64,
    /// Fetch the rest of a blob a start has waited on long, on a fast link
    /// (`DaemonConfig::fetch_rests`).
    pub fetch_rests: bool,
    /// Free bytes of the cache filesystem that fills no reader waits for
    /// leave to the reads readers wait on (`None`: a tenth of it, at most
    /// 1 GiB; `lamina_daemon::config::DaemonConfig::cache_reserve`).
    pub cache_reserve: Option<u64>,
    /// Allocate the image's cache files whole at mount
    /// ([`reserve_cache_files`]): no fill of this mount can then fail for
    /// want of space, or take the space another mount's fills need.
    pub reserve_space: bool,
}

impl Default for LazyOptions {
    fn default() -> Self {
        LazyOptions {
            timeout: Duration::from_secs(60),
            fill_window: 0,
            fill_ahead: lamina_daemon::config::DEFAULT_FILL_AHEAD,
            workers: 8,
            prefetch: Prefetch::Boot,
            record_trace: None,
            readahead_kb: None,
            hedge: true,
            predict_max: lamina_daemon::config::DEFAULT_PREDICT_MAX,
            fetch_rests: false,
            cache_reserve: None,
            reserve_space: false,
        }
    }
}

/// Whether the lazy mount at `mountpoint` (cache `cache_dir`) has its
/// daemon: the `ready` file of its run dir names a live lamina daemon (its
/// holder, or its FUSE daemon) that reported no error. A mount whose daemon
/// died serves no new data (reads of what is not local fail, or for FUSE
/// every read does) and should be detached and mounted again.
pub fn is_served(cache_dir: &Path, mountpoint: &Path) -> bool {
    let run = run_dir(cache_dir, mountpoint);
    // Or a `--share-files` view of a shard another mount serves.
    daemon_serves(&run) || crate::shared::view_served(&run)
}

/// Whether the `ready` file of the run dir `run` names a live lamina
/// daemon that reported no error.
pub(crate) fn daemon_serves(run: &Path) -> bool {
    fs::read(run.join("ready"))
        .ok()
        .and_then(|b| serde_json::from_slice::<Ready>(&b).ok())
        .filter(|r| r.error.is_none())
        .is_some_and(|r| crate::daemons::is_lamina_daemon(r.pid))
}

/// Opens `image` and mounts it lazily in `mode`; a bad mount point fails
/// before anything is fetched.
fn open_and_mount(
    image: &ImageRef,
    mountpoint: &Path,
    opts: &MountOptions,
    lazy: &LazyOptions,
    mode: Mode,
) -> Result<MountInfo, MountError> {
    mountpoint_dir(mountpoint)?;
    let source = open_source(image, &opts.source)?;
    mount_lazy_from(source, image, mountpoint, opts, lazy, mode)
}

/// `mountpoint`, resolved, when it is a directory.
fn mountpoint_dir(mountpoint: &Path) -> Result<PathBuf, MountError> {
    let dir = fs::canonicalize(mountpoint)
        .map_err(|e| MountError::Mountpoint(mountpoint.to_path_buf(), e.to_string()))?;
    if !dir.is_dir() {
        return Err(MountError::Mountpoint(dir, "not a directory".into()));
    }
    Ok(dir)
}

/// The layer files a lazy mount's worker is to sync and record
/// ([`Record::Later`]): those already recorded it finds so and skips. Not
/// the metadata while a FUSE daemon writes its frames (`meta_path`
/// `None`): the daemon records it once whole.
fn adopt_specs(
    layers: &LaminaLayers,
    meta_path: Option<&Path>,
    index_path: &Path,
    lookup_path: Option<&Path>,
) -> Result<Vec<AdoptSpec>, MountError> {
    let spec = |path: &Path, desc: &lamina_oci::Descriptor, what| -> Result<_, MountError> {
        Ok(AdoptSpec {
            path: path.to_path_buf(),
            digest: format!("sha256:{}", hex::encode(content_digest(desc, what)?)),
        })
    };
    let mut specs = vec![spec(index_path, &layers.index, "chunk index")?];
    if let Some(path) = meta_path {
        specs.push(spec(path, &layers.metadata, "metadata")?);
    }
    if let (Some(path), Some(desc)) = (lookup_path, &layers.lookup) {
        specs.push(spec(path, desc, "lookup table")?);
    }
    Ok(specs)
}

/// A lazy FUSE mount's lookup table: its path when cached and recorded
/// (checked to be built for this metadata), else what the worker is to
/// fetch after the mount and the daemon to wait for. The mount then moves
/// no bytes for it: 14 MB for an image of a million files.
#[allow(clippy::type_complexity)]
fn lookup_now_or_later(
    lookup: Option<&lamina_oci::Descriptor>,
    metadata: &lamina_oci::Descriptor,
    meta_dir: &Path,
) -> Result<(Option<PathBuf>, Option<(LayerSpec, LookupLater)>), MountError> {
    let Some(desc) = lookup else {
        return Ok((None, None));
    };
    let path = meta_dir.join(format!("{}.lookup", desc.digest.hex()));
    let content = content_digest(desc, "lookup table")?;
    if let Some(file) = open_recorded(&path, &content) {
        check_lookup_file(file, &path, metadata)?;
        return Ok((Some(path), None));
    }
    let size = artifact::check_lookup_layer(desc)?;
    let digest = format!("sha256:{}", hex::encode(content));
    let spec = LayerSpec {
        what: "lookup table".into(),
        layer_digest: desc.digest.to_string(),
        layer_size: desc.size,
        digest: digest.clone(),
        size,
        path: path.clone(),
    };
    let later = LookupLater {
        path,
        digest,
        metadata_digest: format!(
            "sha256:{}",
            hex::encode(content_digest(metadata, "metadata")?)
        ),
    };
    Ok((None, Some((spec, later))))
}

/// Mounts `image` at `mountpoint` in `mode`: lazily with `lazy`, else
/// with the cache filled first. What `lamina mount`, `lamina run` and the
/// snapshotter do.
pub fn mount(
    image: &ImageRef,
    mountpoint: &Path,
    opts: &MountOptions,
    lazy: Option<&LazyOptions>,
    mode: Mode,
) -> Result<MountInfo, MountError> {
    let _starting = crate::gc::starting_mount(&opts.cache_dir)?;
    match (mode, lazy) {
        (mode, Some(lazy)) => open_and_mount(image, mountpoint, opts, lazy, mode),
        (Mode::Fuse, None) => crate::fuse::mount_fuse(image, mountpoint, opts),
        (Mode::Kernel, None) => crate::kernel::mount_image(image, mountpoint, opts),
    }
}

/// A lazy mount of `image` at `mountpoint` in `mode`, with `image` already
/// opened as `source` (a caller that has just resolved it saves the
/// manifest and config round trips). Through FUSE, the same cache, worker
/// and verification as the kernel path: the FUSE daemon asks the worker
/// for the bytes a read needs.
// Over 100 lines: one mount's steps in order, each taking what the one before found.
pub fn mount_lazy_from(
    source: Box<dyn ImageSource>,
    image: &ImageRef,
    mountpoint: &Path,
    opts: &MountOptions,
    lazy: &LazyOptions,
    mode: Mode,
) -> Result<MountInfo, MountError> {
    let mountpoint = mountpoint_dir(mountpoint)?;
    let _starting = crate::gc::starting_mount(&opts.cache_dir)?;
    let img = source.image();
    let layers = match LaminaLayers::from_manifest(&img.manifest) {
        Ok(layers) => layers,
        Err(ArtifactError::NotLamina(why)) => {
            if opts.share_files {
                tracing::warn!("{image}: a tar index mount does not share files yet; not shared");
            }
            // An unmodified image: served through its tar index, if any.
            return match crate::tar_index::find(image, img, opts)? {
                Some((index_ref, index)) => tar::mount_lazy(
                    image,
                    img,
                    (&index_ref, index.as_ref()),
                    mountpoint,
                    opts,
                    lazy,
                    mode,
                ),
                None => Err(crate::tar_index::not_indexed(image, &why)),
            };
        }
        Err(e) => return Err(e.into()),
    };
    // Index and metadata are independent: fetch them at once, and the
    // first frame of the boot pages beside the metadata once the index
    // says where it is. The other frames are left to the worker, which
    // fetches them while the mount and the container runtime start (misses
    // wait for them).
    let dirs = crate::common::DomainDirs::of(opts, image);
    let meta_dir = &dirs.meta;
    let meta_path = meta_dir.join(format!("{}.erofs", layers.metadata.digest.hex()));
    let index_path = meta_dir.join(format!("{}.index", layers.index.digest.hex()));
    let src = source.as_ref();
    let blob_dir = &dirs.blobs;
    let early_boot = boot_frame_at_mount(lazy, blob_dir);
    // A --share-files mount splits the metadata before it mounts.
    let by_range = !opts.share_files;
    let (index_bytes, metadata, lookup_path) = std::thread::scope(|scope| {
        let index = scope.spawn(|| {
            let bytes = cached_layer(
                src,
                &layers.index,
                "chunk index",
                &index_path,
                Record::Later,
            )?;
            if early_boot {
                first_boot_frames(src, &layers, &bytes, meta_dir);
            }
            Ok(bytes)
        });
        // Only the FUSE daemon reads the lookup table, and only once its
        // worker has fetched it, unless it is cached already.
        let lookup = scope.spawn(|| match mode {
            Mode::Fuse => lookup_now_or_later(layers.lookup.as_ref(), &layers.metadata, meta_dir),
            Mode::Kernel => Ok((None, None)),
        });
        // Through FUSE, the metadata's frames are written by the daemon as
        // requests need them: the mount fetches one frame (or the layer,
        // when the manifest lists no frames).
        let metadata = match mode {
            Mode::Fuse => cache_metadata_frames(src, &layers.metadata, &meta_path, by_range),
            Mode::Kernel => cache_layer_file(
                src,
                &layers.metadata,
                "metadata",
                &meta_path,
                false,
                Record::Later,
            )
            .map(|_| None),
        };
        let panicked = |what: &str| MountError::Daemon(format!("{what} fetch panicked"));
        let index = index.join().unwrap_or_else(|_| Err(panicked("index")));
        let lookup = lookup
            .join()
            .unwrap_or_else(|_| Err(panicked("lookup table")));
        (index, metadata, lookup)
    });
    let index = artifact::parse_index(&index_bytes?, &layers)?;
    let metadata_frames = metadata?;
    let (lookup_path, lookup_later) = lookup_path?;
    let boot_pages = boot_specs(&layers.boot, &index.blobs, meta_dir)?;

    let mut blobs = Vec::new();
    for (i, desc) in layers.blobs.iter().enumerate() {
        // A paged index's chunk tables come with the first read of their
        // blob (the worker's); the cache file is made now, for the kernel.
        let prepared = match index.inline.get(i) {
            Some(blob) => BlobStore::open(blob_dir, blob.clone()).map(|s| Prepared {
                cache_path: s.cache_path.clone(),
                complete: s.is_complete(),
                identity: s.identity(),
            }),
            None => BlobStore::prepare(blob_dir, &index.blobs[i]),
        }
        .map_err(io_err(blob_dir))?;
        blobs.push(blob_spec(&desc.digest, prepared));
    }
    if lazy.reserve_space {
        reserve_cache_files(blob_dir, &blobs)?;
    }

    let plan = LazyPlan {
        image,
        manifest_digest: img.manifest_digest.to_string(),
        mountpoint,
        metadata_path: meta_path,
        index_path,
        blobs,
        blob_dir: dirs.blobs.clone(),
        tar_index: false,
    };
    let (mut config, run) = daemon_config(plan, opts, lazy)?;
    config.metadata_fill = Some(match &metadata_frames {
        Some(_) => MetadataFill::Frames {
            digest: hex::encode(content_digest(&layers.metadata, "metadata")?),
        },
        None => MetadataFill::Whole,
    });
    config.boot_pages = boot_pages;
    readahead_for_boot(&mut config, lazy);
    config.adopt = adopt_specs(
        &layers,
        metadata_frames
            .is_none()
            .then_some(config.metadata_path.as_path()),
        &config.index_path,
        lookup_path.as_deref(),
    )?;
    config.later_layers = lookup_later.iter().map(|(spec, _)| spec.clone()).collect();
    config.xattrs = artifact::may_have_xattrs(&img.manifest);
    let frames = match metadata_frames {
        Some(layer) => {
            let source = config.source.clone();
            let remote = (source, config.timeout_secs);
            Some(frames_for_daemon(layer, &run, &layers.metadata, remote)?)
        }
        None => None,
    };
    if opts.share_files {
        let view = crate::shared::LazyView {
            src,
            layers: &layers,
            index: &index,
            run: &run,
        };
        return crate::shared::mount_lazy_view(view, config, opts, &dirs.shards);
    }
    let fuse = FuseExtras {
        frames,
        lookup: lookup_path,
        lookup_later: lookup_later.map(|(_, later)| later),
    };
    start_serving(&opts.cache_dir, &config, &run, mode, fuse)
}

/// Whether the mount fetches the first boot-pages frame: only when the
/// worker will load boot pages (not `--prefetch none`, not while recording
/// a trace) and the node holds no chunk yet (one that does may hold the
/// boot set, and then the worker fetches no boot pages at all).
fn boot_frame_at_mount(lazy: &LazyOptions, blob_dir: &Path) -> bool {
    if lazy.prefetch == Prefetch::None || lazy.record_trace.is_some() {
        return false;
    }
    lamina_fetch::locator::ChunkLocator::open(blob_dir).is_ok_and(|l| !l.may_hold_any())
}

/// Fetches the first frame of each boot-pages layer into the file the
/// worker looks in first (`BootPagesSpec::frame_path`), checked against
/// the frame's digest (the worker checks it again before use). Through a
/// P2P daemon each blob's first request waits for the daemon's task (a
/// third of a second, docs/dragonfly.md): made here, beside the
/// metadata's, that wait is paid once rather than twice in a row. A
/// failure only leaves the frame to the worker.
fn first_boot_frames(
    src: &dyn ImageSource,
    layers: &LaminaLayers,
    index_bytes: &[u8],
    meta_dir: &Path,
) {
    if layers.boot.is_empty() {
        return;
    }
    let specs = artifact::parse_index(index_bytes, layers)
        .map_err(MountError::from)
        .and_then(|index| boot_specs(&layers.boot, &index.blobs, meta_dir));
    let specs = match specs {
        Ok(specs) => specs,
        Err(e) => return tracing::debug!("boot pages not fetched at mount: {e}"),
    };
    for (spec, desc) in specs.iter().zip(&layers.boot) {
        let Some(frame) = spec.frames().into_iter().next() else {
            continue;
        };
        let path = spec.frame_path(0);
        let wanted = lamina_oci::Digest::parse(&frame.digest).ok();
        let held = fs::read(&path)
            .ok()
            .map(|z| lamina_oci::Digest::of_bytes(&z));
        if wanted.is_none() || held == wanted {
            continue;
        }
        match src.read_blob_range(desc, frame.offset, frame.compressed_size) {
            Ok(Some(z)) if Some(lamina_oci::Digest::of_bytes(&z)) == wanted => {
                if let Err(e) = private::write_atomic_file(&path, &z, false) {
                    tracing::debug!("{}: {e}", path.display());
                }
            }
            Ok(Some(_)) => tracing::warn!(
                "the first boot-pages frame of {} does not match its digest: left to the worker",
                desc.digest
            ),
            Ok(None) => {}
            Err(e) => tracing::debug!("the first boot-pages frame of {}: {e}", desc.digest),
        }
    }
}

/// The boot-pages layers `descs` of an image whose cache files are `blobs`,
/// as the worker takes them; sizes bounded here, before the worker
/// allocates for them.
pub(crate) fn boot_specs(
    descs: &[lamina_oci::Descriptor],
    blobs: &[lamina_format::index::BlobSummary],
    meta_dir: &Path,
) -> Result<Vec<BootPagesSpec>, MountError> {
    Ok(artifact::boot_layers(descs, blobs)?
        .into_iter()
        .zip(descs)
        .map(|(boot, desc)| BootPagesSpec {
            layer_digest: desc.digest.to_string(),
            layer_size: boot.compressed_size,
            digest: boot.digest.to_string(),
            size: boot.size,
            path: meta_dir.join(format!("{}.boot", desc.digest.hex())),
            frames: boot
                .frames
                .iter()
                .map(|f| BootFrameSpec {
                    offset: f.offset,
                    compressed_size: f.compressed_size,
                    size: f.size,
                    digest: f.digest.to_string(),
                })
                .collect(),
            from_image: boot.from_image,
        })
        .collect())
}

/// Readahead would widen every touched page into a window that must be
/// fetched whole: off while recorded boot pages serve a start. Pages known
/// from the image hold only part of a start's reads; the rest misses as
/// without boot pages, where readahead pays (data science 13.7 s against
/// 14.4 s with it off, docs/coldstart-heavy.md).
pub(crate) fn readahead_for_boot(config: &mut DaemonConfig, lazy: &LazyOptions) {
    let recorded = config.boot_pages.iter().any(|b| !b.from_image);
    if recorded && lazy.prefetch != Prefetch::None {
        config.readahead_kb = lazy.readahead_kb.or(Some(0));
    }
}

/// A cache file as a lazy mount hands it to its daemons.
pub(crate) fn blob_spec(digest: &lamina_oci::Digest, prepared: Prepared) -> BlobSpec {
    BlobSpec {
        digest: digest.to_string(),
        cache_path: prepared.cache_path,
        complete: prepared.complete,
        file: prepared.identity.map(CacheFileId::from),
        served_elsewhere: Vec::new(),
    }
}

/// Allocates the blocks of `blobs`' cache files that are still holes
/// (`LazyOptions::reserve_space`), as an overlayfs snapshot takes its space
/// at pull time: the mount is refused here, before any reader, when the
/// cache filesystem has no room for them, and once it is mounted no fill of
/// it needs space another mount's fills could have taken.
pub(crate) fn reserve_cache_files(blob_dir: &Path, blobs: &[BlobSpec]) -> Result<(), MountError> {
    let mut files = Vec::new();
    let mut need = 0u64;
    for blob in blobs {
        let path = &blob.cache_path;
        if files.iter().any(|(_, p)| *p == path) {
            continue;
        }
        // The file this mount was made with, not one put in its place.
        let file = blob.open_checked().map_err(io_err(path))?;
        need += lamina_fetch::store::unallocated(&file).map_err(io_err(path))?;
        files.push((file, path));
    }
    let stat = rustix::fs::statvfs(blob_dir).map_err(|e| io_err(blob_dir)(e.into()))?;
    let free = stat.f_bavail.saturating_mul(stat.f_frsize);
    let no_room = || MountError::NoRoom {
        dir: blob_dir.to_path_buf(),
        need,
        free,
    };
    if need > free {
        return Err(no_room());
    }
    for (file, path) in files {
        match lamina_fetch::store::reserve(&file) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::StorageFull => return Err(no_room()),
            Err(e) => return Err(io_err(path)(e)),
        }
    }
    tracing::info!(
        "reserved {need} bytes of {} for the image's fills",
        blob_dir.display()
    );
    Ok(())
}

/// What every lazy mount knows before its daemons start.
pub(crate) struct LazyPlan<'a> {
    /// The image as named.
    pub image: &'a ImageRef,
    /// Its manifest's digest.
    pub manifest_digest: String,
    /// Where it is mounted (resolved).
    pub mountpoint: PathBuf,
    /// The EROFS metadata file.
    pub metadata_path: PathBuf,
    /// The chunk index, or the tar index's span table.
    pub index_path: PathBuf,
    /// The cache files, in device order.
    pub blobs: Vec<BlobSpec>,
    /// Their dir, their trust domain's (`common::DomainDirs`).
    pub blob_dir: PathBuf,
    /// Whether `index_path` is a span table.
    pub tar_index: bool,
}

/// A fresh run dir for the mount and its daemon config with what every
/// lazy mount shares: no boot pages, layer files or later layers (the
/// caller adds those its image has), readahead off while recording (the
/// trace is then exactly the pages read).
pub(crate) fn daemon_config(
    plan: LazyPlan<'_>,
    opts: &MountOptions,
    lazy: &LazyOptions,
) -> Result<(DaemonConfig, PathBuf), MountError> {
    let run = fresh_run_dir(&opts.cache_dir, &plan.mountpoint)?;
    let recording = lazy.record_trace.is_some();
    let config = DaemonConfig {
        image: plan.image.to_string(),
        manifest_digest: plan.manifest_digest,
        source: source_spec(plan.image, opts, &plan.mountpoint)?,
        mountpoint: plan.mountpoint,
        metadata_path: plan.metadata_path,
        mount_metadata: None,
        index_path: plan.index_path,
        tar_index: plan.tar_index,
        tar_windows: None,
        blob_dir: plan.blob_dir,
        blobs: plan.blobs,
        borrowed: Vec::new(),
        run_dir: run.clone(),
        timeout_secs: lazy.timeout.as_secs().max(1),
        fill_window: lazy.fill_window,
        fill_ahead: lazy.fill_ahead,
        hedge: lazy.hedge,
        // A trace must hold every page the start reads: nothing predicted.
        predict_max: if recording { 0 } else { lazy.predict_max },
        fetch_rests: lazy.fetch_rests,
        metadata_fill: Some(MetadataFill::Whole),
        workers: lazy.workers,
        prefetch: !recording && lazy.prefetch != Prefetch::None,
        prefetch_all: !recording && lazy.prefetch == Prefetch::All,
        boot_chunks: lazy.prefetch != Prefetch::Pages,
        record_trace: lazy.record_trace.clone(),
        privileges: opts.privileges,
        readahead_kb: lazy.readahead_kb.or(recording.then_some(0)),
        boot_pages: Vec::new(),
        adopt: Vec::new(),
        later_layers: Vec::new(),
        xattrs: true,
        cache_reserve: lazy.cache_reserve,
    };
    Ok((config, run))
}

/// The mount's run dir, emptied; refused while a live daemon serves the
/// mountpoint.
fn fresh_run_dir(cache_dir: &Path, mountpoint: &Path) -> Result<PathBuf, MountError> {
    let run = run_dir(cache_dir, mountpoint);
    if let Ok(bytes) = fs::read(run.join("ready")) {
        if let Ok(ready) = serde_json::from_slice::<Ready>(&bytes) {
            if ready.error.is_none() && Path::new(&format!("/proc/{}", ready.pid)).exists() {
                return Err(MountError::Mountpoint(
                    mountpoint.to_path_buf(),
                    format!("already served by lamina (holder pid {})", ready.pid),
                ));
            }
        }
    }
    let _ = fs::remove_dir_all(&run);
    private::private_dir(&run).map_err(io_err(&run))?;
    Ok(run)
}

/// Where the daemons fetch `image`'s blobs from.
pub(crate) fn source_spec(
    image: &ImageRef,
    opts: &MountOptions,
    mountpoint: &Path,
) -> Result<SourceSpec, MountError> {
    Ok(match image {
        ImageRef::Registry(RegistryRef {
            host, repository, ..
        }) => SourceSpec::Registry {
            host: host.clone(),
            repository: repository.clone(),
            insecure_hosts: opts.source.insecure_hosts.clone(),
            tls_hosts: opts.source.tls_hosts.clone(),
            ca_file: opts.source.ca_file.clone(),
            hosts_dir: opts.source.hosts.dir().map(Path::to_path_buf),
            docker_config: opts.source.docker_config.clone(),
        },
        ImageRef::Oci { dir, .. } => SourceSpec::Layout {
            dir: fs::canonicalize(dir).map_err(io_err(dir))?,
        },
        ImageRef::DockerArchive { .. } => {
            return Err(MountError::Mountpoint(
                mountpoint.to_path_buf(),
                "a docker-archive holds no lamina image; convert it first".into(),
            ))
        }
    })
}

/// What a FUSE daemon gets beyond the daemon config.
#[derive(Default)]
pub(crate) struct FuseExtras {
    /// The metadata's frames, when the daemon writes them.
    pub frames: Option<MetadataFrames>,
    /// The lookup table, when cached.
    pub lookup: Option<PathBuf>,
    /// Or the one the worker fetches after the mount.
    pub lookup_later: Option<LookupLater>,
}

/// Saves `config` in `run` and starts the mount's daemons: the holder, or
/// the FUSE daemon with `fuse`. Returns once the mount is usable.
pub(crate) fn start_serving(
    cache_dir: &Path,
    config: &DaemonConfig,
    run: &Path,
    mode: Mode,
    fuse: FuseExtras,
) -> Result<MountInfo, MountError> {
    let config_path = run.join("config.json");
    let lookup_path = fuse.lookup.clone();
    config.save(&config_path).map_err(io_err(&config_path))?;
    let blobs: Vec<PathBuf> = config.blobs.iter().map(|b| b.cache_path.clone()).collect();
    match mode {
        Mode::Kernel => {
            // A holder that mounts a `--share-files` shard mounts the
            // node's own EROFS; its caller checked the image's metadata
            // before splitting it.
            if config.mount_metadata.is_none() {
                crate::layers::check_metadata(&config.metadata_path)?;
            }
            start_daemon(
                "internal-holder",
                &config_path,
                &run.join("holder.log"),
                "holder",
            )?
        }
        Mode::Fuse => {
            let image = crate::fuse::FuseImage {
                metadata: &config.metadata_path,
                frames: fuse.frames,
                lookup: fuse.lookup.as_deref(),
                lookup_later: fuse.lookup_later,
                blobs: &blobs,
                xattrs: config.xattrs,
                privileges: config.privileges,
                blob_files: config.blobs.iter().map(|b| b.file).collect(),
            };
            let worker = Some(config_path.clone());
            crate::fuse::start_fuse_daemon(cache_dir, run, &image, &config.mountpoint, worker)?
        }
    }
    Ok(MountInfo {
        mountpoint: config.mountpoint.clone(),
        manifest_digest: config.manifest_digest.clone(),
        metadata_path: config.metadata_path.clone(),
        blob_paths: blobs,
        index_path: None,
        lookup_path,
        xattrs: config.xattrs,
        fetched_bytes: 0,
    })
}

/// The metadata's frames as a FUSE daemon takes them: the layer's bytes in
/// the run dir `run` (the daemon removes them once every frame is
/// written), only its first frame's when the others are listed, to be
/// fetched from `source` with a deadline of `timeout_secs` each.
fn frames_for_daemon(
    layer: MetadataLayer,
    run: &Path,
    desc: &lamina_oci::Descriptor,
    (source, timeout_secs): (SourceSpec, u64),
) -> Result<MetadataFrames, MountError> {
    let compressed_path = run.join("metadata.zst");
    let digest = format!("sha256:{}", hex::encode(content_digest(desc, "metadata")?));
    let (compressed, frames, remote) = match layer {
        MetadataLayer::Whole(layer) => {
            let frames = layer
                .frames
                .iter()
                .map(|f| FrameSpan {
                    start: f.start,
                    len: f.len,
                    offset: f.offset,
                    size: f.size,
                })
                .collect();
            (layer.compressed, frames, None)
        }
        MetadataLayer::Listed { first, frames } => {
            let mut offset = 0;
            let spans = frames
                .iter()
                .map(|f| {
                    offset += f.size;
                    FrameSpan {
                        start: f.offset,
                        len: f.compressed_size,
                        offset: offset - f.size,
                        size: f.size,
                    }
                })
                .collect();
            let remote = RemoteFrames {
                source,
                layer: desc.digest.to_string(),
                digests: frames.iter().map(|f| f.digest.to_string()).collect(),
                local: 1,
                timeout_secs,
            };
            (first, spans, Some(remote))
        }
    };
    private::write_atomic(&compressed_path, &compressed, false)
        .map_err(io_err(&compressed_path))?;
    Ok(MetadataFrames {
        compressed_path,
        frames,
        digest,
        remote,
    })
}

/// What became of a lazy mount's daemon after its unmount.
#[derive(Debug, Default)]
pub struct Unmounted {
    /// The worker's last status, as JSON text.
    pub last_status: Option<String>,
    /// The holder still serves: the filesystem outlives the mountpoint
    /// (another mount of it, an overlay on it, or a lazy unmount by someone
    /// else while files are open). It exits once the last reader is gone.
    pub still_serving: Option<u32>,
}

/// The status a lazy mount's worker last wrote (JSON text), if any.
pub fn last_status(cache_dir: &Path, mountpoint: &Path) -> Option<String> {
    fs::read_to_string(run_dir(cache_dir, mountpoint).join("status.json")).ok()
}

/// After an unmount: waits for the mount's holder to notice and exit, then
/// removes its run directory. A holder that still serves (the filesystem
/// lives on elsewhere) keeps its run directory.
pub fn finish_unmount(cache_dir: &Path, mountpoint: &Path) -> Unmounted {
    let run = run_dir(cache_dir, mountpoint);
    // A `--share-files` view: its shard stays while other views stack it.
    let shard_kept = crate::shared::finish_view(cache_dir, &run);
    let Some(ready) = fs::read(run.join("ready"))
        .ok()
        .and_then(|b| serde_json::from_slice::<Ready>(&b).ok())
    else {
        let _ = fs::remove_dir_all(&run); // an eager mount's record
        return Unmounted::default();
    };
    // Read before the holder leaves: it removes the run dir on its way out.
    let last_status = fs::read_to_string(run.join("status.json")).ok();
    if shard_kept {
        // Its holder serves the shard for the views that still stack it,
        // and leaves with the shard's superblock.
        return Unmounted {
            last_status,
            still_serving: Some(ready.pid),
        };
    }
    let proc = PathBuf::from(format!("/proc/{}", ready.pid));
    let started = Instant::now();
    let mut alive = proc.exists();
    // The holder stops its worker first, which may take up to ten seconds
    // to save its fill records (lamina-daemon's relay).
    while alive && started.elapsed() < Duration::from_secs(15) {
        // A zombie (our own child) still has /proc; check its state.
        if fs::read_to_string(proc.join("stat")).is_ok_and(|s| s.contains(") Z ")) {
            alive = false;
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
        alive = proc.exists();
    }
    if alive {
        return Unmounted {
            last_status,
            still_serving: Some(ready.pid),
        };
    }
    let _ = fs::remove_dir_all(&run);
    Unmounted {
        last_status,
        still_serving: None,
    }
}
