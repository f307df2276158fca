//! Building an image: layer tars in, a merged tree whose files are cut into
//! chunks (deduplicated by digest across all layers), one zstd data blob per
//! layer that brought new chunks, and at the end the EROFS metadata image and
//! the chunk index.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc;

use lamina_format::erofs::{self, ChunkAddr, Device, FileChunks};
use lamina_format::index::{
    chunk_table_bytes, ChunkEntry, ChunkIndex, IndexBlob, CHUNK_ZSTD, MAX_BLOBS, MAX_CHUNKS,
    MAX_TABLE_CHUNKS,
};
use lamina_oci::{sha256, Sha256};
use lamina_tree::{apply_layer, ApplyError, LayerStats, NodeKind, Tree};

use crate::artifact::MAX_METADATA_SIZE;

/// Build settings.
#[derive(Debug, Clone)]
pub struct BuildOptions {
    /// log2 of the chunk size (default 18: 256 KiB, chosen by measuring
    /// lazy starts; see docs/benchmarks.md).
    pub chunk_bits: u8,
    /// zstd level for data chunks.
    pub zstd_level: i32,
    /// Files of at most this many bytes are packed together, in the order
    /// they come, into chunks of up to the chunk size (0: every file gets
    /// chunks of its own). Must be below the chunk size.
    pub pack_limit: u64,
    /// A paged chunk index (format 4): blobs of at most
    /// [`MAX_TABLE_CHUNKS`] chunks, each ending with its chunk table. Off:
    /// the index holds every chunk (format 3, for older readers).
    pub paged: bool,
}

/// Default [`BuildOptions::pack_limit`] (docs/format.md, "Small files").
pub const DEFAULT_PACK_LIMIT: u64 = 16 * 1024;

impl Default for BuildOptions {
    fn default() -> Self {
        BuildOptions {
            chunk_bits: 18,
            zstd_level: 3,
            pack_limit: DEFAULT_PACK_LIMIT,
            paged: true,
        }
    }
}

/// Why a build failed.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// A layer could not be applied (bad tar, hostile entry, digest failure).
    #[error(transparent)]
    Layer(#[from] ApplyError),
    /// The tree cannot be written as EROFS.
    #[error("writing the EROFS image failed: {0}")]
    Format(#[from] erofs::FormatError),
    /// Local I/O on the work directory.
    #[error("work directory I/O failed: {0}")]
    Io(#[from] io::Error),
    /// Settings out of range.
    #[error("invalid build option: {0}")]
    Options(String),
    /// The image is beyond a limit readers enforce (docs/format.md, "Limits").
    #[error("image too large: {0}")]
    TooLarge(String),
}

/// One finished data blob: a file in the work directory.
#[derive(Debug, Clone)]
pub struct BuiltBlob {
    /// Path of the compressed blob.
    pub path: PathBuf,
    /// sha256 of the compressed blob.
    pub digest: [u8; 32],
    /// Compressed size.
    pub size: u64,
    /// Uncompressed, block-addressed size (the cache file's size).
    pub cache_size: u64,
    /// Index of the source layer that produced it.
    pub layer: u32,
    /// Its chunks, in blob order.
    pub chunks: Vec<ChunkEntry>,
}

/// Counts for the conversion summary.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct BuildStats {
    /// Entries in the final tree (all types, hardlinks counted once per name).
    pub entries: u64,
    /// Regular files (distinct inodes).
    pub files: u64,
    /// Bytes of regular file content in the final tree.
    pub file_bytes: u64,
    /// Chunks referenced by the final tree, holes excluded.
    pub chunk_refs: u64,
    /// Bytes of the final tree's files that live in blobs (holes excluded).
    pub referenced_bytes: u64,
    /// Chunks stored (over all blobs).
    pub chunks_stored: u64,
    /// All-zero chunks stored as holes.
    pub holes: u64,
    /// Uncompressed bytes stored in blobs (including data of files later deleted).
    pub stored_bytes: u64,
    /// Compressed bytes of all blobs.
    pub compressed_bytes: u64,
    /// Tar entries read over all layers.
    pub tar_entries: u64,
    /// Paths confined into the image (absolute, `..`, symlinks out).
    pub confined_paths: u64,
    /// Inodes in the EROFS image, and how many of them are compact.
    pub inodes: u64,
    /// Compact (32-byte) inodes.
    pub compact_inodes: u64,
    /// Chunks in the boot set (prefetch list).
    pub boot_set_chunks: u64,
    /// Inodes with extended attributes (0: a FUSE daemon may tell the
    /// kernel it has none, so `ls -l` stops asking for each file).
    pub xattr_inodes: u64,
    /// Small files stored in packs (each counted once, as stored).
    pub packed_files: u64,
    /// Chunks that are packs of small files.
    pub packs: u64,
}

/// The result of a build.
#[derive(Debug)]
pub struct BuiltImage {
    /// The EROFS metadata image.
    pub metadata: Vec<u8>,
    /// The chunk index.
    pub index: ChunkIndex,
    /// Data blobs in device order (blob i is EROFS device i + 1).
    pub blobs: Vec<BuiltBlob>,
    /// Figures.
    pub stats: BuildStats,
    /// Whether the index is paged ([`BuildOptions::paged`]).
    pub paged: bool,
    /// Where each stored content lives: a chunk's digest gives the chunk's
    /// place, a packed small file's content digest the file's place.
    addresses: HashMap<[u8; 32], ChunkAddr>,
}

impl BuiltImage {
    /// The chunk holding the content with this digest, and the content's
    /// offset in it: (blob, chunk, offset). A whole small file's digest is
    /// the digest its own chunk had before packing, so traces recorded on
    /// an image without packs still find their files in one with them.
    pub fn locate(&self, digest: &[u8; 32]) -> Option<(usize, usize, u64)> {
        locate(&self.blobs, &self.addresses, digest)
    }

    /// Makes `chunks` ((blob, chunk) positions, each kept once, in order)
    /// the boot set: the prefetch list of the index.
    pub fn set_boot_set(&mut self, chunks: &[(usize, usize)]) {
        let mut seen = std::collections::HashSet::new();
        self.index.prefetch = chunks
            .iter()
            .map(|&(b, i)| (b as u32, i as u32))
            .filter(|p| seen.insert(*p))
            .collect();
        self.stats.boot_set_chunks = self.index.prefetch.len() as u64;
    }

    /// The chunk holding byte `offset` of blob `blob`'s cache file, and the
    /// offset inside it.
    pub fn chunk_at(&self, blob: usize, offset: u64) -> Option<(usize, u64)> {
        let chunks = &self.blobs.get(blob)?.chunks;
        let i = chunks
            .partition_point(|c| c.cache_offset.get() <= offset)
            .checked_sub(1)?;
        let within = offset - chunks[i].cache_offset.get();
        (within < u64::from(chunks[i].size.get())).then_some((i, within))
    }
}

fn locate(
    blobs: &[BuiltBlob],
    addresses: &HashMap<[u8; 32], ChunkAddr>,
    digest: &[u8; 32],
) -> Option<(usize, usize, u64)> {
    let ChunkAddr::Data { device, blkaddr } = addresses.get(digest)? else {
        return None;
    };
    let blob = usize::from(*device).checked_sub(1)?;
    let chunks = &blobs.get(blob)?.chunks;
    let at = u64::from(*blkaddr) * 4096;
    let i = chunks
        .partition_point(|c| c.cache_offset.get() <= at)
        .checked_sub(1)?;
    Some((blob, i, at - chunks[i].cache_offset.get()))
}

/// A chunk on its way to the blob's compression thread.
struct PendingChunk {
    data: Vec<u8>,
    /// `None`: hashed on that thread (a pack, whose digest nothing here
    /// waits for).
    digest: Option<[u8; 32]>,
    cache_offset: u64,
}

/// What a blob's compression thread hands back.
struct WrittenBlob {
    digest: [u8; 32],
    compressed_len: u64,
    chunks: Vec<ChunkEntry>,
}

/// A data blob being written. Chunk placement in the cache file (and so the
/// EROFS block address) depends only on uncompressed sizes, so it is decided
/// here at once; compression, writing and the blob digest run on a second
/// thread, in chunk order, so the output stays byte-for-byte reproducible.
struct BlobWriter {
    path: PathBuf,
    sender: mpsc::SyncSender<PendingChunk>,
    thread: std::thread::JoinHandle<io::Result<WrittenBlob>>,
    cache_len: u64,
    /// Chunks sent to the thread.
    chunk_count: u32,
    layer: u32,
}

impl BlobWriter {
    fn create(path: PathBuf, zstd_level: i32, layer: u32, paged: bool) -> io::Result<BlobWriter> {
        let file = BufWriter::with_capacity(1 << 20, File::create(&path)?);
        let mut compressor = zstd::bulk::Compressor::new(zstd_level)?;
        // A few chunks in flight keep both threads busy without holding
        // much memory.
        let (sender, receiver) = mpsc::sync_channel::<PendingChunk>(8);
        let thread = std::thread::Builder::new()
            .name("lamina-compress".into())
            .spawn(move || compress_blob(file, &mut compressor, receiver, paged))?;
        Ok(BlobWriter {
            path,
            sender,
            thread,
            cache_len: 0,
            chunk_count: 0,
            layer,
        })
    }

    /// Waits for the compression thread; the blob file is complete and synced.
    fn finish(self) -> io::Result<BuiltBlob> {
        drop(self.sender);
        let written = self
            .thread
            .join()
            .map_err(|_| io::Error::other("compression thread panicked"))??;
        Ok(BuiltBlob {
            path: self.path,
            digest: written.digest,
            size: written.compressed_len,
            cache_size: self.cache_len,
            layer: self.layer,
            chunks: written.chunks,
        })
    }
}

/// The compression thread: compresses each chunk (kept raw when zstd does
/// not make it smaller), appends it to the blob and hashes the blob; the
/// blob ends with its chunk table (the paged index, docs/format.md).
fn compress_blob(
    mut file: BufWriter<File>,
    compressor: &mut zstd::bulk::Compressor<'static>,
    receiver: mpsc::Receiver<PendingChunk>,
    paged: bool,
) -> io::Result<WrittenBlob> {
    let mut hasher = Sha256::new();
    let mut compressed_len = 0u64;
    let mut chunks = Vec::new();
    for chunk in receiver {
        let data = &chunk.data;
        let compressed = compressor.compress(data)?;
        let (stored, flags): (&[u8], u32) = if compressed.len() < data.len() {
            (&compressed, CHUNK_ZSTD)
        } else {
            (data, 0)
        };
        file.write_all(stored)?;
        hasher.update(stored);
        chunks.push(ChunkEntry {
            cache_offset: chunk.cache_offset.into(),
            compressed_offset: compressed_len.into(),
            compressed_size: (stored.len() as u32).into(),
            size: (data.len() as u32).into(),
            flags: flags.into(),
            reserved: 0.into(),
            digest: chunk.digest.unwrap_or_else(|| sha256(data)),
        });
        compressed_len += stored.len() as u64;
    }
    if paged {
        let table = chunk_table_bytes(&chunks);
        file.write_all(&table)?;
        hasher.update(&table);
        compressed_len += table.len() as u64;
    }
    let file = file.into_inner().map_err(|e| e.into_error())?;
    file.sync_all()?;
    Ok(WrittenBlob {
        digest: hasher.finalize(),
        compressed_len,
        chunks,
    })
}

/// Chunk storage shared by all layers: the dedup table and the blobs.
struct ChunkStore<'a> {
    opts: &'a BuildOptions,
    work_dir: &'a Path,
    dedup: HashMap<[u8; 32], ChunkAddr>,
    finished: Vec<BuiltBlob>,
    current: Option<BlobWriter>,
    /// Small files waiting to become one chunk, each at a 4 KiB boundary
    /// (zeros between), at the current blob's end: any other chunk stored
    /// first stores the pack before it, so that place stays theirs.
    pack: Vec<u8>,
    stats: BuildStats,
}

impl std::fmt::Debug for ChunkStore<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChunkStore")
            .field("blobs", &self.finished.len())
            .finish()
    }
}

impl ChunkStore<'_> {
    fn device_count(&self) -> usize {
        self.finished.len() + usize::from(self.current.is_some())
    }

    /// Cuts one file into chunks, storing the ones not seen before; a small
    /// file goes into the current pack instead.
    fn add_file(&mut self, reader: &mut dyn Read, size: u64, layer: u32) -> io::Result<FileChunks> {
        let chunk_size = 1usize << self.opts.chunk_bits;
        if size > 0 && size <= self.opts.pack_limit.min(chunk_size as u64) {
            let mut data = vec![0u8; size as usize];
            reader.read_exact(&mut data)?;
            return Ok(FileChunks {
                chunk_bits: self.opts.chunk_bits,
                chunks: vec![self.pack_file(data, layer)?],
            });
        }
        let mut chunks = Vec::with_capacity(size.div_ceil(chunk_size as u64) as usize);
        let mut remaining = size;
        while remaining > 0 {
            let want = remaining.min(chunk_size as u64) as usize;
            let mut data = vec![0u8; want];
            reader.read_exact(&mut data)?;
            remaining -= want as u64;
            chunks.push(self.store_chunk(data, layer)?);
        }
        Ok(FileChunks {
            chunk_bits: self.opts.chunk_bits,
            chunks,
        })
    }

    /// A small file's place in the current pack (or wherever its content
    /// already is).
    fn pack_file(&mut self, data: Vec<u8>, layer: u32) -> io::Result<ChunkAddr> {
        if data.iter().all(|&b| b == 0) {
            self.stats.holes += 1;
            return Ok(ChunkAddr::Hole);
        }
        let digest = sha256(&data);
        if let Some(addr) = self.dedup.get(&digest) {
            return Ok(*addr);
        }
        let chunk_size = 1usize << self.opts.chunk_bits;
        let mut offset = self.pack.len().next_multiple_of(4096);
        if !self.pack.is_empty() && offset + data.len() > chunk_size {
            self.store_pack(layer)?;
            offset = 0;
        }
        if self.pack.is_empty() {
            self.make_room()?;
        }
        self.open_blob(layer)?;
        let device = self.device_count() as u16;
        let start = self.current.as_ref().map_or(0, |b| b.cache_len) + offset as u64;
        let blkaddr = u32::try_from(start / 4096)
            .map_err(|_| io::Error::other("data blob larger than 16 TiB"))?;
        self.pack.resize(offset, 0);
        self.pack.extend_from_slice(&data);
        self.stats.packed_files += 1;
        let addr = ChunkAddr::Data { device, blkaddr };
        self.dedup.insert(digest, addr);
        Ok(addr)
    }

    /// Stores the current pack as one chunk, at the place its files were
    /// given. Never deduplicated: its files already point there.
    fn store_pack(&mut self, layer: u32) -> io::Result<()> {
        if self.pack.is_empty() {
            return Ok(());
        }
        let data = std::mem::take(&mut self.pack);
        self.stats.packs += 1;
        // Hashed on the compression thread; `finish` makes it locatable
        // (traces recorded on this image name the pack).
        self.append_chunk(data, None, layer)?;
        Ok(())
    }

    /// Finishes the current blob if its chunk table is full: the next chunk
    /// (or pack, whose place is decided when it opens) starts a new blob.
    /// The pack must be empty.
    fn make_room(&mut self) -> io::Result<()> {
        if self.opts.paged
            && self
                .current
                .as_ref()
                .is_some_and(|b| b.chunk_count >= MAX_TABLE_CHUNKS)
        {
            self.finish_blob()?;
        }
        Ok(())
    }

    fn open_blob(&mut self, layer: u32) -> io::Result<()> {
        if self.current.is_none() && self.finished.len() >= MAX_BLOBS as usize {
            return Err(io::Error::other(format!(
                "more than {MAX_BLOBS} data blobs (use a larger --chunk-size)"
            )));
        }
        if self.current.is_none() {
            let path = self.work_dir.join(format!("blob-{}", self.finished.len()));
            self.current = Some(BlobWriter::create(
                path,
                self.opts.zstd_level,
                layer,
                self.opts.paged,
            )?);
        }
        Ok(())
    }

    fn store_chunk(&mut self, data: Vec<u8>, layer: u32) -> io::Result<ChunkAddr> {
        if data.iter().all(|&b| b == 0) {
            self.stats.holes += 1;
            return Ok(ChunkAddr::Hole);
        }
        let digest = sha256(&data);
        if let Some(addr) = self.dedup.get(&digest) {
            return Ok(*addr);
        }
        self.store_pack(layer)?;
        self.make_room()?;
        let addr = self.append_chunk(data, Some(digest), layer)?;
        self.dedup.entry(digest).or_insert(addr);
        Ok(addr)
    }

    /// Appends a chunk to the current blob (opened if need be).
    fn append_chunk(
        &mut self,
        data: Vec<u8>,
        digest: Option<[u8; 32]>,
        layer: u32,
    ) -> io::Result<ChunkAddr> {
        self.open_blob(layer)?;
        let device = self.device_count() as u16;
        let Some(blob) = self.current.as_mut() else {
            return Err(io::Error::other("no open data blob"));
        };
        let cache_offset = blob.cache_len;
        let blkaddr = u32::try_from(cache_offset / 4096)
            .map_err(|_| io::Error::other("data blob larger than 16 TiB"))?;
        blob.cache_len += (data.len() as u64).next_multiple_of(4096);
        blob.chunk_count += 1;
        self.stats.chunks_stored += 1;
        self.stats.stored_bytes += data.len() as u64;
        let pending = PendingChunk {
            data,
            digest,
            cache_offset,
        };
        if blob.sender.send(pending).is_err() {
            // The thread stopped on an error; finishing the blob reports it.
            let failed = self.current.take().map(BlobWriter::finish);
            return Err(match failed {
                Some(Err(e)) => e,
                _ => io::Error::other("compression thread stopped"),
            });
        }
        Ok(ChunkAddr::Data { device, blkaddr })
    }

    fn finish_blob(&mut self) -> io::Result<()> {
        if let Some(layer) = self.current.as_ref().map(|b| b.layer) {
            self.store_pack(layer)?;
        }
        if let Some(blob) = self.current.take() {
            let blob = blob.finish()?;
            self.stats.compressed_bytes += blob.size;
            self.finished.push(blob);
        }
        Ok(())
    }
}

/// Builds an image layer by layer; blobs go to `work_dir`.
pub struct ImageBuilder<'a> {
    tree: Tree<FileChunks>,
    store: ChunkStore<'a>,
    layers: u32,
}

impl std::fmt::Debug for ImageBuilder<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImageBuilder")
            .field("layers", &self.layers)
            .finish()
    }
}

impl<'a> ImageBuilder<'a> {
    /// A builder writing blobs into `work_dir` (which must exist).
    pub fn new(opts: &'a BuildOptions, work_dir: &'a Path) -> Result<Self, BuildError> {
        if !(12..=24).contains(&opts.chunk_bits) {
            return Err(BuildError::Options(format!(
                "chunk size 2^{} is outside 4 KiB..16 MiB",
                opts.chunk_bits
            )));
        }
        Ok(ImageBuilder {
            tree: Tree::new(),
            store: ChunkStore {
                opts,
                work_dir,
                dedup: HashMap::new(),
                finished: Vec::new(),
                current: None,
                pack: Vec::new(),
                stats: BuildStats::default(),
            },
            layers: 0,
        })
    }

    /// Applies the next layer (an uncompressed tar stream, read to EOF).
    pub fn add_layer(&mut self, tar: impl Read) -> Result<LayerStats, BuildError> {
        let layer = self.layers;
        self.layers += 1;
        let store = &mut self.store;
        let stats = apply_layer(&mut self.tree, layer, tar, |_, reader, size, _| {
            store.add_file(reader, size, layer)
        })?;
        self.store.finish_blob()?;
        self.store.stats.tar_entries += stats.entries;
        self.store.stats.confined_paths += stats.confined;
        Ok(stats)
    }

    /// Writes the metadata image and index. `boot_set` lists chunk digests
    /// (from `lamina mount --record-trace`) in the order a workload needed
    /// them; those stored in this image become its prefetch list.
    pub fn finish(mut self, boot_set: &[[u8; 32]]) -> Result<BuiltImage, BuildError> {
        self.store.finish_blob()?;
        let devices: Vec<Device> = self
            .store
            .finished
            .iter()
            .map(|b| Device {
                tag: hex::encode(b.digest),
                blocks: (b.cache_size / 4096) as u32,
            })
            .collect();
        let (metadata, image_stats) = erofs::write_image(&self.tree, &devices)?;
        // Readers refuse what is over the limits; better not to write it.
        if metadata.len() as u64 > MAX_METADATA_SIZE {
            return Err(BuildError::TooLarge(format!(
                "the EROFS metadata image is {} bytes, more than {MAX_METADATA_SIZE}",
                metadata.len()
            )));
        }
        let chunk_count: usize = self.store.finished.iter().map(|b| b.chunks.len()).sum();
        if chunk_count > MAX_CHUNKS as usize {
            return Err(BuildError::TooLarge(format!(
                "{chunk_count} distinct chunks, more than {MAX_CHUNKS} (use a larger --chunk-size)"
            )));
        }
        let mut stats = self.store.stats;
        stats.inodes = image_stats.inodes;
        stats.compact_inodes = image_stats.compact_inodes;
        let mut seen = std::collections::HashSet::new();
        let mut with_xattrs = std::collections::HashSet::new();
        let tree = &self.tree;
        tree.walk(|_, id| {
            stats.entries += 1;
            if !tree.nodes[id].meta.xattrs.is_empty() && with_xattrs.insert(id) {
                stats.xattr_inodes += 1;
            }
            if let NodeKind::Regular { size, content } = &tree.nodes[id].kind {
                if seen.insert(id) {
                    stats.files += 1;
                    stats.file_bytes += size;
                    let cs = 1u64 << content.chunk_bits;
                    for (i, c) in content.chunks.iter().enumerate() {
                        if matches!(c, ChunkAddr::Data { .. }) {
                            stats.chunk_refs += 1;
                            stats.referenced_bytes += cs.min(size - i as u64 * cs);
                        }
                    }
                }
            }
        });
        stats.entries -= 1; // the root
        for (b, blob) in self.store.finished.iter().enumerate() {
            for c in &blob.chunks {
                self.store.dedup.entry(c.digest).or_insert(ChunkAddr::Data {
                    device: b as u16 + 1,
                    blkaddr: (c.cache_offset.get() / 4096) as u32,
                });
            }
        }
        let boot_set: Vec<(usize, usize)> = boot_set
            .iter()
            .filter_map(|d| locate(&self.store.finished, &self.store.dedup, d))
            .map(|(b, i, _)| (b, i))
            .collect();
        let index = ChunkIndex {
            prefetch: Vec::new(),
            chunk_bits: self.store.opts.chunk_bits,
            blobs: self
                .store
                .finished
                .iter()
                .map(|b| IndexBlob {
                    digest: b.digest,
                    compressed_size: b.size,
                    cache_size: b.cache_size,
                    chunks: b.chunks.clone(),
                })
                .collect(),
        };
        let mut image = BuiltImage {
            metadata,
            index,
            blobs: self.store.finished,
            stats,
            paged: self.store.opts.paged,
            addresses: self.store.dedup,
        };
        image.set_boot_set(&boot_set);
        Ok(image)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A layer tar of regular files (mode 0644, root, mtime 1).
    pub(crate) fn layer(files: &[(&str, Vec<u8>)]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (path, data) in files {
            let mut h = tar::Header::new_gnu();
            h.set_size(data.len() as u64);
            h.set_mode(0o644);
            h.set_uid(0);
            h.set_gid(0);
            h.set_mtime(1);
            b.append_data(&mut h, path, &data[..]).unwrap();
        }
        b.into_inner().unwrap()
    }

    /// Pseudo-random bytes: incompressible.
    pub(crate) fn noise(len: usize, seed: u64) -> Vec<u8> {
        let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    #[test]
    fn dedup_within_and_across_layers_and_holes() {
        let dir = tempfile::tempdir().unwrap();
        let opts = BuildOptions {
            chunk_bits: 16,
            zstd_level: 1,
            pack_limit: 0,
            paged: true,
        };
        let mut b = ImageBuilder::new(&opts, dir.path()).unwrap();
        let a = noise(1 << 16, 1);
        let mut twice = a.clone();
        twice.extend_from_slice(&a); // two identical chunks
        b.add_layer(
            &layer(&[
                ("a", a.clone()),
                ("twice", twice),
                ("zeros", vec![0; 1 << 17]),
            ])[..],
        )
        .unwrap();
        b.add_layer(&layer(&[("copy", a.clone()), ("new", noise(100, 2))])[..])
            .unwrap();
        let img = b.finish(&[]).unwrap();
        // Layer 0 stores one chunk; layer 1 stores only "new".
        assert_eq!(img.stats.chunks_stored, 2);
        assert_eq!(img.stats.holes, 2);
        assert_eq!(img.blobs.len(), 2);
        assert_eq!(img.index.blobs[1].chunks.len(), 1);
        assert_eq!(img.stats.chunk_refs, 1 + 2 + 1 + 1);
        // The blob on disk hashes to its recorded digest.
        let bytes = std::fs::read(&img.blobs[0].path).unwrap();
        assert_eq!(sha256(&bytes), img.blobs[0].digest);
    }

    /// A paged index's blobs hold at most MAX_TABLE_CHUNKS chunks each and
    /// end with their chunk table; a layer with more makes more blobs, and
    /// every file (small ones packed across the split too) reads back.
    #[test]
    fn blobs_split_at_a_full_chunk_table_and_end_with_it() {
        let dir = tempfile::tempdir().unwrap();
        let opts = BuildOptions {
            chunk_bits: 12,
            zstd_level: 1,
            pack_limit: 1024,
            paged: true,
        };
        let mut b = ImageBuilder::new(&opts, dir.path()).unwrap();
        let big = noise(1500 << 12, 3); // 1,500 distinct chunks
        let small: Vec<(String, Vec<u8>)> = (0..700)
            .map(|i| (format!("s{i}"), noise(900, 100 + i)))
            .collect();
        let mut files: Vec<(&str, Vec<u8>)> = vec![("big", big.clone())];
        files.extend(small.iter().map(|(n, d)| (n.as_str(), d.clone())));
        b.add_layer(&layer(&files)[..]).unwrap();
        let img = b.finish(&[]).unwrap();
        assert_eq!(
            img.blobs.len(),
            3,
            "1,500 chunks and 700 packs of one file each"
        );
        let top = ChunkIndex::parse_top(&img.index.to_paged_bytes()).unwrap();
        for (blob, summary) in img.blobs.iter().zip(&top.blobs) {
            assert!(blob.chunks.len() <= MAX_TABLE_CHUNKS as usize);
            let bytes = std::fs::read(&blob.path).unwrap();
            assert_eq!(bytes.len() as u64, blob.size);
            let (at, len) = summary.table_range().unwrap();
            let table = &bytes[at as usize..(at + len) as usize];
            let parsed = IndexBlob::from_table(summary, 12, table).unwrap();
            assert_eq!(parsed.chunks, blob.chunks);
        }
        let caches = cache_files(&img);
        assert_eq!(read_file(&img, &caches, "big"), big);
        for (name, data) in &small {
            assert_eq!(&read_file(&img, &caches, name), data, "{name}");
        }
    }

    /// Each blob's cache file, rebuilt from its chunks (checked against
    /// their digests).
    fn cache_files(img: &BuiltImage) -> Vec<Vec<u8>> {
        img.blobs
            .iter()
            .map(|blob| {
                let file = File::open(&blob.path).unwrap();
                let mut cache = vec![0u8; blob.cache_size as usize];
                for c in &blob.chunks {
                    let data = crate::boot::tests::chunk_bytes(&file, c);
                    let at = c.cache_offset.get() as usize;
                    cache[at..at + data.len()].copy_from_slice(&data);
                }
                cache
            })
            .collect()
    }

    /// A file's bytes as the EROFS image maps them onto the cache files.
    fn read_file(img: &BuiltImage, caches: &[Vec<u8>], path: &str) -> Vec<u8> {
        let image = erofs::Image::new(&img.metadata).unwrap();
        let mut inode = image.inode(image.root_nid()).unwrap();
        for name in path.split('/') {
            let e = image.lookup(&inode, name.as_bytes()).unwrap().unwrap();
            inode = image.inode(e.nid).unwrap();
        }
        let chunks = image.chunks(&inode).unwrap();
        let cs = 1u64 << chunks.chunk_bits;
        let mut out = Vec::new();
        for i in 0..chunks.len() {
            let len = cs.min(inode.size - i as u64 * cs) as usize;
            match chunks.get(i).unwrap() {
                erofs::Chunk::Hole => out.resize(out.len() + len, 0),
                erofs::Chunk::Data { device, offset } => {
                    let cache = &caches[usize::from(device) - 1];
                    out.extend_from_slice(&cache[offset as usize..offset as usize + len]);
                }
            }
        }
        out
    }

    /// 64 KiB chunks, files of up to 12 KiB packed.
    const PACKING: BuildOptions = BuildOptions {
        chunk_bits: 16,
        zstd_level: 1,
        pack_limit: 12 * 1024,
        paged: true,
    };

    /// Small files share chunks, each at a 4 KiB boundary in order; a
    /// bigger file in between closes the pack (its chunks follow it); a
    /// pack never passes the chunk size; a small file seen before, in this
    /// layer or an earlier one, is not stored again; every file reads back
    /// right, and `locate` finds a packed file by its content digest.
    #[test]
    fn small_files_are_packed_into_shared_chunks() {
        let dir = tempfile::tempdir().unwrap();
        let mut b = ImageBuilder::new(&PACKING, dir.path()).unwrap();
        let mut files: Vec<(String, Vec<u8>)> = vec![
            ("a".into(), noise(100, 1)),
            ("b".into(), noise(5000, 2)),
            ("c".into(), noise(9000, 3)),
            ("big".into(), noise(70_000, 4)),
            ("d".into(), noise(12 * 1024, 5)),
            ("zero".into(), vec![0; 3000]),
        ];
        // 20 files of 12 KiB: 16 KiB each in a pack, so 4 per 64 KiB pack.
        for i in 0..20 {
            files.push((format!("many/{i:02}"), noise(12 * 1024, 100 + i)));
        }
        let refs: Vec<(&str, Vec<u8>)> =
            files.iter().map(|(p, d)| (p.as_str(), d.clone())).collect();
        b.add_layer(&layer(&refs)[..]).unwrap();
        let again = noise(9000, 3);
        b.add_layer(&layer(&[("copy-of-c", again.clone()), ("e", noise(200, 6))])[..])
            .unwrap();
        let img = b.finish(&[]).unwrap();

        let caches = cache_files(&img);
        for (path, data) in files
            .iter()
            .chain([("copy-of-c".to_string(), again)].iter())
        {
            assert_eq!(&read_file(&img, &caches, path), data, "{path}");
        }
        // Layer 0: [a b c] (blocks 0, 1-2, 3-5), big (2 chunks), then
        // [d many/00..03] (zero is a hole) and 4 packs of 4.
        let chunks = &img.blobs[0].chunks;
        assert_eq!(chunks[0].size.get(), 3 * 4096 + 9000, "a, b, c in one pack");
        assert_eq!(chunks.len(), 1 + 2 + 1 + 4);
        assert!(chunks.iter().all(|c| c.size.get() <= 1 << 16));
        assert_eq!(img.stats.packed_files, 3 + 1 + 20 + 1);
        assert_eq!(img.stats.packs, 1 + 1 + 4 + 1);
        assert_eq!(img.stats.holes, 1);
        // Layer 1 stores only "e": the copy of c points into layer 0's pack.
        assert_eq!(img.blobs[1].chunks.len(), 1);
        assert_eq!(img.locate(&sha256(&noise(9000, 3))), Some((0, 0, 3 * 4096)));
        assert_eq!(
            img.locate(&sha256(&noise(70_000, 4)[..1 << 16])),
            Some((0, 1, 0))
        );
        assert_eq!(img.locate(&chunks[0].digest), Some((0, 0, 0)));
    }

    /// A trace recorded on an image without packs (its small files' chunk
    /// digests are their content digests) still names them in one with
    /// packs: they join the boot set and their pages become boot pages.
    #[test]
    fn traces_find_small_files_inside_packs() {
        let dir = tempfile::tempdir().unwrap();
        let mut b = ImageBuilder::new(&PACKING, dir.path()).unwrap();
        let (a, c) = (noise(100, 1), noise(9000, 3));
        b.add_layer(&layer(&[("a", a.clone()), ("b", noise(5000, 2)), ("c", c.clone())])[..])
            .unwrap();
        let img = b.finish(&[sha256(&c), sha256(&a)]).unwrap();
        assert_eq!(img.index.prefetch, vec![(0, 0)], "one pack holds both");
        let text = format!("{} 4096 100\n", hex::encode(sha256(&c)));
        let trace = crate::boot::parse_trace(Path::new("t"), &text).unwrap();
        let boot =
            crate::boot::build_boot_pages(&img, &crate::boot::trace_reads(&img, &trace)).unwrap();
        // c starts at block 3 of the pack; its bytes 4096.. are block 4.
        assert_eq!(boot.extents.len(), 1);
        assert_eq!(boot.extents[0].cache_offset.get(), 4 * 4096);
        assert_eq!(&boot.data[..100], &c[4096..4196]);
    }

    #[test]
    fn layer_without_new_chunks_makes_no_blob() {
        let dir = tempfile::tempdir().unwrap();
        let opts = BuildOptions::default();
        let mut b = ImageBuilder::new(&opts, dir.path()).unwrap();
        b.add_layer(&layer(&[("empty", vec![])])[..]).unwrap();
        let img = b.finish(&[]).unwrap();
        assert!(img.blobs.is_empty());
        assert!(img.metadata.len() >= 8192);
    }
}
