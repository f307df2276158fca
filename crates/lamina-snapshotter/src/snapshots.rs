//! Snapshot operations with containerd's semantics, independent of gRPC:
//! ordinary snapshots are overlayfs layers (a bind mount for a layer
//! without parents), lamina images are mounted lazily as one layer.
//!
//! How a lamina image gets in: containerd prepares each layer with the
//! labels of a remote snapshot (the target chain id and the image and
//! layer of `containerd.io/snapshot/cri.*`, or stargz's). When the layer
//! belongs to a lamina image, the snapshot is created here, committed
//! under the target name, and `AlreadyExists` tells containerd not to
//! download or unpack the layer. Layers below the image's top are empty
//! placeholders; the top one mounts the whole image.

use std::collections::{BTreeMap, HashSet};
use std::fs;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use crate::filter::{matches_any, Fields, Filter};
use crate::proto::Mount;
use crate::state::{snapshot_dir, Backing, Kind, Snapshot, State};

/// containerd's label naming the snapshot a layer's Prepare should commit.
pub const LABEL_TARGET: &str = "containerd.io/snapshot.ref";
/// The image reference, as containerd's CRI and transfer service pass it.
pub const LABEL_CRI_IMAGE: &str = "containerd.io/snapshot/cri.image-ref";
/// The layer digest, as containerd's CRI and transfer service pass it.
pub const LABEL_CRI_LAYER: &str = "containerd.io/snapshot/cri.layer-digest";
/// The image reference, as `ctr-remote image rpull` passes it.
pub const LABEL_STARGZ_IMAGE: &str = "containerd.io/snapshot/remote/stargz.reference";
/// The layer digest, as `ctr-remote image rpull` passes it.
pub const LABEL_STARGZ_LAYER: &str = "containerd.io/snapshot/remote/stargz.digest";

/// Why an operation failed; each maps to a gRPC code containerd knows.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No such snapshot.
    #[error("snapshot {0}: not found")]
    NotFound(String),
    /// The name is taken.
    #[error("snapshot {0}: already exists")]
    AlreadyExists(String),
    /// The snapshot is in the wrong state for the operation.
    #[error("{0}")]
    FailedPrecondition(String),
    /// A bad request.
    #[error("{0}")]
    InvalidArgument(String),
    /// Local I/O or a mount failed.
    #[error("{0}")]
    Internal(String),
}

type Result<T> = std::result::Result<T, Error>;

fn internal(what: impl std::fmt::Display) -> impl FnOnce(std::io::Error) -> Error {
    move |e| Error::Internal(format!("{what}: {e}"))
}

/// Where a layer sits in a lamina image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LayerRole {
    /// Below the top: the top snapshot will carry it.
    Lower,
    /// The top layer: mount `image` (pinned `HOST/REPO@DIGEST`).
    Top {
        /// What to mount.
        image: String,
    },
}

/// The lamina side: recognising lamina layers and mounting images. The
/// real one talks to registries and the kernel; tests use a fake.
pub trait Images: Send {
    /// `Some` when `layer` is a layer of the lamina image `reference`.
    fn lookup(
        &mut self,
        reference: &str,
        layer: &str,
    ) -> std::result::Result<Option<LayerRole>, String>;
    /// Mounts `image` lazily at `mountpoint`.
    fn mount(&mut self, image: &str, mountpoint: &Path) -> std::result::Result<(), String>;
    /// Starts mounting `image` at `mountpoint` in the background, so that
    /// containerd goes on with the pull (and the container's creation)
    /// meanwhile; `wait_mount` gives the outcome.
    fn start_mount(&mut self, image: &str, mountpoint: &Path);
    /// Waits for the mount `start_mount` began at `mountpoint`: `None`
    /// when none is pending.
    fn wait_mount(&mut self, mountpoint: &Path) -> Option<std::result::Result<(), String>>;
    /// Unmounts what `mount` mounted; an error when busy.
    fn unmount(&mut self, mountpoint: &Path) -> std::result::Result<(), String>;
    /// Whether `mountpoint` has a live mount on it: mounted, and its
    /// daemons (holder or FUSE daemon) alive.
    fn is_mounted(&self, mountpoint: &Path) -> bool;
    /// Whether a mount `start_mount` began at `mountpoint` is still pending.
    fn is_pending(&self, mountpoint: &Path) -> bool;
    /// Detaches a dead mount at `mountpoint` (mounted, its daemons gone):
    /// containers that use it keep it, new ones get a new mount. Returns
    /// whether there was one.
    fn detach_dead(&mut self, mountpoint: &Path) -> bool;
    /// What answers `lookup` without the snapshotter's lock: the service
    /// resolves a Prepare's image through it first, so that a slow registry
    /// holds up only the calls that need that image (`None`: `lookup` is
    /// asked under the lock, as fakes are).
    fn resolver(&self) -> Option<Arc<dyn Resolve>> {
        None
    }
    /// A wait for the mount `start_mount` began at `mountpoint`, to be
    /// waited for without the snapshotter's lock (`None`: none pending).
    fn pending_wait(&self, _mountpoint: &Path) -> Option<MountWait> {
        None
    }
}

/// Resolving image references, shared with the service outside the lock.
pub trait Resolve: Send + Sync {
    /// As [`Images::lookup`]; network I/O happens here.
    fn lookup(
        &self,
        reference: &str,
        layer: &str,
    ) -> std::result::Result<Option<LayerRole>, String>;
}

/// Blocks until a background mount is done.
pub type MountWait = Box<dyn FnOnce() + Send>;

/// A layer's role as [`Resolve::lookup`] answered it outside the lock, or
/// `None` when it was not asked (the snapshotter asks under the lock).
pub type Resolved = Option<std::result::Result<Option<LayerRole>, String>>;

/// The image and layer a Prepare's labels name for a remote snapshot, if
/// they name one (a target, an image and a layer).
pub fn remote_layer(labels: &BTreeMap<String, String>) -> Option<(String, String)> {
    labels.get(LABEL_TARGET)?;
    let image = labels
        .get(LABEL_CRI_IMAGE)
        .or(labels.get(LABEL_STARGZ_IMAGE))?;
    let layer = labels
        .get(LABEL_CRI_LAYER)
        .or(labels.get(LABEL_STARGZ_LAYER))?;
    Some((image.clone(), layer.clone()))
}

/// A snapshot as callers see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Info {
    /// Name (key).
    pub name: String,
    /// Parent's name, "" for none.
    pub parent: String,
    /// Kind.
    pub kind: Kind,
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// Creation time.
    pub created: SystemTime,
    /// Last update.
    pub updated: SystemTime,
}

impl Fields for Info {
    fn field(&self, path: &[String]) -> Option<String> {
        match path {
            [f] if f == "name" => Some(self.name.clone()),
            // Always present, as in containerd: `parent==""` finds the
            // snapshots without one (containerd's metadata layer asks so).
            [f] if f == "parent" => Some(self.parent.clone()),
            [f] if f == "kind" => Some(self.kind.as_str().to_string()),
            [f, rest @ ..] if f == "labels" && !rest.is_empty() => {
                self.labels.get(&rest.join(".")).cloned()
            }
            _ => None,
        }
    }
}

/// The snapshotter: its root directory, its state and the lamina side.
#[derive(Debug)]
pub struct Snapshotter<I> {
    root: PathBuf,
    state: State,
    images: I,
}

impl<I: Images> Snapshotter<I> {
    /// Opens (creating) the snapshotter at `root` (0700).
    pub fn open(root: &Path, images: I) -> Result<Self> {
        for dir in [root.to_path_buf(), root.join("snapshots")] {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&dir)
                .map_err(internal(dir.display()))?;
        }
        let state = State::load(root).map_err(internal("loading state"))?;
        Ok(Snapshotter {
            root: root.to_path_buf(),
            state,
            images,
        })
    }

    /// Every snapshot's kind and backing, for metrics.
    pub fn census(&self) -> impl Iterator<Item = (Kind, &Backing)> {
        self.state.snapshots.values().map(|s| (s.kind, &s.backing))
    }

    /// The lamina side.
    pub fn images(&mut self) -> &mut I {
        &mut self.images
    }

    fn dir(&self, snap: &Snapshot) -> PathBuf {
        snapshot_dir(&self.root, snap.id)
    }

    fn get(&self, key: &str) -> Result<&Snapshot> {
        self.state
            .snapshots
            .get(key)
            .ok_or_else(|| Error::NotFound(key.to_string()))
    }

    fn save(&self) -> Result<()> {
        self.state
            .save(&self.root)
            .map_err(internal("saving state"))
    }

    /// Creates an active snapshot `key` on `parent`; for a lamina layer,
    /// commits it under its target name instead and says `AlreadyExists`.
    pub fn prepare(
        &mut self,
        key: &str,
        parent: &str,
        labels: BTreeMap<String, String>,
    ) -> Result<Vec<Mount>> {
        self.prepare_resolved(key, parent, labels, None)
    }

    /// [`prepare`](Self::prepare) with the labels' image already resolved
    /// (by [`Images::resolver`], outside the lock): `role` is its answer.
    pub fn prepare_resolved(
        &mut self,
        key: &str,
        parent: &str,
        labels: BTreeMap<String, String>,
        role: Resolved,
    ) -> Result<Vec<Mount>> {
        if let Some(err) = self.try_lamina(parent, &labels, role)? {
            return Err(err);
        }
        self.create(Kind::Active, key, parent, labels)
    }

    /// What resolves images without this snapshotter's lock, if any.
    pub fn resolver(&self) -> Option<Arc<dyn Resolve>> {
        self.images.resolver()
    }

    /// A wait for the background mount of the lamina image under `key`
    /// (when `key` names a snapshot; else under `parent`), to be waited for
    /// without the lock before the call that needs that mount.
    pub fn mount_wait(&self, key: &str, parent: &str) -> Option<MountWait> {
        let parent = match self.state.snapshots.get(key) {
            Some(snap) => snap.parent.as_str(),
            None => parent,
        };
        let (_, mnt) = self.image_under(parent).ok()??;
        self.images.pending_wait(&mnt)
    }

    /// Creates a read-only view `key` of `parent`.
    pub fn view(
        &mut self,
        key: &str,
        parent: &str,
        labels: BTreeMap<String, String>,
    ) -> Result<Vec<Mount>> {
        self.create(Kind::View, key, parent, labels)
    }

    fn check_new(&self, key: &str, parent: &str) -> Result<()> {
        if key.is_empty() {
            return Err(Error::InvalidArgument(
                "snapshot key must not be empty".into(),
            ));
        }
        if self.state.snapshots.contains_key(key) {
            return Err(Error::AlreadyExists(key.to_string()));
        }
        if !parent.is_empty() && self.get(parent)?.kind != Kind::Committed {
            return Err(Error::InvalidArgument(format!(
                "parent {parent} is not a committed snapshot"
            )));
        }
        Ok(())
    }

    /// Makes `snapshots/ID/` (0700) with `fs/` (0755) and, for active
    /// snapshots, `work/`; returns the new id.
    fn make_dirs(&mut self, kind: Kind) -> Result<u64> {
        let id = self.state.take_id();
        let dir = snapshot_dir(&self.root, id);
        let mut subdirs = vec![("fs", 0o755)];
        if kind == Kind::Active {
            subdirs.push(("work", 0o700));
        }
        fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .map_err(internal(dir.display()))?;
        for (name, mode) in subdirs {
            let sub = dir.join(name);
            fs::DirBuilder::new()
                .mode(mode)
                .create(&sub)
                .map_err(internal(sub.display()))?;
            // The umask may have narrowed it; containerd wants 0755 roots.
            fs::set_permissions(&sub, std::os::unix::fs::PermissionsExt::from_mode(mode))
                .map_err(internal(sub.display()))?;
        }
        Ok(id)
    }

    fn insert(&mut self, key: &str, snap: Snapshot) -> Result<()> {
        let dir = self.dir(&snap);
        self.state.snapshots.insert(key.to_string(), snap);
        if let Err(e) = self.save() {
            self.state.snapshots.remove(key);
            let _ = fs::remove_dir_all(dir);
            return Err(e);
        }
        Ok(())
    }

    fn create(
        &mut self,
        kind: Kind,
        key: &str,
        parent: &str,
        labels: BTreeMap<String, String>,
    ) -> Result<Vec<Mount>> {
        self.check_new(key, parent)?;
        // Before anything is recorded: a failed mount fails this call only.
        self.ensure_mounted(parent)?;
        let id = self.make_dirs(kind)?;
        let now = SystemTime::now();
        let snap = Snapshot {
            id,
            kind,
            parent: parent.to_string(),
            labels,
            created: now,
            updated: now,
            backing: Backing::Overlay,
            usage: None,
        };
        self.insert(key, snap)?;
        self.mount_specs(key)
    }

    /// The remote-snapshot path: `Some(AlreadyExists)` when the layer is a
    /// lamina layer now committed under its target name.
    fn try_lamina(
        &mut self,
        parent: &str,
        labels: &BTreeMap<String, String>,
        resolved: Resolved,
    ) -> Result<Option<Error>> {
        let Some((image, layer)) = remote_layer(labels) else {
            return Ok(None);
        };
        let (image, layer) = (&image, &layer);
        let target = &labels[LABEL_TARGET];
        if self.state.snapshots.contains_key(target) {
            return Ok(Some(Error::AlreadyExists(target.clone())));
        }
        let resolved = resolved.unwrap_or_else(|| self.images.lookup(image, layer));
        let role = match resolved {
            Ok(Some(role)) => role,
            Ok(None) => return Ok(None),
            Err(e) => {
                tracing::warn!(
                    image,
                    layer,
                    "not a remote snapshot, containerd unpacks it: {e}"
                );
                return Ok(None);
            }
        };
        self.check_new(target, parent)?;
        let id = self.make_dirs(Kind::Committed)?;
        let dir = snapshot_dir(&self.root, id);
        let backing = match role {
            LayerRole::Lower => Backing::LaminaLayer {
                layer: layer.clone(),
            },
            LayerRole::Top { image } => {
                let mnt = dir.join("lamina");
                if let Err(e) = fs::create_dir(&mnt) {
                    let _ = fs::remove_dir_all(&dir);
                    return Err(Error::Internal(format!("{}: {e}", mnt.display())));
                }
                // Whatever needs the image's files (a child's Prepare, a
                // View, Mounts) waits for this mount: see `ensure_mounted`.
                self.images.start_mount(&image, &mnt);
                tracing::info!(image, snapshot = target, "mounting lamina image lazily");
                Backing::LaminaImage { image }
            }
        };
        let now = SystemTime::now();
        let snap = Snapshot {
            id,
            kind: Kind::Committed,
            parent: parent.to_string(),
            labels: labels.clone(),
            created: now,
            updated: now,
            backing,
            usage: Some((0, 0)),
        };
        self.insert(target, snap)?;
        Ok(Some(Error::AlreadyExists(target.clone())))
    }

    /// The directories an overlay on `parent` stacks, topmost first.
    fn lowers<'a>(&'a self, mut parent: &'a str) -> Result<Vec<PathBuf>> {
        let mut out = Vec::new();
        while !parent.is_empty() {
            let snap = self.get(parent)?;
            let dir = self.dir(snap);
            match &snap.backing {
                Backing::Overlay => out.push(dir.join("fs")),
                // The image's top carries the whole image: stop there.
                Backing::LaminaImage { .. } => {
                    out.push(dir.join("lamina"));
                    break;
                }
                Backing::LaminaLayer { .. } => {}
            }
            parent = &snap.parent;
        }
        Ok(out)
    }

    /// The lamina image `parent` stands on, if any, and its mount point.
    fn image_under<'a>(&'a self, mut parent: &'a str) -> Result<Option<(String, PathBuf)>> {
        while !parent.is_empty() {
            let snap = self.get(parent)?;
            if let Backing::LaminaImage { image } = &snap.backing {
                return Ok(Some((image.clone(), self.dir(snap).join("lamina"))));
            }
            parent = &snap.parent;
        }
        Ok(None)
    }

    /// Makes sure the lamina image under `parent` (if any) is mounted: waits
    /// for its background mount, and mounts it again if that failed or the
    /// mount is gone. An error only when mounting fails now.
    fn ensure_mounted(&mut self, parent: &str) -> Result<()> {
        let Some((image, mnt)) = self.image_under(parent)? else {
            return Ok(());
        };
        match self.images.wait_mount(&mnt) {
            Some(Ok(())) => return Ok(()),
            None if self.images.is_mounted(&mnt) => return Ok(()),
            Some(Err(e)) => tracing::warn!(image, "lazy mount failed: {e}; trying once more"),
            None if self.images.detach_dead(&mnt) => tracing::warn!(
                image,
                "{}: its daemon is gone; detached it, mounting it again",
                mnt.display()
            ),
            None => tracing::warn!(image, "{} is not mounted; mounting it", mnt.display()),
        }
        self.images
            .mount(&image, &mnt)
            .map_err(|e| Error::Internal(format!("lazy mount of {image}: {e}")))?;
        tracing::info!(image, "lamina image mounted lazily");
        Ok(())
    }

    /// The mounts that give snapshot `key`'s filesystem.
    pub fn mounts(&mut self, key: &str) -> Result<Vec<Mount>> {
        let parent = self.get(key)?.parent.clone();
        self.ensure_mounted(&parent)?;
        self.mount_specs(key)
    }

    fn mount_specs(&self, key: &str) -> Result<Vec<Mount>> {
        let snap = self.get(key)?;
        let dir = self.dir(snap);
        let lowers = self.lowers(&snap.parent)?;
        let bind = |source: &Path, mode: &str| Mount {
            r#type: "bind".into(),
            source: source.display().to_string(),
            target: String::new(),
            options: vec![mode.into(), "rbind".into()],
        };
        let lowerdir = || {
            let paths: Vec<String> = lowers.iter().map(|p| p.display().to_string()).collect();
            format!("lowerdir={}", paths.join(":"))
        };
        let overlay = |options: Vec<String>| Mount {
            r#type: "overlay".into(),
            source: "overlay".into(),
            target: String::new(),
            options,
        };
        Ok(match (snap.kind, lowers.len()) {
            (Kind::Committed, _) => {
                return Err(Error::FailedPrecondition(format!(
                    "snapshot {key} is committed: mount a view of it"
                )))
            }
            (Kind::Active, 0) => vec![bind(&dir.join("fs"), "rw")],
            (Kind::View, 0) => vec![bind(&dir.join("fs"), "ro")],
            (Kind::View, 1) => vec![bind(&lowers[0], "ro")],
            (Kind::View, _) => vec![overlay(vec![lowerdir()])],
            (Kind::Active, _) => vec![overlay(vec![
                format!("workdir={}", dir.join("work").display()),
                format!("upperdir={}", dir.join("fs").display()),
                lowerdir(),
            ])],
        })
    }

    /// Commits active snapshot `key` as `name`.
    pub fn commit(
        &mut self,
        name: &str,
        key: &str,
        labels: BTreeMap<String, String>,
    ) -> Result<()> {
        let snap = self.get(key)?.clone();
        if snap.kind != Kind::Active {
            return Err(Error::FailedPrecondition(format!(
                "snapshot {key} is {}, only active snapshots commit",
                snap.kind.as_str()
            )));
        }
        if self.state.snapshots.contains_key(name) {
            return Err(Error::AlreadyExists(name.to_string()));
        }
        let dir = self.dir(&snap);
        let usage = disk_usage(&dir.join("fs")).map_err(internal("measuring usage"))?;
        let now = SystemTime::now();
        let committed = Snapshot {
            kind: Kind::Committed,
            labels,
            created: now,
            updated: now,
            usage: Some(usage),
            ..snap
        };
        self.state.snapshots.remove(key);
        self.state.snapshots.insert(name.to_string(), committed);
        if let Err(e) = self.save() {
            let back = self.state.snapshots.remove(name).expect("just inserted");
            self.state.snapshots.insert(
                key.to_string(),
                Snapshot {
                    kind: Kind::Active,
                    ..back
                },
            );
            return Err(e);
        }
        let _ = fs::remove_dir_all(dir.join("work"));
        Ok(())
    }

    /// Removes snapshot `key`, which must have no children.
    pub fn remove(&mut self, key: &str) -> Result<()> {
        let snap = self.get(key)?.clone();
        if let Some(child) = self.state.children(key).next() {
            return Err(Error::FailedPrecondition(format!(
                "cannot remove snapshot {key}: snapshot {child} is its child"
            )));
        }
        let dir = self.dir(&snap);
        if let Backing::LaminaImage { image } = &snap.backing {
            let mnt = dir.join("lamina");
            // A mount still being made would land after the removal.
            if let Some(Err(e)) = self.images.wait_mount(&mnt) {
                tracing::info!(image, "removing a snapshot whose lazy mount failed: {e}");
            }
            if self.images.is_mounted(&mnt) {
                self.images.unmount(&mnt).map_err(|e| {
                    Error::FailedPrecondition(format!(
                        "cannot remove snapshot {key} ({image}): {e}"
                    ))
                })?;
            }
        }
        self.state.snapshots.remove(key);
        if let Err(e) = self.save() {
            self.state.snapshots.insert(key.to_string(), snap);
            return Err(e);
        }
        remove_snapshot_dir(&dir);
        Ok(())
    }

    /// The snapshot `key`.
    pub fn stat(&self, key: &str) -> Result<Info> {
        Ok(info(key, self.get(key)?))
    }

    /// Updates labels: all of them (no field paths, or `labels`), or the
    /// named ones (`labels.KEY`); other fields are immutable.
    pub fn update(
        &mut self,
        name: &str,
        labels: BTreeMap<String, String>,
        paths: &[String],
    ) -> Result<Info> {
        let mut snap = self.get(name)?.clone();
        if paths.is_empty() {
            snap.labels = labels.clone();
        }
        for path in paths {
            if path == "labels" {
                snap.labels = labels.clone();
            } else if let Some(label) = path.strip_prefix("labels.") {
                match labels.get(label) {
                    Some(v) => snap.labels.insert(label.to_string(), v.clone()),
                    None => snap.labels.remove(label),
                };
            } else {
                return Err(Error::InvalidArgument(format!(
                    "cannot update {path:?} of snapshot {name}: only labels are mutable"
                )));
            }
        }
        snap.updated = SystemTime::now();
        let old = self.state.snapshots.insert(name.to_string(), snap.clone());
        if let Err(e) = self.save() {
            self.state
                .snapshots
                .insert(name.to_string(), old.expect("exists"));
            return Err(e);
        }
        Ok(info(name, &snap))
    }

    /// Bytes and inodes the snapshot uses: an active snapshot's upper dir
    /// measured now, a committed one's as measured at commit.
    pub fn usage(&self, key: &str) -> Result<(i64, i64)> {
        let snap = self.get(key)?;
        match (snap.kind, snap.usage) {
            (Kind::Committed, Some(u)) => Ok(u),
            _ => disk_usage(&self.dir(snap).join("fs")).map_err(internal("measuring usage")),
        }
    }

    /// Every snapshot matching any of `filters` (all when none).
    pub fn walk(&self, filters: &[String]) -> Result<Vec<Info>> {
        let filters = filters
            .iter()
            .map(|f| Filter::parse(f))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(Error::InvalidArgument)?;
        Ok(self
            .state
            .snapshots
            .iter()
            .map(|(name, snap)| info(name, snap))
            .filter(|i| matches_any(&filters, i))
            .collect())
    }

    /// Removes snapshot directories the state does not name (left by a
    /// crash between a directory change and a state change).
    pub fn cleanup(&mut self) -> Result<Vec<PathBuf>> {
        let known: HashSet<String> = self
            .state
            .snapshots
            .values()
            .map(|s| s.id.to_string())
            .collect();
        let snapshots = self.root.join("snapshots");
        let mut removed = Vec::new();
        for entry in fs::read_dir(&snapshots).map_err(internal(snapshots.display()))? {
            let entry = entry.map_err(internal(snapshots.display()))?;
            if known.contains(&*entry.file_name().to_string_lossy()) {
                continue;
            }
            let mnt = entry.path().join("lamina");
            if self.images.is_mounted(&mnt) {
                if let Err(e) = self.images.unmount(&mnt) {
                    tracing::warn!(path = %mnt.display(), "orphaned lamina mount left: {e}");
                    continue;
                }
            }
            remove_snapshot_dir(&entry.path());
            removed.push(entry.path());
        }
        Ok(removed)
    }

    /// After a start, and then every few seconds: every lamina image the
    /// state names whose mount is gone, or dead (its daemons gone: detached
    /// first), is mounted again in the background (`start_mount`), so that
    /// no call waits on a registry unless it needs that image (it waits in
    /// `ensure_mounted`). Returns what it did, one line each.
    pub fn reconcile(&mut self) -> Vec<String> {
        let mut done = Vec::new();
        let images: Vec<(String, PathBuf, String)> = self
            .state
            .snapshots
            .iter()
            .filter_map(|(name, s)| match &s.backing {
                Backing::LaminaImage { image } => {
                    Some((name.clone(), self.dir(s).join("lamina"), image.clone()))
                }
                _ => None,
            })
            .collect();
        for (name, mnt, image) in images {
            if self.images.is_pending(&mnt) || self.images.is_mounted(&mnt) {
                continue;
            }
            let was = match self.images.detach_dead(&mnt) {
                true => "served by no daemon (detached it)",
                false => "not mounted",
            };
            self.images.start_mount(&image, &mnt);
            done.push(format!(
                "snapshot {name}: {image} was {was}; mounting it again in the background"
            ));
        }
        done
    }
}

fn info(name: &str, s: &Snapshot) -> Info {
    Info {
        name: name.to_string(),
        parent: s.parent.clone(),
        kind: s.kind,
        labels: s.labels.clone(),
        created: s.created,
        updated: s.updated,
    }
}

/// Removes a snapshot directory without crossing into anything mounted
/// below it (a busy lamina mount stays, with its directory).
fn remove_snapshot_dir(dir: &Path) {
    let dev = fs::symlink_metadata(dir).map(|m| m.dev()).ok();
    let walker = walkdir::WalkDir::new(dir)
        .same_file_system(true)
        .contents_first(true);
    for entry in walker.into_iter().flatten() {
        if Some(entry.metadata().map(|m| m.dev()).unwrap_or(0)) != dev {
            continue;
        }
        let res = if entry.file_type().is_dir() {
            fs::remove_dir(entry.path())
        } else {
            fs::remove_file(entry.path())
        };
        if let Err(e) = res {
            tracing::warn!(path = %entry.path().display(), "left behind: {e}");
        }
    }
}

/// Bytes (allocated blocks) and inodes under `dir`, each inode once.
fn disk_usage(dir: &Path) -> std::io::Result<(i64, i64)> {
    let mut seen = HashSet::new();
    let (mut bytes, mut inodes) = (0i64, 0i64);
    for entry in walkdir::WalkDir::new(dir).same_file_system(true) {
        let meta = entry
            .map_err(std::io::Error::other)?
            .metadata()
            .map_err(std::io::Error::other)?;
        if seen.insert((meta.dev(), meta.ino())) {
            inodes += 1;
            bytes += meta.blocks() as i64 * 512;
        }
    }
    Ok((bytes, inodes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// A lamina side that knows one image of three layers and records
    /// mounts in memory. A background mount is left pending until waited
    /// for, and then fails `failing_mounts` times before it succeeds.
    #[derive(Debug, Default)]
    struct FakeImages {
        mounted: BTreeSet<PathBuf>,
        /// Mounted, but their daemons are gone.
        dead: BTreeSet<PathBuf>,
        mounts: usize,
        pending: BTreeSet<PathBuf>,
        failing_mounts: usize,
        busy: bool,
        registry_down: bool,
    }

    impl Images for FakeImages {
        fn lookup(
            &mut self,
            reference: &str,
            layer: &str,
        ) -> std::result::Result<Option<LayerRole>, String> {
            if self.registry_down {
                return Err("connection refused".into());
            }
            Ok(match (reference, layer) {
                ("reg/img:tag", "sha256:l1" | "sha256:l2") => Some(LayerRole::Lower),
                ("reg/img:tag", "sha256:top") => Some(LayerRole::Top {
                    image: "reg/img@sha256:m".into(),
                }),
                _ => None,
            })
        }
        fn mount(&mut self, _image: &str, mountpoint: &Path) -> std::result::Result<(), String> {
            self.mounts += 1;
            if self.failing_mounts > 0 {
                self.failing_mounts -= 1;
                return Err("registry unreachable".into());
            }
            self.mounted.insert(mountpoint.to_path_buf());
            Ok(())
        }
        fn start_mount(&mut self, _image: &str, mountpoint: &Path) {
            self.pending.insert(mountpoint.to_path_buf());
        }
        fn wait_mount(&mut self, mountpoint: &Path) -> Option<std::result::Result<(), String>> {
            self.pending
                .remove(mountpoint)
                .then(|| self.mount("", mountpoint))
        }
        fn unmount(&mut self, mountpoint: &Path) -> std::result::Result<(), String> {
            if self.busy {
                return Err("device or resource busy".into());
            }
            self.mounted.remove(mountpoint);
            Ok(())
        }
        fn is_mounted(&self, mountpoint: &Path) -> bool {
            self.mounted.contains(mountpoint) && !self.dead.contains(mountpoint)
        }
        fn is_pending(&self, mountpoint: &Path) -> bool {
            self.pending.contains(mountpoint)
        }
        fn detach_dead(&mut self, mountpoint: &Path) -> bool {
            let dead = self.dead.remove(mountpoint);
            if dead {
                self.mounted.remove(mountpoint);
            }
            dead
        }
    }

    fn remote_labels(target: &str, layer: &str) -> BTreeMap<String, String> {
        [
            (LABEL_TARGET, target),
            (LABEL_CRI_IMAGE, "reg/img:tag"),
            (LABEL_CRI_LAYER, layer),
            ("containerd.io/gc.root", "x"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
    }

    /// Pulls the fake image the way containerd does: one Prepare per layer
    /// with the target chain id; returns the top's name.
    fn pull(sn: &mut Snapshotter<FakeImages>) -> String {
        let mut parent = String::new();
        for (i, layer) in ["sha256:l1", "sha256:l2", "sha256:top"].iter().enumerate() {
            let target = format!("chain-{i}");
            let err = sn
                .prepare(
                    &format!("extract-{i}"),
                    &parent,
                    remote_labels(&target, layer),
                )
                .unwrap_err();
            assert!(
                matches!(&err, Error::AlreadyExists(t) if *t == target),
                "{err}"
            );
            assert!(
                sn.get(&format!("extract-{i}")).is_err(),
                "the extract key must not exist"
            );
            parent = target;
        }
        parent
    }

    #[test]
    fn lamina_layers_become_committed_snapshots_and_the_top_mounts_the_image() {
        let root = tempfile::tempdir().unwrap();
        let mut sn = Snapshotter::open(root.path(), FakeImages::default()).unwrap();
        let top = pull(&mut sn);
        assert_eq!(sn.images.pending.len(), 1, "only the top layer mounts");
        assert_eq!(sn.images.mounts, 0, "in the background: the pull goes on");
        let info = sn.stat(&top).unwrap();
        assert_eq!(
            (info.kind, info.parent.as_str()),
            (Kind::Committed, "chain-1")
        );
        assert_eq!(
            info.labels.get(LABEL_TARGET).map(String::as_str),
            Some("chain-2")
        );
        // Pulling again finds what exists and mounts nothing more.
        assert!(matches!(
            sn.prepare(
                "extract-again",
                "chain-1",
                remote_labels("chain-2", "sha256:top")
            ),
            Err(Error::AlreadyExists(_))
        ));
        assert_eq!(sn.images.pending.len(), 1);

        // The container's snapshot needs the image's files: it waits.
        let mounts = sn.prepare("container", &top, BTreeMap::new()).unwrap();
        assert_eq!((sn.images.mounts, sn.images.pending.len()), (1, 0));
        let top_dir = sn.dir(sn.get(&top).unwrap());
        let opts = &mounts[0].options;
        assert_eq!(mounts[0].r#type, "overlay");
        assert!(
            opts.contains(&format!("lowerdir={}", top_dir.join("lamina").display())),
            "the image's mount is the only lower dir: {opts:?}"
        );
        // A view of the image is a read-only bind of its mount.
        let view = sn.view("view", &top, BTreeMap::new()).unwrap();
        assert_eq!(view[0].source, top_dir.join("lamina").display().to_string());
        assert!(view[0].options.contains(&"ro".to_string()));
        assert_eq!(sn.images.mounts, 1, "mounted once");
    }

    #[test]
    fn a_failed_background_mount_fails_only_the_call_that_needs_it() {
        let root = tempfile::tempdir().unwrap();
        let mut sn = Snapshotter::open(root.path(), FakeImages::default()).unwrap();
        let top = pull(&mut sn);
        // The background mount and the one retry fail: so does the Prepare,
        // and nothing of it is recorded.
        sn.images.failing_mounts = 2;
        let err = sn.prepare("container", &top, BTreeMap::new()).unwrap_err();
        assert!(
            matches!(&err, Error::Internal(m) if m.contains("lazy mount of reg/img@sha256:m")),
            "{err}"
        );
        assert!(matches!(sn.stat("container"), Err(Error::NotFound(_))));
        // containerd tries again: the image is mounted now.
        sn.prepare("container", &top, BTreeMap::new()).unwrap();
        assert_eq!(sn.images.mounts, 3);
        // A background mount that fails once is retried in the call.
        sn.remove("container").unwrap();
        sn.remove(&top).unwrap();
        let top = pull(&mut sn);
        sn.images.failing_mounts = 1;
        sn.view("view", &top, BTreeMap::new()).unwrap();
        assert_eq!(sn.images.mounts, 5);
        assert!(sn.images.failing_mounts == 0 && sn.images.pending.is_empty());
    }

    #[test]
    fn other_images_and_an_unreachable_registry_get_ordinary_snapshots() {
        let root = tempfile::tempdir().unwrap();
        let mut sn = Snapshotter::open(root.path(), FakeImages::default()).unwrap();
        let mut labels = remote_labels("chain-x", "sha256:plain");
        labels.insert(LABEL_CRI_IMAGE.into(), "reg/other:tag".into());
        let mounts = sn.prepare("extract-x", "", labels).unwrap();
        assert_eq!(mounts[0].r#type, "bind");
        assert_eq!(sn.stat("extract-x").unwrap().kind, Kind::Active);

        sn.images.registry_down = true;
        sn.prepare("extract-y", "", remote_labels("chain-y", "sha256:l1"))
            .unwrap();
        assert_eq!(sn.stat("extract-y").unwrap().kind, Kind::Active);
        assert_eq!(sn.images.mounts, 0);
    }

    #[test]
    fn a_busy_image_is_not_removed_and_a_free_one_is_unmounted() {
        let root = tempfile::tempdir().unwrap();
        let mut sn = Snapshotter::open(root.path(), FakeImages::default()).unwrap();
        let top = pull(&mut sn);
        assert!(
            matches!(sn.remove("chain-1"), Err(Error::FailedPrecondition(m)) if m.contains("remove"))
        );
        // Removing waits for the mount still being made, then unmounts it.
        assert_eq!(sn.images.pending.len(), 1);
        sn.images.busy = true;
        assert!(matches!(sn.remove(&top), Err(Error::FailedPrecondition(_))));
        assert_eq!((sn.images.mounts, sn.images.pending.len()), (1, 0));
        assert!(sn.stat(&top).is_ok(), "a failed remove keeps the snapshot");
        sn.images.busy = false;
        sn.remove(&top).unwrap();
        assert!(sn.images.mounted.is_empty());
        for name in ["chain-1", "chain-0"] {
            sn.remove(name).unwrap();
        }
        assert!(sn.walk(&[]).unwrap().is_empty());
        assert_eq!(
            fs::read_dir(root.path().join("snapshots")).unwrap().count(),
            0
        );
    }

    #[test]
    fn a_restart_keeps_the_state_and_mounts_again_what_is_gone() {
        let root = tempfile::tempdir().unwrap();
        let top = {
            let mut sn = Snapshotter::open(root.path(), FakeImages::default()).unwrap();
            let top = pull(&mut sn);
            sn.prepare("container", &top, BTreeMap::new()).unwrap();
            top
        };
        // A new process: nothing mounted as far as its fake knows.
        let mut sn = Snapshotter::open(root.path(), FakeImages::default()).unwrap();
        assert_eq!(sn.stat("container").unwrap().parent, top);
        let done = sn.reconcile();
        assert_eq!(done.len(), 1, "{done:?}");
        assert!(done[0].contains("mounting it again"), "{done:?}");
        // Point 7 of the many-tenants issue: in the background; the first
        // call that needs the image waits for it, no other call does.
        assert_eq!(sn.images.mounts, 0, "reconcile mounted in the foreground");
        assert!(sn.reconcile().is_empty(), "a pending mount is left alone");
        sn.stat("container").unwrap();
        assert_eq!(sn.images.mounts, 0);
        sn.mounts("container").unwrap();
        assert_eq!(sn.images.mounts, 1);
        assert!(sn.reconcile().is_empty(), "a mounted image is left alone");
        // A mount whose daemon died is detached and mounted again.
        let mnt = sn.images.mounted.iter().next().unwrap().clone();
        sn.images.dead.insert(mnt.clone());
        let done = sn.reconcile();
        assert!(done[0].contains("served by no daemon"), "{done:?}");
        assert!(sn.images.pending.contains(&mnt));
        sn.mounts("container").unwrap();
        assert!(sn.images.is_mounted(&mnt));
    }

    #[test]
    fn commit_update_and_cleanup_follow_containerd() {
        let root = tempfile::tempdir().unwrap();
        let mut sn = Snapshotter::open(root.path(), FakeImages::default()).unwrap();
        sn.prepare("a", "", BTreeMap::new()).unwrap();
        assert!(matches!(
            sn.prepare("a", "", BTreeMap::new()),
            Err(Error::AlreadyExists(_))
        ));
        assert!(matches!(
            sn.prepare("b", "a", BTreeMap::new()),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            sn.prepare("b", "nope", BTreeMap::new()),
            Err(Error::NotFound(_))
        ));
        sn.commit("c", "a", BTreeMap::new()).unwrap();
        assert!(matches!(
            sn.commit("d", "c", BTreeMap::new()),
            Err(Error::FailedPrecondition(_))
        ));
        assert!(matches!(sn.mounts("c"), Err(Error::FailedPrecondition(_))));

        let labels: BTreeMap<_, _> = [("l1".to_string(), "v".to_string())].into();
        sn.update("c", labels.clone(), &[]).unwrap();
        let i = sn
            .update("c", BTreeMap::new(), &["labels.l1".into()])
            .unwrap();
        assert!(i.labels.is_empty());
        assert!(matches!(
            sn.update("c", labels, &["parent".into()]),
            Err(Error::InvalidArgument(_))
        ));

        let orphan = root.path().join("snapshots/999");
        fs::create_dir_all(orphan.join("fs")).unwrap();
        assert_eq!(sn.cleanup().unwrap(), vec![orphan.clone()]);
        assert!(!orphan.exists());
        assert!(sn.stat("c").is_ok(), "cleanup keeps what the state names");
    }
}
