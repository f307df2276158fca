//! Files shared across images on the kernel path (`lamina mount
//! --share-files`, issue 43): the mount is an overlayfs of the image's
//! metadata view over shards of content-addressed objects
//! ([`lamina_format::shard`]), so images on one base, and an image and its
//! rebuild, read each file with the same bytes through one inode and one
//! page cache.
//!
//! Layout, per trust domain (`shards/<domain>/`, private):
//!
//! ```text
//! .lock                  held while a view is put together or taken apart
//! <id>/shard.erofs       the shard (id: its sha256, 32 hex)
//! <id>/objects           its fingerprints
//! <id>/blobs.json        the cache files it reads (its EROFS devices)
//! <id>/mnt/              where it is mounted, once, for every view
//! ```
//!
//! A view's own files are in its run dir: `view.erofs`, mounted at `view/`,
//! and `view.json` (the shards it stacks). A shard of an eager mount reads
//! complete, verified cache files; a lazy mount's holder mounts its shard
//! (`holder` names its run dir) and answers its reads for as long as the
//! shard's superblock lives. So any mounted shard of the domain may serve
//! another image: its objects' names are fingerprints this node computed
//! from verified chunk tables, never names an image gave.
//! A view stacks the domain's shards that hold its objects, oldest first,
//! its own last; overlayfs takes a file's data from the first that has its
//! name, so each content is read through the first shard that held it.
//! A shard's devices are the image's cache files and, after them, other
//! images' complete cache files it borrows chunks and packed files from
//! ([`Borrowed`]), so the node keeps one copy of them, not one per image.

use std::collections::{HashMap, HashSet};
use std::fs;
use std::os::unix::ffi::OsStringExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use lamina_fetch::locator::ChunkLocator;
use lamina_fetch::private;
use lamina_fetch::store::EntryKey;
use lamina_format::erofs::Image;
use lamina_format::index::{ChunkIndex, IndexBlob};
use lamina_format::locate::ContentRange;
use lamina_format::shard::{self, Fingerprint};
use rustix::mount::UnmountFlags;
use serde::{Deserialize, Serialize};

use lamina_daemon::config::{DaemonConfig, Privileges};
use lamina_format::index::IndexTop;
use lamina_image::artifact::LaminaLayers;
use lamina_oci::ImageSource;

use crate::borrow::{too_many, Borrowed};
use crate::common::{io_err, MountError, MountInfo, MountOptions};
use crate::mode::Mode;

/// Most other shards one view stacks (overlayfs takes 500 layers).
const MAX_OTHER_SHARDS: usize = 64;

/// What a view stacks, for its unmount (`view.json` in its run dir).
#[derive(Debug, Serialize, Deserialize)]
struct ViewRecord {
    /// `shards/<domain>`.
    shards_dir: PathBuf,
    /// The shards, in stacking order (its own last).
    shards: Vec<String>,
}

/// Mounts `info`'s image (complete in the cache) at `info.mountpoint` as a
/// read-only overlayfs of its metadata view over the domain's shards.
pub(crate) fn mount_view(
    info: &MountInfo,
    opts: &MountOptions,
    shards_dir: &Path,
    borrowed: &Borrowed,
) -> Result<(), MountError> {
    let moved = borrowed.moved(info.blob_paths.len())?;
    // The image's cache files and the borrowed ones, opened once: the
    // shard mounts the very files its objects were named from.
    let mut devices = info
        .blob_paths
        .iter()
        .map(|p| private::open_trusted(p).map_err(io_err(p)))
        .collect::<Result<Vec<_>, _>>()?;
    for (path, file) in &borrowed.files {
        devices.push(file.try_clone().map_err(io_err(path))?);
    }
    let split = split_image(info, &devices, &moved)?;
    private::private_dir(shards_dir).map_err(io_err(shards_dir))?;
    let _lock = lock(shards_dir)?;
    let own = shard_id(&split);
    let dir = shards_dir.join(&own);
    let fresh = !is_mounted(&dir.join("mnt"));
    if fresh {
        let mut paths = info.blob_paths.clone();
        paths.extend(borrowed.files.iter().map(|(p, _)| p.clone()));
        write_shard(&dir, &split, &paths)?;
        let devices: Vec<PathBuf> = devices.iter().map(lamina_sys::fd_path).collect();
        let devices: Vec<&Path> = devices.iter().map(PathBuf::as_path).collect();
        // Objects are plain files: no xattrs, setuid bits or devices.
        let file = dir.join("shard.erofs");
        mount_erofs(
            &file,
            &dir.join("mnt"),
            &devices,
            false,
            Privileges::default(),
        )?;
    }
    let run = crate::common::run_dir(&opts.cache_dir, &info.mountpoint);
    let view = View {
        run: &run,
        mountpoint: &info.mountpoint,
        xattrs: info.xattrs,
        privileges: opts.privileges,
    };
    let (others, _) = other_shards(shards_dir, &own, &split.objects);
    stack_view(view, &split, shards_dir, (others, own)).inspect_err(|_| {
        if fresh {
            drop_shard(&dir);
        }
    })
}

/// Takes down a shard this mount made when its view could not be made:
/// under the lock, so no other view stacked it meanwhile.
fn drop_shard(dir: &Path) {
    if rustix::mount::unmount(dir.join("mnt"), UnmountFlags::DETACH).is_ok() {
        let _ = fs::remove_dir_all(dir);
    }
}

/// What a lazy mount has found when its view is to be made.
pub(crate) struct LazyView<'a> {
    /// The image's source, for the chunk tables not in the cache.
    pub src: &'a dyn ImageSource,
    /// Its layers.
    pub layers: &'a LaminaLayers,
    /// Its verified index.
    pub index: &'a IndexTop,
    /// The mount's run dir.
    pub run: &'a Path,
}

/// A lazy mount with `--share-files`: its view over the domain's shards.
/// The image's own shard is mounted by the mount's holder, which lives as
/// long as the shard's superblock (as long as any view stacks it), so a
/// read of it that finds no data is always answered; when that shard is
/// mounted already (by another mount of the image, lazy or eager), it is
/// stacked as it is and no daemon starts.
pub(crate) fn mount_lazy_view(
    lazy: LazyView<'_>,
    mut config: DaemonConfig,
    opts: &MountOptions,
    shards_dir: &Path,
) -> Result<MountInfo, MountError> {
    crate::layers::check_metadata(&config.metadata_path)?;
    let blob_paths: Vec<PathBuf> = config.blobs.iter().map(|b| b.cache_path.clone()).collect();
    let tables = lazy_tables(&lazy, &config.blob_dir)?;
    let mut borrowed = Borrowed::default();
    if let Ok(locator) = ChunkLocator::open(&config.blob_dir) {
        for (i, (table, spec)) in tables.iter().zip(&mut config.blobs).enumerate() {
            if !spec.complete && locator.may_hold_any() {
                let device = u16::try_from(i + 1).map_err(|_| too_many())?;
                spec.served_elsewhere = borrowed.borrow(&locator, device, table)?;
            }
        }
    }
    let moved = borrowed.moved(tables.len())?;
    // Packed files are named by their packs: their bytes are not here yet.
    let split = split_with(&config.metadata_path, &tables, &moved, &mut |_, _, _| {
        Ok(None)
    })?;
    private::private_dir(shards_dir).map_err(io_err(shards_dir))?;
    let _lock = lock(shards_dir)?;
    let own = shard_id(&split);
    let dir = shards_dir.join(&own);
    let mountpoint = config.mountpoint.clone();
    let mut info = MountInfo {
        mountpoint: mountpoint.clone(),
        manifest_digest: config.manifest_digest.clone(),
        metadata_path: config.metadata_path.clone(),
        blob_paths: blob_paths.clone(),
        index_path: None,
        lookup_path: None,
        xattrs: config.xattrs,
        fetched_bytes: 0,
    };
    let fresh = !is_mounted(&dir.join("mnt"));
    let (others, elsewhere) = other_shards(shards_dir, &own, &split.objects);
    if fresh {
        let mut paths = blob_paths.clone();
        paths.extend(borrowed.files.iter().map(|(p, _)| p.clone()));
        write_shard(&dir, &split, &paths)?;
        config.borrowed = borrowed.specs()?;
        let shadowed = shadowed(&split, &elsewhere, &tables);
        for (spec, chunks) in config.blobs.iter_mut().zip(shadowed) {
            spec.served_elsewhere.extend(chunks);
            spec.served_elsewhere.sort_unstable();
            spec.served_elsewhere.dedup();
        }
        // Who answers the shard's reads, for views of it that start none.
        let holder = dir.join("holder");
        private::write_atomic(&holder, lazy.run.as_os_str().as_encoded_bytes(), false)
            .map_err(io_err(&holder))?;
        config.mountpoint = dir.join("mnt");
        config.mount_metadata = Some(dir.join("shard.erofs"));
        let extras = crate::lazy::FuseExtras::default();
        info = crate::lazy::start_serving(&opts.cache_dir, &config, lazy.run, Mode::Kernel, extras)
            .map(|served| MountInfo {
                mountpoint: mountpoint.clone(),
                ..served
            })?;
    }
    let view = View {
        run: lazy.run,
        mountpoint: &mountpoint,
        xattrs: config.xattrs,
        privileges: opts.privileges,
    };
    // The holder leaves with the shard's superblock.
    stack_view(view, &split, shards_dir, (others, own)).inspect_err(|_| {
        if fresh {
            drop_shard(&dir);
        }
    })?;
    Ok(info)
}

/// Every blob's verified chunk table: in the index, kept in the cache, or
/// fetched now (one range request per blob) and kept.
fn lazy_tables(lazy: &LazyView<'_>, blob_dir: &Path) -> Result<Vec<IndexBlob>, MountError> {
    let index = lazy.index;
    let mut tables = Vec::with_capacity(index.blobs.len());
    for (i, summary) in index.blobs.iter().enumerate() {
        if let Some(blob) = index.inline.get(i) {
            tables.push(blob.clone());
            continue;
        }
        let desc = &lazy.layers.blobs[i];
        let table = chunk_table(lazy.src, desc, summary, index.chunk_bits, blob_dir);
        tables.push(table.map_err(|last| {
            MountError::Share(format!("the chunk table of blob {}: {last}", desc.digest))
        })?);
    }
    Ok(tables)
}

/// A paged blob's chunk table: kept in the cache, or read from the source
/// by range (once more on a failure: a transient fault costs a request,
/// not the mount), checked against its summary and then kept.
pub(crate) fn chunk_table(
    src: &dyn ImageSource,
    desc: &lamina_oci::Descriptor,
    summary: &lamina_format::index::BlobSummary,
    chunk_bits: u8,
    blob_dir: &Path,
) -> Result<IndexBlob, String> {
    if let Ok(Some(table)) = lamina_fetch::store::load_table(blob_dir, summary, chunk_bits) {
        return Ok(table);
    }
    let (at, len) = summary
        .table_range()
        .ok_or_else(|| format!("blob {} has no chunk table", hex::encode(summary.digest)))?;
    let mut last = String::new();
    for _ in 0..2 {
        match src.read_blob_range(desc, at, len) {
            Ok(Some(bytes)) => match IndexBlob::from_table(summary, chunk_bits, &bytes) {
                Ok(table) => {
                    let _ = lamina_fetch::store::save_table(blob_dir, summary, &bytes);
                    return Ok(table);
                }
                Err(e) => last = e.to_string(),
            },
            Ok(None) => last = "the source reads blobs whole only".into(),
            Err(e) => last = e.to_string(),
        }
    }
    Err(last)
}

/// A shard's id: its bytes' sha256, 32 hex digits.
fn shard_id(split: &shard::Split) -> String {
    hex::encode(&lamina_oci::sha256(&split.shard)[..16])
}

/// Writes a shard's files in `dir`, made if need be: the EROFS, its
/// objects list and the cache files it reads.
fn write_shard(dir: &Path, split: &shard::Split, blob_paths: &[PathBuf]) -> Result<(), MountError> {
    make_dir(dir)?;
    make_dir(&dir.join("mnt"))?;
    let file = dir.join("shard.erofs");
    private::write_atomic(&file, &split.shard, false).map_err(io_err(&file))?;
    let objects = dir.join("objects");
    private::write_atomic(&objects, &shard::objects_bytes(&split.objects), false)
        .map_err(io_err(&objects))?;
    let blobs = dir.join("blobs.json");
    let bytes = serde_json::to_vec(blob_paths).map_err(|e| io_err(&blobs)(e.into()))?;
    private::write_atomic(&blobs, &bytes, false).map_err(io_err(&blobs))
}

/// Where and how a view is mounted.
struct View<'a> {
    run: &'a Path,
    mountpoint: &'a Path,
    xattrs: bool,
    privileges: Privileges,
}

/// Mounts the metadata view of `split` in the run dir and the overlayfs at
/// the mountpoint: the view over the domain's other shards that hold its
/// objects, then `own`.
fn stack_view(
    view: View<'_>,
    split: &shard::Split,
    shards_dir: &Path,
    (others, own): (Vec<String>, String),
) -> Result<(), MountError> {
    let mut order = others;
    order.push(own);
    let run = view.run;
    private::private_dir(run).map_err(io_err(run))?;
    let view_file = run.join("view.erofs");
    private::write_atomic(&view_file, &split.view, false).map_err(io_err(&view_file))?;
    let view_mnt = run.join("view");
    make_dir(&view_mnt)?;
    mount_erofs(&view_file, &view_mnt, &[], view.xattrs, view.privileges)?;
    let undo = || {
        let _ = rustix::mount::unmount(&view_mnt, UnmountFlags::DETACH);
        let _ = fs::remove_file(run.join("view.json"));
    };
    let record = ViewRecord {
        shards_dir: shards_dir.to_path_buf(),
        shards: order.clone(),
    };
    let record_path = run.join("view.json");
    let bytes = serde_json::to_vec(&record).map_err(|e| io_err(&record_path)(e.into()))?;
    private::write_atomic(&record_path, &bytes, false)
        .map_err(io_err(&record_path))
        .inspect_err(|_| undo())?;
    let data: Vec<PathBuf> = order
        .iter()
        .map(|id| shards_dir.join(id).join("mnt"))
        .collect();
    mount_overlay(&view_mnt, &data, view.mountpoint, view.privileges).inspect_err(|_| undo())
}

/// The image's metadata view and shard, from its metadata and the chunk
/// tables the mount verified; `files` are the shard's devices in order
/// (the image's cache files, then the borrowed ones).
fn split_image(
    info: &MountInfo,
    files: &[fs::File],
    moved: &shard::Moved,
) -> Result<shard::Split, MountError> {
    let index_path = info.index_path.as_ref().ok_or_else(|| {
        MountError::Share("needs a lamina image (a tar index mount cannot share yet)".into())
    })?;
    let index_bytes = fs::read(index_path).map_err(io_err(index_path))?;
    let index = ChunkIndex::parse_top(&index_bytes)
        .map_err(|e| MountError::Share(format!("{}: {e}", index_path.display())))?;
    let mut tables: Vec<IndexBlob> = Vec::with_capacity(index.blobs.len());
    for (i, summary) in index.blobs.iter().enumerate() {
        if let Some(blob) = index.inline.get(i) {
            tables.push(blob.clone());
            continue;
        }
        let dir = info.blob_paths[i].parent().unwrap_or(Path::new("."));
        let table = lamina_fetch::store::load_table(dir, summary, index.chunk_bits)
            .map_err(io_err(dir))?
            .ok_or_else(|| {
                MountError::Share(format!(
                    "the chunk table of blob {} is not in the cache",
                    hex::encode(summary.digest)
                ))
            })?;
        tables.push(table);
    }
    let mut read = |device: u16, offset: u64, len: usize| {
        let file = files
            .get(usize::from(device).wrapping_sub(1))
            .ok_or("no such device")?;
        let mut bytes = vec![0; len];
        std::os::unix::fs::FileExt::read_exact_at(file, &mut bytes, offset)
            .map_err(|e| format!("device {device} at {offset}: {e}"))?;
        Ok(Some(bytes))
    };
    let split = split_with(&info.metadata_path, &tables, moved, &mut read);
    // Packed files were read to be named: their pages are not the view's
    // (the shard reads with direct I/O), so they go.
    for file in files {
        let _ = rustix::fs::fadvise(file, 0, None, rustix::fs::Advice::DontNeed);
    }
    if let Ok(split) = &split {
        note_named(info, &index, &tables, &split.named);
    }
    split
}

/// Notes in the chunk locator where the packed files named by their bytes
/// lie in the image's complete cache files (their named ranges lists), so
/// that an image whose packs changed around them finds them by content
/// ([`Borrowed`]).
fn note_named(
    info: &MountInfo,
    index: &lamina_format::index::IndexTop,
    tables: &[IndexBlob],
    named: &[shard::NamedRange],
) {
    let Some(dir) = info.blob_paths.first().and_then(|p| p.parent()) else {
        return;
    };
    let Ok(locator) = ChunkLocator::open(dir) else {
        return;
    };
    for (i, (table, summary)) in tables.iter().zip(&index.blobs).enumerate() {
        let key = EntryKey::of(table);
        let on_device = |n: &&shard::NamedRange| usize::from(n.device) == i + 1;
        let ranges: Vec<ContentRange> = named
            .iter()
            .filter(on_device)
            .map(|n| ContentRange {
                offset: n.offset,
                len: n.len,
                sha256: n.sha256,
            })
            .collect();
        let spans: Vec<(u64, u64)> = ranges.iter().map(|r| (r.offset, r.len)).collect();
        let apart = lamina_format::locate::apart(&spans);
        let ranges: Vec<ContentRange> = (ranges.into_iter().zip(apart))
            .filter_map(|(range, apart)| apart.then_some(range))
            .collect();
        let complete = || {
            lamina_fetch::store::BlobStore::recorded_complete(dir, &key, summary).unwrap_or(false)
        };
        if !ranges.is_empty() && complete() {
            locator.note_named(&key, &ranges);
        }
    }
}

/// [`shard::split`] of the metadata at `path`.
fn split_with(
    path: &Path,
    tables: &[IndexBlob],
    moved: &shard::Moved,
    read: &mut shard::ReadDevice<'_>,
) -> Result<shard::Split, MountError> {
    let meta = fs::read(path).map_err(io_err(path))?;
    let image =
        Image::new(&meta).map_err(|e| MountError::Share(format!("{}: {e}", path.display())))?;
    shard::split(&image, tables, moved, read)
        .map_err(|e| MountError::Share(format!("{}: {e}", path.display())))
}

/// The domain's other mounted shards that hold any of `objects`, oldest
/// first: a file's data then comes from the shard that first held it,
/// whichever view reads it, so every view of it shares one inode (had
/// each view preferred the shard it shares most with, an image and its
/// rebuild could each take the base from a different image's shard).
/// Each list is read once: with the shards' ids come the objects of
/// `objects` they hold (what a view of them takes from those shards).
fn other_shards(
    shards_dir: &Path,
    own: &str,
    objects: &[Fingerprint],
) -> (Vec<String>, HashSet<Fingerprint>) {
    let mut found: Vec<(std::time::SystemTime, String, Vec<Fingerprint>)> = Vec::new();
    let Ok(dir) = fs::read_dir(shards_dir) else {
        return Default::default();
    };
    for entry in dir.flatten() {
        let id = entry.file_name().to_string_lossy().into_owned();
        if id == own || id.starts_with('.') || !is_mounted(&entry.path().join("mnt")) {
            continue;
        }
        let list = entry.path().join("objects");
        let Some((theirs, made)) = fs::read(&list)
            .ok()
            .and_then(|b| shard::parse_objects(&b))
            .zip(fs::metadata(&list).and_then(|m| m.modified()).ok())
        else {
            continue;
        };
        let shared = common(objects, &theirs);
        if !shared.is_empty() {
            found.push((made, id, shared));
        }
    }
    found.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
    found.truncate(MAX_OTHER_SHARDS);
    let elsewhere = found.iter().flat_map(|f| f.2.iter().copied()).collect();
    (found.into_iter().map(|(_, id, _)| id).collect(), elsewhere)
}

/// Per blob of `tables`, the chunks (indexes) that only objects in
/// `elsewhere` read through `split`'s shard: a view stacking the shards
/// that hold those takes them from there, so they are never read here.
fn shadowed(
    split: &shard::Split,
    elsewhere: &HashSet<Fingerprint>,
    tables: &[IndexBlob],
) -> Vec<Vec<u32>> {
    // (device, chunk start) → whether every object reading it is elsewhere.
    let mut only_elsewhere: HashMap<(u16, u64), bool> = HashMap::new();
    for (fp, device, start) in &split.reads {
        *only_elsewhere.entry((*device, *start)).or_insert(true) &= elsewhere.contains(fp);
    }
    let mut out = vec![Vec::new(); tables.len()];
    for ((device, start), _) in only_elsewhere.into_iter().filter(|(_, only)| *only) {
        let Some(table) = tables.get(usize::from(device).wrapping_sub(1)) else {
            continue;
        };
        let found = table
            .chunks
            .binary_search_by_key(&start, |c| c.cache_offset.get());
        if let Ok(i) = found {
            out[usize::from(device) - 1].extend(u32::try_from(i));
        }
    }
    out.iter_mut().for_each(|chunks| chunks.sort_unstable());
    out
}

/// The fingerprints two sorted lists have in common.
fn common(a: &[Fingerprint], b: &[Fingerprint]) -> Vec<Fingerprint> {
    let (mut i, mut j, mut out) = (0, 0, Vec::new());
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => {
                out.push(a[i]);
                (i, j) = (i + 1, j + 1);
            }
        }
    }
    out
}

/// After the view at the mount whose run dir is `run` was unmounted: its
/// metadata view goes, and each shard no other view stacks. Whether the
/// view's own shard stays (another view stacks it; a lazy mount's holder
/// then serves it on).
pub(crate) fn finish_view(cache_dir: &Path, run: &Path) -> bool {
    let Some(record) = fs::read(run.join("view.json"))
        .ok()
        .and_then(|b| serde_json::from_slice::<ViewRecord>(&b).ok())
    else {
        return false;
    };
    let _ = rustix::mount::unmount(run.join("view"), UnmountFlags::DETACH);
    let _ = fs::remove_file(run.join("view.json"));
    let Ok(_lock) = lock(&record.shards_dir) else {
        return true;
    };
    let used = shards_in_use(cache_dir, run);
    for id in &record.shards {
        if used.contains(id) {
            continue;
        }
        let dir = record.shards_dir.join(id);
        // A view still mounted keeps the shard's filesystem alive through
        // overlayfs's own reference; this only stops new views finding it.
        if rustix::mount::unmount(dir.join("mnt"), UnmountFlags::DETACH).is_ok() {
            let _ = fs::remove_dir_all(&dir);
        }
    }
    record.shards.last().is_some_and(|own| used.contains(own))
}

/// Whether the view whose run dir is `run` is served: each shard it
/// stacks is mounted, and one a lazy mount's holder mounted has that
/// holder alive (its `ready` names a live lamina daemon). False when `run`
/// holds no view.
pub(crate) fn view_served(run: &Path) -> bool {
    let Some(record) = fs::read(run.join("view.json"))
        .ok()
        .and_then(|b| serde_json::from_slice::<ViewRecord>(&b).ok())
    else {
        return false;
    };
    record.shards.iter().all(|id| {
        let dir = record.shards_dir.join(id);
        if !is_mounted(&dir.join("mnt")) {
            return false;
        }
        let Ok(holder_run) = fs::read(dir.join("holder")) else {
            return true; // an eager mount's: complete cache files
        };
        crate::lazy::daemon_serves(&PathBuf::from(std::ffi::OsString::from_vec(holder_run)))
    })
}

/// The shards every view but the one in `except` stacks.
fn shards_in_use(cache_dir: &Path, except: &Path) -> std::collections::HashSet<String> {
    let mut used = std::collections::HashSet::new();
    let Ok(dir) = fs::read_dir(cache_dir.join("mounts")) else {
        return used;
    };
    for entry in dir.flatten() {
        if entry.path() == except {
            continue;
        }
        if let Some(record) = fs::read(entry.path().join("view.json"))
            .ok()
            .and_then(|b| serde_json::from_slice::<ViewRecord>(&b).ok())
        {
            used.extend(record.shards);
        }
    }
    used
}

/// The cache files of the domain shards that are mounted (for gc).
pub(crate) fn shard_files(cache_dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let Ok(domains) = fs::read_dir(cache_dir.join("shards")) else {
        return files;
    };
    for domain in domains.flatten() {
        let Ok(shards) = fs::read_dir(domain.path()) else {
            continue;
        };
        for shard in shards.flatten() {
            if !is_mounted(&shard.path().join("mnt")) {
                continue;
            }
            if let Some(blobs) = fs::read(shard.path().join("blobs.json"))
                .ok()
                .and_then(|b| serde_json::from_slice::<Vec<PathBuf>>(&b).ok())
            {
                files.extend(blobs);
                files.push(shard.path().join("shard.erofs"));
            }
        }
    }
    files
}

/// Whether `path` is a mount's root (its device is not its parent's).
fn is_mounted(path: &Path) -> bool {
    let parent = path.parent().unwrap_or(Path::new("/"));
    match (fs::symlink_metadata(path), fs::symlink_metadata(parent)) {
        (Ok(m), Ok(p)) => m.is_dir() && m.dev() != p.dev(),
        _ => false,
    }
}

fn make_dir(path: &Path) -> Result<(), MountError> {
    match fs::create_dir(path) {
        Ok(()) => private::private_dir(path).map_err(io_err(path)),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(io_err(path)(e)),
    }
}

fn lock(shards_dir: &Path) -> Result<fs::File, MountError> {
    let path = shards_dir.join(".lock");
    let file = match private::create_new(&path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            private::open_existing(&path).map_err(io_err(&path))?
        }
        Err(e) => return Err(io_err(&path)(e)),
    };
    rustix::fs::flock(&file, rustix::fs::FlockOperation::LockExclusive)
        .map_err(|e| io_err(&path)(e.into()))?;
    Ok(file)
}

fn mount_erofs(
    file: &Path,
    mountpoint: &Path,
    devices: &[&Path],
    acl: bool,
    privileges: Privileges,
) -> Result<(), MountError> {
    lamina_daemon::holder::mount_erofs(&lamina_daemon::holder::ErofsMount {
        metadata: file,
        mountpoint,
        devices,
        acl,
        privileges,
        // Complete before the mount: read with direct I/O, cached once.
        direct: true,
    })
    .map_err(|errno| MountError::Syscall {
        op: "mount",
        path: mountpoint.to_path_buf(),
        errno,
        hint: "",
    })
}

/// `overlay` with `view` as its one lower and `data` as data-only lowers
/// (Linux 6.8+: fsconfig's `lowerdir+` and `datadir+`), read-only.
fn mount_overlay(
    view: &Path,
    data: &[PathBuf],
    mountpoint: &Path,
    privileges: Privileges,
) -> Result<(), MountError> {
    use rustix::mount::{
        fsconfig_create, fsconfig_set_string, fsmount, fsopen, move_mount, FsMountFlags,
        FsOpenFlags, MountAttrFlags, MoveMountFlags,
    };
    let fail = |errno| MountError::Syscall {
        op: "mount overlay",
        path: mountpoint.to_path_buf(),
        errno,
        hint: " (--share-files needs overlayfs with data-only lower layers: Linux 6.8 or later)",
    };
    let fs = fsopen("overlay", FsOpenFlags::FSOPEN_CLOEXEC).map_err(fail)?;
    fsconfig_set_string(&fs, "lowerdir+", view).map_err(fail)?;
    for dir in data {
        fsconfig_set_string(&fs, "datadir+", dir).map_err(fail)?;
    }
    fsconfig_set_string(&fs, "metacopy", "on").map_err(fail)?;
    fsconfig_set_string(&fs, "redirect_dir", "follow").map_err(fail)?;
    fsconfig_create(&fs).map_err(fail)?;
    let mut attrs = MountAttrFlags::MOUNT_ATTR_RDONLY;
    if !privileges.suid {
        attrs |= MountAttrFlags::MOUNT_ATTR_NOSUID;
    }
    if !privileges.dev {
        attrs |= MountAttrFlags::MOUNT_ATTR_NODEV;
    }
    let mnt = fsmount(&fs, FsMountFlags::FSMOUNT_CLOEXEC, attrs).map_err(fail)?;
    move_mount(
        &mnt,
        "",
        rustix::fs::CWD,
        mountpoint,
        MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
    )
    .map_err(fail)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn common_lists_shared_fingerprints() {
        let fp = |b: u8| [b; 32];
        assert_eq!(
            common(&[fp(1), fp(3), fp(5)], &[fp(2), fp(3), fp(5)]),
            vec![fp(3), fp(5)]
        );
        assert!(common(&[], &[fp(1)]).is_empty());
    }

    /// A chunk is shadowed only when every object reading it is served
    /// by another shard.
    #[test]
    fn chunks_only_other_shards_serve_are_shadowed() {
        use lamina_format::index::ChunkEntry;
        let fp = |b: u8| [b; 32];
        let entry = |block: u64| ChunkEntry {
            cache_offset: (block * 4096).into(),
            compressed_offset: (block * 100).into(),
            compressed_size: 4096.into(),
            size: 4096.into(),
            flags: 0.into(),
            reserved: 0.into(),
            digest: [block as u8; 32],
        };
        let table = IndexBlob {
            digest: [9; 32],
            compressed_size: 300,
            cache_size: 3 * 4096,
            chunks: vec![entry(0), entry(1), entry(2)],
        };
        // Chunk 0: objects 1 and 2; chunk 1: object 3; chunk 2: object 1.
        let split = shard::Split {
            view: Vec::new(),
            shard: Vec::new(),
            objects: vec![fp(1), fp(2), fp(3)],
            named: Vec::new(),
            reads: vec![
                (fp(1), 1, 0),
                (fp(1), 1, 8192),
                (fp(2), 1, 0),
                (fp(3), 1, 4096),
            ],
        };
        let elsewhere = HashSet::from([fp(1), fp(3)]);
        assert_eq!(
            shadowed(&split, &elsewhere, std::slice::from_ref(&table)),
            vec![vec![1, 2]]
        );
        let none = HashSet::new();
        assert_eq!(shadowed(&split, &none, &[table]), vec![Vec::<u32>::new()]);
    }
}
