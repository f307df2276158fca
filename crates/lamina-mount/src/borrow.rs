//! Bytes a `--share-files` mount reads from other images' complete cache
//! files instead of keeping a copy in its own: whole stored chunks the
//! chunk locator finds by digest, and packed files (found by the sha256 of
//! their bytes) in packs that are new only because a neighbour changed.
//! Its own cache file keeps holes there, unrecorded: a mount that reads
//! the image's own files fetches them.

use std::collections::HashMap;
use std::fs;
use std::io::Read;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use lamina_fetch::locator::{ChunkLocator, Found};
use lamina_fetch::store::{BlobStore, EntryKey};
use lamina_format::index::IndexBlob;
use lamina_format::locate::{parse_ranges, ranges_bytes, ContentRange};
use lamina_format::shard;
use lamina_oci::sha256;

use crate::common::{io_err, MountError};

/// The block a borrowed range starts on, and that ends a skipped one.
const BLOCK: u64 = 4096;

/// What an eager `--share-files` mount borrows. Each file is opened before
/// its bytes are checked, and its shard mounts that very file
/// (`/proc/self/fd/N`), never a path that could have been replaced since.
#[derive(Debug, Default)]
pub(crate) struct Borrowed {
    /// (path, the file, opened).
    pub(crate) files: Vec<(PathBuf, Arc<fs::File>)>,
    /// (image device, stored chunk's cache offset) → (index in `files`,
    /// where the chunk starts there).
    chunks: HashMap<(u16, u64), (usize, u64)>,
    /// (image device, a packed file's cache offset, its length) → (index
    /// in `files`, where the same bytes start there).
    ranges: HashMap<(u16, u64, u64), (usize, u64)>,
}

/// What an earlier fill of a cache file skipped: its `.skipped` list and
/// the file, opened without a pre-content event (none when there are no
/// hints or it does not open).
struct Skipped<'a> {
    own: Option<&'a fs::File>,
    hints: &'a [ContentRange],
}

/// A blob an eager mount fills: its device in the image, its verified
/// chunk table and the packed files' ranges in it (offset, length, sorted).
pub(crate) struct BlobToFill<'a> {
    pub device: u16,
    pub table: IndexBlob,
    pub packed: &'a [(u64, u64)],
}

impl Borrowed {
    /// Fills `blob`'s cache file (in `blob_dir`) with what no other
    /// complete cache file of the domain holds, borrowing the rest. `None`
    /// when nothing can be borrowed (the caller fetches the blob whole, as
    /// ever); else the bytes of blob read from the source (`open`), 0 when
    /// every chunk was on the node.
    pub(crate) fn fill<R: Read>(
        &mut self,
        locator: &ChunkLocator,
        blob: BlobToFill<'_>,
        blob_dir: &Path,
        open: impl FnOnce() -> Result<R, lamina_oci::OciError>,
    ) -> Result<Option<u64>, MountError> {
        let BlobToFill {
            device,
            table,
            packed,
        } = blob;
        let mut found = crate::cache::find_chunks(locator, &table);
        if found.iter().all(Option::is_none) && packed.is_empty() {
            return Ok(None);
        }
        let mut store = crate::cache::quiet_store(blob_dir, table)?;
        found.iter().flatten().for_each(Found::drop_pages);
        let skipped_path = store.cache_path().with_extension("skipped");
        let hints = fs::read(&skipped_path)
            .ok()
            .and_then(|b| parse_ranges(&b))
            .unwrap_or_default();
        let blob = store.blob().clone();
        let open_chunks: Vec<usize> = (0..found.len()).filter(|&i| !store.is_filled(i)).collect();
        let (mut skipped, mut need) = (Vec::new(), Vec::new());
        // Opened once for every chunk the hints name (a pack each).
        let own = (!hints.is_empty())
            .then(|| lamina_sys::open_quiet(store.cache_file()).ok())
            .flatten();
        let earlier = Skipped {
            own: own.as_ref(),
            hints: &hints,
        };
        for &i in open_chunks.iter().filter(|&&i| found[i].is_none()) {
            match self.composed(locator, &store, (device, i), &earlier)? {
                Some(ranges) => skipped.extend(ranges),
                None => need.push(i),
            }
        }
        let mut read = 0;
        if !need.is_empty() {
            let reader = open()?;
            let packs = Packs { device, packed };
            skipped.extend(self.fill_skipping(locator, &mut store, &need, reader, packs)?);
            read = blob.compressed_size;
        }
        let mut filled = vec![false; found.len()];
        need.iter().for_each(|&i| filled[i] = store.is_filled(i));
        crate::cache::note_chunks(locator, &blob, Some(&filled));
        skipped.sort();
        save_skipped(&skipped_path, &skipped)?;
        for i in open_chunks {
            if let Some(at) = found[i].take() {
                let file = self.file_index(at.path, at.file)?;
                let start = blob.chunks[i].cache_offset.get();
                self.chunks.insert((device, start), (file, at.cache_offset));
            }
        }
        Ok(Some(read))
    }

    /// Fills chunks `need` from `reader` (the blob, streamed, each chunk
    /// verified), but for the packed files in them that the node holds
    /// elsewhere: those are borrowed, and their chunk is written without
    /// them and left unrecorded. Returns the ranges skipped.
    fn fill_skipping(
        &mut self,
        locator: &ChunkLocator,
        store: &mut BlobStore,
        need: &[usize],
        reader: impl Read,
        packs: Packs<'_>,
    ) -> Result<Vec<ContentRange>, MountError> {
        let blob = store.blob().clone();
        let key = EntryKey::of(&blob);
        let path = store.cache_path().to_path_buf();
        let mut skipped = Vec::new();
        crate::cache::decode_stream(&blob, need, reader, |i, data| {
            let start = blob.chunks[i].cache_offset.get();
            let end = start + data.len() as u64;
            let mut skip = Vec::new();
            let inside = packs.inside(start, end);
            for (k, &(offset, len, may_skip)) in inside.iter().enumerate() {
                if !may_skip {
                    continue;
                }
                let bytes = &data[(offset - start) as usize..][..len as usize];
                let sha = sha256(bytes);
                let Some(at) = find_range(locator, &sha, len, &key) else {
                    continue;
                };
                at.drop_pages();
                // One fd per borrowed file, not per range (a pack holds
                // hundreds): a file that cannot be kept open is not borrowed.
                let Ok(file) = self.file_index(at.path, at.file) else {
                    continue;
                };
                self.ranges
                    .insert((packs.device, offset, len), (file, at.cache_offset));
                // To its block's end where no other file starts and the
                // bytes are zeros (a hole reads as what was there).
                let next = inside.get(k + 1).map_or(end, |n| n.0);
                let tail =
                    (offset + len)..(offset + len).next_multiple_of(BLOCK).min(next).min(end);
                let zeros = data[(tail.start - start) as usize..(tail.end - start) as usize]
                    .iter()
                    .all(|&b| b == 0);
                skip.push(offset..if zeros { tail.end } else { tail.start });
                skipped.push(ContentRange {
                    offset,
                    len,
                    sha256: sha,
                });
            }
            let written = match skip.is_empty() {
                true => store.fill(i, data, None),
                false => store.write_partial(i, data, &skip),
            };
            written.map_err(|e| crate::cache::CacheError::Io {
                path: path.clone(),
                source: e,
            })
        })?;
        store.save().map_err(io_err(&path))?;
        Ok(skipped)
    }

    /// Chunk `i` of `store`'s blob taken as whole without a fetch, when an
    /// earlier fill skipped ranges of it (`hints`): the bytes it wrote, and
    /// each skipped range's found elsewhere by its sha256, must hash to
    /// the chunk's verified digest. Returns the ranges, then borrowed.
    fn composed(
        &mut self,
        locator: &ChunkLocator,
        store: &BlobStore,
        (device, i): (u16, usize),
        earlier: &Skipped<'_>,
    ) -> Result<Option<Vec<ContentRange>>, MountError> {
        let chunk = &store.blob().chunks[i];
        let (start, size) = (chunk.cache_offset.get(), u64::from(chunk.size.get()));
        let ranges: Vec<ContentRange> = earlier
            .hints
            .iter()
            .filter(|r| r.offset >= start && r.offset + r.len <= start + size)
            .copied()
            .collect();
        let (false, Some(own)) = (ranges.is_empty(), earlier.own) else {
            return Ok(None);
        };
        let key = EntryKey::of(store.blob());
        let mut bytes = vec![0; size as usize];
        if own.read_exact_at(&mut bytes, start).is_err() {
            return Ok(None);
        }
        let mut places = Vec::with_capacity(ranges.len());
        for r in &ranges {
            let Some(at) = find_range(locator, &r.sha256, r.len, &key) else {
                return Ok(None);
            };
            let part = &mut bytes[(r.offset - start) as usize..][..r.len as usize];
            if at.quiet.read_exact_at(part, at.cache_offset).is_err() {
                return Ok(None);
            }
            at.drop_pages();
            places.push(at);
        }
        let _ = rustix::fs::fadvise(
            own,
            start,
            std::num::NonZeroU64::new(size),
            rustix::fs::Advice::DontNeed,
        );
        if sha256(&bytes) != chunk.digest {
            tracing::info!(
                "{}: chunk at {start} does not verify with the ranges found: fetched",
                store.cache_path().display()
            );
            return Ok(None);
        }
        for (r, at) in ranges.iter().zip(places) {
            let file = self.file_index(at.path, at.file)?;
            self.ranges
                .insert((device, r.offset, r.len), (file, at.cache_offset));
        }
        Ok(Some(ranges))
    }

    /// Borrows every chunk of blob `table` (image device `device`) that
    /// another image's complete cache file holds, for a lazy mount's shard
    /// (its own file keeps whatever it has): returns their indices, for its
    /// worker never to fetch them ahead.
    pub(crate) fn borrow(
        &mut self,
        locator: &ChunkLocator,
        device: u16,
        table: &IndexBlob,
    ) -> Result<Vec<u32>, MountError> {
        let key = EntryKey::of(table);
        let mut chunks = Vec::new();
        for (i, c) in table.chunks.iter().enumerate() {
            let (digest, size) = (&c.digest, c.size.get());
            let found = locator
                .find(digest, size, &key)
                .or_else(|| locator.find_named(digest, u64::from(size), &key));
            if let Some(at) = found {
                at.drop_pages();
                let file = self.file_index(at.path, at.file)?;
                self.chunks
                    .insert((device, c.cache_offset.get()), (file, at.cache_offset));
                chunks.push(u32::try_from(i).map_err(|_| too_many())?);
            }
        }
        Ok(chunks)
    }

    /// The borrowed files as a lazy mount's holder opens them: by path,
    /// checked to be the very inode checked here.
    pub(crate) fn specs(&self) -> Result<Vec<lamina_daemon::config::BorrowedSpec>, MountError> {
        let mut specs = Vec::with_capacity(self.files.len());
        for (path, file) in &self.files {
            let id = lamina_fetch::store::identity(file)
                .map_err(io_err(path))?
                .ok_or_else(|| MountError::Share(format!("{}: no birth time", path.display())))?;
            specs.push(lamina_daemon::config::BorrowedSpec {
                cache_path: path.clone(),
                file: id.into(),
            });
        }
        Ok(specs)
    }

    /// The index of `file` in `files`, added unless the same inode is there.
    fn file_index(&mut self, path: PathBuf, file: Arc<fs::File>) -> Result<usize, MountError> {
        let ino = |f: &fs::File| f.metadata().map(|m| (m.dev(), m.ino()));
        let this = ino(&file).map_err(io_err(&path))?;
        if let Some(i) = self
            .files
            .iter()
            .position(|(_, f)| ino(f).ok() == Some(this))
        {
            return Ok(i);
        }
        self.files.push((path, file));
        Ok(self.files.len() - 1)
    }

    /// The shard's devices for these chunks and ranges, numbered after the
    /// image's `image_devices`.
    pub(crate) fn moved(&self, image_devices: usize) -> Result<shard::Moved, MountError> {
        let mut devices = Vec::with_capacity(self.files.len());
        for (path, file) in &self.files {
            let len = file.metadata().map_err(io_err(path))?.len();
            let name = path.file_name().unwrap_or_default().to_string_lossy();
            devices.push(lamina_format::erofs::Device {
                tag: name.chars().take(64).collect(),
                blocks: u32::try_from(len.div_ceil(BLOCK)).map_err(|_| {
                    MountError::Share(format!("{}: too large a device", path.display()))
                })?,
            });
        }
        let first = u16::try_from(image_devices + 1).map_err(|_| too_many())?;
        let device = |file: usize| {
            let device = u16::try_from(file).ok().and_then(|f| first.checked_add(f));
            device.ok_or_else(too_many)
        };
        let mut moved = shard::Moved {
            devices,
            ..shard::Moved::default()
        };
        for (&at, &(file, offset)) in &self.chunks {
            moved.chunks.insert(at, (device(file)?, offset));
        }
        for (&at, &(file, offset)) in &self.ranges {
            moved.ranges.insert(at, (device(file)?, offset));
        }
        Ok(moved)
    }
}

/// Where another entry's complete cache file than `not` holds the `len`
/// bytes whose sha256 is `sha`: a packed file named by its bytes there, or
/// a stored chunk of those bytes.
fn find_range(locator: &ChunkLocator, sha: &[u8; 32], len: u64, not: &EntryKey) -> Option<Found> {
    locator.find_named(sha, len, not).or_else(|| {
        let size = u32::try_from(len).ok()?;
        locator.find(sha, size, not)
    })
}

/// The packed files' ranges of one blob (image device `device`).
#[derive(Clone, Copy)]
struct Packs<'a> {
    device: u16,
    /// (offset, length), sorted.
    packed: &'a [(u64, u64)],
}

impl Packs<'_> {
    /// The ranges in `start..end`, each with whether it may be skipped:
    /// it starts on a block and overlaps no other (neither could be
    /// skipped without the other's bytes).
    fn inside(&self, start: u64, end: u64) -> Vec<(u64, u64, bool)> {
        let first = self.packed.partition_point(|&(o, _)| o < start);
        let ranges: Vec<(u64, u64)> = self.packed[first..]
            .iter()
            .take_while(|&&(o, l)| o + l <= end)
            .copied()
            .collect();
        let apart = lamina_format::locate::apart(&ranges);
        (ranges.iter().zip(apart))
            .map(|(&(offset, len), apart)| (offset, len, offset % BLOCK == 0 && apart))
            .collect()
    }
}

/// The packed files' ranges of the image whose metadata is at
/// `meta_path`, by image device, each device's sorted: none when a chunk
/// table (`table(i)` for blob `i`) or the metadata cannot be had (its
/// packs are then borrowed whole or fetched).
pub(crate) fn packed_ranges(
    meta_path: &Path,
    table: &dyn Fn(usize) -> Option<IndexBlob>,
) -> HashMap<u16, Vec<(u64, u64)>> {
    let mut out: HashMap<u16, Vec<(u64, u64)>> = HashMap::new();
    let Ok(meta) = fs::read(meta_path) else {
        return out;
    };
    let Ok(image) = lamina_format::erofs::Image::new(&meta) else {
        return out;
    };
    let tables: Option<Vec<IndexBlob>> = (0..image.devices().len()).map(table).collect();
    let ranges = tables.map(|t| shard::packed_ranges(&image, &t));
    match ranges {
        Some(Ok(ranges)) => {
            for (device, offset, len) in ranges {
                out.entry(device).or_default().push((offset, len));
            }
        }
        Some(Err(e)) => tracing::debug!("{}: {e}", meta_path.display()),
        None => {}
    }
    out
}

/// Writes (or, when there are none, removes) a cache file's skipped-ranges
/// list: a hint for the next mount, so its chunks need not be fetched again.
fn save_skipped(path: &Path, skipped: &[ContentRange]) -> Result<(), MountError> {
    if skipped.is_empty() {
        return match fs::remove_file(path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io_err(path)(e)),
            _ => Ok(()),
        };
    }
    lamina_fetch::private::write_atomic(path, &ranges_bytes(skipped), false).map_err(io_err(path))
}

pub(crate) fn too_many() -> MountError {
    MountError::Share("too many devices for one shard".into())
}
