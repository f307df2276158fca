//! `lamina snapshotter`: a containerd proxy snapshotter. Ordinary images get
//! overlayfs snapshots that containerd unpacks as usual; lamina images are
//! recognised from the labels containerd passes with each layer and mounted
//! lazily, so containerd downloads none of their data. docs/containerd.md
//! tells how to plug it in.

pub mod cri;
pub mod filter;
pub mod metrics;
pub mod proto;
pub mod pull_secrets;
mod service;
pub mod snapshots;
pub mod state;
pub mod tenants;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context};
use lamina_image::artifact::{bound_index, LaminaLayers};
use lamina_mount::{LazyOptions, Mode, MountError, MountOptions, Privileges};
use lamina_oci::{open_source, ImageRef, ImageSource, RegistryRef, SourceImage, SourceOptions};

pub use snapshots::{Images, LayerRole, Snapshotter};

/// What `lamina snapshotter` is given.
#[derive(Debug, Clone)]
pub struct Options {
    /// Root directory: state, snapshots and the shared cache.
    pub root: PathBuf,
    /// The unix socket containerd connects to.
    pub address: PathBuf,
    /// How registries are reached.
    pub source: SourceOptions,
    /// How lamina images are served.
    pub lazy: LazyOptions,
    /// Kernel or FUSE mounts; `None`: decided at start from the host, as
    /// `lamina mount --mode auto` does.
    pub mode: Option<Mode>,
    /// Lamina images mounted with `--share-files` (the kernel path).
    pub share_files: bool,
    /// Where Prometheus metrics are served, if anywhere.
    pub metrics_address: Option<metrics::MetricsAddress>,
    /// The shared cache's size limit in bytes: collected in the background
    /// (`None`: never collected).
    pub cache_max_size: Option<u64>,
    /// Which tar indexes plain images may be served through; an image
    /// whose index is refused goes to overlayfs (said in the log, counted).
    pub index_trust: lamina_mount::IndexTrust,
    /// containerd's socket, when the snapshotter's own socket also serves
    /// the CRI image service in front of it (the kubelet's
    /// `--image-service-endpoint`), taking pods' pull secrets for their
    /// images' mounts (`cri.rs`).
    pub cri_keychain: Option<PathBuf>,
    /// Tenants' cache dirs, by image prefix (`tenants.rs`).
    pub tenant_caches: Vec<tenants::TenantCache>,
}

/// The real lamina side: manifests from registries, lazy mounts (kernel or
/// FUSE) sharing one cache.
#[derive(Debug)]
pub struct RegistryImages {
    lazy: LazyOptions,
    mode: Mode,
    /// Image references resolved, shared with the service, which asks
    /// registries through it without the snapshotter's lock.
    resolver: Arc<Resolver>,
    /// Mounts being made in the background, by mount point.
    pending: HashMap<PathBuf, Arc<Pending>>,
}

/// What the snapshotter knows of image references: resolved from their
/// registries, never under the snapshotter's lock (`service.rs` resolves a
/// Prepare's image through it before taking the lock).
#[derive(Debug)]
pub struct Resolver {
    source: SourceOptions,
    /// Pods' pull secrets, with the CRI keychain on.
    secrets: Option<Arc<pull_secrets::PullSecrets>>,
    caches: tenants::CacheDirs,
    index_trust: lamina_mount::IndexTrust,
    /// Mounts share files by content (`--share-files`).
    share_files: bool,
    /// Images resolved, by kind (metrics).
    kinds: metrics::ImageKinds,
    /// Per image reference: the digest to mount and the layer digests, or
    /// `None` for an image served by overlayfs.
    known: Mutex<HashMap<String, Known>>,
    /// One resolution per reference at a time: the layers of one pull all
    /// wait for the first one's answer instead of asking again.
    inflight: Mutex<HashMap<String, Arc<Mutex<()>>>>,
    /// The lamina image resolved last, by the digest it is mounted by: its
    /// top layer's mount comes a few calls later and needs no second
    /// manifest fetch.
    resolved: Mutex<Option<(String, Box<dyn ImageSource>)>>,
}

/// A reference's digest to mount and its layers, `None` for overlayfs.
type Known = Option<(String, Vec<String>)>;

/// A background mount's outcome, once it is there.
#[derive(Debug, Default)]
pub struct Pending {
    done: Mutex<Option<Result<(), String>>>,
    cond: std::sync::Condvar,
}

impl Pending {
    fn finish(&self, outcome: Result<(), String>) {
        *lock(&self.done) = Some(outcome);
        self.cond.notify_all();
    }

    /// Waits for the outcome (leaves it for [`take`](Self::take)).
    fn wait(&self) {
        let mut done = lock(&self.done);
        while done.is_none() {
            done = self.cond.wait(done).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Waits for the outcome and takes it.
    fn take(&self) -> Result<(), String> {
        self.wait();
        lock(&self.done).take().unwrap_or(Ok(()))
    }
}

impl RegistryImages {
    /// Lamina images mounted in `mode` with `cache_dir` as their cache,
    /// plain images through the tar indexes `index_trust` accepts; each
    /// image resolved is counted in `kinds`.
    pub fn new(
        (source, index_trust): (SourceOptions, lamina_mount::IndexTrust),
        cache_dir: PathBuf,
        (lazy, mode): (LazyOptions, Mode),
        kinds: metrics::ImageKinds,
    ) -> Self {
        let resolver = Resolver {
            source,
            secrets: None,
            caches: tenants::CacheDirs::new(cache_dir, Vec::new()),
            index_trust,
            share_files: false,
            kinds,
            known: Mutex::new(HashMap::new()),
            inflight: Mutex::new(HashMap::new()),
            resolved: Mutex::new(None),
        };
        RegistryImages {
            lazy,
            mode,
            resolver: Arc::new(resolver),
            pending: HashMap::new(),
        }
    }

    /// Lamina images mount with `--share-files`.
    pub fn with_share_files(self, share_files: bool) -> Self {
        let resolver = Resolver {
            share_files,
            ..Arc::into_inner(self.resolver).expect("not shared before serving")
        };
        RegistryImages {
            resolver: Arc::new(resolver),
            ..self
        }
    }

    /// Images under a tenant's prefix mount with the tenant's cache dir.
    pub fn with_tenants(self, caches: tenants::CacheDirs) -> Self {
        let resolver = Resolver {
            caches,
            ..Arc::into_inner(self.resolver).expect("not shared before serving")
        };
        RegistryImages {
            resolver: Arc::new(resolver),
            ..self
        }
    }

    /// Mounts of images a pod pulled with a secret fetch with that secret
    /// alone.
    pub fn with_secrets(self, secrets: Arc<pull_secrets::PullSecrets>) -> Self {
        let resolver = Resolver {
            secrets: Some(secrets),
            ..Arc::into_inner(self.resolver).expect("not shared before serving")
        };
        RegistryImages {
            resolver: Arc::new(resolver),
            ..self
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Resolver {
    /// How `img` (named `reference`) is served: `None` for a plain image,
    /// which containerd pulls into overlayfs snapshots (said in the log and
    /// counted, never silently).
    fn kind_of(
        &self,
        reference: &str,
        image: &ImageRef,
        img: &SourceImage,
    ) -> Option<&'static str> {
        let why = match LaminaLayers::from_manifest(&img.manifest) {
            Ok(_) => return Some("lamina"),
            Err(e) => e.to_string(),
        };
        match lamina_mount::find_tar_index(image, img, &self.mount_options(reference)) {
            Ok(Some((index, _))) => {
                tracing::info!("{reference}: served lazily through its tar index {index}");
                Some("tar_index")
            }
            Ok(None) => {
                tracing::info!(
                    "{reference}: {why}, and it has no tar index: containerd pulls it into \
                     overlayfs snapshots"
                );
                None
            }
            Err(e @ MountError::UntrustedIndex(_)) => {
                tracing::warn!(
                    "{reference}: {why}; {e}: containerd pulls it into overlayfs snapshots"
                );
                self.kinds.count("index_refused");
                None
            }
            Err(e) => {
                tracing::warn!(
                    "{reference}: {why}; its tar index is unusable ({e}): containerd pulls it \
                     into overlayfs snapshots"
                );
                None
            }
        }
    }

    fn resolve(&self, reference: &str) -> Result<Known, String> {
        let rr = RegistryRef::parse(reference).map_err(|e| e.to_string())?;
        let image = ImageRef::Registry(rr);
        let source = open_source(&image, &self.source_for(reference)).map_err(|e| e.to_string())?;
        let img = source.image();
        let kind = self.kind_of(reference, &image, img);
        self.kinds.count(kind.unwrap_or("plain"));
        if kind.is_none() {
            return Ok(None);
        }
        let layers = img
            .manifest
            .layers
            .iter()
            .map(|l| l.digest.to_string())
            .collect();
        // An index bound into the image index is found again (without the
        // node's trust in a tag) by mounting that image index's digest.
        let digest = match (kind, &img.index_digest) {
            (Some("tar_index"), Some(index))
                if bound_index(&img.index_entries, &img.manifest_digest).is_some() =>
            {
                index.to_string()
            }
            _ => img.manifest_digest.to_string(),
        };
        if let Some(secrets) = &self.secrets {
            // The top layer is mounted by digest: it fetches as the pull did.
            let pinned = pinned_name(reference, &digest);
            secrets
                .alias(reference, &pinned)
                .map_err(|e| format!("{pinned}: keeping its pull secret: {e}"))?;
        }
        *lock(&self.resolved) = Some((digest.clone(), source));
        Ok(Some((digest, layers)))
    }

    /// The opened source of `image` (`HOST/REPO@DIGEST`) if it was the
    /// image resolved last.
    fn take_resolved(&self, image: &str) -> Option<Box<dyn ImageSource>> {
        let digest = image.rsplit_once('@')?.1;
        let mut resolved = lock(&self.resolved);
        match resolved.take() {
            Some((d, source)) if d == digest => Some(source),
            other => {
                *resolved = other;
                None
            }
        }
    }

    /// How `reference` is fetched: with the secret its pod brought, and
    /// then that alone, or with the node's credentials.
    fn source_for(&self, reference: &str) -> SourceOptions {
        let secret = self.secrets.as_ref().and_then(|s| s.config_for(reference));
        SourceOptions {
            docker_config: secret.or_else(|| self.source.docker_config.clone()),
            ..self.source.clone()
        }
    }

    /// The cache dir of `reference`'s mounts: its tenant's, chosen by the
    /// pull secret its pod brought or by its name.
    fn cache_dir_for(&self, reference: &str) -> &Path {
        let user = self.secrets.as_ref().and_then(|s| s.user_for(reference));
        self.caches.for_image(reference, user.as_deref())
    }

    fn mount_options(&self, reference: &str) -> MountOptions {
        MountOptions {
            cache_dir: self.cache_dir_for(reference).to_path_buf(),
            source: self.source_for(reference),
            // Snapshots are mounted in the snapshotter's private (0700)
            // root for runc, like containerd's overlayfs snapshots.
            privileges: Privileges {
                suid: true,
                dev: true,
            },
            index: None,
            index_trust: self.index_trust.clone(),
            share_files: self.share_files,
        }
    }

    /// `layer`'s role in the lamina image (or image with a tar index)
    /// `reference` was last resolved to, if it is one of its layers. A
    /// plain image is asked about again: its tag may have moved to an
    /// image with an index since.
    fn known_role(&self, reference: &str, layer: &str) -> Option<LayerRole> {
        role_in(reference, lock(&self.known).get(reference)?, layer)
    }
}

/// `layer`'s role in the image `known` describes, named `reference`.
fn role_in(reference: &str, known: &Known, layer: &str) -> Option<LayerRole> {
    let (digest, layers) = known.as_ref()?;
    let pos = layers.iter().position(|l| l == layer)?;
    Some(if pos + 1 == layers.len() {
        LayerRole::Top {
            image: pinned_name(reference, digest),
        }
    } else {
        LayerRole::Lower
    })
}

/// `reference`'s HOST/REPO without the tag, pinned to `digest`: what its
/// top layer is mounted by.
fn pinned_name(reference: &str, digest: &str) -> String {
    let name = reference.split_once('@').map_or(reference, |(n, _)| n);
    let repo = match name.rsplit_once(':') {
        Some((repo, tag)) if !tag.contains('/') => repo,
        _ => name,
    };
    format!("{repo}@{digest}")
}

impl snapshots::Resolve for Resolver {
    fn lookup(&self, reference: &str, layer: &str) -> Result<Option<LayerRole>, String> {
        if let Some(role) = self.known_role(reference, layer) {
            return Ok(Some(role));
        }
        // One resolution per reference: the others wait for its answer.
        let gate = lock(&self.inflight)
            .entry(reference.to_string())
            .or_default()
            .clone();
        let answer = {
            let _one = lock(&gate);
            match self.known_role(reference, layer) {
                Some(role) => Ok(Some(role)),
                None => self.resolve_role(reference, layer),
            }
        };
        // The gate goes once nobody holds or waits on it (clones are made
        // under the map's lock, held here): the map does not grow with
        // every reference ever pulled.
        let mut inflight = lock(&self.inflight);
        if Arc::strong_count(&gate) == 2 {
            inflight.remove(reference);
        }
        answer
    }
}

impl Resolver {
    /// Asks the registry (the reference was not seen, or its tag may have
    /// moved) and remembers the answer.
    fn resolve_role(&self, reference: &str, layer: &str) -> Result<Option<LayerRole>, String> {
        let known = self.resolve(reference)?;
        let role = role_in(reference, &known, layer);
        lock(&self.known).insert(reference.to_string(), known);
        Ok(role)
    }
}

/// Mounts `image` (`HOST/REPO@DIGEST`) lazily at `mountpoint`, through
/// `source` when it is already open.
fn mount_image(
    opts: &MountOptions,
    (lazy, mode): (&LazyOptions, Mode),
    image: &str,
    source: Option<Box<dyn ImageSource>>,
    mountpoint: &Path,
) -> Result<(), String> {
    let image_ref = ImageRef::Registry(RegistryRef::parse(image).map_err(|e| e.to_string())?);
    let started = std::time::Instant::now();
    match source {
        Some(source) => {
            lamina_mount::mount_lazy_from(source, &image_ref, mountpoint, opts, lazy, mode)
        }
        None => lamina_mount::mount(&image_ref, mountpoint, opts, Some(lazy), mode),
    }
    .map_err(|e| e.to_string())?;
    tracing::debug!(image, us = started.elapsed().as_micros() as u64, "mounted");
    Ok(())
}

impl RegistryImages {
    /// Whether a live daemon serves `mountpoint`, from whichever cache dir
    /// its run dir is in.
    fn is_served(&self, mountpoint: &Path) -> bool {
        let caches = &self.resolver.caches;
        caches
            .serving(mountpoint)
            .is_some_and(|c| lamina_mount::is_served(&c, mountpoint))
    }
}

impl Images for RegistryImages {
    fn lookup(&mut self, reference: &str, layer: &str) -> Result<Option<LayerRole>, String> {
        snapshots::Resolve::lookup(self.resolver.as_ref(), reference, layer)
    }

    fn mount(&mut self, image: &str, mountpoint: &Path) -> Result<(), String> {
        let source = self.resolver.take_resolved(image);
        let how = (&self.lazy, self.mode);
        mount_image(
            &self.resolver.mount_options(image),
            how,
            image,
            source,
            mountpoint,
        )
    }

    fn start_mount(&mut self, image: &str, mountpoint: &Path) {
        let opts = self.resolver.mount_options(image);
        let (lazy, mode) = (self.lazy.clone(), self.mode);
        let source = self.resolver.take_resolved(image);
        let (image, mnt) = (image.to_string(), mountpoint.to_path_buf());
        let pending = Arc::new(Pending::default());
        let done = pending.clone();
        let started = std::thread::Builder::new()
            .name("lazy-mount".into())
            .spawn(move || {
                // A panic still finishes the wait: callers would block for ever.
                let mounted = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    mount_image(&opts, (&lazy, mode), &image, source, &mnt)
                }));
                done.finish(mounted.unwrap_or_else(|_| Err("the mounting thread panicked".into())));
            });
        match started {
            Ok(_) => {
                self.pending.insert(mountpoint.to_path_buf(), pending);
            }
            // Nothing pending: the first use mounts it (`ensure_mounted`).
            Err(e) => tracing::warn!("no thread for a background mount: {e}"),
        }
    }

    fn wait_mount(&mut self, mountpoint: &Path) -> Option<Result<(), String>> {
        Some(self.pending.remove(mountpoint)?.take())
    }

    fn resolver(&self) -> Option<Arc<dyn snapshots::Resolve>> {
        Some(self.resolver.clone())
    }

    fn pending_wait(&self, mountpoint: &Path) -> Option<snapshots::MountWait> {
        let pending = self.pending.get(mountpoint)?.clone();
        Some(Box::new(move || pending.wait()))
    }

    fn unmount(&mut self, mountpoint: &Path) -> Result<(), String> {
        lamina_mount::unmount(mountpoint).map_err(|e| e.to_string())?;
        if let Some(cache) = self.resolver.caches.serving(mountpoint) {
            lamina_mount::finish_unmount(&cache, mountpoint);
        }
        Ok(())
    }

    fn is_mounted(&self, mountpoint: &Path) -> bool {
        is_mountpoint(mountpoint) && self.is_served(mountpoint)
    }

    fn is_pending(&self, mountpoint: &Path) -> bool {
        self.pending.contains_key(mountpoint)
    }

    fn detach_dead(&mut self, mountpoint: &Path) -> bool {
        if !is_mountpoint(mountpoint) || self.is_served(mountpoint) {
            return false;
        }
        let detach = rustix::mount::UnmountFlags::DETACH;
        if let Err(e) = rustix::mount::unmount(mountpoint, detach) {
            tracing::warn!("detaching the dead mount {}: {e}", mountpoint.display());
            return false;
        }
        if let Some(cache) = self.resolver.caches.serving(mountpoint) {
            lamina_mount::finish_unmount(&cache, mountpoint);
        }
        true
    }
}

/// Whether `path` is a mount point (in this process's mount namespace),
/// also through a symlink (else a restart would mount an image again on
/// top of its live mount).
fn is_mountpoint(path: &Path) -> bool {
    lamina_sys::mountinfo::is_mount_point(path)
}

/// Runs the snapshotter until SIGTERM or SIGINT. Lamina mounts and their
/// daemons outlive it: a restart finds them in its state and serves on.
pub fn serve(opts: Options) -> anyhow::Result<()> {
    // Before containerd's first pull, not during it.
    lamina_oci::load_trust_store();
    let cache = opts.root.join("cache");
    lamina_fetch::private::private_dir(&cache)
        .with_context(|| format!("cache dir {}", cache.display()))?;
    let (mode, why) = match opts.mode {
        Some(mode) => (mode, "as configured".to_string()),
        None => lamina_mount::choose_mode(&lamina_mount::host_facts(&cache), true),
    };
    tracing::info!("lamina images mount with the {mode} path: {why}");
    tenants::check(&opts.tenant_caches, opts.cri_keychain.is_some()).map_err(anyhow::Error::msg)?;
    let caches = tenants::CacheDirs::new(cache.clone(), opts.tenant_caches.clone());
    for dir in caches.all() {
        lamina_fetch::private::private_dir(&dir)
            .with_context(|| format!("tenant cache dir {}", dir.display()))?;
    }
    let metrics = Arc::new(metrics::Metrics::of_dirs(caches.all()));
    let how = (opts.lazy.clone(), mode);
    let mut images = RegistryImages::new(
        (opts.source.clone(), opts.index_trust.clone()),
        cache.clone(),
        how,
        metrics.image_kinds(),
    )
    .with_tenants(caches.clone())
    .with_share_files(opts.share_files);
    let keychain = match &opts.cri_keychain {
        Some(containerd) => {
            let secrets = Arc::new(open_secrets(&opts.address)?);
            images = images.with_secrets(secrets.clone());
            Some((containerd.clone(), secrets))
        }
        None => None,
    };
    let sn = Snapshotter::open(&opts.root, images).map_err(|e| anyhow::anyhow!("{e}"))?;
    metrics.set_snapshots(sn.census());
    let inner = Arc::new(Mutex::new(sn));
    spawn_reaper();
    // Mounts are checked (and mounted again) in the background, from the
    // start: the socket listens at once, and only a call that needs a
    // lamina image waits for its mount.
    spawn_reconciler(inner.clone(), metrics.clone());
    if let Some(max) = opts.cache_max_size {
        // Each tenant's dir is collected to the same size, its own.
        spawn_gc(caches.all(), max, metrics.clone());
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the runtime")?;
    runtime.block_on(async {
        if let Some(address) = &opts.metrics_address {
            let (listener, bound) = metrics::bind(address).await?;
            tracing::info!(address = %bound, "metrics serving at /metrics");
            tokio::spawn(metrics::serve(listener, metrics.clone()));
        }
        let cri = match keychain {
            Some((containerd, secrets)) => {
                tracing::info!(
                    "serving the CRI image service in front of {}: pods' pull secrets reach \
                     their images' mounts",
                    containerd.display()
                );
                Some(cri::ImageProxy::new(&containerd, secrets)?)
            }
            None => None,
        };
        listen(opts.address, service::Service::new(inner, metrics), cri).await
    })
}

/// Pods' pull secrets live beside the socket (on /run by default: never
/// past a reboot, which ends the mounts that use them).
fn open_secrets(address: &Path) -> anyhow::Result<pull_secrets::PullSecrets> {
    let dir = address
        .parent()
        .unwrap_or(Path::new("/"))
        .join("credentials");
    pull_secrets::PullSecrets::open(&dir)
        .with_context(|| format!("the pull secrets' dir {}", dir.display()))
}

async fn listen<I: Images + 'static>(
    address: PathBuf,
    svc: service::Service<I>,
    cri: Option<cri::ImageProxy>,
) -> anyhow::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    if std::os::unix::net::UnixStream::connect(&address).is_ok() {
        bail!(
            "{} is in use: is another snapshotter running?",
            address.display()
        );
    }
    let listener = bind_private(&address)?;
    tracing::info!(address = %address.display(), "lamina snapshotter serving");
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let stop = async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        tracing::info!("stopping; lamina mounts stay served");
    };
    tonic::transport::Server::builder()
        .add_service(proto::snapshots_server::SnapshotsServer::new(svc))
        .add_optional_service(cri.map(proto::image_service_server::ImageServiceServer::new))
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::UnixListenerStream::new(listener),
            stop,
        )
        .await
        .context("serving gRPC")?;
    let _ = std::fs::remove_file(&address);
    Ok(())
}

/// How often the mounts are checked, and the cache collected.
const RECONCILE_EVERY: Duration = Duration::from_secs(5);
const GC_EVERY: Duration = Duration::from_secs(60);

/// Listens on the unix socket `address`, which is never reachable by
/// anyone but root, not even for a moment: its dir is made 0700 if it is
/// new, and the socket is bound in a private (0700) dir beside it, made
/// 0600, and only then renamed into place.
fn bind_private(address: &Path) -> anyhow::Result<tokio::net::UnixListener> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    let dir = address.parent().unwrap_or(Path::new("/"));
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .with_context(|| format!("creating {}", dir.display()))?;
    let staging = tempfile::Builder::new()
        .prefix(".lamina-socket-")
        .tempdir_in(dir)
        .with_context(|| format!("a private dir in {}", dir.display()))?;
    let staged = staging.path().join("s");
    let listener = std::os::unix::net::UnixListener::bind(&staged)
        .with_context(|| format!("listening on {}", staged.display()))?;
    std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(0o600))?;
    let _ = std::fs::remove_file(address); // a stale socket
    std::fs::rename(&staged, address)
        .with_context(|| format!("placing the socket at {}", address.display()))?;
    listener.set_nonblocking(true)?;
    tokio::net::UnixListener::from_std(listener).context("the socket")
}

/// Mount daemons are this process's children until they exit: reap those,
/// and only those (`lamina_mount::reap_daemons`), so that no other wait
/// (a mount in progress waiting for its daemon) loses its child's status.
fn spawn_reaper() {
    std::thread::spawn(|| loop {
        std::thread::sleep(Duration::from_secs(2));
        reap_once();
    });
}

fn reap_once() {
    lamina_mount::reap_daemons();
}

/// Mounts every lamina image whose mount is gone or dead again, at start
/// and then every [`RECONCILE_EVERY`], in the background (see
/// [`Snapshotter::reconcile`]); each one is logged and counted.
fn spawn_reconciler<I: Images + 'static>(
    inner: Arc<Mutex<Snapshotter<I>>>,
    metrics: Arc<metrics::Metrics>,
) {
    std::thread::spawn(move || loop {
        let lines = inner.lock().unwrap_or_else(|p| p.into_inner()).reconcile();
        for line in lines {
            tracing::warn!("{line}");
            metrics.count_remount();
        }
        std::thread::sleep(RECONCILE_EVERY);
    });
}

/// Keeps each cache dir at most `max` bytes: `lamina gc` every [`GC_EVERY`]
/// (it never evicts what a live or starting mount uses).
fn spawn_gc(caches: Vec<PathBuf>, max: u64, metrics: Arc<metrics::Metrics>) {
    std::thread::spawn(move || loop {
        if let Some((freed, kept)) = collect_all(&caches, max) {
            metrics.record_gc(freed, kept);
        }
        std::thread::sleep(GC_EVERY);
    });
}

/// Collects each cache dir to `max` bytes: the bytes freed and kept in
/// all of them, one record for the cache with every tenant's dir (each
/// dir's run used to set the gauge to its own bytes); `None` when a dir
/// could not be collected, which leaves the gauge as it was rather than
/// undercounted.
fn collect_all(caches: &[PathBuf], max: u64) -> Option<(u64, u64)> {
    let (mut freed, mut kept, mut all) = (0, 0, true);
    for cache in caches {
        match lamina_mount::gc(cache, max) {
            Ok(report) => {
                if !report.evicted.is_empty() {
                    tracing::info!(
                        cache = %cache.display(),
                        evicted = report.evicted.len(),
                        freed_bytes = report.freed_bytes,
                        kept_bytes = report.kept_bytes,
                        "cache collected"
                    );
                }
                freed += report.freed_bytes;
                kept += report.kept_bytes;
            }
            Err(e) => {
                tracing::warn!("cache gc of {}: {e}", cache.display());
                all = false;
            }
        }
    }
    all.then_some((freed, kept))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_cache_dir_is_collected_into_one_record() {
        let t = tempfile::tempdir().unwrap();
        let dirs: Vec<PathBuf> = ["shared", "tenant"].map(|d| t.path().join(d)).into();
        for (i, dir) in dirs.iter().enumerate() {
            let blobs = dir.join("blobs").join("0011223344556677");
            std::fs::create_dir_all(&blobs).unwrap();
            std::fs::write(blobs.join("f"), vec![1u8; 8192 * (i + 1)]).unwrap();
        }
        let (freed, kept) = collect_all(&dirs, u64::MAX).expect("both collected");
        let alone = |d: &PathBuf| collect_all(std::slice::from_ref(d), u64::MAX).unwrap().1;
        assert_eq!((freed, kept), (0, alone(&dirs[0]) + alone(&dirs[1])));
        assert!(alone(&dirs[1]) > alone(&dirs[0]) && alone(&dirs[0]) > 0);
        // A dir that cannot be collected: no record.
        std::fs::write(t.path().join("file"), b"").unwrap();
        let with_bad = [dirs[0].clone(), t.path().join("file")];
        assert_eq!(collect_all(&with_bad, u64::MAX), None);
    }

    #[test]
    fn a_resolution_leaves_no_gate_behind() {
        let cache = tempfile::tempdir().unwrap();
        let metrics = metrics::Metrics::new(cache.path().to_path_buf());
        let images = RegistryImages::new(
            (
                SourceOptions::default(),
                lamina_mount::IndexTrust::default(),
            ),
            cache.path().to_path_buf(),
            (LazyOptions::default(), Mode::Kernel),
            metrics.image_kinds(),
        );
        let resolver = images.resolver.clone();
        for reference in ["not a reference!", "also bad!"] {
            let answer = snapshots::Resolve::lookup(resolver.as_ref(), reference, "sha256:00");
            assert!(answer.is_err());
        }
        assert!(lock(&resolver.inflight).is_empty());
    }

    /// Point 7 of the many-tenants issue: the reaper never takes the exit
    /// status of a child it did not start (a mount in progress waits for
    /// its daemon's).
    #[test]
    fn the_reaper_reaps_only_the_daemons_it_started() {
        let mut child = std::process::Command::new("sh")
            .args(["-c", "exit 7"])
            .spawn()
            .unwrap();
        let stat = format!("/proc/{}/stat", child.id());
        let started = std::time::Instant::now();
        // Until it is a zombie: exited, its status waiting to be taken.
        while !std::fs::read_to_string(&stat).is_ok_and(|s| s.contains(") Z ")) {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "the child never exited"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        reap_once();
        assert_eq!(child.wait().unwrap().code(), Some(7));
    }

    /// Point 7: the socket is 0600 in a dir lamina made 0700, and no
    /// staging dir is left.
    #[tokio::test]
    async fn the_socket_is_private() {
        use std::os::unix::fs::{FileTypeExt, PermissionsExt};
        let root = tempfile::tempdir().unwrap();
        let address = root.path().join("run/lamina/snapshotter.sock");
        let _listener = bind_private(&address).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert!(std::fs::metadata(&address).unwrap().file_type().is_socket());
        assert_eq!(mode(&address), 0o600);
        assert_eq!(mode(address.parent().unwrap()), 0o700);
        let left = std::fs::read_dir(address.parent().unwrap())
            .unwrap()
            .count();
        assert_eq!(left, 1, "only the socket is left");
        std::os::unix::net::UnixStream::connect(&address).unwrap();
    }

    #[test]
    fn mount_points_are_found_through_symlinks() {
        assert!(is_mountpoint(Path::new("/proc")));
        let dir = tempfile::tempdir().unwrap();
        let link = dir.path().join("proc-link");
        std::os::unix::fs::symlink("/proc", &link).unwrap();
        assert!(is_mountpoint(&link), "a symlink to /proc is a mount point");
        assert!(!is_mountpoint(dir.path()));
    }
}
