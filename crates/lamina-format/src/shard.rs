//! Objects shared across images on the kernel path (issue 43): an image's
//! EROFS split into a *metadata view* and a *shard*, the shape of
//! composefs, so that every image whose files have the same bytes reads
//! them through one inode, one page cache.
//!
//! - The **shard** is an EROFS holding one regular file per distinct
//!   content of the image, named `/xx/<62 hex>` by its [`fingerprint`], its
//!   chunks the image's own (same extra devices, same block addresses).
//! - The **metadata view** is the image's tree with every file that has
//!   data made a sparse file of its size (all chunks holes, no devices),
//!   carrying overlayfs's `trusted.overlay.metacopy` and an absolute
//!   `trusted.overlay.redirect` to its object. Mounted as
//!   `overlay lowerdir=VIEW::SHARD-1::...::OWN-SHARD,metacopy=on`, the
//!   shards are data-only lowers: a file's data comes from the first shard
//!   that has its name.
//!
//! A fingerprint is lamina's, never the image's. A file of one chunk is
//! fingerprinted by its size and the sha256 of its bytes
//! ([`content_fingerprint`]): the verified digest of its stored chunk when
//! it is that chunk whole, else (a small file packed with others, whose
//! pack's digest changes with its neighbours) the sha256 of its bytes read
//! from the verified cache file, when the node holds them (an eager
//! mount). Otherwise, and for a larger file, by its size, chunk size and,
//! per chunk, the verified digest of the stored chunk it reads and where in
//! that chunk it starts ([`fingerprint`]). The digests come from the chunk
//! tables a mount verified against the manifest, and a file whose chunk
//! reads past the stored chunk it starts in is refused, so equal
//! fingerprints mean equal bytes whichever image either came from.
//! The image's own `trusted.overlay.*` xattrs are stored escaped
//! (`trusted.overlay.overlay.*`; overlayfs 6.7+ shows them unescaped), so
//! nothing an image carries directs overlayfs.
//!
//! The objects list (`objects` beside a shard) is the shard's fingerprints,
//! sorted, 32 bytes each, nothing else.

use std::collections::{BTreeMap, HashMap};

use lamina_tree::{DirEntry, Metadata, Node, NodeId, NodeKind, Tree};

use crate::erofs::{write_image, ChunkAddr, Device, FileChunks, FormatError};
use crate::erofs::{Chunk, Image, Inode, Kind, ReadError};
use crate::index::IndexBlob;

/// A file's content fingerprint: see the module doc.
pub type Fingerprint = [u8; 32];

/// One chunk of a file, as [`fingerprint`] takes it: a hole, or (the
/// verified digest of the stored chunk it starts in, its offset there).
pub type ChunkRef = Option<([u8; 32], u64)>;

/// What a fingerprint by chunks hashes first: the scheme and its version.
const FINGERPRINT_TAG: &[u8] = b"lamina object v1\0";
/// What a fingerprint by content hashes first.
const CONTENT_TAG: &[u8] = b"lamina object content v1\0";
/// overlayfs's own xattrs, which a metadata view sets and an image may not.
const OVERLAY_PREFIX: &[u8] = b"trusted.overlay.";
/// How overlayfs 6.7+ stores an overlay xattr meant for the layer above.
const ESCAPED_PREFIX: &[u8] = b"trusted.overlay.overlay.";
/// Set on a metadata view's file: its data is elsewhere.
pub const METACOPY_XATTR: &[u8] = b"trusted.overlay.metacopy";
/// Set on a metadata view's file: where its data is (`/xx/<rest>`).
pub const REDIRECT_XATTR: &[u8] = b"trusted.overlay.redirect";

/// An image split for sharing.
#[derive(Debug, Clone)]
pub struct Split {
    /// The metadata view (an EROFS with no extra devices).
    pub view: Vec<u8>,
    /// The shard (an EROFS with the image's extra devices).
    pub shard: Vec<u8>,
    /// The shard's fingerprints, sorted, each once.
    pub objects: Vec<Fingerprint>,
    /// The files named by the bytes read (packed files), where the shard
    /// reads them: for the chunk locator to note, so that an image whose
    /// pack changed around them finds them by content.
    pub named: Vec<NamedRange>,
    /// Which stored chunks of the image's own devices each object reads
    /// (not those [`Moved`] places elsewhere): (object, image device,
    /// stored chunk's cache offset), sorted, each once. A chunk that only
    /// objects another shard serves read is never read through this one.
    pub reads: Vec<(Fingerprint, u16, u64)>,
}

/// A file's bytes, named by their sha256, at `offset` of shard device
/// `device` (1-based).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NamedRange {
    /// The shard's extra device (the image's own first, then [`Moved`]'s).
    pub device: u16,
    /// Where the bytes start there (a block).
    pub offset: u64,
    /// How many.
    pub len: u64,
    /// Their sha256.
    pub sha256: [u8; 32],
}

/// Stored chunks that the shard reads from other cache files than the
/// image's own: verified copies the node already holds, so that the image
/// needs no copy of its own (one copy on disk per domain).
#[derive(Debug, Clone, Default)]
pub struct Moved {
    /// The shard's extra devices after the image's own.
    pub devices: Vec<Device>,
    /// (image device, cache offset of a stored chunk) → (shard device,
    /// where the same bytes start there), both block-aligned.
    pub chunks: HashMap<(u16, u64), (u16, u64)>,
    /// Ranges inside stored chunks (packed files whose pack is new, their
    /// bytes not): (image device, offset, length) → (shard device, where
    /// the same bytes start there), both block-aligned. Only a read of
    /// exactly that range goes there.
    pub ranges: HashMap<(u16, u64, u64), (u16, u64)>,
}

impl Moved {
    /// Where the shard reads the `len` bytes at `offset` of image device
    /// `device`, which lies `at` bytes into its stored chunk.
    fn place(&self, device: u16, offset: u64, at: u64, len: u64) -> (u16, u64) {
        if let Some(&(to, start)) = self.chunks.get(&(device, offset - at)) {
            return (to, start + at);
        }
        match self.ranges.get(&(device, offset, len)) {
            Some(&place) => place,
            None => (device, offset),
        }
    }
}

/// A stored chunk of the image's own devices: (device, cache offset).
type StoredChunk = (u16, u64);

/// Why an image cannot be split.
#[derive(Debug, thiserror::Error)]
pub enum SplitError {
    /// The image does not read.
    #[error(transparent)]
    Read(#[from] ReadError),
    /// A view or shard does not write.
    #[error(transparent)]
    Format(#[from] FormatError),
    /// A file's chunk that no verified chunk table vouches for.
    #[error("{0}")]
    Unverified(String),
}

/// The path an object has in its shard (and a view's redirect names).
pub fn object_path(fp: &Fingerprint) -> String {
    let hex = hex::encode(fp);
    format!("/{}/{}", &hex[..2], &hex[2..])
}

/// The objects list's bytes.
pub fn objects_bytes(objects: &[Fingerprint]) -> Vec<u8> {
    objects.concat()
}

/// Parses an objects list; `None` unless it is whole 32-byte records,
/// sorted, each once.
pub fn parse_objects(bytes: &[u8]) -> Option<Vec<Fingerprint>> {
    if !bytes.len().is_multiple_of(32) {
        return None;
    }
    let list: Vec<Fingerprint> = bytes
        .chunks_exact(32)
        .map(|c| c.try_into().expect("32-byte chunks"))
        .collect();
    list.windows(2).all(|w| w[0] < w[1]).then_some(list)
}

/// The fingerprint of a file of `size` bytes in chunks of `1 << chunk_bits`,
/// each chunk a hole or (the verified digest of the stored chunk it starts
/// in, its offset in that chunk).
pub fn fingerprint(
    size: u64,
    chunk_bits: u8,
    chunks: impl IntoIterator<Item = ChunkRef>,
) -> Fingerprint {
    let mut h = ring::digest::Context::new(&ring::digest::SHA256);
    h.update(FINGERPRINT_TAG);
    h.update(&size.to_le_bytes());
    h.update(&[chunk_bits]);
    for chunk in chunks {
        match chunk {
            None => h.update(&[0]),
            Some((digest, at)) => {
                h.update(&[1]);
                h.update(&digest);
                h.update(&at.to_le_bytes());
            }
        }
    }
    h.finish().as_ref().try_into().expect("sha256 is 32 bytes")
}

/// The fingerprint of a file of `size` bytes whose sha256 is `digest`.
pub fn content_fingerprint(size: u64, digest: &[u8; 32]) -> Fingerprint {
    let mut h = ring::digest::Context::new(&ring::digest::SHA256);
    h.update(CONTENT_TAG);
    h.update(&size.to_le_bytes());
    h.update(digest);
    h.finish().as_ref().try_into().expect("sha256 is 32 bytes")
}

/// Reads `len` bytes at `offset` of extra device `device` (1-based; the
/// shard's numbering, [`Moved`] devices after the image's) from the
/// verified cache files, for a packed file's content fingerprint;
/// `Ok(None)` when the node does not hold them (a lazy mount): the file is
/// then named by its chunk.
pub type ReadDevice<'r> = dyn FnMut(u16, u64, usize) -> Result<Option<Vec<u8>>, String> + 'r;

/// Splits `image`, whose extra device `i + 1` is the cache file of
/// `tables[i]` (the verified chunk tables, complete but for the chunks
/// `moved` places elsewhere, which `read` reads), into a metadata view and
/// a shard. Equal inputs give equal bytes.
pub fn split(
    image: &Image<'_>,
    tables: &[IndexBlob],
    moved: &Moved,
    read: &mut ReadDevice<'_>,
) -> Result<Split, SplitError> {
    if image.devices().len() != tables.len() {
        return Err(SplitError::Unverified(format!(
            "{} devices in the image, {} chunk tables",
            image.devices().len(),
            tables.len()
        )));
    }
    let mut view: Tree<FileChunks> = Tree::new();
    let mut shard = ShardTree::default();
    let root = image.inode(image.root_nid())?;
    view.nodes[view.root].meta = metadata(image, &root)?;
    let mut made: HashMap<u64, NodeId> = HashMap::new();
    // (source dir inode nid, view dir node), depth first.
    let mut stack = vec![(root.nid, view.root)];
    let mut dirs_seen = std::collections::HashSet::new();
    while let Some((nid, dir)) = stack.pop() {
        if !dirs_seen.insert(nid) {
            return Err(ReadError::Corrupt(format!("directory nid {nid} linked twice")).into());
        }
        let inode = image.inode(nid)?;
        for entry in image.entries(&inode)? {
            if entry.name == b"." || entry.name == b".." {
                continue;
            }
            let child = match made.get(&entry.nid) {
                Some(&node) => node,
                None => {
                    let child = image.inode(entry.nid)?;
                    let source = Source {
                        tables,
                        moved,
                        read: &mut *read,
                    };
                    let node = view_node(image, &child, source, &mut shard)?;
                    let id = view.add_node(node);
                    if child.kind() != Some(Kind::Directory) {
                        made.insert(entry.nid, id);
                    } else {
                        stack.push((entry.nid, id));
                    }
                    id
                }
            };
            link(&mut view, dir, entry.name, child);
        }
    }
    let mut devices: Vec<Device> = image
        .devices()
        .iter()
        .map(|d| Device {
            tag: String::from_utf8_lossy(d.tag).into_owned(),
            blocks: d.blocks,
        })
        .collect();
    devices.extend(moved.devices.iter().cloned());
    let (view, _) = write_image(&view, &[])?;
    let objects: Vec<Fingerprint> = shard.objects.keys().copied().collect();
    let mut named = shard.named;
    named.sort_by_key(|n| (n.device, n.offset, n.len));
    named.dedup();
    let mut reads = shard.reads;
    reads.sort_unstable();
    reads.dedup();
    let (shard, _) = write_image(&shard.tree, &devices)?;
    Ok(Split {
        view,
        shard,
        objects,
        named,
        reads,
    })
}

/// The ranges that files of one chunk read inside a stored chunk of
/// `tables` without being that whole chunk (packed files), as (image
/// device, offset, length), sorted, each once: what [`split`] names by the
/// bytes read, and so what an image can borrow by content when its pack
/// is new ([`Moved::ranges`]).
pub fn packed_ranges(
    image: &Image<'_>,
    tables: &[IndexBlob],
) -> Result<Vec<(u16, u64, u64)>, ReadError> {
    let mut out = Vec::new();
    let mut dirs = vec![image.root_nid()];
    let mut seen = std::collections::HashSet::new();
    while let Some(nid) = dirs.pop() {
        if !seen.insert(nid) {
            continue;
        }
        let dir = image.inode(nid)?;
        for entry in image.entries(&dir)? {
            if entry.name == b"." || entry.name == b".." {
                continue;
            }
            let inode = image.inode(entry.nid)?;
            match inode.kind() {
                Some(Kind::Directory) => dirs.push(entry.nid),
                Some(Kind::Regular) => out.extend(packed_range(image, &inode, tables)?),
                _ => {}
            }
        }
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

/// A regular file's range if it is packed: one chunk, inside a stored
/// chunk of `tables` and not all of it.
fn packed_range(
    image: &Image<'_>,
    inode: &Inode<'_>,
    tables: &[IndexBlob],
) -> Result<Option<(u16, u64, u64)>, ReadError> {
    let chunks = image.chunks(inode)?;
    let (Some(Chunk::Data { device, offset }), 1) = (chunks.get(0), chunks.len()) else {
        return Ok(None);
    };
    let Some(table) = tables.get(usize::from(device).wrapping_sub(1)) else {
        return Ok(None);
    };
    let size = inode.size;
    let packed = table.chunks_covering(offset, 1).first().is_some_and(|c| {
        let (start, len) = (c.cache_offset.get(), u64::from(c.size.get()));
        offset >= start && offset + size <= start + len && (offset, size) != (start, len)
    });
    Ok(packed.then_some((device, offset, size)))
}

fn link(tree: &mut Tree<FileChunks>, dir: NodeId, name: &[u8], node: NodeId) {
    if let NodeKind::Directory { entries } = &mut tree.nodes[dir].kind {
        entries.insert(name.to_vec(), DirEntry { node, layer: 0 });
    }
}

/// An inode's attributes, its own overlay xattrs escaped.
fn metadata(image: &Image<'_>, inode: &Inode<'_>) -> Result<Metadata, ReadError> {
    let mut xattrs = BTreeMap::new();
    for (name, value) in image.xattrs(inode)? {
        let name = match name.strip_prefix(OVERLAY_PREFIX) {
            Some(rest) => [ESCAPED_PREFIX, rest].concat(),
            None => name,
        };
        xattrs.insert(name, value.to_vec());
    }
    Ok(Metadata {
        mode: inode.mode & 0o7777,
        uid: inode.uid,
        gid: inode.gid,
        mtime: inode.mtime,
        mtime_nsec: inode.mtime_nsec,
        xattrs,
    })
}

/// What a file's object is made from: the verified chunk tables, where
/// moved chunks are, and how to read bytes.
struct Source<'s, 'r> {
    tables: &'s [IndexBlob],
    moved: &'s Moved,
    read: &'s mut ReadDevice<'r>,
}

/// The view's node for `inode`; a file with data gets its object made.
fn view_node(
    image: &Image<'_>,
    inode: &Inode<'_>,
    source: Source<'_, '_>,
    shard: &mut ShardTree,
) -> Result<Node<FileChunks>, SplitError> {
    let mut meta = metadata(image, inode)?;
    let kind = match inode.kind() {
        Some(Kind::Directory) => NodeKind::Directory {
            entries: BTreeMap::new(),
        },
        Some(Kind::Regular) => {
            let chunks = image.chunks(inode)?;
            let (bits, size) = (chunks.chunk_bits, inode.size);
            let addrs: Vec<Chunk> = (0..chunks.len()).filter_map(|i| chunks.get(i)).collect();
            if addrs.iter().any(|c| matches!(c, Chunk::Data { .. })) {
                let refs = verified(inode, &addrs, bits, source.tables)?;
                let span = (size, bits, image.block_bits());
                let (placed, own) = placed(&addrs, &refs, source.moved, span)?;
                let (fp, named) = file_fingerprint(inode, &addrs, &refs, bits, source)?;
                if shard.add(fp, size, bits, placed) {
                    let reads = own.into_iter().map(|(device, at)| (fp, device, at));
                    shard.reads.extend(reads);
                }
                shard.named.extend(named);
                meta.xattrs.insert(METACOPY_XATTR.to_vec(), Vec::new());
                meta.xattrs
                    .insert(REDIRECT_XATTR.to_vec(), object_path(&fp).into_bytes());
            }
            NodeKind::Regular {
                size,
                content: FileChunks {
                    chunk_bits: bits,
                    chunks: vec![ChunkAddr::Hole; addrs.len()],
                },
            }
        }
        Some(Kind::Symlink) => NodeKind::Symlink {
            target: image.symlink_target(inode)?,
        },
        Some(Kind::CharDevice) => {
            let (major, minor) = inode.rdev();
            NodeKind::CharDevice { major, minor }
        }
        Some(Kind::BlockDevice) => {
            let (major, minor) = inode.rdev();
            NodeKind::BlockDevice { major, minor }
        }
        Some(Kind::Fifo) => NodeKind::Fifo,
        Some(Kind::Socket) => NodeKind::Socket,
        None => return Err(ReadError::Corrupt(format!("nid {}: mode", inode.nid)).into()),
    };
    Ok(Node { meta, kind })
}

/// Each chunk's address in the shard: the image's, or where `moved` put
/// its stored chunk or its range. `span` is (the file's size, its chunk
/// bits, the image's block bits).
fn placed(
    addrs: &[Chunk],
    refs: &[ChunkRef],
    moved: &Moved,
    span: (u64, u8, u8),
) -> Result<(Vec<ChunkAddr>, Vec<StoredChunk>), SplitError> {
    let (size, chunk_bits, block_bits) = span;
    let mut out = Vec::with_capacity(addrs.len());
    // The stored chunks of the image's own devices read: (device, start).
    let mut own = Vec::new();
    for (i, (chunk, chunk_ref)) in addrs.iter().zip(refs).enumerate() {
        let (Chunk::Data { device, offset }, Some((_, at))) = (*chunk, chunk_ref) else {
            out.push(ChunkAddr::Hole);
            continue;
        };
        let len = (size - ((i as u64) << chunk_bits)).min(1 << chunk_bits);
        let image_place = (device, offset);
        let (device, offset) = moved.place(device, offset, *at, len);
        if (device, offset) == image_place {
            own.push((device, offset - at));
        }
        let blkaddr = u32::try_from(offset >> block_bits)
            .ok()
            .filter(|_| offset % (1 << block_bits) == 0)
            .ok_or_else(|| {
                SplitError::Unverified(format!("offset {offset} on device {device} is no block"))
            })?;
        out.push(ChunkAddr::Data { device, blkaddr });
    }
    Ok((out, own))
}

/// A file's fingerprint: by content for a file of one chunk, else by its
/// chunks; and where a file named by the bytes read was read.
fn file_fingerprint(
    inode: &Inode<'_>,
    addrs: &[Chunk],
    refs: &[ChunkRef],
    chunk_bits: u8,
    source: Source<'_, '_>,
) -> Result<(Fingerprint, Option<NamedRange>), SplitError> {
    let size = inode.size;
    let ([Chunk::Data { device, offset }], [Some((digest, at))]) = (addrs, refs) else {
        return Ok((fingerprint(size, chunk_bits, refs.to_vec()), None));
    };
    let stored = &source.tables[usize::from(*device) - 1].chunks_covering(*offset, 1)[0];
    if *at == 0 && u64::from(stored.size.get()) == size {
        return Ok((content_fingerprint(size, digest), None));
    }
    let len = usize::try_from(size).map_err(|_| SplitError::Unverified("size".into()))?;
    // Read where the shard will: a moved chunk is not in the image's file.
    let (read_device, read_offset) = source.moved.place(*device, *offset, *at, size);
    let Some(bytes) =
        (source.read)(read_device, read_offset, len).map_err(SplitError::Unverified)?
    else {
        return Ok((fingerprint(size, chunk_bits, refs.to_vec()), None));
    };
    if bytes.len() != len {
        return Err(SplitError::Unverified(format!(
            "nid {}: read {} of {len} bytes",
            inode.nid,
            bytes.len()
        )));
    }
    let digest = ring::digest::digest(&ring::digest::SHA256, &bytes);
    let sha256: [u8; 32] = digest.as_ref().try_into().expect("sha256 is 32 bytes");
    let named = NamedRange {
        device: read_device,
        offset: read_offset,
        len: size,
        sha256,
    };
    Ok((content_fingerprint(size, &sha256), Some(named)))
}

/// Each chunk's (stored chunk digest, offset in it), checked to lie
/// inside that stored chunk.
fn verified(
    inode: &Inode<'_>,
    addrs: &[Chunk],
    chunk_bits: u8,
    tables: &[IndexBlob],
) -> Result<Vec<ChunkRef>, SplitError> {
    let chunk_size = 1u64 << chunk_bits;
    let mut out = Vec::with_capacity(addrs.len());
    for (i, chunk) in addrs.iter().enumerate() {
        let Chunk::Data { device, offset } = *chunk else {
            out.push(None);
            continue;
        };
        let len = (inode.size - i as u64 * chunk_size).min(chunk_size);
        let table = &tables[usize::from(device) - 1];
        let stored = table.chunks_covering(offset, 1).first().filter(|c| {
            let (start, size) = (c.cache_offset.get(), u64::from(c.size.get()));
            offset >= start && offset + len <= start + size
        });
        let Some(stored) = stored else {
            return Err(SplitError::Unverified(format!(
                "nid {}: chunk {i} ({len} bytes at {offset} on device {device}) is not \
                 inside a stored chunk of the verified chunk table",
                inode.nid
            )));
        };
        out.push(Some((stored.digest, offset - stored.cache_offset.get())));
    }
    Ok(out)
}

/// The shard's tree as it is built: `/xx/<rest>` per fingerprint.
struct ShardTree {
    tree: Tree<FileChunks>,
    dirs: HashMap<u8, NodeId>,
    objects: BTreeMap<Fingerprint, NodeId>,
    named: Vec<NamedRange>,
    reads: Vec<(Fingerprint, u16, u64)>,
}

impl Default for ShardTree {
    fn default() -> Self {
        ShardTree {
            tree: Tree::new(),
            dirs: HashMap::new(),
            objects: BTreeMap::new(),
            named: Vec::new(),
            reads: Vec::new(),
        }
    }
}

impl ShardTree {
    /// Adds object `fp` reading `chunks`; false when the shard has it (it
    /// reads the first file's chunks).
    fn add(&mut self, fp: Fingerprint, size: u64, chunk_bits: u8, chunks: Vec<ChunkAddr>) -> bool {
        if self.objects.contains_key(&fp) {
            return false;
        }
        let fixed = |mode| Metadata {
            mode,
            ..Metadata::default()
        };
        let tree = &mut self.tree;
        let dir = *self.dirs.entry(fp[0]).or_insert_with(|| {
            let id = tree.add_node(Node {
                meta: fixed(0o755),
                kind: NodeKind::Directory {
                    entries: BTreeMap::new(),
                },
            });
            link(tree, tree.root, hex::encode([fp[0]]).as_bytes(), id);
            id
        });
        let file = tree.add_node(Node {
            meta: fixed(0o444),
            kind: NodeKind::Regular {
                size,
                content: FileChunks { chunk_bits, chunks },
            },
        });
        link(tree, dir, hex::encode(&fp[1..]).as_bytes(), file);
        self.objects.insert(fp, file);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::ChunkEntry;

    fn node(mode: u32, kind: NodeKind<FileChunks>) -> Node<FileChunks> {
        let meta = Metadata {
            mode,
            mtime: 7,
            ..Metadata::default()
        };
        Node { meta, kind }
    }

    fn file(size: u64, chunks: Vec<ChunkAddr>) -> NodeKind<FileChunks> {
        NodeKind::Regular {
            size,
            content: FileChunks {
                chunk_bits: 12,
                chunks,
            },
        }
    }

    fn at(blkaddr: u32) -> ChunkAddr {
        ChunkAddr::Data { device: 1, blkaddr }
    }

    /// One device whose stored chunks are blocks 0, 1 and 2-3 (a pack of
    /// 8 KiB), with digests 1, 2, 3.
    fn table() -> IndexBlob {
        let entry = |block: u64, size: u32, d: u8| ChunkEntry {
            cache_offset: (block * 4096).into(),
            compressed_offset: (block * 100).into(),
            compressed_size: size.into(),
            size: size.into(),
            flags: 0.into(),
            reserved: 0.into(),
            digest: [d; 32],
        };
        IndexBlob {
            digest: [9; 32],
            compressed_size: 300,
            cache_size: 4 * 4096,
            chunks: vec![entry(0, 4096, 1), entry(1, 4096, 2), entry(2, 8192, 3)],
        }
    }

    /// `a` and `b`: the same stored chunk; `c`: block 1; `packed`: the
    /// pack's second block; `holes`: no data; `a` carries the image's own
    /// overlay xattr.
    fn image(extra: Option<(&[u8], NodeKind<FileChunks>)>) -> Vec<u8> {
        let mut t: Tree<FileChunks> = Tree::new();
        let mut a = node(0o644, file(4096, vec![at(0)]));
        a.meta.xattrs.insert(
            b"trusted.overlay.redirect".to_vec(),
            b"/etc/shadow".to_vec(),
        );
        let mut files = vec![
            (&b"a"[..], a),
            (b"b", node(0o600, file(4096, vec![at(0)]))),
            (b"c", node(0o644, file(100, vec![at(1)]))),
            (b"packed", node(0o644, file(10, vec![at(3)]))),
            (b"holes", node(0o644, file(5000, vec![ChunkAddr::Hole; 2]))),
            (
                b"link",
                node(
                    0o777,
                    NodeKind::Symlink {
                        target: b"a".to_vec(),
                    },
                ),
            ),
        ];
        if let Some((name, kind)) = extra {
            files.push((name, node(0o644, kind)));
        }
        let root = t.root;
        for (name, n) in files {
            let id = t.add_node(n);
            link(&mut t, root, name, id);
        }
        let devices = [Device {
            tag: "blob".into(),
            blocks: 4,
        }];
        write_image(&t, &devices).unwrap().0
    }

    /// A device whose every byte in block `b` is `b`.
    fn by_block(_device: u16, offset: u64, len: usize) -> Result<Option<Vec<u8>>, String> {
        Ok(Some(vec![(offset / 4096) as u8; len]))
    }

    fn xattr(img: &Image<'_>, name: &[u8], key: &[u8]) -> Option<Vec<u8>> {
        let root = img.inode(img.root_nid()).unwrap();
        let e = img.lookup(&root, name).unwrap().unwrap();
        let inode = img.inode(e.nid).unwrap();
        let xattrs = img.xattrs(&inode).unwrap();
        xattrs
            .into_iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.to_vec())
    }

    #[test]
    fn the_view_redirects_each_file_to_one_object_per_content() {
        let bytes = image(None);
        let split = split(
            &Image::new(&bytes).unwrap(),
            &[table()],
            &Moved::default(),
            &mut by_block,
        )
        .unwrap();
        // a and b share one object; c and packed one each; holes none.
        assert_eq!(split.objects.len(), 3);
        // Each object reads its stored chunk: block 0, block 1, the pack.
        let mut chunks: Vec<(u16, u64)> = split.reads.iter().map(|r| (r.1, r.2)).collect();
        chunks.sort();
        assert_eq!(chunks, vec![(1, 0), (1, 4096), (1, 2 * 4096)]);
        let view = Image::new(&split.view).unwrap();
        assert!(view.devices().is_empty());
        let redirect = |name: &[u8]| xattr(&view, name, REDIRECT_XATTR);
        assert_eq!(redirect(b"a"), redirect(b"b"));
        assert_ne!(redirect(b"a"), redirect(b"c"));
        assert_eq!(redirect(b"holes"), None);
        assert_eq!(xattr(&view, b"a", METACOPY_XATTR), Some(Vec::new()));
        // The image's own overlay xattr is escaped, not obeyed.
        assert_eq!(
            xattr(&view, b"a", b"trusted.overlay.overlay.redirect"),
            Some(b"/etc/shadow".to_vec())
        );
        // The view holds no data; the shard's objects read the image's blocks.
        let root = view.inode(view.root_nid()).unwrap();
        let a = view
            .inode(view.lookup(&root, b"a").unwrap().unwrap().nid)
            .unwrap();
        assert_eq!((a.size, a.mode & 0o7777), (4096, 0o644));
        assert_eq!(view.chunks(&a).unwrap().get(0), Some(Chunk::Hole));
        let shard = Image::new(&split.shard).unwrap();
        assert_eq!(shard.devices().len(), 1);
        let path = String::from_utf8(redirect(b"packed").unwrap()).unwrap();
        let mut dir = shard.inode(shard.root_nid()).unwrap();
        for name in path.trim_start_matches('/').split('/') {
            dir = shard
                .inode(shard.lookup(&dir, name.as_bytes()).unwrap().unwrap().nid)
                .unwrap();
        }
        assert_eq!(dir.size, 10);
        let chunk = shard.chunks(&dir).unwrap().get(0);
        assert_eq!(
            chunk,
            Some(Chunk::Data {
                device: 1,
                offset: 3 * 4096
            })
        );
        assert_eq!(
            parse_objects(&objects_bytes(&split.objects)),
            Some(split.objects)
        );
    }

    #[test]
    fn moved_chunks_are_read_where_the_node_holds_them() {
        let bytes = image(None);
        let img = Image::new(&bytes).unwrap();
        let other = Device {
            tag: "other".into(),
            blocks: 16,
        };
        let moved = Moved {
            devices: vec![other],
            // a's chunk (block 0) and the pack (blocks 2-3) are elsewhere.
            chunks: HashMap::from([((1, 0), (2, 5 * 4096)), ((1, 2 * 4096), (2, 10 * 4096))]),
            ranges: HashMap::new(),
        };
        let mut reads = Vec::new();
        let mut read = |device: u16, offset: u64, len: usize| {
            reads.push((device, offset));
            by_block(device, offset, len)
        };
        let parts = split(&img, &[table()], &moved, &mut read).unwrap();
        // Files smaller than their stored chunk (c, packed) were named by
        // the bytes where the shard reads them.
        reads.sort();
        assert_eq!(reads, vec![(1, 4096), (2, 11 * 4096)]);
        // Of the image's own stored chunks, only c's is read here.
        let own: Vec<(u16, u64)> = parts.reads.iter().map(|r| (r.1, r.2)).collect();
        assert_eq!(own, vec![(1, 4096)]);
        let shard = Image::new(&parts.shard).unwrap();
        assert_eq!(shard.devices().len(), 2);
        let view = Image::new(&parts.view).unwrap();
        let chunk_of = |name: &[u8]| {
            let redirect = xattr(&view, name, REDIRECT_XATTR).unwrap();
            let path = String::from_utf8(redirect).unwrap();
            let mut dir = shard.inode(shard.root_nid()).unwrap();
            for part in path.trim_start_matches('/').split('/') {
                let nid = shard.lookup(&dir, part.as_bytes()).unwrap().unwrap().nid;
                dir = shard.inode(nid).unwrap();
            }
            shard.chunks(&dir).unwrap().get(0).unwrap()
        };
        let on = |device: u16, block: u64| Chunk::Data {
            device,
            offset: block * 4096,
        };
        assert_eq!(chunk_of(b"a"), on(2, 5));
        assert_eq!(chunk_of(b"packed"), on(2, 11));
        assert_eq!(chunk_of(b"c"), on(1, 1), "a chunk not moved stays");
        // A place that is no block is refused, not rounded.
        let odd = Moved {
            chunks: HashMap::from([((1, 0), (2, 100))]),
            ..moved
        };
        assert!(split(&img, &[table()], &odd, &mut by_block).is_err());
    }

    /// Packed files (`c` in block 1, `packed` in the pack's second block)
    /// are listed; a range moved is read there, for exactly that range.
    #[test]
    fn moved_ranges_are_read_there_for_exactly_that_range() {
        let bytes = image(None);
        let img = Image::new(&bytes).unwrap();
        let packed = packed_ranges(&img, &[table()]).unwrap();
        assert_eq!(packed, vec![(1, 4096, 100), (1, 3 * 4096, 10)]);
        let other = Device {
            tag: "other".into(),
            blocks: 16,
        };
        let moved = Moved {
            devices: vec![other],
            chunks: HashMap::new(),
            // `packed`'s 10 bytes, and 11 bytes at c's offset (not c's).
            ranges: HashMap::from([((1, 3 * 4096, 10), (2, 7 * 4096)), ((1, 4096, 11), (2, 0))]),
        };
        let mut reads = Vec::new();
        let mut read = |device: u16, offset: u64, len: usize| {
            reads.push((device, offset, len));
            by_block(device, offset, len)
        };
        let parts = split(&img, &[table()], &moved, &mut read).unwrap();
        reads.sort();
        assert_eq!(reads, vec![(1, 4096, 100), (2, 7 * 4096, 10)]);
        // Named where they were read, for the chunk locator.
        let at = |device, offset, len, b: u8| NamedRange {
            device,
            offset,
            len,
            sha256: ring::digest::digest(&ring::digest::SHA256, &vec![b; len as usize])
                .as_ref()
                .try_into()
                .unwrap(),
        };
        assert_eq!(
            parts.named,
            vec![at(1, 4096, 100, 1), at(2, 7 * 4096, 10, 7)]
        );
        let shard = Image::new(&parts.shard).unwrap();
        let chunks: Vec<Chunk> = parts
            .objects
            .iter()
            .map(|fp| {
                let path = object_path(fp);
                let mut dir = shard.inode(shard.root_nid()).unwrap();
                for part in path.trim_start_matches('/').split('/') {
                    let nid = shard.lookup(&dir, part.as_bytes()).unwrap().unwrap().nid;
                    dir = shard.inode(nid).unwrap();
                }
                shard.chunks(&dir).unwrap().get(0).unwrap()
            })
            .collect();
        let on = |device: u16, block: u64| Chunk::Data {
            device,
            offset: block * 4096,
        };
        assert!(chunks.contains(&on(2, 7)), "{chunks:?}");
        assert!(chunks.contains(&on(1, 1)), "c stays: {chunks:?}");
    }

    #[test]
    fn a_chunk_reading_past_its_stored_chunk_is_refused() {
        // Block 1's stored chunk is 4096 bytes; a 5000-byte read from it
        // would run into block 2, which its digest does not cover.
        let long = NodeKind::Regular {
            size: 5000,
            content: FileChunks {
                chunk_bits: 13,
                chunks: vec![at(1)],
            },
        };
        let bytes = image(Some((b"long", long)));
        let err = split(
            &Image::new(&bytes).unwrap(),
            &[table()],
            &Moved::default(),
            &mut by_block,
        )
        .unwrap_err();
        assert!(
            err.to_string().contains("not inside a stored chunk"),
            "{err}"
        );
        // Off the table's chunks altogether.
        let beyond = file(4096, vec![at(7)]);
        let bytes = image(Some((b"beyond", beyond)));
        assert!(split(
            &Image::new(&bytes).unwrap(),
            &[table()],
            &Moved::default(),
            &mut by_block
        )
        .is_err());
    }

    #[test]
    fn packed_files_are_named_by_the_bytes_read() {
        // `twin` is packed at the start of the pack, `packed` in its second
        // block: their packs' digests are one, their bytes differ.
        let twin = file(10, vec![at(2)]);
        let bytes = image(Some((b"twin", twin)));
        let img = Image::new(&bytes).unwrap();
        let split_by_block = split(&img, &[table()], &Moved::default(), &mut by_block).unwrap();
        assert_eq!(split_by_block.objects.len(), 4);
        // Equal bytes wherever they are packed: one object.
        let mut same = |_: u16, _: u64, len: usize| Ok(Some(vec![5u8; len]));
        let split_same = split(&img, &[table()], &Moved::default(), &mut same).unwrap();
        assert_eq!(split_same.objects.len(), 3);
        // Bytes not on the node: named by their packs, both in one pack.
        let mut absent = |_: u16, _: u64, _: usize| Ok(None);
        let split_absent = split(&img, &[table()], &Moved::default(), &mut absent).unwrap();
        assert_eq!(split_absent.objects.len(), 4);
        let absent_view = Image::new(&split_absent.view).unwrap();
        let by_block_view = Image::new(&split_by_block.view).unwrap();
        let redirect = |v: &Image<'_>, name: &[u8]| xattr(v, name, REDIRECT_XATTR);
        // A file that is its stored chunk whole is named by its bytes all the same.
        assert_eq!(redirect(&absent_view, b"a"), redirect(&by_block_view, b"a"));
        assert_ne!(
            redirect(&absent_view, b"packed"),
            redirect(&by_block_view, b"packed")
        );
        let view = Image::new(&split_same.view).unwrap();
        assert_eq!(
            xattr(&view, b"twin", REDIRECT_XATTR),
            xattr(&view, b"packed", REDIRECT_XATTR)
        );
        let mut failing = |_: u16, _: u64, _: usize| Err("cache file gone".to_string());
        let err = split(&img, &[table()], &Moved::default(), &mut failing).unwrap_err();
        assert!(err.to_string().contains("cache file gone"), "{err}");
    }

    #[test]
    fn fingerprints_bind_size_digests_and_offsets() {
        let base = fingerprint(10, 12, [Some(([1; 32], 0))]);
        assert_eq!(base, fingerprint(10, 12, [Some(([1; 32], 0))]));
        for other in [
            fingerprint(11, 12, [Some(([1; 32], 0))]),
            fingerprint(10, 13, [Some(([1; 32], 0))]),
            fingerprint(10, 12, [Some(([2; 32], 0))]),
            fingerprint(10, 12, [Some(([1; 32], 4096))]),
            fingerprint(10, 12, [None]),
        ] {
            assert_ne!(base, other);
        }
        assert_ne!(
            content_fingerprint(10, &[1; 32]),
            content_fingerprint(11, &[1; 32])
        );
        assert_ne!(
            content_fingerprint(10, &[1; 32]),
            content_fingerprint(10, &[2; 32])
        );
        assert_eq!(parse_objects(&[0; 31]), None);
        assert_eq!(parse_objects(&[[1u8; 32], [1; 32]].concat()), None);
    }
}
