//! What `lamina mount` hands the holder and worker: one JSON file in the
//! mount's run directory.

use std::path::{Path, PathBuf};

use lamina_format::fill::FileIdentity;

/// Where blob bytes come from.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum SourceSpec {
    /// A registry repository.
    Registry {
        /// `host[:port]`.
        host: String,
        /// Repository.
        repository: String,
        /// Hosts spoken to over plain HTTP.
        insecure_hosts: Vec<String>,
        /// Loopback hosts spoken to over TLS.
        #[serde(default)]
        tls_hosts: Vec<String>,
        /// Extra trusted CA certificates (PEM).
        #[serde(default)]
        ca_file: Option<PathBuf>,
        /// containerd-style registry host configuration (`hosts.toml`s).
        #[serde(default)]
        hosts_dir: Option<PathBuf>,
        /// The docker config holding the mount's only credentials (a
        /// pod's pull secret, written by the snapshotter); `None`: the
        /// process's own (`LAMINA_REGISTRY_AUTH`, `DOCKER_CONFIG`).
        #[serde(default)]
        docker_config: Option<PathBuf>,
    },
    /// A local OCI layout.
    Layout {
        /// Its directory.
        dir: PathBuf,
    },
}

/// What a mount lets the image's files do beyond being read. Both are off
/// unless asked for: a root mount is reachable by every local user, and an
/// image's setuid-root binaries or device nodes (a `b 8 0` node of mode
/// 0666 is raw disk access) must not become theirs. Container runtimes that
/// mount into private dirs ask for both, as overlayfs snapshots have them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Privileges {
    /// Honour setuid and setgid bits (else the mount is `nosuid`).
    pub suid: bool,
    /// Open device nodes (else the mount is `nodev`).
    pub dev: bool,
}

/// One data blob of the mount.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct BlobSpec {
    /// Blob digest.
    pub digest: String,
    /// Cache file (the EROFS device).
    pub cache_path: PathBuf,
    /// Already complete when the mount started (never watched).
    pub complete: bool,
    /// The cache file the mount made or found there: the holder, the
    /// worker and the FUSE daemon serve from this inode and no other
    /// (`None`: none was recorded; nothing is served from it. Mounts refuse
    /// a cache dir whose filesystem keeps no birth time).
    #[serde(default)]
    pub file: Option<CacheFileId>,
    /// Chunks a `--share-files` mount's reads never ask of this cache file:
    /// those its shard reads from another image's complete cache file
    /// ([`DaemonConfig::borrowed`]), and those only its objects that
    /// another shard serves read (a view takes an object from the first
    /// shard stacked that has it). Never fetched ahead; a miss on one is
    /// still answered.
    #[serde(default, alias = "borrowed_chunks")]
    pub served_elsewhere: Vec<u32>,
}

/// Another image's cache file that a `--share-files` shard reads chunks
/// from: complete by its fill record when the mount checked those chunks,
/// so its bytes never change. The holder mounts the very inode the mount
/// checked, or nothing.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct BorrowedSpec {
    /// Its path.
    pub cache_path: PathBuf,
    /// The file the mount checked.
    pub file: CacheFileId,
}

impl BorrowedSpec {
    /// Opens the file, read-only, if it is still the one the mount checked.
    pub fn open_checked(&self) -> std::io::Result<std::fs::File> {
        let file = lamina_fetch::private::open_existing(&self.cache_path)?;
        let got = lamina_fetch::store::identity(&file)?.map(CacheFileId::from);
        match got == Some(self.file) {
            true => Ok(file),
            false => Err(std::io::Error::other(format!(
                "borrowed cache file {} is not the one the mount checked (replaced since)",
                self.cache_path.display()
            ))),
        }
    }
}

/// A cache file's identity (inode number and birth time), as a config
/// carries it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CacheFileId {
    /// Inode number.
    pub ino: u64,
    /// Birth time, seconds.
    pub btime_sec: i64,
    /// Birth time, nanoseconds.
    pub btime_nsec: u32,
}

impl From<FileIdentity> for CacheFileId {
    fn from(id: FileIdentity) -> Self {
        CacheFileId {
            ino: id.ino,
            btime_sec: id.btime_sec,
            btime_nsec: id.btime_nsec,
        }
    }
}

impl BlobSpec {
    /// Checks that `file` is the cache file this mount was made with; a
    /// file put in its place since (deleted and recreated, renamed over)
    /// is never served from nor recorded for.
    pub fn check_file(&self, file: &std::fs::File) -> std::io::Result<()> {
        // Without the identity the mount was made with, no file can be
        // told from one put in its place: fail closed.
        let Some(want) = self.file else {
            return Err(std::io::Error::other(format!(
                "cache file {}: the mount recorded no identity (birth time) for it: not serving \
                 from it",
                self.cache_path.display()
            )));
        };
        let got = lamina_fetch::store::identity(file)?.map(CacheFileId::from);
        match got == Some(want) {
            true => Ok(()),
            false => Err(std::io::Error::other(format!(
                "cache file {} is not the one this mount was made with (replaced since): \
                 not serving from it",
                self.cache_path.display()
            ))),
        }
    }

    /// Opens the mount's cache file, read-only, checked with
    /// [`check_file`](Self::check_file).
    pub fn open_checked(&self) -> std::io::Result<std::fs::File> {
        let file = lamina_fetch::private::open_existing(&self.cache_path)?;
        self.check_file(&file)?;
        Ok(file)
    }
}

/// Everything the daemon processes need.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct DaemonConfig {
    /// Image reference, for status.
    pub image: String,
    /// Manifest digest, for status.
    pub manifest_digest: String,
    /// Mountpoint.
    pub mountpoint: PathBuf,
    /// EROFS metadata image.
    pub metadata_path: PathBuf,
    /// What the holder mounts at `mountpoint`, when not `metadata_path`:
    /// a `--share-files` shard (`lamina_format::shard`), whose objects read
    /// the same cache files. The holder then lives as long as the shard's
    /// superblock, which every view stacking it holds.
    #[serde(default)]
    pub mount_metadata: Option<PathBuf>,
    /// Chunk index (uncompressed), or with `tar_index` the span table of
    /// an unmodified image's tar index (`lamina_format::tar_index`).
    pub index_path: PathBuf,
    /// The blobs are an unmodified image's layers, each cached as its
    /// uncompressed tar and filled span by span (`index_path` is the span
    /// table).
    #[serde(default)]
    pub tar_index: bool,
    /// With `tar_index`: the blob the windows of its gzip spans are in.
    #[serde(default)]
    pub tar_windows: Option<WindowsSpec>,
    /// Directory of cache and state files.
    pub blob_dir: PathBuf,
    /// Blobs in device order.
    pub blobs: Vec<BlobSpec>,
    /// Other images' cache files a `--share-files` shard reads, its devices
    /// after the blobs' (never watched: complete).
    #[serde(default)]
    pub borrowed: Vec<BorrowedSpec>,
    /// Where blob bytes come from.
    pub source: SourceSpec,
    /// Run directory (status, logs, ready marker).
    pub run_dir: PathBuf,
    /// A reader waits at most this long for its bytes, then gets EIO.
    pub timeout_secs: u64,
    /// A miss fetches the chunks of this many bytes around it (cache offsets).
    pub fill_window: u64,
    /// Largest window fetched ahead of a reader that reads a blob in
    /// order; 0: never.
    #[serde(default = "default_fill_ahead")]
    pub fill_ahead: u64,
    /// Hedge slow range requests (see `lamina_fetch::hedge`).
    #[serde(default = "yes")]
    pub hedge: bool,
    /// Largest shared library or executable fetched whole on its first
    /// miss (see `crate::predict`); 0: never.
    #[serde(default = "default_predict_max")]
    pub predict_max: u64,
    /// Fetch the rest of a blob a start without a boot set has waited on
    /// long, on a fast link (`crate::worker`'s `rest.rs`; off: only what
    /// is read and predicted).
    #[serde(default)]
    pub fetch_rests: bool,
    /// When the worker may read `metadata_path`, to predict misses
    /// (`None`, a config written before: never).
    #[serde(default)]
    pub metadata_fill: Option<MetadataFill>,
    /// Threads serving misses.
    pub workers: usize,
    /// Fetch the image's boot set in the background.
    pub prefetch: bool,
    /// Then fetch everything else too.
    pub prefetch_all: bool,
    /// With boot pages: also fetch the boot set's whole chunks once the
    /// start is over.
    #[serde(default = "yes")]
    pub boot_chunks: bool,
    /// Append every miss, as `CHUNK_DIGEST OFFSET LEN` lines in the order
    /// they came, to this file (see `lamina_image::boot`).
    pub record_trace: Option<PathBuf>,
    /// Boot pages, one per segment in read order, written into the cache
    /// as each is verified; a miss on a boot-set chunk waits for them.
    /// (A config written before segments has one object or null here.)
    #[serde(default, deserialize_with = "one_or_many")]
    pub boot_pages: Vec<BootPagesSpec>,
    /// The mount's `read_ahead_kb` while any blob is incomplete (`None`:
    /// the kernel's default). Readahead turns one touched page into a
    /// window of misses that must all be fetched.
    #[serde(default)]
    pub readahead_kb: Option<u32>,
    /// setuid and device nodes: off unless asked for.
    #[serde(default)]
    pub privileges: Privileges,
    /// Layer files (metadata, chunk index, lookup table) this mount wrote
    /// verified but neither synced nor recorded: the worker hashes, syncs
    /// and records them in the background (`lamina_fetch::store::adopt_whole`).
    #[serde(default)]
    pub adopt: Vec<AdoptSpec>,
    /// Layers this mount needs soon but not before its first read (a FUSE
    /// mount's lookup table): the worker fetches each after the boot pages,
    /// checks it, and stores it synced and recorded.
    #[serde(default)]
    pub later_layers: Vec<LayerSpec>,
    /// Whether the image may hold extended attributes; `false` (its
    /// manifest says no inode has any): mounted `noacl`.
    #[serde(default = "yes")]
    pub xattrs: bool,
    /// Bytes of the cache filesystem that fills no reader waits for
    /// (prefetches, reads ahead, predictions) leave free, for the reads
    /// readers wait on, this mount's and every other's (`None`: a tenth of
    /// the filesystem, at most [`DEFAULT_CACHE_RESERVE_MAX`]).
    #[serde(default)]
    pub cache_reserve: Option<u64>,
}

/// The most the cache reserve takes when not told (`cache_reserve`).
pub const DEFAULT_CACHE_RESERVE_MAX: u64 = 1 << 30;

/// How `metadata_path` is filled.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MetadataFill {
    /// Whole before the mount (the kernel path, FUSE without frames).
    Whole,
    /// Frame by frame by the FUSE daemon: whole once a record says the
    /// file holds the content of this SHA-256 (hex).
    Frames {
        /// The content's SHA-256, hex.
        digest: String,
    },
}

/// A tar index's windows blob (`lamina_format::tar_index`).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct WindowsSpec {
    /// Its digest.
    pub digest: String,
    /// Its size.
    pub size: u64,
    /// Where it is: the index artifact's repository or layout.
    pub source: SourceSpec,
}

/// A zstd lamina layer for the worker to fetch whole and store.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct LayerSpec {
    /// What it is, for logs.
    pub what: String,
    /// The compressed layer's digest (`sha256:<hex>`).
    pub layer_digest: String,
    /// The compressed layer's size (bounded at mount).
    pub layer_size: u64,
    /// Digest of its content (`sha256:<hex>`).
    pub digest: String,
    /// Size of its content (bounded at mount).
    pub size: u64,
    /// Where it is stored.
    pub path: PathBuf,
}

/// A layer file for the worker to adopt: its path and content digest.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct AdoptSpec {
    /// The file in the cache's `meta` directory.
    pub path: PathBuf,
    /// Its content digest (`sha256:<hex>`).
    pub digest: String,
}

/// One segment of the image's boot pages: fetched (or found in the cache)
/// and checked by the worker.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct BootPagesSpec {
    /// The compressed layer's digest (`sha256:<hex>`).
    pub layer_digest: String,
    /// The compressed layer's size.
    pub layer_size: u64,
    /// Digest of the uncompressed boot pages.
    pub digest: String,
    /// Size of the uncompressed boot pages.
    pub size: u64,
    /// Where frame `k` is kept, compressed, at `<path>.<k>` (a cached copy
    /// is used only if it still hashes to the frame's digest).
    pub path: PathBuf,
    /// The layer's zstd frames, in read order: each a segment of its own,
    /// fetched as a range and checked against its digest. Empty: the
    /// whole layer is one frame.
    #[serde(default)]
    pub frames: Vec<BootFrameSpec>,
    /// Known from the image, not recorded (`lamina convert --boot-exec`):
    /// the mount keeps its readahead.
    #[serde(default)]
    pub from_image: bool,
}

/// One frame of a boot-pages layer (see `lamina_image::artifact::BootFrame`).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct BootFrameSpec {
    /// Where it starts in the compressed layer.
    pub offset: u64,
    /// Its compressed size.
    pub compressed_size: u64,
    /// Its size decompressed (bounded at mount).
    pub size: u64,
    /// Digest of its compressed bytes (`sha256:<hex>`).
    pub digest: String,
}

impl BootPagesSpec {
    /// The frames to fetch: the listed ones, else the whole layer.
    pub fn frames(&self) -> Vec<BootFrameSpec> {
        if !self.frames.is_empty() {
            return self.frames.clone();
        }
        vec![BootFrameSpec {
            offset: 0,
            compressed_size: self.layer_size,
            size: self.size,
            digest: self.layer_digest.clone(),
        }]
    }

    /// Where frame `k` is kept.
    pub fn frame_path(&self, k: usize) -> PathBuf {
        let mut name = self.path.clone().into_os_string();
        name.push(format!(".{k}"));
        PathBuf::from(name)
    }
}
fn yes() -> bool {
    true
}

/// `null`, one object, or a list of them.
fn one_or_many<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<BootPagesSpec>, D::Error> {
    #[derive(serde::Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(BootPagesSpec),
        Many(Vec<BootPagesSpec>),
    }
    let value: Option<OneOrMany> = serde::Deserialize::deserialize(d)?;
    Ok(match value {
        None => Vec::new(),
        Some(OneOrMany::One(spec)) => vec![spec],
        Some(OneOrMany::Many(specs)) => specs,
    })
}

/// The default largest fill-ahead window: at 100 Mbit/s about half a
/// second of transfer (compressed), so one request's round trip is small
/// against it, and at 10 Mbit/s still well within a reader's timeout.
pub const DEFAULT_FILL_AHEAD: u64 = 8 << 20;

fn default_fill_ahead() -> u64 {
    DEFAULT_FILL_AHEAD
}

/// The default largest mapped file fetched whole on its first miss.
pub const DEFAULT_PREDICT_MAX: u64 = 8 << 20;

fn default_predict_max() -> u64 {
    DEFAULT_PREDICT_MAX
}

impl DaemonConfig {
    /// Reads the config: only a private file of this user is trusted (a
    /// daemon runs as root and does what the config says).
    pub fn load(path: &Path) -> std::io::Result<Self> {
        let bytes = lamina_fetch::private::read_trusted(path)?;
        serde_json::from_slice(&bytes).map_err(std::io::Error::other)
    }

    /// Writes the config atomically.
    pub fn save(&self, path: &Path) -> std::io::Result<()> {
        write_atomic(
            path,
            &serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?,
        )
    }
}

/// Writes a small private file via an exclusive temp file and a rename, so
/// readers never see half of it.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    lamina_fetch::private::write_atomic(path, bytes, false)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Point 2 of the many-tenants issue: a file put at a cache file's path
    /// since the mount was made is refused; the mount's own file passes.
    #[test]
    fn only_the_mounts_own_cache_file_passes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("b.cache");
        std::fs::write(&path, b"x").unwrap();
        let file = lamina_fetch::private::open_existing(&path).unwrap();
        let id = lamina_fetch::store::identity(&file).unwrap();
        let id = id.expect("the test's temp dir keeps birth times");
        let spec = BlobSpec {
            digest: "sha256:00".into(),
            cache_path: path.clone(),
            complete: false,
            file: Some(id.into()),
            served_elsewhere: Vec::new(),
        };
        spec.open_checked().unwrap();
        let other = dir.path().join("other");
        std::fs::write(&other, b"x").unwrap();
        std::fs::rename(&other, &path).unwrap();
        let err = spec.open_checked().unwrap_err();
        assert!(err.to_string().contains("replaced since"), "{err}");
        spec.check_file(&file).unwrap();
    }

    /// Issue 42, point 5: a spec without the file's identity serves from
    /// no file (it was the way around the check where birth times are
    /// missing).
    #[test]
    fn a_cache_file_without_a_recorded_identity_is_not_served() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("b.cache");
        std::fs::write(&path, b"x").unwrap();
        let spec = BlobSpec {
            digest: "sha256:00".into(),
            cache_path: path,
            complete: false,
            file: None,
            served_elsewhere: Vec::new(),
        };
        let err = spec.open_checked().unwrap_err();
        assert!(err.to_string().contains("no identity"), "{err}");
    }

    /// A config written before boot segments (`boot_pages`: one object or
    /// null) still loads, so a worker restarted after an upgrade serves on.
    #[test]
    fn boot_pages_read_as_one_many_or_none() {
        let spec = serde_json::json!({
            "layer_digest": "sha256:00", "layer_size": 1, "digest": "sha256:11",
            "size": 2, "path": "/c/meta/x.boot"
        });
        #[derive(serde::Deserialize)]
        struct Only {
            #[serde(default, deserialize_with = "one_or_many")]
            boot_pages: Vec<BootPagesSpec>,
        }
        let read = |v: serde_json::Value| -> Vec<u64> {
            let only: Only = serde_json::from_value(v).unwrap();
            only.boot_pages.iter().map(|b| b.size).collect()
        };
        assert_eq!(read(serde_json::json!({})), Vec::<u64>::new());
        assert_eq!(
            read(serde_json::json!({ "boot_pages": null })),
            Vec::<u64>::new()
        );
        assert_eq!(read(serde_json::json!({ "boot_pages": spec })), vec![2]);
        assert_eq!(
            read(serde_json::json!({ "boot_pages": [spec, spec] })),
            vec![2, 2]
        );
    }
}
