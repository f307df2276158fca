//! Mounting a lamina image with the kernel: the metadata image as a
//! file-backed EROFS, each data blob's cache file as one `device=`.
//!
//! util-linux's `mount` would wrap the image in a loop device, after which the
//! kernel refuses file paths as `device=`; calling mount(2) on the regular
//! file keeps EROFS in file-backed mode, where `device=` takes files too.

use std::fs;
use std::path::{Path, PathBuf};

use lamina_format::index::{BlobSummary, ChunkIndex, IndexBlob};
use lamina_image::artifact::{self, ArtifactError, LaminaLayers};
use lamina_oci::{open_source, ImageRef};
use rustix::mount::UnmountFlags;

use crate::cache::{materialize_blob, materialize_paged_blob};
use crate::common::{io_err, MountError, MountInfo, MountOptions};
use crate::layers::{cache_layer_file, cached_lookup, Record};
use lamina_fetch::store::{BlobStore, EntryKey};

/// Mounts `image` (read-only) at `mountpoint`, filling the cache first.
pub fn mount_image(
    image: &ImageRef,
    mountpoint: &Path,
    opts: &MountOptions,
) -> Result<MountInfo, MountError> {
    let mut borrowed = crate::borrow::Borrowed::default();
    let borrow = opts.share_files.then_some(&mut borrowed);
    let info = fill_cache_borrowing(image, mountpoint, opts, false, borrow)?;
    crate::layers::check_metadata(&info.metadata_path)?;
    lamina_daemon::holder::device_options(info.blob_paths.iter().map(PathBuf::as_path))
        .map_err(MountError::BadCachePath)?;
    if opts.share_files && info.index_path.is_none() {
        tracing::warn!("{image}: a tar index mount does not share files yet; not shared");
    } else if opts.share_files {
        let dirs = crate::common::DomainDirs::of(opts, image);
        crate::shared::mount_view(&info, opts, &dirs.shards, &borrowed)?;
        record_eager(opts, &info);
        return Ok(info);
    }
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
// Over 100 lines: index, metadata, lookup table and blobs, in the order a mount needs them.
pub(crate) fn fill_cache(
    image: &ImageRef,
    mountpoint: &Path,
    opts: &MountOptions,
    lookup: bool,
) -> Result<MountInfo, MountError> {
    fill_cache_borrowing(image, mountpoint, opts, lookup, None)
}

/// [`fill_cache`]; with `borrow` (a `--share-files` mount, which reads
/// blobs only through its shard), chunks that other images' complete
/// cache files hold are borrowed from them, not copied.
fn fill_cache_borrowing(
    image: &ImageRef,
    mountpoint: &Path,
    opts: &MountOptions,
    lookup: bool,
    mut borrow: Option<&mut crate::borrow::Borrowed>,
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
                    image,
                    mountpoint,
                    opts,
                    lookup,
                ),
                None => Err(crate::tar_index::not_indexed(image, &why)),
            };
        }
        Err(e) => return Err(e.into()),
    };
    let dirs = crate::common::DomainDirs::of(opts, image);
    let meta_dir = &dirs.meta;
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
        true => cached_lookup(source.as_ref(), &layers, meta_dir, Record::Now)?,
        false => None,
    };

    // Complete only if a fill record bound to the cache file says so: a
    // lazy mount's sparse file has the full length too.
    let blob_dir = &dirs.blobs;
    let keys = entry_keys(&table, &index_path, &layers)?;
    let mut missing = Vec::new();
    let mut blob_paths = Vec::new();
    for (i, (blob, key)) in table.iter().zip(&keys).enumerate() {
        let (path, _) = lamina_fetch::store::store_paths(blob_dir, key);
        if !BlobStore::recorded_complete(blob_dir, key, blob).map_err(io_err(&path))? {
            missing.push(i);
        }
        blob_paths.push(path);
    }
    let mut fetched = 0;
    if !missing.is_empty() {
        let index_bytes = fs::read(&index_path).map_err(io_err(&index_path))?;
        let index = artifact::parse_index(&index_bytes, &layers)?;
        let locator = lamina_fetch::locator::ChunkLocator::open(blob_dir).ok();
        let on_node = locator.as_ref().filter(|l| l.may_hold_any());
        // A source that cannot read a table alone: that blob fetched whole.
        // Each table is had once (the packed ranges' walk wants them all).
        let tables: Vec<std::cell::OnceCell<Option<IndexBlob>>> =
            (0..table.len()).map(|_| Default::default()).collect();
        let table = |i: usize| {
            let cell = tables.get(i)?;
            cell.get_or_init(|| match index.inline.get(i) {
                Some(blob) => Some(blob.clone()),
                None => {
                    let (desc, summary) = (&layers.blobs[i], &index.blobs[i]);
                    let bits = index.chunk_bits;
                    crate::shared::chunk_table(source.as_ref(), desc, summary, bits, blob_dir)
                        .inspect_err(|e| tracing::debug!("{}: {e}", desc.digest))
                        .ok()
                }
            })
            .clone()
        };
        let packed = match (on_node, &borrow) {
            (Some(_), Some(_)) => crate::borrow::packed_ranges(&meta_path, &table),
            _ => Default::default(),
        };
        for i in missing {
            let (desc, path) = (&layers.blobs[i], &blob_paths[i]);
            // The node's chunks, borrowed (--share-files) or copied.
            if let Some(locator) = on_node {
                let device = u16::try_from(i + 1).expect("the index bounds its blobs");
                let open = || source.open_blob(desc);
                let filled = match (table(i), borrow.as_deref_mut()) {
                    (None, _) => None,
                    (Some(table), Some(borrowed)) => {
                        let packed = packed.get(&device).map_or(&[][..], Vec::as_slice);
                        let blob = crate::borrow::BlobToFill {
                            device,
                            table,
                            packed,
                        };
                        borrowed.fill(locator, blob, blob_dir, open)?
                    }
                    (Some(table), None) => crate::cache::fill_from_node::<_, _, MountError>(
                        locator, table, blob_dir, open,
                    )?,
                };
                if let Some(read) = filled {
                    fetched += read;
                    continue;
                }
            }
            let reader = source.open_blob(desc)?;
            let (file, blob) = match index.inline.get(i) {
                Some(blob) => (materialize_blob(path, blob, reader)?, blob.clone()),
                None => materialize_paged_blob(path, &index.blobs[i], index.chunk_bits, reader)?,
            };
            BlobStore::record_complete(blob_dir, &blob, &file).map_err(io_err(path))?;
            if let Some(locator) = &locator {
                crate::cache::note_chunks(locator, &blob, None);
            }
            fetched += desc.size;
        }
    }
    Ok(MountInfo {
        mountpoint: mountpoint.to_path_buf(),
        manifest_digest: img.manifest_digest.to_string(),
        metadata_path: meta_path,
        blob_paths,
        index_path: Some(index_path),
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
    let run = crate::common::run_dir(&opts.cache_dir, &info.mountpoint);
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
