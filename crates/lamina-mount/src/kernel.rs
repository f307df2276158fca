//! Mounting a lamina image with the kernel: the metadata image as a
//! file-backed EROFS, each data blob's cache file as one `device=`.
//!
//! util-linux's `mount` would wrap the image in a loop device, after which the
//! kernel refuses file paths as `device=`; calling mount(2) on the regular
//! file keeps EROFS in file-backed mode, where `device=` takes files too.

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};

use lamina_daemon::config::Privileges;
use lamina_format::index::{BlobSummary, ChunkIndex};
use lamina_format::lookup::LOOKUP_HEADER_LEN;
use lamina_image::artifact::{self, ArtifactError, LaminaLayers};
use lamina_oci::{open_source, ImageRef, SourceOptions};
use rustix::mount::UnmountFlags;

use crate::cache::{
    materialize_blob, materialize_paged_blob, store_metadata, store_streamed, store_unrecorded,
    CacheError,
};
use lamina_fetch::store::{BlobStore, EntryKey};

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
    /// Whether the image's tree may hold extended attributes (false when
    /// its manifest says no inode has any).
    pub xattrs: bool,
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
    record: Record,
) -> Result<Option<PathBuf>, MountError> {
    let Some(desc) = &layers.lookup else {
        return Ok(None);
    };
    let path = meta_dir.join(format!("{}.lookup", desc.digest.hex()));
    cache_layer_file(source, desc, "lookup table", &path, false, record)?;
    // The binding is in the header: the table is not read here.
    let mut header = [0; LOOKUP_HEADER_LEN];
    fs::File::open(&path)
        .and_then(|mut f| f.read_exact(&mut header))
        .map_err(io_err(&path))?;
    artifact::check_lookup(&header, layers)?;
    Ok(Some(path))
}

/// A zstd-compressed lamina layer (metadata, chunk index, lookup table),
/// kept uncompressed at `path`; its bytes. See [`cache_layer_file`].
pub(crate) fn cached_layer(
    source: &dyn lamina_oci::ImageSource,
    desc: &lamina_oci::Descriptor,
    what: &'static str,
    path: &Path,
    record: Record,
) -> Result<Vec<u8>, MountError> {
    // Asked to read, it always returns the bytes.
    Ok(cache_layer_file(source, desc, what, path, true, record)?.unwrap_or_default())
}

/// When a layer file fetched for a mount is synced and given its record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Record {
    /// Before the mount goes on.
    Now,
    /// By the lazy mount's worker, in the background
    /// (`lamina_fetch::store::adopt_whole`): this mount uses the bytes it
    /// wrote from the layer it verified by the layer's digest; the content
    /// digest's check and the sync (some 150 ms for the 85 MB metadata of a
    /// 1M-file image) are off its path. Until the record is written, a
    /// later mount hashes the file again, so a crash costs a re-hash, never
    /// trust in bytes that were not checked and synced.
    Later,
}

/// Makes `path` hold a zstd-compressed lamina layer's content, verified;
/// returns the bytes if `read`. A cached copy is used as is when its fill
/// record (`lamina_fetch::store::recorded_whole`) says so, without hashing
/// it; one without a record (from before records) is hashed once, synced
/// and recorded; anything else is fetched, checked and stored atomically
/// with its record (or for the record later, see [`Record`]). Both mount
/// paths go through here.
pub(crate) fn cache_layer_file(
    source: &dyn lamina_oci::ImageSource,
    desc: &lamina_oci::Descriptor,
    what: &'static str,
    path: &Path,
    read: bool,
    record: Record,
) -> Result<Option<Vec<u8>>, MountError> {
    let expected = content_digest(desc, what)?;
    if let Ok(mut file) = lamina_fetch::private::open_existing(path) {
        if lamina_fetch::store::recorded_whole(&file, path, &expected).unwrap_or(false) {
            if !read {
                return Ok(None);
            }
            let mut bytes = Vec::new();
            file.read_to_end(&mut bytes).map_err(io_err(path))?;
            return Ok(Some(bytes));
        }
        let mut bytes = Vec::new();
        if file.read_to_end(&mut bytes).is_ok()
            && lamina_oci::sha256(&bytes) == expected
            && file.sync_data().is_ok()
        {
            let _ = lamina_fetch::store::record_whole(&file, path, &expected);
            return Ok(read.then_some(bytes));
        }
    }
    if !read {
        // Recorded now, it is hashed as it is written: streamed, never the
        // whole layer in memory. Recorded later, it is the worker that
        // hashes it before it records it, so the mount waits only for the
        // layer's own digest and the frames' decompression, on every core.
        let record_now = (record == Record::Now).then_some(&expected);
        store_streamed::<MountError>(path, record_now, |file| {
            let copied = match record {
                Record::Now => artifact::copy_compressed_layer(source, desc, what, file),
                Record::Later => {
                    artifact::copy_compressed_layer_in_parallel(source, desc, what, file)
                }
            };
            Ok(copied.map(drop)?)
        })?;
        return Ok(None);
    }
    let bytes = artifact::read_compressed_layer(source, desc, what)?;
    match record {
        Record::Now => store_metadata(path, &bytes, &expected)?,
        Record::Later => store_unrecorded(path, &bytes)?,
    }
    Ok(Some(bytes))
}

/// The metadata layer for a lazy FUSE mount, whose daemon decompresses its
/// frames into `path` as requests need them ([`lamina_fuse::frames`]):
/// `None` when `path` is recorded already, else the layer, fetched and
/// checked against its digest, and `path` made a sparse file of its size
/// (unrecorded: the daemon records it once written whole and hashed). A
/// layer not in sized frames (images from before them) is decompressed
/// into `path` at once, as [`cache_layer_file`] does for [`Record::Later`].
pub(crate) fn cache_metadata_frames(
    source: &dyn lamina_oci::ImageSource,
    desc: &lamina_oci::Descriptor,
    path: &Path,
) -> Result<Option<artifact::LayerFrames>, MountError> {
    let expected = content_digest(desc, "metadata")?;
    if open_recorded(path, &expected).is_some() {
        return Ok(None);
    }
    let mut frames = None;
    store_streamed::<MountError>(path, None, |file| {
        match artifact::read_frames_or_copy(source, desc, "metadata", file)? {
            artifact::FramesOrCopy::Frames(layer) => {
                let size = layer.frames.last().map_or(0, |f| f.offset + f.size);
                file.set_len(size).map_err(io_err(path))?;
                frames = Some(layer);
            }
            artifact::FramesOrCopy::Copied(_) => {}
        }
        Ok(())
    })?;
    Ok(frames)
}

/// The cache file at `path`, open, if its fill record says it holds
/// content of digest `content` (`lamina_fetch::store::recorded_whole`).
pub(crate) fn open_recorded(path: &Path, content: &[u8; 32]) -> Option<std::fs::File> {
    let file = lamina_fetch::private::open_existing(path).ok()?;
    lamina_fetch::store::recorded_whole(&file, path, content)
        .unwrap_or(false)
        .then_some(file)
}

/// A zstd lamina layer's content digest (SHA-256) from its annotation.
pub(crate) fn content_digest(
    desc: &lamina_oci::Descriptor,
    what: &str,
) -> Result<[u8; 32], MountError> {
    let missing =
        || ArtifactError::NotLamina(format!("{what} layer has no SHA-256 content digest"));
    let annotation = desc
        .annotations
        .get(artifact::ANNOTATION_UNCOMPRESSED_DIGEST)
        .ok_or_else(missing)?;
    let digest = lamina_oci::Digest::parse(annotation).map_err(|_| missing())?;
    let mut bytes = [0; 32];
    match digest.algorithm() {
        "sha256" => hex::decode_to_slice(digest.hex(), &mut bytes).map_err(|_| missing())?,
        _ => return Err(missing().into()),
    }
    Ok(bytes)
}

/// Mounts `image` (read-only) at `mountpoint`, filling the cache first.
pub fn mount_image(
    image: &ImageRef,
    mountpoint: &Path,
    opts: &MountOptions,
) -> Result<MountInfo, MountError> {
    let info = fill_cache(image, mountpoint, opts, false)?;
    lamina_daemon::holder::device_options(info.blob_paths.iter().map(PathBuf::as_path))
        .map_err(MountError::BadCachePath)?;
    let devices: Vec<&Path> = info.blob_paths.iter().map(PathBuf::as_path).collect();
    lamina_daemon::holder::mount_erofs(&lamina_daemon::holder::ErofsMount {
        metadata: &info.metadata_path,
        mountpoint,
        devices: &devices,
        acl: info.xattrs,
        privileges: opts.privileges,
        // Complete before the mount: read with direct I/O, cached once.
        direct: true,
    })
    .map_err(|errno| MountError::Syscall {
        op: "mount",
        path: mountpoint.to_path_buf(),
        errno,
        hint: match errno {
            rustix::io::Errno::PERM | rustix::io::Errno::ACCESS => " (mounting needs root)",
            rustix::io::Errno::NODEV => " (the kernel has no EROFS support: modprobe erofs)",
            rustix::io::Errno::TOOBIG => {
                " (a cache path is longer than fsconfig(2) takes, and the cache paths \
                 together longer than mount(2)'s options: choose a shorter --cache-dir)"
            }
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
    let layers = match LaminaLayers::from_manifest(&img.manifest) {
        Ok(layers) => layers,
        Err(ArtifactError::NotLamina(why)) => {
            return match crate::tar_index::find(image, img, opts)? {
                Some((_, index)) => crate::tar_index::fill_cache(
                    source.as_ref(),
                    index.as_ref(),
                    mountpoint,
                    opts,
                    lookup,
                ),
                None => Err(crate::tar_index::not_indexed(image, &why)),
            };
        }
        Err(e) => return Err(e.into()),
    };
    let meta_dir = opts.cache_dir.join("meta");
    let index_path = meta_dir.join(format!("{}.index", layers.index.digest.hex()));
    cache_layer_file(
        source.as_ref(),
        &layers.index,
        "chunk index",
        &index_path,
        false,
        Record::Now,
    )?;
    // The blob table alone says which blobs are cached: the chunks (most
    // of the index of an image of many files) are read only for a blob to
    // fetch.
    let table = fs::File::open(&index_path)
        .map_err(io_err(&index_path))
        .and_then(|f| {
            ChunkIndex::read_blob_table(std::io::BufReader::new(f))
                .map_err(|e| ArtifactError::from(e).into())
        })?;
    artifact::check_blob_table(&table, &layers)?;
    let meta_path = meta_dir.join(format!("{}.erofs", layers.metadata.digest.hex()));
    cache_layer_file(
        source.as_ref(),
        &layers.metadata,
        "metadata",
        &meta_path,
        false,
        Record::Now,
    )?;
    let lookup_path = match lookup {
        true => cached_lookup(source.as_ref(), &layers, &meta_dir, Record::Now)?,
        false => None,
    };

    // Complete only if a fill record bound to the cache file says so: a
    // lazy mount's sparse file has the full length too.
    let blob_dir = opts.cache_dir.join("blobs");
    let keys = entry_keys(&table, &index_path, &layers)?;
    let mut missing = Vec::new();
    let mut blob_paths = Vec::new();
    for (i, (blob, key)) in table.iter().zip(&keys).enumerate() {
        let (path, _) = lamina_fetch::store::store_paths(&blob_dir, key);
        if !BlobStore::recorded_complete(&blob_dir, key, blob).map_err(io_err(&path))? {
            missing.push(i);
        }
        blob_paths.push(path);
    }
    let mut fetched = 0;
    if !missing.is_empty() {
        let index_bytes = fs::read(&index_path).map_err(io_err(&index_path))?;
        let index = artifact::parse_index(&index_bytes, &layers)?;
        for i in missing {
            let (desc, path) = (&layers.blobs[i], &blob_paths[i]);
            let reader = source.open_blob(desc)?;
            let (file, blob) = match index.inline.get(i) {
                Some(blob) => (materialize_blob(path, blob, reader)?, blob.clone()),
                None => materialize_paged_blob(path, &index.blobs[i], index.chunk_bits, reader)?,
            };
            BlobStore::record_complete(&blob_dir, &blob, &file).map_err(io_err(path))?;
            fetched += desc.size;
        }
    }
    Ok(MountInfo {
        mountpoint: mountpoint.to_path_buf(),
        manifest_digest: img.manifest_digest.to_string(),
        metadata_path: meta_path,
        blob_paths,
        lookup_path,
        xattrs: artifact::may_have_xattrs(&img.manifest),
        fetched_bytes: fetched,
    })
}

/// The cache entry of each blob in `table`: a paged index's blob table
/// names them; a version 1 index's chunks, read whole from `index_path`,
/// give them.
fn entry_keys(
    table: &[BlobSummary],
    index_path: &Path,
    layers: &LaminaLayers,
) -> Result<Vec<EntryKey>, MountError> {
    if let Some(keys) = table.iter().map(EntryKey::of_paged).collect() {
        return Ok(keys);
    }
    let index_bytes = fs::read(index_path).map_err(io_err(index_path))?;
    let index = artifact::parse_index(&index_bytes, layers)?;
    let keys = index.blobs.iter().enumerate().map(|(i, summary)| {
        let key = index.inline.get(i).map(EntryKey::of);
        key.or_else(|| EntryKey::of_paged(summary))
    });
    keys.collect::<Option<_>>().ok_or_else(|| {
        MountError::from(ArtifactError::Corrupt {
            what: "chunk index",
            reason: "a blob has neither its chunks nor a chunk table".into(),
        })
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

#[cfg(test)]
mod tests {
    use super::*;
    use lamina_oci::{Descriptor, Digest, ImageSource, Manifest, OciError, SourceImage};
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// One zstd layer, served for any descriptor; counts how often.
    #[derive(Debug)]
    struct OneLayer {
        image: SourceImage,
        compressed: Vec<u8>,
        fetches: AtomicUsize,
    }

    impl OneLayer {
        fn new(raw: &[u8]) -> (Self, Descriptor) {
            Self::of(raw, zstd::bulk::compress(raw, 3).unwrap())
        }

        /// `raw` as frames of `frame` bytes (the metadata layer's form).
        fn framed(raw: &[u8], frame: usize) -> (Self, Descriptor) {
            let compressed = raw
                .chunks(frame)
                .flat_map(|piece| zstd::bulk::compress(piece, 3).unwrap())
                .collect();
            Self::of(raw, compressed)
        }

        fn of(raw: &[u8], compressed: Vec<u8>) -> (Self, Descriptor) {
            let mut desc = Descriptor::of_bytes(artifact::MEDIA_TYPE_METADATA, &compressed);
            desc.annotations = artifact::content_annotations(raw);
            let image = SourceImage {
                manifest: Manifest {
                    schema_version: 2,
                    media_type: None,
                    config: Descriptor::of_bytes("application/vnd.lamina.test", b"{}"),
                    layers: Vec::new(),
                    annotations: Default::default(),
                    artifact_type: None,
                    subject: None,
                },
                manifest_bytes: Vec::new(),
                manifest_digest: Digest::of_bytes(b""),
                config_bytes: b"{}".to_vec(),
                config: serde_json::Value::Null,
                layers: Vec::new(),
            };
            let source = OneLayer {
                image,
                compressed,
                fetches: AtomicUsize::new(0),
            };
            (source, desc)
        }
    }

    impl ImageSource for OneLayer {
        fn image(&self) -> &SourceImage {
            &self.image
        }
        fn open_layer(&self, _: usize) -> Result<Box<dyn Read + Send + '_>, OciError> {
            Err(OciError::Unsupported("no layers".into()))
        }
        fn open_blob(&self, _: &Descriptor) -> Result<Box<dyn Read + Send + '_>, OciError> {
            self.fetches.fetch_add(1, Ordering::Relaxed);
            Ok(Box::new(&self.compressed[..]))
        }
    }

    #[test]
    fn a_cached_layer_is_trusted_by_its_record_only() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("meta/x.erofs");
        let raw = b"metadata bytes".repeat(100);
        let (source, desc) = OneLayer::new(&raw);
        let fetches = || source.fetches.load(Ordering::Relaxed);
        let get = || cached_layer(&source, &desc, "metadata", &path, Record::Now).unwrap();

        assert_eq!(get(), raw);
        assert_eq!(fetches(), 1);
        let record = lamina_fetch::store::whole_record_path(&path);
        assert!(record.is_file(), "stored without a record");
        assert_eq!(get(), raw, "a recorded copy");
        assert_eq!(fetches(), 1, "a recorded copy was fetched again");

        // From before records: hashed, then recorded.
        fs::remove_file(&record).unwrap();
        assert_eq!(get(), raw);
        assert_eq!(fetches(), 1, "a good copy without a record was fetched");
        assert!(record.is_file(), "the good copy was not recorded");

        // Replaced by other bytes: the record does not describe the new
        // file, whose bytes do not hash right, so it is fetched again.
        let tmp = dir.path().join("meta/replacement");
        fs::write(&tmp, b"wrong bytes").unwrap();
        fs::rename(&tmp, &path).unwrap();
        assert_eq!(get(), raw);
        assert_eq!(fetches(), 2, "a replaced copy was trusted");

        // Another layer's record at this path does not count either.
        let (other, other_desc) = OneLayer::new(b"other layer");
        let bytes = cached_layer(&other, &other_desc, "metadata", &path, Record::Now).unwrap();
        assert_eq!(bytes, b"other layer");
        assert_eq!(other.fetches.load(Ordering::Relaxed), 1);
    }

    /// A layer file a lazy mount writes (recorded later, by its worker) is
    /// the layer's content whatever its content-digest annotation says, but
    /// only a file that hashes to the annotation is ever recorded; a file
    /// left unrecorded is not trusted by a mount that records at once.
    #[test]
    fn a_layer_file_recorded_later_is_trusted_once_it_hashes_right() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("meta/x.erofs");
        let record = lamina_fetch::store::whole_record_path(&path);
        let raw: Vec<u8> = (0..3_000_000u32).map(|i| (i % 253) as u8).collect();
        let (source, desc) = OneLayer::framed(&raw, 1 << 20);
        let fetches = || source.fetches.load(Ordering::Relaxed);
        let mut lying = desc.clone();
        let other = lamina_oci::sha256(b"other");
        lying.annotations.insert(
            artifact::ANNOTATION_UNCOMPRESSED_DIGEST.into(),
            format!("sha256:{}", hex::encode(other)),
        );

        cache_layer_file(&source, &lying, "metadata", &path, false, Record::Later).unwrap();
        assert!(fs::read(&path).unwrap() == raw, "not the layer's content");
        assert!(!record.exists(), "recorded by the mount");
        assert!(!lamina_fetch::store::adopt_whole(&path, &other).unwrap());
        assert!(!record.exists(), "recorded against a wrong digest");
        let err = cache_layer_file(&source, &lying, "metadata", &path, false, Record::Now);
        assert!(err.unwrap_err().to_string().contains("does not match"));
        assert_eq!(fetches(), 2);

        fs::remove_file(&path).unwrap();
        cache_layer_file(&source, &desc, "metadata", &path, false, Record::Later).unwrap();
        assert!(!record.exists(), "recorded by the mount");
        let content = lamina_oci::sha256(&raw);
        assert!(lamina_fetch::store::adopt_whole(&path, &content).unwrap());
        assert!(record.is_file(), "not recorded once it hashed right");
        cache_layer_file(&source, &desc, "metadata", &path, false, Record::Now).unwrap();
        assert_eq!(fetches(), 3, "a recorded copy was fetched again");
    }
}
